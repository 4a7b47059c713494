//! Degrade loudly (issue 13, R-5): a run that cannot get its tools from gateway-svc fails with
//! a clear terminal error of kind GATEWAY_UNAVAILABLE — never a COMPLETED answer given without
//! the tools it was meant to have. The user's message is kept either way.

use steward_proto::agent::v1 as pb;
use steward_tests::{
    agent_as,
    agent_calls::{messages, run_once},
    spawn_app,
};

async fn run_on_replica_with(extra: &[(&str, &str)]) -> (pb::RunResult, Vec<pb::Message>) {
    let mut app = spawn_app().await;
    let addr = app.start_another_agent_with(extra).await;
    let mut alice = agent_as(addr, "alice").await;
    let result = run_once(&mut alice, "what tasks do I have?", "")
        .await
        .expect("a failed run is a result, not an RPC error");
    let thread = messages(&mut alice, &result.thread_id)
        .await
        .expect("the thread");
    (result, thread)
}

fn assert_failed_loudly(result: &pb::RunResult, thread: &[pb::Message], reason: &str) {
    assert_eq!(result.status, pb::RunState::Failed as i32, "{result:?}");
    assert_eq!(
        result.failure_kind,
        pb::FailureKind::GatewayUnavailable as i32,
        "{result:?}"
    );
    assert!(
        result.error.contains("could not list its tools") && result.error.contains(reason),
        "{}",
        result.error
    );
    assert_eq!(thread[0].content, "what tasks do I have?", "{thread:?}");
    assert!(
        thread.iter().any(|m| m.content == result.error),
        "the error is shown in the thread: {thread:?}"
    );
}

#[tokio::test]
async fn r5_a_run_whose_gateway_cannot_be_reached_fails_as_gateway_unavailable_not_completed() {
    // Port 1 on loopback: connection refused on every try.
    let (result, thread) = run_on_replica_with(&[("GATEWAY_URL", "http://127.0.0.1:1")]).await;
    assert_failed_loudly(&result, &thread, "unreachable");
}

#[tokio::test]
async fn r5_a_gateway_that_refuses_the_agent_fails_the_run_at_once_with_the_reason() {
    let (result, thread) =
        run_on_replica_with(&[("GATEWAY_SERVICE_TOKEN", "not-the-gateways-secret-token")]).await;
    assert_failed_loudly(&result, &thread, "refused");
}

#[tokio::test]
async fn r5_a_refused_database_connection_reports_postgresqls_own_words() {
    let db = steward_tests::TestDb::create()
        .await
        .expect("a test database");
    let (admin, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    // Nobody but superusers may connect to it any more: every new connection is refused, as
    // when the server runs out of connection slots.
    admin
        .batch_execute(&format!("ALTER DATABASE {} CONNECTION LIMIT 0", db.name()))
        .await
        .expect("limit the database");
    let role = format!("limited_{}", db.name());
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD '{role}'; GRANT CONNECT ON DATABASE {} TO {role}",
            db.name()
        ))
        .await
        .expect("a role that is not a superuser");
    // The same server and database as that role (whatever user and password the URL had).
    let (scheme, rest) = db.url().split_once("://").expect("a URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    let url = format!("{scheme}://{role}:{role}@{host}");
    let pool = svc_kit::pg::pool(
        &url,
        &svc_kit::pg::PoolOptions {
            max_connections: 2,
            acquire_timeout: std::time::Duration::from_secs(2),
            ..svc_kit::pg::PoolOptions::default()
        },
    )
    .expect("a pool");
    let refused = svc_kit::pg::ping(&pool).await;
    drop(pool);
    // Roles are the server's, not the database's: this one goes before anything is asserted.
    admin
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .expect("drop the role");
    let err = refused.expect_err("refused").to_string();
    assert!(
        err.contains("too many connections for database"),
        "the database's own words are lost: {err}"
    );
}

#[tokio::test]
async fn pools_that_could_exceed_the_servers_connections_are_warned_about_at_start() {
    let db = steward_tests::TestDb::create()
        .await
        .expect("a test database");
    // A connection of the test's own open on the server, so at least one is seen elsewhere.
    let (_open, connection) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    tokio::spawn(connection);
    let gateway = steward_tests::procs::ServiceProc::spawn(
        "gateway-svc",
        vec![
            ("GATEWAY_LISTEN_ADDR".into(), "127.0.0.1:0".into()),
            (
                "GATEWAY_SERVICE_TOKEN".into(),
                steward_tests::SERVICE_TOKEN.into(),
            ),
            ("DATABASE_URL".into(), db.url().to_owned()),
            // Two services with 1,000 connections each: more than any default server allows.
            ("DATABASE_MAX_CONNECTIONS".into(), "1000".into()),
        ],
    )
    .await
    .expect("gateway-svc starts");
    // The check runs before the service says it is listening, so the line is already there.
    let warned = gateway
        .log()
        .into_iter()
        .find(|l| l.contains("DATABASE_MAX_CONNECTIONS=1000"))
        .unwrap_or_else(|| panic!("no warning:\n{}", gateway.log_tail(20)));
    assert!(
        warned.contains(r#""level":"WARN""#) && warned.contains("can open 2000 connections"),
        "{warned}"
    );
    // And by what the server has open now: whatever else holds connections, this pool full
    // passes the limit (the count comes from the server, so this also shows it was read).
    assert!(
        gateway.log().iter().any(|l| l.contains(r#""level":"WARN""#)
            && l.contains("connections this role can see are open to this PostgreSQL already")
            && l.contains("DATABASE_MAX_CONNECTIONS=1000")),
        "{}",
        gateway.log_tail(20)
    );
}
