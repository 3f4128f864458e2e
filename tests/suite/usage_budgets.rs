//! Usage budgets (docs/usage-budgets.md): debt buckets asked on the request path with
//! `hits_addend` 0 and charged after the response with the usage, through the public decision
//! path on the memory store; and budgets beyond 2^32 tokens.

use crate::harness;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use harness::{header, hits, limit_of, options, req, Harness, OK, OVER};

/// 2023-11-14T22:13:20Z.
const T0: u64 = 1_700_000_000_000_000;

fn harness(yaml: &str) -> Harness {
    harness::harness_at(yaml, options(), T0)
}

const BUDGET: &str = "domain: d
buckets:
  llm_tokens: {capacity: 1000, refill: 1000/1m, debt: true}
  requests: {capacity: 2, refill: 2/1m}
descriptors:
  - key: tenant
    bucket: llm_tokens
  - key: ip
    bucket: requests
";

/// The request-path question: `hits_addend` 0.
fn ask(tenant: &str) -> RateLimitRequest {
    req("d", vec![hits(&[("tenant", tenant)], 0)])
}

/// A usage report sent after the response: `hits_addend` the tokens used.
fn used(tenant: &str, n: u64) -> RateLimitRequest {
    req("d", vec![hits(&[("tenant", tenant)], n)])
}

