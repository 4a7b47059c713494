//! The PostgreSQL store. agent-svc owns the `agent` schema; its migrations live in
//! `agent-svc/migrations` and are embedded in the binary.

use std::time::{Duration, SystemTime};

use serde_json::Value;
use svc_kit::{pg, server_config::DatabaseConfig};
use tokio_postgres::Row;

use super::{
    Action, ActionState, Admission, Admitted, AgentStore, Approval, ApprovalState, Archive,
    Decided, Ending, Lease, LockOutcome, Message, MessageKind, MessageSource, ModelUsage,
    Occurrence, Run, RunCommit, RunNotice, RunState, RunUsage, Schedule, ScheduleKind,
    ScheduleOutcome, Settle, StoreError, Tally, TaskAgent, TaskSettle, Thread, ThreadCursor,
    TurnJson, UsageSummary, carries_external, transcript_text,
};

mod embedded {
    refinery::embed_migrations!("migrations");
}

mod admission;
mod admitter;
mod batch;
mod busy_owners;
mod commit;
mod committer;
mod group;
pub use svc_kit::group::BatchCounts;
mod notices;
mod storable;

// Lease expiry is set and compared with `clock_timestamp()`, not `now()`: `now()` is when the
// transaction began, and time an admission spent waiting (a locked row, a busy CPU) must not be
// taken off the lease its holder believes it has.

/// Advisory-lock key serialising agent-svc migrations across replicas ("agentsvc" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x6167_656e_7473_7663;

pub struct PgStore {
    pool: pg::PgPool,
    notices: tokio::sync::broadcast::Sender<RunNotice>,
    /// The notice connection: other replicas' notices in, this one's out (after each commit).
    notices_out: notices::Outgoing,
    /// Writes runs' commits, many per statement when they wait (group commit).
    committer: committer::Committer,
    /// Admits runs on new threads, many per statement when they wait (group admission).
    admitter: admitter::Admitter,
    /// Stops the notice connection with the store.
    _listener: tokio_util::sync::DropGuard,
}

impl PgStore {
    /// Applies pending migrations of the `agent` schema and returns (the `migrate` subcommand,
    /// for a Kubernetes Job; start-up does the same first).
    pub async fn migrate(url: &str) -> Result<(), StoreError> {
        pg::migrate(url, Self::migrations(), MIGRATION_LOCK_KEY).await?;
        Ok(())
    }

    /// Applies the migrations up to `version` only: a test of a data migration starts from
    /// the schema and rows before it.
    #[doc(hidden)]
    pub async fn migrate_to(url: &str, version: i32) -> Result<(), StoreError> {
        let runner = Self::migrations().set_target(refinery::Target::Version(version));
        pg::migrate(url, runner, MIGRATION_LOCK_KEY).await?;
        Ok(())
    }

    fn migrations() -> refinery::Runner {
        let mut runner = embedded::migrations::runner();
        runner.set_migration_table_name("agent_schema_history");
        runner
    }

    /// Applies pending migrations, then opens the pool.
    pub async fn connect(config: &DatabaseConfig) -> Result<Self, StoreError> {
        Self::migrate(&config.url).await?;
        let pool = pg::pool(&config.url, &config.pool)?;
        pg::warn_if_pools_exceed_server(&pool, &config.pool).await;
        let (notices, _) = tokio::sync::broadcast::channel(1024);
        let stop = tokio_util::sync::CancellationToken::new();
        let notices_out = notices::start(config.url.clone(), notices.clone(), stop.clone());
        // A quarter of the pool commits: each committer holds one connection per statement,
        // however many runs it carries, and the rest stay free for admissions and reads.
        let committer = committer::Committer::start(pool.clone(), config.pool.max_connections / 4);
        // As many admit runs on new threads in a burst of them; the rest of the pool is left
        // for the runs' reads and for admissions on existing threads.
        let admitter = admitter::Admitter::start(pool.clone(), config.pool.max_connections / 4);
        Ok(Self {
            notices_out,
            committer,
            admitter,
            pool,
            notices,
            _listener: stop.drop_guard(),
        })
    }

    /// How the store has written runs' commits since it opened.
    pub fn commit_counts(&self) -> BatchCounts {
        self.committer.counts.read()
    }

    /// How the store has admitted runs on new threads since it opened.
    pub fn admission_counts(&self) -> BatchCounts {
        self.admitter.counts.read()
    }

    async fn client(&self) -> Result<pg::Pooled, StoreError> {
        pg::checkout(&self.pool, "agent")
            .await
            .map_err(StoreError::unavailable)
    }
}

/// A PostgreSQL error with the server's own words, classified: a row that must be new already
/// there, what the server refused for good, and the rest (no connection, a lock timeout, a
/// serialization failure, the server shutting down), which may clear by waiting.
pub(super) fn db(e: tokio_postgres::Error) -> StoreError {
    match e.as_db_error() {
        Some(d) if *d.code() == tokio_postgres::error::SqlState::UNIQUE_VIOLATION => {
            StoreError::Conflict(format!("{} ({})", d.message(), d.code().code()))
        }
        Some(d) if pg::refused_for_good(d.code()) => StoreError::Rejected(pg::server_message(d)),
        Some(d) => StoreError::Unavailable(pg::server_message(d)),
        // Not the server's words: the I/O cause says what broke ("connection reset").
        None => StoreError::Unavailable(pg::cause(&e)),
    }
}

const THREAD_COLUMNS: &str = "id, owner, title, created_at, updated_at, \
    CASE WHEN lock_expires_at > clock_timestamp() THEN lock_run_id END, last_run_id";

fn thread(r: &Row) -> Thread {
    Thread {
        id: r.get(0),
        owner: r.get(1),
        title: r.get(2),
        created_at: r.get(3),
        updated_at: r.get(4),
        active_run_id: r.get(5),
        last_run_id: r.get(6),
    }
}

fn source_key(s: MessageSource) -> &'static str {
    match s {
        MessageSource::User => "user",
        MessageSource::Agent => "agent",
        MessageSource::Error => "error",
    }
}

fn kind_key(k: MessageKind) -> &'static str {
    match k {
        MessageKind::Text => "text",
        MessageKind::Tool => "tool",
    }
}

fn message(r: &Row) -> Message {
    let source: &str = r.get(3);
    let kind: &str = r.get(4);
    Message {
        id: r.get(0),
        thread_id: r.get(1),
        run_id: r.get(2),
        source: match source {
            "user" => MessageSource::User,
            "error" => MessageSource::Error,
            _ => MessageSource::Agent,
        },
        kind: if kind == "tool" {
            MessageKind::Tool
        } else {
            MessageKind::Text
        },
        content: r.get(5),
        metadata: r.get(6),
        created_at: r.get(7),
    }
}

const RUN_COLUMNS: &str = "id, thread_id, owner, request_id, state, channel, model, usage, iterations, error, \
    failure_kind, summary, cancel_requested, last_event_seq, created_at, started_at, finished_at, prompt_sections, \
    system_prompt, cancel_reason, time_zone";

fn run(r: &Row) -> Result<Run, StoreError> {
    let usage: Value = r.get(7);
    Ok(Run {
        id: r.get(0),
        thread_id: r.get(1),
        owner: r.get(2),
        request_id: r.get(3),
        state: RunState::from_key(r.get(4))?,
        channel: r.get(5),
        model: r.get(6),
        usage: serde_json::from_value::<RunUsage>(usage).unwrap_or_default(),
        iterations: r.get::<_, i32>(8) as u32,
        error: r.get(9),
        failure_kind: r.get(10),
        summary: r.get(11),
        cancel_requested: r.get(12),
        last_event_seq: r.get::<_, i64>(13) as u64,
        created_at: r.get(14),
        started_at: r.get(15),
        finished_at: r.get(16),
        prompt_sections: serde_json::from_value(r.get(17)).unwrap_or_default(),
        system_prompt: r.get(18),
        cancel_reason: r.get(19),
        time_zone: r.get(20),
    })
}

