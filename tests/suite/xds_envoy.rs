//! Tollgate in the place of Envoy Gateway's rate-limit service, end to end (issue 21): a real
//! Envoy (1.40) set up as Envoy Gateway sets up its proxies, tollgate started with the
//! environment Envoy Gateway gives its rate-limit Deployment and no rules files, and the ADS
//! server of `xds_rules` standing in for Envoy Gateway's control plane. Every rule Envoy's
//! traffic meets arrived over xDS; an update pushed on the open stream changes the limit Envoy
//! enforces, nothing restarted. Envoy reaches tollgate over mutual TLS with Envoy Gateway's
//! certificates, and tollgate reaches the ADS server over mutual TLS too.
//!
//! What Envoy Gateway generates, as read in its source (envoyproxy/gateway):
//! - internal/xds/translator/ratelimit.go and testdata/out/xds-ir/ratelimit*.{listeners,routes}.yaml:
//!   one `envoy.filters.http.ratelimit` per listener, its `domain` the listener's name, with
//!   `enable_x_ratelimit_headers: DRAFT_VERSION_03`, `disable_x_envoy_ratelimited_header: true`,
//!   `failure_mode_deny` when the EnvoyGateway's `rateLimit.failClosed` is true and `timeout`
//!   when `rateLimit.timeout` is set; the rules as each route's `RateLimitPerRoute` (domain and
//!   `rate_limits`), each starting with a `generic_key` naming the route, then one action per
//!   match (`request_headers` keyed `rule-<i>-match-<j>` for a distinct header);
//! - internal/xds/translator/globalresources.go: the cluster `ratelimit_cluster`, HTTP/2, with
//!   an `UpstreamTlsContext` that presents Envoy's certificate (an SDS secret
//!   `envoy-gateway-system/envoy`), trusts `/certs/ca.crt`, caps TLS at 1.3, and sets no SNI
//!   and no subject alternative name to match;
//! - internal/crypto/certgen.go: the rate-limit service's certificate and Envoy's are both
//!   `CN=envoy`, `DNS:*.envoy-gateway-system`, without extended key usages, RSA keys in PKCS#1;
//!   the service uses its one certificate for its gRPC port and as its xDS client's;
//! - internal/infrastructure/kubernetes/ratelimit/resource.go: the Deployment's environment
//!   (`xds_rules::envoy_gateway_env`, plus `GRPC_SERVER_*` and Redis below).
//!
//! The EnvoyGateway configuration and what to check in a cluster are in docs/operations.md,
//! "Taking the place of Envoy Gateway's rate-limit service". Envoy is found by
//! `support::envoy_or_skip` (skipped without one, except under `CI=true`). Loopback only.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::task::block_in_place;

use crate::envoy_e2e::{client, get_with, start_upstream, Reply};
use crate::support::openssl::{Certs, Key};
use crate::support::redis::RedisServer;
use crate::support::{self, envoy_or_skip, http_get, tls, Envoy};
use crate::xds_rules::{config, envoy_gateway_env, eventually, listener, start_with, Ads, DOMAIN, ROUTE};

/// The extensions of the certificates Envoy Gateway issues to its rate-limit service and to
/// its Envoys (certgen.go): a wildcard name in the control plane's namespace, no extended key
/// usage.
const EG_CERT_EXT: &str = "subjectAltName=DNS:*.envoy-gateway-system\n\
    keyUsage=critical,digitalSignature,nonRepudiation,keyEncipherment,dataEncipherment\n";
/// The name of the backend cluster behind the route, as Envoy Gateway names it.
const BACKEND: &str = "httproute/default/backend/rule/0";

