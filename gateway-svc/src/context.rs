//! What a tool can do while it runs: find the user's accounts, charge the rate limiter, and call
//! upstream through one HTTP path that adds the access token, refreshes it once on a 401, reads
//! the body under the byte cap, classifies failures, counts and audits every call.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use reqwest::{RequestBuilder, StatusCode, header::HeaderMap};
use serde::de::DeserializeOwned;

use crate::{
    audit::AuditTrail,
    credentials::{Accounts, Credentials},
    domain::{Channel, Integration, UserId},
    enforce::{ToolError, caps::read_capped},
    ratelimit::{HeldReservation, LimitKey, RateLimiter, Window},
    store::{ActingMark, AuditEntry, AuditRecord},
};

/// Shared by every call.
pub struct Services {
    pub credentials: Credentials,
    pub limiter: RateLimiter,
    pub http: reqwest::Client,
    /// Written at once (`record`) or through the batching writer (`enqueue`).
    pub audit: Arc<AuditTrail>,
    /// Hard cap on any upstream response body.
    pub max_body_bytes: usize,
}

/// The HTTP client of the integrations and of OAuth token refreshes, each request bounded by
/// `timeout`. It never follows a redirect: a write answered 3xx may already have acted, and
/// following it with a GET whose 404 looked like a refusal would free the idempotency key of a
/// send that happened; a redirect would also carry the bearer token to wherever it points.
/// None of the APIs called (Google's, Slack's, Google's token endpoint) redirect an API call.
pub fn upstream_client(timeout: Duration) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(Duration::from_secs(5))
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("steward-gateway/", env!("CARGO_PKG_VERSION")))
        .build()
}

pub struct CallContext {
    pub user: UserId,
    pub channel: Channel,
    pub call_id: String,
    pub run_id: Option<String>,
    pub tool: String,
    /// Where the run had read others' words before this call: the provenance of anything the
    /// call stores (memories). Empty: the user's own words only.
    pub read_external_from: Vec<String>,
    /// The user's zone, when the call named one: dates and times in results are shown in it,
    /// and dates and local times in arguments read in it ([`CallContext::zone`]).
    pub time_zone: Option<jiff::tz::TimeZone>,
    /// Its audit records (upstream calls) are kept here and written once the call is over,
    /// outside its deadline ([`CallContext::take_deferred`]): a read-only call's by the
    /// batching writer, any other's at once, before its outcome is stored. Otherwise (a
    /// context made outside the engine) each is written before the call goes on.
    pub(crate) audit_later: bool,
    /// The call is a side effect (`ToolSpec::side_effect`, dispatched through the idempotency
    /// key), set where the engine runs it. Only then are its writing requests counted
    /// ([`Self::write_attempt`]), and only then is a 2xx whose body cannot be read taken as
    /// done: a read-only tool's POST (Gmail's batch fetch) acted on nothing, so its unreadable
    /// answer is the same failure a GET's is.
    pub(crate) side_effect: bool,
    /// The records kept while `audit_later`, each with its time.
    deferred: Mutex<Vec<AuditEntry>>,
    services: Arc<Services>,
    upstream_calls: AtomicU32,
    /// Writing requests that left and were not refused outright (see [`Self::write_attempt`]).
    writes: AtomicU32,
    /// A write was answered 2xx: the call has acted, whatever happens after.
    accepted: std::sync::atomic::AtomicBool,
    /// Marks the call's idempotency key before its first write leaves (set by the engine for
    /// a side effect), and whether it has been marked.
    pub(crate) acting: Option<Arc<dyn ActingMark>>,
    marked: tokio::sync::Mutex<bool>,
    account: Mutex<Option<String>>,
    /// The access token of each account the call charged or sent as, resolved once per call.
    tokens: Mutex<Vec<(Integration, String, String)>>,
}

/// An upstream answer that passed the status checks.
#[derive(Debug)]
pub struct UpstreamResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl UpstreamResponse {
    pub fn json<T: DeserializeOwned>(&self, service: &'static str) -> Result<T, ToolError> {
        serde_json::from_slice(&self.body).map_err(|e| ToolError::UpstreamGarbage {
            service,
            detail: format!("invalid JSON: {e}"),
        })
    }
}

