//! agent-svc's persistence boundary. One trait, two implementations that pass one test suite
//! (S-5): [`memory::MemoryStore`], the zero-set-up default, and [`postgres::PgStore`], used
//! whenever `DATABASE_URL` is set. Nothing about a conversation lives outside the store between
//! requests (S-3): any replica can continue any thread or follow any run.
//!
//! Run events are opaque payloads here (the API encodes them); the store only numbers them.

pub mod memory;
pub mod postgres;

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    #[error("{0} was not found")]
    NotFound(String),
    /// The writer's lease expired or was taken: it must stop writing (E-11).
    #[error("the run's lease on its thread was lost")]
    LeaseLost,
    /// A stored value this build cannot read (never silently defaulted).
    #[error("stored data is unreadable: {0}")]
    Corrupt(String),
    /// A row that must be new already exists.
    #[error("{0} already exists")]
    Conflict(String),
    /// The database refused this for good: the same statement with the same data fails again
    /// (see [`svc_kit::pg::refused_for_good`]). Never retried, and never taken for the database
    /// being away: unattended work counts it as a failed attempt.
    #[error("the database refused this for good: {0}")]
    Rejected(String),
}

impl StoreError {
    pub fn unavailable(e: impl std::fmt::Display) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

impl From<svc_kit::group::Lost> for StoreError {
    fn from(e: svc_kit::group::Lost) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

impl From<svc_kit::pg::PgError> for StoreError {
    fn from(e: svc_kit::pg::PgError) -> Self {
        match e {
            svc_kit::pg::PgError::Query(e) => postgres::db(e),
            e => StoreError::Unavailable(e.to_string()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Thread {
    pub id: String,
    pub owner: String,
    pub title: String,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
    /// The run holding the execution lock, while its lease lasts.
    pub active_run_id: Option<String>,
    pub last_run_id: Option<String>,
}

/// Where a page of a user's threads starts: after this thread, in
/// [`AgentStore::list_threads`]' order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadCursor {
    pub updated_at: SystemTime,
    pub id: String,
}

impl ThreadCursor {
    /// The page after `last`, the last thread shown.
    pub fn after(last: &Thread) -> Self {
        Self {
            updated_at: last.updated_at,
            id: last.id.clone(),
        }
    }

    /// Whether `t` comes after the cursor: updated earlier, or as late with a greater id.
    pub fn precedes(&self, t: &Thread) -> bool {
        t.updated_at < self.updated_at || (t.updated_at == self.updated_at && t.id > self.id)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MessageSource {
    User,
    Agent,
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MessageKind {
    Text,
    Tool,
}

/// A user-visible message of a thread (not the model transcript).
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub id: i64,
    pub thread_id: String,
    pub run_id: Option<String>,
    pub source: MessageSource,
    pub kind: MessageKind,
    pub content: String,
    pub metadata: Value,
    pub created_at: SystemTime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunState {
    Queued,
    Planning,
    Executing,
    AwaitingConfirmation,
    Completed,
    Failed,
    Cancelled,
}

impl RunState {
    pub fn key(self) -> &'static str {
        match self {
            RunState::Queued => "queued",
            RunState::Planning => "planning",
            RunState::Executing => "executing",
            RunState::AwaitingConfirmation => "awaiting_confirmation",
            RunState::Completed => "completed",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
        }
    }

    pub fn from_key(k: &str) -> Result<Self, StoreError> {
        Ok(match k {
            "planning" => RunState::Planning,
            "executing" => RunState::Executing,
            "awaiting_confirmation" => RunState::AwaitingConfirmation,
            "completed" => RunState::Completed,
            "failed" => RunState::Failed,
            "cancelled" => RunState::Cancelled,
            "queued" => RunState::Queued,
            other => {
                return Err(StoreError::Corrupt(format!("unknown RunState {other:?}")));
            }
        })
    }

    /// Queued, planning or executing: a writer holds (or should hold) the thread's lease.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            RunState::Queued | RunState::Planning | RunState::Executing
        )
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Completed | RunState::Failed | RunState::Cancelled
        )
    }
}

/// Token and cost totals of a run, with each model call (E-10).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub cost_usd: f64,
    pub calls: Vec<ModelCallUsage>,
    /// The caller's budget for the whole run, kept with what it is measured against: a run
    /// that pauses for approval goes on under what is left of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<RunCeiling>,
    /// The model the caller chose over the chain's first (`model_override`), kept beside the
    /// calls it paid for: a run that pauses for approval goes on with the same model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_override: Option<String>,
}

/// A run's budget (RunBudget): input plus output tokens and cost over all its model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RunCeiling {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_total_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
}

impl RunCeiling {
    /// The ceiling a run given `max_total_tokens` and `max_cost_usd` runs under, if any.
    pub fn of(max_total_tokens: Option<u64>, max_cost_usd: Option<f64>) -> Option<Self> {
        (max_total_tokens.is_some() || max_cost_usd.is_some()).then_some(Self {
            max_total_tokens,
            max_cost_usd,
        })
    }

