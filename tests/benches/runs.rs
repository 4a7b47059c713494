//! Steward's own overhead per run and per tool iteration, end to end: a persistent gRPC
//! client calls AgentService `Run` (dev identity header) on agent-svc, which calls the real
//! gateway-svc over loopback gRPC and an OpenAI-compatible rule-based fake model that answers
//! instantly, so what is measured is Steward, not a model.
//!
//! Scenarios, each run on a new thread so runs are comparable (a thread's history grows):
//! - `1-call`: the model answers text at once (one model call, no tools);
//! - `4-tool`: the model calls `list_tasks` (answered from the gateway's own store, no upstream)
//!   in 4 iterations, then answers the same text (5 model calls, 4 tool calls).
//!
//! Overhead per tool iteration = (p50(4-tool) − p50(1-call)) / 4. Both backends: the in-memory
//! stores and PostgreSQL. On PostgreSQL the services get a database each (agent, gateway) and
//! the bench reports transactions per run from `pg_stat_database` (xact_commit + xact_rollback)
//! and statements per run from `pg_stat_statements` when the server preloads it. Counters are
//! read only while no service is connected (pending statistics are flushed when a backend
//! exits), over a cycle of 50 runs of one scenario, and the start/stop cost of the services is
//! measured and subtracted; periodic work
//! (health probes, the health monitor, task-agent polling) is slowed or switched off so that it
//! does not count. Autovacuum may add a little.
//!
//! Beside Steward, the same scenarios run through two peer frameworks on the same fake model
//! server in the same bench run (`bench/peers/peer_bench.py`: LangGraph and the OpenAI Agents
//! SDK, from the virtualenv `bench/peers/setup.sh` makes; `PEERS_PYTHON` names its python, or
//! `bench/.venv-peers/bin/python` is used when it exists; without either the peers are skipped
//! and the bench says so). Their per-iteration overhead over Steward's is the ratio reported.
//!
//! The services run on the bench's own runtime unless `BENCH_SERVICES=processes` starts their
//! release binaries as processes of their own (docs/BENCHMARKS.md compares the two).
//!
//! Run: `cargo bench -p steward-tests --bench runs` (needs the test PostgreSQL).
//! `BENCH_BACKENDS` picks `memory`, `postgres` or both (the default, `memory,postgres`).
//! `BENCH_RUNS` (default 200) sets the measured runs per scenario and backend; a tenth of that
//! (at least 10) warms up first. Latency is measured with the two scenarios alternating, so
//! drift on a shared machine hits both alike.

/// The services run in this process: they allocate with jemalloc here as their binaries do.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::{collections::HashMap, time::Duration, time::Instant};

use steward_proto::{AGENT_SERVICE_NAME, GATEWAY_SERVICE_NAME, agent::v1 as pb};
use steward_tests::{
    RunningService, SERVICE_TOKEN, TestDb, UserAgent, agent_as,
    bench::{percentile, summary},
    channel,
    procs::ServiceProc,
    rule_model::RuleModel,
    spawn::{TEST_CREDENTIALS_KEY, start_agent, start_gateway},
    wait_for_status,
};
use tokio_postgres::NoTls;
use tonic_health::pb::health_check_response::ServingStatus;

/// Tool iterations of the long scenario.
const K: usize = 4;

const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

#[derive(Clone, Copy, PartialEq)]
enum Scenario {
    OneCall,
    Tools,
}

impl Scenario {
    fn prompt(self) -> String {
        match self {
            Scenario::OneCall => "hello there".into(),
            Scenario::Tools => format!("check my tasks x{K}"),
        }
    }

    fn label(self) -> String {
        match self {
            Scenario::OneCall => "1-call".into(),
            Scenario::Tools => format!("{K}-tool"),
        }
    }
}

struct Row {
    backend: &'static str,
    scenario: Scenario,
    n: usize,
    p50: Duration,
    p99: Duration,
    /// (agent, gateway) per run.
    tx: Option<(f64, f64)>,
    statements: Option<(f64, f64)>,
}

