//! AgentService end to end (issue 7 so far; A-1..A-5, A-8..A-10, E-11, S-2..S-4, S3 AC-002):
//! both services, real PostgreSQL, the offline scripted model, tools on the real gateway.

use std::time::Duration;

use steward_proto::agent::v1 as pb;
use steward_tests::{Backend, Options, UserAgent, agent_as, spawn::spawn};
use tokio_stream::StreamExt;
use tonic::Code;

fn input(prompt: &str) -> pb::RunInput {
    pb::RunInput {
        prompt: prompt.into(),
        channel: pb::Channel::Web as i32,
        ..Default::default()
    }
}

async fn run(agent: &mut UserAgent, input: pb::RunInput) -> Result<pb::RunResult, tonic::Status> {
    Ok(agent
        .run(pb::RunRequest { input: Some(input) })
        .await?
        .into_inner()
        .result
        .expect("a result"))
}

async fn collect(stream: tonic::Streaming<pb::RunStreamResponse>) -> Vec<pb::RunEvent> {
    stream
        .filter_map(|r| r.ok().and_then(|r| r.event))
        .collect()
        .await
}

fn is_terminal(e: &pb::RunEvent) -> bool {
    matches!(
        e.kind,
        Some(pb::run_event::Kind::Result(_) | pb::run_event::Kind::Error(_))
    )
}

