//! Where bucket state lives. A store runs one request's decision atomically: it reads the
//! states of the request's bucket instances, calls [`crate::core::bucket::decide`], and writes back
//! what changed, all before any other request may see those buckets. Operators can also look
//! at buckets without changing them ([`Store::peek`]) and fill them again ([`Store::reset`]);
//! a refund is an [`Store::apply`] with [`crate::core::bucket::DemandKind::Refund`] demands.

mod any;
mod breaker;
mod digest;
mod error;
pub mod local;
mod memory;
mod metered;
mod postgres;
mod queue;
pub mod redis;
mod resilient;
mod round_trip;
pub mod settings;
mod shared;

use std::future::Future;

pub use any::{AnyStore, Health};
pub use breaker::{Breaker, BreakerPolicy, BreakerState, Outcome, Permit, Transition};
pub use error::{batch_failure, Cause, ConnectError, StoreError};
pub use local::{Local, LocalSettings};
pub use memory::MemorySettings;
pub use memory::{MemoryStore, MemoryStoreStats};
pub use metered::Metered;
pub use postgres::PostgresSettings;
pub use postgres::PostgresStore;
pub(crate) use queue::gather;
pub use redis::RedisStore;
pub use redis::{FallbackBackend, RedisSettings, SentinelSettings};
pub use resilient::{Fallback, Guarded, Resilient};
pub use settings::{redact_url, FailureMode, UnreachableAtStart};
pub use shared::{start_shared, SharedBackend};

use crate::core::bucket::{BucketState, Decision, Demand, Refilling};
use crate::core::schedule::Plan;

/// One bucket instance a request touches.
#[derive(Clone, Debug)]
pub struct BucketRef {
    /// The instance identity, from [`crate::rules::matcher::instance_key`].
    pub key: String,
    /// Its limit and how the limit changes over time; the store evaluates it at its own clock's
    /// now (docs/backends.md).
    pub plan: Plan,
    /// The rule's `lease`, in micro-tokens: how many tokens a replica may reserve from the
    /// shared store at a time and spend locally ([`local`], docs/backends.md); 0 for none (every
    /// decision asks the store).
    pub lease_ut: u64,
}

/// A store's answer: the decision and the instant, by the store's clock, it was taken at.
#[derive(Clone, Debug)]
pub struct Applied {
    /// Microseconds since the epoch, by the store's clock.
    pub now_us: u64,
    /// What was decided, per demand and per instance.
    pub decision: Decision,
}

/// Bucket states as a store reads them at one instant, changing nothing: the answer to
/// [`Store::peek`] and [`Store::reset`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peeked {
    /// Microseconds since the epoch, by the store's clock.
    pub now_us: u64,
    /// Per bucket, in the order asked: its state brought forward to `now_us` with its
    /// [`Plan`] (refilled, trimmed to the capacity in force, or reset by a quota edge), in
    /// micro-tokens. A bucket the store does not hold (never used, full, or forgotten) is full
    /// at the capacity in force at `now_us`.
    pub states: Vec<BucketState>,
    /// Per bucket, the state as the store keeps it (a bucket not held: full at `now_us`).
    /// Waits are measured from it ([`Plan::wait_us`], [`Plan::full_at_us`]), as for a decision
    /// ([`crate::core::bucket::InstanceOutcome::kept`]): it still counts the refill that flooring
    /// leaves out of `states`.
    pub kept: Vec<BucketState>,
}

impl Peeked {
    /// What a peek answers from what a store holds at `now_us`: per bucket its stored state
    /// (`None`: not held, so full at the capacity in force) brought forward with its plan.
    pub fn from_stored(
        buckets: &[BucketRef],
        stored: impl IntoIterator<Item = Option<BucketState>>,
        now_us: u64,
    ) -> Peeked {
        let kept: Vec<BucketState> = buckets
            .iter()
            .zip(stored)
            .map(|(b, s)| s.unwrap_or_else(|| BucketState::full(&b.plan.limit_at(now_us), now_us)))
            .collect();
        let states = buckets
            .iter()
            .zip(&kept)
            .map(|(b, s)| b.plan.refill_to(*s, now_us))
            .collect();
        Peeked { now_us, states, kept }
    }

