//! CREDENTIALS_KEY at start-up and its rotation (G-8): a gateway given a key that reads none of
//! the stored tokens refuses to start instead of serving "reconnect your account" to everyone,
//! and CREDENTIALS_KEY_PREVIOUS lets the key change without reconnecting accounts. gateway-svc
//! runs in process on a per-test PostgreSQL database, with a fake upstream behind a tool.

use std::collections::HashMap;

use gateway_svc::credentials::cipher::TokenCipher;
use steward_proto::gateway::v1 as pb;
use steward_tests::{
    RunningService, TestDb,
    calls::{call_tool, connect_account},
    fakes::{oauth::FakeOAuth, probe::FakeProbe},
    gateway_as, probe_tools, start_gateway_with,
};

/// "0123456789abcdef" twice.
const KEY_A: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
/// "abcdef0123456789" twice.
const KEY_B: &str = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk=";
/// "ZZzzyyxxwwvvuuttssrrqqppoonnmmll".
const KEY_C: &str = "Wlp6enl5eHh3d3Z2dXV0dHNzcnJxcXBwb29ubm1tbGw=";

const ACCOUNT: &str = "work@example.com";
const TOKEN: &str = "access-under-key-a";

/// A database and a fake upstream; the gateway is started on them with the keys each test
/// chooses.
struct World {
    db: TestDb,
    probe: FakeProbe,
    oauth: FakeOAuth,
}

impl World {
    async fn new() -> Self {
        Self {
            db: TestDb::create().await.expect("a test database"),
            probe: FakeProbe::start().await,
            oauth: FakeOAuth::start().await,
        }
    }

    /// Starts gateway-svc with CREDENTIALS_KEY = `key` and, if given,
    /// CREDENTIALS_KEY_PREVIOUS = `previous`; the error is what start-up reported.
    async fn start(&self, key: &str, previous: Option<&str>) -> Result<RunningService, String> {
        self.start_with(key, previous, &[]).await
    }

