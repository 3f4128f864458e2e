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
    /// `redis://host:port[/db]` (or `rediss://` for TLS), or `unix:///path/to/redis.sock[?db=N]`
    /// for a Unix domain socket (credentials then from `username` and `password`). For a
    /// Cluster, one or more seed nodes; the rest are discovered. Not used with `sentinel`.
    pub urls: Vec<String>,
    /// Whether `urls` are nodes of a Redis Cluster (keys then live in many slots).
    pub cluster: bool,
    /// ACL user name (Redis 6+); `null` for the default user.
    pub username: Option<String>,
    /// Password (`requirepass`, or the ACL user's; with `sentinel`, the master's). Redacted in
    /// `/config`.
    pub password: Option<String>,
    /// TLS to Redis, verified against the system's root certificates. Also on when a URL
    /// starts with `rediss://`. With `sentinel`, to the sentinels and the master alike.
    pub tls: bool,
    /// Redis behind Sentinel: the master is asked of the sentinels at each (re)connect, so a
    /// failover moves tollgate to the promoted replica without a restart.
    pub sentinel: SentinelSettings,
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

/// Redis behind Sentinel (docs/backends.md, "Sentinel"). Off while `master_name` is `null`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SentinelSettings {
    /// The master's name as the sentinels monitor it (their `sentinel monitor <name> ...`);
    /// `null`: no Sentinel, `redis.urls` names Redis itself.
    pub master_name: Option<String>,
    /// The sentinels, `redis://host:port` (`rediss://`: TLS to the sentinels and the master),
    /// with no credentials in them; at least one. Any of them may answer.
    pub urls: Vec<String>,
    /// ACL user name on the sentinels; `null` for their default user.
    pub username: Option<String>,
    /// The sentinels' own password (their `requirepass`), not the master's (`redis.password`).
    /// Redacted in `/config`.
    pub password: Option<String>,
}

impl SentinelSettings {
    /// Whether Sentinel is asked for the master.
    pub fn enabled(&self) -> bool {
        self.master_name.is_some()
    }

    /// The sentinels' `host:port`s, in order, for messages and connecting.
    ///
    /// Errors: the first URL that is not `redis://host:port` or `rediss://host:port` (shown
    /// without credentials).
    pub fn addresses(&self) -> Result<Vec<(String, u16)>, String> {
        self.urls.iter().map(|url| sentinel_address(url)).collect()
    }

    /// Whether the sentinel URLs ask for TLS (`rediss://`).
    pub fn tls(&self) -> bool {
        self.urls.iter().any(|u| u.starts_with("rediss://"))
    }

    fn problems(&self, cluster: bool) -> Vec<String> {
        let mut problems = Vec::new();
        let Some(name) = &self.master_name else {
            if !self.urls.is_empty() || self.username.is_some() || self.password.is_some() {
                problems.push(
                    "redis.sentinel is set but redis.sentinel.master_name is not; name the master the sentinels monitor"
                        .into(),
                );
            }
            return problems;
        };
        if name.trim().is_empty() || name.contains(char::is_whitespace) {
            problems.push(
                "redis.sentinel.master_name must be a name without spaces (the sentinels' `sentinel monitor <name>`)"
                    .into(),
            );
        }
        if self.urls.is_empty() {
            problems.push("redis.sentinel.urls must name at least one sentinel (redis://host:port)".into());
        }
        for url in &self.urls {
            if let Err(e) = sentinel_address(url) {
                problems.push(e);
            }
        }
        if self.tls() && self.urls.iter().any(|u| u.starts_with("redis://")) {
            problems.push(
                "redis.sentinel.urls mix redis:// and rediss://; TLS goes to every sentinel and to the master alike"
                    .into(),
            );
        }
        if cluster {
            problems.push(
                "redis.sentinel and redis.cluster: true cannot be combined; Sentinel watches one master and its replicas, a Cluster finds its masters itself"
                    .into(),
            );
        }
        problems
    }
}

