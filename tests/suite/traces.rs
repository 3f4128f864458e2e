//! OpenTelemetry traces (docs/monitoring.md, "Traces"): a real `tollgate serve` exporting over
//! OTLP/gRPC to a receiver in this test (the collector's `TraceService`), called with W3C and
//! B3 (single and multi) trace contexts, an unsampled one and an unparsable one; then real
//! Envoy 1.40 with its OpenTelemetry tracer, on `envoy/tracing.yaml`, in front of tollgate,
//! both exporting to the same receiver: one trace. On Redis (the shared server, and a Cluster
//! of three private masters) and on Postgres, concurrent calls in traces of their own share a
//! batched round trip, whose span is linked from each call's `store` span.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use support::{envoy_or_skip, Envoy, Scrape, Tollgate};

const RULES: &str = r#"
domain: traced
buckets:
  per_key:
    capacity: 100
    refill: 100/s
descriptors:
  - key: api_key
    bucket: per_key
    descriptors:
      - key: tier
        bucket: per_key
"#;

/// A call's propagation: its name, the trace and parent span ids it carries, its metadata.
type Case = (&'static str, &'static str, &'static str, Vec<(&'static str, String)>);

/// The name of tollgate's server span.
const SERVER_SPAN: &str = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A span as received, with the `service.name` of its resource.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    span: Span,
}

impl Received {
    fn attribute(&self, key: &str) -> Option<String> {
        attribute(&self.span.attributes, key)
    }
}

