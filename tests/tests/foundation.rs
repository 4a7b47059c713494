//! Foundation: both services serve health and reflection, report readiness honestly, apply
//! migrations safely across replicas, refuse what they cannot do yet, and drain on shutdown.

use std::collections::HashMap;

use steward_proto::{AGENT_SERVICE_NAME, GATEWAY_SERVICE_NAME};
use steward_tests::{
    Backend, TestDb, channel, spawn_app, spawn_app_with, start_agent, start_gateway,
    wait_for_status,
};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_reflection::pb::v1alpha::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
};

#[tokio::test]
async fn both_services_report_serving_on_postgres() {
    let app = spawn_app().await;
    for (addr, name) in [
        (app.agent_addr, AGENT_SERVICE_NAME),
        (app.gateway_addr, GATEWAY_SERVICE_NAME),
    ] {
        assert_eq!(
            app.health(addr, name).await.unwrap(),
            ServingStatus::Serving
        );
        assert_eq!(app.health(addr, "").await.unwrap(), ServingStatus::Serving);
    }
    assert!(app.shutdown().await.iter().all(Result::is_ok));
}

#[tokio::test]
async fn both_services_report_serving_on_the_embedded_store() {
    let app = spawn_app_with(Backend::Memory, &[]).await;
    assert_eq!(
        app.health(app.agent_addr, AGENT_SERVICE_NAME)
            .await
            .unwrap(),
        ServingStatus::Serving
    );
    assert_eq!(
        app.health(app.gateway_addr, GATEWAY_SERVICE_NAME)
            .await
            .unwrap(),
        ServingStatus::Serving
    );
    assert!(app.shutdown().await.iter().all(Result::is_ok));
}

#[tokio::test]
async fn an_unknown_service_name_is_not_found_by_health() {
    let app = spawn_app_with(Backend::Memory, &[]).await;
    let err = app
        .health(app.agent_addr, "steward.nope.v1.Nope")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

async fn listed_services(addr: std::net::SocketAddr) -> Vec<String> {
    let mut client = ServerReflectionClient::new(channel(addr).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection answers")
        .into_inner();
    let response = responses
        .next()
        .await
        .expect("one response")
        .expect("no error");
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            let mut names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
            names.sort();
            names
        }
        other => panic!("expected a service list, got {other:?}"),
    }
}

#[tokio::test]
async fn o5_reflection_lists_exactly_what_each_process_serves() {
    let app = spawn_app_with(Backend::Memory, &[]).await;
    for (addr, own) in [
        (app.agent_addr, AGENT_SERVICE_NAME),
        (app.gateway_addr, GATEWAY_SERVICE_NAME),
    ] {
        let mut want: Vec<String> = std::iter::once(own)
            .chain(svc_kit::grpc::COMMON_SERVICES)
            .map(str::to_owned)
            .collect();
        want.sort();
        assert_eq!(listed_services(addr).await, want);
    }
}

#[tokio::test]
async fn readiness_drops_to_not_serving_when_the_database_goes_away() {
    let app = spawn_app().await;
    app.db
        .as_ref()
        .expect("postgres backend")
        .drop_now()
        .await
        .expect("drop the database");
    wait_for_status(
        channel(app.gateway_addr).await,
        GATEWAY_SERVICE_NAME,
        ServingStatus::NotServing,
    )
    .await;
    wait_for_status(
        channel(app.agent_addr).await,
        AGENT_SERVICE_NAME,
        ServingStatus::NotServing,
    )
    .await;
    // Alive all the same: a database outage must not have the pods restarted.
    for addr in [app.agent_addr, app.gateway_addr] {
        wait_for_status(
            channel(addr).await,
            svc_kit::health::LIVENESS,
            ServingStatus::Serving,
        )
        .await;
    }
}

#[tokio::test]
async fn replicas_starting_together_apply_each_migration_exactly_once() {
    let db = TestDb::create().await.unwrap();
    let env: HashMap<String, String> = HashMap::from([
        ("DATABASE_URL".into(), db.url().to_owned()),
        ("AGENT_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
        ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
    ]);
    let (g1, g2, g3, a1, a2, a3) = tokio::join!(
        start_gateway(&env),
        start_gateway(&env),
        start_gateway(&env),
        start_agent(&env),
        start_agent(&env),
        start_agent(&env)
    );
    let mut started = vec![
        g1.unwrap(),
        g2.unwrap(),
        g3.unwrap(),
        a1.unwrap(),
        a2.unwrap(),
        a3.unwrap(),
    ];

    let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    for (table, dir) in [
        ("agent_schema_history", "../agent-svc/migrations"),
        ("gateway_schema_history", "../gateway-svc/migrations"),
    ] {
        let shipped = std::fs::read_dir(dir).unwrap().count();
        let rows = client
            .query(
                &format!("SELECT version FROM {table} ORDER BY version"),
                &[],
            )
            .await
            .unwrap();
        let versions: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
        let expected: Vec<i32> = (1..=shipped as i32).collect();
        assert_eq!(versions, expected, "{table} records each migration once");
    }
    for schema in ["agent", "gateway"] {
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1",
                &[&schema],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1, "schema {schema} exists");
    }
    drop(client);
    let _ = conn.await;
    for s in &mut started {
        s.stop().await.unwrap();
    }
}

