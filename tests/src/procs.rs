//! The service binaries as real processes, for fault tests that kill them: a process learns its
//! port from its own "listening" log line (like `svc_kit::testing::ServerProcess`, which exposes
//! neither the pid nor a hard kill, so this is the local equivalent), dies by `kill -9 <pid>`
//! (its own pid, never a name), and every process a test started is killed when its handle is
//! dropped.
//!
//! [`Cluster`] is one gateway-svc and N agent-svc replicas on one fresh PostgreSQL database
//! (or on a database the test provides, [`ClusterOptions::database_url`]), with a rule-based
//! fake model and a fake Gmail on loopback.
//!
//! The binaries are `target/<profile>/agent-svc` and `gateway-svc` beside the test binary
//! (`target/<profile>/deps/…`). When one is missing or older than the test binary, the first
//! test builds both with `cargo build -p agent-svc -p gateway-svc` (`STEWARD_SKIP_BINARY_BUILD=1`
//! turns that off; `cargo test --workspace` builds them too).

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, OnceLock, mpsc},
    time::{Duration, Instant, SystemTime},
};

use steward_proto::{AGENT_SERVICE_NAME, GATEWAY_SERVICE_NAME, gateway::v1 as gw};
use tonic_health::pb::health_check_response::ServingStatus;

use crate::{
    TestDb, UserAgent, UserGateway, agent_as,
    calls::connect_account,
    channel,
    fakes::gmail::FakeGmail,
    gateway_as,
    rule_model::{RuleModel, RuleOptions},
    spawn::{SERVICE_TOKEN, TEST_CREDENTIALS_KEY},
    wait_for_status,
};

/// How long a process may take to log that it is listening.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The directory the test binary was built into (`target/debug` for `target/debug/deps/x`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the deps directory");
    let dir = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("the profile directory")
    } else {
        deps
    };
    dir.to_path_buf()
}

/// The path of a service binary beside the test binary.
pub fn binary(name: &str) -> PathBuf {
    profile_dir().join(name)
}

fn modified(path: &PathBuf) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Builds both binaries once per test process when one is missing or older than this test
/// binary (which links the same crates, so it is newer whenever they changed).
fn ensure_binaries() {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let result = BUILT.get_or_init(|| {
        let test_exe = std::env::current_exe().ok();
        let test_time = test_exe.as_ref().and_then(modified);
        let stale: Vec<String> = ["agent-svc", "gateway-svc"]
            .into_iter()
            .filter(|name| {
                let bin = binary(name);
                match (modified(&bin), test_time) {
                    (None, _) => true,
                    (Some(b), Some(t)) => b < t,
                    (Some(_), None) => false,
                }
            })
            .map(str::to_owned)
            .collect();
        if stale.is_empty() || std::env::var_os("STEWARD_SKIP_BINARY_BUILD").is_some() {
            return Ok(());
        }
        let dir = profile_dir();
        let target = dir.parent().expect("the target directory").to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root")
            .to_path_buf();
        let mut cmd = Command::new(cargo);
        cmd.current_dir(&workspace)
            .args(["build", "-p", "agent-svc", "-p", "gateway-svc"])
            .env("CARGO_TARGET_DIR", &target);
        match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
        }
        eprintln!(
            "building {} (missing or older than the test binary): {cmd:?}",
            stale.join(", ")
        );
        let mut child = cmd
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("could not run cargo: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(1800);
        loop {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("cargo build failed: {status}"))
                };
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err("cargo build did not finish in 30 min".into());
            }
            // Only reaps the build; there is no async exit notification for a child in std.
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    if let Err(e) = result {
        panic!(
            "the service binaries are not available: {e}; build them with `cargo build -p agent-svc -p gateway-svc`"
        );
    }
}

/// A service binary running as a child process of the test.
pub struct ServiceProc {
    pub name: String,
    pub addr: SocketAddr,
    pub pid: u32,
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    dead: bool,
    /// `sh` blocked reading a pipe only this test process holds: when the test process dies
    /// without running its destructors (killed, aborted), the pipe closes and the watchdog
    /// kills this child, so no service outlives its test.
    watchdog: Option<Child>,
}

