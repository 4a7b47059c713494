//! One throwaway PostgreSQL database per test, at `STEWARD_TEST_DATABASE_URL` (default: the
//! machine's trust-auth server).

use std::sync::atomic::{AtomicU64, Ordering};

use tokio_postgres::NoTls;

const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

fn admin_url() -> String {
    std::env::var("STEWARD_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned())
}

/// A database created for one test and dropped (with its connections) when this is dropped.
pub struct TestDb {
    name: String,
    url: String,
}

impl TestDb {
    pub async fn create() -> Result<Self, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let admin = admin_url();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let name = format!(
            "steward_test_{}_{}_{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let (client, conn) = tokio_postgres::connect(&admin, NoTls).await.map_err(|e| {
            format!(
                "cannot reach the test PostgreSQL at {admin} ({e}); start it or set \
                 STEWARD_TEST_DATABASE_URL"
            )
        })?;
        let conn = tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .map_err(|e| format!("cannot create the test database {name}: {e}"))?;
        drop(client);
        let _ = conn.await;
        let url = with_dbname(&admin, &name);
        Ok(Self { name, url })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Drops the database now, terminating its connections: what an outage looks like.
    pub async fn drop_now(&self) -> Result<(), String> {
        let (client, conn) = tokio_postgres::connect(&admin_url(), NoTls)
            .await
            .map_err(|e| e.to_string())?;
        let conn = tokio::spawn(conn);
        client
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await
            .map_err(|e| e.to_string())?;
        drop(client);
        let _ = conn.await;
        Ok(())
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime, which cannot be blocked on; a short-lived thread
        // with its own runtime does the clean-up synchronously so nothing leaks between tests.
        let name = self.name.clone();
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    if let Ok((client, conn)) = tokio_postgres::connect(&admin_url(), NoTls).await {
                        let conn = tokio::spawn(conn);
                        let _ = client
                            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                            .await;
                        drop(client);
                        let _ = conn.await;
                    }
                });
            }
        });
        let _ = handle.join();
    }
}

/// Replaces the database name in a `postgres://` URL (the path segment before any query).
fn with_dbname(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let host_part = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(q) => format!("{host_part}/{name}?{q}"),
        None => format!("{host_part}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::with_dbname;

    #[test]
    fn the_database_name_is_replaced_and_options_kept() {
        assert_eq!(
            with_dbname("postgres://postgres@127.0.0.1:5432/postgres", "t1"),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(
            with_dbname("postgres://u@h/db?sslmode=disable", "t2"),
            "postgres://u@h/t2?sslmode=disable"
        );
        assert_eq!(
            with_dbname("postgres://u@h:5432", "t3"),
            "postgres://u@h:5432/t3"
        );
    }
}
