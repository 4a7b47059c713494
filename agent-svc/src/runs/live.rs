//! Following runs (A-8): the events of runs executing on this replica are fanned out from
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
use tokio::sync::{Notify, futures::OwnedNotified, watch};

use crate::{
    api::ApiError,
    store::{RunNotice, RunState, SharedStore},
};

/// How often a watcher of a run on another replica re-reads the store when no notice comes
/// (the notice connection is down, or the store has none).
const POLL_FALLBACK: Duration = Duration::from_secs(1);

/// The events a segment of a run made on this replica, from its first seq, for local watchers.
pub(super) struct LiveRun {
    inner: Mutex<LiveLog>,
    /// The last seq published; watchers wait on its changes.
    last: watch::Sender<u64>,
    /// Set once a terminal event is published or the log closes: a caller that wants only the
    /// run's end waits on this, not woken by each event before it (issue 13).
    settled: watch::Sender<bool>,
}

struct LiveLog {
    first_seq: u64,
    events: Vec<pb::RunEvent>,
    closed: bool,
}

impl LiveRun {
    pub(super) fn publish(&self, event: pb::RunEvent) {
        let seq = event.seq;
        let terminal = is_terminal(&event);
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .events
            .push(event);
        self.last.send_replace(seq);
        if terminal {
            self.settled.send_replace(true);
        }
    }

    /// Events after `after` (only the terminal ones with `terminal_only`), the last seq in the
    /// log, and whether the log is closed.
    pub(super) fn since(&self, after: u64, terminal_only: bool) -> (Vec<pb::RunEvent>, u64, bool) {
        let log = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let start = log.events.partition_point(|e| e.seq <= after);
        let events = &log.events[start..];
        let last = events.last().map_or(after, |e| e.seq);
        let events = if terminal_only {
            events.iter().filter(|e| is_terminal(e)).cloned().collect()
        } else {
            events.to_vec()
        };
        (events, last, log.closed)
    }

    /// The first seq the log holds: those before it are in the store.
    fn first_seq(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .first_seq
    }
}

/// What this replica knows live: its running segments, and who waits on which remote run.
#[derive(Default)]
pub(super) struct Live {
    runs: Mutex<HashMap<String, Arc<LiveRun>>>,
    /// Watchers of remote runs: a wake-up per run, with how many wait on it.
    remote: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
    /// Stoppers of runs executing here, for CancelRun from any replica: a cancel is recorded as
    /// the run's stop reason, so a commit failing after it cannot end the run FAILED instead.
    pub(super) cancels: Mutex<HashMap<String, super::writer::Stopper>>,
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
            settled: watch::channel(false).0,
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
        run.settled.send_replace(true);
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
                if let Some(stopper) = self
                    .cancels
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(run_id)
                {
                    stopper.stop(super::writer::StopReason::Cancelled);
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
    live: Arc<Live>,
    store: SharedStore,
    run_id: String,
    thread_id: String,
    after: u64,
    /// Following a run executing elsewhere: its registration for notices, and the wake-up.
    waiting: Option<(RemoteWait, std::pin::Pin<Box<OwnedNotified>>)>,
    /// The store was read to its end: the next read waits for a notice.
    caught_up: bool,
    /// Deliver only the terminal event: for callers that wait for a run's end.
    terminal_only: bool,
}

/// What a follower of a run is given.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Deliver {
    /// Every event, as WatchRun streams them.
    Every,
    /// Only the terminal event (the result, a pause or the error): what a caller waiting for
    /// the run's end needs. Of a run executing on this replica, the events before it neither
    /// wake the follower nor are copied; followed from the store (a run elsewhere, or events
    /// before this segment), each notice still wakes it and each event is still read.
    End,
}

type Item = Result<pb::RunEvent, tonic::Status>;

/// The events of one watch, as the RPC streams them. The watch is followed inside the stream's
/// own poll, on the RPC's task: an event reaches the client with one wake-up, where a task of
/// its own handed each event through a channel with two (issue 13). A client that leaves drops
/// the stream, and the following ends with it.
pub struct Watch(std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Item> + Send>>);

impl Watch {
    /// A watch with nothing to deliver.
    pub(super) fn over() -> Self {
        Watch(Box::pin(futures_util::stream::empty()))
    }

    /// The next result this watch delivers (a terminal event, as a RunResult) with its seq;
    /// `None` when the watch ends without one.
    pub async fn result(&mut self) -> Result<Option<(u64, pb::RunResult)>, tonic::Status> {
        while let Some(event) = tokio_stream::StreamExt::next(self).await {
            let event = event?;
            if let Some(result) = crate::api::terminal_result(&event) {
                return Ok(Some((event.seq, result)));
            }
        }
        Ok(None)
    }
}

impl tokio_stream::Stream for Watch {
    type Item = Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.as_mut().poll_next(cx)
    }
}

/// What a local follower waits on: each publish, or only the run's end.
enum Changes {
    Published(watch::Receiver<u64>),
    Settled(watch::Receiver<bool>),
}

