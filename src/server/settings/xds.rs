//! Where the rules come from (`rules_source`) and the `xds` section: the rules pushed by an
//! xDS server (an aggregated discovery stream, state of the world, as Envoy Gateway's and Envoy
//! AI Gateway's control planes serve envoyproxy/ratelimit), docs/operations.md.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

use crate::core::units::Millis;

/// Where the rules in force come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RulesSource {
    /// The rules files at the `rules` path, reloaded when they change.
    #[default]
    Files,
    /// The `RateLimitConfig` resources an xDS server pushes (the `xds` section); the `rules`
    /// path is not read.
    Xds,
}

/// The xDS client that subscribes to `type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig`
/// (used when `rules_source: xds`). Its `Debug` shows the headers' names only.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XdsSettings {
    /// The ADS server: `host:port`, or `http://host:port` (`https://` with `tls.enabled`).
    pub server_url: String,
    /// The node id the server keys its snapshots by (Envoy Gateway: `envoy-ratelimit`).
    pub node_id: String,
    /// String fields of the node's metadata.
    pub node_metadata: BTreeMap<String, String>,
    /// gRPC metadata sent with the stream (an `authorization` header, say): a map, or their
    /// `name:value,name:value` text. The values are secrets: never logged or shown.
    #[serde(deserialize_with = "header_map")]
    pub headers: BTreeMap<String, String>,
    /// TLS to the server.
    pub tls: XdsTlsSettings,
    /// Waits between connection attempts.
    pub backoff: XdsBackoffSettings,
    /// Longest wait for a connection (TCP, TLS and HTTP/2 handshakes) to the server.
    pub connect_timeout_ms: Millis,
    /// Largest `DiscoveryResponse` read, in bytes; a larger one ends the stream (and is
    /// retried like any failed stream).
    pub max_message_bytes: usize,
    /// Ready, with nothing limited, before the first rules have arrived (their
    /// `FORCE_START_WITHOUT_INITIAL_CONFIG`). Without it tollgate is not ready, and answers
    /// `UNAVAILABLE`, until then.
    pub force_start: bool,
}

impl std::fmt::Debug for XdsSettings {
    /// As derived, but each header's value is `<redacted>`: settings end up in logs and panics.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: BTreeMap<&str, &str> = self.headers.keys().map(|k| (k.as_str(), "<redacted>")).collect();
        f.debug_struct("XdsSettings")
            .field("server_url", &self.server_url)
            .field("node_id", &self.node_id)
            .field("node_metadata", &self.node_metadata)
            .field("headers", &headers)
            .field("tls", &self.tls)
            .field("backoff", &self.backoff)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("force_start", &self.force_start)
            .finish()
    }
}

/// TLS to the xDS server.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XdsTlsSettings {
    /// Connect over TLS.
    pub enabled: bool,
    /// The client certificate (PEM) for mutual TLS, with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key_file: Option<PathBuf>,
    /// The CA certificates (PEM) the server's certificate must chain to; without it, the
    /// system's root certificates.
    pub ca_file: Option<PathBuf>,
    /// The name the server's certificate must be valid for (and the TLS server name sent);
    /// without it, the host of `server_url`.
    pub san: Option<String>,
}

/// A capped exponential backoff with jitter: the n-th wait in a row is `initial_ms` doubled
/// n - 1 times, at most `max_ms`, shortened by a random part of up to `jitter` of it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XdsBackoffSettings {
    /// The first wait.
    pub initial_ms: Millis,
    /// The longest wait.
    pub max_ms: Millis,
    /// The largest share of a wait taken off at random (0 to 1), so replicas that lost the
    /// server together do not all come back at once.
    pub jitter: f64,
}

impl Default for XdsSettings {
    fn default() -> Self {
        XdsSettings {
            server_url: "localhost:18000".into(),
            node_id: "default".into(),
            node_metadata: BTreeMap::new(),
            headers: BTreeMap::new(),
            tls: XdsTlsSettings::default(),
            backoff: XdsBackoffSettings::default(),
            connect_timeout_ms: Millis(5_000),
            max_message_bytes: 4 * 1024 * 1024,
            force_start: false,
        }
    }
}

impl Default for XdsBackoffSettings {
    fn default() -> Self {
        XdsBackoffSettings {
            initial_ms: Millis(500),
            max_ms: Millis(30_000),
            jitter: 0.5,
        }
    }
}

