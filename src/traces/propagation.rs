//! Reading the caller's trace context from a call's gRPC metadata, as Envoy's tracers send it.

use opentelemetry::propagation::{Extractor, TextMapCompositePropagator, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
// The Zipkin crate is deprecated for its exporter, which is not used; its B3 propagator is
// OpenTelemetry's own and has no other home yet.
#[allow(deprecated)]
use opentelemetry_zipkin::{B3Encoding, Propagator as B3Propagator};
use tonic::metadata::{AsciiMetadataKey, KeyRef, MetadataMap};

/// The configured propagators, each tried in turn; the last one that finds a valid context
/// wins (OpenTelemetry's composite), so a call carrying both W3C and B3 headers follows W3C
/// when `tracecontext` is listed after `b3`.
pub(crate) struct Propagation {
    composite: TextMapCompositePropagator,
    /// Whether `traceparent` (W3C) is read: only then is an unreadable one counted.
    w3c: bool,
    /// Whether `b3` single headers are read: only then is an unreadable one counted.
    b3: bool,
    /// Whether B3 is read at all (single or multi): its propagator tries both forms.
    b3_any: bool,
    /// The headers [`Propagation::glance`] looks for, parsed once.
    traceparent: AsciiMetadataKey,
    b3_single: AsciiMetadataKey,
    b3_trace_id: AsciiMetadataKey,
}

/// What a call's metadata says of its trace at a glance, without building a context: enough to
/// drop a call that is not sampled before anything else is done for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Glance {
    /// A W3C `traceparent` in its canonical version-00 form, read exactly as the full
    /// extraction reads it, and which wins over any B3 header there: the caller's sampled flag.
    Parent { sampled: bool },
    /// No header a configured propagator reads a span context from: a new trace.
    Root,
    /// Anything else (B3 headers, a `traceparent` in another form or one that does not parse):
    /// for [`Propagation::extract`].
    Unknown,
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
            b3_any: b3 || b3multi,
            traceparent: AsciiMetadataKey::from_static("traceparent"),
            b3_single: AsciiMetadataKey::from_static("b3"),
            b3_trace_id: AsciiMetadataKey::from_static("x-b3-traceid"),
        }
    }

    /// A glance at `metadata`: two or three header lookups and, for a `traceparent`, a scan
    /// of its 55 bytes; no allocation.
    pub(crate) fn glance(&self, metadata: &MetadataMap) -> Glance {
        if self.w3c {
            if let Some(value) = metadata.get(&self.traceparent) {
                return match canonical_traceparent(value.as_bytes()) {
                    Some(sampled) => Glance::Parent { sampled },
                    None => Glance::Unknown,
                };
            }
        }
        // The B3 propagator reads the single header, else the multi ones, which need a trace id.
        if self.b3_any && (metadata.contains_key(&self.b3_single) || metadata.contains_key(&self.b3_trace_id)) {
            return Glance::Unknown;
        }
        Glance::Root
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

/// The sampled flag of a W3C `traceparent` in exactly the form
/// `00-<32 lowercase hex, not all 0>-<16 lowercase hex, not all 0>-<2 lowercase hex>`; `None`
/// for any other value. OpenTelemetry's W3C propagator reads every such value as a valid
/// remote context with that flag (and more values besides, which are left to it).
fn canonical_traceparent(value: &[u8]) -> Option<bool> {
    if value.len() != 55 || !value.starts_with(b"00-") || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    // One table lookup a byte (this runs on every call): the digits' values OR-ed together, so
    // that a byte that is no lowercase hex digit sets NOT_HEX and an all-zero id leaves 0.
    let digits = |s: &[u8]| s.iter().fold(0u8, |acc, &c| acc | LOWER_HEX[usize::from(c)]);
    let (trace_id, span_id, flags) = (digits(&value[3..35]), digits(&value[36..52]), digits(&value[53..55]));
    if (trace_id | span_id | flags) & NOT_HEX != 0 || trace_id == 0 || span_id == 0 {
        return None;
    }
    // The sampled flag is the flags byte's lowest bit: the second hex digit's.
    Some(LOWER_HEX[usize::from(value[54])] & 1 == 1)
}

/// Set in [`LOWER_HEX`] for a byte that is not a lowercase hex digit.
const NOT_HEX: u8 = 0x10;

/// Each byte's value as a lowercase hex digit, or [`NOT_HEX`].
static LOWER_HEX: [u8; 256] = {
    let mut table = [NOT_HEX; 256];
    let mut i = 0;
    while i < 10 {
        table[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        table[b'a' as usize + i] = 10 + i as u8;
        i += 1;
    }
    table
};

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
    fn a_glance_reads_what_the_full_extraction_reads() {
        let p = all();
        let cases: [(&[(&'static str, &'static str)], Glance); 11] = [
            (&[], Glance::Root),
            (&[("x-request-id", "r1")], Glance::Root),
            (
                &[("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")],
                Glance::Parent { sampled: false },
            ),
            (
                &[("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03")],
                Glance::Parent { sampled: true },
            ),
            (
                &[("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-fe")],
                Glance::Parent { sampled: false },
            ),
            // W3C wins over B3 in the full extraction too.
            (
                &[
                    ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
                    ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"),
                ],
                Glance::Parent { sampled: false },
            ),
            // Upper case, an all-zero id, another version, spaces: left to the full extraction.
            (
                &[("traceparent", "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-00")],
                Glance::Unknown,
            ),
            (
                &[("traceparent", "00-00000000000000000000000000000000-b7ad6b7169203331-00")],
                Glance::Unknown,
            ),
            (
                &[("traceparent", "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")],
                Glance::Unknown,
            ),
            (
                &[("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-0")],
                Glance::Unknown,
            ),
            (&[("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124")], Glance::Unknown),
        ];
        for (headers, glance) in cases {
            let map = metadata(headers);
            assert_eq!(p.glance(&map), glance, "{headers:?}");
            // Whatever the glance reads, the full extraction reads the same way.
            let (cx, _) = p.extract(&map);
            let span = cx.span();
            let context = span.span_context();
            match glance {
                Glance::Parent { sampled } => {
                    assert!(context.is_valid() && context.is_remote(), "{headers:?}");
                    assert_eq!(context.is_sampled(), sampled, "{headers:?}");
                }
                Glance::Root => assert!(!context.is_valid(), "{headers:?}"),
                Glance::Unknown => {}
            }
        }
        // Without W3C among the propagators a traceparent is not read: a new trace.
        let b3_only = Propagation::new(&["b3".to_owned()]);
        let map = metadata(&[("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")]);
        assert_eq!(b3_only.glance(&map), Glance::Root);
        assert!(!b3_only.extract(&map).0.span().span_context().is_valid());
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
