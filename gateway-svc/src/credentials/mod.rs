//! Credentials (G-8): connected accounts with tokens encrypted at rest, access tokens refreshed
//! before they expire or after a 401, single-flight per account within a process (an async
//! mutex) and across replicas (the account row lock), and a revoked grant turned into "needs
//! reconnect".

pub mod cipher;
pub mod oauth;
pub mod rekey;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex as SyncMutex},
    time::{Duration, SystemTime},
};

use cipher::{KeyUsed, TokenCipher};
use oauth::{OAuthClient, RefreshError};

use crate::{
    domain::{Integration, Provider, UserId},
    enforce::ToolError,
    store::{AccountLock, AccountStatus, AccountStore, Saved, StoreError, StoredAccount},
};

/// Refresh this long before expiry, so a token does not die in flight.
const EXPIRY_SKEW: Duration = Duration::from_secs(60);

/// A connected account as tools see it: no tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct AccountInfo {
    pub integration: Integration,
    pub account: String,
    pub status: AccountStatus,
    pub scopes: Vec<String>,
    pub expires_at: Option<SystemTime>,
    pub connected_at: SystemTime,
}

/// What ConnectAccount supplies.
#[derive(Debug, Clone)]
pub struct NewAccount {
    pub integration: Integration,
    pub account: String,
    pub access_token: String,
    pub refresh_token: Option<String>,
    pub expires_at: Option<SystemTime>,
    pub scopes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Invalid(String),
    #[error(
        "no CREDENTIALS_KEY is configured, so tokens cannot be stored; set it to 32 random bytes in base64"
    )]
    NoKey,
}

/// A user's accounts of one integration as a call sees them. Those that need reconnecting are
/// kept by name, never dropped quietly (G-8): a call over every account says which it could
/// not use, and a call naming one is told it needs reconnecting.
#[derive(Debug, Clone, PartialEq)]
pub struct Accounts {
    pub integration: Integration,
    /// Connected: usable.
    pub usable: Vec<AccountInfo>,
    /// The accounts that need reconnecting before they can be used again.
    pub to_reconnect: Vec<String>,
}

impl Accounts {
    /// The usable account named `named` (case-insensitive); `CredentialsRevoked` when it is
    /// one that needs reconnecting; `None` when the user has no such account.
    pub fn named(&self, named: &str) -> Result<Option<&AccountInfo>, ToolError> {
        if let Some(a) = self
            .usable
            .iter()
            .find(|a| a.account.eq_ignore_ascii_case(named))
        {
            return Ok(Some(a));
        }
        match self
            .to_reconnect
            .iter()
            .find(|a| a.eq_ignore_ascii_case(named))
        {
            Some(account) => Err(revoked(self.integration, account)),
            None => Ok(None),
        }
    }

    /// What a call over every usable account must add: the accounts it did not reach.
    pub fn left_out(&self, verb: &str) -> Option<String> {
        match self.to_reconnect.as_slice() {
            [] => None,
            [one] => Some(format!(
                "({one} was not {verb}: it needs to be reconnected.)"
            )),
            many => Some(format!(
                "({} were not {verb}: they need to be reconnected.)",
                crate::registry::quoted_list(many)
            )),
        }
    }
}

#[derive(Clone)]
pub struct Credentials {
    store: Arc<dyn AccountStore>,
    cipher: Option<TokenCipher>,
    google: Option<OAuthClient>,
    http: reqwest::Client,
    inflight: Arc<SyncMutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

fn row_id(user: &UserId, integration: Integration, account: &str) -> String {
    format!("{user}/{}/{account}", integration.key())
}

impl Credentials {
    pub fn new(
        store: Arc<dyn AccountStore>,
        cipher: Option<TokenCipher>,
        google: Option<OAuthClient>,
        http: reqwest::Client,
    ) -> Self {
        Self {
            store,
            cipher,
            google,
            http,
            inflight: Arc::default(),
        }
    }

    fn info(a: &StoredAccount) -> AccountInfo {
        AccountInfo {
            integration: a.integration,
            account: a.account.clone(),
            status: a.status,
            scopes: a.scopes.clone(),
            expires_at: a.expires_at,
            connected_at: a.connected_at,
        }
    }

