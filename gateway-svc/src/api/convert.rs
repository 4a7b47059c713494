//! Proto ↔ domain conversions, all in one place.

use std::time::Duration;

use serde_json::{Map, Value};
use steward_proto::gateway::v1 as pb;

use crate::{
    bootstrap::{BootstrapContext, SourceStatus, TaskBrief},
    credentials::AccountInfo,
    domain::{CallOutcome, CallRequest, Channel, ErrorKind, Integration},
    enforce::ToolError,
    registry::{Preview, RegisteredTool},
    store::AccountStatus,
};

pub const MAX_CALL_ID_BYTES: usize = 128;
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 128;

/// Why `key` cannot be an idempotency key, if it cannot: longer than
/// [`MAX_IDEMPOTENCY_KEY_BYTES`], or holding NUL (which no store keeps) or another control
/// character. One rule for every way in (gRPC, the MCP endpoint).
pub fn idempotency_key_problem(key: &str) -> Option<String> {
    if key.len() > MAX_IDEMPOTENCY_KEY_BYTES {
        Some(format!(
            "idempotency_key is longer than {MAX_IDEMPOTENCY_KEY_BYTES} bytes"
        ))
    } else if key.chars().any(char::is_control) {
        Some("idempotency_key must not contain a NUL or another control character".into())
    } else {
        None
    }
}

/// The channel a call names; `None` for a number this build does not know (a newer caller's
/// channel is not silently treated as WEB, whose limits may differ).
pub fn channel(c: i32) -> Option<Channel> {
    Some(match pb::Channel::try_from(c).ok()? {
        pb::Channel::Unspecified | pb::Channel::Web => Channel::Web,
        pb::Channel::Telegram => Channel::Telegram,
        pb::Channel::SessionOpen => Channel::SessionOpen,
        pb::Channel::Scheduled => Channel::Scheduled,
        pb::Channel::Heartbeat => Channel::Heartbeat,
    })
}

/// At most this many tools whose external content a run had read, each named in at most this
/// many bytes: more is not a run's list (the agent sends the tools it called).
pub const MAX_READ_EXTERNAL_FROM: usize = 64;
const MAX_TOOL_NAME_BYTES: usize = 128;

/// A credential's expiry as the store can keep it: after 1970 and before year 9999.
pub fn expiry(t: &prost_types::Timestamp) -> Result<std::time::SystemTime, String> {
    steward_proto::wellknown::storable_time("expires_at", t)
}

pub fn integration_from_pb(i: i32) -> Option<Integration> {
    match pb::Integration::try_from(i).ok()? {
        pb::Integration::Unspecified => None,
        pb::Integration::Gmail => Some(Integration::Gmail),
        pb::Integration::GoogleCalendar => Some(Integration::GoogleCalendar),
        pb::Integration::Slack => Some(Integration::Slack),
        pb::Integration::Memory => Some(Integration::Memory),
        pb::Integration::Tasks => Some(Integration::Tasks),
        pb::Integration::Reminders => Some(Integration::Reminders),
        pb::Integration::Mcp => Some(Integration::Mcp),
    }
}

pub fn integration_to_pb(i: Integration) -> pb::Integration {
    match i {
        Integration::Gmail => pb::Integration::Gmail,
        Integration::GoogleCalendar => pb::Integration::GoogleCalendar,
        Integration::Slack => pb::Integration::Slack,
        Integration::Memory => pb::Integration::Memory,
        Integration::Tasks => pb::Integration::Tasks,
        Integration::Reminders => pb::Integration::Reminders,
        Integration::Mcp => pb::Integration::Mcp,
    }
}

fn error_kind_to_pb(k: ErrorKind) -> pb::ErrorKind {
    match k {
        ErrorKind::InvalidArguments => pb::ErrorKind::InvalidArguments,
        ErrorKind::UnknownTool => pb::ErrorKind::UnknownTool,
        ErrorKind::NotFound => pb::ErrorKind::NotFound,
        ErrorKind::RateLimited => pb::ErrorKind::RateLimited,
        ErrorKind::CredentialsMissing => pb::ErrorKind::CredentialsMissing,
        ErrorKind::CredentialsRevoked => pb::ErrorKind::CredentialsRevoked,
        ErrorKind::UpstreamError => pb::ErrorKind::UpstreamError,
        ErrorKind::UpstreamTimeout => pb::ErrorKind::UpstreamTimeout,
        ErrorKind::UpstreamUnavailable => pb::ErrorKind::UpstreamUnavailable,
        ErrorKind::Cancelled => pb::ErrorKind::Cancelled,
        ErrorKind::PermissionDenied => pb::ErrorKind::PermissionDenied,
        ErrorKind::Internal => pb::ErrorKind::Internal,
        ErrorKind::ChangedSinceApproval => pb::ErrorKind::ChangedSinceApproval,
    }
}

