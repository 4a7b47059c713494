//! The tool-calling loop (E-1..E-10): model call with tool declarations → tool calls → argument
//! parsing → execution (concurrent per turn, results in call order) → results into the
//! transcript → again, until the model answers without tools, a limit, the repetition guard,
//! send_message, a budget, or a failure. Every ending produces text: a limit gets one last
//! tool-less model turn, a dead model chain gets the partial-results sentence (S0 AC-16).
//!
//! The executor depends only on traits (model chain, tool runner, event sink), so it is tested
//! without a network.

pub mod bpe;
pub mod budget;
pub mod limits;
pub mod transcript;

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use serde_json::Value;
use tokio::sync::mpsc;

use self::{budget::TokenCounter, limits::Limits, transcript::check_pairs};
use crate::llm::{
    Delta, ModelRequest, TokenUsage, ToolCall, ToolSet, Turn,
    resilient::{self, ChainEntry, RetryPolicy},
};

/// One tool call to execute, arguments already parsed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolInvocation {
    pub call_id: String,
    pub name: String,
    pub args: Value,
    /// Set by the policy, never by the model: the tools whose external content the run had
    /// read (memory provenance), and the preview binding the call must still match.
    pub read_external_from: Vec<String>,
    pub expected_binding: String,
}

/// What a tool call produced (the gateway's result, or an error made here).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutcome {
    pub ok: bool,
    pub text: String,
    /// Machine-readable kind when not ok, e.g. "RATE_LIMITED".
    pub error_kind: String,
    pub truncated: bool,
    /// The text carries words written by others (an email, an event, a memory taken from
    /// them): the run has now read untrusted content (issue 14).
    pub external: bool,
}

/// What the model reads as a call's result: what a tool returned is data (issue 14) and goes
/// in a data block; a failure is a sentence written by Steward (the policy, the gateway's
/// classified errors) and stays as it is, so the model can act on it — unless it quotes
/// another party (a remote tool's own error text), which is data like any result.
pub fn result_content(tool: &str, outcome: &ToolOutcome) -> String {
    match (outcome.ok, outcome.external) {
        (true, true) => {
            crate::fence::block(&format!("{EXTERNAL_SOURCE} from {tool}"), &outcome.text)
        }
        (true, false) => crate::fence::block(&format!("result of {tool}"), &outcome.text),
        (false, true) => crate::fence::block(
            &format!("{EXTERNAL_SOURCE} from {tool}: the call failed"),
            &outcome.text,
        ),
        (false, false) => outcome.text.clone(),
    }
}

/// The source label of results that carry others' words: a later segment reading the
/// transcript knows from it that the run has seen them.
pub const EXTERNAL_SOURCE: &str = "external content";

#[async_trait::async_trait]
pub trait ToolRunner: Send + Sync {
    /// Runs the calls concurrently; one outcome per call, in call order.
    async fn run(&self, calls: Vec<ToolInvocation>) -> Vec<ToolOutcome>;
}

/// What a run reports as it goes.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEvent {
    Planning {
        iteration: u32,
    },
    Executing {
        calls: usize,
    },
    TextDelta(String),
    ThinkingDelta(String),
    /// The model call is being retried: the partial text streamed for this turn is void.
    DeltaReset,
    /// A turn added to the transcript (persisted as LLM history as the run goes, S-4).
    Turn(Turn),
    /// A model call answered: what it cost is the run's from now on, whatever its end (E-10).
    ModelCall(CallRecord),
    ToolCall {
        call_id: String,
        name: String,
        preview: String,
        /// As parsed: an object, or (arguments that were not one) the text the model sent.
        args: Value,
    },
    ToolResult {
        call_id: String,
        name: String,
        ok: bool,
        preview: String,
        /// The whole (capped) text the model sees.
        text: String,
        error_kind: String,
        truncated: bool,
    },
}

pub trait EventSink: Send + Sync {
    fn emit(&self, event: RunEvent);

    /// The run is stopping (a cancel, a shutdown): the loop starts nothing more — no model
    /// call, no iteration — and waits to be dropped once what it has in flight is recorded.
    fn halted(&self) -> bool {
        false
    }
}

