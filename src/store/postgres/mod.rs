//! The Postgres store (docs/backends.md): bucket state in one table, shared by every replica, each
//! request decided all or nothing while its buckets' rows are locked, inside PostgreSQL.
//!
//! Concurrent requests share a call (`batch`: a lane per connection, `connections`, takes every
//! request waiting, up to 64). **A batch is one statement** in autocommit, `tollgate_decide` (a PL/pgSQL
//! function created by the migrations; its calling convention is in `function`):
//! 1. One `INSERT ... ON CONFLICT DO UPDATE ... WHERE false` over the buckets of all its
//!    requests, deduplicated and in ascending key order, takes each bucket's row lock: it
//!    inserts the row a first touch needs (NULL state, read as full), or waits for whoever holds
//!    the existing one and locks it without writing a version of it (inserting it again if that
//!    holder deleted it meanwhile). So no request decides on a row another can still change or
//!    delete, concurrent first touches serialise, and since every batch locks in the same order,
//!    requests over {A, B} and {B, A} never deadlock.
//! 2. Reads `clock_timestamp()` once every lock is held, and decides each request in turn with
//!    the arithmetic of `lua/decide.lua` (the same per-bucket arguments, worked out here from
//!    each bucket's [`Plan`](crate::core::schedule::Plan) by the Redis store's
//!    [`bucket_args`](crate::store::redis::script::bucket_args)); the shared vectors pin it to
//!    the memory store's [`crate::core::bucket::decide`], micro-token for micro-token.
//! 3. Writes each changed row once (a bucket full again is deleted, as is a row created here
//!    and left unchanged), and returns the answers: the locks are held for the function's own
//!    work, never across a round trip to tollgate.
//!
//! The function leaves some requests to a transaction decided in Rust with the pure core (the
//! previous design, kept for them): a scheduled limit (bringing a bucket forward over changes
//! of limit is tollgate's), one naming an instance twice (refused there), and those it answers
//! "again" (a limit tollgate looked up for a time the server's clock is not in, a bucket
//! written before a reload that changed its limit, a debt quota crossed by a reset edge). If
//! PostgreSQL refuses a statement, its requests are decided again one at a time, so only the
//! one at fault fails.
//!
//! **Rows** are updated in place as heap-only tuples (HOT): the primary key is the only index
//! and never changes, and the table's fillfactor leaves room on each page. `postgres.unlogged`
//! makes the table `UNLOGGED` (no WAL: its rows are lost on a crash and not replicated).
//!
//! Replicas whose clocks disagree still agree on every bucket: all time comes from Postgres.
//! Rows whose bucket is full again are deleted by [`PostgresStore::sweep`] in bounded passes.

mod batch;

mod connections;

mod lane;

mod function;

mod settings;

pub use settings::PostgresSettings;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};

use self::batch::Job;
use self::connections::Connections;
use self::lane::Batcher;
use super::redact_url;
use super::{Applied, BucketRef, Cause, ConnectError, Peeked, Store, StoreError};
use crate::core::bucket::{BucketState, Demand};
use crate::core::clock::Clock;

/// How long past a request's deadline its caller still waits for the lane's answer.
const LANE_MARGIN: Duration = Duration::from_millis(50);

/// Postgres's `clock_timestamp()` in µs since the epoch, as SQL (exact: `extract` gives
/// `numeric` on PostgreSQL 14 and later).
const CLOCK_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

/// The migrations in `migrations/`, applied by [`PostgresStore::connect`].
pub(crate) static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// What [`PostgresStore::migrate`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationReport {
    /// The migrations applied now, `(version, description)`, in order.
    pub applied: Vec<(i64, String)>,
    /// How many were already in place before.
    pub in_place: usize,
}