fn attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes
        .iter()
        .find(|kv| kv.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match value {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

/// An OTLP/gRPC receiver that keeps every span it is sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| attribute(&r.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Serves on a free loopback port; returns its address.
    async fn start(&self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the receiver");
        let addr = listener.local_addr().expect("receiver address");
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
        });
        addr
    }

    /// The first span received that `matches`, waiting up to 15 s; panics with what was
    /// received otherwise.
    async fn wait_for(&self, what: &str, matches: impl Fn(&Received) -> bool) -> Received {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(found) = self.spans.lock().unwrap().iter().find(|r| matches(r)) {
                return found.clone();
            }
            if Instant::now() > deadline {
                panic!("no span {what} received; got {:#?}", self.spans.lock().unwrap());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The `store.round_trip` span linked from the `store` span in trace `trace_id` (hex),
    /// waiting for both as [`Receiver::wait_for`] does.
    async fn round_trip_of(&self, trace_id: &str) -> Received {
        let store = self
            .wait_for(&format!("store in trace {trace_id}"), |r| {
                hex(&r.span.trace_id) == trace_id && r.span.name == "store"
            })
            .await;
        self.wait_for(&format!("{ROUND_TRIP} linked from trace {trace_id}"), |r| {
            r.span.name == ROUND_TRIP
                && r.span
                    .links
                    .iter()
                    .any(|l| l.trace_id == store.span.trace_id && l.span_id == store.span.span_id)
        })
        .await
    }

    fn all(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// tollgate exporting every span to `receiver` at once (a short batch delay).
fn tollgate_tracing_to(receiver: SocketAddr, builder: support::TollgateBuilder) -> Tollgate {
    builder
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{receiver}"))
        .env("OTEL_SERVICE_NAME", "tollgate-under-test")
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .start()
}

async fn call(
    tollgate: &Tollgate,
    request: RateLimitRequest,
    metadata: &[(&'static str, &str)],
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse {
    let mut client = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect to tollgate");
    let mut request = tonic::Request::new(request);
    for (key, value) in metadata {
        request
            .metadata_mut()
            .insert(*key, value.parse().expect("metadata value"));
    }
    client
        .should_rate_limit(request)
        .await
        .expect("ShouldRateLimit")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_join_the_callers_w3c_and_b3_traces() {
    let receiver = Receiver::default();
    let addr = receiver.start().await;
    let tollgate = tokio::task::block_in_place(|| {
        tollgate_tracing_to(
            addr,
            Tollgate::builder()
                .rules_file("traced.yaml", RULES)
                .settings("tracing:\n  value_keys: [tier]"),
        )
    });
    let request = || support::request("traced", &[("api_key", "secret-key-value"), ("tier", "gold")], 0);

    let cases: [Case; 3] = [
        (
            "w3c",
            "0af7651916cd43dd8448eb211c80319c",
            "b7ad6b7169203331",
            vec![
                (
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
                ),
                ("tracestate", "vendor=x".to_owned()),
            ],
        ),
        (
            "b3 single",
            "80f198ee56343ba864fe8b2a57d3eff7",
            "e457b5a2e4d86bd1",
            vec![("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1".to_owned())],
        ),
        (
            "b3 multi",
            "463ac35c9f6413ad48485a3953bb6124",
            "a2fb4a1d1a96d312",
            vec![
                ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124".to_owned()),
                ("x-b3-spanid", "a2fb4a1d1a96d312".to_owned()),
                ("x-b3-sampled", "1".to_owned()),
            ],
        ),
    ];
    for (name, trace_id, parent, metadata) in &cases {
        let metadata: Vec<(&'static str, &str)> = metadata.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let answer = call(&tollgate, request(), &metadata).await;
        assert_eq!(answer.overall_code, Code::Ok as i32, "{name}");
        let span = receiver
            .wait_for(&format!("in trace {trace_id} ({name})"), |r| {
                hex(&r.span.trace_id) == *trace_id && r.span.name == SERVER_SPAN
            })
            .await;
        assert_eq!(
            hex(&span.span.parent_span_id),
            *parent,
            "{name}: the caller's span is the parent"
        );
        assert_eq!(span.service, "tollgate-under-test", "{name}");
        assert_eq!(span.span.kind, SpanKind::Server as i32, "{name}");
        // Its children: rule matching and the store call.
        let children: Vec<String> = receiver
            .all()
            .into_iter()
            .filter(|r| r.span.parent_span_id == span.span.span_id)
            .map(|r| r.span.name)
            .collect();
        for child in ["match_rules", "store"] {
            assert!(
                children.iter().any(|c| c == child),
                "{name}: no {child} span in {children:?}"
            );
        }
        assert_eq!(span.attribute("ratelimit.domain").as_deref(), Some("traced"), "{name}");
        assert_eq!(span.attribute("ratelimit.code").as_deref(), Some("OK"), "{name}");
        assert_eq!(span.attribute("ratelimit.statuses").as_deref(), Some("OK"), "{name}");
        assert_eq!(span.attribute("ratelimit.backend").as_deref(), Some("memory"), "{name}");
        assert_eq!(
            span.attribute("ratelimit.buckets").as_deref(),
            Some("per_key"),
            "{name}"
        );
        // Only the value of the key `tracing.value_keys` names.
        assert_eq!(
            span.attribute("ratelimit.descriptors").as_deref(),
            Some("api_key,tier=gold"),
            "{name}"
        );
        assert_eq!(span.attribute("trace_id").as_deref(), Some(*trace_id), "{name}");
    }

    // A caller that did not sample: nothing exported for its trace (parent-based sampling).
    let unsampled = "11111111111111111111111111111111";
    call(
        &tollgate,
        request(),
        &[("traceparent", &format!("00-{unsampled}-2222222222222222-00"))],
    )
    .await;

    // An unparsable traceparent: answered as usual, under a new root span, and counted.
    let answer = call(
        &tollgate,
        request(),
        &[
            ("traceparent", "00-not-a-trace-id-01"),
            ("x-request-id", "bad-parent-1"),
        ],
    )
    .await;
    assert_eq!(answer.overall_code, Code::Ok as i32);
    let root = receiver
        .wait_for("for x-request-id bad-parent-1", |r| {
            r.attribute("request_id").as_deref() == Some("bad-parent-1")
        })
        .await;
    assert!(root.span.parent_span_id.is_empty(), "a new root: {root:?}");
    assert_eq!(root.span.trace_id.len(), 16);
    let invalid = tokio::task::block_in_place(|| {
        Scrape::from(tollgate.http_addr).counter("tollgate_trace_context_invalid_total", &[])
    });
    assert_eq!(invalid, 1.0);

    // A warning about a request (a malformed part: an empty key) carries its trace id and
    // Envoy's x-request-id.
    call(
        &tollgate,
        support::request("traced", &[("", "x")], 0),
        &[
            ("traceparent", "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            ("x-request-id", "req-with-a-warning"),
        ],
    )
    .await;
    let warning = warning_line(&tollgate, "malformed request part");
    assert!(
        warning.contains("trace_id=5bf92f3577b34da6a3ce929d0e0e4736")
            && warning.contains("request_id=\"req-with-a-warning\""),
        "{warning}"
    );

    // A call the caller did not sample makes no span, yet a warning about it (a descriptor
    // without entries: a reason of its own, as each reason's warnings are rate-limited) still
    // carries its trace id and x-request-id.
    let quiet = "6e0c63257de34c926f9efcd03899b7e2";
    call(
        &tollgate,
        support::request("traced", &[], 0),
        &[
            ("traceparent", &format!("00-{quiet}-00f067aa0ba902b7-00")),
            ("x-request-id", "req-unsampled-warning"),
        ],
    )
    .await;
    let warning = warning_line(&tollgate, "no_entries");
    assert!(
        warning.contains(&format!("trace_id={quiet}")) && warning.contains("request_id=\"req-unsampled-warning\""),
        "{warning}"
    );

    // By now the unsampled calls' spans would have been exported with the later ones.
    assert!(
        !receiver
            .all()
            .iter()
            .any(|r| [unsampled, quiet].contains(&hex(&r.span.trace_id).as_str())),
        "an unsampled caller's trace was exported"
    );
    // Descriptor values other than `tier`'s are in no attribute.
    for received in receiver.all() {
        for kv in &received.span.attributes {
            let value = attribute(std::slice::from_ref(kv), &kv.key).unwrap_or_default();
            assert!(!value.contains("secret-key-value"), "{}: {value}", kv.key);
        }
    }
}

/// The first warning `tollgate` logged that contains `marker`.
fn warning_line(tollgate: &Tollgate, marker: &str) -> String {
    let log = tollgate.process.log();
    log.lines()
        .find(|l| l.contains("WARN") && l.contains(marker))
        .unwrap_or_else(|| panic!("no warning with {marker:?} logged:\n{log}"))
        .to_owned()
}

/// With traces off, a warning about a call still carries the trace id it came with (W3C, else
/// B3) and its x-request-id, as fields of the line (text and JSON logs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warnings_carry_the_calls_ids_with_traces_off() {
    for (format, trace_id, request_id) in [
        (
            "text",
            "trace_id=80f198ee56343ba864fe8b2a57d3eff7",
            "request_id=\"req-text\"",
        ),
        (
            "json",
            "\"trace_id\":\"80f198ee56343ba864fe8b2a57d3eff7\"",
            "\"request_id\":\"req-json\"",
        ),
    ] {
        let tollgate = tokio::task::block_in_place(|| {
            Tollgate::builder()
                .rules_file("traced.yaml", RULES)
                .env("TOLLGATE_LOG__FORMAT", format)
                .start()
        });
        let id = format!("req-{format}");
        call(
            &tollgate,
            support::request("traced", &[("", "x")], 0),
            &[
                ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
                ("x-request-id", &id),
            ],
        )
        .await;
        let warning = warning_line(&tollgate, "malformed request part");
        assert!(
            warning.contains(trace_id) && warning.contains(request_id),
            "{format}: {warning}"
        );
        // A call that carries neither logs neither.
        call(&tollgate, support::request("traced", &[], 0), &[]).await;
        let bare = warning_line(&tollgate, "no_entries");
        assert!(
            !bare.contains("trace_id") && !bare.contains("request_id"),
            "{format}: {bare}"
        );
    }
}

/// The name of a batched round trip's span.
const ROUND_TRIP: &str = "store.round_trip";

/// `tollgate serve` on `backend` (a `backend: ...` settings document) with one lane, so that
/// concurrent calls share round trips, exporting to `receiver`; ready (its backend connected).
fn tollgate_on_one_lane(receiver: SocketAddr, settings: &str) -> Tollgate {
    let mut tollgate = tollgate_tracing_to(
        receiver,
        Tollgate::builder().rules_file("traced.yaml", RULES).settings(settings),
    );
    let http = tollgate.http_addr;
    support::wait_until(&mut tollgate.process, || {
        support::http_get(http, "/readyz").filter(|(status, _)| *status == 200)
    })
    .unwrap_or_else(|why| panic!("tollgate not ready: {why}\n{}", tollgate.process.log_tail(60)));
    tollgate
}

/// Sends rounds of 24 concurrent calls on one connection, each in a sampled trace of its own,
/// until a round trip to `backend` served several of them (at most 10 rounds); then checks
/// that each call's `store` span is linked from a round trip's span, a root of another trace,
/// whose attributes count what it carried, and that a round trip serving only an unsampled
/// call is not exported.
async fn round_trips_are_linked_from_their_requests(
    tollgate: &Tollgate,
    receiver: &Receiver,
    backend: &str,
    calls: &[&str],
) {
    let client = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect to tollgate");
    let traced = |trace_id: String, sampled: bool| {
        let mut client = client.clone();
        async move {
            let mut request = tonic::Request::new(support::request(
                "traced",
                &[("api_key", &trace_id), ("tier", "gold")],
                0,
            ));
            let flags = if sampled { "01" } else { "00" };
            let parent = format!("00-{trace_id}-00f067aa0ba902b7-{flags}");
            request
                .metadata_mut()
                .insert("traceparent", parent.parse().expect("metadata value"));
            let answer = client.should_rate_limit(request).await.expect("ShouldRateLimit");
            assert_eq!(answer.into_inner().overall_code, Code::Ok as i32);
        }
    };
    // Distinct trace ids, none of them the round trips' (random, never this pattern).
    let trace_id = |round: usize, i: usize| format!("{:08x}{:08x}feedfacefeedface", 0x5000_0000 + round, i + 1);
    let mut sent: Vec<String> = Vec::new();
    let mut shared = None;
    for round in 0..10 {
        let ids: Vec<String> = (0..24).map(|i| trace_id(round, i)).collect();
        futures_util::future::join_all(ids.iter().map(|id| traced(id.clone(), true))).await;
        sent.extend(ids);
        // Every call's store span, and the round trip that links it.
        for id in &sent[sent.len() - 24..] {
            let linked_from = receiver.round_trip_of(id).await;
            if linked_from.span.links.len() > 1 {
                shared = Some(linked_from);
            }
        }
        if shared.is_some() {
            break;
        }
    }
    let shared = shared.unwrap_or_else(|| panic!("no {backend} round trip served several of {} calls", sent.len()));
    let links = shared.span.links.len();
    assert!(links <= 24, "{shared:?}");
    for round_trip in receiver.all().iter().filter(|r| r.span.name == ROUND_TRIP) {
        let span = &round_trip.span;
        assert!(span.parent_span_id.is_empty(), "a round trip is a root: {round_trip:?}");
        assert!(
            !sent.contains(&hex(&span.trace_id)),
            "a round trip is a trace of its own: {round_trip:?}"
        );
        assert_eq!(round_trip.attribute("ratelimit.backend").as_deref(), Some(backend));
        let call = round_trip.attribute("ratelimit.call").unwrap_or_default();
        assert!(calls.contains(&call.as_str()), "{round_trip:?}");
        // One job a call (one bucket each), every one of them traced here.
        let requests = span.links.len().to_string();
        assert_eq!(
            round_trip.attribute("ratelimit.requests"),
            Some(requests.clone()),
            "{round_trip:?}"
        );
        assert_eq!(
            round_trip.attribute("ratelimit.buckets"),
            Some(requests),
            "{round_trip:?}"
        );
        assert_eq!(span.status.as_ref().map_or(0, |s| s.code), 0, "{round_trip:?}");
    }

    // A call that its caller did not sample, alone: its round trip is not exported. A sampled
    // call after it, and its round trip, come in the same or a later export.
    let unsampled = trace_id(99, 0);
    traced(unsampled.clone(), false).await;
    let last = trace_id(99, 1);
    traced(last.clone(), true).await;
    receiver.round_trip_of(&last).await;
    sent.push(last);
    assert!(
        !receiver
            .all()
            .iter()
            .any(|r| hex(&r.span.trace_id) == unsampled || r.span.links.iter().any(|l| hex(&l.trace_id) == unsampled)),
        "an unsampled call's span or round trip was exported"
    );
    // A call's spans are all in its caller's trace, none a root of its own. (After a burst on
    // Postgres, sqlx's statement log once left calls without their server span, their
    // `match_rules` and `store` spans exported as roots.)
    for received in receiver.all() {
        if [SERVER_SPAN, "match_rules", "store"].contains(&received.span.name.as_str()) {
            assert!(sent.contains(&hex(&received.span.trace_id)), "{received:?}");
            assert!(!received.span.parent_span_id.is_empty(), "{received:?}");
        }
    }
}

/// On Redis with one lane: concurrent calls share calls of the script, and each call is a span
/// linked from the `store` span of every request it decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_round_trip_is_linked_from_each_request_it_served() {
    let test = "a_redis_round_trip_is_linked_from_each_request_it_served";
    let Some(url) = support::redis::shared_redis(test) else {
        return;
    };
    let receiver = Receiver::default();
    let addr = receiver.start().await;
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], key_prefix: {}, pool_size: 1, command_timeout_ms: 2000}}",
        support::yaml_str(&url),
        support::yaml_str(&support::redis::unique_prefix(test))
    );
    let tollgate = tokio::task::block_in_place(|| tollgate_on_one_lane(addr, &settings));
    round_trips_are_linked_from_their_requests(&tollgate, &receiver, "redis", &["decide"]).await;
}

/// The same on a Redis Cluster of three masters, one lane each: a master's lane decides the
/// requests of several slots in one call of the Cluster form, a span linked from each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_round_trip_is_linked_from_each_request_it_served() {
    let test = "a_redis_cluster_round_trip_is_linked_from_each_request_it_served";
    if !support::redis::redis_binaries_or_skip(test) {
        return;
    }
    let cluster = tokio::task::block_in_place(support::redis::RedisCluster::start);
    let receiver = Receiver::default();
    let addr = receiver.start().await;
    let urls: Vec<String> = cluster.urls().iter().map(|u| support::yaml_str(u)).collect();
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], cluster: true, key_prefix: {}, pool_size: 1, command_timeout_ms: 2000}}",
        urls.join(", "),
        support::yaml_str(&support::redis::unique_prefix(test))
    );
    let tollgate = tokio::task::block_in_place(|| tollgate_on_one_lane(addr, &settings));
    // One bucket a call, so each is one job on one master: a call of several is the Cluster
    // form (Redis 7), a call of one the plain script.
    round_trips_are_linked_from_their_requests(&tollgate, &receiver, "redis", &["decide", "decide_cross_slot"]).await;
    let calls: Vec<String> = receiver
        .all()
        .iter()
        .filter(|r| r.span.name == ROUND_TRIP && r.span.links.len() > 1)
        .filter_map(|r| r.attribute("ratelimit.call"))
        .collect();
    assert!(calls.iter().all(|c| c == "decide_cross_slot"), "{calls:?}");
}

