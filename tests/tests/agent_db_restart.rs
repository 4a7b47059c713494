//! PostgreSQL restarted mid-run (R-1, E-11, E-12): each run ends with a terminal event (or
//! completes), nothing is corrupted, the thread works afterwards.
//!
//! The database is a private PostgreSQL server the test starts itself
//! (`steward_tests::pg_server`), never the machine's shared one. One gateway-svc and two
//! agent-svc replicas run on it as child processes (`steward_tests::procs`) with fast failover
//! settings and a rule-based model slow enough that runs are mid-flight. Six runs (streamed
//! text and `list_tasks` calls, which use the gateway's store) start across both replicas;
//! once each has shown its first event and answers are streaming, the server is stopped as
//! `pg_ctl stop -m immediate` does (every backend quits, no checkpoint), kept down until every
//! service reports NOT_SERVING, and started again on the same port and data directory (crash
//! recovery). That happens twice:
//!
//! - a quick restart, back as soon as PostgreSQL can be (well within RUN_LEASE): the runs'
//!   writers and lease keepers normally ride it out with their retries and complete;
//! - a slow one, down for RUN_LEASE + RUN_GRACE_PERIOD, with six more runs on the same threads
//!   from the other replicas: every lease lapses, the health monitors end the runs.
//!
//! Which way a run ends is printed, not asserted (a writer may still lose its lease in the
//! quick one); the lease each run holds as the database goes is printed too.
//!
//! Either way every run must end exactly once, visibly and consistently (client, GetRun and the
//! stored event log agree; seqs only increase; nothing the client saw is missing unless a
//! monitor ended the run), the user's message is kept, both services are SERVING again, and
//! every thread then completes a new run. The store as a whole is checked last (nothing live,
//! nothing leased, every run's last seq its last stored event).
//!
//! Waiting is on events (run streams, health Watch, the server's own log); bounds are upper
//! limits only; the one timed wait is the slow outage itself. Every failed expectation is
//! gathered and reported together, with the services' and the server's logs.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use steward_proto::{AGENT_SERVICE_NAME, GATEWAY_SERVICE_NAME, agent::v1 as pb};
use steward_tests::{
    UserAgent, agent_as,
    agent_calls::{get_run, messages, run_once},
    channel,
    pg_server::PgServer,
    procs::{Cluster, ClusterOptions, fast_failover_env},
    rule_model::RuleOptions,
};
use tokio::sync::{Notify, watch};
use tokio_stream::StreamExt;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// How long a run may take to end once the database is back: a writer retries its commits for
/// about 10 s, a lapsed lease is ended within RUN_LEASE + RUN_GRACE_PERIOD + a sweep.
const END_BOUND: Duration = Duration::from_secs(40);
/// How long a new run on a thread may take after the restart.
const NEW_RUN_BOUND: Duration = Duration::from_secs(20);
/// How long the services may take to notice the outage, and to be ready after it.
const HEALTH_BOUND: Duration = Duration::from_secs(15);
/// Text deltas and tool calls seen over all runs before the database goes.
const WORK_BEFORE_STOP: usize = 2;
/// How long the second outage lasts: RUN_LEASE + RUN_GRACE_PERIOD, so every lease lapses.
const SLOW_OUTAGE: Duration = Duration::from_secs(3);

/// Every failed expectation of the test, reported together at the end.
#[derive(Default)]
struct Failures(Vec<String>);

impl Failures {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            let what = what();
            eprintln!("FAILED: {what}");
            self.0.push(what);
        }
    }

    fn fail(&mut self, what: String) {
        self.check(false, || what);
    }

    /// Panics listing every failure, with the tail of each process's and the server's log.
    fn finish(self, cluster: &Cluster, pg: &PgServer) {
        if self.0.is_empty() {
            return;
        }
        let mut logs = String::new();
        for p in cluster
            .agents
            .iter()
            .chain(std::iter::once(&cluster.gateway))
        {
            logs.push_str(&format!(
                "\n--- {} pid {}: last WARN/ERROR lines ---\n{}",
                p.name,
                p.pid,
                p.problems(15)
            ));
        }
        logs.push_str(&format!(
            "\n--- postgres (port {}): last lines ---\n{}",
            pg.port(),
            pg.log_tail(15)
        ));
        panic!(
            "{} expectation(s) failed:\n- {}\n{logs}",
            self.0.len(),
            self.0.join("\n- ")
        );
    }
}

fn is_terminal(e: &pb::RunEvent) -> bool {
    matches!(
        e.kind,
        Some(pb::run_event::Kind::Result(_) | pb::run_event::Kind::Error(_))
    )
}

/// The run state a terminal event reports.
fn terminal_state(e: &pb::RunEvent) -> i32 {
    match &e.kind {
        Some(pb::run_event::Kind::Result(r)) => r.status,
        Some(pb::run_event::Kind::Error(err)) if err.kind == pb::FailureKind::Cancelled as i32 => {
            pb::RunState::Cancelled as i32
        }
        _ => pb::RunState::Failed as i32,
    }
}

