//! Proto ↔ domain for AgentService, and the input rules of A-2: caps are refused by field name,
//! never silently cut; the conversation keeps its most recent 40 entries as S1 specifies.

use steward_proto::agent::v1 as pb;

pub use steward_proto::wellknown::{json_to_struct, non_finite_number, struct_to_json, timestamp};

use std::time::{Duration, SystemTime};

use super::ApiError;
use crate::{
    executor::limits::Channel,
    runs::{Attached, RunInput},
    store::{
        Message, MessageKind, MessageSource, ModelUsage, Run, RunState, RunUsage, Thread,
        UsageSummary,
    },
};

pub const MAX_PROMPT_BYTES: usize = 32 * 1024;
pub const MAX_CONVERSATION_TEXT_BYTES: usize = 16 * 1024;
/// S1: the API keeps the most recent 40 conversation entries.
pub const MAX_CONVERSATION_ENTRIES: usize = 40;
pub const MAX_ATTACHED: usize = 12;
const MAX_ID_BYTES: usize = 256;
const MAX_TITLE_BYTES: usize = 1024;
const MAX_SNIPPET_BYTES: usize = 4 * 1024;
const MAX_META_BYTES: usize = 8 * 1024;
const MAX_REQUEST_ID_BYTES: usize = 128;

fn too_long(field: &str, len: usize, max: usize) -> ApiError {
    ApiError::InvalidArgument(format!("{field} is {len} bytes; the limit is {max}"))
}

/// A text field the caller wrote: at most `max` bytes and no NUL character (which no store
/// can keep, and which no one types).
pub fn text(field: &str, value: &str, max: usize) -> Result<(), ApiError> {
    if value.len() > max {
        return Err(too_long(field, value.len(), max));
    }
    if value.contains('\0') {
        return Err(ApiError::InvalidArgument(format!(
            "{field} contains a NUL character; remove it"
        )));
    }
    Ok(())
}

/// An id the caller names (a run, thread, approval or schedule): required, at most 256 bytes,
/// no control characters.
pub fn id<'a>(field: &str, value: &'a str) -> Result<&'a str, ApiError> {
    if value.is_empty() {
        return Err(ApiError::InvalidArgument(format!("{field} is required")));
    }
    optional_id(field, value)?;
    Ok(value)
}

/// As [`id`], where empty means "none".
pub fn optional_id(field: &str, value: &str) -> Result<(), ApiError> {
    if value.len() > MAX_ID_BYTES {
        return Err(too_long(field, value.len(), MAX_ID_BYTES));
    }
    if value.chars().any(char::is_control) {
        return Err(ApiError::InvalidArgument(format!(
            "{field} contains a control character; ids never do"
        )));
    }
    Ok(())
}

/// The hash of the arguments a decider saw (optional): 64 hex digits, compared in lower case
/// as the server writes it, so a hash copied in upper case still matches.
pub fn args_sha256(value: &str) -> Result<Option<String>, ApiError> {
    if value.is_empty() {
        return Ok(None);
    }
    if value.len() != 64 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::InvalidArgument(format!(
            "args_sha256 must be the 64 hex digits of the approval's args_sha256 (got {} characters)",
            value.chars().count()
        )));
    }
    Ok(Some(value.to_ascii_lowercase()))
}

/// A request id (idempotency key): optional, at most 128 bytes, no NUL.
pub fn request_id(field: &str, value: &str) -> Result<Option<String>, ApiError> {
    text(field, value, MAX_REQUEST_ID_BYTES)?;
    Ok(Some(value.to_owned()).filter(|r| !r.is_empty()))
}

/// Every string of a JSON value the caller sent, keys included, free of NUL.
fn json_text(field: &str, v: &serde_json::Value) -> Result<(), ApiError> {
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(items) => items.iter().any(has_nul),
            serde_json::Value::Object(map) => {
                map.iter().any(|(k, v)| k.contains('\0') || has_nul(v))
            }
            _ => false,
        }
    }
    if has_nul(v) {
        return Err(ApiError::InvalidArgument(format!(
            "{field} contains a NUL character; remove it"
        )));
    }
    Ok(())
}

