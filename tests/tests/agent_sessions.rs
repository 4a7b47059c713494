//! Session opening and prompt assembly (issue 8 so far; A-7, B-1..B-3, S0 AC-08..AC-13, AC-17):
//! both services, a scripted OpenAI-compatible model, a fake Gmail.

use agent_svc::executor::budget::TokenCounter;
use steward_proto::agent::v1 as pb;
use steward_tests::{
    Backend, Options, TestApp,
    agent_calls::{get_run, messages, watched},
    calls::call_tool,
    fakes::{
        gmail::FakeGmail,
        openai::{Answer, FakeOpenAi, tool_messages},
    },
    spawn::spawn,
};

async fn world(answers: Vec<Answer>) -> (TestApp, FakeOpenAi, FakeGmail) {
    let model = FakeOpenAi::start(answers).await;
    let gmail = FakeGmail::start().await;
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        env: vec![
            ("MODEL_CHAIN".into(), "openai/gpt-4o".into()),
            ("OPENAI_BASE_URL".into(), model.url.clone()),
            ("GMAIL_API_BASE_URL".into(), gmail.url.clone()),
            ("BOOTSTRAP_CACHE_TTL".into(), "0".into()),
        ],
        ..Options::default()
    })
    .await;
    (app, model, gmail)
}

