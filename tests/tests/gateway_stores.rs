//! One suite, both gateway stores (S-5): the in-memory store and PostgreSQL must behave alike
//! for accounts, row locks, idempotency claims, audit and rate-limit counters.

use std::{sync::Arc, time::SystemTime};

use gateway_svc::{
    credentials::{
        Credentials,
        cipher::TokenCipher,
        oauth::OAuthClient,
        rekey::{self, Walk},
    },
    domain::{Integration, McpSwitch, UserId},
    ratelimit::{Decision, LimitKey, Limits, RateLimitBackend, Window, memory::MemoryRateLimits},
    store::{
        AccountCursor, AccountStatus, AuditRecord, KeyState, Saved, StoredAccount, StoredResult,
        Stores, TaskFilter, TaskPatch, memory::MemoryStore, postgres::PgStore,
    },
};
use steward_tests::{TestDb, fakes::oauth::FakeOAuth};
use svc_kit::{pg::PoolOptions, server_config::DatabaseConfig};

struct Backend {
    stores: Stores,
    limits: Arc<dyn RateLimitBackend>,
    _db: Option<TestDb>,
}

async fn memory() -> Backend {
    Backend {
        stores: MemoryStore::stores(),
        limits: Arc::new(MemoryRateLimits::default()),
        _db: None,
    }
}

fn config(db: &TestDb) -> DatabaseConfig {
    DatabaseConfig {
        url: db.url().to_owned(),
        pool: PoolOptions {
            max_connections: 8,
            acquire_timeout: std::time::Duration::from_secs(5),
            ..PoolOptions::default()
        },
    }
}

async fn postgres() -> Backend {
    let db = TestDb::create().await.unwrap();
    let stores = PgStore::connect(&config(&db)).await.unwrap().stores();
    let limits = stores.shared_rate_limits.clone().unwrap();
    Backend {
        stores,
        limits,
        _db: Some(db),
    }
}

/// How long a test's idempotency claims may be held.
const HOLD: std::time::Duration = std::time::Duration::from_secs(10);

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

fn account(u: &str, name: &str) -> StoredAccount {
    StoredAccount {
        user: user(u),
        integration: Integration::Gmail,
        account: name.into(),
        access_token: vec![1, 2, 3],
        refresh_token: Some(vec![4, 5]),
        expires_at: Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_900_000_000)),
        scopes: vec!["gmail.readonly".into()],
        status: AccountStatus::Connected,
        connected_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000),
    }
}

async fn accounts_are_scoped_to_their_user_and_round_trip(b: Backend) {
    let s = &b.stores.accounts;
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    s.upsert_account(account("u1", "b@x.com")).await.unwrap();
    s.upsert_account(account("u2", "a@x.com")).await.unwrap();
    let mine = s.list_accounts(&user("u1")).await.unwrap();
    assert_eq!(
        mine.iter().map(|a| a.account.as_str()).collect::<Vec<_>>(),
        ["a@x.com", "b@x.com"]
    );
    assert_eq!(mine[0], account("u1", "a@x.com"));
    assert_eq!(s.count_accounts().await.unwrap(), 3);
    assert!(
        s.delete_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
    );
    assert!(
        !s.delete_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
    );
    assert!(
        s.get_account(&user("u2"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
            .is_some()
    );
}

/// The start-up key check reads the most recently saved accounts, and a rotation's progress the
/// least recently saved (on the memory store, which keeps no save time: by connection).
async fn accounts_are_sampled_by_when_they_were_saved(b: Backend) {
    let s = &b.stores.accounts;
    let mut older = account("u1", "old@x.com");
    older.connected_at -= std::time::Duration::from_secs(60);
    s.upsert_account(older).await.unwrap();
    s.upsert_account(account("u1", "new@x.com")).await.unwrap();
    let names =
        |sample: Vec<StoredAccount>| sample.into_iter().map(|a| a.account).collect::<Vec<_>>();
    assert_eq!(
        names(s.sample_accounts(5, true).await.unwrap()),
        ["new@x.com", "old@x.com"]
    );
    assert_eq!(
        names(s.sample_accounts(1, false).await.unwrap()),
        ["old@x.com"]
    );
}

/// A walk over every account, a page at a time, meets each once, in key order (user,
/// integration, account), whatever is saved meanwhile.
async fn every_account_is_walked_once_a_page_at_a_time(b: Backend) {
    let s = &b.stores.accounts;
    let mut calendar = account("u1", "a@x.com");
    calendar.integration = Integration::GoogleCalendar;
    for a in [
        account("u2", "a@x.com"),
        account("u1", "b@x.com"),
        calendar,
        account("u1", "a@x.com"),
        account("u3", "z@x.com"),
    ] {
        s.upsert_account(a).await.unwrap();
    }
    let mut walked = Vec::new();
    let mut after: Option<AccountCursor> = None;
    loop {
        let page = s.accounts_after(after.as_ref(), 2).await.unwrap();
        assert!(page.len() <= 2);
        let Some(last) = page.last() else { break };
        after = Some(AccountCursor::of(last));
        // Saved while the walk is under way, which makes it the most recently saved: a walk
        // ordered by when accounts were saved (as `sample_accounts` is) would meet it twice.
        if walked.is_empty() {
            let lock = s
                .lock_account(&last.user, last.integration, &last.account)
                .await
                .unwrap();
            let mut saved = lock.current().unwrap().clone();
            saved.access_token = vec![7];
            assert_eq!(lock.save(saved).await.unwrap(), Saved::Applied);
        }
        walked.extend(page.iter().map(|a| {
            let c = AccountCursor::of(a);
            let (u, i, n) = c.key();
            format!("{u}/{i}/{n}")
        }));
    }
    assert_eq!(
        walked,
        [
            "u1/gmail/a@x.com",
            "u1/gmail/b@x.com",
            "u1/google_calendar/a@x.com",
            "u2/gmail/a@x.com",
            "u3/gmail/z@x.com",
        ]
    );
}

/// G-8: while CREDENTIALS_KEY_PREVIOUS is set, a walk re-encrypts under CREDENTIALS_KEY every
/// token still under the previous key — access and refresh tokens alike — so the previous key
/// can go; a token under neither key is left as it is — beside a token of the same account
/// that does move — and a second walk finds nothing to do.
async fn g8_a_rotation_walk_moves_every_token_under_the_previous_key_to_the_current_one(
    b: Backend,
) {
    const OLD: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
    const NEW: &str = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk=";
    const OTHER: &str = "Wlp6enl5eHh3d3Z2dXV0dHNzcnJxcXBwb29ubm1tbGw=";
    let cipher = |key: &str| TokenCipher::from_base64(key).unwrap();
    let s = &b.stores.accounts;
    let row = |name: &str| format!("u1/gmail/{name}");
    let stored = |name: &str, key: &str, refresh: bool| {
        let c = cipher(key);
        StoredAccount {
            access_token: c.encrypt(&format!("access-{name}"), &row(name)).unwrap(),
            refresh_token: refresh
                .then(|| c.encrypt(&format!("refresh-{name}"), &row(name)).unwrap()),
            ..account("u1", name)
        }
    };
    let foreign = stored("d@x.com", OTHER, true);
    // Its access token still serves until it expires, so it must not stay under the old key.
    let half_foreign = StoredAccount {
        refresh_token: foreign.refresh_token.clone(),
        ..stored("e@x.com", OLD, false)
    };
    for a in [
        stored("a@x.com", OLD, true),
        stored("b@x.com", NEW, true),
        stored("c@x.com", OLD, false),
        foreign.clone(),
        half_foreign.clone(),
    ] {
        s.upsert_account(a).await.unwrap();
    }
    let rotating = cipher(NEW).with_previous(cipher(OLD));

    let first = rekey::walk(&**s, &rotating, 3).await.unwrap();
    assert_eq!(
        first,
        Walk {
            read: 5,
            moved: 3,
            left: 0,
            unreadable: 1
        }
    );
    // Every readable token now reads with the new key alone, as it was.
    let new_only = cipher(NEW);
    for name in ["a@x.com", "b@x.com", "c@x.com"] {
        let a = s
            .get_account(&user("u1"), Integration::Gmail, name)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            new_only.decrypt(&a.access_token, &row(name)).unwrap(),
            format!("access-{name}")
        );
        let refresh = a
            .refresh_token
            .map(|t| new_only.decrypt(&t, &row(name)).unwrap());
        let expected = (name != "c@x.com").then(|| format!("refresh-{name}"));
        assert_eq!(refresh, expected, "{name}");
    }
    let left = s
        .get_account(&user("u1"), Integration::Gmail, "d@x.com")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left, foreign, "a token under neither key is left as stored");
    let half = s
        .get_account(&user("u1"), Integration::Gmail, "e@x.com")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        new_only
            .decrypt(&half.access_token, &row("e@x.com"))
            .unwrap(),
        "access-e@x.com"
    );
    assert_eq!(
        half.refresh_token, half_foreign.refresh_token,
        "the token under neither key is left as stored beside the one moved"
    );

    let second = rekey::walk(&**s, &rotating, 3).await.unwrap();
    assert!(second.found_none(), "{second:?}");
    assert_eq!((second.read, second.unreadable), (5, 2));
}