impl ServiceProc {
    /// Starts `name` (`agent-svc` or `gateway-svc`) with exactly `env` (plus PATH) and waits,
    /// on its own log, until it says it is listening. Blocking; see [`ServiceProc::spawn`].
    pub fn start(name: &str, env: &[(String, String)]) -> Result<Self, String> {
        ensure_binaries();
        let bin = binary(name);
        let mut child = Command::new(&bin)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
        let pid = child.id();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().expect("stderr is piped");
        let echo = std::env::var_os("TEST_LOG").is_some();
        let label = format!("{name}[{pid}]");
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if echo {
                        eprintln!("{label} {line}");
                    }
                    if line.contains("listening") && json_field(&line, "addr").is_some() {
                        let _ = tx.send(line.clone());
                    }
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            });
        }
        let line = match rx.recv_timeout(START_TIMEOUT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let log = log.lock().unwrap_or_else(|e| e.into_inner()).join("\n");
                return Err(format!(
                    "{name} did not log that it was listening within {START_TIMEOUT:?}:\n{log}"
                ));
            }
        };
        let addr = json_field(&line, "addr")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("no addr in the listening line: {line}"))?;
        let watchdog = Command::new("sh")
            .args([
                "-c",
                "read _ignored; kill -9 \"$1\" 2>/dev/null",
                "watchdog",
                &pid.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        Ok(Self {
            name: name.to_owned(),
            addr,
            pid,
            child,
            log,
            dead: false,
            watchdog,
        })
    }

    /// [`ServiceProc::start`] off the async runtime.
    pub async fn spawn(name: &str, env: Vec<(String, String)>) -> Result<Self, String> {
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || Self::start(&name, &env))
            .await
            .map_err(|e| e.to_string())?
    }

    /// [`ServiceProc::spawn`], then waits until its health service says SERVING; panics
    /// naming the service when it does not start.
    pub async fn serving(name: &str, env: Vec<(String, String)>) -> Self {
        let service = match name {
            "agent-svc" => AGENT_SERVICE_NAME,
            _ => GATEWAY_SERVICE_NAME,
        };
        let proc = Self::spawn(name, env)
            .await
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        wait_for_status(channel(proc.addr).await, service, ServingStatus::Serving).await;
        proc
    }

    /// Ends the watchdog first (by its own pid), so it can never fire at a reaped pid.
    fn stop_watchdog(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }

    /// A field of the first log line containing `message` (e.g. the metrics endpoint's
    /// `metrics_addr`).
    pub fn logged(&self, message: &str, field: &str) -> Option<String> {
        self.log()
            .iter()
            .filter(|l| l.contains(message))
            .find_map(|l| json_field(l, field))
    }

    /// `kill -9 <pid>`: no drain, no goodbye; then reaps the process.
    pub fn kill9(&mut self) {
        if self.dead {
            return;
        }
        self.stop_watchdog();
        let status = Command::new("kill")
            .args(["-9", &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -9 {} failed", self.pid);
        let _ = self.child.wait();
        self.dead = true;
    }

    /// `kill -TERM <pid>` (the graceful stop Kubernetes sends), then waits at most `bound` for
    /// the process to exit and reaps it.
    pub fn terminate(&mut self, bound: Duration) -> Result<std::process::ExitStatus, String> {
        if self.dead {
            return Err(format!("{} was already stopped", self.name));
        }
        self.stop_watchdog();
        svc_kit::testing::signal(self.pid, "-TERM")?;
        let exit = svc_kit::testing::wait_until_exit(&mut self.child, bound)
            .ok_or_else(|| format!("{} did not exit within {bound:?} of SIGTERM", self.name))?;
        self.dead = true;
        Ok(exit)
    }

    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// Everything it logged so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The last `n` log lines, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        log[log.len().saturating_sub(n)..].join("\n")
    }

    /// The last `n` WARN and ERROR lines.
    pub fn problems(&self, n: usize) -> String {
        let log: Vec<String> = self
            .log()
            .into_iter()
            .filter(|l| l.contains(r#""level":"WARN""#) || l.contains(r#""level":"ERROR""#))
            .collect();
        log[log.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for ServiceProc {
    fn drop(&mut self) {
        self.stop_watchdog();
        if !self.dead {
            // SIGKILL to this child's own pid.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Extracts a string field from a flat JSON log line.
fn json_field(line: &str, field: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    let found = value
        .get(field)
        .or_else(|| value.get("fields").and_then(|f| f.get(field)))?;
    found.as_str().map(str::to_owned)
}

/// Agent settings for fast failover in fault tests: a 2 s lease, a monitor sweeping every
/// 500 ms, 1 s of grace after a lease lapsed.
pub fn fast_failover_env() -> Vec<(String, String)> {
    pairs(&[
        ("RUN_LEASE", "2s"),
        ("HEALTH_MONITOR_INTERVAL", "500ms"),
        ("RUN_GRACE_PERIOD", "1s"),
    ])
}

/// What to start.
#[derive(Default)]
pub struct ClusterOptions {
    pub agents: usize,
    pub model: RuleOptions,
    /// Extra settings for every agent replica (after the defaults, so they win).
    pub agent_env: Vec<(String, String)>,
    /// Extra settings for the gateway.
    pub gateway_env: Vec<(String, String)>,
    /// Runs on this database instead of a fresh one on the shared server (the test owns it,
    /// e.g. on a private server from [`crate::pg_server`]).
    pub database_url: Option<String>,
}

/// One gateway-svc and N agent-svc processes on one database, with the fakes.
/// Fields drop in order: processes first, then the database (when the cluster created it).
pub struct Cluster {
    pub agents: Vec<ServiceProc>,
    pub gateway: ServiceProc,
    pub model: RuleModel,
    pub gmail: FakeGmail,
    gateway_env: Vec<(String, String)>,
    agent_env: Vec<(String, String)>,
    database_url: String,
    /// The fresh database, unless [`ClusterOptions::database_url`] was given.
    pub db: Option<TestDb>,
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

impl Cluster {
    pub async fn start(options: ClusterOptions) -> Self {
        let (db, database_url) = match options.database_url.clone() {
            Some(url) => (None, url),
            None => {
                let db = TestDb::create().await.expect("create the test database");
                let url = db.url().to_owned();
                (Some(db), url)
            }
        };
        let model = RuleModel::start_with(options.model).await;
        let gmail = FakeGmail::start().await;
        let mut gateway_env = pairs(&[
            ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
            ("GATEWAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("CREDENTIALS_KEY", TEST_CREDENTIALS_KEY),
            ("HEALTH_PROBE_INTERVAL", "100ms"),
            ("SHUTDOWN_DRAIN_TIMEOUT", "1s"),
            ("RATE_LIMITS_GMAIL", "100000/minute"),
        ]);
        gateway_env.push(("DATABASE_URL".into(), database_url.clone()));
        gateway_env.push(("GMAIL_API_BASE_URL".into(), gmail.url.clone()));
        gateway_env.extend(options.gateway_env);
        let gateway = ServiceProc::serving("gateway-svc", gateway_env.clone()).await;
        let mut agent_env = pairs(&[
            ("AGENT_LISTEN_ADDR", "127.0.0.1:0"),
            ("GATEWAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("AUTH_DEV_USER_HEADER", "true"),
            ("STEWARD_DEVELOPMENT", "true"),
            ("MODEL_CHAIN", "openai/gpt-4o"),
            ("HEALTH_PROBE_INTERVAL", "100ms"),
            ("SHUTDOWN_DRAIN_TIMEOUT", "1s"),
        ]);
        agent_env.push(("DATABASE_URL".into(), database_url.clone()));
        agent_env.push(("OPENAI_BASE_URL".into(), model.url.clone()));
        agent_env.push(("GATEWAY_URL".into(), format!("http://{}", gateway.addr)));
        agent_env.extend(options.agent_env);
        let mut cluster = Self {
            agents: Vec::new(),
            gateway,
            model,
            gmail,
            gateway_env,
            agent_env,
            database_url,
            db,
        };
        for _ in 0..options.agents {
            cluster.start_agent().await;
        }
        cluster
    }

    /// Starts one more agent replica, ready; returns its index.
    pub async fn start_agent(&mut self) -> usize {
        let agent = ServiceProc::serving("agent-svc", self.agent_env.clone()).await;
        self.agents.push(agent);
        self.agents.len() - 1
    }

    /// A client of replica `i` acting for `user` (dev identity header).
    pub async fn agent(&self, i: usize, user: &str) -> UserAgent {
        agent_as(self.agents[i].addr, user).await
    }

    pub async fn gateway_as(&self, user: &str) -> UserGateway {
        gateway_as(self.gateway.addr, user).await
    }

    /// Gives `user` a Gmail account `<user>@example.com` on the fake Gmail behind `token`.
    pub async fn connect_gmail(&self, user: &str, token: &str) {
        self.gmail.add_messages(token, vec![]);
        connect_account(
            &mut self.gateway_as(user).await,
            gw::Integration::Gmail,
            &format!("{user}@example.com"),
            token,
        )
        .await;
    }

    /// `kill -9` replica `i`.
    pub fn kill_agent(&mut self, i: usize) {
        self.agents[i].kill9();
    }

    pub fn kill_gateway(&mut self) {
        self.gateway.kill9();
    }

    /// Starts gateway-svc again on the address the old one had (the agents know only that
    /// one), ready.
    pub async fn restart_gateway(&mut self) {
        let addr = self.gateway.addr;
        let mut env = self.gateway_env.clone();
        env.retain(|(k, _)| k != "GATEWAY_LISTEN_ADDR");
        env.push(("GATEWAY_LISTEN_ADDR".into(), addr.to_string()));
        let gateway = ServiceProc::serving("gateway-svc", env).await;
        let mut old = std::mem::replace(&mut self.gateway, gateway);
        old.kill9();
    }

    /// A direct connection to the test database, for assertions the API cannot make.
    pub async fn sql(&self) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(&self.database_url, tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
        tokio::spawn(conn);
        client
    }
}

#[cfg(test)]
mod tests {
    use super::json_field;

    #[test]
    fn the_listening_address_is_read_from_either_log_shape() {
        assert_eq!(
            json_field(
                r#"{"level":"INFO","addr":"127.0.0.1:4000","message":"listening"}"#,
                "addr"
            )
            .as_deref(),
            Some("127.0.0.1:4000")
        );
        assert_eq!(
            json_field(
                r#"{"fields":{"message":"listening","addr":"127.0.0.1:1"}}"#,
                "addr"
            )
            .as_deref(),
            Some("127.0.0.1:1")
        );
        assert_eq!(json_field("not json listening", "addr"), None);
    }
}
