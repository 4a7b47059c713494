//! A rule-based OpenAI-compatible model (`POST /v1/chat/completions`, streaming SSE) that
//! decides every answer from the request itself, so any number of concurrent runs on any
//! replica get deterministic answers in any order (the scripted fake pops answers in arrival
//! order, which concurrent runs cannot share).
//!
//! The rules look at the last user message (the prompt) and at the tool results after it:
//! - the prompt contains `send`: no tool result yet → a `gmail_send` call to
//!   boss@example.com whose subject is the text after `subject:` in the prompt (up to the end of
//!   the line); after a result → the text answer;
//! - it contains `search`: `search_gmail` once, then the text answer;
//! - it contains `tasks`: `list_tasks` until there are `xN` results after the prompt (`tasks x4`;
//!   one when no `xN` is given), then the text answer;
//! - otherwise the text answer.
//!
//! The text answer is [`ANSWER`], streamed word by word. `slow` in the prompt delays every answer
//! to that run by [`RuleOptions::slow`]; [`RuleOptions::delay`] delays every answer by a
//! seeded pseudo-random time in a range, and [`RuleOptions::delta_pause`] spaces the text
//! deltas, so that faults can land in the middle of a run. With the defaults answers are instant.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::State,
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

/// The text every finished run answers with: twenty words, streamed as twenty deltas.
pub const ANSWER: &str = "Here is what I found for you today and everything is in order so \
                          there is nothing else you need to do now.";

/// How the fake paces its answers.
#[derive(Clone, Debug)]
pub struct RuleOptions {
    /// Every answer waits a pseudo-random time in `[min, max]` first.
    pub delay: Option<(Duration, Duration)>,
    /// The pause between two text deltas.
    pub delta_pause: Duration,
    /// The extra wait of every answer to a prompt containing `slow`.
    pub slow: Duration,
    /// Seeds the delays.
    pub seed: u64,
}

impl Default for RuleOptions {
    fn default() -> Self {
        Self {
            delay: None,
            delta_pause: Duration::ZERO,
            slow: Duration::from_millis(1500),
            seed: 1,
        }
    }
}

/// One request the fake received.
#[derive(Clone, Debug)]
pub struct SeenRequest {
    pub at: Instant,
    pub body: Value,
}

/// A request as received: its body is parsed into a `Value` only when a test asks for it, so
/// that answering costs the fake little (the benches measure Steward, not the fake).
struct Received {
    at: Instant,
    body: axum::body::Bytes,
}

struct RuleState {
    options: RuleOptions,
    rng: Mutex<u64>,
    calls: AtomicU64,
    /// Makes tool-call ids unique across fakes (and so across threads and runs).
    id_prefix: String,
    seen: Mutex<Vec<Received>>,
}

/// A running rule-based model server.
#[derive(Clone)]
pub struct RuleModel {
    /// Base URL including `/v1`, as `OPENAI_BASE_URL` expects.
    pub url: String,
    state: Arc<RuleState>,
}

impl RuleModel {
    /// Instant answers.
    pub async fn start() -> Self {
        Self::start_with(RuleOptions::default()).await
    }

    pub async fn start_with(options: RuleOptions) -> Self {
        let state = Arc::new(RuleState {
            rng: Mutex::new(options.seed ^ 0x9E37_79B9_7F4A_7C15),
            options,
            calls: AtomicU64::new(0),
            id_prefix: uuid::Uuid::new_v4().simple().to_string()[..8].to_owned(),
            seen: Mutex::default(),
        });
        let router = Router::new()
            .route("/v1/chat/completions", post(answer))
            .with_state(state.clone());
        let (base, _) = crate::fakes::serve(router).await;
        Self {
            url: format!("{base}/v1"),
            state,
        }
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<SeenRequest> {
        self.state
            .seen
            .lock()
            .expect("lock")
            .iter()
            .map(|r| SeenRequest {
                at: r.at,
                body: serde_json::from_slice(&r.body).expect("the fake answered only JSON bodies"),
            })
            .collect()
    }

    /// How many requests carried a tool result for `call_id`: the continuations a tool call
    /// caused.
    pub fn requests_answering(&self, call_id: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| {
                r.body["messages"].as_array().is_some_and(|m| {
                    m.iter()
                        .any(|m| m["role"] == "tool" && m["tool_call_id"] == call_id)
                })
            })
            .count()
    }
}

