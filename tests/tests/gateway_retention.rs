//! Retention (P-4, R-3, G-9): the gateway's idempotency keys and audit trail stop growing
//! forever. Both stores (S-5) delete what is past IDEMPOTENCY_RETENTION and, only when it is
//! set, AUDIT_RETENTION; a key a call still holds is never deleted. The sweep is run directly
//! with a chosen `now`, never waited for.

use std::time::{Duration, SystemTime};

use gateway_svc::{
    config::RetentionConfig,
    domain::UserId,
    retention::{Swept, sweep_once},
    store::{
        AuditEntry, AuditRecord, IdempotencyClaim, IdempotencyStore, KeyState, StoreError,
        StoredResult, Stores, memory::MemoryStore, postgres::PgStore,
    },
};
use steward_tests::{TestDb, env, start_gateway};
use svc_kit::{config::Vars, pg::PoolOptions, server_config::DatabaseConfig};

const DAY: Duration = Duration::from_secs(86_400);

/// How long a test's running claims hold their keys.
const HOLD: Duration = Duration::from_secs(60);

struct Backend {
    stores: Stores,
    _db: Option<TestDb>,
}

async fn memory() -> Backend {
    Backend {
        stores: MemoryStore::stores(),
        _db: None,
    }
}

async fn postgres() -> Backend {
    let db = TestDb::create().await.unwrap();
    let config = DatabaseConfig {
        url: db.url().to_owned(),
        pool: PoolOptions {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(5),
            ..PoolOptions::default()
        },
    };
    Backend {
        stores: PgStore::connect(&config).await.unwrap().stores(),
        _db: Some(db),
    }
}

fn user() -> UserId {
    UserId::parse("u1").unwrap()
}

/// The retention the gateway would run with, given these settings.
fn retention(pairs: &[(&str, &str)]) -> RetentionConfig {
    let mut map = env(&[
        ("GATEWAY_ALLOW_INSECURE_DEV_AUTH", "true"),
        ("STEWARD_DEVELOPMENT", "true"),
    ]);
    map.extend(env(pairs));
    gateway_svc::Config::load(Vars::from_map(&map))
        .unwrap()
        .retention
}

/// The wall clock once it has moved past `t`: a time strictly between what was stored before
/// and what is stored after.
fn the_clock_after(t: SystemTime) -> SystemTime {
    loop {
        let now = SystemTime::now();
        if now > t {
            return now;
        }
    }
}

async fn settle(stores: &Stores, key: &str) -> StoredResult {
    let result = StoredResult {
        tool: "gmail_send".into(),
        args_sha256: "abc".into(),
        outcome: serde_json::json!({"text": format!("sent {key}")}),
    };
    let mut claim = stores.idempotency.claim(&user(), key, HOLD).await.unwrap();
    claim.complete(&result).await.unwrap();
    result
}

async fn state(stores: &Stores, key: &str) -> KeyState {
    stores.idempotency.lookup(&user(), key).await.unwrap()
}

async fn p4_a_settled_key_past_its_retention_is_deleted_and_a_fresher_one_kept(b: Backend) {
    let s = &b.stores;
    settle(s, "old-1").await;
    settle(s, "old-2").await;
    let between = the_clock_after(SystemTime::now());
    let fresh = settle(s, "fresh").await;
    let keep = retention(&[]);
    assert_eq!(keep.idempotency, 7 * DAY, "a week by default");

    let swept = sweep_once(s, &keep, between + keep.idempotency)
        .await
        .unwrap();
    assert_eq!(
        swept,
        Swept {
            idempotency: 2,
            audit: 0
        }
    );
    assert_eq!(state(s, "old-1").await, KeyState::Free);
    assert_eq!(state(s, "old-2").await, KeyState::Free);
    assert_eq!(state(s, "fresh").await, KeyState::Done(fresh.clone()));
    assert_eq!(
        sweep_once(s, &keep, between + keep.idempotency)
            .await
            .unwrap(),
        Swept::default(),
        "a second sweep finds nothing more"
    );
    let a_day_later = between + keep.idempotency - Duration::from_secs(1);
    assert_eq!(
        sweep_once(s, &keep, a_day_later).await.unwrap(),
        Swept::default(),
        "nothing is deleted before its retention has passed"
    );
    assert_eq!(state(s, "fresh").await, KeyState::Done(fresh));
}

async fn p4_keys_are_deleted_in_batches_of_at_most_the_limit(b: Backend) {
    let s = &b.stores;
    for key in ["a", "b", "c"] {
        settle(s, key).await;
    }
    let cut = the_clock_after(SystemTime::now());
    let batches = [
        s.idempotency.prune_idempotency(cut, 2).await.unwrap(),
        s.idempotency.prune_idempotency(cut, 2).await.unwrap(),
        s.idempotency.prune_idempotency(cut, 2).await.unwrap(),
    ];
    assert_eq!(batches, [2, 1, 0]);
}

