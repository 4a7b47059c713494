//! Runs from request to terminal event (A-1..A-5, A-8, E-11, S-2..S-4): thread ownership and
//! the execution lock, the user message persisted before the model is called, the executor
//! driven in its own task, every event numbered and persisted then announced, and exactly one
//! terminal event. RunStream and Run both just watch the persisted events, so a client that lost
//! its stream resumes on any replica with WatchRun.
//!
//! Persisted events are the wire `RunEvent` (one shape for RunStream, WatchRun and replay).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use prost::Message as _;
use steward_proto::agent::v1 as pb;
use steward_proto::gateway::v1 as gw;
use tokio::sync::{Notify, mpsc};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

use crate::{
    api::{ApiError, convert},
    executor::{
        self, APPROVAL_REQUIRED, EventSink, Executor, ModelSetup, RunEvent, RunRequest, Stop,
        ToolInvocation, ToolOutcome, ToolRunner, limits,
    },
    gateway_client::GatewayClient,
    llm::{
        ModelRequest, Turn,
        resilient::{self, ChainEntry, RetryPolicy},
    },
    policy::{Policy, Verdict},
    store::{
        Action, ActionState, Approval, ApprovalState, LockOutcome, MessageKind, MessageSource,
        ModelCallUsage, NewRunOutcome, Run, RunPatch, RunState, RunUsage, SharedStore, TaskAgent,
        action_id,
    },
};

#[derive(Debug, Clone, PartialEq)]
pub struct Attached {
    pub kind: String,
    pub id: String,
    pub title: String,
    pub snippet: String,
    pub meta: serde_json::Value,
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
    /// Set for a session opening: its guidance, the bootstrap context and the only tools it may
    /// use; the synthetic prompt is not stored as a user message.
    pub session: Option<SessionSetup>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SessionSetup {
    pub guidance: String,
    pub bootstrap: Option<String>,
    pub allowed_tools: Vec<String>,
}

mod approvals;
mod background;
mod tools;

pub use tools::{HISTORY_TOOL, TASK_AGENT_TOOL, sha256_hex};
use tools::{NoTools, PolicyRunner};

/// S1: the most recent 30 conversation entries go to the model.
const PLANNING_CONVERSATION: usize = 30;
/// How often a watcher re-reads the store when no local announcement comes (other replicas).
const WATCH_POLL: Duration = Duration::from_millis(200);

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
    /// The execution lock's lease; renewed while the run works (E-11).
    pub lease: Duration,
    bus: Mutex<HashMap<String, Arc<Notify>>>,
    cancels: Mutex<HashMap<String, CancellationToken>>,
}

