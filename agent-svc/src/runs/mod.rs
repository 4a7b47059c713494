//! Runs from request to terminal event (A-1..A-8, E-11, S-2..S-4), as one durable state
//! machine across replicas:
//!
//! ```text
//! admission  one transaction: thread lease (fenced by a token), queued run, user message, event 1
//! segment    the lease holder alone writes: writer.rs numbers events, coalesces deltas and
//!            commits each iteration's turns, actions, messages and events in one transaction;
//!            a lease task renews until the end (a lost lease stops the run)
//! pause      one commit: approval, action awaiting, run awaiting, events, lease freed
//! decide     approvals.rs: lease first, then approval pending→decided + run awaiting→executing
//!            in one transaction (one winner), then a new segment on the same run
//! end        one commit: final message, run state, usage, terminal event, lease freed
//! monitor    background.rs: runs whose lease lapsed are ended with a terminal event
//! ```
//!
//! Watchers (live.rs) follow segments on this replica from memory and others from the store,
//! woken by PostgreSQL notices. Proto types appear only as the wire event payload.

use std::{
    borrow::Cow,
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use prost::Message as _;
use steward_proto::agent::v1 as pb;
use steward_proto::gateway::v1 as gw;
use tokio::sync::mpsc;
use tokio_stream::Stream;

use crate::{
    api::{ApiError, convert},
    executor::{
        self, Executor, ModelSetup, RunEvent, RunRequest, Stop, ToolOutcome, ToolRunner, limits,
    },
    gateway_client::{ExecuteSession, GatewayClient, GatewayError, Looked, OnceCall, ToolList},
    llm::{
        ModelRequest, Turn,
        resilient::{self, ChainEntry, RetryPolicy},
    },
    policy::Policy,
    store::{
        Action, ActionState, Admission, Admitted, Approval, ApprovalState, Ending, Lease,
        MessageSource, NewMessage, Run, RunCeiling, RunPatch, RunState, SharedStore, StoreError,
        TaskAgent, action_id,
    },
};

mod approvals;
mod background;
mod guard;
mod live;
pub mod scheduled;
mod tools;
mod writer;

pub use live::{Deliver, Watch};
pub use tools::{HISTORY_TOOL, TASK_AGENT_TOOL, sha256_hex};
use tools::{NoTools, PolicyRunner};
use writer::{RunWriter, StopReason, Stopper, WriterMsg, WriterSink};

#[derive(Debug, Clone, PartialEq)]
pub struct Attached {
    pub kind: String,
    pub id: String,
    pub title: String,
    pub snippet: String,
    pub meta: serde_json::Value,
}

/// The answer to an open side-effect call whose outcome no record can tell.
const OUTCOME_UNKNOWN: &str = "The outcome is unknown: the run that made this call ended while it was running. It may have happened; do not repeat it without asking the user.";

/// What a run found of the calls an earlier run of its thread left open: a result turn for
/// each, and for a side effect whose outcome the gateway knows, its `side_effect_result`.
#[derive(Default)]
struct ClosedCalls {
    turns: Vec<Turn>,
    audit: Vec<(String, serde_json::Value)>,
}

/// A validated run request.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInput {
    pub prompt: String,
    pub thread_id: Option<String>,
    /// (is the user, text), oldest first, at most 40.
    pub conversation: Vec<(bool, String)>,
    pub attached: Vec<Attached>,
    pub channel: limits::Channel,
    pub request_id: Option<String>,
    pub max_total_tokens: Option<u64>,
    pub max_cost_usd: Option<f64>,
    pub model_override: Option<String>,
    /// The user's time zone: the prompt's current time is in it (`None`: UTC).
    pub time_zone: Option<jiff::tz::TimeZone>,
    /// Set for a run Steward starts itself (a session opening, a task agent): its guidance,
    /// context and tools; the synthetic prompt is not stored as a user message.
    pub session: Option<SessionSetup>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SessionSetup {
    pub guidance: String,
    pub bootstrap: Option<String>,
    /// The only tools it may use; `None`: every tool.
    pub allowed_tools: Option<Vec<String>>,
    /// Nobody is waiting for this run (a scheduled run): a run of the thread paused for the
    /// user's approval is left waiting and this run is refused as busy, instead of the usual
    /// superseding of the paused run by a new message.
    pub yield_to_approvals: bool,
}

/// Per-user fair-use caps (A-2): beyond them a call is RESOURCE_EXHAUSTED naming the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairUse {
    /// AGENT_MAX_ACTIVE_RUNS_PER_USER
    pub max_active_runs: u32,
    /// AGENT_MAX_WATCHERS_PER_USER (per replica)
    pub max_watchers: u32,
    /// AGENT_MAX_QUEUED_TASK_AGENTS_PER_USER
    pub max_queued_task_agents: u32,
}

impl Default for FairUse {
    fn default() -> Self {
        Self {
            max_active_runs: 8,
            max_watchers: 32,
            max_queued_task_agents: 10,
        }
    }
}

/// S1: the most recent 30 conversation entries go to the model.
const PLANNING_CONVERSATION: usize = 30;
/// How a run stopped by its service's shutdown ends (FAILED, INTERRUPTED): the caller is to
/// try again, and unattended work takes it up again without counting a try.
pub(crate) const INTERRUPTED_MESSAGE: &str =
    "This run stopped: the service running it was restarted before it finished. Please try again.";
/// What a task agent or a schedule shows as its last error while the attempt a restart stopped
/// is run again: not the run's own "please try again", which its owner need not do.
pub(crate) const RESTARTED_RUNNING_AGAIN: &str = "Its run stopped when the service running it was restarted; it is being run again, and a restart does not count as a try.";
/// How many open calls' lookups a run's start makes at once.
const OPEN_CALL_LOOKUPS: usize = 8;
/// The monitor's terminal event skips past what a dead writer may have shown live.
const ABANDONED_SEQ_GAP: u64 = writer::MAX_VOLATILE_EVENTS as u64 + 1;

pub struct RunService {
    /// The cheap model for session summaries (L-5); `None` uses the user-message fallback.
    pub summary_model: Option<ChainEntry>,
    /// AGENT_SESSION_TIMEOUT: idle time after which a thread's history is archived (B-4).
    pub session_timeout: Duration,
    /// AGENT_HISTORY_SUMMARY_COUNT: summaries of past sessions in the prompt.
    pub summary_count: usize,
    pub policy: Policy,
    /// How long an approval stays usable (APPROVAL_TTL).
    pub approval_ttl: Duration,
    pub store: SharedStore,
    pub models: Arc<ModelSetup>,
    pub gateway: Option<GatewayClient>,
    pub max_loop_steps: Option<u32>,
    pub max_tool_result_chars: usize,
    /// RUN_LEASE: the thread lease of a running run, renewed every third of it (E-11).
    pub lease: Duration,
    pub fair_use: FairUse,
    pub schedule_rules: scheduled::ScheduleRules,
    live: Arc<live::Live>,
    /// Segments running here, to stop them at shutdown.
    stoppers: Arc<Mutex<HashMap<String, Stopper>>>,
    /// Set by shutdown: a segment that starts after it (a decision's continuation, a start
    /// already admitted) is stopped as it starts.
    shutting_down: Arc<std::sync::atomic::AtomicBool>,
    /// Open watch streams per user on this replica (fair use).
    watchers: Arc<Mutex<HashMap<String, u32>>>,
    /// Scheduled occurrences this replica is starting: a permit each, taken before the claim.
    occurrence_starts: Arc<tokio::sync::Semaphore>,
}

/// What a segment registered on this replica, taken down when its task ends however it ends.
/// A run that panics still closes its live log, so local followers turn to the store (where
/// the health monitor ends the run once its lease lapses) instead of waiting forever. Only
/// this segment's own entries are removed: a continuation of the same run (an approval
/// decided here) may have registered its own meanwhile.
struct SegmentRegistered {
    live: Arc<live::Live>,
    stoppers: Arc<Mutex<HashMap<String, Stopper>>>,
    run_id: String,
    stopper: Stopper,
    live_run: Arc<live::LiveRun>,
    /// Stops the lease keeper.
    done: tokio_util::sync::CancellationToken,
}

impl SegmentRegistered {
    fn still_ours(&self) -> bool {
        self.stoppers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&self.run_id)
            .is_some_and(|s| s.same(&self.stopper))
    }
}

impl Drop for SegmentRegistered {
    fn drop(&mut self) {
        self.done.cancel();
        let ours = self.still_ours();
        if ours {
            self.live
                .cancels
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&self.run_id);
        }
        crate::metrics::run_active(-1.0);
        self.live.close(&self.run_id, &self.live_run);
        // Last: shutdown waits for this map to empty.
        if ours {
            self.stoppers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&self.run_id);
        }
    }
}

/// The previous session's archiving and the prompt's recent session summaries (B-4).
enum Sessions {
    /// Nothing to archive: the summaries were read with the admission.
    Read(Vec<crate::store::Archive>),
    /// Archive the thread's previous session before this run, then read them.
    ArchiveFirst,
}

/// What the first segment of a run already has from the gateway when its loop starts.
#[derive(Default)]
struct Prefetched {
    /// The Execute stream opened for the prompt's memory lookup.
    session: Option<ExecuteSession>,
    /// The user's tool list, asked for while the prompt was assembled.
    tools: Option<Result<Arc<ToolList>, crate::gateway_client::GatewayError>>,
}

/// What a segment of a run does.
enum Plan {
    Start {
        input: Box<RunInput>,
        models: Arc<ModelSetup>,
        new_thread: bool,
        sessions: Sessions,
    },
    Continue {
        approval: Box<Approval>,
        approved: bool,
    },
}

/// A run [`RunService::start_run`] started or found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    pub run_id: String,
    pub thread_id: String,
    /// Started by an earlier request with the same request id.
    pub repeated: bool,
}

