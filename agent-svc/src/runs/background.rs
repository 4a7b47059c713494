//! Work that runs without a caller: session archiving (B-4), the health monitor (E-12) and
//! background task agents (B-5).

use super::*;
use crate::{
    executor::CallRecord,
    store::{LockOutcome, RunUsage, Tally},
};
use svc_kit::periodic::{FirstSweep, spawn_every};

/// How much of a session's transcript its summary model reads: the opening (who, what was
/// asked) and the end (what was decided, what is still open), which a long session's first
/// 20,000 characters alone would leave out.
const SUMMARY_HEAD_CHARS: usize = 4_000;
/// How long one replica's claim on summarising an idle session lasts: past a summary's
/// longest (two tries of 30 s and the wait between), so the claim outlives the work.
const ARCHIVE_CLAIM: Duration = Duration::from_secs(300);
const SUMMARY_TAIL_CHARS: usize = 16_000;

fn summarised_part(transcript: &str) -> String {
    let chars = transcript.chars().count();
    if chars <= SUMMARY_HEAD_CHARS + SUMMARY_TAIL_CHARS {
        return transcript.to_owned();
    }
    let head: String = transcript.chars().take(SUMMARY_HEAD_CHARS).collect();
    let tail: String = transcript
        .chars()
        .skip(chars - SUMMARY_TAIL_CHARS)
        .collect();
    format!("{head}\n[... the middle of the session is left out ...]\n{tail}")
}

