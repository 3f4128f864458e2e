//! Rules from an xDS server (`rules_source: xds`, docs/operations.md): tollgate against an ADS
//! server written here (tonic and envoy-types), standing in for Envoy Gateway's control plane:
//! it records every request tollgate sends (version, nonce, error detail, node, headers) and
//! pushes Envoy Gateway-shaped snapshots. Each step is checked on the gRPC port, where Envoy
//! asks: the rules of an update in force, an invalid update NACKed with its reason while the
//! rules before it stay, a dropped stream resumed from the version in force. Then Envoy
//! Gateway's environment: mutual TLS, and a server that cannot be reached (not ready, saying
//! why; forced, ready with nothing limited). Loopback only.

use std::net::SocketAddr;
use std::pin::Pin;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use futures_util::Stream;
use prost::Message;
use tokio::sync::mpsc;
use tokio::task::block_in_place;
use tonic::transport::{Channel, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::support::openssl::{Certs, Key};
use crate::support::{self, free_port, http_get, Scrape, Tollgate};

pub(crate) const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";
/// Envoy Gateway's names: a listener's domain, a route (its host name `*`), a shared policy.
pub(crate) const DOMAIN: &str = "envoy-gateway/gateway-1/http";
/// The route's descriptor, first in each of its rules (key and value alike).
pub(crate) const ROUTE: &str = "httproute/default/backend/rule/0/match/0/*";
pub(crate) const SHARED: &str = "default/shared-policy";
/// How long anything may take to happen.
pub(crate) const PATIENCE: Duration = Duration::from_secs(15);

/// One request tollgate sent, with the stream it came on (1, 2, ...), that stream's metadata,
/// and the client certificate (DER) its connection presented, over TLS.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) stream: usize,
    pub(crate) request: DiscoveryRequest,
    headers: Vec<(String, String)>,
    pub(crate) client_cert: Option<Vec<u8>>,
}

/// The ADS server's record, and the way to the stream open now.
#[derive(Default)]
struct Record {
    requests: Vec<Seen>,
    streams: usize,
    /// Sends on the stream open now (`None` once dropped).
    current: Option<mpsc::UnboundedSender<Result<DiscoveryResponse, Status>>>,
    nonces: usize,
    /// The last response sent, for the behaviours below.
    last: Option<DiscoveryResponse>,
    /// What the server does when a request NACKs.
    on_nack: OnNack,
    /// Whether a new stream gets the last response at once, whatever version it asks from.
    resend_on_open: bool,
}

/// What a control plane does with a NACK.
#[derive(Clone, Copy, Default, PartialEq)]
pub(crate) enum OnNack {
    /// Nothing: it waits for a new snapshot (Envoy Gateway's own translator).
    #[default]
    Wait,
    /// Sends its snapshot again at once, with a new nonce: go-control-plane's snapshot cache
    /// answers every request whose version is not its snapshot's.
    Resend,
    /// Ends the stream.
    Drop,
}

impl Record {
    /// Sends `response` on the stream open now, under a new nonce; returns the nonce.
    fn send(&mut self, mut response: DiscoveryResponse) -> String {
        self.nonces += 1;
        response.nonce = format!("nonce-{}", self.nonces);
        let nonce = response.nonce.clone();
        self.last = Some(response.clone());
        self.current
            .as_ref()
            .expect("a stream is open")
            .send(Ok(response))
            .unwrap();
        nonce
    }
}

/// The ADS server: a state-of-the-world stream per connection, fed by the test.
#[derive(Clone, Default)]
pub(crate) struct Ads(Arc<Mutex<Record>>);

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;
type DeltaStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream;
    type DeltaAggregatedResourcesStream = DeltaStream;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let headers = request
            .metadata()
            .iter()
            .filter_map(|kv| match kv {
                tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                    Some((k.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned()))
                }
                tonic::metadata::KeyAndValueRef::Binary(..) => None,
            })
            .collect::<Vec<_>>();
        let client_cert = request.peer_certs().and_then(|certs| certs.first().map(|c| c.to_vec()));
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = {
            let mut record = self.0.lock().unwrap();
            record.streams += 1;
            record.current = Some(tx);
            if let Some(last) = record.last.clone().filter(|_| record.resend_on_open) {
                record.send(last);
            }
            record.streams
        };
        let mut incoming = request.into_inner();
        let record = self.0.clone();
        tokio::spawn(async move {
            while let Ok(Some(request)) = incoming.message().await {
                let nack = request.error_detail.is_some();
                let mut record = record.lock().unwrap();
                record.requests.push(Seen {
                    stream,
                    request,
                    headers: headers.clone(),
                    client_cert: client_cert.clone(),
                });
                match record.on_nack {
                    OnNack::Resend if nack => {
                        let last = record.last.clone().expect("a NACK answers a response");
                        record.send(last);
                    }
                    OnNack::Drop if nack => {
                        if let Some(tx) = record.current.take() {
                            let _ = tx.send(Err(Status::unavailable("refused; closing")));
                        }
                    }
                    _ => {}
                }
            }
        });
        let responses = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
        Ok(Response::new(Box::pin(responses)))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<DeltaStream>, Status> {
        Err(Status::unimplemented("state of the world only"))
    }
}

