//! One tool call, start to finish, with every protection in a fixed order: registry lookup →
//! argument validation (G-3) → idempotency (P-4) → the tool under its deadline and the caller's
//! cancellation → error-to-string (G-4) → result cap (G-5) → audit (G-9: the records of a call
//! that writes anything — a side effect, or Steward's own tasks, memories, reminders — and of
//! any tool not declared read-only are written before the call returns; a read-only call's
//! records go to the batching writer once the call is over, outside its deadline, see
//! `crate::audit`). Whatever happens, the caller gets a `CallOutcome` with a sentence in it.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::{
    context::{CallContext, Services, millis},
    domain::ErrorKind,
    domain::{CallOutcome, CallRequest, UserId},
    enforce::{ToolError, caps::cap_text},
    registry::{MAX_PREVIEW_CHARS, Preview, RegisteredTool, Registry, ToolOutput},
    store::{
        AuditEntry, AuditRecord, IdempotencyClaim, IdempotencyStore, KeyState, StoreError,
        StoredResult,
    },
};

/// How much longer than the call's deadlines an idempotency key is held: for its audit
/// records and the store's round trips. Outside the deadlines a side effect spends at most
/// the intent record's budget ([`crate::audit::WRITE_NOW_BUDGET`], 8 s) before the call, as
/// much writing its upstream records after it, and [`STORE_BUDGET`] (15 s) storing its
/// result: 31 s, leaving 9 s for the claim's own round trips and scheduling. Were the hold to
/// lapse first, a retry could claim the key and act again (unless a write had marked it).
pub(crate) const CLAIM_MARGIN: Duration = Duration::from_secs(40);

/// The longest storing a side effect's result may take, across its tries (see
/// [`CLAIM_MARGIN`]).
pub(crate) const STORE_BUDGET: Duration = Duration::from_secs(15);

/// What LookupCall finds of a side-effect call by its idempotency key.
#[derive(Debug)]
pub enum Recorded {
    /// No call holds the key or completed with it: the call never ran.
    None,
    /// A call holds it and may still answer: ask again once its hold is over.
    Running,
    /// Its call ended without recording what it did: it may have acted, and that will not
    /// be known.
    MayHaveActed,
    /// (tool, outcome) of the completed call.
    Done(String, CallOutcome),
    /// A stored result this build cannot read (one written by a newer build, say).
    Unreadable(String),
    /// No record, for a call made longer ago than keys are kept: it may have completed and
    /// its record been swept.
    Swept,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub max_result_chars: usize,
    pub default_timeout: Duration,
    pub max_timeout: Duration,
    /// IDEMPOTENCY_RETENTION: how long a key is kept after it settled. A lookup of a key
    /// that is gone, for a call older than this, cannot say the call never ran.
    pub idempotency_retention: Duration,
}

#[derive(Clone)]
pub struct Engine {
    pub registry: Arc<Registry>,
    pub services: Arc<Services>,
    pub idempotency: Arc<dyn IdempotencyStore>,
    pub config: EngineConfig,
    pub in_flight: Arc<InFlight>,
}

/// How many calls are running, so that shutdown can say how many audit records a drain cut
/// short (a call's record is written when it ends).
#[derive(Debug, Default)]
pub struct InFlight(std::sync::atomic::AtomicUsize);

impl InFlight {
    pub fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn start(&self) -> Running<'_> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Running(self)
    }
}

