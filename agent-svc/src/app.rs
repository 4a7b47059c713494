//! Assembles agent-svc from its config: store, API, server. `build` does everything that can
//! fail before serving (bind, connect, migrate), so a bad start exits before it reports ready.

use std::{future::Future, net::SocketAddr, sync::Arc};

use steward_proto::{AGENT_SERVICE_NAME, agent::v1::agent_service_server::AgentServiceServer};
use tokio::net::TcpListener;
use tonic::service::Routes;

use crate::{
    api::AgentApi,
    config::Config,
    gateway_client::GatewayClient,
    runs::RunService,
    store::{SharedStore, memory::MemoryStore, postgres::PgStore},
};

/// How often old runs' events are looked for (RUN_EVENTS_RETENTION): a retention is days,
/// so a minute late costs nothing, and a sweep with nothing due is one index probe.
const EVENTS_PRUNE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot open the store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Serve(#[from] svc_kit::grpc::ServeError),
    #[error("cannot build the HTTP client: {0}")]
    Http(String),
}

pub struct App {
    config: Config,
    listener: TcpListener,
    metrics: Option<svc_kit::metrics::Endpoint>,
    store: SharedStore,
    runs: Arc<RunService>,
}

impl App {
    pub async fn build(config: Config) -> Result<Self, StartError> {
        // The tokenizers' tables take a while to load (~0.25 s in a release build): load them
        // now, beside the migrations, and be ready only once they are. A run that came first
        // would wait for them inside `OnceLock::get_or_init`, blocking a runtime worker, and
        // with both workers blocked no lease is renewed (issue 13).
        let models: Vec<String> = config.models.chain.iter().map(|(_, m)| m.clone()).collect();
        let tokenizers = tokio::task::spawn_blocking(move || {
            for model in &models {
                crate::executor::budget::TokenCounter::for_model(model);
            }
        });
        let store: SharedStore = match &config.server.database {
            Some(db) => Arc::new(PgStore::connect(db).await?),
            None => Arc::new(MemoryStore::new()),
        };
        if let Err(e) = tokenizers.await {
            tracing::error!(error = %e, "loading the tokenizers failed; token counts fall back to estimates");
        }
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
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            // reqwest's own retry keeps a copy of every request body until its response
            // arrives, to resend it on an HTTP/2 refusal: a model request's ~6 KB for the whole
            // model turn, per run in flight. The model chain already retries connection errors
            // with backoff (`llm::resilient`), so this layer adds nothing but that memory.
            .retry(reqwest::retry::never().max_retries_per_request(0))
            .build()
            .map_err(|e| StartError::Http(e.to_string()))?;
        let (models, summary) = config.models.build(&http);
        let gateway = match &config.gateway_token {
            Some(token) => Some(
                GatewayClient::connect_lazy_tls(
                    &config.gateway_url,
                    token.expose(),
                    &config.gateway_tls,
                )
                .map_err(|e| StartError::Http(e.to_string()))?
                .with_tools_cache(config.tools_cache_ttl),
            ),
            None => {
                tracing::warn!("GATEWAY_SERVICE_TOKEN is not set: runs have no tools");
                None
            }
        };
        let mut run_service = RunService::new(
            store.clone(),
            Arc::new(models),
            gateway,
            config.max_loop_steps,
            config.max_tool_result_chars,
        );
        run_service.policy = config.policy.clone();
        run_service.summary_model = Some(summary);
        run_service.session_timeout = config.session_timeout;
        run_service.summary_count = config.summary_count;
        run_service.approval_ttl = config.approval_ttl;
        run_service.lease = config.run_lease;
        run_service.fair_use = config.fair_use;
        run_service.schedule_rules = config.schedule_rules;
        if !config.policy.side_effects_enabled {
            tracing::warn!(
                "AGENT_SIDE_EFFECTS_ENABLED=false: every side-effect tool call is denied"
            );
        }
        let runs = Arc::new(run_service);
        tracing::info!(
            addr = %listener.local_addr().unwrap_or(addr),
            store = store.backend(),
            gateway = %config.gateway_url,
            "agent-svc listening"
        );
        Ok(Self {
            config,
            listener,
            metrics,
            store,
            runs,
        })
    }

    /// The run service, for in-process observers (tests, benches).
    pub fn runs(&self) -> Arc<RunService> {
        self.runs.clone()
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

    /// Serves until `shutdown` resolves, then drains.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let monitor = self
            .runs
            .spawn_monitor(self.config.monitor_interval, self.config.run_grace);
        let archiver = self
            .runs
            .spawn_session_archiver(self.config.monitor_interval);
        let notices = self.runs.spawn_notice_router();
        let pruner = self
            .config
            .run_events_retention
            .map(|keep| self.runs.spawn_events_pruner(keep, EVENTS_PRUNE_INTERVAL));
        // One name for this process's task claims and schedule holds, handed back at shutdown.
        let worker = format!("agent-{}", uuid::Uuid::new_v4());
        let workers = self.config.task_workers.then(|| {
            self.runs
                .spawn_task_workers(self.config.task_poll_interval, worker.clone())
        });
        let schedules = self.config.schedule_workers.then(|| {
            self.runs
                .spawn_schedule_workers(self.config.schedule_poll_interval, worker.clone())
        });
        let max = self.config.server.max_message_bytes;
        let runs = self.runs.clone();
        let api = AgentServiceServer::new(AgentApi::new(
            self.store.clone(),
            self.runs,
            self.config.identity.clone(),
            worker.clone(),
        ))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
        let store = self.store;
        let probe = move || {
            let store = store.clone();
            async move { store.ping().await }
        };
        let served = svc_kit::grpc::run(
            self.listener,
            AGENT_SERVICE_NAME,
            Routes::new(api),
            &self.config.server,
            self.metrics,
            probe,
            shutdown,
        )
        .await;
        monitor.abort();
        archiver.abort();
        if let Some(pruner) = pruner {
            pruner.abort();
        }
        for w in [workers, schedules].into_iter().flatten() {
            w.abort();
            // Gone once this resolves: they claim nothing more.
            let _ = w.await;
        }
        runs.settle_starts(std::time::Duration::from_secs(5)).await;
        // Runs still going after the drain end INTERRUPTED as they hand their threads back
        // (their progress committed, their leases released); a decided approval not yet
        // carried out is left for another replica's monitor to continue.
        runs.release_all(std::time::Duration::from_secs(5)).await;
        // After the runs, so what takes a task or occurrence over finds them stopped.
        runs.hand_back(&worker).await;
        if let Some(n) = notices {
            n.abort();
        }
        served?;
        Ok(())
    }
}
