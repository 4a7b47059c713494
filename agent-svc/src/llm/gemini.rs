//! Google Gemini `streamGenerateContent` with `alt=sse` (L-1): functionDeclarations,
//! functionCall / functionResponse parts, thought parts, usageMetadata.

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::{
    BaseUrl, Delta, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse, TokenUsage,
    ToolCall, Turn, sse,
};

#[derive(Clone)]
pub struct Gemini {
    /// e.g. `https://generativelanguage.googleapis.com`
    pub base_url: BaseUrl,
    pub api_key: Option<String>,
    pub http: reqwest::Client,
}

/// The signature Google documents for a call Gemini did not make itself (a fallback after
/// another provider's calls): Gemini 3 refuses a model turn whose first call has none.
const FOREIGN_CALL_SIGNATURE: &str = "skip_thought_signature_validator";

/// Whether the model checks thought signatures. Gemini 1.x and 2.x do not, and are sent only
/// the signatures they gave; every later generation gets the placeholder where one is missing.
fn validates_signatures(model: &str) -> bool {
    !["gemini-1", "gemini-2"]
        .iter()
        .any(|older| model.starts_with(older))
}

/// The request body without its tools (see [`encode`]).
pub fn body(request: &ModelRequest) -> Value {
    let mut contents: Vec<Value> = Vec::new();
    let placeholder = validates_signatures(request.model).then_some(FOREIGN_CALL_SIGNATURE);
    for turn in request.turns {
        let (role, part) = match turn {
            Turn::User(text) => ("user", json!({"text": text})),
            Turn::Assistant { text, tool_calls } => {
                let mut parts = Vec::new();
                if !text.is_empty() {
                    parts.push(json!({"text": text}));
                }
                for (i, c) in tool_calls.iter().enumerate() {
                    let args = serde_json::from_str::<Value>(&c.arguments)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| json!({}));
                    let mut part = json!({"functionCall": {"name": c.name, "args": args}});
                    // Gemini signs only the first of parallel calls, and checks only that one.
                    let signature = c.signature.as_deref().or(placeholder.filter(|_| i == 0));
                    if let Some(signature) = signature {
                        part["thoughtSignature"] = json!(signature);
                    }
                    parts.push(part);
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
            self.base_url.as_str().trim_end_matches('/')
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

        let mut streamed = Streamed::default();
        while let Some(event) = events.next().await {
            let (_, data) = event?;
            let v: Value = serde_json::from_str(&data)
                .map_err(|e| ModelError::Decode(format!("chunk: {e}")))?;
            streamed.take(&v, deltas);
        }
        streamed.response()
    }
}

/// What a stream's chunks add up to.
#[derive(Default)]
struct Streamed {
    text: String,
    thinking: String,
    tool_calls: Vec<ToolCall>,
    usage: TokenUsage,
    finish: String,
    /// Why Gemini refused the prompt itself (`promptFeedback.blockReason`): it then sends no
    /// candidate at all.
    blocked: Option<String>,
}

impl Streamed {
    fn take(&mut self, v: &Value, deltas: &DeltaSink) {
        if let Some(u) = v.get("usageMetadata") {
            self.usage = TokenUsage {
                input_tokens: u["promptTokenCount"].as_u64().unwrap_or(0),
                output_tokens: u["candidatesTokenCount"].as_u64().unwrap_or(0)
                    + u["thoughtsTokenCount"].as_u64().unwrap_or(0),
                cached_tokens: u["cachedContentTokenCount"].as_u64().unwrap_or(0),
                cache_write_tokens: 0,
            };
        }
        if let Some(reason) = v["promptFeedback"]["blockReason"].as_str() {
            self.blocked = Some(reason.to_owned());
        }
        let Some(candidate) = v["candidates"].get(0) else {
            return;
        };
        for part in candidate["content"]["parts"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(call) = part.get("functionCall") {
                let id = call["id"].as_str().map_or_else(
                    || format!("gemini_call_{}", self.tool_calls.len()),
                    str::to_owned,
                );
                self.tool_calls.push(ToolCall {
                    id,
                    name: call["name"].as_str().unwrap_or("").to_owned(),
                    arguments: call
                        .get("args")
                        .map_or_else(|| "{}".to_owned(), Value::to_string),
                    signature: part["thoughtSignature"].as_str().map(str::to_owned),
                });
            } else if let Some(t) = part["text"].as_str() {
                if part["thought"].as_bool() == Some(true) {
                    self.thinking.push_str(t);
                    let _ = deltas.send(Delta::Thinking(t.to_owned()));
                } else {
                    self.text.push_str(t);
                    let _ = deltas.send(Delta::Text(t.to_owned()));
                }
            }
        }
        if let Some(reason) = candidate["finishReason"].as_str() {
            self.finish = reason.to_owned();
        }
    }

    fn response(self) -> Result<ModelResponse, ModelError> {
        let finish = match (self.finish.as_str(), &self.blocked) {
            // Asking again gets the same refusal, billed again: an empty answer, which the
            // run replaces with what it gathered (E-5).
            ("", Some(reason)) => format!("blocked:{reason}"),
            // Gemini ends the stream without a terminator; a missing finishReason means it was
            // cut.
            ("", None) => return Err(ModelError::TruncatedStream),
            ("MALFORMED_FUNCTION_CALL" | "UNEXPECTED_TOOL_CALL", _)
                if self.tool_calls.is_empty() =>
            {
                return Err(ModelError::MalformedCall(self.finish));
            }
            _ => self.finish,
        };
        Ok(ModelResponse {
            text: self.text,
            thinking: self.thinking,
            tool_calls: self.tool_calls,
            usage: self.usage,
            stop_reason: finish,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::ToolSet;

    /// The chunks, taken in order: the response, or why there is none.
    fn streamed(chunks: &[Value]) -> Result<ModelResponse, ModelError> {
        let (deltas, _) = tokio::sync::mpsc::unbounded_channel();
        let mut streamed = Streamed::default();
        for chunk in chunks {
            streamed.take(chunk, &deltas);
        }
        streamed.response()
    }

    #[test]
    fn l1_a_calls_thought_signature_goes_back_with_it_as_gemini_3_requires() {
        let got = streamed(&[json!({"candidates": [{"content": {"role": "model", "parts": [
            {"functionCall": {"name": "list_tasks", "args": {"status": "pending"}}, "thoughtSignature": "c2lnLTE="},
            {"functionCall": {"name": "search_memory", "args": {}}}
        ]}, "finishReason": "STOP"}]})])
        .expect("a response");
        assert_eq!(got.tool_calls[0].signature.as_deref(), Some("c2lnLTE="));
        assert_eq!(got.tool_calls[1].signature, None);
        let turns = [
            Turn::User("what is due?".into()),
            Turn::Assistant {
                text: String::new(),
                tool_calls: got.tool_calls.clone(),
            },
        ];
        let tools = ToolSet::new(vec![]);
        let body = body(&ModelRequest {
            model: "gemini-3-pro-preview",
            system: "s",
            turns: &turns,
            tools: &tools,
            answer_only: false,
            stable_turns: 0,
            max_output_tokens: 100,
        });
        let parts = &body["contents"][1]["parts"];
        assert_eq!(parts[0]["thoughtSignature"], "c2lnLTE=");
        assert_eq!(parts[0]["functionCall"]["name"], "list_tasks");
        assert!(parts[1].get("thoughtSignature").is_none());
        let history = serde_json::to_string(&turns[1]).unwrap();
        let again: Turn = serde_json::from_str(&history).unwrap();
        assert_eq!(again, turns[1], "kept in the thread's history");
    }

    /// The history of a thread whose calls another provider made, sent to `model`.
    fn foreign_calls_sent_to(model: &str) -> Value {
        let call = |id: &str| ToolCall {
            id: id.into(),
            name: "list_tasks".into(),
            arguments: "{}".into(),
            signature: None,
        };
        let turns = [
            Turn::User("what is due?".into()),
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![call("toolu_1"), call("toolu_2")],
            },
        ];
        let tools = ToolSet::new(vec![]);
        body(&ModelRequest {
            model,
            system: "s",
            turns: &turns,
            tools: &tools,
            answer_only: false,
            stable_turns: 0,
            max_output_tokens: 100,
        })
    }

    #[test]
    fn l1_a_gemini_3_fallback_after_another_providers_calls_sends_the_documented_placeholder() {
        let parts = &foreign_calls_sent_to("gemini-3-pro-preview")["contents"][1]["parts"];
        assert_eq!(parts[0]["thoughtSignature"], FOREIGN_CALL_SIGNATURE);
        assert!(
            parts[1].get("thoughtSignature").is_none(),
            "only the first call of a turn is checked"
        );
        let older = &foreign_calls_sent_to("gemini-2.5-flash")["contents"][1]["parts"];
        assert!(older[0].get("thoughtSignature").is_none(), "{older}");
    }

    #[test]
    fn e5_a_prompt_gemini_blocks_is_an_empty_answer_not_a_cut_stream_retried() {
        let got = streamed(&[json!({"promptFeedback": {"blockReason": "SAFETY"},
            "usageMetadata": {"promptTokenCount": 12, "totalTokenCount": 12}})])
        .expect("an answer, not a retriable error");
        assert_eq!(got.text, "");
        assert_eq!(got.stop_reason, "blocked:SAFETY");
        assert_eq!(got.usage.input_tokens, 12);
    }

    #[test]
    fn e9_a_malformed_function_call_is_asked_again() {
        let err = streamed(&[json!({"candidates": [{"content": {"role": "model"},
            "finishReason": "MALFORMED_FUNCTION_CALL"}]})])
        .expect_err("no empty answer");
        assert!(err.is_retriable(), "{err:?}");
        assert!(matches!(err, ModelError::MalformedCall(_)), "{err:?}");
        let cut = streamed(&[json!({"candidates": [{"content": {"parts": [{"text": "Hal"}]}}]})])
            .expect_err("cut off");
        assert_eq!(cut, ModelError::TruncatedStream);
    }

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
