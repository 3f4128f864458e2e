//! [`Expiring`]: a fixed allowance that is whole again a set time after its first use (a trial
//! of 100 requests a day from the first one, a grant that renews itself), as `capacity` and
//! `expires` without `refill` declare it (docs/rules.md).
//!
//! The stored state's `updated_us` is the start of the current period, the first use, not the
//! last write: a decision within the period keeps it, so that the expiry is measured from the
//! first use however often the allowance is used. Pure like the rest of
//! [`crate::core::schedule`].

use crate::core::bucket::{BucketState, Limit, Refilling};

/// The longest `expires` rules may declare: 3,660 days (ten years), so that a period's end
/// stays far below 2^53 microseconds, the bound of the Redis script's exact doubles.
pub const MAX_EXPIRES_US: u64 = 3_660 * 86_400 * 1_000_000;

/// A fixed allowance (`limit` with a zero rate) whose spent tokens all come back `expires_us`
/// after the first use of a period.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Expiring {
    limit: Limit,
    expires_us: u64,
}

impl Expiring {
    /// An allowance of `limit.capacity_ut` micro-tokens (the rate is ignored: an allowance
    /// never refills) whole again `expires_us` microseconds (at least 1) after its first use.
    pub fn new(limit: Limit, expires_us: u64) -> Expiring {
        Expiring {
            limit: Limit {
                capacity_ut: limit.capacity_ut,
                rate: crate::core::bucket::Rate::ZERO,
            },
            expires_us: expires_us.max(1),
        }
    }

    /// The allowance as a limit: its capacity and a zero rate.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// Microseconds from a period's first use to the instant the allowance is whole again.
    pub fn expires_us(&self) -> u64 {
        self.expires_us
    }

    /// When the period of a bucket stored as `state` ends: its first use plus `expires`.
    pub fn expiry_us(&self, state: BucketState) -> u64 {
        state.updated_us.saturating_add(self.expires_us)
    }

    /// `state` at `now_us`: whole, with no period yet (`updated_us` now, so that the next use
    /// starts one), once its period has ended or when it is whole anyway (a state a reload
    /// brought forward full); otherwise its tokens trimmed to the capacity, and `updated_us`,
    /// the period's start, kept. A clock that stepped back ends no period and never moves
    /// `updated_us` back.
    pub fn advance(&self, state: BucketState, now_us: u64) -> BucketState {
        if now_us >= self.expiry_us(state) || state.tokens_ut >= self.limit.capacity_ut {
            BucketState::full(&self.limit, now_us.max(state.updated_us))
        } else {
            BucketState {
                tokens_ut: state.tokens_ut.min(self.limit.capacity_ut),
                updated_us: state.updated_us,
            }
        }
    }

    /// Microseconds from `now_us` until the bucket stored as `state` holds `need_ut`: 0 when
    /// it does, the time to the end of its period when it does not, `None` for more than the
    /// capacity (nothing ever admits it).
    pub fn wait_us(&self, state: BucketState, need_ut: u64, now_us: u64) -> Option<u64> {
        if need_ut > self.limit.capacity_ut {
            return None;
        }
        if self.advance(state, now_us).tokens_ut >= need_ut {
            return Some(0);
        }
        Some(self.expiry_us(state).saturating_sub(now_us))
    }

    /// When the bucket stored as `state` is whole again: at once if it is, else at the end of
    /// its period.
    pub fn full_at_us(&self, state: BucketState) -> u64 {
        if state.tokens_ut >= self.limit.capacity_ut {
            state.updated_us
        } else {
            self.expiry_us(state)
        }
    }
}

impl Refilling for Expiring {
    fn refill_to(&self, state: BucketState, now_us: u64) -> BucketState {
        self.advance(state, now_us)
    }

