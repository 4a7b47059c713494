//! OpenAI Chat Completions, streaming (L-1): also Ollama, OpenRouter, vLLM and any other
//! server that speaks it, by base URL. Tool-call arguments arrive in fragments keyed by index
//! and are joined here; usage comes in the last chunk (`stream_options.include_usage`).

use std::collections::BTreeMap;

use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    Delta, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse, TokenUsage, ToolCall,
    Turn, sse,
};

#[derive(Clone)]
pub struct OpenAi {
    /// Provider name in logs and usage ("openai", "ollama", ...).
    pub name: String,
    /// Including the version path, e.g. `https://api.openai.com/v1` or `http://localhost:11434/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    pub http: reqwest::Client,
}

impl std::fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAi")
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

/// The request body without its tools (see [`encode`]).
pub fn body(request: &ModelRequest) -> Value {
    let mut messages = vec![json!({"role": "system", "content": request.system})];
    for turn in request.turns {
        messages.push(match turn {
            Turn::User(text) => json!({"role": "user", "content": text}),
            Turn::Assistant { text, tool_calls } if tool_calls.is_empty() => json!({"role": "assistant", "content": text}),
            Turn::Assistant { text, tool_calls } => json!({
                "role": "assistant",
                "content": if text.is_empty() { Value::Null } else { json!(text) },
                "tool_calls": tool_calls.iter().map(|c| json!({
                    "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect::<Vec<_>>()
            }),
            Turn::ToolResult { call_id, content, .. } => json!({"role": "tool", "tool_call_id": call_id, "content": content}),
        });
    }
    json!({
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_output_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// The request body on the wire: [`body`] with the tool set's prepared declarations.
pub fn encode(request: &ModelRequest) -> Vec<u8> {
    let tools =
        (!request.tools.is_empty() && !request.answer_only).then(|| request.tools.openai_wire());
    super::tool_set::encode_with_tools(&body(request), tools)
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: ChunkDelta,
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct ChunkDelta {
    content: Option<String>,
    /// DeepSeek / vLLM reasoning models stream thinking here.
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ToolCallDelta>,
}

#[derive(Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: usize,
    id: Option<String>,
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
struct FunctionDelta {
    name: Option<String>,
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: u64,
}

#[async_trait::async_trait]
impl ModelProvider for OpenAi {
    fn name(&self) -> &str {
        &self.name
    }

    async fn complete(
        &self,
        request: &ModelRequest,
        deltas: &DeltaSink,
    ) -> Result<ModelResponse, ModelError> {
        let url = format!("{}/chat/completions", self.base_url.trim_end_matches('/'));
        let mut http = self
            .http
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(encode(request));
        if let Some(key) = &self.api_key {
            http = http.bearer_auth(key);
        }
        let response = http
            .send()
            .await
            .map_err(|e| ModelError::from_reqwest(&e))?;
        let mut events = Box::pin(sse::events(response).await?);

        let mut text = String::new();
        let mut thinking = String::new();
        let mut calls: BTreeMap<usize, (String, String, String)> = BTreeMap::new();
        let mut usage = TokenUsage::default();
        let mut finish: Option<String> = None;
        let mut done = false;
        while let Some(event) = events.next().await {
            let (_, data) = event?;
            if data.trim() == "[DONE]" {
                done = true;
                break;
            }
            let chunk: Chunk = serde_json::from_str(&data)
                .map_err(|e| ModelError::Decode(format!("chunk: {e}")))?;
            if let Some(u) = chunk.usage {
                usage = TokenUsage {
                    input_tokens: u.prompt_tokens,
                    output_tokens: u.completion_tokens,
                    cached_tokens: u.prompt_tokens_details.map_or(0, |d| d.cached_tokens),
                };
            }
            for choice in chunk.choices {
                if let Some(t) = choice.delta.content.filter(|t| !t.is_empty()) {
                    let _ = deltas.send(Delta::Text(t.clone()));
                    text.push_str(&t);
                }
                if let Some(t) = choice.delta.reasoning_content.filter(|t| !t.is_empty()) {
                    let _ = deltas.send(Delta::Thinking(t.clone()));
                    thinking.push_str(&t);
                }
                for tc in choice.delta.tool_calls {
                    let entry = calls.entry(tc.index).or_default();
                    if let Some(id) = tc.id {
                        entry.0 = id;
                    }
                    if let Some(f) = tc.function {
                        if let Some(name) = f.name {
                            entry.1.push_str(&name);
                        }
                        if let Some(args) = f.arguments {
                            entry.2.push_str(&args);
                        }
                    }
                }
                if choice.finish_reason.is_some() {
                    finish = choice.finish_reason;
                }
            }
        }
        if !done && finish.is_none() {
            return Err(ModelError::TruncatedStream);
        }
        let tool_calls = calls
            .into_iter()
            .map(|(i, (id, name, arguments))| ToolCall {
                id: if id.is_empty() {
                    format!("call_{i}")
                } else {
                    id
                },
                name,
                arguments,
            })
            .collect();
        Ok(ModelResponse {
            text,
            thinking,
            tool_calls,
            usage,
            stop_reason: finish.unwrap_or_default(),
        })
    }
}
