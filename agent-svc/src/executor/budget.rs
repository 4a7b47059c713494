//! The context budget (E-8, S4 fixes 1 and 5/9): tokens counted with the provider's public
//! tokenizer where there is one (tiktoken for OpenAI models) and calibrated characters-per-token
//! ratios otherwise; tool definitions measured from the serialized schemas of each request; the
//! oldest history evicted first, never splitting a tool call from its results and never touching
//! the current turn. Tool declarations are counted once per tool set, and turns at most once
//! each, only when their bytes could be over a limit ([`TurnSizes`], issue 13): fitting a call
//! adds numbers, it encodes nothing again.

use std::sync::OnceLock;

use super::{bpe::Bpe, transcript::units};
use crate::llm::{ToolSet, Turn};

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
    /// `slot` tells the tokenizers apart for the counts a tool set keeps.
    Tiktoken {
        bpe: &'static Bpe,
        slot: usize,
    },
    Ratio,
}

fn o200k() -> Option<&'static Bpe> {
    static BPE: OnceLock<Option<Bpe>> = OnceLock::new();
    BPE.get_or_init(|| Bpe::o200k().ok()).as_ref()
}

fn cl100k() -> Option<&'static Bpe> {
    static BPE: OnceLock<Option<Bpe>> = OnceLock::new();
    BPE.get_or_init(|| Bpe::cl100k().ok()).as_ref()
}

impl TokenCounter {
    /// The counter for a model name: tiktoken for OpenAI families, ratios for the rest.
    pub fn for_model(model: &str) -> Self {
        let m = model.to_ascii_lowercase();
        let (bpe, slot) = if m.starts_with("gpt-4o")
            || m.starts_with("gpt-4.1")
            || m.starts_with("gpt-5")
            || m.starts_with('o') && m.chars().nth(1).is_some_and(|c| c.is_ascii_digit())
        {
            (o200k(), 0)
        } else if m.starts_with("gpt-4") || m.starts_with("gpt-3.5") {
            (cl100k(), 1)
        } else {
            (None, 2)
        };
        bpe.map_or(TokenCounter::Ratio, |bpe| TokenCounter::Tiktoken {
            bpe,
            slot,
        })
    }

    fn slot(&self) -> usize {
        match self {
            TokenCounter::Tiktoken { slot, .. } => *slot,
            TokenCounter::Ratio => 2,
        }
    }

    pub fn text(&self, s: &str) -> usize {
        match self {
            TokenCounter::Tiktoken { bpe, .. } => bpe.count(s),
            TokenCounter::Ratio => {
                (s.chars().count() as f64 / PROSE_CHARS_PER_TOKEN).ceil() as usize
            }
        }
    }