impl Started {
    fn repeated(run_id: String, thread_id: String) -> Self {
        Self {
            run_id,
            thread_id,
            repeated: true,
        }
    }
}

/// The run a segment works on.
#[derive(Clone)]
struct Segment {
    owner: String,
    thread_id: String,
    run_id: String,
    channel: limits::Channel,
    /// The user's zone, when the run was given one (a continuation reads it with the run).
    time_zone: Option<jiff::tz::TimeZone>,
}

/// Where a segment starts numbering.
enum From {
    /// After this durable seq (a continuation).
    Seq(u64),
    /// After this durable first event of a new run.
    Event(Box<pb::RunEvent>),
}

/// How the executor part of a segment ended.
enum Driven {
    Finished(Box<executor::Outcome>),
    Stopped(StopReason),
}

impl RunService {
    /// R-4's refusal of one more live run for an owner with `active` of them, and `then`, what
    /// the caller can do.
    fn at_the_run_cap(&self, active: u32, then: &str) -> ApiError {
        ApiError::ResourceExhausted(format!(
            "you have {active} runs in progress, the limit (AGENT_MAX_ACTIVE_RUNS_PER_USER) is {}; {then}",
            self.fair_use.max_active_runs
        ))
    }

    pub fn new(
        store: SharedStore,
        models: Arc<ModelSetup>,
        gateway: Option<GatewayClient>,
        max_loop_steps: Option<u32>,
        max_tool_result_chars: usize,
    ) -> Self {
        Self {
            summary_model: None,
            session_timeout: Duration::from_secs(30 * 60),
            summary_count: 5,
            policy: Policy::permissive(),
            approval_ttl: Duration::from_secs(24 * 3600),
            store,
            models,
            gateway,
            max_loop_steps,
            max_tool_result_chars,
            lease: Duration::from_secs(30),
            fair_use: FairUse::default(),
            schedule_rules: scheduled::ScheduleRules::default(),
            live: Arc::default(),
            stoppers: Arc::default(),
            shutting_down: Arc::default(),
            watchers: Arc::default(),
            occurrence_starts: Arc::new(tokio::sync::Semaphore::new(scheduled::STARTS_AT_ONCE)),
        }
    }

