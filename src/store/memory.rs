//! The in-process store: a sharded map from instance key to bucket state.
//!
//! A bucket that has refilled to full is the same as no bucket, so full buckets are not kept:
//! a decision that leaves a bucket full removes it, and a periodic sweep drops buckets whose
//! refill has reached full since. Memory is therefore bounded by active (not full) buckets,
//! and by `max_buckets` beyond that: at the cap, the bucket closest to full among a small
//! sample is evicted (DESIGN.md suggests least recently used; closest to full is chosen
//! because evicting it over-admits least).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Applied, BucketRef, Store, StoreError};
use crate::bucket::{decide, time_to_full_us, BucketState, Demand};
use crate::clock::Clock;

struct Entry {
    state: BucketState,
    /// When the bucket will be full again, by the limit of its last decision: the sweep drops
    /// it from then on.
    full_at_us: u64,
}

type Shard = HashMap<String, Entry>;

/// Counters a memory store keeps about itself.
#[derive(Debug, Default)]
pub struct MemoryStoreStats {
    /// Buckets that were not full when evicted to stay under `max_buckets`: each may let a
    /// client through early (a bounded over-admission), so it is counted.
    pub evicted_not_full: AtomicU64,
}

/// The in-process store. Cheap to clone; clones share the buckets.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    per_shard_cap: usize,
    clock: Arc<dyn Clock>,
    stats: MemoryStoreStats,
}

impl MemoryStore {
    /// A store of `shards` shards (at least one) holding at most about `max_buckets` buckets,
    /// reading time from `clock`.
    pub fn new(shards: usize, max_buckets: usize, clock: Arc<dyn Clock>) -> MemoryStore {
        let shards = shards.max(1);
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| Mutex::new(HashMap::new())).collect(),
                hasher: RandomState::new(),
                per_shard_cap: max_buckets.div_ceil(shards).max(1),
                clock,
                stats: MemoryStoreStats::default(),
            }),
        }
    }

    /// How many buckets are held (not full).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The store's counters.
    pub fn stats(&self) -> &MemoryStoreStats {
        &self.inner.stats
    }

    /// The state held for `key`, if any (a missing bucket is a full one).
    pub fn peek(&self, key: &str) -> Option<BucketState> {
        let shard = self.shard_of(key);
        lock(&self.inner.shards[shard]).get(key).map(|e| e.state)
    }

    /// Drops every bucket that is full by now. Locks one shard at a time, so decisions on
    /// other shards go on meanwhile.
    pub fn sweep(&self) -> usize {
        let now = self.inner.clock.now_us();
        let mut dropped = 0;
        for shard in &self.inner.shards {
            let mut map = lock(shard);
            let before = map.len();
            map.retain(|_, e| e.full_at_us > now);
            dropped += before - map.len();
        }
        dropped
    }

    fn shard_of(&self, key: &str) -> usize {
        (self.inner.hasher.hash_one(key) % self.inner.shards.len() as u64) as usize
    }

    /// Decides synchronously; [`Store::apply`] wraps this.
    pub fn apply_now(&self, buckets: &[BucketRef], demands: &[Demand]) -> Applied {
        let mut shard_ids: Vec<usize> = buckets.iter().map(|b| self.shard_of(&b.key)).collect();
        let bucket_shards = shard_ids.clone();
        shard_ids.sort_unstable();
        shard_ids.dedup();
        // Locks are taken in ascending shard order, so two requests never wait on each other
        // in a cycle.
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            shard_ids.iter().map(|&i| (i, lock(&self.inner.shards[i]))).collect();
        let now = self.inner.clock.now_us();
        let guard_of = |shard: usize| shard_ids.binary_search(&shard).expect("shard was locked");
        let limits: Vec<_> = buckets.iter().map(|b| b.limit).collect();
        let states: Vec<BucketState> = buckets
            .iter()
            .zip(&bucket_shards)
            .map(|(b, &s)| {
                guards[guard_of(s)]
                    .1
                    .get(&b.key)
                    .map(|e| e.state)
                    .unwrap_or_else(|| BucketState::full(&b.limit, now))
            })
            .collect();
        let decision = decide(now, &states, &limits, demands);
        for ((b, &s), out) in buckets.iter().zip(&bucket_shards).zip(&decision.instances) {
            if !out.changed {
                continue;
            }
            let map = &mut guards[guard_of(s)].1;
            match time_to_full_us(out.after.tokens_ut, &b.limit) {
                Some(0) => {
                    map.remove(&b.key);
                }
                wait => {
                    // From the state's own time: after a clock step back it is ahead of `now`.
                    let full_at_us = wait.map_or(u64::MAX, |w| out.after.updated_us.saturating_add(w));
                    let entry = Entry {
                        state: out.after,
                        full_at_us,
                    };
                    if let Some(slot) = map.get_mut(&b.key) {
                        *slot = entry;
                    } else {
                        make_room(map, self.inner.per_shard_cap, now, &self.inner.stats);
                        map.insert(b.key.clone(), entry);
                    }
                }
            }
        }
        drop(guards);
        Applied { now_us: now, decision }
    }
}

/// How many entries [`make_room`] looks at to choose a victim.
const EVICTION_SAMPLE: usize = 16;

/// Keeps a shard under its cap before an insert: evicts the bucket closest to full (the least
/// possible over-admission) among a sample of [`EVICTION_SAMPLE`] entries, so the cost stays
/// constant however large the shard (a flood of new keys must not make every request scan it).
/// Evicting a bucket that is not yet full is counted.
fn make_room(map: &mut Shard, cap: usize, now: u64, stats: &MemoryStoreStats) {
    while map.len() >= cap {
        let Some((victim, full_at)) = map
            .iter()
            .take(EVICTION_SAMPLE)
            .min_by_key(|(_, e)| e.full_at_us)
            .map(|(k, e)| (k.clone(), e.full_at_us))
        else {
            return;
        };
        map.remove(&victim);
        if full_at > now {
            stats.evicted_not_full.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave a half-written entry (entries are replaced
    // whole), so a poisoned lock is still safe to use.
    shard.lock().unwrap_or_else(|p| p.into_inner())
}

impl Store for MemoryStore {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        Ok(self.apply_now(buckets, demands))
    }
}

#[cfg(test)]
mod tests;