#[tokio::test]
async fn a_run_answers_with_the_offline_model_and_persists_thread_messages_and_usage() {
    let app = spawn(Options::default()).await;
    let mut alice = app.agent_as("alice").await;
    let result = run(&mut alice, input("hello there")).await.unwrap();
    assert_eq!(result.status, pb::RunState::Completed as i32);
    assert!(
        result.summary.contains("offline scripted model"),
        "{}",
        result.summary
    );
    assert_eq!(result.model, "scripted-offline");
    assert_eq!(result.mode, pb::ResultMode::AssistantText as i32);
    assert!(result.usage.unwrap().model_calls == 1);

    let threads = alice
        .list_threads(pb::ListThreadsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .threads;
    assert_eq!(threads.len(), 1);
    assert_eq!(threads[0].id, result.thread_id);
    assert_eq!(threads[0].title, "hello there");
    let messages = alice
        .list_messages(pb::ListMessagesRequest {
            thread_id: result.thread_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    let shape: Vec<(i32, &str)> = messages
        .iter()
        .map(|m| (m.source, m.content.as_str()))
        .collect();
    assert_eq!(shape[0], (pb::MessageSource::User as i32, "hello there"));
    assert_eq!(shape[1].0, pb::MessageSource::Agent as i32);
    let got = alice
        .get_run(pb::GetRunRequest {
            run_id: result.run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(got.state, pb::RunState::Completed as i32);
    assert_eq!(got.model_calls[0].provider, "scripted-offline");
    assert!(got.finished_at.is_some() && got.last_event_seq > 2);
}

#[tokio::test]
async fn run_stream_events_are_numbered_without_gaps_and_end_with_exactly_one_result() {
    let app = spawn(Options::default()).await;
    let mut alice = app.agent_as("alice").await;
    // The offline model lists tasks through the gateway when asked about tasks.
    let events = collect(
        alice
            .run_stream(pb::RunStreamRequest {
                input: Some(input("what tasks do I have?")),
            })
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    assert_eq!(events.iter().filter(|e| is_terminal(e)).count(), 1);
    assert!(is_terminal(events.last().unwrap()));
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| match &e.kind {
            Some(pb::run_event::Kind::Status(_)) => "status",
            Some(pb::run_event::Kind::Delta(_)) => "delta",
            Some(pb::run_event::Kind::ToolCall(_)) => "tool_call",
            Some(pb::run_event::Kind::ToolResult(_)) => "tool_result",
            Some(pb::run_event::Kind::Result(_)) => "result",
            _ => "other",
        })
        .collect();
    let call = kinds
        .iter()
        .position(|k| *k == "tool_call")
        .expect("a tool call");
    assert!(
        kinds[call + 1..].contains(&"tool_result") && kinds.contains(&"delta"),
        "{kinds:?}"
    );
    let Some(pb::run_event::Kind::ToolResult(r)) = &events
        .iter()
        .find(|e| matches!(e.kind, Some(pb::run_event::Kind::ToolResult(_))))
        .unwrap()
        .kind
    else {
        unreachable!()
    };
    assert_eq!(
        (r.tool.as_str(), r.ok, r.preview.as_str()),
        ("list_tasks", true, "No pending tasks.")
    );
}

#[tokio::test]
async fn a_stream_cut_after_three_events_resumes_on_another_instance_without_gap_or_duplicate() {
    let mut app = spawn(Options::default()).await;
    let mut a = app.agent_as("alice").await;
    let mut stream = a
        .run_stream(pb::RunStreamRequest {
            input: Some(input("what tasks do I have?")),
        })
        .await
        .unwrap()
        .into_inner();
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(stream.next().await.unwrap().unwrap().event.unwrap());
    }
    drop(stream);
    let run_id = seen[0].run_id.clone();
    let other = app.start_another_agent().await;
    let mut b = agent_as(other, "alice").await;
    let rest: Vec<pb::RunEvent> = b
        .watch_run(pb::WatchRunRequest {
            run_id: run_id.clone(),
            after_seq: 3,
        })
        .await
        .unwrap()
        .into_inner()
        .filter_map(|r| r.ok().and_then(|r| r.event))
        .collect()
        .await;
    assert_eq!(rest.first().unwrap().seq, 4);
    let all: Vec<u64> = seen.iter().chain(&rest).map(|e| e.seq).collect();
    assert_eq!(all, (1..=all.len() as u64).collect::<Vec<_>>());
    assert!(is_terminal(rest.last().unwrap()));
}

#[tokio::test]
async fn another_users_thread_and_run_are_not_found() {
    let app = spawn(Options::default()).await;
    let mut alice = app.agent_as("alice").await;
    let mut bob = app.agent_as("bob").await;
    let result = run(&mut alice, input("private plans")).await.unwrap();
    let e = bob
        .get_run(pb::GetRunRequest {
            run_id: result.run_id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = bob
        .list_messages(pb::ListMessagesRequest {
            thread_id: result.thread_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let mut on_alices = input("let me in");
    on_alices.thread_id = result.thread_id.clone();
    assert_eq!(
        run(&mut bob, on_alices).await.unwrap_err().code(),
        Code::NotFound
    );
    let e = bob
        .watch_run(pb::WatchRunRequest {
            run_id: result.run_id,
            after_seq: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(
        bob.list_threads(pb::ListThreadsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .threads
            .is_empty()
    );
}

#[tokio::test]
async fn a_busy_thread_is_aborted_and_an_expired_lease_frees_it() {
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        ..Options::default()
    })
    .await;
    let mut alice = app.agent_as("alice").await;
    let first = run(&mut alice, input("first")).await.unwrap();
    // Another replica's run holds the thread's lock.
    let store = app.agent_store().await;
    use agent_svc::store::{AgentStore, LockOutcome};
    let LockOutcome::Acquired(held) = store
        .lock_thread(
            &first.thread_id,
            "run-on-another-replica",
            Duration::from_secs(300),
        )
        .await
        .unwrap()
    else {
        panic!("the thread was free");
    };
    let mut again = input("second");
    again.thread_id = first.thread_id.clone();
    let err = run(&mut alice, again.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted);
    assert!(
        err.message()
            .contains("already has an active run (run-on-another-replica)"),
        "{}",
        err.message()
    );
    // The holder dies: its lease runs out (here: is already over) and the thread is usable again.
    store.release_lease(&held).await.unwrap();
    store
        .lock_thread(&first.thread_id, "dead-holder", Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        run(&mut alice, again).await.unwrap().status,
        pb::RunState::Completed as i32
    );
}

#[tokio::test]
async fn a_retried_request_id_returns_the_first_run() {
    let app = spawn(Options::default()).await;
    let mut alice = app.agent_as("alice").await;
    let mut req = input("once only");
    req.request_id = "req-42".into();
    let first = run(&mut alice, req.clone()).await.unwrap();
    let second = run(&mut alice, req).await.unwrap();
    assert_eq!(first.run_id, second.run_id);
    let messages = alice
        .list_messages(pb::ListMessagesRequest {
            thread_id: first.thread_id,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert_eq!(
        messages
            .iter()
            .filter(|m| m.source == pb::MessageSource::User as i32)
            .count(),
        1
    );
}

#[tokio::test]
async fn a_second_instance_continues_a_thread_with_its_history() {
    let mut app = spawn(Options::default()).await;
    let mut a = app.agent_as("alice").await;
    let first = run(&mut a, input("remember I like tea")).await.unwrap();
    let other = app.start_another_agent().await;
    let mut b = agent_as(other, "alice").await;
    let mut next = input("and what else?");
    next.thread_id = first.thread_id.clone();
    let second = run(&mut b, next).await.unwrap();
    assert_eq!(second.thread_id, first.thread_id);
    let got = b
        .get_run(pb::GetRunRequest {
            run_id: second.run_id,
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let first_run = a
        .get_run(pb::GetRunRequest {
            run_id: first.run_id,
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    // The second run's model input carried the first exchange (S3 AC-002).
    let input_of = |r: &pb::Run| r.model_calls[0].usage.as_ref().unwrap().input_tokens;
    assert!(
        input_of(&got) > input_of(&first_run) + 10,
        "{} vs {}",
        input_of(&got),
        input_of(&first_run)
    );
    let messages = b
        .list_messages(pb::ListMessagesRequest {
            thread_id: first.thread_id,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert!(messages.len() >= 4, "both exchanges are in the thread");
}

#[tokio::test]
async fn oversized_and_missing_fields_are_refused_by_name() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut alice = app.agent_as("alice").await;
    let err = run(&mut alice, input(&"x".repeat(40 * 1024)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message()
            .starts_with("input.prompt is 40960 bytes; the limit is 32768"),
        "{}",
        err.message()
    );
    let mut many = input("hi");
    many.attached_context = (0..13)
        .map(|i| pb::AttachedContext {
            r#type: pb::ContextType::Email as i32,
            id: format!("m{i}"),
            ..Default::default()
        })
        .collect();
    let err = run(&mut alice, many).await.unwrap_err();
    assert!(
        err.message()
            .contains("input.attached_context has 13 items; the limit is 12"),
        "{}",
        err.message()
    );
    let err = run(&mut alice, input("   ")).await.unwrap_err();
    assert_eq!(err.message(), "input.prompt is required");
    let mut bad_role = input("hi");
    bad_role.conversation = vec![pb::ConversationEntry {
        role: 0,
        text: "?".into(),
    }];
    assert!(
        run(&mut alice, bad_role)
            .await
            .unwrap_err()
            .message()
            .contains("input.conversation[0].role")
    );
    let mut unknown_model = input("hi");
    unknown_model.model_override = "openai/gpt-9".into();
    assert!(
        run(&mut alice, unknown_model)
            .await
            .unwrap_err()
            .message()
            .contains("input.model_override")
    );
    // The chain's model under another provider's name is not in the chain either.
    let configured = run(&mut alice, input("hi")).await.unwrap();
    let mut other_provider = input("hi");
    other_provider.model_override = format!("gemini/{}", configured.model);
    let refused = run(&mut alice, other_provider).await.unwrap_err();
    assert!(
        refused.message().contains("input.model_override"),
        "{}",
        refused.message()
    );
}

/// On PostgreSQL, where a NUL or an out-of-range number once came back as UNAVAILABLE (a
/// retry that can never work) with the database's own words.
#[tokio::test]
async fn a2_input_no_store_can_keep_is_refused_by_name_not_reported_as_an_outage() {
    let app = spawn(Options::default()).await;
    let mut alice = app.agent_as("alice").await;
    let invalid = |e: tonic::Status, field: &str| {
        assert_eq!(e.code(), Code::InvalidArgument, "{field}: {}", e.message());
        assert!(e.message().contains(field), "{field}: {}", e.message());
    };
    invalid(
        run(&mut alice, input("hello\0world")).await.unwrap_err(),
        "input.prompt contains a NUL",
    );
    let mut snippet = input("hi");
    snippet.attached_context = vec![pb::AttachedContext {
        r#type: pb::ContextType::Email as i32,
        id: "m1".into(),
        snippet: "a\0b".into(),
        ..Default::default()
    }];
    invalid(
        run(&mut alice, snippet).await.unwrap_err(),
        "input.attached_context[0].snippet",
    );
    // NaN has no JSON form: it would have been kept as null.
    let mut nan = input("hi");
    nan.attached_context = vec![pb::AttachedContext {
        r#type: pb::ContextType::Email as i32,
        id: "m1".into(),
        meta: Some(prost_types::Struct {
            fields: [(
                "score".to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::NumberValue(f64::NAN)),
                },
            )]
            .into(),
        }),
        ..Default::default()
    }];
    invalid(
        run(&mut alice, nan).await.unwrap_err(),
        "input.attached_context[0].meta.score is not a finite number",
    );
    let mut long_key = input("hi");
    long_key.request_id = "k".repeat(129);
    invalid(
        run(&mut alice, long_key).await.unwrap_err(),
        "input.request_id",
    );
    invalid(
        alice
            .get_run(pb::GetRunRequest::default())
            .await
            .unwrap_err(),
        "run_id is required",
    );
    invalid(
        alice
            .list_threads(pb::ListThreadsRequest {
                page_token: "9223372036854775808".into(),
                ..Default::default()
            })
            .await
            .unwrap_err(),
        "page_token",
    );
    invalid(
        alice
            .list_threads(pb::ListThreadsRequest {
                page_token: "1:\0".into(),
                ..Default::default()
            })
            .await
            .unwrap_err(),
        "page_token",
    );
    let mut empty_entry = input("hi");
    empty_entry.conversation = vec![pb::ConversationEntry {
        role: pb::Role::User as i32,
        text: "  ".into(),
    }];
    invalid(
        run(&mut alice, empty_entry).await.unwrap_err(),
        "input.conversation[0].text is required",
    );
    let mut newer_policy = input("hi");
    newer_policy.on_busy_thread = 7;
    invalid(
        run(&mut alice, newer_policy).await.unwrap_err(),
        "input.on_busy_thread",
    );
    invalid(
        alice
            .decide_approval(pb::DecideApprovalRequest {
                approval_id: "ap_1".into(),
                decision: pb::Decision::Approve as i32,
                args_sha256: "abc".into(),
                ..Default::default()
            })
            .await
            .unwrap_err(),
        "args_sha256 must be the 64 hex digits",
    );
    invalid(
        alice
            .open_session(pb::OpenSessionRequest {
                request_id: "k".repeat(10_000),
                ..Default::default()
            })
            .await
            .unwrap_err(),
        "request_id",
    );

    // The largest after_seq on an ended run: the watch is over at once, no overflow.
    let done = run(&mut alice, input("hi")).await.unwrap();
    let watch = alice
        .watch_run(pb::WatchRunRequest {
            run_id: done.run_id.clone(),
            after_seq: u64::MAX,
        })
        .await
        .unwrap();
    let events: Vec<_> = watch.into_inner().collect().await;
    assert!(events.is_empty(), "{events:?}");
}

#[tokio::test]
async fn calls_without_an_identity_are_unauthenticated() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut anonymous = app.agent.clone();
    let err = anonymous
        .run(pb::RunRequest {
            input: Some(input("hi")),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(err.message().contains("x-user-id"), "{}", err.message());
}

/// E-10, A-10: GetUsage sums the last 30 days unless told otherwise, and a window it cannot sum
/// is refused naming what to fix.
#[tokio::test]
async fn e10_get_usage_defaults_to_the_last_30_days_and_refuses_a_window_it_cannot_sum() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut alice = app.agent_as("alice").await;
    run(&mut alice, input("hi")).await.unwrap();
    let summed = alice
        .get_usage(pb::GetUsageRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(summed.runs, 1);
    let (since, until) = (summed.since.unwrap(), summed.until.unwrap());
    assert_eq!(until.seconds - since.seconds, 30 * 24 * 3600);

    let at = |seconds| Some(prost_types::Timestamp { seconds, nanos: 0 });
    let now = until.seconds;
    for (since, until, says) in [
        (at(now), at(now - 60), "until must be after since"),
        (at(now), at(now), "until must be after since"),
        (
            at(now - 400 * 24 * 3600),
            at(now),
            "is longer than 366 days (400.0 days)",
        ),
        (
            at(now - 366 * 24 * 3600 - 1),
            at(now),
            "is longer than 366 days (366.0 days)",
        ),
        (
            at(-5),
            None,
            "since -5s 0ns is not a time between 1970 and 9999",
        ),
        (None, at(i64::MAX), "until"),
    ] {
        let refused = alice
            .get_usage(pb::GetUsageRequest { since, until })
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            Code::InvalidArgument,
            "{}",
            refused.message()
        );
        assert!(refused.message().contains(says), "{}", refused.message());
    }
}

/// ListThreads pages most recently updated first, each page starting after the last
/// thread the one before showed: a thread that moves to the top meanwhile shifts nothing, and
/// no thread is shown twice (with offsets, the newest would have been).
#[tokio::test]
async fn list_threads_pages_after_the_last_thread_shown_and_never_repeats_one() {
    let app = spawn(Options::default()).await;
    let mut alice = agent_as(app.agent_addr, "alice").await;
    let mut started = Vec::new();
    for prompt in ["one", "two", "three"] {
        started.push(run(&mut alice, input(prompt)).await.unwrap().thread_id);
    }
    let lister = alice.clone();
    let page = |size: i32, token: String| {
        let mut lister = lister.clone();
        async move {
            lister
                .list_threads(pb::ListThreadsRequest {
                    page_size: size,
                    page_token: token,
                })
                .await
                .unwrap()
                .into_inner()
        }
    };
    let first = page(1, String::new()).await;
    let ids = |p: &pb::ListThreadsResponse| -> Vec<String> {
        p.threads.iter().map(|t| t.id.clone()).collect()
    };
    assert_eq!(ids(&first), [started[2].clone()], "the newest first");
    // A message on "two" moves it ahead of the page already shown.
    run(
        &mut alice,
        pb::RunInput {
            thread_id: started[1].clone(),
            ..input("two again")
        },
    )
    .await
    .unwrap();
    let rest = page(10, first.next_page_token).await;
    assert_eq!(ids(&rest), [started[0].clone()]);
    assert!(rest.next_page_token.is_empty(), "the last page says so");
}
