//! The gRPC edge of gateway-svc: authenticate the caller, validate and convert the request,
//! hand it to the engine or the credential store, convert back. Nothing proto-shaped goes
//! deeper than this module.

mod auth;
pub mod convert;
mod status;

use std::{collections::HashMap, panic::AssertUnwindSafe, pin::Pin, sync::Arc};

use futures_util::{FutureExt, StreamExt, stream::FuturesUnordered};
use steward_proto::gateway::v1::{self as pb, gateway_service_server::GatewayService};
use tokio::sync::mpsc;
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

pub use auth::authenticate_headers;
pub use status::ApiError;

use crate::{
    bootstrap::Bootstrap,
    config::CallerAuth,
    credentials::{Credentials, NewAccount},
    domain::{CallOutcome, CallRequest, ErrorKind, UserId},
    engine::{Engine, Recorded},
};

type ResultStream = Pin<Box<dyn Stream<Item = Result<pb::ExecuteResponse, Status>> + Send>>;

/// How many results may wait for a slow reader before tool tasks pause.
const RESULT_BUFFER: usize = 64;

/// Bounds of what ConnectAccount takes: an OAuth token is a few hundred bytes to a few KiB.
const MAX_TOKEN_BYTES: usize = 16 * 1024;
const MAX_SCOPES: usize = 64;

/// An account name as a caller gives it (an address or a team id): 1 to 320 bytes, no control
/// characters.
fn account_name(account: &str) -> Result<(), ApiError> {
    if account.is_empty() || account.len() > 320 || account.chars().any(char::is_control) {
        return Err(ApiError::InvalidArgument(
            "account must be 1 to 320 bytes with no control characters (the address or team id)"
                .into(),
        ));
    }
    Ok(())
}

/// The GatewayService implementation.
pub struct GatewayApi {
    engine: Engine,
    credentials: Credentials,
    bootstrap: Bootstrap,
    auth: CallerAuth,
}

impl GatewayApi {
    pub fn new(
        engine: Engine,
        credentials: Credentials,
        bootstrap: Bootstrap,
        auth: CallerAuth,
    ) -> Self {
        Self {
            engine,
            credentials,
            bootstrap,
            auth,
        }
    }

    fn user<T>(&self, request: &Request<T>) -> Result<UserId, ApiError> {
        auth::authenticate(&self.auth, request.metadata())
    }
}

fn rejected_outcome(r: convert::Rejected) -> CallOutcome {
    failed_outcome(r.call_id, r.tool, r.error.kind(), r.error.to_string())
}

/// A call that ended before reaching any upstream, as its result.
fn failed_outcome(call_id: String, tool: String, kind: ErrorKind, text: String) -> CallOutcome {
    CallOutcome {
        call_id,
        tool,
        error_kind: Some(kind),
        text,
        truncated: false,
        original_chars: 0,
        retry_after_secs: 0,
        display: None,
        upstream_calls: 0,
        account: None,
        latency: std::time::Duration::ZERO,
        replayed: false,
        external: false,
    }
}

/// ListToolsRequest.known_fingerprints holds at most this many.
const MAX_KNOWN_FINGERPRINTS: usize = 16;
/// The longest fingerprint a caller may name (ListTools returns 32 hex digits).
const MAX_FINGERPRINT_LEN: usize = 64;

#[tonic::async_trait]
impl GatewayService for GatewayApi {
    type ExecuteStream = ResultStream;

    async fn list_tools(
        &self,
        request: Request<pb::ListToolsRequest>,
    ) -> Result<Response<pb::ListToolsResponse>, Status> {
        let user = self.user(&request)?;
        let known = request.into_inner().known_fingerprints;
        if known.len() > MAX_KNOWN_FINGERPRINTS {
            return Err(ApiError::InvalidArgument(format!(
                "known_fingerprints holds {} fingerprints; send at most {MAX_KNOWN_FINGERPRINTS}",
                known.len()
            ))
            .into());
        }
        if let Some(long) = known.iter().find(|f| f.len() > MAX_FINGERPRINT_LEN) {
            return Err(ApiError::InvalidArgument(format!(
                "known_fingerprints holds one of {} bytes; a fingerprint is at most \
                 {MAX_FINGERPRINT_LEN} (send them as ListTools returned them)",
                long.len()
            ))
            .into());
        }
        let listed = crate::catalog::tools_for(&self.engine.registry, &self.credentials, &user)
            .await
            .map_err(ApiError::from)?;
        let fingerprint = crate::catalog::fingerprint(&listed);
        if known.contains(&fingerprint) {
            // The caller holds this very list: neither side encodes or decodes it again.
            return Ok(Response::new(pb::ListToolsResponse {
                tools: Vec::new(),
                fingerprint,
                unchanged: true,
            }));
        }
        let tools = listed
            .iter()
            .map(|listed| {
                let availability = if listed.available {
                    pb::ToolAvailability::Ok
                } else {
                    pb::ToolAvailability::SourceUnavailable
                };
                convert::tool_spec(&listed.tool, availability)
            })
            .collect();
        Ok(Response::new(pb::ListToolsResponse {
            tools,
            fingerprint,
            unchanged: false,
        }))
    }

