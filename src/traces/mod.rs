//! OpenTelemetry traces over OTLP (docs/monitoring.md, "Traces").
//!
//! The rest of the crate makes plain `tracing` spans; this room alone knows OpenTelemetry: it
//! starts the SDK and its OTLP exporter, bridges `tracing` spans to it
//! (`tracing-opentelemetry`), reads the caller's trace context from a call's gRPC metadata
//! (W3C, B3 single and multi, baggage) and makes the one server span of each
//! `ShouldRateLimit` call a child of the caller's span. While tracing is off nothing here runs
//! on a request but one load of an empty cell: no span is made, no metadata read. A call whose
//! trace is not sampled (the caller's decision, or the sampler's for a trace that starts here)
//! is decided before any span is made, and then makes none: it costs a glance at its metadata
//! (or, for a context the glance does not read, the context's extraction and the sampler's
//! answer), not a span's bookkeeping in `tracing` and OpenTelemetry.

mod export;
mod propagation;
mod sampling;
pub mod settings;

use std::sync::{Arc, OnceLock};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use opentelemetry::trace::{SpanKind, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Sampler, SamplingDecision, SdkTracerProvider, ShouldSample};
use opentelemetry_sdk::Resource;
use tonic::metadata::MetadataMap;
use tracing::field::Empty;
use tracing::subscriber::Interest;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::dynamic_filter_fn;
use tracing_subscriber::{Layer, Registry};

use crate::telemetry::TRACE_CONTEXT_INVALID;
use export::{Bounded, InFlight, Watched};
use propagation::{Glance, Propagation};
use sampling::FollowsLinks;
pub use settings::{OtlpProtocol, TracingSettings};

/// What a request needs while tracing is on; unset while it is off.
static STATE: OnceLock<State> = OnceLock::new();

struct State {
    propagation: Propagation,
    /// `tracing.value_keys`: the descriptor keys whose values may be attributes.
    value_keys: Vec<String>,
    /// The backend deciding (`memory`, `redis`, `postgres`), the `ratelimit.backend` attribute.
    backend: &'static str,
    /// The tracer provider's sampler, asked before a call's span is made.
    sampler: Box<dyn ShouldSample>,
    /// The sampler's decision on every trace that starts here (no caller's context), when it
    /// does not depend on the trace id: `Some(false)` for a ratio of 0 or `always_off`.
    roots: Option<bool>,
    /// The sampler's decision on a call whose caller's span is not sampled (`[0]`) or is
    /// (`[1]`), when nothing else changes it: a parent-based sampler follows the caller.
    parents: [Option<bool>; 2],
}

/// The name of the server span in OpenTelemetry, as the sampler sees it.
const SERVER_SPAN: &str = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The tracer provider while tracing is on: its layer goes into the process's subscriber, and
/// [`Traces::shutdown`] exports what is still queued.
pub struct Traces {
    provider: SdkTracerProvider,
}

/// The target of the spans and events OpenTelemetry gets: the crate's own, so a dependency's
/// spans never reach the collector.
const OWN_TARGET: &str = crate::telemetry::OWN_TARGET;

