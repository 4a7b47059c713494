//! Gmail's REST API (`gmail.googleapis.com`) as the gateway uses it: `users.labels.get`,
//! `users.messages.list`, `users.messages.get` (metadata and full), `users.threads.get`,
//! `users.messages.send`, `users.drafts.create`, and the batch endpoint (`POST
//! /batch/gmail/v1`, multipart/mixed). The mailbox is chosen by the bearer token, as `users/me`
//! is by the real API. Every request is recorded with the `format` it asked for, so tests can
//! prove search never fetches bodies.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::{
    Json, Router,
    body::Bytes,
    extract::{Path, Query, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use base64::Engine;
use serde_json::{Value, json};

/// One message in a fake mailbox.
#[derive(Clone, Debug)]
pub struct FakeMessage {
    pub id: String,
    pub thread_id: String,
    pub from: String,
    pub to: String,
    pub subject: String,
    pub message_id: String,
    pub internal_date_ms: u64,
    pub snippet: String,
    /// (mime type, charset, raw bytes) of each body part; a filename makes it an attachment.
    pub parts: Vec<(String, String, Vec<u8>, Option<String>)>,
    /// The Reply-To header, when the sender set one.
    pub reply_to: Option<String>,
}

impl FakeMessage {
    /// A 12 KB HTML newsletter: the kind of body that blew the original prompt up.
    pub fn html_newsletter(id: &str, n: usize) -> Self {
        let para = format!(
            "<p style=\"font-family:Arial;color:#333\">BODY-ONLY-TEXT paragraph {n}: quarterly update with \
             tables, links and tracking pixels <a href=\"https://example.com/track?id={id}\">read more</a></p>"
        );
        let mut html =
            String::from("<html><head><style>body{margin:0}</style></head><body><table>");
        while html.len() < 12 * 1024 {
            html.push_str(&para);
        }
        html.push_str("</table></body></html>");
        Self {
            id: id.into(),
            thread_id: format!("t{id}"),
            from: "Acme News <news@acme.example>".into(),
            to: "me@example.com".into(),
            subject: format!("Acme weekly #{n}"),
            message_id: format!("<{id}@acme.example>"),
            internal_date_ms: 1_771_900_000_000 + n as u64 * 60_000,
            snippet: format!("Your weekly digest #{n} &#39;highlights&#39; inside"),
            parts: vec![("text/html".into(), "utf-8".into(), html.into_bytes(), None)],
            reply_to: None,
        }
    }

    fn header_list(&self) -> Vec<(String, String)> {
        let mut headers = vec![
            ("From".into(), self.from.clone()),
            ("To".into(), self.to.clone()),
            ("Subject".into(), self.subject.clone()),
            ("Date".into(), "Tue, 24 Feb 2026 10:00:00 +0000".into()),
            ("Message-ID".into(), self.message_id.clone()),
        ];
        if let Some(reply_to) = &self.reply_to {
            headers.push(("Reply-To".into(), reply_to.clone()));
        }
        headers
    }

    fn metadata_json(&self, wanted: &[String]) -> Value {
        let headers: Vec<Value> = self
            .header_list()
            .into_iter()
            .filter(|(n, _)| wanted.iter().any(|w| w.eq_ignore_ascii_case(n)))
            .map(|(name, value)| json!({"name": name, "value": value}))
            .collect();
        json!({"id": self.id, "threadId": self.thread_id, "labelIds": ["INBOX", "UNREAD"], "snippet": self.snippet,
               "sizeEstimate": 13000, "internalDate": self.internal_date_ms.to_string(),
               "payload": {"mimeType": "multipart/alternative", "headers": headers}})
    }

    fn full_json(&self) -> Value {
        let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE.encode(b);
        let parts: Vec<Value> = self
            .parts
            .iter()
            .enumerate()
            .map(|(i, (mime, charset, bytes, filename))| {
                json!({"partId": i.to_string(), "mimeType": mime, "filename": filename.clone().unwrap_or_default(),
                       "headers": [{"name": "Content-Type", "value": format!("{mime}; charset=\"{charset}\"")}],
                       "body": if filename.is_some() { json!({"size": bytes.len(), "attachmentId": format!("att{i}")}) }
                               else { json!({"size": bytes.len(), "data": b64(bytes)}) }})
            })
            .collect();
        let headers: Vec<Value> = self
            .header_list()
            .into_iter()
            .map(|(name, value)| json!({"name": name, "value": value}))
            .collect();
        json!({"id": self.id, "threadId": self.thread_id, "labelIds": ["INBOX"], "snippet": self.snippet,
               "internalDate": self.internal_date_ms.to_string(),
               "payload": {"mimeType": "multipart/mixed", "headers": headers, "body": {"size": 0}, "parts": parts}})
    }
}

/// What the fake was asked, for assertions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// The `format` parameter, for message gets (batched or not).
    pub format: Option<String>,
}

