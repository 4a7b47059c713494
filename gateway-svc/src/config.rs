//! gateway-svc configuration, loaded once from the environment and validated at start.

use std::{net::SocketAddr, time::Duration};

use svc_kit::{
    config::{ConfigErrors, Vars},
    server_config::ServerConfig,
};

use crate::{
    credentials::{cipher::TokenCipher, oauth::OAuthClient},
    domain::Integration,
    ratelimit::Limits,
};

pub const DEFAULT_LISTEN: &str = "0.0.0.0:50052";
pub const DEFAULT_GOOGLE_TOKEN_URL: &str = "https://oauth2.googleapis.com/token";

/// Where rate-limit counters live (`RATE_LIMIT_BACKEND`): in this process by default, as G-6
/// says; shared through PostgreSQL when chosen. Replicas sharing a database with counters in
/// memory each allow the whole limit: start-up warns, and the shipped manifests choose
/// `postgres`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateLimitBackendKind {
    /// In this process (the default): exact per replica.
    Memory,
    /// In PostgreSQL: exact across every replica.
    Postgres,
}

/// The batching audit writer for read-only calls (issue 13, `crate::audit`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditQueueConfig {
    /// `AUDIT_QUEUE_CAPACITY`: records that may wait for the writer; past this a call waits
    /// for space (backpressure, never a drop). Also the most a crash (SIGKILL, OOM) can lose.
    pub capacity: usize,
    /// `AUDIT_MAX_BATCH`: the most records one INSERT writes.
    pub max_batch: usize,
    /// A batch that failed transiently is retried after this, the pause doubling each time ...
    pub retry_first: Duration,
    /// ... up to this.
    pub retry_max: Duration,
    /// A full queue is warned about at most this often (every wait is counted in the metric).
    pub warn_every: Duration,
    /// On shutdown the writer has until the drain deadline (SHUTDOWN_DRAIN_TIMEOUT after the
    /// signal) to write what is queued, and at least this long after the calls drained, even
    /// with SHUTDOWN_DRAIN_TIMEOUT=0.
    pub flush_grace: Duration,
}

impl Default for AuditQueueConfig {
    fn default() -> Self {
        Self {
            capacity: 2048,
            max_batch: 256,
            retry_first: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
            warn_every: Duration::from_secs(10),
            flush_grace: Duration::from_secs(5),
        }
    }
}

/// How long the gateway keeps what only grows (`crate::retention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionConfig {
    /// `IDEMPOTENCY_RETENTION`: a settled (or long lapsed) idempotency key is deleted this
    /// long after it last changed. agent-svc retries a call within minutes (a lease taken
    /// over, an approval continued), so a week leaves a wide margin.
    pub idempotency: Duration,
    /// `AUDIT_RETENTION`: audit records older than this are deleted; `None` (unset or `off`,
    /// the default) keeps them forever. Deleting audit is the operator's compliance choice.
    pub audit: Option<Duration>,
}

impl RetentionConfig {
    /// Anything shorter could delete a key while a retry of its call may still come.
    pub const MIN: Duration = Duration::from_secs(3600);
    /// A bound only so that `now - retention` stays a real time.
    pub const MAX: Duration = Duration::from_secs(36_500 * 86_400);
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            idempotency: Duration::from_secs(7 * 86_400),
            audit: None,
        }
    }
}

fn load_retention(vars: &mut Vars<'_>) -> RetentionConfig {
    let default = RetentionConfig::default();
    let (min, max) = (RetentionConfig::MIN, RetentionConfig::MAX);
    RetentionConfig {
        idempotency: vars.duration_in("IDEMPOTENCY_RETENTION", default.idempotency, min, max),
        audit: vars.duration_or_off("AUDIT_RETENTION", default.audit, min, max),
    }
}

/// MCP (issue 15): the servers whose tools join the registry, and where the gateway's own
/// tools are served over MCP.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct McpConfig {
    /// `MCP_SERVERS`, with each server's `MCP_SERVER_HEADERS` entry.
    pub servers: Vec<McpServerConfig>,
    /// `MCP_LISTEN_ADDR`: where MCP clients reach the gateway's tools; `None` (unset) is off.
    pub listen_addr: Option<SocketAddr>,
    /// `MCP_ALLOWED_HOSTS`: the `Host` values the MCP endpoint accepts (DNS-rebinding
    /// protection); empty accepts any (`*`).
    pub allowed_hosts: Vec<String>,
    /// `MCP_CONNECT_TIMEOUT`: connecting and listing tools, and each health probe.
    pub connect_timeout: Duration,
    /// `MCP_RECONNECT_INTERVAL`: how often an unavailable server is tried again (and, while
    /// connected, how often it is probed).
    pub reconnect_interval: Duration,
}

