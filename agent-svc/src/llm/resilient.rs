//! The retry and fallback chain (E-6, L-3, S0 AC-19): each (provider, model) entry gets the
//! call plus up to `retries` retries on retriable errors, with exponential backoff and full
//! jitter that waits at least as long as the provider's Retry-After; then the next entry.
//! The whole chain runs within the time its caller has left: each entry gets a share of it,
//! so a model that hangs never takes the fallback's turn.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use super::{Delta, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse};

#[derive(Clone)]
pub struct ChainEntry {
    pub provider: Arc<dyn ModelProvider>,
    pub model: String,
}

#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Retries per chain entry after the first try (2 by default, set explicitly).
    pub retries: u32,
    pub base_backoff: Duration,
    pub max_backoff: Duration,
    /// A Retry-After longer than this is not waited for; the next entry is tried instead.
    pub max_retry_after: Duration,
    /// One call's deadline.
    pub call_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            retries: 2,
            base_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(10),
            max_retry_after: Duration::from_secs(60),
            call_timeout: super::DEFAULT_CALL_TIMEOUT,
        }
    }
}

/// A successful call and what it took.
#[derive(Debug, Clone)]
pub struct Completed {
    pub response: ModelResponse,
    pub provider: String,
    pub model: String,
    /// Retries spent on the entry that succeeded.
    pub retries: u32,
    /// The successful attempt's, like `started_at`.
    pub latency: Duration,
    /// When the successful attempt was sent.
    pub started_at: std::time::SystemTime,
    /// Earlier entries' answers that said nothing (see [`said_nothing`]): billed, so counted,
    /// but passed over for the next entry.
    pub passed_over: Vec<Completed>,
    /// Tries cut before they answered (see [`Cut`]).
    pub cut: Vec<Cut>,
}

/// A try the provider may have billed though it never answered: one that timed out, or whose
/// stream was cut or ended in a call the model could not finish. The provider read the whole
/// prompt, and its usage never arrived, so the caller estimates it.
#[derive(Debug, Clone)]
pub struct Cut {
    pub provider: String,
    pub model: String,
    pub started_at: std::time::SystemTime,
    pub latency: Duration,
}

/// Why an answer with no text and no calls is worth another entry's try: the provider blocked
/// the prompt (Gemini's `blocked:` reason, OpenAI's `content_filter`, Anthropic's `refusal`)
/// or a reasoning model spent its whole output on thinking (`length`, `max_tokens`). Another
/// model may well answer; the same one, asked again, would not. Any other empty answer stands
/// (the run answers with what it gathered, E-5).
fn said_nothing(response: &ModelResponse) -> Option<&str> {
    let why = response.stop_reason.as_str();
    let unusable = why.starts_with("blocked:")
        || matches!(
            why,
            "content_filter" | "refusal" | "length" | "max_tokens" | "MAX_TOKENS"
        );
    (unusable && response.text.trim().is_empty() && response.tool_calls.is_empty()).then_some(why)
}

/// Every entry failed; `attempts` says how, in order.
#[derive(Debug, Clone, thiserror::Error)]
#[error("every model failed: {}", attempts.join("; "))]
pub struct ChainFailed {
    pub attempts: Vec<String>,
    /// Tries cut before they answered (see [`Cut`]).
    pub cut: Vec<Cut>,
    /// The time given ran out: the last entry's try was cut by it, or never made. That is the
    /// caller's time limit, not every model failing.
    pub out_of_time: bool,
}

/// What the chain keeps back for each entry after the one trying, at most: enough for a
/// fallback to answer a short turn. Never more than a third of the time left, so a primary
/// that is slow but healthy keeps most of the run's time (50 s of a 60 s turn with one
/// fallback) and is not cut for a weaker model.
const FALLBACK_TIME: Duration = Duration::from_secs(10);

