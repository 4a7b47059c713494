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
        let closed = || StoreError::Unavailable("the store's committer has stopped".into());
        self.queue
            .send(Queued {
                lease: lease.clone(),
                commit: c,
                answer,
            })
            .map_err(|_| closed())?;
        answered.await.map_err(|_| closed())?
    }
}

async fn work(
    pool: pg::PgPool,
    waiting: Arc<Mutex<mpsc::UnboundedReceiver<Queued>>>,
    counts: Arc<Counters>,
) {
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
        write(&pool, batch, &counts).await;
    }
}

/// Writes `batch` and answers each of its commits.
async fn write(pool: &pg::PgPool, batch: Vec<Queued>, counts: &Counters) {
    let client = match pg::checkout(pool, "agent").await {
        Ok(client) => client,
        Err(e) => {
            let e = e.to_string();
            for q in batch {
                let _ = q.answer.send(Err(StoreError::Unavailable(e.clone())));
            }
            return;
        }
    };
    // Two commits on one thread (a writer that lost its lease and the one that took it) go
    // in statements of their own, after the batch: the batch's fence is one row per thread.
    let mut threads = std::collections::HashSet::new();
    let (together, apart): (Vec<Queued>, Vec<Queued>) = batch
        .into_iter()
        .partition(|q| threads.insert(q.lease.thread_id.clone()));
    let mut alone = apart;
    if together.len() == 1 {
        alone.splice(0..0, together);
    } else {
        let rows: Vec<(&Lease, &RunCommit)> =
            together.iter().map(|q| (&q.lease, &q.commit)).collect();
        match batch::many(&client, &rows).await {
            Ok(fenced) => {
                counts.wrote(together.len());
                for q in together {
                    let answer = if fenced.contains(&q.lease.run_id) {
                        Ok(())
                    } else {
                        Err(StoreError::LeaseLost)
                    };
                    let _ = q.answer.send(answer);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, commits = together.len(), "a batch of commits failed; committing each alone");
                counts.retried();
                alone.splice(0..0, together);
            }
        }
    }
    for q in alone {
        let answer = commit::one(&client, &q.lease, &q.commit).await;
        counts.wrote(1);
        let _ = q.answer.send(answer);
    }
}
