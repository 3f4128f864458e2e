//! envoyproxy/ratelimit's environment variables, read as tollgate settings, so a Deployment
//! written for their image (Istio's sample, Envoy Gateway's managed deployment, hand-made
//! manifests) runs tollgate with only the image changed.
//!
//! [`EnvoyproxyEnv::read`] classifies every environment variable envoyproxy/ratelimit reads:
//!
//! - *mapped*: it becomes a tollgate setting (see [`EnvoyproxyEnv::origins`]);
//! - *accepted*: tollgate already behaves that way, or the variable tunes something tollgate does
//!   differently without changing a decision (a note, logged as a warning when set);
//! - *refused*: continuing would silently change what Envoy is answered or what operators
//!   see; `serve` exits 1 with one [`EnvError`] per variable (the variable, why, what to use
//!   instead).
//!
//! The mapped values form a figment provider merged above the built-in defaults and below the
//! settings file and `TOLLGATE_*` ([`crate::server::settings::Settings::load_layers`]): tollgate's own
//! settings win over theirs. A secret (`REDIS_AUTH`, `REDIS_SENTINEL_AUTH`, ...) is never part of
//! a message.

use std::collections::BTreeMap;
use std::fmt;

use figment::value::{Dict, Map, Value};
use figment::{Metadata, Profile, Provider};
use serde_json::json;

mod statsd;
mod xds;

/// The name a figment value from this environment carries as its source.
pub const SOURCE_NAME: &str = "envoyproxy/ratelimit environment";

/// The file name under which the binary behaves as `tollgate serve` with no arguments, as
/// envoyproxy/ratelimit's manifests run `/bin/ratelimit`.
pub const RATELIMIT_ARGV0: &str = "ratelimit";

/// Their variables that, set alone, are too common to mean "this is their environment"
/// (a platform may set `PORT`); they are read once another of theirs is set or the binary runs
/// as `ratelimit`.
const GENERIC: [&str; 4] = ["HOST", "PORT", "LOG_LEVEL", "LOG_FORMAT"];

/// The bytes of `LOCAL_CACHE_SIZE_IN_BYTES` counted per bucket of tollgate's over-limit cache
/// (an entry and its share of the map: about 70 bytes, rounded up).
pub const LOCAL_CACHE_BYTES_PER_ENTRY: u64 = 100;

/// Variables that hold a secret: their values never appear in a message.
const SECRETS: [&str; 5] = [
    "REDIS_AUTH",
    "REDIS_PERSECOND_AUTH",
    "REDIS_SENTINEL_AUTH",
    "REDIS_PERSECOND_SENTINEL_AUTH",
    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
];

/// Accepted variables that change nothing in tollgate, with why (logged as a warning when set).
const IGNORED: &[(&str, &str)] = &[
    ("DEBUG_HOST", "tollgate has no debug listener; the rules in force are at /config on the HTTP port and the bucket admin API stays on loopback (admin.addr)"),
    ("DEBUG_PORT", "tollgate has no debug listener; the rules in force are at /config on the HTTP port and the bucket admin API stays on loopback (admin.addr)"),
    ("GRPC_MAX_CONNECTION_AGE", "tollgate does not close gRPC connections by age; Envoy keeps its connections and decisions do not depend on them"),
    ("GRPC_MAX_CONNECTION_AGE_GRACE", "tollgate does not close gRPC connections by age"),
    ("USE_DOG_STATSD_MOGRIFIERS", "tollgate sends no DogStatsD"),
    ("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "tollgate exports tollgate_request_duration_seconds, in seconds, and not their response_time series"),
    ("RUNTIME_IGNOREDOTFILES", "tollgate always ignores files and folders whose names start with a dot (ConfigMap mounts' ..data and timestamped folders)"),
    ("RUNTIME_WATCH_ROOT", "tollgate watches the rules folder itself, which follows ConfigMap symlink swaps either way, and also polls it"),
    ("EXPIRATION_JITTER_MAX_SECONDS", "tollgate's Redis keys expire when their bucket is full again, not at a window's end, so expiries do not bunch"),
    ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "a denied request never consumes tokens in tollgate, as if this were always true"),
    ("REDIS_PIPELINE_WINDOW", "tollgate batches the requests waiting for Redis by itself, with no timer"),
    ("REDIS_PIPELINE_LIMIT", "tollgate batches the requests waiting for Redis by itself"),
    ("REDIS_CLUSTER_PIPELINE_PARALLELISM", "tollgate sends one call per Cluster slot, all at once"),
    ("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", "tollgate's readiness (/healthcheck, /readyz, gRPC health) always follows Redis"),
    ("REDIS_STARTUP_INITIAL_INTERVAL", "tollgate starts not ready and keeps connecting to Redis in the background"),
    ("REDIS_STARTUP_MAX_INTERVAL", "tollgate starts not ready and keeps connecting to Redis in the background"),
    ("REDIS_STARTUP_MAX_ELAPSED_TIME", "tollgate keeps connecting to Redis until it answers (not ready meanwhile)"),
    ("REDIS_PERSECOND_SOCKET_TYPE", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_TYPE", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_URL", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_POOL_SIZE", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_AUTH", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_TLS", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_SENTINEL_AUTH", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_PIPELINE_WINDOW", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_PIPELINE_LIMIT", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_TIMEOUT", "only read with REDIS_PERSECOND=true"),
    ("REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR", "only read with REDIS_PERSECOND=true"),
    ("MEMCACHE_HOST_PORT", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_MAX_IDLE_CONNS", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_SRV", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_SRV_REFRESH", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_TLS", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_TLS_CLIENT_CERT", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_TLS_CLIENT_KEY", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_TLS_CACERT", "only used with BACKEND_TYPE=memcache"),
    ("MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION", "only used with BACKEND_TYPE=memcache"),
];

/// Variables tollgate reads into settings or checks (refusing some values).
const HANDLED: &[&str] = &[
    "HOST",
    "PORT",
    "GRPC_HOST",
    "GRPC_PORT",
    "GRPC_UDS",
    "GRPC_SERVER_USE_TLS",
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_SERVER_TLS_CA_CERT",
    "GRPC_CLIENT_TLS_SAN",
    "LOG_LEVEL",
    "LOG_FORMAT",
    "CONFIG_TYPE",
    "USE_DOG_STATSD",
    "USE_STATSD",
    "USE_PROMETHEUS",
    "PROMETHEUS_ADDR",
    "PROMETHEUS_PATH",
    "PROMETHEUS_MAPPER_YAML",
    "RUNTIME_ROOT",
    "RUNTIME_SUBDIRECTORY",
    "RUNTIME_APPDIRECTORY",
    "NEAR_LIMIT_RATIO",
    "LOCAL_CACHE_SIZE_IN_BYTES",
    "CACHE_KEY_PREFIX",
    "BACKEND_TYPE",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "LIMIT_LIMIT_HEADER",
    "LIMIT_REMAINING_HEADER",
    "LIMIT_RESET_HEADER",
    "REDIS_SOCKET_TYPE",
    "REDIS_TYPE",
    "REDIS_URL",
    "REDIS_POOL_SIZE",
    "REDIS_AUTH",
    "REDIS_SENTINEL_AUTH",
    "REDIS_TLS",
    "REDIS_TLS_CLIENT_CERT",
    "REDIS_TLS_CLIENT_KEY",
    "REDIS_TLS_CACERT",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    "REDIS_TIMEOUT",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_PERSECOND",
    "SHADOW_MODE",
    "QUOTA_MODE",
    "RESPONSE_DYNAMIC_METADATA",
    "MERGE_DOMAIN_CONFIG",
    "TRACING_ENABLED",
    "TRACING_SERVICE_NAME",
    "TRACING_SERVICE_NAMESPACE",
    "TRACING_SERVICE_INSTANCE_ID",
    "TRACING_EXPORTER_PROTOCOL",
    "TRACING_SAMPLING_RATE",
];

/// Whether `name` is one of envoyproxy/ratelimit's variables.
pub fn is_theirs(name: &str) -> bool {
    HANDLED.contains(&name)
        || xds::VARIABLES.contains(&name)
        || statsd::VARIABLES.contains(&name)
        || IGNORED.iter().any(|(n, _)| *n == name)
}

/// Their `REDIS_TYPE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RedisType {
    Single,
    Cluster,
    Sentinel,
}

/// One refused variable: what, why, and what to use instead. Never holds a secret's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvError {
    /// The variable.
    pub variable: String,
    /// Why it is refused and what to use instead.
    pub message: String,
}

impl fmt::Display for EnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.variable, self.message)
    }
}

/// Every refused variable of one environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvErrors(pub Vec<EnvError>);

