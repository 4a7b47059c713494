//! Scheduled runs (issue 16): briefings, check-ins and heartbeats that start themselves.
//!
//! The path of an occurrence: a worker on any replica claims it from the store (SKIP LOCKED;
//! the schedule's next due time moves past now in the same transaction, so slots missed while
//! every replica was down collapse into this one occurrence), starts one run through the same
//! admission as any run, with a request id naming the occurrence and attempt (a worker that
//! takes over a dead worker's occurrence finds that run instead of starting a second), follows
//! it to its end and records the outcome on the schedule. A busy thread postpones the
//! occurrence; a retriable failure is retried on the E-12 schedule; an approval the run asked
//! for waits for the user, like any other.

use super::*;
use crate::{
    schedule::Recurrence,
    store::{Occurrence, Schedule, ScheduleKind, ScheduleOutcome, Settle, Tally},
};

/// Per-user rules for schedules (AGENT_MAX_SCHEDULES_PER_USER, AGENT_SCHEDULE_MIN_INTERVAL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleRules {
    pub max_per_user: u32,
    /// The shortest gap between two occurrences a schedule may have.
    pub min_interval: Duration,
}

impl Default for ScheduleRules {
    fn default() -> Self {
        Self {
            max_per_user: 20,
            min_interval: Duration::from_secs(60),
        }
    }
}

/// The thread of a schedule created without one: this and the schedule's id.
pub(super) const SCHEDULE_THREAD_PREFIX: &str = "schedule-";

/// How long a worker holds an occurrence: the longest scheduled run (600 s) and a margin. A
/// worker that dies lets another take the occurrence over after this.
const HOLD: Duration = Duration::from_secs(660);
/// How long an occurrence waits when its thread is busy or the user is at the run cap.
const POSTPONE: Duration = Duration::from_secs(30);
/// The longest a postponed occurrence waits between tries: a thread can stay busy for hours
/// (an approval the user has not decided).
const MAX_POSTPONE: Duration = Duration::from_secs(600);
/// How long after its due time an occurrence whose start met the store away keeps its attempt.
const STORE_PATIENCE: Duration = Duration::from_secs(6 * 3600);
/// How many occurrences one replica starts at once.
pub(super) const STARTS_AT_ONCE: usize = 16;
/// Prompts are the user's own words, stored with the schedule: 8 KiB is plenty for an
/// instruction that runs every day.
const MAX_PROMPT_BYTES: usize = 8 * 1024;
/// The longest interval: beyond a year a cron expression says it better, and timestamps stay
/// far from overflow.
const MAX_INTERVAL: Duration = Duration::from_secs(366 * 24 * 3600);

/// A new schedule, validated at the API edge for shape; [`RunService::create_schedule`] checks
/// the recurrence and the rules.
#[derive(Debug, Clone, PartialEq)]
pub struct NewSchedule {
    pub kind: ScheduleKind,
    pub prompt: String,
    pub cron: Option<String>,
    pub every: Option<Duration>,
    pub time_zone: String,
    pub thread_id: Option<String>,
    pub new_thread_per_run: bool,
    pub enabled: bool,
}

/// Changes to a schedule; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScheduleChange {
    pub prompt: Option<String>,
    pub cron: Option<String>,
    pub every: Option<Duration>,
    pub time_zone: Option<String>,
    pub enabled: Option<bool>,
}

/// An occurrence a worker fired, settled when `outcome` resolves.
#[derive(Debug, Clone, PartialEq)]
pub struct Fired {
    pub schedule_id: String,
    pub run_id: Option<String>,
    pub outcome: ScheduleOutcome,
}

impl ScheduleKind {
    pub fn channel(self) -> limits::Channel {
        match self {
            ScheduleKind::Briefing | ScheduleKind::CheckIn => limits::Channel::Scheduled,
            ScheduleKind::Heartbeat => limits::Channel::Heartbeat,
        }
    }

