//! Policy and approvals end to end (issue 7; P-1..P-5, A-6): both services, PostgreSQL, a
//! scripted OpenAI-compatible model, and a fake Gmail that records what is sent.

use std::time::Duration;

use agent_svc::store::AgentStore;
use steward_proto::agent::v1 as pb;
use steward_tests::{
    TestApp, UserAgent, agent_as,
    fakes::{gmail::FakeGmail, openai::Answer},
    worlds::gmail_world,
};
use tonic::Code;

const SEND_ARGS: &str =
    r#"{"to":["boss@example.com"],"subject":"Budget","body":"Numbers attached.\nCall me."}"#;

fn send_then(answer: &str) -> Vec<Answer> {
    vec![
        Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
        Answer::text(answer),
    ]
}

async fn run(app: &TestApp, prompt: &str) -> pb::RunResult {
    let input = pb::RunInput {
        prompt: prompt.into(),
        ..Default::default()
    };
    run_with(app, input).await
}

/// alice's run of `input`, to its result.
async fn run_with(app: &TestApp, input: pb::RunInput) -> pb::RunResult {
    let mut alice = app.agent_as("alice").await;
    alice
        .run(pb::RunRequest { input: Some(input) })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap()
}

fn decide(id: &str, decision: pb::Decision) -> pb::DecideApprovalRequest {
    pb::DecideApprovalRequest {
        approval_id: id.into(),
        decision: decision as i32,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_supervised_send_waits_with_a_preview_and_approval_on_another_instance_sends_exactly_once()
 {
    let (mut app, gmail) = world(send_then("Sent it to your boss."), &[]).await;
    let paused = run(&app, "email my boss the budget").await;
    assert_eq!(paused.status, pb::RunState::AwaitingConfirmation as i32);
    assert_eq!(paused.mode, pb::ResultMode::RequiresApproval as i32);
    let approval = paused.approval.clone().unwrap();
    assert_eq!(approval.tool, "gmail_send");
    assert_eq!(
        approval.preview,
        "Send\nFrom: alice@example.com\nTo: boss@example.com\nSubject: Budget\n\nNumbers attached.\nCall me."
    );
    assert!(approval.reason.contains("supervised"));
    assert_eq!(approval.args_sha256.len(), 64);
    assert!(
        approval
            .action_id
            .starts_with(&format!("{}/", paused.run_id)),
        "the action it would run: {}",
        approval.action_id
    );
    assert!(gmail.sent().is_empty(), "nothing is sent before approval");

    // Another replica receives the decision and continues the run from persisted state.
    let other = app.start_another_agent().await;
    let mut b = agent_as(other, "alice").await;
    let mut wrong_args = decide(&approval.id, pb::Decision::Approve);
    wrong_args.args_sha256 = "0".repeat(64);
    assert_eq!(
        b.decide_approval(wrong_args).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    // The hash the decider saw, copied in upper case, is the same hash.
    let mut seen_args = decide(&approval.id, pb::Decision::Approve);
    seen_args.args_sha256 = approval.args_sha256.to_ascii_uppercase();
    let done = b.decide_approval(seen_args).await.unwrap().into_inner();
    assert_eq!(
        done.approval.unwrap().state,
        pb::ApprovalState::Approved as i32
    );
    let result = done.result.unwrap();
    assert_eq!(
        (result.status, result.summary.as_str()),
        (pb::RunState::Completed as i32, "Sent it to your boss.")
    );
    assert_eq!(result.run_id, paused.run_id);
    assert_eq!(gmail.sent().len(), 1, "sent exactly once");
    assert!(gmail.sent()[0].0.contains("Subject: Budget"));
    // The commit made durable before the send carries its own mark, so a commit whose answer
    // was lost is recognised and never written twice.
    let events: Vec<pb::RunEvent> = app
        .agent_store()
        .await
        .events_after(&paused.run_id, 0, 1000)
        .await
        .unwrap()
        .into_iter()
        .map(|(_, payload)| prost::Message::decode(payload.as_slice()).unwrap())
        .collect();
    let running = events.iter().position(|e| {
        matches!(&e.kind, Some(pb::run_event::Kind::Status(s))
            if s.detail == "running the approved gmail_send")
    });
    let result_at = events
        .iter()
        .position(|e| matches!(e.kind, Some(pb::run_event::Kind::ToolResult(_))));
    assert!(
        running.is_some() && running < result_at,
        "stored before the send's result: {events:?}"
    );

    // Approving again is idempotent; rejecting now conflicts; another user cannot see it.
    let mut a = app.agent_as("alice").await;
    let again = a
        .decide_approval(decide(&approval.id, pb::Decision::Approve))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        again.approval.unwrap().state,
        pb::ApprovalState::Approved as i32
    );
    assert_eq!(gmail.sent().len(), 1);
    assert_eq!(
        a.decide_approval(decide(&approval.id, pb::Decision::Reject))
            .await
            .unwrap_err()
            .code(),
        Code::FailedPrecondition
    );
    let mut bob = app.agent_as("bob").await;
    assert_eq!(
        bob.decide_approval(decide(&approval.id, pb::Decision::Approve))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );

    let kinds: Vec<String> = app
        .agent_store()
        .await
        .audit("alice")
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        kinds,
        [
            "approval_requested",
            "approval_approved",
            "side_effect",
            "side_effect_result"
        ]
    );
}

/// P-2: the kill switch thrown after a send was approved-to-be still stops it: the replica
/// that receives the decision runs with side effects disabled and sends nothing.
#[tokio::test]
async fn p2_an_approval_decided_where_side_effects_are_disabled_sends_nothing() {
    let (mut app, gmail) = world(send_then("I could not send it."), &[]).await;
    let paused = run(&app, "email my boss the budget").await;
    let approval = paused.approval.clone().unwrap();
    let stopped = app
        .start_another_agent_with(&[("AGENT_SIDE_EFFECTS_ENABLED", "false")])
        .await;
    let mut b = agent_as(stopped, "alice").await;
    let done = b
        .decide_approval(decide(&approval.id, pb::Decision::Approve))
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(
        done.status,
        pb::RunState::Completed as i32,
        "{}",
        done.error
    );
    assert!(gmail.sent().is_empty(), "nothing was sent");
    let run = b
        .get_run(pb::GetRunRequest {
            run_id: paused.run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let send = run
        .actions
        .iter()
        .find(|a| a.tool == "gmail_send")
        .expect("the send's action");
    assert_eq!(send.error_kind, "DENIED", "{send:?}");
}

#[tokio::test]
async fn a_rejection_is_recorded_and_the_model_answers() {
    let (app, gmail) = world(send_then("Understood, I won't send it."), &[]).await;
    let paused = run(&app, "email my boss the budget").await;
    let mut a = app.agent_as("alice").await;
    let done = a
        .decide_approval(decide(&paused.approval.unwrap().id, pb::Decision::Reject))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        done.approval.unwrap().state,
        pb::ApprovalState::Rejected as i32
    );
    assert_eq!(done.result.unwrap().summary, "Understood, I won't send it.");
    assert!(gmail.sent().is_empty());
}

#[tokio::test]
async fn the_kill_switch_denies_side_effects_and_the_model_is_told() {
    let (app, gmail) = world(
        send_then("I can't send email here."),
        &[("AGENT_SIDE_EFFECTS_ENABLED", "false")],
    )
    .await;
    let result = run(&app, "email my boss the budget").await;
    assert_eq!(
        (result.status, result.summary.as_str()),
        (pb::RunState::Completed as i32, "I can't send email here.")
    );
    assert!(gmail.sent().is_empty());
    let mut a = app.agent_as("alice").await;
    let events: Vec<pb::RunEvent> = {
        use tokio_stream::StreamExt;
        a.watch_run(pb::WatchRunRequest {
            run_id: result.run_id,
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .filter_map(|r| r.ok().and_then(|r| r.event))
        .collect()
        .await
    };
    let denied = events.iter().find_map(|e| match &e.kind {
        Some(pb::run_event::Kind::ToolResult(r)) => Some(r.clone()),
        _ => None,
    });
    let denied = denied.unwrap();
    assert!(
        !denied.ok
            && denied.error_kind == "DENIED"
            && denied.preview.contains("side effects are disabled"),
        "{denied:?}"
    );
}

#[tokio::test]
async fn a_delegated_user_sends_to_an_allowlisted_recipient_without_approval() {
    let policies = r#"{"alice": {"trust": "delegated", "allowlist": ["boss@example.com"]}}"#;
    let (app, gmail) = world(send_then("Sent."), &[("AGENT_USER_POLICIES", policies)]).await;
    let result = run(&app, "email my boss the budget").await;
    assert_eq!(
        (result.status, result.summary.as_str()),
        (pb::RunState::Completed as i32, "Sent.")
    );
    assert_eq!(gmail.sent().len(), 1);
    let trail = app.agent_store().await.audit("alice").await.unwrap();
    let kinds: Vec<&str> = trail.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds, ["side_effect", "side_effect_result"]);
    let (intent, outcome) = (&trail[0].1, &trail[1].1);
    assert!(intent["call_id"].is_string(), "{intent}");
    assert_eq!(
        outcome["call_id"], intent["call_id"],
        "the same call: {outcome}"
    );
    assert_eq!(outcome["ok"], true, "{outcome}");
}

#[tokio::test]
async fn expired_approvals_and_approvals_the_conversation_moved_past_cannot_be_approved() {
    let answers = vec![
        Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
        Answer::tool_calls(&[("call_send2", "gmail_send", SEND_ARGS)]),
        Answer::text("Okay, forget the email."),
    ];
    let (app, gmail) = world(answers, &[]).await;
    let first = run(&app, "email my boss the budget")
        .await
        .approval
        .unwrap();
    let second_run = run(&app, "email my boss the budget again").await;
    let second = second_run.approval.unwrap();
    let mut a = app.agent_as("alice").await;

    // The first approval expired.
    let client = app.sql().await;
    client
        .execute(
            "UPDATE agent.approvals SET expires_at = now() - interval '1 minute' WHERE id = $1",
            &[&first.id],
        )
        .await
        .unwrap();
    let err = a
        .decide_approval(decide(&first.id, pb::Decision::Approve))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("expired"), "{}", err.message());

    // The user moves on in the same thread: the pending call is closed and its approval is void.
    let mut next = pb::RunInput {
        prompt: "never mind".into(),
        ..Default::default()
    };
    next.thread_id = second_run.thread_id.clone();
    let moved = a
        .run(pb::RunRequest { input: Some(next) })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(moved.summary, "Okay, forget the email.");
    let err = a
        .decide_approval(decide(&second.id, pb::Decision::Approve))
        .await
        .unwrap_err();
    assert!(err.message().contains("moved on"), "{}", err.message());
    assert!(gmail.sent().is_empty());
}

#[tokio::test]
async fn two_concurrent_runs_on_one_thread_leave_exactly_one_aborted() {
    let (app, _gmail) = world(
        vec![
            Answer::text("first"),
            Answer::Slow(
                Box::new(Answer::text("slow second")),
                Duration::from_secs(2),
            ),
        ],
        &[],
    )
    .await;
    let thread = run(&app, "open a thread").await.thread_id;
    let attempt = |prompt: &'static str| {
        let addr = app.agent_addr;
        let thread = thread.clone();
        tokio::spawn(async move {
            let mut alice = agent_as(addr, "alice").await;
            let input = pb::RunInput {
                prompt: prompt.into(),
                thread_id: thread,
                ..Default::default()
            };
            alice.run(pb::RunRequest { input: Some(input) }).await
        })
    };
    let (a, b) = tokio::join!(attempt("one"), attempt("two"));
    let results = [a.unwrap(), b.unwrap()];
    let aborted: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(aborted.len(), 1, "{results:?}");
    assert_eq!(aborted[0].code(), Code::Aborted);
    assert!(aborted[0].message().contains("already has an active run"));
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
}

/// A-5: a call whose arguments are not a JSON object is an action all the same — failed, with
/// what the model sent — beside the corrected call that ran.
#[tokio::test]
async fn a5_a_call_with_malformed_arguments_is_recorded_as_a_failed_action_with_what_was_sent() {
    let (app, _gmail) = world(
        vec![
            Answer::tool_calls(&[("call_bad", "list_tasks", r#"{"status": "#)]),
            Answer::tool_calls(&[("call_good", "list_tasks", "{}")]),
            Answer::text("No tasks."),
        ],
        &[],
    )
    .await;
    let done = run(&app, "what tasks do I have?").await;
    assert_eq!(done.status, pb::RunState::Completed as i32, "{done:?}");
    let actions =
        steward_tests::agent_calls::get_run(&mut app.agent_as("alice").await, &done.run_id)
            .await
            .unwrap()
            .actions;
    let seen: Vec<(i32, &str, &str)> = actions
        .iter()
        .map(|a| (a.state, a.error_kind.as_str(), a.arguments_text.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (
                pb::ActionState::Failed as i32,
                "INVALID_ARGUMENTS",
                r#"{"status": "#
            ),
            (pb::ActionState::Completed as i32, "", "")
        ]
    );
    assert_eq!(actions[0].arguments, None, "not an object: text only");
    assert!(
        actions[0]
            .result_text
            .starts_with("Your arguments for list_tasks were not valid JSON"),
        "{}",
        actions[0].result_text
    );
    assert!(actions[1].arguments.is_some());
}

#[tokio::test]
async fn every_action_transition_is_recorded_on_the_run() {
    let (app, _gmail) = world(
        vec![
            Answer::tool_calls(&[
                ("call_list", "list_tasks", "{}"),
                ("call_send", "gmail_send", SEND_ARGS),
            ]),
            Answer::text("Done."),
        ],
        &[],
    )
    .await;
    let paused = run(&app, "check my tasks and email my boss").await;
    // Steward names every call itself (providers repeat or omit ids): run id / call id.
    assert!(
        paused
            .action_id
            .starts_with(&format!("{}/call_", paused.run_id)),
        "{}",
        paused.action_id
    );
    let mut a = app.agent_as("alice").await;
    let actions = a
        .get_run(pb::GetRunRequest {
            run_id: paused.run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .actions;
    let states: Vec<(&str, i32)> = actions.iter().map(|x| (x.tool.as_str(), x.state)).collect();
    assert_eq!(
        states,
        [
            ("list_tasks", pb::ActionState::Completed as i32),
            ("gmail_send", pb::ActionState::AwaitingConfirmation as i32)
        ]
    );
    assert_eq!(actions[0].result_text, "No pending tasks.");
    assert!(!actions[0].side_effect && actions[1].side_effect);
    assert_eq!(actions[1].id, paused.action_id);
    let approval = paused.approval.unwrap();
    assert_eq!(actions[1].approval_id, approval.id);

    a.decide_approval(decide(&approval.id, pb::Decision::Approve))
        .await
        .unwrap();
    let actions = a
        .get_run(pb::GetRunRequest {
            run_id: paused.run_id,
        })
        .await
        .unwrap()
        .into_inner()
        .actions;
    assert_eq!(actions[1].state, pb::ActionState::Completed as i32);
    assert!(
        actions[1].result_text.starts_with("Sent \"Budget\""),
        "{}",
        actions[1].result_text
    );
}

/// R-4: a decision continues its paused run, so with the owner at the cap on active runs it is
/// RESOURCE_EXHAUSTED naming the cap, and nothing happens: nothing is sent, the approval stays
/// pending and the run paused. Once the other run ends, the same decision goes through.
#[tokio::test]
async fn r4_a_decision_at_the_active_run_cap_is_refused_until_a_run_ends() {
    let (app, model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::Slow(
                Box::new(Answer::text("still thinking")),
                Duration::from_secs(30),
            ),
            Answer::text("Sent it to your boss."),
        ],
        &[("AGENT_MAX_ACTIVE_RUNS_PER_USER", "1")],
    )
    .await;
    let paused = run(&app, "email my boss the budget").await;
    let approval = paused.approval.clone().unwrap();
    let mut alice = app.agent_as("alice").await;
    let mut other = alice
        .run_stream(pb::RunStreamRequest {
            input: Some(pb::RunInput {
                prompt: "plan my week".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let other_run = other
        .message()
        .await
        .unwrap()
        .unwrap()
        .event
        .unwrap()
        .run_id;
    // The other run is live and waiting on its (slow) model call.
    tokio::time::timeout(Duration::from_secs(10), async {
        while model.requests().len() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the other run calls the model");

    let err = alice
        .decide_approval(decide(&approval.id, pb::Decision::Approve))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(
        err.message().contains("AGENT_MAX_ACTIVE_RUNS_PER_USER")
            && err.message().contains("still pending"),
        "{}",
        err.message()
    );
    assert!(gmail.sent().is_empty(), "nothing is sent");
    let store = app.agent_store().await;
    let still = store
        .get_approval("alice", &approval.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(still.state, agent_svc::store::ApprovalState::Pending);
    let run = store
        .get_run("alice", &paused.run_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(run.state, agent_svc::store::RunState::AwaitingConfirmation);

    alice
        .cancel_run(pb::CancelRunRequest {
            run_id: other_run,
            ..Default::default()
        })
        .await
        .unwrap();
    while other.message().await.unwrap().is_some() {}
    approve_and_see_it_sent_once(&mut alice, &approval.id, &gmail).await;
}

/// A decision that meets another decider holding the run (another replica deciding it), which
/// then records nothing (refused at the cap on active runs, say), is told ABORTED, to decide
/// again, rather than that the approval is already decided; decided again, it goes through.
#[tokio::test]
async fn a_decision_behind_another_that_recorded_nothing_is_told_to_decide_again() {
    let (app, _model, gmail) = gmail_world(
        vec![
            Answer::tool_calls(&[("call_send", "gmail_send", SEND_ARGS)]),
            Answer::text("Sent it to your boss."),
        ],
        &[],
    )
    .await;
    let paused = run(&app, "email my boss the budget").await;
    let approval = paused.approval.clone().unwrap();
    // The other decider, on another replica: it holds the paused run's lease.
    let replica = app.agent_store().await;
    let pending = replica
        .get_approval("alice", &approval.id)
        .await
        .unwrap()
        .unwrap();
    let other = match replica
        .lock_thread(&pending.thread_id, &pending.run_id, Duration::from_secs(60))
        .await
        .unwrap()
    {
        agent_svc::store::LockOutcome::Acquired(lease) => lease,
        busy => panic!("the paused run's lease is taken: {busy:?}"),
    };
    let mut alice = app.agent_as("alice").await;

    let err = alice
        .decide_approval(decide(&approval.id, pb::Decision::Approve))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{}", err.message());
    assert!(
        err.message().contains("did not go through; decide again"),
        "{}",
        err.message()
    );
    assert!(gmail.sent().is_empty(), "nothing is sent");
    let still = replica
        .get_approval("alice", &approval.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(still.state, agent_svc::store::ApprovalState::Pending);

    // The other decider lets go without deciding: the same decision now goes through.
    replica.release_lease(&other).await.unwrap();
    approve_and_see_it_sent_once(&mut alice, &approval.id, &gmail).await;
}

/// A send paused for approval and approved by a decider on another replica that recorded the
/// decision and was then gone. The replicas' own monitors stay out of it (the test sweeps).
async fn a_send_approved_by_a_vanished_decider() -> (TestApp, FakeGmail, pb::RunResult) {
    let (app, gmail) = world(
        send_then("Sent it to your boss."),
        &[("HEALTH_MONITOR_INTERVAL", "3600s")],
    )
    .await;
    let paused = run(&app, "email my boss the budget").await;
    decided_by_a_vanished_decider(&app, &paused).await;
    assert!(gmail.sent().is_empty());
    (app, gmail, paused)
}

/// The run `paused` waits on, approved by a decider on another replica that recorded the
/// decision and was then gone: its lease lets go (released here rather than waited out).
async fn decided_by_a_vanished_decider(app: &TestApp, paused: &pb::RunResult) {
    let approval = paused.approval.clone().unwrap();
    let replica = app.agent_store().await;
    let lease = match replica
        .lock_thread(&paused.thread_id, &paused.run_id, Duration::from_secs(60))
        .await
        .unwrap()
    {
        agent_svc::store::LockOutcome::Acquired(lease) => lease,
        busy => panic!("the paused run's lease is taken: {busy:?}"),
    };
    let decided = replica
        .decide(
            &lease,
            &approval.id,
            agent_svc::store::ApprovalState::Approved,
            "alice",
            "approval_approved",
            10,
        )
        .await
        .unwrap();
    assert!(
        matches!(decided, agent_svc::store::Decided::Won { .. }),
        "{decided:?}"
    );
    replica.release_lease(&lease).await.unwrap();
}

/// E-12, A-6: a decision that was recorded while its decider went away before continuing the
/// run (its replica died just after the commit, or the commit's answer never came back) still
/// happens: the health monitor continues the run instead of failing it, and the mail goes out
/// once.
#[tokio::test]
async fn e12_a_decision_recorded_by_a_decider_that_vanished_is_carried_out_by_the_monitor() {
    let (app, gmail, paused) = a_send_approved_by_a_vanished_decider().await;

    // Any replica's monitor.
    let swept = app.agent_replicas()[0]
        .sweep_stale_runs(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(swept, 1, "continued, once");
    // The user, asking again, follows the same decision to the run's end.
    let mut alice = app.agent_as("alice").await;
    let approval_id = paused.approval.unwrap().id;
    approve_and_see_it_sent_once(&mut alice, &approval_id, &gmail).await;
}

/// E-12: but not once the session that asked has been archived — the conversation the call
/// belonged to is over, so the run is ended as abandoned and nothing is sent.
#[tokio::test]
async fn e12_a_vanished_deciders_run_whose_session_was_archived_is_ended_not_continued() {
    // This test's sweep comes after the archive.
    let (app, gmail, paused) = a_send_approved_by_a_vanished_decider().await;
    let monitor = app.monitor().await;
    monitor
        .archive("alice", &paused.thread_id, None, None)
        .await;
    assert!(
        app.agent_store()
            .await
            .history(&paused.thread_id)
            .await
            .unwrap()
            .is_empty(),
        "the session was archived"
    );

    monitor.sweep_stale_runs(Duration::ZERO).await.unwrap();
    let mut alice = app.agent_as("alice").await;
    let run = steward_tests::agent_calls::get_run(&mut alice, &paused.run_id)
        .await
        .unwrap()
        .run
        .unwrap();
    assert_eq!(run.state, pb::RunState::Failed as i32);
    assert!(gmail.sent().is_empty(), "nothing is sent");
}

/// A-6: a cancel that came between the decision and its continuation (CancelRun saw the run
/// executing, so it only flagged it) wins: the approved send is not made, the paused call is
/// answered "not executed", and the run ends cancelled.
#[tokio::test]
async fn a_cancel_between_a_decision_and_its_continuation_stops_the_send() {
    let (app, gmail, paused) = a_send_approved_by_a_vanished_decider().await;
    let store = app.agent_store().await;
    assert!(store.request_cancel(&paused.run_id, None).await.unwrap());

    app.agent_replicas()[0]
        .sweep_stale_runs(Duration::ZERO)
        .await
        .unwrap();
    let mut alice = app.agent_as("alice").await;
    let done = alice
        .decide_approval(decide(&paused.approval.unwrap().id, pb::Decision::Approve))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.result.unwrap().status, pb::RunState::Cancelled as i32);
    the_send_was_not_executed(&mut alice, &paused.run_id, &gmail).await;
}

/// Nothing reached Gmail, and the run's send action says it was not executed.
async fn the_send_was_not_executed(alice: &mut UserAgent, run_id: &str, gmail: &FakeGmail) {
    assert!(gmail.sent().is_empty(), "nothing is sent");
    let actions = steward_tests::agent_calls::get_run(alice, run_id)
        .await
        .unwrap()
        .actions;
    let send = actions.iter().find(|a| a.tool == "gmail_send").unwrap();
    assert_eq!(send.state, pb::ActionState::Failed as i32);
    assert!(
        send.result_text.starts_with("Not executed"),
        "{}",
        send.result_text
    );
}

/// P-5: an approved send whose audit record cannot be written before the effect is not sent;
/// the action says "Not executed", and no mark of it running is stored.
#[tokio::test]
async fn p5_an_approved_send_whose_audit_record_is_refused_is_not_sent() {
    let (app, gmail) = world(send_then("Sent it to your boss."), &[]).await;
    let paused = run(&app, "email my boss the budget").await;
    app.sql()
        .await
        .batch_execute(
            "ALTER TABLE agent.audit ADD CONSTRAINT no_side_effects CHECK (kind <> 'side_effect')",
        )
        .await
        .unwrap();
    let mut alice = app.agent_as("alice").await;
    let done = alice
        .decide_approval(decide(&paused.approval.unwrap().id, pb::Decision::Approve))
        .await
        .unwrap()
        .into_inner();
    let result = done.result.unwrap();
    assert_eq!(
        result.status,
        pb::RunState::Failed as i32,
        "{}",
        result.error
    );
    the_send_was_not_executed(&mut alice, &paused.run_id, &gmail).await;
    let stored = app
        .agent_store()
        .await
        .events_after(&paused.run_id, 0, 1000)
        .await
        .unwrap();
    assert!(
        !stored.iter().any(|(_, payload)| {
            let e: pb::RunEvent = prost::Message::decode(payload.as_slice()).unwrap();
            matches!(e.kind, Some(pb::run_event::Kind::Status(s)) if s.detail.starts_with("running the approved"))
        }),
        "no mark of a send that never ran"
    );
}

/// P-5: on the approved path the agent's `side_effect` audit record is durable before the
/// effect — it is in the database while the send is still at Gmail — and there is one.
#[tokio::test]
async fn p5_an_approved_sends_audit_record_is_written_before_the_send_reaches_gmail() {
    let (app, gmail) = world(send_then("Sent it to your boss."), &[]).await;
    let paused = run(&app, "email my boss the budget").await;
    let approval = paused.approval.clone().unwrap();
    let gate = gmail.hold_sends();
    let mut alice = app.agent_as("alice").await;
    let deciding = tokio::spawn({
        let id = approval.id.clone();
        async move {
            alice
                .decide_approval(decide(&id, pb::Decision::Approve))
                .await
        }
    });
    gate.arrived().await;
    let audit_kinds = |client: tokio_postgres::Client, run_id: String| async move {
        client
            .query(
                "SELECT kind FROM agent.audit WHERE run_id = $1 ORDER BY id",
                &[&run_id],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
    };
    let at_the_send = audit_kinds(app.sql().await, paused.run_id.clone()).await;
    assert!(
        at_the_send.iter().any(|k| k == "side_effect"),
        "the record is there while the send is in flight: {at_the_send:?}"
    );
    gate.release();
    let done = deciding.await.unwrap().unwrap().into_inner();
    assert_eq!(done.result.unwrap().status, pb::RunState::Completed as i32);
    assert_eq!(gmail.sent().len(), 1);
    let after = audit_kinds(app.sql().await, paused.run_id.clone()).await;
    assert_eq!(
        after.iter().filter(|k| *k == "side_effect").count(),
        1,
        "one record for one effect: {after:?}"
    );
    // What it came to follows it, for the same call: the trail alone says the send happened.
    let detail = |kind: &'static str| {
        let run_id = paused.run_id.clone();
        let sql = app.sql();
        async move {
            sql.await
                .query_one(
                    "SELECT detail FROM agent.audit WHERE run_id = $1 AND kind = $2",
                    &[&run_id, &kind],
                )
                .await
                .unwrap()
                .get::<_, serde_json::Value>(0)
        }
    };
    let (intent, outcome) = (
        detail("side_effect").await,
        detail("side_effect_result").await,
    );
    assert_eq!(outcome["tool"], "gmail_send", "{outcome}");
    assert_eq!(outcome["ok"], true, "{outcome}");
    assert!(outcome["call_id"].is_string(), "{outcome}");
    assert_eq!(outcome["call_id"], intent["call_id"], "{intent} {outcome}");
}

/// Approves `approval_id`: its run completes, and the mail is sent exactly once.
async fn approve_and_see_it_sent_once(alice: &mut UserAgent, approval_id: &str, gmail: &FakeGmail) {
    let done = alice
        .decide_approval(decide(approval_id, pb::Decision::Approve))
        .await
        .unwrap()
        .into_inner();
    let result = done.result.unwrap();
    assert_eq!(
        (result.status, result.summary.as_str()),
        (pb::RunState::Completed as i32, "Sent it to your boss.")
    );
    assert_eq!(gmail.sent().len(), 1, "sent exactly once");
}

async fn world(answers: Vec<Answer>, env: &[(&str, &str)]) -> (TestApp, FakeGmail) {
    let (app, _model, gmail) = gmail_world(answers, env).await;
    (app, gmail)
}

/// A-1, P-2: the model a caller chose over the chain's first is the one that goes on after an
/// approval pause, not the chain's default.
#[tokio::test]
async fn a1_a_run_with_a_chosen_model_continues_with_it_after_approval() {
    let (app, model, gmail) = gmail_world(
        send_then("Sent it to your boss."),
        &[("MODEL_CHAIN", "openai/gpt-4o,openai/gpt-4o-mini")],
    )
    .await;
    let paused = run_with(
        &app,
        pb::RunInput {
            prompt: "email my boss the budget".into(),
            model_override: "openai/gpt-4o-mini".into(),
            ..Default::default()
        },
    )
    .await;
    let mut alice = app.agent_as("alice").await;
    let approval = paused.approval.expect("paused for approval");
    let done = alice
        .decide_approval(decide(&approval.id, pb::Decision::Approve))
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(done.summary, "Sent it to your boss.");
    assert_eq!(gmail.sent().len(), 1);
    let asked: Vec<String> = model
        .requests()
        .iter()
        .map(|(_, body)| body["model"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        asked,
        ["gpt-4o-mini", "gpt-4o-mini"],
        "before and after the pause"
    );
}

/// A-6, R-3: a decider whose call goes away while the decision waits (here on its owner's
/// admission lock, held by a stalled transaction) still has the run continued at once, not
/// left with its lease held by nobody until the monitor's sweep.
#[tokio::test]
async fn a6_a_decision_whose_caller_goes_away_still_continues_the_run() {
    let (app, model, gmail) = gmail_world(send_then("Sent it to your boss."), &[]).await;
    let paused = run(&app, "email my boss the budget").await;
    let approval = paused.approval.expect("paused for approval");
    let side = app.sql().await;
    steward_tests::db::hold_admission_lock(&side, "alice").await;
    let mut alice = app.agent_as("alice").await;
    let mut impatient = tonic::Request::new(decide(&approval.id, pb::Decision::Approve));
    impatient.set_timeout(Duration::from_millis(300));
    let gone = alice.decide_approval(impatient).await.unwrap_err();
    assert!(
        matches!(gone.code(), Code::DeadlineExceeded | Code::Cancelled),
        "the caller gave up: {gone:?}"
    );
    side.batch_execute("ROLLBACK").await.unwrap();
    // The same decision again follows the run the first one continued, to its end.
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        alice.decide_approval(decide(&approval.id, pb::Decision::Approve)),
    )
    .await
    .expect("the run went on within seconds, not after its lease lapsed")
    .expect("the repeated decision is answered")
    .into_inner()
    .result
    .expect("the run's result");
    assert_eq!(ended.status, pb::RunState::Completed as i32);
    assert_eq!(gmail.sent().len(), 1);
    assert_eq!(model.requests().len(), 2);
}
