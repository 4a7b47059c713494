//! agent-svc's persistence boundary. One trait, two implementations that pass one test suite
//! (S-5): [`memory::MemoryStore`], the zero-set-up default, and [`postgres::PgStore`], used
//! whenever `DATABASE_URL` is set.
//!
//! The trait grows with the features that need it: threads and their ownership, user-visible
//! messages, LLM history, runs and their state transitions, actions, approvals, audit, sequenced
//! run events and session archives (S-2). Nothing about a conversation lives outside the store
//! between requests (S-3).

pub mod memory;
pub mod postgres;

use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
}

impl From<svc_kit::pg::PgError> for StoreError {
    fn from(e: svc_kit::pg::PgError) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

#[async_trait::async_trait]
pub trait AgentStore: Send + Sync + 'static {
    /// Which backend this is, for logs.
    fn backend(&self) -> &'static str;

    /// Succeeds when the store can serve requests; drives readiness.
    async fn ping(&self) -> Result<(), StoreError>;
}

pub type SharedStore = Arc<dyn AgentStore>;
