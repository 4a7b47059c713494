//! The PostgreSQL store. gateway-svc owns the `gateway` schema; its migrations live in
//! `gateway-svc/migrations` and are embedded in the binary.
//!
//! Nothing here holds a pooled connection across upstream I/O: an idempotency key is a
//! committed claim row with a lease (pending → done) and a token refresh a lease on the account
//! row. The reads every run makes are grouped across users (`reads`).

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use svc_kit::pg::Pooled;
use svc_kit::{pg, server_config::DatabaseConfig};
use tokio_postgres::Row;

use super::{
    AccountCursor, AccountLock, AccountStatus, AccountStore, ActingMark, AuditEntry, AuditLog,
    AuditRecord, IdempotencyClaim, IdempotencyStore, KeyState, McpSwitchStore, Note, NoteStore,
    Ping, Reminder, ReminderStore, Saved, StoreError, StoredAccount, StoredResult, Stores, Task,
    TaskFilter, TaskPatch, TaskStore,
};
use crate::{
    domain::{Integration, McpSwitch, UserId},
    ratelimit::postgres::PgRateLimits,
};

mod reads;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory-lock key serialising gateway-svc migrations across replicas ("gatewysv" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x6761_7465_7779_7376;

pub struct PgStore {
    pool: pg::PgPool,
    reads: reads::Reads,
}

impl PgStore {
    /// Applies pending migrations of the `gateway` schema and returns (the `migrate` subcommand,
    /// for a Kubernetes Job; start-up does the same first).
    pub async fn migrate(url: &str) -> Result<(), StoreError> {
        let mut runner = embedded::migrations::runner();
        runner.set_migration_table_name("gateway_schema_history");
        pg::migrate(url, runner, MIGRATION_LOCK_KEY).await?;
        Ok(())
    }

    /// Applies pending migrations, then opens the pool.
    pub async fn connect(config: &DatabaseConfig) -> Result<Self, StoreError> {
        Self::migrate(&config.url).await?;
        let pool = pg::pool(&config.url, &config.pool)?;
        pg::warn_if_pools_exceed_server(&pool, &config.pool).await;
        // An eighth of the pool per kind of grouped read (accounts, memory, tasks), at least two
        // so one slow batch never holds up every read of its kind: each reader holds one
        // connection per statement however many reads it carries, and the rest of the pool
        // stays free for writes, claims and locks.
        let reads = reads::Reads::start(&pool, (config.pool.max_connections / 8).max(2));
        Ok(Self { pool, reads })
    }

    /// How the grouped reads have batched since the store opened.
    pub fn read_counts(&self) -> svc_kit::group::BatchCounts {
        self.reads.counts()
    }

    /// Every store trait served from this database, rate limits included.
    pub fn stores(self) -> Stores {
        let limits = Arc::new(PgRateLimits::new(self.pool.clone()));
        let store = Arc::new(self);
        Stores {
            backend: "postgres",
            mcp_switches: store.clone(),
            accounts: store.clone(),
            idempotency: store.clone(),
            audit: store.clone(),
            shared_rate_limits: Some(limits),
            ping: store.clone(),
            tasks: store.clone(),
            notes: store.clone(),
            reminders: store,
        }
    }

    async fn client(&self) -> Result<Pooled, StoreError> {
        pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)
    }
}

fn db(e: tokio_postgres::Error) -> StoreError {
    StoreError::db(e)
}

#[async_trait::async_trait]
impl Ping for PgStore {
    async fn ping(&self) -> Result<(), StoreError> {
        pg::report(&self.pool, "gateway");
        Ok(pg::ping(&self.pool).await?)
    }
}

const ACCOUNT_COLUMNS: &str = "user_id, integration, account, access_token, refresh_token, expires_at, scopes, status, connected_at";

/// Column `i` of `row`, or an error naming it: a row that does not decode (a column's type
/// changed under the service) fails its own read, not the task serving it and the reads
/// grouped with it.
fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    i: usize,
) -> Result<T, StoreError> {
    row.try_get(i).map_err(|e| {
        let name = row.columns().get(i).map_or("?", |c| c.name());
        StoreError::unavailable(format!(
            "column {name} of the gateway's row does not decode: {e}"
        ))
    })
}

fn account_from_row(row: &Row) -> Result<StoredAccount, StoreError> {
    let integration: String = column(row, 1)?;
    Ok(StoredAccount {
        user: UserId::parse(column(row, 0)?).map_err(StoreError::unavailable)?,
        integration: Integration::from_key(&integration).ok_or_else(|| {
            StoreError::unavailable(format!(
                "unknown integration {integration:?} in gateway.accounts"
            ))
        })?,
        account: column(row, 2)?,
        access_token: column(row, 3)?,
        refresh_token: column(row, 4)?,
        expires_at: column(row, 5)?,
        scopes: column(row, 6)?,
        status: AccountStatus::from_key(column(row, 7)?),
        connected_at: column(row, 8)?,
    })
}

