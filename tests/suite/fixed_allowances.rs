//! Fixed allowances (`capacity` without `refill`, docs/rules.md) through the decision path on
//! every backend: a trial of 3 admits 3 and then denies with no `Retry-After` (nothing will
//! admit it); one with `expires: 24h` answers the time to its expiry, counted from the first
//! use, and admits again from then on. Each store runs on a manual clock.

use crate::harness::{self, header, one, options, Harness, OK, OVER};
use crate::support;

use std::sync::Arc;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use tollgate::core::clock::ManualClock;
use tollgate::decision::Limiter;
use tollgate::store::Store;

const T0: u64 = 1_700_000_000_000_000;
const HOUR_MS: u64 = 3_600_000;

const RULES: &str = "domain: d
buckets:
  trial: {capacity: 3}
  daily: {capacity: 3, expires: 24h}
descriptors:
  - {key: trial, bucket: trial}
  - {key: daily, bucket: daily}
";

fn code_and_remaining(resp: &RateLimitResponse) -> (i32, u32) {
    (resp.overall_code, resp.statuses[0].limit_remaining)
}

/// The scenario on one store; `clock` is the store's clock.
async fn allowances_on<S: Store>(limiter: Limiter<S>, clock: ManualClock) {
    let ask = |key: &'static str, user: &'static str| {
        let limiter = &limiter;
        async move {
            limiter
                .should_rate_limit(&one(&[(key, user)]))
                .await
                .unwrap_or_else(|e| panic!("decided: {e}"))
        }
    };

    // A trial of 3: 3 admitted, then denied with no Retry-After, a year later still.
    for left in [2, 1, 0] {
        assert_eq!(code_and_remaining(&ask("trial", "u").await), (OK, left));
    }
    for _ in 0..2 {
        let resp = ask("trial", "u").await;
        assert_eq!(code_and_remaining(&resp), (OVER, 0));
        assert_eq!(header(&resp, "retry-after"), None, "nothing will admit it");
        assert_eq!(resp.statuses[0].duration_until_reset, None);
        clock.advance_us(400 * 24 * HOUR_MS * 1000);
    }

    // Three a day from the first use: the first at `first`, two more 10 h later.
    let first = T0 + 800 * 24 * HOUR_MS * 1000;
    let resp = ask("daily", "u").await;
    assert_eq!(code_and_remaining(&resp), (OK, 2));
    let status = &resp.statuses[0];
    assert_eq!(
        status.current_limit.as_ref().map(|l| (l.requests_per_unit, l.unit)),
        Some((3, Unit::Day as i32)),
        "reported as its capacity per the unit nearest its period"
    );
    assert_eq!(header(&resp, "ratelimit-policy"), Some("\"daily\";q=3;w=86400"));
    clock.advance_us(10 * HOUR_MS * 1000);
    for left in [1, 0] {
        assert_eq!(code_and_remaining(&ask("daily", "u").await), (OK, left));
    }
    // The 4th: denied until 24 h after the first use (14 h from now), not after the last.
    let resp = ask("daily", "u").await;
    assert_eq!(code_and_remaining(&resp), (OVER, 0));
    assert_eq!(header(&resp, "retry-after"), Some("50400"));
    assert_eq!(
        resp.statuses[0].duration_until_reset.as_ref().map(|d| d.seconds),
        Some(50_400)
    );
    // One millisecond before the expiry: denied, one second to wait (rounded up).
    clock.set_us(first + 24 * HOUR_MS * 1000 - 1000);
    let resp = ask("daily", "u").await;
    assert_eq!(code_and_remaining(&resp), (OVER, 0));
    assert_eq!(header(&resp, "retry-after"), Some("1"));
    // At the expiry: whole again; a new period starts with this use.
    clock.advance_us(1000);
    assert_eq!(code_and_remaining(&ask("daily", "u").await), (OK, 2));
    // Another user's allowance is their own.
    assert_eq!(code_and_remaining(&ask("daily", "v").await), (OK, 2));
}

#[tokio::test]
async fn on_memory() {
    let Harness { limiter, clock } = harness::harness_at(RULES, options(), T0);
    allowances_on(limiter, clock).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_redis() {
    let Some(url) = support::redis::shared_redis("fixed_allowances::on_redis") else {
        return;
    };
    let prefix = support::redis::unique_prefix("allowances");
    let clock = ManualClock::new(T0);
    let store = support::redis::store_on_clock(vec![url.clone()], false, &prefix, &clock).await;
    allowances_on(Limiter::new(harness::rules(RULES), store, options()), clock).await;
    tokio::task::block_in_place(|| support::redis::delete_prefix(url.as_str(), &prefix));
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres() {
    let Some(db) = support::postgres::TestSchema::new("fixed_allowances::on_postgres").await else {
        return;
    };
    let clock = ManualClock::new(T0);
    let store = db.store().await.with_time_override(Arc::new(clock.clone()));
    allowances_on(Limiter::new(harness::rules(RULES), store, options()), clock).await;
    db.drop().await;
}
