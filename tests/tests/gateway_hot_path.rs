//! The gateway's hot path (issue 13; G-6, G-9, Q-2): the audit records of read-only calls go
//! through a bounded queue written in multi-row batches — never dropped, flushed on shutdown,
//! retried while the database fails transiently, the records it refuses for good isolated,
//! logged and counted — while every call that writes anything is audited before it returns;
//! and a Gmail search reserves its whole cost before its first request (or what is left, when
//! that still covers the list and one message), giving back what it did not use.
//!
//! No test sleeps to synchronise: each waits on the writer's statistics, a lock it holds, or
//! the answer it needs.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use gateway_svc::{
    App, Config,
    audit::AuditTrail,
    config::AuditQueueConfig,
    context::CallContext,
    domain::{Integration, UserId},
    enforce::ToolError,
    ratelimit::{Decision, LimitKey, Limits, RateLimitBackend, Window, memory::MemoryRateLimits},
    registry::{Tool, ToolOutput, ToolSpec},
    store::{AuditEntry, AuditRecord, Stores, postgres::PgStore},
};
use serde_json::{Value, json};
use steward_proto::{
    GATEWAY_SERVICE_NAME,
    gateway::v1::{self as pb, tool_call::Arguments},
};
use steward_tests::{
    Backend, Options, SERVICE_TOKEN, TestDb, UserGateway,
    calls::{call_tool, connect_account},
    channel, env,
    fakes::gmail::{FakeGmail, FakeMessage},
    gateway_as, probe_tools,
    spawn::spawn,
    wait_for_status,
};
use svc_kit::{config::Vars, pg::PoolOptions, server_config::DatabaseConfig};
use tokio::{sync::oneshot, task::JoinHandle};
use tokio_stream::StreamExt;
use tonic_health::pb::health_check_response::ServingStatus;

async fn pg_stores(db: &TestDb) -> Stores {
    let config = DatabaseConfig {
        url: db.url().to_owned(),
        pool: PoolOptions {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(5),
            ..PoolOptions::default()
        },
    };
    PgStore::connect(&config).await.unwrap().stores()
}

async fn sql(db: &TestDb) -> tokio_postgres::Client {
    steward_tests::db::connect(db).await
}

async fn audit_rows(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query("SELECT call_id FROM gateway.audit ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn record(user: &str, call_id: &str) -> AuditRecord {
    AuditRecord {
        user: user.into(),
        kind: "tool_call".into(),
        tool: "search_gmail".into(),
        integration: Some("gmail".into()),
        account: Some("a@x.com".into()),
        call_id: call_id.into(),
        run_id: Some("run-1".into()),
        status: "ok".into(),
        latency_ms: 12,
        bytes: 345,
        upstream_calls: 2,
    }
}

#[tokio::test]
async fn g9_a_batch_insert_on_postgres_writes_every_field_in_order() {
    let db = TestDb::create().await.unwrap();
    let stores = pg_stores(&db).await;
    let at = |secs: u64, micros: u64| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros)
    };
    let full = AuditRecord {
        user: "u1".into(),
        kind: "upstream_call".into(),
        tool: "search_gmail".into(),
        integration: Some("gmail".into()),
        account: Some("zoë@example.com".into()),
        // NUL cannot be stored in PostgreSQL text; it must not fail the batch.
        call_id: "call\0nul".into(),
        run_id: Some("run-7".into()),
        status: "200".into(),
        latency_ms: 1234,
        bytes: i32::MAX as u32,
        upstream_calls: 3,
    };
    let bare = AuditRecord {
        user: "u1".into(),
        kind: "tool_call".into(),
        tool: "list_tasks".into(),
        integration: None,
        account: None,
        call_id: "c2".into(),
        run_id: None,
        status: "internal".into(),
        latency_ms: 0,
        bytes: 0,
        upstream_calls: 0,
    };
    let other_user = record("u2", "c3");
    // Times out of order on purpose: rows keep the batch's order, each its own time.
    let entries = vec![
        AuditEntry {
            at: at(1_750_000_000, 123_456),
            record: full.clone(),
        },
        AuditEntry {
            at: at(1_700_000_000, 1),
            record: bare.clone(),
        },
        AuditEntry {
            at: at(1_760_000_000, 999_999),
            record: other_user.clone(),
        },
    ];
    stores.audit.record_many(&entries).await.unwrap();
    stores.audit.record_many(&[]).await.unwrap();

    let rows = sql(&db)
        .await
        .query(
            "SELECT at, user_id, kind, tool, integration, account, call_id, run_id, status, latency_ms, \
             bytes, upstream_calls FROM gateway.audit ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    type Row = (
        SystemTime,
        String,
        String,
        String,
        Option<String>,
        Option<String>,
        String,
        Option<String>,
        String,
        i32,
        i32,
        i32,
    );
    let got: Vec<Row> = rows
        .iter()
        .map(|r| {
            (
                r.get(0),
                r.get(1),
                r.get(2),
                r.get(3),
                r.get(4),
                r.get(5),
                r.get(6),
                r.get(7),
                r.get(8),
                r.get(9),
                r.get(10),
                r.get(11),
            )
        })
        .collect();
    let want = |e: &AuditEntry, call_id: &str| -> Row {
        let r = &e.record;
        (
            e.at,
            r.user.clone(),
            r.kind.clone(),
            r.tool.clone(),
            r.integration.clone(),
            r.account.clone(),
            call_id.to_owned(),
            r.run_id.clone(),
            r.status.clone(),
            r.latency_ms as i32,
            r.bytes as i32,
            r.upstream_calls as i32,
        )
    };
    assert_eq!(
        got,
        vec![
            want(&entries[0], "call\u{fffd}nul"),
            want(&entries[1], "c2"),
            want(&entries[2], "c3"),
        ]
    );
    // The store's own read agrees, per user, oldest first.
    let mine = stores
        .audit
        .recent(&UserId::parse("u1").unwrap(), 10)
        .await
        .unwrap();
    let full_stored = AuditRecord {
        call_id: "call\u{fffd}nul".into(),
        ..full
    };
    assert_eq!(mine, vec![full_stored, bare]);
}

