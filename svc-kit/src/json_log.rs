//! JSON log lines written straight into the line (issue 13).
//!
//! tracing-subscriber's own JSON format stores each span's fields as JSON text built through a
//! map of `serde_json::Value`s, and on every event parses each span's text back into values to
//! serialise them again, once for `span` and once more for `spans`. Under load that was ~8% of
//! agent-svc's instructions per run and over a quarter of gateway-svc's. This format writes
//! the same line — `timestamp`, `level`, the event's fields flattened, `target`, `span` (the
//! current span's fields and its `name`), `spans` (root to leaf) — with no intermediate
//! values, and copies each span's stored text into the line as it is. Two differences: an
//! event given an explicit parent lists that parent's scope as `spans`, where
//! tracing-subscriber lists the entered spans, which need not hold it; and a byte-slice field
//! of a span is a hex string, as tracing writes bytes for events, not an array.

use std::fmt::{self, Write};

use tracing::{
    Event, Subscriber,
    field::{Field, Visit},
    span,
};
use tracing_log::NormalizeEvent;
use tracing_subscriber::{
    field::RecordFields,
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields,
        format::Writer,
        time::{FormatTime, SystemTime},
    },
    registry::{LookupSpan, SpanRef},
};

/// Formats span fields as one JSON object's text, `{"a":1,"b":"x"}`, stored once per span.
#[derive(Debug, Default, Clone, Copy)]
pub struct JsonSpanFields;

/// Formats events as JSON lines, reading spans' fields as [`JsonSpanFields`] stored them.
#[derive(Debug, Default, Clone, Copy)]
pub struct JsonLines;

impl<'writer> FormatFields<'writer> for JsonSpanFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        let mut object = Object::open(&mut writer)?;
        fields.record(&mut object);
        object.close()
    }

    /// A field recorded after the span was created (a trace id, say) goes before the object's
    /// closing brace. Recording a field the text already holds would repeat its key, so then
    /// the object is built again with the new value in place of the old.
    fn add_fields(
        &self,
        current: &'writer mut FormattedFields<Self>,
        fields: &span::Record<'_>,
    ) -> fmt::Result {
        let mut names = FieldNames::default();
        fields.record(&mut names);
        if names.0.iter().any(|n| holds_key(&current.fields, n)) {
            return rebuild(&mut current.fields, fields);
        }
        if !current.fields.ends_with('}') {
            return Err(fmt::Error);
        }
        current.fields.pop();
        let kept = current.fields.len();
        let mut object = Object {
            first: current.fields == "{",
            out: &mut current.fields,
            error: Ok(()),
        };
        fields.record(&mut object);
        let written = object.close();
        if written.is_err() {
            // Never leave the stored text unclosed: every later line would lose the span.
            current.fields.truncate(kept);
            current.fields.push('}');
        }
        written
    }
}

impl<S> FormatEvent<S, JsonSpanFields> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonSpanFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        writer.write_str("{\"timestamp\":\"")?;
        SystemTime.format_time(&mut writer)?;
        writer.write_str("\",\"level\":\"")?;
        writer.write_str(meta.level().as_str())?;
        writer.write_char('"')?;
        let mut fields = Object {
            out: &mut writer,
            first: false,
            error: Ok(()),
        };
        event.record(&mut fields);
        fields.error?;
        writer.write_str(",\"target\":")?;
        string(&mut writer, meta.target())?;
        let current = event
            .parent()
            .and_then(|id| ctx.span(id))
            .or_else(|| ctx.lookup_current());
        if let Some(current) = current {
            writer.write_str(",\"span\":")?;
            span_object(&mut writer, &current)?;
            writer.write_str(",\"spans\":[")?;
            for (i, span) in current.scope().from_root().enumerate() {
                if i > 0 {
                    writer.write_char(',')?;
                }
                span_object(&mut writer, &span)?;
            }
            writer.write_char(']')?;
        }
        writer.write_str("}\n")
    }
}