async fn an_account_lock_is_exclusive_until_saved(b: Backend) {
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let first = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    let s2 = s.clone();
    let second = tokio::spawn(async move {
        let lock = s2
            .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap();
        lock.current().unwrap().access_token.clone()
    });
    // The second waiter cannot get in while the first holds the row.
    tokio::task::yield_now().await;
    assert!(!second.is_finished());
    let mut updated = first.current().unwrap().clone();
    updated.access_token = vec![9, 9];
    assert_eq!(first.save(updated).await.unwrap(), Saved::Applied);
    assert_eq!(
        second.await.unwrap(),
        vec![9, 9],
        "the waiter sees the winner's write"
    );
}

/// A refresh that finishes after the user reconnected or disconnected the account does not
/// overwrite that: the new tokens stay, and a disconnected account does not come back.
async fn a_refresh_saved_after_a_reconnect_or_a_disconnect_changes_nothing(b: Backend) {
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let refreshing = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    let mut reconnected = account("u1", "a@x.com");
    reconnected.access_token = vec![7, 7];
    s.upsert_account(reconnected).await.unwrap();
    let mut refreshed = refreshing.current().unwrap().clone();
    refreshed.access_token = vec![9, 9];
    assert_eq!(
        refreshing.save(refreshed.clone()).await.unwrap(),
        Saved::Superseded,
        "the save says it lost"
    );
    let now = s
        .get_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(now.access_token, vec![7, 7], "the reconnect's tokens stay");

    let refreshing = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    assert!(
        s.delete_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
    );
    assert_eq!(
        refreshing.save(refreshed).await.unwrap(),
        Saved::Superseded,
        "a disconnected account is not brought back"
    );
    assert!(
        s.get_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
            .is_none(),
        "a disconnected account does not come back"
    );
}

async fn a_dropped_lock_releases_without_writing(b: Backend) {
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    drop(
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap(),
    );
    let again = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com"),
    )
    .await
    .expect("the lock was released")
    .unwrap();
    assert_eq!(again.current().unwrap().access_token, vec![1, 2, 3]);
}

/// G-8: a refresh whose save fails (here PostgreSQL refuses a NUL in a scope) frees the
/// account at once for callers: the next one does not wait out the refresh hold, and finds
/// the row as it was. The save had been sent, and a lock cannot tell a refused save from one
/// whose answer was lost and may still land, so its lease is left lapsed as of the failure,
/// not freed: background work keeps off the account as it does after any lapse.
#[tokio::test]
async fn g8_on_postgres_a_refresh_whose_save_fails_frees_the_account_at_once() {
    let b = postgres().await;
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let lock = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    let mut refreshed = lock.current().unwrap().clone();
    refreshed.access_token = vec![9, 9, 9];
    refreshed.scopes = vec!["gmail\0readonly".into()];
    let before_the_save = SystemTime::now();
    assert!(
        lock.save(refreshed).await.is_err(),
        "the database refused it"
    );
    let lapsed = let_go(&connect(&b).await)
        .await
        .expect("a save that was sent leaves its lease lapsed, not freed");
    assert!(
        lapsed >= before_the_save && lapsed <= SystemTime::now(),
        "lapsed as of the failure: {lapsed:?}"
    );
    assert!(
        walk_lock(&s).await.is_none(),
        "background work keeps off an account whose save may still land"
    );
    let again = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com"),
    )
    .await
    .expect("the failed save let go of the account")
    .unwrap();
    assert_eq!(again.current().unwrap().access_token, vec![1, 2, 3]);
}