impl RunService {
    /// Archives the thread's LLM history with a 2–3 sentence summary (B-4). Race-safe: the store
    /// moves the history in one transaction, so of two sweeps only one archives. Failures are
    /// logged; the run goes on.
    /// With `idle_before`, only a session still idle since then is archived: the sweep that
    /// found it idle summarises for a while, and the user may have come back meanwhile.
    pub async fn archive(
        &self,
        owner: &str,
        thread_id: &str,
        holder: Option<&Lease>,
        idle_before: Option<SystemTime>,
    ) {
        let history = match self.load_history(thread_id).await {
            Ok(h) if !h.is_empty() => h,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(thread_id, error = %e, "could not read history to archive");
                return;
            }
        };
        let (summary, spent) = self.summarize(&history).await;
        if !spent.calls.is_empty()
            && let Err(e) = self.store.record_summary_spend(owner, &spent).await
        {
            tracing::warn!(thread_id, owner, cost_usd = spent.cost_usd, input_tokens = spent.input_tokens,
                output_tokens = spent.output_tokens, error = %e, "could not record what a session summary cost");
        }
        let message = "The session was archived before this approval was decided.";
        let ending = cancel_ending(message, 1);
        match self
            .store
            .archive_history(thread_id, owner, &summary, &ending, holder, idle_before)
            .await
        {
            Ok(Some(a)) => tracing::info!(thread_id, turns = a.turn_count, "archived a session"),
            Ok(None) => {}
            Err(e) => tracing::warn!(thread_id, error = %e, "could not archive a session"),
        }
    }

    /// The summary model's 2–3 sentences, or the user's own messages when it is unavailable;
    /// with what the summary model's call cost, its owner's (E-10).
    async fn summarize(&self, history: &[Turn]) -> (String, RunUsage) {
        let mut spent = RunUsage::default();
        let transcript: Vec<String> = history
            .iter()
            .filter_map(|t| match t {
                Turn::User(text) => Some(format!("User: {text}")),
                Turn::Assistant { text, .. } if !text.is_empty() => {
                    Some(format!("Assistant: {text}"))
                }
                _ => None,
            })
            .collect();
        if let Some(entry) = &self.summary_model {
            let turns = [Turn::User(summarised_part(&transcript.join("\n")))];
            let request = ModelRequest {
                model: &entry.model,
                system: "Summarise this conversation in 2-3 sentences for your future self: who, what was decided, what is still open.",
                turns: &turns,
                tools: &crate::llm::ToolSet::none(),
                answer_only: true,
                stable_turns: 0,
                max_output_tokens: 300,
            };
            let (tx, _rx) = mpsc::unbounded_channel();
            let policy = RetryPolicy {
                retries: 1,
                call_timeout: Duration::from_secs(30),
                ..RetryPolicy::default()
            };
            // Two tries of 30 s and the backoff between them.
            let within = Duration::from_secs(70);
            let answered =
                resilient::complete(std::slice::from_ref(entry), &policy, &request, &tx, within)
                    .await;
            // What the provider read, for a try that billed without saying so.
            let counter = crate::executor::budget::TokenCounter::for_model(&entry.model);
            let sent =
                counter.text(request.system) + turns.iter().map(|t| counter.turn(t)).sum::<usize>();
            let cut = match &answered {
                Ok(done) => done.cut.as_slice(),
                Err(failed) => failed.cut.as_slice(),
            };
            for cut in cut {
                spent.add(&CallRecord::cut(cut, sent as u64, &self.models.prices));
            }
            match answered {
                Ok(mut done) => {
                    crate::executor::estimate_unreported(&mut done, sent, counter);
                    spent.add(&CallRecord::answered(&done, &self.models.prices));
                    let text = done.response.text.trim();
                    if !text.is_empty() {
                        return (text.to_owned(), spent);
                    }
                    tracing::warn!("the summary model returned nothing; using the user's messages")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the summary model failed; using the user's messages")
                }
            }
        }
        let asked: Vec<&str> = history
            .iter()
            .filter_map(|t| {
                if let Turn::User(text) = t {
                    Some(text.as_str())
                } else {
                    None
                }
            })
            .collect();
        let mut fallback = format!("The user said: {}", asked.join(" / "));
        if fallback.chars().count() > 500 {
            fallback = fallback.chars().take(500).collect::<String>() + "…";
        }
        (fallback, spent)
    }

    /// The monitor's second job: archive threads that have been quiet for the session timeout.
    pub async fn sweep_idle_sessions(&self) -> Result<usize, ApiError> {
        let before = SystemTime::now()
            .checked_sub(self.session_timeout)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let idle = self.store.idle_threads_with_history(before).await?;
        let mut n = 0;
        for (thread_id, owner) in idle {
            // Every replica sweeps; the one that claims the thread pays for its summary.
            match self.store.claim_archive(&thread_id, ARCHIVE_CLAIM).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(thread_id, error = %e, "could not claim an idle session to archive");
                    continue;
                }
            }
            self.archive(&owner, &thread_id, None, Some(before)).await;
            n += 1;
        }
        Ok(n)
    }

    /// The health monitor's sweep (E-12): a run still live whose thread lease lapsed (plus
    /// `grace`) lost its writer — its replica died or stalled. It is failed with a message and
    /// a terminal event — or, when its cancel was requested, ended cancelled with the reason
    /// given —, and its thread freed, by one conditional transaction (one sweeper wins; a
    /// writer whose lease is live again is left alone). A run whose approval was
    /// decided but never continued is continued instead (see `take_up_decided`). Returns how
    /// many runs it ended or continued.
    pub async fn sweep_stale_runs(self: &Arc<Self>, grace: Duration) -> Result<usize, ApiError> {
        let mut ended = 0;
        for run in self.store.abandoned_runs(grace, 200).await? {
            match self.take_up_decided(&run).await {
                Ok(true) => {
                    ended += 1;
                    continue;
                }
                Ok(false) => {}
                // The database away for a moment: the next sweep looks again, rather than
                // failing a run whose user's decision may stand — for a day at most, as an
                // outage that long is no longer a moment.
                Err(
                    e @ (ApiError::Unavailable(_) | ApiError::Store(StoreError::Unavailable(_))),
                ) if run
                    .created_at
                    .elapsed()
                    .is_ok_and(|age| age < TAKE_UP_PATIENCE) =>
                {
                    tracing::warn!(run_id = %run.id, error = %e, "could not check whether a decided approval awaits this run; next sweep");
                    continue;
                }
                // Anything else will not clear by waiting: ended as abandoned, as a run must not
                // stay live with nobody running it.
                Err(e) => {
                    tracing::warn!(run_id = %run.id, error = %e, "could not check whether a decided approval awaits this run");
                }
            }
            let mut ending = if run.cancel_requested {
                // Its cancel came first: it ends as its canceller asked, with their reason —
                // not as a failure, which a task agent or a schedule would retry.
                let message = super::cancelled_message(run.cancel_reason.as_deref());
                cancel_ending(&message, ABANDONED_SEQ_GAP)
            } else {
                let message =
                    "This run stopped: the server running it stopped responding. Please try again.";
                Ending {
                    state: RunState::Failed,
                    error: message.into(),
                    failure_kind: "timed_out".into(),
                    event: encode(pb::run_event::Kind::Error(pb::ErrorEvent {
                        message: message.into(),
                        kind: pb::FailureKind::TimedOut as i32,
                    })),
                    seq_gap: ABANDONED_SEQ_GAP,
                    message: Some(message.into()),
                }
            };
            let mut outcome = self.store.end_abandoned(&run.id, &ending).await;
            if let Err(e @ StoreError::Rejected(_)) = &outcome
                && ending.message.is_some()
            {
                // The note in its thread may be what is refused (a rule on messages): the run
                // ends without it rather than staying live, and counted, on every sweep.
                tracing::warn!(run_id = %run.id, error = %e, "the database refused the abandoned run's end; trying once without its note");
                ending.message = None;
                outcome = self.store.end_abandoned(&run.id, &ending).await;
            }
            match outcome {
                Ok(true) => {
                    tracing::warn!(run_id = %run.id, thread_id = %run.thread_id, "health monitor ended a run whose lease lapsed");
                    crate::metrics::run_ended(ending.state.key());
                    ended += 1;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(run_id = %run.id, error = %e, "could not end an abandoned run; next sweep");
                }
            }
        }
        Ok(ended)
    }

    /// A run whose approval was decided while its decider went away before continuing it (the
    /// replica died just after the decision's commit, or that commit's answer was lost): the
    /// user's decision stands, so the run is continued here rather than failed. Only while
    /// the paused call is untouched: once a segment has taken it up, the run ends as any other
    /// run that lost its writer (its action may have begun; it is never started twice).
    async fn take_up_decided(self: &Arc<Self>, run: &Run) -> Result<bool, ApiError> {
        if run.state != RunState::Executing || self.decided_and_untouched(run).await?.is_none() {
            return Ok(false);
        }
        let lease = match self
            .store
            .lock_thread(&run.thread_id, &run.id, self.lease)
            .await?
        {
            LockOutcome::Acquired(lease) => lease,
            LockOutcome::Busy { .. } => return Ok(false),
        };
        match self.still_to_take_up(run).await {
            Ok(Some((approval, now))) => {
                // Past anything a stalled decider may have shown followers without committing
                // it, as a failed run's terminal event is — and stored there first, so a
                // follower reconnecting from a seq it was shown is not refused, and another
                // take-up after this one numbers past it too.
                let from = now.last_event_seq + ABANDONED_SEQ_GAP;
                // Stored as an ending's event is: its seq, run and thread come from its row.
                let notice = encode(pb::run_event::Kind::Status(pb::StatusEvent {
                    state: pb::RunState::Executing as i32,
                    detail: "continued after the server that took the decision stopped".into(),
                }));
                let stored = self
                    .store
                    .commit(
                        &lease,
                        crate::store::RunCommit {
                            events: vec![(from, notice)],
                            ..Default::default()
                        },
                    )
                    .await;
                if let Err(e) = stored {
                    let _ = self.store.release_lease(&lease).await;
                    return Err(e.into());
                }
                tracing::warn!(run_id = %run.id, approval_id = %approval.id, "health monitor continued a run whose decided approval was never taken up");
                self.continue_decided(lease, approval, &now.channel, from);
                Ok(true)
            }
            other => {
                let _ = self.store.release_lease(&lease).await;
                other.map(|_| false)
            }
        }
    }

    /// Under the lease, again (another sweeper may have continued the run in between): the
    /// decided approval and the run, if the run still waits on it and its session still holds
    /// the paused call (an archive that came first has ended that conversation).
    async fn still_to_take_up(&self, run: &Run) -> Result<Option<(Approval, Run)>, ApiError> {
        let Some(now) = self
            .store
            .get_run(&run.owner, &run.id)
            .await?
            .filter(|r| r.state == RunState::Executing)
        else {
            return Ok(None);
        };
        let Some(approval) = self.decided_and_untouched(&now).await? else {
            return Ok(None);
        };
        let history = self.load_history(&run.thread_id).await?;
        let call = approval.call_id.as_str();
        let asked = history.iter().any(|t| {
            matches!(t, Turn::Assistant { tool_calls, .. } if tool_calls.iter().any(|c| c.id == call))
        });
        let answered = history
            .iter()
            .any(|t| matches!(t, Turn::ToolResult { call_id, .. } if call_id == call));
        Ok((asked && !answered).then_some((approval, now)))
    }

    /// The decided approval of `run` whose paused call nothing has answered yet.
    async fn decided_and_untouched(&self, run: &Run) -> Result<Option<Approval>, ApiError> {
        let waiting = self
            .store
            .list_actions(&run.id)
            .await?
            .into_iter()
            .find(|a| a.state == ActionState::AwaitingConfirmation);
        let Some(approval_id) = waiting.and_then(|a| a.approval_id) else {
            return Ok(None);
        };
        Ok(self
            .store
            .get_approval(&run.owner, &approval_id)
            .await?
            .filter(|a| matches!(a.state, ApprovalState::Approved | ApprovalState::Rejected)))
    }

    /// Runs the sweep every `interval` until the process ends, the first at once: runs a
    /// crash left behind are ended as soon as a replica is up.
    pub fn spawn_monitor(
        self: &Arc<Self>,
        interval: Duration,
        grace: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        spawn_every(interval, FirstSweep::AtOnce, move || {
            let this = this.clone();
            async move {
                if let Err(e) = this.sweep_stale_runs(grace).await {
                    tracing::warn!(error = %e, "health monitor sweep failed");
                }
                // Here rather than on every task worker's poll: a claim lapses after minutes,
                // and one UPDATE per sweep per replica is enough to notice it. Before archiving,
                // which may wait on the summary model.
                match this
                    .store
                    .fail_lapsed_task_agents(MAX_TASK_ATTEMPTS, TASK_KEPT_STOPPING)
                    .await
                {
                    Ok(0) => {}
                    Ok(n) => tracing::error!(
                        tasks = n,
                        "task agents whose last attempt lost its worker with no tries left were failed"
                    ),
                    Err(e) => tracing::warn!(error = %e, "could not sweep lapsed task agents"),
                }
                match this.store.count_pending_approvals().await {
                    Ok(n) => crate::metrics::approvals_pending(n),
                    Err(e) => tracing::warn!(error = %e, "could not count pending approvals"),
                }
            }
        })
    }

    /// RUN_EVENTS_RETENTION: thins the events of runs that ended more than `retention` before
    /// `now` to their last, the result; how many runs. Batches of [`PRUNE_BATCH`] runs, each
    /// one short statement, until the backlog is done or [`PRUNE_BATCHES`] were taken (the
    /// rest waits for the next sweep), so a first sweep over years of runs holds nothing long.
    pub async fn prune_run_events(
        &self,
        retention: Duration,
        now: SystemTime,
    ) -> Result<usize, ApiError> {
        let ended_before = now.checked_sub(retention).unwrap_or(SystemTime::UNIX_EPOCH);
        let mut total = 0;
        for _ in 0..PRUNE_BATCHES {
            let n = self
                .store
                .prune_run_events(ended_before, PRUNE_BATCH)
                .await?;
            total += n;
            if n < PRUNE_BATCH {
                break;
            }
        }
        Ok(total)
    }

    /// The run-events pruner: every `interval`, [`RunService::prune_run_events`]. Any number of
    /// replicas may run it; their sweeps skip each other's rows. The first sweep comes at a
    /// random point of the first interval: replicas a rollout starts together, each meeting
    /// the whole backlog of a first start, do not all sweep it at once.
    pub fn spawn_events_pruner(
        self: &Arc<Self>,
        retention: Duration,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        spawn_every(interval, FirstSweep::Spread, move || {
            let this = this.clone();
            async move {
                match this.prune_run_events(retention, SystemTime::now()).await {
                    Ok(0) => {}
                    Ok(n) => {
                        crate::metrics::run_events_pruned(n);
                        tracing::info!(
                            runs = n,
                            "events of runs past RUN_EVENTS_RETENTION thinned to their results"
                        );
                    }
                    Err(e) => tracing::warn!(error = %e, "could not prune old run events"),
                }
            }
        })
    }

    /// The idle-session sweep (B-4), every `interval`, in a task of its own: it waits on the
    /// summary model, up to 70 s a session and 200 sessions a sweep, and the health monitor's
    /// sweep of abandoned runs must not wait behind it.
    pub fn spawn_session_archiver(
        self: &Arc<Self>,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        spawn_every(interval, FirstSweep::AtOnce, move || {
            let this = this.clone();
            async move {
                if let Err(e) = this.sweep_idle_sessions().await {
                    tracing::warn!(error = %e, "session archiving sweep failed");
                }
            }
        })
    }

    /// Task-agent workers (B-5): every `interval`, take ready tasks from the shared queue (any
    /// replica may) and run them until none is ready. `worker` names this process's claims, so
    /// [`RunService::hand_back`] can release them when it stops.
    pub fn spawn_task_workers(
        self: &Arc<Self>,
        interval: Duration,
        worker: String,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        // A task run takes minutes: the polls it overran are not made all at once after it.
        spawn_every(interval, FirstSweep::AtOnce, move || {
            let (this, worker) = (this.clone(), worker.clone());
            async move {
                loop {
                    match this
                        .store
                        .claim_task_agent(&worker, TASK_CLAIM, MAX_TASK_ATTEMPTS)
                        .await
                    {
                        Ok(Some(task)) => this.run_task_agent(task, &worker).await,
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "task queue unavailable");
                            break;
                        }
                    }
                }
            }
        })
    }

    /// At shutdown, once this process's workers are aborted and its runs stopped: the tasks and
    /// scheduled occurrences `worker` holds are handed back, so another replica takes them up
    /// now rather than when their claims lapse (up to 15 minutes later); what takes a task up
    /// follows the run its attempt started, if any, rather than starting a second.
    pub async fn hand_back(&self, worker: &str) {
        match self.store.release_task_claims(worker).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(tasks = n, "handed back task agents in progress"),
            Err(e) => {
                tracing::warn!(error = %e, "could not hand back task agents; they are taken up when their claims lapse")
            }
        }
        match self.store.release_schedule_holds(worker).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                occurrences = n,
                "handed back scheduled occurrences in progress"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not hand back scheduled occurrences; they are taken over when their holds lapse")
            }
        }
    }

    /// One attempt of a task agent: a run on its own thread through the same admission,
    /// prompt assembly and writer as any run (background limits, no approvals possible), then
    /// its result posted to the parent thread, or a retry per E-12.
    async fn run_task_agent(self: &Arc<Self>, task: TaskAgent, worker: &str) {
        // The claim is renewed while the attempt works, so a long run is not taken over by
        // another worker (whose start would find the task's thread busy).
        let attempt = {
            let work = self.attempt_task_agent(&task);
            tokio::pin!(work);
            let mut renew = tokio::time::interval_at(
                tokio::time::Instant::now() + TASK_CLAIM / 3,
                TASK_CLAIM / 3,
            );
            loop {
                tokio::select! {
                    attempt = &mut work => break attempt,
                    _ = renew.tick() => {
                        match self.store.renew_task_claim(&task, worker, TASK_CLAIM).await {
                            Ok(true) => {}
                            Ok(false) => tracing::warn!(task = %task.id, "task agent's claim was taken over; its outcome will be dropped"),
                            Err(e) => tracing::warn!(task = %task.id, error = %e, "could not renew a task agent's claim"),
                        }
                    }
                }
            }
        };
        let (judged, attempt) = attempt;
        let outcome = task_outcome(&task, judged, attempt);
        let how = crate::store::TaskSettle {
            attempt: judged,
            state: outcome.state,
            result: outcome.result.as_deref(),
            error: outcome.error.as_deref(),
            retry_at: outcome.retry_at,
            report: outcome.report.as_ref().map(|(s, text)| (*s, text.as_str())),
            tally: outcome.tally,
        };
        match self.store.settle_task_agent(&task, worker, &how).await {
            Ok(true) => {}
            // Its claim lapsed and another attempt holds the task: that one reports.
            Ok(false) => {
                tracing::warn!(task = %task.id, attempt = task.attempts, "task agent attempt outlived its claim; its outcome is dropped");
            }
            Err(e) if how.report.is_some() => {
                tracing::error!(task = %task.id, error = %e, "could not record a task agent's outcome or post its report; once its claim lapses the next attempt takes up its run's ending");
            }
            Err(e) => {
                tracing::error!(task = %task.id, error = %e, "could not record a task agent's outcome");
            }
        }
    }

    /// The run of an attempt since the last settled one, if one started — its worker died, was
    /// stopped or could not follow it — to be followed (or its ending used) instead of a second
    /// run started beside it: (its attempt, run id, thread id). Creates the thread on the first
    /// attempt.
    async fn unaccounted_run(
        &self,
        task: &TaskAgent,
        thread_id: &str,
    ) -> Result<Option<(u32, String, String)>, StoreError> {
        if self
            .store
            .get_thread(&task.owner, thread_id)
            .await?
            .is_none()
        {
            let title: String = format!("Task: {}", task.goal).chars().take(80).collect();
            return match self
                .store
                .create_thread(thread_id, &task.owner, &title)
                .await
            {
                Ok(_) | Err(StoreError::Conflict(_)) => Ok(None),
                Err(e) => Err(e),
            };
        }
        // Every attempt since the last settled one may have started a run (the current one
        // too, when it did not count before); at most one did, as the next followed it.
        for n in (task.settled_attempt + 1..=task.attempts).rev() {
            let request = format!("task-{}-attempt-{n}", task.id);
            if let Some(run) = self
                .store
                .find_run_by_request(&task.owner, &request)
                .await?
            {
                return Ok(Some((n, run.id, run.thread_id)));
            }
        }
        Ok(None)
    }

    /// Starts (or, by its request id, finds) the attempt's run and follows it to its end; with
    /// the attempt whose run it was (an earlier one's, taken over).
    async fn attempt_task_agent(self: &Arc<Self>, task: &TaskAgent) -> (u32, TaskAttempt) {
        let thread_id = format!("{TASK_THREAD_PREFIX}{}", task.id);
        let earlier = match self.unaccounted_run(task, &thread_id).await {
            Ok(run) => run,
            Err(e) => return (task.attempts, not_yet(task, ApiError::Store(e))),
        };
        let judged = earlier.as_ref().map_or(task.attempts, |(n, ..)| *n);
        (judged, self.follow_attempt(task, thread_id, earlier).await)
    }

    async fn follow_attempt(
        self: &Arc<Self>,
        task: &TaskAgent,
        thread_id: String,
        earlier: Option<(u32, String, String)>,
    ) -> TaskAttempt {
        // The goal and instructions were written by the model, perhaps after reading
        // someone else's words: they enter the task run as data, not as orders.
        let input = RunInput {
            prompt: format!(
                "Carry out the background task described below for the user.\n{}",
                crate::fence::block("task instructions", &task.instructions)
            ),
            thread_id: Some(thread_id),
            conversation: Vec::new(),
            attached: Vec::new(),
            channel: limits::Channel::TaskAgent,
            request_id: Some(format!("task-{}-attempt-{}", task.id, task.attempts)),
            max_total_tokens: None,
            max_cost_usd: None,
            model_override: None,
            // The zone of the run that started it (a name stored then; one this replica's zone
            // database does not know reads as UTC).
            time_zone: task.time_zone.as_deref().and_then(|z| {
                crate::schedule::user_zone("time_zone", z)
                    .inspect_err(|e| tracing::warn!(task_id = %task.id, error = %e, "the task's time zone is unknown here; its run uses UTC"))
                    .ok()
            }),
            session: Some(SessionSetup {
                guidance: format!(
                    "You are a background task agent working for the user, without them present. \
                     Work step by step with your tools towards the goal below and finish with a short report.\n{}",
                    crate::fence::block("task goal", &task.goal)
                ),
                bootstrap: None,
                allowed_tools: None,
                yield_to_approvals: false,
            }),
        };
        let started = match earlier {
            Some((_, run_id, thread_id)) => Ok((run_id, thread_id)),
            None => self.start(&task.owner, input).await,
        };
        let (run_id, thread_id) = match started {
            Ok(ids) => ids,
            Err(e) => return not_yet(task, e),
        };
        let mut events = self.follow_started(&run_id, &thread_id, Deliver::End);
        match events.result().await {
            Ok(Some((_, result))) => TaskAttempt::Ended(Box::new(result)),
            // Following failed, not the run: the run goes on, and the next take-up of this
            // attempt follows it again.
            // Whatever the task's age: its outcome is readable once it ends, and recording
            // this attempt as settled would leave a run nobody accounts for.
            Err(status) => TaskAttempt::NotYet(format!(
                "run {run_id} could not be followed: {}",
                status.message()
            )),
            Ok(None) => {
                TaskAttempt::NotYet(format!("run {run_id} could not be followed to its end"))
            }
        }
    }
}