/// Per-million-token prices of one model (E-10).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Price {
    pub input: f64,
    pub output: f64,
    pub cached_input: f64,
    /// Input written to the prompt cache (Anthropic: 1.25 × input for the 5-minute cache).
    pub cache_write: f64,
}

impl Price {
    pub fn cost(&self, u: &TokenUsage) -> f64 {
        let plain = u
            .input_tokens
            .saturating_sub(u.cached_tokens)
            .saturating_sub(u.cache_write_tokens) as f64;
        (plain * self.input
            + u.cached_tokens as f64 * self.cached_input
            + u.cache_write_tokens as f64 * self.cache_write
            + u.output_tokens as f64 * self.output)
            / 1e6
    }
}

/// The models a run may use and how.
#[derive(Clone)]
pub struct ModelSetup {
    pub chain: Vec<ChainEntry>,
    pub retry: RetryPolicy,
    /// Always explicit (E-7): 2048 by default.
    pub max_output_tokens: u32,
    /// Context window of the chain's first model, in tokens.
    pub context_window: usize,
    /// AGENT_HISTORY_TOKENS: at most this many tokens of the thread's earlier turns go with a
    /// call (0: only the window limits them).
    pub history_tokens: usize,
    pub prices: HashMap<String, Price>,
    /// Extra time the final tool-less turn may take after the wall-time limit.
    pub final_turn_grace: Duration,
}

#[derive(Debug, Clone)]
pub struct RunRequest {
    pub system: String,
    /// The system text's tokens when the prompt assembler measured them already (counted
    /// here otherwise).
    pub system_tokens: Option<usize>,
    /// Earlier transcript of the thread, oldest first.
    pub history: Vec<Turn>,
    pub prompt: String,
    /// Prepared once per tool set and shared across runs (see [`ToolSet::shared`]).
    pub tools: Arc<ToolSet>,
    pub limits: Limits,
    /// A tool after which a conversational agent stops (E-4): `send_message`.
    pub stop_after: Option<String>,
    /// Continue `history` (which ends with tool results, e.g. after an approval) instead of
    /// starting a new user turn; `prompt` is then ignored.
    pub resume: bool,
    /// What the run had gathered before this call (see [`gathered`]): a continuation's
    /// approved call, which a limit's last words must not deny.
    pub gathered: Vec<String>,
}

/// A successful tool result as the run's last words quote it when a limit or a failure
/// leaves the model no turn to answer.
pub fn gathered(tool: &str, text: &str) -> String {
    format!("{tool}: {}", preview(text, GATHERED_CHARS))
}

#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// The model answered without calling tools.
    Completed,
    IterationLimit,
    TimeLimit,
    /// The same tool too many times in a row (E-3).
    Repetition,
    /// `stop_after` ran (E-4).
    SentMessage,
    /// The run's token or cost budget was used up.
    Budget,
    /// Every model of the chain failed (E-6); the text is the partial-results sentence.
    ModelUnavailable(String),
    /// The model called a tool that does not exist (E-9): the run fails.
    UnknownTool(String),
    /// A call needs the user's approval (P-1): the run pauses; the call has no result yet.
    AwaitingApproval {
        call_id: String,
        name: String,
        arguments: Value,
        reason: String,
    },
}

/// The error kind a ToolRunner answers with when policy requires approval for a call; the
/// executor then pauses the run instead of recording a result.
pub const APPROVAL_REQUIRED: &str = "APPROVAL_REQUIRED";

/// The accounting of one model call.
#[derive(Debug, Clone, PartialEq)]
pub struct CallRecord {
    pub provider: String,
    pub model: String,
    pub usage: TokenUsage,
    pub cost_usd: f64,
    pub latency: Duration,
    pub retries: u32,
    /// When its successful attempt was sent (`latency` is that attempt's too).
    pub started_at: SystemTime,
}