    fn guidance(self) -> &'static str {
        match self {
            ScheduleKind::Briefing => crate::prompt::BRIEFING_GUIDANCE,
            ScheduleKind::CheckIn => crate::prompt::CHECK_IN_GUIDANCE,
            ScheduleKind::Heartbeat => crate::prompt::HEARTBEAT_GUIDANCE,
        }
    }

    /// The tools an unattended run of this kind is offered. Briefings and heartbeats read
    /// metadata only: tools that return message bodies (get_gmail, gmail_thread_read,
    /// slack_read) are not offered, so a briefing cannot contain an email body whatever the
    /// model wants. A briefing may still propose follow-ups (a reply, a task, an event), which
    /// the user's trust level then governs; a heartbeat only looks. A check-in gets every tool.
    fn tools(self) -> Option<Vec<String>> {
        const READ_METADATA: &[&str] = &[
            "list_tasks",
            "get_reminders",
            "search_memory",
            "search_gmail",
            "calendar_search",
        ];
        const FOLLOW_UPS: &[&str] = &[
            "add_task",
            "create_reminder",
            "gmail_send",
            "gmail_draft_create",
            "gmail_reply",
            "calendar_event_create",
        ];
        let names: Vec<&str> = match self {
            ScheduleKind::Briefing => [READ_METADATA, FOLLOW_UPS].concat(),
            ScheduleKind::Heartbeat => READ_METADATA.to_vec(),
            ScheduleKind::CheckIn => return None,
        };
        Some(names.into_iter().map(str::to_owned).collect())
    }

    fn default_prompt(self) -> &'static str {
        match self {
            ScheduleKind::Briefing => "What happened across all my goals today?",
            ScheduleKind::CheckIn => "How are my open tasks and goals going?",
            ScheduleKind::Heartbeat => "Is there anything urgent?",
        }
    }

    fn title(self) -> &'static str {
        match self {
            ScheduleKind::Briefing => "Briefing",
            ScheduleKind::CheckIn => "Check-in",
            ScheduleKind::Heartbeat => "Heartbeat",
        }
    }
}

impl RunService {
    /// Checks `cron` / `every` / `time_zone` and the minimum interval; the error names the field.
    fn recurrence(
        &self,
        cron: Option<&str>,
        every: Option<Duration>,
        time_zone: &str,
    ) -> Result<Recurrence, ApiError> {
        let recurrence = match (cron, every) {
            (Some(expr), None) => {
                Recurrence::cron(expr, time_zone).map_err(ApiError::InvalidArgument)?
            }
            (None, Some(period)) => {
                if period > MAX_INTERVAL {
                    return Err(ApiError::InvalidArgument(format!(
                        "interval is {} s; the longest is {} s (366 days)",
                        period.as_secs(),
                        MAX_INTERVAL.as_secs()
                    )));
                }
                if !time_zone.trim().is_empty() {
                    crate::schedule::user_zone("time_zone", time_zone)
                        .map_err(ApiError::InvalidArgument)?;
                }
                Recurrence::every(period)
            }
            (Some(_), Some(_)) => {
                return Err(ApiError::InvalidArgument(
                    "set either cron or interval, not both".into(),
                ));
            }
            (None, None) => {
                return Err(ApiError::InvalidArgument(
                    "cron or interval is required (e.g. cron \"0 9 * * *\" with time_zone \"Europe/Berlin\")".into(),
                ));
            }
        };
        let gap = recurrence.shortest_gap(SystemTime::now());
        if gap < self.schedule_rules.min_interval {
            let field = if cron.is_some() { "cron" } else { "interval" };
            return Err(ApiError::InvalidArgument(format!(
                "{field} fires every {} s; the minimum (AGENT_SCHEDULE_MIN_INTERVAL) is {} s",
                gap.as_secs(),
                self.schedule_rules.min_interval.as_secs()
            )));
        }
        Ok(recurrence)
    }