impl Ads {
    /// Serves on a free loopback port (with `tls`, requiring a client certificate); returns the
    /// address.
    pub(crate) async fn serve(&self, tls: Option<ServerTlsConfig>) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let mut builder = Server::builder();
        if let Some(tls) = tls {
            builder = builder.tls_config(tls).unwrap();
        }
        let router = builder.add_service(AggregatedDiscoveryServiceServer::new(self.clone()));
        tokio::spawn(router.serve_with_incoming(incoming));
        addr
    }

    /// Pushes a snapshot of `configs` as `version` on the stream open now; returns its nonce.
    pub(crate) fn push(&self, version: &str, configs: &[RateLimitConfig]) -> String {
        let response = DiscoveryResponse {
            version_info: version.into(),
            resources: configs
                .iter()
                .map(|c| Any {
                    type_url: TYPE_URL.into(),
                    value: c.encode_to_vec(),
                })
                .collect(),
            type_url: TYPE_URL.into(),
            ..Default::default()
        };
        self.0.lock().unwrap().send(response)
    }

    /// Sends `response` as it is (but for its nonce) on the stream open now; returns the nonce.
    pub(crate) fn send(&self, response: DiscoveryResponse) -> String {
        self.0.lock().unwrap().send(response)
    }

    /// Sets what the server does with a NACK, and whether a new stream gets the last response
    /// at once.
    pub(crate) fn behave(&self, on_nack: OnNack, resend_on_open: bool) {
        let mut record = self.0.lock().unwrap();
        record.on_nack = on_nack;
        record.resend_on_open = resend_on_open;
    }

    /// The streams opened so far.
    pub(crate) fn streams(&self) -> usize {
        self.0.lock().unwrap().streams
    }

    /// Ends the stream open now with an error, as a control plane that restarts does.
    pub(crate) fn drop_stream(&self) {
        let tx = self.0.lock().unwrap().current.take().expect("a stream is open");
        let _ = tx.send(Err(Status::unavailable("control plane restarting")));
    }

    /// Waits until tollgate has sent `n` requests in all; returns the `n`-th.
    pub(crate) async fn request(&self, n: usize) -> Seen {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(seen) = self.0.lock().unwrap().requests.get(n - 1) {
                return seen.clone();
            }
            assert!(Instant::now() < deadline, "request {n} never came");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub(crate) fn requests(&self) -> usize {
        self.0.lock().unwrap().requests.len()
    }
}

pub(crate) fn node(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        ..Default::default()
    }
}

pub(crate) fn limit(mut d: RateLimitDescriptor, unit: RateLimitUnit, requests_per_unit: u32) -> RateLimitDescriptor {
    d.rate_limit = Some(RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit,
        ..Default::default()
    });
    d
}

pub(crate) fn under(mut d: RateLimitDescriptor, children: Vec<RateLimitDescriptor>) -> RateLimitDescriptor {
    d.descriptors = children;
    d
}

/// What Envoy Gateway pushes for a route with two global rules: per value of a header
/// (`rule-0-match-0`, key only), and per client address within 192.168.0.0/16 behind a
/// header match; `per_header` requests a minute for the first.
pub(crate) fn listener(per_header: u32) -> RateLimitConfig {
    RateLimitConfig {
        name: DOMAIN.into(),
        domain: DOMAIN.into(),
        descriptors: vec![under(
            node(ROUTE, ROUTE),
            vec![
                limit(node("rule-0-match-0", ""), RateLimitUnit::Minute, per_header),
                under(
                    node("rule-1-match-0", "rule-1-match-0"),
                    vec![under(
                        node("masked_remote_address", "192.168.0.0/16"),
                        vec![limit(node("remote_address", ""), RateLimitUnit::Hour, 1)],
                    )],
                ),
            ],
        )],
    }
}

/// A shared policy's domain: one bucket for every route it applies to.
pub(crate) fn shared(requests_per_unit: u32) -> RateLimitConfig {
    let key = format!("{SHARED}/rule/0");
    RateLimitConfig {
        name: SHARED.into(),
        domain: SHARED.into(),
        descriptors: vec![under(
            node(&key, &key),
            vec![limit(
                node("rule-0-match-0", "rule-0-match-0"),
                RateLimitUnit::Day,
                requests_per_unit,
            )],
        )],
    }
}

pub(crate) async fn client(tollgate: &Tollgate) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect to tollgate")
}

/// `ShouldRateLimit` for the descriptor Envoy sends under `DOMAIN`'s route with these entries
/// after the route's own: the overall code, or the gRPC error's code.
pub(crate) async fn ask(
    c: &mut RateLimitServiceClient<Channel>,
    domain: &str,
    entries: &[(&str, &str)],
) -> Result<Code, tonic::Code> {
    let first = if domain == DOMAIN {
        (ROUTE.to_owned(), ROUTE.to_owned())
    } else {
        let key = format!("{SHARED}/rule/0");
        (key.clone(), key)
    };
    let mut all = vec![(first.0.as_str(), first.1.as_str())];
    all.extend_from_slice(entries);
    ask_in(c, domain, &all).await
}