fn state_name(state: i32) -> &'static str {
    pb::RunState::try_from(state).map_or("?", |s| s.as_str_name())
}

const TERMINAL_STATES: [pb::RunState; 3] = [
    pb::RunState::Completed,
    pb::RunState::Failed,
    pb::RunState::Cancelled,
];

fn is_terminal_state(state: i32) -> bool {
    TERMINAL_STATES.iter().any(|s| *s as i32 == state)
}

fn describe(e: &pb::RunEvent) -> String {
    match &e.kind {
        Some(pb::run_event::Kind::Result(r)) => format!(
            "seq {} result {} {:?}{}",
            e.seq,
            state_name(r.status),
            r.summary.chars().take(60).collect::<String>(),
            if r.error.is_empty() {
                String::new()
            } else {
                format!(" error {:?}", r.error)
            }
        ),
        Some(pb::run_event::Kind::Error(err)) => {
            format!("seq {} error {:?} kind {}", e.seq, err.message, err.kind)
        }
        other => format!("seq {} {:?}", e.seq, other),
    }
}

/// A terminal event a user can act on: a completed answer, or a failure that says why.
fn is_clear(e: &pb::RunEvent) -> bool {
    match &e.kind {
        Some(pb::run_event::Kind::Result(r)) if r.status == pb::RunState::Completed as i32 => {
            !r.summary.trim().is_empty()
        }
        Some(pb::run_event::Kind::Result(r)) => {
            is_terminal_state(r.status) && !(r.error.trim().is_empty() && r.summary.is_empty())
        }
        Some(pb::run_event::Kind::Error(err)) => !err.message.trim().is_empty(),
        _ => false,
    }
}

/// Seqs in `events` that do not increase strictly, as "a then b" notes.
fn seq_regressions(events: &[pb::RunEvent]) -> Vec<String> {
    events
        .windows(2)
        .filter(|w| w[1].seq <= w[0].seq)
        .map(|w| format!("{} then {}", w[0].seq, w[1].seq))
        .collect()
}

/// Every durable event of a run, from WatchRun after 0 until its terminal event.
async fn replay(client: &mut UserAgent, run_id: &str) -> Result<Vec<pb::RunEvent>, String> {
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut stream = client
            .watch_run(pb::WatchRunRequest {
                run_id: run_id.to_owned(),
                after_seq: 0,
            })
            .await
            .map_err(|e| format!("WatchRun refused: {:?} {}", e.code(), e.message()))?
            .into_inner();
        let mut events = Vec::new();
        while let Some(item) = stream.next().await {
            let item =
                item.map_err(|e| format!("WatchRun broke: {:?} {}", e.code(), e.message()))?;
            if let Some(e) = item.event {
                let end = is_terminal(&e);
                events.push(e);
                if end {
                    return Ok(events);
                }
            }
        }
        Err(format!(
            "the replay ended without a terminal event after {} events",
            events.len()
        ))
    })
    .await;
    read.unwrap_or_else(|_| Err("the replay did not end within 10 s".into()))
}

// ---------------------------------------------------------------------------------------------
// Following the runs.

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// A streamed answer.
    Text,
    /// `list_tasks` twice (the gateway's own store: it goes down too), then an answer.
    Tools,
    /// A streamed answer that waits 1.5 s first.
    SlowText,
    /// `list_tasks` once, every answer 1.5 s late.
    SlowTools,
}

#[derive(Clone, Debug)]
struct Spec {
    /// Which outage it lives through, for messages.
    round: &'static str,
    index: usize,
    kind: Kind,
    user: String,
    prompt: String,
    request_id: String,
    /// Empty: a new thread.
    thread_id: String,
    replica: usize,
}

impl Spec {
    fn label(&self) -> String {
        format!(
            "{} run #{} ({:?}, user {}, replica {})",
            self.round, self.index, self.kind, self.user, self.replica
        )
    }
}

/// What one client saw of a run, over every stream it took.
#[derive(Default, Debug)]
struct Seen {
    /// Every event received, in order.
    events: Vec<pb::RunEvent>,
    terminal: Option<pb::RunEvent>,
    /// How many streams it took.
    streams: usize,
    notes: Vec<String>,
}

impl Seen {
    fn last_seq(&self) -> u64 {
        self.events.last().map_or(0, |e| e.seq)
    }
}

#[derive(Default, Debug)]
struct Outcome {
    run_id: Option<String>,
    thread_id: Option<String>,
    /// The caller: RunStream on the run's replica, then WatchRun if that broke.
    own: Seen,
    /// A watcher on the other replica (it reads the store), from the first event on.
    remote: Seen,
}