impl Traces {
    /// Starts exporting when `settings.enabled` or an `OTEL_EXPORTER_OTLP_*ENDPOINT` variable
    /// says so (and `OTEL_SDK_DISABLED` is not `true`); `None` otherwise. `runtime` is the
    /// runtime the gRPC exporter's connection lives on; `backend` names the backend in the
    /// spans' attributes. Call it once, before any request.
    ///
    /// Errors: an unknown `OTEL_PROPAGATORS` name or `OTEL_EXPORTER_OTLP_*PROTOCOL`, or an
    /// exporter that cannot be built (the message names the variable or setting; never an
    /// endpoint, which can hold credentials).
    pub fn start(
        settings: &TracingSettings,
        runtime: &tokio::runtime::Handle,
        backend: &'static str,
    ) -> Result<Option<Traces>, String> {
        if !wanted(settings) {
            return Ok(None);
        }
        settings.validate()?;
        let propagators = propagator_names(settings)?;
        let protocol = protocol(settings)?;
        let in_flight = Arc::new(InFlight::default());
        let bound = export::queue_bound();
        let processor = match protocol {
            OtlpProtocol::Grpc => {
                // tonic's channel spawns its connection on the runtime it is made in.
                let _entered = runtime.enter();
                let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
                if let Some(endpoint) = &settings.endpoint {
                    builder = builder.with_endpoint(endpoint.clone());
                }
                let exporter = builder
                    .build()
                    .map_err(|e| format!("cannot build the OTLP/gRPC trace exporter: {e}"))?;
                BatchSpanProcessor::builder(Watched::new(exporter, in_flight.clone())).build()
            }
            OtlpProtocol::HttpProtobuf => {
                // reqwest's blocking client, used on the batch processor's own thread.
                let mut builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
                if let Some(endpoint) = &settings.endpoint {
                    builder = builder.with_endpoint(endpoint.clone());
                }
                let exporter = builder
                    .build()
                    .map_err(|e| format!("cannot build the OTLP/HTTP trace exporter: {e}"))?;
                BatchSpanProcessor::builder(Watched::new(exporter, in_flight.clone())).build()
            }
        };
        // The setting, else the SDK's own choice (OTEL_TRACES_SAMPLER and its argument), kept
        // to decide a call's sampling before its span is made.
        let sampler: Box<dyn ShouldSample> = match settings.sampling_ratio {
            Some(ratio) => Box::new(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))),
            None => opentelemetry_sdk::trace::Config::default().sampler,
        };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Bounded {
                inner: processor,
                in_flight,
                bound,
            })
            .with_resource(resource(settings))
            // A batched round trip's span (a root with links) follows the calls it served.
            .with_sampler(FollowsLinks::new(sampler.clone()))
            .build();
        let state = State {
            propagation: Propagation::new(&propagators),
            value_keys: settings.value_keys.clone(),
            backend,
            roots: fixed_decision(sampler.as_ref(), None),
            parents: [false, true].map(|sampled| fixed_decision(sampler.as_ref(), Some(sampled))),
            sampler,
        };
        if STATE.set(state).is_err() {
            return Err("tracing was started twice".to_owned());
        }
        crate::telemetry::set_traces_on(true);
        Ok(Some(Traces { provider }))
    }

    /// The layer that turns the crate's spans (and the warnings and errors logged in them,
    /// as span events) into OpenTelemetry spans; the bottom layer of the subscriber.
    pub fn layer(&self) -> Box<dyn Layer<Registry> + Send + Sync> {
        let tracer = self.provider.tracer("tollgate");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_filter(
                dynamic_filter_fn(|meta, _| {
                    meta.target().starts_with(OWN_TARGET) && (meta.is_span() || *meta.level() <= tracing::Level::WARN)
                })
                // Our callsites ask every time (`sometimes`, never `always`). A per-layer
                // filter's answer reaches the span it is about through a thread-local that the
                // subscriber's `enabled` sets; a callsite cached as `always` skips that call, and
                // its span is then judged by whatever was asked last on the thread: a
                // dependency's `enabled!` answered no (sqlx after every statement did so) made
                // the next call's server span invisible here.
                // Only the callsites this layer takes: a debug event asking every time would
                // cost an unsampled call its check too.
                .with_callsite_filter(|meta| {
                    if meta.target().starts_with(OWN_TARGET)
                        && (meta.is_span() || *meta.level() <= tracing::Level::WARN)
                    {
                        Interest::sometimes()
                    } else {
                        Interest::never()
                    }
                }),
            )
            .boxed()
    }

    /// Exports what is still queued (for at most a few seconds) and stops the exporter.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!("traces not all exported at shutdown: {e}");
        }
    }
}

/// `sampler`'s decision on every new trace (`parent` `None`), or on every call whose caller's
/// remote span is sampled or not (`Some(flag)`), when the trace id does not change it. The
/// samplers the settings and `OTEL_TRACES_SAMPLER` make follow the caller's flag (parent-based)
/// or decide by the trace id alone, a ratio sampling the ids below a bound: so the lowest and
/// the highest id agree exactly when every id would.
fn fixed_decision(sampler: &dyn ShouldSample, parent: Option<bool>) -> Option<bool> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceState};
    let sampled = |id: u128| {
        let cx = parent.map(|flag| {
            let flags = if flag {
                TraceFlags::SAMPLED
            } else {
                TraceFlags::default()
            };
            opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from(id),
                SpanId::from(1),
                flags,
                true,
                TraceState::NONE,
            ))
        });
        sampler
            .should_sample(cx.as_ref(), TraceId::from(id), SERVER_SPAN, &SpanKind::Server, &[], &[])
            .decision
            != SamplingDecision::Drop
    };
    let (low, high) = (sampled(1), sampled(u128::MAX));
    (low == high).then_some(low)
}

/// Whether a call with the caller's context `parent` may be sampled: the sampler's answer for
/// a valid context (for a parent-based one, the caller's decision), exactly what the SDK will
/// decide for the span; for a new trace, [`State::roots`], or `true` when a ratio between 0
/// and 1 leaves it to the trace id the SDK draws.
fn may_sample(state: &State, parent: &opentelemetry::Context) -> bool {
    let span = parent.span();
    let context = span.span_context();
    if !context.is_valid() {
        return state.roots.unwrap_or(true);
    }
    state
        .sampler
        .should_sample(
            Some(parent),
            context.trace_id(),
            SERVER_SPAN,
            &SpanKind::Server,
            &[],
            &[],
        )
        .decision
        != SamplingDecision::Drop
}