async fn upsert(client: &Pooled, a: &StoredAccount) -> Result<(), StoreError> {
    client
        .execute(
            "INSERT INTO gateway.accounts \
               (user_id, integration, account, access_token, refresh_token, expires_at, scopes, status, connected_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (user_id, integration, account) DO UPDATE SET \
               access_token = EXCLUDED.access_token, refresh_token = EXCLUDED.refresh_token, \
               expires_at = EXCLUDED.expires_at, scopes = EXCLUDED.scopes, status = EXCLUDED.status, \
               connected_at = EXCLUDED.connected_at, updated_at = now(), \
               refresh_holder = NULL, refresh_until = NULL",
            &[
                &a.user.as_str(),
                &a.integration.key(),
                &a.account,
                &a.access_token,
                &a.refresh_token,
                &a.expires_at,
                &a.scopes,
                &a.status.key(),
                &a.connected_at,
            ],
        )
        .await
        .map_err(db)?;
    Ok(())
}

#[async_trait::async_trait]
impl AccountStore for PgStore {
    async fn upsert_account(&self, account: StoredAccount) -> Result<(), StoreError> {
        upsert(&self.client().await?, &account).await
    }

    async fn list_accounts(&self, user: &UserId) -> Result<Vec<StoredAccount>, StoreError> {
        self.reads.accounts(user).await
    }

    async fn get_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Option<StoredAccount>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "SELECT {ACCOUNT_COLUMNS} FROM gateway.accounts \
                     WHERE user_id = $1 AND integration = $2 AND account = $3"
                ),
                &[&user.as_str(), &integration.key(), &account],
            )
            .await
            .map_err(db)?;
        row.as_ref().map(account_from_row).transpose()
    }

    async fn delete_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "DELETE FROM gateway.accounts WHERE user_id = $1 AND integration = $2 AND account = $3",
                &[&user.as_str(), &integration.key(), &account],
            )
            .await
            .map_err(db)?;
        Ok(n > 0)
    }

    async fn count_accounts(&self) -> Result<u64, StoreError> {
        let row = self
            .client()
            .await?
            .query_one("SELECT count(*) FROM gateway.accounts", &[])
            .await
            .map_err(db)?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    /// Once per start: a scan and a top-N sort, without an index on `updated_at`.
    async fn sample_accounts(
        &self,
        limit: usize,
        newest_first: bool,
    ) -> Result<Vec<StoredAccount>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let order = if newest_first { "DESC" } else { "ASC" };
        let rows = self
            .client()
            .await?
            .query(
                &format!(
                    "SELECT {ACCOUNT_COLUMNS} FROM gateway.accounts \
                     ORDER BY updated_at {order} LIMIT $1"
                ),
                &[&limit],
            )
            .await
            .map_err(db)?;
        rows.iter().map(account_from_row).collect()
    }

    async fn accounts_after(
        &self,
        after: Option<&AccountCursor>,
        limit: usize,
    ) -> Result<Vec<StoredAccount>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let client = self.client().await?;
        // By the primary key's index, a page at a time: a row comparison against the last
        // key read, in the columns' own collation, as ORDER BY sorts them.
        let rows = match after.map(AccountCursor::key) {
            None => {
                client
                    .query(
                        &format!(
                            "SELECT {ACCOUNT_COLUMNS} FROM gateway.accounts \
                         ORDER BY user_id, integration, account LIMIT $1"
                        ),
                        &[&limit],
                    )
                    .await
            }
            Some((user, integration, account)) => {
                client
                    .query(
                        &format!(
                            "SELECT {ACCOUNT_COLUMNS} FROM gateway.accounts \
                         WHERE (user_id, integration, account) > ($1, $2, $3) \
                         ORDER BY user_id, integration, account LIMIT $4"
                        ),
                        &[&user, &integration, &account, &limit],
                    )
                    .await
            }
        }
        .map_err(db)?;
        rows.iter().map(account_from_row).collect()
    }

    async fn lock_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Box<dyn AccountLock>, StoreError> {
        // A waiter outlasts a crashed holder's lease by a moment, so it takes the account
        // over when that lease lapses instead of giving up right then (the call's own
        // deadline, usually shorter, still bounds the wait).
        let mut wait = Patience::new(REFRESH_HOLD + Duration::from_secs(2));
        loop {
            let client = self.client().await?;
            if let Some(lock) = self
                .take_lease(&client, user, integration, account, Duration::ZERO)
                .await?
            {
                return Ok(Box::new(lock));
            }
            let exists = account_exists(&client, user, integration, account).await?;
            drop(client);
            if !exists {
                return Ok(Box::new(PgAccountLock::on_nothing(&self.pool)));
            }
            // Another replica is refreshing this account: wait for it to finish (its token is
            // then usable) or for its lease to lapse.
            if !wait.pause().await {
                return Err(StoreError::InProgress(format!(
                    "the account {account} is still being refreshed by another replica after {REFRESH_HOLD:?}"
                )));
            }
        }
    }

    async fn lock_account_if_idle(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
        lapsed_for: Duration,
    ) -> Result<Option<Box<dyn AccountLock>>, StoreError> {
        let client = self.client().await?;
        if let Some(mut lock) = self
            .take_lease(&client, user, integration, account, lapsed_for)
            .await?
        {
            lock.only_while_held = true;
            return Ok(Some(Box::new(lock)));
        }
        // Not taken: held, or gone — which, as for `lock_account`, is a lock on nothing.
        let exists = account_exists(&client, user, integration, account).await?;
        Ok((!exists)
            .then(|| Box::new(PgAccountLock::on_nothing(&self.pool)) as Box<dyn AccountLock>))
    }
}