fn lease_until(lease: Duration) -> SystemTime {
    SystemTime::now() + lease
}

fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

#[async_trait::async_trait]
impl AgentStore for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        pg::report(&self.pool, "agent");
        Ok(pg::ping(&self.pool).await?)
    }

    async fn create_thread(
        &self,
        id: &str,
        owner: &str,
        title: &str,
    ) -> Result<Thread, StoreError> {
        let row = self
            .client()
            .await?
            .query_one(
                &format!("INSERT INTO agent.threads (id, owner, title) VALUES ($1, $2, $3) RETURNING {THREAD_COLUMNS}"),
                &[&id, &owner, &title],
            )
            .await
            .map_err(db)?;
        Ok(thread(&row))
    }

    async fn get_thread(&self, owner: &str, id: &str) -> Result<Option<Thread>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!("SELECT {THREAD_COLUMNS} FROM agent.threads WHERE id = $1 AND owner = $2"),
                &[&id, &owner],
            )
            .await
            .map_err(db)?;
        Ok(row.as_ref().map(thread))
    }

    async fn list_threads(
        &self,
        owner: &str,
        after: Option<&ThreadCursor>,
        limit: usize,
    ) -> Result<Vec<Thread>, StoreError> {
        let (at, id) = (after.map(|c| c.updated_at), after.map(|c| c.id.as_str()));
        let rows = self
            .client()
            .await?
            .query(
                &format!(
                    "SELECT {THREAD_COLUMNS} FROM agent.threads WHERE owner = $1 \
                       AND ($2::timestamptz IS NULL OR updated_at < $2 OR (updated_at = $2 AND id > $3)) \
                     ORDER BY updated_at DESC, id LIMIT $4"
                ),
                &[&owner, &at, &id, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(thread).collect())
    }

    async fn latest_thread_except(
        &self,
        owner: &str,
        skip_prefixes: &[&str],
    ) -> Result<Option<Thread>, StoreError> {
        // Walks `threads_owner_updated` newest first and stops at the first match.
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "SELECT {THREAD_COLUMNS} FROM agent.threads WHERE owner = $1 \
                       AND NOT EXISTS (SELECT 1 FROM unnest($2::text[]) p WHERE starts_with(id, p)) \
                     ORDER BY updated_at DESC, id LIMIT 1"
                ),
                &[&owner, &skip_prefixes],
            )
            .await
            .map_err(db)?;
        Ok(row.as_ref().map(thread))
    }

    async fn admit(&self, a: &Admission) -> Result<Admitted, StoreError> {
        let a = &*storable::admission(a);
        if a.new_thread_title.is_some() {
            return self.admitter.admit(a.clone()).await;
        }
        // A run on an existing thread is admitted at once unless its owner's admission lock is
        // held elsewhere; then it waits in the owner's queue, as a new thread's run does,
        // rather than hold a connection of its own while it waits.
        if !self.admitter.owner_is_waiting(&a.run.owner) {
            let client = self.client().await?;
            // Asked again: the owner's runs may have been queued while this one waited for a
            // connection, and it must not overtake them.
            if !self.admitter.owner_is_waiting(&a.run.owner)
                && let Some(answer) = admission::one_unless_owner_busy(&client, a).await
            {
                return answer;
            }
        }
        self.admitter.wait_for_owner(a.clone()).await
    }

    async fn lock_thread(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<LockOutcome, StoreError> {
        // One statement: row-level locking makes concurrent callers on any replica see one
        // winner; the expiry is the database's clock, never a replica's.
        let client = self.client().await?;
        let taken = Lease::new(thread_id, run_id);
        let row = client
            .query_opt(
                &client
                    .prepare_cached(
                        "UPDATE agent.threads SET lock_run_id = $2, lock_token = $3, \
                           lock_expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond', last_run_id = $2 \
                         WHERE id = $1 AND (lock_run_id IS NULL OR lock_expires_at <= clock_timestamp()) RETURNING id",
                    )
                    .await
                    .map_err(db)?,
                &[&thread_id, &run_id, &taken.token, &millis(lease)],
            )
            .await
            .map_err(db)?;
        if row.is_some() {
            return Ok(LockOutcome::Acquired(taken));
        }
        let holder = client
            .query_opt(
                "SELECT CASE WHEN lock_expires_at > clock_timestamp() THEN lock_run_id END FROM agent.threads WHERE id = $1",
                &[&thread_id],
            )
            .await
            .map_err(db)?
            .ok_or_else(|| StoreError::NotFound(format!("thread {thread_id}")))?;
        Ok(LockOutcome::Busy {
            run_id: holder.get::<_, Option<String>>(0).unwrap_or_default(),
        })
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Option<bool>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                &client
                    .prepare_cached(
                        "UPDATE agent.threads t SET lock_expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond' \
                         WHERE t.id = $1 AND t.lock_token = $2 AND t.lock_expires_at > clock_timestamp() \
                         RETURNING (SELECT cancel_requested FROM agent.runs r WHERE r.id = t.lock_run_id)",
                    )
                    .await
                    .map_err(db)?,
                &[&lease.thread_id, &lease.token, &millis(ttl)],
            )
            .await
            .map_err(db)?;
        Ok(row.map(|r| r.get::<_, Option<bool>>(0).unwrap_or(false)))
    }

    async fn release_lease(&self, lease: &Lease) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(
                &client
                    .prepare_cached(
                        "UPDATE agent.threads SET lock_run_id = NULL, lock_token = NULL, lock_expires_at = NULL \
                         WHERE id = $1 AND lock_token = $2",
                    )
                    .await
                    .map_err(db)?,
                &[&lease.thread_id, &lease.token],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn commit(&self, lease: &Lease, mut c: RunCommit) -> Result<(), StoreError> {
        storable::commit(&mut c);
        let announce = !c.events.is_empty();
        self.committer.commit(lease, c).await?;
        if announce {
            self.notices_out.events(&lease.run_id);
        }
        Ok(())
    }

    async fn decide(
        &self,
        lease: &Lease,
        approval_id: &str,
        wanted: ApprovalState,
        decider: &str,
        audit_kind: &str,
        max_active_runs: u32,
    ) -> Result<Decided, StoreError> {
        let decide = |lock| {
            self.decide_under(
                lease,
                approval_id,
                wanted,
                decider,
                audit_kind,
                max_active_runs,
                lock,
            )
        };
        // The owner's lock is tried first, in the same round trips. Held elsewhere (another
        // replica admitting the owner, a stalled transaction), the decision waits for it as a
        // run set apart does, and is counted and shown waiting the same way (R-4, O-2).
        if let Some(decided) = decide(admission::SQL_TRY_LOCK_RUN_OWNER).await? {
            return Ok(decided);
        }
        crate::metrics::admission_set_apart();
        let _shown = WaitingForOwner::shown();
        // Waiting for the lock is never refused as busy; a lock timeout is the database's error.
        decide(admission::SQL_LOCK_RUN_OWNER).await?.ok_or_else(|| {
            StoreError::Unavailable(format!(
                "the admission lock of run {}'s owner stayed busy",
                lease.run_id
            ))
        })
    }

    async fn end_paused(&self, run_id: &str, e: &Ending) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let ended = end_runs(
            &***client,
            "id = $1 AND state = 'awaiting_confirmation'",
            "",
            run_id,
            e,
        )
        .await?;
        Ok(ended > 0)
    }

    async fn abandoned_runs(&self, grace: Duration, limit: usize) -> Result<Vec<Run>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                &format!(
                    "SELECT {RUN_COLUMNS} FROM agent.runs r WHERE state IN ('queued', 'planning', 'executing') \
                     AND NOT EXISTS (SELECT 1 FROM agent.threads t WHERE t.id = r.thread_id AND t.lock_run_id = r.id \
                       AND t.lock_expires_at + $2::bigint * interval '1 millisecond' > clock_timestamp()) \
                     ORDER BY created_at LIMIT $1"
                ),
                &[&(limit as i64), &millis(grace)],
            )
            .await
            .map_err(db)?;
        rows.iter().map(run).collect()
    }

    async fn end_abandoned(&self, run_id: &str, e: &Ending) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        // The thread row lock orders this against the writer's fenced commits.
        let live = tx
            .query_opt(
                "SELECT t.lock_run_id = r.id AND t.lock_expires_at > clock_timestamp() FROM agent.runs r \
                 JOIN agent.threads t ON t.id = r.thread_id WHERE r.id = $1 FOR UPDATE OF t",
                &[&run_id],
            )
            .await
            .map_err(db)?;
        let Some(live) = live else {
            return Ok(false);
        };
        if live.get::<_, Option<bool>>(0).unwrap_or(false) {
            return Ok(false);
        }
        // Only as the ending was chosen: a cancel that landed since the monitor read the run
        // leaves it for the next sweep, which ends it cancelled.
        let ended = end_runs(
            &*tx,
            "id = $1 AND state IN ('queued', 'planning', 'executing') AND cancel_requested = ($2 = 'cancelled')",
            ", freed AS (UPDATE agent.threads SET lock_run_id = NULL, lock_token = NULL, lock_expires_at = NULL \
               WHERE id IN (SELECT thread_id FROM ended) AND lock_run_id = $1)",
            run_id,
            e,
        )
        .await?;
        tx.commit().await.map_err(db)?;
        Ok(ended > 0)
    }

    async fn archive_history(
        &self,
        thread_id: &str,
        owner: &str,
        summary: &str,
        e: &Ending,
        holder: Option<&Lease>,
        idle_before: Option<SystemTime>,
    ) -> Result<Option<Archive>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        // The thread row lock makes concurrent archivers take turns (the loser finds no
        // history), and a thread another run holds, or one updated since it was found idle,
        // is not archived under it.
        let held = tx
            .query_opt(
                "SELECT (lock_expires_at > clock_timestamp() AND lock_token IS DISTINCT FROM $2) \
                   OR updated_at >= $3 FROM agent.threads WHERE id = $1 FOR UPDATE",
                &[&thread_id, &holder.map(|l| l.token.as_str()), &idle_before],
            )
            .await
            .map_err(db)?;
        if held.is_none_or(|r| r.get::<_, Option<bool>>(0).unwrap_or(false)) {
            return Ok(None);
        }
        let rows = tx
            .query(
                "DELETE FROM agent.llm_history WHERE thread_id = $1 RETURNING seq, turn",
                &[&thread_id],
            )
            .await
            .map_err(db)?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut turns: Vec<(i64, Value)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        turns.sort_by_key(|(seq, _)| *seq);
        let turns: Vec<Value> = turns.into_iter().map(|(_, t)| t).collect();
        // Others' words the transcript does not show (an attached item, a memory, an earlier
        // summary in a run's prompt) count too: the session's runs marked the thread. The
        // mark ends with the session.
        let marked: bool = tx
            .query_one(
                "UPDATE agent.threads t SET read_external = false FROM agent.threads old \
                 WHERE t.id = $1 AND old.id = t.id RETURNING old.read_external",
                &[&thread_id],
            )
            .await
            .map_err(db)?
            .get(0);
        let external = carries_external(&turns) || marked;
        // Paused runs of the session end with it; their approvals can no longer be used.
        end_runs(
            &*tx,
            "thread_id = $1 AND state = 'awaiting_confirmation'",
            "",
            thread_id,
            e,
        )
        .await?;
        tx.execute(
            "UPDATE agent.approvals SET state = 'expired' WHERE thread_id = $1 AND state = 'pending'",
            &[&thread_id],
        )
        .await
        .map_err(db)?;
        let row = tx
            .query_one(
                "INSERT INTO agent.session_archives (thread_id, owner, summary, transcript, transcript_text, turn_count, external) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING archived_at",
                &[&thread_id, &owner, &summary, &Value::Array(turns.clone()), &transcript_text(&turns), &(turns.len() as i32), &external],
            )
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(Some(Archive {
            thread_id: thread_id.to_owned(),
            summary: summary.to_owned(),
            turn_count: turns.len() as u32,
            archived_at: row.get(0),
            external,
        }))
    }

    async fn enqueue_task_agent(
        &self,
        t: &TaskAgent,
        max_queued: u32,
        fence: Option<&Lease>,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let lock = client
            .prepare_cached("SELECT pg_advisory_xact_lock(hashtext('task_agents:' || $1))")
            .await
            .map_err(db)?;
        // The thread row held (shared) to the commit: a takeover's lock of the thread waits
        // for this insert, and one that came first makes it fail. After the owner's lock, as
        // an admission takes them, so the two never wait on each other in a circle.
        let fenced = client
            .prepare_cached(
                "SELECT CASE WHEN $2::text IS NULL OR EXISTS (SELECT 1 FROM agent.threads \
                   WHERE id = $1 AND lock_token = $2 AND lock_expires_at > clock_timestamp() FOR SHARE) \
                 THEN 1 ELSE agent.lease_lost() END",
            )
            .await
            .map_err(db)?;
        let insert = client
            .prepare_cached(
                "INSERT INTO agent.task_agents (id, owner, parent_thread_id, instructions, goal, state, time_zone) \
                 SELECT $1, $2, $3, $4, $5, 'queued', $7 WHERE (SELECT count(*) FROM agent.task_agents \
                   WHERE owner = $2 AND state IN ('queued', 'running')) < $6",
            )
            .await
            .map_err(db)?;
        let t_client: &tokio_postgres::Client = &client;
        // Two enqueues of one owner (on any replica) must not both pass the cap: the count is
        // taken after the owner's lock, in a snapshot of its own, so it sees the other's task
        // . One pipeline, as an admission is; a failed statement makes COMMIT roll back.
        let mut open = pg::Begun::new(t_client);
        let (fence_thread, fence_token) = fence.map_or((None, None), |l| {
            (Some(l.thread_id.as_str()), Some(l.token.as_str()))
        });
        let (begun, locked, held, inserted, committed) = futures_util::future::join5(
            t_client.batch_execute(admission::BEGIN),
            t_client.execute(&lock, &[&t.owner]),
            t_client.execute(&fenced, &[&fence_thread, &fence_token]),
            t_client.execute(
                &insert,
                &[
                    &t.id,
                    &t.owner,
                    &t.parent_thread_id,
                    // The model's words: a NUL in them must not fail the enqueue.
                    &storable::str_cow(&t.instructions),
                    &storable::str_cow(&t.goal),
                    &i64::from(max_queued),
                    &t.time_zone,
                ],
            ),
            t_client.batch_execute("COMMIT"),
        )
        .await;
        open.committed();
        begun.map_err(db)?;
        locked.map_err(db)?;
        match held {
            Err(e) if e.code().map(|c| c.code()) == Some(LEASE_LOST) => {
                return Err(StoreError::LeaseLost);
            }
            held => held.map_err(db)?,
        };
        let n = inserted.map_err(db)?;
        committed.map_err(db)?;
        Ok(n == 1)
    }

    fn notices(&self) -> Option<tokio::sync::broadcast::Receiver<RunNotice>> {
        Some(self.notices.subscribe())
    }

    async fn add_message(
        &self,
        thread_id: &str,
        run_id: Option<&str>,
        source: MessageSource,
        kind: MessageKind,
        content: &str,
        metadata: Value,
    ) -> Result<Message, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one(
                "INSERT INTO agent.messages (thread_id, run_id, source, kind, content, metadata) VALUES ($1, $2, $3, $4, $5, $6) \
                 RETURNING id, thread_id, run_id, source, kind, content, metadata, created_at",
                &[&thread_id, &run_id, &source_key(source), &kind_key(kind), &content, &metadata],
            )
            .await
            .map_err(db)?;
        client
            .execute(
                "UPDATE agent.threads SET updated_at = now() WHERE id = $1",
                &[&thread_id],
            )
            .await
            .map_err(db)?;
        Ok(message(&row))
    }

    async fn list_messages(
        &self,
        thread_id: &str,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT id, thread_id, run_id, source, kind, content, metadata, created_at FROM agent.messages \
                 WHERE thread_id = $1 ORDER BY id OFFSET $2 LIMIT $3",
                &[&thread_id, &(offset as i64), &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(message).collect())
    }

    async fn history(&self, thread_id: &str) -> Result<Vec<TurnJson>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT turn::text FROM agent.llm_history WHERE thread_id = $1 ORDER BY seq",
                &[&thread_id],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(|r| r.get::<_, TurnJson>(0)).collect())
    }

    async fn get_run(&self, owner: &str, run_id: &str) -> Result<Option<Run>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!("SELECT {RUN_COLUMNS} FROM agent.runs WHERE id = $1 AND owner = $2"),
                &[&run_id, &owner],
            )
            .await
            .map_err(db)?;
        row.as_ref().map(run).transpose()
    }

    async fn find_run_by_request(
        &self,
        owner: &str,
        request_id: &str,
    ) -> Result<Option<Run>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "SELECT {RUN_COLUMNS} FROM agent.runs WHERE owner = $1 AND request_id = $2"
                ),
                &[&owner, &request_id],
            )
            .await
            .map_err(db)?;
        row.as_ref().map(run).transpose()
    }

    async fn request_cancel(&self, run_id: &str, reason: Option<&str>) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .query(
                "WITH u AS (UPDATE agent.runs SET cancel_requested = true, \
                   cancel_reason = coalesce(cancel_reason, $2) WHERE id = $1 \
                   AND state IN ('queued', 'planning', 'executing') RETURNING id) \
                 SELECT pg_notify('agent_runs', 'c:' || id) FROM u",
                &[&run_id, &reason],
            )
            .await
            .map_err(db)?;
        Ok(n.len() == 1)
    }

    async fn prune_run_events(
        &self,
        ended_before: SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError> {
        // One statement: the runs due, oldest first, by the partial index (rows another
        // replica's sweep holds are skipped, not waited for); their events below the last
        // stored one deleted — the stored last, not `last_event_seq`, so the result is kept
        // whatever the row says —; and the runs marked, so none is read again.
        let row = self
            .client()
            .await?
            .query_one(
                "WITH due AS ( \
                   SELECT id FROM agent.runs \
                    WHERE finished_at IS NOT NULL AND NOT events_pruned AND finished_at < $1 \
                      AND state IN ('completed', 'failed', 'cancelled') \
                    ORDER BY finished_at LIMIT $2 FOR NO KEY UPDATE SKIP LOCKED), \
                 gone AS ( \
                   DELETE FROM agent.run_events e USING due \
                    WHERE e.run_id = due.id \
                      AND e.seq < (SELECT max(m.seq) FROM agent.run_events m WHERE m.run_id = due.id)), \
                 marked AS ( \
                   UPDATE agent.runs r SET events_pruned = true FROM due WHERE r.id = due.id RETURNING 1) \
                 SELECT count(*)::bigint FROM marked",
                &[&ended_before, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(row.get::<_, i64>(0) as usize)
    }

    async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT seq, payload FROM agent.run_events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
            )
            .await
            .map_err(db)?;
        let rows = client
            .query(&statement, &[&run_id, &(after as i64), &(limit as i64)])
            .await
            .map_err(db)?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, i64>(0) as u64, r.get(1)))
            .collect())
    }

    async fn recent_summaries(
        &self,
        owner: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                &client
                    .prepare_cached(admission::SQL_RECENT_SUMMARIES)
                    .await
                    .map_err(db)?,
                &[&owner, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(archive).collect())
    }

    async fn search_archives(
        &self,
        owner: &str,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT thread_id, summary, turn_count, archived_at, external FROM agent.session_archives, websearch_to_tsquery('english', $2) q \
                 WHERE owner = $1 AND tsv @@ q ORDER BY ts_rank_cd(tsv, q) DESC, archived_at DESC LIMIT $3",
                &[&owner, &query, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(archive).collect())
    }

    async fn claim_archive(&self, thread_id: &str, hold: Duration) -> Result<bool, StoreError> {
        let claimed = self
            .client()
            .await?
            .execute(
                "UPDATE agent.threads SET archive_claimed_until = \
                   clock_timestamp() + $2::bigint * interval '1 millisecond' \
                 WHERE id = $1 AND (archive_claimed_until IS NULL \
                   OR archive_claimed_until <= clock_timestamp())",
                &[&thread_id, &(hold.as_millis() as i64)],
            )
            .await
            .map_err(db)?;
        Ok(claimed == 1)
    }

    async fn idle_threads_with_history(
        &self,
        before: SystemTime,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT t.id, t.owner FROM agent.threads t WHERE t.updated_at < $1 \
                 AND EXISTS (SELECT 1 FROM agent.llm_history h WHERE h.thread_id = t.id) LIMIT 200",
                &[&before],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn claim_task_agent(
        &self,
        worker: &str,
        lease: Duration,
        max_attempts: u32,
    ) -> Result<Option<TaskAgent>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "UPDATE agent.task_agents SET state = 'running', claimed_by = $1, claimed_until = $2, attempts = attempts + 1, \
                       updated_at = now() \
                     WHERE id = (SELECT id FROM agent.task_agents \
                                 WHERE (state = 'queued' AND next_attempt_at <= now()) \
                                    OR (state = 'running' AND claimed_until < now() AND attempts - restarts < $3) \
                                 ORDER BY next_attempt_at LIMIT 1 FOR UPDATE SKIP LOCKED) \
                     RETURNING {TASK_COLUMNS}"
                ),
                &[&worker, &lease_until(lease), &(max_attempts as i32)],
            )
            .await
            .map_err(db)?;
        Ok(row.as_ref().map(task_agent))
    }

    async fn fail_lapsed_task_agents(
        &self,
        max_attempts: u32,
        reason: &str,
    ) -> Result<usize, StoreError> {
        let failed = self
            .client()
            .await?
            .query_one(
                "WITH failed AS (UPDATE agent.task_agents SET state = 'failed', last_error = $2, \
                   claimed_by = NULL, claimed_until = NULL, updated_at = now() \
                   WHERE state = 'running' AND claimed_until < now() AND attempts - restarts >= $1 \
                   RETURNING id, parent_thread_id, goal), \
                 posted AS (INSERT INTO agent.messages (thread_id, source, kind, content, metadata) \
                   SELECT parent_thread_id, 'error', 'text', 'Task agent could not finish (' || goal || '): ' || $2, \
                     jsonb_build_object('task_agent_id', id) FROM failed RETURNING thread_id), \
                 touched AS (UPDATE agent.threads SET updated_at = now() WHERE id IN (SELECT thread_id FROM posted)) \
                 SELECT count(*) FROM failed",
                &[&(max_attempts as i32), &reason],
            )
            .await
            .map_err(db)?;
        Ok(failed.get::<_, i64>(0) as usize)
    }

    async fn release_task_claims(&self, worker: &str) -> Result<usize, StoreError> {
        let released = self
            .client()
            .await?
            .execute(
                "UPDATE agent.task_agents SET claimed_until = now() - interval '1 millisecond', \
                   attempts = attempts - 1, updated_at = now() \
                 WHERE state = 'running' AND claimed_by = $1",
                &[&worker],
            )
            .await
            .map_err(db)?;
        Ok(released as usize)
    }

    async fn create_schedule(
        &self,
        sch: &Schedule,
        max_per_owner: u32,
        thread_title: Option<&str>,
    ) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        // Two creates of one owner must not both pass the cap.
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext('schedules:' || $1))",
            &[&sch.owner],
        )
        .await
        .map_err(db)?;
        let n: i64 = tx
            .query_one(
                "SELECT count(*) FROM agent.schedules WHERE owner = $1",
                &[&sch.owner],
            )
            .await
            .map_err(db)?
            .get(0);
        if n >= i64::from(max_per_owner) {
            return Ok(false);
        }
        if let Some(title) = thread_title {
            tx.execute(
                "INSERT INTO agent.threads (id, owner, title) VALUES ($1, $2, $3)",
                &[&sch.thread_id, &sch.owner, &title],
            )
            .await
            .map_err(db)?;
        }
        tx.execute(
            "INSERT INTO agent.schedules (id, owner, kind, prompt, cron, every_secs, time_zone, enabled, thread_id, \
               next_due_at, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11)",
            &[
                &sch.id,
                &sch.owner,
                &sch.kind.key(),
                &sch.prompt,
                &sch.cron,
                &sch.every.map(|d| d.as_secs() as i64),
                &sch.time_zone,
                &sch.enabled,
                &sch.thread_id,
                &sch.next_due_at,
                &sch.created_at,
            ],
        )
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(true)
    }

    async fn get_schedule(&self, owner: &str, id: &str) -> Result<Option<Schedule>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "SELECT {SCHEDULE_COLUMNS} FROM agent.schedules WHERE id = $1 AND owner = $2"
                ),
                &[&id, &owner],
            )
            .await
            .map_err(db)?;
        row.as_ref().map(schedule).transpose()
    }

    async fn list_schedules(&self, owner: &str) -> Result<Vec<Schedule>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                &format!(
                    "SELECT {SCHEDULE_COLUMNS} FROM agent.schedules WHERE owner = $1 ORDER BY created_at, id"
                ),
                &[&owner],
            )
            .await
            .map_err(db)?;
        rows.iter().map(schedule).collect()
    }

    async fn save_schedule(&self, sch: &Schedule, reschedule: bool) -> Result<bool, StoreError> {
        // An occurrence is dropped with its schedule unless it is held or its run is going
        // (held by none for a moment: its follower was handed back, or lost the store).
        let n = self
            .client()
            .await?
            .execute(
                "WITH waiting AS (SELECT NOT $7 AND holder IS NULL \
                   AND last_outcome IS DISTINCT FROM 'running' AS drop FROM agent.schedules WHERE id = $1) \
                 UPDATE agent.schedules SET prompt = $3, cron = $4, every_secs = $5, time_zone = $6, enabled = $7, \
                   next_due_at = CASE WHEN $9 THEN $8 ELSE next_due_at END, \
                   occurrence_at = CASE WHEN waiting.drop THEN NULL ELSE occurrence_at END, \
                   attempts = CASE WHEN waiting.drop THEN 0 ELSE attempts END, \
                   restarts = CASE WHEN waiting.drop THEN 0 ELSE restarts END, \
                   held_until = CASE WHEN waiting.drop THEN NULL ELSE held_until END, \
                   updated_at = now() FROM waiting WHERE id = $1 AND owner = $2 AND updated_at = $10",
                &[
                    &sch.id,
                    &sch.owner,
                    &sch.prompt,
                    &sch.cron,
                    &sch.every.map(|d| d.as_secs() as i64),
                    &sch.time_zone,
                    &sch.enabled,
                    &sch.next_due_at,
                    &reschedule,
                    &sch.updated_at,
                ],
            )
            .await
            .map_err(db)?;
        Ok(n == 1)
    }

    async fn delete_schedule(&self, owner: &str, id: &str) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "DELETE FROM agent.schedules WHERE id = $1 AND owner = $2",
                &[&id, &owner],
            )
            .await
            .map_err(db)?;
        Ok(n == 1)
    }

    async fn claim_schedule(
        &self,
        worker: &str,
        now: SystemTime,
        hold: Duration,
    ) -> Result<Option<Occurrence>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        let Some(row) = tx
            .query_opt(
                &format!(
                    "SELECT {SCHEDULE_COLUMNS} FROM agent.schedules WHERE \
                       (enabled AND occurrence_at IS NULL AND next_due_at <= $1) \
                        OR (occurrence_at IS NOT NULL AND held_until <= $1) \
                     LIMIT 1 FOR UPDATE SKIP LOCKED"
                ),
                &[&now],
            )
            .await
            .map_err(db)?
        else {
            return Ok(None);
        };
        let mut sch = schedule(&row)?;
        let due_at = match sch.occurrence_at {
            Some(due) => due,
            None => {
                let following = match sch.following_due(now) {
                    Ok(t) => t,
                    Err(e) => {
                        // An unreadable schedule is switched off with the reason, so it cannot
                        // block the queue; the owner sees why in ListSchedules.
                        tx.execute(
                            "UPDATE agent.schedules SET enabled = false, last_outcome = 'failed', last_error = $2, \
                               updated_at = now() WHERE id = $1",
                            &[&sch.id, &e.to_string()],
                        )
                        .await
                        .map_err(db)?;
                        tx.commit().await.map_err(db)?;
                        return Err(e);
                    }
                };
                let due = sch.next_due_at;
                sch.next_due_at = following;
                sch.occurrence_at = Some(due);
                sch.attempts = 1;
                sch.restarts = 0;
                sch.last_outcome = Some(ScheduleOutcome::Running);
                sch.last_fired_at = Some(now);
                due
            }
        };
        hold_occurrence(&tx, &sch, worker, now + hold).await?;
        tx.commit().await.map_err(db)?;
        Ok(Some(Occurrence {
            attempt: sch.attempts,
            schedule: sch,
            due_at,
        }))
    }

    async fn claim_schedule_now(
        &self,
        owner: &str,
        id: &str,
        worker: &str,
        now: SystemTime,
        hold: Duration,
    ) -> Result<Option<Occurrence>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        let Some(row) = tx
            .query_opt(
                &format!(
                    "SELECT {SCHEDULE_COLUMNS} FROM agent.schedules WHERE id = $1 AND owner = $2 FOR UPDATE"
                ),
                &[&id, &owner],
            )
            .await
            .map_err(db)?
        else {
            return Ok(None);
        };
        let mut sch = schedule(&row)?;
        if sch.occurrence_at.is_some() {
            return Err(StoreError::Conflict(format!(
                "an occurrence of schedule {id} (run {})",
                sch.last_run_id.as_deref().unwrap_or("not started yet")
            )));
        }
        sch.occurrence_at = Some(now);
        sch.attempts = 1;
        sch.restarts = 0;
        sch.last_outcome = Some(ScheduleOutcome::Running);
        sch.last_fired_at = Some(now);
        hold_occurrence(&tx, &sch, worker, now + hold).await?;
        tx.commit().await.map_err(db)?;
        Ok(Some(Occurrence {
            attempt: 1,
            schedule: sch,
            due_at: now,
        }))
    }

    async fn release_schedule_holds(&self, worker: &str) -> Result<usize, StoreError> {
        // A holder is `worker/claim`; `worker` is a generated name, free of LIKE's wildcards.
        let released = self
            .client()
            .await?
            .execute(
                "UPDATE agent.schedules SET holder = NULL, held_until = 'epoch', updated_at = now() \
                 WHERE occurrence_at IS NOT NULL AND starts_with(holder, $1 || '/')",
                &[&worker],
            )
            .await
            .map_err(db)?;
        Ok(released as usize)
    }

    async fn settle_schedule(
        &self,
        occurrence: &Occurrence,
        worker: &str,
        settle: &Settle,
    ) -> Result<bool, StoreError> {
        // $1 id, $2 occurrence, $3 worker: only the holder of this very occurrence settles it.
        const HELD: &str = "WHERE id = $1 AND occurrence_at = $2 AND holder = $3";
        let client = self.client().await?;
        let key = (&occurrence.schedule.id, &occurrence.due_at, &worker);
        let n = match settle {
            Settle::Running { run_id, until } => {
                client
                    .execute(
                        &format!(
                            "UPDATE agent.schedules SET last_run_id = $4, last_outcome = 'running', last_error = NULL, \
                               held_until = $5, updated_at = now() {HELD}"
                        ),
                        &[key.0, key.1, key.2, run_id, until],
                    )
                    .await
            }
            Settle::Again { outcome, tally, run_id, error, at } => {
                let (attempt, restart) = (
                    i32::from(*tally != Tally::NotAnAttempt),
                    i32::from(*tally == Tally::Restart),
                );
                client
                    .execute(
                        &format!(
                            "UPDATE agent.schedules SET attempts = attempts + $8, restarts = restarts + $9, \
                               last_outcome = $4, last_run_id = COALESCE($5, last_run_id), last_error = $6, \
                               holder = NULL, held_until = $7, updated_at = now() {HELD}"
                        ),
                        &[key.0, key.1, key.2, &outcome.key(), run_id, error, at, &attempt, &restart],
                    )
                    .await
            }
            Settle::Done { outcome, run_id, error } => {
                client
                    .execute(
                        &format!(
                            "UPDATE agent.schedules SET occurrence_at = NULL, attempts = 0, restarts = 0, last_outcome = $4, \
                               last_run_id = COALESCE($5, last_run_id), last_error = $6, holder = NULL, held_until = NULL, \
                               updated_at = now() {HELD}"
                        ),
                        &[key.0, key.1, key.2, &outcome.key(), run_id, error],
                    )
                    .await
            }
        }
        .map_err(db)?;
        Ok(n == 1)
    }

    async fn renew_task_claim(
        &self,
        task: &TaskAgent,
        worker: &str,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        let renewed = self
            .client()
            .await?
            .execute(
                "UPDATE agent.task_agents SET claimed_until = $4 \
                 WHERE id = $1 AND state = 'running' AND claimed_by = $2 AND attempts = $3",
                &[
                    &task.id,
                    &worker,
                    &(task.attempts as i32),
                    &lease_until(hold),
                ],
            )
            .await
            .map_err(db)?;
        Ok(renewed == 1)
    }

    async fn settle_task_agent(
        &self,
        task: &TaskAgent,
        worker: &str,
        settle: &TaskSettle<'_>,
    ) -> Result<bool, StoreError> {
        let (source, report) = settle.report.map_or((None, None), |(source, text)| {
            (Some(source_key(source)), Some(storable::str_cow(text)))
        });
        // A NUL would fail this settle on every try, and the task would run again and again.
        let result = settle.result.map(storable::str_cow);
        let error = settle.error.map(storable::str_cow);
        let report = report.as_deref();
        // One statement: the settle, fenced by the claim, and the report only if it held.
        let settled = self
            .client()
            .await?
            .query_opt(
                "WITH settled AS (UPDATE agent.task_agents SET state = $2, result = COALESCE($3::text, result), \
                   last_error = $4::text, \
                   next_attempt_at = COALESCE($5::timestamptz, next_attempt_at), claimed_by = NULL, claimed_until = NULL, \
                   attempts = CASE WHEN $10 = 'not_an_attempt' THEN attempts - 1 ELSE $11 END, \
                   settled_attempt = CASE WHEN $10 = 'not_an_attempt' THEN settled_attempt ELSE $11 END, \
                   restarts = restarts + CASE WHEN $10 = 'restart' THEN 1 ELSE 0 END, updated_at = now() \
                   WHERE id = $1 AND state = 'running' AND claimed_by = $6 AND attempts = $7 \
                   RETURNING parent_thread_id), \
                 posted AS (INSERT INTO agent.messages (thread_id, source, kind, content, metadata) \
                   SELECT parent_thread_id, $8, 'text', $9, jsonb_build_object('task_agent_id', $1::text) \
                   FROM settled WHERE $9::text IS NOT NULL RETURNING thread_id), \
                 touched AS (UPDATE agent.threads SET updated_at = now() WHERE id IN (SELECT thread_id FROM posted)) \
                 SELECT 1 FROM settled",
                &[
                    &task.id,
                    &settle.state,
                    &result.as_deref(),
                    &error.as_deref(),
                    &settle.retry_at,
                    &worker,
                    &(task.attempts as i32),
                    &source,
                    &report,
                    &match settle.tally {
                        Tally::Try => "try",
                        Tally::NotAnAttempt => "not_an_attempt",
                        Tally::Restart => "restart",
                    },
                    &(settle.attempt as i32),
                ],
            )
            .await
            .map_err(db)?;
        Ok(settled.is_some())
    }

    async fn get_task_agent(&self, owner: &str, id: &str) -> Result<Option<TaskAgent>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "SELECT {TASK_COLUMNS} FROM agent.task_agents WHERE id = $1 AND owner = $2"
                ),
                &[&id, &owner],
            )
            .await
            .map_err(db)?;
        Ok(row.as_ref().map(task_agent))
    }

    async fn record_summary_spend(&self, owner: &str, spent: &RunUsage) -> Result<(), StoreError> {
        let usage = serde_json::to_value(spent).unwrap_or_default();
        self.client()
            .await?
            .execute(
                "INSERT INTO agent.summary_spend (owner, usage) VALUES ($1, $2)",
                &[&owner, &usage],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn usage(
        &self,
        owner: &str,
        since: SystemTime,
        until: SystemTime,
    ) -> Result<UsageSummary, StoreError> {
        // One statement, so the counts and the sums see the same rows: the empty grouping set
        // counts every run of the window, calls or none, and the session summaries; the others
        // sum each model's calls, the runs' and the summaries'.
        let rows = self
            .client()
            .await?
            .query(
                "WITH calls AS ( \
                   SELECT r.id AS run, c FROM agent.runs r \
                     LEFT JOIN LATERAL jsonb_array_elements(COALESCE(r.usage->'calls', '[]')) c ON true \
                   WHERE r.owner = $1 AND r.created_at >= $2 AND r.created_at < $3 \
                   UNION ALL \
                   SELECT NULL, c FROM agent.summary_spend s \
                     CROSS JOIN LATERAL jsonb_array_elements(COALESCE(s.usage->'calls', '[]')) c \
                   WHERE s.owner = $1 AND s.at >= $2 AND s.at < $3) \
                 SELECT GROUPING(c->>'provider') = 1, c->>'provider', c->>'model', \
                   count(DISTINCT run), count(c) FILTER (WHERE run IS NULL), count(c), \
                   COALESCE(sum((c->>'input_tokens')::bigint), 0)::bigint, \
                   COALESCE(sum((c->>'output_tokens')::bigint), 0)::bigint, \
                   COALESCE(sum((c->>'cached_tokens')::bigint), 0)::bigint, \
                   COALESCE(sum((c->>'cost_usd')::float8), 0) \
                 FROM calls GROUP BY GROUPING SETS ((c->>'provider', c->>'model'), ())",
                &[&owner, &since, &until],
            )
            .await
            .map_err(db)?;
        let (mut runs, mut summaries) = (0, 0);
        let mut calls = Vec::new();
        for row in &rows {
            if row.get::<_, bool>(0) {
                runs = row.get::<_, i64>(3) as u64;
                summaries = row.get::<_, i64>(4) as u64;
                continue;
            }
            // Runs with no call at all group under no model.
            let (Some(provider), Some(model)) = (
                row.get::<_, Option<String>>(1),
                row.get::<_, Option<String>>(2),
            ) else {
                continue;
            };
            calls.push(ModelUsage {
                provider,
                model,
                calls: row.get::<_, i64>(5) as u64,
                input_tokens: row.get::<_, i64>(6) as u64,
                output_tokens: row.get::<_, i64>(7) as u64,
                cached_tokens: row.get::<_, i64>(8) as u64,
                cost_usd: row.get(9),
            });
        }
        Ok(UsageSummary::of(runs, summaries, calls))
    }

    async fn list_actions(&self, run_id: &str) -> Result<Vec<Action>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(&format!(
                "SELECT {ACTION_COLUMNS} FROM agent.actions WHERE run_id = $1 ORDER BY ord"
            ))
            .await
            .map_err(db)?;
        let rows = client.query(&statement, &[&run_id]).await.map_err(db)?;
        rows.iter().map(action).collect()
    }

    async fn actions_for_calls(&self, call_ids: &[String]) -> Result<Vec<Action>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                &format!("SELECT {ACTION_COLUMNS} FROM agent.actions WHERE call_id = ANY($1) ORDER BY ord"),
                &[&call_ids],
            )
            .await
            .map_err(db)?;
        rows.iter().map(action).collect()
    }

    async fn count_pending_approvals(&self) -> Result<u64, StoreError> {
        let n: i64 = self
            .client()
            .await?
            .query_one(
                "SELECT count(*) FROM agent.approvals WHERE state = 'pending' AND expires_at > now()",
                &[],
            )
            .await
            .map_err(db)?
            .get(0);
        Ok(n.max(0) as u64)
    }

    async fn get_approval(&self, owner: &str, id: &str) -> Result<Option<Approval>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "SELECT {APPROVAL_COLUMNS} FROM agent.approvals WHERE id = $1 AND owner = $2"
                ),
                &[&id, &owner],
            )
            .await
            .map_err(db)?;
        row.as_ref().map(approval).transpose()
    }

    async fn record_audit(
        &self,
        owner: &str,
        kind: &str,
        run_id: Option<&str>,
        detail: Value,
    ) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "INSERT INTO agent.audit (owner, kind, run_id, detail) VALUES ($1, $2, $3, $4)",
                &[&owner, &kind, &run_id, &detail],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn audit(&self, owner: &str) -> Result<Vec<(String, Value)>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT kind, detail FROM agent.audit WHERE owner = $1 ORDER BY id",
                &[&owner],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }
}

