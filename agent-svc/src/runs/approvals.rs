//! Decisions on paused actions (A-6, P-4): who may decide, what is refused, and how exactly one
//! decision continues the run, on whichever replica received it.

use super::*;
use crate::store::{Decided, LockOutcome};

/// What a decision call gets back.
pub struct Decision {
    pub approval: Approval,
    /// (run id, seq to follow from) when the run is (being) continued: the caller follows it
    /// to its next stop. `None`: the run is as it stands.
    pub follow: Option<(String, u64)>,
}

impl RunService {
    /// DecideApproval: only the owner; a repeated identical decision returns the run's
    /// state (following it if it is still running); a conflicting one, an expired approval,
    /// changed arguments, or a run that is no longer paused are FAILED_PRECONDITION. Of many
    /// concurrent decisions exactly one wins and continues the run; the others follow it.
    ///
    /// Like an admission, a decision is a task of its own: once its thread is locked, a caller
    /// that goes away (a deadline, a reset stream) must not leave the lease held by nobody, or a
    /// decided run that nothing continues until the monitor's next sweep.
    pub async fn decide(
        self: &Arc<Self>,
        owner: &str,
        approval_id: &str,
        approve: bool,
        args_sha256: Option<&str>,
    ) -> Result<Decision, ApiError> {
        let this = self.clone();
        let (owner, approval_id) = (owner.to_owned(), approval_id.to_owned());
        let args_sha256 = args_sha256.map(str::to_owned);
        super::in_own_task(
            async move {
                this.decide_here(&owner, &approval_id, approve, args_sha256.as_deref())
                    .await
            },
            "agent-svc is shutting down; decide again",
        )
        .await
    }

