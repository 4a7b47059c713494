//! A side effect that fails (P-4, R-3): once its write may have reached the upstream it says so
//! and keeps its idempotency key, so a retry replays instead of sending twice; when no write
//! left, or the upstream refused it outright, it says what went wrong and frees the key.
//! Only a side effect is so lenient: a read-only tool's POST (Gmail's batch fetch) whose answer
//! is cut off fails as a GET would (G-4). A side effect whose result cannot be stored still
//! answers, inside its key's hold.
//! The engine runs the real Gmail tools against a scripted upstream on a local socket.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

mod common;

use common::upstream::{Answer, Upstream};
use gateway_svc::{
    context::CallContext,
    domain::{CallOutcome, CallRequest, Channel, ErrorKind, Integration, UserId},
    enforce::ToolError,
    engine::Engine,
    integrations::gmail::{self, GmailApi},
    registry::{Tool, ToolOutput, ToolSpec},
    store::{
        AuditEntry, AuditLog, AuditRecord, IdempotencyClaim, IdempotencyStore, KeyState,
        StoreError, StoredResult, memory::MemoryStore,
    },
};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A side effect standing in for a remote (MCP) tool: its call leaves, then the connection
/// breaks before an answer.
struct BrokenRemote;

#[async_trait::async_trait]
impl Tool for BrokenRemote {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(
            "remote_act",
            Integration::Mcp,
            "acts remotely",
            json!({"type": "object"}),
        )
        .with_side_effect()
    }

    async fn call(&self, ctx: &CallContext, _args: Value) -> Result<ToolOutput, ToolError> {
        ctx.upstream_attempt();
        ctx.write_attempt().await?;
        Err(ToolError::UpstreamUnavailable {
            service: "MCP server",
            detail: "the connection failed mid-call".into(),
        })
    }
}

async fn engine(upstream: &Upstream) -> Engine {
    engine_at(&upstream.base_url).await
}

/// The engine with Gmail at `base_url`.
async fn engine_at(base_url: &str) -> Engine {
    let stores = MemoryStore::stores();
    let mut tools = gmail::tools(GmailApi {
        base_url: base_url.to_owned(),
    });
    tools.push(Arc::new(BrokenRemote));
    let engine = common::engine(&stores, tools);
    common::connect(
        &engine,
        Integration::Gmail,
        "alice@example.com",
        "tok-alice",
    )
    .await;
    engine
}

async fn call(engine: &Engine, call_id: &str, tool: &str, args: Value) -> CallOutcome {
    common::call(engine, call_id, tool, args, "run-1/call-1").await
}

fn send_args() -> Value {
    json!({"to": "bob@example.com", "subject": "Hi", "body": "Hello"})
}

const SEND: &str = "POST /gmail/v1/users/me/messages/send";

/// Sends with the same idempotency key twice, the upstream answering the send as scripted:
/// the first outcome, the second, and how many sends reached the upstream.
async fn send_twice(script: fn(&str, &str) -> Answer) -> (CallOutcome, CallOutcome, usize) {
    let upstream = Upstream::start(script).await;
    let engine = engine(&upstream).await;
    let first = call(&engine, "c1", "gmail_send", send_args()).await;
    let second = call(&engine, "c2", "gmail_send", send_args()).await;
    (first, second, upstream.seen(SEND))
}

fn says_it_may_have_acted(outcome: &CallOutcome) -> bool {
    outcome
        .text
        .contains("so it may have taken effect. Do not repeat it")
}

#[tokio::test]
async fn p4_a_send_whose_connection_breaks_after_it_left_may_have_acted_and_is_never_sent_again() {
    let (first, second, sends) = send_twice(|_, _| Answer::Hangup).await;
    assert!(says_it_may_have_acted(&first), "{}", first.text);
    assert_eq!(first.error_kind, Some(ErrorKind::UpstreamUnavailable));
    assert!(!first.text.contains("Try again later"), "{}", first.text);
    assert!(second.replayed, "the retry replays: {}", second.text);
    assert_eq!(sends, 1);
}

