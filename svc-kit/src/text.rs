//! Model-facing text caps (G-5, S4 fixes 3-4), shared by gateway-svc (every tool result) and
//! agent-svc (defence in depth before anything enters the LLM history): cut on a character
//! boundary, with a notice the model can see.

/// Text capped for the model, with what it was before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capped {
    pub text: String,
    pub truncated: bool,
    /// Length before capping, in characters.
    pub original_chars: u32,
}

/// Keeps at most `max_chars` characters of `text`, then appends
/// `[... truncated: showing first {max_chars} of {N} chars]`.
pub fn cap_text(text: String, max_chars: usize) -> Capped {
    let original = text.chars().count();
    let original_chars = u32::try_from(original).unwrap_or(u32::MAX);
    if original <= max_chars {
        return Capped {
            text,
            truncated: false,
            original_chars,
        };
    }
    // The byte offset of the first character past the cap: always a char boundary.
    let cut = text
        .char_indices()
        .nth(max_chars)
        .map_or(text.len(), |(i, _)| i);
    let mut capped = String::with_capacity(cut + 64);
    capped.push_str(&text[..cut]);
    capped.push_str(&format!(
        "\n[... truncated: showing first {max_chars} of {original} chars]"
    ));
    Capped {
        text: capped,
        truncated: true,
        original_chars,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn short_text_is_untouched() {
        let c = cap_text("hello".into(), 6000);
        assert_eq!(
            c,
            Capped {
                text: "hello".into(),
                truncated: false,
                original_chars: 5
            }
        );
    }

    #[test]
    fn fifty_kilobytes_are_cut_to_six_thousand_chars_with_the_exact_notice() {
        let c = cap_text("x".repeat(50_000), 6000);
        assert!(c.truncated);
        assert_eq!(c.original_chars, 50_000);
        assert!(c.text.starts_with(&"x".repeat(6000)));
        assert!(
            c.text
                .ends_with("\n[... truncated: showing first 6000 of 50000 chars]")
        );
        assert_eq!(c.text.chars().filter(|&ch| ch == 'x').count(), 6000);
    }

    #[test]
    fn multi_byte_text_is_cut_between_characters() {
        let text = "é🦀日".repeat(3000); // 9000 chars, 1 + 4 + 3 bytes each group
        let c = cap_text(text, 6000);
        let kept: String = c.text.split("\n[... truncated").next().unwrap().into();
        assert_eq!(kept.chars().count(), 6000);
        assert_eq!(kept, "é🦀日".repeat(2000));
        assert_eq!(c.original_chars, 9000);
    }

    proptest! {
        #[test]
        fn capping_never_panics_and_keeps_a_prefix(text in "\\PC{0,300}", max in 0usize..200) {
            let c = cap_text(text.clone(), max);
            let kept = if c.truncated {
                c.text.rsplit_once("\n[... truncated").map(|(k, _)| k.to_owned()).unwrap()
            } else {
                c.text.clone()
            };
            prop_assert!(text.starts_with(&kept));
            prop_assert_eq!(kept.chars().count(), text.chars().count().min(max));
            prop_assert_eq!(c.truncated, text.chars().count() > max);
        }
    }
}