    /// Stops every segment still running here (shutdown) and waits up to `wait` for them to
    /// commit their progress and release their leases.
    pub async fn release_all(&self, wait: Duration) {
        self.shutting_down
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let stop_running = || {
            let stoppers = self.stoppers.lock().unwrap_or_else(|e| e.into_inner());
            for stopper in stoppers.values() {
                stopper.stop(StopReason::Shutdown);
            }
            stoppers.len()
        };
        let running = stop_running();
        if running == 0 {
            return;
        }
        tracing::warn!(
            runs = running,
            "stopping runs still in progress at shutdown"
        );
        let deadline = tokio::time::Instant::now() + wait;
        // Again on every tick: a segment registered between the flag and its own check of it
        // is stopped here.
        while tokio::time::Instant::now() < deadline && stop_running() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Live registrations on this replica (running segments, remote waits, cancels): returns
    /// to zero when nothing runs or is watched.
    pub fn live_registrations(&self) -> usize {
        self.live.registrations() + self.stoppers.lock().map_or(0, |s| s.len())
    }

    /// Routes the store's cross-replica notices (new events, cancels) while the process runs.
    pub fn spawn_notice_router(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        let mut notices = self.store.notices()?;
        let live = self.live.clone();
        Some(tokio::spawn(async move {
            loop {
                match notices.recv().await {
                    Ok(notice) => live.route(&notice),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        live.route(&crate::store::RunNotice::Resync);
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        }))
    }

    /// Starts a run (or finds the one a repeated request id started) and returns its id and
    /// thread. The work continues in its own task.
    pub async fn start(
        self: &Arc<Self>,
        owner: &str,
        input: RunInput,
    ) -> Result<(String, String), ApiError> {
        let started = self.start_run(owner, input).await?;
        Ok((started.run_id, started.thread_id))
    }

    /// As [`start`](RunService::start), saying whether the run was started by an earlier
    /// request with the same id.
    pub async fn start_run(
        self: &Arc<Self>,
        owner: &str,
        input: RunInput,
    ) -> Result<Started, ApiError> {
        let models = self.models_for(input.model_override.as_deref())?;
        // A retried request finds the first run before anything new is created.
        if let Some(key) = &input.request_id
            && let Some(existing) = self.store.find_run_by_request(owner, key).await?
        {
            return Ok(Started::repeated(existing.id, existing.thread_id));
        }
        let now = SystemTime::now();
        let (thread_id, new_thread_title, archive_first) = match &input.thread_id {
            Some(id) => {
                let t = self
                    .store
                    .get_thread(owner, id)
                    .await?
                    .ok_or_else(|| ApiError::NotFound(format!("thread {id}")))?;
                // B-4: a message after AGENT_SESSION_TIMEOUT of quiet starts a new session; the
                // old one is archived first (checked before this message touches the thread).
                (t.id, None, t.updated_at + self.session_timeout <= now)
            }
            None => (
                uuid::Uuid::new_v4().to_string(),
                Some(input.prompt.chars().take(80).collect::<String>()),
                false,
            ),
        };
        let run = Run {
            request_id: input.request_id.clone(),
            time_zone: input
                .time_zone
                .as_ref()
                .and_then(|z| z.iana_name())
                .map(str::to_owned),
            created_at: now,
            ..Run::queued(
                &uuid::Uuid::new_v4().to_string(),
                &thread_id,
                owner,
                input.channel.key(),
            )
        };
        let superseded = "A newer message on this thread superseded this run's pending approval.";
        let queued = pb::RunEvent {
            run_id: run.id.clone(),
            seq: 1,
            time: Some(convert::timestamp(now)),
            thread_id: thread_id.clone(),
            kind: Some(pb::run_event::Kind::Status(pb::StatusEvent {
                state: pb::RunState::Queued as i32,
                detail: String::new(),
            })),
        };
        let admission = Admission {
            new_thread_title,
            // S-4: the user's message is stored before any model call (a run Steward starts
            // itself has none).
            user_message: input.session.is_none().then(|| input.prompt.clone()),
            first_event: queued.encode_to_vec(),
            lease: self.lease,
            max_active_runs: self.fair_use.max_active_runs,
            supersede_event: encode(cancelled_result(superseded)),
            supersede_message: superseded.into(),
            supersede_paused: !input.session.as_ref().is_some_and(|s| s.yield_to_approvals),
            // After an archive they are read once it is written, not here.
            summaries: if archive_first { 0 } else { self.summary_count },
            run,
        };
        // Once sent, an admission commits whatever becomes of this call (on PostgreSQL its
        // COMMIT goes out with its statements), so the admission and the segment it starts are
        // a task of their own: a caller that goes away meanwhile (a reset stream, a deadline)
        // must not leave a committed run that nothing runs.
        let this = self.clone();
        // In the caller's span: the run's trace starts at the caller's RPC (O-2).
        in_own_task(
            async move {
                this.admit(admission, queued, input, models, archive_first)
                    .await
            },
            "agent-svc is shutting down; retry the run",
        )
        .await
    }

    /// Admits a run and, once admitted, starts its segment.
    async fn admit(
        self: Arc<Self>,
        admission: Admission,
        queued: pb::RunEvent,
        input: RunInput,
        models: Arc<ModelSetup>,
        archive_first: bool,
    ) -> Result<Started, ApiError> {
        let new_thread = admission.new_thread_title.is_some();
        let owner = admission.run.owner.clone();
        let thread_id = admission.run.thread_id.clone();
        let run_id = admission.run.id.clone();
        let (lease, sessions) = match self.store.admit(&admission).await? {
            Admitted::Started { lease, summaries } => (
                lease,
                if archive_first {
                    Sessions::ArchiveFirst
                } else {
                    Sessions::Read(summaries)
                },
            ),
            Admitted::Busy { run_id: active } => return Err(thread_busy(&thread_id, &active)),
            Admitted::Duplicate { run_id, thread_id } => {
                return Ok(Started::repeated(run_id, thread_id));
            }
            Admitted::AwaitingApproval { run_id: paused } => {
                return Err(thread_paused(&thread_id, &paused));
            }
            Admitted::TooManyRuns { active } => {
                return Err(self.at_the_run_cap(active, "wait for one to finish"));
            }
        };
        let segment = Segment {
            owner,
            thread_id: thread_id.clone(),
            run_id: run_id.clone(),
            channel: input.channel,
            time_zone: input.time_zone.clone(),
        };
        self.spawn_segment(
            segment,
            lease,
            From::Event(Box::new(queued)),
            Plan::Start {
                input: Box::new(input),
                models,
                new_thread,
                sessions,
            },
        );
        Ok(Started {
            run_id,
            thread_id,
            repeated: false,
        })
    }

    pub(super) fn models_for(
        &self,
        model_override: Option<&str>,
    ) -> Result<Arc<ModelSetup>, ApiError> {
        let Some(wanted) = model_override else {
            return Ok(self.models.clone());
        };
        // "provider/model" names one entry exactly; a bare model name (which may itself hold
        // a '/', as OpenRouter's do) the first entry of that model.
        let chain = &self.models.chain;
        let exact = chain.iter().position(|e| {
            wanted
                .strip_prefix(e.provider.name())
                .and_then(|m| m.strip_prefix('/'))
                == Some(e.model.as_str())
        });
        let Some(pos) = exact.or_else(|| chain.iter().position(|e| e.model == wanted)) else {
            let known: Vec<_> = self
                .models
                .chain
                .iter()
                .map(|e| format!("{}/{}", e.provider.name(), e.model))
                .collect();
            return Err(ApiError::InvalidArgument(format!(
                "input.model_override {wanted:?} is not in the configured chain ({})",
                known.join(", ")
            )));
        };
        let mut setup = (*self.models).clone();
        let entry = setup.chain.remove(pos);
        setup.chain.insert(0, entry);
        Ok(Arc::new(setup))
    }

    /// Runs one segment of a run in its own task: the lease keeper, the live log for local
    /// watchers, the work, then exactly one terminal commit (or nothing, if the lease is lost:
    /// the monitor ends such runs).
    /// `from`: the last durable event (the segment numbers on after it), or a new run's first
    /// event, which local watchers then get from memory too.
    fn spawn_segment(self: &Arc<Self>, seg: Segment, lease: Lease, from: From, plan: Plan) {
        let (last_seq, first) = match from {
            From::Seq(seq) => (seq, None),
            From::Event(event) => (event.seq, Some(*event)),
        };
        let this = self.clone();
        let stopper = Stopper::default();
        self.live
            .cancels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(seg.run_id.clone(), stopper.clone());
        self.stoppers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(seg.run_id.clone(), stopper.clone());
        if self.shutting_down.load(std::sync::atomic::Ordering::SeqCst) {
            // It commits what it was given and hands its thread back, as the running ones do.
            stopper.stop(StopReason::Shutdown);
        }
        let live_run = match first {
            Some(event) => {
                let live_run = self.live.open(&seg.run_id, last_seq - 1);
                live_run.publish(event);
                live_run
            }
            None => self.live.open(&seg.run_id, last_seq),
        };
        let span = tracing::info_span!(
            "run",
            otel.name = "run",
            run_id = %seg.run_id,
            thread_id = %seg.thread_id,
            channel = seg.channel.key(),
            trace_id = tracing::field::Empty,
        );
        svc_kit::telemetry::record_trace_id(&span);
        // Boxed: the run's future is ~17 KB, and tokio moves a spawned future by value into its
        // task cell and writes the whole stage again when it completes; those copies were 5% of
        // a run's instructions (issue 13). Boxed, they copy a pointer.
        tokio::spawn(Box::pin(tracing::Instrument::instrument(
            async move {
                crate::metrics::run_active(1.0);
                let done = tokio_util::sync::CancellationToken::new();
                let _registered = SegmentRegistered {
                    live: this.live.clone(),
                    stoppers: this.stoppers.clone(),
                    run_id: seg.run_id.clone(),
                    stopper: stopper.clone(),
                    live_run: live_run.clone(),
                    done: done.clone(),
                };
                writer::keep_lease(
                    this.store.clone(),
                    lease.clone(),
                    this.lease,
                    stopper.clone(),
                    done.clone(),
                );
                let mut writer =
                    RunWriter::new(this.store.clone(), live_run.clone(), lease, last_seq);
                let worked = match plan {
                    Plan::Start {
                        input,
                        models,
                        new_thread,
                        sessions,
                    } => {
                        this.begin(
                            &seg,
                            &mut writer,
                            &input,
                            models,
                            new_thread,
                            sessions,
                            &stopper,
                        )
                        .await
                    }
                    Plan::Continue { approval, approved } => {
                        this.resume(&seg, &mut writer, *approval, approved, &stopper)
                            .await
                    }
                };
                this.end(&seg, &mut writer, worked).await;
            },
            span,
        )));
    }

    async fn load_history(&self, thread_id: &str) -> Result<Vec<Turn>, ApiError> {
        let mut history = Vec::new();
        for text in self.store.history(thread_id).await? {
            match serde_json::from_str::<Turn>(&text) {
                Ok(turn) => history.push(turn),
                // A turn this build cannot read is left out of the model's view, loudly.
                Err(e) => {
                    tracing::error!(thread_id, error = %e, "unreadable LLM history turn skipped")
                }
            }
        }
        Ok(history)
    }

    /// Tool calls left open in the history (a superseded approval, a run whose replica died
    /// mid-call) get a result now, so the transcript stays valid for every provider. What the
    /// result says comes from the record: a side effect that was executing is looked up at
    /// the gateway (its idempotency record says whether it happened), never assumed.
    ///
    /// A record that cannot be read now (the store, or the gateway, away) fails the run's
    /// start instead of answering for it: the answer joins the thread's history for good, so a
    /// guess written during a blip ("not executed" for a send that went out) would outlive it;
    /// the thread's next run closes the calls from the records. Only what the records say is
    /// answered, "unknown" included.
    async fn close_open_calls(
        &self,
        owner: &str,
        history: &[Turn],
    ) -> Result<ClosedCalls, ApiError> {
        let answered: std::collections::HashSet<&str> = history
            .iter()
            .filter_map(|t| match t {
                Turn::ToolResult { call_id, .. } => Some(call_id.as_str()),
                _ => None,
            })
            .collect();
        let open: Vec<&crate::llm::ToolCall> = history
            .iter()
            .flat_map(|t| match t {
                Turn::Assistant { tool_calls, .. } => tool_calls.iter().collect(),
                _ => Vec::new(),
            })
            .filter(|c| !answered.contains(c.id.as_str()))
            .collect();
        if open.is_empty() {
            return Ok(ClosedCalls::default());
        }
        let ids: Vec<String> = open.iter().map(|c| c.id.clone()).collect();
        // The database away fails the run (asked again by the next); records it refuses or
        // this build cannot read will not improve, so those calls are answered as unknown.
        let actions = match self.store.actions_for_calls(&ids).await {
            Ok(actions) => Some(actions),
            Err(e @ StoreError::Unavailable(_)) => return Err(e.into()),
            Err(e) => {
                tracing::error!(error = %e, "the actions of open calls cannot be read; they are answered as unknown");
                None
            }
        };
        // Looked up side by side, a few at a time, answered in the calls' order: a batch of
        // sends cut off together waits for its slowest lookups, not for the sum of them (each
        // may take the gateway's whole call timeout).
        let mut closed = ClosedCalls::default();
        for some in open.chunks(OPEN_CALL_LOOKUPS) {
            let answers = futures_util::future::try_join_all(
                some.iter()
                    .map(|call| self.answer_open_call(owner, call, actions.as_deref())),
            )
            .await?;
            for (turn, audit) in answers {
                closed.turns.push(turn);
                closed.audit.extend(audit);
            }
        }
        Ok(closed)
    }

    /// The result an open call gets, from its record (`actions`: the open calls' actions,
    /// `None` when unreadable for good), and the `side_effect` audit record it closes, if any.
    /// An error is a record that asking again may read: the run's start fails on it.
    async fn answer_open_call(
        &self,
        owner: &str,
        call: &crate::llm::ToolCall,
        actions: Option<&[Action]>,
    ) -> Result<(Turn, Option<(String, serde_json::Value)>), ApiError> {
        let action = actions.and_then(|all| all.iter().find(|a| a.call_id == call.id));
        let mut audit = None;
        let (content, is_error) = match action {
            // A task agent is queued in the agent's own store, not the gateway's: whether
            // the call queued it is read there (the task carries the call's id).
            _ if call.name == TASK_AGENT_TOOL => {
                let id = tools::task_id_for(&call.id);
                match self.store.get_task_agent(owner, &id).await {
                    Ok(Some(task)) => (tools::task_started_as(&task), false),
                    Ok(None) => (
                        "Not executed: the run that made this call ended before it ran."
                            .to_owned(),
                        true,
                    ),
                    Err(e @ StoreError::Unavailable(_)) => return Err(e.into()),
                    Err(e) => {
                        tracing::error!(call_id = %call.id, error = %e, "an open task agent call's task cannot be read");
                        (
                            "The outcome is unknown: the run that made this call ended while it ran. The task agent may have been started; do not start it again without asking the user.".to_owned(),
                            true,
                        )
                    }
                }
            }
            // Its record unreadable: whatever it was, it may have happened.
            None if actions.is_none() => (OUTCOME_UNKNOWN.to_owned(), true),
            Some(a) if a.side_effect && a.state == ActionState::Executing => {
                match &self.gateway {
                    // What the gateway knows closes the call's `side_effect` record too
                    // (written by this later run; the call id joins them).
                    Some(g) => match g.lookup(owner, &a.id, a.created_at).await {
                        Ok(Looked::Found(done)) => {
                            audit = Some(writer::side_effect_result(
                                &call.name,
                                &call.id,
                                done.ok,
                                &done.error_kind,
                            ));
                            (
                                format!(
                                    "This call completed, but its run ended before it recorded the result. Result:\n{}",
                                    executor::result_content(&call.name, &done)
                                ),
                                !done.ok,
                            )
                        }
                        Ok(Looked::NeverRan) => {
                            audit = Some(writer::side_effect_result(
                                &call.name,
                                &call.id,
                                false,
                                "NOT_EXECUTED",
                            ));
                            (
                                "Not executed: the run that made this call ended before it ran.".to_owned(),
                                true,
                            )
                        }
                        // The gateway's answer, for good: its call ended unrecorded.
                        Ok(Looked::Unknown(why)) => {
                            tracing::warn!(call_id = %call.id, %why, "an open side-effect call's outcome is unknown");
                            (OUTCOME_UNKNOWN.to_owned(), true)
                        }
                        // Not known yet (the gateway away, or the call still running):
                        // asked again by the next run.
                        Err(GatewayError::Unavailable(why)) => {
                            return Err(ApiError::Unavailable(format!(
                                "this thread's previous run left a call to {} open, and gateway-svc could not say yet what it came to ({why}); nothing was run, please try again shortly",
                                call.name
                            )));
                        }
                        Err(e) => {
                            tracing::warn!(call_id = %call.id, error = %e, "an open side-effect call could not be looked up");
                            (OUTCOME_UNKNOWN.to_owned(), true)
                        }
                    },
                    None => (OUTCOME_UNKNOWN.to_owned(), true),
                }
            }
            Some(a) if a.state == ActionState::Executing => (
                "Not completed: the run that made this call ended first. It only read data; call it again if you still need it.".to_owned(),
                true,
            ),
            Some(a) if a.state == ActionState::AwaitingConfirmation => (
                "Not executed: the user moved on without approving it.".to_owned(),
                true,
            ),
            _ => (
                "Not executed: the run that made this call ended before it ran.".to_owned(),
                true,
            ),
        };
        Ok((
            Turn::ToolResult {
                call_id: call.id.clone(),
                name: call.name.clone(),
                content,
                is_error,
            },
            audit,
        ))
    }

    /// The first segment of a run: prompt assembly, then the loop.
    #[allow(clippy::too_many_arguments)]
    async fn begin(
        &self,
        seg: &Segment,
        writer: &mut RunWriter,
        input: &RunInput,
        models: Arc<ModelSetup>,
        new_thread: bool,
        sessions: Sessions,
        stopper: &Stopper,
    ) -> Result<Driven, ApiError> {
        if let Sessions::ArchiveFirst = sessions {
            self.archive(&seg.owner, &seg.thread_id, Some(&writer.lease), None)
                .await;
        }
        // A thread this admission created has no history yet: nothing to read.
        let mut history = if new_thread {
            Vec::new()
        } else {
            self.load_history(&seg.thread_id).await?
        };
        let closed = self.close_open_calls(&seg.owner, &history).await?;
        for turn in &closed.turns {
            writer.pending().history.push(to_json(turn)?);
        }
        writer.pending().audit.extend(closed.audit);
        history.extend(closed.turns);
        if new_thread && history.is_empty() {
            let skip = input
                .conversation
                .len()
                .saturating_sub(PLANNING_CONVERSATION);
            history = input
                .conversation
                .iter()
                .skip(skip)
                .map(|(user, text)| {
                    if *user {
                        Turn::User(text.clone())
                    } else {
                        Turn::Assistant {
                            text: text.clone(),
                            tool_calls: vec![],
                        }
                    }
                })
                .collect();
            // Kept as the thread's own history: a continuation after an approval, and the
            // thread's later runs, read it from there.
            for turn in &history {
                writer.pending().history.push(to_json(turn)?);
            }
        }
        writer
            .pending()
            .history
            .push(to_json(&Turn::User(input.prompt.clone()))?);
        let mut limits = limits::profile(input.channel, self.max_loop_steps);
        limits.max_total_tokens = input.max_total_tokens;
        limits.max_cost_usd = input.max_cost_usd;
        // Kept with the run's usage: a continuation after an approval goes on under what is left.
        writer.spent.ceiling = RunCeiling::of(input.max_total_tokens, input.max_cost_usd);
        writer.spent.model_override = input.model_override.clone();
        if !input.attached.is_empty() {
            writer.guard.read(guard::ATTACHED);
        }
        if seg.channel == limits::Channel::TaskAgent {
            writer.guard.read(guard::TASK_INSTRUCTIONS);
        }
        // The run's Execute stream, opened for the prompt's memory lookup and kept for its tools.
        let mut session = None;
        // The tool list is asked for while the prompt is assembled: both are needed before the
        // first model call and neither needs the other, so their round trips overlap.
        let listing = async {
            match &self.gateway {
                Some(g) => Some(
                    g.list_tools_retrying(&seg.owner, gateway_channel(seg.channel))
                        .await,
                ),
                None => None,
            }
        };
        let tasks = started_task_agents(&history);
        let prepared = async {
            tokio::join!(
                self.assemble(
                    seg,
                    input,
                    &models,
                    &writer.guard,
                    &mut session,
                    sessions,
                    &tasks
                ),
                listing
            )
        };
        // The gateway's bootstrap, memory lookup and tool list can take seconds each: a
        // cancel or a shutdown does not wait for them (nothing they do needs undoing).
        let (prompt, tools) = tokio::select! {
            prepared = prepared => prepared,
            () = stopper.token.cancelled() => {
                return Ok(Driven::Stopped(stopper.reason().unwrap_or(StopReason::Cancelled)));
            }
        };
        writer.pending().patch.merge(RunPatch {
            state: Some(RunState::Planning),
            started_at: Some(SystemTime::now()),
            prompt_sections: Some(prompt.sections.clone()),
            system_prompt: Some(prompt.text.clone()),
            ..RunPatch::default()
        });
        let request = RunRequest {
            system: prompt.text,
            system_tokens: Some(prompt.tokens),
            history,
            prompt: input.prompt.clone(),
            tools: crate::llm::ToolSet::none(),
            limits,
            stop_after: None,
            resume: false,
            gathered: Vec::new(),
        };
        let allowed = input.session.as_ref().and_then(|s| s.allowed_tools.clone());
        self.drive(
            seg,
            writer,
            request,
            models,
            allowed.as_deref(),
            stopper,
            Prefetched { session, tools },
        )
        .await
    }

    /// The one prompt assembler (B-1): every run's system prompt is built here; a
    /// continuation reuses what its run stored.
    #[allow(clippy::too_many_arguments)]
    async fn assemble(
        &self,
        seg: &Segment,
        input: &RunInput,
        models: &ModelSetup,
        guard: &guard::CallGuard,
        session: &mut Option<ExecuteSession>,
        sessions: Sessions,
        tasks: &[&str],
    ) -> crate::prompt::Prompt {
        // The gateway's memory, (after an archive) the store's summaries and the thread's task
        // agents are asked at once: round trips to different services need not queue.
        let (about_user, recent, task_agents) = tokio::join!(
            self.about_user(seg, input, session),
            async {
                match sessions {
                    Sessions::Read(list) => Ok(list),
                    Sessions::ArchiveFirst => {
                        self.store
                            .recent_summaries(&seg.owner, self.summary_count)
                            .await
                    }
                }
            },
            self.task_agent_lines(&seg.owner, tasks, guard)
        );
        let about_user = match about_user {
            Some((text, external)) => {
                if external {
                    guard.read(guard::MEMORY);
                }
                Some(text)
            }
            None => None,
        };
        let recent_sessions = match recent {
            Ok(list) => {
                if list.iter().any(|a| a.external) {
                    guard.read(guard::EARLIER_SESSIONS);
                }
                list.into_iter().map(|a| a.summary).collect()
            }
            Err(e) => {
                tracing::warn!(error = %e, "recent session summaries unavailable");
                Vec::new()
            }
        };
        crate::prompt::build(
            &crate::prompt::PromptInput {
                channel: Some(input.channel),
                about_user,
                attached: input.attached.clone(),
                session_guidance: input.session.as_ref().map(|s| s.guidance.clone()),
                bootstrap: input.session.as_ref().and_then(|s| s.bootstrap.clone()),
                recent_sessions,
                task_agents,
                time_zone: input.time_zone.clone(),
            },
            executor::budget::TokenCounter::for_model(
                models.chain.first().map_or("", |e| e.model.as_str()),
            ),
            SystemTime::now(),
        )
    }

    /// [BACKGROUND TASKS] (B-5): where each task agent the thread started stands, and what a
    /// finished one reported, so the model knows it when the user asks — its report is posted
    /// to the thread as a message, which the model's history does not hold. A task that cannot
    /// be read is left out (logged).
    async fn task_agent_lines(
        &self,
        owner: &str,
        tasks: &[&str],
        guard: &guard::CallGuard,
    ) -> Vec<String> {
        let read = futures_util::future::join_all(
            tasks
                .iter()
                .map(|id| async move { (id, self.store.get_task_agent(owner, id).await) }),
        )
        .await;
        let mut lines = Vec::new();
        for (id, task) in read {
            let task = match task {
                Ok(Some(task)) => task,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(task = %id, error = %e, "a task agent could not be read for the prompt");
                    continue;
                }
            };
            let (state, text) = match task.state.as_str() {
                "completed" => ("finished", task.result.unwrap_or_default()),
                "failed" => ("could not finish", task.last_error.unwrap_or_default()),
                _ => ("still working", String::new()),
            };
            if !text.is_empty() {
                guard.read(guard::TASK_RESULTS);
            }
            // One entry per task, its report's lines indented under it: neither the goal nor
            // the report (both written by a model) can pass for another task's entry.
            let goal = task.goal.split_whitespace().collect::<Vec<_>>().join(" ");
            let mut entry = format!("- {goal} [{}]: {state}", task.id);
            if !text.is_empty() {
                let mut report: String = text.chars().take(TASK_REPORT_CHARS).collect();
                if report.len() < text.len() {
                    report.push_str(" … (the rest of the report is cut)");
                }
                entry.push(':');
                for line in report
                    .split(['\n', '\r', '\u{85}', '\u{2028}', '\u{2029}'])
                    .filter(|l| !l.is_empty())
                {
                    entry.push_str("\n  ");
                    entry.push_str(line);
                }
            }
            lines.push(entry);
        }
        lines
    }

    /// [ABOUT THE USER]: what memory holds that bears on the prompt, asked over the run's
    /// Execute stream (opened here into `session`). A failure never blocks the run (B-1); it
    /// is logged and the section left out.
    async fn about_user(
        &self,
        seg: &Segment,
        input: &RunInput,
        session: &mut Option<ExecuteSession>,
    ) -> Option<(String, bool)> {
        let gateway = self.gateway.as_ref()?;
        let query = if input.session.is_some() {
            "preferences goals priorities".to_owned()
        } else {
            input.prompt.clone()
        };
        let channel = gateway_channel(input.channel);
        if session.is_none() {
            let opened = tokio::time::timeout(
                gateway.call_timeout,
                gateway.open(&seg.owner, &seg.run_id, channel, seg.time_zone.as_ref()),
            )
            .await;
            match opened {
                Ok(Ok(opened)) => *session = Some(opened),
                Ok(Err(e)) => {
                    tracing::warn!(run_id = %seg.run_id, error = %e, "memory unavailable for [ABOUT THE USER]");
                    return None;
                }
                Err(_) => {
                    tracing::warn!(run_id = %seg.run_id, "memory unavailable for [ABOUT THE USER]: the tool stream did not open in time");
                    return None;
                }
            }
        }
        let outcome = session
            .as_ref()?
            .call_once(OnceCall {
                user: &seg.owner,
                run_id: &seg.run_id,
                channel,
                call_id: "about-user",
                tool: "search_memory",
                args: &serde_json::json!({ "query": query.chars().take(500).collect::<String>(), "limit": 5 }),
                idempotency_key: "",
                read_external_from: &[],
                expected_binding: "",
                time_zone: crate::gateway_client::zone_name(seg.time_zone.as_ref()),
            })
            .await;
        if !outcome.ok {
            tracing::warn!(run_id = %seg.run_id, error = %outcome.text, "memory unavailable for [ABOUT THE USER]");
            return None;
        }
        // "No memories match ..." is a fact worth nothing in the prompt.
        // The flag: some of them were taken from others' words (issue 14).
        (!outcome.text.starts_with("No memories")).then_some((outcome.text, outcome.external))
    }

    /// Lists the tools, opens the Execute stream (unless the prompt's memory lookup did) behind
    /// the policy, and runs the executor with its events going through the writer.
    #[allow(clippy::too_many_arguments)]
    async fn drive(
        &self,
        seg: &Segment,
        writer: &mut RunWriter,
        mut request: RunRequest,
        models: Arc<ModelSetup>,
        allowed: Option<&[String]>,
        stopper: &Stopper,
        pre: Prefetched,
    ) -> Result<Driven, ApiError> {
        let gw_channel = gateway_channel(seg.channel);
        let Prefetched { session, tools } = pre;
        // R-5: a run never goes on without the tools it was meant to have — that would report
        // COMPLETED with a different meaning. Retried briefly, then a clear failure.
        let listed = match (&self.gateway, tools) {
            (Some(_), Some(listed)) => Some(listed),
            (Some(g), None) => Some(g.list_tools_retrying(&seg.owner, gw_channel).await),
            (None, _) => None,
        };
        let list = listed.transpose().map_err(|e| {
            ApiError::Unavailable(format!(
                "this run could not list its tools ({e}); nothing was done. Try again shortly."
            ))
        })?;
        let task_agent = seg.channel == limits::Channel::TaskAgent;
        let offer = || {
            let mut decls: Vec<_> = list
                .iter()
                .flat_map(|l| &l.tools)
                .filter(|t| allowed.is_none_or(|only| only.contains(&t.decl.name)))
                .map(|t| t.decl.clone())
                .collect();
            if allowed.is_none_or(|only| only.iter().any(|t| t == HISTORY_TOOL)) {
                decls.push(tools::history_tool());
            }
            if !task_agent && allowed.is_none_or(|only| only.iter().any(|t| t == TASK_AGENT_TOOL)) {
                decls.push(tools::task_agent_tool());
            }
            crate::llm::ToolSet::shared(decls)
        };
        // Runs offered a user's whole list (nearly all) share what the first one prepared.
        request.tools = match (&list, allowed) {
            (Some(list), None) => list.offered(usize::from(task_agent), offer),
            _ => offer(),
        };
        let no_names = HashSet::new();
        let names = |pick: fn(&ToolList) -> &HashSet<String>, by_allowed: bool| {
            let all = list.as_deref().map_or(&no_names, pick);
            match allowed.filter(|_| by_allowed) {
                None => Cow::Borrowed(all),
                Some(only) => {
                    Cow::Owned(all.iter().filter(|n| only.contains(n)).cloned().collect())
                }
            }
        };
        let side_effects = names(|l| &l.side_effects, true);
        let memory_writers = names(|l| &l.memory_writers, true);
        // Known even when not offered: the transcript may hold their results.
        let external_readers = names(|l| &l.external_readers, false);
        let (side_effects, memory_writers, external_readers) =
            (&*side_effects, &*memory_writers, &*external_readers);
        writer.side_effects = side_effects.clone();
        writer.allowed_tools = allowed.map(<[String]>::to_vec);
        let guard = writer.guard.clone();
        guard.read_history(&request.history, external_readers);
        let session = match (&self.gateway, request.tools.is_empty(), session) {
            // A stream that broke during the memory lookup is not the run's tool stream: open a
            // new one, or fail the run as unable to reach its tools (R-5).
            (Some(_), false, Some(open)) if !open.is_closed() => Some(open),
            (Some(g), false, _) => Some(
                g.open(&seg.owner, &seg.run_id, gw_channel, seg.time_zone.as_ref())
                    .await
                    .map_err(|e| ApiError::Unavailable(e.to_string()))?,
            ),
            _ => None,
        };
        let executor = Executor {
            models,
            max_tool_result_chars: self.max_tool_result_chars,
        };
        let (tx, rx) = mpsc::unbounded_channel::<WriterMsg>();
        let in_flight = writer.in_flight.clone();
        let lease = writer.lease.clone();
        let cancel_grace = self.cancel_grace();
        let work = async {
            let no_tools = NoTools;
            let runner = PolicyRunner {
                inner: match &session {
                    Some(s) => s as &dyn ToolRunner,
                    None => &no_tools,
                },
                background: seg.channel == limits::Channel::TaskAgent,
                policy: &self.policy,
                user: &seg.owner,
                side_effects,
                external_readers,
                memory_writers,
                guard: &guard,
                gateway: self.gateway.as_ref(),
                channel: gw_channel,
                store: &self.store,
                run_id: &seg.run_id,
                lease: &lease,
                writer: tx.clone(),
                in_flight: &in_flight,
                stopper,
                max_queued_task_agents: self.fair_use.max_queued_task_agents,
                time_zone: seg.time_zone.as_ref().and_then(|z| z.iana_name()),
            };
            let sink = WriterSink {
                tx,
                in_flight: in_flight.clone(),
                stop: stopper.token.clone(),
            };
            // Dropped at its next step: a model call is cut, a read in flight is abandoned
            // (the run's end answers it), a side effect already sent is waited for.
            tokio::select! {
                biased;
                () = writer::stopped_between_effects(stopper, &in_flight, cancel_grace) => None,
                out = executor.run(&request, &runner, &sink) => Some(out),
            }
        };
        let (outcome, pumped) = tokio::join!(work, writer.pump(rx, stopper));
        drop(session);
        if let Err(e) = pumped {
            tracing::error!(run_id = %seg.run_id, error = %e, "the run could not record its progress");
        }
        Ok(match (outcome, stopper.reason()) {
            (_, Some(reason)) => Driven::Stopped(reason),
            (Some(outcome), None) => Driven::Finished(Box::new(outcome)),
            (None, None) => Driven::Stopped(StopReason::Cancelled),
        })
    }

    /// Ends a segment: its terminal commit (result, pause, cancel or error) with the lease
    /// freed. With the lease lost, nothing is written: the monitor ends the run.
    async fn end(&self, seg: &Segment, writer: &mut RunWriter, worked: Result<Driven, ApiError>) {
        match worked {
            Ok(Driven::Finished(outcome)) => {
                if let Err(e) = self.conclude(seg, writer, *outcome).await {
                    Self::fail(writer, &e.to_string());
                }
            }
            Ok(Driven::Stopped(StopReason::Cancelled)) => {
                // The reason was given to whichever replica took the CancelRun.
                let reason = match self.store.get_run(&seg.owner, &seg.run_id).await {
                    Ok(run) => run.and_then(|r| r.cancel_reason),
                    Err(e) => {
                        tracing::warn!(run_id = %seg.run_id, error = %e, "could not read why the run was cancelled");
                        None
                    }
                };
                writer.answer_stopped_calls("cancelled", "CANCELLED");
                Self::cancelled_ending(writer, &cancelled_message(reason.as_deref()));
            }
            Ok(Driven::Stopped(StopReason::Shutdown)) => {
                writer.answer_stopped_calls("stopped by a restart of the service", "INTERRUPTED");
                let decision_untouched = writer
                    .actions
                    .values()
                    .any(|a| a.state == ActionState::AwaitingConfirmation);
                if decision_untouched {
                    // A continuation stopped before it carried out its user's decision: left
                    // live, so another replica's monitor carries it out (`take_up_decided`).
                    tracing::warn!(run_id = %seg.run_id, "shutting down before a decided approval was carried out: the run is handed to another replica's monitor");
                } else {
                    // Ended here, in the commit that hands the thread back, rather than left
                    // for another replica's monitor: its followers learn at once, in words that
                    // say what happened, and a task agent sees a restart, not a failure. Should
                    // this commit fail, the monitor ends the run when its lease lapses.
                    tracing::warn!(run_id = %seg.run_id, "shutting down: the run ends interrupted and its thread is handed back");
                    Self::fail_as(writer, INTERRUPTED_MESSAGE, pb::FailureKind::Interrupted);
                }
            }
            Ok(Driven::Stopped(StopReason::LeaseLost)) => {
                tracing::error!(run_id = %seg.run_id, "the run lost its lease; the health monitor will end it");
                return;
            }
            Ok(Driven::Stopped(StopReason::WriteFailed(why))) => {
                writer.answer_stopped_calls("stopped by a failed write", "INTERRUPTED");
                Self::fail(
                    writer,
                    &format!("the run could not record its progress ({why})"),
                );
            }
            Err(e) => {
                tracing::error!(run_id = %seg.run_id, error = %e, "run failed outside the model loop");
                // Within a run, Unavailable is gateway-svc (the stores fail as ApiError::Store).
                let kind = match e {
                    ApiError::Unavailable(_) => pb::FailureKind::GatewayUnavailable,
                    _ => pb::FailureKind::Internal,
                };
                Self::fail_as(writer, &e.to_string(), kind);
            }
        }
        writer.pending().release = true;
        let state = writer.pending().patch.state;
        // What a cancelled run's end says, should its commit be refused and redone.
        let cancelled = (state == Some(RunState::Cancelled))
            .then(|| writer.pending().patch.error.clone())
            .flatten();
        match writer.flush().await {
            Ok(()) => {
                if let Some(state) = state {
                    crate::metrics::run_ended(state.key());
                    // Counted once its approval is stored (a refused pause stores none).
                    if state == RunState::AwaitingConfirmation {
                        crate::metrics::approval_requested();
                        self.cancelled_while_pausing(seg).await;
                    }
                    // One line per run segment; the run span adds run_id, thread_id, trace_id.
                    tracing::info!(state = state.key(), "run segment ended");
                }
            }
            Err(StoreError::LeaseLost) => {
                tracing::error!(run_id = %seg.run_id, "the run lost its lease before its end was recorded; the health monitor will end it");
            }
            Err(StoreError::Rejected(why)) => {
                self.end_refused(seg, writer, &why, cancelled).await;
            }
            Err(e) => {
                tracing::error!(run_id = %seg.run_id, error = %e, "could not record the run's end; the health monitor will end it when its lease lapses");
                let _ = self.store.release_lease(&writer.lease).await;
            }
        }
    }

    /// How long a cancel waits for a side effect already sent: as long as the call itself may
    /// take.
    fn cancel_grace(&self) -> Duration {
        self.gateway
            .as_ref()
            .map_or(Duration::ZERO, |g| g.call_timeout + Duration::from_secs(5))
    }

    /// Ends a run paused for approval as cancelled (`ending`), counted: false when it was not
    /// paused.
    async fn end_paused(&self, run_id: &str, ending: &Ending) -> Result<bool, StoreError> {
        let ended = self.store.end_paused(run_id, ending).await?;
        if ended {
            crate::metrics::run_ended(RunState::Cancelled.key());
        }
        Ok(ended)
    }

    /// A CancelRun that set the run's flag while its pause was being committed found it
    /// executing, so nothing ended the pause: the run would wait for a decision its user
    /// cancelled. The flag, read after the pause is durable, ends it as a paused run's cancel.
    async fn cancelled_while_pausing(&self, seg: &Segment) {
        let run = match self.store.get_run(&seg.owner, &seg.run_id).await {
            Ok(Some(run)) if run.cancel_requested => run,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(run_id = %seg.run_id, error = %e, "could not check for a cancel after pausing");
                return;
            }
        };
        let ending = cancel_ending(&cancelled_message(run.cancel_reason.as_deref()), 1);
        match self.end_paused(&seg.run_id, &ending).await {
            Ok(true) => {
                tracing::info!(run_id = %seg.run_id, "a cancel that came while the run paused ended it");
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(run_id = %seg.run_id, error = %e, "could not end a paused run its caller cancelled");
            }
        }
    }

    /// The database refused the run's last commit for good — sent again it fails the same
    /// way, and the health monitor would end the run minutes later as if its server had
    /// stopped responding. What it refused is set aside (logged by count, not content) and the
    /// failure, naming the database's reason, is recorded alone.
    ///
    /// A run its canceller stopped ends cancelled all the same (`cancelled`: what its end
    /// says), not failed — a task agent or a schedule would retry a failure.
    async fn end_refused(
        &self,
        seg: &Segment,
        writer: &mut RunWriter,
        why: &str,
        cancelled: Option<String>,
    ) {
        let set_aside = writer.set_aside_refused();
        tracing::error!(run_id = %seg.run_id, error = %why, %set_aside, "the database refused the run's progress for good; recording its end without it");
        let message = format!(
            "the run could not record its progress (the database refused it for good: {why})"
        );
        let end = |writer: &mut RunWriter, note: bool| match &cancelled {
            Some(said) => Self::cancelled_ending(writer, said),
            None if note => Self::fail(writer, &message),
            None => Self::failed_ending(writer, &message, pb::FailureKind::Internal),
        };
        end(writer, true);
        writer.pending().release = true;
        let mut flushed = writer.flush().await;
        if let Err(StoreError::Rejected(again)) = &flushed {
            // Even that is refused (a rule on every message or on the run's row, a revoked
            // grant): the end is recorded bare — state, error and terminal event, without the
            // thread note, the run's accounting or any audit record.
            tracing::error!(run_id = %seg.run_id, error = %again, "the database refused the run's end too; recording it bare");
            writer.set_aside_refused();
            writer.pending().patch = RunPatch::default();
            writer.pending().audit.clear();
            end(writer, false);
            writer.pending().release = true;
            flushed = writer.flush().await;
        }
        let state = match cancelled {
            Some(_) => RunState::Cancelled,
            None => RunState::Failed,
        };
        match flushed {
            Ok(()) => crate::metrics::run_ended(state.key()),
            Err(e) => {
                tracing::error!(run_id = %seg.run_id, error = %e, "could not record the run's failure either; the health monitor will end it when its lease lapses");
                let _ = self.store.release_lease(&writer.lease).await;
            }
        }
    }

    /// The run's row and terminal event say it was cancelled, with `message`.
    fn cancelled_ending(writer: &mut RunWriter, message: &str) {
        writer.pending().patch.merge(RunPatch {
            state: Some(RunState::Cancelled),
            error: Some(message.to_owned()),
            failure_kind: Some("cancelled".into()),
            finished_at: Some(SystemTime::now()),
            ..RunPatch::default()
        });
        writer.emit(cancelled_result(message));
    }

    /// An internal failure: the run fails with the message, shown in the thread.
    fn fail(writer: &mut RunWriter, message: &str) {
        Self::fail_as(writer, message, pb::FailureKind::Internal);
    }

    /// The run fails with the message, shown in the thread, and its failure kind.
    fn fail_as(writer: &mut RunWriter, message: &str, kind: pb::FailureKind) {
        writer
            .pending()
            .messages
            .push(NewMessage::text(MessageSource::Error, message));
        Self::failed_ending(writer, message, kind);
    }

    /// The run's row and terminal event say it failed, with the message and its kind.
    fn failed_ending(writer: &mut RunWriter, message: &str, kind: pb::FailureKind) {
        let key = match kind {
            pb::FailureKind::GatewayUnavailable => "gateway_unavailable",
            pb::FailureKind::Interrupted => "interrupted",
            _ => "internal",
        };
        writer.pending().patch.merge(RunPatch {
            state: Some(RunState::Failed),
            error: Some(message.to_owned()),
            failure_kind: Some(key.into()),
            finished_at: Some(SystemTime::now()),
            ..RunPatch::default()
        });
        writer.emit(pb::run_event::Kind::Error(pb::ErrorEvent {
            message: message.to_owned(),
            kind: kind as i32,
        }));
    }

    /// The executor finished: the answer, a pause for approval, or a failure, with usage.
    async fn conclude(
        &self,
        seg: &Segment,
        writer: &mut RunWriter,
        mut outcome: executor::Outcome,
    ) -> Result<(), ApiError> {
        if seg.channel == limits::Channel::SessionOpen && outcome.model_text_empty {
            // E-5, S0 AC-17: a session opening with nothing to say stays silent, loudly in logs.
            tracing::error!(
                run_id = %seg.run_id,
                "the model returned no text for a session opening; answering silent"
            );
            outcome.text = String::new();
        }
        // Every call's cost reached the writer as it answered (a continuation's on top of the
        // run's earlier segments'), and the pump has taken in all the executor sent.
        let usage = writer.spent.clone();
        let iterations = writer.iterations_before + outcome.iterations;
        // A continuation whose segment made no call keeps the model its run last used.
        let model = usage
            .calls
            .last()
            .map(|c| c.model.clone())
            .unwrap_or_default();
        let usage_pb = convert::run_usage(&usage);

        if let Stop::AwaitingApproval {
            call_id,
            name,
            arguments,
            reason,
        } = &outcome.stop
        {
            let now = SystemTime::now();
            let shown = writer.guard.take_preview(call_id).unwrap_or_else(|| {
                crate::gateway_client::CallPreview {
                    text: crate::policy::preview(name, arguments),
                    ..Default::default()
                }
            });
            let approval = Approval {
                id: uuid::Uuid::new_v4().to_string(),
                run_id: seg.run_id.clone(),
                thread_id: seg.thread_id.clone(),
                owner: seg.owner.clone(),
                call_id: call_id.clone(),
                tool: name.clone(),
                arguments: arguments.clone(),
                args_sha256: sha256_hex(arguments),
                preview: shown.text,
                reason: reason.clone(),
                state: ApprovalState::Pending,
                created_at: now,
                expires_at: now + self.approval_ttl,
                decided_by: None,
                decided_at: None,
                binding: shown.binding,
                tainted_by: writer.guard.read_from(),
                allowed_tools: writer.allowed_tools.clone(),
            };
            if let Some(a) = writer.actions.get_mut(call_id) {
                a.to(ActionState::AwaitingConfirmation);
                a.approval_id = Some(approval.id.clone());
            }
            writer.stage_action(call_id);
            let approval_pb = convert::approval(&approval);
            let pending = writer.pending();
            pending.audit.push((
                "approval_requested".into(),
                serde_json::json!({"approval_id": approval.id, "tool": name, "preview": approval.preview}),
            ));
            pending.messages.push(NewMessage {
                metadata: serde_json::json!({"approval_id": approval.id}),
                ..NewMessage::text(MessageSource::Agent, outcome.text.clone())
            });
            pending.patch.merge(RunPatch {
                state: Some(RunState::AwaitingConfirmation),
                model: Some(model.clone()),
                usage: Some(usage),
                iterations: Some(iterations),
                summary: Some(outcome.text.clone()),
                ..RunPatch::default()
            });
            pending.approval = Some(approval);
            writer.emit(pb::run_event::Kind::ApprovalRequired(Box::new(
                pb::ApprovalRequiredEvent {
                    approval: Some(approval_pb.clone()),
                },
            )));
            writer.emit(pb::run_event::Kind::Result(Box::new(pb::RunResult {
                run_id: seg.run_id.clone(),
                thread_id: seg.thread_id.clone(),
                action_id: action_id(&seg.run_id, call_id),
                status: pb::RunState::AwaitingConfirmation as i32,
                summary: outcome.text.clone(),
                mode: pb::ResultMode::RequiresApproval as i32,
                model,
                tool: name.clone(),
                tool_args: convert::json_to_struct(arguments),
                approval: Some(approval_pb),
                usage: Some(usage_pb),
                ..pb::RunResult::default()
            })));
            return Ok(());
        }

        let (state, failure, mode) = match &outcome.stop {
            Stop::ModelUnavailable(_) => (
                RunState::Failed,
                Some("model_unavailable"),
                pb::ResultMode::AssistantText,
            ),
            Stop::UnknownTool(_) => (
                RunState::Failed,
                Some("unknown_tool"),
                pb::ResultMode::AssistantText,
            ),
            Stop::SentMessage => (RunState::Completed, None, pb::ResultMode::ToolExecuted),
            _ => (RunState::Completed, None, pb::ResultMode::AssistantText),
        };
        let error = match &outcome.stop {
            Stop::ModelUnavailable(why) => Some(format!("every model failed: {why}")),
            Stop::UnknownTool(name) => Some(format!("the model called an unknown tool: {name}")),
            _ => None,
        };
        let pending = writer.pending();
        if !outcome.text.is_empty() {
            let source = if state == RunState::Failed {
                MessageSource::Error
            } else {
                MessageSource::Agent
            };
            pending
                .messages
                .push(NewMessage::text(source, outcome.text.clone()));
        }
        pending.patch.merge(RunPatch {
            state: Some(state),
            model: Some(model.clone()),
            usage: Some(usage),
            iterations: Some(iterations),
            error: error.clone(),
            failure_kind: failure.map(str::to_owned),
            summary: Some(outcome.text.clone()),
            finished_at: Some(SystemTime::now()),
            ..RunPatch::default()
        });
        writer.emit(pb::run_event::Kind::Result(Box::new(pb::RunResult {
            run_id: seg.run_id.clone(),
            action_id: outcome
                .last_tool_call
                .as_ref()
                .map(|c| action_id(&seg.run_id, c))
                .unwrap_or_default(),
            thread_id: seg.thread_id.clone(),
            status: convert::run_state(state) as i32,
            summary: outcome.text.clone(),
            mode: mode as i32,
            model,
            tool: outcome
                .last_tool
                .as_ref()
                .map(|(n, _)| n.clone())
                .unwrap_or_default(),
            tool_args: outcome
                .last_tool
                .as_ref()
                .and_then(|(_, a)| convert::json_to_struct(a)),
            approval: None,
            output: None,
            usage: Some(usage_pb),
            error: error.unwrap_or_default(),
            failure_kind: convert::failure_kind(failure) as i32,
        })));
        Ok(())
    }

    /// CancelRun: a running run (on any replica) stops at its next step and ends cancelled; a
    /// run paused for approval ends now and its approval can no longer be used. `reason`, when
    /// given, goes to the audit trail and into the run's terminal event and error, whichever
    /// replica (or, if that one died, the health monitor) ends it.
    pub async fn cancel(
        &self,
        owner: &str,
        run_id: &str,
        reason: Option<&str>,
    ) -> Result<Run, ApiError> {
        let run = self
            .store
            .get_run(owner, run_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("run {run_id}")))?;
        if run.state.is_terminal() {
            return Err(ApiError::FailedPrecondition(format!(
                "run {run_id} already ended ({})",
                run.state.key()
            )));
        }
        if let Some(reason) = reason {
            let detail = serde_json::json!({ "reason": reason });
            self.store
                .record_audit(owner, "cancel_requested", Some(run_id), detail)
                .await?;
        }
        let ending = cancel_ending(&cancelled_message(reason), 1);
        // A run can move between paused and running while this goes on (a decision resumes
        // it, the resumed segment pauses again): each is tried against the state it is in now,
        // a few times, before the cancel is reported as not taken.
        let mut state = run.state;
        for _ in 0..3 {
            let taken = if state == RunState::AwaitingConfirmation {
                self.end_paused(run_id, &ending).await?
            } else {
                let requested = self.store.request_cancel(run_id, reason).await?;
                if let Some(stopper) = self
                    .live
                    .cancels
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(run_id)
                {
                    stopper.stop(StopReason::Cancelled);
                }
                requested
            };
            let now = self
                .store
                .get_run(owner, run_id)
                .await?
                .unwrap_or(run.clone());
            if taken || now.state.is_terminal() {
                return Ok(now);
            }
            state = now.state;
        }
        Err(ApiError::Aborted(format!(
            "run {run_id} kept changing state while it was being cancelled; cancel it again"
        )))
    }

