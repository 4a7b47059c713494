//! The gRPC edge of agent-svc: authenticate, validate and normalise, convert proto
//! to domain types, call the run service or the store, convert back. Nothing proto-shaped goes
//! deeper than this module and `runs` (which persists the wire RunEvent as is).

pub mod convert;
pub mod identity;
mod jwks;
mod schedules;
mod status;

use std::{pin::Pin, sync::Arc, time::SystemTime};

use steward_proto::agent::v1::{self as pb, agent_service_server::AgentService};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

pub use status::ApiError;

use steward_proto::gateway::v1 as gw;

use crate::{
    executor::limits::Channel,
    gateway_client::GatewayError,
    prompt,
    runs::{self, Deliver, RunInput, RunService, SessionSetup},
    store::SharedStore,
};

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The AgentService implementation.
pub struct AgentApi {
    store: SharedStore,
    runs: Arc<RunService>,
    identity: identity::Identity,
    /// This replica's name as the holder of occurrences it starts (RunScheduleNow), the same
    /// as its workers': what it holds is handed back when it stops.
    worker: String,
}

impl AgentApi {
    pub fn new(
        store: SharedStore,
        runs: Arc<RunService>,
        identity: identity::Identity,
        worker: String,
    ) -> Self {
        Self {
            store,
            runs,
            identity,
            worker,
        }
    }

    async fn user<T>(&self, request: &Request<T>) -> Result<String, ApiError> {
        self.identity.user(request.metadata()).await
    }
}

/// A session opening with nothing said, pointing at `thread_id`.
fn silent_opening(thread_id: String, new_user: bool) -> Response<pb::OpenSessionResponse> {
    Response::new(pb::OpenSessionResponse {
        silent: true,
        greeting: String::new(),
        thread_id,
        run_id: String::new(),
        new_user,
    })
}

pub(crate) fn terminal_result(event: &pb::RunEvent) -> Option<pb::RunResult> {
    match &event.kind {
        Some(pb::run_event::Kind::Result(r)) => Some((**r).clone()),
        Some(pb::run_event::Kind::Error(e)) => Some(pb::RunResult {
            run_id: event.run_id.clone(),
            thread_id: event.thread_id.clone(),
            status: if e.kind == pb::FailureKind::Cancelled as i32 {
                pb::RunState::Cancelled
            } else {
                pb::RunState::Failed
            } as i32,
            summary: e.message.clone(),
            error: e.message.clone(),
            failure_kind: e.kind,
            ..pb::RunResult::default()
        }),
        _ => None,
    }
}

#[tonic::async_trait]
impl AgentService for AgentApi {
    type RunStreamStream = EventStream<pb::RunStreamResponse>;
    type WatchRunStream = EventStream<pb::WatchRunResponse>;

    async fn run(
        &self,
        request: Request<pb::RunRequest>,
    ) -> Result<Response<pb::RunResponse>, Status> {
        let user = self.user(&request).await?;
        let input = convert::run_input(request.into_inner().input)?;
        // Waiting on a run is following it, as a stream does: repeated requests must
        // not open followers without bound.
        let _following = self.runs.follower_slot(&user)?;
        let started = self.runs.start_run(&user, input).await?;
        let result = if started.repeated {
            // A repeated request whose run may have gone on since: how it stands now.
            self.runs.latest_result(&user, &started.run_id).await?
        } else {
            self.runs
                .follow_started(&started.run_id, &started.thread_id, Deliver::End)
                .result()
                .await?
                .map(|(_, result)| result)
        };
        match result {
            Some(result) => Ok(Response::new(pb::RunResponse {
                result: Some(result),
            })),
            None => Err(ApiError::Unavailable(format!(
                "run {} ended without a result; follow it with WatchRun",
                started.run_id
            ))
            .into()),
        }
    }