#[tokio::test]
async fn p4_a_send_answered_by_a_bad_gateway_may_have_acted_and_is_never_sent_again() {
    for status in [500, 502, 504] {
        let script: fn(&str, &str) -> Answer = match status {
            500 => |_, _| Answer::Status(500, "{}"),
            502 => |_, _| Answer::Status(502, "{}"),
            _ => |_, _| Answer::Status(504, "{}"),
        };
        let (first, second, sends) = send_twice(script).await;
        assert!(says_it_may_have_acted(&first), "{status}: {}", first.text);
        assert!(
            first.text.contains(&format!("HTTP {status}")),
            "{}",
            first.text
        );
        assert_eq!(first.error_kind, Some(ErrorKind::UpstreamError));
        assert!(second.replayed, "{status}");
        assert_eq!(sends, 1, "{status}");
    }
}

#[tokio::test]
async fn p4_a_send_accepted_with_an_unreadable_answer_is_done_with_an_unknown_id() {
    let (first, second, sends) = send_twice(|_, _| Answer::Status(200, "<html>ok")).await;
    assert!(first.ok(), "{}", first.text);
    assert_eq!(
        first.text,
        "Sent \"Hi\" from alice@example.com to bob@example.com (message unknown)."
    );
    assert!(second.replayed);
    assert_eq!(sends, 1);
}

