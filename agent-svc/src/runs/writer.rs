//! The one writer of a run segment (E-11, S-4). The lease holder numbers the run's events
//! itself, shows them to local watchers at once, and makes them durable together with the LLM
//! turns, action states and messages of the same step in one fenced transaction: before a side
//! effect runs (a checkpoint), when the next iteration starts, and at the end. A commit takes
//! in everything the loop has sent by then, so a database slower than the loop gets fewer,
//! larger commits instead of a queue of them that the run's end would wait behind. Text deltas are
//! coalesced into rows: 2 KB, or a window of 50 ms that doubles with each row of one answer up
//! to 1 s (a quick first paint, a few dozen rows for a long answer). A separate task renews the
//! lease until the segment ends; losing it stops the run.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use prost::Message as _;
use steward_proto::agent::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{event_kind, live::LiveRun};
use crate::{
    api::convert,
    executor::{CallRecord, EventSink, RunEvent},
    store::{
        Action, ActionState, Lease, MessageKind, MessageSource, NewMessage, RunCommit, SharedStore,
        StoreError, action_id,
    },
};

/// A coalesced delta row is cut after this long at first (a quick first paint)…
const DELTA_WINDOW: Duration = Duration::from_millis(50);
/// …the window doubles with each row of the same answer, up to this (a long answer is a few
/// dozen rows, not one per 50 ms)…
const DELTA_WINDOW_MAX: Duration = Duration::from_secs(1);
/// …or when it holds this many bytes.
const DELTA_BYTES: usize = 2048;
/// Events not yet durable are flushed after this long…
const FLUSH_AFTER: Duration = Duration::from_millis(250);
/// …or when this many are pending; at most this many are shown to watchers before they are
/// durable (the rest wait for their commit). The monitor's terminal event skips past them.
pub(super) const MAX_VOLATILE_EVENTS: usize = 64;
/// How long a failed flush is retried (a database restart) before the run gives up.
const FLUSH_RETRY_FOR: Duration = Duration::from_secs(10);

/// Why a segment was stopped before the executor finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum StopReason {
    /// CancelRun, from this replica or another.
    Cancelled,
    /// The lease was lost: someone else may own the run now; write nothing more.
    LeaseLost,
    /// The run's progress could not be made durable.
    WriteFailed(String),
    /// This replica is shutting down: commit progress and end the run INTERRUPTED with the
    /// release of its lease (a continuation that has not carried out its decision is released
    /// without an end, for another replica's monitor to continue).
    Shutdown,
}

/// Stops a segment, remembering the first reason.
#[derive(Clone, Default)]
pub(super) struct Stopper {
    pub(super) token: CancellationToken,
    reason: Arc<Mutex<Option<StopReason>>>,
}

impl Stopper {
    pub(super) fn stop(&self, why: StopReason) {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(why);
        self.token.cancel();
    }

    /// Whether `other` is this very stopper (a clone of it), not another segment's.
    pub(super) fn same(&self, other: &Stopper) -> bool {
        Arc::ptr_eq(&self.reason, &other.reason)
    }

    pub(super) fn reason(&self) -> Option<StopReason> {
        if !self.token.is_cancelled() {
            return None;
        }
        Some(
            self.reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or(StopReason::Cancelled),
        )
    }
}

/// Renews `lease` every third of `ttl` until `done`; a lost lease or a cancel request (from
/// any replica) stops the segment. Renewal errors are retried until the lease would lapse.
pub(super) fn keep_lease(
    store: SharedStore,
    lease: Lease,
    ttl: Duration,
    stopper: Stopper,
    done: CancellationToken,
) {
    tokio::spawn(async move {
        let every = ttl / 3;
        let mut last_ok = Instant::now();
        loop {
            tokio::select! {
                () = done.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            // A renewal that hangs (a connection black-holed) must not outlast the lease: the
            // run would go on after another run took its thread. It gives up half a renewal
            // period before the lease lapses, and the run stops.
            let left = ttl.saturating_sub(last_ok.elapsed() + every / 2);
            let renewed = tokio::time::timeout(left, store.renew_lease(&lease, ttl))
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::Unavailable(
                        "the lease renewal did not answer in time".into(),
                    ))
                });
            match renewed {
                Ok(Some(cancel_requested)) => {
                    last_ok = Instant::now();
                    if cancel_requested {
                        stopper.stop(StopReason::Cancelled);
                    }
                }
                Ok(None) => {
                    tracing::error!(run_id = %lease.run_id, "the run lost its thread lease; stopping it");
                    stopper.stop(StopReason::LeaseLost);
                    return;
                }
                Err(e) if last_ok.elapsed() + every >= ttl => {
                    tracing::error!(run_id = %lease.run_id, error = %e, "could not renew the thread lease before it lapses; stopping the run");
                    stopper.stop(StopReason::LeaseLost);
                    return;
                }
                Err(e) => {
                    tracing::warn!(run_id = %lease.run_id, error = %e, "could not renew the thread lease; retrying");
                }
            }
        }
    });
}

/// What the executor (and the policy runner) send the writer, in order.
pub(super) enum WriterMsg {
    /// Boxed: an unbounded channel allocates its slots in blocks of 32 up front, and by value
    /// each slot was 128 bytes, 4 KiB per run in flight (issue 13).
    Event(Box<RunEvent>),
    /// These calls are about to run: record them executing; with an answer channel (a side
    /// effect is among them), make everything so far durable first, then answer.
    Checkpoint(Vec<String>, Option<oneshot::Sender<Result<(), String>>>),
}

/// The executor's event sink: forwards to the writer, in order.
pub(super) struct WriterSink {
    pub(super) tx: mpsc::UnboundedSender<WriterMsg>,
    pub(super) in_flight: SideEffectsInFlight,
    /// The segment's stop token: once it fires the loop starts nothing more.
    pub(super) stop: CancellationToken,
}

