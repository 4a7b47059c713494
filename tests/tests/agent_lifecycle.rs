//! The run as one durable state machine (issue 11; A-4..A-8, E-11, S-2..S-4, P-4, O-3), in
//! process: both services, PostgreSQL, a scripted OpenAI-compatible model, a fake Gmail.
//! Process-level faults (kill -9, database restarts) are in `agent_faults.rs`.

use std::time::Duration;

use futures_util::StreamExt;
use steward_proto::agent::v1 as pb;
use steward_tests::{
    Backend, Options, TestApp, agent_as,
    agent_calls::{get_run, messages},
    fakes::{
        gmail::FakeGmail,
        openai::{Answer, FakeOpenAi, tool_messages},
    },
    spawn::spawn,
    worlds::gmail_world,
};
use tonic::Code;

const SEND_ARGS: &str =
    r#"{"to":["boss@example.com"],"subject":"Budget","body":"Numbers attached."}"#;

fn input(prompt: &str) -> pb::RunInput {
    pb::RunInput {
        prompt: prompt.into(),
        ..Default::default()
    }
}

async fn run_on(addr: std::net::SocketAddr, input: pb::RunInput) -> pb::RunResult {
    agent_as(addr, "alice")
        .await
        .run(pb::RunRequest { input: Some(input) })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap()
}

/// Alice approves `approval_id` on `addr` and gets the run's result once it has gone on.
async fn approved(addr: std::net::SocketAddr, approval_id: &str) -> pb::RunResult {
    agent_as(addr, "alice")
        .await
        .decide_approval(approve(approval_id))
        .await
        .expect("the approval waits for a decision")
        .into_inner()
        .result
        .unwrap()
}

fn approve(id: &str) -> pb::DecideApprovalRequest {
    pb::DecideApprovalRequest {
        approval_id: id.into(),
        decision: pb::Decision::Approve as i32,
        ..Default::default()
    }
}

async fn events(app: &TestApp, run_id: &str, after: u64) -> Vec<pb::RunEvent> {
    app.agent_as("alice")
        .await
        .watch_run(pb::WatchRunRequest {
            run_id: run_id.into(),
            after_seq: after,
        })
        .await
        .unwrap()
        .into_inner()
        .filter_map(|r| async move { r.ok().and_then(|r| r.event) })
        .collect()
        .await
}

/// Every event of a run: a watch ends at each stop (a pause, the end), so watch again from
/// there until nothing follows.
async fn all_events(app: &TestApp, run_id: &str) -> Vec<pb::RunEvent> {
    let mut all: Vec<pb::RunEvent> = Vec::new();
    loop {
        let after = all.last().map_or(0, |e| e.seq);
        let more = events(app, run_id, after).await;
        if more.is_empty() {
            return all;
        }
        all.extend(more);
    }
}

fn is_terminal(e: &pb::RunEvent) -> bool {
    matches!(
        e.kind,
        Some(pb::run_event::Kind::Result(_) | pb::run_event::Kind::Error(_))
    )
}

