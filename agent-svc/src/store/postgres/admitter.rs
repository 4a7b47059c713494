//! Group admission (issue 13, Q-2): admissions of runs on new threads wait for a few admitter
//! tasks, and an admitter writes whatever waits when it comes free as one statement (in one
//! transaction with the owners' session summaries read) — each table once for the batch,
//! every run checked against its owner's cap. A burst of runs started together (a backend's
//! users all asking at once) is where PostgreSQL's fixed cost per transaction was the first
//! wave's latency; a lone admission goes out at once, alone.
//!
//! A batch only admits: a run it does not admit (at its owner's cap, a retried request id) is
//! then admitted alone, which tells it why, as it always did. An admitter never waits for an
//! owner's admission lock: a batch or a lone admission here only tries it, and the runs of an
//! owner whose lock is held elsewhere wait in `busy_owners` instead. Runs on an
//! existing thread are never batched: they take the thread's lease and supersede its paused
//! runs, which the store does in a transaction of their own, trying the owner's lock as an
//! admitter does and joining the same queue when it is held.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use tokio_postgres::types::ToSql;

use super::{
    admission, archive,
    busy_owners::BusyOwners,
    group::{self, Counters, Queue, Waiting},
    millis,
};
use crate::store::{Admission, Admitted, Archive, Lease, StoreError};
use svc_kit::pg;

/// The most admissions one statement carries; as for commits, enough to amortise the
/// statement and few enough that a batch retried one by one stays short.
const MAX_BATCH: usize = 32;

/// Admits every run of the batch whose owner is under the cap and whose request id is new:
/// its thread (with the run's lease), the run, its first event and the user's message. Returns
/// the runs admitted. The cap is counted before the batch, so a batch holds one run per owner.
const SQL_ADMIT_MANY: &str = "WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], \
      $4::text[], $5::text[], $6::text[], $7::text[], $8::bigint[], $9::bytea[], $10::text[], $11::bigint[], \
      $12::text[]) AS u(run, thread, owner, request, channel, title, token, ttl, event, message, cap, zone)), \
  live AS (SELECT r.owner, count(*) AS n FROM agent.runs r \
      WHERE r.owner = ANY($3::text[]) AND r.state IN ('queued', 'planning', 'executing') GROUP BY r.owner), \
  runs AS (INSERT INTO agent.runs (id, thread_id, owner, request_id, state, channel, last_event_seq, \
      time_zone) \
      SELECT u.run, u.thread, u.owner, u.request, 'queued', u.channel, 1, u.zone \
      FROM u LEFT JOIN live l ON l.owner = u.owner WHERE COALESCE(l.n, 0) < u.cap \
      ON CONFLICT (owner, request_id) WHERE request_id IS NOT NULL DO NOTHING RETURNING id), \
  threads AS (INSERT INTO agent.threads (id, owner, title, lock_run_id, lock_token, lock_expires_at, \
      last_run_id) \
      SELECT u.thread, u.owner, u.title, u.run, u.token, \
        clock_timestamp() + u.ttl * interval '1 millisecond', u.run \
      FROM u WHERE u.run IN (SELECT id FROM runs)), \
  events AS (INSERT INTO agent.run_events (run_id, seq, payload) \
      SELECT u.run, 1, u.event FROM u WHERE u.run IN (SELECT id FROM runs)), \
  messages AS (INSERT INTO agent.messages (thread_id, run_id, source, kind, content) \
      SELECT u.thread, u.run, 'user', 'text', u.message FROM u \
      WHERE u.message IS NOT NULL AND u.run IN (SELECT id FROM runs)) \
  SELECT id FROM runs";

/// The newest `$2` session summaries of each owner in `$1`, as `archive` reads them, with the
/// owner last.
const SQL_SUMMARIES_OF_OWNERS: &str = "SELECT thread_id, summary, turn_count, archived_at, external, owner \
    FROM (SELECT a.*, row_number() OVER (PARTITION BY a.owner ORDER BY a.archived_at DESC, a.id DESC) AS n \
      FROM agent.session_archives a WHERE a.owner = ANY($1::text[])) newest \
    WHERE n <= $2 ORDER BY owner, n";

type Queued = Waiting<Admission, Admitted>;

pub(super) struct Admitter {
    queue: Queue<Admission, Admitted>,
    pub(super) counts: Arc<Counters>,
    busy: Arc<BusyOwners>,
}

/// What the admitter tasks share.
struct Shared {
    pool: pg::PgPool,
    counts: Arc<Counters>,
    busy: Arc<BusyOwners>,
}

impl Admitter {
    /// Starts `workers` admitter tasks on `pool`; they end when the admitter is dropped (the
    /// busy owners' queues once they are empty).
    pub(super) fn start(pool: pg::PgPool, workers: usize) -> Self {
        let counts = Arc::new(Counters::new(
            "steward_db_admission_batch_size",
            "steward_db_admission_batches_retried_total",
        ));
        let busy = BusyOwners::new(pool.clone(), counts.clone(), workers);
        let shared = Arc::new(Shared {
            busy: busy.clone(),
            pool,
            counts: counts.clone(),
        });
        let queue = group::start(workers, MAX_BATCH, "admission", move |batch| {
            write(shared.clone(), batch)
        });
        Self {
            queue,
            counts,
            busy,
        }
    }