/// A decision shown waiting for its owner's lock while this lives: answered, failed, or its
/// caller gone (the future dropped mid-wait), it is taken off the gauge.
struct WaitingForOwner;

impl WaitingForOwner {
    fn shown() -> Self {
        crate::metrics::admission_waiting_for_owner(1.0);
        WaitingForOwner
    }
}

impl Drop for WaitingForOwner {
    fn drop(&mut self) {
        crate::metrics::admission_waiting_for_owner(-1.0);
    }
}

impl PgStore {
    /// [`AgentStore::decide`] with the owner's lock taken by `lock` (`SQL_LOCK_RUN_OWNER` or
    /// `SQL_TRY_LOCK_RUN_OWNER`); `None` when the try found the lock held elsewhere.
    #[allow(clippy::too_many_arguments)]
    async fn decide_under(
        &self,
        lease: &Lease,
        approval_id: &str,
        wanted: ApprovalState,
        decider: &str,
        audit_kind: &str,
        max_active_runs: u32,
        lock: &'static str,
    ) -> Result<Option<Decided>, StoreError> {
        let mut client = self.client().await?;
        let lock = client.prepare_cached(lock).await.map_err(db)?;
        let fence = client.prepare_cached(SQL_DECIDE_FENCE).await.map_err(db)?;
        let count = client
            .prepare_cached(admission::SQL_LIVE_RUNS_OF_RUN)
            .await
            .map_err(db)?;
        let revive = client.prepare_cached(SQL_DECIDE_RUN).await.map_err(db)?;
        let record = client
            .prepare_cached(&SQL_DECIDE_APPROVAL)
            .await
            .map_err(db)?;
        // READ COMMITTED, as an admission: the count after the owner's lock must see every
        // run admitted or revived before it.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(db)?;
        // One pipeline, so the owner's lock is held for as few round trips as an admission
        // holds it. Locks in the order admissions take them (the owner, then the thread's
        // row) and ending a paused run takes them (its run row, then its approval).
        let (owner, fenced, active, revived, recorded) = futures_util::future::join5(
            tx.query_opt(&lock, &[&lease.run_id]),
            tx.query_opt(&fence, &[&lease.thread_id, &lease.token]),
            // Counted before this run is revived, so it is not among them.
            tx.query_one(&count, &[&lease.run_id]),
            tx.query_opt(&revive, &[&lease.run_id]),
            tx.query_opt(
                &record,
                &[&approval_id, &wanted.key(), &decider, &lease.run_id],
            ),
        )
        .await;
        if owner
            .as_ref()
            .err()
            .is_some_and(|e| admission::owners_busy(e).is_some())
        {
            return Ok(None);
        }
        let (owner, fenced) = (owner.map_err(db)?, fenced.map_err(db)?);
        if owner.is_none() || fenced.is_none() {
            return Err(StoreError::LeaseLost);
        }
        let active = active.map_err(db)?.get::<_, i64>(0);
        let (Some(run_row), Some(approval_row)) = (revived.map_err(db)?, recorded.map_err(db)?)
        else {
            drop(tx);
            let approval_row = client
                .query_one(
                    &format!("SELECT {APPROVAL_COLUMNS} FROM agent.approvals WHERE id = $1"),
                    &[&approval_id],
                )
                .await
                .map_err(db)?;
            let state: String = client
                .query_one(
                    "SELECT state FROM agent.runs WHERE id = $1",
                    &[&lease.run_id],
                )
                .await
                .map_err(db)?
                .get(0);
            return Ok(Some(Decided::Lost {
                approval: approval(&approval_row)?,
                run_state: RunState::from_key(&state)?,
            }));
        };
        if active >= i64::from(max_active_runs) {
            // Dropped: rolled back, the approval still pending and the run still paused.
            drop(tx);
            return Ok(Some(Decided::TooManyRuns {
                active: u32::try_from(active).unwrap_or(u32::MAX),
            }));
        }
        let approval = approval(&approval_row)?;
        tx.execute(
            "INSERT INTO agent.audit (owner, kind, run_id, detail) VALUES ($1, $2, $3, $4)",
            &[
                &approval.owner,
                &audit_kind,
                &approval.run_id,
                &serde_json::json!({"approval_id": approval.id, "tool": approval.tool}),
            ],
        )
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(Some(Decided::Won {
            approval,
            last_event_seq: run_row.get::<_, i64>(0) as u64,
        }))
    }
}

