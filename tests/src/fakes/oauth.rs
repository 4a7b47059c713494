//! Google's OAuth 2.0 token endpoint (`POST /token`, form-encoded refresh_token grant), counting
//! refreshes. Answers like Google: JSON with access_token and expires_in, or 400 invalid_grant.

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicUsize, Ordering},
};

use axum::{
    Form, Json, Router, extract::State, http::StatusCode, response::IntoResponse, routing::post,
};
use serde_json::json;
use tokio::sync::oneshot;

#[derive(Default)]
pub struct OAuthState {
    pub refreshes: AtomicUsize,
    pub revoked: AtomicBool,
    /// Refresh tokens presented, to check the gateway decrypted the right one.
    pub seen_refresh_tokens: std::sync::Mutex<Vec<String>>,
    /// Answers with a new refresh token too, as providers that rotate them do.
    pub rotate: AtomicBool,
    /// The next refresh's hold (see [`FakeOAuth::hold_next_refresh`]).
    hold: std::sync::Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
}

/// A refresh held at the token endpoint until let go: a slow endpoint, on cue.
pub struct HeldRefresh {
    arrived: oneshot::Receiver<()>,
    release: oneshot::Sender<()>,
}

impl HeldRefresh {
    /// Returns once the held refresh has reached the endpoint.
    pub async fn arrived(&mut self) {
        (&mut self.arrived)
            .await
            .expect("the token endpoint is up while a refresh is held");
    }

    /// Lets the held refresh be answered.
    pub fn release(self) {
        let _ = self.release.send(());
    }
}

#[derive(Clone)]
pub struct FakeOAuth {
    pub url: String,
    pub state: Arc<OAuthState>,
}

impl FakeOAuth {
    /// From now on the token endpoint answers every refresh `invalid_grant` (or, with false,
    /// refreshes again).
    pub fn set_revoked(&self, revoked: bool) {
        self.state.revoked.store(revoked, Ordering::SeqCst);
    }

    pub async fn start() -> Self {
        let state = Arc::new(OAuthState::default());
        let router = Router::new()
            .route("/token", post(token))
            .with_state(state.clone());
        let (base, _) = super::serve(router).await;
        Self {
            url: format!("{base}/token"),
            state,
        }
    }

    /// The next refresh, once it arrives, is answered only when the returned hold is let go.
    pub fn hold_next_refresh(&self) -> HeldRefresh {
        let (arrived_tx, arrived) = oneshot::channel();
        let (release, release_rx) = oneshot::channel();
        *self.state.hold.lock().expect("lock") = Some((arrived_tx, release_rx));
        HeldRefresh { arrived, release }
    }

    pub fn refreshes(&self) -> usize {
        self.state.refreshes.load(Ordering::SeqCst)
    }
}

async fn token(
    State(state): State<Arc<OAuthState>>,
    Form(form): Form<Vec<(String, String)>>,
) -> impl IntoResponse {
    let get = |k: &str| {
        form.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    if get("grant_type") != "refresh_token" || get("client_id").is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "invalid_request"})),
        )
            .into_response();
    }
    state
        .seen_refresh_tokens
        .lock()
        .expect("lock")
        .push(get("refresh_token"));
    if state.revoked.load(Ordering::SeqCst) {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "invalid_grant", "error_description": "Token has been expired or revoked."})),
        )
            .into_response();
    }
    let n = state.refreshes.fetch_add(1, Ordering::SeqCst) + 1;
    let held = state.hold.lock().expect("lock").take();
    match held {
        Some((arrived, release)) => {
            let _ = arrived.send(());
            let _ = release.await;
        }
        // Slow enough that concurrent callers pile up behind the first refresh.
        None => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
    }
    let mut answer = json!({
        "access_token": format!("fresh-access-{n}"),
        "expires_in": 3599,
        "scope": "https://www.googleapis.com/auth/gmail.readonly",
        "token_type": "Bearer"
    });
    if state.rotate.load(Ordering::SeqCst) {
        answer["refresh_token"] = json!(format!("rotated-refresh-{n}"));
    }
    Json(answer).into_response()
}
