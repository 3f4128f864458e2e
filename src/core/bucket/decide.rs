//! One request's decision over all the bucket instances it touches: all or nothing.

use smallvec::SmallVec;

use super::{BucketState, Refilling, MICRO};

/// What one request descriptor asks of one bucket instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DemandKind {
    /// Take this many micro-tokens if the whole request is admitted.
    Consume(u64),
    /// A non-consuming check (a descriptor `hits_addend` explicitly set to 0): passes when one
    /// more token is there beyond what this request consumes from the same instance.
    Check,
    /// Give this many micro-tokens back, never above capacity (`is_negative_hits: true` in the
    /// RLS proto). Always applied, whatever the decision; always answered OK.
    Refund(u64),
    /// A usage report on a debt bucket (docs/usage-budgets.md): `amount_ut` micro-tokens are
    /// taken whatever the decision, down to an empty bucket (the floor), the rest counted as
    /// lost. Passes iff the balance before the request is positive: the bucket holds more than
    /// `depth_ut`, the micro-tokens that lie between zero and the floor.
    Debit {
        /// Micro-tokens used (`hits_addend` x 10^6).
        amount_ut: u64,
        /// How far below zero the floor lies, in micro-tokens: the bucket's tokens less this
        /// are its balance.
        depth_ut: u64,
    },
    /// The request-path question on a debt bucket (`hits_addend` 0): passes iff the balance is
    /// positive, the bucket holding more than `depth_ut`; takes nothing.
    DebtCheck {
        /// As for [`DemandKind::Debit`].
        depth_ut: u64,
    },
}

impl DemandKind {
    /// The micro-tokens the instance must hold for this demand to pass, given that the request
    /// consumes `consumed_ut` from it: one token beyond them for a check, one micro-token beyond
    /// the floor's depth on a debt bucket. `None` for a refund, which always passes.
    pub fn need_ut(&self, consumed_ut: u64) -> Option<u64> {
        match *self {
            DemandKind::Consume(_) => Some(consumed_ut),
            DemandKind::Check => Some(consumed_ut.saturating_add(MICRO)),
            DemandKind::Refund(_) => None,
            DemandKind::Debit { depth_ut, .. } | DemandKind::DebtCheck { depth_ut } => Some(depth_ut.saturating_add(1)),
        }
    }
}

/// One descriptor's demand on one bucket instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// Index of the instance in the `states` and `plans` given to [`decide`].
    pub instance: usize,
    /// What is asked.
    pub kind: DemandKind,
    /// `false` in shadow mode: the demand is evaluated and counted but never denies.
    pub enforced: bool,
}

/// What a decision did to one bucket instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstanceOutcome {
    /// The state as given, before refill: what stays stored when `changed` is `false`.
    pub stored: BucketState,
    /// The state refilled to `now`, before this request took or gave anything.
    pub before: BucketState,
    /// The state after this decision.
    pub after: BucketState,
    /// Micro-tokens this request's consuming demands asked of the instance, added up.
    pub consumed_ut: u64,
    /// Micro-tokens this request's usage reports ([`DemandKind::Debit`]) took, added up.
    pub debited_ut: u64,
    /// Micro-tokens of usage reports that found the bucket empty (at its floor): counted, not
    /// taken.
    pub lost_ut: u64,
    /// Whether `after` must be written back (tokens were taken or given). When `false` the
    /// stored state is left as it was, so flooring in [`super::refill`] loses nothing.
    pub changed: bool,
}

impl InstanceOutcome {
    /// The state the store keeps after this decision: `after` when it changed, else `stored`.
    /// Waits are measured from it ([`super::wait_us`]), so they count refill that flooring
    /// left out of `before`.
    pub fn kept(&self) -> BucketState {
        if self.changed {
            self.after
        } else {
            self.stored
        }
    }
}

/// The decision for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Whether any enforced demand failed; then nothing was consumed anywhere.
    pub denied: bool,
    /// Per demand, in the order given: whether it would pass on its own terms.
    pub passed: Vec<bool>,
    /// Per instance, in the order given.
    pub instances: Vec<InstanceOutcome>,
}

