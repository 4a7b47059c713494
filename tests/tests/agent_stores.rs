//! One suite, both agent-svc stores (S-5): threads and ownership, the execution lock, messages,
//! LLM history, runs and sequenced events behave alike in memory and on PostgreSQL.

use std::{sync::Arc, time::Duration};

use agent_svc::store::{
    AgentStore, LockOutcome, MessageKind, MessageSource, NewRunOutcome, Run, RunPatch, RunState,
    RunUsage, memory::MemoryStore, postgres::PgStore,
};
use steward_tests::TestDb;
use svc_kit::{pg::PoolOptions, server_config::DatabaseConfig};

struct Backend {
    store: Arc<dyn AgentStore>,
    _db: Option<TestDb>,
}

async fn memory() -> Backend {
    Backend {
        store: Arc::new(MemoryStore::new()),
        _db: None,
    }
}

async fn postgres() -> Backend {
    let db = TestDb::create().await.unwrap();
    let config = DatabaseConfig {
        url: db.url().to_owned(),
        pool: PoolOptions {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(5),
        },
    };
    Backend {
        store: Arc::new(PgStore::connect(&config).await.unwrap()),
        _db: Some(db),
    }
}

fn new_run(id: &str, thread: &str, owner: &str, request_id: Option<&str>) -> Run {
    Run {
        id: id.into(),
        thread_id: thread.into(),
        owner: owner.into(),
        request_id: request_id.map(str::to_owned),
        state: RunState::Queued,
        channel: "web".into(),
        model: String::new(),
        usage: RunUsage::default(),
        iterations: 0,
        error: None,
        failure_kind: None,
        summary: String::new(),
        cancel_requested: false,
        last_event_seq: 0,
        created_at: std::time::SystemTime::now(),
        started_at: None,
        finished_at: None,
        prompt_sections: Vec::new(),
    }
}

async fn threads_belong_to_their_owner(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "Plan the offsite")
        .await
        .unwrap();
    s.create_thread("t2", "alice", "Taxes").await.unwrap();
    s.create_thread("t3", "bob", "Bob's").await.unwrap();
    assert!(
        s.get_thread("bob", "t1").await.unwrap().is_none(),
        "another user's thread is not found"
    );
    assert_eq!(
        s.get_thread("alice", "t1").await.unwrap().unwrap().title,
        "Plan the offsite"
    );
    s.add_message(
        "t1",
        None,
        MessageSource::User,
        MessageKind::Text,
        "hi",
        serde_json::json!({}),
    )
    .await
    .unwrap();
    let mine: Vec<_> = s
        .list_threads("alice", 0, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(mine, ["t1", "t2"], "most recently updated first");
    assert_eq!(s.list_threads("alice", 1, 10).await.unwrap().len(), 1);
}

