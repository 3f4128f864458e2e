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

/// Headers for the application behind Envoy when shadow mode let a request through that it
/// would have denied: put in the response's `request_headers_to_add` (the RLS proto field
/// Envoy adds to the request it forwards upstream on an `OK` answer), so the application can
/// log it or try it out. Off by default. Nothing changes in the decision, its counting or its
/// statuses (docs/rules.md, "Shadow mode").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShadowHeaderSettings {
    /// Add the headers at all.
    pub enabled: bool,
    /// The header set to `would-deny` (a lowercase HTTP header name).
    pub verdict: String,
    /// The header listing the buckets that would have denied, comma-separated in request
    /// order (a bucket's name once; `hidden` buckets left out); `""`: not sent.
    pub buckets: String,
}

impl Default for ShadowHeaderSettings {
    fn default() -> Self {
        ShadowHeaderSettings {
            enabled: false,
            verdict: "x-ratelimit-shadow".into(),
            buckets: "x-ratelimit-shadow-buckets".into(),
        }
    }
}

impl ShadowHeaderSettings {
    /// What is wrong with the settings, each a sentence naming the setting: a header name
    /// that is not a lowercase HTTP token (HTTP/2 carries names lowercase; Envoy refuses a
    /// pseudo-header's `:`), or one header named twice.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let token = |name: &str| {
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b))
        };
        if !token(&self.verdict) {
            problems.push(format!(
                "shadow_headers.verdict {:?} is not a lowercase HTTP header name (letters, digits, -)",
                self.verdict
            ));
        }
        if !self.buckets.is_empty() && !token(&self.buckets) {
            problems.push(format!(
                "shadow_headers.buckets {:?} is not a lowercase HTTP header name (letters, digits, -), or \"\" for none",
                self.buckets
            ));
        }
        if self.buckets == self.verdict {
            problems.push("shadow_headers.buckets names the same header as shadow_headers.verdict".into());
        }
        problems
    }
}
