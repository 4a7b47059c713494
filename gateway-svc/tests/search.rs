//! G-7, I-1: a message Gmail rate-limits inside its batch answer (a part answered 429, or 403
//! with Google's rate-limit reason) is a
//! limit to wait out, never a message that "could not be fetched" in a successful result:
//! every part limited is the search's own rate-limit error with when to try again; some
//! limited are said so in the result, with when to try again.
//! The engine runs the real Gmail tools against a scripted upstream on a local socket.

mod common;

use common::upstream::{Answer, Upstream};
use std::sync::Arc;

use gateway_svc::{
    context::Services,
    credentials::{Credentials, cipher::TokenCipher, oauth::OAuthClient},
    domain::{ErrorKind, Integration},
    engine::Engine,
    integrations::gmail::{self, GmailApi},
    ratelimit::{LimitKey, Limits, Window},
    store::memory::MemoryStore,
};
use serde_json::json;
use svc_kit::secret::Secret;

const BATCH: &str = "multipart/mixed; boundary=batch_x";
const LIST: &str = r#"{"messages":[{"id":"a"},{"id":"b"}]}"#;

/// Both parts of the batch answered 429, asking for 9 and 17 seconds: the longer is the wait.
fn all_limited(method: &str, _path: &str) -> Answer {
    match method {
        "GET" => Answer::Status(200, LIST),
        _ => Answer::Typed(
            200,
            BATCH,
            "--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-0>\r\n\r\n\
HTTP/1.1 429 Too Many Requests\r\nRetry-After: 9\r\nContent-Type: application/json\r\n\r\n{\"error\":{}}\r\n\
--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-1>\r\n\r\n\
HTTP/1.1 429 Too Many Requests\r\nRetry-After: 17\r\nContent-Type: application/json\r\n\r\n{\"error\":{}}\r\n\
--batch_x--\r\n",
        ),
    }
}

/// The first part fetched, the second answered 429 asking for 12 seconds.
fn one_limited(method: &str, _path: &str) -> Answer {
    match method {
        "GET" => Answer::Status(200, LIST),
        _ => Answer::Typed(
            200,
            BATCH,
            "--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-0>\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n\
{\"id\":\"a\",\"threadId\":\"t\",\"payload\":{\"headers\":[{\"name\":\"Subject\",\"value\":\"Hello\"}]}}\r\n\
--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-1>\r\n\r\n\
HTTP/1.1 429 Too Many Requests\r\nRetry-After: 12\r\nContent-Type: application/json\r\n\r\n{\"error\":{}}\r\n\
--batch_x--\r\n",
        ),
    }
}

