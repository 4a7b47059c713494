//! Server-sent events from a streaming HTTP response, plus the shared handling of an error
//! response before the stream starts.
//!
//! The parser is our own: eventsource-stream ran a nom parser per line and copied the rest of
//! its buffer after every line, ~5K instructions per chunk of a model's stream, a tenth of
//! agent-svc's instructions per run under load (issue 13). This one scans each chunk once.

use std::collections::VecDeque;
use std::time::Duration;

use futures_util::{Stream, StreamExt};

use super::ModelError;

/// Largest error body read from a provider: enough for its message, never a whole dump.
const MAX_ERROR_BODY: usize = 8 << 10;

/// Longest line, and largest event, of an event stream. A provider's events are a chunk of
/// JSON each; a line that never ends, or data lines that never reach a blank line, are an
/// error, not a buffer that grows until the process dies.
const MAX_LINE: usize = 16 << 20;

/// The UTF-8 byte order mark, which may open a stream.
const BOM: &[u8] = "\u{feff}".as_bytes();

/// One dispatched event: (event name, data).
pub type Event = (String, String);

/// Checks the status, then yields (event name, data) pairs.
pub async fn events(
    response: reqwest::Response,
) -> Result<impl Stream<Item = Result<Event, ModelError>>, ModelError> {
    let status = response.status();
    if !status.is_success() {
        let header = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(svc_kit::retry_after::parse);
        let body = read_capped(response, MAX_ERROR_BODY).await;
        return Err(ModelError::Status {
            status: status.as_u16(),
            detail: error_message(&body),
            retry_after: header.or_else(|| retry_delay(&body)),
        });
    }
    let body = Box::pin(response.bytes_stream());
    let state = (body, Parser::default(), VecDeque::new(), false);
    Ok(futures_util::stream::unfold(
        state,
        |(mut body, mut parser, mut ready, mut ended)| async move {
            loop {
                if let Some(item) = ready.pop_front() {
                    return Some((item, (body, parser, ready, ended)));
                }
                if ended {
                    return None;
                }
                match body.next().await {
                    Some(Ok(chunk)) => {
                        if let Err(e) = parser.feed(&chunk, |event| ready.push_back(Ok(event))) {
                            ready.push_back(Err(e));
                            ended = true;
                        }
                    }
                    Some(Err(e)) => {
                        ready.push_back(Err(ModelError::from_reqwest(&e)));
                        ended = true;
                    }
                    // An event the stream did not finish with a blank line is dropped, as the
                    // standard says.
                    None => ended = true,
                }
            }
        },
    ))
}

/// The event-stream format of the WHATWG HTML standard ("Server-sent events"): lines end with
/// CRLF, LF or CR; a blank line dispatches the event; `event` names it, each `data` line adds
/// to it, a line starting with `:` is a comment; `id` and `retry` mean nothing to a
/// request that is never resumed and are ignored.
#[derive(Default)]
pub struct Parser {
    /// The start of a line that has not ended yet (before the stream has started: its first
    /// bytes, while they may still be a BOM's).
    partial: Vec<u8>,
    /// The last chunk ended in CR: an LF starting the next one belongs to that line end.
    after_cr: bool,
    started: bool,
    event: String,
    data: String,
    has_data: bool,
}

/// The error for a line past [`MAX_LINE`], wherever it is noticed.
fn line_too_long() -> ModelError {
    ModelError::Decode(format!(
        "the model's event stream sent a line longer than {MAX_LINE} bytes"
    ))
}

