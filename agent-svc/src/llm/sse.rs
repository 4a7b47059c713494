//! Server-sent events from a streaming HTTP response (eventsource-stream), plus the shared
//! handling of an error response before the stream starts.

use std::time::Duration;

use eventsource_stream::Eventsource;
use futures_util::{Stream, StreamExt};

use super::ModelError;

/// Largest error body read from a provider: enough for its message, never a whole dump.
const MAX_ERROR_BODY: usize = 8 << 10;

/// Checks the status, then yields (event name, data) pairs.
pub async fn events(
    response: reqwest::Response,
) -> Result<impl Stream<Item = Result<(String, String), ModelError>>, ModelError> {
    let status = response.status();
    if !status.is_success() {
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = read_capped(response, MAX_ERROR_BODY).await;
        return Err(ModelError::Status {
            status: status.as_u16(),
            detail: error_message(&body),
            retry_after,
        });
    }
    Ok(response
        .bytes_stream()
        .eventsource()
        .map(|event| match event {
            Ok(e) => Ok((e.event, e.data)),
            Err(eventsource_stream::EventStreamError::Transport(e)) => {
                Err(ModelError::from_reqwest(&e))
            }
            Err(e) => Err(ModelError::Decode(e.to_string())),
        }))
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
