//! Admissions whose owner's admission lock is held elsewhere: another replica admitting
//! the same owner, or a stalled transaction holding the lock until DATABASE_LOCK_TIMEOUT and
//! the server's idle-in-transaction timeout end it. The admitters never wait for such a lock —
//! a batch only tries its owners' locks — so one owner cannot hold up everyone else's
//! admissions; the runs they set apart wait here instead, as do runs on existing threads that
//! found their owner's lock held (or their owner's runs already waiting here).
//!
//! Each busy owner's runs form one queue, served in order by one task on one connection,
//! however many of the owner's runs (or a client's retries) arrive meanwhile. A round waits for
//! the owner's lock once for every run queued by then: freed, they are admitted one by one;
//! still held when the lock timeout ends the wait, they are all told so at once rather than
//! each waiting out the timeout again. At most `slots` owners are served at a time, so the
//! queues take no more connections than the admitters do however many owners are busy.

use std::{collections::HashMap, sync::Arc};

use futures_util::FutureExt as _;
use svc_kit::{group::Counters, pg};
use tokio::sync::Semaphore;

use super::{admission, db, group::Waiting};
use crate::store::{Admission, Admitted};

type Queued = Waiting<Admission, Admitted>;

pub(super) struct BusyOwners {
    pool: pg::PgPool,
    counts: Arc<Counters>,
    /// Each busy owner's queued runs, in the order they came; an owner is here while a task
    /// serves it, so a run that finds its owner here joins the queue rather than overtake it.
    queues: std::sync::Mutex<HashMap<String, Vec<Queued>>>,
    /// How many owners are served at once: each holds a connection while it waits.
    slots: Semaphore,
}

impl BusyOwners {
    pub(super) fn new(pool: pg::PgPool, counts: Arc<Counters>, slots: usize) -> Arc<Self> {
        Arc::new(Self {
            pool,
            counts,
            queues: Default::default(),
            slots: Semaphore::new(slots.max(1)),
        })
    }

    /// Whether `owner` has runs waiting here: a later run of theirs must wait behind them.
    pub(super) fn is_waiting(&self, owner: &str) -> bool {
        self.lock().contains_key(owner)
    }

    /// Queues `q` behind its owner's runs waiting here, and starts serving the owner if
    /// nothing does yet.
    pub(super) fn wait(self: &Arc<Self>, q: Queued) {
        crate::metrics::admission_set_apart();
        crate::metrics::admission_waiting_for_owner(1.0);
        let owner = q.item.run.owner.clone();
        let first = {
            let mut queues = self.lock();
            match queues.get_mut(&owner) {
                Some(waiting) => {
                    waiting.push(q);
                    false
                }
                None => {
                    queues.insert(owner.clone(), vec![q]);
                    true
                }
            }
        };
        if first {
            tokio::spawn(serve(self.clone(), owner));
        }
    }

    /// The owner's runs queued now, or `None` — the owner forgotten, so its next busy run is
    /// served anew — when none is.
    fn next(&self, owner: &str) -> Option<Vec<Queued>> {
        let mut queues = self.lock();
        let runs = std::mem::take(queues.get_mut(owner)?);
        if runs.is_empty() {
            queues.remove(owner);
            return None;
        }
        Some(runs)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Queued>>> {
        // The map is consistent at every point a panic could leave it.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Serves `owner`'s queue until it is empty. A panic drops the queue, so its callers are told
/// their outcome is unknown, rather than waiting on a queue nothing serves.
async fn serve(busy: Arc<BusyOwners>, owner: String) {
    let served = std::panic::AssertUnwindSafe(serve_until_empty(&busy, &owner))
        .catch_unwind()
        .await;
    if served.is_err() {
        tracing::error!(%owner, "the task admitting a busy owner's runs panicked; they are told so");
        let dropped = busy.lock().remove(&owner).map_or(0, |runs| runs.len());
        drop(Answered(dropped));
    }
}

async fn serve_until_empty(busy: &BusyOwners, owner: &str) {
    // The semaphore is never closed; were it, the owners served would merely be unbounded.
    let _slot = busy.slots.acquire().await.ok();
    let mut client: Option<pg::Pooled> = None;
    while let Some(mut runs) = busy.next(owner) {
        // Every run of the round is answered by the time this drops, a panic included.
        let mut answered = Answered(runs.len());
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            // None: the pool had no connection, and each of these runs was told so.
            client = super::group::connection(&busy.pool, &mut runs).await;
        }
        let Some(client) = &client else {
            continue;
        };
        if let Err(e) = lock_freed(client, owner).await {
            let error = db(e);
            for q in runs {
                q.answer(Err(error.clone()));
            }
            continue;
        }
        for q in runs {
            let answer = admission::one(client, &q.item).await;
            // The admission counts are group admission's, of runs on new threads.
            if q.item.new_thread_title.is_some() {
                busy.counts.wrote(1);
            }
            q.answer(answer);
            answered.one();
        }
    }
}

/// Waits until `owner`'s admission lock is free, at most DATABASE_LOCK_TIMEOUT, and lets it go
/// again at once: the admissions after it take it for themselves.
async fn lock_freed(client: &pg::Pooled, owner: &str) -> Result<(), tokio_postgres::Error> {
    let wait = client.prepare_cached(admission::SQL_LOCK_OWNERS).await?;
    let t: &tokio_postgres::Client = client;
    let owners: &[&str] = &[owner];
    let mut open = pg::Begun::new(t);
    let (begun, waited, ended) = futures_util::future::join3(
        t.batch_execute(admission::BEGIN),
        t.execute(&wait, &[&owners]),
        t.batch_execute("ROLLBACK"),
    )
    .await;
    open.committed();
    begun?;
    waited?;
    ended
}

/// Takes a round's runs off the waiting gauge: each as it is admitted, the rest (answered
/// together, or dropped and so told) when it drops.
struct Answered(usize);

impl Answered {
    fn one(&mut self) {
        self.0 -= 1;
        crate::metrics::admission_waiting_for_owner(-1.0);
    }
}

impl Drop for Answered {
    fn drop(&mut self) {
        crate::metrics::admission_waiting_for_owner(-(self.0 as f64));
    }
}
