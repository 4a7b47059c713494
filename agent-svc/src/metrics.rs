//! agent-svc's Prometheus series, named in one place (O-2). RPC counts and latencies come from
//! svc-kit's server layer; these are the domain events, recorded where they happen.

use std::time::Duration;

use crate::llm::TokenUsage;

/// A model call that answered: count, tokens by kind, cost (micro-USD, as counters are whole
/// numbers), latency and retries, by provider and model.
pub fn model_call(
    provider: &str,
    model: &str,
    usage: &TokenUsage,
    cost_usd: f64,
    latency: Duration,
) {
    metrics::counter!("steward_model_calls_total", "provider" => provider.to_owned(), "model" => model.to_owned(), "outcome" => "ok").increment(1);
    model_spend(provider, model, usage, cost_usd);
    metrics::histogram!("steward_model_call_seconds", "provider" => provider.to_owned(), "model" => model.to_owned())
        .record(latency.as_secs_f64());
}

/// Tokens and cost a model call spent: one that answered, or one cut before it could, whose
/// spend is estimated (its attempt counts as failed in `steward_model_calls_total`).
pub fn model_spend(provider: &str, model: &str, usage: &TokenUsage, cost_usd: f64) {
    let (p, m) = (provider.to_owned(), model.to_owned());
    for (kind, n) in [
        ("input", usage.input_tokens),
        ("output", usage.output_tokens),
        ("cached", usage.cached_tokens),
    ] {
        metrics::counter!("steward_model_tokens_total", "provider" => p.clone(), "model" => m.clone(), "kind" => kind)
            .increment(n);
    }
    metrics::counter!("steward_model_cost_microusd_total", "provider" => p, "model" => m)
        .increment((cost_usd * 1e6).round().max(0.0) as u64);
}

/// A model attempt that failed (it may be retried or fall back).
pub fn model_failed(provider: &str, model: &str) {
    metrics::counter!("steward_model_calls_total", "provider" => provider.to_owned(), "model" => model.to_owned(), "outcome" => "error")
        .increment(1);
}

pub fn model_retry(provider: &str, model: &str) {
    metrics::counter!("steward_model_retries_total", "provider" => provider.to_owned(), "model" => model.to_owned())
        .increment(1);
}

/// The chain moved on to its next entry.
pub fn model_fallback(to_provider: &str, to_model: &str) {
    metrics::counter!("steward_model_fallbacks_total", "provider" => to_provider.to_owned(), "model" => to_model.to_owned())
        .increment(1);
}

/// Finished runs whose events were thinned to their result (RUN_EVENTS_RETENTION).
pub fn run_events_pruned(runs: usize) {
    metrics::counter!("steward_run_events_pruned_runs_total").increment(runs as u64);
}

/// A run segment started or ended on this replica: runs executing here now.
pub fn run_active(delta: f64) {
    metrics::gauge!("steward_runs_active").increment(delta);
}

/// A run segment ended in `state` (completed, failed, cancelled, or awaiting_confirmation).
pub fn run_ended(state: &'static str) {
    metrics::counter!("steward_runs_ended_total", "state" => state).increment(1);
}

pub fn approval_requested() {
    metrics::counter!("steward_approvals_requested_total").increment(1);
}

pub fn approval_decided(approved: bool) {
    let decision = if approved { "approved" } else { "rejected" };
    metrics::counter!("steward_approvals_decided_total", "decision" => decision).increment(1);
}

/// Approvals waiting for a decision, across replicas, as the health monitor last counted them
/// in the store (every replica reports the same number: take the max, not the sum).
pub fn approvals_pending(n: u64) {
    metrics::gauge!("steward_approvals_pending").set(n as f64);
}

/// Runs followed on this replica: open WatchRun/RunStream streams and waiting Run or
/// DecideApproval calls.
pub fn watchers(delta: f64) {
    metrics::gauge!("steward_stream_watchers").increment(delta);
}

/// A run set apart to wait for its owner's admission lock: held elsewhere (another replica, a
/// stalled transaction), or behind the owner's runs already waiting for it. A decision that
/// continues a paused run and finds that lock held is counted here too, and waits for it on
/// its own connection.
pub fn admission_set_apart() {
    metrics::counter!("steward_db_admission_set_apart_total").increment(1);
}

/// Runs and decisions set apart (see [`admission_set_apart`]) on this replica and not yet
/// answered.
pub fn admission_waiting_for_owner(delta: f64) {
    metrics::gauge!("steward_db_admission_waiting_for_owner").increment(delta);
}