/// A rejected call: still answered with a result (G-4), under whatever call id it carried.
pub struct Rejected {
    pub call_id: String,
    pub tool: String,
    pub error: ToolError,
}

/// Validates a wire ToolCall into a domain CallRequest.
pub fn call_request(call: pb::ToolCall) -> Result<CallRequest, Rejected> {
    let reject = |call: &pb::ToolCall, detail: String| Rejected {
        call_id: call.call_id.clone(),
        tool: call.tool.clone(),
        error: ToolError::InvalidArguments {
            tool: call.tool.clone(),
            detail,
        },
    };
    if call.call_id.is_empty() || call.call_id.len() > MAX_CALL_ID_BYTES {
        return Err(reject(
            &call,
            format!("call_id must be 1 to {MAX_CALL_ID_BYTES} bytes"),
        ));
    }
    if call.tool.is_empty() {
        return Err(reject(&call, "tool is empty; name the tool to call".into()));
    }
    if let Some(problem) = idempotency_key_problem(&call.idempotency_key) {
        return Err(reject(&call, problem));
    }
    if call.call_id.contains('\0') {
        return Err(reject(
            &call,
            "call_id must not contain a NUL character".into(),
        ));
    }
    let Some(channel) = channel(call.channel) else {
        return Err(reject(
            &call,
            format!("channel {} is not one this gateway knows", call.channel),
        ));
    };
    if call.read_external_from.len() > MAX_READ_EXTERNAL_FROM
        || call
            .read_external_from
            .iter()
            .any(|t| t.trim().is_empty() || t.len() > MAX_TOOL_NAME_BYTES)
    {
        return Err(reject(
            &call,
            format!(
                "read_external_from must list at most {MAX_READ_EXTERNAL_FROM} tool names, each 1 to {MAX_TOOL_NAME_BYTES} bytes"
            ),
        ));
    }
    let timeout = match call.timeout {
        None => None,
        Some(d) if d.seconds >= 0 && (0..1_000_000_000).contains(&d.nanos) => {
            Some(Duration::new(d.seconds as u64, d.nanos as u32))
        }
        Some(d) => {
            return Err(reject(
                &call,
                format!(
                    "timeout {}s {}ns is not a duration; give a positive one or none",
                    d.seconds, d.nanos
                ),
            ));
        }
    };
    let args = match &call.arguments {
        None => Value::Object(Map::new()),
        Some(pb::tool_call::Arguments::Args(s)) => {
            if let Some(at) = non_finite_number(s) {
                return Err(reject(
                    &call,
                    format!(
                        "argument {at} is not a finite number (NaN or an infinity); JSON cannot hold it"
                    ),
                ));
            }
            struct_to_json(s)
        }
        Some(pb::tool_call::Arguments::ArgsJson(text)) if text.trim().is_empty() => {
            Value::Object(Map::new())
        }
        Some(pb::tool_call::Arguments::ArgsJson(text)) => match serde_json::from_str::<Value>(text)
        {
            Ok(v) => v,
            Err(e) => {
                return Err(reject(
                    &call,
                    format!("the arguments are not valid JSON ({e})"),
                ));
            }
        },
    };
    if !args.is_object() {
        return Err(reject(&call, "the arguments must be a JSON object".into()));
    }
    let time_zone = if call.time_zone.trim().is_empty() {
        None
    } else {
        match jiff::tz::TimeZone::get(call.time_zone.trim()) {
            Ok(zone) => Some(zone),
            Err(_) => {
                return Err(reject(
                    &call,
                    format!(
                        "time_zone {:?} is not an IANA time zone (e.g. \"Europe/Berlin\"); leave it empty if the user's zone is not known",
                        call.time_zone
                    ),
                ));
            }
        }
    };
    Ok(CallRequest {
        call_id: call.call_id,
        tool: call.tool,
        args,
        idempotency_key: Some(call.idempotency_key).filter(|k| !k.is_empty()),
        channel,
        timeout,
        run_id: Some(call.run_id).filter(|r| !r.is_empty()),
        read_external_from: call.read_external_from,
        expected_binding: Some(call.expected_binding).filter(|b| !b.is_empty()),
        time_zone,
    })
}

pub fn tool_result(o: CallOutcome) -> pb::ToolResult {
    pb::ToolResult {
        ok: o.ok(),
        error_kind: o
            .error_kind
            .map_or(pb::ErrorKind::Unspecified, error_kind_to_pb) as i32,
        call_id: o.call_id,
        tool: o.tool,
        text: o.text,
        truncated: o.truncated,
        original_chars: o.original_chars,
        retry_after_seconds: o.retry_after_secs,
        display: o.display.as_ref().and_then(json_to_struct),
        upstream_calls: o.upstream_calls,
        account: o.account.unwrap_or_default(),
        latency: Some(prost_types::Duration {
            seconds: o.latency.as_secs() as i64,
            nanos: o.latency.subsec_nanos() as i32,
        }),
        replayed: o.replayed,
        carries_external_content: o.external,
    }
}

