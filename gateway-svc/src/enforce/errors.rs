//! Error-to-string (G-4): every tool-level failure becomes an `ErrorKind` plus a plain sentence
//! that tells the model what happened and what it can do. None of these is an RPC error.

use std::time::Duration;

use crate::domain::{ErrorKind, Integration};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolError {
    #[error("Invalid arguments for {tool}: {detail}. Fix the arguments and call {tool} again.")]
    InvalidArguments { tool: String, detail: String },
    #[error("There is no tool named {0:?}. Use only the tools you were given.")]
    UnknownTool(String),
    #[error("{0}")]
    NotFound(String),
    /// Our own per-user limit (G-6): the exact text of S0 AC-06.
    #[error("{service} rate limit reached ({limit}/{window}). Try again in {} seconds.", retry_after.as_secs().max(1))]
    RateLimited {
        service: &'static str,
        limit: u32,
        window: &'static str,
        retry_after: Duration,
    },
    /// One call that costs more than a whole window allows can never succeed as asked.
    #[error(
        "This {service} request needs {cost} API calls but the limit is {limit}/{window}; ask for fewer results."
    )]
    OverBudget {
        service: &'static str,
        cost: u32,
        limit: u32,
        window: &'static str,
    },
    /// The upstream's own 429 (G-7).
    #[error("{service} is rate limiting requests. Try again in {} seconds.", retry_after.as_secs().max(1))]
    UpstreamRateLimited {
        service: &'static str,
        retry_after: Duration,
    },
    #[error(
        "No {} account is connected. Tell the user to connect one; do not retry.", integration.label()
    )]
    CredentialsMissing { integration: Integration },
    #[error("Your {provider} {} to be reconnected.", accounts_need(accounts))]
    CredentialsRevoked {
        provider: &'static str,
        /// One account, or several (every one that needs reconnecting).
        accounts: Vec<String>,
    },
    #[error("{service} refused the request for {account}: {detail}")]
    PermissionDenied {
        service: &'static str,
        account: String,
        detail: String,
    },
    #[error(
        "{service} returned an error (HTTP {status}){}. It may work if tried again later.",
        detail_suffix(detail)
    )]
    Upstream {
        service: &'static str,
        status: u16,
        detail: String,
    },
    /// The upstream refused this request as it is (a 4xx other than 401/403/404/429): sent
    /// again unchanged it fails again.
    #[error(
        "{service} rejected the request (HTTP {status}{reason}). Sending it again unchanged will fail the same way; change the request or tell the user."
    )]
    UpstreamRejected {
        service: &'static str,
        status: u16,
        /// The upstream's machine reason as ", word", or empty.
        reason: String,
    },
    /// A tool of another server (MCP) answered that the call failed, in its own words.
    #[error("{service} reported that the call failed: {detail}")]
    RemoteTool {
        service: &'static str,
        detail: String,
    },
    #[error("{service} sent a response that could not be read ({detail}).")]
    UpstreamGarbage {
        service: &'static str,
        detail: String,
    },
    #[error("{service} did not answer within {} seconds. Try again later or narrow the request.", after.as_secs().max(1))]
    UpstreamTimeout {
        service: &'static str,
        after: Duration,
    },
    #[error("{service} could not be reached ({detail}). Try again later.")]
    UpstreamUnavailable {
        service: &'static str,
        detail: String,
    },
    /// The account's access is being renewed by another replica and was not ready in time.
    #[error("{provider} sign-in is being renewed; try again in a few seconds.")]
    SignInRenewing { provider: &'static str },
    #[error("The call was cancelled before it finished.")]
    Cancelled,
    /// The call carried the binding of an approved preview and what it would do now differs
    /// (issue 14): nothing was done.
    #[error("Not done: {0} since the user approved it. Ask the user to approve it again.")]
    ChangedSinceApproval(String),
    #[error("The tool failed unexpectedly ({0}). Try again later.")]
    Internal(String),
    /// Steward's own storage refused what the call would store, for good (a constraint, a
    /// limit): waiting does not help, unlike [`ToolError::Internal`].
    #[error(
        "The tool's storage refused this ({0}). Sending it again unchanged will fail the same way; change the request or tell the user."
    )]
    StorageRefused(String),
    /// A side effect interrupted after its request reached upstream: it may have acted, so it
    /// must not be retried as if it had not (R-3, P-4).
    #[error(
        "{what} after its request reached {service}, so it may have taken effect. Do not repeat it; tell the user it is unconfirmed."
    )]
    MayHaveActed {
        service: &'static str,
        /// What interrupted it, as the start of a sentence.
        what: String,
        kind: ErrorKind,
    },
    /// A side effect whose write the upstream accepted (2xx) ran out of time before it could
    /// finish: it was done, though what came back is unknown.
    #[error(
        "{service} accepted the request, but the call did not finish within {} seconds. It has taken effect: do not repeat it; tell the user it was done and its details are unconfirmed.",
        after.as_secs().max(1)
    )]
    AcceptedUnfinished {
        service: &'static str,
        after: Duration,
    },
    /// What another party wrote (a header of the email replied to) keeps the tool from doing
    /// what was asked: the arguments are fine, so the same call fails the same way. The
    /// sentence says what to do instead, and quotes what the other party wrote (escaped and
    /// clipped), so it carries external words and is fenced as data.
    #[error("Not done: {0}")]
    NotDoable(String),
    /// Another call with the same idempotency key is still running.
    #[error("{0}")]
    KeyInUse(String),
}

