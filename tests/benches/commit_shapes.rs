//! What PostgreSQL spends per run-commit for four shapes of a commit (issue 13, Q-2), sent as
//! agent-svc sends statements: tokio-postgres, pipelined, one Sync (and so one flush from the
//! server) per statement. Each run-commit is the lease fence (`UPDATE agent.threads`), one event
//! (`INSERT INTO agent.run_events`) and the run's patch (`UPDATE agent.runs`) on agent-svc's
//! real schema:
//! - `per-run`: a transaction per run, BEGIN, three statements, COMMIT (agent-svc until the
//!   sixth session of 2026-11-25);
//! - `one-statement`: a run's commit as one statement of data-modifying CTEs, no BEGIN/COMMIT
//!   (agent-svc's lone commit now);
//! - `batch, per run`: four runs in one transaction, three statements per run;
//! - `batch, per table`: four runs in one transaction, one statement per table for all four
//!   (agent-svc's group commit now writes every table of a batch in one statement).
//!
//! The server's CPU is read as the postmaster's reaped children's time (`/proc`), so the
//! database must run on this machine and be otherwise idle; shapes alternate over the rounds
//! and the table gives medians. This is not a model of a whole run: it measures what the next
//! cut of the first PostgreSQL wave (commits batched across runs) would save.
//!
//! Run: `cargo bench -p steward-tests --bench commit_shapes` (needs the test PostgreSQL).
//! `BENCH_ROUNDS` (default 3) rounds, `COMMIT_SHAPE_BATCHES` (default 1,500) batches of four
//! run-commits per shape and round.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use steward_tests::{
    TestDb,
    bench::{clock_ticks, proc_stat},
};
use tokio_postgres::{Client, NoTls, Statement, types::ToSql};

type Param<'a> = &'a (dyn ToSql + Sync);

/// Run-commits per batch.
const K: usize = 4;
/// Threads (and runs) the batches cycle over.
const ROWS: usize = 64;

#[derive(Clone, Copy)]
enum Shape {
    PerRun,
    OneStatement,
    BatchPerRun,
    BatchPerTable,
}

const SHAPES: [Shape; 4] = [
    Shape::PerRun,
    Shape::OneStatement,
    Shape::BatchPerRun,
    Shape::BatchPerTable,
];

impl Shape {
    fn label(self) -> &'static str {
        match self {
            Shape::PerRun => "a transaction per run, 3 statements (agent-svc before group commit)",
            Shape::OneStatement => "a run's commit as one statement",
            Shape::BatchPerRun => "4 runs per transaction, 3 statements per run",
            Shape::BatchPerTable => "4 runs per transaction, 1 statement per table",
        }
    }
}

struct Statements {
    fence: Statement,
    event: Statement,
    patch: Statement,
    fence_many: Statement,
    event_many: Statement,
    patch_many: Statement,
    whole: Statement,
}

impl Statements {
    async fn prepare(c: &Client) -> Result<Self, tokio_postgres::Error> {
        Ok(Self {
            fence: c
                .prepare("UPDATE agent.threads SET updated_at = now() WHERE id = $1")
                .await?,
            event: c
                .prepare(
                    "INSERT INTO agent.run_events (run_id, seq, payload) VALUES ($1, $2, '\\x0a0b')",
                )
                .await?,
            patch: c
                .prepare("UPDATE agent.runs SET iterations = iterations + 1 WHERE id = $1")
                .await?,
            fence_many: c
                .prepare("UPDATE agent.threads SET updated_at = now() WHERE id = ANY($1)")
                .await?,
            event_many: c
                .prepare(
                    "INSERT INTO agent.run_events (run_id, seq, payload) \
                     SELECT r, $2, '\\x0a0b' FROM unnest($1::text[]) AS r",
                )
                .await?,
            patch_many: c
                .prepare("UPDATE agent.runs SET iterations = iterations + 1 WHERE id = ANY($1)")
                .await?,
            whole: c
                .prepare(
                    "WITH f AS (UPDATE agent.threads SET updated_at = now() WHERE id = $1 RETURNING 1), \
                     e AS (INSERT INTO agent.run_events (run_id, seq, payload) VALUES ($2, $3, '\\x0a0b')), \
                     p AS (UPDATE agent.runs SET iterations = iterations + 1 WHERE id = $2) \
                     SELECT count(*) FROM f",
                )
                .await?,
        })
    }
}

/// One batch of `K` run-commits in `shape`, on threads and runs `first..first + K`.
async fn commit(
    c: &Client,
    s: &Statements,
    shape: Shape,
    first: usize,
    seq: i64,
) -> Result<(), tokio_postgres::Error> {
    let threads: Vec<String> = (first..first + K).map(|i| format!("t{i}")).collect();
    let runs: Vec<String> = (first..first + K).map(|i| format!("r{i}")).collect();
    match shape {
        Shape::PerRun => {
            for (t, r) in threads.iter().zip(&runs) {
                let (fence, event, patch): ([Param; 1], [Param; 2], [Param; 1]) =
                    ([t], [r, &seq], [r]);
                let (b, f, e, p, end) = futures_util::join!(
                    c.batch_execute("BEGIN"),
                    c.execute(&s.fence, &fence),
                    c.execute(&s.event, &event),
                    c.execute(&s.patch, &patch),
                    c.batch_execute("COMMIT"),
                );
                for answer in [b, f.map(drop), e.map(drop), p.map(drop), end] {
                    answer?;
                }
            }
        }
        Shape::OneStatement => {
            for (t, r) in threads.iter().zip(&runs) {
                c.query_one(&s.whole, &[t, r, &seq]).await?;
            }
        }
        Shape::BatchPerRun => {
            let params: Vec<([Param; 1], [Param; 2], [Param; 1])> = threads
                .iter()
                .zip(&runs)
                .map(|(t, r)| ([t as Param], [r as Param, &seq], [r as Param]))
                .collect();
            let (b, writes, end) = futures_util::join!(
                c.batch_execute("BEGIN"),
                join_all(params.iter().map(|(fence, event, patch)| async move {
                    let (f, e, p) = futures_util::join!(
                        c.execute(&s.fence, fence),
                        c.execute(&s.event, event),
                        c.execute(&s.patch, patch),
                    );
                    f.and(e).and(p)
                })),
                c.batch_execute("COMMIT"),
            );
            b?;
            writes.into_iter().collect::<Result<Vec<_>, _>>()?;
            end?;
        }
        Shape::BatchPerTable => {
            let (fence, event, patch): ([Param; 1], [Param; 2], [Param; 1]) =
                ([&threads], [&runs, &seq], [&runs]);
            let (b, f, e, p, end) = futures_util::join!(
                c.batch_execute("BEGIN"),
                c.execute(&s.fence_many, &fence),
                c.execute(&s.event_many, &event),
                c.execute(&s.patch_many, &patch),
                c.batch_execute("COMMIT"),
            );
            for answer in [b, f.map(drop), e.map(drop), p.map(drop), end] {
                answer?;
            }
        }
    }
    Ok(())
}

fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

/// CPU time of every PostgreSQL backend that has exited, in clock ticks: the postmaster's
/// cutime and cstime (fields 16 and 17).
fn reaped_children_ticks(postmaster: u32) -> Option<u64> {
    let fields = proc_stat(postmaster)?;
    Some(fields.get(13)?.parse::<u64>().ok()? + fields.get(14)?.parse::<u64>().ok()?)
}

/// Server CPU per run-commit (µs, when readable) and run-commits per second of one pass.
async fn pass(
    url: &str,
    shape: Shape,
    batches: usize,
    seq: &mut i64,
    postmaster: Option<u32>,
    ticks_per_second: f64,
) -> (Option<f64>, f64) {
    let before = postmaster.and_then(reaped_children_ticks);
    let started = Instant::now();
    {
        let (client, connection) = tokio_postgres::connect(url, NoTls)
            .await
            .expect("connect to the bench database");
        let connection = tokio::spawn(connection);
        let statements = Statements::prepare(&client).await.expect("prepare");
        for i in 0..batches {
            *seq += 1;
            commit(&client, &statements, shape, 1 + (i * K) % ROWS, *seq)
                .await
                .expect("a commit");
        }
        drop(client);
        let _ = connection.await;
    }
    let elapsed = started.elapsed();
    // The backend's time is the postmaster's once it has reaped it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = postmaster.and_then(reaped_children_ticks);
    let commits = (batches * K) as f64;
    let cpu = before
        .zip(after)
        .map(|(b, a)| (a - b) as f64 / ticks_per_second * 1e6 / commits);
    (cpu, commits / elapsed.as_secs_f64())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let var = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(default)
    };
    let rounds = var("BENCH_ROUNDS", 3);
    let batches = var("COMMIT_SHAPE_BATCHES", 1500);
    let db = TestDb::create().await.expect("a bench database");
    agent_svc::store::postgres::PgStore::migrate(db.url())
        .await
        .expect("agent-svc's migrations");
    let (client, connection) = tokio_postgres::connect(db.url(), NoTls)
        .await
        .expect("connect to the bench database");
    tokio::spawn(connection);
    client
        .batch_execute(&format!(
            "INSERT INTO agent.threads (id, owner, title) \
               SELECT 't' || i, 'u' || i, 'bench' FROM generate_series(1, {ROWS}) AS i;
             INSERT INTO agent.runs (id, thread_id, owner, state, channel) \
               SELECT 'r' || i, 't' || i, 'u' || i, 'executing', 'api' FROM generate_series(1, {ROWS}) AS i"
        ))
        .await
        .expect("seed threads and runs");
    // The postmaster is the checkpointer's parent; its /proc entry is readable only when the
    // server runs on this machine.
    let checkpointer: Option<i32> = client
        .query_opt(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'",
            &[],
        )
        .await
        .ok()
        .flatten()
        .map(|row| row.get(0));
    // ppid is field 4.
    let postmaster = checkpointer.and_then(|pid| proc_stat(pid as u32)?.get(1)?.parse().ok());
    drop(client);
    if postmaster.is_none() {
        println!(
            "the server's CPU is not readable here (PostgreSQL is not on this machine); throughput only"
        );
    }

    let ticks_per_second = clock_ticks() as f64;
    let mut seq = 0i64;
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); SHAPES.len()];
    let mut rate: Vec<Vec<f64>> = vec![Vec::new(); SHAPES.len()];
    for _ in 0..rounds {
        for (i, shape) in SHAPES.into_iter().enumerate() {
            let (c, r) = pass(
                db.url(),
                shape,
                batches,
                &mut seq,
                postmaster,
                ticks_per_second,
            )
            .await;
            cpu[i].extend(c);
            rate[i].push(r);
        }
    }
    let _ = db.drop_now().await;

    println!(
        "Run-commits (fence, event, patch) on agent-svc's schema, tokio-postgres pipelined, {rounds} rounds of {} per shape; medians",
        batches * K
    );
    println!("| shape | server CPU per run-commit | run-commits/s |");
    println!("|---|---|---|");
    for (i, shape) in SHAPES.into_iter().enumerate() {
        cpu[i].sort_by(f64::total_cmp);
        rate[i].sort_by(f64::total_cmp);
        let server = if cpu[i].is_empty() {
            "–".to_owned()
        } else {
            format!("{:.0} µs", median(&cpu[i]))
        };
        println!("| {} | {server} | {:.0} |", shape.label(), median(&rate[i]));
    }
}
