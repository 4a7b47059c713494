//! Many concurrent runs on one small machine (issue 13, Q-2): N streaming runs (default 1,000)
//! started together against one agent-svc and one gateway-svc, both real release processes.
//! Each run is two model turns that take 1 s each (the rule-based fake model on loopback waits
//! that long before answering) and one `list_tasks` call through the gateway; every run is its
//! own user on a new thread, as a backend serving many people sees them.
//!
//! Per backend (in memory; PostgreSQL with the default pool of 16 per service) it reports:
//! - added latency p50/p99: a run's time from `RunStream` to its terminal event, less the 2 s
//!   the model takes, and how much of it is the admission (time to the first event), the run
//!   up to its tool call, the tool call, and the rest; and when the fake model received each
//!   run's first and second request (the first wave's latency is mostly the time the last
//!   first request leaves);
//! - peak RSS of agent-svc (`VmHWM`, start-up included);
//! - CPU per run of each service and of the bench itself (user + system time over the wave / N,
//!   from `/proc`);
//! - transactions per run on PostgreSQL (`pg_stat_database` of each service's database, read
//!   once the services have exited, less a start and stop with no runs), and the database's
//!   own CPU per run (its exited processes' CPU from the postmaster's `/proc` entry, read the
//!   same way; where the server is local and `postmaster.pid` readable);
//! - that every run completed with its stream intact (numbered without gaps, one result).
//!
//! Run: `cargo bench -p steward-tests --bench load` (needs the test PostgreSQL).
//! `LOAD_RUNS` sets N, `LOAD_WAVES` how many waves of N run back to back on the same processes
//! (default 2: the first meets a fresh process — a cold heap, no pooled connections to the
//! model —, the second one that has served, as a replica under steady load is), `LOAD_BACKENDS` picks `memory`, `postgres` or both (`memory,postgres`),
//! `LOAD_MODEL_DELAY_MS` the model's time per turn (default 1000), `LOAD_RUST_LOG` the services'
//! log filter (default info). `MALLOC_ARENA_MAX` and `GLIBC_TUNABLES`, when set, are passed to
//! both services.

use std::time::{Duration, Instant};

use steward_proto::agent::v1 as pb;
use steward_tests::{
    TestDb, agent_over,
    bench::{
        clock_ticks, percentile, postgres_reaped_cpu, proc_stat, summary, transactions_when_idle,
    },
    channel,
    procs::ServiceProc,
    rule_model::{RuleModel, RuleOptions},
    spawn::{SERVICE_TOKEN, TEST_CREDENTIALS_KEY},
};
use tokio_stream::StreamExt;

/// Runs per client connection: callers spread over connections as a fleet of callers would.
const RUNS_PER_CONNECTION: usize = 100;

struct Settings {
    runs: usize,
    /// Waves run back to back on the same processes: the first meets a fresh process (cold
    /// heap, no pooled connections), the later ones a process that has served.
    waves: usize,
    backends: Vec<String>,
    model_delay: Duration,
}

