//! Deciding locally on a shared backend (docs/backends.md, "Deciding locally"): what a
//! replica on Redis or Postgres answers without a store call.
//!
//! - **The over-limit cache** ([`OverLimitCache`]): a bucket the store just answered for is
//!   known to hold at most what the store said, refilled since; a request that state denies is
//!   denied here, with the statuses, headers and `Retry-After` the store would give. Exact: it
//!   never admits, and never denies what the store would admit but within the documented
//!   bounds (a refund or reset on another replica, a clock estimate off by more than
//!   [`CLOCK_MARGIN_US`]).
//! - **Token leases** (a rule's `lease`): a replica takes a slice of a hot bucket's tokens in
//!   one store call and admits requests on them here. Never over-admits (the store debited
//!   them first); under-admits at most `lease` x (replicas holding one) at a time.
//!
//! [`LocalLayer`] holds the decisions (no I/O: the simulation in the test suite drives it
//! against a simulated store); [`Local`] runs it in front of a real store, with the lease calls
//! and returns as background tasks.

mod layer;
mod lease;
mod overlimit;
mod settings;

pub use layer::{lease_demand, return_demand, Ask, LocalLayer, Route};
pub use lease::{LeaseOrder, LeaseReturn};
pub use overlimit::{OverLimitCache, CLOCK_MARGIN_US, PROBE_US};
pub use settings::LocalSettings;

use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use super::{Applied, BucketRef, Peeked, Store, StoreError};
use crate::core::bucket::Demand;

/// How often the upkeep task gives back the leases whose hold ended.
const UPKEEP_TICK: Duration = Duration::from_millis(100);
/// How often it also drops cache entries no longer trusted (a pass over every entry).
const SWEEP_EVERY_TICKS: u32 = 50;

/// `S` (a shared store behind its breaker and fallback) with a replica's [`LocalLayer`] in
/// front.
pub struct Local<S> {
    inner: Arc<S>,
    layer: Arc<LocalLayer>,
    upkeep: OnceLock<()>,
    calls: LeaseCalls,
}

struct LeaseCalls {
    grant: metrics::Counter,
    give_back: metrics::Counter,
}

impl<S: Store> Local<S> {
    /// `inner` with a local layer of `settings`.
    pub fn new(inner: S, settings: &LocalSettings) -> Local<S> {
        let calls = LeaseCalls {
            grant: metrics::counter!(crate::telemetry::LEASE_CALLS, "kind" => "grant"),
            give_back: metrics::counter!(crate::telemetry::LEASE_CALLS, "kind" => "return"),
        };
        calls.grant.increment(0);
        calls.give_back.increment(0);
        Local {
            inner: Arc::new(inner),
            layer: Arc::new(LocalLayer::new(settings)),
            upkeep: OnceLock::new(),
            calls,
        }
    }

    /// The store behind the layer.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The layer.
    pub fn layer(&self) -> &LocalLayer {
        &self.layer
    }

    /// Gives every lease's unspent tokens back to the store and waits for the answers (at
    /// most `timeout`): for a shutdown.
    pub async fn return_leases(&self, timeout: Duration) {
        let returns = self.layer.return_all();
        if returns.is_empty() {
            return;
        }
        let all = futures_util::future::join_all(
            returns
                .into_iter()
                .map(|r| give_back(&*self.inner, &self.layer, &self.calls.give_back, r)),
        );
        if tokio::time::timeout(timeout, all).await.is_err() {
            tracing::warn!("leased tokens not all given back before the shutdown deadline: they refill in the store");
        }
    }