    pub async fn create_schedule(
        &self,
        owner: &str,
        new: NewSchedule,
    ) -> Result<Schedule, ApiError> {
        check_prompt(&new.prompt)?;
        let recurrence = self.recurrence(new.cron.as_deref(), new.every, &new.time_zone)?;
        // Checked again, race-free, when the schedule (and its thread) is stored.
        let cap = self.schedule_rules.max_per_user;
        if self.store.list_schedules(owner).await?.len() >= cap as usize {
            return Err(too_many_schedules(cap));
        }
        let now = SystemTime::now();
        let id = uuid::Uuid::new_v4().to_string();
        let mut new_thread = None;
        let thread_id = match (&new.thread_id, new.new_thread_per_run) {
            (Some(_), true) => {
                return Err(ApiError::InvalidArgument(
                    "thread_id and new_thread_per_run exclude each other; set one".into(),
                ));
            }
            (Some(t), false) => {
                self.store
                    .get_thread(owner, t)
                    .await?
                    .ok_or_else(|| ApiError::NotFound(format!("thread {t}")))?;
                Some(t.clone())
            }
            (None, true) => None,
            (None, false) => {
                new_thread = Some(format!("{} ({id})", new.kind.title()));
                Some(format!("{SCHEDULE_THREAD_PREFIX}{id}"))
            }
        };
        let schedule = Schedule {
            id: id.clone(),
            owner: owner.to_owned(),
            kind: new.kind,
            prompt: new.prompt,
            cron: recurrence.cron_expr().map(str::to_owned),
            every: new.every,
            time_zone: new.time_zone,
            enabled: new.enabled,
            thread_id,
            next_due_at: recurrence
                .next_due(now, now)
                .ok_or_else(|| ApiError::InvalidArgument("the schedule never fires".into()))?,
            last_outcome: None,
            last_run_id: None,
            last_error: None,
            last_fired_at: None,
            occurrence_at: None,
            attempts: 0,
            restarts: 0,
            created_at: now,
            updated_at: now,
        };
        if !self
            .store
            .create_schedule(&schedule, cap, new_thread.as_deref())
            .await?
        {
            return Err(too_many_schedules(cap));
        }
        Ok(schedule)
    }

    /// Applies `change` to the schedule as it stands. Two updates at once both land: each
    /// writes only if the schedule is as it read it, and reads again otherwise.
    pub async fn update_schedule(
        &self,
        owner: &str,
        id: &str,
        change: ScheduleChange,
    ) -> Result<Schedule, ApiError> {
        for _ in 0..5 {
            let mut s = self
                .store
                .get_schedule(owner, id)
                .await?
                .ok_or_else(|| ApiError::NotFound(format!("schedule {id}")))?;
            let reschedule = self.apply(&mut s, &change)?;
            // False: gone, or changed since it was read (by another update, or a worker).
            if self.store.save_schedule(&s, reschedule).await? {
                return Ok(self.store.get_schedule(owner, id).await?.unwrap_or(s));
            }
        }
        Err(ApiError::Aborted(format!(
            "schedule {id} kept changing while this update was applied; try again"
        )))
    }

    /// `change` applied to `s`, checked; true when the next due time was worked out again.
    fn apply(&self, s: &mut Schedule, change: &ScheduleChange) -> Result<bool, ApiError> {
        if let Some(prompt) = &change.prompt {
            check_prompt(prompt)?;
            s.prompt = prompt.clone();
        }
        let timing = change.cron.is_some() || change.every.is_some() || change.time_zone.is_some();
        match (&change.cron, change.every) {
            (Some(_), Some(_)) => {
                return Err(ApiError::InvalidArgument(
                    "set either cron or interval, not both".into(),
                ));
            }
            (Some(c), None) => (s.cron, s.every) = (Some(c.clone()), None),
            (None, Some(e)) => (s.cron, s.every) = (None, Some(e)),
            (None, None) => {}
        }
        if let Some(tz) = &change.time_zone {
            s.time_zone = tz.clone();
        }
        if timing {
            let recurrence = self.recurrence(s.cron.as_deref(), s.every, &s.time_zone)?;
            let now = SystemTime::now();
            s.cron = recurrence.cron_expr().map(str::to_owned);
            // An interval counts from the schedule's creation; a new cron from now.
            s.next_due_at = recurrence
                .next_due(s.created_at, now)
                .ok_or_else(|| ApiError::InvalidArgument("the schedule never fires".into()))?;
        }
        let mut reschedule = timing;
        if let Some(enabled) = change.enabled {
            if enabled && !s.enabled && !timing {
                // Switched back on: slots that passed while it was off are not owed.
                let now = SystemTime::now();
                s.next_due_at = s.recurrence()?.next_due(s.created_at, now).unwrap_or(now);
                reschedule = true;
            }
            s.enabled = enabled;
        }
        Ok(reschedule)
    }

