//! PostgreSQL: a deadpool pool for the service, and embedded migrations applied at start-up on a
//! dedicated connection under a PostgreSQL advisory lock, so replicas starting together apply each
//! migration exactly once and the losers wait for the winner instead of failing. Every connection
//! — pooled, migrating or listening — is opened through [`Target`], so TLS is used exactly as
//! DATABASE_URL's `sslmode` asks.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
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
    Checkout(#[from] deadpool_postgres::PoolError),
}

/// Pool settings, from each service's config.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_connections: usize,
    /// How long a caller waits for a free connection before getting an error.
    pub acquire_timeout: Duration,
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
    Pool::builder(manager)
        .max_size(options.max_connections)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(options.acquire_timeout))
        .create_timeout(Some(options.acquire_timeout))
        .recycle_timeout(Some(options.acquire_timeout))
        .build()
        .map_err(|e| PgError::Pool(e.to_string()))
}

/// The most specific words of a connection error: tokio-postgres's own Display says only "db
/// error" or "error performing TLS handshake" and keeps the server's message or the TLS reason in
/// its source.
pub(crate) fn cause(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

/// One round trip through the pool: what readiness means for a database-backed service.
pub async fn ping(pool: &Pool) -> Result<(), PgError> {
    let client = pool.get().await?;
    client.simple_query("SELECT 1").await?;
    Ok(())
}

/// A pooled connection for the `schema` store, timing the wait for it
/// (`steward_db_pool_wait_seconds`): the first sign of a pool too small for its load.
pub async fn checkout(
    pool: &Pool,
    schema: &'static str,
) -> Result<Pooled, deadpool_postgres::PoolError> {
    let started = std::time::Instant::now();
    let client = pool.get().await;
    let now = std::time::Instant::now();
    metrics::histogram!("steward_db_pool_wait_seconds", "schema" => schema)
        .record(now.duration_since(started).as_secs_f64());
    Ok(Pooled {
        client: client?,
        schema,
        since: now,
    })
}

/// A pooled connection that, when returned to the pool, records how long the store operation
/// held it (`steward_db_operation_seconds`): the latency of its statements and round trips,
/// measured once here rather than around every statement.
pub struct Pooled {
    client: deadpool_postgres::Object,
    schema: &'static str,
    since: std::time::Instant,
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
        metrics::histogram!("steward_db_operation_seconds", "schema" => self.schema)
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

/// Applies `runner`'s migrations while holding advisory lock `lock_key` (one key per service,
/// so the two services never wait on each other).
pub async fn migrate(url: &str, runner: refinery::Runner, lock_key: i64) -> Result<(), PgError> {
    use futures_util::StreamExt;
    let (mut client, mut messages) = Target::parse(url)?.connect().await?;
    let connection = tokio::spawn(async move {
        while let Some(message) = messages.next().await {
            if let Err(e) = message {
                tracing::warn!(error = %e, "migration connection closed with an error");
            }
        }
    });
    client
        .execute("SELECT pg_advisory_lock($1)", &[&lock_key])
        .await?;
    let result = runner.run_async(&mut client).await;
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
