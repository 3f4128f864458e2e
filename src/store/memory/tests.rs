use std::sync::Arc;

use super::*;
use crate::core::bucket::{DemandKind, Limit, Rate, MICRO};
use crate::core::clock::ManualClock;
use crate::core::schedule::Plan;

const HOUR_US: u64 = 3_600_000_000;

fn bucket(key: &str, capacity: u64, per_hour: u64) -> BucketRef {
    BucketRef {
        lease_ut: 0,
        key: key.to_owned(),
        plan: Plan::Fixed(Limit::new(capacity, Rate::per(per_hour, HOUR_US).unwrap())),
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
    let store = MemoryStore::new(64, 1_000_000, Arc::new(crate::core::clock::SystemClock));
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

/// The eviction sample covers the whole shard: with the shard at its cap, a quarter of it
/// freshly drained buckets inserted first (far from full) and the rest nearly full, thousands
/// of new keys evict nearly-full buckets only. Sampling always the same region of the table
/// (the first entries in table order) ends up evicting the drained buckets there, handing
/// their clients a fresh full bucket, while most of the shard is never looked at.
#[test]
fn eviction_samples_the_whole_shard_and_spares_drained_buckets() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 1000, Arc::new(clock));
    // Drained: empty, full again in 10 s. Nearly full: one token short, full in 1 s.
    for i in 0..250 {
        store.apply_now(&[bucket(&format!("drained{i}"), 10, 3600)], &[consume(0, 10)]);
    }
    for i in 0..750 {
        store.apply_now(&[bucket(&format!("nearly{i}"), 10, 3600)], &[consume(0, 1)]);
    }
    assert_eq!(store.len(), 1000);
    for i in 0..5000 {
        store.apply_now(&[bucket(&format!("new{i}"), 10, 3600)], &[consume(0, 1)]);
    }
    assert_eq!(store.len(), 1000);
    assert_eq!(store.stats().evicted_not_full.load(Ordering::Relaxed), 5000);
    let drained_kept = (0..250)
        .filter(|i| store.peek(&format!("drained{i}")).is_some())
        .count();
    let nearly_kept = (0..750).filter(|i| store.peek(&format!("nearly{i}")).is_some()).count();
    // A sample of 16 is all drained with probability 0.25^16 per insert: never in practice.
    assert_eq!(drained_kept, 250, "drained buckets were evicted");
    // Ties among the equally near full are broken by sample order, so each eviction takes one
    // of the 750 at random: an original one survives 5000 with probability about e^-6.7.
    assert!(
        nearly_kept < 75,
        "{nearly_kept} of 750 nearly-full buckets were never evicted"
    );
}

/// An instance key of `len` bytes, shaped like one ([`crate::rules::matcher::instance_key`]), ending
/// with `last`.
fn long_key(len: usize, last: char) -> String {
    let prefix = "6:domain4:rule3:key";
    let n = (1..len)
        .rev()
        .find(|n| prefix.len() + n.to_string().len() + 1 + n == len)
        .expect("a key this long");
    let key = format!("{prefix}{n}:{}{last}", "v".repeat(n - 1));
    assert_eq!(key.len(), len);
    key
}

#[test]
fn long_keys_differing_in_one_byte_are_different_buckets() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(4, 100, Arc::new(clock));
    let (a, b) = (long_key(60_000, 'a'), long_key(60_000, 'b'));
    assert!(
        !store
            .apply_now(&[bucket(&a, 2, 3600)], &[consume(0, 2)])
            .decision
            .denied
    );
    assert_eq!(store.peek(&a).unwrap().tokens_ut, 0);
    assert_eq!(store.peek(&b), None, "b is untouched, so full");
    assert!(
        !store
            .apply_now(&[bucket(&b, 2, 3600)], &[consume(0, 1)])
            .decision
            .denied
    );
    assert_eq!(store.peek(&b).unwrap().tokens_ut, MICRO);
    assert_eq!(store.len(), 2);
    assert!(
        store
            .apply_now(&[bucket(&a, 2, 3600)], &[consume(0, 1)])
            .decision
            .denied
    );
}