const APPROVAL_COLUMNS: &str = "id, run_id, thread_id, owner, call_id, tool, arguments, args_sha256, preview, reason, state, \
    created_at, expires_at, decided_by, decided_at, binding, tainted_by, allowed_tools";

fn approval(r: &Row) -> Result<Approval, StoreError> {
    Ok(Approval {
        id: r.get(0),
        run_id: r.get(1),
        thread_id: r.get(2),
        owner: r.get(3),
        call_id: r.get(4),
        tool: r.get(5),
        arguments: r.get(6),
        args_sha256: r.get(7),
        preview: r.get(8),
        reason: r.get(9),
        state: ApprovalState::from_key(r.get(10))?,
        created_at: r.get(11),
        expires_at: r.get(12),
        decided_by: r.get(13),
        decided_at: r.get(14),
        binding: r.get(15),
        tainted_by: r.get(16),
        allowed_tools: r.get(17),
    })
}

fn archive(r: &Row) -> Archive {
    Archive {
        thread_id: r.get(0),
        summary: r.get(1),
        turn_count: r.get::<_, i32>(2) as u32,
        archived_at: r.get(3),
        external: r.get(4),
    }
}

const TASK_COLUMNS: &str = "id, owner, parent_thread_id, instructions, goal, state, attempts, last_error, result, \
    created_at, settled_attempt, time_zone, restarts";