/// The Postgres store. Cheap to clone; clones share the connections.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// The lanes' connections ([`batch`], [`connections`]).
    connections: Arc<Connections>,
    /// One connection for the sweep, peek, reset and probes.
    aux: PgPool,
    /// Connection options without `statement_timeout`, for migrations (waiting for another
    /// replica's migration lock is one long statement).
    setup: PgConnectOptions,
    /// What the lanes and the pool connect with: also a direct connection's, whose error says
    /// why a server cannot be used (the pool's says only that it timed out).
    options: PgConnectOptions,
    /// `postgres.connect_timeout_ms`.
    connect_timeout: Duration,
    schema: String,
    /// How long one decision may take, its whole transaction included.
    timeout: Duration,
    /// Whether the schema and migrations are in place (a successful [`PostgresStore::connect`]).
    migrated: AtomicBool,
    /// `postgres.migrate`: whether [`PostgresStore::connect`] applies the migrations or only
    /// checks them.
    migrate: bool,
    /// The URL, password redacted.
    describe: String,
    /// Tests only: decide at this clock's time instead of `clock_timestamp()`.
    time_override: Option<Arc<dyn Clock>>,
    /// Decision lanes, one per connection of `pool_size`; started on the first decision.
    batcher: OnceLock<Batcher>,
    /// `postgres.pool_size`.
    lanes: u32,
    /// `postgres.unlogged`.
    unlogged: bool,
}

fn store_error(e: sqlx::Error) -> StoreError {
    let timeout = match &e {
        sqlx::Error::PoolTimedOut => true,
        // 57014 query_canceled: the statement timeout.
        sqlx::Error::Database(d) => d.code().as_deref() == Some("57014"),
        _ => false,
    };
    if timeout {
        StoreError::Timeout(Cause::from_error(e))
    } else {
        StoreError::Unavailable(Cause::from_error(e))
    }
}

/// A stored state from its columns: NULL (a row a request created and left unchanged) is
/// `None`, a full bucket; a negative value (not tollgate's) refuses the request.
fn row_state(key: &[u8], tokens: Option<i64>, updated: Option<i64>) -> Result<Option<BucketState>, StoreError> {
    let (Some(t), Some(u)) = (tokens, updated) else {
        return Ok(None);
    };
    match (u64::try_from(t), u64::try_from(u)) {
        (Ok(tokens_ut), Ok(updated_us)) => Ok(Some(BucketState { tokens_ut, updated_us })),
        _ => Err(StoreError::Rejected(
            format!("negative bucket state in row {:?}", String::from_utf8_lossy(key)).into(),
        )),
    }
}

/// Why `postgres.url` does not parse, in one clause: sqlx nests "error with configuration: "
/// prefixes, and says "invalid port number" for a password with an unencoded '/' or '@' (then
/// the hint).
fn url_problem(e: &sqlx::Error) -> String {
    let mut why = e.to_string();
    while let Some(rest) = why.strip_prefix("error with configuration: ") {
        why = rest.to_owned();
    }
    let hint = if why.contains("invalid port") {
        " (in a URL, a password's special characters must be percent-encoded; or set postgres.password)"
    } else {
        ""
    };
    format!("postgres.url is not valid: {why}{hint}")
}

