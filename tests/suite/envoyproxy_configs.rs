//! envoyproxy/ratelimit config files (tests/fixtures/envoyproxy/, one point each) load
//! unchanged and give the limits their schema documents, through tollgate's decision path: the
//! memory store on a manual clock. Every fixture is read from disk as it is, never rewritten.

use crate::harness;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use harness::{desc, header, hits, limit_of, options, refund, req, Harness, OK, OVER};
use tollgate::core::clock::ManualClock;
use tollgate::decision::{Limiter, LimiterOptions, ResponseSettings};
use tollgate::rules::load_rules;
use tollgate::store::MemoryStore;

/// 2023-11-14T22:13:20Z: any instant works; tollgate has no windows to align to.
const T0: u64 = 1_700_000_000_000_000;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/envoyproxy")
        .join(name)
}

/// A harness over the rules at `name` (a file or a folder), loaded from disk unchanged.
fn load(name: &str) -> Harness {
    load_with(name, options())
}

/// [`load`] with the limiter options `options`.
fn load_with(name: &str, options: LimiterOptions) -> Harness {
    let path = fixture(name);
    let rules = load_rules(&path).unwrap_or_else(|e| panic!("{} should load: {e}", path.display()));
    let clock = ManualClock::new(T0);
    let store = MemoryStore::new(4, 10_000, Arc::new(clock.clone()));
    Harness {
        limiter: Limiter::new(rules, store, options),
        clock,
    }
}

fn one(domain: &str, pairs: &[(&str, &str)]) -> RateLimitRequest {
    req(domain, vec![desc(pairs)])
}

/// Sends `r` `n` times; the overall codes in order.
async fn codes(h: &Harness, r: &RateLimitRequest, n: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(h.ask(r).await.overall_code);
    }
    out
}

/// `n` OKs followed by one OVER_LIMIT: the documented N admitted, the N+1st denied.
fn admits(n: usize) -> Vec<i32> {
    let mut v = vec![OK; n];
    v.push(OVER);
    v
}

#[tokio::test]
async fn nested_descriptors_apply_the_limit_where_the_last_entry_lands() {
    let h = load("nested.yaml");
    let tenant = one("storefront", &[("tenant", "t1")]);
    assert_eq!(codes(&h, &tenant, 6).await, admits(5));
    let checkout = one("storefront", &[("tenant", "t1"), ("route", "checkout")]);
    assert_eq!(
        codes(&h, &checkout, 4).await,
        admits(3),
        "its own bucket, not the tenant's"
    );
    let resp = h.ask(&checkout).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("", 3, Unit::Minute)));
    // Another route under the tenant only leads to `method`: no limit of its own.
    let other = one("storefront", &[("tenant", "t1"), ("route", "search")]);
    assert_eq!(codes(&h, &other, 10).await, vec![OK; 10]);
    assert_eq!(h.ask(&other).await.statuses[0].current_limit, None);
    let post = one(
        "storefront",
        &[("tenant", "t1"), ("route", "search"), ("method", "POST")],
    );
    assert_eq!(codes(&h, &post, 3).await, admits(2));
    // A deeper request than the tree: no limit (as theirs: the depth must match).
    let deeper = one("storefront", &[("tenant", "t1"), ("route", "checkout"), ("x", "y")]);
    assert_eq!(h.ask(&deeper).await.statuses[0].current_limit, None);
    // Another tenant has buckets of its own.
    assert_eq!(codes(&h, &one("storefront", &[("tenant", "t2")]), 6).await, admits(5));
}

