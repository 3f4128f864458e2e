//! The in-process store: a sharded map from instance key to bucket state.
//!
//! A bucket that has refilled to full is the same as no bucket, so full buckets are not kept:
//! a decision that leaves a bucket full removes it, and a periodic sweep drops buckets whose
//! refill has reached full since. Memory is therefore bounded by active (not full) buckets,
//! and by `max_buckets` beyond that, a cap on the whole store (an atomic count of the buckets
//! held, so no lock beyond the shards a request already holds): at the cap, the bucket closest
//! to full among a small random sample of the inserting shard (or, if that one is empty, of
//! another) is evicted (closest to full rather than least recently used, because
//! evicting it over-admits least).
//!
//! Each bucket also costs the same small amount of memory, whatever the size of its key: a key
//! is stored as its [`Digest`], 128 bits of keyed hash (a client can send header values of
//! tens of KiB, and cannot aim its key at another client's bucket without the hash keys). A
//! held bucket takes its map entry (48 bytes: the hash, the digest and the state, in one place,
//! so a lookup reads no other memory) and its index slot (9 bytes, at most 7/8 of the slots
//! used): about 60 to 70 bytes, up to about 120 right after a shard's table has doubled. A
//! million buckets take about 65 to 120 MB.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use arc_swap::ArcSwap;
use indexmap::IndexMap;
use smallvec::SmallVec;

mod settings;

pub use settings::MemorySettings;

use super::digest::{Digest, DigestHash, Digester};
use super::{Applied, BucketRef, Peeked, Store, StoreError};
use crate::core::bucket::{decide, BucketState, Demand};
use crate::core::clock::Clock;

struct Entry {
    state: BucketState,
    /// When the bucket will be full again, by the plan of its last decision
    /// ([`crate::core::schedule::Plan::full_at_us`]): from then on it reads as absent and the sweep
    /// drops it.
    full_at_us: u64,
}

/// One shard: a key's [`Digest`] to its bucket. An `IndexMap` so that eviction can pick entries
/// at random positions in constant time; hashed by [`DigestHash`], since a digest is already a
/// keyed hash.
type Shard = IndexMap<Digest, Entry, DigestHash>;

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
    /// Seeds the eviction sample.
    hasher: RandomState,
    /// Makes a key's [`Digest`].
    digester: Digester,
    /// Counts eviction samples drawn: hashed with `hasher`, a fresh seed for each.
    samples: AtomicU64,
    /// The cap on buckets held in all shards together (`memory.max_buckets`, at least 1).
    max_buckets: usize,
    /// Buckets held in all shards together: every insert and removal moves it, under the
    /// shard's lock. An insert at the cap evicts first, so it exceeds `max_buckets` only while
    /// concurrent inserts find every other bucket in a shard someone else holds.
    held: AtomicUsize,
    clock: Arc<dyn Clock>,
    stats: MemoryStoreStats,
    /// When the rules were last replaced (see [`Store::rules_changed`]).
    reloads: ArcSwap<Reloads>,
    /// Per shard, the latest `updated_us` written to it (written under its lock), so that a
    /// reload counts as after every write before it even when the clock has stepped back.
    written: Box<[LatestWrite]>,
}

/// The latest write of one shard, on a cache line of its own (shards are written from
/// different cores).
#[derive(Default)]
#[repr(align(64))]
struct LatestWrite(AtomicU64);

/// The instants (by the store's clock) the rules were replaced at, the latest
/// [`MAX_RELOADS_KEPT`] of them, ascending.
#[derive(Default)]
struct Reloads {
    at_us: Vec<u64>,
    /// The latest instant forgotten to stay within [`MAX_RELOADS_KEPT`] (0: none).
    forgotten_until_us: u64,
}

/// How many reload instants are remembered.
const MAX_RELOADS_KEPT: usize = 64;