/// The channel a caller may pick. The long-running channels (scheduled, heartbeat) are
/// Steward's own, not an interactive caller's (fair use); a session opening has its own RPC.
pub fn channel(c: i32) -> Result<Channel, ApiError> {
    match pb::Channel::try_from(c) {
        Ok(pb::Channel::Unspecified | pb::Channel::Web) => Ok(Channel::Web),
        Ok(pb::Channel::Telegram) => Ok(Channel::Telegram),
        Ok(
            reserved @ (pb::Channel::SessionOpen
            | pb::Channel::Scheduled
            | pb::Channel::Heartbeat
            | pb::Channel::TaskAgent),
        ) => Err(ApiError::InvalidArgument(format!(
            "input.channel {} is reserved for runs Steward starts itself; use CHANNEL_WEB or CHANNEL_TELEGRAM",
            reserved.as_str_name()
        ))),
        Err(_) => Err(ApiError::InvalidArgument(format!(
            "input.channel {c} is not a known channel; use CHANNEL_WEB or CHANNEL_TELEGRAM"
        ))),
    }
}

/// A caller's IANA time zone (`field`): `None` when empty.
pub fn time_zone(field: &str, name: &str) -> Result<Option<jiff::tz::TimeZone>, ApiError> {
    text(field, name, 64)?;
    let name = name.trim();
    if name.is_empty() {
        return Ok(None);
    }
    crate::schedule::user_zone(field, name)
        .map(Some)
        .map_err(ApiError::InvalidArgument)
}

pub fn run_input(input: Option<pb::RunInput>) -> Result<RunInput, ApiError> {
    let input = input.ok_or_else(|| {
        ApiError::InvalidArgument("input is required (with at least input.prompt)".into())
    })?;
    let prompt = input.prompt.trim().to_owned();
    if prompt.is_empty() {
        return Err(ApiError::InvalidArgument("input.prompt is required".into()));
    }
    text("input.prompt", &input.prompt, MAX_PROMPT_BYTES)?;
    optional_id("input.thread_id", &input.thread_id)?;
    text("input.model_override", &input.model_override, MAX_ID_BYTES)?;
    let skip = input
        .conversation
        .len()
        .saturating_sub(MAX_CONVERSATION_ENTRIES);
    let mut conversation = Vec::new();
    for (i, entry) in input.conversation.into_iter().enumerate().skip(skip) {
        let field = format!("input.conversation[{i}].text");
        text(&field, &entry.text, MAX_CONVERSATION_TEXT_BYTES)?;
        // Providers refuse an empty message (Anthropic with a 400): the run would fail on
        // the caller's mistake as if the model were down.
        if entry.text.trim().is_empty() {
            return Err(ApiError::InvalidArgument(format!("{field} is required")));
        }
        let user = match pb::Role::try_from(entry.role) {
            Ok(pb::Role::User) => true,
            Ok(pb::Role::Assistant) => false,
            _ => {
                return Err(ApiError::InvalidArgument(format!(
                    "input.conversation[{i}].role must be ROLE_USER or ROLE_ASSISTANT"
                )));
            }
        };
        conversation.push((user, entry.text));
    }
    // REJECT is the only policy; a value from a newer client must not pass as it.
    if !matches!(
        pb::BusyThreadPolicy::try_from(input.on_busy_thread),
        Ok(pb::BusyThreadPolicy::Unspecified | pb::BusyThreadPolicy::Reject)
    ) {
        return Err(ApiError::InvalidArgument(format!(
            "input.on_busy_thread {} is not a policy this server knows; use BUSY_THREAD_POLICY_REJECT",
            input.on_busy_thread
        )));
    }
    if input.attached_context.len() > MAX_ATTACHED {
        return Err(ApiError::InvalidArgument(format!(
            "input.attached_context has {} items; the limit is {MAX_ATTACHED}",
            input.attached_context.len()
        )));
    }
    let mut attached = Vec::new();
    for (i, a) in input.attached_context.into_iter().enumerate() {
        let field = |f: &str| format!("input.attached_context[{i}].{f}");
        if a.id.is_empty() {
            return Err(ApiError::InvalidArgument(format!(
                "{} is required",
                field("id")
            )));
        }
        for (name, value, max) in [
            ("id", &a.id, MAX_ID_BYTES),
            ("title", &a.title, MAX_TITLE_BYTES),
            ("snippet", &a.snippet, MAX_SNIPPET_BYTES),
        ] {
            text(&field(name), value, max)?;
        }
        if let Some(at) = a.meta.as_ref().and_then(non_finite_number) {
            return Err(ApiError::InvalidArgument(format!(
                "{}.{at} is not a finite number (NaN or an infinity); JSON cannot hold it",
                field("meta")
            )));
        }
        let meta = a
            .meta
            .as_ref()
            .map(struct_to_json)
            .unwrap_or(serde_json::Value::Null);
        let meta_len = meta.to_string().len();
        if meta_len > MAX_META_BYTES {
            return Err(too_long(&field("meta"), meta_len, MAX_META_BYTES));
        }
        json_text(&field("meta"), &meta)?;
        let kind = match pb::ContextType::try_from(a.r#type) {
            Ok(pb::ContextType::Email) => "email",
            Ok(pb::ContextType::CalendarEvent) => "calendar_event",
            Ok(pb::ContextType::Briefing) => "briefing",
            _ => {
                return Err(ApiError::InvalidArgument(format!(
                    "{} must be email, calendar_event or briefing",
                    field("type")
                )));
            }
        };
        attached.push(Attached {
            kind: kind.into(),
            id: a.id,
            title: a.title,
            snippet: a.snippet,
            meta,
        });
    }
    let request_id = request_id("input.request_id", &input.request_id)?;
    let budget = input.budget.unwrap_or_default();
    if budget.max_cost_usd < 0.0 || !budget.max_cost_usd.is_finite() {
        return Err(ApiError::InvalidArgument(
            "input.budget.max_cost_usd must be zero or a positive number".into(),
        ));
    }
    Ok(RunInput {
        prompt,
        thread_id: Some(input.thread_id).filter(|t| !t.is_empty()),
        conversation,
        attached,
        channel: channel(input.channel)?,
        request_id,
        max_total_tokens: Some(budget.max_total_tokens).filter(|t| *t > 0),
        max_cost_usd: Some(budget.max_cost_usd).filter(|c| *c > 0.0),
        model_override: Some(input.model_override).filter(|m| !m.is_empty()),
        time_zone: time_zone("input.time_zone", &input.time_zone)?,
        session: None,
    })
}