#[derive(Default)]
pub struct GmailState {
    mailboxes: Mutex<HashMap<String, Vec<FakeMessage>>>,
    unread: Mutex<HashMap<String, u32>>,
    hanging: Mutex<HashSet<String>>,
    failing: Mutex<HashMap<String, (u16, String)>>,
    requests: AtomicUsize,
    pub recorded: Mutex<Vec<Recorded>>,
    /// Decoded RFC 5322 messages sent or drafted, with the threadId given.
    pub sent: Mutex<Vec<(String, Option<String>)>>,
    /// How long each send takes to be answered (a slow upstream).
    send_delay: Mutex<Option<std::time::Duration>>,
    /// While set, each send waits here after it arrived and before it is done.
    send_gate: Mutex<Option<Arc<SendGate>>>,
}

/// Holds sends at the moment they reach the fake: the test sees one arrive, looks at the
/// world as it is then, and lets it through.
#[derive(Default)]
pub struct SendGate {
    arrived: tokio::sync::Notify,
    released: tokio::sync::Notify,
}

impl SendGate {
    /// Resolves once a send has reached the fake (and is being held).
    pub async fn arrived(&self) {
        self.arrived.notified().await;
    }

    /// Lets the held send (or the next one to arrive) through.
    pub fn release(&self) {
        self.released.notify_one();
    }
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
            .route("/gmail/v1/users/me/messages", get(list))
            .route("/gmail/v1/users/me/messages/{id}", get(message))
            .route("/gmail/v1/users/me/threads/{id}", get(thread))
            .route("/gmail/v1/users/me/messages/send", post(send))
            .route("/gmail/v1/users/me/drafts", post(draft))
            .route("/batch/gmail/v1", post(batch))
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

    /// From now on, every send is held at arrival until the gate releases it.
    pub fn hold_sends(&self) -> Arc<SendGate> {
        let gate = Arc::new(SendGate::default());
        *self.state.send_gate.lock().expect("lock") = Some(gate.clone());
        gate
    }

    /// Every send is answered only after `delay`.
    pub fn delay_sends(&self, delay: std::time::Duration) {
        *self.state.send_delay.lock().expect("lock") = Some(delay);
    }

    /// Requests with `token` get this status and body.
    pub fn fail(&self, token: &str, status: u16, body: &str) {
        self.state
            .failing
            .lock()
            .expect("lock")
            .insert(token.to_owned(), (status, body.to_owned()));
    }

    /// Adds messages to a mailbox; one with the id of a message already there replaces it (a
    /// test can change a message between two calls).
    pub fn add_messages(&self, token: &str, messages: Vec<FakeMessage>) {
        let mut boxes = self.state.mailboxes.lock().expect("lock");
        let mailbox = boxes.entry(token.to_owned()).or_default();
        for m in messages {
            match mailbox.iter_mut().find(|old| old.id == m.id) {
                Some(old) => *old = m,
                None => mailbox.push(m),
            }
        }
    }

    /// Label requests answered (hanging ones excluded).
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    pub fn recorded(&self) -> Vec<Recorded> {
        self.state.recorded.lock().expect("lock").clone()
    }

    pub fn sent(&self) -> Vec<(String, Option<String>)> {
        self.state.sent.lock().expect("lock").clone()
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

fn error(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"code": status.as_u16(), "message": message}})),
    )
        .into_response()
}

