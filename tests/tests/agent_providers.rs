//! Model providers against fakes speaking their wire formats, driven through the executor
//! (issue 6; L-1..L-3, E-6, S4 fix 2), and one run whose tools execute on a real gateway-svc
//! over the Execute stream.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use agent_svc::{
    executor::{
        EventSink, Executor, ModelSetup, RunEvent, RunRequest, Stop, ToolInvocation, ToolOutcome,
        ToolRunner,
        limits::{Channel, profile},
    },
    gateway_client::GatewayClient,
    llm::{
        BaseUrl, ModelProvider, ToolDecl, ToolSet,
        openai::OpenAi,
        resilient::{ChainEntry, RetryPolicy},
    },
};
use steward_proto::gateway::v1 as pb;
use steward_tests::{
    Backend, Options, SERVICE_TOKEN,
    calls::{call_tool, connect_account},
    fakes::openai::{Answer, FakeOpenAi},
    spawn::{gateway_as, spawn},
};

#[derive(Default)]
struct Events(Mutex<Vec<RunEvent>>);

impl EventSink for Events {
    fn emit(&self, e: RunEvent) {
        self.0.lock().unwrap().push(e);
    }
}

struct EchoTools;

#[async_trait::async_trait]
impl ToolRunner for EchoTools {
    async fn run(&self, calls: Vec<ToolInvocation>) -> Vec<ToolOutcome> {
        calls
            .into_iter()
            .map(|c| ToolOutcome {
                ok: true,
                text: format!("{} → {}", c.name, c.args),
                error_kind: String::new(),
                truncated: false,
                external: false,
            })
            .collect()
    }
}

fn openai(url: &str) -> Arc<dyn ModelProvider> {
    Arc::new(OpenAi::new(
        "openai",
        &BaseUrl::parse(url).unwrap(),
        Some("sk-test".into()),
        reqwest::Client::new(),
    ))
}

fn executor(chain: Vec<ChainEntry>) -> Executor {
    Executor {
        models: Arc::new(ModelSetup {
            chain,
            retry: RetryPolicy {
                base_backoff: Duration::from_millis(5),
                max_backoff: Duration::from_millis(20),
                ..RetryPolicy::default()
            },
            max_output_tokens: 2048,
            context_window: 128_000,
            history_tokens: 0,
            prices: HashMap::new(),
            final_turn_grace: Duration::from_secs(5),
        }),
        max_tool_result_chars: 6000,
    }
}

fn request(tools: &[&str]) -> RunRequest {
    RunRequest {
        system: "You are Steward.".into(),
        system_tokens: None,
        history: vec![],
        prompt: "Plan my day".into(),
        tools: Arc::new(ToolSet::new(
            tools
                .iter()
                .map(|t| ToolDecl {
                    name: (*t).into(),
                    description: "d".into(),
                    parameters: serde_json::json!({"type": "object"}),
                })
                .collect(),
        )),
        limits: profile(Channel::Web, None),
        stop_after: None,
        resume: false,
        gathered: Vec::new(),
    }
}

