//! agent-svc's side of the gateway contract: ListTools, and one Execute stream per run that
//! carries the run's tool calls concurrently and routes results back by call id. The user id
//! travels in metadata with the service token (S3 5.2); the model never supplies it.

use std::{
    collections::{HashMap, HashSet},
    hash::{Hash, Hasher},
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::FutureExt;
use steward_proto::gateway::v1::{self as pb, gateway_service_client::GatewayServiceClient};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tonic::{Request, metadata::MetadataValue, transport::Channel};

use crate::{
    executor::{ToolInvocation, ToolOutcome, ToolRunner},
    llm::{ToolDecl, ToolSet},
};

/// What the gateway's records say of a side-effect call.
#[derive(Debug, Clone)]
pub enum Looked {
    /// It completed: what it returned.
    Found(ToolOutcome),
    /// It never reached upstream.
    NeverRan,
    /// It will not be known (the gateway's words why): it may have acted.
    Unknown(String),
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("gateway-svc is unreachable: {0}")]
    Unavailable(String),
    #[error("gateway-svc refused the call: {0}")]
    Refused(String),
    /// The gateway found what was sent invalid (INVALID_ARGUMENT): its words name what to fix.
    #[error("gateway-svc refused the call: InvalidArgument: {0}")]
    Invalid(String),
}

impl From<tonic::Status> for GatewayError {
    fn from(s: tonic::Status) -> Self {
        match s.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
                GatewayError::Unavailable(s.message().to_owned())
            }
            tonic::Code::InvalidArgument => GatewayError::Invalid(s.message().to_owned()),
            _ => GatewayError::Refused(format!("{:?}: {}", s.code(), s.message())),
        }
    }
}

/// How often a run asks for its tools before it fails (R-5), the first wait between two tries
/// (tripled after each), and how long one try may take.
const LIST_TOOLS_ATTEMPTS: u32 = 3;
const LIST_TOOLS_FIRST_RETRY: std::time::Duration = std::time::Duration::from_millis(200);
const LIST_TOOLS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The error kind of a call whose request was sent but whose answer never came (timeout, the
/// stream went away): it may or may not have happened upstream.
pub const OUTCOME_UNKNOWN: &str = "OUTCOME_UNKNOWN";

/// A tool as the gateway declares it, in the agent's terms.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayTool {
    pub decl: ToolDecl,
    pub side_effect: bool,
    /// Its output carries words written by others (email, invitations, chat).
    pub reads_external_content: bool,
    /// What it stores shows up in later prompts (memories).
    pub writes_memory: bool,
}

/// What a call would do, as the gateway resolved it without doing it (P-4, issue 14).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CallPreview {
    pub text: String,
    pub recipients: Vec<String>,
    pub binding: String,
}

/// One call made outside a run's Execute stream (an approved action, the prompt's memory
/// lookup): the idempotency key makes a repeat return the first result (P-4).
#[derive(Debug, Clone, Copy)]
pub struct OnceCall<'a> {
    pub user: &'a str,
    pub run_id: &'a str,
    pub channel: pb::Channel,
    pub call_id: &'a str,
    pub tool: &'a str,
    pub args: &'a serde_json::Value,
    pub idempotency_key: &'a str,
    /// The tools whose external content the run had read (memory provenance).
    pub read_external_from: &'a [String],
    /// The approved preview's binding; the gateway refuses the call if it no longer holds.
    pub expected_binding: &'a str,
    /// The run's IANA zone (empty: not known), which the result's dates are shown in and local
    /// times in the arguments are read in.
    pub time_zone: &'a str,
}

impl<'a> OnceCall<'a> {
    fn proto(&self) -> pb::ToolCall {
        pb::ToolCall {
            call_id: self.call_id.to_owned(),
            tool: self.tool.to_owned(),
            arguments: Some(pb::tool_call::Arguments::ArgsJson(self.args.to_string())),
            idempotency_key: self.idempotency_key.to_owned(),
            channel: self.channel as i32,
            timeout: None,
            run_id: self.run_id.to_owned(),
            read_external_from: self.read_external_from.to_vec(),
            expected_binding: self.expected_binding.to_owned(),
            time_zone: self.time_zone.to_owned(),
        }
    }
}