impl fmt::Display for EnvErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "envoyproxy/ratelimit environment not supported as given:")?;
        for e in &self.0 {
            writeln!(f, "  {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for EnvErrors {}

/// The tollgate settings envoyproxy/ratelimit's environment asks for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EnvoyproxyEnv {
    /// Whether their environment is in use (the binary runs as `ratelimit`, or one of their
    /// variables other than `HOST`, `PORT`, `LOG_LEVEL`, `LOG_FORMAT` is set).
    pub active: bool,
    /// The settings, as the nested document figment merges (keys as in the settings file).
    values: serde_json::Map<String, serde_json::Value>,
    /// Per dotted setting key (`redis.urls`), the variables it came from (`REDIS_URL`).
    pub origins: BTreeMap<String, String>,
    /// Accepted variables that change nothing, with why (logged as warnings at start).
    pub notes: Vec<(String, String)>,
}

impl EnvoyproxyEnv {
    /// Reads the process environment; see [`EnvoyproxyEnv::read`].
    ///
    /// Errors: as [`EnvoyproxyEnv::read`].
    pub fn from_process(as_ratelimit: bool) -> Result<EnvoyproxyEnv, EnvErrors> {
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .filter(|(k, _)| is_theirs(k));
        EnvoyproxyEnv::read(vars, as_ratelimit)
    }

    /// Reads their variables from `vars` (`as_ratelimit`: the binary runs as `ratelimit`, which
    /// makes their environment active even when none of theirs is set). An empty value counts
    /// as unset, as their loader (envconfig) treats it for most variables.
    ///
    /// Errors: every refused variable or value, each naming the variable, why, and what to use
    /// instead; a secret's value is never part of them.
    pub fn read(
        vars: impl IntoIterator<Item = (String, String)>,
        as_ratelimit: bool,
    ) -> Result<EnvoyproxyEnv, EnvErrors> {
        let vars: BTreeMap<String, String> = vars
            .into_iter()
            .filter(|(k, v)| is_theirs(k) && !v.trim().is_empty())
            .collect();
        let active = as_ratelimit || vars.keys().any(|k| !GENERIC.contains(&k.as_str()));
        let mut out = EnvoyproxyEnv {
            active,
            ..Default::default()
        };
        if !active {
            return Ok(out);
        }
        let mut r = Reader {
            vars: &vars,
            out: &mut out,
            errors: Vec::new(),
        };
        r.listeners();
        r.logging();
        r.config_source();
        r.stats();
        // Their metric names are exported whenever their environment is in use; the origin
        // names what turned it on.
        let turned_on = if as_ratelimit {
            "the binary runs as `ratelimit`".to_owned()
        } else {
            let theirs: Vec<&str> = vars
                .keys()
                .map(String::as_str)
                .filter(|k| !GENERIC.contains(k))
                .collect();
            theirs.join(", ")
        };
        r.set("metrics.envoyproxy_names", json!(true), &turned_on);
        r.rules(as_ratelimit);
        r.limits();
        r.headers();
        r.backend();
        r.modes();
        for (name, why) in IGNORED {
            if vars.contains_key(*name) {
                r.out.notes.push(((*name).to_owned(), (*why).to_owned()));
            }
        }
        let errors = std::mem::take(&mut r.errors);
        if errors.is_empty() {
            Ok(out)
        } else {
            Err(EnvErrors(errors))
        }
    }

    /// Logs, once per setting, which of their variables it came from, or which of tollgate's
    /// own sources overrode it (`figment` as [`crate::server::settings::Settings::load_layers`] built
    /// it), and each accepted variable that changes nothing, with why. Values are not logged,
    /// so a secret never is.
    pub fn log_sources(&self, figment: &figment::Figment) {
        if !self.active {
            return;
        }
        let overridden = crate::server::settings::overridden_settings(figment, self);
        for (setting, variables) in &self.origins {
            match overridden.iter().find(|(key, _, _)| key == setting) {
                Some((_, _, winner)) => tracing::info!(
                    setting = %setting,
                    variables = %variables,
                    source = %winner,
                    "setting from the envoyproxy/ratelimit environment overridden by tollgate's own"
                ),
                None => tracing::info!(
                    setting = %setting,
                    variables = %variables,
                    "setting from the envoyproxy/ratelimit environment"
                ),
            }
        }
        if let Ok(settings) = figment.extract::<crate::server::settings::Settings>() {
            if let Some(why) = crate::server::settings::admin_clash(&settings, figment, self) {
                tracing::warn!("{why}");
            }
            let from_files = settings.rules_source == crate::server::settings::RulesSource::Files;
            let skipped = if from_files {
                files_not_loaded(&settings.rules)
            } else {
                Vec::new()
            };
            for file in skipped {
                tracing::warn!(
                    file = %file.display(),
                    "not loaded as rules: tollgate reads the *.yaml and *.yml files directly in the rules folder, while envoyproxy/ratelimit loads every file under it"
                );
            }
        }
        for (variable, why) in &self.notes {
            tracing::warn!(variable = %variable, "envoyproxy/ratelimit variable accepted, changes nothing: {why}");
        }
        if std::path::Path::new(crate::server::settings::DEFAULT_SETTINGS_FILE).is_file() {
            tracing::info!(
                file = crate::server::settings::DEFAULT_SETTINGS_FILE,
                "not read: the envoyproxy/ratelimit environment is in use; pass --config to add a settings file"
            );
        }
    }

    /// Whether any setting came from their environment.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The settings as one JSON document (keys as in the settings file), for tests and
    /// `/config`-style views.
    pub fn document(&self) -> serde_json::Value {
        serde_json::Value::Object(self.values.clone())
    }
}

impl Provider for EnvoyproxyEnv {
    fn metadata(&self) -> Metadata {
        Metadata::named(SOURCE_NAME)
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let value = Value::serialize(&self.values)?;
        let dict = value.into_dict().unwrap_or_default();
        Ok(Profile::Default.collect(dict))
    }
}

struct Reader<'a> {
    vars: &'a BTreeMap<String, String>,
    out: &'a mut EnvoyproxyEnv,
    errors: Vec<EnvError>,
}