fn settings() -> Settings {
    let var = |name: &str| std::env::var(name).ok();
    Settings {
        runs: var("LOAD_RUNS")
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(1000),
        waves: var("LOAD_WAVES")
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(2),
        backends: var("LOAD_BACKENDS")
            .unwrap_or_else(|| "memory,postgres".into())
            .split(',')
            .map(|b| b.trim().to_owned())
            .collect(),
        model_delay: Duration::from_millis(
            var("LOAD_MODEL_DELAY_MS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1000),
        ),
    }
}

fn env(model: &RuleModel) -> Vec<(String, String)> {
    [
        ("AGENT_LISTEN_ADDR", "127.0.0.1:0"),
        ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
        ("GATEWAY_SERVICE_TOKEN", SERVICE_TOKEN),
        ("CREDENTIALS_KEY", TEST_CREDENTIALS_KEY),
        ("AUTH_DEV_USER_HEADER", "true"),
        ("STEWARD_DEVELOPMENT", "true"),
        ("MODEL_CHAIN", "openai/gpt-4o-mini"),
        ("OPENAI_BASE_URL", model.url.as_str()),
        ("SHUTDOWN_DRAIN_TIMEOUT", "5s"),
        // Background work off: it is not per-run cost, and it would count as transactions.
        ("HEALTH_PROBE_INTERVAL", "300s"),
        ("HEALTH_MONITOR_INTERVAL", "3600s"),
        ("TASK_AGENT_WORKERS", "false"),
        ("SCHEDULE_WORKERS", "false"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .into_iter()
    // The services log at info, as deployed, unless LOAD_RUST_LOG says otherwise (what the
    // logs themselves cost).
    .chain([(
        "RUST_LOG".to_owned(),
        std::env::var("LOAD_RUST_LOG").unwrap_or_else(|_| "info".into()),
    )])
    // The allocator's own settings reach the services (their environment is otherwise only
    // the above), so allocator settings can be compared with the same bench (jemalloc reads
    // `_RJEM_MALLOC_CONF`: the services' jemalloc is built with the `_rjem_` prefix).
    .chain(
        [
            "MALLOC_ARENA_MAX",
            "GLIBC_TUNABLES",
            "_RJEM_MALLOC_CONF",
            "DATABASE_MAX_CONNECTIONS",
        ]
        .into_iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_owned(), v))),
    )
    .collect()
}

struct Services {
    gateway: ServiceProc,
    agent: ServiceProc,
    /// From spawning each process to its "listening" line, then to its health saying SERVING.
    cold_start: (Duration, Duration),
}

async fn start(model: &RuleModel, dbs: Option<(&TestDb, &TestDb)>) -> Services {
    let base = env(model);
    let mut gw_env = base.clone();
    let mut agent_env = base;
    if let Some((agent_db, gw_db)) = dbs {
        gw_env.push(("DATABASE_URL".into(), gw_db.url().to_owned()));
        agent_env.push(("DATABASE_URL".into(), agent_db.url().to_owned()));
    }
    let spawned = Instant::now();
    let gateway = ServiceProc::serving("gateway-svc", gw_env).await;
    let gateway_ready = spawned.elapsed();
    agent_env.push(("GATEWAY_URL".into(), format!("http://{}", gateway.addr)));
    let spawned = Instant::now();
    let agent = ServiceProc::serving("agent-svc", agent_env).await;
    Services {
        gateway,
        agent,
        cold_start: (spawned.elapsed(), gateway_ready),
    }
}

impl Services {
    fn stop(mut self) {
        for p in [&mut self.agent, &mut self.gateway] {
            let status = p
                .terminate(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("{} stops: {e}", p.name));
            assert!(status.success(), "{} exits cleanly: {status}", p.name);
        }
    }
}

/// User + system CPU time of a process so far.
fn cpu(pid: u32) -> Duration {
    let (user, system) = cpu_split(pid);
    user + system
}

/// User and system (kernel: system calls, page faults, waking threads) CPU time of a process
/// so far.
fn cpu_split(pid: u32) -> (Duration, Duration) {
    let fields = proc_stat(pid).expect("/proc/<pid>/stat");
    // utime and stime are fields 14 and 15.
    let ticks = |i: usize, name: &str| {
        Duration::from_millis(fields[i].parse::<u64>().expect(name) * 1000 / clock_ticks())
    };
    (ticks(11, "utime"), ticks(12, "stime"))
}

/// Peak resident set of a process, in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    memory_mib(pid, "VmHWM:")
}

/// A memory figure of `/proc/<pid>/status` (e.g. `VmRSS:`), in MiB.
fn memory_mib(pid: u32, field: &str) -> f64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/<pid>/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
        / 1024.0
}

/// When a run's events arrived, from its `RunStream`: where its latency went.
struct Timeline {
    /// The first event (`queued`, sent once the run is admitted).
    admitted: Duration,
    /// The tool call (the first model call answered).
    called: Duration,
    /// The tool's result.
    result: Duration,
    /// The terminal event.
    ended: Duration,
}

