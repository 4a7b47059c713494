//! What sits between the executor and the gateway: the approval policy on every call, and the
//! agent's own tools (search_agent_history, create_task_agent) answered here.

use super::*;
use crate::{
    executor::{APPROVAL_REQUIRED, ToolInvocation},
    gateway_client::{CallPreview, GatewayClient, OnceCall},
    policy::{TrustLevel, Verdict},
    runs::guard::CallGuard,
};

/// Applies the approval policy to every call before it reaches the gateway.
pub(super) struct PolicyRunner<'a> {
    pub(super) inner: &'a dyn ToolRunner,
    /// Task agents cannot ask for approval: what would need it is denied instead.
    pub(super) background: bool,
    pub(super) policy: &'a Policy,
    pub(super) user: &'a str,
    pub(super) side_effects: &'a std::collections::HashSet<String>,
    /// Tools whose output is someone else's words, and tools whose writes reach later prompts.
    pub(super) external_readers: &'a std::collections::HashSet<String>,
    pub(super) memory_writers: &'a std::collections::HashSet<String>,
    /// What the run has read; the previews of calls left for approval.
    pub(super) guard: &'a CallGuard,
    /// Previews come from the gateway, which resolves what a call would really do.
    pub(super) gateway: Option<&'a GatewayClient>,
    pub(super) channel: gw::Channel,
    pub(super) store: &'a SharedStore,
    pub(super) run_id: &'a str,
    /// The run's lease: a task agent is queued only while it holds.
    pub(super) lease: &'a Lease,
    /// The run's writer: calls are recorded as executing, durably, before they run.
    pub(super) writer: mpsc::UnboundedSender<WriterMsg>,
    /// Side effects sent and not yet answered: a stop waits for them.
    pub(super) in_flight: &'a writer::SideEffectsInFlight,
    /// The segment's stopper: a cancel found recorded before a side effect leaves stops it.
    pub(super) stopper: &'a writer::Stopper,
    pub(super) max_queued_task_agents: u32,
    /// The run's time zone, handed on to the task agents it starts.
    pub(super) time_zone: Option<&'a str>,
}

