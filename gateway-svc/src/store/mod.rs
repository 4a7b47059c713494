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
    domain::{Integration, McpSwitch, UserId},
    ratelimit::RateLimitBackend,
};

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    /// Another call holds this idempotency key and is still running; or (from
    /// [`AccountStore::lock_account`]) another replica is still refreshing the account.
    #[error("{0}")]
    InProgress(String),
    /// An earlier call with this idempotency key let a write leave for upstream and ended
    /// without storing its result (its replica died, or storing kept failing): it may have
    /// acted, so the key is never taken over.
    #[error("{0}")]
    MayHaveActed(String),
    /// The database refused this for good: the same statement with the same data fails again
    /// (see [`svc_kit::pg::refused_for_good`]), so it is never retried — an audit record is
    /// isolated and logged (`crate::audit`), a call's storage failure is not "try again".
    #[error("the database refused this for good: {message} ({code})")]
    Rejected { code: String, message: String },
}

impl From<svc_kit::group::Lost> for StoreError {
    fn from(e: svc_kit::group::Lost) -> Self {
        StoreError::Unavailable(e.to_string())
    }
}

impl StoreError {
    pub fn unavailable(e: impl std::fmt::Display) -> Self {
        StoreError::Unavailable(e.to_string())
    }

    /// A PostgreSQL error with the server's own message (tokio-postgres prints only "db error"),
    /// classified: what the server refused for good is [`StoreError::Rejected`]; everything
    /// else — no connection, the pool, a serialization failure or deadlock, a lock timeout, the
    /// server shutting down, a full disk — is `Unavailable`, and may clear by waiting.
    pub fn db(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(db) if svc_kit::pg::refused_for_good(db.code()) => StoreError::Rejected {
                code: db.code().code().to_owned(),
                message: db.message().to_owned(),
            },
            Some(db) => StoreError::Unavailable(svc_kit::pg::server_message(db)),
            None => StoreError::Unavailable(e.to_string()),
        }
    }

    /// The write can never succeed as it is; retrying it is pointless.
    pub fn is_permanent(&self) -> bool {
        matches!(self, StoreError::Rejected { .. })
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
    /// Writes `updated` over the account as this lock read it, and releases the lock.
    async fn save(self: Box<Self>, updated: StoredAccount) -> Result<Saved, StoreError>;
}

/// What an [`AccountLock::save`] did. A save is a compare-and-swap on the account as its lock
/// read it, so a change made meanwhile (a reconnect, a disconnect, tokens saved by a taker of
/// a lease this lock outlived) wins; the caller says what that means for its own save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Saved {
    Applied,
    /// Not written: the account changed, or went, after the lock read it.
    Superseded,
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
    /// Up to `limit` accounts of anyone, most recently saved first (or, with `newest_first`
    /// false, least recently saved first): start-up checks that CREDENTIALS_KEY reads their
    /// tokens, and during a rotation how far it has come.
    async fn sample_accounts(
        &self,
        limit: usize,
        newest_first: bool,
    ) -> Result<Vec<StoredAccount>, StoreError>;
    /// Up to `limit` accounts of anyone in key order (user, integration, account), those after
    /// `after` when given: a walk over every stored account a page at a time, which saves
    /// meanwhile do not reorder (moving tokens to a new CREDENTIALS_KEY).
    async fn accounts_after(
        &self,
        after: Option<&AccountCursor>,
        limit: usize,
    ) -> Result<Vec<StoredAccount>, StoreError>;
    async fn lock_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Box<dyn AccountLock>, StoreError>;
    /// As [`AccountStore::lock_account`] for background work that must never supersede a
    /// refresh: the lock at once if nobody holds the account (a lock on nothing if it is
    /// gone), and on PostgreSQL if a lease on it lapsed more than `lapsed_for` ago (a replica
    /// that died holding it); `None`, without waiting, otherwise — including a lease only just
    /// lapsed, whose refresh may still be about to save, and one given back by a caller that
    /// took it over, judged by the lapse it took over. Its save lands only while it still
    /// holds the lease: a refresh that took over its own lapsed lease is never superseded.
    async fn lock_account_if_idle(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
        lapsed_for: std::time::Duration,
    ) -> Result<Option<Box<dyn AccountLock>>, StoreError>;
}

/// Where a walk over every stored account stands: the key of the last account it read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountCursor {
    pub user: UserId,
    pub integration: Integration,
    pub account: String,
}

impl AccountCursor {
    pub fn of(a: &StoredAccount) -> Self {
        Self {
            user: a.user.clone(),
            integration: a.integration,
            account: a.account.clone(),
        }
    }

    /// The key a walk is ordered by: the columns' text, compared in turn (each store in its
    /// own collation, PostgreSQL's for its rows, bytes for the memory store's).
    pub fn key(&self) -> (&str, &str, &str) {
        (self.user.as_str(), self.integration.key(), &self.account)
    }
}

impl StoredAccount {
    /// Its [`AccountCursor::key`], without making a cursor of it.
    pub fn walk_key(&self) -> (&str, &str, &str) {
        (self.user.as_str(), self.integration.key(), &self.account)
    }
}

