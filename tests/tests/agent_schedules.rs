//! Scheduled runs through the real services (issue 16; E-2, E-12, B-4, I-1, O-3): schedules
//! are owner-scoped and validated; every occurrence starts exactly one run across replicas;
//! missed slots run once; a busy thread postpones; briefings read metadata only, archive their
//! session and leave side effects waiting for approval.
//!
//! The replicas' own workers are switched off (`SCHEDULE_WORKERS=false`) and the test fires
//! them with its own clock through `RunService::fire_due_schedules`, whose handles resolve
//! when each occurrence has settled: minutes pass in the test without anyone waiting for them.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use agent_svc::{
    executor::budget::TokenCounter,
    runs::{RunService, scheduled::Fired},
    store::{AgentStore, LockOutcome, ScheduleOutcome},
};
use steward_proto::{agent::v1 as pb, gateway::v1 as gw};
use steward_tests::{
    Backend, TestApp, UserAgent,
    agent_calls::{get_run, messages},
    calls::connect_account,
    fakes::{
        gmail::{FakeGmail, FakeMessage},
        openai::{Answer, FakeOpenAi},
    },
    spawn_app_with,
    worlds::gmail_world,
};
use tokio_stream::StreamExt;

const NO_WORKERS: (&str, &str) = ("SCHEDULE_WORKERS", "false");

fn every_minute_in_berlin(kind: pb::ScheduleKind) -> pb::CreateScheduleRequest {
    pb::CreateScheduleRequest {
        kind: kind as i32,
        cron: "* * * * *".into(),
        time_zone: "Europe/Berlin".into(),
        ..Default::default()
    }
}

async fn create(
    client: &mut UserAgent,
    request: pb::CreateScheduleRequest,
) -> Result<pb::Schedule, tonic::Status> {
    Ok(client
        .create_schedule(request)
        .await?
        .into_inner()
        .schedule
        .expect("the created schedule"))
}

async fn listed(client: &mut UserAgent) -> Vec<pb::Schedule> {
    client
        .list_schedules(pb::ListSchedulesRequest {})
        .await
        .expect("ListSchedules")
        .into_inner()
        .schedules
}

fn time(t: &Option<prost_types::Timestamp>) -> SystemTime {
    let t = t.as_ref().expect("a timestamp");
    SystemTime::UNIX_EPOCH + Duration::new(t.seconds as u64, t.nanos as u32)
}

/// Every replica fires what is due at `now`, all at once; returns every occurrence fired,
/// once it has settled.
async fn fire_everywhere(replicas: &[Arc<RunService>], now: SystemTime) -> Vec<Fired> {
    let fired =
        futures_util::future::join_all(replicas.iter().enumerate().map(|(i, r)| async move {
            r.fire_due_schedules(&format!("replica-{i}"), now)
                .await
                .expect("fire due schedules")
        }))
        .await;
    let mut settled = Vec::new();
    for handle in fired.into_iter().flatten() {
        settled.push(handle.await.expect("the occurrence settles"));
    }
    settled
}

async fn runs_on(app: &TestApp, thread_id: &str) -> Vec<(String, String)> {
    app.sql()
        .await
        .query(
            "SELECT id, coalesce(request_id, '') FROM agent.runs WHERE thread_id = $1 ORDER BY created_at",
            &[&thread_id],
        )
        .await
        .expect("query runs")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test]
async fn o3_a_schedule_every_minute_in_berlin_fires_once_per_minute_across_three_replicas() {
    let mut app = spawn_app_with(Backend::Postgres, &[NO_WORKERS]).await;
    app.start_another_agent_with(&[NO_WORKERS]).await;
    app.start_another_agent_with(&[NO_WORKERS]).await;
    let replicas = app.agent_replicas();
    assert_eq!(replicas.len(), 3);
    let mut alice = app.agent_as("alice").await;
    let schedule = create(
        &mut alice,
        every_minute_in_berlin(pb::ScheduleKind::Heartbeat),
    )
    .await
    .expect("CreateSchedule");
    let first = time(&schedule.next_due_at);

    let mut run_ids = Vec::new();
    for minute in 0..5u64 {
        let now = first + Duration::from_secs(minute * 60 + 1);
        let fired = fire_everywhere(&replicas, now).await;
        assert_eq!(
            fired.len(),
            1,
            "minute {minute}: exactly one occurrence fires"
        );
        assert_eq!(fired[0].outcome, ScheduleOutcome::Completed, "{fired:?}");
        run_ids.push(fired[0].run_id.clone().expect("its run"));
        let later = now + Duration::from_secs(30);
        assert!(
            fire_everywhere(&replicas, now).await.is_empty()
                && fire_everywhere(&replicas, later).await.is_empty(),
            "minute {minute}: nothing more fires until the next minute"
        );
    }

    let runs = runs_on(&app, &schedule.thread_id).await;
    assert_eq!(runs.len(), 5, "one run per occurrence: {runs:?}");
    let mut keys: Vec<&String> = runs.iter().map(|(_, k)| k).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 5, "five distinct occurrences: {keys:?}");
    let now = listed(&mut alice).await;
    assert_eq!(now[0].last_outcome, pb::ScheduleOutcome::Completed as i32);
    assert_eq!(now[0].last_run_id, run_ids[4]);
    assert_eq!(
        time(&now[0].next_due_at),
        first + Duration::from_secs(5 * 60)
    );
    // The thread the schedule writes to is the user's like any other.
    let threads = alice
        .list_threads(pb::ListThreadsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .threads;
    assert!(threads.iter().any(|t| t.id == schedule.thread_id));
    assert_eq!(
        messages(&mut alice, &schedule.thread_id)
            .await
            .unwrap()
            .iter()
            .filter(|m| m.source == pb::MessageSource::Agent as i32)
            .count(),
        5,
        "each heartbeat's answer is posted to the thread"
    );
}