/// An i64 column for a u64 of micro-tokens or microseconds (all below 2^63; the far future
/// saturates).
fn column(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl PostgresStore {
    /// Builds the store for `settings` without connecting; [`PostgresStore::connect`] connects.
    ///
    /// Errors: invalid settings, or a URL that does not parse.
    pub fn new(settings: &PostgresSettings) -> Result<PostgresStore, ConnectError> {
        let describe = redact_url(&settings.url);
        let fail = |reason: String| ConnectError {
            backend: "Postgres",
            url: describe.clone(),
            reason,
        };
        settings.validate().map_err(fail)?;
        let options: PgConnectOptions = settings.url.parse().map_err(|e: sqlx::Error| fail(url_problem(&e)))?;
        let options = match &settings.password {
            Some(password) => options.password(password),
            None => options,
        };
        // sqlx asks the subscriber whether its statement log is enabled after every statement
        // and logs nothing when it is not; the answer stays behind in the per-layer filters'
        // thread-local state, and the next span or event made on that thread from a callsite
        // cached as always enabled is judged by it: calls lost their server span under load
        // (the trace layer's callsites now ask every time, `crate::traces`), and the log
        // layer's can still lose a line. Tollgate times its calls itself
        // (`tollgate_backend_*`), so sqlx logs no statement.
        let options = sqlx::ConnectOptions::disable_statement_logging(options);
        // The schema is a checked identifier, so it can go into the search path as it is.
        let setup = options.options([("search_path", format!("\"{}\"", settings.schema).as_str())]);
        let options = setup
            .clone()
            .options([("statement_timeout", &format!("{}ms", settings.command_timeout_ms.0))]);
        let acquire = settings.connect_timeout_ms.duration();
        // One connection per lane, kept open: a new connection costs a TCP and authentication
        // handshake (SCRAM: milliseconds of key derivation) that a decision's 15 ms budget
        // cannot afford. The sweep, admin calls and probes have their own, so a busy lane never
        // keeps them waiting (nor they a lane).
        let connections = Arc::new(Connections::new(options.clone(), acquire));
        let aux = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(acquire)
            .connect_lazy_with(options.clone());
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                connections,
                aux,
                setup,
                options,
                connect_timeout: settings.connect_timeout_ms.duration(),
                schema: settings.schema.clone(),
                timeout: settings.command_timeout_ms.duration(),
                migrated: AtomicBool::new(false),
                migrate: settings.migrate,
                describe,
                time_override: None,
                batcher: OnceLock::new(),
                lanes: settings.pool_size,
                unlogged: settings.unlogged,
            }),
        })
    }

    /// Tests only: decide at `clock`'s time instead of Postgres's `clock_timestamp()`, so the
    /// shared test vectors can move time. Must be called before any clone.
    pub fn with_time_override(mut self, clock: Arc<dyn Clock>) -> PostgresStore {
        Arc::get_mut(&mut self.inner)
            .expect("with_time_override before the store is shared")
            .time_override = Some(clock);
        self
    }

    /// Connects and makes sure the schema is ready for decisions, waiting at most `timeout`:
    /// with `postgres.migrate: true` (the default) by [`PostgresStore::migrate`]; with `false`
    /// by checking that every migration this build embeds is already applied (an operator runs
    /// `tollgate migrate` with a more privileged user, and tollgate's own user needs no right
    /// to create anything).
    ///
    /// Errors: Postgres not reachable in time, authentication refused, no right to create the
    /// schema, a migration that fails, or (with `migrate: false`) one not yet applied.
    pub async fn connect(&self, timeout: Duration) -> Result<(), ConnectError> {
        if self.inner.migrate {
            self.migrate(timeout).await?;
        } else {
            let setup = self.setup_pool();
            let check = async {
                if !self.schema_exists(&setup).await? {
                    return Err(format!(
                        "schema {:?} does not exist, and postgres.migrate is false: run `tollgate migrate` with \
                         these settings (and a user that may create it)",
                        self.inner.schema
                    ));
                }
                let applied = Self::applied_migrations(&setup).await?;
                let missing: Vec<String> = MIGRATOR
                    .iter()
                    .filter(|m| {
                        !applied
                            .iter()
                            .any(|(v, sum)| *v == m.version && sum[..] == m.checksum[..])
                    })
                    .map(|m| format!("{} {}", m.version, m.description))
                    .collect();
                if missing.is_empty() {
                    self.check_privileges(&setup).await?;
                    self.check_persistence(&setup).await
                } else {
                    Err(format!(
                        "schema {:?} lacks migrations {} (or they differ from this build's), and postgres.migrate \
                         is false: run `tollgate migrate` with these settings",
                        self.inner.schema,
                        missing.join(", ")
                    ))
                }
            };
            let checked = self.within(timeout, check).await;
            setup.close().await;
            checked?;
        }
        // Open the lanes' connections now, so the first decisions do not pay for them.
        let warm = async {
            (self.inner.connections.warm(self.inner.lanes as usize).await)
                .map_err(|e| format!("opening the lanes' connections: {e}"))
        };
        self.within(timeout, warm).await?;
        self.inner.migrated.store(true, Ordering::Release);
        Ok(())
    }

    /// Connects, creates the schema when missing and applies the migrations not yet applied
    /// (each once, in a transaction, recorded in the schema's `_sqlx_migrations`; replicas
    /// starting together take turns on an advisory lock), waiting at most `timeout`. This is
    /// `tollgate migrate`, and what `serve` does at start unless `postgres.migrate` is false.
    ///
    /// Errors: Postgres not reachable in time, authentication refused, no right to create the
    /// schema, a migration that fails, or a schema migrated by a build with migrations this
    /// one does not know.
    pub async fn migrate(&self, timeout: Duration) -> Result<MigrationReport, ConnectError> {
        let setup = self.setup_pool();
        let work = async {
            // CREATE SCHEMA needs the right to create in the database even when the schema
            // exists, so only when it does not: a user that owns an existing schema needs no more.
            if !self.schema_exists(&setup).await? {
                // `IF NOT EXISTS` still races with a replica starting at the same moment (a
                // unique violation on the catalogue); the schema exists either way.
                let create = format!("CREATE SCHEMA IF NOT EXISTS \"{}\"", self.inner.schema);
                if let Err(e) = sqlx::query(&create).execute(&setup).await {
                    let raced = matches!(&e, sqlx::Error::Database(d) if d.code().as_deref() == Some("23505"));
                    if !raced {
                        return Err(e.to_string());
                    }
                }
            }
            let before = Self::applied_migrations(&setup).await?;
            MIGRATOR.run(&setup).await.map_err(|e| {
                let e = e.to_string();
                if e.contains("permission denied") {
                    format!(
                        "{e} (to let another user migrate, run `tollgate migrate` as that user and set \
                         postgres.migrate: false; see Migrations in docs/backends.md)"
                    )
                } else {
                    e
                }
            })?;
            self.set_persistence(&setup).await?;
            self.check_privileges(&setup).await?;
            let applied = MIGRATOR
                .iter()
                .filter(|m| !before.iter().any(|(v, _)| *v == m.version))
                .map(|m| (m.version, m.description.to_string()))
                .collect();
            Ok(MigrationReport {
                applied,
                in_place: before.len(),
            })
        };
        let report = self.within(timeout, work).await;
        setup.close().await;
        let report = report?;
        self.inner.migrated.store(true, Ordering::Release);
        Ok(report)
    }

    /// A pool of one connection without `statement_timeout`, for migrations: sqlx waits for
    /// the migration lock (shared by every schema of the database) in one statement, which the
    /// decisions' timeout would cut short.
    fn setup_pool(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(self.inner.connect_timeout)
            .connect_lazy_with(self.inner.setup.clone())
    }

    /// The schema, for messages.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// Whether the configured schema exists.
    async fn schema_exists(&self, setup: &PgPool) -> Result<bool, String> {
        let found: Option<i32> = sqlx::query_scalar("SELECT 1 FROM pg_namespace WHERE nspname = $1")
            .bind(&self.inner.schema)
            .fetch_optional(setup)
            .await
            .map_err(|e| e.to_string())?;
        Ok(found.is_some())
    }

    /// That the user may do what decisions, the sweep and the admin API do to the table:
    /// otherwise every decision would fail, after a start that looked fine.
    async fn check_privileges(&self, setup: &PgPool) -> Result<(), String> {
        let missing: Vec<String> = sqlx::query_scalar(
            "SELECT p FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) AS p \
             WHERE NOT has_table_privilege('tollgate_buckets', p)",
        )
        .fetch_all(setup)
        .await
        .map_err(|e| e.to_string())?;
        if missing.is_empty() {
            return Ok(());
        }
        Err(format!(
            "the user may not {} on {}.tollgate_buckets: GRANT SELECT, INSERT, UPDATE, DELETE ON it (see \
             Migrations in docs/backends.md)",
            missing.join(", "),
            self.inner.schema
        ))
    }

    /// Whether the bucket table is `UNLOGGED` now.
    async fn is_unlogged(setup: &PgPool) -> Result<bool, String> {
        sqlx::query_scalar("SELECT relpersistence = 'u' FROM pg_class WHERE oid = 'tollgate_buckets'::regclass")
            .fetch_one(setup)
            .await
            .map_err(|e| e.to_string())
    }

    /// Makes the bucket table `UNLOGGED` or logged as `postgres.unlogged` says, when it is not
    /// already: the change rewrites the table under an exclusive lock, so it is only made when
    /// needed (decisions of other replicas wait for it).
    async fn set_persistence(&self, setup: &PgPool) -> Result<(), String> {
        if Self::is_unlogged(setup).await? == self.inner.unlogged {
            return Ok(());
        }
        let to = if self.inner.unlogged { "UNLOGGED" } else { "LOGGED" };
        sqlx::query(&format!("ALTER TABLE tollgate_buckets SET {to}"))
            .execute(setup)
            .await
            .map_err(|e| {
                format!(
                    "making {}.tollgate_buckets {to} (postgres.unlogged): {e}",
                    self.inner.schema
                )
            })?;
        Ok(())
    }

    /// That the bucket table is as `postgres.unlogged` says, for `postgres.migrate: false`
    /// (changing it needs the table's owner).
    async fn check_persistence(&self, setup: &PgPool) -> Result<(), String> {
        if Self::is_unlogged(setup).await? == self.inner.unlogged {
            return Ok(());
        }
        let (want, is) = if self.inner.unlogged {
            ("UNLOGGED", "logged")
        } else {
            ("logged", "UNLOGGED")
        };
        Err(format!(
            "postgres.unlogged is {} but {}.tollgate_buckets is {is}, and postgres.migrate is false: run \
             `tollgate migrate` with these settings to make it {want}",
            self.inner.unlogged, self.inner.schema
        ))
    }

    /// `(version, checksum)` of each migration applied successfully in the schema; none when
    /// the schema or its migrations table does not exist yet.
    async fn applied_migrations(setup: &PgPool) -> Result<Vec<(i64, Vec<u8>)>, String> {
        let rows = sqlx::query_as::<_, (i64, Vec<u8>)>(
            "SELECT version, checksum FROM _sqlx_migrations WHERE success ORDER BY version",
        )
        .fetch_all(setup)
        .await;
        match rows {
            Ok(rows) => Ok(rows),
            // 42P01 undefined_table: nothing applied yet (the search path names the schema).
            Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42P01") => Ok(Vec::new()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// `work` within `timeout`, its failure as a [`ConnectError`] naming the server.
    async fn within<T>(
        &self,
        timeout: Duration,
        work: impl std::future::Future<Output = Result<T, String>>,
    ) -> Result<T, ConnectError> {
        let fail = |reason: String| ConnectError {
            backend: "Postgres",
            url: self.inner.describe.clone(),
            reason,
        };
        let work = async {
            // First one connection of its own: refused, unknown host, bad password or no such
            // database come back as such, not as a pool that timed out.
            let connect = <sqlx::PgConnection as sqlx::Connection>::connect_with(&self.inner.options);
            let direct = match tokio::time::timeout(self.inner.connect_timeout, connect).await {
                Ok(connected) => connected.map_err(|e| e.to_string())?,
                Err(_) => {
                    return Err(format!(
                        "not reachable within {} ms",
                        self.inner.connect_timeout.as_millis()
                    ))
                }
            };
            let _ = sqlx::Connection::close(direct).await;
            work.await
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(result) => result.map_err(fail),
            Err(_) => Err(fail(format!("not reachable within {} ms", timeout.as_millis()))),
        }
    }

    /// Keeps calling [`PostgresStore::connect`] (each attempt given `timeout`) in the
    /// background, `retry` apart, until it succeeds: for a server that starts not ready
    /// (`unreachable_at_start: not_ready`).
    pub fn connect_in_background(&self, retry: Duration, timeout: Duration) {
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                match store.connect(timeout).await {
                    Ok(()) => {
                        tracing::info!(postgres = %store.describe(), "connected to Postgres");
                        return;
                    }
                    Err(e) => tracing::debug!(error = %e, "Postgres still not reachable"),
                }
                tokio::time::sleep(retry).await;
            }
        });
    }

    /// The decision lanes, started on the first call (within a Tokio runtime).
    fn batcher(&self) -> &Batcher {
        self.inner.batcher.get_or_init(|| {
            Batcher::start(
                self.inner.connections.clone(),
                self.inner.lanes,
                self.inner.time_override.clone(),
            )
        })
    }

    /// Whether the schema and migrations are in place: readiness.
    pub fn is_migrated(&self) -> bool {
        self.inner.migrated.load(Ordering::Acquire)
    }

    /// `SELECT 1` within `timeout`: the probe readiness sends. When it fails, one direct
    /// connection attempt says why (refused, a password refused, ...), which the pool's own
    /// error hides behind a timeout.
    ///
    /// Errors: no answer in time, or an error answer.
    pub async fn probe(&self, timeout: Duration) -> Result<(), StoreError> {
        let probe = sqlx::query("SELECT 1").execute(&self.inner.aux);
        let error = match tokio::time::timeout(timeout, probe).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => store_error(e),
            Err(_) => StoreError::Timeout(format!("no answer within {} ms", timeout.as_millis()).into()),
        };
        let connect = <sqlx::PgConnection as sqlx::Connection>::connect_with(&self.inner.options);
        match tokio::time::timeout(timeout.min(self.inner.connect_timeout), connect).await {
            Ok(Err(e)) => Err(store_error(e)),
            Ok(Ok(conn)) => {
                let _ = sqlx::Connection::close(conn).await;
                Err(error)
            }
            Err(_) => Err(error),
        }
    }

    /// How long one decision may take (`postgres.command_timeout_ms`).
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The URL, password redacted, for logs.
    pub fn describe(&self) -> &str {
        &self.inner.describe
    }

    /// Deletes at most `limit` rows whose bucket is full again (by the plan of its last
    /// decision), the first found in the table; returns how many. Run it periodically: a pass does bounded
    /// work, and a request never depends on it (a full bucket's row reads as full anyway).
    ///
    /// Errors: Postgres unreachable or too slow.
    pub async fn sweep(&self, limit: u32) -> Result<u64, StoreError> {
        self.bounded("sweep", self.sweep_inner(limit)).await
    }

    /// One periodic pass of [`sweep`](Self::sweep): statements of `batch` rows while each
    /// deletes a full batch, at most `statements` of them, so a pass deletes at most
    /// `statements * batch` rows however many are due (the rest wait for the next pass).
    /// Returns how many it deleted; a failed statement ends the pass (logged at debug level:
    /// readiness reports an outage).
    pub async fn sweep_pass(&self, batch: u32, statements: u32) -> u64 {
        let mut deleted = 0;
        for _ in 0..statements {
            match self.sweep(batch).await {
                Ok(n) => {
                    deleted += n;
                    if n < u64::from(batch) {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "Postgres sweep failed; trying again next pass");
                    break;
                }
            }
        }
        deleted
    }

    async fn sweep_inner(&self, limit: u32) -> Result<u64, StoreError> {
        // One statement: Postgres's clock read in it, unless a test overrides it. No index on
        // full_at_us (every decision writes it, and an index on it would make no update HOT):
        // a sequential scan that stops at the `limit`th row due, skipping rows a batch holds.
        let sql = format!(
            "DELETE FROM tollgate_buckets WHERE key IN (SELECT key FROM tollgate_buckets \
             WHERE full_at_us <= COALESCE($1, {CLOCK_US}) LIMIT $2 FOR UPDATE SKIP LOCKED)"
        );
        let now = self.inner.time_override.as_ref().map(|c| column(c.now_us()));
        let done = sqlx::query(&sql)
            .bind(now)
            .bind(i64::from(limit))
            .execute(&self.inner.aux)
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    /// Postgres's `clock_timestamp()` (or the test override), in µs since the epoch.
    async fn now_in(&self, tx: &mut Transaction<'_, Postgres>) -> Result<u64, StoreError> {
        if let Some(clock) = &self.inner.time_override {
            return Ok(clock.now_us());
        }
        let now: i64 = sqlx::query_scalar(&format!("SELECT {CLOCK_US}"))
            .fetch_one(&mut **tx)
            .await
            .map_err(store_error)?;
        Ok(u64::try_from(now).unwrap_or(0))
    }

    /// The stored states of `keys` (sorted, distinct), unlocked: NULL (a row just created, or
    /// none) is `None`.
    async fn read(
        tx: &mut Transaction<'_, Postgres>,
        keys: &[Vec<u8>],
    ) -> Result<Vec<Option<BucketState>>, StoreError> {
        let rows = sqlx::query("SELECT key, tokens_ut, updated_us FROM tollgate_buckets WHERE key = ANY($1)")
            .bind(keys)
            .fetch_all(&mut **tx)
            .await
            .map_err(store_error)?;
        let mut states = vec![None; keys.len()];
        for row in rows {
            let key: Vec<u8> = row.try_get(0).map_err(store_error)?;
            let state = row_state(
                &key,
                row.try_get(1).map_err(store_error)?,
                row.try_get(2).map_err(store_error)?,
            )?;
            if let Ok(i) = keys.binary_search(&key) {
                states[i] = state;
            }
        }
        Ok(states)
    }
}

