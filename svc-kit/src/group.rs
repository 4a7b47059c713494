//! Work grouped across callers (issue 13, Q-2): a queue that worker tasks drain in batches —
//! whatever waits when a worker comes free, up to a cap — each item answered on its own, so a
//! quiet replica sends each item at once and a busy one many per statement, with no timer
//! adding latency to either; and the counts that show how much they batch. agent-svc's group
//! commit and group admission and gateway-svc's grouped reads are built on it.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use futures_util::FutureExt as _;
use tokio::sync::{Mutex, mpsc, oneshot};

/// An item whose outcome the queue cannot give: its workers have stopped, or the one handling
/// it failed mid-way (so a write may or may not have landed). Each store turns it into its own
/// "unavailable" error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Lost(String);

/// How a store has handled one kind of item (commits, admissions, reads) since it opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchCounts {
    /// Statements that handled items (a batch, or one item alone).
    pub statements: u64,
    /// Items handled (written, refused or read) by them.
    pub written: u64,
    /// Batches the database refused as a whole, whose items were then written again: one by
    /// one, or (agent-svc's admissions, refused for owners busy elsewhere) the rest as a batch.
    pub batches_retried: u64,
}

/// `BatchCounts` as they grow, and the metrics they feed.
pub struct Counters {
    statements: AtomicU64,
    written: AtomicU64,
    batches_retried: AtomicU64,
    /// Metric names: the histogram of items per statement, the counter of batches retried.
    size_metric: &'static str,
    retried_metric: &'static str,
    /// The `kind` label of both metrics, where one metric covers several kinds of item.
    kind: Option<&'static str>,
}

impl Counters {
    pub fn new(size_metric: &'static str, retried_metric: &'static str) -> Self {
        Self {
            statements: AtomicU64::new(0),
            written: AtomicU64::new(0),
            batches_retried: AtomicU64::new(0),
            size_metric,
            retried_metric,
            kind: None,
        }
    }

    /// The same counters, their metrics labelled `kind`.
    pub fn of_kind(self, kind: &'static str) -> Self {
        Self {
            kind: Some(kind),
            ..self
        }
    }

    pub fn read(&self) -> BatchCounts {
        BatchCounts {
            statements: self.statements.load(Ordering::Relaxed),
            written: self.written.load(Ordering::Relaxed),
            batches_retried: self.batches_retried.load(Ordering::Relaxed),
        }
    }

    pub fn wrote(&self, items: usize) {
        self.statements.fetch_add(1, Ordering::Relaxed);
        self.written.fetch_add(items as u64, Ordering::Relaxed);
        match self.kind {
            Some(kind) => {
                metrics::histogram!(self.size_metric, "kind" => kind).record(items as f64)
            }
            None => metrics::histogram!(self.size_metric).record(items as f64),
        }
    }

    pub fn retried(&self) {
        self.batches_retried.fetch_add(1, Ordering::Relaxed);
        match self.kind {
            Some(kind) => metrics::counter!(self.retried_metric, "kind" => kind).increment(1),
            None => metrics::counter!(self.retried_metric).increment(1),
        }
    }
}

/// An item waiting to be written, and where its outcome goes.
pub struct Waiting<I, O, E> {
    pub item: I,
    answer: oneshot::Sender<Result<O, E>>,
}

impl<I, O, E> Waiting<I, O, E> {
    /// Nobody waits for this item's outcome any more (its caller timed out or went away): a
    /// read need not be done. Writes are done regardless — their caller may have gone, but
    /// what it asked for must land or fail as one.
    pub fn is_abandoned(&self) -> bool {
        self.answer.is_closed()
    }

    pub fn answer(self, outcome: Result<O, E>) {
        // A waiter that went away does not need its answer.
        let _ = self.answer.send(outcome);
    }
}

/// The way in for items of one kind; the workers stop when it is dropped.
pub struct Queue<I, O, E> {
    sender: mpsc::UnboundedSender<Waiting<I, O, E>>,
    what: &'static str,
}

impl<I, O, E: From<Lost>> Waiting<I, O, E> {
    /// `item` to hand to whatever will answer it (a `what`: "admission"), and its outcome once
    /// answered.
    pub fn new(
        item: I,
        what: &'static str,
    ) -> (Self, impl Future<Output = Result<O, E>> + Send + 'static)
    where
        O: Send + 'static,
        E: Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let outcome = async move {
            // Whatever was answering it panicked: it may or may not have landed.
            answered.await.map_err(|_| {
                Lost(format!(
                    "the {what}'s outcome is unknown: the task handling it failed"
                ))
            })?
        };
        (Waiting { item, answer }, outcome)
    }
}

impl<I, O: Send + 'static, E: From<Lost> + Send + 'static> Queue<I, O, E> {
    /// Hands `item` to the workers and waits for its own outcome.
    pub async fn submit(&self, item: I) -> Result<O, E> {
        let what = self.what;
        let (waiting, outcome) = Waiting::new(item, what);
        self.sender
            .send(waiting)
            .map_err(|_| Lost(format!("the store's {what} workers have stopped")))?;
        outcome.await
    }
}

/// Starts `workers` tasks that take batches of at most `most` items (each a `what`: "commit")
/// off the returned queue and hand each batch to `write`, which answers every item of it. A
/// panic in `write` is caught: the batch's waiters are told the outcome is unknown (their
/// answers are dropped), and the worker goes on with the next batch.
pub fn start<I, O, E, W, F>(
    workers: usize,
    most: usize,
    what: &'static str,
    write: W,
) -> Queue<I, O, E>
where
    I: Send + 'static,
    O: Send + 'static,
    E: Send + 'static,
    W: Fn(Vec<Waiting<I, O, E>>) -> F + Clone + Send + Sync + 'static,
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
                    tracing::error!("a task handling {what}s panicked on a batch; it goes on");
                }
            }
        });
    }
    Queue { sender, what }
}

/// A pooled connection of the `schema` store for a batch, or — the pool has none to give —
/// `None`, every waiter of `waiting` told so by `unavailable`.
pub async fn connection<I, O, E>(
    pool: &crate::pg::PgPool,
    schema: &'static str,
    waiting: &mut Vec<Waiting<I, O, E>>,
    unavailable: impl Fn(&crate::pg::PgError) -> E,
) -> Option<crate::pg::Pooled> {
    match crate::pg::checkout(pool, schema).await {
        Ok(client) => Some(client),
        Err(e) => {
            for w in waiting.drain(..) {
                w.answer(Err(unavailable(&e)));
            }
            None
        }
    }
}
