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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeaderSettings {
    /// `Retry-After: <seconds>` on `OVER_LIMIT` (RFC 9110 section 10.2.3).
    pub retry_after: bool,
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
    pub ratelimit: bool,
    /// The older `X-RateLimit-Limit`, `-Remaining`, `-Reset` triple.
    pub x_ratelimit: bool,
    /// envoyproxy/ratelimit's three headers (their `LIMIT_RESPONSE_HEADERS_ENABLED`).
    pub limit_headers: LimitHeaders,
}

/// envoyproxy/ratelimit's response headers (`LIMIT_RESPONSE_HEADERS_ENABLED`, with the names
/// of `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`), computed as
/// theirs from one descriptor's status: the last one `OVER_LIMIT` outside quota mode, else the
/// one with the fewest `limit_remaining` among those with a `current_limit` (the first on a
/// tie). Its `requests_per_unit`, its `limit_remaining`, and its `duration_until_reset` in
/// whole seconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitHeaders {
    /// Whether the three headers are added (none when no descriptor has a `current_limit`).
    pub enabled: bool,
    /// The name of the header holding `requests_per_unit` (their default `RateLimit-Limit`).
    pub limit: String,
    /// The name of the header holding `limit_remaining` (their default `RateLimit-Remaining`).
    pub remaining: String,
    /// The name of the header holding the seconds until reset (their default
    /// `RateLimit-Reset`).
    pub reset: String,
}

impl Default for LimitHeaders {
    fn default() -> Self {
        LimitHeaders {
            enabled: false,
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

impl LimitHeaders {
    /// What is wrong with the names, one message per name that is not an HTTP field name
    /// (RFC 9110 section 5.1: one or more token characters).
    pub fn problems(&self) -> Vec<String> {
        let is_tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        [
            ("limit", &self.limit),
            ("remaining", &self.remaining),
            ("reset", &self.reset),
        ]
        .into_iter()
        .filter(|(_, name)| name.is_empty() || !name.chars().all(is_tchar))
        .map(|(field, name)| format!("headers.limit_headers.{field} must be an HTTP header name, not {name:?}"))
        .collect()
    }
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
            limit_headers: LimitHeaders::default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_header_names_must_be_header_names() {
        assert!(LimitHeaders::default().problems().is_empty());
        let bad = LimitHeaders {
            enabled: true,
            limit: String::new(),
            remaining: "Rate Limit".into(),
            reset: "X-Reset".into(),
        };
        let problems = bad.problems();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("headers.limit_headers.limit"), "{problems:?}");
        assert!(problems[1].contains("\"Rate Limit\""), "{problems:?}");
    }
}
