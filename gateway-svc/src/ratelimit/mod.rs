//! Per-user upstream rate limits (G-6, S0 AC-04..AC-07).
//!
//! Limits apply per (user, integration, account) to the underlying API calls, charged before the
//! calls are made: a Gmail search of N messages costs 1 + N, reserved as 1 + max_results before
//! its first request — or as much as every window has left, when that is less but still covers
//! the list and one message —, the messages it did not find given back after the list
//! ([`HeldReservation`]). Windows are fixed and aligned to
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
            // The database keeps counts as int4.
            if n > i32::MAX as u32 {
                return Err(format!("{part:?}: a limit must be at most {}", i32::MAX));
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
    /// The start of the window charged (Unix seconds): this clock's, or the next one when
    /// another replica had opened it (see [`current`]).
    pub start: u64,
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

impl Decision {
    /// The windows an allowed charge went into, each with its start: what a refund of it
    /// gives back to. Empty for a denial.
    pub fn charged(&self) -> Vec<(Window, u64)> {
        match self {
            Decision::Allowed(usage) => usage.iter().map(|u| (u.window, u.start)).collect(),
            Decision::Denied { .. } => Vec::new(),
        }
    }
}

/// The window a charge at `now` goes into and what it holds: this clock's window, or the next
/// one when a stored window already starts there — another replica's clock runs ahead across
/// a boundary — which is never rolled back (rolling it back would wipe its count at every
/// boundary). An older stored window is stale and counts as empty; one further ahead (a clock
/// that jumped) is not trusted either, so it cannot stretch a window over hours.
fn current(window: Window, counts: &[WindowCount], now: u64) -> (u64, u32) {
    let ours = window.start(now);
    match counts.iter().find(|(w, _, _)| *w == window) {
        Some(&(_, start, used)) if start == ours || start == ours + window.seconds() => {
            (start, used)
        }
        _ => (ours, 0),
    }
}

/// The decision for a charge of `cost` against stored counts, shared by both backends so they
/// cannot disagree. `counts` holds (window, window_start, used) as stored (see [`current`]).
/// Returns the decision and, when allowed, the new (window, start, used) to store.
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
        let (start, used) = current(window, counts, now);
        if used.saturating_add(cost) > limit {
            let retry_after =
                Duration::from_secs((start + window.seconds()).saturating_sub(now).max(1));
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
            start,
            used: used + cost,
            limit,
        });
    }
    (Decision::Allowed(usage), updated)
}

/// The decision for a charge of as much of `max` as every window has room for, but at least
/// `min` (capped at `max`), shared by both backends: `max` when it fits; otherwise the room left
/// in the fullest window when that is at least `min`; otherwise the denial of `min`. Returns
/// the decision, the counts to store when allowed, and the cost decided on.
pub fn decide_up_to(
    limits: &Limits,
    counts: &[WindowCount],
    min: u32,
    max: u32,
    now: u64,
) -> (Decision, Vec<WindowCount>, u32) {
    let room = limits
        .0
        .iter()
        .map(|&(window, limit)| limit.saturating_sub(current(window, counts, now).1))
        .min()
        .unwrap_or(u32::MAX);
    let cost = max.min(room).max(min.min(max));
    let (decision, updated) = decide(limits, counts, cost, now);
    (decision, updated, cost)
}