    /// WatchRun (A-8): the run's events after `after`, then live ones, ending after the
    /// terminal event — at once when the run already ended and nothing is after `after`.
    /// Counts against the caller's open watchers.
    pub async fn watch(
        self: &Arc<Self>,
        owner: &str,
        run_id: &str,
        after: u64,
    ) -> Result<impl Stream<Item = Result<pb::RunEvent, tonic::Status>> + Send + 'static, ApiError>
    {
        let slot = self.follower_slot(owner)?;
        let events = self.follow(owner, run_id, after, Deliver::Every).await?;
        Ok(tokio_stream::StreamExt::map(events, move |e| {
            let _held = &slot;
            e
        }))
    }

    /// One of `owner`'s followed runs on this replica (R-4), held by a Run or DecideApproval
    /// call while it waits for the run's result.
    pub fn follower_slot(&self, owner: &str) -> Result<WatchSlot, ApiError> {
        WatchSlot::take(&self.watchers, owner, self.fair_use.max_watchers)
    }

    /// RunStream: starts a run and watches it from its first event, as [`watch`] does,
    /// without reading the run first (see [`follow_started`]).
    ///
    /// [`watch`]: RunService::watch
    /// [`follow_started`]: RunService::follow_started
    pub async fn start_watched(
        self: &Arc<Self>,
        owner: &str,
        input: RunInput,
    ) -> Result<impl Stream<Item = Result<pb::RunEvent, tonic::Status>> + Send + 'static, ApiError>
    {
        // The slot first (R-4): a caller refused its stream must not leave behind a run it
        // cannot see, whose retry would start it again or find its thread busy.
        let slot = self.follower_slot(owner)?;
        let (run_id, thread_id) = self.start(owner, input).await?;
        let events = self.follow_started(&run_id, &thread_id, Deliver::Every);
        Ok(tokio_stream::StreamExt::map(events, move |e| {
            let _held = &slot;
            e
        }))
    }

