//! One configured MCP server as a tool source: a task keeps the connection (streamable HTTP,
//! through `rmcp`), lists its tools, re-lists them on `notifications/tools/list_changed` and
//! probes the server; each listed tool is a [`Tool`] the engine runs like a built-in one.
//!
//! A server that is down or slow never stalls anything else: calls to it fail at once (or at
//! their deadline) with a sentence, ListTools marks its tools unavailable from the last list it
//! gave, and the task tries it again every `MCP_RECONNECT_INTERVAL`.

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, RwLock, Weak},
    time::{Duration, Instant},
};

use rmcp::{
    ClientHandler, Peer, RoleClient, ServiceError, ServiceExt,
    model::{
        CallToolRequestParams, ClientRequest, ContentBlock, PaginatedRequestParams, PingRequest,
        ResourceContents,
    },
    service::{MaybeSendFuture, NotificationContext, RunningService},
    transport::{
        StreamableHttpClientTransport,
        common::client_side_sse::NeverRetry,
        streamable_http_client::{StreamableHttpClientTransportConfig, StreamableHttpError},
    },
};
use serde_json::Value;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{
    config::{McpConfig, McpServerConfig},
    context::CallContext,
    domain::{Integration, UserId},
    enforce::ToolError,
    registry::{Preview, RegisteredTool, Tool, ToolOutput, ToolSpec, clip, digest},
    store::McpSwitchStore,
};

/// The longest description a server's tool may bring into every prompt.
const MAX_DESCRIPTION_CHARS: usize = 1024;
/// The largest input schema accepted from a server, serialized (a schema is sent with every
/// model call).
const MAX_SCHEMA_BYTES: usize = 32 * 1024;
/// The most tools taken from one server, and the most pages of `tools/list` read to find
/// them: a server cannot flood the registry (or every prompt).
const MAX_TOOLS: usize = 128;
const MAX_LIST_PAGES: usize = 16;
/// The longest tool name taken from a server (the MCP specification's own limit).
const MAX_REMOTE_NAME: usize = 128;

/// Where the connection stands.
#[derive(Debug, Clone, PartialEq)]
enum Status {
    Connecting,
    Ready,
    Unavailable(String),
}

struct State {
    status: Status,
    peer: Option<Peer<RoleClient>>,
    /// Which connection `peer` is: a call that lost connection N must not mark N + 1 down.
    generation: u64,
    /// As the server listed them: (its definition, the registered tool), reused while the
    /// definition stays the same.
    tools: Vec<(rmcp::model::Tool, Arc<RegisteredTool>)>,
    /// Canonical name and alias → tool.
    by_name: HashMap<String, Arc<RegisteredTool>>,
}

pub struct McpServer {
    pub name: String,
    /// "MCP server \"docs\"": how errors name it. Leaked once per configured server, because
    /// `ToolError` names services by `&'static str`.
    label: &'static str,
    config: McpServerConfig,
    /// The URL without credentials or query, for errors and logs.
    shown_url: String,
    connect_timeout: Duration,
    reconnect_interval: Duration,
    http: reqwest::Client,
    state: RwLock<State>,
    switches: Arc<dyn McpSwitchStore>,
    /// The server said its tools changed.
    list_changed: Notify,
    /// A call lost the connection: probe and reconnect now.
    lost: Notify,
}

