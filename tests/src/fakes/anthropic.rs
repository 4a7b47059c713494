//! Anthropic's Messages API (`POST /v1/messages`, streaming), as scripted answers in its event
//! format: message_start, content_block_start/delta/stop, message_delta, message_stop.

use serde_json::{Value, json};

use super::model_server::{ModelServer, Prepared, frames};

pub async fn start(answers: Vec<Prepared>) -> ModelServer {
    ModelServer::start("/v1/messages", answers).await
}

fn start_events() -> Vec<(Option<&'static str>, Value)> {
    vec![(
        Some("message_start"),
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
               "model": "claude-test", "usage": {"input_tokens": 50, "cache_read_input_tokens": 200, "cache_creation_input_tokens": 0, "output_tokens": 1}}}),
    )]
}

fn end_events(stop: &str, out: u64) -> Vec<(Option<&'static str>, Value)> {
    vec![
        (
            Some("message_delta"),
            json!({"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": out}}),
        ),
        (Some("message_stop"), json!({"type": "message_stop"})),
    ]
}

/// A thinking block, then text streamed word by word.
pub fn text(text: &str) -> Prepared {
    let mut e = start_events();
    e.push((Some("content_block_start"), json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}})));
    e.push((Some("content_block_delta"), json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me think."}})));
    e.push((
        Some("content_block_stop"),
        json!({"type": "content_block_stop", "index": 0}),
    ));
    e.push((Some("ping"), json!({"type": "ping"})));
    e.push((Some("content_block_start"), json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}})));
    for w in text.split_inclusive(' ') {
        e.push((Some("content_block_delta"), json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": w}})));
    }
    e.push((
        Some("content_block_stop"),
        json!({"type": "content_block_stop", "index": 1}),
    ));
    e.extend(end_events("end_turn", 15));
    Prepared::Sse {
        body: frames(&e),
        chunk: 11,
    }
}

/// tool_use blocks whose input arrives as input_json_delta fragments.
pub fn tool_calls(calls: &[(&str, &str, &str)]) -> Prepared {
    let mut e = start_events();
    for (i, (id, name, args)) in calls.iter().enumerate() {
        e.push((Some("content_block_start"), json!({"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}})));
        let mid = args.len() / 2;
        for part in [&args[..mid], &args[mid..]] {
            e.push((Some("content_block_delta"), json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": part}})));
        }
        e.push((
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    e.extend(end_events("tool_use", 40));
    Prepared::Sse {
        body: frames(&e),
        chunk: 13,
    }
}

pub fn error(status: u16, retry_after: Option<u64>) -> Prepared {
    let kind = if status == 429 {
        "rate_limit_error"
    } else {
        "api_error"
    };
    Prepared::Error { status, retry_after, body: json!({"type": "error", "error": {"type": kind, "message": format!("scripted {status}")}}).to_string() }
}
