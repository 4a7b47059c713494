//! Many runs' commits as one statement (issue 13, Q-2): each table written once for the whole
//! batch, every row gated on its own run's lease fence. A run whose fence fails writes nothing
//! and is told `LeaseLost`; the others commit. The statement is one transaction, so when it
//! fails as a whole (one run's turn that is not JSON, a deadlock) the caller commits each run
//! on its own instead, and each gets its own answer. `cargo bench -p steward-tests --bench
//! commit_shapes` measured four runs this way at about 40% less of PostgreSQL's CPU per commit
//! than each as its own statement.

use std::{collections::HashSet, time::SystemTime};

use serde_json::Value;
use tokio_postgres::types::ToSql;

use super::{ActionColumns, commit::PatchValues, kind_key, source_key};
use crate::store::{Lease, RunCommit};

/// One statement for any batch; every column is an array of the batch's rows.
/// The batch's thread rows are locked first, in id order and skipping any another
/// transaction holds (an admission, a decision), so one busy row never holds up the batch and
/// two batches never wait on each other; the runs of skipped threads are answered as busy.
const SQL: &str = "WITH locked AS (SELECT t.id FROM agent.threads t WHERE t.id = ANY($1::text[]) \
      ORDER BY t.id FOR NO KEY UPDATE SKIP LOCKED), \
  fenced AS (UPDATE agent.threads t \
      SET updated_at = CASE WHEN u.touch THEN now() ELSE t.updated_at END, \
      lock_run_id = CASE WHEN u.rel THEN NULL ELSE t.lock_run_id END, \
      lock_token = CASE WHEN u.rel THEN NULL ELSE t.lock_token END, \
      lock_expires_at = CASE WHEN u.rel THEN NULL ELSE t.lock_expires_at END, \
      read_external = t.read_external OR u.taint \
    FROM unnest($1::text[], $2::text[], $3::bool[], $4::bool[], $5::text[], $64::bool[]) \
      AS u(thread, token, touch, rel, run, taint) \
    WHERE t.id = u.thread AND t.id IN (SELECT id FROM locked) \
      AND t.lock_token = u.token AND t.lock_expires_at > clock_timestamp() \
    RETURNING u.run, u.thread), \
  events AS (INSERT INTO agent.run_events (run_id, seq, payload) \
    SELECT u.run, u.s, u.p FROM unnest($6::text[], $7::bigint[], $8::bytea[]) AS u(run, s, p) \
    WHERE u.run IN (SELECT run FROM fenced)), \
  history AS (INSERT INTO agent.llm_history (thread_id, seq, turn) \
    SELECT u.thread, \
      COALESCE((SELECT max(l.seq) FROM agent.llm_history l WHERE l.thread_id = u.thread), 0) \
        + row_number() OVER (PARTITION BY u.thread ORDER BY u.o), \
      u.t::jsonb \
    FROM unnest($9::text[], $10::text[]) WITH ORDINALITY AS u(thread, t, o) \
    WHERE u.thread IN (SELECT thread FROM fenced)), \
  actions AS (INSERT INTO agent.actions (id, run_id, call_id, tool, arguments, side_effect, state, \
      result_text, error_kind, approval_id, transitions, created_at, updated_at) \
    SELECT id, run, call_id, tool, arguments, side_effect, state, result_text, error_kind, approval_id, \
      transitions, created_at, updated_at \
    FROM unnest($11::text[], $12::text[], $13::text[], $14::text[], $15::jsonb[], $16::bool[], $17::text[], \
      $18::text[], $19::text[], $20::text[], $21::jsonb[], $22::timestamptz[], $23::timestamptz[]) \
      WITH ORDINALITY AS u(run, id, call_id, tool, arguments, side_effect, state, result_text, error_kind, \
        approval_id, transitions, created_at, updated_at, o) \
    WHERE u.run IN (SELECT run FROM fenced) \
    ORDER BY o \
    ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, result_text = EXCLUDED.result_text, \
      error_kind = EXCLUDED.error_kind, approval_id = EXCLUDED.approval_id, \
      transitions = EXCLUDED.transitions, updated_at = EXCLUDED.updated_at), \
  messages AS (INSERT INTO agent.messages (thread_id, run_id, source, kind, content, metadata) \
    SELECT thread, run, s, k, c, m \
    FROM unnest($24::text[], $25::text[], $26::text[], $27::text[], $28::text[], $29::jsonb[]) \
      WITH ORDINALITY AS u(thread, run, s, k, c, m, o) \
    WHERE u.run IN (SELECT run FROM fenced) ORDER BY o), \
  patch AS (UPDATE agent.runs r SET state = COALESCE(u.state, r.state), model = COALESCE(u.model, r.model), \
      usage = COALESCE(u.usage, r.usage), iterations = COALESCE(u.iterations, r.iterations), \
      error = COALESCE(u.error, r.error), failure_kind = COALESCE(u.failure_kind, r.failure_kind), \
      summary = COALESCE(u.summary, r.summary), started_at = COALESCE(u.started_at, r.started_at), \
      finished_at = COALESCE(u.finished_at, r.finished_at), \
      prompt_sections = COALESCE(u.sections, r.prompt_sections), \
      system_prompt = COALESCE(u.system_prompt, r.system_prompt), \
      last_event_seq = GREATEST(r.last_event_seq, COALESCE(u.max_seq, 0)) \
    FROM unnest($30::text[], $31::text[], $32::text[], $33::jsonb[], $34::int4[], $35::text[], $36::text[], \
      $37::text[], $38::timestamptz[], $39::timestamptz[], $40::jsonb[], $41::text[], $42::bigint[], \
      $43::text[]) AS u(run, state, model, usage, iterations, error, failure_kind, summary, started_at, \
        finished_at, sections, system_prompt, max_seq, expect) \
    WHERE r.id = u.run AND (u.expect IS NULL OR r.state = u.expect) \
      AND u.run IN (SELECT run FROM fenced)), \
  approval AS (INSERT INTO agent.approvals (id, run_id, thread_id, owner, call_id, tool, arguments, \
      args_sha256, preview, reason, state, created_at, expires_at, binding, tainted_by, allowed_tools) \
    SELECT id, run_id, thread_id, owner, call_id, tool, arguments, args_sha256, preview, reason, state, \
      created_at, expires_at, binding, ARRAY(SELECT jsonb_array_elements_text(tainted_by)), \
      CASE WHEN jsonb_typeof(allowed_tools) = 'array' \
        THEN ARRAY(SELECT jsonb_array_elements_text(allowed_tools)) END \
    FROM unnest($44::text[], $45::text[], $46::text[], $47::text[], $48::text[], $49::text[], $50::text[], \
      $51::jsonb[], $52::text[], $53::text[], $54::text[], $55::text[], $56::timestamptz[], \
      $57::timestamptz[], $58::text[], $59::jsonb[], $60::jsonb[]) AS u(lease_run, id, run_id, thread_id, \
        owner, call_id, tool, arguments, args_sha256, preview, reason, state, created_at, expires_at, \
        binding, tainted_by, allowed_tools) \
    WHERE u.lease_run IN (SELECT run FROM fenced)), \
  audit AS (INSERT INTO agent.audit (owner, kind, run_id, detail) \
    SELECT r.owner, u.k, r.id, u.d \
    FROM unnest($61::text[], $62::text[], $63::jsonb[]) WITH ORDINALITY AS u(run, k, d, o) \
      JOIN agent.runs r ON r.id = u.run \
    WHERE u.run IN (SELECT run FROM fenced) ORDER BY o) \
  SELECT run, true FROM fenced \
  UNION ALL SELECT u.run, false FROM unnest($1::text[], $5::text[]) AS u(thread, run) \
    WHERE u.thread NOT IN (SELECT id FROM locked)";

