//! agent-svc configuration, loaded once from the environment and validated at start.

use std::net::SocketAddr;

use svc_kit::{
    config::{ConfigErrors, Vars},
    server_config::ServerConfig,
};

pub const DEFAULT_LISTEN: &str = "0.0.0.0:50051";
pub const DEFAULT_GATEWAY_URL: &str = "http://127.0.0.1:50052";

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    /// `GATEWAY_URL`: where gateway-svc listens.
    pub gateway_url: String,
    /// `GATEWAY_SERVICE_TOKEN`: the secret presented to gateway-svc.
    pub gateway_token: Option<svc_kit::secret::Secret>,
    /// `GATEWAY_TLS_CA`, `GATEWAY_TLS_CERT`/`GATEWAY_TLS_KEY`, `GATEWAY_TLS_DOMAIN`: TLS (and
    /// mTLS) to gateway-svc; used exactly when GATEWAY_URL is https.
    pub gateway_tls: svc_kit::tls::ClientTls,
    /// `AGENT_TOOLS_CACHE_TTL`: how long a user's tool list is reused (0: ask every run).
    pub tools_cache_ttl: std::time::Duration,
    pub models: crate::models::ModelsConfig,
    /// `AGENT_MAX_LOOP_STEPS`: overrides the interactive iteration limit, clamped to 1..15.
    pub max_loop_steps: Option<u32>,
    /// `MAX_TOOL_RESULT_CHARS`
    pub max_tool_result_chars: usize,
    /// `AUTH_JWT_HS256_SECRET` | `AUTH_JWT_RS256_PUBLIC_KEY` (+ `AUTH_JWT_ISSUER`,
    /// `AUTH_JWT_AUDIENCE`), or `AUTH_DEV_USER_HEADER=true`.
    pub identity: crate::api::identity::Identity,
    /// `AGENT_SIDE_EFFECTS_ENABLED`, `AGENT_DEFAULT_TRUST_LEVEL`, `AGENT_USER_POLICIES`.
    pub policy: crate::policy::Policy,
    /// `APPROVAL_TTL`: how long an approval can be approved.
    pub approval_ttl: std::time::Duration,
    /// `HEALTH_MONITOR_INTERVAL`: how often stale runs are looked for (E-12).
    pub monitor_interval: std::time::Duration,
    /// `RUN_GRACE_PERIOD`: how long after its lease lapsed a run counts as lost (E-12).
    pub run_grace: std::time::Duration,
    /// `RUN_LEASE`: the thread lease of a running run, renewed every third of it (E-11).
    pub run_lease: std::time::Duration,
    /// Per-user caps on live runs, open watch streams and queued task agents.
    pub fair_use: crate::runs::FairUse,
    /// `AGENT_SESSION_TIMEOUT`: quiet time after which a thread's session is archived (B-4).
    pub session_timeout: std::time::Duration,
    /// `AGENT_HISTORY_SUMMARY_COUNT`: past session summaries in the prompt.
    pub summary_count: usize,
    /// `TASK_AGENT_WORKERS`: whether this instance runs background task agents.
    pub task_workers: bool,
    /// `TASK_AGENT_POLL_INTERVAL`: how often an idle worker looks for queued tasks.
    pub task_poll_interval: std::time::Duration,
    /// `SCHEDULE_WORKERS`: whether this instance fires due schedules (issue 16).
    pub schedule_workers: bool,
    /// `SCHEDULE_POLL_INTERVAL`: how often a worker looks for due schedules.
    pub schedule_poll_interval: std::time::Duration,
    /// `AGENT_MAX_SCHEDULES_PER_USER`, `AGENT_SCHEDULE_MIN_INTERVAL`.
    pub schedule_rules: crate::runs::scheduled::ScheduleRules,
    /// `RUN_EVENTS_RETENTION`: how long a finished run keeps every event (`None`: for good);
    /// past it only its last event, the result, is kept.
    pub run_events_retention: Option<std::time::Duration>,
}