/// One request of one descriptor of exactly `entries` to `domain`: its overall code, or the
/// gRPC error.
pub(crate) async fn ask_in(
    c: &mut RateLimitServiceClient<Channel>,
    domain: &str,
    entries: &[(&str, &str)],
) -> Result<Code, tonic::Code> {
    match c.should_rate_limit(support::request(domain, entries, 0)).await {
        Ok(r) => Ok(Code::try_from(r.into_inner().overall_code).unwrap()),
        Err(status) => Err(status.code()),
    }
}

/// `n` requests for one header value: their codes.
pub(crate) async fn hits(c: &mut RateLimitServiceClient<Channel>, value: &str, n: usize) -> Vec<Code> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(ask(c, DOMAIN, &[("rule-0-match-0", value)]).await.unwrap());
    }
    out
}

pub(crate) fn readyz(tollgate: &Tollgate) -> (u16, String) {
    http_get(tollgate.http_addr, "/readyz").expect("/readyz answers")
}

/// `/config`, parsed; panics unless it answers 200.
pub(crate) fn config(tollgate: &Tollgate) -> serde_json::Value {
    let (status, body) = tollgate.config().expect("/config answers");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Waits until `check` holds, or panics with `what`.
pub(crate) async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !check() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) const OK: Code = Code::Ok;
pub(crate) const OVER: Code = Code::OverLimit;