impl Reloads {
    /// Whether a bucket written at `written_us`, to be full at `full_at_us` under the rules of
    /// that write, reads as absent at `now_us`. A full bucket is the same as none, so it is
    /// absent once full, but only by the rules it was written under: if the rules were replaced
    /// before it was full, the new rules decide from its state (a raised capacity grants nothing
    /// at once, a lowered refill is not bypassed). When the reloads after the write are no
    /// longer all remembered, it is kept (deciding from its state never over-admits).
    fn forgotten(&self, written_us: u64, full_at_us: u64, now_us: u64) -> bool {
        // A reload at the very microsecond of the write counts as after it (it may have been):
        // the bucket is then decided by its state, which never over-admits.
        if self.at_us.last().is_none_or(|last| *last < written_us) {
            return full_at_us <= now_us;
        }
        if written_us <= self.forgotten_until_us {
            return false;
        }
        let first_after = self.at_us[self.at_us.partition_point(|r| *r < written_us)];
        full_at_us <= first_after.min(now_us)
    }
}

impl MemoryStore {
    /// A store of `shards` shards (at least one) holding at most `max_buckets` buckets in all,
    /// reading time from `clock`.
    pub fn new(shards: usize, max_buckets: usize, clock: Arc<dyn Clock>) -> MemoryStore {
        let shards = shards.max(1);
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards)
                    .map(|_| Mutex::new(IndexMap::with_hasher(DigestHash)))
                    .collect(),
                hasher: RandomState::new(),
                digester: Digester::random(),
                samples: AtomicU64::new(0),
                max_buckets: max_buckets.max(1),
                held: AtomicUsize::new(0),
                clock,
                stats: MemoryStoreStats::default(),
                reloads: ArcSwap::from_pointee(Reloads::default()),
                written: (0..shards).map(|_| LatestWrite::default()).collect(),
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

    /// The state held for the raw instance key `key`, if any (a missing bucket is a full one),
    /// as stored: not brought forward, and whether or not it is full by now. For tests and
    /// debugging; [`Store::peek`] reads buckets as decisions see them.
    pub fn peek(&self, key: &str) -> Option<BucketState> {
        let key = self.digest(key);
        let shard = self.shard_of(&key);
        lock(&self.inner.shards[shard]).get(&key).map(|e| e.state)
    }

    /// Drops every bucket that is full by now, and gives back a shard's memory once it holds
    /// far fewer buckets than it has room for. Locks one shard at a time, and holds it for at
    /// most `SWEEP_CHUNK` entries before letting requests in (staying off it for
    /// `SWEEP_PAUSE`, so they can), so a sweep of a million buckets makes no request wait for
    /// the whole of a shard.
    /// Giving memory back moves a shard's remaining buckets (at most a quarter of its room)
    /// under its lock: with the default 64 shards and a million buckets, a few thousand. A
    /// bucket written before the rules were replaced is dropped only if it was full by the
    /// replacement; otherwise it stays until it is decided on again (or evicted), since only
    /// the rules can tell whether it is full under the new ones. Returns how many it dropped.
    pub fn sweep(&self) -> usize {
        let mut dropped = 0;
        for shard in &self.inner.shards {
            // Walks each shard from its end down: `swap_remove_index` moves the last entry,
            // already looked at, into the hole. Between chunks the shard may change; entries
            // added or moved meanwhile wait for the next sweep, which is harmless.
            let mut next = lock(shard).len();
            while next > 0 {
                let mut map = lock(shard);
                let now = self.inner.clock.now_us();
                let reloads = self.inner.reloads.load();
                next = next.min(map.len());
                let stop = next.saturating_sub(SWEEP_CHUNK);
                while next > stop {
                    next -= 1;
                    let e = &map[next];
                    if reloads.forgotten(e.state.updated_us, e.full_at_us, now) {
                        map.swap_remove_index(next);
                        self.inner.held.fetch_sub(1, Ordering::Relaxed);
                        dropped += 1;
                    }
                }
                drop(map);
                if next == 0 {
                    break; // the shard is done; the next chunk locks another shard
                }
                // std's Mutex is not fair: a yield, or nothing, and the sweep takes the lock
                // again before a request woken by the unlock can (a request then waited 100 ms
                // of a 250 ms sweep). Off the CPU for a moment, it cannot; at about 60 µs a
                // chunk, a million buckets' sweep takes a quarter of a second longer, on its
                // own thread. (parking_lot's fair unlock does the same, but its lock cost the
                // decisions 5-32% in `memory_store/*`.)
                std::thread::sleep(SWEEP_PAUSE);
            }
            // Checked for every shard, also one emptied by requests or a reset since the last
            // sweep.
            let mut map = lock(shard);
            if map.capacity() > 4 * map.len().max(SWEEP_CHUNK) {
                // After a burst of keys: give the memory back (IndexMap never shrinks by
                // itself). Moves what is left, a quarter of the capacity at most.
                map.shrink_to_fit();
            }
        }
        dropped
    }

