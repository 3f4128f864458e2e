//! The gRPC service in-process on a loopback port: exact admission under 64 concurrent
//! callers, INVALID_ARGUMENT for malformed requests, and health.

use crate::support;

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tokio::net::TcpListener;
use tollgate::core::clock::SystemClock;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::server::settings::Settings;
use tollgate::store::MemoryStore;
use tonic::transport::Channel;

const RULES: &str = r#"
domain: grpc_test
buckets:
  hourly: {capacity: 100, refill: 100/1h}
descriptors:
  - key: user
    bucket: hourly
"#;

/// Starts the service on a free loopback port; returns its address. The server lives as long
/// as the test's runtime.
async fn start() -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, RULES).unwrap();
    let rules = tollgate::rules::load_rules(&file).unwrap();
    let store = MemoryStore::new(64, 10_000, Arc::new(SystemClock));
    let options = LimiterOptions::from_settings(&Settings::default());
    let limiter = Arc::new(Limiter::new(rules, store, options));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate::server::serve_grpc(listener, limiter, std::future::pending()));
    format!("http://{addr}")
}

fn request(domain: &str, entries: &[(&str, &str)]) -> RateLimitRequest {
    support::request(domain, entries, 0)
}

async fn client(addr: &str) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(addr.to_owned()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_callers_get_exactly_capacity() {
    let addr = start().await;
    let mut channels = Vec::new();
    for _ in 0..4 {
        channels.push(client(&addr).await);
    }
    let mut tasks = Vec::new();
    for i in 0..64 {
        let mut c = channels[i % 4].clone();
        tasks.push(tokio::spawn(async move {
            let mut ok = 0u32;
            for _ in 0..8 {
                let resp = c
                    .should_rate_limit(request("grpc_test", &[("user", "alice")]))
                    .await
                    .unwrap();
                if resp.get_ref().overall_code == Code::Ok as i32 {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 100, "64 x 8 = 512 requests on a bucket of 100");
    // Another user has their own bucket.
    let resp = channels[0]
        .should_rate_limit(request("grpc_test", &[("user", "bob")]))
        .await
        .unwrap();
    assert_eq!(resp.get_ref().overall_code, Code::Ok as i32);
    assert_eq!(resp.get_ref().statuses[0].limit_remaining, 99);
}

/// No malformed part makes a request an error over gRPC (an error is a failed check, which
/// Envoy lets through with every other limit of the request): each is answered, as
/// docs/rules.md says, and the well-formed descriptors beside it still decided.
#[tokio::test]
async fn malformed_requests_are_answered_not_errors_and_the_server_keeps_serving() {
    let addr = start().await;
    let mut c = client(&addr).await;
    let with = |extra: RateLimitDescriptor| RateLimitRequest {
        domain: "grpc_test".into(),
        descriptors: vec![request("grpc_test", &[("user", "y")]).descriptors[0].clone(), extra],
        hits_addend: 0,
    };
    let one_of = |r: RateLimitRequest| r.descriptors[0].clone();
    let too_many = RateLimitRequest {
        domain: "grpc_test".into(),
        descriptors: vec![one_of(request("grpc_test", &[("user", "x")])); 65],
        hits_addend: 0,
    };
    let deep: Vec<(&str, &str)> = vec![("user", "x"); 33];
    let mut unknown_unit = one_of(request("grpc_test", &[("user", "z")]));
    unknown_unit.limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 99,
    });
    // (request, expected overall code)
    let cases = [
        (request("", &[("user", "x")]), Code::Ok),
        (with(RateLimitDescriptor::default()), Code::Ok),
        (with(one_of(request("grpc_test", &[("", "x")]))), Code::Ok),
        (with(unknown_unit), Code::Ok),
        (too_many, Code::OverLimit),
        (with(one_of(request("grpc_test", &deep))), Code::OverLimit),
    ];
    for (i, (req, expected)) in cases.into_iter().enumerate() {
        let n = req.descriptors.len();
        let resp = c
            .should_rate_limit(req)
            .await
            .unwrap_or_else(|s| panic!("case {i}: {s:?}"));
        assert_eq!(resp.get_ref().overall_code, expected as i32, "case {i}");
        assert_eq!(resp.get_ref().statuses.len(), n, "case {i}");
    }
    // user y: decided (and consumed) beside each of the three OK cases it is in; beside the
    // denied descriptor it consumed nothing.
    let resp = c
        .should_rate_limit(request("grpc_test", &[("user", "y")]))
        .await
        .unwrap();
    assert_eq!(resp.get_ref().statuses[0].limit_remaining, 96, "3 beside, 1 now");
    // Still serving, and the malformed requests consumed nothing.
    let resp = c
        .should_rate_limit(request("grpc_test", &[("user", "x")]))
        .await
        .unwrap();
    assert_eq!(resp.get_ref().statuses[0].limit_remaining, 99);
    // Unknown domain and an empty descriptor list are not errors.
    let resp = c
        .should_rate_limit(request("elsewhere", &[("user", "x")]))
        .await
        .unwrap();
    assert_eq!(resp.get_ref().overall_code, Code::Ok as i32);
    let empty = RateLimitRequest {
        domain: "grpc_test".into(),
        ..Default::default()
    };
    let resp = c.should_rate_limit(empty).await.unwrap();
    assert_eq!(resp.get_ref().overall_code, Code::Ok as i32);
    assert!(resp.get_ref().statuses.is_empty());
}

#[tokio::test]
async fn health_reports_serving() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let addr = start().await;
    let channel = Channel::from_shared(addr).unwrap().connect().await.unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        let resp = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap();
        assert_eq!(
            resp.get_ref().status,
            ServingStatus::Serving as i32,
            "service {service:?}"
        );
    }
}

/// The request's shape with its strings as raw bytes, to send what Envoy sends when a header
/// holds bytes that are not UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// A header value with bytes that are not UTF-8 must be limited like any other value: the
/// stock codec answered INTERNAL, which Envoy treats as a failed check and lets through.
#[tokio::test]
async fn values_that_are_not_utf8_are_still_limited() {
    let addr = start().await;
    let raw = |value: &[u8]| RawRequest {
        domain: b"grpc_test".to_vec(),
        descriptors: vec![RawDescriptor {
            entries: vec![RawEntry {
                key: b"user".to_vec(),
                value: value.to_vec(),
            }],
        }],
    };
    let first = support::raw_call(&addr, raw(b"\xff\xfe"))
        .await
        .expect("decided, not an error");
    assert_eq!(first.overall_code, Code::Ok as i32);
    assert_eq!(first.statuses[0].limit_remaining, 99);
    let second = support::raw_call(&addr, raw(b"\xff\xfe")).await.unwrap();
    assert_eq!(
        second.statuses[0].limit_remaining, 98,
        "the same bytes hit the same bucket"
    );
}

#[tokio::test]
async fn a_message_that_is_not_a_request_is_invalid_argument() {
    let addr = start().await;
    let status = support::raw_call(&addr, support::NotARequest { domain: 7 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("malformed RateLimitRequest"), "{status:?}");
}