/// Where times are shown when the call named no zone.
static UTC: jiff::tz::TimeZone = jiff::tz::TimeZone::UTC;

impl CallContext {
    /// The zone results are shown in: the user's, or UTC when the call named none (the times
    /// Steward shows with a clock say "UTC" then; bare dates are UTC's days).
    pub fn zone(&self) -> &jiff::tz::TimeZone {
        self.time_zone.as_ref().unwrap_or(&UTC)
    }

    pub fn new(
        services: Arc<Services>,
        user: UserId,
        channel: Channel,
        call_id: String,
        run_id: Option<String>,
        tool: String,
    ) -> Self {
        Self {
            user,
            channel,
            call_id,
            run_id,
            tool,
            read_external_from: Vec::new(),
            time_zone: None,
            audit_later: false,
            side_effect: false,
            deferred: Mutex::new(Vec::new()),
            services,
            upstream_calls: AtomicU32::new(0),
            writes: AtomicU32::new(0),
            accepted: std::sync::atomic::AtomicBool::new(false),
            acting: None,
            marked: tokio::sync::Mutex::new(false),
            account: Mutex::new(None),
            tokens: Mutex::new(Vec::new()),
        }
    }

    pub fn upstream_calls(&self) -> u32 {
        self.upstream_calls.load(Ordering::Relaxed)
    }

