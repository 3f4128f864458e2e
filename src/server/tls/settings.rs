//! The `tls` settings section: which of tollgate's listeners serve TLS, from which files, and
//! whether they ask clients for a certificate (docs/operations.md, "TLS").

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::core::units::Seconds;

/// TLS on tollgate's listeners. A listener without its entry (`null`, the default) serves plain
/// text. The metrics-only listener (`metrics.addr`) always serves plain text.
///
/// ```yaml
/// tls:
///   grpc: {cert_file: /certs/tls.crt, key_file: /certs/tls.key, client_ca_file: /certs/ca.crt}
///   http: null
///   admin: null
///   reload_seconds: 5
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSettings {
    /// The gRPC listener (`grpc_addr`): `RateLimitService` and `grpc.health.v1` over TLS, with
    /// HTTP/2 negotiated by ALPN (`h2`).
    pub grpc: Option<ListenerTls>,
    /// The HTTP listener (`http_addr`): health, readiness and metrics over HTTPS (ALPN `h2` and
    /// `http/1.1`).
    pub http: Option<ListenerTls>,
    /// The admin listener (`admin.addr`): the bucket admin API and `/config` over HTTPS (ALPN
    /// `h2` and `http/1.1`). Its token and `Host` checks apply as without TLS.
    pub admin: Option<ListenerTls>,
    /// How often, in seconds, each listener's files are read and compared with the ones in use
    /// (at least 1): changed files are loaded for the connections that open from then on.
    pub reload_seconds: Seconds,
}

/// One listener's TLS: its certificate and key, and optionally the CA its clients'
/// certificates must chain to (mTLS). Paths are shown in `/config` and messages; the key
/// file's contents never are.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerTls {
    /// A PEM file: the listener's certificate first, then any intermediates (cert-manager's
    /// and Kubernetes' `tls.crt`). Required.
    pub cert_file: PathBuf,
    /// A PEM file: the certificate's private key, PKCS#8 (`PRIVATE KEY`), PKCS#1 (`RSA PRIVATE
    /// KEY`) or SEC1 (`EC PRIVATE KEY`). Required.
    pub key_file: PathBuf,
    /// A PEM file of one or more CA certificates (`ca.crt`). When set, every client must
    /// present a certificate that chains to one of them and is valid for client
    /// authentication; a client without one, or with one from another CA, is refused during
    /// the handshake. `null`: no client certificate is asked for.
    pub client_ca_file: Option<PathBuf>,
    /// Subject alternative names, one of which the client's certificate must carry: a DNS name
    /// (`envoy.gateway.svc`; a certificate's wildcard `*.gateway.svc` matches one label in its
    /// place), a URI (`spiffe://cluster.local/ns/gw/sa/envoy`, compared exactly) or an IP
    /// address. Empty: any certificate from `client_ca_file` is accepted. Needs
    /// `client_ca_file`.
    pub client_sans: Vec<String>,
}

impl Default for TlsSettings {
    fn default() -> Self {
        TlsSettings {
            grpc: None,
            http: None,
            admin: None,
            reload_seconds: Seconds(5),
        }
    }
}

impl TlsSettings {
    /// The listeners that have TLS, by name (`grpc`, `http`, `admin`), in that order.
    pub fn listeners(&self) -> impl Iterator<Item = (&'static str, &ListenerTls)> {
        [("grpc", &self.grpc), ("http", &self.http), ("admin", &self.admin)]
            .into_iter()
            .filter_map(|(name, tls)| tls.as_ref().map(|tls| (name, tls)))
    }

    /// Every problem of the section that needs no file read, each a sentence naming the setting
    /// (`tls.grpc.key_file`); empty when there is none. Whether the files exist and hold what
    /// they should is checked when `serve` loads them.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.reload_seconds.0 == 0 {
            problems.push("tls.reload_seconds must be at least 1".to_owned());
        }
        for (name, tls) in self.listeners() {
            problems.extend(tls.problems(name));
        }
        problems
    }
}

impl ListenerTls {
    /// The problems of `tls.<listener>`, as [`TlsSettings::problems`] reports them.
    fn problems(&self, listener: &str) -> Vec<String> {
        let mut problems = Vec::new();
        for (field, path) in [("cert_file", &self.cert_file), ("key_file", &self.key_file)] {
            if path.as_os_str().is_empty() {
                problems.push(format!(
                    "tls.{listener}.{field} must be set: tls.{listener} turns TLS on for that listener, which needs \
                     a certificate (cert_file) and its key (key_file), PEM files"
                ));
            }
        }
        if self.client_ca_file.as_ref().is_some_and(|ca| ca.as_os_str().is_empty()) {
            problems.push(format!(
                "tls.{listener}.client_ca_file is empty: give the PEM file of the CA that signs client \
                 certificates, or null for no client certificate"
            ));
        }
        if !self.client_sans.is_empty() && self.client_ca_file.is_none() {
            problems.push(format!(
                "tls.{listener}.client_sans needs tls.{listener}.client_ca_file: a client's names are \
                 checked on a certificate verified against that CA"
            ));
        }
        for san in &self.client_sans {
            if san.trim().is_empty() || san.trim() != san {
                problems.push(format!(
                    "tls.{listener}.client_sans: {san:?} is not a name (empty, or whitespace at an end)"
                ));
            } else if san.contains('*') {
                // A pattern here would make every name under it acceptable, a grant far wider
                // than it reads; a certificate's own wildcard is still honoured.
                problems.push(format!(
                    "tls.{listener}.client_sans: {san:?} is a pattern; list the exact names a client's \
                     certificate must carry (a wildcard in the certificate itself still matches)"
                ));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> ListenerTls {
        ListenerTls {
            cert_file: "/certs/tls.crt".into(),
            key_file: "/certs/tls.key".into(),
            client_ca_file: None,
            client_sans: Vec::new(),
        }
    }

    #[test]
    fn a_complete_section_has_no_problem() {
        let mut tls = TlsSettings {
            grpc: Some(listener()),
            admin: Some(listener()),
            ..TlsSettings::default()
        };
        assert_eq!(tls.problems(), Vec::<String>::new());
        let grpc = tls.grpc.as_mut().unwrap();
        grpc.client_ca_file = Some("/certs/ca.crt".into());
        grpc.client_sans = vec!["envoy".into(), "spiffe://cluster.local/ns/gw/sa/envoy".into()];
        assert_eq!(tls.problems(), Vec::<String>::new());
        let names: Vec<&str> = tls.listeners().map(|(name, _)| name).collect();
        assert_eq!(names, ["grpc", "admin"]);
    }

    #[test]
    fn every_problem_names_its_setting() {
        let tls = TlsSettings {
            grpc: Some(ListenerTls {
                client_sans: vec!["envoy".into(), " ".into(), "*.gateway.svc".into()],
                ..ListenerTls::default()
            }),
            http: Some(ListenerTls {
                client_ca_file: Some(PathBuf::new()),
                ..listener()
            }),
            admin: None,
            reload_seconds: Seconds(0),
        };
        let problems = tls.problems();
        for part in [
            "tls.reload_seconds",
            "tls.grpc.cert_file must be set",
            "tls.grpc.key_file must be set",
            "tls.grpc.client_sans needs tls.grpc.client_ca_file",
            "tls.grpc.client_sans: \" \"",
            "tls.grpc.client_sans: \"*.gateway.svc\" is a pattern",
            "tls.http.client_ca_file is empty",
        ] {
            assert!(
                problems.iter().any(|p| p.contains(part)),
                "{part} missing from {problems:#?}"
            );
        }
        assert_eq!(problems.len(), 7, "{problems:#?}");
    }
}
