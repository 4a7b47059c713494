//! The embedded store: process memory, for local runs and tests with no database.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex as SyncMutex},
};

use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{
    AccountLock, AccountStore, AuditLog, AuditRecord, IdempotencyClaim, IdempotencyStore, Ping,
    StoreError, StoredAccount, StoredResult, Stores,
};
use crate::domain::{Integration, UserId};

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
    async fn lock(&self, key: &K) -> Result<OwnedMutexGuard<()>, StoreError> {
        let lock = {
            let mut locks = self.locks.lock().map_err(|_| poisoned())?;
            // Forget locks nobody holds, so the map does not grow with every key ever seen.
            if locks.len() > 1024 {
                locks.retain(|_, l| Arc::strong_count(l) > 1);
            }
            locks.entry(key.clone()).or_default().clone()
        };
        Ok(lock.lock_owned().await)
    }
}

fn poisoned() -> StoreError {
    StoreError::Unavailable("in-memory store lock poisoned".into())
}

#[derive(Default)]
pub struct MemoryStore {
    accounts: Arc<SyncMutex<HashMap<AccountKey, StoredAccount>>>,
    account_locks: KeyLocks<AccountKey>,
    results: Arc<SyncMutex<HashMap<(UserId, String), StoredResult>>>,
    result_locks: KeyLocks<(UserId, String)>,
    audit: SyncMutex<VecDeque<AuditRecord>>,
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
            accounts: store.clone(),
            idempotency: store.clone(),
            audit: store.clone(),
            shared_rate_limits: None,
            ping: store,
        }
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

    async fn lock_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Box<dyn AccountLock>, StoreError> {
        let key = account_key(user, integration, account);
        let guard = self.account_locks.lock(&key).await?;
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

    async fn save(self: Box<Self>, updated: StoredAccount) -> Result<(), StoreError> {
        let key = account_key(&updated.user, updated.integration, &updated.account);
        self.accounts
            .lock()
            .map_err(|_| poisoned())?
            .insert(key, updated);
        Ok(())
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for MemoryStore {
    async fn claim(
        &self,
        user: &UserId,
        key: &str,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError> {
        let k = (user.clone(), key.to_owned());
        let guard = self.result_locks.lock(&k).await?;
        let existing = self
            .results
            .lock()
            .map_err(|_| poisoned())?
            .get(&k)
            .cloned();
        Ok(Box::new(MemoryClaim {
            _guard: guard,
            key: k,
            existing,
            results: self.results.clone(),
        }))
    }
}

struct MemoryClaim {
    _guard: OwnedMutexGuard<()>,
    key: (UserId, String),
    existing: Option<StoredResult>,
    results: Arc<SyncMutex<HashMap<(UserId, String), StoredResult>>>,
}

#[async_trait::async_trait]
impl IdempotencyClaim for MemoryClaim {
    fn existing(&self) -> Option<&StoredResult> {
        self.existing.as_ref()
    }

    async fn complete(self: Box<Self>, result: StoredResult) -> Result<(), StoreError> {
        self.results
            .lock()
            .map_err(|_| poisoned())?
            .insert(self.key.clone(), result);
        Ok(())
    }
}

#[async_trait::async_trait]
impl AuditLog for MemoryStore {
    async fn record(&self, record: AuditRecord) -> Result<(), StoreError> {
        let mut audit = self.audit.lock().map_err(|_| poisoned())?;
        if audit.len() == AUDIT_CAPACITY {
            audit.pop_front();
        }
        audit.push_back(record);
        Ok(())
    }

    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        let audit = self.audit.lock().map_err(|_| poisoned())?;
        let mut out: Vec<_> = audit
            .iter()
            .rev()
            .filter(|r| r.user == user.as_str())
            .take(limit)
            .cloned()
            .collect();
        out.reverse();
        Ok(out)
    }
}