    /// Follows a run [`start`](RunService::start) just returned, from its first event. Its
    /// thread is known and a run always has events, so there is nothing to read first: one
    /// round trip and transaction fewer per run (issue 13). A run that already ended (a
    /// repeated request id) is replayed from the store to its terminal event, as any watch is.
    pub fn follow_started(
        self: &Arc<Self>,
        run_id: &str,
        thread_id: &str,
        deliver: Deliver,
    ) -> Watch {
        live::Follow::new(
            self.live.clone(),
            self.store.clone(),
            run_id,
            thread_id.to_owned(),
            0,
            deliver,
        )
        .start()
    }

    /// The run's result as it stands, following it past each result in its log to the last
    /// (and waiting while it goes on). A caller that repeats a request (a request id, a
    /// schedule's occurrence taken over) is owed this, not the first result: a run that
    /// paused, was approved and went on holds its pause's result first.
    pub async fn latest_result(
        self: &Arc<Self>,
        owner: &str,
        run_id: &str,
    ) -> Result<Option<pb::RunResult>, tonic::Status> {
        let (mut latest, mut after) = (None, 0);
        loop {
            let mut events = self.follow(owner, run_id, after, Deliver::End).await?;
            // Each follow delivers only what is after `after`, so this ends.
            match events.result().await? {
                Some((seq, result)) => (after, latest) = (seq, Some(result)),
                None => return Ok(latest),
            }
        }
    }