async fn account_exists(
    client: &Pooled,
    user: &UserId,
    integration: Integration,
    account: &str,
) -> Result<bool, StoreError> {
    Ok(client
        .query_opt(
            "SELECT 1 FROM gateway.accounts WHERE user_id = $1 AND integration = $2 AND account = $3",
            &[&user.as_str(), &integration.key(), &account],
        )
        .await
        .map_err(db)?
        .is_some())
}

impl PgStore {
    /// `account`'s refresh lease, if it is free or lapsed more than `lapsed_for` ago: a
    /// committed lease on the row, not a row lock in an open transaction, so the token
    /// endpoint is called while nothing of the pool is held. A lapsed lease taken over is
    /// remembered, to be given back on release (see [`PgAccountLock::took_over`]).
    async fn take_lease(
        &self,
        client: &Pooled,
        user: &UserId,
        integration: Integration,
        account: &str,
        lapsed_for: Duration,
    ) -> Result<Option<PgAccountLock>, StoreError> {
        let holder = format!("{:032x}", rand::random::<u128>());
        let hold_ms = REFRESH_HOLD.as_millis() as f64;
        let lapsed_ms = lapsed_for.as_millis() as f64;
        let taken = client
            .query_opt(
                &format!(
                    "WITH was AS (SELECT refresh_until AS lapse FROM gateway.accounts \
                       WHERE user_id = $1 AND integration = $2 AND account = $3 FOR UPDATE) \
                     UPDATE gateway.accounts SET refresh_holder = $4, \
                       refresh_until = clock_timestamp() + $5 * interval '1 millisecond' \
                     FROM was WHERE user_id = $1 AND integration = $2 AND account = $3 \
                       AND (was.lapse IS NULL \
                            OR was.lapse < clock_timestamp() - $6 * interval '1 millisecond') \
                     RETURNING {ACCOUNT_COLUMNS}, was.lapse"
                ),
                &[
                    &user.as_str(),
                    &integration.key(),
                    &account,
                    &holder,
                    &hold_ms,
                    &lapsed_ms,
                ],
            )
            .await
            .map_err(db)?;
        taken
            .map(|row| {
                Ok(PgAccountLock {
                    pool: self.pool.clone(),
                    holder: Some(holder),
                    current: Some(account_from_row(&row)?),
                    took_over: row.try_get("lapse").map_err(db)?,
                    only_while_held: false,
                    saving: false,
                })
            })
            .transpose()
    }
}

/// Waiting for another holder's lease (a claim, a refresh) to end: pauses from 25 ms doubling
/// to 500 ms, for at most the given time. Polling, because the holder's end is a row update
/// on any replica; a wait here holds no connection.
struct Patience {
    deadline: tokio::time::Instant,
    pause: Duration,
}

impl Patience {
    fn new(at_most: Duration) -> Self {
        Self {
            deadline: tokio::time::Instant::now() + at_most,
            pause: Duration::from_millis(25),
        }
    }

    /// Waits one pause; false (without waiting) when that would pass the deadline.
    async fn pause(&mut self) -> bool {
        if tokio::time::Instant::now() + self.pause > self.deadline {
            return false;
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_millis(500));
        true
    }
}

/// How long a token refresh may hold its account: the token request's timeout and a margin
/// for saving what it got. Kept short because every call of the account waits it out when a
/// replica dies mid-refresh, and a waiter must take over well inside a tool call's deadline
/// (30 s by default).
pub(crate) const REFRESH_HOLD: Duration =
    Duration::from_secs(crate::credentials::oauth::TOKEN_REQUEST_TIMEOUT.as_secs() + 5);

struct PgAccountLock {
    pool: pg::PgPool,
    /// Set while this lock holds the account's lease.
    holder: Option<String>,
    current: Option<StoredAccount>,
    /// When the lease this lock took over had lapsed; `None` when it took a free one. Given
    /// back on release instead of freeing the lease, unless this lock's save landed: the
    /// holder it took over from may still be saving, and background work must go on judging
    /// the account by that lapse, not take it the moment this lock lets go — its save would
    /// then supersede that holder's (fresh tokens lost, and a refresh token Google rotated).
    /// Callers take such a lease at once as before: it has lapsed.
    took_over: Option<SystemTime>,
    /// Background work's lock ([`AccountStore::lock_account_if_idle`]): its save lands only
    /// while it still holds the lease, so a refresh that took over its lapsed lease is never
    /// superseded by it.
    only_while_held: bool,
    /// Its save was sent: dropped now (the caller cancelled, the connection lost), that save
    /// may still land, so the lease is let go as lapsed now, not freed — background work
    /// keeps off the account for `ABANDONED_AFTER`, callers take it at once.
    saving: bool,
}

impl PgAccountLock {
    /// A lock on an account that does not exist.
    fn on_nothing(pool: &pg::PgPool) -> Self {
        Self {
            pool: pool.clone(),
            holder: None,
            current: None,
            took_over: None,
            only_while_held: false,
            saving: false,
        }
    }
}

#[async_trait::async_trait]
impl AccountLock for PgAccountLock {
    fn current(&self) -> Option<&StoredAccount> {
        self.current.as_ref()
    }

