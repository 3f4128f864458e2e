//! The decision path through the public API (docs/rules.md): a `RateLimitRequest` in,
//! a `RateLimitResponse` out, with the memory store on a manual clock.

use crate::harness;

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration;
use harness::{desc, header, hits, limit_of, one, options, refund, req, Harness, OK, OVER};
use tollgate::core::clock::ManualClock;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::rules::load_rules;
use tollgate::rules::OVERRIDE_BUCKET;
use tollgate::server::settings::{HeaderSettings, RequestLimits, ShadowHeaderSettings};
use tollgate::store::MemoryStore;

const T0: u64 = 1_700_000_000_000_000;

fn harness_with(yaml: &str, options: LimiterOptions) -> Harness {
    harness::harness_at(yaml, options, T0)
}

fn harness(yaml: &str) -> Harness {
    harness_with(yaml, options())
}

fn with_override(pairs: &[(&str, &str)], requests_per_unit: u32, unit: i32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit,
            unit,
        }),
        ..desc(pairs)
    }
}

/// `duration_until_reset` for a wait of `us` microseconds: whole seconds, rounded up, never
/// nanoseconds (Envoy's `x-ratelimit-reset` keeps only whole seconds).
fn dur(us: u64) -> Option<Duration> {
    Some(Duration {
        seconds: us.div_ceil(1_000_000) as i64,
        nanos: 0,
    })
}

/// The memory-store key of the instance of bucket `v` for the descriptor `k=v` in domain `d`.
fn instance(v: &str) -> String {
    let mut key = String::new();
    let entries = desc(&[("k", v)]).entries;
    tollgate::rules::instance_key(&mut key, "d", v, &entries, &[]);
    key
}

/// `(code, limit_remaining)` per status.
fn codes(resp: &RateLimitResponse) -> Vec<(i32, u32)> {
    resp.statuses.iter().map(|s| (s.code, s.limit_remaining)).collect()
}

const BASIC: &str = "domain: d
descriptors:
  - key: k
    value: a
    name: a
    token_bucket: {capacity: 5, refill: 5/1m}
  - key: k
    value: b
    name: b
    token_bucket: {capacity: 1, refill: 1/1m}
  - key: k
    value: c
    name: c
    token_bucket: {capacity: 3, refill: 3/1m}
  - key: per_key
    name: per_key
    token_bucket: {capacity: 3, refill: 3/1m}
  - key: free
    unlimited: true
";

// ---- replaces -------------------------------------------------------------------------

const REPLACES: &str = "domain: d
descriptors:
  - key: api_key
    rate_limit:
      name: per_key
      unit: minute
      requests_per_unit: 10
      replaces: [{name: per_ip}]
  - key: remote_address
    rate_limit: {name: per_ip, unit: minute, requests_per_unit: 5}
";

#[tokio::test]
async fn replaced_descriptor_answers_ok_without_a_limit_and_its_bucket_is_untouched() {
    let h = harness(REPLACES);
    let both = req(
        "d",
        vec![desc(&[("api_key", "k1")]), desc(&[("remote_address", "10.0.0.1")])],
    );
    for round in 0..3u32 {
        let resp = h.ask(&both).await;
        assert_eq!(resp.overall_code, OK);
        assert_eq!(limit_of(&resp.statuses[0]), Some(("per_key", 10, Unit::Minute)));
        assert_eq!(resp.statuses[0].limit_remaining, 9 - round);
        let replaced = &resp.statuses[1];
        assert_eq!(replaced.code, OK);
        assert_eq!(replaced.current_limit, None);
        assert_eq!(replaced.limit_remaining, 0);
        assert_eq!(replaced.duration_until_reset, None);
        assert_eq!(header(&resp, "ratelimit-policy"), Some("\"per_key\";q=10;w=60"));
    }
    // per_ip was never touched: alone, the same address starts from a full bucket.
    assert_eq!(h.limiter.store().len(), 1, "only per_key holds state");
    let resp = h.ask(&one(&[("remote_address", "10.0.0.1")])).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("per_ip", 5, Unit::Minute)));
    assert_eq!(resp.statuses[0].limit_remaining, 4);
    // Replacement needs both rules to match one request: an api_key alone changes nothing else.
    let resp = h.ask(&one(&[("api_key", "k2")])).await;
    assert_eq!(resp.statuses[0].limit_remaining, 9);
}

#[tokio::test]
async fn replaces_in_tollgate_schema_on_the_descriptor() {
    let h = harness(
        "domain: d
buckets:
  per_ip: {capacity: 1, refill: 1/1m}
  per_key: {capacity: 2, refill: 2/1m}
descriptors:
  - key: remote_address
    bucket: per_ip
  - key: api_key
    bucket: per_key
    replaces: [{name: per_ip}]
",
    );
    let both = req("d", vec![desc(&[("remote_address", "ip")]), desc(&[("api_key", "k")])]);
    // per_ip (capacity 1) would deny the second request; it is replaced, so per_key decides.
    for remaining in [1, 0] {
        let resp = h.ask(&both).await;
        assert_eq!(resp.overall_code, OK);
        assert_eq!(codes(&resp), vec![(OK, 0), (OK, remaining)]);
        assert_eq!(resp.statuses[0].current_limit, None);
    }
    assert_eq!(h.ask(&both).await.overall_code, OVER);
}

// ---- overrides ------------------------------------------------------------------------

#[tokio::test]
async fn override_applies_without_a_matching_rule_but_not_for_an_unknown_domain() {
    let h = harness(BASIC);
    let override_on = |domain| {
        req(
            domain,
            vec![with_override(
                &[("nothing", "matches")],
                2,
                RateLimitUnit::Minute as i32,
            )],
        )
    };
    let r = override_on("d");
    for remaining in [1, 0] {
        let resp = h.ask(&r).await;
        assert_eq!(resp.overall_code, OK);
        let s = &resp.statuses[0];
        assert_eq!(limit_of(s), Some((OVERRIDE_BUCKET, 2, Unit::Minute)));
        assert_eq!(s.limit_remaining, remaining);
    }
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(resp.statuses[0].code, OVER);
    // 2 per minute: one token every 30 s.
    assert_eq!(header(&resp, "retry-after"), Some("30"));
    assert_eq!(header(&resp, "ratelimit-policy"), Some("\"override\";q=2;w=60"));
    // As in envoyproxy/ratelimit, an unknown domain is OK before any override is looked at.
    let unknown = override_on("unknown-domain");
    for _ in 0..3 {
        let resp = h.ask(&unknown).await;
        assert_eq!(resp.overall_code, OK);
        assert_eq!(resp.statuses[0].current_limit, None);
    }
}