impl CallRecord {
    /// A call that answered, priced from `prices` and counted in the model metrics.
    pub fn answered(done: &resilient::Completed, prices: &HashMap<String, Price>) -> Self {
        let price = prices.get(&done.model).copied().unwrap_or_default();
        let cost_usd = price.cost(&done.response.usage);
        crate::metrics::model_call(
            &done.provider,
            &done.model,
            &done.response.usage,
            cost_usd,
            done.latency,
        );
        Self {
            provider: done.provider.clone(),
            model: done.model.clone(),
            usage: done.response.usage,
            cost_usd,
            latency: done.latency,
            retries: done.retries,
            started_at: done.started_at,
        }
    }

    /// A try cut before it answered, which the provider may still bill: its input estimated
    /// as `input_tokens` (what was sent), its output as none (what it wrote never arrived).
    pub fn cut(cut: &resilient::Cut, input_tokens: u64, prices: &HashMap<String, Price>) -> Self {
        let usage = TokenUsage {
            input_tokens,
            ..TokenUsage::default()
        };
        let price = prices.get(&cut.model).copied().unwrap_or_default();
        let cost_usd = price.cost(&usage);
        crate::metrics::model_spend(&cut.provider, &cut.model, &usage, cost_usd);
        Self {
            provider: cut.provider.clone(),
            model: cut.model.clone(),
            usage,
            cost_usd,
            latency: cut.latency,
            retries: 0,
            started_at: cut.started_at,
        }
    }
}

/// Whether a call answered without reporting its input usage: what [`estimate_unreported`]
/// counts, and so what a call's input must be counted for.
fn unreported(done: &resilient::Completed) -> bool {
    done.response.usage.input_tokens == 0
}

/// A call that answered without reporting its usage (a compatible server that ignores
/// stream_options, a stream cut after its answer) was billed all the same, and the run's
/// budget must still see it: counted with the tokenizer instead, what the provider did not
/// count — `input_tokens` as sent, the output from what came back.
pub fn estimate_unreported(
    done: &mut resilient::Completed,
    input_tokens: usize,
    counter: TokenCounter,
) {
    if !unreported(done) {
        return;
    }
    let response = &mut done.response;
    response.usage.input_tokens = input_tokens as u64;
    if response.usage.output_tokens == 0 {
        let output = counter.text(&response.text)
            + response
                .tool_calls
                .iter()
                .map(|c| counter.text(&c.name) + counter.text(&c.arguments))
                .sum::<usize>();
        response.usage.output_tokens = output as u64;
    }
    tracing::warn!(
        provider = %done.provider,
        model = %done.model,
        input_tokens = response.usage.input_tokens,
        output_tokens = response.usage.output_tokens,
        "the model reported no input usage; counted it instead"
    );
}

#[derive(Debug, Clone)]
pub struct Outcome {
    /// What the user reads. Never empty.
    pub text: String,
    /// True when the model's own final text was empty and `text` is a fallback (E-5).
    pub model_text_empty: bool,
    pub stop: Stop,
    /// The turns this run added (its user turn first).
    pub new_turns: Vec<Turn>,
    pub calls: Vec<CallRecord>,
    pub iterations: u32,
    /// The last tool the run executed, with its arguments.
    pub last_tool: Option<(String, Value)>,
    /// The model's call id of that tool call.
    pub last_tool_call: Option<String>,
}

impl Outcome {
    pub fn cost_usd(&self) -> f64 {
        self.calls.iter().map(|c| c.cost_usd).sum()
    }
}

/// S0 AC-16, word for word.
pub fn trouble_connecting(gathered: &[String]) -> String {
    let partial = if gathered.is_empty() {
        "nothing yet.".to_owned()
    } else {
        gathered.join("\n")
    };
    format!("I'm having trouble connecting right now. Here's what I was able to gather: {partial}")
}

const PREVIEW_CHARS: usize = 200;

/// A fresh tool-call id that every provider accepts (letters, digits, `_`; ≤ 40 chars).
pub fn new_call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}
/// How much of each tool result the fallback texts quote.
const GATHERED_CHARS: usize = 500;

fn preview(s: &str, n: usize) -> String {
    let mut p: String = s.chars().take(n).collect();
    if p.len() < s.len() {
        p.push('…');
    }
    p
}