/// G-8: a refresh whose lease lapsed mid-call (the token endpoint slow, the process paused)
/// and was taken over still saves what it got while the taker has saved nothing — a refresh
/// token the provider rotated is not lost —, and the taker's later save, made from the tokens
/// as they were, changes nothing but lets go of its lease at once.
#[tokio::test]
async fn g8_on_postgres_a_refresh_whose_lease_lapsed_still_saves_and_the_takers_stale_save_does_not()
 {
    let b = postgres().await;
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let slow = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    lapse_every_lease(&b).await;
    let taker = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com"),
    )
    .await
    .expect("a lapsed lease is taken over at once")
    .unwrap();

    let mut rotated = slow.current().unwrap().clone();
    rotated.access_token = vec![9, 9];
    rotated.refresh_token = Some(vec![6, 6]);
    assert_eq!(slow.save(rotated).await.unwrap(), Saved::Applied);
    let stored = || async {
        s.get_account(&user("u1"), Integration::Gmail, "a@x.com")
            .await
            .unwrap()
            .unwrap()
    };
    assert_eq!(
        (stored().await.access_token, stored().await.refresh_token),
        (vec![9, 9], Some(vec![6, 6])),
        "the lapsed refresh's tokens are saved"
    );

    let mut stale = taker.current().unwrap().clone();
    stale.access_token = vec![8, 8];
    assert_eq!(taker.save(stale).await.unwrap(), Saved::Superseded);
    assert_eq!(
        stored().await.access_token,
        vec![9, 9],
        "the taker's save, from tokens since replaced, changes nothing"
    );
    let next = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com"),
    )
    .await
    .expect("the taker let go of its lease")
    .unwrap();
    assert_eq!(next.current().unwrap().refresh_token, Some(vec![6, 6]));
}

/// G-8: a walk whose own lease lapsed before it saved (its save held up) and was taken over by
/// a refresh saves nothing: the refresh's tokens, saved after, are the account's.
#[tokio::test]
async fn g8_on_postgres_a_walks_save_after_a_refresh_took_over_its_lease_does_not_land() {
    let b = postgres().await;
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let walk = walk_lock(&s).await.expect("idle");
    lapse_every_lease(&b).await;
    let refresh = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();

    let mut moved = walk.current().unwrap().clone();
    moved.access_token = vec![7, 7];
    assert_eq!(walk.save(moved).await.unwrap(), Saved::Superseded);
    let mut fresh = refresh.current().unwrap().clone();
    fresh.access_token = vec![9, 9];
    fresh.refresh_token = Some(vec![6, 6]);
    assert_eq!(refresh.save(fresh).await.unwrap(), Saved::Applied);
    let stored = s
        .get_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (stored.access_token, stored.refresh_token),
        (vec![9, 9], Some(vec![6, 6]))
    );
}

/// G-8: a caller that took over a lapsed lease and let it go unsaved (its call cancelled, its
/// refresh failed) gives the lease back to the lapse it took over, not free: background work
/// still leaves the account to the refresh that may yet save, while callers take it at once.
#[tokio::test]
async fn g8_on_postgres_a_lease_taken_over_and_let_go_keeps_background_work_off_the_first_refresh()
{
    let b = postgres().await;
    let s = b.stores.accounts.clone();
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let slow = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    let sql = lapse_every_lease(&b).await;
    let lapse: SystemTime = sql
        .query_one("SELECT refresh_until FROM gateway.accounts", &[])
        .await
        .unwrap()
        .get(0);
    let taker = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    drop(taker);
    let given_back = let_go(&sql).await;
    assert_eq!(given_back, Some(lapse), "back to the lapse it took over");
    assert!(
        walk_lock(&s).await.is_none(),
        "background work leaves it to the refresh that may still save"
    );
    let caller = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        s.lock_account(&user("u1"), Integration::Gmail, "a@x.com"),
    )
    .await
    .expect("a caller takes a lapsed lease at once, as before")
    .unwrap();
    drop(caller);

    let mut fresh = slow.current().unwrap().clone();
    fresh.access_token = vec![9, 9];
    assert_eq!(slow.save(fresh).await.unwrap(), Saved::Applied);
}

/// u1's account as background work (a rotation walk) takes it: `None` while it keeps off.
async fn walk_lock(
    s: &Arc<dyn gateway_svc::store::AccountStore>,
) -> Option<Box<dyn gateway_svc::store::AccountLock>> {
    s.lock_account_if_idle(
        &user("u1"),
        Integration::Gmail,
        "a@x.com",
        rekey::ABANDONED_AFTER,
    )
    .await
    .unwrap()
}

/// The lone account's `refresh_until` once its lease has no holder: a dropped lock lets go in
/// a task it spawns, so this waits for that task's write.
async fn let_go(sql: &tokio_postgres::Client) -> Option<SystemTime> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let row = sql
            .query_one(
                "SELECT refresh_holder, refresh_until FROM gateway.accounts",
                &[],
            )
            .await
            .unwrap();
        if row.get::<_, Option<String>>(0).is_none() {
            return row.get(1);
        }
        assert!(tokio::time::Instant::now() < deadline, "never let go");
        tokio::task::yield_now().await;
    }
}

/// Every account's refresh lease lapsed a second ago, as if its refresh had outlived it; the
/// connection that lapsed them is returned for the test's own reads.
async fn lapse_every_lease(b: &Backend) -> tokio_postgres::Client {
    let sql = connect(b).await;
    sql.execute(
        "UPDATE gateway.accounts SET refresh_until = now() - interval '1 second'",
        &[],
    )
    .await
    .unwrap();
    sql
}