pub fn channel_from_key(key: &str) -> Channel {
    match key {
        "telegram" => Channel::Telegram,
        "session_open" => Channel::SessionOpen,
        "scheduled" => Channel::Scheduled,
        "heartbeat" => Channel::Heartbeat,
        "task_agent" => Channel::TaskAgent,
        _ => Channel::Web,
    }
}

pub fn approval(a: &crate::store::Approval) -> pb::Approval {
    use crate::store::ApprovalState;
    pb::Approval {
        id: a.id.clone(),
        run_id: a.run_id.clone(),
        action_id: crate::store::action_id(&a.run_id, &a.call_id),
        tool: a.tool.clone(),
        arguments: json_to_struct(&a.arguments),
        args_sha256: a.args_sha256.clone(),
        preview: a.preview.clone(),
        reason: a.reason.clone(),
        state: match a.state {
            ApprovalState::Pending => pb::ApprovalState::Pending,
            ApprovalState::Approved => pb::ApprovalState::Approved,
            ApprovalState::Rejected => pb::ApprovalState::Rejected,
            ApprovalState::Expired => pb::ApprovalState::Expired,
        } as i32,
        created_at: Some(timestamp(a.created_at)),
        expires_at: Some(timestamp(a.expires_at)),
        decided_by: a.decided_by.clone().unwrap_or_default(),
        decided_at: a.decided_at.map(timestamp),
    }
}

pub fn action(a: &crate::store::Action) -> pb::Action {
    use crate::store::ActionState;
    pb::Action {
        id: a.id.clone(),
        run_id: a.run_id.clone(),
        call_id: a.call_id.clone(),
        tool: a.tool.clone(),
        arguments: json_to_struct(&a.arguments),
        arguments_text: match &a.arguments {
            serde_json::Value::String(sent) => sent.clone(),
            _ => String::new(),
        },
        state: match a.state {
            ActionState::Planned => pb::ActionState::Planned,
            ActionState::AwaitingConfirmation => pb::ActionState::AwaitingConfirmation,
            ActionState::Executing => pb::ActionState::Executing,
            ActionState::Completed => pb::ActionState::Completed,
            ActionState::Failed => pb::ActionState::Failed,
            ActionState::Rejected => pb::ActionState::Rejected,
        } as i32,
        side_effect: a.side_effect,
        result_text: a.result_text.clone().unwrap_or_default(),
        error_kind: a.error_kind.clone().unwrap_or_default(),
        approval_id: a.approval_id.clone().unwrap_or_default(),
        created_at: Some(timestamp(a.created_at)),
        updated_at: Some(timestamp(a.updated_at)),
    }
}

pub fn run_state(s: RunState) -> pb::RunState {
    match s {
        RunState::Queued => pb::RunState::Queued,
        RunState::Planning => pb::RunState::Planning,
        RunState::Executing => pb::RunState::Executing,
        RunState::AwaitingConfirmation => pb::RunState::AwaitingConfirmation,
        RunState::Completed => pb::RunState::Completed,
        RunState::Failed => pb::RunState::Failed,
        RunState::Cancelled => pb::RunState::Cancelled,
    }
}