const SCHEDULE_COLUMNS: &str = "id, owner, kind, prompt, cron, every_secs, time_zone, enabled, thread_id, \
    next_due_at, last_outcome, last_run_id, last_error, last_fired_at, occurrence_at, attempts, created_at, updated_at, restarts";

fn schedule(r: &Row) -> Result<Schedule, StoreError> {
    Ok(Schedule {
        id: r.get(0),
        owner: r.get(1),
        kind: ScheduleKind::from_key(r.get(2))?,
        prompt: r.get(3),
        cron: r.get(4),
        every: r
            .get::<_, Option<i64>>(5)
            .map(|s| Duration::from_secs(s.max(1) as u64)),
        time_zone: r.get(6),
        enabled: r.get(7),
        thread_id: r.get(8),
        next_due_at: r.get(9),
        last_outcome: r
            .get::<_, Option<&str>>(10)
            .map(ScheduleOutcome::from_key)
            .transpose()?,
        last_run_id: r.get(11),
        last_error: r.get(12),
        last_fired_at: r.get(13),
        occurrence_at: r.get(14),
        attempts: r.get::<_, i32>(15).max(0) as u32,
        created_at: r.get(16),
        updated_at: r.get(17),
        restarts: r.get::<_, i32>(18).max(0) as u32,
    })
}

