//! The model-facing transcript (LLM history), its units, and the invariant that every tool call
//! has exactly one result, checked on every write.

use std::collections::HashMap;

use crate::llm::Turn;

/// Every tool call of an assistant turn is answered by exactly one later result, and every
/// result answers a call. Returns what is wrong.
pub fn check_pairs(turns: &[Turn]) -> Result<(), String> {
    let mut open: HashMap<&str, usize> = HashMap::new();
    for turn in turns {
        match turn {
            Turn::Assistant { tool_calls, .. } => {
                for c in tool_calls {
                    if open.insert(c.id.as_str(), 0).is_some() {
                        return Err(format!("tool call id {} is used twice", c.id));
                    }
                }
            }
            Turn::ToolResult { call_id, .. } => match open.get_mut(call_id.as_str()) {
                Some(n) if *n == 0 => *n = 1,
                Some(_) => return Err(format!("tool call {call_id} has two results")),
                None => return Err(format!("result for unknown tool call {call_id}")),
            },
            Turn::User(_) => {}
        }
    }
    match open.iter().find(|(_, n)| **n == 0) {
        Some((id, _)) => Err(format!("tool call {id} has no result")),
        None => Ok(()),
    }
}

/// Splits the transcript into units that must stay together: a user turn; an assistant turn
/// with the results of its tool calls. Returns (start, end) index ranges.
pub fn units(turns: &[Turn]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < turns.len() {
        let start = i;
        i += 1;
        if matches!(turns[start], Turn::Assistant { .. }) {
            while i < turns.len() && matches!(turns[i], Turn::ToolResult { .. }) {
                i += 1;
            }
        }
        out.push((start, i));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::ToolCall;

    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: "t".into(),
            arguments: "{}".into(),
            signature: None,
        }
    }

    fn result(id: &str) -> Turn {
        Turn::ToolResult {
            call_id: id.into(),
            name: "t".into(),
            content: "ok".into(),
            is_error: false,
        }
    }

    #[test]
    fn pairs_are_checked_both_ways() {
        let good = vec![
            Turn::User("hi".into()),
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![call("a"), call("b")],
            },
            result("b"),
            result("a"),
        ];
        assert!(check_pairs(&good).is_ok());
        assert!(
            check_pairs(&good[..3])
                .unwrap_err()
                .contains("a has no result")
        );
        let mut twice = good.clone();
        twice.push(result("a"));
        assert!(check_pairs(&twice).unwrap_err().contains("two results"));
        assert!(check_pairs(&[result("z")]).unwrap_err().contains("unknown"));
    }

    #[test]
    fn an_assistant_turn_and_its_results_form_one_unit() {
        let t = vec![
            Turn::User("hi".into()),
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![call("a")],
            },
            result("a"),
            Turn::Assistant {
                text: "done".into(),
                tool_calls: vec![],
            },
            Turn::User("more".into()),
        ];
        assert_eq!(units(&t), [(0, 1), (1, 3), (3, 4), (4, 5)]);
    }
}

#[cfg(test)]
mod serde_tests {
    use crate::llm::{ToolCall, Turn};

    #[test]
    fn every_turn_round_trips_through_json() {
        let turns = vec![
            Turn::User("hi".into()),
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![ToolCall {
                    id: "c".into(),
                    name: "t".into(),
                    arguments: "{}".into(),
                    signature: None,
                }],
            },
            Turn::ToolResult {
                call_id: "c".into(),
                name: "t".into(),
                content: "ok".into(),
                is_error: false,
            },
        ];
        for t in turns {
            let v = serde_json::to_value(&t).unwrap();
            assert_eq!(serde_json::from_value::<Turn>(v).unwrap(), t);
        }
    }
}