#[tokio::test]
async fn override_replaces_the_matching_rule_and_can_be_turned_off() {
    let r = req("d", vec![with_override(&[("k", "a")], 1, RateLimitUnit::Hour as i32)]);
    let h = harness(BASIC);
    let resp = h.ask(&r).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("override", 1, Unit::Hour)));
    assert_eq!(
        h.ask(&r).await.overall_code,
        OVER,
        "the override (1/h), not rule a (5/min)"
    );
    // The override's instance is its own: rule `a` is still full.
    assert_eq!(h.ask(&one(&[("k", "a")])).await.statuses[0].limit_remaining, 4);

    let h = harness_with(
        BASIC,
        LimiterOptions {
            overrides: false,
            ..options()
        },
    );
    let resp = h.ask(&r).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("a", 5, Unit::Minute)));
    assert_eq!(resp.statuses[0].limit_remaining, 4);
    assert_eq!(h.ask(&r).await.overall_code, OK);
    // Off, an override on an unmatched descriptor or an unknown domain limits nothing, and its
    // unit is not even read.
    for domain in ["d", "unknown-domain"] {
        for unit in [RateLimitUnit::Second as i32, 0, 99] {
            let r = req(domain, vec![with_override(&[("x", "y")], 0, unit)]);
            let resp = h.ask(&r).await;
            assert_eq!(resp.overall_code, OK);
            assert_eq!(resp.statuses[0].current_limit, None);
        }
    }
}

/// An override with a unit Envoy does not define is ignored: the descriptor is decided on its
/// rule and the request's other descriptors as usual (it used to fail the whole request, which
/// Envoy lets through by default).
#[tokio::test]
async fn override_with_an_unknown_unit_is_ignored_and_the_rule_decides() {
    let h = harness(BASIC);
    for unit in [RateLimitUnit::Unknown as i32, 99, -1] {
        let r = req("d", vec![desc(&[("k", "b")]), with_override(&[("k", "a")], 10, unit)]);
        let resp = h.ask(&r).await;
        assert_eq!(resp.overall_code, OK, "unit {unit}");
        let limit = resp.statuses[1].current_limit.as_ref().expect("rule a decided it");
        assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("a", 5));
        h.advance_ms(60_000);
    }
    // Rule b (capacity 1) counted the first descriptor: a second one now is over.
    let r = req("d", vec![desc(&[("k", "b")]), with_override(&[("k", "b")], 10, 99)]);
    assert_eq!(h.ask(&r).await.overall_code, OVER);
}

