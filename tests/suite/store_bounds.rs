//! Bounds of the stores: state outlives the bucket on every store, and Redis keys stay small
//! whatever the descriptor values.
//!
//! State outlives the bucket on every store, at the load-time bounds of the rules: a bucket
//! drained under a 10-year fill (`MAX_FILL_US`, the slowest fill `src/rules/file/compile.rs`
//! accepts), a quota reset on 29 February (up to 8 years between resets, 2096 to 2104), and a
//! schedule whose refill lies beyond the look-ahead must keep what they consumed until they
//! are full again, whatever expires, is swept or evicted meanwhile.
//!
//! The memory and Postgres stores decide at an injected time and are swept at it. Redis
//! expires keys on its own clock, which a test cannot move by years, so there the key's time
//! to live is read: it must reach the instant the bucket is full (it was 400 days at most, and
//! a quota's 368: a drained bucket then came back full years early).

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use tollgate::core::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::core::clock::{ManualClock, SystemClock};
use tollgate::core::schedule::{Plan, Quota, Schedule, ScheduleEntry};
use tollgate::rules::instance_key;
use tollgate::server::settings::RedisSettings;
use tollgate::store::{BucketRef, MemoryStore, RedisStore, Store};

const DAY_US: u64 = 86_400 * MICRO;

/// 3,650 tokens at one a day: full from empty in exactly 10 years of 365 days, the slowest
/// fill the rules accept.
fn ten_year_fill() -> Plan {
    Plan::Fixed(Limit::new(3_650, Rate::per(1, DAY_US).unwrap()))
}

/// Five tokens a "year" that resets on 29 February only.
fn leap_day_quota() -> Plan {
    Plan::Quota(Arc::new(Quota::new(5, "0 0 29 2 *", None).unwrap()))
}

/// The 10-year fill with a one-minute window a day that doubles it: a change of limit twice a
/// day, so the time until full (years) lies beyond the look-ahead's 256 changes.
fn slow_schedule() -> Plan {
    let window = ScheduleEntry::new("0 12 * * *", None, Some(2.0), None, None).unwrap();
    Plan::Scheduled(Arc::new(
        Schedule::new(Limit::new(3_650, Rate::per(1, DAY_US).unwrap()), vec![window]).unwrap(),
    ))
}

fn utc_us(y: i32, m: u32, d: u32) -> u64 {
    Utc.with_ymd_and_hms(y, m, d, 0, 0, 0).unwrap().timestamp_micros() as u64
}

fn consume(n: u64) -> Vec<Demand> {
    vec![Demand {
        instance: 0,
        kind: DemandKind::Consume(n * MICRO),
        enforced: true,
    }]
}

/// A case: the plan, when it is drained, an instant shortly before it is full again (nothing
/// may have come back by then), and when it is full again (all of it comes back).
struct Case {
    name: &'static str,
    plan: Plan,
    capacity: u64,
    drained_at_us: u64,
    before_full_us: u64,
    full_at_us: u64,
}

fn cases(now_us: u64) -> Vec<Case> {
    vec![
        Case {
            name: "ten_year_fill",
            plan: ten_year_fill(),
            capacity: 3_650,
            drained_at_us: now_us,
            // One token short of full.
            before_full_us: now_us + 3_649 * DAY_US,
            full_at_us: now_us + 3_650 * DAY_US,
        },
        Case {
            name: "leap_day_quota",
            plan: leap_day_quota(),
            capacity: 5,
            // 2100 is not a leap year: the next reset after 2096's is in 2104.
            drained_at_us: utc_us(2096, 3, 1),
            before_full_us: utc_us(2104, 2, 28),
            full_at_us: utc_us(2104, 2, 29),
        },
    ]
}

/// Drains `case` on `store` (deciding at `clock`), lets `sweep` run shortly before the bucket
/// is full, and checks that nothing came back by then and everything did when it is full.
async fn keeps_state<S: Store>(store: &S, clock: &ManualClock, case: &Case, key: &str, sweep: impl AsyncFn()) {
    let buckets = [BucketRef {
        lease_ut: 0,
        key: key.to_string(),
        plan: case.plan.clone(),
    }];
    clock.set_us(case.drained_at_us);
    let first = store.apply(&buckets, &consume(case.capacity)).await.unwrap();
    assert!(
        !first.decision.denied,
        "{}: a full bucket admits its capacity",
        case.name
    );
    clock.set_us(case.before_full_us);
    sweep().await;
    let early = store.apply(&buckets, &consume(case.capacity)).await.unwrap();
    assert!(
        early.decision.denied,
        "{}: the drained bucket came back full before it was due (its state was forgotten)",
        case.name
    );
    clock.set_us(case.full_at_us);
    sweep().await;
    let due = store.apply(&buckets, &consume(case.capacity)).await.unwrap();
    assert!(!due.decision.denied, "{}: full again when due", case.name);
}

