//! Model-call errors, classified once (E-6, S4 fix 2): what is worth retrying and for how long.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// The provider answered with an error status.
    #[error("HTTP {status}: {message}")]
    Status {
        status: u16,
        message: String,
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
    /// The provider is not configured (no key, no URL).
    #[error("not configured: {0}")]
    NotConfigured(String),
}

impl ModelError {
    /// 429, 500, 502, 503, 504, timeouts, connection errors and cut-off streams may succeed on
    /// a retry; 400, 401, 403, 404 and the rest will not. 500 is retriable because local model
    /// servers answer malformed tool-call JSON with it (S4 failure mode 6).
    pub fn is_retriable(&self) -> bool {
        match self {
            ModelError::Status { status, .. } => matches!(status, 429 | 500 | 502 | 503 | 504),
            ModelError::Timeout | ModelError::Connection(_) | ModelError::TruncatedStream => true,
            ModelError::Decode(_) | ModelError::NotConfigured(_) => false,
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ModelError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    pub fn from_reqwest(e: &reqwest::Error) -> Self {
        if e.is_timeout() {
            ModelError::Timeout
        } else if e.is_decode() || e.is_body() {
            ModelError::TruncatedStream
        } else {
            ModelError::Connection(if e.is_connect() {
                "connect failed".into()
            } else {
                "request failed".into()
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(s: u16) -> ModelError {
        ModelError::Status {
            status: s,
            message: String::new(),
            retry_after: None,
        }
    }

    #[test]
    fn retriable_statuses_are_exactly_the_transient_ones() {
        for s in [429, 500, 502, 503, 504] {
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