    /// What is left of it once `spent` is: (tokens, cost), none below zero.
    pub fn left(&self, spent: &RunUsage) -> (Option<u64>, Option<f64>) {
        (
            self.max_total_tokens
                .map(|max| max.saturating_sub(spent.input_tokens + spent.output_tokens)),
            self.max_cost_usd.map(|max| (max - spent.cost_usd).max(0.0)),
        )
    }
}

impl RunUsage {
    /// Adds one call to the list and the totals.
    pub fn add(&mut self, call: &crate::executor::CallRecord) {
        self.input_tokens += call.usage.input_tokens;
        self.output_tokens += call.usage.output_tokens;
        self.cached_tokens += call.usage.cached_tokens;
        self.cost_usd += call.cost_usd;
        self.calls.push(ModelCallUsage {
            provider: call.provider.clone(),
            model: call.model.clone(),
            input_tokens: call.usage.input_tokens,
            output_tokens: call.usage.output_tokens,
            cached_tokens: call.usage.cached_tokens,
            cost_usd: call.cost_usd,
            latency_ms: call.latency.as_millis() as u64,
            retries: call.retries,
            started_at_ms: call
                .started_at
                .duration_since(SystemTime::UNIX_EPOCH)
                .ok()
                .map(|d| d.as_millis() as u64),
        });
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelCallUsage {
    pub provider: String,
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub cost_usd: f64,
    pub latency_ms: u64,
    pub retries: u32,
    /// When it was sent, in milliseconds since 1970 (absent in calls recorded before it was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
}

/// What one owner's runs in a window spent, summed (E-10: usage summed per user).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageSummary {
    /// Runs created in the window, whatever their end.
    pub runs: u64,
    /// Calls of the summary model made in the window, summarising idle sessions (B-4); they
    /// are in `models` too.
    pub summaries: u64,
    /// By provider and model, the costliest first.
    pub models: Vec<ModelUsage>,
}

/// The calls to one model, summed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelUsage {
    pub provider: String,
    pub model: String,
    pub calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub cost_usd: f64,
}

impl From<&ModelCallUsage> for ModelUsage {
    /// One call, as a sum of one.
    fn from(c: &ModelCallUsage) -> Self {
        Self {
            provider: c.provider.clone(),
            model: c.model.clone(),
            calls: 1,
            input_tokens: c.input_tokens,
            output_tokens: c.output_tokens,
            cached_tokens: c.cached_tokens,
            cost_usd: c.cost_usd,
        }
    }
}

impl ModelUsage {
    fn add(&mut self, other: &ModelUsage) {
        self.calls += other.calls;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cached_tokens += other.cached_tokens;
        self.cost_usd += other.cost_usd;
    }
}

impl UsageSummary {
    /// Every model's calls together (provider and model left empty).
    pub fn total(&self) -> ModelUsage {
        let mut total = ModelUsage::default();
        for m in &self.models {
            total.add(m);
        }
        total
    }

