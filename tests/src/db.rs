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
