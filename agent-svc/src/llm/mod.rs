//! Model providers (L-1..L-5): one neutral request/response shape, adapters that speak each
//! provider's real wire format (streaming included), error classification and the retry /
//! fallback chain in one place, and the deterministic offline model.

pub mod anthropic;
pub mod error;
pub mod gemini;
pub mod openai;
pub mod resilient;
pub mod scripted;
pub mod sse;
pub mod tool_set;

use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;

pub use error::ModelError;
pub use tool_set::ToolSet;

/// A provider's base URL (`OPENAI_BASE_URL` and the like), checked when the settings are read:
/// absolute, http or https, with a host, and no query or fragment (paths are appended to it).
/// A mistyped one is named at start, not met as a failed call on every run.
#[derive(Debug, Clone, PartialEq)]
pub struct BaseUrl(reqwest::Url);

impl BaseUrl {
    /// The problem, when there is one, never repeats the value: a mistyped URL may carry a key.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let url = reqwest::Url::parse(raw.trim()).map_err(|e| format!("is not a URL ({e})"))?;
        match url.scheme() {
            "http" | "https" => {}
            other => return Err(format!("is {other}:, not http: or https:")),
        }
        if !url.has_host() {
            return Err("has no host".into());
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err("has a query or fragment, which the request paths would follow".into());
        }
        Ok(Self(url))
    }

    /// The URL of `path` under this base, its own path kept (`/v1` + `/chat/completions`).
    /// Made once per provider: parsing a URL on every call cost a run ~3% of its
    /// instructions (issue 13).
    pub fn join(&self, path: &str) -> reqwest::Url {
        let joined = format!("{}{path}", self.0.as_str().trim_end_matches('/'));
        reqwest::Url::parse(&joined).expect("a valid base URL with a path appended is valid")
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

/// A tool the model may call, as declared to the provider.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDecl {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments object.
    pub parameters: Value,
}

/// A tool call as the model produced it. `arguments` is the raw JSON text: it may be malformed,
/// and the executor decides what to do about that (E-9), not the adapter.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
    /// Gemini's `thoughtSignature` on the call's part: Gemini 3 refuses (400) a history whose
    /// calls come back without it, so it is kept with the call, in the thread's history too.
    /// Other providers' calls have none, and other adapters send none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// One entry of the model-facing transcript (persisted as the thread's LLM history).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "role", content = "content", rename_all = "snake_case")]
pub enum Turn {
    User(String),
    /// An assistant turn: text (possibly empty) and the tool calls it made.
    Assistant {
        text: String,
        tool_calls: Vec<ToolCall>,
    },
    /// The result of one tool call, answering `call_id`.
    ToolResult {
        call_id: String,
        name: String,
        content: String,
        is_error: bool,
    },
}

/// One model call's input, borrowed from the run: a call (and each retry or fallback of it)
/// copies nothing of the transcript or the tools.
#[derive(Debug, Clone, Copy)]
pub struct ModelRequest<'a> {
    pub model: &'a str,
    pub system: &'a str,
    pub turns: &'a [Turn],
    pub tools: &'a ToolSet,
    /// The model must answer in text, calling nothing (the final turn after a limit). The
    /// adapters then offer no tools, except Anthropic's, which declares them with
    /// `tool_choice: none`: it refuses a transcript holding tool blocks without them.
    pub answer_only: bool,
    /// How many leading turns are the same in the next call of this run (the history before
    /// the current user turn): a provider with a prompt cache marks where they end.
    pub stable_turns: usize,
    /// Always explicit (E-7, S0 AC-19).
    pub max_output_tokens: u32,
}

/// Token accounting of one call (E-10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Input tokens served from the provider's prompt cache.
    pub cached_tokens: u64,
    /// Input tokens written to the provider's prompt cache, which Anthropic bills above the
    /// input price. Like `cached_tokens`, a part of `input_tokens`.
    pub cache_write_tokens: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelResponse {
    pub text: String,
    pub thinking: String,
    pub tool_calls: Vec<ToolCall>,
    pub usage: TokenUsage,
    /// The provider's own stop reason, for logs.
    pub stop_reason: String,
}

/// Pieces of a response as they arrive (L-2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Text(String),
    Thinking(String),
    /// The call is being retried: what was streamed of this turn so far is void.
    Reset,
}

/// Where an adapter sends deltas; a closed receiver is fine (nobody is watching).
pub type DeltaSink = mpsc::UnboundedSender<Delta>;

#[async_trait::async_trait]
pub trait ModelProvider: Send + Sync + 'static {
    /// The provider's name for logs, usage and the fallback chain, e.g. "openai".
    fn name(&self) -> &str;

    /// One model call. Adapters stream and forward deltas to `deltas` as they arrive.
    async fn complete(
        &self,
        request: &ModelRequest,
        deltas: &DeltaSink,
    ) -> Result<ModelResponse, ModelError>;
}

/// How long one model call may take before it counts as a (retriable) timeout.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(120);