/// `{<the span's stored fields>,"name":"<its name>"}`.
fn span_object<S>(out: &mut Writer<'_>, span: &SpanRef<'_, S>) -> fmt::Result
where
    S: for<'a> LookupSpan<'a>,
{
    let extensions = span.extensions();
    let members = extensions
        .get::<FormattedFields<JsonSpanFields>>()
        .and_then(|f| f.fields.strip_prefix('{')?.strip_suffix('}'))
        .filter(|m| !m.is_empty());
    out.write_char('{')?;
    if let Some(members) = members {
        out.write_str(members)?;
        out.write_char(',')?;
    }
    out.write_str("\"name\":")?;
    string(out, span.name())?;
    out.write_char('}')
}

/// The members of a JSON object written as fields are visited.
struct Object<'a, W: Write + ?Sized> {
    out: &'a mut W,
    /// No member written yet: the next needs no comma.
    first: bool,
    error: fmt::Result,
}

impl<'a, W: Write + ?Sized> Object<'a, W> {
    fn open(out: &'a mut W) -> Result<Self, fmt::Error> {
        out.write_char('{')?;
        Ok(Self {
            out,
            first: true,
            error: Ok(()),
        })
    }

    fn close(self) -> fmt::Result {
        self.error?;
        self.out.write_char('}')
    }

    /// Writes `"name":` and then the value `value` writes; the first error sticks.
    fn member(&mut self, field: &Field, value: impl FnOnce(&mut W) -> fmt::Result) {
        if self.error.is_ok() {
            self.error = self.write_member(field, value);
        }
    }

    fn write_member(
        &mut self,
        field: &Field,
        value: impl FnOnce(&mut W) -> fmt::Result,
    ) -> fmt::Result {
        if !std::mem::take(&mut self.first) {
            self.out.write_char(',')?;
        }
        string(self.out, field.name())?;
        self.out.write_char(':')?;
        value(self.out)
    }
}

impl<W: Write + ?Sized> Visit for Object<'_, W> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.member(field, |out| string(out, value));
    }

    /// A value whose `Debug` fails still closes its string (the line stays JSON), marked.
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.member(field, |out| {
            out.write_char('"')?;
            if write!(Escaped(out), "{value:?}").is_err() {
                out.write_str(" [formatting this value failed]")?;
            }
            out.write_char('"')
        });
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.member(field, |out| write!(out, "{value}"));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.member(field, |out| write!(out, "{value}"));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.member(field, |out| {
            out.write_str(if value { "true" } else { "false" })
        });
    }

    /// JSON has no NaN or infinity: those are `null`, as serde_json writes them. `Debug`
    /// keeps a float a float (`1.0`, not `1`) and uses an exponent for large magnitudes.
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.member(field, |out| {
            if value.is_finite() {
                write!(out, "{value:?}")
            } else {
                out.write_str("null")
            }
        });
    }
}

/// The names of the fields a record holds.
#[derive(Default)]
struct FieldNames(Vec<&'static str>);

impl Visit for FieldNames {
    fn record_debug(&mut self, field: &Field, _: &dyn fmt::Debug) {
        self.0.push(field.name());
    }
}

/// Whether the object text `object` holds the key `name`: every quote inside a value is
/// escaped, so `"name":` can only be a key.
fn holds_key(object: &str, name: &str) -> bool {
    let mut quoted = String::with_capacity(name.len() + 3);
    let _ = string(&mut quoted, name);
    quoted.push(':');
    object.contains(&quoted)
}

/// Records `record`'s values into the stored object, replacing those it already holds (rare:
/// a field recorded twice).
fn rebuild(stored: &mut String, record: &span::Record<'_>) -> fmt::Result {
    let mut fresh = String::new();
    let mut object = Object::open(&mut fresh)?;
    record.record(&mut object);
    object.close()?;
    let parse =
        |text: &str| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text);
    let mut members = parse(stored).map_err(|_| fmt::Error)?;
    members.extend(parse(&fresh).map_err(|_| fmt::Error)?);
    *stored = serde_json::Value::Object(members).to_string();
    Ok(())
}

