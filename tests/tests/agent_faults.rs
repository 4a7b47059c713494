//! Faults with real processes (R-1, R-3, E-11, E-12, O-3): one gateway-svc and two agent-svc
//! replicas as child processes on one fresh PostgreSQL database, a rule-based OpenAI-compatible
//! model and a fake Gmail on loopback; replicas and the gateway die by `kill -9 <pid>`.
//!
//! The acceptance suite of the run-lifecycle redesign: it passes only once runs hold a short
//! lease (RUN_LEASE) that the health monitor (HEALTH_MONITOR_INTERVAL, RUN_GRACE_PERIOD) uses to
//! end the runs of a dead replica, approvals continue exactly once, and a cancelled or
//! superseded approval is refused. Each test gathers every failed expectation and reports them
//! together, so one run shows the whole picture.
//!
//! Waiting is on events (run streams, health Watch); bounds are upper limits only. The seed of
//! the kill test is printed; `STEWARD_FAULT_SEED=<n>` replays it. The service binaries are
//! built when missing (see `steward_tests::procs`).

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use steward_proto::agent::v1 as pb;
use steward_tests::{
    UserAgent, agent_as,
    agent_calls::{get_run, messages, run_once},
    procs::{Cluster, ClusterOptions, fast_failover_env},
    rule_model::RuleOptions,
};
use tokio::sync::Notify;
use tokio_stream::StreamExt;
use tonic::Code;

/// How long a test waits for a run's terminal event once it should come.
const TERMINAL_BOUND: Duration = Duration::from_secs(20);

/// Every failed expectation of a test, reported together at the end.
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

    /// Panics listing every failure, with the tail of each process's log.
    fn finish(self, cluster: &Cluster) {
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
                "\n--- {} pid {} ({}): last WARN/ERROR lines ---\n{}",
                p.name,
                p.pid,
                if p.is_dead() { "killed" } else { "running" },
                p.problems(12)
            ));
        }
        panic!(
            "{} expectation(s) failed:\n- {}\n{logs}",
            self.0.len(),
            self.0.join("\n- ")
        );
    }
}

/// splitmix64, seeded: the test's only randomness.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn seed() -> u64 {
    std::env::var("STEWARD_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
        })
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

