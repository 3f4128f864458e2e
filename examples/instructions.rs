//! The driver of the instruction-count gate (`scripts/instruction-gate`, benches/README.md):
//! runs a number of decisions on one path, in process, so that `valgrind --tool=callgrind`
//! counts the instructions they take. Instruction counts repeat for the same binary and inputs,
//! so a regression shows on a noisy machine where time cannot.
//!
//! ```text
//! instructions <memory|grpc|grpc-traceparent|grpc-unsampled|grpc-unsampled-root|envoy|gateway10|gateway10000|redis-client> <decisions>
//! ```
//!
//! - `memory`: [`Limiter::should_rate_limit`] over the memory store, the decision path without
//!   gRPC (validation, tree match, instance key, refill and consume, statuses and headers).
//! - `grpc`: the request path behind the network: the request's bytes decoded by tollgate's
//!   lenient codec ([`tollgate::server::decode_request`]), the service `serve` answers with
//!   ([`tollgate::server::rate_limit_service`]: the decision, the response, the request
//!   metrics), and the response encoded.
//! - `grpc-traceparent`: the `grpc` path, each call carrying a W3C `traceparent` whose sampled
//!   flag is off, as Envoy sends it for a request it does not sample; tracing off. What
//!   `grpc-unsampled` is compared with: the same calls.
//! - `grpc-unsampled`: the `grpc-traceparent` path with traces on as `serve` starts them for an OTLP
//!   endpoint (the real OTLP/gRPC exporter, aimed at a loopback port nobody listens on, under
//!   the subscriber `serve` installs: the OpenTelemetry layer and the log's): the parent-based
//!   sampler drops every call, as it does for every call Envoy decided not to sample. What
//!   tracing costs a call that is not traced.
//! - `grpc-unsampled-root`: the `grpc` path (no caller's context) with traces on as above, the
//!   sampler set to sample no new trace (`tracing.sampling_ratio: 0`, parent-based on a
//!   trace-id ratio of 0).
//! - `envoy`: the memory path on the Envoy shape of the load benchmark
//!   (`benches/rules/envoy-shape.yaml`: four descriptors a request, two of them nested, one
//!   bucket every request shares), for 1,000 clients in turn.
//! - `gateway10`, `gateway10000`: the memory path on Envoy Gateway's shape with 10 and with
//!   10,000 route rules (each a descriptor named by its route, a value ending in `*`, with the
//!   client below it; `SHAPE=gateway` of `scripts/bench-compare`), the same 1,000 clients on
//!   the first ten routes in both: what the number of rules costs a request.
//! - `redis-client`: tollgate's own side of a decision on Redis in the lean form, without the
//!   network: the bucket key, the request's fields (`encode_lean`), the script's answer read
//!   back (`parse_lean`, a stored value) and the decision on it. The script's side is counted
//!   by `scripts/lua-instructions`; fred's RESP framing and the batch lane are in neither.
//!
//! `memory` and `grpc` decide one token of `benches/rules/bench.yaml` (one key-only descriptor, a bucket of
//! 1,000,000 tokens refilled 1,000,000/s) on values `0` to `999` in turn, on a manual clock that
//! moves 2 µs before each decision, so every decision refills and is admitted; the Prometheus
//! recorder `serve` installs is installed, so metrics cost what they cost in production.
//! Everything is deterministic but the hash seeds, which move a count by far less than the
//! gate's tolerance.
//!
//! `TOLLGATE_INSTRUCTIONS_SLOWDOWN=<n>` adds `n` rounds of busy work to every decision: only for
//! the gate's own test, which shows that a slowdown fails it.

use std::future::Future;
use std::hint::black_box;
use std::path::Path;
use std::pin::pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use prost::Message;
use tollgate::core::clock::ManualClock;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::rules::load_rules;
use tollgate::store::MemoryStore;
use tonic::metadata::MetadataMap;

