//! agent-svc: assembles prompts, runs the tool-calling loop against model providers, enforces
//! limits, budgets and approval policy, persists threads, runs, actions and audit, and streams run
//! events to callers. See docs/ARCHITECTURE.md for the path of a run.

pub mod api;
pub mod app;
pub mod config;
pub mod executor;
pub mod fence;
pub mod gateway_client;
pub mod llm;
pub mod metrics;
pub mod models;
pub mod policy;
pub mod prompt;
pub mod runs;
pub mod schedule;
pub mod store;

pub use app::{App, StartError};
pub use config::Config;