impl PostgresStore {
    /// `work` within the store's time budget (at least a second: peek, reset and the sweep are
    /// off the request path but must not hang on a Postgres that stopped answering).
    async fn bounded<T>(
        &self,
        what: &str,
        work: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let budget = self.inner.timeout.max(Duration::from_secs(1));
        match tokio::time::timeout(budget, work).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(
                format!("{what}: no answer from Postgres within {} ms", budget.as_millis()).into(),
            )),
        }
    }

    async fn peek_inner(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        let (keys, index) = batch::keys_of(&[buckets]);
        let index = &index[0];
        let mut tx = self.inner.aux.begin().await.map_err(store_error)?;
        let stored = Self::read(&mut tx, &keys).await?;
        let now = self.now_in(&mut tx).await?;
        tx.commit().await.map_err(store_error)?;
        Ok(Peeked::from_stored(buckets, index.iter().map(|&k| stored[k]), now))
    }

    async fn reset_inner(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        let (keys, _) = batch::keys_of(&[buckets]);
        let mut tx = self.inner.aux.begin().await.map_err(store_error)?;
        // One statement locks the rows in ascending key order, as a decision does, and deletes
        // them: a separate lock and delete could each wait on a batch that locked a row
        // created between the two, while it waits on us.
        sqlx::query(
            "DELETE FROM tollgate_buckets WHERE key IN \
             (SELECT key FROM tollgate_buckets WHERE key = ANY($1) ORDER BY key FOR UPDATE)",
        )
        .bind(&keys)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        let now = self.now_in(&mut tx).await?;
        tx.commit().await.map_err(store_error)?;
        Ok(Peeked::all_full(buckets, now))
    }
}