fn fast_retries() -> AuditQueueConfig {
    AuditQueueConfig {
        retry_first: Duration::from_millis(5),
        retry_max: Duration::from_millis(20),
        ..AuditQueueConfig::default()
    }
}

#[tokio::test]
async fn g9_a_writer_the_database_fails_transiently_retries_and_every_record_lands_once_it_recovers()
 {
    let db = TestDb::create().await.unwrap();
    let stores = pg_stores(&db).await;
    let client = sql(&db).await;
    // Every audit insert fails with a condition a retry can get past: a full disk (53100).
    client
        .batch_execute(
            "CREATE FUNCTION gateway.refuse_audit() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN RAISE EXCEPTION 'no space left on device' USING ERRCODE = '53100'; END $$; \
             CREATE TRIGGER refuse_audit BEFORE INSERT ON gateway.audit \
               FOR EACH STATEMENT EXECUTE FUNCTION gateway.refuse_audit();",
        )
        .await
        .unwrap();
    let trail = AuditTrail::start(stores.audit.clone(), &fast_retries());
    for i in 0..5 {
        trail.record_later(record("u1", &format!("c{i}"))).await;
    }
    trail.stats().wait_for(|s| s.failures >= 2).await.unwrap();
    assert!(audit_rows(&client).await.is_empty());
    let stats = trail.stats().borrow().clone();
    assert_eq!((stats.pending, stats.rejected), (5, 0), "kept, not dropped");

    client
        .batch_execute("DROP TRIGGER refuse_audit ON gateway.audit")
        .await
        .unwrap();
    trail.flush().await.unwrap();
    assert_eq!(
        audit_rows(&client).await,
        ["c0", "c1", "c2", "c3", "c4"],
        "every record exactly once, in order"
    );
    assert_eq!(trail.stats().borrow().rejected, 0);
}

