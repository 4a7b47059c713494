//! Token counts for OpenAI models with tiktoken's vocabularies, held compactly (issue 13).
//!
//! tiktoken-rs keeps each vocabulary as three maps of 200,000 separately allocated byte
//! strings: ~45 MiB resident for o200k, a quarter of agent-svc's footprint under 1,000
//! concurrent runs. Counting needs only "rank of these bytes", so the vocabulary is copied out
//! of tiktoken-rs once at start into one byte arena, its offsets and an open-addressed index of
//! ranks (~4 MiB), and tiktoken-rs's copy is dropped. The pre-tokenizer splits as tiktoken's
//! pattern does (see [`Split`]), and the merge loop is tiktoken's: equal counts are a test
//! (`counts_equal_tiktoken_on_*`), not a hope.

use std::collections::BinaryHeap;

use regex_automata::{Anchored, Input, PatternID, meta::Regex};
use tiktoken_rs::{CoreBPE, Rank};

/// A tiktoken split pattern, in the pieces [`Split`] needs: the branches before its one
/// look-ahead branch `\s+(?!\S)`, and those after it.
struct Split {
    before: &'static str,
    after: &'static str,
}

/// tiktoken's cl100k_base pattern (tiktoken-rs keeps it inside `cl100k_base()`), without its
/// possessive quantifiers: here no branch can match differently for lack of them.
const CL100K: Split = Split {
    before: "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s+$|\\s*[\\r\\n]",
    after: "\\s",
};

/// tiktoken-rs's `O200K_BASE_PAT_STR` (a test keeps the two the same).
const O200K: Split = Split {
    before: concat!(
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        "|\\p{N}{1,3}",
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*",
        "|\\s*[\\r\\n]+",
    ),
    after: "\\s+",
};

/// The look-ahead branch `\s+(?!\S)` takes a run of whitespace, less its last character when
/// something else follows. A regex without look-around (a lazy DFA: counting took 72K
/// instructions per run of the load bench instead of fancy-regex's 170K) gets the same pieces
/// from two patterns in its place: `\s+$` for a run that ends the text, and `\s+\s` for one
/// that does not, whose match gives back its last character. Patterns are tried in order at
/// each position, as the branches of the alternation are.
const END_RUN: &str = "\\s+$";
const RUN_THEN_ONE: &str = "\\s+\\s";
const RUN_THEN_ONE_ID: usize = 2;

/// Pieces at least this long are merged with a heap, as tiktoken does (the simple loop is
/// quadratic).
const LONG_PIECE: usize = 100;

/// A vocabulary's ordinary tokens and split pattern: enough to count, nothing to decode.
pub struct Bpe {
    /// Every token's bytes, in rank order.
    bytes: Vec<u8>,
    /// Token `r` is `bytes[offsets[r]..offsets[r + 1]]`.
    offsets: Vec<u32>,
    /// Open addressing on a hash of the bytes: rank + 1, 0 for empty.
    index: Vec<u32>,
    pattern: Regex,
}

impl std::fmt::Debug for Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bpe")
            .field("tokens", &(self.offsets.len() - 1))
            .finish_non_exhaustive()
    }
}

impl Bpe {
    pub fn o200k() -> Result<Self, String> {
        let source = tiktoken_rs::o200k_base().map_err(|e| e.to_string())?;
        Self::copied_from(&source, &O200K)
    }

    pub fn cl100k() -> Result<Self, String> {
        let source = tiktoken_rs::cl100k_base().map_err(|e| e.to_string())?;
        Self::copied_from(&source, &CL100K)
    }

    /// The ordinary tokens of `source` (ranks 0.. up to the first gap, where the special
    /// tokens begin in every tiktoken vocabulary).
    fn copied_from(source: &CoreBPE, split: &Split) -> Result<Self, String> {
        let mut bytes = Vec::with_capacity(2 << 20);
        let mut offsets = vec![0u32];
        let mut rank: Rank = 0;
        while let Ok(token) = source.decode_bytes(&[rank]) {
            bytes.extend_from_slice(&token);
            offsets.push(u32::try_from(bytes.len()).map_err(|_| "vocabulary over 4 GiB")?);
            rank += 1;
        }
        if rank == 0 {
            return Err("the vocabulary has no tokens".into());
        }
        bytes.shrink_to_fit();
        let slots = (rank as usize * 2).next_power_of_two();
        let mut bpe = Self {
            bytes,
            offsets,
            index: vec![0; slots],
            pattern: Regex::new_many(&[split.before, END_RUN, RUN_THEN_ONE, split.after])
                .map_err(|e| e.to_string())?,
        };
        for r in 0..rank {
            let mut slot = bpe.slot_of(bpe.token(r));
            while bpe.index[slot] != 0 {
                slot = (slot + 1) & (slots - 1);
            }
            bpe.index[slot] = r + 1;
        }
        Ok(bpe)
    }

