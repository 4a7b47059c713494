//! OpenAI Chat Completions, streaming (L-1): also Ollama, OpenRouter, vLLM and any other
//! server that speaks it, by base URL. Tool-call arguments arrive in fragments keyed by index
//! and are joined here; usage comes in the last chunk (`stream_options.include_usage`).

use std::borrow::Cow;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize, Serializer};

use super::{
    BaseUrl, Delta, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse, TokenUsage,
    ToolCall, Turn, sse,
};

#[derive(Clone)]
pub struct OpenAi {
    /// Provider name in logs and usage ("openai", "ollama", ...).
    pub name: String,
    /// The chat completions URL under a base that includes the version path, e.g.
    /// `https://api.openai.com/v1` or `http://localhost:11434/v1`.
    pub endpoint: reqwest::Url,
    pub api_key: Option<String>,
    pub http: reqwest::Client,
}

impl OpenAi {
    pub fn new(name: &str, base: &BaseUrl, api_key: Option<String>, http: reqwest::Client) -> Self {
        Self {
            name: name.to_owned(),
            endpoint: base.join("/chat/completions"),
            api_key,
            http,
        }
    }
}

impl std::fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAi")
            .field("name", &self.name)
            .field("endpoint", &self.endpoint.as_str())
            .finish_non_exhaustive()
    }
}

/// The request body without its tools (see [`encode`]), serialised straight from the run's
/// transcript: nothing of it is copied into a `serde_json::Value` first, which cost a run about
/// as much as serialising it (issue 13). Members are declared in sorted order, the order `json!`
/// wrote them in, so the bytes a provider's prefix cache compares are the same as before.
#[derive(Serialize)]
struct Body<'a> {
    /// What OpenAI's reasoning models take instead of `max_tokens`, which they refuse.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    messages: Messages<'a>,
    model: &'a str,
    stream: bool,
    stream_options: StreamOptions,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// The system prompt, then every turn, as Chat Completions messages.
struct Messages<'a> {
    system: &'a str,
    turns: &'a [Turn],
}

impl Serialize for Messages<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let system = Message {
            content: Some(self.system),
            role: "system",
            tool_call_id: None,
            tool_calls: None,
        };
        s.collect_seq(std::iter::once(system).chain(self.turns.iter().map(Message::of)))
    }
}

#[derive(Serialize)]
struct Message<'a> {
    /// `null` only for an assistant turn that made tool calls and said nothing.
    content: Option<&'a str>,
    role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Calls<'a>>,
}

impl<'a> Message<'a> {
    fn of(turn: &'a Turn) -> Self {
        let plain = |role, content: &'a str| Message {
            content: Some(content),
            role,
            tool_call_id: None,
            tool_calls: None,
        };
        match turn {
            Turn::User(text) => plain("user", text),
            Turn::Assistant { text, tool_calls } if tool_calls.is_empty() => {
                plain("assistant", text)
            }
            Turn::Assistant { text, tool_calls } => Message {
                content: (!text.is_empty()).then_some(text.as_str()),
                role: "assistant",
                tool_call_id: None,
                tool_calls: Some(Calls(tool_calls)),
            },
            Turn::ToolResult {
                call_id, content, ..
            } => Message {
                tool_call_id: Some(call_id),
                ..plain("tool", content)
            },
        }
    }
}

/// A call's arguments as sent back in the history: what the model wrote when it is a JSON
/// object, `{}` otherwise. Servers that parse them (Ollama, vLLM) refuse a request holding
/// malformed JSON, and it would stay in the thread's history (the model was told, in the call's
/// result, what was wrong). Anthropic and Gemini get `{}` the same way.
fn sendable(arguments: &str) -> &str {
    let object = arguments.trim_start().starts_with('{')
        && serde_json::from_str::<serde::de::IgnoredAny>(arguments).is_ok();
    if object { arguments } else { "{}" }
}

/// An assistant turn's tool calls in the wire shape.
struct Calls<'a>(&'a [ToolCall]);

impl Serialize for Calls<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|c| WireCall {
            function: Function {
                arguments: sendable(&c.arguments),
                name: &c.name,
            },
            id: &c.id,
            kind: "function",
        }))
    }
}

