//! Following runs: the events of runs executing on this replica are fanned out from
//! memory, as they are made; runs executing elsewhere are followed from the store, woken by
//! PostgreSQL notices (a poll is only the fallback). Every registration is removed when the run
//! or the watcher ends, so nothing accumulates per watched run.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use prost::Message as _;
use steward_proto::agent::v1 as pb;
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::{
    api::ApiError,
    store::{RunNotice, RunState, SharedStore},
};

/// How often a watcher of a run on another replica re-reads the store when no notice comes
/// (the notice connection is down, or the store has none).
const POLL_FALLBACK: Duration = Duration::from_secs(1);
/// Events a watcher's stream buffers before it waits for its client.
const WATCH_BUFFER: usize = 64;

/// The events a segment of a run made on this replica, from its first seq, for local watchers.
pub(super) struct LiveRun {
    inner: Mutex<LiveLog>,
    /// The last seq published; watchers wait on its changes.
    last: watch::Sender<u64>,
}

struct LiveLog {
    first_seq: u64,
    events: Vec<pb::RunEvent>,
    closed: bool,
}

impl LiveRun {
    pub(super) fn publish(&self, event: pb::RunEvent) {
        let seq = event.seq;
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .events
            .push(event);
        self.last.send_replace(seq);
    }

    /// Events after `after`, whether the log is closed, and the first seq it holds.
    fn since(&self, after: u64) -> (Vec<pb::RunEvent>, bool, u64) {
        let log = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let start = log.events.partition_point(|e| e.seq <= after);
        (log.events[start..].to_vec(), log.closed, log.first_seq)
    }
}

/// What this replica knows live: its running segments, and who waits on which remote run.
#[derive(Default)]
pub(super) struct Live {
    runs: Mutex<HashMap<String, Arc<LiveRun>>>,
    /// Watchers of remote runs: a wake-up per run, with how many wait on it.
    remote: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
    /// Cancels of runs executing here, for CancelRun from any replica.
    pub(super) cancels: Mutex<HashMap<String, CancellationToken>>,
}

impl Live {
    /// Registers a segment executing here; its log starts after `last_durable`.
    pub(super) fn open(&self, run_id: &str, last_durable: u64) -> Arc<LiveRun> {
        let run = Arc::new(LiveRun {
            inner: Mutex::new(LiveLog {
                first_seq: last_durable + 1,
                events: Vec::new(),
                closed: false,
            }),
            last: watch::channel(last_durable).0,
        });
        self.runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(run_id.to_owned(), run.clone());
        run
    }

    /// The segment ended (everything it published is durable, or it never will be): watchers
    /// that hold it drain it; new ones read the store.
    pub(super) fn close(&self, run_id: &str, run: &Arc<LiveRun>) {
        run.inner.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        run.last.send_modify(|_| {});
        let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
        if runs.get(run_id).is_some_and(|r| Arc::ptr_eq(r, run)) {
            runs.remove(run_id);
        }
    }

    fn local(&self, run_id: &str) -> Option<Arc<LiveRun>> {
        self.runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(run_id)
            .cloned()
    }

    fn wait_remote(self: &Arc<Self>, run_id: &str) -> RemoteWait {
        let notify = {
            let mut remote = self.remote.lock().unwrap_or_else(|e| e.into_inner());
            let entry = remote
                .entry(run_id.to_owned())
                .or_insert_with(|| (Arc::new(Notify::new()), 0));
            entry.1 += 1;
            entry.0.clone()
        };
        RemoteWait {
            live: self.clone(),
            run_id: run_id.to_owned(),
            notify,
        }
    }

    /// Registrations held right now (segments, remote waits, cancels): zero when idle.
    pub(super) fn registrations(&self) -> usize {
        self.runs.lock().map_or(0, |r| r.len())
            + self.remote.lock().map_or(0, |r| r.len())
            + self.cancels.lock().map_or(0, |r| r.len())
    }

    /// Routes store notices: new events wake remote watchers, cancels reach runs here.
    pub(super) fn route(&self, notice: &RunNotice) {
        match notice {
            RunNotice::Events(run_id) => {
                if let Some((notify, _)) = self
                    .remote
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(run_id)
                {
                    notify.notify_waiters();
                }
            }
            RunNotice::Cancel(run_id) => {
                if let Some(token) = self
                    .cancels
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(run_id)
                {
                    token.cancel();
                }
            }
            RunNotice::Resync => {
                for (notify, _) in self
                    .remote
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                {
                    notify.notify_waiters();
                }
            }
        }
    }
}

/// A remote watcher's registration; removed when the watcher ends.
struct RemoteWait {
    live: Arc<Live>,
    run_id: String,
    notify: Arc<Notify>,
}

impl Drop for RemoteWait {
    fn drop(&mut self) {
        let mut remote = self.live.remote.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = remote.get_mut(&self.run_id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                remote.remove(&self.run_id);
            }
        }
    }
}

