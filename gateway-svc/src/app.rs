//! Assembles gateway-svc from its config: stores, credentials, rate limiter, tool registry,
//! engine, API, server. `build` does everything that can fail before serving (connect, migrate,
//! key checks, bind), so a bad start exits before it reports ready.

use std::{future::Future, net::SocketAddr, sync::Arc};

use steward_proto::{
    GATEWAY_SERVICE_NAME, gateway::v1::gateway_service_server::GatewayServiceServer,
};
use tokio::net::TcpListener;
use tonic::service::Routes;

use crate::{
    api::GatewayApi,
    audit::AuditTrail,
    bootstrap::Bootstrap,
    config::{Config, RateLimitBackendKind},
    context::Services,
    credentials::{self, Credentials, cipher::TokenCipher},
    engine::{Engine, EngineConfig},
    integrations::{self, Upstreams, calendar::CalendarApi, gmail::GmailApi, slack::SlackApi},
    mcp::{
        McpHub,
        expose::{GatewayTools, McpEndpoint},
    },
    ratelimit::{RateLimitBackend, RateLimiter, memory::MemoryRateLimits},
    registry::{Registry, RegistryError, Tool},
    store::{Stores, memory::MemoryStore, postgres::PgStore},
};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot open the store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error(
        "{0} connected account(s) are stored but CREDENTIALS_KEY is not set, so their tokens cannot be \
         read; set CREDENTIALS_KEY to the key they were stored with"
    )]
    MissingCredentialsKey(u64),
    #[error(
        "{keys} does not decrypt any of the {sampled} stored account tokens sampled: it is not the key \
         they were stored with. Set CREDENTIALS_KEY to that key (or, to rotate, set \
         CREDENTIALS_KEY_PREVIOUS to it)",
        keys = if *.previous_set { "CREDENTIALS_KEY (nor CREDENTIALS_KEY_PREVIOUS)" } else { "CREDENTIALS_KEY" }
    )]
    WrongCredentialsKey { sampled: usize, previous_set: bool },
    #[error("the tool registry is inconsistent: {0}")]
    Registry(#[from] RegistryError),
    #[error("cannot build the HTTP client: {0}")]
    Http(String),
    #[error("MCP: {0}")]
    Mcp(String),
    #[error(transparent)]
    Serve(#[from] svc_kit::grpc::ServeError),
}

/// Refuses a key that reads none of the most recently saved stored tokens; warns when only
/// some are read (damaged rows, or accounts stored under a key neither configured key is);
/// while CREDENTIALS_KEY_PREVIOUS is set, says how far the rotation has come.
async fn check_credentials_key(stores: &Stores, key: &TokenCipher) -> Result<(), StartError> {
    let sample = credentials::KEY_CHECK_SAMPLE;
    let check = credentials::check_key(&*stores.accounts, key, sample, true).await?;
    let readable = check.current + check.previous;
    if check.sampled > 0 && readable == 0 {
        return Err(StartError::WrongCredentialsKey {
            sampled: check.sampled,
            previous_set: key.has_previous(),
        });
    }
    if check.unreadable() > 0 {
        tracing::warn!(
            sampled = check.sampled,
            unreadable = check.unreadable(),
            "{} of {} stored account tokens sampled cannot be decrypted with CREDENTIALS_KEY{}: damaged rows, \
             or accounts stored under another key; their users are asked to reconnect them",
            check.unreadable(),
            check.sampled,
            if key.has_previous() {
                " or CREDENTIALS_KEY_PREVIOUS"
            } else {
                ""
            },
        );
    }
    if key.has_previous() {
        // Accounts move to the new key as they are saved, so the least recently saved are the
        // last to move: none of them under the old key means none is (unreadable ones aside,
        // which only a reconnect mends).
        let oldest = credentials::check_key(&*stores.accounts, key, sample, false).await?;
        tracing::info!(
            sampled = oldest.sampled,
            previous = oldest.previous,
            "{} of the {} least recently saved accounts still need CREDENTIALS_KEY_PREVIOUS; each moves to \
             CREDENTIALS_KEY when next saved or when the background walk reaches it, and once this reads 0 \
             CREDENTIALS_KEY_PREVIOUS can be unset",
            oldest.previous,
            oldest.sampled,
        );
    }
    Ok(())
}

pub struct App {
    config: Config,
    listener: TcpListener,
    metrics: Option<svc_kit::metrics::Endpoint>,
    stores: Stores,
    audit: Arc<AuditTrail>,
    api: GatewayApi,
    mcp_hub: Arc<McpHub>,
    mcp_endpoint: Option<McpEndpoint>,
    in_flight: Arc<crate::engine::InFlight>,
}

impl App {
    pub async fn build(config: Config) -> Result<Self, StartError> {
        Self::build_with_tools(config, Vec::new()).await
    }

    /// Builds with extra tools beside the built-in ones (tests add tools that exercise the
    /// enforcement path).
    pub async fn build_with_tools(
        config: Config,
        extra_tools: Vec<Arc<dyn Tool>>,
    ) -> Result<Self, StartError> {
        let mut stores = match &config.server.database {
            Some(db) => PgStore::connect(db).await?.stores(),
            None => MemoryStore::stores(),
        };
        // Every audit record goes through the trail; reads of it (`stores().audit`) see what
        // is still queued.
        let audit = AuditTrail::start(stores.audit.clone(), &config.audit_queue);
        stores.audit = audit.clone();
        let cipher = match (&config.credentials_key, stores.backend) {
            (Some(key), _) => {
                check_credentials_key(&stores, key).await?;
                Some(key.clone())
            }
            (None, "memory") => {
                tracing::info!(
                    "CREDENTIALS_KEY not set: using a random key; tokens live only as long as this process"
                );
                Some(TokenCipher::ephemeral())
            }
            (None, _) => match stores.accounts.count_accounts().await? {
                0 => {
                    tracing::warn!(
                        "CREDENTIALS_KEY not set: ConnectAccount is refused until it is"
                    );
                    None
                }
                n => return Err(StartError::MissingCredentialsKey(n)),
            },
        };
        let http = crate::context::upstream_client(config.upstream_timeout)
            .map_err(|e| StartError::Http(e.to_string()))?;
        let credentials = Credentials::new(
            stores.accounts.clone(),
            cipher,
            config.google_oauth.clone(),
            http.clone(),
        );
        let backend: Arc<dyn RateLimitBackend> =
            match (config.rate_limit_backend, &stores.shared_rate_limits) {
                (RateLimitBackendKind::Postgres, Some(shared)) => shared.clone(),
                _ => Arc::new(MemoryRateLimits::default()),
            };
        let limits_config = config.clone();
        let limiter = RateLimiter::new(backend, move |i| limits_config.limits_for(i));
        let services = Arc::new(Services {
            credentials: credentials.clone(),
            limiter,
            http,
            audit: audit.clone(),
            max_body_bytes: config.max_body_bytes,
        });
        let upstreams = Upstreams {
            gmail: GmailApi {
                base_url: config.gmail_base_url.clone(),
            },
            calendar: CalendarApi {
                base_url: config.calendar_base_url.clone(),
            },
            slack: SlackApi {
                base_url: config.slack_base_url.clone(),
            },
        };
        let mut tools = integrations::builtin(&stores, &upstreams);
        tools.extend(extra_tools);
        let bootstrap = Bootstrap {
            tasks: stores.tasks.clone(),
            reminders: stores.reminders.clone(),
            notes: stores.notes.clone(),
            services: services.clone(),
            gmail: GmailApi {
                base_url: config.gmail_base_url.clone(),
            },
            source_timeout: config.bootstrap_source_timeout,
            cache: Bootstrap::cache(config.bootstrap_cache_ttl),
        };
        let mcp_hub =
            McpHub::start(&config.mcp, stores.mcp_switches.clone()).map_err(StartError::Mcp)?;
        let engine = Engine {
            registry: Arc::new(Registry::new(tools)?.with_mcp(mcp_hub.clone())),
            services,
            idempotency: stores.idempotency.clone(),
            config: EngineConfig {
                max_result_chars: config.max_result_chars,
                default_timeout: config.call_timeout,
                max_timeout: config.call_max_timeout,
                idempotency_retention: config.retention.idempotency,
            },
            in_flight: Arc::default(),
        };
        let in_flight = engine.in_flight.clone();
        let mcp_endpoint = match config.mcp.listen_addr {
            Some(addr) => Some(
                McpEndpoint::bind(
                    addr,
                    &config.mcp.allowed_hosts,
                    GatewayTools::new(engine.clone(), credentials.clone()),
                    config.auth.clone(),
                )
                .await
                .map_err(|source| StartError::Bind { addr, source })?,
            ),
            None => None,
        };
        let api = GatewayApi::new(engine, credentials, bootstrap, config.auth.clone());

        let addr = config.server.listen_addr;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })?;
        let metrics = match config.server.metrics_addr {
            Some(addr) => svc_kit::metrics::Endpoint::bind(Some(addr))
                .await
                .map_err(|source| StartError::Bind { addr, source })?,
            None => None,
        };
        if config.rate_limit_backend == crate::config::RateLimitBackendKind::Memory
            && config.server.database.is_some()
        {
            // G-6 keeps counters in process by default; replicas sharing this database would
            // each allow the whole limit.
            tracing::warn!(
                "RATE_LIMIT_BACKEND=memory with DATABASE_URL: each replica counts its own rate limits; set RATE_LIMIT_BACKEND=postgres to share them"
            );
        }
        if matches!(config.auth, crate::config::CallerAuth::InsecureDev) {
            tracing::warn!(
                "GATEWAY_ALLOW_INSECURE_DEV_AUTH: any caller may act as any user; never use this in production"
            );
        }
        tracing::info!(
            addr = %listener.local_addr().unwrap_or(addr),
            store = stores.backend,
            rate_limits = ?config.rate_limit_backend,
            "gateway-svc listening"
        );
        if let Some(endpoint) = &mcp_endpoint {
            tracing::info!(addr = ?endpoint.local_addr(), path = crate::mcp::expose::PATH, "MCP endpoint listening");
        }
        Ok(Self {
            config,
            listener,
            metrics,
            stores,
            audit,
            api,
            mcp_hub,
            mcp_endpoint,
            in_flight,
        })
    }

    /// The audit trail: its batching writer's statistics, and `flush` for a test that reads
    /// the database directly.
    pub fn audit(&self) -> Arc<AuditTrail> {
        self.audit.clone()
    }

    /// Where `/metrics` is served, when METRICS_LISTEN_ADDR is set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|m| m.local_addr())
    }

    /// The bound address (useful when the config asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .unwrap_or(self.config.server.listen_addr)
    }

    /// Where MCP clients reach the gateway's tools, when MCP_LISTEN_ADDR is set.
    pub fn mcp_addr(&self) -> Option<SocketAddr> {
        self.mcp_endpoint.as_ref().and_then(McpEndpoint::local_addr)
    }

    /// The stores this instance uses (tests read the audit trail through them).
    pub fn stores(&self) -> &Stores {
        &self.stores
    }

    /// Serves until `shutdown` resolves, then drains: the calls in flight, then the audit
    /// queue (closed, and written out by the drain deadline; see [`AuditTrail::close`]).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let (signalled, signalled_at) = tokio::sync::oneshot::channel();
        let stopping = tokio_util::sync::CancellationToken::new();
        let shutdown = {
            let stopping = stopping.clone();
            async move {
                shutdown.await;
                stopping.cancel();
                let _ = signalled.send(tokio::time::Instant::now());
            }
        };
        let mcp_serving = self
            .mcp_endpoint
            .map(|endpoint| endpoint.start(stopping.clone()));
        let sweeper = crate::retention::Sweeper::start(
            self.stores.clone(),
            self.config.retention,
            stopping.child_token(),
        );
        // The last step of a key rotation: stored tokens moved to the new key in the
        // background, until the stop.
        // Only CREDENTIALS_KEY holds a previous key (the memory store's random one never does).
        let rekeying = self
            .config
            .credentials_key
            .clone()
            .filter(|_| self.config.credentials_rekey)
            .and_then(|cipher| {
                credentials::rekey::spawn(
                    self.stores.accounts.clone(),
                    cipher,
                    self.config.credentials_rekey_interval,
                    stopping.child_token(),
                )
            });
        let max = self.config.server.max_message_bytes;
        let api = GatewayServiceServer::new(self.api)
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        let ping = self.stores.ping.clone();
        let probe = move || {
            let ping = ping.clone();
            async move { ping.ping().await }
        };
        let served = svc_kit::grpc::run(
            self.listener,
            GATEWAY_SERVICE_NAME,
            Routes::new(api),
            &self.config.server,
            self.metrics,
            probe,
            shutdown,
        )
        .await;
        // The drain deadline (SHUTDOWN_DRAIN_TIMEOUT after the signal), and never less than
        // AuditQueueConfig::flush_grace after the calls drained — also with a drain timeout of
        // 0 — so the queue has a moment to be written out; the pod's termination grace (30 s
        // by default) covers it.
        let drain = self.config.server.serve.drain_timeout;
        let now = tokio::time::Instant::now();
        let deadline = signalled_at
            .await
            .map_or(now + drain, |at| at + drain)
            .max(now + self.config.audit_queue.flush_grace);
        // The MCP endpoint stopped accepting at the signal (or now, if serving gRPC ended
        // another way); its calls in flight get the same deadline as gRPC's.
        stopping.cancel();
        sweeper.stopped().await;
        if let Some(rekeying) = rekeying {
            // Aborted at the stop; a save in flight lands whole or not at all.
            let _ = rekeying.await;
        }
        if let Some(mcp) = mcp_serving {
            mcp.drain(deadline).await;
        }
        self.mcp_hub.stop();
        self.audit.close(deadline).await;
        let cut = self.in_flight.count();
        if cut > 0 {
            tracing::error!(
                calls = cut,
                "AUDIT RECORDS LOST: {cut} tool call(s) were still running when the drain deadline passed; their records are not written"
            );
        }
        served?;
        Ok(())
    }
}
