//! A run's commit as one SQL statement (issue 13, Q-2): the lease fence and every write of the
//! commit as data-modifying CTEs, with no BEGIN or COMMIT around them. A statement is its own
//! transaction, so the commit is still whole or absent, and PostgreSQL parses, plans, executes
//! and flushes once instead of once per write plus twice for the transaction — measured by
//! `cargo bench -p steward-tests --bench commit_shapes` as about a third less of its CPU.
//!
//! A commit holds only some parts (events, history, …); each combination is its own statement,
//! built once per process and prepared once per pooled connection.

use std::sync::OnceLock;

use serde_json::Value;
use tokio_postgres::types::ToSql;

use super::{ActionColumns, LEASE_LOST, db, kind_key, source_key};
use crate::store::{Lease, RunCommit, RunPatch, RunState, StoreError};

type Param<'a> = &'a (dyn ToSql + Sync);

/// Writes `c` as one statement on `client` if `lease` is live: `Err(LeaseLost)` otherwise.
pub(super) async fn one(
    client: &deadpool_postgres::Object,
    lease: &Lease,
    c: &RunCommit,
) -> Result<(), StoreError> {
    let run_id = &lease.run_id;
    let touch = !c.messages.is_empty();
    let seqs: Vec<i64> = c.events.iter().map(|(s, _)| *s as i64).collect();
    let payloads: Vec<&[u8]> = c.events.iter().map(|(_, p)| p.as_slice()).collect();
    let mut cols = ActionColumns::default();
    for a in &c.actions {
        cols.push(a);
    }
    let sources: Vec<&str> = c.messages.iter().map(|m| source_key(m.source)).collect();
    let kinds: Vec<&str> = c.messages.iter().map(|m| kind_key(m.kind)).collect();
    let contents: Vec<&str> = c.messages.iter().map(|m| m.content.as_str()).collect();
    let metadata: Vec<&Value> = c.messages.iter().map(|m| &m.metadata).collect();
    let patch = PatchValues::of(c);
    let audit_kinds: Vec<&str> = c.audit.iter().map(|(k, _)| k.as_str()).collect();
    let audit_details: Vec<&Value> = c.audit.iter().map(|(_, d)| d).collect();
    let approval_state = c.approval.as_ref().map(|a| a.state.key());

    // The fence, then each part present, binding the shared parameters first and each part's
    // own in its CTE's order.
    let mut parts = Parts::default();
    let mut params: Vec<Param<'_>> = vec![
        &lease.thread_id,
        &lease.token,
        &touch,
        &c.release,
        run_id,
        &c.read_external,
    ];
    if !seqs.is_empty() {
        parts.with(Part::Events);
        params.extend::<[Param<'_>; 2]>([&seqs, &payloads]);
    }
    if !c.history.is_empty() {
        parts.with(Part::History);
        params.push(&c.history);
    }
    if !c.actions.is_empty() {
        parts.with(Part::Actions);
        params.extend(cols.params());
    }
    if !sources.is_empty() {
        parts.with(Part::Messages);
        params.extend::<[Param<'_>; 4]>([&sources, &kinds, &contents, &metadata]);
    }
    if let Some(patch) = &patch {
        parts.with(Part::Patch);
        params.extend(patch.params(&c.patch));
    }
    if let (Some(a), Some(approval_state)) = (&c.approval, &approval_state) {
        parts.with(Part::Approval);
        params.extend::<[Param<'_>; 16]>([
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
            approval_state,
            &a.created_at,
            &a.expires_at,
            &a.binding,
            &a.tainted_by,
            &a.allowed_tools,
        ]);
    }
    if !audit_kinds.is_empty() {
        parts.with(Part::Audit);
        params.extend::<[Param<'_>; 2]>([&audit_kinds, &audit_details]);
    }
    debug_assert_eq!(params.len(), parts.arity(), "{parts:?}");
    let statement = client
        .prepare_typed_cached(parts.sql(), &SHARED)
        .await
        .map_err(db)?;
    // A statement is its own transaction: if this future is dropped once it was sent, the
    // commit still lands or fails whole, and the connection holds nothing open.
    match client.execute_raw(&statement, params).await {
        Err(e) if e.code().map(|c| c.code()) == Some(LEASE_LOST) => Err(StoreError::LeaseLost),
        other => other.map(drop).map_err(db),
    }
}

/// A run patch's values as PostgreSQL takes them (JSON for the structured ones).
pub(super) struct PatchValues {
    pub(super) state: Option<&'static str>,
    pub(super) usage: Option<Value>,
    pub(super) iterations: Option<i32>,
    pub(super) sections: Option<Value>,
    pub(super) expect: Option<&'static str>,
    /// The commit's last event, which the run's `last_event_seq` moves up to.
    pub(super) max_seq: Option<i64>,
}

impl PatchValues {
    /// What a commit changes on its run's row: its patch, and its last event's seq. `None`
    /// when it changes nothing there.
    pub(super) fn of(c: &RunCommit) -> Option<Self> {
        let p = &c.patch;
        let max_seq = c.events.iter().map(|(seq, _)| *seq as i64).max();
        if *p == RunPatch::default() && max_seq.is_none() {
            return None;
        }
        Some(Self {
            state: p.state.map(RunState::key),
            usage: p
                .usage
                .as_ref()
                .map(|u| serde_json::to_value(u).unwrap_or_default()),
            iterations: p.iterations.map(|i| i as i32),
            sections: p
                .prompt_sections
                .as_ref()
                .map(|v| serde_json::to_value(v).unwrap_or_default()),
            expect: p.expect.map(RunState::key),
            max_seq,
        })
    }

    /// The patch's parameters in `Part::Patch`'s order.
    fn params<'a>(&'a self, p: &'a RunPatch) -> [Param<'a>; 13] {
        [
            &self.state,
            &p.model,
            &self.usage,
            &self.iterations,
            &p.error,
            &p.failure_kind,
            &p.summary,
            &p.started_at,
            &p.finished_at,
            &self.sections,
            &p.system_prompt,
            &self.max_seq,
            &self.expect,
        ]
    }
}