impl EventSink for WriterSink {
    fn emit(&self, event: RunEvent) {
        let answered = match &event {
            RunEvent::ToolResult { call_id, .. } => Some(call_id.clone()),
            _ => None,
        };
        let _ = self.tx.send(WriterMsg::Event(Box::new(event)));
        // After the send: once the set is empty, every result is with the writer.
        if let Some(call_id) = answered {
            self.in_flight.answered(&call_id);
        }
    }

    fn halted(&self) -> bool {
        self.stop.is_cancelled()
    }
}

/// Side-effect calls handed to the gateway whose results the executor has not yet emitted. A
/// stopped run waits for them (within a grace) before it drops the loop: a send that already
/// left is recorded with what it came to, never left `executing` with its outcome unknown.
#[derive(Clone)]
pub(super) struct SideEffectsInFlight {
    waiting: Arc<tokio::sync::watch::Sender<HashSet<String>>>,
    /// Every side effect this segment sent, answered or not: a result that never reached the
    /// record (a failed write dropped it) must not be answered "not executed" at the end.
    ever_sent: Arc<Mutex<HashSet<String>>>,
}

impl Default for SideEffectsInFlight {
    fn default() -> Self {
        Self {
            waiting: Arc::new(tokio::sync::watch::Sender::new(HashSet::new())),
            ever_sent: Arc::default(),
        }
    }
}

impl SideEffectsInFlight {
    pub(super) fn sent(&self, call_ids: Vec<String>) {
        self.ever_sent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(call_ids.iter().cloned());
        self.waiting.send_modify(|s| s.extend(call_ids));
    }

    fn was_sent(&self, call_id: &str) -> bool {
        self.ever_sent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(call_id)
    }

    fn answered(&self, call_id: &str) {
        self.waiting.send_if_modified(|s| s.remove(call_id));
    }

    /// Resolves when no side effect is waiting for its result.
    async fn settled(&self) {
        let _ = self.waiting.subscribe().wait_for(HashSet::is_empty).await;
    }
}

/// How long a run stopped by a shutdown waits for the side effects it has in flight: inside
/// the 5 s the service gives its runs to commit and hand their threads back.
const SHUTDOWN_SIDE_EFFECT_GRACE: Duration = Duration::from_secs(3);

/// How long a stopped segment waits for a side effect already sent: the call's own deadline
/// (`cancel_grace`) for a cancel, [`SHUTDOWN_SIDE_EFFECT_GRACE`] for a shutdown; `None` for a
/// lost lease or a failed write, whose record cannot be trusted to take more.
fn effect_grace(stopper: &Stopper, cancel_grace: Duration) -> Option<Duration> {
    match stopper.reason()? {
        StopReason::Cancelled => Some(cancel_grace),
        StopReason::Shutdown => Some(SHUTDOWN_SIDE_EFFECT_GRACE),
        StopReason::LeaseLost | StopReason::WriteFailed(_) => None,
    }
}

/// Resolves when a stopped segment may drop its loop: at once for a lost lease or a failed
/// write (the record cannot be trusted to take more), and for a cancel or a shutdown once the side effects
/// in flight have their results — within `cancel_grace` (the calls' own deadline) or
/// [`SHUTDOWN_SIDE_EFFECT_GRACE`]. Reads in flight are dropped; the run's end answers them.
pub(super) async fn stopped_between_effects(
    stopper: &Stopper,
    in_flight: &SideEffectsInFlight,
    cancel_grace: Duration,
) {
    stopper.token.cancelled().await;
    let Some(grace) = effect_grace(stopper, cancel_grace) else {
        return;
    };
    if tokio::time::timeout(grace, in_flight.settled())
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "a stopped run's side effects did not answer in time; their outcome is left to the gateway's record"
        );
    }
}

/// `work` (a side effect already sent) to its end, unless the run is stopped: then for at most
/// the stop's grace, as [`stopped_between_effects`] gives one of the loop's. `None`: stopped,
/// and `work` did not finish in time (it is dropped).
pub(super) async fn unless_stopped<F: std::future::Future>(
    work: F,
    stopper: &Stopper,
    cancel_grace: Duration,
) -> Option<F::Output> {
    tokio::pin!(work);
    tokio::select! {
        biased;
        out = &mut work => return Some(out),
        () = stopper.token.cancelled() => {}
    }
    let grace = effect_grace(stopper, cancel_grace).unwrap_or(Duration::ZERO);
    let out = tokio::time::timeout(grace, work).await.ok();
    if out.is_none() {
        tracing::warn!(
            ?grace,
            "a stopped run's side effect did not answer in time; its outcome is left to the gateway's record"
        );
    }
    out
}

/// Tells the writer that `executing` calls are about to run. With `durable` (a side effect is
/// among them) it waits until that and everything before it is committed — a crash from then
/// on still shows what may have happened; Err when it could not be. Reads are recorded with
/// the next commit instead (the start of the next iteration), so they cost no round trip.
pub(super) async fn checkpoint(
    tx: &mpsc::UnboundedSender<WriterMsg>,
    executing: Vec<String>,
    durable: bool,
) -> Result<(), String> {
    let stopped = || "the run's writer has stopped".to_owned();
    if !durable {
        return tx
            .send(WriterMsg::Checkpoint(executing, None))
            .map_err(|_| stopped());
    }
    let (done, wait) = oneshot::channel();
    tx.send(WriterMsg::Checkpoint(executing, Some(done)))
        .map_err(|_| stopped())?;
    wait.await.map_err(|_| stopped())?
}

