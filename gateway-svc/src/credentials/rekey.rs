//! Moving stored tokens to a new CREDENTIALS_KEY (G-8). With CREDENTIALS_REKEY on (a
//! rotation's last step, CREDENTIALS_KEY_PREVIOUS the old key), each replica walks every
//! stored account in key order and re-encrypts, under the current key, the tokens still under
//! the previous one — so a rotation ends without waiting for every account to be refreshed or
//! reconnected, and the old key can go. Never in the first step: there the previous key is the
//! new one, and a walk would move tokens back.
//!
//! Each account is moved under its refresh lock and saved as a compare-and-swap on the
//! tokens the lock read, as a refresh is: a reconnect meanwhile wins, and nothing is
//! re-encrypted twice over. An account being refreshed (or walked by another replica) is left
//! for the next walk, never waited for or taken over (unless its lease was left by a dead
//! replica), and a walk's save lands only while it still holds the lease, so a walk never
//! supersedes a refresh. Replicas walking at once skip what another has moved.
//! Walking repeats every CREDENTIALS_REKEY_INTERVAL ([`DEFAULT_INTERVAL`]) until one whole
//! walk finds nothing under the previous key (a replica of the rollout before may still have written one meanwhile), then ends.

use std::{sync::Arc, time::Duration};

use svc_kit::periodic::{FirstSweep, Then, abort_at, spawn_every_until};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{
    TokenRead, TokensRead,
    cipher::{KeyUsed, TokenCipher},
    row_id,
};
use crate::store::{AccountCursor, AccountStore, Saved, StoreError, StoredAccount};

/// How often a replica walks while there may be tokens to move, unless
/// CREDENTIALS_REKEY_INTERVAL says otherwise; the first walk comes at a random point of the
/// first interval, so replicas a rollout starts together do not walk together, and a rollout
/// is usually over before the first walk begins.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(300);

/// Accounts read per page of a walk.
pub const PAGE: usize = 200;

/// How long past its lapse a refresh's lease is taken over by a walk, so that a walk only
/// ever takes an account a dead replica left, never one whose refresh is about to save (which
/// the walk's save would supersede, losing the fresh tokens and a refresh token the provider
/// rotated). A refresh's token request is bounded by its lease; its save by a checkout (the
/// pool's wait, a recycle and a connect, each up to DATABASE_ACQUIRE_TIMEOUT) and the row
/// lock's wait (DATABASE_LOCK_TIMEOUT): 20 minutes at those settings' 300 s maxima, 20 s at
/// their defaults (a statement stalled on the network after it was sent is not bounded: no
/// statement timeout is set). An hour is well past both; the cost is an account a replica died
/// refreshing, and nobody has called since, moved by a walk an hour later.
pub const ABANDONED_AFTER: Duration = Duration::from_secs(60 * 60);

/// What one walk over every stored account found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Walk {
    /// Accounts read.
    pub read: usize,
    /// Saved under the current key by this walk.
    pub moved: usize,
    /// Under the previous key and not moved: the account was being refreshed or walked by
    /// another replica, or it changed between the walk's lock and its save and is still
    /// under the previous key (a reconnect by a replica of the rollout before, say). The next
    /// walk looks again.
    pub left: usize,
    /// Some token read with neither key (stored under another key, or damaged) and none under
    /// the previous one: only a reconnect mends them, and they do not keep the previous key
    /// needed.
    pub unreadable: usize,
}

impl Walk {
    /// Nothing under the previous key was met: every readable token is under the current one.
    pub fn found_none(&self) -> bool {
        self.moved == 0 && self.left == 0
    }
}

/// How one account fared.
enum Fared {
    Already,
    Moved,
    Left,
    Unreadable,
}

/// One walk over every stored account, `page` at a time. A store error ends the walk: the
/// next one starts again from the first account (what was moved stays moved).
pub async fn walk(
    store: &dyn AccountStore,
    cipher: &TokenCipher,
    page: usize,
) -> Result<Walk, StoreError> {
    let mut walk = Walk::default();
    let mut after: Option<AccountCursor> = None;
    loop {
        let accounts = store.accounts_after(after.as_ref(), page).await?;
        for listed in &accounts {
            walk.read += 1;
            match move_one(store, cipher, listed).await? {
                Fared::Already => {}
                Fared::Moved => {
                    // Counted as it lands: a walk that fails later has still moved it.
                    crate::metrics::credentials_moved();
                    walk.moved += 1;
                }
                Fared::Left => walk.left += 1,
                Fared::Unreadable => walk.unreadable += 1,
            }
        }
        match accounts.last() {
            Some(last) if accounts.len() == page => after = Some(AccountCursor::of(last)),
            _ => return Ok(walk),
        }
    }
}