/// Decides one request at `now_us` over `states` (one per bucket instance, each brought forward
/// to `now_us` by its entry in `plans`: a constant [`super::Limit`], or a schedule or quota),
/// applying `demands`.
///
/// - The consuming demands on one instance add up; the instance can serve them iff it holds
///   that many micro-tokens after refill.
/// - The request is denied iff some enforced demand fails. A denied request consumes nothing
///   anywhere; an admitted one consumes from every instance that can serve it (a shadow
///   instance that cannot keeps its tokens).
/// - Usage reports on a debt bucket ([`DemandKind::Debit`]) are taken in every case, after
///   any consumption, down to an empty bucket; what finds it empty is `lost_ut`.
/// - Refunds apply afterwards in every case, capped at capacity.
///
/// ```
/// use tollgate::core::bucket::{decide, BucketState, Demand, DemandKind, Limit, Rate, MICRO};
/// // Two buckets: 5 tokens refilled 5 per second, and an empty one refilled 1 per hour.
/// let per_second = Limit::new(5, Rate::per(5, 1_000_000).unwrap());
/// let hourly = Limit::new(1, Rate::per(1, 3_600_000_000).unwrap());
/// let states = [BucketState::full(&per_second, 0), BucketState { tokens_ut: 0, updated_us: 0 }];
/// let one = |instance| Demand { instance, kind: DemandKind::Consume(MICRO), enforced: true };
/// let d = decide(1_000, &states, &[per_second, hourly], &[one(0), one(1)]);
/// assert!(d.denied);
/// assert_eq!(d.passed, vec![true, false]);
/// // All or nothing: the bucket that could have served keeps its tokens.
/// assert_eq!(d.instances[0].after.tokens_ut, 5 * MICRO);
/// ```
///
/// # Panics
/// When `plans` and `states` differ in length or a demand names an instance out of range:
/// both are built by the caller from the same list.
pub fn decide<P: Refilling>(now_us: u64, states: &[BucketState], plans: &[P], demands: &[Demand]) -> Decision {
    assert_eq!(states.len(), plans.len(), "one plan per bucket state");
    // A request's few buckets: on the stack.
    let mut consumed: SmallVec<[u64; 4]> = smallvec::smallvec![0; states.len()];
    let mut refunded: SmallVec<[u64; 4]> = smallvec::smallvec![0; states.len()];
    let mut debits: SmallVec<[u64; 4]> = smallvec::smallvec![0; states.len()];
    for d in demands {
        match d.kind {
            DemandKind::Consume(n) => consumed[d.instance] = consumed[d.instance].saturating_add(n),
            DemandKind::Refund(n) => refunded[d.instance] = refunded[d.instance].saturating_add(n),
            DemandKind::Debit { amount_ut, .. } => debits[d.instance] = debits[d.instance].saturating_add(amount_ut),
            DemandKind::Check | DemandKind::DebtCheck { .. } => {}
        }
    }
    let before: SmallVec<[BucketState; 4]> = states.iter().zip(plans).map(|(s, p)| p.refill_to(*s, now_us)).collect();
    let passed: Vec<bool> = demands
        .iter()
        .map(|d| {
            d.kind
                .need_ut(consumed[d.instance])
                .is_none_or(|need| before[d.instance].tokens_ut >= need)
        })
        .collect();
    let denied = demands.iter().zip(&passed).any(|(d, ok)| d.enforced && !ok);
    let instances = before
        .iter()
        .zip(plans)
        .enumerate()
        .map(|(i, (b, plan))| {
            let mut tokens = b.tokens_ut;
            let take = !denied && consumed[i] > 0 && tokens >= consumed[i];
            if take {
                tokens -= consumed[i];
            }
            // Usage that happened is recorded whatever the decision, down to the floor.
            let debited = debits[i].min(tokens);
            tokens -= debited;
            // The capacity at the instant the state was brought to: `now_us`, or its last write
            // when the clock stepped back, as for the trim in `refill_to` (the Redis script
            // decides the same way).
            let capacity = plan.capacity_ut_at(b.updated_us);
            let give = refunded[i] > 0 && tokens < capacity;
            if give {
                tokens = tokens.saturating_add(refunded[i]).min(capacity);
            }
            InstanceOutcome {
                stored: states[i],
                before: *b,
                after: BucketState {
                    tokens_ut: tokens,
                    updated_us: b.updated_us,
                },
                consumed_ut: consumed[i],
                debited_ut: debited,
                lost_ut: debits[i] - debited,
                changed: take || give || debited > 0,
            }
        })
        .collect();
    Decision {
        denied,
        passed,
        instances,
    }
}
