//! PostgreSQL: a deadpool pool for the service, and embedded migrations applied at start-up on a
//! dedicated connection under a PostgreSQL advisory lock, so replicas starting together apply each
//! migration exactly once and the losers wait for the winner instead of failing. Every connection
//! — pooled, migrating or listening — is opened through [`Target`], so TLS is used exactly as
//! DATABASE_URL's `sslmode` asks.

use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

pub use crate::pg_tls::Target;
pub use deadpool_postgres::Pool as PgPool;

#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("DATABASE_URL is not a valid PostgreSQL connection string: {0}")]
    BadUrl(tokio_postgres::Error),
    #[error("cannot connect to PostgreSQL: {}", crate::pg::cause(.0))]
    Connect(tokio_postgres::Error),
    #[error("DATABASE_URL's TLS settings cannot be used: {0}")]
    Tls(String),
    #[error("cannot build the connection pool: {0}")]
    Pool(String),
    #[error("PostgreSQL query failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error("migration failed: {0}")]
    Migration(#[from] refinery::Error),
    #[error("no pooled connection: {0}")]
    Checkout(String),
}

/// Pool settings, from each service's config.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_connections: usize,
    /// How long a caller waits for a free connection before getting an error.
    pub acquire_timeout: Duration,
    /// How long one wait of a pooled connection's statement for a lock (a row, or an advisory
    /// lock such as an owner's admission lock) lasts before the statement fails with the
    /// database's "lock timeout" (55P03).
    pub lock_timeout: Duration,
    /// How long a transaction may sit open with nothing to do (its client stalled or cut off)
    /// before the server ends its session, and so releases what it holds.
    pub idle_in_transaction_timeout: Duration,
}

/// The defaults of `DATABASE_MAX_CONNECTIONS`, `DATABASE_ACQUIRE_TIMEOUT`,
/// `DATABASE_LOCK_TIMEOUT` and `DATABASE_IDLE_IN_TRANSACTION_TIMEOUT`.
impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(5),
            idle_in_transaction_timeout: Duration::from_secs(30),
        }
    }
}

/// What every pooled connection runs once, when it opens.
///
/// Every transaction of both services is reasoned in READ COMMITTED: a statement after an
/// advisory lock (a cap, a rate-limit charge) sees what the lock's last holder committed, and
/// a fenced UPDATE waits for a concurrent one instead of failing to serialise. A database or
/// role whose default is stricter must not change that.
///
/// No wait for a lock lasts without bound: a waiter holds its pooled connection, so a
/// holder that stalls (a replica cut off mid-transaction is noticed only when TCP gives up)
/// would otherwise drain the pools of every replica that meets it; after `lock_timeout` the
/// waiter fails with UNAVAILABLE and its caller can retry. And no holder keeps its locks
/// longer than `idle_in_transaction_timeout` once it stops talking: the server ends its
/// session. Every transaction of both services is a few statements sent back to back, never
/// one left open across other I/O, so only a stalled or vanished client ever meets it.
///
/// (Set here, not as startup options, which poolers such as PgBouncer refuse.)
fn on_open(options: &PoolOptions) -> String {
    format!(
        "SET default_transaction_isolation = 'read committed'; SET lock_timeout = {}; \
         SET idle_in_transaction_session_timeout = {}",
        options.lock_timeout.as_millis().max(1),
        options.idle_in_transaction_timeout.as_millis().max(1)
    )
}

/// Builds the pool. Connections are opened lazily; call [`ping`] to check the server answers.
pub fn pool(url: &str, options: &PoolOptions) -> Result<Pool, PgError> {
    let Target { config, tls } = Target::parse(url)?;
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match tls {
        Some(tls) => Manager::from_config(config, tls, manager_config),
        None => Manager::from_config(config, NoTls, manager_config),
    };
    let on_open = on_open(options);
    Pool::builder(manager)
        .max_size(options.max_connections)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(options.acquire_timeout))
        .create_timeout(Some(options.acquire_timeout))
        .recycle_timeout(Some(options.acquire_timeout))
        .post_create(Hook::async_fn(move |client, _| {
            let on_open = on_open.clone();
            Box::pin(async move {
                client
                    .batch_execute(&on_open)
                    .await
                    .map_err(HookError::Backend)
            })
        }))
        .build()
        .map_err(|e| PgError::Pool(e.to_string()))
}