struct Shared {
    addrs: Vec<SocketAddr>,
    /// Runs that showed their first event.
    started: AtomicUsize,
    /// Text deltas and tool calls over all runs.
    work: AtomicUsize,
    finished: AtomicUsize,
    progress: Notify,
    /// True once the database is back and every service reports SERVING again.
    recovered: watch::Receiver<bool>,
    deadline: Instant,
}

impl Shared {
    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    fn bump(&self, counter: &AtomicUsize) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.progress.notify_waiters();
    }

    /// Waits until `ready` holds for the counters (woken by progress), at most `bound`.
    async fn wait_until(&self, bound: Duration, ready: impl Fn(&Self) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let progressed = self.progress.notified();
            tokio::pin!(progressed);
            progressed.as_mut().enable();
            if ready(self) {
                return true;
            }
            if tokio::time::timeout_at(deadline, progressed).await.is_err() {
                return ready(self);
            }
        }
    }

    /// Waits for the database to be back; false if it is not within the test's bound.
    async fn wait_recovered(&self) -> bool {
        let mut recovered = self.recovered.clone();
        // The borrow `wait_for` returns is dropped at once: it would block the sender.
        tokio::time::timeout(self.left(), recovered.wait_for(|r| *r))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// Reads a RunStream / WatchRun stream into `seen` until a terminal event; the error if it
/// broke. `first` gets the run's ids with its first event (the caller's stream only).
async fn read_stream<S, R>(
    mut stream: S,
    shared: &Shared,
    seen: &mut Seen,
    mut first: Option<&mut (dyn FnMut(&pb::RunEvent) + Send)>,
    event_of: impl Fn(R) -> Option<pb::RunEvent>,
) -> Result<(), String>
where
    S: tokio_stream::Stream<Item = Result<R, tonic::Status>> + Unpin,
{
    loop {
        let next = match tokio::time::timeout(shared.left(), stream.next()).await {
            Ok(n) => n,
            Err(_) => return Err("the test's bound passed without a terminal event".into()),
        };
        match next {
            Some(Ok(r)) => {
                let Some(event) = event_of(r) else { continue };
                if let Some(first) = first.as_mut() {
                    first(&event);
                    if matches!(
                        event.kind,
                        Some(pb::run_event::Kind::Delta(_) | pb::run_event::Kind::ToolCall(_))
                    ) {
                        shared.bump(&shared.work);
                    }
                }
                let end = is_terminal(&event);
                seen.events.push(event.clone());
                if end {
                    seen.terminal = Some(event);
                    return Ok(());
                }
            }
            Some(Err(e)) => return Err(format!("stream broke: {:?} {}", e.code(), e.message())),
            None => return Err("stream ended without a terminal event".into()),
        }
    }
}

/// Follows `run_id` with WatchRun after what `seen` has, once the database is back, until the
/// terminal event; `replicas` are tried in turn.
async fn rewatch(shared: &Shared, user: &str, run_id: &str, replicas: [usize; 2], seen: &mut Seen) {
    let mut attempt = 0;
    while seen.terminal.is_none() && attempt < 4 && !shared.left().is_zero() {
        if !shared.wait_recovered().await {
            seen.notes
                .push("the database did not come back within the test's bound".into());
            return;
        }
        let replica = replicas[attempt % 2];
        attempt += 1;
        seen.streams += 1;
        let after_seq = seen.last_seq();
        let mut client = agent_as(shared.addrs[replica], user).await;
        let request = pb::WatchRunRequest {
            run_id: run_id.to_owned(),
            after_seq,
        };
        match client.watch_run(request).await {
            Ok(stream) => {
                if let Err(e) =
                    read_stream(stream.into_inner(), shared, seen, None, |r| r.event).await
                {
                    seen.notes.push(format!(
                        "WatchRun after {after_seq} on replica {replica}: {e}"
                    ));
                }
            }
            Err(e) => seen.notes.push(format!(
                "WatchRun after {after_seq} refused by replica {replica}: {:?} {}",
                e.code(),
                e.message()
            )),
        }
    }
}

/// Starts one run with RunStream on its replica and follows it to its terminal event; a stream
/// that breaks is picked up again, once the database is back, by WatchRun after the last seq
/// seen (its own replica first, then the other). From the first event on, a second client
/// follows it with WatchRun on the other replica, the same way.
async fn drive(spec: Spec, shared: Arc<Shared>) -> Outcome {
    let mut out = Outcome::default();
    let other = 1 - spec.replica;
    let (id_tx, id_rx) = tokio::sync::oneshot::channel::<String>();
    let remote = {
        let shared = shared.clone();
        let user = spec.user.clone();
        tokio::spawn(async move {
            let mut seen = Seen::default();
            let Ok(run_id) = id_rx.await else {
                return seen;
            };
            seen.streams = 1;
            let mut client = agent_as(shared.addrs[other], &user).await;
            let request = pb::WatchRunRequest {
                run_id: run_id.clone(),
                after_seq: 0,
            };
            match client.watch_run(request).await {
                Ok(stream) => {
                    if let Err(e) =
                        read_stream(stream.into_inner(), &shared, &mut seen, None, |r| r.event)
                            .await
                    {
                        seen.notes.push(format!("WatchRun on replica {other}: {e}"));
                    }
                }
                Err(e) => seen.notes.push(format!(
                    "WatchRun refused by replica {other}: {:?} {}",
                    e.code(),
                    e.message()
                )),
            }
            rewatch(&shared, &user, &run_id, [other, 1 - other], &mut seen).await;
            seen
        })
    };
    let mut client = agent_as(shared.addrs[spec.replica], &spec.user).await;
    let input = pb::RunInput {
        prompt: spec.prompt.clone(),
        request_id: spec.request_id.clone(),
        thread_id: spec.thread_id.clone(),
        ..Default::default()
    };
    out.own.streams = 1;
    let mut id_tx = Some(id_tx);
    let mut ids = None;
    let mut first = |e: &pb::RunEvent| {
        if ids.is_none() {
            ids = Some((e.run_id.clone(), e.thread_id.clone()));
            if let Some(tx) = id_tx.take() {
                let _ = tx.send(e.run_id.clone());
            }
            shared.bump(&shared.started);
        }
    };
    match client
        .run_stream(pb::RunStreamRequest { input: Some(input) })
        .await
    {
        Ok(stream) => {
            if let Err(e) = read_stream(
                stream.into_inner(),
                &shared,
                &mut out.own,
                Some(&mut first),
                |r| r.event,
            )
            .await
            {
                out.own
                    .notes
                    .push(format!("RunStream on replica {}: {e}", spec.replica));
            }
        }
        Err(e) => out.own.notes.push(format!(
            "RunStream refused by replica {}: {:?} {}",
            spec.replica,
            e.code(),
            e.message()
        )),
    }
    if let Some((run_id, thread_id)) = ids {
        rewatch(
            &shared,
            &spec.user,
            &run_id,
            [spec.replica, other],
            &mut out.own,
        )
        .await;
        out.run_id = Some(run_id);
        out.thread_id = Some(thread_id);
    }
    out.remote = remote.await.unwrap_or_default();
    shared.bump(&shared.finished);
    out
}

// ---------------------------------------------------------------------------------------------
// Health.

/// Follows one service's health Watch, publishing every status it reports.
fn watch_health(
    name: String,
    addr: SocketAddr,
    service: &'static str,
) -> (
    watch::Receiver<Option<ServingStatus>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = watch::channel(None);
    let task = tokio::spawn(async move {
        let mut client = HealthClient::new(channel(addr).await);
        let mut stream = match client
            .watch(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
        {
            Ok(s) => s.into_inner(),
            Err(e) => {
                eprintln!("{name}: health Watch refused: {e}");
                return;
            }
        };
        while let Some(update) = stream.next().await {
            match update {
                Ok(u) => {
                    println!("{name} health: {:?}", u.status());
                    tx.send_replace(Some(u.status()));
                }
                Err(e) => {
                    eprintln!("{name}: health Watch broke: {e}");
                    return;
                }
            }
        }
    });
    (rx, task)
}

/// Waits until every watched service reports `want`; the names of those that did not.
async fn wait_health(
    watched: &mut [(String, watch::Receiver<Option<ServingStatus>>)],
    want: ServingStatus,
    bound: Duration,
) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + bound;
    let mut missing = Vec::new();
    for (name, rx) in watched.iter_mut() {
        // The borrow `wait_for` returns is dropped at once: it would block the sender.
        let reached = tokio::time::timeout_at(deadline, rx.wait_for(|s| *s == Some(want)))
            .await
            .is_ok_and(|r| r.is_ok());
        if !reached {
            missing.push(format!("{name} (last reported {:?})", *rx.borrow()));
        }
    }
    missing
}

// ---------------------------------------------------------------------------------------------
// One outage.

/// The health of every service, followed for the whole test.
type Health = Vec<(String, watch::Receiver<Option<ServingStatus>>)>;

/// How many runs the agents' health monitors have ended so far (from their logs).
fn ended_by_monitors(cluster: &Cluster) -> usize {
    cluster
        .agents
        .iter()
        .map(|a| {
            a.log()
                .iter()
                .filter(|l| l.contains("health monitor ended a run whose lease lapsed"))
                .count()
        })
        .sum()
}

/// Starts `specs` with RunStream, stops PostgreSQL immediately once every run has shown its
/// first event and answers are under way, holds it down until every service noticed (plus
/// `hold`), starts it again, and follows every run to its end. Returns what each client saw.
async fn outage(
    cluster: &Cluster,
    pg: &mut PgServer,
    health: &mut Health,
    specs: &[Spec],
    hold: Duration,
    f: &mut Failures,
) -> Vec<Outcome> {
    let round = specs.first().map_or("", |s| s.round);
    let monitor_ends_before = ended_by_monitors(cluster);
    let (recovered_tx, recovered) = watch::channel(false);
    let shared = Arc::new(Shared {
        addrs: cluster.agents.iter().map(|a| a.addr).collect(),
        started: AtomicUsize::new(0),
        work: AtomicUsize::new(0),
        finished: AtomicUsize::new(0),
        progress: Notify::new(),
        recovered,
        deadline: Instant::now() + END_BOUND,
    });
    let tasks: Vec<_> = specs
        .iter()
        .cloned()
        .map(|spec| tokio::spawn(drive(spec, shared.clone())))
        .collect();

    let n = specs.len();
    let all_started = shared
        .wait_until(Duration::from_secs(15), |s| {
            s.started.load(Ordering::SeqCst) == n
        })
        .await;
    let working = shared
        .wait_until(Duration::from_secs(10), |s| {
            s.work.load(Ordering::SeqCst) >= WORK_BEFORE_STOP
        })
        .await;
    f.check(all_started, || {
        format!(
            "{round}: only {} of {n} runs showed a first event before the stop",
            shared.started.load(Ordering::SeqCst)
        )
    });
    f.check(working, || {
        format!(
            "{round}: only {} deltas/tool calls before the stop",
            shared.work.load(Ordering::SeqCst)
        )
    });
    let finished_before = shared.finished.load(Ordering::SeqCst);
    f.check(finished_before == 0, || {
        format!(
            "{round}: {finished_before} runs ended before the database stopped: the model is too quick"
        )
    });
    // For the record: how much lease each live run holds as the database goes (a keeper renews
    // every third of RUN_LEASE, so about two thirds of it or more).
    let sql = cluster.sql().await;
    match sql
        .query(
            "SELECT lock_run_id, (extract(epoch FROM lock_expires_at - clock_timestamp()) * 1000)::bigint \
             FROM agent.threads WHERE lock_run_id IS NOT NULL ORDER BY 2",
            &[],
        )
        .await
    {
        Ok(rows) => {
            let left: Vec<String> = rows
                .iter()
                .map(|r| format!("{} {} ms", r.get::<_, String>(0), r.get::<_, i64>(1)))
                .collect();
            println!("{round}: lease left at the stop: {left:?}");
        }
        Err(e) => println!("{round}: could not read the leases: {e}"),
    }
    drop(sql);
    let pid = pg.pid();
    let stopped_at = Instant::now();
    if let Err(e) = tokio::task::block_in_place(|| pg.stop_immediate()) {
        f.fail(format!("{round}: stopping PostgreSQL: {e}"));
    }
    println!(
        "{round}: PostgreSQL (pid {pid:?}) stopped immediately after {} first events, {} deltas/tool calls, {finished_before} runs ended",
        shared.started.load(Ordering::SeqCst),
        shared.work.load(Ordering::SeqCst),
    );

    let unaware = wait_health(health, ServingStatus::NotServing, HEALTH_BOUND).await;
    f.check(unaware.is_empty(), || {
        format!("{round}: still SERVING with the database down: {unaware:?}")
    });
    let noticed = stopped_at.elapsed();
    if !hold.is_zero() {
        // The outage's length, part of the fault: not a synchronisation.
        tokio::time::sleep(hold).await;
    }
    let restart = tokio::task::block_in_place(|| pg.restart_same_port());
    let down = stopped_at.elapsed();
    match &restart {
        Ok(()) => println!(
            "{round}: PostgreSQL back on port {} as pid {:?}; noticed after {noticed:.1?}, down {down:.1?}",
            pg.port(),
            pg.pid()
        ),
        Err(e) => f.fail(format!("{round}: restarting PostgreSQL: {e}")),
    }
    let unready = wait_health(health, ServingStatus::Serving, HEALTH_BOUND).await;
    f.check(unready.is_empty(), || {
        format!("{round}: not SERVING again after the restart: {unready:?}")
    });
    println!(
        "{round}: every service SERVING {:.1?} after the stop",
        stopped_at.elapsed()
    );
    recovered_tx.send_replace(true);

    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.expect("a driver task"));
    }
    println!(
        "{round}: every run followed to its end {:.1?} after the stop; {} ended by a health monitor",
        stopped_at.elapsed(),
        ended_by_monitors(cluster) - monitor_ends_before
    );
    outcomes
}