async fn move_one(
    store: &dyn AccountStore,
    cipher: &TokenCipher,
    listed: &StoredAccount,
) -> Result<Fared, StoreError> {
    // Read unlocked first: most accounts need nothing, and take no lock.
    if let Some(fared) = nothing_to_move(&TokensRead::of(cipher, listed)) {
        return Ok(fared);
    }
    let Some(lock) = store
        .lock_account_if_idle(
            &listed.user,
            listed.integration,
            &listed.account,
            ABANDONED_AFTER,
        )
        .await?
    else {
        // Being refreshed: the next walk looks again.
        return Ok(Fared::Left);
    };
    // As it is now, under the lock: a refresh or reconnect may have moved it already.
    let Some(current) = lock.current().cloned() else {
        return Ok(Fared::Already);
    };
    let read = TokensRead::of(cipher, &current);
    if let Some(fared) = nothing_to_move(&read) {
        return Ok(fared);
    }
    let row = row_id(&current.user, current.integration, &current.account);
    // A token under the previous key is re-encrypted; any other is kept as stored, one that
    // reads with neither key included (only a reconnect mends it).
    let moved = |read: &TokenRead, stored: &[u8]| match read {
        TokenRead::Under(plain, KeyUsed::Previous) => cipher
            .encrypt(plain, &row)
            .map_err(|e| StoreError::Unavailable(format!("could not re-encrypt a token: {e}"))),
        _ => Ok(stored.to_vec()),
    };
    let mut updated = current.clone();
    updated.access_token = moved(&read.access, &current.access_token)?;
    updated.refresh_token = match (&read.refresh, &current.refresh_token) {
        (Some(read), Some(stored)) => Some(moved(read, stored)?),
        _ => current.refresh_token.clone(),
    };
    if lock.save(updated).await? == Saved::Applied {
        return Ok(Fared::Moved);
    }
    // Changed meanwhile (a reconnect, a refresh that took over the lease): as it is now. A
    // read that fails leaves it for the next walk rather than ending this one.
    Ok(
        match store
            .get_account(&listed.user, listed.integration, &listed.account)
            .await
        {
            Ok(None) => Fared::Already,
            Ok(Some(now)) => nothing_to_move(&TokensRead::of(cipher, &now)).unwrap_or(Fared::Left),
            Err(_) => Fared::Left,
        },
    )
}

/// How an account fares without a save: every token under the current key already, or none
/// under the previous one and some read with neither key. `None` when a token is to move.
fn nothing_to_move(read: &TokensRead) -> Option<Fared> {
    if read.any_previous() {
        None
    } else if read.all_current() {
        Some(Fared::Already)
    } else {
        Some(Fared::Unreadable)
    }
}