/// An attempt that could not start its run, or follow it, because of `e`: not an attempt if
/// that may clear by waiting (the task's thread busy, the user at the run cap, the store or
/// this process away — the run may have started, and the next attempt follows it, see
/// `unaccounted_run`), for a task younger than [`TASK_NOT_YET_PATIENCE`]; otherwise a failed
/// attempt.
fn not_yet(task: &TaskAgent, e: ApiError) -> TaskAttempt {
    let passing = matches!(
        e,
        ApiError::Aborted(_)
            | ApiError::ResourceExhausted(_)
            | ApiError::Unavailable(_)
            | ApiError::Store(StoreError::Unavailable(_))
    );
    let young = task
        .created_at
        .elapsed()
        .is_ok_and(|age| age < TASK_NOT_YET_PATIENCE);
    if passing && young {
        TaskAttempt::NotYet(e.to_string())
    } else {
        TaskAttempt::Failed(e.to_string())
    }
}

/// How an attempt settles its task, owned (see [`crate::store::TaskSettle`]).
struct TaskOutcome {
    state: &'static str,
    result: Option<String>,
    error: Option<String>,
    retry_at: Option<SystemTime>,
    report: Option<(MessageSource, String)>,
    tally: Tally,
}

/// Completed and reported; not yet, and taken up again without counting; stopped by a restart,
/// and taken up again at once without counting a try; failed, and retried on the E-12 schedule
/// or reported as failed for good. A cancelled run (CancelRun) is final.
fn task_outcome(task: &TaskAgent, judged: u32, attempt: TaskAttempt) -> TaskOutcome {
    let again = |error: String, at: Duration, tally| TaskOutcome {
        state: "queued",
        result: None,
        error: Some(error),
        retry_at: Some(SystemTime::now() + at),
        report: None,
        tally,
    };
    let (error, cancelled) = match attempt {
        TaskAttempt::Ended(r) if r.status == pb::RunState::Completed as i32 => {
            return TaskOutcome {
                state: "completed",
                report: Some((
                    MessageSource::Agent,
                    format!("Task agent finished ({}):\n{}", task.goal, r.summary),
                )),
                result: Some(r.summary),
                error: None,
                retry_at: None,
                tally: Tally::Try,
            };
        }
        TaskAttempt::NotYet(why) => {
            tracing::warn!(task = %task.id, attempt = task.attempts, %why, "task agent attempt taken up again later");
            return again(why, TASK_NOT_YET, Tally::NotAnAttempt);
        }
        // Bounded, so a task whose runs somehow always meet a restart still ends: past the
        // bound a restart is a try like any other stop ("restarted" is retried as network
        // trouble is).
        TaskAttempt::Ended(r)
            if r.failure_kind == pb::FailureKind::Interrupted as i32
                && task.restarts < MAX_RESTARTS =>
        {
            tracing::warn!(task = %task.id, attempt = task.attempts, "task agent's run was stopped by a restart; taken up again now, no try counted");
            return again(
                RESTARTED_RUNNING_AGAIN.into(),
                Duration::ZERO,
                Tally::Restart,
            );
        }
        TaskAttempt::Ended(r) => (r.error, r.status == pb::RunState::Cancelled as i32),
        TaskAttempt::Failed(error) => (error, false),
    };
    // Tries, not attempts: the restarts settled before this attempt do not count.
    let tries = judged.saturating_sub(task.restarts);
    match retry_backoff(&error, tries).filter(|_| !cancelled) {
        Some(backoff) => {
            tracing::warn!(task = %task.id, attempt = task.attempts, %error, "task agent failed; retrying later");
            again(retried(&error), backoff, Tally::Try)
        }
        None => TaskOutcome {
            state: "failed",
            report: Some((
                MessageSource::Error,
                format!("Task agent could not finish ({}): {error}", task.goal),
            )),
            result: None,
            error: Some(error),
            retry_at: None,
            tally: Tally::Try,
        },
    }
}

