//! Server settings: built-in defaults, then a YAML file, then `TOLLGATE_*` environment
//! variables (nested keys with `__`, e.g. `TOLLGATE_HEADERS__RETRY_AFTER=false`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Yaml};
use figment::Figment;
use serde::{Deserialize, Serialize};

/// All server settings. Every field has a default, so an empty file is valid.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// gRPC listener for `RateLimitService` and `grpc.health.v1` (Envoy's convention: 8081).
    pub grpc_addr: SocketAddr,
    /// HTTP listener for `/healthz`, `/readyz`, `/metrics` and `/config`.
    pub http_addr: SocketAddr,
    /// A rules file, or a directory of `*.yaml` rules files; relative to the working directory.
    pub rules: PathBuf,
    /// Where bucket state lives.
    pub backend: Backend,
    /// Logging.
    pub log: LogSettings,
    /// Bounds on a request's contents; what happens beyond each is in docs/rules.md.
    pub limits: RequestLimits,
    /// Limits of the gRPC server: message size, streams per connection, keep-alive.
    pub grpc: GrpcSettings,
    /// Which headers go into `response_headers_to_add`.
    pub headers: HeaderSettings,
    /// Global shadow mode: evaluate and count every rule, never answer `OVER_LIMIT`.
    pub shadow_mode: bool,
    /// Honour per-descriptor `limit` overrides sent by Envoy (`RateLimitOverride`).
    pub overrides: bool,
    /// The memory backend.
    pub memory: MemorySettings,
    /// The Redis backend (used when `backend: redis`).
    pub redis: RedisSettings,
    /// The Postgres backend (used when `backend: postgres`).
    pub postgres: PostgresSettings,
    /// The bucket admin API (peek, refund, reset).
    pub admin: AdminSettings,
    /// Reloading the rules when their files change.
    pub reload: ReloadSettings,
    /// Graceful shutdown on SIGTERM / SIGINT.
    pub shutdown: ShutdownSettings,
    /// Prometheus metrics.
    pub metrics: MetricsSettings,
    /// The async runtime `serve` runs on: see [`RuntimeFlavor`].
    pub runtime: RuntimeFlavor,
}

/// Which tokio runtime `tollgate serve` runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeFlavor {
    /// `current_thread` when the process may use only one CPU (a CPU set of one, or a cgroup
    /// quota under two CPUs: `std::thread::available_parallelism`, which rounds a quota down,
    /// is 1), else `multi_thread`.
    #[default]
    Auto,
    /// Everything on one thread: with one CPU, about a quarter less CPU per request than a
    /// multi-thread runtime's single worker (no cross-thread wake-ups or steal checks;
    /// benches/README.md). Blocking work (rule reloads, the memory store's sweep) runs on
    /// separate threads either way.
    CurrentThread,
    /// A worker thread per CPU.
    MultiThread,
}

/// The bucket admin API: its own listener, because it changes limits' state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminSettings {
    /// Whether the admin listener runs at all.
    pub enabled: bool,
    /// Its address; keep it on loopback (or a network only operators reach).
    pub addr: SocketAddr,
    /// When set, every admin request must carry `Authorization: Bearer <token>`.
    /// Redacted in `/config`.
    pub token: Option<String>,
}

/// Watching the rules path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReloadSettings {
    /// Watch the rules path (inotify and the like) and reload when it changes.
    pub watch: bool,
    /// Quiet time after the last file event before reloading, in milliseconds, so an editor's
    /// or ConfigMap's several writes become one reload.
    pub debounce_ms: u64,
    /// Also compare the rules files' contents every this many seconds (0: never), for
    /// filesystems whose changes raise no events (some network and overlay mounts).
    pub poll_seconds: u64,
}

/// Graceful shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownSettings {
    /// Seconds between the signal and closing the listeners, during which `/readyz` and
    /// gRPC health report not serving while requests are still answered, so load balancers
    /// stop sending first.
    pub drain_seconds: u64,
    /// Seconds after closing the listeners that in-flight requests have to finish; then the
    /// process exits anyway.
    pub timeout_seconds: u64,
}

