//! The gRPC edge of gateway-svc: authenticate the caller, validate and convert the request,
//! hand it to the engine or the credential store, convert back. Nothing proto-shaped goes
//! deeper than this module.

mod auth;
pub mod convert;
mod status;

use std::{collections::HashMap, pin::Pin, sync::Arc};

use steward_proto::gateway::v1::{self as pb, gateway_service_server::GatewayService};
use tokio::{sync::mpsc, task::JoinSet};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

pub use auth::authenticate_headers;
pub use status::ApiError;

use crate::{
    bootstrap::Bootstrap,
    config::CallerAuth,
    credentials::{Credentials, NewAccount},
    domain::{CallOutcome, UserId},
    engine::Engine,
};

type ResultStream = Pin<Box<dyn Stream<Item = Result<pb::ExecuteResponse, Status>> + Send>>;

/// How many results may wait for a slow reader before tool tasks pause.
const RESULT_BUFFER: usize = 64;

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
    CallOutcome {
        call_id: r.call_id,
        tool: r.tool,
        error_kind: Some(r.error.kind()),
        text: r.error.to_string(),
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

#[tonic::async_trait]
impl GatewayService for GatewayApi {
    type ExecuteStream = ResultStream;

    async fn list_tools(
        &self,
        request: Request<pb::ListToolsRequest>,
    ) -> Result<Response<pb::ListToolsResponse>, Status> {
        let user = self.user(&request)?;
        let tools = crate::catalog::tools_for(&self.engine.registry, &self.credentials, &user)
            .await
            .map_err(ApiError::from)?
            .iter()
            .map(|listed| {
                let availability = if listed.available {
                    pb::ToolAvailability::Ok
                } else {
                    pb::ToolAvailability::SourceUnavailable
                };
                convert::tool_spec(&listed.tool.spec, availability)
            })
            .collect();
        Ok(Response::new(pb::ListToolsResponse { tools }))
    }

    async fn execute(
        &self,
        request: Request<Streaming<pb::ExecuteRequest>>,
    ) -> Result<Response<Self::ExecuteStream>, Status> {
        let user = self.user(&request)?;
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(RESULT_BUFFER);
        // The stream and its calls stay in the caller's trace (the run on agent-svc).
        tokio::spawn(tracing::Instrument::in_current_span(serve_execute_stream(
            self.engine.clone(),
            user,
            inbound,
            tx,
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
                // A unary caller that goes away drops this future, which cancels the call.
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
        let key = request.into_inner().idempotency_key;
        if key.is_empty() || key.len() > 256 {
            return Err(ApiError::InvalidArgument(
                "idempotency_key is required (at most 256 bytes)".into(),
            )
            .into());
        }
        let recorded = self
            .engine
            .recorded(&user, &key)
            .await
            .map_err(|e| ApiError::Store(crate::store::StoreError::Unavailable(e)))?;
        Ok(Response::new(match recorded {
            Some((tool, outcome)) => pb::LookupCallResponse {
                found: true,
                result: Some(convert::tool_result(outcome)),
                tool,
            },
            None => pb::LookupCallResponse::default(),
        }))
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
        if r.account.is_empty() || r.account.len() > 320 {
            return Err(ApiError::InvalidArgument(
                "account must be 1 to 320 bytes (the address or team id)".into(),
            )
            .into());
        }
        if r.access_token.is_empty() {
            return Err(ApiError::InvalidArgument("access_token is required".into()).into());
        }
        let new = NewAccount {
            integration,
            account: r.account,
            access_token: r.access_token,
            refresh_token: Some(r.refresh_token).filter(|t| !t.is_empty()),
            expires_at: r.expires_at.as_ref().and_then(convert::system_time),
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

/// Runs one Execute stream: every call in its own task, results sent as they finish. A
/// half-closed request side lets in-flight calls finish; a dropped stream (the caller went away
/// or cancelled) cancels them.
async fn serve_execute_stream(
    engine: Engine,
    user: UserId,
    mut inbound: Streaming<pb::ExecuteRequest>,
    tx: mpsc::Sender<Result<pb::ExecuteResponse, Status>>,
) {
    let stream_cancel = CancellationToken::new();
    let mut inflight: HashMap<String, CancellationToken> = HashMap::new();
    let mut tasks: JoinSet<String> = JoinSet::new();
    let user = Arc::new(user);
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
            message = inbound.message(), if reading => match message {
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
                    let (engine, user, tx) = (engine.clone(), user.clone(), tx.clone());
                    tasks.spawn(tracing::Instrument::in_current_span(async move {
                        let call_id = call.call_id.clone();
                        let outcome = engine.execute(&user, call, token).await;
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
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                if let Ok(call_id) = done {
                    inflight.remove(&call_id);
                }
                if !reading && tasks.is_empty() {
                    break;
                }
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
        if !reading && tasks.is_empty() {
            break;
        }
    }
    // Cancelled calls still finish (with ERROR_KIND_CANCELLED) and are audited.
    while tasks.join_next().await.is_some() {}
}