    /// Sums `calls` into one line per model, the costliest first (ties: the most calls, then
    /// by name), as both stores report them.
    pub fn of(runs: u64, summaries: u64, calls: impl IntoIterator<Item = ModelUsage>) -> Self {
        let mut models: Vec<ModelUsage> = Vec::new();
        for c in calls {
            match models
                .iter_mut()
                .find(|m| m.provider == c.provider && m.model == c.model)
            {
                Some(m) => m.add(&c),
                None => models.push(c),
            }
        }
        models.sort_by(|a, b| {
            b.cost_usd
                .total_cmp(&a.cost_usd)
                .then(b.calls.cmp(&a.calls))
                .then_with(|| (&a.provider, &a.model).cmp(&(&b.provider, &b.model)))
        });
        Self {
            runs,
            summaries,
            models,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub id: String,
    pub thread_id: String,
    pub owner: String,
    pub request_id: Option<String>,
    pub state: RunState,
    pub channel: String,
    pub model: String,
    pub usage: RunUsage,
    pub iterations: u32,
    pub error: Option<String>,
    pub failure_kind: Option<String>,
    pub summary: String,
    pub cancel_requested: bool,
    /// What the caller of CancelRun said, if anything (the first reason given).
    pub cancel_reason: Option<String>,
    pub last_event_seq: u64,
    /// (section name, estimated tokens) of the system prompt, in order.
    pub prompt_sections: Vec<(String, u32)>,
    /// The system prompt the run was assembled with; a continuation after an approval uses it
    /// again (one assembler for every path).
    pub system_prompt: String,
    /// The IANA zone the run was started with, if any; a continuation after an approval has
    /// no caller to give it again.
    pub time_zone: Option<String>,
    pub created_at: SystemTime,
    pub started_at: Option<SystemTime>,
    pub finished_at: Option<SystemTime>,
}

impl Run {
    /// A run about to be admitted: queued, its first event (seq 1) written with it.
    pub fn queued(id: &str, thread_id: &str, owner: &str, channel: &str) -> Self {
        Self {
            id: id.to_owned(),
            thread_id: thread_id.to_owned(),
            owner: owner.to_owned(),
            request_id: None,
            state: RunState::Queued,
            channel: channel.to_owned(),
            model: String::new(),
            usage: RunUsage::default(),
            iterations: 0,
            error: None,
            failure_kind: None,
            summary: String::new(),
            cancel_requested: false,
            cancel_reason: None,
            last_event_seq: 1,
            prompt_sections: Vec::new(),
            system_prompt: String::new(),
            time_zone: None,
            created_at: SystemTime::now(),
            started_at: None,
            finished_at: None,
        }
    }
}

/// Changes to a run; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunPatch {
    pub state: Option<RunState>,
    pub model: Option<String>,
    pub usage: Option<RunUsage>,
    pub iterations: Option<u32>,
    pub error: Option<String>,
    pub failure_kind: Option<String>,
    pub summary: Option<String>,
    pub started_at: Option<SystemTime>,
    pub finished_at: Option<SystemTime>,
    pub prompt_sections: Option<Vec<(String, u32)>>,
    pub system_prompt: Option<String>,
    /// Take effect only on a run in this state (compare-and-set); other runs are untouched.
    pub expect: Option<RunState>,
}

impl RunPatch {
    /// Adds `later` on top: its fields win where set.
    pub fn merge(&mut self, later: RunPatch) {
        macro_rules! take {
            ($($f:ident),*) => { $( if later.$f.is_some() { self.$f = later.$f; } )* };
        }
        take!(
            state,
            model,
            usage,
            iterations,
            error,
            failure_kind,
            summary,
            started_at,
            finished_at,
            prompt_sections,
            system_prompt,
            expect
        );
    }
}

/// The right to write one run of a thread (E-11): taken at admission (or by the decider that
/// continues a paused run), renewed by the run's lease task, released with its terminal commit.
/// Every write of the holder is fenced by the token, so a holder that lost its lease (its
/// replica stalled past expiry) can no longer write anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub thread_id: String,
    pub run_id: String,
    pub token: String,
}

impl Lease {
    pub fn new(thread_id: &str, run_id: &str) -> Self {
        Self {
            thread_id: thread_id.to_owned(),
            run_id: run_id.to_owned(),
            token: uuid::Uuid::new_v4().to_string(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockOutcome {
    Acquired(Lease),
    /// Another run holds an unexpired lease.
    Busy {
        run_id: String,
    },
}

/// A user-visible message to add in a commit.
#[derive(Debug, Clone, PartialEq)]
pub struct NewMessage {
    pub source: MessageSource,
    pub kind: MessageKind,
    pub content: String,
    pub metadata: Value,
}

impl NewMessage {
    pub fn text(source: MessageSource, content: impl Into<String>) -> Self {
        Self {
            source,
            kind: MessageKind::Text,
            content: content.into(),
            metadata: Value::Object(Default::default()),
        }
    }
}

/// One turn of a thread's LLM history as its JSON text. A run serialises a turn once; the
/// stores keep it as text (PostgreSQL as jsonb, read back as jsonb's text of it) and refuse a
/// commit with a turn that is not JSON; only a run that reads the history parses it. Carried
/// as a `Value`, a turn was converted twice on its way in and twice on its way out (issue 13).
pub type TurnJson = Box<str>;

/// Everything a run's writer makes durable at one point of the run, in one transaction
/// (S-4): its numbered events, the LLM turns, action states, messages, the run's own fields,
/// a new approval and audit records; optionally the lease is freed in the same transaction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunCommit {
    /// (seq, encoded event), numbered by the writer, ascending.
    pub events: Vec<(u64, Vec<u8>)>,
    /// Turns appended to the thread's LLM history.
    pub history: Vec<TurnJson>,
    /// Actions as they are now (inserted, or updated with their new state recorded).
    pub actions: Vec<Action>,
    pub messages: Vec<NewMessage>,
    pub patch: RunPatch,
    pub approval: Option<Approval>,
    /// (kind, detail) audit records of the run's owner.
    pub audit: Vec<(String, Value)>,
    /// Free the thread's lease (the run ended or paused).
    pub release: bool,
    /// The run has read others' words: the thread's current session is marked so (never
    /// unmarked by a commit), and its archive records it.
    pub read_external: bool,
}

impl RunCommit {
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
            && self.history.is_empty()
            && self.actions.is_empty()
            && self.messages.is_empty()
            && self.patch == RunPatch::default()
            && self.approval.is_none()
            && self.audit.is_empty()
            && !self.release
    }
}

/// A new run and what comes with it, admitted in one transaction: the thread (created when
/// new), the lease, the queued run, the user's message (S-4) and the run's first event.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    pub run: Run,
    /// Title of a thread to create; `None` runs on the existing `run.thread_id`.
    pub new_thread_title: Option<String>,
    pub user_message: Option<String>,
    /// The encoded first event (seq 1).
    pub first_event: Vec<u8>,
    pub lease: Duration,
    /// Fair use: refuse when the owner already has this many live runs.
    pub max_active_runs: u32,
    /// Paused runs of the thread are superseded by this one: ended (cancelled) with this
    /// encoded terminal event and message, their pending approvals expired.
    pub supersede_event: Vec<u8>,
    pub supersede_message: String,
    /// False for a run nobody is waiting for (a scheduled run): a run of the thread paused for
    /// the user's approval is left alone and the admission is `AwaitingApproval` instead.
    pub supersede_paused: bool,
    /// How many of the owner's most recent session summaries to read with the admission (its
    /// prompt's [RECENT SESSIONS]), in the same transaction: one round trip fewer per run.
    /// 0 reads none (a run that archives its thread first reads them after that).
    pub summaries: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Admitted {
    Started {
        lease: Lease,
        /// The `summaries` asked for, newest first.
        summaries: Vec<Archive>,
    },
    /// Another run holds the thread.
    Busy { run_id: String },
    /// A run with this owner and request id exists already (a retried request).
    Duplicate { run_id: String, thread_id: String },
    /// The owner has `active` live runs, at or over the cap.
    TooManyRuns { active: u32 },
    /// A run of the thread waits for the user's approval and this admission may not supersede
    /// it (`supersede_paused` is false).
    AwaitingApproval { run_id: String },
}

/// The outcome of deciding an approval.
#[derive(Debug, Clone, PartialEq)]
pub enum Decided {
    /// This caller's decision was recorded and the paused run moved to executing: it, and only
    /// it, continues the run from event `last_event_seq`.
    Won {
        approval: Approval,
        last_event_seq: u64,
    },
    /// Someone else decided first, or the approval expired, or the run is no longer paused:
    /// nothing changed. The approval and run as they are now.
    Lost {
        approval: Approval,
        run_state: RunState,
    },
    /// The owner has `active` live runs, at or over the cap: nothing changed, the approval is
    /// still pending and the run still paused.
    TooManyRuns { active: u32 },
}

/// How a run that nobody will finish is ended (the monitor, CancelRun on a paused run,
/// archiving): one compare-and-set from the states it may be in, with its terminal event.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub state: RunState,
    pub error: String,
    pub failure_kind: String,
    /// The encoded terminal event.
    pub event: Vec<u8>,
    /// The terminal event's seq is last_event_seq + `seq_gap`: a dead writer may have shown
    /// watchers events it never made durable, so the gap keeps the terminal event after them.
    pub seq_gap: u64,
    /// An error message for the thread, if any.
    pub message: Option<String>,
}

#[async_trait::async_trait]
pub trait AgentStore: Send + Sync + 'static {
    fn backend(&self) -> &'static str;
    async fn ping(&self) -> Result<(), StoreError>;