pub struct Executor {
    pub models: Arc<ModelSetup>,
    /// MAX_TOOL_RESULT_CHARS: the gateway caps results already; this is defence in depth so no
    /// runner can put an uncapped result into the transcript (S4 fix 3).
    pub max_tool_result_chars: usize,
}

struct Run<'a> {
    models: &'a ModelSetup,
    max_tool_result_chars: usize,
    req: &'a RunRequest,
    sink: &'a dyn EventSink,
    started: Instant,
    turns: Vec<Turn>,
    /// Each turn's bound as it joins `turns`, and its tokens once a fit needs them.
    sizes: budget::TurnSizes,
    counter: TokenCounter,
    system_tokens: usize,
    history_len: usize,
    gathered: Vec<String>,
    calls: Vec<CallRecord>,
    iterations: u32,
    last_tool: Option<(String, Value)>,
    last_tool_call: Option<String>,
}

impl Executor {
    pub async fn run(
        &self,
        req: &RunRequest,
        tools: &dyn ToolRunner,
        sink: &dyn EventSink,
    ) -> Outcome {
        let mut turns = req.history.clone();
        let history_len = turns.len();
        if !req.resume {
            turns.push(Turn::User(req.prompt.clone()));
        }
        let first_model = self.models.chain.first().map_or("", |e| e.model.as_str());
        let counter = TokenCounter::for_model(first_model);
        let sizes = budget::TurnSizes::of(&turns);
        let mut run = Run {
            models: &self.models,
            max_tool_result_chars: self.max_tool_result_chars,
            req,
            sink,
            started: Instant::now(),
            turns,
            sizes,
            counter,
            system_tokens: req
                .system_tokens
                .unwrap_or_else(|| counter.text(&req.system)),
            history_len,
            gathered: req.gathered.clone(),
            calls: Vec::new(),
            iterations: 0,
            last_tool: None,
            last_tool_call: None,
        };
        run.go(tools).await
    }
}

enum Step {
    Continue,
    Done(Box<Outcome>),
}

