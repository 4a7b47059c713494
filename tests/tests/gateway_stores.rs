//! One suite, both gateway stores (S-5): the in-memory store and PostgreSQL must behave alike
//! for accounts, row locks, idempotency claims, audit and rate-limit counters.

use std::{sync::Arc, time::SystemTime};

use gateway_svc::{
    domain::{Integration, UserId},
    ratelimit::{Decision, LimitKey, Limits, RateLimitBackend, Window, memory::MemoryRateLimits},
    store::{
        AccountStatus, AuditRecord, StoredAccount, StoredResult, Stores, memory::MemoryStore,
        postgres::PgStore,
    },
};
use steward_tests::TestDb;
use svc_kit::{pg::PoolOptions, server_config::DatabaseConfig};

struct Backend {
    stores: Stores,
    limits: Arc<dyn RateLimitBackend>,
    _db: Option<TestDb>,
}

async fn memory() -> Backend {
    Backend {
        stores: MemoryStore::stores(),
        limits: Arc::new(MemoryRateLimits::default()),
        _db: None,
    }
}

async fn postgres() -> Backend {
    let db = TestDb::create().await.unwrap();
    let config = DatabaseConfig {
        url: db.url().to_owned(),
        pool: PoolOptions {
            max_connections: 8,
            acquire_timeout: std::time::Duration::from_secs(5),
        },
    };
    let stores = PgStore::connect(&config).await.unwrap().stores();
    let limits = stores.shared_rate_limits.clone().unwrap();
    Backend {
        stores,
        limits,
        _db: Some(db),
    }
}

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

fn account(u: &str, name: &str) -> StoredAccount {
    StoredAccount {
        user: user(u),
        integration: Integration::Gmail,
        account: name.into(),
        access_token: vec![1, 2, 3],
        refresh_token: Some(vec![4, 5]),
        expires_at: Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_900_000_000)),
        scopes: vec!["gmail.readonly".into()],
        status: AccountStatus::Connected,
        connected_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000),
    }
}

async fn accounts_are_scoped_to_their_user_and_round_trip(b: Backend) {
    let s = &b.stores.accounts;
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    s.upsert_account(account("u1", "b@x.com")).await.unwrap();
    s.upsert_account(account("u2", "a@x.com")).await.unwrap();
    let mine = s.list_accounts(&user("u1")).await.unwrap();
    assert_eq!(
        mine.iter().map(|a| a.account.as_str()).collect::<Vec<_>>(),
        ["a@x.com", "b@x.com"]
    );
    assert_eq!(mine[0], account("u1", "a@x.com"));
    assert_eq!(s.count_accounts().await.unwrap(), 3);
    assert!(
        s.delete_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
    );
    assert!(
        !s.delete_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
    );
    assert!(
        s.get_account(&user("u2"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
            .is_some()
    );
}

async fn an_account_lock_is_exclusive_until_saved(b: Backend) {
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let first = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    let s2 = s.clone();
    let second = tokio::spawn(async move {
        let lock = s2
            .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap();
        lock.current().unwrap().access_token.clone()
    });
    // The second waiter cannot get in while the first holds the row.
    tokio::task::yield_now().await;
    assert!(!second.is_finished());
    let mut updated = first.current().unwrap().clone();
    updated.access_token = vec![9, 9];
    first.save(updated).await.unwrap();
    assert_eq!(
        second.await.unwrap(),
        vec![9, 9],
        "the waiter sees the winner's write"
    );
}

async fn a_dropped_lock_releases_without_writing(b: Backend) {
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    drop(
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap(),
    );
    let again = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com"),
    )
    .await
    .expect("the lock was released")
    .unwrap();
    assert_eq!(again.current().unwrap().access_token, vec![1, 2, 3]);
}

async fn an_idempotency_key_replays_its_first_result(b: Backend) {
    let s = &b.stores.idempotency;
    let claim = s.claim(&user("u1"), "k1").await.unwrap();
    assert!(claim.existing().is_none());
    let stored = StoredResult {
        tool: "send".into(),
        args_sha256: "abc".into(),
        outcome: serde_json::json!({"text": "sent"}),
    };
    claim.complete(stored.clone()).await.unwrap();
    assert_eq!(
        s.claim(&user("u1"), "k1").await.unwrap().existing(),
        Some(&stored)
    );
    assert!(
        s.claim(&user("u2"), "k1")
            .await
            .unwrap()
            .existing()
            .is_none(),
        "keys are per user"
    );
}

async fn audit_records_come_back_in_order_per_user(b: Backend) {
    let s = &b.stores.audit;
    for (u, call) in [("u1", "c1"), ("u2", "c2"), ("u1", "c3")] {
        s.record(AuditRecord {
            user: u.into(),
            kind: "tool_call".into(),
            tool: "t".into(),
            integration: None,
            account: None,
            call_id: call.into(),
            run_id: None,
            status: "ok".into(),
            latency_ms: 1,
            bytes: 2,
            upstream_calls: 0,
        })
        .await
        .unwrap();
    }
    let calls: Vec<_> = s
        .recent(&user("u1"), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.call_id)
        .collect();
    assert_eq!(calls, ["c1", "c3"]);
}

async fn rate_limits_allow_exactly_the_limit_then_name_the_wait(b: Backend) {
    let key = LimitKey {
        user: user("u1"),
        integration: Integration::Gmail,
        account: "a@x.com".into(),
    };
    let limits = Limits::google_default();
    let now = 1_000_000_020 + 18;
    let mut allowed = 0;
    for _ in 0..35 {
        if matches!(
            b.limits.charge(&key, &limits, 1, now).await.unwrap(),
            Decision::Allowed(_)
        ) {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 30);
    let denied = b.limits.charge(&key, &limits, 1, now).await.unwrap();
    assert_eq!(
        denied,
        Decision::Denied {
            window: Window::Minute,
            limit: 30,
            retry_after: std::time::Duration::from_secs(42)
        }
    );
    // The next minute has room again; the hour keeps counting.
    match b.limits.charge(&key, &limits, 5, now + 60).await.unwrap() {
        Decision::Allowed(usage) => assert!(
            usage
                .iter()
                .any(|u| u.window == Window::Hour && u.used == 35)
        ),
        other => panic!("{other:?}"),
    }
}

macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod in_memory {
            $(#[tokio::test] async fn $name() { super::$name(super::memory().await).await })*
        }
        mod on_postgres {
            $(#[tokio::test] async fn $name() { super::$name(super::postgres().await).await })*
        }
    };
}

both_backends!(
    accounts_are_scoped_to_their_user_and_round_trip,
    an_account_lock_is_exclusive_until_saved,
    a_dropped_lock_releases_without_writing,
    an_idempotency_key_replays_its_first_result,
    audit_records_come_back_in_order_per_user,
    rate_limits_allow_exactly_the_limit_then_name_the_wait,
);
