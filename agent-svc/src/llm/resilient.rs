//! The retry and fallback chain (E-6, L-3, S0 AC-19): each (provider, model) entry gets the
//! call plus up to `retries` retries on retriable errors, with exponential backoff and full
//! jitter that waits at least as long as the provider's Retry-After; then the next entry.

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
}

/// Every entry failed; `attempts` says how, in order.
#[derive(Debug, Clone, thiserror::Error)]
#[error("every model failed: {}", attempts.join("; "))]
pub struct ChainFailed {
    pub attempts: Vec<String>,
}

pub async fn complete(
    chain: &[ChainEntry],
    policy: &RetryPolicy,
    request: &ModelRequest<'_>,
    deltas: &DeltaSink,
) -> Result<Completed, ChainFailed> {
    let mut attempts = Vec::new();
    for (i, entry) in chain.iter().enumerate() {
        if i > 0 {
            crate::metrics::model_fallback(entry.provider.name(), &entry.model);
        }
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
            let result = match tracing::Instrument::instrument(
                tokio::time::timeout(
                    policy.call_timeout,
                    entry.provider.complete(&request, deltas),
                ),
                span,
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(ModelError::Timeout),
            };
            match result {
                Ok(response) => {
                    return Ok(Completed {
                        response,
                        provider: entry.provider.name().to_owned(),
                        model: entry.model.clone(),
                        retries: retry,
                        latency: started.elapsed(),
                        started_at,
                    });
                }
                Err(e) => {
                    tracing::warn!(provider = entry.provider.name(), model = %entry.model, retry, error = %e, detail = e.detail(), "model call failed");
                    attempts.push(format!("{}/{}: {e}", entry.provider.name(), entry.model));
                    crate::metrics::model_failed(entry.provider.name(), &entry.model);
                    let wait = backoff(policy, retry, e.retry_after());
                    if !e.is_retriable() || retry >= policy.retries || wait.is_none() {
                        break;
                    }
                    tokio::time::sleep(wait.unwrap_or_default()).await;
                    crate::metrics::model_retry(entry.provider.name(), &entry.model);
                    retry += 1;
                }
            }
        }
    }
    Err(ChainFailed { attempts })
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

    #[test]
    fn backoff_honours_retry_after_and_its_ceiling() {
        let p = RetryPolicy::default();
        assert!(backoff(&p, 0, None).unwrap() <= Duration::from_millis(500));
        assert!(backoff(&p, 5, None).unwrap() <= Duration::from_secs(10));
        assert!(backoff(&p, 0, Some(Duration::from_secs(3))).unwrap() >= Duration::from_secs(3));
        assert_eq!(backoff(&p, 0, Some(Duration::from_secs(600))), None);
    }
}
