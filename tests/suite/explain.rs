//! Explain (`POST /v1/explain`, `tollgate explain`): what `ShouldRateLimit` would answer now,
//! and why, consuming nothing.
//!
//! - A real `tollgate serve`: a bucket drained over gRPC is explained `OVER_LIMIT`, naming the
//!   bucket and the time until the request passes, by the CLI and the JSON API; a second
//!   explanation shows the bucket unchanged; the next real request gets the explained answer.
//! - Property tests: over random request sequences (several descriptors, nested entries, own
//!   hits and checks, refunds, overrides, quota mode, shadow mode, a calendar quota, unlimited
//!   and unmatched descriptors), the explanation equals the decision that follows it: whole
//!   responses on the memory store with a manual clock, and on real Redis the codes, limits and
//!   tokens left (its clock moves between the two, so waits may differ by a second).

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use proptest::prelude::*;
use serde_json::{json, Value};
use support::Tollgate;
use tollgate::admin::explain::ExplainResponse;
use tollgate::core::clock::{ManualClock, SystemClock};
use tollgate::decision::{Found, Limiter, LimiterOptions};
use tollgate::server::settings::Settings;
use tollgate::store::redis::RedisSettings;
use tollgate::store::{MemoryStore, RedisStore, Store};

const RULES: &str = r#"
domain: ex
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 3, refill: 1/1d}
    descriptors:
      - key: path
        name: per_path
        token_bucket: {capacity: 2, refill: 1/1d}
  - key: plan
    name: per_plan
    token_bucket: {capacity: 5, refill: 1/1d}
    quota: {limit: 4, reset: "0 0 1 1 *"}
  - key: soft
    name: soft_a
    quota_mode: true
    token_bucket: {capacity: 1, refill: 1/1d}
  - key: soft2
    name: soft_b
    quota_mode: true
    token_bucket: {capacity: 2, refill: 1/1d}
  - key: trial
    name: trial
    shadow_mode: true
    token_bucket: {capacity: 1, refill: 1/1d}
  - key: health
    unlimited: true
"#;

/// The acceptance rules: 10 an hour, a token every 360 s, so whole figures hold still.
const SLOW: &str = r#"
domain: api
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 10, refill: 10/1h}
    descriptors:
      - key: path
        value: /upload
        name: uploads
        token_bucket: {capacity: 2, refill: 2/1h}
"#;

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: hits,
    }
}

/// POSTs `body` to the explain endpoint: the status and the answer's text.
async fn post(admin: std::net::SocketAddr, body: &Value) -> (u16, String) {
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{admin}/v1/explain"))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("POST /v1/explain");
    (response.status().as_u16(), response.text().await.unwrap_or_default())
}

async fn post_explain(admin: std::net::SocketAddr, body: &Value) -> ExplainResponse {
    let (status, text) = post(admin, body).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("an ExplainResponse")
}

