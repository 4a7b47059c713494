//! The embedded store: process memory, for local runs and tests with no database. It keeps the
//! same rules as PostgreSQL (fenced leases, compare-and-set transitions, one lock for each
//! command so every command is atomic), so the shared suite holds for both.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Mutex,
    time::{Duration, Instant, SystemTime},
};

use serde_json::Value;

use super::{
    Action, Admission, Admitted, AgentStore, Approval, ApprovalState, Archive, Decided, Ending,
    Lease, LockOutcome, Message, MessageKind, MessageSource, ModelUsage, Occurrence, Run,
    RunCommit, RunPatch, RunState, RunUsage, Schedule, ScheduleOutcome, Settle, StoreError, Tally,
    TaskAgent, TaskSettle, Thread, ThreadCursor, TurnJson, UsageSummary, carries_external,
    transcript_text,
};

/// A thread's lease: holder run, fencing token, expiry on the monotonic clock.
#[derive(Clone)]
struct Held {
    run_id: String,
    token: String,
    until: Instant,
}

struct ThreadRow {
    thread: Thread,
    lease: Option<Held>,
    /// A run of the current session read external content (cleared by its archive).
    read_external: bool,
    /// Until when an idle-session sweep is summarising the thread.
    archive_claimed_until: Option<Instant>,
}

impl ThreadRow {
    fn live_lease(&self) -> Option<&Held> {
        self.lease.as_ref().filter(|l| l.until > Instant::now())
    }
}

/// A schedule and who holds its occurrence in progress until when (no worker: free to take
/// again at that time).
struct ScheduleRow {
    schedule: Schedule,
    holder: Option<String>,
    held_until: Option<SystemTime>,
}

impl ScheduleRow {
    fn claim(
        &mut self,
        worker: &str,
        due_at: SystemTime,
        now: SystemTime,
        hold: Duration,
    ) -> Occurrence {
        self.holder = Some(worker.to_owned());
        self.held_until = Some(now + hold);
        touch(&mut self.schedule.updated_at);
        Occurrence {
            schedule: self.schedule.clone(),
            due_at,
            attempt: self.schedule.attempts,
        }
    }
}

/// A task's claim: until when, by which worker.
type TaskClaim = (SystemTime, String);

/// Whether the attempt `task` is, claimed by `worker`, still holds `row` (the claim's fence:
/// worker and attempt number, as on PostgreSQL — numbers repeat after an attempt that did not
/// count).
fn holds(row: &TaskAgent, claimed: &Option<TaskClaim>, task: &TaskAgent, worker: &str) -> bool {
    row.id == task.id
        && row.state == "running"
        && row.attempts == task.attempts
        && claimed.as_ref().is_some_and(|(_, w)| w == worker)
}

/// Moves a row's `updated_at` on, always forward: UpdateSchedule's fence is this value.
fn touch(updated_at: &mut SystemTime) {
    *updated_at = SystemTime::now().max(*updated_at + Duration::from_micros(1));
}

/// A new thread's row, unlocked.
fn new_thread(id: &str, owner: &str, title: &str) -> ThreadRow {
    let now = SystemTime::now();
    ThreadRow {
        thread: Thread {
            id: id.to_owned(),
            owner: owner.to_owned(),
            title: title.to_owned(),
            created_at: now,
            updated_at: now,
            active_run_id: None,
            last_run_id: None,
        },
        lease: None,
        archive_claimed_until: None,
        read_external: false,
    }
}

#[derive(Default)]
struct State {
    threads: HashMap<String, ThreadRow>,
    messages: Vec<Message>,
    /// Each thread's LLM history, a turn's JSON as text: as a `Value` a turn of a few hundred
    /// bytes took several KiB (a map node per object), kept for every thread the process has
    /// seen (issue 13: agent RSS after a second wave of runs).
    history: HashMap<String, Vec<TurnJson>>,
    runs: HashMap<String, Run>,
    events: HashMap<String, BTreeMap<u64, Vec<u8>>>,
    /// Runs whose events were thinned to their last (RUN_EVENTS_RETENTION).
    events_pruned: std::collections::HashSet<String>,
    approvals: HashMap<String, Approval>,
    actions: Vec<Action>,
    archives: Vec<(String, Archive, String)>,
    /// (owner, when, cost) of each summary model call (E-10).
    summaries_spent: Vec<(String, SystemTime, RunUsage)>,
    /// A task, when it is next due, and its claim.
    tasks: Vec<(TaskAgent, SystemTime, Option<TaskClaim>)>,
    schedules: Vec<ScheduleRow>,
    audit: Vec<(String, String, Value)>,
    // Indexes, so that a long-lived process (this is the embedded default) does not scan
    // every run and action it ever had for each new one.
    /// (owner, request id) → run id.
    by_request: HashMap<(String, String), String>,
    /// Per owner and per thread: the runs that were not terminal when last looked at. A
    /// terminal run never changes state again, so it is dropped when next met.
    open_by_owner: HashMap<String, Vec<String>>,
    open_by_thread: HashMap<String, Vec<String>>,
    /// Where each action is in `actions`.
    action_at: HashMap<String, usize>,
}

/// History turns as stored (JSON text) back as values.
fn parse_turns(turns: &[TurnJson]) -> Result<Vec<Value>, StoreError> {
    turns
        .iter()
        .map(|t| {
            serde_json::from_str(t)
                .map_err(|e| StoreError::Corrupt(format!("a history turn is not JSON: {e}")))
        })
        .collect()
}

/// The runs listed under `key` in `index` that are not terminal (dropping those that are).
fn open_runs<'a>(
    runs: &'a HashMap<String, Run>,
    index: &mut HashMap<String, Vec<String>>,
    key: &str,
) -> Vec<&'a Run> {
    let Some(ids) = index.get_mut(key) else {
        return Vec::new();
    };
    ids.retain(|id| runs.get(id).is_some_and(|r| !r.state.is_terminal()));
    ids.iter().filter_map(|id| runs.get(id)).collect()
}