fn describe(e: &pb::RunEvent) -> String {
    match &e.kind {
        Some(pb::run_event::Kind::Result(r)) => format!(
            "seq {} result {} {:?}{}",
            e.seq,
            state_name(r.status),
            r.summary.chars().take(80).collect::<String>(),
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

/// What following a run's events produced.
#[derive(Default, Debug)]
struct Followed {
    events: Vec<pb::RunEvent>,
    terminal: Option<pb::RunEvent>,
    /// Why it stopped without a terminal event.
    error: Option<String>,
}

/// WatchRun from `after` until the terminal event, at most `bound`.
async fn follow(client: &mut UserAgent, run_id: &str, after: u64, bound: Duration) -> Followed {
    let mut out = Followed::default();
    let watched = tokio::time::timeout(bound, async {
        let mut stream = match client
            .watch_run(pb::WatchRunRequest {
                run_id: run_id.to_owned(),
                after_seq: after,
            })
            .await
        {
            Ok(s) => s.into_inner(),
            Err(e) => return Err(format!("WatchRun refused: {:?} {}", e.code(), e.message())),
        };
        while let Some(item) = stream.next().await {
            match item {
                Ok(r) => {
                    if let Some(e) = r.event {
                        let end = is_terminal(&e);
                        out.events.push(e.clone());
                        if end {
                            out.terminal = Some(e);
                            return Ok(());
                        }
                    }
                }
                Err(e) => return Err(format!("WatchRun broke: {:?} {}", e.code(), e.message())),
            }
        }
        Err("WatchRun ended without a terminal event".to_owned())
    })
    .await;
    match watched {
        Ok(Ok(())) => {}
        Ok(Err(e)) => out.error = Some(e),
        Err(_) => out.error = Some(format!("no terminal event within {bound:?}")),
    }
    out
}

fn approve(approval_id: &str) -> pb::DecideApprovalRequest {
    pb::DecideApprovalRequest {
        approval_id: approval_id.to_owned(),
        decision: pb::Decision::Approve as i32,
        ..Default::default()
    }
}

/// How many emails the fake Gmail sent with exactly this subject.
fn sends_with_subject(cluster: &Cluster, subject: &str) -> usize {
    cluster
        .gmail
        .sent()
        .iter()
        .filter(|(raw, _)| {
            raw.lines()
                .any(|l| l.trim_end() == format!("Subject: {subject}"))
        })
        .count()
}

/// A paused supervised send on replica `replica`: (result, last seq so far, the send's call id).
async fn paused_send(
    cluster: &Cluster,
    replica: usize,
    user: &str,
    prompt: &str,
) -> (pb::RunResult, u64, String) {
    let mut client = cluster.agent(replica, user).await;
    let paused = run_once(&mut client, prompt, "")
        .await
        .expect("the send run starts");
    assert_eq!(
        paused.status,
        pb::RunState::AwaitingConfirmation as i32,
        "a supervised send pauses for approval: {paused:?}"
    );
    let run = get_run(&mut client, &paused.run_id)
        .await
        .expect("GetRun of the paused run");
    let seq = run.run.as_ref().map_or(0, |r| r.last_event_seq);
    let approval = paused.approval.clone().expect("an approval");
    let call_id = run
        .actions
        .iter()
        .find(|a| a.approval_id == approval.id)
        .map(|a| a.call_id.clone())
        .or_else(|| {
            approval
                .action_id
                .rsplit_once('/')
                .map(|(_, c)| c.to_owned())
        })
        .expect("the paused call's id");
    (paused, seq, call_id)
}

// ---------------------------------------------------------------------------------------------
// Test 1: thirty runs, two replicas, kill -9 one of them.

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Text,
    Tools,
    Send,
}

#[derive(Clone, Debug)]
struct Spec {
    index: usize,
    kind: Kind,
    user: String,
    prompt: String,
    subject: Option<String>,
    request_id: String,
    replica: usize,
    approve: bool,
    approve_on: usize,
}

#[derive(Default, Debug)]
struct Outcome {
    run_id: Option<String>,
    thread_id: Option<String>,
    /// The last terminal event seen (after the approval segment when approved).
    terminal: Option<pb::RunEvent>,
    paused: bool,
    approved: bool,
    notes: Vec<String>,
}

struct Shared {
    addrs: Vec<std::net::SocketAddr>,
    dead: Vec<AtomicBool>,
    events: AtomicUsize,
    finished: AtomicUsize,
    progress: Notify,
    deadline: Instant,
}

impl Shared {
    /// `wanted` if it is alive, else a live replica.
    fn alive(&self, wanted: usize) -> usize {
        if !self.dead[wanted].load(Ordering::SeqCst) {
            return wanted;
        }
        (0..self.addrs.len())
            .find(|i| !self.dead[*i].load(Ordering::SeqCst))
            .unwrap_or(wanted)
    }

    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    fn saw_event(&self) {
        self.events.fetch_add(1, Ordering::SeqCst);
        self.progress.notify_waiters();
    }
}

/// Reads a RunStream / WatchRun stream into `out` until a terminal event; the error if it broke.
async fn read_stream<S, R>(
    mut stream: S,
    shared: &Shared,
    out: &mut Outcome,
    last_seq: &mut u64,
    event_of: impl Fn(R) -> Option<pb::RunEvent>,
) -> Result<pb::RunEvent, String>
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
                shared.saw_event();
                out.run_id.get_or_insert_with(|| event.run_id.clone());
                out.thread_id.get_or_insert_with(|| event.thread_id.clone());
                *last_seq = (*last_seq).max(event.seq);
                if is_terminal(&event) {
                    return Ok(event);
                }
            }
            Some(Err(e)) => return Err(format!("stream broke: {:?} {}", e.code(), e.message())),
            None => return Err("stream ended without a terminal event".into()),
        }
    }
}