/// Envoy as Envoy Gateway configures it for an HTTPRoute with a BackendTrafficPolicy whose
/// global rules are those of `xds_rules::listener`: a distinct `x-user-id` header (rule 0) and,
/// behind an `x-plan: free` header, each client address within 192.168.0.0/16 (rule 1, which
/// loopback clients never meet). Static here where Envoy Gateway sends the same over xDS (the
/// route over RDS, the certificate over SDS, the cluster by DNS); `timeout` as `rateLimit.timeout:
/// 2s` sets it (the default, Envoy's 20 ms, is too short for a debug build on a busy machine).
const BOOTSTRAP: &str = r#"
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
static_resources:
  secrets:
    - name: envoy-gateway-system/envoy
      tls_certificate:
        certificate_chain: { filename: "@ENVOY_CERT@" }
        private_key: { filename: "@ENVOY_KEY@" }
  listeners:
    - name: "@DOMAIN@"
      address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
      default_filter_chain:
        filters:
          - name: envoy.filters.network.http_connection_manager
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
              stat_prefix: http-10080
              use_remote_address: true
              route_config:
                name: "@DOMAIN@"
                virtual_hosts:
                  - name: "@DOMAIN@/*"
                    domains: ["*"]
                    routes:
                      - name: "@ROUTE@"
                        match: { prefix: / }
                        route: { cluster: "@BACKEND@" }
                        typed_per_filter_config:
                          envoy.filters.http.ratelimit:
                            "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
                            domain: "@DOMAIN@"
                            rate_limits:
                              - actions:
                                  - generic_key: { descriptor_key: "@ROUTE@", descriptor_value: "@ROUTE@" }
                                  - request_headers: { descriptor_key: rule-0-match-0, header_name: x-user-id }
                              - actions:
                                  - generic_key: { descriptor_key: "@ROUTE@", descriptor_value: "@ROUTE@" }
                                  - header_value_match:
                                      descriptor_key: rule-1-match-0
                                      descriptor_value: rule-1-match-0
                                      expect_match: true
                                      headers: [ { name: x-plan, string_match: { exact: free } } ]
                                  - remote_address_match:
                                      address_matcher: { ranges: [ { address_prefix: 192.168.0.0, prefix_len: 16 } ] }
                                      descriptor_key: masked_remote_address
                                      descriptor_value: 192.168.0.0/16
                                  - remote_address_match:
                                      address_matcher: { ranges: [ { address_prefix: 192.168.0.0, prefix_len: 16 } ] }
                                      descriptor_key: remote_address
                                      descriptor_value: "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"
              http_filters:
                - name: envoy.filters.http.ratelimit
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                    domain: "@DOMAIN@"
                    timeout: 2s
                    failure_mode_deny: true
                    enable_x_ratelimit_headers: DRAFT_VERSION_03
                    disable_x_envoy_ratelimited_header: true
                    rate_limit_service:
                      transport_api_version: V3
                      grpc_service: { envoy_grpc: { cluster_name: ratelimit_cluster } }
                - name: envoy.filters.http.router
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
                    suppress_envoy_headers: true
  clusters:
    - name: "@BACKEND@"
      type: STATIC
      connect_timeout: 10s
      load_assignment:
        cluster_name: "@BACKEND@"
        endpoints:
          - lb_endpoints:
              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: @UPSTREAM_PORT@ } } }
    - name: ratelimit_cluster
      type: STATIC
      connect_timeout: 10s
      load_assignment:
        cluster_name: ratelimit_cluster
        endpoints:
          - lb_endpoints:
              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: @RATELIMIT_PORT@ } } }
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          common_tls_context:
            tls_params: { tls_maximum_protocol_version: TLSv1_3 }
            tls_certificate_sds_secret_configs: [ { name: envoy-gateway-system/envoy } ]
            validation_context:
              trusted_ca: { filename: "@CA@" }
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: { initial_connection_window_size: 1048576, initial_stream_window_size: 65536 }
"#;

fn bootstrap(certs: &Certs, upstream: SocketAddr, tollgate: SocketAddr) -> String {
    let file = |name: &str| certs.path(name).to_string_lossy().into_owned();
    BOOTSTRAP
        .replace("@DOMAIN@", DOMAIN)
        .replace("@ROUTE@", ROUTE)
        .replace("@BACKEND@", BACKEND)
        .replace("@UPSTREAM_PORT@", &upstream.port().to_string())
        .replace("@RATELIMIT_PORT@", &tollgate.port().to_string())
        .replace("@ENVOY_CERT@", &file("envoy.crt"))
        .replace("@ENVOY_KEY@", &file("envoy.key"))
        .replace("@CA@", &file("ca.crt"))
}

