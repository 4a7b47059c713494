//! The gateway's hot path holds no pooled connection across upstream I/O (issue 13): a burst
//! of slow side effects — each upstream send takes 2 s — all go through, 20 on a pool of 4
//! connections and the 50 on the default pool of 16, with a 1 s acquire timeout. (While an idempotency claim was an advisory lock inside an
//! open transaction, each send pinned a connection for its whole upstream call, and the fifth
//! concurrent send waited past the timeout.)

use std::time::Duration;

use serde_json::json;
use steward_tests::{calls::call_tool_keyed, worlds::gmail_world};

#[tokio::test]
async fn twenty_concurrent_slow_sends_never_exhaust_a_four_connection_pool() {
    concurrent_slow_sends(20, 4).await;
}

#[tokio::test]
async fn fifty_concurrent_slow_sends_never_exhaust_a_sixteen_connection_pool() {
    concurrent_slow_sends(50, 16).await;
}

async fn concurrent_slow_sends(sends: usize, pool: usize) {
    let pool = pool.to_string();
    let (app, _model, gmail) = gmail_world(
        vec![],
        &[
            ("DATABASE_MAX_CONNECTIONS", &pool),
            ("DATABASE_ACQUIRE_TIMEOUT", "1s"),
            // The burst is the point here, not the per-user send limit.
            ("RATE_LIMITS_GMAIL", "1000/minute,5000/hour,50000/day"),
        ],
    )
    .await;
    gmail.delay_sends(Duration::from_secs(2));
    let calls = (0..sends).map(|i| {
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
    let results = futures_util::future::join_all(calls).await;
    let failed: Vec<&str> = results
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.text.as_str())
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {sends} failed: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(gmail.sent().len(), sends);
}
