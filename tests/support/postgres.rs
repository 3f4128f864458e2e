//! The PostgreSQL the tests share (`scripts/ensure-postgres`), and a private schema per test so
//! that tests never see each other's rows.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::settings::PostgresSettings;
use tollgate::store::postgres::PostgresStore;

/// Where `scripts/ensure-postgres` puts the test database.
pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/tollgate_test";

/// The shared server's URL (`TOLLGATE_POSTGRES_URL`, else [`DEFAULT_POSTGRES_URL`]) when it
/// answers. Under `CI=true` a missing server fails the test; otherwise the test is skipped
/// with a printed reason.
pub async fn shared_postgres(test: &str) -> Option<String> {
    let url = std::env::var("TOLLGATE_POSTGRES_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_POSTGRES_URL.to_owned());
    let probe = async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&url).await?;
        sqlx::query("SELECT 1").execute(&mut conn).await?;
        conn.close().await
    };
    let why = match tokio::time::timeout(Duration::from_secs(5), probe).await {
        Ok(Ok(())) => return Some(url),
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 5 s".to_string(),
    };
    let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    assert!(
        !ci,
        "{test}: no PostgreSQL at {url} ({why}) and CI=true: run scripts/ensure-postgres or set TOLLGATE_POSTGRES_URL"
    );
    eprintln!("skipping {test}: no PostgreSQL at {url} ({why}; run scripts/ensure-postgres)");
    None
}

/// A schema name unique to this call: `t_<pid>_<nanos>_<n>`.
pub fn unique_schema() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000_000_000)
        .unwrap_or(0);
    format!(
        "t_{}_{}_{}",
        std::process::id(),
        nanos,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Settings for a store on `url` in `schema`, with timeouts generous enough for a loaded
/// machine.
pub fn settings(url: &str, schema: &str) -> PostgresSettings {
    PostgresSettings {
        url: url.to_owned(),
        schema: schema.to_owned(),
        pool_size: 8,
        connect_timeout_ms: 10_000,
        command_timeout_ms: 10_000,
        ..PostgresSettings::default()
    }
}

/// A connected store on `url` in `schema` (created and migrated).
pub async fn store(url: &str, schema: &str) -> PostgresStore {
    let store = PostgresStore::new(&settings(url, schema)).expect("valid settings");
    store
        .connect(Duration::from_secs(10))
        .await
        .expect("connects and migrates");
    store
}

/// Drops `schema` and everything in it.
pub async fn drop_schema(url: &str, schema: &str) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connects");
    sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&mut conn)
        .await
        .expect("drops the schema");
}

/// A schema of its own on the shared server, for one test.
pub struct TestSchema {
    /// The shared server's URL.
    pub url: String,
    /// The schema's name ([`unique_schema`]).
    pub name: String,
}

impl TestSchema {
    /// A fresh schema name on the shared server, or `None` (the test skips) when there is no
    /// server outside CI; see [`shared_postgres`].
    pub async fn new(test: &str) -> Option<TestSchema> {
        let url = shared_postgres(test).await?;
        Some(TestSchema {
            url,
            name: unique_schema(),
        })
    }

    /// A connected store in this schema (created and migrated on first use).
    pub async fn store(&self) -> PostgresStore {
        store(&self.url, &self.name).await
    }

    /// Drops the schema and everything in it.
    pub async fn drop(self) {
        drop_schema(&self.url, &self.name).await;
    }
}