/// Acceptance: snapshots applied, an update applied, an invalid one NACKed with its reason while
/// the rules before it are enforced, and a dropped stream reconnected and resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_apply_an_invalid_one_is_nacked_and_a_dropped_stream_resumes() {
    let ads = Ads::default();
    let addr = ads.serve(None).await;
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .settings(&format!(
                "rules_source: xds\nxds:\n  server_url: {addr}\n  node_id: envoy-ratelimit\n  node_metadata: {{cluster: tollgate-test}}\n  headers: {{x-tenant: team-a, authorization: Bearer s3cr3t}}\n  backoff: {{initial_ms: 50, max_ms: 200}}\n"
            ))
            .start()
    });
    let mut c = client(&tollgate).await;

    // The subscription: every RateLimitConfig for node envoy-ratelimit, from no version.
    let first = ads.request(1).await;
    assert_eq!(first.stream, 1);
    let r = &first.request;
    assert_eq!(
        (r.type_url.as_str(), r.version_info.as_str(), r.response_nonce.as_str()),
        (TYPE_URL, "", "")
    );
    assert!(r.resource_names.is_empty() && r.error_detail.is_none());
    let node = r.node.as_ref().expect("the node");
    assert_eq!(node.id, "envoy-ratelimit");
    let cluster = &node.metadata.as_ref().unwrap().fields["cluster"];
    assert_eq!(cluster.kind, Some(Kind::StringValue("tollgate-test".into())));
    for header in [("x-tenant", "team-a"), ("authorization", "Bearer s3cr3t")] {
        assert!(
            first.headers.contains(&(header.0.to_owned(), header.1.to_owned())),
            "{header:?} in {:?}",
            first.headers
        );
    }
    // No rules yet: not ready, and no decision (Envoy's failure_mode_deny decides).
    let (status, body) = block_in_place(|| readyz(&tollgate));
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no rules received from the xDS server yet"), "{body}");
    assert!(
        !body.contains(&addr.to_string()),
        "no address on the public port: {body}"
    );
    assert_eq!(
        ask(&mut c, DOMAIN, &[("rule-0-match-0", "a")]).await,
        Err(tonic::Code::Unavailable)
    );

    // v1: applied and ACKed; 2 a minute per header value, each value its own bucket.
    let nonce = ads.push("v1", &[listener(2)]);
    let ack = ads.request(2).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("v1", nonce.as_str())
    );
    assert!(ack.error_detail.is_none(), "{ack:?}");
    assert_eq!(hits(&mut c, "alice", 3).await, [OK, OK, OVER]);
    assert_eq!(hits(&mut c, "bob", 1).await, [OK]);
    let address = [
        ("rule-1-match-0", "rule-1-match-0"),
        ("masked_remote_address", "192.168.0.0/16"),
        ("remote_address", "192.168.1.7"),
    ];
    assert_eq!(ask(&mut c, DOMAIN, &address).await, Ok(OK));
    assert_eq!(ask(&mut c, DOMAIN, &address).await, Ok(OVER), "one an hour per address");
    assert_eq!(
        ask(&mut c, SHARED, &[("rule-0-match-0", "rule-0-match-0")]).await,
        Ok(OK),
        "no such domain yet"
    );
    assert_eq!(block_in_place(|| readyz(&tollgate)).0, 200);

    // v2: an update (3 a minute, and a shared policy's domain), applied and ACKed.
    let nonce = ads.push("v2", &[shared(1), listener(3)]);
    let ack = ads.request(3).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("v2", nonce.as_str())
    );
    assert!(ack.error_detail.is_none());
    assert_eq!(hits(&mut c, "carol", 4).await, [OK, OK, OK, OVER]);
    let shared_hit = [("rule-0-match-0", "rule-0-match-0")];
    assert_eq!(ask(&mut c, SHARED, &shared_hit).await, Ok(OK));
    assert_eq!(ask(&mut c, SHARED, &shared_hit).await, Ok(OVER));

    // v3: invalid (a limit without a unit): NACKed with the version in force and the reason;
    // v2 stays enforced.
    let mut bad = listener(100);
    bad.descriptors[0].descriptors[0].rate_limit.as_mut().unwrap().unit = RateLimitUnit::Unknown as i32;
    let nonce = ads.push("v3", &[shared(1), bad]);
    let nack = ads.request(4).await.request;
    assert_eq!(
        (nack.version_info.as_str(), nack.response_nonce.as_str()),
        ("v2", nonce.as_str())
    );
    let detail = nack.error_detail.expect("a NACK says why");
    assert_eq!(detail.code, 3, "INVALID_ARGUMENT");
    let rule = format!("xds:{DOMAIN}: rule `{ROUTE}={ROUTE}.rule-0-match-0`: `rate_limit` needs `unit`");
    assert!(detail.message.contains(&rule), "{}", detail.message);
    assert_eq!(hits(&mut c, "dave", 4).await, [OK, OK, OK, OVER], "v2's 3 a minute");
    assert_eq!(ask(&mut c, SHARED, &shared_hit).await, Ok(OVER));
    let shown = block_in_place(|| config(&tollgate));
    let source = &shown["rules_source"];
    assert_eq!(source["kind"], "xds");
    assert_eq!(source["server"], addr.to_string());
    assert_eq!(source["node"], "envoy-ratelimit");
    assert_eq!(source["version"], "v2");
    assert_eq!(source["connected"], true);
    assert_eq!(source["last_ack"]["version"], "v2");
    assert_eq!(source["last_nack"]["version"], "v3");
    assert!(
        source["last_nack"]["reason"].as_str().unwrap().contains(&rule),
        "{source}"
    );
    assert_eq!(shown["reload"]["last_reload_failed"], true);
    assert_eq!(shown["generation"], 2);
    assert_eq!(shown["settings"]["xds"]["headers"]["authorization"], "<redacted>");
    assert!(!shown.to_string().contains("s3cr3t"), "the headers' values are secrets");
    let scrape = block_in_place(|| Scrape::from(tollgate.http_addr));
    assert_eq!(
        scrape.get("tollgate_xds_updates_total", &[("result", "ack")]),
        Some(2.0)
    );
    assert_eq!(
        scrape.get("tollgate_xds_updates_total", &[("result", "nack")]),
        Some(1.0)
    );
    assert_eq!(scrape.get("tollgate_xds_connected", &[]), Some(1.0));
    assert_eq!(
        scrape.get("tollgate_rules_reloads_total", &[("result", "failure")]),
        Some(1.0)
    );
    assert_eq!(scrape.get("tollgate_rules_last_reload_successful", &[]), Some(0.0));
    assert_eq!(scrape.get("tollgate_rules_generation", &[]), Some(2.0));

    // The stream drops: tollgate opens another and resumes from v2, enforcing v2 meanwhile.
    ads.drop_stream();
    let resumed = ads.request(5).await;
    assert_eq!(resumed.stream, 2);
    let r = &resumed.request;
    assert_eq!((r.version_info.as_str(), r.response_nonce.as_str()), ("v2", ""));
    assert!(r.error_detail.is_none());
    assert_eq!(r.node.as_ref().map(|n| n.id.as_str()), Some("envoy-ratelimit"));
    assert!(resumed.headers.contains(&("x-tenant".to_owned(), "team-a".to_owned())));
    assert_eq!(hits(&mut c, "erin", 4).await, [OK, OK, OK, OVER]);
    assert_eq!(
        block_in_place(|| readyz(&tollgate)).0,
        200,
        "the rules in force stay ready"
    );
    // A snapshot on the new stream is applied: the previous bucket state carries on.
    let nonce = ads.push("v4", &[listener(5)]);
    let ack = ads.request(6).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("v4", nonce.as_str())
    );
    assert!(ack.error_detail.is_none());
    assert_eq!(hits(&mut c, "frank", 6).await, [OK, OK, OK, OK, OK, OVER]);
    assert_eq!(
        ask(&mut c, SHARED, &shared_hit).await,
        Ok(OK),
        "v4 has no shared domain"
    );
    let shown = block_in_place(|| config(&tollgate));
    assert_eq!(shown["reload"]["last_reload_failed"], false);
    assert_eq!(shown["rules_source"]["version"], "v4");
    assert_eq!(
        shown["rules_source"]["last_nack"]["version"], "v3",
        "the last NACK is still shown"
    );
    let scrape = block_in_place(|| Scrape::from(tollgate.http_addr));
    assert_eq!(
        scrape.get("tollgate_xds_updates_total", &[("result", "ack")]),
        Some(3.0)
    );
    assert_eq!(scrape.get("tollgate_xds_connected", &[]), Some(1.0));

    // The same snapshot again (a new version of the same rules): ACKed, nothing swapped.
    let nonce = ads.push("v5", &[listener(5)]);
    let ack = ads.request(7).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("v5", nonce.as_str())
    );
    let shown = block_in_place(|| config(&tollgate));
    assert_eq!(
        (shown["generation"].as_u64(), shown["rules_source"]["version"].as_str()),
        (Some(3), Some("v5")),
        "v1, v2 and v4 were swapped in, v5 was not"
    );
    assert_eq!(hits(&mut c, "frank", 1).await, [OVER], "still over");
    let log = tollgate.process.log();
    assert!(log.contains("rules from the xDS server rejected"), "{log}");
    assert!(!log.contains("s3cr3t"), "the headers' values are never logged");
    assert_eq!(ads.requests(), 7, "one request per response, none more");
}