impl State {
    fn insert_thread(&mut self, row: ThreadRow) -> Result<(), StoreError> {
        let id = row.thread.id.clone();
        if self.threads.contains_key(&id) {
            return Err(StoreError::Conflict(format!("thread {id}")));
        }
        self.threads.insert(id, row);
        Ok(())
    }

    fn recent_summaries(&self, owner: &str, limit: usize) -> Vec<Archive> {
        self.archives
            .iter()
            .rev()
            .filter(|(o, _, _)| o == owner)
            .take(limit)
            .map(|(_, a, _)| a.clone())
            .collect()
    }

    /// The thread's runs waiting for an approval.
    fn paused_in(&mut self, thread_id: &str) -> Vec<String> {
        open_runs(&self.runs, &mut self.open_by_thread, thread_id)
            .into_iter()
            .filter(|r| r.state == RunState::AwaitingConfirmation)
            .map(|r| r.id.clone())
            .collect()
    }

    fn fenced(&self, lease: &Lease) -> Result<(), StoreError> {
        match self
            .threads
            .get(&lease.thread_id)
            .and_then(ThreadRow::live_lease)
        {
            Some(h) if h.token == lease.token && h.run_id == lease.run_id => Ok(()),
            _ => Err(StoreError::LeaseLost),
        }
    }

    fn add_message(
        &mut self,
        thread_id: &str,
        run_id: Option<&str>,
        source: MessageSource,
        kind: MessageKind,
        content: &str,
        metadata: Value,
    ) -> Message {
        let message = Message {
            id: self.messages.len() as i64 + 1,
            thread_id: thread_id.to_owned(),
            run_id: run_id.map(str::to_owned),
            source,
            kind,
            content: content.to_owned(),
            metadata,
            created_at: SystemTime::now(),
        };
        self.messages.push(message.clone());
        if let Some(t) = self.threads.get_mut(thread_id) {
            t.thread.updated_at = message.created_at;
        }
        message
    }

    fn push_event(&mut self, run_id: &str, seq: u64, payload: Vec<u8>) {
        self.events
            .entry(run_id.to_owned())
            .or_default()
            .insert(seq, payload);
        if let Some(run) = self.runs.get_mut(run_id) {
            run.last_event_seq = run.last_event_seq.max(seq);
        }
    }

    /// Ends `run_id` with `ending` if it is in one of `from`; true when it did.
    fn end_run(&mut self, run_id: &str, from: &[RunState], ending: &Ending) -> bool {
        let Some(run) = self.runs.get_mut(run_id) else {
            return false;
        };
        if !from.contains(&run.state) {
            return false;
        }
        run.state = ending.state;
        run.error = Some(ending.error.clone());
        run.failure_kind = Some(ending.failure_kind.clone());
        run.finished_at = Some(SystemTime::now());
        run.cancel_requested |= ending.state == RunState::Cancelled;
        let seq = run.last_event_seq + ending.seq_gap.max(1);
        let thread_id = run.thread_id.clone();
        self.push_event(run_id, seq, ending.event.clone());
        for a in self.approvals.values_mut() {
            if a.run_id == run_id && a.state == ApprovalState::Pending {
                a.state = ApprovalState::Expired;
            }
        }
        if let Some(message) = &ending.message {
            self.add_message(
                &thread_id,
                Some(run_id),
                MessageSource::Error,
                MessageKind::Text,
                message,
                Value::Object(Default::default()),
            );
        }
        true
    }
}

#[derive(Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> Result<T, StoreError> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| StoreError::Unavailable("in-memory store lock poisoned".into()))?;
        Ok(f(&mut state))
    }
}

fn patch_run(run: &mut Run, p: RunPatch) {
    if let Some(v) = p.state {
        run.state = v;
    }
    if let Some(v) = p.model {
        run.model = v;
    }
    if let Some(v) = p.usage {
        run.usage = v;
    }
    if let Some(v) = p.iterations {
        run.iterations = v;
    }
    if let Some(v) = p.error {
        run.error = Some(v);
    }
    if let Some(v) = p.failure_kind {
        run.failure_kind = Some(v);
    }
    if let Some(v) = p.summary {
        run.summary = v;
    }
    if let Some(v) = p.started_at {
        run.started_at = Some(v);
    }
    if let Some(v) = p.finished_at {
        run.finished_at = Some(v);
    }
    if let Some(v) = p.prompt_sections {
        run.prompt_sections = v;
    }
    if let Some(v) = p.system_prompt {
        run.system_prompt = v;
    }
}

