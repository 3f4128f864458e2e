//! The local layer's decisions, without I/O: which part of a request this replica answers
//! itself (a denial the over-limit cache is sure of, tokens from a lease) and which part the
//! store must decide, and what is learnt from the store's answer. [`super::Local`] runs it
//! against a real store; the simulation in the test suite runs it against a simulated one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use smallvec::SmallVec;

use super::super::digest::{Digest, Digester};
use super::super::{Applied, BucketRef, StoreError};
use super::lease::{LeaseOrder, LeaseReturn, Leases, Reserved};
use super::overlimit::{OverLimitCache, Ticket};
use super::LocalSettings;
use crate::core::bucket::{BucketState, Decision, Demand, DemandKind, InstanceOutcome};

/// What to do with one request.
pub enum Route {
    /// Decided here, with no store call: a denial the over-limit cache is sure of, or an
    /// admission wholly on leased tokens.
    Local(Applied),
    /// The store must decide [`Ask::request`]; hand its answer to [`LocalLayer::finish`].
    /// (Boxed: it lives across the store call, in a future moved at every request.)
    Store(Box<Ask>),
}

/// A store call the local layer asked for, and what it needs to finish the request.
pub struct Ask {
    keys: SmallVec<[Digest; 4]>,
    /// Set when leases served part of the request: the store decides the rest.
    split: Option<Box<Split>>,
    ticket: Ticket,
}

/// A request whose leased buckets were served here: the rest, as sent to the store.
struct Split {
    /// Per instance of the request, its reservation when a lease served it.
    reserved: SmallVec<[Option<Reserved>; 4]>,
    /// The store's part: instance indices of the request, in order.
    instances: SmallVec<[usize; 4]>,
    /// The demands of the request on the store's part, by index, in order.
    demand_ix: SmallVec<[usize; 4]>,
    buckets: Vec<BucketRef>,
    demands: Vec<Demand>,
}

impl Ask {
    /// What to send to the store: the request itself, or the part leases did not serve.
    pub fn request<'a>(&'a self, buckets: &'a [BucketRef], demands: &'a [Demand]) -> (&'a [BucketRef], &'a [Demand]) {
        match &self.split {
            Some(s) => (&s.buckets, &s.demands),
            None => (buckets, demands),
        }
    }
}

/// A replica's over-limit cache and leases (docs/backends.md). Shared by every request.
pub struct LocalLayer {
    digester: Digester,
    cache: Option<OverLimitCache>,
    leases: Leases,
    orders: Mutex<Vec<LeaseOrder>>,
    has_orders: AtomicBool,
    counters: Counters,
}

struct Counters {
    denials: metrics::Counter,
    lease_admissions: metrics::Counter,
}

impl LocalLayer {
    /// A layer with `settings`.
    pub fn new(settings: &LocalSettings) -> LocalLayer {
        let counters = Counters {
            denials: metrics::counter!(crate::telemetry::LOCAL_DENIALS),
            lease_admissions: metrics::counter!(crate::telemetry::LEASE_ADMISSIONS),
        };
        counters.denials.increment(0);
        counters.lease_admissions.increment(0);
        LocalLayer {
            digester: Digester::random(),
            cache: settings.over_limit_cache.then(|| {
                OverLimitCache::new(
                    settings.over_limit_cache_entries,
                    settings.over_limit_hold_ms.0.saturating_mul(1_000),
                )
            }),
            leases: Leases::new(settings.lease_hold_ms.0.saturating_mul(1_000)),
            orders: Mutex::new(Vec::new()),
            has_orders: AtomicBool::new(false),
            counters,
        }
    }

    /// The over-limit cache, when on.
    pub fn cache(&self) -> Option<&OverLimitCache> {
        self.cache.as_ref()
    }

    /// Unspent leased tokens this replica holds, all buckets together, in micro-tokens.
    pub fn leased_ut(&self) -> u64 {
        self.leases.held_ut()
    }

    fn keys(&self, buckets: &[BucketRef]) -> SmallVec<[Digest; 4]> {
        buckets.iter().map(|b| self.digester.digest(&b.key)).collect()
    }