/// The first part fetched, the second answered 403 with Google's per-user rate-limit reason,
/// the third 403 for a reason that is no limit.
fn one_limited_by_403(method: &str, _path: &str) -> Answer {
    match method {
        "GET" => Answer::Status(200, r#"{"messages":[{"id":"a"},{"id":"b"},{"id":"c"}]}"#),
        _ => Answer::Typed(
            200,
            BATCH,
            "--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-0>\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n\
{\"id\":\"a\",\"threadId\":\"t\",\"payload\":{\"headers\":[{\"name\":\"Subject\",\"value\":\"Hello\"}]}}\r\n\
--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-1>\r\n\r\n\
HTTP/1.1 403 Forbidden\r\nRetry-After: 21\r\nContent-Type: application/json\r\n\r\n\
{\"error\":{\"code\":403,\"message\":\"User Rate Limit Exceeded\",\"errors\":[{\"domain\":\"usageLimits\",\"reason\":\"userRateLimitExceeded\"}]}}\r\n\
--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-2>\r\n\r\n\
HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n\r\n\
{\"error\":{\"code\":403,\"errors\":[{\"reason\":\"forbidden\"}]}}\r\n\
--batch_x--\r\n",
        ),
    }
}

/// Both parts answered 403 with Google's rate-limit reason, one asking for 25 seconds.
fn all_limited_by_403(method: &str, _path: &str) -> Answer {
    match method {
        "GET" => Answer::Status(200, LIST),
        _ => Answer::Typed(
            200,
            BATCH,
            "--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-0>\r\n\r\n\
HTTP/1.1 403 Forbidden\r\nRetry-After: 25\r\nContent-Type: application/json\r\n\r\n\
{\"error\":{\"code\":403,\"errors\":[{\"reason\":\"rateLimitExceeded\"}]}}\r\n\
--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-1>\r\n\r\n\
HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n\r\n\
{\"error\":{\"code\":403,\"errors\":[{\"reason\":\"userRateLimitExceeded\"}]}}\r\n\
--batch_x--\r\n",
        ),
    }
}

async fn engine(upstream: &Upstream) -> Engine {
    let engine = common::engine(
        &MemoryStore::stores(),
        gmail::tools(GmailApi {
            base_url: upstream.base_url.clone(),
        }),
    );
    common::connect(&engine, Integration::Gmail, "alice@example.com", "tok").await;
    engine
}

#[tokio::test]
async fn g7_a_search_whose_every_batch_part_is_rate_limited_is_a_rate_limit_error_with_when_to_retry()
 {
    let upstream = Upstream::start(all_limited).await;
    let engine = engine(&upstream).await;
    let found = common::call(&engine, "c1", "search_gmail", json!({}), "k1").await;
    assert!(!found.ok(), "{}", found.text);
    assert_eq!(found.error_kind, Some(ErrorKind::RateLimited));
    assert_eq!(
        found.text,
        "Gmail is rate limiting requests. Try again in 17 seconds."
    );
}

#[tokio::test]
async fn g7_a_search_with_some_batch_parts_rate_limited_says_which_could_not_be_fetched_and_when_to_retry()
 {
    let upstream = Upstream::start(one_limited).await;
    let engine = engine(&upstream).await;
    let found = common::call(&engine, "c1", "search_gmail", json!({}), "k1").await;
    assert!(found.ok(), "{}", found.text);
    assert!(found.text.contains("1. [a] \"Hello\""), "{}", found.text);
    assert!(
        found
            .text
            .contains("2. [b] (not fetched: Gmail rate-limited it)"),
        "{}",
        found.text
    );
    assert!(
        found.text.contains(
            "(1 of these could not be fetched because Gmail rate-limited them; try again in 12 seconds"
        ),
        "{}",
        found.text
    );
}

#[tokio::test]
async fn g7_a_batch_part_answered_403_for_a_rate_limit_is_a_rate_limit_and_other_403s_are_not() {
    let upstream = Upstream::start(one_limited_by_403).await;
    let engine = engine(&upstream).await;
    let found = common::call(&engine, "c1", "search_gmail", json!({}), "k1").await;
    assert!(found.ok(), "{}", found.text);
    assert!(
        found
            .text
            .contains("2. [b] (not fetched: Gmail rate-limited it)"),
        "{}",
        found.text
    );
    assert!(
        found
            .text
            .contains("3. [c] (could not be fetched: HTTP 403)"),
        "{}",
        found.text
    );
    assert!(
        found.text.contains(
            "(1 of these could not be fetched because Gmail rate-limited them; try again in 21 seconds"
        ),
        "{}",
        found.text
    );
}

#[tokio::test]
async fn g7_a_search_whose_every_batch_part_is_403_rate_limited_is_a_rate_limit_error() {
    let upstream = Upstream::start(all_limited_by_403).await;
    let engine = engine(&upstream).await;
    let found = common::call(&engine, "c1", "search_gmail", json!({}), "k1").await;
    assert_eq!(
        found.error_kind,
        Some(ErrorKind::RateLimited),
        "{}",
        found.text
    );
    assert_eq!(
        found.text,
        "Gmail is rate limiting requests. Try again in 30 seconds."
    );
}

/// Gmail's token endpoint renews the token; the batch is answered 401 the first time, then as
/// [`one_limited`] but with both parts fetched.
fn batch_refused_once(method: &str, path: &str) -> Answer {
    static BATCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if path.starts_with("/token") {
        return Answer::Status(200, r#"{"access_token": "renewed", "expires_in": 3600}"#);
    }
    if method == "POST" && BATCHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
        return Answer::Status(401, "{}");
    }
    both_fetched(method, path)
}

/// The list, and both parts of the batch fetched.
fn both_fetched(method: &str, _path: &str) -> Answer {
    match method {
        "GET" => Answer::Status(200, LIST),
        _ => Answer::Typed(
            200,
            BATCH,
            "--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-0>\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"id\":\"a\",\"threadId\":\"t\"}\r\n\
--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-1>\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"id\":\"b\",\"threadId\":\"t\"}\r\n\
--batch_x--\r\n",
        ),
    }
}

/// What one search_gmail answered as `script` costs the user's Gmail budget: the calls the
/// day's limit has left after it, taken from the limit.
async fn search_cost(script: fn(&str, &str) -> Answer) -> u32 {
    const LIMIT: u32 = 50;
    let upstream = Upstream::start(script).await;
    let stores = MemoryStore::stores();
    let mut engine = common::engine_with_limits(
        &stores,
        gmail::tools(GmailApi {
            base_url: upstream.base_url.clone(),
        }),
        Some(Limits(vec![(Window::Day, LIMIT)])),
    );
    let services = &engine.services;
    let cipher = TokenCipher::ephemeral();
    let google = OAuthClient {
        token_url: format!("{}/token", upstream.base_url),
        client_id: "client".into(),
        client_secret: Secret::new("secret"),
    };
    engine.services = Arc::new(Services {
        credentials: Credentials::new(
            stores.accounts.clone(),
            Some(cipher),
            Some(google),
            services.http.clone(),
        ),
        limiter: services.limiter.clone(),
        http: services.http.clone(),
        audit: services.audit.clone(),
        max_body_bytes: services.max_body_bytes,
    });
    common::connect(&engine, Integration::Gmail, "alice@example.com", "tok").await;
    let found = common::call(&engine, "c1", "search_gmail", json!({"query": "x"}), "k1").await;
    assert!(found.ok(), "{}", found.text);
    let key = LimitKey {
        user: common::user(),
        integration: Integration::Gmail,
        account: "alice@example.com".into(),
    };
    let mut left = 0;
    while engine.services.limiter.charge(&key, 1).await.is_ok() {
        left += 1;
    }
    LIMIT - left
}

#[tokio::test]
async fn g6_a_metadata_batch_sent_again_after_a_401_is_charged_for_every_message_again() {
    let first_time = search_cost(both_fetched).await;
    let refused_once = search_cost(batch_refused_once).await;
    assert_eq!(refused_once, first_time + 2, "two messages fetched again");
}
