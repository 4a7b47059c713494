//! Rate-limit counters in PostgreSQL, shared by every replica. Every charge (and every refund)
//! holds an advisory lock on the key for its transaction, so concurrent charges for one key
//! are serialised and the count is exact; different keys never wait on each other.
//!
//! A charge that fits is one statement (issue 13): it raises every window by the whole charge
//! where there is room, and undoes itself when some window had none. Only then is the charge
//! decided the long way, in a transaction of two round trips (BEGIN, lock and read; the writes
//! and COMMIT) that reads the windows and lets `decide_up_to` — the rule both backends share —
//! say how much, if anything, it takes. A refund is one round trip.

use deadpool_postgres::Pool;

use super::{
    Decision, LimitKey, Limits, RateLimitBackend, Window, WindowCount, WindowUsage, decide_up_to,
};
use crate::store::StoreError;

/// Serialises every charge and refund of one key for the rest of its transaction.
const SQL_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";
const SQL_READ: &str =
    "SELECT window_secs, window_start, used FROM gateway.rate_windows WHERE limit_key = $1";
/// The whole charge `$5` added to every window of key `$1` (seconds `$2`, current start `$3`,
/// limit `$4`) that has room for it, under the key's lock (taken before any row is written:
/// every row the insert sees comes through the join with it). A stored window from an earlier
/// start counts as empty and one that starts a window later is the current one (another
/// replica's clock is ahead across the boundary), as `decide` has it. Returns each window charged. A charge the windows
/// as the statement first sees them cannot take writes nothing and returns nothing (the usual
/// denial, with no error in the server's log); one that a charge committed meanwhile filled —
/// the rows are raised on their latest version, behind the lock — raises SWR01, so nothing of
/// it stays.
const SQL_CHARGE_WHOLE: &str = "WITH locked AS (SELECT pg_advisory_xact_lock(hashtextextended($1, 0))), \
  seen AS (SELECT bool_and(COALESCE(CASE WHEN r.window_start IN (c.start, c.start + c.secs) THEN r.used ELSE 0 END, 0)::int8 + $5::int4 <= c.lim) \
      AS fits \
      FROM unnest($2::int4[], $3::int8[], $4::int4[]) AS c(secs, start, lim) \
      LEFT JOIN gateway.rate_windows r ON r.limit_key = $1 AND r.window_secs = c.secs), \
  charged AS (INSERT INTO gateway.rate_windows AS w (limit_key, window_secs, window_start, used) \
      SELECT $1, c.secs, c.start, $5 FROM unnest($2::int4[], $3::int8[], $4::int4[]) AS c(secs, start, lim), locked \
      WHERE $5 <= c.lim AND (SELECT fits FROM seen) \
      ON CONFLICT (limit_key, window_secs) DO UPDATE SET \
        window_start = CASE WHEN w.window_start = EXCLUDED.window_start + w.window_secs THEN w.window_start ELSE EXCLUDED.window_start END, \
        used = CASE WHEN w.window_start IN (EXCLUDED.window_start, EXCLUDED.window_start + w.window_secs) THEN w.used ELSE 0 END + EXCLUDED.used \
      WHERE CASE WHEN w.window_start IN (EXCLUDED.window_start, EXCLUDED.window_start + w.window_secs) THEN w.used ELSE 0 END::int8 + EXCLUDED.used \
        <= (SELECT c.lim FROM unnest($2::int4[], $4::int4[]) AS c(secs, lim) WHERE c.secs = w.window_secs) \
      RETURNING w.window_secs, w.used, w.window_start) \
  SELECT window_secs, used, window_start, \
    (SELECT CASE WHEN count(*) = cardinality($2::int4[]) THEN 0 ELSE gateway.charge_refused() END FROM charged) \
  FROM charged";
/// The SQLSTATE `gateway.charge_refused()` raises (migration V8).
const CHARGE_REFUSED: &str = "SWR01";
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
        if let Some(usage) = charge_whole(&client, key, limits, max, now).await? {
            return Ok((Decision::Allowed(usage), max));
        }
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
        amount: u32,
        charged: &[(Window, u64)],
    ) -> Result<(), StoreError> {
        // The windows the charge went into, as `refunded` picks them; a row whose window has
        // rolled over since has another start and is left alone.
        let (secs, starts): (Vec<i32>, Vec<i64>) = charged
            .iter()
            .map(|&(w, start)| (w.seconds() as i32, start as i64))
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

/// Charges the whole of `cost` to every window of `key` in one statement, if every window has
/// room for it: the windows' new counts, shortest window first, as `decide` gives them.
/// `None` when some window had no room — nothing was charged, and the charge is to be decided
/// under the key's lock.
async fn charge_whole(
    client: &svc_kit::pg::Pooled,
    key: &LimitKey,
    limits: &Limits,
    cost: u32,
    now: u64,
) -> Result<Option<Vec<WindowUsage>>, StoreError> {
    let mut windows = limits.0.clone();
    windows.sort_by_key(|(w, _)| w.seconds());
    let (Ok(cost), Ok(limit_values)) = (
        i32::try_from(cost),
        windows
            .iter()
            .map(|(_, limit)| i32::try_from(*limit))
            .collect::<Result<Vec<i32>, _>>(),
    ) else {
        // Beyond what a window's column holds: the long way decides it.
        return Ok(None);
    };
    let secs: Vec<i32> = windows.iter().map(|(w, _)| w.seconds() as i32).collect();
    let starts: Vec<i64> = windows.iter().map(|(w, _)| w.start(now) as i64).collect();
    let rows = match client
        .query(
            SQL_CHARGE_WHOLE,
            &[&key.storage_key(), &secs, &starts, &limit_values, &cost],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) if e.code().is_some_and(|c| c.code() == CHARGE_REFUSED) => return Ok(None),
        Err(e) => return Err(StoreError::db(e)),
    };
    // No window charged at all (none had room) raises nothing: fewer rows than windows.
    if rows.len() != windows.len() {
        return Ok(None);
    }
    let usage = windows
        .iter()
        .zip(&starts)
        .map(|(&(window, limit), &ours)| {
            let (used, start) = rows
                .iter()
                .find(|r| r.get::<_, i32>(0) == window.seconds() as i32)
                .map_or((0, ours), |r| (r.get::<_, i32>(1), r.get::<_, i64>(2)));
            WindowUsage {
                window,
                start: start as u64,
                used: used as u32,
                limit,
            }
        })
        .collect();
    Ok(Some(usage))
}
