//! gateway-svc core enforcement (issue 3; G-1..G-9, P-4), end to end over gRPC against fake
//! upstreams on loopback and a real PostgreSQL.

use std::{collections::HashMap, time::Duration};

use steward_proto::gateway::v1::{self as pb, tool_call::Arguments};
use steward_tests::{
    Backend, Options, SERVICE_TOKEN, TestDb, UserGateway, channel, env,
    fakes::{oauth::FakeOAuth, probe::FakeProbe},
    gateway_as, probe_tools,
    spawn::spawn,
    start_gateway_with, wait_for_status,
};
use tokio_stream::StreamExt;

const ACCOUNT: &str = "work@example.com";

fn call(call_id: &str, tool: &str, args: serde_json::Value) -> pb::ToolCall {
    pb::ToolCall {
        call_id: call_id.into(),
        tool: tool.into(),
        arguments: Some(Arguments::ArgsJson(args.to_string())),
        ..Default::default()
    }
}

async fn execute(gateway: &mut UserGateway, call: pb::ToolCall) -> pb::ToolResult {
    gateway
        .execute_tool(pb::ExecuteToolRequest { call: Some(call) })
        .await
        .expect("the RPC succeeds even when the tool fails")
        .into_inner()
        .result
        .expect("a result")
}

async fn connect(gateway: &mut UserGateway, access: &str, expires_in_secs: i64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    gateway
        .connect_account(pb::ConnectAccountRequest {
            integration: pb::Integration::Gmail as i32,
            account: ACCOUNT.into(),
            access_token: access.into(),
            refresh_token: "refresh-secret-1".into(),
            expires_at: Some(prost_types::Timestamp {
                seconds: now + expires_in_secs,
                nanos: 0,
            }),
            scopes: vec!["gmail.readonly".into()],
        })
        .await
        .expect("connect the account");
}

struct World {
    app: steward_tests::TestApp,
    probe: FakeProbe,
    oauth: FakeOAuth,
}

async fn world(backend: Backend, env: &[(&str, &str)]) -> World {
    let probe = FakeProbe::start().await;
    let oauth = FakeOAuth::start().await;
    let mut all_env = vec![
        ("GOOGLE_CLIENT_ID".to_owned(), "client-id".to_owned()),
        (
            "GOOGLE_CLIENT_SECRET".to_owned(),
            "client-secret".to_owned(),
        ),
        ("GOOGLE_OAUTH_TOKEN_URL".to_owned(), oauth.url.clone()),
        (
            "CREDENTIALS_KEY".to_owned(),
            "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=".to_owned(),
        ),
    ];
    all_env.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let app = spawn(Options {
        backend: Some(backend),
        env: all_env,
        gateway_tools: probe_tools::all(&probe.url),
    })
    .await;
    World { app, probe, oauth }
}

