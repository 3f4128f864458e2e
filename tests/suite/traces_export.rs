//! How traces leave tollgate (docs/monitoring.md, "Traces"): over OTLP/HTTP with protobuf
//! bodies to a receiver in this test, and, with a collector that is not there, decisions that
//! never wait for it, spans beyond the export queue dropped and counted in
//! `tollgate_trace_spans_dropped_total`, and the failure logged once (at most once a minute).

use crate::support;
use crate::traces::hex;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use support::{Scrape, Tollgate};

const RULES: &str = "
domain: traced
descriptors:
  - key: api_key
    token_bucket: {capacity: 1000000, refill: 1000000/s}
";

/// A sampled W3C context of trace `trace_id` (32 hex digits).
fn traceparent(trace_id: &str) -> String {
    format!("00-{trace_id}-b7ad6b7169203331-01")
}

/// One `ShouldRateLimit` call carrying `traceparent`; its overall code.
async fn call(client: &mut RateLimitServiceClient<tonic::transport::Channel>, traceparent: &str) -> Code {
    let mut request = tonic::Request::new(support::request("traced", &[("api_key", "k")], 0));
    request
        .metadata_mut()
        .insert("traceparent", traceparent.parse().expect("metadata value"));
    let answer = client.should_rate_limit(request).await.expect("ShouldRateLimit");
    Code::try_from(answer.into_inner().overall_code).expect("a code")
}

/// An OTLP/HTTP receiver: `POST` of a protobuf `ExportTraceServiceRequest` on any path.
#[derive(Clone, Default)]
struct HttpReceiver {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

impl HttpReceiver {
    async fn start(&self) -> SocketAddr {
        async fn export(State(receiver): State<HttpReceiver>, uri: axum::http::Uri, body: Bytes) -> &'static str {
            let request = ExportTraceServiceRequest::decode(body).expect("a protobuf ExportTraceServiceRequest");
            let mut spans = receiver.spans.lock().unwrap();
            for resource_spans in request.resource_spans {
                for scope in resource_spans.scope_spans {
                    spans.extend(scope.spans.into_iter().map(|s| (uri.path().to_owned(), s)));
                }
            }
            ""
        }
        let app = axum::Router::new().fallback(post(export)).with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_http_protobuf_exports_the_callers_trace() {
    let receiver = HttpReceiver::default();
    let addr = receiver.start().await;
    let tollgate = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("traced.yaml", RULES)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{addr}"))
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
            .env("OTEL_BSP_SCHEDULE_DELAY", "50")
            .start()
    });
    let mut client = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect");
    let trace_id = "5b8efff798038103d269b633813fc60c";
    assert_eq!(call(&mut client, &traceparent(trace_id)).await, Code::Ok);
    let deadline = Instant::now() + Duration::from_secs(15);
    let server = loop {
        let found = receiver.spans.lock().unwrap().iter().find_map(|(path, s)| {
            (hex(&s.trace_id) == trace_id && hex(&s.parent_span_id) == "b7ad6b7169203331")
                .then(|| (path.clone(), s.name.clone()))
        });
        if let Some(found) = found {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "no server span of trace {trace_id} over OTLP/HTTP; got {:?}\n{}",
            receiver.spans.lock().unwrap(),
            tollgate.process.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        server,
        (
            "/v1/traces".to_owned(),
            "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit".to_owned()
        ),
        "the standard path below the endpoint, and the server span, a child of the caller's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_not_there_costs_decisions_nothing() {
    // A port nothing listens on: bound, then let go.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let tollgate = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("traced.yaml", RULES)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{gone}"))
            .env("OTEL_BSP_SCHEDULE_DELAY", "200")
            .env("OTEL_BSP_MAX_QUEUE_SIZE", "8")
            .start()
    });
    let mut client = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect");
    // Every call sampled, each a few spans: far more than 8 between two exports.
    let started = Instant::now();
    for i in 0..300u32 {
        let trace_id = format!("{:032x}", 0xabc0_0000_u64 + u64::from(i));
        assert_eq!(call(&mut client, &traceparent(&trace_id)).await, Code::Ok);
    }
    let took = started.elapsed();
    // Far below any export timeout: no call waited for the collector.
    assert!(took < Duration::from_secs(20), "300 calls took {took:?}");
    // Two scheduled exports later, the failure has been seen.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let dropped = Scrape::from(tollgate.http_addr).sum("tollgate_trace_spans_dropped_total", &[]);
    assert!(dropped > 0.0, "spans beyond the queue of 8 are counted: {dropped}");
    let log = tollgate.process.log_tail(400);
    let lines = log.matches("cannot export traces to the OTLP collector").count();
    assert_eq!(lines, 1, "logged once (at most once a minute):\n{log}");
}
