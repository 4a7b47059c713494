//! Values as PostgreSQL can hold them. It refuses a NUL character in `text` and `\u0000` in
//! `jsonb`, and one such character — in an email a tool read, a model's arguments, a title —
//! would fail a run's commit on every retry and end the run. Each NUL becomes U+FFFD (the
//! replacement character); nothing else changes. The in-memory store keeps values as given.

use std::borrow::Cow;

use serde_json::Value;

use crate::store::{Admission, RunCommit};

const REPLACEMENT: char = '\u{fffd}';

/// `c` with every NUL replaced, in place (a commit is owned on its way to the database).
pub(super) fn commit(c: &mut RunCommit) {
    for turn in &mut c.history {
        if let Some(fixed) = json_text(turn) {
            *turn = fixed.into_boxed_str();
        }
    }
    for a in &mut c.actions {
        for s in [&mut a.tool, &mut a.call_id] {
            text(s);
        }
        json(&mut a.arguments);
        for s in [&mut a.result_text, &mut a.error_kind, &mut a.approval_id] {
            opt(s);
        }
    }
    for m in &mut c.messages {
        text(&mut m.content);
        json(&mut m.metadata);
    }
    let p = &mut c.patch;
    for s in [
        &mut p.model,
        &mut p.error,
        &mut p.failure_kind,
        &mut p.summary,
        &mut p.system_prompt,
    ] {
        opt(s);
    }
    for (name, _) in p.prompt_sections.iter_mut().flatten() {
        text(name);
    }
    if let Some(a) = &mut c.approval {
        for s in [
            &mut a.tool,
            &mut a.call_id,
            &mut a.preview,
            &mut a.reason,
            &mut a.binding,
        ] {
            text(s);
        }
        json(&mut a.arguments);
        a.tainted_by.iter_mut().for_each(text);
        a.allowed_tools.iter_mut().flatten().for_each(text);
    }
    for (kind, detail) in &mut c.audit {
        text(kind);
        json(detail);
    }
}

/// `a` as storable: borrowed as it is unless some text of it holds a NUL.
pub(super) fn admission(a: &Admission) -> Cow<'_, Admission> {
    let r = &a.run;
    let texts = [
        Some(&r.id),
        Some(&r.thread_id),
        Some(&r.owner),
        r.request_id.as_ref(),
        Some(&r.channel),
        Some(&r.model),
        r.error.as_ref(),
        r.failure_kind.as_ref(),
        Some(&r.summary),
        Some(&r.system_prompt),
        a.new_thread_title.as_ref(),
        a.user_message.as_ref(),
    ];
    let nul = texts.iter().flatten().any(|s| s.contains('\0'))
        || r.prompt_sections.iter().any(|(n, _)| n.contains('\0'));
    if !nul {
        return Cow::Borrowed(a);
    }
    let mut a = a.clone();
    let r = &mut a.run;
    for s in [
        &mut r.id,
        &mut r.thread_id,
        &mut r.owner,
        &mut r.channel,
        &mut r.model,
        &mut r.summary,
        &mut r.system_prompt,
    ] {
        text(s);
    }
    for s in [&mut r.request_id, &mut r.error, &mut r.failure_kind] {
        opt(s);
    }
    r.prompt_sections.iter_mut().for_each(|(n, _)| text(n));
    opt(&mut a.new_thread_title);
    opt(&mut a.user_message);
    Cow::Owned(a)
}

/// `s` as storable: borrowed as it is unless it holds a NUL (a task's result or report, which
/// a model may have copied from hostile content).
pub(super) fn str_cow(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', &REPLACEMENT.to_string()))
    } else {
        Cow::Borrowed(s)
    }
}

fn text(s: &mut String) {
    if s.contains('\0') {
        *s = s.replace('\0', "\u{fffd}");
    }
}

fn opt(s: &mut Option<String>) {
    if let Some(s) = s {
        text(s);
    }
}

/// Every string of `v`, keys included.
fn json(v: &mut Value) {
    match v {
        Value::String(s) => text(s),
        Value::Array(items) => items.iter_mut().for_each(json),
        Value::Object(map) => {
            if map.keys().any(|k| k.contains('\0')) {
                *map = std::mem::take(map)
                    .into_iter()
                    .map(|(k, v)| (k.replace('\0', "\u{fffd}"), v))
                    .collect();
            }
            map.values_mut().for_each(json);
        }
        _ => {}
    }
}

/// JSON text with each `\u0000` escape (how JSON writes a NUL) replaced by the replacement
/// character; `None` when there is none. Escapes are read in order, so the text `\\u0000`
/// (an escaped backslash, then `u0000`) is left alone.
fn json_text(s: &str) -> Option<String> {
    if !s.contains("u0000") {
        return None;
    }
    let mut out = String::with_capacity(s.len());
    let mut changed = false;
    let mut rest = s;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let escape = &rest[at..];
        if let Some(after) = escape.strip_prefix("\\u0000") {
            out.push(REPLACEMENT);
            rest = after;
            changed = true;
        } else {
            // A backslash and the character it escapes, whatever it is.
            let len = escape[1..].chars().next().map_or(1, |c| 1 + c.len_utf8());
            out.push_str(&escape[..len]);
            rest = &escape[len..];
        }
    }
    out.push_str(rest);
    changed.then_some(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_nul_in_json_text_is_replaced_and_an_escaped_backslash_is_not_taken_for_one() {
        let nul = serde_json::to_string(&json!({"t": "a\0b"})).unwrap();
        assert_eq!(json_text(&nul).unwrap(), "{\"t\":\"a\u{fffd}b\"}");
        let literal = serde_json::to_string(&json!({"t": "\\u0000"})).unwrap();
        assert_eq!(json_text(&literal), None, "{literal}");
        let both = serde_json::to_string(&json!({"t": "\\\0"})).unwrap();
        let fixed = json_text(&both).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&fixed).unwrap(),
            json!({"t": "\\\u{fffd}"})
        );
        assert_eq!(json_text("{\"t\":\"plain\"}"), None);
    }

    #[test]
    fn every_string_of_a_json_value_loses_its_nul_keys_included() {
        let mut v = json!({"q\0": ["x\0", {"deep": "y\0z"}], "n": 1});
        json(&mut v);
        assert_eq!(
            v,
            json!({"q\u{fffd}": ["x\u{fffd}", {"deep": "y\u{fffd}z"}], "n": 1})
        );
    }
}