#[tokio::test]
async fn wildcards_match_after_exact_values_and_before_the_key_alone() {
    let h = load("wildcards.yaml");
    let path = |p: &str| one("gateway_paths", &[("path", p)]);
    // The exact value wins over `/v2/*`.
    assert_eq!(codes(&h, &path("/v2/login"), 2).await, admits(1));
    // `/v2/*`: 2 per second for each matching path, each its own bucket.
    assert_eq!(codes(&h, &path("/v2/users"), 3).await, admits(2));
    assert_eq!(codes(&h, &path("/v2/orders"), 3).await, admits(2));
    let resp = h.ask(&path("/v2/orders")).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("", 2, Unit::Second)));
    // A `*` inside the value.
    assert_eq!(codes(&h, &path("/files/a/b/meta"), 5).await, admits(4));
    let resp = h.ask(&path("/files/x/data")).await;
    assert_eq!(
        limit_of(&resp.statuses[0]),
        Some(("", 6, Unit::Minute)),
        "no pattern matches"
    );
    // Refill: one token of `/v2/*` every 0.5 s.
    h.advance_ms(499);
    assert_eq!(h.ask(&path("/v2/users")).await.overall_code, OVER);
    h.advance_ms(1);
    assert_eq!(codes(&h, &path("/v2/users"), 2).await, admits(1));
}

#[tokio::test]
async fn replaced_rule_is_not_applied_when_the_replacing_one_matches() {
    let h = load("replaces.yaml");
    let both = req(
        "mobile_api",
        vec![desc(&[("user_id", "u1")]), desc(&[("region", "eu")])],
    );
    // per_region (2 per minute) is replaced: 4 requests pass, limited by per_user alone.
    for i in 0..4 {
        let resp = h.ask(&both).await;
        assert_eq!(resp.overall_code, OK, "request {i}");
        assert_eq!(limit_of(&resp.statuses[0]), Some(("per_user", 4, Unit::Minute)));
        assert_eq!(
            resp.statuses[1].current_limit, None,
            "the replaced descriptor has no limit"
        );
    }
    assert_eq!(h.ask(&both).await.overall_code, OVER);
    // The region alone is limited by per_region, whose bucket the replaced requests never touched.
    assert_eq!(codes(&h, &one("mobile_api", &[("region", "eu")]), 3).await, admits(2));
}

#[tokio::test]
async fn shadow_mode_never_denies_but_its_bucket_still_counts() {
    let h = load("shadow_mode.yaml");
    let beta = one("rollout", &[("feature", "beta")]);
    let remaining: Vec<u32> = {
        let mut v = Vec::new();
        for _ in 0..5 {
            let resp = h.ask(&beta).await;
            assert_eq!(resp.overall_code, OK);
            assert_eq!(resp.statuses[0].code, OK);
            v.push(resp.statuses[0].limit_remaining);
        }
        v
    };
    assert_eq!(
        remaining,
        vec![1, 0, 0, 0, 0],
        "the shadow bucket runs dry like an enforced one"
    );
    // The same limit without shadow_mode denies the third.
    assert_eq!(codes(&h, &one("rollout", &[("feature", "stable")]), 3).await, admits(2));
}

#[tokio::test]
async fn unlimited_never_limits_and_the_other_callers_are_limited() {
    let h = load("unlimited.yaml");
    let probe = one("internal", &[("caller", "health-prober")]);
    assert_eq!(codes(&h, &probe, 200).await, vec![OK; 200]);
    assert_eq!(h.ask(&probe).await.statuses[0].current_limit, None);
    // As theirs: the most a `uint32` holds, not 0 (which reads as "nothing left").
    assert_eq!(h.ask(&probe).await.statuses[0].limit_remaining, u32::MAX);
    assert_eq!(h.limiter.store().len(), 0, "an unlimited rule touches no bucket");
    assert_eq!(
        codes(&h, &one("internal", &[("caller", "batch-job")]), 2).await,
        admits(1)
    );
    // A `replaces` on an unlimited rule applies, as in envoyproxy/ratelimit: beside the nightly
    // job's descriptor, per_caller is dropped from the request, which is never limited and
    // charges nothing; the same caller alone is still limited.
    let job = req(
        "internal",
        vec![desc(&[("internal_job", "nightly")]), desc(&[("caller", "cron")])],
    );
    assert_eq!(codes(&h, &job, 5).await, vec![OK; 5]);
    assert_eq!(
        codes(&h, &one("internal", &[("caller", "cron")]), 2).await,
        admits(1),
        "the job's requests charged nothing"
    );
    let rules = load_rules(&fixture("unlimited.yaml")).unwrap();
    let notes = &rules.domains["internal"].notes;
    assert!(
        !notes.iter().any(|(_, n)| n.contains("no effect on an unlimited rule")),
        "{notes:?}"
    );
}