impl Reader<'_> {
    fn get(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(|v| v.trim())
    }

    fn refuse(&mut self, variable: &str, message: impl Into<String>) {
        self.errors.push(EnvError {
            variable: variable.to_owned(),
            message: message.into(),
        });
    }

    /// `value` shown in a message, unless `variable` holds a secret.
    fn shown(&self, variable: &str) -> String {
        if SECRETS.contains(&variable) {
            "<redacted>".into()
        } else {
            format!("{:?}", self.get(variable).unwrap_or_default())
        }
    }

    /// Sets the setting at dotted `key` to `value`, recording `from` as its source.
    fn set(&mut self, key: &str, value: serde_json::Value, from: &str) {
        let mut parts: Vec<&str> = key.split('.').collect();
        let last = parts.pop().expect("a key has one part at least");
        let mut map = &mut self.out.values;
        for part in parts {
            map = map
                .entry(part.to_owned())
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("settings sections are maps");
        }
        map.insert(last.to_owned(), value);
        self.out.origins.insert(key.to_owned(), from.to_owned());
    }

    /// A boolean as Go's `strconv.ParseBool` reads it (their loader's), or a refusal.
    fn bool(&mut self, name: &str) -> Option<bool> {
        let value = self.get(name)?;
        match value {
            "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
            "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
            _ => {
                let shown = self.shown(name);
                self.refuse(name, format!("{shown} is not a boolean; use true or false"));
                None
            }
        }
    }

    fn port(&mut self, name: &str) -> Option<u16> {
        let value = self.get(name)?;
        match value.parse::<u16>() {
            Ok(port) => Some(port),
            Err(_) => {
                let shown = self.shown(name);
                self.refuse(name, format!("{shown} is not a TCP port (0 to 65535)"));
                None
            }
        }
    }

    /// `HOST`/`PORT`-style pairs: an address for `key` when either is set.
    /// Always sets `key`: their default host (`0.0.0.0`) listens on IPv6 too, as Go's
    /// `net.Listen` does for an unspecified address, which tollgate's own default does not.
    fn address(&mut self, key: &str, host_var: &str, port_var: &str, default_port: u16) {
        let host = self.get(host_var).unwrap_or("0.0.0.0").to_owned();
        let port = self.port(port_var).unwrap_or(default_port);
        let addr = if host == "0.0.0.0" {
            Some(std::net::SocketAddr::new(unspecified_ip(), port))
        } else {
            socket_addr(&host, port)
        };
        let Some(addr) = addr else {
            let shown = self.shown(host_var);
            self.refuse(
                host_var,
                format!(
                    "{shown} is not an IP address; tollgate listens on an IP address (0.0.0.0 for every interface)"
                ),
            );
            return;
        };
        let mut from = [host_var, port_var]
            .iter()
            .filter(|v| self.get(v).is_some())
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        if from.is_empty() {
            from = format!("their defaults ({host_var}=0.0.0.0, {port_var}={default_port})");
        }
        self.set(key, json!(addr.to_string()), &from);
    }

    fn listeners(&mut self) {
        self.address("http_addr", "HOST", "PORT", 8080);
        match self.get("GRPC_UDS").filter(|path| !path.is_empty()).map(str::to_owned) {
            // Theirs listens on the socket instead of GRPC_HOST:GRPC_PORT, which are then unused.
            Some(path) => self.grpc_uds(&path),
            None => self.address("grpc_addr", "GRPC_HOST", "GRPC_PORT", 8081),
        }
        self.grpc_tls();
    }

    /// `GRPC_UDS=<path>`: the gRPC listener on that Unix socket, `grpc_addr: unix:<path>`, in
    /// place of `GRPC_HOST:GRPC_PORT`. tollgate serves TLS on TCP only, so with
    /// `GRPC_SERVER_USE_TLS=true` it is refused.
    fn grpc_uds(&mut self, path: &str) {
        if self.bool("GRPC_SERVER_USE_TLS") == Some(true) {
            self.refuse(
                "GRPC_UDS",
                "tollgate serves a Unix socket in plain text only (its file mode decides who connects), and \
                 GRPC_SERVER_USE_TLS=true asks for TLS: unset one of them",
            );
            return;
        }
        match format!("unix:{path}").parse::<crate::server::uds::GrpcAddr>() {
            Ok(addr) => self.set("grpc_addr", json!(addr.to_string()), "GRPC_UDS"),
            Err(e) => self.refuse("GRPC_UDS", e),
        }
        for unused in ["GRPC_HOST", "GRPC_PORT"] {
            if self.get(unused).is_some() {
                let why = "unused with GRPC_UDS, which replaces the TCP listener, as theirs does";
                self.out.notes.push((unused.to_owned(), why.to_owned()));
            }
        }
    }

    /// `GRPC_SERVER_USE_TLS=true` and its files: `tls.grpc`. Their CA for client certificates
    /// is `GRPC_CLIENT_TLS_CACERT`; Envoy Gateway sets `GRPC_SERVER_TLS_CA_CERT` (which their
    /// service does not read) to the CA of Envoy's own certificate, and either is taken (both
    /// set, they must agree). `GRPC_CLIENT_TLS_SAN` is checked only with a CA, as theirs does.
    /// Without TLS on, the files are notes: their service reads them only with it.
    fn grpc_tls(&mut self) {
        const FILES: [&str; 5] = [
            "GRPC_SERVER_TLS_CERT",
            "GRPC_SERVER_TLS_KEY",
            "GRPC_CLIENT_TLS_CACERT",
            "GRPC_SERVER_TLS_CA_CERT",
            "GRPC_CLIENT_TLS_SAN",
        ];
        if self.bool("GRPC_SERVER_USE_TLS") != Some(true) {
            let set: Vec<&str> = FILES.into_iter().filter(|var| self.get(var).is_some()).collect();
            for var in set {
                let why = "only read with GRPC_SERVER_USE_TLS=true, as theirs does";
                self.out.notes.push((var.to_owned(), why.to_owned()));
            }
            return;
        }
        let (cert, key) = (
            self.get(FILES[0]).map(str::to_owned),
            self.get(FILES[1]).map(str::to_owned),
        );
        let (Some(cert), Some(key)) = (cert, key) else {
            self.refuse(
                "GRPC_SERVER_USE_TLS",
                "true needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY: set them to the PEM files of the \
                 certificate and its key, or unset GRPC_SERVER_USE_TLS",
            );
            return;
        };
        self.set(
            "tls.grpc.cert_file",
            json!(cert),
            "GRPC_SERVER_USE_TLS, GRPC_SERVER_TLS_CERT",
        );
        self.set(
            "tls.grpc.key_file",
            json!(key),
            "GRPC_SERVER_USE_TLS, GRPC_SERVER_TLS_KEY",
        );
        let ca = match (self.get(FILES[2]), self.get(FILES[3])) {
            (Some(theirs), Some(gateway)) if theirs != gateway => {
                self.refuse(
                    "GRPC_SERVER_TLS_CA_CERT",
                    format!(
                        "{} names another file than GRPC_CLIENT_TLS_CACERT {}; both give the CA of client \
                         certificates: set one, or both to the same file",
                        self.shown(FILES[3]),
                        self.shown(FILES[2])
                    ),
                );
                return;
            }
            (Some(ca), _) => Some((ca.to_owned(), FILES[2])),
            (None, Some(ca)) => Some((ca.to_owned(), FILES[3])),
            (None, None) => None,
        };
        if let Some((ca, from)) = &ca {
            self.set(
                "tls.grpc.client_ca_file",
                json!(ca),
                &format!("GRPC_SERVER_USE_TLS, {from}"),
            );
        }
        if let Some(san) = self.get(FILES[4]).map(str::to_owned) {
            if ca.is_some() {
                self.set("tls.grpc.client_sans", json!([san]), "GRPC_CLIENT_TLS_SAN");
            } else {
                let why = "without GRPC_CLIENT_TLS_CACERT no client certificate is asked for, so there is no name to check (theirs ignores it too)";
                self.out.notes.push((FILES[4].to_owned(), why.to_owned()));
            }
        }
    }

    fn logging(&mut self) {
        if let Some(level) = self.get("LOG_LEVEL") {
            // logrus's level names; tracing has no fatal or panic level.
            let mapped = match level.to_ascii_lowercase().as_str() {
                "trace" => Some("trace"),
                "debug" => Some("debug"),
                "info" => Some("info"),
                "warn" | "warning" => Some("warn"),
                "error" | "fatal" | "panic" => Some("error"),
                _ => None,
            };
            match mapped {
                Some(l) => self.set("log.level", json!(l), "LOG_LEVEL"),
                None => {
                    let shown = self.shown("LOG_LEVEL");
                    self.refuse(
                        "LOG_LEVEL",
                        format!("{shown} is not a log level; use trace, debug, info, warn, error, fatal or panic"),
                    );
                }
            }
        }
        if let Some(format) = self.get("LOG_FORMAT") {
            match format.to_ascii_lowercase().as_str() {
                "text" => self.set("log.format", json!("text"), "LOG_FORMAT"),
                "json" => self.set("log.format", json!("json"), "LOG_FORMAT"),
                _ => {
                    let shown = self.shown("LOG_FORMAT");
                    self.refuse("LOG_FORMAT", format!("{shown} is not a log format; use text or json"));
                }
            }
        }
    }

    fn config_source(&mut self) {
        match self.get("CONFIG_TYPE").map(str::to_ascii_uppercase).as_deref() {
            None | Some("FILE") => self.xds_unused(),
            Some("GRPC_XDS_SOTW") => self.xds(),
            Some(_) => {
                let shown = self.shown("CONFIG_TYPE");
                self.refuse(
                    "CONFIG_TYPE",
                    format!("{shown} is not a config type; use FILE or GRPC_XDS_SOTW"),
                );
            }
        }
    }

    /// Whether the rules come from their xDS server (`CONFIG_TYPE=GRPC_XDS_SOTW`).
    fn rules_from_xds(&self) -> bool {
        self.get("CONFIG_TYPE")
            .is_some_and(|t| t.eq_ignore_ascii_case("GRPC_XDS_SOTW"))
    }

    fn stats(&mut self) {
        if self.bool("USE_DOG_STATSD") == Some(true) {
            self.refuse(
                "USE_DOG_STATSD",
                "tollgate sends no DogStatsD; set it to false and use USE_STATSD=true (their statsd names) or scrape Prometheus metrics (USE_PROMETHEUS=true, or /metrics on the HTTP port)",
            );
        }
        self.statsd();
        // Theirs reads the mapper only for its Prometheus sink.
        let prometheus = self.bool("USE_PROMETHEUS") == Some(true);
        if let Some(path) = self.get("PROMETHEUS_MAPPER_YAML").map(str::to_owned) {
            if !prometheus {
                self.out.notes.push((
                    "PROMETHEUS_MAPPER_YAML".into(),
                    "only read with USE_PROMETHEUS=true".into(),
                ));
            } else {
                match check_mapper(std::path::Path::new(&path)) {
                    Ok(warnings) => {
                        for w in warnings {
                            self.out.notes.push(("PROMETHEUS_MAPPER_YAML".into(), w));
                        }
                    }
                    Err(why) => self.refuse(
                        "PROMETHEUS_MAPPER_YAML",
                        format!(
                            "{why}; tollgate exports the default mapper's names and labels only: unset it, and rename series with metric_relabel_configs in Prometheus"
                        ),
                    ),
                }
            }
        }
        if prometheus {
            let addr = self.get("PROMETHEUS_ADDR").unwrap_or(":9090").to_owned();
            match listen_addr(&addr) {
                Some(a) => {
                    let from = if self.get("PROMETHEUS_ADDR").is_some() {
                        "USE_PROMETHEUS, PROMETHEUS_ADDR"
                    } else {
                        "USE_PROMETHEUS (their default address :9090)"
                    };
                    self.set("metrics.addr", json!(a.to_string()), from);
                }
                None => {
                    let shown = self.shown("PROMETHEUS_ADDR");
                    self.refuse(
                        "PROMETHEUS_ADDR",
                        format!("{shown} is not a listen address; use :PORT (every interface) or IP:PORT"),
                    );
                }
            }
            if let Some(path) = self.get("PROMETHEUS_PATH").map(str::to_owned) {
                if path.starts_with('/') && !path.contains(char::is_whitespace) {
                    self.set("metrics.path", json!(path), "PROMETHEUS_PATH");
                } else {
                    let shown = self.shown("PROMETHEUS_PATH");
                    self.refuse(
                        "PROMETHEUS_PATH",
                        format!("{shown} is not a URL path; use one starting with /"),
                    );
                }
            }
        } else {
            for name in ["PROMETHEUS_ADDR", "PROMETHEUS_PATH"] {
                if self.get(name).is_some() {
                    self.out.notes.push((
                        name.into(),
                        "only read with USE_PROMETHEUS=true (metrics are at /metrics on the HTTP port either way)"
                            .into(),
                    ));
                }
            }
        }
    }

    fn rules(&mut self, as_ratelimit: bool) {
        let set = ["RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY"]
            .into_iter()
            .filter(|v| self.get(v).is_some())
            .collect::<Vec<_>>();
        if (set.is_empty() && !as_ratelimit) || self.rules_from_xds() {
            return;
        }
        // Their layout: $RUNTIME_ROOT/$RUNTIME_SUBDIRECTORY/$RUNTIME_APPDIRECTORY, each file a
        // domain.
        let mut path = std::path::PathBuf::from(self.get("RUNTIME_ROOT").unwrap_or("/srv/runtime_data/current"));
        // Go's filepath.Join keeps the root when a part starts with `/`; PathBuf::push would
        // replace it, so the parts lose their leading slashes first.
        if let Some(sub) = self.get("RUNTIME_SUBDIRECTORY") {
            path.push(sub.trim_start_matches('/'));
        }
        path.push(
            self.get("RUNTIME_APPDIRECTORY")
                .unwrap_or("config")
                .trim_start_matches('/'),
        );
        let from = if set.is_empty() {
            "their defaults (RUNTIME_ROOT=/srv/runtime_data/current, RUNTIME_APPDIRECTORY=config)".to_owned()
        } else {
            set.join(", ")
        };
        self.set("rules", json!(path.to_string_lossy()), &from);
    }

    fn limits(&mut self) {
        if let Some(ratio) = self.get("NEAR_LIMIT_RATIO") {
            match ratio.parse::<f64>() {
                Ok(r) if r > 0.0 && r <= 1.0 => self.set("metrics.near_limit_ratio", json!(r), "NEAR_LIMIT_RATIO"),
                _ => {
                    let shown = self.shown("NEAR_LIMIT_RATIO");
                    self.refuse(
                        "NEAR_LIMIT_RATIO",
                        format!(
                            "{shown} is not a ratio; use a number greater than 0 and at most 1 (their default: 0.8)"
                        ),
                    );
                }
            }
        }
        if let Some(v) = self.bool("SHADOW_MODE") {
            self.set("shadow_mode", json!(v), "SHADOW_MODE");
        }
        self.local_cache();
    }

    /// `LOCAL_CACHE_SIZE_IN_BYTES`: their local over-limit cache's size, 0 (their default) for
    /// none. Tollgate's over-limit cache is exact (docs/backends.md) and on by default; an
    /// explicit 0 turns it off, a size caps it at one bucket per [`LOCAL_CACHE_BYTES_PER_ENTRY`].
    fn local_cache(&mut self) {
        const NAME: &str = "LOCAL_CACHE_SIZE_IN_BYTES";
        let Some(size) = self.get(NAME) else {
            return;
        };
        match size.parse::<u64>() {
            Ok(0) => self.set("local.over_limit_cache", json!(false), NAME),
            Ok(bytes) => {
                let entries = (bytes / LOCAL_CACHE_BYTES_PER_ENTRY).max(1);
                self.set("local.over_limit_cache", json!(true), NAME);
                self.set("local.over_limit_cache_entries", json!(entries), NAME);
            }
            Err(_) => {
                let shown = self.shown(NAME);
                self.refuse(
                    NAME,
                    format!("{shown} is not a number of bytes; use a whole number (0: no local cache, their default)"),
                );
            }
        }
    }

    /// `LIMIT_RESPONSE_HEADERS_ENABLED` and their three names become `headers.limit_headers`,
    /// computed as theirs (`crate::decision::LimitHeaders`); a name that is no HTTP header
    /// name is refused (Envoy would drop the header).
    fn headers(&mut self) {
        let names = [
            ("LIMIT_LIMIT_HEADER", "limit"),
            ("LIMIT_REMAINING_HEADER", "remaining"),
            ("LIMIT_RESET_HEADER", "reset"),
        ];
        if self.bool("LIMIT_RESPONSE_HEADERS_ENABLED") != Some(true) {
            for (var, _) in names {
                if self.get(var).is_some() {
                    self.out
                        .notes
                        .push((var.into(), "only read with LIMIT_RESPONSE_HEADERS_ENABLED=true".into()));
                }
            }
            return;
        }
        self.set(
            "headers.limit_headers.enabled",
            json!(true),
            "LIMIT_RESPONSE_HEADERS_ENABLED",
        );
        let is_tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        for (var, field) in names {
            let Some(name) = self.get(var).map(str::to_owned) else {
                continue;
            };
            if name.chars().all(is_tchar) {
                self.set(&format!("headers.limit_headers.{field}"), json!(name), var);
            } else {
                let shown = self.shown(var);
                self.refuse(
                    var,
                    format!("{shown} is not an HTTP header name; use letters, digits and - (e.g. X-RateLimit-Limit)"),
                );
            }
        }
    }

    fn backend(&mut self) {
        self.backend_type();
        if !self.redis_backend() {
            return;
        }
        let kind = self.redis_type();
        let socket = self.redis_socket(kind);
        let tls = self.redis_tls();
        if kind == RedisType::Sentinel {
            self.redis_sentinel(tls);
        } else {
            self.redis_urls(&socket, tls, kind == RedisType::Cluster);
        }
        self.redis_pool_size();
        self.redis_auth();
        self.redis_sentinel_auth(kind);
        self.redis_timeout();
        self.redis_key_prefix();
        self.redis_pool_on_empty();
    }

    /// Refuses the backends (and the per-second Redis) tollgate does not have.
    fn backend_type(&mut self) {
        match self.get("BACKEND_TYPE").map(str::to_ascii_lowercase).as_deref() {
            None | Some("redis") => {}
            Some("memcache") => self.refuse(
                "BACKEND_TYPE",
                "memcache is not supported; use BACKEND_TYPE=redis with REDIS_URL, or tollgate's postgres or memory backend (TOLLGATE_BACKEND)",
            ),
            Some(_) => {
                let shown = self.shown("BACKEND_TYPE");
                self.refuse("BACKEND_TYPE", format!("{shown} is not a backend; use redis"));
            }
        }
        if self.bool("REDIS_PERSECOND") == Some(true) {
            self.refuse(
                "REDIS_PERSECOND",
                "a second Redis for per-second limits is not supported; set it to false: every limit lives in the Redis of REDIS_URL",
            );
        }
    }

    /// Whether the Redis backend is asked for (`BACKEND_TYPE=redis` or any Redis variable);
    /// when it is, selects it.
    fn redis_backend(&mut self) -> bool {
        let redis_vars = [
            "REDIS_SOCKET_TYPE",
            "REDIS_TYPE",
            "REDIS_URL",
            "REDIS_POOL_SIZE",
            "REDIS_AUTH",
            "REDIS_TLS",
            "REDIS_TIMEOUT",
            "CACHE_KEY_PREFIX",
        ];
        let set: Vec<&str> = redis_vars.into_iter().filter(|v| self.get(v).is_some()).collect();
        let explicit = self
            .get("BACKEND_TYPE")
            .is_some_and(|b| b.eq_ignore_ascii_case("redis"));
        if set.is_empty() && !explicit {
            return false;
        }
        let mut from: Vec<&str> = set.clone();
        if explicit {
            from.insert(0, "BACKEND_TYPE");
        }
        self.set("backend", json!("redis"), &from.join(", "));
        // Their service retries Redis at start until it answers, failing health meanwhile.
        self.set("redis.unreachable_at_start", json!("not_ready"), &from.join(", "));
        true
    }

    /// `REDIS_SOCKET_TYPE`, lowercase (their default: `unix`): `tcp`, or `unix` with a single
    /// Redis (`REDIS_URL` a socket path). Their Cluster and Sentinel clients dial TCP whatever it
    /// says, so with `SENTINEL` it is not read; with `CLUSTER` only `tcp` is accepted.
    fn redis_socket(&mut self, kind: RedisType) -> String {
        let socket = self.get("REDIS_SOCKET_TYPE").unwrap_or("unix").to_ascii_lowercase();
        let shown = self
            .get("REDIS_SOCKET_TYPE")
            .map_or("unix (their default)".to_owned(), |v| format!("{v:?}"));
        match (socket.as_str(), kind) {
            (_, RedisType::Sentinel) | ("tcp", _) => {}
            ("unix", RedisType::Single) => {
                if self.get("REDIS_URL").is_some_and(|url| !url.starts_with('/')) {
                    self.refuse(
                        "REDIS_SOCKET_TYPE",
                        format!("{shown} needs REDIS_URL to be a socket path (/var/run/redis/redis.sock); for host:port set REDIS_SOCKET_TYPE=tcp"),
                    );
                }
            }
            ("unix", _) => self.refuse(
                "REDIS_SOCKET_TYPE",
                format!("{shown}: a Redis Cluster is reached over TCP; set REDIS_SOCKET_TYPE=tcp and REDIS_URL=host:port,..."),
            ),
            _ => self.refuse(
                "REDIS_SOCKET_TYPE",
                format!("{shown} is not a socket type; use tcp (REDIS_URL=host:port) or unix (REDIS_URL=/path/to/redis.sock)"),
            ),
        }
        socket
    }

    /// `REDIS_TYPE` (their default: `SINGLE`).
    fn redis_type(&mut self) -> RedisType {
        let kind = match self.get("REDIS_TYPE").map(str::to_ascii_uppercase).as_deref() {
            None | Some("SINGLE") => RedisType::Single,
            Some("CLUSTER") => RedisType::Cluster,
            Some("SENTINEL") => RedisType::Sentinel,
            Some(_) => {
                let shown = self.shown("REDIS_TYPE");
                self.refuse(
                    "REDIS_TYPE",
                    format!("{shown} is not a Redis type; use SINGLE, CLUSTER or SENTINEL"),
                );
                RedisType::Single
            }
        };
        if self.get("REDIS_TYPE").is_some() {
            self.set("redis.cluster", json!(kind == RedisType::Cluster), "REDIS_TYPE");
        }
        kind
    }

    /// `REDIS_URL` with `REDIS_TYPE=SENTINEL`, as theirs reads it: the master's name, then the
    /// sentinels' `host:port`s, comma-separated; TLS (`REDIS_TLS`) to the sentinels and the
    /// master alike.
    fn redis_sentinel(&mut self, tls: bool) {
        let Some(url) = self.get("REDIS_URL").map(str::to_owned) else {
            self.refuse(
                "REDIS_URL",
                "is not set; with REDIS_TYPE=SENTINEL use REDIS_URL=<master name>,<sentinel host:port>,...",
            );
            return;
        };
        let parts: Vec<&str> = url.split(',').map(str::trim).collect();
        let [name, sentinels @ ..] = parts.as_slice() else {
            return;
        };
        if sentinels.is_empty() || name.is_empty() || name.contains(':') {
            self.refuse(
                "REDIS_URL",
                "with REDIS_TYPE=SENTINEL use <master name>,<sentinel host:port>,... (the master's name first, then at least one sentinel)",
            );
            return;
        }
        let scheme = if tls { "rediss" } else { "redis" };
        let mut urls = Vec::new();
        for sentinel in sentinels {
            let has_port = sentinel
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && !host.contains('@') && port.parse::<u16>().is_ok());
            if !has_port {
                self.refuse(
                    "REDIS_URL",
                    format!(
                        "sentinel {:?} is not host:port; use <master name>,<sentinel host:port>,...",
                        crate::server::settings::redact_url(sentinel)
                    ),
                );
                continue;
            }
            urls.push(format!("{scheme}://{sentinel}"));
        }
        self.set("redis.sentinel.master_name", json!(name), "REDIS_TYPE, REDIS_URL");
        self.set("redis.sentinel.urls", json!(urls), "REDIS_URL");
    }

    /// `REDIS_SENTINEL_AUTH`: the sentinels' `password`, or `user:password`, as theirs reads it
    /// (`REDIS_AUTH` stays the master's).
    fn redis_sentinel_auth(&mut self, kind: RedisType) {
        let Some(auth) = self.get("REDIS_SENTINEL_AUTH").map(str::to_owned) else {
            return;
        };
        if kind != RedisType::Sentinel {
            self.out.notes.push((
                "REDIS_SENTINEL_AUTH".into(),
                "only used with REDIS_TYPE=SENTINEL".into(),
            ));
            return;
        }
        match auth.split_once(':') {
            Some((user, pass)) => {
                self.set("redis.sentinel.username", json!(user), "REDIS_SENTINEL_AUTH");
                self.set("redis.sentinel.password", json!(pass), "REDIS_SENTINEL_AUTH");
            }
            None => self.set("redis.sentinel.password", json!(auth), "REDIS_SENTINEL_AUTH"),
        }
    }

    /// Whether `REDIS_TLS` is on; refuses the TLS options tollgate does not have.
    fn redis_tls(&mut self) -> bool {
        let tls = self.bool("REDIS_TLS") == Some(true);
        if self.get("REDIS_TLS").is_some() {
            self.set("redis.tls", json!(tls), "REDIS_TLS");
        }
        if tls {
            for var in ["REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY", "REDIS_TLS_CACERT"] {
                if self.get(var).is_some() {
                    self.refuse(
                        var,
                        "client certificates and private CAs for Redis TLS are not supported; tollgate verifies Redis against the system's root certificates; unset it (or terminate TLS in a sidecar)",
                    );
                }
            }
            if self.bool("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION") == Some(true) {
                self.refuse(
                    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
                    "tollgate always verifies Redis's host name; set it to false and give Redis a certificate for the name in REDIS_URL",
                );
            }
        }
        tls
    }

    /// `REDIS_URL`'s nodes, over TCP (`socket`), with TLS or not, one node unless `cluster`;
    /// or, over a Unix socket, its path.
    fn redis_urls(&mut self, socket: &str, tls: bool, cluster: bool) {
        match self.get("REDIS_URL").map(str::to_owned) {
            Some(path) if socket == "unix" && path.starts_with('/') && !cluster => {
                if tls {
                    self.refuse(
                        "REDIS_TLS",
                        "TLS is for TCP; with REDIS_SOCKET_TYPE=unix set REDIS_TLS=false",
                    );
                }
                self.set("redis.urls", json!([format!("unix://{path}")]), "REDIS_SOCKET_TYPE, REDIS_URL");
            }
            Some(url) if socket == "tcp" => {
                let scheme = if tls { "rediss" } else { "redis" };
                let mut urls = Vec::new();
                for part in url.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                    // Theirs dials host:port as given, so a missing port fails there.
                    let has_port = part
                        .rsplit_once(':')
                        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
                    if !part.contains("://") && !has_port {
                        self.refuse(
                            "REDIS_URL",
                            format!(
                                "{:?} has no port; use host:port (their service fails without one), e.g. redis:6379",
                                crate::server::settings::redact_url(part)
                            ),
                        );
                        continue;
                    }
                    let full = if part.contains("://") {
                        part.to_owned()
                    } else {
                        format!("{scheme}://{part}")
                    };
                    if fred::types::config::Config::from_url(&full).is_err() || !full.starts_with("redis") {
                        self.refuse(
                            "REDIS_URL",
                            format!(
                                "{:?} is not host:port; use host:port, comma-separated for a Cluster's seed nodes",
                                crate::server::settings::redact_url(part)
                            ),
                        );
                    }
                    urls.push(full);
                }
                if urls.len() > 1 && !cluster {
                    self.refuse(
                        "REDIS_URL",
                        "lists several nodes but REDIS_TYPE is not CLUSTER; set REDIS_TYPE=CLUSTER for a Redis Cluster, or give one host:port",
                    );
                }
                self.set("redis.urls", json!(urls), "REDIS_URL");
            }
            Some(_) => {}
            None => self.refuse(
                "REDIS_URL",
                "is not set, so their default (/var/run/nutcracker/ratelimit.sock, a twemproxy socket in their deployment) would apply; set REDIS_URL=host:port, or the path of Redis's own Unix socket",
            ),
        }
    }

    fn redis_pool_size(&mut self) {
        /// Most Redis connections their REDIS_POOL_SIZE gives tollgate.
        const REDIS_POOL_MAX: usize = 256;
        if let Some(size) = self.get("REDIS_POOL_SIZE") {
            match size.parse::<usize>() {
                // Their pools hold a connection per concurrent request; tollgate pipelines
                // every request over few connections, so a large pool only costs.
                Ok(n) if n >= 1 => {
                    if n > REDIS_POOL_MAX {
                        self.out.notes.push((
                            "REDIS_POOL_SIZE".into(),
                            format!("{n} is capped at {REDIS_POOL_MAX} connections: tollgate pipelines requests, so more only cost"),
                        ));
                    }
                    self.set("redis.pool_size", json!(n.min(REDIS_POOL_MAX)), "REDIS_POOL_SIZE")
                }
                _ => {
                    let shown = self.shown("REDIS_POOL_SIZE");
                    self.refuse(
                        "REDIS_POOL_SIZE",
                        format!("{shown} is not a pool size; use a whole number of at least 1"),
                    );
                }
            }
        }
    }

    fn redis_auth(&mut self) {
        if let Some(auth) = self.get("REDIS_AUTH").map(str::to_owned) {
            // Theirs: `password`, or `user:password` for an ACL user.
            match auth.split_once(':') {
                Some((user, pass)) => {
                    self.set("redis.username", json!(user), "REDIS_AUTH");
                    self.set("redis.password", json!(pass), "REDIS_AUTH");
                }
                None => self.set("redis.password", json!(auth), "REDIS_AUTH"),
            }
        }
    }

    fn redis_timeout(&mut self) {
        if let Some(timeout) = self.get("REDIS_TIMEOUT").map(str::to_owned) {
            match go_duration_ms(&timeout) {
                Some(ms) if ms >= 1 => self.set("redis.connect_timeout_ms", json!(ms), "REDIS_TIMEOUT"),
                // Go's dialer reads 0 as "no timeout"; tollgate keeps a bound, its default.
                Some(_) => self.out.notes.push((
                    "REDIS_TIMEOUT".into(),
                    "0 (no timeout in theirs) keeps tollgate's default redis.connect_timeout_ms".into(),
                )),
                _ => {
                    let shown = self.shown("REDIS_TIMEOUT");
                    self.refuse(
                        "REDIS_TIMEOUT",
                        format!("{shown} is not a duration; use a Go duration such as 10s or 500ms"),
                    );
                }
            }
        }
    }

    fn redis_key_prefix(&mut self) {
        if let Some(prefix) = self.get("CACHE_KEY_PREFIX").map(str::to_owned) {
            if prefix.contains(['{', '}']) {
                self.refuse(
                    "CACHE_KEY_PREFIX",
                    "must not contain { or } (tollgate puts a Cluster hash tag after it); choose a prefix without braces",
                );
            } else {
                self.set("redis.key_prefix", json!(prefix), "CACHE_KEY_PREFIX");
            }
        }
    }

    fn redis_pool_on_empty(&mut self) {
        if let Some(behavior) = self.get("REDIS_POOL_ON_EMPTY_BEHAVIOR") {
            if !behavior.eq_ignore_ascii_case("WAIT") {
                let shown = self.shown("REDIS_POOL_ON_EMPTY_BEHAVIOR");
                self.refuse(
                    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
                    format!("{shown} is not supported (theirs only supports WAIT too); unset it: tollgate's requests wait for Redis up to redis.command_timeout_ms"),
                );
            }
        }
    }

    fn modes(&mut self) {
        if let Some(v) = self.bool("QUOTA_MODE") {
            self.set("response.quota_mode", json!(v), "QUOTA_MODE");
        }
        if let Some(v) = self.bool("RESPONSE_DYNAMIC_METADATA") {
            self.set("response.dynamic_metadata", json!(v), "RESPONSE_DYNAMIC_METADATA");
        }
        if let Some(v) = self.bool("MERGE_DOMAIN_CONFIG") {
            self.set("merge_domains", json!(v), "MERGE_DOMAIN_CONFIG");
        }
        self.tracing();
    }

    /// `TRACING_*`: their OpenTelemetry export, onto the `tracing` section. The collector is
    /// the standard `OTEL_EXPORTER_OTLP_*ENDPOINT`, as theirs; their protocol defaults to
    /// HTTP. The other `TRACING_*` are read only with `TRACING_ENABLED=true`, as theirs.
    fn tracing(&mut self) {
        if self.bool("TRACING_ENABLED") != Some(true) {
            return;
        }
        self.set("tracing.enabled", json!(true), "TRACING_ENABLED");
        let protocol = match self
            .get("TRACING_EXPORTER_PROTOCOL")
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None | Some("http") => Some("http/protobuf"),
            Some("grpc") => Some("grpc"),
            Some(_) => {
                let shown = self.shown("TRACING_EXPORTER_PROTOCOL");
                self.refuse(
                    "TRACING_EXPORTER_PROTOCOL",
                    format!("{shown} is not an exporter protocol; use http (their default) or grpc"),
                );
                None
            }
        };
        if let Some(protocol) = protocol {
            self.set("tracing.protocol", json!(protocol), "TRACING_EXPORTER_PROTOCOL");
        }
        if let Some(name) = self.get("TRACING_SERVICE_NAME").filter(|n| !n.is_empty()) {
            let name = name.to_owned();
            self.set("tracing.service_name", json!(name), "TRACING_SERVICE_NAME");
        }
        // One map: the attributes' names hold dots, which `set` would take for sections.
        let mut attributes = serde_json::Map::new();
        let mut from = Vec::new();
        for (variable, attribute) in [
            ("TRACING_SERVICE_NAMESPACE", "service.namespace"),
            ("TRACING_SERVICE_INSTANCE_ID", "service.instance.id"),
        ] {
            if let Some(value) = self.get(variable).filter(|v| !v.is_empty()) {
                attributes.insert(attribute.to_owned(), json!(value));
                from.push(variable);
            }
        }
        if !attributes.is_empty() {
            self.set("tracing.resource_attributes", attributes.into(), &from.join(", "));
        }
        if let Some(rate) = self.get("TRACING_SAMPLING_RATE") {
            match rate.parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => {
                    self.set("tracing.sampling_ratio", json!(r), "TRACING_SAMPLING_RATE")
                }
                _ => {
                    let shown = self.shown("TRACING_SAMPLING_RATE");
                    self.refuse(
                        "TRACING_SAMPLING_RATE",
                        format!("{shown} is not a sampling rate; use a number from 0 to 1 (their default: 1)"),
                    );
                }
            }
        }
    }
}

