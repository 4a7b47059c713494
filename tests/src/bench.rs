//! What the benches (`tests/benches/`) share: percentiles, the summary lines that
//! `bench/run.sh` gathers into one table, PostgreSQL's own transaction counts, and processes'
//! CPU times from `/proc`.

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

/// The fields of `/proc/<pid>/stat` from the third (the state) on, so field N of proc(5) is
/// index N − 3; the command name before them may hold spaces and parentheses. None when the
/// process is not on this machine or gone.
pub fn proc_stat(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    )
}

/// Clock ticks per second (`getconf CLK_TCK`), the unit of `/proc`'s CPU times.
pub fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// The CPU time of the PostgreSQL server's exited processes so far — backends and autovacuum
/// workers, which the postmaster reaps (`cutime + cstime` of its `/proc/<pid>/stat`). Read it
/// once a service's backends have gone (see [`transactions_when_idle`]): a backend's CPU is
/// counted when it exits. `None` where it cannot be read (a server on another host, a role
/// that may not read `postmaster.pid`).
pub async fn postgres_reaped_cpu(admin: &tokio_postgres::Client) -> Option<Duration> {
    let pid: String = admin
        .query_one(
            "SELECT split_part(pg_read_file('postmaster.pid'), E'\\n', 1)",
            &[],
        )
        .await
        .ok()?
        .get(0);
    let fields = proc_stat(pid.trim().parse().ok()?)?;
    // Fields 16 and 17 of stat(5); the slice starts at field 3.
    let ticks: u64 = fields.get(13)?.parse::<u64>().ok()? + fields.get(14)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 1000 / clock_ticks()))
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