/// One streaming run to its end, after checking the stream, and when its events came.
async fn one_run(
    channel: tonic::transport::Channel,
    user: String,
    go: tokio::sync::watch::Receiver<bool>,
) -> Result<Timeline, String> {
    let mut go = go;
    let mut client = agent_over(channel, &user);
    go.wait_for(|g| *g).await.map_err(|e| e.to_string())?;
    let started = Instant::now();
    let input = pb::RunInput {
        prompt: "check my tasks".into(),
        ..Default::default()
    };
    let mut stream = client
        .run_stream(pb::RunStreamRequest { input: Some(input) })
        .await
        .map_err(|s| format!("{user}: RunStream refused: {s}"))?
        .into_inner();
    let mut seq = 0;
    let mut result = None;
    let (mut first_event, mut called, mut tool_result) = (None, None, None);
    while let Some(item) = stream.next().await {
        first_event.get_or_insert_with(|| started.elapsed());
        let event = item
            .map_err(|s| format!("{user}: stream broke: {s}"))?
            .event
            .ok_or("an empty event")?;
        seq += 1;
        if event.seq != seq {
            return Err(format!("{user}: event {} after {}", event.seq, seq - 1));
        }
        match event.kind {
            Some(pb::run_event::Kind::Result(r)) => result = Some(r),
            Some(pb::run_event::Kind::ToolCall(_)) => {
                called.get_or_insert_with(|| started.elapsed());
            }
            Some(pb::run_event::Kind::ToolResult(_)) => {
                tool_result.get_or_insert_with(|| started.elapsed());
            }
            Some(pb::run_event::Kind::Error(e)) => {
                return Err(format!("{user}: the run failed: {}", e.message));
            }
            _ => {}
        }
    }
    let elapsed = started.elapsed();
    let result = result.ok_or_else(|| format!("{user}: the stream ended without a result"))?;
    if result.status() != pb::RunState::Completed {
        return Err(format!("{user}: {:?}: {}", result.status(), result.error));
    }
    if result.usage.map(|u| u.model_calls) != Some(2) {
        return Err(format!(
            "{user}: expected two model calls: {:?}",
            result.usage
        ));
    }
    let (Some(admitted), Some(called), Some(result)) = (first_event, called, tool_result) else {
        return Err(format!("{user}: no tool call and result in the stream"));
    };
    Ok(Timeline {
        admitted,
        called,
        result,
        ended: elapsed,
    })
}

struct Wave {
    added_p50: Duration,
    added_p99: Duration,
    /// From `RunStream` to the run's first event: the admission's share of the latency.
    first_event_p50: Duration,
    first_event_p99: Duration,
    /// p50 / p99 of the rest of the run's added latency, phase by phase (the model's time
    /// taken off): admitted → tool call, tool call → its result, result → the end.
    phases: [(Duration, Duration); 3],
    wall: Duration,
    agent_cpu_per_run: Duration,
    /// Of `agent_cpu_per_run`, what the kernel spent for agent-svc.
    agent_system_cpu_per_run: Duration,
    gateway_cpu_per_run: Duration,
    agent_peak_rss_mib: f64,
    /// Log lines each service wrote per run (what RUST_LOG costs, beside its CPU).
    log_lines_per_run: (f64, f64),
    /// p50 / p99 of when the fake model received each run's first and second request, from the
    /// wave's start: splits "to the tool call" into the work before the first model call and
    /// what follows its answer.
    model_requests: [(Duration, Duration); 2],
    /// The bench's own CPU per run (callers and the fake model), which shares the two cores.
    harness_cpu_per_run: Duration,
}