/// What the statsd-exporter mapper file at `path` (`PROMETHEUS_MAPPER_YAML`) does to their
/// per-rule series, against what tollgate exports: `domain`, `key1` for a one-level stat key
/// and `domain`, `key1`, `key2` for two or more. Returns warnings, one per difference that
/// leaves tollgate exporting a series the mapper would drop or label with fewer labels (Envoy
/// Gateway's file maps `_shadow_mode` only with all three labels, and matches `key2` as
/// exactly one level). Their service ignores a mapper it cannot read or parse and starts with
/// no mapping, so tollgate warns then too (Envoy Gateway mounts the file from an optional
/// ConfigMap).
///
/// Errors: a mapping names one of these series with a label other than `domain`, `key1`,
/// `key2`, or maps their rate-limit stats to another series name: dashboards built on that
/// mapper would find nothing in what tollgate exports.
fn check_mapper(path: &std::path::Path) -> Result<Vec<String>, String> {
    let shown = path.display();
    let mapper = match read_mapper(path) {
        Ok(mapper) => mapper,
        Err(warning) => return Ok(vec![warning]),
    };
    refuse_other_series(&mapper, &shown)?;
    Ok(mapper_warnings(&mapper, &shown))
}

/// A statsd-exporter mapper file, the parts [`check_mapper`] reads.
#[derive(serde::Deserialize)]
struct Mapper {
    #[serde(default)]
    mappings: Vec<Mapping>,
}