/// The most specific words of a connection error: tokio-postgres's own Display says only "db
/// error" or "error performing TLS handshake" and keeps the server's message or the TLS reason in
/// its source.
pub fn cause(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

/// A server error in the server's own words with its SQLSTATE, and what to do about the one
/// this crate's settings cause: a lock that waited past `DATABASE_LOCK_TIMEOUT`.
pub fn server_message(e: &tokio_postgres::error::DbError) -> String {
    let said = format!("{} ({})", e.message(), e.code().code());
    if *e.code() == tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE {
        format!(
            "{said}: another transaction held a lock this one needed for longer than DATABASE_LOCK_TIMEOUT; retry"
        )
    } else {
        said
    }
}

/// Whether the server refused a statement for good: sent again with the same data, it fails the
/// same way. SQLSTATE class 22 (a data exception), 23 (an integrity constraint), 42 (a syntax or
/// access rule, a missing privilege among them), 54 (a program limit, such as an index row too
/// large) and P0001 (a trigger's `RAISE EXCEPTION` without its own code). Everything else — a
/// serialization failure or deadlock (40), a lock timeout (55P03), the server shutting down or
/// an operator's cancel (57), a broken connection (08), no room (53), a cached plan gone stale
/// (0A000) — may clear by waiting, so callers retry it.
pub fn refused_for_good(code: &tokio_postgres::error::SqlState) -> bool {
    let code = code.code();
    code == "P0001"
        || ["22", "23", "42", "54"]
            .iter()
            .any(|class| code.starts_with(class))
}

/// Warns at start when pools of this size could open more connections than the server allows.
/// Past that PostgreSQL refuses new connections ("too many clients") under load, long after
/// the start looked fine. See [`pool_warnings`] for the two checks.
pub async fn warn_if_pools_exceed_server(pool: &Pool, options: &PoolOptions) {
    let limits = async {
        let client = pool.get().await.map_err(|e| checkout_error(e, pool))?;
        let row = client
            .query_one(
                "SELECT current_setting('max_connections')::int, \
                        current_setting('superuser_reserved_connections')::int \
                          + COALESCE(current_setting('reserved_connections', true)::int, 0), \
                        (SELECT count(*)::int FROM pg_stat_activity \
                          WHERE backend_type = 'client backend' AND pid <> pg_backend_pid())",
                &[],
            )
            .await?;
        Ok::<_, PgError>(ServerConnections {
            max: row.get::<_, i32>(0).max(0) as usize,
            reserved: row.get::<_, i32>(1).max(0) as usize,
            open_elsewhere: row.get::<_, i32>(2).max(0) as usize,
        })
    };
    match limits.await {
        Ok(server) => {
            for warning in pool_warnings(&server, options.max_connections) {
                tracing::warn!(
                    database_max_connections = options.max_connections,
                    server_max_connections = server.max,
                    server_open_connections = server.open_elsewhere,
                    "{warning}"
                );
            }
        }
        Err(e) => tracing::debug!(error = %e, "could not read the server's connection limits"),
    }
}

/// What the server said of its connections when a service started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConnections {
    pub max: usize,
    /// Slots an ordinary role cannot take: `superuser_reserved_connections`, and on
    /// PostgreSQL 16+ `reserved_connections` too.
    pub reserved: usize,
    /// Client connections open to the server that this role can see, this one's not counted:
    /// other replicas, the other service, anything else using the server. Another role's are
    /// hidden from a role without `pg_read_all_stats`, so this can count low.
    pub open_elsewhere: usize,
}

