//! The settings every Steward server has, read the same way by both services.

use std::{net::SocketAddr, time::Duration};

use crate::{config::Vars, grpc::ServeOptions, pg::PoolOptions};

/// PostgreSQL settings; present only when `DATABASE_URL` is set.
#[derive(Clone)]
pub struct DatabaseConfig {
    pub url: String,
    pub pool: PoolOptions,
}

impl std::fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &crate::secret::redact_url_password(&self.url))
            .field("pool", &self.pool)
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// `<PREFIX>_LISTEN_ADDR`.
    pub listen_addr: SocketAddr,
    /// `DATABASE_URL`; `None` selects the embedded in-memory store.
    pub database: Option<DatabaseConfig>,
    /// `GRPC_MAX_MESSAGE_BYTES`: the largest request or response message, either direction.
    pub max_message_bytes: usize,
    /// `HEALTH_PROBE_INTERVAL`: how often readiness re-checks the store.
    pub health_probe_interval: Duration,
    /// `METRICS_LISTEN_ADDR`: where Prometheus scrapes `/metrics`; `None` (unset) is off.
    pub metrics_addr: Option<SocketAddr>,
    pub serve: ServeOptions,
}

impl ServerConfig {
    /// Reads the shared settings; `prefix` names the listen variable (e.g. `AGENT` reads
    /// `AGENT_LISTEN_ADDR`).
    pub fn load(vars: &mut Vars<'_>, prefix: &str, default_listen: SocketAddr) -> Self {
        let listen_addr = vars.socket_addr(&format!("{prefix}_LISTEN_ADDR"), default_listen);
        let metrics_addr = vars.optional_string("METRICS_LISTEN_ADDR").and_then(|raw| {
            raw.parse::<SocketAddr>()
                .map_err(|_| {
                    vars.error(
                        "METRICS_LISTEN_ADDR",
                        format!("{raw:?} is not host:port; use e.g. 0.0.0.0:9464"),
                    )
                })
                .ok()
        });
        let database = vars.optional_string("DATABASE_URL").and_then(|url| {
            // Parsed as the pool will parse it, TLS settings and `sslrootcert` file included.
            match crate::pg::Target::parse(&url) {
                Err(crate::pg::PgError::BadUrl(e)) => {
                    vars.error(
                        "DATABASE_URL",
                        format!("not a PostgreSQL connection string ({e}); use e.g. postgres://user@host:5432/db"),
                    );
                    return None;
                }
                Err(e) => {
                    vars.error("DATABASE_URL", e.to_string());
                    return None;
                }
                Ok(_) => {}
            }
            let defaults = PoolOptions::default();
            let max_connections =
                vars.int_in("DATABASE_MAX_CONNECTIONS", defaults.max_connections, 1, 1000);
            let acquire_timeout = vars.duration_in(
                "DATABASE_ACQUIRE_TIMEOUT",
                defaults.acquire_timeout,
                Duration::from_millis(100),
                Duration::from_secs(300),
            );
            let lock_timeout = vars.duration_in(
                "DATABASE_LOCK_TIMEOUT",
                defaults.lock_timeout,
                Duration::from_millis(100),
                Duration::from_secs(300),
            );
            let idle_in_transaction_timeout = vars.duration_in(
                "DATABASE_IDLE_IN_TRANSACTION_TIMEOUT",
                defaults.idle_in_transaction_timeout,
                Duration::from_secs(1),
                Duration::from_secs(3600),
            );
            Some(DatabaseConfig {
                url,
                pool: PoolOptions {
                    max_connections,
                    acquire_timeout,
                    lock_timeout,
                    idle_in_transaction_timeout,
                },
            })
        });
        let max_message_bytes =
            vars.bytes_in("GRPC_MAX_MESSAGE_BYTES", 4 << 20, 64 << 10, 64 << 20);
        let health_probe_interval = vars.duration_in(
            "HEALTH_PROBE_INTERVAL",
            Duration::from_secs(5),
            Duration::from_millis(100),
            Duration::from_secs(300),
        );
        let drain_timeout = vars.duration_in(
            "SHUTDOWN_DRAIN_TIMEOUT",
            Duration::from_secs(20),
            Duration::ZERO,
            Duration::from_secs(600),
        );
        let keepalive_interval = vars.duration_in(
            "GRPC_KEEPALIVE_INTERVAL",
            Duration::from_secs(30),
            Duration::from_secs(1),
            Duration::from_secs(3600),
        );
        // Long-lived HTTP/2 connections pin a client to one pod; a maximum age makes clients
        // reconnect (and rebalance) now and then. In-flight calls get the grace to finish:
        // longer than the longest run (600 s).
        let max_connection_age = vars.duration_in(
            "GRPC_MAX_CONNECTION_AGE",
            Duration::from_secs(300),
            Duration::from_secs(1),
            Duration::from_secs(7 * 24 * 3600),
        );
        let max_connection_age_grace = vars.duration_in(
            "GRPC_MAX_CONNECTION_AGE_GRACE",
            Duration::from_secs(660),
            Duration::ZERO,
            Duration::from_secs(24 * 3600),
        );
        let tls = crate::tls::load_server(vars);
        Self {
            listen_addr,
            database,
            max_message_bytes,
            health_probe_interval,
            metrics_addr,
            serve: ServeOptions {
                drain_timeout,
                keepalive_interval,
                max_connection_age,
                max_connection_age_grace,
                tls,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn defaults_select_the_in_memory_store_on_the_default_port() {
        let map = HashMap::new();
        let mut vars = Vars::from_map(&map);
        let cfg = ServerConfig::load(&mut vars, "AGENT", "0.0.0.0:50051".parse().unwrap());
        assert!(vars.finish(()).is_ok());
        assert!(cfg.database.is_none());
        assert_eq!(cfg.listen_addr.port(), 50051);
        assert_eq!(cfg.max_message_bytes, 4 << 20);
    }

    #[test]
    fn a_malformed_database_url_is_named() {
        let map = HashMap::from([(
            "DATABASE_URL".to_owned(),
            "postgres://x:notaport/db".to_owned(),
        )]);
        let mut vars = Vars::from_map(&map);
        ServerConfig::load(&mut vars, "GATEWAY", "0.0.0.0:50052".parse().unwrap());
        let errors = vars.finish(()).unwrap_err();
        assert_eq!(errors.0[0].var, "DATABASE_URL");
    }

    #[test]
    fn the_pools_lock_and_idle_transaction_timeouts_are_read_and_checked() {
        let url = ("DATABASE_URL".to_owned(), "postgres://u@h/db".to_owned());
        let map = HashMap::from([
            url.clone(),
            ("DATABASE_LOCK_TIMEOUT".to_owned(), "750ms".to_owned()),
            (
                "DATABASE_IDLE_IN_TRANSACTION_TIMEOUT".to_owned(),
                "2m".to_owned(),
            ),
        ]);
        let mut vars = Vars::from_map(&map);
        let cfg = ServerConfig::load(&mut vars, "AGENT", "0.0.0.0:50051".parse().unwrap());
        assert!(vars.finish(()).is_ok());
        let pool = cfg.database.unwrap().pool;
        assert_eq!(pool.lock_timeout, Duration::from_millis(750));
        assert_eq!(pool.idle_in_transaction_timeout, Duration::from_secs(120));

        let map = HashMap::from([url, ("DATABASE_LOCK_TIMEOUT".to_owned(), "0s".to_owned())]);
        let mut vars = Vars::from_map(&map);
        ServerConfig::load(&mut vars, "AGENT", "0.0.0.0:50051".parse().unwrap());
        let errors = vars.finish(()).unwrap_err();
        assert_eq!(errors.0[0].var, "DATABASE_LOCK_TIMEOUT");
    }
}
