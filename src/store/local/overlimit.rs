//! The exact over-limit cache: bucket states the shared store answered with, kept so that a
//! request they are sure to deny is denied here, without a store call.
//!
//! **Why it is exact.** A state the store answered for a bucket is an upper bound of what the
//! bucket holds later, brought forward by its plan: from then on, other requests (here or on
//! other replicas) only take tokens; only a refund, a reset or a lost store can add any. So
//! when [`bucket::decide`](crate::core::bucket::decide) over the kept states denies a request,
//! the store would deny it too, with the same statuses, headers and `Retry-After` (they are
//! computed from the same kept states). The cache never admits: a request it cannot deny goes
//! to the store.
//!
//! **How long an entry is trusted.** Until the instant the store said the bucket would hold
//! what the denied request needed (its reopen time), and never beyond `max_hold_us`, the next
//! change of the bucket's limit by the clock (a schedule window, a quota reset), or the time it
//! would be full. So a refund or reset made on another replica, which this replica cannot see,
//! is honoured at the latest at that instant; a local refund, reset or reload forgets the
//! entries at once.
//!
//! **Time.** Entries are read at the store's clock as tollgate estimates it
//! ([`crate::store::Store::clock_estimate_us`]). Within [`CLOCK_MARGIN_US`] of a bucket's
//! reopen time the estimate is not trusted alone: one request (a probe) asks the store, and the
//! others of that bucket are denied here only while its answer is awaited. So a flood costs
//! about one store call per reopen, and an estimate behind the store's clock by less than the
//! margin denies at most for one round trip what the store would admit.
//!
//! **Races.** A store answer is learnt only if no refund, reset or reload touched its buckets'
//! shards since the call left (an epoch per shard): an answer read before a refund must not
//! bring back the state the refund raised. A refund (or lease return) through this replica
//! moves the epoch again when its answer is back: a request sent after it may have reached the
//! store before it. Tokens another request gives back as it rolls back (a request over
//! several Cluster slots takes from one, then refunds it when another denies) are not seen
//! here: a bucket's state read meanwhile may be low by them. So only a bucket the store itself
//! denied can deny here (a bucket that merely passed in a denied request is kept to complete
//! the answer), and such a rollback is honoured, as a refund on another replica is, by the
//! reopen time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use smallvec::SmallVec;

use super::super::digest::{Digest, DigestHash};
use super::super::{Applied, BucketRef};
use crate::core::bucket::{decide, BucketState, Decision, Demand, DemandKind, MICRO};
use crate::core::schedule::Plan;

/// How far ahead of the store's estimated clock a local denial must still hold, in
/// microseconds: the error of that estimate the cache tolerates without denying what the
/// store would admit (docs/backends.md).
pub const CLOCK_MARGIN_US: u64 = 1_000;

/// How long a probe (the one request let through to the store while a bucket is within
/// [`CLOCK_MARGIN_US`] of its reopen time) keeps the others of that bucket denied here, at
/// most, in microseconds: its answer ends it sooner.
pub const PROBE_US: u64 = 50_000;

/// Shards of the cache (a power of two), each with its own lock and epoch.
const SHARDS: usize = 64;

/// How many entries an insertion at the cap looks at to pick the one to evict.
const EVICTION_SAMPLE: usize = 8;

/// One bucket's last known state.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The state as the store keeps it (what waits are measured from).
    state: BucketState,
    /// The store's clock when it answered, in microseconds: an older answer never replaces a
    /// newer one.
    at_us: u64,
    /// The entry is not used from this instant on (store clock, microseconds).
    until_us: u64,
    /// Until when a request let through to the store near the reopen time (a probe) is
    /// awaited: meanwhile the others are denied here if they would be at the estimated now.
    probe_until_us: u64,
    /// The store denied a request on this bucket. Only such an entry can deny here; the others
    /// (the buckets that passed in a denied request) only complete its answer, since their
    /// state may have been read while another request's all-or-nothing rollback was giving
    /// them tokens back (a request over several Cluster slots takes from one slot, then
    /// refunds it when another denies).
    denies: bool,
}

type Map = HashMap<Digest, Entry, DigestHash>;

/// See the module docs. Shared by every request of a replica.
pub struct OverLimitCache {
    shards: Box<[Mutex<Map>]>,
    /// Per shard, bumped by every refund, reset or reload that touches it.
    epochs: Box<[AtomicU64]>,
    len: AtomicUsize,
    max_entries: usize,
    max_hold_us: u64,
    evictions: AtomicU64,
    metrics: CacheMetrics,
}

/// The cache's metric handles (no-ops without a recorder).
struct CacheMetrics {
    entries: metrics::Gauge,
    evictions: metrics::Counter,
}

/// The shard epochs of a request's buckets when its store call left: what
/// [`OverLimitCache::learn`] checks that nothing was forgotten since.
#[derive(Clone, Debug, Default)]
pub(crate) struct Ticket(SmallVec<[u64; 4]>);

fn lock(shard: &Mutex<Map>) -> MutexGuard<'_, Map> {
    // Entries are replaced whole: a panic elsewhere cannot leave one half-written.
    shard.lock().unwrap_or_else(|p| p.into_inner())
}