#[tokio::test]
async fn detailed_metric_and_value_to_metric_leave_the_limits_as_they_are() {
    let h = load("detailed_metric.yaml");
    assert_eq!(codes(&h, &one("reporting", &[("client_id", "c1")]), 4).await, admits(3));
    let csv = one("reporting", &[("report", "sales"), ("format", "csv")]);
    assert_eq!(codes(&h, &csv, 3).await, admits(2));
    let rules = load_rules(&fixture("detailed_metric.yaml")).unwrap();
    let notes: Vec<&str> = rules.domains["reporting"]
        .notes
        .iter()
        .map(|(r, _)| r.as_str())
        .collect();
    assert_eq!(
        notes,
        vec!["client_id", "report", "report.format"],
        "each accepted field is listed"
    );
}

#[tokio::test]
async fn envoy_gateways_written_out_fields_change_nothing() {
    let h = load("envoy_gateway.yaml");
    let route = "httproute/default/backend/rule/0/match/0/*";
    let user = |u: &str| one("envoy-gateway/gateway-1/http", &[(route, route), ("rule-0-match-0", u)]);
    assert_eq!(codes(&h, &user("alice"), 3).await, admits(2));
    assert_eq!(codes(&h, &user("bob"), 3).await, admits(2), "a bucket per value");
    // No name goes to Envoy (as theirs sends none): the path would show clients the route's
    // namespace and name in `x-ratelimit-limit`.
    let resp = h.ask(&user("carol")).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("", 2, Unit::Minute)));
    let rules = load_rules(&fixture("envoy_gateway.yaml")).unwrap();
    let domain = &rules.domains["envoy-gateway/gateway-1/http"];
    assert_eq!(
        domain.buckets.iter().map(|b| b.name.as_str()).collect::<Vec<_>>(),
        [format!("{route}={route}.rule-0-match-0")],
        "`name: \"\"` is no name: the bucket is named by its path"
    );
    assert!(
        !domain.notes.iter().any(|(_, n)| n.contains("metric")),
        "`false` metric flags are not listed: {:?}",
        domain.notes
    );
}

#[tokio::test]
async fn share_threshold_shares_one_bucket_among_matching_values() {
    let h = load("share_threshold.yaml");
    let bucket = |b: &str| one("object_store", &[("bucket", b)]);
    let mut got = Vec::new();
    for b in ["uploads-a", "uploads-b", "uploads-c", "uploads-d"] {
        got.push(h.ask(&bucket(b)).await.overall_code);
    }
    assert_eq!(got, admits(3), "three hits across all uploads-* values");
    // Without share_threshold each value has its own.
    for b in ["logs-a", "logs-b", "logs-c", "logs-d"] {
        assert_eq!(h.ask(&bucket(b)).await.overall_code, OK, "{b}");
    }
    assert_eq!(codes(&h, &bucket("logs-a"), 3).await, admits(2));
}

#[tokio::test]
async fn several_domains_in_a_folder_each_keep_their_limits() {
    let h = load("domains");
    let rules = load_rules(&fixture("domains")).unwrap();
    let mut names: Vec<&str> = rules.domains.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, vec!["auth", "checkout", "search"]);
    let addr = [("remote_address", "10.1.2.3")];
    assert_eq!(codes(&h, &one("checkout", &addr), 3).await, admits(2));
    assert_eq!(
        codes(&h, &one("search", &addr), 4).await,
        admits(3),
        "same descriptor, another domain"
    );
    assert_eq!(codes(&h, &one("auth", &[("generic_key", "login")]), 2).await, admits(1));
}