/// The mailbox for the request's token, or the response to give instead.
async fn mailbox(s: &GmailState, headers: &HeaderMap) -> Result<Vec<FakeMessage>, Response> {
    let token = bearer(headers);
    if s.hanging.lock().expect("lock").contains(&token) {
        std::future::pending::<()>().await;
    }
    if let Some((status, body)) = s.failing.lock().expect("lock").get(&token).cloned() {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Err((status, [("content-type", "application/json")], body).into_response());
    }
    let known = s.unread.lock().expect("lock").contains_key(&token)
        || s.mailboxes.lock().expect("lock").contains_key(&token);
    if !known {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "Request had invalid authentication credentials.",
        ));
    }
    Ok(s.mailboxes
        .lock()
        .expect("lock")
        .get(&token)
        .cloned()
        .unwrap_or_default())
}

fn record(s: &GmailState, method: &str, path: &str, format: Option<String>) {
    s.recorded.lock().expect("lock").push(Recorded {
        method: method.into(),
        path: path.into(),
        format,
    });
}

async fn label(
    State(s): State<Arc<GmailState>>,
    headers: HeaderMap,
    Path(label): Path<String>,
) -> Response {
    if let Err(r) = mailbox(&s, &headers).await {
        return r;
    }
    let unread = s
        .unread
        .lock()
        .expect("lock")
        .get(&bearer(&headers))
        .copied()
        .unwrap_or(0);
    s.requests.fetch_add(1, Ordering::SeqCst);
    record(&s, "GET", &format!("/labels/{label}"), None);
    if label != "INBOX" {
        return error(StatusCode::NOT_FOUND, "Requested entity was not found.");
    }
    Json(json!({
        "id": "INBOX", "name": "INBOX", "type": "system",
        "messagesTotal": unread + 250, "messagesUnread": unread, "threadsTotal": unread + 200, "threadsUnread": unread
    }))
    .into_response()
}

async fn list(
    State(s): State<Arc<GmailState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let messages = match mailbox(&s, &headers).await {
        Ok(m) => m,
        Err(r) => return r,
    };
    record(&s, "GET", "/messages", None);
    let query = q.get("q").map(|v| v.to_lowercase()).unwrap_or_default();
    let max: usize = q
        .get("maxResults")
        .and_then(|m| m.parse().ok())
        .unwrap_or(100);
    let all: Vec<Value> = messages
        .iter()
        .filter(|m| {
            // Every fake message is unread in INBOX (see `metadata_json`); other queries match
            // the subject.
            matches!(query.as_str(), "" | "in:inbox" | "is:unread")
                || m.subject.to_lowercase().contains(&query)
        })
        .map(|m| json!({"id": m.id, "threadId": m.thread_id}))
        .collect();
    if all.is_empty() {
        return Json(json!({"resultSizeEstimate": 0})).into_response();
    }
    let total = all.len();
    let matching: Vec<Value> = all.into_iter().take(max).collect();
    let mut page = json!({"messages": matching, "resultSizeEstimate": total});
    // As Gmail does: a token for the next page when this one did not hold every match.
    if total > max {
        page["nextPageToken"] = json!(format!("page-after-{max}"));
    }
    Json(page).into_response()
}

async fn message(
    State(s): State<Arc<GmailState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let messages = match mailbox(&s, &headers).await {
        Ok(m) => m,
        Err(r) => return r,
    };
    let format = q.get("format").cloned().unwrap_or_else(|| "full".into());
    record(&s, "GET", &format!("/messages/{id}"), Some(format.clone()));
    match messages.iter().find(|m| m.id == id) {
        None => error(StatusCode::NOT_FOUND, "Requested entity was not found."),
        Some(m) if format == "metadata" => {
            Json(m.metadata_json(&["Subject".into(), "From".into(), "Date".into()])).into_response()
        }
        Some(m) => Json(m.full_json()).into_response(),
    }
}

async fn thread(
    State(s): State<Arc<GmailState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let messages = match mailbox(&s, &headers).await {
        Ok(m) => m,
        Err(r) => return r,
    };
    record(&s, "GET", &format!("/threads/{id}"), Some("full".into()));
    let in_thread: Vec<Value> = messages
        .iter()
        .filter(|m| m.thread_id == id)
        .map(FakeMessage::full_json)
        .collect();
    if in_thread.is_empty() {
        return error(StatusCode::NOT_FOUND, "Requested entity was not found.");
    }
    Json(json!({"id": id, "messages": in_thread})).into_response()
}