/// Distinct descriptor values, as in the load benchmark's default.
const KEYS: usize = 1_000;
/// How far the clock moves before each decision (µs).
const STEP_US: u64 = 2;
/// 2026-12-02T12:00:00Z: any instant works.
const START_US: u64 = 1_796_212_800_000_000;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(path), Some(Ok(decisions))) = (args.get(1), args.get(2).map(|n| n.parse::<usize>())) else {
        eprintln!(
            "usage: instructions <memory|grpc|grpc-traceparent|grpc-unsampled|grpc-unsampled-root|envoy|gateway10|\
             gateway10000|redis-client> <decisions>"
        );
        return ExitCode::from(2);
    };
    let slowdown: u64 = std::env::var("TOLLGATE_INSTRUCTIONS_SLOWDOWN")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if let Err(e) = tollgate::server::install_metrics_recorder() {
        eprintln!("{e:#}");
        return ExitCode::FAILURE;
    }
    if path == "redis-client" {
        return redis_client(decisions, slowdown);
    }
    // Kept until the end: the exporter's runtime and the tracer provider.
    let started = match path.as_str() {
        "grpc-unsampled" => start_traces(None),
        "grpc-unsampled-root" => start_traces(Some(0.0)),
        _ => Ok(None),
    };
    let _traces = match started {
        Ok(traces) => traces,
        Err(e) => {
            eprintln!("cannot start traces: {e}");
            return ExitCode::FAILURE;
        }
    };
    let routes = match path.as_str() {
        "gateway10" => Some(10),
        "gateway10000" => Some(10_000),
        _ => None,
    };
    let generated = tempdir_for_rules(routes);
    let file = match (&generated, path.as_str()) {
        (Some(dir), _) => dir.join("gateway.yaml"),
        (None, "envoy") => Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/envoy-shape.yaml"),
        (None, _) => Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/bench.yaml"),
    };
    let file = file.display().to_string();
    let rules = match load_rules(Path::new(&file)) {
        Ok(rules) => rules,
        Err(e) => {
            eprintln!("{file}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(64, 1_000_000, Arc::new(clock.clone()));
    let options = LimiterOptions::from_settings(&tollgate::server::settings::Settings::default());
    let limiter = Arc::new(Limiter::new(rules, store, options));
    let requests: Vec<RateLimitRequest> = match path.as_str() {
        "envoy" => (0..KEYS).map(envoy_request).collect(),
        "gateway10" | "gateway10000" => (0..KEYS).map(gateway_request).collect(),
        _ => (0..KEYS).map(request).collect(),
    };
    if let Some(dir) = generated {
        let _ = std::fs::remove_dir_all(dir);
    }
    let admitted = match path.as_str() {
        "memory" | "envoy" => run(decisions, slowdown, &clock, |i| {
            let response = block_on(limiter.should_rate_limit(&requests[i % KEYS]));
            response.is_ok_and(|r| r.overall_code == Code::Ok as i32)
        }),
        // Admitted by a rule: a status with the route's limit, so the rule was found.
        "gateway10" | "gateway10000" => run(decisions, slowdown, &clock, |i| {
            let response = block_on(limiter.should_rate_limit(&requests[i % KEYS]));
            response.is_ok_and(|r| {
                r.overall_code == Code::Ok as i32 && r.statuses.first().is_some_and(|s| s.current_limit.is_some())
            })
        }),
        "grpc" | "grpc-traceparent" | "grpc-unsampled" | "grpc-unsampled-root" => {
            let service = tollgate::server::rate_limit_service(limiter.clone());
            let wire: Vec<Vec<u8>> = requests.iter().map(Message::encode_to_vec).collect();
            // Each call's metadata made before the measured decisions: tonic moves it out of
            // the HTTP/2 headers, the network's part, not counted (`grpc` has none). Dropping it
            // is counted, as tonic drops it with the request.
            let traceparent = matches!(path.as_str(), "grpc-traceparent" | "grpc-unsampled");
            let mut metadata: Vec<MetadataMap> = if traceparent {
                (0..WARMUP + decisions).map(unsampled_parent).collect()
            } else {
                vec![MetadataMap::new()]
            };
            if path.starts_with("grpc-unsampled") {
                if let Err(e) = check_unsampled(&metadata[0]) {
                    eprintln!("{e}: the measured path is not the one intended");
                    return ExitCode::FAILURE;
                }
            }
            run(decisions, slowdown, &clock, |i| {
                let Ok(request) = tollgate::server::decode_request(wire[i % KEYS].as_slice()) else {
                    return false;
                };
                let request = if traceparent {
                    tonic::Request::from_parts(std::mem::take(&mut metadata[i]), tonic::Extensions::new(), request)
                } else {
                    tonic::Request::new(request)
                };
                let response = block_on(service.should_rate_limit(request));
                response.is_ok_and(|r| {
                    let r = r.into_inner();
                    black_box(r.encode_to_vec());
                    r.overall_code == Code::Ok as i32
                })
            })
        }
        other => {
            eprintln!(
                "unknown path {other:?}: memory, grpc, grpc-traceparent, grpc-unsampled, grpc-unsampled-root, envoy, \
                 gateway10, gateway10000 or redis-client"
            );
            return ExitCode::from(2);
        }
    };
    if admitted != decisions {
        eprintln!("{admitted} of {decisions} decisions admitted: the measured path is not the one intended");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Decisions before the measured ones: every key's bucket is in the store, and whatever is set
/// up lazily at a first use (the metrics' handles, the clock calibration of the metrics
/// library, which loops until the clock looks stable: a count that differs from run to run) is
/// done.
const WARMUP: usize = 2 * KEYS;

/// Runs [`WARMUP`] decisions, then `decisions` in [`measured_decisions`], the one function
/// whose instructions the gate collects (`--toggle-collect`); returns how many of those were
/// admitted.
fn run(decisions: usize, slowdown: u64, clock: &ManualClock, mut decide: impl FnMut(usize) -> bool) -> usize {
    for i in 0..WARMUP {
        clock.advance_us(STEP_US);
        decide(i);
    }
    measured_decisions(decisions, slowdown, clock, &mut decide)
}

/// The decisions the gate counts: `decide` for `WARMUP..WARMUP + decisions`, the clock moved
/// [`STEP_US`] before each; returns how many were admitted.
#[inline(never)]
fn measured_decisions(
    decisions: usize,
    slowdown: u64,
    clock: &ManualClock,
    decide: &mut impl FnMut(usize) -> bool,
) -> usize {
    let mut admitted = 0;
    for i in WARMUP..WARMUP + decisions {
        clock.advance_us(STEP_US);
        if decide(i) {
            admitted += 1;
        }
        let mut x = 0u64;
        for round in 0..slowdown {
            x = black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(round));
        }
        black_box(x);
    }
    admitted
}

/// An OTLP endpoint on loopback where nothing listens (the discard port): nothing is sampled,
/// so nothing is ever sent.
const NOWHERE: &str = "http://127.0.0.1:9";

/// Starts traces as `tollgate serve` does when an OTLP endpoint is set (`Traces::start`, then
/// its `init_logging`: the OpenTelemetry layer under the log's fmt layer at `info`, here
/// writing nowhere), exporting over OTLP/gRPC to [`NOWHERE`]; `root_ratio` is
/// `tracing.sampling_ratio`. Returns the runtime the exporter's channel lives on and the
/// tracer provider, both to be kept.
fn start_traces(
    root_ratio: Option<f64>,
) -> Result<Option<(tokio::runtime::Runtime, tollgate::traces::Traces)>, String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let settings = tollgate::traces::TracingSettings {
        enabled: true,
        endpoint: Some(NOWHERE.to_owned()),
        protocol: Some(tollgate::traces::OtlpProtocol::Grpc),
        sampling_ratio: root_ratio,
        ..Default::default()
    };
    let traces = tollgate::traces::Traces::start(&settings, runtime.handle(), "memory")?
        .ok_or("tracing is off (OTEL_SDK_DISABLED?)")?;
    let filter = tracing_subscriber::EnvFilter::new("info,sqlx::postgres::notice=error,sqlx_postgres::options=error");
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_writer(std::io::sink)
        .with_filter(filter)
        .boxed();
    tracing_subscriber::registry()
        .with(Some(traces.layer()))
        .with(fmt)
        .try_init()
        .map_err(|e| e.to_string())?;
    Ok(Some((runtime, traces)))
}

/// Call `i`'s metadata from a caller that did not sample its trace: a W3C `traceparent` with
/// the sampled flag off, a trace and parent span of its own.
fn unsampled_parent(i: usize) -> MetadataMap {
    let mut metadata = MetadataMap::new();
    let value = format!(
        "00-{:032x}-{:016x}-00",
        0x4bf9_2f35_77b3_4da6_u128 << 64 | (i as u128 + 1),
        i + 1
    );
    metadata.insert("traceparent", value.parse().expect("an ASCII value"));
    metadata
}

/// Checks that tracing is on and that a call with `metadata` is not sampled: it makes no server
/// span, or one in a trace that is not sampled (so the path measures what it says).
fn check_unsampled(metadata: &MetadataMap) -> Result<(), String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !tollgate::telemetry::traces_on() {
        return Err("tracing is off".to_owned());
    }
    let span = tollgate::traces::server_span(metadata);
    if span.is_disabled() {
        return Ok(());
    }
    let cx = span.context();
    let context = cx.span().span_context().clone();
    if context.is_sampled() {
        return Err(format!("the call is sampled: {context:?}"));
    }
    Ok(())
}

/// One token of the value `i` of the bench rules' descriptor `k`.
fn request(i: usize) -> RateLimitRequest {
    RateLimitRequest {
        domain: "bench".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "k".to_owned(),
                value: i.to_string(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

/// Client `i` of the Envoy shape: `[remote_address]`, `[api_key, path]`, `[generic_key=global]`
/// and `[header_match=premium, tenant]`, as `tollgate-loadgen run --shape envoy` sends them
/// (8 paths, 50 tenants).
fn envoy_request(i: usize) -> RateLimitRequest {
    let descriptor = |entries: &[(&str, String)]| RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).to_owned(),
                value: value.clone(),
            })
            .collect(),
        ..Default::default()
    };
    RateLimitRequest {
        domain: "bench_envoy".to_owned(),
        descriptors: vec![
            descriptor(&[("remote_address", format!("10.0.{}.{}", i >> 8, i & 0xff))]),
            descriptor(&[
                ("api_key", format!("ak_live_{i:016x}")),
                ("path", format!("/api/v1/route{}", i % 8)),
            ]),
            descriptor(&[("generic_key", "global".to_owned())]),
            descriptor(&[
                ("header_match", "premium".to_owned()),
                ("tenant", format!("tenant-{:02}", i % 50)),
            ]),
        ],
        hits_addend: 1,
    }
}