#[async_trait::async_trait]
impl ToolRunner for PolicyRunner<'_> {
    async fn run(&self, calls: Vec<ToolInvocation>) -> Vec<ToolOutcome> {
        let mut outcomes: Vec<Option<ToolOutcome>> = vec![None; calls.len()];
        let mut allowed = Vec::new();
        let mut positions = Vec::new();
        let mut paused = false;
        for (i, call) in calls.into_iter().enumerate() {
            // A stop that came while earlier calls of the batch were prepared (a preview, an
            // audit record) leaves the rest unprepared and unsent.
            if let Some(reason) = self.stopper.reason() {
                outcomes[i] = Some(not_run_for(&reason));
                continue;
            }
            if call.name == HISTORY_TOOL {
                let outcome = search_history(self.store, self.user, &call.args).await;
                if outcome.external {
                    self.guard.read(HISTORY_TOOL);
                }
                outcomes[i] = Some(outcome);
                continue;
            }
            if call.name == TASK_AGENT_TOOL {
                // Queuing a task is an effect too, treated as a side effect is: the call is
                // durable in the record first (a crash after the insert leaves a call the next
                // run closes from the queue, never a task nobody knows of), a cancel recorded
                // anywhere stops it, and once begun it is waited for.
                let checkpointed =
                    writer::checkpoint(&self.writer, vec![call.call_id.clone()], true).await;
                if checkpointed.is_ok() {
                    look_for_a_cancel(self.store, self.user, self.run_id, self.stopper).await;
                }
                outcomes[i] = Some(match (self.stopper.reason(), checkpointed) {
                    (Some(reason), _) => not_run_for(&reason),
                    (None, Err(why)) => unavailable(&format!(
                        "Not executed: the run could not record its progress ({why})."
                    )),
                    (None, Ok(())) => {
                        self.in_flight.sent(vec![call.call_id.clone()]);
                        enqueue_task_agent(
                            self.store,
                            self.user,
                            self.lease,
                            &call.call_id,
                            &call.args,
                            self.max_queued_task_agents,
                            self.time_zone,
                        )
                        .await
                    }
                });
                continue;
            }
            let side_effect = self.side_effects.contains(&call.name);
            let read_from = self.guard.read_from();
            let remembers_others =
                self.memory_writers.contains(&call.name) && !read_from.is_empty();
            let mut call = call;
            call.read_external_from = read_from.clone();
            let preview = if (side_effect && self.policy.wants_preview(self.user))
                || (remembers_others && self.policy.trust(self.user) != TrustLevel::Autonomous)
            {
                match self.preview(&call).await {
                    Ok(p) => Some(p),
                    Err(not_run) => {
                        outcomes[i] = Some(not_run);
                        continue;
                    }
                }
            } else {
                None
            };
            let verdict = if side_effect {
                self.policy.decide(
                    self.user,
                    &call.name,
                    true,
                    &call.args,
                    preview.as_ref().map(|p| p.recipients.as_slice()),
                )
            } else if remembers_others {
                self.policy
                    .decide_memory_write(self.user, &call.name, &read_from)
            } else {
                Verdict::Allow
            };
            match verdict {
                Verdict::Allow => {
                    // Held to what the decision saw: if it changes before execution, refused.
                    if let Some(p) = &preview {
                        call.expected_binding = p.binding.clone();
                    }
                    if side_effect
                        && let Err(e) = self
                            .store
                            .record_audit(
                                self.user,
                                "side_effect",
                                Some(self.run_id),
                                serde_json::json!({"tool": call.name, "call_id": call.call_id, "approval": "not required"}),
                            )
                            .await
                    {
                        // P-5: no side effect without its audit record.
                        outcomes[i] = Some(unavailable(&format!(
                            "Not executed: its audit record could not be written ({e}). Try again later."
                        )));
                        continue;
                    }
                    positions.push(i);
                    allowed.push(call);
                }
                Verdict::Deny(text) => {
                    outcomes[i] = Some(ToolOutcome {
                        ok: false,
                        text,
                        error_kind: "DENIED".into(),
                        truncated: false,
                        external: false,
                    });
                }
                Verdict::NeedsApproval(_) if self.background => {
                    outcomes[i] = Some(ToolOutcome {
                        ok: false,
                        text: format!(
                            "Denied: {} needs the user's approval, which a background task cannot ask for. Report it instead.",
                            call.name
                        ),
                        error_kind: "DENIED".into(),
                        truncated: false,
                        external: false,
                    });
                }
                Verdict::NeedsApproval(reason) if !paused => {
                    paused = true;
                    if let Some(p) = preview {
                        self.guard.keep_preview(&call.call_id, p);
                    }
                    outcomes[i] = Some(ToolOutcome {
                        ok: false,
                        text: reason,
                        error_kind: APPROVAL_REQUIRED.into(),
                        truncated: false,
                        external: false,
                    });
                }
                Verdict::NeedsApproval(_) => {
                    outcomes[i] = Some(ToolOutcome {
                        ok: false,
                        text: "Not executed: another action of this turn is waiting for approval; ask for this one again after it is decided.".into(),
                        error_kind: "DEFERRED".into(),
                        truncated: false,
                        external: false,
                    });
                }
            }
        }
        if !allowed.is_empty() {
            let ids = allowed.iter().map(|c| c.call_id.clone()).collect();
            let side: Vec<bool> = allowed
                .iter()
                .map(|c| self.side_effects.contains(&c.name))
                .collect();
            let checkpointed = writer::checkpoint(&self.writer, ids, side.contains(&true)).await;
            if checkpointed.is_ok() && side.contains(&true) {
                look_for_a_cancel(self.store, self.user, self.run_id, self.stopper).await;
            }
            // Any stop known by now, for whatever reason, keeps the batch unsent.
            let checkpointed = match self.stopper.reason() {
                Some(reason) => Err(Some(reason)),
                None => checkpointed.map_err(|why| {
                    for &pos in &positions {
                        outcomes[pos] = Some(unavailable(&format!(
                            "Not executed: the run could not record its progress ({why})."
                        )));
                    }
                    None
                }),
            };
            match checkpointed {
                Ok(()) => {
                    // Only now: a stop that came during the checkpoint drops the batch unsent.
                    self.in_flight.sent(
                        allowed
                            .iter()
                            .zip(&side)
                            .filter(|(_, side_effect)| **side_effect)
                            .map(|(c, _)| c.call_id.clone())
                            .collect(),
                    );
                    let names: Vec<String> = allowed.iter().map(|c| c.name.clone()).collect();
                    let results = self.inner.run(allowed).await;
                    for (((pos, outcome), side_effect), name) in
                        positions.into_iter().zip(results).zip(side).zip(names)
                    {
                        // A failure can carry others' words too (a remote tool's error).
                        if outcome.external || (outcome.ok && self.external_readers.contains(&name))
                        {
                            self.guard.read(&name);
                        }
                        outcomes[pos] = Some(ambiguity(outcome, side_effect));
                    }
                }
                Err(Some(reason)) => {
                    for pos in positions {
                        outcomes[pos] = Some(not_run_for(&reason));
                    }
                }
                Err(None) => {}
            }
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or(ToolOutcome {
                    ok: false,
                    text: "The tool did not answer.".into(),
                    error_kind: "INTERNAL".into(),
                    truncated: false,
                    external: false,
                })
            })
            .collect()
    }
}