    /// The [`Digest`] of instance key `key`: its 128-bit SipHash-1-3 under the store's key.
    #[inline]
    fn digest(&self, key: &str) -> Digest {
        self.inner.digester.digest(key)
    }

    /// The shard of a key: from the first half of its digest (the map hashes the second).
    #[inline]
    fn shard_of(&self, key: &Digest) -> usize {
        key.shard(self.inner.shards.len())
    }

    /// Decides synchronously; [`Store::apply`] wraps this.
    pub fn apply_now(&self, buckets: &[BucketRef], demands: &[Demand]) -> Applied {
        let mut locked = self.lock_buckets(buckets);
        let now = locked.now;
        let plans: SmallVec<[&crate::core::schedule::Plan; 4]> = buckets.iter().map(|b| &b.plan).collect();
        let states = locked.read(buckets);
        let decision = decide(now, &states, &plans, demands);
        // Room made for one of this request's new buckets never evicts another of its own
        // (written a moment before): that would lose what the request just took from it.
        let own = locked.keys.clone();
        for (i, (b, out)) in buckets.iter().zip(&decision.instances).enumerate() {
            if !out.changed {
                continue;
            }
            let shard = locked.bucket_shards[i];
            let (map, key) = locked.map_of(i);
            // From the state's own time: after a clock step back it is ahead of `now`.
            match b.plan.full_at_us(out.after) {
                Some(at) if at <= out.after.updated_us => {
                    if map.swap_remove(&key).is_some() {
                        self.inner.held.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                full_at => {
                    let full_at_us = full_at.unwrap_or(u64::MAX);
                    let entry = Entry {
                        state: out.after,
                        full_at_us,
                    };
                    if let Some(slot) = map.get_mut(&key) {
                        *slot = entry;
                    } else {
                        self.inner.make_room(map, shard, now, &own);
                        map.insert(key, entry);
                    }
                    let latest = &self.inner.written[locked.bucket_shards[i]].0;
                    if latest.load(Ordering::Relaxed) < out.after.updated_us {
                        latest.store(out.after.updated_us, Ordering::Relaxed);
                    }
                }
            }
        }
        locked.unlock();
        Applied { now_us: now, decision }
    }

    /// Reads synchronously, changing nothing; [`Store::peek`] wraps this. (Not to be confused
    /// with [`MemoryStore::peek`], which looks up one raw instance key.)
    pub fn peek_now(&self, buckets: &[BucketRef]) -> Peeked {
        let locked = self.lock_buckets(buckets);
        let now = locked.now;
        let kept = locked.read(buckets);
        drop(locked);
        Peeked::from_stored(buckets, kept.into_iter().map(Some), now)
    }

    /// Forgets `buckets` synchronously, so each is full again; [`Store::reset`] wraps this.
    pub fn reset_now(&self, buckets: &[BucketRef]) -> Peeked {
        let mut locked = self.lock_buckets(buckets);
        let now = locked.now;
        for i in 0..buckets.len() {
            let (map, key) = locked.map_of(i);
            if map.swap_remove(&key).is_some() {
                self.inner.held.fetch_sub(1, Ordering::Relaxed);
            }
        }
        drop(locked);
        Peeked::all_full(buckets, now)
    }

    /// Locks the shards holding `buckets`, in ascending order so that two requests never wait
    /// on each other in a cycle, then reads the clock and the reloads: everything a decision,
    /// a peek or a reset needs, for as long as it holds the result.
    fn lock_buckets<'s>(&'s self, buckets: &[BucketRef]) -> Locked<'s> {
        let keys: SmallVec<[Digest; 4]> = buckets.iter().map(|b| self.digest(&b.key)).collect();
        let bucket_shards: SmallVec<[usize; 4]> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut shard_ids = bucket_shards.clone();
        shard_ids.sort_unstable();
        shard_ids.dedup();
        let guards: SmallVec<[MutexGuard<'s, Shard>; 4]> =
            shard_ids.iter().map(|&i| lock(&self.inner.shards[i])).collect();
        Locked {
            keys,
            bucket_shards,
            shard_ids,
            guards,
            now: self.inner.clock.now_us(),
            reloads: self.inner.reloads.load(),
        }
    }
}

/// One request's buckets with their shards locked ([`MemoryStore::lock_buckets`]).
struct Locked<'s> {
    // Fields drop in this order, after `unlock` freed the guards: the order the decision path
    // has always freed its allocations in. Freeing them all at the unlock instead cost about
    // 3% more instructions per decision (glibc's allocator then serves `decide`'s zeroed
    // vectors the slow way).
    reloads: arc_swap::Guard<Arc<Reloads>>,
    /// The distinct shards, ascending; `guards` in the same order.
    shard_ids: SmallVec<[usize; 4]>,
    /// Per bucket, its shard.
    bucket_shards: SmallVec<[usize; 4]>,
    /// Per bucket, its key's digest.
    keys: SmallVec<[Digest; 4]>,
    guards: SmallVec<[MutexGuard<'s, Shard>; 4]>,
    /// The store's clock, read once the locks were held.
    now: u64,
}

impl Locked<'_> {
    /// Per bucket (the `buckets` the shards were locked for), the state the store keeps for it
    /// at `now`: the one stored, or, for a bucket absent or full by now under the rules it was
    /// written by ([`Reloads::forgotten`]), full at the capacity in force.
    fn read(&self, buckets: &[BucketRef]) -> SmallVec<[BucketState; 4]> {
        buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                self.guards[self.guard_of(i)]
                    .get(&self.keys[i])
                    // A bucket full by now is the same as none, swept or not.
                    .filter(|e| !self.reloads.forgotten(e.state.updated_us, e.full_at_us, self.now))
                    .map(|e| e.state)
                    .unwrap_or_else(|| BucketState::full(&b.plan.limit_at(self.now), self.now))
            })
            .collect()
    }

    /// Releases the shards' locks (dropping the whole `Locked` does too).
    fn unlock(&mut self) {
        drop(std::mem::take(&mut self.guards));
    }

    /// The shard map holding bucket `i`, and the bucket's key digest.
    fn map_of(&mut self, i: usize) -> (&mut Shard, Digest) {
        let guard = self.guard_of(i);
        (&mut self.guards[guard], self.keys[i])
    }

    /// The index in `guards` of bucket `i`'s shard.
    fn guard_of(&self, i: usize) -> usize {
        self.shard_ids
            .binary_search(&self.bucket_shards[i])
            .expect("shard was locked")
    }
}

