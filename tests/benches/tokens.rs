//! What a model reads (issue 13, E-8, S0): input tokens, counted with tiktoken (o200k, as for
//! gpt-4o) over the whole request body a model server received, JSON syntax included.
//! - the incident's session open: two Gmail inboxes with ten unread 12 KB newsletters each, an
//!   overdue task (production sent 135K tokens here; S0);
//! - a run on a thread of 50 earlier turns of ~250 tokens each (AGENT_HISTORY_TOKENS default);
//! - the tool declarations a user with Gmail, Calendar and Slack connected is offered, each as
//!   an OpenAI function declaration (sent with every model call of a run).
//!
//! Run: `cargo bench -p steward-tests --bench tokens`.

use agent_svc::executor::budget::TokenCounter;
use steward_proto::agent::v1 as pb;
use steward_proto::gateway::v1 as gw;
use steward_tests::{
    Backend, Options,
    agent_calls::run_once,
    bench::summary,
    calls::connect_account,
    fakes::{
        gmail::FakeGmail,
        openai::{Answer, FakeOpenAi},
    },
    rule_model::RuleModel,
    spawn::spawn,
    worlds::s0_incident_inboxes,
};

fn tokens(body: &serde_json::Value) -> usize {
    TokenCounter::for_model("gpt-4o").text(&body.to_string())
}

async fn session_open_incident() -> usize {
    let model = FakeOpenAi::start(vec![Answer::text("Morning! 10 unread in each inbox.")]).await;
    let gmail = FakeGmail::start().await;
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env: vec![
            ("MODEL_CHAIN".into(), "openai/gpt-4o".into()),
            ("OPENAI_BASE_URL".into(), model.url.clone()),
            ("GMAIL_API_BASE_URL".into(), gmail.url.clone()),
        ],
        ..Options::default()
    })
    .await;
    s0_incident_inboxes(&app, &gmail).await;
    let greeting = app
        .agent_as("alice")
        .await
        .open_session(pb::OpenSessionRequest {
            time_zone: "UTC".into(),
            ..Default::default()
        })
        .await
        .expect("OpenSession")
        .into_inner();
    assert!(!greeting.silent, "the session opened with a greeting");
    let requests = model.requests();
    assert_eq!(requests.len(), 1, "one model call");
    tokens(&requests[0].1)
}

async fn fifty_turn_thread() -> (usize, usize) {
    let model = RuleModel::start().await;
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env: vec![
            ("MODEL_CHAIN".into(), "openai/gpt-4o".into()),
            ("OPENAI_BASE_URL".into(), model.url.clone()),
        ],
        ..Options::default()
    })
    .await;
    let mut agent = app.agent_as("alice").await;
    let counter = TokenCounter::for_model("gpt-4o");
    let turn =
        |i: usize| {
            format!(
            "Turn {i}: {} {}",
            if i.is_multiple_of(2) { "check my tasks." } else { "noted." },
            "The quarterly review, the hiring loop, the dentist and my sister's birthday dinner. "
                .repeat(12)
        )
        };
    let mut thread = String::new();
    let mut said = 0;
    for i in 0..50 {
        let result = run_once(&mut agent, &turn(i), &thread).await.expect("run");
        assert_eq!(result.status(), pb::RunState::Completed);
        thread = result.thread_id;
        said += counter.text(&turn(i));
    }
    let before = model.requests().len();
    run_once(&mut agent, "check my tasks once more", &thread)
        .await
        .expect("run");
    let largest = model.requests()[before..]
        .iter()
        .map(|r| tokens(&r.body))
        .max()
        .expect("the run called the model");
    (largest, said)
}

/// Every tool a fully connected user is offered: (name, tokens of its declaration), largest
/// first.
async fn tool_declarations() -> Vec<(String, usize)> {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        ..Options::default()
    })
    .await;
    let mut g = app.gateway_as("alice").await;
    for (integration, account) in [
        (gw::Integration::Gmail, "alice@example.com"),
        (gw::Integration::GoogleCalendar, "alice@example.com"),
        (gw::Integration::Slack, "T0001"),
    ] {
        connect_account(&mut g, integration, account, "tok").await;
    }
    let tools = g
        .list_tools(gw::ListToolsRequest::default())
        .await
        .expect("ListTools")
        .into_inner()
        .tools;
    let mut sizes: Vec<(String, usize)> = tools
        .iter()
        .map(|t| {
            let declaration = serde_json::json!({
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": serde_json::from_str::<serde_json::Value>(&t.parameters_json_schema)
                        .expect("a JSON schema"),
                }
            });
            (t.name.clone(), tokens(&declaration))
        })
        .collect();
    sizes.sort_by_key(|s| std::cmp::Reverse(s.1));
    sizes
}

#[tokio::main]
async fn main() {
    let declarations = tool_declarations().await;
    let total: usize = declarations.iter().map(|(_, n)| n).sum();
    println!(
        "tool declarations of a user with Gmail, Calendar and Slack: {} tools, {total} tokens",
        declarations.len()
    );
    for (name, n) in &declarations {
        println!("  {n:>5}  {name}");
    }
    summary(
        "tool declarations, fully connected user: tokens",
        &total.to_string(),
        "",
    );
    let incident = session_open_incident().await;
    println!(
        "session open, the S0 incident (2 inboxes × 10 unread 12 KB emails): {incident} input tokens in one call (production sent 135K)"
    );
    summary(
        "session open, S0 incident: input tokens",
        &incident.to_string(),
        "",
    );
    let (largest, said) = fifty_turn_thread().await;
    println!(
        "a run on a thread of 50 earlier turns ({said} tokens said by the user alone): largest call {largest} input tokens"
    );
    summary(
        "run on a 50-turn thread: input tokens per call",
        &largest.to_string(),
        "≤ 8000",
    );
}