pub fn thread(t: &Thread) -> pb::Thread {
    pb::Thread {
        id: t.id.clone(),
        title: t.title.clone(),
        created_at: Some(timestamp(t.created_at)),
        updated_at: Some(timestamp(t.updated_at)),
        active_run_id: t.active_run_id.clone().unwrap_or_default(),
        last_run_id: t.last_run_id.clone().unwrap_or_default(),
    }
}

pub fn message(m: &Message) -> pb::Message {
    pb::Message {
        id: m.id.to_string(),
        thread_id: m.thread_id.clone(),
        run_id: m.run_id.clone().unwrap_or_default(),
        source: match m.source {
            MessageSource::User => pb::MessageSource::User,
            MessageSource::Agent => pb::MessageSource::Agent,
            MessageSource::Error => pb::MessageSource::Error,
        } as i32,
        r#type: match m.kind {
            MessageKind::Text => pb::MessageType::Text,
            MessageKind::Tool => pb::MessageType::Tool,
        } as i32,
        content: m.content.clone(),
        metadata: json_to_struct(&m.metadata),
        created_at: Some(timestamp(m.created_at)),
    }
}

pub fn run(r: &Run) -> pb::Run {
    let u = &r.usage;
    pb::Run {
        id: r.id.clone(),
        thread_id: r.thread_id.clone(),
        state: run_state(r.state) as i32,
        channel: match channel_from_key(&r.channel) {
            Channel::Web => pb::Channel::Web,
            Channel::Telegram => pb::Channel::Telegram,
            Channel::SessionOpen => pb::Channel::SessionOpen,
            Channel::Scheduled => pb::Channel::Scheduled,
            Channel::Heartbeat => pb::Channel::Heartbeat,
            Channel::TaskAgent => pb::Channel::TaskAgent,
        } as i32,
        model: r.model.clone(),
        usage: Some(run_usage(u)),
        model_calls: u
            .calls
            .iter()
            .map(|c| pb::ModelCall {
                provider: c.provider.clone(),
                model: c.model.clone(),
                usage: Some(model_usage(&ModelUsage::from(c))),
                latency: Some(prost_types::Duration {
                    seconds: (c.latency_ms / 1000) as i64,
                    nanos: ((c.latency_ms % 1000) * 1_000_000) as i32,
                }),
                retries: c.retries,
                started_at: c
                    .started_at_ms
                    .map(|ms| timestamp(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))),
            })
            .collect(),
        iterations: r.iterations,
        created_at: Some(timestamp(r.created_at)),
        started_at: r.started_at.map(timestamp),
        finished_at: r.finished_at.map(timestamp),
        error: r.error.clone().unwrap_or_default(),
        failure_kind: failure_kind(r.failure_kind.as_deref()) as i32,
        summary: r.summary.clone(),
        prompt_sections: r
            .prompt_sections
            .iter()
            .map(|(name, tokens)| pb::PromptSection {
                name: name.clone(),
                estimated_tokens: *tokens,
            })
            .collect(),
        last_event_seq: r.last_event_seq,
    }
}

/// GetUsage's window when unset: the last 30 days.
const USAGE_WINDOW: Duration = Duration::from_secs(30 * 24 * 3600);
/// The longest window GetUsage sums, so that one call reads at most a year of runs.
const MAX_USAGE_WINDOW: Duration = Duration::from_secs(366 * 24 * 3600);

/// GetUsage's `[since, until)`: each a storable time, `until` after `since`, at most 366 days
/// apart; `until` defaults to `now` and `since` to 30 days before `until` (not before 1970).
/// Both are cut to whole microseconds, as PostgreSQL keeps times, so both stores see one window.
pub fn usage_window(
    r: &pb::GetUsageRequest,
    now: SystemTime,
) -> Result<(SystemTime, SystemTime), ApiError> {
    let time = |field: &str, t: &Option<prost_types::Timestamp>| {
        t.as_ref()
            .map(|t| steward_proto::wellknown::storable_time(field, t))
            .transpose()
            .map_err(ApiError::InvalidArgument)
    };
    let until = micros(time("until", &r.until)?.unwrap_or(now));
    let since = match time("since", &r.since)? {
        Some(since) => micros(since),
        None => until
            .checked_sub(USAGE_WINDOW)
            .map_or(SystemTime::UNIX_EPOCH, |t| t.max(SystemTime::UNIX_EPOCH)),
    };
    match until.duration_since(since) {
        Err(_) | Ok(Duration::ZERO) => Err(ApiError::InvalidArgument(
            "until must be after since (runs created in [since, until) are summed)".into(),
        )),
        Ok(d) if d > MAX_USAGE_WINDOW => Err(ApiError::InvalidArgument(format!(
            "the window from since to until is longer than 366 days ({:.1} days): ask for it in parts",
            d.as_secs_f64() / (24.0 * 3600.0)
        ))),
        Ok(_) => Ok((since, until)),
    }
}