/// Prometheus metrics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSettings {
    /// An admitted decision is counted `near_limit` when the bucket has used at least this
    /// fraction of its capacity (0 < ratio <= 1).
    pub near_limit_ratio: f64,
    /// Also export envoyproxy/ratelimit's series (`ratelimit_service_rate_limit_total_hits`,
    /// `_over_limit`, `_near_limit`, `_within_limit`, `_shadow_mode` by `domain`, `key1`,
    /// `key2`, and `ratelimit_service_should_rate_limit_error` by `err_type`), so dashboards
    /// built for it keep working. On by default when their environment is in use.
    pub envoyproxy_names: bool,
    /// A second listener that serves only the metrics, at `path` (their `PROMETHEUS_ADDR`);
    /// `null`: none (the metrics are on the HTTP port's `/metrics` either way).
    pub addr: Option<SocketAddr>,
    /// The URL path of the metrics on `addr` (their `PROMETHEUS_PATH`).
    pub path: String,
}

/// The backend keeping bucket state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In-process: each replica enforces its own limits; a restart refills every bucket.
    Memory,
    /// Redis (single node or Cluster), shared by every replica: see [`RedisSettings`].
    Redis,
    /// PostgreSQL, shared by every replica: see [`PostgresSettings`].
    Postgres,
}

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
    pub connect_timeout_ms: u64,
    /// Milliseconds a decision may wait for Redis before it counts as a failure. Keep it well
    /// under Envoy's rate-limit filter timeout (20 ms by default).
    pub command_timeout_ms: u64,
    /// Every key starts with this (no `{` or `}`: the hash tag follows it).
    pub key_prefix: String,
    /// What to answer when Redis fails or times out.
    pub failure_mode: FailureMode,
    /// What to do when Redis cannot be reached at start.
    pub unreachable_at_start: UnreachableAtStart,
    /// Consecutive failures that open the circuit breaker (then Redis is not asked at all).
    pub breaker_failures: u32,
    /// Milliseconds the breaker stays open before one request probes Redis again.
    pub breaker_open_ms: u64,
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

/// What a request gets when its backend fails (docs/backends.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Answer `OK` (every descriptor `OK`, nothing consumed) and count it.
    Allow,
    /// Answer `OVER_LIMIT` without `Retry-After`.
    Deny,
    /// Answer gRPC `UNAVAILABLE`, so Envoy's `failure_mode_deny` decides.
    Error,
    /// Decide on another store until the backend is back: for Redis, the store named by
    /// `redis.fallback` (Postgres by default); for Postgres, a local memory store.
    Fallback,
}

/// Starting while Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnreachableAtStart {
    /// `tollgate serve` exits with an error naming the URL and the reason.
    Exit,
    /// Start anyway, not ready (`/readyz` 503), and keep connecting in the background;
    /// requests meanwhile get the failure mode's answer.
    NotReady,
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
            connect_timeout_ms: 1000,
            command_timeout_ms: 10,
            key_prefix: "tollgate:".into(),
            failure_mode: FailureMode::Error,
            unreachable_at_start: UnreachableAtStart::Exit,
            breaker_failures: 5,
            breaker_open_ms: 1000,
            fallback: FallbackBackend::Postgres,
        }
    }
}

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
    /// Connections in the pool.
    pub pool_size: u32,
    /// How long to wait for a connection, at start and from the pool, in milliseconds.
    pub connect_timeout_ms: u64,
    /// How long one decision may take, its whole transaction included, in milliseconds (under
    /// Envoy's 20 ms filter timeout by default); also Postgres's `statement_timeout`.
    pub command_timeout_ms: u64,
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
    /// Consecutive failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open circuit skips Postgres before a probe, in milliseconds.
    pub breaker_open_ms: u64,
    /// How often rows whose bucket is full again are deleted, in seconds.
    pub sweep_interval_seconds: u64,
    /// Rows a sweep deletes per statement (a pass runs at most 10 of them).
    pub sweep_batch: u32,
}

impl Default for PostgresSettings {
    fn default() -> Self {
        PostgresSettings {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            password: None,
            pool_size: 8,
            connect_timeout_ms: 1_000,
            command_timeout_ms: 15,
            schema: "tollgate".into(),
            migrate: true,
            failure_mode: FailureMode::Error,
            unreachable_at_start: UnreachableAtStart::Exit,
            breaker_failures: 5,
            breaker_open_ms: 1_000,
            sweep_interval_seconds: 10,
            sweep_batch: 1_000,
        }
    }
}