fn admin_url() -> String {
    std::env::var("STEWARD_TEST_DATABASE_URL").unwrap_or_else(|_| ADMIN_URL.to_owned())
}

fn counts() -> (usize, usize) {
    let runs = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(200);
    (runs, (runs / 10).max(10))
}

/// Settings for both services; `None` databases mean the in-memory stores.
fn env(model: &RuleModel) -> HashMap<String, String> {
    HashMap::from(
        [
            ("AGENT_LISTEN_ADDR", "127.0.0.1:0"),
            ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
            ("GATEWAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("CREDENTIALS_KEY", TEST_CREDENTIALS_KEY),
            ("AUTH_DEV_USER_HEADER", "true"),
            ("STEWARD_DEVELOPMENT", "true"),
            ("MODEL_CHAIN", "openai/gpt-4o"),
            ("OPENAI_BASE_URL", model.url.as_str()),
            ("SHUTDOWN_DRAIN_TIMEOUT", "2s"),
            // Quiet background work: it would count as per-run transactions otherwise.
            ("HEALTH_PROBE_INTERVAL", "300s"),
            ("HEALTH_MONITOR_INTERVAL", "3600s"),
            ("TASK_AGENT_WORKERS", "false"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    )
}

/// A service as the bench hosts it: on the bench's own runtime (the default), or as its
/// release binary in a process of its own, as it is deployed (`BENCH_SERVICES=processes`).
enum Service {
    InProcess(RunningService),
    Process(ServiceProc),
}

impl Service {
    fn addr(&self) -> std::net::SocketAddr {
        match self {
            Service::InProcess(s) => s.addr,
            Service::Process(p) => p.addr,
        }
    }

    async fn stop(&mut self) {
        match self {
            Service::InProcess(s) => s.stop().await.expect("the service stops"),
            Service::Process(p) => {
                tokio::task::block_in_place(|| p.terminate(Duration::from_secs(10)))
                    .expect("the service stops");
            }
        }
    }
}

/// `BENCH_SERVICES=processes`: each message between the caller, agent-svc, gateway-svc and
/// the model then wakes another process, as in a deployment; in process, one runtime's two
/// workers pass the work between them.
fn as_processes() -> bool {
    std::env::var("BENCH_SERVICES").is_ok_and(|v| v == "processes")
}

async fn start_one(name: &str, env: &HashMap<String, String>) -> Service {
    if as_processes() {
        let env = env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        return Service::Process(ServiceProc::serving(name, env).await);
    }
    let (service, health) = if name == "agent-svc" {
        (
            start_agent(env).await.expect("start agent-svc"),
            AGENT_SERVICE_NAME,
        )
    } else {
        (
            start_gateway(env).await.expect("start gateway-svc"),
            GATEWAY_SERVICE_NAME,
        )
    };
    wait_for_status(channel(service.addr).await, health, ServingStatus::Serving).await;
    Service::InProcess(service)
}

/// Gateway then agent, both ready, and a persistent client.
async fn start(
    base: &HashMap<String, String>,
    dbs: Option<(&TestDb, &TestDb)>,
) -> (Service, Service, UserAgent) {
    let mut gw_env = base.clone();
    let mut agent_env = base.clone();
    if let Some((agent_db, gw_db)) = dbs {
        gw_env.insert("DATABASE_URL".into(), gw_db.url().to_owned());
        agent_env.insert("DATABASE_URL".into(), agent_db.url().to_owned());
    }
    let gateway = start_one("gateway-svc", &gw_env).await;
    agent_env.insert("GATEWAY_URL".into(), format!("http://{}", gateway.addr()));
    let agent = start_one("agent-svc", &agent_env).await;
    let client = agent_as(agent.addr(), "bench-user").await;
    (gateway, agent, client)
}

async fn stop(mut gateway: Service, mut agent: Service, client: UserAgent) {
    drop(client);
    agent.stop().await;
    gateway.stop().await;
}

/// One run to its end on a new thread; its latency.
async fn one_run(client: &mut UserAgent, scenario: Scenario) -> Duration {
    let input = pb::RunInput {
        prompt: scenario.prompt(),
        ..Default::default()
    };
    let started = Instant::now();
    let result = client
        .run(pb::RunRequest { input: Some(input) })
        .await
        .expect("Run succeeds")
        .into_inner()
        .result
        .expect("a result");
    let elapsed = started.elapsed();
    assert_eq!(
        result.status,
        pb::RunState::Completed as i32,
        "the run completes: {result:?}"
    );
    let tools = result.usage.map_or(0, |u| u.model_calls as usize);
    let expected = match scenario {
        Scenario::OneCall => 1,
        Scenario::Tools => K + 1,
    };
    assert_eq!(tools, expected, "model calls of {}", scenario.label());
    elapsed
}

/// Both scenarios alternately after a warm-up of each, so drift (a busy machine, a growing
/// database) affects them alike and their difference stays fair: (1-call, tool) samples, sorted.
async fn measure_both(
    client: &mut UserAgent,
    warmup: usize,
    runs: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    for _ in 0..warmup {
        one_run(client, Scenario::OneCall).await;
        one_run(client, Scenario::Tools).await;
    }
    let mut one = Vec::with_capacity(runs);
    let mut tools = Vec::with_capacity(runs);
    for _ in 0..runs {
        one.push(one_run(client, Scenario::OneCall).await);
        tools.push(one_run(client, Scenario::Tools).await);
    }
    one.sort();
    tools.sort();
    (one, tools)
}

/// The database statistics the bench reads, from a connection to a database it does not
/// measure.
struct Stats {
    client: tokio_postgres::Client,
    /// Whether `pg_stat_statements` is readable (preloaded, and created in `stats_db`).
    statements: bool,
    _stats_db: Option<TestDb>,
}

impl Stats {
    async fn connect() -> (Self, String) {
        let (admin, conn) = tokio_postgres::connect(&admin_url(), NoTls)
            .await
            .expect("connect to the test PostgreSQL");
        tokio::spawn(conn);
        let available = admin
            .query_opt(
                "SELECT 1 FROM pg_available_extensions WHERE name = 'pg_stat_statements'",
                &[],
            )
            .await
            .expect("pg_available_extensions")
            .is_some();
        let preload: String = admin
            .query_one("SHOW shared_preload_libraries", &[])
            .await
            .expect("shared_preload_libraries")
            .get(0);
        let preloaded = preload
            .split(',')
            .any(|l| l.trim().trim_matches('"') == "pg_stat_statements");
        if !preloaded {
            let why = if available {
                "unavailable: pg_stat_statements is installed but not preloaded; to enable it \
                 set shared_preload_libraries = 'pg_stat_statements' in postgresql.conf, restart \
                 PostgreSQL and run the bench again (it creates the extension in a scratch \
                 database of its own)"
            } else {
                "unavailable: the pg_stat_statements extension is not installed on this server \
                 (it ships with postgresql-contrib); then preload it with shared_preload_libraries \
                 = 'pg_stat_statements' and restart"
            };
            return (
                Self {
                    client: admin,
                    statements: false,
                    _stats_db: None,
                },
                format!("statements/run {why}"),
            );
        }
        // The view lives where the extension is created: a scratch database, so neither the
        // server's own databases nor the measured ones change.
        let stats_db = TestDb::create()
            .await
            .expect("create the statistics database");
        let (client, conn) = tokio_postgres::connect(stats_db.url(), NoTls)
            .await
            .expect("connect to the statistics database");
        tokio::spawn(conn);
        let created = client
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await;
        let note = match &created {
            Ok(()) => "statements/run from pg_stat_statements (calls, BEGIN/COMMIT included when \
                       pg_stat_statements.track_utility is on)"
                .to_owned(),
            Err(e) => format!("statements/run unavailable: CREATE EXTENSION failed: {e}"),
        };
        (
            Self {
                client,
                statements: created.is_ok(),
                _stats_db: Some(stats_db),
            },
            note,
        )
    }

    /// (transactions, statements) so far for `db`, once no backend is connected to it (a
    /// backend flushes its pending counters when it exits). Polls: this waits on PostgreSQL's
    /// own bookkeeping, for which there is no notification.
    async fn read(&self, db: &TestDb) -> (i64, Option<i64>) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let row = self
                .client
                .query_one(
                    "SELECT (xact_commit + xact_rollback)::int8, numbackends::int8 \
                     FROM pg_stat_database WHERE datname = $1",
                    &[&db.name()],
                )
                .await
                .expect("pg_stat_database");
            let (tx, backends): (i64, i64) = (row.get(0), row.get(1));
            if backends == 0 || Instant::now() > deadline {
                if backends != 0 {
                    eprintln!(
                        "warning: {backends} backends still connected to {}; counts approximate",
                        db.name()
                    );
                }
                let statements = if self.statements {
                    let row = self
                        .client
                        .query_one(
                            "SELECT COALESCE(sum(calls), 0)::int8 FROM pg_stat_statements \
                             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1)",
                            &[&db.name()],
                        )
                        .await
                        .expect("pg_stat_statements");
                    Some(row.get(0))
                } else {
                    None
                };
                return (tx, statements);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

type Counters = [(i64, Option<i64>); 2];

async fn read_both(stats: &Stats, agent_db: &TestDb, gw_db: &TestDb) -> Counters {
    [stats.read(agent_db).await, stats.read(gw_db).await]
}

fn per_run(
    before: &Counters,
    after: &Counters,
    startup: &Counters,
    runs: usize,
) -> ((f64, f64), Option<(f64, f64)>) {
    let tx = |i: usize| (after[i].0 - before[i].0 - startup[i].0) as f64 / runs as f64;
    let st = |i: usize| Some((after[i].1? - before[i].1? - startup[i].1?) as f64 / runs as f64);
    let statements = match (st(0), st(1)) {
        (Some(a), Some(g)) => Some((a, g)),
        _ => None,
    };
    ((tx(0), tx(1)), statements)
}

fn diff(a: &Counters, b: &Counters) -> Counters {
    [0, 1].map(|i| (b[i].0 - a[i].0, b[i].1.zip(a[i].1).map(|(x, y)| x - y)))
}

/// (transactions, statements) per run, each as (agent, gateway).
type Counted = (Option<(f64, f64)>, Option<(f64, f64)>);

fn rows(
    backend: &'static str,
    (one, tools): (Vec<Duration>, Vec<Duration>),
    counted: [Counted; 2],
) -> Vec<Row> {
    [
        (Scenario::OneCall, one, counted[0]),
        (Scenario::Tools, tools, counted[1]),
    ]
    .into_iter()
    .map(|(scenario, samples, (tx, statements))| Row {
        backend,
        scenario,
        n: samples.len(),
        p50: percentile(&samples, 0.50),
        p99: percentile(&samples, 0.99),
        tx,
        statements,
    })
    .collect()
}

async fn bench_memory(model: &RuleModel, warmup: usize, runs: usize) -> Vec<Row> {
    let base = env(model);
    let (gateway, agent, mut client) = start(&base, None).await;
    let samples = measure_both(&mut client, warmup, runs).await;
    stop(gateway, agent, client).await;
    rows("memory", samples, [(None, None); 2])
}

/// Runs per scenario in the PostgreSQL counting cycles (the count per run hardly varies).
const COUNTED_RUNS: usize = 50;

async fn bench_postgres(model: &RuleModel, warmup: usize, runs: usize, stats: &Stats) -> Vec<Row> {
    let base = env(model);
    let agent_db = TestDb::create().await.expect("create the agent database");
    let gw_db = TestDb::create().await.expect("create the gateway database");
    let dbs = Some((&agent_db, &gw_db));
    // 1. Migrations; 2. a start and stop alone: what every cycle costs besides its runs.
    let (g, a, c) = start(&base, dbs).await;
    stop(g, a, c).await;
    let migrated = read_both(stats, &agent_db, &gw_db).await;
    let (g, a, c) = start(&base, dbs).await;
    stop(g, a, c).await;
    let mut last = read_both(stats, &agent_db, &gw_db).await;
    let startup = diff(&migrated, &last);
    println!(
        "PostgreSQL start+stop of both services, counted out of every cycle: agent {} tx, gateway {} tx",
        startup[0].0, startup[1].0
    );
    // 3. One counting cycle per scenario: the database's own statistics per run.
    let mut counted: [Counted; 2] = [(None, None); 2];
    for (i, scenario) in [Scenario::OneCall, Scenario::Tools].into_iter().enumerate() {
        let (g, a, mut c) = start(&base, dbs).await;
        let count = COUNTED_RUNS.min(runs);
        for _ in 0..count {
            one_run(&mut c, scenario).await;
        }
        stop(g, a, c).await;
        let now = read_both(stats, &agent_db, &gw_db).await;
        let (tx, statements) = per_run(&last, &now, &startup, count);
        counted[i] = (Some(tx), statements);
        last = now;
    }
    // 4. Latency, both scenarios alternately.
    let (g, a, mut c) = start(&base, dbs).await;
    let samples = measure_both(&mut c, warmup, runs).await;
    stop(g, a, c).await;
    rows("postgres", samples, counted)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn split(v: Option<(f64, f64)>, unavailable: &str) -> String {
    match v {
        Some((a, g)) => format!("{:.1} (agent {a:.1} + gateway {g:.1})", a + g),
        None => unavailable.to_owned(),
    }
}

#[tokio::main]
async fn main() {
    let (runs, warmup) = counts();
    let started = Instant::now();
    let model = RuleModel::start().await;
    let (stats, statements_note) = Stats::connect().await;

    let backends = std::env::var("BENCH_BACKENDS").unwrap_or_else(|_| "memory,postgres".into());
    let mut rows = Vec::new();
    for backend in backends.split(',').map(str::trim) {
        match backend {
            "memory" => rows.extend(bench_memory(&model, warmup, runs).await),
            "postgres" => rows.extend(bench_postgres(&model, warmup, runs, &stats).await),
            other => {
                panic!("BENCH_BACKENDS: unknown backend {other:?}; use memory and/or postgres")
            }
        }
    }

    println!();
    println!(
        "Run latency end to end (gRPC Run → agent-svc → gateway-svc + instant fake model), \
         n = {runs} per row after {warmup} warm-up runs; overhead/iteration = (p50 {K}-tool − \
         p50 1-call) / {K}"
    );
    println!(
        "| backend | scenario | n | p50 | p99 | overhead/iteration p50 | tx/run | statements/run |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for row in &rows {
        let overhead = if row.scenario == Scenario::Tools {
            rows.iter()
                .find(|r| r.backend == row.backend && r.scenario == Scenario::OneCall)
                .map(|one| {
                    let d = row.p50.as_secs_f64() - one.p50.as_secs_f64();
                    format!("{:.2} ms", d * 1000.0 / K as f64)
                })
                .unwrap_or_default()
        } else {
            "–".to_owned()
        };
        let tx = if row.backend == "memory" {
            "–".to_owned()
        } else {
            split(row.tx, "?")
        };
        let statements = if row.backend == "memory" {
            "–".to_owned()
        } else {
            split(row.statements, "unavailable")
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            row.backend,
            row.scenario.label(),
            row.n,
            ms(row.p50),
            ms(row.p99),
            overhead,
            tx,
            statements
        );
    }
    let backend = "postgres";
    let one = rows
        .iter()
        .find(|r| r.backend == backend && r.scenario == Scenario::OneCall);
    let many = rows
        .iter()
        .find(|r| r.backend == backend && r.scenario == Scenario::Tools);
    if let (Some(Some((a1, g1))), Some(Some((ak, gk)))) = (one.map(|r| r.tx), many.map(|r| r.tx)) {
        println!(
            "{backend}: transactions per tool iteration = {:.1} (agent {:.1} + gateway {:.1})",
            ((ak + gk) - (a1 + g1)) / K as f64,
            (ak - a1) / K as f64,
            (gk - g1) / K as f64
        );
    }
    println!("{statements_note}");

    let steward: Vec<(&str, f64)> = ["memory", "postgres"]
        .into_iter()
        .filter_map(|b| Some((b, per_iteration_ms(&rows, b)?)))
        .collect();
    for (backend, ms) in &steward {
        summary(
            &format!("overhead per tool iteration, Steward {backend}"),
            &format!("{ms:.2} ms"),
            "",
        );
    }
    match peers_python() {
        None => println!(
            "peers skipped: no PEERS_PYTHON and no bench/.venv-peers (run bench/peers/setup.sh)"
        ),
        Some(python) => {
            println!();
            println!(
                "| framework | 1-call p50 / p99 | {K}-tool p50 / p99 | overhead/iteration p50 |"
            );
            println!("|---|---|---|---|");
            for framework in ["langgraph", "openai-agents"] {
                let peer = run_peer(&python, framework, &model.url, runs, warmup);
                println!(
                    "| {framework} {} | {:.2} / {:.2} ms | {:.2} / {:.2} ms | {:.2} ms |",
                    peer["version"].as_str().unwrap_or("?"),
                    peer["1-call"]["p50_ms"].as_f64().unwrap_or(f64::NAN),
                    peer["1-call"]["p99_ms"].as_f64().unwrap_or(f64::NAN),
                    peer["4-tool"]["p50_ms"].as_f64().unwrap_or(f64::NAN),
                    peer["4-tool"]["p99_ms"].as_f64().unwrap_or(f64::NAN),
                    peer["per_iteration_ms"].as_f64().unwrap_or(f64::NAN),
                );
                let theirs = peer["per_iteration_ms"].as_f64().unwrap_or(f64::NAN);
                summary(
                    &format!("overhead per tool iteration, {framework}"),
                    &format!("{theirs:.2} ms"),
                    "",
                );
                for (backend, ours) in &steward {
                    let target = match (framework, *backend) {
                        ("langgraph", "memory") => "≥ 30×",
                        ("langgraph", _) => "≥ 8×",
                        _ => "",
                    };
                    summary(
                        &format!("{framework} per iteration ÷ Steward {backend}"),
                        &format!("{:.1}×", theirs / ours),
                        target,
                    );
                }
            }
        }
    }
    println!("bench time {:.1} s", started.elapsed().as_secs_f64());
}

/// (p50 4-tool − p50 1-call) / K of a backend, in ms.
fn per_iteration_ms(rows: &[Row], backend: &str) -> Option<f64> {
    let p50 = |scenario: Scenario| {
        rows.iter()
            .find(|r| r.backend == backend && r.scenario == scenario)
            .map(|r| r.p50.as_secs_f64() * 1000.0)
    };
    Some((p50(Scenario::Tools)? - p50(Scenario::OneCall)?) / K as f64)
}

fn peers_python() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("PEERS_PYTHON") {
        return Some(p.into());
    }
    let venv =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv-peers/bin/python");
    venv.exists().then_some(venv)
}

/// One peer framework's measurement (`bench/peers/peer_bench.py`), as its JSON line.
fn run_peer(
    python: &std::path::Path,
    framework: &str,
    url: &str,
    runs: usize,
    warmup: usize,
) -> serde_json::Value {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/peers/peer_bench.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(["--framework", framework, "--base-url", url])
        .args(["--runs", &runs.to_string(), "--warmup", &warmup.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("could not run {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "{framework} bench failed ({}); see its message above",
        out.status
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim())
        .unwrap_or_else(|e| panic!("{framework} bench printed {line:?}, not one JSON line: {e}"))
}