/// One call counted in [`InFlight`] while it lives.
struct Running<'a>(&'a InFlight);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Engine {
    pub async fn execute(
        &self,
        user: &UserId,
        request: CallRequest,
        cancel: CancellationToken,
    ) -> CallOutcome {
        // Resolved once: an MCP server may re-list its tools while the call runs, and the
        // outcome and audit must describe the tool that ran.
        let tool = self.registry.get(&request.tool);
        let Some(service) = tool
            .as_ref()
            .filter(|t| t.spec.side_effect)
            .map(|t| t.service)
        else {
            return self.execute_resolved(tool, user, request, cancel).await;
        };
        // A side effect, once started, runs to its end in a task of its own, and a caller that
        // goes away (a unary caller's deadline, a dropped connection) cancels it instead of
        // dropping it. Dropped mid-flight, a call that had reached upstream would free its
        // idempotency key for a retry to act again, and would leave no audit record.
        let on_drop = cancel.clone().drop_guard();
        let (engine, owner) = (self.clone(), user.clone());
        let (call_id, name) = (request.call_id.clone(), request.tool.clone());
        let ran = tokio::spawn(tracing::Instrument::in_current_span(async move {
            engine.execute_resolved(tool, &owner, request, cancel).await
        }))
        .await;
        on_drop.disarm();
        ran.unwrap_or_else(|_| {
            tracing::error!(tool = %name, call_id = %call_id, "side-effect call panicked");
            self.outcome(
                call_id,
                name,
                false,
                Err(ToolError::MayHaveActed {
                    service,
                    what: "The call failed inside the gateway".into(),
                    kind: ErrorKind::Internal,
                }),
                0,
                None,
            )
        })
    }

    async fn execute_resolved(
        &self,
        tool: Option<Arc<RegisteredTool>>,
        user: &UserId,
        request: CallRequest,
        cancel: CancellationToken,
    ) -> CallOutcome {
        let _running = self.in_flight.start();
        let started = Instant::now();
        let call_id = request.call_id.clone();
        let run_id = request.run_id.clone();
        let span = tracing::info_span!(
            "tool_call",
            otel.name = %format!("tool_call {}", request.tool),
            tool = %request.tool,
            call_id = %call_id,
            run_id = run_id.as_deref().unwrap_or_default(),
            trace_id = tracing::field::Empty,
        );
        svc_kit::telemetry::record_trace_id(&span);
        let (tool_name, outcome, ctx) =
            tracing::Instrument::instrument(self.run(tool.clone(), user, request, cancel), span)
                .await;
        let upstream_calls = ctx.as_ref().map_or(0, |c| c.upstream_calls());
        let account = ctx.as_ref().and_then(|c| c.account());
        let mut outcome = match outcome {
            Finished::Replayed(mut stored) => {
                stored.call_id = call_id.clone();
                stored.replayed = true;
                stored.latency = started.elapsed();
                stored
            }
            Finished::Ran(result) => self.outcome(
                call_id.clone(),
                tool_name.clone(),
                tool.as_ref().is_some_and(|t| t.spec.reads_external_content),
                result,
                upstream_calls,
                account,
            ),
        };
        outcome.latency = started.elapsed();

        let status = outcome.error_kind.map_or("ok", |k| k.as_str());
        crate::metrics::tool_call(&outcome.tool, status, outcome.latency);
        tracing::info!(
            user = %user, tool = %outcome.tool, call_id = %call_id, status, upstream_calls = outcome.upstream_calls,
            latency_ms = millis(outcome.latency), truncated = outcome.truncated, replayed = outcome.replayed,
            "tool call"
        );
        let record = AuditRecord {
            user: user.to_string(),
            kind: "tool_call".into(),
            tool: outcome.tool.clone(),
            integration: tool.as_ref().map(|t| t.spec.integration.key().to_owned()),
            account: outcome.account.clone(),
            call_id,
            run_id,
            status: status.to_owned(),
            latency_ms: millis(outcome.latency),
            bytes: u32::try_from(outcome.text.len()).unwrap_or(u32::MAX),
            upstream_calls: outcome.upstream_calls,
        };
        if tool.as_ref().is_some_and(|t| t.read_only) {
            // A read-only call: its upstream records (kept in its context while it ran) and
            // this one go to the batching writer, off the call's path and outside its deadline;
            // never dropped, waiting here for space when the queue is full.
            let mut entries = ctx
                .as_ref()
                .map(CallContext::take_deferred)
                .unwrap_or_default();
            entries.push(AuditEntry::now(record));
            self.services.audit.enqueue(entries).await;
        } else {
            // Anything that may write (a side effect, Steward's own data, an unknown or
            // undeclared tool): written before the result is returned (tried again, or
            // logged in full, by `record_now`).
            let _ = self.services.audit.record_now(record).await;
        }
        outcome
    }

