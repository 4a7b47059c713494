//! What the gateway tells before a side effect and holds it to (issue 14; P-4, P-5, G-4):
//! PreviewCall for every side-effect tool shows recipients / attendees / time / subject as
//! execution would resolve them, an execution bound to a preview is refused when that changed,
//! memories keep their provenance, and no side effect runs without its audit record.

use serde_json::{Value, json};
use steward_proto::gateway::v1::{self as pb, tool_call::Arguments};
use steward_tests::{
    Backend, Options, TestApp, UserGateway,
    calls::{call_tool, call_tool_keyed, connect_account},
    fakes::{
        calendar::{self, FakeCalendar},
        gmail::{FakeGmail, FakeMessage},
    },
    spawn,
};

struct World {
    app: TestApp,
    g: UserGateway,
    gmail: FakeGmail,
    calendar: FakeCalendar,
}

async fn world(backend: Backend) -> World {
    let gmail = FakeGmail::start().await;
    let calendar = FakeCalendar::start().await;
    let app = spawn(Options {
        backend: Some(backend),
        env: vec![
            ("GMAIL_API_BASE_URL".into(), gmail.url.clone()),
            ("GOOGLE_CALENDAR_API_BASE_URL".into(), calendar.url.clone()),
        ],
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("alice").await;
    connect_account(
        &mut g,
        pb::Integration::Gmail,
        "alice@example.com",
        "tok-alice",
    )
    .await;
    connect_account(
        &mut g,
        pb::Integration::GoogleCalendar,
        "alice@example.com",
        calendar::TOKEN,
    )
    .await;
    gmail.add_messages("tok-alice", vec![original(None)]);
    calendar.state.events.lock().unwrap().push(json!({
        "id": "ev1", "status": "confirmed", "summary": "Quarterly review",
        "start": {"dateTime": "2026-11-30T09:00:00Z"}, "end": {"dateTime": "2026-11-30T10:00:00Z"},
        "attendees": [{"email": "boss@example.com"}, {"email": "alice@example.com"}]}));
    World {
        app,
        g,
        gmail,
        calendar,
    }
}

fn original(reply_to: Option<&str>) -> FakeMessage {
    FakeMessage {
        id: "m1".into(),
        thread_id: "t1".into(),
        from: "Bob <bob@example.com>".into(),
        to: "alice@example.com, carol@example.com".into(),
        subject: "Budget".into(),
        message_id: "<m1@example.com>".into(),
        internal_date_ms: 1_771_900_000_000,
        snippet: "Numbers?".into(),
        parts: vec![(
            "text/plain".into(),
            "utf-8".into(),
            b"Numbers?".to_vec(),
            None,
        )],
        reply_to: reply_to.map(str::to_owned),
    }
}

fn tool_call(tool: &str, args: Value) -> pb::ToolCall {
    pb::ToolCall {
        call_id: "c".into(),
        tool: tool.into(),
        arguments: Some(Arguments::ArgsJson(args.to_string())),
        ..Default::default()
    }
}

async fn preview(g: &mut UserGateway, tool: &str, args: Value) -> pb::PreviewCallResponse {
    g.preview_call(pb::PreviewCallRequest {
        call: Some(tool_call(tool, args)),
    })
    .await
    .expect("previews answer with ok = false, not RPC errors")
    .into_inner()
}

#[tokio::test]
async fn p4_every_side_effect_preview_shows_who_what_and_when() {
    let mut w = world(Backend::Memory).await;
    let send = preview(
        &mut w.g,
        "gmail_send",
        json!({"to": ["boss@example.com"], "cc": "carol@example.com", "bcc": ["dan@example.com"],
               "subject": "Budget", "body": "L1\nL2\nL3\nL4\nL5\nL6\nL7"}),
    )
    .await;
    assert!(send.ok, "{}", send.text);
    assert_eq!(
        send.text,
        "Send\nFrom: alice@example.com\nTo: boss@example.com\nCc: carol@example.com\nBcc: dan@example.com\nSubject: Budget\n\nL1\nL2\nL3\nL4\nL5\n…"
    );
    assert_eq!(
        send.recipients,
        ["boss@example.com", "carol@example.com", "dan@example.com"]
    );

    let draft = preview(
        &mut w.g,
        "gmail_draft_create",
        json!({"to": "boss@example.com", "subject": "Plan", "body": "Draft text"}),
    )
    .await;
    assert!(draft.text.starts_with("Save as a draft (not sent)\nFrom: alice@example.com\nTo: boss@example.com\nSubject: Plan"), "{}", draft.text);

    w.gmail.add_messages(
        "tok-alice",
        vec![original(Some("Finance <finance@example.com>"))],
    );
    let reply = preview(
        &mut w.g,
        "gmail_reply",
        json!({"message_id": "m1", "body": "Here.", "reply_all": true}),
    )
    .await;
    assert!(reply.ok, "{}", reply.text);
    assert_eq!(
        reply.recipients,
        ["finance@example.com", "carol@example.com"],
        "Reply-To first, then the others; never the sender's own address"
    );
    assert!(
        reply
            .text
            .contains("To: finance@example.com, carol@example.com\nSubject: Re: Budget\n\nHere."),
        "{}",
        reply.text
    );
    assert_eq!(reply.binding.len(), 64);

    let create = preview(
        &mut w.g,
        "calendar_event_create",
        json!({"summary": "Sync", "start": "2026-12-01T09:00:00+01:00", "end": "2026-12-01T10:00:00+01:00",
               "time_zone": "Europe/Berlin", "attendees": ["boss@example.com"], "location": "Room 4"}),
    )
    .await;
    assert_eq!(
        create.text,
        "Create event \"Sync\"\nWhen: 2026-12-01T09:00:00+01:00 to 2026-12-01T10:00:00+01:00 (Europe/Berlin)\nAttendees (invited): boss@example.com\nLocation: Room 4\n"
    );
    assert_eq!(create.recipients, ["boss@example.com"]);

    let update = preview(
        &mut w.g,
        "calendar_event_update",
        json!({"event_id": "ev1", "start": "2026-11-30T11:00:00Z", "end": "2026-11-30T12:00:00Z",
               "attendees": ["boss@example.com", "alice@example.com", "eve@example.com"]}),
    )
    .await;
    assert!(update.ok, "{}", update.text);
    for part in [
        "Update event [ev1] \"Quarterly review\"",
        "Now: Nov 30 09:00 UTC to Nov 30 10:00 UTC",
        "Attendees now: boss@example.com, alice@example.com",
        "- Time → 2026-11-30T11:00:00Z to 2026-11-30T12:00:00Z",
        "- Invites: eve@example.com",
    ] {
        assert!(
            update.text.contains(part),
            "{part:?} missing in\n{}",
            update.text
        );
    }
    assert!(update.recipients.contains(&"eve@example.com".to_owned()));
    assert_eq!(w.gmail.sent().len(), 0, "previews never send");
}

#[tokio::test]
async fn p4_a_preview_that_cannot_be_made_is_not_ok_and_says_why() {
    let mut w = world(Backend::Memory).await;
    let bad = preview(&mut w.g, "gmail_send", json!({"subject": "no recipient"})).await;
    assert!(!bad.ok);
    assert_eq!(bad.error_kind, pb::ErrorKind::InvalidArguments as i32);
    assert!(bad.text.contains("to"), "{}", bad.text);
    let gone = preview(
        &mut w.g,
        "gmail_reply",
        json!({"message_id": "nope", "body": "x"}),
    )
    .await;
    assert!(!gone.ok);
    assert_eq!(gone.error_kind, pb::ErrorKind::NotFound as i32);
}

#[tokio::test]
async fn p4_an_update_bound_to_a_preview_is_refused_when_the_event_changed() {
    let mut w = world(Backend::Memory).await;
    let args = json!({"event_id": "ev1", "summary": "Quarterly review (moved)"});
    let shown = preview(&mut w.g, "calendar_event_update", args.clone()).await;
    // Someone adds an attendee after the user approved what they saw.
    w.calendar.state.events.lock().unwrap()[0]["attendees"] =
        json!([{"email": "boss@example.com"}, {"email": "mallory@evil.test"}]);
    let mut call = tool_call("calendar_event_update", args.clone());
    call.idempotency_key = "k-update".into();
    call.expected_binding = shown.binding.clone();
    let refused =
        w.g.execute_tool(pb::ExecuteToolRequest { call: Some(call) })
            .await
            .unwrap()
            .into_inner()
            .result
            .unwrap();
    assert_eq!(
        refused.error_kind,
        pb::ErrorKind::ChangedSinceApproval as i32,
        "{}",
        refused.text
    );
    assert!(
        refused.text.contains("mallory@evil.test"),
        "{}",
        refused.text
    );
    assert_eq!(
        w.calendar.state.events.lock().unwrap()[0]["summary"],
        "Quarterly review",
        "nothing was changed"
    );
    // With the binding the event has now, the same key still works: nothing was recorded.
    let fresh = preview(&mut w.g, "calendar_event_update", args.clone()).await;
    let mut again = tool_call("calendar_event_update", args);
    again.idempotency_key = "k-update".into();
    again.expected_binding = fresh.binding;
    let done =
        w.g.execute_tool(pb::ExecuteToolRequest { call: Some(again) })
            .await
            .unwrap()
            .into_inner()
            .result
            .unwrap();
    assert!(done.ok, "{}", done.text);
}

#[tokio::test]
async fn p1_a_memory_keeps_where_it_came_from_and_says_so_when_read_back() {
    let mut w = world(Backend::Postgres).await;
    let mut external = tool_call("save_memory", json!({"content": "Bob handles the budget"}));
    external.read_external_from = vec!["search_gmail".into()];
    external.run_id = "run-7".into();
    let saved =
        w.g.execute_tool(pb::ExecuteToolRequest {
            call: Some(external),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert!(saved.ok, "{}", saved.text);
    let own = call_tool(
        &mut w.g,
        "save_memory",
        json!({"content": "I own the budget review"}),
    )
    .await;
    assert!(own.ok);
    let found = call_tool(&mut w.g, "search_memory", json!({"query": "budget"})).await;
    assert!(
        found.text.contains("Bob handles the budget (saved ")
            && found
                .text
                .contains("(from external content: read by search_gmail in run run-7))"),
        "{}",
        found.text
    );
    let own_line = found
        .text
        .lines()
        .find(|l| l.contains("I own the budget review"))
        .unwrap();
    assert!(!own_line.contains("external"), "{own_line}");
    assert!(found.carries_external_content);
    let plain = call_tool(&mut w.g, "search_memory", json!({"query": "review"})).await;
    assert!(!plain.carries_external_content, "{}", plain.text);
    let tools =
        w.g.list_tools(pb::ListToolsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .tools;
    let flag = |name: &str| tools.iter().find(|t| t.name == name).unwrap();
    assert!(flag("search_gmail").reads_external_content);
    assert!(flag("save_memory").writes_memory && flag("create_memories").writes_memory);
    assert!(!flag("save_memory").reads_external_content);
}

#[tokio::test]
async fn p5_a_side_effect_whose_audit_record_cannot_be_written_is_not_executed() {
    let mut w = world(Backend::Postgres).await;
    // The audit table refuses side-effect intents (a full disk, a revoked grant, ...).
    w.app
        .sql()
        .await
        .batch_execute(
            "ALTER TABLE gateway.audit ADD CONSTRAINT no_intents CHECK (kind <> 'side_effect_intent')",
        )
        .await
        .unwrap();
    let r = call_tool_keyed(
        &mut w.g,
        "gmail_send",
        json!({"to": "boss@example.com", "subject": "Budget", "body": "Numbers"}),
        "k-audit",
    )
    .await;
    assert!(!r.ok);
    assert_eq!(r.error_kind, pb::ErrorKind::Internal as i32);
    assert!(r.text.contains("audit record"), "{}", r.text);
    assert!(w.gmail.sent().is_empty(), "nothing may be sent");
    // Reads are audited after the fact and go on.
    let read = call_tool(&mut w.g, "search_gmail", json!({})).await;
    assert!(read.ok, "{}", read.text);
}