/// `code` when it is a machine word (an upstream's error code or reason from a fixed
/// vocabulary: 1 to 40 ASCII letters or `_`), the only part of an upstream's error that may be
/// repeated to the model; `None` for free text, which stays in the log.
pub fn code_word(code: &str) -> Option<&str> {
    (!code.is_empty()
        && code.len() <= 40
        && code.bytes().all(|b| b.is_ascii_alphabetic() || b == b'_'))
    .then_some(code)
}

/// "account a needs", or `accounts "a", "b" need` for several, each name quoted so that one
/// holding ", " (a Slack workspace "Acme, Inc") reads as one account.
fn accounts_need(accounts: &[String]) -> String {
    match accounts {
        [one] => format!("account {one} needs"),
        many => format!("accounts {} need", crate::registry::quoted_list(many)),
    }
}

fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(": {detail}")
    }
}

impl ToolError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ToolError::InvalidArguments { .. } | ToolError::NotDoable(_) => {
                ErrorKind::InvalidArguments
            }
            ToolError::UnknownTool(_) => ErrorKind::UnknownTool,
            ToolError::NotFound(_) => ErrorKind::NotFound,
            ToolError::RateLimited { .. }
            | ToolError::OverBudget { .. }
            | ToolError::UpstreamRateLimited { .. } => ErrorKind::RateLimited,
            ToolError::CredentialsMissing { .. } => ErrorKind::CredentialsMissing,
            ToolError::CredentialsRevoked { .. } => ErrorKind::CredentialsRevoked,
            ToolError::PermissionDenied { .. } => ErrorKind::PermissionDenied,
            ToolError::Upstream { .. }
            | ToolError::UpstreamRejected { .. }
            | ToolError::UpstreamGarbage { .. }
            | ToolError::RemoteTool { .. } => ErrorKind::UpstreamError,
            ToolError::UpstreamTimeout { .. } | ToolError::AcceptedUnfinished { .. } => {
                ErrorKind::UpstreamTimeout
            }
            ToolError::UpstreamUnavailable { .. } | ToolError::SignInRenewing { .. } => {
                ErrorKind::UpstreamUnavailable
            }
            ToolError::Cancelled => ErrorKind::Cancelled,
            ToolError::ChangedSinceApproval(_) => ErrorKind::ChangedSinceApproval,
            ToolError::Internal(_) | ToolError::StorageRefused(_) | ToolError::KeyInUse(_) => {
                ErrorKind::Internal
            }
            ToolError::MayHaveActed { kind, .. } => *kind,
        }
    }

    /// Seconds until a retry can succeed, for rate limits; 0 otherwise.
    pub fn retry_after_secs(&self) -> u32 {
        match self {
            ToolError::RateLimited { retry_after, .. }
            | ToolError::UpstreamRateLimited { retry_after, .. } => {
                u32::try_from(retry_after.as_secs().max(1)).unwrap_or(u32::MAX)
            }
            _ => 0,
        }
    }

    /// The sentence carries words another party wrote (an MCP server's own account of its
    /// failure, an entry of an email's header), so the agent must treat it as data, not as
    /// Steward's instruction (P-1).
    pub fn carries_external_words(&self) -> bool {
        matches!(self, ToolError::RemoteTool { .. } | ToolError::NotDoable(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_limit_sentence_matches_the_spec_exactly() {
        let e = ToolError::RateLimited {
            service: "Gmail",
            limit: 30,
            window: "minute",
            retry_after: Duration::from_secs(42),
        };
        assert_eq!(
            e.to_string(),
            "Gmail rate limit reached (30/minute). Try again in 42 seconds."
        );
        assert_eq!(e.kind(), ErrorKind::RateLimited);
        assert_eq!(e.retry_after_secs(), 42);
    }

    #[test]
    fn an_interrupted_side_effect_says_it_may_have_acted_and_keeps_its_kind() {
        let e = ToolError::MayHaveActed {
            service: "Gmail",
            what: "The call was cancelled".into(),
            kind: ErrorKind::Cancelled,
        };
        assert_eq!(
            e.to_string(),
            "The call was cancelled after its request reached Gmail, so it may have taken effect. \
             Do not repeat it; tell the user it is unconfirmed."
        );
        assert_eq!(e.kind(), ErrorKind::Cancelled);
    }

    #[test]
    fn u1_a_refusal_quoting_another_partys_header_carries_external_words_and_ours_do_not() {
        assert!(
            ToolError::NotDoable("the From header holds \"x\"".into()).carries_external_words()
        );
        assert!(
            !ToolError::InvalidArguments {
                tool: "gmail_reply".into(),
                detail: "no body".into()
            }
            .carries_external_words()
        );
    }

    #[test]
    fn a_revoked_account_names_the_account() {
        let e = ToolError::CredentialsRevoked {
            provider: "Google",
            accounts: vec!["x@y.com".into()],
        };
        assert_eq!(
            e.to_string(),
            "Your Google account x@y.com needs to be reconnected."
        );
    }

    #[test]
    fn sub_second_waits_round_up_to_one_second() {
        let e = ToolError::UpstreamRateLimited {
            service: "Slack",
            retry_after: Duration::from_millis(300),
        };
        assert_eq!(
            e.to_string(),
            "Slack is rate limiting requests. Try again in 1 seconds."
        );
        assert_eq!(e.retry_after_secs(), 1);
    }
}
