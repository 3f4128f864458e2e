//! Runs the shared token-bucket vectors (`tests/vectors/token_bucket.yaml`) against the memory
//! store. Other stores run the same file; all must agree exactly.

use crate::support;

use std::future::Future;
use std::sync::Arc;

use chrono::DateTime;

use serde::Deserialize;
use tollgate::core::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::core::clock::ManualClock;
use tollgate::core::schedule::{Expiring, Plan, Quota, Schedule, ScheduleEntry};
use tollgate::rules::parse_refill;
use tollgate::store::{BucketRef, MemoryStore, Store};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// When step 0 happens (RFC 3339); a fixed instant in 2023 when absent.
    start: Option<String>,
    buckets: Vec<BucketSpec>,
    steps: Vec<Step>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BucketSpec {
    capacity: Option<u64>,
    refill: Option<String>,
    schedule: Option<Vec<EntrySpec>>,
    quota: Option<QuotaSpec>,
    /// A debt bucket's floor, in tokens below zero (docs/usage-budgets.md): its plan's
    /// capacities are raised by it, a consume on it is a usage report and a check asks for a
    /// positive balance.
    #[serde(default)]
    debt_depth: Option<u64>,
    /// A fixed allowance's `expires`, in seconds: whole again this long after its first use.
    #[serde(default)]
    expires_s: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntrySpec {
    cron: String,
    timezone: Option<String>,
    scale: Option<f64>,
    capacity: Option<u64>,
    refill: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaSpec {
    limit: u64,
    reset: String,
    timezone: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Step {
    at_us: u64,
    /// The buckets' rules from this step on, as a reload replaces them (no request is sent).
    reload: Option<Vec<BucketSpec>>,
    #[serde(default)]
    demands: Vec<DemandSpec>,
    #[serde(default)]
    denied: bool,
    #[serde(default)]
    passed: Vec<bool>,
    #[serde(default)]
    tokens: Vec<u64>,
    /// Per bucket, micro-tokens of usage reports that found it at its floor (all 0 if absent).
    #[serde(default)]
    lost: Vec<u64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DemandSpec {
    bucket: usize,
    consume: Option<u64>,
    #[serde(default)]
    check: bool,
    refund: Option<u64>,
    #[serde(default)]
    shadow: bool,
}

fn rate(refill: &str) -> Rate {
    if refill == "none" {
        return Rate::ZERO;
    }
    let r = parse_refill(refill).unwrap();
    Rate::per(r.tokens, r.period_us).unwrap()
}

/// The bucket's plan: a quota, or a token bucket with or without a schedule.
fn plan(spec: &BucketSpec) -> Plan {
    let depth_ut = spec.debt_depth.unwrap_or(0) * MICRO;
    if let Some(q) = &spec.quota {
        let quota = Quota::new(q.limit, &q.reset, q.timezone.as_deref()).unwrap();
        return Plan::Quota(Arc::new(if depth_ut > 0 {
            quota.with_debt_depth(depth_ut)
        } else {
            quota
        }));
    }
    let mut base = Limit::new(
        spec.capacity.expect("a token bucket has a capacity"),
        rate(spec.refill.as_deref().expect("a token bucket has a refill")),
    );
    if let Some(seconds) = spec.expires_s {
        return Plan::Expiring(Expiring::new(base, seconds * 1_000_000));
    }
    let Some(entries) = &spec.schedule else {
        base.capacity_ut += depth_ut;
        return Plan::Fixed(base);
    };
    let entries = entries
        .iter()
        .map(|e| {
            let refill = e.refill.as_deref().map(rate);
            ScheduleEntry::new(&e.cron, e.timezone.as_deref(), e.scale, e.capacity, refill).unwrap()
        })
        .collect();
    Plan::Scheduled(Arc::new(
        Schedule::new(base, entries).unwrap().with_debt_depth(depth_ut),
    ))
}

/// A demand on the bucket it names among `buckets`: on a debt bucket a consume is a usage
/// report and a check asks for a positive balance.
fn demand(d: &DemandSpec, buckets: &[BucketSpec]) -> Demand {
    // `debt_depth: 0` is a debt bucket too, whose floor is at 0.
    let debt = buckets[d.bucket].debt_depth.is_some();
    let depth_ut = buckets[d.bucket].debt_depth.unwrap_or(0) * MICRO;
    let kind = match (d.consume, d.check, d.refund) {
        (Some(n), false, None) if debt => DemandKind::Debit {
            amount_ut: n * MICRO,
            depth_ut,
        },
        (None, true, None) if debt => DemandKind::DebtCheck { depth_ut },
        (Some(n), false, None) => DemandKind::Consume(n * MICRO),
        (None, true, None) => DemandKind::Check,
        (None, false, Some(n)) => DemandKind::Refund(n * MICRO),
        _ => panic!("a demand is exactly one of consume, check, refund"),
    };
    Demand {
        instance: d.bucket,
        kind,
        enforced: !d.shadow,
    }
}

/// The vectors, parsed; other stores' tests read the same file.
fn cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors/token_bucket.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn start_us(case: &Case) -> u64 {
    case.start.as_deref().map_or(1_700_000_000_000_000, |t| {
        DateTime::parse_from_rfc3339(t).unwrap().timestamp_micros() as u64
    })
}

fn bucket_refs(case: &Case) -> Vec<BucketRef> {
    case.buckets
        .iter()
        .enumerate()
        .map(|(i, b)| BucketRef {
            lease_ut: 0,
            key: format!("{}#{i}", case.name),
            plan: plan(b),
        })
        .collect()
}

/// Runs every case on a store made by `store_for` (given the case's clock), checking each
/// step's decision and the micro-tokens each bucket holds after it.
async fn check_vectors<S: Store, F: Future<Output = S>>(mut store_for: impl FnMut(ManualClock) -> F) {
    let cases = cases();
    assert!(cases.len() >= 6);
    for case in cases {
        let start = start_us(&case);
        let clock = ManualClock::new(start);
        let store = store_for(clock.clone()).await;
        let mut buckets = bucket_refs(&case);
        let mut specs = case.buckets.clone();
        for (n, step) in case.steps.iter().enumerate() {
            clock.set_us(start + step.at_us);
            if let Some(reloaded) = &step.reload {
                // What `Limiter::swap_rules` does to a bucket policy whose rules changed.
                assert_eq!(
                    reloaded.len(),
                    buckets.len(),
                    "case `{}` step {n}: one spec per bucket",
                    case.name
                );
                for (b, spec) in buckets.iter_mut().zip(reloaded) {
                    b.plan = Plan::after_reload(&b.plan, plan(spec), start + step.at_us);
                }
                specs = reloaded.clone();
                store.rules_changed();
                continue;
            }
            let demands: Vec<Demand> = step.demands.iter().map(|d| demand(d, &specs)).collect();
            let applied = store.apply(&buckets, &demands).await.unwrap();
            let at = format!("case `{}` step {n}", case.name);
            assert_eq!(
                applied.now_us,
                start + step.at_us,
                "{at}: the store decides at the injected time"
            );
            assert_eq!(applied.decision.denied, step.denied, "{at}: denied");
            assert_eq!(applied.decision.passed, step.passed, "{at}: passed");
            let tokens: Vec<u64> = applied.decision.instances.iter().map(|i| i.after.tokens_ut).collect();
            assert_eq!(tokens, step.tokens, "{at}: tokens");
            let lost: Vec<u64> = applied.decision.instances.iter().map(|i| i.lost_ut).collect();
            let want_lost = if step.lost.is_empty() {
                vec![0; lost.len()]
            } else {
                step.lost.clone()
            };
            assert_eq!(lost, want_lost, "{at}: lost");
        }
    }
}

#[tokio::test]
async fn memory_store_matches_the_shared_vectors() {
    check_vectors(|clock| async move { MemoryStore::new(8, 1000, Arc::new(clock)) }).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_store_matches_the_shared_vectors() {
    let Some(url) = support::redis::shared_redis("redis_store_matches_the_shared_vectors") else {
        return;
    };
    let prefix = support::redis::unique_prefix("vectors");
    check_vectors(|clock| {
        let (url, prefix) = (url.clone(), prefix.clone());
        async move { support::redis::store_on_clock(vec![url], false, &prefix, &clock).await }
    })
    .await;
    let without_ttl = tokio::task::block_in_place(|| support::redis::keys_without_ttl(url.as_str(), &prefix));
    assert_eq!(never_full(&without_ttl), without_ttl, "keys without a TTL");
    assert_eq!(
        never_full(&without_ttl).len(),
        1,
        "the spent allowance is kept, with no TTL"
    );
    tokio::task::block_in_place(|| support::redis::delete_prefix(url.as_str(), &prefix));
}

/// The same vectors with every request in the script's general form: the lean form (plain
/// token buckets and consumes) takes most of the cases above, so this keeps the general form's
/// handling of those checked too.
#[tokio::test(flavor = "multi_thread")]
async fn redis_store_matches_the_shared_vectors_in_the_general_form() {
    let Some(url) = support::redis::shared_redis("redis_store_matches_the_shared_vectors_in_the_general_form") else {
        return;
    };
    let prefix = support::redis::unique_prefix("vectors-general");
    check_vectors(|clock| {
        let (url, prefix) = (url.clone(), prefix.clone());
        async move {
            support::redis::store_on_clock(vec![url], false, &prefix, &clock)
                .await
                .general_form_only()
        }
    })
    .await;
    let without_ttl = tokio::task::block_in_place(|| support::redis::keys_without_ttl(url.as_str(), &prefix));
    assert_eq!(never_full(&without_ttl), without_ttl, "keys without a TTL");
    tokio::task::block_in_place(|| support::redis::delete_prefix(url.as_str(), &prefix));
}

/// Of `keys`, those of a bucket that will never be full again, the only keys that may live
/// without a TTL: a spent fixed allowance (a case named so) must not be forgotten, which would
/// hand it back.
fn never_full(keys: &[String]) -> Vec<String> {
    keys.iter()
        .filter(|k| k.contains("a fixed allowance"))
        .cloned()
        .collect()
}

/// The same vectors on a three-master Redis Cluster: the buckets of a case land in different
/// slots, so a step with several buckets runs one script per slot (and refunds on a denial).
#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster_matches_the_shared_vectors() {
    if support::redis::shared_redis("redis_cluster_matches_the_shared_vectors").is_none() {
        return;
    }
    let cluster = tokio::task::block_in_place(support::redis::RedisCluster::start);
    let urls = cluster.urls();
    let prefix = support::redis::unique_prefix("vectors-cluster");
    check_vectors(|clock| {
        let (urls, prefix) = (urls.clone(), prefix.clone());
        async move { support::redis::store_on_clock(urls, true, &prefix, &clock).await }
    })
    .await;
    let without_ttl = tokio::task::block_in_place(|| cluster.keys_without_ttl(&prefix));
    assert_eq!(never_full(&without_ttl), without_ttl, "keys without a TTL");
    assert_eq!(
        never_full(&without_ttl).len(),
        1,
        "the spent allowance is kept, with no TTL"
    );
}

/// The same vectors on the Postgres store (in a schema of its own), deciding at the injected
/// time instead of `clock_timestamp()`.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_store_matches_the_shared_vectors() {
    let Some(db) = support::postgres::TestSchema::new("postgres_store_matches_the_shared_vectors").await else {
        return;
    };
    check_vectors(|clock| {
        let db = &db;
        async move { db.store().await.with_time_override(Arc::new(clock)) }
    })
    .await;
    db.drop().await;
}

mod random {
    //! Random plans and request sequences, decided side by side by the memory store and the
    //! Redis store at the same (injected) instants: every decision and every micro-token must
    //! agree. This covers what the hand-written vectors do not: schedule changes crossed in
    //! any number, quota edges, a clock stepping back, many buckets per request, reloads that
    //! replace any kind of limit by any other.

    use super::*;
    use proptest::prelude::*;

    const START: u64 = 1_780_000_000_000_000; // 2026-05-28T20:26:40Z

    fn arb_ordinary() -> impl Strategy<Value = BucketSpec> {
        let refill = prop::sample::select(vec!["1/s", "10/1m", "3/1h", "7/1h", "1/250ms", "none"]);
        let entry = (
            prop::sample::select(vec![
                "* 12-13 * * *",
                "0-29 * * * *",
                "*/7 * * * *",
                "* * * * MON",
                "15-44 * * * *",
            ]),
            prop::sample::select(vec![
                (Some(0.5), None),
                (Some(2.0), None),
                (None, Some(0)),
                (None, Some(30)),
            ]),
        )
            .prop_map(|(cron, (scale, capacity))| EntrySpec {
                cron: cron.to_string(),
                timezone: None,
                scale,
                capacity,
                refill: None,
            });
        prop_oneof![
            (1..20u64, refill.clone()).prop_map(|(capacity, refill)| BucketSpec {
                capacity: Some(capacity),
                refill: Some(refill.to_string()),
                schedule: None,
                quota: None,
                debt_depth: None,
                expires_s: None,
            }),
            (2..20u64, refill, prop::collection::vec(entry, 1..3)).prop_map(|(capacity, refill, entries)| {
                BucketSpec {
                    capacity: Some(capacity),
                    refill: Some(refill.to_string()),
                    schedule: Some(entries),
                    quota: None,
                    debt_depth: None,
                    expires_s: None,
                }
            }),
            (
                1..10u64,
                prop::sample::select(vec!["0 * * * *", "*/20 * * * *", "0 0 * * *"])
            )
                .prop_map(|(limit, reset)| BucketSpec {
                    capacity: None,
                    refill: None,
                    schedule: None,
                    quota: Some(QuotaSpec {
                        limit,
                        reset: reset.to_string(),
                        timezone: None,
                    }),
                    debt_depth: None,
                    expires_s: None,
                }),
            (1..6u64, prop::sample::select(vec![1u64, 90, 3_600])).prop_map(|(capacity, expires)| BucketSpec {
                capacity: Some(capacity),
                refill: Some("none".to_string()),
                schedule: None,
                quota: None,
                debt_depth: None,
                expires_s: Some(expires),
            }),
        ]
    }

    /// A bucket of [`arb_ordinary`], now and then a debt bucket (a quota's floor at most one
    /// allowance deep, as the rules compiler requires).
    fn arb_bucket() -> impl Strategy<Value = BucketSpec> {
        (arb_ordinary(), prop::option::weighted(0.3, 0..20u64)).prop_map(|(mut b, depth)| {
            // (The rules compiler refuses debt on an expiring allowance.)
            b.debt_depth = depth
                .filter(|_| b.expires_s.is_none())
                .map(|d| b.quota.as_ref().map_or(d, |q| d.min(q.limit)));
            b
        })
    }

    fn arb_demand(buckets: usize) -> impl Strategy<Value = DemandSpec> {
        (0..buckets, 0..10u8, 1..6u64, any::<bool>()).prop_map(|(bucket, kind, n, shadow)| DemandSpec {
            bucket,
            consume: (kind < 7).then_some(n),
            check: kind == 7,
            refund: (kind > 7).then_some(n),
            shadow: shadow && kind == 0,
        })
    }

    /// Time steps in µs: mostly small, sometimes minutes or hours, now and then backwards.
    fn arb_step() -> impl Strategy<Value = i64> {
        prop_oneof![
            4 => 0..2_000_000i64,
            3 => 0..600_000_000i64,
            2 => 0..7_200_000_000i64,
            1 => -5_000_000..0i64,
        ]
    }

    /// A step: a time step, then a request, or now and then a reload that replaces every
    /// bucket's rules.
    type RandomStep = (i64, Vec<DemandSpec>, Option<Vec<BucketSpec>>);

    fn arb_case() -> impl Strategy<Value = (Vec<BucketSpec>, Vec<RandomStep>)> {
        prop::collection::vec(arb_bucket(), 1..4).prop_flat_map(|buckets| {
            let n = buckets.len();
            let reload = prop::option::weighted(0.15, prop::collection::vec(arb_bucket(), n..=n));
            let steps = prop::collection::vec((arb_step(), prop::collection::vec(arb_demand(n), 1..4), reload), 1..25);
            (Just(buckets), steps)
        })
    }

    /// The stores and bookkeeping one sequence is decided with: `redis` is the shared store
    /// compared with memory (Redis, or Postgres).
    struct Stores<'a, S> {
        rt: &'a tokio::runtime::Runtime,
        clock: &'a ManualClock,
        redis: &'a S,
        unbounded: &'a std::sync::Mutex<std::collections::HashSet<String>>,
    }

    /// Decides `steps` over buckets `specs` (case `n`, which names its keys) on a fresh memory
    /// store and on the shared store at the same instants: every decision and micro-token must
    /// agree.
    fn agree_on<S: Store>(
        s: &Stores<S>,
        n: u64,
        specs: &[BucketSpec],
        steps: &[RandomStep],
    ) -> Result<(), TestCaseError> {
        let (rt, clock, redis, unbounded) = (s.rt, s.clock, s.redis, s.unbounded);

        clock.set_us(START);
        let memory = MemoryStore::new(4, 1000, Arc::new(clock.clone()));
        let mut buckets: Vec<BucketRef> = specs
            .iter()
            .enumerate()
            .map(|(i, b)| BucketRef {
                lease_ut: 0,
                key: format!("case{n}#{i}"),
                plan: plan(b),
            })
            .collect();
        // Any plan a bucket has had, a reload's included, may have written its key.
        let note_unbounded = |buckets: &[BucketRef]| {
            for b in buckets {
                let plan = b.plan.current();
                if matches!(plan, Plan::Scheduled(_)) || matches!(plan, Plan::Fixed(l) if l.rate.is_zero()) {
                    unbounded.lock().unwrap().insert(b.key.clone());
                }
            }
        };
        note_unbounded(&buckets);
        let mut current: &[BucketSpec] = specs;
        let mut t = START;
        let mut latest = START;
        let mut reloaded_at = 0;
        for (k, (dt, demands, reload)) in steps.iter().enumerate() {
            // The clock steps back between requests, but never across a reload: a reload
            // comes after every write so far, and no request after it reads a time before
            // it. A clock stepping back across a reload is where the two stores may still
            // differ (docs/operations.md).
            t = t.saturating_add_signed(*dt).max(reloaded_at);
            if reload.is_some() {
                t = t.max(latest + 1);
                reloaded_at = t;
            }
            latest = latest.max(t);
            clock.set_us(t);
            if let Some(specs) = reload {
                for (b, spec) in buckets.iter_mut().zip(specs) {
                    b.plan = Plan::after_reload(&b.plan, plan(spec), t);
                }
                current = specs;
                note_unbounded(&buckets);
                memory.rules_changed();
                continue;
            }
            let demands: Vec<Demand> = demands.iter().map(|d| demand(d, current)).collect();
            let m = memory.apply_now(&buckets, &demands);
            let r = rt.block_on(redis.apply(&buckets, &demands)).unwrap();
            let at = format!("step {k} at {:+} µs", t as i64 - START as i64);
            prop_assert_eq!(m.decision.denied, r.decision.denied, "{}: denied", at);
            prop_assert_eq!(&m.decision.passed, &r.decision.passed, "{}: passed", at);
            let mt: Vec<u64> = m.decision.instances.iter().map(|i| i.after.tokens_ut).collect();
            let rt_: Vec<u64> = r.decision.instances.iter().map(|i| i.after.tokens_ut).collect();
            prop_assert_eq!(mt, rt_, "{}: tokens after", at);
            let ml: Vec<u64> = m.decision.instances.iter().map(|i| i.lost_ut).collect();
            let rl: Vec<u64> = r.decision.instances.iter().map(|i| i.lost_ut).collect();
            prop_assert_eq!(ml, rl, "{}: lost", at);
        }
        Ok(())
    }
    fn allowance(capacity: u64, expires_s: u64) -> BucketSpec {
        BucketSpec {
            capacity: Some(capacity),
            refill: Some("none".to_string()),
            schedule: None,
            quota: None,
            debt_depth: None,
            expires_s: Some(expires_s),
        }
    }

    fn hourly_quota(limit: u64) -> BucketSpec {
        BucketSpec {
            capacity: None,
            refill: None,
            schedule: None,
            quota: Some(QuotaSpec {
                limit,
                reset: "0 * * * *".to_string(),
                timezone: None,
            }),
            debt_depth: None,
            expires_s: None,
        }
    }

    fn take(n: u64) -> DemandSpec {
        DemandSpec {
            bucket: 0,
            consume: Some(n),
            check: false,
            refund: None,
            shadow: false,
        }
    }

    /// The random search's settings: 128 cases, or `PROPTEST_CASES` (2000 for a longer search).
    fn search() -> ProptestConfig {
        ProptestConfig {
            cases: std::env::var("PROPTEST_CASES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(128),
            failure_persistence: None,
            max_shrink_iters: 4096,
            ..ProptestConfig::default()
        }
    }

    /// Sequences the random search found where the stores disagreed, shrunk, kept as they are.
    /// Both reload an allowance (or a quota) into an expiring allowance: at the instant the old
    /// limit is whole again (the old period's end; a quota's reset edge, START + 2,000 s being
    /// 21:00 UTC), the bucket is whole under the new one too, and the next use starts its period.
    #[test]
    fn redis_and_memory_agree_on_sequences_found_before() {
        let Some(url) = support::redis::shared_redis("redis_and_memory_agree_on_sequences_found_before") else {
            return;
        };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let clock = ManualClock::new(START);
        let prefix = support::redis::unique_prefix("vectors-found");
        let redis = rt.block_on(support::redis::store_on_clock(
            vec![url.clone()],
            false,
            &prefix,
            &clock,
        ));
        let unbounded = std::sync::Mutex::new(std::collections::HashSet::<String>::new());
        let stores = Stores {
            rt: &rt,
            clock: &clock,
            redis: &redis,
            unbounded: &unbounded,
        };
        let check = DemandSpec {
            check: true,
            consume: None,
            ..take(0)
        };
        let cases: Vec<(Vec<BucketSpec>, Vec<RandomStep>)> = vec![
            (
                vec![allowance(1, 90)],
                vec![
                    (0, vec![take(1)], None),
                    (88_939_531, vec![take(1)], None),
                    (1_060_469, vec![], Some(vec![allowance(2, 3_600)])),
                    (0, vec![take(1)], None),
                ],
            ),
            (
                vec![hourly_quota(3)],
                vec![
                    (0, vec![take(1)], None),
                    (2_000_000_000, vec![], Some(vec![allowance(5, 1)])),
                    (620_457, vec![check, take(2)], None),
                    (767_321, vec![take(1), take(5)], None),
                ],
            ),
        ];
        for (n, (specs, steps)) in cases.iter().enumerate() {
            clock.set_us(START);
            if let Err(e) = agree_on(&stores, n as u64, specs, steps) {
                panic!("sequence {n}: {e}");
            }
        }
        support::redis::delete_prefix(url.as_str(), &prefix);
    }

    #[test]
    fn redis_and_memory_agree_on_random_sequences() {
        let Some(url) = support::redis::shared_redis("redis_and_memory_agree_on_random_sequences") else {
            return;
        };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let clock = ManualClock::new(START);
        let prefix = support::redis::unique_prefix("vectors-random");
        let redis = rt.block_on(support::redis::store_on_clock(
            vec![url.clone()],
            false,
            &prefix,
            &clock,
        ));
        let case_no = std::sync::atomic::AtomicU64::new(0);
        // Buckets whose full time the script may not know (a schedule walked beyond its
        // look-ahead, a refill of zero): their keys are kept without expiry, as memory keeps them.
        let unbounded = std::sync::Mutex::new(std::collections::HashSet::<String>::new());
        proptest!(search(), |((specs, steps) in arb_case())| {
            let n = case_no.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            agree_on(&Stores { rt: &rt, clock: &clock, redis: &redis, unbounded: &unbounded }, n, &specs, &steps)?;
        });
        let unbounded = unbounded.into_inner().unwrap();
        let without_ttl: Vec<String> = support::redis::keys_without_ttl(url.as_str(), &prefix)
            .into_iter()
            .filter(|k| !unbounded.iter().any(|id| k.ends_with(&format!("}}{id}"))))
            .collect();
        assert!(
            without_ttl.is_empty(),
            "keys of buckets with a known full time without a TTL: {without_ttl:?}"
        );
        support::redis::delete_prefix(url.as_str(), &prefix);
    }

    /// The same random search on Postgres: `tollgate_decide` (and the transaction for
    /// schedules and walks) must agree with memory as the Redis script does.
    #[test]
    fn postgres_and_memory_agree_on_random_sequences() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let Some(db) = rt.block_on(support::postgres::TestSchema::new(
            "postgres_and_memory_agree_on_random_sequences",
        )) else {
            return;
        };
        let clock = ManualClock::new(START);
        let store = rt.block_on(db.store()).with_time_override(Arc::new(clock.clone()));
        let case_no = std::sync::atomic::AtomicU64::new(0);
        let unbounded = std::sync::Mutex::new(std::collections::HashSet::<String>::new());
        proptest!(search(), |((specs, steps) in arb_case())| {
            let n = case_no.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            agree_on(&Stores { rt: &rt, clock: &clock, redis: &store, unbounded: &unbounded }, n, &specs, &steps)?;
        });
        rt.block_on(db.drop());
    }
}

/// A request far beyond the default limits (1,000 buckets and demands: 12,000 packed numbers
/// in, 7,002 out) is decided like any other, batched with small requests around it, which are
/// each decided exactly once.
///
/// This failed before `lua/decide.lua` read and packed its numbers in chunks: Lua's C stack
/// holds about 8,000 results, so the call failed with "stack overflow (too many results)", and
/// the requests decided ahead of it in the same call had already consumed.
#[tokio::test(flavor = "multi_thread")]
async fn redis_store_decides_a_request_of_a_thousand_buckets() {
    let Some(url) = support::redis::shared_redis("redis_store_decides_a_request_of_a_thousand_buckets") else {
        return;
    };
    let prefix = support::redis::unique_prefix("huge");
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = support::redis::store_on_clock(vec![url.clone()], false, &prefix, &clock).await;
    let limit = Limit::new(10, Rate::per(10, 3_600_000_000).unwrap());
    let bucket = |key: String| BucketRef {
        lease_ut: 0,
        key,
        plan: Plan::Fixed(limit),
    };
    let consume = |instance| Demand {
        instance,
        kind: DemandKind::Consume(MICRO),
        enforced: true,
    };
    let huge: Vec<BucketRef> = (0..1000).map(|i| bucket(format!("huge#{i}"))).collect();
    let huge_demands: Vec<Demand> = (0..1000).map(consume).collect();
    let small = [bucket("small".into())];
    let one = [consume(0)];

    for round in 1..=3u64 {
        let (a, b, c) = tokio::join!(
            store.apply(&small, &one),
            store.apply(&huge, &huge_demands),
            store.apply(&small, &one)
        );
        let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
        assert!(!a.decision.denied && !b.decision.denied && !c.decision.denied);
        assert_eq!(b.decision.passed, vec![true; 1000]);
        for (i, o) in b.decision.instances.iter().enumerate() {
            assert_eq!(o.after.tokens_ut, (10 - round) * MICRO, "round {round}, bucket {i}");
        }
        let kept = store.peek(&small).await.unwrap().kept[0].tokens_ut;
        assert_eq!(kept, (10 - 2 * round) * MICRO, "round {round}: each small request once");
    }
    tokio::task::block_in_place(|| support::redis::delete_prefix(url.as_str(), &prefix));
}