    async fn save(mut self: Box<Self>, a: StoredAccount) -> Result<Saved, StoreError> {
        // Kept until the UPDATE lands: a save that fails or is cancelled still frees the lease
        // on drop, instead of leaving every caller of the account waiting out its hold.
        let Some(holder) = self.holder.clone() else {
            return Err(StoreError::Unavailable(format!(
                "the account {} is gone; nothing to save",
                a.account
            )));
        };
        let read = self
            .current
            .as_ref()
            .map(|c| (&c.access_token, &c.refresh_token, c.status.key()));
        // Written only over the tokens (and status) this lock read — a compare-and-swap, not a
        // test of the lease: a reconnect or a needs-reconnect mark meanwhile wins, and a
        // refresh whose lease lapsed mid-call and was taken over still lands if the taker has
        // saved nothing yet, so a refresh token Google rotated is not lost. Background work's
        // save also needs the lease still its own ($13). The lease is let go if it is still
        // ours, saved or not, so nobody waits out its hold: freed when the save landed (a
        // holder taken over from can land nothing after it), else given back to the lapse it
        // was taken over from ($14, see `took_over`).
        let client = pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)?;
        self.saving = true;
        let row = client
            .query_opt(
                "WITH held AS (SELECT access_token = $10 AND refresh_token IS NOT DISTINCT FROM $11 AND status = $12 \
                     AND (COALESCE(refresh_holder = $4, false) OR NOT $13) AS lands, \
                   COALESCE(refresh_holder = $4, false) AS ours FROM gateway.accounts \
                   WHERE user_id = $1 AND integration = $2 AND account = $3 FOR UPDATE) \
                 UPDATE gateway.accounts a SET \
                   access_token = CASE WHEN held.lands THEN $5 ELSE a.access_token END, \
                   refresh_token = CASE WHEN held.lands THEN $6 ELSE a.refresh_token END, \
                   expires_at = CASE WHEN held.lands THEN $7 ELSE a.expires_at END, \
                   scopes = CASE WHEN held.lands THEN $8 ELSE a.scopes END, \
                   status = CASE WHEN held.lands THEN $9 ELSE a.status END, \
                   updated_at = CASE WHEN held.lands THEN now() ELSE a.updated_at END, \
                   refresh_holder = CASE WHEN held.ours THEN NULL ELSE a.refresh_holder END, \
                   refresh_until = CASE WHEN NOT held.ours THEN a.refresh_until \
                                        WHEN held.lands THEN NULL ELSE $14 END \
                 FROM held WHERE a.user_id = $1 AND a.integration = $2 AND a.account = $3 \
                   AND (held.lands OR held.ours) \
                 RETURNING held.lands",
                &[
                    &a.user.as_str(),
                    &a.integration.key(),
                    &a.account,
                    &holder,
                    &a.access_token,
                    &a.refresh_token,
                    &a.expires_at,
                    &a.scopes,
                    &a.status.key(),
                    &read.map(|(access, ..)| access.as_slice()),
                    &read.and_then(|(_, refresh, _)| refresh.as_deref()),
                    &read.map(|(.., status)| status),
                    &self.only_while_held,
                    &self.took_over,
                ],
            )
            .await
            .map_err(db)?;
        self.holder = None;
        Ok(match row.is_some_and(|r| r.get::<_, bool>(0)) {
            true => Saved::Applied,
            false => Saved::Superseded,
        })
    }
}

impl Drop for PgAccountLock {
    /// A lock let go without saving (the refresh failed) frees the account at once: its lease
    /// freed, or given back to the lapse it took over (`took_over`), which callers take at
    /// once — or, when its save was already sent (`saving`), lapsed now.
    fn drop(&mut self) {
        let Some(holder) = self.holder.take() else {
            return;
        };
        let Some(a) = self.current.take() else {
            return;
        };
        let (pool, lapse, saving) = (self.pool.clone(), self.took_over, self.saving);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let freed = async {
                    pg::checkout(&pool, "gateway")
                        .await
                        .map_err(StoreError::unavailable)?
                        .execute(
                            "UPDATE gateway.accounts SET refresh_holder = NULL, \
                               refresh_until = CASE WHEN $6 THEN greatest($5, clock_timestamp()) ELSE $5 END \
                             WHERE user_id = $1 AND integration = $2 AND account = $3 AND refresh_holder = $4",
                            &[&a.user.as_str(), &a.integration.key(), &a.account, &holder, &lapse, &saving],
                        )
                        .await
                        .map_err(db)
                };
                if let Err(e) = freed.await {
                    tracing::warn!(error = %e, "an account stays leased until its refresh hold lapses");
                }
            });
        }
    }
}

/// The idempotency rows the retention sweep deletes, `$1` its cut-off. It implies the
/// predicate of V12's `idempotency_prunable` index, so the sweep reads that index, which
/// holds none of the rows kept for good (a test checks that the planner can use it for the sweep, with the other scans turned off).
pub const IDEMPOTENCY_PRUNABLE: &str = "updated_at < $1 AND (state = 'done' OR (lease_until < least($1, clock_timestamp()) AND NOT acting))";