    /// Every worker tick: fire what is due at `now` (the clock is a parameter so tests can
    /// drive it). Each occurrence's run is followed in its own task; the handles resolve when
    /// the occurrence has settled.
    ///
    /// Up to [`STARTS_AT_ONCE`] occurrences start together on a replica (across ticks), so at
    /// a popular hour one whose gateway call is slow does not hold up the rest; a replica
    /// claims no more than it can start, and leaves the others to the other replicas.
    pub async fn fire_due_schedules(
        self: &Arc<Self>,
        worker: &str,
        now: SystemTime,
    ) -> Result<Vec<tokio::task::JoinHandle<Fired>>, ApiError> {
        let mut fired = Vec::new();
        loop {
            let start = self
                .occurrence_starts
                .clone()
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            let holder = holder(worker);
            let Some(occurrence) = self.store.claim_schedule(&holder, now, HOLD).await? else {
                return Ok(fired);
            };
            let this = self.clone();
            fired.push(tokio::spawn(async move {
                let schedule_id = occurrence.schedule.id.clone();
                let (_, settled) = this.fire(&holder, occurrence, now, false).await;
                drop(start);
                match settled.await {
                    Ok(fired) => fired,
                    Err(e) => match e.try_into_panic() {
                        Ok(panic) => std::panic::resume_unwind(panic),
                        // The runtime is stopping: the hold lapses, or is handed back.
                        Err(_) => Fired {
                            schedule_id,
                            run_id: None,
                            outcome: ScheduleOutcome::Running,
                        },
                    },
                }
            }));
        }
    }

    /// RunScheduleNow: one occurrence at once, through the same path as a due one.
    pub async fn run_schedule_now(
        self: &Arc<Self>,
        owner: &str,
        id: &str,
        worker: &str,
    ) -> Result<(String, String), ApiError> {
        let now = SystemTime::now();
        let worker = &holder(worker);
        let occurrence = match self
            .store
            .claim_schedule_now(owner, id, worker, now, HOLD)
            .await
        {
            Ok(Some(o)) => o,
            Ok(None) => return Err(ApiError::NotFound(format!("schedule {id}"))),
            Err(StoreError::Conflict(what)) => {
                return Err(ApiError::FailedPrecondition(format!(
                    "{what} is still in progress; wait for it to finish"
                )));
            }
            Err(e) => return Err(e.into()),
        };
        let (started, settled) = self.fire(worker, occurrence, now, true).await;
        match started {
            Ok(ids) => Ok(ids),
            Err(e) => {
                let _ = settled.await;
                Err(e)
            }
        }
    }

    /// At shutdown, once the schedule workers are stopped: waits (at most `wait`) until the
    /// occurrences this replica was starting have started, so their runs are among those
    /// stopped before the hand-back. Best effort: a start still waiting on the gateway after
    /// `wait` goes on, and what takes its occurrence over follows its run by request id.
    pub async fn settle_starts(&self, wait: Duration) {
        let all = STARTS_AT_ONCE as u32;
        let _ = tokio::time::timeout(wait, self.occurrence_starts.acquire_many(all)).await;
    }

    /// Workers: every `interval`, fire whatever is due. Any number of replicas may run them.
    /// `worker` names this process's holds, so [`RunService::hand_back`] can release them.
    pub fn spawn_schedule_workers(
        self: &Arc<Self>,
        interval: Duration,
        worker: String,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        svc_kit::periodic::spawn_every(interval, svc_kit::periodic::FirstSweep::AtOnce, move || {
            let (this, worker) = (this.clone(), worker.clone());
            async move {
                if let Err(e) = this.fire_due_schedules(&worker, SystemTime::now()).await {
                    tracing::warn!(error = %e, "schedules unavailable");
                }
            }
        })
    }

