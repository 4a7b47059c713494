//! gateway-svc's Prometheus series, named in one place (O-2). RPC counts and latencies come from
//! svc-kit's server layer; these are the domain events, recorded where they happen.

use std::time::Duration;

/// A tool call's end: by tool and outcome (`ok` or the error kind), with its latency.
pub fn tool_call(tool: &str, outcome: &str, latency: Duration) {
    metrics::counter!("steward_tool_calls_total", "tool" => tool.to_owned(), "outcome" => outcome.to_owned())
        .increment(1);
    metrics::histogram!("steward_tool_call_seconds", "tool" => tool.to_owned())
        .record(latency.as_secs_f64());
}

/// One upstream HTTP request (Gmail, Calendar, Slack, OAuth): its latency and status.
pub fn upstream_request(integration: &'static str, status: &str, latency: Duration) {
    metrics::counter!("steward_upstream_requests_total", "integration" => integration, "status" => status.to_owned())
        .increment(1);
    metrics::histogram!("steward_upstream_request_seconds", "integration" => integration)
        .record(latency.as_secs_f64());
}

/// A call refused by the per-user rate limit before any upstream request.
pub fn rate_limit_denied(integration: &'static str) {
    metrics::counter!("steward_rate_limit_denials_total", "integration" => integration)
        .increment(1);
}

/// Audit records of read-only calls waiting for the batching writer (queued or being
/// written): a gauge moved by `delta`.
pub fn audit_queue_depth(delta: i64) {
    let gauge = metrics::gauge!("steward_gateway_audit_queue_depth");
    if delta >= 0 {
        gauge.increment(delta as f64);
    } else {
        gauge.decrement(delta.unsigned_abs() as f64);
    }
}

/// A call found the audit queue full and waited for space (backpressure, never a drop).
pub fn audit_queue_waited() {
    metrics::counter!("steward_gateway_audit_queue_waits_total").increment(1);
}

/// The batching writer wrote one batch of `records` in one INSERT.
pub fn audit_batch_written(records: usize) {
    metrics::histogram!("steward_gateway_audit_batch_records").record(records as f64);
    metrics::counter!("steward_gateway_audit_records_written_total").increment(records as u64);
}

/// A batch write failed: retried when the failure is transient, split to isolate the refused
/// record(s) when the database refused it for good.
pub fn audit_write_failed() {
    metrics::counter!("steward_gateway_audit_write_failures_total").increment(1);
}

/// The database refused one audit record for good (a constraint, a bad value, a trigger, a
/// missing privilege): it is logged in full at ERROR instead of written.
pub fn audit_record_rejected() {
    metrics::counter!("steward_gateway_audit_records_rejected_total").increment(1);
}

/// Audit records of read-only calls that were never written: still queued when the writer was
/// stopped at the drain deadline or died, or refused when written at once after that.
pub fn audit_records_lost(records: usize) {
    metrics::counter!("steward_gateway_audit_records_lost_total").increment(records as u64);
}

/// A retention sweep deleted `rows` from `table` (`idempotency` or `audit`): what
/// IDEMPOTENCY_RETENTION and AUDIT_RETENTION keep bounded.
pub fn retention_pruned(table: &'static str, rows: usize) {
    metrics::counter!("steward_gateway_retention_pruned_total", "table" => table)
        .increment(rows as u64);
}

/// A key rotation's walk re-encrypted one account under CREDENTIALS_KEY.
pub fn credentials_moved() {
    metrics::counter!("steward_gateway_credentials_moved_total").increment(1);
}

/// A key rotation's walk over every stored account ended, leaving accounts still under
/// CREDENTIALS_KEY_PREVIOUS (`left`: being refreshed or walked elsewhere as it passed; 0 once
/// the previous key can go) and accounts read with neither key (`unreadable`, only a reconnect
/// mends them).
pub fn rekey_walked(left: usize, unreadable: usize) {
    rekey_walk_ended("finished");
    metrics::gauge!("steward_gateway_credentials_accounts", "key" => "previous").set(left as f64);
    metrics::gauge!("steward_gateway_credentials_accounts", "key" => "neither")
        .set(unreadable as f64);
}

/// A key rotation's walk failed on a store error before it had read every account: the
/// gauges above still show the last walk that finished, which this counter's `failed` outcome
/// rising while `finished` stands still says.
pub fn rekey_walk_failed() {
    rekey_walk_ended("failed");
}

fn rekey_walk_ended(outcome: &'static str) {
    metrics::counter!("steward_gateway_credentials_walks_total", "outcome" => outcome).increment(1);
}