    async fn execute(
        &self,
        request: Request<Streaming<pb::ExecuteRequest>>,
    ) -> Result<Response<Self::ExecuteStream>, Status> {
        let user = self.user(&request)?;
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(RESULT_BUFFER);
        let (engine, user) = (self.engine.clone(), Arc::new(user));
        let execute = move |call: CallRequest, cancel: CancellationToken| {
            let (engine, user) = (engine.clone(), user.clone());
            async move { engine.execute(&user, call, cancel).await }
        };
        // The stream and its calls stay in the caller's trace (the run on agent-svc).
        tokio::spawn(tracing::Instrument::in_current_span(serve_execute_stream(
            inbound, tx, execute,
        )));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn execute_tool(
        &self,
        request: Request<pb::ExecuteToolRequest>,
    ) -> Result<Response<pb::ExecuteToolResponse>, Status> {
        let user = self.user(&request)?;
        let call = request
            .into_inner()
            .call
            .ok_or_else(|| ApiError::InvalidArgument("call is required".into()))?;
        let outcome = match convert::call_request(call) {
            Ok(call) => {
                // A unary caller that goes away drops this future, which cancels the call (a
                // side effect still runs to its end, see `Engine::execute`).
                self.engine
                    .execute(&user, call, CancellationToken::new())
                    .await
            }
            Err(rejected) => rejected_outcome(rejected),
        };
        Ok(Response::new(pb::ExecuteToolResponse {
            result: Some(convert::tool_result(outcome)),
        }))
    }

    async fn preview_call(
        &self,
        request: Request<pb::PreviewCallRequest>,
    ) -> Result<Response<pb::PreviewCallResponse>, Status> {
        let user = self.user(&request)?;
        let call = request
            .into_inner()
            .call
            .ok_or_else(|| ApiError::InvalidArgument("call is required".into()))?;
        let result = match convert::call_request(call) {
            Ok(call) => self.engine.preview(&user, call).await,
            Err(rejected) => Err(rejected.error),
        };
        Ok(Response::new(convert::preview_response(result)))
    }

    async fn lookup_call(
        &self,
        request: Request<pb::LookupCallRequest>,
    ) -> Result<Response<pb::LookupCallResponse>, Status> {
        let user = self.user(&request)?;
        let request = request.into_inner();
        let key = request.idempotency_key;
        let made_at = request
            .made_at
            .and_then(|t| std::time::SystemTime::try_from(t).ok());
        if key.is_empty() || key.len() > 256 || key.contains('\0') {
            return Err(ApiError::InvalidArgument(
                "idempotency_key is required (at most 256 bytes, no NUL)".into(),
            )
            .into());
        }
        let recorded = self
            .engine
            .recorded(&user, &key, made_at)
            .await
            .map_err(ApiError::Store)?;
        // The codes say what the caller can do (see `status`): UNAVAILABLE, ask again later
        // (the call may still answer); ABORTED and DATA_LOSS, it will not be known.
        let found = match recorded {
            Recorded::Done(tool, outcome) => pb::LookupCallResponse {
                found: true,
                result: Some(convert::tool_result(outcome)),
                tool,
            },
            Recorded::None => pb::LookupCallResponse::default(),
            Recorded::Running => {
                return Err(ApiError::StillRunning(format!(
                    "the call with idempotency key {key:?} is still running (or its replica stopped a moment ago); ask again once it has finished"
                ))
                .into());
            }
            Recorded::MayHaveActed => {
                return Err(ApiError::Store(crate::store::StoreError::MayHaveActed(format!(
                    "the call with idempotency key {key:?} ended without recording its result: it may have taken effect"
                )))
                .into());
            }
            Recorded::Swept => {
                return Err(ApiError::Store(crate::store::StoreError::MayHaveActed(format!(
                    "the call with idempotency key {key:?} was made longer ago than this gateway keeps its records (IDEMPOTENCY_RETENTION): it may have taken effect"
                )))
                .into());
            }
            Recorded::Unreadable(why) => {
                return Err(ApiError::Unreadable(format!(
                    "the stored result of the call with idempotency key {key:?} cannot be read by this build: {why}"
                ))
                .into());
            }
        };
        Ok(Response::new(found))
    }

    async fn get_bootstrap_context(
        &self,
        request: Request<pb::GetBootstrapContextRequest>,
    ) -> Result<Response<pb::GetBootstrapContextResponse>, Status> {
        let user = self.user(&request)?;
        let time_zone = request.into_inner().time_zone;
        if !time_zone.is_empty() && jiff::tz::TimeZone::get(&time_zone).is_err() {
            return Err(ApiError::InvalidArgument(format!(
                "time_zone {time_zone:?} is not an IANA time zone (e.g. Europe/Berlin)"
            ))
            .into());
        }
        let context = self.bootstrap.context(&user, &time_zone).await;
        Ok(Response::new(convert::bootstrap(&context)))
    }

    async fn connect_account(
        &self,
        request: Request<pb::ConnectAccountRequest>,
    ) -> Result<Response<pb::ConnectAccountResponse>, Status> {
        let user = self.user(&request)?;
        let r = request.into_inner();
        let integration = convert::integration_from_pb(r.integration).ok_or_else(|| {
            ApiError::InvalidArgument("integration must be set (e.g. INTEGRATION_GMAIL)".into())
        })?;
        account_name(&r.account)?;
        for (field, value) in [
            ("access_token", &r.access_token),
            ("refresh_token", &r.refresh_token),
        ] {
            if value.len() > MAX_TOKEN_BYTES || value.chars().any(char::is_control) {
                return Err(ApiError::InvalidArgument(format!(
                    "{field} must be at most {MAX_TOKEN_BYTES} bytes with no control characters"
                ))
                .into());
            }
        }
        if r.access_token.is_empty() {
            return Err(ApiError::InvalidArgument("access_token is required".into()).into());
        }
        if r.scopes.len() > MAX_SCOPES || r.scopes.iter().any(|s| s.len() > 512 || s.contains('\0'))
        {
            return Err(ApiError::InvalidArgument(format!(
                "scopes must be at most {MAX_SCOPES}, each at most 512 bytes"
            ))
            .into());
        }
        let expires_at = match &r.expires_at {
            None => None,
            Some(t) => Some(convert::expiry(t).map_err(ApiError::InvalidArgument)?),
        };
        let new = NewAccount {
            integration,
            account: r.account,
            access_token: r.access_token,
            refresh_token: Some(r.refresh_token).filter(|t| !t.is_empty()),
            expires_at,
            scopes: r.scopes,
        };
        let info = self
            .credentials
            .connect(&user, new)
            .await
            .map_err(ApiError::from)?;
        tracing::info!(user = %user, integration = integration.key(), account = %info.account, "account connected");
        Ok(Response::new(pb::ConnectAccountResponse {
            account: Some(convert::account(&info)),
        }))
    }

    async fn list_accounts(
        &self,
        request: Request<pb::ListAccountsRequest>,
    ) -> Result<Response<pb::ListAccountsResponse>, Status> {
        let user = self.user(&request)?;
        let accounts = self.credentials.list(&user).await.map_err(ApiError::from)?;
        Ok(Response::new(pb::ListAccountsResponse {
            accounts: accounts.iter().map(convert::account).collect(),
        }))
    }

    async fn disconnect_account(
        &self,
        request: Request<pb::DisconnectAccountRequest>,
    ) -> Result<Response<pb::DisconnectAccountResponse>, Status> {
        let user = self.user(&request)?;
        let r = request.into_inner();
        let integration = convert::integration_from_pb(r.integration).ok_or_else(|| {
            ApiError::InvalidArgument("integration must be set (e.g. INTEGRATION_GMAIL)".into())
        })?;
        account_name(&r.account)?;
        if !self
            .credentials
            .disconnect(&user, integration, &r.account)
            .await
            .map_err(ApiError::from)?
        {
            return Err(ApiError::NotFound(format!(
                "no {} account {:?} is connected",
                integration.label(),
                r.account
            ))
            .into());
        }
        Ok(Response::new(pb::DisconnectAccountResponse {}))
    }

    async fn set_mcp_enabled(
        &self,
        request: Request<pb::SetMcpEnabledRequest>,
    ) -> Result<Response<pb::SetMcpEnabledResponse>, Status> {
        let user = self.user(&request)?;
        let r = request.into_inner();
        if r.server.is_empty() {
            return Err(ApiError::InvalidArgument(
                "server must name an MCP server (see MCP_SERVERS)".into(),
            )
            .into());
        }
        let switch = crate::domain::McpSwitch {
            server: r.server,
            tool: (!r.tool.is_empty()).then_some(r.tool),
        };
        let Some(hub) = self.engine.registry.mcp() else {
            return Err(ApiError::NotFound("no MCP server is configured".into()).into());
        };
        let disabled = hub
            .set_enabled(&user, &switch, r.enabled)
            .await
            .map_err(|e| match e {
                crate::mcp::SwitchError::UnknownServer(m) => ApiError::NotFound(m),
                crate::mcp::SwitchError::Invalid(m) => ApiError::InvalidArgument(m),
                crate::mcp::SwitchError::Store(s) => ApiError::Store(s),
            })?;
        tracing::info!(user = %user, server = %switch.server, tool = switch.tool.as_deref().unwrap_or(""), enabled = r.enabled, "MCP switch set");
        Ok(Response::new(pb::SetMcpEnabledResponse {
            disabled: disabled
                .into_iter()
                .map(|s| pb::McpSwitch {
                    server: s.server,
                    tool: s.tool.unwrap_or_default(),
                })
                .collect(),
        }))
    }
}

/// Runs one Execute stream: its calls run concurrently inside this task, results sent as they
/// finish. A half-closed request side lets in-flight calls finish; a dropped stream (the caller
/// went away or cancelled) cancels them.
///
/// The calls are polled here rather than spawned: a result then goes from the call straight to
/// the response stream, one task wake-up fewer per call on the path of every tool iteration
/// (issue 13), and a call that panics becomes an INTERNAL result for the model instead of a
/// call that never answers.
async fn serve_execute_stream<Call>(
    mut inbound: impl Stream<Item = Result<pb::ExecuteRequest, Status>> + Unpin,
    tx: mpsc::Sender<Result<pb::ExecuteResponse, Status>>,
    execute: impl Fn(CallRequest, CancellationToken) -> Call,
) where
    Call: Future<Output = CallOutcome>,
{
    let stream_cancel = CancellationToken::new();
    let mut inflight: HashMap<String, CancellationToken> = HashMap::new();
    let mut calls = FuturesUnordered::new();
    let send = |tx: mpsc::Sender<Result<pb::ExecuteResponse, Status>>, outcome: CallOutcome| async move {
        let _ = tx
            .send(Ok(pb::ExecuteResponse {
                result: Some(convert::tool_result(outcome)),
            }))
            .await;
    };

    let mut reading = true;
    loop {
        tokio::select! {
            message = inbound.next(), if reading => match message.transpose() {
                Ok(Some(pb::ExecuteRequest { kind: Some(pb::execute_request::Kind::Call(call)) })) => {
                    let call = match convert::call_request(call) {
                        Ok(call) => call,
                        Err(rejected) => {
                            send(tx.clone(), rejected_outcome(rejected)).await;
                            continue;
                        }
                    };
                    if inflight.contains_key(&call.call_id) {
                        let rejected = convert::Rejected {
                            error: crate::enforce::ToolError::InvalidArguments {
                                tool: call.tool.clone(),
                                detail: format!("call_id {:?} is already in flight on this stream", call.call_id),
                            },
                            call_id: call.call_id,
                            tool: call.tool,
                        };
                        send(tx.clone(), rejected_outcome(rejected)).await;
                        continue;
                    }
                    let token = stream_cancel.child_token();
                    inflight.insert(call.call_id.clone(), token.clone());
                    let tx = tx.clone();
                    let (call_id, tool) = (call.call_id.clone(), call.tool.clone());
                    let running = execute(call, token);
                    calls.push(tracing::Instrument::in_current_span(async move {
                        let outcome = AssertUnwindSafe(running)
                            .catch_unwind()
                            .await
                            .unwrap_or_else(|_| panicked_outcome(call_id.clone(), tool));
                        send(tx, outcome).await;
                        call_id
                    }));
                }
                Ok(Some(pb::ExecuteRequest { kind: Some(pb::execute_request::Kind::Cancel(c)) })) => {
                    if let Some(token) = inflight.get(&c.call_id) {
                        token.cancel();
                    }
                }
                Ok(Some(pb::ExecuteRequest { kind: None })) => {}
                Ok(None) => reading = false,
                Err(status) => {
                    tracing::info!(code = ?status.code(), "execute stream broke; cancelling its calls");
                    stream_cancel.cancel();
                    break;
                }
            },
            Some(call_id) = calls.next(), if !calls.is_empty() => {
                inflight.remove(&call_id);
            },
            () = tx.closed() => {
                // A run that ended drops its stream: routine unless calls were still going.
                if inflight.is_empty() {
                    tracing::debug!("execute stream closed by the caller");
                } else {
                    tracing::info!(calls = inflight.len(), "execute stream dropped by the caller; cancelling its calls");
                }
                stream_cancel.cancel();
                break;
            }
        }
        if !reading && calls.is_empty() {
            break;
        }
    }
    // Cancelled calls still finish (with ERROR_KIND_CANCELLED) and are audited.
    while calls.next().await.is_some() {}
}

/// What the model is told of a call whose code panicked: a clear failure, never silence.
fn panicked_outcome(call_id: String, tool: String) -> CallOutcome {
    tracing::error!(tool = %tool, call_id = %call_id, "tool call panicked");
    let text = format!(
        "The tool {tool} failed inside the gateway (an internal error); it may or may not have taken effect."
    );
    failed_outcome(call_id, tool, ErrorKind::Internal, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, tool: &str) -> Result<pb::ExecuteRequest, Status> {
        Ok(pb::ExecuteRequest {
            kind: Some(pb::execute_request::Kind::Call(pb::ToolCall {
                call_id: id.into(),
                tool: tool.into(),
                ..Default::default()
            })),
        })
    }

    fn answered(call: &CallRequest) -> CallOutcome {
        CallOutcome {
            error_kind: None,
            text: format!("{} done", call.tool),
            ..failed_outcome(
                call.call_id.clone(),
                call.tool.clone(),
                ErrorKind::Internal,
                String::new(),
            )
        }
    }

    #[tokio::test]
    async fn a_call_that_panics_is_answered_as_internal_and_the_stream_keeps_serving() {
        let (requests, inbound) = mpsc::channel(8);
        let (tx, mut results) = mpsc::channel(8);
        // "slow" answers only after "boom" has panicked, so the panic meets a call in flight.
        let (boomed, boomed_wait) = tokio::sync::watch::channel(false);
        let execute = move |call: CallRequest, _cancel: CancellationToken| {
            let (boomed, mut boomed_wait) = (boomed.clone(), boomed_wait.clone());
            async move {
                match call.tool.as_str() {
                    "boom" => {
                        boomed.send_replace(true);
                        panic!("a bug in a tool");
                    }
                    "slow" => {
                        let _ = boomed_wait.wait_for(|b| *b).await;
                        answered(&call)
                    }
                    _ => answered(&call),
                }
            }
        };
        let served = tokio::spawn(serve_execute_stream(
            ReceiverStream::new(inbound),
            tx,
            execute,
        ));
        for (id, tool) in [("c1", "slow"), ("c2", "boom")] {
            requests.send(call(id, tool)).await.expect("serving");
        }
        let mut got = HashMap::new();
        for _ in 0..2 {
            let r = results
                .recv()
                .await
                .expect("a result")
                .expect("not a status")
                .result
                .expect("a tool result");
            got.insert(r.call_id.clone(), r);
        }
        let boom = &got["c2"];
        assert!(!boom.ok);
        assert_eq!(boom.error_kind, pb::ErrorKind::Internal as i32);
        assert!(boom.text.contains("boom"), "names the tool: {}", boom.text);
        assert!(got["c1"].ok, "the call in flight still answered");
        // The stream still takes calls after the panic.
        requests.send(call("c3", "fine")).await.expect("serving");
        let r = results
            .recv()
            .await
            .expect("a result")
            .expect("not a status");
        assert_eq!(r.result.expect("a tool result").call_id, "c3");
        drop(requests);
        served
            .await
            .expect("the stream ends cleanly when its caller half-closes");
    }
}
