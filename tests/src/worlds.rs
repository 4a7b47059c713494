//! Ready-made worlds for agent tests: both services on PostgreSQL, a scripted
//! OpenAI-compatible model, a fake Gmail, and alice's Gmail account connected.

use steward_proto::gateway::v1 as gw;

use crate::{
    Backend, Options, TestApp,
    calls::connect_account,
    fakes::{
        gmail::FakeGmail,
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