/// The batch's rows, column by column, borrowed from its commits.
#[derive(Default)]
struct Columns<'a> {
    fence_thread: Vec<&'a str>,
    fence_token: Vec<&'a str>,
    fence_touch: Vec<bool>,
    fence_release: Vec<bool>,
    fence_run: Vec<&'a str>,
    /// Bound last of all (`$64`), so the columns after the fence's kept their numbers.
    fence_taint: Vec<bool>,
    event_run: Vec<&'a str>,
    event_seq: Vec<i64>,
    event_payload: Vec<&'a [u8]>,
    history_thread: Vec<&'a str>,
    history_turn: Vec<&'a str>,
    action_run: Vec<&'a str>,
    actions: ActionColumns<'a>,
    message_thread: Vec<&'a str>,
    message_run: Vec<&'a str>,
    message_source: Vec<&'static str>,
    message_kind: Vec<&'static str>,
    message_content: Vec<&'a str>,
    message_metadata: Vec<&'a Value>,
    patch: PatchColumns<'a>,
    approval: ApprovalColumns<'a>,
    audit_run: Vec<&'a str>,
    audit_kind: Vec<&'a str>,
    audit_detail: Vec<&'a Value>,
}

#[derive(Default)]
struct PatchColumns<'a> {
    run: Vec<&'a str>,
    state: Vec<Option<&'static str>>,
    model: Vec<Option<&'a str>>,
    usage: Vec<Option<Value>>,
    iterations: Vec<Option<i32>>,
    error: Vec<Option<&'a str>>,
    failure_kind: Vec<Option<&'a str>>,
    summary: Vec<Option<&'a str>>,
    started_at: Vec<Option<SystemTime>>,
    finished_at: Vec<Option<SystemTime>>,
    sections: Vec<Option<Value>>,
    system_prompt: Vec<Option<&'a str>>,
    max_seq: Vec<Option<i64>>,
    expect: Vec<Option<&'static str>>,
}

