//! The gateway's audit trail (G-9, P-5, issue 13): one place every audit record goes through,
//! by one of two paths.
//!
//! - [`AuditLog::record`] writes at once, before the caller goes on. Side effects use it: the
//!   intent record before the effect (no side effect without its record written first) and
//!   every later record of a side-effect call.
//! - [`AuditTrail::record_later`] hands the record of a call with no side effect to a bounded
//!   queue drained by one writer task, which writes whatever has gathered as one multi-row
//!   INSERT ([`AuditLog::record_many`]) while the calls go on. Nothing is dropped: a full queue
//!   makes the caller wait for space (counted, and warned about at most every
//!   [`WARN_EVERY`]); a batch that fails is kept and retried with capped exponential backoff;
//!   closing the queue ([`AuditTrail::close`], when the service drains) writes everything still
//!   queued, and whatever cannot be written by the deadline is logged loudly with its count.
//!   Each record keeps the time of its call, not of its write.
//!
//! Reading through the trail ([`AuditLog::recent`]) first waits for everything queued before
//! the read, so a caller reads its own calls' records.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::{
    sync::{
        mpsc::{self, error::TrySendError},
        oneshot, watch,
    },
    task::JoinHandle,
};
use tokio_util::sync::CancellationToken;

use crate::{
    config::AuditQueueConfig,
    domain::UserId,
    store::{AuditEntry, AuditLog, AuditRecord, StoreError},
};

/// A full queue is warned about at most this often (every wait is counted in the metric).
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// What the writer has done so far, for tests and operators (`AuditTrail::stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditStats {
    /// Records handed to the writer and not yet written: queued, or in the batch being written
    /// (the `steward_gateway_audit_queue_depth` gauge).
    pub pending: usize,
    /// Records written by the writer.
    pub written: u64,
    /// Batches written (each one INSERT).
    pub batches: u64,
    /// The most records one batch held.
    pub largest_batch: usize,
    /// Batch writes that failed (each then retried).
    pub failures: u64,
    /// Calls that found the queue full and waited for space.
    pub waits: u64,
}

// Nearly every item is a record; boxing it would add an allocation per call for the rare flush.
#[allow(clippy::large_enum_variant)]
enum Item {
    Record(AuditEntry),
    /// Answered once everything queued before it is written.
    Flush(oneshot::Sender<()>),
}

pub struct AuditTrail {
    store: Arc<dyn AuditLog>,
    queue: mpsc::Sender<Item>,
    capacity: usize,
    stats: Arc<watch::Sender<AuditStats>>,
    closing: CancellationToken,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// When the next full-queue warning may be logged, in ms since `epoch`.
    next_warning_ms: AtomicU64,
    /// Waits since the last warning, reported with the next one.
    unwarned_waits: AtomicU64,
    epoch: Instant,
}

impl AuditTrail {
    /// The trail over `store`, its writer task started (call from within the runtime).
    pub fn start(store: Arc<dyn AuditLog>, config: &AuditQueueConfig) -> Arc<Self> {
        let capacity = config.capacity.max(1);
        let (queue, received) = mpsc::channel(capacity);
        let stats = Arc::new(watch::Sender::new(AuditStats::default()));
        let closing = CancellationToken::new();
        let writer = Writer {
            store: store.clone(),
            stats: stats.clone(),
            max_batch: config.max_batch.max(1),
            retry_first: config.retry_first,
            retry_max: config.retry_max.max(config.retry_first),
            closing: closing.clone(),
        };
        Arc::new(Self {
            store,
            queue,
            capacity,
            stats,
            closing,
            writer: Mutex::new(Some(tokio::spawn(writer.run(received)))),
            next_warning_ms: AtomicU64::new(0),
            unwarned_waits: AtomicU64::new(0),
            epoch: Instant::now(),
        })
    }

    /// Hands `record` to the batching writer; returns once it is queued, waiting for space
    /// when the queue is full. After [`AuditTrail::close`] it is written at once instead.
    pub async fn record_later(&self, record: AuditRecord) {
        // Counted before it is queued, so the writer never settles more than was counted.
        self.stats.send_modify(|s| s.pending += 1);
        crate::metrics::audit_queue_depth(1);
        let item = match self.queue.try_send(Item::Record(AuditEntry::now(record))) {
            Ok(()) => return,
            Err(TrySendError::Full(item)) => item,
            Err(TrySendError::Closed(item)) => return self.write_now(item).await,
        };
        self.waited();
        if let Err(mpsc::error::SendError(item)) = self.queue.send(item).await {
            self.write_now(item).await;
        }
    }

