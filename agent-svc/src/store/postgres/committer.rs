//! Group commit across runs (issue 13, Q-2). Every run's writer hands its commit to a few
//! committer tasks; a committer takes whatever commits are waiting when it comes free and
//! writes them in one statement (`batch`), or a lone one as its own (`commit::one`). So a
//! quiet replica commits each run at once, as before, and a busy one — where PostgreSQL's
//! fixed cost per statement is what limits it — writes many runs per statement, without a
//! timer adding latency to either.

use std::sync::Arc;

use super::{
    batch, commit,
    group::{self, Counters, Queue, Waiting},
};
use crate::store::{Lease, RunCommit, StoreError};
use svc_kit::pg;

/// The most commits one statement carries: enough to amortise the statement, few enough that
/// a batch that fails and is retried commit by commit stays short.
const MAX_BATCH: usize = 32;

type Queued = Waiting<(Lease, RunCommit), ()>;

pub(super) struct Committer {
    queue: Queue<(Lease, RunCommit), ()>,
    pub(super) counts: Arc<Counters>,
}

impl Committer {
    /// Starts `workers` committer tasks on `pool`; they end when the committer is dropped.
    pub(super) fn start(pool: pg::PgPool, workers: usize) -> Self {
        let counts = Arc::new(Counters::new(
            "steward_db_commit_batch_size",
            "steward_db_commit_batches_retried_total",
        ));
        let suspects = Arc::new(Suspects::default());
        let written = counts.clone();
        let queue = group::start(workers, MAX_BATCH, "commit", move |batch| {
            let (pool, counts, suspects) = (pool.clone(), written.clone(), suspects.clone());
            async move { write(&pool, batch, &counts, &suspects).await }
        });
        Self { queue, counts }
    }

    /// Writes `c` fenced by `lease`, alone or with other runs' commits, and answers for it
    /// alone: `LeaseLost` only when its own lease was lost.
    pub(super) async fn commit(&self, lease: &Lease, c: RunCommit) -> Result<(), StoreError> {
        self.queue.submit((lease.clone(), c)).await
    }
}

/// Runs whose last commit failed on its own after its batch failed: the database refuses
/// something in it (a duplicate key, a constraint), and its writer sends it again — retried
/// while the failure may pass, or carried by the run's failure commit when it may not. Until
/// it commits, it is written alone, so it fails no one else's batch again.
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
async fn write(pool: &pg::PgPool, mut batch: Vec<Queued>, counts: &Counters, suspects: &Suspects) {
    let Some(mut client) = group::connection(pool, &mut batch).await else {
        return;
    };
    // Written alone, after the batch: a second commit on one thread (a writer that lost its
    // lease and the one that took it; the batch's fence is one row per thread), and a suspect.
    let mut threads = std::collections::HashSet::new();
    let (together, mut alone): (Vec<Queued>, Vec<Queued>) = batch.into_iter().partition(|q| {
        let lease = &q.item.0;
        !suspects.has(&lease.run_id) && threads.insert(lease.thread_id.clone())
    });
    if together.len() == 1 {
        alone.splice(0..0, together);
    } else if !together.is_empty() {
        let rows: Vec<(&Lease, &RunCommit)> =
            together.iter().map(|q| (&q.item.0, &q.item.1)).collect();
        match batch::many(&client, &rows).await {
            Ok(written) => {
                counts.wrote(together.len() - written.busy.len());
                let mut busy = Vec::new();
                for q in together {
                    let run = &q.item.0.run_id;
                    if written.busy.contains(run) {
                        // Its thread row was locked by another transaction: alone, it waits.
                        busy.push(q);
                    } else if written.fenced.contains(run) {
                        q.answer(Ok(()));
                    } else {
                        q.answer(Err(StoreError::LeaseLost));
                    }
                }
                // Before the ones apart: one of those may be a later commit on a busy thread.
                alone.splice(0..0, busy);
            }
            Err(e) if e.as_db_error().is_none() => {
                // The connection failed under the statement, which may have committed. Written
                // again, a commit that landed would repeat its history rows, or fail its fence
                // (a run's last commit releases its lease) and read as a lost lease. Each writer
                // is told the outcome is unknown, and looks for its events before it retries.
                let told =
                    group::unknown_outcome(pool, client, &e, ("commit", ""), together, &mut alone);
                let Some(usable) = told.await else {
                    return;
                };
                client = usable;
            }
            Err(e) => {
                let retry = group::refused_batch(pool, client, &e, counts, together, &mut alone);
                let Some(usable) = retry.await else {
                    return;
                };
                client = usable;
            }
        }
    }
    for q in alone {
        let (lease, c) = &q.item;
        let answer = commit::one(&client, lease, c).await;
        counts.wrote(1);
        // Refused by a database that is still there: it would fail a batch as well.
        let refused = matches!(
            answer,
            Err(StoreError::Conflict(_) | StoreError::Rejected(_) | StoreError::Unavailable(_))
        ) && !client.is_closed();
        suspects.mark(&lease.run_id, refused);
        q.answer(answer);
    }
}
