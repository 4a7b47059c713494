//! Each service process serves its own Prometheus endpoint (issue 12, O-2): after real runs
//! through real agent-svc and gateway-svc processes, a scrape of each endpoint parses and
//! shows its series with non-zero values.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use steward_proto::agent::v1 as pb;
use steward_tests::{
    agent_calls::run_once,
    db::hold_admission_lock,
    procs::{Cluster, ClusterOptions, ServiceProc},
};
use tokio_stream::StreamExt;

/// `name{labels} value` lines of a Prometheus text exposition, summed per metric name.
fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut series = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (key, value) = line.rsplit_once(' ').expect("a sample line has a value");
        let name = key.split('{').next().unwrap_or(key).to_owned();
        let value: f64 = value.parse().expect("a numeric sample value");
        *series.entry(name).or_default() += value;
    }
    series
}

async fn scrape(addr: SocketAddr) -> BTreeMap<String, f64> {
    let body = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .expect("the metrics endpoint answers")
        .text()
        .await
        .expect("a text body");
    parse(&body)
}

fn metrics_addr(service: &ServiceProc) -> SocketAddr {
    service
        .logged("metrics endpoint bound", "metrics_addr")
        .expect("the service logs its metrics address")
        .parse()
        .expect("a socket address")
}

fn assert_positive(series: &BTreeMap<String, f64>, names: &[&str], who: &str) {
    for name in names {
        let value = series.get(*name).copied().unwrap_or_default();
        assert!(
            value > 0.0,
            "{who}: {name} is {value}; series present: {:?}",
            series.keys().collect::<Vec<_>>()
        );
    }
}

