//! Per-user upstream rate limits (G-6, S0 AC-04..AC-07).
//!
//! Limits apply per (user, integration, account) to the underlying API calls, charged before the
//! calls are made: a Gmail search of N messages costs 1 + N, reserved as 1 + max_results before
//! its first request, the messages it did not find given back after the list ([`Reservation`]). Windows are fixed and aligned to
//! the minute, hour and day (UTC), so every replica agrees on them and a denial can say exactly
//! when the window reopens. Two backends implement one decision: in-process (the default) and
//! PostgreSQL (shared by every replica, exact under concurrency).

pub mod memory;
pub mod postgres;

use std::{fmt, str::FromStr, sync::Arc, time::Duration};

use crate::{
    domain::{Integration, UserId},
    enforce::ToolError,
    store::StoreError,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Window {
    Minute,
    Hour,
    Day,
}

impl Window {
    pub fn seconds(self) -> u64 {
        match self {
            Window::Minute => 60,
            Window::Hour => 3600,
            Window::Day => 86_400,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Window::Minute => "minute",
            Window::Hour => "hour",
            Window::Day => "day",
        }
    }

    /// The start of the window containing `now` (seconds since the Unix epoch).
    pub fn start(self, now: u64) -> u64 {
        now - now % self.seconds()
    }
}

/// The limits of one integration, e.g. `30/minute,500/hour,5000/day`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits(pub Vec<(Window, u32)>);

impl Limits {
    pub fn google_default() -> Self {
        Limits(vec![
            (Window::Minute, 30),
            (Window::Hour, 500),
            (Window::Day, 5000),
        ])
    }
}

impl FromStr for Limits {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (n, w) = part
                .split_once('/')
                .ok_or_else(|| format!("{part:?} is not N/window"))?;
            let n: u32 = n
                .trim()
                .parse()
                .map_err(|_| format!("{n:?} is not a whole number"))?;
            let w = match w.trim() {
                "minute" | "min" | "m" => Window::Minute,
                "hour" | "h" => Window::Hour,
                "day" | "d" => Window::Day,
                other => return Err(format!("{other:?} is not minute, hour or day")),
            };
            if n == 0 {
                return Err(format!("{part:?}: a limit must be at least 1"));
            }
            if out.iter().any(|(existing, _)| *existing == w) {
                return Err(format!("the {} window is given twice", w.label()));
            }
            out.push((w, n));
        }
        if out.is_empty() {
            return Err("no limits given".into());
        }
        Ok(Limits(out))
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<_> = self
            .0
            .iter()
            .map(|(w, n)| format!("{n}/{}", w.label()))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// Whose budget a charge comes out of.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LimitKey {
    pub user: UserId,
    pub integration: Integration,
    pub account: String,
}

impl LimitKey {
    /// One string for storage. U+001F cannot occur in a user id or an integration key, and
    /// the account comes last, so the key is unambiguous (and, unlike NUL, PostgreSQL stores it).
    pub fn storage_key(&self) -> String {
        format!(
            "{}\u{1f}{}\u{1f}{}",
            self.user,
            self.integration.key(),
            self.account
        )
    }
}

/// A stored counter: (window, start of the window in Unix seconds, calls used in it).
pub type WindowCount = (Window, u64, u32);

/// Usage of one window after an allowed charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowUsage {
    pub window: Window,
    pub used: u32,
    pub limit: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allowed(Vec<WindowUsage>),
    /// The first window (shortest first) that cannot take the charge.
    Denied {
        window: Window,
        limit: u32,
        retry_after: Duration,
    },
}

/// The decision for a charge of `cost` against stored counts, shared by both backends so they
/// cannot disagree. `counts` holds (window, window_start, used) as stored; stale windows count
/// as empty. Returns the decision and, when allowed, the new (window, start, used) to store.
pub fn decide(
    limits: &Limits,
    counts: &[WindowCount],
    cost: u32,
    now: u64,
) -> (Decision, Vec<WindowCount>) {
    let mut updated = Vec::with_capacity(limits.0.len());
    let mut usage = Vec::with_capacity(limits.0.len());
    let mut windows = limits.0.clone();
    windows.sort_by_key(|(w, _)| w.seconds());
    for (window, limit) in windows {
        let start = window.start(now);
        let used = counts
            .iter()
            .find(|(w, s, _)| *w == window && *s == start)
            .map_or(0, |(_, _, used)| *used);
        if used.saturating_add(cost) > limit {
            let retry_after = Duration::from_secs(start + window.seconds() - now);
            return (
                Decision::Denied {
                    window,
                    limit,
                    retry_after,
                },
                Vec::new(),
            );
        }
        updated.push((window, start, used + cost));
        usage.push(WindowUsage {
            window,
            used: used + cost,
            limit,
        });
    }
    (Decision::Allowed(usage), updated)
}