/// A tool list as the gateway gave it. Users with the same integrations get equal lists, and
/// one copy of each distinct list is kept (see [`ToolLists`]): a burst of runs of many users
/// neither parses the schemas nor holds them once per run or per user (issue 13).
#[derive(Debug, Default)]
pub struct ToolList {
    pub tools: Vec<GatewayTool>,
    /// Names by what the policy needs to know of them.
    pub side_effects: HashSet<String>,
    pub external_readers: HashSet<String>,
    pub memory_writers: HashSet<String>,
    /// Each schema as sent, to tell lists apart.
    schemas: Vec<String>,
    /// What runs offer the model from this whole list, prepared by the first such run: one per
    /// kind of run (see `runs::drive`).
    offered: [OnceLock<Arc<ToolSet>>; 2],
}

impl ToolList {
    fn new(specs: Vec<pb::ToolSpec>) -> Self {
        let mut list = ToolList::default();
        for t in specs {
            if t.side_effect {
                list.side_effects.insert(t.name.clone());
            }
            if t.reads_external_content {
                list.external_readers.insert(t.name.clone());
            }
            if t.writes_memory {
                list.memory_writers.insert(t.name.clone());
            }
            list.tools.push(GatewayTool {
                decl: ToolDecl {
                    parameters: serde_json::from_str(&t.parameters_json_schema)
                        .unwrap_or_else(|_| serde_json::json!({"type": "object"})),
                    name: t.name,
                    description: t.description,
                },
                side_effect: t.side_effect,
                reads_external_content: t.reads_external_content,
                writes_memory: t.writes_memory,
            });
            list.schemas.push(t.parameters_json_schema);
        }
        list
    }

    fn same_as(&self, specs: &[pb::ToolSpec]) -> bool {
        self.tools.len() == specs.len()
            && self
                .tools
                .iter()
                .zip(&self.schemas)
                .zip(specs)
                .all(|((t, schema), s)| {
                    t.decl.name == s.name
                        && t.decl.description == s.description
                        && *schema == s.parameters_json_schema
                        && t.side_effect == s.side_effect
                        && t.reads_external_content == s.reads_external_content
                        && t.writes_memory == s.writes_memory
                })
    }

    /// The tool set offered to the model by runs of kind `kind` that offer this whole list,
    /// built by `build` the first time.
    pub fn offered(&self, kind: usize, build: impl FnOnce() -> Arc<ToolSet>) -> Arc<ToolSet> {
        self.offered[kind % 2].get_or_init(build).clone()
    }
}

/// One copy of each distinct tool list, by a hash of what the gateway sent; and the lists the
/// gateway fingerprinted, by fingerprint. Each ListTools names the newest of those, and one the
/// gateway answers "unchanged" neither encodes nor parses the list again (issue 13).
#[derive(Default)]
struct ToolLists(Mutex<Interned>);

#[derive(Default)]
struct Interned {
    by_hash: HashMap<u64, Arc<ToolList>>,
    by_fingerprint: HashMap<String, Arc<ToolList>>,
    /// The fingerprints of `by_fingerprint`, the most recently answered last.
    recent: std::collections::VecDeque<String>,
    /// ListTools answers that carried a whole list (the others said "unchanged").
    sent: u64,
}

/// Distinct lists kept; past that the interner starts over (lists still in use stay alive).
const DISTINCT_LISTS: usize = 256;

/// Fingerprints named per ListTools (the gateway takes up to 16): users with the same
/// integrations share a list, so a few cover most runs.
const KNOWN_FINGERPRINTS: usize = 8;

impl ToolLists {
    fn lock(&self) -> std::sync::MutexGuard<'_, Interned> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn intern(&self, specs: Vec<pb::ToolSpec>) -> Arc<ToolList> {
        // A fast unkeyed hash: a collision only costs a comparison (`same_as`), and SipHash
        // over every description and schema was 2.6% of a run's instructions (issue 13).
        let mut h = std::hash::BuildHasher::build_hasher(&foldhash::fast::FixedState::default());
        for s in &specs {
            (
                &s.name,
                &s.description,
                &s.parameters_json_schema,
                s.side_effect,
                s.reads_external_content,
                s.writes_memory,
            )
                .hash(&mut h);
        }
        let key = h.finish();
        if let Some(list) = self.lock().by_hash.get(&key)
            && list.same_as(&specs)
        {
            return list.clone();
        }
        // Parsed outside the lock: another run may parse the same list meanwhile; one wins.
        let list = Arc::new(ToolList::new(specs));
        let mut lists = self.lock();
        if lists.by_hash.len() >= DISTINCT_LISTS {
            lists.by_hash.clear();
        }
        lists.by_hash.insert(key, list.clone());
        list
    }

    /// The fingerprints to name in a ListTools.
    fn known(&self) -> Vec<String> {
        self.lock().recent.iter().rev().cloned().collect()
    }

    /// The list the gateway answered "unchanged" for, unless forgotten since it was named.
    fn fingerprinted(&self, fingerprint: &str) -> Option<Arc<ToolList>> {
        let mut lists = self.lock();
        let list = lists.by_fingerprint.get(fingerprint).cloned()?;
        lists.remember(fingerprint.to_owned(), &list);
        Some(list)
    }

    /// A ListTools answer that sent the list.
    fn sent(&self, response: pb::ListToolsResponse) -> Arc<ToolList> {
        self.lock().sent += 1;
        let list = self.intern(response.tools);
        // An older gateway sends no fingerprint.
        if !response.fingerprint.is_empty() {
            self.lock().remember(response.fingerprint, &list);
        }
        list
    }
}

