//! [`Plan`]: what a bucket policy does over time, as one type the stores and the response use
//! without caring whether the limit is constant, scheduled or a calendar quota.

use std::sync::Arc;

use super::{
    full_at_us, refill_scheduled, reopen_at_us, wait_until_us, Expiring, Quota, Reloaded, Schedule, DEFAULT_HORIZON_US,
    QUOTA_HORIZON_US,
};
use crate::core::bucket::{refill, wait_us, BucketState, Limit, Refilling};

/// How a bucket's limit behaves over time. Cheap to clone (the time-varying kinds are shared).
///
/// Every method is pure: the time is an argument (microseconds since the epoch) and tokens are
/// micro-tokens, as in [`crate::core::bucket`].
#[derive(Clone, Debug)]
pub enum Plan {
    /// A token bucket whose capacity and refill never change.
    Fixed(Limit),
    /// A token bucket whose capacity and refill follow schedule windows (docs/schedules-and-quotas.md).
    Scheduled(Arc<Schedule>),
    /// A calendar quota: no refill, back to full at each reset edge (docs/schedules-and-quotas.md).
    Quota(Arc<Quota>),
    /// A fixed allowance whole again a set time after its first use (`expires`, docs/rules.md).
    Expiring(Expiring),
    /// One of the above replaced by a reload: the old plan up to the reload, the new one from
    /// it ([`Reloaded`]; docs/operations.md). Never compiled from a rules file: a reload builds
    /// it from the plan in force and the new one.
    Reloaded(Arc<Reloaded>),
}

impl Plan {
    /// The limit in force at `t_us`. A quota's is its allowance with a zero rate.
    // Inline: it runs on every decision, and left to how rustc splits the crate into codegen
    // units it stopped being inlined when unrelated modules were added (+1.4% instructions per
    // decision on the instruction gate's envoy path).
    #[inline]
    pub fn limit_at(&self, t_us: u64) -> Limit {
        match self {
            Plan::Fixed(limit) => *limit,
            Plan::Scheduled(s) => s.limit_at(t_us),
            Plan::Quota(q) => q.limit(),
            Plan::Expiring(e) => e.limit(),
            Plan::Reloaded(r) if t_us < r.at_us() => r.before().limit_at(t_us),
            Plan::Reloaded(r) => r.after().limit_at(t_us),
        }
    }

    /// The limit when no schedule window is active (a quota's allowance).
    pub fn base(&self) -> Limit {
        match self {
            Plan::Fixed(limit) => *limit,
            Plan::Scheduled(s) => *s.base(),
            Plan::Quota(q) => q.limit(),
            Plan::Expiring(e) => e.limit(),
            Plan::Reloaded(r) => r.after().base(),
        }
    }

    /// Microseconds from `now_us` until the bucket stored as `state` holds `need_ut`, by the
    /// same arithmetic as [`Refilling::refill_to`]: the exact retry-after (docs/rules.md).
    /// `Some(0)` when it holds them already; `None` when nothing within the horizon admits it:
    /// none for a constant limit, [`DEFAULT_HORIZON_US`] (62 days) walking schedule windows,
    /// [`QUOTA_HORIZON_US`] for a quota's next reset edge; for an expiring allowance, the end
    /// of its period.
    pub fn wait_us(&self, state: BucketState, need_ut: u64, now_us: u64) -> Option<u64> {
        match self {
            Plan::Fixed(limit) => wait_us(state, need_ut, limit, now_us),
            Plan::Scheduled(s) => wait_until_us(state, need_ut, s, now_us, DEFAULT_HORIZON_US),
            Plan::Quota(q) => q.wait_us(state, need_ut, now_us, QUOTA_HORIZON_US),
            Plan::Expiring(e) => e.wait_us(state, need_ut, now_us),
            Plan::Reloaded(r) if !r.predates(state.updated_us) => r.after().wait_us(state, need_ut, now_us),
            Plan::Reloaded(r) if now_us < r.at_us() => match r.before().wait_us(state, need_ut, now_us) {
                Some(w) if now_us.saturating_add(w) < r.at_us() => Some(w),
                _ => r
                    .after()
                    .wait_us(r.at_reload(state), need_ut, r.at_us())
                    .map(|w| w.saturating_add(r.at_us() - now_us)),
            },
            Plan::Reloaded(r) => r.after().wait_us(r.at_reload(state), need_ut, now_us),
        }
    }

    /// The instant the bucket stored as `state` is full again (holds the capacity in force
    /// then), so that a store may forget it from then on: a missing bucket starts full. `None`
    /// when that is not within the horizon (or never, for a zero rate). For a quota, its next
    /// reset edge unless it is full already; for an expiring allowance, the end of its period.
    pub fn full_at_us(&self, state: BucketState) -> Option<u64> {
        match self {
            Plan::Fixed(limit) => wait_us(state, limit.capacity_ut, limit, state.updated_us)
                .map(|wait| state.updated_us.saturating_add(wait)),
            Plan::Scheduled(s) => full_at_us(state, s, DEFAULT_HORIZON_US),
            Plan::Quota(q) => q.first_holding(state, q.limit().capacity_ut, state.updated_us, QUOTA_HORIZON_US),
            Plan::Expiring(e) => Some(e.full_at_us(state)),
            Plan::Reloaded(r) if !r.predates(state.updated_us) => r.after().full_at_us(state),
            Plan::Reloaded(r) => match r.before().full_at_us(state) {
                // Full before the reload: full under the new limit too (a full bucket is no bucket).
                Some(full) if full <= r.at_us() => Some(full),
                _ => r.after().full_at_us(r.at_reload(state)),
            },
        }
    }

