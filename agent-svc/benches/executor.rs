//! Executor overhead per iteration (Q-2): the whole loop machinery (request assembly, context
//! fitting with token counting, model-chain plumbing, argument parsing, event emission, result
//! capping, transcript checks) with the scripted model and an in-process tool runner, so nothing
//! but the executor's own work is measured. Target: p50 <= 250 µs per iteration.
//!
//! Run: `cargo bench -p agent-svc --bench executor`

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use agent_svc::{
    executor::{
        EventSink, Executor, ModelSetup, RunEvent, RunRequest, ToolInvocation, ToolOutcome,
        ToolRunner, limits,
    },
    llm::{
        ToolDecl, ToolSet,
        resilient::{ChainEntry, RetryPolicy},
        scripted::{ScriptedModel, Step},
    },
};

struct Discard;

impl EventSink for Discard {
    fn emit(&self, _: RunEvent) {}
}

struct InstantTools;

#[async_trait::async_trait]
impl ToolRunner for InstantTools {
    async fn run(&self, calls: Vec<ToolInvocation>) -> Vec<ToolOutcome> {
        calls
            .into_iter()
            .map(|c| ToolOutcome {
                ok: true,
                text: format!("#7 \"Call dentist\" — {}", c.args),
                error_kind: String::new(),
                truncated: false,
                external: false,
            })
            .collect()
    }
}

const ITERATIONS_PER_RUN: usize = 5;
const RUNS: usize = 2000;

#[tokio::main]
async fn main() {
    // Fifteen tools with real-looking schemas, as the gateway declares them.
    let tools: Vec<ToolDecl> = (0..15)
        .map(|i| ToolDecl {
            name: format!("tool_{i}"),
            description: "Search the user's email and return metadata only; never bodies.".into(),
            parameters: serde_json::json!({"type": "object", "properties": {
                "query": {"type": "string", "maxLength": 500}, "max_results": {"type": "integer", "minimum": 1, "maximum": 50}}}),
        })
        .collect();
    for (model_name, counter) in [
        ("claude-sonnet-4-5", "calibrated ratios"),
        ("gpt-4o", "tiktoken o200k"),
    ] {
        measure(&tools, model_name, counter).await;
    }
}

async fn measure(tools: &[ToolDecl], model_name: &str, counter: &str) {
    let tokenizer = agent_svc::executor::budget::TokenCounter::for_model(model_name);
    let sample = started_count(tokenizer, tools);
    eprintln!(
        "{model_name}: tiktoken={} tool schema tokens={} (counted in {:?})",
        matches!(
            tokenizer,
            agent_svc::executor::budget::TokenCounter::Tiktoken { .. }
        ),
        sample.0,
        sample.1
    );
    let mut per_iteration = Vec::with_capacity(RUNS);
    for run in 0..(RUNS + 100) {
        let mut steps: Vec<Step> = (0..ITERATIONS_PER_RUN - 1)
            .map(|i| {
                Step::Call(vec![(
                    format!("tool_{i}"),
                    r#"{"query":"from:boss","max_results":5}"#.into(),
                )])
            })
            .collect();
        steps.push(Step::Reply("All done.".into()));
        let model = Arc::new(ScriptedModel::new(steps));
        let executor = Executor {
            models: Arc::new(ModelSetup {
                chain: vec![ChainEntry {
                    provider: model,
                    model: "claude-sonnet-4-5".into(),
                }],
                retry: RetryPolicy::default(),
                max_output_tokens: 2048,
                context_window: 200_000,
                history_tokens: 0,
                prices: HashMap::new(),
                final_turn_grace: Duration::from_secs(10),
            }),
            max_tool_result_chars: 6000,
        };
        let request = RunRequest {
            system: "You are Steward, a chief of staff. Never fabricate data.".repeat(20),
            system_tokens: None,
            history: vec![],
            prompt: "What's on my plate?".into(),
            // As a run gets its tools: the user's list, then the prepared set equal to it.
            tools: ToolSet::shared(tools.to_vec()),
            limits: limits::profile(limits::Channel::Web, None),
            stop_after: None,
            resume: false,
            gathered: Vec::new(),
        };
        let started = Instant::now();
        let outcome = executor.run(&request, &InstantTools, &Discard).await;
        let elapsed = started.elapsed();
        assert_eq!(outcome.iterations as usize, ITERATIONS_PER_RUN);
        if run >= 100 {
            per_iteration.push(elapsed / ITERATIONS_PER_RUN as u32);
        }
    }
    per_iteration.sort();
    let pct = |p: f64| per_iteration[((per_iteration.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "executor overhead per iteration ({model_name}, tokens by {counter}; scripted model, in-process tools, 15 tool schemas): runs={RUNS} x {ITERATIONS_PER_RUN} iterations p50={:?} p99={:?}",
        pct(0.5),
        pct(0.99)
    );
    // A row of the table `bench/run.sh` prints at the end.
    println!(
        "SUMMARY\texecutor CPU per iteration p50 ({model_name}, {counter})\t{:.0} µs\t≤ 250 µs",
        pct(0.5).as_secs_f64() * 1e6
    );
}

fn started_count(
    counter: agent_svc::executor::budget::TokenCounter,
    tools: &[ToolDecl],
) -> (usize, Duration) {
    let started = Instant::now();
    let n = counter.tools(&ToolSet::new(tools.to_vec()));
    (n, started.elapsed())
}
