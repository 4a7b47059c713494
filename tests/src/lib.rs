//! The end-to-end harness (the zero-to-production `spawn_app` pattern): both services start
//! in-process on 127.0.0.1 port 0 against a fresh PostgreSQL database per test, which is dropped
//! afterwards, and the test gets typed clients.
//!
//! PostgreSQL comes from `STEWARD_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, the machine's trust-auth server). Logs are
//! printed only with `TEST_LOG=1`.

pub mod agent_calls;
pub mod bench;
pub mod calls;
pub mod db;
pub mod demo;
pub mod fakes;
pub mod mcp_python;
pub mod obedient_model;
pub mod pg_server;
pub mod probe_tools;
pub mod procs;
pub mod rule_model;
pub mod spawn;
pub mod worlds;

pub use db::TestDb;
pub use spawn::{
    Backend, Options, RunningService, SERVICE_TOKEN, TestApp, UserAgent, UserGateway, agent_as,
    agent_over, channel, gateway_as, gateway_with_token, spawn, spawn_app, spawn_app_with,
    start_agent, start_gateway, start_gateway_with, wait_for_status,
};

/// Settings as a map, from literal pairs: the shape `start_agent` and `start_gateway` take.
pub fn env(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A test for each store backend from one body: `both_backends!(f, g)` makes
/// `in_memory::f` and `on_postgres::f` (and so on), each calling `f` with the calling file's
/// own `memory()` or `postgres()` backend.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod in_memory {
            $(#[tokio::test] async fn $name() { super::$name(super::memory().await).await })*
        }
        mod on_postgres {
            $(#[tokio::test] async fn $name() { super::$name(super::postgres().await).await })*
        }
    };
}
