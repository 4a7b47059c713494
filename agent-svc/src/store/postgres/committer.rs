//! Group commit across runs (issue 13, Q-2). Every run's writer hands its commit to a few
//! committer tasks; a committer takes whatever commits are waiting when it comes free and
//! writes them in one statement (`batch`), or a lone one as its own (`commit::one`). So a
//! quiet replica commits each run at once, as before, and a busy one — where PostgreSQL's
//! fixed cost per statement is what limits it — writes many runs per statement, without a
//! timer adding latency to either.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use tokio::sync::{Mutex, mpsc, oneshot};

use super::{batch, commit};
use crate::store::{Lease, RunCommit, StoreError};
use svc_kit::pg;

/// The most commits one statement carries: enough to amortise the statement, few enough that
/// a batch that fails and is retried commit by commit stays short.
const MAX_BATCH: usize = 32;

struct Queued {
    lease: Lease,
    commit: RunCommit,
    answer: oneshot::Sender<Result<(), StoreError>>,
}

/// How the store has written runs' commits since it opened: how much group commit batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitCounts {
    /// Statements that wrote commits (a batch, or one commit alone).
    pub statements: u64,
    /// Commits written, or refused, by them.
    pub commits: u64,
    /// Batches the database refused as a whole, whose commits were then written one by one.
    pub batches_retried: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    statements: AtomicU64,
    commits: AtomicU64,
    batches_retried: AtomicU64,
}

impl Counters {
    pub(super) fn read(&self) -> CommitCounts {
        CommitCounts {
            statements: self.statements.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Relaxed),
            batches_retried: self.batches_retried.load(Ordering::Relaxed),
        }
    }

    fn wrote(&self, commits: usize) {
        self.statements.fetch_add(1, Ordering::Relaxed);
        self.commits.fetch_add(commits as u64, Ordering::Relaxed);
        metrics::histogram!("steward_db_commit_batch_size").record(commits as f64);
    }

    fn retried(&self) {
        self.batches_retried.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("steward_db_commit_batches_retried_total").increment(1);
    }
}

pub(super) struct Committer {
    queue: mpsc::UnboundedSender<Queued>,
    pub(super) counts: Arc<Counters>,
}

impl Committer {
    /// Starts `workers` committer tasks on `pool`; they end when the committer is dropped.
    pub(super) fn start(pool: pg::PgPool, workers: usize) -> Self {
        let (queue, waiting) = mpsc::unbounded_channel();
        let waiting = Arc::new(Mutex::new(waiting));
        let counts = Arc::new(Counters::default());
        for _ in 0..workers.max(1) {
            tokio::spawn(work(pool.clone(), waiting.clone(), counts.clone()));
        }
        Self { queue, counts }
    }

    /// Writes `c` fenced by `lease`, alone or with other runs' commits, and answers for it
    /// alone: `LeaseLost` only when its own lease was lost.
    pub(super) async fn commit(&self, lease: &Lease, c: RunCommit) -> Result<(), StoreError> {
        let (answer, answered) = oneshot::channel();
        self.queue
            .send(Queued {
                lease: lease.clone(),
                commit: c,
                answer,
            })
            .map_err(|_| StoreError::Unavailable("the store's committers have stopped".into()))?;
        // Its committer panicked while writing it: it may or may not have landed.
        answered.await.map_err(|_| {
            StoreError::Unavailable(
                "the commit's outcome is unknown: its committer failed while writing it".into(),
            )
        })?
    }
}

async fn work(
    pool: pg::PgPool,
    waiting: Arc<Mutex<mpsc::UnboundedReceiver<Queued>>>,
    counts: Arc<Counters>,
) {
    use futures_util::FutureExt as _;
    let suspects = Suspects::default();
    loop {
        let batch = {
            let mut waiting = waiting.lock().await;
            let Some(first) = waiting.recv().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match waiting.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            batch
        };
        // A panic must not take the committer with it: the batch's callers are told their
        // outcome is unknown (their answers are dropped), the next batch is written as usual.
        let written = std::panic::AssertUnwindSafe(write(&pool, batch, &counts, &suspects));
        if written.catch_unwind().await.is_err() {
            tracing::error!("a committer panicked writing a batch of commits; it goes on");
        }
    }
}