/// A streaming run of alice's on the app's own agent replica, and its first event.
async fn start_streaming(
    app: &TestApp,
    prompt: &str,
) -> (tonic::Streaming<pb::RunStreamResponse>, pb::RunEvent) {
    let mut stream = app
        .agent_as("alice")
        .await
        .run_stream(pb::RunStreamRequest {
            input: Some(input(prompt)),
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap().event.unwrap();
    (stream, first)
}

/// Returns once a statement waits for a lock on `table` that the test's own lock, held by
/// the backend `holder`, blocks (not any other wait on it), or fails saying `never` at
/// `deadline`.
async fn until_a_write_waits_on(
    watcher: &tokio_postgres::Client,
    table: &str,
    holder: &tokio_postgres::Transaction<'_>,
    deadline: tokio::time::Instant,
    never: &str,
) {
    let holder: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    loop {
        let waiting: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE relation = $1::text::regclass AND NOT granted \
                 AND $2 = ANY(pg_blocking_pids(pid))",
                &[&table, &holder],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{never}");
        tokio::task::yield_now().await;
    }
}

async fn sql_count(app: &TestApp, query: &str, run_id: &str) -> i64 {
    let client = app.sql().await;
    client.query_one(query, &[&run_id]).await.unwrap().get(0)
}

#[tokio::test]
async fn watching_a_finished_run_after_its_last_event_returns_at_once() {
    let (app, _model, _gmail) = gmail_world(vec![Answer::text("Done.")], &[]).await;
    let result = run_on(app.agent_addr, input("hi")).await;
    let all = events(&app, &result.run_id, 0).await;
    assert!(is_terminal(all.last().unwrap()));
    let last = all.last().unwrap().seq;
    let nothing = tokio::time::timeout(Duration::from_secs(5), events(&app, &result.run_id, last))
        .await
        .expect("a watch after the terminal event ends at once");
    assert!(nothing.is_empty());
}

#[tokio::test]
async fn a_long_streamed_answer_reaches_the_client_whole_in_few_event_rows() {
    // About 3,000 tokens of text, streamed one word per delta.
    let answer: String = (0..3000).map(|i| format!("w{} ", i % 97)).collect();
    let (app, _model, _gmail) = gmail_world(vec![Answer::text(answer.trim_end())], &[]).await;
    let mut alice = app.agent_as("alice").await;
    let stream = alice
        .run_stream(pb::RunStreamRequest {
            input: Some(input("tell me a long story")),
        })
        .await
        .unwrap()
        .into_inner();
    let got: Vec<pb::RunEvent> = stream
        .filter_map(|r| async move { r.ok().and_then(|r| r.event) })
        .collect()
        .await;
    let text: String = got
        .iter()
        .filter_map(|e| match &e.kind {
            Some(pb::run_event::Kind::Delta(d)) => Some(d.text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, answer.trim_end(), "the client sees every word once");
    let seqs: Vec<u64> = got.iter().map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let run_id = got[0].run_id.clone();
    let rows = sql_count(
        &app,
        "SELECT count(*) FROM agent.run_events WHERE run_id = $1",
        &run_id,
    )
    .await;
    println!("3,000-word answer: {rows} event rows");
    assert!(rows <= 30, "{rows} event rows for one streamed answer");
}

#[tokio::test]
async fn live_registrations_return_to_zero_after_a_thousand_watched_runs() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut alice = app.agent_as("alice").await;
    for i in 0..1000 {
        let stream = alice
            .run_stream(pb::RunStreamRequest {
                input: Some(input(&format!("hello {i}"))),
            })
            .await
            .unwrap()
            .into_inner();
        let got: Vec<_> = stream.collect().await;
        assert!(matches!(
            got.last()
                .unwrap()
                .as_ref()
                .unwrap()
                .event
                .as_ref()
                .unwrap()
                .kind,
            Some(pb::run_event::Kind::Result(_))
        ));
    }
    // Every stream ended with its run; the run's segment deregisters just after its end is
    // durable, so wait (bounded) for the last one to let go.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while app.live_registrations() > 0 && tokio::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    assert_eq!(app.live_registrations(), 0);
}

/// Pauses a supervised send for approval; returns (run, approval).
async fn paused_send(app: &TestApp) -> (pb::RunResult, pb::Approval) {
    let result = run_on(app.agent_addr, input("email my boss the budget")).await;
    assert_eq!(result.status, pb::RunState::AwaitingConfirmation as i32);
    let approval = result.approval.clone().unwrap();
    (result, approval)
}

#[tokio::test]
async fn eight_concurrent_approvals_on_two_replicas_continue_the_run_once() {
    let (mut app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Sent it."),
            Answer::text("You're welcome."),
        ],
        &[],
    )
    .await;
    let second = app.start_another_agent().await;
    let (paused, approval) = paused_send(&app).await;
    let before = model.requests().len();
    let deciders = (0..8).map(|i| {
        let addr = if i % 2 == 0 { app.agent_addr } else { second };
        let id = approval.id.clone();
        tokio::spawn(async move {
            agent_as(addr, "alice")
                .await
                .decide_approval(approve(&id))
                .await
        })
    });
    let mut states = Vec::new();
    for d in deciders {
        let response = d
            .await
            .unwrap()
            .expect("every caller gets an answer")
            .into_inner();
        assert_eq!(
            response.approval.unwrap().state,
            pb::ApprovalState::Approved as i32
        );
        states.push(response.result.unwrap().status);
    }
    assert!(
        states.iter().all(|s| *s == pb::RunState::Completed as i32),
        "every caller sees the same final state: {states:?}"
    );
    assert_eq!(model.requests().len() - before, 1, "one continuation");
    assert_eq!(gmail.sent().len(), 1, "one email");
    let all = all_events(&app, &paused.run_id).await;
    let terminals: Vec<_> = all.iter().filter(|e| is_terminal(e)).collect();
    assert_eq!(terminals.len(), 2, "the pause and the one end");
    let seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let messages = app
        .agent_as("alice")
        .await
        .list_messages(pb::ListMessagesRequest {
            thread_id: paused.thread_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert!(
        messages
            .iter()
            .all(|m| m.source != pb::MessageSource::Error as i32),
        "{messages:?}"
    );
    // The thread takes the next message.
    let mut next = input("thanks");
    next.thread_id = paused.thread_id;
    assert_eq!(run_on(second, next).await.summary, "You're welcome.");
}

#[tokio::test]
async fn an_approval_on_the_other_replica_long_after_the_pause_completes_normally() {
    let (mut app, _model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            // The continuation takes a while: the monitors sweep many times meanwhile.
            Answer::Slow(
                Box::new(Answer::text("Sent it.")),
                Duration::from_millis(800),
            ),
        ],
        &[
            ("HEALTH_MONITOR_INTERVAL", "100ms"),
            ("RUN_GRACE_PERIOD", "0s"),
        ],
    )
    .await;
    let second = app
        .start_another_agent_with(&[("HEALTH_MONITOR_INTERVAL", "100ms")])
        .await;
    let (paused, approval) = paused_send(&app).await;
    // The run started an hour ago as far as its row knows (past every channel's limit).
    let client = app.sql().await;
    client
        .execute(
            "UPDATE agent.runs SET created_at = now() - interval '1 hour', started_at = now() - interval '1 hour' WHERE id = $1",
            &[&paused.run_id],
        )
        .await
        .unwrap();
    let result = approved(second, &approval.id).await;
    assert_eq!(result.status, pb::RunState::Completed as i32, "{result:?}");
    assert_eq!(result.summary, "Sent it.");
    assert_eq!(gmail.sent().len(), 1);
    let all = all_events(&app, &paused.run_id).await;
    assert_eq!(all.iter().filter(|e| is_terminal(e)).count(), 2);
}

#[tokio::test]
async fn cancelling_a_run_that_waits_for_approval_ends_it_and_approving_is_refused() {
    let (app, _model, gmail) = gmail_world(
        vec![Answer::tool_calls(&[(
            "call_send",
            "gmail_send",
            SEND_ARGS,
        )])],
        &[],
    )
    .await;
    let (paused, approval) = paused_send(&app).await;
    let mut alice = app.agent_as("alice").await;
    let cancelled = alice
        .cancel_run(pb::CancelRunRequest {
            run_id: paused.run_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(cancelled.state, pb::RunState::Cancelled as i32);
    let all = all_events(&app, &paused.run_id).await;
    match &all.last().unwrap().kind {
        Some(pb::run_event::Kind::Result(r)) => {
            assert_eq!(r.status, pb::RunState::Cancelled as i32);
            assert_eq!(
                (&r.run_id, &r.thread_id),
                (&paused.run_id, &paused.thread_id),
                "A-3: a cancelled result names its run"
            );
        }
        other => panic!("not a cancelled result: {other:?}"),
    }
    let err = alice
        .decide_approval(approve(&approval.id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(gmail.sent().is_empty());
    let err = alice
        .cancel_run(pb::CancelRunRequest {
            run_id: paused.run_id,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "already ended");
}

/// A cancel that lands while a run's pause is being committed finds the run executing: the
/// cancel only sets its flag, and nothing else would end the pause. The flag, read once the
/// pause is durable, ends the run cancelled instead of leaving it waiting for a decision its
/// user cancelled. The pause's commit is held in the window by a lock on the audit table,
/// which in this run only the pause writes to.
#[tokio::test]
async fn a_cancel_that_lands_while_the_pause_commits_ends_the_paused_run() {
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let (app, model, gmail) = gmail_world(
        vec![Answer::Held(
            Box::new(Answer::tool_calls(&[(
                "call_send",
                "gmail_send",
                SEND_ARGS,
            )])),
            gate.clone(),
        )],
        // The held commit waits for the test's lock, however slow the machine, and does not fail.
        &[("DATABASE_LOCK_TIMEOUT", "60s")],
    )
    .await;
    let (mut stream, first) = start_streaming(&app, "email my boss the budget").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while model.requests().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the model was never called"
        );
        tokio::task::yield_now().await;
    }
    let mut holder = app.sql().await;
    let lock = holder.transaction().await.unwrap();
    lock.execute("LOCK TABLE agent.audit IN SHARE MODE", &[])
        .await
        .unwrap();
    gate.notify_one();
    let watcher = app.sql().await;
    until_a_write_waits_on(
        &watcher,
        "agent.audit",
        &lock,
        deadline,
        "the pause was never committed",
    )
    .await;
    let mut alice = app.agent_as("alice").await;
    let answered = alice
        .cancel_run(pb::CancelRunRequest {
            run_id: first.run_id.clone(),
            ..Default::default()
        })
        .await
        .expect("the cancel is taken")
        .into_inner()
        .run
        .unwrap();
    assert!(
        [
            pb::RunState::Queued as i32,
            pb::RunState::Planning as i32,
            pb::RunState::Executing as i32
        ]
        .contains(&answered.state),
        "the cancel landed before the pause was durable: {answered:?}"
    );
    lock.rollback().await.unwrap();
    while let Some(Ok(_)) = stream.next().await {}
    let run = loop {
        let run = get_run(&mut alice, &first.run_id)
            .await
            .unwrap()
            .run
            .unwrap();
        if run.state != pb::RunState::AwaitingConfirmation as i32
            && run.state != pb::RunState::Executing as i32
        {
            break run;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cancelled run still waits for a decision: {run:?}"
        );
        tokio::task::yield_now().await;
    };
    assert_eq!(run.state, pb::RunState::Cancelled as i32, "{run:?}");
    let approval_state: String = watcher
        .query_one(
            "SELECT state FROM agent.approvals WHERE run_id = $1",
            &[&first.run_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        approval_state, "expired",
        "the cancelled run's approval cannot be decided"
    );
    assert!(gmail.sent().is_empty());
}

/// B-3, A-6: opening the app while the user's last conversation waits for their approval
/// leaves the approval waiting: the opening is silent and points at that thread, and
/// approving it then sends.
#[tokio::test]
async fn b3_opening_the_app_leaves_a_pending_approval_waiting_and_points_at_its_thread() {
    let (app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Sent."),
        ],
        &[],
    )
    .await;
    let (paused, approval) = paused_send(&app).await;
    // Something in flight, so only the waiting approval keeps the opening silent.
    gmail.set_unread("tok-alice", 2);
    let mut alice = app.agent_as("alice").await;
    let opened = alice
        .open_session(pb::OpenSessionRequest {
            time_zone: "UTC".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(opened.silent && opened.greeting.is_empty(), "{opened:?}");
    assert_eq!(
        opened.thread_id, paused.thread_id,
        "where the approval waits"
    );
    let sent = approved(app.agent_addr, &approval.id).await;
    assert_eq!(sent.status, pb::RunState::Completed as i32);
    assert_eq!(gmail.sent().len(), 1);
    assert_eq!(model.requests().len(), 2, "no greeting was asked for");
}

/// B-1: a task agent started after an approval pause keeps the zone the run was started with;
/// the continuation has no caller to give it again.
#[tokio::test]
async fn b1_a_task_agent_started_after_an_approval_keeps_the_runs_time_zone() {
    let task = r#"{"instructions":"Watch for the reply","goal":"reply watch"}"#;
    let (app, _model, _gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::tool_calls(&[("call_task", "create_task_agent", task)]),
            Answer::text("Sent, and I'll watch for the reply."),
        ],
        &[("TASK_AGENT_WORKERS", "false")],
    )
    .await;
    let paused = run_on(
        app.agent_addr,
        pb::RunInput {
            time_zone: "Asia/Tokyo".into(),
            ..input("email my boss the budget and watch for the reply")
        },
    )
    .await;
    assert_eq!(paused.status, pb::RunState::AwaitingConfirmation as i32);
    let sent = approved(app.agent_addr, &paused.approval.unwrap().id).await;
    assert_eq!(sent.status, pb::RunState::Completed as i32);
    let zone: Option<String> = app
        .sql()
        .await
        .query_one("SELECT time_zone FROM agent.task_agents", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(zone.as_deref(), Some("Asia/Tokyo"));
}

/// A-3: a Run repeated with its request id after its run paused, was approved and completed
/// answers with how the run ended, not with the pause first in its log.
#[tokio::test]
async fn a_repeated_run_request_answers_how_its_run_stands_now_not_its_first_pause() {
    let (app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Sent."),
        ],
        &[],
    )
    .await;
    let request = pb::RunInput {
        request_id: "budget-mail-1".into(),
        ..input("email my boss the budget")
    };
    let paused = run_on(app.agent_addr, request.clone()).await;
    assert_eq!(paused.status, pb::RunState::AwaitingConfirmation as i32);
    approved(app.agent_addr, &paused.approval.unwrap().id).await;
    let again = run_on(app.agent_addr, request).await;
    assert_eq!(
        (again.status, again.run_id.as_str(), again.summary.as_str()),
        (
            pb::RunState::Completed as i32,
            paused.run_id.as_str(),
            "Sent."
        )
    );
    assert_eq!(gmail.sent().len(), 1);
    assert_eq!(model.requests().len(), 2, "the repeat started nothing");
}

/// R-4: a RunStream or Run refused at the cap on followed runs starts no run; the caller could
/// not see one, and its retry would start it twice or find the thread busy.
#[tokio::test]
async fn r4_a_stream_or_run_refused_at_the_watcher_cap_starts_no_run() {
    let (app, model, _gmail) = gmail_world(
        vec![
            Answer::Slow(Box::new(Answer::text("done")), Duration::from_secs(20)),
            Answer::text("never asked"),
        ],
        &[("AGENT_MAX_WATCHERS_PER_USER", "1")],
    )
    .await;
    let (_open, first) = start_streaming(&app, "take your time").await;
    let refused = app
        .agent_as("alice")
        .await
        .run_stream(pb::RunStreamRequest {
            input: Some(input("and this too")),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused.message().contains("AGENT_MAX_WATCHERS_PER_USER"),
        "{}",
        refused.message()
    );
    // Waiting on a Run is following it too.
    let refused = app
        .agent_as("alice")
        .await
        .run(pb::RunRequest {
            input: Some(input("or this")),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    let runs = sql_count(
        &app,
        "SELECT count(*) FROM agent.runs WHERE owner = (SELECT owner FROM agent.runs WHERE id = $1)",
        &first.run_id,
    )
    .await;
    assert_eq!(runs, 1, "only the watched run exists");
    assert!(model.requests().len() <= 1);
}

#[tokio::test]
async fn an_approval_after_its_session_was_archived_is_refused_and_the_thread_works() {
    let (app, _model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Fresh start."),
        ],
        &[],
    )
    .await;
    let (paused, approval) = paused_send(&app).await;
    // The session goes quiet and a monitor archives it.
    let client = app.sql().await;
    client
        .execute(
            "UPDATE agent.threads SET updated_at = now() - interval '1 day' WHERE id = $1",
            &[&paused.thread_id],
        )
        .await
        .unwrap();
    let monitor = app.monitor().await;
    assert_eq!(monitor.sweep_idle_sessions().await.unwrap(), 1);

    let mut alice = app.agent_as("alice").await;
    let err = alice
        .decide_approval(approve(&approval.id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("archived"), "{}", err.message());
    assert!(gmail.sent().is_empty());
    let mut next = input("start over");
    next.thread_id = paused.thread_id;
    let result = run_on(app.agent_addr, next).await;
    assert_eq!(result.status, pb::RunState::Completed as i32);
    assert_eq!(result.summary, "Fresh start.");
}

#[tokio::test]
async fn a_retried_model_stream_tells_the_client_to_discard_its_partial_text() {
    let cut = Answer::CutOff {
        events: vec![
            serde_json::json!({"choices": [{"index": 0, "delta": {"content": "Half an ans"}, "finish_reason": null}]}),
        ],
    };
    let (app, _model, _gmail) = gmail_world(vec![cut, Answer::text("A whole answer.")], &[]).await;
    let mut alice = app.agent_as("alice").await;
    let got: Vec<pb::RunEvent> = alice
        .run_stream(pb::RunStreamRequest {
            input: Some(input("answer me")),
        })
        .await
        .unwrap()
        .into_inner()
        .filter_map(|r| async move { r.ok().and_then(|r| r.event) })
        .collect()
        .await;
    // What a client shows: deltas, discarding everything before a reset.
    let mut shown = String::new();
    let mut resets = 0;
    for e in &got {
        if let Some(pb::run_event::Kind::Delta(d)) = &e.kind {
            if d.reset {
                resets += 1;
                shown.clear();
            }
            shown.push_str(&d.text);
        }
    }
    assert_eq!(resets, 1);
    assert_eq!(shown, "A whole answer.");
}

#[tokio::test]
async fn callers_cannot_pick_the_long_running_channels() {
    let (app, _model, _gmail) = gmail_world(vec![], &[]).await;
    let mut alice = app.agent_as("alice").await;
    for channel in [
        pb::Channel::Scheduled,
        pb::Channel::Heartbeat,
        pb::Channel::TaskAgent,
    ] {
        let mut i = input("work for ten minutes");
        i.channel = channel as i32;
        let err = alice
            .run(pb::RunRequest { input: Some(i) })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("input.channel"), "{}", err.message());
    }
}

#[tokio::test]
async fn a_user_over_the_active_run_cap_is_told_which_cap() {
    let (app, _model, _gmail) = gmail_world(
        vec![Answer::Slow(
            Box::new(Answer::text("slow")),
            Duration::from_secs(2),
        )],
        &[("AGENT_MAX_ACTIVE_RUNS_PER_USER", "1")],
    )
    .await;
    let mut alice = app.agent_as("alice").await;
    let first = alice
        .run_stream(pb::RunStreamRequest {
            input: Some(input("first")),
        })
        .await
        .unwrap()
        .into_inner();
    let err = alice
        .run(pb::RunRequest {
            input: Some(input("second, elsewhere")),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(
        err.message().contains("AGENT_MAX_ACTIVE_RUNS_PER_USER"),
        "{}",
        err.message()
    );
    drop(first);
    // Another user is not affected.
    let bob = agent_as(app.agent_addr, "bob")
        .await
        .run(pb::RunRequest {
            input: Some(input("bob's")),
        })
        .await;
    assert!(bob.is_ok(), "{bob:?}");
}

/// A transaction that stalls holding a user's admission lock (another replica cut off
/// mid-admission) makes that user's runs fail UNAVAILABLE once DATABASE_LOCK_TIMEOUT passes,
/// saying why, instead of hanging; once it ends, runs start again.
#[tokio::test]
async fn r4_a_run_whose_owners_lock_is_held_by_a_stalled_transaction_fails_unavailable() {
    let (app, _model, _gmail) = gmail_world(
        vec![Answer::text("first"), Answer::text("after")],
        &[("DATABASE_LOCK_TIMEOUT", "300ms")],
    )
    .await;
    let first = run_on(app.agent_addr, input("hello")).await;
    assert_eq!(first.status, pb::RunState::Completed as i32);
    let mut stalled = app.sql().await;
    let owner: String = stalled
        .query_one(
            "SELECT owner FROM agent.runs WHERE id = $1",
            &[&first.run_id],
        )
        .await
        .unwrap()
        .get(0);
    let holder = stalled.transaction().await.unwrap();
    holder
        .execute(
            "SELECT pg_advisory_xact_lock(hashtext('runs:' || $1))",
            &[&owner],
        )
        .await
        .unwrap();
    let mut alice = agent_as(app.agent_addr, "alice").await;
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        alice.run(pb::RunRequest {
            input: Some(input("while another replica is stuck")),
        }),
    )
    .await
    .expect("the run waits for the lock without bound")
    .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{}", refused.message());
    assert!(
        refused.message().contains("lock timeout")
            && refused.message().contains("DATABASE_LOCK_TIMEOUT"),
        "{}",
        refused.message()
    );
    holder.rollback().await.unwrap();
    let after = run_on(app.agent_addr, input("and now")).await;
    assert_eq!(after.status, pb::RunState::Completed as i32);
}

/// A-10: a run the database refuses for good (here a constraint an operator added) fails
/// INTERNAL in the database's own words, not UNAVAILABLE: a client told to retry would meet the
/// same refusal every time. Other runs go on.
#[tokio::test]
async fn a10_a_run_the_database_refuses_for_good_fails_internal_not_unavailable() {
    let (app, _model, _gmail) = gmail_world(vec![Answer::text("after")], &[]).await;
    app.sql()
        .await
        .batch_execute(
            "ALTER TABLE agent.messages ADD CONSTRAINT no_passwords CHECK (content NOT LIKE '%password%')",
        )
        .await
        .unwrap();
    let mut alice = agent_as(app.agent_addr, "alice").await;
    let refused = alice
        .run(pb::RunRequest {
            input: Some(input("my password is hunter2")),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Internal, "{}", refused.message());
    assert!(
        refused.message().contains("refused this for good")
            && refused.message().contains("no_passwords"),
        "{}",
        refused.message()
    );
    let after = run_on(app.agent_addr, input("and now")).await;
    assert_eq!(after.status, pb::RunState::Completed as i32);
}

/// A run of alice's with `prompt`, after `constraint` was added to `agent.messages` (as an
/// operator might): it must fail, naming the constraint, without waiting for the health
/// monitor.
async fn run_under_message_rule(app: &TestApp, constraint: &str, prompt: &str) -> pb::RunResult {
    app.sql()
        .await
        .batch_execute(&format!(
            "ALTER TABLE agent.messages ADD CONSTRAINT {constraint}"
        ))
        .await
        .unwrap();
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        run_on(app.agent_addr, input(prompt)),
    )
    .await
    .expect("the run ends without waiting for the health monitor");
    assert_eq!(
        refused.status,
        pb::RunState::Failed as i32,
        "{}",
        refused.error
    );
    let name = constraint.split_whitespace().next().unwrap();
    assert!(
        refused.error.contains("refused it for good") && refused.error.contains(name),
        "{}",
        refused.error
    );
    refused
}

/// The next run on `thread_id` completes: the refused run freed its thread.
async fn the_thread_takes_runs_again(app: &TestApp, thread_id: &str) {
    let next = run_on(
        app.agent_addr,
        pb::RunInput {
            thread_id: thread_id.to_owned(),
            ..input("and now?")
        },
    )
    .await;
    assert_eq!(
        next.status,
        pb::RunState::Completed as i32,
        "{}",
        next.error
    );
}

/// A-10, R-2: a run whose progress the database refuses for good (here its answer, under a
/// constraint an operator added) fails at once in the database's words, with its usage kept,
/// instead of being left for the health monitor to end minutes later as if its server had
/// stopped responding. Its thread is free for the next run.
#[tokio::test]
async fn a10_a_run_whose_answer_the_database_refuses_for_good_fails_at_once_naming_why() {
    let (app, _model, _gmail) = gmail_world(
        vec![
            Answer::text("The password is hunter2."),
            Answer::text("I can't repeat it."),
        ],
        &[],
    )
    .await;
    let refused = run_under_message_rule(
        &app,
        "no_passwords CHECK (content NOT LIKE '%password is%')",
        "what is the wifi password?",
    )
    .await;
    let mut alice = agent_as(app.agent_addr, "alice").await;
    let run = get_run(&mut alice, &refused.run_id)
        .await
        .unwrap()
        .run
        .unwrap();
    assert!(
        run.usage.is_some_and(|u| u.input_tokens > 0),
        "the model call's usage is kept"
    );
    assert_eq!(run.summary, "", "what was refused is not kept elsewhere");
    the_thread_takes_runs_again(&app, &refused.thread_id).await;
}

/// A-10, R-2: when the database refuses even the failure's note in the thread (here every
/// message but the user's), the run still ends at once, its row and terminal event saying why.
#[tokio::test]
async fn a10_a_run_whose_failure_note_is_refused_too_still_ends_saying_why() {
    let (app, _model, _gmail) = gmail_world(
        vec![Answer::text("Hello."), Answer::text("Hello again.")],
        &[],
    )
    .await;
    let refused =
        run_under_message_rule(&app, "users_only CHECK (source = 'user') NOT VALID", "hi").await;
    let mut alice = agent_as(app.agent_addr, "alice").await;
    let run = get_run(&mut alice, &refused.run_id)
        .await
        .unwrap()
        .run
        .unwrap();
    assert_eq!(run.state, pb::RunState::Failed as i32);
    assert_eq!(run.error, refused.error, "the run's row says why too");
    app.sql()
        .await
        .batch_execute("ALTER TABLE agent.messages DROP CONSTRAINT users_only")
        .await
        .unwrap();
    the_thread_takes_runs_again(&app, &refused.thread_id).await;
}

/// A-10, R-2: the same when the refusal comes mid-run — a tool call's note in the thread, here
/// — the run stops at that commit and fails at once in the database's words.
#[tokio::test]
async fn a10_a_run_whose_progress_the_database_refuses_mid_run_stops_and_fails_at_once() {
    let (app, _model, _gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("c1", "list_tasks", "{}")]),
            Answer::text("You have no tasks."),
        ],
        &[],
    )
    .await;
    let refused = run_under_message_rule(
        &app,
        "no_tool_notes CHECK (content NOT LIKE 'Ran list_tasks%')",
        "what are my tasks?",
    )
    .await;
    let mut alice = agent_as(app.agent_addr, "alice").await;
    let run = get_run(&mut alice, &refused.run_id)
        .await
        .unwrap()
        .run
        .unwrap();
    assert_eq!(
        run.summary, "",
        "no answer is recorded for a run that failed"
    );
    let notes: Vec<String> = messages(&mut alice, &refused.thread_id)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.content)
        .collect();
    assert!(
        !notes.iter().any(|n| n.starts_with("Ran list_tasks")),
        "{notes:?}"
    );
    assert!(
        notes
            .last()
            .is_some_and(|n| n.contains("could not record its progress")),
        "the failure is told in the thread: {notes:?}"
    );
}

#[tokio::test]
async fn a_cancel_on_one_replica_stops_a_run_executing_on_another() {
    let (mut app, _model, _gmail) = gmail_world(
        vec![Answer::Slow(
            Box::new(Answer::text("too late")),
            Duration::from_secs(20),
        )],
        // Lease renewals (every 20 s) are too slow to carry this cancel: the notice must.
        &[("RUN_LEASE", "60s")],
    )
    .await;
    let second = app.start_another_agent().await;
    let (mut stream, first) = start_streaming(&app, "take your time").await;
    let started = std::time::Instant::now();
    let mut canceller = agent_as(second, "alice").await;
    canceller
        .cancel_run(pb::CancelRunRequest {
            run_id: first.run_id.clone(),
            reason: "asked about the wrong account".into(),
        })
        .await
        .unwrap();
    let mut last = None;
    while let Some(Ok(r)) = stream.next().await {
        last = r.event;
    }
    // The reason given on one replica is in the run's end, written by the other.
    let told = "The run was cancelled: asked about the wrong account";
    match last.and_then(|e| e.kind) {
        Some(pb::run_event::Kind::Result(r)) => {
            assert_eq!(r.status, pb::RunState::Cancelled as i32);
            assert_eq!(r.error, told);
            assert_eq!(
                r.run_id, first.run_id,
                "A-3: a cancelled result names its run"
            );
        }
        other => panic!("not cancelled: {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the notice reached the other replica, not the lease renewal: {:?}",
        started.elapsed()
    );
    let run = get_run(&mut canceller, &first.run_id)
        .await
        .unwrap()
        .run
        .unwrap();
    assert_eq!(run.error, told);
}

#[tokio::test]
async fn e10_a_cancelled_run_keeps_what_its_answered_model_calls_cost_and_get_usage_sums_it() {
    let (app, _model, _gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_1", "list_tasks", "{}")]),
            Answer::Slow(Box::new(Answer::text("too late")), Duration::from_secs(20)),
        ],
        &[("MODEL_PRICES", "gpt-4o=2.5/10/1.25")],
    )
    .await;
    let (mut stream, first) = start_streaming(&app, "what are my tasks?").await;
    // The first model call has answered once its tool has run; the second never will.
    read_until(&mut stream, |k| {
        matches!(k, pb::run_event::Kind::ToolResult(_))
    })
    .await;
    let mut alice = cancel(&app, &first.run_id).await;
    while stream.next().await.is_some() {}

    let run = get_run(&mut alice, &first.run_id)
        .await
        .unwrap()
        .run
        .unwrap();
    assert_eq!(run.state, pb::RunState::Cancelled as i32);
    let usage = run.usage.unwrap();
    // The tool-call answer reports 100 tokens in and 20 out: $2.5 and $10 per million.
    assert_eq!(
        (usage.model_calls, usage.input_tokens, usage.output_tokens),
        (1, 100, 20),
        "the answered call is the run's, cancelled or not"
    );
    assert!(
        (usage.cost_usd - 0.00045).abs() < 1e-12,
        "{}",
        usage.cost_usd
    );
    assert_eq!(run.model, "gpt-4o");
    assert_eq!(run.iterations, 1);
    let sent = run.model_calls[0]
        .started_at
        .expect("when the call was sent");
    let created = run.created_at.unwrap();
    assert!(
        (sent.seconds, sent.nanos / 1_000_000) >= (created.seconds, created.nanos / 1_000_000),
        "sent {sent:?}, after the run was created {created:?}"
    );

    let summed = alice
        .get_usage(pb::GetUsageRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(summed.runs, 1);
    assert_eq!(summed.total, Some(usage));
    let models: Vec<_> = summed
        .models
        .iter()
        .map(|m| {
            (
                m.provider.as_str(),
                m.model.as_str(),
                m.usage.unwrap().model_calls,
            )
        })
        .collect();
    assert_eq!(models, [("openai", "gpt-4o", 1)]);
    let nobody = app
        .agent_as("bob")
        .await
        .get_usage(pb::GetUsageRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (nobody.runs, nobody.models.len()),
        (0, 0),
        "alice's runs are hers"
    );
}

/// A supervised send asked for under a RunBudget of `max_total_tokens`, paused, then approved:
/// the continuation's result, with the world it ran in. The model answers `then` after the send.
async fn an_approved_send_under_a_budget(
    max_total_tokens: u64,
    then: Vec<Answer>,
) -> (TestApp, FakeOpenAi, FakeGmail, pb::RunResult) {
    let mut answers = vec![Answer::tool_calls(&[(
        "call_send",
        "gmail_send",
        SEND_ARGS,
    )])];
    answers.extend(then);
    let (app, model, gmail) = gmail_world(answers, &[]).await;
    let mut budgeted = input("email my boss the budget, then list my tasks");
    budgeted.budget = Some(pb::RunBudget {
        max_total_tokens,
        max_cost_usd: 0.0,
    });
    let paused = run_on(app.agent_addr, budgeted).await;
    assert_eq!(paused.status, pb::RunState::AwaitingConfirmation as i32);
    let decided = app
        .agent_as("alice")
        .await
        .decide_approval(approve(&paused.approval.unwrap().id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gmail.sent().len(), 1, "the approved send is made");
    (app, model, gmail, decided.result.unwrap())
}

#[tokio::test]
async fn a_runs_budget_covers_its_model_calls_after_an_approval_pause_too() {
    // Each tool-call answer reports 100 tokens in and 20 out.
    let (_app, model, _gmail, result) = an_approved_send_under_a_budget(
        150,
        vec![
            Answer::tool_calls(&[("call_list", "list_tasks", "{}")]),
            Answer::text("Sent it, and here are your tasks."),
        ],
    )
    .await;
    // 120 tokens before the pause and 120 after it pass 150: no third model call.
    assert_eq!(model.requests().len(), 2);
    assert_eq!(result.status, pb::RunState::Completed as i32);
    let usage = result.usage.unwrap();
    assert_eq!(
        (usage.model_calls, usage.input_tokens + usage.output_tokens),
        (2, 240)
    );
}

#[tokio::test]
async fn a_budget_spent_before_an_approval_pause_ends_the_continuation_quoting_the_approved_call() {
    // The first answer's 100 + 20 tokens use it all.
    let (_app, model, _gmail, result) =
        an_approved_send_under_a_budget(120, vec![Answer::text("never asked")]).await;
    assert_eq!(model.requests().len(), 1, "no model call past the budget");
    assert!(
        result.summary.starts_with("I stopped because of the token or cost budget for this run. Here's what I was able to gather:\ngmail_send: "),
        "the send that was made is not denied: {}",
        result.summary
    );
}

/// O-1, E-12: a run still going when its replica's drain ends is ended there, as interrupted,
/// in the commit that hands its thread back: a follower on another replica sees the end at
/// once and in words that say what happened (not, a monitor sweep later, "stopped
/// responding"), and the thread takes the next run.
#[tokio::test]
async fn a_replica_shutting_down_ends_its_unfinished_run_as_interrupted_and_frees_its_thread() {
    let (mut app, _model, _gmail) = gmail_world(
        vec![
            Answer::Slow(Box::new(Answer::text("too late")), Duration::from_secs(30)),
            Answer::text("Back again."),
        ],
        &[
            // A lease that would keep the run's thread for a minute if it were not released.
            ("RUN_LEASE", "60s"),
            ("SHUTDOWN_DRAIN_TIMEOUT", "1s"),
        ],
    )
    .await;
    let second = app.start_another_agent().await;
    let (_stream, first) = start_streaming(&app, "take your time").await;
    let stopping = std::time::Instant::now();
    app.stop_service(app.agent_addr).await.unwrap();
    let mut alice = agent_as(second, "alice").await;
    let seen: Vec<pb::RunEvent> = alice
        .watch_run(pb::WatchRunRequest {
            run_id: first.run_id.clone(),
            after_seq: first.seq,
        })
        .await
        .unwrap()
        .into_inner()
        .filter_map(|r| async move { r.ok().and_then(|r| r.event) })
        .collect()
        .await;
    match &seen.last().unwrap().kind {
        Some(pb::run_event::Kind::Error(e)) => {
            assert_eq!(e.kind, pb::FailureKind::Interrupted as i32);
            assert!(
                e.message.contains("the service running it was restarted"),
                "{}",
                e.message
            );
        }
        other => panic!("not ended as interrupted: {other:?}"),
    }
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "ended and released, not left to lapse: {:?}",
        stopping.elapsed()
    );
    let run = alice
        .get_run(pb::GetRunRequest {
            run_id: first.run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(
        (run.state, run.failure_kind),
        (
            pb::RunState::Failed as i32,
            pb::FailureKind::Interrupted as i32
        )
    );
    let mut next = input("hello?");
    next.thread_id = first.thread_id;
    assert_eq!(run_on(second, next).await.summary, "Back again.");
}

/// O-1: a run that starts on a replica after its shutdown began (the request arrived as the
/// drain started) is not left running past it: the `shutting_down` flag stops it as the runs
/// already going were stopped, so it ends INTERRUPTED and hands its thread back at once.
#[tokio::test]
async fn a_run_started_after_its_replicas_shutdown_began_ends_interrupted_and_frees_its_thread() {
    let (mut app, _model, _gmail) = gmail_world(
        vec![Answer::text("Back again."), Answer::text("Back again.")],
        &[("RUN_LEASE", "60s")],
    )
    .await;
    let stopping = app.agent_replicas();
    assert_eq!(stopping.len(), 1);
    // Nothing runs yet: it only marks the replica as shutting down.
    stopping[0].release_all(Duration::from_secs(1)).await;

    let late = run_on(app.agent_addr, input("hello?")).await;
    assert_eq!(
        (late.status, late.failure_kind),
        (
            pb::RunState::Failed as i32,
            pb::FailureKind::Interrupted as i32
        ),
        "{late:?}"
    );
    assert!(
        late.error.contains("the service running it was restarted"),
        "{}",
        late.error
    );
    let other = app.start_another_agent().await;
    let mut next = input("hello again?");
    next.thread_id = late.thread_id;
    assert_eq!(
        run_on(other, next).await.summary,
        "Back again.",
        "the thread was handed back, not held for RUN_LEASE"
    );
}

/// O-1, P-5: a shutdown that comes while an approved send's intent is being committed does not
/// undo the user's decision: once the intent is durable the send goes, once, within the
/// stop's grace, as one the loop had begun would; its action is completed, and the run ends
/// interrupted with the send's result kept for the thread's next run.
#[tokio::test]
async fn a_shutdown_during_an_approved_sends_intent_commit_still_sends_it_once() {
    let (mut app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Anything else?"),
        ],
        // The held commit waits for the test's lock, however slow the machine, and does not fail.
        &[("DATABASE_LOCK_TIMEOUT", "60s")],
    )
    .await;
    let (paused, approval) = paused_send(&app).await;
    // The decision itself writes no action; the intent commit (the action `executing`, its
    // `side_effect` record) does, and waits here.
    let mut holder = app.sql().await;
    let lock = holder.transaction().await.unwrap();
    lock.execute("LOCK TABLE agent.actions IN SHARE MODE", &[])
        .await
        .unwrap();
    let (addr, id) = (app.agent_addr, approval.id.clone());
    let deciding = tokio::spawn(async move {
        agent_as(addr, "alice")
            .await
            .decide_approval(approve(&id))
            .await
    });
    let watcher = app.sql().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    until_a_write_waits_on(
        &watcher,
        "agent.actions",
        &lock,
        deadline,
        "the intent was never committed",
    )
    .await;
    let replica = app.agent_replicas().remove(0);
    let mut stopping = Box::pin(replica.release_all(Duration::from_secs(20)));
    // Its first poll marks the replica as shutting down and stops its runs; then it waits
    // for them, which it does once the intent lands.
    assert!(
        tokio::time::timeout(Duration::ZERO, &mut stopping)
            .await
            .is_err()
    );
    lock.rollback().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("the stop ended well within its 20 s grace, the send done");

    let decided = deciding
        .await
        .unwrap()
        .expect("the decision was taken")
        .into_inner();
    assert_eq!(
        decided.approval.unwrap().state,
        pb::ApprovalState::Approved as i32
    );
    let ended = decided.result.unwrap();
    assert_eq!(
        (ended.status, ended.failure_kind),
        (
            pb::RunState::Failed as i32,
            pb::FailureKind::Interrupted as i32
        ),
        "{ended:?}"
    );
    assert_eq!(gmail.sent().len(), 1, "the approved send went, once");
    let action: String = watcher
        .query_one(
            "SELECT state FROM agent.actions WHERE run_id = $1 AND tool = 'gmail_send'",
            &[&paused.run_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(action, "completed");

    let other = app.start_another_agent().await;
    let mut next = input("thanks");
    next.thread_id = paused.thread_id;
    assert_eq!(run_on(other, next).await.summary, "Anything else?");
    let sent = tool_messages(&model.requests().last().unwrap().1);
    assert!(
        sent.len() == 1 && !sent[0].1.contains("Not executed"),
        "the next run reads what the send came to: {sent:?}"
    );
}

/// O-1, E-12: an approval decided on a replica whose shutdown has begun is recorded, and its
/// continuation stops before it touches the call, leaving the run live with its lease let go:
/// another replica's monitor carries the decision out, the mail goes once, and the decider,
/// still following on the stopping replica, sees the run complete.
#[tokio::test]
async fn a_decision_taken_as_its_replica_shuts_down_is_carried_out_by_another_replica_once() {
    let (mut app, _model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Sent it."),
        ],
        // The test sweeps by hand.
        &[("HEALTH_MONITOR_INTERVAL", "3600s")],
    )
    .await;
    let (paused, approval) = paused_send(&app).await;
    app.start_another_agent().await;
    // The replica started last comes first; the first one serves `app.agent_addr`.
    let [other, stopping] = <[_; 2]>::try_from(app.agent_replicas()).ok().unwrap();
    // Nothing runs: it only marks the replica as shutting down.
    stopping.release_all(Duration::from_secs(1)).await;

    let (addr, id) = (app.agent_addr, approval.id.clone());
    let deciding = tokio::spawn(async move {
        agent_as(addr, "alice")
            .await
            .decide_approval(approve(&id))
            .await
    });
    // Once the stopped continuation has let go of the run, the other replica's monitor takes
    // it up.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while other.sweep_stale_runs(Duration::ZERO).await.unwrap() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the decided run was never handed over"
        );
        tokio::task::yield_now().await;
    }
    let decided = deciding
        .await
        .unwrap()
        .expect("the decision was taken")
        .into_inner();
    assert_eq!(
        decided.approval.unwrap().state,
        pb::ApprovalState::Approved as i32
    );
    let ended = decided.result.unwrap();
    assert_eq!(
        (ended.status, ended.summary.as_str()),
        (pb::RunState::Completed as i32, "Sent it."),
        "{ended:?}"
    );
    assert_eq!(gmail.sent().len(), 1, "sent once");
    assert_eq!(
        sql_count(
            &app,
            "SELECT count(*) FROM agent.actions WHERE run_id = $1 AND state = 'completed'",
            &paused.run_id
        )
        .await,
        1
    );
}

/// O-1: a shutdown that comes while a run is still being prepared — its tool list and memory
/// asked of a gateway that does not answer — does not wait for the gateway (nothing it asked
/// needs undoing): the run ends interrupted at once, long before the gateway's timeouts, and
/// its thread is handed back.
#[tokio::test]
async fn a_run_stopped_while_its_gateway_does_not_answer_ends_interrupted_at_once() {
    let (mut app, _model, _gmail) =
        gmail_world(vec![Answer::text("Back again.")], &[("RUN_LEASE", "60s")]).await;
    // A gateway that takes connections and never answers; each byte it is sent is counted.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let (asked, mut asking) = tokio::sync::watch::channel(0usize);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = silent.accept().await {
            let asked = asked.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await {
                    asked.send_modify(|total| *total += n);
                }
            });
        }
    });
    let stuck = app
        .start_another_agent_with(&[("GATEWAY_URL", silent_url.as_str())])
        .await;
    // The replica started last comes first.
    let replica = app.agent_replicas().remove(0);
    let before = *asking.borrow_and_update();
    let mut stream = agent_as(stuck, "alice")
        .await
        .run_stream(pb::RunStreamRequest {
            input: Some(input("what is on today?")),
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap().event.unwrap();
    tokio::time::timeout(
        Duration::from_secs(20),
        asking.wait_for(|total| *total > before),
    )
    .await
    .expect("the run asked the gateway")
    .unwrap();

    let stopping = std::time::Instant::now();
    replica.release_all(Duration::from_secs(20)).await;
    let mut last = None;
    while let Some(Ok(r)) = stream.next().await {
        last = r.event;
    }
    let waited = stopping.elapsed();
    match last.and_then(|e| e.kind) {
        Some(pb::run_event::Kind::Error(e)) => {
            assert_eq!(e.kind, pb::FailureKind::Interrupted as i32, "{e:?}");
        }
        other => panic!("not ended as interrupted: {other:?}"),
    }
    assert!(
        waited < Duration::from_secs(5),
        "ended without waiting for the gateway's timeouts: {waited:?}"
    );
    let mut next = input("hello again?");
    next.thread_id = first.thread_id;
    assert_eq!(
        run_on(app.agent_addr, next).await.summary,
        "Back again.",
        "the thread was handed back, not held for RUN_LEASE"
    );
}

/// Thread `t-crash` of alice's, as a run on a replica that died leaves it: the model asked
/// for two sends, both recorded as executing; `call_sent` reached Gmail, `call_lost` did not.
async fn a_thread_whose_run_died_during_two_sends(app: &TestApp) {
    a_thread_whose_run_died_before_its_sends_were_made(app).await;
    the_dead_run_sends(app, "call_sent").await;
}

/// The dead run's call `call_id` made at the gateway, under its idempotency key.
async fn the_dead_run_sends(app: &TestApp, call_id: &str) {
    let sent = steward_tests::calls::call_tool_keyed(
        &mut app.gateway_as("alice").await,
        "gmail_send",
        serde_json::from_str(SEND_ARGS).unwrap(),
        &agent_svc::store::action_id("r-crash", call_id),
    )
    .await;
    assert!(sent.ok, "{sent:?}");
}

/// Thread `t-crash` with the dead run's two sends recorded as executing, neither made yet.
async fn a_thread_whose_run_died_before_its_sends_were_made(app: &TestApp) {
    use agent_svc::store::{
        Action, ActionState, Admission, Admitted, AgentStore, RunCommit, action_id,
    };
    let store = app.agent_store().await;
    store
        .create_thread("t-crash", "alice", "sends")
        .await
        .unwrap();
    let now = std::time::SystemTime::now();
    let Admitted::Started { lease, .. } = store
        .admit(&Admission {
            run: agent_svc::store::Run::queued("r-crash", "t-crash", "alice", "web"),
            new_thread_title: None,
            user_message: Some("send both".into()),
            first_event: Vec::new(),
            lease: Duration::from_secs(60),
            max_active_runs: 8,
            supersede_event: Vec::new(),
            supersede_message: String::new(),
            supersede_paused: true,
            summaries: 0,
        })
        .await
        .unwrap()
    else {
        panic!("not admitted");
    };
    let call =
        |id: &str| serde_json::json!({"id": id, "name": "gmail_send", "arguments": SEND_ARGS});
    let executing = |call_id: &str| Action {
        id: action_id("r-crash", call_id),
        run_id: "r-crash".into(),
        call_id: call_id.into(),
        tool: "gmail_send".into(),
        arguments: serde_json::from_str(SEND_ARGS).unwrap(),
        side_effect: true,
        state: ActionState::Executing,
        result_text: None,
        error_kind: None,
        approval_id: None,
        transitions: vec![ActionState::Planned, ActionState::Executing],
        created_at: now,
        updated_at: now,
    };
    store
        .commit(
            &lease,
            RunCommit {
                history: vec![
                    serde_json::json!({"role": "user", "content": "send both"}).to_string().into(),
                    serde_json::json!({"role": "assistant", "content": {"text": "", "tool_calls": [call("call_sent"), call("call_lost")]}}).to_string().into(),
                ],
                actions: vec![executing("call_sent"), executing("call_lost")],
                ..RunCommit::default()
            },
        )
        .await
        .unwrap();
    store.release_lease(&lease).await.unwrap();
}

/// The two calls a dead run left open, as the next run's model is told of them: what the
/// gateway recorded, not a guess.
fn assert_closed_from_the_record(request: &serde_json::Value) {
    let tool_messages = tool_messages(request);
    assert_eq!(tool_messages.len(), 2, "{tool_messages:?}");
    assert_eq!(tool_messages[0].0, "call_sent");
    assert!(
        tool_messages[0].1.contains("completed") && tool_messages[0].1.contains("Sent"),
        "{}",
        tool_messages[0].1
    );
    assert_eq!(tool_messages[1].0, "call_lost");
    assert!(
        tool_messages[1].1.starts_with("Not executed"),
        "{}",
        tool_messages[1].1
    );
}

/// Alice asks on `t-crash` what became of the dead run's sends.
fn asked_about_the_sends() -> pb::RunInput {
    let mut asked = input("did they go out?");
    asked.thread_id = "t-crash".into();
    asked
}

/// A run that could not learn what an open send came to: failed as the gateway being
/// unavailable, in words `saying`.
fn assert_failed_not_knowing_yet(failed: &pb::RunResult, saying: &str) {
    assert_eq!(
        (failed.status, failed.failure_kind),
        (
            pb::RunState::Failed as i32,
            pb::FailureKind::GatewayUnavailable as i32
        ),
        "{failed:?}"
    );
    assert!(failed.error.contains(saying), "{}", failed.error);
}

#[tokio::test]
async fn calls_left_open_by_a_dead_run_are_closed_with_what_the_gateway_recorded() {
    let (app, model, gmail) =
        gmail_world(vec![Answer::text("One went out, one did not.")], &[]).await;
    a_thread_whose_run_died_during_two_sends(&app).await;

    let result = run_on(app.agent_addr, asked_about_the_sends()).await;
    assert_eq!(result.status, pb::RunState::Completed as i32);
    assert_closed_from_the_record(&model.requests()[0].1);
    assert_eq!(gmail.sent().len(), 1, "nothing was sent again");
}

/// P-4: a dead run's open sends are looked up side by side, not one after another: with the
/// gateway's idempotency table locked, both lookups wait on the lock at once (one after
/// another, only the first would). Once it is released the run answers both from the record.
#[tokio::test]
async fn p4_the_open_sends_of_a_dead_run_are_looked_up_side_by_side() {
    let (app, model, _gmail) =
        gmail_world(vec![Answer::text("One went out, one did not.")], &[]).await;
    a_thread_whose_run_died_during_two_sends(&app).await;
    let lock = app.sql().await;
    lock.batch_execute("BEGIN; LOCK TABLE gateway.idempotency IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let run = tokio::spawn(run_on(app.agent_addr, asked_about_the_sends()));
    let watch = app.sql().await;
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let waiting: i64 = watch
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                       AND query LIKE 'SELECT state, tool, args_sha256%'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if waiting >= 2 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("both lookups wait on the locked table at once");
    lock.batch_execute("COMMIT").await.unwrap();
    let result = run.await.unwrap();
    assert_eq!(
        result.status,
        pb::RunState::Completed as i32,
        "{}",
        result.error
    );
    assert_closed_from_the_record(&model.requests()[0].1);
}

/// P-4, R-3: a run that cannot learn from the gateway what an open send came to fails, saying
/// so, and writes no answer for it: a guess would join the thread's history for good (here
/// "outcome unknown" for a send that went out). The thread's next run, with the gateway
/// answering, closes both calls from the record.
#[tokio::test]
async fn a_run_that_cannot_look_up_an_open_send_fails_and_leaves_it_for_the_next_run() {
    let (mut app, model, gmail) =
        gmail_world(vec![Answer::text("One went out, one did not.")], &[]).await;
    a_thread_whose_run_died_during_two_sends(&app).await;
    let cut_off = app
        .start_another_agent_with(&[("GATEWAY_URL", "http://127.0.0.1:1")])
        .await;

    let asked = asked_about_the_sends();
    let failed = run_on(cut_off, asked.clone()).await;
    assert_failed_not_knowing_yet(&failed, "could not say yet what it came to");
    assert!(model.requests().is_empty(), "the model was not asked");

    let result = run_on(app.agent_addr, asked).await;
    assert_eq!(result.status, pb::RunState::Completed as i32);
    assert_closed_from_the_record(&model.requests()[0].1);
    assert_eq!(gmail.sent().len(), 1, "nothing was sent again");
}

/// P-4: a send still at Gmail when the thread's next run starts (its run's replica died, the
/// gateway's call goes on) is not known yet: the run fails, saying so, and writes nothing for
/// it; once the send has answered, the next run closes it from the record.
#[tokio::test]
async fn an_open_send_still_running_at_the_gateway_fails_the_run_until_its_result_is_recorded() {
    let (app, model, gmail) =
        gmail_world(vec![Answer::text("One went out, one did not.")], &[]).await;
    a_thread_whose_run_died_before_its_sends_were_made(&app).await;
    let gate = gmail.hold_sends();
    let sending = {
        let gateway = app.gateway_as("alice").await;
        tokio::spawn(async move {
            let mut gateway = gateway;
            steward_tests::calls::call_tool_keyed(
                &mut gateway,
                "gmail_send",
                serde_json::from_str(SEND_ARGS).unwrap(),
                &agent_svc::store::action_id("r-crash", "call_sent"),
            )
            .await
        })
    };
    gate.arrived().await;

    let asked = asked_about_the_sends();
    let early = run_on(app.agent_addr, asked.clone()).await;
    assert_failed_not_knowing_yet(&early, "still running");
    assert!(model.requests().is_empty(), "the model was not asked");

    gate.release();
    assert!(sending.await.unwrap().ok);
    let result = run_on(app.agent_addr, asked).await;
    assert_eq!(result.status, pb::RunState::Completed as i32);
    assert_closed_from_the_record(&model.requests()[0].1);
}

/// P-4, R-3: a send whose call ended without recording what it did (its gateway replica died
/// after the write left, its hold long lapsed) will never be known: the gateway says so, and
/// the run answers it "outcome unknown" and goes on, rather than failing every run after.
#[tokio::test]
async fn an_open_send_that_ended_unrecorded_is_answered_as_unknown_for_good() {
    let (app, model, _gmail) = gmail_world(vec![Answer::text("I cannot tell.")], &[]).await;
    a_thread_whose_run_died_before_its_sends_were_made(&app).await;
    // What a gateway replica that died mid-send leaves: the key held, marked acting, lapsed.
    app.sql()
        .await
        .execute(
            "INSERT INTO gateway.idempotency (user_id, key, tool, args_sha256, state, holder, lease_until, acting) \
             VALUES ('alice', $1, '', '', 'pending', 'a-dead-replica', now() - interval '1 minute', true)",
            &[&agent_svc::store::action_id("r-crash", "call_sent")],
        )
        .await
        .unwrap();

    let result = run_on(app.agent_addr, asked_about_the_sends()).await;
    assert_eq!(result.status, pb::RunState::Completed as i32, "{result:?}");
    let answered = tool_messages(&model.requests()[0].1);
    assert_eq!(answered[0].0, "call_sent");
    assert!(
        answered[0].1.starts_with("The outcome is unknown"),
        "{}",
        answered[0].1
    );
    assert!(
        answered[1].1.starts_with("Not executed"),
        "{}",
        answered[1].1
    );
}

/// RUN_EVENTS_RETENTION: once a run has ended longer ago than the retention, the pruner
/// thins its events to the result: a watch from the start replays the result alone, under its
/// own number, and the run and its thread read as before.
#[tokio::test]
async fn a_run_past_the_events_retention_replays_its_result_alone() {
    let (app, _model, _gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_list", "list_tasks", "{}")]),
            Answer::text("Nothing due."),
        ],
        &[],
    )
    .await;
    let done = run_on(app.agent_addr, input("what is due?")).await;
    assert_eq!(done.status, pb::RunState::Completed as i32);
    let before = events(&app, &done.run_id, 0).await;
    assert!(before.len() > 2, "{before:?}");

    let replica = app.agent_replicas()[0].clone();
    let hour = Duration::from_secs(3600);
    assert_eq!(
        replica
            .prune_run_events(hour, std::time::SystemTime::now())
            .await
            .unwrap(),
        0,
        "ended just now: within the retention"
    );
    let thinned = replica
        .prune_run_events(hour, std::time::SystemTime::now() + 2 * hour)
        .await
        .unwrap();
    assert_eq!(thinned, 1);

    let after = events(&app, &done.run_id, 0).await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0].seq, before.last().unwrap().seq);
    match &after[0].kind {
        Some(pb::run_event::Kind::Result(r)) => assert_eq!(r.summary, "Nothing due."),
        other => panic!("not the result: {other:?}"),
    }
    let run = app
        .agent_as("alice")
        .await
        .get_run(pb::GetRunRequest {
            run_id: done.run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(run.state, pb::RunState::Completed as i32);
}

#[tokio::test]
async fn a_caller_gone_mid_admission_leaves_no_run_that_nothing_runs() {
    // On PostgreSQL an admission's COMMIT goes out with its statements, so once a call has
    // begun its admission the run may be admitted whatever becomes of the caller. Callers give
    // up after deadlines short enough to end their calls before, during and after admission;
    // each then retries with the same request id, which finds the run it left behind (or
    // starts one), and that run must reach its end — not wait, admitted but never started,
    // for its lease to lapse.
    let deadlines_us = [0u64, 100, 300, 1_000, 3_000, 10_000];
    let (app, _model, _gmail) =
        gmail_world(vec![Answer::text("Done."); deadlines_us.len()], &[]).await;
    for (i, deadline) in deadlines_us.into_iter().enumerate() {
        let mut req = input("hi");
        req.request_id = format!("gone-{i}");
        let mut call = tonic::Request::new(pb::RunStreamRequest {
            input: Some(req.clone()),
        });
        call.set_timeout(Duration::from_micros(deadline));
        // Whatever this answers (most often DEADLINE_EXCEEDED), the caller walks away.
        drop(app.agent_as("alice").await.run_stream(call).await);
        let result = tokio::time::timeout(Duration::from_secs(20), run_on(app.agent_addr, req))
            .await
            .unwrap_or_else(|_| panic!("the run of a caller gone after {deadline} µs never ended"));
        assert_eq!(
            result.status,
            pb::RunState::Completed as i32,
            "after {deadline} µs: {result:?}"
        );
    }
}

/// A-8: a client following a run that executes on another replica, who leaves part way, lets
/// go of everything its watch held on the replica it watched from, while the run goes on to
/// its end for the client that started it.
#[tokio::test]
async fn a8_a_watcher_that_leaves_a_run_on_another_replica_lets_go_of_its_registration() {
    use steward_tests::rule_model::{RuleModel, RuleOptions};
    let model = RuleModel::start_with(RuleOptions {
        // Long enough that the run is still live while the watcher comes and goes, and makes
        // no event the watcher could notice its client gone by.
        slow: Duration::from_secs(6),
        ..RuleOptions::default()
    })
    .await;
    let mut app = steward_tests::spawn::spawn_app_with(
        Backend::Postgres,
        &[
            ("MODEL_CHAIN", "openai/gpt-4o-mini"),
            ("OPENAI_BASE_URL", &model.url),
            ("OPENAI_API_KEY", "test"),
        ],
    )
    .await;
    let other = app.start_another_agent().await;
    let watched_from = app.agent_replicas()[0].clone();
    assert_eq!(watched_from.live_registrations(), 0);

    let (mut started, first) = start_streaming(&app, "a slow question").await;

    let mut watcher = agent_as(other, "alice")
        .await
        .watch_run(pb::WatchRunRequest {
            run_id: first.run_id.clone(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let replayed = watcher.next().await.unwrap().unwrap().event.unwrap();
    assert_eq!(replayed.seq, 1, "the watch replays the run from the store");
    assert!(
        watched_from.live_registrations() > 0,
        "the watch waits for notices of the run"
    );

    drop(watcher);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while watched_from.live_registrations() > 0 && tokio::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        watched_from.live_registrations(),
        0,
        "nothing is held for a watcher that left"
    );
    assert!(
        app.agent_replicas()[1].live_registrations() > 0,
        "let go while the run was still executing, not when it ended"
    );

    let mut last = first;
    while let Some(item) = started.next().await {
        last = item.unwrap().event.unwrap();
    }
    let Some(pb::run_event::Kind::Result(result)) = last.kind else {
        panic!("the run's own stream ends with its result: {last:?}");
    };
    assert_eq!(result.status(), pb::RunState::Completed, "{}", result.error);
}

/// P-5, R-2: a send whose run ended while it was executing (its result never recorded) is
/// closed by the thread's next run with what the gateway knows of it — in the transcript, and
/// in the audit trail as the `side_effect_result` its `side_effect` record was waiting for.
#[tokio::test]
async fn a_send_its_run_left_executing_is_closed_by_the_next_run_with_what_the_gateway_knows() {
    let (app, model, gmail) = gmail_world(
        vec![Answer::text("Hello."), Answer::text("Noted, it went out.")],
        &[],
    )
    .await;
    let first = run_on(app.agent_addr, input("hi")).await;
    // The first run's model called gmail_send, the action was committed executing, and the
    // send went out at the gateway; then the run's replica died before it recorded the result.
    let action_id = format!("{}/call_lost", first.run_id);
    let sql = app.sql().await;
    let turn = serde_json::json!({"role": "assistant", "content": {"text": "", "tool_calls": [
        {"id": "call_lost", "name": "gmail_send", "arguments": SEND_ARGS}]}});
    sql.execute(
        "INSERT INTO agent.llm_history (thread_id, seq, turn) \
         SELECT $1, COALESCE(max(seq), 0) + 1, $2 FROM agent.llm_history WHERE thread_id = $1",
        &[&first.thread_id, &turn],
    )
    .await
    .unwrap();
    let args: serde_json::Value = serde_json::from_str(SEND_ARGS).unwrap();
    sql.execute(
        "INSERT INTO agent.actions (id, run_id, call_id, tool, arguments, side_effect, state) \
         VALUES ($1, $2, 'call_lost', 'gmail_send', $3, true, 'executing')",
        &[&action_id, &first.run_id, &args],
    )
    .await
    .unwrap();
    let sent = steward_tests::calls::call_tool_keyed(
        &mut app.gateway_as("alice").await,
        "gmail_send",
        args,
        &action_id,
    )
    .await;
    assert!(sent.ok, "{sent:?}");

    let mut next = input("did my email go out?");
    next.thread_id = first.thread_id.clone();
    assert_eq!(
        run_on(app.agent_addr, next).await.summary,
        "Noted, it went out."
    );
    assert_eq!(
        gmail.sent().len(),
        1,
        "closed from what is known, not sent again"
    );
    let requests = model.requests();
    let told = serde_json::to_string(&requests[1].1["messages"]).unwrap();
    assert!(
        told.contains("This call completed, but its run ended before it recorded the result."),
        "{told}"
    );
    let outcome: serde_json::Value = sql
        .query_one(
            "SELECT detail FROM agent.audit WHERE kind = 'side_effect_result'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        (&outcome["call_id"], &outcome["tool"], &outcome["ok"]),
        (
            &serde_json::json!("call_lost"),
            &serde_json::json!("gmail_send"),
            &serde_json::json!(true)
        ),
        "{outcome}"
    );
}

/// Reads `stream` up to and including the first event whose kind `is` picks.
async fn read_until(
    stream: &mut tonic::Streaming<pb::RunStreamResponse>,
    is: fn(&pb::run_event::Kind) -> bool,
) {
    while let Some(Ok(r)) = stream.next().await {
        if r.event.and_then(|e| e.kind).is_some_and(|k| is(&k)) {
            return;
        }
    }
}

/// CancelRun of alice's run, without a reason; her client.
async fn cancel(app: &TestApp, run_id: &str) -> steward_tests::UserAgent {
    let mut alice = app.agent_as("alice").await;
    alice
        .cancel_run(pb::CancelRunRequest {
            run_id: run_id.to_owned(),
            reason: String::new(),
        })
        .await
        .unwrap();
    alice
}

/// Runs `prompt` on alice's `thread_id` to completion, on the replica at `agent`, and returns
/// the tool results its last model request carried: the thread's transcript as the model
/// sees it.
async fn tool_results_the_next_run_sends(
    agent: std::net::SocketAddr,
    model: &FakeOpenAi,
    thread_id: &str,
    prompt: &str,
) -> Vec<String> {
    let next = run_on(
        agent,
        pb::RunInput {
            thread_id: thread_id.to_owned(),
            ..input(prompt)
        },
    )
    .await;
    assert_eq!(
        next.status,
        pb::RunState::Completed as i32,
        "{}",
        next.error
    );
    let (_, sent) = model.requests().pop().unwrap();
    tool_messages(&sent)
        .into_iter()
        .map(|(_, content)| content)
        .collect()
}

/// Everything a streaming run sends until its stream ends.
async fn rest_of(mut stream: tonic::Streaming<pb::RunStreamResponse>) -> Vec<pb::RunEvent> {
    let mut all = Vec::new();
    while let Some(Ok(r)) = stream.next().await {
        all.extend(r.event);
    }
    all
}

fn tool_results(events: &[pb::RunEvent]) -> Vec<pb::ToolResultEvent> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(pb::run_event::Kind::ToolResult(r)) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

fn ended_cancelled(events: &[pb::RunEvent]) -> bool {
    matches!(
        events.last().and_then(|e| e.kind.as_ref()),
        Some(pb::run_event::Kind::Result(r)) if r.status == pb::RunState::Cancelled as i32
    )
}

/// A cancel that lands while a send is at Gmail does not drop it: the run waits for the
/// send's answer, records what it came to, and then ends cancelled without asking the model
/// again. Dropped mid-call, the send's action stayed `executing` with its outcome unknown
/// until the thread's next run asked the gateway.
#[tokio::test]
async fn a_cancel_during_a_send_already_at_gmail_records_what_it_came_to_and_ends_cancelled() {
    let (app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Sent."),
        ],
        &[("AGENT_DEFAULT_TRUST_LEVEL", "autonomous")],
    )
    .await;
    let gate = gmail.hold_sends();
    let (stream, first) = start_streaming(&app, "send the budget to my boss").await;
    gate.arrived().await;
    let mut alice = cancel(&app, &first.run_id).await;
    gate.release();
    let events = rest_of(stream).await;
    assert!(ended_cancelled(&events), "{:?}", events.last());
    let results = tool_results(&events);
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(
        results[0].ok && results[0].tool == "gmail_send",
        "{results:?}"
    );
    assert_eq!(gmail.sent().len(), 1);
    assert_eq!(model.requests().len(), 1, "no model call after the cancel");
    let actions = get_run(&mut alice, &first.run_id).await.unwrap().actions;
    assert_eq!(actions.len(), 1);
    assert_eq!(
        actions[0].state,
        pb::ActionState::Completed as i32,
        "{:?}",
        actions[0]
    );
    let outcome: serde_json::Value = app
        .sql()
        .await
        .query_one(
            "SELECT detail FROM agent.audit WHERE run_id = $1 AND kind = 'side_effect_result'",
            &[&first.run_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        outcome["ok"], true,
        "the audit trail says it happened: {outcome}"
    );
}

/// A read does not hold a cancel up: a search Gmail never answers is abandoned, the run ends
/// cancelled at once, and the call is answered as cut short — in its action, its result event
/// and the thread's transcript, which the thread's next run sends as it is.
#[tokio::test]
async fn a_cancel_during_a_read_ends_the_run_at_once_and_answers_the_read_as_cut_short() {
    let (app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_find", "search_gmail", r#"{"query":"budget"}"#)]),
            Answer::text("Anything else?"),
        ],
        &[],
    )
    .await;
    gmail.hang("tok-alice");
    let (mut stream, first) = start_streaming(&app, "find the budget mail").await;
    read_until(&mut stream, |k| {
        matches!(k, pb::run_event::Kind::ToolCall(_))
    })
    .await;
    let mut alice = cancel(&app, &first.run_id).await;
    let events = tokio::time::timeout(Duration::from_secs(10), rest_of(stream))
        .await
        .expect("the cancel does not wait for the hanging search");
    assert!(ended_cancelled(&events), "{:?}", events.last());
    let results = tool_results(&events);
    assert_eq!(results.len(), 1, "{results:?}");
    assert!(
        !results[0].ok && results[0].error_kind == "CANCELLED",
        "{results:?}"
    );
    let actions = get_run(&mut alice, &first.run_id).await.unwrap().actions;
    assert_eq!(actions[0].state, pb::ActionState::Failed as i32);
    assert!(
        actions[0]
            .result_text
            .starts_with("Not completed: the run was cancelled while this call ran."),
        "{:?}",
        actions[0]
    );
    // The thread's next run sends the transcript as it was closed.
    let told =
        tool_results_the_next_run_sends(app.agent_addr, &model, &first.thread_id, "never mind")
            .await;
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(
        told[0].contains("the run was cancelled while this call ran"),
        "{told:?}"
    );
}

/// A world whose model first answers with the tool call `call` (id, tool, arguments), held
/// until the returned gate opens, then with `then`. Its lease is a minute long, so a cancel
/// that reaches the run within the test came by its own check, not by a lease renewal.
async fn a_world_whose_call_waits(
    (id, tool, args): (&str, &str, &str),
    then: &str,
    env: &[(&str, &str)],
) -> (
    TestApp,
    FakeOpenAi,
    FakeGmail,
    std::sync::Arc<tokio::sync::Notify>,
) {
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut env = env.to_vec();
    env.push(("RUN_LEASE", "60s"));
    let (app, model, gmail) = gmail_world(
        vec![
            Answer::Held(
                Box::new(Answer::tool_calls(&[(id, tool, args)])),
                gate.clone(),
            ),
            Answer::text(then),
        ],
        &env,
    )
    .await;
    (app, model, gmail, gate)
}

/// How many task agents are in the queue, in any state.
async fn task_agents_queued(app: &TestApp) -> i64 {
    app.sql()
        .await
        .query_one("SELECT count(*) FROM agent.task_agents", &[])
        .await
        .unwrap()
        .get(0)
}

/// Once the run has asked the model (whose answer is held), records a cancel of `run_id` as
/// CancelRun on another replica writes it, with no notice sent.
async fn cancel_without_its_notice_once_asked(app: &TestApp, model: &FakeOpenAi, run_id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while model.requests().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the model was never called"
        );
        tokio::task::yield_now().await;
    }
    app.sql()
        .await
        .execute(
            "UPDATE agent.runs SET cancel_requested = true WHERE id = $1",
            &[&run_id],
        )
        .await
        .unwrap();
}

/// A cancel another replica recorded, whose notice never reached this one, still stops a send:
/// the run asks just before a side effect leaves, rather than learning of it at its next lease
/// renewal (a third of the lease, here 20 s) after the mail went out.
#[tokio::test]
async fn a_cancel_recorded_without_its_notice_stops_a_send_before_it_leaves() {
    let (app, model, gmail, gate) = a_world_whose_call_waits(
        ("call_send", "gmail_send", SEND_ARGS),
        "Sent.",
        &[("AGENT_DEFAULT_TRUST_LEVEL", "autonomous")],
    )
    .await;
    let (stream, first) = start_streaming(&app, "send the budget to my boss").await;
    cancel_without_its_notice_once_asked(&app, &model, &first.run_id).await;
    let started = std::time::Instant::now();
    gate.notify_one();
    let events = rest_of(stream).await;
    assert!(ended_cancelled(&events), "{:?}", events.last());
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "stopped by the check, not by a lease renewal: {:?}",
        started.elapsed()
    );
    assert!(gmail.sent().is_empty(), "the send left after the cancel");
    let mut alice = app.agent_as("alice").await;
    let actions = get_run(&mut alice, &first.run_id).await.unwrap().actions;
    assert_eq!(actions[0].state, pb::ActionState::Failed as i32);
    assert_eq!(
        actions[0].result_text,
        "Not executed: the run was cancelled before this call ran."
    );
}

/// B-5: queuing a task agent is treated as a side effect is — a cancel recorded on another
/// replica, whose notice never arrived, stops it before the task is queued, and the call is
/// answered "not executed" rather than a task started behind the user's cancel.
#[tokio::test]
async fn b5_a_cancel_recorded_without_its_notice_stops_a_task_agent_before_it_is_queued() {
    let task = r#"{"instructions":"Watch for the reply","goal":"reply watch"}"#;
    let (app, model, _gmail, gate) = a_world_whose_call_waits(
        ("call_task", "create_task_agent", task),
        "I'll watch for the reply.",
        &[("TASK_AGENT_WORKERS", "false")],
    )
    .await;
    let (stream, first) = start_streaming(&app, "watch for the boss's reply").await;
    cancel_without_its_notice_once_asked(&app, &model, &first.run_id).await;
    gate.notify_one();
    let events = rest_of(stream).await;
    assert!(ended_cancelled(&events), "{:?}", events.last());
    let results = tool_results(&events);
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].error_kind, "CANCELLED", "{results:?}");
    assert_eq!(
        task_agents_queued(&app).await,
        0,
        "no task queued behind the cancel"
    );
}