/// What the rules answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Text(String),
    Tool { name: String, args: Value },
}

/// The rules (see the module documentation), public for tests of the fake itself.
pub fn decide(body: &Value) -> (Reply, bool) {
    let empty = Vec::new();
    let messages = body["messages"].as_array().unwrap_or(&empty);
    let last_user = messages.iter().rposition(|m| m["role"] == "user");
    let prompt = last_user
        .and_then(|i| messages[i]["content"].as_str())
        .unwrap_or_default();
    let results_after = last_user.map_or(0, |i| {
        messages[i + 1..]
            .iter()
            .filter(|m| m["role"] == "tool")
            .count()
    });
    rules(prompt, results_after)
}

/// Of a request, only what the rules read: each message's role and text content (the tool
/// declarations and everything else are skipped, not built).
#[derive(serde::Deserialize)]
struct RuleView<'a> {
    #[serde(borrow, default)]
    messages: Vec<MessageView<'a>>,
}

#[derive(serde::Deserialize)]
struct MessageView<'a> {
    #[serde(borrow)]
    role: std::borrow::Cow<'a, str>,
    #[serde(default)]
    content: Option<Value>,
}

/// [`decide`] on the raw body, reading only what the rules need.
fn decide_raw(body: &[u8]) -> Result<(Reply, bool), serde_json::Error> {
    let view: RuleView<'_> = serde_json::from_slice(body)?;
    let messages = &view.messages;
    let last_user = messages.iter().rposition(|m| m.role == "user");
    let prompt = last_user
        .and_then(|i| messages[i].content.as_ref())
        .and_then(Value::as_str)
        .unwrap_or_default();
    let results_after = last_user.map_or(0, |i| {
        messages[i + 1..]
            .iter()
            .filter(|m| m.role == "tool")
            .count()
    });
    Ok(rules(prompt, results_after))
}

fn rules(prompt: &str, results_after: usize) -> (Reply, bool) {
    let lower = prompt.to_lowercase();
    let slow = lower.contains("slow");
    let text = Reply::Text(ANSWER.to_owned());
    let reply = if lower.contains("send") {
        if results_after == 0 {
            let subject = prompt
                .split_once("subject:")
                .map(|(_, s)| s.lines().next().unwrap_or_default().trim().to_owned())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "Note".to_owned());
            Reply::Tool {
                name: "gmail_send".into(),
                args: json!({"to": ["boss@example.com"], "subject": subject,
                             "body": "Numbers attached.\nCall me."}),
            }
        } else {
            text
        }
    } else if lower.contains("search") {
        if results_after == 0 {
            Reply::Tool {
                name: "search_gmail".into(),
                args: json!({"query": "budget"}),
            }
        } else {
            text
        }
    } else if lower.contains("tasks") {
        let wanted = lower
            .split_whitespace()
            .find_map(|w| w.strip_prefix('x').and_then(|n| n.parse::<usize>().ok()))
            .unwrap_or(1);
        if results_after < wanted {
            Reply::Tool {
                name: "list_tasks".into(),
                args: json!({}),
            }
        } else {
            text
        }
    } else {
        text
    };
    (reply, slow)
}

fn next_random(state: &RuleState) -> u64 {
    // splitmix64: deterministic for a seed, no dependency.
    let mut s = state.rng.lock().expect("lock");
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn chunk(delta: Value, finish: Option<&str>) -> String {
    let event = json!({"id": "chatcmpl-rule", "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    format!("data: {event}\n\n")
}

/// The SSE frames of `reply`, each its own network write.
pub(crate) fn frames(reply: &Reply, call_id: &str) -> Vec<String> {
    let mut out = Vec::new();
    match reply {
        Reply::Text(text) => {
            out.push(chunk(json!({"role": "assistant", "content": ""}), None));
            for word in text.split_inclusive(' ') {
                out.push(chunk(json!({"content": word}), None));
            }
            out.push(chunk(json!({}), Some("stop")));
        }
        Reply::Tool { name, args } => {
            let args = args.to_string();
            let mid = args.len() / 2;
            out.push(chunk(json!({"role": "assistant", "content": null}), None));
            out.push(chunk(
                json!({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                       "function": {"name": name, "arguments": ""}}]}),
                None,
            ));
            for part in [&args[..mid], &args[mid..]] {
                out.push(chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}),
                    None,
                ));
            }
            out.push(chunk(json!({}), Some("tool_calls")));
        }
    }
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 20}});
    out.push(format!("data: {usage}\n\n"));
    out.push("data: [DONE]\n\n".to_owned());
    out
}

