//! gateway-svc's persistence boundary. Each concern is a small trait; [`memory`] (the
//! zero-set-up default) and [`postgres`] (used whenever `DATABASE_URL` is set) implement all of
//! them and pass one shared test suite (S-5).
//!
//! Tokens are stored as ciphertext: encryption happens in `credentials`, never here.

pub mod memory;
pub mod postgres;

use std::{sync::Arc, time::SystemTime};

use serde::{Deserialize, Serialize};

use crate::{
    domain::{Integration, UserId},
    ratelimit::RateLimitBackend,
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
}

impl StoreError {
    pub fn unavailable(e: impl std::fmt::Display) -> Self {
        StoreError::Unavailable(e.to_string())
    }

    /// A PostgreSQL error with the server's own message (tokio-postgres prints only "db error").
    pub fn db(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(db) => StoreError::Unavailable(format!("{} ({})", db.message(), db.code().code())),
            None => StoreError::Unavailable(e.to_string()),
        }
    }
}

impl From<svc_kit::pg::PgError> for StoreError {
    fn from(e: svc_kit::pg::PgError) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AccountStatus {
    Connected,
    NeedsReconnect,
}

impl AccountStatus {
    pub fn key(self) -> &'static str {
        match self {
            AccountStatus::Connected => "connected",
            AccountStatus::NeedsReconnect => "needs_reconnect",
        }
    }

    pub fn from_key(key: &str) -> Self {
        if key == "needs_reconnect" {
            AccountStatus::NeedsReconnect
        } else {
            AccountStatus::Connected
        }
    }
}

/// A connected account as stored: tokens are AES-256-GCM ciphertext.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredAccount {
    pub user: UserId,
    pub integration: Integration,
    pub account: String,
    pub access_token: Vec<u8>,
    pub refresh_token: Option<Vec<u8>>,
    pub expires_at: Option<SystemTime>,
    pub scopes: Vec<String>,
    pub status: AccountStatus,
    pub connected_at: SystemTime,
}

/// An account row held exclusively (across replicas, for PostgreSQL) until saved or dropped;
/// what makes token refresh single-flight.
#[async_trait::async_trait]
pub trait AccountLock: Send {
    /// The row as it is now, under the lock; `None` if it was deleted.
    fn current(&self) -> Option<&StoredAccount>;
    /// Writes `updated` and releases the lock.
    async fn save(self: Box<Self>, updated: StoredAccount) -> Result<(), StoreError>;
}

#[async_trait::async_trait]
pub trait AccountStore: Send + Sync + 'static {
    async fn upsert_account(&self, account: StoredAccount) -> Result<(), StoreError>;
    async fn list_accounts(&self, user: &UserId) -> Result<Vec<StoredAccount>, StoreError>;
    async fn get_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Option<StoredAccount>, StoreError>;
    /// True when something was deleted.
    async fn delete_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<bool, StoreError>;
    /// How many accounts exist for anyone: start-up refuses to run without a key if any do.
    async fn count_accounts(&self) -> Result<u64, StoreError>;
    async fn lock_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Box<dyn AccountLock>, StoreError>;
}

/// The stored result of a side-effect call, replayed for a repeated idempotency key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResult {
    pub tool: String,
    pub args_sha256: String,
    pub outcome: serde_json::Value,
}

/// An idempotency key held exclusively until completed or dropped, so two concurrent calls
/// with one key run upstream once.
#[async_trait::async_trait]
pub trait IdempotencyClaim: Send {
    /// The result stored by an earlier call with this key, if any.
    fn existing(&self) -> Option<&StoredResult>;
    /// Stores the result and releases the key.
    async fn complete(self: Box<Self>, result: StoredResult) -> Result<(), StoreError>;
}

#[async_trait::async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    async fn claim(
        &self,
        user: &UserId,
        key: &str,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError>;
}

/// One audit record (G-9): who called what, against which account, how it went. Never
/// arguments, tokens or bodies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    pub user: String,
    /// `tool_call` or `upstream_call`.
    pub kind: String,
    pub tool: String,
    pub integration: Option<String>,
    pub account: Option<String>,
    pub call_id: String,
    pub run_id: Option<String>,
    /// `ok`, an error kind, or an HTTP status for upstream calls.
    pub status: String,
    pub latency_ms: u32,
    pub bytes: u32,
    pub upstream_calls: u32,
}

#[async_trait::async_trait]
pub trait AuditLog: Send + Sync + 'static {
    async fn record(&self, record: AuditRecord) -> Result<(), StoreError>;
    /// The most recent records for a user, newest last (for tests and operators).
    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError>;
}

/// Everything the gateway persists, from one backend.
#[derive(Clone)]
pub struct Stores {
    pub backend: &'static str,
    pub accounts: Arc<dyn AccountStore>,
    pub idempotency: Arc<dyn IdempotencyStore>,
    pub audit: Arc<dyn AuditLog>,
    /// Rate-limit counters in this backend (shared mode); in-process counters are separate.
    pub shared_rate_limits: Option<Arc<dyn RateLimitBackend>>,
    pub ping: Arc<dyn Ping>,
}

#[async_trait::async_trait]
pub trait Ping: Send + Sync + 'static {
    /// Succeeds when the store can serve requests; drives readiness.
    async fn ping(&self) -> Result<(), StoreError>;
}
