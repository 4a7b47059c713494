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

#[derive(Default)]
pub struct OAuthState {
    pub refreshes: AtomicUsize,
    pub revoked: AtomicBool,
    /// Refresh tokens presented, to check the gateway decrypted the right one.
    pub seen_refresh_tokens: std::sync::Mutex<Vec<String>>,
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
    // Slow enough that concurrent callers pile up behind the first refresh.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    Json(json!({
        "access_token": format!("fresh-access-{n}"),
        "expires_in": 3599,
        "scope": "https://www.googleapis.com/auth/gmail.readonly",
        "token_type": "Bearer"
    }))
    .into_response()
}
