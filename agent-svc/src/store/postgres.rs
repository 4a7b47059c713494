//! The PostgreSQL store. agent-svc owns the `agent` schema; its migrations live in
//! `agent-svc/migrations` and are embedded in the binary.

use std::time::{Duration, SystemTime};

use serde_json::Value;
use svc_kit::{pg, server_config::DatabaseConfig};
use tokio_postgres::Row;

use super::{
    Action, ActionState, AgentStore, Approval, ApprovalState, Archive, LockOutcome, Message,
    MessageKind, MessageSource, NewRunOutcome, Run, RunPatch, RunState, RunUsage, StoreError,
    TaskAgent, Thread, transcript_text,
};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory-lock key serialising agent-svc migrations across replicas ("agentsvc" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x6167_656e_7473_7663;

pub struct PgStore {
    pool: pg::PgPool,
}

impl PgStore {
    /// Applies pending migrations, then opens the pool.
    pub async fn connect(config: &DatabaseConfig) -> Result<Self, StoreError> {
        let mut runner = embedded::migrations::runner();
        runner.set_migration_table_name("agent_schema_history");
        pg::migrate(&config.url, runner, MIGRATION_LOCK_KEY).await?;
        let pool = pg::pool(&config.url, &config.pool)?;
        Ok(Self { pool })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(StoreError::unavailable)
    }
}

fn db(e: tokio_postgres::Error) -> StoreError {
    match e.as_db_error() {
        Some(d) => StoreError::Unavailable(format!("{} ({})", d.message(), d.code().code())),
        None => StoreError::Unavailable(e.to_string()),
    }
}

const THREAD_COLUMNS: &str = "id, owner, title, created_at, updated_at, \
    CASE WHEN lock_expires_at > now() THEN lock_run_id END, last_run_id";

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
    failure_kind, summary, cancel_requested, last_event_seq, created_at, started_at, finished_at, prompt_sections";

fn run(r: &Row) -> Run {
    let usage: Value = r.get(7);
    Run {
        id: r.get(0),
        thread_id: r.get(1),
        owner: r.get(2),
        request_id: r.get(3),
        state: RunState::from_key(r.get(4)),
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
    }
}

fn lease_until(lease: Duration) -> SystemTime {
    SystemTime::now() + lease
}

#[async_trait::async_trait]
impl AgentStore for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn ping(&self) -> Result<(), StoreError> {
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
        offset: usize,
        limit: usize,
    ) -> Result<Vec<Thread>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                &format!(
                    "SELECT {THREAD_COLUMNS} FROM agent.threads WHERE owner = $1 \
                     ORDER BY updated_at DESC, id OFFSET $2 LIMIT $3"
                ),
                &[&owner, &(offset as i64), &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(thread).collect())
    }

    async fn lock_thread(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<LockOutcome, StoreError> {
        // One statement: take the lock if it is free, expired or already ours; otherwise report
        // the holder. Row-level locking makes concurrent callers on any replica see one winner.
        let client = self.client().await?;
        let taken = client
            .query_opt(
                "UPDATE agent.threads SET lock_run_id = $2, lock_expires_at = $3, last_run_id = $2, updated_at = now() \
                 WHERE id = $1 AND (lock_run_id IS NULL OR lock_expires_at <= now() OR lock_run_id = $2) RETURNING id",
                &[&thread_id, &run_id, &lease_until(lease)],
            )
            .await
            .map_err(db)?;
        if taken.is_some() {
            return Ok(LockOutcome::Acquired);
        }
        let holder = client
            .query_opt(
                "SELECT lock_run_id FROM agent.threads WHERE id = $1",
                &[&thread_id],
            )
            .await
            .map_err(db)?
            .ok_or_else(|| StoreError::NotFound(format!("thread {thread_id}")))?;
        Ok(LockOutcome::Busy {
            run_id: holder.get::<_, Option<String>>(0).unwrap_or_default(),
        })
    }

    async fn renew_lock(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "UPDATE agent.threads SET lock_expires_at = $3 WHERE id = $1 AND lock_run_id = $2",
                &[&thread_id, &run_id, &lease_until(lease)],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn release_lock(&self, thread_id: &str, run_id: &str) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "UPDATE agent.threads SET lock_run_id = NULL, lock_expires_at = NULL WHERE id = $1 AND lock_run_id = $2",
                &[&thread_id, &run_id],
            )
            .await
            .map_err(db)?;
        Ok(())
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

    async fn history(&self, thread_id: &str) -> Result<Vec<Value>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT turn FROM agent.llm_history WHERE thread_id = $1 ORDER BY seq",
                &[&thread_id],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    async fn append_history(&self, thread_id: &str, turns: &[Value]) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        let next: i64 = tx
            .query_one(
                "SELECT COALESCE(max(seq), 0) + 1 FROM agent.llm_history WHERE thread_id = $1",
                &[&thread_id],
            )
            .await
            .map_err(db)?
            .get(0);
        for (i, turn) in turns.iter().enumerate() {
            tx.execute(
                "INSERT INTO agent.llm_history (thread_id, seq, turn) VALUES ($1, $2, $3)",
                &[&thread_id, &(next + i as i64), turn],
            )
            .await
            .map_err(db)?;
        }
        tx.commit().await.map_err(db)
    }

    async fn create_run(&self, r: &Run) -> Result<NewRunOutcome, StoreError> {
        let client = self.client().await?;
        let usage = serde_json::to_value(&r.usage).unwrap_or_default();
        let inserted = client
            .execute(
                "INSERT INTO agent.runs (id, thread_id, owner, request_id, state, channel, usage) VALUES ($1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT (owner, request_id) WHERE request_id IS NOT NULL DO NOTHING",
                &[&r.id, &r.thread_id, &r.owner, &r.request_id, &r.state.key(), &r.channel, &usage],
            )
            .await
            .map_err(db)?;
        if inserted == 1 {
            return Ok(NewRunOutcome::Created);
        }
        let existing = client
            .query_one(
                "SELECT id FROM agent.runs WHERE owner = $1 AND request_id = $2",
                &[&r.owner, &r.request_id],
            )
            .await
            .map_err(db)?;
        Ok(NewRunOutcome::Duplicate {
            run_id: existing.get(0),
        })
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
        Ok(row.as_ref().map(run))
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
        Ok(row.as_ref().map(run))
    }

    async fn update_run(&self, run_id: &str, p: RunPatch) -> Result<(), StoreError> {
        let usage = p
            .usage
            .as_ref()
            .map(|u| serde_json::to_value(u).unwrap_or_default());
        let iterations = p.iterations.map(|i| i as i32);
        self.client()
            .await?
            .execute(
                "UPDATE agent.runs SET state = COALESCE($2::text, state), model = COALESCE($3::text, model), \
                   usage = COALESCE($4::jsonb, usage), iterations = COALESCE($5::integer, iterations), \
                   error = COALESCE($6::text, error), failure_kind = COALESCE($7::text, failure_kind), \
                   summary = COALESCE($8::text, summary), started_at = COALESCE($9::timestamptz, started_at), \
                   finished_at = COALESCE($10::timestamptz, finished_at), \
                   prompt_sections = COALESCE($11::jsonb, prompt_sections) WHERE id = $1",
                &[
                    &run_id,
                    &p.state.map(RunState::key),
                    &p.model,
                    &usage,
                    &iterations,
                    &p.error,
                    &p.failure_kind,
                    &p.summary,
                    &p.started_at,
                    &p.finished_at,
                    &p.prompt_sections.as_ref().map(|v| serde_json::to_value(v).unwrap_or_default()),
                ],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn request_cancel(&self, run_id: &str) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "UPDATE agent.runs SET cancel_requested = true WHERE id = $1 AND state NOT IN ('completed', 'failed', 'cancelled')",
                &[&run_id],
            )
            .await
            .map_err(db)?;
        Ok(n == 1)
    }

    async fn append_event(&self, run_id: &str, payload: &[u8]) -> Result<u64, StoreError> {
        // Numbering through the run row serialises appends per run: no gaps, no duplicates.
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        let seq: i64 = tx
            .query_one("UPDATE agent.runs SET last_event_seq = last_event_seq + 1 WHERE id = $1 RETURNING last_event_seq", &[&run_id])
            .await
            .map_err(db)?
            .get(0);
        tx.execute(
            "INSERT INTO agent.run_events (run_id, seq, payload) VALUES ($1, $2, $3)",
            &[&run_id, &seq, &payload],
        )
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(seq as u64)
    }

    async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT seq, payload FROM agent.run_events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                &[&run_id, &(after as i64), &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, i64>(0) as u64, r.get(1)))
            .collect())
    }

    async fn unfinished_runs_before(&self, before: SystemTime) -> Result<Vec<Run>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                &format!(
                    "SELECT {RUN_COLUMNS} FROM agent.runs WHERE state IN ('queued', 'planning', 'executing') \
                     AND COALESCE(started_at, created_at) < $1 ORDER BY created_at LIMIT 500"
                ),
                &[&before],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(run).collect())
    }

    async fn fail_if_unfinished(
        &self,
        run_id: &str,
        error: &str,
        failure_kind: &str,
    ) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "UPDATE agent.runs SET state = 'failed', error = $2, failure_kind = $3, finished_at = now() \
                 WHERE id = $1 AND state IN ('queued', 'planning', 'executing')",
                &[&run_id, &error, &failure_kind],
            )
            .await
            .map_err(db)?;
        Ok(n == 1)
    }

    async fn archive_history(
        &self,
        thread_id: &str,
        owner: &str,
        summary: &str,
    ) -> Result<Option<Archive>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        // The thread row lock makes concurrent archivers take turns; the loser finds no history.
        tx.execute(
            "SELECT 1 FROM agent.threads WHERE id = $1 FOR UPDATE",
            &[&thread_id],
        )
        .await
        .map_err(db)?;
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
        let row = tx
            .query_one(
                "INSERT INTO agent.session_archives (thread_id, owner, summary, transcript, transcript_text, turn_count) \
                 VALUES ($1, $2, $3, $4, $5, $6) RETURNING archived_at",
                &[&thread_id, &owner, &summary, &Value::Array(turns.clone()), &transcript_text(&turns), &(turns.len() as i32)],
            )
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(Some(Archive {
            thread_id: thread_id.to_owned(),
            summary: summary.to_owned(),
            turn_count: turns.len() as u32,
            archived_at: row.get(0),
        }))
    }

    async fn recent_summaries(
        &self,
        owner: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT thread_id, summary, turn_count, archived_at FROM agent.session_archives WHERE owner = $1 \
                 ORDER BY archived_at DESC, id DESC LIMIT $2",
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
                "SELECT thread_id, summary, turn_count, archived_at FROM agent.session_archives, websearch_to_tsquery('english', $2) q \
                 WHERE owner = $1 AND tsv @@ q ORDER BY ts_rank_cd(tsv, q) DESC, archived_at DESC LIMIT $3",
                &[&owner, &query, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(archive).collect())
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

    async fn enqueue_task_agent(&self, t: &TaskAgent) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "INSERT INTO agent.task_agents (id, owner, parent_thread_id, instructions, goal, state) VALUES ($1, $2, $3, $4, $5, 'queued')",
                &[&t.id, &t.owner, &t.parent_thread_id, &t.instructions, &t.goal],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn claim_task_agent(
        &self,
        worker: &str,
        lease: Duration,
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
                                    OR (state = 'running' AND claimed_until < now()) \
                                 ORDER BY next_attempt_at LIMIT 1 FOR UPDATE SKIP LOCKED) \
                     RETURNING {TASK_COLUMNS}"
                ),
                &[&worker, &lease_until(lease)],
            )
            .await
            .map_err(db)?;
        Ok(row.as_ref().map(task_agent))
    }

    async fn settle_task_agent(
        &self,
        id: &str,
        state: &str,
        result: Option<&str>,
        error: Option<&str>,
        retry_at: Option<SystemTime>,
    ) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "UPDATE agent.task_agents SET state = $2, result = COALESCE($3::text, result), last_error = COALESCE($4::text, last_error), \
                   next_attempt_at = COALESCE($5::timestamptz, next_attempt_at), claimed_by = NULL, claimed_until = NULL, \
                   updated_at = now() WHERE id = $1",
                &[&id, &state, &result, &error, &retry_at],
            )
            .await
            .map_err(db)?;
        Ok(())
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

    async fn create_action(&self, a: &Action) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "INSERT INTO agent.actions (id, run_id, call_id, tool, arguments, side_effect, state) VALUES ($1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT (id) DO NOTHING",
                &[&a.id, &a.run_id, &a.call_id, &a.tool, &a.arguments, &a.side_effect, &a.state.key()],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn update_action(
        &self,
        id: &str,
        state: ActionState,
        result: Option<(&str, Option<&str>)>,
        approval_id: Option<&str>,
    ) -> Result<(), StoreError> {
        let (text, kind) = result.map_or((None, None), |(t, k)| (Some(t), k));
        self.client()
            .await?
            .execute(
                "UPDATE agent.actions SET state = $2, result_text = COALESCE($3::text, result_text), \
                   error_kind = CASE WHEN $3::text IS NULL THEN error_kind ELSE $4::text END, \
                   approval_id = COALESCE($5::text, approval_id), updated_at = now() WHERE id = $1",
                &[&id, &state.key(), &text, &kind, &approval_id],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn list_actions(&self, run_id: &str) -> Result<Vec<Action>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT id, run_id, call_id, tool, arguments, side_effect, state, result_text, error_kind, approval_id, created_at, \
                   updated_at FROM agent.actions WHERE run_id = $1 ORDER BY created_at, id",
                &[&run_id],
            )
            .await
            .map_err(db)?;
        Ok(rows
            .iter()
            .map(|r| Action {
                id: r.get(0),
                run_id: r.get(1),
                call_id: r.get(2),
                tool: r.get(3),
                arguments: r.get(4),
                side_effect: r.get(5),
                state: ActionState::from_key(r.get(6)),
                result_text: r.get(7),
                error_kind: r.get(8),
                approval_id: r.get(9),
                created_at: r.get(10),
                updated_at: r.get(11),
            })
            .collect())
    }

    async fn create_approval(&self, a: &Approval) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "INSERT INTO agent.approvals (id, run_id, thread_id, owner, call_id, tool, arguments, args_sha256, preview, reason, \
                   state, created_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
                &[
                    &a.id,
                    &a.run_id,
                    &a.thread_id,
                    &a.owner,
                    &a.call_id,
                    &a.tool,
                    &a.arguments,
                    &a.args_sha256,
                    &a.preview,
                    &a.reason,
                    &a.state.key(),
                    &a.created_at,
                    &a.expires_at,
                ],
            )
            .await
            .map_err(db)?;
        Ok(())
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
        Ok(row.as_ref().map(approval))
    }

    async fn decide_approval(
        &self,
        id: &str,
        state: ApprovalState,
        decider: &str,
    ) -> Result<Option<Approval>, StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "UPDATE agent.approvals SET state = $2, decided_by = $3, decided_at = now() WHERE id = $1 AND state = 'pending'",
                &[&id, &state.key(), &decider],
            )
            .await
            .map_err(db)?;
        let row = client
            .query_opt(
                &format!("SELECT {APPROVAL_COLUMNS} FROM agent.approvals WHERE id = $1"),
                &[&id],
            )
            .await
            .map_err(db)?;
        Ok(row.as_ref().map(approval))
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

const APPROVAL_COLUMNS: &str = "id, run_id, thread_id, owner, call_id, tool, arguments, args_sha256, preview, reason, state, \
    created_at, expires_at, decided_by, decided_at";

fn approval(r: &Row) -> Approval {
    Approval {
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
        state: ApprovalState::from_key(r.get(10)),
        created_at: r.get(11),
        expires_at: r.get(12),
        decided_by: r.get(13),
        decided_at: r.get(14),
    }
}

fn archive(r: &Row) -> Archive {
    Archive {
        thread_id: r.get(0),
        summary: r.get(1),
        turn_count: r.get::<_, i32>(2) as u32,
        archived_at: r.get(3),
    }
}

const TASK_COLUMNS: &str =
    "id, owner, parent_thread_id, instructions, goal, state, attempts, last_error, result";

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
    }
}
