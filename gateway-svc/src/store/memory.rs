//! The embedded store: process memory, for local runs and tests with no database.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex as SyncMutex},
    time::SystemTime,
};

use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{
    AccountCursor, AccountLock, AccountStore, ActingMark, AuditEntry, AuditLog, AuditRecord,
    IdempotencyClaim, IdempotencyStore, KeyState, McpSwitchStore, Note, NoteStore, Ping, Reminder,
    ReminderStore, Saved, StoreError, StoredAccount, StoredResult, Stores, Task, TaskFilter,
    TaskPatch, TaskStore, words,
};
use crate::domain::{Integration, McpSwitch, UserId};

/// How many audit records the in-memory log keeps (oldest dropped first).
const AUDIT_CAPACITY: usize = 10_000;

type AccountKey = (UserId, Integration, String);

/// Per-key async mutexes: the in-process equivalent of a row lock.
struct KeyLocks<K> {
    locks: SyncMutex<HashMap<K, Arc<Mutex<()>>>>,
}

impl<K> Default for KeyLocks<K> {
    fn default() -> Self {
        Self {
            locks: SyncMutex::new(HashMap::new()),
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone> KeyLocks<K> {
    /// The mutex of `key`.
    fn mutex(&self, key: &K) -> Result<Arc<Mutex<()>>, StoreError> {
        let mut locks = self.locks.lock().map_err(|_| poisoned())?;
        // Forget locks nobody holds, so the map does not grow with every key ever seen.
        if locks.len() > 1024 {
            locks.retain(|_, l| Arc::strong_count(l) > 1);
        }
        Ok(locks.entry(key.clone()).or_default().clone())
    }

    async fn lock(&self, key: &K) -> Result<OwnedMutexGuard<()>, StoreError> {
        Ok(self.mutex(key)?.lock_owned().await)
    }

    /// The lock of `key` if nobody holds it now, without waiting.
    fn try_lock(&self, key: &K) -> Result<Option<OwnedMutexGuard<()>>, StoreError> {
        Ok(self.mutex(key)?.try_lock_owned().ok())
    }

    /// Whether someone holds `key` right now.
    fn held(&self, key: &K) -> Result<bool, StoreError> {
        let locks = self.locks.lock().map_err(|_| poisoned())?;
        Ok(locks.get(key).is_some_and(|l| l.try_lock().is_err()))
    }
}

fn poisoned() -> StoreError {
    StoreError::Unavailable("in-memory store lock poisoned".into())
}

#[derive(Default)]
pub struct MemoryStore {
    accounts: Arc<SyncMutex<HashMap<AccountKey, StoredAccount>>>,
    account_locks: KeyLocks<AccountKey>,
    results: Arc<SyncMutex<HashMap<(UserId, String), Settled>>>,
    result_locks: KeyLocks<(UserId, String)>,
    /// Keys whose claim was abandoned: held until their hold lapses, as PostgreSQL holds them.
    abandoned: Arc<SyncMutex<HashMap<(UserId, String), Abandoned>>>,
    audit: SyncMutex<VecDeque<AuditEntry>>,
    tasks: SyncMutex<Vec<(UserId, Task)>>,
    notes: SyncMutex<Vec<(UserId, Note)>>,
    reminders: SyncMutex<Vec<(UserId, Reminder)>>,
    next_id: std::sync::atomic::AtomicI64,
    mcp_disabled: SyncMutex<std::collections::BTreeSet<(UserId, McpSwitch)>>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every store trait served from one in-memory instance.
    pub fn stores() -> Stores {
        let store = Arc::new(Self::new());
        Stores {
            backend: "memory",
            mcp_switches: store.clone(),
            accounts: store.clone(),
            idempotency: store.clone(),
            audit: store.clone(),
            shared_rate_limits: None,
            ping: store.clone(),
            tasks: store.clone(),
            notes: store.clone(),
            reminders: store,
        }
    }

    fn next_id(&self) -> i64 {
        self.next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }
}

#[async_trait::async_trait]
impl Ping for MemoryStore {
    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

fn account_key(user: &UserId, integration: Integration, account: &str) -> AccountKey {
    (user.clone(), integration, account.to_owned())
}

#[async_trait::async_trait]
impl AccountStore for MemoryStore {
    async fn upsert_account(&self, account: StoredAccount) -> Result<(), StoreError> {
        let key = account_key(&account.user, account.integration, &account.account);
        self.accounts
            .lock()
            .map_err(|_| poisoned())?
            .insert(key, account);
        Ok(())
    }

    async fn list_accounts(&self, user: &UserId) -> Result<Vec<StoredAccount>, StoreError> {
        let accounts = self.accounts.lock().map_err(|_| poisoned())?;
        let mut list: Vec<_> = accounts
            .values()
            .filter(|a| &a.user == user)
            .cloned()
            .collect();
        list.sort_by(|a, b| {
            (a.integration.key(), &a.account).cmp(&(b.integration.key(), &b.account))
        });
        Ok(list)
    }

    async fn get_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Option<StoredAccount>, StoreError> {
        let accounts = self.accounts.lock().map_err(|_| poisoned())?;
        Ok(accounts
            .get(&account_key(user, integration, account))
            .cloned())
    }

    async fn delete_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<bool, StoreError> {
        let mut accounts = self.accounts.lock().map_err(|_| poisoned())?;
        Ok(accounts
            .remove(&account_key(user, integration, account))
            .is_some())
    }

    async fn count_accounts(&self) -> Result<u64, StoreError> {
        Ok(self.accounts.lock().map_err(|_| poisoned())?.len() as u64)
    }

    /// By connection time: this store keeps no update time.
    async fn sample_accounts(
        &self,
        limit: usize,
        newest_first: bool,
    ) -> Result<Vec<StoredAccount>, StoreError> {
        let mut all: Vec<_> = self
            .accounts
            .lock()
            .map_err(|_| poisoned())?
            .values()
            .cloned()
            .collect();
        all.sort_by_key(|a| a.connected_at);
        if newest_first {
            all.reverse();
        }
        all.truncate(limit);
        Ok(all)
    }

    async fn accounts_after(
        &self,
        after: Option<&AccountCursor>,
        limit: usize,
    ) -> Result<Vec<StoredAccount>, StoreError> {
        let mut page: Vec<StoredAccount> = self
            .accounts
            .lock()
            .map_err(|_| poisoned())?
            .values()
            .filter(|a| after.is_none_or(|c| a.walk_key() > c.key()))
            .cloned()
            .collect();
        page.sort_by(|a, b| a.walk_key().cmp(&b.walk_key()));
        page.truncate(limit);
        Ok(page)
    }

    async fn lock_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Box<dyn AccountLock>, StoreError> {
        let key = account_key(user, integration, account);
        let guard = self.account_locks.lock(&key).await?;
        self.locked(guard, user, integration, account).await
    }

    /// A held lock here is a live refresh (nothing in one process outlives its holder).
    async fn lock_account_if_idle(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
        _lapsed_for: std::time::Duration,
    ) -> Result<Option<Box<dyn AccountLock>>, StoreError> {
        let key = account_key(user, integration, account);
        let Some(guard) = self.account_locks.try_lock(&key)? else {
            return Ok(None);
        };
        Ok(Some(self.locked(guard, user, integration, account).await?))
    }
}

impl MemoryStore {
    /// The account as it is now, held by `guard`.
    async fn locked(
        &self,
        guard: OwnedMutexGuard<()>,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Box<dyn AccountLock>, StoreError> {
        let current = self.get_account(user, integration, account).await?;
        Ok(Box::new(MemoryAccountLock {
            _guard: guard,
            current,
            accounts: self.accounts.clone(),
        }))
    }
}

struct MemoryAccountLock {
    _guard: OwnedMutexGuard<()>,
    current: Option<StoredAccount>,
    accounts: Arc<SyncMutex<HashMap<AccountKey, StoredAccount>>>,
}

#[async_trait::async_trait]
impl AccountLock for MemoryAccountLock {
    fn current(&self) -> Option<&StoredAccount> {
        self.current.as_ref()
    }

    async fn save(self: Box<Self>, updated: StoredAccount) -> Result<Saved, StoreError> {
        let Some(locked) = &self.current else {
            return Err(StoreError::Unavailable(format!(
                "the account {} is gone; nothing to save",
                updated.account
            )));
        };
        let key = account_key(&updated.user, updated.integration, &updated.account);
        let mut accounts = self.accounts.lock().map_err(|_| poisoned())?;
        // Only over the account as it was locked, as PostgreSQL's lease does: a reconnect or a
        // disconnect while the refresh ran wins, and a disconnected account does not come back.
        if accounts.get(&key) != Some(locked) {
            return Ok(Saved::Superseded);
        }
        accounts.insert(key, updated);
        Ok(Saved::Applied)
    }
}

/// A key let go without its result (see [`IdempotencyClaim::abandon`]).
#[derive(Debug, Clone, Copy)]
struct Abandoned {
    until: tokio::time::Instant,
    /// `until` on the wall clock, which retention is judged by.
    lapses_at: SystemTime,
    /// Its call had marked a write ([`ActingMark`]).
    acting: bool,
}

/// A stored result and when it was stored (PostgreSQL's `updated_at`).
#[derive(Debug, Clone)]
struct Settled {
    result: StoredResult,
    at: SystemTime,
}

#[async_trait::async_trait]
impl IdempotencyStore for MemoryStore {
    async fn claim(
        &self,
        user: &UserId,
        key: &str,
        hold: std::time::Duration,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError> {
        let k = (user.clone(), key.to_owned());
        let deadline = tokio::time::Instant::now() + hold;
        let busy = || StoreError::InProgress(super::in_progress(hold));
        loop {
            // In one process a holder cannot die without its guard; the wait is still bounded.
            let guard = tokio::time::timeout_at(deadline, self.result_locks.lock(&k))
                .await
                .map_err(|_| busy())??;
            let existing = self
                .results
                .lock()
                .map_err(|_| poisoned())?
                .get(&k)
                .map(|settled| settled.result.clone());
            let left = self
                .abandoned
                .lock()
                .map_err(|_| poisoned())?
                .get(&k)
                .copied();
            match left {
                Some(left) if existing.is_none() && left.until > tokio::time::Instant::now() => {
                    // Held until its hold lapses, as on PostgreSQL, never past this call's.
                    drop(guard);
                    if left.until > deadline {
                        tokio::time::sleep_until(deadline).await;
                        return Err(busy());
                    }
                    tokio::time::sleep_until(left.until).await;
                    continue;
                }
                Some(left) if existing.is_none() && left.acting => {
                    return Err(StoreError::MayHaveActed(super::may_have_acted()));
                }
                Some(_) => {
                    self.abandoned.lock().map_err(|_| poisoned())?.remove(&k);
                }
                None => {}
            }
            return Ok(Box::new(MemoryClaim {
                guard: Some(guard),
                key: k,
                existing,
                lapses: tokio::time::Instant::now() + hold,
                lapses_at: SystemTime::now() + hold,
                acting: Arc::default(),
                results: self.results.clone(),
                abandoned: self.abandoned.clone(),
            }));
        }
    }

    async fn lookup(&self, user: &UserId, key: &str) -> Result<KeyState, StoreError> {
        let k = (user.clone(), key.to_owned());
        if let Some(done) = self.results.lock().map_err(|_| poisoned())?.get(&k) {
            return Ok(KeyState::Done(done.result.clone()));
        }
        let abandoned = self
            .abandoned
            .lock()
            .map_err(|_| poisoned())?
            .get(&k)
            .copied();
        Ok(match abandoned {
            // As on PostgreSQL, where a let-go hold cannot be told from a running one until
            // it lapses.
            Some(a) if a.until > tokio::time::Instant::now() => KeyState::Running,
            // Lapsed: it may have acted only if it marked a write (marked before any leaves).
            Some(a) if a.acting => KeyState::Held,
            Some(_) => KeyState::Free,
            None if self.result_locks.held(&k)? => KeyState::Running,
            None => KeyState::Free,
        })
    }

    /// Settled keys by when they were stored; abandoned ones once their hold lapsed, on the
    /// tokio clock as `claim` judges it, before `older_than`, unless their call marked itself
    /// acting (it may have acted: kept for good, as on PostgreSQL). A key still held by a
    /// running claim is in neither map, so is never touched.
    async fn prune_idempotency(
        &self,
        older_than: SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError> {
        let mut left = limit;
        let mut take = |old: bool| {
            let pruned = old && left > 0;
            left -= usize::from(pruned);
            !pruned
        };
        self.results
            .lock()
            .map_err(|_| poisoned())?
            .retain(|_, settled| take(settled.at < older_than));
        let now = tokio::time::Instant::now();
        self.abandoned
            .lock()
            .map_err(|_| poisoned())?
            .retain(|_, a| take(a.lapses_at < older_than && a.until <= now && !a.acting));
        Ok(limit - left)
    }
}

struct MemoryClaim {
    /// Held until the result is stored (or the claim is dropped).
    guard: Option<OwnedMutexGuard<()>>,
    key: (UserId, String),
    existing: Option<StoredResult>,
    /// When its hold lapses.
    lapses: tokio::time::Instant,
    lapses_at: SystemTime,
    /// Set once its call marked a write.
    acting: Arc<std::sync::atomic::AtomicBool>,
    results: Arc<SyncMutex<HashMap<(UserId, String), Settled>>>,
    abandoned: Arc<SyncMutex<HashMap<(UserId, String), Abandoned>>>,
}

#[async_trait::async_trait]
impl IdempotencyClaim for MemoryClaim {
    fn existing(&self) -> Option<&StoredResult> {
        self.existing.as_ref()
    }

    async fn complete(&mut self, result: &StoredResult) -> Result<(), StoreError> {
        self.results.lock().map_err(|_| poisoned())?.insert(
            self.key.clone(),
            Settled {
                result: result.clone(),
                at: SystemTime::now(),
            },
        );
        self.guard = None;
        Ok(())
    }

    /// Held until its hold lapses, as PostgreSQL holds it (S-5): a store that freed it at
    /// once would let a retry act again at once.
    fn abandon(self: Box<Self>) {
        let left = Abandoned {
            until: self.lapses,
            lapses_at: self.lapses_at,
            acting: self.acting.load(std::sync::atomic::Ordering::Relaxed),
        };
        match self.abandoned.lock() {
            Ok(mut abandoned) => {
                abandoned.insert(self.key.clone(), left);
            }
            Err(_) => tracing::error!("an abandoned idempotency key could not be kept held"),
        }
    }

    fn acting(&self) -> Option<Arc<dyn ActingMark>> {
        self.guard.as_ref()?;
        Some(Arc::new(MemoryActing(self.acting.clone())))
    }
}

struct MemoryActing(Arc<std::sync::atomic::AtomicBool>);

#[async_trait::async_trait]
impl ActingMark for MemoryActing {
    async fn mark(&self) -> Result<(), StoreError> {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

#[async_trait::async_trait]
impl AuditLog for MemoryStore {
    async fn record(&self, record: AuditRecord) -> Result<(), StoreError> {
        self.record_many(&[AuditEntry::now(record)]).await
    }

    async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError> {
        let mut audit = self.audit.lock().map_err(|_| poisoned())?;
        for entry in entries {
            if audit.len() == AUDIT_CAPACITY {
                audit.pop_front();
            }
            audit.push_back(entry.clone());
        }
        Ok(())
    }

    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        let audit = self.audit.lock().map_err(|_| poisoned())?;
        let mut out: Vec<_> = audit
            .iter()
            .rev()
            .map(|e| &e.record)
            .filter(|r| r.user == user.as_str())
            .take(limit)
            .cloned()
            .collect();
        out.reverse();
        Ok(out)
    }

    async fn prune_audit(&self, older_than: SystemTime, limit: usize) -> Result<usize, StoreError> {
        let mut audit = self.audit.lock().map_err(|_| poisoned())?;
        let mut left = limit;
        audit.retain(|e| {
            let pruned = e.at < older_than && left > 0;
            left -= usize::from(pruned);
            !pruned
        });
        Ok(limit - left)
    }
}

/// Pending tasks by due date (undated last), then completed ones, newest first: the order both
/// stores list in.
pub(crate) fn task_order(a: &Task, b: &Task) -> std::cmp::Ordering {
    let key = |t: &Task| {
        (
            t.completed_at.is_some(),
            t.due_at.is_none(),
            t.due_at,
            std::cmp::Reverse(t.id),
        )
    };
    key(a).cmp(&key(b))
}

#[async_trait::async_trait]
impl TaskStore for MemoryStore {
    async fn add_task(
        &self,
        user: &UserId,
        title: &str,
        description: Option<&str>,
        due_at: Option<SystemTime>,
    ) -> Result<Task, StoreError> {
        let task = Task {
            id: self.next_id(),
            title: title.to_owned(),
            description: description.map(str::to_owned),
            due_at,
            completed_at: None,
            created_at: SystemTime::now(),
        };
        self.tasks
            .lock()
            .map_err(|_| poisoned())?
            .push((user.clone(), task.clone()));
        Ok(task)
    }

    async fn list_tasks(&self, user: &UserId, filter: TaskFilter) -> Result<Vec<Task>, StoreError> {
        let tasks = self.tasks.lock().map_err(|_| poisoned())?;
        let mut mine: Vec<Task> = tasks
            .iter()
            .filter(|(u, t)| {
                u == user
                    && match filter {
                        TaskFilter::All => true,
                        TaskFilter::Pending => t.completed_at.is_none(),
                        TaskFilter::Completed => t.completed_at.is_some(),
                    }
            })
            .map(|(_, t)| t.clone())
            .collect();
        mine.sort_by(task_order);
        Ok(mine)
    }

    async fn update_task(
        &self,
        user: &UserId,
        id: i64,
        patch: TaskPatch,
    ) -> Result<Option<Task>, StoreError> {
        let mut tasks = self.tasks.lock().map_err(|_| poisoned())?;
        let Some((_, task)) = tasks.iter_mut().find(|(u, t)| u == user && t.id == id) else {
            return Ok(None);
        };
        if let Some(title) = patch.title {
            task.title = title;
        }
        if let Some(description) = patch.description {
            task.description = description;
        }
        if let Some(due_at) = patch.due_at {
            task.due_at = due_at;
        }
        match patch.completed {
            Some(true) if task.completed_at.is_none() => {
                task.completed_at = Some(SystemTime::now())
            }
            Some(false) => task.completed_at = None,
            _ => {}
        }
        Ok(Some(task.clone()))
    }

    async fn delete_task(&self, user: &UserId, id: i64) -> Result<Option<Task>, StoreError> {
        let mut tasks = self.tasks.lock().map_err(|_| poisoned())?;
        let index = tasks.iter().position(|(u, t)| u == user && t.id == id);
        Ok(index.map(|i| tasks.remove(i).1))
    }
}

/// How well `note` matches the query words: 2 per exact word, 1 per word it merely starts.
fn note_score(note: &Note, query: &[String]) -> u32 {
    let mut text = words(&note.content);
    text.extend(note.tags.iter().flat_map(|t| words(t)));
    query
        .iter()
        .map(|q| {
            if text.iter().any(|w| w == q) {
                2
            } else if text
                .iter()
                .any(|w| w.starts_with(q.as_str()) || q.starts_with(w.as_str()) && w.len() >= 4)
            {
                1
            } else {
                0
            }
        })
        .sum()
}

#[async_trait::async_trait]
impl NoteStore for MemoryStore {
    async fn add_notes(
        &self,
        user: &UserId,
        notes: &[(String, Vec<String>)],
        origin: &str,
    ) -> Result<Vec<Note>, StoreError> {
        let mut stored = self.notes.lock().map_err(|_| poisoned())?;
        let mut out = Vec::new();
        for (content, tags) in notes {
            let note = Note {
                id: self.next_id(),
                content: content.clone(),
                tags: tags.clone(),
                created_at: SystemTime::now(),
                origin: origin.to_owned(),
            };
            stored.push((user.clone(), note.clone()));
            out.push(note);
        }
        Ok(out)
    }

    async fn search_notes(
        &self,
        user: &UserId,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Note>, StoreError> {
        let query = words(query);
        let notes = self.notes.lock().map_err(|_| poisoned())?;
        let mut scored: Vec<(u32, &Note)> = notes
            .iter()
            .filter(|(u, _)| u == user)
            .map(|(_, n)| (note_score(n, &query), n))
            .filter(|(score, _)| *score > 0)
            .collect();
        scored.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.id.cmp(&a.1.id)));
        Ok(scored
            .into_iter()
            .take(limit)
            .map(|(_, n)| n.clone())
            .collect())
    }

    async fn count_notes(&self, user: &UserId) -> Result<u64, StoreError> {
        Ok(self
            .notes
            .lock()
            .map_err(|_| poisoned())?
            .iter()
            .filter(|(u, _)| u == user)
            .count() as u64)
    }
}

#[async_trait::async_trait]
impl ReminderStore for MemoryStore {
    async fn add_reminder(
        &self,
        user: &UserId,
        text: &str,
        due_at: SystemTime,
    ) -> Result<Reminder, StoreError> {
        let reminder = Reminder {
            id: self.next_id(),
            text: text.to_owned(),
            due_at,
            created_at: SystemTime::now(),
        };
        self.reminders
            .lock()
            .map_err(|_| poisoned())?
            .push((user.clone(), reminder.clone()));
        Ok(reminder)
    }

    async fn upcoming_reminders(
        &self,
        user: &UserId,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<Reminder>, StoreError> {
        let reminders = self.reminders.lock().map_err(|_| poisoned())?;
        let mut upcoming: Vec<Reminder> = reminders
            .iter()
            .filter(|(u, r)| u == user && r.due_at >= now)
            .map(|(_, r)| r.clone())
            .collect();
        upcoming.sort_by_key(|r| (r.due_at, r.id));
        upcoming.truncate(limit);
        Ok(upcoming)
    }

    async fn count_reminders(&self, user: &UserId) -> Result<u64, StoreError> {
        Ok(self
            .reminders
            .lock()
            .map_err(|_| poisoned())?
            .iter()
            .filter(|(u, _)| u == user)
            .count() as u64)
    }
}

#[async_trait::async_trait]
impl McpSwitchStore for MemoryStore {
    async fn set_mcp_enabled(
        &self,
        user: &UserId,
        switch: &McpSwitch,
        enabled: bool,
    ) -> Result<(), StoreError> {
        let mut disabled = self.mcp_disabled.lock().map_err(|_| poisoned())?;
        let entry = (user.clone(), switch.clone());
        if enabled {
            disabled.remove(&entry);
        } else {
            disabled.insert(entry);
        }
        Ok(())
    }

    async fn disabled_mcp(&self, user: &UserId) -> Result<Vec<McpSwitch>, StoreError> {
        let disabled = self.mcp_disabled.lock().map_err(|_| poisoned())?;
        Ok(disabled
            .iter()
            .filter(|(u, _)| u == user)
            .map(|(_, s)| s.clone())
            .collect())
    }
}