#[tokio::test]
async fn p4_a_send_accepted_with_an_answer_cut_off_mid_stream_is_done_and_never_sent_again() {
    let (first, second, sends) =
        send_twice(|_, _| Answer::CutOff("application/json", r#"{"id":"#)).await;
    assert!(first.ok(), "{}", first.text);
    assert_eq!(
        first.text,
        "Sent \"Hi\" from alice@example.com to bob@example.com (message unknown)."
    );
    assert!(second.replayed);
    assert_eq!(sends, 1);
}

/// Gmail lists two messages, then cuts off its batch answer with their metadata mid-stream.
fn batch_cut_off(method: &str, _path: &str) -> Answer {
    match method {
        "GET" => Answer::Status(200, r#"{"messages":[{"id":"m1"},{"id":"m2"}]}"#),
        _ => Answer::CutOff(
            "multipart/mixed; boundary=batch_cut",
            "--batch_cut\r\nContent-Type: application/http\r\nContent-ID: <response-item-0>\r\n\r\nHTTP/1.1 200 OK\r\n",
        ),
    }
}

#[tokio::test]
async fn g4_i1_a_search_whose_batch_answer_is_cut_off_is_a_clear_gmail_error_not_missing_messages()
{
    let upstream = Upstream::start(batch_cut_off).await;
    let engine = engine(&upstream).await;
    let found = call(&engine, "c1", "search_gmail", json!({"query": "in:inbox"})).await;
    assert_eq!(
        found.error_kind,
        Some(ErrorKind::UpstreamError),
        "{}",
        found.text
    );
    assert_eq!(
        found.text,
        "Gmail sent a response that could not be read (the response body was cut off)."
    );
    assert!(!found.text.contains("missing"), "{}", found.text);
    assert_eq!(upstream.seen("POST /batch/gmail/v1"), 1);
}

#[tokio::test]
async fn p4_a_send_refused_outright_did_nothing_and_frees_its_key_for_a_retry() {
    // A 400: the request as it is will fail again; a 401 with no way to refresh: the token.
    for script in [
        (|_, _| {
            Answer::Status(
                400,
                r#"{"error":{"errors":[{"reason":"invalidArgument"}]}}"#,
            )
        }) as fn(&str, &str) -> Answer,
        |_, _| Answer::Status(401, "{}"),
    ] {
        let (first, second, sends) = send_twice(script).await;
        assert!(!first.ok());
        assert!(!says_it_may_have_acted(&first), "{}", first.text);
        assert!(!second.replayed, "nothing was done, so nothing is replayed");
        assert_eq!(sends, 2);
    }
}

#[tokio::test]
async fn p4_a_reply_whose_read_of_the_original_fails_did_nothing_and_frees_its_key() {
    let upstream = Upstream::start(|method, _| match method {
        "GET" => Answer::Status(502, "{}"),
        _ => Answer::Status(200, r#"{"id":"m2"}"#),
    })
    .await;
    let engine = engine(&upstream).await;
    let args = json!({"message_id": "m1", "body": "Thanks"});
    let first = call(&engine, "c1", "gmail_reply", args.clone()).await;
    assert_eq!(first.error_kind, Some(ErrorKind::UpstreamError));
    assert!(!says_it_may_have_acted(&first), "{}", first.text);
    assert!(first.text.contains("It may work if tried again later"));
    let second = call(&engine, "c2", "gmail_reply", args).await;
    assert!(!second.replayed, "the key was freed: {}", second.text);
    assert_eq!(upstream.seen("GET /gmail/v1/users/me/messages/m1"), 2);
    assert_eq!(upstream.seen(SEND), 0);
}

#[tokio::test]
async fn p4_a_remote_side_effect_whose_connection_breaks_mid_call_may_have_acted() {
    let upstream = Upstream::start(|_, _| Answer::Hangup).await;
    let engine = engine(&upstream).await;
    let first = call(&engine, "c1", "remote_act", json!({})).await;
    assert!(says_it_may_have_acted(&first), "{}", first.text);
    assert_eq!(first.error_kind, Some(ErrorKind::UpstreamUnavailable));
    let second = call(&engine, "c2", "remote_act", json!({})).await;
    assert!(second.replayed);
}

#[tokio::test]
async fn p4_a_send_that_could_not_connect_never_left_and_frees_its_key_for_a_retry() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base_url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let engine = engine_at(&base_url).await;
    let first = call(&engine, "c1", "gmail_send", send_args()).await;
    assert_eq!(first.error_kind, Some(ErrorKind::UpstreamUnavailable));
    assert!(!says_it_may_have_acted(&first), "{}", first.text);
    assert!(
        first.text.contains("could not be reached"),
        "{}",
        first.text
    );
    let second = call(&engine, "c2", "gmail_send", send_args()).await;
    assert!(!second.replayed, "nothing left, so nothing is replayed");
    assert_eq!(second.error_kind, Some(ErrorKind::UpstreamUnavailable));
}

#[tokio::test]
async fn p4_a_send_answered_by_a_redirect_may_have_acted_and_the_redirect_is_never_followed() {
    let upstream = Upstream::start(|method, _| match method {
        "POST" => Answer::Redirect(303, "/gmail/v1/users/me/messages/elsewhere"),
        _ => Answer::Status(404, "{}"),
    })
    .await;
    let engine = engine(&upstream).await;
    let first = call(&engine, "c1", "gmail_send", send_args()).await;
    assert!(says_it_may_have_acted(&first), "{}", first.text);
    assert!(first.text.contains("HTTP 303"), "{}", first.text);
    let second = call(&engine, "c2", "gmail_send", send_args()).await;
    assert!(second.replayed, "the retry replays: {}", second.text);
    assert_eq!(upstream.seen(SEND), 1);
    assert_eq!(upstream.seen("GET "), 0, "the redirect was not followed");
}

/// A side effect that acts at once, with no HTTP: its write leaves and it succeeds.
struct Acts;

#[async_trait::async_trait]
impl Tool for Acts {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(
            "remote_send",
            Integration::Mcp,
            "acts remotely",
            json!({"type": "object"}),
        )
        .with_side_effect()
    }

    async fn call(&self, ctx: &CallContext, _args: Value) -> Result<ToolOutput, ToolError> {
        ctx.upstream_attempt();
        ctx.write_attempt().await?;
        Ok(ToolOutput::text("Sent."))
    }
}

/// What happened to the one key claimed from [`HangingResults`], on tokio's clock.
#[derive(Default, Clone, Copy)]
struct KeyLog {
    /// When it was claimed, and for how long.
    claimed: Option<(Instant, Duration)>,
    result_write_began: Option<Instant>,
    /// When the hanging write was given up (its future dropped).
    result_write_dropped: Option<Instant>,
    /// When the claim was let go without a result, to lapse at the end of its hold.
    abandoned: Option<Instant>,
}

/// An idempotency store whose result writes never finish, as a database that took the write
/// and then hung would.
#[derive(Default)]
struct HangingResults(Arc<Mutex<KeyLog>>);

impl HangingResults {
    fn log(&self) -> KeyLog {
        *self.0.lock().unwrap()
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for HangingResults {
    async fn claim(
        &self,
        _user: &gateway_svc::domain::UserId,
        _key: &str,
        hold: Duration,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError> {
        self.0.lock().unwrap().claimed = Some((Instant::now(), hold));
        Ok(Box::new(HangingClaim(self.0.clone())))
    }

    async fn lookup(
        &self,
        _user: &gateway_svc::domain::UserId,
        _key: &str,
    ) -> Result<KeyState, StoreError> {
        Ok(KeyState::Held)
    }

    async fn prune_idempotency(
        &self,
        _older_than: std::time::SystemTime,
        _limit: usize,
    ) -> Result<usize, StoreError> {
        Ok(0)
    }
}

struct HangingClaim(Arc<Mutex<KeyLog>>);

/// Notes when the write holding it is given up.
struct WriteInFlight(Arc<Mutex<KeyLog>>);

impl Drop for WriteInFlight {
    fn drop(&mut self) {
        self.0.lock().unwrap().result_write_dropped = Some(Instant::now());
    }
}

#[async_trait::async_trait]
impl IdempotencyClaim for HangingClaim {
    fn existing(&self) -> Option<&StoredResult> {
        None
    }

    async fn complete(&mut self, _result: &StoredResult) -> Result<(), StoreError> {
        self.0.lock().unwrap().result_write_began = Some(Instant::now());
        let _in_flight = WriteInFlight(self.0.clone());
        std::future::pending().await
    }

    fn abandon(self: Box<Self>) {
        self.0.lock().unwrap().abandoned = Some(Instant::now());
    }

    fn acting(&self) -> Option<Arc<dyn gateway_svc::store::ActingMark>> {
        None
    }
}

#[tokio::test(start_paused = true)]
async fn p4_r3_a_result_write_that_hangs_is_given_up_within_15_seconds_and_the_call_answers_inside_its_keys_hold()
 {
    let stores = MemoryStore::stores();
    let mut engine = common::engine(&stores, vec![Arc::new(Acts)]);
    let results = Arc::new(HangingResults::default());
    engine.idempotency = results.clone();

    let sent = call(&engine, "c1", "remote_send", json!({})).await;
    let answered = Instant::now();

    assert!(sent.ok(), "the send happened: {}", sent.text);
    assert_eq!(sent.text, "Sent.");
    let log = results.log();
    let (claimed, hold) = log.claimed.expect("the key was claimed");
    let began = log.result_write_began.expect("its result write began");
    let dropped = log
        .result_write_dropped
        .expect("the hanging write was given up");
    let waited = dropped - began;
    assert!(
        waited >= Duration::from_secs(15) && waited < Duration::from_secs(16),
        "gave up after {waited:?}"
    );
    assert_eq!(
        log.abandoned,
        Some(dropped),
        "the key is left to lapse at the end of its hold, not freed for a retry"
    );
    assert!(
        answered < claimed + hold,
        "answered {:?} after the claim, its hold {hold:?}",
        answered - claimed
    );
}

/// An audit log whose writes of upstream records take `delay` (a database that is slow just
/// then); every other record is written at once.
struct SlowUpstreamRecords {
    log: Arc<dyn AuditLog>,
    delay: Duration,
}

#[async_trait::async_trait]
impl AuditLog for SlowUpstreamRecords {
    async fn record(&self, record: AuditRecord) -> Result<(), StoreError> {
        self.record_many(&[AuditEntry::now(record)]).await
    }

    async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError> {
        if entries.iter().any(|e| e.record.kind == "upstream_call") {
            tokio::time::sleep(self.delay).await;
        }
        self.log.record_many(entries).await
    }

    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        self.log.recent(user, limit).await
    }

    async fn prune_audit(
        &self,
        older_than: std::time::SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError> {
        self.log.prune_audit(older_than, limit).await
    }
}

/// G-9, P-5: a send Gmail answered 200 is done even when its upstream record takes longer to
/// write than the call's deadline: the record is written after the deadline, not cut off by
/// it, and the send is not reported as unanswered.
#[tokio::test]
async fn g9_p5_a_send_whose_upstream_record_is_slow_to_write_is_done_and_its_record_kept() {
    let upstream =
        Upstream::start(|_, _| Answer::Status(200, r#"{"id": "m1", "threadId": "t1"}"#)).await;
    let mut stores = MemoryStore::stores();
    let log = stores.audit.clone();
    let deadline = Duration::from_secs(1);
    stores.audit = Arc::new(SlowUpstreamRecords {
        log: log.clone(),
        delay: deadline + Duration::from_millis(500),
    });
    let tools = gmail::tools(GmailApi {
        base_url: upstream.base_url.clone(),
    });
    let engine = common::engine(&stores, tools);
    common::connect(&engine, Integration::Gmail, "alice@example.com", "tok").await;
    let request = CallRequest {
        call_id: "c1".into(),
        tool: "gmail_send".into(),
        args: send_args(),
        idempotency_key: Some("run-1/call-1".into()),
        channel: Channel::Web,
        timeout: Some(deadline),
        run_id: None,
        read_external_from: Vec::new(),
        expected_binding: None,
        time_zone: None,
    };

    let sent = engine
        .execute(&common::user(), request, CancellationToken::new())
        .await;

    assert!(sent.ok(), "{}", sent.text);
    assert!(!sent.text.contains("did not answer"), "{}", sent.text);
    let records = log.recent(&common::user(), 10).await.unwrap();
    assert!(
        records
            .iter()
            .any(|r| r.kind == "upstream_call" && r.call_id == "c1" && r.status == "200"),
        "{records:?}"
    );
    assert_eq!(upstream.seen(SEND), 1);
}

/// A side effect whose write Gmail accepts, and which then never finishes (a later step that
/// hangs).
struct SendsThenHangs(String);

#[async_trait::async_trait]
impl Tool for SendsThenHangs {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(
            "send_then_hang",
            Integration::Gmail,
            "sends, then hangs",
            json!({"type": "object"}),
        )
        .with_side_effect()
    }

    async fn call(&self, ctx: &CallContext, _args: Value) -> Result<ToolOutput, ToolError> {
        let url = format!("{}/gmail/v1/users/me/messages/send", self.0);
        ctx.send(Integration::Gmail, "alice@example.com", |token| {
            ctx.http().post(&url).bearer_auth(token).body("{}")
        })
        .await?;
        std::future::pending().await
    }
}

/// P-4: a side effect whose write was answered 2xx and which then ran out of time is told it
/// was done, never that the upstream "did not answer".
#[tokio::test]
async fn p4_a_side_effect_that_runs_out_of_time_after_its_write_was_accepted_is_told_it_was_done() {
    let upstream = Upstream::start(|_, _| Answer::Status(200, r#"{"id": "m1"}"#)).await;
    let stores = MemoryStore::stores();
    let engine = common::engine(
        &stores,
        vec![Arc::new(SendsThenHangs(upstream.base_url.clone()))],
    );
    common::connect(&engine, Integration::Gmail, "alice@example.com", "tok").await;
    let request = CallRequest {
        call_id: "c1".into(),
        tool: "send_then_hang".into(),
        args: json!({}),
        idempotency_key: Some("run-1/call-1".into()),
        channel: Channel::Web,
        timeout: Some(Duration::from_secs(1)),
        run_id: None,
        read_external_from: Vec::new(),
        expected_binding: None,
        time_zone: None,
    };

    let sent = engine
        .execute(&common::user(), request, CancellationToken::new())
        .await;

    assert!(!sent.text.contains("did not answer"), "{}", sent.text);
    assert_eq!(
        sent.text,
        "Gmail accepted the request, but the call did not finish within 1 seconds. It has taken \
         effect: do not repeat it; tell the user it was done and its details are unconfirmed."
    );
    let again = common::call(&engine, "c2", "send_then_hang", json!({}), "run-1/call-1").await;
    assert!(again.replayed, "{}", again.text);
    assert_eq!(upstream.seen(SEND), 1);
}