impl Interned {
    /// Records that the gateway's list `fingerprint` is `list`, as the newest.
    fn remember(&mut self, fingerprint: String, list: &Arc<ToolList>) {
        self.recent.retain(|f| *f != fingerprint);
        self.recent.push_back(fingerprint.clone());
        self.by_fingerprint.insert(fingerprint, list.clone());
        while self.recent.len() > KNOWN_FINGERPRINTS {
            if let Some(oldest) = self.recent.pop_front() {
                self.by_fingerprint.remove(&oldest);
            }
        }
    }
}

/// The longest a bootstrap context may take (a session opening has 15 s in all).
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct GatewayClient {
    channel: Channel,
    token: String,
    /// How long one tool call may take before the run stops waiting for it.
    pub call_timeout: Duration,
    /// Each user's tool list per channel, reused for a few seconds: a burst of runs asks the
    /// gateway once (issue 13). A newly connected account shows within the TTL.
    tools: Option<ToolsCache>,
    lists: Arc<ToolLists>,
}

/// Tool lists by (user, channel).
type ToolsCache = moka::future::Cache<(String, i32), Arc<ToolList>>;

impl GatewayClient {
    pub fn connect_lazy(url: &str, token: &str) -> Result<Self, GatewayError> {
        Self::connect_lazy_tls(url, token, &svc_kit::tls::ClientTls::default())
    }

    /// As [`GatewayClient::connect_lazy`]; an `https://` URL gets TLS with `tls` (mTLS when it
    /// holds a client key pair), never a silent plaintext channel.
    pub fn connect_lazy_tls(
        url: &str,
        token: &str,
        tls: &svc_kit::tls::ClientTls,
    ) -> Result<Self, GatewayError> {
        let mut endpoint = Channel::from_shared(url.to_owned())
            .map_err(|e| GatewayError::Unavailable(format!("bad GATEWAY_URL: {e}")))?;
        if url.starts_with("https://") {
            endpoint = endpoint.tls_config(tls.tonic_config()).map_err(|e| {
                GatewayError::Unavailable(format!("GATEWAY_URL TLS settings are unusable: {e}"))
            })?;
        }
        let channel = endpoint
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .connect_lazy();
        Ok(Self {
            channel,
            token: token.to_owned(),
            call_timeout: Duration::from_secs(60),
            tools: None,
            lists: Arc::default(),
        })
    }

    /// Reuses each user's tool list for `ttl` (zero: no reuse).
    pub fn with_tools_cache(mut self, ttl: Duration) -> Self {
        self.tools = (!ttl.is_zero()).then(|| {
            moka::future::Cache::builder()
                .max_capacity(10_000)
                .time_to_live(ttl)
                .build()
        });
        self
    }