#[tokio::test]
async fn override_of_zero_denies_without_retry_after() {
    let h = harness(BASIC);
    let r = req("d", vec![with_override(&[("x", "y")], 0, RateLimitUnit::Second as i32)]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(limit_of(&resp.statuses[0]), Some(("override", 0, Unit::Second)));
    assert_eq!(header(&resp, "retry-after"), None);
    // A bucket that never refills announces no reset: `t=0` would tell clients to retry now.
    assert_eq!(resp.statuses[0].duration_until_reset, None);
    assert_eq!(header(&resp, "ratelimit"), Some("\"override\";r=0"));
}

#[tokio::test]
async fn overrides_beyond_the_exact_bounds_are_brought_within_them_and_reported_as_applied() {
    let h = harness(BASIC);
    // Every `uint32` count is within the capacity bound (9,000,000,000): applied as asked.
    let r = req(
        "d",
        vec![with_override(&[("x", "big")], u32::MAX, RateLimitUnit::Second as i32)],
    );
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(limit_of(&resp.statuses[0]), Some(("override", u32::MAX, Unit::Second)));
    assert_eq!(header(&resp, "ratelimit-policy"), Some("\"override\";q=4294967295;w=1"));
    // Too fine a rate per year to compute exactly: rounded down to a multiple of 1,000.
    let r = req(
        "d",
        vec![with_override(
            &[("x", "yearly")],
            999_999_937,
            RateLimitUnit::Year as i32,
        )],
    );
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(limit_of(&resp.statuses[0]), Some(("override", 999_999_000, Unit::Year)));
    assert_eq!(resp.statuses[0].limit_remaining, 999_998_999);
}

// ---- unknown domain, empty and unmatched descriptors ----------------------------------

#[tokio::test]
async fn unknown_domain_is_ok_with_one_status_per_descriptor() {
    let h = harness(BASIC);
    let r = req(
        "nope",
        vec![desc(&[("k", "a")]), desc(&[("k", "b")]), desc(&[("x", "1")])],
    );
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(resp.statuses.len(), 3);
    for s in &resp.statuses {
        assert_eq!(s.code, OK);
        assert_eq!(s.current_limit, None);
    }
    assert!(resp.response_headers_to_add.is_empty());
    assert!(h.limiter.store().is_empty());
}

#[tokio::test]
async fn empty_descriptor_list_is_ok() {
    let h = harness(BASIC);
    for domain in ["d", "nope"] {
        let resp = h.ask(&req(domain, vec![])).await;
        assert_eq!(resp.overall_code, OK);
        assert!(resp.statuses.is_empty());
        assert!(resp.response_headers_to_add.is_empty());
    }
}

#[tokio::test]
async fn unmatched_and_unlimited_descriptors_are_ok_in_request_order() {
    let h = harness(BASIC);
    let r = req(
        "d",
        vec![desc(&[("free", "x")]), desc(&[("k", "b")]), desc(&[("k", "zzz")])],
    );
    let resp = h.ask(&r).await;
    // An unlimited descriptor has the most a `uint32` holds left, as envoyproxy/ratelimit
    // answers it; an unmatched one 0.
    assert_eq!(codes(&resp), vec![(OK, u32::MAX), (OK, 0), (OK, 0)]);
    assert_eq!(resp.statuses[0].current_limit, None);
    assert_eq!(limit_of(&resp.statuses[1]), Some(("b", 1, Unit::Minute)));
    assert_eq!(resp.statuses[2].current_limit, None);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(codes(&resp), vec![(OK, u32::MAX), (OVER, 0), (OK, 0)]);
}

/// An unlimited descriptor answers the `uint32` maximum wherever it stands in the request, past
/// the 64th too when `limits.max_descriptors` allows more (a 64-bit mask answered 0 there).
#[tokio::test]
async fn an_unlimited_descriptor_past_the_64th_has_the_most_left() {
    let mut options = options();
    options.limits.max_descriptors = 100;
    let h = harness_with(BASIC, options);
    let mut descriptors: Vec<_> = (0..69).map(|_| desc(&[("k", "zzz")])).collect();
    descriptors.push(desc(&[("free", "x")]));
    let resp = h.ask(&req("d", descriptors)).await;
    assert_eq!(resp.statuses.len(), 70);
    assert_eq!(resp.statuses[69].limit_remaining, u32::MAX);
    assert!(resp.statuses[..69].iter().all(|s| s.limit_remaining == 0));
}

// ---- hits_addend ----------------------------------------------------------------------

#[tokio::test]
async fn request_hits_addend_zero_means_one() {
    let h = harness(BASIC);
    for remaining in [2, 1, 0] {
        let resp = h.ask(&one(&[("k", "c")])).await;
        assert_eq!(codes(&resp), vec![(OK, remaining)]);
    }
    assert_eq!(h.ask(&one(&[("k", "c")])).await.overall_code, OVER);

    let h = harness(BASIC);
    let r = RateLimitRequest {
        hits_addend: 2,
        ..one(&[("k", "c")])
    };
    assert_eq!(codes(&h.ask(&r).await), vec![(OK, 1)]);
    let resp = h.ask(&r).await;
    assert_eq!(codes(&resp), vec![(OVER, 1)], "2 asked, 1 left: denied, nothing taken");
    // A descriptor's own hits_addend wins over the request's.
    let r = RateLimitRequest {
        hits_addend: 2,
        ..req("d", vec![hits(&[("k", "c")], 1)])
    };
    assert_eq!(codes(&h.ask(&r).await), vec![(OK, 0)]);
}

#[tokio::test]
async fn descriptor_hits_addend_zero_is_a_check_that_changes_nothing() {
    let h = harness(BASIC);
    let check = RateLimitRequest {
        hits_addend: 3, // ignored: the descriptor's explicit 0 wins
        ..req("d", vec![hits(&[("k", "c")], 0)])
    };
    // On a full bucket: OK, full, and no state is created.
    let resp = h.ask(&check).await;
    assert_eq!(codes(&resp), vec![(OK, 3)]);
    assert_eq!(resp.statuses[0].duration_until_reset, dur(0));
    assert!(h.limiter.store().is_empty());
    // Empty the bucket, then check: OVER, with the wait for one token.
    let r = RateLimitRequest {
        hits_addend: 3,
        ..one(&[("k", "c")])
    };
    assert_eq!(codes(&h.ask(&r).await), vec![(OK, 0)]);
    h.advance_ms(1_000);
    let before = h.limiter.store().len();
    let resp = h.ask(&check).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(codes(&resp), vec![(OVER, 0)]);
    // 3 per minute: a token every 20 s, one second of it has passed.
    assert_eq!(header(&resp, "retry-after"), Some("19"));
    assert_eq!(h.limiter.store().len(), before);
    // The check consumed nothing: after 19 s a real hit passes and takes the only token.
    h.advance_ms(19_000);
    assert_eq!(codes(&h.ask(&check).await), vec![(OK, 1)]);
    assert_eq!(codes(&h.ask(&check).await), vec![(OK, 1)]);
    assert_eq!(codes(&h.ask(&one(&[("k", "c")])).await), vec![(OK, 0)]);
    assert_eq!(h.ask(&one(&[("k", "c")])).await.overall_code, OVER);
}

#[tokio::test]
async fn a_check_sees_what_the_same_request_consumes() {
    let h = harness(BASIC);
    // Capacity 3: consume 3 and check the same instance in one request: the check fails (no
    // fourth token) and denies the request, so nothing is consumed.
    let r = req("d", vec![hits(&[("k", "c")], 3), hits(&[("k", "c")], 0)]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(codes(&resp), vec![(OK, 3), (OVER, 3)]);
    let r = req("d", vec![hits(&[("k", "c")], 2), hits(&[("k", "c")], 0)]);
    assert_eq!(codes(&h.ask(&r).await), vec![(OK, 1), (OK, 1)]);
}

#[tokio::test]
async fn descriptor_hits_above_capacity_are_denied_without_retry_after() {
    let h = harness(BASIC);
    for n in [4, 1_000_000_000_000, u64::MAX] {
        let r = req("d", vec![hits(&[("k", "c")], n)]);
        let resp = h.ask(&r).await;
        assert_eq!(resp.overall_code, OVER, "{n}");
        assert_eq!(codes(&resp), vec![(OVER, 3)]);
        assert_eq!(header(&resp, "retry-after"), None, "{n} can never pass");
        assert!(header(&resp, "ratelimit").is_some());
    }
    assert!(h.limiter.store().is_empty(), "nothing consumed");
    // Exactly the capacity is admissible.
    assert_eq!(
        codes(&h.ask(&req("d", vec![hits(&[("k", "c")], 3)])).await),
        vec![(OK, 0)]
    );
}

#[tokio::test]
async fn two_descriptors_on_one_instance_add_up() {
    let h = harness(BASIC);
    let r = req("d", vec![hits(&[("k", "c")], 2), hits(&[("k", "c")], 2)]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER, "2 + 2 > 3");
    assert_eq!(codes(&resp), vec![(OVER, 3), (OVER, 3)]);
    assert!(h.limiter.store().is_empty());
    let r = req("d", vec![desc(&[("k", "c")]), desc(&[("k", "c")])]);
    assert_eq!(codes(&h.ask(&r).await), vec![(OK, 1), (OK, 1)]);
    // Different values of a key-only node are different instances: they do not add up.
    let r = req("d", vec![hits(&[("per_key", "x")], 3), hits(&[("per_key", "y")], 3)]);
    assert_eq!(codes(&h.ask(&r).await), vec![(OK, 0), (OK, 0)]);
}

// ---- all or nothing -------------------------------------------------------------------

#[tokio::test]
async fn a_denied_request_consumes_nothing_anywhere() {
    let h = harness(BASIC);
    // a: 5 -> 3; b: 1 -> 0.
    h.ask(&req("d", vec![hits(&[("k", "a")], 2)])).await;
    h.ask(&one(&[("k", "b")])).await;
    let states = || ["a", "b"].map(|v| h.limiter.store().peek(&instance(v)));
    let before = states();
    assert!(before.iter().all(Option::is_some));
    let both = req("d", vec![desc(&[("k", "a")]), desc(&[("k", "b")])]);
    for _ in 0..3 {
        let resp = h.ask(&both).await;
        assert_eq!(resp.overall_code, OVER);
        // a would have passed: OK, with its unchanged remaining; b is over.
        assert_eq!(codes(&resp), vec![(OK, 3), (OVER, 0)]);
        assert_eq!(limit_of(&resp.statuses[0]), Some(("a", 5, Unit::Minute)));
        assert_eq!(limit_of(&resp.statuses[1]), Some(("b", 1, Unit::Minute)));
    }
    h.advance_ms(1_000);
    let resp = h.ask(&both).await;
    assert_eq!(codes(&resp), vec![(OK, 3), (OVER, 0)]);
    assert_eq!(states(), before, "stored states untouched");
    assert_eq!(codes(&h.ask(&one(&[("k", "a")])).await), vec![(OK, 2)]);
}

// ---- shadow mode ----------------------------------------------------------------------

#[tokio::test]
async fn shadow_rule_never_denies_but_consumes_while_it_has_tokens() {
    let h = harness(
        "domain: d
descriptors:
  - key: shadow
    name: shadow
    shadow_mode: true
    token_bucket: {capacity: 2, refill: 2/1m}
  - key: enforced
    name: enforced
    token_bucket: {capacity: 5, refill: 5/1m}
",
    );
    let r = req("d", vec![desc(&[("shadow", "x")]), desc(&[("enforced", "x")])]);
    let expected_shadow = [1, 0, 0, 0];
    for (i, shadow_left) in expected_shadow.into_iter().enumerate() {
        let resp = h.ask(&r).await;
        assert_eq!(resp.overall_code, OK, "round {i}");
        assert_eq!(resp.statuses[0].code, OK);
        assert_eq!(resp.statuses[0].limit_remaining, shadow_left);
        assert_eq!(limit_of(&resp.statuses[0]), Some(("shadow", 2, Unit::Minute)));
        // The shadow bucket running dry does not stop the enforced one from consuming.
        assert_eq!(resp.statuses[1].limit_remaining, 4 - i as u32);
        assert_eq!(header(&resp, "retry-after"), None);
    }
    // A refilled shadow token is consumed again (it models enforcement).
    h.advance_ms(30_000);
    let resp = h.ask(&one(&[("shadow", "x")])).await;
    assert_eq!(codes(&resp), vec![(OK, 0)]);
}

/// The headers of `resp` for the upstream request (`request_headers_to_add`).
fn upstream_headers(resp: &RateLimitResponse) -> Vec<(&str, &str)> {
    resp.request_headers_to_add
        .iter()
        .map(|h| (h.key.as_str(), h.value.as_str()))
        .collect()
}

fn shadow_headers_on() -> LimiterOptions {
    LimiterOptions {
        shadow_headers: ShadowHeaderSettings {
            enabled: true,
            ..ShadowHeaderSettings::default()
        },
        ..options()
    }
}

const SHADOW_BESIDE_ENFORCED: &str = "domain: d
buckets:
  secret: {capacity: 1, refill: 1/1m, hidden: true}
descriptors:
  - key: shadow
    name: shadow
    shadow_mode: true
    token_bucket: {capacity: 1, refill: 1/1m}
  - key: hidden_shadow
    shadow_mode: true
    bucket: secret
  - key: enforced
    name: enforced
    token_bucket: {capacity: 2, refill: 2/1m}
";

/// A request a shadow rule would have denied tells the upstream so, when asked: the verdict
/// header and the bucket's name in `request_headers_to_add`; statuses and codes as without.
#[tokio::test]
async fn a_shadow_denial_is_told_upstream_when_asked() {
    let r = req("d", vec![desc(&[("shadow", "x")]), desc(&[("enforced", "x")])]);
    let h = harness_with(SHADOW_BESIDE_ENFORCED, shadow_headers_on());
    let first = h.ask(&r).await;
    assert_eq!(first.overall_code, OK);
    assert_eq!(
        upstream_headers(&first),
        [],
        "admitted within every limit: nothing told"
    );
    let second = h.ask(&r).await;
    assert_eq!(second.overall_code, OK);
    assert_eq!(
        codes(&second),
        vec![(OK, 0), (OK, 0)],
        "statuses as without the headers"
    );
    assert_eq!(
        upstream_headers(&second),
        [
            ("x-ratelimit-shadow", "would-deny"),
            ("x-ratelimit-shadow-buckets", "shadow")
        ]
    );
    // The enforced bucket is empty now: a denied request goes nowhere, so nothing is told.
    let denied = h.ask(&r).await;
    assert_eq!(denied.overall_code, OVER);
    assert_eq!(upstream_headers(&denied), []);

    // Off by default: the same decisions, no header.
    let off = harness(SHADOW_BESIDE_ENFORCED);
    for _ in 0..2 {
        assert_eq!(upstream_headers(&off.ask(&r).await), []);
    }

    // A hidden bucket is not named, but its would-be denial is told.
    let hidden = harness_with(SHADOW_BESIDE_ENFORCED, shadow_headers_on());
    let r = one(&[("hidden_shadow", "x")]);
    hidden.ask(&r).await;
    assert_eq!(
        upstream_headers(&hidden.ask(&r).await),
        [("x-ratelimit-shadow", "would-deny")]
    );
}

/// Under global shadow mode every bucket that would have denied is named, each once, with the
/// header names configured; `buckets: ""` leaves the second header out.
#[tokio::test]
async fn global_shadow_mode_tells_every_bucket_that_would_have_denied() {
    let options = LimiterOptions {
        shadow_mode: true,
        shadow_headers: ShadowHeaderSettings {
            enabled: true,
            verdict: "x-shadow".into(),
            buckets: "x-shadow-rules".into(),
        },
        ..options()
    };
    let h = harness_with(SHADOW_BESIDE_ENFORCED, options.clone());
    let r = req(
        "d",
        vec![
            desc(&[("enforced", "x")]),
            desc(&[("shadow", "x")]),
            desc(&[("enforced", "x")]),
        ],
    );
    let first = h.ask(&r).await;
    assert_eq!(first.overall_code, OK);
    assert_eq!(upstream_headers(&first), [], "the two enforced hits fit its two tokens");
    let second = h.ask(&r).await;
    assert_eq!(
        upstream_headers(&second),
        [("x-shadow", "would-deny"), ("x-shadow-rules", "enforced, shadow")]
    );
    let verdict_only = harness_with(
        SHADOW_BESIDE_ENFORCED,
        LimiterOptions {
            shadow_headers: ShadowHeaderSettings {
                buckets: String::new(),
                ..options.shadow_headers.clone()
            },
            ..options
        },
    );
    let r = one(&[("shadow", "x")]);
    verdict_only.ask(&r).await;
    assert_eq!(
        upstream_headers(&verdict_only.ask(&r).await),
        [("x-shadow", "would-deny")]
    );
}

/// Global shadow mode denies nothing, but each descriptor's status says what it would have
/// been, as envoyproxy/ratelimit's `SHADOW_MODE` answers: `OVER_LIMIT` under an overall `OK`.
#[tokio::test]
async fn global_shadow_mode_never_denies() {
    let h = harness_with(
        BASIC,
        LimiterOptions {
            shadow_mode: true,
            ..options()
        },
    );
    let r = req("d", vec![desc(&[("k", "b")]), desc(&[("k", "a")])]);
    assert_eq!(codes(&h.ask(&r).await), vec![(OK, 0), (OK, 4)]);
    for a_left in [3, 2] {
        let resp = h.ask(&r).await;
        assert_eq!(resp.overall_code, OK);
        assert_eq!(codes(&resp), vec![(OVER, 0), (OK, a_left)]);
        assert_eq!(header(&resp, "retry-after"), None);
    }
    // Even a demand that can never pass is not denied; it takes nothing.
    let resp = h.ask(&req("d", vec![hits(&[("k", "c")], 100)])).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(codes(&resp), vec![(OVER, 3)]);
    // A rule's own shadow_mode still answers OK on its status.
    let h = harness_with(
        "domain: d
descriptors:
  - key: k
    shadow_mode: true
    token_bucket: {capacity: 1, refill: 1/1m}
",
        LimiterOptions {
            shadow_mode: true,
            ..options()
        },
    );
    for left in [0, 0] {
        let resp = h.ask(&one(&[("k", "x")])).await;
        assert_eq!((resp.overall_code, codes(&resp)), (OK, vec![(OK, left)]));
    }
}

// ---- refunds --------------------------------------------------------------------------

#[tokio::test]
async fn negative_hits_refund_up_to_capacity_and_answer_ok() {
    let h = harness(BASIC);
    assert_eq!(
        codes(&h.ask(&req("d", vec![hits(&[("k", "a")], 5)])).await),
        vec![(OK, 0)]
    );
    let resp = h.ask(&req("d", vec![refund(&[("k", "a")], 2)])).await;
    assert_eq!(codes(&resp), vec![(OK, 2)]);
    assert_eq!(limit_of(&resp.statuses[0]), Some(("a", 5, Unit::Minute)));
    // Capped at capacity; the full bucket is then the same as no bucket.
    let resp = h.ask(&req("d", vec![refund(&[("k", "a")], 1_000)])).await;
    assert_eq!(codes(&resp), vec![(OK, 5)]);
    assert_eq!(resp.statuses[0].duration_until_reset, dur(0));
    assert!(h.limiter.store().is_empty());
    // A refund on a full bucket stays full; a huge one does not overflow.
    let resp = h.ask(&req("d", vec![refund(&[("k", "a")], u64::MAX)])).await;
    assert_eq!(codes(&resp), vec![(OK, 5)]);
    // Without its own hits_addend a refund gives back the request's (0 meaning 1).
    h.ask(&req("d", vec![hits(&[("k", "a")], 3)])).await;
    let r = RateLimitDescriptor {
        is_negative_hits: true,
        ..desc(&[("k", "a")])
    };
    assert_eq!(codes(&h.ask(&req("d", vec![r.clone()])).await), vec![(OK, 3)]);
    let resp = h
        .ask(&RateLimitRequest {
            hits_addend: 2,
            ..req("d", vec![r])
        })
        .await;
    assert_eq!(codes(&resp), vec![(OK, 5)]);
}

/// `refunds: false`: whoever reaches the gRPC port cannot refill a bucket with
/// `is_negative_hits`; such a descriptor is answered `OK` (as a refund is) without a bucket,
/// and the rest of the request is decided as usual.
#[tokio::test]
async fn with_refunds_off_a_refund_gives_nothing_back() {
    let h = harness_with(
        BASIC,
        LimiterOptions {
            refunds: false,
            ..options()
        },
    );
    h.ask(&req("d", vec![hits(&[("k", "a")], 5)])).await;
    let resp = h.ask(&req("d", vec![refund(&[("k", "a")], 5)])).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(codes(&resp), vec![(OK, 0)]);
    assert_eq!(resp.statuses[0].current_limit, None, "no bucket was involved");
    // Beside it, the rest is decided: b passes once, then is over.
    let resp = h
        .ask(&req("d", vec![refund(&[("k", "a")], 5), desc(&[("k", "b")])]))
        .await;
    assert_eq!(codes(&resp), vec![(OK, 0), (OK, 0)]);
    assert_eq!(limit_of(&resp.statuses[1]).map(|l| l.0), Some("b"));
    let resp = h
        .ask(&req("d", vec![refund(&[("k", "b")], 1), desc(&[("k", "b")])]))
        .await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(
        codes(&h.ask(&one(&[("k", "a")])).await),
        vec![(OVER, 0)],
        "a got nothing back"
    );
}

#[tokio::test]
async fn refunds_apply_even_in_a_denied_request_and_take_no_part_in_the_decision() {
    let h = harness(BASIC);
    h.ask(&req("d", vec![hits(&[("k", "a")], 5)])).await;
    h.ask(&one(&[("k", "b")])).await;
    // b is over: the request is denied, yet a's refund applies and answers OK.
    let r = req("d", vec![refund(&[("k", "a")], 2), desc(&[("k", "b")])]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(codes(&resp), vec![(OK, 2), (OVER, 0)]);
    // A refund does not make a consume on the same bucket admissible.
    let r = req("d", vec![refund(&[("k", "b")], 1), desc(&[("k", "b")])]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(codes(&resp), vec![(OK, 1), (OVER, 1)]);
    assert_eq!(codes(&h.ask(&one(&[("k", "b")])).await), vec![(OK, 0)]);
}

// ---- requests_per_unit: 0 -------------------------------------------------------------

#[tokio::test]
async fn requests_per_unit_zero_always_denies_without_retry_after() {
    let h = harness(
        "domain: d
descriptors:
  - key: client
    value: blocked
    rate_limit: {unit: minute, requests_per_unit: 0}
",
    );
    let r = one(&[("client", "blocked")]);
    for _ in 0..3 {
        let resp = h.ask(&r).await;
        assert_eq!(resp.overall_code, OVER);
        assert_eq!(codes(&resp), vec![(OVER, 0)]);
        assert_eq!(limit_of(&resp.statuses[0]), Some(("", 0, Unit::Minute)));
        assert_eq!(header(&resp, "retry-after"), None);
        assert_eq!(header(&resp, "ratelimit-policy"), Some("\"client=blocked\";q=0"));
        h.advance_ms(3_600_000);
    }
    // A check is over too; other clients are not limited.
    assert_eq!(
        h.ask(&req("d", vec![hits(&[("client", "blocked")], 0)]))
            .await
            .overall_code,
        OVER
    );
    assert_eq!(h.ask(&one(&[("client", "ok")])).await.overall_code, OK);
}

/// A fixed allowance (`capacity` without `refill`): 3 admitted, then denied with no
/// `Retry-After` (nothing will admit it), no `w` or `t` in the headers and no
/// `duration_until_reset`; it is reported as its capacity per YEAR, never as 0 (which Envoy
/// reads as "blocks everything") nor as a huge number; and it stays spent however long.
#[tokio::test]
async fn a_fixed_allowance_admits_its_capacity_then_denies_without_retry_after() {
    let h = harness(
        "domain: d
buckets:
  trial: {capacity: 3}
descriptors:
  - {key: user, bucket: trial}
",
    );
    let r = one(&[("user", "new")]);
    for left in [2, 1, 0] {
        let resp = h.ask(&r).await;
        assert_eq!(codes(&resp), vec![(OK, left)]);
        assert_eq!(limit_of(&resp.statuses[0]), Some(("trial", 3, Unit::Year)));
        assert_eq!(resp.statuses[0].duration_until_reset, None);
        assert_eq!(header(&resp, "ratelimit-policy"), Some("\"trial\";q=3"));
        assert_eq!(header(&resp, "ratelimit"), Some(&*format!("\"trial\";r={left}")));
    }
    for _ in 0..3 {
        let resp = h.ask(&r).await;
        assert_eq!(codes(&resp), vec![(OVER, 0)]);
        assert_eq!(header(&resp, "retry-after"), None);
        assert_eq!(resp.statuses[0].duration_until_reset, None);
        h.advance_ms(400 * 86_400_000);
    }
    // Another user has an allowance of their own.
    assert_eq!(codes(&h.ask(&one(&[("user", "other")])).await), vec![(OK, 2)]);
}

// ---- current_limit and duration_until_reset -------------------------------------------

#[tokio::test]
async fn current_limit_and_duration_until_reset() {
    let h = harness(
        "domain: d
descriptors:
  - key: envoy
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: fine
    name: fine
    token_bucket: {capacity: 7, refill: 1/250ms}
  - key: burst
    name: burst
    token_bucket: {capacity: 100, refill: 10/s}
  - key: hourly
    name: hourly
    token_bucket: {capacity: 24, refill: 24/1d}
",
    );
    // (key, current_limit, capacity, time until full after one hit)
    type Case = (&'static str, (&'static str, u32, Unit), u32, u64);
    let cases: &[Case] = &[
        // 10 per minute: a token every 6 s.
        ("envoy", ("", 10, Unit::Minute), 10, 6_000_000),
        // time to fill (1.75 s) is not a unit: the rate, 4 per second.
        ("fine", ("fine", 4, Unit::Second), 7, 250_000),
        ("burst", ("burst", 10, Unit::Second), 100, 100_000),
        // time to fill is exactly one day: capacity per day.
        ("hourly", ("hourly", 24, Unit::Day), 24, 3_600_000_000),
    ];
    for (key, limit, capacity, until_full) in cases {
        let resp = h.ask(&one(&[(key, "x")])).await;
        let s = &resp.statuses[0];
        assert_eq!(limit_of(s), Some(*limit), "{key}");
        assert_eq!(s.limit_remaining, capacity - 1, "{key}");
        assert_eq!(s.duration_until_reset, dur(*until_full), "{key}");
    }
    // Time passes: the wait shrinks by as much.
    h.advance_ms(1_500);
    let resp = h.ask(&req("d", vec![hits(&[("envoy", "x")], 0)])).await;
    assert_eq!(resp.statuses[0].limit_remaining, 9);
    assert_eq!(resp.statuses[0].duration_until_reset, dur(4_500_000));
    let resp = h.ask(&req("d", vec![hits(&[("envoy", "x")], 3)])).await;
    assert_eq!(resp.statuses[0].limit_remaining, 6);
    assert_eq!(resp.statuses[0].duration_until_reset, dur(22_500_000));
}

/// A wait shorter than a second is announced as one whole second, not as 0 s and some
/// nanoseconds: Envoy writes only the whole seconds of `duration_until_reset` into
/// `x-ratelimit-reset`, so a 429 read `0` before.
#[tokio::test]
async fn a_sub_second_reset_is_one_whole_second() {
    let h = harness(
        "domain: d
descriptors:
  - key: fine
    name: fine
    token_bucket: {capacity: 2, refill: 1/250ms}
",
    );
    for (code, remaining) in [(OK, 1), (OK, 0), (OVER, 0)] {
        let resp = h.ask(&one(&[("fine", "x")])).await;
        let s = &resp.statuses[0];
        assert_eq!((s.code, s.limit_remaining), (code, remaining));
        let reset = s.duration_until_reset.expect("a refilling bucket announces its reset");
        assert_eq!((reset.seconds, reset.nanos), (1, 0), "{code:?}");
    }
    // 0.45 s until full: still one second.
    h.advance_ms(50);
    let resp = h.ask(&req("d", vec![hits(&[("fine", "x")], 0)])).await;
    assert_eq!(resp.statuses[0].duration_until_reset, dur(1_000_000));
}

// ---- Retry-After ----------------------------------------------------------------------

#[tokio::test]
async fn retry_after_is_the_exact_wait_rounded_up() {
    let h = harness(
        "domain: d
descriptors:
  - key: k
    name: slow
    token_bucket: {capacity: 2, refill: 2/3s}
",
    );
    let r = one(&[("k", "x")]);
    h.ask(&r).await;
    h.ask(&r).await;
    // One token every 1.5 s.
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(header(&resp, "retry-after"), Some("2"));
    h.clock.advance_us(1_499_999);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER, "1 µs early");
    assert_eq!(header(&resp, "retry-after"), Some("1"));
    h.clock.advance_us(1);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OK, "exactly on time");
    assert_eq!(header(&resp, "retry-after"), None);
    // Asking for both tokens: the wait is for the whole demand (3 s).
    let resp = h.ask(&req("d", vec![hits(&[("k", "x")], 2)])).await;
    assert_eq!(header(&resp, "retry-after"), Some("3"));
}

/// A clock that steps backwards counts as zero elapsed time: the wait runs from when the
/// bucket was last updated, so a client retrying after Retry-After is not turned away.
#[tokio::test]
async fn retry_after_counts_a_clock_that_stepped_back() {
    let h = harness(BASIC);
    h.advance_ms(10_000);
    assert_eq!(h.ask(&one(&[("k", "b")])).await.overall_code, OK);
    h.clock.set_us(T0);
    let resp = h.ask(&one(&[("k", "b")])).await;
    assert_eq!(resp.overall_code, OVER);
    // b's token is due at T0 + 10 s + 60 s.
    assert_eq!(header(&resp, "retry-after"), Some("70"));
    assert_eq!(resp.statuses[0].duration_until_reset, dur(70_000_000));
    h.advance_ms(69_999);
    assert_eq!(h.ask(&one(&[("k", "b")])).await.overall_code, OVER);
    h.advance_ms(1);
    assert_eq!(h.ask(&one(&[("k", "b")])).await.overall_code, OK);
}

/// After the clock steps back, a bucket written meanwhile is full only when its refill from
/// its last update says so: the memory store's sweep must not drop it earlier (that would
/// hand out tokens the bucket has not earned).
#[tokio::test]
async fn sweep_after_a_clock_step_back_keeps_buckets_that_are_not_full() {
    let h = harness(BASIC);
    h.advance_ms(10_000);
    assert_eq!(codes(&h.ask(&one(&[("k", "a")])).await), vec![(OK, 4)]);
    h.clock.set_us(T0);
    // No time has elapsed since T0 + 10 s as far as the bucket is concerned.
    let resp = h.ask(&one(&[("k", "a")])).await;
    assert_eq!(codes(&resp), vec![(OK, 3)]);
    // Two tokens at one per 12 s: full at T0 + 10 s + 24 s.
    assert_eq!(resp.statuses[0].duration_until_reset, dur(34_000_000));
    h.advance_ms(30_000);
    h.limiter.store().sweep();
    // At T0 + 30 s it holds 3 + 20/12 tokens: 3 left after one more hit, not 4.
    assert_eq!(codes(&h.ask(&one(&[("k", "a")])).await), vec![(OK, 3)]);
}

#[tokio::test]
async fn retry_after_is_the_largest_among_denied_descriptors() {
    let h = harness(BASIC);
    // a (5/min, a token every 12 s) and b (1/min, 60 s) both empty.
    h.ask(&req("d", vec![hits(&[("k", "a")], 5), desc(&[("k", "b")])]))
        .await;
    h.advance_ms(1_000);
    let r = req("d", vec![desc(&[("k", "a")]), desc(&[("k", "b")]), desc(&[("k", "c")])]);
    let resp = h.ask(&r).await;
    assert_eq!(codes(&resp), vec![(OVER, 0), (OVER, 0), (OK, 3)]);
    // b's token is due exactly 60 s after it was taken: 59 s from now, though the refill of
    // the last second (1/60 token) is not a whole number of micro-tokens.
    assert_eq!(header(&resp, "retry-after"), Some("59"));
    assert_eq!(resp.statuses[1].duration_until_reset, dur(59_000_000));
    assert_eq!(resp.statuses[0].duration_until_reset, dur(59_000_000));
    let r = req("d", vec![desc(&[("k", "b")]), desc(&[("k", "a")])]);
    assert_eq!(header(&h.ask(&r).await, "retry-after"), Some("59"));
    // When a denied descriptor can never pass, no Retry-After at all.
    let r = req("d", vec![desc(&[("k", "a")]), hits(&[("k", "c")], 4)]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(header(&resp, "retry-after"), None);
}

#[tokio::test]
async fn retry_after_header_can_be_turned_off() {
    let h = harness_with(
        BASIC,
        LimiterOptions {
            headers: HeaderSettings {
                retry_after: false,
                ratelimit: false,
                x_ratelimit: false,
                ..HeaderSettings::default()
            },
            ..options()
        },
    );
    h.ask(&one(&[("k", "b")])).await;
    let resp = h.ask(&one(&[("k", "b")])).await;
    assert_eq!(resp.overall_code, OVER);
    assert!(resp.response_headers_to_add.is_empty());
}

// ---- RateLimit-Policy / RateLimit -----------------------------------------------------

#[tokio::test]
async fn ratelimit_headers_syntax() {
    let h = harness(
        "domain: d
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 10}
  - key: upload
    name: 'up\"load'
    token_bucket: {capacity: 5, refill: 1/2500ms}
",
    );
    let r = req("d", vec![desc(&[("api_key", "k")]), desc(&[("upload", "u")])]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(
        header(&resp, "ratelimit-policy"),
        Some("\"per_key\";q=10;w=60, \"up\\\"load\";q=5;w=13")
    );
    assert_eq!(
        header(&resp, "ratelimit"),
        Some("\"per_key\";r=9;t=6, \"up\\\"load\";r=4;t=3")
    );
    // 3 s later per_key holds 9.5 tokens; taking 9 leaves 0.5, full again in 57 s.
    h.advance_ms(3_000);
    let mut nine = req("d", vec![desc(&[("api_key", "k")])]);
    nine.hits_addend = 9;
    let resp = h.ask(&nine).await;
    assert_eq!(header(&resp, "ratelimit"), Some("\"per_key\";r=0;t=57"));
    // On a 429 as well; `t` counts down, and one more token comes in 3 s.
    h.advance_ms(1_000);
    let resp = h.ask(&one(&[("api_key", "k")])).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(header(&resp, "ratelimit-policy"), Some("\"per_key\";q=10;w=60"));
    assert_eq!(header(&resp, "ratelimit"), Some("\"per_key\";r=0;t=56"));
    assert_eq!(header(&resp, "retry-after"), Some("2"));
}

#[tokio::test]
async fn ratelimit_headers_list_a_bucket_once_with_its_lowest_instance() {
    let h = harness(BASIC);
    h.ask(&req("d", vec![hits(&[("per_key", "y")], 2)])).await;
    let r = req("d", vec![desc(&[("per_key", "x")]), desc(&[("per_key", "y")])]);
    let resp = h.ask(&r).await;
    assert_eq!(codes(&resp), vec![(OK, 2), (OK, 0)]);
    assert_eq!(header(&resp, "ratelimit-policy"), Some("\"per_key\";q=3;w=60"));
    assert_eq!(header(&resp, "ratelimit"), Some("\"per_key\";r=0;t=60"));
}

// ---- invalid requests -----------------------------------------------------------------

/// No malformed part of a request makes it an error (which Envoy lets through by default, with
/// every other limit of the request): each is decided as docs/rules.md says.
#[tokio::test]
async fn malformed_parts_are_decided_never_errors() {
    let h = harness(BASIC);
    // An empty domain is an unknown domain: OK, no limits, and an override is not looked at.
    let r = req("", vec![desc(&[("k", "b")]), with_override(&[("k", "b")], 0, 1)]);
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OK);
    assert!(resp.statuses.iter().all(|s| s.current_limit.is_none()));
    // A descriptor without entries reaches no rule; the others are decided.
    let resp = h.ask(&req("d", vec![desc(&[("k", "b")]), desc(&[])])).await;
    assert_eq!(codes(&resp), vec![(OK, 0), (OK, 0)]);
    assert_eq!(resp.statuses[0].current_limit.as_ref().unwrap().name, "b");
    assert_eq!(h.ask(&one(&[("k", "b")])).await.overall_code, OVER, "b was consumed");
    // An empty key is decided as sent: it equals no rule key, so `per_key` alone is not reached.
    let resp = h.ask(&req("d", vec![desc(&[("per_key", "x"), ("", "v")])])).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(resp.statuses[0].current_limit, None);
    // An empty value is fine.
    assert_eq!(h.ask(&one(&[("k", "")])).await.overall_code, OK);

    // Too many descriptors: the first `max` are decided, the rest denied, so is the request,
    // and (all or nothing) nothing is consumed.
    let max = RequestLimits::default();
    let r = req("d", (0..=max.max_descriptors).map(|_| desc(&[("k", "a")])).collect());
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(resp.statuses.len(), max.max_descriptors + 1);
    assert_eq!(resp.statuses[max.max_descriptors].code, OVER);
    assert_eq!(resp.statuses[max.max_descriptors].current_limit, None);
    assert!(resp.statuses[..max.max_descriptors].iter().all(|s| s.code == OK));
    assert_eq!(
        h.ask(&one(&[("k", "a")])).await.statuses[0].limit_remaining,
        4,
        "a kept 5"
    );
    let ok = req("d", (0..max.max_descriptors).map(|_| desc(&[("x", "a")])).collect());
    assert_eq!(h.ask(&ok).await.statuses.len(), max.max_descriptors);

    // Too many entries: that descriptor is denied, the request with it, nothing consumed.
    let long: Vec<(String, String)> = (0..=max.max_entries)
        .map(|i| (format!("k{i}"), "v".to_owned()))
        .collect();
    let pairs: Vec<(&str, &str)> = long.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let resp = h.ask(&req("d", vec![desc(&[("k", "a")]), desc(&pairs)])).await;
    assert_eq!(codes(&resp), vec![(OK, 4), (OVER, 0)]);
    assert!(!resp.response_headers_to_add.iter().any(|h| h.key == "retry-after"));
    assert_eq!(
        h.ask(&one(&[("k", "a")])).await.statuses[0].limit_remaining,
        3,
        "one taken above"
    );
    assert_eq!(h.ask(&req("d", vec![desc(&pairs[1..])])).await.overall_code, OK);

    // Global shadow mode denies nothing, malformed or not.
    let shadow = harness_with(
        BASIC,
        LimiterOptions {
            shadow_mode: true,
            ..options()
        },
    );
    assert_eq!(shadow.ask(&req("d", vec![desc(&pairs)])).await.overall_code, OK);

    let h = harness_with(
        BASIC,
        LimiterOptions {
            limits: RequestLimits {
                max_descriptors: 1,
                max_entries: 1,
                ..RequestLimits::default()
            },
            ..options()
        },
    );
    let resp = h.ask(&req("d", vec![desc(&[("k", "a")]), desc(&[("k", "b")])])).await;
    assert_eq!(codes(&resp), vec![(OK, 5), (OVER, 0)]);
    let resp = h.ask(&req("d", vec![desc(&[("k", "a"), ("x", "y")])])).await;
    assert_eq!(codes(&resp), vec![(OVER, 0)]);
}

const LONG_VALUES: &str = "domain: d
descriptors:
  - key: path
    value: /api/*
    name: api
    token_bucket: {capacity: 2, refill: 2/1m}
  - key: user
    name: per_user
    token_bucket: {capacity: 2, refill: 2/1m}
";

/// A value over `limits.max_value_bytes` is cut to it and decided on its rule: a wildcard
/// still sees its prefix, and values alike in their first bytes share a key-only bucket.
#[tokio::test]
async fn a_value_over_the_limit_is_cut_and_decided_on_its_rule() {
    let h = harness_with(
        LONG_VALUES,
        LimiterOptions {
            limits: RequestLimits {
                max_value_bytes: 8,
                ..RequestLimits::default()
            },
            ..options()
        },
    );
    let long_path = format!("/api/{}", "x".repeat(70_000));
    let resp = h.ask(&one(&[("path", &long_path)])).await;
    assert_eq!(resp.statuses[0].current_limit.as_ref().unwrap().name, "api");
    // Two users alike in their first 8 bytes share one bucket (2 tokens); the third is over.
    let resp = h
        .ask(&req(
            "d",
            vec![desc(&[("user", "aaaaaaaa-1")]), desc(&[("user", "aaaaaaaa-2")])],
        ))
        .await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(h.ask(&one(&[("user", "aaaaaaaa-3")])).await.overall_code, OVER);
    // A value within the limit is its own bucket; a cut value never shares one with it.
    assert_eq!(
        h.ask(&one(&[("user", "aaaaaaaa")])).await.statuses[0].limit_remaining,
        1
    );
    // Cut at a character boundary: a multi-byte character across the limit is dropped whole.
    let resp = h.ask(&one(&[("user", "aaaaaaa\u{e9}\u{e9}")])).await;
    assert_eq!(resp.overall_code, OK);
}

// ---- the repository's example rules ---------------------------------------------------

#[tokio::test]
async fn repository_example_rules_decide_as_documented() {
    let rules = load_rules(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/rules")).unwrap();
    let clock = ManualClock::new(T0);
    let h = Harness {
        limiter: Limiter::new(rules, MemoryStore::new(4, 10_000, Arc::new(clock.clone())), options()),
        clock,
    };
    // edge: uploads per key, 5 then one every 12 s; the api key's own bucket also counts.
    let upload = req(
        "edge",
        vec![
            desc(&[("api_key", "k"), ("path", "/upload")]),
            desc(&[("api_key", "k")]),
        ],
    );
    for left in (0..5).rev() {
        let resp = h.ask(&upload).await;
        assert_eq!(resp.overall_code, OK);
        assert_eq!(limit_of(&resp.statuses[0]), Some(("uploads_per_key", 5, Unit::Minute)));
        assert_eq!(resp.statuses[0].limit_remaining, left);
        assert_eq!(limit_of(&resp.statuses[1]), Some(("per_api_key", 60, Unit::Minute)));
    }
    let resp = h.ask(&upload).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(header(&resp, "retry-after"), Some("12"));
    assert_eq!(resp.statuses[1].limit_remaining, 55, "denied: per_api_key untouched");
    // Static paths are never limited; legacy (envoyproxy schema) blocks a client outright.
    assert_eq!(
        h.ask(&req("edge", vec![desc(&[("path", "/static/app.js")])]))
            .await
            .statuses[0]
            .current_limit,
        None
    );
    let blocked = req("legacy", vec![desc(&[("database", "default"), ("client", "blocked")])]);
    assert_eq!(h.ask(&blocked).await.overall_code, OVER);
    let resp = h.ask(&req("legacy", vec![desc(&[("database", "users")])])).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("", 500, Unit::Second)));
    assert_eq!(resp.statuses[0].limit_remaining, 499);
}

// ---- share_threshold (envoyproxy/ratelimit) -------------------------------------------

const SHARED: &str = "domain: d
descriptors:
  - key: path
    value: files/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: images/*
    rate_limit: {unit: minute, requests_per_unit: 2}
";

#[tokio::test]
async fn share_threshold_makes_every_matching_value_share_one_bucket() {
    let h = harness(SHARED);
    let code = |resp: RateLimitResponse| resp.overall_code;
    // files/*: one bucket for all files.
    assert_eq!(code(h.ask(&one(&[("path", "files/a")])).await), OK);
    assert_eq!(code(h.ask(&one(&[("path", "files/b")])).await), OK);
    assert_eq!(code(h.ask(&one(&[("path", "files/c")])).await), OVER);
    // images/* has no share_threshold: one bucket per image.
    for image in ["images/a", "images/b", "images/c"] {
        assert_eq!(code(h.ask(&one(&[("path", image)])).await), OK, "{image}");
    }
    // Below a shared level, the next entry still splits: per user, across all files.
    let per_user = |file, user| one(&[("path", file), ("user", user)]);
    assert_eq!(code(h.ask(&per_user("files/a", "u1")).await), OK);
    assert_eq!(code(h.ask(&per_user("files/b", "u1")).await), OK);
    assert_eq!(code(h.ask(&per_user("files/c", "u1")).await), OVER);
    assert_eq!(code(h.ask(&per_user("files/c", "u2")).await), OK);
}