/// Whether tracing is on: the setting, or a standard endpoint variable.
fn wanted(settings: &TracingSettings) -> bool {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    settings.enabled
        || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        || env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
}

/// A variable's value, `None` when unset or empty (OpenTelemetry treats both alike).
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `tracing.propagators`, else `OTEL_PROPAGATORS`, else all four Envoy may send.
fn propagator_names(settings: &TracingSettings) -> Result<Vec<String>, String> {
    if let Some(names) = &settings.propagators {
        return Ok(names.clone());
    }
    let Some(value) = env("OTEL_PROPAGATORS") else {
        return Ok(["tracecontext", "baggage", "b3", "b3multi"].map(String::from).to_vec());
    };
    let names: Vec<String> = value.split(',').map(|n| n.trim().to_owned()).collect();
    for name in &names {
        if !settings::PROPAGATORS.contains(&name.as_str()) {
            return Err(format!(
                "OTEL_PROPAGATORS: unknown propagator {name:?} (known: {})",
                settings::PROPAGATORS.join(", ")
            ));
        }
    }
    Ok(names)
}

/// `tracing.protocol`, else `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, else gRPC.
fn protocol(settings: &TracingSettings) -> Result<OtlpProtocol, String> {
    if let Some(protocol) = settings.protocol {
        return Ok(protocol);
    }
    for name in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Some(value) = env(name) {
            return OtlpProtocol::parse(&value)
                .ok_or_else(|| format!("{name}: {value:?} is not offered (grpc or http/protobuf)"));
        }
    }
    Ok(OtlpProtocol::Grpc)
}

/// The resource: OpenTelemetry's detectors (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`),
/// the setting's service name over them, `tollgate` when none names one, and the version.
fn resource(settings: &TracingSettings) -> Resource {
    let named_by_env = env("OTEL_SERVICE_NAME").is_some()
        || env("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attrs| {
            attrs
                .split(',')
                .any(|pair| pair.split('=').next().is_some_and(|k| k.trim() == "service.name"))
        });
    let mut builder = Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attributes(
            settings
                .resource_attributes
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        );
    match &settings.service_name {
        Some(name) => builder = builder.with_service_name(name.clone()),
        None if !named_by_env => builder = builder.with_service_name("tollgate"),
        None => {}
    }
    builder.build()
}

/// The server span of one `ShouldRateLimit` call, a child of the span the caller's metadata
/// names (or a new root when it names none or one that does not parse, which is counted in
/// [`TRACE_CONTEXT_INVALID`]). A disabled span while tracing is off, and when the call's trace
/// is not sampled: then no span of the crate's exists while the call is decided, which
/// [`crate::telemetry::in_sampled_call`] reads, so its child spans are not made either. Its `trace_id` (and the
/// caller's `x-request-id`) are fields, so warnings logged inside carry them.
pub fn server_span(metadata: &MetadataMap) -> tracing::Span {
    let Some(state) = STATE.get() else {
        return tracing::Span::none();
    };
    // Most calls a sampler drops are seen at a glance (Envoy's unsampled `traceparent`, or no
    // context under a sampler that starts no trace): dropped before a context is built.
    let fixed = match state.propagation.glance(metadata) {
        Glance::Parent { sampled } => state.parents[usize::from(sampled)],
        Glance::Root => state.roots,
        Glance::Unknown => None,
    };
    if fixed == Some(false) {
        return tracing::Span::none();
    }
    let (parent, unreadable) = state.propagation.extract(metadata);
    if unreadable {
        metrics::counter!(TRACE_CONTEXT_INVALID).increment(1);
    }
    if !may_sample(state, &parent) {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        target: "tollgate::traces",
        "ShouldRateLimit",
        otel.name = SERVER_SPAN,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = "envoy.service.ratelimit.v3.RateLimitService",
        rpc.method = "ShouldRateLimit",
        trace_id = Empty,
        request_id = Empty,
        ratelimit.backend = state.backend,
        ratelimit.domain = Empty,
        ratelimit.descriptors = Empty,
        ratelimit.code = Empty,
        ratelimit.statuses = Empty,
        ratelimit.buckets = Empty,
        rpc.grpc.status_code = Empty,
    );
    if span.is_disabled() {
        return span;
    }
    let _ = span.set_parent(parent);
    // The SDK's decision, made now: a new trace's id drawn by a ratio sampler may lose.
    let cx = span.context();
    let context = cx.span().span_context().clone();
    if !context.is_sampled() {
        return tracing::Span::none();
    }
    span.record("trace_id", tracing::field::display(context.trace_id()));
    if let Some(id) = metadata.get("x-request-id").and_then(|v| v.to_str().ok()) {
        span.record("request_id", id);
    }
    span
}