#[tokio::test]
async fn requests_per_unit_zero_or_missing_denies_from_the_first_request() {
    let h = load("zero.yaml");
    for client in ["banned", "legacy"] {
        let resp = h.ask(&one("abuse", &[("client", client)])).await;
        assert_eq!(resp.overall_code, OVER, "{client}");
        assert_eq!(
            resp.statuses[0].current_limit.as_ref().map(|l| l.requests_per_unit),
            Some(0)
        );
    }
    h.advance_ms(3_600_000);
    assert_eq!(
        h.ask(&one("abuse", &[("client", "legacy")])).await.overall_code,
        OVER,
        "no refill"
    );
    assert_eq!(h.limiter.store().len(), 0, "denials consume nothing");
    assert_eq!(codes(&h, &one("abuse", &[("client", "anyone")]), 51).await, admits(50));
}

#[tokio::test]
async fn units_admit_requests_per_unit_then_refill_one_token_per_unit_over_n() {
    let h = load("units.yaml");
    // (value, requests_per_unit, unit, ms per token)
    let cases = [
        ("second", 4, Unit::Second, 250),
        ("minute", 6, Unit::Minute, 10_000),
        ("hour", 12, Unit::Hour, 300_000),
        ("day", 24, Unit::Day, 3_600_000),
    ];
    for (value, n, unit, _) in cases {
        let r = one("units", &[("per", value)]);
        assert_eq!(codes(&h, &r, n + 1).await, admits(n), "{value}");
        let resp = h.ask(&r).await;
        assert_eq!(limit_of(&resp.statuses[0]).map(|l| (l.1, l.2)), Some((n as u32, unit)));
    }
    // Each bucket on a fresh harness, emptied: denied 1 ms before its next token, admitted at it.
    for (value, _, _, ms) in cases {
        let h = load("units.yaml");
        let r = one("units", &[("per", value)]);
        while h.ask(&r).await.overall_code == OK {}
        h.advance_ms(ms - 1);
        assert_eq!(h.ask(&r).await.overall_code, OVER, "{value}: not yet");
        h.advance_ms(1);
        assert_eq!(codes(&h, &r, 2).await, admits(1), "{value}: one token back");
    }
}

#[tokio::test]
async fn month_and_year_refill_over_30_and_365_days() {
    let h = load("month_year.yaml");
    let trial = one("billing", &[("plan", "trial")]);
    assert_eq!(codes(&h, &trial, 31).await, admits(30));
    let resp = h.ask(&trial).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("", 30, Unit::Month)));
    // 30 per 30 days: one a day, not 30 at a calendar month's start.
    h.advance_ms(86_400_000 - 1);
    assert_eq!(h.ask(&trial).await.overall_code, OVER);
    h.advance_ms(1);
    assert_eq!(codes(&h, &trial, 2).await, admits(1));
    let archive = one("billing", &[("plan", "archive")]);
    assert_eq!(codes(&h, &archive, 366).await, admits(365));
    h.advance_ms(86_400_000);
    assert_eq!(codes(&h, &archive, 2).await, admits(1), "365 per 365 days: one a day");
}

#[tokio::test]
async fn a_name_is_reported_and_shared_by_rules_that_keep_their_own_limits() {
    let h = load("named.yaml");
    let acme = one("partners", &[("partner", "acme")]);
    let resp = h.ask(&acme).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("partner_tier", 3, Unit::Second)));
    assert_eq!(codes(&h, &acme, 3).await, admits(2));
    let globex = one("partners", &[("partner", "globex")]);
    let resp = h.ask(&globex).await;
    assert_eq!(limit_of(&resp.statuses[0]), Some(("partner_tier", 1, Unit::Second)));
    assert_eq!(h.ask(&globex).await.overall_code, OVER);
}

/// Denied hits consume nothing and a request is all or nothing: a request's hits_addend larger
/// than what is left is denied and the rest stays for a smaller request (envoyproxy/ratelimit
/// would have added the hits to its window's counter).
#[tokio::test]
async fn a_denied_request_consumes_nothing_in_any_of_its_descriptors() {
    let h = load("domains");
    let big = request_hits(req("checkout", vec![desc(&[("remote_address", "a")])]), 3);
    assert_eq!(h.ask(&big).await.overall_code, OVER, "3 hits against 2 tokens");
    let small = one("checkout", &[("remote_address", "a")]);
    assert_eq!(codes(&h, &small, 3).await, admits(2), "both tokens are still there");
    // Two descriptors: the second denies, so the first is not charged either.
    let fresh = one("checkout", &[("remote_address", "b")]);
    let pair = req(
        "checkout",
        vec![desc(&[("remote_address", "b")]), desc(&[("remote_address", "a")])],
    );
    assert_eq!(h.ask(&pair).await.overall_code, OVER);
    assert_eq!(codes(&h, &fresh, 3).await, admits(2), "`b` kept its two tokens");
}

