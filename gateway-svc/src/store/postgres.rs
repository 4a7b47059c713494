//! The PostgreSQL store. gateway-svc owns the `gateway` schema; its migrations live in
//! `gateway-svc/migrations` and are embedded in the binary.

use svc_kit::{pg, server_config::DatabaseConfig};

use super::{GatewayStore, StoreError};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory-lock key serialising gateway-svc migrations across replicas ("gatewysv" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x6761_7465_7779_7376;

pub struct PgStore {
    pool: pg::PgPool,
}

impl PgStore {
    /// Applies pending migrations, then opens the pool.
    pub async fn connect(config: &DatabaseConfig) -> Result<Self, StoreError> {
        let mut runner = embedded::migrations::runner();
        runner.set_migration_table_name("gateway_schema_history");
        pg::migrate(&config.url, runner, MIGRATION_LOCK_KEY).await?;
        let pool = pg::pool(&config.url, &config.pool)?;
        Ok(Self { pool })
    }
}

#[async_trait::async_trait]
impl GatewayStore for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(pg::ping(&self.pool).await?)
    }
}