pub(super) struct RunWriter {
    store: SharedStore,
    live: Arc<LiveRun>,
    pub(super) lease: Lease,
    thread_id: String,
    run_id: String,
    next_seq: u64,
    pending: RunCommit,
    pending_since: Option<Instant>,
    /// (thinking?, text, since) of the delta row being coalesced.
    delta: Option<(bool, String, Instant)>,
    /// The current delta window (grows while one answer streams, resets after it).
    delta_window: Duration,
    /// Terminal events and approval requests wait for their commit: a client that sees the
    /// end can read it, and one that sees an approval can decide it.
    held: Vec<pb::RunEvent>,
    /// The run's actions by call id, as they are now.
    pub(super) actions: HashMap<String, Action>,
    pub(super) side_effects: HashSet<String>,
    /// The only tools the run may use (`None`: every tool); a pause hands them to its resume.
    pub(super) allowed_tools: Option<Vec<String>>,
    /// What the segment has read and the previews of its paused calls (issue 14).
    pub(super) guard: Arc<super::guard::CallGuard>,
    /// What the run's model calls have cost so far, its earlier segments' included: each
    /// call's cost goes with the next commit, so a run cancelled, failed or lost mid-way still
    /// accounts for every call that answered (E-10).
    pub(super) spent: crate::store::RunUsage,
    /// Iterations of the run's earlier segments (a continuation adds to them).
    pub(super) iterations_before: u32,
    /// This segment's iteration, as the executor last announced it.
    iteration: u32,
    /// Commits made by this segment.
    pub(super) commits: u32,
    /// The run's row says it read external content (its session's archive will say so).
    marked_external: bool,
    /// Side effects sent and not yet answered (a stop waits for them).
    pub(super) in_flight: SideEffectsInFlight,
}

impl RunWriter {
    pub(super) fn new(store: SharedStore, live: Arc<LiveRun>, lease: Lease, last_seq: u64) -> Self {
        Self {
            store,
            live,
            thread_id: lease.thread_id.clone(),
            run_id: lease.run_id.clone(),
            lease,
            next_seq: last_seq + 1,
            pending: RunCommit::default(),
            pending_since: None,
            delta: None,
            delta_window: DELTA_WINDOW,
            held: Vec::new(),
            actions: HashMap::new(),
            side_effects: HashSet::new(),
            allowed_tools: None,
            guard: Arc::default(),
            spent: Default::default(),
            iterations_before: 0,
            iteration: 0,
            commits: 0,
            marked_external: false,
            in_flight: SideEffectsInFlight::default(),
        }
    }

    /// A segment stopped mid-step (`why`: "cancelled", "stopped …") answers the calls its loop
    /// recorded as actions and left open, so their actions and the transcript say what became
    /// of them now rather than at the thread's next run: a call that never ran did not happen,
    /// and a read cut short only read. A side effect that was sent and whose result is not in
    /// the record (it did not answer within the stop's grace, or a failed write dropped its
    /// result) stays `executing` and unanswered: only the gateway's record can say whether it
    /// happened, and the thread's next run asks it.
    pub(super) fn answer_stopped_calls(&mut self, why: &str, error_kind: &str) {
        let in_flight = self.in_flight.clone();
        let mut open: Vec<(String, String, ActionState, bool)> = self
            .actions
            .values()
            .filter(|a| matches!(a.state, ActionState::Planned | ActionState::Executing))
            .filter(|a| !in_flight.was_sent(&a.call_id))
            .map(|a| (a.call_id.clone(), a.tool.clone(), a.state, a.side_effect))
            .collect();
        // In the order the model made them, as every provider wants results.
        open.sort_by_key(|(call_id, ..)| {
            self.actions
                .get(call_id)
                .map(|a| a.created_at)
                .unwrap_or(SystemTime::UNIX_EPOCH)
        });
        for (call_id, name, state, side_effect) in open {
            let text = if state == ActionState::Executing && !side_effect {
                format!(
                    "Not completed: the run was {why} while this call ran. It only read data; call it again if you still need it."
                )
            } else {
                format!("Not executed: the run was {why} before this call ran.")
            };
            for event in [
                RunEvent::ToolResult {
                    call_id: call_id.clone(),
                    name: name.clone(),
                    ok: false,
                    preview: text.clone(),
                    text: text.clone(),
                    error_kind: error_kind.into(),
                    truncated: false,
                },
                RunEvent::Turn(crate::llm::Turn::ToolResult {
                    call_id,
                    name,
                    content: text,
                    is_error: true,
                }),
            ] {
                self.record(event);
            }
        }
    }

    /// The pending commit, for what the run adds beside its events (turns, patches, …).
    pub(super) fn pending(&mut self) -> &mut RunCommit {
        self.pending_since.get_or_insert_with(Instant::now);
        &mut self.pending
    }

    /// Numbers an event, shows it to local watchers and queues it for the next commit.
    pub(super) fn emit(&mut self, kind: pb::run_event::Kind) {
        if !matches!(
            kind,
            pb::run_event::Kind::Delta(_) | pb::run_event::Kind::ThoughtDelta(_)
        ) {
            self.cut_delta();
            self.delta_window = DELTA_WINDOW;
        }
        let event = pb::RunEvent {
            run_id: self.run_id.clone(),
            seq: self.next_seq,
            time: Some(convert::timestamp(SystemTime::now())),
            thread_id: self.thread_id.clone(),
            kind: Some(kind),
        };
        self.next_seq += 1;
        self.pending()
            .events
            .push((event.seq, event.encode_to_vec()));
        // A terminal event is shown once durable, and so is an approval request: a watcher
        // acts on its id, which a commit that never lands (a crash, a refusal) would leave
        // unknown to DecideApproval. So is any event past the first MAX_VOLATILE_EVENTS not yet
        // durable (and every one after it, to keep their order): the monitor numbers a dead
        // writer's terminal event just past that many, and a watcher shown further would
        // take it for one it had seen and wait forever.
        let held_until_durable = matches!(
            event.kind,
            Some(
                pb::run_event::Kind::Result(_)
                    | pb::run_event::Kind::Error(_)
                    | pb::run_event::Kind::ApprovalRequired(_)
            )
        );
        if held_until_durable
            || !self.held.is_empty()
            || self.pending.events.len() > MAX_VOLATILE_EVENTS
        {
            self.held.push(event);
        } else {
            self.live.publish(event);
        }
    }

