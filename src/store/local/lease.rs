//! Token leases: a replica reserves a slice of a hot bucket's tokens from the shared store in
//! one call (an ordinary consuming decision of `lease` tokens, so the store has debited them
//! before any is spent) and admits requests on them locally, with no store call.
//!
//! **Bounds.** A lease is taken only when the store's last answer showed the bucket holding at
//! least `lease` tokens after the request it decided, and topped up to `lease` (never beyond:
//! the tokens reserved by requests still being decided count as held, since a denial gives
//! them back) when half of it is spent, so a replica never holds more than `lease` unspent
//! tokens of a bucket. Admissions never exceed what the store debited: no over-admission, ever. What the
//! leases cost is under-admission: tokens held unspent by one replica cannot serve another, at
//! most `lease` x (replicas holding one) at any moment; over any window (an admission counted
//! when its tokens are taken), a bucket admits at most its capacity plus its refill over the
//! window plus the refunds given in it plus the tokens leased and unspent at the window's
//! start (grants and returns on their way included). Unspent tokens go back to the store (a refund, capped at the capacity)
//! when the lease's hold ends (`lease_hold_ms` after it was taken), at a reload and at
//! shutdown; a reset of the bucket drops them.
//!
//! **Eras.** A reload or shutdown ends a lease, a reset wipes it: each starts a new era of
//! the lease (an id). A grant or a reserved token from an earlier era never joins the new one
//! (the new rules may size the lease smaller): after a reload it goes back to the store; after
//! a reset it is dropped, since the reset wiped the debit it came from and giving it back could
//! add tokens the reset bucket never lost. (A grant the store decided just after the reset is
//! then lost until refill: an under-admission of at most one lease.)
//!
//! **The accounting, for other holders.** A lease is a share of a bucket held outside the store:
//! taken by an ordinary all-or-nothing consuming decision (so whatever holds it, the store has
//! debited it first), spent without the store, given back by an ordinary refund. Nothing here
//! depends on the holder being this replica: a server handing token shares to remote
//! data-plane clients (a quota assignment per client) can take and return them the same way,
//! with the same bound (the sum of shares outstanding).
//!
//! Only plain consuming demands of enforced rules are served from a lease; a check
//! (`hits_addend: 0`), a refund, a shadow-mode demand or a demand larger than what the lease
//! holds goes to the store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::super::digest::{Digest, DigestHash};
use super::super::BucketRef;
use super::overlimit::Ticket;
use crate::core::bucket::{BucketState, Refilling};

/// Shards of the lease table.
const SHARDS: usize = 16;

/// One bucket's lease on this replica.
#[derive(Debug)]
struct Lease {
    /// The bucket, for the return.
    bucket: BucketRef,
    /// Leased tokens not spent nor reserved, in micro-tokens.
    tokens_ut: u64,
    /// Tokens reserved by requests whose other buckets are still being decided.
    reserved_ut: u64,
    /// The bucket's state in the store right after the latest grant: with `tokens_ut`, what
    /// this replica reports as the bucket's remaining tokens.
    granted: BucketState,
    /// When the leased tokens go back (store clock, microseconds).
    expires_us: u64,
    /// A grant is on its way.
    acquiring: bool,
    /// The lease's era: orders and reservations carry the era they were made in.
    era: u64,
    /// The era the latest reset started: anything from before it is dropped, not given back.
    reset_era: u64,
}

impl Lease {
    /// Orders what brings the lease back to `lease` tokens: what it holds counts the tokens
    /// reserved by requests still being decided, which come back to it if they are denied (a
    /// top-up that left them out held up to twice the lease once they did).
    fn top_up(&mut self, lease_ut: u64, bucket: BucketRef, key: Digest, orders: &mut Vec<LeaseOrder>) {
        let missing = lease_ut.saturating_sub(self.tokens_ut.saturating_add(self.reserved_ut));
        if missing == 0 {
            return;
        }
        self.acquiring = true;
        orders.push(LeaseOrder {
            bucket,
            tokens_ut: missing,
            key,
            era: self.era,
            ticket: Ticket::default(),
        });
    }
}

type Map = HashMap<Digest, Lease, DigestHash>;

/// A lease the store must be asked for: consume `tokens_ut` from `bucket` (all or nothing).
#[derive(Clone, Debug)]
pub struct LeaseOrder {
    /// The bucket.
    pub bucket: BucketRef,
    /// Micro-tokens to take.
    pub tokens_ut: u64,
    pub(crate) key: Digest,
    pub(crate) era: u64,
    /// The over-limit cache's epochs when the order left (set by the layer).
    pub(crate) ticket: Ticket,
}

/// Unspent leased tokens to give back to the store: a refund of `tokens_ut` on `bucket`.
#[derive(Clone, Debug)]
pub struct LeaseReturn {
    /// The bucket.
    pub bucket: BucketRef,
    /// Micro-tokens to give back.
    pub tokens_ut: u64,
    pub(crate) key: Digest,
}