    /// Tokens of a text that never changes (the operator's fixed prompt sections), counted
    /// once per tokenizer.
    pub fn constant(&self, s: &'static str) -> usize {
        type Seen = std::sync::Mutex<std::collections::HashMap<(usize, usize, usize), usize>>;
        static SEEN: std::sync::LazyLock<Seen> = std::sync::LazyLock::new(Seen::default);
        // A &'static str's address names its text for the life of the process.
        let key = (self.slot(), s.as_ptr() as usize, s.len());
        if let Some(n) = SEEN.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return *n;
        }
        let n = self.text(s);
        SEEN.lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, n);
        n
    }

    fn json(&self, s: &str) -> usize {
        match self {
            TokenCounter::Tiktoken { .. } => self.text(s),
            TokenCounter::Ratio => {
                (s.chars().count() as f64 / JSON_CHARS_PER_TOKEN).ceil() as usize
            }
        }
    }

    /// Tokens of the tool definitions as a request declares them, counted once per set.
    pub fn tools(&self, tools: &ToolSet) -> usize {
        tools.tokens(self.slot(), |serialized| self.json(serialized))
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

/// What a tool result of the current turn says in its place when the turn alone is over the
/// context window. The call and its result stay paired; the model may read again, and is told
/// never to act again (the call may have sent or changed something).
pub fn elided_result(tool: &str) -> String {
    let tool: String = tool.chars().take(64).collect();
    format!(
        "[The result of this {tool} call was left out to fit the model's context window. \
If the call only read data and you still need it, call it again; never repeat a call that sent, \
created or changed something.]"
    )
}

/// An upper bound of [`elided_result`]'s tokens as a turn, under every counter.
const ELIDED_RESULT_TOKENS: usize = PER_TURN_OVERHEAD + 110;

/// Each transcript turn's tokens, counted only when a fit needs them. A turn's bytes and its
/// framing bound its tokens from above under every counter (a BPE token is at least one byte;
/// the ratios divide characters), so a transcript whose bytes fit every limit is fitted
/// without counting, exactly as its counts would have fitted it: nothing left out. Counting
/// each turn as it joined the transcript cost a run ~3% of its instructions (issue 13).
#[derive(Debug, Default)]
pub struct TurnSizes {
    /// Each turn's upper bound.
    bounds: Vec<usize>,
    /// The exact counts of the first `counted.len()` turns: turns are only ever appended.
    counted: Vec<usize>,
}

impl TurnSizes {
    pub fn of(turns: &[Turn]) -> Self {
        let mut sizes = Self::default();
        for t in turns {
            sizes.push(t);
        }
        sizes
    }

    /// A turn joined the transcript.
    pub fn push(&mut self, t: &Turn) {
        self.bounds.push(
            PER_TURN_OVERHEAD
                + match t {
                    Turn::User(s) => s.len(),
                    Turn::Assistant { text, tool_calls } => {
                        text.len()
                            + tool_calls
                                .iter()
                                .map(|c| c.name.len() + c.arguments.len())
                                .sum::<usize>()
                    }
                    Turn::ToolResult { content, .. } => content.len(),
                },
        );
    }

    fn counted(&mut self, turns: &[Turn], counter: TokenCounter) -> &[usize] {
        debug_assert_eq!(turns.len(), self.bounds.len());
        let from = self.counted.len();
        self.counted
            .extend(turns[from..].iter().map(|t| counter.turn(t)));
        &self.counted
    }

    /// [`fit`] for `turns` (the transcript these sizes were pushed for), counting only when the
    /// bounds cannot settle it. `estimated_input_tokens` is `None` when nothing was counted:
    /// [`TurnSizes::input_tokens`] gives it when it is needed.
    pub fn fit(
        &mut self,
        turns: &[Turn],
        counter: TokenCounter,
        fixed: usize,
        budget: Budget,
    ) -> Fit {
        let current_start = current_start(turns);
        let history: usize = self.bounds[..current_start].iter().sum();
        let total = fixed + budget.reserve_output + self.bounds.iter().sum::<usize>();
        // `fit` keeps everything when the history and the whole are within their limits and
        // the transcript opens with the user (or with the current turn).
        if total <= budget.window
            && (budget.history == 0 || history <= budget.history)
            && (current_start == 0 || matches!(turns.first(), Some(Turn::User(_))))
        {
            return Fit {
                evicted_turns: 0,
                elided_results: Vec::new(),
                window_full: false,
                estimated_input_tokens: None,
            };
        }
        fit(turns, self.counted(turns, counter), fixed, budget)
    }

    /// The input tokens a call sends when its fit left nothing out: the whole transcript's
    /// counts and `fixed`.
    pub fn input_tokens(&mut self, turns: &[Turn], counter: TokenCounter, fixed: usize) -> usize {
        fixed + self.counted(turns, counter).iter().sum::<usize>()
    }
}

fn current_start(turns: &[Turn]) -> usize {
    turns
        .iter()
        .rposition(|t| matches!(t, Turn::User(_)))
        .unwrap_or(0)
}

/// What fitting the transcript did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fit {
    /// The call sends `turns[evicted_turns..]`.
    pub evicted_turns: usize,
    /// The current turn's tool results (indices into `turns`, oldest first) that go as
    /// [`elided_result`]: the history was gone and the turn was still over the window.
    pub elided_results: Vec<usize>,
    /// Some of them went because the context window was full, not for the history limit.
    pub window_full: bool,
    /// What the call's input counts to; `None` from [`TurnSizes::fit`] when nothing was left
    /// out and nothing counted.
    pub estimated_input_tokens: Option<usize>,
}