    /// Where `buckets` with `demands` (one request) are decided at `now_us` (the store's clock
    /// as estimated).
    pub fn route(&self, buckets: &[BucketRef], demands: &[Demand], now_us: u64) -> Route {
        let keys = self.keys(buckets);
        // What a request gives back or reports must reach the store, and what the cache holds
        // of those buckets is stale once it has: forgotten before the call leaves.
        if let Some(cache) = &self.cache {
            for d in demands {
                if matches!(d.kind, DemandKind::Refund(_) | DemandKind::Debit { .. }) {
                    cache.forget(&keys[d.instance]);
                }
            }
        }
        let split = if buckets.iter().any(|b| b.lease_ut > 0) {
            self.reserve(buckets, &keys, demands, now_us)
        } else {
            None
        };
        let Some(split) = split else {
            if let Some(decision) = self
                .cache
                .as_ref()
                .and_then(|c| c.deny(buckets, &keys, demands, now_us))
            {
                self.counters.denials.increment(1);
                return Route::Local(Applied { now_us, decision });
            }
            let ticket = self.ticket(&keys);
            return Route::Store(Box::new(Ask {
                keys,
                split: None,
                ticket,
            }));
        };
        if split.instances.is_empty() {
            // Every bucket served by its lease.
            self.counters.lease_admissions.increment(1);
            let applied = Applied {
                now_us,
                decision: Decision {
                    denied: false,
                    passed: vec![true; demands.len()],
                    instances: Vec::new(),
                },
            };
            return Route::Local(self.merge(&keys, split, applied, demands.len()));
        }
        let sub_keys: SmallVec<[Digest; 4]> = split.instances.iter().map(|&i| keys[i]).collect();
        let cached = self
            .cache
            .as_ref()
            .and_then(|c| c.deny(&split.buckets, &sub_keys, &split.demands, now_us));
        if let Some(decision) = cached {
            self.counters.denials.increment(1);
            let applied = Applied { now_us, decision };
            return Route::Local(self.merge(&keys, split, applied, demands.len()));
        }
        let ticket = self.ticket(&sub_keys);
        Route::Store(Box::new(Ask {
            keys,
            split: Some(split),
            ticket,
        }))
    }

    fn ticket(&self, keys: &[Digest]) -> Ticket {
        match &self.cache {
            Some(c) => c.ticket(keys),
            None => Ticket::default(),
        }
    }

    /// Serves what leases can of the request: per leased bucket whose demands are all plain
    /// enforced consumption, reserves their sum from its lease. `None` when no lease served
    /// anything.
    fn reserve(&self, buckets: &[BucketRef], keys: &[Digest], demands: &[Demand], now_us: u64) -> Option<Box<Split>> {
        let mut reserved: SmallVec<[Option<Reserved>; 4]> = SmallVec::from_elem(None, buckets.len());
        let mut orders = Vec::new();
        let mut any = false;
        for (i, b) in buckets.iter().enumerate() {
            if b.lease_ut == 0 {
                continue;
            }
            let mut need = 0u64;
            let mut plain = true;
            for d in demands.iter().filter(|d| d.instance == i) {
                match d.kind {
                    DemandKind::Consume(n) if d.enforced => need = need.saturating_add(n),
                    _ => plain = false,
                }
            }
            if !plain || need == 0 {
                continue;
            }
            if let Some(r) = self.leases.reserve(b, keys[i], need, now_us, &mut orders) {
                reserved[i] = Some(r);
                any = true;
            }
        }
        self.push_orders(orders);
        if !any {
            return None;
        }
        let instances: SmallVec<[usize; 4]> = (0..buckets.len()).filter(|&i| reserved[i].is_none()).collect();
        let demand_ix: SmallVec<[usize; 4]> = (0..demands.len())
            .filter(|&j| reserved[demands[j].instance].is_none())
            .collect();
        let sub_buckets = instances.iter().map(|&i| buckets[i].clone()).collect();
        let sub_demands = demand_ix
            .iter()
            .map(|&j| Demand {
                instance: instances
                    .iter()
                    .position(|&i| i == demands[j].instance)
                    .expect("a demand on the store's part names one of its buckets"),
                ..demands[j]
            })
            .collect();
        Some(Box::new(Split {
            reserved,
            instances,
            demand_ix,
            buckets: sub_buckets,
            demands: sub_demands,
        }))
    }

