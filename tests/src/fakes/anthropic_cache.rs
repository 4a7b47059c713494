//! An Anthropic Messages server that honours prompt caching as the API documents it, so that
//! what `cache_control` saves can be shown rather than assumed: the prompt is the sequence of
//! blocks tools → system → messages; a block marked `cache_control` writes the prefix that
//! ends with it to the cache; a request reads the longest prefix, at a block boundary, that an
//! earlier request wrote. Usage reports `cache_read_input_tokens`,
//! `cache_creation_input_tokens` (up to the request's last breakpoint) and `input_tokens` (the
//! rest), counting a block's tokens as its JSON length / 4.
//!
//! Answers: when the last user message asks about `tasks` and holds no tool result yet, one
//! `list_tasks` call; otherwise a short text.

use std::{
    collections::{HashSet, hash_map::DefaultHasher},
    hash::{Hash, Hasher},
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    extract::{Json, State},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use super::model_server::frames;

/// The usage a request was billed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheUsage {
    pub input: u64,
    pub cache_read: u64,
    pub cache_write: u64,
}

impl CacheUsage {
    pub fn total(&self) -> u64 {
        self.input + self.cache_read + self.cache_write
    }
}

#[derive(Default)]
struct CacheState {
    written: Mutex<HashSet<u64>>,
    usage: Mutex<Vec<CacheUsage>>,
    calls: Mutex<u64>,
}

#[derive(Clone)]
pub struct CachingAnthropic {
    pub base: String,
    state: Arc<CacheState>,
}

impl CachingAnthropic {
    pub async fn start() -> Self {
        let state = Arc::new(CacheState::default());
        let router = Router::new()
            .route("/v1/messages", post(answer))
            .with_state(state.clone());
        let (base, _) = super::serve(router).await;
        Self { base, state }
    }

    /// Usage of every request so far, in arrival order.
    pub fn usage(&self) -> Vec<CacheUsage> {
        self.state.usage.lock().expect("lock").clone()
    }
}

/// The prompt's blocks in cache order, each without its `cache_control`, and whether it
/// carried one.
fn blocks(body: &Value) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut push = |block: &Value| {
        let mut b = block.clone();
        let marked = b
            .as_object_mut()
            .and_then(|o| o.remove("cache_control"))
            .is_some();
        out.push((b.to_string(), marked));
    };
    body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .for_each(&mut push);
    match &body["system"] {
        Value::String(s) => push(&json!({"type": "text", "text": s})),
        Value::Array(parts) => parts.iter().for_each(&mut push),
        _ => {}
    }
    for m in body["messages"].as_array().into_iter().flatten() {
        match &m["content"] {
            Value::String(s) => push(&json!({"role": m["role"], "text": s})),
            Value::Array(parts) => {
                for (i, p) in parts.iter().enumerate() {
                    // The role is part of the prompt: the same block said by another is not
                    // the same prefix.
                    let mut p = p.clone();
                    if i == 0 {
                        p["_role"] = m["role"].clone();
                    }
                    push(&p);
                }
            }
            _ => {}
        }
    }
    out
}

fn bill(state: &CacheState, body: &Value) -> CacheUsage {
    let blocks = blocks(body);
    let mut hasher = DefaultHasher::new();
    let mut prefixes = Vec::with_capacity(blocks.len());
    let mut tokens = 0u64;
    for (text, marked) in &blocks {
        text.hash(&mut hasher);
        tokens += (text.len() as u64).div_ceil(4);
        prefixes.push((hasher.finish(), tokens, *marked));
    }
    let total = tokens;
    let mut written = state.written.lock().expect("lock");
    let last_mark = prefixes.iter().rposition(|p| p.2);
    let read = last_mark
        .and_then(|end| {
            prefixes[..=end]
                .iter()
                .rev()
                .find(|p| written.contains(&p.0))
        })
        .map_or(0, |p| p.1);
    let mut write = 0;
    if let Some(end) = last_mark {
        write = prefixes[end].1.saturating_sub(read);
        for p in prefixes[..=end].iter().filter(|p| p.2) {
            written.insert(p.0);
        }
    }
    CacheUsage {
        input: total - read - write,
        cache_read: read,
        cache_write: write,
    }
}

fn wants_tasks(body: &Value) -> bool {
    let Some(last) = body["messages"].as_array().and_then(|m| m.last()) else {
        return false;
    };
    let parts = last["content"].as_array().cloned().unwrap_or_default();
    let answered = parts.iter().any(|p| p["type"] == "tool_result");
    let asks = parts
        .iter()
        .any(|p| p["text"].as_str().is_some_and(|t| t.contains("tasks")));
    asks && !answered && body["tools"].is_array()
}

async fn answer(State(s): State<Arc<CacheState>>, Json(body): Json<Value>) -> Response {
    let usage = bill(&s, &body);
    s.usage.lock().expect("lock").push(usage);
    let n = {
        let mut calls = s.calls.lock().expect("lock");
        *calls += 1;
        *calls
    };
    let start = json!({"type": "message_start", "message": {"id": format!("msg_{n}"), "type": "message",
        "role": "assistant", "content": [], "model": "claude-test",
        "usage": {"input_tokens": usage.input, "cache_read_input_tokens": usage.cache_read,
                  "cache_creation_input_tokens": usage.cache_write, "output_tokens": 1}}});
    let mut events = vec![(Some("message_start"), start)];
    let stop = if wants_tasks(&body) {
        events.push((Some("content_block_start"), json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": format!("toolu_{n}"), "name": "list_tasks", "input": {}}})));
        events.push((
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{}"}}),
        ));
        "tool_use"
    } else {
        events.push((
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        ));
        events.push((
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "All in order."}}),
        ));
        "end_turn"
    };
    events.push((
        Some("content_block_stop"),
        json!({"type": "content_block_stop", "index": 0}),
    ));
    events.push((
        Some("message_delta"),
        json!({"type": "message_delta",
        "delta": {"stop_reason": stop}, "usage": {"output_tokens": 5}}),
    ));
    events.push((Some("message_stop"), json!({"type": "message_stop"})));
    ([("content-type", "text/event-stream")], frames(&events)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_prefix_is_written_once_and_read_after() {
        let state = CacheState::default();
        let body = |last: &str| {
            json!({"tools": [{"name": "t", "cache_control": {"type": "ephemeral"}}],
                   "system": [{"type": "text", "text": "s".repeat(400), "cache_control": {"type": "ephemeral"}}],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": last}]}]})
        };
        let first = bill(&state, &body("hello"));
        assert_eq!(first.cache_read, 0);
        assert!(first.cache_write > 100);
        let second = bill(&state, &body("something else"));
        assert_eq!(
            second.cache_read, first.cache_write,
            "tools and system are read"
        );
        assert_eq!(second.cache_write, 0);
        assert!(second.input > 0, "the new message is not cached");
        let unmarked = CacheState::default();
        let mut plain = body("hello");
        plain["system"][0]
            .as_object_mut()
            .unwrap()
            .remove("cache_control");
        plain["tools"][0]
            .as_object_mut()
            .unwrap()
            .remove("cache_control");
        bill(&unmarked, &plain);
        assert_eq!(
            bill(&unmarked, &plain).cache_read,
            0,
            "nothing marked, nothing cached"
        );
    }
}