/// Envoy Gateway's rules for `routes` routes, written to a new temporary directory (`None`
/// for the other paths): route `r`'s descriptor is keyed and valued by its name, which ends
/// in `*`, with a key-only client entry below it, as `scripts/bench-compare` writes them.
fn tempdir_for_rules(routes: Option<usize>) -> Option<std::path::PathBuf> {
    let routes = routes?;
    let dir = std::env::temp_dir().join(format!("tollgate-instructions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let mut yaml = String::from("domain: envoy-gateway/gateway-1/http\ndescriptors:\n");
    for r in 0..routes {
        let route = gateway_route(r);
        yaml.push_str(&format!(
            "  - key: {route}\n    value: \"{route}\"\n    descriptors:\n      - key: rule-0-match-0\n        \
             rate_limit: {{unit: second, requests_per_unit: 1000000}}\n"
        ));
    }
    std::fs::write(dir.join("gateway.yaml"), yaml).ok()?;
    Some(dir)
}

/// The name Envoy Gateway gives route `r`'s first rule and match.
fn gateway_route(r: usize) -> String {
    format!("httproute/default/route-{r}/rule/0/match/0/*")
}

/// Client `i` on route `i` mod 10, as `tollgate-loadgen run --shape gateway --routes 10`.
fn gateway_request(i: usize) -> RateLimitRequest {
    let route = gateway_route(i % 10);
    RateLimitRequest {
        domain: "envoy-gateway/gateway-1/http".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![
                Entry {
                    key: route.clone(),
                    value: route,
                },
                Entry {
                    key: "rule-0-match-0".to_owned(),
                    value: i.to_string(),
                },
            ],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

/// The `redis-client` path: per decision, the key of the bench rules' bucket for value `i`,
/// the lean request's fields, the answer of a script that found the bucket stored 2 µs earlier
/// holding half its tokens, and the decision tollgate takes on it.
fn redis_client(decisions: usize, slowdown: u64) -> ExitCode {
    use tollgate::core::bucket::{decide, Demand, DemandKind, Limit, Rate, MICRO};
    use tollgate::core::schedule::Plan;
    use tollgate::store::redis::{keys, script};
    let plan = Plan::Fixed(Limit::new(1_000_000, Rate::per(1_000_000, 1_000_000).expect("a rate")));
    let demands = [Demand {
        instance: 0,
        kind: DemandKind::Consume(MICRO),
        enforced: true,
    }];
    let clock = ManualClock::new(START_US);
    let identities: Vec<String> = (0..KEYS)
        .map(|i| {
            let mut id = String::new();
            let entries = [Entry {
                key: "k".to_owned(),
                value: i.to_string(),
            }];
            tollgate::rules::instance_key(&mut id, "bench", "per_key", &entries, &[]);
            id
        })
        .collect();
    let admitted = run(decisions, slowdown, &clock, |i| {
        let now = START_US + (i as u64 + 1) * STEP_US;
        let key = keys::bucket_key("tollgate:", &identities[i % KEYS]);
        let Some(limits) = script::lean_limits(std::iter::once(&plan), &demands) else {
            return false;
        };
        let argv = script::encode_lean(&limits, &demands);
        black_box((&key, &argv));
        let stored: Vec<u8> = [500_000.0 * MICRO as f64, (now - STEP_US) as f64, 0.0]
            .iter()
            .flat_map(|x: &f64| x.to_le_bytes())
            .collect();
        let answer = fred::types::Value::Bytes(stored.into());
        let Ok(script::LeanReply::Decided(states)) = script::parse_lean(&answer, 1) else {
            return false;
        };
        let states: Vec<_> = states.iter().map(|s| s.expect("stored")).collect();
        !decide(now, &states, &limits, &demands).denied
    });
    if admitted != decisions {
        eprintln!("{admitted} of {decisions} decisions admitted: the measured path is not the one intended");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Drives a future that completes without waiting, as the memory store's always does: polled
/// once with a no-op waker, nothing is added to what is counted; one that waits is finished on
/// a current-thread runtime.
#[inline(always)]
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime")
            .block_on(future),
    }
}