    /// Creates a thread; a thread with this id already existing is an error, never overwritten.
    async fn create_thread(&self, id: &str, owner: &str, title: &str)
    -> Result<Thread, StoreError>;
    /// The thread if it exists and belongs to `owner`.
    async fn get_thread(&self, owner: &str, id: &str) -> Result<Option<Thread>, StoreError>;
    /// Most recently updated first (ties by id), from after `after` when given.
    async fn list_threads(
        &self,
        owner: &str,
        after: Option<&ThreadCursor>,
        limit: usize,
    ) -> Result<Vec<Thread>, StoreError>;

    /// The owner's most recently updated thread whose id starts with none of `skip_prefixes`
    /// (ties by id, as [`Self::list_threads`] orders them).
    async fn latest_thread_except(
        &self,
        owner: &str,
        skip_prefixes: &[&str],
    ) -> Result<Option<Thread>, StoreError>;

    /// Admits a new run (see [`Admission`]); nothing is written unless it is `Started`.
    async fn admit(&self, admission: &Admission) -> Result<Admitted, StoreError>;

    /// Takes the thread's lease for `run_id` unless an unexpired lease is held (by any run,
    /// this one included). Expiry is computed by the store's clock. Holds across replicas.
    async fn lock_thread(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<LockOutcome, StoreError>;
    /// Extends a live lease; `Ok(None)` when it was lost (expired or taken). Otherwise
    /// whether a cancel was requested for the run (from any replica).
    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<Option<bool>, StoreError>;
    async fn release_lease(&self, lease: &Lease) -> Result<(), StoreError>;

    /// Writes `commit` in one transaction if `lease` is still live; `Err(LeaseLost)` otherwise.
    /// A lease has one commit in flight at a time: its writer awaits each before the next. A
    /// commit whose future is dropped may still land, and on PostgreSQL (where commits queue
    /// for a committer) after one sent later, so a caller that drops one must not send more.
    async fn commit(&self, lease: &Lease, commit: RunCommit) -> Result<(), StoreError>;

    /// Records `wanted` on a pending, unexpired approval and moves its paused run to
    /// executing, in one transaction, fenced by `lease` (taken by the caller for that run).
    /// The run becomes live again, so the owner's cap on live runs is checked as an admission
    /// checks it: at `max_active_runs` nothing is recorded (`TooManyRuns`).
    async fn decide(
        &self,
        lease: &Lease,
        approval_id: &str,
        wanted: ApprovalState,
        decider: &str,
        audit_kind: &str,
        max_active_runs: u32,
    ) -> Result<Decided, StoreError>;

    /// Ends a run paused for approval (CancelRun): false when it was not paused.
    async fn end_paused(&self, run_id: &str, ending: &Ending) -> Result<bool, StoreError>;
    /// Runs queued, planning or executing whose thread lease has not been live for them for
    /// `grace`: their writer is gone (E-12). What the monitor ends.
    async fn abandoned_runs(&self, grace: Duration, limit: usize) -> Result<Vec<Run>, StoreError>;
    /// Ends an abandoned run unless its lease is live again or it already ended; frees the
    /// thread. False when someone else got there first. Only a run whose cancel request
    /// matches the ending (cancelled or not) is ended: a cancel that lands after the monitor
    /// chose the ending leaves the run for the next sweep.
    async fn end_abandoned(&self, run_id: &str, ending: &Ending) -> Result<bool, StoreError>;

    async fn add_message(
        &self,
        thread_id: &str,
        run_id: Option<&str>,
        source: MessageSource,
        kind: MessageKind,
        content: &str,
        metadata: Value,
    ) -> Result<Message, StoreError>;
    /// Oldest first.
    async fn list_messages(
        &self,
        thread_id: &str,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError>;

    /// The thread's model transcript, oldest first, each turn as its JSON text.
    async fn history(&self, thread_id: &str) -> Result<Vec<TurnJson>, StoreError>;

    async fn get_run(&self, owner: &str, run_id: &str) -> Result<Option<Run>, StoreError>;
    async fn find_run_by_request(
        &self,
        owner: &str,
        request_id: &str,
    ) -> Result<Option<Run>, StoreError>;
    /// Marks a live run for cancellation, keeping the first `reason` given; false when it is
    /// not live (ended or paused).
    async fn request_cancel(&self, run_id: &str, reason: Option<&str>) -> Result<bool, StoreError>;

    /// Thins the events of up to `limit` runs that ended before `ended_before` (completed,
    /// failed or cancelled) to their last one, the result, each run once; returns how many
    /// runs were thinned. A watch of such a run replays its result alone.
    async fn prune_run_events(
        &self,
        ended_before: SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError>;

    /// Events with seq > `after`, in order, at most `limit`.
    async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError>;

    /// Moves the thread's LLM history into an archive with `summary` and clears it, atomically,
    /// under the thread's row lock; paused runs of the thread end with `ending` and their
    /// approvals expire. `None` when there was nothing to archive (another sweep got there
    /// first), a run other than `holder` holds the thread, or — with `idle_before` — the thread
    /// was updated since (a session that came back to life after the sweep listed it).
    async fn archive_history(
        &self,
        thread_id: &str,
        owner: &str,
        summary: &str,
        ending: &Ending,
        holder: Option<&Lease>,
        idle_before: Option<SystemTime>,
    ) -> Result<Option<Archive>, StoreError>;
    /// The owner's most recent archive summaries, newest first.
    async fn recent_summaries(&self, owner: &str, limit: usize)
    -> Result<Vec<Archive>, StoreError>;
    /// The owner's archives matching `query` in summary or transcript, best first.
    async fn search_archives(
        &self,
        owner: &str,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError>;
    /// Claims the thread's archiving for `hold`, unless another sweep's claim is live: one
    /// replica summarises an idle session, not each of them. The claim lapses by itself.
    async fn claim_archive(&self, thread_id: &str, hold: Duration) -> Result<bool, StoreError>;
    /// Threads idle since before `before` that still have LLM history: (thread id, owner).
    async fn idle_threads_with_history(
        &self,
        before: SystemTime,
    ) -> Result<Vec<(String, String)>, StoreError>;

    /// Queues a task unless the owner already has `max_queued` queued or running; false then.
    /// With `fence` (the lease of the run whose call queues it), only while that lease is live
    /// (else `LeaseLost`, nothing queued), ordered against a takeover of the thread: the run
    /// that takes the thread over and closes the call sees the task, or it is never queued.
    async fn enqueue_task_agent(
        &self,
        task: &TaskAgent,
        max_queued: u32,
        fence: Option<&Lease>,
    ) -> Result<bool, StoreError>;
    /// Takes the next ready task (queued and due, or running with an expired claim on a try
    /// before `max_attempts` — restarts are not tries) for `worker`, exclusively across
    /// replicas, counting the attempt.
    async fn claim_task_agent(
        &self,
        worker: &str,
        lease: Duration,
        max_attempts: u32,
    ) -> Result<Option<TaskAgent>, StoreError>;
    /// Fails every task whose claim lapsed on try `max_attempts` or later — its last
    /// attempt's worker went away mid-attempt with no tries left, so a task that brings its
    /// process down is not taken again forever — and posts "Task agent could not finish (goal):
    /// `reason`" to its parent thread in the same statement. Returns how many.
    async fn fail_lapsed_task_agents(
        &self,
        max_attempts: u32,
        reason: &str,
    ) -> Result<usize, StoreError>;
    /// Hands back every task `worker` holds (its process is stopping): each claim lapses now,
    /// so another worker takes the task over at once rather than when the claim would have
    /// lapsed. The attempt does not count: a stop is not the task's failure, so a task handed
    /// back on its last attempt is taken up again, not failed as lapsed; the worker that takes
    /// it up makes the same attempt and follows the run it started, if any (that run ended
    /// interrupted by the stop, which settles as a [`Tally::Restart`]). A settle of the attempt that landed
    /// before the hand-back counts; one after it is fenced out. Returns how many.
    async fn release_task_claims(&self, worker: &str) -> Result<usize, StoreError>;
    /// Extends the claim of the attempt `task` is (fenced as `settle_task_agent` is) to `hold`
    /// from now; false when that attempt no longer holds the task.
    async fn renew_task_claim(
        &self,
        task: &TaskAgent,
        worker: &str,
        hold: Duration,
    ) -> Result<bool, StoreError>;
    /// Ends the attempt `task` is (as claimed: `worker`, and its `attempts` as the fence) as
    /// `settle` says, and posts its report to the parent thread in the same transaction. False:
    /// that attempt no longer holds the task (its claim lapsed and another took it), and
    /// nothing was written — a stale attempt can neither overwrite the task nor post twice.
    async fn settle_task_agent(
        &self,
        task: &TaskAgent,
        worker: &str,
        settle: &TaskSettle<'_>,
    ) -> Result<bool, StoreError>;
    async fn get_task_agent(&self, owner: &str, id: &str) -> Result<Option<TaskAgent>, StoreError>;

    /// Stores a new schedule unless the owner already has `max_per_owner`; false then. With
    /// `thread_title`, its thread (`s.thread_id`) is created with it, so a schedule refused at
    /// the cap leaves no thread behind.
    async fn create_schedule(
        &self,
        s: &Schedule,
        max_per_owner: u32,
        thread_title: Option<&str>,
    ) -> Result<bool, StoreError>;
    async fn get_schedule(&self, owner: &str, id: &str) -> Result<Option<Schedule>, StoreError>;
    /// Oldest first.
    async fn list_schedules(&self, owner: &str) -> Result<Vec<Schedule>, StoreError>;
    /// Writes the definition of an existing schedule (prompt, recurrence, zone, enabled) and,
    /// when `reschedule`, its next due time (otherwise a claim that moved it meanwhile stands).
    /// Switching it off drops an occurrence that is waiting (postponed or retrying) but not one
    /// whose run is in progress. Only over the schedule as `s` was read (its `updated_at`):
    /// false when it is gone or has changed since, and nothing is written.
    async fn save_schedule(&self, s: &Schedule, reschedule: bool) -> Result<bool, StoreError>;
    async fn delete_schedule(&self, owner: &str, id: &str) -> Result<bool, StoreError>;
    /// Takes the next occurrence to fire at `now`, exclusively across replicas (SKIP LOCKED):
    /// an enabled due schedule with no occurrence in progress (its next due time moves past `now`, so
    /// slots missed while nobody fired collapse into this one), or an occurrence whose hold
    /// expired (postponed, retrying, or its worker died). Held for `worker` until `now + hold`.
    async fn claim_schedule(
        &self,
        worker: &str,
        now: SystemTime,
        hold: Duration,
    ) -> Result<Option<Occurrence>, StoreError>;
    /// Starts an occurrence of the owner's schedule at `now` (RunScheduleNow). `Conflict` while
    /// another occurrence is in progress; `None` when there is no such schedule.
    async fn claim_schedule_now(
        &self,
        owner: &str,
        id: &str,
        worker: &str,
        now: SystemTime,
        hold: Duration,
    ) -> Result<Option<Occurrence>, StoreError>;
    /// Hands back every occurrence a holder of `worker` (`worker/…`) holds (its process is
    /// stopping): each can be taken over at once, whatever the claimer's clock, rather than
    /// when its hold lapses.
    async fn release_schedule_holds(&self, worker: &str) -> Result<usize, StoreError>;
    /// Records how `occurrence` went, if `worker` still holds it; false otherwise.
    async fn settle_schedule(
        &self,
        occurrence: &Occurrence,
        worker: &str,
        settle: &Settle,
    ) -> Result<bool, StoreError>;

    /// Records what a summary model call for `owner` cost (E-10), whether or not its archive
    /// is then made: the call was paid for.
    async fn record_summary_spend(&self, owner: &str, spent: &RunUsage) -> Result<(), StoreError>;

    /// What `owner`'s runs created in `[since, until)` spent, whatever their end, and the
    /// summary calls recorded in it (E-10).
    async fn usage(
        &self,
        owner: &str,
        since: SystemTime,
        until: SystemTime,
    ) -> Result<UsageSummary, StoreError>;

    /// A run's actions, oldest first.
    async fn list_actions(&self, run_id: &str) -> Result<Vec<Action>, StoreError>;
    /// The actions of these call ids, whatever run made them (call ids are unique).
    async fn actions_for_calls(&self, call_ids: &[String]) -> Result<Vec<Action>, StoreError>;

    /// Approvals still waiting for a decision (pending and unexpired), across every owner.
    async fn count_pending_approvals(&self) -> Result<u64, StoreError>;
    /// The approval if it exists and belongs to `owner`.
    async fn get_approval(&self, owner: &str, id: &str) -> Result<Option<Approval>, StoreError>;
    /// An audit record of a side effect or an approval event (P-5).
    async fn record_audit(
        &self,
        owner: &str,
        kind: &str,
        run_id: Option<&str>,
        detail: Value,
    ) -> Result<(), StoreError>;
    /// The owner's audit records (kind, detail), oldest first.
    async fn audit(&self, owner: &str) -> Result<Vec<(String, Value)>, StoreError>;

    /// Wake-ups from other replicas: `RunNotice`s for runs with new events or a cancel
    /// request. `None` when the store has no cross-process channel (watchers poll).
    fn notices(&self) -> Option<tokio::sync::broadcast::Receiver<RunNotice>> {
        None
    }
}

/// A cross-replica wake-up (PostgreSQL LISTEN/NOTIFY on [`NOTICE_CHANNEL`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunNotice {
    /// The run has new durable events.
    Events(String),
    /// A cancel was requested for the run.
    Cancel(String),
    /// The notice connection was (re)established: notices may have been missed meanwhile.
    Resync,
}

/// The PostgreSQL notification channel of run notices: payload `e:<run_id>` or `c:<run_id>`.
pub const NOTICE_CHANNEL: &str = "agent_runs";

impl RunNotice {
    pub fn parse(payload: &str) -> Option<Self> {
        if let Some(id) = payload.strip_prefix("e:") {
            Some(RunNotice::Events(id.to_owned()))
        } else {
            payload
                .strip_prefix("c:")
                .map(|id| RunNotice::Cancel(id.to_owned()))
        }
    }
}

pub type SharedStore = Arc<dyn AgentStore>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalState {
    Pending,
    Approved,
    Rejected,
    Expired,
}

impl ApprovalState {
    pub fn key(self) -> &'static str {
        match self {
            ApprovalState::Pending => "pending",
            ApprovalState::Approved => "approved",
            ApprovalState::Rejected => "rejected",
            ApprovalState::Expired => "expired",
        }
    }

    pub fn from_key(k: &str) -> Result<Self, StoreError> {
        Ok(match k {
            "approved" => ApprovalState::Approved,
            "rejected" => ApprovalState::Rejected,
            "expired" => ApprovalState::Expired,
            "pending" => ApprovalState::Pending,
            other => {
                return Err(StoreError::Corrupt(format!(
                    "unknown ApprovalState {other:?}"
                )));
            }
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionState {
    Planned,
    AwaitingConfirmation,
    Executing,
    Completed,
    Failed,
    Rejected,
}

impl ActionState {
    pub fn key(self) -> &'static str {
        match self {
            ActionState::Planned => "planned",
            ActionState::AwaitingConfirmation => "awaiting_confirmation",
            ActionState::Executing => "executing",
            ActionState::Completed => "completed",
            ActionState::Failed => "failed",
            ActionState::Rejected => "rejected",
        }
    }

    pub fn from_key(k: &str) -> Result<Self, StoreError> {
        Ok(match k {
            "awaiting_confirmation" => ActionState::AwaitingConfirmation,
            "executing" => ActionState::Executing,
            "completed" => ActionState::Completed,
            "failed" => ActionState::Failed,
            "rejected" => ActionState::Rejected,
            "planned" => ActionState::Planned,
            other => {
                return Err(StoreError::Corrupt(format!(
                    "unknown ActionState {other:?}"
                )));
            }
        })
    }
}

/// One tool call of a run. Its id is `{run_id}/{call_id}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    pub id: String,
    pub run_id: String,
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    pub side_effect: bool,
    pub state: ActionState,
    pub result_text: Option<String>,
    pub error_kind: Option<String>,
    pub approval_id: Option<String>,
    /// Every state the action has been in, oldest first (A-5: every transition persisted).
    pub transitions: Vec<ActionState>,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
}

impl Action {
    /// Moves the action to `state`, recording the transition.
    pub fn to(&mut self, state: ActionState) {
        if self.transitions.last() != Some(&state) {
            self.transitions.push(state);
        }
        self.state = state;
        self.updated_at = SystemTime::now();
    }
}

pub fn action_id(run_id: &str, call_id: &str) -> String {
    format!("{run_id}/{call_id}")
}

/// A queued background task agent (B-5).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskAgent {
    pub id: String,
    pub owner: String,
    pub parent_thread_id: String,
    pub instructions: String,
    pub goal: String,
    /// queued | running | completed | failed
    pub state: String,
    pub attempts: u32,
    pub last_error: Option<String>,
    pub result: Option<String>,
    pub created_at: SystemTime,
    /// The last attempt whose outcome was recorded: a run of a later attempt on the task's
    /// thread was never accounted for.
    pub settled_attempt: u32,
    /// How many settled attempts were stopped by a restart of the service running their run:
    /// attempts, but not tries (E-12 counts `attempts - restarts`).
    pub restarts: u32,
    /// The IANA time zone of the run that started it (its runs' current time is in it).
    pub time_zone: Option<String>,
}

/// How a task agent's attempt ends.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSettle<'a> {
    /// completed | failed | queued (again, at `retry_at`)
    pub state: &'a str,
    pub result: Option<&'a str>,
    /// The task's last error from now on: `None` clears it (a completed task has none, whatever
    /// an earlier attempt left).
    pub error: Option<&'a str>,
    pub retry_at: Option<SystemTime>,
    /// (source, text) posted to the parent thread with the settle.
    pub report: Option<(MessageSource, &'a str)>,
    /// Whether the attempt counts, as a try or at all.
    pub tally: Tally,
    /// The attempt whose run this settle judged, when it counts: the claimed one, or an earlier
    /// one whose run this attempt took over from a worker that went away. The task's count
    /// goes back to it, so a takeover spends no try of E-12's.
    pub attempt: u32,
}

/// How a settled attempt of unattended work (a task agent's, a schedule occurrence's) counts
/// against its tries (E-12).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tally {
    /// A try: its run ended (or could not start) for a reason of its own.
    Try,
    /// Not an attempt (its run could not start for now, or could not be followed): the next
    /// claim takes the same attempt number, and its outcome is not recorded as settled, so the
    /// run this one may have started is followed rather than a second started.
    NotAnAttempt,
    /// An attempt but not a try: its run was stopped by a restart of the service running it.
    /// Settled, so the next attempt starts a run of its own, and counted in `restarts`.
    Restart,
}

/// An archived session (B-4).
#[derive(Debug, Clone, PartialEq)]
pub struct Archive {
    pub thread_id: String,
    pub summary: String,
    pub turn_count: u32,
    pub archived_at: SystemTime,
    /// Its transcript held others' words (a result marked as external content): its summary
    /// and its text carry them on.
    pub external: bool,
}

/// Whether a serialized transcript holds a tool result marked as external content (see
/// `executor::result_content`).
pub fn carries_external(turns: &[Value]) -> bool {
    let marked = format!("<data source=\"{}", crate::executor::EXTERNAL_SOURCE);
    turns.iter().any(|t| {
        t.get("role").and_then(Value::as_str) == Some("tool_result")
            && t.pointer("/content/content")
                .and_then(Value::as_str)
                .is_some_and(|c| c.starts_with(&marked))
    })
}

/// The plain text of a serialized transcript, for full-text search.
pub fn transcript_text(turns: &[Value]) -> String {
    turns
        .iter()
        .filter_map(|t| match t.get("content") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(o)) => o
                .get("text")
                .or_else(|| o.get("content"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            _ => None,
        })
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A request to run one side-effecting call, bound to its exact arguments (P-4).
#[derive(Debug, Clone, PartialEq)]
pub struct Approval {
    pub id: String,
    pub run_id: String,
    pub thread_id: String,
    pub owner: String,
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    pub args_sha256: String,
    pub preview: String,
    pub reason: String,
    pub state: ApprovalState,
    pub created_at: SystemTime,
    pub expires_at: SystemTime,
    pub decided_by: Option<String>,
    pub decided_at: Option<SystemTime>,
    /// What the gateway's preview resolved (PreviewCallResponse.binding): the approved call
    /// runs only if it still holds. Empty: nothing was resolved beyond the arguments.
    pub binding: String,
    /// The tools whose external content the run had read when it asked (issue 14).
    pub tainted_by: Vec<String>,
    /// The only tools the run could use when it asked (`None`: every tool): its resume
    /// offers these again.
    pub allowed_tools: Option<Vec<String>>,
}

/// What a scheduled run is for: its guidance, channel and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    Briefing,
    CheckIn,
    Heartbeat,
}

impl ScheduleKind {
    pub fn key(self) -> &'static str {
        match self {
            ScheduleKind::Briefing => "briefing",
            ScheduleKind::CheckIn => "check_in",
            ScheduleKind::Heartbeat => "heartbeat",
        }
    }

    pub fn from_key(k: &str) -> Result<Self, StoreError> {
        Ok(match k {
            "briefing" => ScheduleKind::Briefing,
            "check_in" => ScheduleKind::CheckIn,
            "heartbeat" => ScheduleKind::Heartbeat,
            other => {
                return Err(StoreError::Corrupt(format!(
                    "unknown ScheduleKind {other:?}"
                )));
            }
        })
    }
}

/// How a schedule's latest occurrence went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleOutcome {
    Running,
    Completed,
    AwaitingApproval,
    Retrying,
    Failed,
    Postponed,
}

impl ScheduleOutcome {
    pub fn key(self) -> &'static str {
        match self {
            ScheduleOutcome::Running => "running",
            ScheduleOutcome::Completed => "completed",
            ScheduleOutcome::AwaitingApproval => "awaiting_approval",
            ScheduleOutcome::Retrying => "retrying",
            ScheduleOutcome::Failed => "failed",
            ScheduleOutcome::Postponed => "postponed",
        }
    }