/// The start-up warnings for a pool of `pool` connections on `server`:
/// - by rule: both services use the same default size, so twice this pool (one replica each)
///   must fit in `max_connections` less the reserved slots;
/// - by what is open now: the connections already open elsewhere (the replicas and the other
///   service started before this one) and this pool, once full, must fit too. A start that
///   comes first cannot see the rest; the one that tips it over can.
pub fn pool_warnings(server: &ServerConnections, pool: usize) -> Vec<String> {
    let usable = server.max.saturating_sub(server.reserved);
    let limit = format!(
        "the {usable} this PostgreSQL allows (max_connections {} less {} reserved)",
        server.max, server.reserved
    );
    let mut warnings = Vec::new();
    let both = 2 * pool;
    if both > usable {
        warnings.push(format!(
            "DATABASE_MAX_CONNECTIONS={pool}: agent-svc and gateway-svc with pools this size can open {both} \
             connections, more than {limit}; keep replicas × DATABASE_MAX_CONNECTIONS of both services under {usable}"
        ));
    }
    let with_this = server.open_elsewhere + pool;
    // Nothing else open: the rule above has said it (or the pool alone passes the limit,
    // which it also covers).
    if server.open_elsewhere > 0 && with_this > usable {
        warnings.push(format!(
            "DATABASE_MAX_CONNECTIONS={pool}: {} connections this role can see are open to this PostgreSQL already \
             (other replicas, the other service, other clients); with this pool full that is {with_this}, more than {limit}. \
             Under load new connections will be refused: lower DATABASE_MAX_CONNECTIONS or the replica counts, \
             raise max_connections, or put a pooler in front",
            server.open_elsewhere
        ));
    }
    warnings
}

/// One round trip through the pool: what readiness means for a database-backed service.
pub async fn ping(pool: &Pool) -> Result<(), PgError> {
    let client = pool.get().await.map_err(|e| checkout_error(e, pool))?;
    client.simple_query("SELECT 1").await?;
    Ok(())
}

/// A pooled connection for the `schema` store, timing the wait for it
/// (`steward_db_pool_wait_seconds`): the first sign of a pool too small for its load.
pub async fn checkout(pool: &Pool, schema: &'static str) -> Result<Pooled, PgError> {
    let started = std::time::Instant::now();
    let client = pool.get().await;
    let now = std::time::Instant::now();
    metrics::histogram!("steward_db_pool_wait_seconds", "schema" => schema)
        .record(now.duration_since(started).as_secs_f64());
    Ok(Pooled {
        client: client.map_err(|e| checkout_error(e, pool))?,
        schema,
        since: now,
    })
}

/// What went wrong getting a connection, in words an operator can act on: deadpool's own
/// Display says "Error occurred while creating a new object: db error" even when PostgreSQL
/// said "sorry, too many clients already".
fn checkout_error(e: deadpool_postgres::PoolError, pool: &Pool) -> PgError {
    use deadpool_postgres::PoolError;
    PgError::Checkout(match e {
        PoolError::Backend(e) => format!("opening a connection failed: {}", cause(&e)),
        PoolError::Timeout(_) => {
            let s = pool.status();
            format!(
                "none free within DATABASE_ACQUIRE_TIMEOUT ({} of {} open, {} idle, {} waiting); \
                 raise DATABASE_MAX_CONNECTIONS or find what holds them",
                s.size, s.max_size, s.available, s.waiting
            )
        }
        PoolError::Closed => "the pool is closed (the service is stopping)".into(),
        other => other.to_string(),
    })
}