impl McpServer {
    pub(super) fn start(
        config: McpServerConfig,
        mcp: &McpConfig,
        switches: Arc<dyn McpSwitchStore>,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, String> {
        // Its own client: the shared one's overall timeout would cut the server's event
        // stream, which stays open for notifications. Calls are bounded by the engine.
        let http = reqwest::Client::builder()
            .connect_timeout(mcp.connect_timeout)
            // A redirect would carry the configured headers (API keys) to another host.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("steward-gateway/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| {
                format!(
                    "MCP server {}: cannot build its HTTP client: {e}",
                    config.name
                )
            })?;
        let server = Arc::new(Self {
            name: config.name.clone(),
            label: Box::leak(format!("MCP server \"{}\"", config.name).into_boxed_str()),
            shown_url: shown_url(&config.url),
            config,
            connect_timeout: mcp.connect_timeout,
            reconnect_interval: mcp.reconnect_interval,
            http,
            state: RwLock::new(State {
                status: Status::Connecting,
                peer: None,
                generation: 0,
                tools: Vec::new(),
                by_name: HashMap::new(),
            }),
            switches,
            list_changed: Notify::new(),
            lost: Notify::new(),
        });
        tokio::spawn(keep_connected(Arc::downgrade(&server), stop));
        Ok(server)
    }

    pub fn label(&self) -> &'static str {
        self.label
    }

    pub fn is_available(&self) -> bool {
        self.state
            .read()
            .is_ok_and(|s| s.status == Status::Ready && s.peer.is_some())
    }

    /// Why it is not available, for errors and logs.
    fn unavailable_reason(&self) -> String {
        match self.state.read().map(|s| s.status.clone()) {
            Ok(Status::Unavailable(why)) => why,
            Ok(Status::Connecting) => "it is still being connected".into(),
            Ok(Status::Ready) => "its connection was lost".into(),
            Err(_) => "its state is unreadable".into(),
        }
    }

    pub(super) fn get(&self, name: &str) -> Option<Arc<RegisteredTool>> {
        self.state.read().ok()?.by_name.get(name).cloned()
    }

    /// (its own name, tool) for every tool of the last list.
    pub(super) fn tools(&self) -> Vec<(String, Arc<RegisteredTool>)> {
        self.state
            .read()
            .map(|s| {
                s.tools
                    .iter()
                    .map(|(remote, tool)| (remote.name.to_string(), tool.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The connection to call on, and which one it is.
    fn peer(&self) -> Result<(Peer<RoleClient>, u64), ToolError> {
        let state = self
            .state
            .read()
            .map_err(|_| ToolError::Internal("poisoned".into()))?;
        match (&state.status, &state.peer) {
            (Status::Ready, Some(peer)) => Ok((peer.clone(), state.generation)),
            _ => {
                drop(state);
                Err(ToolError::UpstreamUnavailable {
                    service: self.label,
                    detail: format!("it is unavailable: {}", self.unavailable_reason()),
                })
            }
        }
    }

    /// Ready on a new connection, or unavailable.
    fn set_status(&self, status: Status, peer: Option<Peer<RoleClient>>) {
        if let Ok(mut state) = self.state.write() {
            if state.status != status {
                match &status {
                    Status::Unavailable(why) => {
                        tracing::warn!(server = %self.name, reason = %why, "MCP server unavailable")
                    }
                    Status::Ready => tracing::info!(server = %self.name, "MCP server connected"),
                    Status::Connecting => {}
                }
            }
            if peer.is_some() {
                state.generation += 1;
            }
            state.status = status;
            state.peer = peer;
        }
    }

    /// A call found connection `generation` broken: marked at once (unless a newer connection
    /// replaced it meanwhile), and the task reconnects.
    fn connection_lost(&self, generation: u64, why: String) {
        let current = self.state.read().is_ok_and(|s| s.generation == generation);
        if current {
            self.set_status(Status::Unavailable(why), None);
            self.lost.notify_one();
        }
    }

    /// A call ended without an answer (its deadline, or its caller gone): probe now.
    fn suspect(&self) {
        self.lost.notify_one();
    }

    /// Replaces the tool list with what the server listed now; unchanged definitions keep
    /// their registered tool (no schema compiled again).
    fn set_tools(self: &Arc<Self>, listed: Vec<rmcp::model::Tool>) {
        let previous = self
            .state
            .read()
            .map(|s| s.tools.clone())
            .unwrap_or_default();
        if previous.len() == listed.len()
            && previous
                .iter()
                .zip(&listed)
                .all(|((old, _), new)| old == new)
        {
            return;
        }
        let mut tools = Vec::new();
        let mut by_name = HashMap::new();
        for remote in listed {
            if tools.len() == MAX_TOOLS {
                tracing::warn!(server = %self.name, max = MAX_TOOLS, "MCP server lists more tools than are taken; the rest are left out");
                break;
            }
            let reused = previous
                .iter()
                .find(|(old, _)| *old == remote)
                .map(|(_, t)| t.clone());
            let tool = match reused.map_or_else(
                || {
                    McpTool::new(self, &remote).and_then(|t| {
                        RegisteredTool::new(Arc::new(t))
                            .map(Arc::new)
                            .map_err(|e| e.to_string())
                    })
                },
                Ok,
            ) {
                Ok(t) => t,
                Err(why) => {
                    tracing::warn!(server = %self.name, tool = %clip(&remote.name, MAX_REMOTE_NAME), reason = %why, "MCP tool skipped");
                    continue;
                }
            };
            let names = std::iter::once(&tool.spec.name).chain(&tool.spec.aliases);
            if names.clone().any(|n| by_name.contains_key(n)) {
                tracing::warn!(server = %self.name, tool = %remote.name, "MCP tool skipped: its name collides with another of the server's tools");
                continue;
            }
            for name in names {
                by_name.insert(name.clone(), tool.clone());
            }
            tools.push((remote, tool));
        }
        tracing::info!(server = %self.name, tools = tools.len(), "MCP tools listed");
        if let Ok(mut state) = self.state.write() {
            state.tools = tools;
            state.by_name = by_name;
        }
    }

    /// Whether `user` turned this tool (or the whole server) off.
    async fn check_enabled(&self, user: &UserId, remote: &str) -> Result<(), ToolError> {
        let off = self.switches.disabled_mcp(user).await.map_err(|e| {
            ToolError::Internal(format!("cannot read the user's MCP settings: {e}"))
        })?;
        if off.iter().any(|s| s.covers(&self.name, remote)) {
            return Err(ToolError::PermissionDenied {
                service: self.label,
                account: user.to_string(),
                detail: format!("the user turned {remote} off; do not call it"),
            });
        }
        Ok(())
    }

    async fn connect(self: &Arc<Self>) -> Result<RunningService<RoleClient, Listener>, String> {
        let headers = self
            .config
            .headers
            .iter()
            .filter_map(|(k, v)| {
                Some((
                    http::HeaderName::try_from(k.as_str()).ok()?,
                    http::HeaderValue::try_from(v.expose()).ok()?,
                ))
            })
            .collect();
        let mut transport = StreamableHttpClientTransportConfig::with_uri(self.config.url.as_str())
            .custom_headers(headers);
        // A broken event stream is a lost connection, handled by this task, not retried
        // inside the transport while a call waits.
        transport.retry_config = Arc::new(NeverRetry::default());
        let transport = StreamableHttpClientTransport::with_client(self.http.clone(), transport);
        let listener = Listener {
            server: Arc::downgrade(self),
        };
        match tokio::time::timeout(self.connect_timeout, listener.serve(transport)).await {
            Ok(Ok(running)) => Ok(running),
            Ok(Err(e)) => Err(format!(
                "cannot connect to {}: {}",
                self.shown_url,
                scrub(&e.to_string(), &self.config.url)
            )),
            Err(_) => Err(format!(
                "{} did not answer within {:?}",
                self.shown_url, self.connect_timeout
            )),
        }
    }

    /// Lists the tools (at most [`MAX_LIST_PAGES`] pages); an error means the connection is no
    /// good.
    async fn list(self: &Arc<Self>, peer: &Peer<RoleClient>) -> Result<(), String> {
        let pages = async {
            let mut tools = Vec::new();
            let mut cursor = None;
            for _ in 0..MAX_LIST_PAGES {
                let page = peer
                    .list_tools(Some(PaginatedRequestParams::default().with_cursor(cursor)))
                    .await?;
                tools.extend(page.tools);
                cursor = page.next_cursor;
                if cursor.is_none() || tools.len() >= MAX_TOOLS {
                    break;
                }
            }
            Ok::<_, ServiceError>(tools)
        };
        match tokio::time::timeout(self.connect_timeout, pages).await {
            Ok(Ok(tools)) => {
                self.set_tools(tools);
                Ok(())
            }
            Ok(Err(e)) => Err(format!(
                "listing its tools failed: {}",
                scrub(&e.to_string(), &self.config.url)
            )),
            Err(_) => Err(format!(
                "it did not list its tools within {:?}",
                self.connect_timeout
            )),
        }
    }

    /// Asks the server whether it is there.
    async fn ping(&self, peer: &Peer<RoleClient>) -> Result<(), String> {
        let ping = peer.send_request(ClientRequest::PingRequest(PingRequest::default()));
        match tokio::time::timeout(self.connect_timeout, ping).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!(
                "it stopped answering: {}",
                scrub(&e.to_string(), &self.config.url)
            )),
            Err(_) => Err(format!(
                "it did not answer a ping within {:?}",
                self.connect_timeout
            )),
        }
    }
}

/// The URL as errors and logs may show it: scheme, host, port and path, never a user, a
/// password or a query (which may hold a key).
fn shown_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => "(its URL)".into(),
    }
}