/// A preview, or why there is none (a sentence, as for a failed call: the call must not run).
pub fn preview_response(result: Result<Preview, ToolError>) -> pb::PreviewCallResponse {
    match result {
        Ok(p) => pb::PreviewCallResponse {
            ok: true,
            text: p.text,
            error_kind: pb::ErrorKind::Unspecified as i32,
            recipients: p.recipients,
            binding: p.binding,
        },
        Err(e) => pb::PreviewCallResponse {
            ok: false,
            text: e.to_string(),
            error_kind: error_kind_to_pb(e.kind()) as i32,
            ..pb::PreviewCallResponse::default()
        },
    }
}

pub fn tool_spec(tool: &RegisteredTool, availability: pb::ToolAvailability) -> pb::ToolSpec {
    let spec = &tool.spec;
    pb::ToolSpec {
        name: spec.name.clone(),
        aliases: spec.aliases.clone(),
        description: spec.description.clone(),
        parameters_json_schema: tool.schema_json.clone(),
        side_effect: spec.side_effect,
        integration: integration_to_pb(spec.integration) as i32,
        upstream_cost: spec.upstream_cost,
        availability: availability as i32,
        reads_external_content: spec.reads_external_content,
        writes_memory: spec.writes_memory,
    }
}

pub fn account(a: &AccountInfo) -> pb::Account {
    pb::Account {
        integration: integration_to_pb(a.integration) as i32,
        account: a.account.clone(),
        status: match a.status {
            AccountStatus::Connected => pb::AccountStatus::Connected,
            AccountStatus::NeedsReconnect => pb::AccountStatus::NeedsReconnect,
        } as i32,
        scopes: a.scopes.clone(),
        expires_at: a.expires_at.map(timestamp),
        connected_at: Some(timestamp(a.connected_at)),
    }
}

fn source_status(s: SourceStatus) -> i32 {
    let status = match s {
        SourceStatus::Ok => pb::SourceStatus::Ok,
        SourceStatus::Unavailable => pb::SourceStatus::Unavailable,
        SourceStatus::Empty => pb::SourceStatus::Empty,
    };
    status as i32
}

fn task_brief(t: &TaskBrief) -> pb::TaskBrief {
    pb::TaskBrief {
        id: t.id.to_string(),
        title: t.title.clone(),
        due_at: t.due_at.map(timestamp),
        overdue_days: t.overdue_days,
    }
}

pub fn bootstrap(c: &BootstrapContext) -> pb::GetBootstrapContextResponse {
    pb::GetBootstrapContextResponse {
        tasks: Some(pb::TasksSummary {
            status: source_status(c.tasks.status),
            line: c.tasks.line.clone(),
            pending: c.tasks.pending,
            completed: c.tasks.completed,
            overdue: c.tasks.overdue,
            overdue_items: c.tasks.overdue_items.iter().map(task_brief).collect(),
            top: c.tasks.top.as_ref().map(task_brief),
        }),
        reminders: Some(pb::RemindersSummary {
            status: source_status(c.reminders.status),
            line: c.reminders.line.clone(),
            upcoming: c.reminders.upcoming,
            next_title: c
                .reminders
                .next
                .as_ref()
                .map(|(t, _)| t.clone())
                .unwrap_or_default(),
            next_due_at: c.reminders.next.as_ref().map(|(_, at)| timestamp(*at)),
        }),
        email: Some(pb::EmailSummary {
            status: source_status(c.email.status),
            line: c.email.line.clone(),
            accounts: c
                .email
                .accounts
                .iter()
                .map(|a| pb::AccountUnread {
                    account: a.account.clone(),
                    status: source_status(a.status),
                    unread: a.unread,
                })
                .collect(),
        }),
        new_user: c.new_user,
        rendered: c.rendered.clone(),
        generated_at: Some(timestamp(c.generated_at)),
    }
}

pub use steward_proto::wellknown::{
    json_to_struct, non_finite_number, struct_to_json, system_time, timestamp,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_json_arguments_become_a_result_not_an_rpc_error() {
        let call = pb::ToolCall {
            call_id: "c1".into(),
            tool: "list_tasks".into(),
            arguments: Some(pb::tool_call::Arguments::ArgsJson(
                r#"{"status":""/x"}"#.into(),
            )),
            ..Default::default()
        };
        let rejected = call_request(call).err().unwrap();
        assert_eq!(rejected.call_id, "c1");
        assert!(rejected.error.to_string().contains("not valid JSON"));
    }
}
