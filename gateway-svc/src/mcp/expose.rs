//! The gateway's own tools served over MCP (streamable HTTP, `MCP_LISTEN_ADDR`), so MCP
//! clients get the enforced integrations: every request proves itself like a gRPC caller (the
//! service token, and the user in `x-steward-user-id`), each user sees only their own tools,
//! and every call runs through the same engine as a gRPC call.

use std::{net::SocketAddr, sync::Arc};

use axum::{
    extract::{Request, State},
    middleware::Next,
    response::{IntoResponse, Response},
};
use rmcp::{
    ErrorData, RoleServer, ServerHandler,
    model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
        ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, ToolAnnotations,
    },
    service::RequestContext,
    transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    },
};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    api::{ApiError, authenticate_headers},
    config::CallerAuth,
    credentials::Credentials,
    domain::{CallRequest, Channel, Integration, UserId},
    enforce::ToolError,
    engine::Engine,
};

/// Where MCP clients send their requests.
pub const PATH: &str = "/mcp";
/// `_meta` key a client may set to make a side-effect call idempotent across its retries.
pub const IDEMPOTENCY_META_KEY: &str = "steward/idempotency_key";

/// The MCP face of the engine, one per session.
#[derive(Clone)]
pub struct GatewayTools {
    engine: Engine,
    credentials: Credentials,
    /// The calls in flight, which a shutdown lets finish before it ends the sessions.
    calls: TaskTracker,
}

impl GatewayTools {
    pub fn new(engine: Engine, credentials: Credentials) -> Self {
        Self {
            engine,
            credentials,
            calls: TaskTracker::new(),
        }
    }
}

/// The user the authentication layer found for this request.
fn user_of(context: &RequestContext<RoleServer>) -> Result<UserId, ErrorData> {
    context
        .extensions
        .get::<http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<UserId>())
        .cloned()
        .ok_or_else(|| {
            ErrorData::invalid_request("the request carries no authenticated user", None)
        })
}

fn internal(e: impl std::fmt::Display) -> ErrorData {
    ErrorData::internal_error(e.to_string(), None)
}

impl ServerHandler for GatewayTools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_server_info(
            Implementation::new("steward-gateway", env!("CARGO_PKG_VERSION")),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let user = user_of(&context)?;
        let listed = crate::catalog::tools_for(&self.engine.registry, &self.credentials, &user)
            .await
            .map_err(internal)?;
        let tools = listed
            .iter()
            // The gateway's own tools; other servers' tools are theirs to serve.
            .filter(|l| l.tool.spec.integration != Integration::Mcp)
            .filter_map(|l| {
                let spec = &l.tool.spec;
                let Value::Object(schema) = spec.schema.clone() else {
                    return None;
                };
                let annotations = ToolAnnotations::from_raw(
                    None,
                    Some(l.tool.read_only),
                    Some(spec.side_effect),
                    None,
                    Some(spec.integration.provider().is_some()),
                );
                Some(
                    rmcp::model::Tool::new(spec.name.clone(), spec.description.clone(), schema)
                        .with_annotations(annotations),
                )
            })
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let user = user_of(&context)?;
        let name = request.name.to_string();
        let text = |t: String| vec![ContentBlock::text(t)];
        if self
            .engine
            .registry
            .get(&name)
            .is_none_or(|t| t.spec.integration == Integration::Mcp)
        {
            return Ok(CallToolResult::error(text(format!(
                "There is no tool named {name:?} here. Use only the tools tools/list gives."
            )))
            .into());
        }
        let call_id = format!("mcp-{}", uuid::Uuid::new_v4());
        let client_key = request
            .meta
            .as_ref()
            .and_then(|m| m.get(IDEMPOTENCY_META_KEY));
        let idempotency_key = match idempotency_key(client_key, &name) {
            Ok(key) => key,
            Err(e) => return Ok(CallToolResult::error(text(e.to_string())).into()),
        };
        let call = CallRequest {
            call_id,
            tool: name,
            args: Value::Object(request.arguments.unwrap_or_default()),
            idempotency_key: Some(idempotency_key),
            channel: Channel::Web,
            timeout: None,
            run_id: None,
            read_external_from: Vec::new(),
            expected_binding: None,
            time_zone: None,
        };
        let outcome = self
            .calls
            .track_future(self.engine.execute(&user, call, context.ct.clone()))
            .await;
        let content = text(outcome.text.clone());
        Ok(if outcome.ok() {
            CallToolResult::success(content)
        } else {
            CallToolResult::error(content)
        }
        .into())
    }
}

/// The key a call from an MCP client runs under. Keys of MCP clients live apart from
/// agent-svc's (`mcp:`), and are checked as gRPC checks its callers' keys. Without a client
/// key each request is its own key: a client's retry acts again — it should set the key. A
/// key that is there but not a string (`42`, `null`) is refused: read as absent, the client's
/// retry would act again though it set a key.
fn idempotency_key(client_key: Option<&Value>, tool: &str) -> Result<String, ToolError> {
    let client_key = match client_key {
        None => None,
        Some(Value::String(key)) => Some(key.as_str()),
        Some(other) => {
            return Err(ToolError::InvalidArguments {
                tool: tool.into(),
                detail: format!(
                    "{IDEMPOTENCY_META_KEY} must be a string, not {}",
                    json_type(other)
                ),
            });
        }
    };
    match client_key.filter(|k| !k.is_empty()) {
        Some(key) => match crate::api::convert::idempotency_key_problem(key) {
            Some(problem) => Err(ToolError::InvalidArguments {
                tool: tool.into(),
                detail: problem.replace("idempotency_key", IDEMPOTENCY_META_KEY),
            }),
            None => Ok(format!("mcp:{key}")),
        },
        // Request ids repeat across clients (every client starts at 0 or 1), and a stateless
        // request has no session to tell them apart: a fresh key per request.
        None => Ok(format!("mcp-request:{}", uuid::Uuid::new_v4())),
    }
}

