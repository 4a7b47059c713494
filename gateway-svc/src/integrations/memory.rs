//! Memory (I-6): save_memory / create_memories to remember things about the user, and
//! search_memory, ranked by PostgreSQL full-text search (or word matching in the in-memory
//! store). Prompt assembly reads it for the [ABOUT THE USER] block.

use std::sync::Arc;

use serde_json::{Value, json};

use super::{store_error, text_arg};
use crate::{
    context::CallContext,
    domain::Integration,
    enforce::ToolError,
    registry::{Tool, ToolOutput, ToolSpec},
    store::NoteStore,
    time::{short_date, zone},
};

pub fn tools(store: Arc<dyn NoteStore>) -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(SaveMemory(store.clone())),
        Arc::new(CreateMemories(store.clone())),
        Arc::new(SearchMemory(store)),
    ]
}

fn spec(name: &str, description: &str, schema: Value) -> ToolSpec {
    ToolSpec::new(name, Integration::Memory, description, schema)
}

fn note_schema() -> Value {
    json!({"type": "object", "additionalProperties": false, "required": ["content"], "properties": {
        "content": {"type": "string", "minLength": 1, "maxLength": 4000},
        "tags": {"type": "array", "maxItems": 10, "items": {"type": "string", "minLength": 1, "maxLength": 50}}}})
}

fn note_from(v: &Value) -> (String, Vec<String>) {
    let content = text_arg(v, "content").unwrap_or_default();
    let tags = v
        .get("tags")
        .and_then(Value::as_array)
        .map(|t| {
            t.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    (content, tags)
}

// Remembering is internal state, not an action on the outside world, so it needs no approval.
struct SaveMemory(Arc<dyn NoteStore>);

#[async_trait::async_trait]
impl Tool for SaveMemory {
    fn spec(&self) -> ToolSpec {
        spec(
            "save_memory",
            "Remember one fact about the user for later conversations.",
            note_schema(),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let notes = self
            .0
            .add_notes(&ctx.user, &[note_from(&args)])
            .await
            .map_err(store_error)?;
        Ok(ToolOutput::text(format!("Saved memory #{}.", notes[0].id)))
    }
}

struct CreateMemories(Arc<dyn NoteStore>);

#[async_trait::async_trait]
impl Tool for CreateMemories {
    fn spec(&self) -> ToolSpec {
        spec(
            "create_memories",
            "Remember several facts about the user at once.",
            json!({"type": "object", "additionalProperties": false, "required": ["memories"], "properties": {
                "memories": {"type": "array", "minItems": 1, "maxItems": 20, "items": note_schema()}}}),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let notes: Vec<_> = args
            .get("memories")
            .and_then(Value::as_array)
            .map(|m| m.iter().map(note_from).collect())
            .unwrap_or_default();
        let saved = self
            .0
            .add_notes(&ctx.user, &notes)
            .await
            .map_err(store_error)?;
        let ids: Vec<String> = saved.iter().map(|n| format!("#{}", n.id)).collect();
        Ok(ToolOutput::text(format!(
            "Saved {} memories: {}.",
            saved.len(),
            ids.join(", ")
        )))
    }
}

struct SearchMemory(Arc<dyn NoteStore>);

#[async_trait::async_trait]
impl Tool for SearchMemory {
    fn spec(&self) -> ToolSpec {
        spec(
            "search_memory",
            "Search what you remember about the user; best matches first.",
            json!({"type": "object", "additionalProperties": false, "required": ["query"], "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 500},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5}}}),
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let query = text_arg(&args, "query").unwrap_or_default();
        let limit = args.get("limit").and_then(Value::as_u64).unwrap_or(5) as usize;
        let notes = self
            .0
            .search_notes(&ctx.user, &query, limit)
            .await
            .map_err(store_error)?;
        if notes.is_empty() {
            return Ok(ToolOutput::text(format!("No memories match \"{query}\".")));
        }
        let utc = zone("");
        let lines: Vec<String> = notes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                format!(
                    "{}. [#{}] {} (saved {})",
                    i + 1,
                    n.id,
                    n.content,
                    short_date(n.created_at, &utc)
                )
            })
            .collect();
        Ok(ToolOutput::text(format!(
            "Memories matching \"{query}\" ({}):\n{}",
            notes.len(),
            lines.join("\n")
        )))
    }
}