    fn request<T>(&self, message: T, user: &str) -> Result<Request<T>, GatewayError> {
        let mut request = Request::new(message);
        let md = request.metadata_mut();
        // One trace from the run to its tool calls on the gateway.
        svc_kit::telemetry::inject(md);
        md.insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {}", self.token))
                .map_err(|_| GatewayError::Refused("token is not ASCII".into()))?,
        );
        md.insert(
            "x-steward-user-id",
            MetadataValue::try_from(user)
                .map_err(|_| GatewayError::Refused("user id is not ASCII".into()))?,
        );
        Ok(request)
    }

    /// The user's tools on `channel`: from the cache while fresh, else
    /// [`GatewayClient::list_tools`], each attempt under [`LIST_TOOLS_TIMEOUT`], tried again
    /// while gateway-svc cannot be reached (a restart, a rollout) up to [`LIST_TOOLS_ATTEMPTS`]
    /// times; a refusal is final at once. Only a successful list is kept.
    pub async fn list_tools_retrying(
        &self,
        user: &str,
        channel: pb::Channel,
    ) -> Result<Arc<ToolList>, GatewayError> {
        let key = (user.to_owned(), channel as i32);
        if let Some(cache) = &self.tools
            && let Some(tools) = cache.get(&key).await
        {
            return Ok(tools);
        }
        let tools = self.list_tools_fresh(user, channel).await?;
        if let Some(cache) = &self.tools {
            cache.insert(key, tools.clone()).await;
        }
        Ok(tools)
    }

    /// ListTools with its retries, never from the cache.
    async fn list_tools_fresh(
        &self,
        user: &str,
        channel: pb::Channel,
    ) -> Result<Arc<ToolList>, GatewayError> {
        let mut delay = LIST_TOOLS_FIRST_RETRY;
        let mut attempt = 1;
        loop {
            let error = match tokio::time::timeout(
                LIST_TOOLS_TIMEOUT,
                self.list_tools(user, channel),
            )
            .await
            {
                Ok(Ok(tools)) => return Ok(tools),
                Ok(Err(refused @ (GatewayError::Refused(_) | GatewayError::Invalid(_)))) => {
                    return Err(refused);
                }
                Ok(Err(unavailable)) => unavailable,
                Err(_) => GatewayError::Unavailable(format!(
                    "ListTools had no answer within {LIST_TOOLS_TIMEOUT:?}"
                )),
            };
            if attempt == LIST_TOOLS_ATTEMPTS {
                return Err(error);
            }
            tracing::warn!(attempt, error = %error, "ListTools failed; trying again");
            tokio::time::sleep(delay).await;
            delay *= 3;
            attempt += 1;
        }
    }

    /// How many ListTools answers carried a whole list, the others having said "unchanged"
    /// (what the fingerprints save, for tests and investigation).
    pub fn whole_lists_received(&self) -> u64 {
        self.lists.lock().sent
    }

    /// ListTools once; equal lists come back as one shared copy. The request names the lists
    /// this replica holds, so a user whose list is one of them gets only its fingerprint back.
    pub async fn list_tools(
        &self,
        user: &str,
        channel: pb::Channel,
    ) -> Result<Arc<ToolList>, GatewayError> {
        let answer = self.ask_list(user, channel, self.lists.known()).await?;
        if !answer.unchanged {
            return Ok(self.lists.sent(answer));
        }
        if let Some(list) = self.lists.fingerprinted(&answer.fingerprint) {
            return Ok(list);
        }
        // Forgotten since the request named it (newer lists pushed it out): ask for the list.
        let answer = self.ask_list(user, channel, Vec::new()).await?;
        if answer.unchanged {
            // The gateway broke the contract: asking again would get the same answer.
            return Err(GatewayError::Refused(
                "ListTools answered \"unchanged\" to a request that named no list".into(),
            ));
        }
        Ok(self.lists.sent(answer))
    }

    async fn ask_list(
        &self,
        user: &str,
        channel: pb::Channel,
        known_fingerprints: Vec<String>,
    ) -> Result<pb::ListToolsResponse, GatewayError> {
        let mut client = GatewayServiceClient::new(self.channel.clone());
        let response = client
            .list_tools(self.request(
                pb::ListToolsRequest {
                    channel: channel as i32,
                    known_fingerprints,
                },
                user,
            )?)
            .await?;
        Ok(response.into_inner())
    }

    /// What `call` would do (PreviewCall): the text a person approves, the recipients policy
    /// checks, the binding execution is held to. A call that cannot be previewed must not run:
    /// the error is the outcome to give the model.
    pub async fn preview(&self, call: OnceCall<'_>) -> Result<CallPreview, ToolOutcome> {
        let mut client = GatewayServiceClient::new(self.channel.clone());
        let request = self
            .request(
                pb::PreviewCallRequest {
                    call: Some(call.proto()),
                },
                call.user,
            )
            .map_err(|e| failed("INTERNAL", &e.to_string()))?;
        let response =
            match tokio::time::timeout(self.call_timeout, client.preview_call(request)).await {
                Ok(Ok(r)) => r.into_inner(),
                Ok(Err(status)) => {
                    return Err(failed(
                        "UPSTREAM_UNAVAILABLE",
                        &format!(
                            "Not executed: the tool service could not preview it ({}).",
                            status.message()
                        ),
                    ));
                }
                Err(_) => {
                    return Err(failed(
                        "UPSTREAM_TIMEOUT",
                        "Not executed: the tool service did not preview it in time.",
                    ));
                }
            };
        if !response.ok {
            return Err(ToolOutcome {
                ok: false,
                error_kind: kind_name(response.error_kind),
                text: format!("Not executed: {}", response.text),
                truncated: false,
                external: false,
            });
        }
        Ok(CallPreview {
            text: response.text,
            recipients: response.recipients,
            binding: response.binding,
        })
    }

    /// Runs one call through the unary ExecuteTool with its idempotency key (an action id),
    /// so a retried decision cannot act twice (P-4).
    pub async fn execute_once(&self, call: OnceCall<'_>) -> ToolOutcome {
        let user = call.user;
        let call = call.proto();
        let mut client = GatewayServiceClient::new(self.channel.clone());
        let request = match self.request(pb::ExecuteToolRequest { call: Some(call) }, user) {
            Ok(r) => r,
            Err(e) => return failed("INTERNAL", &e.to_string()),
        };
        match tokio::time::timeout(self.call_timeout, client.execute_tool(request)).await {
            Ok(Ok(response)) => match response.into_inner().result {
                Some(r) => outcome(r),
                None => failed("INTERNAL", "The tool service answered without a result."),
            },
            Ok(Err(status)) => failed(
                "UPSTREAM_UNAVAILABLE",
                &format!("The tool service refused the call: {}", status.message()),
            ),
            Err(_) => failed(OUTCOME_UNKNOWN, "The tool did not answer in time."),
        }
    }

    /// What became of a side-effect call made with `idempotency_key`, as the gateway records
    /// it. Nothing is executed. An error is one that asking again may clear (the gateway
    /// away, restarting, or the call still running): `GatewayError::Unavailable`, whatever
    /// the code; the gateway's answers that will not change are [`Looked::Unknown`].
    /// `made_at`: when the call was made (its action's creation), so a record the gateway has
    /// since swept is not taken for a call that never ran.
    pub async fn lookup(
        &self,
        user: &str,
        idempotency_key: &str,
        made_at: std::time::SystemTime,
    ) -> Result<Looked, GatewayError> {
        let mut client = GatewayServiceClient::new(self.channel.clone());
        let request = self.request(
            pb::LookupCallRequest {
                idempotency_key: idempotency_key.to_owned(),
                made_at: Some(made_at.into()),
            },
            user,
        )?;
        let answer = tokio::time::timeout(self.call_timeout, client.lookup_call(request))
            .await
            .map_err(|_| GatewayError::Unavailable("the lookup timed out".into()))?;
        match answer {
            Ok(response) => {
                let response = response.into_inner();
                Ok(match response.found.then_some(response.result).flatten() {
                    Some(result) => Looked::Found(outcome(result)),
                    None => Looked::NeverRan,
                })
            }
            // A connection cut mid-answer (UNKNOWN, an h2 reset as INTERNAL), a token the
            // gateway does not take yet during a rollout, a gateway out of breath: not an
            // answer about the call.
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Cancelled
                        | tonic::Code::Unknown
                        | tonic::Code::Internal
                        | tonic::Code::Unauthenticated
                        | tonic::Code::ResourceExhausted
                ) =>
            {
                Err(GatewayError::Unavailable(format!(
                    "{:?}: {}",
                    status.code(),
                    status.message()
                )))
            }
            // ABORTED (ended unrecorded), DATA_LOSS (a record this build cannot read),
            // UNIMPLEMENTED (a gateway from before LookupCall), and the rest.
            Err(status) => Ok(Looked::Unknown(format!(
                "{:?}: {}",
                status.code(),
                status.message()
            ))),
        }
    }

    /// The bootstrap context for a session opening (I-8).
    pub async fn bootstrap(
        &self,
        user: &str,
        time_zone: &str,
        channel: pb::Channel,
    ) -> Result<pb::GetBootstrapContextResponse, GatewayError> {
        let mut client = GatewayServiceClient::new(self.channel.clone());
        let request = self.request(
            pb::GetBootstrapContextRequest {
                channel: channel as i32,
                time_zone: time_zone.to_owned(),
            },
            user,
        )?;
        // Bounded, inside a session opening's 15 s: a stalled gateway must not hold the
        // opening (or a schedule's start) until the caller's own deadline, if it has one.
        let bound = self.call_timeout.min(BOOTSTRAP_TIMEOUT);
        Ok(
            tokio::time::timeout(bound, client.get_bootstrap_context(request))
                .await
                .map_err(|_| {
                    GatewayError::Unavailable(format!("no bootstrap context within {bound:?}"))
                })??
                .into_inner(),
        )
    }

    /// Opens the Execute stream for one run; its calls carry the run's zone (`None`: not known).
    pub async fn open(
        &self,
        user: &str,
        run_id: &str,
        channel: pb::Channel,
        time_zone: Option<&jiff::tz::TimeZone>,
    ) -> Result<ExecuteSession, GatewayError> {
        // Boxed: the channel allocates its slots up front, and by value they were ~9 KiB
        // for the life of every run (issue 13).
        let (tx, rx) = mpsc::channel::<Box<pb::ExecuteRequest>>(64);
        let mut client = GatewayServiceClient::new(self.channel.clone());
        let results = client
            .execute(self.request(ReceiverStream::new(rx).map(|request| *request), user)?)
            .await?
            .into_inner();
        Ok(ExecuteSession {
            tx,
            results: tokio::sync::Mutex::new(results),
            pending: Mutex::default(),
            ended: AtomicBool::new(false),
            run_id: run_id.to_owned(),
            channel,
            time_zone: zone_name(time_zone).to_owned(),
            call_timeout: self.call_timeout,
        })
    }
}