    /// Follows a run for this service's own callers (Run, DecideApproval, OpenSession).
    pub async fn follow(
        self: &Arc<Self>,
        owner: &str,
        run_id: &str,
        after: u64,
        deliver: Deliver,
    ) -> Result<Watch, ApiError> {
        let run = self
            .store
            .get_run(owner, run_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("run {run_id}")))?;
        if live::Follow::already_over(run.state, run.last_event_seq, after) {
            return Ok(Watch::over());
        }
        // No caller can have seen an event further on than the volatile ones a writer shows
        // before their commit; a watch from past them would wait for events that never come.
        if after >= run.last_event_seq.saturating_add(ABANDONED_SEQ_GAP) {
            return Err(ApiError::InvalidArgument(format!(
                "after_seq {after} is past run {run_id}'s last event ({}); pass 0, or the seq of an event you received",
                run.last_event_seq
            )));
        }
        Ok(live::Follow::new(
            self.live.clone(),
            self.store.clone(),
            run_id,
            run.thread_id,
            after,
            deliver,
        )
        .start())
    }
}

/// One run a user follows on this replica (an open stream, a waiting Run or DecideApproval);
/// freed when dropped.
pub struct WatchSlot {
    watchers: Arc<Mutex<HashMap<String, u32>>>,
    owner: String,
}