impl PostgresSettings {
    /// Errors: a URL that is not `postgres://` or `postgresql://`, a pool of 0 or more than
    /// 1,000 connections, a zero timeout, sweep interval or batch, a zero `breaker_failures`,
    /// or a schema that is not a lower-case identifier.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")) {
            return Err(format!(
                "postgres.url must start with postgres:// or postgresql://, not {:?}",
                redact_url(&self.url)
            ));
        }
        if self.pool_size == 0 || self.pool_size > 1_000 {
            return Err("postgres.pool_size must be between 1 and 1000".into());
        }
        if self.connect_timeout_ms == 0 || self.command_timeout_ms == 0 {
            return Err("postgres.connect_timeout_ms and postgres.command_timeout_ms must be above 0".into());
        }
        if self.sweep_interval_seconds == 0 || self.sweep_batch == 0 {
            return Err("postgres.sweep_interval_seconds and postgres.sweep_batch must be above 0".into());
        }
        if self.breaker_failures == 0 {
            return Err("postgres.breaker_failures must be at least 1".into());
        }
        let s = self.schema.as_bytes();
        let identifier = !s.is_empty()
            && s.len() <= 63
            && (s[0].is_ascii_lowercase() || s[0] == b'_')
            && s.iter()
                .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_');
        // Postgres reserves pg_*; information_schema is its own.
        if !identifier || self.schema.starts_with("pg_") || self.schema == "information_schema" {
            return Err(format!(
                "postgres.schema must be a lower-case identifier (a-z or _, then a-z, 0-9 or _, at most 63, \
                 not pg_* or information_schema), not {:?}",
                self.schema
            ));
        }
        Ok(())
    }
}

/// Log output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSettings {
    /// `text` or `json`.
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `tollgate=debug`; `RUST_LOG` wins when set.
    pub level: String,
}

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Bounds on one `RateLimitRequest`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestLimits {
    /// Most descriptors in one request.
    pub max_descriptors: usize,
    /// Most entries in one descriptor.
    pub max_entries: usize,
    /// Longest descriptor value, in bytes (of UTF-8). A longer value is cut to this length
    /// (at a character boundary) and marked, then decided like any other (docs/rules.md).
    pub max_value_bytes: usize,
}