impl OverLimitCache {
    /// A cache of at most `max_entries` buckets, each trusted for at most `max_hold_us`
    /// microseconds after the answer that put it there.
    pub fn new(max_entries: usize, max_hold_us: u64) -> OverLimitCache {
        let m = CacheMetrics {
            entries: metrics::gauge!(crate::telemetry::LOCAL_CACHE_ENTRIES),
            evictions: metrics::counter!(crate::telemetry::LOCAL_CACHE_EVICTIONS),
        };
        m.entries.set(0.0);
        m.evictions.increment(0);
        OverLimitCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Map::with_hasher(DigestHash))).collect(),
            epochs: (0..SHARDS).map(|_| AtomicU64::new(0)).collect(),
            len: AtomicUsize::new(0),
            max_entries: max_entries.max(1),
            max_hold_us,
            evictions: AtomicU64::new(0),
            metrics: m,
        }
    }

    /// Buckets held.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries evicted at the cap so far.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &Digest) -> usize {
        key.shard(SHARDS)
    }

    /// The epochs of `keys`' shards now, for [`OverLimitCache::learn`].
    pub(crate) fn ticket(&self, keys: &[Digest]) -> Ticket {
        Ticket(
            keys.iter()
                .map(|k| self.epochs[self.shard(k)].load(Ordering::Acquire))
                .collect(),
        )
    }

    /// The decision the store would take on `buckets` (whose digests are `keys`) with
    /// `demands` at `now_us` (its clock, estimated), if it is a denial this cache is sure of;
    /// `None` when the store must be asked: a bucket not held (or no longer trusted), a demand
    /// that must reach the store (a refund, a usage report), or a request that could pass.
    pub(crate) fn deny(
        &self,
        buckets: &[BucketRef],
        keys: &[Digest],
        demands: &[Demand],
        now_us: u64,
    ) -> Option<Decision> {
        if self.is_empty() || !demands.iter().any(|d| d.enforced) {
            return None;
        }
        if demands
            .iter()
            .any(|d| !matches!(d.kind, DemandKind::Consume(_) | DemandKind::Check))
        {
            return None;
        }
        let mut states: SmallVec<[BucketState; 4]> = SmallVec::with_capacity(keys.len());
        let mut denies: SmallVec<[bool; 4]> = SmallVec::with_capacity(keys.len());
        let mut probing = true;
        for key in keys {
            let entry = *lock(&self.shards[self.shard(key)]).get(key)?;
            if entry.until_us <= now_us {
                // No longer trusted: the store decides, and its answer renews the entry (the
                // sweep drops entries nobody renews).
                return None;
            }
            probing &= entry.probe_until_us > now_us;
            states.push(entry.state);
            denies.push(entry.denies);
        }
        let plans: SmallVec<[&Plan; 4]> = buckets.iter().map(|b| &b.plan).collect();
        let decision = decide(now_us, &states, &plans, demands);
        let by_a_denier = demands
            .iter()
            .zip(&decision.passed)
            .any(|(d, ok)| d.enforced && !ok && denies[d.instance]);
        if !decision.denied || !by_a_denier {
            return None;
        }
        if decide(now_us.saturating_add(CLOCK_MARGIN_US), &states, &plans, demands).denied || probing {
            return Some(decision);
        }
        // Within the margin of the reopen time: this request asks the store (a probe), and the
        // others wait for its answer here rather than all asking at once.
        for key in keys {
            if let Some(entry) = lock(&self.shards[self.shard(key)]).get_mut(key) {
                entry.probe_until_us = now_us.saturating_add(PROBE_US);
            }
        }
        None
    }

    /// Learns from the store's answer `applied` to `buckets` (digests `keys`) with `demands`,
    /// sent with `ticket`: a denial puts every bucket of the request in the cache (the ones
    /// that denied until they could serve the demand that failed, the others so that the same
    /// request can be answered whole); an admission updates the buckets already held. Buckets
    /// whose shard saw a refund, reset or reload since the ticket are left alone.
    pub(crate) fn learn(
        &self,
        ticket: &Ticket,
        buckets: &[BucketRef],
        keys: &[Digest],
        demands: &[Demand],
        applied: &Applied,
    ) {
        let now = applied.now_us;
        let decision = &applied.decision;
        if !decision.denied && self.is_empty() {
            return;
        }
        for (i, ((bucket, key), outcome)) in buckets.iter().zip(keys).zip(&decision.instances).enumerate() {
            let shard_ix = self.shard(key);
            let kept = outcome.kept();
            // What the bucket must hold for a request like this one to pass again: the largest
            // need among its demands that failed (a denial), or what this request took (an
            // admission: the same request next time).
            let failed = demands
                .iter()
                .zip(&decision.passed)
                .filter(|(d, ok)| d.instance == i && d.enforced && !**ok)
                .filter_map(|(d, _)| d.kind.need_ut(outcome.consumed_ut))
                .max();
            let need = match failed {
                Some(need) => Some(need),
                None if !decision.denied => Some(outcome.consumed_ut.max(MICRO)),
                None => None,
            };
            let until = self.trusted_until(&bucket.plan, kept, need, now);
            let mut shard = lock(&self.shards[shard_ix]);
            // The epoch under the lock that a forget takes too: an answer that left before a
            // refund, reset or reload of this shard is not learnt, and what the cache held of
            // its buckets goes (it may be older still).
            let fresh = ticket.0.get(i) == Some(&self.epochs[shard_ix].load(Ordering::Acquire));
            let removed = match shard.get_mut(key) {
                Some(held) if !fresh => {
                    let _ = held;
                    shard.remove(key).is_some()
                }
                // A newer answer is held already.
                Some(held) if held.at_us > now => false,
                Some(held) => {
                    // A state the same request would pass on (it was just admitted) is still an
                    // upper bound for larger ones, within what the cache had promised.
                    let until = if until > now { until } else { held.until_us };
                    if until > now {
                        // A denial keeps an awaited probe's window: the store is asked once
                        // per reopen time, not once per round trip while the estimate is ahead.
                        let probe_until_us = if decision.denied { held.probe_until_us } else { 0 };
                        *held = Entry {
                            state: kept,
                            at_us: now,
                            until_us: until,
                            probe_until_us,
                            denies: held.denies || failed.is_some(),
                        };
                        false
                    } else {
                        shard.remove(key).is_some()
                    }
                }
                None if fresh && decision.denied && until > now => {
                    let entry = Entry {
                        state: kept,
                        at_us: now,
                        until_us: until,
                        probe_until_us: 0,
                        denies: failed.is_some(),
                    };
                    self.insert(&mut shard, *key, entry, now);
                    false
                }
                None => false,
            };
            drop(shard);
            if removed {
                self.removed(1);
            }
        }
    }

    /// Until when a state `kept` (answered at `now_us`) is trusted: until the bucket holds
    /// `need_ut` again (or is full, when `None`), within the hold, the next change of limit and
    /// the time it is full.
    fn trusted_until(&self, plan: &Plan, kept: BucketState, need_ut: Option<u64>, now_us: u64) -> u64 {
        let mut until = now_us.saturating_add(self.max_hold_us);
        let reopen = match need_ut {
            Some(need) => plan.wait_us(kept, need, now_us).map(|w| now_us.saturating_add(w)),
            None => plan.full_at_us(kept),
        };
        for bound in [
            reopen,
            plan.full_at_us(kept),
            plan.next_change_us(now_us, self.max_hold_us),
        ]
        .into_iter()
        .flatten()
        {
            until = until.min(bound);
        }
        until
    }

    /// Inserts into `shard` (locked), evicting first at the cap: the sampled entry of the shard
    /// trusted for the shortest time (an expired one first; it would have asked the store
    /// soonest anyway); a shard with nothing to give keeps the new entry out instead (the cap
    /// counts every shard, and locking another under this one could deadlock). Either way a
    /// bucket the cache could not keep is counted as an eviction.
    fn insert(&self, shard: &mut Map, key: Digest, entry: Entry, now_us: u64) {
        if self.len.load(Ordering::Relaxed) >= self.max_entries {
            self.evictions.fetch_add(1, Ordering::Relaxed);
            self.metrics.evictions.increment(1);
            let victim = shard
                .iter()
                .take(EVICTION_SAMPLE)
                .min_by_key(|(_, e)| if e.until_us <= now_us { 0 } else { e.until_us })
                .map(|(k, _)| *k);
            let Some(victim) = victim else {
                return;
            };
            shard.remove(&victim);
            self.removed(1);
        }
        shard.insert(key, entry);
        self.len.fetch_add(1, Ordering::Relaxed);
        self.metrics.entries.increment(1.0);
    }

    fn removed(&self, n: usize) {
        if n > 0 {
            self.len.fetch_sub(n, Ordering::Relaxed);
            self.metrics.entries.decrement(n as f64);
        }
    }

    /// Forgets `key` (a refund, a reset, a returned lease): its shard's epoch moves on, so an
    /// answer already on its way is not learnt either.
    pub(crate) fn forget(&self, key: &Digest) {
        let ix = self.shard(key);
        let mut shard = lock(&self.shards[ix]);
        self.epochs[ix].fetch_add(1, Ordering::AcqRel);
        if shard.remove(key).is_some() {
            drop(shard);
            self.removed(1);
        }
    }

    /// Forgets everything (a reload).
    pub(crate) fn clear(&self) {
        for (shard, epoch) in self.shards.iter().zip(self.epochs.iter()) {
            let mut shard = lock(shard);
            epoch.fetch_add(1, Ordering::AcqRel);
            let n = shard.len();
            shard.clear();
            drop(shard);
            self.removed(n);
        }
    }

    /// Drops entries no longer trusted at `now_us` (store clock): memory goes back without
    /// waiting for a request on each. Holds each shard for one pass over it.
    pub(crate) fn sweep(&self, now_us: u64) -> usize {
        let mut dropped = 0;
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let before = shard.len();
            shard.retain(|_, e| e.until_us > now_us);
            let n = before - shard.len();
            drop(shard);
            self.removed(n);
            dropped += n;
        }
        dropped
    }
}