async fn connect(b: &Backend) -> tokio_postgres::Client {
    let (sql, conn) = tokio_postgres::connect(b._db.as_ref().unwrap().url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    sql
}

/// G-8: a key rotation's walk never supersedes a refresh. An account being refreshed — even
/// one whose lease has just lapsed, its refresh still about to save — is left for the next
/// walk, so the refresh's fresh tokens, and the refresh token the provider rotated, are saved
/// (under the new key). Only a lease a dead replica left long ago is taken over.
#[tokio::test]
async fn g8_on_postgres_a_rotation_walk_leaves_an_account_being_refreshed_to_its_refresh() {
    const OLD: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
    const NEW: &str = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk=";
    let cipher = |key: &str| TokenCipher::from_base64(key).unwrap();
    let b = postgres().await;
    let s = b.stores.accounts.clone();
    let row = |name: &str| format!("u1/gmail/{name}");
    for name in ["a@x.com", "dead@x.com"] {
        s.upsert_account(StoredAccount {
            access_token: cipher(OLD).encrypt("expired-access", &row(name)).unwrap(),
            refresh_token: Some(cipher(OLD).encrypt("first-refresh", &row(name)).unwrap()),
            expires_at: Some(SystemTime::now()),
            ..account("u1", name)
        })
        .await
        .unwrap();
    }
    let oauth = FakeOAuth::start().await;
    oauth
        .state
        .rotate
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let rotating = cipher(NEW).with_previous(cipher(OLD));
    let credentials = Credentials::new(
        s.clone(),
        Some(rotating.clone()),
        Some(OAuthClient {
            token_url: oauth.url.clone(),
            client_id: "client-id".into(),
            client_secret: "client-secret".to_owned().into(),
        }),
        reqwest::Client::new(),
    );

    let mut held = oauth.hold_next_refresh();
    let refreshing = tokio::spawn(async move {
        credentials
            .access_token(&user("u1"), Integration::Gmail, "a@x.com", None)
            .await
    });
    held.arrived().await;
    // The refresh has held a@ past its lease; dead@'s lease was left by a replica that died
    // two hours ago.
    let sql = connect(&b).await;
    sql.batch_execute(
        "UPDATE gateway.accounts SET refresh_until = now() - interval '1 second' WHERE account = 'a@x.com'; \
         UPDATE gateway.accounts SET refresh_holder = 'dead', refresh_until = now() - interval '2 hours' WHERE account = 'dead@x.com';",
    )
    .await
    .unwrap();
    let walk = rekey::walk(&*s, &rotating, 10).await.unwrap();
    assert_eq!(
        (walk.moved, walk.left),
        (1, 1),
        "the dead replica's account moved, the one being refreshed left: {walk:?}"
    );

    held.release();
    assert_eq!(
        refreshing.await.unwrap().unwrap(),
        "fresh-access-1",
        "the call has its fresh token"
    );
    let stored = s
        .get_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap()
        .unwrap();
    let new_only = cipher(NEW);
    assert_eq!(
        (
            new_only
                .decrypt(&stored.access_token, &row("a@x.com"))
                .unwrap(),
            new_only
                .decrypt(stored.refresh_token.as_deref().unwrap(), &row("a@x.com"))
                .unwrap(),
        ),
        ("fresh-access-1".to_owned(), "rotated-refresh-1".to_owned()),
        "the refresh's tokens are stored, under the new key"
    );
    assert!(
        rekey::walk(&*s, &rotating, 10).await.unwrap().found_none(),
        "nothing is left under the old key"
    );
}

/// G-8: background work takes an account only when nobody is refreshing it, and never waits.
async fn an_account_being_refreshed_is_not_locked_for_background_work(b: Backend) {
    let s = &b.stores.accounts;
    s.upsert_account(account("u1", "a@x.com")).await.unwrap();
    let u1 = user("u1");
    let idle =
        || s.lock_account_if_idle(&u1, Integration::Gmail, "a@x.com", rekey::ABANDONED_AFTER);
    let refreshing = s
        .lock_account(&user("u1"), Integration::Gmail, "a@x.com")
        .await
        .unwrap();
    let left = tokio::time::timeout(std::time::Duration::from_secs(1), idle())
        .await
        .expect("left at once, never waited for");
    assert!(left.unwrap().is_none(), "being refreshed: left");
    drop(refreshing);
    // The memory lock frees at once; PostgreSQL's lease is freed by a task the drop spawns.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    let taken = loop {
        if let Some(lock) = idle().await.unwrap() {
            break lock;
        }
        assert!(tokio::time::Instant::now() < deadline, "never let go");
        tokio::task::yield_now().await;
    };
    assert_eq!(taken.current().unwrap().account, "a@x.com");
    assert!(idle().await.unwrap().is_none(), "held by the walk now");

    // An account gone since it was listed is a lock on nothing, as `lock_account` gives: not
    // one left for the next walk.
    let gone = s
        .lock_account_if_idle(
            &u1,
            Integration::Gmail,
            "gone@x.com",
            rekey::ABANDONED_AFTER,
        )
        .await
        .unwrap()
        .expect("nobody holds what does not exist");
    assert!(gone.current().is_none());
}

async fn account_locks_held_during_refreshes_pin_no_connection(b: Backend) {
    let s = &b.stores.accounts;
    let mut held = Vec::new();
    // As many refreshes in flight as the PostgreSQL pool has connections (8).
    for i in 0..8 {
        let name = format!("r{i}@x.com");
        s.upsert_account(account("u1", &name)).await.unwrap();
        held.push(
            s.lock_account(&user("u1"), Integration::Gmail, &name)
                .await
                .unwrap(),
        );
    }
    let listed = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        s.list_accounts(&user("u1")),
    )
    .await
    .expect("the store answers while eight refreshes hold their accounts")
    .unwrap();
    assert_eq!(listed.len(), 8);
    drop(held);
}

async fn an_idempotency_key_replays_its_first_result(b: Backend) {
    let s = &b.stores.idempotency;
    let mut claim = s.claim(&user("u1"), "k1", HOLD).await.unwrap();
    assert!(claim.existing().is_none());
    let stored = StoredResult {
        tool: "send".into(),
        args_sha256: "abc".into(),
        outcome: serde_json::json!({"text": "sent"}),
    };
    claim.complete(&stored).await.unwrap();
    assert_eq!(
        s.lookup(&user("u1"), "k1").await.unwrap(),
        KeyState::Done(stored.clone())
    );
    assert_eq!(
        s.claim(&user("u1"), "k1", HOLD).await.unwrap().existing(),
        Some(&stored)
    );
    assert!(
        s.claim(&user("u2"), "k1", HOLD)
            .await
            .unwrap()
            .existing()
            .is_none(),
        "keys are per user"
    );
}

