//! An OpenAI-compatible Chat Completions server (`POST /v1/chat/completions`, streaming SSE),
//! playing scripted answers in its wire format: chunked SSE (events split across reads), error
//! statuses with Retry-After, or a stream cut off mid-way.

use std::time::Instant;

use serde_json::{Value, json};

use super::model_server::{ModelServer, Prepared, frames};

#[derive(Clone, Debug)]
pub enum Answer {
    /// SSE `data:` payloads, sent in `chunk`-byte pieces, ending with `[DONE]`.
    Stream { events: Vec<Value>, chunk: usize },
    /// An error status, optionally with Retry-After seconds.
    Error {
        status: u16,
        retry_after: Option<u64>,
    },
    /// An error status with exactly this body (what a provider echoes back, secrets and all).
    ErrorBody { status: u16, body: String },
    /// A stream that stops after these events without finish_reason or [DONE].
    CutOff { events: Vec<Value> },
    /// The inner answer, after a pause.
    Slow(Box<Answer>, std::time::Duration),
    /// The inner answer, once the test calls `notify_one` on the gate.
    Held(Box<Answer>, std::sync::Arc<tokio::sync::Notify>),
}

impl Answer {
    /// Text streamed as several deltas, with usage.
    pub fn text(text: &str) -> Self {
        let mut events: Vec<Value> = text
            .split_inclusive(' ')
            .map(|w| json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": null}]}))
            .collect();
        events.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}));
        events.push(json!({"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 100}}}));
        Answer::Stream { events, chunk: 7 }
    }

    /// Tool calls, each streamed as a header chunk and its arguments in fragments.
    pub fn tool_calls(calls: &[(&str, &str, &str)]) -> Self {
        let mut events = vec![
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": null}}]}),
        ];
        for (i, (id, name, args)) in calls.iter().enumerate() {
            events.push(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}}]}));
            let mid = args.len() / 2;
            for part in [&args[..mid], &args[mid..]] {
                events.push(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": part}}]}}]}));
            }
        }
        events.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}));
        events
            .push(json!({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 20}}));
        Answer::Stream { events, chunk: 5 }
    }
}

impl Answer {
    fn prepared(self) -> Prepared {
        match self {
            Answer::Stream { events, chunk } => Prepared::Sse { body: sse(&events, true), chunk },
            Answer::CutOff { events } => Prepared::Sse { body: sse(&events, false), chunk: 9 },
            Answer::Slow(inner, pause) => Prepared::Delayed(Box::new(inner.prepared()), pause),
            Answer::Held(inner, gate) => Prepared::Held(Box::new(inner.prepared()), gate),
            Answer::ErrorBody { status, body } => Prepared::Error {
                status,
                retry_after: None,
                body,
            },
            Answer::Error { status, retry_after } => Prepared::Error {
                status,
                retry_after,
                body: json!({"error": {"message": format!("scripted {status}"), "type": "server_error"}}).to_string(),
            },
        }
    }
}

#[derive(Clone)]
pub struct FakeOpenAi {
    /// Base URL including `/v1`, as the adapter is configured.
    pub url: String,
    pub server: ModelServer,
}

impl FakeOpenAi {
    pub async fn start(answers: Vec<Answer>) -> Self {
        let server = ModelServer::start(
            "/v1/chat/completions",
            answers.into_iter().map(Answer::prepared).collect(),
        )
        .await;
        Self {
            url: format!("{}/v1", server.base),
            server,
        }
    }

    /// (when, body) of every request.
    pub fn requests(&self) -> Vec<(Instant, Value)> {
        self.server
            .seen()
            .into_iter()
            .map(|s| (s.at, s.body))
            .collect()
    }
}

/// (call id, content) of each tool result an OpenAI-shaped request carries, in order: the
/// thread's transcript of tool calls as the model was shown it.
pub fn tool_messages(request: &Value) -> Vec<(String, String)> {
    request["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn sse(events: &[Value], done: bool) -> String {
    let mut out = frames(&events.iter().map(|e| (None, e.clone())).collect::<Vec<_>>());
    if done {
        out.push_str("data: [DONE]\n\n");
    }
    out
}