impl WatchSlot {
    fn take(
        watchers: &Arc<Mutex<HashMap<String, u32>>>,
        owner: &str,
        max: u32,
    ) -> Result<Self, ApiError> {
        let mut open = watchers.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(owner.to_owned()).or_default();
        if *n >= max {
            return Err(ApiError::ResourceExhausted(format!(
                "you are following {n} runs on this server (open streams and waiting Run or DecideApproval calls), the limit (AGENT_MAX_WATCHERS_PER_USER) is {max}; close one first"
            )));
        }
        *n += 1;
        crate::metrics::watchers(1.0);
        Ok(Self {
            watchers: watchers.clone(),
            owner: owner.to_owned(),
        })
    }
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        crate::metrics::watchers(-1.0);
        let mut open = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.owner) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.owner);
            }
        }
    }
}

/// Runs `work` as a task of its own, in the caller's span, so a caller that goes away (a reset
/// stream, a deadline) cannot drop it half done. Nothing aborts the task: if it did not finish,
/// it ended with the runtime (the service is stopping: `shutting_down` is the answer) or
/// panicked, and the panic goes on here as if it had happened in this call.
async fn in_own_task<T: Send + 'static>(
    work: impl Future<Output = Result<T, ApiError>> + Send + 'static,
    shutting_down: &str,
) -> Result<T, ApiError> {
    match tokio::spawn(tracing::Instrument::in_current_span(work)).await {
        Ok(done) => done,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => Err(ApiError::Unavailable(shutting_down.into())),
        },
    }
}