/// Stored counts after giving back `amount` of a charge made at `charged_at`, shared by both
/// backends: only the windows that charge went into lose it (one that has rolled over since
/// keeps its count, so a refund never grants budget in a window it was not charged to), and
/// never below zero.
pub fn refunded(counts: &[WindowCount], amount: u32, charged_at: u64) -> Vec<WindowCount> {
    counts
        .iter()
        .map(|&(window, start, used)| {
            if start == window.start(charged_at) {
                (window, start, used.saturating_sub(amount))
            } else {
                (window, start, used)
            }
        })
        .collect()
}

#[async_trait::async_trait]
pub trait RateLimitBackend: Send + Sync + 'static {
    /// Atomically charges `cost` to every window of `key` if all of them can take it.
    async fn charge(
        &self,
        key: &LimitKey,
        limits: &Limits,
        cost: u32,
        now: u64,
    ) -> Result<Decision, StoreError>;

    /// Atomically gives back `amount` of a charge to `key` made at `charged_at` that was not
    /// used, as [`refunded`] says: only in the windows of `limits` that charge went into, never
    /// taking one below zero.
    async fn refund(
        &self,
        key: &LimitKey,
        limits: &Limits,
        amount: u32,
        charged_at: u64,
    ) -> Result<(), StoreError>;
}

/// A charge that went through, so what it reserved and did not use can be given back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub key: LimitKey,
    pub cost: u32,
    /// When it was charged (Unix seconds): a refund goes to the windows of that moment.
    pub at: u64,
}

/// The limiter tools call: picks the integration's limits, charges, warns at 80%, and turns a
/// denial into the sentence the model reads.
#[derive(Clone)]
pub struct RateLimiter {
    backend: Arc<dyn RateLimitBackend>,
    limits: Arc<dyn Fn(Integration) -> Option<Limits> + Send + Sync>,
}

impl RateLimiter {
    pub fn new(
        backend: Arc<dyn RateLimitBackend>,
        limits: impl Fn(Integration) -> Option<Limits> + Send + Sync + 'static,
    ) -> Self {
        Self {
            backend,
            limits: Arc::new(limits),
        }
    }

    /// Charges `cost` upstream calls to `key` now. Integrations without limits always pass.
    pub async fn charge(&self, key: &LimitKey, cost: u32) -> Result<(), ToolError> {
        self.reserve(key, cost).await.map(drop)
    }

    /// The smallest limit of `integration`'s windows and that window: the most one charge can
    /// ever be. `None` when the integration has no limits.
    pub fn tightest(&self, integration: Integration) -> Option<(u32, Window)> {
        (self.limits)(integration)?
            .0
            .into_iter()
            .map(|(w, n)| (n, w))
            .min_by_key(|(n, w)| (*n, w.seconds()))
    }