/// Writes `s` as a JSON string, quotes included.
fn string<W: Write + ?Sized>(out: &mut W, s: &str) -> fmt::Result {
    out.write_char('"')?;
    escape(out, s)?;
    out.write_char('"')
}

/// Writes `s` escaped for the inside of a JSON string: the quote, the backslash and the C0
/// control characters, as serde_json escapes them (so no value can end its line, and ESC
/// never reaches a terminal raw).
fn escape<W: Write + ?Sized>(out: &mut W, s: &str) -> fmt::Result {
    let mut from = 0;
    for (i, b) in s.bytes().enumerate() {
        let short = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0..=0x1f => "",
            _ => continue,
        };
        // Every escaped byte is ASCII, so `i` is a character boundary.
        out.write_str(&s[from..i])?;
        if short.is_empty() {
            write!(out, "\\u{b:04x}")?;
        } else {
            out.write_str(short)?;
        }
        from = i + 1;
    }
    out.write_str(&s[from..])
}

/// Escapes what is written through it (a `Debug` value formatted straight into a line).
struct Escaped<'a, W: Write + ?Sized>(&'a mut W);

impl<W: Write + ?Sized> Write for Escaped<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        escape(self.0, s)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use serde_json::Value;
    use tracing_subscriber::{fmt, prelude::*};

    use super::*;

    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> fmt::MakeWriter<'a> for Lines {
        type Writer = Lines;

        fn make_writer(&'a self) -> Lines {
            self.clone()
        }
    }

    /// The format under test, writing to `lines`.
    fn our_format<S>(lines: &Lines) -> impl tracing_subscriber::Layer<S>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        fmt::layer()
            .fmt_fields(JsonSpanFields)
            .event_format(JsonLines)
            .with_writer(lines.clone())
    }

    impl Lines {
        /// Each line parsed, its timestamp checked and taken out (two formats cannot share an
        /// instant).
        fn parsed(&self) -> Vec<Value> {
            let bytes = self.0.lock().unwrap().clone();
            String::from_utf8(bytes)
                .unwrap()
                .lines()
                .map(|line| {
                    let mut v: Value = serde_json::from_str(line)
                        .unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                    let ts = v.as_object_mut().unwrap().remove("timestamp");
                    assert!(
                        ts.as_ref()
                            .and_then(Value::as_str)
                            .is_some_and(|t| t.ends_with('Z')),
                        "an RFC 3339 UTC timestamp: {ts:?}"
                    );
                    v
                })
                .collect()
        }
    }

    #[derive(Debug)]
    #[allow(dead_code)]
    struct Thing {
        name: &'static str,
        n: u32,
    }

    /// Every kind of field, in spans and events, with recorded-later and recorded-twice span
    /// fields, and text that needs escaping.
    fn log_everything() {
        let awkward = "quote \" backslash \\ newline \n tab \t bell \u{7} esc \u{1b}[31m é 🦀";
        let outer = tracing::info_span!(
            "outer",
            run_id = "r-1",
            trace_id = tracing::field::Empty,
            n = 7u64,
        );
        let _o = outer.enter();
        outer.record("trace_id", "abc123");
        outer.record("n", 8u64);
        let inner = tracing::info_span!("inner", r#type = "x", text = awkward, ok = true);
        inner.record("ok", false);
        inner.record("text", "replaced, \"quoted\"");
        let _i = inner.enter();
        tracing::info!(
            i = -3i64,
            u = 4u64,
            f = 1.0f64,
            big = 1e300f64,
            nan = f64::NAN,
            b = true,
            thing = ?Thing { name: "a\"b", n: 2 },
            shown = %"display \n value",
            err = &std::io::Error::other("disk on fire") as &(dyn std::error::Error + 'static),
            "a message with {} and {awkward}",
            "args"
        );
        drop(_i);
        let empty = tracing::info_span!("empty");
        tracing::warn!(parent: &empty, "explicit parent");
        let late = tracing::info_span!("late", id = tracing::field::Empty);
        late.record("id", 5u64);
        tracing::info!(parent: &late, "fields recorded after an empty start");
        drop(_o);
        tracing::error!(r#type = "no span here", "outside");
    }

    #[test]
    fn lines_read_as_tracing_subscribers_own_json_format_reads() {
        let ours = Lines::default();
        let theirs = Lines::default();
        let subscriber = tracing_subscriber::registry().with(our_format(&ours)).with(
            fmt::layer()
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_writer(theirs.clone()),
        );
        tracing::subscriber::with_default(subscriber, log_everything);

        let (mut ours, mut theirs) = (ours.parsed(), theirs.parsed());
        assert_eq!(ours.len(), 4, "{ours:#?}");
        // One deliberate difference: an event with an explicit parent lists that parent's
        // scope, where tracing-subscriber lists the entered spans (which need not hold it).
        let explicit = ours[1].as_object_mut().unwrap().remove("spans").unwrap();
        assert_eq!(
            explicit,
            serde_json::json!([
                {"name": "outer", "run_id": "r-1", "trace_id": "abc123", "n": 8},
                {"name": "empty"}
            ])
        );
        theirs[1].as_object_mut().unwrap().remove("spans");
        ours[2].as_object_mut().unwrap().remove("spans");
        theirs[2].as_object_mut().unwrap().remove("spans");
        assert_eq!(ours, theirs);
        // And what matters about them, said plainly.
        let first = &ours[0];
        assert_eq!(first["level"], "INFO");
        assert_eq!(first["span"]["name"], "inner");
        assert_eq!(first["span"]["type"], "x");
        assert_eq!(first["span"]["ok"], false);
        assert_eq!(first["span"]["text"], "replaced, \"quoted\"");
        assert_eq!(first["spans"][0]["trace_id"], "abc123");
        assert_eq!(first["spans"][0]["n"], 8);
        assert_eq!(first["f"].as_f64(), Some(1.0));
        assert!(first["f"].is_f64(), "a float stays a float");
        assert_eq!(first["nan"], Value::Null);
        assert_eq!(first["err"], "disk on fire");
        assert!(
            first["message"]
                .as_str()
                .unwrap()
                .ends_with("esc \u{1b}[31m é 🦀"),
            "{}",
            first["message"]
        );
        assert_eq!(ours[1]["span"]["name"], "empty");
        assert_eq!(
            ours[2]["span"],
            serde_json::json!({"name": "late", "id": 5})
        );
        assert!(ours[3].get("span").is_none() && ours[3].get("spans").is_none());
    }

    struct Unprintable;

    impl std::fmt::Debug for Unprintable {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            Err(std::fmt::Error)
        }
    }

    #[test]
    fn a_value_that_fails_to_format_leaves_its_line_and_its_span_intact() {
        let lines = Lines::default();
        let subscriber = tracing_subscriber::registry().with(our_format(&lines));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("s", a = 1u64, b = tracing::field::Empty);
            span.record("b", tracing::field::debug(Unprintable));
            let _e = span.enter();
            tracing::info!(v = ?Unprintable, "after");
        });
        let lines = lines.parsed();
        assert_eq!(lines.len(), 1, "{lines:#?}");
        assert_eq!(lines[0]["v"], " [formatting this value failed]");
        assert_eq!(lines[0]["span"]["a"], 1);
        assert_eq!(lines[0]["span"]["b"], " [formatting this value failed]");
    }

    #[test]
    fn no_value_can_break_a_line_or_reach_a_terminal_raw() {
        let mut out = String::new();
        string(&mut out, "a\nb\rc\u{1b}d\u{0}e\"f\\g").unwrap();
        assert_eq!(out, r#""a\nb\rc\u001bd\u0000e\"f\\g""#);
        assert!(!out.contains('\n') && !out.contains('\u{1b}'));
    }
}