#[tokio::test]
async fn memory_keeps_state_until_full_at_the_bounds() {
    let clock = ManualClock::new(utc_us(2026, 1, 1));
    let memory = MemoryStore::new(2, 1000, Arc::new(clock.clone()));
    for case in cases(utc_us(2026, 1, 1)) {
        keeps_state(&memory, &clock, &case, case.name, async || {
            memory.sweep();
        })
        .await;
    }
    // The schedule whose full time the look-ahead does not find is kept (until evicted).
    let buckets = [BucketRef {
        lease_ut: 0,
        key: "slow_schedule".into(),
        plan: slow_schedule(),
    }];
    clock.set_us(utc_us(2026, 1, 1));
    assert!(!memory.apply_now(&buckets, &consume(3_650)).decision.denied);
    clock.set_us(utc_us(2026, 1, 1) + 1_000 * DAY_US);
    memory.sweep();
    assert!(memory.apply_now(&buckets, &consume(3_650)).decision.denied);
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_keeps_state_until_full_at_the_bounds() {
    let Some(db) = support::postgres::TestSchema::new("postgres_keeps_state_until_full_at_the_bounds").await else {
        return;
    };
    let clock = ManualClock::new(utc_us(2026, 1, 1));
    let store = db.store().await.with_time_override(Arc::new(clock.clone()));
    for case in cases(utc_us(2026, 1, 1)) {
        keeps_state(&store, &clock, &case, case.name, async || {
            store.sweep(1_000).await.unwrap();
        })
        .await;
    }
    let buckets = [BucketRef {
        lease_ut: 0,
        key: "slow_schedule".into(),
        plan: slow_schedule(),
    }];
    clock.set_us(utc_us(2026, 1, 1));
    assert!(!store.apply(&buckets, &consume(3_650)).await.unwrap().decision.denied);
    clock.set_us(utc_us(2026, 1, 1) + 1_000 * DAY_US);
    store.sweep(1_000).await.unwrap();
    assert!(store.apply(&buckets, &consume(3_650)).await.unwrap().decision.denied);
    db.drop().await;
}

/// On Redis the decisions run at the injected time but keys expire on Redis's own clock, so
/// the check is each key's time to live against the time until its bucket is full.
#[tokio::test(flavor = "multi_thread")]
async fn redis_keys_live_until_their_bucket_is_full_at_the_bounds() {
    let Some(url) = support::redis::shared_redis("redis_keys_live_until_their_bucket_is_full_at_the_bounds") else {
        return;
    };
    let prefix = support::redis::unique_prefix("lifetime");
    let clock = ManualClock::new(utc_us(2026, 1, 1));
    let store = support::redis::store_on_clock(vec![url.clone()], false, &prefix, &clock).await;
    let target = support::redis::RedisTarget::from(&url);
    let pttl = |identity: &str| {
        let key = tollgate::store::redis::keys::bucket_key(&prefix, identity);
        target.cmd(&[b"PTTL", &key]).as_int().expect("PTTL answers a number")
    };
    for case in cases(utc_us(2026, 1, 1)) {
        let buckets = [BucketRef {
            lease_ut: 0,
            key: case.name.into(),
            plan: case.plan.clone(),
        }];
        clock.set_us(case.drained_at_us);
        assert!(
            !store
                .apply(&buckets, &consume(case.capacity))
                .await
                .unwrap()
                .decision
                .denied
        );
        let ttl = tokio::task::block_in_place(|| pttl(case.name));
        let needed_ms = ((case.full_at_us - case.drained_at_us) / 1_000) as i64;
        assert!(
            ttl >= needed_ms,
            "{}: the key expires in {ttl} ms ({} days), before its bucket is full in {needed_ms} ms ({} days)",
            case.name,
            ttl / 86_400_000,
            needed_ms / 86_400_000
        );
        // Not without bound either: within the margin of the due time.
        assert!(ttl <= needed_ms + 2_000, "{}: {ttl} ms", case.name);
    }
    // Full time beyond the look-ahead: kept without expiry until a write finds it full.
    let buckets = [BucketRef {
        lease_ut: 0,
        key: "slow_schedule".into(),
        plan: slow_schedule(),
    }];
    clock.set_us(utc_us(2026, 1, 1));
    assert!(!store.apply(&buckets, &consume(3_650)).await.unwrap().decision.denied);
    let ttl = tokio::task::block_in_place(|| pttl("slow_schedule"));
    assert!(
        ttl == -1 || ttl >= (3_000 * DAY_US / 1_000) as i64,
        "the slow schedule's key expires in {ttl} ms ({} days), years before its bucket is full",
        ttl / 86_400_000
    );
    store.quit().await;
    tokio::task::block_in_place(|| support::redis::delete_prefix(url.as_str(), &prefix));
}

/// A descriptor value of 64 KiB (a header Envoy accepts) is decided on like any other, and the
/// key Redis stores for it is bounded (it held the value verbatim: 64 KiB per bucket); values a
/// byte apart are still different buckets.
#[tokio::test(flavor = "multi_thread")]
async fn redis_keys_are_bounded_whatever_the_value() {
    let Some(url) = support::redis::shared_redis("redis_keys_are_bounded_whatever_the_value") else {
        return;
    };
    let prefix = support::redis::unique_prefix("bounded-keys");
    let settings = RedisSettings {
        urls: vec![url.clone()],
        key_prefix: prefix.clone(),
        command_timeout_ms: tollgate::core::units::Millis(5_000),
        ..RedisSettings::default()
    };
    let store = RedisStore::new(&settings, Arc::new(SystemClock)).unwrap();
    store.connect(Duration::from_secs(10)).await.unwrap();
    let identity = |value: &str| {
        let mut out = String::new();
        let entries = [Entry {
            key: "authorization".into(),
            value: value.into(),
        }];
        instance_key(&mut out, "api", "per_token", &entries, &[None]);
        out
    };
    let long = "t".repeat(64 * 1024);
    let mut other = long.clone();
    other.push('u');
    let plan = Plan::Fixed(Limit::new(2, Rate::per(1, DAY_US).unwrap()));
    let bucket = |value: &str| {
        [BucketRef {
            lease_ut: 0,
            key: identity(value),
            plan: plan.clone(),
        }]
    };
    for _ in 0..2 {
        assert!(!store.apply(&bucket(&long), &consume(1)).await.unwrap().decision.denied);
    }
    assert!(
        store.apply(&bucket(&long), &consume(1)).await.unwrap().decision.denied,
        "the long value's bucket holds two tokens"
    );
    assert!(
        !store.apply(&bucket(&other), &consume(1)).await.unwrap().decision.denied,
        "a value one byte longer is another bucket"
    );
    let keys = tokio::task::block_in_place(|| support::redis::scan_keys_raw(url.as_str(), prefix.as_bytes()));
    assert_eq!(keys.len(), 2, "one key per bucket");
    for key in &keys {
        assert!(
            // The hash tag and at most 512 bytes of identity (keys.rs's MAX_VERBATIM_IDENTITY).
            key.len() <= prefix.len() + 18 + 512,
            "a key of {} bytes for a value of 64 KiB",
            key.len()
        );
    }
    store.quit().await;
    tokio::task::block_in_place(|| support::redis::delete_prefix(url.as_str(), &prefix));
}

/// Redis Cluster, a request over buckets in three slots, one of which denies: every bucket is
/// left as it was, but for the request's own refund, which applies. The admitting slots had
/// taken their consumption (a shadow demand's too) and give back exactly that; a shadow demand
/// a bucket could not cover took nothing and gives back nothing. (Before, a bucket with both a
/// refund and a shadow demand it could not cover was "refunded" the shadow demand it never
/// took: 5 tokens out of nothing.)
#[tokio::test(flavor = "multi_thread")]
async fn a_denial_across_slots_refunds_exactly_what_was_taken() {
    if support::redis::shared_redis("a_denial_across_slots_refunds_exactly_what_was_taken").is_none() {
        return;
    }
    let cluster = tokio::task::block_in_place(support::redis::RedisCluster::start);
    let prefix = support::redis::unique_prefix("cluster-refunds");
    let clock = ManualClock::new(utc_us(2026, 6, 1));
    let store = support::redis::store_on_clock(cluster.urls(), true, &prefix, &clock).await;
    let plan = Plan::Fixed(Limit::new(10, Rate::per(1, DAY_US).unwrap()));
    let buckets: Vec<BucketRef> = ["drained", "three_left", "five_left"]
        .iter()
        .map(|k| BucketRef {
            lease_ut: 0,
            key: (*k).into(),
            plan: plan.clone(),
        })
        .collect();
    let slots: std::collections::HashSet<u16> = buckets
        .iter()
        .map(|b| tollgate::store::redis::keys::slot(&tollgate::store::redis::keys::bucket_key(&prefix, &b.key)))
        .collect();
    assert_eq!(slots.len(), 3, "three slots");
    let demand = |instance, kind, enforced| Demand {
        instance,
        kind,
        enforced,
    };
    for (i, take) in [(0, 10), (1, 7), (2, 5)] {
        let one = std::slice::from_ref(&buckets[i]);
        assert!(!store.apply(one, &consume(take)).await.unwrap().decision.denied);
    }
    let tokens = |p: tollgate::store::Peeked| p.states.iter().map(|s| s.tokens_ut / MICRO).collect::<Vec<_>>();
    assert_eq!(tokens(store.peek(&buckets).await.unwrap()), [0, 3, 5]);

    let request = [
        demand(0, DemandKind::Consume(MICRO), true),      // denies: nothing left
        demand(1, DemandKind::Consume(5 * MICRO), false), // shadow, more than it holds
        demand(1, DemandKind::Refund(MICRO), true),       // always applies
        demand(2, DemandKind::Consume(2 * MICRO), true),  // taken, then given back
        demand(2, DemandKind::Consume(MICRO), false),     // shadow, taken with it, given back
    ];
    let applied = store.apply(&buckets, &request).await.unwrap();
    assert!(applied.decision.denied);
    let reported: Vec<u64> = applied
        .decision
        .instances
        .iter()
        .map(|o| o.after.tokens_ut / MICRO)
        .collect();
    assert_eq!(reported, [0, 4, 5], "as the decision reports them");
    assert_eq!(
        tokens(store.peek(&buckets).await.unwrap()),
        [0, 4, 5],
        "as Redis holds them: the refund applied, nothing else changed"
    );
    store.quit().await;
}