/// One run's Execute stream. Dropping it closes the stream, which cancels calls in flight.
///
/// Results are read by whichever call is waiting for one, not by a task of the session's own:
/// a result then wakes its caller directly, one task wake-up fewer per tool call (issue 13).
/// The reader routes results for other calls to their waiters by call id.
pub struct ExecuteSession {
    tx: mpsc::Sender<Box<pb::ExecuteRequest>>,
    results: tokio::sync::Mutex<tonic::Streaming<pb::ExecuteResponse>>,
    pending: Mutex<HashMap<String, oneshot::Sender<pb::ToolResult>>>,
    /// The gateway ended the stream or it broke.
    ended: AtomicBool,
    run_id: String,
    channel: pb::Channel,
    /// The run's IANA zone, or empty when not known.
    time_zone: String,
    call_timeout: Duration,
}

/// A zone as the gateway takes it: its IANA name, or empty (not known) for none or one without a
/// name (a fixed offset, which runs never carry).
pub fn zone_name(zone: Option<&jiff::tz::TimeZone>) -> &str {
    zone.and_then(|z| z.iana_name()).unwrap_or("")
}

fn outcome(r: pb::ToolResult) -> ToolOutcome {
    ToolOutcome {
        ok: r.ok,
        error_kind: kind_name(r.error_kind),
        text: r.text,
        truncated: r.truncated,
        external: r.carries_external_content,
    }
}