/// Limits of the gRPC server (HTTP/2) Envoy talks to; all explicit, so that what a connection
/// may cost tollgate is a setting and not a library's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcSettings {
    /// Largest `RateLimitRequest` message read, in bytes (after decompression); a larger one is
    /// answered `OUT_OF_RANGE` unread.
    pub max_message_bytes: usize,
    /// Most streams (requests in flight) per HTTP/2 connection, announced in
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`: a client waits for a stream or opens another
    /// connection (Envoy does); a stream beyond it is refused (`REFUSED_STREAM`, never
    /// processed, so safe to retry).
    pub max_concurrent_streams: u32,
    /// Seconds between HTTP/2 PINGs on an idle connection (0: none), so a peer that vanished
    /// without closing is noticed.
    pub keepalive_interval_seconds: u64,
    /// Seconds to wait for a PING's answer before closing the connection.
    pub keepalive_timeout_seconds: u64,
}

/// Response headers tollgate asks Envoy to add (`response_headers_to_add`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeaderSettings {
    /// `Retry-After: <seconds>` on `OVER_LIMIT` (RFC 9110 section 10.2.3).
    pub retry_after: bool,
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
    pub ratelimit: bool,
    /// The older `X-RateLimit-Limit`, `-Remaining`, `-Reset` triple.
    pub x_ratelimit: bool,
}

/// The memory backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemorySettings {
    /// Lock shards; more shards, less contention.
    pub shards: usize,
    /// Most buckets held; beyond it the bucket closest to full is evicted (and counted).
    pub max_buckets: usize,
    /// Seconds between sweeps that drop buckets which have refilled to full.
    pub sweep_interval_seconds: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], 8081)),
            http_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            rules: PathBuf::from("config/rules"),
            backend: Backend::Memory,
            log: LogSettings::default(),
            limits: RequestLimits::default(),
            grpc: GrpcSettings::default(),
            headers: HeaderSettings::default(),
            shadow_mode: false,
            overrides: true,
            memory: MemorySettings::default(),
            redis: RedisSettings::default(),
            postgres: PostgresSettings::default(),
            admin: AdminSettings::default(),
            reload: ReloadSettings::default(),
            shutdown: ShutdownSettings::default(),
            metrics: MetricsSettings::default(),
            runtime: RuntimeFlavor::Auto,
        }
    }
}

impl Default for AdminSettings {
    fn default() -> Self {
        AdminSettings {
            enabled: true,
            addr: SocketAddr::from(([127, 0, 0, 1], 8082)),
            token: None,
        }
    }
}

impl Default for ReloadSettings {
    fn default() -> Self {
        ReloadSettings {
            watch: true,
            debounce_ms: 200,
            poll_seconds: 10,
        }
    }
}

impl Default for ShutdownSettings {
    fn default() -> Self {
        ShutdownSettings {
            drain_seconds: 2,
            timeout_seconds: 10,
        }
    }
}

impl Default for MetricsSettings {
    fn default() -> Self {
        MetricsSettings {
            near_limit_ratio: 0.8,
            envoyproxy_names: false,
            addr: None,
            path: "/metrics".into(),
        }
    }
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_descriptors: 64,
            max_entries: 32,
            max_value_bytes: 4096,
        }
    }
}

impl Default for GrpcSettings {
    fn default() -> Self {
        GrpcSettings {
            max_message_bytes: 4 * 1024 * 1024,
            max_concurrent_streams: 1024,
            keepalive_interval_seconds: 30,
            keepalive_timeout_seconds: 10,
        }
    }
}

impl Default for HeaderSettings {
    fn default() -> Self {
        HeaderSettings {
            retry_after: true,
            ratelimit: true,
            x_ratelimit: false,
        }
    }
}

impl Default for MemorySettings {
    fn default() -> Self {
        MemorySettings {
            shards: 64,
            max_buckets: 1_000_000,
            sweep_interval_seconds: 10,
        }
    }
}

/// The settings file read when `--config` is not given, if it exists.
pub const DEFAULT_SETTINGS_FILE: &str = "config/tollgate.yaml";

/// Top-level settings keys; only these are read from `TOLLGATE_*`, so unrelated variables
/// with the same prefix are not mistaken for settings.
const KEYS: [&str; 18] = [
    "grpc_addr",
    "http_addr",
    "rules",
    "backend",
    "log",
    "limits",
    "headers",
    "shadow_mode",
    "overrides",
    "memory",
    "redis",
    "postgres",
    "admin",
    "reload",
    "shutdown",
    "metrics",
    "runtime",
    "grpc",
];

impl Settings {
    /// Loads settings: defaults, then `file` (which must exist when given; otherwise
    /// [`DEFAULT_SETTINGS_FILE`] if it exists), then the environment.
    ///
    /// Errors: an unreadable file, a missing `--config` file, bad YAML, an unknown key, or a
    /// value of the wrong type, each naming the key and where it came from.
    pub fn load(file: Option<&Path>) -> Result<Settings, Box<figment::Error>> {
        Settings::load_layers(file, None).map(|(settings, _)| settings)
    }

    /// Loads settings from every source, lowest first: built-in defaults, envoyproxy/ratelimit's
    /// environment (`theirs`, when given and in use), the settings `file` (when given; without
    /// it [`DEFAULT_SETTINGS_FILE`] if it exists, except when their environment is in use: a
    /// file found by chance in the working directory must not override a Deployment's
    /// environment), then `TOLLGATE_*`. Returns the figment too, whose metadata tells each
    /// value's source ([`overridden_settings`]).
    ///
    /// Errors: as [`Settings::load`].
    pub fn load_layers(
        file: Option<&Path>,
        theirs: Option<&crate::envoyproxy_env::EnvoyproxyEnv>,
    ) -> Result<(Settings, Figment), Box<figment::Error>> {
        let mut figment = Figment::from(Serialized::defaults(Settings::default()));
        let theirs = theirs.filter(|t| t.active);
        if let Some(theirs) = theirs {
            figment = figment.merge(theirs.clone());
        }
        match file {
            Some(path) => {
                if !path.is_file() {
                    let missing = format!("settings file {} does not exist", path.display());
                    return Err(Box::new(figment::Error::from(missing)));
                }
                figment = figment.merge(Yaml::file_exact(path));
            }
            None if theirs.is_some() => {}
            None => figment = figment.merge(Yaml::file(DEFAULT_SETTINGS_FILE)),
        }
        let figment = figment.merge(Env::prefixed("TOLLGATE_").split("__").filter(|k| {
            let top = k.as_str().split('.').next().unwrap_or_default();
            KEYS.iter().any(|known| known.eq_ignore_ascii_case(top))
        }));
        let mut settings: Settings = figment.extract().map_err(Box::new)?;
        if let Some(theirs) = theirs {
            if admin_clash(&settings, &figment, theirs).is_some() {
                settings.admin.enabled = false;
            }
        }
        Ok((settings, figment))
    }
}

/// Why the admin listener is turned off under envoyproxy/ratelimit's environment, if it is:
/// their ports (`PORT`, `GRPC_PORT`, `PROMETHEUS_ADDR`) are free to be 8082, which is
/// tollgate's default `admin.addr` port, and a clash would stop tollgate from starting where
/// theirs starts. Only a default `admin.addr` gives way; one set in tollgate's own settings
/// (file or `TOLLGATE_ADMIN__ADDR`) is kept, and a clash then fails at bind, naming it.
/// `settings` and `figment` as [`Settings::load_layers`] extracted them.
pub fn admin_clash(
    settings: &Settings,
    figment: &Figment,
    theirs: &crate::envoyproxy_env::EnvoyproxyEnv,
) -> Option<String> {
    use figment::Provider;
    if !theirs.active || !settings.admin.enabled {
        return None;
    }
    let default_source = Serialized::defaults(Settings::default()).metadata().name;
    let from_defaults = figment
        .find_metadata("admin.addr")
        .is_none_or(|meta| meta.name == default_source);
    if !from_defaults {
        return None;
    }
    let admin = settings.admin.addr;
    let overlaps = |other: SocketAddr| {
        other.port() == admin.port()
            && (other.ip() == admin.ip() || other.ip().is_unspecified() || admin.ip().is_unspecified())
    };
    let listeners = [
        ("http_addr", Some(settings.http_addr)),
        ("grpc_addr", Some(settings.grpc_addr)),
        ("metrics.addr", settings.metrics.addr),
    ];
    listeners.into_iter().find_map(|(key, addr)| {
        let addr = addr.filter(|a| overlaps(*a))?;
        let variables = theirs.origins.get(key).map_or("", String::as_str);
        Some(format!(
            "the admin API's default address {admin} clashes with {key} {addr} (from {variables}); the admin API is off: set admin.addr (TOLLGATE_ADMIN__ADDR) to a free address to turn it on"
        ))
    })
}

/// The settings envoyproxy/ratelimit's environment gave that a source of tollgate's own
/// overrode: `(setting, their variables, the source that won)`, by setting key.
pub fn overridden_settings(
    figment: &Figment,
    theirs: &crate::envoyproxy_env::EnvoyproxyEnv,
) -> Vec<(String, String, String)> {
    theirs
        .origins
        .iter()
        .filter_map(|(key, vars)| {
            let meta = figment.find_metadata(key)?;
            (meta.name != crate::envoyproxy_env::SOURCE_NAME).then(|| {
                let source = match &meta.source {
                    Some(figment::Source::File(path)) => format!("{} {}", meta.name, path.display()),
                    _ => meta.name.to_string(),
                };
                (key.clone(), vars.clone(), source)
            })
        })
        .collect()
}

impl Settings {
    /// Checks what types alone cannot.
    ///
    /// Errors: a `log.level` that is not a `tracing` filter (`info`, `tollgate=debug,warn`);
    /// `metrics.near_limit_ratio` outside `(0, 1]`; an empty `admin.token` or one with
    /// whitespace at either end (it could never match what a client sends); `shutdown.timeout_seconds` of 0.
    pub fn validate(&self) -> Result<(), String> {
        let ratio = self.metrics.near_limit_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(format!("metrics.near_limit_ratio must be in (0, 1], not {ratio}"));
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            return Err(format!("log.level {:?} is not a tracing filter: {e}", self.log.level));
        }
        if let Some(token) = &self.admin.token {
            if token.is_empty() || token.trim() != token {
                return Err("admin.token must not be empty or start or end with whitespace \
                            (a YAML block scalar `|` adds a newline; use a plain string)"
                    .into());
            }
        }
        if self.limits.max_value_bytes == 0 {
            return Err("limits.max_value_bytes must be at least 1".into());
        }
        if self.grpc.max_message_bytes < 1024 || self.grpc.max_concurrent_streams == 0 {
            return Err(
                "grpc.max_message_bytes must be at least 1024 and grpc.max_concurrent_streams at least 1".into(),
            );
        }
        if self.grpc.keepalive_interval_seconds > 0 && self.grpc.keepalive_timeout_seconds == 0 {
            return Err("grpc.keepalive_timeout_seconds must be at least 1 when keep-alive is on".into());
        }
        if !self.metrics.path.starts_with('/') {
            return Err(format!("metrics.path {:?} must start with /", self.metrics.path));
        }
        if self.shutdown.timeout_seconds == 0 {
            return Err("shutdown.timeout_seconds must be at least 1".into());
        }
        self.redis.validate()?;
        self.postgres.validate()
    }
}

impl RedisSettings {
    /// Errors: no URL, a URL that is not `redis://` or `rediss://` (or does not parse), a key
    /// prefix with `{` or `}`, a zero pool size or timeout, or a zero `breaker_failures`.
    pub fn validate(&self) -> Result<(), String> {
        if self.urls.is_empty() {
            return Err("redis.urls must name at least one Redis node".into());
        }
        for url in &self.urls {
            let ok = url.starts_with("redis://") || url.starts_with("rediss://");
            if !ok || fred::types::config::Config::from_url(url).is_err() {
                return Err(format!(
                    "redis.urls: {:?} is not a Redis URL; use redis://host:port (rediss:// for TLS)",
                    crate::settings::redact_url(url)
                ));
            }
        }
        if !self.cluster && self.urls.len() > 1 {
            return Err(
                "redis.urls lists several nodes but redis.cluster is false; set cluster: true for a Redis Cluster"
                    .into(),
            );
        }
        if self.key_prefix.contains(['{', '}']) {
            return Err(format!(
                "redis.key_prefix {:?} must not contain {{ or }} (the Cluster hash tag follows it)",
                self.key_prefix
            ));
        }
        if self.pool_size == 0 || self.pool_size > 256 {
            return Err("redis.pool_size must be between 1 and 256".into());
        }
        if self.command_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return Err("redis.command_timeout_ms and redis.connect_timeout_ms must be at least 1".into());
        }
        if self.breaker_failures == 0 {
            return Err("redis.breaker_failures must be at least 1".into());
        }
        Ok(())
    }
}

