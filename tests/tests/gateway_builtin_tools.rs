//! Built-in tools and the bootstrap context (issue 5; I-6, I-7, I-8, S0 AC-12/AC-13,
//! S3 AC-001..AC-005), end to end over gRPC.

use std::time::{Duration, Instant};

use steward_proto::gateway::v1 as pb;
use steward_tests::{
    Backend, Options, UserGateway,
    calls::{call_tool as run, connect_account},
    fakes::gmail::FakeGmail,
    spawn::spawn,
};

fn task_id(text: &str) -> i64 {
    let start = text.find('#').expect("an id") + 1;
    text[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn tasks_crud_by_the_s3_tool_names_never_crosses_users() {
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        ..Options::default()
    })
    .await;
    let mut alice = app.gateway_as("alice").await;
    let mut bob = app.gateway_as("bob").await;

    let added = run(
        &mut alice,
        "add_task",
        serde_json::json!({"title": "Call dentist", "due": "2020-01-01"}),
    )
    .await;
    assert!(added.ok, "{}", added.text);
    assert!(
        added.text.starts_with("Added task #")
            && added.text.contains("\"Call dentist\" — due Jan 1 (overdue"),
        "{}",
        added.text
    );
    let dentist = task_id(&added.text);
    run(
        &mut alice,
        "add_task",
        serde_json::json!({"title": "Buy milk"}),
    )
    .await;
    let bobs = run(
        &mut bob,
        "add_task",
        serde_json::json!({"title": "Bob's secret plan"}),
    )
    .await;
    let bobs_id = task_id(&bobs.text);

    let list = run(
        &mut alice,
        "list_tasks",
        serde_json::json!({"status": "all"}),
    )
    .await;
    assert!(list.text.starts_with("Tasks (2):"), "{}", list.text);
    assert!(
        !list.text.contains("secret plan"),
        "alice never sees bob's tasks"
    );

    // Bob cannot touch Alice's task, and is told plainly it does not exist.
    for tool in ["complete_task", "delete_task"] {
        let r = run(&mut bob, tool, serde_json::json!({"task_id": dentist})).await;
        assert!(!r.ok);
        assert_eq!(r.error_kind, pb::ErrorKind::NotFound as i32, "{}", r.text);
        assert_eq!(r.text, format!("I couldn't find task #{dentist}."));
    }
    let r = run(
        &mut alice,
        "update_task",
        serde_json::json!({"task_id": bobs_id, "title": "mine now"}),
    )
    .await;
    assert_eq!(r.text, format!("I couldn't find task #{bobs_id}."));

    let done = run(
        &mut alice,
        "complete_task",
        serde_json::json!({"task_id": dentist}),
    )
    .await;
    assert_eq!(
        done.text,
        format!("Completed task #{dentist}: \"Call dentist\".")
    );
    let pending = run(&mut alice, "list_tasks", serde_json::json!({})).await;
    assert!(
        pending.text.starts_with("Pending tasks (1):") && pending.text.contains("Buy milk"),
        "{}",
        pending.text
    );
    let completed = run(
        &mut alice,
        "list_tasks",
        serde_json::json!({"status": "completed"}),
    )
    .await;
    assert!(
        completed.text.contains("Call dentist\" — done"),
        "{}",
        completed.text
    );

    let updated = run(
        &mut alice,
        "update_task",
        serde_json::json!({"task_id": dentist, "status": "pending", "due": "2030-05-01T09:00:00Z"}),
    )
    .await;
    assert!(
        updated.text.contains("due May 1") && !updated.text.contains("overdue"),
        "{}",
        updated.text
    );
    let deleted = run(
        &mut alice,
        "delete_task",
        serde_json::json!({"task_id": dentist}),
    )
    .await;
    assert_eq!(
        deleted.text,
        format!("Deleted task #{dentist}: \"Call dentist\".")
    );
    let again = run(
        &mut alice,
        "delete_task",
        serde_json::json!({"task_id": dentist}),
    )
    .await;
    assert_eq!(again.text, format!("I couldn't find task #{dentist}."));

    // The user id is never a model argument: the schema refuses one.
    let smuggled = run(
        &mut bob,
        "list_tasks",
        serde_json::json!({"user_id": "alice"}),
    )
    .await;
    assert_eq!(smuggled.error_kind, pb::ErrorKind::InvalidArguments as i32);
    let bad_due = run(
        &mut bob,
        "add_task",
        serde_json::json!({"title": "x", "due": "next tuesday"}),
    )
    .await;
    assert!(bad_due.text.contains("RFC 3339"), "{}", bad_due.text);
}

