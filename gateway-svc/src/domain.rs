//! The gateway's own vocabulary, independent of the wire format. `api/` converts proto to these
//! and back; nothing deeper sees a proto type.

use std::{fmt, time::Duration};

use serde::{Deserialize, Serialize};

/// The user a call acts for, taken from authenticated metadata (never from tool arguments).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct UserId(String);

impl UserId {
    pub const MAX_BYTES: usize = 128;

    /// A user id: 1 to 128 bytes of visible ASCII (what JWT subjects and UUIDs look like).
    pub fn parse(raw: &str) -> Result<Self, String> {
        if raw.is_empty() || raw.len() > Self::MAX_BYTES {
            return Err(format!("must be 1 to {} bytes", Self::MAX_BYTES));
        }
        if !raw.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("must be visible ASCII without spaces".into());
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Integration {
    Gmail,
    GoogleCalendar,
    Slack,
    Memory,
    Tasks,
    Reminders,
    /// A tool of a configured MCP server (issue 15); its limits count per user and server.
    Mcp,
}

/// Who issues the OAuth tokens of an integration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    Google,
    Slack,
}

impl Integration {
    pub const ALL: [Integration; 7] = [
        Integration::Gmail,
        Integration::GoogleCalendar,
        Integration::Slack,
        Integration::Memory,
        Integration::Tasks,
        Integration::Reminders,
        Integration::Mcp,
    ];

    /// The name users and models read.
    pub fn label(self) -> &'static str {
        match self {
            Integration::Gmail => "Gmail",
            Integration::GoogleCalendar => "Google Calendar",
            Integration::Slack => "Slack",
            Integration::Memory => "Memory",
            Integration::Tasks => "Tasks",
            Integration::Reminders => "Reminders",
            Integration::Mcp => "MCP",
        }
    }

    /// A stable key for storage and configuration.
    pub fn key(self) -> &'static str {
        match self {
            Integration::Gmail => "gmail",
            Integration::GoogleCalendar => "google_calendar",
            Integration::Slack => "slack",
            Integration::Memory => "memory",
            Integration::Tasks => "tasks",
            Integration::Reminders => "reminders",
            Integration::Mcp => "mcp",
        }
    }

    pub fn from_key(key: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|i| i.key() == key)
    }

    /// The token issuer, for integrations that need a connected account.
    pub fn provider(self) -> Option<Provider> {
        match self {
            Integration::Gmail | Integration::GoogleCalendar => Some(Provider::Google),
            Integration::Slack => Some(Provider::Slack),
            Integration::Memory
            | Integration::Tasks
            | Integration::Reminders
            | Integration::Mcp => None,
        }
    }
}

impl Provider {
    pub fn label(self) -> &'static str {
        match self {
            Provider::Google => "Google",
            Provider::Slack => "Slack",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Channel {
    #[default]
    Web,
    Telegram,
    SessionOpen,
    Scheduled,
    Heartbeat,
}

impl Channel {
    /// Web, Telegram and session opening are a person waiting; the rest are background.
    pub fn is_interactive(self) -> bool {
        matches!(
            self,
            Channel::Web | Channel::Telegram | Channel::SessionOpen
        )
    }
}

/// Why a tool call returned ok = false; mirrors the proto enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    InvalidArguments,
    UnknownTool,
    NotFound,
    RateLimited,
    CredentialsMissing,
    CredentialsRevoked,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
    Cancelled,
    PermissionDenied,
    Internal,
    ChangedSinceApproval,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArguments => "invalid_arguments",
            ErrorKind::UnknownTool => "unknown_tool",
            ErrorKind::NotFound => "not_found",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::CredentialsMissing => "credentials_missing",
            ErrorKind::CredentialsRevoked => "credentials_revoked",
            ErrorKind::UpstreamError => "upstream_error",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::UpstreamUnavailable => "upstream_unavailable",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::Internal => "internal",
            ErrorKind::ChangedSinceApproval => "changed_since_approval",
        }
    }
}

/// One tool call as the gateway receives it, after the API edge validated its shape.
#[derive(Debug, Clone)]
pub struct CallRequest {
    pub call_id: String,
    pub tool: String,
    pub args: serde_json::Value,
    pub idempotency_key: Option<String>,
    pub channel: Channel,
    pub timeout: Option<Duration>,
    pub run_id: Option<String>,
    /// Where the run had read others' words before this call (memory provenance).
    pub read_external_from: Vec<String>,
    /// The approved preview's binding; when set the call runs only if it still holds.
    pub expected_binding: Option<String>,
    /// The user's zone, when the run knows it: the result's dates and times are shown in it
    /// (else in UTC), and a local time the model writes is read in it (else refused).
    pub time_zone: Option<jiff::tz::TimeZone>,
}

/// What a tool call produced, success or failure: the model always gets a sentence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallOutcome {
    pub call_id: String,
    pub tool: String,
    pub error_kind: Option<ErrorKind>,
    pub text: String,
    pub truncated: bool,
    pub original_chars: u32,
    pub retry_after_secs: u32,
    pub display: Option<serde_json::Value>,
    pub upstream_calls: u32,
    pub account: Option<String>,
    pub latency: Duration,
    pub replayed: bool,
    /// The text carries words written by others (issue 14).
    #[serde(default)]
    pub external: bool,
}

impl CallOutcome {
    pub fn ok(&self) -> bool {
        self.error_kind.is_none()
    }
}

/// An MCP server (`tool: None`) or one of its tools, as the server names it: what a user can
/// turn off for themselves (issue 15).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct McpSwitch {
    pub server: String,
    pub tool: Option<String>,
}

impl McpSwitch {
    /// Whether this switch, when off, turns off `tool` of `server`.
    pub fn covers(&self, server: &str, tool: &str) -> bool {
        self.server == server && self.tool.as_deref().is_none_or(|t| t == tool)
    }
}