/// `text` with the configured URL (which may hold a key) replaced by its shown form. An error
/// may quote the URL as written or as the HTTP client normalised it, or quote only its secret
/// parts; each is taken out.
fn scrub(text: &str, url: &str) -> String {
    // The whole URL first, to a marker the secrets cannot be part of; the shown form goes in
    // last, so hiding a secret never edits it.
    const MARK: &str = "\u{1}url\u{1}";
    let mut out = text.replace(url, MARK);
    if let Ok(parsed) = reqwest::Url::parse(url) {
        out = out.replace(parsed.as_str(), MARK);
        let mut secrets: Vec<String> = [parsed.password(), parsed.query(), Some(parsed.username())]
            .into_iter()
            .flatten()
            .map(str::to_owned)
            .collect();
        // Each query value on its own too, as sent and as decoded.
        for (_, value) in parsed.query_pairs() {
            secrets.push(value.into_owned());
        }
        if let Some(query) = parsed.query() {
            secrets.extend(
                query
                    .split('&')
                    .filter_map(|p| p.split_once('='))
                    .map(|(_, v)| v.to_owned()),
            );
        }
        // Longest first, so a part of a longer secret is not hidden alone. A part of a few
        // characters would blot out ordinary words; such a part is no key.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        for secret in secrets.iter().filter(|s| s.len() >= 6) {
            out = out.replace(secret.as_str(), "(hidden)");
        }
    }
    out.replace(MARK, &shown_url(url))
}