impl PolicyRunner<'_> {
    /// What the call would do, resolved by the gateway. Without a gateway nothing can run
    /// anyway; the arguments' own preview stands in.
    async fn preview(&self, call: &ToolInvocation) -> Result<CallPreview, ToolOutcome> {
        let Some(gateway) = self.gateway else {
            return Ok(CallPreview {
                text: crate::policy::preview(&call.name, &call.args),
                ..CallPreview::default()
            });
        };
        gateway
            .preview(OnceCall {
                user: self.user,
                run_id: self.run_id,
                channel: self.channel,
                call_id: &call.call_id,
                tool: &call.name,
                args: &call.args,
                idempotency_key: "",
                read_external_from: &call.read_external_from,
                expected_binding: "",
                time_zone: self.time_zone.unwrap_or(""),
            })
            .await
    }
}

/// The answer of a call a stopped run did not send.
pub(super) fn not_run_for(reason: &writer::StopReason) -> ToolOutcome {
    // In the words the run's end uses for the calls it answers (`answer_stopped_calls`).
    let (why, error_kind) = match reason {
        writer::StopReason::Cancelled => ("cancelled", "CANCELLED"),
        writer::StopReason::Shutdown => ("stopped by a restart of the service", "INTERRUPTED"),
        writer::StopReason::WriteFailed(_) => ("stopped by a failed write", "INTERRUPTED"),
        writer::StopReason::LeaseLost => ("stopped", "INTERRUPTED"),
    };
    ToolOutcome {
        ok: false,
        text: format!("Not executed: the run was {why} before this call ran."),
        error_kind: error_kind.into(),
        truncated: false,
        external: false,
    }
}

/// A call whose outcome is unknown (the tool service stopped answering after the request
/// left): for a side effect the model is told it may have happened and must not be retried.
pub(super) fn ambiguity(outcome: ToolOutcome, side_effect: bool) -> ToolOutcome {
    if outcome.error_kind != crate::gateway_client::OUTCOME_UNKNOWN {
        return outcome;
    }
    ToolOutcome {
        text: if side_effect {
            "The outcome is unknown: the tool service stopped answering after the request was sent. It may have happened; do not retry it — tell the user to check.".into()
        } else {
            format!("{} Try again later.", outcome.text)
        },
        ..outcome
    }
}

/// The agent's own tool (B-5): queues a background task agent for this thread.
pub const TASK_AGENT_TOOL: &str = "create_task_agent";
/// How its answer begins, before the task's id (the prompt finds the thread's tasks by it).
pub(super) const TASK_STARTED: &str = "Started task agent ";

pub(super) fn task_agent_tool() -> crate::llm::ToolDecl {
    crate::llm::ToolDecl {
        name: TASK_AGENT_TOOL.into(),
        description: "Start a background task agent for work that takes many steps; its result is posted to this thread when done.".into(),
        parameters: serde_json::json!({"type": "object", "additionalProperties": false, "required": ["instructions", "goal"], "properties": {
            "instructions": {"type": "string", "minLength": 1, "maxLength": 4000},
            "goal": {"type": "string", "minLength": 1, "maxLength": 500}}}),
    }
}