/// 1,000 tokens a minute: admitted while the balance is positive, every report debited in full
/// (the one that crosses zero too), a 429 with the exact wait while in debt, admitted again
/// once refill has repaid the debt.
#[tokio::test]
async fn a_budget_admits_while_positive_and_refill_repays_the_debt() {
    let h = harness(BUDGET);
    let first = h.ask(&ask("acme")).await;
    assert_eq!(first.overall_code, OK);
    assert_eq!(header(&first, "ratelimit"), Some(r#""llm_tokens";r=1000;t=0"#));
    assert_eq!(limit_of(&first.statuses[0]), Some(("llm_tokens", 1000, Unit::Minute)));
    // A response that used 600, then another that crosses zero: both recorded in full.
    assert_eq!(h.ask(&used("acme", 600)).await.overall_code, OK);
    assert_eq!(h.ask(&ask("acme")).await.overall_code, OK, "400 left");
    assert_eq!(
        h.ask(&used("acme", 600)).await.overall_code,
        OK,
        "a report while positive"
    );
    let denied = h.ask(&ask("acme")).await;
    assert_eq!(denied.overall_code, OVER, "200 in debt");
    // 200 tokens and one micro-token at 1,000 a minute: 12.000001 s.
    assert_eq!(header(&denied, "retry-after"), Some("13"));
    assert_eq!(denied.statuses[0].limit_remaining, 0);
    assert_eq!(header(&denied, "ratelimit"), Some(r#""llm_tokens";r=0;t=72"#));
    // A report while in debt deepens it, and is answered over the limit.
    let late = h.ask(&used("acme", 100)).await;
    assert_eq!(late.overall_code, OVER);
    assert_eq!(
        header(&h.ask(&ask("acme")).await, "retry-after"),
        Some("19"),
        "300 in debt: 18.000001 s"
    );
    h.advance_ms(18_000);
    assert_eq!(
        h.ask(&ask("acme")).await.overall_code,
        OVER,
        "a balance of exactly 0 is not positive"
    );
    h.advance_ms(1);
    let again = h.ask(&ask("acme")).await;
    assert_eq!(again.overall_code, OK, "repaid");
    // Another tenant's account is its own.
    assert_eq!(h.ask(&ask("globex")).await.overall_code, OK);
}

/// The floor (default minus the capacity) bounds the debt: usage beyond it is lost, so the
/// longest wait is the time to repay one capacity.
#[tokio::test]
async fn the_floor_bounds_the_debt() {
    let h = harness(BUDGET);
    assert_eq!(h.ask(&used("acme", 5000)).await.overall_code, OK);
    let denied = h.ask(&ask("acme")).await;
    assert_eq!(denied.overall_code, OVER);
    // From -1,000 (not -4,000) to positive: 60.000001 s.
    assert_eq!(header(&denied, "retry-after"), Some("61"));
    let floored = "domain: d
buckets:
  llm_tokens: {capacity: 1000, refill: 1000/1m, debt: true, debt_floor: -100}
descriptors:
  - key: tenant
    bucket: llm_tokens
";
    let h = harness(floored);
    h.ask(&used("acme", 5000)).await;
    assert_eq!(
        header(&h.ask(&ask("acme")).await, "retry-after"),
        Some("7"),
        "-100: 6.000001 s"
    );
}

/// `debt_floor: 0` (docs/usage-budgets.md: a floor is "0 or below") is a debt bucket whose
/// balance never goes below zero: a report larger than the balance is still taken, down to 0
/// (the rest lost, never refused), and the request-path check passes on any positive balance,
/// a micro-token, as on every debt bucket. It used to compile to an ordinary bucket (its depth,
/// 0, was what marked a debt bucket): the report of 1,000 on 400 was refused and dropped
/// whole, and the check wanted a whole token.
#[tokio::test]
async fn a_floor_of_zero_is_still_a_debt_bucket() {
    let h = harness(
        "domain: d
buckets:
  llm_tokens: {capacity: 1000, refill: 1000/1m, debt: true, debt_floor: 0}
descriptors:
  - key: tenant
    bucket: llm_tokens
",
    );
    assert_eq!(h.ask(&used("acme", 600)).await.overall_code, OK);
    let report = h.ask(&used("acme", 1000)).await;
    assert_eq!(report.overall_code, OK, "400 left: positive before it, taken down to 0");
    assert_eq!(report.statuses[0].limit_remaining, 0);
    let denied = h.ask(&ask("acme")).await;
    assert_eq!(denied.overall_code, OVER, "a balance of exactly 0 is not positive");
    // One micro-token at 1,000 tokens a minute (50/3 micro-tokens a microsecond): 1 µs.
    assert_eq!(header(&denied, "retry-after"), Some("1"));
    h.advance_ms(1);
    assert_eq!(
        h.ask(&ask("acme")).await.overall_code,
        OK,
        "16 micro-tokens are a positive balance"
    );
}

/// A debt bucket and an ordinary one in one request: the ordinary buckets stay all or
/// nothing (a debt not yet repaid denies the request and they keep their tokens), while usage
/// reports are debited whatever the decision.
#[tokio::test]
async fn mixed_requests_keep_all_or_nothing_for_the_ordinary_buckets() {
    let h = harness(BUDGET);
    let both = |tenant_hits: u64| {
        req(
            "d",
            vec![
                hits(&[("tenant", "acme")], tenant_hits),
                harness::desc(&[("ip", "10.0.0.1")]),
            ],
        )
    };
    assert_eq!(h.ask(&used("acme", 1500)).await.overall_code, OK);
    // In debt: the request-path check denies, and the request bucket keeps both its tokens.
    assert_eq!(h.ask(&both(0)).await.overall_code, OVER);
    h.advance_ms(30_001);
    assert_eq!(h.ask(&both(0)).await.overall_code, OK, "repaid: 1 of 2 requests taken");
    assert_eq!(h.ask(&both(0)).await.overall_code, OK, "the second");
    // The request bucket is empty now; a report sent with it is still debited in full.
    let report = h.ask(&both(400)).await;
    assert_eq!(report.overall_code, OVER, "the request bucket denies");
    let after = h.ask(&ask("acme")).await;
    assert_eq!(
        after.overall_code, OVER,
        "the 400 were debited although the request was denied"
    );
    assert!(header(&after, "retry-after").is_some());
}

/// A monthly quota with debt: overshoot is repaid by the next period's allowance, not forgiven
/// at the edge.
#[tokio::test]
async fn a_monthly_quota_with_debt_starts_the_next_month_short() {
    let yaml = "domain: d
buckets:
  monthly: {quota: {limit: 1000, reset: '0 0 1 * *', timezone: UTC}, debt: true}
descriptors:
  - key: tenant
    bucket: monthly
";
    let h = harness(yaml);
    assert_eq!(h.ask(&used("acme", 1200)).await.overall_code, OK);
    let denied = h.ask(&ask("acme")).await;
    assert_eq!(denied.overall_code, OVER);
    // From 2023-11-14T22:13:20Z to 2023-12-01T00:00:00Z: 1,388,800 s.
    assert_eq!(header(&denied, "retry-after"), Some("1388800"));
    h.advance_ms(1_388_800_000);
    let next = h.ask(&ask("acme")).await;
    assert_eq!(next.overall_code, OK);
    assert!(
        header(&next, "ratelimit").is_some_and(|v| v.starts_with(r#""monthly";r=800;"#)),
        "{:?}",
        header(&next, "ratelimit")
    );
}

/// 5,000,000,000 tokens a calendar month in Europe/Berlin: exact, with the full numbers in the
/// headers, while the `uint32` fields of `DescriptorStatus` saturate.
#[tokio::test]
async fn a_budget_of_five_billion_a_month_is_exact() {
    let yaml = "domain: d
buckets:
  monthly: {quota: {limit: 5000000000, reset: '0 0 1 * *', timezone: Europe/Berlin}}
descriptors:
  - key: tenant
    bucket: monthly
";
    let h = harness(yaml);
    let first = h.ask(&ask("acme")).await;
    assert_eq!(first.overall_code, OK);
    assert!(
        header(&first, "ratelimit-policy").is_some_and(|v| v.starts_with(r#""monthly";q=5000000000;"#)),
        "{:?}",
        header(&first, "ratelimit-policy")
    );
    assert!(header(&first, "ratelimit").is_some_and(|v| v.starts_with(r#""monthly";r=5000000000;"#)));
    assert_eq!(first.statuses[0].limit_remaining, u32::MAX);
    assert_eq!(limit_of(&first.statuses[0]).map(|l| l.1), Some(u32::MAX));
    assert_eq!(
        h.ask(&used("acme", 4_294_967_296)).await.overall_code,
        OK,
        "2^32 at once"
    );
    let r = h.ask(&used("acme", 705_032_703)).await;
    assert_eq!(r.overall_code, OK);
    assert!(
        header(&r, "ratelimit").is_some_and(|v| v.starts_with(r#""monthly";r=1;"#)),
        "{:?}",
        header(&r, "ratelimit")
    );
    assert_eq!(r.statuses[0].limit_remaining, 1);
    assert_eq!(h.ask(&used("acme", 2)).await.overall_code, OVER, "2 left? only 1");
    assert_eq!(h.ask(&used("acme", 1)).await.overall_code, OK, "the last token");
    let spent = h.ask(&used("acme", 1)).await;
    assert_eq!(spent.overall_code, OVER);
    // 2023-11-14T22:13:20Z to 2023-12-01T00:00:00+01:00 (23:00Z): 1,385,200 s.
    assert_eq!(header(&spent, "retry-after"), Some("1385200"));
}

// ---- 64 concurrent usage reports on one debt bucket, on every store ----------------------

mod concurrent {
    use std::sync::Arc;

    use futures_util::future::join_all;
    use tollgate::core::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
    use tollgate::core::clock::ManualClock;
    use tollgate::core::schedule::Plan;
    use tollgate::store::{BucketRef, MemoryStore, Store};

    use crate::support;

    const T0: u64 = super::T0;
    /// 1,000,000 tokens a day, its floor 1,000,000 deep: the plan holds up to 2e12 µt.
    const DEPTH_UT: u64 = 1_000_000 * MICRO;

    fn bucket(key: &str) -> Vec<BucketRef> {
        let mut limit = Limit::new(1_000_000, Rate::per(1_000_000, 86_400_000_000).unwrap());
        limit.capacity_ut += DEPTH_UT;
        vec![BucketRef {
            lease_ut: 0,
            key: key.to_owned(),
            plan: Plan::Fixed(limit),
        }]
    }

    fn report(n: u64) -> Vec<Demand> {
        vec![Demand {
            instance: 0,
            kind: DemandKind::Debit {
                amount_ut: n * MICRO,
                depth_ut: DEPTH_UT,
            },
            enforced: true,
        }]
    }

    /// Reports of 1, 2, ..., 64 tokens at once, on a clock that stands still: every one is
    /// debited exactly once, and the balance is the capacity less their sum (2,080), to the
    /// micro-token, whatever order or batches the store decided them in.
    async fn sixty_four_reports_sum_exactly<S: Store>(store: &S, key: &str) {
        let buckets = bucket(key);
        let demands: Vec<Vec<Demand>> = (1..=64).map(report).collect();
        let applied = join_all(demands.iter().map(|d| store.apply(&buckets, d))).await;
        let mut debited = 0;
        for a in applied {
            let a = a.expect("decided");
            assert_eq!(a.decision.instances[0].lost_ut, 0);
            debited += a.decision.instances[0].debited_ut;
        }
        assert_eq!(debited, 2080 * MICRO, "every report debited once, in full");
        let check = vec![Demand {
            instance: 0,
            kind: DemandKind::DebtCheck { depth_ut: DEPTH_UT },
            enforced: true,
        }];
        let after = store.apply(&buckets, &check).await.expect("decided");
        assert_eq!(
            after.decision.instances[0].after.tokens_ut,
            DEPTH_UT + (1_000_000 - 2080) * MICRO,
            "the balance is the capacity less the sum"
        );
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn on_memory() {
        let store = MemoryStore::new(4, 1000, Arc::new(ManualClock::new(T0)));
        sixty_four_reports_sum_exactly(&store, "debt-concurrency").await;
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn on_redis() {
        let Some(url) = support::redis::shared_redis("usage_budgets::concurrent::on_redis") else {
            return;
        };
        let prefix = support::redis::unique_prefix("debt-concurrency");
        let clock = ManualClock::new(T0);
        let store = support::redis::store_on_clock(vec![url.clone()], false, &prefix, &clock).await;
        sixty_four_reports_sum_exactly(&store, "debt-concurrency").await;
        tokio::task::block_in_place(|| support::redis::delete_prefix(url.as_str(), &prefix));
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn on_postgres() {
        let Some(db) = support::postgres::TestSchema::new("usage_budgets::concurrent::on_postgres").await else {
            return;
        };
        let store = db.store().await.with_time_override(Arc::new(ManualClock::new(T0)));
        sixty_four_reports_sum_exactly(&store, "debt-concurrency").await;
        db.drop().await;
    }
}
