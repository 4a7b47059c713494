//! Server plumbing that agent-svc and gateway-svc share, written once: typed environment
//! configuration with errors that name the variable, JSON logs, the gRPC serving loop with
//! health, reflection and a bounded graceful drain, and the PostgreSQL pool with migrations
//! applied under an advisory lock.

pub mod config;
pub mod group;
pub mod grpc;
pub mod health;
pub mod json_log;
pub mod metrics;
pub mod periodic;
pub mod pg;
pub mod pg_tls;
pub mod process;
pub mod retry_after;
pub mod secret;
pub mod server_config;
pub mod shutdown;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;
pub mod tls;