/// `t` without its part below a microsecond.
fn micros(t: SystemTime) -> SystemTime {
    let since_epoch = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    SystemTime::UNIX_EPOCH
        + Duration::new(since_epoch.as_secs(), since_epoch.subsec_micros() * 1000)
}

/// A run's totals.
pub fn run_usage(u: &RunUsage) -> pb::Usage {
    pb::Usage {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        cached_tokens: u.cached_tokens,
        cost_usd: u.cost_usd,
        model_calls: u.calls.len() as u32,
    }
}

fn model_usage(m: &ModelUsage) -> pb::Usage {
    pb::Usage {
        input_tokens: m.input_tokens,
        output_tokens: m.output_tokens,
        cached_tokens: m.cached_tokens,
        cost_usd: m.cost_usd,
        model_calls: u32::try_from(m.calls).unwrap_or(u32::MAX),
    }
}

pub fn usage(u: &UsageSummary, since: SystemTime, until: SystemTime) -> pb::GetUsageResponse {
    pb::GetUsageResponse {
        total: Some(model_usage(&u.total())),
        runs: u.runs,
        models: u
            .models
            .iter()
            .map(|m| pb::ModelUsage {
                provider: m.provider.clone(),
                model: m.model.clone(),
                usage: Some(model_usage(m)),
            })
            .collect(),
        since: Some(timestamp(since)),
        until: Some(timestamp(until)),
        summary_calls: u.summaries,
    }
}

pub fn failure_kind(k: Option<&str>) -> pb::FailureKind {
    match k {
        Some("model_unavailable") => pb::FailureKind::ModelUnavailable,
        Some("unknown_tool") => pb::FailureKind::UnknownTool,
        Some("cancelled") => pb::FailureKind::Cancelled,
        Some("timed_out") => pb::FailureKind::TimedOut,
        Some("gateway_unavailable") => pb::FailureKind::GatewayUnavailable,
        Some("interrupted") => pb::FailureKind::Interrupted,
        Some(_) => pb::FailureKind::Internal,
        None => pb::FailureKind::Unspecified,
    }
}

fn foreign_token() -> ApiError {
    ApiError::InvalidArgument("page_token is not one this service issued".into())
}

/// Pagination of an append-only list: tokens are offsets, opaque to callers.
pub fn page(
    token: &str,
    size: i32,
    default: usize,
    max: usize,
) -> Result<(usize, usize), ApiError> {
    // An offset the database can take (a signed 64-bit OFFSET), or the token is not ours.
    let offset = if token.is_empty() {
        0
    } else {
        token.parse::<u32>().map_err(|_| foreign_token())? as usize
    };
    Ok((offset, page_size(size, default, max)?))
}

/// Pagination of a user's threads, most recently updated first. Any message moves a thread to
/// the top, so an offset would skip or repeat threads between pages: a token names the last
/// thread shown, and the next page starts after it.
pub fn thread_page(
    token: &str,
    size: i32,
) -> Result<(Option<crate::store::ThreadCursor>, usize), ApiError> {
    let after = if token.is_empty() {
        None
    } else {
        let (nanos, id) = token.split_once(':').ok_or_else(foreign_token)?;
        let nanos = nanos.parse::<u64>().map_err(|_| foreign_token())?;
        // The id goes to the database: one we never issued (a NUL, megabytes) is the
        // caller's mistake, not a database fault.
        if id.is_empty() || optional_id("page_token", id).is_err() {
            return Err(foreign_token());
        }
        Some(crate::store::ThreadCursor {
            updated_at: SystemTime::UNIX_EPOCH + Duration::from_nanos(nanos),
            id: id.to_owned(),
        })
    };
    Ok((after, page_size(size, 20, 100)?))
}

/// The token of the page after `last`.
pub fn thread_page_token(last: &crate::store::Thread) -> String {
    let nanos = last
        .updated_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("{nanos}:{}", last.id)
}

fn page_size(size: i32, default: usize, max: usize) -> Result<usize, ApiError> {
    Ok(match size {
        0 => default,
        n if n < 0 || n as usize > max => {
            return Err(ApiError::InvalidArgument(format!(
                "page_size must be between 1 and {max}"
            )));
        }
        n => n as usize,
    })
}
