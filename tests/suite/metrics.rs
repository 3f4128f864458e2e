//! `/metrics` on a running `tollgate serve`: after a known request mix, every counter has the
//! exact value the mix implies, per rule and code, and the output is valid Prometheus text.

use crate::support;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use support::{Scrape, Tollgate};
use tokio::task::block_in_place;
use tonic::transport::Channel;

const RULES: &str = r#"
domain: shop
buckets:
  per_user: {capacity: 5, refill: 5/1h}
descriptors:
  - key: user
    bucket: per_user
  - key: path
    value: /shadow
    name: shadowed
    token_bucket: {capacity: 1, refill: 1/1h}
    shadow_mode: true
"#;

fn descriptor(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![Entry {
            key: key.into(),
            value: value.into(),
        }],
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn code(c: &mut RateLimitServiceClient<Channel>, req: RateLimitRequest) -> Code {
    let resp = c.should_rate_limit(req).await.expect("an answer").into_inner();
    Code::try_from(resp.overall_code).expect("a known code")
}

async fn connect(tollgate: &Tollgate) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect")
}

const DECISIONS: &str = "tollgate_decisions_total";
const HITS: &str = "tollgate_hits_total";

fn decisions(scrape: &Scrape, metric: &str, bucket: &str, code: &str) -> f64 {
    scrape.counter(metric, &[("domain", "shop"), ("bucket", bucket), ("code", code)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_request_mix_gives_exact_counters() {
    let tollgate = block_in_place(|| Tollgate::start(&[("shop.yaml", RULES)]));
    let mut c = connect(&tollgate).await;

    // Capacity 5, near limit from 80% used: 3 ok, 2 near_limit, 2 over_limit.
    let mut codes = Vec::new();
    for _ in 0..7 {
        codes.push(code(&mut c, request("shop", vec![descriptor("user", "alice")])).await);
    }
    assert_eq!(codes.iter().filter(|c| **c == Code::Ok).count(), 5, "{codes:?}");
    // A refund of 2 hits (is_negative_hits), answered OK.
    let mut refund = descriptor("user", "alice");
    refund.is_negative_hits = true;
    refund.hits_addend = Some(UInt64Value { value: 2 });
    assert_eq!(code(&mut c, request("shop", vec![refund])).await, Code::Ok);
    // Shadow mode: 1 near_limit (the only token), then 2 shadow_over_limit, all answered OK.
    for _ in 0..3 {
        assert_eq!(
            code(&mut c, request("shop", vec![descriptor("path", "/shadow")])).await,
            Code::Ok
        );
    }
    // One request with an empty domain (malformed, answered OK as an unknown domain), one for
    // an unknown domain, one that matches no rule.
    assert_eq!(code(&mut c, request("", vec![descriptor("user", "x")])).await, Code::Ok);
    // And one that is not a RateLimitRequest at all, rejected before the service runs.
    let target = format!("http://{}", tollgate.grpc_addr);
    let malformed = support::raw_call(&target, support::NotARequest { domain: 7 })
        .await
        .unwrap_err();
    assert_eq!(malformed.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        code(&mut c, request("nowhere", vec![descriptor("user", "bob")])).await,
        Code::Ok
    );
    assert_eq!(
        code(&mut c, request("shop", vec![descriptor("color", "red")])).await,
        Code::Ok
    );

    let m = block_in_place(|| Scrape::from(tollgate.http_addr));
    assert_eq!(decisions(&m, DECISIONS, "per_user", "ok"), 3.0);
    assert_eq!(decisions(&m, DECISIONS, "per_user", "near_limit"), 2.0);
    assert_eq!(decisions(&m, DECISIONS, "per_user", "over_limit"), 2.0);
    assert_eq!(decisions(&m, DECISIONS, "per_user", "shadow_over_limit"), 0.0);
    assert_eq!(decisions(&m, DECISIONS, "per_user", "refund"), 1.0);
    assert_eq!(decisions(&m, HITS, "per_user", "refund"), 2.0);
    assert_eq!(decisions(&m, HITS, "per_user", "over_limit"), 2.0);
    assert_eq!(decisions(&m, DECISIONS, "shadowed", "near_limit"), 1.0);
    assert_eq!(decisions(&m, DECISIONS, "shadowed", "shadow_over_limit"), 2.0);
    assert_eq!(decisions(&m, DECISIONS, "shadowed", "ok"), 0.0);
    assert_eq!(decisions(&m, DECISIONS, "shadowed", "over_limit"), 0.0);

    let requests = |code| m.counter("tollgate_requests_total", &[("code", code)]);
    // 7 + refund + 3 shadow + empty domain + unknown domain + no rule = 14 answered, 2 of
    // them over limit; the malformed message is not timed (it never reached the service).
    assert_eq!(requests("ok"), 12.0);
    assert_eq!(requests("over_limit"), 2.0);
    assert_eq!(requests("invalid_argument"), 1.0);
    assert_eq!(
        m.counter("tollgate_malformed_total", &[("reason", "empty_domain")]),
        1.0
    );
    assert_eq!(requests("unavailable"), 0.0);
    assert_eq!(m.histogram_count("tollgate_request_duration_seconds"), Some(14.0));
    assert_eq!(m.counter("tollgate_unknown_domain_requests_total", &[]), 1.0);
    // The store is asked only for requests that reached a bucket: 7 + 1 + 3.
    assert_eq!(
        m.counter("tollgate_backend_calls_total", &[("backend", "memory")]),
        11.0
    );
    assert_eq!(
        m.counter(
            "tollgate_backend_errors_total",
            &[("backend", "memory"), ("kind", "error")]
        ),
        0.0
    );
    assert_eq!(
        m.get("tollgate_backend_circuit_open", &[("backend", "memory")]),
        Some(0.0)
    );
    assert_eq!(m.get("tollgate_rules_generation", &[]), Some(1.0));
    assert_eq!(m.get("tollgate_rules_last_reload_successful", &[]), Some(1.0));
    assert_eq!(m.counter("tollgate_rules_reloads_total", &[("result", "failure")]), 0.0);
    // alice's bucket and the shadowed one are held (not full); nothing was evicted.
    assert_eq!(m.get("tollgate_memory_buckets", &[]), Some(2.0));
    assert_eq!(m.get("tollgate_memory_evicted_not_full_total", &[]), Some(0.0));
    // Registered at zero before any failure, so that an alert's rate() sees the first one.
    for answer in ["allow", "deny"] {
        assert_eq!(
            m.get("tollgate_backend_failure_answers_total", &[("answer", answer)]),
            Some(0.0),
            "{answer}"
        );
    }
    assert_eq!(
        m.types.get("tollgate_request_duration_seconds").map(String::as_str),
        Some("histogram")
    );
    // The standard process metrics come along.
    assert!(m.get("process_cpu_seconds_total", &[]).is_some());
    assert!(m.get("process_resident_memory_bytes", &[]).is_some_and(|v| v > 1e6));

    // Label values come from the rules, never from requests.
    for sample in &m.samples {
        for value in ["alice", "bob", "nowhere", "/shadow", "red"] {
            assert!(
                !format!("{:?}", sample.labels).contains(value),
                "{} has a runtime value in its labels: {:?}",
                sample.metric,
                sample.labels
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_near_limit_ratio_is_a_setting() {
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shop.yaml", RULES)
            .settings("metrics: {near_limit_ratio: 0.4}")
            .start()
    });
    let mut c = connect(&tollgate).await;
    for _ in 0..5 {
        code(&mut c, request("shop", vec![descriptor("user", "carol")])).await;
    }
    let m = block_in_place(|| Scrape::from(tollgate.http_addr));
    // 40% of 5 is 2 used: the first admission is ok, the next four near the limit.
    assert_eq!(decisions(&m, DECISIONS, "per_user", "ok"), 1.0);
    assert_eq!(decisions(&m, DECISIONS, "per_user", "near_limit"), 4.0);
}

#[test]
fn an_out_of_range_near_limit_ratio_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let settings = dir.path().join("tollgate.yaml");
    std::fs::write(&settings, "metrics: {near_limit_ratio: 1.5}\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--config"])
        .arg(&settings)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("near_limit_ratio"), "{stderr}");
}

/// One descriptor with `hits_addend` near 2^64 adds at most what could matter to the hit
/// counters: capacity + 1 for a denial (shadow or not), the capacity for a refund. Malformed
/// parts are counted by reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_hits_addend_counts_at_most_capacity_plus_one_and_malformed_parts_are_counted() {
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shop.yaml", RULES)
            .settings("limits: {max_entries: 2, max_value_bytes: 16}")
            .start()
    });
    let mut c = connect(&tollgate).await;
    let huge = |key: &str, value: &str, negative: bool| {
        let mut d = descriptor(key, value);
        d.hits_addend = Some(UInt64Value { value: u64::MAX });
        d.is_negative_hits = negative;
        request("shop", vec![d])
    };
    assert_eq!(code(&mut c, huge("user", "dave", false)).await, Code::OverLimit);
    assert_eq!(code(&mut c, huge("user", "dave", true)).await, Code::Ok);
    assert_eq!(code(&mut c, huge("path", "/shadow", false)).await, Code::Ok);
    // Malformed: three entries (denied), a 40-byte value (cut, decided on per_user).
    let deep = RateLimitDescriptor {
        entries: (0..3)
            .map(|i| Entry {
                key: format!("k{i}"),
                value: "v".into(),
            })
            .collect(),
        ..Default::default()
    };
    assert_eq!(code(&mut c, request("shop", vec![deep])).await, Code::OverLimit);
    let long = "e".repeat(40);
    let resp = c
        .should_rate_limit(request("shop", vec![descriptor("user", &long)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.statuses[0].current_limit.as_ref().map(|l| l.name.as_str()),
        Some("per_user")
    );

    let m = block_in_place(|| Scrape::from(tollgate.http_addr));
    assert_eq!(decisions(&m, DECISIONS, "per_user", "over_limit"), 1.0);
    assert_eq!(decisions(&m, HITS, "per_user", "over_limit"), 6.0);
    assert_eq!(decisions(&m, HITS, "per_user", "refund"), 5.0);
    assert_eq!(decisions(&m, HITS, "shadowed", "shadow_over_limit"), 2.0);
    let malformed = |reason| m.counter("tollgate_malformed_total", &[("reason", reason)]);
    assert_eq!(malformed("too_many_entries"), 1.0);
    assert_eq!(malformed("value_too_long"), 1.0);
    // The cut value was decided: one admission on per_user.
    assert_eq!(decisions(&m, DECISIONS, "per_user", "ok"), 1.0);
}

const DEBT_RULES: &str = r#"
domain: llm
buckets:
  # 100 tokens a day: over a test of a few seconds refill adds a few thousandths of a token.
  tenant_tokens: {capacity: 100, refill: 100/1d, debt: true}
descriptors:
  - key: tenant
    bucket: tenant_tokens
"#;

/// A usage report of `n` tokens (`hits_addend` n), or the request-path check for `n` = 0.
fn usage(tenant: &str, n: u64) -> RateLimitRequest {
    let mut d = descriptor("tenant", tenant);
    d.hits_addend = Some(UInt64Value { value: n });
    request("llm", vec![d])
}

/// The debt metrics of docs/usage-budgets.md after known usage reports on a debt bucket of
/// capacity 100 (floor -100), through the gRPC service on the real clock. Refill is 100 tokens a
/// day, so over the test it adds a few thousandths of a token (about 1.2 micro-tokens a
/// millisecond): the balances below hold up to that, and every value asserted is one that such
/// a sliver does not change.
///
/// acme: 100 -> report 30 (ok) -> 70 -> report 150 (ok: positive before it; all debited) ->
/// -80 -> check (over) -> report 50 (over; 20 (and the sliver) down to the floor debited, 30 lost)
/// -> -100 -> report 10 at the floor (over; all 10 lost: the sliver refill gave is less than a
/// token). Then globex reports 5 (ok) on an account of its own.
///
/// - `tollgate_debited_tokens_total`: 30 + 150 + 20 + 0 + 5 = 205;
/// - `tollgate_debt_lost_tokens_total`: 30 + 10 = 40;
/// - so debited + lost = 245 = every hit reported, as `tollgate_hits_total` counts them
///   (ok: 30 + 5; near_limit: 150, after which all of the capacity is used, past the default
///   0.8; over_limit: 50 + 10, the check 0);
/// - `tollgate_debt_tokens`: the debt of the instance decided last: 80 after acme's 150 (80
///   less the sliver, shown whole), 100 at the floor, then 0 once globex (positive) is decided.
///
/// The labels are the domain and the bucket name, never a tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debt_metrics_count_usage_reports_exactly() {
    let tollgate = block_in_place(|| Tollgate::start(&[("llm.yaml", DEBT_RULES)]));
    let mut c = connect(&tollgate).await;
    let labels = [("domain", "llm"), ("bucket", "tenant_tokens")];
    let scrape = || block_in_place(|| Scrape::from(tollgate.http_addr));

    assert_eq!(code(&mut c, usage("acme", 30)).await, Code::Ok);
    assert_eq!(code(&mut c, usage("acme", 150)).await, Code::Ok, "positive before it");
    let m = scrape();
    assert_eq!(m.counter(DEBITED, &labels), 180.0);
    assert_eq!(m.counter(LOST, &labels), 0.0);
    assert_eq!(
        m.get(DEBT, &labels),
        Some(80.0),
        "80 in debt, less the sliver, shown whole"
    );

    assert_eq!(code(&mut c, usage("acme", 0)).await, Code::OverLimit, "in debt");
    assert_eq!(code(&mut c, usage("acme", 50)).await, Code::OverLimit);
    let m = scrape();
    assert_eq!(m.counter(DEBITED, &labels), 200.0, "20 of the 50 fit above the floor");
    assert_eq!(m.counter(LOST, &labels), 30.0, "the other 30 found the floor");
    assert_eq!(m.get(DEBT, &labels), Some(100.0), "at the floor");

    assert_eq!(code(&mut c, usage("acme", 10)).await, Code::OverLimit);
    let m = scrape();
    assert_eq!(
        m.counter(DEBITED, &labels),
        200.0,
        "nothing of a report at the floor is debited"
    );
    assert_eq!(m.counter(LOST, &labels), 40.0, "all 10 are lost");
    assert_eq!(m.get(DEBT, &labels), Some(100.0));

    assert_eq!(code(&mut c, usage("globex", 5)).await, Code::Ok);
    let m = scrape();
    assert_eq!(m.counter(DEBITED, &labels), 205.0);
    assert_eq!(m.counter(LOST, &labels), 40.0);
    assert_eq!(m.get(DEBT, &labels), Some(0.0), "globex, decided last, owes nothing");
    let hits = |code| m.counter(HITS, &[("domain", "llm"), ("bucket", "tenant_tokens"), ("code", code)]);
    assert_eq!(hits("ok"), 35.0);
    assert_eq!(hits("near_limit"), 150.0);
    assert_eq!(hits("over_limit"), 60.0);
    assert_eq!(
        m.counter(DEBITED, &labels) + m.counter(LOST, &labels),
        hits("ok") + hits("near_limit") + hits("over_limit"),
        "every hit reported is debited or lost"
    );
    assert_eq!(
        m.counter(
            DECISIONS,
            &[("domain", "llm"), ("bucket", "tenant_tokens"), ("code", "over_limit")]
        ),
        3.0,
        "the check and the two reports while in debt"
    );

    // One series per bucket, labelled by domain and bucket only.
    for name in [DEBITED, LOST, DEBT] {
        let series: Vec<_> = m.samples.iter().filter(|s| s.metric == name).collect();
        assert_eq!(series.len(), 1, "{name}: {series:?}");
        let mut keys: Vec<&str> = series[0].labels.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["bucket", "domain"], "{name}");
    }
    assert_eq!(m.types.get(DEBITED).map(String::as_str), Some("counter"));
    assert_eq!(m.types.get(LOST).map(String::as_str), Some("counter"));
    assert_eq!(m.types.get(DEBT).map(String::as_str), Some("gauge"));
}

const DEBITED: &str = "tollgate_debited_tokens_total";
const LOST: &str = "tollgate_debt_lost_tokens_total";
const DEBT: &str = "tollgate_debt_tokens";