/// G-4: words that are only whitespace are refused with a sentence naming the field, never
/// saved empty or answered "Updated" with nothing changed.
#[tokio::test]
async fn blank_words_for_a_task_or_a_memory_are_refused_by_name() {
    let app = spawn(Options::default()).await;
    let mut g = app.gateway_as("u1").await;
    let added = run(
        &mut g,
        "add_task",
        serde_json::json!({"title": "Call dentist"}),
    )
    .await;
    let id = task_id(&added.text);
    for (tool, args, field) in [
        (
            "update_task",
            serde_json::json!({"task_id": id, "title": "   "}),
            "title is blank",
        ),
        (
            "save_memory",
            serde_json::json!({"content": " \n\t "}),
            "content is blank",
        ),
        (
            "create_memories",
            serde_json::json!({"memories": [{"content": "Likes tea"}, {"content": "  "}]}),
            "content is blank",
        ),
    ] {
        let refused = run(&mut g, tool, args).await;
        assert_eq!(
            refused.error_kind,
            pb::ErrorKind::InvalidArguments as i32,
            "{tool}: {}",
            refused.text
        );
        assert!(refused.text.contains(field), "{tool}: {}", refused.text);
    }
    let found = run(&mut g, "search_memory", serde_json::json!({"query": "tea"})).await;
    assert!(
        !found.text.contains("Likes tea"),
        "a refused batch saves none of its notes: {}",
        found.text
    );
    let listed = run(&mut g, "list_tasks", serde_json::json!({})).await;
    assert!(listed.text.contains("Call dentist"), "{}", listed.text);
}

/// Q-2, I-6: what the database refuses for good (here a constraint an operator added) reaches
/// the model as a request that fails the same way when sent again, not as storage that is
/// away for a moment ("try again later"); the user's other writes go on.
#[tokio::test]
async fn a_task_the_database_refuses_for_good_is_not_called_a_passing_failure() {
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        ..Options::default()
    })
    .await;
    app.sql()
        .await
        .batch_execute(
            "ALTER TABLE gateway.tasks ADD CONSTRAINT no_secret_plans CHECK (title NOT LIKE '%secret%')",
        )
        .await
        .unwrap();
    let mut g = app.gateway_as("alice").await;
    let refused = run(
        &mut g,
        "add_task",
        serde_json::json!({"title": "A secret plan"}),
    )
    .await;
    assert!(!refused.ok);
    assert_eq!(refused.error_kind, pb::ErrorKind::Internal as i32);
    assert!(
        refused.text.contains("no_secret_plans")
            && refused.text.contains("will fail the same way")
            && !refused.text.contains("Try again later"),
        "{}",
        refused.text
    );
    let added = run(&mut g, "add_task", serde_json::json!({"title": "Buy milk"})).await;
    assert!(added.ok, "{}", added.text);
}

#[tokio::test]
async fn search_memory_ranks_the_relevant_note_first() {
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    let saved = run(
        &mut g,
        "create_memories",
        serde_json::json!({"memories": [
            {"content": "Prefers meetings after 10am"},
            {"content": "Daughter Ana plays soccer on Tuesdays", "tags": ["family"]},
            {"content": "Works at Acme on the billing team"}]}),
    )
    .await;
    assert!(
        saved.text.starts_with("Saved 3 memories: #"),
        "{}",
        saved.text
    );
    let one = run(
        &mut g,
        "save_memory",
        serde_json::json!({"content": "Allergic to peanuts"}),
    )
    .await;
    assert!(one.text.starts_with("Saved memory #"), "{}", one.text);
    let found = run(
        &mut g,
        "search_memory",
        serde_json::json!({"query": "soccer practice"}),
    )
    .await;
    assert!(
        found
            .text
            .starts_with("Memories matching \"soccer practice\""),
        "{}",
        found.text
    );
    assert!(
        found
            .text
            .lines()
            .nth(1)
            .unwrap()
            .contains("Daughter Ana plays soccer"),
        "{}",
        found.text
    );
    let none = run(
        &mut g,
        "search_memory",
        serde_json::json!({"query": "zebra"}),
    )
    .await;
    assert_eq!(none.text, "No memories match \"zebra\".");
}