#[async_trait::async_trait]
impl AgentStore for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn create_thread(
        &self,
        id: &str,
        owner: &str,
        title: &str,
    ) -> Result<Thread, StoreError> {
        let row = new_thread(id, owner, title);
        let thread = row.thread.clone();
        self.with(|s| s.insert_thread(row).map(|()| thread))?
    }

    async fn get_thread(&self, owner: &str, id: &str) -> Result<Option<Thread>, StoreError> {
        self.with(|s| {
            s.threads
                .get(id)
                .filter(|row| row.thread.owner == owner)
                .map(|row| {
                    let mut t = row.thread.clone();
                    t.active_run_id = row.live_lease().map(|l| l.run_id.clone());
                    t
                })
        })
    }

    async fn list_threads(
        &self,
        owner: &str,
        after: Option<&ThreadCursor>,
        limit: usize,
    ) -> Result<Vec<Thread>, StoreError> {
        self.with(|s| {
            let mut mine: Vec<Thread> = s
                .threads
                .values()
                .filter(|row| row.thread.owner == owner)
                .filter(|row| after.is_none_or(|c| c.precedes(&row.thread)))
                .map(|row| {
                    let mut t = row.thread.clone();
                    t.active_run_id = row.live_lease().map(|l| l.run_id.clone());
                    t
                })
                .collect();
            mine.sort_by(|a, b| b.updated_at.cmp(&a.updated_at).then(a.id.cmp(&b.id)));
            mine.into_iter().take(limit).collect()
        })
    }

    async fn latest_thread_except(
        &self,
        owner: &str,
        skip_prefixes: &[&str],
    ) -> Result<Option<Thread>, StoreError> {
        self.with(|s| {
            s.threads
                .values()
                .filter(|row| row.thread.owner == owner)
                .filter(|row| !skip_prefixes.iter().any(|p| row.thread.id.starts_with(p)))
                .min_by(|a, b| {
                    b.thread
                        .updated_at
                        .cmp(&a.thread.updated_at)
                        .then(a.thread.id.cmp(&b.thread.id))
                })
                .map(|row| {
                    let mut t = row.thread.clone();
                    t.active_run_id = row.live_lease().map(|l| l.run_id.clone());
                    t
                })
        })
    }

    async fn admit(&self, a: &Admission) -> Result<Admitted, StoreError> {
        self.with(|s| {
            let run = &a.run;
            if let Some(key) = &run.request_id
                && let Some(existing) = s
                    .by_request
                    .get(&(run.owner.clone(), key.clone()))
                    .and_then(|id| s.runs.get(id))
            {
                return Ok(Admitted::Duplicate {
                    run_id: existing.id.clone(),
                    thread_id: existing.thread_id.clone(),
                });
            }
            let active = open_runs(&s.runs, &mut s.open_by_owner, &run.owner)
                .into_iter()
                .filter(|r| r.state.is_live())
                .count() as u32;
            if active >= a.max_active_runs {
                return Ok(Admitted::TooManyRuns { active });
            }
            let now = SystemTime::now();
            match &a.new_thread_title {
                Some(title) => {
                    if s.threads.contains_key(&run.thread_id) {
                        return Err(StoreError::Conflict(format!("thread {}", run.thread_id)));
                    }
                    s.threads.insert(
                        run.thread_id.clone(),
                        new_thread(&run.thread_id, &run.owner, title),
                    );
                }
                None => {
                    let row = s
                        .threads
                        .get(&run.thread_id)
                        .filter(|row| row.thread.owner == run.owner)
                        .ok_or_else(|| StoreError::NotFound(format!("thread {}", run.thread_id)))?;
                    if let Some(held) = row.live_lease() {
                        return Ok(Admitted::Busy {
                            run_id: held.run_id.clone(),
                        });
                    }
                }
            }
            if !a.supersede_paused
                && let Some(paused) = s.paused_in(&run.thread_id).into_iter().next()
            {
                return Ok(Admitted::AwaitingApproval { run_id: paused });
            }
            let lease = Lease::new(&run.thread_id, &run.id);
            let row = s.threads.get_mut(&run.thread_id).expect("checked above");
            row.lease = Some(Held {
                run_id: run.id.clone(),
                token: lease.token.clone(),
                until: Instant::now() + a.lease,
            });
            row.thread.last_run_id = Some(run.id.clone());
            row.thread.updated_at = now;
            for id in s.paused_in(&run.thread_id) {
                s.end_run(
                    &id,
                    &[RunState::AwaitingConfirmation],
                    &Ending {
                        state: RunState::Cancelled,
                        error: a.supersede_message.clone(),
                        failure_kind: "cancelled".into(),
                        event: a.supersede_event.clone(),
                        seq_gap: 1,
                        message: None,
                    },
                );
            }
            s.runs.insert(run.id.clone(), run.clone());
            if let Some(key) = &run.request_id {
                s.by_request
                    .insert((run.owner.clone(), key.clone()), run.id.clone());
            }
            s.open_by_owner
                .entry(run.owner.clone())
                .or_default()
                .push(run.id.clone());
            s.open_by_thread
                .entry(run.thread_id.clone())
                .or_default()
                .push(run.id.clone());
            if let Some(text) = &a.user_message {
                s.add_message(
                    &run.thread_id,
                    Some(&run.id),
                    MessageSource::User,
                    MessageKind::Text,
                    text,
                    Value::Object(Default::default()),
                );
            }
            s.push_event(&run.id, 1, a.first_event.clone());
            Ok(Admitted::Started {
                lease,
                summaries: s.recent_summaries(&run.owner, a.summaries),
            })
        })?
    }

    async fn lock_thread(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<LockOutcome, StoreError> {
        self.with(|s| {
            let Some(row) = s.threads.get_mut(thread_id) else {
                return Err(StoreError::NotFound(format!("thread {thread_id}")));
            };
            if let Some(held) = row.live_lease() {
                return Ok(LockOutcome::Busy {
                    run_id: held.run_id.clone(),
                });
            }
            let taken = Lease::new(thread_id, run_id);
            row.lease = Some(Held {
                run_id: run_id.to_owned(),
                token: taken.token.clone(),
                until: Instant::now() + lease,
            });
            row.thread.last_run_id = Some(run_id.to_owned());
            Ok(LockOutcome::Acquired(taken))
        })?
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Option<bool>, StoreError> {
        self.with(|s| {
            if s.fenced(lease).is_err() {
                return None;
            }
            if let Some(held) = s
                .threads
                .get_mut(&lease.thread_id)
                .and_then(|row| row.lease.as_mut())
            {
                held.until = Instant::now() + ttl;
            }
            Some(
                s.runs
                    .get(&lease.run_id)
                    .is_some_and(|r| r.cancel_requested),
            )
        })
    }

    async fn release_lease(&self, lease: &Lease) -> Result<(), StoreError> {
        self.with(|s| {
            if let Some(row) = s.threads.get_mut(&lease.thread_id)
                && row.lease.as_ref().is_some_and(|h| h.token == lease.token)
            {
                row.lease = None;
            }
        })
    }

    async fn commit(&self, lease: &Lease, mut c: RunCommit) -> Result<(), StoreError> {
        let history = std::mem::take(&mut c.history);
        // Refused as PostgreSQL's jsonb cast refuses it: a turn kept here is readable later.
        for turn in &history {
            serde_json::from_str::<serde::de::IgnoredAny>(turn).map_err(|e| {
                StoreError::Corrupt(format!("a history turn to commit is not JSON: {e}"))
            })?;
        }
        self.with(|s| {
            s.fenced(lease)?;
            let run_id = &lease.run_id;
            for (seq, payload) in c.events {
                s.push_event(run_id, seq, payload);
            }
            if !history.is_empty() {
                s.history
                    .entry(lease.thread_id.clone())
                    .or_default()
                    .extend(history);
            }
            for action in c.actions {
                match s.action_at.get(&action.id) {
                    Some(&at) => s.actions[at] = action,
                    None => {
                        s.action_at.insert(action.id.clone(), s.actions.len());
                        s.actions.push(action);
                    }
                }
            }
            for m in c.messages {
                s.add_message(
                    &lease.thread_id,
                    Some(run_id),
                    m.source,
                    m.kind,
                    &m.content,
                    m.metadata,
                );
            }
            let owner = s.runs.get(run_id).map(|r| r.owner.clone());
            if c.read_external
                && let Some(t) = s.threads.get_mut(&lease.thread_id)
            {
                t.read_external = true;
            }
            if let Some(run) = s.runs.get_mut(run_id)
                && c.patch.expect.is_none_or(|e| e == run.state)
            {
                patch_run(run, c.patch);
            }
            if let Some(approval) = c.approval {
                s.approvals.insert(approval.id.clone(), approval);
            }
            if let Some(owner) = owner {
                for (kind, detail) in c.audit {
                    s.audit.push((owner.clone(), kind, detail));
                }
            }
            if c.release
                && let Some(row) = s.threads.get_mut(&lease.thread_id)
            {
                row.lease = None;
            }
            Ok(())
        })?
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
        self.with(|s| {
            s.fenced(lease)?;
            let approval = s
                .approvals
                .get(approval_id)
                .cloned()
                .ok_or_else(|| StoreError::NotFound(format!("approval {approval_id}")))?;
            let run_state = s
                .runs
                .get(&approval.run_id)
                .map(|r| r.state)
                .ok_or_else(|| StoreError::NotFound(format!("run {}", approval.run_id)))?;
            let usable = approval.state == ApprovalState::Pending
                && approval.expires_at > SystemTime::now()
                && run_state == RunState::AwaitingConfirmation
                && approval.run_id == lease.run_id;
            if !usable {
                return Ok(Decided::Lost {
                    approval,
                    run_state,
                });
            }
            let active = open_runs(&s.runs, &mut s.open_by_owner, &approval.owner)
                .into_iter()
                .filter(|r| r.state.is_live())
                .count() as u32;
            if active >= max_active_runs {
                return Ok(Decided::TooManyRuns { active });
            }
            let a = s.approvals.get_mut(approval_id).expect("read above");
            a.state = wanted;
            a.decided_by = Some(decider.to_owned());
            a.decided_at = Some(SystemTime::now());
            let approval = a.clone();
            let run = s.runs.get_mut(&approval.run_id).expect("read above");
            run.state = RunState::Executing;
            let last_event_seq = run.last_event_seq;
            s.audit.push((
                approval.owner.clone(),
                audit_kind.to_owned(),
                serde_json::json!({"approval_id": approval.id, "tool": approval.tool}),
            ));
            Ok(Decided::Won {
                approval,
                last_event_seq,
            })
        })?
    }

    async fn end_paused(&self, run_id: &str, ending: &Ending) -> Result<bool, StoreError> {
        self.with(|s| s.end_run(run_id, &[RunState::AwaitingConfirmation], ending))
    }

    async fn abandoned_runs(&self, grace: Duration, limit: usize) -> Result<Vec<Run>, StoreError> {
        let now = Instant::now();
        self.with(|s| {
            s.runs
                .values()
                .filter(|r| r.state.is_live())
                .filter(|r| {
                    s.threads
                        .get(&r.thread_id)
                        .and_then(|row| row.lease.as_ref())
                        .is_none_or(|h| h.run_id != r.id || h.until + grace <= now)
                })
                .take(limit)
                .cloned()
                .collect()
        })
    }

    async fn end_abandoned(&self, run_id: &str, ending: &Ending) -> Result<bool, StoreError> {
        self.with(|s| {
            let Some(thread_id) = s.runs.get(run_id).map(|r| r.thread_id.clone()) else {
                return false;
            };
            let held_by_run = s
                .threads
                .get(&thread_id)
                .and_then(|row| row.lease.as_ref())
                .is_some_and(|h| h.run_id == run_id);
            let live = s
                .threads
                .get(&thread_id)
                .and_then(ThreadRow::live_lease)
                .is_some_and(|h| h.run_id == run_id);
            let chosen_for = s
                .runs
                .get(run_id)
                .is_some_and(|r| r.cancel_requested == (ending.state == RunState::Cancelled));
            if live || !chosen_for {
                return false;
            }
            let ended = s.end_run(
                run_id,
                &[RunState::Queued, RunState::Planning, RunState::Executing],
                ending,
            );
            if ended
                && held_by_run
                && let Some(row) = s.threads.get_mut(&thread_id)
            {
                row.lease = None;
            }
            ended
        })
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
        self.with(|s| s.add_message(thread_id, run_id, source, kind, content, metadata))
    }

    async fn list_messages(
        &self,
        thread_id: &str,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        self.with(|s| {
            s.messages
                .iter()
                .filter(|m| m.thread_id == thread_id)
                .skip(offset)
                .take(limit)
                .cloned()
                .collect()
        })
    }

    async fn history(&self, thread_id: &str) -> Result<Vec<TurnJson>, StoreError> {
        self.with(|s| s.history.get(thread_id).cloned().unwrap_or_default())
    }

    async fn get_run(&self, owner: &str, run_id: &str) -> Result<Option<Run>, StoreError> {
        self.with(|s| s.runs.get(run_id).filter(|r| r.owner == owner).cloned())
    }

    async fn find_run_by_request(
        &self,
        owner: &str,
        request_id: &str,
    ) -> Result<Option<Run>, StoreError> {
        self.with(|s| {
            s.by_request
                .get(&(owner.to_owned(), request_id.to_owned()))
                .and_then(|id| s.runs.get(id))
                .cloned()
        })
    }

    async fn request_cancel(&self, run_id: &str, reason: Option<&str>) -> Result<bool, StoreError> {
        self.with(|s| match s.runs.get_mut(run_id) {
            Some(run) if run.state.is_live() => {
                run.cancel_requested = true;
                if run.cancel_reason.is_none() {
                    run.cancel_reason = reason.map(str::to_owned);
                }
                true
            }
            _ => false,
        })
    }

    async fn prune_run_events(
        &self,
        ended_before: SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError> {
        self.with(|s| {
            let State {
                runs,
                events,
                events_pruned,
                ..
            } = s;
            let mut due: Vec<(SystemTime, &String)> = runs
                .iter()
                .filter(|(id, run)| run.state.is_terminal() && !events_pruned.contains(*id))
                .filter_map(|(id, run)| run.finished_at.filter(|t| *t < ended_before).zip(Some(id)))
                .collect();
            due.sort();
            due.truncate(limit);
            for (_, id) in &due {
                if let Some(kept) = events.get_mut(*id)
                    && let Some(last) = kept.pop_last()
                {
                    kept.clear();
                    kept.insert(last.0, last.1);
                }
                events_pruned.insert((*id).clone());
            }
            due.len()
        })
    }

    async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        self.with(|s| {
            s.events
                .get(run_id)
                .map(|events| {
                    events
                        .range(after + 1..)
                        .take(limit)
                        .map(|(seq, e)| (*seq, e.clone()))
                        .collect()
                })
                .unwrap_or_default()
        })
    }

    async fn archive_history(
        &self,
        thread_id: &str,
        owner: &str,
        summary: &str,
        ending: &Ending,
        holder: Option<&Lease>,
        idle_before: Option<SystemTime>,
    ) -> Result<Option<Archive>, StoreError> {
        self.with(|s| {
            let row = s.threads.get(thread_id);
            if row
                .and_then(ThreadRow::live_lease)
                .is_some_and(|h| holder.is_none_or(|l| l.token != h.token))
                || row.is_some_and(|r| idle_before.is_some_and(|b| r.thread.updated_at >= b))
            {
                return Ok(None);
            }
            let Some(turns) = s.history.get(thread_id).filter(|t| !t.is_empty()) else {
                return Ok(None);
            };
            // Read before removing: an unreadable turn leaves the history where it was.
            let turns = parse_turns(turns)?;
            s.history.remove(thread_id);
            for id in s.paused_in(thread_id) {
                s.end_run(&id, &[RunState::AwaitingConfirmation], ending);
            }
            for a in s.approvals.values_mut() {
                if a.thread_id == thread_id && a.state == ApprovalState::Pending {
                    a.state = ApprovalState::Expired;
                }
            }
            let archive = Archive {
                thread_id: thread_id.to_owned(),
                summary: summary.to_owned(),
                turn_count: turns.len() as u32,
                archived_at: SystemTime::now(),
                external: carries_external(&turns)
                    || s.threads.get(thread_id).is_some_and(|t| t.read_external),
            };
            if let Some(t) = s.threads.get_mut(thread_id) {
                t.read_external = false;
            }
            s.archives.push((
                owner.to_owned(),
                archive.clone(),
                format!("{summary}\n{}", transcript_text(&turns)).to_lowercase(),
            ));
            Ok(Some(archive))
        })?
    }

    async fn recent_summaries(
        &self,
        owner: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError> {
        self.with(|s| s.recent_summaries(owner, limit))
    }

    async fn search_archives(
        &self,
        owner: &str,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError> {
        // Like PostgreSQL's websearch query: every word must match (here as a case-insensitive
        // word prefix, a stand-in for stemming); more occurrences rank higher.
        let words: Vec<String> = query
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_lowercase)
            .collect();
        if words.is_empty() {
            return Ok(Vec::new());
        }
        self.with(|s| {
            let mut hits: Vec<(usize, Archive)> = s
                .archives
                .iter()
                .rev()
                .filter(|(o, _, _)| o == owner)
                .filter_map(|(_, a, text)| {
                    let tokens: Vec<&str> = text
                        .split(|c: char| !c.is_alphanumeric())
                        .filter(|t| !t.is_empty())
                        .collect();
                    let counts: Vec<usize> = words
                        .iter()
                        .map(|w| tokens.iter().filter(|t| t.starts_with(w.as_str())).count())
                        .collect();
                    counts
                        .iter()
                        .all(|c| *c > 0)
                        .then(|| (counts.iter().sum(), a.clone()))
                })
                .collect();
            hits.sort_by_key(|h| std::cmp::Reverse(h.0));
            hits.into_iter().take(limit).map(|(_, a)| a).collect()
        })
    }

    async fn claim_archive(&self, thread_id: &str, hold: Duration) -> Result<bool, StoreError> {
        self.with(|s| {
            let now = Instant::now();
            match s.threads.get_mut(thread_id) {
                Some(row) if row.archive_claimed_until.is_none_or(|u| u <= now) => {
                    row.archive_claimed_until = Some(now + hold);
                    true
                }
                _ => false,
            }
        })
    }

    async fn idle_threads_with_history(
        &self,
        before: SystemTime,
    ) -> Result<Vec<(String, String)>, StoreError> {
        self.with(|s| {
            s.threads
                .values()
                .filter(|row| {
                    row.thread.updated_at < before
                        && s.history.get(&row.thread.id).is_some_and(|h| !h.is_empty())
                })
                .map(|row| (row.thread.id.clone(), row.thread.owner.clone()))
                .collect()
        })
    }

    async fn enqueue_task_agent(
        &self,
        task: &TaskAgent,
        max_queued: u32,
        fence: Option<&Lease>,
    ) -> Result<bool, StoreError> {
        self.with(|s| {
            if let Some(lease) = fence {
                s.fenced(lease)?;
            }
            let open = s
                .tasks
                .iter()
                .filter(|(t, _, _)| {
                    t.owner == task.owner && (t.state == "queued" || t.state == "running")
                })
                .count() as u32;
            if open >= max_queued {
                return Ok(false);
            }
            s.tasks.push((task.clone(), SystemTime::now(), None));
            Ok(true)
        })?
    }

    async fn claim_task_agent(
        &self,
        worker: &str,
        lease: Duration,
        max_attempts: u32,
    ) -> Result<Option<TaskAgent>, StoreError> {
        let now = SystemTime::now();
        self.with(|s| {
            let (task, _, claimed) = s.tasks.iter_mut().find(|(t, next, claimed)| {
                (t.state == "queued" && *next <= now)
                    || (t.state == "running"
                        && t.attempts.saturating_sub(t.restarts) < max_attempts
                        && claimed.as_ref().is_some_and(|(c, _)| *c < now))
            })?;
            task.state = "running".into();
            task.attempts += 1;
            *claimed = Some((now + lease, worker.to_owned()));
            Some(task.clone())
        })
    }

    async fn fail_lapsed_task_agents(
        &self,
        max_attempts: u32,
        reason: &str,
    ) -> Result<usize, StoreError> {
        let now = SystemTime::now();
        self.with(|s| {
            let mut reports = Vec::new();
            for (task, _, claimed) in &mut s.tasks {
                if task.state == "running"
                    && task.attempts.saturating_sub(task.restarts) >= max_attempts
                    && claimed.as_ref().is_some_and(|(c, _)| *c < now)
                {
                    task.state = "failed".into();
                    task.last_error = Some(reason.to_owned());
                    *claimed = None;
                    reports.push((
                        task.parent_thread_id.clone(),
                        format!("Task agent could not finish ({}): {reason}", task.goal),
                        task.id.clone(),
                    ));
                }
            }
            let n = reports.len();
            for (parent, text, id) in reports {
                s.add_message(
                    &parent,
                    None,
                    MessageSource::Error,
                    MessageKind::Text,
                    &text,
                    serde_json::json!({ "task_agent_id": id }),
                );
            }
            n
        })
    }

    async fn release_task_claims(&self, worker: &str) -> Result<usize, StoreError> {
        let now = SystemTime::now();
        self.with(|s| {
            let mut n = 0;
            for (task, _, claimed) in &mut s.tasks {
                if let Some((until, w)) = claimed
                    && task.state == "running"
                    && w == worker
                {
                    *until = now - Duration::from_millis(1);
                    task.attempts -= 1;
                    n += 1;
                }
            }
            n
        })
    }

    async fn renew_task_claim(
        &self,
        task: &TaskAgent,
        worker: &str,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        let now = SystemTime::now();
        self.with(|s| {
            match s
                .tasks
                .iter_mut()
                .find(|(t, _, claimed)| holds(t, claimed, task, worker))
            {
                Some((_, _, Some((until, _)))) => {
                    *until = now + hold;
                    true
                }
                _ => false,
            }
        })
    }

    async fn settle_task_agent(
        &self,
        task: &TaskAgent,
        worker: &str,
        settle: &TaskSettle<'_>,
    ) -> Result<bool, StoreError> {
        self.with(|s| {
            let Some((held, next, claimed)) = s
                .tasks
                .iter_mut()
                .find(|(t, _, claimed)| holds(t, claimed, task, worker))
            else {
                return false;
            };
            held.state = settle.state.to_owned();
            if settle.tally == Tally::NotAnAttempt {
                held.attempts -= 1;
            } else {
                held.attempts = settle.attempt;
                held.settled_attempt = settle.attempt;
                held.restarts += u32::from(settle.tally == Tally::Restart);
            }
            held.result = settle.result.map(str::to_owned).or(held.result.take());
            held.last_error = settle.error.map(str::to_owned);
            if let Some(at) = settle.retry_at {
                *next = at;
            }
            *claimed = None;
            let parent = held.parent_thread_id.clone();
            if let Some((source, text)) = settle.report {
                s.add_message(
                    &parent,
                    None,
                    source,
                    MessageKind::Text,
                    text,
                    serde_json::json!({ "task_agent_id": task.id }),
                );
            }
            true
        })
    }

    async fn get_task_agent(&self, owner: &str, id: &str) -> Result<Option<TaskAgent>, StoreError> {
        self.with(|s| {
            s.tasks
                .iter()
                .find(|(t, _, _)| t.id == id && t.owner == owner)
                .map(|(t, _, _)| t.clone())
        })
    }

    async fn create_schedule(
        &self,
        sch: &Schedule,
        max_per_owner: u32,
        thread_title: Option<&str>,
    ) -> Result<bool, StoreError> {
        let thread = thread_title.map(|title| {
            let id = sch.thread_id.as_deref().unwrap_or_default();
            new_thread(id, &sch.owner, title)
        });
        self.with(|s| {
            let mine = s
                .schedules
                .iter()
                .filter(|r| r.schedule.owner == sch.owner)
                .count();
            if mine as u32 >= max_per_owner {
                return Ok(false);
            }
            if s.schedules.iter().any(|r| r.schedule.id == sch.id) {
                return Err(StoreError::Conflict(format!("schedule {}", sch.id)));
            }
            if let Some(row) = thread {
                s.insert_thread(row)?;
            }
            s.schedules.push(ScheduleRow {
                schedule: sch.clone(),
                holder: None,
                held_until: None,
            });
            Ok(true)
        })?
    }

    async fn get_schedule(&self, owner: &str, id: &str) -> Result<Option<Schedule>, StoreError> {
        self.with(|s| {
            s.schedules
                .iter()
                .find(|r| r.schedule.id == id && r.schedule.owner == owner)
                .map(|r| r.schedule.clone())
        })
    }

    async fn list_schedules(&self, owner: &str) -> Result<Vec<Schedule>, StoreError> {
        self.with(|s| {
            let mut mine: Vec<Schedule> = s
                .schedules
                .iter()
                .filter(|r| r.schedule.owner == owner)
                .map(|r| r.schedule.clone())
                .collect();
            mine.sort_by_key(|x| x.created_at);
            mine
        })
    }

    async fn save_schedule(&self, sch: &Schedule, reschedule: bool) -> Result<bool, StoreError> {
        self.with(|s| {
            let Some(row) = s.schedules.iter_mut().find(|r| {
                r.schedule.id == sch.id
                    && r.schedule.owner == sch.owner
                    && r.schedule.updated_at == sch.updated_at
            }) else {
                return false;
            };
            let r = &mut row.schedule;
            r.prompt = sch.prompt.clone();
            r.cron = sch.cron.clone();
            r.every = sch.every;
            r.time_zone = sch.time_zone.clone();
            r.enabled = sch.enabled;
            if reschedule {
                r.next_due_at = sch.next_due_at;
            }
            // Dropped unless held, or its run is going (held by none for a moment: its
            // follower was handed back, or lost the store).
            if !sch.enabled
                && row.holder.is_none()
                && r.last_outcome != Some(ScheduleOutcome::Running)
                && r.occurrence_at.is_some()
            {
                r.occurrence_at = None;
                r.attempts = 0;
                r.restarts = 0;
                row.held_until = None;
            }
            touch(&mut r.updated_at);
            true
        })
    }

    async fn delete_schedule(&self, owner: &str, id: &str) -> Result<bool, StoreError> {
        self.with(|s| {
            let before = s.schedules.len();
            s.schedules
                .retain(|r| !(r.schedule.id == id && r.schedule.owner == owner));
            s.schedules.len() < before
        })
    }

    async fn claim_schedule(
        &self,
        worker: &str,
        now: SystemTime,
        hold: Duration,
    ) -> Result<Option<Occurrence>, StoreError> {
        self.with(|s| {
            // An occurrence already begun is finished even if the schedule was switched off
            // meanwhile (RunScheduleNow works on a switched-off schedule too).
            let Some(row) = s
                .schedules
                .iter_mut()
                .find(|r| match r.schedule.occurrence_at {
                    None => r.schedule.enabled && r.schedule.next_due_at <= now,
                    Some(_) => r.held_until.is_none_or(|t| t <= now),
                })
            else {
                return Ok(None);
            };
            let due_at = match row.schedule.occurrence_at {
                Some(due) => due,
                None => {
                    let due = row.schedule.next_due_at;
                    let following = match row.schedule.following_due(now) {
                        Ok(t) => t,
                        Err(e) => {
                            // As on PostgreSQL: switched off with the reason, never blocking.
                            row.schedule.enabled = false;
                            row.schedule.last_outcome = Some(ScheduleOutcome::Failed);
                            row.schedule.last_error = Some(e.to_string());
                            touch(&mut row.schedule.updated_at);
                            return Err(e);
                        }
                    };
                    row.schedule.next_due_at = following;
                    row.schedule.occurrence_at = Some(due);
                    row.schedule.attempts = 1;
                    row.schedule.restarts = 0;
                    row.schedule.last_outcome = Some(ScheduleOutcome::Running);
                    row.schedule.last_fired_at = Some(now);
                    due
                }
            };
            Ok(Some(row.claim(worker, due_at, now, hold)))
        })?
    }

    async fn claim_schedule_now(
        &self,
        owner: &str,
        id: &str,
        worker: &str,
        now: SystemTime,
        hold: Duration,
    ) -> Result<Option<Occurrence>, StoreError> {
        self.with(|s| {
            let Some(row) = s
                .schedules
                .iter_mut()
                .find(|r| r.schedule.id == id && r.schedule.owner == owner)
            else {
                return Ok(None);
            };
            if row.schedule.occurrence_at.is_some() {
                return Err(StoreError::Conflict(format!(
                    "an occurrence of schedule {id} (run {})",
                    row.schedule
                        .last_run_id
                        .as_deref()
                        .unwrap_or("not started yet")
                )));
            }
            row.schedule.occurrence_at = Some(now);
            row.schedule.attempts = 1;
            row.schedule.restarts = 0;
            row.schedule.last_outcome = Some(ScheduleOutcome::Running);
            row.schedule.last_fired_at = Some(now);
            Ok(Some(row.claim(worker, now, now, hold)))
        })?
    }

    async fn release_schedule_holds(&self, worker: &str) -> Result<usize, StoreError> {
        let prefix = format!("{worker}/");
        self.with(|s| {
            let mut n = 0;
            for row in &mut s.schedules {
                if row.schedule.occurrence_at.is_some()
                    && row.holder.as_ref().is_some_and(|h| h.starts_with(&prefix))
                {
                    row.holder = None;
                    row.held_until = Some(SystemTime::UNIX_EPOCH);
                    touch(&mut row.schedule.updated_at);
                    n += 1;
                }
            }
            n
        })
    }

    async fn settle_schedule(
        &self,
        occurrence: &Occurrence,
        worker: &str,
        settle: &Settle,
    ) -> Result<bool, StoreError> {
        self.with(|s| {
            let Some(row) = s.schedules.iter_mut().find(|r| {
                r.schedule.id == occurrence.schedule.id
                    && r.schedule.occurrence_at == Some(occurrence.due_at)
                    && r.holder.as_deref() == Some(worker)
            }) else {
                return false;
            };
            let sch = &mut row.schedule;
            match settle {
                Settle::Running { run_id, until } => {
                    sch.last_run_id = Some(run_id.clone());
                    sch.last_outcome = Some(ScheduleOutcome::Running);
                    sch.last_error = None;
                    row.held_until = Some(*until);
                }
                Settle::Again {
                    outcome,
                    tally,
                    run_id,
                    error,
                    at,
                } => {
                    sch.attempts += u32::from(*tally != Tally::NotAnAttempt);
                    sch.restarts += u32::from(*tally == Tally::Restart);
                    sch.last_outcome = Some(*outcome);
                    sch.last_run_id = run_id.clone().or(sch.last_run_id.take());
                    sch.last_error = error.clone();
                    row.holder = None;
                    row.held_until = Some(*at);
                }
                Settle::Done {
                    outcome,
                    run_id,
                    error,
                } => {
                    sch.last_outcome = Some(*outcome);
                    sch.last_run_id = run_id.clone().or(sch.last_run_id.take());
                    sch.last_error = error.clone();
                    sch.occurrence_at = None;
                    sch.attempts = 0;
                    sch.restarts = 0;
                    row.holder = None;
                    row.held_until = None;
                }
            }
            touch(&mut sch.updated_at);
            true
        })
    }

    async fn record_summary_spend(&self, owner: &str, spent: &RunUsage) -> Result<(), StoreError> {
        self.with(|s| {
            s.summaries_spent
                .push((owner.to_owned(), SystemTime::now(), spent.clone()));
        })
    }

    async fn usage(
        &self,
        owner: &str,
        since: SystemTime,
        until: SystemTime,
    ) -> Result<UsageSummary, StoreError> {
        self.with(|s| {
            let window = since..until;
            let runs: Vec<&RunUsage> = s
                .runs
                .values()
                .filter(|r| r.owner == owner && window.contains(&r.created_at))
                .map(|r| &r.usage)
                .collect();
            let summaries: Vec<&RunUsage> = s
                .summaries_spent
                .iter()
                .filter(|(o, at, _)| o == owner && window.contains(at))
                .map(|(_, _, spent)| spent)
                .collect();
            let summary_calls = summaries.iter().map(|u| u.calls.len() as u64).sum();
            let calls = runs
                .iter()
                .chain(&summaries)
                .flat_map(|u| &u.calls)
                .map(ModelUsage::from);
            UsageSummary::of(runs.len() as u64, summary_calls, calls)
        })
    }

    async fn list_actions(&self, run_id: &str) -> Result<Vec<Action>, StoreError> {
        self.with(|s| {
            s.actions
                .iter()
                .filter(|a| a.run_id == run_id)
                .cloned()
                .collect()
        })
    }

    async fn actions_for_calls(&self, call_ids: &[String]) -> Result<Vec<Action>, StoreError> {
        self.with(|s| {
            s.actions
                .iter()
                .filter(|a| call_ids.contains(&a.call_id))
                .cloned()
                .collect()
        })
    }

    async fn count_pending_approvals(&self) -> Result<u64, StoreError> {
        let now = SystemTime::now();
        self.with(|s| {
            s.approvals
                .values()
                .filter(|a| a.state == ApprovalState::Pending && a.expires_at > now)
                .count() as u64
        })
    }

    async fn get_approval(&self, owner: &str, id: &str) -> Result<Option<Approval>, StoreError> {
        self.with(|s| s.approvals.get(id).filter(|a| a.owner == owner).cloned())
    }

    async fn record_audit(
        &self,
        owner: &str,
        kind: &str,
        _run_id: Option<&str>,
        detail: Value,
    ) -> Result<(), StoreError> {
        self.with(|s| s.audit.push((owner.to_owned(), kind.to_owned(), detail)))
    }

    async fn audit(&self, owner: &str) -> Result<Vec<(String, Value)>, StoreError> {
        self.with(|s| {
            s.audit
                .iter()
                .filter(|(o, _, _)| o == owner)
                .map(|(_, k, d)| (k.clone(), d.clone()))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ActionState;

    #[test]
    fn an_action_records_each_state_once() {
        let mut a = Action {
            id: "r/c".into(),
            run_id: "r".into(),
            call_id: "c".into(),
            tool: "t".into(),
            arguments: Value::Null,
            side_effect: false,
            state: ActionState::Planned,
            result_text: None,
            error_kind: None,
            approval_id: None,
            transitions: vec![ActionState::Planned],
            created_at: SystemTime::now(),
            updated_at: SystemTime::now(),
        };
        a.to(ActionState::Executing);
        a.to(ActionState::Executing);
        a.to(ActionState::Completed);
        assert_eq!(
            a.transitions,
            [
                ActionState::Planned,
                ActionState::Executing,
                ActionState::Completed
            ]
        );
    }
}
