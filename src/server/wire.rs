//! The gRPC wire edge: `RateLimitService` served with a lenient request codec.
//!
//! Envoy copies request header bytes into descriptor values, and a header may hold bytes that
//! are not UTF-8 (HTTP allows obs-text). The proto declares those fields `string`, so the stock
//! codec rejects such a request before any service code runs, with gRPC `INTERNAL`; Envoy then
//! counts a failed check and, with `failure_mode_deny: false`, lets the request through — and
//! every other limit in the same request with it. One odd byte in a header would bypass all
//! limits. So requests are decoded here with `bytes` fields and converted to the envoy-types
//! messages, replacing invalid sequences with U+FFFD: such a value can never equal a rule's
//! (UTF-8) value, still lands in a key-only bucket, and at worst shares that bucket with other
//! malformed values, which errs on the side of limiting. A request that is not valid protobuf
//! at all is answered `INVALID_ARGUMENT` (docs/rules.md), never `INTERNAL`.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::Status;

/// `envoy.service.ratelimit.v3.RateLimitRequest` with its strings read as bytes (same tags).
#[derive(Clone, PartialEq, Message)]
struct WireRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<WireDescriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`, strings as bytes.
#[derive(Clone, PartialEq, Message)]
struct WireDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<WireEntry>,
    #[prost(message, optional, tag = "2")]
    limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    is_negative_hits: bool,
}

/// `RateLimitDescriptor.Entry`, strings as bytes.
#[derive(Clone, PartialEq, Message)]
struct WireEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// Bytes to a string, without copying when they are UTF-8; invalid sequences become U+FFFD.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl From<WireRequest> for RateLimitRequest {
    fn from(w: WireRequest) -> Self {
        RateLimitRequest {
            domain: text(w.domain),
            descriptors: w
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| Entry {
                            key: text(e.key),
                            value: text(e.value),
                        })
                        .collect(),
                    limit: d.limit,
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: w.hits_addend,
        }
    }
}

/// Decodes one `RateLimitRequest` leniently (see the module docs): what `RequestDecoder`
/// does with a gRPC message's bytes, callable on plain bytes (the fuzz targets in fuzz/).
///
/// Errors: the bytes are not protobuf of that message's shape.
pub fn decode_request(bytes: impl prost::bytes::Buf) -> Result<RateLimitRequest, prost::DecodeError> {
    WireRequest::decode(bytes).map(RateLimitRequest::from)
}

/// Decodes requests leniently (see the module docs) and encodes responses with prost.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LenientCodec;

/// The request half of [`LenientCodec`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RequestDecoder;

/// The response half of [`LenientCodec`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ResponseEncoder;

impl Codec for LenientCodec {
    type Encode = RateLimitResponse;
    type Decode = RateLimitRequest;
    type Encoder = ResponseEncoder;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> ResponseEncoder {
        ResponseEncoder
    }

    fn decoder(&mut self) -> RequestDecoder {
        RequestDecoder
    }
}

impl Encoder for ResponseEncoder {
    type Item = RateLimitResponse;
    type Error = Status;

    fn encode(&mut self, item: RateLimitResponse, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("cannot encode the response: {e}")))
    }
}

impl Decoder for RequestDecoder {
    type Item = RateLimitRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<RateLimitRequest>, Status> {
        decode_request(src).map(Some).map_err(|e| {
            // Rejected before the service sees it, so counted here.
            metrics::counter!(crate::telemetry::REQUESTS, "code" => "invalid_argument").increment(1);
            Status::invalid_argument(format!("malformed RateLimitRequest: {e}"))
        })
    }
}

/// The fully-qualified gRPC service name, as in the proto.
pub(crate) const SERVICE_NAME: &str = "envoy.service.ratelimit.v3.RateLimitService";
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Serves any envoy-types `RateLimitService` over HTTP/2 with [`LenientCodec`]; a drop-in for
/// envoy-types' generated `RateLimitServiceServer`, which uses the strict codec.
#[derive(Debug)]
pub(crate) struct RateLimitServer<T> {
    inner: Arc<T>,
    /// The largest request message read, in bytes (`grpc.max_message_bytes`).
    max_message_bytes: usize,
}

/// The default of [`RateLimitServer::max_message_bytes`]: tonic's, 4 MiB, made explicit.
pub(crate) const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

impl<T> RateLimitServer<T> {
    /// Serves `inner`, reading requests of up to [`DEFAULT_MAX_MESSAGE_BYTES`].
    pub(crate) fn new(inner: T) -> Self {
        RateLimitServer {
            inner: Arc::new(inner),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    /// Reads requests of up to `bytes` (after decompression); a larger one is answered
    /// `OUT_OF_RANGE` unread and counted ([`crate::telemetry::MALFORMED`],
    /// `reason="message_too_large"`).
    pub(crate) fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }
}

impl<T> Clone for RateLimitServer<T> {
    fn clone(&self) -> Self {
        RateLimitServer {
            inner: Arc::clone(&self.inner),
            max_message_bytes: self.max_message_bytes,
        }
    }
}

impl<T> tonic::server::NamedService for RateLimitServer<T> {
    const NAME: &'static str = SERVICE_NAME;
}

struct ShouldRateLimit<T>(Arc<T>);

impl<T: RateLimitService> tonic::server::UnaryService<RateLimitRequest> for ShouldRateLimit<T> {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

impl<T, B> Service<http::Request<B>> for RateLimitServer<T>
where
    T: RateLimitService,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) });
        }
        let method = ShouldRateLimit(Arc::clone(&self.inner));
        let max = self.max_message_bytes;
        Box::pin(async move {
            let resp = tonic::server::Grpc::new(LenientCodec)
                .max_decoding_message_size(max)
                .unary(method, req)
                .await;
            // tonic refuses a message over the limit before the codec sees it, answering
            // OUT_OF_RANGE (trailers-only, so the status is in the headers); nothing else
            // here answers that code.
            if resp.headers().get("grpc-status").is_some_and(|v| v == "11") {
                metrics::counter!(crate::telemetry::REQUESTS, "code" => "out_of_range").increment(1);
                metrics::counter!(crate::telemetry::MALFORMED, "reason" => "message_too_large").increment(1);
                tracing::debug!(max_message_bytes = max, "request message over grpc.max_message_bytes");
            }
            Ok(resp)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_utf8_becomes_replacement_characters_and_valid_text_is_kept() {
        let wire = WireRequest {
            domain: b"edge".to_vec(),
            descriptors: vec![WireDescriptor {
                entries: vec![
                    WireEntry {
                        key: b"api_key".to_vec(),
                        value: vec![b'a', 0xff, b'b'],
                    },
                    WireEntry {
                        key: b"path".to_vec(),
                        value: "/caf\u{e9}".as_bytes().to_vec(),
                    },
                ],
                hits_addend: Some(UInt64Value { value: 0 }),
                ..Default::default()
            }],
            hits_addend: 3,
        };
        let req = RateLimitRequest::from(wire);
        assert_eq!(req.domain, "edge");
        assert_eq!(req.descriptors[0].entries[0].value, "a\u{fffd}b");
        assert_eq!(req.descriptors[0].entries[1].value, "/caf\u{e9}");
        assert_eq!(req.descriptors[0].hits_addend, Some(UInt64Value { value: 0 }));
        assert_eq!(req.hits_addend, 3);
    }

    #[test]
    fn the_wire_types_read_what_envoy_types_write() {
        let req = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                limit: Some(RateLimitOverride {
                    requests_per_unit: 7,
                    unit: 2,
                }),
                hits_addend: Some(UInt64Value { value: 9 }),
                is_negative_hits: true,
            }],
            hits_addend: 4,
        };
        let back = RateLimitRequest::from(WireRequest::decode(req.encode_to_vec().as_slice()).unwrap());
        assert_eq!(back, req);
    }
}