    fn capacity_ut_at(&self, _now_us: u64) -> u64 {
        self.limit.capacity_ut
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bucket::{decide, Demand, DemandKind, Rate, MICRO};

    const DAY: u64 = 86_400 * MICRO;

    fn three_a_day() -> Expiring {
        Expiring::new(Limit::new(3, Rate::ZERO), DAY)
    }

    fn consume(instance: usize) -> Demand {
        Demand {
            instance,
            kind: DemandKind::Consume(MICRO),
            enforced: true,
        }
    }

    /// Three uses spread over the day keep the period's start at the first; the fourth waits
    /// for the end of the day counted from that first use, not from the last.
    #[test]
    fn the_period_runs_from_the_first_use() {
        let a = three_a_day();
        let plans = [a];
        let mut state = BucketState::full(&a.limit(), 1_000);
        for at in [1_000, 5_000 * MICRO, 20_000 * MICRO] {
            let d = decide(at, &[state], &plans, &[consume(0)]);
            assert!(!d.denied, "use at {at}");
            state = d.instances[0].kept();
            assert_eq!(state.updated_us, 1_000, "the first use stays the period's start");
        }
        let now = 30_000 * MICRO;
        let d = decide(now, &[state], &plans, &[consume(0)]);
        assert!(d.denied);
        assert_eq!(a.wait_us(d.instances[0].kept(), MICRO, now), Some(1_000 + DAY - now));
        // One microsecond before the end: still spent; at the end: whole, a new period.
        assert!(decide(1_000 + DAY - 1, &[state], &plans, &[consume(0)]).denied);
        let d = decide(1_000 + DAY, &[state], &plans, &[consume(0)]);
        assert!(!d.denied);
        assert_eq!(
            d.instances[0].after,
            BucketState {
                tokens_ut: 2 * MICRO,
                updated_us: 1_000 + DAY
            }
        );
    }

    #[test]
    fn more_than_the_capacity_never_passes_and_a_whole_allowance_is_full_now() {
        let a = three_a_day();
        let state = BucketState {
            tokens_ut: 0,
            updated_us: 0,
        };
        assert_eq!(a.wait_us(state, 4 * MICRO, 10), None);
        assert_eq!(a.full_at_us(state), DAY);
        let whole = BucketState::full(&a.limit(), 7);
        assert_eq!(a.full_at_us(whole), 7);
        assert_eq!(a.wait_us(whole, 3 * MICRO, 9), Some(0));
    }

    /// A reload never hands back spent tokens: an allowance in use starts a new period at
    /// the reload with the tokens it had; one whose period ended by the reload is whole (the
    /// case a random cross-store sequence found: the old rules made it whole at that instant).
    /// A refilling bucket turned into an allowance keeps what it had earned by the reload.
    #[test]
    fn a_reload_hands_back_nothing_and_ends_no_period_early() {
        use crate::core::schedule::Plan;
        let old = Plan::Expiring(Expiring::new(Limit::new(1, Rate::ZERO), 90 * MICRO));
        let new = Plan::Expiring(Expiring::new(Limit::new(2, Rate::ZERO), 3_600 * MICRO));
        let spent = BucketState {
            tokens_ut: 0,
            updated_us: 0,
        };
        // In use at the reload (50 s): spent, and a new hour-long period from the reload.
        let plan = Plan::after_reload(&old, new.clone(), 50 * MICRO);
        assert_eq!(
            plan.refill_to(spent, 60 * MICRO),
            BucketState {
                tokens_ut: 0,
                updated_us: 50 * MICRO
            }
        );
        assert_eq!(plan.wait_us(spent, MICRO, 60 * MICRO), Some(3_590 * MICRO));
        // The old period ended at 90 s, the instant of the reload: whole under the new rules.
        let plan = Plan::after_reload(&old, new, 90 * MICRO);
        assert_eq!(plan.refill_to(spent, 90 * MICRO).tokens_ut, 2 * MICRO);

        let hourly = Plan::Fixed(Limit::new(3, Rate::per(3, 3_600 * MICRO).unwrap()));
        let plan = Plan::after_reload(&hourly, old, 1_200 * MICRO);
        // 1,200 s at 3 an hour earned one token before the reload: the allowance of one is
        // whole, with no period until its next use.
        let after = plan.refill_to(spent, 1_250 * MICRO);
        assert_eq!(
            after,
            BucketState {
                tokens_ut: MICRO,
                updated_us: 1_250 * MICRO
            }
        );
        assert_eq!(plan.wait_us(after, MICRO, 1_250 * MICRO), Some(0));
        assert_eq!(
            plan.wait_us(after, 2 * MICRO, 1_250 * MICRO),
            None,
            "more than the allowance"
        );
    }

    /// A whole allowance has no period: the use that takes from it starts one, even if its
    /// stored state is older (a reload brings a full bucket forward to the reload's instant).
    #[test]
    fn the_first_use_of_a_whole_allowance_starts_the_period() {
        let a = three_a_day();
        let whole = BucketState {
            tokens_ut: 3 * MICRO,
            updated_us: 1_000,
        };
        let d = decide(5_000, &[whole], &[a], &[consume(0)]);
        assert_eq!(
            d.instances[0].after,
            BucketState {
                tokens_ut: 2 * MICRO,
                updated_us: 5_000
            }
        );
    }

    #[test]
    fn a_clock_stepping_back_ends_no_period() {
        let a = three_a_day();
        let state = BucketState {
            tokens_ut: 0,
            updated_us: 2 * DAY,
        };
        assert_eq!(
            a.advance(state, DAY),
            BucketState {
                tokens_ut: 0,
                updated_us: 2 * DAY
            }
        );
        assert_eq!(a.wait_us(state, MICRO, DAY), Some(2 * DAY));
    }
}