impl Parser {
    /// Parses one chunk, calling `dispatch` for every event it completes. An error (a line
    /// that is not UTF-8, a line or an event larger than [`MAX_LINE`]) ends the stream.
    pub fn feed(
        &mut self,
        chunk: &[u8],
        mut dispatch: impl FnMut(Event),
    ) -> Result<(), ModelError> {
        if !self.started {
            // The stream's first bytes wait until they show whether they are a BOM, which
            // may come split across chunks.
            let mut head = std::mem::take(&mut self.partial);
            head.extend_from_slice(chunk);
            if head.len() < BOM.len() && BOM.starts_with(&head) {
                self.partial = head;
                return Ok(());
            }
            self.started = true;
            return self.feed(head.strip_prefix(BOM).unwrap_or(&head), dispatch);
        }
        let mut rest = chunk;
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            rest = rest.strip_prefix(b"\n").unwrap_or(rest);
        }
        while let Some(end) = memchr::memchr2(b'\n', b'\r', rest) {
            let line = &rest[..end];
            let cr = rest[end] == b'\r';
            let crlf = cr && rest.get(end + 1) == Some(&b'\n');
            // A CR that ends the chunk may be the first half of a CRLF.
            self.after_cr = cr && end + 1 == rest.len();
            rest = &rest[end + 1 + usize::from(crlf)..];
            if self.partial.is_empty() {
                self.line(line, &mut dispatch)?;
            } else {
                let mut whole = std::mem::take(&mut self.partial);
                whole.extend_from_slice(line);
                self.line(&whole, &mut dispatch)?;
                whole.clear();
                self.partial = whole;
            }
        }
        if self.partial.len() + rest.len() > MAX_LINE {
            return Err(line_too_long());
        }
        self.partial.extend_from_slice(rest);
        Ok(())
    }

    fn line(&mut self, line: &[u8], dispatch: &mut impl FnMut(Event)) -> Result<(), ModelError> {
        if line.len() > MAX_LINE {
            return Err(line_too_long());
        }
        if line.is_empty() {
            let event = std::mem::take(&mut self.event);
            if std::mem::take(&mut self.has_data) {
                let data = std::mem::take(&mut self.data);
                let name = if event.is_empty() {
                    "message".to_owned()
                } else {
                    event
                };
                dispatch((name, data));
            }
            return Ok(());
        }
        let line = std::str::from_utf8(line).map_err(|e| {
            ModelError::Decode(format!("the model's event stream is not UTF-8: {e}"))
        })?;
        let (field, value) = match line.split_once(':') {
            Some(("", _)) => return Ok(()),
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "event" => value.clone_into(&mut self.event),
            "data" => {
                if self.data.len() + value.len() >= MAX_LINE {
                    return Err(ModelError::Decode(format!(
                        "the model's event stream sent an event larger than {MAX_LINE} bytes"
                    )));
                }
                if std::mem::replace(&mut self.has_data, true) {
                    self.data.push('\n');
                }
                self.data.push_str(value);
            }
            _ => {}
        }
        Ok(())
    }
}

/// At most `cap` bytes of a body, chunk by chunk: a huge error body is never read whole.
async fn read_capped(mut response: reqwest::Response, cap: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < cap {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk[..chunk.len().min(cap - body.len())]),
            Ok(None) | Err(_) => break,
        }
    }
    body
}

/// The provider's error message (`{"error": {"message": ...}}` for all three) as a redacted
/// excerpt for logs.
/// The wait an error body asks for where there is no `Retry-After` header: Gemini puts it in
/// the error's `google.rpc.RetryInfo` detail as a duration string ("37s", "0.5s").
fn retry_delay(body: &[u8]) -> Option<Duration> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.pointer("/error/details")?
        .as_array()?
        .iter()
        .find_map(|d| d["retryDelay"].as_str())
        .and_then(|s| s.strip_suffix('s'))
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|secs| secs.is_finite() && *secs >= 0.0)
        .map(|secs| Duration::from_secs_f64(secs.min(86_400.0)))
}

