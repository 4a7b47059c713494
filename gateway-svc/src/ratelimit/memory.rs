//! In-process rate-limit counters: exact within one replica, lost on restart.

use std::{collections::HashMap, sync::Mutex};

use super::{
    Decision, LimitKey, Limits, RateLimitBackend, Window, WindowCount, decide_up_to, refunded,
};
use crate::store::StoreError;

/// Past this many keys, windows that ended are pruned on the next charge.
const PRUNE_ABOVE: usize = 10_000;

#[derive(Default)]
pub struct MemoryRateLimits {
    counts: Mutex<HashMap<String, Vec<WindowCount>>>,
}

#[async_trait::async_trait]
impl RateLimitBackend for MemoryRateLimits {
    async fn charge_up_to(
        &self,
        key: &LimitKey,
        limits: &Limits,
        min: u32,
        max: u32,
        now: u64,
    ) -> Result<(Decision, u32), StoreError> {
        let mut counts = self
            .counts
            .lock()
            .map_err(|_| StoreError::Unavailable("rate limiter lock poisoned".into()))?;
        if counts.len() > PRUNE_ABOVE {
            counts.retain(|_, windows| {
                windows
                    .iter()
                    .any(|(w, start, _)| start + w.seconds() > now)
            });
        }
        let entry = counts.entry(key.storage_key()).or_default();
        let (decision, updated, cost) = decide_up_to(limits, entry, min, max, now);
        if matches!(decision, Decision::Allowed(_)) {
            *entry = updated;
        }
        Ok((decision, cost))
    }

    async fn refund(
        &self,
        key: &LimitKey,
        amount: u32,
        charged: &[(Window, u64)],
    ) -> Result<(), StoreError> {
        let mut counts = self
            .counts
            .lock()
            .map_err(|_| StoreError::Unavailable("rate limiter lock poisoned".into()))?;
        if let Some(entry) = counts.get_mut(&key.storage_key()) {
            *entry = refunded(entry, amount, charged);
        }
        Ok(())
    }
}