/// The JSON type of `v`, as a client's error names it.
fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Refuses a request without valid credentials before MCP sees it, and hands the user on.
async fn require_caller(
    State(auth): State<Arc<CallerAuth>>,
    mut request: Request,
    next: Next,
) -> Response {
    match authenticate_headers(&auth, request.headers()) {
        Ok(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        Err(e) => {
            let status = match e {
                ApiError::Unauthenticated(_) => http::StatusCode::UNAUTHORIZED,
                _ => http::StatusCode::BAD_REQUEST,
            };
            (status, e.to_string()).into_response()
        }
    }
}

/// The MCP endpoint, bound at start so a taken port fails the start.
pub struct McpEndpoint {
    listener: TcpListener,
    router: axum::Router,
    sessions: CancellationToken,
    calls: TaskTracker,
}

impl McpEndpoint {
    pub async fn bind(
        addr: SocketAddr,
        allowed_hosts: &[String],
        tools: GatewayTools,
        auth: CallerAuth,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let sessions = CancellationToken::new();
        let calls = tools.calls.clone();
        let mut config = StreamableHttpServerConfig::default();
        config.cancellation_token = sessions.clone();
        // Stateless: every request stands alone (the user comes with each one), so any replica
        // behind a Service answers any request, and no session state is lost with a pod.
        config.legacy_session_mode = false;
        config = if allowed_hosts.is_empty() {
            config.disable_allowed_hosts()
        } else {
            config.with_allowed_hosts(allowed_hosts.iter().cloned())
        };
        let service: StreamableHttpService<GatewayTools, LocalSessionManager> =
            StreamableHttpService::new(move || Ok(tools.clone()), Default::default(), config);
        let router = axum::Router::new().nest_service(PATH, service).layer(
            axum::middleware::from_fn_with_state(Arc::new(auth), require_caller),
        );
        Ok(Self {
            listener,
            router,
            sessions,
            calls,
        })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `stopping` is cancelled; then [`Serving::drain`] ends it.
    pub fn start(self, stopping: CancellationToken) -> Serving {
        let sessions = self.sessions.clone();
        let calls = self.calls.clone();
        let task = tokio::spawn(async move {
            let result = axum::serve(self.listener, self.router)
                .with_graceful_shutdown(async move { stopping.cancelled().await })
                .await;
            if let Err(e) = result {
                tracing::error!(error = %e, "the MCP endpoint stopped");
            }
        });
        Serving {
            task,
            sessions,
            calls,
        }
    }
}

/// A running MCP endpoint.
pub struct Serving {
    task: tokio::task::JoinHandle<()>,
    sessions: CancellationToken,
    calls: TaskTracker,
}

impl Serving {
    /// After the listener stopped accepting: lets the calls in flight finish by `deadline`,
    /// then ends the sessions (their open event streams would hold the server forever) and
    /// whatever is still running.
    pub async fn drain(self, deadline: tokio::time::Instant) {
        self.calls.close();
        if tokio::time::timeout_at(deadline, self.calls.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                calls = self.calls.len(),
                "MCP calls still running at the drain deadline are cancelled"
            );
        }
        self.sessions.cancel();
        let mut task = self.task;
        let grace = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
        if tokio::time::timeout_at(grace.max(deadline), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> Value {
        Value::String(k.to_owned())
    }

    #[test]
    fn a_clients_idempotency_key_is_checked_as_grpc_checks_it() {
        assert_eq!(
            idempotency_key(Some(&key("k-1")), "gmail_send").unwrap(),
            "mcp:k-1"
        );
        assert!(
            idempotency_key(None, "gmail_send")
                .unwrap()
                .starts_with("mcp-request:")
        );
        for bad in ["a\0b".to_owned(), "a\r\nb".to_owned(), "k".repeat(129)] {
            let e = idempotency_key(Some(&key(&bad)), "gmail_send").unwrap_err();
            assert_eq!(
                e.kind(),
                crate::domain::ErrorKind::InvalidArguments,
                "{bad:?}"
            );
            assert!(e.to_string().contains(IDEMPOTENCY_META_KEY), "{e}");
        }
        assert!(idempotency_key(Some(&key(&"k".repeat(128))), "gmail_send").is_ok());
    }

    #[test]
    fn p4_a_clients_idempotency_key_that_is_not_a_string_is_refused_not_ignored() {
        for bad in [
            serde_json::json!(42),
            Value::Null,
            serde_json::json!(true),
            serde_json::json!(["k"]),
            serde_json::json!({"k": 1}),
        ] {
            let e = idempotency_key(Some(&bad), "gmail_send").unwrap_err();
            assert_eq!(
                e.kind(),
                crate::domain::ErrorKind::InvalidArguments,
                "{bad}"
            );
            assert!(e.to_string().contains(IDEMPOTENCY_META_KEY), "{e}");
            assert!(e.to_string().contains("must be a string"), "{e}");
        }
    }
}
