//! G-8, I-1: an account that needs reconnecting is never left out quietly. A call over every
//! account says which it could not use; a call naming it is told it needs reconnecting.

mod common;

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use common::{
    upstream::{Answer, Upstream},
    user,
};
use gateway_svc::{
    credentials::NewAccount,
    domain::{ErrorKind, Integration, UserId},
    engine::Engine,
    integrations::{
        calendar::{self, CalendarApi},
        gmail::{self, GmailApi},
        slack::{self, SlackApi},
    },
    store::{
        AccountCursor, AccountLock, AccountStore, StoreError, StoredAccount, memory::MemoryStore,
    },
};
use serde_json::json;

/// Gmail and Calendar, each with `work@example.com` connected and `home@example.com` needing
/// reconnecting; every search finds nothing.
async fn engine_with_one_account_to_reconnect() -> (Engine, Upstream) {
    let upstream =
        Upstream::start(|_, _| Answer::Status(200, r#"{"messages": [], "items": []}"#)).await;
    let stores = MemoryStore::stores();
    let mut tools = gmail::tools(GmailApi {
        base_url: upstream.base_url.clone(),
    });
    tools.extend(calendar::tools(CalendarApi {
        base_url: upstream.base_url.clone(),
    }));
    let engine = common::engine(&stores, tools);
    for integration in [Integration::Gmail, Integration::GoogleCalendar] {
        for account in ["work@example.com", "home@example.com"] {
            common::connect(&engine, integration, account, "tok").await;
        }
        common::needs_reconnect(&stores, integration, "home@example.com").await;
    }
    (engine, upstream)
}

#[tokio::test]
async fn i1_searching_every_account_says_which_one_was_not_searched_and_why() {
    let (engine, upstream) = engine_with_one_account_to_reconnect().await;
    let found = common::call(&engine, "s", "search_gmail", json!({}), "k").await;
    assert!(found.ok(), "{}", found.text);
    assert!(
        found
            .text
            .contains("=== work@example.com ===\nNo messages match."),
        "{}",
        found.text
    );
    assert!(
        found
            .text
            .contains("(home@example.com was not searched: it needs to be reconnected.)"),
        "{}",
        found.text
    );
    assert_eq!(upstream.seen("GET /gmail/v1/users/me/messages?"), 1);

    let events = common::call(&engine, "c", "calendar_search", json!({}), "k").await;
    assert!(events.ok(), "{}", events.text);
    assert!(
        events
            .text
            .ends_with("\n(home@example.com was not searched: it needs to be reconnected.)"),
        "{}",
        events.text
    );
}

#[tokio::test]
async fn g8_naming_an_account_that_needs_reconnecting_says_so_not_that_it_is_unknown() {
    let (engine, _upstream) = engine_with_one_account_to_reconnect().await;
    for (tool, args) in [
        ("search_gmail", json!({"account": "Home@example.com"})),
        (
            "get_gmail",
            json!({"message_id": "m1", "account": "home@example.com"}),
        ),
        ("calendar_search", json!({"account": "home@example.com"})),
    ] {
        let refused = common::call(&engine, "n", tool, args, "k").await;
        assert_eq!(
            refused.error_kind,
            Some(ErrorKind::CredentialsRevoked),
            "{tool}: {}",
            refused.text
        );
        assert_eq!(
            refused.text,
            "Your Google account home@example.com needs to be reconnected."
        );
    }
    let unknown = common::call(
        &engine,
        "u",
        "search_gmail",
        json!({"account": "x@example.com"}),
        "k",
    )
    .await;
    assert_eq!(
        unknown.error_kind,
        Some(ErrorKind::InvalidArguments),
        "{}",
        unknown.text
    );
}

#[tokio::test]
async fn i1_the_session_brief_names_the_account_that_needs_reconnecting() {
    let (engine, upstream) = engine_with_one_account_to_reconnect().await;
    let stores = MemoryStore::stores();
    let bootstrap = gateway_svc::bootstrap::Bootstrap {
        tasks: stores.tasks.clone(),
        reminders: stores.reminders.clone(),
        notes: stores.notes.clone(),
        services: engine.services.clone(),
        gmail: GmailApi {
            base_url: upstream.base_url.clone(),
        },
        source_timeout: Duration::from_secs(5),
        cache: None,
    };
    let brief = bootstrap.context(&user(), "UTC").await;
    assert_eq!(
        brief.email.line,
        r#"Unread: "work@example.com" 0, "home@example.com" (needs to be reconnected)"#
    );
    let accounts: Vec<_> = brief
        .email
        .accounts
        .iter()
        .map(|a| a.account.as_str())
        .collect();
    assert_eq!(accounts, ["work@example.com", "home@example.com"]);
}

#[tokio::test]
async fn i1_the_session_brief_quotes_each_account_so_a_name_holding_a_comma_or_quote_reads_as_one()
{
    let stores = MemoryStore::stores();
    let upstream = Upstream::start(|_, _| Answer::Status(200, r#"{"messagesUnread": 3}"#)).await;
    let engine = common::engine(
        &stores,
        gmail::tools(GmailApi {
            base_url: upstream.base_url.clone(),
        }),
    );
    let odd = r#"Acme, Inc" 9, "b"#;
    for account in ["a@example.com", odd] {
        common::connect(&engine, Integration::Gmail, account, "tok").await;
    }
    common::needs_reconnect(&stores, Integration::Gmail, odd).await;
    let bootstrap = gateway_svc::bootstrap::Bootstrap {
        tasks: stores.tasks.clone(),
        reminders: stores.reminders.clone(),
        notes: stores.notes.clone(),
        services: engine.services.clone(),
        gmail: GmailApi {
            base_url: upstream.base_url.clone(),
        },
        source_timeout: Duration::from_secs(5),
        cache: None,
    };
    let brief = bootstrap.context(&user(), "UTC").await;
    assert_eq!(
        brief.email.line,
        r#"Unread: "a@example.com" 3, "Acme, Inc\" 9, \"b" (needs to be reconnected)"#
    );
}

#[tokio::test]
async fn g8_when_every_account_needs_reconnecting_naming_one_names_that_one_and_all_are_listed() {
    let stores = MemoryStore::stores();
    let upstream = Upstream::start(|_, _| Answer::Status(200, "{}")).await;
    let engine = common::engine(
        &stores,
        gmail::tools(GmailApi {
            base_url: upstream.base_url.clone(),
        }),
    );
    for account in ["work@example.com", "home@example.com"] {
        common::connect(&engine, Integration::Gmail, account, "tok").await;
        common::needs_reconnect(&stores, Integration::Gmail, account).await;
    }
    for named in ["home@example.com", "Work@example.com"] {
        let refused =
            common::call(&engine, "n", "search_gmail", json!({"account": named}), "k").await;
        assert_eq!(refused.error_kind, Some(ErrorKind::CredentialsRevoked));
        assert_eq!(
            refused.text,
            format!(
                "Your Google account {} needs to be reconnected.",
                named.to_lowercase()
            )
        );
    }
    let every = common::call(&engine, "a", "search_gmail", json!({}), "k").await;
    assert_eq!(every.error_kind, Some(ErrorKind::CredentialsRevoked));
    assert!(
        every.text.starts_with("Your Google accounts "),
        "{}",
        every.text
    );
    assert!(every.text.contains("work@example.com"), "{}", every.text);
    assert!(every.text.contains("home@example.com"), "{}", every.text);
    assert!(
        every.text.ends_with(" need to be reconnected."),
        "{}",
        every.text
    );
    assert_eq!(upstream.seen("GET "), 0);
}

#[tokio::test]
async fn g8_several_accounts_needing_reconnecting_are_each_named_in_quotes_so_a_comma_in_one_name_splits_nothing()
 {
    let stores = MemoryStore::stores();
    let upstream = Upstream::start(|_, _| Answer::Status(200, r#"{"messages": []}"#)).await;
    let mut tools = gmail::tools(GmailApi {
        base_url: upstream.base_url.clone(),
    });
    tools.extend(slack::tools(SlackApi {
        base_url: upstream.base_url.clone(),
    }));
    let engine = common::engine(&stores, tools);
    for workspace in ["Acme, Inc", "Globex"] {
        common::connect(&engine, Integration::Slack, workspace, "tok").await;
        common::needs_reconnect(&stores, Integration::Slack, workspace).await;
    }
    let every = common::call(&engine, "a", "slack_channels", json!({}), "k").await;
    assert_eq!(every.error_kind, Some(ErrorKind::CredentialsRevoked));
    assert_eq!(
        every.text,
        r#"Your Slack accounts "Acme, Inc", "Globex" need to be reconnected."#
    );
    let named = common::call(
        &engine,
        "n",
        "slack_channels",
        json!({"workspace": "Acme, Inc"}),
        "k",
    )
    .await;
    assert_eq!(
        named.text,
        "Your Slack account Acme, Inc needs to be reconnected."
    );

    common::connect(&engine, Integration::Gmail, "work@example.com", "tok").await;
    for account in ["Acme, Inc", "home@example.com"] {
        common::connect(&engine, Integration::Gmail, account, "tok").await;
        common::needs_reconnect(&stores, Integration::Gmail, account).await;
    }
    let found = common::call(&engine, "s", "search_gmail", json!({}), "k").await;
    assert!(found.ok(), "{}", found.text);
    assert!(
        found.text.contains(
            "\n(\"Acme, Inc\", \"home@example.com\" were not searched: they need to be reconnected.)\n"
        ),
        "{}",
        found.text
    );
    assert_eq!(upstream.seen("POST "), 0);
}

/// An account store in which another replica holds every account's refresh lease past any
/// wait (it died mid-refresh, and its lease has not lapsed yet).
struct RefreshingElsewhere(Arc<dyn AccountStore>);

#[async_trait::async_trait]
impl AccountStore for RefreshingElsewhere {
    async fn upsert_account(&self, account: StoredAccount) -> Result<(), StoreError> {
        self.0.upsert_account(account).await
    }
    async fn list_accounts(&self, user: &UserId) -> Result<Vec<StoredAccount>, StoreError> {
        self.0.list_accounts(user).await
    }
    async fn get_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<Option<StoredAccount>, StoreError> {
        self.0.get_account(user, integration, account).await
    }
    async fn delete_account(
        &self,
        user: &UserId,
        integration: Integration,
        account: &str,
    ) -> Result<bool, StoreError> {
        self.0.delete_account(user, integration, account).await
    }
    async fn count_accounts(&self) -> Result<u64, StoreError> {
        self.0.count_accounts().await
    }
    async fn sample_accounts(
        &self,
        limit: usize,
        newest_first: bool,
    ) -> Result<Vec<StoredAccount>, StoreError> {
        self.0.sample_accounts(limit, newest_first).await
    }
    async fn accounts_after(
        &self,
        after: Option<&AccountCursor>,
        limit: usize,
    ) -> Result<Vec<StoredAccount>, StoreError> {
        self.0.accounts_after(after, limit).await
    }
    async fn lock_account(
        &self,
        _user: &UserId,
        _integration: Integration,
        account: &str,
    ) -> Result<Box<dyn AccountLock>, StoreError> {
        Err(StoreError::InProgress(format!(
            "the account {account} is still being refreshed by another replica"
        )))
    }
    async fn lock_account_if_idle(
        &self,
        _user: &UserId,
        _integration: Integration,
        _account: &str,
        _lapsed_for: std::time::Duration,
    ) -> Result<Option<Box<dyn AccountLock>>, StoreError> {
        Ok(None)
    }
}

#[tokio::test]
async fn g8_a_call_that_outwaits_another_replicas_token_refresh_is_told_sign_in_is_being_renewed() {
    let upstream = Upstream::start(|_, _| Answer::Status(200, r#"{"messages": []}"#)).await;
    let mut stores = MemoryStore::stores();
    stores.accounts = Arc::new(RefreshingElsewhere(stores.accounts.clone()));
    let engine = common::engine(
        &stores,
        gmail::tools(GmailApi {
            base_url: upstream.base_url.clone(),
        }),
    );
    engine
        .services
        .credentials
        .connect(
            &user(),
            NewAccount {
                integration: Integration::Gmail,
                account: "work@example.com".into(),
                access_token: "expired".into(),
                refresh_token: Some("refresh".into()),
                expires_at: Some(SystemTime::now() - Duration::from_secs(60)),
                scopes: Vec::new(),
            },
        )
        .await
        .unwrap();

    let found = common::call(&engine, "c1", "search_gmail", json!({"query": "x"}), "k1").await;

    assert_eq!(
        found.text,
        "Google sign-in is being renewed; try again in a few seconds."
    );
    assert_eq!(found.error_kind, Some(ErrorKind::UpstreamUnavailable));
    assert_eq!(upstream.seen(""), 0);
}

#[tokio::test]
async fn g8_a_token_that_cannot_be_decrypted_asks_for_the_account_to_be_reconnected() {
    let upstream = Upstream::start(|_, _| Answer::Status(200, r#"{"messages": []}"#)).await;
    let stores = MemoryStore::stores();
    let tools = || {
        gmail::tools(GmailApi {
            base_url: upstream.base_url.clone(),
        })
    };
    // Each engine has a key of its own: the other's tokens are unreadable to it, as after
    // CREDENTIALS_KEY changed.
    let connected_under_another_key = common::engine(&stores, tools());
    common::connect(
        &connected_under_another_key,
        Integration::Gmail,
        "work@example.com",
        "tok",
    )
    .await;
    let engine = common::engine(&stores, tools());

    let found = common::call(&engine, "c1", "search_gmail", json!({"query": "x"}), "k1").await;

    assert_eq!(found.error_kind, Some(ErrorKind::CredentialsRevoked));
    assert_eq!(
        found.text,
        "Your Google account work@example.com needs to be reconnected."
    );
    assert_eq!(upstream.seen(""), 0);
}

#[tokio::test]
async fn i1_get_gmail_not_finding_an_email_names_each_account_searched_in_quotes() {
    let upstream = Upstream::start(|_, _| Answer::Status(404, "{}")).await;
    let engine = common::engine(
        &MemoryStore::stores(),
        gmail::tools(GmailApi {
            base_url: upstream.base_url.clone(),
        }),
    );
    for account in ["home@example.com", "work@example.com"] {
        common::connect(&engine, Integration::Gmail, account, "tok").await;
    }
    let missing = common::call(
        &engine,
        "c1",
        "get_gmail",
        json!({"message_id": "m1"}),
        "k1",
    )
    .await;
    assert_eq!(missing.error_kind, Some(ErrorKind::NotFound));
    assert_eq!(
        missing.text,
        r#"I couldn't find email m1 in "home@example.com", "work@example.com"."#
    );
}