/// The same on Postgres with one lane: a batch (one call of `tollgate_decide`) is one span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_round_trip_is_linked_from_each_request_it_served() {
    let test = "a_postgres_round_trip_is_linked_from_each_request_it_served";
    let Some(url) = support::postgres::shared_postgres(test).await else {
        return;
    };
    let schema = support::postgres::unique_schema();
    let receiver = Receiver::default();
    let addr = receiver.start().await;
    let settings = format!(
        "backend: postgres\npostgres: {{url: {}, schema: {schema}, pool_size: 1, command_timeout_ms: 2000, \
         connect_timeout_ms: 10000}}",
        support::yaml_str(&url)
    );
    let tollgate = tokio::task::block_in_place(|| tollgate_on_one_lane(addr, &settings));
    round_trips_are_linked_from_their_requests(&tollgate, &receiver, "postgres", &["tollgate_decide"]).await;
    drop(tollgate);
    support::postgres::drop_schema(&url, &schema).await;
}

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// Through real Envoy on `envoy/tracing.yaml`: Envoy's span of the rate-limit call and
/// tollgate's server span are one trace, tollgate's a child of the span Envoy exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_and_tollgate_spans_are_one_trace() {
    let Some(envoy_bin) = envoy_or_skip("envoy_and_tollgate_spans_are_one_trace") else {
        return;
    };
    let receiver = Receiver::default();
    let addr = receiver.start().await;
    let upstream = crate::envoy_e2e::start_upstream().await;
    let tollgate = tokio::task::block_in_place(|| {
        tollgate_tracing_to(addr, Tollgate::builder().rules_path(repo_path("config/rules")))
    });
    let shipped = std::fs::read_to_string(repo_path("envoy/tracing.yaml")).expect("read envoy/tracing.yaml");
    let mut bootstrap = shipped.clone();
    for (from, to) in [
        (
            "{ address: 0.0.0.0, port_value: 10000 }".to_owned(),
            "{ address: 127.0.0.1, port_value: 0 }".to_owned(),
        ),
        ("port_value: 9901".to_owned(), "port_value: 0".to_owned()),
        (
            "port_value: 8000".to_owned(),
            format!("port_value: {}", upstream.port()),
        ),
        (
            "port_value: 8081".to_owned(),
            format!("port_value: {}", tollgate.grpc_addr.port()),
        ),
        ("port_value: 4317".to_owned(), format!("port_value: {}", addr.port())),
        // A debug build on a busy machine: a late answer would let the request through untraced.
        ("timeout: 0.1s".to_owned(), "timeout: 2s".to_owned()),
    ] {
        assert_eq!(
            shipped.matches(&from).count(),
            1,
            "envoy/tracing.yaml changed: expected `{from}` exactly once"
        );
        bootstrap = bootstrap.replace(&from, &to);
    }
    let envoy = tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &bootstrap));
    let ingress = envoy.listener("ingress");
    let reply = tokio::task::block_in_place(|| support::http_get_with(ingress, "/", "x-api-key: alice\r\n"));
    assert_eq!(reply.map(|(status, _)| status), Some(200));

    let ours = receiver
        .wait_for("from tollgate", |r| {
            r.service == "tollgate-under-test" && r.span.name == SERVER_SPAN
        })
        .await;
    assert_eq!(ours.attribute("ratelimit.domain").as_deref(), Some("edge"));
    assert!(
        !ours.span.parent_span_id.is_empty(),
        "tollgate's span has no parent: {ours:?}"
    );
    let parent = receiver
        .wait_for("from Envoy that is tollgate's parent", |r| {
            r.service == "envoy" && r.span.span_id == ours.span.parent_span_id
        })
        .await;
    assert_eq!(parent.span.trace_id, ours.span.trace_id, "one trace");
    // Envoy's request span is in the same trace too.
    let spans = receiver.all();
    let envoy_spans: Vec<&Received> = spans
        .iter()
        .filter(|r| r.service == "envoy" && r.span.trace_id == ours.span.trace_id)
        .collect();
    assert!(
        envoy_spans.len() >= 2,
        "Envoy's request span and its rate-limit call: {envoy_spans:#?}"
    );
    assert_eq!(
        tokio::task::block_in_place(|| envoy.stat("cluster.upstream.ratelimit.ok")),
        1
    );
}

/// The Envoy tracing fragment docs/monitoring.md shows is the one `envoy/tracing.yaml` (the
/// file the test above runs) holds, line for line in order, so the two cannot drift apart.
#[test]
fn the_documented_envoy_tracing_config_is_the_tested_one() {
    let docs = std::fs::read_to_string(repo_path("docs/monitoring.md")).expect("read docs/monitoring.md");
    let traces = &docs[docs.find("## Traces").expect("a Traces section")..];
    let start = traces.find("```yaml envoy-fragment\n").expect("an Envoy fragment") + "```yaml envoy-fragment\n".len();
    let fragment = &traces[start..start + traces[start..].find("```").expect("the fence's end")];
    let shipped = std::fs::read_to_string(repo_path("envoy/tracing.yaml")).expect("read envoy/tracing.yaml");
    let mut lines = shipped.lines().map(str::trim);
    for wanted in fragment.lines().map(str::trim).filter(|l| !l.is_empty()) {
        assert!(
            lines.any(|l| l == wanted),
            "docs/monitoring.md shows `{wanted}`, which envoy/tracing.yaml does not hold (in that order)"
        );
    }
}