/// `host` and `port` of a sentinel URL.
fn sentinel_address(url: &str) -> Result<(String, u16), String> {
    let bad = |why: &str| {
        format!(
            "redis.sentinel.urls: {:?} {why}; use redis://host:port (rediss:// for TLS)",
            redact_url(url)
        )
    };
    let rest = url
        .strip_prefix("redis://")
        .or_else(|| url.strip_prefix("rediss://"))
        .ok_or_else(|| bad("is not a sentinel URL"))?;
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(bad(
            "carries credentials (set redis.sentinel.username and password instead)",
        ));
    }
    let (host, port) = authority
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        .filter(|(h, p)| !h.is_empty() && *p != 0)
        .ok_or_else(|| bad("has no host:port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok((host.to_owned(), port))
}

/// A `unix:///path/to/redis.sock[?db=N]` URL: the socket's path and the database (`None`: 0).
///
/// Errors: not an absolute path, credentials in the URL, or a query other than `db=<0..=255>`.
pub(super) fn unix_socket(url: &str) -> Option<Result<(std::path::PathBuf, Option<u8>), String>> {
    let rest = url.strip_prefix("unix://")?;
    let bad = |why: &str| {
        Err(format!(
            "redis.urls: {:?} {why}; use unix:///path/to/redis.sock, or unix:///path/to/redis.sock?db=N",
            redact_url(url)
        ))
    };
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if !path.starts_with('/') {
        return Some(bad(
            "is not an absolute socket path (three slashes: unix:// and the path)",
        ));
    }
    if path.contains('@') {
        return Some(bad(
            "carries credentials (set redis.username and redis.password instead)",
        ));
    }
    let db = match query {
        "" => None,
        q => match q.strip_prefix("db=").map(str::parse::<u8>) {
            Some(Ok(db)) => Some(db),
            _ => return Some(bad("has a query other than db=<0 to 255>")),
        },
    };
    Some(Ok((path.into(), db)))
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
            sentinel: SentinelSettings::default(),
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
    /// Errors: no URL, a URL that is not `redis://`, `rediss://` or `unix://` (or does not parse), a
    /// Unix socket with `cluster` or `tls`, `sentinel` settings that name no master or no
    /// sentinel, a sentinel URL that is not `redis://host:port`, `sentinel` with `cluster`, a key
    /// prefix with `{` or `}`, a zero pool size or timeout, a zero `breaker_failures`, a
    /// `breaker_failure_percent` outside 1..=100 or a `breaker_window_ms` under 10.
    pub fn validate(&self) -> Result<(), String> {
        all_problems(self.problems(), "; ")
    }

    /// Every problem [`Self::validate`] reports, each a sentence naming the setting; empty when
    /// there is none.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let sentinel = self.sentinel.enabled();
        if self.urls.is_empty() && !sentinel {
            problems.push("redis.urls must name at least one Redis node".into());
        }
        for url in &self.urls {
            if let Some(unix) = unix_socket(url) {
                match unix {
                    Err(e) => problems.push(e),
                    Ok(_) if self.cluster => problems.push(format!(
                        "redis.urls: {:?} is a Unix socket, which reaches one Redis; set redis.cluster: false",
                        redact_url(url)
                    )),
                    Ok(_) if self.tls && !sentinel => problems
                        .push("redis.tls is on but redis.urls is a Unix socket; TLS is for TCP, set tls: false".into()),
                    Ok(_) => {}
                }
                continue;
            }
            let ok = url.starts_with("redis://") || url.starts_with("rediss://");
            if !ok || fred::types::config::Config::from_url(url).is_err() {
                problems.push(format!(
                    "redis.urls: {:?} is not a Redis URL; use redis://host:port (rediss:// for TLS, unix:///path for a Unix socket)",
                    redact_url(url)
                ));
            }
        }
        if !self.cluster && !sentinel && self.urls.len() > 1 {
            problems.push(
                "redis.urls lists several nodes but redis.cluster is false; set cluster: true for a Redis Cluster"
                    .into(),
            );
        }
        problems.extend(self.sentinel.problems(self.cluster));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sentinel(name: Option<&str>, urls: &[&str]) -> RedisSettings {
        RedisSettings {
            sentinel: SentinelSettings {
                master_name: name.map(str::to_owned),
                urls: urls.iter().map(|u| (*u).to_owned()).collect(),
                ..SentinelSettings::default()
            },
            ..RedisSettings::default()
        }
    }

    fn problem(settings: &RedisSettings, part: &str) {
        let err = settings.validate().expect_err("invalid settings");
        assert!(err.contains(part), "{part:?} not in {err}");
    }

    #[test]
    fn sentinel_settings_that_make_no_sense_are_refused() {
        let ok = sentinel(Some("mymaster"), &["redis://127.0.0.1:26379", "redis://[::1]:26380"]);
        ok.validate().unwrap();
        assert_eq!(
            ok.sentinel.addresses().unwrap(),
            [("127.0.0.1".to_owned(), 26379), ("::1".to_owned(), 26380)]
        );
        problem(
            &sentinel(Some("mymaster"), &[]),
            "redis.sentinel.urls must name at least one sentinel",
        );
        problem(
            &sentinel(None, &["redis://127.0.0.1:26379"]),
            "redis.sentinel.master_name is not",
        );
        problem(
            &sentinel(Some(""), &["redis://127.0.0.1:26379"]),
            "master_name must be a name",
        );
        problem(&sentinel(Some("m"), &["127.0.0.1:26379"]), "is not a sentinel URL");
        problem(&sentinel(Some("m"), &["redis://127.0.0.1"]), "has no host:port");
        problem(
            &sentinel(Some("m"), &["redis://127.0.0.1:1", "rediss://127.0.0.1:2"]),
            "mix redis:// and rediss://",
        );
        let mut cluster = sentinel(Some("m"), &["redis://127.0.0.1:26379"]);
        cluster.cluster = true;
        problem(&cluster, "cannot be combined");
        // Credentials go in their settings, never in a URL (and are not echoed).
        let secret = sentinel(Some("m"), &["redis://:hunter2@127.0.0.1:26379"]);
        let err = secret.validate().unwrap_err();
        assert!(
            err.contains("redis.sentinel.username and password") && !err.contains("hunter2"),
            "{err}"
        );
        // With Sentinel, redis.urls is not used: empty is fine.
        let mut no_urls = sentinel(Some("m"), &["redis://127.0.0.1:26379"]);
        no_urls.urls.clear();
        no_urls.validate().unwrap();
    }

    #[test]
    fn unix_socket_urls() {
        assert_eq!(unix_socket("redis://127.0.0.1:6379"), None);
        assert_eq!(
            unix_socket("unix:///run/redis/redis.sock"),
            Some(Ok(("/run/redis/redis.sock".into(), None)))
        );
        assert_eq!(
            unix_socket("unix:///r.sock?db=3"),
            Some(Ok(("/r.sock".into(), Some(3))))
        );
        for bad in [
            "unix://r.sock",
            "unix:///r.sock?db=300",
            "unix:///r.sock?password=x",
            "unix://:pw@/r.sock",
        ] {
            assert!(matches!(unix_socket(bad), Some(Err(_))), "{bad}");
        }
        let unix = |f: &dyn Fn(&mut RedisSettings)| {
            let mut s = RedisSettings {
                urls: vec!["unix:///run/redis.sock".into()],
                ..RedisSettings::default()
            };
            f(&mut s);
            s
        };
        unix(&|_| {}).validate().unwrap();
        problem(&unix(&|s| s.cluster = true), "set redis.cluster: false");
        problem(&unix(&|s| s.tls = true), "TLS is for TCP");
    }
}