/// The status codes of `resp`, in request order.
fn status_codes(resp: &RateLimitResponse) -> Vec<i32> {
    resp.statuses.iter().map(|s| s.code).collect()
}

/// `limit_remaining` of every status of `resp`.
fn remaining(resp: &RateLimitResponse) -> Vec<u32> {
    resp.statuses.iter().map(|s| s.limit_remaining).collect()
}

/// `quota_mode: true`, envoyproxy/ratelimit's rule: a request is denied when every quota-mode
/// descriptor is over (a quota-mode descriptor over while another passes only says so in its
/// status), and a denied request takes nothing from any bucket, as without quota mode.
#[tokio::test]
async fn quota_mode_denies_only_when_every_quota_descriptor_is_over() {
    let h = load("quota_mode.yaml");
    let plans = req(
        "plans",
        vec![desc(&[("plan", "included")]), desc(&[("plan", "overage")])],
    );
    // Both pass, then `overage` (1) is over while `included` (2) still passes: OK both times.
    let first = h.ask(&plans).await;
    assert_eq!((first.overall_code, status_codes(&first)), (OK, vec![OK, OK]));
    let second = h.ask(&plans).await;
    assert_eq!(
        (second.overall_code, status_codes(&second)),
        (OK, vec![OK, OVER]),
        "one of two quota-mode descriptors over: the request passes, its status says over"
    );
    assert_eq!(remaining(&second), vec![0, 0]);
    assert_eq!(header(&second, "retry-after"), None);
    // Both over: denied, with the wait until the first of them passes (`overage`: 60 s per
    // token; `included`: 30 s).
    let third = h.ask(&plans).await;
    assert_eq!((third.overall_code, status_codes(&third)), (OVER, vec![OVER, OVER]));
    assert_eq!(header(&third, "retry-after"), Some("30"));
    // 30 s on, `included` has a token again and `overage` none: the request passes on it.
    h.advance_ms(30_000);
    let fourth = h.ask(&plans).await;
    assert_eq!((fourth.overall_code, status_codes(&fourth)), (OK, vec![OK, OVER]));

    // The first quota-mode descriptor over and the second passing: the request passes on the
    // second, which alone is charged.
    let h = load("quota_mode.yaml");
    let overage = req("plans", vec![desc(&[("plan", "overage")])]);
    assert_eq!(h.ask(&overage).await.overall_code, OK, "spends `overage` alone");
    let reversed = req(
        "plans",
        vec![desc(&[("plan", "overage")]), desc(&[("plan", "included")])],
    );
    let resp = h.ask(&reversed).await;
    assert_eq!((resp.overall_code, status_codes(&resp)), (OK, vec![OVER, OK]));
    assert_eq!(remaining(&resp), vec![0, 1], "`included` charged once");
}

