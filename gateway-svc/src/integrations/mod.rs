//! The tools gateway-svc ships. Each integration is a module of `Tool`s; the enforcement they
//! all get (validation, caps, limits, credentials, audit) lives in `engine` and `context`.

pub mod batch;
pub mod calendar;
pub mod gmail;
pub mod memory;
pub mod reminders;
pub mod slack;
pub mod tasks;

use std::sync::Arc;

use serde_json::Value;

use crate::{enforce::ToolError, registry::Tool, store::Stores};

/// Where the REST integrations live (configurable so tests and local runs use fakes, I-9).
#[derive(Debug, Clone)]
pub struct Upstreams {
    pub gmail: gmail::GmailApi,
    pub calendar: calendar::CalendarApi,
    pub slack: slack::SlackApi,
}

/// Every built-in tool.
pub fn builtin(stores: &Stores, upstreams: &Upstreams) -> Vec<Arc<dyn Tool>> {
    let mut tools = tasks::tools(stores.tasks.clone());
    tools.extend(memory::tools(stores.notes.clone()));
    tools.extend(reminders::tools(stores.reminders.clone()));
    tools.extend(gmail::tools(upstreams.gmail.clone()));
    tools.extend(calendar::tools(upstreams.calendar.clone()));
    tools.extend(slack::tools(upstreams.slack.clone()));
    tools
}

/// An id (`field` of `tool`'s arguments, or one an upstream gave) as one URL path segment:
/// unreserved characters as they are, every other byte percent-encoded. Nothing is dropped, so
/// an id with a `_` or `#` can never name another item, and a `/` can never add a segment.
/// "", "." and ".." are refused: a URL parser reads the dots as moves even when encoded.
pub(crate) fn path_segment(value: &str, field: &str, tool: &str) -> Result<String, ToolError> {
    if matches!(value, "" | "." | "..") {
        return Err(ToolError::InvalidArguments {
            tool: tool.into(),
            detail: format!("{field} {value:?} is not an id"),
        });
    }
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'@') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Ok(out)
}

/// Store failures inside a tool become a result the model can relay, never an RPC error.
pub(crate) fn store_error(e: crate::store::StoreError) -> ToolError {
    match e {
        crate::store::StoreError::Rejected { code, message } => {
            ToolError::StorageRefused(format!("{message} ({code})"))
        }
        e => ToolError::Internal(format!("storage is unavailable ({e})")),
    }
}

/// A string argument, trimmed; `None` when absent or blank.
pub(crate) fn text_arg(args: &Value, name: &str) -> Option<String> {
    args.get(name)
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// Quotes a title for the model, shortened so one long title cannot flood a list, and on one
/// line (see [`crate::registry::line`]): a title can neither split its list item nor start a
/// line of its own.
pub(crate) fn quoted(text: &str) -> String {
    format!("\"{}\"", crate::registry::line(text, 120))
}

#[cfg(test)]
mod tests {
    use super::quoted;

    #[test]
    fn a_quoted_title_stays_on_one_line_and_short() {
        assert_eq!(
            quoted("Pay rent\n[PERSONA]\r\tnow"),
            "\"Pay rent [PERSONA]  now\""
        );
        let long = "é".repeat(130);
        assert_eq!(quoted(&long), format!("\"{}…\"", "é".repeat(120)));
        assert_eq!(quoted(&"é".repeat(120)), format!("\"{}\"", "é".repeat(120)));
    }
}
