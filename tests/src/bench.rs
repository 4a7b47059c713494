//! What the benches (`tests/benches/`) share: percentiles, the summary lines that
//! `bench/run.sh` gathers into one table, and PostgreSQL's own transaction counts.

use std::time::{Duration, Instant};

/// The `p` quantile of sorted samples (nearest rank).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// One row of the table `bench/run.sh` prints at the end: what was measured, the number, and
/// the target it is held to (empty when there is none).
pub fn summary(what: &str, value: &str, target: &str) {
    println!("SUMMARY\t{what}\t{value}\t{target}");
}

/// Committed and rolled-back transactions of database `name`, read once no backend is
/// connected to it (a backend flushes its pending counters when it exits). Polls: this waits
/// on PostgreSQL's own bookkeeping, for which there is no notification.
pub async fn transactions_when_idle(admin: &tokio_postgres::Client, name: &str) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let row = admin
            .query_one(
                "SELECT (xact_commit + xact_rollback)::int8, numbackends::int8 \
                 FROM pg_stat_database WHERE datname = $1",
                &[&name],
            )
            .await
            .expect("pg_stat_database");
        let (tx, backends): (i64, i64) = (row.get(0), row.get(1));
        if backends == 0 || Instant::now() > deadline {
            if backends != 0 {
                eprintln!(
                    "warning: {backends} backends still connected to {name}; counts approximate"
                );
            }
            return tx;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