/// `url` with any password replaced by `<redacted>`, for messages and `/config`: the password
/// of the userinfo (everything up to the last `@` counts as userinfo, so a password holding an
/// unencoded `/`, `?`, `#` or `@` is hidden whole; a query value holding `@` makes it hide more
/// than it must, never less) and the value of a `password`, `pass` or `sslpassword` query
/// parameter (libpq's and sqlx's URL forms accept those). Text that is not a URL at all (no
/// `://`) keeps only what follows its last `@`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return match url.rsplit_once('@') {
            Some((_, host)) => format!("<redacted>@{host}"),
            None => url.to_string(),
        };
    };
    let mut out = format!("{scheme}://");
    let after_userinfo = match rest.rsplit_once('@') {
        Some((userinfo, after)) => {
            match userinfo.split_once(':') {
                Some((user, _)) => out.push_str(&format!("{user}:<redacted>@")),
                None => out.push_str(&format!("{userinfo}@")),
            }
            after
        }
        None => rest,
    };
    let (host_path, query) = match after_userinfo.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (after_userinfo, None),
    };
    out.push_str(host_path);
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((key, _))
                    if ["password", "pass", "sslpassword"]
                        .iter()
                        .any(|secret| key.eq_ignore_ascii_case(secret)) =>
                {
                    format!("{key}=<redacted>")
                }
                _ => param.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url;

    #[test]
    fn passwords_are_hidden_wherever_a_url_carries_them() {
        for (url, shown) in [
            ("postgres://app:s3cret@db:5432/x", "postgres://app:<redacted>@db:5432/x"),
            ("postgres://app@db:5432/x", "postgres://app@db:5432/x"),
            ("postgres://db/x", "postgres://db/x"),
            ("redis://:pw@127.0.0.1:6379/2", "redis://:<redacted>@127.0.0.1:6379/2"),
            // An unencoded '/' or '@' in the password.
            (
                "postgres://app:hun/ter2@db:5432/x",
                "postgres://app:<redacted>@db:5432/x",
            ),
            ("postgres://app:a@b@db/x", "postgres://app:<redacted>@db/x"),
            // Query parameters.
            (
                "postgres://app@db/x?password=hunter2&sslmode=require",
                "postgres://app@db/x?password=<redacted>&sslmode=require",
            ),
            (
                "postgres://db/x?sslmode=verify-full&SSLPassword=k",
                "postgres://db/x?sslmode=verify-full&SSLPassword=<redacted>",
            ),
            ("not a url", "not a url"),
            // A raw '?' or '#' in the password; not a URL at all.
            (
                "postgres://u:Sec?r3tX@127.0.0.1:5/p",
                "postgres://u:<redacted>@127.0.0.1:5/p",
            ),
            (
                "postgres://u:a#b@127.0.0.1/p?sslmode=disable",
                "postgres://u:<redacted>@127.0.0.1/p?sslmode=disable",
            ),
            (
                "postgres//u:Secr3tX@127.0.0.1:55499/postgres",
                "<redacted>@127.0.0.1:55499/postgres",
            ),
            (
                "postgres:/u:Secr3tX@127.0.0.1/postgres",
                "<redacted>@127.0.0.1/postgres",
            ),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}

/// `TOLLGATE_*` environment variables that name no setting (a misspelt
/// `TOLLGATE_GRPC_ADR`, say). They are ignored, since other tools share the prefix; `serve`
/// logs a warning for each so a typo does not pass unseen.
pub fn unknown_env_vars() -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| {
            name.strip_prefix("TOLLGATE_").is_some_and(|rest| {
                let top = rest.split("__").next().unwrap_or_default();
                !KEYS.iter().any(|known| known.eq_ignore_ascii_case(top))
            })
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closures return figment::Error
mod tests {
    use super::*;

    #[test]
    fn defaults_file_then_env() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("t.yaml", "grpc_addr: 127.0.0.1:9000\nheaders: {x_ratelimit: true}\n")?;
            jail.set_env("TOLLGATE_HEADERS__RETRY_AFTER", "false");
            jail.set_env("TOLLGATE_ENVOY_BIN", "/not/a/setting");
            jail.set_env("TOLLGATE_GRPC_ADR", "127.0.0.1:1");
            let unknown = unknown_env_vars();
            assert!(unknown.contains(&"TOLLGATE_GRPC_ADR".to_owned()), "{unknown:?}");
            assert!(
                !unknown.iter().any(|v| v.starts_with("TOLLGATE_HEADERS")),
                "{unknown:?}"
            );
            let s = Settings::load(Some(Path::new("t.yaml"))).map_err(|e| e.to_string())?;
            assert_eq!(s.grpc_addr, SocketAddr::from(([127, 0, 0, 1], 9000)));
            assert!(s.headers.x_ratelimit);
            assert!(!s.headers.retry_after);
            assert!(s.headers.ratelimit);
            assert_eq!(s.http_addr, Settings::default().http_addr);
            Ok(())
        });
    }

    /// Their ports may be 8082, tollgate's default admin port: under their environment the
    /// default admin listener gives way (off), one set in tollgate's own settings stays.
    #[test]
    fn the_default_admin_listener_gives_way_to_their_ports() {
        figment::Jail::expect_with(|jail| {
            let theirs = |vars: &[(&str, &str)]| {
                crate::envoyproxy_env::EnvoyproxyEnv::read(
                    vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
                    false,
                )
                .unwrap()
            };
            for vars in [
                &[("USE_STATSD", "false"), ("PORT", "8082")][..],
                &[("GRPC_PORT", "8082")][..],
                &[("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", ":8082")][..],
                &[("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", "127.0.0.1:8082")][..],
            ] {
                let env = theirs(vars);
                let (s, figment) = Settings::load_layers(None, Some(&env)).map_err(|e| e.to_string())?;
                assert!(!s.admin.enabled, "{vars:?}");
                let extracted: Settings = figment.extract().map_err(|e| e.to_string())?;
                let why = admin_clash(&extracted, &figment, &env).unwrap_or_default();
                assert!(
                    why.contains("8082") && why.contains("TOLLGATE_ADMIN__ADDR"),
                    "{vars:?}: {why}"
                );
            }
            let env = theirs(&[("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", "127.0.0.2:8082")]);
            let (s, _) = Settings::load_layers(None, Some(&env)).map_err(|e| e.to_string())?;
            assert!(s.admin.enabled, "another address on the same port does not clash");
            let env = theirs(&[("GRPC_PORT", "9000")]);
            let (s, _) = Settings::load_layers(None, Some(&env)).map_err(|e| e.to_string())?;
            assert!(s.admin.enabled, "no clash");
            jail.set_env("TOLLGATE_ADMIN__ADDR", "127.0.0.1:8082");
            let env = theirs(&[("GRPC_PORT", "8082")]);
            let (s, _) = Settings::load_layers(None, Some(&env)).map_err(|e| e.to_string())?;
            assert!(s.admin.enabled, "tollgate's own admin.addr is kept");
            Ok(())
        });
    }

    /// Defaults < envoyproxy/ratelimit's environment < the settings file < `TOLLGATE_*`, and
    /// the overridden settings name the source that won.
    #[test]
    fn their_environment_sits_below_tollgates_own_settings() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("t.yaml", "grpc_addr: 127.0.0.1:9000\n")?;
            jail.set_env("TOLLGATE_REDIS__KEY_PREFIX", "mine:");
            let theirs = crate::envoyproxy_env::EnvoyproxyEnv::read(
                [
                    ("REDIS_SOCKET_TYPE", "tcp"),
                    ("REDIS_URL", "127.0.0.1:7000"),
                    ("CACHE_KEY_PREFIX", "theirs:"),
                    ("GRPC_PORT", "9100"),
                    ("PORT", "9101"),
                ]
                .map(|(k, v)| (k.to_owned(), v.to_owned())),
                false,
            )
            .map_err(|e| e.to_string())?;
            let (s, figment) =
                Settings::load_layers(Some(Path::new("t.yaml")), Some(&theirs)).map_err(|e| e.to_string())?;
            assert_eq!(s.backend, Backend::Redis);
            assert_eq!(s.redis.urls, ["redis://127.0.0.1:7000"]);
            assert_eq!(s.redis.key_prefix, "mine:", "TOLLGATE_* beats CACHE_KEY_PREFIX");
            assert_eq!(
                s.grpc_addr,
                SocketAddr::from(([127, 0, 0, 1], 9000)),
                "the file beats GRPC_PORT"
            );
            assert_eq!(
                s.http_addr,
                SocketAddr::new(crate::envoyproxy_env::unspecified_ip(), 9101),
                "PORT beats the default (their unspecified host: IPv4 and IPv6)"
            );
            let overridden = overridden_settings(&figment, &theirs);
            let keys: Vec<&str> = overridden.iter().map(|(k, _, _)| k.as_str()).collect();
            assert_eq!(keys, ["grpc_addr", "redis.key_prefix"]);
            assert_eq!(overridden[0].1, "GRPC_PORT");
            assert!(overridden[0].2.contains("t.yaml"), "{:?}", overridden[0]);
            assert_eq!(overridden[1].1, "CACHE_KEY_PREFIX");
            assert!(overridden[1].2.contains("TOLLGATE_"), "{:?}", overridden[1]);
            // Their environment in use: the default settings file is not read by chance.
            std::fs::create_dir_all("config").map_err(|e| e.to_string())?;
            jail.create_file(DEFAULT_SETTINGS_FILE, "backend: memory\n")?;
            assert_eq!(
                Settings::load(None).map_err(|e| e.to_string())?.backend,
                Backend::Memory
            );
            let (s, _) = Settings::load_layers(None, Some(&theirs)).map_err(|e| e.to_string())?;
            assert_eq!(s.backend, Backend::Redis);
            Ok(())
        });
    }

    #[test]
    fn unknown_keys_and_missing_files_are_errors() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("t.yaml", "grpc_adr: 127.0.0.1:9000\n")?;
            let err = Settings::load(Some(Path::new("t.yaml"))).unwrap_err().to_string();
            assert!(err.contains("grpc_adr"), "{err}");
            assert!(Settings::load(Some(Path::new("nope.yaml"))).is_err());
            // Without --config, a missing default file means built-in defaults.
            assert_eq!(Settings::load(None).map_err(|e| e.to_string())?, Settings::default());
            Ok(())
        });
    }

    #[test]
    fn the_shipped_settings_file_lists_the_defaults() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/tollgate.yaml");
        let shipped: Settings = Figment::new()
            .merge(Yaml::file_exact(path))
            .extract()
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(shipped, Settings::default());
        // Every setting is written out, not left to its default: the file is the list of them.
        let text = std::fs::read_to_string(path).unwrap();
        let written: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        let defaults = serde_yaml::to_value(Settings::default()).unwrap();
        assert_eq!(written, defaults, "{path} must list every setting with its default");
    }

    #[test]
    fn tokens_that_could_never_match_are_refused() {
        let mut s = Settings::default();
        assert_eq!(s.validate(), Ok(()));
        for bad in ["", "tok\n", " tok", "tok "] {
            s.admin.token = Some(bad.into());
            let err = s.validate().unwrap_err();
            assert!(err.contains("admin.token"), "{bad:?}: {err}");
        }
        s.admin.token = Some("tok".into());
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn a_log_level_that_is_no_filter_is_refused() {
        let mut s = Settings::default();
        s.log.level = "tollgate=debug,warn".into();
        assert_eq!(s.validate(), Ok(()));
        s.log.level = "bogus[[".into();
        let err = s.validate().unwrap_err();
        assert!(err.contains("log.level"), "{err}");
    }
}