/// What a call waiting for another call with its idempotency key is told when that one is
/// still running after `waited`.
pub fn in_progress(waited: std::time::Duration) -> String {
    format!(
        "an identical call (same idempotency key) is still in progress after {waited:?}; do not \
         repeat it, its result will be recorded under that key"
    )
}

/// What a call is told when the call that held its idempotency key let a write leave and
/// ended without storing its result.
pub fn may_have_acted() -> String {
    "an earlier call with this idempotency key ended without recording its result".into()
}

/// The stored result of a side-effect call, replayed for a repeated idempotency key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResult {
    pub tool: String,
    pub args_sha256: String,
    pub outcome: serde_json::Value,
}

/// An idempotency key held exclusively until completed, abandoned or dropped, so two
/// concurrent calls with one key run upstream once.
#[async_trait::async_trait]
pub trait IdempotencyClaim: Send {
    /// The result stored by an earlier call with this key, if any.
    fn existing(&self) -> Option<&StoredResult>;
    /// Stores the result and releases the key. On an error the key is still held by this
    /// claim, and storing may be tried again.
    async fn complete(&mut self, result: &StoredResult) -> Result<(), StoreError>;
    /// Lets go without a result and without freeing the key: its call may have acted, so the
    /// key answers "in progress" until its hold lapses, rather than letting a retry act again
    /// at once. (Dropping a claim frees the key: for a call that never reached upstream.)
    /// Once the hold lapsed, a claim never marked ([`IdempotencyClaim::acting`]) is taken
    /// over; a marked one answers [`StoreError::MayHaveActed`] for good.
    fn abandon(self: Box<Self>);
    /// What marks this claim as acting, for its call to use before its first write leaves;
    /// `None` for a claim that holds nothing (it replays a stored result).
    fn acting(&self) -> Option<Arc<dyn ActingMark>>;
}

/// Marks a held idempotency key as one whose call let a write leave for upstream. Without the
/// mark, a holder that died after its write (a replica killed before storing the result)
/// would leave a key a retry could take over once its hold lapsed, and act again.
#[async_trait::async_trait]
pub trait ActingMark: Send + Sync {
    /// Marked, or an error: the key is no longer this call's, or the store cannot be reached,
    /// and the write must not leave.
    async fn mark(&self) -> Result<(), StoreError>;
}

/// What is known of an idempotency key without claiming it.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyState {
    /// No call holds it or has completed with it.
    Free,
    /// A call holds it and its hold has not lapsed: the call is running (or its holder died a
    /// moment ago, which a store cannot tell apart until the hold lapses). Its result may
    /// still come.
    Running,
    /// A call held it, marked that its write was leaving, and ended without storing its
    /// result, its hold lapsed: it may have acted, and no result will come. (One whose hold
    /// lapsed before it marked a write did nothing: that key is `Free`.)
    Held,
    /// A call completed with it; its result.
    Done(StoredResult),
}

#[async_trait::async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Claims `key` for one call that may take up to `hold`: a key another call holds is
    /// waited for (its stored result then replayed), for at most `hold`; a holder that died is
    /// taken over once its hold lapsed, unless it had marked a write
    /// ([`StoreError::MayHaveActed`]).
    async fn claim(
        &self,
        user: &UserId,
        key: &str,
        hold: std::time::Duration,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError>;
    /// What is known of `key`, without claiming it.
    async fn lookup(&self, user: &UserId, key: &str) -> Result<KeyState, StoreError>;
    /// Deletes up to `limit` keys last changed before `older_than` that no call can still be
    /// waiting on: settled ones, and held ones whose hold lapsed before `older_than` too. A
    /// key still held (its hold not lapsed by the store's own clock) is never deleted,
    /// whatever `older_than` says. How many were deleted; the caller repeats while any were.
    async fn prune_idempotency(
        &self,
        older_than: SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError>;
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

/// An audit record with the time it happened: a record written later by the batching writer
/// (`crate::audit`) keeps the time of its call, not of its write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    pub at: SystemTime,
    pub record: AuditRecord,
}

impl AuditEntry {
    /// `record`, happening now.
    pub fn now(record: AuditRecord) -> Self {
        Self {
            at: SystemTime::now(),
            record,
        }
    }
}

#[async_trait::async_trait]
pub trait AuditLog: Send + Sync + 'static {
    /// Writes one record now, stamped with the time of the write.
    async fn record(&self, record: AuditRecord) -> Result<(), StoreError>;
    /// Writes one record with the time it already has: a record tried again keeps the time of
    /// its call, not of the try that landed.
    async fn record_entry(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.record_many(std::slice::from_ref(entry)).await
    }
    /// Writes `entries` in their order, all or none, each with its own time: one statement
    /// for the whole batch. A batch the database refuses for good (one bad record in it, or
    /// any record at all) fails with [`StoreError::Rejected`]; a failure a retry can get past
    /// with `Unavailable`.
    async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError>;
    /// The most recent records for a user, newest last (for tests and operators).
    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError>;
    /// Deletes up to `limit` records that happened before `older_than`, oldest written first.
    /// How many were deleted; the caller repeats while any were (a batch may delete fewer than
    /// `limit` and still leave older records behind it).
    async fn prune_audit(&self, older_than: SystemTime, limit: usize) -> Result<usize, StoreError>;
}