    pub fn from_key(k: &str) -> Result<Self, StoreError> {
        Ok(match k {
            "running" => ScheduleOutcome::Running,
            "completed" => ScheduleOutcome::Completed,
            "awaiting_approval" => ScheduleOutcome::AwaitingApproval,
            "retrying" => ScheduleOutcome::Retrying,
            "failed" => ScheduleOutcome::Failed,
            "postponed" => ScheduleOutcome::Postponed,
            other => {
                return Err(StoreError::Corrupt(format!(
                    "unknown ScheduleOutcome {other:?}"
                )));
            }
        })
    }
}

/// A recurring run of one user (issue 16). At most one occurrence is in progress at a time.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub id: String,
    pub owner: String,
    pub kind: ScheduleKind,
    pub prompt: String,
    /// Five-field cron read in `time_zone`, or else `every`.
    pub cron: Option<String>,
    pub every: Option<Duration>,
    pub time_zone: String,
    pub enabled: bool,
    /// The thread occurrences post to; `None`: a new thread per occurrence.
    pub thread_id: Option<String>,
    pub next_due_at: SystemTime,
    pub last_outcome: Option<ScheduleOutcome>,
    pub last_run_id: Option<String>,
    pub last_error: Option<String>,
    pub last_fired_at: Option<SystemTime>,
    /// The due time of the occurrence in progress, until it settles.
    pub occurrence_at: Option<SystemTime>,
    /// Attempts of the occurrence in progress (E-12 retries).
    pub attempts: u32,
    /// Of those, the ones a restart of the service running their run stopped: attempts, each
    /// with a run of its own, but not tries (see [`Tally::Restart`]).
    pub restarts: u32,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
}