/// How many entries [`MemoryStore::sweep`] looks at per hold of a shard's lock.
const SWEEP_CHUNK: usize = 256;

/// How long the sweep stays off a shard between two chunks, so that requests woken by its unlock
/// get the lock (the kernel's timer slack makes it about 60 µs).
const SWEEP_PAUSE: Duration = Duration::from_micros(10);

/// How many entries [`Inner::make_room`] looks at to choose a victim.
const EVICTION_SAMPLE: usize = 16;

impl Inner {
    /// Keeps the store within `max_buckets` before an insert into `map` (shard `shard`, locked
    /// by the caller): counts the insert, and when that reaches past the cap evicts one bucket,
    /// from `map` when it holds any (hashing spreads buckets evenly over the shards, so a
    /// random shard's sample is a random sample of the store), else from the first other shard
    /// not locked at the moment (`try_lock`: waiting for a shard while holding one could
    /// deadlock), starting at a random one.
    /// An insert that finds the store already past the cap (concurrent inserts that found
    /// nothing to evict) evicts until it is back within it.
    /// The keys of `own` (the deciding request's) are never chosen.
    fn make_room(&self, map: &mut Shard, shard: usize, now: u64, own: &[Digest]) {
        self.held.fetch_add(1, Ordering::Relaxed);
        while self.held.load(Ordering::Relaxed) > self.max_buckets {
            if !self.evict_anywhere(map, shard, now, own) {
                return;
            }
        }
    }

