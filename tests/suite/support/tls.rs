//! TLS for the tests of tollgate's TLS listeners: a CA made in the test (rcgen) that issues
//! server and client certificates, written as PEM files; rustls clients (ring) that trust the
//! CA and present a certificate or not; a tonic channel through such a client that records the
//! certificate and protocol each of its connections got; HTTPS requests over HTTP/1.1 (blocking)
//! and HTTP/2 (hyper). Every connection is a real handshake over loopback TCP.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

/// A certificate and its key, as PEM.
#[derive(Clone)]
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Identity {
    /// The certificate's DER bytes, as a peer sees them.
    pub fn der(&self) -> Vec<u8> {
        CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .expect("a PEM certificate")
            .to_vec()
    }

    /// Writes the certificate and the key to `cert` and `key`, each by a rename over the old
    /// file (as a rotation that replaces files does), key first.
    pub fn write(&self, cert: &Path, key: &Path) {
        for (path, text) in [(key, &self.key_pem), (cert, &self.cert_pem)] {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, path).unwrap();
        }
    }
}

/// A CA of the test's own.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate's validity, ending at `not_after` (Unix seconds, whole).
fn validity(params: &mut CertificateParams, not_after: i64) {
    params.not_before = time_of(unix_now() - 3_600);
    params.not_after = time_of(not_after);
}

fn time_of(unix: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(unix).expect("a valid time")
}

/// The current Unix time in seconds.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity(&mut params, unix_now() + 365 * 86_400);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Ca { issuer }
    }

    /// The CA certificate as PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for 127.0.0.1 and `localhost`, named `cn`, with `serial`, valid
    /// until `not_after` (Unix seconds).
    pub fn server(&self, cn: &str, serial: u64, not_after: i64) -> Identity {
        let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.serial_number = Some(SerialNumber::from(serial));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        validity(&mut params, not_after);
        self.issue(params)
    }

    /// A client certificate named `cn` carrying `sans` (DNS names, `spiffe://` URIs, IP
    /// addresses), for client authentication.
    pub fn client(&self, cn: &str, sans: &[&str]) -> Identity {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.subject_alt_names = sans
            .iter()
            .map(|san| {
                if let Ok(ip) = san.parse::<IpAddr>() {
                    SanType::IpAddress(ip)
                } else if san.contains("://") {
                    SanType::URI((*san).try_into().unwrap())
                } else {
                    SanType::DnsName((*san).try_into().unwrap())
                }
            })
            .collect();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        validity(&mut params, unix_now() + 86_400);
        self.issue(params)
    }

    fn issue(&self, params: CertificateParams) -> Identity {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Identity {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// The PEM files of a listener's TLS in a directory: `tls.crt`, `tls.key`, `ca.crt`.
pub struct Files {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl Files {
    /// Writes `server` and the CA `ca` into `dir`.
    pub fn write(dir: &Path, server: &Identity, ca: &Ca) -> Files {
        let files = Files {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            ca: dir.join("ca.crt"),
        };
        server.write(&files.cert, &files.key);
        std::fs::write(&files.ca, ca.pem()).unwrap();
        files
    }

    /// `{cert_file: ..., key_file: ..., client_ca_file: ...}` (the CA only with `mtls`) and
    /// `extra` fields, as a YAML flow mapping.
    pub fn yaml(&self, mtls: bool, extra: &str) -> String {
        let mut yaml = format!(
            "{{cert_file: {}, key_file: {}",
            super::yaml_str(&self.cert.to_string_lossy()),
            super::yaml_str(&self.key.to_string_lossy())
        );
        if mtls {
            yaml.push_str(&format!(
                ", client_ca_file: {}",
                super::yaml_str(&self.ca.to_string_lossy())
            ));
        }
        if !extra.is_empty() {
            yaml.push_str(", ");
            yaml.push_str(extra);
        }
        yaml.push('}');
        yaml
    }
}

/// A rustls client (ring) that trusts `ca`, presents `identity` when given, and offers `alpn`.
/// No session resumption: every connection is a full handshake and sees the server's
/// certificate.
pub fn client_config(ca: &Ca, identity: Option<&Identity>, alpn: &[&[u8]]) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
        .unwrap();
    let builder = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(id) => {
            let chain = vec![CertificateDer::from_pem_slice(id.cert_pem.as_bytes()).unwrap()];
            let key = PrivateKeyDer::from_pem_slice(id.key_pem.as_bytes()).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config.resumption = Resumption::disabled();
    Arc::new(config)
}

/// What one connection of a [`channel`] got: the server's certificate (DER) and the protocol
/// agreed by ALPN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connection {
    pub server_cert: Vec<u8>,
    pub alpn: Option<Vec<u8>>,
}

/// A tonic channel to `addr` whose connections are TLS with `config` (server name
/// `localhost`); each connection it makes is appended to `seen`.
///
/// Errors: the first connection failed (TCP, handshake, or HTTP/2).
pub async fn channel(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    seen: Arc<Mutex<Vec<Connection>>>,
) -> Result<tonic::transport::Channel, String> {
    let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let (config, seen) = (config.clone(), seen.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = ServerName::try_from("localhost").unwrap();
            let tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
            let (_, conn) = tls.get_ref();
            seen.lock().unwrap().push(Connection {
                server_cert: conn.peer_certificates().unwrap_or_default()[0].to_vec(),
                alpn: conn.alpn_protocol().map(<[u8]>::to_vec),
            });
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    tonic::transport::Endpoint::from_static("http://tollgate.test")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(connector)
        .await
        .map_err(|e| format!("{e:?}"))
}

/// One `ShouldRateLimit` of `request` on `channel`, within 5 s.
///
/// Errors: the call failed or timed out, as text.
pub async fn ask(
    channel: &tonic::transport::Channel,
    request: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest,
) -> Result<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse, String> {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let mut client = RateLimitServiceClient::new(channel.clone());
    match tokio::time::timeout(Duration::from_secs(5), client.should_rate_limit(request)).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(format!("{status:?}")),
        Err(_) => Err("no answer within 5 s".to_owned()),
    }
}

/// A new channel with `config` and one call of `request` on it: the answer, or why there was
/// none (no connection, or the call failed).
pub async fn connect_and_ask(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    request: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest,
) -> Result<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse, String> {
    let channel = channel(addr, config, Arc::default()).await?;
    ask(&channel, request).await
}

/// A blocking HTTPS/1.1 `GET path` at `addr` with `config` (which should offer `http/1.1` or
/// nothing by ALPN), `Host` the address: the status and body, or why there was none.
pub fn https_get(addr: SocketAddr, config: Arc<ClientConfig>, path: &str) -> Result<(u16, String), String> {
    let tcp = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    write!(tls, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    match tls.read_to_end(&mut response) {
        Ok(_) => {}
        // A server that closes without close_notify after a complete response.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !response.is_empty() => {}
        Err(e) => return Err(e.to_string()),
    }
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no HTTP status in {response:?}"))?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((status, body))
}

/// An HTTP/2 `GET path` at `addr` over TLS with `config` (which must offer `h2`): the protocol
/// agreed, the status and the body, or why there was none.
pub async fn h2_get(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    path: &str,
) -> Result<(Option<Vec<u8>>, u16, String), String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let request = axum::http::Request::get(format!("https://{addr}{path}"))
        .body(axum::body::Body::empty())
        .unwrap();
    let response = sender.send_request(request).await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = axum::body::to_bytes(axum::body::Body::new(response.into_body()), 1 << 20)
        .await
        .map_err(|e| e.to_string())?;
    Ok((alpn, status, String::from_utf8_lossy(&body).into_owned()))
}