/// A descriptor without quota mode still denies on its own, and then no quota-mode bucket is
/// charged; and it is charged when the request passes on a quota-mode descriptor.
#[tokio::test]
async fn quota_mode_beside_a_descriptor_without_it() {
    let h = load("quota_mode.yaml");
    let mixed = |user: &str| {
        req(
            "plans",
            vec![
                desc(&[("user", user)]),
                desc(&[("plan", "included")]),
                desc(&[("plan", "overage")]),
            ],
        )
    };
    // The first request takes from both plans (each quota-mode descriptor that can serve is
    // charged), the second from `included` alone; the third finds both plans spent.
    for _ in 0..2 {
        assert_eq!(h.ask(&mixed("a")).await.overall_code, OK);
    }
    let resp = h.ask(&mixed("a")).await;
    assert_eq!(
        (resp.overall_code, status_codes(&resp)),
        (OVER, vec![OK, OVER, OVER]),
        "every quota-mode descriptor over: denied although `user=a` passes"
    );
    assert_eq!(remaining(&resp)[0], 1, "and `user=a` is not charged");
    // `user=b` over alone: denied although a plan passes, and no plan is charged.
    let h = load("quota_mode.yaml");
    let user_b = request_hits(req("plans", vec![desc(&[("user", "b")])]), 3);
    assert_eq!(h.ask(&user_b).await.overall_code, OK, "spends `user=b`");
    let resp = h.ask(&mixed("b")).await;
    assert_eq!((resp.overall_code, status_codes(&resp)), (OVER, vec![OVER, OK, OK]));
    assert_eq!(remaining(&resp), vec![0, 2, 1], "the plans keep their tokens");
    // `user=c` passes: charged along with the quota-mode descriptors that can serve.
    let resp = h.ask(&mixed("c")).await;
    assert_eq!((resp.overall_code, remaining(&resp)), (OK, vec![2, 1, 0]));
}

/// When the request stands on a second quota-mode descriptor (the first was over), its refunds
/// are given once, not once per try.
#[tokio::test]
async fn quota_mode_gives_a_refund_once() {
    let h = load("quota_mode.yaml");
    assert_eq!(
        h.ask(&request_hits(req("plans", vec![desc(&[("user", "r")])]), 3))
            .await
            .overall_code,
        OK
    );
    assert_eq!(
        h.ask(&req("plans", vec![desc(&[("plan", "overage")])]))
            .await
            .overall_code,
        OK
    );
    let resp = h
        .ask(&req(
            "plans",
            vec![
                desc(&[("plan", "overage")]),
                desc(&[("plan", "included")]),
                refund(&[("user", "r")], 1),
            ],
        ))
        .await;
    assert_eq!((resp.overall_code, status_codes(&resp)), (OK, vec![OVER, OK, OK]));
    let user = h.ask(&req("plans", vec![desc(&[("user", "r")])])).await;
    assert_eq!(
        (user.overall_code, user.statuses[0].limit_remaining),
        (OK, 0),
        "one token given back (and taken again), not two"
    );
}

/// The global switch (their `QUOTA_MODE`, tollgate's `response.quota_mode`) puts every limited
/// descriptor in quota mode, the per-user limit too.
#[tokio::test]
async fn global_quota_mode_puts_every_descriptor_in_quota_mode() {
    let quota_everywhere = LimiterOptions {
        response: ResponseSettings {
            quota_mode: true,
            dynamic_metadata: false,
        },
        ..options()
    };
    let h = load_with("quota_mode.yaml", quota_everywhere);
    let pair = req("plans", vec![desc(&[("user", "u")]), desc(&[("plan", "overage")])]);
    assert_eq!(h.ask(&pair).await.overall_code, OK);
    let resp = h.ask(&pair).await;
    assert_eq!(
        (resp.overall_code, status_codes(&resp)),
        (OK, vec![OK, OVER]),
        "`user=u` now counts as a quota-mode descriptor that passes"
    );
    assert_eq!(h.ask(&pair).await.overall_code, OK);
    let resp = h.ask(&pair).await;
    assert_eq!((resp.overall_code, status_codes(&resp)), (OVER, vec![OVER, OVER]));
    // Without the switch the same pair is denied as soon as `overage` is over.
    let h = load("quota_mode.yaml");
    assert_eq!(codes(&h, &pair, 2).await, admits(1));
}

/// A protobuf `Struct` as JSON, for comparing.
fn json(s: &Struct) -> serde_json::Value {
    fn value(v: &Value) -> serde_json::Value {
        match v.kind.as_ref() {
            None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
            Some(Kind::NumberValue(n)) => serde_json::json!(n),
            Some(Kind::StringValue(s)) => serde_json::json!(s),
            Some(Kind::BoolValue(b)) => serde_json::json!(b),
            Some(Kind::StructValue(s)) => json(s),
            Some(Kind::ListValue(l)) => serde_json::Value::Array(l.values.iter().map(value).collect()),
        }
    }
    serde_json::Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value(v))).collect())
}

