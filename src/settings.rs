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
    /// Bounds on a request; beyond them it is answered `INVALID_ARGUMENT`.
    pub limits: RequestLimits,
    /// Which headers go into `response_headers_to_add`.
    pub headers: HeaderSettings,
    /// Global shadow mode: evaluate and count every rule, never answer `OVER_LIMIT`.
    pub shadow_mode: bool,
    /// Honour per-descriptor `limit` overrides sent by Envoy (`RateLimitOverride`).
    pub overrides: bool,
    /// The memory backend.
    pub memory: MemorySettings,
    /// The bucket admin API (peek, refund, reset).
    pub admin: AdminSettings,
    /// Reloading the rules when their files change.
    pub reload: ReloadSettings,
    /// Graceful shutdown on SIGTERM / SIGINT.
    pub shutdown: ShutdownSettings,
    /// Prometheus metrics.
    pub metrics: MetricsSettings,
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
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSettings {
    /// An admitted decision is counted `near_limit` when the bucket has used at least this
    /// fraction of its capacity (0 < ratio <= 1).
    pub near_limit_ratio: f64,
}

/// The backend keeping bucket state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In-process: each replica enforces its own limits; a restart refills every bucket.
    Memory,
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
            headers: HeaderSettings::default(),
            shadow_mode: false,
            overrides: true,
            memory: MemorySettings::default(),
            admin: AdminSettings::default(),
            reload: ReloadSettings::default(),
            shutdown: ShutdownSettings::default(),
            metrics: MetricsSettings::default(),
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
        MetricsSettings { near_limit_ratio: 0.8 }
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
const KEYS: [&str; 14] = [
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
    "admin",
    "reload",
    "shutdown",
    "metrics",
];

impl Settings {
    /// Loads settings: defaults, then `file` (which must exist when given; otherwise
    /// [`DEFAULT_SETTINGS_FILE`] if it exists), then the environment.
    ///
    /// Errors: an unreadable file, a missing `--config` file, bad YAML, an unknown key, or a
    /// value of the wrong type, each naming the key and where it came from.
    pub fn load(file: Option<&Path>) -> Result<Settings, Box<figment::Error>> {
        let mut figment = Figment::from(Serialized::defaults(Settings::default()));
        match file {
            Some(path) => {
                if !path.is_file() {
                    let missing = format!("settings file {} does not exist", path.display());
                    return Err(Box::new(figment::Error::from(missing)));
                }
                figment = figment.merge(Yaml::file_exact(path));
            }
            None => figment = figment.merge(Yaml::file(DEFAULT_SETTINGS_FILE)),
        }
        figment
            .merge(Env::prefixed("TOLLGATE_").split("__").filter(|k| {
                let top = k.as_str().split('.').next().unwrap_or_default();
                KEYS.iter().any(|known| known.eq_ignore_ascii_case(top))
            }))
            .extract()
            .map_err(Box::new)
    }
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
        if self.shutdown.timeout_seconds == 0 {
            return Err("shutdown.timeout_seconds must be at least 1".into());
        }
        Ok(())
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
