//! Prompt cost (issue 13, E-8, E-10): a long thread's runs stay small, and what repeats from
//! one call to the next is read from Anthropic's prompt cache, not paid for again.

use agent_svc::executor::budget::TokenCounter;
use steward_proto::agent::v1 as pb;
use steward_tests::{
    Backend, agent_calls::run_once, fakes::anthropic_cache::CachingAnthropic,
    rule_model::RuleModel, spawn_app_with,
};

/// About 200 tokens of a person's words, different each turn.
fn long_prompt(i: usize) -> String {
    let ask = if i.is_multiple_of(2) {
        "check my tasks"
    } else {
        "just think it over"
    };
    format!(
        "Turn {i}: {ask}. {}",
        "I have a long week ahead with the quarterly review, the hiring loop for two engineers, \
         a dentist appointment I keep moving and a birthday dinner for my sister on Friday. "
            .repeat(6)
    )
}

#[tokio::test]
async fn q2_a_run_on_a_thread_of_50_prior_turns_sends_at_most_8k_input_tokens() {
    let model = RuleModel::start().await;
    let app = spawn_app_with(
        Backend::Memory,
        &[
            ("MODEL_CHAIN", "openai/gpt-4o-mini"),
            ("OPENAI_BASE_URL", &model.url),
            ("OPENAI_API_KEY", "test"),
        ],
    )
    .await;
    let mut agent = app.agent_as("alice").await;
    let counter = TokenCounter::for_model("gpt-4o-mini");

    let first = run_once(&mut agent, &long_prompt(0), "")
        .await
        .expect("run");
    let thread = first.thread_id;
    let mut said = counter.text(&long_prompt(0));
    for i in 1..50 {
        let result = run_once(&mut agent, &long_prompt(i), &thread)
            .await
            .expect("run");
        assert_eq!(result.status(), pb::RunState::Completed, "turn {i}");
        said += counter.text(&long_prompt(i));
    }
    assert!(
        said > 8_000,
        "the thread's own words alone ({said} tokens) would not fit 8K"
    );

    let before = model.requests().len();
    let last = run_once(&mut agent, "check my tasks once more", &thread)
        .await
        .expect("run");
    assert_eq!(last.status(), pb::RunState::Completed);
    let calls = &model.requests()[before..];
    assert_eq!(calls.len(), 2, "a tool call and the answer");
    for call in calls {
        // The whole request body, JSON syntax included: an upper bound of what the model reads.
        let tokens = counter.text(&call.body.to_string());
        eprintln!("a call on a 50-turn thread ({said} tokens said so far): {tokens} tokens");
        assert!(
            tokens <= 8_000,
            "a call on a 50-turn thread sent {tokens} tokens"
        );
        let messages = call.body["messages"].as_array().expect("messages");
        assert!(
            messages.iter().any(|m| m["content"]
                .as_str()
                .is_some_and(|c| c.starts_with("Turn 4"))),
            "recent turns are still there"
        );
        assert!(
            !messages.iter().any(|m| m["content"]
                .as_str()
                .is_some_and(|c| c.starts_with("Turn 1:"))),
            "the oldest turns are left out"
        );
    }
}

async fn anthropic_app(fake: &CachingAnthropic, cache: &str) -> steward_tests::TestApp {
    spawn_app_with(
        Backend::Memory,
        &[
            ("MODEL_CHAIN", "anthropic/claude-sonnet-4-5"),
            ("ANTHROPIC_BASE_URL", &fake.base),
            ("ANTHROPIC_API_KEY", "test"),
            ("ANTHROPIC_PROMPT_CACHE", cache),
        ],
    )
    .await
}

#[tokio::test]
async fn e10_with_anthropic_caching_a_repeated_run_reads_most_of_its_input_from_the_cache() {
    let fake = CachingAnthropic::start().await;
    let app = anthropic_app(&fake, "true").await;
    // Something remembered that each prompt finds: [ABOUT THE USER] differs run to run.
    let saved = steward_tests::calls::call_tool(
        &mut app.gateway_as("alice").await,
        "create_memories",
        serde_json::json!({"memories": [
            {"content": "Keeps tasks for the hiring loop"},
            {"content": "Reviews tasks again every Friday"}]}),
    )
    .await;
    assert!(saved.ok, "{}", saved.text);
    let mut agent = app.agent_as("alice").await;

    let first = run_once(&mut agent, "check my tasks", "")
        .await
        .expect("run");
    assert_eq!(first.status(), pb::RunState::Completed);
    let second = run_once(&mut agent, "check my tasks again", &first.thread_id)
        .await
        .expect("run");
    assert_eq!(second.status(), pb::RunState::Completed);

    let usage = second.usage.expect("usage");
    assert_eq!(usage.model_calls, 2, "a tool call and the answer");
    let share = usage.cached_tokens as f64 / usage.input_tokens as f64;
    eprintln!("repeated run: {usage:?}, {:.1}% cache reads", share * 100.0);
    assert!(
        share >= 0.8,
        "cache reads are {:.0}% of the repeated run's input ({usage:?}); the fake saw {:?}",
        share * 100.0,
        fake.usage()
    );
    let billed: u64 = fake.usage()[2..].iter().map(|u| u.total()).sum();
    assert_eq!(
        usage.input_tokens, billed,
        "the run accounts for exactly what the provider billed"
    );
}

#[tokio::test]
async fn e10_with_anthropic_caching_off_nothing_is_read_from_the_cache() {
    let fake = CachingAnthropic::start().await;
    let app = anthropic_app(&fake, "false").await;
    let mut agent = app.agent_as("alice").await;
    let first = run_once(&mut agent, "check my tasks", "")
        .await
        .expect("run");
    let second = run_once(&mut agent, "check my tasks again", &first.thread_id)
        .await
        .expect("run");
    assert_eq!(second.usage.expect("usage").cached_tokens, 0);
    assert!(
        fake.usage()
            .iter()
            .all(|u| u.cache_read == 0 && u.cache_write == 0)
    );
}
