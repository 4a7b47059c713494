//! Starting both services in-process, the way production wires them: gateway-svc first, then
//! agent-svc pointed at it over loopback gRPC.

use std::{collections::HashMap, net::SocketAddr, time::Duration};

use steward_proto::{
    AGENT_SERVICE_NAME, GATEWAY_SERVICE_NAME, agent::v1::agent_service_client::AgentServiceClient,
    gateway::v1::gateway_service_client::GatewayServiceClient,
};
use svc_kit::config::Vars;
use tokio::{sync::oneshot, task::JoinHandle};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::TestDb;

/// The service token every test gateway expects and every test client presents.
pub const SERVICE_TOKEN: &str = "test-service-token-0123456789";

/// The AES-256 key test gateways encrypt tokens with (32 bytes, base64).
pub const TEST_CREDENTIALS_KEY: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";

/// What to start.
#[derive(Default)]
pub struct Options {
    pub backend: Option<Backend>,
    /// Extra environment-style settings for both services.
    pub env: Vec<(String, String)>,
    /// Tools registered in gateway-svc beside the built-in ones.
    pub gateway_tools: Vec<std::sync::Arc<dyn gateway_svc::registry::Tool>>,
}

/// How long a test waits for a service to become ready before failing.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// Which store the services run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A fresh PostgreSQL database, dropped when the app is.
    Postgres,
    /// The embedded in-memory stores.
    Memory,
}

type ServeResult = Result<(), String>;

/// One running service: its address, its stop button and its task.
pub struct RunningService {
    pub addr: SocketAddr,
    /// agent-svc's run service, when this is an agent replica.
    pub runs: Option<std::sync::Arc<agent_svc::runs::RunService>>,
    /// gateway-svc's MCP endpoint, when MCP_LISTEN_ADDR is set.
    pub mcp_addr: Option<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<ServeResult>,
}

impl RunningService {
    /// Signals shutdown and waits for the server to finish draining.
    pub async fn stop(&mut self) -> ServeResult {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match tokio::time::timeout(Duration::from_secs(10), &mut self.task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(format!("server task for {} panicked: {join}", self.addr)),
            Err(_) => Err(format!("server at {} did not stop within 10 s", self.addr)),
        }
    }
}

pub struct TestApp {
    pub agent_addr: SocketAddr,
    pub gateway_addr: SocketAddr,
    /// gateway-svc's MCP endpoint, when the test set MCP_LISTEN_ADDR.
    pub gateway_mcp_addr: Option<SocketAddr>,
    pub agent: AgentServiceClient<Channel>,
    pub gateway: GatewayServiceClient<Channel>,
    /// The test database, when the backend is PostgreSQL.
    pub db: Option<TestDb>,
    services: Vec<RunningService>,
    /// The settings both services started with, for starting more replicas.
    env: HashMap<String, String>,
}

/// Both services on a fresh PostgreSQL database.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(Backend::Postgres, &[]).await
}

/// Both services on `backend`, with extra environment-style settings for both.
pub async fn spawn_app_with(backend: Backend, extra: &[(&str, &str)]) -> TestApp {
    spawn(Options {
        backend: Some(backend),
        env: extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        gateway_tools: Vec::new(),
    })
    .await
}