/// A transaction begun inside a pipeline: BEGIN is sent with its first statements instead of
/// awaited on its own as `Client::transaction` does, one round trip fewer (and COMMIT can go
/// with the last statements when nothing between decides against it). Unless marked
/// `committed` — COMMIT was sent — it is rolled back when this guard goes, also when the future
/// holding it is dropped mid-way, so a connection never returns to the pool inside a
/// transaction: the ROLLBACK is queued on the connection at once, ahead of whatever its next
/// user sends, and its answer is not waited for (as tokio-postgres's own `Transaction` does on
/// drop).
///
/// Statements of a pipeline are sent in the order their futures are first polled
/// (`futures_util::future::join*` polls in argument order), and a statement that fails aborts
/// the transaction: the ones behind it fail unexecuted and COMMIT answers ROLLBACK — without
/// an error, so a commit is known only when every statement before it answered without one.
pub struct Begun<'a> {
    client: &'a tokio_postgres::Client,
    open: bool,
}

impl<'a> Begun<'a> {
    pub fn new(client: &'a tokio_postgres::Client) -> Self {
        Self { client, open: true }
    }

    /// COMMIT (or ROLLBACK) was sent: the transaction ends whatever it answers.
    pub fn committed(&mut self) {
        self.open = false;
    }
}

impl Drop for Begun<'_> {
    fn drop(&mut self) {
        if self.open {
            use futures_util::FutureExt as _;
            // The first poll sends it; a ROLLBACK with no transaction open is only a warning.
            let _ = self.client.batch_execute("ROLLBACK").now_or_never();
        }
    }
}

/// A pooled connection that, when returned to the pool, records how long the store operation
/// held it (`steward_db_connection_held_seconds`): its statements' latency and round trips,
/// plus anything done while holding it — a long tail there is a connection held across
/// upstream I/O, the way a pool runs dry.
pub struct Pooled {
    client: deadpool_postgres::Object,
    schema: &'static str,
    since: std::time::Instant,
}

/// A statement to run on a [`Pooled`] connection: SQL text (prepared through the
/// connection's statement cache) or a statement the caller prepared.
pub enum Sql<'a> {
    Text(&'a str),
    Prepared(&'a tokio_postgres::Statement),
}

impl<'a> From<&'a str> for Sql<'a> {
    fn from(text: &'a str) -> Self {
        Sql::Text(text)
    }
}

impl<'a> From<&'a String> for Sql<'a> {
    fn from(text: &'a String) -> Self {
        Sql::Text(text)
    }
}

impl<'a> From<&'a tokio_postgres::Statement> for Sql<'a> {
    fn from(statement: &'a tokio_postgres::Statement) -> Self {
        Sql::Prepared(statement)
    }
}

type Params<'p> = &'p [&'p (dyn tokio_postgres::types::ToSql + Sync)];

/// Statements run on a `Pooled` connection by their SQL text go through the connection's
/// statement cache: prepared once per connection, then one round trip each, where an
/// unprepared string costs a prepare round trip every time (issue 13). These shadow the
/// client's own methods of the same names, so every store gets the cache without a change at
/// each call site.
impl Pooled {
    async fn statement(
        &self,
        sql: Sql<'_>,
    ) -> Result<tokio_postgres::Statement, tokio_postgres::Error> {
        match sql {
            Sql::Text(text) => self.client.prepare_cached(text).await,
            Sql::Prepared(statement) => Ok(statement.clone()),
        }
    }

    /// `result`, forgetting the connection's prepared statements when the server says one
    /// is stale ("cached plan must not change result type", 0A000, after a migration changed
    /// a table under it): prepared again, the next use works, where the cached one would fail
    /// on this connection for as long as it lives. Only statements run through these methods
    /// are watched: the pipelined and batched statements the stores run on the client itself
    /// (commits, admissions, rate-limit charges) return fixed column types, which a
    /// migration that only adds never changes.
    fn unless_stale<T>(
        &self,
        result: Result<T, tokio_postgres::Error>,
    ) -> Result<T, tokio_postgres::Error> {
        if let Err(e) = &result
            && e.code() == Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED)
        {
            self.client.statement_cache.clear();
        }
        result
    }

    pub async fn query<'a>(
        &self,
        sql: impl Into<Sql<'a>>,
        params: Params<'_>,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let statement = self.statement(sql.into()).await?;
        self.unless_stale(self.client.query(&statement, params).await)
    }

    pub async fn query_one<'a>(
        &self,
        sql: impl Into<Sql<'a>>,
        params: Params<'_>,
    ) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
        let statement = self.statement(sql.into()).await?;
        self.unless_stale(self.client.query_one(&statement, params).await)
    }

    pub async fn query_opt<'a>(
        &self,
        sql: impl Into<Sql<'a>>,
        params: Params<'_>,
    ) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
        let statement = self.statement(sql.into()).await?;
        self.unless_stale(self.client.query_opt(&statement, params).await)
    }

    pub async fn execute<'a>(
        &self,
        sql: impl Into<Sql<'a>>,
        params: Params<'_>,
    ) -> Result<u64, tokio_postgres::Error> {
        let statement = self.statement(sql.into()).await?;
        self.unless_stale(self.client.execute(&statement, params).await)
    }
}

