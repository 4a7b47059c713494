//! The gateway's hot path holds no pooled connection across upstream I/O (issue 13): a burst
//! of slow side effects — each upstream send takes 2 s — on a pool of 4 connections with a 1 s
//! acquire timeout all go through. (While an idempotency claim was an advisory lock inside an
//! open transaction, each send pinned a connection for its whole upstream call, and the fifth
//! concurrent send waited past the timeout.)

use std::time::Duration;

use serde_json::json;
use steward_tests::{calls::call_tool_keyed, worlds::gmail_world};

#[tokio::test]
async fn twenty_concurrent_slow_sends_never_exhaust_a_four_connection_pool() {
    let (app, _model, gmail) = gmail_world(
        vec![],
        &[
            ("DATABASE_MAX_CONNECTIONS", "4"),
            ("DATABASE_ACQUIRE_TIMEOUT", "1s"),
        ],
    )
    .await;
    gmail.delay_sends(Duration::from_secs(2));
    let sends = (0..20).map(|i| {
        let app = &app;
        async move {
            let mut g = app.gateway_as("alice").await;
            call_tool_keyed(
                &mut g,
                "gmail_send",
                json!({"to": "bob@example.com", "subject": format!("Note {i}"), "body": "Hello"}),
                &format!("run-1/call-{i}"),
            )
            .await
        }
    });
    let results = futures_util::future::join_all(sends).await;
    let failed: Vec<&str> = results
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.text.as_str())
        .collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(gmail.sent().len(), 20);
}