/// Both services as `options` say.
pub async fn spawn(options: Options) -> TestApp {
    init_test_logs();
    let backend = options.backend.unwrap_or(Backend::Postgres);
    let db = match backend {
        Backend::Postgres => Some(TestDb::create().await.expect("create the test database")),
        Backend::Memory => None,
    };
    let mut env: HashMap<String, String> = HashMap::from([
        ("AGENT_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
        ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
        // Fast probes so readiness follows outages within a test's patience.
        ("HEALTH_PROBE_INTERVAL".into(), "100ms".into()),
        ("SHUTDOWN_DRAIN_TIMEOUT".into(), "2s".into()),
        ("GATEWAY_SERVICE_TOKEN".into(), SERVICE_TOKEN.into()),
        ("CREDENTIALS_KEY".into(), TEST_CREDENTIALS_KEY.into()),
        ("AUTH_DEV_USER_HEADER".into(), "true".into()),
        ("STEWARD_DEVELOPMENT".into(), "true".into()),
    ]);
    if let Some(db) = &db {
        env.insert("DATABASE_URL".into(), db.url().to_owned());
    }
    env.extend(options.env);

    let gateway = start_gateway_with(&env, options.gateway_tools)
        .await
        .expect("start gateway-svc");
    env.insert("GATEWAY_URL".into(), format!("http://{}", gateway.addr));
    let agent = start_agent(&env).await.expect("start agent-svc");

    let gateway_channel = channel(gateway.addr).await;
    let agent_channel = channel(agent.addr).await;
    wait_for_status(
        gateway_channel.clone(),
        GATEWAY_SERVICE_NAME,
        ServingStatus::Serving,
    )
    .await;
    wait_for_status(
        agent_channel.clone(),
        AGENT_SERVICE_NAME,
        ServingStatus::Serving,
    )
    .await;

    TestApp {
        agent_addr: agent.addr,
        gateway_addr: gateway.addr,
        gateway_mcp_addr: gateway.mcp_addr,
        agent: AgentServiceClient::new(agent_channel),
        gateway: GatewayServiceClient::new(gateway_channel),
        db,
        services: vec![agent, gateway],
        env,
    }
}

/// Starts one gateway-svc with `env`; for tests that need several replicas.
pub async fn start_gateway(env: &HashMap<String, String>) -> Result<RunningService, String> {
    start_gateway_with(env, Vec::new()).await
}

/// Starts one gateway-svc with `env` and extra tools. `GATEWAY_SERVICE_TOKEN` defaults to
/// [`SERVICE_TOKEN`].
pub async fn start_gateway_with(
    env: &HashMap<String, String>,
    tools: Vec<std::sync::Arc<dyn gateway_svc::registry::Tool>>,
) -> Result<RunningService, String> {
    let mut env = env.clone();
    env.entry("GATEWAY_SERVICE_TOKEN".into())
        .or_insert_with(|| SERVICE_TOKEN.into());
    let config = gateway_svc::Config::load(Vars::from_map(&env)).map_err(|e| e.to_string())?;
    let app = gateway_svc::App::build_with_tools(config, tools)
        .await
        .map_err(|e| e.to_string())?;
    let addr = app.local_addr();
    let mcp_addr = app.mcp_addr();
    let mut running = spawn_running(addr, |stop| async move {
        app.run(stop).await.map_err(|e| e.to_string())
    });
    running.mcp_addr = mcp_addr;
    Ok(running)
}

/// Starts one agent-svc with `env`; for tests that need several replicas.
pub async fn start_agent(env: &HashMap<String, String>) -> Result<RunningService, String> {
    let mut env = env.clone();
    env.entry("AUTH_DEV_USER_HEADER".into())
        .or_insert_with(|| "true".into());
    env.entry("STEWARD_DEVELOPMENT".into())
        .or_insert_with(|| "true".into());
    let config = agent_svc::Config::load(Vars::from_map(&env)).map_err(|e| e.to_string())?;
    let app = agent_svc::App::build(config)
        .await
        .map_err(|e| e.to_string())?;
    let addr = app.local_addr();
    let runs = app.runs();
    let mut running = spawn_running(addr, |stop| async move {
        app.run(stop).await.map_err(|e| e.to_string())
    });
    running.runs = Some(runs);
    Ok(running)
}

fn spawn_running<F, Fut>(addr: SocketAddr, run: F) -> RunningService
where
    F: FnOnce(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) -> Fut,
    Fut: std::future::Future<Output = ServeResult> + Send + 'static,
{
    let (tx, rx) = oneshot::channel::<()>();
    let stop = Box::pin(async move {
        let _ = rx.await;
    });
    RunningService {
        addr,
        runs: None,
        mcp_addr: None,
        stop: Some(tx),
        task: tokio::spawn(run(stop)),
    }
}

/// Adds the service token and the user id to every gateway call, as agent-svc does.
#[derive(Clone)]
pub struct AsUser {
    user: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
    auth: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
}

impl tonic::service::Interceptor for AsUser {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("x-steward-user-id", self.user.clone());
        request
            .metadata_mut()
            .insert("authorization", self.auth.clone());
        Ok(request)
    }
}