    fn token(&self, rank: Rank) -> &[u8] {
        &self.bytes[self.offsets[rank as usize] as usize..self.offsets[rank as usize + 1] as usize]
    }

    fn slot_of(&self, piece: &[u8]) -> usize {
        // FNV-1a: tokens are a few bytes; this is a lookup, not a defence against collisions.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in piece {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        (h as usize ^ (h >> 32) as usize) & (self.index.len() - 1)
    }

    fn rank(&self, piece: &[u8]) -> Option<Rank> {
        let mask = self.index.len() - 1;
        let mut slot = self.slot_of(piece);
        loop {
            match self.index[slot] {
                0 => return None,
                r if self.token(r - 1) == piece => return Some(r - 1),
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    /// How many tokens tiktoken's `encode_ordinary(text)` returns.
    pub fn count(&self, text: &str) -> usize {
        let mut count = 0;
        let mut at = 0;
        while at < text.len() {
            // Anchored: every character starts some branch, so the next piece starts where
            // the last ended, and the DFA never has to search backwards for a start.
            let input = Input::new(text).range(at..).anchored(Anchored::Yes);
            let Some(m) = self.pattern.search(&input) else {
                // A character no branch starts with (none in these patterns): skipped, as
                // tiktoken's unanchored search would.
                at += text[at..].chars().next().map_or(1, char::len_utf8);
                continue;
            };
            let mut end = m.end();
            if m.pattern() == PatternID::must(RUN_THEN_ONE_ID) {
                // The last whitespace character stood for the look-ahead: it starts the next
                // piece. What is left is never empty (`\s+` before it).
                end -= text[..end].chars().next_back().map_or(0, char::len_utf8);
            }
            count += self.count_piece(&text.as_bytes()[at..end]);
            at = end;
        }
        count
    }

    fn count_piece(&self, piece: &[u8]) -> usize {
        if piece.len() <= 1 || self.rank(piece).is_some() {
            return usize::from(!piece.is_empty());
        }
        if piece.len() < LONG_PIECE {
            self.merge_short(piece)
        } else {
            self.merge_long(piece)
        }
    }

    /// tiktoken's `_byte_pair_merge`: repeatedly merge the adjacent pair of lowest rank
    /// (leftmost on ties); returns how many parts remain.
    fn merge_short(&self, piece: &[u8]) -> usize {
        // (start, rank of the pair starting here)
        let mut parts: Vec<(usize, Rank)> = (0..piece.len() - 1)
            .map(|i| (i, self.rank(&piece[i..i + 2]).unwrap_or(Rank::MAX)))
            .collect();
        parts.push((piece.len() - 1, Rank::MAX));
        parts.push((piece.len(), Rank::MAX));
        let rank_at = |parts: &[(usize, Rank)], i: usize| {
            if i + 3 < parts.len() {
                self.rank(&piece[parts[i].0..parts[i + 3].0])
                    .unwrap_or(Rank::MAX)
            } else {
                Rank::MAX
            }
        };
        loop {
            let (i, min) = parts[..parts.len() - 1].iter().enumerate().fold(
                (usize::MAX, Rank::MAX),
                |best, (i, &(_, r))| {
                    if r < best.1 { (i, r) } else { best }
                },
            );
            if min == Rank::MAX {
                return parts.len() - 1;
            }
            if i > 0 {
                parts[i - 1].1 = rank_at(&parts, i - 1);
            }
            parts[i].1 = rank_at(&parts, i);
            parts.remove(i + 1);
        }
    }

    /// tiktoken's `_byte_pair_merge_large`: the same merges, found with a heap.
    fn merge_long(&self, piece: &[u8]) -> usize {
        #[derive(PartialEq, Eq)]
        struct Merge {
            start: usize,
            rank: Rank,
        }
        impl Ord for Merge {
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                // Lowest rank first, then leftmost.
                other
                    .rank
                    .cmp(&self.rank)
                    .then_with(|| other.start.cmp(&self.start))
            }
        }
        impl PartialOrd for Merge {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }
        struct Part {
            prev: usize,
            end: usize,
            next_end: usize,
            next_rank: Rank,
        }
        let n = piece.len();
        let mut parts: Vec<Part> = (0..n)
            .map(|i| Part {
                prev: i.wrapping_sub(1),
                end: i + 1,
                next_end: i + 2,
                next_rank: Rank::MAX,
            })
            .collect();
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some(rank) = self.rank(&piece[i..i + 2]) {
                heap.push(Merge { start: i, rank });
                parts[i].next_rank = rank;
            }
        }
        let mut count = n;
        let consider =
            |parts: &mut Vec<Part>, heap: &mut BinaryHeap<Merge>, start: usize, next_end: usize| {
                parts[start].next_end = next_end;
                parts[start].next_rank = Rank::MAX;
                if next_end <= n
                    && let Some(rank) = self.rank(&piece[start..next_end])
                {
                    heap.push(Merge { start, rank });
                    parts[start].next_rank = rank;
                }
            };
        while let Some(left) = heap.pop() {
            if left.rank != parts[left.start].next_rank {
                continue; // invalidated since it was pushed
            }
            let start = left.start;
            let right = parts[start].end;
            let right_end = parts[start].next_end;
            let right_next_end = parts[right].next_end;
            parts[start].end = right_end;
            count -= 1;
            consider(&mut parts, &mut heap, start, right_next_end);
            if right_end < n {
                parts[right_end].prev = start;
            }
            if start > 0 {
                let prev = parts[start].prev;
                consider(&mut parts, &mut heap, prev, right_end);
            }
            parts[right].next_rank = Rank::MAX;
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    use proptest::prelude::*;

    use super::*;

    static O200K: LazyLock<(Bpe, CoreBPE)> = LazyLock::new(|| {
        (
            Bpe::o200k().expect("o200k"),
            tiktoken_rs::o200k_base().expect("o200k"),
        )
    });
    static CL100K: LazyLock<(Bpe, CoreBPE)> = LazyLock::new(|| {
        (
            Bpe::cl100k().expect("cl100k"),
            tiktoken_rs::cl100k_base().expect("cl100k"),
        )
    });

    fn same(text: &str) {
        for (bpe, tiktoken) in [&*O200K, &*CL100K] {
            assert_eq!(
                bpe.count(text),
                tiktoken.encode_ordinary(text).len(),
                "{text:?}"
            );
        }
    }

    #[test]
    fn the_o200k_split_is_tiktokens_pattern_with_its_look_ahead_branch_replaced() {
        assert_eq!(
            format!("{}|\\s+(?!\\S)|{}", super::O200K.before, super::O200K.after),
            tiktoken_rs::O200K_BASE_PAT_STR
        );
    }

    #[test]
    fn every_ordinary_token_is_copied_and_no_special_one() {
        assert_eq!(O200K.0.offsets.len() - 1, 199_998);
        assert_eq!(CL100K.0.offsets.len() - 1, 100_256);
        assert_eq!(O200K.0.count("<|endoftext|>"), 7);
    }

    #[test]
    fn counts_equal_tiktoken_on_prose_code_json_and_odd_text() {
        for text in [
            "",
            " ",
            "Hello, world!",
            "I'm sure they'll say it's fine; we've DONE it.",
            "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n\n\n",
            r#"{"type":"object","required":["query"],"properties":{"query":{"type":"string","maxLength":300}}}"#,
            "Grüße aus Köln — 東京 へ ようこそ 👋🏽 مرحبا",
            "1234567890 3.14159 0xDEADBEEF",
            "   leading and trailing   \t\r\n",
            "<|endoftext|> is text here, not a special token",
        ] {
            same(text);
        }
        // Long pieces take the heap path: a word, a run of punctuation, a run of digits.
        same(&"abcdefghij".repeat(40));
        same(&"=-".repeat(300));
        same(&"supercalifragilistic".repeat(12));
        same(&"a1b2c3".repeat(100));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn counts_equal_tiktoken_on_any_text(text in "\\PC{0,200}") {
            same(&text);
        }

        #[test]
        fn counts_equal_tiktoken_on_runs_of_whitespace(text in "[ \\t\\r\\n\\u{a0}\\u{3000}a1.']{0,120}") {
            same(&text);
        }

        #[test]
        fn counts_equal_tiktoken_on_long_runs(text in "[a-zA-Z0-9 .,!?{}\"'\\n-]{100,600}") {
            same(&text);
        }
    }
}