fn decode_raw(raw: &str) -> String {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(raw.trim_end_matches('='))
        .unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn send(
    State(s): State<Arc<GmailState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    if let Err(r) = mailbox(&s, &headers).await {
        return r;
    }
    record(&s, "POST", "/messages/send", None);
    let gate = s.send_gate.lock().expect("lock").clone();
    if let Some(gate) = gate {
        // notify_one keeps a permit: the test may start waiting after the send arrived.
        gate.arrived.notify_one();
        gate.released.notified().await;
    }
    let delay = *s.send_delay.lock().expect("lock");
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    let raw = decode_raw(body["raw"].as_str().unwrap_or_default());
    let thread = body["threadId"].as_str().map(str::to_owned);
    let mut sent = s.sent.lock().expect("lock");
    sent.push((raw, thread.clone()));
    Json(json!({"id": format!("sent{}", sent.len()), "threadId": thread.unwrap_or_else(|| "tnew".into()), "labelIds": ["SENT"]}))
        .into_response()
}

async fn draft(
    State(s): State<Arc<GmailState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    if let Err(r) = mailbox(&s, &headers).await {
        return r;
    }
    record(&s, "POST", "/drafts", None);
    let raw = decode_raw(
        body.pointer("/message/raw")
            .and_then(Value::as_str)
            .unwrap_or_default(),
    );
    let mut sent = s.sent.lock().expect("lock");
    sent.push((raw, None));
    Json(json!({"id": format!("draft{}", sent.len()), "message": {"id": "m-draft", "threadId": "tdraft"}})).into_response()
}

/// Google's batch endpoint: one embedded GET per part, answered part by part.
async fn batch(State(s): State<Arc<GmailState>>, headers: HeaderMap, body: Bytes) -> Response {
    let messages = match mailbox(&s, &headers).await {
        Ok(m) => m,
        Err(r) => return r,
    };
    record(&s, "POST", "/batch", None);
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let Some(boundary) = content_type.split("boundary=").nth(1) else {
        return error(
            StatusCode::BAD_REQUEST,
            "multipart/mixed with a boundary is required",
        );
    };
    let body = String::from_utf8_lossy(&body);
    let mut out = String::new();
    let mut count = 0;
    for part in body.split(&format!("--{boundary}")).skip(1) {
        if part.starts_with("--") {
            break;
        }
        count += 1;
        if count > 100 {
            return error(StatusCode::BAD_REQUEST, "Too many requests in batch");
        }
        let content_id = part
            .lines()
            .find_map(|l| {
                l.strip_prefix("Content-ID: <")
                    .map(|v| v.trim_end_matches('>').to_owned())
            })
            .unwrap_or_default();
        let Some(request_line) = part.lines().find(|l| l.starts_with("GET ")) else {
            continue;
        };
        let target = request_line
            .trim_start_matches("GET ")
            .split_whitespace()
            .next()
            .unwrap_or_default();
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let params: Vec<(String, String)> = query
            .split('&')
            .filter_map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
            })
            .collect();
        let format = params
            .iter()
            .find(|(k, _)| k == "format")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| "full".into());
        let wanted: Vec<String> = params
            .iter()
            .filter(|(k, _)| k == "metadataHeaders")
            .map(|(_, v)| v.clone())
            .collect();
        let id = path.rsplit('/').next().unwrap_or_default();
        record(
            &s,
            "GET(batched)",
            &format!("/messages/{id}"),
            Some(format.clone()),
        );
        let (status, json_body) = match messages.iter().find(|m| m.id == id) {
            None => (
                "404 Not Found",
                json!({"error": {"code": 404, "message": "Requested entity was not found."}}),
            ),
            Some(m) if format == "metadata" => ("200 OK", m.metadata_json(&wanted)),
            Some(m) => ("200 OK", m.full_json()),
        };
        out.push_str(&format!(
            "--batch_fake\r\nContent-Type: application/http\r\nContent-ID: <response-{content_id}>\r\n\r\n\
             HTTP/1.1 {status}\r\nContent-Type: application/json; charset=UTF-8\r\nVary: Origin\r\n\r\n{json_body}\r\n"
        ));
    }
    out.push_str("--batch_fake--\r\n");
    (
        StatusCode::OK,
        [("content-type", "multipart/mixed; boundary=batch_fake")],
        out,
    )
        .into_response()
}