#[tokio::test]
async fn e12_occurrences_missed_while_every_replica_was_down_run_once_on_recovery() {
    let mut app = spawn_app_with(Backend::Postgres, &[NO_WORKERS]).await;
    let mut alice = app.agent_as("alice").await;
    let schedule = create(
        &mut alice,
        every_minute_in_berlin(pb::ScheduleKind::CheckIn),
    )
    .await
    .unwrap();
    let first = time(&schedule.next_due_at);
    app.stop_service(app.agent_addr)
        .await
        .expect("the only agent stops");

    // Three slots pass with no replica up; then one comes back.
    let addr = app.start_another_agent_with(&[NO_WORKERS]).await;
    let replicas = vec![app.agent_replicas()[0].clone()];
    let recovered = first + Duration::from_secs(2 * 60 + 20);
    let fired = fire_everywhere(&replicas, recovered).await;
    assert_eq!(fired.len(), 1, "the missed slots run once, not three times");
    assert_eq!(fired[0].outcome, ScheduleOutcome::Completed);
    assert!(fire_everywhere(&replicas, recovered).await.is_empty());
    let mut alice = steward_tests::agent_as(addr, "alice").await;
    let after = listed(&mut alice).await;
    assert_eq!(
        time(&after[0].next_due_at),
        first + Duration::from_secs(3 * 60),
        "the next slot is the first one after recovery"
    );
    assert_eq!(runs_on(&app, &schedule.thread_id).await.len(), 1);
}

#[tokio::test]
async fn a_busy_thread_postpones_the_occurrence_and_it_runs_once_when_free() {
    let (app, (_model, gmail), mut alice, schedule) =
        a_heartbeat(vec![Answer::text("Nothing urgent.")], &[]).await;
    let replicas = app.agent_replicas();
    let due = time(&schedule.next_due_at);
    let store = app.agent_store().await;
    let LockOutcome::Acquired(lease) = store
        .lock_thread(&schedule.thread_id, "a-users-run", Duration::from_secs(120))
        .await
        .unwrap()
    else {
        panic!("the thread was free")
    };

    let asked = gmail.requests();
    let fired = fire_everywhere(&replicas, due + Duration::from_secs(1)).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Postponed);
    assert!(runs_on(&app, &schedule.thread_id).await.is_empty());
    assert_eq!(
        gmail.requests(),
        asked,
        "a postponed occurrence does not fetch its context (the unread counts)"
    );
    let shown = listed(&mut alice).await;
    assert_eq!(shown[0].last_outcome, pb::ScheduleOutcome::Postponed as i32);
    assert!(
        shown[0].last_error.contains("already has an active run"),
        "{}",
        shown[0].last_error
    );
    assert!(
        fire_everywhere(&replicas, due + Duration::from_secs(11))
            .await
            .is_empty(),
        "a postponed occurrence waits its turn"
    );

    // Still busy an hour later: the later an occurrence is, the longer it waits (ten minutes
    // at most), rather than trying every 30 s for as long as an approval stays undecided.
    let late = due + Duration::from_secs(3600);
    assert_eq!(
        fire_everywhere(&replicas, late).await[0].outcome,
        ScheduleOutcome::Postponed
    );
    assert!(
        fire_everywhere(&replicas, late + Duration::from_secs(300))
            .await
            .is_empty(),
        "an hour late, it waits ten minutes"
    );

    store.release_lease(&lease).await.unwrap();
    let fired = fire_everywhere(&replicas, late + Duration::from_secs(601)).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Completed);
    assert_eq!(runs_on(&app, &schedule.thread_id).await.len(), 1);
    assert!(gmail.requests() > asked, "the run that started fetched it");
}

/// A replica starts the occurrences due at one time together: one whose gateway call hangs
/// does not hold up the claiming and starting of the others.
#[tokio::test]
async fn occurrences_due_together_start_together_on_a_replica() {
    // A "gateway" that accepts connections and never answers.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket);
        }
    });
    let mut app = spawn_app_with(Backend::Postgres, &[NO_WORKERS]).await;
    let gateway = format!("http://{hole_addr}");
    app.start_another_agent_with(&[NO_WORKERS, ("GATEWAY_URL", gateway.as_str())])
        .await;
    let mut due = Vec::new();
    for user in ["ann", "ben", "cat"] {
        let schedule = create(
            &mut app.agent_as(user).await,
            every_minute_in_berlin(pb::ScheduleKind::Heartbeat),
        )
        .await
        .unwrap();
        due.push(time(&schedule.next_due_at));
    }
    let now = due.into_iter().max().unwrap() + Duration::from_secs(1);

    let replica = &app.agent_replicas()[0];
    let fired = tokio::time::timeout(
        Duration::from_secs(4),
        replica.fire_due_schedules("replica", now),
    )
    .await
    .expect("every due occurrence was claimed, its start under way, while the gateway hangs")
    .expect("fire due schedules");
    assert_eq!(fired.len(), 3);
}

