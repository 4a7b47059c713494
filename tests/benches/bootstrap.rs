//! Bootstrap-context latency (Q-2, I-8): GetBootstrapContext over gRPC for a returning user
//! with tasks, reminders and two Gmail accounts on the fake Gmail, on PostgreSQL, with the
//! per-user cache off (every call gathers all three sources) and on (rapid reconnects).
//!
//! Run: `cargo bench -p steward-tests --bench bootstrap` (needs the test PostgreSQL).

/// The services run in this process: they allocate with jemalloc here as their binaries do.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::time::{Duration, Instant};

use steward_proto::gateway::v1::{self as pb, tool_call::Arguments};
use steward_tests::{Backend, Options, fakes::gmail::FakeGmail, spawn::spawn};

const CALLS: usize = 500;
const WARMUP: usize = 50;

async fn measure(cache_ttl: &str, label: &str) {
    let gmail = FakeGmail::start().await;
    gmail.set_unread("token-work", 12);
    gmail.set_unread("token-home", 3);
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        env: vec![
            ("GMAIL_API_BASE_URL".into(), gmail.url.clone()),
            ("BOOTSTRAP_CACHE_TTL".into(), cache_ttl.into()),
            // Each uncached call charges one labels.get per account; lift the limit for the run.
            ("RATE_LIMITS_GMAIL".into(), "1000000/minute".into()),
        ],
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("bench-user").await;
    for (account, token) in [
        ("work@example.com", "token-work"),
        ("home@example.com", "token-home"),
    ] {
        g.connect_account(pb::ConnectAccountRequest {
            integration: pb::Integration::Gmail as i32,
            account: account.into(),
            access_token: token.into(),
            refresh_token: "r".into(),
            expires_at: Some(prost_types::Timestamp {
                seconds: 4_000_000_000,
                nanos: 0,
            }),
            scopes: vec![],
        })
        .await
        .unwrap();
    }
    for (i, tool, args) in [
        (
            0,
            "add_task",
            r#"{"title":"Call dentist","due":"2020-01-01"}"#,
        ),
        (
            1,
            "add_task",
            r#"{"title":"Plan offsite","due":"2040-01-01"}"#,
        ),
        (2, "add_task", r#"{"title":"Read book"}"#),
        (
            3,
            "create_reminder",
            r#"{"text":"Standup","due_at":"2039-03-04T09:30:00Z"}"#,
        ),
    ] {
        g.execute_tool(pb::ExecuteToolRequest {
            call: Some(pb::ToolCall {
                call_id: format!("seed{i}"),
                tool: tool.into(),
                arguments: Some(Arguments::ArgsJson(args.into())),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    }
    let mut samples = Vec::with_capacity(CALLS);
    for i in 0..(WARMUP + CALLS) {
        let started = Instant::now();
        let ctx = g
            .get_bootstrap_context(pb::GetBootstrapContextRequest {
                channel: 3,
                time_zone: "Europe/Berlin".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let elapsed = started.elapsed();
        assert_eq!(ctx.email.unwrap().status, pb::SourceStatus::Ok as i32);
        if i >= WARMUP {
            samples.push(elapsed);
        }
    }
    samples.sort();
    let pct = |p: f64| samples[((samples.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "GetBootstrapContext ({label}): n={CALLS} p50={:?} p99={:?} max={:?}",
        pct(0.5),
        pct(0.99),
        samples.last().copied().unwrap_or(Duration::ZERO)
    );
    steward_tests::bench::summary(
        &format!("GetBootstrapContext p50 ({label})"),
        &format!("{:.2} ms", pct(0.5).as_secs_f64() * 1000.0),
        "",
    );
}

#[tokio::main]
async fn main() {
    measure("0", "PostgreSQL, 2 Gmail accounts, cache off").await;
    measure("10s", "PostgreSQL, 2 Gmail accounts, cache on").await;
}