/// One mapping of a [`Mapper`].
#[derive(serde::Deserialize)]
struct Mapping {
    #[serde(rename = "match")]
    pattern: Option<String>,
    match_type: Option<String>,
    action: Option<String>,
    name: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// The labels tollgate puts on the per-rule series.
const MAPPER_LABELS: [&str; 3] = ["domain", "key1", "key2"];

/// The mapper at `path`, or the warning that it cannot be read or parsed.
fn read_mapper(path: &std::path::Path) -> Result<Mapper, String> {
    let shown = path.display();
    let unmapped = "tollgate exports the default mapper's names and labels";
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            return Err(format!(
                "cannot read {shown} ({e}); their service ignores that too; {unmapped}"
            ))
        }
    };
    match serde_yaml::from_str(&text) {
        Ok(m) => Ok(m),
        Err(e) => Err(format!(
            "{shown} is not a statsd-exporter mapper ({e}); their service ignores that too; {unmapped}"
        )),
    }
}

/// Refuses a mapping that labels a per-rule series with another label, or maps their
/// rate-limit stats to another series name (see [`check_mapper`]).
fn refuse_other_series(mapper: &Mapper, shown: &std::path::Display<'_>) -> Result<(), String> {
    let series = crate::telemetry::ENVOYPROXY_RULE_SERIES;
    for m in &mapper.mappings {
        let name = m.name.as_deref().unwrap_or_default();
        let drops = m.action.as_deref().is_some_and(|a| a.eq_ignore_ascii_case("drop"));
        let rate_limit_stat = m.pattern.as_deref().is_some_and(|p| {
            p.starts_with("ratelimit.service.rate_limit.") || p.starts_with("ratelimit\\.service\\.rate_limit\\.")
        });
        if series.contains(&name) {
            if let Some(other) = m.labels.keys().find(|k| !MAPPER_LABELS.contains(&k.as_str())) {
                return Err(format!(
                    "{shown} labels {name} with {other:?}; tollgate labels it with domain, key1, key2 only"
                ));
            }
        } else if rate_limit_stat && !drops {
            return Err(format!(
                "{shown} maps their rate-limit stats to {name:?}; tollgate exports them as {}",
                series.join(", ")
            ));
        }
    }
    Ok(())
}

/// One warning per difference between `mapper` and tollgate's per-rule series (see
/// [`check_mapper`]).
fn mapper_warnings(mapper: &Mapper, shown: &std::path::Display<'_>) -> Vec<String> {
    let series = crate::telemetry::ENVOYPROXY_RULE_SERIES;
    let mut warnings = Vec::new();
    for name in series {
        let forms: Vec<(&Mapping, Vec<&str>)> = mapper
            .mappings
            .iter()
            .filter(|m| m.name.as_deref() == Some(name))
            .map(|m| (m, m.labels.keys().map(String::as_str).collect()))
            .collect();
        if forms.is_empty() {
            warnings.push(format!(
                "{shown} does not map {name}, so theirs would not export it; tollgate does"
            ));
            continue;
        }
        for (wanted, levels) in [(&MAPPER_LABELS[..2], "one-level"), (&MAPPER_LABELS[..], "two-level")] {
            if !forms.iter().any(|(_, labels)| labels == wanted) {
                warnings.push(format!(
                    "{shown} has no {levels} mapping of {name} (labels {}); tollgate exports those stats anyway",
                    wanted.join(", ")
                ));
            }
        }
        if let Some((_, labels)) = forms.iter().find(|(_, l)| l.len() < 2) {
            warnings.push(format!(
                "{shown} maps {name} with labels {labels:?} only; tollgate's series carry domain, key1 and, for two levels or more, key2"
            ));
        }
        let glob_three = forms.iter().any(|(m, labels)| {
            labels.len() == 3 && m.match_type.as_deref().is_none_or(|t| t.eq_ignore_ascii_case("glob"))
        });
        if glob_three {
            warnings.push(format!(
                "{shown} matches {name}'s key2 as exactly one level (a glob), so theirs would not map stats of three levels or more; tollgate counts those under their first two levels"
            ));
        }
    }
    warnings
}