fn encode(kind: pb::run_event::Kind) -> Vec<u8> {
    pb::RunEvent {
        time: Some(convert::timestamp(SystemTime::now())),
        kind: Some(kind),
        ..pb::RunEvent::default()
    }
    .encode_to_vec()
}

fn to_json(turn: &Turn) -> Result<crate::store::TurnJson, ApiError> {
    serde_json::to_string(turn)
        .map(String::into_boxed_str)
        .map_err(|e| ApiError::Unavailable(format!("could not serialize the transcript: {e}")))
}

/// What a cancelled run's end says, with the reason its canceller gave.
fn cancelled_message(reason: Option<&str>) -> String {
    match reason {
        Some(reason) => format!("The run was cancelled: {reason}"),
        None => "The run was cancelled.".to_owned(),
    }
}

/// The end of a run nobody will finish, cancelled with `message` (the terminal event
/// `seq_gap` past the last durable one).
fn cancel_ending(message: &str, seq_gap: u64) -> Ending {
    Ending {
        state: RunState::Cancelled,
        error: message.to_owned(),
        failure_kind: "cancelled".into(),
        event: encode(cancelled_result(message)),
        seq_gap,
        message: None,
    }
}

fn cancelled_result(message: &str) -> pb::run_event::Kind {
    pb::run_event::Kind::Result(Box::new(pb::RunResult {
        status: pb::RunState::Cancelled as i32,
        summary: message.to_owned(),
        mode: pb::ResultMode::AssistantText as i32,
        error: message.to_owned(),
        failure_kind: pb::FailureKind::Cancelled as i32,
        ..pb::RunResult::default()
    }))
}

fn event_kind(run_id: &str, e: RunEvent) -> Option<pb::run_event::Kind> {
    use pb::run_event::Kind;
    Some(match e {
        RunEvent::Planning { iteration } => Kind::Status(pb::StatusEvent {
            state: pb::RunState::Planning as i32,
            detail: format!("iteration {iteration}"),
        }),
        RunEvent::Executing { calls } => Kind::Status(pb::StatusEvent {
            state: pb::RunState::Executing as i32,
            detail: format!("{calls} tool calls"),
        }),
        RunEvent::TextDelta(text) => Kind::Delta(pb::DeltaEvent { text, reset: false }),
        RunEvent::ThinkingDelta(text) => Kind::ThoughtDelta(pb::ThoughtDeltaEvent { text }),
        RunEvent::DeltaReset | RunEvent::Turn(_) | RunEvent::ModelCall(_) => return None,
        RunEvent::ToolCall {
            call_id,
            name,
            preview,
            ..
        } => Kind::ToolCall(pb::ToolCallEvent {
            action_id: action_id(run_id, &call_id),
            call_id,
            tool: name,
            preview,
        }),
        RunEvent::ToolResult {
            call_id,
            name,
            ok,
            preview,
            error_kind,
            truncated,
            ..
        } => Kind::ToolResult(pb::ToolResultEvent {
            action_id: action_id(run_id, &call_id),
            call_id,
            tool: name,
            ok,
            preview,
            error_kind,
            truncated,
        }),
    })
}

fn gateway_channel(c: limits::Channel) -> gw::Channel {
    match c {
        limits::Channel::Web => gw::Channel::Web,
        limits::Channel::Telegram => gw::Channel::Telegram,
        limits::Channel::SessionOpen => gw::Channel::SessionOpen,
        limits::Channel::Scheduled => gw::Channel::Scheduled,
        limits::Channel::Heartbeat | limits::Channel::TaskAgent => gw::Channel::Heartbeat,
    }
}

/// A tool outcome for calls that could not be made.
fn unavailable(text: &str) -> ToolOutcome {
    ToolOutcome {
        ok: false,
        text: text.to_owned(),
        error_kind: "UPSTREAM_UNAVAILABLE".into(),
        truncated: false,
        external: false,
    }
}

/// The ids of the task agents `history` shows this thread starting, the latest
/// [`PROMPT_TASK_AGENTS`]: what `create_task_agent` answered (fenced as its result) when it
/// queued one.
fn started_task_agents(history: &[Turn]) -> Vec<&str> {
    let mut ids: Vec<&str> = history
        .iter()
        .filter_map(|t| match t {
            Turn::ToolResult {
                name,
                content,
                is_error: false,
                ..
            } if name == TASK_AGENT_TOOL => content
                .split_once(tools::TASK_STARTED)
                .and_then(|(_, rest)| rest.split(';').next()),
            _ => None,
        })
        .collect();
    let skip = ids.len().saturating_sub(PROMPT_TASK_AGENTS);
    ids.drain(..skip);
    ids
}

/// How many of a thread's task agents its prompt shows, and how much of each report.
const PROMPT_TASK_AGENTS: usize = 3;
const TASK_REPORT_CHARS: usize = 2000;

/// How the ids of threads begin whose runs Steward itself starts (a task agent's, a
/// schedule's own), rather than its user holding a conversation there. Callers never name
/// new threads (their ids are UUIDs), so a prefix cannot be claimed by a user's thread.
pub const STEWARD_THREAD_PREFIXES: [&str; 2] = [
    background::TASK_THREAD_PREFIX,
    scheduled::SCHEDULE_THREAD_PREFIX,
];

/// A run refused because `thread_id` has a run going (`active`).
fn thread_busy(thread_id: &str, active: &str) -> ApiError {
    ApiError::Aborted(format!(
        "thread {thread_id} already has an active run ({active}); wait for it to finish or cancel it"
    ))
}

/// A run refused because `thread_id` has a run waiting for the user's approval (`paused`).
fn thread_paused(thread_id: &str, paused: &str) -> ApiError {
    ApiError::Aborted(format!(
        "thread {thread_id} has a run waiting for your approval ({paused}); it runs once that is decided"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registers a segment of `run_id` as `spawn_segment` does.
    fn register(
        live: &Arc<live::Live>,
        stoppers: &Arc<Mutex<HashMap<String, Stopper>>>,
        run_id: &str,
    ) -> SegmentRegistered {
        let stopper = Stopper::default();
        live.cancels
            .lock()
            .unwrap()
            .insert(run_id.to_owned(), stopper.clone());
        stoppers
            .lock()
            .unwrap()
            .insert(run_id.to_owned(), stopper.clone());
        SegmentRegistered {
            live: live.clone(),
            stoppers: stoppers.clone(),
            run_id: run_id.to_owned(),
            stopper,
            live_run: live.open(run_id, 1),
            done: tokio_util::sync::CancellationToken::new(),
        }
    }

    #[tokio::test]
    async fn r2_a_segment_that_panics_still_closes_its_live_log_and_takes_down_its_registrations() {
        let (live, stoppers) = (Arc::new(live::Live::default()), Arc::default());
        let registered = register(&live, &stoppers, "r1");
        let (live_run, done) = (registered.live_run.clone(), registered.done.clone());
        let ended = tokio::spawn(async move {
            let _registered = registered;
            panic!("a bug in the run");
        })
        .await;
        assert!(ended.is_err_and(|e| e.is_panic()));
        let (_, _, closed) = live_run.since(1, false);
        assert!(closed, "followers are told to turn to the store");
        assert!(done.is_cancelled(), "the lease keeper stops");
        assert_eq!(live.registrations(), 0);
        assert!(stoppers.lock().unwrap().is_empty());
    }

    #[test]
    fn a_cancel_from_any_replica_stays_the_runs_stop_reason_whatever_fails_after_it() {
        let (live, stoppers) = (Arc::new(live::Live::default()), Arc::default());
        let running = register(&live, &stoppers, "r1");
        live.route(&crate::store::RunNotice::Cancel("r1".into()));
        // Its commit then fails: the run still ends CANCELLED, not FAILED.
        running
            .stopper
            .stop(StopReason::WriteFailed("database gone".into()));
        assert_eq!(running.stopper.reason(), Some(StopReason::Cancelled));
    }

    #[test]
    fn an_ended_segment_leaves_a_continuation_of_its_run_registered() {
        let (live, stoppers) = (Arc::new(live::Live::default()), Arc::default());
        let first = register(&live, &stoppers, "r1");
        let continuation = register(&live, &stoppers, "r1");
        drop(first);
        assert!(continuation.still_ours(), "its stopper stays for shutdown");
        assert!(
            live.cancels.lock().unwrap().contains_key("r1"),
            "CancelRun still reaches it"
        );
        drop(continuation);
        assert_eq!(live.registrations(), 0);
        assert!(stoppers.lock().unwrap().is_empty());
    }
}
