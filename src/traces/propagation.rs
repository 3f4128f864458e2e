//! Reading the caller's trace context from a call's gRPC metadata, as Envoy's tracers send it.

use opentelemetry::propagation::{Extractor, TextMapCompositePropagator, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
// The Zipkin crate is deprecated for its exporter, which is not used; its B3 propagator is
// OpenTelemetry's own and has no other home yet.
#[allow(deprecated)]
use opentelemetry_zipkin::{B3Encoding, Propagator as B3Propagator};
use tonic::metadata::{KeyRef, MetadataMap};

/// The configured propagators, each tried in turn; the last one that finds a valid context
/// wins (OpenTelemetry's composite), so a call carrying both W3C and B3 headers follows W3C
/// when `tracecontext` is listed after `b3`.
pub(crate) struct Propagation {
    composite: TextMapCompositePropagator,
    /// Whether `traceparent` (W3C) is read: only then is an unreadable one counted.
    w3c: bool,
    /// Whether `b3` single headers are read: only then is an unreadable one counted.
    b3: bool,
}

impl Propagation {
    /// The propagators `names` lists (`tracing.propagators` or `OTEL_PROPAGATORS`'s names,
    /// checked before); `none` or an empty list reads no context.
    #[allow(deprecated)]
    pub(crate) fn new(names: &[String]) -> Propagation {
        let mut propagators: Vec<Box<dyn TextMapPropagator + Send + Sync>> = Vec::new();
        let has = |n: &str| names.iter().any(|name| name == n);
        // B3 before W3C: OpenTelemetry's composite lets the later one win, and W3C carries
        // more (tracestate).
        let b3 = has("b3");
        let b3multi = has("b3multi");
        let encoding = match (b3, b3multi) {
            (true, true) => Some(B3Encoding::SingleAndMultiHeader),
            (true, false) => Some(B3Encoding::SingleHeader),
            (false, true) => Some(B3Encoding::MultipleHeader),
            (false, false) => None,
        };
        if let Some(encoding) = encoding {
            propagators.push(Box::new(B3Propagator::with_encoding(encoding)));
        }
        let w3c = has("tracecontext");
        if w3c {
            propagators.push(Box::new(TraceContextPropagator::new()));
        }
        if has("baggage") {
            propagators.push(Box::new(BaggagePropagator::new()));
        }
        Propagation {
            composite: TextMapCompositePropagator::new(propagators),
            w3c,
            b3,
        }
    }

    /// The caller's context from `metadata` (an empty one when it sent none or none that
    /// parses), and whether it sent a `traceparent` or `b3` header that does not parse.
    pub(crate) fn extract(&self, metadata: &MetadataMap) -> (Context, bool) {
        let extractor = Metadata(metadata);
        let cx = self.composite.extract(&extractor);
        let valid = cx.span().span_context().is_valid();
        let unreadable =
            !valid && ((self.w3c && metadata.contains_key("traceparent")) || (self.b3 && metadata.contains_key("b3")));
        (cx, unreadable)
    }
}

/// gRPC metadata read as a text map: ASCII entries only (binary `-bin` ones carry no trace
/// context).
struct Metadata<'a>(&'a MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                KeyRef::Ascii(key) => Some(key.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceId;

    fn all() -> Propagation {
        let names: Vec<String> = ["tracecontext", "baggage", "b3", "b3multi"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        Propagation::new(&names)
    }

    fn metadata(pairs: &[(&'static str, &'static str)]) -> MetadataMap {
        let mut map = MetadataMap::new();
        for (key, value) in pairs {
            map.insert(*key, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn reads_w3c_b3_single_and_multi() {
        let p = all();
        let (cx, bad) = p.extract(&metadata(&[(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )]));
        assert!(!bad);
        assert_eq!(
            cx.span().span_context().trace_id(),
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap()
        );
        let (cx, bad) = p.extract(&metadata(&[(
            "b3",
            "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1",
        )]));
        assert!(!bad);
        assert_eq!(
            cx.span().span_context().trace_id(),
            TraceId::from_hex("80f198ee56343ba864fe8b2a57d3eff7").unwrap()
        );
        let (cx, bad) = p.extract(&metadata(&[
            ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
            ("x-b3-spanid", "a2fb4a1d1a96d312"),
            ("x-b3-sampled", "1"),
        ]));
        assert!(!bad);
        assert_eq!(
            cx.span().span_context().trace_id(),
            TraceId::from_hex("463ac35c9f6413ad48485a3953bb6124").unwrap()
        );
    }

    #[test]
    fn an_unreadable_traceparent_is_flagged_and_reads_as_no_context() {
        let (cx, bad) = all().extract(&metadata(&[("traceparent", "00-not-a-trace-01")]));
        assert!(bad);
        assert!(!cx.span().span_context().is_valid());
        let (_, bad) = all().extract(&metadata(&[]));
        assert!(!bad);
        // Not read, so not counted.
        let (_, bad) = Propagation::new(&["b3".to_owned()]).extract(&metadata(&[("traceparent", "garbage")]));
        assert!(!bad);
    }
}
