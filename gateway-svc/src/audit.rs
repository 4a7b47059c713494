//! The gateway's audit trail (G-9, P-5, issue 13): one place every audit record goes through,
//! by one of two paths.
//!
//! - [`AuditLog::record`] writes at once, before the caller goes on. Every call that writes
//!   anything uses it — side effects (the intent record before the effect: no side effect
//!   without its record written first) and Steward's own writes (tasks, memories, reminders) —
//!   and so does every call whose tool is not declared read-only (`Tool::read_only`).
//! - [`AuditTrail::enqueue`] hands the records of a read-only call to a bounded queue drained
//!   by one writer task, which writes whatever has gathered as one multi-row INSERT
//!   ([`AuditLog::record_many`]) while the calls go on. Nothing is dropped on the way: a full
//!   queue makes the caller wait for space (counted, and warned about at most every
//!   `AuditQueueConfig::warn_every`); the wait runs in a task of its own, so a caller that
//!   gives up (a timeout, a cancelled run, a client gone) does not take the record with it. A
//!   batch that fails transiently (no connection, the pool, 08xxx, 40xxx, 57xxx, a full
//!   disk) is kept and retried with capped exponential backoff; one the database refuses for
//!   good (SQLSTATE classes 22, 23, 42, P0001) is split until the refused records stand alone,
//!   the rest are written, and each refused one is logged in full at ERROR and counted
//!   (`steward_gateway_audit_records_rejected_total`). Closing the queue
//!   ([`AuditTrail::close`], when the service drains) writes everything still queued;
//!   whatever cannot be written by the deadline is logged loudly with its count. Each record
//!   keeps the time of its call, not of its write. A writer that panics is reported at ERROR
//!   at once with what it lost; from then on records are written at once.
//!
//! What the queue holds is in memory only: a crash (SIGKILL, OOM) loses up to
//! AUDIT_QUEUE_CAPACITY records of read-only calls (G-9). Records of calls that write anything
//! never wait in it.
//!
//! Reading through the trail ([`AuditLog::recent`]) first waits for everything queued before
//! the read, so a caller reads its own calls' records.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::{
    sync::{
        mpsc::{self, error::TrySendError},
        oneshot, watch,
    },
    task::{AbortHandle, JoinError},
};
use tokio_util::sync::CancellationToken;

use crate::{
    config::AuditQueueConfig,
    domain::UserId,
    store::{AuditEntry, AuditLog, AuditRecord, StoreError},
};

/// What the writer has done so far, for tests and operators (`AuditTrail::stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditStats {
    /// Records in the queue and not yet written: queued, or in the batch being written
    /// (the `steward_gateway_audit_queue_depth` gauge). Only records really queued count.
    pub pending: usize,
    /// Records written by the writer.
    pub written: u64,
    /// Batches written (each one INSERT).
    pub batches: u64,
    /// The most records one batch held.
    pub largest_batch: usize,
    /// Batch writes that failed (each then retried, or split when the database refused it).
    pub failures: u64,
    /// Records the database refused for good, logged instead of written.
    pub rejected: u64,
    /// Calls that found the queue full and waited for space.
    pub waits: u64,
}

/// How the writer task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriterEnd {
    /// The queue was closed and everything in it written (or refused and logged).
    Finished,
    /// It panicked: what it held is lost.
    Panicked,
    /// It was stopped at the drain deadline.
    Aborted,
}

/// The writer could not confirm that the records queued before a flush are written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the audit writer stopped before writing what was queued ({pending} record(s) not written)"
)]
pub struct FlushError {
    /// Records still counted as queued when the flush gave up.
    pub pending: usize,
}

// Nearly every item is a record; boxing it would add an allocation per call for the rare flush.
#[allow(clippy::large_enum_variant)]
enum Item {
    Record(AuditEntry),
    /// Answered once everything queued before it is written.
    Flush(oneshot::Sender<()>),
}

/// How often a writing call's record is tried before it is logged as lost: the call waits for
/// it, so the tries are few and their pauses short (`retry_first`, doubling).
const WRITE_NOW_ATTEMPTS: u32 = 3;

/// The longest a writing call's record may take, across all its tries: each try can wait for
/// a pooled connection (5 s), so 3 tries alone could take over 15 s. A side effect's intent
/// record is written while it holds its idempotency key, so this is part of the key's margin
/// (`engine::CLAIM_MARGIN`).
pub const WRITE_NOW_BUDGET: Duration = Duration::from_secs(8);

