//! An in-process limiter for integration tests: rules from YAML, the memory store on a
//! [`ManualClock`], and small builders for requests and for reading responses.

use std::io::Write;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tollgate::core::clock::ManualClock;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::rules::load_rules;
use tollgate::rules::RuleSet;
use tollgate::server::settings::{HeaderSettings, RequestLimits};
use tollgate::store::MemoryStore;

pub const OK: i32 = Code::Ok as i32;
pub const OVER: i32 = Code::OverLimit as i32;

/// A limiter over rules from YAML, deciding on a manual clock.
pub struct Harness {
    pub limiter: Limiter<MemoryStore>,
    pub clock: ManualClock,
}

/// The default options: default request bounds and headers, no global shadow mode, Envoy
/// overrides honoured.
pub fn options() -> LimiterOptions {
    LimiterOptions {
        limits: RequestLimits::default(),
        headers: HeaderSettings::default(),
        shadow_mode: false,
        shadow_headers: Default::default(),
        overrides: true,
        refunds: true,
        near_limit_ratio: 0.8,
        on_store_failure: tollgate::server::settings::FailureMode::Error,
        response: Default::default(),
    }
}

/// Compiles one rules file written to a temporary file; panics with the errors if it is
/// rejected.
pub fn rules(yaml: &str) -> RuleSet {
    let mut file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    file.write_all(yaml.as_bytes()).unwrap();
    load_rules(file.path()).unwrap_or_else(|e| panic!("rules should load: {e}"))
}

/// A harness whose clock starts at `now_us`.
pub fn harness_at(yaml: &str, options: LimiterOptions, now_us: u64) -> Harness {
    let clock = ManualClock::new(now_us);
    let store = MemoryStore::new(4, 10_000, Arc::new(clock.clone()));
    Harness {
        limiter: Limiter::new(rules(yaml), store, options),
        clock,
    }
}

impl Harness {
    /// Decides `req`; panics if it is not decided.
    pub async fn ask(&self, req: &RateLimitRequest) -> RateLimitResponse {
        self.limiter
            .should_rate_limit(req)
            .await
            .unwrap_or_else(|e| panic!("request should be decided: {e}"))
    }

    pub fn advance_ms(&self, ms: u64) {
        self.clock.advance_us(ms * 1000);
    }
}

pub fn desc(pairs: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: pairs
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A descriptor with its own `hits_addend` (0 is a non-consuming check).
pub fn hits(pairs: &[(&str, &str)], n: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend: Some(UInt64Value { value: n }),
        ..desc(pairs)
    }
}

pub fn refund(pairs: &[(&str, &str)], n: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        is_negative_hits: true,
        ..hits(pairs, n)
    }
}

pub fn req(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

/// A request in domain `d` with one descriptor.
pub fn one(pairs: &[(&str, &str)]) -> RateLimitRequest {
    req("d", vec![desc(pairs)])
}

/// The value of the response header `name`, which must not be sent twice.
pub fn header<'a>(resp: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    let mut found = resp
        .response_headers_to_add
        .iter()
        .filter(|h| h.key.eq_ignore_ascii_case(name));
    let first = found.next().map(|h| h.value.as_str());
    assert!(found.next().is_none(), "header {name} sent twice");
    first
}

/// `(name, requests_per_unit, unit)` of a status's `current_limit`.
pub fn limit_of(s: &DescriptorStatus) -> Option<(&str, u32, Unit)> {
    s.current_limit
        .as_ref()
        .map(|l| (l.name.as_str(), l.requests_per_unit, Unit::try_from(l.unit).unwrap()))
}
