//! Server settings: built-in defaults, then a YAML file, then `TOLLGATE_*` environment
//! variables (nested keys with `__`, e.g. `TOLLGATE_HEADERS__RETRY_AFTER=false`).

pub mod envoyproxy_env;
pub mod xds;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::core::units::{Millis, Seconds};
use figment::providers::{Env, Format, Serialized, Yaml};
use figment::Figment;
use serde::{Deserialize, Serialize};

// The sections of the layers below, composed here (their types live beside their code).
pub use crate::decision::{HeaderSettings, RequestLimits, ResponseSettings, ShadowHeaderSettings};
pub use crate::server::tls::{ListenerTls, TlsSettings};
pub use crate::server::uds::{GrpcAddr, SocketMode};
pub use crate::store::{
    redact_url, FailureMode, FallbackBackend, LocalSettings, MemorySettings, PostgresSettings, RedisSettings,
    SentinelSettings, UnreachableAtStart,
};
pub use xds::{RulesSource, XdsSettings};

/// All server settings. Every field has a default, so an empty file is valid.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// gRPC listener for `RateLimitService`, `grpc.health.v1` and RLQS (Envoy's convention:
    /// 8081): a TCP address, or `unix:<path>` for a Unix domain socket (see [`GrpcAddr`]).
    pub grpc_addr: GrpcAddr,
    /// HTTP listener for `/healthz`, `/readyz`, `/metrics` and `/config`.
    pub http_addr: SocketAddr,
    /// A rules file, or a directory of `*.yaml` rules files; relative to the working directory.
    pub rules: PathBuf,
    /// Rules files that declare the same domain are merged into one domain, their top-level
    /// descriptors side by side (envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`); `false`: a
    /// domain declared twice is an error.
    pub merge_domains: bool,
    /// Where the rules come from: the files at `rules`, or an xDS server (`xds`).
    pub rules_source: RulesSource,
    /// The xDS client (used when `rules_source: xds`).
    pub xds: XdsSettings,
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
    /// Headers sent upstream when shadow mode let through a request it would have denied.
    pub shadow_headers: ShadowHeaderSettings,
    /// envoyproxy/ratelimit's global quota mode and response dynamic metadata.
    pub response: ResponseSettings,
    /// Honour per-descriptor `limit` overrides sent by Envoy (`RateLimitOverride`).
    pub overrides: bool,
    /// Honour `is_negative_hits` refunds sent over gRPC. `false`: such a descriptor is answered
    /// `OK` without a bucket (nothing given back), so whoever reaches the gRPC port cannot
    /// refill buckets; the rest of the request is decided as usual.
    pub refunds: bool,
    /// The memory backend.
    pub memory: MemorySettings,
    /// The Redis backend (used when `backend: redis`).
    pub redis: RedisSettings,
    /// The Postgres backend (used when `backend: postgres`).
    pub postgres: PostgresSettings,
    /// What a replica on Redis or Postgres decides without a store call: the over-limit cache
    /// and token leases.
    pub local: LocalSettings,
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
    /// TLS on the gRPC, HTTP and admin listeners: see [`TlsSettings`].
    pub tls: TlsSettings,
    /// Envoy's Rate Limit Quota Service on the gRPC listener (docs/rlqs.md).
    pub rlqs: crate::rlqs::RlqsSettings,
    /// OpenTelemetry traces over OTLP (docs/monitoring.md, "Traces").
    pub tracing: crate::traces::TracingSettings,
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
    /// Redacted in `/config`. Required when `addr` is not a loopback address.
    pub token: Option<String>,
    /// Host names accepted in an admin request's `Host` header besides `localhost` and IP
    /// addresses (say the name a port-forward, a proxy or an ingress uses), without a port;
    /// any other name is refused (`403`), so a page in an operator's browser cannot reach the
    /// listener under a name of its own (DNS rebinding).
    pub allowed_hosts: Vec<String>,
    /// The operator console at `/` on this listener (docs/console.md).
    pub console: crate::console::ConsoleSettings,
}