/// One part a commit may hold. The order here is the order of the CTEs in the statement and of
/// their parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    Events,
    History,
    Actions,
    Messages,
    Patch,
    Approval,
    Audit,
}

impl Part {
    pub(super) const ALL: [Part; 7] = [
        Part::Events,
        Part::History,
        Part::Actions,
        Part::Messages,
        Part::Patch,
        Part::Approval,
        Part::Audit,
    ];

    /// The part's CTE. `$1`..`$6` are shared (see [`SHARED`]); `#n` is the part's own n-th
    /// parameter, numbered after the parts before it when the statement is built. Every write
    /// is gated on the fence, so whatever order PostgreSQL runs the CTEs in, a lost lease
    /// writes nothing and answers `SWL01`, never a key conflict of a stale write.
    fn cte(self) -> &'static str {
        match self {
            Part::Events => {
                "events AS (INSERT INTO agent.run_events (run_id, seq, payload) \
                 SELECT $5, s, p FROM unnest(#1::bigint[], #2::bytea[]) AS u(s, p) \
                 WHERE EXISTS (SELECT 1 FROM fenced))"
            }
            // The history's base is read in the statement's snapshot, taken before the fence
            // waits for the thread row. That is safe because only the lease holder appends
            // history, one commit at a time, and a new holder's lease comes from an admission
            // that committed after the old holder's last commit (both lock the thread row).
            Part::History => {
                "history AS (INSERT INTO agent.llm_history (thread_id, seq, turn) \
                 SELECT $1, b.base + u.o, u.t::jsonb FROM \
                   (SELECT COALESCE(max(seq), 0) AS base FROM agent.llm_history WHERE thread_id = $1) b, \
                   unnest(#1::text[]) WITH ORDINALITY AS u(t, o) \
                 WHERE EXISTS (SELECT 1 FROM fenced))"
            }
            Part::Actions => {
                "actions AS (INSERT INTO agent.actions (id, run_id, call_id, tool, arguments, side_effect, \
                   state, result_text, error_kind, approval_id, transitions, created_at, updated_at) \
                 SELECT id, $5, call_id, tool, arguments, side_effect, state, result_text, error_kind, \
                   approval_id, transitions, created_at, updated_at \
                 FROM unnest(#1::text[], #2::text[], #3::text[], #4::jsonb[], #5::bool[], #6::text[], \
                   #7::text[], #8::text[], #9::text[], #10::jsonb[], #11::timestamptz[], \
                   #12::timestamptz[]) WITH ORDINALITY \
                   AS u(id, call_id, tool, arguments, side_effect, state, result_text, error_kind, \
                     approval_id, transitions, created_at, updated_at, o) \
                 WHERE EXISTS (SELECT 1 FROM fenced) \
                 ORDER BY o \
                 ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, result_text = EXCLUDED.result_text, \
                   error_kind = EXCLUDED.error_kind, approval_id = EXCLUDED.approval_id, \
                   transitions = EXCLUDED.transitions, updated_at = EXCLUDED.updated_at)"
            }
            Part::Messages => {
                "messages AS (INSERT INTO agent.messages (thread_id, run_id, source, kind, content, metadata) \
                 SELECT $1, $5, s, k, c, m \
                 FROM unnest(#1::text[], #2::text[], #3::text[], #4::jsonb[]) WITH ORDINALITY \
                   AS u(s, k, c, m, o) \
                 WHERE EXISTS (SELECT 1 FROM fenced) ORDER BY o)"
            }
            Part::Patch => {
                "patch AS (UPDATE agent.runs SET state = COALESCE(#1::text, state), \
                   model = COALESCE(#2::text, model), usage = COALESCE(#3::jsonb, usage), \
                   iterations = COALESCE(#4::integer, iterations), error = COALESCE(#5::text, error), \
                   failure_kind = COALESCE(#6::text, failure_kind), summary = COALESCE(#7::text, summary), \
                   started_at = COALESCE(#8::timestamptz, started_at), \
                   finished_at = COALESCE(#9::timestamptz, finished_at), \
                   prompt_sections = COALESCE(#10::jsonb, prompt_sections), \
                   system_prompt = COALESCE(#11::text, system_prompt), \
                   last_event_seq = GREATEST(last_event_seq, COALESCE(#12::bigint, 0)) \
                 WHERE id = $5 AND (#13::text IS NULL OR state = #13::text) \
                   AND EXISTS (SELECT 1 FROM fenced))"
            }
            Part::Approval => {
                "approval AS (INSERT INTO agent.approvals (id, run_id, thread_id, owner, call_id, tool, \
                   arguments, args_sha256, preview, reason, state, created_at, expires_at, binding, \
                   tainted_by, allowed_tools) \
                 SELECT #1::text, #2::text, #3::text, #4::text, #5::text, #6::text, #7::jsonb, #8::text, \
                   #9::text, #10::text, #11::text, #12::timestamptz, #13::timestamptz, #14::text, \
                   #15::text[], #16::text[] \
                 WHERE EXISTS (SELECT 1 FROM fenced))"
            }
            Part::Audit => {
                "audit AS (INSERT INTO agent.audit (owner, kind, run_id, detail) \
                 SELECT r.owner, k, r.id, d FROM agent.runs r, \
                   unnest(#1::text[], #2::jsonb[]) WITH ORDINALITY AS u(k, d, o) \
                 WHERE r.id = $5 AND EXISTS (SELECT 1 FROM fenced) ORDER BY o)"
            }
        }
    }

    /// How many parameters of its own the part binds, in its CTE's `#n` order.
    pub(super) fn arity(self) -> usize {
        match self {
            Part::Events => 2,
            Part::History => 1,
            Part::Actions => 12,
            Part::Messages => 4,
            Part::Patch => 13,
            Part::Approval => 16,
            Part::Audit => 2,
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The parameters every commit binds first, in this order: the thread id, the lease token,
/// whether to touch the thread (messages arrived), whether to release the lease, the run id,
/// whether the run has read external content (marked on the thread). Their types are given
/// when the statement is prepared, so a combination that reads none of the run's rows (only
/// history, say) still knows what `$5` is.
pub(super) const SHARED: [tokio_postgres::types::Type; 6] = {
    use tokio_postgres::types::Type;
    [
        Type::TEXT,
        Type::TEXT,
        Type::BOOL,
        Type::BOOL,
        Type::TEXT,
        Type::BOOL,
    ]
};

/// The writer's fence: the thread row, locked, still this lease's and unexpired. It also
/// touches the thread when messages arrive and frees the lease when the run ends or pauses.
const FENCE: &str = "WITH fenced AS (UPDATE agent.threads \
      SET updated_at = CASE WHEN $3 THEN now() ELSE updated_at END, \
      lock_run_id = CASE WHEN $4 THEN NULL ELSE lock_run_id END, \
      lock_token = CASE WHEN $4 THEN NULL ELSE lock_token END, \
      lock_expires_at = CASE WHEN $4 THEN NULL ELSE lock_expires_at END, \
      read_external = read_external OR $6 \
    WHERE id = $1 AND lock_token = $2 AND lock_expires_at > clock_timestamp() RETURNING 1)";
/// When the lease is not live the statement raises `LEASE_LOST` (`agent.lease_lost()`,
/// migration V11) and nothing of it stays.
const VERDICT: &str =
    " SELECT CASE WHEN EXISTS (SELECT 1 FROM fenced) THEN 1 ELSE agent.lease_lost() END";

/// The parts one commit holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Parts(u8);

impl Parts {
    pub(super) fn with(&mut self, part: Part) {
        self.0 |= part.bit();
    }

    pub(super) fn has(self, part: Part) -> bool {
        self.0 & part.bit() != 0
    }

    /// How many parameters the statement binds: the shared ones, then each part's own.
    pub(super) fn arity(self) -> usize {
        SHARED.len()
            + Part::ALL
                .iter()
                .filter(|p| self.has(**p))
                .map(|p| p.arity())
                .sum::<usize>()
    }

    /// The statement for these parts, built on first use.
    pub(super) fn sql(self) -> &'static str {
        static BUILT: [OnceLock<String>; 1 << Part::ALL.len()] =
            [const { OnceLock::new() }; 1 << Part::ALL.len()];
        BUILT[self.0 as usize].get_or_init(|| self.build())
    }

    fn build(self) -> String {
        let mut sql = String::from(FENCE);
        let mut bound = SHARED.len();
        for part in Part::ALL.into_iter().filter(|p| self.has(*p)) {
            sql.push_str(", ");
            number(&mut sql, part.cte(), bound);
            bound += part.arity();
        }
        sql.push_str(VERDICT);
        sql
    }
}

/// Appends `cte` to `sql` with each `#n` written as `$(base + n)`.
fn number(sql: &mut String, cte: &str, base: usize) {
    let mut rest = cte;
    while let Some(at) = rest.find('#') {
        sql.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len() - at - 1);
        let n: usize = rest[at + 1..at + 1 + digits]
            .parse()
            .expect("a CTE's parameters are written #1, #2, …");
        sql.push('$');
        sql.push_str(&(base + n).to_string());
        rest = &rest[at + 1 + digits..];
    }
    sql.push_str(rest);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_part_is_numbered_after_the_shared_parameters_and_the_parts_before_it() {
        let mut parts = Parts::default();
        parts.with(Part::Events);
        parts.with(Part::Audit);
        let sql = parts.sql();
        assert!(sql.contains("unnest($7::bigint[], $8::bytea[])"), "{sql}");
        assert!(sql.contains("unnest($9::text[], $10::jsonb[])"), "{sql}");
        assert!(!sql.contains('#'), "{sql}");
        assert_eq!(parts.arity(), 10);
    }

    #[test]
    fn every_part_numbers_exactly_the_parameters_it_binds() {
        for part in Part::ALL {
            // Numbered from 100, the part's own parameters stand apart from the shared $1..$6.
            let mut sql = String::new();
            number(&mut sql, part.cte(), 100);
            let highest = (1..=20)
                .filter(|n| sql.contains(&format!("${}", 100 + n)))
                .max();
            assert_eq!(highest, Some(part.arity()), "{part:?}: {sql}");
        }
    }

    #[test]
    fn a_commit_of_nothing_is_only_the_fence() {
        let sql = Parts::default().sql();
        assert!(sql.starts_with("WITH fenced AS"));
        assert!(sql.ends_with("agent.lease_lost() END"));
        assert_eq!(Parts::default().arity(), SHARED.len());
    }
}
