//! gateway-svc: owns every integration (Gmail, Google Calendar, Slack, memory, tasks, reminders)
//! and enforces in one place argument validation, metadata-only search, result caps, per-user
//! rate limits, credential handling and error-to-string. See docs/ARCHITECTURE.md.

pub mod api;
pub mod app;
pub mod audit;
pub mod bootstrap;
pub mod catalog;
pub mod config;
pub mod context;
pub mod credentials;
pub mod domain;
pub mod enforce;
pub mod engine;
pub mod integrations;
pub mod mcp;
pub mod metrics;
pub mod ratelimit;
pub mod registry;
pub mod retention;
pub mod store;
pub mod time;

pub use app::{App, StartError};
pub use config::Config;