    async fn run_stream(
        &self,
        request: Request<pb::RunStreamRequest>,
    ) -> Result<Response<Self::RunStreamStream>, Status> {
        let user = self.user(&request).await?;
        let input = convert::run_input(request.into_inner().input)?;
        let events = self.runs.start_watched(&user, input).await?;
        Ok(Response::new(Box::pin(events.map(|e| {
            e.map(|event| pb::RunStreamResponse { event: Some(event) })
        }))))
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        let user = self.user(&request).await?;
        let r = request.into_inner();
        convert::optional_id("thread_id", &r.thread_id)?;
        let time_zone = convert::time_zone("time_zone", &r.time_zone)?;
        let request_id = convert::request_id("request_id", &r.request_id)?;
        // The thread first: a missing one is NOT_FOUND whatever the gateway's state, and
        // costs no bootstrap.
        let picked = r.thread_id.is_empty();
        let thread_id = if picked {
            // The conversation the user was last in: not a thread whose runs Steward starts
            // itself (a task agent's report, a schedule's briefings).
            self.store
                .latest_thread_except(&user, &runs::STEWARD_THREAD_PREFIXES)
                .await
                .map_err(ApiError::from)?
                .map(|t| t.id)
        } else {
            self.store
                .get_thread(&user, &r.thread_id)
                .await
                .map_err(ApiError::from)?
                .ok_or_else(|| ApiError::NotFound(format!("thread {}", r.thread_id)))?;
            Some(r.thread_id.clone())
        };
        let gateway = self
            .runs
            .gateway
            .as_ref()
            .ok_or_else(|| ApiError::Unavailable("no gateway is configured".into()))?;
        let context = gateway
            // The name as the zone database spells it: one cache entry per zone.
            .bootstrap(
                &user,
                time_zone.as_ref().and_then(|z| z.iana_name()).unwrap_or(""),
                gw::Channel::SessionOpen,
            )
            .await
            .map_err(|e| match e {
                // The gateway checks what the caller sent (the time zone); anything else it
                // refuses is this deployment's fault, not the caller's.
                GatewayError::Invalid(m) => ApiError::InvalidArgument(m),
                GatewayError::Refused(m) => {
                    tracing::error!(error = %m, "the gateway refused a session bootstrap");
                    ApiError::Unavailable(
                        "the session context is unavailable right now; try again shortly".into(),
                    )
                }
                GatewayError::Unavailable(m) => ApiError::Unavailable(m),
            })?;
        let in_flight = context
            .tasks
            .as_ref()
            .is_some_and(|t| t.pending > 0 || t.status == gw::SourceStatus::Unavailable as i32)
            || context.reminders.as_ref().is_some_and(|r| {
                r.upcoming > 0 || r.status == gw::SourceStatus::Unavailable as i32
            })
            || context.email.as_ref().is_some_and(|e| {
                e.accounts.iter().any(|a| a.unread > 0)
                    || e.status == gw::SourceStatus::Unavailable as i32
            });
        if !context.new_user && !in_flight {
            // B-3: a returning user with nothing in flight hears nothing, and no model is called.
            return Ok(silent_opening(thread_id.unwrap_or_default(), false));
        }
        let session = if context.new_user {
            SessionSetup {
                guidance: prompt::NEW_USER_GUIDANCE.into(),
                bootstrap: None,
                allowed_tools: Some(vec!["create_memories".into()]),
                // Opening the app says nothing to a run waiting for the user's decision.
                yield_to_approvals: true,
            }
        } else {
            SessionSetup {
                guidance: prompt::RETURNING_GUIDANCE.into(),
                bootstrap: Some(context.rendered.clone()),
                allowed_tools: Some(Vec::new()),
                yield_to_approvals: true,
            }
        };
        let input = RunInput {
            prompt: "(The user opened the app.)".into(),
            thread_id,
            conversation: Vec::new(),
            attached: Vec::new(),
            channel: Channel::SessionOpen,
            request_id,
            max_total_tokens: None,
            max_cost_usd: None,
            model_override: None,
            time_zone,
            session: Some(session),
        };
        let picked_thread = input.thread_id.clone().filter(|_| picked);
        // Waiting on the opening's run is following it, as Run does; a silent opening
        // starts none and takes no slot.
        let _following = self.runs.follower_slot(&user)?;
        let (run_id, thread_id) = match self.runs.start(&user, input).await {
            // The thread picked has a run going, or one waiting for the user's approval, which
            // a greeting must not supersede: that is what the user comes back to, so the
            // opening is silent and points at it (a greeting elsewhere would make a new thread
            // the latest). A thread the caller named is refused, saying why.
            Err(ApiError::Aborted(why)) if picked_thread.is_some() => {
                tracing::info!(reason = %why, "session opening silent: its thread is busy");
                return Ok(silent_opening(
                    picked_thread.unwrap_or_default(),
                    context.new_user,
                ));
            }
            started => started?,
        };
        let result = self
            .runs
            .follow_started(&run_id, &thread_id, Deliver::End)
            .result()
            .await?
            .map(|(_, result)| result)
            .unwrap_or_default();
        let silent = result.summary.is_empty() || result.status != pb::RunState::Completed as i32;
        if silent && !result.summary.is_empty() {
            tracing::error!(run_id = %run_id, status = result.status, "session opening did not complete; answering silent");
        }
        Ok(Response::new(pb::OpenSessionResponse {
            silent,
            greeting: if silent {
                String::new()
            } else {
                result.summary
            },
            thread_id,
            run_id,
            new_user: context.new_user,
        }))
    }