#[derive(Serialize)]
struct WireCall<'a> {
    function: Function<'a>,
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct Function<'a> {
    arguments: &'a str,
    name: &'a str,
}

/// The request body on the wire: [`Body`] with the tool set's prepared declarations.
pub fn encode(request: &ModelRequest) -> Vec<u8> {
    let tools =
        (!request.tools.is_empty() && !request.answer_only).then(|| request.tools.openai_wire());
    let (max_completion_tokens, max_tokens) = if reasons_first(request.model) {
        let limit = request.max_output_tokens.saturating_add(REASONING_HEADROOM);
        (Some(limit), None)
    } else {
        (None, Some(request.max_output_tokens))
    };
    let body = Body {
        max_completion_tokens,
        max_tokens,
        messages: Messages {
            system: request.system,
            turns: request.turns,
        },
        model: request.model,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
    };
    super::tool_set::encode_with_tools(&body, tools)
}

/// What a reasoning model's limit adds to the answer's: its hidden reasoning counts against
/// `max_completion_tokens`, and a limit of the answer's size alone is often spent on
/// reasoning, leaving an empty answer. OpenAI advises keeping about 25,000 tokens for
/// reasoning and output. Billed only as used; the run's token and cost budgets still apply.
const REASONING_HEADROOM: u32 = 25_000;

/// Whether `model` is one of OpenAI's reasoning families (o1, o3, o4-mini, gpt-5...), which
/// answer `max_tokens` with a 400 and take `max_completion_tokens`. A routed name
/// (`openai/gpt-5` on OpenRouter) is the router's to translate, and other compatible servers
/// (Ollama, older vLLM) know only `max_tokens`, so only a bare OpenAI name qualifies.
fn reasons_first(model: &str) -> bool {
    let m = model.to_ascii_lowercase();
    m.starts_with("gpt-5")
        || m.starts_with('o') && m.chars().nth(1).is_some_and(|c| c.is_ascii_digit())
}

/// One streamed chunk. Its text borrows from the event's data where it has no escapes: a
/// chunk is usually a word, and each one was copied twice on its way to the delta.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    usage: Option<Usage>,
    /// vLLM and OpenRouter report a failure inside the stream (`{"object": "error", ...}` or
    /// `finish_reason: "error"` with this member) and then end it normally.
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: ChunkDelta<'a>,
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct ChunkDelta<'a> {
    #[serde(borrow)]
    content: Option<Text<'a>>,
    /// DeepSeek / vLLM reasoning models stream thinking here.
    #[serde(borrow)]
    reasoning_content: Option<Text<'a>>,
    /// A model that declines says why here, with `content` null: it is the answer the user
    /// reads, not an empty one.
    #[serde(borrow)]
    refusal: Option<Text<'a>>,
    /// Some servers send `"tool_calls": null` in text chunks.
    #[serde(default, borrow)]
    tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

#[derive(Deserialize)]
struct ToolCallDelta<'a> {
    /// Ollama numbers every call of a parallel batch 0, and older builds leave it out.
    index: Option<usize>,
    id: Option<String>,
    #[serde(borrow)]
    function: Option<FunctionDelta<'a>>,
}

#[derive(Deserialize)]
struct FunctionDelta<'a> {
    #[serde(borrow)]
    name: Option<Text<'a>>,
    #[serde(borrow)]
    arguments: Option<Text<'a>>,
}

/// A string of a chunk. serde borrows a `Cow` only where it is a field's whole type, not inside
/// an `Option`: this newtype is that field.
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

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
        let mut http = self
            .http
            .post(self.endpoint.clone())
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

        let mut streamed = Streamed::default();
        let mut done = false;
        while let Some(event) = events.next().await {
            let (_, data) = event?;
            if streamed.take(&data, deltas)? {
                done = true;
                break;
            }
        }
        if !done && streamed.finish.is_none() {
            return Err(ModelError::TruncatedStream);
        }
        Ok(streamed.response())
    }
}

/// What a stream's chunks add up to.
#[derive(Default)]
struct Streamed {
    text: String,
    thinking: String,
    /// Tool calls in the order they began: (id, name, arguments), each joined from fragments.
    calls: Vec<(String, String, String)>,
    /// The call each stream index (`None`: no index given) is filling now.
    filling: Vec<(Option<usize>, usize)>,
    usage: TokenUsage,
    finish: Option<String>,
}

