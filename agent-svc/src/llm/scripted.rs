//! The deterministic offline model (L-4): "scripted-offline". Tests give it an exact script of
//! turns; the local stack uses its rules, so everything runs with no key and no network. It is
//! named as what it is wherever it appears (usage, logs, the run's model field).

use std::{collections::VecDeque, sync::Mutex};

#[cfg(test)]
use super::ToolSet;
use super::{
    Delta, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse, TokenUsage, ToolCall,
    ToolDecl, Turn,
};

pub const NAME: &str = "scripted-offline";

/// One scripted model turn.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Answer in text.
    Reply(String),
    /// Call tools: (name, raw JSON arguments).
    Call(Vec<(String, String)>),
    /// Fail the call.
    Fail(ModelError),
}

#[derive(Default)]
pub struct ScriptedModel {
    script: Mutex<VecDeque<Step>>,
    /// Requests seen, for tests.
    pub seen: Mutex<Vec<SeenRequest>>,
}

/// What a request held, kept for tests.
#[derive(Debug, Clone, PartialEq)]
pub struct SeenRequest {
    pub model: String,
    pub system: String,
    pub turns: Vec<Turn>,
    pub tools: Vec<ToolDecl>,
    pub max_output_tokens: u32,
}

impl ScriptedModel {
    /// Plays `steps` in order, then falls back to the offline rules.
    pub fn new(steps: Vec<Step>) -> Self {
        Self {
            script: Mutex::new(steps.into()),
            seen: Mutex::default(),
        }
    }

    /// The rules alone, for local runs.
    pub fn offline() -> Self {
        Self::default()
    }

    fn next_step(&self, request: &ModelRequest) -> Step {
        if let Some(step) = self.script.lock().ok().and_then(|mut s| s.pop_front()) {
            return step;
        }
        rules(request)
    }
}

/// The offline rules: gather with a fitting tool when the user asks for something a tool can
/// answer, then summarise what came back; otherwise say plainly what this model is.
fn rules(request: &ModelRequest) -> Step {
    let has = |name: &str| !request.answer_only && request.tools.iter().any(|t| t.name == name);
    // A session opening: greet as the session guidance asks, from the context given.
    if request.system.contains("[SESSION OPEN]") {
        return Step::Reply(match request.system.split("[BOOTSTRAP CONTEXT]\n").nth(1) {
            Some(context) => {
                let context: Vec<&str> = context.lines().take_while(|l| !l.is_empty()).collect();
                format!("Welcome back. {}", context.join(" "))
            }
            None => format!(
                "I'm Steward, a chief of staff who gets your time back (answering with the offline model {NAME}). \
                 What's eating your time right now?"
            ),
        });
    }
    match request.turns.last() {
        Some(Turn::ToolResult { .. }) => {
            let results: Vec<&str> = request
                .turns
                .iter()
                .rev()
                .take_while(|t| matches!(t, Turn::ToolResult { .. }))
                .filter_map(|t| match t {
                    // Quoted as a person would, without the fence the prompt puts around it.
                    Turn::ToolResult { content, .. } => {
                        Some(crate::fence::body(content).unwrap_or(content))
                    }
                    _ => None,
                })
                .collect();
            Step::Reply(format!("Here is what I found:\n{}", results.join("\n")))
        }
        Some(Turn::User(text)) => {
            let lower = text.to_lowercase();
            if let Some(to) = recipient(text)
                .filter(|_| lower.starts_with("send ") || lower.starts_with("email "))
                && has("gmail_send")
            {
                // "send an email to maria@client.example saying …": a side effect, so the local
                // stack shows an approval (supervised by default) before anything is sent.
                Step::Call(vec![(
                    "gmail_send".into(),
                    serde_json::json!({
                        "to": [to],
                        "subject": "A note from Steward",
                        "body": message_of(text),
                    })
                    .to_string(),
                )])
            } else if lower.contains("task") && has("list_tasks") {
                Step::Call(vec![(
                    "list_tasks".into(),
                    r#"{"status":"pending"}"#.into(),
                )])
            } else if let Some(fact) = lower
                .strip_prefix("remember ")
                .filter(|_| has("save_memory"))
            {
                Step::Call(vec![(
                    "save_memory".into(),
                    serde_json::json!({ "content": fact }).to_string(),
                )])
            } else if (lower.contains("email") || lower.contains("mail")) && has("search_gmail") {
                Step::Call(vec![(
                    "search_gmail".into(),
                    r#"{"query":"is:unread"}"#.into(),
                )])
            } else {
                Step::Reply(format!(
                    "I'm the offline scripted model ({NAME}); no model provider is configured. You said: {text}"
                ))
            }
        }
        _ => Step::Reply(format!("I'm the offline scripted model ({NAME}).")),
    }
}

/// What to say in "send an email to x saying …" (or "that …"); the whole request otherwise.
fn message_of(text: &str) -> String {
    // ASCII-only lowering keeps every byte offset: full lowering changes the length of some
    // characters ("İ", the Kelvin sign), and the offset found would cut `text` mid-character.
    let lower = text.to_ascii_lowercase();
    [" saying ", " that "]
        .iter()
        .find_map(|w| {
            lower
                .find(w)
                .map(|at| text[at + w.len()..].trim().to_owned())
        })
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| text.to_owned())
}

/// The first word of `text` that looks like a mail address, without trailing punctuation.
fn recipient(text: &str) -> Option<String> {
    text.split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric() && c != '@' && c != '.'))
        .map(|w| w.trim_end_matches('.'))
        .find(|w| {
            w.split_once('@')
                .is_some_and(|(l, d)| !l.is_empty() && d.contains('.'))
        })
        .map(str::to_owned)
}

