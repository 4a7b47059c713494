//! Bounded growth of what the gateway only ever adds to: idempotency keys (P-4, R-3) and the
//! audit trail (G-9). A background sweep on every replica deletes idempotency keys last
//! changed more than IDEMPOTENCY_RETENTION ago — settled ones, and held ones whose hold lapsed
//! that long ago; never one still held — and, only when AUDIT_RETENTION is set, audit records
//! older than it.
//!
//! Each delete is a batch of at most [`BATCH`] rows in its own short statement, so a sweep
//! never holds many row locks or one long transaction. Replicas sweep independently: a row
//! two of them pick is deleted by one and skipped by the other, so no coordination is needed
//! beyond each starting at a random point of its interval.

use std::time::{Duration, SystemTime};

use svc_kit::periodic::{FirstSweep, abort_at, spawn_every};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{
    config::RetentionConfig,
    store::{StoreError, Stores},
};

/// How often each replica sweeps. Retention is at least an hour, so five minutes adds little
/// to how long a row outlives it, and each sweep finds only about five minutes' worth of rows
/// to delete; a sweep with nothing to do costs one index probe per table.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(300);

/// Rows one statement deletes at most: a few thousand row locks, held for milliseconds.
pub const BATCH: usize = 5000;

/// The most batches one sweep deletes from a table. A backlog — the first sweep after
/// AUDIT_RETENTION is set on a trail years long — is worked off a million rows a sweep,
/// leaving autovacuum time to keep up in between.
pub const MAX_BATCHES: usize = 200;

/// What one sweep deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub idempotency: usize,
    pub audit: usize,
}

/// One sweep as of `now`: the background task passes the wall clock, tests a time of their
/// choosing. A held idempotency key's hold is still judged by the store's own clock, so no
/// `now` deletes a key a running call holds.
pub async fn sweep_once(
    stores: &Stores,
    retention: &RetentionConfig,
    now: SystemTime,
) -> Result<Swept, StoreError> {
    // Each table on its own: a failing idempotency prune does not keep the audit trail,
    // which may be under a compliance deadline, from being pruned.
    let idempotency = match now.checked_sub(retention.idempotency) {
        Some(cut) => drain(|| stores.idempotency.prune_idempotency(cut, BATCH)).await,
        None => Ok(0),
    };
    let audit = match retention.audit.and_then(|keep| now.checked_sub(keep)) {
        Some(cut) => drain(|| stores.audit.prune_audit(cut, BATCH)).await,
        None => Ok(0),
    };
    for (table, deleted) in [("idempotency", &idempotency), ("audit", &audit)] {
        match deleted {
            Ok(n) => crate::metrics::retention_pruned(table, *n),
            // The caller hears of the first failure only; each is logged here, once.
            Err(e) => tracing::warn!(
                table,
                error = %e,
                "retention prune failed; its rows wait for the next sweep"
            ),
        }
    }
    Ok(Swept {
        idempotency: idempotency?,
        audit: audit?,
    })
}

/// Repeats `batch` while it deletes anything (a batch may delete fewer than [`BATCH`] and
/// leave more behind it: see `AuditLog::prune_audit`), up to [`MAX_BATCHES`].
async fn drain<F, Fut>(mut batch: F) -> Result<usize, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<usize, StoreError>>,
{
    let mut total = 0;
    for _ in 0..MAX_BATCHES {
        let deleted = batch().await?;
        total += deleted;
        if deleted == 0 {
            break;
        }
    }
    Ok(total)
}

/// The background sweep of one replica.
pub struct Sweeper {
    task: JoinHandle<()>,
    stop: CancellationToken,
}

impl Sweeper {
    /// Sweeps every [`SWEEP_INTERVAL`] until `stop` is cancelled, the first time at a random
    /// point of the first interval so replicas started together do not sweep together.
    pub fn start(stores: Stores, retention: RetentionConfig, stop: CancellationToken) -> Self {
        let task = spawn_every(SWEEP_INTERVAL, FirstSweep::Spread, move || {
            let stores = stores.clone();
            async move {
                match sweep_once(&stores, &retention, SystemTime::now()).await {
                    Ok(Swept {
                        idempotency: 0,
                        audit: 0,
                    }) => {}
                    Ok(swept) => tracing::info!(
                        idempotency = swept.idempotency,
                        audit = swept.audit,
                        "retention: deleted {} idempotency key(s) and {} audit record(s) past their retention",
                        swept.idempotency,
                        swept.audit,
                    ),
                    // Logged by the sweep, table by table; tried again next interval, and
                    // meanwhile the rows only wait longer.
                    Err(_) => {}
                }
            }
        });
        // Ended at the stop itself, not when `stopped` is awaited: no sweep starts during the
        // drain.
        abort_at(&task, stop.clone().cancelled_owned());
        Self { task, stop }
    }

    /// Ends the sweep once its `stop` is cancelled (a delete in flight is abandoned; it
    /// commits or not as a whole) and waits for it to be gone.
    pub async fn stopped(self) {
        self.stop.cancelled().await;
        if let Err(e) = self.task.await
            && e.is_panic()
        {
            tracing::error!("the retention sweep panicked: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        domain::UserId,
        store::{AuditEntry, AuditRecord, memory::MemoryStore},
    };

    const DAY: Duration = Duration::from_secs(86_400);

    fn old_record() -> AuditEntry {
        AuditEntry {
            at: SystemTime::now() - 100 * DAY,
            record: AuditRecord {
                user: "u1".into(),
                kind: "tool_call".into(),
                tool: "gmail_send".into(),
                integration: None,
                account: None,
                call_id: "old".into(),
                run_id: None,
                status: "ok".into(),
                latency_ms: 1,
                bytes: 1,
                upstream_calls: 1,
            },
        }
    }

    /// G-9: the background sweep itself prunes, within its first interval, and ends when told.
    /// On tokio's paused clock: the interval passes at once, and the sweep's random start with
    /// it.
    #[tokio::test(start_paused = true)]
    async fn g9_the_background_sweep_prunes_within_its_first_interval_and_stops_when_told() {
        let stores = MemoryStore::stores();
        stores.audit.record_many(&[old_record()]).await.unwrap();
        let user = UserId::parse("u1").unwrap();
        assert_eq!(stores.audit.recent(&user, 10).await.unwrap().len(), 1);
        let stop = CancellationToken::new();
        let retention = RetentionConfig {
            audit: Some(90 * DAY),
            ..RetentionConfig::default()
        };
        let sweeper = Sweeper::start(stores.clone(), retention, stop.clone());
        tokio::time::sleep(SWEEP_INTERVAL).await;
        assert!(
            stores.audit.recent(&user, 10).await.unwrap().is_empty(),
            "pruned by the first sweep"
        );
        stop.cancel();
        sweeper.stopped().await;
    }
}