/// Follows one run to its end from wherever it can: RunStream on its replica, then WatchRun
/// on a live one after the last seq seen; approves when planned.
async fn drive(spec: Spec, shared: Arc<Shared>) -> Outcome {
    let mut out = Outcome::default();
    let mut last_seq = 0u64;
    let input = pb::RunInput {
        prompt: spec.prompt.clone(),
        request_id: spec.request_id.clone(),
        ..Default::default()
    };
    let mut terminal = None;
    // Start it; a replica that dies first is replaced by the survivor, with the same request
    // id so a run it already created is found, not duplicated.
    for attempt in 0..4 {
        if shared.left().is_zero() {
            break;
        }
        let replica = shared.alive(if attempt == 0 {
            spec.replica
        } else {
            1 - spec.replica
        });
        let mut client = agent_as(shared.addrs[replica], &spec.user).await;
        if out.run_id.is_none() {
            match client
                .run_stream(pb::RunStreamRequest {
                    input: Some(input.clone()),
                })
                .await
            {
                Ok(stream) => {
                    match read_stream(
                        stream.into_inner(),
                        &shared,
                        &mut out,
                        &mut last_seq,
                        |r: pb::RunStreamResponse| r.event,
                    )
                    .await
                    {
                        Ok(t) => {
                            terminal = Some(t);
                            break;
                        }
                        Err(e) => out
                            .notes
                            .push(format!("RunStream on replica {replica}: {e}")),
                    }
                }
                Err(e) => out.notes.push(format!(
                    "RunStream refused by replica {replica}: {:?} {}",
                    e.code(),
                    e.message()
                )),
            }
        } else {
            let run_id = out.run_id.clone().unwrap_or_default();
            match client
                .watch_run(pb::WatchRunRequest {
                    run_id,
                    after_seq: last_seq,
                })
                .await
            {
                Ok(stream) => {
                    match read_stream(
                        stream.into_inner(),
                        &shared,
                        &mut out,
                        &mut last_seq,
                        |r: pb::WatchRunResponse| r.event,
                    )
                    .await
                    {
                        Ok(t) => {
                            terminal = Some(t);
                            break;
                        }
                        Err(e) => out
                            .notes
                            .push(format!("WatchRun on replica {replica}: {e}")),
                    }
                }
                Err(e) => out.notes.push(format!(
                    "WatchRun refused by replica {replica}: {:?} {}",
                    e.code(),
                    e.message()
                )),
            }
        }
    }
    let Some(first_end) = terminal else {
        shared.finished.fetch_add(1, Ordering::SeqCst);
        shared.progress.notify_waiters();
        return out;
    };
    out.paused = terminal_state(&first_end) == pb::RunState::AwaitingConfirmation as i32;
    out.terminal = Some(first_end.clone());
    let approval_id = match &first_end.kind {
        Some(pb::run_event::Kind::Result(r)) => r.approval.as_ref().map(|a| a.id.clone()),
        _ => None,
    };
    if out.paused
        && spec.approve
        && let Some(approval_id) = approval_id
    {
        // Decide on the planned replica (the survivor if it died); a decision lost with its
        // replica is repeated on the survivor, where it is idempotent.
        for attempt in 0..3 {
            let replica = shared.alive(if attempt == 0 {
                spec.approve_on
            } else {
                1 - spec.approve_on
            });
            let mut client = agent_as(shared.addrs[replica], &spec.user).await;
            match tokio::time::timeout(shared.left(), client.decide_approval(approve(&approval_id)))
                .await
            {
                Ok(Ok(_)) => {
                    out.approved = true;
                    break;
                }
                Ok(Err(e)) => out.notes.push(format!(
                    "DecideApproval on replica {replica}: {:?} {}",
                    e.code(),
                    e.message()
                )),
                Err(_) => {
                    out.notes
                        .push("DecideApproval did not answer in time".into());
                    break;
                }
            }
        }
        if out.approved {
            // The continuation's terminal event: follow after the pause's seq on a live replica.
            let after = first_end.seq;
            let mut ended = None;
            for attempt in 0..3 {
                let replica = shared.alive(if attempt == 0 {
                    spec.approve_on
                } else {
                    1 - spec.approve_on
                });
                let mut client = agent_as(shared.addrs[replica], &spec.user).await;
                let run_id = out.run_id.clone().unwrap_or_default();
                let f = follow(&mut client, &run_id, after, shared.left()).await;
                for _ in &f.events {
                    shared.saw_event();
                }
                if let Some(t) = f.terminal {
                    ended = Some(t);
                    break;
                }
                out.notes.push(format!(
                    "after approval on replica {replica}: {}",
                    f.error.unwrap_or_default()
                ));
                if shared.left().is_zero() {
                    break;
                }
            }
            match ended {
                Some(t) => out.terminal = Some(t),
                None => {
                    out.notes
                        .push("no terminal event after the approval".into());
                    out.terminal = None;
                }
            }
        }
    }
    shared.finished.fetch_add(1, Ordering::SeqCst);
    shared.progress.notify_waiters();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_runs_across_two_replicas_survive_kill_9_of_one_replica() {
    let seed = seed();
    println!("seed = {seed} (replay with STEWARD_FAULT_SEED={seed})");
    let mut rng = Rng(seed);
    let mut cluster = Cluster::start(ClusterOptions {
        agents: 2,
        model: RuleOptions {
            delay: Some((Duration::from_millis(50), Duration::from_millis(300))),
            delta_pause: Duration::from_millis(5),
            seed,
            ..RuleOptions::default()
        },
        // The dead replica's runs count as live until the monitor ends them; this test is about
        // failover, so the per-user cap on live runs (new with the redesign) is lifted.
        agent_env: [
            fast_failover_env(),
            vec![("AGENT_MAX_ACTIVE_RUNS_PER_USER".into(), "64".into())],
        ]
        .concat(),
        ..ClusterOptions::default()
    })
    .await;
    let users = ["alice", "bob", "carol"];
    for user in users {
        cluster.connect_gmail(user, &format!("tok-{user}")).await;
    }
    let tag = format!("{:08x}", seed as u32);
    let specs: Vec<Spec> = (0..30)
        .map(|i| {
            let kind = [Kind::Text, Kind::Tools, Kind::Send][i % 3];
            let subject = (kind == Kind::Send).then(|| format!("S-{tag}-{i}"));
            let prompt = match kind {
                Kind::Text => format!("hello number {i} ({tag})"),
                Kind::Tools => format!("check my tasks x2 #{i} ({tag})"),
                Kind::Send => format!("send subject: {}", subject.clone().unwrap_or_default()),
            };
            Spec {
                index: i,
                kind,
                user: users[(i / 3) % 3].to_owned(),
                prompt,
                subject,
                request_id: format!("req-{tag}-{i}"),
                replica: i % 2,
                approve: kind == Kind::Send && rng.below(3) != 0,
                approve_on: rng.below(2) as usize,
            }
        })
        .collect();
    // Roughly 25 events per run: the kill lands somewhere in the first half of the work.
    let kill_after = 10 + rng.below(300) as usize;
    let victim = rng.below(2) as usize;
    let survivor = 1 - victim;
    println!("kill -9 replica {victim} after {kill_after} events");

    let shared = Arc::new(Shared {
        addrs: cluster.agents.iter().map(|a| a.addr).collect(),
        dead: (0..2).map(|_| AtomicBool::new(false)).collect(),
        events: AtomicUsize::new(0),
        finished: AtomicUsize::new(0),
        progress: Notify::new(),
        deadline: Instant::now() + Duration::from_secs(35),
    });
    // At most 8 runs at a time, so some start before the kill and some after.
    let gate = Arc::new(tokio::sync::Semaphore::new(8));
    let mut tasks = Vec::new();
    for spec in specs.clone() {
        let shared = shared.clone();
        let gate = gate.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await.expect("the gate stays open");
            drive(spec, shared).await
        }));
    }

    // The kill, on progress events (no sleeping).
    loop {
        let progressed = shared.progress.notified();
        tokio::pin!(progressed);
        progressed.as_mut().enable();
        if shared.events.load(Ordering::SeqCst) >= kill_after
            || shared.finished.load(Ordering::SeqCst) == specs.len()
        {
            break;
        }
        if tokio::time::timeout(shared.left(), progressed)
            .await
            .is_err()
        {
            break;
        }
    }
    let at = shared.events.load(Ordering::SeqCst);
    shared.dead[victim].store(true, Ordering::SeqCst);
    let victim_pid = cluster.agents[victim].pid;
    cluster.kill_agent(victim);
    println!(
        "killed replica {victim} (pid {victim_pid}) after {at} events, {} runs finished",
        shared.finished.load(Ordering::SeqCst)
    );

    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.expect("a driver task"));
    }

    let mut f = Failures::default();
    let mut threads: Vec<(usize, String, String)> = Vec::new();
    for (spec, out) in specs.iter().zip(&outcomes) {
        let label = format!(
            "run #{} ({:?}, user {}, replica {}{})",
            spec.index,
            spec.kind,
            spec.user,
            spec.replica,
            if spec.approve {
                format!(", approve on {}", spec.approve_on)
            } else {
                String::new()
            }
        );
        println!(
            "{label}: run {:?} terminal {:?} notes {:?}",
            out.run_id,
            out.terminal.as_ref().map(describe),
            out.notes
        );
        let Some(run_id) = &out.run_id else {
            f.fail(format!("{label}: never started: {:?}", out.notes));
            continue;
        };
        f.check(out.terminal.is_some(), || {
            format!(
                "{label} {run_id}: no terminal event reached the client: {:?}",
                out.notes
            )
        });
        let mut client = cluster.agent(survivor, &spec.user).await;
        match get_run(&mut client, run_id).await {
            Ok(got) => {
                let run = got.run.unwrap_or_default();
                let paused_ok = spec.kind == Kind::Send && !out.approved;
                let allowed = [
                    pb::RunState::Completed as i32,
                    pb::RunState::Failed as i32,
                    pb::RunState::Cancelled as i32,
                ];
                f.check(
                    allowed.contains(&run.state)
                        || (paused_ok && run.state == pb::RunState::AwaitingConfirmation as i32),
                    || {
                        format!(
                            "{label} {run_id}: left {} (error {:?})",
                            state_name(run.state),
                            run.error
                        )
                    },
                );
                if let Some(t) = &out.terminal {
                    f.check(run.last_event_seq == t.seq, || {
                        format!(
                            "{label} {run_id}: events after the terminal one ({}): last_event_seq {}",
                            describe(t),
                            run.last_event_seq
                        )
                    });
                    f.check(terminal_state(t) == run.state, || {
                        format!(
                            "{label} {run_id}: terminal event says {} but GetRun says {}",
                            state_name(terminal_state(t)),
                            state_name(run.state)
                        )
                    });
                }
            }
            Err(e) => f.fail(format!("{label}: {e}")),
        }
        let thread_id = out.thread_id.clone().unwrap_or_default();
        match messages(&mut client, &thread_id).await {
            Ok(list) => f.check(
                list.iter().any(|m| {
                    m.source == pb::MessageSource::User as i32 && m.content == spec.prompt
                }),
                || format!("{label}: the user's prompt is missing from thread {thread_id}"),
            ),
            Err(e) => f.fail(format!("{label}: {e}")),
        }
        threads.push((spec.index, spec.user.clone(), thread_id));
    }

    // No email twice; approved sends that completed sent once.
    let mut per_subject: HashMap<String, usize> = HashMap::new();
    for spec in specs.iter().filter(|s| s.kind == Kind::Send) {
        let subject = spec.subject.clone().unwrap_or_default();
        per_subject.insert(subject.clone(), sends_with_subject(&cluster, &subject));
    }
    for (spec, out) in specs.iter().zip(&outcomes) {
        let Some(subject) = &spec.subject else {
            continue;
        };
        let n = per_subject[subject];
        f.check(n <= 1, || {
            format!("run #{}: {n} emails with subject {subject}", spec.index)
        });
        let completed = out
            .terminal
            .as_ref()
            .is_some_and(|t| out.approved && terminal_state(t) == pb::RunState::Completed as i32);
        f.check(!completed || n == 1, || {
            format!(
                "run #{}: approved and completed but {n} emails with subject {subject}",
                spec.index
            )
        });
        f.check(out.approved || n == 0, || {
            format!("run #{}: never approved but {n} emails sent", spec.index)
        });
    }

    // Every thread takes a new run on the survivor (six at a time).
    let mut seen = HashSet::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(6));
    let mut next_runs = Vec::new();
    for (index, user, thread_id) in threads {
        if !seen.insert(thread_id.clone()) {
            continue;
        }
        let addr = cluster.agents[survivor].addr;
        let gate = gate.clone();
        next_runs.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await.expect("the gate stays open");
            let mut client = agent_as(addr, &user).await;
            let next = tokio::time::timeout(
                TERMINAL_BOUND,
                run_once(&mut client, &format!("hello again {index}"), &thread_id),
            )
            .await;
            (index, thread_id, next)
        }));
    }
    for task in next_runs {
        let (index, thread_id, next) = task.await.expect("a new-run task");
        match next {
            Ok(Ok(r)) => f.check(r.status == pb::RunState::Completed as i32, || {
                format!(
                    "run #{index}: a new run on thread {thread_id} ended {} ({:?})",
                    state_name(r.status),
                    r.error
                )
            }),
            Ok(Err(e)) => f.fail(format!(
                "run #{index}: thread {thread_id} refused a new run: {:?} {}",
                e.code(),
                e.message()
            )),
            Err(_) => f.fail(format!(
                "run #{index}: a new run on thread {thread_id} did not end within {TERMINAL_BOUND:?}"
            )),
        }
    }
    f.finish(&cluster);
}