/// Twelve large newsletters in an inbox (ten of them unread).
fn newsletters(prefix: &str) -> Vec<FakeMessage> {
    (0..12)
        .map(|n| FakeMessage::html_newsletter(&format!("{prefix}{n:02}"), n))
        .collect()
}

#[tokio::test]
async fn b4_a_briefing_over_two_inboxes_reads_metadata_only_stays_under_3000_tokens_and_archives() {
    let answers = vec![
        Answer::tool_calls(&[("call_unread", "search_gmail", r#"{"query": "in:inbox"}"#)]),
        Answer::text("Twenty unread newsletters from Acme across both inboxes; nothing urgent."),
    ];
    let (app, model, gmail) = gmail_world(answers, &[NO_WORKERS]).await;
    gmail.add_messages("tok-alice", newsletters("a"));
    gmail.add_messages("tok-alice-work", newsletters("w"));
    gmail.set_unread("tok-alice", 10);
    gmail.set_unread("tok-alice-work", 10);
    connect_account(
        &mut app.gateway_as("alice").await,
        gw::Integration::Gmail,
        "alice@work.example",
        "tok-alice-work",
    )
    .await;
    let mut alice = app.agent_as("alice").await;
    let schedule = create(
        &mut alice,
        pb::CreateScheduleRequest {
            kind: pb::ScheduleKind::Briefing as i32,
            cron: "0 7 * * *".into(),
            time_zone: "Europe/Berlin".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();

    let fired = fire_everywhere(
        &app.agent_replicas(),
        time(&schedule.next_due_at) + Duration::from_secs(1),
    )
    .await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Completed, "{fired:?}");

    // The run's model calls (the archive's summary call has no tools).
    let requests: Vec<_> = model
        .requests()
        .into_iter()
        .filter(|(_, body)| body["tools"].as_array().is_some_and(|t| !t.is_empty()))
        .collect();
    assert_eq!(requests.len(), 2, "one search, one answer");
    let counter = TokenCounter::for_model("gpt-4o");
    for (_, body) in &requests {
        let sent = serde_json::to_string(body).unwrap();
        assert!(
            !sent.contains("BODY-ONLY-TEXT"),
            "no email body reaches the model"
        );
        let tokens = counter.text(&sent);
        assert!(tokens < 3000, "a briefing request is {tokens} tokens");
    }
    let system = requests[0].1["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("[Europe/Berlin]\nThe user's time zone is Europe/Berlin"),
        "a briefing speaks of its owner's day, in the schedule's zone: {system}"
    );
    let answered = serde_json::to_string(&requests[1].1).unwrap();
    assert!(
        answered.contains("Acme weekly #9") && answered.contains("alice@work.example"),
        "the search covered both inboxes"
    );
    assert!(
        !answered.contains("Acme weekly #11") && answered.matches("Acme weekly #").count() == 20,
        "I-1: a scheduled run gets at most 10 results per account"
    );
    let offered: Vec<&str> = requests[0].1["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert!(offered.contains(&"search_gmail") && offered.contains(&"gmail_send"));
    assert!(
        !offered.contains(&"get_gmail") && !offered.contains(&"gmail_thread_read"),
        "a briefing is not offered tools that read bodies: {offered:?}"
    );
    let listed_ids = gmail
        .recorded()
        .iter()
        .filter(|r| r.path.ends_with("/messages") && r.method == "GET")
        .count();
    assert_eq!(listed_ids, 2, "one metadata list per account");

    // The briefing is posted to the thread, and its session archived (S2).
    let thread = &schedule.thread_id;
    let posted = messages(&mut alice, thread).await.unwrap();
    assert!(
        posted
            .iter()
            .any(|m| m.source == pb::MessageSource::Agent as i32
                && m.content.contains("Twenty unread newsletters")),
        "{posted:?}"
    );
    let sql = app.sql().await;
    let history: i64 = sql
        .query_one(
            "SELECT count(*) FROM agent.llm_history WHERE thread_id = $1",
            &[thread],
        )
        .await
        .unwrap()
        .get(0);
    let archives: i64 = sql
        .query_one(
            "SELECT count(*) FROM agent.session_archives WHERE thread_id = $1",
            &[thread],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!((history, archives), (0, 1), "the session was archived");
}

/// Alice's hourly briefing "Send my boss a status update.", fired once at its first due time.
async fn a_briefing_that_sends_fires(app: &TestApp, alice: &mut UserAgent) -> Vec<Fired> {
    let schedule = create(
        alice,
        pb::CreateScheduleRequest {
            kind: pb::ScheduleKind::Briefing as i32,
            prompt: "Send my boss a status update.".into(),
            interval: Some(prost_types::Duration {
                seconds: 3600,
                nanos: 0,
            }),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    fire_everywhere(
        &app.agent_replicas(),
        time(&schedule.next_due_at) + Duration::from_secs(1),
    )
    .await
}

#[tokio::test]
async fn a_briefing_that_wants_to_send_under_supervised_trust_leaves_a_pending_approval_and_sends_nothing()
 {
    let answers = vec![Answer::tool_calls(&[(
        "call_send",
        "gmail_send",
        r#"{"to": "boss@example.com", "subject": "Status", "body": "All good."}"#,
    )])];
    let (app, _model, gmail) = gmail_world(answers, &[NO_WORKERS]).await;
    let mut alice = app.agent_as("alice").await;
    let fired = a_briefing_that_sends_fires(&app, &mut alice).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::AwaitingApproval);
    assert!(gmail.sent().is_empty(), "nothing is sent unattended");
    let run = get_run(&mut alice, fired[0].run_id.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(
        run.run.unwrap().state,
        pb::RunState::AwaitingConfirmation as i32,
        "the approval waits for the user (the session is not archived under it)"
    );
    let send = run
        .actions
        .iter()
        .find(|a| a.tool == "gmail_send")
        .expect("the send's action");
    assert_eq!(send.state, pb::ActionState::AwaitingConfirmation as i32);
    assert_eq!(
        listed(&mut alice).await[0].last_outcome,
        pb::ScheduleOutcome::AwaitingApproval as i32
    );
}

/// The tools a model request offered, by name.
fn offered(request: &serde_json::Value) -> Vec<String> {
    let mut names: Vec<String> = request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// P-1: an approval continues the run it paused, with that run's limits — a briefing that
/// paused on a send goes on with the briefing's short list, not every tool the user has.
#[tokio::test]
async fn p1_a_briefing_resumed_by_its_approval_is_offered_only_the_briefings_tools() {
    let answers = vec![
        Answer::tool_calls(&[(
            "call_send",
            "gmail_send",
            r#"{"to": "boss@example.com", "subject": "Status", "body": "All good."}"#,
        )]),
        Answer::text("Sent your boss the status."),
    ];
    let (app, model, gmail) = gmail_world(answers, &[NO_WORKERS]).await;
    let mut alice = app.agent_as("alice").await;
    let fired = a_briefing_that_sends_fires(&app, &mut alice).await;
    assert_eq!(fired[0].outcome, ScheduleOutcome::AwaitingApproval);
    let run = get_run(&mut alice, fired[0].run_id.as_deref().unwrap())
        .await
        .unwrap();
    let send = run.actions.iter().find(|a| a.tool == "gmail_send");
    let approval_id = send
        .expect("the send waits for approval")
        .approval_id
        .clone();

    let decided = alice
        .decide_approval(pb::DecideApprovalRequest {
            approval_id,
            decision: pb::Decision::Approve as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        decided.result.unwrap().status,
        pb::RunState::Completed as i32
    );
    assert_eq!(gmail.sent().len(), 1, "the approved send went out once");

    let requests = model.requests();
    let (first, resumed) = (
        offered(&requests[0].1),
        offered(&requests.last().unwrap().1),
    );
    assert!(
        first.iter().any(|t| t == "gmail_send") && !first.iter().any(|t| t == "create_memories"),
        "the briefing's own list: {first:?}"
    );
    assert_eq!(
        resumed, first,
        "the resumed run is offered what the briefing was, not the user's whole list"
    );
}

#[tokio::test]
async fn run_schedule_now_starts_a_run_the_caller_can_watch() {
    let app = spawn_app_with(Backend::Memory, &[NO_WORKERS]).await;
    let mut alice = app.agent_as("alice").await;
    let schedule = create(
        &mut alice,
        pb::CreateScheduleRequest {
            new_thread_per_run: true,
            ..every_minute_in_berlin(pb::ScheduleKind::CheckIn)
        },
    )
    .await
    .unwrap();
    assert!(schedule.thread_id.is_empty(), "a new thread per occurrence");
    let started = alice
        .run_schedule_now(pb::RunScheduleNowRequest {
            schedule_id: schedule.id.clone(),
        })
        .await
        .expect("RunScheduleNow")
        .into_inner();
    let mut events = alice
        .watch_run(pb::WatchRunRequest {
            run_id: started.run_id.clone(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut last = None;
    while let Some(event) = events.next().await {
        last = event.unwrap().event;
    }
    match last.and_then(|e| e.kind) {
        Some(pb::run_event::Kind::Result(r)) => {
            assert_eq!(r.status, pb::RunState::Completed as i32, "{}", r.error);
            assert!(!r.summary.is_empty());
        }
        other => panic!("the stream ends with a result: {other:?}"),
    }
    let threads = alice
        .list_threads(pb::ListThreadsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .threads;
    assert!(threads.iter().any(|t| t.id == started.thread_id));
    // E-2: it ran on the scheduled channel, so under that channel's limits (15 / 600 s).
    let run = alice
        .get_run(pb::GetRunRequest {
            run_id: started.run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .expect("the run");
    assert_eq!(run.channel, pb::Channel::Scheduled as i32);
}

#[tokio::test]
async fn another_users_schedule_is_not_found_and_bad_input_names_the_field() {
    let app = spawn_app_with(
        Backend::Memory,
        &[NO_WORKERS, ("AGENT_MAX_SCHEDULES_PER_USER", "2")],
    )
    .await;
    let mut alice = app.agent_as("alice").await;
    let mut bob = app.agent_as("bob").await;
    let mine = create(
        &mut alice,
        every_minute_in_berlin(pb::ScheduleKind::Briefing),
    )
    .await
    .unwrap();

    let id = mine.id.clone();
    let update = bob
        .update_schedule(pb::UpdateScheduleRequest {
            schedule_id: id.clone(),
            enabled: Some(false),
            ..Default::default()
        })
        .await
        .unwrap_err();
    let delete = bob
        .delete_schedule(pb::DeleteScheduleRequest {
            schedule_id: id.clone(),
        })
        .await
        .unwrap_err();
    let now = bob
        .run_schedule_now(pb::RunScheduleNowRequest {
            schedule_id: id.clone(),
        })
        .await
        .unwrap_err();
    for status in [update, delete, now] {
        assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    }
    assert!(listed(&mut bob).await.is_empty());
    assert_eq!(listed(&mut alice).await.len(), 1, "alice's is untouched");

    let bad =
        |cron: &str, zone: &str, interval: i64, kind: pb::ScheduleKind| pb::CreateScheduleRequest {
            kind: kind as i32,
            cron: cron.into(),
            time_zone: zone.into(),
            interval: (interval > 0).then_some(prost_types::Duration {
                seconds: interval,
                nanos: 0,
            }),
            ..Default::default()
        };
    use pb::ScheduleKind::{Briefing, Unspecified};
    for (request, field) in [
        (bad("61 9 * * *", "Europe/Berlin", 0, Briefing), "cron"),
        (bad("0 9 * *", "Europe/Berlin", 0, Briefing), "cron"),
        (bad("0 9 * * *", "Mars/Olympus", 0, Briefing), "time_zone"),
        (bad("0 9 * * *", "", 0, Briefing), "time_zone"),
        (bad("", "", 30, Briefing), "interval"),
        (bad("", "", 10_000_000_000_000, Briefing), "interval"),
        (bad("", "", 0, Briefing), "cron or interval"),
        (bad("0 9 * * *", "UTC", 0, Unspecified), "kind"),
        // Text no store can keep is refused by name, not reported as an outage.
        (
            pb::CreateScheduleRequest {
                prompt: "brief me\0".into(),
                ..bad("0 9 * * *", "UTC", 0, Briefing)
            },
            "prompt contains a NUL",
        ),
        (
            pb::CreateScheduleRequest {
                thread_id: "t\0".into(),
                ..bad("0 9 * * *", "UTC", 0, Briefing)
            },
            "thread_id",
        ),
        (
            bad("0 9 * * *", &"Z".repeat(65), 0, Briefing),
            "time_zone is 65 bytes",
        ),
        (
            bad(&"0 ".repeat(200), "UTC", 0, Briefing),
            "cron is 400 bytes",
        ),
    ] {
        let status = create(&mut alice, request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(field),
            "{field}: {}",
            status.message()
        );
    }
    create(&mut alice, bad("0 9 * * 1-5", "Europe/Berlin", 0, Briefing))
        .await
        .expect("a second schedule is within the cap");
    let over = create(&mut alice, bad("0 9 * * *", "UTC", 0, Briefing))
        .await
        .unwrap_err();
    assert_eq!(over.code(), tonic::Code::ResourceExhausted);
    assert!(over.message().contains("AGENT_MAX_SCHEDULES_PER_USER"));

    // A switched-off schedule does not fire.
    let off = alice
        .update_schedule(pb::UpdateScheduleRequest {
            schedule_id: id.clone(),
            enabled: Some(false),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .schedule
        .unwrap();
    assert!(!off.enabled);
    let far = time(&off.next_due_at) + Duration::from_secs(3600);
    // (The weekday schedule made above may be due by then, depending on today's date.)
    assert!(
        fire_everywhere(&app.agent_replicas(), far)
            .await
            .iter()
            .all(|f| f.schedule_id != id)
    );
    let bad_update = alice
        .update_schedule(pb::UpdateScheduleRequest {
            schedule_id: id,
            cron: Some("0 25 * * *".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad_update.code(), tonic::Code::InvalidArgument);
    assert!(bad_update.message().contains("cron"));
}

/// Alice's every-minute heartbeat, whose model refuses its first two requests (a 400: two
/// tries under E-12).
async fn a_heartbeat_whose_model_refuses()
-> (TestApp, (FakeOpenAi, FakeGmail), UserAgent, pb::Schedule) {
    let refused = || Answer::ErrorBody {
        status: 400,
        body: r#"{"error": {"message": "this request is malformed"}}"#.into(),
    };
    a_heartbeat(vec![refused(), refused()], &[]).await
}

/// Alice's heartbeat every minute in Berlin, its model answering `answers`, on replicas
/// whose own schedule workers are off (the test fires them), with `env` besides.
async fn a_heartbeat(
    answers: Vec<Answer>,
    env: &[(&str, &str)],
) -> (TestApp, (FakeOpenAi, FakeGmail), UserAgent, pb::Schedule) {
    let mut all = vec![NO_WORKERS];
    all.extend_from_slice(env);
    let (app, model, gmail) = gmail_world(answers, &all).await;
    let mut alice = app.agent_as("alice").await;
    let schedule = create(
        &mut alice,
        every_minute_in_berlin(pb::ScheduleKind::Heartbeat),
    )
    .await
    .unwrap();
    // The fakes live as long as the test holds them.
    (app, (model, gmail), alice, schedule)
}

#[tokio::test]
async fn e12_a_failed_scheduled_run_is_retried_on_its_schedule_then_recorded_as_failed() {
    let (app, _fakes, mut alice, schedule) = a_heartbeat_whose_model_refuses().await;
    let replicas = app.agent_replicas();
    let now = time(&schedule.next_due_at) + Duration::from_secs(1);

    let fired = fire_everywhere(&replicas, now).await;
    assert_eq!(fired[0].outcome, ScheduleOutcome::Retrying, "{fired:?}");
    let shown = listed(&mut alice).await;
    assert_eq!(shown[0].last_outcome, pb::ScheduleOutcome::Retrying as i32);
    assert!(
        shown[0]
            .last_error
            .ends_with("It is tried again automatically."),
        "why it failed, and that nobody need try again: {}",
        shown[0].last_error
    );
    assert!(
        fire_everywhere(&replicas, now + Duration::from_secs(5))
            .await
            .is_empty(),
        "E-12: the retry backs off at least 10 s"
    );
    let fired = fire_everywhere(&replicas, now + Duration::from_secs(13)).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(
        fired[0].outcome,
        ScheduleOutcome::Failed,
        "E-12: two tries for an error that is neither a rate limit nor the network"
    );
    let runs = runs_on(&app, &schedule.thread_id).await;
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert!(
        runs[0].1.ends_with(":1") && runs[1].1.ends_with(":2"),
        "{runs:?}"
    );
    let shown = listed(&mut alice).await;
    assert_eq!(shown[0].last_outcome, pb::ScheduleOutcome::Failed as i32);
    assert_eq!(shown[0].last_run_id, runs[1].0);
}

/// E-12, O-1: an occurrence whose run was stopped by a restart of its replica (a rolling
/// deploy) is taken up again at once, by a replica still running, under a new attempt and
/// request id, and spends no try: the two refusals that follow still get E-12's two tries,
/// as they would have with no restart.
#[tokio::test]
async fn e12_an_occurrence_stopped_by_a_restart_is_taken_up_again_at_once_without_a_try() {
    let refused = || Answer::ErrorBody {
        status: 400,
        body: r#"{"error": {"message": "this request is malformed"}}"#.into(),
    };
    let never = Arc::new(tokio::sync::Notify::new());
    let (mut app, (model, _gmail), _alice, schedule) = a_heartbeat(
        vec![
            Answer::Held(Box::new(Answer::text("too late")), never),
            refused(),
            refused(),
        ],
        &[("SHUTDOWN_DRAIN_TIMEOUT", "0s")],
    )
    .await;
    let stopping = app.agent_replicas()[0].clone();
    // Ahead of the wall clock for the whole test, so every settle counts from this clock.
    let now = time(&schedule.next_due_at).max(SystemTime::now()) + Duration::from_secs(3600);
    let fired = stopping
        .fire_due_schedules("replica-0", now)
        .await
        .expect("fire due schedules");
    model.server.requested(1).await;
    let second = app.start_another_agent().await;
    // Newest first.
    let running = app.agent_replicas()[0].clone();
    let mut alice = steward_tests::agent_as(second, "alice").await;
    app.stop_service(app.agent_addr)
        .await
        .expect("agent-svc stops cleanly");
    let settled = futures_util::future::join_all(fired).await;
    assert_eq!(
        settled[0].as_ref().unwrap().outcome,
        ScheduleOutcome::Retrying
    );
    let shown = listed(&mut alice).await[0].last_error.clone();
    assert!(
        shown.contains("the service running it was restarted"),
        "the owner sees why: {shown}"
    );
    assert!(
        shown.contains("it is being run again") && !shown.contains("Please try again"),
        "and that nothing is theirs to do: {shown}"
    );

    let fired = fire_everywhere(std::slice::from_ref(&running), now).await;
    assert_eq!(fired.len(), 1, "taken up again at once, with no backoff");
    assert_eq!(
        fired[0].outcome,
        ScheduleOutcome::Retrying,
        "the restart was not a try: the first refusal leaves one"
    );
    let fired = fire_everywhere(&[running], now + Duration::from_secs(13)).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Failed);
    let runs = runs_on(&app, &schedule.thread_id).await;
    let attempts: Vec<&str> = runs
        .iter()
        .map(|(_, request)| request.rsplit(':').next().unwrap())
        .collect();
    assert_eq!(attempts, ["1", "2", "3"], "{runs:?}");
    let interrupted: String = app
        .sql()
        .await
        .query_one(
            "SELECT failure_kind FROM agent.runs WHERE id = $1",
            &[&runs[0].0],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(interrupted, "interrupted");
}

/// E-12, O-1: the same restart as a stopping replica usually leaves it: the replica handed the
/// occurrence back (its hold released) before its follower could record the run's end. The
/// replica that takes it up finds the stopped run by its request id, settles that attempt as a
/// restart, and the next attempt runs at once with a run of its own.
#[tokio::test]
async fn e12_an_occurrence_handed_back_at_shutdown_is_settled_as_a_restart_by_its_taker() {
    let never = Arc::new(tokio::sync::Notify::new());
    let (mut app, (model, _gmail), _alice, schedule) = a_heartbeat(
        vec![
            Answer::Held(Box::new(Answer::text("too late")), never),
            Answer::text("All quiet."),
        ],
        &[("SHUTDOWN_DRAIN_TIMEOUT", "0s")],
    )
    .await;
    let stopping = app.agent_replicas()[0].clone();
    let now = time(&schedule.next_due_at).max(SystemTime::now()) + Duration::from_secs(3600);
    let _follower = stopping
        .fire_due_schedules("replica-0", now)
        .await
        .expect("fire due schedules");
    model.server.requested(1).await;
    app.start_another_agent().await;
    let taker = app.agent_replicas()[0].clone();
    // What the stopping replica's hand-back does, here before its follower can settle.
    let handed_back = app
        .agent_store()
        .await
        .release_schedule_holds("replica-0")
        .await
        .unwrap();
    assert_eq!(handed_back, 1);
    app.stop_service(app.agent_addr)
        .await
        .expect("agent-svc stops cleanly");

    // Attempt 1 is settled as a restart and attempt 2 is due at once: the same sweep takes it
    // when attempt 1 settles before the sweep's next claim (a busy machine), else the next.
    let mut fired = fire_everywhere(std::slice::from_ref(&taker), now).await;
    assert_eq!(
        fired.first().map(|f| f.outcome),
        Some(ScheduleOutcome::Retrying),
        "attempt 1 found stopped: {fired:?}"
    );
    if fired.len() == 1 {
        fired.extend(fire_everywhere(&[taker], now).await);
    }
    assert_eq!(fired.len(), 2, "the next attempt is due at once: {fired:?}");
    assert_eq!(fired[1].outcome, ScheduleOutcome::Completed, "{fired:?}");
    let runs = runs_on(&app, &schedule.thread_id).await;
    let attempts: Vec<&str> = runs
        .iter()
        .map(|(_, request)| request.rsplit(':').next().unwrap())
        .collect();
    assert_eq!(attempts, ["1", "2"], "one run each: {runs:?}");
}

/// E-12: a schedule switched off while its occurrence was in progress (the switch leaves an
/// occurrence that is held alone) is not retried once that attempt fails.
#[tokio::test]
async fn e12_a_schedule_switched_off_while_its_run_was_going_is_not_retried() {
    let (app, _fakes, mut alice, schedule) = a_heartbeat_whose_model_refuses().await;
    let replicas = app.agent_replicas();
    let now = time(&schedule.next_due_at) + Duration::from_secs(1);
    let fired = fire_everywhere(&replicas, now).await;
    assert_eq!(fired[0].outcome, ScheduleOutcome::Retrying, "{fired:?}");
    // What an UpdateSchedule that landed while the run was going leaves: switched off, with
    // the occurrence (then held) still there, now waiting for its retry.
    app.sql()
        .await
        .execute(
            "UPDATE agent.schedules SET enabled = false WHERE id = $1",
            &[&schedule.id],
        )
        .await
        .unwrap();

    let fired = fire_everywhere(&replicas, now + Duration::from_secs(13)).await;
    assert_eq!(fired.len(), 1, "{fired:?}");
    assert_eq!(fired[0].outcome, ScheduleOutcome::Failed);
    assert_eq!(
        runs_on(&app, &schedule.thread_id).await.len(),
        1,
        "no second run"
    );
    let shown = listed(&mut alice).await;
    assert!(
        shown[0].last_error.contains("switched off"),
        "{}",
        shown[0].last_error
    );
    assert!(
        fire_everywhere(&replicas, now + Duration::from_secs(600))
            .await
            .is_empty(),
        "nothing is left to fire"
    );
}

/// E-12: an occurrence whose start meets the database away for a moment (here a lock held past
/// DATABASE_LOCK_TIMEOUT) is postponed under the same attempt and runs once the database is
/// back. One whose run the database refuses for good is a failed attempt, retried on E-12's
/// schedule and then failed, not postponed for hours as if the database were away.
#[tokio::test]
async fn e12_an_occurrence_the_database_cannot_start_for_now_waits_and_one_it_refuses_for_good_fails()
 {
    let (app, _fakes, mut alice, schedule) = a_heartbeat(
        vec![Answer::text("Nothing urgent.")],
        &[("DATABASE_LOCK_TIMEOUT", "200ms")],
    )
    .await;
    let replicas = app.agent_replicas();
    let due = time(&schedule.next_due_at);

    // Another session holds the runs table: the start's first read waits past the lock timeout.
    let mut holder = app.sql().await;
    let held = holder.transaction().await.unwrap();
    held.batch_execute("LOCK TABLE agent.runs IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let fired = fire_everywhere(&replicas, due + Duration::from_secs(1)).await;
    held.rollback().await.unwrap();
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Postponed, "{fired:?}");
    let shown = listed(&mut alice).await;
    assert!(
        shown[0].last_error.contains("DATABASE_LOCK_TIMEOUT"),
        "the database's own reason: {}",
        shown[0].last_error
    );
    let fired = fire_everywhere(&replicas, due + Duration::from_secs(32)).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Completed, "{fired:?}");
    let runs = runs_on(&app, &schedule.thread_id).await;
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert!(runs[0].1.ends_with(":1"), "the same attempt: {runs:?}");

    // The next occurrence's run is refused by the database for good (a constraint an operator
    // added, here): waiting does not help, so the attempt counts.
    app.sql()
        .await
        .batch_execute(
            "ALTER TABLE agent.runs ADD CONSTRAINT no_more_scheduled_runs \
               CHECK (request_id NOT LIKE 'schedule:%') NOT VALID",
        )
        .await
        .unwrap();
    let next = due + Duration::from_secs(61);
    let fired = fire_everywhere(&replicas, next).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Retrying, "{fired:?}");
    let shown = listed(&mut alice).await;
    assert!(
        shown[0].last_error.contains("refused this for good")
            && shown[0].last_error.contains("no_more_scheduled_runs"),
        "{}",
        shown[0].last_error
    );
    let fired = fire_everywhere(&replicas, next + Duration::from_secs(13)).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Failed, "{fired:?}");
    assert_eq!(runs_on(&app, &schedule.thread_id).await.len(), 1);
}

#[tokio::test]
async fn a_scheduled_run_waits_for_the_users_pending_approval_instead_of_voiding_it() {
    let answers = vec![
        Answer::tool_calls(&[(
            "call_send",
            "gmail_send",
            r#"{"to": "boss@example.com", "subject": "Status", "body": "All good."}"#,
        )]),
        Answer::text("Sent."),
        Answer::text("All quiet."),
    ];
    let (app, _model, gmail) = gmail_world(answers, &[NO_WORKERS]).await;
    let replicas = app.agent_replicas();
    let mut alice = app.agent_as("alice").await;
    let paused = steward_tests::agent_calls::run_once(&mut alice, "tell my boss all is good", "")
        .await
        .unwrap();
    let approval = paused.approval.expect("the send waits for approval");
    let schedule = create(
        &mut alice,
        pb::CreateScheduleRequest {
            thread_id: paused.thread_id.clone(),
            ..every_minute_in_berlin(pb::ScheduleKind::Heartbeat)
        },
    )
    .await
    .unwrap();
    let now = time(&schedule.next_due_at) + Duration::from_secs(1);

    let fired = fire_everywhere(&replicas, now).await;
    assert_eq!(fired[0].outcome, ScheduleOutcome::Postponed);
    assert!(
        listed(&mut alice).await[0]
            .last_error
            .contains("waiting for your approval")
    );
    let decided = alice
        .decide_approval(pb::DecideApprovalRequest {
            approval_id: approval.id.clone(),
            decision: pb::Decision::Approve as i32,
            ..Default::default()
        })
        .await
        .expect("the approval is still there to decide")
        .into_inner();
    assert_eq!(
        decided.result.unwrap().status,
        pb::RunState::Completed as i32
    );
    assert_eq!(gmail.sent().len(), 1);

    let fired = fire_everywhere(&replicas, now + Duration::from_secs(31)).await;
    assert_eq!(fired[0].outcome, ScheduleOutcome::Completed, "{fired:?}");
}

#[tokio::test]
async fn an_occurrence_whose_worker_died_is_taken_over_once_its_hold_expires() {
    let app = spawn_app_with(Backend::Postgres, &[NO_WORKERS]).await;
    let replicas = app.agent_replicas();
    let mut alice = app.agent_as("alice").await;
    let schedule = create(
        &mut alice,
        every_minute_in_berlin(pb::ScheduleKind::Heartbeat),
    )
    .await
    .unwrap();
    let now = time(&schedule.next_due_at) + Duration::from_secs(1);
    // A replica claims the occurrence and dies before it starts the run.
    let store = app.agent_store().await;
    let claimed = store
        .claim_schedule("replica-that-died", now, Duration::from_secs(60))
        .await
        .unwrap()
        .expect("due");
    assert!(
        fire_everywhere(&replicas, now + Duration::from_secs(30))
            .await
            .is_empty(),
        "held by the dead replica"
    );
    let fired = fire_everywhere(&replicas, now + Duration::from_secs(61)).await;
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].outcome, ScheduleOutcome::Completed);
    assert_eq!(runs_on(&app, &schedule.thread_id).await.len(), 1);
    let late = agent_svc::store::Settle::Done {
        outcome: ScheduleOutcome::Failed,
        run_id: None,
        error: None,
    };
    assert!(
        !store
            .settle_schedule(&claimed, "replica-that-died", &late)
            .await
            .unwrap(),
        "the dead replica's claim no longer counts"
    );
}