/// Writes a claimed occurrence and its holder (inside the claiming transaction).
async fn hold_occurrence(
    tx: &deadpool_postgres::Transaction<'_>,
    sch: &Schedule,
    worker: &str,
    until: SystemTime,
) -> Result<(), StoreError> {
    tx.execute(
        "UPDATE agent.schedules SET occurrence_at = $2, next_due_at = $3, attempts = $4, restarts = $8, \
           last_outcome = 'running', last_fired_at = $5, holder = $6, held_until = $7, updated_at = now() WHERE id = $1",
        &[
            &sch.id,
            &sch.occurrence_at,
            &sch.next_due_at,
            &(sch.attempts as i32),
            &sch.last_fired_at,
            &worker,
            &until,
            &(sch.restarts as i32),
        ],
    )
    .await
    .map_err(db)?;
    Ok(())
}

fn task_agent(r: &Row) -> TaskAgent {
    TaskAgent {
        id: r.get(0),
        owner: r.get(1),
        parent_thread_id: r.get(2),
        instructions: r.get(3),
        goal: r.get(4),
        state: r.get(5),
        attempts: r.get::<_, i32>(6) as u32,
        last_error: r.get(7),
        result: r.get(8),
        created_at: r.get(9),
        settled_attempt: r.get::<_, i32>(10) as u32,
        time_zone: r.get(11),
        restarts: r.get::<_, i32>(12) as u32,
    }
}

