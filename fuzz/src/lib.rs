//! What the fuzz targets share: running a decision without a runtime, and the checks every
//! response must pass whatever the input.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use tollgate::decision::{LimitHeaders, LimiterOptions};
use tollgate::server::settings::{FailureMode, HeaderSettings, RequestLimits};

/// Runs a future that completes without waiting, as every memory-store decision does (it never
/// leaves the calling thread): a tokio runtime per input would cost more than the decision.
/// Panics if the future is not ready at once, which would itself be a finding.
pub fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("a memory-store decision waited"),
    }
}

/// One `RateLimit-Policy` or `RateLimit` item parsed back: the bucket name and its parameters.
#[derive(Debug, PartialEq, Eq)]
pub struct SfItem {
    /// The quoted bucket name.
    pub name: String,
    /// Parameters in order (`q`, `w` or `r`, `t`), each a non-negative integer.
    pub params: Vec<(String, u64)>,
}

impl SfItem {
    /// The parameter `key`, if present.
    pub fn get(&self, key: &str) -> Option<u64> {
        self.params.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }
}

/// The headers of a response, parsed back. Panics (a finding) on a header a client could not
/// read: a control character, a number that is not one, a structured field that is not
/// RFC 8941, a name twice.
#[derive(Debug, Default)]
pub struct Headers {
    /// `retry-after`, in seconds.
    pub retry_after: Option<u64>,
    /// `ratelimit-policy` items.
    pub policy: Vec<SfItem>,
    /// `ratelimit` items.
    pub state: Vec<SfItem>,
    /// `x-ratelimit-limit`, `-remaining`, `-reset`.
    pub x: Option<(u64, u64, u64)>,
    /// envoyproxy/ratelimit's `RateLimit-Limit`, `-Remaining`, `-Reset`.
    pub theirs: Option<(u64, u64, u64)>,
}

fn number(key: &str, value: &str) -> u64 {
    assert!(
        !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()),
        "{key}: {value:?} is not a number"
    );
    value.parse().unwrap_or_else(|e| panic!("{key}: {value:?}: {e}"))
}

fn sf_list(key: &str, value: &str, want: &[&str]) -> Vec<SfItem> {
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .unwrap_or_else(|e| panic!("{key}: {value:?} is not an RFC 8941 list: {e}"));
    list.into_iter()
        .map(|entry| {
            let sfv::ListEntry::Item(item) = entry else {
                panic!("{key}: an inner list in {value:?}")
            };
            let name = item
                .bare_item
                .as_string()
                .unwrap_or_else(|| panic!("{key}: an item of {value:?} is not a string"))
                .as_str()
                .to_owned();
            let params = item
                .params
                .iter()
                .map(|(k, v)| {
                    let k = k.as_str();
                    assert!(want.contains(&k), "{key}: unexpected parameter {k} in {value:?}");
                    let n = v
                        .as_integer()
                        .unwrap_or_else(|| panic!("{key}: {k} is not an integer in {value:?}"));
                    let n = u64::try_from(i64::from(n)).unwrap_or_else(|_| panic!("{key}: {k} < 0 in {value:?}"));
                    (k.to_owned(), n)
                })
                .collect();
            SfItem { name, params }
        })
        .collect()
}

/// Parses and checks the headers of `resp` (see [`Headers`]), and the shape of the response: a
/// `Retry-After` only on `OVER_LIMIT`, one status per descriptor, `RateLimit` and
/// `RateLimit-Policy` naming the same buckets in the same order with no more tokens left than
/// the capacity.
pub fn check_response(resp: &RateLimitResponse, descriptors: usize) -> Headers {
    assert_eq!(resp.statuses.len(), descriptors, "one status per descriptor");
    let over = resp.overall_code == Code::OverLimit as i32;
    assert!(
        over || resp.overall_code == Code::Ok as i32,
        "overall code {}",
        resp.overall_code
    );
    assert_eq!(
        over,
        resp.statuses.iter().any(|s| s.code == Code::OverLimit as i32),
        "the overall code is the statuses'"
    );
    let mut h = Headers::default();
    let mut seen: Vec<&str> = Vec::new();
    let mut x = (None, None, None);
    let mut theirs = (None, None, None);
    for hv in &resp.response_headers_to_add {
        let (key, value) = (hv.key.as_str(), hv.value.as_str());
        assert!(!seen.contains(&key), "{key} twice");
        seen.push(key);
        assert!(
            value.bytes().all(|b| (0x20..0x7f).contains(&b)),
            "{key}: {value:?} holds a control or non-ASCII byte"
        );
        match key {
            "retry-after" => h.retry_after = Some(number(key, value)),
            "ratelimit-policy" => h.policy = sf_list(key, value, &["q", "w"]),
            "ratelimit" => h.state = sf_list(key, value, &["r", "t"]),
            "x-ratelimit-limit" => x.0 = Some(number(key, value)),
            "x-ratelimit-remaining" => x.1 = Some(number(key, value)),
            "x-ratelimit-reset" => x.2 = Some(number(key, value)),
            "RateLimit-Limit" => theirs.0 = Some(number(key, value)),
            "RateLimit-Remaining" => theirs.1 = Some(number(key, value)),
            "RateLimit-Reset" => theirs.2 = Some(number(key, value)),
            other => panic!("unexpected header {other}"),
        }
    }
    assert!(h.retry_after.is_none() || over, "Retry-After on an OK answer");
    h.x = match x {
        (Some(l), Some(r), Some(t)) => {
            assert!(r <= l, "x-ratelimit-remaining {r} > x-ratelimit-limit {l}");
            Some((l, r, t))
        }
        (None, None, None) => None,
        partial => panic!("an incomplete X-RateLimit triple: {partial:?}"),
    };
    h.theirs = match theirs {
        (Some(l), Some(r), Some(t)) => Some((l, r, t)),
        (None, None, None) => None,
        partial => panic!("an incomplete RateLimit-Limit triple: {partial:?}"),
    };
    assert_eq!(h.policy.len(), h.state.len(), "RateLimit and RateLimit-Policy differ");
    for (p, s) in h.policy.iter().zip(&h.state) {
        assert_eq!(p.name, s.name, "RateLimit and RateLimit-Policy differ");
        let (q, r) = (p.get("q").expect("q"), s.get("r").expect("r"));
        assert!(r <= q, "{}: r={r} > q={q}", p.name);
    }
    h
}

/// The limiter options the targets decide with: the default request bounds, every header on
/// (so each header builder is exercised), Envoy overrides and refunds honoured, no shadow mode.
pub fn limiter_options() -> LimiterOptions {
    LimiterOptions {
        limits: RequestLimits::default(),
        headers: HeaderSettings {
            retry_after: true,
            ratelimit: true,
            x_ratelimit: true,
            limit_headers: LimitHeaders {
                enabled: true,
                ..LimitHeaders::default()
            },
        },
        shadow_mode: false,
        shadow_headers: Default::default(),
        overrides: true,
        refunds: true,
        near_limit_ratio: 0.8,
        on_store_failure: FailureMode::Error,
        response: Default::default(),
    }
}