impl Store for PostgresStore {
    fn clock_estimate_us(&self) -> u64 {
        match &self.inner.time_override {
            Some(clock) => clock.now_us(),
            None => crate::core::clock::Clock::now_us(&crate::core::clock::SystemClock),
        }
    }

    /// Queues the request for a lane (`batch`), which decides it in one call with the requests
    /// waiting with it, within `postgres.command_timeout_ms` of now.
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        let timeout = self.inner.timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let batcher = self.batcher();
        let (reply, answer) = tokio::sync::oneshot::channel();
        batcher.submit(Job {
            buckets: buckets.to_vec(),
            demands: demands.to_vec(),
            deadline,
            start_by: tokio::time::Instant::now() + timeout / 2,
            reply,
            origin: crate::store::round_trip::origin(),
        })?;
        let late =
            || StoreError::Timeout(format!("no decision from Postgres within {} ms", timeout.as_millis()).into());
        // The lane answers by the deadline (it abandons a transaction at its batch's earliest
        // one); the margin only covers its own scheduling. A job it dropped unanswered (its
        // deadline passed while it waited) closes the channel; one no lane took in time (every
        // lane busy past it, say on a paused server) is answered by this timer.
        match tokio::time::timeout_at(deadline + LANE_MARGIN, answer).await {
            Ok(Ok(result)) => result.map_err(|e| match e {
                StoreError::Timeout(_) => late(),
                e => e,
            }),
            Ok(Err(_)) | Err(_) => Err(late()),
        }
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.bounded("peek", self.peek_inner(buckets)).await
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.bounded("reset", self.reset_inner(buckets)).await
    }
}