    /// The whole request's answer from the store's answer (or the cache's) to its part
    /// `applied`: leased buckets spent when it was admitted, given back to their leases when
    /// not.
    fn merge(&self, keys: &[Digest], split: Box<Split>, applied: Applied, demands: usize) -> Applied {
        let Split {
            reserved,
            instances,
            demand_ix,
            ..
        } = *split;
        let Applied { now_us, decision } = applied;
        let admitted = !decision.denied;
        let mut passed = vec![true; demands];
        for (k, &j) in demand_ix.iter().enumerate() {
            passed[j] = decision.passed[k];
        }
        debug_assert_eq!(decision.instances.len(), instances.len());
        let mut remote = decision.instances.into_iter();
        let outcomes = reserved
            .iter()
            .enumerate()
            .map(|(i, r)| match r {
                Some(r) => {
                    if admitted {
                        self.leases.commit(&keys[i], r);
                    } else {
                        self.leases.release(&keys[i], r);
                    }
                    leased_outcome(r, admitted, now_us)
                }
                None => remote.next().expect("an answer for every bucket the store decided"),
            })
            .collect();
        Applied {
            now_us,
            decision: Decision {
                denied: !admitted,
                passed,
                instances: outcomes,
            },
        }
    }

    /// Finishes a request the store was asked about: `answer` to [`Ask::request`] becomes the
    /// request's answer, and the layer learns from it (the cache; leases to take).
    ///
    /// Errors: the store's, as it gave it (leased tokens reserved for the request go back to
    /// their leases).
    pub fn finish(
        &self,
        ask: Ask,
        buckets: &[BucketRef],
        demands: &[Demand],
        answer: Result<Applied, StoreError>,
    ) -> Result<Applied, StoreError> {
        let Ask { keys, split, ticket } = ask;
        // A refund of this request reached the store (or may have: a failed call may have
        // decided). A request sent after it but decided before it arrived (another connection)
        // answers with the bucket short of the refund: learnt already, or on its way, it would
        // deny here what the store admits. Forgotten again, as at the route.
        if let Some(cache) = &self.cache {
            for d in demands {
                if matches!(d.kind, DemandKind::Refund(_)) {
                    cache.forget(&keys[d.instance]);
                }
            }
        }
        let applied = match answer {
            Ok(a) => a,
            Err(e) => {
                if let Some(s) = split {
                    for (i, r) in s.reserved.iter().enumerate() {
                        if let Some(r) = r {
                            self.leases.release(&keys[i], r);
                        }
                    }
                }
                return Err(e);
            }
        };
        let (sent_buckets, sent_demands): (&[BucketRef], &[Demand]) = match &split {
            Some(s) => (&s.buckets, &s.demands),
            None => (buckets, demands),
        };
        let sent_keys: SmallVec<[Digest; 4]> = match &split {
            Some(s) => s.instances.iter().map(|&i| keys[i]).collect(),
            None => keys.clone(),
        };
        if let Some(cache) = &self.cache {
            cache.learn(&ticket, sent_buckets, &sent_keys, sent_demands, &applied);
        }
        if !applied.decision.denied && sent_buckets.iter().any(|b| b.lease_ut > 0) {
            let mut orders = Vec::new();
            for ((b, key), outcome) in sent_buckets.iter().zip(&sent_keys).zip(&applied.decision.instances) {
                if b.lease_ut > 0 {
                    self.leases.consider(b, *key, outcome.kept(), &mut orders);
                }
            }
            self.push_orders(orders);
        }
        Ok(match split {
            Some(s) => self.merge(&keys, s, applied, demands.len()),
            None => applied,
        })
    }

    fn push_orders(&self, orders: Vec<LeaseOrder>) {
        if orders.is_empty() {
            return;
        }
        self.orders.lock().unwrap_or_else(|p| p.into_inner()).extend(orders);
        self.has_orders.store(true, Ordering::Release);
    }