/// The request through the chain, within `within`: each entry's tries, then the next entry's,
/// until one answers or the time is spent.
pub async fn complete(
    chain: &[ChainEntry],
    policy: &RetryPolicy,
    request: &ModelRequest<'_>,
    deltas: &DeltaSink,
    within: Duration,
) -> Result<Completed, ChainFailed> {
    let deadline = tokio::time::Instant::now() + within;
    let mut attempts = Vec::new();
    let mut out_of_time = false;
    let mut passed_over = Vec::new();
    let mut cut = Vec::new();
    for (i, entry) in chain.iter().enumerate() {
        if i > 0 {
            crate::metrics::model_fallback(entry.provider.name(), &entry.model);
        }
        // The caller's time is shared out: an entry that hangs, or asks to be retried later
        // than its share allows, leaves the rest of the chain its turn before the run's time
        // runs out. The last entry has whatever is left.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            attempts.push(format!(
                "{}/{}: not tried, no time left",
                entry.provider.name(),
                entry.model
            ));
            out_of_time = true;
            continue;
        }
        let after = (chain.len() - i - 1) as u32;
        let kept_back = (FALLBACK_TIME * after).min(left / 3);
        let entry_deadline = tokio::time::Instant::now() + (left - kept_back);
        let request = ModelRequest {
            model: &entry.model,
            ..*request
        };
        let mut retry = 0;
        loop {
            if !attempts.is_empty() {
                // A failed attempt may have streamed part of its answer: the client discards it.
                let _ = deltas.send(Delta::Reset);
            }
            let started = Instant::now();
            let started_at = std::time::SystemTime::now();
            let span = tracing::info_span!(
                "model_call",
                otel.name = "model_call",
                provider = entry.provider.name(),
                model = %entry.model,
                retry,
            );
            let timeout = policy
                .call_timeout
                .min(entry_deadline.saturating_duration_since(tokio::time::Instant::now()));
            let result = match tracing::Instrument::instrument(
                tokio::time::timeout(timeout, entry.provider.complete(&request, deltas)),
                span,
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(ModelError::Timeout),
            };
            match result {
                Ok(response) => {
                    let done = Completed {
                        response,
                        provider: entry.provider.name().to_owned(),
                        model: entry.model.clone(),
                        retries: retry,
                        latency: started.elapsed(),
                        started_at,
                        passed_over: Vec::new(),
                        cut: Vec::new(),
                    };
                    // The last entry's answer stands, whatever it is: an answer, even an
                    // empty one, is the run's to handle, not a failure to connect.
                    if i + 1 < chain.len()
                        && let Some(why) = said_nothing(&done.response)
                    {
                        tracing::warn!(provider = entry.provider.name(), model = %entry.model, stop_reason = why, "the model answered nothing; asking the next");
                        attempts.push(format!(
                            "{}/{}: answered nothing ({why})",
                            entry.provider.name(),
                            entry.model
                        ));
                        passed_over.push(done);
                        break;
                    }
                    return Ok(Completed {
                        passed_over,
                        cut,
                        ..done
                    });
                }
                Err(e) => {
                    tracing::warn!(provider = entry.provider.name(), model = %entry.model, retry, error = %e, detail = e.detail(), "model call failed");
                    out_of_time =
                        e == ModelError::Timeout && tokio::time::Instant::now() >= deadline;
                    attempts.push(format!("{}/{}: {e}", entry.provider.name(), entry.model));
                    if e.may_be_billed() {
                        cut.push(Cut {
                            provider: entry.provider.name().to_owned(),
                            model: entry.model.clone(),
                            started_at,
                            latency: started.elapsed(),
                        });
                    }
                    crate::metrics::model_failed(entry.provider.name(), &entry.model);
                    let wait = backoff(policy, retry, e.retry_after());
                    let in_time =
                        wait.is_some_and(|w| tokio::time::Instant::now() + w < entry_deadline);
                    if !e.is_retriable() || retry >= policy.retries || !in_time {
                        break;
                    }
                    tokio::time::sleep(wait.unwrap_or_default()).await;
                    crate::metrics::model_retry(entry.provider.name(), &entry.model);
                    retry += 1;
                }
            }
        }
    }
    // Every later entry failed: an answer passed over still stands, as it would have alone
    // (the run answers from what it gathered, E-5), and keeps its bill.
    if let Some(said_nothing) = passed_over.pop() {
        return Ok(Completed {
            passed_over,
            cut,
            ..said_nothing
        });
    }
    Err(ChainFailed {
        attempts,
        cut,
        out_of_time,
    })
}