    /// As [`RateLimiter::charge`], returning the charge so that what it did not use can be
    /// given back with [`RateLimiter::refund`] (a search reserves 1 + max_results up front).
    pub async fn reserve(&self, key: &LimitKey, cost: u32) -> Result<Reservation, ToolError> {
        let now = unix_now();
        let reservation = Reservation {
            key: key.clone(),
            cost,
            at: now,
        };
        let Some(limits) = (self.limits)(key.integration) else {
            return Ok(reservation);
        };
        let service = key.integration.label();
        let decision = self
            .backend
            .charge(key, &limits, cost, now)
            .await
            .map_err(|e| ToolError::Internal(format!("rate limiter unavailable: {e}")))?;
        match decision {
            Decision::Allowed(usage) => {
                for u in usage {
                    let threshold = u.limit * 4 / 5;
                    // Warn once per window: on the charge that crosses 80%.
                    if u.used >= threshold && u.used.saturating_sub(cost) < threshold {
                        tracing::warn!(
                            user = %key.user, integration = key.integration.key(), account = %key.account,
                            window = u.window.label(), used = u.used, limit = u.limit,
                            "rate limit window is over 80% used"
                        );
                    }
                }
                Ok(reservation)
            }
            Decision::Denied { window, limit, .. } if cost > limit => Err(ToolError::OverBudget {
                service,
                cost,
                limit,
                window: window.label(),
            }),
            Decision::Denied {
                window,
                limit,
                retry_after,
            } => {
                metrics_rate_limited(key.integration);
                Err(ToolError::RateLimited {
                    service,
                    limit,
                    window: window.label(),
                    retry_after,
                })
            }
        }
    }

    /// Gives back `unused` calls of `reservation` (at most what it charged). A refund that
    /// cannot be made leaves the user with less budget than they have, never more: it is
    /// logged, not an error of the call.
    pub async fn refund(&self, reservation: &Reservation, unused: u32) {
        let amount = unused.min(reservation.cost);
        if amount == 0 {
            return;
        }
        let key = &reservation.key;
        let Some(limits) = (self.limits)(key.integration) else {
            return;
        };
        if let Err(e) = self
            .backend
            .refund(key, &limits, amount, reservation.at)
            .await
        {
            tracing::warn!(
                error = %e, user = %key.user, integration = key.integration.key(), account = %key.account,
                amount, "could not give back unused rate-limit budget"
            );
        }
    }
}

fn metrics_rate_limited(integration: Integration) {
    tracing::info!(integration = integration.key(), "rate limit hit");
    crate::metrics::rate_limit_denied(integration.key());
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_and_print_round_trip() {
        let l: Limits = "30/minute, 500/hour,5000/day".parse().unwrap();
        assert_eq!(l, Limits::google_default());
        assert_eq!(l.to_string(), "30/minute,500/hour,5000/day");
        assert!("0/minute".parse::<Limits>().is_err());
        assert!("30/week".parse::<Limits>().is_err());
        assert!("30/minute,40/min".parse::<Limits>().is_err());
    }

    #[test]
    fn a_denial_names_the_shortest_full_window_and_when_it_reopens() {
        let limits = Limits::google_default();
        let now = 1_000_000_038; // 18 s into a minute (1_000_000_020 is a whole minute)
        let start = Window::Minute.start(now);
        let (d, _) = decide(&limits, &[(Window::Minute, start, 30)], 1, now);
        assert_eq!(
            d,
            Decision::Denied {
                window: Window::Minute,
                limit: 30,
                retry_after: Duration::from_secs(42)
            }
        );
    }

    #[test]
    fn a_refund_goes_only_to_the_windows_it_was_charged_to_and_never_below_zero() {
        let charged_at = 1_000_000_038;
        let minute = Window::Minute.start(charged_at);
        let hour = Window::Hour.start(charged_at);
        let counts = [
            (Window::Minute, minute, 7),
            (Window::Hour, hour, 3),
            // A day window from before the charge (stale): untouched.
            (Window::Day, Window::Day.start(charged_at) - 86_400, 9),
        ];
        assert_eq!(
            refunded(&counts, 5, charged_at),
            [
                (Window::Minute, minute, 2),
                (Window::Hour, hour, 0),
                (Window::Day, Window::Day.start(charged_at) - 86_400, 9),
            ]
        );
        // The minute rolled over since the charge: the new minute keeps its count.
        let later = [(Window::Minute, minute + 60, 4)];
        assert_eq!(refunded(&later, 3, charged_at), later);
    }

    #[test]
    fn counts_from_an_earlier_window_do_not_count() {
        let limits = Limits::google_default();
        let now = 1_000_000_038;
        let (d, updated) = decide(
            &limits,
            &[(Window::Minute, Window::Minute.start(now) - 60, 30)],
            11,
            now,
        );
        assert!(matches!(d, Decision::Allowed(_)));
        assert!(updated.contains(&(Window::Minute, Window::Minute.start(now), 11)));
    }
}