#[test]
fn a_long_key_finds_its_bucket_again() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let key = long_key(10_000, 'x');
    let b = [bucket(&key, 3, 3600)];
    store.apply_now(&b, &[consume(0, 2)]);
    assert_eq!(store.peek(&key).unwrap().tokens_ut, MICRO);
    store.apply_now(&b, &[consume(0, 1)]);
    assert_eq!(store.peek(&key).unwrap().tokens_ut, 0);
    assert!(store.apply_now(&b, &[consume(0, 1)]).decision.denied);
    assert_eq!(store.len(), 1);
    // Refilled to full by time: the sweep drops it like any other.
    clock.advance_us(2_999_999);
    assert_eq!(store.sweep(), 0);
    clock.advance_us(1);
    assert_eq!(store.sweep(), 1);
    assert!(store.is_empty());
    assert_eq!(store.peek(&key), None);
}

#[test]
fn keys_of_any_length_are_told_apart() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 100, Arc::new(clock));
    // Keys that differ only in their last byte, short and long, are distinct buckets.
    for len in [24, 128, 129, 1000, 60_000] {
        for tail in ['y', 'z'] {
            let key = long_key(len, tail);
            store.apply_now(&[bucket(&key, 10, 3600)], &[consume(0, 1)]);
            assert_eq!(store.peek(&key).map(|s| s.tokens_ut), Some(9 * MICRO), "{len} {tail}");
        }
    }
    assert_eq!(store.len(), 10);
}

/// Which buckets read as absent around reloads, including when old reloads were forgotten.
#[test]
fn forgotten_around_reloads() {
    let none = Reloads::default();
    assert!(none.forgotten(100, 200, 200), "full by now, no reload since");
    assert!(!none.forgotten(100, 201, 200));
    let one = Reloads {
        at_us: vec![150],
        forgotten_until_us: 0,
    };
    assert!(one.forgotten(100, 150, 300), "full by the reload");
    assert!(
        !one.forgotten(100, 151, 300),
        "not full by the reload: the new rules decide"
    );
    assert!(
        one.forgotten(150, 160, 300) == one.forgotten(150, 160, 150),
        "a reload at the write counts as after it"
    );
    assert!(!one.forgotten(150, 160, 300));
    assert!(
        one.forgotten(151, 160, 300),
        "written after the reload: its own full time"
    );
    let truncated = Reloads {
        at_us: vec![500, 600],
        forgotten_until_us: 400,
    };
    assert!(
        !truncated.forgotten(300, 301, 1000),
        "a forgotten reload may lie after the write"
    );
    assert!(truncated.forgotten(450, 500, 1000));
    assert!(!truncated.forgotten(450, 501, 1000));
}

fn refund(instance: usize, n: u64) -> Demand {
    Demand {
        instance,
        kind: DemandKind::Refund(n.saturating_mul(MICRO)),
        enforced: true,
    }
}