async fn a_held_key_makes_a_second_claim_wait_for_its_result_and_a_dropped_one_frees_it(
    b: Backend,
) {
    let s = b.stores.idempotency.clone();
    let mut first = s.claim(&user("u1"), "k2", HOLD).await.unwrap();
    assert!(first.existing().is_none());
    // As many calls in flight as the PostgreSQL pool has connections (8), and the store still
    // answers at once: a claim pins no connection while its call runs upstream.
    let mut held = Vec::new();
    for i in 0..8 {
        held.push(
            s.claim(&user("u1"), &format!("busy-{i}"), HOLD)
                .await
                .unwrap(),
        );
    }
    let answered = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        s.lookup(&user("u1"), "busy-0"),
    )
    .await
    .expect("the store answers while eight calls hold their keys")
    .unwrap();
    assert_eq!(
        answered,
        KeyState::Running,
        "a pending call has no result yet, and may still answer"
    );
    drop(held);
    let waiting = {
        let s = s.clone();
        tokio::spawn(async move {
            s.claim(&user("u1"), "k2", HOLD)
                .await
                .map(|c| c.existing().cloned())
        })
    };
    let stored = StoredResult {
        tool: "send".into(),
        args_sha256: "abc".into(),
        outcome: serde_json::json!({"text": "sent once"}),
    };
    first.complete(&stored).await.unwrap();
    assert_eq!(
        waiting.await.unwrap().unwrap(),
        Some(stored),
        "the second call replays the first one's result instead of acting again"
    );

    // A claim let go without a result (nothing reached upstream) leaves the key free.
    let given_up = s.claim(&user("u1"), "k3", HOLD).await.unwrap();
    drop(given_up);
    let again = tokio::time::timeout(HOLD, s.claim(&user("u1"), "k3", HOLD))
        .await
        .expect("the key was freed, not left until its hold lapsed")
        .unwrap();
    assert!(again.existing().is_none());
    assert_eq!(
        s.lookup(&user("u1"), "k4").await.unwrap(),
        KeyState::Free,
        "a key no call took"
    );
    // A key still held past the waiter's own patience: a clear error, not a second action.
    let err = s
        .claim(&user("u1"), "k3", std::time::Duration::from_millis(200))
        .await
        .err()
        .expect("still held")
        .to_string();
    assert!(err.contains("still in progress"), "{err}");
}

async fn audit_records_come_back_in_order_per_user(b: Backend) {
    let s = &b.stores.audit;
    for (u, call) in [("u1", "c1"), ("u2", "c2"), ("u1", "c3")] {
        s.record(AuditRecord {
            user: u.into(),
            kind: "tool_call".into(),
            tool: "t".into(),
            integration: None,
            account: None,
            call_id: call.into(),
            run_id: None,
            status: "ok".into(),
            latency_ms: 1,
            bytes: 2,
            upstream_calls: 0,
        })
        .await
        .unwrap();
    }
    let calls: Vec<_> = s
        .recent(&user("u1"), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.call_id)
        .collect();
    assert_eq!(calls, ["c1", "c3"]);
}

async fn rate_limits_allow_exactly_the_limit_then_name_the_wait(b: Backend) {
    let key = LimitKey {
        user: user("u1"),
        integration: Integration::Gmail,
        account: "a@x.com".into(),
    };
    let limits = Limits::google_default();
    let now = 1_000_000_020 + 18;
    let mut allowed = 0;
    for _ in 0..35 {
        if matches!(
            b.limits.charge(&key, &limits, 1, now).await.unwrap(),
            Decision::Allowed(_)
        ) {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 30);
    let denied = b.limits.charge(&key, &limits, 1, now).await.unwrap();
    assert_eq!(
        denied,
        Decision::Denied {
            window: Window::Minute,
            limit: 30,
            retry_after: std::time::Duration::from_secs(42)
        }
    );
    // The next minute has room again; the hour keeps counting.
    match b.limits.charge(&key, &limits, 5, now + 60).await.unwrap() {
        Decision::Allowed(usage) => assert!(
            usage
                .iter()
                .any(|u| u.window == Window::Hour && u.used == 35)
        ),
        other => panic!("{other:?}"),
    }
}

/// Two replicas whose clocks straddle a minute's boundary: the one ahead opens the next window
/// and the one behind charges into it instead of rolling it back (which wiped its count at
/// every boundary, and let a user past the limit while the clocks disagreed).
async fn g6_a_replica_whose_clock_lags_never_rolls_a_window_back(b: Backend) {
    let key = LimitKey {
        user: user("u1"),
        integration: Integration::Gmail,
        account: "a@x.com".into(),
    };
    let limits: Limits = "30/minute".parse().unwrap();
    let behind = 1_000_000_079; // the last second of a minute here
    let ahead = behind + 2; // two seconds into the next on the other replica
    let mut allowed = 0;
    for i in 0..40 {
        let now = if i % 2 == 0 { ahead } else { behind };
        if matches!(
            b.limits.charge(&key, &limits, 1, now).await.unwrap(),
            Decision::Allowed(_)
        ) {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 30, "one window, however the clocks alternate");
}

/// The replica behind reserves into the window the one ahead opened; what its reservation did
/// not use goes back to that window, not to the one its own clock names (where it was lost).
async fn g6_a_lagging_replicas_refund_goes_back_to_the_windows_it_charged(b: Backend) {
    let key = LimitKey {
        user: user("u1"),
        integration: Integration::Gmail,
        account: "a@x.com".into(),
    };
    let limits: Limits = "30/minute".parse().unwrap();
    let behind = 1_000_000_079;
    let ahead = behind + 2;
    let opened = b.limits.charge(&key, &limits, 1, ahead).await.unwrap();
    assert!(matches!(opened, Decision::Allowed(_)));
    let search = b.limits.charge(&key, &limits, 10, behind).await.unwrap();
    assert_eq!(
        search.charged(),
        opened.charged(),
        "the lagging replica charged the window already open"
    );
    b.limits.refund(&key, 8, &search.charged()).await.unwrap();
    // 1 + 10 - 8 = 3 used: 27 left, and not one more.
    assert!(matches!(
        b.limits.charge(&key, &limits, 27, ahead).await.unwrap(),
        Decision::Allowed(_)
    ));
    assert!(matches!(
        b.limits.charge(&key, &limits, 1, ahead).await.unwrap(),
        Decision::Denied { .. }
    ));
}

async fn tasks_are_listed_pending_first_by_due_date_and_scoped_to_their_user(b: Backend) {
    let s = &b.stores.tasks;
    let at = |secs| Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs));
    let undated = s
        .add_task(&user("u1"), "undated", None, None)
        .await
        .unwrap();
    let later = s
        .add_task(&user("u1"), "later", Some("details"), at(2_000_000_000))
        .await
        .unwrap();
    let sooner = s
        .add_task(&user("u1"), "sooner", None, at(1_900_000_000))
        .await
        .unwrap();
    s.add_task(&user("u2"), "not mine", None, None)
        .await
        .unwrap();
    let titles = |tasks: Vec<gateway_svc::store::Task>| {
        tasks.into_iter().map(|t| t.title).collect::<Vec<_>>()
    };
    assert_eq!(
        titles(
            s.list_tasks(&user("u1"), TaskFilter::Pending)
                .await
                .unwrap()
        ),
        ["sooner", "later", "undated"]
    );

    let done = TaskPatch {
        completed: Some(true),
        ..TaskPatch::default()
    };
    assert!(
        s.update_task(&user("u2"), sooner.id, done.clone())
            .await
            .unwrap()
            .is_none(),
        "another user's task is not found"
    );
    let completed = s
        .update_task(&user("u1"), sooner.id, done)
        .await
        .unwrap()
        .unwrap();
    assert!(completed.completed_at.is_some());
    assert_eq!(
        titles(
            s.list_tasks(&user("u1"), TaskFilter::Completed)
                .await
                .unwrap()
        ),
        ["sooner"]
    );
    assert_eq!(
        titles(s.list_tasks(&user("u1"), TaskFilter::All).await.unwrap()),
        ["later", "undated", "sooner"]
    );

    let patch = TaskPatch {
        title: Some("renamed".into()),
        description: Some(None),
        due_at: Some(None),
        completed: None,
    };
    let renamed = s
        .update_task(&user("u1"), later.id, patch)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            renamed.title.as_str(),
            renamed.description.clone(),
            renamed.due_at
        ),
        ("renamed", None, None)
    );
    assert!(
        s.delete_task(&user("u2"), undated.id)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        s.delete_task(&user("u1"), undated.id)
            .await
            .unwrap()
            .unwrap()
            .title,
        "undated"
    );
    assert!(
        s.delete_task(&user("u1"), undated.id)
            .await
            .unwrap()
            .is_none()
    );
}

