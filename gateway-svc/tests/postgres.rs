//! gateway-svc's PostgreSQL store, on a database of its own per test.

mod common;

use std::{sync::Arc, time::Duration};

use common::upstream::{Answer, Upstream};
use gateway_svc::{
    domain::{Integration, UserId},
    integrations::gmail::{self, GmailApi},
    store::{
        ActingMark, IdempotencyClaim, IdempotencyStore, KeyState, StoreError, StoredResult,
        memory::MemoryStore, postgres::PgStore,
    },
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

/// R-3, S-5: a claim let go without its result once its call marked a write is never taken
/// over, even after its hold lapsed: the caller is told the earlier call may have acted. One
/// let go before any write is taken over once its hold lapsed, as before.
async fn a_lapsed_claim_is_taken_over_only_if_its_call_never_marked_a_write(
    store: Arc<dyn IdempotencyStore>,
) {
    let user = UserId::parse("u1").unwrap();
    let short = Duration::from_millis(300);
    let unmarked = store.claim(&user, "never-wrote", short).await.unwrap();
    unmarked.abandon();
    let marked = store.claim(&user, "wrote", short).await.unwrap();
    marked
        .acting()
        .expect("a held claim can be marked")
        .mark()
        .await
        .unwrap();
    marked.abandon();

    assert_eq!(
        store.lookup(&user, "wrote").await.unwrap(),
        KeyState::Running,
        "held, its hold not lapsed yet"
    );
    let taken = store
        .claim(&user, "never-wrote", Duration::from_secs(30))
        .await
        .expect("taken over once its hold lapsed");
    assert!(taken.existing().is_none());
    let refused = store
        .claim(&user, "wrote", Duration::from_secs(30))
        .await
        .err()
        .expect("a claim whose call marked a write is never taken over");
    assert!(
        matches!(&refused, StoreError::MayHaveActed(why) if why.contains("ended without recording its result")),
        "{refused:?}"
    );
    assert_eq!(
        store.lookup(&user, "wrote").await.unwrap(),
        KeyState::Held,
        "left as it is"
    );
}

#[tokio::test]
async fn r3_on_postgres_a_lapsed_claim_is_taken_over_only_if_its_call_never_marked_a_write() {
    let db = TestDb::create().await.unwrap();
    let store = store(&db).await.stores().idempotency;
    a_lapsed_claim_is_taken_over_only_if_its_call_never_marked_a_write(store).await;
}

#[tokio::test(start_paused = true)]
async fn r3_s5_in_memory_a_lapsed_claim_is_taken_over_only_if_its_call_never_marked_a_write() {
    let store = MemoryStore::stores().idempotency;
    a_lapsed_claim_is_taken_over_only_if_its_call_never_marked_a_write(store).await;
}

/// The idempotency store of a replica that dies after its send and before storing the result:
/// every result write fails, so the claim is let go without it, as a dead holder's is.
struct DiesBeforeStoring(Arc<dyn IdempotencyStore>);

#[async_trait::async_trait]
impl IdempotencyStore for DiesBeforeStoring {
    async fn claim(
        &self,
        user: &UserId,
        key: &str,
        hold: Duration,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError> {
        Ok(Box::new(Unstored(self.0.claim(user, key, hold).await?)))
    }

    async fn lookup(&self, user: &UserId, key: &str) -> Result<KeyState, StoreError> {
        self.0.lookup(user, key).await
    }

    async fn prune_idempotency(
        &self,
        older_than: std::time::SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError> {
        self.0.prune_idempotency(older_than, limit).await
    }
}

struct Unstored(Box<dyn IdempotencyClaim>);

#[async_trait::async_trait]
impl IdempotencyClaim for Unstored {
    fn existing(&self) -> Option<&StoredResult> {
        self.0.existing()
    }

    async fn complete(&mut self, _result: &StoredResult) -> Result<(), StoreError> {
        Err(StoreError::Rejected {
            code: "57P01".into(),
            message: "the replica went away".into(),
        })
    }

    fn abandon(self: Box<Self>) {
        self.0.abandon();
    }

    fn acting(&self) -> Option<Arc<dyn ActingMark>> {
        self.0.acting()
    }
}

const SEND: &str = "POST /gmail/v1/users/me/messages/send";

/// R-3: `gmail_send` reaches Gmail, which answers 200, and its replica dies before storing the
/// result. A retry with the same key on another replica, once the dead holder's hold lapsed,
/// is told the earlier call may have acted, and Gmail receives one send.
#[tokio::test]
async fn r3_a_retry_after_the_holder_died_mid_send_is_told_it_may_have_acted_and_gmail_receives_one_send()
 {
    let db = TestDb::create().await.unwrap();
    let stores = store(&db).await.stores();
    let upstream =
        Upstream::start(|_, _| Answer::Status(200, r#"{"id": "m1", "threadId": "t1"}"#)).await;
    let tools = gmail::tools(GmailApi {
        base_url: upstream.base_url.clone(),
    });
    let mut dying = common::engine(&stores, tools);
    common::connect(&dying, Integration::Gmail, "alice@example.com", "tok").await;
    let other_replica = dying.clone();
    dying.idempotency = Arc::new(DiesBeforeStoring(stores.idempotency.clone()));
    let args = json!({"to": "bob@example.com", "subject": "Hi", "body": "Hello"});

    let first = common::call(&dying, "c1", "gmail_send", args.clone(), "run-1/call-1").await;
    assert!(first.ok(), "{}", first.text);
    // The dead holder's hold lapses (as its time would pass).
    let (client, connection) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let lapsed = client
        .execute(
            "UPDATE gateway.idempotency SET lease_until = clock_timestamp() - interval '1 second'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(lapsed, 1);
    let retry = common::call(&other_replica, "c2", "gmail_send", args, "run-1/call-1").await;

    assert!(
        retry.text.contains("ended without recording its result")
            && retry
                .text
                .contains("may have taken effect. Do not repeat it"),
        "{}",
        retry.text
    );
    assert_eq!(upstream.seen(SEND), 1, "Gmail received one send");
}