    async fn run(
        &self,
        tool: Option<Arc<RegisteredTool>>,
        user: &UserId,
        mut request: CallRequest,
        cancel: CancellationToken,
    ) -> (String, Finished, Option<CallContext>) {
        request.args = crate::registry::integral_numbers(request.args);
        let Some(tool) = tool else {
            let name = request.tool.clone();
            return (
                name.clone(),
                Finished::Ran(Err(ToolError::UnknownTool(name))),
                None,
            );
        };
        let name = tool.spec.name.clone();
        let fail = |e: ToolError| (name.clone(), Finished::Ran(Err(e)), None);
        if let Err(e) = tool.validate(&request.args) {
            return fail(e);
        }

        let claim = if tool.spec.side_effect {
            let Some(key) = request.idempotency_key.as_deref() else {
                return fail(ToolError::InvalidArguments {
                    tool: name.clone(),
                    detail: "side-effect tools need an idempotency_key so a retry cannot act twice"
                        .into(),
                });
            };
            // Held for as long as this call may take: its preview check (each under the
            // call's deadline) and the call, plus the audit records around them.
            let deadlines = if request.expected_binding.is_some() {
                2
            } else {
                1
            };
            let hold = self.timeout(&request) * deadlines + CLAIM_MARGIN;
            let claim = match self.idempotency.claim(user, key, hold).await {
                Ok(claim) => claim,
                Err(StoreError::InProgress(why)) => {
                    return fail(ToolError::KeyInUse(why));
                }
                Err(StoreError::MayHaveActed(why)) => {
                    return fail(ToolError::MayHaveActed {
                        service: tool.service,
                        what: capitalised(&why),
                        kind: ErrorKind::Internal,
                    });
                }
                Err(e) => {
                    return fail(ToolError::Internal(format!(
                        "idempotency store unavailable: {e}"
                    )));
                }
            };
            let args_sha256 = sha256_hex(&request.args);
            if let Some(existing) = claim.existing() {
                if existing.tool != name || existing.args_sha256 != args_sha256 {
                    return fail(ToolError::InvalidArguments {
                        tool: name.clone(),
                        detail: format!(
                            "idempotency_key {key:?} was already used for a different call"
                        ),
                    });
                }
                return match serde_json::from_value::<CallOutcome>(existing.outcome.clone()) {
                    Ok(stored) => (name, Finished::Replayed(stored), None),
                    Err(e) => fail(ToolError::Internal(format!(
                        "stored result unreadable: {e}"
                    ))),
                };
            }
            Some((claim, args_sha256))
        } else {
            None
        };

        let mut ctx = self.context(user, &request, &name);
        // The one place a call learns it is a side effect: its writes are counted, and a write
        // accepted with an unreadable answer is done (see `CallContext::side_effect`).
        ctx.side_effect = tool.spec.side_effect;
        ctx.acting = claim.as_ref().and_then(|(claim, _)| claim.acting());
        // The key's hold borrows the context, so it ends inside this block.
        let result = {
            let held = claim.map(|(claim, args_sha256)| Held {
                claim: Some(claim),
                args_sha256,
                ctx: &ctx,
            });
            let timeout = self.timeout(&request);
            let service = tool.service;
            if let Some(expected) = &request.expected_binding {
                // Resolved in its own context: its reads are not the effect, so a refusal leaves
                // the idempotency key free.
                let check = self.context(user, &request, &name);
                let now =
                    match tokio::time::timeout(timeout, tool.tool.preview(&check, &request.args))
                        .await
                    {
                        Ok(Ok(p)) => p,
                        Ok(Err(e)) => return fail(e),
                        Err(_) => {
                            return fail(ToolError::UpstreamTimeout {
                                service,
                                after: timeout,
                            });
                        }
                    };
                if &now.binding != expected {
                    return fail(ToolError::ChangedSinceApproval(format!(
                        "what {name} would do changed (it would now reach {})",
                        if now.recipients.is_empty() {
                            "something else".to_owned()
                        } else {
                            now.recipients.join(", ")
                        }
                    )));
                }
            }
            if tool.spec.side_effect {
                // P-5: no side effect without its audit record, written before the effect.
                let intent = AuditRecord {
                    user: user.to_string(),
                    kind: "side_effect_intent".into(),
                    tool: name.clone(),
                    integration: Some(tool.spec.integration.key().to_owned()),
                    account: None,
                    call_id: request.call_id.clone(),
                    run_id: request.run_id.clone(),
                    status: "started".into(),
                    latency_ms: 0,
                    bytes: 0,
                    upstream_calls: 0,
                };
                if let Err(e) = self.services.audit.record_intent(intent).await {
                    tracing::error!(error = %e, tool = %name, "side effect refused: its audit record could not be written");
                    return fail(ToolError::Internal(format!(
                        "not executed, because its audit record could not be written: {e}"
                    )));
                }
            }
            // Dropping the tool future on cancel or deadline drops its in-flight HTTP request too.
            let result = tokio::select! {
                r = tokio::time::timeout(timeout, tool.tool.call(&ctx, request.args)) => {
                    r.unwrap_or(Err(ToolError::UpstreamTimeout { service, after: timeout }))
                }
                () = cancel.cancelled() => Err(ToolError::Cancelled),
            };

            let result = match result {
                // The upstream answered the write 2xx and the call ran out of time after:
                // done, and not "did not answer".
                Err(ToolError::UpstreamTimeout { service, after })
                    if tool.spec.side_effect && ctx.write_accepted() =>
                {
                    Err(ToolError::AcceptedUnfinished { service, after })
                }
                // Failed once a write had left, with no definite refusal: it may have acted,
                // and must say so rather than invite a retry that acts twice.
                Err(e) if tool.spec.side_effect && ctx.may_have_written() => {
                    Err(may_have_acted(service, e))
                }
                r => r,
            };
            if !tool.read_only {
                // Outside the deadline, so that a slow audit store can neither lose a record
                // nor turn a done write into a timeout; before the outcome is stored, inside
                // the key's hold (see `CLAIM_MARGIN`). A read-only call's go to the batching
                // writer in `execute`.
                self.services
                    .audit
                    .record_kept_now(ctx.take_deferred())
                    .await;
            }
            if let Some(mut held) = held {
                // A write may have reached upstream, or the call succeeded: the outcome is
                // stored, and a retry replays it. Otherwise no write left, or each was refused
                // outright (a 4xx, a 429 for its rate): nothing was done, so the key is freed
                // for a retry.
                if result.is_ok() || ctx.may_have_written() {
                    let outcome = self.outcome(
                        request.call_id,
                        name.clone(),
                        tool.spec.reads_external_content,
                        result.clone(),
                        ctx.upstream_calls(),
                        ctx.account(),
                    );
                    held.store(&name, outcome).await;
                } else {
                    held.free();
                }
            }
            result
        };
        (name, Finished::Ran(result), Some(ctx))
    }