    async fn decide_approval(
        &self,
        request: Request<pb::DecideApprovalRequest>,
    ) -> Result<Response<pb::DecideApprovalResponse>, Status> {
        let user = self.user(&request).await?;
        let r = request.into_inner();
        let approve = match pb::Decision::try_from(r.decision) {
            Ok(pb::Decision::Approve) => true,
            Ok(pb::Decision::Reject) => false,
            _ => {
                return Err(ApiError::InvalidArgument(
                    "decision must be DECISION_APPROVE or DECISION_REJECT".into(),
                )
                .into());
            }
        };
        convert::id("approval_id", &r.approval_id)?;
        convert::text("comment", &r.comment, 1024)?;
        let sha = convert::args_sha256(&r.args_sha256)?;
        let decision = self
            .runs
            .decide(&user, &r.approval_id, approve, sha.as_deref())
            .await?;
        if !r.comment.is_empty() {
            // The decider's note goes to the audit trail beside the decision it explains.
            let detail = serde_json::json!({
                "approval_id": r.approval_id,
                "decision": if approve { "approve" } else { "reject" },
                "comment": r.comment,
            });
            let run = Some(decision.approval.run_id.as_str());
            if let Err(e) = self
                .store
                .record_audit(&user, "approval_comment", run, detail)
                .await
            {
                tracing::error!(error = %e, approval_id = %r.approval_id, "could not record an approval's comment");
            }
        }
        let approval = decision.approval;
        let mut result = None;
        // Waiting on the run is following it. A decision is never refused for it: at the
        // cap the caller is answered with the run as it stands, below.
        let following = decision
            .follow
            .as_ref()
            .and_then(|f| Some((f, self.runs.follower_slot(&user).ok()?)));
        if let Some(((run_id, from), _slot)) = following {
            let mut events = self.runs.follow(&user, run_id, *from, Deliver::End).await?;
            result = events.result().await?.map(|(_, r)| r);
        }
        // Not followed (or the run ended before this caller could follow it): the run as
        // it stands.
        if result.is_none() {
            result = self
                .store
                .get_run(&user, &approval.run_id)
                .await
                .map_err(ApiError::from)?
                .map(|run| pb::RunResult {
                    run_id: run.id.clone(),
                    thread_id: run.thread_id.clone(),
                    status: convert::run_state(run.state) as i32,
                    summary: run.summary.clone(),
                    model: run.model.clone(),
                    error: run.error.clone().unwrap_or_default(),
                    failure_kind: convert::failure_kind(run.failure_kind.as_deref()) as i32,
                    ..pb::RunResult::default()
                });
        }
        let approval = self
            .store
            .get_approval(&user, &approval.id)
            .await
            .map_err(ApiError::from)?
            .unwrap_or(approval);
        Ok(Response::new(pb::DecideApprovalResponse {
            approval: Some(convert::approval(&approval)),
            result,
        }))
    }