impl std::ops::Deref for Pooled {
    type Target = deadpool_postgres::Object;

    fn deref(&self) -> &Self::Target {
        &self.client
    }
}

impl std::ops::DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.client
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        metrics::histogram!("steward_db_connection_held_seconds", "schema" => self.schema)
            .record(self.since.elapsed().as_secs_f64());
    }
}

/// The pool's size, idle connections and waiters as gauges (`steward_db_pool_connections`),
/// sampled with each readiness probe.
pub fn report(pool: &Pool, schema: &'static str) {
    let status = pool.status();
    for (state, n) in [
        ("max", status.max_size),
        ("open", status.size),
        ("idle", status.available),
        ("waiting", status.waiting),
    ] {
        metrics::gauge!("steward_db_pool_connections", "schema" => schema, "state" => state)
            .set(n as f64);
    }
}

/// How long one migration statement waits for a table's lock. An `ALTER TABLE` waiting behind
/// a long reader (a backup, an operator's query) queues every later statement on that table
/// behind it — every replica's commits, leases and admissions — so it gives way soon and is
/// tried again after a pause instead of stalling the fleet.
const MIGRATION_LOCK_TIMEOUT: &str = "3s";
const MIGRATION_LOCK_PAUSE: Duration = Duration::from_secs(2);
/// Tries of a migration that keeps meeting a held lock: about two minutes in all.
const MIGRATION_LOCK_TRIES: u32 = 25;

/// Applies `runner`'s migrations while holding advisory lock `lock_key` (one key per service,
/// so the two services never wait on each other). A database a newer build has already
/// migrated further is run as it is: its migrations add to the schema and never take from
/// what an older build uses (deploy/README.md), so a rollback or an old replica restarting
/// mid-deploy still starts.
pub async fn migrate(url: &str, runner: refinery::Runner, lock_key: i64) -> Result<(), PgError> {
    use futures_util::StreamExt;
    let (mut client, mut messages) = Target::parse(url)?.connect().await?;
    let connection = tokio::spawn(async move {
        while let Some(message) = messages.next().await {
            if let Err(e) = message {
                tracing::warn!(error = %e, "migration connection closed with an error");
                break;
            }
        }
    });
    client
        .execute("SELECT pg_advisory_lock($1)", &[&lock_key])
        .await?;
    let result = migrate_locked(&mut client, runner).await;
    // Unlock explicitly; closing the session would release it too, but this frees waiters now.
    let unlock = client
        .execute("SELECT pg_advisory_unlock($1)", &[&lock_key])
        .await;
    drop(client);
    let _ = connection.await;
    let report = result?;
    unlock?;
    for m in report.applied_migrations() {
        tracing::info!(version = m.version(), name = m.name(), "applied migration");
    }
    Ok(())
}

