//! SIGTERM, as Kubernetes sends it, during a streaming run (issue 12, O-1): the replica stops
//! taking calls, lets the run finish within SHUTDOWN_DRAIN_TIMEOUT, and exits 0; the caller's
//! stream ends with the run's result, not a broken connection.

use std::time::Duration;

use futures_util::StreamExt;
use steward_proto::agent::v1 as pb;
use steward_tests::procs::{Cluster, ClusterOptions};

#[tokio::test]
async fn o1_sigterm_during_a_streaming_run_lets_it_finish_and_the_replica_exits_zero() {
    let mut cluster = Cluster::start(ClusterOptions {
        agents: 1,
        agent_env: vec![("SHUTDOWN_DRAIN_TIMEOUT".into(), "10s".into())],
        ..ClusterOptions::default()
    })
    .await;
    let mut alice = cluster.agent(0, "alice").await;
    // `slow`: the model holds every answer of this run back for 1.5 s.
    let mut events = alice
        .run_stream(pb::RunStreamRequest {
            input: Some(pb::RunInput {
                prompt: "a slow answer please".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("RunStream")
        .into_inner();
    let first = events
        .next()
        .await
        .expect("a first event")
        .expect("an event")
        .event
        .expect("a run event");
    assert_eq!(first.seq, 1);

    // The run is admitted and its model call is in flight: now the graceful stop.
    let agent = cluster.agents.remove(0);
    let stopping = tokio::task::spawn_blocking(move || {
        let mut agent = agent;
        let exit = agent.terminate(Duration::from_secs(20));
        (exit, agent.log().join("\n"))
    });

    let mut terminal = None;
    while let Some(event) = events.next().await {
        let event = event
            .expect("the stream stays intact through the drain")
            .event
            .expect("a run event");
        if let Some(kind @ (pb::run_event::Kind::Result(_) | pb::run_event::Kind::Error(_))) =
            event.kind
        {
            terminal = Some(kind);
        }
    }
    match terminal {
        Some(pb::run_event::Kind::Result(result)) => assert_eq!(
            result.status,
            pb::RunState::Completed as i32,
            "{}",
            result.error
        ),
        other => panic!("the run did not finish with a result: {other:?}"),
    }
    let (exit, log) = stopping.await.expect("the stopping task");
    let exit = exit.expect("agent-svc exits after SIGTERM");
    assert!(exit.success(), "{exit:?}\n{log}");
    // The signal landed while the run was still going: the drain, not luck, let it finish.
    let at = |what: &str| log.lines().position(|l| l.contains(what));
    let (signalled, ended) = (at("shutdown signal received"), at("run segment ended"));
    assert!(
        signalled.is_some() && ended.is_some() && signalled < ended,
        "the signal must come before the run's end:\n{log}"
    );
}
