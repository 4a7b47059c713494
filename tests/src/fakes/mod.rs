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

use tokio::net::TcpSocket;

/// Connections a fake upstream's listener queues before its accept loop takes them. The load
/// bench opens a thousand at once; past tokio's default of 1,024 half-served ones the kernel
/// drops a SYN, and the client's one-second retransmit showed up as Steward's latency.
const BACKLOG: u32 = 4096;

/// Serves `router` on 127.0.0.1 port 0 for the rest of the test; returns its base URL.
pub async fn serve(router: axum::Router) -> (String, SocketAddr) {
    let socket = TcpSocket::new_v4().expect("a socket for a fake upstream");
    socket
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind a fake upstream");
    let listener = socket.listen(BACKLOG).expect("listen on a fake upstream");
    let addr = listener.local_addr().expect("fake address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (format!("http://{addr}"), addr)
}