/// [`migrate`]'s work once the advisory lock is held.
async fn migrate_locked(
    client: &mut tokio_postgres::Client,
    runner: refinery::Runner,
) -> Result<refinery::Report, PgError> {
    let known = runner
        .get_migrations()
        .iter()
        .map(|m| m.version())
        .max()
        .unwrap_or_default();
    // No history table yet (a new database) reads as nothing applied.
    let ahead: Vec<i32> = runner
        .get_applied_migrations_async(client)
        .await
        .map(|applied| {
            applied
                .iter()
                .map(|m| m.version())
                .filter(|v| *v > known)
                .collect()
        })
        .unwrap_or_default();
    let runner = if ahead.is_empty() {
        runner
    } else {
        tracing::warn!(
            ?ahead,
            this_build = known,
            "the database has migrations from a newer build; running on its schema as it is"
        );
        runner.set_abort_missing(false)
    };
    client
        .batch_execute(&format!("SET lock_timeout = '{MIGRATION_LOCK_TIMEOUT}'"))
        .await?;
    let mut tries = 1;
    loop {
        match runner.run_async(client).await {
            Err(e) if waited_too_long_for_a_lock(&e) && tries < MIGRATION_LOCK_TRIES => {
                tracing::warn!(
                    tries,
                    error = %e,
                    "a migration met a lock held by another session; trying again shortly"
                );
                tries += 1;
                tokio::time::sleep(MIGRATION_LOCK_PAUSE).await;
            }
            result => return Ok(result?),
        }
    }
}

/// Whether a migration failed because its statement's lock wait ran out (55P03).
fn waited_too_long_for_a_lock(e: &refinery::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(pg) = err.downcast_ref::<tokio_postgres::Error>() {
            return pg.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE);
        }
        source = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use tokio_postgres::error::SqlState;

    use super::{ServerConnections, pool_warnings, refused_for_good};

    const DEFAULT_SERVER: ServerConnections = ServerConnections {
        max: 100,
        reserved: 3,
        open_elsewhere: 0,
    };

    #[test]
    fn pools_that_fit_the_server_twice_over_with_nothing_else_open_are_not_warned_about() {
        assert!(pool_warnings(&DEFAULT_SERVER, 16).is_empty());
        assert!(pool_warnings(&DEFAULT_SERVER, 48).is_empty());
    }

    #[test]
    fn a_pool_whose_double_passes_the_server_is_warned_about_by_rule() {
        let warnings = pool_warnings(&DEFAULT_SERVER, 49);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("can open 98 connections")
                && warnings[0].contains("the 97 this PostgreSQL allows"),
            "{}",
            warnings[0]
        );
    }

    #[test]
    fn connections_other_replicas_already_hold_count_against_the_server() {
        // Five replicas of each service with pools of 16 would fit no server by rule; here
        // five pools' worth are open (80), and a sixth pool passes the 97 allowed.
        let busy = ServerConnections {
            open_elsewhere: 5 * 16,
            ..DEFAULT_SERVER
        };
        assert!(pool_warnings(&busy, 17).is_empty(), "80 + 17 fits in 97");
        let warnings = pool_warnings(&busy, 18);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0]
                .contains("80 connections this role can see are open to this PostgreSQL already")
                && warnings[0].contains("with this pool full that is 98"),
            "{}",
            warnings[0]
        );
    }

    #[test]
    fn what_the_server_refused_for_good_is_told_from_what_may_clear_by_waiting() {
        for lasting in [
            SqlState::CHECK_VIOLATION,
            SqlState::FOREIGN_KEY_VIOLATION,
            SqlState::STRING_DATA_RIGHT_TRUNCATION,
            SqlState::UNDEFINED_COLUMN,
            SqlState::INSUFFICIENT_PRIVILEGE,
            SqlState::PROGRAM_LIMIT_EXCEEDED,
            SqlState::RAISE_EXCEPTION,
        ] {
            assert!(refused_for_good(&lasting), "{}", lasting.code());
        }
        for passing in [
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::LOCK_NOT_AVAILABLE,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::QUERY_CANCELED,
            SqlState::CONNECTION_FAILURE,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::FEATURE_NOT_SUPPORTED,
        ] {
            assert!(!refused_for_good(&passing), "{}", passing.code());
        }
    }
}