/// Walks every `interval` while `cipher` holds a previous key, until a walk finds nothing
/// under it (the task then ends) or `stop` is cancelled, which aborts the task (a save in
/// flight lands whole or not at all); logs what each walk did.
pub fn spawn(
    store: Arc<dyn AccountStore>,
    cipher: TokenCipher,
    interval: Duration,
    stop: CancellationToken,
) -> Option<JoinHandle<()>> {
    if !cipher.has_previous() {
        return None;
    }
    let task = spawn_every_until(interval, FirstSweep::Spread, move || {
        let (store, cipher) = (store.clone(), cipher.clone());
        async move {
            let walked = walk(&*store, &cipher, PAGE).await;
            match &walked {
                Ok(w) => crate::metrics::rekey_walked(w.left, w.unreadable),
                Err(_) => crate::metrics::rekey_walk_failed(),
            }
            match walked {
                Ok(w) if w.found_none() => {
                    tracing::info!(
                        read = w.read,
                        unreadable = w.unreadable,
                        "a walk over every stored account found no token under CREDENTIALS_KEY_PREVIOUS: \
                         once every replica has said so, CREDENTIALS_KEY_PREVIOUS and CREDENTIALS_REKEY can be unset"
                    );
                    return Then::Done;
                }
                Ok(w) => tracing::info!(
                    read = w.read,
                    moved = w.moved,
                    left = w.left,
                    unreadable = w.unreadable,
                    "moved {} stored account(s) from CREDENTIALS_KEY_PREVIOUS to CREDENTIALS_KEY; \
                     {} left for the next walk",
                    w.moved,
                    w.left,
                ),
                Err(e) => tracing::warn!(
                    error = %e,
                    "could not finish moving stored tokens to CREDENTIALS_KEY; the next walk starts over"
                ),
            }
            Then::Again
        }
    });
    abort_at(&task, stop.cancelled_owned());
    Some(task)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        domain::{Integration, UserId},
        store::{AccountStatus, memory::MemoryStore},
    };

    const OLD: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
    const NEW: &str = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk=";

    fn cipher(key: &str) -> TokenCipher {
        TokenCipher::from_base64(key).unwrap()
    }

    /// G-8: a replica given a previous key moves the tokens under it in the background, within
    /// its first interval; one given no previous key has nothing to move and starts no walk.
    /// On tokio's paused clock: the interval passes at once, and the walk's random start too.
    #[tokio::test(start_paused = true)]
    async fn g8_a_rotating_replica_moves_stored_tokens_to_the_new_key_within_its_first_interval_and_ends_once_none_are_left()
     {
        let stores = MemoryStore::stores();
        let user = UserId::parse("u1").unwrap();
        let row = row_id(&user, Integration::Gmail, "a@x.com");
        stores
            .accounts
            .upsert_account(StoredAccount {
                user: user.clone(),
                integration: Integration::Gmail,
                account: "a@x.com".into(),
                access_token: cipher(OLD).encrypt("access", &row).unwrap(),
                refresh_token: None,
                expires_at: None,
                scopes: vec![],
                status: AccountStatus::Connected,
                connected_at: std::time::SystemTime::UNIX_EPOCH,
            })
            .await
            .unwrap();
        let stop = CancellationToken::new();
        assert!(
            spawn(
                stores.accounts.clone(),
                cipher(NEW),
                DEFAULT_INTERVAL,
                stop.clone()
            )
            .is_none()
        );

        let walking = spawn(
            stores.accounts.clone(),
            cipher(NEW).with_previous(cipher(OLD)),
            DEFAULT_INTERVAL,
            stop.clone(),
        )
        .expect("a previous key: a walk to make");
        tokio::time::sleep(DEFAULT_INTERVAL).await;
        let stored = stores
            .accounts
            .get_account(&user, Integration::Gmail, "a@x.com")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            cipher(NEW).decrypt(&stored.access_token, &row).unwrap(),
            "access"
        );
        stop.cancel();
        assert!(
            walking.await.unwrap_err().is_cancelled(),
            "ended at the stop"
        );

        // Restarted with nothing left under the old key: its first walk says so, and it ends.
        let walking = spawn(
            stores.accounts.clone(),
            cipher(NEW).with_previous(cipher(OLD)),
            DEFAULT_INTERVAL,
            CancellationToken::new(),
        )
        .expect("a previous key: a walk to make");
        tokio::time::timeout(DEFAULT_INTERVAL, walking)
            .await
            .expect("ended within its first interval")
            .expect("ended by itself");
    }

    /// A store whose walks fail at their first page (the database gone, say).
    struct Unlistable;

    #[async_trait::async_trait]
    impl AccountStore for Unlistable {
        async fn accounts_after(
            &self,
            _: Option<&AccountCursor>,
            _: usize,
        ) -> Result<Vec<StoredAccount>, StoreError> {
            Err(StoreError::Unavailable("the database is gone".into()))
        }
        // A walk that cannot list reads and writes nothing else.
        async fn upsert_account(&self, _: StoredAccount) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn list_accounts(&self, _: &UserId) -> Result<Vec<StoredAccount>, StoreError> {
            unreachable!()
        }
        async fn get_account(
            &self,
            _: &UserId,
            _: Integration,
            _: &str,
        ) -> Result<Option<StoredAccount>, StoreError> {
            unreachable!()
        }
        async fn delete_account(
            &self,
            _: &UserId,
            _: Integration,
            _: &str,
        ) -> Result<bool, StoreError> {
            unreachable!()
        }
        async fn count_accounts(&self) -> Result<u64, StoreError> {
            unreachable!()
        }
        async fn sample_accounts(
            &self,
            _: usize,
            _: bool,
        ) -> Result<Vec<StoredAccount>, StoreError> {
            unreachable!()
        }
        async fn lock_account(
            &self,
            _: &UserId,
            _: Integration,
            _: &str,
        ) -> Result<Box<dyn crate::store::AccountLock>, StoreError> {
            unreachable!()
        }
        async fn lock_account_if_idle(
            &self,
            _: &UserId,
            _: Integration,
            _: &str,
            _: Duration,
        ) -> Result<Option<Box<dyn crate::store::AccountLock>>, StoreError> {
            unreachable!()
        }
    }

    /// G-8: a walk that fails is counted as failed, and walking goes on: the gauges, set only
    /// by a walk that finishes, are not taken for this one's.
    #[tokio::test(start_paused = true)]
    async fn g8_a_failed_walk_is_counted_as_failed_and_the_next_one_still_comes() {
        let metrics = svc_kit::metrics::recorder();
        let failed = || {
            metrics
                .render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("steward_gateway_credentials_walks_total{outcome=\"failed\"} ")
                        .map(|n| n.parse::<u64>().unwrap())
                })
                .unwrap_or(0)
        };
        let before = failed();
        let walking = spawn(
            Arc::new(Unlistable),
            cipher(NEW).with_previous(cipher(OLD)),
            DEFAULT_INTERVAL,
            CancellationToken::new(),
        )
        .expect("a previous key: a walk to make");
        // The first walk comes within the first interval, the second one interval later.
        tokio::time::sleep(DEFAULT_INTERVAL * 2).await;
        assert!(!walking.is_finished(), "a failed walk does not end walking");
        assert!(failed() >= before + 2, "each failed walk counted");
        walking.abort();
    }
}