impl RunService {
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
            bus: Mutex::default(),
            cancels: Mutex::default(),
        }
    }

    fn notifier(&self, run_id: &str) -> Arc<Notify> {
        let mut bus = self.bus.lock().unwrap_or_else(|e| e.into_inner());
        bus.entry(run_id.to_owned()).or_default().clone()
    }

    fn announce(&self, run_id: &str) {
        self.notifier(run_id).notify_waiters();
    }

    /// Starts a run (or finds the one a repeated request id started) and returns its id and
    /// thread. The work continues in its own task.
    pub async fn start(
        self: &Arc<Self>,
        owner: &str,
        input: RunInput,
    ) -> Result<(String, String), ApiError> {
        let models = self.models_for(input.model_override.as_deref())?;
        // A retried request finds the first run before anything new is created.
        if let Some(key) = &input.request_id
            && let Some(existing) = self.store.find_run_by_request(owner, key).await?
        {
            return Ok((existing.id, existing.thread_id));
        }
        let (thread, new_thread) = match &input.thread_id {
            Some(id) => {
                let t = self
                    .store
                    .get_thread(owner, id)
                    .await?
                    .ok_or_else(|| ApiError::NotFound(format!("thread {id}")))?;
                (t, false)
            }
            None => {
                let title: String = input.prompt.chars().take(80).collect();
                (
                    self.store
                        .create_thread(&uuid::Uuid::new_v4().to_string(), owner, &title)
                        .await?,
                    true,
                )
            }
        };
        let run_id = uuid::Uuid::new_v4().to_string();
        let now = SystemTime::now();
        // B-4: a message after AGENT_SESSION_TIMEOUT of quiet starts a new session; the old one
        // is archived first (checked before this message touches the thread).
        let archive_first = !new_thread && thread.updated_at + self.session_timeout <= now;
        let run = Run {
            id: run_id.clone(),
            thread_id: thread.id.clone(),
            owner: owner.to_owned(),
            request_id: input.request_id.clone(),
            state: RunState::Queued,
            channel: input.channel.key().to_owned(),
            model: String::new(),
            usage: RunUsage::default(),
            iterations: 0,
            error: None,
            failure_kind: None,
            summary: String::new(),
            cancel_requested: false,
            last_event_seq: 0,
            created_at: now,
            started_at: None,
            finished_at: None,
            prompt_sections: Vec::new(),
        };
        match self
            .store
            .lock_thread(&thread.id, &run_id, self.lease)
            .await?
        {
            LockOutcome::Acquired => {}
            LockOutcome::Busy { run_id: active } => {
                return Err(ApiError::Aborted(format!(
                    "thread {} already has an active run ({active}); wait for it to finish or cancel it",
                    thread.id
                )));
            }
        }
        if let NewRunOutcome::Duplicate { run_id: first } = self.store.create_run(&run).await? {
            self.store.release_lock(&thread.id, &run_id).await?;
            return Ok((first, thread.id));
        }
        // S-4: the user's message is stored before any model call (a session opening has none).
        if input.session.is_none() {
            self.store
                .add_message(
                    &thread.id,
                    Some(&run_id),
                    MessageSource::User,
                    MessageKind::Text,
                    &input.prompt,
                    serde_json::json!({}),
                )
                .await?;
        }
        let cancel = CancellationToken::new();
        self.cancels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(run_id.clone(), cancel.clone());
        self.append(
            &run_id,
            &thread.id,
            pb::run_event::Kind::Status(pb::StatusEvent {
                state: pb::RunState::Queued as i32,
                detail: String::new(),
            }),
        )
        .await?;
        let this = self.clone();
        let (owner, thread_id, id) = (owner.to_owned(), thread.id.clone(), run_id.clone());
        tokio::spawn(async move {
            this.execute(
                owner,
                thread_id,
                id,
                Work::Start {
                    input,
                    models,
                    new_thread,
                    archive_first,
                },
                cancel,
            )
            .await
        });
        Ok((run_id, thread.id))
    }

    fn models_for(&self, model_override: Option<&str>) -> Result<Arc<ModelSetup>, ApiError> {
        let Some(wanted) = model_override else {
            return Ok(self.models.clone());
        };
        let wanted_model = wanted.rsplit('/').next().unwrap_or(wanted);
        let Some(pos) = self
            .models
            .chain
            .iter()
            .position(|e| e.model == wanted_model)
        else {
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

    async fn append(
        &self,
        run_id: &str,
        thread_id: &str,
        kind: pb::run_event::Kind,
    ) -> Result<u64, ApiError> {
        let event = pb::RunEvent {
            run_id: run_id.to_owned(),
            seq: 0,
            time: Some(convert::timestamp(SystemTime::now())),
            thread_id: thread_id.to_owned(),
            kind: Some(kind),
        };
        let seq = self
            .store
            .append_event(run_id, &event.encode_to_vec())
            .await?;
        self.announce(run_id);
        Ok(seq)
    }

    /// The spawned part of a run: work, then exactly one terminal event, then the lock.
    async fn execute(
        self: Arc<Self>,
        owner: String,
        thread_id: String,
        run_id: String,
        work: Work,
        cancel: CancellationToken,
    ) {
        let outcome = match work {
            Work::Start {
                input,
                models,
                new_thread,
                archive_first,
            } => {
                if archive_first {
                    self.archive(&owner, &thread_id).await;
                }
                self.work(
                    &owner, &thread_id, &run_id, &input, models, new_thread, &cancel,
                )
                .await
            }
            Work::Continue { approval, approved } => {
                self.continue_after(&owner, &thread_id, &run_id, approval, approved, &cancel)
                    .await
            }
        };
        let terminal = match outcome {
            Ok(result) => pb::run_event::Kind::Result(result),
            Err(e) => {
                tracing::error!(run_id = %run_id, error = %e, "run failed outside the model loop");
                let message = e.to_string();
                let _ = self
                    .store
                    .update_run(
                        &run_id,
                        RunPatch {
                            state: Some(RunState::Failed),
                            error: Some(message.clone()),
                            failure_kind: Some("internal".into()),
                            finished_at: Some(SystemTime::now()),
                            ..RunPatch::default()
                        },
                    )
                    .await;
                let _ = self
                    .store
                    .add_message(
                        &thread_id,
                        Some(&run_id),
                        MessageSource::Error,
                        MessageKind::Text,
                        &message,
                        serde_json::json!({}),
                    )
                    .await;
                pb::run_event::Kind::Error(pb::ErrorEvent {
                    message,
                    kind: pb::FailureKind::Internal as i32,
                })
            }
        };
        // The lock goes first: a caller that sees the terminal event may send the next message
        // at once, and must not find the thread still busy.
        if let Err(e) = self.store.release_lock(&thread_id, &run_id).await {
            tracing::error!(run_id = %run_id, error = %e, "could not release the thread lock; it expires with its lease");
        }
        if let Err(e) = self.append(&run_id, &thread_id, terminal).await {
            tracing::error!(run_id = %run_id, error = %e, "could not persist the terminal event");
        }
        self.cancels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&run_id);
        self.bus
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&run_id);
    }

    async fn load_history(&self, thread_id: &str) -> Result<Vec<Turn>, ApiError> {
        let mut history = Vec::new();
        for value in self.store.history(thread_id).await? {
            match serde_json::from_value::<Turn>(value) {
                Ok(turn) => history.push(turn),
                // A turn this build cannot read is left out of the model's view, loudly.
                Err(e) => {
                    tracing::error!(thread_id, error = %e, "unreadable LLM history turn skipped")
                }
            }
        }
        Ok(history)
    }

    /// Tool calls left open by a paused run whose user moved on get a result now, so the
    /// transcript stays valid for every provider; their approvals can no longer be used.
    async fn close_open_calls(
        &self,
        thread_id: &str,
        history: &mut Vec<Turn>,
    ) -> Result<(), ApiError> {
        let answered: std::collections::HashSet<String> = history
            .iter()
            .filter_map(|t| {
                if let Turn::ToolResult { call_id, .. } = t {
                    Some(call_id.clone())
                } else {
                    None
                }
            })
            .collect();
        let open: Vec<(String, String)> = history
            .iter()
            .flat_map(|t| match t {
                Turn::Assistant { tool_calls, .. } => tool_calls
                    .iter()
                    .map(|c| (c.id.clone(), c.name.clone()))
                    .collect(),
                _ => Vec::new(),
            })
            .filter(|(id, _)| !answered.contains(id))
            .collect();
        if open.is_empty() {
            return Ok(());
        }
        let closing: Vec<Turn> = open
            .into_iter()
            .map(|(call_id, name)| Turn::ToolResult {
                call_id,
                name,
                content: "Not executed: the user moved on without approving it.".into(),
                is_error: true,
            })
            .collect();
        let values = closing
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ApiError::Unavailable(e.to_string()))?;
        self.store.append_history(thread_id, &values).await?;
        history.extend(closing);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn work(
        &self,
        owner: &str,
        thread_id: &str,
        run_id: &str,
        input: &RunInput,
        models: Arc<ModelSetup>,
        new_thread: bool,
        cancel: &CancellationToken,
    ) -> Result<pb::RunResult, ApiError> {
        self.store
            .update_run(
                run_id,
                RunPatch {
                    state: Some(RunState::Planning),
                    started_at: Some(SystemTime::now()),
                    ..RunPatch::default()
                },
            )
            .await?;
        let mut history = self.load_history(thread_id).await?;
        self.close_open_calls(thread_id, &mut history).await?;
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
        }
        let mut limits = limits::profile(input.channel, self.max_loop_steps);
        limits.max_total_tokens = input.max_total_tokens;
        limits.max_cost_usd = input.max_cost_usd;
        let about_user = self.about_user(owner, run_id, input).await;
        let recent_sessions = match self.store.recent_summaries(owner, self.summary_count).await {
            Ok(list) => list.into_iter().map(|a| a.summary).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "recent session summaries unavailable");
                Vec::new()
            }
        };
        let prompt = crate::prompt::build(
            &crate::prompt::PromptInput {
                channel: Some(input.channel),
                about_user,
                attached: input.attached.clone(),
                session_guidance: input.session.as_ref().map(|s| s.guidance.clone()),
                bootstrap: input.session.as_ref().and_then(|s| s.bootstrap.clone()),
                recent_sessions,
            },
            executor::budget::TokenCounter::for_model(
                models.chain.first().map_or("", |e| e.model.as_str()),
            ),
            SystemTime::now(),
        );
        self.store
            .update_run(
                run_id,
                RunPatch {
                    prompt_sections: Some(prompt.sections.clone()),
                    ..RunPatch::default()
                },
            )
            .await?;
        let request = RunRequest {
            system: prompt.text,
            history,
            prompt: input.prompt.clone(),
            tools: Vec::new(),
            limits,
            stop_after: None,
            resume: false,
        };
        let allowed = input.session.as_ref().map(|s| s.allowed_tools.as_slice());
        self.drive(
            owner,
            thread_id,
            run_id,
            input.channel,
            request,
            models,
            allowed,
            cancel,
        )
        .await
    }

    /// [ABOUT THE USER]: what memory holds that bears on the prompt. A failure never blocks
    /// the run (B-1); it is logged and the section left out.
    async fn about_user(&self, owner: &str, run_id: &str, input: &RunInput) -> Option<String> {
        let gateway = self.gateway.as_ref()?;
        let query = if input.session.is_some() {
            "preferences goals priorities".to_owned()
        } else {
            input.prompt.clone()
        };
        let outcome = gateway
            .execute_once(
                owner,
                run_id,
                gateway_channel(input.channel),
                "about-user",
                "search_memory",
                &serde_json::json!({ "query": query.chars().take(500).collect::<String>(), "limit": 5 }),
                "",
            )
            .await;
        if !outcome.ok {
            tracing::warn!(run_id, error = %outcome.text, "memory unavailable for [ABOUT THE USER]");
            return None;
        }
        // "No memories match ..." is a fact worth nothing in the prompt.
        (!outcome.text.starts_with("No memories")).then_some(outcome.text)
    }

    /// Lists the tools, opens the Execute stream behind the policy, runs the executor with its
    /// events persisted, and records the outcome.
    #[allow(clippy::too_many_arguments)]
    async fn drive(
        &self,
        owner: &str,
        thread_id: &str,
        run_id: &str,
        channel: limits::Channel,
        mut request: RunRequest,
        models: Arc<ModelSetup>,
        allowed: Option<&[String]>,
        cancel: &CancellationToken,
    ) -> Result<pb::RunResult, ApiError> {
        let gw_channel = gateway_channel(channel);
        let mut side_effects = std::collections::HashSet::new();
        if let Some(g) = &self.gateway {
            match g.list_tools(owner, gw_channel).await {
                Ok(list) => {
                    for t in list {
                        if allowed.is_some_and(|only| !only.contains(&t.decl.name)) {
                            continue;
                        }
                        if t.side_effect {
                            side_effects.insert(t.decl.name.clone());
                        }
                        request.tools.push(t.decl);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "tools unavailable for this run");
                    request.system.push_str("\n\nTools are unavailable right now; say so if the user needs data you cannot see.");
                }
            }
        }
        if allowed.is_none_or(|only| only.iter().any(|t| t == HISTORY_TOOL)) {
            request.tools.push(crate::llm::ToolDecl {
                name: HISTORY_TOOL.into(),
                description: "Search the user's past sessions with you (summaries and full text); up to 5, newest and best first.".into(),
                parameters: serde_json::json!({"type": "object", "additionalProperties": false, "required": ["query"], "properties": {
                    "query": {"type": "string", "minLength": 1, "maxLength": 300},
                    "timeframe_days": {"type": "integer", "minimum": 1, "maximum": 3650}}}),
            });
        }
        if channel != limits::Channel::TaskAgent
            && allowed.is_none_or(|only| only.iter().any(|t| t == TASK_AGENT_TOOL))
        {
            request.tools.push(crate::llm::ToolDecl {
                name: TASK_AGENT_TOOL.into(),
                description: "Start a background task agent for work that takes many steps; its result is posted to this thread when done.".into(),
                parameters: serde_json::json!({"type": "object", "additionalProperties": false, "required": ["instructions", "goal"], "properties": {
                    "instructions": {"type": "string", "minLength": 1, "maxLength": 4000},
                    "goal": {"type": "string", "minLength": 1, "maxLength": 500}}}),
            });
        }
        let session = match (&self.gateway, request.tools.is_empty()) {
            (Some(g), false) => Some(
                g.open(owner, run_id, gw_channel)
                    .await
                    .map_err(|e| ApiError::Unavailable(e.to_string()))?,
            ),
            _ => None,
        };
        let no_tools = NoTools;
        let inner: &dyn ToolRunner = match &session {
            Some(s) => s,
            None => &no_tools,
        };
        let runner = PolicyRunner {
            inner,
            thread_id,
            background: channel == limits::Channel::TaskAgent,
            policy: &self.policy,
            user: owner,
            side_effects: &side_effects,
            store: &self.store,
            run_id,
        };
        let executor = Executor {
            models,
            max_tool_result_chars: self.max_tool_result_chars,
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<RunEvent>();
        let sink = ChannelSink(tx);
        let writer = async {
            let mut tool_messages = Vec::new();
            while let Some(event) = rx.recv().await {
                match &event {
                    RunEvent::ToolCall {
                        call_id,
                        name,
                        args,
                        ..
                    } => {
                        let id = action_id(run_id, call_id);
                        let now = SystemTime::now();
                        self.store
                            .create_action(&Action {
                                id: id.clone(),
                                run_id: run_id.to_owned(),
                                call_id: call_id.clone(),
                                tool: name.clone(),
                                arguments: args.clone(),
                                side_effect: side_effects.contains(name),
                                state: ActionState::Planned,
                                result_text: None,
                                error_kind: None,
                                approval_id: None,
                                created_at: now,
                                updated_at: now,
                            })
                            .await?;
                        self.store
                            .update_action(&id, ActionState::Executing, None, None)
                            .await?;
                    }
                    RunEvent::ToolResult {
                        call_id,
                        name,
                        ok,
                        preview,
                        text,
                        error_kind,
                        ..
                    } => {
                        tool_messages.push((name.clone(), *ok, preview.clone()));
                        let state = if *ok {
                            ActionState::Completed
                        } else {
                            ActionState::Failed
                        };
                        let kind = Some(error_kind.as_str()).filter(|k| !k.is_empty());
                        self.store
                            .update_action(
                                &action_id(run_id, call_id),
                                state,
                                Some((text, kind)),
                                None,
                            )
                            .await?;
                    }
                    _ => {}
                }
                if let Some(kind) = event_kind(run_id, event) {
                    self.append(run_id, thread_id, kind).await?;
                }
            }
            Ok::<_, ApiError>(tool_messages)
        };
        let work = async {
            let out = tokio::select! {
                out = executor.run(&request, &runner, &sink) => Some(out),
                () = cancel.cancelled() => None,
                () = self.watch_cancel(owner, run_id, thread_id) => None,
            };
            drop(sink);
            out
        };
        let (outcome, written) = tokio::join!(work, writer);
        let tool_messages = written?;
        drop(session);
        let Some(outcome) = outcome else {
            return self.cancelled(run_id, thread_id).await;
        };
        for (name, ok, preview) in tool_messages {
            let content = format!("{} {name}: {preview}", if ok { "Ran" } else { "Tried" });
            self.store
                .add_message(
                    thread_id,
                    Some(run_id),
                    MessageSource::Agent,
                    MessageKind::Tool,
                    &content,
                    serde_json::json!({ "tool": name, "ok": ok }),
                )
                .await?;
        }
        let mut outcome = outcome;
        if channel == limits::Channel::SessionOpen && outcome.model_text_empty {
            // E-5, S0 AC-17: a session opening with nothing to say stays silent, loudly in logs.
            tracing::error!(
                run_id,
                "the model returned no text for a session opening; answering silent"
            );
            outcome.text = String::new();
        }
        self.finalize(owner, thread_id, run_id, outcome).await
    }

    async fn cancelled(&self, run_id: &str, thread_id: &str) -> Result<pb::RunResult, ApiError> {
        let message = "The run was cancelled.".to_owned();
        self.store
            .update_run(
                run_id,
                RunPatch {
                    state: Some(RunState::Cancelled),
                    error: Some(message.clone()),
                    failure_kind: Some("cancelled".into()),
                    finished_at: Some(SystemTime::now()),
                    ..RunPatch::default()
                },
            )
            .await?;
        Ok(pb::RunResult {
            run_id: run_id.into(),
            thread_id: thread_id.into(),
            status: pb::RunState::Cancelled as i32,
            summary: message.clone(),
            mode: pb::ResultMode::AssistantText as i32,
            error: message,
            failure_kind: pb::FailureKind::Cancelled as i32,
            ..pb::RunResult::default()
        })
    }

    async fn finalize(
        &self,
        owner: &str,
        thread_id: &str,
        run_id: &str,
        outcome: executor::Outcome,
    ) -> Result<pb::RunResult, ApiError> {
        let turns = outcome
            .new_turns
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                ApiError::Unavailable(format!("could not serialize the transcript: {e}"))
            })?;
        self.store.append_history(thread_id, &turns).await?;
        let usage = usage_of(&outcome);
        let model = outcome
            .calls
            .last()
            .map(|c| c.model.clone())
            .unwrap_or_default();
        let usage_pb = pb::Usage {
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            cached_tokens: usage.cached_tokens,
            cost_usd: usage.cost_usd,
            model_calls: usage.calls.len() as u32,
        };

        if let Stop::AwaitingApproval {
            call_id,
            name,
            arguments,
            reason,
        } = &outcome.stop
        {
            let now = SystemTime::now();
            let approval = Approval {
                id: uuid::Uuid::new_v4().to_string(),
                run_id: run_id.into(),
                thread_id: thread_id.into(),
                owner: owner.into(),
                call_id: call_id.clone(),
                tool: name.clone(),
                arguments: arguments.clone(),
                args_sha256: sha256_hex(arguments),
                preview: crate::policy::preview(name, arguments),
                reason: reason.clone(),
                state: ApprovalState::Pending,
                created_at: now,
                expires_at: now + self.approval_ttl,
                decided_by: None,
                decided_at: None,
            };
            self.store.create_approval(&approval).await?;
            self.store
                .update_action(
                    &action_id(run_id, call_id),
                    ActionState::AwaitingConfirmation,
                    None,
                    Some(&approval.id),
                )
                .await?;
            self.store
                .record_audit(owner, "approval_requested", Some(run_id), serde_json::json!({"approval_id": approval.id, "tool": name, "preview": approval.preview}))
                .await?;
            self.store
                .add_message(
                    thread_id,
                    Some(run_id),
                    MessageSource::Agent,
                    MessageKind::Text,
                    &outcome.text,
                    serde_json::json!({"approval_id": approval.id}),
                )
                .await?;
            self.store
                .update_run(
                    run_id,
                    RunPatch {
                        state: Some(RunState::AwaitingConfirmation),
                        model: Some(model.clone()),
                        usage: Some(usage.clone()),
                        iterations: Some(outcome.iterations),
                        summary: Some(outcome.text.clone()),
                        ..RunPatch::default()
                    },
                )
                .await?;
            let approval_pb = convert::approval(&approval);
            self.append(
                run_id,
                thread_id,
                pb::run_event::Kind::ApprovalRequired(pb::ApprovalRequiredEvent {
                    approval: Some(approval_pb.clone()),
                }),
            )
            .await?;
            return Ok(pb::RunResult {
                run_id: run_id.into(),
                thread_id: thread_id.into(),
                action_id: action_id(run_id, call_id),
                status: pb::RunState::AwaitingConfirmation as i32,
                summary: outcome.text.clone(),
                mode: pb::ResultMode::RequiresApproval as i32,
                model,
                tool: name.clone(),
                tool_args: convert::json_to_struct(arguments),
                approval: Some(approval_pb),
                usage: Some(usage_pb),
                ..pb::RunResult::default()
            });
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
        let source = if state == RunState::Failed {
            MessageSource::Error
        } else {
            MessageSource::Agent
        };
        if !outcome.text.is_empty() {
            self.store
                .add_message(
                    thread_id,
                    Some(run_id),
                    source,
                    MessageKind::Text,
                    &outcome.text,
                    serde_json::json!({}),
                )
                .await?;
        }
        let error = match &outcome.stop {
            Stop::ModelUnavailable(why) => Some(format!("every model failed: {why}")),
            Stop::UnknownTool(name) => Some(format!("the model called an unknown tool: {name}")),
            _ => None,
        };
        self.store
            .update_run(
                run_id,
                RunPatch {
                    state: Some(state),
                    model: Some(model.clone()),
                    usage: Some(usage.clone()),
                    iterations: Some(outcome.iterations),
                    error: error.clone(),
                    failure_kind: failure.map(str::to_owned),
                    summary: Some(outcome.text.clone()),
                    finished_at: Some(SystemTime::now()),
                    ..RunPatch::default()
                },
            )
            .await?;
        Ok(pb::RunResult {
            run_id: run_id.into(),
            action_id: outcome
                .last_tool_call
                .as_ref()
                .map(|c| action_id(run_id, c))
                .unwrap_or_default(),
            thread_id: thread_id.into(),
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
        })
    }

    /// Resolves when another replica asked to cancel this run; renews the lock lease meanwhile.
    async fn watch_cancel(&self, owner: &str, run_id: &str, thread_id: &str) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut since_renew = Duration::ZERO;
        loop {
            tick.tick().await;
            since_renew += Duration::from_secs(1);
            if since_renew >= self.lease / 3 {
                since_renew = Duration::ZERO;
                if let Err(e) = self.store.renew_lock(thread_id, run_id, self.lease).await {
                    tracing::warn!(run_id, error = %e, "could not renew the thread lock");
                }
            }
            if let Ok(Some(run)) = self.store.get_run(owner, run_id).await
                && run.cancel_requested
            {
                return;
            }
        }
    }

    /// CancelRun: marks the run (any replica's) and stops it here if it runs here.
    pub async fn cancel(&self, owner: &str, run_id: &str) -> Result<Run, ApiError> {
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
        self.store.request_cancel(run_id).await?;
        if let Some(token) = self
            .cancels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(run_id)
        {
            token.cancel();
        }
        Ok(self.store.get_run(owner, run_id).await?.unwrap_or(run))
    }

    /// The run's events after `after`, then live ones, ending after the terminal event.
    pub async fn watch(
        self: &Arc<Self>,
        owner: &str,
        run_id: &str,
        after: u64,
    ) -> Result<impl Stream<Item = Result<pb::RunEvent, tonic::Status>> + Send + 'static, ApiError>
    {
        self.store
            .get_run(owner, run_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("run {run_id}")))?;
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        let run_id = run_id.to_owned();
        tokio::spawn(async move {
            let mut last = after;
            loop {
                let notify = this.notifier(&run_id);
                let announced = notify.notified();
                tokio::pin!(announced);
                announced.as_mut().enable();
                let batch = match this.store.events_after(&run_id, last, 256).await {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = tx.send(Err(tonic::Status::from(ApiError::from(e)))).await;
                        return;
                    }
                };
                for (seq, payload) in batch {
                    last = seq;
                    let Ok(mut event) = pb::RunEvent::decode(payload.as_slice()) else {
                        continue;
                    };
                    event.seq = seq;
                    let terminal = matches!(
                        event.kind,
                        Some(pb::run_event::Kind::Result(_) | pb::run_event::Kind::Error(_))
                    );
                    if tx.send(Ok(event)).await.is_err() || terminal {
                        return;
                    }
                }
                tokio::select! {
                    () = &mut announced => {}
                    () = tokio::time::sleep(WATCH_POLL) => {}
                    () = tx.closed() => return,
                }
            }
        });
        Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