/// Runs whose last commit failed on its own after its batch failed: the database refuses
/// something in it (a duplicate key, text it cannot store), and its writer will retry it for
/// a while. Until it commits, it is written alone, so it fails no one else's batch again.
#[derive(Default)]
struct Suspects(std::sync::Mutex<std::collections::HashSet<String>>);

impl Suspects {
    /// Far more than there are runs in flight; past it the set starts again (a forgotten
    /// suspect costs one more failed batch, never a wrong answer).
    const MOST: usize = 4096;

    fn has(&self, run: &str) -> bool {
        self.0.lock().is_ok_and(|s| s.contains(run))
    }

    fn mark(&self, run: &str, failed: bool) {
        if let Ok(mut s) = self.0.lock() {
            if !failed {
                s.remove(run);
            } else {
                if s.len() >= Self::MOST {
                    s.clear();
                }
                s.insert(run.to_owned());
            }
        }
    }
}

/// Writes `batch` and answers each of its commits.
async fn write(pool: &pg::PgPool, batch: Vec<Queued>, counts: &Counters, suspects: &Suspects) {
    let checkout = || async {
        pg::checkout(pool, "agent")
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))
    };
    let mut client = match checkout().await {
        Ok(client) => client,
        Err(e) => {
            for q in batch {
                let _ = q.answer.send(Err(StoreError::Unavailable(e.to_string())));
            }
            return;
        }
    };
    // Written alone, after the batch: a second commit on one thread (a writer that lost its
    // lease and the one that took it; the batch's fence is one row per thread), and a suspect.
    let mut threads = std::collections::HashSet::new();
    let (together, mut alone): (Vec<Queued>, Vec<Queued>) = batch
        .into_iter()
        .partition(|q| !suspects.has(&q.lease.run_id) && threads.insert(q.lease.thread_id.clone()));
    if together.len() == 1 {
        alone.splice(0..0, together);
    } else if !together.is_empty() {
        let rows: Vec<(&Lease, &RunCommit)> =
            together.iter().map(|q| (&q.lease, &q.commit)).collect();
        match batch::many(&client, &rows).await {
            Ok(written) => {
                counts.wrote(together.len() - written.busy.len());
                let mut busy = Vec::new();
                for q in together {
                    if written.busy.contains(&q.lease.run_id) {
                        // Its thread row was locked by another transaction: alone, it waits.
                        busy.push(q);
                        continue;
                    }
                    let answer = if written.fenced.contains(&q.lease.run_id) {
                        Ok(())
                    } else {
                        Err(StoreError::LeaseLost)
                    };
                    let _ = q.answer.send(answer);
                }
                // Before the ones apart: one of those may be a later commit on a busy thread.
                alone.splice(0..0, busy);
            }
            Err(e) => {
                tracing::debug!(error = %e, commits = together.len(), "a batch of commits failed; committing each alone");
                counts.retried();
                alone.splice(0..0, together);
                if client.is_closed() {
                    client = match checkout().await {
                        Ok(fresh) => fresh,
                        Err(e) => {
                            for q in alone {
                                let _ = q.answer.send(Err(StoreError::Unavailable(e.to_string())));
                            }
                            return;
                        }
                    };
                }
            }
        }
    }
    for q in alone {
        let answer = commit::one(&client, &q.lease, &q.commit).await;
        counts.wrote(1);
        // Refused by a database that is still there: it would fail a batch as well.
        let refused = matches!(
            answer,
            Err(StoreError::Conflict(_) | StoreError::Unavailable(_))
        ) && !client.is_closed();
        suspects.mark(&q.lease.run_id, refused);
        let _ = q.answer.send(answer);
    }
}
