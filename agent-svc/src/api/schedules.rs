//! Schedules at the edge (issue 16): proto requests to validated domain changes and back.
//! Recurrence and rules are checked by the run service, which names the field at fault.

use std::time::Duration;

use steward_proto::agent::v1 as pb;

use super::{
    ApiError,
    convert::{self, MAX_PROMPT_BYTES, timestamp},
};
use crate::{
    runs::scheduled::{NewSchedule, ScheduleChange},
    store::{Schedule, ScheduleKind, ScheduleOutcome},
};

fn kind(k: i32) -> Result<ScheduleKind, ApiError> {
    match pb::ScheduleKind::try_from(k) {
        Ok(pb::ScheduleKind::Briefing) => Ok(ScheduleKind::Briefing),
        Ok(pb::ScheduleKind::CheckIn) => Ok(ScheduleKind::CheckIn),
        Ok(pb::ScheduleKind::Heartbeat) => Ok(ScheduleKind::Heartbeat),
        _ => Err(ApiError::InvalidArgument(
            "kind must be SCHEDULE_KIND_BRIEFING, SCHEDULE_KIND_CHECK_IN or SCHEDULE_KIND_HEARTBEAT".into(),
        )),
    }
}

fn interval(d: Option<prost_types::Duration>) -> Result<Option<Duration>, ApiError> {
    match d {
        None => Ok(None),
        Some(d) if d.seconds > 0 && d.nanos == 0 => Ok(Some(Duration::from_secs(d.seconds as u64))),
        Some(d) => Err(ApiError::InvalidArgument(format!(
            "interval must be a positive whole number of seconds (got {}s {}ns)",
            d.seconds, d.nanos
        ))),
    }
}

fn cron(c: String) -> Option<String> {
    Some(c).filter(|c| !c.trim().is_empty())
}

/// IANA zone names are short ("America/Argentina/ComodRivadavia" is among the longest).
const MAX_TIME_ZONE_BYTES: usize = 64;
/// Five fields, lists included, are far shorter.
const MAX_CRON_BYTES: usize = 256;

/// The texts a schedule keeps, each checked by name before anything reads them: none holds a
/// NUL (no store can keep one) or exceeds its size (they are echoed in errors and prompts).
fn texts(
    prompt: Option<&str>,
    cron: Option<&str>,
    time_zone: Option<&str>,
) -> Result<(), ApiError> {
    if let Some(p) = prompt {
        convert::text("prompt", p, MAX_PROMPT_BYTES)?;
    }
    if let Some(c) = cron {
        convert::text("cron", c, MAX_CRON_BYTES)?;
    }
    if let Some(z) = time_zone {
        convert::text("time_zone", z, MAX_TIME_ZONE_BYTES)?;
    }
    Ok(())
}

pub(super) fn new_schedule(r: pb::CreateScheduleRequest) -> Result<NewSchedule, ApiError> {
    texts(Some(&r.prompt), Some(&r.cron), Some(&r.time_zone))?;
    convert::optional_id("thread_id", &r.thread_id)?;
    Ok(NewSchedule {
        kind: kind(r.kind)?,
        every: interval(r.interval)?,
        cron: cron(r.cron),
        prompt: r.prompt,
        time_zone: r.time_zone.trim().to_owned(),
        thread_id: Some(r.thread_id).filter(|t| !t.is_empty()),
        new_thread_per_run: r.new_thread_per_run,
        enabled: !r.disabled,
    })
}

pub(super) fn change(r: pb::UpdateScheduleRequest) -> Result<ScheduleChange, ApiError> {
    texts(
        r.prompt.as_deref(),
        r.cron.as_deref(),
        r.time_zone.as_deref(),
    )?;
    if r.cron.as_deref().is_some_and(|c| c.trim().is_empty()) {
        return Err(ApiError::InvalidArgument(
            "cron, when set, must not be empty (set interval instead to switch to an interval)"
                .into(),
        ));
    }
    Ok(ScheduleChange {
        prompt: r.prompt,
        cron: r.cron,
        every: interval(r.interval)?,
        time_zone: r.time_zone.map(|z| z.trim().to_owned()),
        enabled: r.enabled,
    })
}

fn outcome(o: Option<ScheduleOutcome>) -> pb::ScheduleOutcome {
    match o {
        None => pb::ScheduleOutcome::Unspecified,
        Some(ScheduleOutcome::Running) => pb::ScheduleOutcome::Running,
        Some(ScheduleOutcome::Completed) => pb::ScheduleOutcome::Completed,
        Some(ScheduleOutcome::AwaitingApproval) => pb::ScheduleOutcome::AwaitingApproval,
        Some(ScheduleOutcome::Retrying) => pb::ScheduleOutcome::Retrying,
        Some(ScheduleOutcome::Failed) => pb::ScheduleOutcome::Failed,
        Some(ScheduleOutcome::Postponed) => pb::ScheduleOutcome::Postponed,
    }
}

pub(super) fn schedule(s: &Schedule) -> pb::Schedule {
    pb::Schedule {
        id: s.id.clone(),
        kind: match s.kind {
            ScheduleKind::Briefing => pb::ScheduleKind::Briefing,
            ScheduleKind::CheckIn => pb::ScheduleKind::CheckIn,
            ScheduleKind::Heartbeat => pb::ScheduleKind::Heartbeat,
        } as i32,
        prompt: s.prompt.clone(),
        cron: s.cron.clone().unwrap_or_default(),
        interval: s.every.map(|d| prost_types::Duration {
            seconds: d.as_secs() as i64,
            nanos: 0,
        }),
        time_zone: s.time_zone.clone(),
        enabled: s.enabled,
        thread_id: s.thread_id.clone().unwrap_or_default(),
        next_due_at: Some(timestamp(s.next_due_at)),
        last_outcome: outcome(s.last_outcome) as i32,
        last_run_id: s.last_run_id.clone().unwrap_or_default(),
        last_error: s.last_error.clone().unwrap_or_default(),
        last_fired_at: s.last_fired_at.map(timestamp),
        created_at: Some(timestamp(s.created_at)),
        updated_at: Some(timestamp(s.updated_at)),
    }
}
