//! The `redis` settings section (docs/backends.md), as the Redis store takes it.

use crate::core::units::Millis;
use serde::{Deserialize, Serialize};

use crate::store::settings::{
    all_problems, breaker_policy, breaker_window, redact_url, FailureMode, UnreachableAtStart,
};
use crate::store::BreakerPolicy;

/// The Redis backend (docs/backends.md): where Redis is, how to reach it, and what to answer when it
/// cannot be reached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisSettings {
    /// `redis://host:port[/db]` (or `rediss://` for TLS). For a Cluster, one or more seed
    /// nodes; the rest are discovered.
    pub urls: Vec<String>,
    /// Whether `urls` are nodes of a Redis Cluster (keys then live in many slots).
    pub cluster: bool,
    /// ACL user name (Redis 6+); `null` for the default user.
    pub username: Option<String>,
    /// Password (`requirepass`, or the ACL user's). Redacted in `/config`.
    pub password: Option<String>,
    /// TLS to Redis, verified against the system's root certificates. Also on when a URL
    /// starts with `rediss://`.
    pub tls: bool,
    /// Connections, each pipelining many requests' commands.
    pub pool_size: usize,
    /// Milliseconds to connect (and reconnect) before a connection attempt fails.
    pub connect_timeout_ms: Millis,
    /// Milliseconds a decision may wait for Redis (from its arrival) before it counts as a
    /// failure. The default (1000) holds a loaded machine; with `failure_mode` `allow`, `deny` or
    /// `fallback` behind Envoy, keep it under Envoy's rate-limit filter timeout (20 ms by
    /// default), or Envoy gives up first and its own `failure_mode_deny` decides.
    pub command_timeout_ms: Millis,
    /// Every key starts with this (no `{` or `}`: the hash tag follows it).
    pub key_prefix: String,
    /// What to answer when Redis fails or times out.
    pub failure_mode: FailureMode,
    /// What to do when Redis cannot be reached at start.
    pub unreachable_at_start: UnreachableAtStart,
    /// Failed Redis calls within `breaker_window_ms` below which the circuit breaker never
    /// opens (then Redis is not asked at all): at low traffic, a dead Redis opens it after this
    /// many. A failed pipelined batch is one call, however many requests it held.
    pub breaker_failures: u32,
    /// Milliseconds the breaker stays open before one request probes Redis again.
    pub breaker_open_ms: Millis,
    /// The percentage (1 to 100) of the requests of the last `breaker_window_ms` that must have
    /// failed, beside `breaker_failures` failed calls, for the breaker to open: a timeout now
    /// and then under load does not open it, an outage does.
    pub breaker_failure_percent: u8,
    /// Milliseconds of the breaker's rolling window (ten slots of a tenth each).
    pub breaker_window_ms: Millis,
    /// With `failure_mode: fallback`, where decisions go while Redis fails: `postgres` (the
    /// `postgres` section; shared by every replica) or `memory` (a local store per replica).
    pub fallback: FallbackBackend,
}

/// Where `failure_mode: fallback` decides while Redis fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FallbackBackend {
    /// The Postgres store of the `postgres` section.
    Postgres,
    /// A local memory store, per replica.
    Memory,
}

impl Default for RedisSettings {
    fn default() -> Self {
        RedisSettings {
            urls: vec!["redis://127.0.0.1:6379".into()],
            cluster: false,
            username: None,
            password: None,
            tls: false,
            pool_size: 4,
            connect_timeout_ms: Millis(1000),
            command_timeout_ms: Millis(1000),
            key_prefix: "tollgate:".into(),
            failure_mode: FailureMode::Error,
            unreachable_at_start: UnreachableAtStart::Exit,
            breaker_failures: 5,
            breaker_open_ms: Millis(1000),
            breaker_failure_percent: 50,
            breaker_window_ms: Millis(1000),
            fallback: FallbackBackend::Postgres,
        }
    }
}

impl RedisSettings {
    /// Errors: no URL, a URL that is not `redis://` or `rediss://` (or does not parse), a key
    /// prefix with `{` or `}`, a zero pool size or timeout, a zero `breaker_failures`, a
    /// `breaker_failure_percent` outside 1..=100 or a `breaker_window_ms` under 10.
    pub fn validate(&self) -> Result<(), String> {
        all_problems(self.problems(), "; ")
    }

    /// Every problem [`Self::validate`] reports, each a sentence naming the setting; empty when
    /// there is none.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.urls.is_empty() {
            problems.push("redis.urls must name at least one Redis node".into());
        }
        for url in &self.urls {
            let ok = url.starts_with("redis://") || url.starts_with("rediss://");
            if !ok || fred::types::config::Config::from_url(url).is_err() {
                problems.push(format!(
                    "redis.urls: {:?} is not a Redis URL; use redis://host:port (rediss:// for TLS)",
                    redact_url(url)
                ));
            }
        }
        if !self.cluster && self.urls.len() > 1 {
            problems.push(
                "redis.urls lists several nodes but redis.cluster is false; set cluster: true for a Redis Cluster"
                    .into(),
            );
        }
        if self.key_prefix.contains(['{', '}']) {
            problems.push(format!(
                "redis.key_prefix {:?} must not contain {{ or }} (the Cluster hash tag follows it)",
                self.key_prefix
            ));
        }
        if self.pool_size == 0 || self.pool_size > 256 {
            problems.push("redis.pool_size must be between 1 and 256".into());
        }
        if self.command_timeout_ms.0 == 0 || self.connect_timeout_ms.0 == 0 {
            problems.push("redis.command_timeout_ms and redis.connect_timeout_ms must be at least 1".into());
        }
        if self.breaker_failures == 0 {
            problems.push("redis.breaker_failures must be at least 1".into());
        }
        if let Err(e) = breaker_window("redis", self.breaker_failure_percent, self.breaker_window_ms.0) {
            problems.push(e);
        }
        problems
    }

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