/// Stored counts after giving back `amount` of a charge that went into the windows `charged`
/// ((window, start) as the charge decided them), shared by both backends: only those windows
/// lose it — one that has rolled over since keeps its count, so a refund never grants budget
/// in a window it was not charged to, and one a lagging clock charged into the next window is
/// found there —, and never below zero.
pub fn refunded(
    counts: &[WindowCount],
    amount: u32,
    charged: &[(Window, u64)],
) -> Vec<WindowCount> {
    counts
        .iter()
        .map(|&(window, start, used)| {
            if charged.contains(&(window, start)) {
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
    ) -> Result<Decision, StoreError> {
        self.charge_up_to(key, limits, cost, cost, now)
            .await
            .map(|(decision, _)| decision)
    }

    /// Atomically charges every window of `key` as [`decide_up_to`] says: `max` if all can
    /// take it, else as much as all have left if that is at least `min`, else nothing (the
    /// denial of `min`). Returns the decision and the cost decided on.
    async fn charge_up_to(
        &self,
        key: &LimitKey,
        limits: &Limits,
        min: u32,
        max: u32,
        now: u64,
    ) -> Result<(Decision, u32), StoreError>;

    /// Atomically gives back `amount` of a charge to `key` that was not used, as [`refunded`]
    /// says: only in the windows `charged` ([`Decision::charged`]), never taking one below zero.
    async fn refund(
        &self,
        key: &LimitKey,
        amount: u32,
        charged: &[(Window, u64)],
    ) -> Result<(), StoreError>;
}

/// A charge that went through, so what it reserved and did not use can be given back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub key: LimitKey,
    pub cost: u32,
    /// The windows it was charged to, with their starts: a refund goes to those.
    pub charged: Vec<(Window, u64)>,
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
        self.reserve_up_to(key, cost, cost).await.map(drop)
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

    /// Charges `key` as much of `max` as every window has left, but at least `min` (else the
    /// call is refused as a charge of `min` would be), keeping the charge so that what it did
    /// not use can be given back (a search reserves 1 + max_results up front).
    pub async fn reserve_up_to(
        &self,
        key: &LimitKey,
        min: u32,
        max: u32,
    ) -> Result<HeldReservation, ToolError> {
        let now = unix_now();
        let held = |cost: u32, usage: Vec<WindowUsage>| HeldReservation {
            limiter: self.clone(),
            reservation: Reservation {
                key: key.clone(),
                cost,
                charged: usage.iter().map(|u| (u.window, u.start)).collect(),
            },
            usage,
            if_dropped: 0,
        };
        let Some(limits) = (self.limits)(key.integration) else {
            return Ok(held(max, Vec::new()));
        };
        let service = key.integration.label();
        let (decision, cost) = self
            .backend
            .charge_up_to(key, &limits, min, max, now)
            .await
            .map_err(|e| ToolError::Internal(format!("rate limiter unavailable: {e}")))?;
        match decision {
            Decision::Allowed(usage) => {
                for u in &usage {
                    let threshold = (u64::from(u.limit) * 4 / 5) as u32;
                    // Warn once per window: on the charge that crosses 80%.
                    if u.used >= threshold && u.used.saturating_sub(cost) < threshold {
                        tracing::warn!(
                            user = %key.user, integration = key.integration.key(), account = %key.account,
                            window = u.window.label(), used = u.used, limit = u.limit,
                            "rate limit window is over 80% used"
                        );
                    }
                }
                Ok(held(cost, usage))
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
        // Nothing was charged where the integration has no limits.
        if reservation.charged.is_empty() {
            return;
        }
        if let Err(e) = self.backend.refund(key, amount, &reservation.charged).await {
            tracing::warn!(
                error = %e, user = %key.user, integration = key.integration.key(), account = %key.account,
                amount, "could not give back unused rate-limit budget"
            );
        }
    }
}

/// A reservation a call holds: settled with [`HeldReservation::refund`] (what it did not use
/// goes back), or, dropped unsettled because its call was cancelled or timed out, giving back
/// what [`HeldReservation::unused_if_dropped`] last said — in a task of its own, since a drop
/// cannot wait.
pub struct HeldReservation {
    limiter: RateLimiter,
    reservation: Reservation,
    /// Each window after the charge (empty when the integration has no limits).
    usage: Vec<WindowUsage>,
    if_dropped: u32,
}

impl HeldReservation {
    /// The calls reserved.
    pub fn cost(&self) -> u32 {
        self.reservation.cost
    }

    /// The shortest window this reservation filled, and its limit: the one that kept it
    /// smaller than asked.
    pub fn full_window(&self) -> Option<(Window, u32)> {
        self.usage
            .iter()
            .find(|u| u.used >= u.limit)
            .map(|u| (u.window, u.limit))
    }

    /// How much to give back if this reservation is dropped before it is settled (what
    /// surely has not been used yet).
    pub fn unused_if_dropped(&mut self, unused: u32) {
        self.if_dropped = unused.min(self.reservation.cost);
    }

    /// Settles the reservation, giving back `unused` of it. The refund runs in a task of its
    /// own: a caller dropped meanwhile does not lose it.
    pub async fn refund(mut self, unused: u32) {
        self.if_dropped = 0;
        if unused == 0 {
            return;
        }
        let (limiter, reservation) = (self.limiter.clone(), self.reservation.clone());
        let _ = tokio::spawn(async move { limiter.refund(&reservation, unused).await }).await;
    }
}

impl Drop for HeldReservation {
    fn drop(&mut self) {
        let unused = std::mem::take(&mut self.if_dropped);
        if unused == 0 {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (limiter, reservation) = (self.limiter.clone(), self.reservation.clone());
            runtime.spawn(async move { limiter.refund(&reservation, unused).await });
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
    fn a_window_from_a_clock_running_ahead_is_never_rolled_back_and_keeps_its_count() {
        let limits: Limits = "30/minute".parse().unwrap();
        let now = 1_000_000_079; // 59 s into a minute here
        let ahead = Window::Minute.start(now) + 60; // another replica is already in the next
        let (d, stored) = decide(&limits, &[(Window::Minute, ahead, 29)], 1, now);
        assert!(matches!(d, Decision::Allowed(_)), "{d:?}");
        assert_eq!(
            stored,
            [(Window::Minute, ahead, 30)],
            "charged to the newer window"
        );
        let (d, _) = decide(&limits, &[(Window::Minute, ahead, 30)], 1, now);
        assert!(
            matches!(d, Decision::Denied { .. }),
            "its count holds: {d:?}"
        );
        // A window older than this clock's is stale and counts as empty, and so is one from
        // a clock that jumped far ahead.
        for stale in [ahead - 120, ahead + 3_600] {
            let (d, stored) = decide(&limits, &[(Window::Minute, stale, 30)], 1, now);
            assert!(matches!(d, Decision::Allowed(_)), "{d:?}");
            assert_eq!(stored, [(Window::Minute, ahead - 60, 1)]);
        }
        assert!(
            format!("{}/minute", i32::MAX as u64 + 1)
                .parse::<Limits>()
                .is_err()
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
        let charged = [(Window::Minute, minute), (Window::Hour, hour)];
        assert_eq!(
            refunded(&counts, 5, &charged),
            [
                (Window::Minute, minute, 2),
                (Window::Hour, hour, 0),
                (Window::Day, Window::Day.start(charged_at) - 86_400, 9),
            ]
        );
        // The minute rolled over since the charge: the new minute keeps its count.
        let later = [(Window::Minute, minute + 60, 4)];
        assert_eq!(refunded(&later, 3, &charged), later);
        // A lagging clock's charge into the next minute (opened by a clock ahead) is given
        // back there.
        let next = [(Window::Minute, minute + 60, 4)];
        assert_eq!(
            refunded(&next, 3, &[(Window::Minute, minute + 60)]),
            [(Window::Minute, minute + 60, 1)]
        );
    }

    #[test]
    fn a_charge_up_to_takes_what_every_window_has_left_but_never_less_than_its_minimum() {
        let limits: Limits = "10/minute,100/hour".parse().unwrap();
        let now = 1_000_000_038;
        let minute = Window::Minute.start(now);
        let hour = Window::Hour.start(now);
        let cost = |counts: &[WindowCount], min, max| {
            let (d, _, cost) = decide_up_to(&limits, counts, min, max, now);
            matches!(d, Decision::Allowed(_)).then_some(cost)
        };
        // Room for all of it.
        assert_eq!(cost(&[], 2, 7), Some(7));
        // 6 left this minute (the hour has more): cut to 6.
        assert_eq!(cost(&[(Window::Minute, minute, 4)], 2, 7), Some(6));
        // The fullest window decides: 3 left this hour.
        assert_eq!(
            cost(
                &[(Window::Minute, minute, 1), (Window::Hour, hour, 97)],
                2,
                7
            ),
            Some(3)
        );
        // Fewer than the minimum left: refused, with the denial of the minimum.
        let (d, updated, _) = decide_up_to(&limits, &[(Window::Minute, minute, 9)], 2, 7, now);
        assert!(
            matches!(
                d,
                Decision::Denied {
                    window: Window::Minute,
                    limit: 10,
                    ..
                }
            ),
            "{d:?}"
        );
        assert!(updated.is_empty());
        // A plain charge is a charge up to itself.
        assert_eq!(cost(&[(Window::Minute, minute, 4)], 7, 7), None);
    }

    #[tokio::test]
    async fn a_reservation_dropped_unsettled_gives_back_what_it_was_told_is_unused() {
        let limiter = RateLimiter::new(Arc::new(memory::MemoryRateLimits::default()), |_| {
            Some("10/day".parse().unwrap())
        });
        let key = LimitKey {
            user: UserId::parse("u1").unwrap(),
            integration: Integration::Gmail,
            account: "a@x.com".into(),
        };
        let mut held = limiter.reserve_up_to(&key, 2, 10).await.unwrap();
        assert_eq!(held.cost(), 10);
        assert!(limiter.charge(&key, 1).await.is_err(), "all 10 reserved");
        // The search was cancelled during its list request: its 9 fetches never happened.
        held.unused_if_dropped(9);
        drop(held);
        // The refund runs in a task of its own; on this single-threaded runtime it has run
        // once this task has yielded to it.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        limiter.charge(&key, 9).await.unwrap();
        assert!(limiter.charge(&key, 1).await.is_err(), "9 back, no more");
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