/// The limits a call's input is fitted to.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// The model's context window.
    pub window: usize,
    /// Kept free for the answer.
    pub reserve_output: usize,
    /// At most this many tokens of earlier turns (the thread's history) go with a call; older
    /// ones stay searchable through the history tool. Zero: no limit but the window.
    pub history: usize,
}

/// Which leading turns a call leaves out, given each turn's tokens (`sizes`) and the tokens of
/// everything else (`fixed`: system text and tools).
///
/// Whole units go from the front, never splitting a tool call from its results, and what is
/// kept starts with a user turn. The last user turn and everything after it (the current turn)
/// always stay; when they alone do not fit, the current turn's older tool results (never the
/// latest round's, never a failure's) give their place to [`elided_result`], oldest first.
/// Only a latest round too big by itself still goes over, and the provider then answers with
/// a clear error.
///
/// The history limit cuts in steps of half the limit, counted from the start of the history,
/// so the cut moves only every few runs and the kept history stays a stable prefix that a
/// provider's prompt cache can serve.
pub fn fit(turns: &[Turn], sizes: &[usize], fixed: usize, budget: Budget) -> Fit {
    debug_assert_eq!(turns.len(), sizes.len());
    let current_start = current_start(turns);
    let history: usize = sizes[..current_start].iter().sum();
    let must_drop = if budget.history > 0 && history > budget.history {
        let step = (budget.history / 2).max(1);
        (history - budget.history).div_ceil(step) * step
    } else {
        0
    };
    // The history limit never takes the last exchange before the current turn (the answer a
    // follow-up question refers to); only the context window may.
    let last_exchange = turns[..current_start]
        .iter()
        .rposition(|t| matches!(t, Turn::User(_)))
        .unwrap_or(0);
    let mut total: usize = fixed + budget.reserve_output + sizes.iter().sum::<usize>();
    let mut dropped = 0;
    let mut cut = 0;
    let mut window_full = false;
    for (start, end) in units(turns) {
        if end > current_start {
            break;
        }
        let history_over = dropped < must_drop && start < last_exchange;
        // Keep going past the limits while the kept part would start with a non-user turn:
        // providers (Anthropic, Gemini) require the transcript to open with the user.
        if total <= budget.window && !history_over && matches!(turns[start], Turn::User(_)) {
            break;
        }
        window_full |= total > budget.window;
        let unit: usize = sizes[start..end].iter().sum();
        total -= unit;
        dropped += unit;
        cut = end;
    }
    let mut elided_results = Vec::new();
    if total > budget.window {
        let latest_round = turns
            .iter()
            .rposition(|t| matches!(t, Turn::Assistant { .. }))
            .unwrap_or(turns.len())
            .max(current_start);
        for i in current_start..latest_round {
            if total <= budget.window {
                break;
            }
            // A failure is Steward's own short sentence the model acts on: it stays.
            if matches!(
                turns[i],
                Turn::ToolResult {
                    is_error: false,
                    ..
                }
            ) && sizes[i] > ELIDED_RESULT_TOKENS
            {
                total -= sizes[i] - ELIDED_RESULT_TOKENS;
                elided_results.push(i);
                window_full = true;
            }
        }
    }
    Fit {
        evicted_turns: cut,
        elided_results,
        estimated_input_tokens: Some(total.saturating_sub(budget.reserve_output)),
        window_full,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ToolCall, ToolDecl};

    fn pair(id: &str, size: usize) -> Vec<Turn> {
        vec![
            Turn::Assistant {
                text: String::new(),
                tool_calls: vec![ToolCall {
                    id: id.into(),
                    name: "t".into(),
                    arguments: "{}".into(),
                    signature: None,
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
            TokenCounter::Tiktoken { .. }
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
        let small = ToolSet::new(vec![ToolDecl {
            name: "a".into(),
            description: "d".into(),
            parameters: serde_json::json!({"type": "object"}),
        }]);
        let big = ToolSet::new((0..15)
            .map(|i| ToolDecl {
                name: format!("tool_{i}"),
                description: "a long description of what this tool does and when to use it".repeat(3),
                parameters: serde_json::json!({"type": "object", "properties": {"q": {"type": "string", "description": "query"}}}),
            })
            .collect());
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
        let counter = TokenCounter::Ratio;
        let sizes: Vec<usize> = turns.iter().map(|t| counter.turn(t)).collect();
        let budget = Budget {
            window: 2000,
            reserve_output: 200,
            history: 0,
        };
        let fit = fit(&turns, &sizes, counter.text("system"), budget);
        assert_eq!(
            fit.evicted_turns, 4,
            "the first question, its pair and the answer go"
        );
        let turns = &turns[fit.evicted_turns..];
        assert_eq!(turns[0], Turn::User("second question".into()));
        assert!(
            super::super::transcript::check_pairs(turns).is_ok(),
            "no pair is split"
        );
    }

    fn exchange(n: usize) -> Vec<Turn> {
        vec![
            Turn::User(format!("question {n} {}", "words ".repeat(20))),
            Turn::Assistant {
                text: format!("answer {n} {}", "words ".repeat(40)),
                tool_calls: vec![],
            },
        ]
    }

    #[test]
    fn history_is_held_to_its_limit_and_cut_in_steps_so_the_prefix_stays_stable() {
        let counter = TokenCounter::Ratio;
        let budget = Budget {
            window: 200_000,
            reserve_output: 2048,
            history: 1000,
        };
        let mut cuts = Vec::new();
        for prior in 10..60 {
            let mut turns: Vec<Turn> = (0..prior).flat_map(exchange).collect();
            turns.push(Turn::User("now".into()));
            let sizes: Vec<usize> = turns.iter().map(|t| counter.turn(t)).collect();
            let fit = fit(&turns, &sizes, 0, budget);
            let kept: usize = sizes[fit.evicted_turns..sizes.len() - 1].iter().sum();
            assert!(
                kept <= budget.history,
                "{prior} prior exchanges keep {kept} tokens"
            );
            assert!(matches!(turns[fit.evicted_turns], Turn::User(_)));
            cuts.push(fit.evicted_turns);
        }
        cuts.dedup();
        assert!(
            cuts.len() < 50 / 2,
            "the cut moves in steps, not with every run: {cuts:?}"
        );
    }

    #[test]
    fn the_history_limit_keeps_the_last_exchange_whatever_its_size() {
        let counter = TokenCounter::Ratio;
        let budget = Budget {
            window: 200_000,
            reserve_output: 2048,
            history: 3000,
        };
        // A small old exchange, then one whose tool results alone are over the limit.
        let mut turns = exchange(0);
        turns.push(Turn::User("compare my two inboxes".into()));
        turns.extend(pair("a", 6000));
        turns.extend(pair("b", 6000));
        turns.push(Turn::Assistant {
            text: "Work has 3 unread, home has 12.".into(),
            tool_calls: vec![],
        });
        turns.push(Turn::User("reply to the second one".into()));
        let sizes: Vec<usize> = turns.iter().map(|t| counter.turn(t)).collect();
        let kept = fit(&turns, &sizes, 0, budget).evicted_turns;
        assert_eq!(
            turns[kept],
            Turn::User("compare my two inboxes".into()),
            "the old exchange goes, the one the follow-up refers to stays"
        );
        // Only the window may take it.
        let tight = Budget {
            window: 3000,
            ..budget
        };
        let tight = fit(&turns, &sizes, 0, tight);
        assert_eq!(
            turns[tight.evicted_turns],
            Turn::User("reply to the second one".into())
        );
        assert!(tight.window_full, "a full window is told apart");
    }

    #[test]
    fn a_current_turn_over_the_window_gives_up_its_older_results_never_the_latest_round() {
        let counter = TokenCounter::Ratio;
        let budget = Budget {
            window: 6000,
            reserve_output: 1000,
            history: 0,
        };
        // Three rounds of 7,000 characters (~2,000 tokens) each in the current turn.
        let mut turns = exchange(0);
        turns.push(Turn::User("read all three reports".into()));
        for id in ["a", "b", "c"] {
            turns.extend(pair(id, 7000));
        }
        let sizes: Vec<usize> = turns.iter().map(|t| counter.turn(t)).collect();
        let fit = fit(&turns, &sizes, 100, budget);
        assert_eq!(
            turns[fit.evicted_turns],
            Turn::User("read all three reports".into())
        );
        assert_eq!(fit.elided_results, [4], "only the oldest result had to go");
        assert!(fit.window_full);
        assert!(fit.estimated_input_tokens.unwrap() + budget.reserve_output <= budget.window);

        // Too tight for even that: every older result goes, the latest round stays whole.
        let tighter = Budget {
            window: 3000,
            ..budget
        };
        let fit = super::fit(&turns, &sizes, 100, tighter);
        assert_eq!(fit.elided_results, [4, 6]);
        assert!(
            !fit.elided_results.contains(&8),
            "the latest result is never elided"
        );

        // A failure stays whatever its size: the model acts on Steward's sentence.
        let mut failed = turns.clone();
        if let Turn::ToolResult { is_error, .. } = &mut failed[4] {
            *is_error = true;
        }
        let fit = super::fit(&failed, &sizes, 100, tighter);
        assert_eq!(fit.elided_results, [6]);
    }

    /// A transcript of units: a user turn, an answer, or a call with its results; sizes as
    /// text lengths, some past any limit below.
    fn transcript() -> impl Strategy<Value = Vec<Turn>> {
        let unit = prop_oneof![
            (0usize..3000).prop_map(|n| vec![Turn::User("word ".repeat(n / 5))]),
            (0usize..3000).prop_map(|n| vec![Turn::Assistant {
                text: "said ".repeat(n / 5),
                tool_calls: vec![],
            }]),
            (0usize..6000, any::<bool>()).prop_map(|(n, failed)| {
                let mut p = pair("c", n);
                if let Turn::ToolResult { is_error, .. } = &mut p[1] {
                    *is_error = failed;
                }
                p
            }),
        ];
        prop::collection::vec(unit, 1..12).prop_map(|units| units.concat())
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Fitting by bounds first leaves out exactly what fitting by counts does, under
        /// either kind of counter, and when it counted nothing the input it reports on asking
        /// is the counted one.
        #[test]
        fn fitting_by_bounds_first_fits_as_counting_every_turn_does(
            turns in transcript(),
            window in 200usize..20_000,
            reserve in 0usize..2_000,
            history in prop_oneof![Just(0usize), 1usize..10_000],
            fixed in 0usize..1_000,
            tiktoken in any::<bool>(),
        ) {
            let counter = if tiktoken { TokenCounter::for_model("gpt-4o") } else { TokenCounter::Ratio };
            let budget = Budget { window, reserve_output: reserve, history };
            let sizes: Vec<usize> = turns.iter().map(|t| counter.turn(t)).collect();
            let counted = fit(&turns, &sizes, fixed, budget);
            let mut lazily = TurnSizes::of(&turns);
            let bounded = lazily.fit(&turns, counter, fixed, budget);
            prop_assert_eq!(bounded.evicted_turns, counted.evicted_turns);
            prop_assert_eq!(&bounded.elided_results, &counted.elided_results);
            prop_assert_eq!(bounded.window_full, counted.window_full);
            let reported = bounded
                .estimated_input_tokens
                .unwrap_or_else(|| lazily.input_tokens(&turns, counter, fixed));
            prop_assert_eq!(Some(reported), counted.estimated_input_tokens);
        }
    }
}