/// Connects, lists, then follows the server: re-lists on list_changed, pings every interval,
/// and reconnects after a loss (at once the first time, then every interval). Ends when the
/// hub stops or the server is dropped.
async fn keep_connected(server: Weak<McpServer>, stop: CancellationToken) {
    let mut pause = false;
    loop {
        if pause {
            let Some(interval) = server.upgrade().map(|s| s.reconnect_interval) else {
                return;
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
        let Some(this) = server.upgrade() else { return };
        match this.connect().await {
            Ok(running) => {
                let peer = running.peer().clone();
                match this.list(&peer).await {
                    Ok(()) => {
                        this.set_status(Status::Ready, Some(peer.clone()));
                        if let Some(why) = follow(&this, &peer, &stop).await {
                            this.set_status(Status::Unavailable(why), None);
                        }
                        // A connection that worked is tried again at once.
                        pause = false;
                    }
                    Err(why) => {
                        this.set_status(Status::Unavailable(why), None);
                        pause = true;
                    }
                }
                // Closing a dead connection may wait on the network; never let it hold up
                // the next attempt.
                tokio::spawn(async move {
                    let _ = running.cancel().await;
                });
                if stop.is_cancelled() {
                    return;
                }
            }
            Err(why) => {
                this.set_status(Status::Unavailable(why), None);
                pause = true;
            }
        }
    }
}

/// While connected: `None` when stopping, otherwise why the connection is given up.
async fn follow(
    server: &Arc<McpServer>,
    peer: &Peer<RoleClient>,
    stop: &CancellationToken,
) -> Option<String> {
    loop {
        tokio::select! {
            () = stop.cancelled() => return None,
            () = server.list_changed.notified() => {
                if let Err(why) = server.list(peer).await {
                    return Some(why);
                }
            }
            () = server.lost.notified() => {
                // A call saw the connection break or go quiet; a ping decides.
                if !server.is_available() {
                    return Some(server.unavailable_reason());
                }
                if let Err(why) = server.ping(peer).await {
                    return Some(why);
                }
            }
            () = tokio::time::sleep(server.reconnect_interval) => {
                if let Err(why) = server.ping(peer).await {
                    return Some(why);
                }
            }
        }
    }
}

/// Receives the server's notifications for its task.
struct Listener {
    server: Weak<McpServer>,
}

impl ClientHandler for Listener {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        if let Some(server) = self.server.upgrade() {
            server.list_changed.notify_one();
        }
        std::future::ready(())
    }
}

/// One tool of an MCP server.
struct McpTool {
    /// Weak: the server holds its tools.
    server: Weak<McpServer>,
    label: &'static str,
    /// As the server names it.
    remote: String,
    spec: ToolSpec,
    /// What approving a call binds to: the tool's definition as listed (server, name,
    /// description, schema, annotations), so a redefined tool needs a new approval.
    definition: String,
}

impl McpTool {
    fn new(server: &Arc<McpServer>, remote: &rmcp::model::Tool) -> Result<Self, String> {
        if remote.name.is_empty() || remote.name.len() > MAX_REMOTE_NAME {
            return Err(format!(
                "its name must be 1 to {MAX_REMOTE_NAME} characters"
            ));
        }
        let schema = Value::Object((*remote.input_schema).clone());
        let size = schema.to_string().len();
        if size > MAX_SCHEMA_BYTES {
            return Err(format!(
                "its input schema is {size} bytes; the most accepted is {MAX_SCHEMA_BYTES}"
            ));
        }
        let description = remote
            .description
            .as_deref()
            .or(remote.title.as_deref())
            .unwrap_or("(no description)");
        // Only a tool its server declares read-only is spared approval: without the hint it
        // may act on the world, so policy treats it as a side effect.
        let read_only = remote
            .annotations
            .as_ref()
            .and_then(|a| a.read_only_hint)
            .unwrap_or(false);
        let mut spec = ToolSpec::new(
            &super::canonical_name(&server.name, &remote.name),
            Integration::Mcp,
            &format!(
                "[MCP server {}] {}",
                server.name,
                clip(description, MAX_DESCRIPTION_CHARS)
            ),
            schema,
        )
        .with_aliases(&[&super::alias_name(&server.name, &remote.name)])
        .with_cost(1)
        // What a third party's server returns is not the user's own words.
        .reading_external_content();
        if !read_only {
            spec = spec.with_side_effect();
        }
        let definition = serde_json::to_string(remote).unwrap_or_default();
        Ok(Self {
            remote: remote.name.to_string(),
            server: Arc::downgrade(server),
            label: server.label,
            spec,
            definition: digest(&[&server.name, &definition]),
        })
    }

    fn server(&self) -> Result<Arc<McpServer>, ToolError> {
        self.server.upgrade().ok_or(ToolError::UpstreamUnavailable {
            service: self.label,
            detail: "it is no longer configured".into(),
        })
    }
}

/// Tells the server's task to probe when a call ends without an answer: its deadline passed,
/// or its caller went away, and the engine dropped it.
struct ProbeIfUnanswered<'a> {
    server: &'a McpServer,
    answered: bool,
}