#[derive(Default)]
struct ApprovalColumns<'a> {
    lease_run: Vec<&'a str>,
    id: Vec<&'a str>,
    run_id: Vec<&'a str>,
    thread_id: Vec<&'a str>,
    owner: Vec<&'a str>,
    call_id: Vec<&'a str>,
    tool: Vec<&'a str>,
    arguments: Vec<&'a Value>,
    args_sha256: Vec<&'a str>,
    preview: Vec<&'a str>,
    reason: Vec<&'a str>,
    state: Vec<&'static str>,
    created_at: Vec<SystemTime>,
    expires_at: Vec<SystemTime>,
    binding: Vec<&'a str>,
    tainted_by: Vec<Value>,
    /// JSON null: every tool.
    allowed_tools: Vec<Value>,
}

impl<'a> Columns<'a> {
    fn push(&mut self, lease: &'a Lease, c: &'a RunCommit) {
        let (run, thread) = (lease.run_id.as_str(), lease.thread_id.as_str());
        self.fence_thread.push(thread);
        self.fence_token.push(&lease.token);
        self.fence_touch.push(!c.messages.is_empty());
        self.fence_release.push(c.release);
        self.fence_run.push(run);
        self.fence_taint.push(c.read_external);
        for (seq, payload) in &c.events {
            self.event_run.push(run);
            self.event_seq.push(*seq as i64);
            self.event_payload.push(payload);
        }
        for turn in &c.history {
            self.history_thread.push(thread);
            self.history_turn.push(turn);
        }
        for a in &c.actions {
            self.action_run.push(run);
            self.actions.push(a);
        }
        for m in &c.messages {
            self.message_thread.push(thread);
            self.message_run.push(run);
            self.message_source.push(source_key(m.source));
            self.message_kind.push(kind_key(m.kind));
            self.message_content.push(&m.content);
            self.message_metadata.push(&m.metadata);
        }
        if let Some(values) = PatchValues::of(c) {
            let (p, cols) = (&c.patch, &mut self.patch);
            cols.run.push(run);
            cols.state.push(values.state);
            cols.model.push(p.model.as_deref());
            cols.usage.push(values.usage);
            cols.iterations.push(values.iterations);
            cols.error.push(p.error.as_deref());
            cols.failure_kind.push(p.failure_kind.as_deref());
            cols.summary.push(p.summary.as_deref());
            cols.started_at.push(p.started_at);
            cols.finished_at.push(p.finished_at);
            cols.sections.push(values.sections);
            cols.system_prompt.push(p.system_prompt.as_deref());
            cols.max_seq.push(values.max_seq);
            cols.expect.push(values.expect);
        }
        if let Some(a) = &c.approval {
            let cols = &mut self.approval;
            cols.lease_run.push(run);
            cols.id.push(&a.id);
            cols.run_id.push(&a.run_id);
            cols.thread_id.push(&a.thread_id);
            cols.owner.push(&a.owner);
            cols.call_id.push(&a.call_id);
            cols.tool.push(&a.tool);
            cols.arguments.push(&a.arguments);
            cols.args_sha256.push(&a.args_sha256);
            cols.preview.push(&a.preview);
            cols.reason.push(&a.reason);
            cols.state.push(a.state.key());
            cols.created_at.push(a.created_at);
            cols.expires_at.push(a.expires_at);
            cols.binding.push(&a.binding);
            // A row's text[] cannot be an element of another array: it travels as JSON.
            cols.tainted_by.push(Value::from(a.tainted_by.clone()));
            cols.allowed_tools
                .push(Value::from(a.allowed_tools.clone()));
        }
        for (kind, detail) in &c.audit {
            self.audit_run.push(run);
            self.audit_kind.push(kind);
            self.audit_detail.push(detail);
        }
    }