/// What a request reserved from a lease: `taken_ut` micro-tokens, and the bucket as this
/// replica sees it before the request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reserved {
    pub(crate) taken_ut: u64,
    pub(crate) view: BucketState,
    pub(crate) era: u64,
}

/// Every lease of a replica.
pub(crate) struct Leases {
    shards: Box<[Mutex<Map>]>,
    hold_us: u64,
    /// Unspent tokens held, all leases together (micro-tokens), for the gauge.
    held_ut: AtomicU64,
    held_gauge: metrics::Gauge,
    /// The next era (unique across leases, so a lease made anew never matches an old one).
    next_era: AtomicU64,
    /// Reserved tokens of an ended era, released by their requests: to go back with the next
    /// returns.
    orphans: Mutex<Vec<LeaseReturn>>,
}

fn lock(shard: &Mutex<Map>) -> MutexGuard<'_, Map> {
    shard.lock().unwrap_or_else(|p| p.into_inner())
}

fn lock_orphans(orphans: &Mutex<Vec<LeaseReturn>>) -> MutexGuard<'_, Vec<LeaseReturn>> {
    orphans.lock().unwrap_or_else(|p| p.into_inner())
}

impl Leases {
    /// Leases held `hold_us` microseconds each before their unspent tokens go back.
    pub(crate) fn new(hold_us: u64) -> Leases {
        let held_gauge = metrics::gauge!(crate::telemetry::LEASE_TOKENS);
        held_gauge.set(0.0);
        Leases {
            shards: (0..SHARDS).map(|_| Mutex::new(Map::with_hasher(DigestHash))).collect(),
            hold_us: hold_us.max(1),
            held_ut: AtomicU64::new(0),
            held_gauge,
            next_era: AtomicU64::new(1),
            orphans: Mutex::new(Vec::new()),
        }
    }

    fn era(&self) -> u64 {
        self.next_era.fetch_add(1, Ordering::Relaxed)
    }