    /// Waits until every record queued before this call is written (while the store refuses
    /// writes, until it takes them again). Returns at once once the queue is closed.
    pub async fn flush(&self) {
        let (done, written) = oneshot::channel();
        if self.queue.send(Item::Flush(done)).await.is_ok() {
            let _ = written.await;
        }
    }

    /// What the writer has done so far; `wait_for` on it to wait for a condition.
    pub fn stats(&self) -> watch::Receiver<AuditStats> {
        self.stats.subscribe()
    }

    /// Closes the queue — records handed over from now on are written at once — and waits
    /// until `deadline` for the writer to write everything still queued. Returns how many
    /// records it could not write (each logged as lost, loudly, with the count).
    pub async fn close(&self, deadline: tokio::time::Instant) -> usize {
        self.closing.cancel();
        let writer = self.writer.lock().ok().and_then(|mut w| w.take());
        let Some(mut writer) = writer else {
            return 0;
        };
        let queued = self.stats.borrow().pending;
        if tokio::time::timeout_at(deadline, &mut writer).await.is_ok() {
            tracing::info!(
                flushed = queued,
                "audit queue closed; every queued record is written"
            );
            return 0;
        }
        writer.abort();
        let unwritten = self.stats.borrow().pending;
        tracing::error!(
            unwritten,
            "AUDIT RECORDS LOST: {unwritten} audit record(s) of read-only calls could not be written \
             before the drain deadline (is the database down?)"
        );
        unwritten
    }

    /// A record that can no longer be queued (the queue is closed: the service is stopping)
    /// is written at once, like a side effect's.
    async fn write_now(&self, item: Item) {
        self.stats.send_modify(|s| s.pending -= 1);
        crate::metrics::audit_queue_depth(-1);
        if let Item::Record(entry) = item
            && let Err(e) = self.store.record_many(std::slice::from_ref(&entry)).await
        {
            tracing::error!(error = %e, tool = %entry.record.tool, "could not write an audit record");
        }
    }