    /// Evicts one bucket, from `map` (shard `shard`) or another shard: see [`Inner::make_room`].
    fn evict_anywhere(&self, map: &mut Shard, shard: usize, now: u64, own: &[Digest]) -> bool {
        if self.evict_one(map, now, own) {
            return true;
        }
        let n = self.shards.len();
        let start = self.rng().below(n);
        for k in 0..n {
            let other = (start + k) % n;
            if other == shard {
                continue;
            }
            let mut guard = match self.shards[other].try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            if self.evict_one(&mut guard, now, own) {
                return true;
            }
        }
        false
    }

    /// Evicts the bucket closest to full (the least possible over-admission) among
    /// [`EVICTION_SAMPLE`] entries drawn at random from the whole of `map` (all of them in a
    /// shard this small), so the cost stays constant however large the shard (a flood of new
    /// keys must not make every request scan it) and no part of it is favoured. Evicting a
    /// bucket that is not yet full is counted. Returns whether `map` had one to evict.
    fn evict_one(&self, map: &mut Shard, now: u64, own: &[Digest]) -> bool {
        let len = map.len();
        let candidate = |i: &usize| map.get_index(*i).is_some_and(|(k, _)| !own.contains(k));
        let full_at = |i: usize| map.get_index(i).map_or(u64::MAX, |(_, e)| e.full_at_us);
        let victim = if len <= EVICTION_SAMPLE {
            (0..len).filter(candidate).min_by_key(|&i| full_at(i))
        } else {
            let mut rng = self.rng();
            (0..EVICTION_SAMPLE)
                .map(|_| rng.below(len))
                .filter(candidate)
                .min_by_key(|&i| full_at(i))
        };
        let Some((_, evicted)) = victim.and_then(|i| map.swap_remove_index(i)) else {
            return false;
        };
        self.held.fetch_sub(1, Ordering::Relaxed);
        if evicted.full_at_us > now {
            self.stats.evicted_not_full.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// A fresh generator for an eviction sample.
    fn rng(&self) -> SplitMix64 {
        SplitMix64(self.hasher.hash_one(self.samples.fetch_add(1, Ordering::Relaxed)))
    }
}

/// A small, fast generator for the eviction sample (SplitMix64), seeded by a keyed hash: the
/// positions it gives are not predictable from outside and cover the shard uniformly.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A position below `n`, uniform but for a bias below `n / 2^64`.
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
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

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        Ok(self.peek_now(buckets))
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        Ok(self.reset_now(buckets))
    }

    fn on_rules_retired(&self) -> Option<super::RetireHook> {
        let store = MemoryStore {
            inner: self.inner.clone(),
        };
        Some(Arc::new(move || store.rules_changed()))
    }

    fn clock_estimate_us(&self) -> u64 {
        self.inner.clock.now_us()
    }

    fn rules_changed(&self) {
        // After every write so far, by their times too: a write stamped later than the clock
        // reads now (it stepped back) was still made under the old rules.
        let written = self.inner.written.iter().map(|w| w.0.load(Ordering::Relaxed)).max();
        let now = self.inner.clock.now_us().max(written.unwrap_or(0));
        self.inner.reloads.rcu(|old| {
            let mut at_us = old.at_us.clone();
            // In order of the instants, not of the calls: a reload read off a clock that
            // stepped back lies before an earlier one, and a bucket not full by then is not
            // full by the rules that replaced it then.
            at_us.insert(at_us.partition_point(|r| *r <= now), now);
            let mut forgotten_until_us = old.forgotten_until_us;
            if at_us.len() > MAX_RELOADS_KEPT {
                forgotten_until_us = forgotten_until_us.max(at_us.remove(0));
            }
            Reloads {
                at_us,
                forgotten_until_us,
            }
        });
    }
}

#[cfg(test)]
mod tests;