impl Changes {
    fn mark_seen(&mut self) {
        match self {
            Changes::Published(r) => {
                r.borrow_and_update();
            }
            Changes::Settled(r) => {
                r.borrow_and_update();
            }
        }
    }

    /// Err: the segment's log is gone.
    async fn changed(&mut self) -> Result<(), watch::error::RecvError> {
        match self {
            Changes::Published(r) => r.changed().await,
            Changes::Settled(r) => r.changed().await,
        }
    }
}

/// Events a replay reads from the store at a time.
const REPLAY_PAGE: usize = 256;

impl Follow {
    /// Follows `run_id` (on `thread_id`) from the event after `after`.
    pub(super) fn new(
        live: Arc<Live>,
        store: SharedStore,
        run_id: &str,
        thread_id: String,
        after: u64,
        deliver: Deliver,
    ) -> Self {
        Follow {
            live,
            store,
            run_id: run_id.to_owned(),
            thread_id,
            after,
            waiting: None,
            caught_up: false,
            terminal_only: deliver == Deliver::End,
        }
    }

    /// Whether a watch from `after` has nothing to deliver: the run's stream segment ended at
    /// or before `after` (WatchRun then returns at once instead of waiting forever).
    pub(super) fn already_over(state: RunState, last_event_seq: u64, after: u64) -> bool {
        (state.is_terminal() || state == RunState::AwaitingConfirmation) && last_event_seq <= after
    }

    pub(super) fn start(self) -> Watch {
        use futures_util::StreamExt as _;
        let batches = futures_util::stream::unfold(Some(self), |follow| async move {
            let mut follow = follow?;
            let mut out = Vec::new();
            let over = match follow.next(&mut out).await {
                Ok(over) => over,
                Err(e) => {
                    out.push(Err(tonic::Status::from(e)));
                    true
                }
            };
            Some((out, (!over).then_some(follow)))
        });
        // Fused: polled again after its end, it ends again, as a channel's receiver did.
        Watch(Box::pin(
            batches.flat_map(futures_util::stream::iter).fuse(),
        ))
    }

    /// The watch's next events into `out` (none: look again); true when the watch is over.
    async fn next(&mut self, out: &mut Vec<Item>) -> Result<bool, ApiError> {
        match self.live.local(&self.run_id) {
            Some(local) => {
                self.waiting = None;
                self.caught_up = false;
                self.next_local(&local, out).await
            }
            None => self.next_remote(out).await,
        }
    }

    /// Adds one event (passed over when only the terminal one is wanted and this is not it);
    /// true when it ends the watch.
    fn push(&mut self, mut event: pb::RunEvent, out: &mut Vec<Item>) -> bool {
        if event.seq <= self.after {
            return false;
        }
        self.after = event.seq;
        let terminal = is_terminal(&event);
        if self.terminal_only && !terminal {
            return false;
        }
        event.run_id.clone_from(&self.run_id);
        event.thread_id.clone_from(&self.thread_id);
        if let Some(pb::run_event::Kind::Result(r)) = &mut event.kind {
            // Ends written without the run at hand (a cancel, a supersede, the monitor's) are
            // encoded once for any run; the caller is owed which run and thread it was (A-3).
            if r.run_id.is_empty() {
                r.run_id.clone_from(&self.run_id);
            }
            if r.thread_id.is_empty() {
                r.thread_id.clone_from(&self.thread_id);
            }
        }
        out.push(Ok(event));
        terminal
    }

    /// A page of durable events after `self.after`, up to `until` (inclusive) if given: whether
    /// the watch is over, and whether the store may hold more of them.
    async fn replay_page(
        &mut self,
        until: Option<u64>,
        out: &mut Vec<Item>,
    ) -> Result<(bool, bool), ApiError> {
        let page = self
            .store
            .events_after(&self.run_id, self.after, REPLAY_PAGE)
            .await?;
        let more = page.len() == REPLAY_PAGE;
        for (seq, payload) in page {
            if until.is_some_and(|u| seq > u) {
                return Ok((false, false));
            }
            let Ok(mut event) = pb::RunEvent::decode(payload.as_slice()) else {
                tracing::error!(run_id = %self.run_id, seq, "undecodable run event skipped");
                self.after = seq;
                continue;
            };
            event.seq = seq;
            if self.push(event, out) {
                return Ok((true, false));
            }
        }
        Ok((false, more))
    }

    /// The next events of a segment executing here: those before it from the store first, then
    /// its own as it publishes them. None and not over: the segment closed (what follows is in
    /// the store or another segment).
    async fn next_local(&mut self, run: &LiveRun, out: &mut Vec<Item>) -> Result<bool, ApiError> {
        // Subscribed before the log is read, so a publish after the read is not missed.
        let mut changes = if self.terminal_only {
            Changes::Settled(run.settled.subscribe())
        } else {
            Changes::Published(run.last.subscribe())
        };
        let first_seq = run.first_seq();
        if self.after + 1 < first_seq {
            let (over, more) = self.replay_page(Some(first_seq - 1), out).await?;
            if over || more || !out.is_empty() {
                return Ok(over);
            }
        }
        loop {
            changes.mark_seen();
            let (events, last, closed) = run.since(self.after, self.terminal_only);
            let mut over = false;
            for event in events {
                if self.push(event, out) {
                    over = true;
                    break;
                }
            }
            if !over {
                // What was passed over is behind this watch, as if delivered.
                self.after = self.after.max(last);
            }
            if over || closed || !out.is_empty() {
                return Ok(over);
            }
            if changes.changed().await.is_err() {
                return Ok(false);
            }
        }
    }