async fn the_thread_lock_admits_one_run_until_released_or_expired(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    assert_eq!(
        s.lock_thread("t1", "r1", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Acquired
    );
    assert_eq!(
        s.lock_thread("t1", "r2", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Busy {
            run_id: "r1".into()
        }
    );
    assert_eq!(
        s.get_thread("alice", "t1")
            .await
            .unwrap()
            .unwrap()
            .active_run_id
            .as_deref(),
        Some("r1")
    );
    s.release_lock("t1", "r2").await.unwrap(); // not the holder: no effect
    assert!(matches!(
        s.lock_thread("t1", "r2", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Busy { .. }
    ));
    s.release_lock("t1", "r1").await.unwrap();
    // r2 takes a lease that has already run out, as a crashed holder's would have.
    assert_eq!(
        s.lock_thread("t1", "r2", Duration::ZERO).await.unwrap(),
        LockOutcome::Acquired
    );
    assert_eq!(
        s.lock_thread("t1", "r3", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Acquired
    );
}

async fn concurrent_lockers_get_exactly_one_winner(b: Backend) {
    b.store.create_thread("t1", "alice", "x").await.unwrap();
    let attempts = (0..10).map(|i| {
        let s = b.store.clone();
        tokio::spawn(async move {
            s.lock_thread("t1", &format!("r{i}"), Duration::from_secs(60))
                .await
                .unwrap()
        })
    });
    let mut acquired = 0;
    for a in attempts {
        if a.await.unwrap() == LockOutcome::Acquired {
            acquired += 1;
        }
    }
    assert_eq!(acquired, 1);
}

async fn messages_and_history_keep_their_order(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    s.add_message(
        "t1",
        Some("r1"),
        MessageSource::User,
        MessageKind::Text,
        "one",
        serde_json::json!({}),
    )
    .await
    .unwrap();
    s.add_message(
        "t1",
        Some("r1"),
        MessageSource::Agent,
        MessageKind::Tool,
        "two",
        serde_json::json!({"tool": "list_tasks"}),
    )
    .await
    .unwrap();
    let m = s.list_messages("t1", 0, 10).await.unwrap();
    assert_eq!(
        m.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(),
        ["one", "two"]
    );
    assert_eq!(
        (m[1].source, m[1].kind),
        (MessageSource::Agent, MessageKind::Tool)
    );
    assert_eq!(m[1].metadata["tool"], "list_tasks");
    s.append_history(
        "t1",
        &[
            serde_json::json!({"role": "user"}),
            serde_json::json!({"role": "assistant"}),
        ],
    )
    .await
    .unwrap();
    s.append_history("t1", &[serde_json::json!({"role": "user", "n": 2})])
        .await
        .unwrap();
    let h = s.history("t1").await.unwrap();
    assert_eq!(h.len(), 3);
    assert_eq!(h[2]["n"], 2);
}

async fn runs_are_created_once_per_request_id_and_updated(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    assert_eq!(
        s.create_run(&new_run("r1", "t1", "alice", Some("req-1")))
            .await
            .unwrap(),
        NewRunOutcome::Created
    );
    assert_eq!(
        s.create_run(&new_run("r2", "t1", "alice", Some("req-1")))
            .await
            .unwrap(),
        NewRunOutcome::Duplicate {
            run_id: "r1".into()
        }
    );
    assert_eq!(
        s.create_run(&new_run("r3", "t1", "bob", Some("req-1")))
            .await
            .unwrap(),
        NewRunOutcome::Created,
        "keys are per owner"
    );
    s.update_run(
        "r1",
        RunPatch {
            state: Some(RunState::Completed),
            summary: Some("done".into()),
            iterations: Some(2),
            ..RunPatch::default()
        },
    )
    .await
    .unwrap();
    let r = s.get_run("alice", "r1").await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.summary.as_str(), r.iterations),
        (RunState::Completed, "done", 2)
    );
    assert!(s.get_run("bob", "r1").await.unwrap().is_none());
    assert!(
        !s.request_cancel("r1").await.unwrap(),
        "an ended run cannot be cancelled"
    );
    assert!(s.request_cancel("r3").await.unwrap());
}

async fn events_are_numbered_without_gaps_even_when_appended_concurrently(b: Backend) {
    b.store.create_thread("t1", "alice", "x").await.unwrap();
    b.store
        .create_run(&new_run("r1", "t1", "alice", None))
        .await
        .unwrap();
    let appends = (0..20).map(|i| {
        let s = b.store.clone();
        tokio::spawn(async move {
            s.append_event("r1", format!("e{i}").as_bytes())
                .await
                .unwrap()
        })
    });
    let mut seqs = Vec::new();
    for a in appends {
        seqs.push(a.await.unwrap());
    }
    seqs.sort();
    assert_eq!(seqs, (1..=20).collect::<Vec<u64>>());
    let after = b.store.events_after("r1", 15, 100).await.unwrap();
    assert_eq!(
        after.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [16, 17, 18, 19, 20]
    );
    assert_eq!(
        b.store
            .get_run("alice", "r1")
            .await
            .unwrap()
            .unwrap()
            .last_event_seq,
        20
    );
}

macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod in_memory {
            $(#[tokio::test] async fn $name() { super::$name(super::memory().await).await })*
        }
        mod on_postgres {
            $(#[tokio::test] async fn $name() { super::$name(super::postgres().await).await })*
        }
    };
}

both_backends!(
    threads_belong_to_their_owner,
    the_thread_lock_admits_one_run_until_released_or_expired,
    concurrent_lockers_get_exactly_one_winner,
    messages_and_history_keep_their_order,
    runs_are_created_once_per_request_id_and_updated,
    events_are_numbered_without_gaps_even_when_appended_concurrently,
);