/// A decision's fence: the caller's lease on the thread, its row locked to the commit.
const SQL_DECIDE_FENCE: &str = "SELECT 1 FROM agent.threads WHERE id = $1 AND lock_token = $2 \
    AND lock_expires_at > clock_timestamp() FOR UPDATE";
/// A decision continues the run `$1` if it is paused (its row first, as ending a paused run
/// locks it)...
const SQL_DECIDE_RUN: &str = "UPDATE agent.runs SET state = 'executing' WHERE id = $1 \
    AND state = 'awaiting_confirmation' RETURNING last_event_seq";
/// ...and records the decision on its approval if that is still pending and unexpired. Only
/// both together are a decision: either alone is rolled back.
static SQL_DECIDE_APPROVAL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "UPDATE agent.approvals SET state = $2, decided_by = $3, decided_at = now() \
         WHERE id = $1 AND run_id = $4 AND state = 'pending' AND expires_at > now() \
         RETURNING {APPROVAL_COLUMNS}"
    )
});

/// Ending a run nobody will finish: `$1` selects (see each caller's WHERE), `$2` state, `$3`
/// error, `$4` failure kind, `$5` seq gap, `$6` terminal event, `$7` optional thread message.
const END_RUN: &str = "UPDATE agent.runs SET state = $2, error = $3, failure_kind = $4, finished_at = now(), \
    cancel_requested = cancel_requested OR $2 = 'cancelled', last_event_seq = last_event_seq + $5";