    /// Every column in the statement's `$n` order.
    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        let (p, a) = (&self.patch, &self.approval);
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![
            &self.fence_thread,
            &self.fence_token,
            &self.fence_touch,
            &self.fence_release,
            &self.fence_run,
            &self.event_run,
            &self.event_seq,
            &self.event_payload,
            &self.history_thread,
            &self.history_turn,
            &self.action_run,
        ];
        params.extend(self.actions.params());
        params.extend::<[&(dyn ToSql + Sync); 6]>([
            &self.message_thread,
            &self.message_run,
            &self.message_source,
            &self.message_kind,
            &self.message_content,
            &self.message_metadata,
        ]);
        params.extend::<[&(dyn ToSql + Sync); 14]>([
            &p.run,
            &p.state,
            &p.model,
            &p.usage,
            &p.iterations,
            &p.error,
            &p.failure_kind,
            &p.summary,
            &p.started_at,
            &p.finished_at,
            &p.sections,
            &p.system_prompt,
            &p.max_seq,
            &p.expect,
        ]);
        params.extend::<[&(dyn ToSql + Sync); 17]>([
            &a.lease_run,
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
            &a.state,
            &a.created_at,
            &a.expires_at,
            &a.binding,
            &a.tainted_by,
            &a.allowed_tools,
        ]);
        params.extend::<[&(dyn ToSql + Sync); 4]>([
            &self.audit_run,
            &self.audit_kind,
            &self.audit_detail,
            &self.fence_taint,
        ]);
        params
    }
}

/// What a batch's statement did with each run: written (its fence held), or not tried (its
/// thread row was busy). A run in neither wrote nothing because its lease is gone.
#[derive(Debug, Default)]
pub(super) struct Written {
    pub(super) fenced: HashSet<String>,
    pub(super) busy: HashSet<String>,
}

/// Writes every commit of `batch` whose lease is live and whose thread row is free, in one
/// statement. No two commits of a batch may share a thread.
pub(super) async fn many(
    client: &deadpool_postgres::Object,
    batch: &[(&Lease, &RunCommit)],
) -> Result<Written, tokio_postgres::Error> {
    let mut cols = Columns::default();
    for (lease, c) in batch {
        cols.push(lease, c);
    }
    let statement = client.prepare_cached(SQL).await?;
    let rows = client.query(&statement, &cols.params()).await?;
    let mut written = Written::default();
    for row in rows {
        let run: String = row.get(0);
        if row.get::<_, bool>(1) {
            written.fenced.insert(run);
        } else {
            written.busy.insert(run);
        }
    }
    Ok(written)
}