/// The two clients of a run: the caller, and the watcher on the other replica.
fn clients(out: &Outcome) -> [(&'static str, &Seen); 2] {
    [
        ("the caller", &out.own),
        ("the other replica's watcher", &out.remote),
    ]
}

/// One visible end, the same for both clients and in the store, nothing out of order or lost,
/// the user's message kept once.
async fn check_run(cluster: &Cluster, spec: &Spec, out: &Outcome, f: &mut Failures) {
    let label = spec.label();
    for (who, seen) in clients(out) {
        println!(
            "{label}: {who}: {} events over {} stream(s), terminal {:?}, notes {:?}",
            seen.events.len(),
            seen.streams,
            seen.terminal.as_ref().map(describe),
            seen.notes
        );
    }
    let Some(run_id) = &out.run_id else {
        f.fail(format!("{label}: never started: {:?}", out.own.notes));
        return;
    };
    let thread_id = out.thread_id.clone().unwrap_or_default();
    for (who, seen) in clients(out) {
        let regressions = seq_regressions(&seen.events);
        f.check(regressions.is_empty(), || {
            format!("{label} {run_id}: seqs not strictly increasing for {who}: {regressions:?}")
        });
        match &seen.terminal {
            None => f.fail(format!(
                "{label} {run_id}: no terminal event reached {who}: {:?}",
                seen.notes
            )),
            Some(t) => f.check(is_clear(t), || {
                format!(
                    "{label} {run_id}: the terminal event {who} got is not clear: {}",
                    describe(t)
                )
            }),
        }
    }
    if let (Some(a), Some(b)) = (&out.own.terminal, &out.remote.terminal) {
        f.check(a.seq == b.seq && a.kind == b.kind, || {
            format!(
                "{label} {run_id}: the caller's end is {} but the other replica's watcher got {}",
                describe(a),
                describe(b)
            )
        });
    }
    let terminal = out.own.terminal.as_ref().or(out.remote.terminal.as_ref());
    let mut client = cluster.agent(1 - spec.replica, &spec.user).await;
    match get_run(&mut client, run_id).await {
        Ok(got) => {
            let run = got.run.unwrap_or_default();
            f.check(is_terminal_state(run.state), || {
                format!(
                    "{label} {run_id}: GetRun says {} (error {:?})",
                    state_name(run.state),
                    run.error
                )
            });
            if let Some(t) = terminal {
                f.check(run.last_event_seq == t.seq, || {
                    format!(
                        "{label} {run_id}: last_event_seq {} but the terminal event is {}",
                        run.last_event_seq,
                        describe(t)
                    )
                });
                f.check(terminal_state(t) == run.state, || {
                    format!(
                        "{label} {run_id}: the terminal event says {} but GetRun says {}",
                        state_name(terminal_state(t)),
                        state_name(run.state)
                    )
                });
            }
        }
        Err(e) => f.fail(format!("{label}: {e}")),
    }
    // The durable log, replayed from the start on the other replica.
    match replay(&mut client, run_id).await {
        Ok(durable) => check_durable(&label, run_id, out, &durable, f),
        Err(e) => f.fail(format!("{label} {run_id}: replaying its events: {e}")),
    }
    match messages(&mut client, &thread_id).await {
        Ok(list) => {
            let asked = list
                .iter()
                .filter(|m| m.source == pb::MessageSource::User as i32 && m.content == spec.prompt)
                .count();
            f.check(asked == 1, || {
                format!(
                    "{label}: the user's message is in thread {thread_id} {asked} times (want once)"
                )
            });
        }
        Err(e) => f.fail(format!("{label}: {e}")),
    }
}

/// The stored events of a run against what its clients saw. A writer numbers events one by
/// one, so the stored seqs run 1, 2, 3, … with one exception: the end a health monitor writes
/// skips past what a lost writer may have shown live. Only then may an event the caller saw be
/// missing from the store; the other replica's watcher reads the store, so nothing it saw may
/// ever be missing.
fn check_durable(
    label: &str,
    run_id: &str,
    out: &Outcome,
    durable: &[pb::RunEvent],
    f: &mut Failures,
) {
    let regressions = seq_regressions(durable);
    f.check(regressions.is_empty(), || {
        format!("{label} {run_id}: stored seqs not strictly increasing: {regressions:?}")
    });
    f.check(durable.first().is_some_and(|e| e.seq == 1), || {
        format!(
            "{label} {run_id}: the stored log starts at {:?}",
            durable.first().map(describe)
        )
    });
    let jumps: Vec<(usize, u64, u64)> = durable
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[1].seq != w[0].seq + 1)
        .map(|(i, w)| (i + 1, w[0].seq, w[1].seq))
        .collect();
    let last = durable.len().saturating_sub(1);
    let inner_jumps: Vec<_> = jumps.iter().filter(|(i, _, _)| *i != last).collect();
    f.check(inner_jumps.is_empty(), || {
        format!("{label} {run_id}: gaps inside the stored log: {inner_jumps:?}")
    });
    let monitor_end = jumps.iter().any(|(i, _, _)| *i == last);
    let end = durable.last();
    let stored: HashMap<u64, &pb::RunEvent> = durable.iter().map(|e| (e.seq, e)).collect();
    let mut lost_live = 0;
    for (who, seen) in clients(out) {
        if let (Some(end), Some(t)) = (end, &seen.terminal) {
            f.check(end.seq == t.seq && end.kind == t.kind, || {
                format!(
                    "{label} {run_id}: the stored end is {} but {who} got {}",
                    describe(end),
                    describe(t)
                )
            });
        }
        let differing: Vec<String> = seen
            .events
            .iter()
            .filter_map(|e| {
                let d = stored.get(&e.seq)?;
                (e.kind != d.kind)
                    .then(|| format!("{who} got {} / stored {}", describe(e), describe(d)))
            })
            .collect();
        f.check(differing.is_empty(), || {
            format!("{label} {run_id}: one seq, two events: {differing:?}")
        });
        let lost: Vec<u64> = seen
            .events
            .iter()
            .filter(|e| !stored.contains_key(&e.seq))
            .map(|e| e.seq)
            .collect();
        let from_store = std::ptr::eq(seen, &out.remote);
        f.check(lost.is_empty() || (monitor_end && !from_store), || {
            format!(
                "{label} {run_id}: seqs {lost:?} that {who} got are not in the store (it ended {} by {})",
                end.map_or_else(|| "?".into(), describe),
                if monitor_end {
                    "a health monitor"
                } else {
                    "its own writer"
                }
            )
        });
        if !from_store {
            lost_live = lost.len();
        }
    }
    println!(
        "{label}: {} stored events, ended {} by {}; {lost_live} shown live but never stored",
        durable.len(),
        end.map_or_else(|| "nowhere".into(), describe),
        if monitor_end {
            "a health monitor"
        } else {
            "its writer"
        },
    );
}