/// How one attempt of a task agent went.
enum TaskAttempt {
    /// Its run ended: completed, failed or cancelled.
    Ended(Box<pb::RunResult>),
    /// It could not start or follow a run, for a reason that waiting will not clear.
    Failed(String),
    /// Not an attempt: its run could not start for now (the task's thread busy, the user at
    /// the run cap) or could not be followed (the store away). The same attempt is taken up
    /// again shortly, and its request id finds the run if one started.
    NotYet(String),
}

/// A task agent's thread: this and the task's id.
pub(super) const TASK_THREAD_PREFIX: &str = "task-";

/// How soon an attempt that did not happen ([`TaskAttempt::NotYet`]) is taken up again.
const TASK_NOT_YET: Duration = Duration::from_secs(30);
/// How long after it was queued a task's attempts may keep not happening: past this, what
/// keeps them from it (a store error that is not passing, say) counts against its tries.
const TASK_NOT_YET_PATIENCE: Duration = Duration::from_secs(6 * 3600);

/// The most tries a task gets (attempts a restart of their service stopped are not tries); a
/// claim that lapses on the last one (its worker went away every time) fails the task. As many
/// as the most retries E-12 allows any error.
const MAX_TASK_ATTEMPTS: u32 = 5;

/// The most of a task's (or a schedule occurrence's) attempts that a restart may stop without
/// counting as tries: enough for any run of rolling deploys, few enough that unattended work
/// cannot be taken up forever.
pub(super) const MAX_RESTARTS: u32 = 20;