    async fn get_run(
        &self,
        request: Request<pb::GetRunRequest>,
    ) -> Result<Response<pb::GetRunResponse>, Status> {
        let user = self.user(&request).await?;
        let id = request.into_inner().run_id;
        convert::id("run_id", &id)?;
        let run = self
            .store
            .get_run(&user, &id)
            .await
            .map_err(ApiError::from)?
            .ok_or_else(|| ApiError::NotFound(format!("run {id}")))?;
        let actions = self
            .store
            .list_actions(&run.id)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(pb::GetRunResponse {
            run: Some(convert::run(&run)),
            actions: actions.iter().map(convert::action).collect(),
        }))
    }

    async fn get_usage(
        &self,
        request: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        let user = self.user(&request).await?;
        let (since, until) = convert::usage_window(request.get_ref(), SystemTime::now())?;
        let summed = self
            .store
            .usage(&user, since, until)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(convert::usage(&summed, since, until)))
    }

    async fn list_threads(
        &self,
        request: Request<pb::ListThreadsRequest>,
    ) -> Result<Response<pb::ListThreadsResponse>, Status> {
        let user = self.user(&request).await?;
        let r = request.into_inner();
        let (after, size) = convert::thread_page(&r.page_token, r.page_size)?;
        let threads = self
            .store
            .list_threads(&user, after.as_ref(), size + 1)
            .await
            .map_err(ApiError::from)?;
        let next = match threads.get(size) {
            Some(_) => convert::thread_page_token(&threads[size - 1]),
            None => String::new(),
        };
        Ok(Response::new(pb::ListThreadsResponse {
            threads: threads.iter().take(size).map(convert::thread).collect(),
            next_page_token: next,
        }))
    }

    async fn list_messages(
        &self,
        request: Request<pb::ListMessagesRequest>,
    ) -> Result<Response<pb::ListMessagesResponse>, Status> {
        let user = self.user(&request).await?;
        let r = request.into_inner();
        convert::id("thread_id", &r.thread_id)?;
        self.store
            .get_thread(&user, &r.thread_id)
            .await
            .map_err(ApiError::from)?
            .ok_or_else(|| ApiError::NotFound(format!("thread {}", r.thread_id)))?;
        let (offset, size) = convert::page(&r.page_token, r.page_size, 50, 200)?;
        let messages = self
            .store
            .list_messages(&r.thread_id, offset, size + 1)
            .await
            .map_err(ApiError::from)?;
        let next = if messages.len() > size {
            (offset + size).to_string()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListMessagesResponse {
            messages: messages.iter().take(size).map(convert::message).collect(),
            next_page_token: next,
        }))
    }

    async fn cancel_run(
        &self,
        request: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::CancelRunResponse>, Status> {
        let user = self.user(&request).await?;
        let r = request.into_inner();
        convert::id("run_id", &r.run_id)?;
        convert::text("reason", &r.reason, 1024)?;
        let reason = Some(r.reason.trim()).filter(|s| !s.is_empty());
        let run = self.runs.cancel(&user, &r.run_id, reason).await?;
        Ok(Response::new(pb::CancelRunResponse {
            run: Some(convert::run(&run)),
        }))
    }

    async fn watch_run(
        &self,
        request: Request<pb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let user = self.user(&request).await?;
        let r = request.into_inner();
        convert::id("run_id", &r.run_id)?;
        let events = self.runs.watch(&user, &r.run_id, r.after_seq).await?;
        Ok(Response::new(Box::pin(events.map(|e| {
            e.map(|event| pb::WatchRunResponse { event: Some(event) })
        }))))
    }

    async fn create_schedule(
        &self,
        request: Request<pb::CreateScheduleRequest>,
    ) -> Result<Response<pb::CreateScheduleResponse>, Status> {
        let user = self.user(&request).await?;
        let new = schedules::new_schedule(request.into_inner())?;
        let schedule = self.runs.create_schedule(&user, new).await?;
        Ok(Response::new(pb::CreateScheduleResponse {
            schedule: Some(schedules::schedule(&schedule)),
        }))
    }

    async fn list_schedules(
        &self,
        request: Request<pb::ListSchedulesRequest>,
    ) -> Result<Response<pb::ListSchedulesResponse>, Status> {
        let user = self.user(&request).await?;
        let list = self
            .store
            .list_schedules(&user)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(pb::ListSchedulesResponse {
            schedules: list.iter().map(schedules::schedule).collect(),
        }))
    }

    async fn update_schedule(
        &self,
        request: Request<pb::UpdateScheduleRequest>,
    ) -> Result<Response<pb::UpdateScheduleResponse>, Status> {
        let user = self.user(&request).await?;
        let r = request.into_inner();
        let id = convert::id("schedule_id", &r.schedule_id)?.to_owned();
        let schedule = self
            .runs
            .update_schedule(&user, &id, schedules::change(r)?)
            .await?;
        Ok(Response::new(pb::UpdateScheduleResponse {
            schedule: Some(schedules::schedule(&schedule)),
        }))
    }

    async fn delete_schedule(
        &self,
        request: Request<pb::DeleteScheduleRequest>,
    ) -> Result<Response<pb::DeleteScheduleResponse>, Status> {
        let user = self.user(&request).await?;
        let id = request.into_inner().schedule_id;
        convert::id("schedule_id", &id)?;
        if !self
            .store
            .delete_schedule(&user, &id)
            .await
            .map_err(ApiError::from)?
        {
            return Err(ApiError::NotFound(format!("schedule {id}")).into());
        }
        Ok(Response::new(pb::DeleteScheduleResponse {}))
    }

    async fn run_schedule_now(
        &self,
        request: Request<pb::RunScheduleNowRequest>,
    ) -> Result<Response<pb::RunScheduleNowResponse>, Status> {
        let user = self.user(&request).await?;
        let id = request.into_inner().schedule_id;
        convert::id("schedule_id", &id)?;
        let (run_id, thread_id) = self.runs.run_schedule_now(&user, &id, &self.worker).await?;
        Ok(Response::new(pb::RunScheduleNowResponse {
            run_id,
            thread_id,
        }))
    }
}
