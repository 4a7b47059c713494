//! Anthropic Messages, streaming (L-1): tool_use / tool_result content blocks, text, thinking
//! and input_json deltas, usage including prompt-cache reads.

use std::collections::BTreeMap;

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::{
    BaseUrl, Delta, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse, TokenUsage,
    ToolCall, Turn, sse,
};

pub const API_VERSION: &str = "2023-06-01";

#[derive(Clone)]
pub struct Anthropic {
    /// The Messages URL under a base such as `https://api.anthropic.com`.
    pub endpoint: reqwest::Url,
    pub api_key: Option<String>,
    pub http: reqwest::Client,
    /// `ANTHROPIC_PROMPT_CACHE`: mark the stable prefix for Anthropic's prompt cache.
    pub prompt_cache: bool,
}

impl Anthropic {
    pub fn new(
        base: &BaseUrl,
        api_key: Option<String>,
        http: reqwest::Client,
        prompt_cache: bool,
    ) -> Self {
        Self {
            endpoint: base.join("/v1/messages"),
            api_key,
            http,
            prompt_cache,
        }
    }
}

/// Tool arguments as the object Anthropic requires; a malformed call replays as `{}` (its
/// result already told the model what was wrong).
fn input_object(arguments: &str) -> Value {
    serde_json::from_str::<Value>(arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}))
}

/// The request body without its tools (see [`encode`]). With `cache`, prompt-cache
/// breakpoints mark the stable prefix: the system text, the end of the thread's history (the
/// same in every call of this run and the next) and the end of this call's transcript (the
/// prefix of this run's next call). The tools carry the fourth (see `ToolSet`).
pub fn body(request: &ModelRequest, cache: bool) -> Value {
    let mut messages: Vec<Value> = Vec::new();
    // Where each turn's last block landed: (message, block).
    let mut landed: Vec<(usize, usize)> = Vec::with_capacity(request.turns.len());
    for turn in request.turns {
        let (role, block) = match turn {
            Turn::User(text) => ("user", json!({"type": "text", "text": text})),
            Turn::Assistant { text, tool_calls } => {
                let mut blocks = Vec::new();
                // Anthropic refuses a text block of only whitespace (400), and the turn stays
                // in the thread's history: a model that said "\n\n" before its tool call would
                // break every later call on the thread.
                if !text.trim().is_empty() {
                    blocks.push(json!({"type": "text", "text": text}));
                }
                for c in tool_calls {
                    blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input_object(&c.arguments)}));
                }
                if blocks.is_empty() {
                    // The API refuses an empty content list; an empty answer is an empty text.
                    blocks.push(json!({"type": "text", "text": "(no answer)"}));
                }
                landed.push((messages.len(), blocks.len() - 1));
                messages.push(json!({"role": "assistant", "content": blocks}));
                continue;
            }
            Turn::ToolResult {
                call_id,
                content,
                is_error,
                ..
            } => (
                "user",
                json!({"type": "tool_result", "tool_use_id": call_id, "content": content, "is_error": is_error}),
            ),
        };
        // Consecutive user-side blocks (all results of one turn) share one message, as the API
        // requires alternating roles.
        let at = messages.len();
        match messages.last_mut() {
            Some(last) if last["role"] == role && role == "user" => {
                if let Some(blocks) = last["content"].as_array_mut() {
                    blocks.push(block);
                    landed.push((at - 1, blocks.len() - 1));
                }
            }
            _ => {
                landed.push((at, 0));
                messages.push(json!({"role": role, "content": [block]}));
            }
        }
    }
    let mut system = vec![json!({"type": "text", "text": request.system})];
    // A one-off call without tools (a session summary) is never repeated: marking it would
    // only pay for cache writes.
    if cache && !request.tools.is_empty() {
        // The sections that change with every run (what is remembered about the user for this
        // prompt, attachments, the clock) would void the cached prefix from there on, history
        // included. They go after the cached part instead: at the end of the last user message
        // (or, when there is none, after the system text).
        if let Some(at) = per_run_start(request.system) {
            let (stable, per_run) = request.system.split_at(at);
            system = vec![json!({"type": "text", "text": stable})];
            let tail = json!({"type": "text", "text": per_run.trim_start()});
            match messages.last_mut() {
                Some(last) if last["role"] == "user" => {
                    if let Some(blocks) = last["content"].as_array_mut() {
                        blocks.push(tail);
                    }
                }
                _ => system.push(tail),
            }
        }
        system[0]["cache_control"] = json!({"type": "ephemeral"});
        let history_end = request.stable_turns.checked_sub(1);
        for at in [history_end, landed.len().checked_sub(1)]
            .into_iter()
            .flatten()
            .filter_map(|i| landed.get(i))
        {
            messages[at.0]["content"][at.1]["cache_control"] = json!({"type": "ephemeral"});
        }
    }
    let mut body = json!({
        "model": request.model,
        "max_tokens": request.max_output_tokens,
        "system": system,
        "messages": messages,
        "stream": true,
    });
    if request.answer_only && !request.tools.is_empty() {
        body["tool_choice"] = json!({"type": "none"});
    }
    body
}