fn is_terminal(event: &pb::RunEvent) -> bool {
    matches!(
        event.kind,
        Some(pb::run_event::Kind::Result(_) | pb::run_event::Kind::Error(_))
    )
}

/// Follows one run for one client: events after `after`, ending after a terminal event.
pub(super) struct Follow {
    pub(super) live: Arc<Live>,
    pub(super) store: SharedStore,
    pub(super) run_id: String,
    pub(super) thread_id: String,
    pub(super) after: u64,
}

/// A watcher's items go boxed: a channel allocates its slots up front, 32 at a time, and a
/// `RunEvent` or `Status` by value made that ~22 KiB per watching stream, for the stream's whole
/// life (issue 13).
type Watched = Box<Result<pb::RunEvent, tonic::Status>>;
type Sender = mpsc::Sender<Watched>;

/// The events of one watch, as the RPC streams them.
pub struct Watch(mpsc::Receiver<Watched>);

impl Watch {
    /// A watch with nothing to deliver.
    pub(super) fn over() -> Self {
        Watch(mpsc::channel(1).1)
    }
}

impl tokio_stream::Stream for Watch {
    type Item = Result<pb::RunEvent, tonic::Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|item| item.map(|boxed| *boxed))
    }
}

impl Follow {
    /// Whether a watch from `after` has nothing to deliver: the run's stream segment ended at
    /// or before `after` (WatchRun then returns at once instead of waiting forever).
    pub(super) fn already_over(state: RunState, last_event_seq: u64, after: u64) -> bool {
        (state.is_terminal() || state == RunState::AwaitingConfirmation) && last_event_seq <= after
    }

    pub(super) fn start(self) -> Watch {
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        tokio::spawn(async move {
            if let Err(e) = self.run(&tx).await {
                let _ = tx.send(Box::new(Err(tonic::Status::from(e)))).await;
            }
        });
        Watch(rx)
    }

    async fn run(mut self, tx: &Sender) -> Result<(), ApiError> {
        loop {
            if let Some(local) = self.live.local(&self.run_id) {
                if self.follow_local(&local, tx).await? {
                    return Ok(());
                }
                continue;
            }
            if self.follow_remote_once(tx).await? {
                return Ok(());
            }
        }
    }

    /// Sends one event; true when the watch is over (terminal event, or the client left).
    async fn send(&mut self, mut event: pb::RunEvent, tx: &Sender) -> bool {
        if event.seq <= self.after {
            return false;
        }
        self.after = event.seq;
        event.run_id.clone_from(&self.run_id);
        event.thread_id.clone_from(&self.thread_id);
        let terminal = is_terminal(&event);
        tx.send(Box::new(Ok(event))).await.is_err() || terminal
    }

    /// Durable events after `self.after`, up to `until` (inclusive) if given; true when over.
    async fn replay(&mut self, until: Option<u64>, tx: &Sender) -> Result<bool, ApiError> {
        loop {
            let batch = self
                .store
                .events_after(&self.run_id, self.after, 256)
                .await?;
            let full = batch.len() == 256;
            let mut any = false;
            for (seq, payload) in batch {
                if until.is_some_and(|u| seq > u) {
                    return Ok(false);
                }
                any = true;
                let Ok(mut event) = pb::RunEvent::decode(payload.as_slice()) else {
                    tracing::error!(run_id = %self.run_id, seq, "undecodable run event skipped");
                    self.after = seq;
                    continue;
                };
                event.seq = seq;
                if self.send(event, tx).await {
                    return Ok(true);
                }
            }
            if !(full && any) {
                return Ok(false);
            }
        }
    }

    /// Follows a segment executing here; true when the watch is over, false when the segment
    /// closed first (what follows is in the store or another segment).
    async fn follow_local(&mut self, run: &Arc<LiveRun>, tx: &Sender) -> Result<bool, ApiError> {
        let mut changes = run.last.subscribe();
        let (_, _, first_seq) = run.since(self.after);
        if self.after + 1 < first_seq && self.replay(Some(first_seq - 1), tx).await? {
            return Ok(true);
        }
        loop {
            changes.borrow_and_update();
            let (events, closed, _) = run.since(self.after);
            for event in events {
                if self.send(event, tx).await {
                    return Ok(true);
                }
            }
            if closed {
                return Ok(false);
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return Ok(false) },
                () = tx.closed() => return Ok(true),
            }
        }
    }

    /// One round of following a remote run: replay from the store, then wait for a notice (or
    /// the poll fallback); true when the watch is over.
    async fn follow_remote_once(&mut self, tx: &Sender) -> Result<bool, ApiError> {
        let wait = self.live.wait_remote(&self.run_id);
        let woken = wait.notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if self.replay(None, tx).await? {
            return Ok(true);
        }
        tokio::select! {
            () = &mut woken => {}
            () = tokio::time::sleep(POLL_FALLBACK) => {}
            () = tx.closed() => return Ok(true),
        }
        Ok(false)
    }
}