#[tokio::test]
async fn schema_invalid_arguments_never_reach_upstream_and_the_model_reads_why() {
    let w = world(Backend::Postgres, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    for (id, args) in [
        ("c1", serde_json::json!({})),
        ("c2", serde_json::json!({"path": "no-slash"})),
        ("c3", serde_json::json!({"path": "/data", "extra": 1})),
    ] {
        let r = execute(&mut g, call(id, "probe_fetch", args)).await;
        assert!(!r.ok);
        assert_eq!(r.error_kind, pb::ErrorKind::InvalidArguments as i32);
        assert!(
            r.text.starts_with("Invalid arguments for probe_fetch:"),
            "{}",
            r.text
        );
        assert_eq!(r.upstream_calls, 0);
    }
    assert_eq!(w.probe.request_count(), 0, "nothing reached upstream");
}

#[tokio::test]
async fn g4_a_call_or_account_the_gateway_cannot_honour_as_sent_is_refused_by_name_not_adjusted() {
    let w = world(Backend::Postgres, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let mut negative = call("c1", "probe_fetch", serde_json::json!({"path": "/data"}));
    negative.timeout = Some(prost_types::Duration {
        seconds: -5,
        nanos: 0,
    });
    let mut unknown_channel = call("c2", "probe_fetch", serde_json::json!({"path": "/data"}));
    unknown_channel.channel = 99;
    let mut provenance = call("c3", "probe_fetch", serde_json::json!({"path": "/data"}));
    provenance.read_external_from = vec!["search_gmail".into(), "  ".into()];
    // A Struct number JSON cannot hold (it became null).
    let mut nan = call("c4", "probe_fetch", serde_json::json!({}));
    nan.arguments = Some(Arguments::Args(prost_types::Struct {
        fields: [(
            "path".to_owned(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::NumberValue(f64::NAN)),
            },
        )]
        .into(),
    }));
    for (bad, field) in [
        (negative, "timeout"),
        (unknown_channel, "channel 99"),
        (provenance, "read_external_from"),
        (nan, "argument path is not a finite number"),
    ] {
        let r = execute(&mut g, bad).await;
        assert_eq!(
            r.error_kind,
            pb::ErrorKind::InvalidArguments as i32,
            "{}",
            r.text
        );
        assert!(r.text.contains(field), "{field}: {}", r.text);
        assert_eq!(r.upstream_calls, 0);
    }
    assert_eq!(w.probe.request_count(), 0, "nothing reached upstream");

    for (expires_at, account, field) in [
        (Some((-1, 0)), ACCOUNT, "expires_at"),
        (Some((100_000_000_000_000, 0)), ACCOUNT, "expires_at"),
        (None, "work\0@example.com", "account"),
    ] {
        let refused = g
            .connect_account(pb::ConnectAccountRequest {
                integration: pb::Integration::Gmail as i32,
                account: account.into(),
                access_token: "a".into(),
                expires_at: expires_at
                    .map(|(seconds, nanos)| prost_types::Timestamp { seconds, nanos }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::InvalidArgument,
            "{}",
            refused.message()
        );
        assert!(refused.message().contains(field), "{}", refused.message());
    }
    let blank = g
        .disconnect_account(pb::DisconnectAccountRequest {
            integration: pb::Integration::Gmail as i32,
            account: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        blank.code(),
        tonic::Code::InvalidArgument,
        "{}",
        blank.message()
    );
}

#[tokio::test]
async fn a_fifty_kilobyte_result_comes_back_capped_with_the_exact_notice() {
    let w = world(Backend::Memory, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let r = execute(
        &mut g,
        call(
            "c1",
            "probe_fetch",
            serde_json::json!({"path": "/data?size=51200"}),
        ),
    )
    .await;
    assert!(r.ok, "{}", r.text);
    assert!(r.truncated);
    assert_eq!(r.original_chars, 51_200);
    assert!(
        r.text
            .ends_with("[... truncated: showing first 6000 of 51200 chars]"),
        "{}",
        &r.text[5990..]
    );
    assert_eq!(r.text.chars().filter(|&c| c == 'x').count(), 6000);
}

#[tokio::test]
async fn multi_byte_text_is_cut_on_a_character_boundary() {
    let w = world(Backend::Memory, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    // 7000 crabs: 28,000 bytes of 4-byte characters.
    let r = execute(
        &mut g,
        call(
            "c1",
            "probe_fetch",
            serde_json::json!({"path": "/data?size=7000&unit=%F0%9F%A6%80"}),
        ),
    )
    .await;
    assert!(r.truncated);
    assert_eq!(r.original_chars, 7000);
    let kept = r.text.split('\n').next().unwrap();
    assert_eq!(kept, "🦀".repeat(6000));
}

#[tokio::test]
async fn upstream_bodies_over_the_byte_cap_are_refused_not_buffered() {
    let w = world(Backend::Memory, &[("UPSTREAM_MAX_BODY_BYTES", "64KiB")]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let r = execute(
        &mut g,
        call(
            "c1",
            "probe_fetch",
            serde_json::json!({"path": "/data?size=200000"}),
        ),
    )
    .await;
    assert!(!r.ok);
    assert_eq!(r.error_kind, pb::ErrorKind::UpstreamError as i32);
    assert!(r.text.contains("larger than 65536 bytes"), "{}", r.text);
}

/// Waits out the last seconds of a minute so a test of a per-minute window runs inside one.
async fn inside_one_minute() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    if now % 60 > 50 {
        tokio::time::sleep(Duration::from_secs(61 - now % 60)).await;
    }
}

#[tokio::test]
async fn a_hundred_concurrent_calls_across_three_gateways_sharing_postgres_allow_exactly_thirty() {
    let db = TestDb::create().await.unwrap();
    let env: HashMap<String, String> = HashMap::from([
        ("DATABASE_URL".into(), db.url().to_owned()),
        ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
        ("RATE_LIMIT_BACKEND".into(), "postgres".into()),
        (
            "CREDENTIALS_KEY".into(),
            "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=".into(),
        ),
    ]);
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push(
            start_gateway_with(&env, probe_tools::all("http://127.0.0.1:9"))
                .await
                .unwrap(),
        );
    }
    let mut clients = Vec::new();
    for g in &gateways {
        clients.push(gateway_as(g.addr, "u1").await);
    }
    // A charge is made only for an account that can be used (its token resolves).
    connect(&mut clients[0], "access-1", 3600).await;
    inside_one_minute().await;
    let calls = (0..100).map(|i| {
        let mut client = clients[i % 3].clone();
        async move {
            execute(
                &mut client,
                call(
                    &format!("c{i}"),
                    "probe_charge",
                    serde_json::json!({"account": ACCOUNT}),
                ),
            )
            .await
        }
    });
    let results = futures_join_all(calls).await;
    let allowed = results.iter().filter(|r| r.ok).count();
    assert_eq!(
        allowed,
        30,
        "{:?}",
        results.iter().map(|r| &r.text).take(3).collect::<Vec<_>>()
    );
    let denied: Vec<_> = results.iter().filter(|r| !r.ok).collect();
    assert_eq!(denied.len(), 70);
    for r in denied {
        assert_eq!(r.error_kind, pb::ErrorKind::RateLimited as i32);
        assert!(
            r.text
                .starts_with("Gmail rate limit reached (30/minute). Try again in "),
            "{}",
            r.text
        );
        assert!(r.text.ends_with(" seconds."));
        assert!((1..=60).contains(&r.retry_after_seconds));
    }
    for g in &mut gateways {
        g.stop().await.unwrap();
    }
}

async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("task"));
    }
    out
}

#[tokio::test]
async fn ten_concurrent_calls_on_an_expired_token_cause_exactly_one_refresh() {
    let w = world(Backend::Postgres, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "expired-access", -10).await;
    w.probe.accept_only(&["fresh-access-1"]);
    let calls = (0..10).map(|i| {
        let mut g = g.clone();
        async move {
            execute(
                &mut g,
                call(
                    &format!("c{i}"),
                    "probe_fetch",
                    serde_json::json!({"path": "/data?size=3"}),
                ),
            )
            .await
        }
    });
    let results = futures_join_all(calls).await;
    assert!(
        results.iter().all(|r| r.ok && r.text == "xxx"),
        "{results:?}"
    );
    assert_eq!(w.oauth.refreshes(), 1);
    assert!(w.probe.tokens_seen().iter().all(|t| t == "fresh-access-1"));
    assert_eq!(
        *w.oauth.state.seen_refresh_tokens.lock().unwrap(),
        vec!["refresh-secret-1".to_owned()]
    );
}

#[tokio::test]
async fn a_401_refreshes_once_and_retries_once() {
    let w = world(Backend::Memory, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "stale-but-unexpired", 3600).await;
    w.probe.accept_only(&["fresh-access-1"]);
    let r = execute(
        &mut g,
        call(
            "c1",
            "probe_fetch",
            serde_json::json!({"path": "/data?size=2"}),
        ),
    )
    .await;
    assert!(r.ok, "{}", r.text);
    assert_eq!(r.upstream_calls, 2);
    assert_eq!(w.oauth.refreshes(), 1);
    assert_eq!(
        w.probe.tokens_seen(),
        ["stale-but-unexpired", "fresh-access-1"]
    );
}

/// G-8: a token refused even after it was refreshed means the grant gives no access any more:
/// the model is told to reconnect, the account says so, and later calls fail at once instead of
/// refreshing and calling upstream twice each time.
#[tokio::test]
async fn a_refreshed_token_that_is_refused_too_marks_the_account_for_reconnection() {
    for backend in [Backend::Memory, Backend::Postgres] {
        let w = world(backend, &[]).await;
        let mut g = w.app.gateway_as("u1").await;
        connect(&mut g, "stale-but-unexpired", 3600).await;
        w.probe.accept_only(&["a-token-never-issued"]);
        let probe = |id: &str| {
            call(
                id,
                "probe_fetch",
                serde_json::json!({"path": "/data?size=2"}),
            )
        };
        let r = execute(&mut g, probe("c1")).await;
        assert_eq!(
            (r.ok, r.error_kind, r.text.as_str()),
            (
                false,
                pb::ErrorKind::CredentialsRevoked as i32,
                "Your Google account work@example.com needs to be reconnected."
            ),
            "{backend:?}"
        );
        assert_eq!(w.oauth.refreshes(), 1, "{backend:?}");
        let accounts = g
            .list_accounts(pb::ListAccountsRequest {})
            .await
            .unwrap()
            .into_inner()
            .accounts;
        assert_eq!(
            accounts[0].status,
            pb::AccountStatus::NeedsReconnect as i32,
            "{backend:?}: the account says what the model was told"
        );

        let again = execute(&mut g, probe("c2")).await;
        assert_eq!(
            again.error_kind,
            pb::ErrorKind::CredentialsRevoked as i32,
            "{backend:?}"
        );
        assert_eq!(
            (w.probe.request_count(), w.oauth.refreshes()),
            (2, 1),
            "{backend:?}: nothing more was sent or refreshed"
        );
    }
}

#[tokio::test]
async fn a_revoked_refresh_token_asks_for_reconnection_and_marks_the_account() {
    let w = world(Backend::Postgres, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "expired-access", -10).await;
    w.oauth.set_revoked(true);
    let r = execute(
        &mut g,
        call(
            "c1",
            "probe_fetch",
            serde_json::json!({"path": "/data?size=2"}),
        ),
    )
    .await;
    assert!(!r.ok);
    assert_eq!(r.error_kind, pb::ErrorKind::CredentialsRevoked as i32);
    assert_eq!(
        r.text,
        "Your Google account work@example.com needs to be reconnected."
    );
    let accounts = g
        .list_accounts(pb::ListAccountsRequest {})
        .await
        .unwrap()
        .into_inner()
        .accounts;
    assert_eq!(accounts[0].status, pb::AccountStatus::NeedsReconnect as i32);
    assert_eq!(w.probe.request_count(), 0);
}

/// G-6, G-8: a call that cannot be made for want of credentials costs no budget — the
/// account's token is resolved before the charge, not after it.
#[tokio::test]
async fn g6_a_call_refused_for_its_credentials_spends_no_rate_limit_budget() {
    let w = world(Backend::Postgres, &[("RATE_LIMITS_GMAIL", "2/minute")]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "expired-access", -10).await;
    w.oauth.set_revoked(true);
    let fetch = |id: &str| {
        call(
            id,
            "probe_fetch",
            serde_json::json!({"path": "/data?size=1"}),
        )
    };
    let refused = execute(&mut g, fetch("c1")).await;
    assert_eq!(
        refused.error_kind,
        pb::ErrorKind::CredentialsRevoked as i32,
        "{}",
        refused.text
    );

    // Reconnected: the minute's two calls are both still there.
    w.oauth.set_revoked(false);
    connect(&mut g, "access-2", 3600).await;
    for id in ["c2", "c3"] {
        let r = execute(&mut g, fetch(id)).await;
        assert!(r.ok, "{id}: {}", r.text);
    }
    let third = execute(&mut g, fetch("c4")).await;
    assert_eq!(
        third.error_kind,
        pb::ErrorKind::RateLimited as i32,
        "{}",
        third.text
    );
    assert_eq!(w.probe.request_count(), 2);
}

#[tokio::test]
async fn no_connected_account_is_a_clear_result_and_the_tool_is_not_offered() {
    let w = world(Backend::Memory, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    let r = execute(
        &mut g,
        call(
            "c1",
            "probe_fetch",
            serde_json::json!({"path": "/data?size=2"}),
        ),
    )
    .await;
    assert_eq!(r.error_kind, pb::ErrorKind::CredentialsMissing as i32);
    assert!(
        r.text.starts_with("No Gmail account is connected."),
        "{}",
        r.text
    );
    let tools = g
        .list_tools(pb::ListToolsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .tools;
    let names: Vec<_> = tools.iter().map(|t| t.name.as_str()).collect();
    assert!(
        !names
            .iter()
            .any(|n| ["probe_fetch", "probe_send", "probe_charge"].contains(n)),
        "{names:?}"
    );
    assert!(
        names.contains(&"probe_echo") && names.contains(&"list_tasks"),
        "tools that need no account stay"
    );
    let without_account = tools.len();
    connect(&mut g, "a", 3600).await;
    let tools = g
        .list_tools(pb::ListToolsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .tools;
    // The Gmail account unlocks the three Gmail probes and the six Gmail tools.
    assert_eq!(tools.len(), without_account + 3 + 6);
    assert!(
        tools
            .iter()
            .any(|t| t.name == "search_gmail" && t.aliases == ["gmail_search"])
    );
    let send = tools.iter().find(|t| t.name == "probe_send").unwrap();
    assert!(send.side_effect);
    assert!(send.parameters_json_schema.contains("\"required\""));
}

fn list_request(known: impl IntoIterator<Item = impl Into<String>>) -> pb::ListToolsRequest {
    pb::ListToolsRequest {
        known_fingerprints: known.into_iter().map(Into::into).collect(),
        ..Default::default()
    }
}

/// Issue 13: a caller that holds the user's list gets its fingerprint back, not the list; a
/// list that changed (an account connected) is sent whole whatever the caller names.
#[tokio::test]
async fn list_tools_answers_unchanged_only_for_a_list_the_caller_holds() {
    let w = world(Backend::Memory, &[]).await;
    let mut u1 = w.app.gateway_as("u1").await;
    let mut u2 = w.app.gateway_as("u2").await;
    let first = u1
        .list_tools(pb::ListToolsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(!first.unchanged && !first.tools.is_empty());
    assert_eq!(first.fingerprint.len(), 32, "{}", first.fingerprint);

    // Another user with the same integrations has the same list.
    let held = u2
        .list_tools(list_request(["0123", first.fingerprint.as_str()]))
        .await
        .unwrap()
        .into_inner();
    assert!(held.unchanged && held.tools.is_empty());
    assert_eq!(held.fingerprint, first.fingerprint);

    connect(&mut u1, "a", 3600).await;
    let changed = u1
        .list_tools(list_request([first.fingerprint.as_str()]))
        .await
        .unwrap()
        .into_inner();
    assert!(!changed.unchanged);
    assert_eq!(changed.tools.len(), first.tools.len() + 3 + 6);
    assert_ne!(changed.fingerprint, first.fingerprint);

    let named = u1
        .list_tools(list_request((0..16).map(|i| format!("f{i}"))))
        .await
        .expect("sixteen are accepted");
    assert!(!named.into_inner().unchanged);
    let long = "f".repeat(65);
    let refused = u1.list_tools(list_request([long])).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("at most 64"),
        "{}",
        refused.message()
    );
    let refused = u1
        .list_tools(list_request((0..17).map(|i| format!("f{i}"))))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("at most 16"),
        "{}",
        refused.message()
    );
}

#[tokio::test]
async fn a_repeated_idempotency_key_calls_upstream_once() {
    let w = world(Backend::Postgres, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let mut send = call(
        "c1",
        "probe_send",
        serde_json::json!({"to": "boss@example.com"}),
    );
    send.idempotency_key = "approval-123".into();
    let first = execute(&mut g, send.clone()).await;
    send.call_id = "c2".into();
    let second = execute(&mut g, send.clone()).await;
    assert!(first.ok && second.ok, "{} | {}", first.text, second.text);
    assert_eq!(first.text, "sent message #1");
    assert_eq!(second.text, "sent message #1");
    assert!(!first.replayed && second.replayed);
    assert_eq!(second.call_id, "c2");
    assert_eq!(w.probe.sends(), 1);

    send.arguments = Some(Arguments::ArgsJson(
        r#"{"to":"someone-else@example.com"}"#.into(),
    ));
    let reused = execute(&mut g, send).await;
    assert_eq!(reused.error_kind, pb::ErrorKind::InvalidArguments as i32);
    assert!(
        reused.text.contains("already used for a different call"),
        "{}",
        reused.text
    );

    let no_key = execute(
        &mut g,
        call("c4", "probe_send", serde_json::json!({"to": "x@y"})),
    )
    .await;
    assert!(
        no_key.text.contains("need an idempotency_key"),
        "{}",
        no_key.text
    );
    assert_eq!(w.probe.sends(), 1);
}

/// R-3, P-4: a unary ExecuteTool caller that goes away once the send has reached upstream (its
/// deadline, a dropped connection) cancels the call instead of dropping it mid-flight. The key
/// then holds "it may have taken effect", so a retry replays that rather than sending again;
/// while the call runs, LookupCall says it is still running (UNAVAILABLE: ask again) rather
/// than "not found".
async fn a_side_effect_whose_caller_leaves_after_the_send_left_is_never_sent_twice(b: Backend) {
    let w = world(b, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let mut send = call(
        "c1",
        "probe_send",
        serde_json::json!({"to": "boss@example.com", "slow": true}),
    );
    send.idempotency_key = "approval-lost-reply".into();
    let started = w.probe.state.slow_started.notified();
    let dropped = w.probe.state.slow_dropped.notified();
    let first = {
        let (mut g, send) = (g.clone(), send.clone());
        tokio::spawn(async move { execute(&mut g, send).await })
    };
    started.await;
    let looked_up = g
        .lookup_call(pb::LookupCallRequest {
            idempotency_key: "approval-lost-reply".into(),
            made_at: None,
        })
        .await
        .expect_err("a call in flight is not reported as never run");
    assert_eq!(looked_up.code(), tonic::Code::Unavailable, "{looked_up:?}");
    assert!(
        looked_up.message().contains("still running"),
        "{looked_up:?}"
    );

    first.abort();
    dropped.await;
    send.call_id = "c2".into();
    let retried = tokio::time::timeout(Duration::from_secs(10), execute(&mut g, send))
        .await
        .expect("the retry replays the stored outcome instead of waiting on a second send");
    assert!(retried.replayed, "{retried:?}");
    assert_eq!(retried.error_kind, pb::ErrorKind::Cancelled as i32);
    assert!(
        retried.text.contains("may have taken effect"),
        "{}",
        retried.text
    );
    assert_eq!(w.probe.sends(), 1, "sent once, never twice");
    let recorded = g
        .lookup_call(pb::LookupCallRequest {
            idempotency_key: "approval-lost-reply".into(),
            made_at: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(recorded.found);
}

/// R-3, P-4: a key not found is "never ran" only for a call recent enough that its record
/// would still be kept; for one made longer ago than IDEMPOTENCY_RETENTION the record may have
/// been swept after the call completed, so LookupCall says it may have taken effect.
async fn a_lookup_of_a_call_older_than_the_retention_never_says_it_never_ran(b: Backend) {
    let w = world(b, &[("IDEMPOTENCY_RETENTION", "2d")]).await;
    let mut g = w.app.gateway_as("u1").await;
    let asked = |days: u64| pb::LookupCallRequest {
        idempotency_key: "run-1/call_1".into(),
        made_at: Some((std::time::SystemTime::now() - Duration::from_secs(days * 86_400)).into()),
    };
    let recent = g.lookup_call(asked(1)).await.unwrap().into_inner();
    assert!(
        !recent.found,
        "made a day ago and not recorded: it never ran"
    );
    let old = g
        .lookup_call(asked(3))
        .await
        .expect_err("made three days ago: its record may have been swept");
    assert_eq!(old.code(), tonic::Code::Aborted, "{old:?}");
    assert!(
        old.message().contains("IDEMPOTENCY_RETENTION")
            && old.message().contains("may have taken effect"),
        "{old:?}"
    );
}

#[tokio::test]
async fn in_memory_a_lookup_of_a_call_older_than_the_retention_never_says_it_never_ran() {
    a_lookup_of_a_call_older_than_the_retention_never_says_it_never_ran(Backend::Memory).await;
}

#[tokio::test]
async fn on_postgres_a_lookup_of_a_call_older_than_the_retention_never_says_it_never_ran() {
    a_lookup_of_a_call_older_than_the_retention_never_says_it_never_ran(Backend::Postgres).await;
}

#[tokio::test]
async fn in_memory_a_side_effect_whose_caller_leaves_after_the_send_left_is_never_sent_twice() {
    a_side_effect_whose_caller_leaves_after_the_send_left_is_never_sent_twice(Backend::Memory)
        .await;
}

#[tokio::test]
async fn on_postgres_a_side_effect_whose_caller_leaves_after_the_send_left_is_never_sent_twice() {
    a_side_effect_whose_caller_leaves_after_the_send_left_is_never_sent_twice(Backend::Postgres)
        .await;
}

#[tokio::test]
async fn dropping_the_execute_stream_cancels_a_slow_upstream_call() {
    let w = world(Backend::Memory, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut results = g
        .execute(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let started = w.probe.state.slow_started.notified();
    let dropped = w.probe.state.slow_dropped.notified();
    tx.send(pb::ExecuteRequest {
        kind: Some(pb::execute_request::Kind::Call(call(
            "slow",
            "probe_fetch",
            serde_json::json!({"path": "/slow"}),
        ))),
    })
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(10), started)
        .await
        .expect("the slow call reached upstream");
    drop(results.next());
    drop(results);
    drop(tx);
    tokio::time::timeout(Duration::from_secs(10), dropped)
        .await
        .expect("the upstream request was dropped");
}

#[tokio::test]
async fn the_execute_stream_runs_calls_concurrently_and_correlates_results_by_call_id() {
    let w = world(Backend::Memory, &[]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut results = g
        .execute(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let send = |c: pb::ToolCall| pb::ExecuteRequest {
        kind: Some(pb::execute_request::Kind::Call(c)),
    };
    tx.send(send(call(
        "slow",
        "probe_fetch",
        serde_json::json!({"path": "/slow"}),
    )))
    .await
    .unwrap();
    tx.send(send(call(
        "fast",
        "probe_echo",
        serde_json::json!({"text": "hi"}),
    )))
    .await
    .unwrap();
    tx.send(send(call("bad", "no_such_tool", serde_json::json!({}))))
        .await
        .unwrap();
    let mut first_two = Vec::new();
    for _ in 0..2 {
        first_two.push(results.next().await.unwrap().unwrap().result.unwrap());
    }
    first_two.sort_by(|a, b| a.call_id.cmp(&b.call_id));
    assert_eq!(first_two[0].call_id, "bad");
    assert_eq!(first_two[0].error_kind, pb::ErrorKind::UnknownTool as i32);
    assert_eq!(first_two[1].call_id, "fast");
    assert_eq!(first_two[1].text, "hi");
    // Cancelling one call answers it with CANCELLED; closing the request side then ends the stream.
    tx.send(pb::ExecuteRequest {
        kind: Some(pb::execute_request::Kind::Cancel(pb::CancelCall {
            call_id: "slow".into(),
        })),
    })
    .await
    .unwrap();
    let cancelled = results.next().await.unwrap().unwrap().result.unwrap();
    assert_eq!(
        (cancelled.call_id.as_str(), cancelled.error_kind),
        ("slow", pb::ErrorKind::Cancelled as i32)
    );
    drop(tx);
    assert!(results.next().await.is_none());
}

#[tokio::test]
async fn upstream_failures_become_clear_results() {
    let w = world(Backend::Memory, &[("TOOL_CALL_TIMEOUT", "300ms")]).await;
    let mut g = w.app.gateway_as("u1").await;
    connect(&mut g, "access-1", 3600).await;
    let cases = [
        (
            "/status/429",
            pb::ErrorKind::RateLimited,
            "Gmail is rate limiting requests. Try again in 42 seconds.",
        ),
        (
            "/status/500",
            pb::ErrorKind::UpstreamError,
            // The upstream's own words stay in the logs (issue 14).
            "Gmail returned an error (HTTP 500). It may work if tried again later.",
        ),
        (
            "/status/403",
            pb::ErrorKind::PermissionDenied,
            // The account is named, so the user knows which one to look at.
            "Gmail refused the request for work@example.com: permission denied;",
        ),
        (
            "/status/403?reason=insufficientPermissions",
            pb::ErrorKind::PermissionDenied,
            "Gmail refused the request for work@example.com: permission denied (insufficientPermissions);",
        ),
        // Google says "rate limit" with a 403: a limit to wait out, not a permission.
        (
            "/status/403?reason=userRateLimitExceeded",
            pb::ErrorKind::RateLimited,
            "Gmail is rate limiting requests. Try again in 42 seconds.",
        ),
        (
            "/status/403?reason=dailyLimitExceeded",
            pb::ErrorKind::RateLimited,
            "Gmail is rate limiting requests. Try again in 3600 seconds.",
        ),
        // A request the upstream refuses as it is is not worth sending again unchanged.
        (
            "/status/400?reason=invalidArgument",
            pb::ErrorKind::UpstreamError,
            "Gmail rejected the request (HTTP 400, invalidArgument). Sending it again unchanged will fail the same way;",
        ),
        (
            "/slow",
            pb::ErrorKind::UpstreamTimeout,
            "Gmail did not answer within 1 seconds.",
        ),
    ];
    for (path, kind, text) in cases {
        let r = execute(
            &mut g,
            call("c", "probe_fetch", serde_json::json!({ "path": path })),
        )
        .await;
        assert_eq!(r.error_kind, kind as i32, "{path}: {}", r.text);
        assert!(r.text.starts_with(text), "{path}: {}", r.text);
    }
    let r = execute(
        &mut g,
        call(
            "c",
            "probe_fetch",
            serde_json::json!({"path": "/status/429"}),
        ),
    )
    .await;
    assert_eq!(r.retry_after_seconds, 42);
}

#[tokio::test]
async fn calls_without_the_service_token_or_a_user_are_unauthenticated() {
    let w = world(Backend::Memory, &[]).await;
    let mut anonymous = w.app.gateway.clone();
    let err = anonymous
        .list_tools(pb::ListToolsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(err.message().contains("authorization"), "{}", err.message());
}

/// A gateway on a fresh PostgreSQL database with the probe tools, run by the test itself so
/// it can reach the gateway's audit trail (to flush it before reading the table).
struct OwnGateway {
    db: TestDb,
    audit: std::sync::Arc<gateway_svc::audit::AuditTrail>,
    addr: std::net::SocketAddr,
    _probe: FakeProbe,
}

async fn own_gateway() -> OwnGateway {
    let probe = FakeProbe::start().await;
    let db = TestDb::create().await.unwrap();
    let vars = env(&[
        ("DATABASE_URL", db.url()),
        ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
        ("GATEWAY_SERVICE_TOKEN", SERVICE_TOKEN),
        (
            "CREDENTIALS_KEY",
            "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
        ),
        ("HEALTH_PROBE_INTERVAL", "100ms"),
    ]);
    let config = gateway_svc::Config::load(svc_kit::config::Vars::from_map(&vars)).unwrap();
    let app = gateway_svc::App::build_with_tools(config, probe_tools::all(&probe.url))
        .await
        .unwrap();
    let (audit, addr) = (app.audit(), app.local_addr());
    tokio::spawn(app.run(std::future::pending()));
    wait_for_status(
        channel(addr).await,
        steward_proto::GATEWAY_SERVICE_NAME,
        tonic_health::pb::health_check_response::ServingStatus::Serving,
    )
    .await;
    OwnGateway {
        db,
        audit,
        addr,
        _probe: probe,
    }
}

#[tokio::test]
async fn every_tool_call_and_upstream_call_is_audited_without_secrets() {
    let w = own_gateway().await;
    let mut g = gateway_as(w.addr, "u1").await;
    connect(&mut g, "access-1", 3600).await;
    execute(
        &mut g,
        call(
            "c1",
            "probe_fetch",
            serde_json::json!({"path": "/data?size=5"}),
        ),
    )
    .await;
    // The call has answered; a read-only call's records may still be queued for the batching
    // writer (the answer does not wait for them), so the table is read after a flush.
    w.audit.flush().await.unwrap();
    let (client, conn) = tokio_postgres::connect(w.db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let rows = client
        .query("SELECT kind, tool, account, status, bytes, upstream_calls FROM gateway.audit WHERE user_id = 'u1' ORDER BY id", &[])
        .await
        .unwrap();
    let got: Vec<(String, String, Option<String>, String, i32, i32)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                "upstream_call".into(),
                "probe_fetch".into(),
                Some(ACCOUNT.into()),
                "200".into(),
                5,
                1
            ),
            (
                "tool_call".into(),
                "probe_fetch".into(),
                Some(ACCOUNT.into()),
                "ok".into(),
                5,
                1
            ),
        ]
    );
    let stored: Vec<u8> = client
        .query_one(
            "SELECT access_token FROM gateway.accounts WHERE user_id = 'u1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !String::from_utf8_lossy(&stored).contains("access-1"),
        "tokens are encrypted at rest"
    );
}

#[tokio::test]
async fn a_gateway_with_stored_accounts_refuses_to_start_without_the_key() {
    let db = TestDb::create().await.unwrap();
    let key = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
    let mut env: HashMap<String, String> = HashMap::from([
        ("DATABASE_URL".into(), db.url().to_owned()),
        ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
        ("CREDENTIALS_KEY".into(), key.into()),
    ]);
    let mut first = start_gateway_with(&env, vec![]).await.unwrap();
    let mut g = gateway_as(first.addr, "u1").await;
    connect(&mut g, "a", 3600).await;
    first.stop().await.unwrap();
    env.remove("CREDENTIALS_KEY");
    let Err(err) = start_gateway_with(&env, vec![]).await else {
        panic!("started without the key")
    };
    assert!(
        err.contains("1 connected account(s) are stored but CREDENTIALS_KEY is not set"),
        "{err}"
    );
}
