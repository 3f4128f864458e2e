//! The header builders (`response.rs`) through the decision path, on one token bucket of any
//! capacity, refill and printable name the loader accepts (written as tollgate's YAML and
//! loaded as an operator's file would be). Asserted: every response passes
//! `tollgate_fuzz::check_response` (headers parse back: numbers, RFC 8941 lists, no control
//! characters); the headers agree with the status (`RateLimit` `r` and `X-RateLimit-Remaining`
//! are `limit_remaining`, `q` and `X-RateLimit-Limit` the capacity); and a client that is denied
//! and waits exactly `Retry-After` seconds passes with the same request.
#![no_main]

use std::path::Path;
use std::sync::Arc;

use arbitrary::Arbitrary;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use libfuzzer_sys::fuzz_target;
use tollgate::core::clock::ManualClock;
use tollgate::rules::load_rules_text;
use tollgate::decision::Limiter;
use tollgate::store::MemoryStore;
use tollgate_fuzz::{check_response, limiter_options, now};

const UNITS: [&str; 4] = ["ms", "s", "m", "h"];

#[derive(Arbitrary, Debug)]
struct Input {
    name: String,
    capacity: u32,
    /// Refill `tokens/<period><unit>`; `period` 0 writes none (`10/s`).
    tokens: u32,
    period: u16,
    unit: u8,
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// `hits_addend` of the descriptor: 0 is a check.
    Ask(u32),
    Refund(u32),
    AdvanceMs(u32),
}

fn request(hits: u32, refund: bool) -> RateLimitRequest {
    RateLimitRequest {
        domain: "fuzz".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "k".into(),
                value: "v".into(),
            }],
            hits_addend: Some(UInt64Value { value: u64::from(hits) }),
            is_negative_hits: refund,
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

fuzz_target!(|input: Input| {
    let period = match input.period {
        0 => String::new(),
        p => p.to_string(),
    };
    let refill = format!(
        "{}/{period}{}",
        input.tokens,
        UNITS[usize::from(input.unit) % UNITS.len()]
    );
    // Written through serde_yaml, so any name is quoted as YAML needs.
    let mut bucket = serde_yaml::Mapping::new();
    bucket.insert("capacity".into(), u64::from(input.capacity).into());
    bucket.insert("refill".into(), refill.into());
    let mut buckets = serde_yaml::Mapping::new();
    buckets.insert(input.name.clone().into(), bucket.into());
    let mut descriptor = serde_yaml::Mapping::new();
    descriptor.insert("key".into(), "k".into());
    descriptor.insert("bucket".into(), input.name.clone().into());
    let mut file = serde_yaml::Mapping::new();
    file.insert("domain".into(), "fuzz".into());
    file.insert("buckets".into(), buckets.into());
    file.insert("descriptors".into(), vec![serde_yaml::Value::from(descriptor)].into());
    let text = serde_yaml::to_string(&file).expect("YAML");
    let Ok(rules) = load_rules_text(Path::new("fuzz.yaml"), &text) else {
        return;
    };

    let clock = ManualClock::new(1_774_744_200_000_000);
    let store = MemoryStore::new(1, 16, Arc::new(clock.clone()));
    let limiter = Limiter::new(rules, store, limiter_options());
    let capacity = u64::from(input.capacity);
    let ask = |req: &RateLimitRequest| {
        let resp = now(limiter.should_rate_limit(req)).expect("decided");
        let h = check_response(&resp, 1);
        let status = &resp.statuses[0];
        let limit = status.current_limit.as_ref().expect("the rule's limit");
        assert_eq!(limit.name, input.name);
        let remaining = u64::from(status.limit_remaining);
        assert!(remaining <= capacity, "{remaining} left of {capacity}");
        assert_eq!(h.state.len(), 1);
        assert_eq!(h.state[0].name, input.name, "the name quoted and escaped");
        assert_eq!(h.state[0].get("r"), Some(remaining));
        assert_eq!(h.policy[0].get("q"), Some(capacity));
        assert_eq!(h.x.map(|x| (x.0, x.1)), Some((capacity, remaining)));
        (resp.overall_code == Code::OverLimit as i32, h.retry_after)
    };
    for step in input.steps.iter().take(64) {
        match *step {
            Step::AdvanceMs(ms) => clock.advance_us(u64::from(ms) * 1000),
            Step::Refund(n) => {
                ask(&request(n, true));
            }
            Step::Ask(hits) => {
                let req = request(hits, false);
                let (denied, retry_after) = ask(&req);
                if let (true, Some(seconds)) = (denied, retry_after) {
                    clock.advance_us(seconds * 1_000_000);
                    let (denied, _) = ask(&req);
                    assert!(!denied, "denied again after Retry-After: {seconds} s ({hits} hits)");
                }
            }
        }
    }
});
