//! One suite, both agent-svc stores (S-5): every store command of the run's state machine —
//! threads, the fenced lease, admission, commits, decisions, endings, archives and the task
//! queue — behaves alike in memory and on PostgreSQL.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use agent_svc::store::{
    Action, ActionState, Admission, Admitted, AgentStore, Approval, ApprovalState, Decided, Ending,
    Lease, LockOutcome, MessageKind, MessageSource, ModelCallUsage, ModelUsage, NewMessage,
    Occurrence, Run, RunCommit, RunPatch, RunState, RunUsage, Schedule, ScheduleKind,
    ScheduleOutcome, Settle, StoreError, Tally, TaskAgent, TaskSettle, ThreadCursor, TurnJson,
    UsageSummary, action_id, memory::MemoryStore, postgres::PgStore,
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
    postgres_with(8).await
}

/// A PostgreSQL store on `url` with a pool of `max_connections`.
async fn pg_store(url: &str, max_connections: usize) -> PgStore {
    let pool = PoolOptions {
        max_connections,
        ..PoolOptions::default()
    };
    pg_store_with(url, pool).await
}

/// A PostgreSQL store on `url` with these pool settings.
async fn pg_store_with(url: &str, pool: PoolOptions) -> PgStore {
    let url = url.to_owned();
    PgStore::connect(&DatabaseConfig { url, pool })
        .await
        .unwrap()
}

/// `n` replicas' stores over one database, each with a pool of four.
async fn replicas(db: &TestDb, n: usize) -> Vec<PgStore> {
    let mut stores = Vec::new();
    for _ in 0..n {
        stores.push(pg_store(db.url(), 4).await);
    }
    stores
}

async fn postgres_with(max_connections: usize) -> Backend {
    let db = TestDb::create().await.unwrap();
    Backend {
        store: Arc::new(pg_store(db.url(), max_connections).await),
        _db: Some(db),
    }
}

fn new_run(id: &str, thread: &str, owner: &str, request_id: Option<&str>) -> Run {
    Run {
        request_id: request_id.map(str::to_owned),
        ..Run::queued(id, thread, owner, "web")
    }
}

fn admission(run: Run, new_thread: bool, lease: Duration) -> Admission {
    Admission {
        new_thread_title: new_thread.then(|| format!("title of {}", run.thread_id)),
        user_message: Some(format!("prompt of {}", run.id)),
        first_event: b"queued".to_vec(),
        lease,
        max_active_runs: 3,
        supersede_event: b"superseded".to_vec(),
        supersede_message: "superseded".into(),
        supersede_paused: true,
        summaries: 0,
        run,
    }
}

/// Run `id` of `owner` on a new thread `thread`, with a 60 s lease.
fn admit_new(id: &str, thread: &str, owner: &str, request: Option<&str>) -> Admission {
    admission(
        new_run(id, thread, owner, request),
        true,
        Duration::from_secs(60),
    )
}

/// A session of its own that holds `owner`'s admission lock, as a stalled replica's
/// transaction would, until it rolls back.
async fn holding_the_admission_lock_of(url: &str, owner: &str) -> tokio_postgres::Client {
    let holder = side_connection(url).await;
    steward_tests::db::hold_admission_lock(&holder, owner).await;
    holder
}