/// One MCP server whose tools the gateway offers as `mcp__<name>__<tool>`.
#[derive(Debug, Clone, PartialEq)]
pub struct McpServerConfig {
    /// 1 to 24 of `a-z`, `0-9` and `-`: it becomes part of tool names, which model providers
    /// restrict to letters, digits, `_` and `-`.
    pub name: String,
    /// Its streamable HTTP endpoint, e.g. `https://docs.example.com/mcp`.
    pub url: String,
    /// Headers sent with every request (an `Authorization` bearer token, an API key), kept as
    /// secrets.
    pub headers: Vec<(String, svc_kit::secret::Secret)>,
}

impl McpServerConfig {
    pub const MAX_NAME: usize = 24;

    pub fn valid_name(name: &str) -> bool {
        (1..=Self::MAX_NAME).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    }
}

/// `MCP_SERVERS` (`name=url,…`) and `MCP_SERVER_HEADERS` (a JSON object: server name → header
/// name → value).
fn load_mcp_servers(vars: &mut Vars<'_>) -> Vec<McpServerConfig> {
    let mut servers: Vec<McpServerConfig> = Vec::new();
    for entry in vars
        .optional_string("MCP_SERVERS")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        let Some((name, url)) = entry.split_once('=') else {
            vars.error(
                "MCP_SERVERS",
                format!("{entry:?} is not name=url; use e.g. docs=https://docs.example.com/mcp"),
            );
            continue;
        };
        let (name, url) = (name.trim(), url.trim());
        if !McpServerConfig::valid_name(name) {
            vars.error(
                "MCP_SERVERS",
                format!(
                    "server name {name:?} must be 1 to {} of a-z, 0-9 and -",
                    McpServerConfig::MAX_NAME
                ),
            );
            continue;
        }
        match reqwest::Url::parse(url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => {}
            _ => {
                vars.error(
                    "MCP_SERVERS",
                    format!("the URL of {name:?}, {url:?}, is not an http(s) URL"),
                );
                continue;
            }
        }
        if servers.iter().any(|s| s.name == name) {
            vars.error("MCP_SERVERS", format!("server {name:?} is named twice"));
            continue;
        }
        servers.push(McpServerConfig {
            name: name.to_owned(),
            url: url.to_owned(),
            headers: Vec::new(),
        });
    }
    let Some(raw) = vars.optional_string("MCP_SERVER_HEADERS") else {
        return servers;
    };
    let parsed: Result<
        std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
        _,
    > = serde_json::from_str(&raw);
    let Ok(by_server) = parsed else {
        // Never echo the value: it holds secrets.
        vars.error(
            "MCP_SERVER_HEADERS",
            "is not a JSON object of server name → {header name: value}; e.g.              {\"docs\": {\"Authorization\": \"Bearer …\"}}",
        );
        return servers;
    };
    for (name, headers) in by_server {
        let Some(server) = servers.iter_mut().find(|s| s.name == name) else {
            vars.error(
                "MCP_SERVER_HEADERS",
                format!("names server {name:?}, which MCP_SERVERS does not list"),
            );
            continue;
        };
        for (header, value) in headers {
            let valid = http::HeaderName::try_from(header.as_str()).is_ok()
                && http::HeaderValue::try_from(value.as_str()).is_ok();
            if !valid {
                vars.error(
                    "MCP_SERVER_HEADERS",
                    format!("header {header:?} of server {name:?} is not a valid HTTP header"),
                );
                continue;
            }
            server.headers.push((header, value.into()));
        }
    }
    servers
}

