//! One throwaway PostgreSQL database per test: shared with the services' own binary tests.

pub use svc_kit::testing::TestDb;

/// A plain client on the test database, for a test that reads what the services wrote.
pub async fn connect(db: &TestDb) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    tokio::spawn(connection);
    client
}

/// Begins a transaction on `side` that holds `owner`'s admission lock (agent-svc's advisory
/// key for it), as a stalled replica's transaction would, until `side` rolls back or closes.
pub async fn hold_admission_lock(side: &tokio_postgres::Client, owner: &str) {
    side.batch_execute("BEGIN").await.expect("BEGIN");
    side.execute(
        "SELECT pg_advisory_xact_lock(hashtext('runs:' || $1::text))",
        &[&owner],
    )
    .await
    .expect("take the owner's admission lock");
}