    /// As [`World::start`], with `more` settings.
    async fn start_with(
        &self,
        key: &str,
        previous: Option<&str>,
        more: &[(&str, &str)],
    ) -> Result<RunningService, String> {
        let mut env: HashMap<String, String> = HashMap::from([
            ("DATABASE_URL".into(), self.db.url().to_owned()),
            ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
            ("CREDENTIALS_KEY".into(), key.into()),
            ("GOOGLE_CLIENT_ID".into(), "client-id".into()),
            ("GOOGLE_CLIENT_SECRET".into(), "client-secret".into()),
            ("GOOGLE_OAUTH_TOKEN_URL".into(), self.oauth.url.clone()),
        ]);
        if let Some(previous) = previous {
            env.insert("CREDENTIALS_KEY_PREVIOUS".into(), previous.into());
        }
        env.extend(more.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        start_gateway_with(&env, probe_tools::all(&self.probe.url)).await
    }

    /// Starts with `key` (and `previous`), connects `user`'s Gmail account with `token`, and
    /// stops: the account is then stored under `key`.
    async fn store_account(&self, key: &str, previous: Option<&str>, user: &str, token: &str) {
        let mut gateway = self.start(key, previous).await.expect("the gateway starts");
        connect_account(
            &mut gateway_as(gateway.addr, user).await,
            pb::Integration::Gmail,
            ACCOUNT,
            token,
        )
        .await;
        gateway.stop().await.expect("the gateway stops cleanly");
    }

    /// A world whose one account (u1's) was stored under KEY_A.
    async fn stored_under_key_a() -> Self {
        let w = Self::new().await;
        w.store_account(KEY_A, None, "u1", TOKEN).await;
        w
    }

    /// Calls a tool of `user`'s account through `gateway`, which fetches from the fake
    /// upstream with the account's access token.
    async fn fetch(&self, gateway: &RunningService, user: &str) -> pb::ToolResult {
        call_tool(
            &mut gateway_as(gateway.addr, user).await,
            "probe_fetch",
            serde_json::json!({"path": "/data?size=2"}),
        )
        .await
    }
}

#[tokio::test]
async fn a_gateway_given_a_key_that_reads_none_of_the_stored_tokens_refuses_to_start_naming_credentials_key()
 {
    let w = World::stored_under_key_a().await;
    let Err(err) = w.start(KEY_B, None).await else {
        panic!("started with a key that reads no stored token")
    };
    assert!(
        err.contains(
            "CREDENTIALS_KEY does not decrypt any of the 1 stored account tokens sampled: it is not the key they were stored with"
        ),
        "{err}"
    );
    assert!(
        err.contains(
            "Set CREDENTIALS_KEY to that key (or, to rotate, set CREDENTIALS_KEY_PREVIOUS to it)"
        ),
        "{err}"
    );
    assert!(
        !err.contains(TOKEN),
        "no token material in the error: {err}"
    );
}

#[tokio::test]
async fn a_gateway_whose_previous_key_reads_none_of_the_stored_tokens_either_refuses_to_start_naming_both()
 {
    let w = World::stored_under_key_a().await;
    let Err(err) = w.start(KEY_B, Some(KEY_C)).await else {
        panic!("started with keys that read no stored token")
    };
    assert!(
        err.contains("CREDENTIALS_KEY (nor CREDENTIALS_KEY_PREVIOUS) does not decrypt any of the 1 stored account tokens sampled"),
        "{err}"
    );
}

#[tokio::test]
async fn a_gateway_given_the_new_key_and_the_old_one_as_previous_starts_and_sends_the_stored_token_upstream()
 {
    let w = World::stored_under_key_a().await;
    let mut gateway = w
        .start(KEY_B, Some(KEY_A))
        .await
        .expect("starts while rotating from key A to key B");
    let result = w.fetch(&gateway, "u1").await;
    assert!(result.ok, "{}", result.text);
    assert_eq!(result.text, "xx");
    assert_eq!(w.probe.tokens_seen(), [TOKEN]);
    gateway.stop().await.expect("the gateway stops cleanly");
}

#[tokio::test]
async fn a_gateway_given_the_key_the_tokens_were_stored_with_still_starts_and_serves_them() {
    let w = World::stored_under_key_a().await;
    let mut gateway = w.start(KEY_A, None).await.expect("starts with key A");
    let result = w.fetch(&gateway, "u1").await;
    assert!(result.ok, "{}", result.text);
    assert_eq!(w.probe.tokens_seen(), [TOKEN]);
    gateway.stop().await.expect("the gateway stops cleanly");
}

#[tokio::test]
async fn an_account_saved_while_rotating_is_stored_under_the_new_key_so_the_previous_one_can_go() {
    let w = World::stored_under_key_a().await;
    // Reconnecting during the rotation stores the account under the new key...
    w.store_account(KEY_B, Some(KEY_A), "u1", "access-under-key-b")
        .await;
    // ...so the new key alone reads it, and the old key alone no longer does.
    let mut gateway = w
        .start(KEY_B, None)
        .await
        .expect("starts with key B alone once every account was saved again");
    let result = w.fetch(&gateway, "u1").await;
    assert!(result.ok, "{}", result.text);
    assert_eq!(w.probe.tokens_seen(), ["access-under-key-b"]);
    gateway.stop().await.expect("the gateway stops cleanly");
    let Err(err) = w.start(KEY_A, None).await else {
        panic!("started with the key rotated out")
    };
    assert!(err.contains("CREDENTIALS_KEY does not decrypt"), "{err}");
}

#[tokio::test]
async fn a_gateway_that_reads_some_of_the_stored_tokens_starts_and_serves_those() {
    let w = World::stored_under_key_a().await;
    // u2's account is stored under key C (by a replica rotating from A to C).
    w.store_account(KEY_C, Some(KEY_A), "u2", "access-under-key-c")
        .await;
    let mut gateway = w
        .start(KEY_A, None)
        .await
        .expect("starts: one of the two tokens sampled is readable");
    let result = w.fetch(&gateway, "u1").await;
    assert!(result.ok, "{}", result.text);
    let unreadable = w.fetch(&gateway, "u2").await;
    assert!(!unreadable.ok, "{}", unreadable.text);
    assert_eq!(
        unreadable.error_kind,
        pb::ErrorKind::CredentialsRevoked as i32,
        "{}",
        unreadable.text
    );
    assert_eq!(w.probe.tokens_seen(), [TOKEN], "u2's call never left");
    gateway.stop().await.expect("the gateway stops cleanly");
}

/// An account refreshed during a rotation is stored whole under the new key — its refresh
/// token too, although Google kept it the same —, so once every account was saved again the
/// previous key can go: the new key alone reads both of its tokens.
#[tokio::test]
async fn a_token_refreshed_while_rotating_is_stored_whole_under_the_new_key() {
    let w = World::new().await;
    let mut gateway = w.start(KEY_A, None).await.expect("starts with key A");
    let expiring = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        + 10;
    gateway_as(gateway.addr, "u1")
        .await
        .connect_account(pb::ConnectAccountRequest {
            integration: pb::Integration::Gmail as i32,
            account: ACCOUNT.into(),
            access_token: TOKEN.into(),
            refresh_token: "refresh-under-key-a".into(),
            expires_at: Some(prost_types::Timestamp {
                seconds: expiring,
                nanos: 0,
            }),
            scopes: vec![],
        })
        .await
        .expect("connect the account");
    gateway.stop().await.expect("the gateway stops cleanly");

    let mut rotating = w
        .start(KEY_B, Some(KEY_A))
        .await
        .expect("starts while rotating from key A to key B");
    let result = w.fetch(&rotating, "u1").await;
    assert!(result.ok, "{}", result.text);
    assert_eq!(w.oauth.refreshes(), 1, "the expiring token was refreshed");
    assert_eq!(
        *w.oauth.state.seen_refresh_tokens.lock().unwrap(),
        ["refresh-under-key-a"],
        "read with the previous key"
    );
    assert_eq!(w.probe.tokens_seen(), ["fresh-access-1"]);
    rotating.stop().await.expect("the gateway stops cleanly");

    let mut rotated = w
        .start(KEY_B, None)
        .await
        .expect("key B alone reads the refreshed account, refresh token included");
    rotated.stop().await.expect("the gateway stops cleanly");
}

/// G-8, a rotation's last step: with CREDENTIALS_REKEY the gateway moves every stored token
/// under CREDENTIALS_KEY_PREVIOUS to CREDENTIALS_KEY by itself, in the background, with no
/// call made — so the previous key can go, and a gateway given the new key alone serves the
/// account as before.
#[tokio::test]
async fn g8_with_credentials_rekey_the_stored_tokens_move_to_the_new_key_by_themselves() {
    // The process's metrics, which the in-process gateway records to.
    let metrics = svc_kit::metrics::recorder();
    let w = World::stored_under_key_a().await;
    let mut rekeying = w
        .start_with(
            KEY_B,
            Some(KEY_A),
            &[
                ("CREDENTIALS_REKEY", "true"),
                ("CREDENTIALS_REKEY_INTERVAL", "1s"),
            ],
        )
        .await
        .expect("starts in a rotation's last step");
    let (sql, conn) = tokio_postgres::connect(w.db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let new_key_alone = TokenCipher::from_base64(KEY_B).unwrap();
    let row = format!("u1/gmail/{ACCOUNT}");
    // The walk's first run comes within its first interval (1 s here).
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let stored: Vec<u8> = sql
            .query_one("SELECT access_token FROM gateway.accounts", &[])
            .await
            .unwrap()
            .get(0);
        if let Ok(token) = new_key_alone.decrypt(&stored, &row) {
            assert_eq!(token, TOKEN);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the token never moved to the new key"
        );
        tokio::task::yield_now().await;
    }
    assert!(w.probe.tokens_seen().is_empty(), "moved with no call made");
    // The walk's end sets the gauges just after its last save.
    let shown = loop {
        let shown = metrics.render();
        if shown.contains("steward_gateway_credentials_accounts{key=\"previous\"}") {
            break shown;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the walk never ended: {shown}"
        );
        tokio::task::yield_now().await;
    };
    for line in [
        "steward_gateway_credentials_moved_total 1",
        "steward_gateway_credentials_accounts{key=\"previous\"} 0",
        "steward_gateway_credentials_accounts{key=\"neither\"} 0",
    ] {
        assert!(shown.lines().any(|l| l == line), "{line} in {shown}");
    }
    assert!(
        shown.contains("steward_gateway_credentials_walks_total{outcome=\"finished\"}")
            && !shown.contains("steward_gateway_credentials_walks_total{outcome=\"failed\"}"),
        "{shown}"
    );
    rekeying.stop().await.expect("the gateway stops cleanly");

    let mut rotated = w
        .start(KEY_B, None)
        .await
        .expect("key B alone reads every stored token");
    let result = w.fetch(&rotated, "u1").await;
    assert!(result.ok, "{}", result.text);
    assert_eq!(w.probe.tokens_seen(), [TOKEN]);
    rotated.stop().await.expect("the gateway stops cleanly");
}
