//! Their xDS rules source: `CONFIG_TYPE=GRPC_XDS_SOTW` and the variables it reads, as
//! `rules_source: xds` and the `xds` section. Without it their service reads none of them, so
//! each one set is only noted.

use serde_json::json;

use super::{go_duration_ms, Reader};
use crate::server::settings::xds::{parse_header_pairs, ServerUrl};

/// The variables of their xDS rules source (read only with `CONFIG_TYPE=GRPC_XDS_SOTW`).
pub(super) const VARIABLES: [&str; 17] = [
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "CONFIG_GRPC_XDS_NODE_ID",
    "CONFIG_GRPC_XDS_NODE_METADATA",
    "CONFIG_GRPC_XDS_SERVER_URL",
    "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
    "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
    "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
    "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
    "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
    "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
    "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
    "XDS_CLIENT_BACKOFF_JITTER",
    "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
];

/// Their TLS variables for the xDS server, read only with `CONFIG_GRPC_XDS_SERVER_USE_TLS=true`,
/// and the settings they become.
const TLS_FILES: [(&str, &str); 4] = [
    ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "xds.tls.cert_file"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "xds.tls.key_file"),
    ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "xds.tls.ca_file"),
    ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "xds.tls.san"),
];

impl Reader<'_> {
    /// `CONFIG_TYPE=GRPC_XDS_SOTW`: the rules come from their xDS server.
    pub(super) fn xds(&mut self) {
        self.set("rules_source", json!("xds"), "CONFIG_TYPE");
        if let Some(url) = self.get("CONFIG_GRPC_XDS_SERVER_URL").map(str::to_owned) {
            match ServerUrl::parse(&url) {
                Ok(_) => self.set("xds.server_url", json!(url), "CONFIG_GRPC_XDS_SERVER_URL"),
                Err(why) => {
                    let shown = self.shown("CONFIG_GRPC_XDS_SERVER_URL");
                    self.refuse("CONFIG_GRPC_XDS_SERVER_URL", format!("{shown}: {why}"));
                }
            }
        }
        if let Some(id) = self.get("CONFIG_GRPC_XDS_NODE_ID").map(str::to_owned) {
            self.set("xds.node_id", json!(id), "CONFIG_GRPC_XDS_NODE_ID");
        }
        self.xds_node_metadata();
        if let Some(text) = self.get("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS").map(str::to_owned) {
            match parse_header_pairs(&text) {
                Ok(pairs) => {
                    let headers: serde_json::Map<String, serde_json::Value> = pairs
                        .into_iter()
                        .map(|(k, v)| (k.to_ascii_lowercase(), json!(v)))
                        .collect();
                    self.set(
                        "xds.headers",
                        json!(headers),
                        "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                    );
                }
                Err(why) => self.refuse("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", why),
            }
        }
        self.xds_tls();
        self.xds_backoff();
        self.xds_start();
        for name in ["RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY"] {
            if self.get(name).is_some() {
                self.out.notes.push((
                    name.into(),
                    "not read: with CONFIG_TYPE=GRPC_XDS_SOTW the rules come from the xDS server, in theirs too".into(),
                ));
            }
        }
    }

    /// Without their xDS source: every xDS variable set is noted, as theirs ignores them.
    pub(super) fn xds_unused(&mut self) {
        for name in VARIABLES {
            if self.get(name).is_some() {
                let why = if name == "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED" {
                    "tollgate is not ready before its rules have loaded"
                } else {
                    "only used with CONFIG_TYPE=GRPC_XDS_SOTW"
                };
                self.out.notes.push((name.into(), why.into()));
            }
        }
    }

    /// `CONFIG_GRPC_XDS_NODE_METADATA`: `key=value` pairs separated by commas, each a string field
    /// of the node's metadata; an item without `=` is skipped, as theirs skips it (noted).
    fn xds_node_metadata(&mut self) {
        let Some(text) = self.get("CONFIG_GRPC_XDS_NODE_METADATA").map(str::to_owned) else {
            return;
        };
        let mut fields = serde_json::Map::new();
        for item in text.split(',').filter(|i| !i.trim().is_empty()) {
            match item.split_once('=') {
                Some((k, v)) => {
                    fields.insert(k.to_owned(), json!(v));
                }
                None => self.out.notes.push((
                    "CONFIG_GRPC_XDS_NODE_METADATA".into(),
                    format!("{item:?} is not key=value and is left out of the node's metadata, as theirs leaves it"),
                )),
            }
        }
        self.set("xds.node_metadata", json!(fields), "CONFIG_GRPC_XDS_NODE_METADATA");
    }

    /// `CONFIG_GRPC_XDS_SERVER_USE_TLS` and, with it, the certificate files and the SAN.
    fn xds_tls(&mut self) {
        let tls = self.bool("CONFIG_GRPC_XDS_SERVER_USE_TLS");
        if let Some(tls) = tls {
            self.set("xds.tls.enabled", json!(tls), "CONFIG_GRPC_XDS_SERVER_USE_TLS");
        }
        for (name, key) in TLS_FILES {
            let Some(value) = self.get(name).map(str::to_owned) else {
                continue;
            };
            if tls == Some(true) {
                self.set(key, json!(value), name);
            } else {
                self.out
                    .notes
                    .push((name.into(), "only read with CONFIG_GRPC_XDS_SERVER_USE_TLS=true".into()));
            }
        }
    }

    /// `XDS_CLIENT_*` and `CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL`: tollgate has one backoff
    /// for connecting and reconnecting, and one message size limit.
    fn xds_backoff(&mut self) {
        for (name, key) in [
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "xds.backoff.initial_ms"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "xds.backoff.max_ms"),
        ] {
            let Some(text) = self.get(name).map(str::to_owned) else {
                continue;
            };
            match go_duration_ms(&text) {
                Some(ms) if ms >= 1 => self.set(key, json!(ms), name),
                _ => {
                    let shown = self.shown(name);
                    self.refuse(
                        name,
                        format!("{shown} is not a duration of 1ms or more; use a Go duration such as 10s"),
                    );
                }
            }
        }
        if self.bool("XDS_CLIENT_BACKOFF_JITTER") == Some(false) {
            self.set("xds.backoff.jitter", json!(0.0), "XDS_CLIENT_BACKOFF_JITTER");
        }
        if let Some(factor) = self.get("XDS_CLIENT_BACKOFF_RANDOM_FACTOR").map(str::to_owned) {
            if factor.parse::<f64>().is_ok_and(f64::is_finite) {
                self.out.notes.push((
                    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR".into(),
                    "tollgate doubles each wait up to XDS_CLIENT_BACKOFF_MAX_INTERVAL (xds.backoff) and takes up to half of it off at random unless XDS_CLIENT_BACKOFF_JITTER=false".into(),
                ));
            } else {
                let shown = self.shown("XDS_CLIENT_BACKOFF_RANDOM_FACTOR");
                self.refuse("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", format!("{shown} is not a number"));
            }
        }
        if self.get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL").is_some() {
            self.out.notes.push((
                "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL".into(),
                "tollgate waits between connection attempts by one backoff, XDS_CLIENT_BACKOFF_INITIAL_INTERVAL doubled up to XDS_CLIENT_BACKOFF_MAX_INTERVAL (xds.backoff)".into(),
            ));
        }
        if let Some(size) = self.get("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES").map(str::to_owned) {
            match size.parse::<usize>() {
                // 0 is their unset: gRPC's default, which is tollgate's.
                Ok(0) => {}
                Ok(n) => self.set("xds.max_message_bytes", json!(n), "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES"),
                Err(_) => {
                    let shown = self.shown("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES");
                    self.refuse(
                        "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
                        format!("{shown} is not a number of bytes"),
                    );
                }
            }
        }
    }

    /// `FORCE_START_WITHOUT_INITIAL_CONFIG`, unless `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`:
    /// with both, theirs serves at once but reports unhealthy until the first rules, which is
    /// tollgate without `force_start` (its gRPC port is up either way).
    fn xds_start(&mut self) {
        let force = self.bool("FORCE_START_WITHOUT_INITIAL_CONFIG");
        let healthy_after_first = self.bool("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED") == Some(true);
        match force {
            Some(true) if healthy_after_first => self.set(
                "xds.force_start",
                json!(false),
                "FORCE_START_WITHOUT_INITIAL_CONFIG, HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
            ),
            Some(force) => self.set("xds.force_start", json!(force), "FORCE_START_WITHOUT_INITIAL_CONFIG"),
            None => {}
        }
        if healthy_after_first && force != Some(true) {
            self.out.notes.push((
                "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED".into(),
                "tollgate is not ready before the first rules have arrived (without FORCE_START_WITHOUT_INITIAL_CONFIG)"
                    .into(),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{notes_of, read};
    use serde_json::json;

    /// The variables Envoy Gateway sets on its rate-limit Deployment, xDS and TLS included.
    #[test]
    fn envoy_gateways_environment_is_an_xds_source() {
        let env = read(&[
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
            ("LOG_LEVEL", "info"),
            ("USE_STATSD", "false"),
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ])
        .unwrap();
        let doc = env.document();
        assert_eq!(doc["rules_source"], "xds");
        assert_eq!(
            doc["xds"],
            json!({
                "server_url": "envoy-gateway:18001",
                "node_id": "envoy-ratelimit",
                "tls": {"enabled": true, "cert_file": "/certs/tls.crt", "key_file": "/certs/tls.key", "ca_file": "/certs/ca.crt"},
                "force_start": true,
            })
        );
        assert!(doc.get("rules").is_none(), "the rules folder is not read: {doc}");
        assert_eq!(env.origins["rules_source"], "CONFIG_TYPE");
        assert_eq!(env.origins["xds.tls.cert_file"], "CONFIG_GRPC_XDS_CLIENT_TLS_CERT");
        assert_eq!(notes_of(&env, "RUNTIME_ROOT").len(), 1);
        assert!(notes_of(&env, "CONFIG_GRPC_XDS_SERVER_URL").is_empty());
    }

    #[test]
    fn metadata_headers_backoff_and_sizes() {
        let env = read(&[
            ("CONFIG_TYPE", "grpc_xds_sotw"),
            ("CONFIG_GRPC_XDS_NODE_METADATA", "cluster=edge,zone=a=b,junk"),
            (
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                "Authorization:Bearer s3cr3t,x-team:rl",
            ),
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "250ms"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "1m"),
            ("XDS_CLIENT_BACKOFF_JITTER", "false"),
            ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "0.5"),
            ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "16777216"),
            ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3s"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "cp.internal"),
        ])
        .unwrap();
        let xds = &env.document()["xds"];
        assert_eq!(xds["node_metadata"], json!({"cluster": "edge", "zone": "a=b"}));
        assert_eq!(
            xds["headers"],
            json!({"authorization": "Bearer s3cr3t", "x-team": "rl"})
        );
        assert_eq!(
            xds["backoff"],
            json!({"initial_ms": 250, "max_ms": 60000, "jitter": 0.0})
        );
        assert_eq!(xds["max_message_bytes"], 16_777_216);
        assert!(xds.get("tls").is_none(), "the SAN is read only with TLS");
        for noted in [
            "CONFIG_GRPC_XDS_NODE_METADATA",
            "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
            "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
        ] {
            assert_eq!(notes_of(&env, noted).len(), 1, "{noted}: {:?}", env.notes);
        }
        // A malformed header list is refused, without its text (it may hold a token).
        let err = read(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "Bearer s3cr3t"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "dns:///cp"),
        ])
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS"), "{text}");
        assert!(text.contains("CONFIG_GRPC_XDS_SERVER_URL"), "{text}");
        assert!(!text.contains("s3cr3t"), "{text}");
    }

    /// Their HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED undoes the readiness of a forced start.
    #[test]
    fn forced_start_and_health_after_the_first_config() {
        let force = |vars: &[(&str, &str)]| {
            let mut all = vec![("CONFIG_TYPE", "GRPC_XDS_SOTW")];
            all.extend_from_slice(vars);
            read(&all).unwrap().document()["xds"]["force_start"].clone()
        };
        assert_eq!(force(&[("FORCE_START_WITHOUT_INITIAL_CONFIG", "true")]), true);
        assert_eq!(
            force(&[
                ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
                ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true")
            ]),
            false
        );
        assert_eq!(force(&[]), serde_json::Value::Null, "tollgate's default: not forced");
        // Without their xDS source, each xDS variable is only noted.
        let env = read(&[("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"), ("CONFIG_TYPE", "FILE")]).unwrap();
        assert!(env.document().get("xds").is_none());
        assert_eq!(
            notes_of(&env, "FORCE_START_WITHOUT_INITIAL_CONFIG"),
            ["only used with CONFIG_TYPE=GRPC_XDS_SOTW"]
        );
    }
}
