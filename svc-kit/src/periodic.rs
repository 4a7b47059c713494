//! Background sweeps that repeat on an interval, as both services run them (health monitor,
//! archiver, pruners, workers, the gateway's retention): one loop, so each keeps the same two
//! promises — a sweep never overlaps the one before it, and each starts a whole interval after
//! the last one ended, so a long sweep (a backlog worked off) is followed by a rest, never by
//! the next at once nor a burst of the ticks it overran.

use std::time::Duration;

/// When a periodic sweep first runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstSweep {
    /// As the replica starts.
    AtOnce,
    /// At a random point of the first interval: replicas a rollout starts together do not
    /// all meet the same backlog at once.
    Spread,
}

/// What a sweep of [`spawn_every_until`] says of the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    Again,
    /// The work is done for good: the loop ends, its task with it.
    Done,
}

/// Runs `sweep` until the task is aborted (or the runtime ends), each `interval` after the one
/// before it ended. Aborting it mid-sweep drops that sweep's future: a sweep
/// must leave nothing half-done that a drop would lose (a statement in flight commits or
/// not as a whole).
pub fn spawn_every<F, Fut>(
    interval: Duration,
    first: FirstSweep,
    mut sweep: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    spawn_every_until(interval, first, move || {
        let swept = sweep();
        async move {
            swept.await;
            Then::Again
        }
    })
}

/// As [`spawn_every`], for work that can end: the loop stops after a sweep that says
/// [`Then::Done`].
pub fn spawn_every_until<F, Fut>(
    interval: Duration,
    first: FirstSweep,
    mut sweep: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Then> + Send + 'static,
{
    let delay = match first {
        FirstSweep::AtOnce => Duration::ZERO,
        FirstSweep::Spread => interval.mul_f64(rand::random::<f64>()),
    };
    tokio::spawn(async move {
        let mut next = tokio::time::Instant::now() + delay;
        loop {
            tokio::time::sleep_until(next).await;
            if sweep().await == Then::Done {
                return;
            }
            next = tokio::time::Instant::now() + interval;
        }
    })
}

/// Aborts `task` once `stop` completes (a cancellation token's `cancelled_owned()`, say): a
/// loop of [`spawn_every`] ended at a service's stop itself, not when the stop is next awaited.
pub fn abort_at<T: Send + 'static>(
    task: &tokio::task::JoinHandle<T>,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let abort = task.abort_handle();
    tokio::spawn(async move {
        stop.await;
        abort.abort();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The times, on tokio's paused clock, of the first `n` sweeps of a `spawn_every` every
    /// 10 s whose first sweep takes `first_takes` and every later one a second.
    async fn sweep_times(first: FirstSweep, first_takes: Duration, n: usize) -> Vec<Duration> {
        let start = tokio::time::Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut swept = 0;
        let task = spawn_every(Duration::from_secs(10), first, move || {
            let tx = tx.clone();
            let takes = match swept {
                0 => first_takes,
                _ => Duration::from_secs(1),
            };
            swept += 1;
            async move {
                let _ = tx.send(start.elapsed());
                tokio::time::sleep(takes).await;
            }
        });
        let mut times = Vec::new();
        while times.len() < n {
            times.push(rx.recv().await.unwrap());
        }
        task.abort();
        times
    }

    #[tokio::test(start_paused = true)]
    async fn a_periodic_sweep_starts_at_once_and_rests_a_whole_interval_after_each() {
        let secs = |t: &[Duration]| t.iter().map(Duration::as_secs).collect::<Vec<_>>();
        let quick = sweep_times(FirstSweep::AtOnce, Duration::from_secs(1), 3).await;
        assert_eq!(secs(&quick), [0, 11, 22]);
        // The first sweep takes 25 s, past two intervals: the next comes 10 s after it ended
        // (tokio's `Delay` would bring it at 25 s, `Burst` at 25 and 26 s, `Skip` at 30 s).
        let slow = sweep_times(FirstSweep::AtOnce, Duration::from_secs(25), 3).await;
        assert_eq!(secs(&slow), [0, 35, 46]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_sweep_that_says_it_is_done_ends_its_loop() {
        let start = tokio::time::Instant::now();
        let mut swept = 0;
        let task = spawn_every_until(Duration::from_secs(10), FirstSweep::AtOnce, move || {
            swept += 1;
            let then = if swept == 3 { Then::Done } else { Then::Again };
            async move { then }
        });
        task.await.expect("the loop ends by itself");
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(20),
            "after its third sweep"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_spread_sweep_starts_within_its_first_interval() {
        let times = sweep_times(FirstSweep::Spread, Duration::ZERO, 2).await;
        // Within the interval; the paused clock rounds up to the millisecond.
        assert!(times[0] <= Duration::from_secs(10), "{times:?}");
        assert_eq!(
            times[1] - times[0],
            Duration::from_secs(10),
            "it took no time"
        );
    }
}