    /// `duration_until_reset` and the `t` of the `RateLimit` header (docs/rules.md), in
    /// microseconds from `now_us`: the time until the bucket stored as `state` is full again;
    /// for a quota, the time to its next reset edge; for an expiring allowance, to the end of
    /// its period (0 while it is whole). `None` for a bucket that never refills and when the
    /// instant lies beyond the horizon.
    ///
    /// A bucket under a zero capacity (a maintenance window) is "full" but admits nothing: its
    /// reset is when it is full again under a positive capacity, the end of the window.
    pub fn reset_in_us(&self, state: BucketState, now_us: u64) -> Option<u64> {
        match self {
            Plan::Fixed(limit) if limit.rate.is_zero() || limit.capacity_ut == 0 => None,
            Plan::Fixed(_) => self.full_at_us(state).map(|at| at.saturating_sub(now_us)),
            Plan::Scheduled(s) => reopen_at_us(state, s, now_us, DEFAULT_HORIZON_US).map(|at| at - now_us),
            Plan::Quota(q) => q
                .next_edge(now_us, now_us.saturating_add(QUOTA_HORIZON_US))
                .map(|edge| edge - now_us),
            Plan::Expiring(e) => Some(e.full_at_us(e.advance(state, now_us)).saturating_sub(now_us)),
            Plan::Reloaded(r) if !r.predates(state.updated_us) => r.after().reset_in_us(state, now_us),
            Plan::Reloaded(r) if now_us < r.at_us() => r.before().reset_in_us(state, now_us),
            Plan::Reloaded(r) => r.after().reset_in_us(r.at_reload(state), now_us),
        }
    }

    /// The first instant in `(now_us, now_us + horizon_us]` at which the limit may change by
    /// the clock (a schedule window opens or closes, a quota resets, a reload takes effect),
    /// or `None` when there is none within the horizon: a constant limit never changes, and an
    /// expiring allowance's period end depends on its state ([`Plan::full_at_us`] gives it).
    /// What a cache of bucket states must not trust a state beyond (the local over-limit cache).
    pub fn next_change_us(&self, now_us: u64, horizon_us: u64) -> Option<u64> {
        match self {
            Plan::Fixed(_) | Plan::Expiring(_) => None,
            Plan::Scheduled(s) => s.next_limit_change(now_us, horizon_us),
            Plan::Quota(q) => q.next_edge(now_us, now_us.saturating_add(horizon_us)),
            Plan::Reloaded(r) if now_us < r.at_us() => {
                (r.at_us() <= now_us.saturating_add(horizon_us)).then_some(r.at_us())
            }
            Plan::Reloaded(r) => r.after().next_change_us(now_us, horizon_us),
        }
    }

    /// The `w` of the `RateLimit-Policy` header in microseconds: how long the policy in force
    /// at `now_us` takes to give back a whole capacity. For a token bucket the time to fill
    /// from empty at the limit in force; for a quota the current period, from the last reset
    /// edge to the next; for an expiring allowance, `expires`. `None` for a bucket that never
    /// refills, or a period not found within the horizon.
    pub fn window_us(&self, now_us: u64) -> Option<u64> {
        match self {
            Plan::Quota(q) => {
                let next = q.next_edge(now_us, now_us.saturating_add(QUOTA_HORIZON_US))?;
                let prev = q.prev_edge(now_us, now_us.saturating_sub(QUOTA_HORIZON_US))?;
                Some(next - prev)
            }
            Plan::Expiring(e) => Some(e.expires_us()),
            Plan::Reloaded(r) if now_us < r.at_us() => r.before().window_us(now_us),
            Plan::Reloaded(r) => r.after().window_us(now_us),
            _ => self.limit_at(now_us).window_us(),
        }
    }
}

impl Refilling for Plan {
    fn refill_to(&self, state: BucketState, now_us: u64) -> BucketState {
        match self {
            Plan::Fixed(limit) => refill(state, limit, now_us),
            Plan::Scheduled(s) => refill_scheduled(state, s, now_us),
            Plan::Quota(q) => q.advance(state, now_us),
            Plan::Expiring(e) => e.advance(state, now_us),
            Plan::Reloaded(r) if !r.predates(state.updated_us) => r.after().refill_to(state, now_us),
            Plan::Reloaded(r) if now_us < r.at_us() => r.before().refill_to(state, now_us),
            Plan::Reloaded(r) => r.after().refill_to(r.at_reload(state), now_us),
        }
    }

    fn capacity_ut_at(&self, now_us: u64) -> u64 {
        self.limit_at(now_us).capacity_ut
    }
}

/// Plans are equal when they describe the same behaviour: the same limits, the same entries
/// (pattern, timezone, effect) in the same order, the same quota. Two rules that declare one
/// bucket name must agree on it.
impl PartialEq for Plan {
    fn eq(&self, other: &Plan) -> bool {
        match (self, other) {
            (Plan::Fixed(a), Plan::Fixed(b)) => a == b,
            (Plan::Scheduled(a), Plan::Scheduled(b)) => {
                a.base() == b.base()
                    && a.entries().len() == b.entries().len()
                    && a.entries().iter().zip(b.entries()).all(|(x, y)| {
                        x.pattern() == y.pattern() && x.timezone() == y.timezone() && x.effect() == y.effect()
                    })
            }
            (Plan::Quota(a), Plan::Quota(b)) => {
                a.limit() == b.limit() && a.pattern() == b.pattern() && a.timezone() == b.timezone()
            }
            (Plan::Expiring(a), Plan::Expiring(b)) => a == b,
            (Plan::Reloaded(a), Plan::Reloaded(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Plan {}