pub(super) fn history_tool() -> crate::llm::ToolDecl {
    crate::llm::ToolDecl {
        name: HISTORY_TOOL.into(),
        description: "Search the user's past sessions with you (summaries and full text); up to 5, newest and best first.".into(),
        parameters: serde_json::json!({"type": "object", "additionalProperties": false, "required": ["query"], "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 300},
            "timeframe_days": {"type": "integer", "minimum": 1, "maximum": 3650}}}),
    }
}

/// A call of one of the agent's own tools whose arguments break its schema (E-9): told to
/// the model, which can call again. The gateway checks its own tools; these run here.
fn invalid(tool: &str, why: String) -> ToolOutcome {
    ToolOutcome {
        ok: false,
        text: format!("Your arguments for {tool} {why}. Call {tool} again with them fixed."),
        error_kind: "INVALID_ARGUMENTS".into(),
        truncated: false,
        external: false,
    }
}

/// `args` has only the members `known` names.
fn only_known(tool: &str, args: &serde_json::Value, known: &[&str]) -> Result<(), ToolOutcome> {
    match args
        .as_object()
        .and_then(|o| o.keys().find(|k| !known.contains(&k.as_str())))
    {
        Some(k) => Err(invalid(
            tool,
            format!("have a member {k:?} it does not take (it takes {known:?})"),
        )),
        None => Ok(()),
    }
}

/// The text member `name` of `args`: present, not blank, at most `max` characters.
fn text_arg<'a>(
    tool: &str,
    args: &'a serde_json::Value,
    name: &str,
    max: usize,
) -> Result<&'a str, ToolOutcome> {
    let text = match args.get(name) {
        None => return Err(invalid(tool, format!("lack {name:?}, which is required"))),
        Some(v) => v
            .as_str()
            .ok_or_else(|| invalid(tool, format!("give {name:?} as something other than text")))?,
    };
    if text.trim().is_empty() {
        return Err(invalid(tool, format!("give {name:?} blank")));
    }
    let chars = text.chars().count();
    if chars > max {
        return Err(invalid(
            tool,
            format!("give {name:?} as {chars} characters; at most {max} are taken"),
        ));
    }
    Ok(text)
}

