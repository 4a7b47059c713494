//! Tasks (I-7, S3): add_task, list_tasks, complete_task, delete_task, update_task. The user is
//! always the caller from identity; a task id that is not the user's is "not found", never
//! someone else's task.

use std::{sync::Arc, time::SystemTime};

use serde_json::{Value, json};

use super::{quoted, store_error, text_arg};
use crate::{
    context::CallContext,
    domain::Integration,
    enforce::ToolError,
    registry::{Tool, ToolOutput, ToolSpec},
    store::{Task, TaskFilter, TaskPatch, TaskStore},
    time::{Resolved, overdue_days, parse_when, short_date},
};

const DUE: &str = "When it is due: RFC 3339 (2026-11-25T17:00:00Z), a date (2026-11-25: by the end of that day in the user's time zone), or a local time in the user's zone (2026-11-25T17:00)";

pub fn tools(store: Arc<dyn TaskStore>) -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(AddTask(store.clone())),
        Arc::new(ListTasks(store.clone())),
        Arc::new(CompleteTask(store.clone())),
        Arc::new(DeleteTask(store.clone())),
        Arc::new(UpdateTask(store)),
    ]
}

// Tasks live inside Steward: changing them acts on nothing outside it, so they are not side
// effects and need no approval (P-3 keys approvals off this flag).
fn spec(name: &str, description: &str, schema: Value) -> ToolSpec {
    ToolSpec::new(name, Integration::Tasks, description, schema)
}

fn task_id(args: &Value) -> i64 {
    args.get("task_id")
        .and_then(Value::as_i64)
        .unwrap_or_default()
}

fn not_found(id: i64) -> ToolError {
    ToolError::NotFound(format!("I couldn't find task #{id}."))
}

/// `#7 "Call dentist" — due Nov 25 (overdue 2d)` or `#7 "Call dentist" — done`, its date in
/// the user's zone `tz`.
pub fn render_task(t: &Task, now: SystemTime, tz: &jiff::tz::TimeZone) -> String {
    let mut line = format!("#{} {}", t.id, quoted(&t.title));
    if t.completed_at.is_some() {
        line.push_str(" — done");
    } else if let Some(due) = t.due_at {
        line.push_str(&format!(" — due {}", short_date(due, tz)));
        let days = overdue_days(due, now, tz);
        if days > 0 {
            line.push_str(&format!(" (overdue {days}d)"));
        }
    }
    if let Some(d) = &t.description {
        line.push_str(&format!("\n   {}", d.chars().take(200).collect::<String>()));
    }
    line
}

fn due_arg(ctx: &CallContext, args: &Value, tool: &str) -> Result<Option<Resolved>, ToolError> {
    text_arg(args, "due")
        .map(|raw| {
            parse_when(&raw, ctx.time_zone.as_ref()).map_err(|detail| ToolError::InvalidArguments {
                tool: tool.into(),
                detail,
            })
        })
        .transpose()
}

struct AddTask(Arc<dyn TaskStore>);

#[async_trait::async_trait]
impl Tool for AddTask {
    fn spec(&self) -> ToolSpec {
        spec(
            "add_task",
            "Add a task to the user's task list.",
            json!({"type": "object", "additionalProperties": false, "required": ["title"], "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 500},
                "description": {"type": "string", "maxLength": 4000},
                "due": {"type": "string", "description": DUE}}}),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let title = text_arg(&args, "title").ok_or_else(|| ToolError::InvalidArguments {
            tool: "add_task".into(),
            detail: "title is blank".into(),
        })?;
        let due = due_arg(ctx, &args, "add_task")?;
        let description = text_arg(&args, "description");
        let task = self
            .0
            .add_task(
                &ctx.user,
                &title,
                description.as_deref(),
                due.as_ref().map(|d| d.at),
            )
            .await
            .map_err(store_error)?;
        let said = format!(
            "Added task {}.",
            render_task(&task, SystemTime::now(), ctx.zone())
        );
        Ok(ToolOutput::text(match &due {
            Some(due) => due.noted(said),
            None => said,
        }))
    }
}

struct ListTasks(Arc<dyn TaskStore>);

#[async_trait::async_trait]
impl Tool for ListTasks {
    /// Reads only: its audit records may be written after it answers.
    fn read_only(&self) -> bool {
        true
    }