/// A peek reads the bucket as a decision would (brought forward to now) but writes nothing:
/// not the tokens, not `updated_us`, not when it is forgotten; a twin store that was never
/// peeked decides the same afterwards.
#[test]
fn peek_changes_nothing() {
    let clock = ManualClock::new(1_000_000);
    let peeked = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let twin = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let b = [bucket("a", 10, 3600), bucket("untouched", 4, 3600)]; // 1 token per second
    for store in [&peeked, &twin] {
        store.apply_now(&b[..1], &[consume(0, 3)]);
    }
    let stored = peeked.peek("a").unwrap();
    assert_eq!(stored.tokens_ut, 7 * MICRO);
    clock.advance_us(500_001);
    let p = peeked.peek_now(&b);
    assert_eq!(p.now_us, 1_500_001);
    // Brought forward: half a token refilled. Kept: as stored. Untouched: full at now.
    assert_eq!(
        p.states[0],
        BucketState {
            tokens_ut: 7 * MICRO + 500_001,
            updated_us: 1_500_001
        }
    );
    assert_eq!(p.kept[0], stored);
    assert_eq!(
        p.states[1],
        BucketState::full(&b[1].plan.limit_at(1_500_001), 1_500_001)
    );
    assert_eq!(p.kept[1], p.states[1]);
    // Nothing was written: the stored state is as it was, the untouched bucket still absent.
    assert_eq!(peeked.peek("a"), Some(stored));
    assert_eq!(peeked.peek("untouched"), None);
    assert_eq!(peeked.len(), 1);
    // Peeking again and again changes nothing either; the twin decides alike.
    for _ in 0..3 {
        assert_eq!(peeked.peek_now(&b), p);
    }
    for n in [2, 5, 1, 1] {
        clock.advance_us(250_000);
        peeked.peek_now(&b);
        let (x, y) = (
            peeked.apply_now(&b[..1], &[consume(0, n)]),
            twin.apply_now(&b[..1], &[consume(0, n)]),
        );
        assert_eq!(x.decision, y.decision);
        assert_eq!(peeked.peek("a"), twin.peek("a"));
    }
    // Full again by time: forgotten (and swept) exactly when the twin's is.
    let full_in = b[0].plan.full_at_us(peeked.peek("a").unwrap()).unwrap() - clock.now_us();
    clock.advance_us(full_in - 1);
    peeked.peek_now(&b);
    assert_eq!((peeked.sweep(), twin.sweep()), (0, 0));
    clock.advance_us(1);
    assert_eq!(peeked.peek_now(&b).states[0].tokens_ut, 10 * MICRO);
    assert_eq!((peeked.sweep(), twin.sweep()), (1, 1));
}

/// A bucket full by now but not swept yet reads as full at now, kept state included, as it
/// does for a decision.
#[test]
fn peek_reads_a_bucket_full_by_now_as_absent() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let b = [bucket("a", 2, 3600)];
    store.apply_now(&b, &[consume(0, 1)]);
    clock.advance_us(5_000_000);
    assert!(store.peek("a").is_some(), "not swept yet");
    let p = store.peek_now(&b);
    let full = BucketState {
        tokens_ut: 2 * MICRO,
        updated_us: 5_000_000,
    };
    assert_eq!((p.states[0], p.kept[0]), (full, full));
}

#[test]
fn reset_makes_buckets_full() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let b = [bucket("a", 5, 3600), bucket("b", 3, 0), bucket("never_used", 2, 3600)];
    store.apply_now(&b[..2], &[consume(0, 5), consume(1, 2)]);
    assert_eq!(store.len(), 2);
    assert!(store.apply_now(&b[..1], &[consume(0, 1)]).decision.denied);
    clock.advance_us(10);
    let r = store.reset_now(&b);
    assert!(store.is_empty(), "a full bucket is no bucket");
    let full = |cap: u64| BucketState {
        tokens_ut: cap * MICRO,
        updated_us: 10,
    };
    assert_eq!(r.now_us, 10);
    assert_eq!(r.states, [full(5), full(3), full(2)]);
    assert_eq!(r.kept, r.states);
    assert_eq!(store.peek_now(&b), r);
    // The whole capacity is there again, even for a bucket that never refills.
    assert!(
        !store
            .apply_now(&b[..2], &[consume(0, 5), consume(1, 3)])
            .decision
            .denied
    );
}