/// The id of the task agent a `create_task_agent` call queues: its call's own (each call
/// has a fresh one), so a later run can find whether a call whose result was lost queued it.
pub(super) fn task_id_for(call_id: &str) -> String {
    format!("t-{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// What a call that queued task `id` answers.
pub(super) fn task_started(id: &str) -> String {
    format!("{TASK_STARTED}{id}; its result will be posted to this thread when it finishes.")
}

/// What a call that queued `task` answers when its result is found later (the call's own
/// was lost): what has become of the task since.
pub(super) fn task_started_as(task: &TaskAgent) -> String {
    let id = &task.id;
    match task.state.as_str() {
        "completed" => {
            format!("{TASK_STARTED}{id}; it has finished, and its report is posted in this thread.")
        }
        "failed" => {
            format!("{TASK_STARTED}{id}; it could not finish, and why is posted in this thread.")
        }
        _ => task_started(id),
    }
}

async fn enqueue_task_agent(
    store: &SharedStore,
    user: &str,
    lease: &Lease,
    call_id: &str,
    args: &serde_json::Value,
    max_queued: u32,
    time_zone: Option<&str>,
) -> ToolOutcome {
    let checked = only_known(TASK_AGENT_TOOL, args, &["instructions", "goal"]).and_then(|()| {
        Ok((
            text_arg(TASK_AGENT_TOOL, args, "instructions", 4000)?,
            text_arg(TASK_AGENT_TOOL, args, "goal", 500)?,
        ))
    });
    let (instructions, goal) = match checked {
        Ok(fields) => fields,
        Err(refused) => return refused,
    };
    let task = TaskAgent {
        id: task_id_for(call_id),
        owner: user.to_owned(),
        parent_thread_id: lease.thread_id.clone(),
        instructions: instructions.to_owned(),
        goal: goal.to_owned(),
        state: "queued".into(),
        attempts: 0,
        last_error: None,
        result: None,
        created_at: std::time::SystemTime::now(),
        settled_attempt: 0,
        restarts: 0,
        time_zone: time_zone.map(str::to_owned),
    };
    match store
        .enqueue_task_agent(&task, max_queued, Some(lease))
        .await
    {
        Ok(false) => ToolOutcome {
            ok: false,
            text: format!(
                "Not started: the user already has {max_queued} task agents queued or running (AGENT_MAX_QUEUED_TASK_AGENTS_PER_USER). Wait for one to finish."
            ),
            error_kind: "RATE_LIMITED".into(),
            truncated: false,
            external: false,
        },
        Ok(true) => ToolOutcome {
            ok: true,
            text: task_started(&task.id),
            error_kind: String::new(),
            truncated: false,
            external: false,
        },
        Err(e) => store_failed("Could not start a task agent", &e),
    }
}

/// Reads the run's cancel flag just before a side effect leaves (once its checkpoint is
/// durable), and stops the segment if it is set: a cancel taken by another replica reaches
/// this one by a notice, or else by the next lease renewal up to a third of the lease later —
/// too late to stop a send. If the store cannot say, the call goes ahead (the checkpoint has
/// just been written, so it was answering).
pub(super) async fn look_for_a_cancel(
    store: &SharedStore,
    owner: &str,
    run_id: &str,
    stopper: &writer::Stopper,
) {
    if stopper.reason().is_some() {
        return;
    }
    match store.get_run(owner, run_id).await {
        Ok(Some(run)) if run.cancel_requested => stopper.stop(writer::StopReason::Cancelled),
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(run_id = %run_id, error = %e, "could not check for a cancel before a side effect");
        }
    }
}

/// A store failure in one of the agent's own tools, worded as the gateway words its own: what
/// the database refused for good is not "unavailable right now", since sending it again
/// unchanged fails the same way.
fn store_failed(what: &str, e: &StoreError) -> ToolOutcome {
    let (text, kind) = match e {
        StoreError::Rejected(_) => (
            format!(
                "{what} ({e}). Sending it again unchanged will fail the same way; change the request or tell the user."
            ),
            "INTERNAL",
        ),
        _ => (
            format!("{what} ({e}). Try again later."),
            "UPSTREAM_UNAVAILABLE",
        ),
    };
    ToolOutcome {
        ok: false,
        text,
        error_kind: kind.into(),
        truncated: false,
        external: false,
    }
}

/// The agent's own tool (B-4): it reads the agent's archives, so it runs here, not in the gateway.
pub const HISTORY_TOOL: &str = "search_agent_history";

async fn search_history(store: &SharedStore, user: &str, args: &serde_json::Value) -> ToolOutcome {
    let checked = only_known(HISTORY_TOOL, args, &["query", "timeframe_days"])
        .and_then(|()| text_arg(HISTORY_TOOL, args, "query", 300));
    let query = match checked {
        Ok(query) => query,
        Err(refused) => return refused,
    };
    let days = match args.get("timeframe_days") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => match v
            .as_f64()
            .filter(|d| d.fract() == 0.0 && (1.0..=3650.0).contains(d))
        {
            Some(d) => Some(d as u64),
            None => {
                return invalid(
                    HISTORY_TOOL,
                    format!(
                        "give \"timeframe_days\" as {v}; give a whole number of days from 1 to 3650"
                    ),
                );
            }
        },
    };
    let since = days.and_then(|d| SystemTime::now().checked_sub(Duration::from_secs(d * 86_400)));
    match store.search_archives(user, query, 5).await {
        Ok(hits) => {
            let hits: Vec<_> = hits
                .into_iter()
                .filter(|a| since.is_none_or(|s| a.archived_at >= s))
                .collect();
            let text = if hits.is_empty() {
                format!("No past sessions match \"{query}\".")
            } else {
                let lines: Vec<String> = hits
                    .iter()
                    .enumerate()
                    .map(|(i, a)| {
                        let when = jiff::Timestamp::try_from(a.archived_at)
                            .map(|t| t.strftime("%b %-d").to_string())
                            .unwrap_or_default();
                        format!("{}. ({when}, thread {}) {}", i + 1, a.thread_id, a.summary)
                    })
                    .collect();
                format!(
                    "Past sessions matching \"{query}\" ({}):\n{}",
                    hits.len(),
                    lines.join("\n")
                )
            };
            ToolOutcome {
                ok: true,
                text,
                error_kind: String::new(),
                truncated: false,
                // A session that read others' words passes them on in its summary.
                external: hits.iter().any(|a| a.external),
            }
        }
        Err(e) => store_failed("Past sessions could not be searched", &e),
    }
}