    /// The next events of a run executing elsewhere, from the store: read to its end, then
    /// again only after a notice says it has new ones (or the poll fallback comes first).
    async fn next_remote(&mut self, out: &mut Vec<Item>) -> Result<bool, ApiError> {
        if self.caught_up {
            if let Some((_, woken)) = &mut self.waiting {
                tokio::select! {
                    () = woken.as_mut() => {}
                    () = tokio::time::sleep(POLL_FALLBACK) => {}
                }
            }
            self.waiting = None;
            self.caught_up = false;
        }
        // Registered, and enabled, before the store is read, so a notice after the read is not
        // missed; kept until the store has been read to its end and a notice awaited.
        if self.waiting.is_none() {
            let wait = self.live.wait_remote(&self.run_id);
            let mut woken = Box::pin(wait.notify.clone().notified_owned());
            woken.as_mut().enable();
            self.waiting = Some((wait, woken));
        }
        let (over, more) = self.replay_page(None, out).await?;
        self.caught_up = !more;
        Ok(over)
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        task::{Context, Poll, Wake, Waker},
    };

    use tokio_stream::Stream as _;

    use super::*;
    use crate::store::memory::MemoryStore;

    /// Counts how often the follower's task is woken.
    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn event(seq: u64, terminal: bool) -> pb::RunEvent {
        let kind = if terminal {
            pb::run_event::Kind::Result(Box::default())
        } else {
            pb::run_event::Kind::Delta(pb::DeltaEvent {
                text: format!("part {seq}"),
                reset: false,
            })
        };
        pb::RunEvent {
            run_id: "r".into(),
            seq,
            kind: Some(kind),
            ..Default::default()
        }
    }

    fn following(deliver: Deliver) -> (Arc<LiveRun>, Watch) {
        let live = Arc::new(Live::default());
        let run = live.open("r", 0);
        let store: SharedStore = Arc::new(MemoryStore::new());
        let watch = Follow::new(live, store, "r", "t".into(), 0, deliver).start();
        (run, watch)
    }

    fn poll(watch: &mut Watch, wakes: &Arc<Wakes>) -> Poll<Option<Item>> {
        let waker = Waker::from(wakes.clone());
        std::pin::Pin::new(watch).poll_next(&mut Context::from_waker(&waker))
    }

    fn seq(polled: Poll<Option<Item>>) -> u64 {
        match polled {
            Poll::Ready(Some(Ok(event))) => event.seq,
            other => panic!("expected an event, got {other:?}"),
        }
    }

    #[test]
    fn a8_a_follower_of_the_end_is_not_woken_by_the_events_before_it() {
        let (run, mut watch) = following(Deliver::End);
        let wakes = Arc::new(Wakes::default());
        run.publish(event(1, false));
        assert!(
            poll(&mut watch, &wakes).is_pending(),
            "event 1 is passed over"
        );
        run.publish(event(2, false));
        run.publish(event(3, false));
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            0,
            "no wake-up before the end"
        );
        run.publish(event(4, true));
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "woken by the end");
        let end = poll(&mut watch, &wakes);
        assert_eq!(seq(end), 4, "only the terminal event is delivered");
        assert!(matches!(poll(&mut watch, &wakes), Poll::Ready(None)));
    }

    #[test]
    fn a8_a_follower_of_every_event_is_woken_by_each_and_given_all() {
        let (run, mut watch) = following(Deliver::Every);
        let wakes = Arc::new(Wakes::default());
        run.publish(event(1, false));
        assert_eq!(seq(poll(&mut watch, &wakes)), 1);
        assert!(poll(&mut watch, &wakes).is_pending());
        run.publish(event(2, false));
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert_eq!(seq(poll(&mut watch, &wakes)), 2);
        run.publish(event(3, true));
        assert_eq!(seq(poll(&mut watch, &wakes)), 3);
        assert!(matches!(poll(&mut watch, &wakes), Poll::Ready(None)));
    }

    #[tokio::test]
    async fn a8_a_follower_of_the_end_is_woken_when_the_segment_closes_without_one() {
        let live = Arc::new(Live::default());
        let run = live.open("r", 0);
        let store: SharedStore = Arc::new(MemoryStore::new());
        let mut watch = Follow::new(live.clone(), store, "r", "t".into(), 0, Deliver::End).start();
        let wakes = Arc::new(Wakes::default());
        run.publish(event(1, false));
        assert!(poll(&mut watch, &wakes).is_pending());
        // A shutdown: the segment ends with no terminal event; what follows is in the store.
        live.close("r", &run);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "woken by the close");
    }
}
