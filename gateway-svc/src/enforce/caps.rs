//! Size caps (G-5, S4 fixes 3-4). Model-facing text is cut on a character boundary with a notice
//! the model can see; upstream bodies are read under a hard byte cap so no response can exhaust
//! memory.

pub use svc_kit::text::{Capped, cap_text};

/// A body larger than the cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("response larger than {limit} bytes")]
pub struct BodyTooLarge {
    pub limit: usize,
}

/// Reads a response body chunk by chunk, failing as soon as it passes `limit` bytes instead of
/// buffering whatever the upstream sends.
pub async fn read_capped(
    mut response: reqwest::Response,
    limit: usize,
) -> Result<Result<Vec<u8>, BodyTooLarge>, reqwest::Error> {
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Ok(Err(BodyTooLarge { limit }));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > limit {
            return Ok(Err(BodyTooLarge { limit }));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Ok(body))
}