impl Schedule {
    /// The recurrence the stored fields describe; a stored value this build cannot read is
    /// `Corrupt`, never a silent default.
    pub fn recurrence(&self) -> Result<crate::schedule::Recurrence, StoreError> {
        match (&self.cron, self.every) {
            (Some(expr), _) => crate::schedule::Recurrence::cron(expr, &self.time_zone)
                .map_err(|e| StoreError::Corrupt(format!("schedule {}: {e}", self.id))),
            (None, Some(period)) => Ok(crate::schedule::Recurrence::every(period)),
            (None, None) => Err(StoreError::Corrupt(format!(
                "schedule {} has neither cron nor interval",
                self.id
            ))),
        }
    }

    /// The due time after the one that fires at `now`: strictly after `now`, so every slot
    /// that passed unfired collapses into the occurrence being claimed.
    pub fn following_due(&self, now: SystemTime) -> Result<SystemTime, StoreError> {
        let after = now.max(self.next_due_at);
        self.recurrence()?
            .next_due(self.created_at, after)
            .ok_or_else(|| StoreError::Corrupt(format!("schedule {} never fires again", self.id)))
    }
}

/// One occurrence of a schedule, held by the worker that claimed it.
#[derive(Debug, Clone, PartialEq)]
pub struct Occurrence {
    pub schedule: Schedule,
    pub due_at: SystemTime,
    /// 1 for the first try; the run's request id includes it, so a worker that takes over a
    /// dead worker's occurrence finds its run instead of starting a second.
    pub attempt: u32,
}

