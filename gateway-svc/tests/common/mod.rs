//! An engine as the gateway assembles it, on in-memory stores, for tests that drive calls
//! through it with tools of their choosing.

// Each test file uses a part of this.
#![allow(dead_code)]

pub(crate) mod upstream;

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use gateway_svc::{
    audit::AuditTrail,
    config::AuditQueueConfig,
    context::Services,
    credentials::{Credentials, NewAccount, cipher::TokenCipher},
    domain::{CallOutcome, CallRequest, Channel, Integration, UserId},
    engine::{Engine, EngineConfig},
    ratelimit::{Limits, RateLimiter, memory::MemoryRateLimits},
    registry::{Registry, Tool},
    store::{AccountStatus, Stores},
};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub(crate) fn user() -> UserId {
    UserId::parse("u1").unwrap()
}

/// Connects the test user's `account` of `integration`, its access token `token` valid for an
/// hour.
pub(crate) async fn connect(engine: &Engine, integration: Integration, account: &str, token: &str) {
    engine
        .services
        .credentials
        .connect(
            &user(),
            NewAccount {
                integration,
                account: account.into(),
                access_token: token.into(),
                refresh_token: Some(format!("refresh-{token}")),
                expires_at: Some(SystemTime::now() + Duration::from_secs(3600)),
                scopes: Vec::new(),
            },
        )
        .await
        .unwrap();
}

/// Marks the test user's connected `account` as needing reconnection, as a refused refresh
/// would.
pub(crate) async fn needs_reconnect(stores: &Stores, integration: Integration, account: &str) {
    let mut stored = stores
        .accounts
        .get_account(&user(), integration, account)
        .await
        .unwrap()
        .unwrap();
    stored.status = AccountStatus::NeedsReconnect;
    stores.accounts.upsert_account(stored).await.unwrap();
}

pub(crate) fn engine(stores: &Stores, tools: Vec<Arc<dyn Tool>>) -> Engine {
    engine_with_limits(stores, tools, None)
}

/// [`engine`], every integration's calls limited by `limits` per user and account.
pub(crate) fn engine_with_limits(
    stores: &Stores,
    tools: Vec<Arc<dyn Tool>>,
    limits: Option<Limits>,
) -> Engine {
    let http = gateway_svc::context::upstream_client(Duration::from_secs(10)).unwrap();
    let services = Arc::new(Services {
        credentials: Credentials::new(
            stores.accounts.clone(),
            Some(TokenCipher::ephemeral()),
            None,
            http.clone(),
        ),
        limiter: RateLimiter::new(Arc::new(MemoryRateLimits::default()), move |_| {
            limits.clone()
        }),
        http,
        audit: AuditTrail::start(stores.audit.clone(), &AuditQueueConfig::default()),
        max_body_bytes: 1 << 20,
    });
    Engine {
        registry: Arc::new(Registry::new(tools).unwrap()),
        services,
        idempotency: stores.idempotency.clone(),
        config: EngineConfig {
            max_result_chars: 6000,
            default_timeout: Duration::from_secs(10),
            max_timeout: Duration::from_secs(10),
            idempotency_retention: Duration::from_secs(7 * 86_400),
        },
        in_flight: Arc::default(),
    }
}

/// One call by the test user, with idempotency key `key`.
pub(crate) async fn call(
    engine: &Engine,
    call_id: &str,
    tool: &str,
    args: Value,
    key: &str,
) -> CallOutcome {
    call_in_zone(engine, call_id, tool, args, key, None).await
}

/// As [`call`], made by a run in the user's zone `time_zone`.
pub(crate) async fn call_in_zone(
    engine: &Engine,
    call_id: &str,
    tool: &str,
    args: Value,
    key: &str,
    time_zone: Option<jiff::tz::TimeZone>,
) -> CallOutcome {
    engine
        .execute(
            &user(),
            request(call_id, tool, args, key, time_zone),
            CancellationToken::new(),
        )
        .await
}

/// A web call of `tool` by a run in `time_zone` (none: not known), as the Execute stream
/// would bring it: to execute, or to preview.
pub(crate) fn request(
    call_id: &str,
    tool: &str,
    args: Value,
    key: &str,
    time_zone: Option<jiff::tz::TimeZone>,
) -> CallRequest {
    CallRequest {
        call_id: call_id.into(),
        tool: tool.into(),
        args,
        idempotency_key: Some(key.into()),
        channel: Channel::Web,
        timeout: None,
        run_id: None,
        read_external_from: Vec::new(),
        expected_binding: None,
        time_zone,
    }
}