/// A shutdown that stops a run while its send is at Gmail gives the send a moment (3 s) to
/// answer, so the run hands its thread back with the send recorded as done — not `executing`
/// with its outcome unknown. The drain here waits for nothing, so the stop comes mid-send.
#[tokio::test]
async fn a_shutdown_during_a_send_records_what_it_came_to_before_the_run_is_handed_back() {
    let never = std::sync::Arc::new(tokio::sync::Notify::new());
    let (mut app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::Held(Box::new(Answer::text("Sent.")), never),
        ],
        &[
            ("AGENT_DEFAULT_TRUST_LEVEL", "autonomous"),
            ("SHUTDOWN_DRAIN_TIMEOUT", "0s"),
        ],
    )
    .await;
    let gate = gmail.hold_sends();
    let (_stream, first) = start_streaming(&app, "send the budget to my boss").await;
    gate.arrived().await;
    // Answered 2 s after the stop begins: inside the 3 s grace, long after the drain (0 s).
    gmail.delay_sends(Duration::from_secs(2));
    gate.release();
    let agent = app.agent_addr;
    app.stop_service(agent)
        .await
        .expect("agent-svc stops cleanly");
    assert_eq!(gmail.sent().len(), 1);
    assert_eq!(
        model.requests().len(),
        1,
        "the stop came while the send was at Gmail: the run asked the model nothing after it"
    );
    let sql = app.sql().await;
    let state: String = sql
        .query_one(
            "SELECT state FROM agent.actions WHERE run_id = $1",
            &[&first.run_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "completed");
    let outcome: serde_json::Value = sql
        .query_one(
            "SELECT detail FROM agent.audit WHERE run_id = $1 AND kind = 'side_effect_result'",
            &[&first.run_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(outcome["ok"], true, "{outcome}");
}

/// A shutdown that stops a run in the middle of a batch (a read answered, a send at Gmail)
/// records both calls as they came out before handing the run back: the thread's next run, on
/// another replica, shows the model both results as the stopped run wrote them — the send as
/// sent, neither "not executed" nor unknown — and nothing is sent twice.
#[tokio::test]
async fn a_shutdown_mid_batch_records_every_call_of_the_batch_for_the_threads_next_run() {
    let (mut app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[
                ("call_list", "list_tasks", "{}"),
                ("call_send", "gmail_send", SEND_ARGS),
            ]),
            // The next run's: the stopped one asks the model nothing more.
            Answer::text("Both done."),
        ],
        &[
            ("AGENT_DEFAULT_TRUST_LEVEL", "autonomous"),
            ("SHUTDOWN_DRAIN_TIMEOUT", "0s"),
        ],
    )
    .await;
    let second = app.start_another_agent().await;
    let gate = gmail.hold_sends();
    let (_stream, first) = start_streaming(&app, "list my tasks and send the budget").await;
    gate.arrived().await;
    // Answered inside the stop's 3 s grace, after the drain (0 s) has given up.
    gmail.delay_sends(Duration::from_secs(1));
    gate.release();
    app.stop_service(app.agent_addr)
        .await
        .expect("agent-svc stops cleanly");
    assert_eq!(model.requests().len(), 1, "the stop came mid-batch");

    let sql = app.sql().await;
    let states: Vec<(String, String)> = sql
        .query(
            "SELECT tool, state FROM agent.actions WHERE run_id = $1 ORDER BY tool",
            &[&first.run_id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        states,
        [
            ("gmail_send".to_owned(), "completed".to_owned()),
            ("list_tasks".to_owned(), "completed".to_owned())
        ]
    );
    let results =
        tool_results_the_next_run_sends(second, &model, &first.thread_id, "did both happen?").await;
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(
        results
            .iter()
            .all(|text| !text.contains("Not executed") && !text.contains("unknown")),
        "{results:?}"
    );
    assert!(
        results.iter().any(|text| text.contains("Sent")),
        "the send's own result: {results:?}"
    );
    assert_eq!(gmail.sent().len(), 1, "nothing was sent again");
}

/// A shutdown while an approved send is at Gmail gives the send the stop's grace (3 s), not
/// the call's whole deadline: the replica ends the run INTERRUPTED and hands its thread back
/// inside its 5 s, and the send, which left with no word of what it came to, stays `executing`
/// with its intent recorded — for the thread's next run to look up, never "not executed".
#[tokio::test]
async fn a_shutdown_during_an_approved_send_that_does_not_answer_still_hands_the_run_back() {
    let (mut app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Sent it."),
        ],
        &[("SHUTDOWN_DRAIN_TIMEOUT", "0s")],
    )
    .await;
    let (paused, approval) = paused_send(&app).await;
    let gate = gmail.hold_sends();
    let agent = app.agent_addr;
    let deciding = tokio::spawn(async move {
        let _ = agent_as(agent, "alice")
            .await
            .decide_approval(approve(&approval.id))
            .await;
    });
    gate.arrived().await;
    let stopping = std::time::Instant::now();
    app.stop_service(agent)
        .await
        .expect("agent-svc stops cleanly");
    assert!(
        stopping.elapsed() < Duration::from_secs(8),
        "the send was given its grace, not its deadline: {:?}",
        stopping.elapsed()
    );
    let sql = app.sql().await;
    let (state, kind): (String, Option<String>) = sql
        .query_one(
            "SELECT state, failure_kind FROM agent.runs WHERE id = $1",
            &[&paused.run_id],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(
        (state.as_str(), kind.as_deref()),
        ("failed", Some("interrupted")),
        "ended as the replica stopped, not left for a monitor"
    );
    let action: String = sql
        .query_one(
            "SELECT state FROM agent.actions WHERE run_id = $1",
            &[&paused.run_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        action, "executing",
        "sent, outcome unknown: left to look up"
    );
    let records: Vec<String> = sql
        .query(
            "SELECT kind FROM agent.audit WHERE run_id = $1 AND kind LIKE 'side_effect%' ORDER BY kind",
            &[&paused.run_id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(records, ["side_effect"], "its intent, and no result");
    assert_eq!(model.requests().len(), 1, "the model was not asked again");
    gate.release();
    deciding.abort();
}

/// B-5: a `create_task_agent` call whose result never reached the thread's history (its run
/// was stopped past the shutdown's grace, or a failed write dropped it) is closed by the next
/// run with what the task queue holds: the task was started, so the model is told so and does
/// not queue it a second time.
#[tokio::test]
async fn b5_a_task_agent_call_whose_result_was_lost_is_answered_from_the_task_queue() {
    let task = r#"{"instructions":"Watch for the reply","goal":"reply watch"}"#;
    let (app, model, _gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_task", "create_task_agent", task)]),
            Answer::text("I'll watch for the reply."),
            Answer::text("Still watching."),
        ],
        &[("TASK_AGENT_WORKERS", "false")],
    )
    .await;
    let first = run_on(app.agent_addr, input("watch for the boss's reply")).await;
    assert_eq!(
        first.status,
        pb::RunState::Completed as i32,
        "{}",
        first.error
    );
    let sql = app.sql().await;
    let removed = sql
        .execute(
            "DELETE FROM agent.llm_history WHERE thread_id = $1 AND turn->>'role' = 'tool_result'",
            &[&first.thread_id],
        )
        .await
        .unwrap();
    assert_eq!(removed, 1, "the task call's result, as if it were lost");
    let task_id: String = sql
        .query_one("SELECT id FROM agent.task_agents", &[])
        .await
        .unwrap()
        .get(0);
    let told =
        tool_results_the_next_run_sends(app.agent_addr, &model, &first.thread_id, "anything yet?")
            .await;
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(
        told[0].contains(&format!("Started task agent {task_id};")),
        "{told:?}"
    );
    assert_eq!(task_agents_queued(&app).await, 1, "the task, once");
}