/// The `headers` setting: a map, or one string of `name:value` pairs separated by commas (their
/// `CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS`, and `TOLLGATE_XDS__HEADERS`, which is read raw
/// as a secret). Names are lower-cased, as gRPC metadata keys are.
fn header_map<'de, D: Deserializer<'de>>(deserializer: D) -> Result<BTreeMap<String, String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Map(BTreeMap<String, String>),
        Text(String),
    }
    let pairs = match Form::deserialize(deserializer)? {
        Form::Map(map) => map,
        Form::Text(text) => parse_header_pairs(&text).map_err(serde::de::Error::custom)?,
    };
    Ok(pairs
        .into_iter()
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v))
        .collect())
}

/// `name:value,name:value` (empty items skipped; a value may hold `:`), as their loader reads a
/// map. Errors: an item without `:`, naming its position, never its text (values are secrets).
pub(crate) fn parse_header_pairs(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (i, item) in text.split(',').enumerate() {
        if item.trim().is_empty() {
            continue;
        }
        let Some((name, value)) = item.split_once(':') else {
            return Err(format!(
                "item {} of the headers is not name:value; use name:value,name:value",
                i + 1
            ));
        };
        out.insert(name.trim().to_owned(), value.trim().to_owned());
    }
    Ok(out)
}

/// The scheme, host and port of an xDS `server_url`: `host:port`, `http://host:port` or
/// `https://host:port` (`[::1]:18000` for IPv6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerUrl {
    /// `Some(true)` for `https://`, `Some(false)` for `http://`, `None` without a scheme.
    pub https: Option<bool>,
    /// The host as written (brackets kept for IPv6).
    pub host: String,
    /// The port.
    pub port: u16,
}

impl ServerUrl {
    /// Parses `text`. Errors: the reason, naming what is expected.
    pub fn parse(text: &str) -> Result<ServerUrl, String> {
        let (https, rest) = if let Some(rest) = text.strip_prefix("https://") {
            (Some(true), rest)
        } else if let Some(rest) = text.strip_prefix("http://") {
            (Some(false), rest)
        } else {
            (None, text)
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let expected = "use host:port (envoy-gateway:18001), http://host:port or https://host:port";
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("no port; {expected}"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{port:?} is not a port; {expected}"))?;
        let bad_host = host.is_empty()
            || host.contains(['/', '@', '?', '#', ' '])
            || (host.contains(':') && !(host.starts_with('[') && host.ends_with(']')));
        if bad_host || port == 0 {
            return Err(expected.to_owned());
        }
        Ok(ServerUrl {
            https,
            host: host.to_owned(),
            port,
        })
    }
}

impl XdsSettings {
    /// Every problem of the section, each a sentence naming the setting (checked only with
    /// `rules_source: xds`); never a header's value.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        match ServerUrl::parse(&self.server_url) {
            Err(why) => problems.push(format!("xds.server_url {:?}: {why}", self.server_url)),
            Ok(url) => match url.https {
                Some(true) if !self.tls.enabled => problems.push(format!(
                    "xds.server_url {:?} is https:// but xds.tls.enabled is false; set xds.tls.enabled: true",
                    self.server_url
                )),
                Some(false) if self.tls.enabled => problems.push(format!(
                    "xds.server_url {:?} is http:// but xds.tls.enabled is true; write host:port or https://",
                    self.server_url
                )),
                _ => {}
            },
        }
        if self.node_id.trim().is_empty() {
            problems.push("xds.node_id must not be empty: the server keys its snapshots by it".into());
        }
        for name in self.headers.keys() {
            if let Err(why) = check_header_name(name) {
                problems.push(format!("xds.headers: {name:?} {why}"));
            }
        }
        for (name, value) in &self.headers {
            if value.is_empty()
                || !value
                    .bytes()
                    .all(|b| b == b' ' || b == b'\t' || (0x21..0x7f).contains(&b))
            {
                problems.push(format!(
                    "xds.headers: the value of {name:?} must be printable ASCII and not empty (not shown: it may be a secret)"
                ));
            }
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            problems.push("xds.tls.cert_file and xds.tls.key_file go together: give both, or neither".into());
        }
        if self.tls.san.as_deref().is_some_and(|s| s.trim().is_empty()) {
            problems.push("xds.tls.san must not be empty (null: the host of xds.server_url)".into());
        }
        let b = &self.backoff;
        if b.initial_ms.0 == 0 || b.max_ms.0 < b.initial_ms.0 {
            problems.push(format!(
                "xds.backoff.initial_ms must be at least 1 and xds.backoff.max_ms at least that, not {} and {}",
                b.initial_ms.0, b.max_ms.0
            ));
        }
        if !(0.0..=1.0).contains(&b.jitter) {
            problems.push(format!("xds.backoff.jitter must be from 0 to 1, not {}", b.jitter));
        }
        if self.connect_timeout_ms.0 == 0 {
            problems.push("xds.connect_timeout_ms must be at least 1".into());
        }
        if self.max_message_bytes < 1024 {
            problems.push("xds.max_message_bytes must be at least 1024".into());
        }
        problems
    }
}