#[tokio::test]
async fn o2_each_service_serves_its_own_series_with_real_values() {
    let metrics = ("METRICS_LISTEN_ADDR".to_owned(), "127.0.0.1:0".to_owned());
    let cluster = Cluster::start(ClusterOptions {
        agents: 1,
        agent_env: vec![
            metrics.clone(),
            ("MODEL_PRICES".into(), "gpt-4o=2.5/10/1.25".into()),
            ("HEALTH_MONITOR_INTERVAL".into(), "100ms".into()),
        ],
        gateway_env: vec![metrics, ("RATE_LIMITS_GMAIL".into(), "3/minute".into())],
        ..ClusterOptions::default()
    })
    .await;
    cluster.connect_gmail("alice", "tok-alice").await;
    let mut alice = cluster.agent(0, "alice").await;

    // Each search of the empty mailbox is one upstream request: the limit denies the fourth.
    for _ in 0..5 {
        run_once(&mut alice, "search my mail for the budget", "")
            .await
            .expect("a search run");
    }
    // One streamed run: a watcher opens and closes.
    let mut events = alice
        .run_stream(pb::RunStreamRequest {
            input: Some(pb::RunInput {
                prompt: "what is new?".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("RunStream")
        .into_inner();
    while let Some(event) = events.next().await {
        event.expect("a run event");
    }
    let paused = run_once(&mut alice, "send the numbers subject: Q3", "")
        .await
        .expect("a send run");
    let approval = paused.approval.expect("the send waits for approval");

    let agent = metrics_addr(&cluster.agents[0]);
    let gateway = metrics_addr(&cluster.gateway);
    assert_ne!(agent, gateway);

    // The pending-approvals gauge is the monitor's count; wait (bounded) for its next sweep.
    let agent_series = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let s = scrape(agent).await;
            if s.get("steward_approvals_pending")
                .copied()
                .unwrap_or_default()
                > 0.0
            {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the monitor counts the pending approval");
    assert_positive(
        &agent_series,
        &[
            "grpc_server_handled_total",
            "grpc_server_handling_seconds_count",
            "steward_model_calls_total",
            "steward_model_tokens_total",
            "steward_model_cost_microusd_total",
            "steward_model_call_seconds_count",
            "steward_runs_ended_total",
            "steward_approvals_requested_total",
            "steward_approvals_pending",
            "steward_db_pool_connections",
            "steward_db_pool_wait_seconds_count",
            "steward_db_connection_held_seconds_count",
        ],
        "agent-svc",
    );
    alice
        .decide_approval(pb::DecideApprovalRequest {
            approval_id: approval.id,
            decision: pb::Decision::Approve as i32,
            ..Default::default()
        })
        .await
        .expect("DecideApproval");
    assert_positive(
        &scrape(agent).await,
        &["steward_approvals_decided_total"],
        "agent-svc",
    );
    for present in ["steward_runs_active", "steward_stream_watchers"] {
        assert!(
            agent_series.contains_key(present),
            "agent-svc: {present} missing"
        );
    }
    assert!(
        !agent_series.contains_key("steward_tool_calls_total"),
        "agent-svc serves only its own series"
    );

    let gateway_series = scrape(gateway).await;
    assert_positive(
        &gateway_series,
        &[
            "grpc_server_handled_total",
            "grpc_server_handling_seconds_count",
            "steward_tool_calls_total",
            "steward_tool_call_seconds_count",
            "steward_upstream_requests_total",
            "steward_upstream_request_seconds_count",
            "steward_rate_limit_denials_total",
            "steward_db_pool_connections",
            "steward_db_pool_wait_seconds_count",
            "steward_db_connection_held_seconds_count",
        ],
        "gateway-svc",
    );
    assert!(
        !gateway_series.contains_key("steward_model_calls_total"),
        "gateway-svc serves only its own series"
    );
    // The grouped reads say which kind of read each batch was: the runs' tool lists read the
    // users' accounts.
    let account_batches = scrape_labelled(
        gateway,
        "steward_db_read_batch_size_count",
        "kind=\"accounts\"",
    )
    .await;
    assert!(
        account_batches > 0.0,
        "gateway-svc: no account-read batches counted by kind"
    );
}

/// Sum of the samples of `name` whose labels include `label`.
async fn scrape_labelled(addr: SocketAddr, name: &str, label: &str) -> f64 {
    let body = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .expect("the metrics endpoint answers")
        .text()
        .await
        .expect("a text body");
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_burst_of_runs_by_one_user_lists_the_tools_once() {
    let cluster = Cluster::start(ClusterOptions {
        agents: 1,
        agent_env: vec![("AGENT_TOOLS_CACHE_TTL".into(), "1m".into())],
        gateway_env: vec![("METRICS_LISTEN_ADDR".to_owned(), "127.0.0.1:0".to_owned())],
        ..ClusterOptions::default()
    })
    .await;
    let gateway = metrics_addr(&cluster.gateway);
    let mut alice = cluster.agent(0, "alice").await;
    let mut bob = cluster.agent(0, "bob").await;
    for _ in 0..3 {
        run_once(&mut alice, "what is new?", "")
            .await
            .expect("a run");
    }
    run_once(&mut bob, "what is new?", "").await.expect("a run");
    let listed = scrape_labelled(
        gateway,
        "grpc_server_handled_total",
        r#"grpc_method="ListTools""#,
    )
    .await;
    assert_eq!(listed, 2.0, "one ListTools per user, not per run");
}

/// agent-svc's settings for the tests of waiting for an owner's admission lock.
fn lock_wait_options() -> ClusterOptions {
    ClusterOptions {
        agents: 1,
        agent_env: vec![
            ("METRICS_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
            // Longer than the test: what waits, waits for the holder, not for a timeout.
            ("DATABASE_LOCK_TIMEOUT".into(), "60s".into()),
        ],
        ..ClusterOptions::default()
    }
}

fn waiting_for_owner(s: &BTreeMap<String, f64>) -> f64 {
    s.get("steward_db_admission_waiting_for_owner")
        .copied()
        .unwrap_or_default()
}

fn set_apart(s: &BTreeMap<String, f64>) -> f64 {
    s.get("steward_db_admission_set_apart_total")
        .copied()
        .unwrap_or_default()
}

/// agent-svc's series once something there waits for an owner's lock (at most 15 s: `what`
/// is what was expected to wait).
async fn once_waiting_for_owner(agent: SocketAddr, what: &str) -> BTreeMap<String, f64> {
    tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let s = scrape(agent).await;
            if waiting_for_owner(&s) > 0.0 {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} waits for the owner's lock, counted"))
}

/// R-4, O-2: a run whose owner's admission lock another session holds waits in the owner's
/// queue, and agent-svc's metrics say so: counted as set apart, shown as waiting while the
/// lock is held, and no longer waiting once it is free and the run has been admitted.
#[tokio::test]
async fn r4_o2_a_run_waiting_for_its_owners_held_lock_shows_in_the_metrics() {
    a_run_waits_for_alices_held_lock(false).await;
}

/// R-4, O-2: the same for a run on a thread that already exists, which is admitted on its own
/// rather than with others: it waits in the owner's queue too, and is counted the same way.
#[tokio::test]
async fn r4_o2_a_run_on_an_existing_thread_waiting_for_its_owners_lock_shows_in_the_metrics() {
    a_run_waits_for_alices_held_lock(true).await;
}

async fn a_run_waits_for_alices_held_lock(on_existing_thread: bool) {
    let cluster = Cluster::start(lock_wait_options()).await;
    let mut alice = cluster.agent(0, "alice").await;
    let thread = if on_existing_thread {
        let first = run_once(&mut alice, "hello there", "").await.unwrap();
        assert!(first.error.is_empty(), "{}", first.error);
        first.thread_id
    } else {
        String::new()
    };
    let holder = cluster.sql().await;
    hold_admission_lock(&holder, "alice").await;

    let on = thread.clone();
    let run = tokio::spawn(async move { run_once(&mut alice, "hello again", &on).await });
    let agent = metrics_addr(&cluster.agents[0]);
    let series = once_waiting_for_owner(agent, "the run").await;
    assert_eq!(waiting_for_owner(&series), 1.0);
    assert_eq!(set_apart(&series), 1.0);
    assert!(!run.is_finished(), "the run waits for the lock");

    holder.batch_execute("ROLLBACK").await.unwrap();
    let result = run
        .await
        .unwrap()
        .expect("the run goes on once the lock is free");
    assert!(result.error.is_empty(), "{}", result.error);
    if on_existing_thread {
        assert_eq!(
            result.thread_id, thread,
            "the run went on the thread it named"
        );
    }
    tokio::time::timeout(Duration::from_secs(10), async {
        while waiting_for_owner(&scrape(agent).await) != 0.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("no run waits once the lock is free");
}

/// R-4, O-2: a decision that continues a paused run takes its owner's admission lock, as an
/// admission does; held by another session, the decision waits for it and says so in the
/// metrics, as a run set apart does, and goes on once the lock is free.
#[tokio::test]
async fn r4_o2_a_decision_waiting_for_its_owners_held_lock_shows_in_the_metrics() {
    let cluster = Cluster::start(lock_wait_options()).await;
    cluster.connect_gmail("alice", "tok-alice").await;
    let mut alice = cluster.agent(0, "alice").await;
    let agent = metrics_addr(&cluster.agents[0]);
    let approve = |id: String| pb::DecideApprovalRequest {
        approval_id: id,
        decision: pb::Decision::Approve as i32,
        ..Default::default()
    };

    // A decision that finds the lock free is not counted.
    let paused = run_once(&mut alice, "send the numbers subject: Q2", "")
        .await
        .expect("a send run");
    let approval = paused.approval.expect("the send waits for approval");
    alice
        .decide_approval(approve(approval.id))
        .await
        .expect("an uncontended decision");
    assert_eq!(set_apart(&scrape(agent).await), 0.0);

    let paused = run_once(&mut alice, "send the numbers subject: Q3", "")
        .await
        .expect("a send run");
    let approval = paused.approval.expect("the send waits for approval");

    let holder = cluster.sql().await;
    hold_admission_lock(&holder, "alice").await;
    let decision = tokio::spawn(async move { alice.decide_approval(approve(approval.id)).await });

    let series = once_waiting_for_owner(agent, "the decision").await;
    assert_eq!(waiting_for_owner(&series), 1.0);
    assert_eq!(set_apart(&series), 1.0);
    assert!(!decision.is_finished(), "the decision waits for the lock");

    holder.batch_execute("ROLLBACK").await.unwrap();
    let decided = decision
        .await
        .unwrap()
        .expect("the decision goes on once the lock is free")
        .into_inner();
    let result = decided.result.expect("the continued run's result");
    assert_eq!(
        result.status,
        pb::RunState::Completed as i32,
        "the approved send ran: {result:?}"
    );
    assert_eq!(
        waiting_for_owner(&scrape(agent).await),
        0.0,
        "nothing waits once the decision is through"
    );
}