pub struct AuditTrail {
    store: Arc<dyn AuditLog>,
    /// The first pause before a writing call's record is tried again.
    retry_first: Duration,
    queue: mpsc::Sender<Item>,
    capacity: usize,
    warn_every: Duration,
    stats: Arc<watch::Sender<AuditStats>>,
    closing: CancellationToken,
    /// Set (by the task that watches the writer) once the writer has ended, and how.
    ended: watch::Receiver<Option<WriterEnd>>,
    writer: AbortHandle,
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
        let writer = tokio::spawn(writer.run(received));
        let abort = writer.abort_handle();
        let (ended_tx, ended) = watch::channel(None);
        // Whoever else is waiting, the writer's end is noticed, and a panic is loud at once.
        let watched = stats.clone();
        tokio::spawn(async move {
            let end = match writer.await {
                Ok(()) => WriterEnd::Finished,
                Err(e) if e.is_panic() => {
                    let pending = watched.borrow().pending;
                    crate::metrics::audit_records_lost(pending);
                    tracing::error!(
                        pending,
                        panic = %panic_text(e),
                        "AUDIT WRITER PANICKED: {pending} queued audit record(s) of read-only calls \
                         are lost; from now on each record is written at once"
                    );
                    WriterEnd::Panicked
                }
                Err(_) => WriterEnd::Aborted,
            };
            ended_tx.send_replace(Some(end));
        });
        Arc::new(Self {
            store,
            retry_first: config.retry_first,
            queue,
            capacity,
            warn_every: config.warn_every,
            stats,
            closing,
            ended,
            writer: abort,
            next_warning_ms: AtomicU64::new(0),
            unwarned_waits: AtomicU64::new(0),
            epoch: Instant::now(),
        })
    }

    /// Writes one record of a call that writes (a side effect, Steward's own data) at once,
    /// before the call goes on (G-9, P-5). A transient failure is tried again, up to
    /// [`WRITE_NOW_ATTEMPTS`] times with short pauses; a record still not written is logged
    /// with every field and counted as lost, so the trail can be rebuilt from the logs.
    pub async fn record_now(&self, record: AuditRecord) -> Result<(), StoreError> {
        let entry = AuditEntry::now(record);
        let written = self
            .record_retrying(&entry, Instant::now() + WRITE_NOW_BUDGET)
            .await;
        if let Err(e) = &written {
            crate::metrics::audit_records_lost(1);
            log_unwritten(
                &entry,
                e,
                "AUDIT RECORD LOST: a writing call's record could not be written",
            );
        }
        written
    }

    /// Writes the records a writing call kept while it ran (its upstream calls, each with its
    /// own time), once its deadline is over: tried as [`Self::record_now`] tries, all of them
    /// within one [`WRITE_NOW_BUDGET`]; any not written is logged in full and counted as lost.
    pub async fn record_kept_now(&self, entries: Vec<AuditEntry>) {
        let deadline = Instant::now() + WRITE_NOW_BUDGET;
        for entry in entries {
            if let Err(e) = self.record_retrying(&entry, deadline).await {
                crate::metrics::audit_records_lost(1);
                log_unwritten(
                    &entry,
                    &e,
                    "AUDIT RECORD LOST: a writing call's record could not be written",
                );
            }
        }
    }

    /// Writes a side effect's intent, tried as [`Self::record_now`] tries; not logged as lost
    /// when it fails, as the side effect is then refused and its intent was never carried out.
    pub async fn record_intent(&self, record: AuditRecord) -> Result<(), StoreError> {
        self.record_retrying(&AuditEntry::now(record), Instant::now() + WRITE_NOW_BUDGET)
            .await
    }

    /// Writes `entry` (keeping its time), tried again after a transient failure while tries
    /// are left and `deadline` has not passed; a try still running at `deadline` is given up.
    async fn record_retrying(
        &self,
        entry: &AuditEntry,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let record = &entry.record;
        let deadline = tokio::time::Instant::from_std(deadline);
        let mut pause = self.retry_first;
        let mut attempt = 1;
        loop {
            let written = tokio::time::timeout_at(deadline, self.store.record_entry(entry))
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::Unavailable(format!(
                        "not written within {WRITE_NOW_BUDGET:?}"
                    )))
                });
            match written {
                Err(e)
                    if !e.is_permanent()
                        && attempt < WRITE_NOW_ATTEMPTS
                        && tokio::time::Instant::now() + pause < deadline =>
                {
                    tracing::warn!(error = %e, attempt, call_id = %record.call_id, kind = %record.kind, "could not write an audit record; trying again");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    attempt += 1;
                }
                written => return written,
            }
        }
    }

    /// Hands one record of a read-only call to the batching writer; see
    /// [`AuditTrail::enqueue`].
    pub async fn record_later(self: &Arc<Self>, record: AuditRecord) {
        self.enqueue(vec![AuditEntry::now(record)]).await;
    }

    /// Hands the records of a read-only call, in their order, to the batching writer. Returns
    /// once all are queued, waiting for space when the queue is full. After
    /// [`AuditTrail::close`] (or once the writer died) they are written at once instead.
    ///
    /// Cancellation-safe: with room in the queue nothing is awaited; otherwise the waiting
    /// (and any write at once) runs in a task of its own, which dropping this future does not
    /// cancel. A record is counted as pending only once it is really in the queue.
    pub async fn enqueue(self: &Arc<Self>, entries: Vec<AuditEntry>) {
        let mut entries = entries.into_iter();
        let mut rest = Vec::new();
        while let Some(entry) = entries.next() {
            match self.queue.try_reserve() {
                Ok(permit) => {
                    // Counted before the writer can see it, with no await in between.
                    self.queued();
                    permit.send(Item::Record(entry));
                }
                Err(full_or_closed) => {
                    if matches!(full_or_closed, TrySendError::Full(())) {
                        self.waited();
                    }
                    rest.push(entry);
                    rest.extend(entries);
                    break;
                }
            }
        }
        if rest.is_empty() {
            return;
        }
        let trail = self.clone();
        let task = tokio::spawn(async move {
            let mut rest = rest.into_iter();
            while let Some(entry) = rest.next() {
                match trail.queue.reserve().await {
                    Ok(permit) => {
                        trail.queued();
                        permit.send(Item::Record(entry));
                    }
                    Err(_closed) => {
                        let mut now = vec![entry];
                        now.extend(rest);
                        trail.write_now(now).await;
                        return;
                    }
                }
            }
        });
        // Dropping the handle (this future dropped) leaves the task running.
        if let Err(e) = task.await
            && e.is_panic()
        {
            tracing::error!(panic = %panic_text(e), "handing audit records to the writer panicked");
        }
    }

    /// Waits until every record queued before this call is written or, refused for good,
    /// logged (while the store refuses writes transiently, until it takes them again). Fails
    /// when the writer stopped first — it panicked, or was stopped at the drain deadline — or
    /// when the queue is closed with records still unwritten.
    pub async fn flush(&self) -> Result<(), FlushError> {
        let (done, written) = oneshot::channel();
        if self.queue.send(Item::Flush(done)).await.is_ok() {
            // Dropped unanswered: the writer died with the flush in its queue.
            return written.await.map_err(|_| self.flush_error());
        }
        // The queue takes nothing more: it was closed (shutdown), or its writer died. Wait for
        // the writer's end; only a writer that wrote everything out is a success.
        let mut ended = self.ended.clone();
        let end = ended.wait_for(Option::is_some).await.ok().and_then(|e| *e);
        let pending = self.stats.borrow().pending;
        if end == Some(WriterEnd::Finished) && pending == 0 {
            Ok(())
        } else {
            Err(FlushError { pending })
        }
    }

    fn flush_error(&self) -> FlushError {
        FlushError {
            pending: self.stats.borrow().pending,
        }
    }

    /// What the writer has done so far; `wait_for` on it to wait for a condition.
    pub fn stats(&self) -> watch::Receiver<AuditStats> {
        self.stats.subscribe()
    }

    /// Closes the queue — records handed over from now on are written at once — and waits
    /// until `deadline` for the writer to write everything still queued. Returns how many
    /// records it could not write (logged as lost, loudly, with the count): 0 only when the
    /// writer finished.
    pub async fn close(&self, deadline: tokio::time::Instant) -> usize {
        self.closing.cancel();
        let queued = self.stats.borrow().pending;
        let mut ended = self.ended.clone();
        let end = tokio::time::timeout_at(deadline, ended.wait_for(Option::is_some))
            .await
            .map(|e| e.ok().and_then(|e| *e));
        match end {
            Ok(Some(WriterEnd::Finished)) => {
                tracing::info!(
                    flushed = queued,
                    "audit queue closed; every queued record is written"
                );
                0
            }
            Ok(Some(WriterEnd::Panicked)) => {
                // Already reported, and counted as lost, when it panicked.
                let unwritten = self.stats.borrow().pending;
                tracing::error!(
                    unwritten,
                    "AUDIT RECORDS LOST: the audit writer had panicked; {unwritten} audit record(s) \
                     of read-only calls were not written"
                );
                unwritten
            }
            Ok(_) | Err(_) => {
                self.writer.abort();
                let unwritten = self.stats.borrow().pending;
                crate::metrics::audit_records_lost(unwritten);
                tracing::error!(
                    unwritten,
                    "AUDIT RECORDS LOST: {unwritten} audit record(s) of read-only calls could not \
                     be written before the drain deadline (is the database down?)"
                );
                unwritten
            }
        }
    }

    /// Records that can no longer be queued (the queue is closed: the service is stopping, or
    /// the writer died) are written at once, like a side effect's.
    async fn write_now(&self, entries: Vec<AuditEntry>) {
        if let Err(e) = self.store.record_many(&entries).await {
            crate::metrics::audit_records_lost(entries.len());
            for entry in &entries {
                log_unwritten(entry, &e, "AUDIT RECORD LOST: could not write it at once");
            }
        }
    }

    /// One record went into the queue.
    fn queued(&self) {
        self.stats.send_modify(|s| s.pending += 1);
        crate::metrics::audit_queue_depth(1);
    }

    /// A caller found the queue full: counted every time, warned about at most every
    /// `warn_every` (with the count since the last warning).
    fn waited(&self) {
        self.stats.send_modify(|s| s.waits += 1);
        crate::metrics::audit_queue_waited();
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_warning_ms.load(Ordering::Relaxed);
        let every = u64::try_from(self.warn_every.as_millis()).unwrap_or(u64::MAX);
        if now >= next
            && self
                .next_warning_ms
                .compare_exchange(
                    next,
                    now.saturating_add(every),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
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

    async fn record_entry(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.store.record_entry(entry).await
    }

    async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError> {
        self.store.record_many(entries).await
    }

    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        self.flush()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        self.store.recent(user, limit).await
    }

    /// Only what is written: a record still queued is pruned by a later sweep.
    async fn prune_audit(
        &self,
        older_than: std::time::SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError> {
        self.store.prune_audit(older_than, limit).await
    }
}

/// A record that was not written, logged with every field (an audit record holds no secrets
/// and no content: G-9) so the trail can be rebuilt from the logs.
fn log_unwritten(entry: &AuditEntry, error: &StoreError, what: &str) {
    let r = &entry.record;
    let at = jiff::Timestamp::try_from(entry.at).map_or_else(|_| String::new(), |t| t.to_string());
    tracing::error!(
        error = %error,
        at,
        user = %r.user,
        kind = %r.kind,
        tool = %r.tool,
        integration = r.integration.as_deref().unwrap_or_default(),
        account = r.account.as_deref().unwrap_or_default(),
        call_id = %r.call_id,
        run_id = r.run_id.as_deref().unwrap_or_default(),
        status = %r.status,
        latency_ms = r.latency_ms,
        bytes = r.bytes,
        upstream_calls = r.upstream_calls,
        "{what}"
    );
}

fn panic_text(e: JoinError) -> String {
    match e.try_into_panic() {
        Ok(panic) => panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_owned()),
        Err(e) => e.to_string(),
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

    /// Writes one batch: what the database refuses for good is isolated (the batch halved
    /// until each refused record stands alone), logged and counted, and everything else is
    /// written, in order; a transient failure is retried until it passes. Nothing is dropped
    /// silently.
    async fn write(&self, entries: &[AuditEntry]) {
        // Parts still to write, the next one last.
        let mut todo: Vec<&[AuditEntry]> = vec![entries];
        while let Some(part) = todo.pop() {
            match self.write_retrying(part).await {
                Ok(()) => self.settled(part.len(), true),
                Err(e) if part.len() == 1 => {
                    self.settled(1, false);
                    crate::metrics::audit_record_rejected();
                    log_unwritten(
                        &part[0],
                        &e,
                        "AUDIT RECORD REJECTED: the database refused it for good; it is not written",
                    );
                }
                Err(_) => {
                    let (first, second) = part.split_at(part.len() / 2);
                    todo.push(second);
                    todo.push(first);
                }
            }
        }
    }

    /// Writes `part`, retrying transient failures with capped backoff; returns the error when
    /// the database refused it for good.
    async fn write_retrying(&self, part: &[AuditEntry]) -> Result<(), StoreError> {
        let mut pause = self.retry_first;
        let mut attempt: u32 = 0;
        loop {
            let Err(e) = self.store.record_many(part).await else {
                return Ok(());
            };
            self.stats.send_modify(|s| s.failures += 1);
            crate::metrics::audit_write_failed();
            if e.is_permanent() {
                if part.len() > 1 {
                    tracing::warn!(
                        error = %e,
                        batch = part.len(),
                        "the database refused a batch of audit records; writing it in parts to \
                         find the refused record(s)"
                    );
                }
                return Err(e);
            }
            attempt += 1;
            tracing::error!(
                error = %e,
                waiting = self.stats.borrow().pending,
                batch = part.len(),
                attempt,
                retry_in_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
                "could not write audit records; keeping them and retrying"
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(self.retry_max);
        }
    }

    /// `n` records left the queue: written (one more INSERT) or rejected.
    fn settled(&self, n: usize, written: bool) {
        self.stats.send_modify(|s| {
            debug_assert!(
                s.pending >= n,
                "settling more audit records than were queued"
            );
            s.pending = s.pending.saturating_sub(n);
            if written {
                s.written += n as u64;
                s.batches += 1;
                s.largest_batch = s.largest_batch.max(n);
            } else {
                s.rejected += n as u64;
            }
        });
        crate::metrics::audit_queue_depth(-(n as i64));
        if written {
            crate::metrics::audit_batch_written(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Mutex, atomic::AtomicBool};

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

    /// An audit log whose batch writes can be held (`open`), made to fail transiently
    /// (`down`), made to refuse given call ids for good (`refuse`), made to panic once
    /// (`panic_once`), and watched starting (`started`). Single-record writes (`record`) go
    /// through, unless made to fail transiently (`singles_failing`); each is counted.
    struct FakeLog {
        batches: Mutex<Vec<Vec<AuditRecord>>>,
        singles: Mutex<Vec<AuditRecord>>,
        singles_failing: std::sync::atomic::AtomicUsize,
        single_tries: std::sync::atomic::AtomicUsize,
        /// The time each single-record try carried.
        single_times: Mutex<Vec<std::time::SystemTime>>,
        /// Single-record writes never finish (a pool with no connection to give).
        singles_hang: AtomicBool,
        open: watch::Sender<bool>,
        started: watch::Sender<usize>,
        down: AtomicBool,
        refuse: Mutex<Vec<String>>,
        panic_once: AtomicBool,
    }

    impl FakeLog {
        fn new(open: bool) -> Arc<Self> {
            Arc::new(Self {
                batches: Mutex::new(Vec::new()),
                singles: Mutex::new(Vec::new()),
                singles_failing: Default::default(),
                single_tries: Default::default(),
                single_times: Mutex::new(Vec::new()),
                singles_hang: AtomicBool::new(false),
                open: watch::Sender::new(open),
                started: watch::Sender::new(0),
                down: AtomicBool::new(false),
                refuse: Mutex::new(Vec::new()),
                panic_once: AtomicBool::new(false),
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

        fn kinds(&self) -> Vec<(String, String)> {
            self.batches
                .lock()
                .unwrap()
                .iter()
                .flatten()
                .map(|r| (r.kind.clone(), r.call_id.clone()))
                .collect()
        }
    }

    #[async_trait::async_trait]
    impl AuditLog for FakeLog {
        async fn record(&self, record: AuditRecord) -> Result<(), StoreError> {
            self.record_entry(&AuditEntry::now(record)).await
        }

        async fn record_entry(&self, entry: &AuditEntry) -> Result<(), StoreError> {
            let record = entry.record.clone();
            self.single_tries.fetch_add(1, Ordering::SeqCst);
            self.single_times.lock().unwrap().push(entry.at);
            if self.singles_hang.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            let failing =
                self.singles_failing
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            if failing.is_ok() {
                return Err(StoreError::Unavailable("the database is down".into()));
            }
            self.singles.lock().unwrap().push(record);
            Ok(())
        }

        async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError> {
            self.started.send_modify(|n| *n += 1);
            self.open.subscribe().wait_for(|open| *open).await.unwrap();
            assert!(
                !self.panic_once.swap(false, Ordering::SeqCst),
                "the store blew up"
            );
            if self.down.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("the database is down".into()));
            }
            let refused = self.refuse.lock().unwrap().clone();
            if entries.iter().any(|e| refused.contains(&e.record.call_id)) {
                return Err(StoreError::Rejected {
                    code: "23514".into(),
                    message: "new row violates check constraint".into(),
                });
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

        async fn prune_audit(
            &self,
            _older_than: std::time::SystemTime,
            _limit: usize,
        ) -> Result<usize, StoreError> {
            Ok(0)
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

    /// A guard against a hang: a test waits on conditions, never on time, but fails rather
    /// than hangs when the condition never comes.
    async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .unwrap_or_else(|_| panic!("{what} did not happen"))
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
        trail.flush().await.unwrap();
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
        assert_eq!(
            trail.stats().borrow().pending,
            3,
            "only what is queued counts"
        );
        log.open();
        waiting.await.unwrap();
        trail.flush().await.unwrap();
        assert_eq!(log.call_ids(), ids(0..4));
        assert_eq!(
            log.batch_sizes(),
            [1, 1, 1, 1],
            "at most AUDIT_MAX_BATCH per insert"
        );
    }

    #[tokio::test]
    async fn a_caller_that_gives_up_while_the_queue_is_full_leaves_its_record_queued() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(1, 1));
        trail.record_later(record("c0")).await;
        log.started(1).await;
        trail.record_later(record("c1")).await;
        // The queue is full; a caller waits for space, then is dropped (its tool call timed
        // out, its run was cancelled, its client went away).
        let waiting = tokio::spawn({
            let trail = trail.clone();
            async move { trail.record_later(record("c2")).await }
        });
        trail.stats().wait_for(|s| s.waits == 1).await.unwrap();
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        assert_eq!(
            trail.stats().borrow().pending,
            2,
            "c2 is not counted before it is really queued"
        );
        log.open();
        within(
            "the abandoned record being written",
            trail.stats().wait_for(|s| s.written == 3),
        )
        .await
        .unwrap();
        assert_eq!(log.call_ids(), ids(0..3), "the abandoned record is kept");
        trail.flush().await.unwrap();
        assert_eq!(trail.stats().borrow().pending, 0, "and the count settles");
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
        trail.flush().await.unwrap();
        assert_eq!(
            log.call_ids(),
            ids(0..5),
            "each record exactly once, in order"
        );
        let stats = trail.stats().borrow().clone();
        assert_eq!((stats.pending, stats.rejected), (0, 0));
    }

    #[tokio::test]
    async fn a_record_the_database_refuses_for_good_is_isolated_counted_and_blocks_nothing() {
        let log = FakeLog::new(false);
        log.refuse.lock().unwrap().push("bad".into());
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        trail.record_later(record("c0")).await;
        log.started(1).await;
        // One batch with a refused record in the middle.
        for id in ["c1", "c2", "bad", "c3", "c4"] {
            trail.record_later(record(id)).await;
        }
        log.open();
        within("the flush", trail.flush()).await.unwrap();
        assert_eq!(
            log.call_ids(),
            ids(0..5),
            "every other record written, in order"
        );
        let stats = trail.stats().borrow().clone();
        assert_eq!((stats.rejected, stats.written, stats.pending), (1, 5, 0));
        assert!(
            log.batch_sizes().len() <= 4,
            "split, not one insert per record: {:?}",
            log.batch_sizes()
        );
        // Not retried forever: the queue keeps flowing.
        trail.record_later(record("c5")).await;
        within("the next flush", trail.flush()).await.unwrap();
        assert_eq!(log.call_ids(), ids(0..6));
    }

    #[tokio::test]
    async fn a_writer_that_panics_is_reported_and_later_records_are_written_at_once() {
        let log = FakeLog::new(true);
        log.panic_once.store(true, Ordering::SeqCst);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        trail.record_later(record("c0")).await;
        let err = within("the failed flush", trail.flush()).await.unwrap_err();
        assert_eq!(err.pending, 1, "c0 died with the writer");
        // The queue is gone with its writer: a record is written before record_later returns.
        trail.record_later(record("c1")).await;
        assert_eq!(log.call_ids(), ["c1"]);
        assert!(trail.flush().await.is_err(), "a dead writer never flushes");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        assert_eq!(within("close", trail.close(deadline)).await, 1);
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
        // A closed queue whose writer wrote everything out: nothing to wait for.
        trail.flush().await.unwrap();
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
        assert_eq!(
            trail.flush().await,
            Err(FlushError { pending: 3 }),
            "a flush cannot pretend they were written"
        );
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

    /// What a probe tool does.
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        /// Reads only (`read_only`), recording one upstream call as it goes.
        Read,
        /// Writes Steward's own data (as add_task does): no side effect, not read-only.
        Write,
        /// A side effect: asserts its intent record was written before it runs.
        Act,
    }

    struct Probe {
        kind: Kind,
        log: Arc<FakeLog>,
        /// Calls that returned from the tool (not yet from the engine).
        finished: Arc<watch::Sender<usize>>,
    }

    #[async_trait::async_trait]
    impl Tool for Probe {
        fn spec(&self) -> ToolSpec {
            let name = match self.kind {
                Kind::Read => "read",
                Kind::Write => "write",
                Kind::Act => "act",
            };
            let spec = ToolSpec::new(name, Integration::Tasks, name, json!({"type": "object"}));
            if self.kind == Kind::Act {
                spec.with_side_effect()
            } else {
                spec
            }
        }

        fn read_only(&self) -> bool {
            self.kind == Kind::Read
        }

        async fn call(&self, ctx: &CallContext, _args: Value) -> Result<ToolOutput, ToolError> {
            match self.kind {
                Kind::Read => {
                    ctx.audit(AuditRecord {
                        kind: "upstream_call".into(),
                        call_id: ctx.call_id.clone(),
                        ..record("upstream")
                    })
                    .await;
                }
                Kind::Write => {}
                Kind::Act => {
                    let intents = self.log.singles.lock().unwrap().clone();
                    if !intents.iter().any(|r| r.kind == "side_effect_intent") {
                        return Err(ToolError::Internal(
                            "acted before the intent was written".into(),
                        ));
                    }
                }
            }
            self.finished.send_modify(|n| *n += 1);
            Ok(ToolOutput::text("done"))
        }
    }

    fn engine(
        log: &Arc<FakeLog>,
        trail: Arc<AuditTrail>,
        timeout: Duration,
    ) -> (Engine, watch::Receiver<usize>) {
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
        let finished = Arc::new(watch::Sender::new(0));
        let tools: Vec<Arc<dyn Tool>> = [Kind::Read, Kind::Write, Kind::Act]
            .into_iter()
            .map(|kind| {
                Arc::new(Probe {
                    kind,
                    log: log.clone(),
                    finished: finished.clone(),
                }) as Arc<dyn Tool>
            })
            .collect();
        let engine = Engine {
            registry: Arc::new(Registry::new(tools).unwrap()),
            services,
            idempotency: stores.idempotency.clone(),
            config: EngineConfig {
                max_result_chars: 6000,
                default_timeout: timeout,
                max_timeout: timeout,
                idempotency_retention: Duration::from_secs(7 * 86_400),
            },
            in_flight: Arc::default(),
        };
        (engine, finished.subscribe())
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
            time_zone: None,
        }
    }

    fn singles(log: &FakeLog) -> Vec<(String, String)> {
        log.singles
            .lock()
            .unwrap()
            .iter()
            .map(|r| (r.kind.clone(), r.call_id.clone()))
            .collect()
    }

    fn pair(kind: &str, call_id: &str) -> (String, String) {
        (kind.to_owned(), call_id.to_owned())
    }

    #[tokio::test]
    async fn a_call_counts_as_in_flight_until_its_records_are_handed_to_the_trail() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(1, 1));
        let (engine, _) = engine(&log, trail.clone(), Duration::from_secs(10));
        trail.record_later(record("c0")).await;
        log.started(1).await;
        trail.record_later(record("c1")).await;
        // The queue is full: the read's records wait for space, and so does the call.
        let read = tokio::spawn({
            let engine = engine.clone();
            async move {
                engine
                    .execute(
                        &UserId::parse("u1").unwrap(),
                        call("read", "r1"),
                        CancellationToken::new(),
                    )
                    .await
            }
        });
        trail.stats().wait_for(|s| s.waits == 1).await.unwrap();
        assert_eq!(
            engine.in_flight.count(),
            1,
            "a drain cut here would lose its records, and shutdown says so"
        );
        log.open();
        read.await.unwrap();
        assert_eq!(engine.in_flight.count(), 0);
    }

    #[tokio::test]
    async fn a_reads_records_are_queued_off_the_call_path_and_every_writing_calls_written_at_once()
    {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        let (engine, _) = engine(&log, trail.clone(), Duration::from_secs(10));
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
        assert_eq!(
            trail.stats().borrow().pending,
            4,
            "upstream + tool_call each"
        );

        // A side effect: its intent before it runs (the tool checks), its result record
        // before the call returns, neither through the queue.
        let act = engine
            .execute(&user, call("act", "a1"), CancellationToken::new())
            .await;
        assert!(act.error_kind.is_none(), "{}", act.text);
        // A write of Steward's own data (add_task, save_memory, create_reminder ...): no side
        // effect, but not read-only either, so written before the call returns.
        let write = engine
            .execute(&user, call("write", "w1"), CancellationToken::new())
            .await;
        assert!(write.error_kind.is_none(), "{}", write.text);
        // A call of an unknown tool declares nothing: written at once too.
        engine
            .execute(&user, call("nope", "n1"), CancellationToken::new())
            .await;
        assert_eq!(
            singles(&log),
            [
                pair("side_effect_intent", "a1"),
                pair("tool_call", "a1"),
                pair("tool_call", "w1"),
                pair("tool_call", "n1"),
            ]
        );
        assert_eq!(trail.stats().borrow().pending, 4);

        log.open();
        trail.flush().await.unwrap();
        assert_eq!(
            log.kinds(),
            [
                pair("upstream_call", "r1"),
                pair("tool_call", "r1"),
                pair("upstream_call", "r2"),
                pair("tool_call", "r2"),
            ]
        );
    }

    #[tokio::test]
    async fn a_read_that_finishes_while_the_queue_is_full_is_not_an_upstream_timeout() {
        let log = FakeLog::new(false);
        let trail = AuditTrail::start(log.clone(), &config(1, 1));
        // A short deadline: waiting for the queue inside it would fail the call.
        let (engine, mut finished) = engine(&log, trail.clone(), Duration::from_millis(100));
        let user = UserId::parse("u1").unwrap();
        trail.record_later(record("c0")).await;
        log.started(1).await;
        trail.record_later(record("c1")).await; // the queue is full

        let running = tokio::spawn({
            let (engine, user) = (engine.clone(), user.clone());
            async move {
                engine
                    .execute(&user, call("read", "r1"), CancellationToken::new())
                    .await
            }
        });
        // The tool itself finishes although the queue is full: its upstream record does not
        // wait for space inside the call ...
        within("the tool finishing", finished.wait_for(|n| *n == 1))
            .await
            .unwrap();
        // ... the engine does, after the call, outside its deadline.
        trail.stats().wait_for(|s| s.waits >= 1).await.unwrap();
        assert!(!running.is_finished());
        log.open();
        let outcome = within("the call", running).await.unwrap();
        assert!(outcome.error_kind.is_none(), "{}", outcome.text);
        assert_eq!(outcome.text, "done");
        trail.flush().await.unwrap();
        assert_eq!(
            log.kinds(),
            [
                pair("tool_call", "c0"),
                pair("tool_call", "c1"),
                pair("upstream_call", "r1"),
                pair("tool_call", "r1"),
            ],
            "the read's records are kept, its upstream call first"
        );
    }

    #[test]
    fn a_tool_declared_read_only_cannot_declare_writes() {
        struct Liar;
        #[async_trait::async_trait]
        impl Tool for Liar {
            fn spec(&self) -> ToolSpec {
                ToolSpec::new(
                    "liar",
                    Integration::Memory,
                    "liar",
                    json!({"type": "object"}),
                )
                .writing_memory()
            }
            fn read_only(&self) -> bool {
                true
            }
            async fn call(&self, _: &CallContext, _: Value) -> Result<ToolOutput, ToolError> {
                Ok(ToolOutput::text(""))
            }
        }
        assert!(matches!(
            Registry::new(vec![Arc::new(Liar)]),
            Err(crate::registry::RegistryError::ReadOnlyWrites(_))
        ));
    }

    #[tokio::test]
    async fn g9_a_side_effects_records_are_tried_again_when_the_store_fails_for_a_moment() {
        let log = FakeLog::new(true);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        let (engine, _) = engine(&log, trail.clone(), Duration::from_secs(10));
        // The intent's first two tries fail: the side effect still runs, and is recorded.
        log.singles_failing.store(2, Ordering::SeqCst);
        let user = UserId::parse("u1").unwrap();
        let act = engine
            .execute(&user, call("act", "a1"), CancellationToken::new())
            .await;
        assert!(act.error_kind.is_none(), "{}", act.text);
        assert_eq!(
            singles(&log),
            [pair("side_effect_intent", "a1"), pair("tool_call", "a1")]
        );
        log.singles_failing.store(1, Ordering::SeqCst);
        let write = engine
            .execute(&user, call("write", "w1"), CancellationToken::new())
            .await;
        assert!(write.error_kind.is_none(), "{}", write.text);
        assert_eq!(singles(&log).last(), Some(&pair("tool_call", "w1")));
        // The intent 3 tries, the side effect's result 1, the write's result 2.
        assert_eq!(log.single_tries.load(Ordering::SeqCst), 3 + 1 + 2);
    }

    #[tokio::test]
    async fn g9_a_writing_calls_record_the_store_keeps_refusing_is_tried_a_bounded_number_of_times()
    {
        let log = FakeLog::new(true);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        log.singles_failing.store(usize::MAX, Ordering::SeqCst);
        // Then logged with every field (`log_unwritten`) and counted as lost.
        assert!(trail.record_now(record("c1")).await.is_err());
        assert_eq!(
            log.single_tries.load(Ordering::SeqCst),
            WRITE_NOW_ATTEMPTS as usize
        );
        assert!(log.singles.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn p5_a_writing_calls_record_tried_again_keeps_the_time_of_its_call() {
        let log = FakeLog::new(true);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        log.singles_failing.store(2, Ordering::SeqCst);
        trail.record_now(record("c1")).await.unwrap();
        let times = log.single_times.lock().unwrap().clone();
        assert_eq!(times.len(), 3);
        assert!(times.iter().all(|t| *t == times[0]), "{times:?}");
    }

    #[tokio::test]
    async fn p4_a_writing_calls_record_gives_up_at_its_deadline_however_long_the_store_waits() {
        let log = FakeLog::new(true);
        let trail = AuditTrail::start(log.clone(), &config(64, 64));
        log.singles_hang.store(true, Ordering::SeqCst);
        let entry = AuditEntry::now(record("c1"));
        let written = within(
            "giving up at the deadline",
            trail.record_retrying(&entry, Instant::now() + Duration::from_millis(50)),
        )
        .await;
        assert!(matches!(written, Err(StoreError::Unavailable(_))));
        // A store that keeps failing fast: no try starts past the deadline either.
        log.singles_hang.store(false, Ordering::SeqCst);
        log.singles_failing.store(usize::MAX, Ordering::SeqCst);
        let before = log.single_tries.load(Ordering::SeqCst);
        assert!(trail.record_retrying(&entry, Instant::now()).await.is_err());
        assert_eq!(log.single_tries.load(Ordering::SeqCst) - before, 1);
    }

    #[test]
    fn p4_the_intent_record_and_the_stored_result_fit_inside_the_keys_margin() {
        // What a side effect may spend outside its call's deadlines while it holds its key:
        // its intent record, its upstream records, its result.
        let outside = WRITE_NOW_BUDGET * 2 + crate::engine::STORE_BUDGET;
        assert!(outside + Duration::from_secs(5) <= crate::engine::CLAIM_MARGIN);
    }
}