    fn shard(&self, key: &Digest) -> MutexGuard<'_, Map> {
        lock(&self.shards[key.shard(SHARDS)])
    }

    fn held(&self, add: u64, sub: u64) {
        if add > sub {
            self.held_ut.fetch_add(add - sub, Ordering::Relaxed);
        } else if sub > add {
            self.held_ut.fetch_sub(sub - add, Ordering::Relaxed);
        }
        self.held_gauge
            .set(self.held_ut.load(Ordering::Relaxed) as f64 / crate::core::bucket::MICRO as f64);
    }

    /// Unspent leased tokens held now, all buckets together, in micro-tokens.
    pub(crate) fn held_ut(&self) -> u64 {
        self.held_ut.load(Ordering::Relaxed)
    }

    /// Reserves `need_ut` micro-tokens of `bucket` (digest `key`) from its lease at `now_us`,
    /// if the lease holds them and its hold has not ended. Orders a top-up into `orders` when
    /// the lease falls to half or less.
    pub(crate) fn reserve(
        &self,
        bucket: &BucketRef,
        key: Digest,
        need_ut: u64,
        now_us: u64,
        orders: &mut Vec<LeaseOrder>,
    ) -> Option<Reserved> {
        let mut shard = self.shard(&key);
        let lease = shard.get_mut(&key)?;
        if lease.expires_us <= now_us || lease.tokens_ut < need_ut {
            return None;
        }
        let capacity = bucket.plan.capacity_ut_at(now_us);
        let view_tokens = bucket
            .plan
            .refill_to(lease.granted, now_us)
            .tokens_ut
            .saturating_add(lease.tokens_ut)
            .min(capacity);
        lease.tokens_ut -= need_ut;
        lease.reserved_ut += need_ut;
        if lease.tokens_ut <= bucket.lease_ut / 2 && !lease.acquiring {
            let order_bucket = lease.bucket.clone();
            lease.top_up(bucket.lease_ut, order_bucket, key, orders);
        }
        Some(Reserved {
            taken_ut: need_ut,
            view: BucketState {
                tokens_ut: view_tokens.max(need_ut),
                updated_us: now_us,
            },
            era: lease.era,
        })
    }

    /// The request that made `r` on `key` was admitted: the tokens are spent.
    pub(crate) fn commit(&self, key: &Digest, r: &Reserved) {
        if let Some(lease) = self.shard(key).get_mut(key) {
            lease.reserved_ut = lease.reserved_ut.saturating_sub(r.taken_ut);
        }
        self.held(0, r.taken_ut);
    }

    /// The request that made `r` on `key` was denied (or failed): the tokens are the lease's
    /// again, if its era has not ended meanwhile (see the module's docs).
    pub(crate) fn release(&self, key: &Digest, r: &Reserved) {
        let mut shard = self.shard(key);
        let back = match shard.get_mut(key) {
            Some(lease) => {
                lease.reserved_ut = lease.reserved_ut.saturating_sub(r.taken_ut);
                if lease.era == r.era {
                    lease.tokens_ut = lease.tokens_ut.saturating_add(r.taken_ut);
                    return;
                }
                (r.era >= lease.reset_era).then(|| LeaseReturn {
                    bucket: lease.bucket.clone(),
                    tokens_ut: r.taken_ut,
                    key: *key,
                })
            }
            // The lease is gone with whatever happened to it: dropped (the safe side).
            None => None,
        };
        drop(shard);
        match back {
            Some(ret) => lock_orphans(&self.orphans).push(ret),
            None => self.held(0, r.taken_ut),
        }
    }

    /// After the store admitted a request on `bucket` (digest `key`), leaving it at `after`:
    /// orders a lease when none is held or on its way and the store had `lease` tokens to
    /// spare.
    pub(crate) fn consider(&self, bucket: &BucketRef, key: Digest, after: BucketState, orders: &mut Vec<LeaseOrder>) {
        if after.tokens_ut < bucket.lease_ut {
            return;
        }
        let mut shard = self.shard(&key);
        let lease = shard.entry(key).or_insert_with(|| Lease {
            bucket: bucket.clone(),
            tokens_ut: 0,
            reserved_ut: 0,
            granted: after,
            expires_us: 0,
            acquiring: false,
            era: 0,
            reset_era: 0,
        });
        if lease.era == 0 {
            lease.era = self.era();
            lease.reset_era = lease.era;
        }
        if lease.acquiring || lease.tokens_ut > bucket.lease_ut / 2 {
            return;
        }
        lease.top_up(bucket.lease_ut, bucket.clone(), key, orders);
    }

    /// The store's answer to `order`: `Some(state)` when it granted the tokens, leaving the
    /// bucket at `state` at `now_us`; `None` when it denied or failed. Returns the tokens to
    /// give back at once, if the lease's era ended while the order was on its way (a reload);
    /// after a reset they are dropped (see the module's docs).
    pub(crate) fn granted(&self, order: &LeaseOrder, state: Option<BucketState>, now_us: u64) -> Option<LeaseReturn> {
        let mut shard = self.shard(&order.key);
        // Never removed while acquiring: a missing lease is a bug's aftermath, and dropping
        // the grant is the safe side.
        let lease = shard.get_mut(&order.key)?;
        lease.acquiring = false;
        let state = state?;
        if lease.era != order.era {
            return (order.era >= lease.reset_era).then(|| LeaseReturn {
                bucket: order.bucket.clone(),
                tokens_ut: order.tokens_ut,
                key: order.key,
            });
        }
        if lease.expires_us <= now_us {
            // A fresh lease (or one whose hold ended: what it held went back already).
            lease.expires_us = now_us.saturating_add(self.hold_us);
        }
        lease.tokens_ut = lease.tokens_ut.saturating_add(order.tokens_ut);
        lease.granted = state;
        lease.bucket = order.bucket.clone();
        drop(shard);
        self.held(order.tokens_ut, 0);
        None
    }

    /// The unspent tokens of leases whose hold ended by `now_us`, taken out to go back; leases
    /// left with nothing are dropped.
    pub(crate) fn due(&self, now_us: u64) -> Vec<LeaseReturn> {
        self.take(|lease| lease.expires_us <= now_us)
    }

    /// Every lease's unspent tokens, taken out to go back, and every lease ended (a reload, a
    /// shutdown): a new era for each.
    pub(crate) fn take_all(&self) -> Vec<LeaseReturn> {
        self.take(|lease| {
            lease.expires_us = 0;
            lease.era = self.era();
            true
        })
    }

    fn take(&self, mut ends: impl FnMut(&mut Lease) -> bool) -> Vec<LeaseReturn> {
        let mut out = std::mem::take(&mut *lock_orphans(&self.orphans));
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            shard.retain(|key, lease| {
                if !ends(lease) {
                    return true;
                }
                if lease.tokens_ut > 0 {
                    out.push(LeaseReturn {
                        bucket: lease.bucket.clone(),
                        tokens_ut: lease.tokens_ut,
                        key: *key,
                    });
                    lease.tokens_ut = 0;
                }
                lease.reserved_ut > 0 || lease.acquiring
            });
        }
        let returned: u64 = out.iter().map(|r| r.tokens_ut).sum();
        self.held(0, returned);
        out
    }

    /// Drops the lease of `key` without giving its tokens back (the bucket was reset: it is
    /// full, and a refund would be capped away).
    pub(crate) fn drop_lease(&self, key: &Digest) {
        let mut shard = self.shard(key);
        if let Some(lease) = shard.get_mut(key) {
            let dropped = lease.tokens_ut;
            lease.tokens_ut = 0;
            lease.expires_us = 0;
            lease.era = self.era();
            lease.reset_era = lease.era;
            if lease.reserved_ut == 0 && !lease.acquiring {
                shard.remove(key);
            }
            drop(shard);
            self.held(0, dropped);
        }
    }
}