#[async_trait::async_trait]
impl IdempotencyStore for PgStore {
    async fn lookup(&self, user: &UserId, key: &str) -> Result<KeyState, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                "SELECT state, tool, args_sha256, outcome, lease_until > clock_timestamp(), acting \
                 FROM gateway.idempotency WHERE user_id = $1 AND key = $2",
                &[&user.as_str(), &key],
            )
            .await
            .map_err(db)?;
        Ok(match row {
            None => KeyState::Free,
            // Pending: its call may still answer while its hold lasts; past it, it may have
            // acted and never will — unless it never marked a write, which is marked before
            // any leaves: then it did nothing, and a claim may take the key over.
            Some(r) if r.get::<_, &str>(0) != "done" => {
                if r.get::<_, Option<bool>>(4).unwrap_or(false) {
                    KeyState::Running
                } else if r.get::<_, bool>(5) {
                    KeyState::Held
                } else {
                    KeyState::Free
                }
            }
            Some(r) => KeyState::Done(StoredResult {
                tool: r.get(1),
                args_sha256: r.get(2),
                outcome: r.get(3),
            }),
        })
    }

    async fn prune_idempotency(
        &self,
        older_than: SystemTime,
        limit: usize,
    ) -> Result<usize, StoreError> {
        // Found by the index of prunable rows (V12), deleted by ctid. The condition is repeated on the
        // DELETE so that a row a takeover changed between the two (a fresh hold) is checked
        // again as it now is, and kept. A held key's lapse is judged by the database's clock,
        // which every claim's lease is set by, not by `older_than`. A lapsed key whose call
        // marked itself acting is kept for good: its call may have acted, and without the
        // row a retry would act again and a lookup would answer "not executed".
        let deleted = self
            .client()
            .await?
            .execute(
                &format!(
                    "DELETE FROM gateway.idempotency WHERE ctid = ANY(ARRAY( \
                       SELECT ctid FROM gateway.idempotency WHERE {IDEMPOTENCY_PRUNABLE} LIMIT $2)) \
                     AND {IDEMPOTENCY_PRUNABLE}"
                ),
                &[&older_than, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(deleted as usize)
    }

    async fn claim(
        &self,
        user: &UserId,
        key: &str,
        hold: Duration,
    ) -> Result<Box<dyn IdempotencyClaim>, StoreError> {
        // A committed 'pending' row is the claim: no connection is held while the call runs
        // upstream (a burst of slow sends cannot drain the pool). Every statement is one short
        // checkout.
        // Who holds the row: only its holder may complete or free it.
        let holder = format!("{:032x}", rand::random::<u128>());
        let hold_ms = i64::try_from(hold.as_millis()).unwrap_or(i64::MAX);
        let mut wait = Patience::new(hold);
        loop {
            let won = self
                .client()
                .await?
                .query_opt(
                    "INSERT INTO gateway.idempotency AS i (user_id, key, tool, args_sha256, state, holder, lease_until, updated_at) \
                     VALUES ($1, $2, '', '', 'pending', $3, clock_timestamp() + $4 * interval '1 millisecond', clock_timestamp()) \
                     ON CONFLICT (user_id, key) DO UPDATE SET holder = EXCLUDED.holder, lease_until = EXCLUDED.lease_until, \
                       updated_at = EXCLUDED.updated_at \
                     WHERE i.state = 'pending' AND i.lease_until < clock_timestamp() AND NOT i.acting \
                     RETURNING 1",
                    &[&user.as_str(), &key, &holder, &(hold_ms as f64)],
                )
                .await
                .map_err(db)?
                .is_some();
            if won {
                return Ok(Box::new(PgClaim {
                    pool: self.pool.clone(),
                    user: user.clone(),
                    key: key.to_owned(),
                    holder: Some(holder.clone()),
                    existing: None,
                }));
            }
            let row = self
                .client()
                .await?
                .query_opt(
                    "SELECT state, tool, args_sha256, outcome, \
                       acting AND lease_until < clock_timestamp() FROM gateway.idempotency \
                     WHERE user_id = $1 AND key = $2",
                    &[&user.as_str(), &key],
                )
                .await
                .map_err(db)?;
            match row {
                // Freed meanwhile: claimed on the next try.
                None => continue,
                Some(r) if r.get::<_, &str>(0) == "done" => {
                    return Ok(Box::new(PgClaim {
                        pool: self.pool.clone(),
                        user: user.clone(),
                        key: key.to_owned(),
                        holder: None,
                        existing: Some(StoredResult {
                            tool: r.get(1),
                            args_sha256: r.get(2),
                            outcome: r.get(3),
                        }),
                    }));
                }
                // Left as it is, for good: its holder let a write leave and never stored
                // what came of it.
                Some(r) if r.get::<_, Option<bool>>(4) == Some(true) => {
                    return Err(StoreError::MayHaveActed(super::may_have_acted()));
                }
                Some(_) => {}
            }
            // Another call holds the key: wait for its result (or for its hold to lapse, or
            // for it to let go without acting), never longer than this call may take.
            if !wait.pause().await {
                return Err(StoreError::InProgress(super::in_progress(hold)));
            }
        }
    }
}

struct PgClaim {
    pool: pg::PgPool,
    user: UserId,
    key: String,
    /// Set while this claim holds the key's pending row.
    holder: Option<String>,
    existing: Option<StoredResult>,
}

#[async_trait::async_trait]
impl IdempotencyClaim for PgClaim {
    fn existing(&self) -> Option<&StoredResult> {
        self.existing.as_ref()
    }

    async fn complete(&mut self, result: &StoredResult) -> Result<(), StoreError> {
        let Some(holder) = &self.holder else {
            return Ok(());
        };
        let client = pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)?;
        let stored = client
            .execute(
                "UPDATE gateway.idempotency SET state = 'done', tool = $4, args_sha256 = $5, outcome = $6, \
                 holder = NULL, lease_until = NULL, updated_at = clock_timestamp() \
                 WHERE user_id = $1 AND key = $2 AND holder = $3",
                &[&self.user.as_str(), &self.key, holder, &result.tool, &result.args_sha256, &pg_json(&result.outcome)],
            )
            .await
            .map_err(db)?;
        // The key is no longer this claim's either way: stored, or taken over by another call.
        self.holder = None;
        if stored == 0 {
            return Err(StoreError::InProgress(
                "this call's hold on its idempotency key lapsed and another call took the key \
                 over, so its result was not stored"
                    .into(),
            ));
        }
        Ok(())
    }

    fn abandon(mut self: Box<Self>) {
        // Forgotten, not deleted: the row stays pending until its hold lapses.
        self.holder = None;
    }

    fn acting(&self) -> Option<Arc<dyn ActingMark>> {
        let holder = self.holder.clone()?;
        Some(Arc::new(PgActing {
            pool: self.pool.clone(),
            user: self.user.clone(),
            key: self.key.clone(),
            holder,
        }))
    }
}