    /// Starts the occurrence's run; the handle follows it and settles the occurrence.
    /// `at_once` (RunScheduleNow): a run that cannot start is reported to the caller and the
    /// occurrence dropped, not postponed behind their back.
    async fn fire(
        self: &Arc<Self>,
        worker: &str,
        occurrence: Occurrence,
        now: SystemTime,
        at_once: bool,
    ) -> (
        Result<(String, String), ApiError>,
        tokio::task::JoinHandle<Fired>,
    ) {
        let started = self.start_occurrence(&occurrence).await;
        let (run, early) = match &started {
            Ok((run_id, thread_id)) => (Some((run_id.clone(), thread_id.clone())), None),
            Err(e) if at_once => (
                None,
                Some(Settle::Done {
                    outcome: ScheduleOutcome::Failed,
                    run_id: None,
                    error: Some(e.to_string()),
                }),
            ),
            Err(e) => (None, Some(start_failed(&occurrence, e, now))),
        };
        let this = self.clone();
        let worker = worker.to_owned();
        let settled = tokio::spawn(async move {
            let settle = match (run, early) {
                (Some((run_id, thread_id)), _) => {
                    let running = Settle::Running {
                        run_id: run_id.clone(),
                        until: now + HOLD,
                    };
                    this.record(&occurrence, &worker, &running).await;
                    this.await_occurrence(&occurrence, &worker, run_id, thread_id, now)
                        .await
                }
                (None, Some(settle)) => settle,
                (None, None) => unreachable!("a start either ran or failed"),
            };
            this.record(&occurrence, &worker, &settle).await;
            let (outcome, run_id) = match settle {
                Settle::Running { run_id, .. } => (ScheduleOutcome::Running, Some(run_id)),
                Settle::Again {
                    outcome, run_id, ..
                }
                | Settle::Done {
                    outcome, run_id, ..
                } => (outcome, run_id),
            };
            Fired {
                schedule_id: occurrence.schedule.id.clone(),
                run_id,
                outcome,
            }
        });
        (started, settled)
    }

    /// The run of an occurrence: the schedule's kind sets guidance, channel and limits; the
    /// bootstrap context (tasks, reminders, unread counts: metadata only) is its starting point.
    async fn start_occurrence(
        self: &Arc<Self>,
        occurrence: &Occurrence,
    ) -> Result<(String, String), ApiError> {
        let s = &occurrence.schedule;
        let due = occurrence
            .due_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        // The due time in milliseconds (PostgreSQL keeps microseconds, so it reads back alike).
        let request_id = format!("schedule:{}:{due}:{}", s.id, occurrence.attempt);
        let channel = s.kind.channel();
        // An occurrence taken over after its run started finds that run first: asking the
        // gateway again could fail and turn one occurrence into a retry, and a second run.
        if let Some(run) = self
            .store
            .find_run_by_request(&s.owner, &request_id)
            .await?
        {
            return Ok((run.id, run.thread_id));
        }
        // Switched off after an attempt failed or was postponed: the rest of the occurrence is
        // not owed. (One whose run is going is followed to its end, above; RunScheduleNow's
        // first attempt is Running.)
        if !s.enabled
            && matches!(
                s.last_outcome,
                Some(ScheduleOutcome::Retrying | ScheduleOutcome::Postponed)
            )
        {
            return Err(ApiError::FailedPrecondition(
                "the schedule was switched off before this occurrence could run again".into(),
            ));
        }
        // A busy thread postpones the occurrence (the admission below decides): found out here
        // first, so a postponed occurrence does not ask the gateway for its context every try.
        if let Some(thread_id) = &s.thread_id
            && let Some(thread) = self.store.get_thread(&s.owner, thread_id).await?
        {
            if let Some(active) = &thread.active_run_id {
                return Err(thread_busy(thread_id, active));
            }
            if let Some(last) = &thread.last_run_id
                && let Some(run) = self.store.get_run(&s.owner, last).await?
                && run.state == RunState::AwaitingConfirmation
            {
                return Err(thread_paused(thread_id, last));
            }
        }
        let bootstrap = match &self.gateway {
            Some(gateway) => {
                // Bounded by the client (a start holds one of the replica's permits while it
                // waits).
                let fetched = gateway
                    .bootstrap(&s.owner, &s.time_zone, gateway_channel(channel))
                    .await
                    .map_err(|e| e.to_string());
                Some(
                    fetched
                        .map_err(|e| {
                            ApiError::Unavailable(format!(
                                "the briefing context could not be fetched (gateway unavailable): {e}"
                            ))
                        })?
                        .rendered,
                )
            }
            None => None,
        };
        let prompt = if s.prompt.trim().is_empty() {
            s.kind.default_prompt().to_owned()
        } else {
            s.prompt.clone()
        };
        let input = RunInput {
            prompt,
            thread_id: s.thread_id.clone(),
            conversation: Vec::new(),
            attached: Vec::new(),
            channel,
            request_id: Some(request_id),
            max_total_tokens: None,
            max_cost_usd: None,
            model_override: None,
            // The schedule's zone is its owner's: a briefing speaks of their day.
            time_zone: crate::schedule::user_zone("time_zone", &s.time_zone).ok(),
            session: Some(SessionSetup {
                guidance: s.kind.guidance().into(),
                bootstrap,
                allowed_tools: s.kind.tools(),
                yield_to_approvals: true,
            }),
        };
        self.start(&s.owner, input).await
    }