/// What a spawned run task does.
enum Work {
    Start {
        input: RunInput,
        models: Arc<ModelSetup>,
        new_thread: bool,
        /// Archive the previous session before this run (B-4).
        archive_first: bool,
    },
    Continue {
        approval: Approval,
        approved: bool,
    },
}

struct ChannelSink(mpsc::UnboundedSender<RunEvent>);

impl EventSink for ChannelSink {
    fn emit(&self, event: RunEvent) {
        let _ = self.0.send(event);
    }
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
        RunEvent::TextDelta(text) => Kind::Delta(pb::DeltaEvent { text }),
        RunEvent::ThinkingDelta(text) => Kind::ThoughtDelta(pb::ThoughtDeltaEvent { text }),
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

fn usage_of(outcome: &executor::Outcome) -> RunUsage {
    let total = outcome.total_usage();
    RunUsage {
        input_tokens: total.input_tokens,
        output_tokens: total.output_tokens,
        cached_tokens: total.cached_tokens,
        cost_usd: outcome.cost_usd(),
        calls: outcome
            .calls
            .iter()
            .map(|c| ModelCallUsage {
                provider: c.provider.clone(),
                model: c.model.clone(),
                input_tokens: c.usage.input_tokens,
                output_tokens: c.usage.output_tokens,
                cached_tokens: c.usage.cached_tokens,
                cost_usd: c.cost_usd,
                latency_ms: c.latency.as_millis() as u64,
                retries: c.retries,
            })
            .collect(),
    }
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
