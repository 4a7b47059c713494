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

/// An excerpt of text someone else wrote (a provider's or an upstream's error body) that is
/// safe for a log line: secret-looking words replaced by `[redacted]`, at most `max_chars`
/// characters. Never for user-visible text: users get a classified sentence instead.
pub fn redacted_excerpt(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    let mut after_bearer = false;
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        let core = word.trim_matches(|c: char| {
            matches!(
                c,
                '"' | '\'' | ',' | ';' | '(' | ')' | '[' | ']' | '{' | '}'
            )
        });
        if !core.is_empty() && (after_bearer || looks_secret(core)) {
            out.push_str(&word.replace(core, "[redacted]"));
        } else {
            out.push_str(word);
        }
        after_bearer = core.eq_ignore_ascii_case("bearer");
        if out.chars().count() > max_chars {
            break;
        }
    }
    cap_text(out, max_chars).text
}

/// Keys, tokens and passwords as they usually look: a known key prefix, or a long run of
/// key characters mixing letters and digits.
fn looks_secret(word: &str) -> bool {
    let lower = word.to_ascii_lowercase();
    if ["sk-", "sk_", "pk_", "xox", "ghp_", "aiza", "ya29."]
        .iter()
        .any(|p| lower.starts_with(p) && word.len() >= 8)
    {
        return true;
    }
    if let Some((key, _)) = lower.split_once('=')
        && ["key", "token", "secret", "password", "api_key", "apikey"].contains(&key)
    {
        return true;
    }
    word.len() >= 20
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '+' | '/' | '='))
        && word.chars().any(|c| c.is_ascii_digit())
        && word.chars().any(|c| c.is_ascii_alphabetic())
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

    #[test]
    fn secret_looking_words_are_redacted_and_the_rest_kept() {
        let body = r#"{"error": {"message": "Invalid key sk-live-SECRET123456789012345 for org-77; Authorization: Bearer abc.def token=hunter2 aGVsbG8gd29ybGQgdGhpcyBpcyBsb25nMTIz"}}"#;
        let e = redacted_excerpt(body, 500);
        for secret in ["SECRET1234", "abc.def", "hunter2", "aGVsbG8"] {
            assert!(!e.contains(secret), "{secret} survived in {e}");
        }
        assert!(e.contains("Invalid key") && e.contains("org-77"));
        assert!(redacted_excerpt(&"word ".repeat(500), 50).chars().count() < 120);
    }

    proptest! {
        #[test]
        fn redacting_never_panics_and_stays_short(text in "\\PC{0,300}", max in 0usize..100) {
            let e = redacted_excerpt(&text, max);
            prop_assert!(e.chars().count() <= max + 60);
        }

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
