//! Rate-limit counters in PostgreSQL, shared by every replica. Each charge (and each refund)
//! runs in one transaction holding an advisory lock on the key, so concurrent charges for one
//! key are serialised and the count is exact; different keys never wait on each other.

use deadpool_postgres::Pool;

use super::{Decision, LimitKey, Limits, RateLimitBackend, Window, WindowCount, decide_up_to};
use crate::store::StoreError;

pub struct PgRateLimits {
    pool: Pool,
}

impl PgRateLimits {
    pub fn new(pool: Pool) -> Self {
        Self { pool }
    }
}

fn window_from_secs(secs: i32) -> Option<Window> {
    [Window::Minute, Window::Hour, Window::Day]
        .into_iter()
        .find(|w| w.seconds() == secs as u64)
}

#[async_trait::async_trait]
impl RateLimitBackend for PgRateLimits {
    async fn charge_up_to(
        &self,
        key: &LimitKey,
        limits: &Limits,
        min: u32,
        max: u32,
        now: u64,
    ) -> Result<(Decision, u32), StoreError> {
        let mut client = svc_kit::pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)?;
        let tx = client.transaction().await.map_err(StoreError::db)?;
        // Each statement prepared once per connection (the statement cache), not per call.
        let (lock, read, write) = futures_util::try_join!(
            tx.prepare_cached("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"),
            tx.prepare_cached(
                "SELECT window_secs, window_start, used FROM gateway.rate_windows WHERE limit_key = $1"
            ),
            tx.prepare_cached(
                "INSERT INTO gateway.rate_windows (limit_key, window_secs, window_start, used) \
                 VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (limit_key, window_secs) \
                 DO UPDATE SET window_start = EXCLUDED.window_start, used = EXCLUDED.used"
            ),
        )
        .map_err(StoreError::db)?;
        let storage_key = key.storage_key();
        tx.execute(&lock, &[&storage_key])
            .await
            .map_err(StoreError::db)?;
        let rows = tx
            .query(&read, &[&storage_key])
            .await
            .map_err(StoreError::db)?;
        let counts: Vec<WindowCount> = rows
            .iter()
            .filter_map(|r| {
                let w = window_from_secs(r.get::<_, i32>(0))?;
                Some((w, r.get::<_, i64>(1) as u64, r.get::<_, i32>(2) as u32))
            })
            .collect();
        let (decision, updated, cost) = decide_up_to(limits, &counts, min, max, now);
        if matches!(decision, Decision::Allowed(_)) {
            for (window, start, used) in updated {
                tx.execute(
                    &write,
                    &[
                        &storage_key,
                        &(window.seconds() as i32),
                        &(start as i64),
                        &(used as i32),
                    ],
                )
                .await
                .map_err(StoreError::db)?;
            }
        }
        tx.commit().await.map_err(StoreError::db)?;
        Ok((decision, cost))
    }

    async fn refund(
        &self,
        key: &LimitKey,
        limits: &Limits,
        amount: u32,
        charged_at: u64,
    ) -> Result<(), StoreError> {
        // The windows the charge went into, as `refunded` picks them; a row whose window has
        // rolled over since has another start and is left alone.
        let (secs, starts): (Vec<i32>, Vec<i64>) = limits
            .0
            .iter()
            .map(|(w, _)| (w.seconds() as i32, w.start(charged_at) as i64))
            .unzip();
        let mut client = svc_kit::pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)?;
        let tx = client.transaction().await.map_err(StoreError::db)?;
        // Under the key's advisory lock, as a charge: a charge reads and then writes absolute
        // counts, so a refund between the two would otherwise be lost.
        let (lock, give_back) = futures_util::try_join!(
            tx.prepare_cached("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"),
            tx.prepare_cached(
                "UPDATE gateway.rate_windows AS w SET used = GREATEST(w.used - $2, 0) \
                 FROM unnest($3::int4[], $4::int8[]) AS c(secs, start) \
                 WHERE w.limit_key = $1 AND w.window_secs = c.secs AND w.window_start = c.start"
            ),
        )
        .map_err(StoreError::db)?;
        let storage_key = key.storage_key();
        tx.execute(&lock, &[&storage_key])
            .await
            .map_err(StoreError::db)?;
        let amount = i32::try_from(amount).unwrap_or(i32::MAX);
        tx.execute(&give_back, &[&storage_key, &amount, &secs, &starts])
            .await
            .map_err(StoreError::db)?;
        tx.commit().await.map_err(StoreError::db)?;
        Ok(())
    }
}
