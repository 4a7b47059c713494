//! What group commit and group admission share (issue 13, Q-2): a queue that worker tasks
//! drain in batches — whatever waits when a worker comes free, up to a cap — each item
//! answered on its own, so a quiet replica writes each item at once and a busy one many per
//! statement, with no timer adding latency to either; and the counts that show how much they
//! batch.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use futures_util::FutureExt as _;
use svc_kit::pg;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::store::StoreError;

/// How a store has written one kind of item (commits, admissions) since it opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchCounts {
    /// Statements that wrote items (a batch, or one item alone).
    pub statements: u64,
    /// Items written, or refused, by them.
    pub written: u64,
    /// Batches the database refused as a whole, whose items were then written one by one.
    pub batches_retried: u64,
}

/// `BatchCounts` as they grow, and the metrics they feed.
pub(super) struct Counters {
    statements: AtomicU64,
    written: AtomicU64,
    batches_retried: AtomicU64,
    /// Metric names: the histogram of items per statement, the counter of batches retried.
    size_metric: &'static str,
    retried_metric: &'static str,
}

impl Counters {
    pub(super) fn new(size_metric: &'static str, retried_metric: &'static str) -> Self {
        Self {
            statements: AtomicU64::new(0),
            written: AtomicU64::new(0),
            batches_retried: AtomicU64::new(0),
            size_metric,
            retried_metric,
        }
    }

    pub(super) fn read(&self) -> BatchCounts {
        BatchCounts {
            statements: self.statements.load(Ordering::Relaxed),
            written: self.written.load(Ordering::Relaxed),
            batches_retried: self.batches_retried.load(Ordering::Relaxed),
        }
    }

    pub(super) fn wrote(&self, items: usize) {
        self.statements.fetch_add(1, Ordering::Relaxed);
        self.written.fetch_add(items as u64, Ordering::Relaxed);
        metrics::histogram!(self.size_metric).record(items as f64);
    }

    pub(super) fn retried(&self) {
        self.batches_retried.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(self.retried_metric).increment(1);
    }
}

/// An item waiting to be written, and where its outcome goes.
pub(super) struct Waiting<I, O> {
    pub(super) item: I,
    answer: oneshot::Sender<Result<O, StoreError>>,
}

impl<I, O> Waiting<I, O> {
    pub(super) fn answer(self, outcome: Result<O, StoreError>) {
        // A waiter that went away does not need its answer.
        let _ = self.answer.send(outcome);
    }
}

/// The way in for items of one kind; the workers stop when it is dropped.
pub(super) struct Queue<I, O> {
    sender: mpsc::UnboundedSender<Waiting<I, O>>,
    what: &'static str,
}

impl<I, O> Queue<I, O> {
    /// Hands `item` to the workers and waits for its own outcome.
    pub(super) async fn submit(&self, item: I) -> Result<O, StoreError> {
        let (answer, answered) = oneshot::channel();
        let what = self.what;
        self.sender.send(Waiting { item, answer }).map_err(|_| {
            StoreError::Unavailable(format!("the store's {what} writers have stopped"))
        })?;
        // Its worker panicked while writing it: it may or may not have landed.
        answered.await.map_err(|_| {
            StoreError::Unavailable(format!(
                "the {what}'s outcome is unknown: the task writing it failed"
            ))
        })?
    }
}

/// Starts `workers` tasks that take batches of at most `most` items (each a `what`: "commit")
/// off the returned queue and hand each batch to `write`, which answers every item of it. A
/// panic in `write` is caught: the batch's waiters are told the outcome is unknown (their
/// answers are dropped), and the worker goes on with the next batch.
pub(super) fn start<I, O, W, F>(
    workers: usize,
    most: usize,
    what: &'static str,
    write: W,
) -> Queue<I, O>
where
    I: Send + 'static,
    O: Send + 'static,
    W: Fn(Vec<Waiting<I, O>>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let (sender, queue) = mpsc::unbounded_channel();
    let waiting = Arc::new(Mutex::new(queue));
    for _ in 0..workers.max(1) {
        let (waiting, write) = (waiting.clone(), write.clone());
        tokio::spawn(async move {
            loop {
                let batch = {
                    let mut waiting = waiting.lock().await;
                    let Some(first) = waiting.recv().await else {
                        return;
                    };
                    let mut batch = vec![first];
                    while batch.len() < most {
                        match waiting.try_recv() {
                            Ok(next) => batch.push(next),
                            Err(_) => break,
                        }
                    }
                    batch
                };
                let written = std::panic::AssertUnwindSafe(write(batch));
                if written.catch_unwind().await.is_err() {
                    tracing::error!("a task writing {what}s panicked on a batch; it goes on");
                }
            }
        });
    }
    Queue { sender, what }
}

/// A connection for a batch, or — the pool has none to give — `None`, every waiter of
/// `waiting` told so.
pub(super) async fn connection<I, O>(
    pool: &pg::PgPool,
    waiting: &mut Vec<Waiting<I, O>>,
) -> Option<pg::Pooled> {
    match pg::checkout(pool, "agent").await {
        Ok(client) => Some(client),
        Err(e) => {
            for w in waiting.drain(..) {
                w.answer(Err(StoreError::Unavailable(e.to_string())));
            }
            None
        }
    }
}

/// A batch the database refused as a whole (`error`): its items go first among those to be
/// written one by one, which returns the connection for them — `client`, or a fresh one if the
/// failure closed it (`None` when the pool has none: every waiter told so).
pub(super) async fn refused_batch<I, O>(
    pool: &pg::PgPool,
    client: pg::Pooled,
    error: &tokio_postgres::Error,
    counts: &Counters,
    batch: Vec<Waiting<I, O>>,
    alone: &mut Vec<Waiting<I, O>>,
) -> Option<pg::Pooled> {
    tracing::debug!(%error, items = batch.len(), "the database refused a batch; writing each item alone");
    counts.retried();
    alone.splice(0..0, batch);
    match client.is_closed() {
        false => Some(client),
        true => connection(pool, alone).await,
    }
}
