//! Reminders (I-7): create_reminder and get_reminders (upcoming, soonest first).

use std::{sync::Arc, time::SystemTime};

use serde_json::{Value, json};

use super::{quoted, store_error, text_arg};
use crate::{
    context::CallContext,
    domain::Integration,
    enforce::ToolError,
    registry::{Tool, ToolOutput, ToolSpec},
    store::ReminderStore,
    time::{parse_when, short_datetime_zoned},
};

pub fn tools(store: Arc<dyn ReminderStore>) -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(CreateReminder(store.clone())),
        Arc::new(GetReminders(store)),
    ]
}

// Reminders live inside Steward, so they are not side effects (see tasks).
fn spec(name: &str, description: &str, schema: Value) -> ToolSpec {
    ToolSpec::new(name, Integration::Reminders, description, schema)
}

struct CreateReminder(Arc<dyn ReminderStore>);

#[async_trait::async_trait]
impl Tool for CreateReminder {
    fn spec(&self) -> ToolSpec {
        spec(
            "create_reminder",
            "Set a reminder for the user at a future time.",
            json!({"type": "object", "additionalProperties": false, "required": ["text", "due_at"], "properties": {
                "text": {"type": "string", "minLength": 1, "maxLength": 1000},
                "due_at": {"type": "string", "description": "RFC 3339 date-time, e.g. 2026-11-25T09:00:00Z, or a local time in the user's zone, e.g. 2026-11-25T09:00"}}}),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let invalid = |detail: String| ToolError::InvalidArguments {
            tool: "create_reminder".into(),
            detail,
        };
        let text = text_arg(&args, "text").ok_or_else(|| invalid("text is blank".into()))?;
        let tz = ctx.zone();
        let due = parse_when(
            &text_arg(&args, "due_at").unwrap_or_default(),
            ctx.time_zone.as_ref(),
        )
        .map_err(invalid)?;
        if due.at < SystemTime::now() {
            return Err(invalid(format!(
                "{} is in the past; pick a future time",
                short_datetime_zoned(due.at, tz)
            )));
        }
        let r = self
            .0
            .add_reminder(&ctx.user, &text, due.at)
            .await
            .map_err(store_error)?;
        Ok(ToolOutput::text(due.noted(format!(
            "Reminder #{} set for {}: {}.",
            r.id,
            short_datetime_zoned(r.due_at, tz),
            quoted(&r.text)
        ))))
    }
}

struct GetReminders(Arc<dyn ReminderStore>);

#[async_trait::async_trait]
impl Tool for GetReminders {
    /// Reads only: its audit records may be written after it answers.
    fn read_only(&self) -> bool {
        true
    }

    fn spec(&self) -> ToolSpec {
        spec(
            "get_reminders",
            "List the user's upcoming reminders, soonest first.",
            json!({"type": "object", "additionalProperties": false, "properties": {
                "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10}}}),
        )
        // Items may have been written by the agent from others' words and carry no
        // provenance yet: a run that read them is treated as having read external content.
        .reading_external_content()
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let limit = args.get("limit").and_then(Value::as_u64).unwrap_or(10) as usize;
        let reminders = self
            .0
            .upcoming_reminders(&ctx.user, SystemTime::now(), limit)
            .await
            .map_err(store_error)?;
        if reminders.is_empty() {
            return Ok(ToolOutput::text("No upcoming reminders."));
        }
        let lines: Vec<String> = reminders
            .iter()
            .map(|r| {
                format!(
                    "#{} {} — {}",
                    r.id,
                    short_datetime_zoned(r.due_at, ctx.zone()),
                    quoted(&r.text)
                )
            })
            .collect();
        Ok(ToolOutput::text(format!(
            "Upcoming reminders ({}):\n{}",
            reminders.len(),
            lines.join("\n")
        )))
    }
}
