//! Decisions on paused actions (A-6, P-4): who may decide, what is refused, and how the run
//! continues on whichever replica received the decision.

use super::*;

impl RunService {
    /// After a decision: the approved action runs exactly once (the approval id is the gateway
    /// idempotency key) or the rejection is recorded, as the pending call's result; then the loop
    /// continues from the persisted transcript.
    pub(super) async fn continue_after(
        &self,
        owner: &str,
        thread_id: &str,
        run_id: &str,
        approval: Approval,
        approved: bool,
        cancel: &CancellationToken,
    ) -> Result<pb::RunResult, ApiError> {
        self.store
            .update_run(
                run_id,
                RunPatch {
                    state: Some(RunState::Executing),
                    ..RunPatch::default()
                },
            )
            .await?;
        let run = self
            .store
            .get_run(owner, run_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("run {run_id}")))?;
        let channel = convert::channel_from_key(&run.channel);
        let action = action_id(run_id, &approval.call_id);
        if approved {
            self.store
                .update_action(&action, ActionState::Executing, None, None)
                .await?;
        }
        let (content, ok) = if approved {
            let outcome = match &self.gateway {
                Some(g) => {
                    g.execute_once(
                        owner,
                        run_id,
                        gateway_channel(channel),
                        &approval.call_id,
                        &approval.tool,
                        &approval.arguments,
                        &approval.id,
                    )
                    .await
                }
                None => ToolOutcome {
                    ok: false,
                    text: "Tools are unavailable right now.".into(),
                    error_kind: "UPSTREAM_UNAVAILABLE".into(),
                    truncated: false,
                },
            };
            self.store
                .record_audit(owner, "side_effect", Some(run_id), serde_json::json!({"approval_id": approval.id, "tool": approval.tool, "ok": outcome.ok}))
                .await?;
            (outcome.text, outcome.ok)
        } else {
            (
                "The user rejected this action. Do not retry it unless they ask again.".to_owned(),
                false,
            )
        };
        let state = match (approved, ok) {
            (false, _) => ActionState::Rejected,
            (true, true) => ActionState::Completed,
            (true, false) => ActionState::Failed,
        };
        self.store
            .update_action(&action, state, Some((&content, None)), None)
            .await?;
        self.append(
            run_id,
            thread_id,
            pb::run_event::Kind::ToolResult(pb::ToolResultEvent {
                call_id: approval.call_id.clone(),
                action_id: action.clone(),
                tool: approval.tool.clone(),
                ok,
                preview: content.chars().take(200).collect(),
                error_kind: String::new(),
                truncated: false,
            }),
        )
        .await?;
        let result = Turn::ToolResult {
            call_id: approval.call_id.clone(),
            name: approval.tool.clone(),
            content,
            is_error: !ok,
        };
        let value =
            serde_json::to_value(&result).map_err(|e| ApiError::Unavailable(e.to_string()))?;
        self.store.append_history(thread_id, &[value]).await?;
        let history = self.load_history(thread_id).await?;
        let prompt = crate::prompt::build(
            &crate::prompt::PromptInput {
                channel: Some(channel),
                ..crate::prompt::PromptInput::default()
            },
            executor::budget::TokenCounter::Ratio,
            SystemTime::now(),
        );
        let request = RunRequest {
            system: prompt.text,
            history,
            prompt: String::new(),
            tools: Vec::new(),
            limits: limits::profile(channel, self.max_loop_steps),
            stop_after: None,
            resume: true,
        };
        self.drive(
            owner,
            thread_id,
            run_id,
            channel,
            request,
            self.models.clone(),
            None,
            cancel,
        )
        .await
    }

    /// DecideApproval: only the owner; a repeated identical decision returns the current
    /// state; a conflicting one, an expired approval, or changed arguments are
    /// FAILED_PRECONDITION. The continuation runs on whichever replica received the call.
    pub async fn decide(
        self: &Arc<Self>,
        owner: &str,
        approval_id: &str,
        approve: bool,
        args_sha256: Option<&str>,
    ) -> Result<(Approval, Option<(String, u64)>), ApiError> {
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
        if approval.state == wanted {
            return Ok((approval, None));
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
        if approve && approval.expires_at <= SystemTime::now() {
            self.store
                .decide_approval(approval_id, ApprovalState::Expired, owner)
                .await?;
            return Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} expired; ask again"
            )));
        }
        // The call must still be open: a newer message on the thread closes paused calls.
        let history = self.load_history(&approval.thread_id).await?;
        let still_open = !history
            .iter()
            .any(|t| matches!(t, Turn::ToolResult { call_id, .. } if *call_id == approval.call_id));
        if !still_open {
            self.store
                .decide_approval(approval_id, ApprovalState::Expired, owner)
                .await?;
            return Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} can no longer be used: the conversation moved on"
            )));
        }
        let decided = self
            .store
            .decide_approval(approval_id, wanted, owner)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("approval {approval_id}")))?;
        if decided.state != wanted {
            // Someone decided differently first.
            return Err(ApiError::FailedPrecondition(format!(
                "approval {approval_id} is already {}",
                decided.state.key()
            )));
        }
        self.store
            .record_audit(
                owner,
                if approve {
                    "approval_approved"
                } else {
                    "approval_rejected"
                },
                Some(&decided.run_id),
                serde_json::json!({"approval_id": approval_id, "tool": decided.tool}),
            )
            .await?;
        match self
            .store
            .lock_thread(&decided.thread_id, &decided.run_id, self.lease)
            .await?
        {
            LockOutcome::Acquired => {}
            LockOutcome::Busy { run_id } => {
                return Err(ApiError::Aborted(format!(
                    "thread {} has an active run ({run_id}); decide again when it ends",
                    decided.thread_id
                )));
            }
        }
        let from = self
            .store
            .get_run(owner, &decided.run_id)
            .await?
            .map_or(0, |r| r.last_event_seq);
        let cancel = CancellationToken::new();
        self.cancels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(decided.run_id.clone(), cancel.clone());
        let this = self.clone();
        let (o, t, r, a) = (
            owner.to_owned(),
            decided.thread_id.clone(),
            decided.run_id.clone(),
            decided.clone(),
        );
        tokio::spawn(async move {
            this.execute(
                o,
                t,
                r,
                Work::Continue {
                    approval: a,
                    approved: approve,
                },
                cancel,
            )
            .await
        });
        Ok((decided.clone(), Some((decided.run_id, from))))
    }
}