    /// What a reset answers: every bucket full at the capacity in force at `now_us`.
    pub fn all_full(buckets: &[BucketRef], now_us: u64) -> Peeked {
        let full: Vec<BucketState> = buckets
            .iter()
            .map(|b| BucketState::full(&b.plan.limit_at(now_us), now_us))
            .collect();
        Peeked {
            now_us,
            states: full.clone(),
            kept: full,
        }
    }
}

/// A place to keep bucket state and decide on it atomically.
pub trait Store: Send + Sync + 'static {
    /// Decides one request over `buckets` (distinct instances) with `demands` (whose
    /// `instance` index into `buckets`), all or nothing, and persists the result.
    fn apply(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
    ) -> impl Future<Output = Result<Applied, StoreError>> + Send;

    /// Reads `buckets` (distinct instances) at the store's now without changing anything
    /// stored, not even when a bucket was last brought up to date: a peek never loses refill
    /// to flooring and never delays a bucket's being forgotten once full. Reads as of one
    /// instant, atomically with respect to decisions.
    fn peek(&self, buckets: &[BucketRef]) -> impl Future<Output = Result<Peeked, StoreError>> + Send;

    /// Fills `buckets` (distinct instances) again: each is then full at the capacity in force,
    /// as if never used (the memory store forgets them). Answers with their states after.
    fn reset(&self, buckets: &[BucketRef]) -> impl Future<Output = Result<Peeked, StoreError>> + Send;

    /// Decides as [`Store::apply`], but the part of the request that only a failed part of the
    /// store holds (the slots of a lost Redis Cluster master) is decided on `fallback`, the
    /// rest here, still all or nothing. A store that fails as a whole decides as `apply` (the
    /// default), and its caller falls back for the whole request.
    fn apply_or_fall_back<F: PartFallback>(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
        fallback: &F,
    ) -> impl Future<Output = Result<Applied, StoreError>> + Send {
        let _ = fallback;
        self.apply(buckets, demands)
    }

    /// Told when the rules in force are replaced, so that what a store remembers about a bucket
    /// under the old rules (such as when it would be full) is not applied under the new ones.
    fn rules_changed(&self) {}

    /// What to run when the replaced rules are retired (the last request deciding on them is
    /// done), if this store needs telling then too: a request that loaded the old rules
    /// before a reload and writes after it must not have its bucket's old "full again" time
    /// trusted under the new rules. The memory store's answer calls [`Store::rules_changed`].
    fn on_rules_retired(&self) -> Option<RetireHook> {
        None
    }

    /// The store's clock as read without a call, in microseconds since the epoch: its own
    /// (memory), tollgate's estimate of the backend's (Redis), tollgate's (Postgres, whose
    /// clock is within the skew between hosts). The instant a reload takes effect at
    /// ([`crate::core::schedule::Reloaded`]).
    fn clock_estimate_us(&self) -> u64 {
        crate::core::clock::Clock::now_us(&crate::core::clock::SystemClock)
    }
}

/// What decides the part of a request that a failed part of a store cannot
/// ([`Store::apply_or_fall_back`]): the configured fallback, counted.
pub trait PartFallback: Sync {
    /// Decides `buckets` with `demands` as [`Store::apply`] does (counted as a fallback).
    fn decide(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
    ) -> impl Future<Output = Result<Applied, StoreError>> + Send;

    /// Gives back what a part it decided took, when another part of the request denied: as
    /// [`PartFallback::decide`] with refund demands, but no decision to count.
    fn give_back(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
    ) -> impl Future<Output = Result<Applied, StoreError>> + Send;
}

/// A callback for [`Store::on_rules_retired`].
pub type RetireHook = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Both hooks, or either, or none.
pub fn both_hooks(a: Option<RetireHook>, b: Option<RetireHook>) -> Option<RetireHook> {
    match (a, b) {
        (Some(a), Some(b)) => Some(std::sync::Arc::new(move || {
            a();
            b();
        })),
        (a, b) => a.or(b),
    }
}