pub type UserGateway =
    GatewayServiceClient<tonic::service::interceptor::InterceptedService<Channel, AsUser>>;

/// A gateway client acting for `user` on the gateway at `addr`.
pub async fn gateway_as(addr: SocketAddr, user: &str) -> UserGateway {
    gateway_with_token(channel(addr).await, user, SERVICE_TOKEN)
}

/// A gateway client acting for `user` over `channel`, presenting `token` as the service secret.
pub fn gateway_with_token(channel: Channel, user: &str, token: &str) -> UserGateway {
    let interceptor = AsUser {
        user: user.parse().expect("ASCII user id"),
        auth: format!("Bearer {token}").parse().expect("ASCII token"),
    };
    GatewayServiceClient::with_interceptor(channel, interceptor)
}

/// Adds `x-user-id` (the agent's dev identity mode) to every call.
#[derive(Clone)]
pub struct AsAgentUser(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for AsAgentUser {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request.metadata_mut().insert("x-user-id", self.0.clone());
        Ok(request)
    }
}

pub type UserAgent =
    AgentServiceClient<tonic::service::interceptor::InterceptedService<Channel, AsAgentUser>>;

/// An agent client acting for `user` on the agent at `addr`.
pub async fn agent_as(addr: SocketAddr, user: &str) -> UserAgent {
    agent_over(channel(addr).await, user)
}

/// An agent client acting for `user` over `channel` (e.g. one with TLS).
pub fn agent_over(channel: Channel, user: &str) -> UserAgent {
    AgentServiceClient::with_interceptor(channel, AsAgentUser(user.parse().expect("ASCII user id")))
}

impl TestApp {
    /// An agent client acting for `user`.
    pub async fn agent_as(&self, user: &str) -> UserAgent {
        agent_as(self.agent_addr, user).await
    }

    /// Another agent-svc replica on the same database and gateway, stopped when dropped with
    /// the app.
    pub async fn start_another_agent(&mut self) -> SocketAddr {
        self.start_another_agent_with(&[]).await
    }

    /// As [`TestApp::start_another_agent`], with some settings changed.
    pub async fn start_another_agent_with(&mut self, extra: &[(&str, &str)]) -> SocketAddr {
        let mut env = self.env.clone();
        env.insert(
            "GATEWAY_URL".into(),
            format!("http://{}", self.gateway_addr),
        );
        // After the defaults, so a test can point a replica elsewhere (a dead gateway).
        for (k, v) in extra {
            env.insert((*k).to_owned(), (*v).to_owned());
        }
        let agent = start_agent(&env).await.expect("start another agent-svc");
        let addr = agent.addr;
        wait_for_status(
            channel(addr).await,
            AGENT_SERVICE_NAME,
            ServingStatus::Serving,
        )
        .await;
        self.services.insert(0, agent);
        addr
    }

    /// agent-svc's PostgreSQL store on the test database, as another replica would open it.
    pub async fn agent_store(&self) -> agent_svc::store::postgres::PgStore {
        agent_svc::store::postgres::PgStore::connect(&svc_kit::server_config::DatabaseConfig {
            url: self.db.as_ref().expect("a PostgreSQL app").url().to_owned(),
            pool: svc_kit::pg::PoolOptions {
                max_connections: 2,
                acquire_timeout: Duration::from_secs(5),
                ..svc_kit::pg::PoolOptions::default()
            },
        })
        .await
        .expect("open the agent store")
    }

