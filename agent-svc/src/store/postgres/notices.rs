//! The store's notice connection: one dedicated connection (not from the pool) that LISTENs for
//! the run notices of every replica and sends this replica's "new events" notices.
//!
//! Those are sent here, after their commit, not inside it. A transaction that runs NOTIFY takes
//! one database-wide lock at its commit and keeps it until the transaction is over, its WAL
//! flush included, so every run's commit waited behind every other's: with 1,000 concurrent
//! runs most sampled backends waited on `Lock:object` (issue 13, docs/BENCHMARKS.md). A commit
//! now only queues its run's id, and what gathered is sent as one short transaction that does
//! not wait for its WAL flush. A notice was never durable, and its receivers take it as a hint:
//! one that is lost costs a watcher on another replica at most its poll fallback.

use std::time::Duration;

use futures_util::StreamExt as _;
use svc_kit::pg;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use crate::store::{NOTICE_CHANNEL, RunNotice};

/// Run ids one notice transaction carries at most; more go in the next one.
const MAX_BATCH: usize = 512;

/// How long a notice waits for others to share its transaction.
const GATHER: Duration = Duration::from_millis(2);

const SQL_NOTIFY_EVENTS: &str =
    "SELECT pg_notify('agent_runs', 'e:' || r) FROM unnest($1::text[]) AS r";

/// Queues "new events" notices for the notice connection.
pub(super) struct Outgoing(mpsc::UnboundedSender<String>);

impl Outgoing {
    /// Tells the other replicas, soon, that `run_id` has committed new events. Call it only
    /// after the commit: a notice must never arrive before the rows it announces.
    pub(super) fn events(&self, run_id: &str) {
        // Fails only once the connection's task has stopped, with the store.
        let _ = self.0.send(run_id.to_owned());
    }
}

/// Starts the notice connection: notices from PostgreSQL go to `notices` until `stop`; the
/// connection is opened again when it drops, and after each (re)connect `Resync` is sent, as
/// notices may have been missed meanwhile, so watchers re-read.
pub(super) fn start(
    url: String,
    notices: broadcast::Sender<RunNotice>,
    stop: CancellationToken,
) -> Outgoing {
    let (queue, outgoing) = mpsc::unbounded_channel();
    tokio::spawn(run(url, notices, outgoing, stop));
    Outgoing(queue)
}

async fn run(
    url: String,
    notices: broadcast::Sender<RunNotice>,
    mut outgoing: mpsc::UnboundedReceiver<String>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            ended = session(&url, &notices, &mut outgoing) => {
                tracing::warn!(error = %ended, "run notices unavailable; watchers poll until it reconnects");
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        // Nobody waits for what queued while the connection was down: its watchers have
        // polled since, or will re-read at the Resync the reconnect sends.
        while outgoing.try_recv().is_ok() {}
    }
}

/// One connection's life; returns why it ended.
async fn session(
    url: &str,
    notices: &broadcast::Sender<RunNotice>,
    outgoing: &mut mpsc::UnboundedReceiver<String>,
) -> String {
    let connected = async {
        let target = pg::Target::parse(url).map_err(|e| e.to_string())?;
        target.connect().await.map_err(|e| e.to_string())
    };
    let (client, mut messages) = match connected.await {
        Ok(c) => c,
        Err(e) => return e,
    };
    // The connection's messages are driven by their own task; notices reach this one by channel.
    let (tx, mut incoming) = mpsc::unbounded_channel();
    let pump = tokio::spawn(async move {
        while let Some(message) = messages.next().await {
            match message {
                Ok(tokio_postgres::AsyncMessage::Notification(n)) => {
                    if tx.send(n.payload().to_owned()).is_err() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "run notice connection failed");
                    break;
                }
            }
        }
    });
    let ended = async {
        client
            .batch_execute(&format!("LISTEN {NOTICE_CHANNEL}"))
            .await
            .map_err(|e| e.to_string())?;
        let notify = client
            .prepare(SQL_NOTIFY_EVENTS)
            .await
            .map_err(|e| e.to_string())?;
        let _ = notices.send(RunNotice::Resync);
        let mut batch = Vec::new();
        loop {
            tokio::select! {
                payload = incoming.recv() => {
                    let Some(payload) = payload else {
                        return Err("the connection closed".to_owned());
                    };
                    if let Some(notice) = RunNotice::parse(&payload) {
                        let _ = notices.send(notice);
                    }
                }
                n = outgoing.recv_many(&mut batch, MAX_BATCH) => {
                    if n == 0 {
                        // The store is gone; `stop` ends this task.
                        std::future::pending::<()>().await;
                    }
                    // What else comes within GATHER goes in the same transaction (and while
                    // one is sent the next gathers): a watcher on another replica learns a
                    // little later, and under load the notices cost far fewer transactions.
                    let gathered = tokio::time::sleep(GATHER);
                    tokio::pin!(gathered);
                    while batch.len() < MAX_BATCH {
                        let room = MAX_BATCH - batch.len();
                        tokio::select! {
                            () = &mut gathered => break,
                            more = outgoing.recv_many(&mut batch, room) => {
                                if more == 0 { break; }
                            }
                        }
                    }
                    batch.sort_unstable();
                    batch.dedup();
                    send(&client, &notify, &batch).await.map_err(|e| e.to_string())?;
                    batch.clear();
                }
            }
        }
    };
    let ended: Result<std::convert::Infallible, String> = ended.await;
    pump.abort();
    let Err(why) = ended;
    why
}

/// One short transaction that does not wait for its WAL flush, in one round trip: each request
/// is written when first polled, and `join3` polls them in order. A failed NOTIFY turns the
/// COMMIT into a rollback, so the session stays usable.
async fn send(
    client: &tokio_postgres::Client,
    notify: &tokio_postgres::Statement,
    run_ids: &[String],
) -> Result<(), tokio_postgres::Error> {
    let (begun, notified, committed) = futures_util::future::join3(
        client.batch_execute("BEGIN; SET LOCAL synchronous_commit TO off"),
        client.execute(notify, &[&run_ids]),
        client.batch_execute("COMMIT"),
    )
    .await;
    begun.and(notified.map(drop)).and(committed)
}