    fn context(&self, user: &UserId, request: &CallRequest, tool: &str) -> CallContext {
        let mut ctx = CallContext::new(
            self.services.clone(),
            user.clone(),
            request.channel,
            request.call_id.clone(),
            request.run_id.clone(),
            tool.to_owned(),
        );
        ctx.read_external_from = request.read_external_from.clone();
        ctx.time_zone = request.time_zone.clone();
        // Written after the call's deadline, never inside it (see `run` and `execute`).
        ctx.audit_later = true;
        ctx
    }

    fn timeout(&self, request: &CallRequest) -> Duration {
        request
            .timeout
            .filter(|t| !t.is_zero())
            .unwrap_or(self.config.default_timeout)
            .min(self.config.max_timeout)
    }

    /// What a call would do (PreviewCall), resolved as its execution would resolve it; nothing
    /// is sent or changed. Validated and rate-limited like a call; audited as a preview.
    pub async fn preview(
        &self,
        user: &UserId,
        mut request: CallRequest,
    ) -> Result<Preview, ToolError> {
        // As `run` reads them, so the preview shows what the call will do.
        request.args = crate::registry::integral_numbers(request.args);
        let started = Instant::now();
        let tool = self
            .registry
            .get(&request.tool)
            .ok_or_else(|| ToolError::UnknownTool(request.tool.clone()))?;
        tool.validate(&request.args)?;
        let name = tool.spec.name.clone();
        let ctx = self.context(user, &request, &name);
        let timeout = self.timeout(&request);
        let result =
            match tokio::time::timeout(timeout, tool.tool.preview(&ctx, &request.args)).await {
                Ok(r) => r,
                Err(_) => Err(ToolError::UpstreamTimeout {
                    service: tool.service,
                    after: timeout,
                }),
            };
        let record = AuditRecord {
            user: user.to_string(),
            kind: "preview".into(),
            tool: name,
            integration: Some(tool.spec.integration.key().to_owned()),
            account: ctx.account(),
            call_id: request.call_id,
            run_id: request.run_id,
            status: result
                .as_ref()
                .map_or_else(|e| e.kind().as_str(), |_| "ok")
                .to_owned(),
            latency_ms: millis(started.elapsed()),
            bytes: 0,
            upstream_calls: ctx.upstream_calls(),
        };
        let _ = self.services.audit.record_now(record).await;
        result.map(|mut p| {
            p.text = crate::registry::clip(&p.text, MAX_PREVIEW_CHARS);
            p
        })
    }