/// "RATE_LIMITED" for ERROR_KIND_RATE_LIMITED; empty for none.
fn kind_name(kind: i32) -> String {
    match pb::ErrorKind::try_from(kind) {
        Ok(pb::ErrorKind::Unspecified) | Err(_) => String::new(),
        Ok(k) => k.as_str_name().trim_start_matches("ERROR_KIND_").to_owned(),
    }
}

fn failed(kind: &str, text: &str) -> ToolOutcome {
    ToolOutcome {
        ok: false,
        text: text.to_owned(),
        error_kind: kind.to_owned(),
        truncated: false,
        external: false,
    }
}

impl ExecuteSession {
    /// The gateway ended the stream (or it broke): nothing sent on it now gets an answer.
    pub fn is_closed(&self) -> bool {
        // Whatever arrived with nobody waiting is read now, so an end is seen.
        if let Ok(mut results) = self.results.try_lock() {
            while let Some(item) = results.next().now_or_never() {
                if !self.take(item) {
                    break;
                }
            }
        }
        self.ended.load(Ordering::Acquire) || self.tx.is_closed()
    }

    /// Routes one item read from the stream; false when the stream is over, and then every
    /// waiter is woken to report it.
    fn take(&self, item: Option<Result<pb::ExecuteResponse, tonic::Status>>) -> bool {
        match item {
            Some(Ok(response)) => {
                if let Some(result) = response.result {
                    let waiter = self
                        .pending
                        .lock()
                        .ok()
                        .and_then(|mut p| p.remove(&result.call_id));
                    if let Some(waiter) = waiter {
                        let _ = waiter.send(result);
                    }
                }
                true
            }
            None | Some(Err(_)) => {
                self.ended.store(true, Ordering::Release);
                if let Ok(mut p) = self.pending.lock() {
                    p.clear();
                }
                false
            }
        }
    }