impl Drop for ProbeIfUnanswered<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.server.suspect();
        }
    }
}

#[async_trait::async_trait]
impl Tool for McpTool {
    fn spec(&self) -> ToolSpec {
        self.spec.clone()
    }

    fn read_only(&self) -> bool {
        !self.spec.side_effect
    }

    fn service(&self) -> &'static str {
        self.label
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let server = self.server()?;
        server.check_enabled(&ctx.user, &self.remote).await?;
        // A server known to be down costs the user nothing.
        let (peer, generation) = server.peer()?;
        ctx.charge(Integration::Mcp, &server.name, 1).await?;
        let arguments = match args {
            Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        let params = CallToolRequestParams::new(self.remote.clone()).with_arguments(arguments);
        // A remote tool may change anything: once the call leaves, a side effect's failure
        // short of the server's own answer may come after it acted (the engine decides).
        ctx.write_attempt().await?;
        let started = Instant::now();
        ctx.upstream_attempt();
        let mut probe = ProbeIfUnanswered {
            server: &server,
            answered: false,
        };
        let result = peer.call_tool(params).await;
        probe.answered = true;
        drop(probe);
        if result.as_ref().is_err_and(never_sent) {
            ctx.write_refused();
        }
        let (status, bytes) = match &result {
            Ok(r) if r.is_error == Some(true) => ("tool_error", 0),
            Ok(r) => ("ok", render(&r.content, None).len()),
            Err(e) => (error_status(e), 0),
        };
        ctx.record_upstream_call(Integration::Mcp, Some(&server.name), status, started, bytes)
            .await;
        let result = result.map_err(|e| {
            let error = describe(server.label, &server.config.url, e);
            if error.kind() == crate::domain::ErrorKind::UpstreamUnavailable {
                server.connection_lost(generation, error.to_string());
            }
            error
        })?;
        let text = render(&result.content, result.structured_content.as_ref());
        if result.is_error == Some(true) {
            return Err(ToolError::RemoteTool {
                service: server.label,
                detail: clip(&scrub(&text, &server.config.url), 2000),
            });
        }
        Ok(ToolOutput::text(text))
    }