/// Why such a task failed, as its parent thread is told.
const TASK_KEPT_STOPPING: &str =
    "its last attempt stopped with the server running it, and it has no tries left";

/// Runs whose events one pruning statement thins, and statements at most per sweep.
const PRUNE_BATCH: usize = 500;
const PRUNE_BATCHES: usize = 20;

/// How long a run whose take-up check keeps failing on an unavailable store is left for the
/// next sweep before it is ended as abandoned.
const TAKE_UP_PATIENCE: Duration = Duration::from_secs(24 * 3600);

/// How long a task agent's attempt holds its task: the longest a task run can take (its
/// wall-clock limit, a tool call started just before it, the final answer) and a margin. A
/// worker that dies leaves the task to be taken again after this.
const TASK_CLAIM: Duration = Duration::from_secs(600 + 60 + 60 + 180);

/// What unattended work shows of a failure it will retry by itself: the run's own words, less
/// a closing "Please try again" (or "try again shortly", "Try again later") meant for a person
/// at the other end, who need not.
pub(super) fn retried(error: &str) -> String {
    let own = error.trim_end();
    let lower = own.to_ascii_lowercase();
    // The last sentence or clause that asks for another try, and what joins it on.
    let cut = ["please try again", "try again"]
        .iter()
        .filter_map(|ask| lower.rfind(ask))
        .min()
        .filter(|&at| {
            let tail = lower[at..].trim_end_matches(['.', '!']);
            [
                "please try again",
                "try again",
                "please try again shortly",
                "try again shortly",
                "try again later",
                "please try again later",
            ]
            .contains(&tail)
        });
    let own = match cut {
        Some(at) => own[..at].trim_end_matches([' ', ',', ';']),
        None => own,
    };
    let stop = if own.ends_with(['.', '!', '?']) {
        ""
    } else {
        "."
    };
    format!("{own}{stop} It is tried again automatically.")
}