// ---------------------------------------------------------------------------------------------
// Test 2: eight concurrent approvals, one continuation.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_approves_on_two_replicas_continue_the_run_exactly_once() {
    let cluster = Cluster::start(ClusterOptions {
        agents: 2,
        agent_env: fast_failover_env(),
        ..ClusterOptions::default()
    })
    .await;
    cluster.connect_gmail("dora", "tok-dora").await;
    let subject = format!("Eight-{}", uuid::Uuid::new_v4().simple());
    let (paused, paused_seq, call_id) =
        paused_send(&cluster, 0, "dora", &format!("send subject: {subject}")).await;
    let approval = paused.approval.clone().expect("an approval");
    assert_eq!(cluster.model.requests_answering(&call_id), 0);

    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut callers = Vec::new();
    for k in 0..8 {
        let addr = cluster.agents[k % 2].addr;
        let barrier = barrier.clone();
        let id = approval.id.clone();
        callers.push(tokio::spawn(async move {
            let mut client = agent_as(addr, "dora").await;
            barrier.wait().await;
            tokio::time::timeout(TERMINAL_BOUND, client.decide_approval(approve(&id))).await
        }));
    }
    let mut f = Failures::default();
    let mut finals = Vec::new();
    for (k, caller) in callers.into_iter().enumerate() {
        let replica = k % 2;
        match caller.await.expect("a caller task") {
            Err(_) => f.fail(format!(
                "caller {k} (replica {replica}): no answer within {TERMINAL_BOUND:?}"
            )),
            Ok(Err(e)) => f.fail(format!(
                "caller {k} (replica {replica}): {:?} {}",
                e.code(),
                e.message()
            )),
            Ok(Ok(resp)) => {
                let resp = resp.into_inner();
                f.check(
                    resp.approval.as_ref().map(|a| a.state)
                        == Some(pb::ApprovalState::Approved as i32),
                    || {
                        format!(
                            "caller {k}: approval state {:?}",
                            resp.approval.map(|a| a.state)
                        )
                    },
                );
                let status = resp.result.as_ref().map_or(0, |r| r.status);
                let terminal = [
                    pb::RunState::Completed as i32,
                    pb::RunState::Failed as i32,
                    pb::RunState::Cancelled as i32,
                ];
                let status = if terminal.contains(&status) {
                    status
                } else {
                    // A caller that did not win got the run as it stood: wait for its end.
                    let mut client = cluster.agent(replica, "dora").await;
                    let followed =
                        follow(&mut client, &paused.run_id, paused_seq, TERMINAL_BOUND).await;
                    followed.terminal.as_ref().map_or(0, terminal_state)
                };
                finals.push((k, status));
            }
        }
    }
    for (k, status) in &finals {
        f.check(*status == pb::RunState::Completed as i32, || {
            format!("caller {k} reports the run {}", state_name(*status))
        });
    }

    let mut client = cluster.agent(1, "dora").await;
    let after = follow(&mut client, &paused.run_id, paused_seq, TERMINAL_BOUND).await;
    match &after.terminal {
        None => f.fail(format!(
            "no terminal event after the approval: {:?}",
            after.error
        )),
        Some(t) => {
            let run = get_run(&mut client, &paused.run_id)
                .await
                .map(|r| r.run.unwrap_or_default());
            match run {
                Ok(run) => {
                    f.check(run.last_event_seq == t.seq, || {
                        format!(
                            "more than one continuation: events after the first terminal one ({}) up to seq {}",
                            describe(t),
                            run.last_event_seq
                        )
                    });
                    f.check(run.state == pb::RunState::Completed as i32, || {
                        format!("the run ended {} ({:?})", state_name(run.state), run.error)
                    });
                }
                Err(e) => f.fail(e),
            }
        }
    }
    let results = after
        .events
        .iter()
        .filter(
            |e| matches!(&e.kind, Some(pb::run_event::Kind::ToolResult(r)) if r.call_id == call_id),
        )
        .count();
    f.check(results == 1, || {
        format!("{results} tool results for the approved call after the approval")
    });
    let continuations = cluster.model.requests_answering(&call_id);
    f.check(continuations == 1, || {
        format!("the model was asked {continuations} times with the approved call's result")
    });
    match messages(&mut client, &paused.thread_id).await {
        Ok(list) => {
            let errors: Vec<_> = list
                .iter()
                .filter(|m| m.source == pb::MessageSource::Error as i32)
                .map(|m| m.content.clone())
                .collect();
            f.check(errors.is_empty(), || format!("ERROR messages: {errors:?}"));
        }
        Err(e) => f.fail(e),
    }
    let sent = sends_with_subject(&cluster, &subject);
    f.check(sent == 1, || format!("{sent} emails sent"));
    f.finish(&cluster);
}