/// Whether `name` can be sent as gRPC metadata: lower-case letters, digits, `-`, `_`, `.`, not
/// binary (`-bin`) and not one the transport sets itself.
fn check_header_name(name: &str) -> Result<(), &'static str> {
    const RESERVED: [&str; 5] = ["content-type", "te", "user-agent", "host", "grpc-timeout"];
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.'))
    {
        return Err("is not a header name (letters, digits, -, _ and .)");
    }
    if name.ends_with("-bin") {
        return Err("is a binary header, which tollgate does not send");
    }
    if RESERVED.contains(&name) || name.starts_with("grpc-") {
        return Err("is set by gRPC itself");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls() {
        let url = ServerUrl::parse("envoy-gateway:18001").unwrap();
        assert_eq!((url.https, url.host.as_str(), url.port), (None, "envoy-gateway", 18001));
        let url = ServerUrl::parse("https://[::1]:18001/").unwrap();
        assert_eq!((url.https, url.host.as_str(), url.port), (Some(true), "[::1]", 18001));
        assert_eq!(ServerUrl::parse("http://127.0.0.1:1").unwrap().https, Some(false));
        for bad in [
            "envoy-gateway",
            ":18001",
            "host:port",
            "::1:18001",
            "a/b:1",
            "host:0",
            "grpc://x:1",
        ] {
            assert!(ServerUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn problems_name_the_setting_and_never_a_header_value() {
        assert!(XdsSettings::default().problems().is_empty());
        let mut s = XdsSettings {
            server_url: "https://cp:18001".into(),
            node_id: " ".into(),
            ..XdsSettings::default()
        };
        s.headers.insert("Bad Name".into(), "ok".into());
        s.headers.insert("x-token".into(), "s3cr3t\n".into());
        s.tls.cert_file = Some("c.pem".into());
        s.backoff.jitter = 2.0;
        s.backoff.max_ms = Millis(1);
        let problems = s.problems().join("\n");
        for part in [
            "xds.tls.enabled",
            "xds.node_id",
            "\"Bad Name\"",
            "\"x-token\"",
            "xds.tls.cert_file",
            "xds.backoff.jitter",
            "xds.backoff.max_ms",
        ] {
            assert!(problems.contains(part), "{part} missing from:\n{problems}");
        }
        assert!(!problems.contains("s3cr3t"), "{problems}");
    }

    /// `TOLLGATE_XDS__HEADERS` is a secret: read raw (a value that looks like a number stays
    /// text), and never quoted in an error.
    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closures return figment::Error
    fn headers_from_the_environment_are_raw_secrets() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("TOLLGATE_RULES_SOURCE", "xds");
            jail.set_env("TOLLGATE_XDS__HEADERS", "authorization:Bearer 8675309,x-team:[rl]");
            let s = crate::server::settings::Settings::load(None).map_err(|e| e.to_string())?;
            assert_eq!(s.rules_source, RulesSource::Xds);
            assert_eq!(s.xds.headers["authorization"], "Bearer 8675309");
            assert_eq!(s.xds.headers["x-team"], "[rl]");
            let shown = format!("{:?}", s);
            assert!(
                shown.contains(r#""authorization": "<redacted>""#) && !shown.contains("8675309"),
                "Debug redacts the values: {shown}"
            );
            jail.set_env("TOLLGATE_XDS__HEADERS", "8675309");
            let err = crate::server::settings::Settings::load(None).unwrap_err().to_string();
            assert!(
                err.to_lowercase().contains("xds.headers") && !err.contains("8675309"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn headers_are_a_map_or_their_text() {
        let s: XdsSettings = serde_yaml::from_str("headers: {Authorization: Bearer x}").unwrap();
        assert_eq!(s.headers["authorization"], "Bearer x");
        let s: XdsSettings = serde_yaml::from_str("headers: 'x-a:1, X-B:b:c,'").unwrap();
        assert_eq!(s.headers.len(), 2);
        assert_eq!(s.headers["x-a"], "1");
        assert_eq!(s.headers["x-b"], "b:c", "a value may hold a colon");
        let err = serde_yaml::from_str::<XdsSettings>("headers: 'x-a:1,s3cr3t'")
            .unwrap_err()
            .to_string();
        assert!(err.contains("item 2") && !err.contains("s3cr3t"), "{err}");
    }
}