#[tokio::test]
async fn reminders_are_set_for_the_future_and_listed_soonest_first() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    let later = run(
        &mut g,
        "create_reminder",
        serde_json::json!({"text": "Renew passport", "due_at": "2031-02-01T10:00:00Z"}),
    )
    .await;
    assert!(
        later
            .text
            .contains("set for Feb 1 10:00 UTC: \"Renew passport\""),
        "{}",
        later.text
    );
    run(
        &mut g,
        "create_reminder",
        serde_json::json!({"text": "Standup", "due_at": "2030-01-01T09:30:00Z"}),
    )
    .await;
    let past = run(
        &mut g,
        "create_reminder",
        serde_json::json!({"text": "Too late", "due_at": "2001-01-01T00:00:00Z"}),
    )
    .await;
    assert!(past.text.contains("is in the past"), "{}", past.text);
    let list = run(&mut g, "get_reminders", serde_json::json!({})).await;
    let lines: Vec<_> = list.text.lines().collect();
    assert_eq!(lines[0], "Upcoming reminders (2):");
    assert!(
        lines[1].contains("Standup") && lines[2].contains("Renew passport"),
        "{}",
        list.text
    );
}

/// A call carries the user's zone: times come back in it, named, and a date without a time
/// ("due 2030-12-01") means the end of that day there, not in UTC. A zone that is not one is
/// refused, naming the field.
#[tokio::test]
async fn times_are_shown_and_dates_read_in_the_callers_time_zone() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    let new_york = "America/New_York";
    let set = steward_tests::calls::call_tool_in_zone(
        &mut g,
        new_york,
        "create_reminder",
        serde_json::json!({"text": "Call mom", "due_at": "2030-12-01T14:00:00Z"}),
    )
    .await;
    assert!(set.text.contains("set for Dec 1 09:00 EST"), "{}", set.text);
    let listed = steward_tests::calls::call_tool_in_zone(
        &mut g,
        "Europe/Berlin",
        "get_reminders",
        serde_json::json!({}),
    )
    .await;
    assert!(listed.text.contains("Dec 1 15:00 CET"), "{}", listed.text);

    // The end of Dec 1 in New York is early on Dec 2 in UTC.
    steward_tests::calls::call_tool_in_zone(
        &mut g,
        new_york,
        "add_task",
        serde_json::json!({"title": "File report", "due": "2030-12-01"}),
    )
    .await;
    let there = steward_tests::calls::call_tool_in_zone(
        &mut g,
        new_york,
        "list_tasks",
        serde_json::json!({}),
    )
    .await;
    assert!(there.text.contains("due Dec 1"), "{}", there.text);
    let in_utc = run(&mut g, "list_tasks", serde_json::json!({})).await;
    assert!(in_utc.text.contains("due Dec 2"), "{}", in_utc.text);

    let refused = steward_tests::calls::call_tool_in_zone(
        &mut g,
        "Mars/Olympus",
        "get_reminders",
        serde_json::json!({}),
    )
    .await;
    assert!(!refused.ok);
    assert!(
        refused
            .text
            .contains("time_zone \"Mars/Olympus\" is not an IANA time zone"),
        "{}",
        refused.text
    );
}

/// A local time the user's clocks skip or repeat is set all the same, and the result says how
/// it was read — so the model does not confirm a time the reminder is not at, nor guess which
/// of two was meant.
#[tokio::test]
async fn a_time_a_clock_change_skips_or_repeats_is_set_and_the_result_says_how_it_was_read() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    let new_york = "America/New_York";
    let skipped = steward_tests::calls::call_tool_in_zone(
        &mut g,
        new_york,
        "create_reminder",
        serde_json::json!({"text": "Water plants", "due_at": "2030-03-10T02:30"}),
    )
    .await;
    assert!(skipped.ok, "{}", skipped.text);
    assert!(
        skipped.text.contains("set for Mar 10 03:30 EDT")
            && skipped
                .text
                .contains("(02:30 on Mar 10 does not exist in America/New_York"),
        "{}",
        skipped.text
    );

    let repeated = steward_tests::calls::call_tool_in_zone(
        &mut g,
        new_york,
        "add_task",
        serde_json::json!({"title": "Night shift handover", "due": "2030-11-03T01:30"}),
    )
    .await;
    assert!(repeated.ok, "{}", repeated.text);
    assert!(
        repeated
            .text
            .contains("for the second, Nov 3 01:30 EST, write 2030-11-03T01:30:00-05:00"),
        "{}",
        repeated.text
    );

    let plain = steward_tests::calls::call_tool_in_zone(
        &mut g,
        new_york,
        "create_reminder",
        serde_json::json!({"text": "Stretch", "due_at": "2030-03-10T09:00"}),
    )
    .await;
    assert!(!plain.text.contains("("), "nothing to say: {}", plain.text);
}