    pub async fn connect(
        &self,
        user: &UserId,
        new: NewAccount,
    ) -> Result<AccountInfo, CredentialError> {
        let cipher = self.cipher.as_ref().ok_or(CredentialError::NoKey)?;
        if new.integration.provider().is_none() {
            return Err(CredentialError::Invalid(format!(
                "{} needs no account; it is always available",
                new.integration.label()
            )));
        }
        if new.integration.provider() == Some(Provider::Google) && new.refresh_token.is_none() {
            return Err(CredentialError::Invalid(
                "refresh_token is required for Google accounts, so access can be renewed".into(),
            ));
        }
        let row = row_id(user, new.integration, &new.account);
        let encrypt = |t: &str| {
            cipher
                .encrypt(t, &row)
                .map_err(|e| CredentialError::Invalid(e.to_string()))
        };
        let stored = StoredAccount {
            user: user.clone(),
            integration: new.integration,
            account: new.account,
            access_token: encrypt(&new.access_token)?,
            refresh_token: new.refresh_token.as_deref().map(encrypt).transpose()?,
            expires_at: new.expires_at,
            scopes: new.scopes,
            status: AccountStatus::Connected,
            connected_at: SystemTime::now(),
        };
        let info = Self::info(&stored);
        self.store.upsert_account(stored).await?;
        Ok(info)
    }

    pub async fn list(&self, user: &UserId) -> Result<Vec<AccountInfo>, StoreError> {
        Ok(self
            .store
            .list_accounts(user)
            .await?
            .iter()
            .map(Self::info)
            .collect())
    }

