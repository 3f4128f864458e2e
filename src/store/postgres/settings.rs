//! The `postgres` settings section (docs/backends.md), as the Postgres store takes it.

use crate::core::units::{Millis, Seconds};
use serde::{Deserialize, Serialize};

use crate::store::settings::{
    all_problems, breaker_policy, breaker_window, redact_url, FailureMode, UnreachableAtStart,
};
use crate::store::BreakerPolicy;

/// The Postgres backend (docs/backends.md): where PostgreSQL is, how to use it, and what to answer
/// when it cannot be reached. See `src/store/postgres/`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostgresSettings {
    /// `postgres://user[:password]@host[:port]/database[?sslmode=...]` (libpq's URL form, as sqlx
    /// reads it; special characters in a password percent-encoded).
    pub url: String,
    /// The password, when it is not in `url` (say, from a secret in `TOLLGATE_POSTGRES__PASSWORD`);
    /// it wins over one in the URL. Redacted in `/config`.
    pub password: Option<String>,
    /// Decision lanes, one connection each (plus one connection for the sweep, admin calls and
    /// probes).
    pub pool_size: u32,
    /// How long one connection attempt may take, at start and when a lane connects again, in
    /// milliseconds.
    pub connect_timeout_ms: Millis,
    /// How long one decision may take, its whole transaction included, in milliseconds (under
    /// Envoy's 20 ms filter timeout by default); also Postgres's `statement_timeout`.
    pub command_timeout_ms: Millis,
    /// The schema holding tollgate's table, created when missing: a lower-case identifier (a
    /// letter or `_`, then letters, digits or `_`, at most 63 bytes).
    pub schema: String,
    /// Whether `serve` creates the schema and applies the migrations at start (`true`), or only
    /// checks that `tollgate migrate` has (`false`: tollgate's database user then needs no
    /// right to create anything).
    pub migrate: bool,
    /// What to answer while Postgres fails: as for Redis (`fallback`: a local memory store).
    pub failure_mode: FailureMode,
    /// When Postgres cannot be reached at start: exit, or start not ready.
    pub unreachable_at_start: UnreachableAtStart,
    /// Failed Postgres calls within `breaker_window_ms` below which the circuit breaker never
    /// opens; a failed batch (one transaction) is one call.
    pub breaker_failures: u32,
    /// How long an open circuit skips Postgres before a probe, in milliseconds.
    pub breaker_open_ms: Millis,
    /// The percentage (1 to 100) of the requests of the last `breaker_window_ms` that must have
    /// failed, beside `breaker_failures` failed calls, for the breaker to open.
    pub breaker_failure_percent: u8,
    /// Milliseconds of the breaker's rolling window (ten slots of a tenth each).
    pub breaker_window_ms: Millis,
    /// How often rows whose bucket is full again are deleted, in seconds.
    pub sweep_interval_seconds: Seconds,
    /// Rows a sweep deletes per statement (a pass runs at most 10 of them).
    pub sweep_batch: u32,
    /// Whether the bucket table is `UNLOGGED` (no write-ahead log: cheaper writes, but its rows
    /// are emptied after a PostgreSQL crash and are not replicated to standbys, so buckets read
    /// as full again). Applied by migrations (`ALTER TABLE ... SET UNLOGGED` or `SET LOGGED`, a
    /// rewrite of the table under an exclusive lock); with `migrate: false`, checked.
    pub unlogged: bool,
}

impl Default for PostgresSettings {
    fn default() -> Self {
        PostgresSettings {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            password: None,
            pool_size: 8,
            connect_timeout_ms: Millis(1_000),
            command_timeout_ms: Millis(15),
            schema: "tollgate".into(),
            migrate: true,
            failure_mode: FailureMode::Error,
            unreachable_at_start: UnreachableAtStart::Exit,
            breaker_failures: 5,
            breaker_open_ms: Millis(1_000),
            breaker_failure_percent: 50,
            breaker_window_ms: Millis(1_000),
            sweep_interval_seconds: Seconds(10),
            sweep_batch: 1_000,
            unlogged: false,
        }
    }
}

impl PostgresSettings {
    /// Errors: a URL that is not `postgres://` or `postgresql://`, a pool of 0 or more than
    /// 1,000 connections, a zero timeout, sweep interval or batch, a zero `breaker_failures`,
    /// a `breaker_failure_percent` outside 1..=100, a `breaker_window_ms` under 10, or a schema
    /// that is not a lower-case identifier.
    pub fn validate(&self) -> Result<(), String> {
        all_problems(self.problems(), "; ")
    }

    /// Every problem [`Self::validate`] reports, each a sentence naming the setting; empty when
    /// there is none.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !(self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")) {
            problems.push(format!(
                "postgres.url must start with postgres:// or postgresql://, not {:?}",
                redact_url(&self.url)
            ));
        }
        if self.pool_size == 0 || self.pool_size > 1_000 {
            problems.push("postgres.pool_size must be between 1 and 1000".into());
        }
        if self.connect_timeout_ms.0 == 0 || self.command_timeout_ms.0 == 0 {
            problems.push("postgres.connect_timeout_ms and postgres.command_timeout_ms must be above 0".into());
        }
        if self.sweep_interval_seconds.0 == 0 || self.sweep_batch == 0 {
            problems.push("postgres.sweep_interval_seconds and postgres.sweep_batch must be above 0".into());
        }
        if self.breaker_failures == 0 {
            problems.push("postgres.breaker_failures must be at least 1".into());
        }
        if let Err(e) = breaker_window("postgres", self.breaker_failure_percent, self.breaker_window_ms.0) {
            problems.push(e);
        }
        let s = self.schema.as_bytes();
        let identifier = !s.is_empty()
            && s.len() <= 63
            && (s[0].is_ascii_lowercase() || s[0] == b'_')
            && s.iter()
                .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_');
        // Postgres reserves pg_*; information_schema is its own.
        if !identifier || self.schema.starts_with("pg_") || self.schema == "information_schema" {
            problems.push(format!(
                "postgres.schema must be a lower-case identifier (a-z or _, then a-z, 0-9 or _, at most 63, \
                 not pg_* or information_schema), not {:?}",
                self.schema
            ));
        }
        problems
    }
}

impl PostgresSettings {
    /// The circuit breaker of these settings (`breaker_*`).
    pub fn breaker_policy(&self) -> BreakerPolicy {
        breaker_policy(
            self.breaker_failures,
            self.breaker_failure_percent,
            self.breaker_window_ms.0,
            self.breaker_open_ms.0,
        )
    }
}