/// Envoy Gateway's xDS variables, pointed at `server` with the certificates of `certs`, as
/// `tollgate serve` reads them. (It also sets `GRPC_SERVER_USE_TLS` for tollgate's own gRPC
/// port, which is not part of the xDS client.)
pub(crate) fn envoy_gateway_env(server: &str, certs: &Certs, force_start: bool) -> Vec<(String, String)> {
    let file = |name: &str| certs.path(name).to_string_lossy().into_owned();
    let mut env: Vec<(String, String)> = [
        ("RUNTIME_ROOT", "/data".to_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_owned()),
        ("RUNTIME_WATCH_ROOT", "false".to_owned()),
        ("LOG_LEVEL", "info".to_owned()),
        ("USE_STATSD", "false".to_owned()),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_owned()),
        ("CONFIG_GRPC_XDS_SERVER_URL", server.to_owned()),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".to_owned()),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".to_owned()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", file("client.crt")),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", file("client.key")),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", file("ca.crt")),
        // The server is reached by address here, while its certificate names xds.test.
        ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "xds.test".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    if force_start {
        env.push(("FORCE_START_WITHOUT_INITIAL_CONFIG".to_owned(), "true".to_owned()));
    }
    env
}

/// Starts tollgate with `env` and a short xDS backoff.
pub(crate) fn start_with(env: &[(String, String)]) -> Tollgate {
    env.iter()
        .fold(Tollgate::builder(), |b, (k, v)| b.env(k, v))
        .settings("xds: {backoff: {initial_ms: 50, max_ms: 500}}")
        .start()
}

/// Envoy Gateway's environment over mutual TLS: tollgate presents its client certificate,
/// checks the server's against the CA and the SAN, and takes the rules it pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateways_environment_takes_rules_over_mutual_tls() {
    let certs = block_in_place(Certs::make);
    let ads = Ads::default();
    let addr = ads.serve(Some(certs.server())).await;
    let env = envoy_gateway_env(&addr.to_string(), &certs, true);
    let tollgate = block_in_place(|| start_with(&env));
    let first = ads.request(1).await.request;
    assert_eq!(first.node.map(|n| n.id), Some("envoy-ratelimit".to_owned()));
    let nonce = ads.push("1", &[listener(1)]);
    let ack = ads.request(2).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("1", nonce.as_str())
    );
    assert!(ack.error_detail.is_none());
    let mut c = client(&tollgate).await;
    assert_eq!(hits(&mut c, "alice", 2).await, [OK, OVER]);
    let shown = block_in_place(|| config(&tollgate));
    assert_eq!(shown["rules_source"]["tls"], true);
    assert_eq!(shown["settings"]["rules_source"], "xds");

    // An invalid update is NACKed: envoyproxy/ratelimit's config-load counters (their names are
    // on with their environment) count the update in force and the refused one.
    let mut bad = listener(1);
    bad.descriptors[0].descriptors[0].rate_limit.as_mut().unwrap().unit = RateLimitUnit::Unknown as i32;
    ads.push("2", &[bad]);
    let nack = ads.request(3).await.request;
    assert!(nack.error_detail.is_some(), "{nack:?}");
    let text = block_in_place(|| http_get(tollgate.http_addr, "/metrics")).unwrap().1;
    for (series, count) in [
        ("ratelimit_service_config_load_success", 1),
        ("ratelimit_service_config_load_error", 1),
    ] {
        assert!(
            text.lines().any(|l| l == format!("{series} {count}")),
            "{series} {count}:\n{text}"
        );
    }

    // A client without the CA's certificate is refused by the server: the TLS is mutual.
    let mut refused = env.clone();
    refused.retain(|(k, _)| !k.starts_with("CONFIG_GRPC_XDS_CLIENT_TLS"));
    let stranger = block_in_place(|| start_with(&refused));
    let log_has = |t: &Tollgate, text: &str| t.process.log().contains(text);
    eventually("the stranger logs its failed connection", || {
        log_has(&stranger, "no rules received from xDS server")
    })
    .await;
    let shown = block_in_place(|| config(&stranger));
    let source = &shown["rules_source"];
    assert!(
        source["last_error"]["error"].as_str().is_some() && source["version"].is_null(),
        "the refused connection is the last error: {source}"
    );
    assert_eq!(
        ads.0.lock().unwrap().streams,
        1,
        "only the client with a certificate got a stream"
    );
    assert_eq!(block_in_place(|| readyz(&stranger)).0, 200, "forced start");
}

