//! Google Gemini `streamGenerateContent` with `alt=sse` (L-1): functionDeclarations,
//! functionCall / functionResponse parts, thought parts, usageMetadata.

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::{
    Delta, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse, TokenUsage, ToolCall,
    Turn, sse,
};

#[derive(Clone)]
pub struct Gemini {
    /// e.g. `https://generativelanguage.googleapis.com`
    pub base_url: String,
    pub api_key: Option<String>,
    pub http: reqwest::Client,
}

/// The request body without its tools (see [`encode`]).
pub fn body(request: &ModelRequest) -> Value {
    let mut contents: Vec<Value> = Vec::new();
    for turn in request.turns {
        let (role, part) = match turn {
            Turn::User(text) => ("user", json!({"text": text})),
            Turn::Assistant { text, tool_calls } => {
                let mut parts = Vec::new();
                if !text.is_empty() {
                    parts.push(json!({"text": text}));
                }
                for c in tool_calls {
                    let args = serde_json::from_str::<Value>(&c.arguments)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| json!({}));
                    parts.push(json!({"functionCall": {"name": c.name, "args": args}}));
                }
                if parts.is_empty() {
                    // An empty answer (Gemini gives them itself) is kept in the history, and
                    // Gemini refuses a content with no parts: every later run of the thread
                    // would fail. Anthropic gets the same words.
                    parts.push(json!({"text": "(no answer)"}));
                }
                contents.push(json!({"role": "model", "parts": parts}));
                continue;
            }
            Turn::ToolResult {
                name,
                content,
                is_error,
                ..
            } => {
                let key = if *is_error { "error" } else { "content" };
                (
                    "user",
                    json!({"functionResponse": {"name": name, "response": { key: content }}}),
                )
            }
        };
        match contents.last_mut() {
            Some(last) if last["role"] == role => {
                if let Some(parts) = last["parts"].as_array_mut() {
                    parts.push(part);
                }
            }
            _ => contents.push(json!({"role": role, "parts": [part]})),
        }
    }
    json!({
        "systemInstruction": {"parts": [{"text": request.system}]},
        "contents": contents,
        "generationConfig": {"maxOutputTokens": request.max_output_tokens},
    })
}

/// The request body on the wire: [`body`] with the tool set's prepared declarations.
pub fn encode(request: &ModelRequest) -> Vec<u8> {
    let tools =
        (!request.tools.is_empty() && !request.answer_only).then(|| request.tools.gemini_wire());
    super::tool_set::encode_with_tools(&body(request), tools)
}

#[async_trait::async_trait]
impl ModelProvider for Gemini {
    fn name(&self) -> &str {
        "gemini"
    }

    async fn complete(
        &self,
        request: &ModelRequest,
        deltas: &DeltaSink,
    ) -> Result<ModelResponse, ModelError> {
        let key = self
            .api_key
            .as_deref()
            .ok_or_else(|| ModelError::NotConfigured("GEMINI_API_KEY is not set".into()))?;
        let model: String = request
            .model
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || "-._".contains(*c))
            .collect();
        let url = format!(
            "{}/v1beta/models/{model}:streamGenerateContent",
            self.base_url.trim_end_matches('/')
        );
        let response = self
            .http
            .post(url)
            .query(&[("alt", "sse")])
            .header("x-goog-api-key", key)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(encode(request))
            .send()
            .await
            .map_err(|e| ModelError::from_reqwest(&e))?;
        let mut events = Box::pin(sse::events(response).await?);

        let mut text = String::new();
        let mut thinking = String::new();
        let mut tool_calls = Vec::new();
        let mut usage = TokenUsage::default();
        let mut finish = String::new();
        while let Some(event) = events.next().await {
            let (_, data) = event?;
            let v: Value = serde_json::from_str(&data)
                .map_err(|e| ModelError::Decode(format!("chunk: {e}")))?;
            if let Some(u) = v.get("usageMetadata") {
                usage = TokenUsage {
                    input_tokens: u["promptTokenCount"].as_u64().unwrap_or(0),
                    output_tokens: u["candidatesTokenCount"].as_u64().unwrap_or(0)
                        + u["thoughtsTokenCount"].as_u64().unwrap_or(0),
                    cached_tokens: u["cachedContentTokenCount"].as_u64().unwrap_or(0),
                };
            }
            let Some(candidate) = v["candidates"].get(0) else {
                continue;
            };
            for part in candidate["content"]["parts"]
                .as_array()
                .into_iter()
                .flatten()
            {
                if let Some(call) = part.get("functionCall") {
                    let id = call["id"].as_str().map_or_else(
                        || format!("gemini_call_{}", tool_calls.len()),
                        str::to_owned,
                    );
                    tool_calls.push(ToolCall {
                        id,
                        name: call["name"].as_str().unwrap_or("").to_owned(),
                        arguments: call
                            .get("args")
                            .map_or_else(|| "{}".to_owned(), Value::to_string),
                    });
                } else if let Some(t) = part["text"].as_str() {
                    if part["thought"].as_bool() == Some(true) {
                        thinking.push_str(t);
                        let _ = deltas.send(Delta::Thinking(t.to_owned()));
                    } else {
                        text.push_str(t);
                        let _ = deltas.send(Delta::Text(t.to_owned()));
                    }
                }
            }
            if let Some(reason) = candidate["finishReason"].as_str() {
                finish = reason.to_owned();
            }
        }
        // Gemini ends the stream without a terminator; a missing finishReason means it was cut.
        if finish.is_empty() {
            return Err(ModelError::TruncatedStream);
        }
        Ok(ModelResponse {
            text,
            thinking,
            tool_calls,
            usage,
            stop_reason: finish,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::ToolSet;

    #[test]
    fn an_empty_answer_in_the_history_is_sent_with_a_part_gemini_accepts() {
        let turns = [
            Turn::User("hi".into()),
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![],
            },
            Turn::User("still there?".into()),
        ];
        let tools = ToolSet::new(vec![]);
        let body = body(&ModelRequest {
            model: "gemini-2.5-flash",
            system: "[PERSONA]",
            turns: &turns,
            tools: &tools,
            answer_only: false,
            stable_turns: 0,
            max_output_tokens: 100,
        });
        assert_eq!(body["contents"][1]["role"], "model");
        assert_eq!(
            body["contents"][1]["parts"],
            serde_json::json!([{"text": "(no answer)"}])
        );
    }
}