/// The acceptance path: a drained bucket, explained twice by the API and once by the CLI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_bucket_is_explained_over_limit_and_left_unchanged() {
    let tollgate = tokio::task::block_in_place(|| Tollgate::builder().rules_file("api.yaml", SLOW).start());
    let mut grpc = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .unwrap();
    let alice = || request("api", vec![support::descriptor(&[("user", "alice")])], 1);
    for _ in 0..10 {
        let answer = grpc.should_rate_limit(alice()).await.unwrap().into_inner();
        assert_eq!(answer.overall_code, Code::Ok as i32);
    }
    let body = json!({"domain": "api", "descriptors": [{"entries": [{"key": "user", "value": "alice"}]}]});
    let first = post_explain(tollgate.admin_addr, &body).await;
    assert_eq!(first.overall_code, "OVER_LIMIT");
    let d = &first.descriptors[0];
    assert_eq!((d.found.as_str(), d.rule.as_deref()), ("rule", Some("user")));
    assert_eq!(d.deciding.as_deref(), Some("per_user"));
    assert_eq!(d.buckets[0].bucket.tokens, 0);
    assert!(!d.buckets[0].passed && d.buckets[0].enforced);
    // A token every 360 s; the last one taken a moment ago.
    let passes = first.passes_in_seconds.expect("a drained bucket refills");
    assert!((300..=360).contains(&passes), "{first:?}");
    assert_eq!(first.statuses[0].code, "OVER_LIMIT");
    assert_eq!(
        first.statuses[0].current_limit.as_ref().map(|l| l.name.as_str()),
        Some("per_user")
    );
    // Explaining took nothing: the same again, and the bucket's state as it was.
    // (10 an hour: a micro-token every 360 us, and nothing else in between.)
    let second = post_explain(tollgate.admin_addr, &body).await;
    let again = &second.descriptors[0].buckets[0].bucket;
    assert_eq!(again.tokens, 0);
    let refilled = (second.now_us - first.now_us) / 360;
    let grew = again.tokens_micro - d.buckets[0].bucket.tokens_micro;
    assert!(
        grew.abs_diff(refilled) <= 1,
        "grew {grew} micro-tokens, refill gave {refilled}"
    );

    // The CLI says the same, in a person's words and as JSON.
    let cli = |extra: &[&str]| {
        let mut args = vec!["explain", "--domain", "api", "--entry", "user=alice"];
        args.extend_from_slice(extra);
        let admin = tollgate.admin_addr.to_string();
        std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(&args)
            .env("TOLLGATE_ADMIN__ADDR", admin)
            .output()
            .expect("run tollgate explain")
    };
    let out = tokio::task::block_in_place(|| cli(&[]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.starts_with("OVER_LIMIT: passes in "), "{text}");
    assert!(
        text.contains("decided by per_user") && text.contains("per_user: 0 of 10 tokens"),
        "{text}"
    );
    let out = tokio::task::block_in_place(|| cli(&["--json"]));
    let json: ExplainResponse = serde_json::from_slice(&out.stdout).expect("--json prints the answer");
    assert_eq!(json.overall_code, "OVER_LIMIT");

    // And the next real request gets the explained answer.
    let real = grpc.should_rate_limit(alice()).await.unwrap().into_inner();
    assert_eq!(real.overall_code, Code::OverLimit as i32);
    assert_eq!(
        real.statuses[0].current_limit.as_ref().map(|l| l.name.as_str()),
        Some("per_user")
    );

    // Why a descriptor is not limited: the nearest rule and the entry that matched nothing.
    let body = json!({"domain": "api", "descriptors": [
        {"entries": [{"key": "user", "value": "bob"}, {"key": "path", "value": "/download"}]},
        {"entries": [{"key": "tenant", "value": "x"}]}]});
    let why = post_explain(tollgate.admin_addr, &body).await;
    assert_eq!(why.overall_code, "OK");
    assert_eq!(why.passes_in_seconds, Some(0));
    let (nested, top) = (&why.descriptors[0], &why.descriptors[1]);
    assert_eq!(
        (nested.found.as_str(), nested.nearest.as_deref()),
        ("no_rule", Some("user"))
    );
    assert_eq!(
        nested.failed_entry.as_ref().map(|f| (f.index, f.key.as_str())),
        Some((1, "path"))
    );
    assert_eq!((top.found.as_str(), top.nearest.as_deref()), ("no_rule", None));
    assert_eq!(top.failed_entry.as_ref().map(|f| f.index), Some(0));

    // A body that is no request is 400, and changes nothing.
    let bad = json!({"domain": "api", "descriptors": [
        {"entries": [], "limit": {"requests_per_unit": 1, "unit": "FORTNIGHT"}}]});
    let (status, text) = post(tollgate.admin_addr, &bad).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("FORTNIGHT"), "{text}");
}

// ---- explanation equals decision --------------------------------------------------------

/// The descriptors a request is drawn from: rules of every kind, and descriptors no rule takes.
const SHAPES: &[&[(&str, &str)]] = &[
    &[("user", "u0")],
    &[("user", "u1")],
    &[("user", "u0"), ("path", "/a")],
    &[("user", "u1"), ("path", "/b")],
    &[("plan", "p")],
    &[("soft", "s")],
    &[("soft2", "s")],
    &[("trial", "t")],
    &[("health", "h")],
    &[("nobody", "n")],
    &[("user", "u0"), ("path", "/a"), ("deeper", "x")],
];

/// One drawn descriptor: its shape, its own hits (`None`, a check, 1 or 2), a refund, an
/// override.
fn drawn_descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
    descriptor_of(0..SHAPES.len())
}