const END_RETURNING: &str = "RETURNING id, thread_id, last_event_seq";
const END_REST: &str = ", ev AS (INSERT INTO agent.run_events (run_id, seq, payload) SELECT id, last_event_seq, $6 FROM ended), \
    ap AS (UPDATE agent.approvals SET state = 'expired' WHERE run_id IN (SELECT id FROM ended) AND state = 'pending'), \
    msg AS (INSERT INTO agent.messages (thread_id, run_id, source, kind, content) \
      SELECT thread_id, id, 'error', 'text', $7 FROM ended WHERE $7::text IS NOT NULL) \
    SELECT id, pg_notify('agent_runs', 'e:' || id) FROM ended";

/// Ends the runs `selector` picks (a condition on `agent.runs`, `$1` = `key`) with `e` in one
/// statement, `more` adding CTEs after `ended`; how many it ended.
async fn end_runs(
    client: &impl tokio_postgres::GenericClient,
    selector: &str,
    more: &str,
    key: &str,
    e: &Ending,
) -> Result<usize, StoreError> {
    let sql =
        format!("WITH ended AS ({END_RUN} WHERE {selector} {END_RETURNING}){more} {END_REST}");
    let gap = e.seq_gap.max(1) as i64;
    let rows = client
        .query(
            &sql,
            &[
                &key,
                &e.state.key(),
                &e.error,
                &e.failure_kind,
                &gap,
                &e.event,
                &e.message,
            ],
        )
        .await
        .map_err(db)?;
    Ok(rows.len())
}

/// Actions as column arrays, for one multi-row upsert.
#[derive(Default)]
struct ActionColumns<'a> {
    id: Vec<&'a str>,
    call_id: Vec<&'a str>,
    tool: Vec<&'a str>,
    arguments: Vec<&'a Value>,
    side_effect: Vec<bool>,
    state: Vec<&'static str>,
    result_text: Vec<Option<&'a str>>,
    error_kind: Vec<Option<&'a str>>,
    approval_id: Vec<Option<&'a str>>,
    transitions: Vec<Value>,
    created_at: Vec<SystemTime>,
    updated_at: Vec<SystemTime>,
}

impl<'a> ActionColumns<'a> {
    fn push(&mut self, a: &'a Action) {
        self.id.push(&a.id);
        self.call_id.push(&a.call_id);
        self.tool.push(&a.tool);
        self.arguments.push(&a.arguments);
        self.side_effect.push(a.side_effect);
        self.state.push(a.state.key());
        self.result_text.push(a.result_text.as_deref());
        self.error_kind.push(a.error_kind.as_deref());
        self.approval_id.push(a.approval_id.as_deref());
        self.transitions.push(Value::Array(
            a.transitions
                .iter()
                .map(|s| Value::String(s.key().to_owned()))
                .collect(),
        ));
        self.created_at.push(a.created_at);
        self.updated_at.push(a.updated_at);
    }

    /// The columns in the order the actions' upsert binds them.
    fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 12] {
        [
            &self.id,
            &self.call_id,
            &self.tool,
            &self.arguments,
            &self.side_effect,
            &self.state,
            &self.result_text,
            &self.error_kind,
            &self.approval_id,
            &self.transitions,
            &self.created_at,
            &self.updated_at,
        ]
    }
}

const ACTION_COLUMNS: &str = "id, run_id, call_id, tool, arguments, side_effect, state, result_text, error_kind, \
    approval_id, transitions, created_at, updated_at";

fn action(r: &Row) -> Result<Action, StoreError> {
    let transitions: Vec<String> = serde_json::from_value(r.get(10)).unwrap_or_default();
    Ok(Action {
        id: r.get(0),
        run_id: r.get(1),
        call_id: r.get(2),
        tool: r.get(3),
        arguments: r.get(4),
        side_effect: r.get(5),
        state: ActionState::from_key(r.get(6))?,
        result_text: r.get(7),
        error_kind: r.get(8),
        approval_id: r.get(9),
        transitions: transitions
            .iter()
            .map(|k| ActionState::from_key(k))
            .collect::<Result<_, _>>()?,
        created_at: r.get(11),
        updated_at: r.get(12),
    })
}

/// The SQLSTATE `agent.lease_lost()` raises (migration V11) when a writer's lease is not live.
const LEASE_LOST: &str = "SWL01";