    /// Waits for the result `wait` was registered for, reading the stream while nobody else
    /// does. None when the stream ended first.
    async fn receive(&self, mut wait: oneshot::Receiver<pb::ToolResult>) -> Option<pb::ToolResult> {
        tokio::select! {
            biased;
            result = &mut wait => result.ok(),
            mut results = self.results.lock() => loop {
                // Another reader may have routed it while this one waited for the lock.
                match wait.try_recv() {
                    Ok(result) => return Some(result),
                    Err(oneshot::error::TryRecvError::Closed) => return None,
                    Err(oneshot::error::TryRecvError::Empty) => {}
                }
                // Cancel-safe: a message half read stays in the stream's buffer.
                let item = results.next().await;
                self.take(item);
            },
        }
    }

    /// One call outside the model's tool calls (the prompt's memory lookup) on this stream
    /// rather than as an RPC of its own: one round of RPC set-up fewer per run (issue 13).
    pub async fn call_once(&self, call: OnceCall<'_>) -> ToolOutcome {
        self.send(vec![call.proto()])
            .await
            .pop()
            .unwrap_or_else(|| failed("INTERNAL", "The call was not sent."))
    }

    /// Sends every call, then waits for each result, in order.
    async fn send(&self, calls: Vec<pb::ToolCall>) -> Vec<ToolOutcome> {
        let mut waiters = Vec::with_capacity(calls.len());
        for call in calls {
            let (done, wait) = oneshot::channel();
            if self.ended.load(Ordering::Acquire) {
                drop(done);
            } else if let Ok(mut p) = self.pending.lock() {
                p.insert(call.call_id.clone(), done);
            }
            let call_id = call.call_id.clone();
            let request = pb::ExecuteRequest {
                kind: Some(pb::execute_request::Kind::Call(call)),
            };
            let sent = self.tx.send(Box::new(request)).await.is_ok();
            waiters.push((call_id, sent, wait));
        }
        // The calls run at once on the gateway, so they share one deadline: waited for one
        // after another with a timeout each, N hung calls would hold the run N times as long.
        let deadline = tokio::time::Instant::now() + self.call_timeout;
        let mut outcomes = Vec::with_capacity(waiters.len());
        for (call_id, sent, wait) in waiters {
            if !sent {
                self.forget(&call_id);
                outcomes.push(failed(
                    "UPSTREAM_UNAVAILABLE",
                    "The tool service is unreachable right now.",
                ));
                continue;
            }
            outcomes.push(
                match tokio::time::timeout_at(deadline, self.receive(wait)).await {
                    Ok(Some(r)) => outcome(r),
                    Ok(None) => failed(
                        OUTCOME_UNKNOWN,
                        "The tool service went away before answering.",
                    ),
                    Err(_) => {
                        // A run's stream outlives its calls: an answer that never comes must
                        // not leave its waiter behind for the rest of the run.
                        self.forget(&call_id);
                        failed(OUTCOME_UNKNOWN, "The tool did not answer in time.")
                    }
                },
            );
        }
        outcomes
    }

    fn forget(&self, call_id: &str) {
        if let Ok(mut p) = self.pending.lock() {
            p.remove(call_id);
        }
    }
}

#[async_trait::async_trait]
impl ToolRunner for ExecuteSession {
    async fn run(&self, calls: Vec<ToolInvocation>) -> Vec<ToolOutcome> {
        let calls = calls
            .into_iter()
            .map(|call| pb::ToolCall {
                // The action id: a retry, a reclaim or a replay of this call can never act twice.
                idempotency_key: crate::store::action_id(&self.run_id, &call.call_id),
                call_id: call.call_id,
                tool: call.name,
                arguments: Some(pb::tool_call::Arguments::ArgsJson(call.args.to_string())),
                channel: self.channel as i32,
                timeout: None,
                run_id: self.run_id.clone(),
                read_external_from: call.read_external_from,
                expected_binding: call.expected_binding,
                time_zone: self.time_zone.clone(),
            })
            .collect();
        self.send(calls).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, schema: &str, side_effect: bool) -> pb::ToolSpec {
        pb::ToolSpec {
            name: name.into(),
            description: format!("{name} things"),
            parameters_json_schema: schema.into(),
            side_effect,
            ..Default::default()
        }
    }

