//! Gateway benchmarks (Q-2), a harness rather than timed tests:
//! - overhead per tool call over the Execute stream, for a tool with no upstream, with the
//!   in-memory store and with PostgreSQL (where each call also writes its audit record);
//! - rate-limiter decisions per second for both backends;
//! - a memory search on PostgreSQL (the lookup every run's prompt makes) for a user with many
//!   notes, none holding the query's words whole, so the search falls back to prefixes.
//!
//! Run: `cargo bench -p steward-tests --bench gateway` (needs the test PostgreSQL).

/// The services run in this process: they allocate with jemalloc here as their binaries do.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use gateway_svc::{
    domain::{Integration, UserId},
    ratelimit::{LimitKey, Limits, RateLimitBackend, memory::MemoryRateLimits},
    store::postgres::PgStore,
};
use steward_proto::gateway::v1::{self as pb, tool_call::Arguments};
use steward_tests::{Backend, Options, TestDb, bench::percentile, probe_tools, spawn::spawn};
use svc_kit::{pg::PoolOptions, server_config::DatabaseConfig};
use tokio_stream::StreamExt;

const CALLS: usize = 3000;
const WARMUP: usize = 300;

async fn stream_overhead(backend: Backend, label: &str) {
    let app = spawn(Options {
        backend: Some(backend),
        env: vec![],
        gateway_tools: probe_tools::all("http://127.0.0.1:9"),
    })
    .await;
    let mut g = app.gateway_as("bench-user").await;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let mut results = g
        .execute(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut samples = Vec::with_capacity(CALLS);
    for i in 0..(WARMUP + CALLS) {
        let call = pb::ToolCall {
            call_id: format!("c{i}"),
            tool: "probe_echo".into(),
            arguments: Some(Arguments::ArgsJson(r#"{"text":"hello"}"#.into())),
            ..Default::default()
        };
        let started = Instant::now();
        tx.send(pb::ExecuteRequest {
            kind: Some(pb::execute_request::Kind::Call(call)),
        })
        .await
        .unwrap();
        let result = results.next().await.unwrap().unwrap().result.unwrap();
        let elapsed = started.elapsed();
        assert!(result.ok);
        if i >= WARMUP {
            samples.push(elapsed);
        }
    }
    samples.sort();
    println!(
        "gateway call over Execute stream ({label}): n={CALLS} p50={:?} p99={:?} max={:?}",
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
    let p50 = percentile(&samples, 0.50).as_secs_f64() * 1e6;
    let target = if matches!(backend, Backend::Postgres) {
        "≤ 400 µs"
    } else {
        ""
    };
    steward_tests::bench::summary(
        &format!("gateway call p50 ({label})"),
        &format!("{p50:.0} µs"),
        target,
    );
}

async fn limiter_throughput(
    backend: Arc<dyn RateLimitBackend>,
    label: &str,
    tasks: usize,
    per_task: usize,
) {
    let limits: Limits = "1000000000/minute,1000000000/hour,1000000000/day"
        .parse()
        .unwrap();
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let backend = backend.clone();
            let limits = limits.clone();
            tokio::spawn(async move {
                // A key per task (users are independent), as in production.
                let key = LimitKey {
                    user: UserId::parse(&format!("u{t}")).unwrap(),
                    integration: Integration::Gmail,
                    account: "a@x.com".into(),
                };
                for _ in 0..per_task {
                    backend
                        .charge(&key, &limits, 1, gateway_svc::ratelimit::unix_now())
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    let total = tasks * per_task;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "rate limiter ({label}, {tasks} concurrent keys): {total} decisions in {secs:.2}s = {:.0}/s",
        total as f64 / secs
    );
}

/// Notes of the one user searched.
const NOTES: usize = 20_000;
const SEARCHES: usize = 200;

/// p50 of a memory search for a user with `NOTES` notes: one whose words no note holds whole
/// ("zeb": the prefix pass runs), one that a few notes match, and one that every note matches
/// (each match is ranked).
async fn memory_search(stores: &gateway_svc::store::Stores) {
    let heavy = UserId::parse("heavy-user").unwrap();
    for chunk in 0..NOTES / 1000 {
        let notes: Vec<(String, Vec<String>)> = (0..1000)
            .map(|i| {
                let n = chunk * 1000 + i;
                // One note in a thousand mentions the dentist.
                let what = if n % 1000 == 0 {
                    "dentist appointment"
                } else {
                    "budget review"
                };
                (
                    format!("Note {n}: the quarterly {what} with the platform team, room {n}"),
                    vec!["work".to_owned()],
                )
            })
            .collect();
        stores
            .notes
            .add_notes(&heavy, &notes, "bench")
            .await
            .unwrap();
    }
    for (query, label) in [
        ("zeb", "nothing whole, so the prefix pass"),
        ("dentist", "20 notes match"),
        ("quarterly", "every note matches"),
    ] {
        let mut samples = Vec::with_capacity(SEARCHES);
        for _ in 0..SEARCHES {
            let started = Instant::now();
            let found = stores.notes.search_notes(&heavy, query, 5).await.unwrap();
            samples.push(started.elapsed());
            assert_eq!(found.is_empty(), query == "zeb", "{query}");
        }
        samples.sort();
        let p50 = percentile(&samples, 0.5).as_secs_f64() * 1e3;
        println!(
            "memory search on PostgreSQL, a user with {NOTES} notes ({label}): p50 {p50:.2} ms"
        );
    }
}

#[tokio::main]
async fn main() {
    stream_overhead(Backend::Memory, "in-memory store").await;
    stream_overhead(Backend::Postgres, "PostgreSQL store, audit row per call").await;

    limiter_throughput(
        Arc::new(MemoryRateLimits::default()),
        "in-process",
        8,
        100_000,
    )
    .await;
    let db = TestDb::create().await.unwrap();
    let config = DatabaseConfig {
        url: db.url().to_owned(),
        pool: PoolOptions {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            ..PoolOptions::default()
        },
    };
    let stores = PgStore::connect(&config).await.unwrap().stores();
    limiter_throughput(
        stores.shared_rate_limits.clone().unwrap(),
        "PostgreSQL",
        8,
        1000,
    )
    .await;
    memory_search(&stores).await;
}