/// How callers prove they are agent-svc (or an operator).
#[derive(Debug, Clone)]
pub enum CallerAuth {
    /// `authorization: Bearer <token>` must match.
    ServiceToken(svc_kit::secret::Secret),
    /// Opt-in for local runs only: any caller is trusted with the user id it names.
    InsecureDev,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub auth: CallerAuth,
    /// `MAX_TOOL_RESULT_CHARS`
    pub max_result_chars: usize,
    /// `UPSTREAM_MAX_BODY_BYTES`
    pub max_body_bytes: usize,
    /// `UPSTREAM_TIMEOUT`: one HTTP request upstream.
    pub upstream_timeout: Duration,
    /// `TOOL_CALL_TIMEOUT`: a whole tool call when the caller sets none.
    pub call_timeout: Duration,
    /// `TOOL_CALL_MAX_TIMEOUT`: the most a caller may ask for.
    pub call_max_timeout: Duration,
    pub rate_limit_backend: RateLimitBackendKind,
    /// `RATE_LIMITS_GMAIL`, `RATE_LIMITS_GOOGLE_CALENDAR`, `RATE_LIMITS_SLACK`.
    pub rate_limits: Vec<(Integration, Limits)>,
    /// `CREDENTIALS_KEY`, holding `CREDENTIALS_KEY_PREVIOUS` too when set.
    pub credentials_key: Option<TokenCipher>,
    /// `CREDENTIALS_REKEY`: move stored tokens from CREDENTIALS_KEY_PREVIOUS to
    /// CREDENTIALS_KEY in the background. Off unless set, and only with a previous key: in a
    /// rotation's first step (the old key current, the new one previous) it would move tokens
    /// the wrong way, so it is set in the last step alone.
    pub credentials_rekey: bool,
    /// `CREDENTIALS_REKEY_INTERVAL`: how often a replica walks while tokens may be left to
    /// move (its first walk at a random point of the first interval).
    pub credentials_rekey_interval: Duration,
    /// `GOOGLE_OAUTH_TOKEN_URL`, `GOOGLE_CLIENT_ID`, `GOOGLE_CLIENT_SECRET`
    pub google_oauth: Option<OAuthClient>,
    /// `GMAIL_API_BASE_URL`
    pub gmail_base_url: String,
    /// `GOOGLE_CALENDAR_API_BASE_URL`
    pub calendar_base_url: String,
    /// `SLACK_API_BASE_URL`
    pub slack_base_url: String,
    /// `BOOTSTRAP_SOURCE_TIMEOUT`: each bootstrap source's deadline.
    pub bootstrap_source_timeout: Duration,
    /// `BOOTSTRAP_CACHE_TTL`: how long a user's bootstrap context is reused; 0 disables.
    pub bootstrap_cache_ttl: Duration,
    /// `AUDIT_QUEUE_CAPACITY`, `AUDIT_MAX_BATCH`
    pub audit_queue: AuditQueueConfig,
    /// `IDEMPOTENCY_RETENTION`, `AUDIT_RETENTION`
    pub retention: RetentionConfig,
    pub mcp: McpConfig,
}

