//! Several limits on one descriptor (`buckets: [a, b]`, all or nothing, each in the headers)
//! and limits hidden from clients (`hidden: true`: decides, but never shows in the
//! `RateLimit`/`RateLimit-Policy` headers nor in the `DescriptorStatus` Envoy turns into
//! `x-ratelimit-*`), through the public decision path on the memory store (docs/rules.md).

use crate::harness;

use harness::{header, hits, limit_of, one, options, req, Harness, OK, OVER};
use tollgate::server::settings::HeaderSettings;

const T0: u64 = 1_700_000_000_000_000;

fn harness(yaml: &str) -> Harness {
    harness::harness_at(yaml, options(), T0)
}

const BURST_AND_DAY: &str = "domain: d
buckets:
  per_minute: {capacity: 3, refill: 3/1m}
  per_day: {capacity: 10, refill: 10/1d}
descriptors:
  - key: user
    buckets: [per_minute, per_day]
";

/// 3 a minute and 10 a day: the 4th request in a minute is denied by the minute's bucket (the
/// next token in 20 s), the 11th in a day by the day's (one token per 8,640 s), and a denied
/// request takes nothing from either. The requests come in steps of 86.4 s, a whole number of
/// the day's micro-tokens (1 per 8,640 µs), so the expected waits are exact.
#[tokio::test]
async fn two_buckets_deny_the_fourth_in_a_minute_and_the_eleventh_in_a_day() {
    let h = harness(BURST_AND_DAY);
    let r = one(&[("user", "ann")]);
    for i in 0..3 {
        assert_eq!(h.ask(&r).await.overall_code, OK, "request {i}");
    }
    let fourth = h.ask(&r).await;
    assert_eq!(fourth.overall_code, OVER);
    assert_eq!(header(&fourth, "retry-after"), Some("20"));
    // The minute's bucket denied: its limit is the one the status reports.
    assert_eq!(
        limit_of(&fourth.statuses[0]).map(|(name, _, _)| name),
        Some("per_minute")
    );
    assert_eq!(
        header(&fourth, "ratelimit-policy"),
        Some(r#""per_minute";q=3;w=60, "per_day";q=10;w=86400"#)
    );
    // The day's bucket lost nothing to the denial: 7 left (plus what 0 s refilled).
    assert_eq!(
        header(&fourth, "ratelimit"),
        Some(r#""per_minute";r=0;t=60, "per_day";r=7;t=25920"#)
    );
    // 3 more in each of the next two steps (the minute's bucket is full again), then the 10th.
    for step in 1..=3 {
        h.advance_ms(86_400);
        let n = if step < 3 { 3 } else { 1 };
        for i in 0..n {
            assert_eq!(h.ask(&r).await.overall_code, OK, "step {step}, request {i}");
        }
    }
    let eleventh = h.ask(&r).await;
    assert_eq!(eleventh.overall_code, OVER);
    // 259.2 s have earned 0.03 of a token; the rest of one takes 0.97 × 8,640 s = 8,380.8 s.
    assert_eq!(header(&eleventh, "retry-after"), Some("8381"));
    assert_eq!(
        limit_of(&eleventh.statuses[0]).map(|(name, _, _)| name),
        Some("per_day")
    );
    assert_eq!(eleventh.statuses[0].limit_remaining, 0);
    // The minute's bucket kept its 2 tokens through the denial.
    assert!(
        header(&eleventh, "ratelimit").is_some_and(|v| v.starts_with(r#""per_minute";r=2;"#)),
        "{:?}",
        header(&eleventh, "ratelimit")
    );
    h.advance_ms(8_380_799);
    assert_eq!(h.ask(&r).await.overall_code, OVER, "1 ms early");
    // A client that waits as told passes.
    h.advance_ms(1);
    assert_eq!(h.ask(&r).await.overall_code, OK);
}

/// When several buckets deny, `Retry-After` is the longest wait: the time until every one
/// of them would pass.
#[tokio::test]
async fn when_both_deny_retry_after_is_the_longest_wait() {
    let h = harness(BURST_AND_DAY);
    let r = one(&[("user", "bob")]);
    for _ in 0..3 {
        assert_eq!(h.ask(&r).await.overall_code, OK);
    }
    // 7 left for the day, none for the minute: 8 hits are denied by both.
    let resp = h.ask(&req("d", vec![hits(&[("user", "bob")], 8)])).await;
    assert_eq!(resp.overall_code, OVER);
    // The minute's bucket can never hold 8; the wait of one that cannot pass is unknown.
    assert_eq!(header(&resp, "retry-after"), None);
    // 3 hits: the minute's bucket in 60 s, the day's now (7 left): 60 s.
    let resp = h.ask(&req("d", vec![hits(&[("user", "bob")], 3)])).await;
    assert_eq!(header(&resp, "retry-after"), Some("60"));
    h.advance_ms(60_000);
    let resp = h.ask(&req("d", vec![hits(&[("user", "bob")], 3)])).await;
    assert_eq!(resp.overall_code, OK);
}

const HIDDEN: &str = "domain: d
buckets:
  anti_abuse: {capacity: 2, refill: 2/1s, hidden: true}
  contract: {capacity: 1000, refill: 1000/1m}
descriptors:
  - key: user
    buckets: [anti_abuse, contract]
  - key: bot
    bucket: anti_abuse
";

/// A hidden bucket decides but never shows: statuses and headers carry the contractual limit
/// only, and a 429 the hidden one causes still gets its true `Retry-After`.
#[tokio::test]
async fn a_hidden_bucket_never_appears_in_headers_or_statuses() {
    let mut opts = options();
    opts.headers = HeaderSettings {
        x_ratelimit: true,
        ..HeaderSettings::default()
    };
    let h = harness::harness_at(HIDDEN, opts, T0);
    let r = one(&[("user", "ann")]);
    for remaining in [999, 998] {
        let resp = h.ask(&r).await;
        assert_eq!(resp.overall_code, OK);
        assert_eq!(
            limit_of(&resp.statuses[0]).map(|(name, n, _)| (name, n)),
            Some(("contract", 1000))
        );
        assert_eq!(resp.statuses[0].limit_remaining, remaining);
        assert_eq!(header(&resp, "ratelimit-policy"), Some(r#""contract";q=1000;w=60"#));
        assert_eq!(header(&resp, "x-ratelimit-limit"), Some("1000"));
    }
    let denied = h.ask(&r).await;
    assert_eq!(denied.overall_code, OVER);
    assert_eq!(denied.statuses[0].code, OVER);
    // The status still shows the contract, untouched by the denial.
    assert_eq!(limit_of(&denied.statuses[0]).map(|(name, _, _)| name), Some("contract"));
    assert_eq!(denied.statuses[0].limit_remaining, 998);
    // A token every 500 ms: 1 s, rounded up.
    assert_eq!(header(&denied, "retry-after"), Some("1"));
    for h in &denied.response_headers_to_add {
        assert!(!h.value.contains("anti_abuse"), "{}: {}", h.key, h.value);
    }
    assert_eq!(header(&denied, "x-ratelimit-remaining"), Some("998"));

    // A rule whose only bucket is hidden: no limit in the status, no limit headers, and still
    // a true Retry-After.
    let b = one(&[("bot", "x")]);
    for _ in 0..2 {
        let resp = h.ask(&b).await;
        assert_eq!(resp.overall_code, OK);
        assert_eq!(resp.statuses[0].current_limit, None);
        assert_eq!(resp.statuses[0].limit_remaining, 0);
        assert_eq!(resp.statuses[0].duration_until_reset, None);
        assert!(
            resp.response_headers_to_add.is_empty(),
            "{:?}",
            resp.response_headers_to_add
        );
    }
    let resp = h.ask(&b).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(resp.statuses[0].current_limit, None);
    let names: Vec<&str> = resp.response_headers_to_add.iter().map(|h| h.key.as_str()).collect();
    assert_eq!(names, ["retry-after"]);
}

/// `replaces` naming one bucket of a rule with several drops that whole rule from the request,
/// as it drops a token bucket together with its quota.
#[tokio::test]
async fn replacing_one_bucket_of_a_list_drops_the_rule() {
    let h = harness(
        "domain: d
buckets:
  per_minute: {capacity: 1, refill: 1/1m}
  per_day: {capacity: 5, refill: 5/1d}
  vip: {capacity: 100, refill: 100/1m}
descriptors:
  - key: user
    buckets: [per_minute, per_day]
  - key: plan
    value: vip
    bucket: vip
    replaces: [{name: per_day}]
",
    );
    let both = || {
        req(
            "d",
            vec![harness::desc(&[("user", "ann")]), harness::desc(&[("plan", "vip")])],
        )
    };
    for i in 0..3 {
        let resp = h.ask(&both()).await;
        assert_eq!(resp.overall_code, OK, "request {i}");
        assert_eq!(resp.statuses[0].current_limit, None, "the user's rule is dropped");
    }
    let alone = h.ask(&one(&[("user", "ann")])).await;
    assert_eq!(alone.overall_code, OK, "the user's buckets were never charged");
    assert_eq!(h.ask(&one(&[("user", "ann")])).await.overall_code, OVER);
}

/// Every unknown name of a rule's `buckets` is reported, each as its own problem.
#[test]
fn every_unknown_name_in_a_list_is_reported() {
    let file = std::path::Path::new("list.yaml");
    let errors = tollgate::rules::load_rules_text(
        file,
        "domain: d
buckets:
  per_second: {capacity: 20, refill: 20/s}
descriptors:
  - key: user
    buckets: [per_hoor, per_second, per_dya]
",
    )
    .expect_err("unknown buckets");
    let text = errors.to_string();
    for name in ["per_hoor", "per_dya"] {
        assert!(
            text.lines()
                .any(|l| l.contains("rule `user`") && l.contains(&format!("unknown bucket `{name}`"))),
            "{text}"
        );
    }
}
