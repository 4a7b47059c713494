//! Slack's Web API as the gateway uses it: `conversations.list` (cursor pagination) and
//! `conversations.history`, with Slack's habits: HTTP 200 with `{"ok": false, "error": ...}`
//! for most failures, and 429 with `Retry-After` when rate limited.

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicUsize, Ordering},
};

use axum::{
    Json, Router,
    extract::{Query, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
};
use serde_json::{Value, json};

#[derive(Default)]
pub struct SlackState {
    pub rate_limited: AtomicBool,
    pub calls: AtomicUsize,
    /// Messages channel C00000001 answers with instead of its two standard ones.
    pub history: std::sync::Mutex<Option<Vec<serde_json::Value>>>,
}

#[derive(Clone)]
pub struct FakeSlack {
    pub url: String,
    pub state: Arc<SlackState>,
}

/// The bot token the fake accepts.
pub const TOKEN: &str = "xoxb-test-token";
/// Channels in the fake workspace: enough for two pages of 200.
pub const CHANNELS: usize = 250;

impl FakeSlack {
    pub async fn start() -> Self {
        let state = Arc::new(SlackState::default());
        let router = Router::new()
            .route("/api/conversations.list", get(list))
            .route("/api/conversations.history", get(history))
            .with_state(state.clone());
        let (url, _) = super::serve(router).await;
        Self { url, state }
    }
}

fn check(s: &SlackState, headers: &HeaderMap) -> Option<Response> {
    s.calls.fetch_add(1, Ordering::SeqCst);
    if s.rate_limited.load(Ordering::SeqCst) {
        return Some(
            (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "30")],
                Json(json!({"ok": false, "error": "ratelimited"})),
            )
                .into_response(),
        );
    }
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if token != format!("Bearer {TOKEN}") {
        return Some(Json(json!({"ok": false, "error": "invalid_auth"})).into_response());
    }
    None
}

async fn list(
    State(s): State<Arc<SlackState>>,
    headers: HeaderMap,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if let Some(r) = check(&s, &headers) {
        return r;
    }
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(100)
        .min(1000);
    let start: usize = q
        .get("cursor")
        .and_then(|c| c.strip_prefix("page:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let end = (start + limit).min(CHANNELS);
    let channels: Vec<_> = (start..end)
        .map(|i| {
            json!({"id": format!("C{i:08}"), "name": format!("channel-{i}"), "is_channel": true,
                        "is_private": i % 10 == 0, "is_archived": false, "num_members": i % 50})
        })
        .collect();
    let next = if end < CHANNELS {
        format!("page:{end}")
    } else {
        String::new()
    };
    Json(json!({"ok": true, "channels": channels, "response_metadata": {"next_cursor": next}}))
        .into_response()
}

async fn history(
    State(s): State<Arc<SlackState>>,
    headers: HeaderMap,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if let Some(r) = check(&s, &headers) {
        return r;
    }
    if q.get("channel").map(String::as_str) != Some("C00000001") {
        return Json(json!({"ok": false, "error": "channel_not_found"})).into_response();
    }
    let messages = s.history.lock().expect("lock").clone().unwrap_or_else(|| {
        vec![
            json!({"type": "message", "user": "U012AB3CD", "text": "Deploy is done", "ts": "1771920000.000200"}),
            json!({"type": "message", "user": "U045EF6GH", "text": "Standup moved to 10:00", "ts": "1771916400.000100"}),
        ]
    });
    // As Slack does: at most `limit`, newest first, and `has_more` when older ones are left.
    let limit: usize = q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(100);
    let has_more = messages.len() > limit;
    let messages: Vec<Value> = messages.into_iter().take(limit).collect();
    Json(json!({"ok": true, "has_more": has_more, "messages": messages})).into_response()
}