impl Streamed {
    /// Takes one event's data; true at the stream's end marker.
    fn take(&mut self, data: &str, deltas: &DeltaSink) -> Result<bool, ModelError> {
        if data.trim() == "[DONE]" {
            return Ok(true);
        }
        let chunk: Chunk =
            serde_json::from_str(data).map_err(|e| ModelError::Decode(format!("chunk: {e}")))?;
        if let Some(error) = &chunk.error {
            return Err(stream_error(error));
        }
        if let Some(u) = chunk.usage {
            self.usage = TokenUsage {
                input_tokens: u.prompt_tokens,
                output_tokens: u.completion_tokens,
                cached_tokens: u.prompt_tokens_details.map_or(0, |d| d.cached_tokens),
                cache_write_tokens: 0,
            };
        }
        for choice in chunk.choices {
            let said = [choice.delta.content, choice.delta.refusal];
            for Text(t) in said.into_iter().flatten().filter(|t| !t.0.is_empty()) {
                self.text.push_str(&t);
                let _ = deltas.send(Delta::Text(t.into_owned()));
            }
            if let Some(Text(t)) = choice.delta.reasoning_content.filter(|t| !t.0.is_empty()) {
                self.thinking.push_str(&t);
                let _ = deltas.send(Delta::Thinking(t.into_owned()));
            }
            for tc in choice.delta.tool_calls.into_iter().flatten() {
                let at = self.call_for(tc.index, tc.id.as_deref());
                let entry = &mut self.calls[at];
                if let Some(id) = tc.id {
                    entry.0 = id;
                }
                if let Some(f) = tc.function {
                    if let Some(Text(name)) = f.name {
                        entry.1.push_str(&name);
                    }
                    if let Some(Text(args)) = f.arguments {
                        entry.2.push_str(&args);
                    }
                }
            }
            if choice.finish_reason.as_deref() == Some("error") {
                return Err(stream_error(&serde_json::Value::Null));
            }
            if choice.finish_reason.is_some() {
                self.finish = choice.finish_reason;
            }
        }
        Ok(false)
    }

    /// Where a fragment for stream index `index` goes: the call that index is filling, unless
    /// the fragment names another id, which starts a new call (parallel calls all numbered 0,
    /// or not numbered, would otherwise be joined into one).
    fn call_for(&mut self, index: Option<usize>, id: Option<&str>) -> usize {
        let filling = self.filling.iter().position(|(i, _)| *i == index);
        if let Some(f) = filling {
            let at = self.filling[f].1;
            let current = &self.calls[at].0;
            if id.is_none_or(|id| current.is_empty() || current == id) {
                return at;
            }
        }
        self.calls.push(Default::default());
        let at = self.calls.len() - 1;
        match filling {
            Some(f) => self.filling[f].1 = at,
            None => self.filling.push((index, at)),
        }
        at
    }

    fn response(self) -> ModelResponse {
        let tool_calls = self
            .calls
            .into_iter()
            .enumerate()
            .map(|(i, (id, name, arguments))| ToolCall {
                id: if id.is_empty() {
                    format!("call_{i}")
                } else {
                    id
                },
                name,
                arguments,
                signature: None,
            })
            .collect();
        ModelResponse {
            text: self.text,
            thinking: self.thinking,
            tool_calls,
            usage: self.usage,
            stop_reason: self.finish.unwrap_or_default(),
        }
    }
}

