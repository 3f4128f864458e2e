use std::sync::Arc;

use super::*;
use crate::bucket::{DemandKind, Limit, Rate, MICRO};
use crate::clock::ManualClock;

const HOUR_US: u64 = 3_600_000_000;

fn bucket(key: &str, capacity: u64, per_hour: u64) -> BucketRef {
    BucketRef {
        key: key.to_owned(),
        limit: Limit::new(capacity, Rate::per(per_hour, HOUR_US).unwrap()),
    }
}

fn consume(instance: usize, n: u64) -> Demand {
    Demand {
        instance,
        kind: DemandKind::Consume(n * MICRO),
        enforced: true,
    }
}

/// Acceptance: 64 concurrent callers on one bucket of capacity 100 refilled 100 per hour get
/// exactly 100 admissions (a run of a few seconds accrues no whole token).
#[test]
fn sixty_four_threads_admit_exactly_capacity() {
    let store = MemoryStore::new(64, 1_000_000, Arc::new(crate::clock::SystemClock));
    let admitted = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..64 {
            s.spawn(|| {
                let b = [bucket("shared", 100, 100)];
                for _ in 0..50 {
                    if !store.apply_now(&b, &[consume(0, 1)]).decision.denied {
                        admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert_eq!(admitted.into_inner(), 100);
}

#[test]
fn full_buckets_are_not_kept() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let b = [bucket("a", 10, 3600)]; // 1 token per second
    store.apply_now(&b, &[consume(0, 2)]);
    assert_eq!(store.len(), 1);
    // A check and a refund that fills it again: a full bucket is dropped on write.
    let refund = Demand {
        instance: 0,
        kind: DemandKind::Refund(2 * MICRO),
        enforced: true,
    };
    store.apply_now(&b, &[refund]);
    assert!(store.is_empty());
    // Refilled to full by time: the sweep drops it, not before.
    store.apply_now(&b, &[consume(0, 2)]);
    clock.advance_us(1_999_999);
    assert_eq!(store.sweep(), 0);
    clock.advance_us(1);
    assert_eq!(store.sweep(), 1);
    assert!(store.is_empty());
}

#[test]
fn all_or_nothing_across_shards() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(64, 1000, Arc::new(clock));
    let buckets: Vec<BucketRef> = (0..8).map(|i| bucket(&format!("b{i}"), 5, 1)).collect();
    // Drain the last bucket, then ask all eight for one token: nothing moves anywhere.
    store.apply_now(&buckets[7..], &[consume(0, 5)]);
    let demands: Vec<Demand> = (0..8).map(|i| consume(i, 1)).collect();
    let applied = store.apply_now(&buckets, &demands);
    assert!(applied.decision.denied);
    for b in &buckets[..7] {
        assert_eq!(store.peek(&b.key), None, "{} must still be full (absent)", b.key);
    }
    assert_eq!(store.peek("b7").unwrap().tokens_ut, 0);
}

#[test]
fn the_cap_evicts_the_bucket_closest_to_full_and_counts_it() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 2, Arc::new(clock));
    store.apply_now(&[bucket("nearly_full", 10, 3600)], &[consume(0, 1)]);
    store.apply_now(&[bucket("empty", 10, 3600)], &[consume(0, 10)]);
    store.apply_now(&[bucket("third", 10, 3600)], &[consume(0, 5)]);
    assert_eq!(store.len(), 2);
    assert_eq!(store.peek("nearly_full"), None);
    assert!(store.peek("empty").is_some());
    assert_eq!(store.stats().evicted_not_full.load(Ordering::Relaxed), 1);
}

#[test]
fn a_denied_request_writes_nothing() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let b = [bucket("a", 2, 3600)];
    store.apply_now(&b, &[consume(0, 2)]);
    let before = store.peek("a").unwrap();
    clock.advance_us(500_000);
    assert!(store.apply_now(&b, &[consume(0, 1)]).decision.denied);
    assert_eq!(store.peek("a").unwrap(), before);
}

#[test]
fn at_the_cap_each_insert_evicts_one_and_only_unfull_evictions_count() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 1000, Arc::new(clock.clone()));
    for i in 0..1000 {
        store.apply_now(&[bucket(&format!("k{i}"), 10, 3600)], &[consume(0, 1)]);
    }
    assert_eq!(store.len(), 1000);
    store.apply_now(&[bucket("new", 10, 3600)], &[consume(0, 1)]);
    assert_eq!(store.len(), 1000);
    assert!(store.peek("new").is_some());
    assert_eq!(store.stats().evicted_not_full.load(Ordering::Relaxed), 1);
    // Once every held bucket has refilled to full, evicting one loses nothing: not counted.
    clock.advance_us(1_000_000);
    store.apply_now(&[bucket("newer", 10, 3600)], &[consume(0, 1)]);
    assert_eq!(store.len(), 1000);
    assert_eq!(store.stats().evicted_not_full.load(Ordering::Relaxed), 1);
}