impl Config {
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::load(Vars::from_env())
    }

    pub fn load(mut vars: Vars<'_>) -> Result<Self, ConfigErrors> {
        let default_listen: SocketAddr = DEFAULT_LISTEN.parse().expect("constant address");
        let server = ServerConfig::load(&mut vars, "GATEWAY", default_listen);

        let insecure = vars.bool("GATEWAY_ALLOW_INSECURE_DEV_AUTH", false);
        let development = vars.bool("STEWARD_DEVELOPMENT", false);
        let auth = match (vars.optional_string("GATEWAY_SERVICE_TOKEN"), insecure) {
            (Some(token), _) if token.len() < 16 => {
                vars.error(
                    "GATEWAY_SERVICE_TOKEN",
                    "is shorter than 16 characters; use a long random secret",
                );
                CallerAuth::InsecureDev
            }
            (Some(token), _) => CallerAuth::ServiceToken(token.into()),
            (None, true) if !development => {
                // As agent-svc's dev identity header: a second, separate flag, so one stray
                // variable in a production manifest cannot open the gateway to every caller.
                vars.error(
                    "GATEWAY_ALLOW_INSECURE_DEV_AUTH",
                    "lets any caller act as any user, so it also needs STEWARD_DEVELOPMENT=true \
                     (a development machine, never production); or set GATEWAY_SERVICE_TOKEN",
                );
                CallerAuth::InsecureDev
            }
            (None, true) => CallerAuth::InsecureDev,
            (None, false) => {
                vars.error(
                    "GATEWAY_SERVICE_TOKEN",
                    "is required: the secret agent-svc presents as `authorization: Bearer <token>` \
                     (or set GATEWAY_ALLOW_INSECURE_DEV_AUTH=true for a local run)",
                );
                CallerAuth::InsecureDev
            }
        };

        let max_result_chars = vars.int_in("MAX_TOOL_RESULT_CHARS", 6000usize, 200, 1_000_000);
        let max_body_bytes =
            vars.bytes_in("UPSTREAM_MAX_BODY_BYTES", 10 << 20, 64 << 10, 256 << 20);
        let upstream_timeout = vars.duration_in(
            "UPSTREAM_TIMEOUT",
            Duration::from_secs(20),
            Duration::from_millis(100),
            Duration::from_secs(300),
        );
        let call_timeout = vars.duration_in(
            "TOOL_CALL_TIMEOUT",
            Duration::from_secs(30),
            Duration::from_millis(100),
            Duration::from_secs(600),
        );
        let call_max_timeout = vars.duration_in(
            "TOOL_CALL_MAX_TIMEOUT",
            Duration::from_secs(120),
            Duration::from_millis(100),
            Duration::from_secs(3600),
        );
        if call_max_timeout < call_timeout {
            vars.error("TOOL_CALL_MAX_TIMEOUT", "is shorter than TOOL_CALL_TIMEOUT");
        }

        let rate_limit_backend = match vars.string("RATE_LIMIT_BACKEND", "memory").as_str() {
            "memory" => RateLimitBackendKind::Memory,
            "postgres" if server.database.is_some() => RateLimitBackendKind::Postgres,
            "postgres" => {
                vars.error(
                    "RATE_LIMIT_BACKEND",
                    "postgres needs DATABASE_URL to be set",
                );
                RateLimitBackendKind::Memory
            }
            other => {
                vars.error(
                    "RATE_LIMIT_BACKEND",
                    format!("{other:?} is not memory or postgres"),
                );
                RateLimitBackendKind::Memory
            }
        };
        let mut rate_limits = Vec::new();
        for integration in [
            Integration::Gmail,
            Integration::GoogleCalendar,
            Integration::Slack,
            Integration::Mcp,
        ] {
            let var = format!("RATE_LIMITS_{}", integration.key().to_ascii_uppercase());
            // MCP limits count per user and server; the defaults are Google's quotas, which
            // suit an unknown server too.
            let default = Limits::google_default();
            let limits = match vars.raw(&var) {
                None => default,
                Some(raw) => raw.parse().unwrap_or_else(|e| {
                    vars.error(&var, format!("{e}; use e.g. 30/minute,500/hour,5000/day"));
                    default
                }),
            };
            rate_limits.push((integration, limits));
        }

        let current_key = vars.optional_string("CREDENTIALS_KEY");
        let credentials_key = current_key.as_deref().and_then(|k| {
            TokenCipher::from_base64(k)
                .map_err(|e| vars.error("CREDENTIALS_KEY", e))
                .ok()
        });
        // The key being rotated out: read, never written with (see `TokenCipher`).
        let previous_key = match (
            vars.optional_string("CREDENTIALS_KEY_PREVIOUS"),
            &current_key,
        ) {
            (None, _) => None,
            (Some(_), None) => {
                vars.error(
                    "CREDENTIALS_KEY_PREVIOUS",
                    "is set but CREDENTIALS_KEY is not; set CREDENTIALS_KEY to the new key and \
                     CREDENTIALS_KEY_PREVIOUS to the one it replaces",
                );
                None
            }
            // Standard base64 decodes one way only, so equal keys are equal strings.
            (Some(previous), Some(current)) if previous.trim() == current.trim() => {
                vars.error(
                    "CREDENTIALS_KEY_PREVIOUS",
                    "is the same key as CREDENTIALS_KEY; set it to the key being replaced, or \
                     unset it once rotation is done",
                );
                None
            }
            (Some(previous), Some(_)) => TokenCipher::from_base64(&previous)
                .map_err(|e| vars.error("CREDENTIALS_KEY_PREVIOUS", e))
                .ok(),
        };
        let credentials_key = match (credentials_key, previous_key) {
            (Some(current), Some(previous)) => Some(current.with_previous(previous)),
            (current, _) => current,
        };
        let credentials_rekey = vars.bool("CREDENTIALS_REKEY", false);
        let credentials_rekey_interval = vars.duration_in(
            "CREDENTIALS_REKEY_INTERVAL",
            crate::credentials::rekey::DEFAULT_INTERVAL,
            Duration::from_secs(1),
            Duration::from_secs(24 * 3600),
        );
        if credentials_rekey && vars.raw("CREDENTIALS_KEY_PREVIOUS").is_none() {
            vars.error(
                "CREDENTIALS_REKEY",
                "is on but CREDENTIALS_KEY_PREVIOUS is not set, so there is no key to move \
                 tokens from; set CREDENTIALS_KEY_PREVIOUS to the key being replaced, or unset \
                 CREDENTIALS_REKEY",
            );
        }
        let google_oauth = match (
            vars.optional_string("GOOGLE_CLIENT_ID"),
            vars.optional_string("GOOGLE_CLIENT_SECRET"),
        ) {
            (Some(client_id), Some(client_secret)) => Some(OAuthClient {
                token_url: vars.string("GOOGLE_OAUTH_TOKEN_URL", DEFAULT_GOOGLE_TOKEN_URL),
                client_id,
                client_secret: client_secret.into(),
            }),
            (None, None) => None,
            _ => {
                vars.error(
                    "GOOGLE_CLIENT_ID",
                    "GOOGLE_CLIENT_ID and GOOGLE_CLIENT_SECRET must be set together",
                );
                None
            }
        };

        let mut url = |var: &str, default: &str| {
            let value = vars.string(var, default);
            if reqwest::Url::parse(&value).is_err() {
                vars.error(var, format!("{value:?} is not a URL"));
            }
            value
        };
        let gmail_base_url = url(
            "GMAIL_API_BASE_URL",
            crate::integrations::gmail::DEFAULT_BASE_URL,
        );
        let calendar_base_url = url(
            "GOOGLE_CALENDAR_API_BASE_URL",
            crate::integrations::calendar::DEFAULT_BASE_URL,
        );
        let slack_base_url = url(
            "SLACK_API_BASE_URL",
            crate::integrations::slack::DEFAULT_BASE_URL,
        );
        let bootstrap_source_timeout = vars.duration_in(
            "BOOTSTRAP_SOURCE_TIMEOUT",
            Duration::from_millis(1500),
            Duration::from_millis(50),
            Duration::from_millis(1900),
        );
        let bootstrap_cache_ttl = vars.duration_in(
            "BOOTSTRAP_CACHE_TTL",
            Duration::from_secs(10),
            Duration::ZERO,
            Duration::from_secs(300),
        );

        let audit_default = AuditQueueConfig::default();
        let audit_queue = AuditQueueConfig {
            capacity: vars.int_in("AUDIT_QUEUE_CAPACITY", audit_default.capacity, 1, 1_000_000),
            // An INSERT of up to 10,000 rows stays well inside one statement's limits.
            max_batch: vars.int_in("AUDIT_MAX_BATCH", audit_default.max_batch, 1, 10_000),
            ..audit_default
        };
        let retention = load_retention(&mut vars);

        let mcp = McpConfig {
            servers: load_mcp_servers(&mut vars),
            listen_addr: vars.optional_string("MCP_LISTEN_ADDR").and_then(|raw| {
                raw.parse::<SocketAddr>()
                    .map_err(|_| {
                        vars.error(
                            "MCP_LISTEN_ADDR",
                            format!("{raw:?} is not host:port; use e.g. 0.0.0.0:8765"),
                        )
                    })
                    .ok()
            }),
            allowed_hosts: match vars
                .string("MCP_ALLOWED_HOSTS", "localhost,127.0.0.1,::1")
                .trim()
            {
                "*" => Vec::new(),
                hosts => hosts
                    .split(',')
                    .map(str::trim)
                    .filter(|h| !h.is_empty())
                    .map(str::to_owned)
                    .collect(),
            },
            connect_timeout: vars.duration_in(
                "MCP_CONNECT_TIMEOUT",
                Duration::from_secs(5),
                Duration::from_millis(100),
                Duration::from_secs(60),
            ),
            reconnect_interval: vars.duration_in(
                "MCP_RECONNECT_INTERVAL",
                Duration::from_secs(5),
                Duration::from_millis(100),
                Duration::from_secs(600),
            ),
        };

        if let (CallerAuth::InsecureDev, Some(addr)) = (&auth, mcp.listen_addr)
            && (!addr.ip().is_loopback() || mcp.allowed_hosts.is_empty())
        {
            vars.error(
                "MCP_LISTEN_ADDR",
                format!(
                    "{addr} with GATEWAY_ALLOW_INSECURE_DEV_AUTH (and MCP_ALLOWED_HOSTS not `*`) \
                     would let anyone who reaches it act as any user; listen on 127.0.0.1 or \
                     set GATEWAY_SERVICE_TOKEN"
                ),
            );
        }

        vars.finish(Self {
            server,
            auth,
            max_result_chars,
            max_body_bytes,
            upstream_timeout,
            call_timeout,
            call_max_timeout,
            rate_limit_backend,
            rate_limits,
            credentials_key,
            credentials_rekey,
            credentials_rekey_interval,
            google_oauth,
            gmail_base_url,
            calendar_base_url,
            slack_base_url,
            bootstrap_source_timeout,
            bootstrap_cache_ttl,
            audit_queue,
            retention,
            mcp,
        })
    }

    pub fn limits_for(&self, integration: Integration) -> Option<Limits> {
        self.rate_limits
            .iter()
            .find(|(i, _)| *i == integration)
            .map(|(_, l)| l.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// A local run's auth: no service token, on a development machine.
    const DEV_AUTH: [(&str, &str); 2] = [
        ("GATEWAY_ALLOW_INSECURE_DEV_AUTH", "true"),
        ("STEWARD_DEVELOPMENT", "true"),
    ];

    fn load(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::load(Vars::from_map(&map))
    }

    #[test]
    fn a9_insecure_dev_auth_needs_the_development_flag_too() {
        let err = load(&[("GATEWAY_ALLOW_INSECURE_DEV_AUTH", "true")]).unwrap_err();
        assert_eq!(err.0[0].var, "GATEWAY_ALLOW_INSECURE_DEV_AUTH");
        assert!(err.0[0].problem.contains("STEWARD_DEVELOPMENT=true"));
        assert!(
            load(&[
                ("GATEWAY_ALLOW_INSECURE_DEV_AUTH", "true"),
                ("STEWARD_DEVELOPMENT", "true"),
            ])
            .is_ok()
        );
    }

    #[test]
    fn a_local_run_listens_on_50052_with_the_in_memory_store_and_spec_defaults() {
        let cfg = load(&[
            ("GATEWAY_ALLOW_INSECURE_DEV_AUTH", "true"),
            ("STEWARD_DEVELOPMENT", "true"),
        ])
        .unwrap();
        assert_eq!(cfg.server.listen_addr.to_string(), DEFAULT_LISTEN);
        assert!(cfg.server.database.is_none());
        assert_eq!(cfg.max_result_chars, 6000);
        assert_eq!(
            cfg.limits_for(Integration::Gmail).unwrap().to_string(),
            "30/minute,500/hour,5000/day"
        );
        assert!(cfg.limits_for(Integration::Tasks).is_none());
        assert_eq!(cfg.audit_queue, AuditQueueConfig::default());
    }

    #[test]
    fn g15_mcp_servers_are_named_urls_with_secret_headers() {
        let base = DEV_AUTH;
        let cfg = load(&[
            base[0],
            base[1],
            (
                "MCP_SERVERS",
                "docs=https://docs.example.com/mcp, wiki-2=http://127.0.0.1:9/mcp",
            ),
            (
                "MCP_SERVER_HEADERS",
                r#"{"docs": {"Authorization": "Bearer s3cr3t-value"}}"#,
            ),
            ("MCP_ALLOWED_HOSTS", "*"),
        ])
        .unwrap();
        let names: Vec<&str> = cfg.mcp.servers.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["docs", "wiki-2"]);
        assert_eq!(cfg.mcp.servers[0].headers[0].0, "Authorization");
        assert!(cfg.mcp.allowed_hosts.is_empty());
        assert!(!format!("{cfg:?}").contains("s3cr3t-value"));

        for (servers, headers, expected) in [
            ("Docs=https://x/mcp", "", "server name \"Docs\""),
            ("docs", "", "is not name=url"),
            ("docs=ftp://x/mcp", "", "is not an http(s) URL"),
            ("docs=https://x/mcp,docs=https://y/mcp", "", "named twice"),
            (
                "docs=https://x/mcp",
                r#"{"wiki": {"A": "b"}}"#,
                "does not list",
            ),
            (
                "docs=https://x/mcp",
                "Bearer s3cr3t-value",
                "is not a JSON object",
            ),
        ] {
            let mut pairs = vec![base[0], base[1], ("MCP_SERVERS", servers)];
            if !headers.is_empty() {
                pairs.push(("MCP_SERVER_HEADERS", headers));
            }
            let err = load(&pairs).unwrap_err().to_string();
            assert!(err.contains(expected), "{servers} {headers}: {err}");
            assert!(!err.contains("s3cr3t-value"), "a secret was echoed: {err}");
        }
    }

    #[test]
    fn g15_the_mcp_endpoint_without_a_service_token_stays_on_loopback() {
        let dev = DEV_AUTH;
        assert!(load(&[dev[0], dev[1], ("MCP_LISTEN_ADDR", "127.0.0.1:8765")]).is_ok());
        let err = load(&[dev[0], dev[1], ("MCP_LISTEN_ADDR", "0.0.0.0:8765")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("MCP_LISTEN_ADDR") && err.contains("GATEWAY_SERVICE_TOKEN"));
        assert!(
            load(&[
                ("GATEWAY_SERVICE_TOKEN", "token-0123456789abcdef"),
                ("MCP_LISTEN_ADDR", "0.0.0.0:8765"),
            ])
            .is_ok()
        );
    }

    #[test]
    fn the_audit_queue_is_sized_from_the_environment_within_bounds() {
        let base = DEV_AUTH;
        let cfg = load(&[
            base[0],
            base[1],
            ("AUDIT_QUEUE_CAPACITY", "64"),
            ("AUDIT_MAX_BATCH", "16"),
        ])
        .unwrap();
        assert_eq!(
            (cfg.audit_queue.capacity, cfg.audit_queue.max_batch),
            (64, 16)
        );
        let err = load(&[
            base[0],
            base[1],
            ("AUDIT_QUEUE_CAPACITY", "0"),
            ("AUDIT_MAX_BATCH", "20000"),
        ])
        .unwrap_err();
        let vars: Vec<_> = err.0.iter().map(|e| e.var.as_str()).collect();
        assert_eq!(vars, ["AUDIT_QUEUE_CAPACITY", "AUDIT_MAX_BATCH"]);
    }

    #[test]
    fn retention_keeps_idempotency_keys_a_week_and_audit_forever_unless_told_otherwise() {
        let dev = DEV_AUTH;
        let retention = |extra: &[(&str, &str)]| {
            let mut pairs = dev.to_vec();
            pairs.extend_from_slice(extra);
            load(&pairs).map(|c| c.retention)
        };
        let day = Duration::from_secs(86_400);
        assert_eq!(retention(&[]).unwrap(), RetentionConfig::default());
        assert_eq!(RetentionConfig::default().idempotency, 7 * day);
        assert_eq!(RetentionConfig::default().audit, None);
        let set =
            retention(&[("IDEMPOTENCY_RETENTION", "48h"), ("AUDIT_RETENTION", "90d")]).unwrap();
        assert_eq!((set.idempotency, set.audit), (2 * day, Some(90 * day)));
        assert_eq!(
            retention(&[("AUDIT_RETENTION", "OFF")]).unwrap().audit,
            None
        );
        assert_eq!(
            retention(&[("IDEMPOTENCY_RETENTION", "3600")])
                .unwrap()
                .idempotency,
            RetentionConfig::MIN,
            "a bare number is seconds, as for every other duration"
        );
        for (var, value, expected) in [
            (
                "IDEMPOTENCY_RETENTION",
                "0",
                "shorter than 1h: use a duration from 1h to 36500d",
            ),
            ("IDEMPOTENCY_RETENTION", "59m", "shorter than 1h"),
            ("IDEMPOTENCY_RETENTION", "off", "is not a duration"),
            (
                "IDEMPOTENCY_RETENTION",
                "99999999999999999d",
                "is not a duration",
            ),
            ("AUDIT_RETENTION", "0", "shorter than 1h"),
            ("AUDIT_RETENTION", "0", "or off"),
            ("AUDIT_RETENTION", "1 week", "is not a duration"),
            ("AUDIT_RETENTION", "1 week", "or off"),
            ("AUDIT_RETENTION", "40000d", "longer than 36500d"),
        ] {
            let err = retention(&[(var, value)]).unwrap_err();
            assert_eq!(err.0.len(), 1, "{err}");
            assert_eq!(err.0[0].var, var, "{err}");
            assert!(err.0[0].problem.contains(expected), "{var}={value}: {err}");
        }
    }

    #[test]
    fn the_service_token_is_required_unless_insecure_dev_auth_is_chosen() {
        let err = load(&[]).unwrap_err();
        assert_eq!(err.0[0].var, "GATEWAY_SERVICE_TOKEN");
        assert!(matches!(
            load(&[("GATEWAY_SERVICE_TOKEN", "0123456789abcdef0")])
                .unwrap()
                .auth,
            CallerAuth::ServiceToken(_)
        ));
    }

    #[test]
    fn g6_rate_limits_are_in_process_by_default_and_shared_through_the_database_when_chosen() {
        let base = DEV_AUTH;
        let db = ("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/steward");
        let backend = |pairs: &[(&str, &str)]| load(pairs).unwrap().rate_limit_backend;
        assert_eq!(
            backend(&[base[0], base[1], db]),
            RateLimitBackendKind::Memory,
            "G-6: in-process state by default"
        );
        assert_eq!(
            backend(&[base[0], base[1], db, ("RATE_LIMIT_BACKEND", "postgres")]),
            RateLimitBackendKind::Postgres,
            "shared across replicas when configured"
        );
    }

    #[test]
    fn bad_limits_keys_and_sizes_are_each_named() {
        let err = load(&[
            ("GATEWAY_ALLOW_INSECURE_DEV_AUTH", "true"),
            ("STEWARD_DEVELOPMENT", "true"),
            ("GRPC_MAX_MESSAGE_BYTES", "1GiB"),
            ("RATE_LIMITS_GMAIL", "30/fortnight"),
            ("CREDENTIALS_KEY", "short"),
            ("RATE_LIMIT_BACKEND", "postgres"),
        ])
        .unwrap_err();
        let vars: Vec<_> = err.0.iter().map(|e| e.var.as_str()).collect();
        assert_eq!(
            vars,
            [
                "GRPC_MAX_MESSAGE_BYTES",
                "RATE_LIMIT_BACKEND",
                "RATE_LIMITS_GMAIL",
                "CREDENTIALS_KEY"
            ]
        );
    }

    #[test]
    fn the_previous_credentials_key_is_validated_and_needs_a_different_current_key() {
        const KEY: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
        const OTHER: &str = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk=";
        let problem = |extra: &[(&str, &str)]| {
            let mut pairs = DEV_AUTH.to_vec();
            pairs.extend_from_slice(extra);
            let err = load(&pairs).unwrap_err();
            assert_eq!(err.0.len(), 1, "{err}");
            assert_eq!(err.0[0].var, "CREDENTIALS_KEY_PREVIOUS", "{err}");
            err.to_string()
        };
        assert!(problem(&[("CREDENTIALS_KEY_PREVIOUS", KEY)]).contains("CREDENTIALS_KEY is not"));
        assert!(
            problem(&[("CREDENTIALS_KEY", KEY), ("CREDENTIALS_KEY_PREVIOUS", KEY)])
                .contains("the same key")
        );
        assert!(
            problem(&[
                ("CREDENTIALS_KEY", KEY),
                ("CREDENTIALS_KEY_PREVIOUS", "c2hvcnQ=")
            ])
            .contains("exactly 32")
        );
        let config = load(&[
            DEV_AUTH[0],
            DEV_AUTH[1],
            ("CREDENTIALS_KEY", OTHER),
            ("CREDENTIALS_KEY_PREVIOUS", KEY),
        ])
        .unwrap();
        assert!(config.credentials_key.unwrap().has_previous());
        assert!(
            !config.credentials_rekey,
            "moving tokens is asked for, never assumed"
        );
    }

    #[test]
    fn moving_tokens_to_the_new_key_needs_a_previous_key_to_move_them_from() {
        const KEY: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
        const OTHER: &str = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk=";
        let mut pairs = DEV_AUTH.to_vec();
        pairs.extend_from_slice(&[("CREDENTIALS_KEY", KEY), ("CREDENTIALS_REKEY", "true")]);
        let err = load(&pairs).unwrap_err();
        assert_eq!(err.0[0].var, "CREDENTIALS_REKEY", "{err}");
        assert!(
            err.to_string()
                .contains("CREDENTIALS_KEY_PREVIOUS is not set"),
            "{err}"
        );
        pairs.push(("CREDENTIALS_KEY_PREVIOUS", OTHER));
        assert!(load(&pairs).unwrap().credentials_rekey);
    }
}