/// How an occurrence went.
#[derive(Debug, Clone, PartialEq)]
pub enum Settle {
    /// Its run started (or is still going): the hold is extended to `until`.
    Running { run_id: String, until: SystemTime },
    /// Try it again at `at`: postponed (busy thread) or retrying (the next attempt); `tally`
    /// says whether the next try is a new attempt, and whether this one was a try.
    Again {
        outcome: ScheduleOutcome,
        tally: Tally,
        run_id: Option<String>,
        error: Option<String>,
        at: SystemTime,
    },
    /// Finished with it (completed, awaiting approval, or failed for good).
    Done {
        outcome: ScheduleOutcome,
        run_id: Option<String>,
        error: Option<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::Turn;

    fn json(turn: &Turn) -> Value {
        serde_json::to_value(turn).unwrap()
    }

    #[test]
    fn only_a_tool_result_marked_as_external_content_makes_a_transcript_carry_others_words() {
        let marked = crate::executor::result_content(
            "search_gmail",
            &crate::executor::ToolOutcome {
                ok: true,
                text: "From: bank".into(),
                error_kind: String::new(),
                truncated: false,
                external: true,
            },
        );
        let result = |content: &str| {
            json(&Turn::ToolResult {
                call_id: "c".into(),
                name: "search_gmail".into(),
                content: content.into(),
                is_error: false,
            })
        };
        let user = json(&Turn::User(marked.clone()));
        assert!(carries_external(&[user.clone(), result(&marked)]));
        assert!(!carries_external(&[
            user,
            result("<data source=\"result of list_tasks\">")
        ]));
    }
}