    /// A caller found the queue full: counted every time, warned about at most every
    /// [`WARN_EVERY`] (with the count since the last warning).
    fn waited(&self) {
        self.stats.send_modify(|s| s.waits += 1);
        crate::metrics::audit_queue_waited();
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_warning_ms.load(Ordering::Relaxed);
        let every = u64::try_from(WARN_EVERY.as_millis()).unwrap_or(u64::MAX);
        if now >= next
            && self
                .next_warning_ms
                .compare_exchange(next, now + every, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let waits = self.unwarned_waits.swap(0, Ordering::Relaxed) + 1;
            tracing::warn!(
                capacity = self.capacity,
                waits,
                "the audit queue is full: read-only calls are waiting for the audit writer \
                 (is the database slow or down?)"
            );
        } else {
            self.unwarned_waits.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The trail is an [`AuditLog`]: `record` and `record_many` write at once; `recent` first waits
/// for the queue, so what a caller's calls recorded is there.
#[async_trait::async_trait]
impl AuditLog for AuditTrail {
    async fn record(&self, record: AuditRecord) -> Result<(), StoreError> {
        self.store.record(record).await
    }

    async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError> {
        self.store.record_many(entries).await
    }

    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        self.flush().await;
        self.store.recent(user, limit).await
    }
}

/// The one task that drains the queue.
struct Writer {
    store: Arc<dyn AuditLog>,
    stats: Arc<watch::Sender<AuditStats>>,
    max_batch: usize,
    retry_first: Duration,
    retry_max: Duration,
    closing: CancellationToken,
}

impl Writer {
    async fn run(self, mut queue: mpsc::Receiver<Item>) {
        let mut items = Vec::with_capacity(self.max_batch);
        let mut closed = false;
        loop {
            // Whatever gathered while the last batch was written, up to `max_batch`: one
            // record at a time when the store keeps up, bigger batches when it does not.
            let received = tokio::select! {
                n = queue.recv_many(&mut items, self.max_batch) => n,
                () = self.closing.cancelled(), if !closed => {
                    // Nothing new comes in; everything already queued is still received.
                    queue.close();
                    closed = true;
                    continue;
                }
            };
            if received == 0 {
                return;
            }
            let mut entries = Vec::with_capacity(items.len());
            let mut flushes = Vec::new();
            for item in items.drain(..) {
                match item {
                    Item::Record(entry) => entries.push(entry),
                    Item::Flush(done) => flushes.push(done),
                }
            }
            if !entries.is_empty() {
                self.write(&entries).await;
            }
            for done in flushes {
                let _ = done.send(());
            }
        }
    }

    /// Writes one batch, retrying until it is written: a batch is never dropped.
    async fn write(&self, entries: &[AuditEntry]) {
        let mut pause = self.retry_first;
        let mut attempt: u32 = 0;
        while let Err(e) = self.store.record_many(entries).await {
            attempt += 1;
            self.stats.send_modify(|s| s.failures += 1);
            crate::metrics::audit_write_failed();
            tracing::error!(
                error = %e,
                waiting = self.stats.borrow().pending,
                batch = entries.len(),
                attempt,
                retry_in_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
                "could not write audit records; keeping them and retrying"
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(self.retry_max);
        }
        let n = entries.len();
        self.stats.send_modify(|s| {
            s.pending -= n;
            s.written += n as u64;
            s.batches += 1;
            s.largest_batch = s.largest_batch.max(n);
        });
        crate::metrics::audit_queue_depth(-(n as i64));
        crate::metrics::audit_batch_written(n);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use serde_json::{Value, json};
    use tokio::sync::watch;

    use super::*;
    use crate::{
        context::{CallContext, Services},
        credentials::{Credentials, cipher::TokenCipher},
        domain::{CallRequest, Channel, Integration},
        enforce::ToolError,
        engine::{Engine, EngineConfig},
        ratelimit::{RateLimiter, memory::MemoryRateLimits},
        registry::{Registry, Tool, ToolOutput, ToolSpec},
        store::memory::MemoryStore,
    };

    /// An audit log whose batch writes can be held (`open`), made to fail (`down`), and
    /// watched starting (`started`). Single-record writes (`record`) always go through.
    struct FakeLog {
        batches: Mutex<Vec<Vec<AuditRecord>>>,
        singles: Mutex<Vec<AuditRecord>>,
        open: watch::Sender<bool>,
        started: watch::Sender<usize>,
        down: AtomicBool,
    }

    impl FakeLog {
        fn new(open: bool) -> Arc<Self> {
            Arc::new(Self {
                batches: Mutex::new(Vec::new()),
                singles: Mutex::new(Vec::new()),
                open: watch::Sender::new(open),
                started: watch::Sender::new(0),
                down: AtomicBool::new(false),
            })
        }

        fn open(&self) {
            self.open.send_replace(true);
        }

        /// Waits until `n` batch writes have started.
        async fn started(&self, n: usize) {
            self.started
                .subscribe()
                .wait_for(|s| *s >= n)
                .await
                .unwrap();
        }

        fn batch_sizes(&self) -> Vec<usize> {
            self.batches.lock().unwrap().iter().map(Vec::len).collect()
        }

        fn call_ids(&self) -> Vec<String> {
            self.batches
                .lock()
                .unwrap()
                .iter()
                .flatten()
                .map(|r| r.call_id.clone())
                .collect()
        }
    }

    #[async_trait::async_trait]
    impl AuditLog for FakeLog {
        async fn record(&self, record: AuditRecord) -> Result<(), StoreError> {
            self.singles.lock().unwrap().push(record);
            Ok(())
        }

        async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError> {
            self.started.send_modify(|n| *n += 1);
            self.open.subscribe().wait_for(|open| *open).await.unwrap();
            if self.down.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("the database is down".into()));
            }
            self.batches
                .lock()
                .unwrap()
                .push(entries.iter().map(|e| e.record.clone()).collect());
            Ok(())
        }

        async fn recent(
            &self,
            user: &UserId,
            limit: usize,
        ) -> Result<Vec<AuditRecord>, StoreError> {
            let batches = self.batches.lock().unwrap();
            let mine: Vec<_> = batches
                .iter()
                .flatten()
                .filter(|r| r.user == user.as_str())
                .cloned()
                .collect();
            Ok(mine[mine.len().saturating_sub(limit)..].to_vec())
        }
    }

    fn record(call_id: &str) -> AuditRecord {
        AuditRecord {
            user: "u1".into(),
            kind: "tool_call".into(),
            tool: "read".into(),
            integration: None,
            account: None,
            call_id: call_id.into(),
            run_id: None,
            status: "ok".into(),
            latency_ms: 1,
            bytes: 2,
            upstream_calls: 0,
        }
    }

    fn config(capacity: usize, max_batch: usize) -> AuditQueueConfig {
        AuditQueueConfig {
            capacity,
            max_batch,
            retry_first: Duration::from_millis(1),
            retry_max: Duration::from_millis(4),
            ..AuditQueueConfig::default()
        }
    }

    fn ids(range: std::ops::Range<usize>) -> Vec<String> {
        range.map(|i| format!("c{i}")).collect()
    }

    #[tokio::test]
    async fn records_gathered_while_a_batch_is_written_go_in_one_insert() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        trail.record_later(record("c0")).await;
        // The writer holds c0 in a write that cannot finish yet; the rest gather behind it.
        log.started(1).await;
        for i in 1..10 {
            trail.record_later(record(&format!("c{i}"))).await;
        }
        assert_eq!(trail.stats().borrow().pending, 10);
        log.open();
        trail.flush().await;
        assert_eq!(log.batch_sizes(), [1, 9]);
        assert_eq!(log.call_ids(), ids(0..10), "every record, in order");
        let stats = trail.stats().borrow().clone();
        assert_eq!(
            (
                stats.pending,
                stats.written,
                stats.batches,
                stats.largest_batch,
                stats.waits
            ),
            (0, 10, 2, 9, 0)
        );
    }

    #[tokio::test]
    async fn a_full_queue_makes_the_caller_wait_and_nothing_is_dropped() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(2, 1));
        trail.record_later(record("c0")).await;
        log.started(1).await;
        // Two fit in the queue behind the write in progress ...
        trail.record_later(record("c1")).await;
        trail.record_later(record("c2")).await;
        // ... the third waits for space.
        let waiting = tokio::spawn({
            let trail = trail.clone();
            async move { trail.record_later(record("c3")).await }
        });
        trail.stats().wait_for(|s| s.waits == 1).await.unwrap();
        assert!(
            !waiting.is_finished(),
            "the caller waits while the queue is full"
        );
        assert!(log.call_ids().is_empty());
        log.open();
        waiting.await.unwrap();
        trail.flush().await;
        assert_eq!(log.call_ids(), ids(0..4));
        assert_eq!(
            log.batch_sizes(),
            [1, 1, 1, 1],
            "at most AUDIT_MAX_BATCH per insert"
        );
    }

    #[tokio::test]
    async fn a_failed_batch_is_kept_and_retried_until_the_store_recovers_and_lands_once() {
        let log = FakeLog::new(true);
        log.down.store(true, Ordering::SeqCst);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        for i in 0..5 {
            trail.record_later(record(&format!("c{i}"))).await;
        }
        trail.stats().wait_for(|s| s.failures >= 3).await.unwrap();
        assert!(log.call_ids().is_empty());
        assert_eq!(trail.stats().borrow().pending, 5, "nothing dropped");
        log.down.store(false, Ordering::SeqCst);
        trail.flush().await;
        assert_eq!(
            log.call_ids(),
            ids(0..5),
            "each record exactly once, in order"
        );
        assert_eq!(trail.stats().borrow().pending, 0);
    }

    #[tokio::test]
    async fn closing_writes_everything_queued_then_later_records_are_written_at_once() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        for i in 0..5 {
            trail.record_later(record(&format!("c{i}"))).await;
        }
        log.started(1).await;
        let closing = tokio::spawn({
            let trail = trail.clone();
            async move {
                trail
                    .close(tokio::time::Instant::now() + Duration::from_secs(30))
                    .await
            }
        });
        log.open();
        assert_eq!(closing.await.unwrap(), 0, "nothing left unwritten");
        assert_eq!(log.call_ids(), ids(0..5));
        // Closed: a record is written before record_later returns.
        trail.record_later(record("c5")).await;
        assert_eq!(log.call_ids(), ids(0..6));
        assert_eq!(trail.stats().borrow().pending, 0);
        trail.flush().await; // returns at once on a closed queue
    }

    #[tokio::test]
    async fn what_cannot_be_written_by_the_deadline_is_counted() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        for i in 0..3 {
            trail.record_later(record(&format!("c{i}"))).await;
        }
        log.started(1).await;
        // The store never answers: the deadline is what ends the wait.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(50);
        assert_eq!(trail.close(deadline).await, 3);
    }

    #[tokio::test]
    async fn reading_through_the_trail_sees_what_is_still_queued() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        trail.record_later(record("c0")).await;
        log.started(1).await;
        let reading = tokio::spawn({
            let trail = trail.clone();
            async move { trail.recent(&UserId::parse("u1").unwrap(), 10).await }
        });
        log.open();
        let read = reading.await.unwrap().unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].call_id, "c0");
    }

    /// A tool with no side effect, and one with: the latter asserts its intent record was
    /// written before it runs.
    struct Probe {
        side_effect: bool,
        log: Arc<FakeLog>,
    }

    #[async_trait::async_trait]
    impl Tool for Probe {
        fn spec(&self) -> ToolSpec {
            let name = if self.side_effect { "act" } else { "read" };
            let spec = ToolSpec::new(name, Integration::Tasks, name, json!({"type": "object"}));
            if self.side_effect {
                spec.with_side_effect()
            } else {
                spec
            }
        }

        async fn call(&self, _ctx: &CallContext, _args: Value) -> Result<ToolOutput, ToolError> {
            if self.side_effect {
                let intents = self.log.singles.lock().unwrap().clone();
                if !intents.iter().any(|r| r.kind == "side_effect_intent") {
                    return Err(ToolError::Internal(
                        "acted before the intent was written".into(),
                    ));
                }
            }
            Ok(ToolOutput::text("done"))
        }
    }

    fn engine(log: &Arc<FakeLog>, trail: Arc<AuditTrail>) -> Engine {
        let stores = MemoryStore::stores();
        let http = reqwest::Client::new();
        let services = Arc::new(Services {
            credentials: Credentials::new(
                stores.accounts.clone(),
                Some(TokenCipher::ephemeral()),
                None,
                http.clone(),
            ),
            limiter: RateLimiter::new(Arc::new(MemoryRateLimits::default()), |_| None),
            http,
            audit: trail,
            max_body_bytes: 1 << 20,
        });
        let tools: Vec<Arc<dyn Tool>> = vec![
            Arc::new(Probe {
                side_effect: false,
                log: log.clone(),
            }),
            Arc::new(Probe {
                side_effect: true,
                log: log.clone(),
            }),
        ];
        Engine {
            registry: Arc::new(Registry::new(tools).unwrap()),
            services,
            idempotency: stores.idempotency.clone(),
            config: EngineConfig {
                max_result_chars: 6000,
                default_timeout: Duration::from_secs(10),
                max_timeout: Duration::from_secs(10),
            },
        }
    }

    fn call(tool: &str, call_id: &str) -> CallRequest {
        CallRequest {
            call_id: call_id.into(),
            tool: tool.into(),
            args: json!({}),
            idempotency_key: Some(format!("key-{call_id}")),
            channel: Channel::Web,
            timeout: None,
            run_id: None,
            read_external_from: Vec::new(),
            expected_binding: None,
        }
    }

    #[tokio::test]
    async fn a_reads_record_is_queued_off_the_call_path_and_a_side_effects_written_at_once() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        let engine = engine(&log, trail.clone());
        let user = UserId::parse("u1").unwrap();

        // The batch writer cannot write, yet reads complete: their records wait in the queue.
        let read = engine
            .execute(&user, call("read", "r1"), CancellationToken::new())
            .await;
        assert!(read.error_kind.is_none(), "{}", read.text);
        log.started(1).await;
        let read = engine
            .execute(&user, call("read", "r2"), CancellationToken::new())
            .await;
        assert!(read.error_kind.is_none(), "{}", read.text);
        assert_eq!(trail.stats().borrow().pending, 2);

        // A side effect: its intent before it runs (the tool checks), its result record
        // before the call returns, neither through the queue.
        let act = engine
            .execute(&user, call("act", "a1"), CancellationToken::new())
            .await;
        assert!(act.error_kind.is_none(), "{}", act.text);
        let singles: Vec<_> = log
            .singles
            .lock()
            .unwrap()
            .iter()
            .map(|r| (r.kind.clone(), r.call_id.clone()))
            .collect();
        assert_eq!(
            singles,
            [
                ("side_effect_intent".to_owned(), "a1".to_owned()),
                ("tool_call".to_owned(), "a1".to_owned())
            ]
        );
        assert_eq!(trail.stats().borrow().pending, 2);

        log.open();
        trail.flush().await;
        assert_eq!(log.call_ids(), ["r1", "r2"]);
    }
}