#[tokio::test]
async fn openai_two_tool_calls_then_a_streamed_answer() {
    let fake = FakeOpenAi::start(vec![
        Answer::tool_calls(&[
            ("call_a", "list_tasks", r#"{"status":"pending"}"#),
            ("call_b", "search_memory", r#"{"query":"focus"}"#),
        ]),
        Answer::text("Start with the dentist."),
    ])
    .await;
    let exec = executor(vec![ChainEntry {
        provider: openai(&fake.url),
        model: "gpt-4o-mini".into(),
    }]);
    let events = Events::default();
    let out = exec
        .run(
            &request(&["list_tasks", "search_memory"]),
            &EchoTools,
            &events,
        )
        .await;
    assert_eq!(
        (out.stop.clone(), out.text.as_str()),
        (Stop::Completed, "Start with the dentist.")
    );

    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let first = &requests[0].1;
    assert_eq!(first["model"], "gpt-4o-mini");
    assert_eq!(first["max_tokens"], 2048);
    assert_eq!(first["stream"], true);
    assert_eq!(first["tools"][0]["function"]["name"], "list_tasks");
    let second = &requests[1].1["messages"];
    let roles: Vec<&str> = second
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "tool"]);
    assert_eq!(
        second[2]["tool_calls"][0]["function"]["arguments"], r#"{"status":"pending"}"#,
        "fragments are joined"
    );
    // Steward's own call ids (providers repeat or omit theirs), paired in the transcript.
    assert_eq!(second[3]["tool_call_id"], second[2]["tool_calls"][0]["id"]);
    assert!(
        second[3]["tool_call_id"]
            .as_str()
            .unwrap()
            .starts_with("call_")
    );
    assert_ne!(second[3]["tool_call_id"], second[4]["tool_call_id"]);
    // What a tool returned is data (issue 14).
    assert_eq!(
        second[4]["content"],
        "<data source=\"result of search_memory\">\nsearch_memory → {\"query\":\"focus\"}\n</data>"
    );

    let deltas: Vec<String> = events
        .0
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| {
            if let RunEvent::TextDelta(t) = e {
                Some(t.clone())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(
        deltas,
        ["Start ", "with ", "the ", "dentist."],
        "text streams as deltas"
    );
    assert_eq!(out.calls[1].usage.cached_tokens, 100);
    assert_eq!(out.calls[1].usage.input_tokens, 120);
}

#[tokio::test]
async fn a_429_with_retry_after_waits_that_long_then_succeeds() {
    let fake = FakeOpenAi::start(vec![
        Answer::Error {
            status: 429,
            retry_after: Some(1),
        },
        Answer::text("ok"),
    ])
    .await;
    let exec = executor(vec![ChainEntry {
        provider: openai(&fake.url),
        model: "gpt-4o".into(),
    }]);
    let out = exec
        .run(&request(&[]), &EchoTools, &Events::default())
        .await;
    assert_eq!(out.text, "ok");
    let r = fake.requests();
    assert!(
        r[1].0 - r[0].0 >= Duration::from_secs(1),
        "waited {:?}",
        r[1].0 - r[0].0
    );
    assert_eq!(out.calls[0].retries, 1);
}

#[tokio::test]
async fn a_500_is_retried_and_a_cut_off_stream_too() {
    let fake = FakeOpenAi::start(vec![
        Answer::Error {
            status: 500,
            retry_after: None,
        },
        Answer::CutOff {
            events: vec![
                serde_json::json!({"choices": [{"index": 0, "delta": {"content": "half"}}]}),
            ],
        },
        Answer::text("whole"),
    ])
    .await;
    let exec = executor(vec![ChainEntry {
        provider: openai(&fake.url),
        model: "gpt-4o".into(),
    }]);
    let out = exec
        .run(&request(&[]), &EchoTools, &Events::default())
        .await;
    assert_eq!(out.text, "whole");
    assert_eq!(fake.requests().len(), 3);
}

/// An executor whose chain is a gpt-4o that answers `first`, then a gpt-4o-mini that answers
/// "from the second model"; with the first's fake.
async fn with_a_fallback(first: Answer) -> (Executor, FakeOpenAi, FakeOpenAi) {
    with_a_fallback_after(vec![first]).await
}

/// [`with_a_fallback`], its gpt-4o answering `firsts` in turn.
async fn with_a_fallback_after(firsts: Vec<Answer>) -> (Executor, FakeOpenAi, FakeOpenAi) {
    let primary = FakeOpenAi::start(firsts).await;
    let secondary = FakeOpenAi::start(vec![Answer::text("from the second model")]).await;
    let exec = executor(vec![
        ChainEntry {
            provider: openai(&primary.url),
            model: "gpt-4o".into(),
        },
        ChainEntry {
            provider: openai(&secondary.url),
            model: "gpt-4o-mini".into(),
        },
    ]);
    (exec, primary, secondary)
}

#[tokio::test]
async fn a_400_fails_without_retry_and_the_chain_moves_on() {
    let (exec, primary, _secondary) = with_a_fallback(Answer::Error {
        status: 400,
        retry_after: None,
    })
    .await;
    let out = exec
        .run(&request(&[]), &EchoTools, &Events::default())
        .await;
    assert_eq!(out.text, "from the second model");
    assert_eq!(primary.requests().len(), 1);
    assert_eq!(out.calls[0].model, "gpt-4o-mini");
}

/// L-3, E-6: a model that takes the request and never answers gets its share of the run's
/// time, not the 120 s a call may take, so the fallback answers before the run's limit.
#[tokio::test]
async fn l3_a_model_that_hangs_leaves_the_fallback_time_to_answer_within_the_run() {
    let (exec, _primary, _secondary) = with_a_fallback(Answer::Slow(
        Box::new(Answer::text("far too late")),
        Duration::from_secs(600),
    ))
    .await;
    let mut req = request(&[]);
    req.limits.max_wall = Duration::from_secs(4);
    let out = exec.run(&req, &EchoTools, &Events::default()).await;
    assert_eq!(out.text, "from the second model");
    assert_eq!(out.stop, Stop::Completed, "{:?}", out.stop);
    let models: Vec<&str> = out.calls.iter().map(|c| c.model.as_str()).collect();
    assert_eq!(
        models,
        ["gpt-4o", "gpt-4o-mini"],
        "the hung try may be billed, so it is counted"
    );
}

/// E-10: a compatible server that sends no usage (it ignores stream_options) still billed the
/// call; the run counts it with the tokenizer, so its budget and cost see the call.
#[tokio::test]
async fn e10_a_call_answered_without_usage_is_counted_not_free() {
    let fake = FakeOpenAi::start(vec![Answer::Stream {
        events: vec![
            serde_json::json!({"choices": [{"index": 0, "delta": {"content": "Nothing is due today."}}]}),
            serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        ],
        chunk: 64,
    }])
    .await;
    let exec = executor(vec![ChainEntry {
        provider: openai(&fake.url),
        model: "gpt-4o".into(),
    }]);
    let out = exec
        .run(&request(&[]), &EchoTools, &Events::default())
        .await;
    assert_eq!(out.text, "Nothing is due today.");
    let usage = out.calls[0].usage;
    assert!(usage.input_tokens > 10, "{usage:?}");
    assert!(usage.output_tokens >= 5, "{usage:?}");
}

/// E-5, L-3: a reasoning model that spent its whole output on thinking said nothing; the next
/// model answers, and the empty answer is still counted, as it was billed.
#[tokio::test]
async fn e5_an_answer_cut_for_length_before_any_text_goes_to_the_next_model() {
    let (exec, _primary, _secondary) = with_a_fallback(Answer::Stream {
        events: vec![
            serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
            serde_json::json!({"choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 2048}}),
        ],
        chunk: 64,
    })
    .await;
    let out = exec
        .run(&request(&[]), &EchoTools, &Events::default())
        .await;
    assert_eq!(out.text, "from the second model");
    assert!(!out.model_text_empty);
    let spent: Vec<(&str, u64)> = out
        .calls
        .iter()
        .map(|c| (c.model.as_str(), c.usage.output_tokens))
        .collect();
    assert_eq!(spent, [("gpt-4o", 2048), ("gpt-4o-mini", 12)]);
}

/// E-10: a try whose stream was cut was billed all the same; the run's budget sees it, its
/// input estimated, beside the call that answered.
#[tokio::test]
async fn e10_a_try_cut_mid_stream_is_counted_with_its_input_estimated() {
    let cut = Answer::CutOff {
        events: vec![
            serde_json::json!({"choices": [{"index": 0, "delta": {"content": "Let me"}}]}),
        ],
    };
    let (exec, _primary, _secondary) =
        with_a_fallback_after(vec![cut.clone(), cut.clone(), cut]).await;
    let out = exec
        .run(&request(&[]), &EchoTools, &Events::default())
        .await;
    assert_eq!(out.text, "from the second model");
    let models: Vec<&str> = out.calls.iter().map(|c| c.model.as_str()).collect();
    assert_eq!(
        models,
        ["gpt-4o", "gpt-4o", "gpt-4o", "gpt-4o-mini"],
        "three cut tries, then the answer"
    );
    for cut in &out.calls[..3] {
        assert!(cut.usage.input_tokens > 10, "{:?}", cut.usage);
        assert_eq!(cut.usage.output_tokens, 0);
    }
    assert_eq!(
        out.calls[3].usage.input_tokens, 120,
        "the answer's own usage"
    );
}

#[tokio::test]
async fn all_failing_gives_the_friendly_partial_results_message() {
    let fake = FakeOpenAi::start(vec![
        Answer::tool_calls(&[("c1", "list_tasks", "{}")]),
        Answer::Error {
            status: 503,
            retry_after: None,
        },
        Answer::Error {
            status: 503,
            retry_after: None,
        },
        Answer::Error {
            status: 503,
            retry_after: None,
        },
    ])
    .await;
    let exec = executor(vec![ChainEntry {
        provider: openai(&fake.url),
        model: "gpt-4o".into(),
    }]);
    let out = exec
        .run(&request(&["list_tasks"]), &EchoTools, &Events::default())
        .await;
    assert!(matches!(out.stop, Stop::ModelUnavailable(_)));
    assert_eq!(
        out.text,
        "I'm having trouble connecting right now. Here's what I was able to gather: list_tasks: list_tasks → {}"
    );
}

/// E-6: an answer that failed after part of it streamed (here an error inside the stream) is
/// withdrawn from the client before the fallback text comes, not left on screen before it.
#[tokio::test]
async fn the_part_of_an_answer_that_streamed_before_it_failed_is_withdrawn() {
    let fake = FakeOpenAi::start(vec![Answer::Stream {
        events: vec![
            serde_json::json!({"choices": [{"index": 0, "delta": {"content": "Your day: "}}]}),
            serde_json::json!({"object": "error", "error": {"message": "context length exceeded", "code": 400}}),
        ],
        chunk: 64,
    }])
    .await;
    let exec = executor(vec![ChainEntry {
        provider: openai(&fake.url),
        model: "gpt-4o".into(),
    }]);
    let events = Events::default();
    let out = exec.run(&request(&[]), &EchoTools, &events).await;
    assert!(
        matches!(out.stop, Stop::ModelUnavailable(_)),
        "{:?}",
        out.stop
    );
    let seen = events.0.lock().unwrap();
    let partial = seen
        .iter()
        .position(|e| matches!(e, RunEvent::TextDelta(t) if t == "Your day: "))
        .expect("the partial text streamed");
    assert!(
        seen[partial..]
            .iter()
            .any(|e| matches!(e, RunEvent::DeltaReset)),
        "{seen:?}"
    );
}

/// Issue 13: each ListTools names the lists this replica holds, so users with the same
/// integrations share one copy the gateway sends once; a user whose list changed (an account
/// connected) is never handed the list held before.
#[tokio::test]
async fn equal_tool_lists_are_sent_once_and_a_changed_list_is_never_stale() {
    let app = spawn(Options::default()).await;
    let gateway =
        GatewayClient::connect_lazy(&format!("http://{}", app.gateway_addr), SERVICE_TOKEN)
            .unwrap();
    let alice = gateway.list_tools("alice", pb::Channel::Web).await.unwrap();
    let bob = gateway.list_tools("bob", pb::Channel::Web).await.unwrap();
    assert!(Arc::ptr_eq(&alice, &bob), "one copy for both");
    assert!(!alice.tools.iter().any(|t| t.decl.name == "search_gmail"));

    let mut bobs = gateway_as(app.gateway_addr, "bob").await;
    connect_account(&mut bobs, pb::Integration::Gmail, "bob@example.com", "t").await;
    let bob = gateway.list_tools("bob", pb::Channel::Web).await.unwrap();
    assert!(bob.tools.iter().any(|t| t.decl.name == "search_gmail"));
    let alice_again = gateway.list_tools("alice", pb::Channel::Web).await.unwrap();
    assert!(Arc::ptr_eq(&alice, &alice_again), "both lists held now");
    assert_eq!(
        gateway.whole_lists_received(),
        2,
        "alice's first list and bob's changed one; the other two answers said \"unchanged\""
    );
}

#[tokio::test]
async fn a_run_executes_its_tools_on_gateway_svc_over_the_execute_stream() {
    let app = spawn(Options {
        backend: Some(Backend::Postgres),
        ..Options::default()
    })
    .await;
    let fake = FakeOpenAi::start(vec![
        Answer::tool_calls(&[
            ("c1", "add_task", r#"{"title":"Call dentist"}"#),
            ("c2", "save_memory", r#"{"content":"Prefers mornings"}"#),
        ]),
        Answer::text("Done: task added and noted."),
    ])
    .await;
    let gateway =
        GatewayClient::connect_lazy(&format!("http://{}", app.gateway_addr), SERVICE_TOKEN)
            .unwrap();
    let tools = gateway.list_tools("alice", pb::Channel::Web).await.unwrap();
    assert!(
        tools
            .tools
            .iter()
            .any(|t| t.decl.name == "add_task" && !t.side_effect)
    );
    let mut req = request(&[]);
    req.tools = Arc::new(ToolSet::new(
        tools.tools.iter().map(|t| t.decl.clone()).collect(),
    ));
    let session = gateway
        .open("alice", "run-1", pb::Channel::Web, None)
        .await
        .unwrap();
    let exec = executor(vec![ChainEntry {
        provider: openai(&fake.url),
        model: "gpt-4o".into(),
    }]);
    let events = Events::default();
    let out = exec.run(&req, &session, &events).await;
    assert_eq!(out.text, "Done: task added and noted.");
    let results: Vec<(String, bool)> = events
        .0
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| {
            if let RunEvent::ToolResult { name, ok, .. } = e {
                Some((name.clone(), *ok))
            } else {
                None
            }
        })
        .collect();
    assert_eq!(
        results,
        [
            ("add_task".to_owned(), true),
            ("save_memory".to_owned(), true)
        ]
    );
    // The task really exists, for alice only: the user id travelled in metadata.
    let mut alice = app.gateway_as("alice").await;
    assert!(
        call_tool(&mut alice, "list_tasks", serde_json::json!({}))
            .await
            .text
            .contains("Call dentist")
    );
    let mut bob = app.gateway_as("bob").await;
    assert_eq!(
        call_tool(&mut bob, "list_tasks", serde_json::json!({}))
            .await
            .text,
        "No pending tasks."
    );
}

mod anthropic_and_gemini {
    use agent_svc::llm::{anthropic::Anthropic, gemini::Gemini};
    use steward_tests::fakes::{anthropic, gemini};

    use super::*;

    fn anthropic_at(base: &str) -> Arc<dyn ModelProvider> {
        Arc::new(Anthropic::new(
            &BaseUrl::parse(base).unwrap(),
            Some("sk-ant-test".into()),
            reqwest::Client::new(),
            true,
        ))
    }

    fn gemini_at(base: &str) -> Arc<dyn ModelProvider> {
        Arc::new(Gemini {
            base_url: BaseUrl::parse(base).unwrap(),
            api_key: Some("gm-test".into()),
            http: reqwest::Client::new(),
        })
    }

    fn texts(events: &Events) -> (Vec<String>, String) {
        let events = events.0.lock().unwrap();
        let deltas = events
            .iter()
            .filter_map(|e| {
                if let RunEvent::TextDelta(t) = e {
                    Some(t.clone())
                } else {
                    None
                }
            })
            .collect();
        let thoughts = events
            .iter()
            .filter_map(|e| {
                if let RunEvent::ThinkingDelta(t) = e {
                    Some(t.as_str())
                } else {
                    None
                }
            })
            .collect();
        (deltas, thoughts)
    }

    #[tokio::test]
    async fn anthropic_two_tool_calls_then_a_streamed_answer() {
        let fake = anthropic::start(vec![
            anthropic::tool_calls(&[
                ("toolu_1", "list_tasks", r#"{"status":"pending"}"#),
                ("toolu_2", "search_memory", r#"{"query":"x"}"#),
            ]),
            anthropic::text("All clear today."),
        ])
        .await;
        let exec = executor(vec![ChainEntry {
            provider: anthropic_at(&fake.base),
            model: "claude-sonnet-4".into(),
        }]);
        let events = Events::default();
        let out = exec
            .run(
                &request(&["list_tasks", "search_memory"]),
                &EchoTools,
                &events,
            )
            .await;
        assert_eq!(
            (out.stop.clone(), out.text.as_str()),
            (Stop::Completed, "All clear today.")
        );
        let seen = fake.seen();
        assert_eq!(seen[0].headers["x-api-key"], "sk-ant-test");
        assert_eq!(seen[0].headers["anthropic-version"], "2023-06-01");
        assert_eq!(seen[0].body["system"][0]["text"], "You are Steward.");
        assert_eq!(
            seen[0].body["system"][0]["cache_control"]["type"], "ephemeral",
            "the system text is a cache breakpoint"
        );
        assert_eq!(seen[0].body["max_tokens"], 2048);
        assert_eq!(seen[0].body["tools"][1]["input_schema"]["type"], "object");
        let messages = seen[1].body["messages"].as_array().unwrap().clone();
        assert_eq!(
            messages.len(),
            3,
            "user, assistant tool_use, one user message with both results"
        );
        assert_eq!(messages[1]["content"][0]["type"], "tool_use");
        assert_eq!(
            messages[1]["content"][0]["input"]["status"], "pending",
            "input_json fragments are joined"
        );
        assert_eq!(
            messages[2]["content"][1]["tool_use_id"], messages[1]["content"][1]["id"],
            "each result answers its own call"
        );
        let (deltas, thoughts) = texts(&events);
        assert_eq!(deltas, ["All ", "clear ", "today."]);
        assert!(thoughts.contains("Let me think."));
        assert_eq!(
            out.calls[1].usage.input_tokens, 250,
            "cache reads count as input"
        );
        assert_eq!(out.calls[1].usage.cached_tokens, 200);
    }

    #[tokio::test]
    async fn anthropic_429_and_500_are_retried_and_400_is_not() {
        let fake = anthropic::start(vec![
            anthropic::error(429, Some(0)),
            anthropic::error(500, None),
            anthropic::text("fine"),
        ])
        .await;
        let exec = executor(vec![ChainEntry {
            provider: anthropic_at(&fake.base),
            model: "claude".into(),
        }]);
        assert_eq!(
            exec.run(&request(&[]), &EchoTools, &Events::default())
                .await
                .text,
            "fine"
        );
        assert_eq!(fake.seen().len(), 3);

        let fake = anthropic::start(vec![anthropic::error(400, None)]).await;
        let exec = executor(vec![ChainEntry {
            provider: anthropic_at(&fake.base),
            model: "claude".into(),
        }]);
        let out = exec
            .run(&request(&[]), &EchoTools, &Events::default())
            .await;
        assert!(matches!(out.stop, Stop::ModelUnavailable(_)));
        assert_eq!(fake.seen().len(), 1);
    }

    #[tokio::test]
    async fn gemini_function_calls_then_a_streamed_answer() {
        let fake = gemini::start(vec![
            gemini::function_calls(&[
                ("list_tasks", serde_json::json!({"status": "pending"})),
                ("search_memory", serde_json::json!({"query": "x"})),
            ]),
            gemini::text("Nothing urgent."),
        ])
        .await;
        let exec = executor(vec![ChainEntry {
            provider: gemini_at(&fake.base),
            model: "gemini-2.5-flash".into(),
        }]);
        let events = Events::default();
        let out = exec
            .run(
                &request(&["list_tasks", "search_memory"]),
                &EchoTools,
                &events,
            )
            .await;
        assert_eq!(
            (out.stop.clone(), out.text.as_str()),
            (Stop::Completed, "Nothing urgent.")
        );
        let seen = fake.seen();
        assert_eq!(
            seen[0].path,
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
        );
        assert_eq!(seen[0].headers["x-goog-api-key"], "gm-test");
        assert_eq!(
            seen[0].body["systemInstruction"]["parts"][0]["text"],
            "You are Steward."
        );
        assert_eq!(seen[0].body["generationConfig"]["maxOutputTokens"], 2048);
        assert_eq!(
            seen[0].body["tools"][0]["functionDeclarations"][0]["name"],
            "list_tasks"
        );
        let contents = seen[1].body["contents"].as_array().unwrap().clone();
        let roles: Vec<&str> = contents
            .iter()
            .map(|c| c["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["user", "model", "user"]);
        assert_eq!(
            contents[1]["parts"][0]["functionCall"]["args"]["status"],
            "pending"
        );
        assert_eq!(
            contents[2]["parts"][1]["functionResponse"]["name"],
            "search_memory"
        );
        let (deltas, thoughts) = texts(&events);
        assert_eq!(deltas, ["Nothing ", "urgent."]);
        assert_eq!(thoughts, "Considering the request.");
        assert_eq!(out.calls[1].usage.cached_tokens, 64);
    }

    #[tokio::test]
    async fn gemini_500_is_retried_and_400_falls_through_to_the_next_model() {
        let fake = gemini::start(vec![gemini::error(500), gemini::text("recovered")]).await;
        let exec = executor(vec![ChainEntry {
            provider: gemini_at(&fake.base),
            model: "gemini-2.5-pro".into(),
        }]);
        assert_eq!(
            exec.run(&request(&[]), &EchoTools, &Events::default())
                .await
                .text,
            "recovered"
        );

        let bad = gemini::start(vec![gemini::error(400)]).await;
        let good = anthropic::start(vec![anthropic::text("from claude")]).await;
        let exec = executor(vec![
            ChainEntry {
                provider: gemini_at(&bad.base),
                model: "gemini-2.5-pro".into(),
            },
            ChainEntry {
                provider: anthropic_at(&good.base),
                model: "claude".into(),
            },
        ]);
        let out = exec
            .run(&request(&[]), &EchoTools, &Events::default())
            .await;
        assert_eq!(out.text, "from claude");
        assert_eq!(bad.seen().len(), 1);
        assert_eq!(out.calls[0].provider, "anthropic");
    }
}

/// `gate_wait` answers only once `gate_open` has run: so on one Execute stream the later call's
/// result arrives first, whatever the timing.
struct Gate {
    name: &'static str,
    opened: Arc<tokio::sync::watch::Sender<bool>>,
}

#[async_trait::async_trait]
impl gateway_svc::registry::Tool for Gate {
    fn spec(&self) -> gateway_svc::registry::ToolSpec {
        gateway_svc::registry::ToolSpec {
            name: self.name.into(),
            aliases: vec![],
            description: format!("test gate {}", self.name),
            schema: serde_json::json!({"type": "object", "properties": {}}),
            side_effect: false,
            integration: gateway_svc::domain::Integration::Tasks,
            upstream_cost: 0,
            reads_external_content: false,
            writes_memory: false,
        }
    }

    fn read_only(&self) -> bool {
        true
    }

    async fn call(
        &self,
        _ctx: &gateway_svc::context::CallContext,
        _args: serde_json::Value,
    ) -> Result<gateway_svc::registry::ToolOutput, gateway_svc::enforce::ToolError> {
        if self.name == "gate_open" {
            self.opened.send_replace(true);
        } else {
            let _ = self.opened.subscribe().wait_for(|open| *open).await;
        }
        Ok(gateway_svc::registry::ToolOutput::text(format!(
            "{} answered",
            self.name
        )))
    }
}

#[tokio::test]
async fn results_that_arrive_out_of_order_on_one_execute_stream_reach_their_own_calls() {
    let opened = Arc::new(tokio::sync::watch::channel(false).0);
    let gates = ["gate_wait", "gate_open"].map(|name| {
        Arc::new(Gate {
            name,
            opened: opened.clone(),
        }) as Arc<dyn gateway_svc::registry::Tool>
    });
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        gateway_tools: gates.to_vec(),
        ..Options::default()
    })
    .await;
    let gateway =
        GatewayClient::connect_lazy(&format!("http://{}", app.gateway_addr), SERVICE_TOKEN)
            .unwrap();
    let session = gateway
        .open("alice", "run-1", pb::Channel::Web, None)
        .await
        .unwrap();
    let call = |id: &str, name: &str| ToolInvocation {
        call_id: id.into(),
        name: name.into(),
        args: serde_json::json!({}),
        read_external_from: vec![],
        expected_binding: String::new(),
    };
    // Twice on the same stream: the session reads results with no task of its own, so the
    // second round shows nothing was left behind by the first.
    for round in 1..=2 {
        opened.send_replace(false);
        let outcomes = tokio::time::timeout(
            Duration::from_secs(10),
            session.run(vec![
                call(&format!("w{round}"), "gate_wait"),
                call(&format!("o{round}"), "gate_open"),
            ]),
        )
        .await
        .expect("both calls answered");
        let texts: Vec<&str> = outcomes.iter().map(|o| o.text.as_str()).collect();
        assert_eq!(
            texts,
            ["gate_wait answered", "gate_open answered"],
            "round {round}"
        );
        assert!(!session.is_closed(), "the stream stays open between rounds");
    }
}

/// A gateway whose ListTools answers are scripted, one per request, and which keeps every
/// request's fingerprints; its other RPCs are not used here.
struct ScriptedLists {
    answers: Mutex<std::collections::VecDeque<pb::ListToolsResponse>>,
    named: Arc<Mutex<Vec<Vec<String>>>>,
}

fn whole_list(fingerprint: &str) -> pb::ListToolsResponse {
    pb::ListToolsResponse {
        tools: vec![pb::ToolSpec {
            name: "list_tasks".into(),
            parameters_json_schema: r#"{"type":"object"}"#.into(),
            ..Default::default()
        }],
        fingerprint: fingerprint.into(),
        unchanged: false,
    }
}

fn unchanged(fingerprint: &str) -> pb::ListToolsResponse {
    pb::ListToolsResponse {
        tools: vec![],
        fingerprint: fingerprint.into(),
        unchanged: true,
    }
}

type Unused<T> = Result<tonic::Response<T>, tonic::Status>;

fn unused<T>() -> Unused<T> {
    Err(tonic::Status::unimplemented("not scripted"))
}

#[tonic::async_trait]
impl pb::gateway_service_server::GatewayService for ScriptedLists {
    type ExecuteStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::ExecuteResponse, tonic::Status>> + Send>,
    >;

    async fn list_tools(
        &self,
        request: tonic::Request<pb::ListToolsRequest>,
    ) -> Unused<pb::ListToolsResponse> {
        self.named
            .lock()
            .unwrap()
            .push(request.into_inner().known_fingerprints);
        let answer = self.answers.lock().unwrap().pop_front().expect("scripted");
        Ok(tonic::Response::new(answer))
    }
    async fn execute(
        &self,
        _: tonic::Request<tonic::Streaming<pb::ExecuteRequest>>,
    ) -> Unused<Self::ExecuteStream> {
        unused()
    }
    async fn execute_tool(
        &self,
        _: tonic::Request<pb::ExecuteToolRequest>,
    ) -> Unused<pb::ExecuteToolResponse> {
        unused()
    }
    async fn get_bootstrap_context(
        &self,
        _: tonic::Request<pb::GetBootstrapContextRequest>,
    ) -> Unused<pb::GetBootstrapContextResponse> {
        unused()
    }
    async fn connect_account(
        &self,
        _: tonic::Request<pb::ConnectAccountRequest>,
    ) -> Unused<pb::ConnectAccountResponse> {
        unused()
    }
    async fn list_accounts(
        &self,
        _: tonic::Request<pb::ListAccountsRequest>,
    ) -> Unused<pb::ListAccountsResponse> {
        unused()
    }
    async fn disconnect_account(
        &self,
        _: tonic::Request<pb::DisconnectAccountRequest>,
    ) -> Unused<pb::DisconnectAccountResponse> {
        unused()
    }
    async fn lookup_call(
        &self,
        _: tonic::Request<pb::LookupCallRequest>,
    ) -> Unused<pb::LookupCallResponse> {
        unused()
    }
    async fn preview_call(
        &self,
        _: tonic::Request<pb::PreviewCallRequest>,
    ) -> Unused<pb::PreviewCallResponse> {
        unused()
    }
    async fn set_mcp_enabled(
        &self,
        _: tonic::Request<pb::SetMcpEnabledRequest>,
    ) -> Unused<pb::SetMcpEnabledResponse> {
        unused()
    }
}

/// Serves `answers` on loopback; the client, and what each request named.
async fn scripted_lists(
    answers: Vec<pb::ListToolsResponse>,
) -> (GatewayClient, Arc<Mutex<Vec<Vec<String>>>>) {
    let named = Arc::new(Mutex::new(Vec::new()));
    let gateway = ScriptedLists {
        answers: Mutex::new(answers.into()),
        named: named.clone(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::gateway_service_server::GatewayServiceServer::new(
                gateway,
            ))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let client = GatewayClient::connect_lazy(&format!("http://{addr}"), SERVICE_TOKEN).unwrap();
    (client, named)
}

/// Issue 13: a list the gateway calls unchanged but this replica has forgotten since naming it
/// (newer lists pushed it out) is asked for again, naming nothing; and "unchanged" to a
/// request that named nothing is refused, never taken for some list.
#[tokio::test]
async fn a_forgotten_list_answered_unchanged_is_asked_for_again() {
    let mut answers: Vec<_> = (0..=8).map(|i| whole_list(&format!("f{i}"))).collect();
    answers.push(unchanged("f0"));
    answers.push(whole_list("f0"));
    let (gateway, named) = scripted_lists(answers).await;
    for _ in 0..=8 {
        gateway.list_tools("alice", pb::Channel::Web).await.unwrap();
    }
    let list = gateway.list_tools("alice", pb::Channel::Web).await.unwrap();
    assert_eq!(list.tools[0].decl.name, "list_tasks");
    let named = named.lock().unwrap().clone();
    assert_eq!(named.len(), 11);
    assert!(
        !named[9].contains(&"f0".to_owned()),
        "f0 was pushed out: {:?}",
        named[9]
    );
    assert!(named[10].is_empty(), "asked again naming nothing");
    assert_eq!(gateway.whole_lists_received(), 10);

    let (gateway, _) = scripted_lists(vec![unchanged("f0"), unchanged("f0")]).await;
    let refused = gateway
        .list_tools("alice", pb::Channel::Web)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("named no list"), "{refused}");
}
