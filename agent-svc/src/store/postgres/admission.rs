//! A run's admission on PostgreSQL: one transaction that checks the owner's cap,
//! takes (or makes) the thread and its lease, and writes the run with its first event and the
//! user's message — all of it, or, refused, nothing. Many admissions of new threads that wait
//! together are written as one statement instead (`admitter`).

use svc_kit::pg;

use super::{archive, db, millis};
use crate::store::{Admission, Admitted, Lease, StoreError};

/// Admits `a` in one transaction of its own, sent as one pipeline: its checks, the thread's
/// lease, the run, its first event and message, and the owner's recent session summaries. It
/// waits for the owner's admission lock, at most DATABASE_LOCK_TIMEOUT.
pub(super) async fn one(client: &pg::Pooled, a: &Admission) -> Result<Admitted, StoreError> {
    admit(client, a, SQL_LOCK_OWNERS)
        .await
        .map_err(|refused| match refused {
            Refused::Store(e) => e,
            // Waiting for the lock, the admission is answered; this is for completeness.
            Refused::OwnerBusy => StoreError::Unavailable(format!(
                "{}'s admission lock is held elsewhere; retry",
                a.run.owner
            )),
        })
}

/// Admits `a` as `one` does if its owner's admission lock is free; `None`, with nothing
/// written, when it is held elsewhere (an admitter does not wait on one owner while others
/// queue behind it).
pub(super) async fn one_unless_owner_busy(
    client: &pg::Pooled,
    a: &Admission,
) -> Option<Result<Admitted, StoreError>> {
    match admit(client, a, SQL_TRY_LOCK_OWNERS).await {
        Ok(admitted) => Some(Ok(admitted)),
        Err(Refused::Store(e)) => Some(Err(e)),
        Err(Refused::OwnerBusy) => None,
    }
}

/// Why a lone admission was not answered.
enum Refused {
    /// Its owner's admission lock is held elsewhere, and it was only tried.
    OwnerBusy,
    Store(StoreError),
}

impl From<StoreError> for Refused {
    fn from(e: StoreError) -> Self {
        Refused::Store(e)
    }
}