/// E-12's retry schedule for unattended work that failed after `attempts` tries: rate limits get
/// 5 tries, network trouble (and a server that stopped mid-run) 3, anything else 2, with
/// exponential backoff from 10 s and up to 25% jitter. `None`: give up.
pub(super) fn retry_backoff(error: &str, attempts: u32) -> Option<Duration> {
    let tries = if error.contains("HTTP 429") || error.contains("rate limit") {
        5
    } else if [
        "timed out",
        "stopped responding",
        // INTERRUPTED_MESSAGE: a restart past the free ones of a task or a schedule.
        "the service running it was restarted",
        "connection",
        "cut off",
        "unreachable",
        "unavailable",
    ]
    .iter()
    .any(|k| error.contains(k))
    {
        3
    } else {
        2
    };
    (attempts < tries).then(|| {
        Duration::from_secs(10)
            .saturating_mul(1 << attempts.saturating_sub(1).min(10))
            .mul_f64(1.0 + rand::random::<f64>() * 0.25)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn b4_a_long_sessions_summary_reads_its_opening_and_its_end() {
        let short = "User: hi\nAssistant: hello";
        assert_eq!(summarised_part(short), short);
        let long = format!(
            "User: I'm Dana from finance.\n{}\nUser: so we settle on Friday, and the venue is still open",
            "Assistant: noted.\n".repeat(5_000)
        );
        let part = summarised_part(&long);
        assert!(part.starts_with("User: I'm Dana from finance."));
        assert!(part.ends_with("the venue is still open"));
        assert!(part.contains("[... the middle of the session is left out ...]"));
        assert!(part.chars().count() < SUMMARY_HEAD_CHARS + SUMMARY_TAIL_CHARS + 100);
    }

    fn task(attempts: u32, restarts: u32) -> TaskAgent {
        TaskAgent {
            id: "t-1".into(),
            owner: "alice".into(),
            parent_thread_id: "th".into(),
            instructions: "do".into(),
            goal: "done".into(),
            state: "running".into(),
            attempts,
            last_error: None,
            result: None,
            created_at: SystemTime::now(),
            settled_attempt: attempts - 1,
            restarts,
            time_zone: None,
        }
    }

    fn ended(kind: pb::FailureKind, error: &str) -> TaskAttempt {
        TaskAttempt::Ended(Box::new(pb::RunResult {
            status: pb::RunState::Failed as i32,
            error: error.into(),
            failure_kind: kind as i32,
            ..Default::default()
        }))
    }

    #[test]
    fn e12_a_task_run_stopped_by_a_restart_is_taken_up_again_at_once_without_a_try() {
        let restarted = || ended(pb::FailureKind::Interrupted, INTERRUPTED_MESSAGE);
        let outcome = task_outcome(&task(3, 2), 3, restarted());
        assert_eq!((outcome.state, outcome.tally), ("queued", Tally::Restart));
        assert_eq!(
            outcome.error.as_deref(),
            Some(RESTARTED_RUNNING_AGAIN),
            "not the run's own \"please try again\""
        );
        assert!(outcome.retry_at.unwrap() <= SystemTime::now(), "due now");
        assert!(outcome.report.is_none(), "the parent is told nothing yet");

        // Past the bound a restart is a try like any other stop, retried as network trouble.
        let worn = task(MAX_RESTARTS + 1, MAX_RESTARTS);
        let outcome = task_outcome(&worn, MAX_RESTARTS + 1, restarted());
        assert_eq!((outcome.state, outcome.tally), ("queued", Tally::Try));
        assert_eq!(
            outcome.error.as_deref(),
            Some(
                "This run stopped: the service running it was restarted before it finished. \
                 It is tried again automatically."
            ),
            "retried, so not \"please try again\""
        );
        let last = task(MAX_RESTARTS + 3, MAX_RESTARTS);
        let outcome = task_outcome(&last, MAX_RESTARTS + 3, restarted());
        assert_eq!(outcome.state, "failed", "its third try was its last");
    }

    #[test]
    fn e12_a_retried_failure_drops_only_a_closing_ask_to_try_again() {
        for (error, shown) in [
            (
                "This run stopped: the server running it stopped responding. Please try again.",
                "This run stopped: the server running it stopped responding. It is tried again automatically.",
            ),
            (
                "gateway-svc could not say yet (timed out); nothing was run, please try again shortly",
                "gateway-svc could not say yet (timed out); nothing was run. It is tried again automatically.",
            ),
            (
                "the database is unavailable: connection refused",
                "the database is unavailable: connection refused. It is tried again automatically.",
            ),
            (
                "Try again later? No: the model said no.",
                "Try again later? No: the model said no. It is tried again automatically.",
            ),
        ] {
            assert_eq!(retried(error), shown);
        }
    }

    #[test]
    fn e12_restarts_before_an_attempt_do_not_count_against_its_retries() {
        // Anything else gets 2 tries: the fourth attempt after two restarts is the second try.
        let failed = || ended(pb::FailureKind::Internal, "the model said no");
        assert_eq!(task_outcome(&task(3, 2), 3, failed()).state, "queued");
        assert_eq!(task_outcome(&task(4, 2), 4, failed()).state, "failed");
    }
}
