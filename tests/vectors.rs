//! Runs the shared token-bucket vectors (`tests/vectors/token_bucket.yaml`) against the memory
//! store. Other stores run the same file; all must agree exactly.

use std::sync::Arc;

use serde::Deserialize;
use tollgate::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::clock::ManualClock;
use tollgate::config::parse_refill;
use tollgate::store::{BucketRef, MemoryStore};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    buckets: Vec<BucketSpec>,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BucketSpec {
    capacity: u64,
    refill: String,
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

fn limit(spec: &BucketSpec) -> Limit {
    if spec.refill == "none" {
        return Limit::new(spec.capacity, Rate::ZERO);
    }
    let r = parse_refill(&spec.refill).unwrap();
    Limit::new(spec.capacity, Rate::per(r.tokens, r.period_us).unwrap())
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
    const START: u64 = 1_700_000_000_000_000;
    let cases = cases();
    assert!(cases.len() >= 6);
    for case in cases {
        let clock = ManualClock::new(START);
        let store = MemoryStore::new(8, 1000, Arc::new(clock.clone()));
        let buckets: Vec<BucketRef> = case
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| BucketRef {
                key: format!("{}#{i}", case.name),
                limit: limit(b),
            })
            .collect();
        for (n, step) in case.steps.iter().enumerate() {
            clock.set_us(START + step.at_us);
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