    /// What the side-effect call with this key came to, without running anything (LookupCall).
    /// `made_at`: when the call was made, if the caller knows.
    pub async fn recorded(
        &self,
        user: &UserId,
        key: &str,
        made_at: Option<SystemTime>,
    ) -> Result<Recorded, StoreError> {
        let stored = match self.idempotency.lookup(user, key).await? {
            // A key gone for a call older than the retention may have been swept after it
            // completed: that it never ran cannot be said. (A margin for clocks apart.)
            KeyState::Free
                if made_at.is_some_and(|t| {
                    t + self.config.idempotency_retention
                        < SystemTime::now() + Duration::from_secs(3600)
                }) =>
            {
                return Ok(Recorded::Swept);
            }
            KeyState::Free => return Ok(Recorded::None),
            KeyState::Running => return Ok(Recorded::Running),
            KeyState::Held => return Ok(Recorded::MayHaveActed),
            KeyState::Done(stored) => stored,
        };
        Ok(
            match serde_json::from_value::<CallOutcome>(stored.outcome) {
                Ok(outcome) => Recorded::Done(stored.tool, outcome),
                Err(e) => Recorded::Unreadable(e.to_string()),
            },
        )
    }

    fn outcome(
        &self,
        call_id: String,
        tool: String,
        reads_external: bool,
        result: Result<ToolOutput, ToolError>,
        upstream_calls: u32,
        account: Option<String>,
    ) -> CallOutcome {
        let (text, display, error_kind, retry_after_secs, external) = match result {
            Ok(out) => {
                let text = if out.text.trim().is_empty() {
                    format!("{tool} completed and returned no content.")
                } else {
                    out.text
                };
                (text, out.display, None, 0, reads_external || out.external)
            }
            // Failures are Steward's own classified sentences, except where one quotes another
            // party (a remote tool's own error text), which the agent must fence as data.
            Err(e) => (
                e.to_string(),
                None,
                Some(e.kind()),
                e.retry_after_secs(),
                e.carries_external_words(),
            ),
        };
        let capped = cap_text(text, self.config.max_result_chars);
        CallOutcome {
            call_id,
            tool,
            error_kind,
            text: capped.text,
            truncated: capped.truncated,
            original_chars: capped.original_chars,
            retry_after_secs,
            display,
            upstream_calls,
            account,
            latency: Duration::ZERO,
            replayed: false,
            external,
        }
    }
}

