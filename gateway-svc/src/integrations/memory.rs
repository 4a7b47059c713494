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
    registry::{Preview, Tool, ToolOutput, ToolSpec, clip},
    store::NoteStore,
    time::short_date,
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

fn notes_from(args: &Value, tool: &str) -> Result<Vec<(String, Vec<String>)>, ToolError> {
    args.get("memories")
        .and_then(Value::as_array)
        .map(|m| m.iter().map(|v| note_from(v, tool)).collect())
        .unwrap_or(Ok(Vec::new()))
}

/// One note's words and tags; words that are only whitespace are refused, not saved empty.
fn note_from(v: &Value, tool: &str) -> Result<(String, Vec<String>), ToolError> {
    let content = text_arg(v, "content").ok_or_else(|| ToolError::InvalidArguments {
        tool: tool.to_owned(),
        detail: "content is blank; give the words to remember".into(),
    })?;
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
    Ok((content, tags))
}

/// The provenance a memory written in this call gets: empty for the user's own words.
fn origin(ctx: &CallContext) -> String {
    if ctx.read_external_from.is_empty() {
        return String::new();
    }
    let mut origin = format!("read by {}", ctx.read_external_from.join(", "));
    if let Some(run) = &ctx.run_id {
        origin.push_str(&format!(" in run {run}"));
    }
    origin
}

/// The exact text of the memories a call would store, and where they would come from.
fn memory_preview(notes: &[(String, Vec<String>)], ctx: &CallContext) -> Preview {
    let mut text = format!(
        "Remember {} about the user (shown in later conversations):",
        if notes.len() == 1 {
            "this".to_owned()
        } else {
            format!("these {}", notes.len())
        }
    );
    for (content, tags) in notes {
        text.push_str(&format!("\n- \"{}\"", clip(content, 1000)));
        if !tags.is_empty() {
            text.push_str(&format!(" (tags: {})", tags.join(", ")));
        }
    }
    let origin = origin(ctx);
    if !origin.is_empty() {
        text.push_str(&format!("\nWritten after this run {origin}."));
    }
    Preview {
        text,
        ..Preview::default()
    }
}

// Remembering is internal state, not an action on the outside world: no approval for the
// user's own words; after reading someone else's, agent-svc's policy asks first (issue 14).
struct SaveMemory(Arc<dyn NoteStore>);

#[async_trait::async_trait]
impl Tool for SaveMemory {
    fn spec(&self) -> ToolSpec {
        spec(
            "save_memory",
            "Remember one fact about the user for later conversations.",
            note_schema(),
        )
        .writing_memory()
    }

    async fn preview(&self, ctx: &CallContext, args: &Value) -> Result<Preview, ToolError> {
        Ok(memory_preview(&[note_from(args, "save_memory")?], ctx))
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let notes = self
            .0
            .add_notes(&ctx.user, &[note_from(&args, "save_memory")?], &origin(ctx))
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
        .writing_memory()
    }

    async fn preview(&self, ctx: &CallContext, args: &Value) -> Result<Preview, ToolError> {
        Ok(memory_preview(&notes_from(args, "create_memories")?, ctx))
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let notes = notes_from(&args, "create_memories")?;
        let saved = self
            .0
            .add_notes(&ctx.user, &notes, &origin(ctx))
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
    /// Reads only: its audit records may be written after it answers.
    fn read_only(&self) -> bool {
        true
    }

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
        let lines: Vec<String> = notes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                // Others' words are marked as such wherever a memory is read back.
                let origin = if n.origin.is_empty() {
                    String::new()
                } else {
                    format!(" (from external content: {})", n.origin)
                };
                format!(
                    "{}. [#{}] {} (saved {}{origin})",
                    i + 1,
                    n.id,
                    n.content,
                    short_date(n.created_at, ctx.zone())
                )
            })
            .collect();
        Ok(ToolOutput {
            // Memories taken from others' words carry them into whatever reads them.
            external: notes.iter().any(|n| !n.origin.is_empty()),
            ..ToolOutput::text(format!(
                "Memories matching \"{query}\" ({}):\n{}",
                notes.len(),
                lines.join("\n")
            ))
        })
    }
}