async fn wave(
    services: &Services,
    model: &RuleModel,
    number: usize,
    runs: usize,
    model_delay: Duration,
) -> Wave {
    let mut channels = Vec::new();
    for _ in 0..runs.div_ceil(RUNS_PER_CONNECTION) {
        channels.push(channel(services.agent.addr).await);
    }
    let (go_tx, go) = tokio::sync::watch::channel(false);
    let tasks: Vec<_> = (0..runs)
        .map(|i| {
            let ch = channels[i / RUNS_PER_CONNECTION].clone();
            tokio::spawn(one_run(ch, format!("load-{number}-{i}"), go.clone()))
        })
        .collect();
    let cpu_before = (cpu(services.agent.pid), cpu(services.gateway.pid));
    let agent_system_before = cpu_split(services.agent.pid).1;
    let logged_before = (services.agent.log().len(), services.gateway.log().len());
    let harness_before = cpu(std::process::id());
    let started = Instant::now();
    go_tx.send(true).expect("runs are waiting");
    let mut latencies = Vec::with_capacity(runs);
    let mut first_events = Vec::with_capacity(runs);
    let mut phases: [Vec<Duration>; 3] = Default::default();
    let mut failures = Vec::new();
    for t in tasks {
        match t.await.expect("run task") {
            Ok(run) => {
                latencies.push(run.ended);
                first_events.push(run.admitted);
                phases[0].push((run.called - run.admitted).saturating_sub(model_delay));
                phases[1].push(run.result - run.called);
                phases[2].push((run.ended - run.result).saturating_sub(model_delay));
            }
            Err(e) => failures.push(e),
        }
    }
    let wall = started.elapsed();
    let harness_cpu = cpu(std::process::id()) - harness_before;
    let cpu_after = (cpu(services.agent.pid), cpu(services.gateway.pid));
    let agent_system = cpu_split(services.agent.pid).1 - agent_system_before;
    let logged_after = (services.agent.log().len(), services.gateway.log().len());
    assert!(
        failures.is_empty(),
        "{} of {runs} runs did not complete intact; first: {}",
        failures.len(),
        failures[0]
    );
    latencies.sort();
    first_events.sort();
    let phases = phases.map(|mut p| {
        p.sort();
        (percentile(&p, 0.50), percentile(&p, 0.99))
    });
    let model_time = model_delay * 2;
    // A continuation carries the tool's result; a first call does not.
    let mut arrivals: [Vec<Duration>; 2] = Default::default();
    for r in model.requests().into_iter().filter(|r| r.at >= started) {
        let continued = r.body["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "tool"));
        arrivals[usize::from(continued)].push(r.at - started);
    }
    let model_requests = arrivals.map(|mut a| {
        a.sort();
        (percentile(&a, 0.50), percentile(&a, 0.99))
    });
    Wave {
        added_p50: percentile(&latencies, 0.50).saturating_sub(model_time),
        added_p99: percentile(&latencies, 0.99).saturating_sub(model_time),
        first_event_p50: percentile(&first_events, 0.50),
        first_event_p99: percentile(&first_events, 0.99),
        phases,
        wall,
        agent_cpu_per_run: (cpu_after.0 - cpu_before.0) / runs as u32,
        agent_system_cpu_per_run: agent_system / runs as u32,
        gateway_cpu_per_run: (cpu_after.1 - cpu_before.1) / runs as u32,
        agent_peak_rss_mib: peak_rss_mib(services.agent.pid),
        log_lines_per_run: (
            (logged_after.0 - logged_before.0) as f64 / runs as f64,
            (logged_after.1 - logged_before.1) as f64 / runs as f64,
        ),
        model_requests,
        harness_cpu_per_run: harness_cpu / runs as u32,
    }
}

async fn admin() -> tokio_postgres::Client {
    let url = std::env::var("STEWARD_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test PostgreSQL");
    tokio::spawn(conn);
    client
}

/// (agent, gateway) transactions so far, once neither service is connected.
async fn transactions(admin: &tokio_postgres::Client, dbs: (&TestDb, &TestDb)) -> (i64, i64) {
    (
        transactions_when_idle(admin, dbs.0.name()).await,
        transactions_when_idle(admin, dbs.1.name()).await,
    )
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    let s = settings();
    let model = RuleModel::start_with(RuleOptions {
        delay: Some((s.model_delay, s.model_delay)),
        ..RuleOptions::default()
    })
    .await;
    let mut rows = Vec::new();
    // PostgreSQL's own CPU per run over all waves, where it can be read.
    let mut database_cpu_per_run: Option<f64> = None;
    for backend in &s.backends {
        match backend.as_str() {
            "memory" => {
                // A first start builds stale binaries and warms the page cache; the second is
                // the one measured.
                start(&model, None).await.stop();
                let services = start(&model, None).await;
                // Idle: serving, no run yet. (The first model's tokenizer loads in the
                // background at start; give it its moment so idle means idle.)
                tokio::time::sleep(Duration::from_secs(2)).await;
                let idle = (
                    memory_mib(services.agent.pid, "VmRSS:"),
                    memory_mib(services.gateway.pid, "VmRSS:"),
                );
                println!(
                    "cold start to SERVING (in memory): agent-svc {} (gateway up), gateway-svc {}; idle RSS agent {:.1} MiB, gateway {:.1} MiB",
                    ms(services.cold_start.0),
                    ms(services.cold_start.1),
                    idle.0,
                    idle.1
                );
                summary(
                    "cold start to SERVING, agent-svc",
                    &ms(services.cold_start.0),
                    "",
                );
                summary(
                    "cold start to SERVING, gateway-svc",
                    &ms(services.cold_start.1),
                    "",
                );
                summary("idle RSS, agent-svc", &format!("{:.1} MiB", idle.0), "");
                summary("idle RSS, gateway-svc", &format!("{:.1} MiB", idle.1), "");
                for n in 1..=s.waves {
                    let w = wave(&services, &model, n, s.runs, s.model_delay).await;
                    rows.push(("memory", n, w, None));
                }
                services.stop();
            }
            "postgres" => {
                let admin = admin().await;
                let agent_db = TestDb::create().await.expect("agent database");
                let gw_db = TestDb::create().await.expect("gateway database");
                let dbs = (&agent_db, &gw_db);
                // Migrations, then a start and stop alone: what the measured cycle costs
                // besides its runs.
                start(&model, Some(dbs)).await.stop();
                let migrated = transactions(&admin, dbs).await;
                let cpu_migrated = postgres_reaped_cpu(&admin).await;
                start(&model, Some(dbs)).await.stop();
                let idle = transactions(&admin, dbs).await;
                let cpu_idle = postgres_reaped_cpu(&admin).await;
                let startup = (idle.0 - migrated.0, idle.1 - migrated.1);
                let services = start(&model, Some(dbs)).await;
                let mut waves = Vec::new();
                for n in 1..=s.waves {
                    waves.push(wave(&services, &model, n, s.runs, s.model_delay).await);
                }
                services.stop();
                let after = transactions(&admin, dbs).await;
                // The database's CPU over the waves: its backends (and autovacuum) counted as
                // they exit, less what a start and stop without runs costs.
                if let (Some(m), Some(i), Some(a)) =
                    (cpu_migrated, cpu_idle, postgres_reaped_cpu(&admin).await)
                {
                    let waves_cpu = a.saturating_sub(i).saturating_sub(i.saturating_sub(m));
                    database_cpu_per_run =
                        Some(waves_cpu.as_secs_f64() * 1000.0 / (s.runs * s.waves) as f64);
                }
                // Over every wave: transactions are counted once the services have exited.
                let per_run = |i: usize| {
                    let (a, b, c) = match i {
                        0 => (after.0, idle.0, startup.0),
                        _ => (after.1, idle.1, startup.1),
                    };
                    (a - b - c) as f64 / (s.runs * s.waves) as f64
                };
                for (n, w) in waves.into_iter().enumerate() {
                    rows.push(("postgres", n + 1, w, Some((per_run(0), per_run(1)))));
                }
            }
            other => panic!("LOAD_BACKENDS: unknown backend {other:?}; use memory and/or postgres"),
        }
    }

    println!();
    println!(
        "{} concurrent streaming runs, each 2 model turns of {} ms + 1 list_tasks through the gateway; release processes, {} runs per client connection",
        s.runs,
        s.model_delay.as_millis(),
        RUNS_PER_CONNECTION
    );
    println!(
        "| backend | wave | N | added latency p50 / p99 | wall | peak RSS agent | CPU per run agent / gateway | transactions per run (agent + gateway, over all waves) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let log_filter = std::env::var("LOAD_RUST_LOG").unwrap_or_else(|_| "info".into());
    for (backend, n, w, tx) in &rows {
        let tx_text = tx.map_or("–".to_owned(), |(a, g)| {
            format!("{:.1} ({a:.1} + {g:.1})", a + g)
        });
        let wave = if *n == 1 {
            "1 (fresh process)".to_owned()
        } else {
            n.to_string()
        };
        println!(
            "| {backend} | {wave} | {} | {} / {} | {:.1} s | {:.0} MiB | {:.2} / {:.2} ms | {tx_text} |",
            s.runs,
            ms(w.added_p50),
            ms(w.added_p99),
            w.wall.as_secs_f64(),
            w.agent_peak_rss_mib,
            w.agent_cpu_per_run.as_secs_f64() * 1000.0,
            w.gateway_cpu_per_run.as_secs_f64() * 1000.0,
        );
    }
    for (backend, n, w, _) in &rows {
        println!(
            "{backend}, wave {n}: first event (the run admitted) p50 / p99: {} / {}",
            ms(w.first_event_p50),
            ms(w.first_event_p99)
        );
        let [start, tool, finish] = w
            .phases
            .map(|(p50, p99)| format!("{} / {}", ms(p50), ms(p99)));
        println!(
            "{backend}, wave {n}: then, p50 / p99 (model time taken off): to the tool call {start}, \
             the tool call {tool}, to the end {finish}"
        );
        let [first, second] = w
            .model_requests
            .map(|(p50, p99)| format!("{} / {}", ms(p50), ms(p99)));
        println!(
            "{backend}, wave {n}: the model's first requests arrived at p50 / p99 {first} from the start, \
             its second at {second}; the bench's own CPU per run (callers, fake model) {:.2} ms; \
             of agent-svc's CPU per run, the kernel's {:.2} ms",
            w.harness_cpu_per_run.as_secs_f64() * 1000.0,
            w.agent_system_cpu_per_run.as_secs_f64() * 1000.0
        );
    }
    if let Some(cpu) = database_cpu_per_run {
        println!(
            "postgres: the database's own CPU per run, all waves (its backends and autovacuum, counted as they exit; a start and stop without runs taken off): {cpu:.2} ms"
        );
    }
    for (backend, n, w, _) in &rows {
        println!(
            "{backend}, wave {n}: log lines per run at RUST_LOG={log_filter}: agent-svc {:.1}, gateway-svc {:.1}",
            w.log_lines_per_run.0, w.log_lines_per_run.1
        );
    }
    let runs = s.runs;
    for (backend, n, w, tx) in &rows {
        let label = |what: &str| {
            let wave = if *n == 1 {
                "first wave, fresh process".to_owned()
            } else {
                format!("wave {n}")
            };
            format!("{runs} runs, {backend} ({wave}): {what}")
        };
        let p99_target = if *backend == "memory" {
            "≤ 250 ms"
        } else {
            "≤ 600 ms"
        };
        summary(&label("added latency p99"), &ms(w.added_p99), p99_target);
        summary(
            &label("peak agent RSS"),
            &format!("{:.0} MiB", w.agent_peak_rss_mib),
            "≤ 150 MiB",
        );
        if *backend == "memory" {
            summary(
                &label("agent CPU per run"),
                &format!("{:.2} ms", w.agent_cpu_per_run.as_secs_f64() * 1000.0),
                "≤ 0.5 ms",
            );
        }
        if let (Some((a, g)), 1) = (tx, n) {
            summary(
                &format!("{runs} runs, postgres: transactions per run (all waves)"),
                &format!("{:.1}", a + g),
                "≤ 12",
            );
            if let Some(cpu) = database_cpu_per_run {
                summary(
                    &format!("{runs} runs, postgres: the database's CPU per run (all waves)"),
                    &format!("{cpu:.2} ms"),
                    "",
                );
            }
        }
    }
}