/// A failure reported inside the stream, as the status it would have had: its numeric `code`
/// when it is an HTTP status, 502 otherwise (the server's own upstream failed; worth a retry).
fn stream_error(error: &serde_json::Value) -> ModelError {
    let status = error["code"]
        .as_u64()
        .and_then(|c| u16::try_from(c).ok())
        .filter(|c| (400..=599).contains(c))
        .unwrap_or(502);
    let message = error["message"]
        .as_str()
        .map_or_else(|| error.to_string(), str::to_owned);
    ModelError::Status {
        status,
        detail: svc_kit::text::redacted_excerpt(&message, 200),
        retry_after: None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::llm::{ToolDecl, ToolSet};

    /// The body as this adapter built it before it was serialised straight from the transcript.
    fn as_json_wrote_it(request: &ModelRequest) -> Value {
        let mut messages = vec![json!({"role": "system", "content": request.system})];
        for turn in request.turns {
            messages.push(match turn {
                Turn::User(text) => json!({"role": "user", "content": text}),
                Turn::Assistant { text, tool_calls } if tool_calls.is_empty() => {
                    json!({"role": "assistant", "content": text})
                }
                Turn::Assistant { text, tool_calls } => json!({
                    "role": "assistant",
                    "content": if text.is_empty() { Value::Null } else { json!(text) },
                    "tool_calls": tool_calls.iter().map(|c| json!({
                        "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}})).collect::<Vec<_>>()
                }),
                Turn::ToolResult {
                    call_id, content, ..
                } => json!({"role": "tool", "tool_call_id": call_id, "content": content}),
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

    fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
            signature: None,
        }
    }

    #[test]
    fn a_chunks_text_is_borrowed_unless_it_has_escapes() {
        let data = r#"{"id":"c","choices":[{"index":0,"delta":{"content":"plain","reasoning_content":"a\nb","tool_calls":[{"index":1,"id":"call_9","function":{"name":"list_tasks","arguments":null}}]},"finish_reason":null}],"usage":null}"#;
        let chunk: Chunk = serde_json::from_str(data).unwrap();
        let delta = &chunk.choices[0].delta;
        let content = &delta.content.as_ref().unwrap().0;
        assert!(matches!(content, Cow::Borrowed("plain")), "{content:?}");
        let thinking = &delta.reasoning_content.as_ref().unwrap().0;
        assert!(
            matches!(thinking, Cow::Owned(t) if t == "a\nb"),
            "{thinking:?}"
        );
        let call = &delta.tool_calls.as_ref().expect("calls")[0];
        assert_eq!((call.index, call.id.as_deref()), (Some(1), Some("call_9")));
        let function = call.function.as_ref().unwrap();
        assert_eq!(function.name.as_ref().unwrap().0, "list_tasks");
        assert!(function.arguments.is_none(), "null is no text");

        let bare: Chunk = serde_json::from_str(r#"{"choices":[{"delta":{}}]}"#).unwrap();
        assert!(bare.choices[0].delta.content.is_none() && bare.usage.is_none());
    }

    #[test]
    fn the_body_has_the_same_bytes_as_its_json_value_form_had() {
        let tools = ToolSet::new(vec![ToolDecl {
            name: "list_tasks".into(),
            description: "d".into(),
            parameters: json!({"type": "object"}),
        }]);
        let turns = [
            Turn::User("what is \"due\"\n today? ünïcödé \u{1}".into()),
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![
                    call("call_1", "list_tasks", r#"{"due":"today"}"#),
                    call("call_2", "list_tasks", "{}"),
                ],
            },
            Turn::ToolResult {
                call_id: "call_1".into(),
                name: "list_tasks".into(),
                content: "[]".into(),
                is_error: false,
            },
            Turn::ToolResult {
                call_id: "call_2".into(),
                name: "list_tasks".into(),
                content: "error: the gateway is unreachable".into(),
                is_error: true,
            },
            Turn::Assistant {
                text: "Checking one more.".into(),
                tool_calls: vec![call("call_3", "list_tasks", "{}")],
            },
            Turn::ToolResult {
                call_id: "call_3".into(),
                name: "list_tasks".into(),
                content: "[{\"title\":\"pay rent\"}]".into(),
                is_error: false,
            },
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![],
            },
            Turn::Assistant {
                text: "Nothing is due.".into(),
                tool_calls: vec![],
            },
        ];
        let request = ModelRequest {
            model: "gpt-4o-mini",
            system: "[PERSONA]\nSteward",
            turns: &turns,
            tools: &tools,
            answer_only: false,
            stable_turns: 0,
            max_output_tokens: 700,
        };
        let wire = encode(&ModelRequest {
            answer_only: true,
            ..request
        });
        // A `Value` writes its members sorted: equal bytes mean the same members in the same
        // order, so a provider's prefix cache sees no change.
        let before = serde_json::to_vec(&as_json_wrote_it(&request)).unwrap();
        assert_eq!(
            String::from_utf8(wire).unwrap(),
            String::from_utf8(before).unwrap()
        );

        let with_tools: Value = serde_json::from_slice(&encode(&request)).unwrap();
        assert_eq!(with_tools["tools"][0]["function"]["name"], "list_tasks");
        assert_eq!(with_tools["messages"][2]["content"], Value::Null);
    }

    /// The chunks' data, taken in order: the response, or the error that ended it.
    fn streamed(chunks: &[&str]) -> Result<ModelResponse, ModelError> {
        let (deltas, _) = tokio::sync::mpsc::unbounded_channel();
        let mut streamed = Streamed::default();
        for data in chunks {
            if streamed.take(data, &deltas)? {
                break;
            }
        }
        Ok(streamed.response())
    }

    #[test]
    fn parallel_calls_that_all_come_as_index_0_or_none_stay_separate_calls() {
        let got = streamed(&[
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"list_tasks","arguments":"{\"status\""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":":\"pending\"}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"b","function":{"name":"search_memory","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"id":"c","function":{"name":"list_reminders","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ])
        .expect("a response");
        let calls: Vec<(&str, &str, &str)> = got
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            [
                ("a", "list_tasks", r#"{"status":"pending"}"#),
                ("b", "search_memory", "{}"),
                ("c", "list_reminders", "{}"),
            ]
        );
    }

    #[test]
    fn a_null_tool_calls_member_is_read_as_none() {
        let got = streamed(&[
            r#"{"choices":[{"delta":{"content":"Hi","tool_calls":null}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
        ])
        .expect("a response");
        assert_eq!(got.text, "Hi");
        assert!(got.tool_calls.is_empty());
    }

    #[test]
    fn an_error_inside_the_stream_fails_the_call_with_its_status_never_an_empty_answer() {
        let vllm = streamed(&[
            r#"{"object":"error","error":{"message":"This model's maximum context length is 8192 tokens","code":400}}"#,
            "[DONE]",
        ])
        .expect_err("an error");
        assert!(
            matches!(vllm, ModelError::Status { status: 400, .. }),
            "{vllm:?}"
        );
        assert!(!vllm.is_retriable());
        let openrouter = streamed(&[
            r#"{"choices":[{"delta":{"content":"Par"}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"error"}]}"#,
        ])
        .expect_err("an error");
        assert!(openrouter.is_retriable(), "{openrouter:?}");
    }

    #[test]
    fn l1_reasoning_models_are_given_max_completion_tokens_and_others_max_tokens() {
        let limit = |model: &str| -> (Value, Value) {
            let request = ModelRequest {
                model,
                system: "s",
                turns: &[],
                tools: &ToolSet::none(),
                answer_only: true,
                stable_turns: 0,
                max_output_tokens: 700,
            };
            let body: Value = serde_json::from_slice(&encode(&request)).unwrap();
            (
                body["max_completion_tokens"].clone(),
                body["max_tokens"].clone(),
            )
        };
        for model in ["gpt-5", "gpt-5-mini", "o1", "o3-mini", "o4-mini", "O3"] {
            let with_reasoning = json!(700 + REASONING_HEADROOM);
            assert_eq!(limit(model), (with_reasoning, Value::Null), "{model}");
        }
        for model in ["gpt-4o", "gpt-4.1-mini", "llama3.1", "openai/gpt-5", "orca"] {
            assert_eq!(limit(model), (Value::Null, json!(700)), "{model}");
        }
    }

    #[test]
    fn e5_a_models_refusal_is_its_answer_not_an_empty_one() {
        let got = streamed(&[
            r#"{"choices":[{"delta":{"role":"assistant","content":null,"refusal":""}}]}"#,
            r#"{"choices":[{"delta":{"content":null,"refusal":"I can't help "}}]}"#,
            r#"{"choices":[{"delta":{"content":null,"refusal":"with that."}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
            "[DONE]",
        ])
        .expect("a response");
        assert_eq!(got.text, "I can't help with that.");
    }

    #[test]
    fn malformed_arguments_go_back_in_the_history_as_an_empty_object() {
        assert_eq!(sendable(r#"{"due":"today"}"#), r#"{"due":"today"}"#);
        assert_eq!(sendable(r#"{"due": "tod"#), "{}");
        assert_eq!(sendable("[1, 2]"), "{}");
        assert_eq!(sendable(""), "{}");
    }
}