/// How long to wait before retry number `retry + 1`: exponential with full jitter, never less
/// than Retry-After; `None` when Retry-After asks for longer than the policy allows.
fn backoff(policy: &RetryPolicy, retry: u32, retry_after: Option<Duration>) -> Option<Duration> {
    let exp = policy
        .base_backoff
        .saturating_mul(1 << retry.min(16))
        .min(policy.max_backoff);
    let jittered = exp.mul_f64(rand::random::<f64>());
    match retry_after {
        Some(after) if after > policy.max_retry_after => None,
        Some(after) => Some(after.max(jittered)),
        None => Some(jittered),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ModelResponse, ToolSet};

    /// A provider that answers `behaviour` to every call.
    struct Provider {
        name: &'static str,
        behaviour: Behaviour,
        calls: std::sync::atomic::AtomicU32,
    }

    enum Behaviour {
        /// Accepts the call and never answers.
        Hangs,
        /// Rate-limited, asking to come back in 30 s.
        RateLimited,
        /// Refuses the request (400): not worth a retry.
        Refuses,
        Answers,
        /// Answers nothing, for this reason.
        SaysNothing(&'static str),
    }

    #[async_trait::async_trait]
    impl ModelProvider for Provider {
        fn name(&self) -> &str {
            self.name
        }

        async fn complete(
            &self,
            _request: &ModelRequest,
            _deltas: &DeltaSink,
        ) -> Result<ModelResponse, ModelError> {
            self.calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match self.behaviour {
                Behaviour::Hangs => std::future::pending().await,
                Behaviour::RateLimited => Err(ModelError::Status {
                    status: 429,
                    detail: String::new(),
                    retry_after: Some(Duration::from_secs(30)),
                }),
                Behaviour::Refuses => Err(ModelError::Status {
                    status: 400,
                    detail: String::new(),
                    retry_after: None,
                }),
                Behaviour::Answers => Ok(ModelResponse {
                    text: format!("{} answered", self.name),
                    thinking: String::new(),
                    tool_calls: Vec::new(),
                    usage: Default::default(),
                    stop_reason: "stop".into(),
                }),
                Behaviour::SaysNothing(why) => Ok(ModelResponse {
                    text: String::new(),
                    thinking: "so much to think about".into(),
                    tool_calls: Vec::new(),
                    usage: crate::llm::TokenUsage {
                        input_tokens: 120,
                        output_tokens: 4000,
                        ..Default::default()
                    },
                    stop_reason: why.into(),
                }),
            }
        }
    }

    fn entry(name: &'static str, behaviour: Behaviour) -> (ChainEntry, Arc<Provider>) {
        let provider = Arc::new(Provider {
            name,
            behaviour,
            calls: Default::default(),
        });
        let entry = ChainEntry {
            provider: provider.clone(),
            model: "m".into(),
        };
        (entry, provider)
    }

    /// A request through `chain` within `within`, under the default policy (120 s per call,
    /// Retry-After up to 60 s waited for).
    async fn through(chain: &[ChainEntry], within: Duration) -> Result<Completed, ChainFailed> {
        let tools = ToolSet::default();
        let request = ModelRequest {
            model: "",
            system: "s",
            turns: &[],
            tools: &tools,
            answer_only: true,
            stable_turns: 0,
            max_output_tokens: 10,
        };
        let (deltas, _rx) = tokio::sync::mpsc::unbounded_channel();
        complete(chain, &RetryPolicy::default(), &request, &deltas, within).await
    }

    /// A chain of `first` then a healthy fallback, given `within`: how long it took, what
    /// answered, and how often the first entry was called.
    async fn chain_of(first: Behaviour, within: Duration) -> (Duration, String, u32) {
        let (primary, first_calls) = entry("primary", first);
        let (fallback, _) = entry("fallback", Behaviour::Answers);
        let started = tokio::time::Instant::now();
        let done = through(&[primary, fallback], within)
            .await
            .expect("the fallback answers");
        let calls = first_calls.calls.load(std::sync::atomic::Ordering::Relaxed);
        (started.elapsed(), done.response.text, calls)
    }

    #[tokio::test(start_paused = true)]
    async fn l3_a_model_that_hangs_leaves_the_fallback_its_turn_within_the_runs_time() {
        let (took, answer, _) = chain_of(Behaviour::Hangs, Duration::from_secs(60)).await;
        assert_eq!(answer, "fallback answered");
        assert_eq!(
            took,
            Duration::from_secs(50),
            "all but the fallback's 10 s, not 120 s per call"
        );
        let (took, answer, _) = chain_of(Behaviour::Hangs, Duration::from_secs(15)).await;
        assert_eq!(answer, "fallback answered");
        assert_eq!(
            took,
            Duration::from_secs(10),
            "a third kept back of a short turn"
        );
    }

    /// The chain of `behaviours` within 15 s: whether its failure says the time ran out.
    async fn failed_out_of_time(behaviours: Vec<Behaviour>) -> bool {
        let chain: Vec<ChainEntry> = behaviours.into_iter().map(|b| entry("m", b).0).collect();
        through(&chain, Duration::from_secs(15))
            .await
            .expect_err("no entry answers")
            .out_of_time
    }

    #[tokio::test(start_paused = true)]
    async fn e6_a_chain_that_fails_says_whether_the_time_ran_out_or_every_model_failed() {
        assert!(failed_out_of_time(vec![Behaviour::Refuses, Behaviour::Hangs]).await);
        assert!(!failed_out_of_time(vec![Behaviour::Hangs, Behaviour::Refuses]).await);
        assert!(!failed_out_of_time(vec![Behaviour::Refuses, Behaviour::Refuses]).await);
    }

    #[tokio::test(start_paused = true)]
    async fn e10_a_try_cut_by_its_time_is_reported_for_billing_and_a_refusal_is_not() {
        let (hangs, _) = entry("primary", Behaviour::Hangs);
        let (fallback, _) = entry("fallback", Behaviour::Answers);
        let done = through(&[hangs, fallback], Duration::from_secs(60))
            .await
            .expect("the fallback answers");
        let cut: Vec<&str> = done.cut.iter().map(|c| c.provider.as_str()).collect();
        assert_eq!(
            cut,
            ["primary"],
            "its one try, cut by its share of the time"
        );
        let (refuses, _) = entry("primary", Behaviour::Refuses);
        let (hangs, _) = entry("fallback", Behaviour::Hangs);
        let failed = through(&[refuses, hangs], Duration::from_secs(60))
            .await
            .expect_err("nothing answers");
        let cut: Vec<&str> = failed.cut.iter().map(|c| c.provider.as_str()).collect();
        assert_eq!(cut, ["fallback"], "a 400 is not billed; a hung call may be");
    }

    #[tokio::test(start_paused = true)]
    async fn e6_a_retry_after_past_the_models_share_of_the_time_goes_to_the_fallback_at_once() {
        let (took, answer, calls) = chain_of(Behaviour::RateLimited, Duration::from_secs(15)).await;
        assert_eq!(answer, "fallback answered");
        assert_eq!(calls, 1, "no retry that would wait 30 s of a 15 s run");
        assert_eq!(took, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn e5_a_blocked_prompt_or_an_answer_all_thinking_goes_to_the_next_model_billed() {
        for why in ["blocked:SAFETY", "length", "refusal"] {
            let (primary, calls) = entry("primary", Behaviour::SaysNothing(why));
            let (fallback, _) = entry("fallback", Behaviour::Answers);
            let done = through(&[primary, fallback], Duration::from_secs(60))
                .await
                .expect("the fallback answers");
            assert_eq!(done.response.text, "fallback answered", "{why}");
            assert_eq!(calls.calls.load(std::sync::atomic::Ordering::Relaxed), 1);
            assert_eq!(
                done.passed_over.len(),
                1,
                "{why}: the empty answer was billed"
            );
            assert_eq!(done.passed_over[0].response.usage.output_tokens, 4000);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn e5_an_answer_passed_over_stands_when_every_later_model_fails() {
        let (primary, _) = entry("primary", Behaviour::SaysNothing("length"));
        let (fallback, _) = entry("fallback", Behaviour::Refuses);
        let done = through(&[primary, fallback], Duration::from_secs(60))
            .await
            .expect("the empty answer, not 'trouble connecting'");
        assert_eq!(
            (done.provider.as_str(), done.response.stop_reason.as_str()),
            ("primary", "length")
        );
        assert_eq!(
            done.response.usage.output_tokens, 4000,
            "billed, so counted"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn e5_the_last_models_empty_answer_stands_for_the_run_to_answer_from_what_it_gathered() {
        let (only, _) = entry("only", Behaviour::SaysNothing("blocked:SAFETY"));
        let done = through(&[only], Duration::from_secs(60))
            .await
            .expect("an answer, not 'trouble connecting'");
        assert_eq!(done.response.stop_reason, "blocked:SAFETY");
        let (primary, _) = entry("primary", Behaviour::SaysNothing("stop"));
        let (fallback, fallback_calls) = entry("fallback", Behaviour::Answers);
        let done = through(&[primary, fallback], Duration::from_secs(60))
            .await
            .expect("an answer");
        assert_eq!(
            done.response.text, "",
            "an ordinary empty answer is not passed on"
        );
        assert_eq!(
            fallback_calls
                .calls
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }

    #[test]
    fn backoff_honours_retry_after_and_its_ceiling() {
        let p = RetryPolicy::default();
        assert!(backoff(&p, 0, None).unwrap() <= Duration::from_millis(500));
        assert!(backoff(&p, 5, None).unwrap() <= Duration::from_secs(10));
        assert!(backoff(&p, 0, Some(Duration::from_secs(3))).unwrap() >= Duration::from_secs(3));
        assert_eq!(backoff(&p, 0, Some(Duration::from_secs(600))), None);
    }
}