/// `one`, taking the owner's lock by `lock_owners` (`SQL_LOCK_OWNERS` or
/// `SQL_TRY_LOCK_OWNERS`).
async fn admit(client: &pg::Pooled, a: &Admission, lock_owners: &str) -> Result<Admitted, Refused> {
    use tokio_postgres::types::ToSql;
    type Param<'a> = &'a (dyn ToSql + Sync);
    let run = &a.run;
    let lease = Lease::new(&run.thread_id, &run.id);
    let ttl = millis(a.lease);
    let t: &tokio_postgres::Client = client;
    // The whole admission is one pipeline, BEGIN to COMMIT: each check raises
    // `agent.admission_refused` when it fails (migration V13), which aborts the transaction,
    // so COMMIT need not wait for the answers — one round trip while the connection is held.
    let lock = client.prepare_cached(lock_owners).await.map_err(db)?;
    let count = client.prepare_cached(SQL_ADMIT_CAP).await.map_err(db)?;
    let take = client
        .prepare_cached(if a.new_thread_title.is_some() {
            SQL_NEW_THREAD
        } else {
            SQL_TAKE_THREAD
        })
        .await
        .map_err(db)?;
    // Nothing can be paused on a thread this admission makes.
    let supersede = match a.new_thread_title {
        Some(_) => None,
        None => Some(
            client
                .prepare_cached(if a.supersede_paused {
                    SQL_SUPERSEDE
                } else {
                    SQL_NOT_PAUSED
                })
                .await
                .map_err(db)?,
        ),
    };
    let insert = client.prepare_cached(SQL_ADMIT_RUN).await.map_err(db)?;
    let summaries = match a.summaries {
        0 => None,
        _ => Some(
            client
                .prepare_cached(SQL_RECENT_SUMMARIES)
                .await
                .map_err(db)?,
        ),
    };
    let summary_limit = a.summaries as i64;
    let max_active = i64::from(a.max_active_runs);
    let title = a.new_thread_title.as_deref().unwrap_or_default();
    let count_params: [Param<'_>; 2] = [&run.owner, &max_active];
    let take_params: [Param<'_>; 6] = match &a.new_thread_title {
        Some(_) => [
            &run.thread_id,
            &run.owner,
            &title,
            &run.id,
            &lease.token,
            &ttl,
        ],
        None => [
            &run.thread_id,
            &run.id,
            &lease.token,
            &ttl,
            &run.owner,
            &title,
        ],
    };
    let supersede_params: [Param<'_>; 3] =
        [&run.thread_id, &a.supersede_message, &a.supersede_event];
    // SQL_NOT_PAUSED only looks at the thread ($1).
    let supersede_params = &supersede_params[..if a.supersede_paused { 3 } else { 1 }];
    let insert_params: [Param<'_>; 8] = [
        &run.id,
        &run.thread_id,
        &run.owner,
        &run.request_id,
        &run.channel,
        &a.first_event,
        &a.user_message,
        &run.time_zone,
    ];
    let mut open = pg::Begun::new(t);
    // join polls in order, and each statement is sent when first polled: BEGIN goes first,
    // COMMIT last.
    let owners: &[&str] = &[run.owner.as_str()];
    let owner: [Param<'_>; 1] = [&owners];
    let ((begun, locked, active, taken), (superseded, inserted, recent, committed)) =
        futures_util::future::join(
            futures_util::future::join4(
                t.batch_execute(BEGIN),
                t.execute_raw(&lock, owner),
                t.query_one(&count, &count_params),
                t.execute_raw(&take, take_params),
            ),
            futures_util::future::join4(
                async {
                    match &supersede {
                        Some(s) => t.execute_raw(s, supersede_params.iter().copied()).await,
                        None => Ok(0),
                    }
                },
                t.query_one(&insert, &insert_params),
                async {
                    match &summaries {
                        Some(s) => t.query(s, &[&run.owner, &summary_limit]).await,
                        None => Ok(Vec::new()),
                    }
                },
                t.batch_execute("COMMIT"),
            ),
        )
        .await;
    // COMMIT was sent: the transaction is over whatever it answers.
    open.committed();
    begun.map_err(db)?;
    // The first statement that failed decides (those behind it failed unexecuted), and
    // COMMIT answered ROLLBACK: nothing of this admission is left behind.
    let failed = (locked.err())
        .or(active.err())
        .or(taken.err())
        .or(superseded.err())
        .or(inserted.err());
    let recent = match (failed, recent) {
        (Some(e), _) | (None, Err(e)) if owners_busy(&e).is_some() => {
            return Err(Refused::OwnerBusy);
        }
        (Some(e), _) | (None, Err(e)) => return Ok(refused(client, a, e).await?),
        (None, Ok(rows)) => rows,
    };
    committed.map_err(db)?;
    let summaries = recent.iter().map(archive).collect();
    Ok(Admitted::Started { lease, summaries })
}

/// The owners a batch met with their admission locks held elsewhere, when that is why the
/// database refused it (`SQL_TRY_LOCK_OWNERS`).
pub(super) fn owners_busy(e: &tokio_postgres::Error) -> Option<Vec<String>> {
    let refusal = e.as_db_error()?;
    if refusal.code().code() != REFUSED_OWNERS_BUSY {
        return None;
    }
    let owners: Vec<String> = serde_json::from_str(refusal.detail()?).ok()?;
    (!owners.is_empty()).then_some(owners)
}

/// What a refused admission tells its caller, from the check that refused it
/// (`agent.admission_refused`, migration V13); any other error is the database's.
async fn refused(
    client: &pg::Pooled,
    a: &Admission,
    e: tokio_postgres::Error,
) -> Result<Admitted, StoreError> {
    let run = &a.run;
    let Some(refusal) = e.as_db_error() else {
        return Err(db(e));
    };
    let detail = refusal.detail().unwrap_or_default();
    let code = refusal.code().code();
    // A retried request id is told of its first run. A retry racing its original meets
    // the original's lease or cap before its own request id, and is told the same, as the
    // in-memory store tells it.
    let may_be_a_retry = code == REFUSED_DUPLICATE
        || run.request_id.is_some()
            && [
                REFUSED_TOO_MANY_RUNS,
                REFUSED_BUSY,
                REFUSED_AWAITING_APPROVAL,
            ]
            .contains(&code);
    if may_be_a_retry
        && let Some(first) = client
            .query_opt(
                "SELECT id, thread_id FROM agent.runs WHERE owner = $1 AND request_id = $2",
                &[&run.owner, &run.request_id],
            )
            .await
            .map_err(db)?
    {
        return Ok(Admitted::Duplicate {
            run_id: first.get(0),
            thread_id: first.get(1),
        });
    }
    match code {
        REFUSED_TOO_MANY_RUNS => Ok(Admitted::TooManyRuns {
            active: detail.parse().unwrap_or(a.max_active_runs),
        }),
        REFUSED_AWAITING_APPROVAL => Ok(Admitted::AwaitingApproval {
            run_id: detail.to_owned(),
        }),
        REFUSED_BUSY => {
            let holder = client
                .query_opt(
                    "SELECT CASE WHEN lock_expires_at > clock_timestamp() THEN lock_run_id END FROM agent.threads \
                     WHERE id = $1 AND owner = $2",
                    &[&run.thread_id, &run.owner],
                )
                .await
                .map_err(db)?
                .ok_or_else(|| StoreError::NotFound(format!("thread {}", run.thread_id)))?;
            Ok(Admitted::Busy {
                run_id: holder.get::<_, Option<String>>(0).unwrap_or_default(),
            })
        }
        // The run the insert met was deleted (with its thread) before this read: a
        // conflict the caller can retry.
        REFUSED_DUPLICATE => Err(StoreError::Conflict(format!(
            "run request {:?} conflicted with a run that is gone; retry",
            run.request_id.as_deref().unwrap_or_default()
        ))),
        _ => Err(db(e)),
    }
}

/// The admission's checks raise `agent.admission_refused` (migration V13) with these SQLSTATEs.
const REFUSED_TOO_MANY_RUNS: &str = "SWA01";
const REFUSED_BUSY: &str = "SWA02";
const REFUSED_AWAITING_APPROVAL: &str = "SWA03";
const REFUSED_DUPLICATE: &str = "SWA04";
/// An admission's transaction. Its cap is counted after the owners' locks are taken, which
/// holds only if each statement takes its own snapshot: READ COMMITTED whatever the
/// database's or role's default isolation is.
pub(super) const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";
/// The admission locks of the owners in `$1` (a lone admission's one owner): admissions of one
/// owner wait for each other from here to their COMMIT, on every replica, so the cap counted
/// after it sees every run admitted before it and two admissions never both find the owner one
/// under the cap. The key space is the schedules' (`'schedules:' || owner`), with its
/// own prefix.
pub(super) const SQL_LOCK_OWNERS: &str = "SELECT pg_advisory_xact_lock(k) FROM \
    (SELECT DISTINCT hashtext('runs:' || o) AS k FROM unnest($1::text[]) AS o ORDER BY k) owners";
/// The same locks for a batch of admissions, without waiting: when any owner's lock is held
/// elsewhere (another admission in flight, or a stalled replica's transaction), the batch is
/// refused at once with `REFUSED_OWNERS_BUSY`, naming those owners as a JSON array. A batch
/// that waited for one owner would hold every other owner in it for as long (up to
/// `DATABASE_LOCK_TIMEOUT`); refused, the others are admitted without them, and only the busy
/// owners' runs wait, alone. Never waiting, it cannot deadlock, so it needs no order.
pub(super) const SQL_TRY_LOCK_OWNERS: &str = "SELECT CASE WHEN bool_and(got IS TRUE) THEN 0 \
      ELSE agent.admission_refused('SWA05', \
        COALESCE((json_agg(o) FILTER (WHERE got IS NOT TRUE))::text, '[]')) END \
    FROM (SELECT o, pg_try_advisory_xact_lock(hashtext('runs:' || o)) AS got \
      FROM unnest($1::text[]) AS o) tried";
/// A batch met owners whose admission locks are held elsewhere (`SQL_TRY_LOCK_OWNERS`).
pub(super) const REFUSED_OWNERS_BUSY: &str = "SWA05";
/// A decision's lock of its run's owner (`$1` is the run): the admissions' key, so a run
/// revived by a decision is counted against the cap as one admitted is. Returns the owner.
pub(super) const SQL_LOCK_RUN_OWNER: &str =
    "SELECT owner, pg_advisory_xact_lock(hashtext('runs:' || owner)) FROM agent.runs WHERE id = $1";
/// `SQL_LOCK_RUN_OWNER` without waiting: refused with `REFUSED_OWNERS_BUSY`, naming the owner,
/// when the lock is held elsewhere, so the decision is counted before it waits.
pub(super) const SQL_TRY_LOCK_RUN_OWNER: &str = "SELECT owner, \
      CASE WHEN pg_try_advisory_xact_lock(hashtext('runs:' || owner)) THEN 0 \
      ELSE agent.admission_refused('SWA05', json_build_array(owner)::text) END \
    FROM agent.runs WHERE id = $1";
/// How many live runs the owner of run `$1` has.
pub(super) const SQL_LIVE_RUNS_OF_RUN: &str = "SELECT count(*) FROM agent.runs \
    WHERE owner = (SELECT owner FROM agent.runs WHERE id = $1) \
      AND state IN ('queued', 'planning', 'executing')";
/// The owner's live runs, refused at the cap (`$2`) with their count.
const SQL_ADMIT_CAP: &str = "SELECT CASE WHEN count(*) < $2::bigint THEN count(*) \
      ELSE agent.admission_refused('SWA01', count(*)::text) END \
    FROM agent.runs WHERE owner = $1 AND state IN ('queued', 'planning', 'executing')";
const SQL_NEW_THREAD: &str = "INSERT INTO agent.threads (id, owner, title, lock_run_id, lock_token, lock_expires_at, \
      last_run_id) \
    VALUES ($1, $2, $3, $4, $5, clock_timestamp() + $6::bigint * interval '1 millisecond', $4)";
/// Takes an existing thread's lease if it is free or lapsed (`$6`, the title, is unused);
/// refused as busy when it is neither (or the thread is someone else's).
const SQL_TAKE_THREAD: &str = "WITH taken AS (UPDATE agent.threads SET lock_run_id = $2, lock_token = $3, \
      lock_expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond', last_run_id = $2, updated_at = now() \
    WHERE id = $1 AND owner = $5 AND $6::text IS NOT NULL AND (lock_run_id IS NULL OR lock_expires_at <= clock_timestamp()) \
    RETURNING 1) \
    SELECT CASE WHEN EXISTS (SELECT 1 FROM taken) THEN 1 ELSE agent.admission_refused('SWA02', '') END";
/// Runs paused on the thread are superseded by the new message (their calls are closed by the
/// new run), their approvals void.
const SQL_SUPERSEDE: &str = "WITH ended AS (UPDATE agent.runs SET state = 'cancelled', error = $2, \
      failure_kind = 'cancelled', finished_at = now(), last_event_seq = last_event_seq + 1 \
      WHERE thread_id = $1 AND state = 'awaiting_confirmation' RETURNING id, last_event_seq), \
    ev AS (INSERT INTO agent.run_events (run_id, seq, payload) SELECT id, last_event_seq, $3 FROM ended), \
    ap AS (UPDATE agent.approvals SET state = 'expired' WHERE thread_id = $1 AND state = 'pending') \
    SELECT pg_notify('agent_runs', 'e:' || id) FROM ended";
/// An admission that must not supersede a run paused for approval on the thread is refused
/// with that run's id; with none paused it returns no row (the thread lease taken first in the
/// same transaction keeps any other run from pausing meanwhile).
const SQL_NOT_PAUSED: &str = "SELECT agent.admission_refused('SWA03', id) FROM agent.runs \
    WHERE thread_id = $1 AND state = 'awaiting_confirmation' LIMIT 1";
pub(super) const SQL_RECENT_SUMMARIES: &str = "SELECT thread_id, summary, turn_count, archived_at, external \
     FROM agent.session_archives WHERE owner = $1 ORDER BY archived_at DESC, id DESC LIMIT $2";

const SQL_ADMIT_RUN: &str = "WITH r AS (INSERT INTO agent.runs (id, thread_id, owner, request_id, state, channel, \
      last_event_seq, time_zone) VALUES ($1, $2, $3, $4, 'queued', $5, 1, $8) \
      ON CONFLICT (owner, request_id) WHERE request_id IS NOT NULL DO NOTHING RETURNING id), \
    e AS (INSERT INTO agent.run_events (run_id, seq, payload) SELECT id, 1, $6 FROM r), \
    m AS (INSERT INTO agent.messages (thread_id, run_id, source, kind, content) \
      SELECT $2, id, 'user', 'text', $7 FROM r WHERE $7::text IS NOT NULL) \
    SELECT CASE WHEN EXISTS (SELECT 1 FROM r) THEN 1 ELSE agent.admission_refused('SWA04', '') END";
