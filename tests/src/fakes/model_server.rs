//! A scripted model server shared by the provider fakes: each request pops the next prepared
//! answer (an SSE body sent in small arbitrary chunks, or an error status with Retry-After) and
//! is recorded with its arrival time, path and JSON body. The provider modules build answers in
//! their own wire formats.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Instant,
};

use axum::{
    Router,
    body::Body,
    extract::{Json, State},
    http::Uri,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::Value;

/// One prepared answer.
#[derive(Clone, Debug)]
pub enum Prepared {
    /// `text/event-stream` body, sent `chunk` bytes at a time.
    Sse { body: String, chunk: usize },
    Error {
        status: u16,
        retry_after: Option<u64>,
        body: String,
    },
    /// The inner answer after a pause: a model that takes its time.
    Delayed(Box<Prepared>, std::time::Duration),
    /// The inner answer once the test lets it go (`notify_one`): a model whose answer the test
    /// times against something else it does meanwhile.
    Held(Box<Prepared>, Arc<tokio::sync::Notify>),
}

/// A recorded request.
#[derive(Clone, Debug)]
pub struct Seen {
    pub at: Instant,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

#[derive(Default)]
pub struct ModelServerState {
    answers: Mutex<VecDeque<Prepared>>,
    seen: Mutex<Vec<Seen>>,
    /// Woken with every request recorded.
    arrivals: tokio::sync::Notify,
}

#[derive(Clone)]
pub struct ModelServer {
    pub base: String,
    pub state: Arc<ModelServerState>,
}

impl ModelServer {
    /// Serves `answers` on every POST path under `route` (an axum path pattern).
    pub async fn start(route: &str, answers: Vec<Prepared>) -> Self {
        let state = Arc::new(ModelServerState {
            answers: Mutex::new(answers.into()),
            seen: Mutex::default(),
            arrivals: tokio::sync::Notify::new(),
        });
        let router = Router::new()
            .route(route, post(answer))
            .with_state(state.clone());
        let (base, _) = super::serve(router).await;
        Self { base, state }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().expect("lock").clone()
    }

    /// Resolves once `n` requests have arrived: a test waits on the model's side, not on time.
    pub async fn requested(&self, n: usize) {
        loop {
            let arrival = self.state.arrivals.notified();
            tokio::pin!(arrival);
            // Registered before the count is read, so a request in between still wakes it.
            arrival.as_mut().enable();
            if self.state.seen.lock().expect("lock").len() >= n {
                return;
            }
            arrival.await;
        }
    }
}

/// SSE frames: `event:` lines when named, then `data:`.
pub fn frames(events: &[(Option<&str>, Value)]) -> String {
    events
        .iter()
        .map(|(name, data)| match name {
            Some(n) => format!("event: {n}\ndata: {data}\n\n"),
            None => format!("data: {data}\n\n"),
        })
        .collect()
}

async fn answer(
    State(s): State<Arc<ModelServerState>>,
    uri: Uri,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    s.seen.lock().expect("lock").push(Seen {
        at: Instant::now(),
        path: uri.to_string(),
        headers,
        body,
    });
    s.arrivals.notify_waiters();
    let mut next = s.answers.lock().expect("lock").pop_front();
    match next {
        Some(Prepared::Delayed(inner, pause)) => {
            tokio::time::sleep(pause).await;
            next = Some(*inner);
        }
        Some(Prepared::Held(inner, gate)) => {
            gate.notified().await;
            next = Some(*inner);
        }
        _ => {}
    }
    match next {
        Some(Prepared::Delayed(..) | Prepared::Held(..)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "nested delays are not supported",
        )
            .into_response(),
        None => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "no more scripted answers",
        )
            .into_response(),
        Some(Prepared::Error {
            status,
            retry_after,
            body,
        }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut r = (status, [("content-type", "application/json")], body).into_response();
            if let Some(secs) = retry_after {
                r.headers_mut()
                    .insert("retry-after", secs.to_string().parse().expect("header"));
            }
            r
        }
        Some(Prepared::Sse { body, chunk }) => {
            let pieces: Vec<Result<Vec<u8>, std::io::Error>> = body
                .into_bytes()
                .chunks(chunk.max(1))
                .map(|c| Ok(c.to_vec()))
                .collect();
            (
                [("content-type", "text/event-stream")],
                Body::from_stream(futures_util::stream::iter(pieces)),
            )
                .into_response()
        }
    }
}