    /// Counts a writing request (one that can change something upstream: an HTTP method other
    /// than GET/HEAD/OPTIONS, an MCP `tools/call`) about to leave. Counted before it is sent,
    /// never after: a call cut off or failed once it left may still have acted, and a
    /// side effect with a write counted keeps its idempotency key, so a retry replays instead
    /// of acting twice. Reads (a reply reading its original first) are not counted: a side
    /// effect that failed before any write did nothing. Counted only for a side effect
    /// (`side_effect`): the count decides what happens to an idempotency key, which only a
    /// side effect holds; a read-only call's POST (a batch of reads) is no write.
    ///
    /// Before a side effect's first write its idempotency key is marked as acting: a holder
    /// that dies after this point (its replica killed before the result is stored) leaves a key
    /// no retry takes over (R-3). When the mark cannot be made the write must not leave: the
    /// error says nothing was done.
    pub async fn write_attempt(&self) -> Result<(), ToolError> {
        if !self.side_effect {
            return Ok(());
        }
        if let Some(acting) = &self.acting {
            let mut marked = self.marked.lock().await;
            if !*marked {
                acting.mark().await.map_err(|e| {
                    tracing::error!(error = %e, tool = %self.tool, "a side effect's write was not sent: its idempotency key could not be marked");
                    ToolError::Internal(format!(
                        "not executed, because its idempotency key could not be marked: {e}"
                    ))
                })?;
                *marked = true;
            }
        }
        self.writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// A counted write was refused outright (a 4xx answer; a 3xx is no refusal: the write
    /// may have acted before the upstream pointed elsewhere), or never left (no connection
    /// could be made): that request did nothing.
    pub(crate) fn write_refused(&self) {
        let _ = self
            .writes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Whether a writing request left and was not refused outright: the call may have acted.
    /// Never, for a call that is no side effect (see [`Self::write_attempt`]).
    pub fn may_have_written(&self) -> bool {
        self.writes.load(Ordering::Relaxed) > 0
    }

    /// Whether a side effect's write was answered 2xx: it was done.
    pub fn write_accepted(&self) -> bool {
        self.accepted.load(Ordering::Relaxed)
    }

    /// The account the call used (the last one named to `charge` or `send`).
    pub fn account(&self) -> Option<String> {
        self.account.lock().ok().and_then(|a| a.clone())
    }

    fn use_account(&self, account: &str) {
        if let Ok(mut a) = self.account.lock() {
            *a = Some(account.to_owned());
        }
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.services.http
    }

    /// The user's accounts of `integration`, at least one usable (see [`Accounts`]).
    pub async fn accounts(&self, integration: Integration) -> Result<Accounts, ToolError> {
        self.accounts_named(integration, None).await
    }

    /// As [`Self::accounts`], for a call that names the account it means (`named`): when
    /// none is usable, the refusal names that account if it needs reconnecting.
    pub async fn accounts_named(
        &self,
        integration: Integration,
        named: Option<&str>,
    ) -> Result<Accounts, ToolError> {
        self.services
            .credentials
            .usable_accounts_named(&self.user, integration, named)
            .await
    }

    /// A usable access token of `account`: the one this call already resolved, or one from the
    /// credentials (refreshed first when it is about to expire).
    async fn token(&self, integration: Integration, account: &str) -> Result<String, ToolError> {
        let known = self.tokens.lock().ok().and_then(|t| {
            t.iter()
                .find(|(i, a, _)| *i == integration && a == account)
                .map(|(_, _, token)| token.clone())
        });
        if let Some(token) = known {
            return Ok(token);
        }
        let token = self
            .services
            .credentials
            .access_token(&self.user, integration, account, None)
            .await?;
        self.remember_token(integration, account, &token);
        Ok(token)
    }

    fn remember_token(&self, integration: Integration, account: &str, token: &str) {
        if let Ok(mut t) = self.tokens.lock() {
            t.retain(|(i, a, _)| !(*i == integration && a == account));
            t.push((integration, account.to_owned(), token.to_owned()));
        }
    }

    /// The account's token was refused and could not be replaced: later sends of this call
    /// ask the credentials again (which know whether the account must be reconnected).
    fn forget_token(&self, integration: Integration, account: &str) {
        if let Ok(mut t) = self.tokens.lock() {
            t.retain(|(i, a, _)| !(*i == integration && a == account));
        }
    }

    /// The upstream refused `account`'s credentials for good in its own words (Slack's
    /// `invalid_auth`, `token_revoked`): the account is marked as needing reconnecting, so
    /// the next call picks another account and the tool is no longer offered for it, unless a
    /// different token was put in place meanwhile.
    pub async fn credentials_refused(&self, integration: Integration, account: &str) {
        let used = self.tokens.lock().ok().and_then(|t| {
            t.iter()
                .find(|(i, a, _)| *i == integration && a == account)
                .map(|(_, _, token)| token.clone())
        });
        self.forget_token(integration, account);
        if let Some(token) = used {
            self.services
                .credentials
                .refused_fresh(&self.user, integration, account, &token)
                .await;
        }
    }

    /// Before a charge: an account that needs credentials must have usable ones, so a missing
    /// or revoked account (or one whose refresh fails) costs no budget for calls it cannot make.
    async fn can_send(&self, integration: Integration, account: &str) -> Result<(), ToolError> {
        if integration.provider().is_some() {
            self.token(integration, account).await?;
        }
        Ok(())
    }

    /// Charges `cost` upstream calls against the user's limits for `account` before making them.
    pub async fn charge(
        &self,
        integration: Integration,
        account: &str,
        cost: u32,
    ) -> Result<(), ToolError> {
        self.use_account(account);
        self.can_send(integration, account).await?;
        let key = LimitKey {
            user: self.user.clone(),
            integration,
            account: account.to_owned(),
        };
        self.services.limiter.charge(&key, cost).await
    }

    /// Reserves between `min` and `max` upstream calls against the user's limits for
    /// `account`: `max` when every window has room for it, otherwise as many as every window
    /// has left if that is at least `min`; below `min` the call is refused like a charge.
    /// What the reservation does not use is given back with [`HeldReservation::refund`]; a
    /// reservation dropped unsettled (the call cancelled or timed out) gives back what it was
    /// told would be unused if dropped.
    pub async fn reserve_up_to(
        &self,
        integration: Integration,
        account: &str,
        min: u32,
        max: u32,
    ) -> Result<HeldReservation, ToolError> {
        self.use_account(account);
        self.can_send(integration, account).await?;
        let key = LimitKey {
            user: self.user.clone(),
            integration,
            account: account.to_owned(),
        };
        self.services.limiter.reserve_up_to(&key, min, max).await
    }

    /// The most one charge to `integration` can ever be, and its window (`None`: no limits).
    pub fn tightest_limit(&self, integration: Integration) -> Option<(u32, Window)> {
        self.services.limiter.tightest(integration)
    }

    /// Sends an authorised request for `account`: `build` makes the request with the bearer
    /// token; on a 401 the token is refreshed and the request sent once more (charged as one
    /// more upstream call). Returns 2xx and 404 answers; every other status is an error.
    pub async fn send(
        &self,
        integration: Integration,
        account: &str,
        build: impl Fn(&str) -> RequestBuilder,
    ) -> Result<UpstreamResponse, ToolError> {
        self.send_costing(integration, account, 1, build).await
    }

    /// As [`Self::send`], for a request that costs `cost` upstream calls (a batch of that
    /// many): sent again after a 401, it is charged `cost` again, as the upstream counts it.
    pub async fn send_costing(
        &self,
        integration: Integration,
        account: &str,
        cost: u32,
        build: impl Fn(&str) -> RequestBuilder,
    ) -> Result<UpstreamResponse, ToolError> {
        self.use_account(account);
        let credentials = &self.services.credentials;
        let token = self.token(integration, account).await?;
        let first = self
            .send_raw(integration, Some(account), build(&token))
            .await?;
        if first.status != StatusCode::UNAUTHORIZED {
            return check_status(integration.label(), account, first);
        }
        let token = match credentials
            .access_token(&self.user, integration, account, Some(&token))
            .await
        {
            Ok(token) => token,
            Err(e) => {
                self.forget_token(integration, account);
                return Err(e);
            }
        };
        self.remember_token(integration, account, &token);
        self.charge(integration, account, cost).await?;
        let second = self
            .send_raw(integration, Some(account), build(&token))
            .await?;
        if second.status == StatusCode::UNAUTHORIZED {
            credentials
                .refused_fresh(&self.user, integration, account, &token)
                .await;
            self.forget_token(integration, account);
            return Err(ToolError::CredentialsRevoked {
                provider: integration
                    .provider()
                    .map_or(integration.label(), |p| p.label()),
                accounts: vec![account.to_owned()],
            });
        }
        check_status(integration.label(), account, second)
    }

    /// Sends one request and reads its body under the cap; any status comes back. A side
    /// effect's request of a writing method is counted as a write ([`Self::write_attempt`])
    /// before it leaves, and uncounted when the upstream refuses it outright (4xx). Such a
    /// write the upstream accepted (2xx) whose body cannot be read (cut off, over the cap)
    /// comes back with an empty body: it was done, and must not be retried. Any other
    /// request's unreadable body (a read-only tool's POST too) is an error, as a GET's is.
    async fn send_raw(
        &self,
        integration: Integration,
        account: Option<&str>,
        request: RequestBuilder,
    ) -> Result<UpstreamResponse, ToolError> {
        let service = integration.label();
        let (client, request) = request.build_split();
        // Not sent: a request that cannot be built did nothing.
        let request = request.map_err(|e| transport_error(service, &e, Duration::ZERO))?;
        // Only a side effect writes (see `side_effect`): a read-only tool's POST does not.
        let writes = self.side_effect && !request.method().is_safe();
        if writes {
            self.write_attempt().await?;
        }
        let started = Instant::now();
        self.upstream_attempt();
        let result: Result<UpstreamResponse, ToolError> = async {
            let response = client.execute(request).await.map_err(|e| {
                // No connection (DNS, refused, connect timeout, TLS handshake): the request
                // was never written, so it did nothing and the call is free to be tried again.
                if writes && e.is_connect() {
                    self.write_refused();
                }
                transport_error(service, &e, started.elapsed())
            })?;
            let status = response.status();
            if writes && status.is_client_error() {
                self.write_refused();
            }
            if writes && status.is_success() {
                self.accepted.store(true, Ordering::Relaxed);
            }
            let headers = response.headers().clone();
            let body = match read_capped(response, self.services.max_body_bytes).await {
                Ok(Ok(body)) => body,
                Err(_) | Ok(Err(_)) if writes && status.is_success() => {
                    tracing::warn!(
                        service,
                        status = status.as_u16(),
                        "a write was accepted but its answer could not be read"
                    );
                    Vec::new()
                }
                Err(e) => return Err(transport_error(service, &e, started.elapsed())),
                Ok(Err(e)) => {
                    return Err(ToolError::UpstreamGarbage {
                        service,
                        detail: e.to_string(),
                    });
                }
            };
            Ok(UpstreamResponse {
                status,
                headers,
                body,
            })
        }
        .await;
        let (status, bytes) = match &result {
            Ok(r) => (r.status.as_u16().to_string(), r.body.len()),
            Err(e) => (e.kind().as_str().to_owned(), 0),
        };
        self.record_upstream_call(integration, account, &status, started, bytes)
            .await;
        result
    }

    /// Counts a request about to leave for upstream (read or write), for the call's outcome and
    /// audit. Whether a side effect may have acted is counted apart, by
    /// [`Self::write_attempt`].
    pub fn upstream_attempt(&self) {
        self.upstream_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Measures and audits one upstream call made since `started` (HTTP here; an MCP
    /// `tools/call` in `crate::mcp`), counted by [`Self::upstream_attempt`] before it left.
    pub async fn record_upstream_call(
        &self,
        integration: Integration,
        account: Option<&str>,
        status: &str,
        started: Instant,
        bytes: usize,
    ) {
        crate::metrics::upstream_request(integration.key(), status, started.elapsed());
        self.audit(AuditRecord {
            user: self.user.to_string(),
            kind: "upstream_call".into(),
            tool: self.tool.clone(),
            integration: Some(integration.key().into()),
            account: account.map(str::to_owned),
            call_id: self.call_id.clone(),
            run_id: self.run_id.clone(),
            status: status.to_owned(),
            latency_ms: millis(started.elapsed()),
            bytes: u32::try_from(bytes).unwrap_or(u32::MAX),
            upstream_calls: 1,
        })
        .await;
    }

    /// Audits one record of this call: kept until the call is over (see `audit_later`), never
    /// written here, inside the call's deadline, where a slow store could cut it off.
    pub async fn audit(&self, record: AuditRecord) {
        // (A poisoned lock: written at once rather than lost.)
        if self.audit_later
            && let Ok(mut deferred) = self.deferred.lock()
        {
            deferred.push(AuditEntry::now(record));
            return;
        }
        // Tried again, or logged in full, by `record_now`.
        let _ = self.services.audit.record_now(record).await;
    }

    /// The records kept for the batching writer so far, in their order (see `audit_later`).
    pub(crate) fn take_deferred(&self) -> Vec<AuditEntry> {
        self.deferred
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default()
    }
}

impl Drop for CallContext {
    /// A call dropped before the engine queued its records (its caller went away mid-call)
    /// still hands over the upstream records it kept.
    fn drop(&mut self) {
        let deferred = self.take_deferred();
        if deferred.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let audit = self.services.audit.clone();
                runtime.spawn(async move { audit.enqueue(deferred).await });
            }
            Err(_) => tracing::error!(
                records = deferred.len(),
                "AUDIT RECORDS LOST: a call's audit records were dropped outside the runtime"
            ),
        }
    }
}

pub fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// `elapsed`: how long the request had been out when it failed, the honest "within" of a
/// timeout.
fn transport_error(service: &'static str, e: &reqwest::Error, elapsed: Duration) -> ToolError {
    // Before `is_timeout`: a connect timeout is both, and no request was sent — the upstream
    // was never reached, it did not fail to answer.
    if e.is_connect() {
        ToolError::UpstreamUnavailable {
            service,
            detail: if e.is_timeout() {
                "the connection timed out".into()
            } else {
                "connection refused or failed".into()
            },
        }
    } else if e.is_timeout() {
        ToolError::UpstreamTimeout {
            service,
            after: elapsed,
        }
    } else if e.is_body() || e.is_decode() {
        ToolError::UpstreamGarbage {
            service,
            detail: "the response body was cut off".into(),
        }
    } else {
        ToolError::UpstreamUnavailable {
            service,
            detail: "the request failed in transit".into(),
        }
    }
}

/// Turns non-success statuses into errors the model can act on. 404 is returned to the tool,
/// which knows what was missing.
fn check_status(
    service: &'static str,
    account: &str,
    r: UpstreamResponse,
) -> Result<UpstreamResponse, ToolError> {
    let status = r.status;
    if status.is_success() || status == StatusCode::NOT_FOUND {
        return Ok(r);
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        return Err(ToolError::UpstreamRateLimited {
            service,
            retry_after: retry_after(&r.headers),
        });
    }
    let reason = google_reason(&r.body);
    // Google answers a rate or quota limit with 403 and says so in the reason: a limit to wait
    // out, not a permission the user lacks.
    if status == StatusCode::FORBIDDEN
        && let Some(wait) = reason
            .as_deref()
            .and_then(|why| limit_wait(why, &r.headers))
    {
        return Err(ToolError::UpstreamRateLimited {
            service,
            retry_after: wait,
        });
    }
    // What the upstream said stays in the logs (redacted): it can echo tokens or the request,
    // and it is someone else's words. The model and the user get the classified sentence,
    // with at most Google's reason, a machine word from a fixed vocabulary.
    tracing::warn!(
        service,
        status = status.as_u16(),
        reason = reason.as_deref().unwrap_or(""),
        detail = %svc_kit::text::redacted_excerpt(&short_detail(&r.body), 200),
        "upstream error"
    );
    let said = |before: &str, after: &str| {
        reason
            .as_deref()
            .map(|r| format!("{before}{r}{after}"))
            .unwrap_or_default()
    };
    if status == StatusCode::FORBIDDEN {
        return Err(ToolError::PermissionDenied {
            service,
            account: account.to_owned(),
            detail: format!(
                "permission denied{}; the account may not allow this, or access must be granted again",
                said(" (", ")")
            ),
        });
    }
    // 408 and 425 are the upstream's own "not now": the same request may work later.
    if status.is_client_error() && status != StatusCode::REQUEST_TIMEOUT && status.as_u16() != 425 {
        return Err(ToolError::UpstreamRejected {
            service,
            status: status.as_u16(),
            reason: said(", ", ""),
        });
    }
    Err(ToolError::Upstream {
        service,
        status: status.as_u16(),
        detail: String::new(),
    })
}

/// How long to wait out a Google limit named by `reason`, or `None` when it names none: a
/// per-minute limit as `Retry-After` says, a daily quota for an hour at least.
fn limit_wait(reason: &str, headers: &HeaderMap) -> Option<Duration> {
    match reason {
        "rateLimitExceeded" | "userRateLimitExceeded" => Some(retry_after(headers)),
        "quotaExceeded" | "dailyLimitExceeded" => {
            Some(retry_after(headers).max(Duration::from_secs(3600)))
        }
        _ => None,
    }
}

/// Google's machine reason for an error (`error.errors[0].reason`, or `error.status`), when it
/// is a plain word: never free text.
pub(crate) fn google_reason(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let reason = v
        .pointer("/error/errors/0/reason")
        .or_else(|| v.pointer("/error/status"))?
        .as_str()?;
    crate::enforce::errors::code_word(reason).map(str::to_owned)
}

/// `Retry-After` as seconds or an HTTP date; 30 s when absent or unreadable.
pub fn retry_after(headers: &HeaderMap) -> Duration {
    let Some(value) = headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
    else {
        return Duration::from_secs(30);
    };
    // A date already past (clock skew) would say "now", and the model would call straight
    // into the next 429: the default wait, as for an unreadable value.
    svc_kit::retry_after::parse(value)
        .filter(|wait| !wait.is_zero())
        .unwrap_or(Duration::from_secs(30))
}

/// The upstream's error message, if it sent a readable one, cut short: enough for a log line,
/// never a body dump.
fn short_detail(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.pointer("/error_description"))
                .or_else(|| v.pointer("/error"))
                .and_then(|m| m.as_str().map(str::to_owned))
        })
        .unwrap_or_default();
    message.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use reqwest::header::{HeaderValue, RETRY_AFTER};

    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_defaults_to_thirty() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), Duration::from_secs(30));
        h.insert(RETRY_AFTER, HeaderValue::from_static("42"));
        assert_eq!(retry_after(&h), Duration::from_secs(42));
        h.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h), Duration::from_secs(30));
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&h), Duration::from_secs(30), "a date past");
    }

    #[test]
    fn error_details_are_short_and_never_the_raw_body() {
        assert_eq!(
            short_detail(br#"{"error":{"message":"Backend Error"}}"#),
            "Backend Error"
        );
        assert_eq!(short_detail(b"<html>secret body</html>"), "");
        assert_eq!(
            short_detail(format!(r#"{{"error":"{}"}}"#, "x".repeat(500)).as_bytes()).len(),
            200
        );
    }
}