    /// Admits `a` (a run on a new thread), alone or with others, and answers for it alone. An
    /// outcome left unknown (its admitter failed) may be a run admitted that nothing runs: it
    /// is ended as abandoned once its lease lapses.
    pub(super) async fn admit(&self, a: Admission) -> Result<Admitted, StoreError> {
        self.queue.submit(a).await
    }

    /// Whether `owner` has runs waiting for their admission lock: a run of theirs admitted
    /// elsewhere must wait behind them ([`Admitter::wait_for_owner`]).
    pub(super) fn owner_is_waiting(&self, owner: &str) -> bool {
        self.busy.is_waiting(owner)
    }

    /// Admits `a` (a run on an existing thread, its owner's lock found held) behind the owner's
    /// runs already waiting: in order, counted in the metrics, and on the owner's one
    /// connection rather than one held per waiting run.
    pub(super) async fn wait_for_owner(&self, a: Admission) -> Result<Admitted, StoreError> {
        let (waiting, outcome) = Waiting::new(a, "admission");
        self.busy.wait(waiting);
        outcome.await
    }
}

/// Writes `batch` and answers each of its admissions.
async fn write(shared: Arc<Shared>, batch: Vec<Queued>) {
    let (pool, counts) = (&shared.pool, &*shared.counts);
    // An owner with runs queued behind a lock held elsewhere: its new runs join that queue
    // rather than overtake it.
    let (queued, mut batch): (Vec<Queued>, Vec<Queued>) = batch
        .into_iter()
        .partition(|q| shared.busy.is_waiting(&q.item.run.owner));
    for q in queued {
        shared.busy.wait(q);
    }
    if batch.is_empty() {
        return;
    }
    let Some(mut client) = group::connection(pool, &mut batch).await else {
        return;
    };
    // Admitted alone, after the batch: a second run of one owner (the batch counts the cap
    // before it, and a request id is unique per owner), and a second run on one thread.
    let mut seen = HashSet::new();
    let (mut together, mut alone): (Vec<Queued>, Vec<Queued>) = batch.into_iter().partition(|q| {
        let run = &q.item.run;
        seen.insert(("owner", run.owner.clone())) & seen.insert(("thread", run.thread_id.clone()))
    });
    // Owners whose admission locks are held elsewhere: their runs wait in `BusyOwners`, while
    // this admitter goes on. Nothing here waits for an owner's lock.
    let mut busy: HashSet<String> = HashSet::new();
    while together.len() > 1 {
        let admissions: Vec<&Admission> = together.iter().map(|q| &q.item).collect();
        match many(&client, &admissions).await {
            Ok(mut admitted) => {
                counts.wrote(admitted.len());
                let mut refused = Vec::new();
                for q in together.drain(..) {
                    match admitted.remove(&q.item.run.id) {
                        Some(started) => q.answer(Ok(started)),
                        // Refused: alone, it is told why (or admitted, if that has changed).
                        None => refused.push(q),
                    }
                }
                // Before the ones set apart: an owner's run refused here came first.
                alone.splice(0..0, refused);
            }
            // No answer from the database (the connection broke): the batch may have
            // committed, and admitting its runs again would meet their own rows. Each is told
            // its outcome is unknown; a run that was admitted is ended as abandoned once its
            // lease lapses, and a caller's retry with its request id finds it.
            Err(e) if e.as_db_error().is_none() => {
                let batch = std::mem::take(&mut together);
                let advice = ("admission", "; retry the run");
                let told = group::unknown_outcome(pool, client, &e, advice, batch, &mut alone);
                let Some(usable) = told.await else {
                    return;
                };
                client = usable;
            }
            Err(e) => match admission::owners_busy(&e) {
                // Nothing was written: the rest of the batch is tried again without the busy
                // owners. Each try sets at least one owner apart, so this ends.
                Some(owners) => {
                    counts.retried();
                    busy.extend(owners);
                    let (wait, rest): (Vec<Queued>, Vec<Queued>) = together
                        .drain(..)
                        .partition(|q| busy.contains(&q.item.run.owner));
                    if wait.is_empty() {
                        // None of the owners named is in the batch: trying it again would
                        // never end, so each of its runs goes alone.
                        alone.splice(0..0, rest);
                    } else {
                        alone.splice(0..0, wait);
                        together = rest;
                    }
                }
                None => {
                    let retry = group::refused_batch(
                        pool,
                        client,
                        &e,
                        counts,
                        std::mem::take(&mut together),
                        &mut alone,
                    );
                    let Some(usable) = retry.await else {
                        return;
                    };
                    client = usable;
                }
            },
        }
    }
    // A batch of one goes alone, as do the runs set apart: each only tries its owner's lock.
    alone.splice(0..0, together);
    for q in alone {
        if busy.contains(&q.item.run.owner) || shared.busy.is_waiting(&q.item.run.owner) {
            shared.busy.wait(q);
            continue;
        }
        match admission::one_unless_owner_busy(&client, &q.item).await {
            Some(answer) => {
                counts.wrote(1);
                q.answer(answer);
            }
            None => {
                busy.insert(q.item.run.owner.clone());
                shared.busy.wait(q);
            }
        }
    }
}

