//! Runs the shared token-bucket vectors (`tests/vectors/token_bucket.yaml`) against the memory
//! store. Other stores run the same file; all must agree exactly.

use std::sync::Arc;

use chrono::DateTime;

use serde::Deserialize;
use tollgate::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::clock::ManualClock;
use tollgate::config::parse_refill;
use tollgate::schedule::{Plan, Quota, Schedule, ScheduleEntry};
use tollgate::store::{BucketRef, MemoryStore};

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

#[test]
fn memory_store_matches_the_shared_vectors() {
    let cases = cases();
    assert!(cases.len() >= 6);
    for case in cases {
        let start = case.start.as_deref().map_or(1_700_000_000_000_000, |t| {
            DateTime::parse_from_rfc3339(t).unwrap().timestamp_micros() as u64
        });
        let clock = ManualClock::new(start);
        let store = MemoryStore::new(8, 1000, Arc::new(clock.clone()));
        let buckets: Vec<BucketRef> = case
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| BucketRef {
                key: format!("{}#{i}", case.name),
                plan: plan(b),
            })
            .collect();
        for (n, step) in case.steps.iter().enumerate() {
            clock.set_us(start + step.at_us);
            let demands: Vec<Demand> = step.demands.iter().map(demand).collect();
            let applied = store.apply_now(&buckets, &demands);
            let at = format!("case `{}` step {n}", case.name);
            assert_eq!(applied.decision.denied, step.denied, "{at}: denied");
            assert_eq!(applied.decision.passed, step.passed, "{at}: passed");
            let tokens: Vec<u64> = applied.decision.instances.iter().map(|i| i.after.tokens_ut).collect();
            assert_eq!(tokens, step.tokens, "{at}: tokens");
        }
    }
}