    /// Follows the occurrence's run to its end, extending the hold while it goes, and says how
    /// the occurrence settles.
    async fn await_occurrence(
        self: &Arc<Self>,
        occurrence: &Occurrence,
        worker: &str,
        run_id: String,
        thread_id: String,
        claimed: SystemTime,
    ) -> Settle {
        let owner = &occurrence.schedule.owner;
        // The latest result: an occurrence taken over after its run paused and went on is
        // settled by how the run ended, not by its pause.
        let followed = async {
            self.latest_result(owner, &run_id)
                .await
                .map_err(|s| ApiError::Unavailable(s.message().to_owned()))?
                .ok_or_else(|| {
                    ApiError::Unavailable(format!("run {run_id} ended without a result"))
                })
        };
        let result = {
            tokio::pin!(followed);
            let mut renew =
                tokio::time::interval_at(tokio::time::Instant::now() + HOLD / 3, HOLD / 3);
            loop {
                tokio::select! {
                    result = &mut followed => break result,
                    _ = renew.tick() => {
                        let running = Settle::Running {
                            run_id: run_id.clone(),
                            until: settle_time(claimed) + HOLD,
                        };
                        self.record(occurrence, worker, &running).await;
                    }
                }
            }
        };
        // Waits count from now, not from the claim: a retry's backoff starts when the run ended.
        let now = settle_time(claimed);
        let done = |outcome, error| Settle::Done {
            outcome,
            run_id: Some(run_id.clone()),
            error,
        };
        match result {
            Ok(r) if r.status == pb::RunState::Completed as i32 => {
                // S2: the session is archived when the briefing completes.
                if occurrence.schedule.kind == ScheduleKind::Briefing {
                    self.archive(owner, &thread_id, None, None).await;
                }
                done(ScheduleOutcome::Completed, None)
            }
            Ok(r) if r.status == pb::RunState::AwaitingConfirmation as i32 => {
                done(ScheduleOutcome::AwaitingApproval, None)
            }
            Ok(r) if r.status == pb::RunState::Cancelled as i32 => {
                done(ScheduleOutcome::Failed, Some(r.error))
            }
            // Stopped by a restart of the service running it (a rolling deploy): tried again at
            // once, under a new request id, spending no try — as a task agent's attempt is.
            Ok(r)
                if r.failure_kind == pb::FailureKind::Interrupted as i32
                    && occurrence.schedule.restarts < background::MAX_RESTARTS =>
            {
                tracing::warn!(schedule = %occurrence.schedule.id, attempt = occurrence.attempt, "scheduled run was stopped by a restart; taken up again now, no try counted");
                Settle::Again {
                    outcome: ScheduleOutcome::Retrying,
                    tally: Tally::Restart,
                    run_id: Some(run_id.clone()),
                    error: Some(RESTARTED_RUNNING_AGAIN.into()),
                    at: now,
                }
            }
            Ok(r) => failed(occurrence, Some(run_id.clone()), r.error, now),
            // The run could not be followed (the store or the stream failed), not that it
            // failed: the same attempt is taken up again shortly, and its request id finds this
            // very run instead of starting a second one.
            Err(e) => Settle::Again {
                outcome: ScheduleOutcome::Running,
                tally: Tally::NotAnAttempt,
                run_id: Some(run_id.clone()),
                error: Some(e.to_string()),
                at: now + POSTPONE,
            },
        }
    }

    async fn record(&self, occurrence: &Occurrence, worker: &str, settle: &Settle) {
        match self.store.settle_schedule(occurrence, worker, settle).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                schedule = %occurrence.schedule.id,
                "a schedule's occurrence was taken over or removed before its outcome was recorded"
            ),
            Err(e) => tracing::error!(
                schedule = %occurrence.schedule.id,
                error = %e,
                "could not record a schedule's outcome; the occurrence is retried when its hold expires"
            ),
        }
    }
}