pub fn error_message(body: &[u8]) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let message = parsed
        .as_ref()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.pointer("/message"))
        })
        .and_then(|m| m.as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    svc_kit::text::redacted_excerpt(&message, 200)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(chunks: &[&[u8]]) -> Result<Vec<Event>, ModelError> {
        let mut parser = Parser::default();
        let mut events = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, |e| events.push(e))?;
        }
        Ok(events)
    }

    #[test]
    fn e6_geminis_retry_delay_in_the_error_body_is_the_wait_it_asks_for() {
        let body = br#"{"error":{"code":429,"message":"Resource exhausted","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure"},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"37s"}]}}"#;
        assert_eq!(retry_delay(body), Some(Duration::from_secs(37)));
        let half = br#"{"error":{"details":[{"retryDelay":"0.5s"}]}}"#;
        assert_eq!(retry_delay(half), Some(Duration::from_millis(500)));
        for none in [
            &br#"{"error":{"message":"x"}}"#[..],
            br#"{"error":{"details":[{"retryDelay":"-1s"}]}}"#,
            br#"{"error":{"details":[{"retryDelay":"soon"}]}}"#,
            b"not json",
        ] {
            assert_eq!(retry_delay(none), None);
        }
    }

    fn event(name: &str, data: &str) -> Event {
        (name.to_owned(), data.to_owned())
    }

    const STREAM: &str = "\u{feff}: keep-alive\r\n\
        event: message_start\r\ndata: {\"a\":1}\r\n\r\n\
        data: first\ndata:second\n\n\
        event: ignored, it has no data\n\n\
        data: é ✓\rid: 7\rretry: 10\r\r\
        data\n\n";

    #[test]
    fn events_come_out_the_same_however_the_stream_is_cut() {
        let want = vec![
            event("message_start", "{\"a\":1}"),
            event("message", "first\nsecond"),
            event("message", "é ✓"),
            event("message", ""),
        ];
        let bytes = STREAM.as_bytes();
        assert_eq!(parse(&[bytes]).unwrap(), want, "one chunk");
        for at in 1..bytes.len() {
            let (a, b) = bytes.split_at(at);
            assert_eq!(parse(&[a, b]).unwrap(), want, "cut at byte {at}");
        }
        let bytewise: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(parse(&bytewise).unwrap(), want, "one byte per chunk");
    }

    #[test]
    fn a_crlf_split_by_an_empty_chunk_is_one_line_end() {
        assert_eq!(
            parse(&[b"data: a\r", b"", b"\ndata: b\n\n"]).unwrap(),
            vec![event("message", "a\nb")]
        );
    }

    #[test]
    fn a_bom_split_across_chunks_is_still_only_a_bom() {
        let want = vec![event("message", "x")];
        assert_eq!(
            parse(&[b"\xEF", b"", b"\xBB", b"\xBFdata: x\n\n"]).unwrap(),
            want
        );
        assert_eq!(
            parse(&[b"da", b"ta: x\n\n"]).unwrap(),
            want,
            "no BOM, a short first chunk"
        );
    }

    #[test]
    fn data_lines_that_never_end_their_event_are_an_error_not_a_growing_buffer() {
        let mut parser = Parser::default();
        let line = format!("data: {}\n", "x".repeat(1 << 20));
        let err = loop {
            if let Err(e) = parser.feed(line.as_bytes(), |_| panic!("nothing to dispatch")) {
                break e;
            }
            assert!(
                parser.data.len() <= MAX_LINE,
                "the event grew past the limit"
            );
        };
        assert!(
            matches!(&err, ModelError::Decode(m) if m.contains("larger than")),
            "{err:?}"
        );
    }

    #[test]
    fn an_event_the_stream_did_not_finish_is_not_dispatched() {
        assert_eq!(
            parse(&[b"data: done\n\ndata: cut off\n"]).unwrap(),
            vec![event("message", "done")]
        );
    }

    #[test]
    fn a_line_that_is_not_utf8_is_a_decode_error() {
        let err = parse(&[b"data: ok\n\ndata: \xff\xfe\n\n"]).unwrap_err();
        assert!(
            matches!(&err, ModelError::Decode(m) if m.contains("not UTF-8")),
            "{err:?}"
        );
    }

    #[test]
    fn a_line_that_never_ends_is_an_error_not_a_growing_buffer() {
        let mut parser = Parser::default();
        let chunk = vec![b'x'; 1 << 20];
        let mut fed = 0;
        let err = loop {
            match parser.feed(&chunk, |_| panic!("nothing to dispatch")) {
                Ok(()) => fed += chunk.len(),
                Err(e) => break e,
            }
            assert!(fed <= MAX_LINE, "the line grew past the limit");
        };
        assert!(
            matches!(&err, ModelError::Decode(m) if m.contains("longer than")),
            "{err:?}"
        );
    }
}