/// Refunds (how the admin API refunds) go back into the bucket, never above the capacity.
#[test]
fn refund_never_exceeds_capacity() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(4, 100, Arc::new(clock.clone()));
    let b = [bucket("a", 10, 3600)];
    store.apply_now(&b, &[consume(0, 6)]);
    let a = store.apply_now(&b, &[refund(0, 2)]);
    assert_eq!(a.decision.instances[0].after.tokens_ut, 6 * MICRO);
    assert_eq!(store.peek("a").unwrap().tokens_ut, 6 * MICRO);
    // Beyond the capacity: capped at it, and a full bucket is not kept.
    let a = store.apply_now(&b, &[refund(0, 5)]);
    assert_eq!(a.decision.instances[0].after.tokens_ut, 10 * MICRO);
    assert!(store.is_empty());
    // On a full bucket, or by any amount: still the capacity, nothing stored.
    for n in [1, u64::MAX] {
        let a = store.apply_now(&b, &[refund(0, n), refund(0, n)]);
        assert_eq!(a.decision.instances[0].after.tokens_ut, 10 * MICRO);
        assert!(store.is_empty());
    }
    // Half-refilled: the refund tops up to exactly the capacity.
    store.apply_now(&b, &[consume(0, 10)]);
    clock.advance_us(1_500_000);
    let a = store.apply_now(&b, &[refund(0, 9)]);
    assert_eq!(a.decision.instances[0].after.tokens_ut, 10 * MICRO);
    assert_eq!(store.peek_now(&b).states[0].tokens_ut, 10 * MICRO);
}

/// A sweep over a shard many times longer than one chunk drops exactly the buckets full by
/// now, wherever they sit in it.
#[test]
fn a_sweep_in_chunks_drops_exactly_the_full_buckets() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 10_000, Arc::new(clock.clone()));
    // A token an hour: even buckets take one (full again in an hour), odd ones five.
    for i in 0..2_000 {
        let taken = if i % 2 == 0 { 1 } else { 5 };
        store.apply_now(&[bucket(&format!("k{i}"), 10, 1)], &[consume(0, taken)]);
    }
    assert_eq!(store.len(), 2_000);
    clock.advance_us(HOUR_US);
    assert_eq!(store.sweep(), 1_000);
    assert_eq!(store.len(), 1_000);
    for i in 0..2_000 {
        assert_eq!(store.peek(&format!("k{i}")).is_some(), i % 2 == 1, "k{i}");
    }
}

/// After a burst of keys that all fill again, a sweep gives the shard's memory back (an
/// `IndexMap` never shrinks by itself): a replica that once held a million buckets does not keep
/// their room for good.
#[test]
fn a_sweep_after_a_burst_gives_the_memory_back() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 100_000, Arc::new(clock.clone()));
    for i in 0..20_000 {
        store.apply_now(&[bucket(&format!("k{i}"), 10, 1)], &[consume(0, 1)]);
    }
    let before = lock(&store.inner.shards[0]).capacity();
    assert!(before >= 20_000, "capacity {before}");
    // One bucket stays short of full; the rest fill again within the hour.
    clock.advance_us(HOUR_US / 2);
    store.apply_now(&[bucket("kept", 10, 1)], &[consume(0, 5)]);
    clock.advance_us(HOUR_US / 2);
    assert_eq!(store.sweep(), 20_000);
    let after = lock(&store.inner.shards[0]).capacity();
    assert!(after < before / 4, "capacity {before} -> {after}");
    assert!(store.peek("kept").is_some());
}

