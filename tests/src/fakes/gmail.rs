//! Gmail's REST API (`gmail.googleapis.com`), as much as the gateway uses: so far
//! `users.labels.get` for INBOX (unread counts). The account is identified by the bearer token,
//! as with the real API's `users/me`. Tokens can be told to hang, to play a slow upstream.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
};
use serde_json::json;

#[derive(Default)]
pub struct GmailState {
    unread: Mutex<HashMap<String, u32>>,
    hanging: Mutex<HashSet<String>>,
    requests: AtomicUsize,
}

#[derive(Clone)]
pub struct FakeGmail {
    pub url: String,
    pub state: Arc<GmailState>,
}

impl FakeGmail {
    pub async fn start() -> Self {
        let state = Arc::new(GmailState::default());
        let router = Router::new()
            .route("/gmail/v1/users/me/labels/{label}", get(label))
            .with_state(state.clone());
        let (url, _) = super::serve(router).await;
        Self { url, state }
    }

    /// The mailbox behind `token` has `n` unread messages in INBOX.
    pub fn set_unread(&self, token: &str, n: u32) {
        self.state
            .unread
            .lock()
            .expect("lock")
            .insert(token.to_owned(), n);
    }

    /// Requests with `token` never get an answer.
    pub fn hang(&self, token: &str) {
        self.state
            .hanging
            .lock()
            .expect("lock")
            .insert(token.to_owned());
    }

    /// Requests answered (hanging ones excluded).
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }
}

fn bearer(headers: &HeaderMap) -> String {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
        .to_owned()
}

fn unauthenticated() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(json!({"error": {"code": 401, "message": "Request had invalid authentication credentials.", "status": "UNAUTHENTICATED"}})),
    )
        .into_response()
}

async fn label(
    State(s): State<Arc<GmailState>>,
    headers: HeaderMap,
    Path(label): Path<String>,
) -> Response {
    let token = bearer(&headers);
    if s.hanging.lock().expect("lock").contains(&token) {
        std::future::pending::<()>().await;
    }
    let Some(unread) = s.unread.lock().expect("lock").get(&token).copied() else {
        return unauthenticated();
    };
    s.requests.fetch_add(1, Ordering::SeqCst);
    if label != "INBOX" {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"code": 404, "message": "Requested entity was not found."}})),
        )
            .into_response();
    }
    Json(json!({
        "id": "INBOX", "name": "INBOX", "type": "system",
        "messageListVisibility": "hide", "labelListVisibility": "labelShow",
        "messagesTotal": unread + 250, "messagesUnread": unread,
        "threadsTotal": unread + 200, "threadsUnread": unread
    }))
    .into_response()
}