    fn spec(&self) -> ToolSpec {
        spec(
            "list_tasks",
            "List the user's tasks with their ids, due dates and whether they are overdue.",
            json!({"type": "object", "additionalProperties": false, "properties": {
                "status": {"type": "string", "enum": ["all", "pending", "completed"], "default": "pending"}}}),
        )
        // Items may have been written by the agent from others' words and carry no
        // provenance yet: a run that read them is treated as having read external content.
        .reading_external_content()
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let (filter, label) = match args
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("pending")
        {
            "all" => (TaskFilter::All, "tasks"),
            "completed" => (TaskFilter::Completed, "completed tasks"),
            _ => (TaskFilter::Pending, "pending tasks"),
        };
        let tasks = self
            .0
            .list_tasks(&ctx.user, filter)
            .await
            .map_err(store_error)?;
        if tasks.is_empty() {
            return Ok(ToolOutput::text(format!("No {label}.")));
        }
        let now = SystemTime::now();
        let lines: Vec<String> = tasks
            .iter()
            .map(|t| render_task(t, now, ctx.zone()))
            .collect();
        Ok(ToolOutput::text(format!(
            "{} ({}):\n{}",
            capitalise(label),
            tasks.len(),
            lines.join("\n")
        )))
    }
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
        .unwrap_or_default()
}

fn id_schema() -> Value {
    json!({"type": "object", "additionalProperties": false, "required": ["task_id"], "properties": {
        "task_id": {"type": "integer", "minimum": 1, "description": "The task's id, as listed (#7 → 7)"}}})
}

struct CompleteTask(Arc<dyn TaskStore>);

#[async_trait::async_trait]
impl Tool for CompleteTask {
    fn spec(&self) -> ToolSpec {
        spec(
            "complete_task",
            "Mark one of the user's tasks as done.",
            id_schema(),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let id = task_id(&args);
        let patch = TaskPatch {
            completed: Some(true),
            ..TaskPatch::default()
        };
        let task = self
            .0
            .update_task(&ctx.user, id, patch)
            .await
            .map_err(store_error)?
            .ok_or_else(|| not_found(id))?;
        Ok(ToolOutput::text(format!(
            "Completed task #{}: {}.",
            task.id,
            quoted(&task.title)
        )))
    }
}

struct DeleteTask(Arc<dyn TaskStore>);

#[async_trait::async_trait]
impl Tool for DeleteTask {
    fn spec(&self) -> ToolSpec {
        spec(
            "delete_task",
            "Delete one of the user's tasks.",
            id_schema(),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let id = task_id(&args);
        let task = self
            .0
            .delete_task(&ctx.user, id)
            .await
            .map_err(store_error)?
            .ok_or_else(|| not_found(id))?;
        Ok(ToolOutput::text(format!(
            "Deleted task #{}: {}.",
            task.id,
            quoted(&task.title)
        )))
    }
}

struct UpdateTask(Arc<dyn TaskStore>);

#[async_trait::async_trait]
impl Tool for UpdateTask {
    fn spec(&self) -> ToolSpec {
        spec(
            "update_task",
            "Change a task's title, description, due date or status. Pass an empty due to clear it.",
            json!({"type": "object", "additionalProperties": false, "required": ["task_id"], "minProperties": 2,
                "properties": {
                    "task_id": {"type": "integer", "minimum": 1},
                    "title": {"type": "string", "minLength": 1, "maxLength": 500},
                    "description": {"type": "string", "maxLength": 4000},
                    "due": {"type": "string", "description": DUE},
                    "status": {"type": "string", "enum": ["pending", "completed"]}}}),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let id = task_id(&args);
        let title = match args.get("title") {
            None => None,
            Some(_) => {
                Some(
                    text_arg(&args, "title").ok_or_else(|| ToolError::InvalidArguments {
                        tool: "update_task".into(),
                        detail: "title is blank; give a title or leave it out".into(),
                    })?,
                )
            }
        };
        let due = match args.get("due") {
            None => None,
            Some(_) => Some(due_arg(ctx, &args, "update_task")?),
        };
        let patch = TaskPatch {
            title,
            description: args
                .get("description")
                .map(|_| text_arg(&args, "description")),
            due_at: due.as_ref().map(|d| d.as_ref().map(|d| d.at)),
            completed: args
                .get("status")
                .and_then(Value::as_str)
                .map(|s| s == "completed"),
        };
        let task = self
            .0
            .update_task(&ctx.user, id, patch)
            .await
            .map_err(store_error)?
            .ok_or_else(|| not_found(id))?;
        let said = format!(
            "Updated task {}.",
            render_task(&task, SystemTime::now(), ctx.zone())
        );
        Ok(ToolOutput::text(match due.flatten() {
            Some(due) => due.noted(said),
            None => said,
        }))
    }
}