/// A drawn descriptor of one of the shapes `shapes` picks.
fn descriptor_of(shapes: impl Strategy<Value = usize>) -> impl Strategy<Value = RateLimitDescriptor> {
    (
        shapes,
        prop_oneof![Just(None), Just(Some(0u64)), Just(Some(1)), Just(Some(2))],
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(shape, hits, refund, overridden)| {
            let mut d = support::descriptor(SHAPES[shape]);
            d.hits_addend = hits.map(|value| UInt64Value { value });
            d.is_negative_hits = refund;
            if overridden {
                d.limit = Some(RateLimitOverride {
                    requests_per_unit: 2,
                    unit: Unit::Hour as i32,
                });
            }
            d
        })
}

/// A request of quota-mode descriptors and a plain one (`soft`, `soft2`, `user`): a denied
/// try of the quota-mode walk, its refunds and reports, then another try.
fn quota_mode_request() -> impl Strategy<Value = RateLimitRequest> {
    (
        prop::collection::vec(descriptor_of(prop_oneof![Just(5usize), Just(6), Just(0)]), 2..=4),
        0u32..=2,
    )
        .prop_map(|(descriptors, hits)| request("ex", descriptors, hits))
}

/// A request of one to three drawn descriptors, with request-level hits 0 to 2.
fn drawn_request() -> impl Strategy<Value = RateLimitRequest> {
    (prop::collection::vec(drawn_descriptor(), 1..=3), 0u32..=2)
        .prop_map(|(descriptors, hits)| request("ex", descriptors, hits))
}

fn limiter<S: Store>(store: S) -> Limiter<S> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ex.yaml");
    std::fs::write(&file, RULES).unwrap();
    let rules = tollgate::rules::load_rules(&file).unwrap();
    let mut settings = Settings::default();
    settings.headers.retry_after = true;
    settings.headers.ratelimit = true;
    settings.headers.x_ratelimit = true;
    settings.headers.limit_headers.enabled = true;
    Limiter::new(rules, store, LimiterOptions::from_settings(&settings))
}