async fn bootstrap(g: &mut UserGateway) -> pb::GetBootstrapContextResponse {
    g.get_bootstrap_context(pb::GetBootstrapContextRequest {
        channel: pb::Channel::SessionOpen as i32,
        time_zone: "UTC".into(),
    })
    .await
    .unwrap()
    .into_inner()
}

async fn connect_gmail(g: &mut UserGateway, account: &str, token: &str) {
    connect_account(g, pb::Integration::Gmail, account, token).await;
}

#[tokio::test]
async fn a_hanging_gmail_leaves_bootstrap_inside_two_seconds_with_email_unavailable_and_the_rest_correct()
 {
    let gmail = FakeGmail::start().await;
    gmail.hang("token-work");
    gmail.set_unread("token-home", 3);
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        env: vec![
            ("GMAIL_API_BASE_URL".into(), gmail.url.clone()),
            ("BOOTSTRAP_CACHE_TTL".into(), "0".into()),
        ],
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    run(
        &mut g,
        "add_task",
        serde_json::json!({"title": "Call dentist", "due": "2020-01-01"}),
    )
    .await;
    run(
        &mut g,
        "add_task",
        serde_json::json!({"title": "Plan offsite", "due": "2040-01-01"}),
    )
    .await;
    run(
        &mut g,
        "add_task",
        serde_json::json!({"title": "Read book"}),
    )
    .await;
    run(
        &mut g,
        "create_reminder",
        serde_json::json!({"text": "Standup", "due_at": "2039-03-04T09:30:00Z"}),
    )
    .await;
    connect_gmail(&mut g, "work@example.com", "token-work").await;

    let started = Instant::now();
    let ctx = bootstrap(&mut g).await;
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    let email = ctx.email.unwrap();
    assert_eq!(email.status, pb::SourceStatus::Unavailable as i32);
    assert_eq!(email.line, r#"Unread: "work@example.com" (unavailable)"#);
    let tasks = ctx.tasks.unwrap();
    assert_eq!(tasks.status, pb::SourceStatus::Ok as i32);
    assert_eq!((tasks.pending, tasks.overdue), (3, 1));
    assert!(
        tasks
            .line
            .starts_with("3 active tasks (1 overdue). Top: 'Call dentist' (overdue "),
        "{}",
        tasks.line
    );
    let reminders = ctx.reminders.unwrap();
    assert_eq!(
        reminders.line,
        "1 upcoming reminder. Next: 'Standup' at Mar 4 09:30"
    );
    assert!(!ctx.new_user);

    // One hanging account does not hide a healthy one.
    connect_gmail(&mut g, "home@example.com", "token-home").await;
    let started = Instant::now();
    let email = bootstrap(&mut g).await.email.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(email.status, pb::SourceStatus::Ok as i32);
    assert_eq!(
        email.line,
        r#"Unread: "home@example.com" 3, "work@example.com" (unavailable)"#
    );
}

#[tokio::test]
async fn bootstrap_reports_unread_counts_without_content_and_spots_a_new_user() {
    let gmail = FakeGmail::start().await;
    gmail.set_unread("token-work", 12);
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env: vec![
            ("GMAIL_API_BASE_URL".into(), gmail.url.clone()),
            ("BOOTSTRAP_CACHE_TTL".into(), "0".into()),
        ],
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("newbie").await;
    let ctx = bootstrap(&mut g).await;
    assert!(ctx.new_user);
    assert_eq!(
        ctx.rendered,
        "Tasks: No active tasks.\nReminders: No upcoming reminders.\nEmail: No email account connected."
    );
    assert_eq!(ctx.email.unwrap().status, pb::SourceStatus::Empty as i32);

    connect_gmail(&mut g, "work@example.com", "token-work").await;
    run(
        &mut g,
        "save_memory",
        serde_json::json!({"content": "Likes tea"}),
    )
    .await;
    let ctx = bootstrap(&mut g).await;
    assert!(!ctx.new_user, "a memory makes a returning user");
    let email = ctx.email.unwrap();
    assert_eq!(email.line, r#"Unread: "work@example.com" 12"#);
    assert_eq!(email.accounts[0].unread, 12);
    assert_eq!(gmail.requests(), 1, "one labels.get per account");
}

#[tokio::test]
async fn an_unknown_time_zone_is_refused_by_name() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    let err = g
        .get_bootstrap_context(pb::GetBootstrapContextRequest {
            channel: 0,
            time_zone: "Mars/Olympus".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("time_zone \"Mars/Olympus\""),
        "{}",
        err.message()
    );
}
