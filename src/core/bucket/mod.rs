//! The pure token-bucket core: no I/O, no clock reads. Every function takes the time and the
//! state and returns a result, so every store (memory, Redis, Postgres) reuses the same math.
//!
//! Units, used throughout tollgate:
//! - time is an instant in **microseconds** since the Unix epoch (`_us` suffix), the resolution
//!   of Redis `TIME` and of Postgres `clock_timestamp()`;
//! - tokens are held in **micro-tokens** (`_ut` suffix): one token is [`MICRO`] micro-tokens.
//!
//! Bucket state is held as `(tokens, updated)` rather than as a GCRA arrival time: a schedule
//! or reload that changes capacity then only needs a `min`, and the tokens a client sees are
//! read off directly. Refill is lazy and floors to whole micro-tokens; state is written back only
//! when a decision changes the tokens, so a denied request or a check loses nothing to flooring.
//! An admitted request can lose less than one micro-token of refill (one token per million
//! admitted requests): a bounded under-admission, never an over-admission.

mod decide;
mod rate;

pub use decide::{decide, Decision, Demand, DemandKind, InstanceOutcome};
pub use rate::{Rate, RateError, EXACT_LIMIT};

/// Micro-tokens per token.
pub const MICRO: u64 = 1_000_000;

/// The largest capacity a bucket may have, in whole tokens: 9·10^9 (a large tenant's monthly
/// budget of tokens fits). Keeps capacities in micro-tokens (9·10^15) below 2^53 (about
/// 9.007·10^15), so the Redis script's doubles compute exactly. A debt bucket's capacity plus
/// the depth of its floor stays within it too (docs/usage-budgets.md).
pub const MAX_CAPACITY: u64 = 9_000_000_000;

/// The limit in force for a bucket at one instant: its capacity and refill rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limit {
    /// The burst: how many micro-tokens the bucket holds when full.
    pub capacity_ut: u64,
    /// How fast tokens come back.
    pub rate: Rate,
}

impl Limit {
    /// A bucket of `capacity` whole tokens refilled at `rate`.
    pub fn new(capacity: u64, rate: Rate) -> Limit {
        Limit {
            capacity_ut: capacity.saturating_mul(MICRO),
            rate,
        }
    }

    /// Capacity in whole tokens.
    pub fn capacity(&self) -> u64 {
        self.capacity_ut / MICRO
    }

    /// Microseconds to refill from empty to full; `None` when the rate is zero and the
    /// capacity positive (the bucket never refills).
    pub fn time_to_fill_us(&self) -> Option<u64> {
        self.rate.time_to_earn(self.capacity_ut)
    }

    /// The window the `RateLimit-Policy` header gives the limit: microseconds to fill from
    /// empty; `None` for a limit that never refills or holds nothing.
    pub fn window_us(&self) -> Option<u64> {
        (!self.rate.is_zero() && self.capacity_ut > 0)
            .then(|| self.time_to_fill_us())
            .flatten()
    }
}

/// How a bucket's limit acts over time: [`decide`] brings each state forward with it and caps
/// refunds at the capacity it gives. A constant [`Limit`] is one; a schedule or a quota
/// ([`crate::core::schedule::Plan`]) is another.
pub trait Refilling {
    /// The state brought forward to `now_us` (trimmed to the capacity in force, refilled or
    /// reset as the limit says). Must never move `updated_us` back.
    fn refill_to(&self, state: BucketState, now_us: u64) -> BucketState;

    /// The capacity in force at `now_us`, in micro-tokens.
    fn capacity_ut_at(&self, now_us: u64) -> u64;
}

impl Refilling for Limit {
    fn refill_to(&self, state: BucketState, now_us: u64) -> BucketState {
        refill(state, self, now_us)
    }

    fn capacity_ut_at(&self, _now_us: u64) -> u64 {
        self.capacity_ut
    }
}

impl<T: Refilling + ?Sized> Refilling for &T {
    fn refill_to(&self, state: BucketState, now_us: u64) -> BucketState {
        (**self).refill_to(state, now_us)
    }

    fn capacity_ut_at(&self, now_us: u64) -> u64 {
        (**self).capacity_ut_at(now_us)
    }
}

/// The stored state of one bucket instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketState {
    /// Micro-tokens held at `updated_us`. May exceed the capacity in force after a capacity
    /// drop; [`refill`] trims it before any decision.
    pub tokens_ut: u64,
    /// When `tokens_ut` was last brought up to date, in microseconds since the epoch.
    pub updated_us: u64,
}

impl BucketState {
    /// A bucket that has never been used: full at `now_us`.
    pub fn full(limit: &Limit, now_us: u64) -> BucketState {
        BucketState {
            tokens_ut: limit.capacity_ut,
            updated_us: now_us,
        }
    }
}

/// The state of a bucket brought forward to `now_us`: trimmed to the capacity, then refilled
/// for the elapsed time, never above capacity. A clock that stepped backwards counts as zero
/// elapsed time and never moves `updated_us` back (that would credit the same time twice).
pub fn refill(state: BucketState, limit: &Limit, now_us: u64) -> BucketState {
    let tokens = state.tokens_ut.min(limit.capacity_ut);
    let elapsed = now_us.saturating_sub(state.updated_us);
    let missing = limit.capacity_ut - tokens;
    let tokens_ut = match limit.rate.credit(elapsed, missing) {
        Some(credit) => tokens + credit,
        None => limit.capacity_ut,
    };
    BucketState {
        tokens_ut,
        updated_us: state.updated_us.max(now_us),
    }
}

/// Microseconds until a bucket holding `tokens_ut` is full again; `None` if it never will be.
pub fn time_to_full_us(tokens_ut: u64, limit: &Limit) -> Option<u64> {
    limit.rate.time_to_earn(limit.capacity_ut.saturating_sub(tokens_ut))
}

/// Microseconds from `now_us` until a bucket stored as `state` holds `need_ut`, by the
/// arithmetic of [`refill`]: the exact instant, since the refill that flooring leaves out of a
/// state refilled to `now_us` still counts. `None` when that can never happen (more than the
/// capacity, or a zero rate with too few tokens).
pub fn wait_us(state: BucketState, need_ut: u64, limit: &Limit, now_us: u64) -> Option<u64> {
    if need_ut > limit.capacity_ut {
        return None;
    }
    let tokens = state.tokens_ut.min(limit.capacity_ut);
    if tokens >= need_ut {
        // Already there, even if the clock now reads before `updated_us`.
        return Some(0);
    }
    let earn = limit.rate.time_to_earn(need_ut - tokens)?;
    Some(state.updated_us.saturating_add(earn).saturating_sub(now_us))
}

#[cfg(test)]
mod tests;