enum Finished {
    Ran(Result<ToolOutput, ToolError>),
    Replayed(CallOutcome),
}

/// How often storing a side effect's result is tried before its key is left to lapse.
const STORE_ATTEMPTS: u32 = 4;

/// A side effect's hold on its idempotency key while it runs. It ends by storing the call's
/// outcome or by freeing the key; dropped without either (the call panicked), it frees the key
/// only if no write left for upstream, and otherwise leaves it held until its hold lapses, so
/// that no retry acts again at once.
struct Held<'a> {
    claim: Option<Box<dyn IdempotencyClaim>>,
    args_sha256: String,
    ctx: &'a CallContext,
}

impl Held<'_> {
    /// Stores `outcome` under the key, trying again while the database is unavailable.
    async fn store(&mut self, tool: &str, outcome: CallOutcome) {
        let Some(mut claim) = self.claim.take() else {
            return;
        };
        let stored = StoredResult {
            tool: tool.to_owned(),
            args_sha256: std::mem::take(&mut self.args_sha256),
            outcome: serde_json::to_value(&outcome).unwrap_or(Value::Null),
        };
        let tries = async {
            let mut pause = Duration::from_millis(100);
            for attempt in 1..=STORE_ATTEMPTS {
                match claim.complete(&stored).await {
                    Ok(()) => return true,
                    Err(StoreError::Unavailable(e)) if attempt < STORE_ATTEMPTS => {
                        tracing::warn!(error = %e, tool, attempt, "could not store a side effect's result; trying again");
                        tokio::time::sleep(pause).await;
                        pause *= 4;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, tool, "could not store a side effect's result; its key stays held until its hold lapses");
                        return false;
                    }
                }
            }
            false
        };
        // Within the key's hold (see `CLAIM_MARGIN`): past it a retry could act again.
        match tokio::time::timeout(STORE_BUDGET, tries).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(_) => tracing::error!(
                tool,
                "could not store a side effect's result within {STORE_BUDGET:?}; its key stays held until its hold lapses"
            ),
        }
        claim.abandon();
    }

    /// Nothing was done: the key is free for a retry.
    fn free(&mut self) {
        self.claim = None;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(claim) = self.claim.take()
            && self.ctx.may_have_written()
        {
            claim.abandon();
        }
    }
}

/// A side effect's failure once a write had left: a definite answer (the upstream refused it,
/// or said why it failed) stays as it is; anything else (cut off, a broken connection, a 5xx,
/// an answer that could not be read, a failure inside the gateway) may have come after the
/// upstream acted, so it is reported as such, keeping its kind.
fn may_have_acted(service: &'static str, e: ToolError) -> ToolError {
    let what = match &e {
        ToolError::UpstreamTimeout { after, .. } => format!(
            "{service} did not answer within {} seconds",
            after.as_secs().max(1)
        ),
        ToolError::Cancelled => "The call was cancelled".to_owned(),
        ToolError::UpstreamUnavailable { detail, .. } => {
            format!("The connection to {service} failed ({detail})")
        }
        ToolError::Upstream { status, .. } => format!("{service} answered HTTP {status}"),
        ToolError::UpstreamGarbage { detail, .. } => {
            format!("{service}'s answer could not be read ({detail})")
        }
        ToolError::Internal(_) => "The call failed inside the gateway".to_owned(),
        _ => return e,
    };
    ToolError::MayHaveActed {
        service,
        what,
        kind: e.kind(),
    }
}

/// `s` with its first letter upper-case: a store's clause as the start of a sentence.
fn capitalised(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// SHA-256 of the arguments' canonical JSON (serde_json sorts object keys), binding a stored
/// result to exactly these arguments.
pub fn sha256_hex(args: &Value) -> String {
    let canonical = serde_json::to_string(args).unwrap_or_default();
    let digest = Sha256::digest(canonical.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}
