//! gateway-svc's persistence boundary. One trait, two implementations that pass one test suite
//! (S-5): [`memory::MemoryStore`], the zero-set-up default, and [`postgres::PgStore`], used
//! whenever `DATABASE_URL` is set.
//!
//! The trait grows with the features that need it: connected accounts with encrypted tokens,
//! rate-limit windows shared by replicas, idempotent results of side-effect calls, the audit of
//! every upstream call, and the memory, task and reminder data the built-in tools own.

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
pub trait GatewayStore: Send + Sync + 'static {
    /// Which backend this is, for logs.
    fn backend(&self) -> &'static str;

    /// Succeeds when the store can serve requests; drives readiness.
    async fn ping(&self) -> Result<(), StoreError>;
}

pub type SharedStore = Arc<dyn GatewayStore>;
