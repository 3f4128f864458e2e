//! Runs the shared token-bucket vectors (`tests/vectors/token_bucket.yaml`) against the memory
//! store. Other stores run the same file; all must agree exactly.

mod support;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::DateTime;

use serde::Deserialize;
use tollgate::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::clock::{ManualClock, SystemClock};
use tollgate::config::parse_refill;
use tollgate::schedule::{Plan, Quota, Schedule, ScheduleEntry};
use tollgate::settings::RedisSettings;
use tollgate::store::{BucketRef, MemoryStore, RedisStore, Store};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// When step 0 happens (RFC 3339); a fixed instant in 2023 when absent.
    start: Option<String>,
    buckets: Vec<BucketSpec>,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BucketSpec {
    capacity: Option<u64>,
    refill: Option<String>,
    schedule: Option<Vec<EntrySpec>>,
    quota: Option<QuotaSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EntrySpec {
    cron: String,
    timezone: Option<String>,
    scale: Option<f64>,
    capacity: Option<u64>,
    refill: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaSpec {
    limit: u64,
    reset: String,
    timezone: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Step {
    at_us: u64,
    demands: Vec<DemandSpec>,
    denied: bool,
    passed: Vec<bool>,
    tokens: Vec<u64>,
}

#[derive(Deserialize)]
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
    if let Some(q) = &spec.quota {
        return Plan::Quota(Arc::new(Quota::new(q.limit, &q.reset, q.timezone.as_deref()).unwrap()));
    }
    let base = Limit::new(
        spec.capacity.expect("a token bucket has a capacity"),
        rate(spec.refill.as_deref().expect("a token bucket has a refill")),
    );
    let Some(entries) = &spec.schedule else {
        return Plan::Fixed(base);
    };
    let entries = entries
        .iter()
        .map(|e| {
            let refill = e.refill.as_deref().map(rate);
            ScheduleEntry::new(&e.cron, e.timezone.as_deref(), e.scale, e.capacity, refill).unwrap()
        })
        .collect();
    Plan::Scheduled(Arc::new(Schedule::new(base, entries).unwrap()))
}

fn demand(d: &DemandSpec) -> Demand {
    let kind = match (d.consume, d.check, d.refund) {
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
        let buckets = bucket_refs(&case);
        for (n, step) in case.steps.iter().enumerate() {
            clock.set_us(start + step.at_us);
            let demands: Vec<Demand> = step.demands.iter().map(demand).collect();
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
        }
    }
}

#[tokio::test]
async fn memory_store_matches_the_shared_vectors() {
    check_vectors(|clock| async move { MemoryStore::new(8, 1000, Arc::new(clock)) }).await;
}

/// A Redis store on `urls` whose scripts decide at `clock`'s time instead of Redis `TIME`.
async fn redis_store(urls: Vec<String>, cluster: bool, prefix: &str, clock: &ManualClock) -> RedisStore {
    let settings = RedisSettings {
        urls,
        cluster,
        key_prefix: prefix.to_string(),
        command_timeout_ms: 2_000,
        ..RedisSettings::default()
    };
    let store = RedisStore::new(&settings, Arc::new(SystemClock))
        .unwrap()
        .with_time_override(Arc::new(clock.clone()));
    store.connect(Duration::from_secs(5)).await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_store_matches_the_shared_vectors() {
    let Some(url) = support::redis::shared_redis("redis_store_matches_the_shared_vectors") else {
        return;
    };
    let prefix = support::redis::unique_prefix("vectors");
    check_vectors(|clock| {
        let (url, prefix) = (url.clone(), prefix.clone());
        async move { redis_store(vec![url], false, &prefix, &clock).await }
    })
    .await;
    let without_ttl = tokio::task::block_in_place(|| support::redis::keys_without_ttl(url.as_str(), &prefix));
    assert!(without_ttl.is_empty(), "keys without a TTL: {without_ttl:?}");
}
