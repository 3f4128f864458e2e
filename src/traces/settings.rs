//! The `tracing:` settings section (docs/monitoring.md, "Traces").

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// OpenTelemetry traces over OTLP. Tracing is on when `enabled` is true or when the standard
/// `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (and
/// `OTEL_SDK_DISABLED` is not `true`). Every field left `null` falls back to the standard
/// OpenTelemetry variable named in its doc, then to the OpenTelemetry default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingSettings {
    /// Export traces even when no `OTEL_EXPORTER_OTLP_*ENDPOINT` variable is set (to
    /// `endpoint`, or OTLP's default `http://localhost:4317` / `:4318`).
    pub enabled: bool,
    /// The collector: `http://host:4317` for gRPC; for HTTP/protobuf the full traces URL
    /// (`http://host:4318/v1/traces`). `null`: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, then
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (with `/v1/traces` appended for HTTP).
    pub endpoint: Option<String>,
    /// `grpc` or `http/protobuf`. `null`: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, then
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`, then `grpc`.
    pub protocol: Option<OtlpProtocol>,
    /// The `service.name` resource attribute. `null`: `OTEL_SERVICE_NAME` (or
    /// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`), then `tollgate`.
    pub service_name: Option<String>,
    /// More resource attributes (`service.namespace`, `deployment.environment`, ...), over
    /// those of `OTEL_RESOURCE_ATTRIBUTES`.
    pub resource_attributes: BTreeMap<String, String>,
    /// Sample this share (0.0 to 1.0) of the traces that start here; a call whose caller sent
    /// a trace context follows the caller's decision (parent-based). `null`:
    /// `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, then `parentbased_always_on`.
    pub sampling_ratio: Option<f64>,
    /// The propagators read from a call's gRPC metadata, as `OTEL_PROPAGATORS` names them:
    /// `tracecontext`, `baggage`, `b3` (single header), `b3multi` (the `x-b3-*` headers),
    /// `none`. `null`: `OTEL_PROPAGATORS`, then all of `tracecontext`, `baggage`, `b3` and
    /// `b3multi` (Envoy's tracers send one or the other).
    pub propagators: Option<Vec<String>>,
    /// Descriptor keys whose values may become span attributes
    /// (`ratelimit.descriptor.<key>`). Values are never attributes otherwise: they are API
    /// keys, user ids and addresses.
    pub value_keys: Vec<String>,
}

/// How spans travel to the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (port 4317).
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl OtlpProtocol {
    /// The protocol an `OTEL_EXPORTER_OTLP_*PROTOCOL` value names; `None` for anything else
    /// (`http/json` is not offered).
    pub fn parse(value: &str) -> Option<OtlpProtocol> {
        match value.trim() {
            "grpc" => Some(OtlpProtocol::Grpc),
            "http/protobuf" | "http" => Some(OtlpProtocol::HttpProtobuf),
            _ => None,
        }
    }
}

/// The propagator names `tracing.propagators` and `OTEL_PROPAGATORS` accept.
pub const PROPAGATORS: [&str; 5] = ["tracecontext", "baggage", "b3", "b3multi", "none"];

impl TracingSettings {
    /// Checks the values serde cannot: the ratio's range, the propagators' names.
    ///
    /// Errors: a message naming the setting and the value.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(ratio) = self.sampling_ratio {
            if !(0.0..=1.0).contains(&ratio) {
                return Err(format!("tracing.sampling_ratio must be between 0 and 1, not {ratio}"));
            }
        }
        for name in self.propagators.iter().flatten() {
            if !PROPAGATORS.contains(&name.as_str()) {
                return Err(format!(
                    "tracing.propagators: unknown propagator {name:?} (known: {})",
                    PROPAGATORS.join(", ")
                ));
            }
        }
        if let Some(endpoint) = &self.endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err("tracing.endpoint must be an http:// or https:// URL".to_owned());
            }
        }
        Ok(())
    }
}