/// Where the system text's per-run sections start (`prompt::PER_RUN_SECTIONS`, always last;
/// a header inside data cannot look like one, see `fence`).
fn per_run_start(system: &str) -> Option<usize> {
    crate::prompt::PER_RUN_SECTIONS
        .iter()
        .filter_map(|name| system.find(&format!("\n\n[{name}]\n")))
        .min()
}

/// The request body on the wire: [`body`] with the tool set's prepared declarations.
pub fn encode(request: &ModelRequest, cache: bool) -> Vec<u8> {
    let tools = (!request.tools.is_empty()).then(|| request.tools.anthropic_wire(cache));
    super::tool_set::encode_with_tools(&body(request, cache), tools)
}

#[async_trait::async_trait]
impl ModelProvider for Anthropic {
    fn name(&self) -> &str {
        "anthropic"
    }

    async fn complete(
        &self,
        request: &ModelRequest,
        deltas: &DeltaSink,
    ) -> Result<ModelResponse, ModelError> {
        let key = self
            .api_key
            .as_deref()
            .ok_or_else(|| ModelError::NotConfigured("ANTHROPIC_API_KEY is not set".into()))?;
        let response = self
            .http
            .post(self.endpoint.clone())
            .header("x-api-key", key)
            .header("anthropic-version", API_VERSION)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(encode(request, self.prompt_cache))
            .send()
            .await
            .map_err(|e| ModelError::from_reqwest(&e))?;
        let mut events = Box::pin(sse::events(response).await?);

        let mut text = String::new();
        let mut thinking = String::new();
        // index → (id, name, partial json)
        let mut tools: BTreeMap<u64, (String, String, String)> = BTreeMap::new();
        let mut usage = TokenUsage::default();
        let mut stop_reason = String::new();
        let mut stopped = false;
        while let Some(event) = events.next().await {
            let (name, data) = event?;
            let v: Value = serde_json::from_str(&data)
                .map_err(|e| ModelError::Decode(format!("{name}: {e}")))?;
            match v["type"].as_str().unwrap_or(name.as_str()) {
                "message_start" => {
                    let u = &v["message"]["usage"];
                    let read = u["cache_read_input_tokens"].as_u64().unwrap_or(0);
                    let written = u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
                    usage.input_tokens = u["input_tokens"].as_u64().unwrap_or(0) + read + written;
                    usage.cached_tokens = read;
                    usage.cache_write_tokens = written;
                    usage.output_tokens = u["output_tokens"].as_u64().unwrap_or(0);
                }
                "content_block_start" => {
                    let block = &v["content_block"];
                    if block["type"] == "tool_use" {
                        let index = v["index"].as_u64().unwrap_or(0);
                        tools.insert(
                            index,
                            (
                                block["id"].as_str().unwrap_or("").into(),
                                block["name"].as_str().unwrap_or("").into(),
                                String::new(),
                            ),
                        );
                    }
                }
                "content_block_delta" => {
                    let d = &v["delta"];
                    match d["type"].as_str() {
                        Some("text_delta") => {
                            let t = d["text"].as_str().unwrap_or("");
                            text.push_str(t);
                            let _ = deltas.send(Delta::Text(t.to_owned()));
                        }
                        Some("thinking_delta") => {
                            let t = d["thinking"].as_str().unwrap_or("");
                            thinking.push_str(t);
                            let _ = deltas.send(Delta::Thinking(t.to_owned()));
                        }
                        Some("input_json_delta") => {
                            if let Some(entry) = tools.get_mut(&v["index"].as_u64().unwrap_or(0)) {
                                entry.2.push_str(d["partial_json"].as_str().unwrap_or(""));
                            }
                        }
                        _ => {}
                    }
                }
                "message_delta" => {
                    if let Some(r) = v["delta"]["stop_reason"].as_str() {
                        stop_reason = r.to_owned();
                    }
                    if let Some(out) = v["usage"]["output_tokens"].as_u64() {
                        usage.output_tokens = out;
                    }
                }
                "message_stop" => {
                    stopped = true;
                    break;
                }
                "error" => {
                    // Mid-stream errors: overloaded_error is Anthropic's 529, worth a retry.
                    let kind = v["error"]["type"].as_str().unwrap_or("error");
                    let status = match kind {
                        "overloaded_error" => 529,
                        "rate_limit_error" => 429,
                        "api_error" => 500,
                        _ => 400,
                    };
                    let message = v["error"]["message"].as_str().unwrap_or(kind);
                    return Err(ModelError::Status {
                        status: if status == 529 { 503 } else { status },
                        detail: svc_kit::text::redacted_excerpt(message, 200),
                        retry_after: None,
                    });
                }
                _ => {}
            }
        }
        if !stopped {
            return Err(ModelError::TruncatedStream);
        }
        let tool_calls = tools
            .into_values()
            .map(|(id, name, json)| ToolCall {
                id,
                name,
                arguments: if json.is_empty() { "{}".into() } else { json },
                signature: None,
            })
            .collect();
        Ok(ModelResponse {
            text,
            thinking,
            tool_calls,
            usage,
            stop_reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ToolDecl, ToolSet};

    fn marks(v: &Value) -> usize {
        v.to_string().matches("\"cache_control\"").count()
    }

    #[test]
    fn the_stable_prefix_is_marked_and_what_changes_per_run_goes_after_it() {
        let tools = ToolSet::new(vec![ToolDecl {
            name: "list_tasks".into(),
            description: "d".into(),
            parameters: json!({"type": "object"}),
        }]);
        let system =
            "[PERSONA]\nSteward\n\n[ABOUT THE USER]\n<data>likes tea</data>\n\n[CURRENT TIME]\nnow";
        let turns = [
            Turn::User("first".into()),
            Turn::Assistant {
                text: "answer".into(),
                tool_calls: vec![],
            },
            Turn::User("second".into()),
        ];
        let request = ModelRequest {
            model: "claude",
            system,
            turns: &turns,
            tools: &tools,
            answer_only: false,
            stable_turns: 2,
            max_output_tokens: 100,
        };
        let body = body(&request, true);
        assert_eq!(body["system"][0]["text"], "[PERSONA]\nSteward");
        assert_eq!(body["system"][0]["cache_control"]["type"], "ephemeral");
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(
            messages[1]["content"][0]["cache_control"]["type"], "ephemeral",
            "the end of the history is a breakpoint"
        );
        let last = messages[2]["content"].as_array().unwrap();
        assert_eq!(last[0]["text"], "second");
        assert_eq!(last[0]["cache_control"]["type"], "ephemeral");
        assert!(
            last[1]["text"]
                .as_str()
                .unwrap()
                .starts_with("[ABOUT THE USER]")
                && last[1].get("cache_control").is_none(),
            "the per-run sections follow the last breakpoint"
        );
        let tools: Value = serde_json::from_str(request.tools.anthropic_wire(true)).unwrap();
        assert!(
            marks(&body) + marks(&tools) <= 4,
            "Anthropic takes at most four breakpoints"
        );

        let last_turn = super::body(
            &ModelRequest {
                answer_only: true,
                ..request
            },
            true,
        );
        assert_eq!(
            last_turn["tool_choice"]["type"], "none",
            "an answer-only call still declares the tools, and forbids them"
        );

        let one_off = super::body(
            &ModelRequest {
                tools: &ToolSet::default(),
                ..request
            },
            true,
        );
        assert_eq!(marks(&one_off), 0, "a call without tools is not cached");

        let plain = super::body(&request, false);
        assert_eq!(marks(&plain), 0);
        assert_eq!(
            plain["system"][0]["text"], system,
            "caching off: the text as built"
        );
    }

    #[test]
    fn l1_an_assistant_turn_of_only_whitespace_sends_no_text_block() {
        let turns = [
            Turn::User("what is due?".into()),
            Turn::Assistant {
                text: "\n\n".into(),
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "list_tasks".into(),
                    arguments: "{}".into(),
                    signature: None,
                }],
            },
            Turn::ToolResult {
                call_id: "call_1".into(),
                name: "list_tasks".into(),
                content: "[]".into(),
                is_error: false,
            },
            Turn::Assistant {
                text: " ".into(),
                tool_calls: vec![],
            },
        ];
        let request = ModelRequest {
            model: "claude",
            system: "s",
            turns: &turns,
            tools: &ToolSet::default(),
            answer_only: false,
            stable_turns: 0,
            max_output_tokens: 100,
        };
        let body = body(&request, false);
        let messages = body["messages"].as_array().unwrap();
        let call = messages[1]["content"].as_array().unwrap();
        assert_eq!(call.len(), 1, "{call:?}");
        assert_eq!(call[0]["type"], "tool_use");
        assert_eq!(messages[3]["content"][0]["text"], "(no answer)");
    }
}
