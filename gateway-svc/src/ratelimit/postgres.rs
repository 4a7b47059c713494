//! Rate-limit counters in PostgreSQL, shared by every replica. Each charge (and each refund)
//! runs in one transaction holding an advisory lock on the key, so concurrent charges for one
//! key are serialised and the count is exact; different keys never wait on each other. The
//! transactions are pipelined: a charge is two round trips (BEGIN, lock and read; the writes
//! and COMMIT), a refund one.

use deadpool_postgres::Pool;

use super::{Decision, LimitKey, Limits, RateLimitBackend, Window, WindowCount, decide_up_to};
use crate::store::StoreError;

/// Serialises every charge and refund of one key for the rest of its transaction.
const SQL_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";
const SQL_READ: &str =
    "SELECT window_secs, window_start, used FROM gateway.rate_windows WHERE limit_key = $1";
/// Every window a charge changed, in one statement (a window appears once).
const SQL_WRITE: &str = "INSERT INTO gateway.rate_windows (limit_key, window_secs, window_start, used) \
     SELECT $1, c.secs, c.start, c.used FROM unnest($2::int4[], $3::int8[], $4::int4[]) AS c(secs, start, used) \
     ON CONFLICT (limit_key, window_secs) \
     DO UPDATE SET window_start = EXCLUDED.window_start, used = EXCLUDED.used";
const SQL_GIVE_BACK: &str = "UPDATE gateway.rate_windows AS w SET used = GREATEST(w.used - $2, 0) \
     FROM unnest($3::int4[], $4::int8[]) AS c(secs, start) \
     WHERE w.limit_key = $1 AND w.window_secs = c.secs AND w.window_start = c.start";

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
        let client = svc_kit::pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)?;
        // Each statement prepared once per connection (the statement cache), not per call.
        let (lock, read, write_statement) = futures_util::try_join!(
            client.prepare_cached(SQL_LOCK),
            client.prepare_cached(SQL_READ),
            client.prepare_cached(SQL_WRITE),
        )
        .map_err(StoreError::db)?;
        let storage_key = key.storage_key();
        let t: &tokio_postgres::Client = &client;
        let mut open = svc_kit::pg::Begun::new(t);
        // BEGIN, the key's lock and the read in one round trip. The read is a statement of its
        // own after the lock, so its snapshot is taken once the lock is held and it sees every
        // charge to the key that committed before.
        let (begun, locked, rows) = futures_util::future::join3(
            t.batch_execute("BEGIN"),
            t.execute(&lock, &[&storage_key]),
            t.query(&read, &[&storage_key]),
        )
        .await;
        begun.map_err(StoreError::db)?;
        locked.map_err(StoreError::db)?;
        let counts: Vec<WindowCount> = rows
            .map_err(StoreError::db)?
            .iter()
            .filter_map(|r| {
                let w = window_from_secs(r.get::<_, i32>(0))?;
                Some((w, r.get::<_, i64>(1) as u64, r.get::<_, i32>(2) as u32))
            })
            .collect();
        let (decision, updated, cost) = decide_up_to(limits, &counts, min, max, now);
        // Every window's new count (when the charge went through) and COMMIT in the second
        // round trip.
        let write = (matches!(decision, Decision::Allowed(_)) && !updated.is_empty()).then(|| {
            let mut secs = Vec::with_capacity(updated.len());
            let mut starts = Vec::with_capacity(updated.len());
            let mut used = Vec::with_capacity(updated.len());
            for (window, start, n) in updated {
                secs.push(window.seconds() as i32);
                starts.push(start as i64);
                used.push(n as i32);
            }
            (secs, starts, used)
        });
        let written = write.as_ref().map(|(secs, starts, used)| {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&storage_key, secs, starts, used];
            t.execute_raw(&write_statement, params)
        });
        let (written, committed) = futures_util::future::join(
            futures_util::future::OptionFuture::from(written),
            t.batch_execute("COMMIT"),
        )
        .await;
        open.committed();
        written.transpose().map_err(StoreError::db)?;
        committed.map_err(StoreError::db)?;
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
        let client = svc_kit::pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)?;
        // Under the key's advisory lock, as a charge: a charge reads and then writes absolute
        // counts, so a refund between the two would otherwise be lost.
        let (lock, give_back) = futures_util::try_join!(
            client.prepare_cached(SQL_LOCK),
            client.prepare_cached(SQL_GIVE_BACK),
        )
        .map_err(StoreError::db)?;
        let storage_key = key.storage_key();
        let amount = i32::try_from(amount).unwrap_or(i32::MAX);
        let t: &tokio_postgres::Client = &client;
        let mut open = svc_kit::pg::Begun::new(t);
        // Nothing here decides between statements: the whole transaction is one round trip.
        let (begun, locked, given, committed) = futures_util::future::join4(
            t.batch_execute("BEGIN"),
            t.execute(&lock, &[&storage_key]),
            t.execute(&give_back, &[&storage_key, &amount, &secs, &starts]),
            t.batch_execute("COMMIT"),
        )
        .await;
        open.committed();
        begun.map_err(StoreError::db)?;
        locked.map_err(StoreError::db)?;
        given.map_err(StoreError::db)?;
        committed.map_err(StoreError::db)?;
        Ok(())
    }
}