/// `metadata` loads and, with dynamic metadata on (their `RESPONSE_DYNAMIC_METADATA`), the
/// response carries envoyproxy/ratelimit's shape: the domain, each descriptor's entries (its
/// override and `hits_addend` when it has them), the request's `hits_addend`, and the metadata
/// of the rules whose descriptors passed, merged in request order.
#[tokio::test]
async fn response_metadata_names_the_request_and_what_passed() {
    use serde_json::json as j;
    let off = load("metadata.yaml");
    let services = req(
        "backends",
        vec![desc(&[("service", "service_1")]), desc(&[("service", "service_2")])],
    );
    assert_eq!(off.ask(&services).await.dynamic_metadata, None, "off by default");

    let on = LimiterOptions {
        response: ResponseSettings {
            quota_mode: false,
            dynamic_metadata: true,
        },
        ..options()
    };
    let h = load_with("metadata.yaml", on);
    let first = h.ask(&services).await;
    assert_eq!(
        json(first.dynamic_metadata.as_ref().unwrap()),
        j!({
            "domain": "backends",
            "descriptors": [{"entries": ["service=service_1"]}, {"entries": ["service=service_2"]}],
            "metadata": {"service_with_quota": {"name": "service_1", "tier": "spare"}},
        }),
        "both passed: merged, the first descriptor's name kept"
    );
    let second = h.ask(&services).await;
    assert_eq!((second.overall_code, status_codes(&second)), (OK, vec![OVER, OK]));
    assert_eq!(
        json(&second.dynamic_metadata.unwrap())["metadata"],
        j!({"service_with_quota": {"name": "service_2", "tier": "spare"}}),
        "service_1 is over: only service_2's metadata"
    );
    let third = h.ask(&services).await;
    assert_eq!(third.overall_code, OVER);
    let meta = json(&third.dynamic_metadata.unwrap());
    assert!(meta.get("metadata").is_none(), "nothing passed: {meta}");

    // A nested rule's metadata (its parent's, a node without a limit, is never passed on); the
    // request's and a descriptor's hits_addend; an override; a descriptor no rule matches.
    let mut with_override = desc(&[("tenant", "t1"), ("route", "r")]);
    with_override.limit = Some(
        envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
            requests_per_unit: 7,
            unit: Unit::Hour as i32,
        },
    );
    let mut r = req(
        "backends",
        vec![
            hits(&[("tenant", "t1"), ("route", "r")], 2),
            desc(&[("unknown", "x")]),
            with_override,
        ],
    );
    r.hits_addend = 3;
    let resp = h.ask(&r).await;
    assert_eq!(resp.overall_code, OK);
    assert_eq!(
        json(&resp.dynamic_metadata.unwrap()),
        j!({
            "domain": "backends",
            "descriptors": [
                {"entries": ["tenant=t1", "route=r"], "hitsAddend": 2.0},
                {"entries": ["unknown=x"]},
                {"entries": ["tenant=t1", "route=r"], "limit": "requests_per_unit:7 unit:HOUR"},
            ],
            "hitsAddend": 3.0,
            "metadata": {"route_limited": true},
        })
    );
}

/// At least ten fixtures, each named by a test above (the folder counts as one).
#[test]
fn every_fixture_is_tested() {
    let source = include_str!("envoyproxy_configs.rs");
    let mut count = 0;
    for entry in std::fs::read_dir(fixture("")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(source.contains(&format!("load(\"{name}\")")), "{name} has no test");
        count += 1;
    }
    assert!(count >= 10, "{count} fixtures");
}

/// `request` with the request-level `hits_addend` `n`: the request's own hits, all or nothing
/// in the token bucket (a descriptor's own `hits_addend` is counted as theirs counts it).
fn request_hits(mut request: RateLimitRequest, n: u32) -> RateLimitRequest {
    request.hits_addend = n;
    request
}