struct PgActing {
    pool: pg::PgPool,
    user: UserId,
    key: String,
    holder: String,
}

#[async_trait::async_trait]
impl ActingMark for PgActing {
    async fn mark(&self) -> Result<(), StoreError> {
        let marked = pg::checkout(&self.pool, "gateway")
            .await
            .map_err(StoreError::unavailable)?
            .execute(
                "UPDATE gateway.idempotency SET acting = true, updated_at = clock_timestamp() \
                 WHERE user_id = $1 AND key = $2 AND state = 'pending' AND holder = $3",
                &[&self.user.as_str(), &self.key, &self.holder],
            )
            .await
            .map_err(db)?;
        if marked == 0 {
            return Err(StoreError::InProgress(
                "this call's hold on its idempotency key lapsed and another call took the key \
                 over"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl Drop for PgClaim {
    /// A claim given up without a result (nothing reached upstream) frees its key at once, so
    /// a retry need not wait for the hold to lapse.
    fn drop(&mut self) {
        let Some(holder) = self.holder.take() else {
            return;
        };
        let (pool, user, key) = (self.pool.clone(), self.user.clone(), self.key.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let freed = async {
                    pg::checkout(&pool, "gateway")
                        .await
                        .map_err(StoreError::unavailable)?
                        .execute(
                            "DELETE FROM gateway.idempotency WHERE user_id = $1 AND key = $2 \
                             AND state = 'pending' AND holder = $3",
                            &[&user.as_str(), &key, &holder],
                        )
                        .await
                        .map_err(db)
                };
                if let Err(e) = freed.await {
                    tracing::warn!(error = %e, "an idempotency key stays held until its hold lapses");
                }
            });
        }
    }
}

/// Text PostgreSQL can store: it refuses NUL, and one such value would fail its whole audit
/// batch on every retry, stalling the queue behind it.
fn pg_text(s: &str) -> String {
    s.replace('\0', "\u{fffd}")
}

/// A JSON value as `jsonb` takes it: NUL (`\u0000`), which `jsonb` refuses in any string,
/// replaced in every string and key as [`pg_text`] does. Refused, a side effect's result would
/// not be stored and its key, once its hold lapsed, would let a retry act again.
fn pg_json(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) if s.contains('\0') => Value::String(pg_text(s)),
        Value::Array(items) => Value::Array(items.iter().map(pg_json).collect()),
        Value::Object(map) => {
            Value::Object(map.iter().map(|(k, v)| (pg_text(k), pg_json(v))).collect())
        }
        other => other.clone(),
    }
}

/// A count as PostgreSQL `int4`: saturated at its maximum, never wrapped to a negative.
fn int4(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

#[async_trait::async_trait]
impl AuditLog for PgStore {
    /// One record now: the batch statement with one row, so both paths share one statement,
    /// one clock (the gateway's) and one sanitiser.
    async fn record(&self, r: AuditRecord) -> Result<(), StoreError> {
        self.record_many(&[AuditEntry::now(r)]).await
    }

    async fn record_many(&self, entries: &[AuditEntry]) -> Result<(), StoreError> {
        if entries.is_empty() {
            return Ok(());
        }
        // One column array per field, unnested into rows in their order: one statement text
        // whatever the batch size, so it is prepared once per connection (statement cache).
        let n = entries.len();
        let mut at = Vec::with_capacity(n);
        let mut user = Vec::with_capacity(n);
        let mut kind = Vec::with_capacity(n);
        let mut tool = Vec::with_capacity(n);
        let mut integration = Vec::with_capacity(n);
        let mut account = Vec::with_capacity(n);
        let mut call_id = Vec::with_capacity(n);
        let mut run_id = Vec::with_capacity(n);
        let mut status = Vec::with_capacity(n);
        let mut latency_ms = Vec::with_capacity(n);
        let mut bytes = Vec::with_capacity(n);
        let mut upstream_calls = Vec::with_capacity(n);
        for AuditEntry { at: t, record: r } in entries {
            at.push(*t);
            user.push(pg_text(&r.user));
            kind.push(pg_text(&r.kind));
            tool.push(pg_text(&r.tool));
            integration.push(r.integration.as_deref().map(pg_text));
            account.push(r.account.as_deref().map(pg_text));
            call_id.push(pg_text(&r.call_id));
            run_id.push(r.run_id.as_deref().map(pg_text));
            status.push(pg_text(&r.status));
            latency_ms.push(int4(r.latency_ms));
            bytes.push(int4(r.bytes));
            upstream_calls.push(int4(r.upstream_calls));
        }
        self.client()
            .await?
            .execute(
                "INSERT INTO gateway.audit (at, user_id, kind, tool, integration, account, call_id, run_id, \
                   status, latency_ms, bytes, upstream_calls) \
                 SELECT at, user_id, kind, tool, integration, account, call_id, run_id, status, latency_ms, \
                   bytes, upstream_calls \
                 FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
                   $7::text[], $8::text[], $9::text[], $10::int4[], $11::int4[], $12::int4[]) WITH ORDINALITY \
                   AS r(at, user_id, kind, tool, integration, account, call_id, run_id, status, latency_ms, \
                   bytes, upstream_calls, n) \
                 ORDER BY n",
                &[
                    &at,
                    &user,
                    &kind,
                    &tool,
                    &integration,
                    &account,
                    &call_id,
                    &run_id,
                    &status,
                    &latency_ms,
                    &bytes,
                    &upstream_calls,
                ],
            )
            .await
            // A refused record is told apart from an outage: the batching writer isolates the
            // first and retries the second.
            .map_err(StoreError::db)?;
        Ok(())
    }

    async fn recent(&self, user: &UserId, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT user_id, kind, tool, integration, account, call_id, run_id, status, latency_ms, bytes, \
                   upstream_calls FROM gateway.audit WHERE user_id = $1 ORDER BY id DESC LIMIT $2",
                &[&user.as_str(), &(limit as i64)],
            )
            .await
            .map_err(db)?;
        let mut out: Vec<_> = rows
            .iter()
            .map(|r| AuditRecord {
                user: r.get(0),
                kind: r.get(1),
                tool: r.get(2),
                integration: r.get(3),
                account: r.get(4),
                call_id: r.get(5),
                run_id: r.get(6),
                status: r.get(7),
                latency_ms: r.get::<_, i32>(8) as u32,
                bytes: r.get::<_, i32>(9) as u32,
                upstream_calls: r.get::<_, i32>(10) as u32,
            })
            .collect();
        out.reverse();
        Ok(out)
    }

