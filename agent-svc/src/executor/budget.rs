//! The context budget (E-8, S4 fixes 1 and 5/9): tokens counted with the provider's public
//! tokenizer where there is one (tiktoken for OpenAI models) and calibrated characters-per-token
//! ratios otherwise; tool definitions measured from the serialized schemas of each request; the
//! oldest history evicted first, never splitting a tool call from its results and never touching
//! the current turn.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use super::transcript::units;
use crate::llm::{ToolDecl, Turn};

/// Above this many estimated tokens the system prompt is logged at WARN before the call
/// (S0 AC-20).
pub const SYSTEM_PROMPT_WARN_TOKENS: usize = 50_000;

/// Characters per token for prose, calibrated for Claude and Gemini tokenizers (~3.5), and for
/// JSON, which tokenizes denser (~2.8, S4).
const PROSE_CHARS_PER_TOKEN: f64 = 3.5;
const JSON_CHARS_PER_TOKEN: f64 = 2.8;
/// Per-message framing the providers add (role markers and separators).
const PER_TURN_OVERHEAD: usize = 4;

#[derive(Clone, Copy)]
pub enum TokenCounter {
    Tiktoken(&'static CoreBPE),
    Ratio,
}

fn o200k() -> Option<&'static CoreBPE> {
    static BPE: OnceLock<Option<CoreBPE>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::o200k_base().ok()).as_ref()
}

fn cl100k() -> Option<&'static CoreBPE> {
    static BPE: OnceLock<Option<CoreBPE>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::cl100k_base().ok()).as_ref()
}

impl TokenCounter {
    /// The counter for a model name: tiktoken for OpenAI families, ratios for the rest.
    pub fn for_model(model: &str) -> Self {
        let m = model.to_ascii_lowercase();
        let bpe = if m.starts_with("gpt-4o")
            || m.starts_with("gpt-4.1")
            || m.starts_with("gpt-5")
            || m.starts_with('o') && m.chars().nth(1).is_some_and(|c| c.is_ascii_digit())
        {
            o200k()
        } else if m.starts_with("gpt-4") || m.starts_with("gpt-3.5") {
            cl100k()
        } else {
            None
        };
        bpe.map_or(TokenCounter::Ratio, TokenCounter::Tiktoken)
    }

    pub fn text(&self, s: &str) -> usize {
        match self {
            TokenCounter::Tiktoken(bpe) => bpe.encode_ordinary(s).len(),
            TokenCounter::Ratio => {
                (s.chars().count() as f64 / PROSE_CHARS_PER_TOKEN).ceil() as usize
            }
        }
    }

    fn json(&self, s: &str) -> usize {
        match self {
            TokenCounter::Tiktoken(_) => self.text(s),
            TokenCounter::Ratio => {
                (s.chars().count() as f64 / JSON_CHARS_PER_TOKEN).ceil() as usize
            }
        }
    }

    /// Tokens of the tool definitions exactly as this request serializes them.
    pub fn tools(&self, tools: &[ToolDecl]) -> usize {
        let serialized: Vec<_> = tools
            .iter()
            .map(|t| serde_json::json!({"name": t.name, "description": t.description, "parameters": t.parameters}))
            .collect();
        self.json(&serde_json::Value::Array(serialized).to_string())
    }

    pub fn turn(&self, t: &Turn) -> usize {
        PER_TURN_OVERHEAD
            + match t {
                Turn::User(s) => self.text(s),
                Turn::Assistant { text, tool_calls } => {
                    self.text(text)
                        + tool_calls
                            .iter()
                            .map(|c| self.text(&c.name) + self.json(&c.arguments))
                            .sum::<usize>()
                }
                Turn::ToolResult { content, .. } => self.text(content),
            }
    }
}

/// What fitting the transcript did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fit {
    pub evicted_turns: usize,
    pub estimated_input_tokens: usize,
    pub tool_tokens: usize,
}