    /// The leases to ask the store for now (each a consuming decision of
    /// [`LeaseOrder::tokens_ut`] on its bucket, to send at once; hand the answer to
    /// [`LocalLayer::granted`]).
    pub fn take_orders(&self) -> Vec<LeaseOrder> {
        if !self.has_orders.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        let mut orders = std::mem::take(&mut *self.orders.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(cache) = &self.cache {
            // A denial of the order is learnt only if nothing was forgotten since it left.
            for order in &mut orders {
                order.ticket = cache.ticket(&[order.key]);
            }
        }
        orders
    }

    /// The store's answer to `order`: its decision, or `None` when the call failed. Returns
    /// tokens to give back at once, if the lease was dropped meanwhile.
    pub fn granted(&self, order: &LeaseOrder, answer: Option<&Applied>) -> Option<LeaseReturn> {
        let state = answer.and_then(|a| {
            (!a.decision.denied)
                .then(|| a.decision.instances.first().map(InstanceOutcome::kept))
                .flatten()
        });
        let now = answer.map_or(0, |a| a.now_us);
        if let (Some(a), Some(cache)) = (answer, &self.cache) {
            if a.decision.denied {
                // The store said the bucket cannot spare a lease: what it holds is worth knowing
                // (a request asking less still goes to the store).
                let demand = lease_demand(order);
                cache.learn(
                    &order.ticket,
                    std::slice::from_ref(&order.bucket),
                    &[order.key],
                    &[demand],
                    a,
                );
            }
        }
        self.leases.granted(order, state, now)
    }

    /// Leased tokens whose hold ended by `now_us`, to give back to the store (a refund each;
    /// see [`LocalLayer::returned`]).
    pub fn due_returns(&self, now_us: u64) -> Vec<LeaseReturn> {
        self.leases.due(now_us)
    }

    /// Every lease's unspent tokens, to give back to the store (a reload, a shutdown).
    pub fn return_all(&self) -> Vec<LeaseReturn> {
        self.leases.take_all()
    }

    /// A return is on its way to the store, or its call is done: what the cache holds of its
    /// bucket is stale. Call it when the return leaves and again when its answer is back (or
    /// its call failed): a request sent after the return but decided before it arrived answers
    /// with the bucket short of the returned tokens, and may have been learnt meanwhile.
    pub fn returned(&self, ret: &LeaseReturn) {
        if let Some(cache) = &self.cache {
            cache.forget(&ret.key);
        }
    }

    /// The rules were replaced: the cache forgets everything (limits may have changed);
    /// leases are ended ([`LocalLayer::return_all`] gives their tokens back).
    pub fn rules_changed(&self) {
        if let Some(cache) = &self.cache {
            cache.clear();
        }
    }

    /// `buckets` are being reset (the admin API): forgotten by the cache, their leases dropped.
    pub fn reset(&self, buckets: &[BucketRef]) {
        for key in self.keys(buckets) {
            if let Some(cache) = &self.cache {
                cache.forget(&key);
            }
            self.leases.drop_lease(&key);
        }
    }

    /// Drops cache entries no longer trusted at `now_us`; how many.
    pub fn sweep(&self, now_us: u64) -> usize {
        self.cache.as_ref().map_or(0, |c| c.sweep(now_us))
    }
}

/// The store demand of a lease order.
pub fn lease_demand(order: &LeaseOrder) -> Demand {
    Demand {
        instance: 0,
        kind: DemandKind::Consume(order.tokens_ut),
        enforced: true,
    }
}

/// The store demand of a lease return.
pub fn return_demand(ret: &LeaseReturn) -> Demand {
    Demand {
        instance: 0,
        kind: DemandKind::Refund(ret.tokens_ut),
        enforced: false,
    }
}

/// How a bucket served by a lease looks in the request's answer: this replica's view of it
/// (the store's state at the latest grant, refilled, plus the unspent lease), less what the
/// request took if it was admitted.
fn leased_outcome(r: &Reserved, admitted: bool, now_us: u64) -> InstanceOutcome {
    let before = BucketState {
        tokens_ut: r.view.tokens_ut,
        updated_us: now_us.max(r.view.updated_us),
    };
    let after = BucketState {
        tokens_ut: if admitted {
            before.tokens_ut.saturating_sub(r.taken_ut)
        } else {
            before.tokens_ut
        },
        ..before
    };
    InstanceOutcome {
        stored: before,
        before,
        after,
        consumed_ut: r.taken_ut,
        debited_ut: 0,
        lost_ut: 0,
        changed: admitted,
    }
}