async fn open(app: &TestApp) -> pb::OpenSessionResponse {
    let mut alice = app.agent_as("alice").await;
    alice
        .open_session(pb::OpenSessionRequest {
            time_zone: "UTC".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test]
async fn a_new_user_is_greeted_with_one_sentence_and_one_question_and_no_data_gathering() {
    let (app, model, _gmail) = world(vec![Answer::text(
        "I'm Steward, a chief of staff who gets your time back. What's eating your time right now?",
    )])
    .await;
    let greeting = open(&app).await;
    assert!(greeting.new_user && !greeting.silent);
    assert!(
        greeting
            .greeting
            .ends_with("What's eating your time right now?")
    );
    let requests = model.requests();
    assert_eq!(requests.len(), 1);
    let body = &requests[0].1;
    let tools: Vec<&str> = body["tools"]
        .as_array()
        .map(|t| {
            t.iter()
                .map(|t| t["function"]["name"].as_str().unwrap())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        tools,
        ["create_memories"],
        "no data-gathering tools are offered"
    );
    let system = body["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("[SESSION OPEN]") && system.contains("What's eating your time right now?")
    );
    assert!(!system.contains("[OPERATING MODEL]") && !system.contains("[BOOTSTRAP CONTEXT]"));
    assert!(!system.to_lowercase().contains("connect your email"));
}

/// I-4, B-1: a returning user's bootstrap context counts a task's overdue days in the zone the
/// session was opened in, not UTC's: 30 hours past due is one day where it is 06:00 or later
/// now, and two where it is still before 06:00 (the due time fell two dates back).
#[tokio::test]
async fn i4_the_bootstrap_context_counts_overdue_days_in_the_zone_the_session_opened_in() {
    let (app, model, _gmail) =
        world(vec![Answer::text("Morning."), Answer::text("Morning.")]).await;
    let now = jiff::Timestamp::now();
    let due = now - jiff::SignedDuration::from_hours(30);
    let mut g = app.gateway_as("alice").await;
    let added = call_tool(
        &mut g,
        "add_task",
        serde_json::json!({"title": "File taxes", "due": due.to_string()}),
    )
    .await;
    assert!(added.ok, "{}", added.text);
    // Fixed-offset zones whose clock reads 12:00 and 03:00 now ("Etc/GMT-3" is UTC+3). One
    // test run falls within an hour, so either zone's local hour cannot cross 06:00 in it.
    let utc_hour = i64::from(now.to_zoned(jiff::tz::TimeZone::UTC).hour());
    let zone_at = |local_hour: i64| {
        // The offset in -12..=11 that makes `local_hour` of `utc_hour`.
        match (local_hour - utc_hour + 36).rem_euclid(24) - 12 {
            0 => "Etc/GMT".to_owned(),
            o if o > 0 => format!("Etc/GMT-{o}"),
            o => format!("Etc/GMT+{}", -o),
        }
    };
    let mut overdue = Vec::new();
    for zone in [zone_at(12), zone_at(3)] {
        let mut alice = app.agent_as("alice").await;
        alice
            .open_session(pb::OpenSessionRequest {
                time_zone: zone.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        let requests = model.requests();
        let system = requests.last().unwrap().1["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(system.contains("[BOOTSTRAP CONTEXT]"), "{system}");
        overdue.push(
            ["(overdue 1d)", "(overdue 2d)"]
                .into_iter()
                .find(|days| system.contains(&format!("Top: 'File taxes' {days}")))
                .unwrap_or_else(|| panic!("in {zone}: {system}")),
        );
    }
    assert_eq!(overdue, ["(overdue 1d)", "(overdue 2d)"]);
}

#[tokio::test]
async fn the_incident_replayed_one_call_no_tools_a_small_prompt_and_the_unread_counts() {
    let (app, model, gmail) = world(vec![Answer::text(
        "Morning! 10 unread in each inbox, and 'Call dentist' is overdue.",
    )])
    .await;
    steward_tests::worlds::s0_incident_inboxes(&app, &gmail).await;

    let greeting = open(&app).await;
    assert!(!greeting.silent && !greeting.new_user);
    assert!(greeting.greeting.contains("10 unread"));
    let requests = model.requests();
    assert_eq!(requests.len(), 1, "exactly one model call");
    let body = &requests[0].1;
    assert!(
        body.get("tools").is_none(),
        "no tools offered, so no tool calls"
    );
    let system = body["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains(r#"Unread: "home@example.com" 10, "work@example.com" 10"#),
        "{system}"
    );
    assert!(
        system.contains("1 active task (1 overdue). Top: 'Call dentist'"),
        "{system}"
    );
    assert!(!system.contains("BODY-ONLY-TEXT"), "no email content");
    let tokens = TokenCounter::for_model("gpt-4o").text(&body["messages"].to_string());
    assert!(
        tokens < 3000,
        "{tokens} input tokens (the incident sent 135K)"
    );
    println!("incident replay: {tokens} input tokens in one model call");

    let mut alice = app.agent_as("alice").await;
    let run = alice
        .get_run(pb::GetRunRequest {
            run_id: greeting.run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(run.actions.is_empty(), "zero tool calls");
    let sections: Vec<String> = run
        .run
        .unwrap()
        .prompt_sections
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert!(
        sections.contains(&"BOOTSTRAP CONTEXT".to_owned())
            && sections.contains(&"SESSION OPEN".to_owned()),
        "{sections:?}"
    );
    let messages = alice
        .list_messages(pb::ListMessagesRequest {
            thread_id: greeting.thread_id,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert_eq!(
        messages.len(),
        1,
        "the greeting only; the session prompt is not a user message"
    );
}

#[tokio::test]
async fn a_returning_user_with_nothing_in_flight_gets_silence_without_a_model_call() {
    let (app, model, _gmail) = world(vec![]).await;
    let mut g = app.gateway_as("alice").await;
    call_tool(
        &mut g,
        "save_memory",
        serde_json::json!({"content": "Likes tea"}),
    )
    .await;
    let greeting = open(&app).await;
    assert!(greeting.silent && !greeting.new_user && greeting.greeting.is_empty());
    assert!(model.requests().is_empty());
}

#[tokio::test]
async fn an_empty_model_answer_makes_the_session_silent() {
    let (app, _model, _gmail) = world(vec![Answer::text("")]).await;
    let mut g = app.gateway_as("alice").await;
    call_tool(
        &mut g,
        "add_task",
        serde_json::json!({"title": "Something"}),
    )
    .await;
    let greeting = open(&app).await;
    assert!(greeting.silent, "{greeting:?}");
    assert!(greeting.greeting.is_empty());
}

/// A run another instance admitted and was executing when it died: its lease (a millisecond)
/// lapses and nobody renews it. Returns its thread's id.
async fn a_run_whose_replica_died(app: &TestApp, run_id: &str) -> String {
    use agent_svc::store::{Admission, Admitted, AgentStore, Run};
    let store = app.agent_store().await;
    let thread = store
        .create_thread(&format!("t-{run_id}"), "alice", "orphaned")
        .await
        .unwrap();
    let admitted = store
        .admit(&Admission {
            run: Run::queued(run_id, &thread.id, "alice", "web"),
            new_thread_title: None,
            user_message: Some("do the thing".into()),
            first_event: Vec::new(),
            lease: std::time::Duration::from_millis(1),
            max_active_runs: 10,
            supersede_event: Vec::new(),
            supersede_message: String::new(),
            supersede_paused: true,
            summaries: 0,
        })
        .await
        .unwrap();
    assert!(matches!(admitted, Admitted::Started { .. }), "{admitted:?}");
    thread.id
}

/// Any replica's monitor (a service built on the same database) sweeps: it ends the one dead
/// run, and a second sweep finds nothing more to end.
async fn the_monitor_ends_it_once(app: &TestApp) {
    let runs = app.monitor().await;
    let sweep = || runs.sweep_stale_runs(std::time::Duration::ZERO);
    assert_eq!(sweep().await.unwrap(), 1);
    assert_eq!(sweep().await.unwrap(), 0, "only once");
}

#[tokio::test]
async fn a_run_whose_lease_lapsed_is_failed_by_the_monitor_and_its_thread_freed() {
    let (app, _model, _gmail) = world(vec![Answer::text("fresh start")]).await;
    let thread_id = a_run_whose_replica_died(&app, "r-dead").await;

    the_monitor_ends_it_once(&app).await;

    let mut alice = app.agent_as("alice").await;
    let got = get_run(&mut alice, "r-dead").await.unwrap().run.unwrap();
    assert_eq!(got.state, pb::RunState::Failed as i32);
    assert_eq!(got.failure_kind, pb::FailureKind::TimedOut as i32);
    assert!(got.error.contains("stopped responding"));
    // Its stream has its terminal event, and the thread takes new runs.
    let events = watched(&mut alice, "r-dead", 0).await.unwrap();
    assert!(matches!(
        events.last().unwrap().kind,
        Some(pb::run_event::Kind::Error(_))
    ));
    let next = pb::RunInput {
        prompt: "hello again".into(),
        thread_id,
        ..Default::default()
    };
    let result = alice
        .run(pb::RunRequest { input: Some(next) })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(result.summary, "fresh start");
}

/// A dead run whose thread note the database refuses for good (a rule on messages) is still
/// ended by the monitor, without the note, rather than left live and counted on every sweep.
#[tokio::test]
async fn an_abandoned_run_whose_note_is_refused_is_ended_without_it() {
    let (app, _model, _gmail) = world(vec![]).await;
    a_run_whose_replica_died(&app, "r-noted").await;
    app.sql()
        .await
        .batch_execute(
            "ALTER TABLE agent.messages ADD CONSTRAINT users_only CHECK (source = 'user') NOT VALID",
        )
        .await
        .unwrap();
    the_monitor_ends_it_once(&app).await;
    let mut alice = app.agent_as("alice").await;
    let got = get_run(&mut alice, "r-noted").await.unwrap().run.unwrap();
    assert_eq!(got.state, pb::RunState::Failed as i32);
    assert!(got.error.contains("stopped responding"), "{}", got.error);
}

/// A run cancelled as its replica died (the cancel recorded, nobody left to act on it) is ended
/// by the monitor as cancelled, with the canceller's reason — not failed as "stopped
/// responding", which a task agent or a schedule would retry.
#[tokio::test]
async fn a_cancelled_run_whose_replica_died_is_ended_cancelled_with_its_reason() {
    use agent_svc::store::AgentStore;
    let (app, _model, _gmail) = world(vec![Answer::text("fresh start")]).await;
    let thread_id = a_run_whose_replica_died(&app, "r-gone").await;
    let store = app.agent_store().await;
    assert!(
        store
            .request_cancel("r-gone", Some("not needed any more"))
            .await
            .unwrap()
    );
    the_monitor_ends_it_once(&app).await;
    let mut alice = app.agent_as("alice").await;
    let got = get_run(&mut alice, "r-gone").await.unwrap().run.unwrap();
    assert_eq!(got.state, pb::RunState::Cancelled as i32);
    assert_eq!(got.failure_kind, pb::FailureKind::Cancelled as i32);
    assert_eq!(got.error, "The run was cancelled: not needed any more");
    let events = watched(&mut alice, "r-gone", 0).await.unwrap();
    match events.last().and_then(|e| e.kind.clone()) {
        Some(pb::run_event::Kind::Result(r)) => {
            assert_eq!(r.status, pb::RunState::Cancelled as i32);
            assert_eq!(r.error, got.error);
        }
        other => panic!("not ended cancelled: {other:?}"),
    }
    let notes: Vec<String> = messages(&mut alice, &thread_id)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.content)
        .collect();
    assert_eq!(notes, ["do the thing"], "no failure told in the thread");
    let next = alice
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: "hello again".into(),
                thread_id,
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(next.summary, "fresh start", "the thread was freed");
}

#[tokio::test]
async fn an_archived_session_is_summarised_into_the_next_prompt_and_found_by_a_word_from_its_transcript()
 {
    let model = FakeOpenAi::start(vec![
        Answer::text("Booked."),
        Answer::text("Alice planned a trip."), // the summary of session 1
        Answer::text("Noted."),
        // The summary of session 2, from a server that reports no usage.
        Answer::Stream {
            events: vec![
                serde_json::json!({"choices": [{"index": 0, "delta": {"content": "Alice said thanks."}}]}),
                serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            ],
            chunk: 64,
        },
        Answer::tool_calls(&[("c1", "search_agent_history", r#"{"query":"TP1347"}"#)]),
        Answer::text("You booked flight TP1347."),
    ])
    .await;
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        env: vec![
            ("MODEL_CHAIN".into(), "openai/gpt-4o".into()),
            ("OPENAI_BASE_URL".into(), model.url.clone()),
            // Every new message starts a new session, so each run archives the previous one.
            ("AGENT_SESSION_TIMEOUT".into(), "0s".into()),
        ],
        ..Options::default()
    })
    .await;
    let mut alice = app.agent_as("alice").await;
    let ask = |prompt: &str, thread: &str| pb::RunInput {
        prompt: prompt.into(),
        thread_id: thread.into(),
        ..Default::default()
    };
    let first = alice
        .run(pb::RunRequest {
            input: Some(ask("Book the Lisbon trip, flight TP1347", "")),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    let thread = first.thread_id.clone();
    alice
        .run(pb::RunRequest {
            input: Some(ask("thanks", &thread)),
        })
        .await
        .unwrap();
    let third = alice
        .run(pb::RunRequest {
            input: Some(ask("which flight was it?", &thread)),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(third.summary, "You booked flight TP1347.");

    let requests = model.requests();
    assert_eq!(requests.len(), 6);
    let system = |i: usize| {
        requests[i].1["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(
        system(1).starts_with("Summarise this conversation"),
        "the summary model wrote the summary"
    );
    assert!(
        system(2).contains(
            "[RECENT SESSIONS]\n<data source=\"past session summaries\">\n- Alice planned a trip."
        ),
        "{}",
        system(2)
    );
    // Session 1 was cleared from the live history: run 2 saw only its own turn.
    let run2_turns = requests[2].1["messages"].as_array().unwrap().len();
    assert_eq!(run2_turns, 2, "system + the new user turn");
    // search_agent_history found session 1 by a word only its transcript has.
    let tool_result = requests[5].1["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap()["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        tool_result.starts_with(
            "<data source=\"result of search_agent_history\">\nPast sessions matching \"TP1347\" (1):"
        ),
        "{tool_result}"
    );
    assert!(
        tool_result.contains("Alice planned a trip."),
        "{tool_result}"
    );
    // E-10: the two summaries' calls are alice's cost beside her three runs' four.
    let usage = alice
        .get_usage(pb::GetUsageRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!((usage.runs, usage.summary_calls), (3, 2));
    let total = usage.total.unwrap();
    assert_eq!(total.model_calls, 6);
    // Each text answer reports 120 tokens in, the tool call 100; the summary that reported
    // nothing is counted by the tokenizer (its instructions and transcript), not as free.
    let estimated = total.input_tokens - (4 * 120 + 100);
    assert!((30..400).contains(&estimated), "{estimated}");
    assert!(total.output_tokens > 4 * 12 + 20, "its output counted too");
}

/// An app whose first replica takes no background work, and a run on it whose model queued a
/// task agent (goal `goal`): the model's answers after the parent's two are `then`. Returns the
/// app, the model, the parent run's result and the task's id.
async fn a_task_queued_by_the_model(
    goal: &str,
    then: Vec<Answer>,
    env: &[(&str, &str)],
) -> (TestApp, FakeOpenAi, pb::RunResult, String) {
    let arguments =
        serde_json::json!({"instructions": format!("Work towards: {goal}"), "goal": goal});
    let mut answers = vec![
        Answer::tool_calls(&[("c1", "create_task_agent", &arguments.to_string())]),
        Answer::text("I've started a task agent."),
    ];
    answers.extend(then);
    let model = FakeOpenAi::start(answers).await;
    let mut all = vec![
        ("MODEL_CHAIN".to_owned(), "openai/gpt-4o".to_owned()),
        ("OPENAI_BASE_URL".to_owned(), model.url.clone()),
        // This instance takes no background work: only another one can run the task.
        ("TASK_AGENT_WORKERS".to_owned(), "false".to_owned()),
    ];
    all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        env: all,
        ..Options::default()
    })
    .await;
    let parent = app
        .agent_as("alice")
        .await
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: format!("{goal}, in the background"),
                // The task's runs are told the time where the user is, as the parent was.
                time_zone: "Asia/Tokyo".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(parent.summary, "I've started a task agent.");
    let task: String = app
        .sql()
        .await
        .query_one("SELECT id FROM agent.task_agents", &[])
        .await
        .unwrap()
        .get(0);
    (app, model, parent, task)
}

const TASK_WORKERS: [(&str, &str); 2] = [
    ("TASK_AGENT_WORKERS", "true"),
    ("TASK_AGENT_POLL_INTERVAL", "100ms"),
];

/// The task's row once `ready` holds of it (state, attempts, last error, claimed by), within
/// 15 s.
async fn task_row_when(
    app: &TestApp,
    task: &str,
    ready: impl Fn(&str, i32, &str, Option<&str>) -> bool,
) -> (String, i32, String, Option<String>) {
    let client = app.sql().await;
    tokio::time::timeout(std::time::Duration::from_secs(15), async {
        loop {
            let row = client
                .query_one(
                    "SELECT state, attempts, coalesce(last_error, ''), claimed_by FROM agent.task_agents WHERE id = $1",
                    &[&task],
                )
                .await
                .unwrap();
            let (state, attempts, error, claimed): (String, i32, String, Option<String>) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            if ready(&state, attempts, &error, claimed.as_deref()) {
                return (state, attempts, error, claimed);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the task reached the state within 15 s")
}

/// The task agent's report on the parent thread, within 15 s.
async fn task_report(app: &TestApp, thread: &str) -> String {
    let mut alice = app.agent_as("alice").await;
    tokio::time::timeout(std::time::Duration::from_secs(15), async {
        loop {
            let messages = alice
                .list_messages(pb::ListMessagesRequest {
                    thread_id: thread.to_owned(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .messages;
            if let Some(m) = messages
                .iter()
                .find(|m| m.content.starts_with("Task agent"))
            {
                return m.content.clone();
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the task agent reported within 15 s")
}

#[tokio::test]
async fn a_task_agent_spawned_on_one_instance_runs_on_another_and_reports_to_the_parent_thread() {
    let (mut app, model, started, task) = a_task_queued_by_the_model(
        "task summary",
        vec![
            Answer::text("You have no pending tasks."),
            Answer::text("It found no pending tasks."),
        ],
        &[],
    )
    .await;
    app.start_another_agent_with(&TASK_WORKERS).await;
    assert_eq!(
        task_report(&app, &started.thread_id).await,
        "Task agent finished (task summary):\nYou have no pending tasks."
    );
    let task_run: String = app
        .sql()
        .await
        .query_one(
            "SELECT id FROM agent.runs WHERE thread_id = 'task-' || $1",
            &[&task],
        )
        .await
        .unwrap()
        .get(0);
    let shown = get_run(&mut app.agent_as("alice").await, &task_run)
        .await
        .unwrap()
        .run
        .unwrap();
    assert_eq!(
        shown.channel,
        pb::Channel::TaskAgent as i32,
        "GetRun tells a task agent's run from a caller's"
    );
    let task_request = &model.requests()[2].1;
    let system = task_request["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("background task agent")
            && system.contains("<data source=\"task goal\">\ntask summary\n</data>"),
        "{system}"
    );
    assert!(
        system.contains("[Asia/Tokyo]\nThe user's time zone is Asia/Tokyo"),
        "the parent run's zone: {system}"
    );
    let tools: Vec<&str> = task_request["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert!(
        !tools.contains(&"create_task_agent"),
        "a task agent cannot start another: {tools:?}"
    );

    // B-5: the parent's next run knows what the task reported.
    app.agent_as("alice")
        .await
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: "what did the background task find?".into(),
                thread_id: started.thread_id.clone(),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    let next = &model.requests()[3].1;
    let system = next["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains(&format!(
            "[BACKGROUND TASKS]\n<data source=\"task agents started in this conversation\">\n- task summary [{task}]: finished:\n  You have no pending tasks.\n</data>"
        )),
        "{system}"
    );
}

/// B-5 on the embedded default (in-memory stores, one process): the task is taken up by the
/// same replica and reports to the parent thread, whose next run knows what it found.
#[tokio::test]
async fn b5_a_task_agent_runs_and_reports_on_the_in_memory_store() {
    let arguments = r#"{"instructions":"Look at my tasks","goal":"task check"}"#;
    let model = FakeOpenAi::start(vec![
        Answer::tool_calls(&[("c1", "create_task_agent", arguments)]),
        // The parent's answer and the task's are alike: one replica runs both, in either order.
        Answer::text("Nothing is overdue."),
        Answer::text("Nothing is overdue."),
        Answer::text("It found nothing overdue."),
    ])
    .await;
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env: vec![
            ("MODEL_CHAIN".into(), "openai/gpt-4o".into()),
            ("OPENAI_BASE_URL".into(), model.url.clone()),
            ("TASK_AGENT_POLL_INTERVAL".into(), "100ms".into()),
        ],
        ..Options::default()
    })
    .await;
    let mut alice = app.agent_as("alice").await;
    let run = |prompt: &str, thread_id: &str| pb::RunRequest {
        input: Some(pb::RunInput {
            prompt: prompt.into(),
            thread_id: thread_id.into(),
            ..Default::default()
        }),
    };
    let parent = alice
        .run(run("check my tasks in the background", ""))
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    let report = task_report(&app, &parent.thread_id).await;
    assert_eq!(
        report,
        "Task agent finished (task check):\nNothing is overdue."
    );
    alice
        .run(run("what did it find?", &parent.thread_id))
        .await
        .unwrap();
    let next = &model.requests()[3].1;
    let system = next["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("- task check [") && system.contains("]: finished:\n  Nothing is overdue."),
        "{system}"
    );
}

#[tokio::test]
async fn a_task_agent_that_fails_on_a_retriable_error_is_queued_again_with_backoff() {
    let failing = Answer::Error {
        status: 503,
        retry_after: None,
    };
    let (mut app, _model, _parent, task) = a_task_queued_by_the_model(
        "flaky work",
        vec![failing.clone(), failing.clone(), failing],
        &[("MODEL_RETRIES", "2")],
    )
    .await;
    app.start_another_agent_with(&TASK_WORKERS).await;
    let (state, attempts, error, _) = task_row_when(&app, &task, |state, attempts, _, _| {
        state == "queued" && attempts > 0
    })
    .await;
    assert_eq!((state.as_str(), attempts), ("queued", 1));
    assert!(error.contains("HTTP 503"), "{error}");
    let later: bool = app
        .sql()
        .await
        .query_one(
            "SELECT next_attempt_at > now() + interval '5 seconds' FROM agent.task_agents WHERE id = $1",
            &[&task],
        )
        .await
        .unwrap()
        .get(0);
    assert!(later, "the retry waits at least the 10 s backoff");
}

/// B-5, E-12: a replica that stops while its task agent works ends the task's run as
/// interrupted and hands the task back; another replica takes it up at once (not when the claim
/// lapses, 15 minutes later) and starts it afresh. The restart spends no try of E-12's, so a
/// task meets every rolling deploy without running out of retries.
#[tokio::test]
async fn b5_a_task_agent_in_progress_at_shutdown_is_handed_back_and_finished_by_another_replica() {
    let (mut app, model, parent, task) = a_task_queued_by_the_model(
        "long research",
        vec![
            // The first attempt's model call outlasts its replica.
            Answer::Slow(
                Box::new(Answer::text("never seen")),
                std::time::Duration::from_secs(120),
            ),
            Answer::text("Found it."),
        ],
        &[],
    )
    .await;
    let first = app.start_another_agent_with(&TASK_WORKERS).await;
    let claimed = task_row_when(&app, &task, |state, _, _, _| state == "running").await;
    assert_eq!(claimed.1, 1);
    tokio::time::timeout(std::time::Duration::from_secs(15), async {
        while model.requests().len() < 3 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the first attempt asked the model");

    app.stop_service(first).await.expect("a clean drain");
    let sql = app.sql().await;
    let lapsed: bool = sql
        .query_one(
            "SELECT state = 'running' AND attempts = 0 AND claimed_until <= now() FROM agent.task_agents WHERE id = $1",
            &[&task],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        lapsed,
        "handed back as the replica stopped, not held until its claim lapses, and the stop \
         not counted as a try"
    );
    let (state, kind): (String, Option<String>) = sql
        .query_one(
            "SELECT state, failure_kind FROM agent.runs WHERE request_id = $1",
            &[&format!("task-{task}-attempt-1")],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(
        (state.as_str(), kind.as_deref()),
        ("failed", Some("interrupted")),
        "the stopping replica ended its run itself, as interrupted"
    );

    // The replica that takes it over follows the stopped attempt's run rather than starting a
    // second beside it, finds it interrupted, and starts the task again at once, under a new
    // attempt (a run of its own) that is still its first try. No monitor is needed for any of it.
    app.start_another_agent_with(&TASK_WORKERS).await;
    assert_eq!(
        task_report(&app, &parent.thread_id).await,
        "Task agent finished (long research):\nFound it."
    );
    let (attempts, restarts, settled): (i32, i32, i32) = sql
        .query_one(
            "SELECT attempts, restarts, settled_attempt FROM agent.task_agents WHERE id = $1 AND state = 'completed'",
            &[&task],
        )
        .await
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .unwrap();
    assert_eq!(
        (attempts, restarts, settled),
        (2, 1, 2),
        "two attempts, one of them stopped by the restart: one try spent"
    );
    assert_eq!(
        task_runs(&app, &task).await,
        [
            format!("task-{task}-attempt-1"),
            format!("task-{task}-attempt-2")
        ]
    );
}

/// The request ids of the runs on the task's thread, oldest first.
async fn task_runs(app: &TestApp, task: &str) -> Vec<String> {
    app.sql()
        .await
        .query(
            "SELECT request_id FROM agent.runs WHERE thread_id = $1 ORDER BY created_at",
            &[&format!("task-{task}")],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The task is due now rather than after its wait.
async fn due_now(app: &TestApp, task: &str) {
    app.sql()
        .await
        .execute(
            "UPDATE agent.task_agents SET next_attempt_at = now() WHERE id = $1",
            &[&task],
        )
        .await
        .unwrap();
}

/// B-5, E-12: a task whose thread is busy (or whose user is at the run cap) has not been tried:
/// it waits without spending an attempt, and runs under the same attempt once the thread is free.
#[tokio::test]
async fn b5_a_task_agent_whose_thread_is_busy_waits_without_spending_an_attempt() {
    use agent_svc::store::{AgentStore, LockOutcome};
    let (mut app, _model, parent, task) =
        a_task_queued_by_the_model("tidy up", vec![Answer::text("Tidied.")], &[]).await;
    let store = app.agent_store().await;
    let thread = format!("task-{task}");
    store.create_thread(&thread, "alice", "busy").await.unwrap();
    let LockOutcome::Acquired(lease) = store
        .lock_thread(&thread, "someone-else", std::time::Duration::from_secs(120))
        .await
        .unwrap()
    else {
        panic!("the test holds the task's thread");
    };

    app.start_another_agent_with(&TASK_WORKERS).await;
    let (state, attempts, error, claimed_by) = task_row_when(&app, &task, |_, _, error, _| {
        error.contains("already has an active run")
    })
    .await;
    assert_eq!(
        (state.as_str(), attempts, claimed_by),
        ("queued", 0, None),
        "not an attempt: {error}"
    );

    store.release_lease(&lease).await.unwrap();
    due_now(&app, &task).await;
    assert_eq!(
        task_report(&app, &parent.thread_id).await,
        "Task agent finished (tidy up):\nTidied."
    );
    assert_eq!(
        task_runs(&app, &task).await,
        [format!("task-{task}-attempt-1")],
        "one run, the first attempt's"
    );
}

/// B-5, E-12: a task whose run the database refuses for good (here a constraint an operator
/// added) spends its attempt and is retried with backoff like any failure, rather than waiting
/// for hours as if the database were away for a moment.
#[tokio::test]
async fn b5_a_task_agent_whose_run_the_database_refuses_for_good_spends_its_attempt() {
    let (mut app, _model, _parent, task) =
        a_task_queued_by_the_model("tidy up", vec![Answer::text("Tidied.")], &[]).await;
    app.sql()
        .await
        .batch_execute(
            "ALTER TABLE agent.runs ADD CONSTRAINT no_task_runs \
               CHECK (request_id NOT LIKE 'task-%') NOT VALID",
        )
        .await
        .unwrap();
    app.start_another_agent_with(&TASK_WORKERS).await;
    let (state, attempts, error, _) =
        task_row_when(&app, &task, |_, _, error, _| !error.is_empty()).await;
    assert_eq!((state.as_str(), attempts), ("queued", 1), "{error}");
    assert!(
        error.contains("refused this for good") && error.contains("no_task_runs"),
        "{error}"
    );
    assert!(task_runs(&app, &task).await.is_empty());
}

#[tokio::test]
async fn b1_a_run_prompt_holds_what_memory_knows_about_the_user() {
    let (app, model, _gmail) = world(vec![Answer::text("Noted.")]).await;
    let saved = call_tool(
        &mut app.gateway_as("alice").await,
        "create_memories",
        serde_json::json!({"memories": [{"content": "Prefers dentist appointments on Friday mornings"}]}),
    )
    .await;
    assert!(saved.ok, "{}", saved.text);
    let mut alice = app.agent_as("alice").await;
    let result = steward_tests::agent_calls::run_once(&mut alice, "book the dentist", "")
        .await
        .expect("run");
    assert_eq!(result.status(), pb::RunState::Completed, "{}", result.error);

    let requests = model.requests();
    let system = requests[0].1["messages"][0]["content"]
        .as_str()
        .expect("a system message");
    let about = &system[system.find("[ABOUT THE USER]").expect("the section")..];
    assert!(
        about.contains("Prefers dentist appointments on Friday mornings"),
        "{about}"
    );
}

/// What the tools answered a run in `time_zone` whose model set a reminder due `due_at`.
async fn reminder_set_in(time_zone: &str, due_at: &str) -> Vec<String> {
    let (app, model, _gmail) = world(vec![
        Answer::tool_calls(&[(
            "call_remind",
            "create_reminder",
            &format!(r#"{{"text": "Call mom", "due_at": "{due_at}"}}"#),
        )]),
        Answer::text("Set for 3 pm your time."),
    ])
    .await;
    let mut alice = app.agent_as("alice").await;
    alice
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: "remind me to call mom on Dec 1 2030 at 3pm".into(),
                time_zone: time_zone.into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    tool_messages(&model.requests()[1].1)
        .into_iter()
        .map(|(_, content)| content)
        .collect()
}

/// B-1: a run's tool calls carry its time zone, so the times its tools return are in the
/// user's zone, named — the model is never left to convert UTC itself.
#[tokio::test]
async fn a_runs_tools_answer_in_the_users_time_zone() {
    let answered = reminder_set_in("Europe/Berlin", "2030-12-01T14:00:00Z").await;
    assert!(
        answered
            .iter()
            .any(|t| t.contains("set for Dec 1 15:00 CET")),
        "{answered:?}"
    );
}

/// B-1: a time the model writes without an offset is the user's local time, read in the
/// run's zone; a run with no zone has it refused, naming the offset to add.
#[tokio::test]
async fn a_local_time_the_model_writes_is_the_users_and_refused_when_the_run_has_no_zone() {
    let answered = reminder_set_in("Europe/Berlin", "2030-12-01T15:00").await;
    assert!(
        answered
            .iter()
            .any(|t| t.contains("set for Dec 1 15:00 CET")),
        "{answered:?}"
    );
    let answered = reminder_set_in("", "2030-12-01T15:00").await;
    assert!(
        answered
            .iter()
            .any(|t| t.contains("has no offset") && t.contains("time zone is not known")),
        "{answered:?}"
    );
}

/// B-1: the current time is given in the user's time zone — a run's, and a session opening's
/// (its OpenSession time zone) — and a zone that is not one is refused by name.
#[tokio::test]
async fn the_users_time_zone_reaches_the_current_time_of_a_run_and_of_a_session_opening() {
    let (app, model, _gmail) = world(vec![
        Answer::text("Welcome! What's eating your time right now?"),
        Answer::text("Morning."),
    ])
    .await;
    let mut alice = app.agent_as("alice").await;
    alice
        .open_session(pb::OpenSessionRequest {
            // Padded as a form might send it: the gateway is given the name itself.
            time_zone: " Asia/Tokyo ".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    alice
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: "what day is it?".into(),
                time_zone: "America/New_York".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    let requests = model.requests();
    let current_time = |i: usize| {
        let system = requests[i].1["messages"][0]["content"].as_str().unwrap();
        system[system.find("[CURRENT TIME]").expect("a current time")..].to_owned()
    };
    for (i, zone) in [(0, "Asia/Tokyo"), (1, "America/New_York")] {
        let said = current_time(i);
        assert!(
            said.contains(&format!(
                "[{zone}]\nThe user's time zone is {zone}: give dates"
            )),
            "{said}"
        );
    }

    for (time_zone, refused) in [
        (
            "Mars/Olympus_Mons",
            alice
                .run(pb::RunRequest {
                    input: Some(pb::RunInput {
                        prompt: "hi".into(),
                        time_zone: "Mars/Olympus_Mons".into(),
                        ..Default::default()
                    }),
                })
                .await
                .unwrap_err(),
        ),
        (
            "CET+99",
            alice
                .open_session(pb::OpenSessionRequest {
                    time_zone: "CET+99".into(),
                    ..Default::default()
                })
                .await
                .unwrap_err(),
        ),
    ] {
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(
            refused.message().contains(&format!(
                "time_zone \"{time_zone}\" is not an IANA time zone"
            )),
            "{}",
            refused.message()
        );
    }
}

/// A-1, A-2: the conversation a caller starts a thread with becomes the thread's history, so
/// its later runs still see it (a continuation after an approval reads the same history).
#[tokio::test]
async fn a1_the_conversation_a_thread_starts_with_stays_in_its_history() {
    let (app, model, _gmail) = world(vec![
        Answer::text("The one about Q3."),
        Answer::text("Done."),
    ])
    .await;
    let mut alice = app.agent_as("alice").await;
    let entry = |role: pb::Role, text: &str| pb::ConversationEntry {
        role: role as i32,
        text: text.into(),
    };
    let first = alice
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: "which one did she mean?".into(),
                conversation: vec![
                    entry(pb::Role::User, "Alice asked about Q3"),
                    entry(pb::Role::Assistant, "She wants the numbers by Friday."),
                ],
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    alice
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: "thanks".into(),
                thread_id: first.thread_id.clone(),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    let requests = model.requests();
    let said: Vec<&str> = requests[1].1["messages"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|m| m["content"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        said,
        [
            "Alice asked about Q3",
            "She wants the numbers by Friday.",
            "which one did she mean?",
            "The one about Q3.",
            "thanks"
        ]
    );
}