/// Acceptance: Envoy Gateway's environment and an xDS server that cannot be reached. Without a
/// forced start: not ready, saying why in the log and on `/readyz`, no decisions. Forced (as
/// Envoy Gateway sets it): ready, nothing limited, the reason still in the log and `/config`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_xds_server_keeps_it_not_ready_unless_forced() {
    let certs = block_in_place(Certs::make);
    let nobody = format!("127.0.0.1:{}", free_port());
    for force_start in [false, true] {
        let env = envoy_gateway_env(&nobody, &certs, force_start);
        let tollgate = block_in_place(|| start_with(&env));
        let why = format!("no rules received from xDS server {nobody} (node envoy-ratelimit) yet: cannot connect");
        let state = if force_start {
            "ready, nothing limited (xds.force_start)"
        } else {
            "not ready"
        };
        let why = format!("{state}: {why}");
        eventually("the log says why", || tollgate.process.log().contains(&why)).await;
        let (status, body) = block_in_place(|| readyz(&tollgate));
        let (health, _) = block_in_place(|| http_get(tollgate.http_addr, "/healthcheck")).unwrap();
        let mut c = client(&tollgate).await;
        let answer = ask(&mut c, DOMAIN, &[("rule-0-match-0", "alice")]).await;
        let channel = Channel::from_shared(format!("http://{}", tollgate.grpc_addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let grpc_health = HealthClient::new(channel)
            .check(HealthCheckRequest { service: String::new() })
            .await
            .unwrap()
            .into_inner()
            .status;
        let expected = if force_start {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        assert_eq!(grpc_health, expected as i32, "gRPC health says what /readyz says");
        if force_start {
            assert_eq!((status, health), (200, 200), "{body}");
            assert_eq!(answer, Ok(OK), "nothing limited");
        } else {
            assert_eq!((status, health), (503, 500));
            assert_eq!(
                body,
                "not ready: no rules received from the xDS server yet (not connected; see the log)\n"
            );
            assert_eq!(answer, Err(tonic::Code::Unavailable), "no decisions without rules");
        }
        let shown = block_in_place(|| config(&tollgate));
        let source = &shown["rules_source"];
        assert_eq!(
            (source["connected"].as_bool(), source["version"].as_str()),
            (Some(false), None)
        );
        assert!(
            source["last_error"]["error"]
                .as_str()
                .unwrap()
                .starts_with("cannot connect"),
            "{source}"
        );
        assert_eq!(source["force_start"], force_start);
        // Their series are on too (their environment), which the strict `Scrape` refuses
        // (`ratelimit_service_should_rate_limit_error` is a counter without `_total`).
        let (_, metrics) = block_in_place(|| http_get(tollgate.http_addr, "/metrics")).unwrap();
        for line in ["tollgate_xds_connected 0", "tollgate_rules_generation 0"] {
            assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
        }
    }
}

/// A certificate that is not there stops the start, naming the file and its variable's
/// setting, instead of retrying forever.
#[test]
fn a_missing_certificate_stops_the_start() {
    let certs = Certs::make();
    let mut env = envoy_gateway_env("127.0.0.1:1", &certs, true);
    for (k, v) in env.iter_mut() {
        if k == "CONFIG_GRPC_XDS_SERVER_TLS_CACERT" {
            *v = "/nonexistent/ca.crt".into();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("serve")
        .current_dir(dir.path())
        .env("TOLLGATE_GRPC_ADDR", format!("127.0.0.1:{}", free_port()))
        .env("TOLLGATE_HTTP_ADDR", format!("127.0.0.1:{}", free_port()))
        .env("TOLLGATE_ADMIN__ENABLED", "false")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("xds.tls.ca_file /nonexistent/ca.crt"), "{stderr}");
}

/// Tollgate on `server` without TLS, with `backoff` as `xds.backoff`.
pub(crate) fn start_plain(server: SocketAddr, backoff: &str) -> Tollgate {
    Tollgate::builder()
        .settings(&format!(
            "rules_source: xds\nxds:\n  server_url: {server}\n  node_id: envoy-ratelimit\n  backoff: {backoff}\n"
        ))
        .start()
}

/// The snapshot `listener(100)` with a limit that has no unit: refused.
pub(crate) fn invalid() -> RateLimitConfig {
    let mut bad = listener(100);
    bad.descriptors[0].descriptors[0].rate_limit.as_mut().unwrap().unit = RateLimitUnit::Unknown as i32;
    bad
}

/// Waits for the request that answers `nonce`.
pub(crate) async fn answer_to(ads: &Ads, nonce: &str) -> DiscoveryRequest {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let found = ads
            .0
            .lock()
            .unwrap()
            .requests
            .iter()
            .find(|s| s.request.response_nonce == nonce)
            .map(|s| s.request.clone());
        if let Some(request) = found {
            return request;
        }
        assert!(Instant::now() < deadline, "no answer to {nonce}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A control plane that sends its snapshot again at once on every NACK (go-control-plane's
/// snapshot cache does): the repeats are refused without compiling, at a pace that backs off
/// like the connection (at most 5 s), instead of as fast as the network allows. A fix that
/// comes during a pause supersedes the NACK waiting to be sent and is ACKed at once; when the
/// fix is the rules in force, the failure no longer stands in
/// `tollgate_rules_last_reload_successful`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_resent_on_every_nack_is_refused_at_a_backed_off_pace() {
    let ads = Ads::default();
    let addr = ads.serve(None).await;
    let tollgate = block_in_place(|| start_plain(addr, "{initial_ms: 400, max_ms: 60000}"));
    ads.request(1).await;
    ads.push("v1", &[listener(2)]);
    assert!(ads.request(2).await.request.error_detail.is_none());

    ads.behave(OnNack::Resend, false);
    let first = ads.push("v2", &[invalid()]);
    let nack = answer_to(&ads, &first).await;
    let started = Instant::now();
    let detail = nack.error_detail.expect("refused").message;
    // The first NACK and four repeats, paced 400, 800, 1,600 and 3,200 ms, each cut by less
    // than half (the jitter); the next pause is 5 s (the cap), at least halved.
    let fifth = ads.request(2 + 5).await.request;
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(3_000), "5 NACKs in {took:?}");
    assert!(took < Duration::from_millis(9_000), "5 NACKs in {took:?}");
    for seen in ads.0.lock().unwrap().requests[2..].iter() {
        let r = &seen.request;
        assert_eq!(r.version_info, "v1", "{r:?}");
        assert_eq!(
            r.error_detail.as_ref().map(|d| d.message.as_str()),
            Some(detail.as_str())
        );
    }
    assert!(fifth.error_detail.is_some());

    // The rules in force again, as a new version: ACKed at once, the NACK waiting dropped.
    ads.behave(OnNack::Wait, false);
    let sent = Instant::now();
    let fix = ads.push("v3", &[listener(2)]);
    let ack = answer_to(&ads, &fix).await;
    assert!(ack.error_detail.is_none(), "{ack:?}");
    assert_eq!(ack.version_info, "v3");
    assert!(
        sent.elapsed() < Duration::from_millis(2_000),
        "ACKed after {:?}",
        sent.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    assert_eq!(ads.requests(), 8, "no NACK after the ACK");

    let log = tollgate.process.log();
    assert_eq!(
        log.matches("rules from the xDS server rejected").count(),
        1,
        "logged once:\n{log}"
    );
    let scrape = block_in_place(|| Scrape::from(tollgate.http_addr));
    assert_eq!(
        scrape.get("tollgate_rules_reloads_total", &[("result", "failure")]),
        Some(1.0),
        "compiled once"
    );
    assert_eq!(
        scrape.get("tollgate_xds_updates_total", &[("result", "nack")]),
        Some(5.0),
        "the NACKs sent, not the one superseded"
    );
    assert_eq!(scrape.get("tollgate_rules_last_reload_successful", &[]), Some(1.0));
    let shown = block_in_place(|| config(&tollgate));
    assert_eq!(shown["reload"]["last_reload_failed"], false);
    assert_eq!(shown["generation"], 1, "v3 is v1's rules: nothing swapped");
    assert_eq!(shown["rules_source"]["version"], "v3");
}

/// A response of a type tollgate did not subscribe to is not answered (as Envoy answers none:
/// a request of that type would subscribe to it), and neither the rules nor their state take it
/// for an update; a NACK waiting for its pause is still sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_of_another_type_is_ignored() {
    const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    let ads = Ads::default();
    let addr = ads.serve(None).await;
    let tollgate = block_in_place(|| start_plain(addr, "{initial_ms: 1000, max_ms: 1000}"));
    ads.request(1).await;
    ads.push("v1", &[listener(2)]);
    ads.request(2).await;
    let cluster = || DiscoveryResponse {
        version_info: "c1".into(),
        resources: vec![Any {
            type_url: CLUSTER.into(),
            value: Vec::new(),
        }],
        type_url: CLUSTER.into(),
        ..Default::default()
    };
    ads.send(cluster());

    // A refused snapshot sent twice: the second NACK waits about a second; a response of
    // another type meanwhile does not drop it.
    ads.push("v2", &[invalid()]);
    assert!(ads.request(3).await.request.error_detail.is_some());
    let again = ads.push("v2", &[invalid()]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    ads.send(cluster());
    let repeat = answer_to(&ads, &again).await;
    assert!(repeat.error_detail.is_some(), "{repeat:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let requests = ads.0.lock().unwrap().requests.clone();
    assert_eq!(requests.len(), 4, "{requests:#?}");
    assert!(requests.iter().all(|s| s.request.type_url == TYPE_URL), "{requests:#?}");

    let shown = block_in_place(|| config(&tollgate));
    assert_eq!(shown["rules_source"]["version"], "v1");
    assert_eq!(shown["rules_source"]["last_nack"]["version"], "v2", "{shown}");
    let log = tollgate.process.log();
    assert_eq!(
        log.matches("xDS response of a type not subscribed to; ignored").count(),
        1,
        "warned once per type:\n{log}"
    );
    let mut c = client(&tollgate).await;
    assert_eq!(hits(&mut c, "alice", 3).await, [OK, OK, OVER], "v1 in force");
}

/// A server that answers every stream with a snapshot tollgate refuses, and then closes it, is
/// no healthier than one that cannot be reached: the waits between streams grow as after
/// failed connections, instead of starting over at every response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_only_bring_refusals_back_off() {
    let ads = Ads::default();
    let addr = ads.serve(None).await;
    let _tollgate = block_in_place(|| start_plain(addr, "{initial_ms: 100, max_ms: 10000}"));
    ads.request(1).await;
    ads.behave(OnNack::Drop, true);
    let started = Instant::now();
    ads.push("v1", &[invalid()]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let streams = ads.streams();
    // Backing off: 100, 200, 400, 800, 1,600 ms between streams (each cut by at most half),
    // and the repeated NACK paced as much again. Starting over at 100 ms each time, there
    // would be about 30.
    assert!(
        (3..=8).contains(&streams),
        "{streams} streams in {:?}",
        started.elapsed()
    );
}

/// The DER of the first certificate in the PEM file `path`.
fn der_of(path: &std::path::Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_file(path)
        .expect("a PEM certificate")
        .to_vec()
}

/// Mutual TLS on the xDS client, both ways: a client certificate from another CA is refused by
/// the server, and a server whose certificate is from another CA is refused by tollgate; a
/// client certificate renewed on disk is presented from the next connection on, while the
/// stream open on the old one keeps taking updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xds_mutual_tls_refuses_other_cas_and_a_renewed_certificate_serves_the_next_connection() {
    let (certs, other) = block_in_place(|| (Certs::make(), Certs::make()));
    let ads = Ads::default();
    let addr = ads.serve(Some(certs.server())).await;

    // Tollgate's certificate from another CA: the server refuses the handshake, no stream.
    let mut env = envoy_gateway_env(&addr.to_string(), &certs, true);
    for (k, v) in env.iter_mut() {
        match k.as_str() {
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT" => *v = other.path("client.crt").to_string_lossy().into(),
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY" => *v = other.path("client.key").to_string_lossy().into(),
            _ => {}
        }
    }
    let stranger = block_in_place(|| start_with(&env));
    eventually("the stranger's connection fails", || {
        block_in_place(|| config(&stranger))["rules_source"]["last_error"]["error"].is_string()
    })
    .await;
    // The server's certificate from another CA: tollgate refuses it.
    let impostor = Ads::default();
    let impostor_addr = impostor.serve(Some(other.server())).await;
    let fooled = block_in_place(|| start_with(&envoy_gateway_env(&impostor_addr.to_string(), &certs, true)));
    eventually("the impostor is refused", || {
        let shown = block_in_place(|| config(&fooled));
        shown["rules_source"]["last_error"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("certificate"))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        (ads.streams(), impostor.streams()),
        (0, 0),
        "no stream on a refused handshake"
    );
    drop((stranger, fooled));

    // The certificate tollgate reads, in a folder of its own so it can be renewed.
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::copy(certs.path("client.crt"), &cert).unwrap();
    std::fs::copy(certs.path("client.key"), &key).unwrap();
    let mut env = envoy_gateway_env(&addr.to_string(), &certs, true);
    for (k, v) in env.iter_mut() {
        match k.as_str() {
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT" => *v = cert.to_string_lossy().into(),
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY" => *v = key.to_string_lossy().into(),
            _ => {}
        }
    }
    let tollgate = block_in_place(|| start_with(&env));
    let first = ads.request(1).await;
    assert_eq!(first.client_cert, Some(der_of(&cert)), "the certificate of the file");
    ads.push("1", &[listener(1)]);
    assert!(ads.request(2).await.request.error_detail.is_none());

    // Renewed as cert-manager does: new files moved into place.
    block_in_place(|| {
        certs.issue(
            "renewed",
            "envoy-ratelimit",
            "subjectAltName=DNS:envoy-ratelimit\nextendedKeyUsage=clientAuth\n",
            Key::Ec,
            None,
        )
    });
    for (from, to) in [("renewed.crt", &cert), ("renewed.key", &key)] {
        let staged = dir.path().join(format!("{from}.new"));
        std::fs::copy(certs.path(from), &staged).unwrap();
        std::fs::rename(&staged, to).unwrap();
    }
    // The open stream goes on: an update on it is applied and ACKed.
    let nonce = ads.push("2", &[listener(2)]);
    let ack = ads.request(3).await;
    assert_eq!((ack.stream, ack.request.response_nonce.as_str()), (1, nonce.as_str()));
    assert!(ack.request.error_detail.is_none());
    let mut c = client(&tollgate).await;
    assert_eq!(hits(&mut c, "alice", 3).await, [OK, OK, OVER], "update 2 in force");
    // The next connection presents the renewed certificate.
    ads.drop_stream();
    let resumed = ads.request(4).await;
    assert_eq!(resumed.stream, 2);
    assert_eq!(resumed.client_cert, Some(der_of(&cert)), "the renewed certificate");
    assert_ne!(first.client_cert, resumed.client_cert);
}