/// The batch's rows, column by column.
#[derive(Default)]
struct Columns<'a> {
    run: Vec<&'a str>,
    thread: Vec<&'a str>,
    owner: Vec<&'a str>,
    request: Vec<Option<&'a str>>,
    channel: Vec<&'a str>,
    title: Vec<&'a str>,
    token: Vec<String>,
    ttl: Vec<i64>,
    event: Vec<&'a [u8]>,
    message: Vec<Option<&'a str>>,
    cap: Vec<i64>,
    zone: Vec<Option<&'a str>>,
}

/// Admits, in one statement, every run of `batch` (runs on new threads, one per owner and per
/// thread) that its owner's cap and request id let in, with the summaries each asked for.
async fn many(
    client: &pg::Pooled,
    batch: &[&Admission],
) -> Result<HashMap<String, Admitted>, tokio_postgres::Error> {
    let mut cols = Columns::default();
    let mut leases: HashMap<&str, (&Admission, Lease)> = HashMap::new();
    for a in batch {
        let run = &a.run;
        let lease = Lease::new(&run.thread_id, &run.id);
        cols.run.push(&run.id);
        cols.thread.push(&run.thread_id);
        cols.owner.push(&run.owner);
        cols.request.push(run.request_id.as_deref());
        cols.channel.push(&run.channel);
        cols.title
            .push(a.new_thread_title.as_deref().unwrap_or_default());
        cols.token.push(lease.token.clone());
        cols.ttl.push(millis(a.lease));
        cols.event.push(&a.first_event);
        cols.message.push(a.user_message.as_deref());
        cols.cap.push(i64::from(a.max_active_runs));
        cols.zone.push(run.time_zone.as_deref());
        leases.insert(&run.id, (a, lease));
    }
    let params: [&(dyn ToSql + Sync); 12] = [
        &cols.run,
        &cols.thread,
        &cols.owner,
        &cols.request,
        &cols.channel,
        &cols.title,
        &cols.token,
        &cols.ttl,
        &cols.event,
        &cols.message,
        &cols.cap,
        &cols.zone,
    ];
    let most_summaries = batch.iter().map(|a| a.summaries).max().unwrap_or(0) as i64;
    let wanting: Vec<&str> = batch
        .iter()
        .filter(|a| a.summaries > 0)
        .map(|a| a.run.owner.as_str())
        .collect();
    let lock = client
        .prepare_cached(admission::SQL_TRY_LOCK_OWNERS)
        .await?;
    let admit = client.prepare_cached(SQL_ADMIT_MANY).await?;
    let read = client.prepare_cached(SQL_SUMMARIES_OF_OWNERS).await?;
    // One transaction in one round trip, BEGIN to COMMIT, as a lone admission is: a read that
    // fails undoes the write too, so a batch that failed with the database's error wrote
    // nothing and its admissions can be tried again alone.
    let t: &tokio_postgres::Client = client;
    let mut open = pg::Begun::new(t);
    // The cap is counted after the owners' locks are held, and none of them is waited for:
    // see `admission::SQL_TRY_LOCK_OWNERS`.
    let ((begun, locked), admitted, recent, committed) = futures_util::future::join4(
        futures_util::future::join(
            t.batch_execute(admission::BEGIN),
            t.execute(&lock, &[&cols.owner]),
        ),
        t.query(&admit, &params),
        async {
            match wanting.is_empty() {
                true => Ok(Vec::new()),
                false => t.query(&read, &[&wanting, &most_summaries]).await,
            }
        },
        t.batch_execute("COMMIT"),
    )
    .await;
    // COMMIT was sent: the transaction is over whatever it answers (after a failed statement
    // it answers ROLLBACK, so the first failure decides).
    open.committed();
    begun?;
    locked?;
    let (admitted, recent) = (admitted?, recent?);
    committed?;
    let mut summaries: HashMap<String, Vec<Archive>> = HashMap::new();
    for row in &recent {
        summaries.entry(row.get(5)).or_default().push(archive(row));
    }
    let mut started = HashMap::new();
    for row in admitted {
        let id: String = row.get(0);
        let Some((a, lease)) = leases.remove(id.as_str()) else {
            continue;
        };
        let mut recent = summaries.get(&a.run.owner).cloned().unwrap_or_default();
        recent.truncate(a.summaries);
        started.insert(
            id,
            Admitted::Started {
                lease,
                summaries: recent,
            },
        );
    }
    Ok(started)
}