async fn answer(State(s): State<Arc<RuleState>>, body: axum::body::Bytes) -> Response {
    let (reply, slow) = match decide_raw(&body) {
        Ok(decided) => decided,
        Err(e) => {
            return (
                axum::http::StatusCode::BAD_REQUEST,
                format!("the request body is not a chat completion request: {e}"),
            )
                .into_response();
        }
    };
    s.seen.lock().expect("lock").push(Received {
        at: Instant::now(),
        body,
    });
    let n = s.calls.fetch_add(1, Ordering::SeqCst);
    let call_id = format!("call_{}_{n}", s.id_prefix);
    let mut wait = Duration::ZERO;
    if let Some((min, max)) = s.options.delay {
        let span = max.saturating_sub(min).as_millis() as u64;
        wait += min + Duration::from_millis(next_random(&s) % (span + 1));
    }
    if slow {
        wait += s.options.slow;
    }
    if !wait.is_zero() {
        // A model that takes its time; this paces the fake, it synchronises nothing.
        tokio::time::sleep(wait).await;
    }
    let frames = frames(&reply, &call_id);
    let pause = s.options.delta_pause;
    let body = if pause.is_zero() {
        Body::from(frames.concat())
    } else {
        let stream = futures_util::stream::unfold(
            (frames.into_iter(), true),
            move |(mut it, first)| async move {
                let frame = it.next()?;
                if !first {
                    tokio::time::sleep(pause).await;
                }
                Some((Ok::<_, std::io::Error>(frame.into_bytes()), (it, false)))
            },
        );
        Body::from_stream(stream)
    };
    ([("content-type", "text/event-stream")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(messages: Value) -> Value {
        json!({"model": "m", "messages": messages})
    }

    #[test]
    fn the_rules_follow_the_prompt_and_the_results_after_it() {
        let send = body(json!([{"role": "system", "content": "s"},
                               {"role": "user", "content": "please send subject: S-1 now"}]));
        let (reply, slow) = decide(&send);
        assert!(!slow);
        assert_eq!(
            reply,
            Reply::Tool {
                name: "gmail_send".into(),
                args: json!({"to": ["boss@example.com"], "subject": "S-1 now",
                             "body": "Numbers attached.\nCall me."})
            }
        );
        let answered = body(json!([{"role": "user", "content": "send subject: S-1"},
                                   {"role": "assistant", "content": null},
                                   {"role": "tool", "tool_call_id": "c", "content": "Sent"}]));
        assert_eq!(decide(&answered).0, Reply::Text(ANSWER.into()));
        let tasks = |results: usize| {
            let mut m = vec![json!({"role": "user", "content": "slow tasks x3"})];
            m.extend((0..results).map(|_| json!({"role": "tool", "content": "none"})));
            decide(&body(Value::Array(m)))
        };
        assert!(matches!(tasks(2).0, Reply::Tool { ref name, .. } if name == "list_tasks"));
        assert_eq!(tasks(3), (Reply::Text(ANSWER.into()), true));
        // Results before the prompt belong to an earlier run.
        let next = body(json!([{"role": "user", "content": "send subject: A"},
                               {"role": "tool", "tool_call_id": "c", "content": "Not executed"},
                               {"role": "user", "content": "hello again"}]));
        assert_eq!(decide(&next).0, Reply::Text(ANSWER.into()));
    }

    #[test]
    fn answering_from_the_raw_body_decides_as_the_rules_do() {
        let bodies = [
            body(json!([{"role": "system", "content": "s"},
                        {"role": "user", "content": "please send subject: S-1 now"}])),
            body(json!([{"role": "user", "content": "slow tasks x2"},
                        {"role": "assistant", "content": null,
                         "tool_calls": [{"id": "c", "type": "function",
                                         "function": {"name": "list_tasks", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c", "content": "none"}])),
            body(json!([{"role": "user", "content": [{"type": "text", "text": "search"}]}])),
            json!({"model": "m", "tools": [{"type": "function"}]}),
        ];
        for b in bodies {
            let raw = serde_json::to_vec(&b).expect("json");
            assert_eq!(decide_raw(&raw).expect("parses"), decide(&b), "{b}");
        }
        assert!(decide_raw(b"not json").is_err());
    }
}