impl Config {
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::load(Vars::from_env())
    }

    pub fn load(mut vars: Vars<'_>) -> Result<Self, ConfigErrors> {
        let default_listen: SocketAddr = DEFAULT_LISTEN.parse().expect("constant address");
        let server = ServerConfig::load(&mut vars, "AGENT", default_listen);
        let gateway_url = vars.string("GATEWAY_URL", DEFAULT_GATEWAY_URL);
        if !(gateway_url.starts_with("http://") || gateway_url.starts_with("https://"))
            || gateway_url.parse::<tonic::transport::Uri>().is_err()
        {
            vars.error(
                "GATEWAY_URL",
                format!("{gateway_url:?} is not an http(s) URL; use e.g. {DEFAULT_GATEWAY_URL}"),
            );
        }
        let gateway_tls = svc_kit::tls::ClientTls::load(&mut vars, "GATEWAY");
        if gateway_tls.is_set() && !gateway_url.starts_with("https://") {
            vars.error(
                "GATEWAY_URL",
                format!(
                    "{gateway_url:?} is plaintext but GATEWAY_TLS_* is set; use an https:// URL"
                ),
            );
        }
        let gateway_token = vars
            .optional_string("GATEWAY_SERVICE_TOKEN")
            .map(svc_kit::secret::Secret::from);
        let tools_cache_ttl = vars.duration_in(
            "AGENT_TOOLS_CACHE_TTL",
            std::time::Duration::from_secs(5),
            std::time::Duration::ZERO,
            std::time::Duration::from_secs(300),
        );
        let models = crate::models::ModelsConfig::load(&mut vars);
        // S1: "default 8, clamp 1..15": out-of-range values are clamped, not refused.
        let max_loop_steps = vars
            .raw("AGENT_MAX_LOOP_STEPS")
            .map(|raw| match raw.parse::<i64>() {
                Ok(n) => n.clamp(1, 15) as u32,
                Err(_) => {
                    vars.error(
                        "AGENT_MAX_LOOP_STEPS",
                        format!("{raw:?} is not a whole number (1 to 15)"),
                    );
                    8
                }
            });
        let max_tool_result_chars = vars.int_in("MAX_TOOL_RESULT_CHARS", 6000usize, 200, 1_000_000);
        let identity = load_identity(&mut vars);
        let policy = load_policy(&mut vars);
        let session_timeout = vars.duration_in(
            "AGENT_SESSION_TIMEOUT",
            std::time::Duration::from_secs(30 * 60),
            std::time::Duration::ZERO,
            std::time::Duration::from_secs(7 * 24 * 3600),
        );
        let summary_count = vars.int_in("AGENT_HISTORY_SUMMARY_COUNT", 5usize, 0, 20);
        let task_workers = vars.bool("TASK_AGENT_WORKERS", true);
        let task_poll_interval = vars.duration_in(
            "TASK_AGENT_POLL_INTERVAL",
            std::time::Duration::from_secs(2),
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(600),
        );
        let schedule_workers = vars.bool("SCHEDULE_WORKERS", true);
        let schedule_poll_interval = vars.duration_in(
            "SCHEDULE_POLL_INTERVAL",
            std::time::Duration::from_secs(5),
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(60),
        );
        let schedule_rules = crate::runs::scheduled::ScheduleRules {
            max_per_user: vars.int_in("AGENT_MAX_SCHEDULES_PER_USER", 20u32, 0, 10_000),
            min_interval: vars.duration_in(
                "AGENT_SCHEDULE_MIN_INTERVAL",
                std::time::Duration::from_secs(60),
                std::time::Duration::from_secs(60),
                std::time::Duration::from_secs(7 * 24 * 3600),
            ),
        };
        let monitor_interval = vars.duration_in(
            "HEALTH_MONITOR_INTERVAL",
            std::time::Duration::from_secs(10),
            std::time::Duration::from_millis(100),
            std::time::Duration::from_secs(3600),
        );
        let run_lease = vars.duration_in(
            "RUN_LEASE",
            std::time::Duration::from_secs(15),
            std::time::Duration::from_millis(300),
            std::time::Duration::from_secs(600),
        );
        let fair_use = crate::runs::FairUse {
            max_active_runs: vars.int_in("AGENT_MAX_ACTIVE_RUNS_PER_USER", 8u32, 1, 10_000),
            max_watchers: vars.int_in("AGENT_MAX_WATCHERS_PER_USER", 32u32, 1, 100_000),
            max_queued_task_agents: vars.int_in(
                "AGENT_MAX_QUEUED_TASK_AGENTS_PER_USER",
                10u32,
                0,
                10_000,
            ),
        };
        let run_grace = vars.duration_in(
            "RUN_GRACE_PERIOD",
            std::time::Duration::from_secs(5),
            std::time::Duration::ZERO,
            std::time::Duration::from_secs(3600),
        );
        let approval_ttl = vars.duration_in(
            "APPROVAL_TTL",
            std::time::Duration::from_secs(24 * 3600),
            std::time::Duration::from_secs(60),
            std::time::Duration::from_secs(30 * 24 * 3600),
        );
        const DAY: std::time::Duration = std::time::Duration::from_secs(86_400);
        let run_events_retention = vars.duration_or_off(
            "RUN_EVENTS_RETENTION",
            Some(30 * DAY),
            std::time::Duration::from_secs(3600),
            3650 * DAY,
        );
        vars.finish(Self {
            server,
            gateway_url,
            gateway_token,
            gateway_tls,
            tools_cache_ttl,
            models,
            max_loop_steps,
            max_tool_result_chars,
            identity,
            policy,
            approval_ttl,
            monitor_interval,
            run_grace,
            run_lease,
            fair_use,
            session_timeout,
            summary_count,
            task_workers,
            task_poll_interval,
            schedule_workers,
            schedule_poll_interval,
            schedule_rules,
            run_events_retention,
        })
    }
}