/// The rate-limit Deployment's environment as Envoy Gateway writes it (resource.go), pointed at
/// `ads`, the certificates of `certs` and a Redis on `redis_port`: the xDS client as in
/// `envoy_gateway_env`, but with the service's one certificate (`tls.crt`) as Envoy Gateway
/// mounts it at `/certs`, and the gRPC port serving TLS to Envoys with certificates from the CA.
fn deployment_env(ads: SocketAddr, certs: &Certs, redis_port: u16) -> Vec<(String, String)> {
    let file = |name: &str| certs.path(name).to_string_lossy().into_owned();
    let mut env = envoy_gateway_env(&ads.to_string(), certs, true);
    for (key, value) in env.iter_mut() {
        match key.as_str() {
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT" => *value = file("tls.crt"),
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY" => *value = file("tls.key"),
            _ => {}
        }
    }
    env.extend(
        [
            ("GRPC_SERVER_USE_TLS", "true".to_owned()),
            ("GRPC_SERVER_TLS_CERT", file("tls.crt")),
            ("GRPC_SERVER_TLS_KEY", file("tls.key")),
            ("GRPC_SERVER_TLS_CA_CERT", file("ca.crt")),
            ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
            ("REDIS_URL", format!("127.0.0.1:{redis_port}")),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    env
}

/// A 200 from the upstream with Envoy's DRAFT_VERSION_03 headers for a bucket of `limit` a
/// minute with `remaining` left, full again in `full_in_us` less the time since the first
/// decision (at most `reply.at`).
fn assert_admitted(reply: &Reply, limit: u64, remaining: u64, full_in_us: u64) {
    assert_eq!(reply.status, 200, "{}", reply.dump());
    assert_eq!(reply.header("x-upstream"), Some("yes"), "{}", reply.dump());
    assert_limit_headers(reply, limit, remaining, full_in_us);
}

fn assert_limit_headers(reply: &Reply, limit: u64, remaining: u64, full_in_us: u64) {
    // No `;name=...`: a rule without a name sends none, as envoyproxy/ratelimit's.
    let quota = format!("{limit}, {limit};w=60");
    assert_eq!(reply.required("x-ratelimit-limit"), quota, "{}", reply.dump());
    assert_eq!(reply.number("x-ratelimit-remaining"), remaining, "{}", reply.dump());
    // Envoy writes the whole seconds of `duration_until_reset`, which tollgate rounds up; the
    // time since the first decision only shortens it.
    let reset = reply.number("x-ratelimit-reset");
    let elapsed_us = u64::try_from(reply.at.as_micros()).unwrap();
    let expected = full_in_us.saturating_sub(elapsed_us).div_ceil(1_000_000)..=full_in_us.div_ceil(1_000_000);
    assert!(
        expected.contains(&reset),
        "reset {reset}, expected {expected:?}:\n{}",
        reply.dump()
    );
}

/// A 429 that Envoy answered itself, without Envoy's own `x-envoy-ratelimited` (Envoy Gateway
/// turns it off).
fn assert_denied(reply: &Reply, limit: u64, full_in_us: u64) {
    assert_eq!(reply.status, 429, "{}", reply.dump());
    assert_eq!(reply.header("x-upstream"), None);
    assert_eq!(reply.header("x-envoy-ratelimited"), None, "{}", reply.dump());
    assert_limit_headers(reply, limit, 0, full_in_us);
}

/// The value of the sample `series` (name and labels, as exposed) on tollgate's `/metrics`.
fn sample(tollgate: &support::Tollgate, series: &str) -> Option<f64> {
    // Their series are exported too in their environment, which the strict `Scrape` refuses.
    let (_, metrics) = http_get(tollgate.http_addr, "/metrics").expect("/metrics answers");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Checks a server's certificate as Envoy Gateway's Envoys do: it must chain to the CA, and its
/// names are not looked at (Envoy Gateway sets no SNI and no name to match, and its wildcard
/// `*.envoy-gateway-system` is one webpki never matches).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the name last, once the chain and validity have passed.
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A `ShouldRateLimit` on a new TLS connection to tollgate's gRPC port, checking its
/// certificate as Envoy does and presenting the certificate `client` (`envoy` for Envoy's) or
/// none: the answer's code, or why there was none.
async fn ask_over_tls(certs: &Certs, grpc: SocketAddr, client: Option<&str>) -> Result<Code, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(&certs.read("ca.crt")).unwrap())
        .unwrap();
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .unwrap();
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ChainOnly(verifier)));
    let mut config = match client {
        Some(name) => {
            let chain = vec![CertificateDer::from_pem_slice(&certs.read(&format!("{name}.crt"))).unwrap()];
            let key = PrivateKeyDer::from_pem_slice(&certs.read(&format!("{name}.key"))).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let descriptor = [(ROUTE, ROUTE), ("rule-0-match-0", "grpc-client")];
    let request = support::request(DOMAIN, &descriptor, 0);
    let answer = tls::connect_and_ask(grpc, Arc::new(config), request).await?;
    Ok(Code::try_from(answer.overall_code).unwrap())
}

/// Acceptance point 2 of issue 21.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_set_up_as_envoy_gateway_does_enforces_rules_pushed_over_xds() {
    let Some(envoy_bin) = envoy_or_skip("envoy_set_up_as_envoy_gateway_does_enforces_rules_pushed_over_xds") else {
        return;
    };
    let certs = block_in_place(|| {
        let certs = Certs::make();
        certs.issue("tls", "envoy", EG_CERT_EXT, Key::RsaPkcs1, None);
        certs.issue("envoy", "envoy", EG_CERT_EXT, Key::RsaPkcs1, None);
        certs
    });
    let ads = Ads::default();
    let ads_addr = ads.serve(Some(certs.server())).await;
    let redis = block_in_place(RedisServer::start);
    let tollgate = block_in_place(|| start_with(&deployment_env(ads_addr, &certs, redis.port())));
    let subscription = ads.request(1).await.request;
    assert_eq!(subscription.node.map(|n| n.id).as_deref(), Some("envoy-ratelimit"));
    let upstream = start_upstream().await;
    let envoy = block_in_place(|| Envoy::start(&envoy_bin, &bootstrap(&certs, upstream, tollgate.grpc_addr)));
    let url = format!("http://{}/", envoy.listener(DOMAIN));
    let http = client();
    let alice = [("x-user-id", "alice")];

    // Before the first rules: started forced, as Envoy Gateway starts it, tollgate limits
    // nothing, and its answer reaches Envoy (with `failure_mode_deny`, no answer would be a 500).
    let before = get_with(&http, &url, &alice, Instant::now()).await;
    assert_eq!(before.status, 200, "{}", before.dump());
    assert_eq!(before.header("x-ratelimit-limit"), None, "{}", before.dump());

    // Envoy Gateway's first snapshot (its versions count up from 1): 3 a minute per user.
    let nonce = ads.push("1", &[listener(3)]);
    let ack = ads.request(2).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("1", nonce.as_str())
    );
    assert!(ack.error_detail.is_none(), "{ack:?}");
    // One token every 20 s: after k requests the bucket is full again in k * 20 s.
    let token_us = 20_000_000;
    let start = Instant::now();
    for k in 1..=3 {
        let reply = get_with(&http, &url, &alice, start).await;
        assert_admitted(&reply, 3, 3 - k, k * token_us);
    }
    let denied = get_with(&http, &url, &alice, start).await;
    assert_denied(&denied, 3, 3 * token_us);
    let bob = get_with(&http, &url, &[("x-user-id", "bob")], start).await;
    assert_admitted(&bob, 3, 2, token_us);

    // An update on the same stream, nothing restarted: 6 a minute.
    let nonce = ads.push("2", &[listener(6)]);
    let ack = ads.request(3).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("2", nonce.as_str())
    );
    assert!(ack.error_detail.is_none(), "{ack:?}");
    assert_eq!(block_in_place(|| config(&tollgate))["rules_source"]["version"], "2");
    let token_us = 10_000_000;
    let start = Instant::now();
    let carol = [("x-user-id", "carol")];
    for k in 1..=6 {
        let reply = get_with(&http, &url, &carol, start).await;
        assert_admitted(&reply, 6, 6 - k, k * token_us);
    }
    let denied = get_with(&http, &url, &carol, start).await;
    assert_denied(&denied, 6, 6 * token_us);

    // Every decision came from tollgate over TLS: none failed, none was let through for want
    // of an answer.
    let stat = |name: &str| block_in_place(|| envoy.stat(name));
    let ratelimit = |what: &str| stat(&format!("cluster.{BACKEND}.ratelimit.{what}"));
    assert_eq!((ratelimit("ok"), ratelimit("over_limit")), (11, 2));
    assert_eq!((ratelimit("error"), ratelimit("failure_mode_allowed")), (0, 0));
    assert!(stat("cluster.ratelimit_cluster.ssl.handshake") >= 1);
    assert_eq!(stat("cluster.ratelimit_cluster.ssl.connection_error"), 0);
    let failures = r#"tollgate_tls_handshake_failures_total{listener="grpc"}"#;
    assert_eq!(block_in_place(|| sample(&tollgate, failures)).unwrap_or(0.0), 0.0);
    let acks = r#"tollgate_xds_updates_total{result="ack"}"#;
    assert_eq!(block_in_place(|| sample(&tollgate, acks)), Some(2.0));
    assert_eq!(
        block_in_place(|| sample(&tollgate, "tollgate_xds_connected")),
        Some(1.0)
    );

    // The TLS is mutual: with Envoy's certificate a client is answered, without one refused.
    assert_eq!(
        ask_over_tls(&certs, tollgate.grpc_addr, Some("envoy")).await,
        Ok(Code::Ok)
    );
    let refused = ask_over_tls(&certs, tollgate.grpc_addr, None).await;
    assert!(refused.is_err(), "{refused:?}");
    // At least one: the channel may try again once the first connection is refused.
    eventually("tollgate counts the refused handshake", || {
        block_in_place(|| sample(&tollgate, failures)).is_some_and(|n| n >= 1.0)
    })
    .await;
}
