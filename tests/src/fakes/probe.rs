//! A generic JSON/HTTP upstream for exercising the gateway core: sized bodies, statuses with
//! Retry-After, a request that never answers (and notices when its caller goes away), and a
//! side-effect endpoint that counts what it was asked to do. Every request is recorded with the
//! bearer token it carried.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Router,
    extract::{Path, Query, State},
    http::{HeaderMap, StatusCode},
    response::IntoResponse,
    routing::{get, post},
};
use tokio::sync::Notify;

#[derive(Default)]
pub struct ProbeState {
    /// (path, bearer token) of every request.
    pub requests: Mutex<Vec<(String, String)>>,
    pub sends: AtomicUsize,
    pub slow_started: Notify,
    pub slow_dropped: Notify,
    /// Tokens the fake accepts; empty means any.
    pub valid_tokens: Mutex<Vec<String>>,
}

#[derive(Clone)]
pub struct FakeProbe {
    pub url: String,
    pub state: Arc<ProbeState>,
}

impl FakeProbe {
    pub async fn start() -> Self {
        let state = Arc::new(ProbeState::default());
        let router = Router::new()
            .route("/data", get(data))
            .route("/status/{code}", get(status))
            .route("/slow", get(slow))
            .route("/send", post(send))
            .with_state(state.clone());
        let (url, _) = super::serve(router).await;
        Self { url, state }
    }

    pub fn request_count(&self) -> usize {
        self.state.requests.lock().expect("lock").len()
    }

    pub fn tokens_seen(&self) -> Vec<String> {
        self.state
            .requests
            .lock()
            .expect("lock")
            .iter()
            .map(|(_, t)| t.clone())
            .collect()
    }

    pub fn sends(&self) -> usize {
        self.state.sends.load(Ordering::SeqCst)
    }

    /// Only these bearer tokens are accepted from now on (others get 401).
    pub fn accept_only(&self, tokens: &[&str]) {
        *self.state.valid_tokens.lock().expect("lock") =
            tokens.iter().map(|t| (*t).to_owned()).collect();
    }
}

fn record(state: &ProbeState, path: &str, headers: &HeaderMap) -> Result<(), StatusCode> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
        .to_owned();
    state
        .requests
        .lock()
        .expect("lock")
        .push((path.to_owned(), token.clone()));
    let valid = state.valid_tokens.lock().expect("lock");
    if !valid.is_empty() && !valid.contains(&token) {
        return Err(StatusCode::UNAUTHORIZED);
    }
    Ok(())
}

#[derive(serde::Deserialize)]
struct DataQuery {
    size: usize,
    #[serde(default)]
    unit: String,
}

async fn data(
    State(s): State<Arc<ProbeState>>,
    headers: HeaderMap,
    Query(q): Query<DataQuery>,
) -> impl IntoResponse {
    if let Err(code) = record(&s, "/data", &headers) {
        return (
            code,
            String::from(r#"{"error":{"message":"Invalid Credentials"}}"#),
        );
    }
    let unit = if q.unit.is_empty() {
        "x"
    } else {
        q.unit.as_str()
    };
    (StatusCode::OK, unit.repeat(q.size))
}

#[derive(serde::Deserialize)]
struct StatusQuery {
    /// Google's machine reason for the error (`error.errors[0].reason`), e.g.
    /// `userRateLimitExceeded`.
    reason: Option<String>,
}

/// Answers with `code`, a Google-shaped error body (with `?reason=`, its reason) and a
/// `Retry-After` of 42 s.
async fn status(
    State(s): State<Arc<ProbeState>>,
    headers: HeaderMap,
    Path(code): Path<u16>,
    Query(q): Query<StatusQuery>,
) -> impl IntoResponse {
    let _ = record(&s, "/status", &headers);
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut error = serde_json::json!({"message": "Backend Error"});
    if let Some(reason) = q.reason {
        error["errors"] = serde_json::json!([{"reason": reason, "message": "Backend Error"}]);
    }
    (
        [("retry-after", "42")],
        (code, serde_json::json!({ "error": error }).to_string()),
    )
}

struct DropSignal(Arc<ProbeState>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        self.0.slow_dropped.notify_one();
    }
}

async fn slow(State(s): State<Arc<ProbeState>>, headers: HeaderMap) -> impl IntoResponse {
    let _ = record(&s, "/slow", &headers);
    let _guard = DropSignal(s.clone());
    s.slow_started.notify_one();
    // Never answers; when the gateway drops the request, hyper drops this future and the
    // guard reports it.
    std::future::pending::<()>().await;
    "unreachable"
}

#[derive(serde::Deserialize)]
struct SendQuery {
    #[serde(default)]
    slow: bool,
}

async fn send(
    State(s): State<Arc<ProbeState>>,
    headers: HeaderMap,
    Query(q): Query<SendQuery>,
) -> impl IntoResponse {
    if let Err(code) = record(&s, "/send", &headers) {
        return (code, String::new());
    }
    let n = s.sends.fetch_add(1, Ordering::SeqCst) + 1;
    if q.slow {
        // Sent, and the answer never comes: what a caller sees of a send whose reply is lost.
        let _guard = DropSignal(s.clone());
        s.slow_started.notify_one();
        std::future::pending::<()>().await;
    }
    (StatusCode::OK, format!("sent message #{n}"))
}