    async fn preview(&self, ctx: &CallContext, args: &Value) -> Result<Preview, ToolError> {
        let server = self.server()?;
        server.check_enabled(&ctx.user, &self.remote).await?;
        Ok(Preview {
            text: format!(
                "{} on MCP server {}: {}",
                self.remote,
                server.name,
                clip(&args.to_string(), 300)
            ),
            recipients: Vec::new(),
            binding: self.definition.clone(),
        })
    }
}

/// Whether a failed `tools/call` provably never reached the server: its HTTP request could not
/// connect (DNS, refused, connect timeout, TLS handshake), so nothing was written and it did
/// nothing. Any other transport failure may have come after the server read the call.
fn never_sent(e: &ServiceError) -> bool {
    let ServiceError::TransportSend(e) = e else {
        return false;
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e.error.as_ref());
    while let Some(error) = cause {
        // The transport's own error does not name the client's as its source.
        if let Some(StreamableHttpError::Client(r)) =
            error.downcast_ref::<StreamableHttpError<reqwest::Error>>()
        {
            return r.is_connect();
        }
        if let Some(r) = error.downcast_ref::<reqwest::Error>() {
            return r.is_connect();
        }
        cause = error.source();
    }
    false
}

fn error_status(e: &ServiceError) -> &'static str {
    match e {
        ServiceError::McpError(_) => "mcp_error",
        ServiceError::Timeout { .. } => "upstream_timeout",
        _ => "upstream_unavailable",
    }
}

/// A failed `tools/call` as a sentence for the model; the server's `url` (which may hold a
/// key) never appears in it.
fn describe(service: &'static str, url: &str, e: ServiceError) -> ToolError {
    match e {
        // The server answered with a JSON-RPC error: its words, not a broken connection.
        ServiceError::McpError(data) => ToolError::RemoteTool {
            service,
            detail: clip(&scrub(&data.message, url), 2000),
        },
        ServiceError::Timeout { timeout } => ToolError::UpstreamTimeout {
            service,
            after: timeout,
        },
        ServiceError::Cancelled { .. } => ToolError::Cancelled,
        // A transport failure's text can carry the server's own response body: it goes to
        // the log, and the model reads only what happened.
        other => {
            tracing::warn!(service, error = %scrub(&other.to_string(), url), "an MCP call's connection failed");
            ToolError::UpstreamUnavailable {
                service,
                detail: "the connection failed mid-call".into(),
            }
        }
    }
}