impl Run<'_> {
    async fn go(&mut self, tools: &dyn ToolRunner) -> Outcome {
        let mut same_tool: (String, u32) = (String::new(), 0);
        loop {
            let limits = &self.req.limits;
            if self.iterations >= limits.max_iterations {
                return self.final_turn(Stop::IterationLimit).await;
            }
            if self.started.elapsed() >= limits.max_wall {
                return self.final_turn(Stop::TimeLimit).await;
            }
            if self.over_budget() {
                return self.final_turn(Stop::Budget).await;
            }
            // One span per iteration (O-2): the model call and the tool calls it made sit
            // under it in a trace, numbered as the run's Planning events are.
            let span = tracing::info_span!("iteration", n = self.iterations + 1);
            match tracing::Instrument::instrument(self.iteration(tools, &mut same_tool), span).await
            {
                Step::Continue => {}
                Step::Done(outcome) => return *outcome,
            }
        }
    }

    fn over_budget(&self) -> bool {
        let usage = self
            .calls
            .iter()
            .map(|c| c.usage.input_tokens + c.usage.output_tokens)
            .sum::<u64>();
        let cost: f64 = self.calls.iter().map(|c| c.cost_usd).sum();
        self.req
            .limits
            .max_total_tokens
            .is_some_and(|max| usage >= max)
            || self.req.limits.max_cost_usd.is_some_and(|max| cost >= max)
    }

    async fn iteration(&mut self, tools: &dyn ToolRunner, same_tool: &mut (String, u32)) -> Step {
        self.wait_if_halted().await;
        self.iterations += 1;
        self.sink.emit(RunEvent::Planning {
            iteration: self.iterations,
        });
        let remaining = self
            .req
            .limits
            .max_wall
            .saturating_sub(self.started.elapsed());
        let req = self.req;
        let response = match self.call_model(&req.tools, false, "", remaining).await {
            Ok(Some(r)) => r,
            Ok(None) => return Step::Done(Box::new(self.final_turn(Stop::TimeLimit).await)),
            Err(failed) => {
                let text = trouble_connecting(&self.gathered);
                return Step::Done(Box::new(self.finish(
                    text,
                    false,
                    Stop::ModelUnavailable(failed),
                )));
            }
        };
        if response.tool_calls.is_empty() {
            let text = response.text.trim().to_owned();
            self.push(Turn::Assistant {
                text: text.clone(),
                tool_calls: vec![],
            });
            return Step::Done(Box::new(self.answer(text, Stop::Completed)));
        }
        // Providers' ids repeat across turns (or are empty): every call gets its own, so
        // actions and side-effect idempotency keys (run id + call id) can never collide.
        let calls: Vec<ToolCall> = response
            .tool_calls
            .iter()
            .map(|c| ToolCall {
                id: new_call_id(),
                ..c.clone()
            })
            .collect();
        self.push(Turn::Assistant {
            text: response.text.clone(),
            tool_calls: calls.clone(),
        });

        // E-9: an unknown tool ends the run as failed; every call still gets its result.
        if let Some(unknown) = calls
            .iter()
            .find(|c| !self.req.tools.iter().any(|t| t.name == c.name))
        {
            let name = unknown.name.clone();
            for c in &calls {
                self.push(Turn::ToolResult {
                    call_id: c.id.clone(),
                    name: c.name.clone(),
                    content: format!(
                        "Not executed: the run stopped because there is no tool named {name:?}."
                    ),
                    is_error: true,
                });
            }
            let text =
                format!("I tried to use a tool that doesn't exist ({name}), so I stopped here.");
            return Step::Done(Box::new(self.finish(text, false, Stop::UnknownTool(name))));
        }

        let outcomes = self.execute(tools, &calls).await;
        if let Some((call, outcome)) = calls
            .iter()
            .zip(&outcomes)
            .find(|(_, o)| o.error_kind == APPROVAL_REQUIRED)
        {
            let arguments = serde_json::from_str(&call.arguments).unwrap_or(Value::Null);
            let stop = Stop::AwaitingApproval {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments,
                reason: outcome.text.clone(),
            };
            let text = format!(
                "This needs your approval before I go ahead: {} ({}).",
                call.name, outcome.text
            );
            return Step::Done(Box::new(self.finish(text, false, stop)));
        }
        for (call, outcome) in calls.iter().zip(&outcomes) {
            if outcome.ok {
                self.gathered.push(gathered(&call.name, &outcome.text));
            }
            if same_tool.0 == call.name {
                same_tool.1 += 1;
            } else {
                *same_tool = (call.name.clone(), 1);
            }
        }
        if let Some(stop_tool) = &self.req.stop_after
            && let Some((call, _)) = calls
                .iter()
                .zip(&outcomes)
                .find(|(c, o)| &c.name == stop_tool && o.ok)
        {
            let args: Value = serde_json::from_str(&call.arguments).unwrap_or(Value::Null);
            let text = ["message", "text", "content"]
                .iter()
                .find_map(|k| args.get(*k).and_then(Value::as_str))
                .unwrap_or_default()
                .to_owned();
            return Step::Done(Box::new(self.answer(text, Stop::SentMessage)));
        }
        if same_tool.1 >= self.req.limits.max_same_tool_consecutive {
            return Step::Done(Box::new(self.final_turn(Stop::Repetition).await));
        }
        Step::Continue
    }

    /// Parses arguments, runs the valid calls, and records every call's result in order.
    async fn execute(&mut self, tools: &dyn ToolRunner, calls: &[ToolCall]) -> Vec<ToolOutcome> {
        let mut outcomes: Vec<Option<ToolOutcome>> = vec![None; calls.len()];
        let mut invocations = Vec::new();
        let mut positions = Vec::new();
        for (i, call) in calls.iter().enumerate() {
            let raw = if call.arguments.trim().is_empty() {
                "{}"
            } else {
                call.arguments.as_str()
            };
            match serde_json::from_str::<Value>(raw) {
                Ok(args) if args.is_object() => {
                    self.sink.emit(RunEvent::ToolCall {
                        call_id: call.id.clone(),
                        name: call.name.clone(),
                        preview: preview(raw, PREVIEW_CHARS),
                        args: args.clone(),
                    });
                    self.last_tool = Some((call.name.clone(), args.clone()));
                    self.last_tool_call = Some(call.id.clone());
                    invocations.push(ToolInvocation {
                        call_id: call.id.clone(),
                        name: call.name.clone(),
                        args,
                        ..ToolInvocation::default()
                    });
                    positions.push(i);
                }
                // S4 failure mode 6: malformed JSON goes back to the model as a result it can fix.
                parsed => {
                    let why = match parsed {
                        Err(e) => format!("were not valid JSON ({e})"),
                        Ok(_) => "were not a JSON object".to_owned(),
                    };
                    // A call all the same: watchers see it before its failed result, and
                    // the run's actions keep what the model sent, as text, failed.
                    self.sink.emit(RunEvent::ToolCall {
                        call_id: call.id.clone(),
                        name: call.name.clone(),
                        preview: preview(raw, PREVIEW_CHARS),
                        args: Value::String(raw.to_owned()),
                    });
                    self.last_tool = Some((call.name.clone(), Value::String(raw.to_owned())));
                    self.last_tool_call = Some(call.id.clone());
                    outcomes[i] = Some(ToolOutcome {
                        ok: false,
                        text: format!(
                            "Your arguments for {} {why}. Call {} again with a valid JSON object.",
                            call.name, call.name
                        ),
                        error_kind: "INVALID_ARGUMENTS".into(),
                        truncated: false,
                        external: false,
                    });
                }
            }
        }
        if !invocations.is_empty() {
            self.sink.emit(RunEvent::Executing {
                calls: invocations.len(),
            });
            let results = tools.run(invocations).await;
            for (pos, mut result) in positions.into_iter().zip(results) {
                let capped = svc_kit::text::cap_text(
                    std::mem::take(&mut result.text),
                    self.max_tool_result_chars,
                );
                result.text = capped.text;
                result.truncated |= capped.truncated;
                outcomes[pos] = Some(result);
            }
        }
        let outcomes: Vec<ToolOutcome> = outcomes
            .into_iter()
            .map(|o| {
                // A runner that answered fewer calls than asked must not leave a call unanswered.
                o.unwrap_or(ToolOutcome {
                    ok: false,
                    text: "The tool did not answer.".into(),
                    error_kind: "INTERNAL".into(),
                    truncated: false,
                    external: false,
                })
            })
            .collect();
        for (call, outcome) in calls.iter().zip(&outcomes) {
            if outcome.error_kind == APPROVAL_REQUIRED {
                // No result yet: the approval decides what it will be.
                continue;
            }
            self.sink.emit(RunEvent::ToolResult {
                call_id: call.id.clone(),
                name: call.name.clone(),
                ok: outcome.ok,
                preview: preview(&outcome.text, PREVIEW_CHARS),
                text: outcome.text.clone(),
                error_kind: outcome.error_kind.clone(),
                truncated: outcome.truncated,
            });
            self.push(Turn::ToolResult {
                call_id: call.id.clone(),
                name: call.name.clone(),
                content: result_content(&call.name, outcome),
                is_error: !outcome.ok,
            });
        }
        outcomes
    }

    /// A halted run never resolves from here: its owner drops it (a model request begun now
    /// could be billed and would never be counted).
    async fn wait_if_halted(&self) {
        if self.sink.halted() {
            std::future::pending::<()>().await;
        }
    }

    /// One model call within `remaining` time: `Ok(None)` when the time ran out, `Err` with the
    /// attempts when every model failed.
    async fn call_model(
        &mut self,
        tools: &ToolSet,
        answer_only: bool,
        system_suffix: &str,
        remaining: Duration,
    ) -> Result<Option<crate::llm::ModelResponse>, String> {
        self.wait_if_halted().await;
        let models = self.models;
        let counter = self.counter;
        let (system, system_tokens) = if system_suffix.is_empty() {
            (
                std::borrow::Cow::Borrowed(self.req.system.as_str()),
                self.system_tokens,
            )
        } else {
            (
                std::borrow::Cow::Owned(format!("{}{system_suffix}", self.req.system)),
                self.system_tokens + counter.text(system_suffix),
            )
        };
        if system_tokens > budget::SYSTEM_PROMPT_WARN_TOKENS {
            tracing::warn!(
                system_tokens,
                "assembled system prompt is over 50K estimated tokens"
            );
        }
        let fixed = system_tokens + counter.tools(tools);
        let fit = self.sizes.fit(
            &self.turns,
            counter,
            fixed,
            budget::Budget {
                window: models.context_window,
                reserve_output: models.max_output_tokens as usize,
                history: models.history_tokens,
            },
        );
        if fit.window_full {
            // Routine for the history limit; a full context window is worth knowing about.
            tracing::info!(
                evicted = fit.evicted_turns,
                tokens = fit.estimated_input_tokens,
                "evicted old history to fit the context window"
            );
        } else if fit.evicted_turns > 0 {
            tracing::debug!(
                evicted = fit.evicted_turns,
                tokens = fit.estimated_input_tokens,
                "older history left out for the history limit"
            );
        }
        // Rare (the current turn alone is over the window): a copy with older results elided.
        let sent: std::borrow::Cow<'_, [Turn]> = if fit.elided_results.is_empty() {
            std::borrow::Cow::Borrowed(&self.turns[fit.evicted_turns..])
        } else {
            tracing::warn!(
                elided = fit.elided_results.len(),
                tokens = fit.estimated_input_tokens,
                "the current turn is over the context window; older tool results left out"
            );
            let mut turns = self.turns[fit.evicted_turns..].to_vec();
            for i in &fit.elided_results {
                if let Some(Turn::ToolResult { content, name, .. }) =
                    turns.get_mut(i - fit.evicted_turns)
                {
                    *content = budget::elided_result(name);
                }
            }
            std::borrow::Cow::Owned(turns)
        };
        let request = ModelRequest {
            model: "",
            system: &system,
            turns: &sent,
            tools,
            answer_only,
            stable_turns: self.history_len.saturating_sub(fit.evicted_turns),
            max_output_tokens: models.max_output_tokens,
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let call = async move {
            let result =
                resilient::complete(&models.chain, &models.retry, &request, &tx, remaining).await;
            drop(tx);
            result
        };
        let sink = self.sink;
        let streamed = std::sync::atomic::AtomicBool::new(false);
        let forward = async {
            while let Some(delta) = rx.recv().await {
                streamed.store(true, std::sync::atomic::Ordering::Relaxed);
                sink.emit(match delta {
                    Delta::Text(t) => RunEvent::TextDelta(t),
                    Delta::Thinking(t) => RunEvent::ThinkingDelta(t),
                    Delta::Reset => RunEvent::DeltaReset,
                });
            }
        };
        let timed = tokio::time::timeout(remaining, async { tokio::join!(call, forward).0 }).await;
        if !matches!(timed, Ok(Ok(_))) && streamed.into_inner() {
            // What streamed of an answer that never finished is void: the client discards it
            // before the run's last words (a final turn or the fallback) arrive.
            self.sink.emit(RunEvent::DeltaReset);
        }
        let cut = match &timed {
            Ok(Ok(done)) => done.cut.as_slice(),
            Ok(Err(failed)) => failed.cut.as_slice(),
            Err(_) => &[],
        };
        // What the call's input counts to, counted only where the fit did not, and only for
        // what needs it: a try cut short, or an answer that did not report its usage.
        let needed = !cut.is_empty()
            || matches!(&timed, Ok(Ok(done)) if unreported(done) || done.passed_over.iter().any(unreported));
        let input_tokens = match fit.estimated_input_tokens {
            Some(n) => n,
            None if needed => self.sizes.input_tokens(&self.turns, counter, fixed),
            None => 0,
        };
        for cut in cut {
            let record = CallRecord::cut(cut, input_tokens as u64, &models.prices);
            self.sink.emit(RunEvent::ModelCall(record.clone()));
            self.calls.push(record);
        }
        match timed {
            Err(_) => Ok(None),
            // The chain shares out the same time, so its last try can end with the time
            // itself: that is the time limit, not every model failing.
            Ok(Err(failed)) if failed.out_of_time => Ok(None),
            Ok(Err(failed)) => Err(failed.to_string()),
            Ok(Ok(mut done)) => {
                estimate_unreported(&mut done, input_tokens, counter);
                // Answers passed over for the next model were billed all the same.
                for mut passed in std::mem::take(&mut done.passed_over) {
                    estimate_unreported(&mut passed, input_tokens, counter);
                    let record = CallRecord::answered(&passed, &models.prices);
                    self.sink.emit(RunEvent::ModelCall(record.clone()));
                    self.calls.push(record);
                }
                let record = CallRecord::answered(&done, &models.prices);
                self.sink.emit(RunEvent::ModelCall(record.clone()));
                self.calls.push(record);
                Ok(Some(done.response))
            }
        }
    }

    /// One last model turn without tools, answering from what was gathered (E-2: a limit never
    /// means an empty answer). Falls back to the gathered results if even that fails.
    async fn final_turn(&mut self, stop: Stop) -> Outcome {
        let reason = match stop {
            Stop::IterationLimit => "the step limit for this request",
            Stop::TimeLimit => "the time limit for this request",
            Stop::Repetition => "repeated calls to the same tool",
            Stop::Budget => "the token or cost budget for this run",
            _ => "a limit",
        };
        let suffix = format!(
            "\n\n[LIMIT REACHED] Tools are no longer available because of {reason}. Answer the user now, \
             using only the information already gathered above. Say what you could not finish."
        );
        if stop != Stop::Budget {
            let remaining = self
                .req
                .limits
                .max_wall
                .saturating_sub(self.started.elapsed())
                .max(self.models.final_turn_grace);
            // The run's tools, declared but not callable: Anthropic refuses tool blocks in a
            // transcript without them, and they are its cached prefix.
            let req = self.req;
            if let Ok(Some(response)) = self.call_model(&req.tools, true, &suffix, remaining).await
            {
                let text = response.text.trim().to_owned();
                if !text.is_empty() {
                    self.push(Turn::Assistant {
                        text: text.clone(),
                        tool_calls: vec![],
                    });
                    return self.finish(text, false, stop);
                }
            }
        }
        let text = if self.gathered.is_empty() {
            format!("I stopped because of {reason} before I could gather anything.")
        } else {
            format!(
                "I stopped because of {reason}. Here's what I was able to gather:\n{}",
                self.gathered.join("\n")
            )
        };
        self.push(Turn::Assistant {
            text: text.clone(),
            tool_calls: vec![],
        });
        self.finish(text, true, stop)
    }

    /// A model answer; an empty one is replaced by what was gathered (E-5).
    fn answer(&mut self, text: String, stop: Stop) -> Outcome {
        if !text.is_empty() {
            return self.finish(text, false, stop);
        }
        tracing::error!("the model returned an empty answer");
        let fallback = if self.gathered.is_empty() {
            "I couldn't put an answer together this time. Please try again.".to_owned()
        } else {
            format!(
                "I couldn't put an answer together, but here's what I gathered:\n{}",
                self.gathered.join("\n")
            )
        };
        self.finish(fallback, true, stop)
    }

    fn push(&mut self, turn: Turn) {
        self.sink.emit(RunEvent::Turn(turn.clone()));
        self.sizes.push(&turn);
        self.turns.push(turn);
    }

    fn finish(&mut self, text: String, model_text_empty: bool, stop: Stop) -> Outcome {
        let paused = matches!(stop, Stop::AwaitingApproval { .. });
        if let Err(broken) = check_pairs(&self.turns)
            && !paused
        {
            // A bug, not a user error: the transcript would be rejected by providers.
            tracing::error!(%broken, "transcript invariant violated");
        }
        Outcome {
            text,
            model_text_empty,
            stop,
            new_turns: self.turns[self.history_len..].to_vec(),
            calls: std::mem::take(&mut self.calls),
            iterations: self.iterations,
            last_tool: self.last_tool.clone(),
            last_tool_call: self.last_tool_call.clone(),
        }
    }
}