// ---------------------------------------------------------------------------------------------
// Test 3: approvals and time limits, approvals and cancellation.

/// Stand-in for a configurable channel time limit: moves the run's start back past the web
/// channel's 60 s limit, as if the user had decided much later. Direct SQL because no setting
/// or API shortens the limit (see the report).
async fn age_run(cluster: &Cluster, run_id: &str) -> Result<u64, String> {
    cluster
        .sql()
        .await
        .execute(
            "UPDATE agent.runs SET created_at = created_at - interval '10 minutes', \
             started_at = started_at - interval '10 minutes' WHERE id = $1",
            &[&run_id],
        )
        .await
        .map_err(|e| format!("could not age the run in SQL: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_approval_decided_after_the_time_limit_on_the_other_replica_completes_normally() {
    let cluster = Cluster::start(ClusterOptions {
        agents: 2,
        agent_env: fast_failover_env(),
        ..ClusterOptions::default()
    })
    .await;
    cluster.connect_gmail("erin", "tok-erin").await;
    // Every answer to a `slow` prompt takes 1.5 s: three sweeps of each replica's monitor
    // happen while the continuation works.
    let subject = format!("Late-{}", uuid::Uuid::new_v4().simple());
    let (paused, paused_seq, _call) = paused_send(
        &cluster,
        0,
        "erin",
        &format!("slow send subject: {subject}"),
    )
    .await;
    let approval = paused.approval.clone().expect("an approval");
    let mut f = Failures::default();
    match age_run(&cluster, &paused.run_id).await {
        Ok(1) => {}
        Ok(n) => f.fail(format!("aging the run updated {n} rows")),
        Err(e) => f.fail(e),
    }

    let mut other = cluster.agent(1, "erin").await;
    match tokio::time::timeout(TERMINAL_BOUND, other.decide_approval(approve(&approval.id))).await {
        Err(_) => f.fail(format!(
            "DecideApproval did not answer within {TERMINAL_BOUND:?}"
        )),
        Ok(Err(e)) => f.fail(format!(
            "DecideApproval on the other replica: {:?} {}",
            e.code(),
            e.message()
        )),
        Ok(Ok(resp)) => {
            let result = resp.into_inner().result.unwrap_or_default();
            f.check(result.status == pb::RunState::Completed as i32, || {
                format!(
                    "the approved run ended {}: {:?}",
                    state_name(result.status),
                    result.error
                )
            });
        }
    }
    let after = follow(&mut other, &paused.run_id, paused_seq, TERMINAL_BOUND).await;
    match &after.terminal {
        None => f.fail(format!(
            "no terminal event after the approval: {:?}",
            after.error
        )),
        Some(t) => {
            f.check(terminal_state(t) == pb::RunState::Completed as i32, || {
                format!(
                    "the first terminal event after the approval is {}",
                    describe(t)
                )
            });
            if let Ok(r) = get_run(&mut other, &paused.run_id).await {
                let run = r.run.unwrap_or_default();
                f.check(run.last_event_seq == t.seq, || {
                    format!(
                        "events after the terminal one ({}): last_event_seq {}",
                        describe(t),
                        run.last_event_seq
                    )
                });
                f.check(run.state == pb::RunState::Completed as i32, || {
                    format!("GetRun says {} ({:?})", state_name(run.state), run.error)
                });
            }
        }
    }
    if let Ok(list) = messages(&mut other, &paused.thread_id).await {
        let errors: Vec<_> = list
            .iter()
            .filter(|m| m.source == pb::MessageSource::Error as i32)
            .map(|m| m.content.clone())
            .collect();
        f.check(errors.is_empty(), || format!("ERROR messages: {errors:?}"));
    }
    let sent = sends_with_subject(&cluster, &subject);
    f.check(sent == 1, || format!("{sent} emails sent"));
    f.finish(&cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_run_during_an_approval_wait_ends_the_run_and_a_later_approve_is_refused() {
    let cluster = Cluster::start(ClusterOptions {
        agents: 2,
        agent_env: fast_failover_env(),
        ..ClusterOptions::default()
    })
    .await;
    cluster.connect_gmail("finn", "tok-finn").await;
    let subject = format!("Cancel-{}", uuid::Uuid::new_v4().simple());
    let (paused, paused_seq, _call) =
        paused_send(&cluster, 0, "finn", &format!("send subject: {subject}")).await;
    let approval = paused.approval.clone().expect("an approval");
    let mut f = Failures::default();

    let mut other = cluster.agent(1, "finn").await;
    if let Err(e) = other
        .cancel_run(pb::CancelRunRequest {
            run_id: paused.run_id.clone(),
            reason: "changed my mind".into(),
        })
        .await
    {
        f.fail(format!("CancelRun: {:?} {}", e.code(), e.message()));
    }
    let mut first = cluster.agent(0, "finn").await;
    let after = follow(
        &mut first,
        &paused.run_id,
        paused_seq,
        Duration::from_secs(10),
    )
    .await;
    match &after.terminal {
        None => f.fail(format!(
            "no terminal event after CancelRun of a run awaiting approval: {:?}",
            after.error
        )),
        Some(t) => f.check(terminal_state(t) == pb::RunState::Cancelled as i32, || {
            format!("the terminal event after CancelRun is {}", describe(t))
        }),
    }
    if let Ok(r) = get_run(&mut first, &paused.run_id).await {
        let run = r.run.unwrap_or_default();
        f.check(run.state == pb::RunState::Cancelled as i32, || {
            format!("GetRun after CancelRun says {}", state_name(run.state))
        });
    }
    match other.decide_approval(approve(&approval.id)).await {
        Err(e) => f.check(e.code() == Code::FailedPrecondition, || {
            format!(
                "approve after CancelRun: {:?} {} (want FAILED_PRECONDITION)",
                e.code(),
                e.message()
            )
        }),
        Ok(resp) => f.fail(format!(
            "approve after CancelRun was accepted: {:?}",
            resp.into_inner()
                .result
                .map(|r| (state_name(r.status), r.summary))
        )),
    }
    // Whatever the approve did, nothing may be sent for a cancelled run; its continuation (if
    // any) ends on the stream.
    let _ = follow(
        &mut first,
        &paused.run_id,
        paused_seq,
        Duration::from_secs(5),
    )
    .await;
    let sent = sends_with_subject(&cluster, &subject);
    f.check(sent == 0, || {
        format!("{sent} emails sent for a cancelled run")
    });
    f.finish(&cluster);
}

// ---------------------------------------------------------------------------------------------
// Test 4: the gateway dies mid tool call.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_killed_mid_tool_call_ends_the_run_and_the_thread_works_after_a_restart() {
    let mut cluster = Cluster::start(ClusterOptions {
        agents: 1,
        agent_env: fast_failover_env(),
        ..ClusterOptions::default()
    })
    .await;
    cluster.connect_gmail("gus", "tok-gus").await;
    // Gmail never answers this account: the search stays in flight until the gateway dies.
    cluster.gmail.hang("tok-gus");
    let mut f = Failures::default();
    let mut client = cluster.agent(0, "gus").await;
    let mut stream = client
        .run_stream(pb::RunStreamRequest {
            input: Some(pb::RunInput {
                prompt: "search my mail for the budget".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("RunStream starts")
        .into_inner();
    let mut run_id = String::new();
    let mut thread_id = String::new();
    let mut killed = false;
    let mut events = Vec::new();
    let mut terminal = None;
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(item) = stream.next().await {
            let Some(event) = item.map_err(|e| format!("{:?} {}", e.code(), e.message()))?.event
            else {
                continue;
            };
            run_id.clone_from(&event.run_id);
            thread_id.clone_from(&event.thread_id);
            events.push(event.clone());
            if !killed
                && matches!(&event.kind, Some(pb::run_event::Kind::ToolCall(c)) if c.tool == "search_gmail")
            {
                cluster.kill_gateway();
                killed = true;
            }
            if is_terminal(&event) {
                terminal = Some(event);
                return Ok(());
            }
        }
        Err("RunStream ended without a terminal event".to_owned())
    })
    .await;
    assert!(killed, "the run never called search_gmail: {events:?}");
    match read {
        Err(_) => f.fail("no terminal event within 30 s of the gateway's death".into()),
        Ok(Err(e)) => f.fail(format!("RunStream: {e}")),
        Ok(Ok(())) => {}
    }
    if let Some(t) = &terminal {
        let clear = match &t.kind {
            Some(pb::run_event::Kind::Error(e)) => !e.message.is_empty(),
            Some(pb::run_event::Kind::Result(r)) => {
                [pb::RunState::Completed as i32, pb::RunState::Failed as i32].contains(&r.status)
                    && !r.summary.is_empty()
            }
            _ => false,
        };
        f.check(clear, || {
            format!("the terminal event is not clear: {}", describe(t))
        });
        println!("terminal after the gateway died: {}", describe(t));
    }
    for e in &events {
        if let Some(pb::run_event::Kind::ToolResult(r)) = &e.kind
            && r.tool == "search_gmail"
        {
            f.check(!r.ok, || {
                format!("the interrupted search reported ok: {r:?}")
            });
            println!("tool result of the interrupted search: {r:?}");
        }
    }
    if !run_id.is_empty() {
        match get_run(&mut client, &run_id).await {
            Ok(r) => {
                let run = r.run.unwrap_or_default();
                f.check(
                    [
                        pb::RunState::Completed as i32,
                        pb::RunState::Failed as i32,
                        pb::RunState::Cancelled as i32,
                    ]
                    .contains(&run.state),
                    || format!("the run is left {}", state_name(run.state)),
                );
            }
            Err(e) => f.fail(e),
        }
    }

    cluster.restart_gateway().await;
    let next = tokio::time::timeout(
        TERMINAL_BOUND,
        run_once(&mut client, "hello again after the outage", &thread_id),
    )
    .await;
    match next {
        Ok(Ok(r)) => f.check(r.status == pb::RunState::Completed as i32, || {
            format!(
                "the run after the restart ended {} ({:?})",
                state_name(r.status),
                r.error
            )
        }),
        Ok(Err(e)) => f.fail(format!(
            "the thread refused a run after the gateway restart: {:?} {}",
            e.code(),
            e.message()
        )),
        Err(_) => f.fail(format!(
            "the run after the gateway restart did not end within {TERMINAL_BOUND:?}"
        )),
    }
    f.finish(&cluster);
}
