//! An OpenAI-compatible Chat Completions server (`POST /v1/chat/completions`, streaming SSE),
//! playing a queue of scripted answers: SSE streams (sent in small arbitrary chunks, so events
//! split across reads), error statuses with Retry-After, or a stream cut off mid-way. Records
//! every request body and when it arrived.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Instant,
};

use axum::{
    Json, Router,
    body::Body,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

#[derive(Clone, Debug)]
pub enum Answer {
    /// SSE `data:` payloads, sent in `chunk`-byte pieces, ending with `[DONE]`.
    Stream { events: Vec<Value>, chunk: usize },
    /// An error status, optionally with Retry-After seconds.
    Error {
        status: u16,
        retry_after: Option<u64>,
    },
    /// A stream that stops after these events without finish_reason or [DONE].
    CutOff { events: Vec<Value> },
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

#[derive(Default)]
pub struct OpenAiState {
    pub answers: Mutex<VecDeque<Answer>>,
    /// (when, request body) of every request.
    pub requests: Mutex<Vec<(Instant, Value)>>,
}

#[derive(Clone)]
pub struct FakeOpenAi {
    /// Base URL including `/v1`, as the adapter is configured.
    pub url: String,
    pub state: Arc<OpenAiState>,
}

impl FakeOpenAi {
    pub async fn start(answers: Vec<Answer>) -> Self {
        let state = Arc::new(OpenAiState {
            answers: Mutex::new(answers.into()),
            requests: Mutex::default(),
        });
        let router = Router::new()
            .route("/v1/chat/completions", post(complete))
            .with_state(state.clone());
        let (base, _) = super::serve(router).await;
        Self {
            url: format!("{base}/v1"),
            state,
        }
    }

    pub fn requests(&self) -> Vec<(Instant, Value)> {
        self.state.requests.lock().expect("lock").clone()
    }
}

fn sse(events: &[Value], done: bool) -> String {
    let mut out: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    if done {
        out.push_str("data: [DONE]\n\n");
    }
    out
}

fn chunked(text: String, size: usize) -> Body {
    let bytes = text.into_bytes();
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
        bytes.chunks(size.max(1)).map(|c| Ok(c.to_vec())).collect();
    Body::from_stream(futures_util::stream::iter(pieces))
}

async fn complete(State(s): State<Arc<OpenAiState>>, Json(body): Json<Value>) -> Response {
    s.requests
        .lock()
        .expect("lock")
        .push((Instant::now(), body));
    let answer = s
        .answers
        .lock()
        .expect("lock")
        .pop_front()
        .unwrap_or_else(|| Answer::text("(no more scripted answers)"));
    match answer {
        Answer::Error {
            status,
            retry_after,
        } => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut response = (status, Json(json!({"error": {"message": format!("scripted {status}"), "type": "server_error"}}))).into_response();
            if let Some(secs) = retry_after {
                response
                    .headers_mut()
                    .insert("retry-after", secs.to_string().parse().expect("header"));
            }
            response
        }
        Answer::Stream { events, chunk } => (
            [("content-type", "text/event-stream")],
            chunked(sse(&events, true), chunk),
        )
            .into_response(),
        Answer::CutOff { events } => (
            [("content-type", "text/event-stream")],
            chunked(sse(&events, false), 9),
        )
            .into_response(),
    }
}