/// The files under the rules folder `dir` that their service would load and tollgate does not
/// (`crate::rules::file::rule_files`): not hidden (no part of the path under `dir` starts with
/// `.`, which also skips a ConfigMap's `..data`), and either not `*.yaml`/`*.yml` or inside a
/// subfolder. Sorted; at most 100 (the rest are not listed). Empty when `dir` is a file or
/// cannot be read.
pub fn files_not_loaded(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    const MAX: usize = 100;
    fn walk(dir: &std::path::Path, top: bool, out: &mut Vec<std::path::PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        let mut entries: Vec<_> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
        entries.sort();
        for path in entries {
            if out.len() >= MAX {
                return;
            }
            let hidden = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'));
            if hidden {
                continue;
            }
            if path.is_dir() {
                walk(&path, false, out);
            } else if path.is_file() {
                let yaml = path
                    .extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
                if !top || !yaml {
                    out.push(path);
                }
            }
        }
    }
    let mut out = Vec::new();
    if dir.is_dir() {
        walk(dir, true, &mut out);
    }
    out
}

fn socket_addr(host: &str, port: u16) -> Option<std::net::SocketAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: std::net::IpAddr = if host.eq_ignore_ascii_case("localhost") {
        std::net::Ipv4Addr::LOCALHOST.into()
    } else {
        host.parse().ok()?
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// Go's listen address forms: `:9090` (every interface, IPv4 and IPv6: see
/// [`unspecified_ip`]), `host:9090`, `[::1]:9090`.
pub fn listen_addr(text: &str) -> Option<std::net::SocketAddr> {
    let (host, port) = text.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    if host.is_empty() || host == "0.0.0.0" {
        return Some(std::net::SocketAddr::new(unspecified_ip(), port));
    }
    socket_addr(host, port)
}

/// The address that means "every interface" as Go's `net.Listen` takes it for an empty or
/// unspecified host: `::` where the machine has IPv6 (on Linux such a socket takes IPv4 too,
/// unless `net.ipv6.bindv6only` is set), else `0.0.0.0`. Found by binding `[::]:0` once;
/// with `bindv6only` on, `0.0.0.0`, so that IPv4 clients, the common case, are still served.
pub fn unspecified_ip() -> std::net::IpAddr {
    static IP: std::sync::OnceLock<std::net::IpAddr> = std::sync::OnceLock::new();
    *IP.get_or_init(|| {
        let v6only = std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|v| v.trim() == "1");
        if v6only {
            return std::net::Ipv4Addr::UNSPECIFIED.into();
        }
        match std::net::TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, 0)) {
            Ok(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
            // EAFNOSUPPORT (no IPv6 in the kernel) or EADDRNOTAVAIL (IPv6 disabled), or any
            // other failure: IPv4 alone still serves.
            Err(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        }
    })
}