async fn r3_a_key_a_call_still_holds_is_never_deleted_whatever_its_age(b: Backend) {
    let s = &b.stores;
    let mut running = s.idempotency.claim(&user(), "running", HOLD).await.unwrap();
    let abandoned = s
        .idempotency
        .claim(&user(), "abandoned", HOLD)
        .await
        .unwrap();
    // Let go without its result: its call may have acted, so the key stays held for its hold.
    abandoned.abandon();
    let a_century_on = SystemTime::now() + 36_500 * DAY;
    let swept = sweep_once(s, &retention(&[]), a_century_on).await.unwrap();
    assert_eq!(swept.idempotency, 0);
    assert_eq!(state(s, "running").await, KeyState::Running);
    assert_eq!(state(s, "abandoned").await, KeyState::Running);
    let result = StoredResult {
        tool: "gmail_send".into(),
        args_sha256: "abc".into(),
        outcome: serde_json::json!({"text": "sent"}),
    };
    running
        .complete(&result)
        .await
        .expect("the running call still holds its key and stores its result");
    assert_eq!(state(s, "running").await, KeyState::Done(result));
}

async fn r3_a_key_abandoned_and_lapsed_long_ago_is_deleted(b: Backend) {
    let s = &b.stores;
    // A hold of zero has lapsed by the time anything looks at it.
    let lapsed = s
        .idempotency
        .claim(&user(), "lapsed", Duration::ZERO)
        .await
        .unwrap();
    lapsed.abandon();
    assert_eq!(
        state(s, "lapsed").await,
        KeyState::Free,
        "it never marked a write: nothing was done"
    );
    let keep = retention(&[]);
    let later = the_clock_after(SystemTime::now()) + keep.idempotency;
    assert_eq!(sweep_once(s, &keep, later).await.unwrap().idempotency, 1);
    assert_eq!(state(s, "lapsed").await, KeyState::Free);
}

async fn r3_a_key_whose_call_may_have_acted_is_kept_for_good(b: Backend) {
    let s = &b.stores;
    let claim = s
        .idempotency
        .claim(&user(), "sent-maybe", Duration::ZERO)
        .await
        .unwrap();
    claim
        .acting()
        .expect("a running claim can mark its write")
        .mark()
        .await
        .unwrap();
    // The call went to Gmail and its replica died: no result, its hold lapsed.
    claim.abandon();
    let a_century_on = SystemTime::now() + 36_500 * DAY;
    let swept = sweep_once(s, &retention(&[]), a_century_on).await.unwrap();
    assert_eq!(swept.idempotency, 0);
    assert_eq!(
        state(s, "sent-maybe").await,
        KeyState::Held,
        "still answered as possibly done, never as free"
    );
}