#[tokio::test]
async fn g9_records_the_database_refuses_for_good_are_counted_and_the_rest_written() {
    let db = TestDb::create().await.unwrap();
    let stores = pg_stores(&db).await;
    let mut client = sql(&db).await;
    // Two records the database will never take: one breaks a CHECK constraint (23514), one a
    // trigger refuses with RAISE (P0001). Retrying them would stall the queue forever.
    client
        .batch_execute(
            "ALTER TABLE gateway.audit ADD CONSTRAINT no_bad_check CHECK (call_id <> 'bad-check'); \
             CREATE FUNCTION gateway.refuse_one() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN IF NEW.call_id = 'bad-raise' THEN RAISE EXCEPTION 'refused'; END IF; \
                  RETURN NEW; END $$; \
             CREATE TRIGGER refuse_one BEFORE INSERT ON gateway.audit \
               FOR EACH ROW EXECUTE FUNCTION gateway.refuse_one();",
        )
        .await
        .unwrap();
    let trail = AuditTrail::start(stores.audit.clone(), &fast_retries());
    // Held back while they gather, so they go as one batch.
    {
        let lock = lock_audit_table(&mut client).await;
        for id in ["c0", "bad-check", "c1", "bad-raise", "c2"] {
            trail.record_later(record("u1", id)).await;
        }
        lock.commit().await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(20), trail.flush())
        .await
        .expect("refused records do not stall the queue")
        .unwrap();
    assert_eq!(audit_rows(&client).await, ["c0", "c1", "c2"]);
    let stats = trail.stats().borrow().clone();
    assert_eq!((stats.rejected, stats.written, stats.pending), (2, 3, 0));
    // And the queue keeps flowing.
    trail.record_later(record("u1", "c3")).await;
    trail.flush().await.unwrap();
    assert_eq!(audit_rows(&client).await, ["c0", "c1", "c2", "c3"]);
}

/// `read_echo {text}`: no upstream; returns its text. Declared read-only, so its audit record
/// goes through the batching writer (the shared probe tools declare nothing, so theirs are
/// written before the call returns).
struct ReadEcho;

#[async_trait::async_trait]
impl Tool for ReadEcho {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(
            "read_echo",
            Integration::Tasks,
            "test: returns its text",
            json!({"type": "object", "properties": {"text": {"type": "string"}}}),
        )
    }

    fn read_only(&self) -> bool {
        true
    }

    async fn call(&self, _ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text(args["text"].as_str().unwrap_or_default()))
    }
}

/// One gateway on a fresh database, run by the test so it can reach the audit trail.
struct Gateway {
    db: TestDb,
    audit: Arc<AuditTrail>,
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), gateway_svc::StartError>>,
}

async fn gateway() -> Gateway {
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
        ("SHUTDOWN_DRAIN_TIMEOUT", "10s"),
    ]);
    let config = Config::load(Vars::from_map(&vars)).unwrap();
    let mut tools = probe_tools::all("http://127.0.0.1:9");
    tools.push(Arc::new(ReadEcho));
    let app = App::build_with_tools(config, tools).await.unwrap();
    let audit = app.audit();
    let addr = app.local_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    wait_for_status(
        channel(addr).await,
        GATEWAY_SERVICE_NAME,
        ServingStatus::Serving,
    )
    .await;
    Gateway {
        db,
        audit,
        addr,
        stop: Some(stop),
        task,
    }
}

/// `n` read_echo calls over one Execute stream, one after another, as a run makes them.
async fn echo_calls(g: &mut UserGateway, n: usize) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut results = g
        .execute(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    for i in 0..n {
        let call = pb::ToolCall {
            call_id: format!("c{i}"),
            tool: "read_echo".into(),
            arguments: Some(Arguments::ArgsJson(r#"{"text":"hello"}"#.into())),
            ..Default::default()
        };
        tx.send(pb::ExecuteRequest {
            kind: Some(pb::execute_request::Kind::Call(call)),
        })
        .await
        .unwrap();
        let result = results.next().await.unwrap().unwrap().result.unwrap();
        assert!(result.ok, "{}", result.text);
    }
}

/// Holds an exclusive lock on gateway.audit: every insert waits until it is released.
async fn lock_audit_table(client: &mut tokio_postgres::Client) -> tokio_postgres::Transaction<'_> {
    let tx = client.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE gateway.audit IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    tx
}

#[tokio::test]
async fn g9_reads_answer_before_their_audit_is_written_and_their_records_arrive_in_multi_row_batches()
 {
    let gw = gateway().await;
    let mut client = sql(&gw.db).await;
    let mut g = gateway_as(gw.addr, "u1").await;
    {
        let lock = lock_audit_table(&mut client).await;
        // Nothing can be written, yet every call answers: its record waits in the queue.
        echo_calls(&mut g, 10).await;
        assert_eq!(gw.audit.stats().borrow().pending, 10);
        lock.commit().await.unwrap();
    }
    gw.audit.flush().await.unwrap();
    let rows = audit_rows(&client).await;
    assert_eq!(rows, (0..10).map(|i| format!("c{i}")).collect::<Vec<_>>());
    let stats = gw.audit.stats().borrow().clone();
    assert_eq!((stats.written, stats.pending), (10, 0));
    assert!(
        stats.largest_batch >= 2 && stats.batches < 10,
        "records that gathered went in one INSERT: {stats:?}"
    );
}

#[tokio::test]
async fn g9_a_draining_gateway_writes_every_queued_audit_record_before_it_exits() {
    let mut gw = gateway().await;
    let mut client = sql(&gw.db).await;
    let mut g = gateway_as(gw.addr, "u1").await;
    let lock = lock_audit_table(&mut client).await;
    echo_calls(&mut g, 7).await;
    drop(g);
    assert_eq!(gw.audit.stats().borrow().pending, 7);
    // SIGTERM: the calls are drained (none is open), then the queue is closed and written
    // out; the gateway waits for its writer, which waits for this lock (the drain deadline is
    // 10 s away).
    let _ = gw.stop.take().unwrap().send(());
    lock.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), &mut gw.task)
        .await
        .expect("the gateway stops within its drain")
        .unwrap()
        .unwrap();
    // Written before run returned, not eventually.
    assert_eq!(gw.audit.stats().borrow().pending, 0);
    assert_eq!(audit_rows(&client).await.len(), 7);
}