#[tokio::test]
async fn shutdown_reports_not_serving_and_drains_cleanly() {
    let app = spawn_app_with(Backend::Memory, &[]).await;
    let agent = channel(app.agent_addr).await;
    let mut watch = tonic_health::pb::health_client::HealthClient::new(agent)
        .watch(tonic_health::pb::HealthCheckRequest {
            service: AGENT_SERVICE_NAME.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        watch.next().await.unwrap().unwrap().status(),
        ServingStatus::Serving
    );

    // The open Watch stream is an in-flight call: the drain waits for it up to its deadline,
    // and it hears NOT_SERVING first so a load balancer stops routing here.
    let results = app.shutdown().await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let update = tokio::time::timeout(std::time::Duration::from_secs(5), watch.next())
        .await
        .expect("an update after shutdown")
        .expect("stream still open")
        .expect("no error");
    assert_eq!(update.status(), ServingStatus::NotServing);
}

#[tokio::test]
async fn an_unreachable_database_fails_start_up_with_a_clear_error() {
    let env: HashMap<String, String> = HashMap::from([
        (
            "DATABASE_URL".into(),
            "postgres://postgres@127.0.0.1:1/none".into(),
        ),
        ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
    ]);
    let Err(err) = start_gateway(&env).await else {
        panic!("gateway started without a database")
    };
    assert!(err.contains("cannot connect to PostgreSQL"), "{err}");
}

/// a migration that changes a column under a connection's prepared statement fails that
/// statement once ("cached plan must not change result type"); the connection then forgets its
/// prepared statements, so the next use is prepared again and works, instead of failing for as
/// long as the pooled connection lives.
#[tokio::test]
async fn a_statement_made_stale_by_a_migration_fails_once_then_is_prepared_again() {
    let db = TestDb::create().await.unwrap();
    let pool = svc_kit::pg::pool(
        db.url(),
        &svc_kit::pg::PoolOptions {
            max_connections: 1,
            ..svc_kit::pg::PoolOptions::default()
        },
    )
    .unwrap();
    let side = steward_tests::db::connect(&db).await;
    side.batch_execute("CREATE TABLE widgets (size int); INSERT INTO widgets VALUES (3)")
        .await
        .unwrap();
    let read = "SELECT size FROM widgets";
    let pooled = svc_kit::pg::checkout(&pool, "test").await.unwrap();
    let size: i32 = pooled.query_one(read, &[]).await.unwrap().get(0);
    assert_eq!(size, 3);

    side.batch_execute("ALTER TABLE widgets ALTER COLUMN size TYPE bigint")
        .await
        .unwrap();
    let stale = pooled.query_one(read, &[]).await.unwrap_err();
    assert_eq!(
        stale.code(),
        Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED),
        "{stale:?}"
    );
    let size: i64 = pooled.query_one(read, &[]).await.unwrap().get(0);
    assert_eq!(size, 3, "prepared again on the same connection");
}

/// `db` with both services' migrations applied, and a client on it.
async fn migrated_by_both(db: &TestDb) -> tokio_postgres::Client {
    agent_svc::store::postgres::PgStore::migrate(db.url())
        .await
        .unwrap();
    gateway_svc::store::postgres::PgStore::migrate(db.url())
        .await
        .unwrap();
    steward_tests::db::connect(db).await
}

/// A database whose history table says `version` of `table` is applied.
async fn record_a_newer_migration(client: &tokio_postgres::Client, table: &str, version: i32) {
    client
        .execute(
            &format!(
                "INSERT INTO {table} (version, name, applied_on, checksum) \
                 VALUES ($1, 'from_a_newer_build', '2026-11-28T00:00:00Z', '1')"
            ),
            &[&version],
        )
        .await
        .unwrap();
}