/// Evicts whole units from the front of `turns` until system + tools + turns + the output
/// reserve fit `window` and what is kept starts with a user turn. The last user turn and everything after it (the current turn) always
/// stay, even if they alone do not fit: the provider then answers with a clear error.
pub fn fit(
    counter: TokenCounter,
    system: &str,
    tools: &[ToolDecl],
    turns: &mut Vec<Turn>,
    window: usize,
    reserve_output: usize,
) -> Fit {
    let tool_tokens = counter.tools(tools);
    let fixed = counter.text(system) + tool_tokens + reserve_output;
    let sizes: Vec<usize> = turns.iter().map(|t| counter.turn(t)).collect();
    let mut total: usize = fixed + sizes.iter().sum::<usize>();
    let current_start = turns
        .iter()
        .rposition(|t| matches!(t, Turn::User(_)))
        .unwrap_or(0);
    let mut cut = 0;
    for (start, end) in units(turns) {
        if end > current_start {
            break;
        }
        // Keep going past the window while the kept part would start with a non-user turn:
        // providers (Anthropic, Gemini) require the transcript to open with the user.
        if total <= window && matches!(turns[start], Turn::User(_)) {
            break;
        }
        total -= sizes[start..end].iter().sum::<usize>();
        cut = end;
    }
    turns.drain(..cut);
    Fit {
        evicted_turns: cut,
        estimated_input_tokens: total - reserve_output,
        tool_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::ToolCall;

    fn pair(id: &str, size: usize) -> Vec<Turn> {
        vec![
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![ToolCall {
                    id: id.into(),
                    name: "t".into(),
                    arguments: "{}".into(),
                }],
            },
            Turn::ToolResult {
                call_id: id.into(),
                name: "t".into(),
                content: "x".repeat(size),
                is_error: false,
            },
        ]
    }

    #[test]
    fn tiktoken_counts_openai_models_and_ratios_the_rest() {
        assert!(matches!(
            TokenCounter::for_model("gpt-4o-mini"),
            TokenCounter::Tiktoken(_)
        ));
        assert!(matches!(
            TokenCounter::for_model("claude-sonnet-4"),
            TokenCounter::Ratio
        ));
        assert_eq!(TokenCounter::for_model("gpt-4o").text("hello world"), 2);
        assert_eq!(TokenCounter::Ratio.text(&"a".repeat(35)), 10);
    }

    #[test]
    fn tool_definitions_are_measured_not_assumed() {
        let small = vec![ToolDecl {
            name: "a".into(),
            description: "d".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        let big: Vec<_> = (0..15)
            .map(|i| ToolDecl {
                name: format!("tool_{i}"),
                description: "a long description of what this tool does and when to use it".repeat(3),
                parameters: serde_json::json!({"type": "object", "properties": {"q": {"type": "string", "description": "query"}}}),
            })
            .collect();
        assert!(TokenCounter::Ratio.tools(&big) > 30 * TokenCounter::Ratio.tools(&small));
    }

    #[test]
    fn eviction_takes_the_oldest_units_whole_and_keeps_the_current_turn() {
        let mut turns = vec![Turn::User("first question".into())];
        turns.extend(pair("a", 4000));
        turns.push(Turn::Assistant {
            text: "answer".into(),
            tool_calls: vec![],
        });
        turns.push(Turn::User("second question".into()));
        turns.extend(pair("b", 4000));
        let before = turns.len();
        let fit = fit(TokenCounter::Ratio, "system", &[], &mut turns, 2000, 200);
        assert_eq!(
            fit.evicted_turns, 4,
            "the first question, its pair and the answer go"
        );
        assert_eq!(turns.len(), before - 4);
        assert_eq!(turns[0], Turn::User("second question".into()));
        assert!(
            super::super::transcript::check_pairs(&turns).is_ok(),
            "no pair is split"
        );
    }
}