async fn memory_search_ranks_the_relevant_note_first(b: Backend) {
    let s = &b.stores.notes;
    let notes = [
        (
            "Prefers meetings after 10am and hates Monday mornings".to_owned(),
            vec!["schedule".to_owned()],
        ),
        (
            "Daughter Ana plays soccer on Tuesdays and Thursdays".to_owned(),
            vec!["family".to_owned()],
        ),
        (
            "Works at Acme as a product manager for the billing team".to_owned(),
            vec!["work".to_owned()],
        ),
    ];
    s.add_notes(&user("u1"), &notes, "").await.unwrap();
    s.add_notes(
        &user("u2"),
        &[("Ana is my manager at soccer club".to_owned(), vec![])],
        "read by search_gmail in run r1",
    )
    .await
    .unwrap();
    let first = |found: Vec<gateway_svc::store::Note>| {
        found.first().map(|n| n.content.clone()).unwrap_or_default()
    };
    assert!(
        first(s.search_notes(&user("u1"), "soccer", 5).await.unwrap()).starts_with("Daughter Ana")
    );
    assert!(
        first(s.search_notes(&user("u1"), "meeting", 5).await.unwrap())
            .starts_with("Prefers meetings")
    );
    assert!(
        first(
            s.search_notes(&user("u1"), "where does she work", 5)
                .await
                .unwrap()
        )
        .starts_with("Works at Acme")
    );
    // A half-typed word still finds its note.
    assert!(
        first(s.search_notes(&user("u1"), "bill", 5).await.unwrap()).starts_with("Works at Acme")
    );
    assert!(
        first(s.search_notes(&user("u1"), "family", 5).await.unwrap()).starts_with("Daughter Ana"),
        "tags are searched"
    );
    let theirs = s.search_notes(&user("u2"), "soccer", 5).await.unwrap();
    assert_eq!(theirs.len(), 1, "another user's notes never appear");
    assert!(
        s.search_notes(&user("u1"), "zebra", 5)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(s.count_notes(&user("u1")).await.unwrap(), 3);
}

async fn reminders_come_back_soonest_first_and_only_upcoming(b: Backend) {
    let s = &b.stores.reminders;
    let at = |secs| SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    s.add_reminder(&user("u1"), "past", at(1_000))
        .await
        .unwrap();
    s.add_reminder(&user("u1"), "later", at(3_000))
        .await
        .unwrap();
    s.add_reminder(&user("u1"), "sooner", at(2_000))
        .await
        .unwrap();
    s.add_reminder(&user("u2"), "theirs", at(2_500))
        .await
        .unwrap();
    let upcoming = s
        .upcoming_reminders(&user("u1"), at(1_500), 10)
        .await
        .unwrap();
    assert_eq!(
        upcoming.iter().map(|r| r.text.as_str()).collect::<Vec<_>>(),
        ["sooner", "later"]
    );
    assert_eq!(s.count_reminders(&user("u1")).await.unwrap(), 3);
}

async fn g15_mcp_switches_are_per_user_and_turning_on_removes_only_that_switch(b: Backend) {
    let s = &b.stores.mcp_switches;
    let server = McpSwitch {
        server: "docs".into(),
        tool: None,
    };
    let search = McpSwitch {
        server: "docs".into(),
        tool: Some("search".into()),
    };
    s.set_mcp_enabled(&user("u1"), &search, false)
        .await
        .unwrap();
    s.set_mcp_enabled(&user("u1"), &search, false)
        .await
        .unwrap();
    s.set_mcp_enabled(&user("u1"), &server, false)
        .await
        .unwrap();
    assert_eq!(
        s.disabled_mcp(&user("u1")).await.unwrap(),
        [server.clone(), search.clone()]
    );
    assert!(s.disabled_mcp(&user("u2")).await.unwrap().is_empty());
    s.set_mcp_enabled(&user("u1"), &server, true).await.unwrap();
    assert_eq!(
        s.disabled_mcp(&user("u1")).await.unwrap(),
        std::slice::from_ref(&search)
    );
    s.set_mcp_enabled(&user("u1"), &search, true).await.unwrap();
    assert!(s.disabled_mcp(&user("u1")).await.unwrap().is_empty());
}

steward_tests::both_backends!(
    accounts_are_scoped_to_their_user_and_round_trip,
    an_account_lock_is_exclusive_until_saved,
    an_account_being_refreshed_is_not_locked_for_background_work,
    accounts_are_sampled_by_when_they_were_saved,
    every_account_is_walked_once_a_page_at_a_time,
    g8_a_rotation_walk_moves_every_token_under_the_previous_key_to_the_current_one,
    a_dropped_lock_releases_without_writing,
    a_refresh_saved_after_a_reconnect_or_a_disconnect_changes_nothing,
    account_locks_held_during_refreshes_pin_no_connection,
    an_idempotency_key_replays_its_first_result,
    a_held_key_makes_a_second_claim_wait_for_its_result_and_a_dropped_one_frees_it,
    audit_records_come_back_in_order_per_user,
    rate_limits_allow_exactly_the_limit_then_name_the_wait,
    g6_a_replica_whose_clock_lags_never_rolls_a_window_back,
    g6_a_lagging_replicas_refund_goes_back_to_the_windows_it_charged,
    tasks_are_listed_pending_first_by_due_date_and_scoped_to_their_user,
    memory_search_ranks_the_relevant_note_first,
    reminders_come_back_soonest_first_and_only_upcoming,
    g15_mcp_switches_are_per_user_and_turning_on_removes_only_that_switch,
);

/// a claim let go without its result (storing the result kept failing) leaves the key
/// held, answering "held" to lookups, until its hold lapses; only then may another call take
/// it over, and only because this one never marked a write (a claim that did is never taken
/// over: gateway-svc's own tests cover that, and the memory store's alike behaviour).
#[tokio::test]
async fn r3_on_postgres_an_abandoned_claim_keeps_its_key_held_until_its_hold_lapses() {
    let b = postgres().await;
    let s = &b.stores.idempotency;
    let short = std::time::Duration::from_millis(300);
    let claim = s.claim(&user("u1"), "sent-maybe", short).await.unwrap();
    claim.abandon();
    assert_eq!(
        s.lookup(&user("u1"), "sent-maybe").await.unwrap(),
        KeyState::Running,
        "a hold let go looks like a running one until it lapses"
    );
    let later = s
        .claim(&user("u1"), "sent-maybe", HOLD)
        .await
        .expect("taken over once the abandoned hold lapsed");
    assert!(later.existing().is_none());
}

/// the reads every run makes (accounts, memory, tasks), asked by many users at once, go
/// to PostgreSQL as a few statements, and each user gets its own rows and only those.
#[tokio::test]
async fn q2_reads_of_many_users_at_once_share_statements_and_each_gets_only_its_own_rows() {
    use gateway_svc::store::{AccountStore, NoteStore, TaskStore};
    let db = TestDb::create().await.unwrap();
    let store = PgStore::connect(&config(&db)).await.unwrap();
    let users: Vec<UserId> = (0..40).map(|i| user(&format!("reader-{i}"))).collect();
    for (i, u) in users.iter().enumerate() {
        store
            .add_task(u, &format!("task {i}"), None, None)
            .await
            .unwrap();
        if i % 2 == 0 {
            let mut a = account(u.as_str(), &format!("mail-{i}"));
            a.user = u.clone();
            store.upsert_account(a).await.unwrap();
        }
        let note = (format!("reader {i} drinks green tea"), vec![]);
        store.add_notes(u, &[note], "").await.unwrap();
    }
    let before = store.read_counts();

    // All asked before any is answered: one task polls them all first.
    let answers = futures_util::future::join_all(users.iter().map(|u| async {
        let (tasks, accounts, notes) = tokio::join!(
            store.list_tasks(u, TaskFilter::All),
            store.list_accounts(u),
            store.search_notes(u, "tea", 5),
        );
        (tasks.unwrap(), accounts.unwrap(), notes.unwrap())
    }))
    .await;

    for (i, (tasks, accounts, notes)) in answers.into_iter().enumerate() {
        let titles: Vec<_> = tasks.iter().map(|t| t.title.as_str()).collect();
        assert_eq!(titles, [format!("task {i}")], "reader-{i}'s tasks");
        let names: Vec<_> = accounts.iter().map(|a| a.account.clone()).collect();
        let expected: Vec<String> = if i % 2 == 0 {
            vec![format!("mail-{i}")]
        } else {
            vec![]
        };
        assert_eq!(names, expected, "reader-{i}'s accounts");
        assert!(accounts.iter().all(|a| a.user == users[i]));
        let contents: Vec<_> = notes.iter().map(|n| n.content.as_str()).collect();
        assert_eq!(
            contents,
            [format!("reader {i} drinks green tea")],
            "reader-{i}'s memory"
        );
    }
    let after = store.read_counts();
    assert_eq!(
        after.written - before.written,
        120,
        "every read was answered"
    );
    assert!(
        after.statements - before.statements <= 6,
        "120 reads of three kinds, one reader per kind taking up to 32: {} statements",
        after.statements - before.statements
    );
    assert_eq!(after.batches_retried, 0);
}

/// a read whose input the database refuses fails alone; the reads grouped with it are
/// read again one by one and answered.
#[tokio::test]
async fn q2_a_read_the_database_refuses_fails_alone_not_its_batch() {
    use gateway_svc::store::NoteStore;
    let db = TestDb::create().await.unwrap();
    let store = PgStore::connect(&config(&db)).await.unwrap();
    let (u1, u2) = (user("tea-drinker"), user("coffee-drinker"));
    store
        .add_notes(&u1, &[("likes tea".to_owned(), vec![])], "")
        .await
        .unwrap();
    store
        .add_notes(&u2, &[("likes coffee".to_owned(), vec![])], "")
        .await
        .unwrap();

    // PostgreSQL text cannot hold a NUL: the whole array parameter is refused.
    let (tea, refused, coffee) = tokio::join!(
        store.search_notes(&u1, "tea", 5),
        store.search_notes(&u1, "te\0a", 5),
        store.search_notes(&u2, "coffee", 5),
    );

    assert_eq!(tea.unwrap()[0].content, "likes tea");
    assert_eq!(coffee.unwrap()[0].content, "likes coffee");
    let refused = refused.unwrap_err().to_string();
    assert!(
        refused.contains("0x00"),
        "the database's own words: {refused}"
    );
    let counts = store.read_counts();
    assert_eq!(counts.batches_retried, 1, "{counts:?}");
    assert_eq!(
        counts.statements, 4,
        "the batch, then each alone: {counts:?}"
    );
}

/// a row that does not decode (here a task title made NULL under the service) fails
/// only the read it belongs to, with an error naming the column; the reads grouped with it
/// are answered, and the reader goes on serving.
#[tokio::test]
async fn q2_a_row_that_does_not_decode_fails_only_its_own_read() {
    use gateway_svc::store::TaskStore;
    let db = TestDb::create().await.unwrap();
    let store = PgStore::connect(&config(&db)).await.unwrap();
    let (good, bad, other) = (user("decodes"), user("does-not"), user("decodes-too"));
    for u in [&good, &bad, &other] {
        store.add_task(u, "a task", None, None).await.unwrap();
    }
    let side = steward_tests::db::connect(&db).await;
    side.batch_execute(&format!(
        "ALTER TABLE gateway.tasks ALTER COLUMN title DROP NOT NULL; \
         UPDATE gateway.tasks SET title = NULL WHERE user_id = '{}'",
        bad.as_str()
    ))
    .await
    .unwrap();

    let before = store.read_counts();
    let (first, broken, last) = tokio::join!(
        store.list_tasks(&good, TaskFilter::All),
        store.list_tasks(&bad, TaskFilter::All),
        store.list_tasks(&other, TaskFilter::All),
    );
    let after = store.read_counts();

    assert_eq!(first.unwrap()[0].title, "a task");
    assert_eq!(last.unwrap()[0].title, "a task");
    let broken = broken.unwrap_err().to_string();
    assert!(
        broken.contains("column title"),
        "names the column: {broken}"
    );
    assert_eq!(
        after.written - before.written,
        3,
        "all three were read: {after:?}"
    );
    assert!(
        after.statements - before.statements < 3,
        "some were read together: {after:?}"
    );
    // The reader that met the bad row still serves.
    let again = store.list_tasks(&good, TaskFilter::All).await.unwrap();
    assert_eq!(again.len(), 1);
}

/// reads grouped in one statement — different filters, limits, and a search only the
/// prefix pass answers — each get what the same read alone gets.
#[tokio::test]
async fn q2_a_grouped_read_answers_each_user_as_its_read_alone_would() {
    use gateway_svc::store::{NoteStore, TaskStore};
    let db = TestDb::create().await.unwrap();
    let store = PgStore::connect(&config(&db)).await.unwrap();
    let at = |secs| Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs));
    let (a, b) = (user("mixed-a"), user("mixed-b"));
    for u in [&a, &b] {
        for (title, due) in [
            ("later", at(2_000_000_000)),
            ("sooner", at(1_900_000_000)),
            ("undated", None),
        ] {
            store.add_task(u, title, None, due).await.unwrap();
        }
        let done = store.add_task(u, "done", None, None).await.unwrap();
        let patch = TaskPatch {
            completed: Some(true),
            ..TaskPatch::default()
        };
        store.update_task(u, done.id, patch).await.unwrap();
        let notes = [
            "green tea in the morning",
            "tennis on tuesdays",
            "tea with Ana",
        ]
        .map(|n| (n.to_owned(), vec![]));
        store.add_notes(u, &notes, "").await.unwrap();
    }
    let before = store.read_counts();

    let grouped = tokio::join!(
        store.list_tasks(&a, TaskFilter::Pending),
        store.list_tasks(&b, TaskFilter::Completed),
        store.list_tasks(&a, TaskFilter::All),
        store.search_notes(&a, "tea", 1),
        store.search_notes(&b, "tea", 5),
        store.search_notes(&a, "tenn", 5),
    );
    let grouped_statements = store.read_counts().statements - before.statements;
    let alone = (
        store.list_tasks(&a, TaskFilter::Pending).await.unwrap(),
        store.list_tasks(&b, TaskFilter::Completed).await.unwrap(),
        store.list_tasks(&a, TaskFilter::All).await.unwrap(),
        store.search_notes(&a, "tea", 1).await.unwrap(),
        store.search_notes(&b, "tea", 5).await.unwrap(),
        store.search_notes(&a, "tenn", 5).await.unwrap(),
    );

    assert_eq!(grouped_statements, 2, "one statement per kind of read");
    let titles = |tasks: &[gateway_svc::store::Task]| -> Vec<String> {
        tasks.iter().map(|t| t.title.clone()).collect()
    };
    let contents = |notes: &[gateway_svc::store::Note]| -> Vec<String> {
        notes.iter().map(|n| n.content.clone()).collect()
    };
    assert_eq!(titles(&grouped.0.unwrap()), titles(&alone.0));
    assert_eq!(titles(&alone.0), ["sooner", "later", "undated"]);
    assert_eq!(titles(&grouped.1.unwrap()), ["done"]);
    assert_eq!(titles(&alone.1), ["done"]);
    assert_eq!(titles(&grouped.2.unwrap()), titles(&alone.2));
    assert_eq!(alone.2.len(), 4);
    assert_eq!(contents(&grouped.3.unwrap()), contents(&alone.3));
    assert_eq!(alone.3.len(), 1, "a limit of one");
    assert_eq!(contents(&grouped.4.unwrap()), contents(&alone.4));
    assert_eq!(alone.4.len(), 2, "both tea notes");
    assert_eq!(contents(&grouped.5.unwrap()), contents(&alone.5));
    assert_eq!(
        contents(&alone.5),
        ["tennis on tuesdays"],
        "found by the prefix pass"
    );
}