/// R-3, P-4: the keys kept for good are not where the sweep looks. With thousands of them,
/// older than everything else, the planner reads the sweep's rows by V12's index of prunable
/// rows, which holds none of them, so no batch reads past them again.
#[tokio::test]
async fn r3_on_postgres_the_sweep_finds_its_rows_by_an_index_that_leaves_out_the_keys_kept_for_good()
 {
    let b = postgres().await;
    let (sql, conn) = tokio_postgres::connect(b._db.as_ref().unwrap().url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    sql.batch_execute(
        "INSERT INTO gateway.idempotency (user_id, key, tool, args_sha256, outcome, state, lease_until, acting, updated_at) \
           SELECT 'u1', 'kept-' || g, 'gmail_send', 'x', '{}', 'pending', now() - interval '30 days', true, \
                  now() - interval '60 days' + g * interval '1 second' FROM generate_series(1, 5000) g; \
         INSERT INTO gateway.idempotency (user_id, key, tool, args_sha256, outcome, state, updated_at) \
           SELECT 'u1', 'done-' || g, 'gmail_send', 'x', '{}', 'done', now() - interval '10 days' FROM generate_series(1, 20) g; \
         ANALYZE gateway.idempotency; SET enable_seqscan = off; SET enable_bitmapscan = off;",
    )
    .await
    .unwrap();
    let cut = gateway_svc::store::postgres::IDEMPOTENCY_PRUNABLE
        .replace("$1", "(now() - interval '7 days')");
    let plan: Vec<String> = sql
        .query(
            &format!("EXPLAIN SELECT ctid FROM gateway.idempotency WHERE {cut} LIMIT 1000"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        plan.iter().any(|l| l.contains("idempotency_prunable")),
        "{plan:#?}"
    );
    let swept = sweep_once(&b.stores, &retention(&[]), SystemTime::now())
        .await
        .unwrap();
    assert_eq!(swept.idempotency, 20, "the settled keys go, the kept stay");
}

fn record(call_id: &str) -> AuditRecord {
    AuditRecord {
        user: "u1".into(),
        kind: "tool_call".into(),
        tool: "gmail_send".into(),
        integration: Some("gmail".into()),
        account: Some("me@example.com".into()),
        call_id: call_id.into(),
        run_id: None,
        status: "ok".into(),
        latency_ms: 3,
        bytes: 10,
        upstream_calls: 1,
    }
}

async fn audit_calls(stores: &Stores) -> Vec<String> {
    stores
        .audit
        .recent(&user(), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.call_id)
        .collect()
}

async fn g9_audit_records_are_deleted_only_when_audit_retention_is_set(b: Backend) {
    let s = &b.stores;
    let now = SystemTime::now();
    let at = |age: Duration, call: &str| AuditEntry {
        at: now - age,
        record: record(call),
    };
    // The second is written after the first but happened long before it: a record written
    // late keeps its call's time, and is deleted by it.
    s.audit
        .record_many(&[
            at(100 * DAY, "old"),
            at(DAY, "recent"),
            at(200 * DAY, "old-written-late"),
        ])
        .await
        .unwrap();

    for kept_forever in [retention(&[]), retention(&[("AUDIT_RETENTION", "off")])] {
        assert_eq!(kept_forever.audit, None);
        assert_eq!(sweep_once(s, &kept_forever, now).await.unwrap().audit, 0);
    }
    assert_eq!(audit_calls(s).await, ["old", "recent", "old-written-late"]);

    let ninety_days = retention(&[("AUDIT_RETENTION", "90d")]);
    assert_eq!(ninety_days.audit, Some(90 * DAY));
    assert_eq!(
        sweep_once(s, &ninety_days, now).await.unwrap(),
        Swept {
            idempotency: 0,
            audit: 2
        }
    );
    assert_eq!(audit_calls(s).await, ["recent"]);
}

/// An idempotency store whose prune always fails: the database refuses that table.
struct PruneFails(std::sync::Arc<dyn IdempotencyStore>);

#[async_trait::async_trait]
impl IdempotencyStore for PruneFails {
    async fn claim(
        &self,
        user: &UserId,
        key: &str,
        hold: Duration,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError> {
        self.0.claim(user, key, hold).await
    }

    async fn lookup(&self, user: &UserId, key: &str) -> Result<KeyState, StoreError> {
        self.0.lookup(user, key).await
    }

    async fn prune_idempotency(&self, _: SystemTime, _: usize) -> Result<usize, StoreError> {
        Err(StoreError::Unavailable("idempotency is locked".into()))
    }
}

/// G-9: the audit trail is pruned on time even while pruning idempotency keys fails; the
/// sweep still reports the failure, to be retried next interval.
#[tokio::test]
async fn g9_audit_is_pruned_even_when_the_idempotency_prune_fails() {
    let mut stores = MemoryStore::stores();
    stores.idempotency = std::sync::Arc::new(PruneFails(stores.idempotency.clone()));
    let now = SystemTime::now();
    stores
        .audit
        .record_many(&[AuditEntry {
            at: now - 100 * DAY,
            record: record("old"),
        }])
        .await
        .unwrap();
    let err = sweep_once(&stores, &retention(&[("AUDIT_RETENTION", "90d")]), now)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("idempotency is locked"), "{err}");
    assert!(audit_calls(&stores).await.is_empty());
}

steward_tests::both_backends!(
    p4_a_settled_key_past_its_retention_is_deleted_and_a_fresher_one_kept,
    p4_keys_are_deleted_in_batches_of_at_most_the_limit,
    r3_a_key_a_call_still_holds_is_never_deleted_whatever_its_age,
    r3_a_key_abandoned_and_lapsed_long_ago_is_deleted,
    r3_a_key_whose_call_may_have_acted_is_kept_for_good,
    g9_audit_records_are_deleted_only_when_audit_retention_is_set,
);

#[tokio::test]
async fn a_gateway_given_a_retention_it_cannot_honour_fails_to_start_naming_the_variable() {
    for (var, value, hint) in [
        ("IDEMPOTENCY_RETENTION", "0", "shorter than 1h"),
        ("IDEMPOTENCY_RETENTION", "30m", "from 1h to 36500d"),
        ("IDEMPOTENCY_RETENTION", "a week", "is not a duration"),
        ("AUDIT_RETENTION", "forever", "or off"),
        ("AUDIT_RETENTION", "0", "shorter than 1h"),
    ] {
        let settings = env(&[("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"), (var, value)]);
        let Err(err) = start_gateway(&settings).await else {
            panic!("started with {var}={value}")
        };
        assert!(
            err.contains(var) && err.contains(hint),
            "{var}={value}: {err}"
        );
    }
}

#[tokio::test]
async fn a_gateway_with_both_retentions_set_starts_and_stops_its_sweep_on_shutdown() {
    let db = TestDb::create().await.unwrap();
    let settings = env(&[
        ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
        ("DATABASE_URL", db.url()),
        ("IDEMPOTENCY_RETENTION", "48h"),
        ("AUDIT_RETENTION", "90d"),
    ]);
    let mut gateway = start_gateway(&settings).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), gateway.stop())
        .await
        .expect("the sweep does not hold up shutdown")
        .unwrap();
}