fn load_policy(vars: &mut Vars<'_>) -> crate::policy::Policy {
    use crate::policy::{Policy, TrustLevel, UserPolicy};
    let side_effects_enabled = vars.bool("AGENT_SIDE_EFFECTS_ENABLED", true);
    let default_trust = match vars
        .string("AGENT_DEFAULT_TRUST_LEVEL", "supervised")
        .as_str()
    {
        "supervised" => TrustLevel::Supervised,
        "delegated" => TrustLevel::Delegated,
        "autonomous" => TrustLevel::Autonomous,
        other => {
            vars.error(
                "AGENT_DEFAULT_TRUST_LEVEL",
                format!("{other:?} is not supervised, delegated or autonomous"),
            );
            TrustLevel::Supervised
        }
    };
    let users = match vars.raw("AGENT_USER_POLICIES") {
        None => Default::default(),
        Some(raw) => serde_json::from_str::<std::collections::HashMap<String, UserPolicy>>(&raw).unwrap_or_else(|e| {
            vars.error(
                "AGENT_USER_POLICIES",
                format!("is not JSON like {{\"alice\": {{\"trust\": \"delegated\", \"allowlist\": [\"boss@example.com\"]}}}} ({e})"),
            );
            Default::default()
        }),
    };
    Policy {
        side_effects_enabled,
        default_trust,
        users,
    }
}

