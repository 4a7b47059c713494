//! The embedded store: process memory, for local runs and tests with no database.

use super::{GatewayStore, StoreError};

#[derive(Debug, Default)]
pub struct MemoryStore {}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait::async_trait]
impl GatewayStore for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
