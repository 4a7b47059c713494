//! Google Calendar's REST API as the gateway uses it: `events.list` (timeMin/timeMax/q,
//! singleEvents, orderBy=startTime), `events.insert`, `events.patch`, for one calendar per
//! bearer token.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use axum::{
    Json, Router,
    extract::{Path, Query, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
};
use serde_json::{Value, json};

#[derive(Default)]
pub struct CalendarState {
    /// Events by id, in insertion order.
    pub events: Mutex<Vec<Value>>,
}

#[derive(Clone)]
pub struct FakeCalendar {
    pub url: String,
    pub state: Arc<CalendarState>,
}

pub const TOKEN: &str = "cal-token";

impl FakeCalendar {
    pub async fn start() -> Self {
        let state = Arc::new(CalendarState::default());
        let router = Router::new()
            .route(
                "/calendar/v3/calendars/{cal}/events",
                get(list).post(insert),
            )
            .route(
                "/calendar/v3/calendars/{cal}/events/{id}",
                get(one).patch(update),
            )
            .with_state(state.clone());
        let (url, _) = super::serve(router).await;
        Self { url, state }
    }
}

fn authorised(headers: &HeaderMap) -> bool {
    headers.get("authorization").and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

/// When an event starts, as an RFC 3339 instant; an all-day event starts at its date's first
/// moment (UTC, which is what these tests use).
fn start_of(e: &Value) -> String {
    time_of(e, "start")
}

fn time_of(e: &Value, which: &str) -> String {
    if let Some(t) = e
        .pointer(&format!("/{which}/dateTime"))
        .and_then(Value::as_str)
    {
        return t.to_owned();
    }
    e.pointer(&format!("/{which}/date"))
        .and_then(Value::as_str)
        .map(|d| format!("{d}T00:00:00Z"))
        .unwrap_or_default()
}

async fn list(
    State(s): State<Arc<CalendarState>>,
    headers: HeaderMap,
    Path(cal): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if !authorised(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    if cal != "primary" {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"code": 404, "message": "Not Found"}})),
        )
            .into_response();
    }
    let ts = |v: &str| v.parse::<jiff::Timestamp>().ok();
    let (min, max) = (
        q.get("timeMin").and_then(|v| ts(v)),
        q.get("timeMax").and_then(|v| ts(v)),
    );
    let text = q.get("q").map(|t| t.to_lowercase());
    let mut items: Vec<Value> = s
        .events
        .lock()
        .expect("lock")
        .iter()
        .filter(|e| {
            // As Google filters: timeMin bounds an event's end, timeMax its start, both
            // exclusive, so an event under way at timeMin is found.
            let (start, end) = (ts(&start_of(e)), ts(&time_of(e, "end")));
            min.is_none_or(|m| end.is_some_and(|t| t > m))
                && max.is_none_or(|m| start.is_some_and(|s| s < m))
                && text.as_ref().is_none_or(|t| {
                    e["summary"]
                        .as_str()
                        .unwrap_or_default()
                        .to_lowercase()
                        .contains(t)
                })
        })
        .cloned()
        .collect();
    items.sort_by_key(start_of);
    // As Google does: at most `maxResults`, and a token for the next page when more match.
    let max: usize = q
        .get("maxResults")
        .and_then(|m| m.parse().ok())
        .unwrap_or(250);
    let mut page = json!({"kind": "calendar#events"});
    if items.len() > max {
        page["nextPageToken"] = json!(format!("after-{max}"));
        items.truncate(max);
    }
    page["items"] = json!(items);
    Json(page).into_response()
}

async fn insert(
    State(s): State<Arc<CalendarState>>,
    headers: HeaderMap,
    Json(mut event): Json<Value>,
) -> Response {
    if !authorised(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let mut events = s.events.lock().expect("lock");
    event["id"] = json!(format!("evt{}", events.len() + 1));
    event["status"] = json!("confirmed");
    events.push(event.clone());
    Json(event).into_response()
}

async fn one(
    State(s): State<Arc<CalendarState>>,
    headers: HeaderMap,
    Path((_, id)): Path<(String, String)>,
) -> Response {
    if !authorised(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    match s
        .events
        .lock()
        .expect("lock")
        .iter()
        .find(|e| e["id"] == json!(id))
    {
        Some(event) => Json(event.clone()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"code": 404, "message": "Not Found"}})),
        )
            .into_response(),
    }
}

async fn update(
    State(s): State<Arc<CalendarState>>,
    headers: HeaderMap,
    Path((_, id)): Path<(String, String)>,
    Json(changes): Json<Value>,
) -> Response {
    if !authorised(&headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let mut events = s.events.lock().expect("lock");
    let Some(event) = events.iter_mut().find(|e| e["id"] == json!(id)) else {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"code": 404, "message": "Not Found"}})),
        )
            .into_response();
    };
    if let (Some(target), Some(changes)) = (event.as_object_mut(), changes.as_object()) {
        for (k, v) in changes {
            target.insert(k.clone(), v.clone());
        }
    }
    Json(event.clone()).into_response()
}