    fn cut_delta(&mut self) {
        if let Some((thinking, text, _)) = self.delta.take() {
            self.delta_window = (self.delta_window * 2).min(DELTA_WINDOW_MAX);
            self.emit(if thinking {
                pb::run_event::Kind::ThoughtDelta(pb::ThoughtDeltaEvent { text })
            } else {
                pb::run_event::Kind::Delta(pb::DeltaEvent { text, reset: false })
            });
        }
    }

    fn delta(&mut self, thinking: bool, text: String) {
        match &mut self.delta {
            Some((t, buf, _)) if *t == thinking => buf.push_str(&text),
            _ => {
                self.cut_delta();
                self.delta = Some((thinking, text, Instant::now()));
            }
        }
        if self
            .delta
            .as_ref()
            .is_some_and(|d| d.1.len() >= DELTA_BYTES)
        {
            self.cut_delta();
        }
    }

    fn action(&mut self, call_id: &str) -> Option<&mut Action> {
        self.actions.get_mut(call_id)
    }

    /// Queues an action as it is now.
    pub(super) fn stage_action(&mut self, call_id: &str) {
        if let Some(a) = self.actions.get(call_id).cloned() {
            let pending = &mut self.pending().actions;
            match pending.iter_mut().find(|p| p.id == a.id) {
                Some(staged) => *staged = a,
                None => pending.push(a),
            }
        }
    }

    /// Takes one executor event: actions, messages and turns for the next commit, the event
    /// itself for watchers. True when it marks a point to commit at (the next iteration).
    fn record(&mut self, event: RunEvent) -> bool {
        match &event {
            RunEvent::TextDelta(t) => {
                self.delta(false, t.clone());
                return false;
            }
            RunEvent::ThinkingDelta(t) => {
                self.delta(true, t.clone());
                return false;
            }
            RunEvent::DeltaReset => {
                // What was streamed of this turn is void: drop what is not shown yet, tell
                // the client to discard what it has.
                self.delta = None;
                self.emit(pb::run_event::Kind::Delta(pb::DeltaEvent {
                    text: String::new(),
                    reset: true,
                }));
                return false;
            }
            RunEvent::ModelCall(call) => {
                self.spend(call);
                return false;
            }
            RunEvent::Planning { iteration } => self.iteration = *iteration,
            RunEvent::Turn(turn) => {
                match super::to_json(turn) {
                    Ok(text) => self.pending().history.push(text),
                    Err(e) => {
                        tracing::error!(run_id = %self.run_id, error = %e, "unserializable turn left out of history")
                    }
                }
                return false;
            }
            RunEvent::ToolCall {
                call_id,
                name,
                args,
                ..
            } => {
                let now = SystemTime::now();
                self.actions.insert(
                    call_id.clone(),
                    Action {
                        id: action_id(&self.run_id, call_id),
                        run_id: self.run_id.clone(),
                        call_id: call_id.clone(),
                        tool: name.clone(),
                        arguments: args.clone(),
                        side_effect: self.side_effects.contains(name),
                        state: ActionState::Planned,
                        result_text: None,
                        error_kind: None,
                        approval_id: None,
                        transitions: vec![ActionState::Planned],
                        created_at: now,
                        updated_at: now,
                    },
                );
                self.stage_action(call_id);
            }
            RunEvent::ToolResult {
                call_id,
                name,
                ok,
                preview,
                text,
                error_kind,
                ..
            } => {
                let mut executed_side_effect = false;
                if let Some(a) = self.action(call_id) {
                    executed_side_effect =
                        a.side_effect && a.transitions.contains(&ActionState::Executing);
                    a.to(if *ok {
                        ActionState::Completed
                    } else {
                        ActionState::Failed
                    });
                    a.result_text = Some(text.clone());
                    a.error_kind = Some(error_kind.clone()).filter(|k| !k.is_empty());
                }
                self.stage_action(call_id);
                if executed_side_effect {
                    self.pending()
                        .audit
                        .push(side_effect_result(name, call_id, *ok, error_kind));
                }
                let content = format!("{} {name}: {preview}", if *ok { "Ran" } else { "Tried" });
                self.pending().messages.push(NewMessage {
                    source: MessageSource::Agent,
                    kind: MessageKind::Tool,
                    content,
                    metadata: serde_json::json!({ "tool": name, "ok": ok }),
                });
            }
            _ => {}
        }
        let next_iteration = matches!(event, RunEvent::Planning { iteration } if iteration > 1);
        if let Some(kind) = event_kind(&self.run_id, event) {
            self.emit(kind);
        }
        next_iteration
    }

    /// Adds a model call's cost to the run's and stages it for the next commit.
    fn spend(&mut self, call: &CallRecord) {
        self.spent.add(call);
        let patch = crate::store::RunPatch {
            usage: Some(self.spent.clone()),
            iterations: Some(self.iterations_before + self.iteration),
            model: Some(call.model.clone()),
            ..Default::default()
        };
        self.pending().patch.merge(patch);
    }