/// The part of a response that no clock movement between two answers can change on these
/// rules (a token a day): codes, limits, tokens left, header names.
fn verdict(r: &RateLimitResponse) -> Value {
    json!({
        "overall": r.overall_code,
        "statuses": r.statuses.iter().map(|s| json!([s.code, s.current_limit.as_ref().map(|l| (l.name.clone(), l.requests_per_unit)), s.limit_remaining])).collect::<Vec<_>>(),
        "headers": r.response_headers_to_add.iter().map(|h| h.key.clone()).collect::<Vec<_>>(),
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Memory, manual clock: the explanation is the decision, exactly (headers included), and
    /// explaining changes nothing (a second explanation is the first).
    #[test]
    fn on_memory_the_explanation_is_the_decision(
        steps in prop::collection::vec((prop_oneof![drawn_request(), quota_mode_request()], 0u64..=200_000), 1..24)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let clock = ManualClock::new(1_767_225_600_000_000);
        let limiter = limiter(MemoryStore::new(4, 10_000, Arc::new(clock.clone())));
        for (req, advance_s) in steps {
            clock.advance_us(advance_s * 1_000_000);
            let explained = runtime.block_on(limiter.explain(&req)).unwrap();
            let again = runtime.block_on(limiter.explain(&req)).unwrap();
            prop_assert_eq!(&explained.response, &again.response);
            let decided = runtime.block_on(limiter.should_rate_limit(&req)).unwrap();
            prop_assert_eq!(&explained.response, &decided, "{:?}", req);
            let over = decided.overall_code == Code::OverLimit as i32;
            prop_assert_eq!(explained.passes_in_us == Some(0), !over);
            for why in &explained.descriptors {
                for b in &why.buckets {
                    // A bucket that passes (a refund always does) passes now.
                    prop_assert!(!b.passed || b.wait_us == Some(0), "{:?}", b);
                    // Quota mode counts against the request, whichever try stood on it.
                    prop_assert_eq!(b.enforced, !why.shadow, "{:?}", why);
                }
            }
            for (d, why) in req.descriptors.iter().zip(&explained.descriptors) {
                if d.entries.first().is_some_and(|e| e.key == "nobody") {
                    let nothing = Found::NoRule { nearest: None, failed_entry: Some(0) };
                    let refused_or_override = matches!(why.found, Found::RefundRefused | Found::Override);
                    prop_assert!(why.found == nothing || refused_or_override, "{:?}", why.found);
                }
            }
        }
    }
}

/// Real Redis: the explanation's verdict is the decision's, over random sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_the_explanation_is_the_decision() {
    let Some(url) = support::redis::shared_redis("on_redis_the_explanation_is_the_decision") else {
        return;
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 12,
        ..ProptestConfig::default()
    });
    let steps = prop::collection::vec(prop_oneof![drawn_request(), quota_mode_request()], 1..16);
    let handle = tokio::runtime::Handle::current();
    let outcome = tokio::task::block_in_place(|| {
        runner.run(&steps, |requests| {
            let settings = RedisSettings {
                urls: vec![url.clone()],
                key_prefix: support::redis::unique_prefix("explain"),
                ..RedisSettings::default()
            };
            let store = RedisStore::new(&settings, Arc::new(SystemClock)).unwrap();
            handle.block_on(store.connect(Duration::from_secs(10))).unwrap();
            let limiter = limiter(store);
            for req in requests {
                let explained = handle.block_on(limiter.explain(&req)).unwrap();
                let decided = handle.block_on(limiter.should_rate_limit(&req)).unwrap();
                prop_assert_eq!(verdict(&explained.response), verdict(&decided), "{:?}", req);
            }
            Ok(())
        })
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

/// A request on the memory store and a manual clock, explained then decided.
fn explained_then_decided(
    rules_limiter: &Limiter<MemoryStore>,
    req: &RateLimitRequest,
) -> (tollgate::decision::Explanation, RateLimitResponse) {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let explained = runtime.block_on(rules_limiter.explain(req)).unwrap();
    let decided = runtime.block_on(rules_limiter.should_rate_limit(req)).unwrap();
    (explained, decided)
}

/// Quota mode: the limiter's first try is denied, yet writes the request's refund, and the next
/// try decides on the refilled bucket; the explanation walks the same way (it once decided every
/// try on the states before the first, and said OVER_LIMIT where the request got OK).
#[test]
fn a_quota_mode_walk_carries_a_denied_trys_refund() {
    let clock = ManualClock::new(1_767_225_600_000_000);
    let limiter = limiter(MemoryStore::new(4, 1_000, Arc::new(clock)));
    let drain = request("ex", vec![support::descriptor(&[("soft", "x")])], 1);
    explained_then_decided(&limiter, &drain);
    let mut refund = support::descriptor(&[("soft", "x")]);
    refund.is_negative_hits = true;
    refund.hits_addend = Some(UInt64Value { value: 1 });
    let req = request(
        "ex",
        vec![
            support::descriptor(&[("soft", "x")]),
            support::descriptor(&[("soft2", "y")]),
            refund,
        ],
        1,
    );
    let (explained, decided) = explained_then_decided(&limiter, &req);
    assert_eq!(decided.statuses[0].code, Code::Ok as i32, "{decided:?}");
    assert_eq!(explained.response, decided);
    // The refund is shown as the request asks it, not as the walk spent it.
    let refunded = &explained.descriptors[2].buckets[0];
    assert_eq!(refunded.demand, tollgate::core::bucket::DemandKind::Refund(1_000_000));
}

/// A `rate_limit` of envoyproxy/ratelimit's schema without a name reports no bucket name in its
/// status; the deciding bucket is still named (it was once looked up by that name, and missed).
#[test]
fn an_unnamed_rate_limit_still_has_a_deciding_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gw.yaml");
    std::fs::write(
        &file,
        "domain: gw\ndescriptors:\n  - key: route\n    rate_limit: {unit: hour, requests_per_unit: 10}\n",
    )
    .unwrap();
    let rules = tollgate::rules::load_rules(&file).unwrap();
    let clock = ManualClock::new(1_767_225_600_000_000);
    let limiter = Limiter::new(
        rules,
        MemoryStore::new(4, 1_000, Arc::new(clock)),
        LimiterOptions::from_settings(&Settings::default()),
    );
    let mut own = support::descriptor(&[("route", "r1")]);
    own.hits_addend = Some(UInt64Value { value: 2 });
    for req in [
        request("gw", vec![support::descriptor(&[("route", "r1")])], 1),
        request("gw", vec![own], 1),
    ] {
        let (explained, decided) = explained_then_decided(&limiter, &req);
        assert_eq!(explained.response, decided);
        let d = &explained.descriptors[0];
        let deciding = d.deciding.map(|i| &d.buckets[i]).expect("a deciding bucket");
        // Not the hidden over-limit account, while the visible bucket is there to report.
        assert!(!deciding.policy.hidden, "{d:?}");
    }
}