/// Watching the rules path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReloadSettings {
    /// Watch the rules path (inotify and the like) and reload when it changes.
    pub watch: bool,
    /// Quiet time after the last file event before reloading, in milliseconds, so an editor's
    /// or ConfigMap's several writes become one reload.
    pub debounce_ms: Millis,
    /// Also compare the rules files' contents every this many seconds (0: never), for
    /// filesystems whose changes raise no events (some network and overlay mounts).
    pub poll_seconds: Seconds,
}

/// Graceful shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownSettings {
    /// Seconds between the signal and closing the listeners, during which `/readyz` and
    /// gRPC health report not serving while requests are still answered, so load balancers
    /// stop sending first.
    pub drain_seconds: Seconds,
    /// Seconds after closing the listeners that in-flight requests have to finish; then the
    /// process exits anyway.
    pub timeout_seconds: Seconds,
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
    /// `key2`, `ratelimit_service_should_rate_limit_error` by `err_type`, and
    /// `ratelimit_service_config_load_success` and `_error`), so dashboards built for it keep
    /// working. On by default when their environment is in use.
    pub envoyproxy_names: bool,
    /// A second listener that serves only the metrics, at `path` (their `PROMETHEUS_ADDR`);
    /// `null`: none (the metrics are on the HTTP port's `/metrics` either way).
    pub addr: Option<SocketAddr>,
    /// The URL path of the metrics on `addr` (their `PROMETHEUS_PATH`).
    pub path: String,
    /// envoyproxy/ratelimit's stats sent to a statsd server too (their `USE_STATSD`).
    pub statsd: crate::statsd::StatsdSettings,
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
    pub keepalive_interval_seconds: Seconds,
    /// Seconds to wait for a PING's answer before closing the connection.
    pub keepalive_timeout_seconds: Seconds,
    /// The permission bits of the socket file when `grpc_addr` is `unix:<path>`, as octal
    /// digits (`"0660"`: owner and group may connect). Unused on TCP.
    pub unix_socket_mode: SocketMode,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            grpc_addr: GrpcAddr::Tcp(SocketAddr::from(([0, 0, 0, 0], 8081))),
            http_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            rules: PathBuf::from("config/rules"),
            merge_domains: false,
            rules_source: RulesSource::Files,
            xds: XdsSettings::default(),
            backend: Backend::Memory,
            log: LogSettings::default(),
            limits: RequestLimits::default(),
            grpc: GrpcSettings::default(),
            headers: HeaderSettings::default(),
            shadow_mode: false,
            shadow_headers: ShadowHeaderSettings::default(),
            response: ResponseSettings::default(),
            overrides: true,
            refunds: true,
            memory: MemorySettings::default(),
            redis: RedisSettings::default(),
            postgres: PostgresSettings::default(),
            local: LocalSettings::default(),
            admin: AdminSettings::default(),
            reload: ReloadSettings::default(),
            shutdown: ShutdownSettings::default(),
            metrics: MetricsSettings::default(),
            runtime: RuntimeFlavor::Auto,
            tls: TlsSettings::default(),
            rlqs: crate::rlqs::RlqsSettings::default(),
            tracing: crate::traces::TracingSettings::default(),
        }
    }
}

impl Default for AdminSettings {
    fn default() -> Self {
        AdminSettings {
            enabled: true,
            addr: SocketAddr::from(([127, 0, 0, 1], 8082)),
            token: None,
            allowed_hosts: Vec::new(),
            console: crate::console::ConsoleSettings::default(),
        }
    }
}

impl Default for ReloadSettings {
    fn default() -> Self {
        ReloadSettings {
            watch: true,
            debounce_ms: Millis(200),
            poll_seconds: Seconds(10),
        }
    }
}