/// The model's text for a result: text blocks as they are, other blocks named in a line (an
/// image is never pasted into a prompt), structured content when there is nothing else.
fn render(content: &[ContentBlock], structured: Option<&Value>) -> String {
    let mut parts: Vec<String> = content
        .iter()
        .map(|block| match block {
            ContentBlock::Text(t) => t.text.clone(),
            ContentBlock::Image(i) => {
                format!("[an image ({}) was returned and left out]", i.mime_type)
            }
            ContentBlock::Audio(a) => {
                format!("[audio ({}) was returned and left out]", a.mime_type)
            }
            ContentBlock::Resource(r) => match &r.resource {
                ResourceContents::TextResourceContents { uri, text, .. } => {
                    format!("[resource {uri}]\n{text}")
                }
                ResourceContents::BlobResourceContents { uri, .. } => {
                    format!("[resource {uri}: binary, left out]")
                }
                _ => "[a resource of a kind this gateway does not read was left out]".to_owned(),
            },
            ContentBlock::ResourceLink(l) => format!("[resource link {} ({})]", l.uri, l.name),
            _ => "[content of a kind this gateway does not read was left out]".to_owned(),
        })
        .collect();
    if parts.is_empty()
        && let Some(value) = structured
    {
        parts.push(value.to_string());
    }
    parts.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send error as the streamable HTTP transport reports it, wrapping `error`.
    fn send_error(error: StreamableHttpError<reqwest::Error>) -> ServiceError {
        ServiceError::TransportSend(rmcp::transport::DynamicTransportError::from_parts(
            "streamable-http",
            std::any::TypeId::of::<()>(),
            Box::new(error),
        ))
    }

    #[tokio::test]
    async fn p4_a_call_that_could_not_connect_never_reached_the_server() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/mcp", closed.local_addr().unwrap());
        drop(closed);
        let refused = reqwest::Client::new().post(&url).send().await.unwrap_err();
        assert!(refused.is_connect());
        assert!(never_sent(&send_error(StreamableHttpError::Client(
            refused
        ))));
    }

    #[test]
    fn p4_a_call_whose_transport_failed_otherwise_may_have_reached_the_server() {
        assert!(!never_sent(&ServiceError::TransportClosed));
        assert!(!never_sent(&send_error(
            StreamableHttpError::UnexpectedEndOfStream
        )));
        assert!(!never_sent(&ServiceError::Timeout {
            timeout: Duration::from_secs(1)
        }));
    }

    const URL: &str = "https://user:s3cret-pass@mcp.example.com:8443/mcp?api_key=k-0123456789";

    #[test]
    fn a_scrubbed_error_keeps_the_host_and_never_the_key_in_any_form_it_was_quoted() {
        for quoted in [
            format!("error sending request for url ({URL})"),
            "bad query api_key=k-0123456789".to_owned(),
            "auth failed for s3cret-pass".to_owned(),
        ] {
            let shown = scrub(&quoted, URL);
            assert!(!shown.contains("k-0123456789"), "{shown}");
            assert!(!shown.contains("s3cret-pass"), "{shown}");
        }
        assert_eq!(
            scrub(&format!("cannot reach {URL}"), URL),
            "cannot reach https://mcp.example.com:8443/mcp"
        );
    }

    #[test]
    fn a_url_quoted_as_the_http_client_normalised_it_is_scrubbed_too() {
        let configured = "HTTPS://MCP.example.com?api_key=k-0123456789";
        let normalised = "https://mcp.example.com/?api_key=k-0123456789";
        assert_eq!(
            scrub(
                &format!("error sending request for url ({normalised})"),
                configured
            ),
            "error sending request for url (https://mcp.example.com/)"
        );
    }

    #[test]
    fn each_query_value_is_hidden_alone_and_the_shown_host_is_never_edited() {
        let url = "https://example:pass-word@mcp.example.com/mcp?a=1&api_key=SECRET-123";
        let shown = scrub(
            &format!("failed {url}: api_key=SECRET-123 rejected by SECRET-123"),
            url,
        );
        assert!(!shown.contains("SECRET-123"), "{shown}");
        assert!(!shown.contains("pass-word"), "{shown}");
        assert!(
            shown.starts_with("failed https://mcp.example.com/mcp:"),
            "{shown}"
        );
    }

    #[test]
    fn a_broken_call_is_described_without_the_key() {
        let url = "http://127.0.0.1:9/mcp?token=abcdef123456";
        let error = describe(
            "MCP server \"demo\"",
            url,
            ServiceError::McpError(rmcp::model::ErrorData::internal_error(
                format!("upstream {url} refused"),
                None,
            )),
        );
        let text = error.to_string();
        assert!(!text.contains("abcdef123456"), "{text}");
        assert!(text.contains("http://127.0.0.1:9/mcp"), "{text}");
    }
}