    /// Commits what is pending, retrying a store that is briefly unavailable.
    pub(super) async fn flush(&mut self) -> Result<(), StoreError> {
        // A delta row still being coalesced is not an event yet: it is cut by its window, or
        // by the next event of another kind (every run ends with one).
        if self.pending.is_empty() {
            return Ok(());
        }
        // What the run has read from others goes on record with its next commit.
        let marking = !self.marked_external && self.guard.has_read();
        if marking {
            self.pending.read_external = true;
        }
        let started = Instant::now();
        let mut wait = Duration::from_millis(100);
        loop {
            match self.store.commit(&self.lease, self.pending.clone()).await {
                Ok(()) => {
                    self.marked_external |= marking;
                    self.committed();
                    return Ok(());
                }
                // The COMMIT went through but its answer was lost (the database went away right
                // then): doing it again would duplicate it, or, for the run's last commit,
                // which released the lease, be refused as a lost lease.
                Err(_) if self.landed().await => {
                    self.marked_external |= marking;
                    self.committed();
                    return Ok(());
                }
                Err(StoreError::LeaseLost) => return Err(StoreError::LeaseLost),
                Err(e @ StoreError::Rejected(_)) => return Err(e),
                Err(e) if started.elapsed() + wait > FLUSH_RETRY_FOR => return Err(e),
                Err(e) => {
                    tracing::warn!(run_id = %self.run_id, error = %e, "could not record the run's progress; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// The database refused the pending commit for good: none of its rows can be written, so
    /// its events, turns, actions, messages, audit and approval are set aside (never shown as
    /// durable; what watchers were already shown stays numbered, and what comes next is
    /// numbered after it). Of its patch of the run row only the accounting is kept (usage,
    /// iterations, model, start): a summary or prompt may hold what was refused, and the run's
    /// summary is cleared. What a side effect that ran came to is kept too (its
    /// `side_effect_result`, built here, never from content): its intent record is already
    /// durable. Returns what was set aside, for the log.
    pub(super) fn set_aside_refused(&mut self) -> String {
        let c = &mut self.pending;
        let outcomes: Vec<(String, serde_json::Value)> = c
            .audit
            .iter()
            .filter(|(kind, _)| kind == SIDE_EFFECT_RESULT)
            .cloned()
            .collect();
        c.audit.retain(|(kind, _)| kind != SIDE_EFFECT_RESULT);
        let said = format!(
            "{} events, {} turns, {} actions, {} messages, {} audit records{}",
            c.events.len(),
            c.history.len(),
            c.actions.len(),
            c.messages.len(),
            c.audit.len(),
            if c.approval.is_some() {
                ", an approval"
            } else {
                ""
            }
        );
        let patch = std::mem::take(&mut c.patch);
        *c = RunCommit {
            patch: crate::store::RunPatch {
                usage: patch.usage,
                iterations: patch.iterations,
                model: patch.model,
                started_at: patch.started_at,
                summary: Some(String::new()),
                ..Default::default()
            },
            read_external: c.read_external,
            audit: outcomes,
            ..RunCommit::default()
        };
        self.held.clear();
        self.delta = None;
        said
    }

    /// Takes back the last event emitted, whose commit failed: the run's end will not write it
    /// (its number stays unused; watchers that were shown it skip past). A commit whose answer
    /// was lost may still hold it.
    pub(super) fn withdraw_last_event(&mut self) {
        if let Some((seq, _)) = self.pending.events.pop()
            && self.held.last().is_some_and(|e| e.seq == seq)
        {
            self.held.pop();
        }
    }

    /// The pending commit is durable: clear it and show the events it held back.
    fn committed(&mut self) {
        self.commits += 1;
        self.pending = RunCommit::default();
        self.pending_since = None;
        for event in self.held.drain(..) {
            self.live.publish(event);
        }
    }

    /// Whether the pending commit is in the store already: its last event is there, byte for
    /// byte (its time included), so no other writer's event at that seq is taken for it.
    /// A commit without events (a model call's usage and its turn, flushed by the timer before
    /// the calls' events came) is known by its turns: the thread's history ends with them.
    /// Such turns are tool calls and results, whose call ids are the run's own, so no earlier
    /// turn passes for them; written twice, they would break every later call on the thread.
    async fn landed(&self) -> bool {
        let Some((last, payload)) = self.pending.events.last() else {
            return !self.pending.history.is_empty() && self.history_ends_with_pending().await;
        };
        matches!(
            self.store.events_after(&self.run_id, last - 1, 1).await,
            Ok(found) if found.first().is_some_and(|(seq, p)| seq == last && p == payload)
        )
    }

    /// Whether the thread's stored history ends with the pending commit's turns (compared as
    /// JSON: the database keeps its own spelling of them).
    async fn history_ends_with_pending(&self) -> bool {
        let Ok(stored) = self.store.history(&self.thread_id).await else {
            return false;
        };
        let pending = &self.pending.history;
        let Some(tail) = stored
            .len()
            .checked_sub(pending.len())
            .map(|at| &stored[at..])
        else {
            return false;
        };
        let json = |t: &str| serde_json::from_str::<serde_json::Value>(t).ok();
        tail.iter()
            .zip(pending)
            .all(|(a, b)| json(a).is_some_and(|a| Some(a) == json(b)))
    }

    fn due(&self) -> Option<Instant> {
        let delta = self.delta.as_ref().map(|d| d.2 + self.delta_window);
        let flush = self.pending_since.map(|s| s + FLUSH_AFTER);
        match (delta, flush) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Takes the executor's events until its sink closes, committing at each checkpoint, at
    /// the start of each later iteration and when events have waited too long. A failed
    /// commit stops the run (through `stopper`) and is returned.
    ///
    /// A commit takes in everything the executor has sent by then (group commit): when the
    /// database is slower than the loop, the iterations that piled up during one commit go
    /// out in the next one, so the writer never falls further behind than one commit and the
    /// run's end waits for at most one commit before its own.
    pub(super) async fn pump(
        &mut self,
        mut rx: mpsc::UnboundedReceiver<WriterMsg>,
        stopper: &Stopper,
    ) -> Result<(), StoreError> {
        let pumped = self.take_in(&mut rx, stopper).await;
        if pumped.is_err() {
            // The run is stopping (the stopper fired) without its progress; what its calls
            // cost still goes with its end. Everything else the executor sends until it stops
            // is dropped, and a checkpoint waiting for an answer is told the writer stopped.
            while let Some(msg) = rx.recv().await {
                if let WriterMsg::Event(event) = msg
                    && let RunEvent::ModelCall(call) = *event
                {
                    self.spend(&call);
                }
            }
        }
        pumped
    }

    async fn take_in(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<WriterMsg>,
        stopper: &Stopper,
    ) -> Result<(), StoreError> {
        loop {
            let due = self.due();
            let msg = tokio::select! {
                msg = rx.recv() => msg,
                () = sleep_until(due) => {
                    if self.delta.as_ref().is_some_and(|d| d.2.elapsed() >= self.delta_window) {
                        self.cut_delta();
                    }
                    if (self.pending_since.is_some_and(|s| s.elapsed() >= FLUSH_AFTER)
                        || self.pending.events.len() >= MAX_VOLATILE_EVENTS)
                        && self.commit_ready(rx, stopper, Vec::new()).await?
                    {
                        return Ok(());
                    }
                    continue;
                }
            };
            let closed = match msg {
                None => return Ok(()),
                Some(WriterMsg::Checkpoint(executing, done)) => {
                    self.executing(executing);
                    match done {
                        Some(done) => self.commit_ready(rx, stopper, vec![done]).await?,
                        None => false,
                    }
                }
                Some(WriterMsg::Event(event)) => {
                    if self.record(*event) || self.pending.events.len() >= MAX_VOLATILE_EVENTS {
                        self.commit_ready(rx, stopper, Vec::new()).await?
                    } else {
                        false
                    }
                }
            };
            if closed {
                return Ok(());
            }
        }
    }

    /// Calls about to run are recorded as executing with the next commit.
    fn executing(&mut self, call_ids: Vec<String>) {
        for call_id in call_ids {
            if let Some(a) = self.action(&call_id) {
                a.to(ActionState::Executing);
            }
            self.stage_action(&call_id);
        }
    }

    /// Takes in whatever the executor has sent already (up to the volatile limit), commits it
    /// all at once and answers the checkpoints that waited for it. True when the executor's
    /// sink closed meanwhile (everything it sent is in this commit).
    async fn commit_ready(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<WriterMsg>,
        stopper: &Stopper,
        mut waiting: Vec<oneshot::Sender<Result<(), String>>>,
    ) -> Result<bool, StoreError> {
        let mut closed = false;
        while self.pending.events.len() < MAX_VOLATILE_EVENTS {
            match rx.try_recv() {
                Ok(WriterMsg::Event(event)) => {
                    self.record(*event);
                }
                Ok(WriterMsg::Checkpoint(executing, done)) => {
                    self.executing(executing);
                    waiting.extend(done);
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        let flushed = self.flush_or_stop(stopper).await;
        for done in waiting {
            let _ = done.send(flushed.as_ref().map_err(ToString::to_string).copied());
        }
        flushed.map(|()| closed)
    }

    async fn flush_or_stop(&mut self, stopper: &Stopper) -> Result<(), StoreError> {
        let flushed = self.flush().await;
        match &flushed {
            Ok(()) => {}
            Err(StoreError::LeaseLost) => stopper.stop(StopReason::LeaseLost),
            Err(e) => stopper.stop(StopReason::WriteFailed(e.to_string())),
        }
        flushed
    }
}

/// The audit record of what a side effect that ran came to, beside the `side_effect` record
/// written before it (P-5): an audit trail read alone says whether the effect happened.
pub(super) fn side_effect_result(
    tool: &str,
    call_id: &str,
    ok: bool,
    error_kind: &str,
) -> (String, serde_json::Value) {
    (
        SIDE_EFFECT_RESULT.into(),
        serde_json::json!({"tool": tool, "call_id": call_id, "ok": ok, "error_kind": error_kind}),
    )
}

const SIDE_EFFECT_RESULT: &str = "side_effect_result";

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Admission, Admitted, Run, memory::MemoryStore};

    async fn writer() -> (RunWriter, SharedStore) {
        let store: SharedStore = Arc::new(MemoryStore::default());
        let admitted = store
            .admit(&Admission {
                run: Run::queued("r1", "t1", "alice", "api"),
                new_thread_title: Some("a thread".into()),
                user_message: None,
                first_event: b"queued".to_vec(),
                lease: Duration::from_secs(60),
                max_active_runs: 3,
                supersede_event: Vec::new(),
                supersede_message: String::new(),
                supersede_paused: true,
                summaries: 0,
            })
            .await
            .expect("admitted");
        let Admitted::Started { lease, .. } = admitted else {
            panic!("not started: {admitted:?}");
        };
        let live = super::super::live::Live::default().open("r1", 1);
        (RunWriter::new(store.clone(), live, lease, 1), store)
    }

    fn iteration(tx: &mpsc::UnboundedSender<WriterMsg>, iteration: u32) {
        for event in [
            RunEvent::Planning { iteration },
            RunEvent::Executing { calls: 1 },
        ] {
            tx.send(WriterMsg::Event(Box::new(event)))
                .expect("writer listens");
        }
    }

    #[tokio::test]
    async fn iterations_that_piled_up_while_the_writer_was_busy_go_out_in_one_commit() {
        let (mut writer, store) = writer().await;
        let (tx, rx) = mpsc::unbounded_channel();
        // Four iterations sent before the writer looks: each later one marks a commit point.
        for n in 1..=4 {
            iteration(&tx, n);
        }
        drop(tx);
        writer.pump(rx, &Stopper::default()).await.expect("pumped");
        assert_eq!(writer.commits, 1, "one commit took in every iteration");
        assert!(writer.pending.is_empty(), "nothing left behind");
        let seqs: Vec<u64> = store
            .events_after("r1", 1, 100)
            .await
            .expect("events")
            .into_iter()
            .map(|(seq, _)| seq)
            .collect();
        assert_eq!(
            seqs,
            (2..=9).collect::<Vec<u64>>(),
            "all eight events, in order"
        );
    }

    #[tokio::test]
    async fn r2_a_commit_of_turns_alone_whose_answer_was_lost_is_known_by_its_turns() {
        let (mut writer, store) = writer().await;
        let call = serde_json::json!({"Assistant": {"text": "", "tool_calls": [
            {"id": "call_r1_1", "name": "list_tasks", "arguments": "{}"}]}});
        writer.pending().history.push(call.to_string().into());
        assert!(!writer.landed().await, "not written yet");
        let commit = writer.pending.clone();
        store.commit(&writer.lease, commit).await.expect("written");
        // Its answer lost: the retry finds it in place rather than writing the turn again.
        assert!(writer.landed().await);
    }

    #[tokio::test]
    async fn a_checkpoint_taken_into_a_commit_is_answered_once_that_commit_is_durable() {
        let (mut writer, store) = writer().await;
        let (tx, rx) = mpsc::unbounded_channel();
        iteration(&tx, 1);
        iteration(&tx, 2);
        let (done, answered) = oneshot::channel();
        tx.send(WriterMsg::Checkpoint(Vec::new(), Some(done)))
            .expect("writer listens");
        iteration(&tx, 3);
        drop(tx);
        writer.pump(rx, &Stopper::default()).await.expect("pumped");
        assert_eq!(answered.await.expect("answered"), Ok(()));
        assert_eq!(writer.commits, 1);
        assert_eq!(
            store
                .events_after("r1", 1, 100)
                .await
                .expect("events")
                .len(),
            6
        );
    }

    #[tokio::test]
    async fn r2_watchers_are_shown_at_most_the_volatile_limit_of_events_before_they_are_durable() {
        let (mut writer, _store) = writer().await;
        let extra = 3;
        for n in 0..MAX_VOLATILE_EVENTS + extra {
            writer.emit(pb::run_event::Kind::Delta(pb::DeltaEvent {
                text: format!("part {n}"),
                reset: false,
            }));
        }
        let seqs = |writer: &RunWriter| -> Vec<u64> {
            let (shown, _, _) = writer.live.since(1, false);
            shown.iter().map(|e| e.seq).collect()
        };
        assert_eq!(
            seqs(&writer),
            (2..2 + MAX_VOLATILE_EVENTS as u64).collect::<Vec<_>>(),
            "no further than a dead writer's terminal event would be numbered"
        );
        writer.flush().await.expect("committed");
        assert_eq!(
            seqs(&writer),
            (2..2 + (MAX_VOLATILE_EVENTS + extra) as u64).collect::<Vec<_>>(),
            "the rest are shown once durable, in order"
        );
    }

    fn shown(writer: &RunWriter) -> Vec<u64> {
        let (shown, _, _) = writer.live.since(1, false);
        shown.iter().map(|e| e.seq).collect()
    }

    #[tokio::test]
    async fn an_approval_request_is_shown_to_watchers_only_once_durable() {
        let (mut writer, _store) = writer().await;
        writer.emit(pb::run_event::Kind::Delta(pb::DeltaEvent {
            text: "I will send it.".into(),
            reset: false,
        }));
        writer.emit(pb::run_event::Kind::ApprovalRequired(Box::default()));
        assert_eq!(
            shown(&writer),
            [2],
            "a watcher never acts on an approval that may not exist"
        );
        writer.flush().await.expect("committed");
        assert_eq!(shown(&writer), [2, 3]);
    }

    #[tokio::test]
    async fn a_refused_commit_is_set_aside_keeping_only_the_runs_accounting() {
        let (mut writer, _store) = writer().await;
        writer.emit(pb::run_event::Kind::Delta(pb::DeltaEvent {
            text: "shown".into(),
            reset: false,
        }));
        writer.emit(pb::run_event::Kind::Error(pb::ErrorEvent::default()));
        let pending = writer.pending();
        pending.history.push("{}".into());
        pending
            .messages
            .push(NewMessage::text(MessageSource::Agent, "refused"));
        let started = SystemTime::now();
        pending.patch = crate::store::RunPatch {
            state: Some(crate::store::RunState::Completed),
            usage: Some(crate::store::RunUsage::default()),
            iterations: Some(2),
            model: Some("gpt-4o".into()),
            started_at: Some(started),
            summary: Some("refused".into()),
            error: Some("refused".into()),
            system_prompt: Some("refused".into()),
            ..Default::default()
        };
        let said = writer.set_aside_refused();
        assert_eq!(
            said,
            "2 events, 1 turns, 0 actions, 1 messages, 0 audit records"
        );
        let kept = &writer.pending;
        assert!(kept.events.is_empty() && kept.history.is_empty() && kept.messages.is_empty());
        assert_eq!(
            kept.patch,
            crate::store::RunPatch {
                usage: Some(crate::store::RunUsage::default()),
                iterations: Some(2),
                model: Some("gpt-4o".into()),
                started_at: Some(started),
                summary: Some(String::new()),
                ..Default::default()
            },
            "only the run's accounting, and no summary"
        );
        writer.emit(pb::run_event::Kind::Error(pb::ErrorEvent::default()));
        assert_eq!(
            writer.pending.events[0].0, 4,
            "what comes next is numbered after what watchers were shown"
        );
        writer.flush().await.expect("committed");
        assert_eq!(shown(&writer), [2, 4], "the refused end is never shown");
    }

    #[tokio::test]
    async fn r2_a_last_commit_that_landed_but_whose_answer_was_lost_is_not_taken_for_a_lost_lease()
    {
        let (mut writer, store) = writer().await;
        writer.emit(pb::run_event::Kind::Error(pb::ErrorEvent {
            message: "the end".into(),
            ..Default::default()
        }));
        writer.pending.release = true;
        // It lands, and its answer never reaches the writer: the lease is released.
        store
            .commit(&writer.lease, writer.pending.clone())
            .await
            .expect("landed");
        assert!(matches!(
            store.commit(&writer.lease, writer.pending.clone()).await,
            Err(StoreError::LeaseLost)
        ));
        writer
            .flush()
            .await
            .expect("the writer finds its commit in the store");
        let (shown, _, _) = writer.live.since(1, false);
        assert_eq!(
            shown.len(),
            1,
            "the terminal event it held back is shown to watchers"
        );
    }

    #[tokio::test]
    async fn e10_a_call_that_answers_after_a_failed_commit_still_counts_in_the_runs_usage() {
        let (mut writer, store) = writer().await;
        // The lease is given up under the writer: its next commit is fenced out.
        store
            .commit(
                &writer.lease,
                RunCommit {
                    release: true,
                    ..RunCommit::default()
                },
            )
            .await
            .expect("released");
        let (tx, rx) = mpsc::unbounded_channel();
        let stopper = Stopper::default();
        let executor = async {
            iteration(&tx, 1);
            iteration(&tx, 2);
            // The failed commit stops the run; the call in flight answers as it stops.
            stopper.token.cancelled().await;
            let call = CallRecord {
                provider: "openai".into(),
                model: "gpt-4o".into(),
                usage: crate::llm::TokenUsage {
                    input_tokens: 100,
                    output_tokens: 20,
                    cached_tokens: 0,
                    cache_write_tokens: 0,
                },
                cost_usd: 0.5,
                latency: Duration::from_millis(3),
                retries: 0,
                started_at: SystemTime::now(),
            };
            tx.send(WriterMsg::Event(Box::new(RunEvent::ModelCall(call))))
                .expect("the writer still listens");
            drop(tx);
        };
        let (pumped, ()) = tokio::join!(writer.pump(rx, &stopper), executor);
        assert!(matches!(pumped, Err(StoreError::LeaseLost)));
        assert_eq!(
            writer
                .pending
                .patch
                .usage
                .as_ref()
                .map(|u| (u.input_tokens, u.calls.len())),
            Some((100, 1)),
            "staged for the run's end"
        );
        assert_eq!(writer.pending.patch.iterations, Some(2));
    }

    #[tokio::test]
    async fn the_writer_still_commits_each_iteration_when_it_keeps_up() {
        let (mut writer, store) = writer().await;
        let (tx, rx) = mpsc::unbounded_channel();
        let pump = async {
            writer.pump(rx, &Stopper::default()).await.expect("pumped");
            writer
        };
        let loop_ = async {
            for n in 1..=3 {
                iteration(&tx, n);
                // Sent one at a time, each once the last one is durable (seen in the store).
                let last = 2 * u64::from(n) - 2;
                while n > 1
                    && store
                        .events_after("r1", last, 1)
                        .await
                        .expect("events")
                        .is_empty()
                {
                    tokio::task::yield_now().await;
                }
            }
            drop(tx);
        };
        let (writer, ()) = tokio::join!(pump, loop_);
        assert_eq!(writer.commits, 2, "at the starts of iterations 2 and 3");
    }

    fn call(writer: &mut RunWriter, call_id: &str, name: &str) {
        writer.record(RunEvent::ToolCall {
            call_id: call_id.into(),
            name: name.into(),
            preview: "{}".into(),
            args: serde_json::json!({}),
        });
    }

    #[tokio::test]
    async fn a_stopped_run_answers_what_never_left_and_what_it_read_but_not_a_send_whose_result_it_lost()
     {
        let (mut writer, _store) = writer().await;
        writer.side_effects = ["gmail_send".to_owned()].into();
        for (call_id, name) in [
            ("sent", "gmail_send"),
            ("unsent", "gmail_send"),
            ("read", "list_tasks"),
        ] {
            call(&mut writer, call_id, name);
        }
        writer.executing(vec!["sent".into(), "unsent".into(), "read".into()]);
        // The send went out and answered, but a failed write dropped its result on the way.
        writer.in_flight.sent(vec!["sent".into()]);
        writer.in_flight.answered("sent");

        writer.answer_stopped_calls("cancelled", "CANCELLED");

        let state = |id: &str| writer.actions[id].state;
        assert_eq!(
            state("sent"),
            ActionState::Executing,
            "left for the gateway's record"
        );
        assert_eq!(state("unsent"), ActionState::Failed);
        assert_eq!(state("read"), ActionState::Failed);
        assert_eq!(
            writer.actions["unsent"].result_text.as_deref(),
            Some("Not executed: the run was cancelled before this call ran.")
        );
        assert!(
            writer.actions["read"]
                .result_text
                .as_deref()
                .is_some_and(|t| t.starts_with("Not completed: the run was cancelled")),
            "{:?}",
            writer.actions["read"].result_text
        );
        let answered: Vec<String> = writer
            .pending
            .history
            .iter()
            .map(|t| t.to_string())
            .collect();
        assert_eq!(answered.len(), 2, "{answered:?}");
        assert!(
            !answered.iter().any(|t| t.contains("\"sent\"")),
            "{answered:?}"
        );
    }
}