    async fn decide_here(
        self: &Arc<Self>,
        owner: &str,
        approval_id: &str,
        approve: bool,
        args_sha256: Option<&str>,
    ) -> Result<Decision, ApiError> {
        let approval = self
            .store
            .get_approval(owner, approval_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("approval {approval_id}")))?;
        let wanted = if approve {
            ApprovalState::Approved
        } else {
            ApprovalState::Rejected
        };
        let run = self
            .store
            .get_run(owner, &approval.run_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("run {}", approval.run_id)))?;
        if approval.state == wanted {
            return Ok(self.same_decision(approval, &run));
        }
        if approval.state == ApprovalState::Expired {
            return Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} can no longer be used: it expired (the conversation moved on, the session was archived, the run was cancelled, or its time ran out); ask again"
            )));
        }
        if approval.state != ApprovalState::Pending {
            return Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} is already {}",
                approval.state.key()
            )));
        }
        if let Some(sha) = args_sha256
            && sha != approval.args_sha256
        {
            return Err(ApiError::FailedPrecondition(format!(
                "args_sha256 does not match approval {approval_id}: the arguments you saw are not the ones pending"
            )));
        }
        if run.state != RunState::AwaitingConfirmation && !run.state.is_live() {
            return Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} can no longer be used: its run is {}",
                run.state.key()
            )));
        }
        if approval.expires_at <= SystemTime::now() {
            return Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} expired; ask again"
            )));
        }
        // The lease comes first: nothing is recorded unless this caller can also continue.
        let lease = match self
            .store
            .lock_thread(&approval.thread_id, &approval.run_id, self.lease)
            .await?
        {
            LockOutcome::Acquired(lease) => lease,
            LockOutcome::Busy { run_id } if run_id == approval.run_id => {
                // Another decider holds this run: it continues; this caller follows.
                return self.after_losing(owner, approval_id, wanted, &run).await;
            }
            LockOutcome::Busy { run_id } => {
                return Err(ApiError::Aborted(format!(
                    "thread {} has an active run ({run_id}); decide again when it ends",
                    approval.thread_id
                )));
            }
        };
        let audit_kind = if approve {
            "approval_approved"
        } else {
            "approval_rejected"
        };
        match self
            .store
            .decide(
                &lease,
                approval_id,
                wanted,
                owner,
                audit_kind,
                self.fair_use.max_active_runs,
            )
            .await
        {
            Ok(Decided::Won {
                approval,
                last_event_seq,
            }) => {
                crate::metrics::approval_decided(approve);
                Ok(self.continue_decided(lease, approval, &run.channel, last_event_seq))
            }
            // Still pending on a paused run, under this caller's lease: the one condition the
            // store checks that this replica did not is expiry, by the database's clock.
            Ok(Decided::Lost {
                approval: ref lost,
                run_state: RunState::AwaitingConfirmation,
            }) if lost.state == ApprovalState::Pending => {
                let _ = self.store.release_lease(&lease).await;
                Err(ApiError::FailedPrecondition(format!(
                    "approval {approval_id} expired; ask again"
                )))
            }
            Ok(Decided::Lost { .. }) => {
                let _ = self.store.release_lease(&lease).await;
                self.after_losing(owner, approval_id, wanted, &run).await
            }
            Ok(Decided::TooManyRuns { active }) => {
                let _ = self.store.release_lease(&lease).await;
                Err(self.at_the_run_cap(
                    active,
                    &format!(
                        "deciding approval {approval_id} (approving or rejecting) continues its run, so it is still pending: decide again when one of them finishes, or cancel one (CancelRun)"
                    ),
                ))
            }
            Err(e) => {
                // The commit's answer can be lost after it landed. This caller still holds the
                // lease (unless the store said it lost it), so a decision that stands is its
                // own: it continues the run. Otherwise the lease goes, and a decision that
                // landed unseen is the health monitor's to continue (`sweep_stale_runs`).
                let maybe_ours = !matches!(e, StoreError::LeaseLost);
                if maybe_ours
                    && let Some((approval, last_event_seq)) =
                        self.landed(owner, approval_id, wanted, &run.id).await
                    // Still ours after those reads: otherwise the monitor has the run.
                    && matches!(self.store.renew_lease(&lease, self.lease).await, Ok(Some(_)))
                {
                    tracing::warn!(approval_id, error = %e, "the decision's commit answer was lost, but the decision landed; continuing the run");
                    crate::metrics::approval_decided(approve);
                    return Ok(self.continue_decided(
                        lease,
                        approval,
                        &run.channel,
                        last_event_seq,
                    ));
                }
                let _ = self.store.release_lease(&lease).await;
                Err(e.into())
            }
        }
    }

    /// The decision recorded and the run it continues, if this decision is what the store now
    /// holds (an error while reading says nothing: `None`).
    async fn landed(
        &self,
        owner: &str,
        approval_id: &str,
        wanted: ApprovalState,
        run_id: &str,
    ) -> Option<(Approval, u64)> {
        let approval = self.store.get_approval(owner, approval_id).await.ok()??;
        let run = self.store.get_run(owner, run_id).await.ok()??;
        (approval.state == wanted && run.state == RunState::Executing)
            .then_some((approval, run.last_event_seq))
    }

    /// Continues a run whose approval was just decided, holding `lease`: a segment answers
    /// the paused call and goes on; the caller follows from `last_event_seq`.
    pub(super) fn continue_decided(
        self: &Arc<Self>,
        lease: Lease,
        approval: Approval,
        channel: &str,
        last_event_seq: u64,
    ) -> Decision {
        let approved = approval.state == ApprovalState::Approved;
        let segment = Segment {
            owner: approval.owner.clone(),
            thread_id: approval.thread_id.clone(),
            run_id: approval.run_id.clone(),
            channel: convert::channel_from_key(channel),
            // Read with the run when the segment resumes it.
            time_zone: None,
        };
        self.spawn_segment(
            segment,
            lease,
            From::Seq(last_event_seq),
            Plan::Continue {
                approval: Box::new(approval.clone()),
                approved,
            },
        );
        let follow = Some((approval.run_id.clone(), last_event_seq));
        Decision { approval, follow }
    }

    /// The decision asked for was already made: follow the run if it is still going.
    fn same_decision(&self, approval: Approval, run: &Run) -> Decision {
        let follow = run
            .state
            .is_live()
            .then(|| (run.id.clone(), run.last_event_seq));
        Decision { approval, follow }
    }

    /// Someone else decided (or is deciding) first: the same decision follows the run; a
    /// different one is refused.
    async fn after_losing(
        &self,
        owner: &str,
        approval_id: &str,
        wanted: ApprovalState,
        seen: &Run,
    ) -> Result<Decision, ApiError> {
        // The winner takes the lease a moment before it records its decision: give it that
        // moment (bounded), so this caller sees which decision won.
        let mut approval = None;
        for _ in 0..40 {
            let now = self
                .store
                .get_approval(owner, approval_id)
                .await?
                .ok_or_else(|| ApiError::NotFound(format!("approval {approval_id}")))?;
            let decided = now.state != ApprovalState::Pending;
            approval = Some(now);
            if decided {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let approval = approval.expect("the loop ran");
        let run = self.store.get_run(owner, &seen.id).await?;
        match (approval.state, run) {
            (state, Some(run)) if state == wanted => Ok(self.same_decision(approval, &run)),
            // Being decided right now by a caller holding the lease: follow from the pause.
            (ApprovalState::Pending, Some(run)) if run.state != RunState::AwaitingConfirmation => {
                Ok(Decision {
                    follow: (!run.state.is_terminal())
                        .then(|| (run.id.clone(), seen.last_event_seq)),
                    approval,
                })
            }
            // Nothing was decided and the run is still paused: the other decision did not go
            // through (the cap on active runs, say); this one may be tried again.
            (ApprovalState::Pending, Some(run)) if run.state == RunState::AwaitingConfirmation => {
                Err(ApiError::Aborted(format!(
                    "approval {approval_id} was being decided by another request that did not go through; decide again"
                )))
            }
            (state, run) => Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} is {}{}",
                state.key(),
                run.map(|r| format!(" and its run is {}", r.state.key()))
                    .unwrap_or_default()
            ))),
        }
    }

    /// A continuation segment: the approved action runs exactly once (its idempotency key is
    /// the run id and call id) or the rejection is recorded, as the pending call's result;
    /// then the loop continues from the persisted transcript with the run's own prompt.
    pub(super) async fn resume(
        &self,
        seg: &Segment,
        writer: &mut RunWriter,
        approval: Approval,
        approved: bool,
        stopper: &Stopper,
    ) -> Result<Driven, ApiError> {
        let run = self
            .store
            .get_run(&seg.owner, &seg.run_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("run {}", seg.run_id)))?;
        // The zone the run was started with: no caller gives it again, and the task agents
        // this segment starts tell their time in it (B-1).
        let zoned;
        let seg = match run.time_zone.as_deref().and_then(|z| {
            crate::schedule::user_zone("time_zone", z)
                .inspect_err(|e| tracing::warn!(run_id = %seg.run_id, error = %e, "the run's time zone is unknown here; its continuation uses UTC"))
                .ok()
        }) {
            Some(zone) => {
                zoned = Segment {
                    time_zone: Some(zone),
                    ..seg.clone()
                };
                &zoned
            }
            None => seg,
        };
        writer.spent = run.usage.clone();
        writer.iterations_before = run.iterations;
        // What the run had read when it asked still counts: the stored prompt may hold it
        // (attached items, memories), and the transcript alone does not say so (U-2).
        for source in &approval.tainted_by {
            writer.guard.read(source);
        }
        let call_id = approval.call_id.clone();
        if let Some(action) = self
            .store
            .list_actions(&seg.run_id)
            .await?
            .into_iter()
            .find(|a| a.call_id == call_id)
        {
            writer.actions.insert(call_id.clone(), action);
        }
        // A shutdown or a lost lease before anything ran: this segment stops as it would
        // anywhere else (the lease goes to another replica's monitor).
        if let Some(reason) = stopper.reason().filter(|r| *r != StopReason::Cancelled) {
            return Ok(Driven::Stopped(reason));
        }
        // A cancel that raced the decision (CancelRun saw the run paused, then the decision
        // won) ends the run without the approved effect; the call is answered, so the
        // transcript stays whole.
        let mut stopped = (approved
            && (stopper.reason().is_some()
                || self
                    .store
                    .get_run(&seg.owner, &seg.run_id)
                    .await?
                    .is_some_and(|r| r.cancel_requested)))
        .then_some(StopReason::Cancelled);
        let side_effect = writer.actions.get(&call_id).is_none_or(|a| a.side_effect);
        // Set once the action's `side_effect` record is durable (the effect may follow).
        let mut intent_recorded = false;
        let (content, ok, error_kind) = if stopped.is_some() {
            (
                "Not executed: the run was cancelled before the approved action ran.".to_owned(),
                false,
                "CANCELLED".to_owned(),
            )
        } else if approved && side_effect && !self.policy.side_effects_enabled {
            // The kill switch holds for approvals made before it was thrown (P-2).
            (
                format!(
                    "Denied: {} changes things outside Steward and side effects are disabled in this deployment. \
                     Tell the user it could not be done.",
                    approval.tool
                ),
                false,
                "DENIED".to_owned(),
            )
        } else if approved {
            if let Some(a) = writer.actions.get_mut(&call_id) {
                a.to(ActionState::Executing);
            }
            writer.stage_action(&call_id);
            // P-5: the audit record goes with the action's executing state, durable before the
            // effect; if it cannot be written, nothing is sent.
            writer.pending().audit.push((
                "side_effect".into(),
                serde_json::json!({"approval_id": approval.id, "tool": approval.tool, "call_id": call_id, "approval": "approved"}),
            ));
            // Shown to watchers, and this commit's own mark: a commit whose answer was lost is
            // found in the store by its last event (`RunWriter::landed`), so it is not written
            // a second time — nor its side_effect record.
            writer.emit(pb::run_event::Kind::Status(pb::StatusEvent {
                state: pb::RunState::Executing as i32,
                detail: format!("running the approved {}", approval.tool),
            }));
            // Durable before the effect: a crash from here on shows the action as executing.
            if let Err(e) = writer.flush().await {
                // Not sent: the run's end must write neither the record of an effect nor the
                // mark of one running, and the action says it was not done.
                writer.pending().audit.pop();
                writer.withdraw_last_event();
                if let Some(a) = writer.actions.get_mut(&call_id) {
                    a.to(ActionState::Failed);
                    a.result_text =
                        Some("Not executed: the run could not record its progress.".into());
                    a.error_kind = Some("INTERNAL".into());
                }
                writer.stage_action(&call_id);
                return Err(e.into());
            }
            intent_recorded = true;
            // A stop that came during that commit still comes before the effect: a local one,
            // or a cancel another replica recorded whose notice has not arrived.
            tools::look_for_a_cancel(&self.store, &seg.owner, &seg.run_id, stopper).await;
            stopped = stopper.reason();
            // A shutdown that came during the intent commit does not undo the user's decision:
            // the send goes, within the stop's grace, as one the loop had begun would. A
            // cancel, a lost lease or a failed write keeps it unsent.
            let sends = matches!(stopped, None | Some(StopReason::Shutdown));
            let outcome = match (&self.gateway, &stopped) {
                (_, Some(reason)) if !sends => tools::not_run_for(reason),
                (Some(g), _) => {
                    let idempotency_key = action_id(&seg.run_id, &call_id);
                    let call = g.execute_once(crate::gateway_client::OnceCall {
                        user: &seg.owner,
                        run_id: &seg.run_id,
                        channel: gateway_channel(seg.channel),
                        call_id: &call_id,
                        tool: &approval.tool,
                        args: &approval.arguments,
                        idempotency_key: &idempotency_key,
                        read_external_from: &approval.tainted_by,
                        // What the user saw must still be what happens (issue 14).
                        expected_binding: &approval.binding,
                        time_zone: crate::gateway_client::zone_name(seg.time_zone.as_ref()),
                    });
                    // A stop mid-send gives the send the same grace as one of the loop's.
                    match super::writer::unless_stopped(call, stopper, self.cancel_grace()).await {
                        Some(outcome) => outcome,
                        None => {
                            // Sent, and no word of what it came to: left `executing` (its
                            // `side_effect` record is durable) for the thread's next run to
                            // look up, never answered "not executed".
                            writer.in_flight.sent(vec![call_id.clone()]);
                            return Ok(Driven::Stopped(
                                stopper.reason().unwrap_or(StopReason::Shutdown),
                            ));
                        }
                    }
                }
                (None, _) => unavailable("Tools are unavailable right now."),
            };
            let outcome = match sends {
                true => tools::ambiguity(outcome, true),
                false => outcome,
            };
            (outcome.text, outcome.ok, outcome.error_kind)
        } else {
            (
                "The user rejected this action. Do not retry it unless they ask again.".to_owned(),
                false,
                String::new(),
            )
        };
        if let Some(a) = writer.actions.get_mut(&call_id) {
            a.to(match (approved, ok) {
                (false, _) => ActionState::Rejected,
                (true, true) => ActionState::Completed,
                (true, false) => ActionState::Failed,
            });
            a.result_text = Some(content.clone());
            a.error_kind = Some(error_kind.clone()).filter(|k| !k.is_empty());
        }
        writer.stage_action(&call_id);
        if intent_recorded {
            // Its `side_effect` record was committed before the effect: this one closes it.
            let record =
                super::writer::side_effect_result(&approval.tool, &call_id, ok, &error_kind);
            writer.pending().audit.push(record);
        }
        let gathered = (approved && ok).then(|| executor::gathered(&approval.tool, &content));
        let preview: String = content.chars().take(200).collect();
        writer.emit(pb::run_event::Kind::ToolResult(pb::ToolResultEvent {
            call_id: call_id.clone(),
            action_id: action_id(&seg.run_id, &call_id),
            tool: approval.tool.clone(),
            ok,
            preview: preview.clone(),
            error_kind,
            truncated: false,
        }));
        let result = Turn::ToolResult {
            content: if ok {
                crate::fence::block(&format!("result of {}", approval.tool), &content)
            } else {
                content
            },
            call_id,
            name: approval.tool.clone(),
            is_error: !ok,
        };
        let pending = writer.pending();
        pending.history.push(to_json(&result)?);
        if approved {
            pending.messages.push(NewMessage {
                kind: crate::store::MessageKind::Tool,
                metadata: serde_json::json!({ "tool": approval.tool, "ok": ok }),
                ..NewMessage::text(
                    MessageSource::Agent,
                    format!(
                        "{} {}: {preview}",
                        if ok { "Ran" } else { "Tried" },
                        approval.tool
                    ),
                )
            });
        }
        if let Some(reason) = stopped {
            return Ok(Driven::Stopped(reason));
        }
        let mut history = self.load_history(&seg.thread_id).await?;
        history.push(result);
        let system = if run.system_prompt.is_empty() {
            // A run paused before prompts were stored: the base prompt for its channel.
            crate::prompt::build(
                &crate::prompt::PromptInput {
                    channel: Some(seg.channel),
                    ..crate::prompt::PromptInput::default()
                },
                executor::budget::TokenCounter::Ratio,
                SystemTime::now(),
            )
            .text
        } else {
            run.system_prompt
        };
        let request = RunRequest {
            system,
            system_tokens: None,
            history,
            prompt: String::new(),
            tools: crate::llm::ToolSet::none(),
            limits: continued_limits(
                limits::profile(seg.channel, self.max_loop_steps),
                &writer.spent,
            ),
            stop_after: None,
            resume: true,
            gathered: gathered.into_iter().collect(),
        };
        // The model the run started with, if the caller chose one; a chain that no longer
        // holds it (a deploy in between) goes on with its own first model.
        let models = self
            .models_for(writer.spent.model_override.as_deref())
            .unwrap_or_else(|e| {
                tracing::warn!(run_id = %seg.run_id, error = %e, "the run's chosen model is no longer configured; going on with the chain's first");
                self.models.clone()
            });
        self.drive(
            seg,
            writer,
            request,
            models,
            // A scheduled briefing that paused on a send goes on with its own short list.
            approval.allowed_tools.as_deref(),
            stopper,
            super::Prefetched::default(),
        )
        .await
    }
}

/// A continuation's limits: its channel's, under what is left of the run's budget after what
/// its earlier segments spent (RunBudget covers every model call of the run).
fn continued_limits(mut limits: limits::Limits, spent: &crate::store::RunUsage) -> limits::Limits {
    if let Some(ceiling) = spent.ceiling {
        (limits.max_total_tokens, limits.max_cost_usd) = ceiling.left(spent);
    }
    limits
}