    /// Starts what runs beside the requests, once: lease calls the layer ordered, and the
    /// upkeep (returns at the end of a hold, the cache's sweep).
    fn background(&self) {
        let orders = self.layer.take_orders();
        if !orders.is_empty() {
            for order in orders {
                let (inner, layer, grant) = (self.inner.clone(), self.layer.clone(), self.calls.grant.clone());
                let give = self.calls.give_back.clone();
                tokio::spawn(async move {
                    grant.increment(1);
                    let demand = lease_demand(&order);
                    let answer = inner.apply(std::slice::from_ref(&order.bucket), &[demand]).await;
                    if let Err(e) = &answer {
                        tracing::debug!(error = %e, "a lease call failed; requests go to the store meanwhile");
                    }
                    if let Some(ret) = layer.granted(&order, answer.as_ref().ok()) {
                        give_back(&*inner, &layer, &give, ret).await;
                    }
                });
            }
        }
        self.upkeep.get_or_init(|| {
            let (inner, layer) = (Arc::downgrade(&self.inner), Arc::downgrade(&self.layer));
            tokio::spawn(upkeep(inner, layer, self.calls.give_back.clone()));
        });
    }
}

/// Gives `ret`'s tokens back to `store` (a refund), making `layer` forget its stale state
/// before the call and again after it ([`LocalLayer::returned`]). A failure is logged: the
/// tokens then come back by refill (an under-admission).
async fn give_back<S: Store>(store: &S, layer: &LocalLayer, counter: &metrics::Counter, ret: LeaseReturn) {
    layer.returned(&ret);
    counter.increment(1);
    let demand = return_demand(&ret);
    let answer = store.apply(std::slice::from_ref(&ret.bucket), &[demand]).await;
    layer.returned(&ret);
    if let Err(e) = answer {
        tracing::warn!(error = %e, "could not give leased tokens back: they come back by refill");
    }
}

/// Gives back the leases whose hold ended and sweeps the cache, until the store is dropped.
async fn upkeep<S: Store>(inner: Weak<S>, layer: Weak<LocalLayer>, counter: metrics::Counter) {
    let mut ticks = 0u32;
    loop {
        tokio::time::sleep(UPKEEP_TICK).await;
        let (Some(inner), Some(layer)) = (inner.upgrade(), layer.upgrade()) else {
            return;
        };
        let now = inner.clock_estimate_us();
        for ret in layer.due_returns(now) {
            give_back(&*inner, &layer, &counter, ret).await;
        }
        ticks += 1;
        if ticks.is_multiple_of(SWEEP_EVERY_TICKS) {
            layer.sweep(now);
        }
    }
}

impl<S: Store> Store for Local<S> {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        let now = self.inner.clock_estimate_us();
        let ask = match self.layer.route(buckets, demands, now) {
            Route::Local(applied) => {
                // On the store span of a traced request (a no-op otherwise): the over-limit
                // cache only denies, a lease only admits.
                let by = if applied.decision.denied {
                    "over_limit_cache"
                } else {
                    "lease"
                };
                if crate::telemetry::in_sampled_call() {
                    tracing::Span::current().record("ratelimit.decided_by", by);
                }
                self.background();
                return Ok(applied);
            }
            Route::Store(ask) => ask,
        };
        let answer = {
            let (b, d) = ask.request(buckets, demands);
            self.inner.apply(b, d).await
        };
        let result = self.layer.finish(*ask, buckets, demands, answer);
        self.background();
        result
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.inner.peek(buckets).await
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.layer.reset(buckets);
        self.inner.reset(buckets).await
    }

    fn rules_changed(&self) {
        self.inner.rules_changed();
        self.layer.rules_changed();
        let returns = self.layer.return_all();
        if returns.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (inner, layer, counter) = (self.inner.clone(), self.layer.clone(), self.calls.give_back.clone());
            runtime.spawn(async move {
                for ret in returns {
                    give_back(&*inner, &layer, &counter, ret).await;
                }
            });
        }
    }

    fn on_rules_retired(&self) -> Option<super::RetireHook> {
        self.inner.on_rules_retired()
    }

    fn clock_estimate_us(&self) -> u64 {
        self.inner.clock_estimate_us()
    }
}

#[cfg(test)]
mod tests;
