//! Ready-made worlds for agent tests: both services on PostgreSQL, a scripted
//! OpenAI-compatible model, a fake Gmail, and alice's Gmail account connected.

use steward_proto::gateway::v1 as gw;

use crate::{
    Backend, Options, TestApp,
    calls::{call_tool, connect_account},
    fakes::{
        gmail::{FakeGmail, FakeMessage},
        openai::{Answer, FakeOpenAi},
    },
    spawn::spawn,
};

/// The model plays `answers` in order; `env` adds or overrides settings of both services.
pub async fn gmail_world(
    answers: Vec<Answer>,
    env: &[(&str, &str)],
) -> (TestApp, FakeOpenAi, FakeGmail) {
    let model = FakeOpenAi::start(answers).await;
    let gmail = FakeGmail::start().await;
    gmail.add_messages("tok-alice", vec![]);
    let mut all = vec![
        ("MODEL_CHAIN".to_owned(), "openai/gpt-4o".to_owned()),
        ("OPENAI_BASE_URL".to_owned(), model.url.clone()),
        ("GMAIL_API_BASE_URL".to_owned(), gmail.url.clone()),
    ];
    all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        env: all,
        ..Options::default()
    })
    .await;
    connect_account(
        &mut app.gateway_as("alice").await,
        gw::Integration::Gmail,
        "alice@example.com",
        "tok-alice",
    )
    .await;
    (app, model, gmail)
}

/// The S0 incident's mailboxes for alice: two Gmail inboxes (work@, home@) with ten unread
/// 12 KB newsletters each, and one overdue task ("Call dentist").
pub async fn s0_incident_inboxes(app: &TestApp, gmail: &FakeGmail) {
    let mut g = app.gateway_as("alice").await;
    for (account, token, prefix) in [
        ("work@example.com", "tok-work", "a1"),
        ("home@example.com", "tok-home", "b2"),
    ] {
        gmail.set_unread(token, 10);
        gmail.add_messages(
            token,
            (0..10)
                .map(|i| FakeMessage::html_newsletter(&format!("{prefix}{i:06x}"), i))
                .collect(),
        );
        connect_account(&mut g, gw::Integration::Gmail, account, token).await;
    }
    call_tool(
        &mut g,
        "add_task",
        serde_json::json!({"title": "Call dentist", "due": "2020-01-01"}),
    )
    .await;
}