/// Hex SHA-256 of the canonical JSON (serde_json sorts object keys) of an approval's arguments.
pub fn sha256_hex(args: &serde_json::Value) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(args.to_string().as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(super) struct NoTools;

#[async_trait::async_trait]
impl ToolRunner for NoTools {
    async fn run(&self, calls: Vec<ToolInvocation>) -> Vec<ToolOutcome> {
        calls
            .into_iter()
            .map(|_| ToolOutcome {
                ok: false,
                text: "Tools are unavailable right now.".into(),
                error_kind: "UPSTREAM_UNAVAILABLE".into(),
                truncated: false,
                external: false,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::store::memory::MemoryStore;

    fn store() -> SharedStore {
        Arc::new(MemoryStore::new())
    }

    /// A run's lease on alice's thread t1.
    async fn lease(store: &SharedStore) -> Lease {
        store.create_thread("t1", "alice", "x").await.unwrap();
        match store
            .lock_thread("t1", "r1", Duration::from_secs(60))
            .await
            .unwrap()
        {
            crate::store::LockOutcome::Acquired(lease) => lease,
            busy => panic!("{busy:?}"),
        }
    }

    #[tokio::test]
    async fn e9_a_task_agent_without_instructions_or_goal_is_refused_and_none_is_queued() {
        let store = store();
        let lease = lease(&store).await;
        for (args, says) in [
            (json!({}), "lack \"instructions\""),
            (
                json!({"instructions": "  ", "goal": "g"}),
                "\"instructions\" blank",
            ),
            (
                json!({"instructions": "do it", "goal": 7}),
                "\"goal\" as something other than text",
            ),
            (
                json!({"instructions": "x".repeat(4001), "goal": "g"}),
                "4001 characters; at most 4000",
            ),
            (
                json!({"instructions": "i", "goal": "g", "priority": 1}),
                "member \"priority\"",
            ),
        ] {
            let out = enqueue_task_agent(&store, "alice", &lease, "call_1", &args, 5, None).await;
            assert!(!out.ok, "{args}");
            assert_eq!(out.error_kind, "INVALID_ARGUMENTS");
            assert!(out.text.contains(says), "{}: {}", args, out.text);
            assert!(
                out.text.contains("Call create_task_agent again"),
                "{}",
                out.text
            );
        }
        let queued = store
            .claim_task_agent("w", Duration::from_secs(60), 5)
            .await
            .unwrap();
        assert!(queued.is_none(), "{queued:?}");
        let out = enqueue_task_agent(
            &store,
            "alice",
            &lease,
            "call_2",
            &json!({"instructions": "read the inbox", "goal": "a digest"}),
            5,
            None,
        )
        .await;
        assert!(out.ok, "{}", out.text);
    }

    #[tokio::test]
    async fn e9_a_history_search_over_an_impossible_timeframe_is_refused_not_overflowed() {
        let store = store();
        for days in [json!(1e15), json!(0), json!(-3), json!(2.5), json!("7")] {
            let args = json!({"query": "budget", "timeframe_days": days});
            let out = search_history(&store, "alice", &args).await;
            assert_eq!(out.error_kind, "INVALID_ARGUMENTS", "{days}: {}", out.text);
            assert!(out.text.contains("from 1 to 3650"), "{}", out.text);
        }
        let out = search_history(&store, "alice", &json!({"query": ""})).await;
        assert!(out.text.contains("\"query\" blank"), "{}", out.text);
        let out = search_history(
            &store,
            "alice",
            &json!({"query": "budget", "timeframe_days": 30}),
        )
        .await;
        assert!(out.ok, "{}", out.text);
    }
}