impl super::SharedBackend for PostgresStore {
    const NAME: &'static str = "Postgres";
    const PROBE_EVERY_CHECK: bool = true;

    fn describe(&self) -> &str {
        PostgresStore::describe(self)
    }

    fn connect(&self, timeout: Duration) -> impl std::future::Future<Output = Result<(), ConnectError>> + Send {
        PostgresStore::connect(self, timeout)
    }

    /// An attempt every 500 ms, each within `timeout`.
    fn connect_in_background(&self, timeout: Duration) {
        PostgresStore::connect_in_background(self, Duration::from_millis(500), timeout);
    }

    fn not_ready_yet(&self) -> Option<String> {
        (!self.is_migrated()).then(|| format!("not connected to Postgres at {}", self.describe()))
    }

    fn probe(&self, timeout: Duration) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        PostgresStore::probe(self, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlx_errors_stay_the_source_of_store_errors() {
        let is_sqlx = |e: &StoreError| {
            let cause = std::error::Error::source(e).expect("a cause");
            cause.source().is_some_and(|s| s.is::<sqlx::Error>())
        };
        let slow = store_error(sqlx::Error::PoolTimedOut);
        assert!(matches!(slow, StoreError::Timeout(_)) && is_sqlx(&slow), "{slow:?}");
        let closed = store_error(sqlx::Error::PoolClosed);
        assert!(
            matches!(closed, StoreError::Unavailable(_)) && is_sqlx(&closed),
            "{closed:?}"
        );
    }

    #[test]
    fn a_url_that_does_not_parse_is_named_once_with_the_right_hint() {
        let problem = |url: &str| {
            let settings = PostgresSettings {
                url: url.into(),
                ..PostgresSettings::default()
            };
            PostgresStore::new(&settings).err().expect("refused").to_string()
        };
        let e = problem("postgres://postgres@127.0.0.1:5432/postgres?sslmode=bogus");
        assert!(e.contains("postgres.url is not valid: unknown value \"bogus\""), "{e}");
        assert!(!e.contains("error with configuration"), "{e}");
        assert!(!e.contains("percent-encoded"), "{e}");
        let e = problem("postgres://u:pa/ss@127.0.0.1:5432/postgres");
        assert!(e.contains("percent-encoded"), "{e}");
        assert!(!e.contains("pa/ss"), "the password is not shown: {e}");
    }

    #[test]
    fn settings_are_checked() {
        assert_eq!(PostgresSettings::default().validate(), Ok(()));
        let with = |f: fn(&mut PostgresSettings)| {
            let mut s = PostgresSettings::default();
            f(&mut s);
            s.validate()
        };
        assert!(with(|s| s.url = "mysql://x".into()).is_err());
        assert!(with(|s| s.pool_size = 0).is_err());
        assert!(with(|s| s.command_timeout_ms.0 = 0).is_err());
        assert!(with(|s| s.sweep_batch = 0).is_err());
        for bad in [
            "",
            "1abc",
            "Tollgate",
            "a-b",
            "a;drop table x",
            "a b",
            &"a".repeat(64),
            "pg_x",
            "information_schema",
        ] {
            let s = PostgresSettings {
                schema: bad.to_string(),
                ..PostgresSettings::default()
            };
            assert!(s.validate().is_err(), "{bad:?}");
        }
        for good in ["tollgate", "_t", "rate_limits_2", "select"] {
            let s = PostgresSettings {
                schema: good.to_string(),
                ..PostgresSettings::default()
            };
            assert_eq!(s.validate(), Ok(()), "{good:?}");
        }
    }
}