    async fn prune_audit(&self, older_than: SystemTime, limit: usize) -> Result<usize, StoreError> {
        // The `limit` lowest ids, by the primary key, and of those the ones older than the
        // cut: no index on `at` is kept (it would cost every audit insert), and ids follow the
        // time of writing, so the oldest records are at the head. A record written late (it
        // keeps its call's time) or stamped by a fast clock may sit at the head and be kept a
        // while longer; the records behind it still go, as the caller repeats while any do.
        let deleted = self
            .client()
            .await?
            .execute(
                "DELETE FROM gateway.audit WHERE id = ANY(ARRAY( \
                   SELECT id FROM (SELECT id, at FROM gateway.audit ORDER BY id LIMIT $2) head \
                   WHERE at < $1))",
                &[&older_than, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(deleted as usize)
    }
}

const TASK_COLUMNS: &str = "id, title, description, due_at, completed_at, created_at";
/// Pending first by due date (undated last), then completed, newest first (see `task_order`).
const TASK_ORDER: &str = "completed_at IS NOT NULL, due_at IS NULL, due_at, id DESC";

fn task_from_row(r: &Row) -> Result<Task, StoreError> {
    Ok(Task {
        id: column(r, 0)?,
        title: column(r, 1)?,
        description: column(r, 2)?,
        due_at: column(r, 3)?,
        completed_at: column(r, 4)?,
        created_at: column(r, 5)?,
    })
}

#[async_trait::async_trait]
impl TaskStore for PgStore {
    async fn add_task(
        &self,
        user: &UserId,
        title: &str,
        description: Option<&str>,
        due_at: Option<SystemTime>,
    ) -> Result<Task, StoreError> {
        let row = self
            .client()
            .await?
            .query_one(
                &format!(
                    "INSERT INTO gateway.tasks (user_id, title, description, due_at) VALUES ($1, $2, $3, $4) \
                     RETURNING {TASK_COLUMNS}"
                ),
                &[&user.as_str(), &title, &description, &due_at],
            )
            .await
            .map_err(db)?;
        task_from_row(&row)
    }

    async fn list_tasks(&self, user: &UserId, filter: TaskFilter) -> Result<Vec<Task>, StoreError> {
        self.reads.tasks(user, filter).await
    }

    async fn update_task(
        &self,
        user: &UserId,
        id: i64,
        patch: TaskPatch,
    ) -> Result<Option<Task>, StoreError> {
        let completed: Option<bool> = patch.completed;
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "UPDATE gateway.tasks SET \
                       title = COALESCE($3::text, title), \
                       description = CASE WHEN $4::boolean THEN $5::text ELSE description END, \
                       due_at = CASE WHEN $6::boolean THEN $7::timestamptz ELSE due_at END, \
                       completed_at = CASE WHEN $8::boolean IS NULL THEN completed_at \
                                           WHEN $8::boolean THEN COALESCE(completed_at, now()) ELSE NULL END \
                     WHERE user_id = $1 AND id = $2 RETURNING {TASK_COLUMNS}"
                ),
                &[
                    &user.as_str(),
                    &id,
                    &patch.title,
                    &patch.description.is_some(),
                    &patch.description.flatten(),
                    &patch.due_at.is_some(),
                    &patch.due_at.flatten(),
                    &completed,
                ],
            )
            .await
            .map_err(db)?;
        row.as_ref().map(task_from_row).transpose()
    }