// ---------------------------------------------------------------------------------------------
// The test.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restarted_mid_run_ends_every_run_and_the_threads_work_afterwards() {
    let began = Instant::now();
    // Declared before the cluster, so it is dropped after every service process.
    let mut pg = PgServer::spawn().await.expect("start a private PostgreSQL");
    let db = "steward_db_restart";
    pg.create_database(db)
        .await
        .expect("create the test database on the private server");
    println!(
        "private PostgreSQL pid {:?} on port {} in {} ({:.1?})",
        pg.pid(),
        pg.port(),
        pg.dir().display(),
        began.elapsed()
    );
    let cluster = Cluster::start(ClusterOptions {
        agents: 2,
        model: RuleOptions {
            delay: Some((Duration::from_millis(100), Duration::from_millis(400))),
            // Twenty deltas 100 ms apart: an answer streams for two seconds.
            delta_pause: Duration::from_millis(100),
            slow: Duration::from_millis(1500),
            seed: 11,
        },
        agent_env: fast_failover_env(),
        database_url: Some(pg.url(db)),
        ..ClusterOptions::default()
    })
    .await;
    println!("cluster ready ({:.1?})", began.elapsed());

    let mut health: Health = Vec::new();
    let mut watchers = Vec::new();
    for (i, a) in cluster.agents.iter().enumerate() {
        let name = format!("agent-svc {i}");
        let (rx, task) = watch_health(name.clone(), a.addr, AGENT_SERVICE_NAME);
        health.push((name, rx));
        watchers.push(task);
    }
    let (rx, task) = watch_health(
        "gateway-svc".into(),
        cluster.gateway.addr,
        GATEWAY_SERVICE_NAME,
    );
    health.push(("gateway-svc".into(), rx));
    watchers.push(task);
    let serving = wait_health(&mut health, ServingStatus::Serving, HEALTH_BOUND).await;
    assert!(serving.is_empty(), "not SERVING at the start: {serving:?}");
    let mut f = Failures::default();

    let users = ["ada", "ben", "cyd"];
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let kinds = [
        Kind::Text,
        Kind::Tools,
        Kind::SlowText,
        Kind::Text,
        Kind::Tools,
        Kind::SlowTools,
    ];
    let specs_for = |round: &'static str, threads: &[String], shift: usize| -> Vec<Spec> {
        kinds
            .iter()
            .enumerate()
            .map(|(i, kind)| Spec {
                round,
                index: i,
                kind: *kind,
                user: users[i % users.len()].to_owned(),
                prompt: match kind {
                    Kind::Text => format!("hello number {i} ({round} {tag})"),
                    Kind::Tools => format!("check my tasks x2 #{i} ({round} {tag})"),
                    Kind::SlowText => format!("slow hello number {i} ({round} {tag})"),
                    Kind::SlowTools => format!("slow check my tasks #{i} ({round} {tag})"),
                },
                request_id: format!("req-{tag}-{round}-{i}"),
                thread_id: threads.get(i).cloned().unwrap_or_default(),
                replica: (i + shift) % 2,
            })
            .collect()
    };

    // A quick restart: PostgreSQL is back as soon as it can be, well within RUN_LEASE.
    let quick = specs_for("quick restart", &[], 0);
    let outcomes = outage(
        &cluster,
        &mut pg,
        &mut health,
        &quick,
        Duration::ZERO,
        &mut f,
    )
    .await;
    for (spec, out) in quick.iter().zip(&outcomes) {
        check_run(&cluster, spec, out, &mut f).await;
    }
    let threads: Vec<String> = outcomes
        .iter()
        .map(|o| o.thread_id.clone().unwrap_or_default())
        .collect();
    println!("quick restart checked ({:.1?})", began.elapsed());

    // A slow one, on the same threads from the other replicas: down for RUN_LEASE +
    // RUN_GRACE_PERIOD, so every lease lapses while it is away.
    let slow = specs_for("slow restart", &threads, 1);
    let outcomes = outage(&cluster, &mut pg, &mut health, &slow, SLOW_OUTAGE, &mut f).await;
    for (spec, out) in slow.iter().zip(&outcomes) {
        check_run(&cluster, spec, out, &mut f).await;
    }
    println!("slow restart checked ({:.1?})", began.elapsed());

    // Every thread takes a new run, all at once.
    let mut next_runs = Vec::new();
    for spec in &quick {
        let thread_id = threads[spec.index].clone();
        if thread_id.is_empty() {
            continue;
        }
        let addr = cluster.agents[spec.replica].addr;
        let user = spec.user.clone();
        let label = format!("run #{} ({:?}, user {user})", spec.index, spec.kind);
        next_runs.push(tokio::spawn(async move {
            let mut client = agent_as(addr, &user).await;
            let prompt = format!("hello again on {thread_id}");
            let next =
                tokio::time::timeout(NEW_RUN_BOUND, run_once(&mut client, &prompt, &thread_id))
                    .await;
            (label, thread_id, next)
        }));
    }
    for task in next_runs {
        let (label, thread_id, next) = task.await.expect("a new-run task");
        match next {
            Ok(Ok(r)) => f.check(r.status == pb::RunState::Completed as i32, || {
                format!(
                    "the thread of {label}: a new run on {thread_id} ended {} ({:?})",
                    state_name(r.status),
                    r.error
                )
            }),
            Ok(Err(e)) => f.fail(format!(
                "the thread of {label}: {thread_id} refused a new run: {:?} {}",
                e.code(),
                e.message()
            )),
            Err(_) => f.fail(format!(
                "the thread of {label}: a new run on {thread_id} did not end within {NEW_RUN_BOUND:?}"
            )),
        }
    }
    println!("a new run on every thread done ({:.1?})", began.elapsed());

    // The store as a whole: nothing live, nothing leased, every run's seq at its last event.
    let sql = cluster.sql().await;
    let live: Vec<(String, String)> = sql
        .query(
            "SELECT id, state FROM agent.runs WHERE state IN ('queued', 'planning', 'executing')",
            &[],
        )
        .await
        .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        .unwrap_or_else(|e| vec![("query failed".into(), e.to_string())]);
    f.check(live.is_empty(), || {
        format!("runs still live in the store: {live:?}")
    });
    let leased: Vec<(String, Option<String>)> = sql
        .query(
            "SELECT id, lock_run_id FROM agent.threads WHERE lock_run_id IS NOT NULL OR lock_token IS NOT NULL",
            &[],
        )
        .await
        .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        .unwrap_or_else(|e| vec![("query failed".into(), Some(e.to_string()))]);
    f.check(leased.is_empty(), || {
        format!("threads still leased with every run over: {leased:?}")
    });
    let skewed: Vec<(String, i64, Option<i64>)> = sql
        .query(
            "SELECT r.id, r.last_event_seq, (SELECT max(seq) FROM agent.run_events e WHERE e.run_id = r.id) \
             FROM agent.runs r",
            &[],
        )
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .filter(|(_, last, max): &(String, i64, Option<i64>)| Some(*last) != *max)
                .collect()
        })
        .unwrap_or_else(|e| vec![(format!("query failed: {e}"), 0, None)]);
    f.check(skewed.is_empty(), || {
        format!("runs whose last_event_seq is not their last stored event: {skewed:?}")
    });
    // Calls an ended run left open (whether they ran is unknown): reported, not failed.
    if let Ok(rows) = sql
        .query(
            "SELECT a.run_id, a.tool, a.state, r.state FROM agent.actions a \
             JOIN agent.runs r ON r.id = a.run_id WHERE a.state IN ('planned', 'executing')",
            &[],
        )
        .await
    {
        for r in rows {
            let (run, tool, state, run_state): (String, String, String, String) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            println!("note: run {run} ({run_state}) left its {tool} call {state}");
        }
    }
    println!("the whole test took {:.1?}", began.elapsed());
    for w in watchers {
        w.abort();
    }
    f.finish(&cluster, &pg);
}