    pub async fn disconnect(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<bool, StoreError> {
        self.store.delete_account(user, integration, account).await
    }

    /// The user's accounts of `integration`: those that can be used, and those that need
    /// reconnecting.
    pub async fn accounts(
        &self,
        user: &UserId,
        integration: Integration,
    ) -> Result<Accounts, StoreError> {
        let (usable, to_reconnect): (Vec<_>, Vec<_>) = self
            .list(user)
            .await?
            .into_iter()
            .filter(|a| a.integration == integration)
            .partition(|a| a.status == AccountStatus::Connected);
        Ok(Accounts {
            integration,
            usable,
            to_reconnect: to_reconnect.into_iter().map(|a| a.account).collect(),
        })
    }

    /// The user's accounts of `integration`, at least one usable; `CredentialsMissing` when
    /// none is connected, `CredentialsRevoked` naming every account when all need
    /// reconnecting.
    pub async fn usable_accounts(
        &self,
        user: &UserId,
        integration: Integration,
    ) -> Result<Accounts, ToolError> {
        self.usable_accounts_named(user, integration, None).await
    }

    /// As [`Self::usable_accounts`], for a call that names the account it means: when all need
    /// reconnecting and `named` is one of them, the refusal names it, not another.
    pub async fn usable_accounts_named(
        &self,
        user: &UserId,
        integration: Integration,
        named: Option<&str>,
    ) -> Result<Accounts, ToolError> {
        let accounts = self
            .accounts(user, integration)
            .await
            .map_err(|e| ToolError::Internal(e.to_string()))?;
        if accounts.usable.is_empty() {
            // The named account first: `named` refuses one that needs reconnecting by name.
            if let Some(named) = named {
                accounts.named(named)?;
            }
            return Err(match accounts.to_reconnect.as_slice() {
                [] => ToolError::CredentialsMissing { integration },
                [one] => revoked(integration, one),
                many => revoked_all(integration, many),
            });
        }
        Ok(accounts)
    }

    /// A valid access token, refreshed first if it expires within a minute. With
    /// `rejected = Some(token)` (the upstream answered 401 to it), refreshes unless another call
    /// already replaced that token.
    pub async fn access_token(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
        rejected: Option<&str>,
    ) -> Result<String, ToolError> {
        let internal = |e: &dyn std::fmt::Display| ToolError::Internal(e.to_string());
        let cipher = self
            .cipher
            .as_ref()
            .ok_or_else(|| internal(&CredentialError::NoKey))?;
        let row = row_id(user, integration, account);
        let stored = self
            .store
            .get_account(user, integration, account)
            .await
            .map_err(|e| internal(&e))?
            .ok_or(ToolError::CredentialsMissing { integration })?;
        if let Some(token) = usable_token(cipher, &stored, &row, rejected)? {
            return Ok(token);
        }

        // Single flight in this process; the row lock below makes it single flight across
        // replicas, and the re-check under it lets late arrivals reuse the winner's token.
        let flight = {
            let mut map = self
                .inflight
                .lock()
                .map_err(|_| internal(&"credential lock poisoned"))?;
            if map.len() > 1024 {
                map.retain(|_, l| Arc::strong_count(l) > 1);
            }
            map.entry(row.clone()).or_default().clone()
        };
        let _flight = flight.lock().await;
        let lock = self
            .store
            .lock_account(user, integration, account)
            .await
            .map_err(|e| match e {
                // Another replica's refresh outlasted the wait (it died mid-refresh, or the
                // token endpoint is slow): its lease lapses within seconds.
                StoreError::InProgress(why) => {
                    tracing::warn!(user = %user, integration = integration.key(), account, why, "gave up waiting for another replica's token refresh");
                    ToolError::SignInRenewing {
                        provider: integration
                            .provider()
                            .map_or(integration.label(), Provider::label),
                    }
                }
                e => internal(&e),
            })?;
        let current = lock
            .current()
            .cloned()
            .ok_or(ToolError::CredentialsMissing { integration })?;
        if let Some(token) = usable_token(cipher, &current, &row, rejected)? {
            return Ok(token);
        }
        let refresh_token = match &current.refresh_token {
            Some(t) => cipher
                .decrypt(t, &row)
                .map_err(|e| undecryptable(&current, &e))?,
            None => return Err(cannot_renew(lock, current).await),
        };
        let oauth = match integration.provider() {
            Some(Provider::Google) => self.google.as_ref().ok_or_else(|| {
                internal(&"GOOGLE_CLIENT_ID and GOOGLE_CLIENT_SECRET are not configured, so Google tokens cannot be refreshed")
            })?,
            _ => return Err(cannot_renew(lock, current).await),
        };
        tracing::info!(user = %user, integration = integration.key(), account, "refreshing access token");
        match oauth.refresh(&self.http, &refresh_token).await {
            Ok(fresh) => {
                let mut updated = current.clone();
                updated.access_token = cipher
                    .encrypt(&fresh.access_token, &row)
                    .map_err(|e| internal(&e))?;
                // Written again even when the provider kept it: under CREDENTIALS_KEY, so an
                // account refreshed since a key rotation needs CREDENTIALS_KEY_PREVIOUS no more.
                let kept = fresh.refresh_token.as_deref().unwrap_or(&refresh_token);
                updated.refresh_token = Some(cipher.encrypt(kept, &row).map_err(|e| internal(&e))?);
                updated.expires_at = fresh.expires_in.map(|d| SystemTime::now() + d);
                if lock.save(updated).await.map_err(|e| internal(&e))? == Saved::Superseded {
                    not_saved(&current, "the refreshed tokens were");
                }
                Ok(fresh.access_token)
            }
            Err(RefreshError::Revoked) => {
                tracing::warn!(user = %user, integration = integration.key(), account, "refresh token revoked; account needs reconnecting");
                let mut updated = current.clone();
                updated.status = AccountStatus::NeedsReconnect;
                if lock.save(updated).await.map_err(|e| internal(&e))? == Saved::Superseded {
                    not_saved(&current, "the needs-reconnecting mark was");
                }
                Err(revoked(integration, account))
            }
            Err(RefreshError::Failed(detail)) => Err(ToolError::UpstreamUnavailable {
                service: integration
                    .provider()
                    .map_or("the token service", Provider::label),
                detail: format!("token refresh failed: {detail}"),
            }),
        }
    }
}

impl Credentials {
    /// The upstream refused `token` for good (although it had just been refreshed or
    /// replaced, or in words such as Slack's `token_revoked`): the grant no longer gives
    /// access (scopes withdrawn, the account disabled, the app uninstalled), and only
    /// reconnecting helps. The account is marked so — as the model is told — unless another call has put a
    /// different token in place since, which may still work. A failure to record it is logged:
    /// the call's answer is the same.
    pub async fn refused_fresh(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
        token: &str,
    ) {
        let marked = async {
            let cipher = self.cipher.as_ref().ok_or(CredentialError::NoKey)?;
            let lock = self.store.lock_account(user, integration, account).await?;
            let Some(current) = lock.current().cloned() else {
                return Ok(false);
            };
            let row = row_id(user, integration, account);
            let same = cipher
                .decrypt(&current.access_token, &row)
                .is_ok_and(|t| t == token);
            if !same || current.status == AccountStatus::NeedsReconnect {
                return Ok(false);
            }
            let mut updated = current;
            updated.status = AccountStatus::NeedsReconnect;
            Ok::<_, CredentialError>(lock.save(updated).await? == Saved::Applied)
        };
        match marked.await {
            Ok(true) => {
                tracing::warn!(user = %user, integration = integration.key(), account, "a token was refused for good; account needs reconnecting");
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(user = %user, integration = integration.key(), account, error = %e, "could not mark the account as needing reconnection");
            }
        }
    }
}

/// `current`'s token expired or was refused and nothing can renew it (no refresh token, a
/// provider such as Slack that has none): marked as needing reconnecting, so the next call
/// picks another account instead of failing on this one forever (G-8). A failure to record it
/// is logged: the call's answer is the same.
async fn cannot_renew(lock: Box<dyn AccountLock>, current: StoredAccount) -> ToolError {
    let error = revoked(current.integration, &current.account);
    let mut updated = current.clone();
    updated.status = AccountStatus::NeedsReconnect;
    let (user, integration, account) = (&current.user, current.integration.key(), &current.account);
    match lock.save(updated).await {
        Ok(Saved::Applied) => {
            tracing::warn!(user = %user, integration, account = %account, "a token that cannot be renewed expired or was refused; account needs reconnecting");
        }
        Ok(Saved::Superseded) => not_saved(&current, "the needs-reconnecting mark was"),
        Err(e) => {
            tracing::error!(user = %user, integration, account = %account, error = %e, "could not mark the account as needing reconnection");
        }
    }
    error
}

/// A save of `account` lost to a change made meanwhile, which stays.
fn not_saved(account: &StoredAccount, what: &str) {
    tracing::warn!(
        user = %account.user,
        integration = account.integration.key(),
        account = %account.account,
        "{what} not saved: the account changed meanwhile (reconnected, disconnected, or newer tokens saved elsewhere), and that stays"
    );
}

fn revoked(integration: Integration, account: &str) -> ToolError {
    revoked_all(integration, &[account.to_owned()])
}

/// Every one of `accounts` needs reconnecting.
fn revoked_all(integration: Integration, accounts: &[String]) -> ToolError {
    ToolError::CredentialsRevoked {
        provider: integration
            .provider()
            .map_or(integration.label(), Provider::label),
        accounts: accounts.to_vec(),
    }
}

/// A stored token that cannot be decrypted (written under another key, or damaged): no retry
/// can read it, so the user is told to reconnect the account, which stores a fresh one. Not
/// marked as needing reconnecting: a replica given the wrong key would mark every account.
fn undecryptable(stored: &StoredAccount, e: &dyn std::fmt::Display) -> ToolError {
    tracing::error!(
        user = %stored.user,
        integration = stored.integration.key(),
        account = %stored.account,
        error = %e,
        "a stored token cannot be decrypted (CREDENTIALS_KEY changed, or the row is damaged); the account must be reconnected"
    );
    revoked(stored.integration, &stored.account)
}

/// How many stored accounts start-up reads with CREDENTIALS_KEY before serving.
pub const KEY_CHECK_SAMPLE: usize = 20;

/// What reading the sampled accounts' access tokens found (counts only: no token leaves
/// [`check_key`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyCheck {
    pub sampled: usize,
    /// Every token read with the current key.
    pub current: usize,
    /// Some token read with the previous key (CREDENTIALS_KEY_PREVIOUS): not yet saved since
    /// rotation.
    pub previous: usize,
}

impl KeyCheck {
    /// Read with neither key: stored under another key, or damaged.
    pub fn unreadable(&self) -> usize {
        self.sampled - self.current - self.previous
    }
}

/// Reads the tokens of up to `limit` stored accounts, most recently saved first (or least
/// recently, with `newest_first` false), with `cipher`, as [`Credentials`] reads them (the row identity as associated data): a replica
/// given the wrong key finds none readable, and refuses to start instead of telling every
/// user to reconnect and storing tokens the other replicas cannot read.
///
/// An account marked as needing reconnecting is sampled too: the mark leaves its ciphertext
/// as it was stored, so it shows which key it was stored with as well as any other; leaving
/// such accounts out would leave nothing to check in a store where most need reconnecting.
pub async fn check_key(
    store: &dyn AccountStore,
    cipher: &TokenCipher,
    limit: usize,
    newest_first: bool,
) -> Result<KeyCheck, StoreError> {
    let sample = store.sample_accounts(limit, newest_first).await?;
    let mut check = KeyCheck {
        sampled: sample.len(),
        current: 0,
        previous: 0,
    };
    for a in &sample {
        let read = TokensRead::of(cipher, a);
        if read.any_previous() {
            check.previous += 1;
        } else if read.all_current() {
            check.current += 1;
        }
    }
    Ok(check)
}

/// An account's stored tokens as read, with the key each was under (the start-up key check
/// and the rotation walk).
struct TokensRead {
    access: TokenRead,
    refresh: Option<TokenRead>,
}

/// One stored token as read: with one of the keys, or with neither (stored under another key,
/// or damaged).
enum TokenRead {
    Under(String, KeyUsed),
    Unreadable,
}

impl TokensRead {
    fn of(cipher: &TokenCipher, a: &StoredAccount) -> Self {
        let row = row_id(&a.user, a.integration, &a.account);
        let read = |t: &[u8]| match cipher.decrypt_which(t, &row) {
            Ok((plain, key)) => TokenRead::Under(plain, key),
            Err(_) => TokenRead::Unreadable,
        };
        Self {
            access: read(&a.access_token),
            refresh: a.refresh_token.as_deref().map(read),
        }
    }