impl Default for ShutdownSettings {
    fn default() -> Self {
        ShutdownSettings {
            drain_seconds: Seconds(2),
            timeout_seconds: Seconds(10),
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
            statsd: crate::statsd::StatsdSettings::default(),
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

impl Default for GrpcSettings {
    fn default() -> Self {
        GrpcSettings {
            max_message_bytes: 4 * 1024 * 1024,
            max_concurrent_streams: 1024,
            keepalive_interval_seconds: Seconds(30),
            keepalive_timeout_seconds: Seconds(10),
            unix_socket_mode: SocketMode(0o660),
        }
    }
}

/// The settings file read when `--config` is not given, if it exists.
pub const DEFAULT_SETTINGS_FILE: &str = "config/tollgate.yaml";

/// Top-level settings keys; only these are read from `TOLLGATE_*`, so unrelated variables
/// with the same prefix are not mistaken for settings.
const KEYS: [&str; 28] = [
    "grpc_addr",
    "http_addr",
    "rules",
    "rules_source",
    "xds",
    "backend",
    "log",
    "limits",
    "headers",
    "shadow_mode",
    "shadow_headers",
    "response",
    "overrides",
    "refunds",
    "memory",
    "redis",
    "postgres",
    "local",
    "admin",
    "reload",
    "shutdown",
    "metrics",
    "runtime",
    "grpc",
    "tls",
    "rlqs",
    "merge_domains",
    "tracing",
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
        theirs: Option<&crate::server::settings::envoyproxy_env::EnvoyproxyEnv>,
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
        let figment = figment.merge(RawSecretsEnv(Env::prefixed("TOLLGATE_").split("__").filter(|k| {
            let top = k.as_str().split('.').next().unwrap_or_default();
            KEYS.iter().any(|known| known.eq_ignore_ascii_case(top))
        })));
        let mut settings: Settings = figment.extract().map_err(|e| Box::new(hide_secrets(e)))?;
        if let Some(theirs) = theirs {
            if admin_clash(&settings, &figment, theirs).is_some() {
                settings.admin.enabled = false;
            }
        }
        Ok((settings, figment))
    }
}

/// The settings whose values are secrets (or may hold one, as a URL's password does), by
/// figment path. From the environment they are taken as the raw string, whatever it looks like,
/// and no error message shows their value.
pub const SECRET_SETTINGS: [&str; 7] = [
    "admin.token",
    "redis.password",
    "redis.sentinel.password",
    "redis.urls",
    "postgres.url",
    "postgres.password",
    "xds.headers",
];

/// Whether the figment path `key` (`admin.token`) is, holds, or lies within a secret setting
/// (`xds.headers.authorization`).
fn holds_secret(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    SECRET_SETTINGS.iter().any(|secret| {
        *secret == key || secret.starts_with(&format!("{key}.")) || key.starts_with(&format!("{secret}."))
    })
}

/// `TOLLGATE_*` as figment's [`Env`] reads them, except the [`SECRET_SETTINGS`]: `Env` parses
/// every value (`8675309` becomes an integer, `true` a bool, `[x]` an array), so a token or a
/// password that looked like one failed to load, with its value quoted in the error, or loaded
/// changed. A secret is taken as the raw string; `redis.urls` as a list of raw URLs (one URL,
/// several separated by commas, or `[url, ...]` with optional quotes around each, as figment's
/// array syntax had it).
struct RawSecretsEnv(Env);

impl figment::Provider for RawSecretsEnv {
    fn metadata(&self) -> figment::Metadata {
        self.0.metadata()
    }

    fn data(&self) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        use figment::value::{Dict, Value};
        let mut dict = Dict::new();
        for (key, raw) in self.0.iter() {
            let key = key.as_str();
            let value = if key.eq_ignore_ascii_case("redis.urls") {
                Value::from(raw_list(&raw))
            } else if holds_secret(key) && !SECRET_SETTINGS.iter().any(|s| s.starts_with(&format!("{key}."))) {
                Value::from(raw)
            } else {
                raw.parse().expect("figment's Value::from_str is infallible")
            };
            merge_into(&mut dict, key, value);
        }
        Ok(figment::Profile::Default.collect(dict))
    }
}

/// Puts `value` at the dotted `key` of `dict`, creating the dictionaries on the way; a later
/// variable wins over an earlier one for the same key, as in figment's `Env`.
fn merge_into(dict: &mut figment::value::Dict, key: &str, value: figment::value::Value) {
    use figment::value::{Dict, Value};
    match key.split_once('.') {
        Some((head, rest)) => {
            let entry = dict.entry(head.to_owned()).or_insert_with(|| Value::from(Dict::new()));
            if entry.as_dict().is_none() {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, inner) = entry {
                merge_into(inner, rest, value);
            }
        }
        None => match (dict.get_mut(key), value) {
            (Some(Value::Dict(_, old)), Value::Dict(_, new)) => {
                for (k, v) in new {
                    merge_into(old, &k, v);
                }
            }
            (_, value) => {
                dict.insert(key.to_owned(), value);
            }
        },
    }
}

/// The URLs in one environment value: `url`, `url,url`, or `[url, "url"]`.
fn raw_list(raw: &str) -> Vec<String> {
    let trimmed = raw.trim();
    let inner = trimmed
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(trimmed);
    inner
        .split(',')
        .map(|item| {
            let item = item.trim();
            let unquoted = ['"', '\'']
                .iter()
                .find_map(|q| item.strip_prefix(*q).and_then(|i| i.strip_suffix(*q)));
            unquoted.unwrap_or(item).to_owned()
        })
        .filter(|item| !item.is_empty())
        .collect()
}

/// `error` with the value taken out of every message about a secret setting (figment quotes
/// the value it could not use: `invalid type: found unsigned int `8675309``), so that a token
/// or password never reaches the log or the terminal, whichever source gave it.
fn hide_secrets(error: figment::Error) -> figment::Error {
    use figment::error::Kind;
    let mut hidden: Option<figment::Error> = None;
    // The iterator goes from the newest error back; chaining from the oldest keeps the order.
    let errors: Vec<figment::Error> = error.into_iter().collect();
    for mut e in errors.into_iter().rev() {
        if holds_secret(&e.path.join(".")) {
            e.kind = match e.kind {
                Kind::InvalidType(_, expected) | Kind::InvalidValue(_, expected) => Kind::Message(format!(
                    "invalid value for a secret setting (not shown): expected {expected}"
                )),
                // Names of fields, never values.
                other @ (Kind::MissingField(_) | Kind::DuplicateField(_) | Kind::UnknownField(..)) => other,
                _ => Kind::Message("invalid value for a secret setting (not shown)".into()),
            };
        }
        hidden = Some(match hidden {
            Some(chain) => chain.chain(e),
            None => e,
        });
    }
    hidden.unwrap_or_else(|| figment::Error::from("invalid settings".to_owned()))
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
    theirs: &crate::server::settings::envoyproxy_env::EnvoyproxyEnv,
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
        ("grpc_addr", settings.grpc_addr.tcp()),
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
    theirs: &crate::server::settings::envoyproxy_env::EnvoyproxyEnv,
) -> Vec<(String, String, String)> {
    theirs
        .origins
        .iter()
        .filter_map(|(key, vars)| {
            let meta = figment.find_metadata(key)?;
            (meta.name != crate::server::settings::envoyproxy_env::SOURCE_NAME).then(|| {
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
    /// whitespace at either end (it could never match what a client sends); an enabled admin
    /// listener beyond loopback without `admin.token`; an `admin.allowed_hosts` entry that is not
    /// a bare host name; `shutdown.timeout_seconds` of 0; and those of the `redis`, `postgres` and `tls`
    /// sections. Every problem at once, one per line, so a fix is not followed by the next error.
    pub fn validate(&self) -> Result<(), String> {
        crate::store::settings::all_problems(self.problems(), "\n  ")
    }

    /// Every problem [`Self::validate`] reports, each a sentence naming the setting; empty when
    /// there is none.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let ratio = self.metrics.near_limit_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            problems.push(format!("metrics.near_limit_ratio must be in (0, 1], not {ratio}"));
        }
        if let Err(e) = self.tracing.validate() {
            problems.push(e);
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            problems.push(format!("log.level {:?} is not a tracing filter: {e}", self.log.level));
        }
        if self.admin.enabled && self.admin.token.is_none() && !self.admin.addr.ip().is_loopback() {
            problems.push(format!(
                "admin.addr {} is not a loopback address and admin.token is not set: anyone who reaches it \
                 could reset or refund any bucket; set admin.token (TOLLGATE_ADMIN__TOKEN), bind admin.addr \
                 to 127.0.0.1 or [::1], or set admin.enabled: false",
                self.admin.addr
            ));
        }
        for name in &self.admin.allowed_hosts {
            let bad = name.is_empty()
                || name.contains(|c: char| c.is_whitespace() || "/:@[]".contains(c))
                || name.trim_end_matches('.').is_empty();
            if bad {
                problems.push(format!(
                    "admin.allowed_hosts: {name:?} is not a host name; give names without a scheme or port \
                     (IP addresses and localhost are always accepted)"
                ));
            }
        }
        if let Some(token) = &self.admin.token {
            if token.is_empty() || token.trim() != token {
                problems.push(
                    "admin.token must not be empty or start or end with whitespace \
                            (a YAML block scalar `|` adds a newline; use a plain string)"
                        .into(),
                );
            }
        }
        if self.headers.limit_headers.enabled {
            problems.extend(self.headers.limit_headers.problems());
        }
        if self.limits.max_value_bytes == 0 {
            problems.push("limits.max_value_bytes must be at least 1".into());
        }
        if let Err(e) = self.rlqs.validate() {
            problems.push(e);
        }
        if self.grpc.max_message_bytes < 1024 || self.grpc.max_concurrent_streams == 0 {
            problems
                .push("grpc.max_message_bytes must be at least 1024 and grpc.max_concurrent_streams at least 1".into());
        }
        if self.grpc.keepalive_interval_seconds.0 > 0 && self.grpc.keepalive_timeout_seconds.0 == 0 {
            problems.push("grpc.keepalive_timeout_seconds must be at least 1 when keep-alive is on".into());
        }
        problems.extend(self.grpc_addr.problem());
        problems.extend(self.shadow_headers.problems());
        if self.grpc_addr.unix().is_some() && self.tls.grpc.is_some() {
            problems.push(format!(
                "tls.grpc is set but grpc_addr {} is a Unix socket, which tollgate serves in plain text only: \
                 the socket file's mode (grpc.unix_socket_mode) decides who may connect; remove tls.grpc or \
                 listen on a TCP address",
                self.grpc_addr
            ));
        }
        if !self.metrics.path.starts_with('/') {
            problems.push(format!("metrics.path {:?} must start with /", self.metrics.path));
        }
        if self.shutdown.timeout_seconds.0 == 0 {
            problems.push("shutdown.timeout_seconds must be at least 1".into());
        }
        problems.extend(self.metrics.statsd.problems());
        problems.extend(self.redis.problems());
        problems.extend(self.postgres.problems());
        problems.extend(self.local.problems());
        problems.extend(self.tls.problems());
        if self.rules_source == RulesSource::Xds {
            problems.extend(self.xds.problems());
        }
        problems
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

    /// `KEYS` is what `TOLLGATE_*` variables may name: every top-level setting, so a section
    /// added to `Settings` and forgotten there is never silently ignored from the environment
    /// (`rlqs` was: `TOLLGATE_RLQS__*` did nothing).
    #[test]
    fn keys_name_every_top_level_setting() {
        let serde_json::Value::Object(fields) = serde_json::to_value(Settings::default()).unwrap() else {
            panic!("settings serialize to an object");
        };
        let mut fields: Vec<&str> = fields.keys().map(String::as_str).collect();
        let mut keys = KEYS.to_vec();
        fields.sort_unstable();
        keys.sort_unstable();
        assert_eq!(keys, fields);
    }

    #[test]
    fn an_rlqs_setting_is_read_from_the_environment() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("TOLLGATE_RLQS__ENABLED", "false");
            let settings = Settings::load(None).expect("settings load");
            assert!(!settings.rlqs.enabled);
            assert!(!unknown_env_vars().iter().any(|v| v == "TOLLGATE_RLQS__ENABLED"));
            Ok(())
        });
    }

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
            assert_eq!(s.grpc_addr.tcp(), Some(SocketAddr::from(([127, 0, 0, 1], 9000))));
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
                crate::server::settings::envoyproxy_env::EnvoyproxyEnv::read(
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
            let theirs = crate::server::settings::envoyproxy_env::EnvoyproxyEnv::read(
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
                s.grpc_addr.tcp(),
                Some(SocketAddr::from(([127, 0, 0, 1], 9000))),
                "the file beats GRPC_PORT"
            );
            assert_eq!(
                s.http_addr,
                SocketAddr::new(crate::server::settings::envoyproxy_env::unspecified_ip(), 9101),
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

    /// figment's `Env` parsed every value: a token `8675309` became an integer (load failed,
    /// quoting it), `true` a bool, `[x]` an array. Secrets are the raw strings.
    #[test]
    fn validation_reports_every_problem_at_once() {
        let mut s = Settings::default();
        s.metrics.near_limit_ratio = 2.0;
        s.shutdown.timeout_seconds = Seconds(0);
        s.redis.pool_size = 0;
        s.redis.urls = vec!["http://a".into(), "redis://b:1".into()];
        s.postgres.schema = "Bad".into();
        let e = s.validate().unwrap_err();
        for part in [
            "metrics.near_limit_ratio",
            "shutdown.timeout_seconds",
            "redis.pool_size",
            "\"http://a\" is not a Redis URL",
            "redis.cluster is false",
            "postgres.schema",
        ] {
            assert!(e.contains(part), "{part} missing from: {e}");
        }
        assert_eq!(e.lines().count(), 6, "one line per problem: {e}");
    }

    #[test]
    fn a_unix_socket_address_and_its_mode_load_from_the_file_and_the_environment() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "t.yaml",
                "grpc_addr: unix:/run/tollgate/rls.sock\ngrpc: {unix_socket_mode: 0600}\n",
            )?;
            let s = Settings::load(Some(Path::new("t.yaml"))).map_err(|e| e.to_string())?;
            assert_eq!(s.grpc_addr, GrpcAddr::Unix("/run/tollgate/rls.sock".into()));
            assert_eq!(s.grpc.unix_socket_mode, SocketMode(0o600));
            jail.set_env("TOLLGATE_GRPC_ADDR", "unix:///tmp/other.sock");
            jail.set_env("TOLLGATE_GRPC__UNIX_SOCKET_MODE", "0666");
            let s = Settings::load(Some(Path::new("t.yaml"))).map_err(|e| e.to_string())?;
            assert_eq!(s.grpc_addr.unix(), Some(Path::new("/tmp/other.sock")));
            assert_eq!(s.grpc.unix_socket_mode, SocketMode(0o666));
            jail.set_env("TOLLGATE_GRPC__UNIX_SOCKET_MODE", "0999");
            let e = Settings::load(Some(Path::new("t.yaml"))).unwrap_err().to_string();
            assert!(
                e.contains("not a file mode") && e.to_lowercase().contains("unix_socket_mode"),
                "{e}"
            );
            Ok(())
        });
        let mut s = Settings {
            grpc_addr: "unix:/run/rls.sock".parse().unwrap(),
            ..Settings::default()
        };
        s.tls.grpc = Some(ListenerTls::default());
        let e = s.problems().join("\n");
        assert!(e.contains("tls.grpc is set but grpc_addr unix:/run/rls.sock"), "{e}");
    }

    #[test]
    fn durations_take_a_unit_in_the_file_and_the_environment() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "t.yaml",
                "redis:\n  command_timeout_ms: 250ms\n  breaker_window_ms: 2000\nshutdown:\n  drain_seconds: 1m\n",
            )?;
            jail.set_env("TOLLGATE_REDIS__BREAKER_OPEN_MS", "2s");
            jail.set_env("TOLLGATE_RELOAD__POLL_SECONDS", "30");
            let s = Settings::load(Some(std::path::Path::new("t.yaml"))).map_err(|e| e.to_string())?;
            assert_eq!(s.redis.command_timeout_ms, Millis(250));
            assert_eq!(s.redis.breaker_window_ms, Millis(2_000));
            assert_eq!(s.redis.breaker_open_ms, Millis(2_000));
            assert_eq!(s.shutdown.drain_seconds, Seconds(60));
            assert_eq!(s.reload.poll_seconds, Seconds(30));
            jail.set_env("TOLLGATE_RELOAD__POLL_SECONDS", "1500ms");
            let e = Settings::load(Some(std::path::Path::new("t.yaml")))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("whole number of seconds") && e.to_lowercase().contains("poll_seconds"),
                "{e}"
            );
            Ok(())
        });
    }

    #[test]
    fn secrets_from_the_environment_are_raw_strings() {
        for raw in ["8675309", "true", "[x]", "{a=b}", "1.5", "-7", "null"] {
            figment::Jail::expect_with(|jail| {
                jail.set_env("TOLLGATE_ADMIN__TOKEN", raw);
                jail.set_env("TOLLGATE_REDIS__PASSWORD", raw);
                jail.set_env("TOLLGATE_POSTGRES__PASSWORD", raw);
                jail.set_env("TOLLGATE_REDIS__SENTINEL__PASSWORD", raw);
                let s = Settings::load(None).map_err(|e| e.to_string())?;
                assert_eq!(s.admin.token.as_deref(), Some(raw), "admin.token");
                assert_eq!(s.redis.password.as_deref(), Some(raw), "redis.password");
                assert_eq!(
                    s.redis.sentinel.password.as_deref(),
                    Some(raw),
                    "redis.sentinel.password"
                );
                assert_eq!(s.postgres.password.as_deref(), Some(raw), "postgres.password");
                Ok(())
            });
        }
        figment::Jail::expect_with(|jail| {
            jail.set_env("TOLLGATE_POSTGRES__URL", "postgres://u:8675309@db:5432/x");
            jail.set_env("TOLLGATE_REDIS__URLS", "redis://:[x]@cache:6379");
            let s = Settings::load(None).map_err(|e| e.to_string())?;
            assert_eq!(s.postgres.url, "postgres://u:8675309@db:5432/x");
            assert_eq!(s.redis.urls, ["redis://:[x]@cache:6379"]);
            jail.set_env("TOLLGATE_REDIS__SENTINEL__MASTER_NAME", "mymaster");
            jail.set_env(
                "TOLLGATE_REDIS__SENTINEL__URLS",
                "[redis://127.0.0.1:26379, redis://127.0.0.1:26380]",
            );
            let s = Settings::load(None).map_err(|e| e.to_string())?;
            assert_eq!(s.redis.sentinel.master_name.as_deref(), Some("mymaster"));
            assert_eq!(
                s.redis.sentinel.urls,
                ["redis://127.0.0.1:26379", "redis://127.0.0.1:26380"]
            );
            for (given, urls) in [
                ("[redis://a:1]", &["redis://a:1"][..]),
                ("[\"redis://a:1\", 'redis://b:2']", &["redis://a:1", "redis://b:2"][..]),
                ("redis://a:1, redis://b:2", &["redis://a:1", "redis://b:2"][..]),
            ] {
                jail.set_env("TOLLGATE_REDIS__URLS", given);
                assert_eq!(
                    Settings::load(None).map_err(|e| e.to_string())?.redis.urls,
                    urls,
                    "{given}"
                );
            }
            // envoyproxy/ratelimit's secrets too.
            let theirs = crate::server::settings::envoyproxy_env::EnvoyproxyEnv::read(
                [
                    ("REDIS_SOCKET_TYPE", "tcp"),
                    ("REDIS_URL", "cache:6379"),
                    ("REDIS_AUTH", "8675309"),
                ]
                .map(|(k, v)| (k.to_owned(), v.to_owned())),
                false,
            )
            .map_err(|e| e.to_string())?;
            jail.clear_env();
            let (s, _) = Settings::load_layers(None, Some(&theirs)).map_err(|e| e.to_string())?;
            assert_eq!(s.redis.password.as_deref(), Some("8675309"), "REDIS_AUTH");
            // Other settings are still parsed.
            jail.set_env("TOLLGATE_SHADOW_MODE", "true");
            jail.set_env("TOLLGATE_MEMORY__SHARDS", "8");
            let s = Settings::load(None).map_err(|e| e.to_string())?;
            assert!(s.shadow_mode);
            assert_eq!(s.memory.shards, 8);
            Ok(())
        });
    }

    /// figment's errors quote the value they could not use; about a secret they must not,
    /// whichever source gave it.
    #[test]
    fn errors_about_secrets_never_show_them() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("t.yaml", "admin: {token: 8675309}\nredis: {password: [hunter2x]}\n")?;
            let err = Settings::load(Some(Path::new("t.yaml"))).unwrap_err().to_string();
            assert!(err.contains("admin.token") || err.contains("token"), "{err}");
            assert!(!err.contains("8675309") && !err.contains("hunter2x"), "{err}");
            // A whole section from the environment, parsed as a dict.
            jail.set_env("TOLLGATE_POSTGRES", "{password=[s3cr3tzz]}");
            let err = Settings::load(None).unwrap_err().to_string();
            assert!(err.to_lowercase().contains("postgres.password"), "{err}");
            assert!(!err.contains("s3cr3tzz"), "{err}");
            // Other settings' errors still show what was wrong.
            jail.clear_env();
            jail.set_env("TOLLGATE_MEMORY__SHARDS", "lots");
            let err = Settings::load(None).unwrap_err().to_string();
            assert!(err.contains("lots"), "{err}");
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

    /// Without a token, anyone who reaches a listener beyond loopback could reset every
    /// bucket: refused at start, naming the settings.
    #[test]
    fn an_admin_listener_beyond_loopback_needs_a_token() {
        let mut s = Settings::default();
        for addr in ["0.0.0.0:8082", "10.1.2.3:8082", "[::]:8082"] {
            s.admin.addr = addr.parse().unwrap();
            let err = s.validate().unwrap_err();
            assert!(
                err.contains("admin.addr") && err.contains("admin.token") && err.contains(addr),
                "{addr}: {err}"
            );
        }
        s.admin.token = Some("tok".into());
        assert_eq!(s.validate(), Ok(()));
        s.admin.token = None;
        s.admin.enabled = false;
        assert_eq!(s.validate(), Ok(()), "an admin API that is off binds nothing");
        s.admin.enabled = true;
        for loopback in ["127.0.0.1:8082", "127.0.0.2:9000", "[::1]:8082"] {
            s.admin.addr = loopback.parse().unwrap();
            assert_eq!(s.validate(), Ok(()), "{loopback}");
        }
        s.admin.allowed_hosts = vec!["tollgate-admin.ops.svc".into(), "Admin.Example.".into()];
        assert_eq!(s.validate(), Ok(()));
        for bad in ["", "http://x", "x:8082", "a b", "[::1]"] {
            s.admin.allowed_hosts = vec![bad.into()];
            let err = s.validate().unwrap_err();
            assert!(err.contains("admin.allowed_hosts"), "{bad:?}: {err}");
        }
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
