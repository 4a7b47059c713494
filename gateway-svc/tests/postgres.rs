//! gateway-svc's PostgreSQL store, on a database of its own per test.

use std::time::Duration;

use gateway_svc::{
    domain::UserId,
    store::{KeyState, StoredResult, postgres::PgStore},
};
use serde_json::json;
use svc_kit::{pg::PoolOptions, server_config::DatabaseConfig, testing::TestDb};

async fn store(db: &TestDb) -> PgStore {
    PgStore::connect(&DatabaseConfig {
        url: db.url().to_owned(),
        pool: PoolOptions {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(5),
            ..PoolOptions::default()
        },
    })
    .await
    .expect("open the gateway store")
}

/// P-4: a side effect's result holding NUL (a remote tool's text, an upstream's words) is
/// stored, with NUL replaced, as `jsonb` refuses it: refused, its key would be left to lapse
/// and a retry could act again.
#[tokio::test]
async fn p4_a_side_effects_result_holding_nul_is_stored_and_replayed_with_nul_replaced() {
    let db = TestDb::create().await.unwrap();
    let stores = store(&db).await.stores();
    let user = UserId::parse("u1").unwrap();
    let mut claim = stores
        .idempotency
        .claim(&user, "run-1/call-1", Duration::from_secs(30))
        .await
        .unwrap();
    let outcome = json!({"text": "sent\u{0}ok", "display": {"k\u{0}": ["a\u{0}b", 1]}});
    claim
        .complete(&StoredResult {
            tool: "gmail_send".into(),
            args_sha256: "abc".into(),
            outcome,
        })
        .await
        .expect("stored");
    drop(claim);
    let KeyState::Done(stored) = stores
        .idempotency
        .lookup(&user, "run-1/call-1")
        .await
        .unwrap()
    else {
        panic!("the result was not stored");
    };
    assert_eq!(
        stored.outcome,
        json!({"text": "sent\u{fffd}ok", "display": {"k\u{fffd}": ["a\u{fffd}b", 1]}})
    );
}