/// A rollback, or a replica of the build before restarting mid-deploy, meets a database a
/// newer build migrated further: it runs on that schema rather than refusing to start.
#[tokio::test]
async fn an_older_build_starts_on_a_database_a_newer_build_migrated_further() {
    let db = TestDb::create().await.unwrap();
    let client = migrated_by_both(&db).await;
    record_a_newer_migration(&client, "agent_schema_history", 900).await;
    record_a_newer_migration(&client, "gateway_schema_history", 900).await;

    let env: HashMap<String, String> = HashMap::from([
        ("DATABASE_URL".into(), db.url().to_owned()),
        ("AGENT_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
        ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
    ]);
    let mut gateway = start_gateway(&env).await.expect("the gateway starts");
    let mut agent = start_agent(&env).await.expect("agent-svc starts");
    wait_for_status(
        channel(agent.addr).await,
        AGENT_SERVICE_NAME,
        ServingStatus::Serving,
    )
    .await;
    agent.stop().await.unwrap();
    gateway.stop().await.unwrap();
}

/// An `ALTER TABLE` that waits for a lock queues every later statement on its table behind it.
/// A migration that meets a long reader gives way to the replicas' statements and tries again,
/// and lands once the reader is done.
#[tokio::test]
async fn a_migration_waiting_for_a_lock_gives_way_to_the_replicas_statements() {
    use agent_svc::store::postgres::PgStore;
    let db = TestDb::create().await.unwrap();
    PgStore::migrate_to(db.url(), 21).await.unwrap();
    let connect = || async {
        let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
    };
    // A backup, say: a transaction that has read agent.threads and goes on.
    let reader = connect().await;
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM agent.threads")
        .await
        .unwrap();
    let migration = tokio::spawn({
        let url = db.url().to_owned();
        async move { PgStore::migrate(&url).await }
    });
    let replica = connect().await;
    // V22's ALTER TABLE agent.threads is waiting for its lock.
    tokio::time::timeout(std::time::Duration::from_secs(20), async {
        loop {
            let waiting: bool = replica
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                     WHERE c.relname = 'threads' AND NOT l.granted)",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if waiting {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the migration reached agent.threads");
    // A replica's statement on the table is not held until the reader ends.
    tokio::time::timeout(
        std::time::Duration::from_secs(15),
        replica.execute(
            "INSERT INTO agent.threads (id, owner, title) VALUES ('t1', 'alice', 'x')",
            &[],
        ),
    )
    .await
    .expect("the replica's write is not stuck behind the migration")
    .unwrap();
    reader.batch_execute("COMMIT").await.unwrap();
    migration
        .await
        .unwrap()
        .expect("the migration lands once the reader is done");
    let applied: i32 = replica
        .query_one("SELECT max(version) FROM agent_schema_history", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied, 25);
}

/// Each shipped migration's checksum as refinery records it. A database that applied a
/// migration refuses to start a build whose text of it differs (DivergentVersion), so an
/// applied migration is never edited: a change goes in a new one. Adding one adds its line.
const MIGRATION_CHECKSUMS: &[(&str, &[&str])] = &[
    (
        "agent_schema_history",
        &[
            "17510433710214866874", // V1
            "13374846272930868597", // V2
            "8523000306498136507",  // V3
            "17779650141851169313", // V4
            "2000864238174956167",  // V5
            "5827688699469369833",  // V6
            "7601377415597141041",  // V7
            "6353644777639963583",  // V8
            "3917228144175751815",  // V9
            "3410887479837327753",  // V10
            "6241649354685496050",  // V11
            "3794134900803999739",  // V12
            "2454378065499636988",  // V13
            "14277346539845596141", // V14
            "6865567933891173406",  // V15
            "5537883393104475580",  // V16
            "14090533175569331123", // V17
            "2414024052866243525",  // V18
            "7769397423420512243",  // V19
            "15488915999327955532", // V20
            "12731774979488163909", // V21
            "14619383028808738936", // V22
            "14650989266149762680", // V23
            "15586975895207243026", // V24
            "1892179349270800231",  // V25
        ],
    ),
    (
        "gateway_schema_history",
        &[
            "1693573921431933422",  // V1
            "11439032536882111629", // V2
            "12465095445599243572", // V3
            "14351319189822355212", // V4
            "13082823721360454074", // V5
            "7069324342974547702",  // V6
            "1731754192360862032",  // V7
            "10357449365668025505", // V8
            "9234735666995074740",  // V9
            "15737436639101030455", // V10
            "5892801394472467032",  // V11
            "6006530800582473756",  // V12
        ],
    ),
];

#[tokio::test]
async fn applied_migrations_are_never_edited() {
    let db = TestDb::create().await.unwrap();
    let client = migrated_by_both(&db).await;
    for (table, pinned) in MIGRATION_CHECKSUMS {
        let recorded: Vec<String> = client
            .query(
                &format!("SELECT checksum FROM {table} ORDER BY version"),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(
            recorded, *pinned,
            "{table}: an applied migration's text changed (or a new one is not pinned yet)"
        );
    }
}