/// How an occurrence whose run could not start settles: a busy thread or the user's run cap
/// postpones it; the store away leaves the attempt to be taken up again (whether its run
/// started is not known, and its request id finds that run if it did) for the first six hours
/// after the occurrence was due; a schedule whose thread is gone, or that was switched off,
/// fails; anything else is retried per E-12.
fn start_failed(occurrence: &Occurrence, e: &ApiError, now: SystemTime) -> Settle {
    match e {
        ApiError::Store(StoreError::Unavailable(_))
            if now
                .duration_since(occurrence.due_at)
                .is_ok_and(|late| late < STORE_PATIENCE) =>
        {
            tracing::warn!(schedule = %occurrence.schedule.id, error = %e, "scheduled run not started; the same attempt is taken up again");
            Settle::Again {
                // Postponed, not retrying: this does not count as an attempt.
                outcome: ScheduleOutcome::Postponed,
                tally: Tally::NotAnAttempt,
                run_id: None,
                error: Some(e.to_string()),
                at: now + postponed_for(occurrence, now),
            }
        }
        ApiError::Aborted(why) | ApiError::ResourceExhausted(why) => {
            tracing::info!(schedule = %occurrence.schedule.id, %why, "scheduled run postponed");
            Settle::Again {
                outcome: ScheduleOutcome::Postponed,
                tally: Tally::NotAnAttempt,
                run_id: None,
                error: Some(why.clone()),
                at: now + postponed_for(occurrence, now),
            }
        }
        ApiError::NotFound(_) | ApiError::InvalidArgument(_) | ApiError::FailedPrecondition(_) => {
            Settle::Done {
                outcome: ScheduleOutcome::Failed,
                run_id: None,
                error: Some(e.to_string()),
            }
        }
        _ => failed(occurrence, None, e.to_string(), now),
    }
}

/// How long a postponed occurrence waits before its next try: a quarter of how late it
/// already is, from [`POSTPONE`] up to [`MAX_POSTPONE`] — soon after a short wait, rarely
/// during a long one.
fn postponed_for(occurrence: &Occurrence, now: SystemTime) -> Duration {
    let late = now.duration_since(occurrence.due_at).unwrap_or_default();
    (late / 4).clamp(POSTPONE, MAX_POSTPONE)
}

/// A failed occurrence: retried on the E-12 schedule, or failed for good.
fn failed(
    occurrence: &Occurrence,
    run_id: Option<String>,
    error: String,
    now: SystemTime,
) -> Settle {
    // Tries, not attempts: the restarts before this attempt do not count. At least one: a
    // replica of the build before V24, settling an occurrence, leaves its count behind.
    let tries = occurrence
        .attempt
        .saturating_sub(occurrence.schedule.restarts)
        .max(1);
    match background::retry_backoff(&error, tries) {
        Some(backoff) => {
            tracing::warn!(schedule = %occurrence.schedule.id, attempt = occurrence.attempt, %error, "scheduled run failed; retrying later");
            Settle::Again {
                outcome: ScheduleOutcome::Retrying,
                tally: Tally::Try,
                run_id,
                error: Some(background::retried(&error)),
                at: now + backoff,
            }
        }
        None => {
            tracing::warn!(schedule = %occurrence.schedule.id, attempt = occurrence.attempt, %error, "scheduled run failed for good");
            Settle::Done {
                outcome: ScheduleOutcome::Failed,
                run_id,
                error: Some(error),
            }
        }
    }
}

/// A fresh holder name per claim: a replica that claims its own expired occurrence again is a
/// different holder, so the earlier follower can no longer settle it.
fn holder(worker: &str) -> String {
    format!("{worker}/{}", uuid::Uuid::new_v4().simple())
}

/// The time a settle counts from: the wall clock, or the claim's clock when that is ahead
/// (tests drive the claim clock forward).
fn settle_time(claimed: SystemTime) -> SystemTime {
    claimed.max(SystemTime::now())
}

fn too_many_schedules(cap: u32) -> ApiError {
    ApiError::ResourceExhausted(format!(
        "you have {cap} schedules, the limit (AGENT_MAX_SCHEDULES_PER_USER); delete one first"
    ))
}

fn check_prompt(prompt: &str) -> Result<(), ApiError> {
    if prompt.len() > MAX_PROMPT_BYTES {
        return Err(ApiError::InvalidArgument(format!(
            "prompt is {} bytes; the limit is {MAX_PROMPT_BYTES}",
            prompt.len()
        )));
    }
    Ok(())
}