/// Records the request and its answer on `span` (from [`server_span`]): domain, descriptor
/// keys (values only of `tracing.value_keys`), the overall and per-descriptor codes, the
/// buckets that answered.
pub fn record_decision(span: &tracing::Span, request: &RateLimitRequest, answer: Result<&RateLimitResponse, &str>) {
    let Some(state) = STATE.get() else {
        return;
    };
    if span.is_disabled() {
        return;
    }
    span.record("ratelimit.domain", request.domain.as_str());
    span.record("ratelimit.descriptors", describe(request, &state.value_keys).as_str());
    match answer {
        Ok(response) => {
            span.record("ratelimit.code", code_name(response.overall_code));
            let statuses: Vec<&str> = response.statuses.iter().map(|s| code_name(s.code)).collect();
            span.record("ratelimit.statuses", statuses.join(",").as_str());
            let buckets: Vec<&str> = response
                .statuses
                .iter()
                .filter_map(|s| s.current_limit.as_ref())
                .map(|l| l.name.as_str())
                .filter(|n| !n.is_empty())
                .collect();
            if !buckets.is_empty() {
                span.record("ratelimit.buckets", buckets.join(",").as_str());
            }
            span.record("rpc.grpc.status_code", 0);
        }
        Err(why) => {
            span.record("rpc.grpc.status_code", tonic::Code::Unavailable as i32);
            span.set_status(opentelemetry::trace::Status::error(why.to_owned()));
        }
    }
}

/// The descriptors' keys, `;` between descriptors and `,` between entries; an entry whose key
/// `value_keys` names is `key=value`.
fn describe(request: &RateLimitRequest, value_keys: &[String]) -> String {
    let mut out = String::new();
    for (i, descriptor) in request.descriptors.iter().enumerate() {
        if i > 0 {
            out.push(';');
        }
        for (j, entry) in descriptor.entries.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            out.push_str(&entry.key);
            if value_keys.contains(&entry.key) {
                out.push('=');
                out.push_str(&entry.value);
            }
        }
    }
    out
}

/// Envoy's name of a `RateLimitResponse.Code`.
fn code_name(code: i32) -> &'static str {
    match Code::try_from(code) {
        Ok(Code::Ok) => "OK",
        Ok(Code::OverLimit) => "OVER_LIMIT",
        _ => "UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

    #[test]
    fn a_decision_the_trace_id_does_not_change_is_made_once() {
        let parent_based = |root: Sampler| Sampler::ParentBased(Box::new(root));
        // (sampler, a new trace, a caller's unsampled span, a caller's sampled span)
        let cases = [
            (parent_based(Sampler::AlwaysOn), Some(true), Some(false), Some(true)),
            (
                parent_based(Sampler::TraceIdRatioBased(0.0)),
                Some(false),
                Some(false),
                Some(true),
            ),
            (
                parent_based(Sampler::TraceIdRatioBased(0.25)),
                None,
                Some(false),
                Some(true),
            ),
            (
                parent_based(Sampler::TraceIdRatioBased(1.0)),
                Some(true),
                Some(false),
                Some(true),
            ),
            (Sampler::AlwaysOff, Some(false), Some(false), Some(false)),
            // Not parent-based: the caller's flag does not decide, the trace id does.
            (Sampler::TraceIdRatioBased(0.25), None, None, None),
        ];
        for (sampler, root, unsampled, sampled) in cases {
            assert_eq!(fixed_decision(&sampler, None), root, "{sampler:?}");
            assert_eq!(fixed_decision(&sampler, Some(false)), unsampled, "{sampler:?}");
            assert_eq!(fixed_decision(&sampler, Some(true)), sampled, "{sampler:?}");
        }
    }

    #[test]
    fn descriptor_values_are_attributes_only_for_the_named_keys() {
        let request = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    entries: vec![
                        Entry {
                            key: "api_key".into(),
                            value: "secret".into(),
                        },
                        Entry {
                            key: "path".into(),
                            value: "/a".into(),
                        },
                    ],
                    ..Default::default()
                },
                RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "tier".into(),
                        value: "gold".into(),
                    }],
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        assert_eq!(describe(&request, &[]), "api_key,path;tier");
        assert_eq!(describe(&request, &["tier".to_owned()]), "api_key,path;tier=gold");
    }
}
