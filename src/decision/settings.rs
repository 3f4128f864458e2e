//! The settings sections the decision path takes: the bounds on one request and the headers
//! a response asks Envoy to add.

use serde::{Deserialize, Serialize};

/// Bounds on one `RateLimitRequest`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestLimits {
    /// Most descriptors in one request.
    pub max_descriptors: usize,
    /// Most entries in one descriptor.
    pub max_entries: usize,
    /// Longest descriptor value, in bytes (of UTF-8). A longer value is cut to this length
    /// (at a character boundary) and marked, then decided like any other (docs/rules.md).
    pub max_value_bytes: usize,
}

/// Response headers tollgate asks Envoy to add (`response_headers_to_add`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeaderSettings {
    /// `Retry-After: <seconds>` on `OVER_LIMIT` (RFC 9110 section 10.2.3).
    pub retry_after: bool,
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
    pub ratelimit: bool,
    /// The older `X-RateLimit-Limit`, `-Remaining`, `-Reset` triple.
    pub x_ratelimit: bool,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_descriptors: 64,
            max_entries: 32,
            max_value_bytes: 4096,
        }
    }
}

impl Default for HeaderSettings {
    fn default() -> Self {
        HeaderSettings {
            retry_after: true,
            ratelimit: true,
            x_ratelimit: false,
        }
    }
}

/// envoyproxy/ratelimit's request-wide answers (docs/rules.md, "Quota mode" and "Response
/// metadata"): both off by default, and then free on the decision path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponseSettings {
    /// Every limited descriptor is in quota mode, as if each rule said `quota_mode: true`
    /// (envoyproxy/ratelimit's `QUOTA_MODE`): the request is denied only when a descriptor
    /// without quota mode is over its limit, or every quota-mode descriptor is.
    pub quota_mode: bool,
    /// Fill the response's `dynamic_metadata` with the domain, the descriptors, `hits_addend`
    /// and the `metadata` of the rules whose descriptors passed, in envoyproxy/ratelimit's shape
    /// (their `RESPONSE_DYNAMIC_METADATA`).
    pub dynamic_metadata: bool,
}