#[async_trait::async_trait]
impl ModelProvider for ScriptedModel {
    fn name(&self) -> &str {
        NAME
    }

    async fn complete(
        &self,
        request: &ModelRequest,
        deltas: &DeltaSink,
    ) -> Result<ModelResponse, ModelError> {
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(SeenRequest {
                model: request.model.to_owned(),
                system: request.system.to_owned(),
                turns: request.turns.to_vec(),
                tools: if request.answer_only {
                    Vec::new()
                } else {
                    request.tools.to_vec()
                },
                max_output_tokens: request.max_output_tokens,
            });
        }
        let input_tokens =
            (request.system.len() + request.turns.iter().map(turn_len).sum::<usize>()) as u64 / 4;
        let step = self.next_step(request);
        let (text, tool_calls) = match step {
            Step::Fail(e) => return Err(e),
            // A tool-less request cannot be answered with a call: the rules' text stands in.
            Step::Call(_) if request.tools.is_empty() || request.answer_only => {
                ("Here is what I have so far.".to_owned(), Vec::new())
            }
            Step::Reply(text) => (text, Vec::new()),
            Step::Call(calls) => {
                let n = request.turns.len();
                let calls = calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, (name, arguments))| ToolCall {
                        id: format!("call_{n}_{i}"),
                        name,
                        arguments,
                        signature: None,
                    })
                    .collect();
                (String::new(), calls)
            }
        };
        for word in text.split_inclusive(' ') {
            let _ = deltas.send(Delta::Text(word.to_owned()));
        }
        Ok(ModelResponse {
            usage: TokenUsage {
                input_tokens,
                output_tokens: text.len() as u64 / 4 + 1,
                cached_tokens: 0,
                cache_write_tokens: 0,
            },
            stop_reason: if tool_calls.is_empty() {
                "end_turn".into()
            } else {
                "tool_use".into()
            },
            text,
            thinking: String::new(),
            tool_calls,
        })
    }
}

fn turn_len(t: &Turn) -> usize {
    match t {
        Turn::User(s) => s.len(),
        Turn::Assistant { text, tool_calls } => {
            text.len() + tool_calls.iter().map(|c| c.arguments.len()).sum::<usize>()
        }
        Turn::ToolResult { content, .. } => content.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules_for(system: &str, prompt: &str, tools: &[&str]) -> Step {
        let tools = ToolSet::new(
            tools
                .iter()
                .map(|name| ToolDecl {
                    name: (*name).into(),
                    description: String::new(),
                    parameters: serde_json::json!({}),
                })
                .collect(),
        );
        rules(&ModelRequest {
            model: NAME,
            system,
            turns: &[Turn::User(prompt.into())],
            tools: &tools,
            answer_only: false,
            stable_turns: 0,
            max_output_tokens: 100,
        })
    }

    fn request_rules(system: &str) -> Step {
        rules_for(system, "(opened)", &[])
    }

    #[test]
    fn a_request_with_letters_whose_lowercase_is_longer_is_answered_without_a_panic() {
        let Step::Call(calls) = rules_for(
            "[PERSONA]\nx",
            "Send İİİ an email to ana@istanbul.example saying İyi günler",
            &["gmail_send"],
        ) else {
            panic!("expected a call")
        };
        let args: serde_json::Value = serde_json::from_str(&calls[0].1).unwrap();
        assert_eq!(args["body"], "İyi günler");
    }

    #[test]
    fn asked_to_send_an_email_the_offline_model_calls_gmail_send_with_the_address_it_was_given() {
        let mail = ["gmail_send", "search_gmail"];
        let Step::Call(calls) = rules_for(
            "[PERSONA]\nx",
            "Send an email to maria@client.example saying the contract looks good.",
            &mail,
        ) else {
            panic!("expected a call")
        };
        assert_eq!(calls[0].0, "gmail_send");
        let args: serde_json::Value = serde_json::from_str(&calls[0].1).unwrap();
        assert_eq!(args["to"], serde_json::json!(["maria@client.example"]));
        assert_eq!(args["body"], "the contract looks good.");
        // Sending comes first, whatever else the request mentions.
        let Step::Call(calls) = rules_for(
            "[PERSONA]\nx",
            "Send an email to a@b.example about the task",
            &["gmail_send", "search_gmail", "list_tasks"],
        ) else {
            panic!("expected a call")
        };
        assert_eq!(calls[0].0, "gmail_send");
        // Without an address it is a search, as before.
        let Step::Call(calls) = rules_for("[PERSONA]\nx", "send me a summary of my email", &mail)
        else {
            panic!("expected a call")
        };
        assert_eq!(calls[0].0, "search_gmail");
    }

    #[test]
    fn the_offline_model_greets_new_and_returning_users_from_the_session_sections() {
        let Step::Reply(new) = request_rules("[PERSONA]\nx\n\n[SESSION OPEN]\nfirst session")
        else {
            panic!()
        };
        assert!(new.ends_with("What's eating your time right now?"));
        let Step::Reply(back) = request_rules(
            "[SESSION OPEN]\ng\n\n[BOOTSTRAP CONTEXT]\nTasks: 1 active task.\nEmail: Unread: a 3\n\n[CURRENT TIME]\nnow",
        ) else {
            panic!()
        };
        assert_eq!(
            back,
            "Welcome back. Tasks: 1 active task. Email: Unread: a 3"
        );
    }
}