    fn each(&self) -> impl Iterator<Item = &TokenRead> {
        std::iter::once(&self.access).chain(self.refresh.as_ref())
    }

    /// Every token read, and under the current key.
    fn all_current(&self) -> bool {
        self.each()
            .all(|t| matches!(t, TokenRead::Under(_, KeyUsed::Current)))
    }

    /// Some token still needs the previous key: an account whose refresh token is under it
    /// needs it as much as one whose access token is, and one whose other token reads with
    /// neither key still needs it for the one that reads (its access token serves until it
    /// expires).
    fn any_previous(&self) -> bool {
        self.each()
            .any(|t| matches!(t, TokenRead::Under(_, KeyUsed::Previous)))
    }
}

/// The stored access token if it can be used as is.
fn usable_token(
    cipher: &TokenCipher,
    stored: &StoredAccount,
    row: &str,
    rejected: Option<&str>,
) -> Result<Option<String>, ToolError> {
    if stored.status == AccountStatus::NeedsReconnect {
        return Err(revoked(stored.integration, &stored.account));
    }
    let token = cipher
        .decrypt(&stored.access_token, row)
        .map_err(|e| undecryptable(stored, &e))?;
    let fresh = stored
        .expires_at
        .is_none_or(|at| at > SystemTime::now() + EXPIRY_SKEW);
    // After a 401: a token another caller has put in place since, if it has not expired too.
    let replaced = rejected.is_some_and(|r| r != token);
    let usable = fresh && (rejected.is_none() || replaced);
    Ok(usable.then_some(token))
}