    /// A run service of its own on the test database (offline model, no gateway): what any
    /// replica's monitor does, on demand.
    pub async fn monitor(&self) -> std::sync::Arc<agent_svc::runs::RunService> {
        let models = agent_svc::models::ModelsConfig::load(&mut Vars::new(|_| None))
            .build(&reqwest::Client::new())
            .0;
        std::sync::Arc::new(agent_svc::runs::RunService::new(
            std::sync::Arc::new(self.agent_store().await),
            std::sync::Arc::new(models),
            None,
            None,
            6000,
        ))
    }

    /// A plain connection to the test database, for what the API cannot show.
    pub async fn sql(&self) -> tokio_postgres::Client {
        let url = self.db.as_ref().expect("a PostgreSQL app").url();
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
        tokio::spawn(conn);
        client
    }

    /// The run service of every agent replica here, newest first: to drive their workers
    /// (e.g. schedule firing) with a test's own clock.
    pub fn agent_replicas(&self) -> Vec<std::sync::Arc<agent_svc::runs::RunService>> {
        self.services
            .iter()
            .filter_map(|s| s.runs.clone())
            .collect()
    }

    /// Live run registrations (segments, watchers, cancels) over every agent replica here.
    pub fn live_registrations(&self) -> usize {
        self.services
            .iter()
            .filter_map(|s| s.runs.as_ref())
            .map(|r| r.live_registrations())
            .sum()
    }

    /// A gateway client acting for `user`.
    pub async fn gateway_as(&self, user: &str) -> UserGateway {
        gateway_as(self.gateway_addr, user).await
    }

    /// The health status of `service` ("" for the whole server) on `addr`.
    pub async fn health(
        &self,
        addr: SocketAddr,
        service: &str,
    ) -> Result<ServingStatus, tonic::Status> {
        let mut client = HealthClient::new(channel(addr).await);
        let resp = client
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await?;
        Ok(resp.into_inner().status())
    }

    /// Stops both services, agent first (it depends on the gateway), and reports how each ended.
    /// Shuts down the one service listening on `addr` (its drain, as on SIGTERM) and waits.
    pub async fn stop_service(&mut self, addr: SocketAddr) -> ServeResult {
        let Some(running) = self.services.iter_mut().find(|s| s.addr == addr) else {
            return Err(format!("no service listens on {addr}"));
        };
        running.stop().await
    }

    pub async fn shutdown(mut self) -> Vec<ServeResult> {
        let mut results = Vec::new();
        for running in &mut self.services {
            results.push(running.stop().await);
        }
        results
    }
}

/// A lazily connecting channel to a loopback address.
pub async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("loopback URL")
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy()
}

/// Waits, by following the health Watch stream (no polling, no sleeps), until `service` reports
/// `want`; panics after [`READY_TIMEOUT`].
pub async fn wait_for_status(channel: Channel, service: &str, want: ServingStatus) {
    let watch = async {
        let mut client = HealthClient::new(channel);
        let mut stream = client
            .watch(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .expect("health Watch starts")
            .into_inner();
        while let Some(update) = stream.next().await {
            if update.expect("health update").status() == want {
                return;
            }
        }
        panic!("health stream for {service} ended before it reported {want:?}");
    };
    tokio::time::timeout(READY_TIMEOUT, watch)
        .await
        .unwrap_or_else(|_| panic!("{service} did not report {want:?} within {READY_TIMEOUT:?}"));
}

fn init_test_logs() {
    // Held for the test binary's life; the first test to start installs the subscriber.
    static LOGS: std::sync::OnceLock<svc_kit::telemetry::Logs> = std::sync::OnceLock::new();
    if std::env::var_os("TEST_LOG").is_some() {
        LOGS.get_or_init(|| svc_kit::telemetry::init("steward-tests"));
    }
}
