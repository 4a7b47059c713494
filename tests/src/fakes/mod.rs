//! Fake upstreams on loopback, speaking the real wire formats, recording what they were sent.

pub mod anthropic;
pub mod anthropic_cache;
pub mod calendar;
pub mod gemini;
pub mod gmail;
pub mod model_server;
pub mod oauth;
pub mod openai;
pub mod probe;
pub mod slack;

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Serves `router` on 127.0.0.1 port 0 for the rest of the test; returns its base URL.
pub async fn serve(router: axum::Router) -> (String, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a fake upstream");
    let addr = listener.local_addr().expect("fake address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (format!("http://{addr}"), addr)
}
