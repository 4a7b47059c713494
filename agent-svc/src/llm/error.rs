//! Model-call errors, classified once (E-6, S4 fix 2): what is worth retrying and for how long.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// The provider answered with an error status. What it said is never shown to users (it
    /// can echo keys or prompt text): they see the status's meaning; logs see `detail`.
    #[error("HTTP {status} ({})", meaning(*status))]
    Status {
        status: u16,
        /// A redacted excerpt of the provider's message, for logs only.
        detail: String,
        retry_after: Option<Duration>,
    },
    #[error("the call timed out")]
    Timeout,
    #[error("the connection failed: {0}")]
    Connection(String),
    /// The stream ended before the provider said it was done.
    #[error("the response stream was cut off")]
    TruncatedStream,
    /// The provider sent something this adapter cannot read.
    #[error("unreadable response: {0}")]
    Decode(String),
    /// The model set out to call a tool and produced nothing usable (Gemini's
    /// `MALFORMED_FUNCTION_CALL`): asked again, it usually manages.
    #[error("the model produced a tool call it could not finish ({0})")]
    MalformedCall(String),
    /// The provider is not configured (no key, no URL).
    #[error("not configured: {0}")]
    NotConfigured(String),
}

/// What an error status means, in words a user can read.
fn meaning(status: u16) -> &'static str {
    match status {
        400 | 422 => "the provider rejected the request",
        401 => "the provider rejected the API key",
        403 => "the provider refused access",
        404 => "the model or endpoint was not found",
        408 => "the provider timed out",
        413 => "the request was too large for the provider",
        429 => "rate limited by the provider",
        500..=599 => "the provider had a server error",
        _ => "the provider refused the call",
    }
}

impl ModelError {
    /// The provider's own words (redacted) when it sent any: for a log line, never for users.
    pub fn detail(&self) -> &str {
        match self {
            ModelError::Status { detail, .. } => detail,
            _ => "",
        }
    }

    /// 408, 429, 500, 502, 503, 504, 529 (Anthropic's "overloaded"), timeouts, connection
    /// errors and cut-off streams may succeed on a retry; 400, 401, 403, 404 and the rest will
    /// not. 500 is retriable because local model servers answer malformed tool-call JSON with it
    /// (S4 failure mode 6).
    pub fn is_retriable(&self) -> bool {
        match self {
            ModelError::Status { status, .. } => {
                matches!(status, 408 | 429 | 500 | 502 | 503 | 504 | 529)
            }
            ModelError::Timeout
            | ModelError::Connection(_)
            | ModelError::TruncatedStream
            | ModelError::MalformedCall(_) => true,
            ModelError::Decode(_) | ModelError::NotConfigured(_) => false,
        }
    }

    /// Whether the provider may have billed the try: it took the request and started on it
    /// (a timeout, a cut stream, a call it could not finish). An error status or a failed
    /// connection was not billed.
    pub fn may_be_billed(&self) -> bool {
        matches!(
            self,
            ModelError::Timeout | ModelError::TruncatedStream | ModelError::MalformedCall(_)
        )
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ModelError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    pub fn from_reqwest(e: &reqwest::Error) -> Self {
        // A connect timeout is both: it never reached the provider, so it was not billed.
        if e.is_connect() {
            ModelError::Connection("connect failed".into())
        } else if e.is_timeout() {
            ModelError::Timeout
        } else if e.is_decode() || e.is_body() {
            ModelError::TruncatedStream
        } else {
            ModelError::Connection("request failed".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(s: u16) -> ModelError {
        ModelError::Status {
            status: s,
            detail: String::new(),
            retry_after: None,
        }
    }

    #[test]
    fn a_status_error_shows_its_meaning_never_the_provider_words() {
        let e = ModelError::Status {
            status: 400,
            detail: "bad key sk-live-123".into(),
            retry_after: None,
        };
        assert_eq!(
            e.to_string(),
            "HTTP 400 (the provider rejected the request)"
        );
        assert_eq!(e.detail(), "bad key sk-live-123");
    }

    #[test]
    fn retriable_statuses_are_exactly_the_transient_ones() {
        for s in [408, 429, 500, 502, 503, 504, 529] {
            assert!(status(s).is_retriable(), "{s}");
        }
        for s in [400, 401, 403, 404, 422] {
            assert!(!status(s).is_retriable(), "{s}");
        }
        assert!(ModelError::Timeout.is_retriable());
        assert!(ModelError::TruncatedStream.is_retriable());
        assert!(!ModelError::Decode("x".into()).is_retriable());
    }
}
