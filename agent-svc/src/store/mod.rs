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

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    #[error("{0} was not found")]
    NotFound(String),
}

impl StoreError {
    pub fn unavailable(e: impl std::fmt::Display) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

impl From<svc_kit::pg::PgError> for StoreError {
    fn from(e: svc_kit::pg::PgError) -> Self {
        StoreError::Unavailable(e.to_string())
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

    pub fn from_key(k: &str) -> Self {
        match k {
            "planning" => RunState::Planning,
            "executing" => RunState::Executing,
            "awaiting_confirmation" => RunState::AwaitingConfirmation,
            "completed" => RunState::Completed,
            "failed" => RunState::Failed,
            "cancelled" => RunState::Cancelled,
            _ => RunState::Queued,
        }
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
    pub last_event_seq: u64,
    /// (section name, estimated tokens) of the system prompt, in order.
    pub prompt_sections: Vec<(String, u32)>,
    pub created_at: SystemTime,
    pub started_at: Option<SystemTime>,
    pub finished_at: Option<SystemTime>,
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockOutcome {
    Acquired,
    /// Another run holds an unexpired lease.
    Busy {
        run_id: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NewRunOutcome {
    Created,
    /// A run with this owner and request id exists already (a retried request).
    Duplicate {
        run_id: String,
    },
}

#[async_trait::async_trait]
pub trait AgentStore: Send + Sync + 'static {
    fn backend(&self) -> &'static str;
    async fn ping(&self) -> Result<(), StoreError>;

    async fn create_thread(&self, id: &str, owner: &str, title: &str)
    -> Result<Thread, StoreError>;
    /// The thread if it exists and belongs to `owner`.
    async fn get_thread(&self, owner: &str, id: &str) -> Result<Option<Thread>, StoreError>;
    /// Most recently updated first.
    async fn list_threads(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<Thread>, StoreError>;

    /// Takes the thread's execution lock for `run_id` unless an unexpired lease is held by
    /// another run (E-11). Holds across replicas for PostgreSQL.
    async fn lock_thread(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<LockOutcome, StoreError>;
    async fn renew_lock(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<(), StoreError>;
    async fn release_lock(&self, thread_id: &str, run_id: &str) -> Result<(), StoreError>;

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

    /// The thread's model transcript, oldest first, as serialized turns.
    async fn history(&self, thread_id: &str) -> Result<Vec<Value>, StoreError>;
    async fn append_history(&self, thread_id: &str, turns: &[Value]) -> Result<(), StoreError>;

    /// Creates a queued run, unless one with the same owner and request id exists.
    async fn create_run(&self, run: &Run) -> Result<NewRunOutcome, StoreError>;
    async fn get_run(&self, owner: &str, run_id: &str) -> Result<Option<Run>, StoreError>;
    async fn find_run_by_request(
        &self,
        owner: &str,
        request_id: &str,
    ) -> Result<Option<Run>, StoreError>;
    async fn update_run(&self, run_id: &str, patch: RunPatch) -> Result<(), StoreError>;
    /// Marks a non-terminal run for cancellation; false when it already ended.
    async fn request_cancel(&self, run_id: &str) -> Result<bool, StoreError>;

    /// Appends an event and returns its sequence number (1, 2, 3, … per run, no gaps).
    async fn append_event(&self, run_id: &str, payload: &[u8]) -> Result<u64, StoreError>;
    /// Events with seq > `after`, in order, at most `limit`.
    async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError>;

    /// Records a new action in `state`.
    /// Runs still queued, planning or executing that started (or were created) before
    /// `before`, for any owner: what the health monitor inspects (E-12).
    async fn unfinished_runs_before(&self, before: SystemTime) -> Result<Vec<Run>, StoreError>;

    /// Fails a run that is still queued, planning or executing; false when it had already
    /// moved on (so only one sweeper, or the run itself, finishes it).
    async fn fail_if_unfinished(
        &self,
        run_id: &str,
        error: &str,
        failure_kind: &str,
    ) -> Result<bool, StoreError>;

    /// Moves the thread's LLM history into an archive with `summary` and clears it, atomically;
    /// `None` when there was nothing to archive (another sweep got there first).
    async fn archive_history(
        &self,
        thread_id: &str,
        owner: &str,
        summary: &str,
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
    /// Threads idle since before `before` that still have LLM history: (thread id, owner).
    async fn idle_threads_with_history(
        &self,
        before: SystemTime,
    ) -> Result<Vec<(String, String)>, StoreError>;

    async fn enqueue_task_agent(&self, task: &TaskAgent) -> Result<(), StoreError>;
    /// Takes the next ready task (queued and due, or running with an expired claim) for
    /// `worker`, exclusively across replicas, counting the attempt.
    async fn claim_task_agent(
        &self,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<TaskAgent>, StoreError>;
    /// Ends a task: completed with its result, failed permanently, or queued again at `retry_at`.
    async fn settle_task_agent(
        &self,
        id: &str,
        state: &str,
        result: Option<&str>,
        error: Option<&str>,
        retry_at: Option<SystemTime>,
    ) -> Result<(), StoreError>;
    async fn get_task_agent(&self, owner: &str, id: &str) -> Result<Option<TaskAgent>, StoreError>;

    async fn create_action(&self, action: &Action) -> Result<(), StoreError>;
    /// Moves an action to `state`, with its result when it has one.
    async fn update_action(
        &self,
        id: &str,
        state: ActionState,
        result: Option<(&str, Option<&str>)>,
        approval_id: Option<&str>,
    ) -> Result<(), StoreError>;
    /// A run's actions, oldest first.
    async fn list_actions(&self, run_id: &str) -> Result<Vec<Action>, StoreError>;

    async fn create_approval(&self, approval: &Approval) -> Result<(), StoreError>;
    /// The approval if it exists and belongs to `owner`.
    async fn get_approval(&self, owner: &str, id: &str) -> Result<Option<Approval>, StoreError>;
    /// Moves a pending approval to `state` (atomically, so two deciders cannot both win) and
    /// returns it as it is afterwards; an approval that was not pending is returned unchanged.
    async fn decide_approval(
        &self,
        id: &str,
        state: ApprovalState,
        decider: &str,
    ) -> Result<Option<Approval>, StoreError>;
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

    pub fn from_key(k: &str) -> Self {
        match k {
            "approved" => ApprovalState::Approved,
            "rejected" => ApprovalState::Rejected,
            "expired" => ApprovalState::Expired,
            _ => ApprovalState::Pending,
        }
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

    pub fn from_key(k: &str) -> Self {
        match k {
            "awaiting_confirmation" => ActionState::AwaitingConfirmation,
            "executing" => ActionState::Executing,
            "completed" => ActionState::Completed,
            "failed" => ActionState::Failed,
            "rejected" => ActionState::Rejected,
            _ => ActionState::Planned,
        }
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
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
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
}

/// An archived session (B-4).
#[derive(Debug, Clone, PartialEq)]
pub struct Archive {
    pub thread_id: String,
    pub summary: String,
    pub turn_count: u32,
    pub archived_at: SystemTime,
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
}