#[tokio::test]
async fn g9_a_call_that_writes_steward_data_is_audited_before_it_returns() {
    let gw = gateway().await;
    let client = sql(&gw.db).await;
    let mut g = gateway_as(gw.addr, "u1").await;
    // add_task has no side effect outside Steward, but it writes: not read-only.
    let added = call_tool(&mut g, "add_task", json!({"title": "File the report"})).await;
    assert!(added.ok, "{}", added.text);
    // No flush: the record is in the table as the call returns, and never went through the
    // queue.
    let rows = client
        .query(
            "SELECT kind, tool FROM gateway.audit WHERE user_id = 'u1' ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(got, [("tool_call".to_owned(), "add_task".to_owned())]);
    let stats = gw.audit.stats().borrow().clone();
    assert_eq!((stats.pending, stats.written), (0, 0));
    // A read, by contrast, is queued (and written by the writer).
    let listed = call_tool(&mut g, "list_tasks", json!({})).await;
    assert!(listed.ok, "{}", listed.text);
    gw.audit.flush().await.unwrap();
    assert_eq!(gw.audit.stats().borrow().written, 1);
}

// --- Rate limits: a search reserves 1 + max_results and gives back what it did not use. ---

fn key(user: &str) -> LimitKey {
    LimitKey {
        user: UserId::parse(user).unwrap(),
        integration: Integration::Gmail,
        account: "a@x.com".into(),
    }
}

fn allowed(d: &Decision) -> bool {
    matches!(d, Decision::Allowed(_))
}

/// 18 s into a minute, as the rate-limit unit tests use.
const T: u64 = 1_000_000_038;

async fn refunds_go_back_to_the_windows_charged_and_never_below_zero(b: Arc<dyn RateLimitBackend>) {
    let limits: Limits = "10/minute,100/hour".parse().unwrap();
    // What a refund gives back can be charged again.
    let a = key("a");
    let six = b.charge(&a, &limits, 6, T).await.unwrap();
    assert!(allowed(&six));
    b.refund(&a, 4, &six.charged()).await.unwrap();
    assert!(allowed(&b.charge(&a, &limits, 8, T).await.unwrap()));
    assert!(!allowed(&b.charge(&a, &limits, 1, T).await.unwrap()));

    // Never below zero: a refund larger than the count empties the window, no more.
    let z = key("z");
    let three = b.charge(&z, &limits, 3, T).await.unwrap();
    assert!(allowed(&three));
    b.refund(&z, 50, &three.charged()).await.unwrap();
    assert!(allowed(&b.charge(&z, &limits, 10, T).await.unwrap()));
    assert!(!allowed(&b.charge(&z, &limits, 1, T).await.unwrap()));

    // A refund for a minute that has ended leaves the new minute's count alone; the hour it
    // was charged to gets it back.
    let r = key("r");
    let five = b.charge(&r, &limits, 5, T).await.unwrap();
    assert!(allowed(&five));
    assert!(allowed(&b.charge(&r, &limits, 4, T + 60).await.unwrap()));
    b.refund(&r, 5, &five.charged()).await.unwrap();
    match b.charge(&r, &limits, 6, T + 60).await.unwrap() {
        Decision::Allowed(usage) => {
            let used: Vec<u32> = usage.iter().map(|u| u.used).collect();
            assert_eq!(used, [10, 10], "minute 4 + 6, hour 5 + 4 - 5 + 6");
        }
        denied => panic!("{denied:?}"),
    }
    assert!(!allowed(&b.charge(&r, &limits, 1, T + 60).await.unwrap()));
}

/// A charge lands whole or not at all: one that fits the hour but not the minute charges
/// neither (on PostgreSQL the one-statement charge undoes itself), and a charge of up to `max`
/// that does not fit takes what every window has left.
async fn a_charge_that_does_not_fit_every_window_charges_none(b: Arc<dyn RateLimitBackend>) {
    let limits: Limits = "10/minute,100/hour".parse().unwrap();
    let k = key("partial");
    assert!(allowed(&b.charge(&k, &limits, 8, T).await.unwrap()));
    assert_eq!(
        b.charge(&k, &limits, 5, T).await.unwrap(),
        Decision::Denied {
            window: Window::Minute,
            limit: 10,
            retry_after: Duration::from_secs(42)
        }
    );
    let (decision, cost) = b.charge_up_to(&k, &limits, 1, 5, T).await.unwrap();
    assert_eq!(cost, 2, "what the minute had left");
    match decision {
        Decision::Allowed(usage) => {
            let used: Vec<(Window, u32)> = usage.iter().map(|u| (u.window, u.used)).collect();
            assert_eq!(
                used,
                [(Window::Minute, 10), (Window::Hour, 10)],
                "the refused 5 left the hour as it was"
            );
        }
        denied => panic!("{denied:?}"),
    }
}

#[tokio::test]
async fn g6_a_partial_charge_is_never_kept_in_process() {
    a_charge_that_does_not_fit_every_window_charges_none(Arc::new(MemoryRateLimits::default()))
        .await;
}

#[tokio::test]
async fn g6_a_partial_charge_is_never_kept_on_postgres() {
    let db = TestDb::create().await.unwrap();
    let stores = pg_stores(&db).await;
    a_charge_that_does_not_fit_every_window_charges_none(
        stores.shared_rate_limits.clone().unwrap(),
    )
    .await;
}

#[tokio::test]
async fn g6_refunds_in_process() {
    refunds_go_back_to_the_windows_charged_and_never_below_zero(Arc::new(
        MemoryRateLimits::default(),
    ))
    .await;
}

#[tokio::test]
async fn g6_refunds_on_postgres() {
    let db = TestDb::create().await.unwrap();
    let stores = pg_stores(&db).await;
    refunds_go_back_to_the_windows_charged_and_never_below_zero(
        stores.shared_rate_limits.clone().unwrap(),
    )
    .await;
}

#[tokio::test]
async fn g6_concurrent_charges_and_refunds_on_postgres_lose_nothing() {
    let db = TestDb::create().await.unwrap();
    let backend = pg_stores(&db).await.shared_rate_limits.unwrap();
    let limits: Limits = "1000000/minute".parse().unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (backend, limits) = (backend.clone(), limits.clone());
            tokio::spawn(async move {
                for _ in 0..20 {
                    let six = backend.charge(&key("c"), &limits, 6, T).await.unwrap();
                    assert!(allowed(&six));
                    backend.refund(&key("c"), 5, &six.charged()).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    match backend.charge(&key("c"), &limits, 1, T).await.unwrap() {
        Decision::Allowed(usage) => assert_eq!(usage[0].used, 8 * 20 + 1),
        denied => panic!("{denied:?}"),
    }
}

/// Charges racing on one key, each of as much as 3 but at least 1, take exactly the limit:
/// the one-statement charges (while 3 fits), the charges decided under the lock (the last
/// room, 1 or 2) and the denials after them never lose a count or give one twice.
#[tokio::test]
async fn g6_racing_charges_on_postgres_take_exactly_the_limit() {
    let db = TestDb::create().await.unwrap();
    let backend = pg_stores(&db).await.shared_rate_limits.unwrap();
    let limits: Limits = "100/minute,1000/hour".parse().unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (backend, limits) = (backend.clone(), limits.clone());
            tokio::spawn(async move {
                let mut taken = 0;
                loop {
                    let (decision, cost) = backend
                        .charge_up_to(&key("race"), &limits, 1, 3, T)
                        .await
                        .unwrap();
                    if !allowed(&decision) {
                        return taken;
                    }
                    taken += cost;
                }
            })
        })
        .collect();
    let mut taken = 0;
    for t in tasks {
        taken += t.await.unwrap();
    }
    assert_eq!(taken, 100, "the minute's limit, no more and no less");
    match backend
        .charge(&key("race"), &limits, 1, T + 60)
        .await
        .unwrap()
    {
        Decision::Allowed(usage) => {
            let hour = usage.iter().find(|u| u.window == Window::Hour).unwrap();
            assert_eq!(hour.used, 101, "every count the minute took is in the hour");
        }
        denied => panic!("{denied:?}"),
    }
}

struct GmailWorld {
    gmail: FakeGmail,
    g: UserGateway,
    _app: steward_tests::TestApp,
}

/// A gateway with Gmail limited to `limits` (a day window, so no test straddles a window),
/// rate limits kept in `backend`, and one account whose mailbox holds `messages` newsletters.
async fn gmail_world(backend: Backend, limits: &str, messages: usize) -> GmailWorld {
    let gmail = FakeGmail::start().await;
    gmail.add_messages(
        "tok",
        (0..messages)
            .map(|i| FakeMessage::html_newsletter(&format!("aa{i:04x}"), i))
            .collect(),
    );
    let mut env = vec![
        ("GMAIL_API_BASE_URL".to_owned(), gmail.url.clone()),
        ("RATE_LIMITS_GMAIL".to_owned(), limits.to_owned()),
    ];
    if backend == Backend::Postgres {
        env.push(("RATE_LIMIT_BACKEND".into(), "postgres".into()));
    }
    let app = spawn(Options {
        backend: Some(backend),
        env,
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    connect_account(&mut g, pb::Integration::Gmail, "me@example.com", "tok").await;
    GmailWorld {
        gmail,
        g,
        _app: app,
    }
}

fn list_requests(gmail: &FakeGmail) -> usize {
    gmail
        .recorded()
        .into_iter()
        .filter(|r| r.path.ends_with("/messages"))
        .count()
}

async fn a_search_the_budget_cannot_fully_cover_is_cut_to_what_is_left(backend: Backend) {
    let mut w = gmail_world(backend, "10/day", 3).await;
    for _ in 0..4 {
        let r = call_tool(&mut w.g, "get_gmail", json!({"message_id": "aa0000"})).await;
        assert!(r.ok, "{}", r.text);
    }
    // 6 of 10 left; a search of up to 6 messages would need 7, but the list and the 3
    // messages there are fit: cut to 5, it finds all 3 and says nothing of a cut.
    let found = call_tool(&mut w.g, "search_gmail", json!({"max_results": 6})).await;
    assert!(found.ok, "{}", found.text);
    assert_eq!(found.upstream_calls, 2);
    assert!(found.text.contains("3. [aa0002]"), "{}", found.text);
    assert!(!found.text.contains("At most"), "{}", found.text);
    // It paid 1 + 3: 2 left. A search of up to 5 is cut to the list and 1 message, and says so.
    let cut = call_tool(&mut w.g, "search_gmail", json!({"max_results": 5})).await;
    assert!(cut.ok, "{}", cut.text);
    assert!(cut.text.contains("1. [aa0000]"), "{}", cut.text);
    assert!(!cut.text.contains("[aa0001]"), "{}", cut.text);
    assert!(
        cut.text
            .contains("(At most 1 this time: 2 of the 10 Gmail calls per day were left.)"),
        "{}",
        cut.text
    );
    // Nothing left now.
    let spent = call_tool(&mut w.g, "get_gmail", json!({"message_id": "aa0000"})).await;
    assert_eq!(
        spent.error_kind,
        pb::ErrorKind::RateLimited as i32,
        "{}",
        spent.text
    );
}

#[tokio::test]
async fn g6_a_search_the_remaining_budget_cannot_fully_cover_is_cut_to_what_is_left() {
    a_search_the_budget_cannot_fully_cover_is_cut_to_what_is_left(Backend::Memory).await;
}

#[tokio::test]
async fn g6_a_search_the_remaining_budget_cannot_fully_cover_is_cut_to_what_is_left_on_postgres() {
    a_search_the_budget_cannot_fully_cover_is_cut_to_what_is_left(Backend::Postgres).await;
}

async fn a_search_with_fewer_than_two_calls_left_makes_no_request(backend: Backend) {
    let mut w = gmail_world(backend, "10/day", 3).await;
    for _ in 0..9 {
        let r = call_tool(&mut w.g, "get_gmail", json!({"message_id": "aa0000"})).await;
        assert!(r.ok, "{}", r.text);
    }
    // 1 of 10 left: not even the list and one message.
    let lists = list_requests(&w.gmail);
    let before = w.gmail.recorded().len();
    let denied = call_tool(&mut w.g, "search_gmail", json!({"max_results": 1})).await;
    assert!(!denied.ok);
    assert_eq!(denied.error_kind, pb::ErrorKind::RateLimited as i32);
    assert!(
        denied
            .text
            .starts_with("Gmail rate limit reached (10/day). Try again in "),
        "{}",
        denied.text
    );
    assert_eq!(denied.upstream_calls, 0);
    assert_eq!(lists, list_requests(&w.gmail));
    assert_eq!(
        w.gmail.recorded().len(),
        before,
        "a denied search sends Gmail nothing, not even its list request"
    );
    // The denial charged nothing: the last call still fits.
    let fits = call_tool(&mut w.g, "get_gmail", json!({"message_id": "aa0000"})).await;
    assert!(fits.ok, "{}", fits.text);
}

#[tokio::test]
async fn g6_a_search_with_fewer_than_two_calls_left_is_refused_before_any_request() {
    a_search_with_fewer_than_two_calls_left_makes_no_request(Backend::Memory).await;
}

#[tokio::test]
async fn g6_a_search_with_fewer_than_two_calls_left_is_refused_before_any_request_on_postgres() {
    a_search_with_fewer_than_two_calls_left_makes_no_request(Backend::Postgres).await;
}

async fn a_search_that_finds_fewer_gives_the_rest_back(backend: Backend) {
    let mut w = gmail_world(backend, "12/day", 2).await;
    // Reserves 1 + 10; finds 2: charged 3, 8 given back.
    let first = call_tool(&mut w.g, "search_gmail", json!({"max_results": 10})).await;
    assert!(first.ok, "{}", first.text);
    assert_eq!(first.upstream_calls, 2);
    assert!(first.text.contains("[aa0001]"), "{}", first.text);
    // 9 left: a search reserving 1 + 8 fits only because of the refund ...
    let second = call_tool(&mut w.g, "search_gmail", json!({"max_results": 8})).await;
    assert!(second.ok, "{}", second.text);
    // ... and it too paid only for what it fetched: 6 used, 6 left.
    for _ in 0..6 {
        let r = call_tool(&mut w.g, "get_gmail", json!({"message_id": "aa0000"})).await;
        assert!(r.ok, "{}", r.text);
    }
    let spent = call_tool(&mut w.g, "get_gmail", json!({"message_id": "aa0000"})).await;
    assert_eq!(
        spent.error_kind,
        pb::ErrorKind::RateLimited as i32,
        "{}",
        spent.text
    );
}

#[tokio::test]
async fn g6_a_search_that_finds_fewer_than_max_results_gives_the_difference_back() {
    a_search_that_finds_fewer_gives_the_rest_back(Backend::Memory).await;
}

#[tokio::test]
async fn g6_a_search_that_finds_fewer_than_max_results_gives_the_difference_back_on_postgres() {
    a_search_that_finds_fewer_gives_the_rest_back(Backend::Postgres).await;
}

#[tokio::test]
async fn g6_a_search_asking_for_more_than_a_window_allows_is_cut_to_fit_and_says_so() {
    let mut w = gmail_world(Backend::Memory, "4/day", 10).await;
    let r = call_tool(&mut w.g, "search_gmail", json!({"max_results": 10})).await;
    assert!(r.ok, "{}", r.text);
    assert!(r.text.contains("3. [aa0002]"), "{}", r.text);
    assert!(!r.text.contains("[aa0003]"), "{}", r.text);
    assert!(
        r.text
            .contains("(At most 3 per search: the Gmail limit is 4 calls per day.)"),
        "{}",
        r.text
    );
    let list = w
        .gmail
        .recorded()
        .into_iter()
        .filter(|r| r.path == "/messages")
        .count();
    assert_eq!(list, 1);
}