    fn list(schema: &str) -> Vec<pb::ToolSpec> {
        vec![
            spec("list_tasks", r#"{"type":"object"}"#, false),
            spec("add_task", schema, true),
        ]
    }

    #[test]
    fn equal_tool_lists_of_different_users_are_one_shared_copy() {
        let lists = ToolLists::default();
        let alice = lists.intern(list(r#"{"type":"object","required":["title"]}"#));
        let bob = lists.intern(list(r#"{"type":"object","required":["title"]}"#));
        assert!(Arc::ptr_eq(&alice, &bob));
        assert_eq!(alice.tools[1].decl.parameters["required"][0], "title");
        assert!(alice.side_effects.contains("add_task"));
        assert!(!alice.side_effects.contains("list_tasks"));
    }

    #[test]
    fn a_list_that_differs_in_anything_the_agent_uses_is_its_own() {
        let lists = ToolLists::default();
        let first = lists.intern(list(r#"{"type":"object"}"#));
        let other_schema = lists.intern(list(r#"{"type":"object","required":["title"]}"#));
        let mut flags = list(r#"{"type":"object"}"#);
        flags[0].reads_external_content = true;
        let other_flags = lists.intern(flags);
        assert!(!Arc::ptr_eq(&first, &other_schema));
        assert!(!Arc::ptr_eq(&first, &other_flags));
        assert!(other_flags.external_readers.contains("list_tasks"));
    }

    fn sent(tools: Vec<pb::ToolSpec>, fingerprint: &str) -> pb::ListToolsResponse {
        pb::ListToolsResponse {
            tools,
            fingerprint: fingerprint.into(),
            unchanged: false,
        }
    }

    #[test]
    fn a_fingerprinted_list_is_named_in_the_next_request_and_found_by_its_fingerprint() {
        let lists = ToolLists::default();
        assert!(lists.known().is_empty(), "nothing held, nothing named");
        let first = lists.sent(sent(list(r#"{"type":"object"}"#), "aa"));
        let second = lists.sent(sent(list(r#"{"type":"string"}"#), "bb"));
        assert_eq!(lists.known(), ["bb", "aa"], "the newest first");
        assert!(Arc::ptr_eq(&lists.fingerprinted("aa").unwrap(), &first));
        assert!(Arc::ptr_eq(&lists.fingerprinted("bb").unwrap(), &second));
        assert!(lists.fingerprinted("cc").is_none());
    }

    #[test]
    fn a_list_from_a_gateway_without_fingerprints_is_interned_and_never_named() {
        let lists = ToolLists::default();
        let held = lists.sent(sent(list(r#"{"type":"object"}"#), ""));
        assert!(lists.known().is_empty());
        assert!(Arc::ptr_eq(
            &lists.intern(list(r#"{"type":"object"}"#)),
            &held
        ));
    }

    #[test]
    fn only_the_newest_fingerprints_are_named_and_kept() {
        let lists = ToolLists::default();
        for i in 0..=KNOWN_FINGERPRINTS {
            lists.sent(sent(
                list(&format!(r#"{{"title":"{i}"}}"#)),
                &format!("f{i}"),
            ));
        }
        let known = lists.known();
        assert_eq!(known.len(), KNOWN_FINGERPRINTS);
        assert_eq!(known[0], format!("f{KNOWN_FINGERPRINTS}"));
        assert!(!known.contains(&"f0".to_owned()));
        assert!(
            lists.fingerprinted("f0").is_none(),
            "the oldest is forgotten"
        );
        // Answered "unchanged", a list is the newest again.
        lists.fingerprinted("f1").unwrap();
        assert_eq!(lists.known()[0], "f1");
    }

    #[test]
    fn the_offered_set_is_prepared_once_per_list_and_kind_of_run() {
        let lists = ToolLists::default();
        let tools = lists.intern(list(r#"{"type":"object"}"#));
        let built = std::sync::atomic::AtomicUsize::new(0);
        let build = || {
            built.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Arc::new(ToolSet::new(
                tools.tools.iter().map(|t| t.decl.clone()).collect(),
            ))
        };
        let a = tools.offered(0, build);
        let b = tools.offered(0, build);
        let task_agent = tools.offered(1, build);
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &task_agent));
        assert_eq!(built.load(std::sync::atomic::Ordering::Relaxed), 2);
    }
}