fn load_identity(vars: &mut Vars<'_>) -> crate::api::identity::Identity {
    use crate::api::identity::Identity;
    let issuer = vars.optional_string("AUTH_JWT_ISSUER");
    let audience = vars.optional_string("AUTH_JWT_AUDIENCE");
    let any_audience = vars.bool("AUTH_JWT_ANY_AUDIENCE", false);
    let dev = vars.bool("AUTH_DEV_USER_HEADER", false);
    let development = vars.bool("STEWARD_DEVELOPMENT", false);
    let jwks_url = vars.optional_string("AUTH_JWKS_URL");
    let keyed = vars.optional_string("AUTH_JWT_HS256_SECRET").is_some()
        || vars.optional_string("AUTH_JWT_RS256_PUBLIC_KEY").is_some()
        || jwks_url.is_some();
    if keyed && audience.is_none() && !any_audience {
        // Without an audience, a token the same issuer minted for any other service would do.
        vars.error(
            "AUTH_JWT_AUDIENCE",
            "is required when a JWT key is configured, so tokens your issuer minted for other services \
             are refused; set it to this service's audience (or AUTH_JWT_ANY_AUDIENCE=true if the issuer \
             mints tokens for this service only)",
        );
    }
    let hs = vars.optional_string("AUTH_JWT_HS256_SECRET");
    let rs = vars.optional_string("AUTH_JWT_RS256_PUBLIC_KEY");
    if let Some(url) = jwks_url {
        if hs.is_some() || rs.is_some() {
            vars.error(
                "AUTH_JWKS_URL",
                "set one key source: AUTH_JWKS_URL, AUTH_JWT_HS256_SECRET or AUTH_JWT_RS256_PUBLIC_KEY",
            );
        } else if !(url.starts_with("https://") || url.starts_with("http://")) {
            vars.error("AUTH_JWKS_URL", "must be an http(s) URL of a JWK set");
        }
        return Identity::jwks(&url, issuer.as_deref(), audience.as_deref());
    }
    match (hs, rs) {
        (Some(_), Some(_)) => {
            vars.error(
                "AUTH_JWT_HS256_SECRET",
                "set either AUTH_JWT_HS256_SECRET or AUTH_JWT_RS256_PUBLIC_KEY, not both",
            );
            Identity::DevHeader
        }
        (Some(secret), None) if secret.len() < 32 => {
            vars.error(
                "AUTH_JWT_HS256_SECRET",
                "is shorter than 32 characters; use a long random secret",
            );
            Identity::DevHeader
        }
        (Some(secret), None) => {
            Identity::hs256(secret.as_bytes(), issuer.as_deref(), audience.as_deref())
        }
        (None, Some(pem)) => Identity::rs256(
            pem.replace("\\n", "\n").as_bytes(),
            issuer.as_deref(),
            audience.as_deref(),
        )
        .unwrap_or_else(|e| {
            vars.error("AUTH_JWT_RS256_PUBLIC_KEY", e);
            Identity::DevHeader
        }),
        (None, None) if dev && !development => {
            vars.error(
                "AUTH_DEV_USER_HEADER",
                "lets any caller name itself with x-user-id, so it also needs STEWARD_DEVELOPMENT=true \
                 (a development machine, never production); or configure AUTH_JWT_HS256_SECRET / \
                 AUTH_JWT_RS256_PUBLIC_KEY",
            );
            Identity::DevHeader
        }
        (None, None) if dev => {
            tracing::warn!(
                "AUTH_DEV_USER_HEADER: callers name themselves with x-user-id; never use this in production"
            );
            Identity::DevHeader
        }
        (None, None) => {
            vars.error(
                "AUTH_JWT_HS256_SECRET",
                "no identity is configured: set AUTH_JWT_HS256_SECRET or AUTH_JWT_RS256_PUBLIC_KEY \
                 (or AUTH_DEV_USER_HEADER=true for a local run)",
            );
            Identity::DevHeader
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Loads `pairs`, in dev identity mode unless the test says otherwise.
    fn load(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        let mut map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        map.entry("AUTH_DEV_USER_HEADER".into())
            .or_insert_with(|| "true".into());
        map.entry("STEWARD_DEVELOPMENT".into())
            .or_insert_with(|| "true".into());
        Config::load(Vars::from_map(&map))
    }

    #[test]
    fn an_empty_environment_gives_a_working_local_default() {
        let cfg = load(&[]).unwrap();
        assert_eq!(cfg.server.listen_addr.to_string(), DEFAULT_LISTEN);
        assert!(cfg.server.database.is_none());
        assert_eq!(cfg.gateway_url, DEFAULT_GATEWAY_URL);
    }

    #[test]
    fn run_events_are_kept_thirty_days_unless_set_or_switched_off() {
        const DAY: std::time::Duration = std::time::Duration::from_secs(86_400);
        assert_eq!(load(&[]).unwrap().run_events_retention, Some(30 * DAY));
        let set = load(&[("RUN_EVENTS_RETENTION", "7d")]).unwrap();
        assert_eq!(set.run_events_retention, Some(7 * DAY));
        let off = load(&[("RUN_EVENTS_RETENTION", "off")]).unwrap();
        assert_eq!(off.run_events_retention, None);
        let err = load(&[("RUN_EVENTS_RETENTION", "30s")]).unwrap_err();
        assert_eq!(err.0[0].var, "RUN_EVENTS_RETENTION");
        assert!(
            err.to_string()
                .contains("\"30s\" is shorter than 1h: use a duration from 1h to 3650d, or off"),
            "{err}"
        );
    }

    #[test]
    fn an_identity_must_be_chosen_explicitly() {
        let err = load(&[("AUTH_DEV_USER_HEADER", "false")]).unwrap_err();
        assert_eq!(err.0[0].var, "AUTH_JWT_HS256_SECRET");
        let cfg = load(&[
            ("AUTH_DEV_USER_HEADER", "false"),
            ("AUTH_JWT_HS256_SECRET", &"k".repeat(32)),
            ("AUTH_JWT_AUDIENCE", "steward"),
        ])
        .unwrap();
        assert!(matches!(
            cfg.identity,
            crate::api::identity::Identity::Jwt { .. }
        ));
        let err = load(&[
            ("AUTH_JWT_RS256_PUBLIC_KEY", "not a pem"),
            ("AUTH_JWT_AUDIENCE", "steward"),
        ])
        .unwrap_err();
        assert_eq!(err.0[0].var, "AUTH_JWT_RS256_PUBLIC_KEY");
    }

    #[test]
    fn a9_a_jwt_key_needs_an_audience_unless_explicitly_waived() {
        let err = load(&[
            ("AUTH_DEV_USER_HEADER", "false"),
            ("AUTH_JWT_HS256_SECRET", &"k".repeat(32)),
        ])
        .unwrap_err();
        assert_eq!(err.0[0].var, "AUTH_JWT_AUDIENCE");
        assert!(err.0[0].problem.contains("AUTH_JWT_ANY_AUDIENCE"));
        load(&[
            ("AUTH_DEV_USER_HEADER", "false"),
            ("AUTH_JWT_HS256_SECRET", &"k".repeat(32)),
            ("AUTH_JWT_ANY_AUDIENCE", "true"),
        ])
        .unwrap();
    }

    #[test]
    fn a9_the_dev_identity_header_needs_the_development_flag_too() {
        let err = load(&[("STEWARD_DEVELOPMENT", "false")]).unwrap_err();
        assert_eq!(err.0[0].var, "AUTH_DEV_USER_HEADER");
        assert!(err.0[0].problem.contains("STEWARD_DEVELOPMENT=true"));
    }

    #[test]
    fn the_loop_step_override_is_clamped_not_refused() {
        assert_eq!(
            load(&[("AGENT_MAX_LOOP_STEPS", "99")])
                .unwrap()
                .max_loop_steps,
            Some(15)
        );
        assert_eq!(
            load(&[("AGENT_MAX_LOOP_STEPS", "0")])
                .unwrap()
                .max_loop_steps,
            Some(1)
        );
        assert_eq!(load(&[]).unwrap().max_loop_steps, None);
        assert_eq!(
            load(&[("AGENT_MAX_LOOP_STEPS", "lots")]).unwrap_err().0[0].var,
            "AGENT_MAX_LOOP_STEPS"
        );
    }

    #[test]
    fn a_bad_listen_address_and_gateway_url_are_both_named() {
        let err = load(&[
            ("AGENT_LISTEN_ADDR", "localhost"),
            ("GATEWAY_URL", "gateway:50052"),
        ])
        .unwrap_err();
        let vars: Vec<_> = err.0.iter().map(|e| e.var.as_str()).collect();
        assert_eq!(vars, ["AGENT_LISTEN_ADDR", "GATEWAY_URL"]);
    }
}