/// Everything the gateway persists, from one backend.
#[derive(Clone)]
pub struct Stores {
    pub backend: &'static str,
    pub mcp_switches: Arc<dyn McpSwitchStore>,
    pub accounts: Arc<dyn AccountStore>,
    pub idempotency: Arc<dyn IdempotencyStore>,
    pub audit: Arc<dyn AuditLog>,
    /// Rate-limit counters in this backend (shared mode); in-process counters are separate.
    pub shared_rate_limits: Option<Arc<dyn RateLimitBackend>>,
    pub ping: Arc<dyn Ping>,
    pub tasks: Arc<dyn TaskStore>,
    pub notes: Arc<dyn NoteStore>,
    pub reminders: Arc<dyn ReminderStore>,
}

#[async_trait::async_trait]
pub trait Ping: Send + Sync + 'static {
    /// Succeeds when the store can serve requests; drives readiness.
    async fn ping(&self) -> Result<(), StoreError>;
}

/// A task (I-7). Ids are global and quotable ("#42"); every query is scoped by user.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub id: i64,
    pub title: String,
    pub description: Option<String>,
    pub due_at: Option<SystemTime>,
    pub completed_at: Option<SystemTime>,
    pub created_at: SystemTime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskFilter {
    All,
    Pending,
    Completed,
}

/// Changes to a task; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskPatch {
    pub title: Option<String>,
    pub description: Option<Option<String>>,
    pub due_at: Option<Option<SystemTime>>,
    /// `Some(true)` completes the task now, `Some(false)` reopens it.
    pub completed: Option<bool>,
}

#[async_trait::async_trait]
pub trait TaskStore: Send + Sync + 'static {
    async fn add_task(
        &self,
        user: &UserId,
        title: &str,
        description: Option<&str>,
        due_at: Option<SystemTime>,
    ) -> Result<Task, StoreError>;
    /// Pending first by due date (undated last), then completed, newest first.
    async fn list_tasks(&self, user: &UserId, filter: TaskFilter) -> Result<Vec<Task>, StoreError>;
    /// The updated task, or `None` when the user has no such task.
    async fn update_task(
        &self,
        user: &UserId,
        id: i64,
        patch: TaskPatch,
    ) -> Result<Option<Task>, StoreError>;
    /// The deleted task, or `None` when the user has no such task.
    async fn delete_task(&self, user: &UserId, id: i64) -> Result<Option<Task>, StoreError>;
}

/// A remembered note about the user (I-6).
#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    pub id: i64,
    pub content: String,
    pub tags: Vec<String>,
    pub created_at: SystemTime,
    /// Where it came from (issue 14): empty for the user's own words, otherwise the external
    /// content the run had read when it was written.
    pub origin: String,
}

#[async_trait::async_trait]
pub trait NoteStore: Send + Sync + 'static {
    /// Stores `notes` (content, tags), all with the same `origin`.
    async fn add_notes(
        &self,
        user: &UserId,
        notes: &[(String, Vec<String>)],
        origin: &str,
    ) -> Result<Vec<Note>, StoreError>;
    /// Best match first; short and partial queries still find notes that start with their words.
    async fn search_notes(
        &self,
        user: &UserId,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Note>, StoreError>;
    async fn count_notes(&self, user: &UserId) -> Result<u64, StoreError>;
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reminder {
    pub id: i64,
    pub text: String,
    pub due_at: SystemTime,
    pub created_at: SystemTime,
}

#[async_trait::async_trait]
pub trait ReminderStore: Send + Sync + 'static {
    async fn add_reminder(
        &self,
        user: &UserId,
        text: &str,
        due_at: SystemTime,
    ) -> Result<Reminder, StoreError>;
    /// Reminders due at or after `now`, soonest first.
    async fn upcoming_reminders(
        &self,
        user: &UserId,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<Reminder>, StoreError>;
    /// All of the user's reminders, past ones included.
    async fn count_reminders(&self, user: &UserId) -> Result<u64, StoreError>;
}

/// The MCP servers and tools each user turned off (issue 15); on is the default.
#[async_trait::async_trait]
pub trait McpSwitchStore: Send + Sync + 'static {
    /// Turns `switch` off (`enabled = false`) or back on. Turning on removes only this entry:
    /// a tool stays off while its whole server is off.
    async fn set_mcp_enabled(
        &self,
        user: &UserId,
        switch: &McpSwitch,
        enabled: bool,
    ) -> Result<(), StoreError>;
    /// What the user turned off, server first then tool.
    async fn disabled_mcp(&self, user: &UserId) -> Result<Vec<McpSwitch>, StoreError>;
}

/// Splits text into lowercase words, for the in-memory search and for building prefix queries.
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}