    async fn delete_task(&self, user: &UserId, id: i64) -> Result<Option<Task>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                &format!("DELETE FROM gateway.tasks WHERE user_id = $1 AND id = $2 RETURNING {TASK_COLUMNS}"),
                &[&user.as_str(), &id],
            )
            .await
            .map_err(db)?;
        row.as_ref().map(task_from_row).transpose()
    }
}

fn note_from_row(r: &Row) -> Result<Note, StoreError> {
    Ok(Note {
        id: column(r, 0)?,
        content: column(r, 1)?,
        tags: column(r, 2)?,
        created_at: column(r, 3)?,
        origin: column(r, 4)?,
    })
}

#[async_trait::async_trait]
impl NoteStore for PgStore {
    async fn add_notes(
        &self,
        user: &UserId,
        notes: &[(String, Vec<String>)],
        origin: &str,
    ) -> Result<Vec<Note>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        let mut out = Vec::new();
        for (content, tags) in notes {
            let search_text = format!("{content} {}", tags.join(" "));
            let row = tx
                .query_one(
                    "INSERT INTO gateway.memories (user_id, content, tags, search_text, origin) \
                     VALUES ($1, $2, $3, $4, $5) RETURNING id, content, tags, created_at, origin",
                    &[&user.as_str(), content, tags, &search_text, &origin],
                )
                .await
                .map_err(db)?;
            out.push(note_from_row(&row)?);
        }
        tx.commit().await.map_err(db)?;
        Ok(out)
    }

    async fn search_notes(
        &self,
        user: &UserId,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Note>, StoreError> {
        self.reads.notes(user, query, limit).await
    }

    async fn count_notes(&self, user: &UserId) -> Result<u64, StoreError> {
        let row = self
            .client()
            .await?
            .query_one(
                "SELECT count(*) FROM gateway.memories WHERE user_id = $1",
                &[&user.as_str()],
            )
            .await
            .map_err(db)?;
        Ok(row.get::<_, i64>(0) as u64)
    }
}

fn reminder_from_row(r: &Row) -> Reminder {
    Reminder {
        id: r.get(0),
        text: r.get(1),
        due_at: r.get(2),
        created_at: r.get(3),
    }
}

#[async_trait::async_trait]
impl ReminderStore for PgStore {
    async fn add_reminder(
        &self,
        user: &UserId,
        text: &str,
        due_at: SystemTime,
    ) -> Result<Reminder, StoreError> {
        let row = self
            .client()
            .await?
            .query_one(
                "INSERT INTO gateway.reminders (user_id, text, due_at) VALUES ($1, $2, $3) \
                 RETURNING id, text, due_at, created_at",
                &[&user.as_str(), &text, &due_at],
            )
            .await
            .map_err(db)?;
        Ok(reminder_from_row(&row))
    }

    async fn upcoming_reminders(
        &self,
        user: &UserId,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<Reminder>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT id, text, due_at, created_at FROM gateway.reminders \
                 WHERE user_id = $1 AND due_at >= $2 ORDER BY due_at, id LIMIT $3",
                &[&user.as_str(), &now, &(limit as i64)],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(reminder_from_row).collect())
    }

    async fn count_reminders(&self, user: &UserId) -> Result<u64, StoreError> {
        let row = self
            .client()
            .await?
            .query_one(
                "SELECT count(*) FROM gateway.reminders WHERE user_id = $1",
                &[&user.as_str()],
            )
            .await
            .map_err(db)?;
        Ok(row.get::<_, i64>(0) as u64)
    }
}

#[async_trait::async_trait]
impl McpSwitchStore for PgStore {
    async fn set_mcp_enabled(
        &self,
        user: &UserId,
        switch: &McpSwitch,
        enabled: bool,
    ) -> Result<(), StoreError> {
        let tool = switch.tool.as_deref().unwrap_or("");
        let sql = if enabled {
            "DELETE FROM gateway.mcp_disabled WHERE user_id = $1 AND server = $2 AND tool = $3"
        } else {
            "INSERT INTO gateway.mcp_disabled (user_id, server, tool) VALUES ($1, $2, $3) \
             ON CONFLICT DO NOTHING"
        };
        self.client()
            .await?
            .execute(sql, &[&user.as_str(), &switch.server, &tool])
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn disabled_mcp(&self, user: &UserId) -> Result<Vec<McpSwitch>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT server, tool FROM gateway.mcp_disabled WHERE user_id = $1 \
                 ORDER BY server, tool",
                &[&user.as_str()],
            )
            .await
            .map_err(db)?;
        Ok(rows
            .iter()
            .map(|r| {
                let tool: String = r.get(1);
                McpSwitch {
                    server: r.get(0),
                    tool: (!tool.is_empty()).then_some(tool),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn g8_a_refresh_hold_outlasts_its_token_request_and_a_waiter_takes_over_inside_a_calls_deadline()
     {
        let token_request = crate::credentials::oauth::TOKEN_REQUEST_TIMEOUT;
        assert!(REFRESH_HOLD > token_request);
        // A waiter gives up 2 s after the hold; the default tool call deadline is 30 s.
        assert!(REFRESH_HOLD + Duration::from_secs(2) < Duration::from_secs(30));
    }
}