/// A Go duration (`10s`, `500ms`, `1m30s`, `2h`) in whole milliseconds (rounded up).
fn go_duration_ms(text: &str) -> Option<u64> {
    let mut rest = text;
    let mut total_us: f64 = 0.0;
    if rest == "0" {
        return Some(0);
    }
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let (num, tail) = rest.split_at(num_len);
        let n: f64 = num.parse().ok()?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let us = match unit {
            "ns" => 0.001,
            "us" | "µs" => 1.0,
            "ms" => 1_000.0,
            "s" => 1_000_000.0,
            "m" => 60_000_000.0,
            "h" => 3_600_000_000.0,
            _ => return None,
        };
        total_us += n * us;
        rest = tail;
    }
    Some((total_us / 1000.0).ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The environment of `vars`, read as `tollgate serve` reads it (shared with the tests of
    /// the submodules).
    pub(super) fn read(vars: &[(&str, &str)]) -> Result<EnvoyproxyEnv, EnvErrors> {
        EnvoyproxyEnv::read(vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())), false)
    }

    #[test]
    fn istio_sample_environment() {
        let env = read(&[
            ("LOG_LEVEL", "debug"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("USE_STATSD", "false"),
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
            ("HOST", "::"),
            ("GRPC_HOST", "::"),
        ])
        .unwrap();
        assert!(env.active);
        let doc = env.document();
        assert_eq!(doc["rules"], "/data/ratelimit/config");
        assert_eq!(doc["http_addr"], "[::]:8080", "their default PORT");
        assert_eq!(doc["grpc_addr"], "[::]:8081", "their default GRPC_PORT");
        assert_eq!(doc["backend"], "redis");
        assert_eq!(doc["redis"]["urls"], json!(["redis://redis:6379"]));
        assert_eq!(doc["redis"]["unreachable_at_start"], "not_ready");
        assert_eq!(doc["log"]["level"], "debug");
        assert_eq!(doc["metrics"]["envoyproxy_names"], true);
        assert_eq!(env.origins["rules"], "RUNTIME_ROOT, RUNTIME_SUBDIRECTORY");
        assert_eq!(env.origins["redis.urls"], "REDIS_URL");
        let noted: Vec<&str> = env.notes.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(noted, ["RUNTIME_IGNOREDOTFILES", "RUNTIME_WATCH_ROOT"]);
    }

    /// `GRPC_UDS` replaces the TCP listener with a Unix socket, as theirs does; with their TLS
    /// switch on it is refused.
    #[test]
    fn grpc_uds_puts_the_grpc_listener_on_a_unix_socket() {
        let env = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("GRPC_UDS", "/var/run/ratelimit/ratelimit.sock"),
            ("GRPC_PORT", "9000"),
        ])
        .unwrap();
        let doc = env.document();
        assert_eq!(doc["grpc_addr"], "unix:/var/run/ratelimit/ratelimit.sock");
        assert_eq!(env.origins["grpc_addr"], "GRPC_UDS");
        assert!(env
            .notes
            .iter()
            .any(|(n, why)| n == "GRPC_PORT" && why.contains("GRPC_UDS")));
        let empty = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("GRPC_UDS", ""),
        ])
        .unwrap();
        let tcp = std::net::SocketAddr::new(unspecified_ip(), 8081).to_string();
        assert_eq!(
            empty.document()["grpc_addr"],
            tcp.as_str(),
            "an empty GRPC_UDS is unset, as theirs"
        );
        let err = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("GRPC_UDS", "/tmp/rl.sock"),
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/c.pem"),
            ("GRPC_SERVER_TLS_KEY", "/k.pem"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("GRPC_UDS") && err.contains("plain text only"), "{err}");
    }

    /// Their tracing variables map onto the `tracing` section with `TRACING_ENABLED=true`
    /// (protocol HTTP by default, as theirs), are not read without it, and a bad protocol or
    /// rate is refused naming the variable.
    #[test]
    fn tracing_variables_map_onto_the_tracing_section() {
        let env = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("TRACING_ENABLED", "true"),
            ("TRACING_SERVICE_NAME", "ratelimit-edge"),
            ("TRACING_SERVICE_NAMESPACE", "edge"),
            ("TRACING_SERVICE_INSTANCE_ID", "rl-0"),
            ("TRACING_SAMPLING_RATE", "0.25"),
        ])
        .unwrap();
        let doc = env.document();
        assert_eq!(doc["tracing"]["enabled"], true);
        assert_eq!(doc["tracing"]["protocol"], "http/protobuf");
        assert_eq!(doc["tracing"]["service_name"], "ratelimit-edge");
        assert_eq!(doc["tracing"]["sampling_ratio"], 0.25);
        assert_eq!(
            doc["tracing"]["resource_attributes"],
            json!({"service.namespace": "edge", "service.instance.id": "rl-0"})
        );
        let settings: crate::traces::TracingSettings =
            serde_json::from_value(doc["tracing"].clone()).expect("a tracing section");
        assert_eq!(settings.protocol, Some(crate::traces::OtlpProtocol::HttpProtobuf));
        settings.validate().unwrap();

        let doc = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "grpc"),
        ])
        .unwrap()
        .document();
        assert_eq!(doc["tracing"]["protocol"], "grpc");
        let doc = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("TRACING_SERVICE_NAME", "x"),
        ])
        .unwrap()
        .document();
        assert!(
            doc.get("tracing").is_none(),
            "read only with TRACING_ENABLED=true: {doc}"
        );

        for (name, value) in [("TRACING_EXPORTER_PROTOCOL", "udp"), ("TRACING_SAMPLING_RATE", "2")] {
            let errors = read(&[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "redis:6379"),
                ("TRACING_ENABLED", "true"),
                (name, value),
            ])
            .expect_err("refused");
            assert!(errors.to_string().contains(name), "{errors}");
        }
    }

    /// Their local cache's size: 0 turns tollgate's exact cache off, a size bounds it, unset
    /// leaves tollgate's default (on), and a non-number is refused naming the variable.
    #[test]
    fn local_cache_size_maps_onto_the_over_limit_cache() {
        let doc = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("LOCAL_CACHE_SIZE_IN_BYTES", "0"),
        ])
        .unwrap()
        .document();
        assert_eq!(doc["local"]["over_limit_cache"], false);
        let doc = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("LOCAL_CACHE_SIZE_IN_BYTES", "1048576"),
        ])
        .unwrap()
        .document();
        assert_eq!(doc["local"]["over_limit_cache"], true);
        assert_eq!(doc["local"]["over_limit_cache_entries"], 10485);
        let doc = read(&[("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "redis:6379")])
            .unwrap()
            .document();
        assert!(doc.get("local").is_none(), "{doc}");
        let err = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("LOCAL_CACHE_SIZE_IN_BYTES", "1GB"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("LOCAL_CACHE_SIZE_IN_BYTES: \"1GB\" is not a number of bytes"),
            "{err}"
        );
    }

    #[test]
    fn generic_variables_alone_do_not_activate_it() {
        let env = read(&[("PORT", "3000"), ("LOG_LEVEL", "debug")]).unwrap();
        assert!(!env.active);
        assert!(env.is_empty());
        let env = EnvoyproxyEnv::read([("PORT".to_owned(), "3000".to_owned())], true).unwrap();
        let every = std::net::SocketAddr::new(unspecified_ip(), 3000).to_string();
        assert_eq!(env.document()["http_addr"], every.as_str());
        assert_eq!(env.document()["rules"], "/srv/runtime_data/current/config");
    }

    #[test]
    fn cluster_auth_and_addresses() {
        let env = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_TYPE", "cluster"),
            ("REDIS_URL", "a:7000, b:7001"),
            ("REDIS_AUTH", "app:s3cret"),
            ("REDIS_TLS", "true"),
            ("GRPC_HOST", "127.0.0.1"),
            ("GRPC_PORT", "9000"),
            ("USE_PROMETHEUS", "true"),
            ("PROMETHEUS_ADDR", ":19001"),
            ("REDIS_TIMEOUT", "1m30s"),
        ])
        .unwrap();
        let doc = env.document();
        assert_eq!(doc["redis"]["urls"], json!(["rediss://a:7000", "rediss://b:7001"]));
        assert_eq!(doc["redis"]["cluster"], true);
        assert_eq!(doc["redis"]["username"], "app");
        assert_eq!(doc["redis"]["password"], "s3cret");
        assert_eq!(doc["grpc_addr"], "127.0.0.1:9000");
        let every = std::net::SocketAddr::new(unspecified_ip(), 19001).to_string();
        assert_eq!(doc["metrics"]["addr"], every.as_str());
        assert_eq!(doc["redis"]["connect_timeout_ms"], 90_000);
    }

    #[test]
    fn sentinel_as_theirs_master_name_first_then_the_sentinels() {
        let env = read(&[
            ("REDIS_TYPE", "SENTINEL"),
            ("REDIS_URL", "mymaster, sentinel-0:26379,10.0.0.2:26380"),
            ("REDIS_AUTH", "master-secret"),
            ("REDIS_SENTINEL_AUTH", "watcher:sentinel-secret"),
            ("REDIS_TLS", "true"),
        ])
        .unwrap();
        let doc = env.document();
        let sentinel = &doc["redis"]["sentinel"];
        assert_eq!(sentinel["master_name"], "mymaster");
        assert_eq!(
            sentinel["urls"],
            json!(["rediss://sentinel-0:26379", "rediss://10.0.0.2:26380"])
        );
        assert_eq!(sentinel["username"], "watcher");
        assert_eq!(sentinel["password"], "sentinel-secret");
        assert_eq!(doc["redis"]["password"], "master-secret");
        assert_eq!(doc["redis"]["cluster"], false);
        assert_eq!(doc["redis"].get("urls"), None, "the sentinels are not Redis nodes");
        // Their Sentinel client dials TCP whatever REDIS_SOCKET_TYPE says (default unix).
        assert!(env.notes.iter().all(|(v, _)| v != "REDIS_SENTINEL_AUTH"));

        for url in [
            "mymaster",
            "sentinel-0:26379,sentinel-1:26379",
            "mymaster,sentinel-0",
            "mymaster,:1",
        ] {
            let err = read(&[
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_URL", url),
                ("REDIS_SENTINEL_AUTH", "hunter2-secret"),
            ])
            .unwrap_err();
            assert!(err.0.iter().any(|e| e.variable == "REDIS_URL"), "{url}: {err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
        // Outside Sentinel their sentinel password is a note, not a setting.
        let env = read(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("REDIS_SENTINEL_AUTH", "x"),
        ])
        .unwrap();
        assert!(env.notes.iter().any(|(v, _)| v == "REDIS_SENTINEL_AUTH"));
        assert_eq!(env.document()["redis"].get("sentinel"), None);
    }

    #[test]
    fn a_unix_socket_as_theirs_a_path_in_redis_url() {
        for socket in [None, Some("unix")] {
            let mut vars = vec![("REDIS_URL", "/var/run/redis/redis.sock"), ("REDIS_AUTH", "pw")];
            vars.extend(socket.map(|s| ("REDIS_SOCKET_TYPE", s)));
            let doc = read(&vars).unwrap().document();
            assert_eq!(doc["redis"]["urls"], json!(["unix:///var/run/redis/redis.sock"]));
            assert_eq!(doc["redis"]["password"], "pw");
        }
        let refused = |vars: &[(&str, &str)], variable: &str| {
            let err = read(vars).unwrap_err();
            assert!(err.0.iter().any(|e| e.variable == variable), "{vars:?}: {err}");
        };
        // Their default socket type with host:port: it would dial a socket named so.
        refused(&[("REDIS_URL", "redis:6379")], "REDIS_SOCKET_TYPE");
        refused(
            &[
                ("REDIS_SOCKET_TYPE", "unix"),
                ("REDIS_TYPE", "CLUSTER"),
                ("REDIS_URL", "/r.sock"),
            ],
            "REDIS_SOCKET_TYPE",
        );
        refused(
            &[
                ("REDIS_SOCKET_TYPE", "unix"),
                ("REDIS_URL", "/r.sock"),
                ("REDIS_TLS", "true"),
            ],
            "REDIS_TLS",
        );
    }

    #[test]
    fn refusals_name_the_variable_and_never_a_secret() {
        let err = read(&[
            ("REDIS_SOCKET_TYPE", "udp"),
            ("REDIS_URL", "/var/run/redis.sock"),
            ("REDIS_TYPE", "SHARDED"),
            ("REDIS_AUTH", "hunter2-secret"),
            ("BACKEND_TYPE", "memcache"),
            ("USE_DOG_STATSD", "true"),
            ("CONFIG_TYPE", "GRPC_XDS_DELTA"),
            ("GRPC_SERVER_USE_TLS", "true"),
        ])
        .unwrap_err();
        let text = err.to_string();
        for var in [
            "REDIS_SOCKET_TYPE",
            "REDIS_TYPE",
            "BACKEND_TYPE",
            "USE_DOG_STATSD",
            "CONFIG_TYPE",
            "GRPC_SERVER_USE_TLS",
        ] {
            assert!(err.0.iter().any(|e| e.variable == var), "{var} missing in {text}");
        }
        assert!(
            text.contains("is not a config type; use FILE or GRPC_XDS_SOTW"),
            "{text}"
        );
        assert!(
            text.contains("needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn durations_and_listen_addresses() {
        assert_eq!(go_duration_ms("10s"), Some(10_000));
        assert_eq!(go_duration_ms("250ms"), Some(250));
        assert_eq!(go_duration_ms("1.5s"), Some(1_500));
        assert_eq!(go_duration_ms("ten"), None);
        assert_eq!(
            listen_addr(":19001"),
            Some(std::net::SocketAddr::new(unspecified_ip(), 19001))
        );
        assert_eq!(
            listen_addr("127.0.0.1:9"),
            Some(std::net::SocketAddr::from(([127, 0, 0, 1], 9)))
        );
        assert_eq!(listen_addr("nope"), None);
    }

    /// `LIMIT_RESPONSE_HEADERS_ENABLED` turns their headers on under their default names or
    /// the names given; the names alone are only noted; a name that is no header name is
    /// refused.
    #[test]
    fn limit_headers_and_their_names() {
        let env = read(&[("LIMIT_RESPONSE_HEADERS_ENABLED", "true")]).unwrap();
        assert_eq!(env.document()["headers"], json!({"limit_headers": {"enabled": true}}));
        let env = read(&[
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
            ("LIMIT_LIMIT_HEADER", "A-Ratelimit-Limit"),
            ("LIMIT_REMAINING_HEADER", "A-Ratelimit-Remaining"),
            ("LIMIT_RESET_HEADER", "A-Ratelimit-Reset"),
        ])
        .unwrap();
        assert_eq!(
            env.document()["headers"]["limit_headers"],
            json!({"enabled": true, "limit": "A-Ratelimit-Limit", "remaining": "A-Ratelimit-Remaining", "reset": "A-Ratelimit-Reset"})
        );
        assert_eq!(env.origins["headers.limit_headers.reset"], "LIMIT_RESET_HEADER");
        let env = read(&[("LIMIT_LIMIT_HEADER", "A-Ratelimit-Limit")]).unwrap();
        assert!(env.document().get("headers").is_none());
        assert_eq!(
            notes_of(&env, "LIMIT_LIMIT_HEADER"),
            ["only read with LIMIT_RESPONSE_HEADERS_ENABLED=true"]
        );
        let err = read(&[
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
            ("LIMIT_RESET_HEADER", "Reset: now"),
        ])
        .unwrap_err();
        assert_eq!(err.0.len(), 1, "{err}");
        assert_eq!(err.0[0].variable, "LIMIT_RESET_HEADER");
    }

    /// `MERGE_DOMAIN_CONFIG` and `SHADOW_MODE` become settings of the same meaning.
    #[test]
    fn merge_domain_config_and_shadow_mode() {
        let env = read(&[("MERGE_DOMAIN_CONFIG", "true"), ("SHADOW_MODE", "1")]).unwrap();
        assert_eq!(env.document()["merge_domains"], true);
        assert_eq!(env.document()["shadow_mode"], true);
        let env = read(&[("MERGE_DOMAIN_CONFIG", "false")]).unwrap();
        assert_eq!(env.document()["merge_domains"], false);
    }

    /// Their filepath.Join keeps RUNTIME_ROOT when a part starts with `/`.
    #[test]
    fn runtime_parts_with_a_leading_slash_stay_under_the_root() {
        let env = read(&[
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "/ratelimit"),
            ("RUNTIME_APPDIRECTORY", "//config"),
        ])
        .unwrap();
        assert_eq!(env.document()["rules"], "/data/ratelimit/config");
    }

    /// Envoy Gateway's variables (its CA as `GRPC_SERVER_TLS_CA_CERT`) and theirs
    /// (`GRPC_CLIENT_TLS_CACERT`, `GRPC_CLIENT_TLS_SAN`) become `tls.grpc`; without
    /// `GRPC_SERVER_USE_TLS=true` the files change nothing, as in theirs.
    #[test]
    fn grpc_server_tls_becomes_tls_grpc() {
        let gateway = read(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
            ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ])
        .unwrap();
        assert_eq!(
            gateway.document()["tls"],
            json!({"grpc": {"cert_file": "/certs/tls.crt", "key_file": "/certs/tls.key", "client_ca_file": "/certs/ca.crt"}})
        );
        assert_eq!(
            gateway.origins["tls.grpc.client_ca_file"],
            "GRPC_SERVER_USE_TLS, GRPC_SERVER_TLS_CA_CERT"
        );
        let theirs = read(&[
            ("GRPC_SERVER_USE_TLS", "1"),
            ("GRPC_SERVER_TLS_CERT", "/c/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/c/tls.key"),
            ("GRPC_CLIENT_TLS_CACERT", "/c/ca.crt"),
            ("GRPC_SERVER_TLS_CA_CERT", "/c/ca.crt"),
            ("GRPC_CLIENT_TLS_SAN", "envoy.gateway"),
        ])
        .unwrap();
        let grpc = &theirs.document()["tls"]["grpc"];
        assert_eq!(grpc["client_ca_file"], "/c/ca.crt");
        assert_eq!(grpc["client_sans"], json!(["envoy.gateway"]));
        assert_eq!(
            theirs.origins["tls.grpc.client_ca_file"],
            "GRPC_SERVER_USE_TLS, GRPC_CLIENT_TLS_CACERT"
        );
        // A SAN without a CA: no certificate is asked for, so nothing to check (a note).
        let no_ca = read(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/c/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/c/tls.key"),
            ("GRPC_CLIENT_TLS_SAN", "envoy"),
        ])
        .unwrap();
        assert_eq!(
            no_ca.document()["tls"],
            json!({"grpc": {"cert_file": "/c/tls.crt", "key_file": "/c/tls.key"}})
        );
        assert_eq!(notes_of(&no_ca, "GRPC_CLIENT_TLS_SAN").len(), 1);
        // Without TLS on: notes, and no `tls`.
        for use_tls in [None, Some("false")] {
            let mut vars = vec![
                ("GRPC_SERVER_TLS_CERT", "/c/tls.crt"),
                ("GRPC_SERVER_TLS_KEY", "/c/tls.key"),
                ("GRPC_SERVER_TLS_CA_CERT", "/c/ca.crt"),
            ];
            vars.extend(use_tls.map(|v| ("GRPC_SERVER_USE_TLS", v)));
            let off = read(&vars).unwrap();
            assert!(off.document().get("tls").is_none(), "{use_tls:?}");
            assert_eq!(notes_of(&off, "GRPC_SERVER_TLS_CERT").len(), 1, "{use_tls:?}");
            assert_eq!(notes_of(&off, "GRPC_SERVER_TLS_CA_CERT").len(), 1, "{use_tls:?}");
        }
    }

    /// TLS on without a certificate and key is refused (their service exits too), and so are
    /// two CA variables that disagree.
    #[test]
    fn grpc_server_tls_refusals() {
        for vars in [
            &[("GRPC_SERVER_USE_TLS", "true")][..],
            &[("GRPC_SERVER_USE_TLS", "true"), ("GRPC_SERVER_TLS_CERT", "/c/tls.crt")][..],
        ] {
            let err = read(vars).unwrap_err();
            assert_eq!(err.0.len(), 1, "{err}");
            assert_eq!(err.0[0].variable, "GRPC_SERVER_USE_TLS");
            assert!(err.0[0].message.contains("GRPC_SERVER_TLS_KEY"), "{err}");
        }
        let err = read(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/c/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/c/tls.key"),
            ("GRPC_CLIENT_TLS_CACERT", "/c/ca.crt"),
            ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ])
        .unwrap_err();
        assert_eq!(err.0[0].variable, "GRPC_SERVER_TLS_CA_CERT", "{err}");
        assert!(
            err.0[0].message.contains("/certs/ca.crt") && err.0[0].message.contains("/c/ca.crt"),
            "{err}"
        );
    }

    /// What the reading noted about `variable`.
    pub(super) fn notes_of<'a>(env: &'a EnvoyproxyEnv, variable: &str) -> Vec<&'a str> {
        env.notes
            .iter()
            .filter(|(n, _)| n == variable)
            .map(|(_, why)| why.as_str())
            .collect()
    }

    /// Envoy Gateway's mapper, in its shape: every series but `_shadow_mode` with
    /// (domain, key1) and (domain, key1, key2) as globs, `_shadow_mode` with three labels only,
    /// other series of theirs, and a catch-all drop at the end.
    fn envoy_gateway_shaped_mapper() -> String {
        let mut out = String::from("mappings:\n");
        for stat in ["near_limit", "over_limit", "total_hits", "within_limit"] {
            out += &format!(
                "  - match: \"ratelimit.service.rate_limit.*.*.{stat}\"\n    name: \"ratelimit_service_rate_limit_{stat}\"\n    timer_type: histogram\n    labels:\n      domain: \"$1\"\n      key1: \"$2\"\n"
            );
        }
        for stat in ["near_limit", "over_limit", "total_hits", "within_limit"] {
            out += &format!(
                "  - match: \"ratelimit.service.rate_limit.*.*.*.{stat}\"\n    name: \"ratelimit_service_rate_limit_{stat}\"\n    timer_type: histogram\n    labels:\n      domain: \"$1\"\n      key1: \"$2\"\n      key2: \"$3\"\n"
            );
        }
        out += "  - match: \"ratelimit.service.call.should_rate_limit.*\"\n    name: \"ratelimit_service_should_rate_limit_error\"\n    match_metric_type: counter\n    labels:\n      err_type: \"$1\"\n";
        out += "  - match: \"ratelimit_server.*.total_requests\"\n    name: \"ratelimit_service_total_requests\"\n    match_metric_type: counter\n    labels:\n      grpc_method: \"$1\"\n";
        out += "  - match: \"ratelimit.service.config_load_success\"\n    name: \"ratelimit_service_config_load_success\"\n    match_metric_type: counter\n";
        out += "  - match: \"ratelimit.service.rate_limit.*.*.*.shadow_mode\"\n    name: \"ratelimit_service_rate_limit_shadow_mode\"\n    timer_type: histogram\n    labels:\n      domain: \"$1\"\n      key1: \"$2\"\n      key2: \"$3\"\n";
        out += "  - match: \".\"\n    match_type: regex\n    action: drop\n    name: dropped\n";
        out
    }

    #[test]
    fn an_envoy_gateway_mapper_is_accepted_with_warnings() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("conf.yaml");
        std::fs::write(&path, envoy_gateway_shaped_mapper()).unwrap();
        let path = path.to_string_lossy().into_owned();
        let env = read(&[("USE_PROMETHEUS", "true"), ("PROMETHEUS_MAPPER_YAML", &path)])
            .unwrap_or_else(|e| panic!("Envoy Gateway's mapper must be accepted: {e}"));
        let warned = notes_of(&env, "PROMETHEUS_MAPPER_YAML");
        assert!(
            warned
                .iter()
                .any(|w| w.contains("no one-level mapping of ratelimit_service_rate_limit_shadow_mode")),
            "{warned:#?}"
        );
        assert!(
            warned.iter().any(|w| w.contains("key2 as exactly one level")),
            "{warned:#?}"
        );
        assert!(
            !warned
                .iter()
                .any(|w| w.contains("one-level mapping of ratelimit_service_rate_limit_total_hits")),
            "total_hits has its one-level form: {warned:#?}"
        );
    }

    /// Their service ignores a missing or broken mapper; Envoy Gateway's ConfigMap is optional.
    #[test]
    fn a_missing_or_broken_mapper_is_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent.yaml").to_string_lossy().into_owned();
        let env = read(&[("USE_PROMETHEUS", "true"), ("PROMETHEUS_MAPPER_YAML", &missing)]).unwrap();
        let warned = notes_of(&env, "PROMETHEUS_MAPPER_YAML");
        assert!(warned.len() == 1 && warned[0].starts_with("cannot read"), "{warned:?}");
        let broken = dir.path().join("broken.yaml");
        std::fs::write(&broken, "mappings: [unclosed\n").unwrap();
        let broken = broken.to_string_lossy().into_owned();
        let env = read(&[("USE_PROMETHEUS", "true"), ("PROMETHEUS_MAPPER_YAML", &broken)]).unwrap();
        let warned = notes_of(&env, "PROMETHEUS_MAPPER_YAML");
        assert!(
            warned.len() == 1 && warned[0].contains("is not a statsd-exporter mapper"),
            "{warned:?}"
        );
    }

    /// Without USE_PROMETHEUS their service never opens the mapper, so neither does tollgate.
    #[test]
    fn the_mapper_is_read_only_with_use_prometheus() {
        let env = read(&[
            ("USE_STATSD", "false"),
            ("PROMETHEUS_MAPPER_YAML", "/nonexistent/conf.yaml"),
        ])
        .unwrap();
        assert_eq!(
            notes_of(&env, "PROMETHEUS_MAPPER_YAML"),
            ["only read with USE_PROMETHEUS=true"]
        );
        let env = read(&[("PROMETHEUS_PATH", "/stats"), ("USE_STATSD", "false")]).unwrap();
        assert_eq!(
            notes_of(&env, "PROMETHEUS_ADDR").len(),
            0,
            "the note names the variable set"
        );
        assert_eq!(notes_of(&env, "PROMETHEUS_PATH").len(), 1);
    }

    #[test]
    fn a_mapper_renaming_their_series_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("conf.yaml");
        std::fs::write(
            &path,
            "mappings:\n  - match: \"ratelimit.service.rate_limit.*.*.total_hits\"\n    name: my_hits\n    labels: {domain: \"$1\"}\n",
        )
        .unwrap();
        let path = path.to_string_lossy().into_owned();
        let err = read(&[("USE_PROMETHEUS", "true"), ("PROMETHEUS_MAPPER_YAML", &path)]).unwrap_err();
        assert_eq!(err.0[0].variable, "PROMETHEUS_MAPPER_YAML");
        assert!(err.0[0].message.contains("\"my_hits\""), "{err}");
    }

    #[test]
    fn nits_of_their_environment() {
        // Envoy Gateway sets it beside its xDS variables.
        let env = read(&[("CONFIG_GRPC_XDS_SERVER_USE_TLS", "false")]).unwrap();
        assert!(env.active);
        assert_eq!(notes_of(&env, "CONFIG_GRPC_XDS_SERVER_USE_TLS").len(), 1);
        // The origin of metrics.envoyproxy_names names what turned it on.
        assert_eq!(
            env.origins["metrics.envoyproxy_names"],
            "CONFIG_GRPC_XDS_SERVER_USE_TLS"
        );
        let env = EnvoyproxyEnv::read(std::iter::empty(), true).unwrap();
        assert_eq!(
            env.origins["metrics.envoyproxy_names"],
            "the binary runs as `ratelimit`"
        );

        let redis = |extra: &[(&'static str, &'static str)]| {
            let mut vars = vec![("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "redis:6379")];
            vars.extend_from_slice(extra);
            read(&vars)
        };
        // 0 is a Go duration (no timeout in theirs): tollgate's default stays, with a note.
        for zero in ["0", "0s"] {
            let env = redis(&[("REDIS_TIMEOUT", zero)]).unwrap_or_else(|e| panic!("{zero}: {e}"));
            assert!(env.document()["redis"].get("connect_timeout_ms").is_none());
            assert_eq!(notes_of(&env, "REDIS_TIMEOUT").len(), 1);
        }
        // A pool capped is said so.
        let env = redis(&[("REDIS_POOL_SIZE", "1000")]).unwrap();
        assert_eq!(env.document()["redis"]["pool_size"], 256);
        assert!(notes_of(&env, "REDIS_POOL_SIZE")[0].contains("capped at 256"));
        let env = redis(&[("REDIS_POOL_SIZE", "10")]).unwrap();
        assert!(notes_of(&env, "REDIS_POOL_SIZE").is_empty());
        // A host without a port fails in theirs; tollgate refuses it up front.
        let err = read(&[("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "redis")]).unwrap_err();
        assert_eq!(err.0.len(), 1, "{err}");
        assert_eq!(err.0[0].variable, "REDIS_URL");
        assert!(err.0[0].message.contains("has no port"), "{err}");
    }
}