/// Issue 7: idle buckets are evicted without a stop-the-world pause. A sweep drops 300,000
/// buckets that filled again, all in one shard (the worst case: a sweep that held the shard
/// would keep every request to it waiting for the whole sweep), while another thread decides
/// on that shard throughout: decisions keep getting in during the sweep, and none waits for
/// more than a small part of it.
#[test]
fn a_sweep_of_many_buckets_lets_decisions_in_throughout() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    const BUCKETS: usize = 300_000;
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 2 * BUCKETS, Arc::new(clock.clone()));
    let mut b = [bucket("k", 10, 1)];
    for i in 0..BUCKETS {
        b[0].key = format!("k{i}");
        store.apply_now(&b, &[consume(0, 1)]);
    }
    clock.advance_us(HOUR_US);
    let sweeping = AtomicBool::new(true);
    let (swept, sweep_took, (during, longest)) = std::thread::scope(|s| {
        let probe = s.spawn(|| {
            let probe = [bucket("probe", u64::MAX / MICRO / 4, 1)];
            let (mut during, mut longest) = (0u64, Duration::ZERO);
            while sweeping.load(Ordering::Relaxed) {
                let started = Instant::now();
                store.apply_now(&probe, &[consume(0, 1)]);
                longest = longest.max(started.elapsed());
                during += 1;
            }
            (during, longest)
        });
        let started = Instant::now();
        let swept = store.sweep();
        let took = started.elapsed();
        sweeping.store(false, Ordering::Relaxed);
        (swept, took, probe.join().unwrap())
    });
    assert_eq!(swept, BUCKETS);
    eprintln!("sweep of {BUCKETS} buckets: {sweep_took:?}; {during} decisions meanwhile, the longest {longest:?}");
    // Quiet machine, debug build: 14,000 to 20,000 decisions in a 400 ms sweep, the longest
    // 3 to 4.5 ms. When the sweep released the shard with an unlock and a yield, it took the
    // lock back before a woken request could: 12 to 400 decisions, the longest 60 to 110 ms.
    assert!(during >= 1_000, "{during} decisions in a {sweep_took:?} sweep");
    assert!(
        longest * 4 < sweep_took,
        "a decision waited {longest:?} of a {sweep_took:?} sweep"
    );
}

/// `max_buckets` caps the whole store, not each shard: with 64 shards a cap of 10 holds 10
/// buckets (per shard it held up to 64), from one thread and from many at once, and a request
/// over several shards still finds room.
#[test]
fn max_buckets_caps_the_whole_store_across_shards() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(64, 10, Arc::new(clock.clone()));
    for i in 0..1000 {
        store.apply_now(&[bucket(&format!("k{i}"), 10, 3600)], &[consume(0, 1)]);
        assert!(
            store.len() <= 10,
            "{} buckets held after {} inserts",
            store.len(),
            i + 1
        );
    }
    assert_eq!(store.len(), 10);
    let evicted = store.stats().evicted_not_full.load(Ordering::Relaxed);
    assert_eq!(evicted, 990, "each insert past the cap evicted one unfull bucket");
    let pair = [bucket("left", 10, 3600), bucket("right", 10, 3600)];
    store.apply_now(&pair, &[consume(0, 1), consume(1, 1)]);
    assert_eq!(store.len(), 10);
    assert!(store.peek("left").is_some() && store.peek("right").is_some());

    let store = MemoryStore::new(64, 10, Arc::new(crate::core::clock::SystemClock));
    std::thread::scope(|s| {
        for t in 0..8 {
            let store = &store;
            s.spawn(move || {
                for i in 0..2000 {
                    store.apply_now(&[bucket(&format!("t{t}k{i}"), 10, 3600)], &[consume(0, 1)]);
                }
            });
        }
    });
    // Concurrent inserts may pass the cap only while they race; at rest it holds.
    assert!(store.len() <= 10, "{} buckets held", store.len());
}

/// Room made for a request's second new bucket never evicts its first (written a moment
/// before): with one shard and a cap of one, the request keeps both for now (the store is over
/// its cap until the next insert evicts), where it used to lose what it took from the first.
#[test]
fn a_request_never_evicts_its_own_buckets() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new(1, 1, Arc::new(clock.clone()));
    store.apply_now(&[bucket("other", 10, 3600)], &[consume(0, 1)]);
    let pair = [bucket("left", 10, 3600), bucket("right", 10, 3600)];
    store.apply_now(&pair, &[consume(0, 1), consume(1, 1)]);
    assert!(store.peek("other").is_none(), "another request's bucket made room");
    assert!(store.peek("left").is_some() && store.peek("right").is_some());
    store.apply_now(&[bucket("next", 10, 3600)], &[consume(0, 1)]);
    assert!(
        store.len() <= 2,
        "the next insert brings the store back towards its cap: {}",
        store.len()
    );
}