/// A connection of the test's own to `url`, beside the store's pool.
async fn side_connection(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// Admits run `id` on a new thread `thread` for alice and returns its lease.
async fn started(s: &Arc<dyn AgentStore>, id: &str, thread: &str, lease: Duration) -> Lease {
    match s
        .admit(&admission(new_run(id, thread, "alice", None), true, lease))
        .await
        .unwrap()
    {
        Admitted::Started { lease, .. } => lease,
        other => panic!("not admitted: {other:?}"),
    }
}

fn action(run_id: &str, call_id: &str, state: ActionState) -> Action {
    Action {
        id: action_id(run_id, call_id),
        run_id: run_id.into(),
        call_id: call_id.into(),
        tool: "gmail_send".into(),
        arguments: serde_json::json!({"to": ["a@example.com"]}),
        side_effect: true,
        state,
        result_text: None,
        error_kind: None,
        approval_id: None,
        transitions: vec![ActionState::Planned, state],
        created_at: SystemTime::now(),
        updated_at: SystemTime::now(),
    }
}

fn approval(id: &str, run_id: &str, thread_id: &str, ttl: Duration) -> Approval {
    let now = SystemTime::now();
    Approval {
        id: id.into(),
        run_id: run_id.into(),
        thread_id: thread_id.into(),
        owner: "alice".into(),
        call_id: "c1".into(),
        tool: "gmail_send".into(),
        arguments: serde_json::json!({"to": ["a@example.com"]}),
        args_sha256: "sha".into(),
        preview: "To: a@example.com".into(),
        reason: "sends email".into(),
        state: ApprovalState::Pending,
        created_at: now,
        expires_at: now + ttl,
        decided_by: None,
        decided_at: None,
        // Issue 14: both round-trip through every backend.
        binding: "digest-of-resolved-recipients".into(),
        tainted_by: vec!["search_gmail".into()],
        allowed_tools: Some(vec!["list_tasks".into(), "gmail_send".into()]),
    }
}

/// Pauses `lease`'s run for approval `approval_id` (one commit that frees the lease).
async fn pause(s: &Arc<dyn AgentStore>, lease: &Lease, approval_id: &str, ttl: Duration) {
    let mut a = action(&lease.run_id, "c1", ActionState::AwaitingConfirmation);
    a.approval_id = Some(approval_id.into());
    s.commit(
        lease,
        RunCommit {
            events: vec![(2, b"approval".to_vec()), (3, b"paused".to_vec())],
            actions: vec![a],
            patch: RunPatch {
                state: Some(RunState::AwaitingConfirmation),
                ..RunPatch::default()
            },
            approval: Some(approval(approval_id, &lease.run_id, &lease.thread_id, ttl)),
            release: true,
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
}

fn ending(state: RunState, gap: u64) -> Ending {
    Ending {
        state,
        error: "ended".into(),
        failure_kind: "cancelled".into(),
        event: b"end".to_vec(),
        seq_gap: gap,
        message: Some("the run ended".into()),
    }
}

async fn seqs(s: &dyn AgentStore, run_id: &str) -> Vec<u64> {
    s.events_after(run_id, 0, 1000)
        .await
        .unwrap()
        .into_iter()
        .map(|(seq, _)| seq)
        .collect()
}

async fn a_thread_is_never_created_twice(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "first").await.unwrap();
    let err = s.create_thread("t1", "bob", "second").await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
    assert_eq!(
        s.get_thread("alice", "t1").await.unwrap().unwrap().title,
        "first"
    );
}

async fn the_thread_lease_has_one_holder_until_released_or_expired(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    let LockOutcome::Acquired(first) = s
        .lock_thread("t1", "r1", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("free thread not acquired");
    };
    assert_eq!(
        s.lock_thread("t1", "r2", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Busy {
            run_id: "r1".into()
        }
    );
    assert_eq!(
        s.lock_thread("t1", "r1", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Busy {
            run_id: "r1".into()
        },
        "a live lease is not taken again, not even for the same run"
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
    assert_eq!(
        s.renew_lease(&first, Duration::from_secs(60))
            .await
            .unwrap(),
        Some(false)
    );
    let stranger = Lease {
        token: "not-the-token".into(),
        ..first.clone()
    };
    s.release_lease(&stranger).await.unwrap();
    assert!(
        matches!(
            s.lock_thread("t1", "r2", Duration::from_secs(60))
                .await
                .unwrap(),
            LockOutcome::Busy { .. }
        ),
        "only the token releases"
    );
    s.release_lease(&first).await.unwrap();
    let LockOutcome::Acquired(lapsing) = s.lock_thread("t1", "r2", Duration::ZERO).await.unwrap()
    else {
        panic!("released thread not acquired");
    };
    assert_eq!(
        s.renew_lease(&lapsing, Duration::from_secs(60))
            .await
            .unwrap(),
        None,
        "an expired lease cannot be renewed"
    );
    assert!(matches!(
        s.lock_thread("t1", "r3", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Acquired(_)
    ));
}

async fn concurrent_lockers_get_exactly_one_winner(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    let attempts = (0..8).map(|i| {
        let s = s.clone();
        tokio::spawn(async move {
            s.lock_thread("t1", &format!("r{i}"), Duration::from_secs(60))
                .await
                .unwrap()
        })
    });
    let mut winners = 0;
    for a in attempts {
        if matches!(a.await.unwrap(), LockOutcome::Acquired(_)) {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
}

async fn admission_writes_run_message_and_first_event_or_nothing(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    assert_eq!(lease.run_id, "r1");
    let run = s.get_run("alice", "r1").await.unwrap().unwrap();
    assert_eq!((run.state, run.last_event_seq), (RunState::Queued, 1));
    assert_eq!(
        s.events_after("r1", 0, 10).await.unwrap(),
        [(1, b"queued".to_vec())]
    );
    let messages = s.list_messages("t1", 0, 10).await.unwrap();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].content, "prompt of r1");

    // A busy thread: nothing of the second run is written.
    let busy = s
        .admit(&admission(
            new_run("r2", "t1", "alice", None),
            false,
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert_eq!(
        busy,
        Admitted::Busy {
            run_id: "r1".into()
        }
    );
    assert!(s.get_run("alice", "r2").await.unwrap().is_none());
    assert_eq!(s.list_messages("t1", 0, 10).await.unwrap().len(), 1);

    // Someone else's thread is not found.
    let err = s
        .admit(&admission(
            new_run("r3", "t1", "bob", None),
            false,
            Duration::from_secs(60),
        ))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

async fn a_retried_request_id_is_a_duplicate_and_the_run_cap_holds(b: Backend) {
    let s = &b.store;
    let first = s
        .admit(&admission(
            new_run("r1", "t1", "alice", Some("req-1")),
            true,
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert!(matches!(first, Admitted::Started { .. }));
    let again = s
        .admit(&admission(
            new_run("r1b", "t1b", "alice", Some("req-1")),
            true,
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert_eq!(
        again,
        Admitted::Duplicate {
            run_id: "r1".into(),
            thread_id: "t1".into()
        }
    );
    assert!(s.get_thread("alice", "t1b").await.unwrap().is_none());
    // A retry on the original's own thread, while the original holds it, is a duplicate too.
    let racing = s
        .admit(&admission(
            new_run("r1c", "t1", "alice", Some("req-1")),
            false,
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert_eq!(
        racing,
        Admitted::Duplicate {
            run_id: "r1".into(),
            thread_id: "t1".into()
        }
    );
    assert_eq!(
        s.find_run_by_request("alice", "req-1")
            .await
            .unwrap()
            .unwrap()
            .id,
        "r1"
    );
    started(s, "r2", "t2", Duration::from_secs(60)).await;
    started(s, "r3", "t3", Duration::from_secs(60)).await;
    let capped = s
        .admit(&admission(
            new_run("r4", "t4", "alice", None),
            true,
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert_eq!(capped, Admitted::TooManyRuns { active: 3 });
    // Refused whole: not even the new thread it would have made is left.
    assert!(s.get_thread("alice", "t4").await.unwrap().is_none());
    assert!(matches!(
        s.admit(&admission(
            new_run("b1", "tb", "bob", None),
            true,
            Duration::from_secs(60)
        ))
        .await
        .unwrap(),
        Admitted::Started { .. }
    ));
}

async fn a_commit_writes_everything_or_nothing_and_is_fenced_by_the_lease(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    s.commit(
        &lease,
        RunCommit {
            events: vec![(2, b"planning".to_vec()), (3, b"tool call".to_vec())],
            history: vec![
                serde_json::json!({"role": "user", "content": "one"})
                    .to_string()
                    .into(),
                serde_json::json!({"role": "user", "content": "two"})
                    .to_string()
                    .into(),
            ],
            actions: vec![action("r1", "c1", ActionState::Executing)],
            messages: vec![NewMessage::text(MessageSource::Agent, "working")],
            patch: RunPatch {
                state: Some(RunState::Executing),
                system_prompt: Some("you are steward".into()),
                ..RunPatch::default()
            },
            audit: vec![(
                "side_effect".into(),
                serde_json::json!({"tool": "gmail_send"}),
            )],
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
    let mut done = action("r1", "c1", ActionState::Completed);
    done.transitions = vec![
        ActionState::Planned,
        ActionState::Executing,
        ActionState::Completed,
    ];
    done.result_text = Some("sent".into());
    s.commit(
        &lease,
        RunCommit {
            events: vec![(4, b"result".to_vec())],
            history: vec![
                serde_json::json!({"role": "user", "content": "three"})
                    .to_string()
                    .into(),
            ],
            actions: vec![done, action("r1", "c2", ActionState::Executing)],
            patch: RunPatch {
                state: Some(RunState::Completed),
                ..RunPatch::default()
            },
            release: true,
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
    let run = s.get_run("alice", "r1").await.unwrap().unwrap();
    assert_eq!(run.state, RunState::Completed);
    assert_eq!(run.last_event_seq, 4);
    assert_eq!(run.system_prompt, "you are steward");
    assert_eq!(seqs(s.as_ref(), "r1").await, [1, 2, 3, 4]);
    let history: Vec<String> = s
        .history("t1")
        .await
        .unwrap()
        .iter()
        .map(|t| {
            let turn: serde_json::Value = serde_json::from_str(t).expect("a stored turn is JSON");
            turn["content"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(history, ["one", "two", "three"]);
    let actions = s.list_actions("r1").await.unwrap();
    assert_eq!(
        actions.len(),
        2,
        "an action is updated in place, never duplicated"
    );
    assert_eq!(actions[0].call_id, "c1");
    assert_eq!(actions[0].state, ActionState::Completed);
    assert_eq!(
        actions[0].transitions,
        [
            ActionState::Planned,
            ActionState::Executing,
            ActionState::Completed
        ]
    );
    assert_eq!(actions[0].result_text.as_deref(), Some("sent"));
    let by_call = s
        .actions_for_calls(&["c2".into(), "nope".into()])
        .await
        .unwrap();
    assert_eq!(by_call.len(), 1);
    assert_eq!(by_call[0].id, action_id("r1", "c2"));
    assert_eq!(s.audit("alice").await.unwrap()[0].0, "side_effect");
    assert!(
        s.get_thread("alice", "t1")
            .await
            .unwrap()
            .unwrap()
            .active_run_id
            .is_none(),
        "released with the last commit"
    );

    // The released lease fences every later write out.
    let late = s
        .commit(
            &lease,
            RunCommit {
                events: vec![(5, b"late".to_vec())],
                ..RunCommit::default()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(late, StoreError::LeaseLost), "{late:?}");
    assert_eq!(seqs(s.as_ref(), "r1").await, [1, 2, 3, 4]);
}

async fn of_concurrent_deciders_exactly_one_wins(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    pause(s, &lease, "a1", Duration::from_secs(600)).await;
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().state,
        RunState::AwaitingConfirmation
    );
    let LockOutcome::Acquired(winner) = s
        .lock_thread("t1", "r1", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("a paused run's thread is free");
    };
    assert_eq!(
        s.lock_thread("t1", "r1", Duration::from_secs(60))
            .await
            .unwrap(),
        LockOutcome::Busy {
            run_id: "r1".into()
        },
        "a second decider cannot take the lease"
    );
    match s
        .decide(
            &winner,
            "a1",
            ApprovalState::Approved,
            "alice",
            "approval_approved",
            3,
        )
        .await
        .unwrap()
    {
        Decided::Won {
            approval,
            last_event_seq,
        } => {
            assert_eq!(approval.state, ApprovalState::Approved);
            assert_eq!(approval.decided_by.as_deref(), Some("alice"));
            assert_eq!(last_event_seq, 3);
        }
        lost => panic!("the first decision lost: {lost:?}"),
    }
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().state,
        RunState::Executing
    );
    s.release_lease(&winner).await.unwrap();
    let LockOutcome::Acquired(late) = s
        .lock_thread("t1", "r1", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("released");
    };
    match s
        .decide(
            &late,
            "a1",
            ApprovalState::Rejected,
            "alice",
            "approval_rejected",
            3,
        )
        .await
        .unwrap()
    {
        Decided::Lost {
            approval,
            run_state,
        } => {
            assert_eq!(approval.state, ApprovalState::Approved);
            assert_eq!(run_state, RunState::Executing);
        }
        won => panic!("a second decision won: {won:?}"),
    }
    let kinds: Vec<String> = s
        .audit("alice")
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, ["approval_approved"]);
}

/// Deciding continues a paused run, so it counts against the owner's cap on live runs as an
/// admission does: at the cap nothing is recorded, and once a run ends the same decision wins.
async fn r4_a_decision_does_not_take_its_owner_past_the_run_cap(b: Backend) {
    let s = &b.store;
    let paused = started(s, "r1", "t1", Duration::from_secs(60)).await;
    pause(s, &paused, "a1", Duration::from_secs(600)).await;
    let mut live = Vec::new();
    for n in 2..=4 {
        live.push(
            started(
                s,
                &format!("r{n}"),
                &format!("t{n}"),
                Duration::from_secs(60),
            )
            .await,
        );
    }
    let LockOutcome::Acquired(decider) = s
        .lock_thread("t1", "r1", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("a paused run's thread is free");
    };
    let decide = |lease: Lease| async move {
        s.decide(
            &lease,
            "a1",
            ApprovalState::Approved,
            "alice",
            "approval_approved",
            3,
        )
        .await
        .unwrap()
    };
    assert_eq!(
        decide(decider.clone()).await,
        Decided::TooManyRuns { active: 3 }
    );
    let approval = s.get_approval("alice", "a1").await.unwrap().unwrap();
    assert_eq!(approval.state, ApprovalState::Pending, "nothing recorded");
    assert_eq!(
        approval.allowed_tools.as_deref(),
        Some(&["list_tasks".to_owned(), "gmail_send".to_owned()][..]),
        "the pause kept the tools its resume may offer"
    );
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().state,
        RunState::AwaitingConfirmation
    );
    assert!(s.audit("alice").await.unwrap().is_empty());
    // One run ends: the decision now continues the paused run.
    s.commit(
        &live[0],
        RunCommit {
            events: vec![(2, b"done".to_vec())],
            patch: RunPatch {
                state: Some(RunState::Completed),
                ..RunPatch::default()
            },
            release: true,
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
    assert!(matches!(decide(decider).await, Decided::Won { .. }));
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().state,
        RunState::Executing
    );
}

async fn an_expired_approval_cannot_be_decided(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    pause(s, &lease, "a1", Duration::ZERO).await;
    let LockOutcome::Acquired(decider) = s
        .lock_thread("t1", "r1", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("free");
    };
    let decided = s
        .decide(
            &decider,
            "a1",
            ApprovalState::Approved,
            "alice",
            "approval_approved",
            3,
        )
        .await
        .unwrap();
    assert!(matches!(decided, Decided::Lost { .. }), "{decided:?}");
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().state,
        RunState::AwaitingConfirmation
    );
}

async fn a_paused_run_ends_once_and_its_approval_expires(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    pause(s, &lease, "a1", Duration::from_secs(600)).await;
    assert!(
        s.end_paused("r1", &ending(RunState::Cancelled, 1))
            .await
            .unwrap()
    );
    assert!(
        !s.end_paused("r1", &ending(RunState::Cancelled, 1))
            .await
            .unwrap(),
        "only once"
    );
    let run = s.get_run("alice", "r1").await.unwrap().unwrap();
    assert_eq!(run.state, RunState::Cancelled);
    assert_eq!(seqs(s.as_ref(), "r1").await, [1, 2, 3, 4]);
    assert_eq!(
        s.get_approval("alice", "a1").await.unwrap().unwrap().state,
        ApprovalState::Expired
    );
    assert!(
        !s.request_cancel("r1", None).await.unwrap(),
        "an ended run takes no cancel"
    );
}

async fn a_run_whose_lease_lapsed_is_ended_once_after_a_gap(b: Backend) {
    let s = &b.store;
    let live = started(s, "r-live", "t1", Duration::from_secs(60)).await;
    let dead = started(s, "r-dead", "t2", Duration::from_millis(1)).await;
    s.commit(
        &live,
        RunCommit {
            events: vec![(2, b"planning".to_vec())],
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
    // Let the dead run's millisecond lease lapse (the store's clock decides).
    while s
        .renew_lease(&dead, Duration::from_millis(1))
        .await
        .unwrap()
        .is_some()
    {
        tokio::task::yield_now().await;
    }
    let abandoned: Vec<String> = s
        .abandoned_runs(Duration::ZERO, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(abandoned, ["r-dead"]);
    assert!(
        !s.end_abandoned("r-live", &ending(RunState::Failed, 10))
            .await
            .unwrap(),
        "a live lease protects its run"
    );
    assert!(
        !s.end_abandoned("r-dead", &ending(RunState::Cancelled, 10))
            .await
            .unwrap(),
        "not cancelled when nobody asked"
    );
    // A cancel that lands after the monitor chose "failed" keeps the run for the next sweep,
    // which ends it cancelled as its canceller asked.
    assert!(s.request_cancel("r-dead", Some("late")).await.unwrap());
    assert!(
        !s.end_abandoned("r-dead", &ending(RunState::Failed, 10))
            .await
            .unwrap(),
        "not failed once a cancel was asked"
    );
    assert!(
        s.end_abandoned("r-dead", &ending(RunState::Cancelled, 10))
            .await
            .unwrap()
    );
    assert!(
        !s.end_abandoned("r-dead", &ending(RunState::Cancelled, 10))
            .await
            .unwrap(),
        "one sweeper wins"
    );
    assert_eq!(
        seqs(s.as_ref(), "r-dead").await,
        [1, 11],
        "the terminal event skips the gap"
    );
    let thread = s.get_thread("alice", "t2").await.unwrap().unwrap();
    assert!(thread.active_run_id.is_none());
    let messages = s.list_messages("t2", 0, 10).await.unwrap();
    assert_eq!(messages.last().unwrap().content, "the run ended");
    assert_eq!(messages.last().unwrap().source, MessageSource::Error);
    let stale = s
        .commit(
            &dead,
            RunCommit {
                events: vec![(2, b"too late".to_vec())],
                ..RunCommit::default()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(stale, StoreError::LeaseLost));
}

async fn a_new_message_supersedes_a_paused_run(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    pause(s, &lease, "a1", Duration::from_secs(600)).await;
    // A run nobody waits for (a scheduled one) leaves the approval waiting and takes nothing.
    let unattended = Admission {
        supersede_paused: false,
        ..admission(
            new_run("r0", "t1", "alice", None),
            false,
            Duration::from_secs(60),
        )
    };
    assert_eq!(
        s.admit(&unattended).await.unwrap(),
        Admitted::AwaitingApproval {
            run_id: "r1".into()
        }
    );
    assert!(s.get_run("alice", "r0").await.unwrap().is_none());
    assert_eq!(
        s.get_approval("alice", "a1").await.unwrap().unwrap().state,
        ApprovalState::Pending
    );
    assert!(matches!(
        s.admit(&admission(
            new_run("r2", "t1", "alice", None),
            false,
            Duration::from_secs(60)
        ))
        .await
        .unwrap(),
        Admitted::Started { .. }
    ));
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().state,
        RunState::Cancelled
    );
    assert_eq!(seqs(s.as_ref(), "r1").await, [1, 2, 3, 4]);
    assert_eq!(
        s.get_approval("alice", "a1").await.unwrap().unwrap().state,
        ApprovalState::Expired
    );
}

/// P-1, U-2: a session is archived as having read others' words when one of its runs did,
/// even when its transcript does not show it (an attached item lives in the run's prompt) —
/// including the run that archived the session before it and only then read them; the session
/// after starts clean.
async fn p1_an_archive_says_whether_its_session_read_external_content(b: Backend) {
    let s = &b.store;
    let turn = |text: &str| -> TurnJson {
        serde_json::json!({"role": "user", "content": text})
            .to_string()
            .into()
    };
    let finish = |text: &str, read_external: bool| RunCommit {
        history: vec![turn(text)],
        patch: RunPatch {
            state: Some(RunState::Completed),
            ..RunPatch::default()
        },
        release: true,
        read_external,
        ..RunCommit::default()
    };
    let archive = |summary: &'static str, holder: Option<Lease>| async move {
        s.archive_history(
            "t1",
            "alice",
            summary,
            &ending(RunState::Cancelled, 1),
            holder.as_ref(),
            None,
        )
        .await
        .unwrap()
        .unwrap()
    };
    let next_run = |id: &'static str| async move {
        match s
            .admit(&admission(
                new_run(id, "t1", "alice", None),
                false,
                Duration::from_secs(60),
            ))
            .await
            .unwrap()
        {
            Admitted::Started { lease, .. } => lease,
            other => panic!("not admitted: {other:?}"),
        }
    };
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    s.commit(&lease, finish("summarise the attached mail", true))
        .await
        .unwrap();
    // r2 starts a new session: it archives r1's under its own lease, then reads the summary.
    let lease = next_run("r2").await;
    assert!(archive("Mail", Some(lease.clone())).await.external);
    s.commit(&lease, finish("what did the bank want?", true))
        .await
        .unwrap();
    assert!(
        archive("Bank", None).await.external,
        "r2 read the summary after its own archive"
    );
    let lease = next_run("r3").await;
    s.commit(&lease, finish("thanks", false)).await.unwrap();
    assert!(
        !archive("Thanks", None).await.external,
        "the next session starts clean"
    );
    let recent: Vec<bool> = s
        .recent_summaries("alice", 5)
        .await
        .unwrap()
        .iter()
        .map(|a| a.external)
        .collect();
    assert_eq!(
        recent,
        [false, true, true],
        "newest first, each as archived"
    );
}

async fn archiving_moves_history_and_ends_paused_runs(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    s.commit(
        &lease,
        RunCommit {
            history: vec![
                serde_json::json!({"role": "user", "content": "Book the flight to Lisbon"}).to_string().into(),
                serde_json::json!({"role": "assistant", "content": {"text": "Booked TP1347", "tool_calls": []}}).to_string().into(),
            ],
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
    pause(s, &lease, "a1", Duration::from_secs(600)).await;
    let archived = s
        .archive_history(
            "t1",
            "alice",
            "Flights",
            &ending(RunState::Cancelled, 1),
            None,
            None,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(archived.turn_count, 2);
    assert!(s.history("t1").await.unwrap().is_empty());
    assert_eq!(
        s.get_approval("alice", "a1").await.unwrap().unwrap().state,
        ApprovalState::Expired
    );
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().state,
        RunState::Cancelled
    );
    assert!(
        s.archive_history(
            "t1",
            "alice",
            "again",
            &ending(RunState::Cancelled, 1),
            None,
            None
        )
        .await
        .unwrap()
        .is_none(),
        "nothing left to archive"
    );
    // Search: every word must match, in summary or transcript.
    let hits = s.search_archives("alice", "TP1347", 5).await.unwrap();
    assert_eq!(hits.len(), 1);
    assert!(
        s.search_archives("alice", "TP1347 Paris", 5)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        s.search_archives("bob", "TP1347", 5)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        s.recent_summaries("alice", 5).await.unwrap()[0].summary,
        "Flights"
    );
}

/// Issue 13: a run's [RECENT SESSIONS] come back with its admission, one round trip fewer.
async fn an_admission_reads_the_owners_newest_session_summaries(b: Backend) {
    let s = &b.store;
    for (n, (owner, summary)) in [("alice", "Flights"), ("bob", "Taxes"), ("alice", "Dentist")]
        .into_iter()
        .enumerate()
    {
        let (run, thread) = (format!("r{n}"), format!("t{n}"));
        archived_session(s.as_ref(), owner, &run, &thread, summary).await;
    }
    // Runs left open above count against the cap; it is not what this test is about.
    let asking = Admission {
        summaries: 5,
        max_active_runs: 10,
        ..admission(
            new_run("r9", "t9", "alice", None),
            true,
            Duration::from_secs(60),
        )
    };
    let Admitted::Started { summaries, .. } = s.admit(&asking).await.unwrap() else {
        panic!("not admitted");
    };
    let read: Vec<&str> = summaries.iter().map(|a| a.summary.as_str()).collect();
    assert_eq!(read, ["Dentist", "Flights"], "alice's own, newest first");
    assert_eq!(summaries, s.recent_summaries("alice", 5).await.unwrap());
    let one = Admission {
        summaries: 1,
        max_active_runs: 10,
        ..admission(
            new_run("r10", "t10", "alice", None),
            true,
            Duration::from_secs(60),
        )
    };
    let Admitted::Started { summaries, .. } = s.admit(&one).await.unwrap() else {
        panic!("not admitted");
    };
    assert_eq!(summaries.len(), 1, "no more than asked for");
    let none = Admission {
        max_active_runs: 10,
        ..admission(
            new_run("r11", "t11", "alice", None),
            true,
            Duration::from_secs(60),
        )
    };
    let Admitted::Started { summaries, .. } = s.admit(&none).await.unwrap() else {
        panic!("not admitted");
    };
    assert!(summaries.is_empty(), "none unless asked");
}

async fn a_thread_held_by_another_run_is_not_archived(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    s.commit(
        &lease,
        RunCommit {
            history: vec![
                serde_json::json!({"role": "user", "content": "hi"})
                    .to_string()
                    .into(),
            ],
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
    let e = ending(RunState::Cancelled, 1);
    assert!(
        s.archive_history("t1", "alice", "x", &e, None, None)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        s.archive_history("t1", "alice", "x", &e, Some(&lease), None)
            .await
            .unwrap()
            .is_some(),
        "the holder itself may archive before its run"
    );
}

/// B-4: the idle-session sweep summarises for a while after it lists a thread; a thread
/// written to since is not archived under the sweep's old summary.
async fn b4_a_session_that_came_back_after_the_sweep_listed_it_is_not_archived(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    let turn = serde_json::json!({"role": "user", "content": "hi"});
    let commit = RunCommit {
        history: vec![turn.to_string().into()],
        release: true,
        ..RunCommit::default()
    };
    s.commit(&lease, commit).await.unwrap();
    let listed_idle_before = std::time::SystemTime::now();
    user_says(s.as_ref(), "t1", "I'm back").await;
    let e = ending(RunState::Cancelled, 1);
    let swept = s
        .archive_history("t1", "alice", "x", &e, None, Some(listed_idle_before))
        .await
        .unwrap();
    assert!(swept.is_none(), "{swept:?}");
    assert_eq!(s.history("t1").await.unwrap().len(), 1, "the history stays");
    let later = std::time::SystemTime::now() + Duration::from_secs(1);
    let swept = s
        .archive_history("t1", "alice", "x", &e, None, Some(later))
        .await
        .unwrap();
    assert!(swept.is_some(), "idle since: archived");
}

/// B-4: every replica's sweep lists the same idle sessions; one claims each, and only it
/// calls the summary model. A claim lapses by itself (its sweep may have died).
async fn b4_one_sweep_claims_an_idle_session_until_its_claim_lapses(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "t").await.unwrap();
    assert!(
        s.claim_archive("t1", Duration::from_millis(300))
            .await
            .unwrap()
    );
    assert!(
        !s.claim_archive("t1", Duration::from_secs(60))
            .await
            .unwrap(),
        "another replica's sweep skips it"
    );
    assert!(
        !s.claim_archive("t2", Duration::from_secs(60))
            .await
            .unwrap(),
        "no such thread"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !s
        .claim_archive("t1", Duration::from_secs(60))
        .await
        .unwrap()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the claim never lapsed"
        );
        tokio::task::yield_now().await;
    }
}

/// Task agent `id` of `owner`, queued from thread `thread`, never tried.
/// What the thread's messages say, oldest first.
async fn posted_on(s: &Arc<dyn AgentStore>, thread: &str) -> Vec<String> {
    s.list_messages(thread, 0, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.content)
        .collect()
}

fn queued_task(id: &str, owner: &str, thread: &str) -> TaskAgent {
    TaskAgent {
        id: id.into(),
        owner: owner.into(),
        parent_thread_id: thread.into(),
        instructions: "do".into(),
        goal: "done".into(),
        state: "queued".into(),
        attempts: 0,
        last_error: None,
        result: None,
        created_at: SystemTime::now(),
        settled_attempt: 0,
        restarts: 0,
        // Kept as given: the task's runs read it.
        time_zone: Some("Europe/Berlin".into()),
    }
}

/// Alice's thread t1 with her task k1 queued on it.
async fn queue_alices_task_k1(s: &Arc<dyn AgentStore>) {
    s.create_thread("t1", "alice", "x").await.unwrap();
    assert!(
        s.enqueue_task_agent(&queued_task("k1", "alice", "t1"), 5, None)
            .await
            .unwrap()
    );
}

async fn the_task_queue_caps_open_tasks_per_user_and_settles_each_attempt_once(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    let task = |id: &str| queued_task(id, "alice", "t1");
    assert!(s.enqueue_task_agent(&task("k1"), 2, None).await.unwrap());
    assert!(s.enqueue_task_agent(&task("k2"), 2, None).await.unwrap());
    assert!(!s.enqueue_task_agent(&task("k3"), 2, None).await.unwrap());
    let claimed = s
        .claim_task_agent("w", Duration::from_secs(60), 5)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.attempts, 1);
    assert_eq!(claimed.time_zone.as_deref(), Some("Europe/Berlin"));
    let completed = TaskSettle {
        state: "completed",
        result: Some("ok"),
        error: None,
        retry_at: None,
        report: Some((MessageSource::Agent, "Task agent finished: ok")),
        tally: Tally::Try,
        attempt: claimed.attempts,
    };
    // An attempt whose claim was taken over (here: a later attempt number) settles nothing.
    let stale = TaskAgent {
        attempts: 0,
        ..claimed.clone()
    };
    let hold = Duration::from_secs(60);
    assert!(s.renew_task_claim(&claimed, "w", hold).await.unwrap());
    assert!(!s.renew_task_claim(&stale, "w", hold).await.unwrap());
    assert!(!s.settle_task_agent(&stale, "w", &completed).await.unwrap());
    assert!(
        s.settle_task_agent(&claimed, "w", &completed)
            .await
            .unwrap()
    );
    assert!(
        !s.settle_task_agent(&claimed, "w", &completed)
            .await
            .unwrap(),
        "settled once: a second settle of the same attempt is refused"
    );
    assert!(
        !s.renew_task_claim(&claimed, "w", hold).await.unwrap(),
        "a settled task has no claim to renew"
    );
    let posted = posted_on(s, "t1").await;
    assert_eq!(posted, ["Task agent finished: ok"], "the report, once");
    assert!(s.enqueue_task_agent(&task("k3"), 2, None).await.unwrap());
    assert_eq!(
        s.get_task_agent("alice", &claimed.id)
            .await
            .unwrap()
            .unwrap()
            .result
            .as_deref(),
        Some("ok")
    );
}

/// E-12: an attempt that takes over an earlier attempt's run (its worker went away) and
/// settles that run's failure spends no try of its own: the count goes back to the attempt
/// whose run it was, so a task's "other" error still gets its second try.
async fn e12_a_takeover_that_settles_an_earlier_attempts_run_spends_no_try(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    let task = queued_task("k1", "alice", "t1");
    assert!(s.enqueue_task_agent(&task, 5, None).await.unwrap());
    // A zero-long claim lapses at once: its worker "died" with its run going.
    let first = s.claim_task_agent("w1", Duration::ZERO, 5).await.unwrap();
    let first = first.expect("queued");
    let hold = Duration::from_secs(60);
    let takeover = s.claim_task_agent("w2", hold, 5).await.unwrap();
    let takeover = takeover.expect("lapsed: taken over");
    assert_eq!(takeover.attempts, 2);
    let failed = TaskSettle {
        state: "queued",
        result: None,
        error: Some("unknown tool"),
        retry_at: Some(SystemTime::now()),
        report: None,
        tally: Tally::Try,
        attempt: first.attempts,
    };
    assert!(s.settle_task_agent(&takeover, "w2", &failed).await.unwrap());
    let next = s.claim_task_agent("w3", hold, 5).await.unwrap();
    let next = next.expect("due again");
    assert_eq!(
        (next.attempts, next.settled_attempt),
        (2, 1),
        "the second try, after the first attempt's run was accounted for"
    );
}

/// B-5, E-12: an attempt that did not happen keeps its number; a stopping worker hands back
/// what it holds; a task whose every attempt lost its worker is failed and its parent told.
async fn task_claims_are_kept_handed_back_or_ended_by_their_rules(b: Backend) {
    let s = &b.store;
    queue_alices_task_k1(s).await;
    let hold = Duration::from_secs(60);
    let first = s.claim_task_agent("w1", hold, 3).await.unwrap().unwrap();
    assert_eq!((first.attempts, first.settled_attempt), (1, 0));
    let not_yet = TaskSettle {
        state: "queued",
        result: None,
        error: Some("thread busy"),
        retry_at: Some(SystemTime::now()),
        report: None,
        tally: Tally::NotAnAttempt,
        attempt: first.attempts,
    };
    assert!(s.settle_task_agent(&first, "w1", &not_yet).await.unwrap());
    let again = s.claim_task_agent("w1", hold, 3).await.unwrap().unwrap();
    assert_eq!(
        (again.attempts, again.settled_attempt),
        (1, 0),
        "the same attempt, and not settled: the run it may have started is followed"
    );

    assert_eq!(s.release_task_claims("w2").await.unwrap(), 0, "not w2's");
    assert_eq!(s.release_task_claims("w1").await.unwrap(), 1);
    // A zero-long claim lapses at once: the worker "died" on each of these attempts.
    let second = s
        .claim_task_agent("w2", Duration::ZERO, 3)
        .await
        .unwrap()
        .expect("handed back: ready at once");
    assert_eq!(
        (second.attempts, second.settled_attempt),
        (1, 0),
        "the same attempt, taken over: a stop is not the task's failure"
    );
    assert!(
        !s.settle_task_agent(&again, "w1", &not_yet).await.unwrap(),
        "a handed-back attempt that was taken over settles nothing"
    );
    // An attempt that ran and failed is settled: its run is accounted for.
    let retry = TaskSettle {
        error: Some("HTTP 503"),
        tally: Tally::Try,
        attempt: second.attempts,
        ..not_yet
    };
    assert!(s.settle_task_agent(&second, "w2", &retry).await.unwrap());
    let third = s
        .claim_task_agent("w3", Duration::ZERO, 3)
        .await
        .unwrap()
        .expect("due again");
    assert_eq!((third.attempts, third.settled_attempt), (2, 1));
    let last = s
        .claim_task_agent("w4", Duration::ZERO, 3)
        .await
        .unwrap()
        .expect("its claim lapsed: taken over");
    assert_eq!((last.attempts, last.settled_attempt), (3, 1));
    assert!(
        s.claim_task_agent("w5", hold, 3).await.unwrap().is_none(),
        "a claim that lapsed on the last attempt is not taken again"
    );
    assert_eq!(
        s.fail_lapsed_task_agents(3, "it kept stopping")
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        s.fail_lapsed_task_agents(3, "it kept stopping")
            .await
            .unwrap(),
        0,
        "failed once"
    );
    let task = s.get_task_agent("alice", "k1").await.unwrap().unwrap();
    assert_eq!(
        (task.state.as_str(), task.last_error.as_deref()),
        ("failed", Some("it kept stopping"))
    );
    let posted = posted_on(s, "t1").await;
    assert_eq!(
        posted,
        ["Task agent could not finish (done): it kept stopping"]
    );
}

/// B-5: a task handed back by a stopping worker on its last attempt is taken up again by
/// another, not failed as if its worker had died.
async fn b5_a_task_handed_back_on_its_last_attempt_is_taken_up_not_failed(b: Backend) {
    let s = &b.store;
    queue_alices_task_k1(s).await;
    let hold = Duration::from_secs(60);
    let first = s
        .claim_task_agent("w1", Duration::ZERO, 2)
        .await
        .unwrap()
        .unwrap();
    let last = s.claim_task_agent("w2", hold, 2).await.unwrap().unwrap();
    assert_eq!(
        (first.attempts, last.attempts),
        (1, 2),
        "w1 died; w2 has the last try"
    );
    assert_eq!(
        s.release_task_claims("w2").await.unwrap(),
        1,
        "w2 is stopping"
    );
    assert_eq!(
        s.fail_lapsed_task_agents(2, "it kept stopping")
            .await
            .unwrap(),
        0,
        "a hand-back is not a lapse"
    );
    let taken = s
        .claim_task_agent("w3", hold, 2)
        .await
        .unwrap()
        .expect("handed back: taken up at once");
    assert_eq!(
        (taken.attempts, taken.settled_attempt),
        (2, 0),
        "the same last attempt, so its run is followed rather than a third started"
    );
    assert!(posted_on(s, "t1").await.is_empty(), "no failure posted");
}

/// B-5: a task agent is queued only under the live lease of the run whose call queues it: a
/// run that lost its thread to a takeover (whose next run closes the call from the task queue)
/// queues nothing after it, so that run's "not executed" stays true.
async fn b5_a_task_agent_is_queued_only_under_its_runs_live_lease(b: Backend) {
    let s = &b.store;
    s.create_thread("t1", "alice", "x").await.unwrap();
    let LockOutcome::Acquired(lapsed) = s.lock_thread("t1", "r1", Duration::ZERO).await.unwrap()
    else {
        panic!("the thread was free")
    };
    let LockOutcome::Acquired(taker) = s
        .lock_thread("t1", "r2", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("a lapsed lease is taken over")
    };
    let refused = s
        .enqueue_task_agent(&queued_task("k1", "alice", "t1"), 5, Some(&lapsed))
        .await;
    assert!(matches!(refused, Err(StoreError::LeaseLost)), "{refused:?}");
    assert!(s.get_task_agent("alice", "k1").await.unwrap().is_none());
    assert!(
        s.enqueue_task_agent(&queued_task("k2", "alice", "t1"), 5, Some(&taker))
            .await
            .unwrap()
    );
    assert!(s.get_task_agent("alice", "k2").await.unwrap().is_some());
}

/// B-5, E-12: an attempt whose run a restart of its service stopped is settled — the next
/// attempt starts a run of its own — but is no try: a task meets every rolling deploy without
/// using up its retries, and its last try is still taken over when its worker dies.
async fn b5_a_restart_settles_an_attempt_without_spending_a_try(b: Backend) {
    let s = &b.store;
    queue_alices_task_k1(s).await;
    let hold = Duration::from_secs(60);
    let restarted = |attempt| TaskSettle {
        state: "queued",
        result: None,
        error: Some("the service was restarted"),
        retry_at: Some(SystemTime::now()),
        report: None,
        tally: Tally::Restart,
        attempt,
    };
    for n in 1..=3 {
        let claimed = s.claim_task_agent("w", hold, 2).await.unwrap().unwrap();
        assert_eq!(
            (claimed.attempts, claimed.settled_attempt, claimed.restarts),
            (n, n - 1, n - 1),
            "attempt {n}: a new number each time (so a run of its own), no try spent"
        );
        assert!(
            s.settle_task_agent(&claimed, "w", &restarted(n))
                .await
                .unwrap()
        );
    }
    // Four attempts, three of them restarts: this is the first try, then the second.
    let first_try = s
        .claim_task_agent("w1", Duration::ZERO, 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((first_try.attempts, first_try.restarts), (4, 3));
    let last_try = s
        .claim_task_agent("w2", Duration::ZERO, 2)
        .await
        .unwrap()
        .expect("its worker died on the first try: the second is still due");
    assert_eq!(last_try.attempts, 5);
    assert!(
        s.claim_task_agent("w3", hold, 2).await.unwrap().is_none(),
        "a claim that lapsed on the last try is not taken again"
    );
    assert_eq!(
        s.fail_lapsed_task_agents(2, "it kept stopping")
            .await
            .unwrap(),
        1,
        "two tries lapsed, whatever the restarts before them"
    );
}

/// B-5: a task that completes after an attempt that did not shows no error: the note its
/// restart left ("being run again") is not a task's last word once it has finished.
async fn b5_a_task_completed_after_a_restart_shows_no_error(b: Backend) {
    let s = &b.store;
    queue_alices_task_k1(s).await;
    let hold = Duration::from_secs(60);
    let claimed = s.claim_task_agent("w", hold, 2).await.unwrap().unwrap();
    let restarted = TaskSettle {
        state: "queued",
        result: None,
        error: Some("the service was restarted; it is being run again"),
        retry_at: Some(SystemTime::now()),
        report: None,
        tally: Tally::Restart,
        attempt: claimed.attempts,
    };
    assert!(
        s.settle_task_agent(&claimed, "w", &restarted)
            .await
            .unwrap()
    );
    let shown = s.get_task_agent("alice", "k1").await.unwrap().unwrap();
    assert_eq!(shown.last_error.as_deref(), restarted.error);

    let claimed = s.claim_task_agent("w", hold, 2).await.unwrap().unwrap();
    let completed = TaskSettle {
        state: "completed",
        result: Some("done"),
        error: None,
        retry_at: None,
        report: None,
        tally: Tally::Try,
        attempt: claimed.attempts,
    };
    assert!(
        s.settle_task_agent(&claimed, "w", &completed)
            .await
            .unwrap()
    );
    let shown = s.get_task_agent("alice", "k1").await.unwrap().unwrap();
    assert_eq!(
        (
            shown.state.as_str(),
            shown.result.as_deref(),
            shown.last_error
        ),
        ("completed", Some("done"), None)
    );
}

/// A stopping worker hands back the occurrences its holders (`worker/claim`) hold, and only
/// those: another worker takes them over at once, and the old holder can no longer settle.
async fn a_stopping_workers_occurrences_are_handed_back(b: Backend) {
    let s = &b.store;
    for id in ["s1", "s2"] {
        s.create_schedule(&every_minute(id, "alice", t0()), 10, None)
            .await
            .unwrap();
    }
    let now = t0() + secs(61);
    let mine = s
        .claim_schedule("w1/a", now, secs(600))
        .await
        .unwrap()
        .unwrap();
    let theirs = s
        .claim_schedule("w10/b", now, secs(600))
        .await
        .unwrap()
        .unwrap();
    assert_ne!(mine.schedule.id, theirs.schedule.id);
    assert_eq!(s.release_schedule_holds("w1").await.unwrap(), 1);
    let taken = s
        .claim_schedule("w2/c", now, secs(600))
        .await
        .unwrap()
        .expect("handed back: taken over at once");
    assert_eq!(
        (&taken.schedule.id, taken.due_at, taken.attempt),
        (&mine.schedule.id, mine.due_at, mine.attempt),
        "the same occurrence and attempt"
    );
    let done = Settle::Done {
        outcome: ScheduleOutcome::Completed,
        run_id: None,
        error: None,
    };
    assert!(!s.settle_schedule(&mine, "w1/a", &done).await.unwrap());
    assert!(s.settle_schedule(&theirs, "w10/b", &done).await.unwrap());
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
    user_says(s.as_ref(), "t1", "hi").await;
    let mine = s.list_threads("alice", None, 10).await.unwrap();
    let ids: Vec<_> = mine.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["t1", "t2"], "most recently updated first");
    let rest = s
        .list_threads("alice", Some(&ThreadCursor::after(&mine[0])), 10)
        .await
        .unwrap();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].id, "t2");
}

/// A user's message on `thread`, which makes it the most recently updated.
async fn user_says(s: &dyn AgentStore, thread: &str, text: &str) {
    s.add_message(
        thread,
        None,
        MessageSource::User,
        MessageKind::Text,
        text,
        serde_json::json!({}),
    )
    .await
    .unwrap();
}

/// ListThreads' pages are keyed by the last thread shown: a message on a thread further down
/// moves it to the top between pages, and the next page still starts after the last one
/// shown — never showing it again, as an offset would.
async fn a_page_of_threads_starts_after_the_last_one_shown(b: Backend) {
    let s = &b.store;
    for id in ["oldest", "middle", "newest"] {
        s.create_thread(id, "alice", id).await.unwrap();
        user_says(s.as_ref(), id, "hi").await;
    }
    let first = s.list_threads("alice", None, 1).await.unwrap();
    assert_eq!(first[0].id, "newest");
    user_says(s.as_ref(), "oldest", "again").await;
    let cursor = ThreadCursor::after(&first[0]);
    let next: Vec<String> = s
        .list_threads("alice", Some(&cursor), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(next, ["middle"], "newest is not shown twice");
}

/// B-3: a session opening finds the user's latest conversation however many threads Steward
/// started itself (task reports, schedule briefings) were updated after it — not only among
/// the newest few.
async fn b3_the_latest_conversation_is_found_behind_any_number_of_stewards_threads(b: Backend) {
    let s = &b.store;
    let skip = ["task-", "schedule-"];
    assert_eq!(s.latest_thread_except("alice", &skip).await.unwrap(), None);
    for id in ["older-chat", "chat"] {
        s.create_thread(id, "alice", id).await.unwrap();
        user_says(s.as_ref(), id, "hi").await;
    }
    s.create_thread("bobs-chat", "bob", "bob").await.unwrap();
    for n in 0..30 {
        let id = if n % 2 == 0 {
            format!("task-{n}")
        } else {
            format!("schedule-{n}")
        };
        s.create_thread(&id, "alice", "report").await.unwrap();
        user_says(s.as_ref(), &id, "report").await;
    }
    let latest = s.latest_thread_except("alice", &skip).await.unwrap();
    assert_eq!(latest.map(|t| t.id).as_deref(), Some("chat"));
    user_says(s.as_ref(), "older-chat", "back again").await;
    let latest = s.latest_thread_except("alice", &skip).await.unwrap();
    assert_eq!(latest.map(|t| t.id).as_deref(), Some("older-chat"));
    let unfiltered = s.latest_thread_except("alice", &[]).await.unwrap();
    assert_eq!(unfiltered.map(|t| t.id).as_deref(), Some("older-chat"));
}

/// The usage of these calls: (provider, model, input tokens, output tokens, cost).
fn spent(calls: &[(&str, &str, u64, u64, f64)]) -> RunUsage {
    let calls: Vec<ModelCallUsage> = calls
        .iter()
        .map(|&(provider, model, input, output, cost)| ModelCallUsage {
            provider: provider.into(),
            model: model.into(),
            input_tokens: input,
            output_tokens: output,
            cost_usd: cost,
            ..ModelCallUsage::default()
        })
        .collect();
    RunUsage {
        input_tokens: calls.iter().map(|c| c.input_tokens).sum(),
        output_tokens: calls.iter().map(|c| c.output_tokens).sum(),
        cost_usd: calls.iter().map(|c| c.cost_usd).sum(),
        calls,
        ..RunUsage::default()
    }
}

/// A commit ending a run in `state`, having spent what `calls` did (see `spent`).
fn ended_having_spent(state: RunState, calls: &[(&str, &str, u64, u64, f64)]) -> RunCommit {
    RunCommit {
        events: vec![(2, b"end".to_vec())],
        patch: RunPatch {
            state: Some(state),
            usage: Some(spent(calls)),
            ..RunPatch::default()
        },
        release: true,
        ..RunCommit::default()
    }
}

async fn e10_usage_sums_an_owners_runs_in_a_window_by_model_whatever_their_end(b: Backend) {
    let s = &b.store;
    let before = SystemTime::now() - Duration::from_secs(1);
    let completed = started(s, "r1", "t1", Duration::from_secs(60)).await;
    let calls = [
        ("openai", "gpt-4o", 100, 20, 0.25),
        ("anthropic", "claude", 50, 5, 0.5),
        ("openai", "gpt-4o", 10, 2, 0.125),
    ];
    s.commit(&completed, ended_having_spent(RunState::Completed, &calls))
        .await
        .unwrap();
    let cancelled = started(s, "r2", "t2", Duration::from_secs(60)).await;
    s.commit(&cancelled, ended_having_spent(RunState::Cancelled, &[]))
        .await
        .unwrap();
    let Admitted::Started { lease: bobs, .. } =
        s.admit(&admit_new("r3", "t3", "bob", None)).await.unwrap()
    else {
        panic!("bob's run not admitted");
    };
    let bobs_spend = [("openai", "gpt-4o", 999, 9, 1.0)];
    s.commit(&bobs, ended_having_spent(RunState::Completed, &bobs_spend))
        .await
        .unwrap();
    // A session summary the summary model wrote: alice's cost too.
    let summarised = spent(&[("openai", "gpt-4o-mini", 30, 3, 0.0625)]);
    s.record_summary_spend("alice", &summarised).await.unwrap();
    let after = SystemTime::now() + Duration::from_secs(1);

    let summed = s.usage("alice", before, after).await.unwrap();
    assert_eq!(summed.runs, 2, "a run with no call counts as a run");
    assert_eq!(summed.summaries, 1);
    let model = |provider: &str, model: &str, calls, input, output, cost_usd| ModelUsage {
        provider: provider.into(),
        model: model.into(),
        calls,
        input_tokens: input,
        output_tokens: output,
        cached_tokens: 0,
        cost_usd,
    };
    assert_eq!(
        summed.models,
        [
            model("anthropic", "claude", 1, 50, 5, 0.5),
            model("openai", "gpt-4o", 2, 110, 22, 0.375),
            model("openai", "gpt-4o-mini", 1, 30, 3, 0.0625),
        ],
        "one line per model, the costliest first, bob's run left out"
    );
    assert_eq!(summed.total(), model("", "", 4, 190, 30, 0.9375));

    let later = s
        .usage("alice", after, after + Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(
        later,
        UsageSummary::default(),
        "runs started before the window"
    );
}

async fn a_cancel_request_reaches_the_lease_holder_and_idle_threads_are_found(b: Backend) {
    let s = &b.store;
    s.ping().await.unwrap();
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    assert!(s.request_cancel("r1", Some("wrong thread")).await.unwrap());
    assert!(
        s.request_cancel("r1", Some("a later reason"))
            .await
            .unwrap(),
        "asked twice, still live"
    );
    assert_eq!(
        s.renew_lease(&lease, Duration::from_secs(60))
            .await
            .unwrap(),
        Some(true),
        "the holder learns of the cancel when it renews"
    );
    let run = s.get_run("alice", "r1").await.unwrap().unwrap();
    assert!(run.cancel_requested);
    assert_eq!(
        run.cancel_reason.as_deref(),
        Some("wrong thread"),
        "the first reason given is kept"
    );
    s.commit(
        &lease,
        RunCommit {
            history: vec![
                serde_json::json!({"role": "user", "content": "hi"})
                    .to_string()
                    .into(),
            ],
            release: true,
            ..RunCommit::default()
        },
    )
    .await
    .unwrap();
    let future = SystemTime::now() + Duration::from_secs(60);
    assert_eq!(
        s.idle_threads_with_history(future).await.unwrap(),
        [("t1".to_owned(), "alice".to_owned())]
    );
    assert!(
        s.idle_threads_with_history(SystemTime::now() - Duration::from_secs(60))
            .await
            .unwrap()
            .is_empty()
    );
    s.record_audit(
        "alice",
        "approval_requested",
        Some("r1"),
        serde_json::json!({"n": 1}),
    )
    .await
    .unwrap();
    assert_eq!(
        s.audit("alice").await.unwrap(),
        [("approval_requested".to_owned(), serde_json::json!({"n": 1}))]
    );
    assert!(s.audit("bob").await.unwrap().is_empty());
}

/// A heartbeat every minute of alice's, created at `t0` (whole seconds: PostgreSQL keeps
/// microseconds, and the tests compare times).
fn every_minute(id: &str, owner: &str, t0: SystemTime) -> Schedule {
    Schedule {
        id: id.into(),
        owner: owner.into(),
        kind: ScheduleKind::Heartbeat,
        prompt: String::new(),
        cron: None,
        every: Some(Duration::from_secs(60)),
        time_zone: "UTC".into(),
        enabled: true,
        thread_id: None,
        next_due_at: t0 + Duration::from_secs(60),
        last_outcome: None,
        last_run_id: None,
        last_error: None,
        last_fired_at: None,
        occurrence_at: None,
        attempts: 0,
        restarts: 0,
        created_at: t0,
        updated_at: t0,
    }
}

fn t0() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

async fn schedules_belong_to_their_owner_and_the_per_user_cap_holds(b: Backend) {
    let s = &b.store;
    assert!(
        s.create_schedule(&every_minute("s1", "alice", t0()), 2, None)
            .await
            .unwrap()
    );
    let with_thread = |id: &str, t| Schedule {
        thread_id: Some(format!("schedule-{id}")),
        ..every_minute(id, "alice", t)
    };
    assert!(
        s.create_schedule(&with_thread("s2", t0() + secs(1)), 2, Some("Heartbeat"))
            .await
            .unwrap()
    );
    assert_eq!(
        s.get_thread("alice", "schedule-s2")
            .await
            .unwrap()
            .unwrap()
            .title,
        "Heartbeat",
        "created with its schedule"
    );
    assert!(
        !s.create_schedule(&with_thread("s3", t0()), 2, Some("Heartbeat"))
            .await
            .unwrap()
    );
    assert!(
        s.get_thread("alice", "schedule-s3")
            .await
            .unwrap()
            .is_none(),
        "a schedule refused at the cap leaves no thread behind"
    );
    assert!(
        s.create_schedule(&every_minute("s4", "bob", t0()), 2, None)
            .await
            .unwrap()
    );
    let ids: Vec<String> = s
        .list_schedules("alice")
        .await
        .unwrap()
        .into_iter()
        .map(|x| x.id)
        .collect();
    assert_eq!(ids, ["s1", "s2"]);
    assert!(s.get_schedule("bob", "s1").await.unwrap().is_none());
    assert!(!s.delete_schedule("bob", "s1").await.unwrap());
    let read = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    let mut changed = Schedule {
        owner: "bob".into(),
        ..read.clone()
    };
    assert!(
        !s.save_schedule(&changed, true).await.unwrap(),
        "bob cannot change alice's schedule"
    );
    changed.owner = "alice".into();
    changed.prompt = "anything new?".into();
    assert!(s.save_schedule(&changed, true).await.unwrap());
    // Another update that read the schedule before that one: it would undo the new prompt.
    let stale = Schedule {
        enabled: false,
        ..read
    };
    assert!(
        !s.save_schedule(&stale, true).await.unwrap(),
        "a save over a schedule changed since it was read writes nothing"
    );
    let mut again = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    again.enabled = false;
    assert!(s.save_schedule(&again, true).await.unwrap());
    let got = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    assert_eq!(
        (got.prompt.as_str(), got.enabled),
        ("anything new?", false),
        "both changes stand"
    );
    assert!(s.delete_schedule("alice", "s1").await.unwrap());
    assert!(s.get_schedule("alice", "s1").await.unwrap().is_none());
}

async fn a_due_occurrence_is_claimed_once_and_missed_slots_collapse_into_it(b: Backend) {
    let s = &b.store;
    s.create_schedule(&every_minute("s1", "alice", t0()), 10, None)
        .await
        .unwrap();
    assert!(
        s.claim_schedule("w1", t0() + secs(30), secs(600))
            .await
            .unwrap()
            .is_none(),
        "not due yet"
    );
    // Four slots (t0+60 .. t0+240) passed with nobody firing: one occurrence, the first slot's.
    let now = t0() + secs(250);
    let o = s
        .claim_schedule("w1", now, secs(600))
        .await
        .unwrap()
        .expect("due");
    assert_eq!((o.due_at, o.attempt), (t0() + secs(60), 1));
    assert_eq!(
        o.schedule.next_due_at,
        t0() + secs(300),
        "the next due time moved past now"
    );
    assert!(
        s.claim_schedule("w2", now, secs(600))
            .await
            .unwrap()
            .is_none(),
        "held by w1"
    );
    let done = Settle::Done {
        outcome: ScheduleOutcome::Completed,
        run_id: Some("r1".into()),
        error: None,
    };
    assert!(s.settle_schedule(&o, "w1", &done).await.unwrap());
    assert!(
        s.claim_schedule("w2", now, secs(600))
            .await
            .unwrap()
            .is_none(),
        "nothing owed"
    );
    let got = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    assert_eq!(got.last_outcome, Some(ScheduleOutcome::Completed));
    assert_eq!(got.last_run_id.as_deref(), Some("r1"));
    assert_eq!(got.occurrence_at, None);
    let next = s
        .claim_schedule("w2", t0() + secs(300), secs(600))
        .await
        .unwrap()
        .expect("due again");
    assert_eq!(next.due_at, t0() + secs(300));
}

async fn of_concurrent_claimers_exactly_one_gets_an_occurrence(b: Backend) {
    let s = &b.store;
    s.create_schedule(&every_minute("s1", "alice", t0()), 10, None)
        .await
        .unwrap();
    let claims = futures_util::future::join_all((0..8).map(|i| {
        let s = s.clone();
        async move {
            s.claim_schedule(&format!("w{i}"), t0() + secs(61), secs(600))
                .await
                .unwrap()
        }
    }))
    .await;
    assert_eq!(claims.iter().filter(|c| c.is_some()).count(), 1);
}

async fn an_occurrence_is_retried_taken_over_or_run_now_only_by_its_rules(b: Backend) {
    let s = &b.store;
    s.create_schedule(&every_minute("s1", "alice", t0()), 10, None)
        .await
        .unwrap();
    let now = t0() + secs(61);
    let o: Occurrence = s
        .claim_schedule("w1", now, secs(600))
        .await
        .unwrap()
        .unwrap();
    let again = Settle::Again {
        outcome: ScheduleOutcome::Retrying,
        run_id: Some("r1".into()),
        tally: Tally::Try,
        error: Some("HTTP 429".into()),
        at: now + secs(10),
    };
    assert!(
        !s.settle_schedule(&o, "w2", &again).await.unwrap(),
        "only the holder settles"
    );
    assert!(s.settle_schedule(&o, "w1", &again).await.unwrap());
    assert!(
        s.claim_schedule("w2", now + secs(5), secs(600))
            .await
            .unwrap()
            .is_none(),
        "backing off"
    );
    let retry = s
        .claim_schedule("w2", now + secs(10), secs(600))
        .await
        .unwrap()
        .expect("retry due");
    assert_eq!(
        (retry.due_at, retry.attempt),
        (o.due_at, 2),
        "the same occurrence, attempt 2"
    );
    // w2 dies holding it: after the hold another worker takes the same attempt over.
    let taken = s
        .claim_schedule("w3", now + secs(611), secs(600))
        .await
        .unwrap()
        .expect("taken over");
    assert_eq!((taken.due_at, taken.attempt), (o.due_at, 2));
    let late = Settle::Done {
        outcome: ScheduleOutcome::Completed,
        run_id: None,
        error: None,
    };
    assert!(
        !s.settle_schedule(&retry, "w2", &late).await.unwrap(),
        "the displaced holder cannot settle"
    );
    assert!(matches!(
        s.claim_schedule_now("alice", "s1", "api", now + secs(612), secs(600))
            .await,
        Err(StoreError::Conflict(_))
    ));
    let done = Settle::Done {
        outcome: ScheduleOutcome::Failed,
        run_id: None,
        error: Some("gave up".into()),
    };
    assert!(s.settle_schedule(&taken, "w3", &done).await.unwrap());
    assert!(
        s.claim_schedule_now("bob", "s1", "api", now, secs(600))
            .await
            .unwrap()
            .is_none()
    );
    let at_once = s
        .claim_schedule_now("alice", "s1", "api", now + secs(700), secs(600))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((at_once.due_at, at_once.attempt), (now + secs(700), 1));
    let got = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    assert_eq!(got.last_outcome, Some(ScheduleOutcome::Running));
}

/// E-12: an occurrence's attempt that a restart stopped is settled as an attempt (the next one
/// starts a run of its own, under its own request id) but counted in `restarts`, so its tries
/// are `attempts - restarts`; a settled occurrence starts the next one at zero.
async fn e12_a_restart_settles_an_occurrences_attempt_without_spending_a_try(b: Backend) {
    let s = &b.store;
    s.create_schedule(&every_minute("s1", "alice", t0()), 10, None)
        .await
        .unwrap();
    let now = t0() + secs(61);
    let first = s
        .claim_schedule("w1", now, secs(600))
        .await
        .unwrap()
        .unwrap();
    let restarted = Settle::Again {
        outcome: ScheduleOutcome::Retrying,
        tally: Tally::Restart,
        run_id: Some("r1".into()),
        error: Some("the service running it was restarted".into()),
        at: now,
    };
    assert!(s.settle_schedule(&first, "w1", &restarted).await.unwrap());
    let second = s
        .claim_schedule("w2", now, secs(600))
        .await
        .unwrap()
        .expect("taken up again at once");
    assert_eq!(
        (second.due_at, second.attempt, second.schedule.restarts),
        (first.due_at, 2, 1),
        "a new attempt, and the restart counted"
    );
    let failed = Settle::Again {
        outcome: ScheduleOutcome::Retrying,
        tally: Tally::Try,
        run_id: Some("r2".into()),
        error: Some("HTTP 429".into()),
        at: now + secs(10),
    };
    assert!(s.settle_schedule(&second, "w2", &failed).await.unwrap());
    let third = s
        .claim_schedule("w3", now + secs(10), secs(600))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((third.attempt, third.schedule.restarts), (3, 1));
    let done = Settle::Done {
        outcome: ScheduleOutcome::Completed,
        run_id: Some("r3".into()),
        error: None,
    };
    assert!(s.settle_schedule(&third, "w3", &done).await.unwrap());
    let got = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    assert_eq!((got.attempts, got.restarts), (0, 0));
    let next = s
        .claim_schedule("w4", now + secs(600), secs(600))
        .await
        .unwrap()
        .expect("the next occurrence");
    assert_eq!((next.attempt, next.schedule.restarts), (1, 0));
}

async fn switching_a_schedule_off_drops_a_waiting_occurrence_but_not_a_running_one(b: Backend) {
    let s = &b.store;
    s.create_schedule(&every_minute("s1", "alice", t0()), 10, None)
        .await
        .unwrap();
    s.create_schedule(&every_minute("s2", "alice", t0()), 10, None)
        .await
        .unwrap();
    let now = t0() + secs(61);
    let mut waiting = None;
    let mut running = None;
    while let Some(o) = s.claim_schedule("w1", now, secs(600)).await.unwrap() {
        if o.schedule.id == "s1" {
            waiting = Some(o)
        } else {
            running = Some(o)
        }
    }
    let (waiting, running) = (waiting.unwrap(), running.unwrap());
    let postponed = Settle::Again {
        outcome: ScheduleOutcome::Postponed,
        tally: Tally::NotAnAttempt,
        run_id: None,
        error: Some("busy".into()),
        at: now + secs(30),
    };
    assert!(s.settle_schedule(&waiting, "w1", &postponed).await.unwrap());
    for id in ["s1", "s2"] {
        let mut off = s.get_schedule("alice", id).await.unwrap().unwrap();
        off.enabled = false;
        off.next_due_at = t0();
        assert!(s.save_schedule(&off, false).await.unwrap());
        let got = s.get_schedule("alice", id).await.unwrap().unwrap();
        assert_eq!(
            got.next_due_at,
            t0() + secs(120),
            "{id}: without reschedule the due time stands"
        );
    }
    assert_eq!(
        s.get_schedule("alice", "s1")
            .await
            .unwrap()
            .unwrap()
            .occurrence_at,
        None
    );
    assert!(
        s.claim_schedule("w2", now + secs(300), secs(600))
            .await
            .unwrap()
            .is_none(),
        "the waiting occurrence is gone; the running one is still held"
    );
    let done = Settle::Done {
        outcome: ScheduleOutcome::Completed,
        run_id: Some("r2".into()),
        error: None,
    };
    assert!(
        s.settle_schedule(&running, "w1", &done).await.unwrap(),
        "a run in progress still settles after its schedule was switched off"
    );
}

/// C-1: an occurrence whose run is going but which no worker holds for the moment (its
/// follower handed it back at shutdown, or lost the store) is not dropped when the schedule is
/// switched off: the worker that takes it up follows the run and records its end.
async fn switching_a_schedule_off_keeps_an_occurrence_whose_run_is_going_unheld(b: Backend) {
    let s = &b.store;
    s.create_schedule(&every_minute("s1", "alice", t0()), 10, None)
        .await
        .unwrap();
    let now = t0() + secs(61);
    let claimed = s
        .claim_schedule("w1", now, secs(600))
        .await
        .unwrap()
        .unwrap();
    let started = Settle::Running {
        run_id: "r1".into(),
        until: now + secs(600),
    };
    assert!(s.settle_schedule(&claimed, "w1", &started).await.unwrap());
    let follow_later = Settle::Again {
        outcome: ScheduleOutcome::Running,
        tally: Tally::NotAnAttempt,
        run_id: Some("r1".into()),
        error: Some("could not follow the run".into()),
        at: now + secs(30),
    };
    assert!(
        s.settle_schedule(&claimed, "w1", &follow_later)
            .await
            .unwrap()
    );
    let mut off = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    off.enabled = false;
    assert!(s.save_schedule(&off, false).await.unwrap());
    let got = s.get_schedule("alice", "s1").await.unwrap().unwrap();
    assert_eq!(got.occurrence_at, Some(claimed.due_at), "kept");
    let again = s
        .claim_schedule("w2", now + secs(60), secs(600))
        .await
        .unwrap();
    let again = again.expect("taken up again to follow its run");
    assert_eq!(again.schedule.last_run_id.as_deref(), Some("r1"));
}

/// Issue 13: history turns travel as JSON text; a store refuses a turn that is not JSON with
/// the rest of its commit, so every turn it keeps can be read and archived later.
async fn a_history_turn_that_is_not_json_is_refused_with_its_commit(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    let mut bad = events(&[2]);
    bad.history = vec![
        serde_json::json!({"role": "user", "content": "fine"})
            .to_string()
            .into(),
        "{not json".into(),
    ];
    assert!(
        s.commit(&lease, bad).await.is_err(),
        "a turn that is not JSON is refused"
    );
    assert_eq!(
        seqs(s.as_ref(), "r1").await,
        [1],
        "nothing of the refused commit landed"
    );
    assert!(
        s.history("t1").await.unwrap().is_empty(),
        "no turn of it either"
    );
}

/// On PostgreSQL a commit is one statement built from the parts it holds (issue 13); every
/// one of the 128 combinations of parts lands whole, in both stores alike.
async fn every_combination_of_a_commits_parts_lands(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(600)).await;
    let (mut seq, mut want) = (1u64, [0usize; 7]);
    for combination in 0..128u32 {
        let has = |part: u32| combination & (1 << part) != 0;
        let mut c = RunCommit::default();
        if has(0) {
            seq += 1;
            c.events = vec![(seq, format!("event {combination}").into_bytes())];
        }
        if has(1) {
            c.history = vec![
                serde_json::json!({"role": "user", "content": combination})
                    .to_string()
                    .into(),
            ];
        }
        if has(2) {
            c.actions = vec![action(
                "r1",
                &format!("c{combination}"),
                ActionState::Executing,
            )];
        }
        if has(3) {
            c.messages = vec![NewMessage::text(
                MessageSource::Agent,
                format!("message {combination}"),
            )];
        }
        if has(4) {
            c.patch.iterations = Some(combination);
        }
        if has(5) {
            c.approval = Some(approval(
                &format!("a{combination}"),
                "r1",
                "t1",
                Duration::from_secs(600),
            ));
        }
        if has(6) {
            c.audit = vec![("combination".into(), serde_json::json!(combination))];
        }
        for (part, n) in want.iter_mut().enumerate() {
            *n += usize::from(has(part as u32));
        }
        s.commit(&lease, c)
            .await
            .unwrap_or_else(|e| panic!("combination {combination:07b}: {e:?}"));
    }
    assert_eq!(seqs(s.as_ref(), "r1").await.len(), 1 + want[0], "events");
    assert_eq!(s.history("t1").await.unwrap().len(), want[1], "history");
    assert_eq!(
        s.list_actions("r1").await.unwrap().len(),
        want[2],
        "actions"
    );
    let messages = s.list_messages("t1", 0, 1000).await.unwrap();
    assert_eq!(
        messages
            .iter()
            .filter(|m| m.content.starts_with("message "))
            .count(),
        want[3],
        "messages"
    );
    let run = s.get_run("alice", "r1").await.unwrap().unwrap();
    assert_eq!(run.iterations, 127, "the last patch's iterations");
    assert_eq!(run.last_event_seq, 1 + want[0] as u64);
    assert!(s.get_approval("alice", "a127").await.unwrap().is_some());
    assert_eq!(s.audit("alice").await.unwrap().len(), want[6], "audit");
}

/// An email a tool read, a model's arguments or a tool's answer can hold a NUL; PostgreSQL's
/// text and jsonb refuse one, which once failed every retry of the run's commit.
async fn q2_a_commit_with_nul_characters_from_hostile_content_lands(b: Backend) {
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    let mut read = action("r1", "c1", ActionState::Completed);
    read.arguments = serde_json::json!({"query\0": "from:\0evil"});
    read.result_text = Some("Subject: hi\0there".into());
    let turn = serde_json::json!({"role": "tool", "content": "body\0with a NUL"});
    s.commit(
        &lease,
        RunCommit {
            events: vec![(2, b"tool result".to_vec())],
            history: vec![turn.to_string().into()],
            actions: vec![read],
            messages: vec![NewMessage::text(MessageSource::Agent, "Ran read\0mail")],
            audit: vec![("tool".into(), serde_json::json!({"q": "\0"}))],
            release: true,
            ..RunCommit::default()
        },
    )
    .await
    .expect("a NUL never fails a commit");
    let history = s.history("t1").await.unwrap();
    let stored: serde_json::Value = serde_json::from_str(&history[0]).unwrap();
    let content = stored["content"].as_str().unwrap();
    assert!(
        content == "body\0with a NUL" || content == "body\u{fffd}with a NUL",
        "kept as given, or with the replacement character: {content:?}"
    );
}

steward_tests::both_backends!(
    threads_belong_to_their_owner,
    a_page_of_threads_starts_after_the_last_one_shown,
    b3_the_latest_conversation_is_found_behind_any_number_of_stewards_threads,
    a_thread_is_never_created_twice,
    the_thread_lease_has_one_holder_until_released_or_expired,
    concurrent_lockers_get_exactly_one_winner,
    admission_writes_run_message_and_first_event_or_nothing,
    a_retried_request_id_is_a_duplicate_and_the_run_cap_holds,
    a_commit_writes_everything_or_nothing_and_is_fenced_by_the_lease,
    of_concurrent_deciders_exactly_one_wins,
    r4_a_decision_does_not_take_its_owner_past_the_run_cap,
    an_expired_approval_cannot_be_decided,
    a_paused_run_ends_once_and_its_approval_expires,
    a_run_whose_lease_lapsed_is_ended_once_after_a_gap,
    a_new_message_supersedes_a_paused_run,
    archiving_moves_history_and_ends_paused_runs,
    p1_an_archive_says_whether_its_session_read_external_content,
    a_thread_held_by_another_run_is_not_archived,
    b4_a_session_that_came_back_after_the_sweep_listed_it_is_not_archived,
    b4_one_sweep_claims_an_idle_session_until_its_claim_lapses,
    a_history_turn_that_is_not_json_is_refused_with_its_commit,
    q2_a_commit_with_nul_characters_from_hostile_content_lands,
    every_combination_of_a_commits_parts_lands,
    an_admission_reads_the_owners_newest_session_summaries,
    the_task_queue_caps_open_tasks_per_user_and_settles_each_attempt_once,
    task_claims_are_kept_handed_back_or_ended_by_their_rules,
    b5_a_restart_settles_an_attempt_without_spending_a_try,
    b5_a_task_completed_after_a_restart_shows_no_error,
    b5_a_task_agent_is_queued_only_under_its_runs_live_lease,
    b5_a_task_handed_back_on_its_last_attempt_is_taken_up_not_failed,
    e12_a_takeover_that_settles_an_earlier_attempts_run_spends_no_try,
    a_stopping_workers_occurrences_are_handed_back,
    a_cancel_request_reaches_the_lease_holder_and_idle_threads_are_found,
    e10_usage_sums_an_owners_runs_in_a_window_by_model_whatever_their_end,
    schedules_belong_to_their_owner_and_the_per_user_cap_holds,
    a_due_occurrence_is_claimed_once_and_missed_slots_collapse_into_it,
    of_concurrent_claimers_exactly_one_gets_an_occurrence,
    an_occurrence_is_retried_taken_over_or_run_now_only_by_its_rules,
    e12_a_restart_settles_an_occurrences_attempt_without_spending_a_try,
    events_of_runs_ended_before_the_cutoff_are_thinned_to_their_result_once,
    switching_a_schedule_off_drops_a_waiting_occurrence_but_not_a_running_one,
    switching_a_schedule_off_keeps_an_occurrence_whose_run_is_going_unheld,
);

/// Run `id` on its own thread: events 1 (its admission) to 4 (its result), ended `at`.
async fn a_run_ended_at(s: &Arc<dyn AgentStore>, id: &str, at: SystemTime) {
    let lease = started(s, id, &format!("thread-of-{id}"), Duration::from_secs(60)).await;
    let ended = RunCommit {
        events: vec![
            (2, b"tool call".to_vec()),
            (3, b"tool result".to_vec()),
            (4, b"result".to_vec()),
        ],
        patch: RunPatch {
            state: Some(RunState::Completed),
            finished_at: Some(at),
            ..RunPatch::default()
        },
        release: true,
        ..RunCommit::default()
    };
    s.commit(&lease, ended).await.unwrap();
}

/// RUN_EVENTS_RETENTION: the runs that ended before the cutoff keep only their last event,
/// the result (what a watch of them replays); runs ended since, and runs not ended, keep
/// every event; each run is thinned once, oldest first, at most `limit` a call.
async fn events_of_runs_ended_before_the_cutoff_are_thinned_to_their_result_once(b: Backend) {
    let s = &b.store;
    let day = Duration::from_secs(86_400);
    let now = SystemTime::now();
    a_run_ended_at(s, "r-old", now - 40 * day).await;
    a_run_ended_at(s, "r-older", now - 50 * day).await;
    a_run_ended_at(s, "r-recent", now - day).await;
    let going = started(s, "r-going", "t-going", Duration::from_secs(60)).await;
    s.commit(&going, events(&[2, 3])).await.unwrap();
    // Paused for an approval, with a finish time from an earlier segment: not ended, so its
    // events are what its continuation and watchers replay.
    let paused = started(s, "r-paused", "t-paused", Duration::from_secs(60)).await;
    let pause = RunCommit {
        patch: RunPatch {
            state: Some(RunState::AwaitingConfirmation),
            finished_at: Some(now - 60 * day),
            ..RunPatch::default()
        },
        ..events(&[2, 3])
    };
    s.commit(&paused, pause).await.unwrap();
    // Ended by the health monitor past a gap in its numbering: its result is the event with
    // the highest seq, not the one at the run's count of events.
    let gapped = started(s, "r-gapped", "t-gapped", Duration::from_secs(60)).await;
    let ended = RunCommit {
        patch: RunPatch {
            state: Some(RunState::Failed),
            finished_at: Some(now - 45 * day),
            ..RunPatch::default()
        },
        release: true,
        ..events(&[2, 1002])
    };
    s.commit(&gapped, ended).await.unwrap();
    let cutoff = now - 30 * day;

    assert_eq!(s.prune_run_events(cutoff, 1).await.unwrap(), 1);
    assert_eq!(seqs(s.as_ref(), "r-older").await, [4], "the oldest first");
    assert_eq!(
        seqs(s.as_ref(), "r-old").await,
        [1, 2, 3, 4],
        "one run a call"
    );
    assert_eq!(s.prune_run_events(cutoff, 500).await.unwrap(), 2);
    assert_eq!(seqs(s.as_ref(), "r-old").await, [4]);
    assert_eq!(seqs(s.as_ref(), "r-gapped").await, [1002]);
    assert_eq!(seqs(s.as_ref(), "r-paused").await, [1, 2, 3], "not ended");
    let result = s.events_after("r-old", 0, 10).await.unwrap();
    assert_eq!(result[0].1, b"result");
    assert_eq!(seqs(s.as_ref(), "r-recent").await, [1, 2, 3, 4]);
    assert_eq!(seqs(s.as_ref(), "r-going").await, [1, 2, 3]);
    assert_eq!(
        s.prune_run_events(cutoff, 500).await.unwrap(),
        0,
        "each run once"
    );
    let run = s.get_run("alice", "r-old").await.unwrap().unwrap();
    assert_eq!(run.state, RunState::Completed, "the run's record is kept");
}

fn events(seqs: &[u64]) -> RunCommit {
    RunCommit {
        events: seqs.iter().map(|s| (*s, b"e".to_vec())).collect(),
        ..RunCommit::default()
    }
}

/// A commit goes out as one statement (issue 13): whatever way it ends — fenced out, or its
/// future dropped once it was sent — it is whole or absent, and the connection goes back to
/// the pool with nothing open, so the next command on it cannot commit what a failed one left.
#[tokio::test]
async fn a_commit_is_whole_or_absent_and_leaves_its_connection_outside_any_transaction() {
    use futures_util::FutureExt as _;
    // One pooled connection: every command reuses the connection the last one left behind.
    let b = postgres_with(1).await;
    let s = &b.store;
    let lease = started(s, "r1", "t1", Duration::from_secs(60)).await;
    s.commit(&lease, events(&[2])).await.unwrap();

    // Fenced out: a stale token, on a commit holding every part, one of them an event whose
    // seq is taken. Every write is gated on the fence, so the answer is the lost lease, never
    // the key conflict of a write that should not have run.
    let stale = Lease {
        token: "not-the-token".into(),
        ..lease.clone()
    };
    let mut everything = events(&[2, 3]);
    everything.history = vec![serde_json::json!({"role": "user"}).to_string().into()];
    everything.actions = vec![action("r1", "c1", ActionState::Executing)];
    everything.messages = vec![NewMessage::text(MessageSource::Agent, "stale")];
    everything.approval = Some(approval("a1", "r1", "t1", Duration::from_secs(60)));
    everything.audit = vec![("stale".into(), serde_json::json!({}))];
    let fenced = s.commit(&stale, everything).await.unwrap_err();
    assert!(matches!(fenced, StoreError::LeaseLost), "{fenced:?}");
    assert!(s.list_actions("r1").await.unwrap().is_empty());
    assert!(s.get_approval("alice", "a1").await.unwrap().is_none());

    // Dropped mid-way: its one poll hands it to the store's committer, then the future goes
    // away before any answer is read.
    assert!(
        s.commit(&lease, events(&[4])).now_or_never().is_none(),
        "a commit cannot finish in one poll"
    );

    // The same connection takes the next commit; the fenced one left nothing, the dropped one
    // was handed over whole and is whole.
    s.commit(&lease, events(&[5])).await.unwrap();
    assert_eq!(seqs(s.as_ref(), "r1").await, [1, 2, 4, 5]);
    let other: Arc<dyn AgentStore> = Arc::new(pg_store(b._db.as_ref().unwrap().url(), 1).await);
    assert_eq!(
        seqs(other.as_ref(), "r1").await,
        [1, 2, 4, 5],
        "committed, as another connection sees it"
    );

    // Nothing sent behind a failed fence lands, whatever its kind.
    let mut late = events(&[6]);
    late.history = vec![
        serde_json::json!({"role": "user", "content": "late"})
            .to_string()
            .into(),
    ];
    let refused = s.commit(&stale, late).await.unwrap_err();
    assert!(matches!(refused, StoreError::LeaseLost), "{refused:?}");
    assert_eq!(seqs(other.as_ref(), "r1").await, [1, 2, 4, 5]);
    assert!(
        other.history("t1").await.unwrap().is_empty(),
        "no history row"
    );
}

/// A commit of run `id` holding every part a commit can hold.
fn everything(id: &str, thread: &str, seq: u64) -> RunCommit {
    RunCommit {
        events: vec![(seq, format!("event of {id}").into_bytes())],
        history: vec![
            serde_json::json!({"role": "user", "content": id})
                .to_string()
                .into(),
        ],
        actions: vec![action(id, "c1", ActionState::Executing)],
        messages: vec![NewMessage::text(MessageSource::Agent, format!("from {id}"))],
        patch: RunPatch {
            iterations: Some(7),
            ..RunPatch::default()
        },
        approval: Some(Approval {
            // r2 could use every tool: stored as NULL, not as an empty list.
            allowed_tools: approval(&format!("a-{id}"), id, thread, Duration::from_secs(60))
                .allowed_tools
                .filter(|_| id != "r2"),
            ..approval(&format!("a-{id}"), id, thread, Duration::from_secs(60))
        }),
        audit: vec![("side_effect".into(), serde_json::json!({"run": id}))],
        release: true,
        read_external: true,
    }
}

/// Group commit (issue 13): commits that wait together go out in one statement, each fenced
/// by its own lease — a run whose lease is gone writes nothing and is told so, the others land
/// whole, every part of them.
#[tokio::test]
async fn commits_waiting_together_are_written_together_each_behind_its_own_fence() {
    let db = TestDb::create().await.unwrap();
    // Four connections: one committer, which finds every commit below waiting at once.
    let store = pg_store(db.url(), 4).await;
    let s: &dyn AgentStore = &store;
    let mut leases = runs_of_many_owners(s, 12).await;
    // r5's writer lost its lease: its commit carries a token that is not the thread's.
    leases[5].token = "not-the-token".into();
    let before = store.commit_counts();
    let answers = futures_util::future::join_all(
        leases
            .iter()
            .map(|lease| s.commit(lease, everything(&lease.run_id, &lease.thread_id, 2))),
    )
    .await;
    let after = store.commit_counts();
    assert_eq!(after.written - before.written, 12);
    assert!(
        after.statements - before.statements < 12,
        "{} statements for 12 commits",
        after.statements - before.statements
    );
    for (lease, answer) in leases.iter().zip(answers) {
        let id = lease.run_id.as_str();
        if id == "r5" {
            assert!(matches!(answer, Err(StoreError::LeaseLost)), "{answer:?}");
            assert_eq!(seqs(s, id).await, [1], "nothing of the fenced run");
            assert!(s.list_actions(id).await.unwrap().is_empty());
            assert!(s.get_approval("alice", "a-r5").await.unwrap().is_none());
            assert!(s.history("t5").await.unwrap().is_empty());
            continue;
        }
        answer.unwrap_or_else(|e| panic!("{id}: {e:?}"));
        assert_eq!(seqs(s, id).await, [1, 2], "{id}");
        let owner = owner_of(id);
        let run = s.get_run(&owner, id).await.unwrap().unwrap();
        assert_eq!((run.iterations, run.last_event_seq), (7, 2), "{id}");
        assert_eq!(s.list_actions(id).await.unwrap().len(), 1, "{id}");
        let approval = s.get_approval("alice", &format!("a-{id}")).await.unwrap();
        let approval = approval.unwrap();
        assert_eq!(
            approval.tainted_by,
            ["search_gmail"],
            "{id}: its provenance survives the batch"
        );
        assert_eq!(
            approval.allowed_tools,
            (id != "r2").then(|| vec!["list_tasks".to_owned(), "gmail_send".to_owned()]),
            "{id}: and so do the tools its resume may offer (every tool as NULL)"
        );
        assert_eq!(s.history(&lease.thread_id).await.unwrap().len(), 1, "{id}");
        let messages = s.list_messages(&lease.thread_id, 0, 10).await.unwrap();
        assert_eq!(messages.last().unwrap().content, format!("from {id}"));
        let thread = s
            .get_thread(&owner, &lease.thread_id)
            .await
            .unwrap()
            .unwrap();
        assert!(thread.active_run_id.is_none(), "{id}: released");
        assert_eq!(
            s.audit(&owner).await.unwrap().len(),
            1,
            "{id}: its audit record"
        );
    }
    assert!(s.audit("u5").await.unwrap().is_empty());
}

/// A batch is one transaction, so one commit the database refuses would sink the others; the
/// committer then writes each alone, and only the bad one fails.
#[tokio::test]
async fn a_refused_commit_in_a_batch_fails_alone_and_the_rest_land() {
    let db = TestDb::create().await.unwrap();
    let store = pg_store(db.url(), 4).await;
    let s: &dyn AgentStore = &store;
    let leases = runs_of_many_owners(s, 6).await;
    let before = store.commit_counts();
    let answers = futures_util::future::join_all(leases.iter().map(|lease| {
        let mut c = everything(&lease.run_id, &lease.thread_id, 2);
        c.release = false;
        if lease.run_id == "r3" {
            c.history = vec!["{not json".into()];
        }
        s.commit(lease, c)
    }))
    .await;
    for (lease, answer) in leases.iter().zip(answers) {
        let id = lease.run_id.as_str();
        if id == "r3" {
            assert!(
                matches!(answer, Err(StoreError::Rejected(_))),
                "refused for good, not the database away: {answer:?}"
            );
            assert_eq!(seqs(s, id).await, [1], "nothing of the refused commit");
        } else {
            answer.unwrap_or_else(|e| panic!("{id}: {e:?}"));
            assert_eq!(seqs(s, id).await, [1, 2], "{id}");
        }
    }
    let after = store.commit_counts();
    assert_eq!(
        after.batches_retried - before.batches_retried,
        1,
        "the batch was tried, refused and retried commit by commit"
    );

    // r3's writer retries the same commit with everyone's next ones: r3 is written alone now,
    // so it sinks no batch again.
    let answers = futures_util::future::join_all(leases.iter().map(|lease| {
        let mut c = events(&[3]);
        if lease.run_id == "r3" {
            c.history = vec!["{not json".into()];
        }
        s.commit(lease, c)
    }))
    .await;
    for (lease, answer) in leases.iter().zip(answers) {
        assert_eq!(
            answer.is_ok(),
            lease.run_id != "r3",
            "{}: {answer:?}",
            lease.run_id
        );
    }
    let again = store.commit_counts();
    assert_eq!(
        again.batches_retried, after.batches_retried,
        "no batch failed"
    );
    assert!(
        again.statements - after.statements < 6,
        "the others still went together"
    );
}

/// A thread row another transaction holds (an admission, a decision) does not hold up the
/// batch: the other runs commit at once, and the busy thread's run commits once it is free.
#[tokio::test]
async fn a_busy_thread_row_holds_up_only_its_own_runs_commit() {
    let db = TestDb::create().await.unwrap();
    // However slow the machine, the held commit waits for the row rather than timing out.
    let pool = PoolOptions {
        max_connections: 4,
        lock_timeout: secs(300),
        ..PoolOptions::default()
    };
    let store = Arc::new(pg_store_with(db.url(), pool).await);
    let leases = runs_of_many_owners(store.as_ref(), 6).await;
    let holder = side_connection(db.url()).await;
    holder
        .batch_execute("BEGIN; SELECT 1 FROM agent.threads WHERE id = 't3' FOR UPDATE")
        .await
        .unwrap();

    let commits: Vec<_> = leases
        .iter()
        .map(|lease| {
            let (store, lease) = (store.clone(), lease.clone());
            tokio::spawn(async move { store.commit(&lease, events(&[2])).await })
        })
        .collect();
    let mut commits = commits.into_iter();
    let held = commits.nth(3).unwrap();
    let others = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join_all(commits),
    )
    .await
    .expect("the other runs' commits did not wait for t3");
    for answer in others {
        answer.unwrap().unwrap();
    }
    assert!(!held.is_finished(), "t3's run waits for its thread row");
    holder.batch_execute("COMMIT").await.unwrap();
    held.await.unwrap().unwrap();
    for lease in &leases {
        assert_eq!(seqs(store.as_ref(), &lease.run_id).await, [1, 2]);
    }
}

/// Archives a session of `owner`'s titled `summary` (run `run` on thread `thread`).
async fn archived_session(s: &dyn AgentStore, owner: &str, run: &str, thread: &str, summary: &str) {
    let lease = match s.admit(&admit_new(run, thread, owner, None)).await.unwrap() {
        Admitted::Started { lease, .. } => lease,
        other => panic!("not admitted: {other:?}"),
    };
    let turn = serde_json::json!({"role": "user", "content": summary});
    let commit = RunCommit {
        history: vec![turn.to_string().into()],
        release: true,
        ..RunCommit::default()
    };
    s.commit(&lease, commit).await.unwrap();
    let ended = ending(RunState::Cancelled, 1);
    let archived = s.archive_history(thread, owner, summary, &ended, None, None);
    archived.await.unwrap().expect("archived");
}

/// Group admission (issue 13): runs on new threads admitted together go out in one statement,
/// and each is admitted whole — its thread holding its lease, the run, its first event, the
/// user's message, its request id and the session summaries it asked for.
#[tokio::test]
async fn admissions_of_new_threads_waiting_together_are_written_together() {
    let db = TestDb::create().await.unwrap();
    // Four connections: one admitter, which finds every admission below waiting at once.
    let store = pg_store(db.url(), 4).await;
    let s: &dyn AgentStore = &store;
    archived_session(s, "u0", "old", "t-old", "Flights").await;
    let admissions: Vec<Admission> = (0..12)
        .map(|i| {
            let (run, thread) = (format!("r{i}"), format!("t{i}"));
            let (owner, request) = (format!("u{i}"), format!("req-{i}"));
            Admission {
                summaries: 2,
                ..admit_new(&run, &thread, &owner, Some(&request))
            }
        })
        .collect();
    let before = store.admission_counts();
    let answers = futures_util::future::join_all(admissions.iter().map(|a| s.admit(a))).await;
    let after = store.admission_counts();
    assert_eq!(after.written - before.written, 12);
    assert!(
        after.statements - before.statements < 12,
        "{} statements for 12 admissions",
        after.statements - before.statements
    );
    for (i, answer) in answers.into_iter().enumerate() {
        let (id, thread, owner) = (format!("r{i}"), format!("t{i}"), format!("u{i}"));
        let Admitted::Started { lease, summaries } = answer.unwrap() else {
            panic!("{id} not admitted");
        };
        assert_eq!((&lease.run_id, &lease.thread_id), (&id, &thread));
        let read: Vec<&str> = summaries.iter().map(|a| a.summary.as_str()).collect();
        let expected: &[&str] = if i == 0 { &["Flights"] } else { &[] };
        assert_eq!(read, expected, "{id}: its owner's own summaries");
        let run = s.get_run(&owner, &id).await.unwrap().unwrap();
        assert_eq!(
            (run.state, run.last_event_seq),
            (RunState::Queued, 1),
            "{id}"
        );
        assert_eq!(
            s.events_after(&id, 0, 10).await.unwrap(),
            [(1, b"queued".to_vec())]
        );
        let messages = s.list_messages(&thread, 0, 10).await.unwrap();
        let texts: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(texts, [format!("prompt of {id}")]);
        let made = s.get_thread(&owner, &thread).await.unwrap().unwrap();
        assert_eq!(made.title, format!("title of {thread}"));
        assert_eq!(
            made.active_run_id.as_deref(),
            Some(id.as_str()),
            "{id} holds its thread"
        );
        let by_request = s.find_run_by_request(&owner, &format!("req-{i}")).await;
        assert_eq!(by_request.unwrap().unwrap().id, id);
        // The lease it was given is the thread's: its commit lands.
        s.commit(&lease, events(&[2])).await.unwrap();
        assert_eq!(seqs(s, &id).await, [1, 2]);
    }
}

/// Group admission refuses each run on its own: one at its owner's cap, or retrying a request
/// id, is told so, as if it had come alone, and leaves nothing behind; a second run of an owner
/// or on a thread in the same batch is admitted (or refused) alone, after it; the rest land.
#[tokio::test]
async fn each_admission_in_a_batch_is_refused_or_admitted_on_its_own() {
    let db = TestDb::create().await.unwrap();
    let store = pg_store(db.url(), 4).await;
    let s: &dyn AgentStore = &store;
    // carol is at her cap of 3 live runs; dave has run d1 for request "req-d".
    for i in 0..3 {
        let a = admit_new(&format!("c{i}"), &format!("tc{i}"), "carol", None);
        assert!(matches!(
            s.admit(&a).await.unwrap(),
            Admitted::Started { .. }
        ));
    }
    let d1 = admit_new("d1", "td1", "dave", Some("req-d"));
    assert!(matches!(
        s.admit(&d1).await.unwrap(),
        Admitted::Started { .. }
    ));

    let batch = [
        admit_new("e1", "te1", "erin", None),
        admit_new("c3", "tc3", "carol", None),
        admit_new("d2", "td2", "dave", Some("req-d")),
        admit_new("f1", "tf", "frank", None),
        admit_new("g1", "tf", "grace", None),
        admit_new("e2", "te2", "erin", None),
    ];
    let before = store.admission_counts();
    let answers = futures_util::future::join_all(batch.iter().map(|a| s.admit(a))).await;
    let after = store.admission_counts();
    assert!(
        after.statements - before.statements < 6,
        "some were admitted together: {} statements",
        after.statements - before.statements
    );
    let mut answers = answers.into_iter();
    let mut next = || answers.next().unwrap();
    assert!(matches!(next(), Ok(Admitted::Started { .. })), "e1");
    assert_eq!(next().unwrap(), Admitted::TooManyRuns { active: 3 }, "c3");
    assert_eq!(
        next().unwrap(),
        Admitted::Duplicate {
            run_id: "d1".into(),
            thread_id: "td1".into()
        },
        "d2 retried d1's request"
    );
    assert!(matches!(next(), Ok(Admitted::Started { .. })), "f1");
    let second_on_tf = next();
    assert!(
        matches!(second_on_tf, Err(StoreError::Conflict(_))),
        "g1 on a thread f1 made: {second_on_tf:?}"
    );
    assert!(
        matches!(next(), Ok(Admitted::Started { .. })),
        "e2, erin's second"
    );
    // The refused left nothing: no thread, no run.
    for (owner, run, thread) in [
        ("carol", "c3", "tc3"),
        ("dave", "d2", "td2"),
        ("grace", "g1", "tf"),
    ] {
        assert!(s.get_run(owner, run).await.unwrap().is_none(), "{run}");
        assert!(
            s.get_thread(owner, thread).await.unwrap().is_none(),
            "{thread}"
        );
    }
    let tf = s.get_thread("frank", "tf").await.unwrap().unwrap();
    assert_eq!(tf.active_run_id.as_deref(), Some("f1"));
}

/// `owner` has exactly one run queued, planning or executing: a cap of one held.
async fn assert_one_live_run(side: &tokio_postgres::Client, owner: &str) {
    let live: i64 = side
        .query_one(
            "SELECT count(*) FROM agent.runs WHERE owner = $1 \
             AND state IN ('queued', 'planning', 'executing')",
            &[&owner],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(live, 1, "{owner} has {live} live runs against a cap of one");
}

/// Three replicas (three stores' pools over one database) each admit one of every owner's
/// three runs at once, under a cap of one; `on_new_thread(k)` says whether run k makes its
/// thread (group admission) or takes one that exists (a lone admission's transaction). Each
/// owner must end with exactly the one live run its cap allows, every other run told the cap.
async fn one_run_per_owner_when_replicas_race(on_new_thread: impl Fn(usize) -> bool) {
    let db = TestDb::create().await.unwrap();
    one_run_per_owner_when_replicas_race_on(&db, on_new_thread).await;
}

async fn one_run_per_owner_when_replicas_race_on(
    db: &TestDb,
    on_new_thread: impl Fn(usize) -> bool,
) {
    let replicas = replicas(db, 3).await;
    let owners = 30;
    let mut admissions = Vec::new();
    for o in 0..owners {
        let owner = format!("u{o}");
        for k in 0..3 {
            let (run, thread) = (format!("r{o}-{k}"), format!("t{o}-{k}"));
            let new_thread = on_new_thread(k);
            if !new_thread {
                let s: &dyn AgentStore = &replicas[0];
                s.create_thread(&thread, &owner, "x").await.unwrap();
            }
            let a = Admission {
                max_active_runs: 1,
                ..admission(
                    new_run(&run, &thread, &owner, None),
                    new_thread,
                    Duration::from_secs(60),
                )
            };
            admissions.push((k, a));
        }
    }
    let answers = futures_util::future::join_all(
        admissions
            .iter()
            .map(|(k, a)| (&replicas[*k] as &dyn AgentStore).admit(a)),
    )
    .await;
    let side = side_connection(db.url()).await;
    for o in 0..owners {
        let owner = format!("u{o}");
        assert_one_live_run(&side, &owner).await;
        let of_owner = &answers[o * 3..o * 3 + 3];
        let started = of_owner
            .iter()
            .filter(|a| matches!(a, Ok(Admitted::Started { .. })))
            .count();
        assert_eq!(started, 1, "{owner}: {of_owner:?}");
        for answer in of_owner {
            assert!(
                matches!(
                    answer,
                    Ok(Admitted::Started { .. } | Admitted::TooManyRuns { active: 1 })
                ),
                "{owner}: {answer:?}"
            );
        }
    }
}

/// R-4: an owner's cap on live runs holds when replicas admit that owner's runs on new
/// threads at the same moment (batch against batch).
#[tokio::test]
async fn r4_the_run_cap_holds_when_replicas_admit_one_owner_at_once() {
    one_run_per_owner_when_replicas_race(|_| true).await;
}

/// R-4: the same on threads that exist (each a lone admission's transaction), and mixed: one
/// replica's run makes its thread (a batch) while the others take theirs.
#[tokio::test]
async fn r4_the_run_cap_holds_when_replicas_admit_one_owner_on_existing_threads() {
    one_run_per_owner_when_replicas_race(|_| false).await;
    one_run_per_owner_when_replicas_race(|k| k == 0).await;
}

/// R-4: the same where the database's default isolation is REPEATABLE READ (a snapshot per
/// transaction would be taken before the owner's lock is): admissions set their own.
#[tokio::test]
async fn r4_the_run_cap_holds_where_the_database_defaults_to_repeatable_read() {
    let db = TestDb::create().await.unwrap();
    let side = side_connection(db.url()).await;
    let name: String = side
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    side.batch_execute(&format!(
        "ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
    ))
    .await
    .unwrap();
    // Runs 1 and 2 take existing threads (lone admissions), run 0 makes its own (a batch).
    one_run_per_owner_when_replicas_race_on(&db, |k| k == 0).await;
    // And every pooled connection of the services works in READ COMMITTED regardless.
    let pool = svc_kit::pg::pool(
        db.url(),
        &PoolOptions {
            max_connections: 1,
            acquire_timeout: Duration::from_secs(5),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let isolation: String = pool
        .get()
        .await
        .unwrap()
        .query_one("SHOW transaction_isolation", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(isolation, "read committed");
}

/// Run `run` of `owner`, on a thread of its own, paused for approval `approval_id`, and the
/// lease on its thread a decider takes.
async fn paused_for_a_decision(
    s: &dyn AgentStore,
    owner: &str,
    run: &str,
    approval_id: &str,
) -> Lease {
    let thread = format!("thread-of-{run}");
    let Admitted::Started { lease, .. } = s
        .admit(&admission(
            new_run(run, &thread, owner, None),
            true,
            secs(60),
        ))
        .await
        .unwrap()
    else {
        panic!("{owner}'s run {run} is admitted");
    };
    let mut paused = action(run, "c1", ActionState::AwaitingConfirmation);
    paused.approval_id = Some(approval_id.to_owned());
    let commit = RunCommit {
        events: vec![(2, b"paused".to_vec())],
        actions: vec![paused],
        patch: RunPatch {
            state: Some(RunState::AwaitingConfirmation),
            ..RunPatch::default()
        },
        approval: Some(Approval {
            owner: owner.to_owned(),
            ..approval(approval_id, run, &thread, secs(600))
        }),
        release: true,
        ..RunCommit::default()
    };
    s.commit(&lease, commit).await.unwrap();
    match s.lock_thread(&thread, run, secs(60)).await.unwrap() {
        LockOutcome::Acquired(lease) => lease,
        busy => panic!("{owner}'s paused thread is free: {busy:?}"),
    }
}

/// R-4: two decisions that would each continue one of an owner's paused runs, on two replicas
/// at once, under a cap of one: exactly one goes ahead for every owner, the other approval is
/// left pending.
#[tokio::test]
async fn r4_the_run_cap_holds_when_two_replicas_decide_for_one_owner_at_once() {
    let db = TestDb::create().await.unwrap();
    let replicas = replicas(&db, 2).await;
    let owners = 30;
    let mut deciders = Vec::new();
    for o in 0..owners {
        let owner = format!("u{o}");
        for k in 0..2 {
            let (run, id) = (format!("p{o}-{k}"), format!("a{o}-{k}"));
            let lease = paused_for_a_decision(&replicas[0], &owner, &run, &id).await;
            deciders.push((k, id, lease));
        }
    }
    let decided = futures_util::future::join_all(deciders.iter().map(|(k, id, lease)| {
        let s: &dyn AgentStore = &replicas[*k];
        s.decide(
            lease,
            id,
            ApprovalState::Approved,
            "u",
            "approval_approved",
            1,
        )
    }))
    .await;
    let side = side_connection(db.url()).await;
    for o in 0..owners {
        let owner = format!("u{o}");
        assert_one_live_run(&side, &owner).await;
        let both = &decided[o * 2..o * 2 + 2];
        let won = both
            .iter()
            .filter(|d| matches!(d, Ok(Decided::Won { .. })))
            .count();
        assert_eq!(won, 1, "{owner}: {both:?}");
        for (d, (_, id, _)) in both.iter().zip(&deciders[o * 2..]) {
            if let Ok(Decided::TooManyRuns { active }) = d {
                assert_eq!(*active, 1);
                let left: &dyn AgentStore = &replicas[0];
                let approval = left.get_approval(&owner, id).await.unwrap().unwrap();
                assert_eq!(approval.state, ApprovalState::Pending, "{owner}'s {id}");
            }
        }
    }
}

/// R-4: a decision that continues a paused run races admissions of the same owner on other
/// replicas (one a batch on a new thread, one a lone admission on a thread that exists); under
/// a cap of one exactly one of the three goes ahead for every owner.
#[tokio::test]
async fn r4_the_run_cap_holds_when_a_decision_races_admissions_on_other_replicas() {
    let db = TestDb::create().await.unwrap();
    let replicas = replicas(&db, 3).await;
    let first: &dyn AgentStore = &replicas[0];
    let owners = 30;
    let mut deciders = Vec::new();
    let mut admissions = Vec::new();
    for o in 0..owners {
        let owner = format!("u{o}");
        let lease = paused_for_a_decision(first, &owner, &format!("p{o}"), &format!("a{o}")).await;
        deciders.push((format!("a{o}"), lease));
        first
            .create_thread(&format!("tx{o}"), &owner, "x")
            .await
            .unwrap();
        for (k, new_thread) in [(1, true), (2, false)] {
            let run = new_run(&format!("r{o}-{k}"), &format!("t{o}-{k}"), &owner, None);
            let run = match new_thread {
                true => run,
                false => Run {
                    thread_id: format!("tx{o}"),
                    ..run
                },
            };
            let a = Admission {
                max_active_runs: 1,
                ..admission(run, new_thread, secs(60))
            };
            admissions.push((k, a));
        }
    }
    let (decided, admitted) = futures_util::future::join(
        futures_util::future::join_all(deciders.iter().map(|(id, lease)| {
            first.decide(
                lease,
                id,
                ApprovalState::Approved,
                "u",
                "approval_approved",
                1,
            )
        })),
        futures_util::future::join_all(
            admissions
                .iter()
                .map(|(k, a)| (&replicas[*k] as &dyn AgentStore).admit(a)),
        ),
    )
    .await;
    let side = side_connection(db.url()).await;
    for o in 0..owners {
        let owner = format!("u{o}");
        assert_one_live_run(&side, &owner).await;
        let won = matches!(decided[o], Ok(Decided::Won { .. }));
        assert!(
            won || matches!(decided[o], Ok(Decided::TooManyRuns { active: 1 })),
            "{owner}: {:?}",
            decided[o]
        );
        let of_owner = &admitted[o * 2..o * 2 + 2];
        let started = of_owner
            .iter()
            .filter(|a| matches!(a, Ok(Admitted::Started { .. })))
            .count();
        assert_eq!(
            usize::from(won) + started,
            1,
            "{owner}: {decided:?} {of_owner:?}",
            decided = decided[o]
        );
        if !won {
            let approval = first.get_approval(&owner, &format!("a{o}")).await.unwrap();
            assert_eq!(approval.unwrap().state, ApprovalState::Pending, "{owner}");
        }
    }
}

/// An owner's admission lock held by a transaction that stalls (a replica cut off mid-admission)
/// makes that owner's admissions fail UNAVAILABLE after DATABASE_LOCK_TIMEOUT, in the database's
/// own words, instead of each waiting without bound on a pooled connection; other owners'
/// admissions, batched with them or not, go ahead; once the holder ends, the owner is admitted.
#[tokio::test]
async fn r4_an_admission_waits_for_its_owners_lock_no_longer_than_the_lock_timeout() {
    let db = TestDb::create().await.unwrap();
    let pool = PoolOptions {
        max_connections: 4,
        lock_timeout: Duration::from_millis(300),
        ..PoolOptions::default()
    };
    let store = pg_store_with(db.url(), pool).await;
    let s: &dyn AgentStore = &store;
    s.create_thread("t-old", "alice", "x").await.unwrap();
    let holder = holding_the_admission_lock_of(db.url(), "alice").await;
    let on_old_thread = admission(new_run("r-old", "t-old", "alice", None), false, secs(60));
    let batch = [
        admit_new("r-new", "t-new", "alice", None),
        admit_new("b1", "tb1", "bob", None),
        admit_new("c1", "tc1", "carol", None),
    ];
    let answers = futures_util::future::join(
        s.admit(&on_old_thread),
        futures_util::future::join_all(batch.iter().map(|a| s.admit(a))),
    );
    let (alone, batched) = tokio::time::timeout(secs(30), answers)
        .await
        .expect("admissions wait for a held lock without bound");
    for refused in [&alone, &batched[0]] {
        match refused {
            Err(StoreError::Unavailable(why)) => {
                assert!(why.contains("lock timeout (55P03)"), "{why}");
                assert!(why.contains("DATABASE_LOCK_TIMEOUT"), "{why}");
            }
            other => panic!("alice's admission did not time out on her lock: {other:?}"),
        }
    }
    for other_owner in &batched[1..] {
        assert!(
            matches!(other_owner, Ok(Admitted::Started { .. })),
            "{other_owner:?}"
        );
    }
    assert!(
        s.get_run("alice", "r-old").await.unwrap().is_none(),
        "nothing of it is left"
    );
    assert!(s.get_thread("alice", "t-new").await.unwrap().is_none());
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert!(matches!(
        s.admit(&on_old_thread).await,
        Ok(Admitted::Started { .. })
    ));
}

/// Returns once some session of the database at `url` waits for an advisory lock.
async fn a_session_waits_for_an_admission_lock(url: &str) {
    let watcher = side_connection(url).await;
    tokio::time::timeout(secs(30), async {
        loop {
            let waiting: i64 = watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                     AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if waiting > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("a session waits for the lock");
}

/// A store with a pool of four (so one admitter task) whose lock waits last `lock_timeout`,
/// and a session of the test's own holding alice's admission lock.
async fn one_admitter_with_alices_lock_held_elsewhere(
    lock_timeout: Duration,
) -> (TestDb, PgStore, tokio_postgres::Client) {
    let db = TestDb::create().await.unwrap();
    let pool = PoolOptions {
        max_connections: 4,
        lock_timeout,
        ..PoolOptions::default()
    };
    let store = pg_store_with(db.url(), pool).await;
    let holder = holding_the_admission_lock_of(db.url(), "alice").await;
    (db, store, holder)
}

/// R-4: a batch of admissions that meets an owner whose admission lock is held elsewhere (a
/// stalled replica's transaction, say) admits its other owners at once, without waiting for
/// that lock; only that owner's run waits for it, alone, and is admitted once it is free.
#[tokio::test]
async fn r4_a_batch_admits_its_other_owners_while_one_owners_lock_is_held_elsewhere() {
    use futures_util::StreamExt as _;
    // Lock waits far longer than any bound below: a run held behind alice's lock fails it.
    let (_db, store, holder) = one_admitter_with_alices_lock_held_elsewhere(secs(300)).await;
    let s: &dyn AgentStore = &store;
    let before = store.admission_counts();
    let batch = [
        admit_new("a1", "ta1", "alice", None),
        admit_new("b1", "tb1", "bob", None),
        admit_new("c1", "tc1", "carol", None),
        admit_new("d1", "td1", "dave", None),
    ];
    // All four are handed to the admitter in one poll, so they wait for it together.
    let mut answers: futures_util::stream::FuturesUnordered<_> = batch
        .iter()
        .map(|a| async move { (a.run.owner.as_str(), s.admit(a).await) })
        .collect();
    let mut admitted = Vec::new();
    while admitted.len() < 3 {
        let (owner, answer) = tokio::time::timeout(secs(30), answers.next())
            .await
            .expect("the other owners' runs wait for alice's lock")
            .unwrap();
        assert!(
            matches!(answer, Ok(Admitted::Started { .. })),
            "{owner}: {answer:?}"
        );
        admitted.push(owner);
    }
    admitted.sort();
    assert_eq!(admitted, ["bob", "carol", "dave"]);
    let after = store.admission_counts();
    assert_eq!(
        after.batches_retried - before.batches_retried,
        1,
        "the four were one batch, refused once for alice's lock"
    );
    assert!(s.get_run("alice", "a1").await.unwrap().is_none());
    // The admitter is not held either: admissions that come after are admitted while alice
    // still waits.
    let later = [
        admit_new("e1", "te1", "eve", None),
        admit_new("f1", "tf1", "frank", None),
    ];
    let later = tokio::time::timeout(
        secs(30),
        futures_util::future::join_all(later.iter().map(|a| s.admit(a))),
    )
    .await
    .expect("later admissions wait behind alice's");
    for answer in later {
        assert!(matches!(answer, Ok(Admitted::Started { .. })), "{answer:?}");
    }

    holder.batch_execute("ROLLBACK").await.unwrap();
    let (owner, answer) = tokio::time::timeout(secs(30), answers.next())
        .await
        .expect("alice's run is admitted once her lock is free")
        .unwrap();
    assert_eq!(owner, "alice");
    assert!(matches!(answer, Ok(Admitted::Started { .. })), "{answer:?}");
    assert!(s.get_run("alice", "a1").await.unwrap().is_some());
}

/// R-4: however many runs an owner whose admission lock is held elsewhere sends meanwhile,
/// their waits tie up one connection of the pool between them, not one each, nor the admitter:
/// with a pool of four, a lone run of alice's and then six rounds of batches that each hold one
/// of hers still admit everyone else's at once. Once the lock is free, alice's runs are
/// admitted in order, up to her cap.
#[tokio::test]
async fn r4_an_owner_whose_lock_is_held_elsewhere_ties_up_one_connection_however_many_runs_wait() {
    use futures_util::{FutureExt as _, StreamExt as _};
    // Lock waits far longer than any bound below: a run held behind alice's lock fails it.
    let (db, store, holder) = one_admitter_with_alices_lock_held_elsewhere(secs(300)).await;
    let s: &dyn AgentStore = &store;
    // A run of alice's alone, first: the admitter only tries her lock, and the run waits for it
    // elsewhere, where a session is soon seen waiting.
    let lone = admit_new("a0", "ta0", "alice", None);
    let mut first = Box::pin(s.admit(&lone));
    assert!(first.as_mut().now_or_never().is_none());
    a_session_waits_for_an_admission_lock(db.url()).await;
    let rounds: Vec<[Admission; 2]> = (1..=6)
        .map(|k| {
            [
                admit_new(&format!("a{k}"), &format!("ta{k}"), "alice", None),
                admit_new(
                    &format!("o{k}"),
                    &format!("to{k}"),
                    &format!("other{k}"),
                    None,
                ),
            ]
        })
        .collect();
    let mut alices = Vec::new();
    for [alice, other] in &rounds {
        // Both are handed to the admitter in one poll, so they wait for it together.
        let mut answers: futures_util::stream::FuturesUnordered<_> = [alice, other]
            .into_iter()
            .map(|a| async move { (a.run.id.as_str(), s.admit(a).await) })
            .collect();
        let (id, answer) = tokio::time::timeout(secs(30), answers.next())
            .await
            .unwrap_or_else(|_| panic!("{} waits behind alice's lock", other.run.owner))
            .unwrap();
        assert_eq!(id, other.run.id);
        assert!(
            matches!(answer, Ok(Admitted::Started { .. })),
            "{id}: {answer:?}"
        );
        alices.push(answers);
    }

    holder.batch_execute("ROLLBACK").await.unwrap();
    let mut answers = vec![(
        "a0".to_owned(),
        tokio::time::timeout(secs(30), first)
            .await
            .expect("alice's first run is admitted once her lock is free"),
    )];
    for mut waiting in alices {
        let (id, answer) = tokio::time::timeout(secs(30), waiting.next())
            .await
            .expect("alice's runs are admitted once her lock is free")
            .unwrap();
        answers.push((id.to_owned(), answer));
    }
    let started: Vec<&str> = answers
        .iter()
        .filter(|(_, a)| matches!(a, Ok(Admitted::Started { .. })))
        .map(|(id, _)| id.as_str())
        .collect();
    assert_eq!(started, ["a0", "a1", "a2"], "in order, up to her cap of 3");
    for (id, answer) in &answers[3..] {
        assert!(
            matches!(answer, Ok(Admitted::TooManyRuns { active: 3 })),
            "{id}: {answer:?}"
        );
    }
}

/// R-4: runs queued behind an owner's lock held elsewhere wait for it once per round, not once
/// each: when DATABASE_LOCK_TIMEOUT ends the wait, every run queued by then is told at once,
/// in the database's words, and none of them is tried alone (which would wait the timeout out
/// again for each). Once the holder is gone, the owner's next run is admitted.
#[tokio::test]
async fn r4_runs_queued_behind_a_held_lock_are_all_told_when_the_wait_times_out() {
    use futures_util::FutureExt as _;
    let (db, store, holder) =
        one_admitter_with_alices_lock_held_elsewhere(Duration::from_millis(500)).await;
    let s: &dyn AgentStore = &store;
    let before = store.admission_counts();
    let first = admit_new("a1", "ta1", "alice", None);
    let mut first_answer = Box::pin(s.admit(&first));
    assert!(first_answer.as_mut().now_or_never().is_none());
    a_session_waits_for_an_admission_lock(db.url()).await;
    let queued: Vec<Admission> = (2..=5)
        .map(|k| admit_new(&format!("a{k}"), &format!("ta{k}"), "alice", None))
        .collect();
    let (first_answer, answers) = tokio::time::timeout(
        secs(30),
        futures_util::future::join(
            first_answer,
            futures_util::future::join_all(queued.iter().map(|a| s.admit(a))),
        ),
    )
    .await
    .expect("queued runs are told once the lock wait times out");
    for answer in std::iter::once(&first_answer).chain(&answers) {
        match answer {
            Err(StoreError::Unavailable(why)) => {
                assert!(why.contains("lock timeout (55P03)"), "{why}");
                assert!(why.contains("DATABASE_LOCK_TIMEOUT"), "{why}");
            }
            other => panic!("a run of alice's was not told of her lock: {other:?}"),
        }
    }
    assert_eq!(
        store.admission_counts().written,
        before.written,
        "none of them was tried alone"
    );
    assert!(s.get_run("alice", "a1").await.unwrap().is_none());

    holder.batch_execute("ROLLBACK").await.unwrap();
    let again = admit_new("a6", "ta6", "alice", None);
    assert!(matches!(
        s.admit(&again).await,
        Ok(Admitted::Started { .. })
    ));
}

/// A pooled connection whose transaction stalls while holding a lock (its replica cut off,
/// say) is ended by the server after DATABASE_IDLE_IN_TRANSACTION_TIMEOUT, which releases the
/// lock for everyone else; and every pooled connection waits for a lock no longer than
/// DATABASE_LOCK_TIMEOUT.
#[tokio::test]
async fn a_stalled_transaction_on_a_pooled_connection_is_ended_and_its_locks_released() {
    let db = TestDb::create().await.unwrap();
    let pool = svc_kit::pg::pool(
        db.url(),
        &PoolOptions {
            max_connections: 1,
            lock_timeout: Duration::from_millis(1500),
            idle_in_transaction_timeout: Duration::from_millis(500),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let stalled = pool.get().await.unwrap();
    let setting: String = stalled
        .query_one("SHOW lock_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(setting, "1500ms");
    stalled
        .batch_execute("BEGIN; SELECT pg_advisory_xact_lock(hashtext('runs:' || 'alice'))")
        .await
        .unwrap();
    // Another session waits for the lock, and gets it once the server ends the stalled one.
    let mut other = side_connection(db.url()).await;
    let waiter = other.transaction().await.unwrap();
    tokio::time::timeout(
        secs(20),
        waiter.execute(
            "SELECT pg_advisory_xact_lock(hashtext('runs:' || 'alice'))",
            &[],
        ),
    )
    .await
    .expect("the stalled session's lock is released")
    .unwrap();
    let ended = stalled.query_one("SELECT 1", &[]).await.unwrap_err();
    let said = ended
        .as_db_error()
        .map(|e| e.message().to_owned())
        .unwrap_or_else(|| ended.to_string());
    assert!(
        said.contains("idle-in-transaction") || stalled.is_closed(),
        "the stalled session was not ended: {said}"
    );
}

/// R-4: the cap on an owner's queued task agents holds when replicas enqueue at once.
#[tokio::test]
async fn r4_the_task_queue_cap_holds_when_replicas_enqueue_at_once() {
    let db = TestDb::create().await.unwrap();
    let replicas = replicas(&db, 3).await;
    let owners = 20;
    for o in 0..owners {
        let s: &dyn AgentStore = &replicas[0];
        s.create_thread(&format!("t{o}"), &format!("u{o}"), "x")
            .await
            .unwrap();
    }
    let tasks: Vec<(usize, TaskAgent)> = (0..owners)
        .flat_map(|o| {
            (0..3).map(move |k| {
                let task = queued_task(&format!("k{o}-{k}"), &format!("u{o}"), &format!("t{o}"));
                (k, task)
            })
        })
        .collect();
    let queued = futures_util::future::join_all(
        tasks
            .iter()
            .map(|(k, t)| (&replicas[*k] as &dyn AgentStore).enqueue_task_agent(t, 1, None)),
    )
    .await;
    for o in 0..owners {
        let of_owner: Vec<bool> = queued[o * 3..o * 3 + 3]
            .iter()
            .map(|q| *q.as_ref().unwrap())
            .collect();
        assert_eq!(
            of_owner.iter().filter(|q| **q).count(),
            1,
            "u{o}: {of_owner:?} against a cap of one"
        );
    }
}

/// A batch of admissions the database refuses as a whole (here one run reuses another's id)
/// is admitted one by one: the rest start, the one at fault alone is refused and leaves nothing.
#[tokio::test]
async fn a_batch_of_admissions_the_database_refuses_is_admitted_one_by_one() {
    let db = TestDb::create().await.unwrap();
    let store = pg_store(db.url(), 4).await;
    let s: &dyn AgentStore = &store;
    assert!(matches!(
        s.admit(&admit_new("r1", "t1", "alice", None))
            .await
            .unwrap(),
        Admitted::Started { .. }
    ));
    let batch = [
        admit_new("r2", "t2", "bob", None),
        admit_new("r1", "t3", "carol", None),
        admit_new("r4", "t4", "dave", None),
    ];
    let before = store.admission_counts();
    let answers = futures_util::future::join_all(batch.iter().map(|a| s.admit(a))).await;
    let after = store.admission_counts();
    assert_eq!(after.batches_retried - before.batches_retried, 1);
    assert!(
        matches!(answers[0], Ok(Admitted::Started { .. })),
        "{:?}",
        answers[0]
    );
    assert!(
        matches!(answers[1], Err(StoreError::Conflict(_))),
        "{:?}",
        answers[1]
    );
    assert!(
        matches!(answers[2], Ok(Admitted::Started { .. })),
        "{:?}",
        answers[2]
    );
    assert!(s.get_thread("carol", "t3").await.unwrap().is_none());
    assert_eq!(
        s.get_run("alice", "r1").await.unwrap().unwrap().thread_id,
        "t1"
    );
    for (owner, run) in [("bob", "r2"), ("dave", "r4")] {
        assert_eq!(seqs(s, run).await, [1], "{owner}'s run and its first event");
    }
}

/// A batch is one transaction with the owners' session summaries it reads: when that read
/// fails after the runs were written, nothing of the batch stays, so admitting each again alone
/// never meets its own rows — every run is told the database's error, and none is left behind
/// with nothing to run it.
#[tokio::test]
async fn a_batch_whose_summaries_cannot_be_read_admits_nothing() {
    let db = TestDb::create().await.unwrap();
    let store = pg_store(db.url(), 4).await;
    let s: &dyn AgentStore = &store;
    let asking = |i: usize| Admission {
        summaries: 3,
        ..admit_new(&format!("r{i}"), &format!("t{i}"), &format!("u{i}"), None)
    };
    // A first batch prepares its statements on the admitter's connection.
    let first = [asking(0), asking(1)];
    for answer in futures_util::future::join_all(first.iter().map(|a| s.admit(a))).await {
        assert!(matches!(answer, Ok(Admitted::Started { .. })), "{answer:?}");
    }
    let admin = side_connection(db.url()).await;
    admin
        .batch_execute("DROP TABLE agent.session_archives")
        .await
        .unwrap();

    let batch = [asking(2), asking(3), asking(4)];
    let answers = futures_util::future::join_all(batch.iter().map(|a| s.admit(a))).await;
    for (a, answer) in batch.iter().zip(answers) {
        let id = &a.run.id;
        assert!(
            matches!(answer, Err(StoreError::Rejected(_))),
            "{id}: {answer:?}"
        );
        assert!(s.get_run(&a.run.owner, id).await.unwrap().is_none(), "{id}");
        let thread = s.get_thread(&a.run.owner, &a.run.thread_id).await.unwrap();
        assert!(thread.is_none(), "{id}");
    }
}

/// Run `r{i}` is user `u{i}`'s, on thread `t{i}`.
fn owner_of(run_id: &str) -> String {
    run_id.replacen('r', "u", 1)
}

/// Admits runs r0.. for as many users (each user may have only so many live runs).
async fn runs_of_many_owners(s: &dyn AgentStore, n: usize) -> Vec<Lease> {
    let mut leases = Vec::new();
    for i in 0..n {
        let run = new_run(&format!("r{i}"), &format!("t{i}"), &format!("u{i}"), None);
        match s
            .admit(&admission(run, true, Duration::from_secs(60)))
            .await
            .unwrap()
        {
            Admitted::Started { lease, .. } => leases.push(lease),
            other => panic!("not admitted: {other:?}"),
        }
    }
    leases
}

/// Issue 13: a commit's "new events" notice is sent after the commit, from the store's notice
/// connection, batched with other runs' notices. Another replica still hears of every run that
/// committed events, and whatever a notice announces is already readable when it arrives.
#[tokio::test]
async fn every_run_that_commits_events_is_announced_to_other_replicas_after_its_rows() {
    use agent_svc::store::RunNotice;
    use std::collections::BTreeSet;
    let b = postgres().await;
    let s = &b.store;
    let other: Arc<dyn AgentStore> = Arc::new(pg_store(b._db.as_ref().unwrap().url(), 2).await);
    let mut heard = other.notices().expect("PostgreSQL has notices");
    // The other replica listens once its notice connection is up: a probe run commits until
    // it is heard.
    let probe = started(s, "probe", "t-probe", Duration::from_secs(60)).await;
    let mut listening = false;
    for seq in 2..100 {
        s.commit(&probe, events(&[seq])).await.unwrap();
        let wait = tokio::time::timeout(Duration::from_millis(200), async {
            loop {
                if let Ok(RunNotice::Events(id)) = heard.recv().await {
                    break id;
                }
            }
        });
        if wait.await.is_ok_and(|id| id == "probe") {
            listening = true;
            break;
        }
    }
    assert!(listening, "the other replica never heard the probe run");

    // Twenty runs, each its own user's, commit at once: their notices share transactions.
    let leases = runs_of_many_owners(s.as_ref(), 20).await;
    futures_util::future::try_join_all(leases.iter().map(|l| s.commit(l, events(&[2, 3]))))
        .await
        .unwrap();

    let mut announced = BTreeSet::new();
    while announced.len() < 20 {
        let notice = tokio::time::timeout(Duration::from_secs(10), heard.recv())
            .await
            .unwrap_or_else(|_| panic!("only {announced:?} were announced"))
            .unwrap();
        if let RunNotice::Events(run_id) = notice
            && run_id != "probe"
        {
            assert_eq!(
                seqs(other.as_ref(), &run_id).await,
                [1, 2, 3],
                "{run_id}'s rows are readable when its notice arrives"
            );
            announced.insert(run_id);
        }
    }
    let expected: BTreeSet<String> = (0..20).map(|i| format!("r{i}")).collect();
    assert_eq!(announced, expected);
}

/// B-5, E-12: migration V17's backfill. A task already queued or ended has recorded every
/// attempt it made; one running has not recorded its current attempt, whose run is followed by
/// whatever takes it up next (never a second run beside it).
#[tokio::test]
async fn v17_settles_the_attempts_tasks_made_before_it_except_a_running_ones_current() {
    let db = TestDb::create().await.unwrap();
    PgStore::migrate_to(db.url(), 16).await.unwrap();
    let side = side_connection(db.url()).await;
    side.batch_execute(
        "INSERT INTO agent.threads (id, owner, title) VALUES ('parent', 'alice', 'p'); \
         INSERT INTO agent.task_agents (id, owner, parent_thread_id, instructions, goal, state, attempts) VALUES \
           ('never-tried', 'alice', 'parent', 'i', 'g', 'queued', 0), \
           ('retrying', 'alice', 'parent', 'i', 'g', 'queued', 1), \
           ('on-its-second', 'alice', 'parent', 'i', 'g', 'running', 2), \
           ('done', 'alice', 'parent', 'i', 'g', 'completed', 1), \
           ('gave-up', 'alice', 'parent', 'i', 'g', 'failed', 2)",
    )
    .await
    .unwrap();

    PgStore::migrate(db.url()).await.unwrap();
    let settled: Vec<(String, i32)> = side
        .query(
            "SELECT id, settled_attempt FROM agent.task_agents ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let expected = [
        ("done", 1),
        ("gave-up", 2),
        ("never-tried", 0),
        ("on-its-second", 1),
        ("retrying", 1),
    ];
    assert_eq!(
        settled,
        expected.map(|(id, n)| (id.to_owned(), n)),
        "each task's recorded attempts"
    );
}

/// A pre-built index V19 finds in place is kept; one whose CONCURRENTLY build was interrupted
/// (invalid) is built again, so GetUsage never reads every run through a broken index.
#[tokio::test]
async fn v19_replaces_an_interrupted_prebuild_of_its_index_and_keeps_a_valid_one() {
    let index = "SELECT i.indisvalid, i.indisunique FROM pg_index i \
                 JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'runs_owner_created'";
    for interrupted in [true, false] {
        let db = TestDb::create().await.unwrap();
        PgStore::migrate_to(db.url(), 18).await.unwrap();
        let side = side_connection(db.url()).await;
        side.batch_execute(
            "INSERT INTO agent.threads (id, owner, title) VALUES ('t', 'alice', 't'); \
             INSERT INTO agent.runs (id, thread_id, owner, state, channel) VALUES \
               ('r1', 't', 'alice', 'completed', 'web'), ('r2', 't', 'alice', 'completed', 'web')",
        )
        .await
        .unwrap();
        // A unique build over alice's two runs fails part-way, leaving an invalid index.
        let prebuild = if interrupted {
            "CREATE UNIQUE INDEX CONCURRENTLY runs_owner_created ON agent.runs (owner)"
        } else {
            "CREATE INDEX CONCURRENTLY runs_owner_created ON agent.runs (owner, created_at)"
        };
        assert_eq!(side.batch_execute(prebuild).await.is_err(), interrupted);
        let before: bool = side.query_one(index, &[]).await.unwrap().get(0);
        assert_eq!(before, !interrupted);

        PgStore::migrate(db.url()).await.unwrap();
        let after = side.query_one(index, &[]).await.unwrap();
        assert_eq!(
            (after.get::<_, bool>(0), after.get::<_, bool>(1)),
            (true, false),
            "valid and not unique (interrupted: {interrupted})"
        );
    }
}
