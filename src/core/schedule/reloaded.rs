//! [`Reloaded`]: a bucket policy whose limit a reload replaced. A reload changes a rate from the
//! reload on: the time a bucket spent before it counts under the rules in force then, the time
//! after it under the new ones (docs/operations.md, "Reloading rules"). Raising a refill rate
//! grants nothing for the time before the reload; lowering it takes away nothing already earned.
//!
//! Pure like the rest of [`crate::core::schedule`]: the reload instant is data, not a clock read.

use crate::core::bucket::BucketState;

use super::Plan;

/// How many reloads of one bucket policy are remembered. A bucket idle across more reloads
/// that each changed its limit, with none of those limits having had time to fill it, is
/// brought forward from the oldest remembered reload as if the limit then in force had held
/// since its write: the only approximation, and only for such a bucket.
pub const MAX_RELOADS_REMEMBERED: usize = 8;

/// A plan replaced at `at_us`: `before` up to that instant, `after` from it.
///
/// `after` is always a plan as the rules file compiled it (never itself a [`Reloaded`]);
/// `before` may be one, so a chain of reloads is a chain of these, newest outermost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reloaded {
    before: Plan,
    at_us: u64,
    after: Plan,
}

impl Reloaded {
    /// `before` replaced by `after` at `at_us` (microseconds since the epoch, by the clock of
    /// the store that keeps the buckets).
    pub fn new(before: Plan, at_us: u64, after: Plan) -> Reloaded {
        Reloaded { before, at_us, after }
    }

    /// The plan in force before the reload (itself possibly [`Plan::Reloaded`]).
    pub fn before(&self) -> &Plan {
        &self.before
    }

    /// The instant of the reload, in microseconds since the epoch.
    pub fn at_us(&self) -> u64 {
        self.at_us
    }

    /// The plan in force from the reload on, as compiled from the rules file.
    pub fn after(&self) -> &Plan {
        &self.after
    }

    /// A bucket stored as `state` (written before the reload) as it stands at the reload:
    /// brought forward under `before`; a bucket full then is full under `after` too, at the
    /// capacity in force from the reload (a full bucket is the same as no bucket, and a store
    /// may have forgotten it), exactly as a change of limit in a schedule treats it.
    ///
    /// The state is as of the reload (or its write, if later) in every case. An expiring
    /// allowance's `updated_us` is the start of its period, not its last write: kept, it would
    /// let the new rules count time before the reload, and leave the state looking older than
    /// the reload after every later write. So an allowance in use across a reload starts a new
    /// period at the reload, with the tokens it had; one whose period ended by then is whole.
    pub fn at_reload(&self, state: BucketState) -> BucketState {
        use crate::core::bucket::Refilling;
        let s = self.before.refill_to(state, self.at_us);
        let updated_us = s.updated_us.max(self.at_us);
        let tokens_ut = if s.tokens_ut >= self.before.capacity_ut_at(self.at_us) {
            self.after.capacity_ut_at(self.at_us)
        } else {
            s.tokens_ut
        };
        BucketState { tokens_ut, updated_us }
    }

    /// Whether a state written at `updated_us` lies before the reload, so that `before` still
    /// has a say in it.
    pub fn predates(&self, updated_us: u64) -> bool {
        updated_us < self.at_us
    }
}

impl Plan {
    /// The plan the rules in force compiled: `self`, or for [`Plan::Reloaded`] its `after`.
    pub fn current(&self) -> &Plan {
        match self {
            Plan::Reloaded(r) => r.after(),
            plan => plan,
        }
    }

    /// The plan of a bucket policy whose rules were `old` (as in force, with their history)
    /// and are `new` (as just compiled) from `at_us` on: `old` itself when the new rules
    /// describe the same behaviour (so history is kept, and a reload that changes nothing
    /// changes no plan); else a [`Reloaded`] from `old` to `new`, keeping of `old`'s history
    /// only what can still matter at `at_us` and at most [`MAX_RELOADS_REMEMBERED`] reloads.
    pub fn after_reload(old: &Plan, new: Plan, at_us: u64) -> Plan {
        if *old.current() == new {
            return old.clone();
        }
        let before = old.pruned(at_us).capped(MAX_RELOADS_REMEMBERED - 1);
        Plan::Reloaded(std::sync::Arc::new(Reloaded::new(before, at_us, new)))
    }

    /// Drops the history of a chain that cannot matter to a bucket brought forward to an
    /// instant at or after `until_us`: everything before a reload whose `after` refills an
    /// empty bucket before the next reload (or `until_us`), since every bucket written
    /// earlier is full by then whatever it held.
    fn pruned(&self, until_us: u64) -> Plan {
        let Plan::Reloaded(r) = self else {
            return self.clone();
        };
        let empty = BucketState {
            tokens_ut: 0,
            updated_us: r.at_us,
        };
        if r.after.full_at_us(empty).is_some_and(|full| full <= until_us) {
            return r.after.clone();
        }
        let before = r.before.pruned(r.at_us);
        Plan::Reloaded(std::sync::Arc::new(Reloaded::new(before, r.at_us, r.after.clone())))
    }

    /// The chain with at most `reloads` reloads: the oldest beyond them are forgotten (the
    /// limit in force after the oldest kept one stands in for every earlier one).
    fn capped(&self, reloads: usize) -> Plan {
        match self {
            Plan::Reloaded(r) if reloads == 0 => r.after.clone(),
            Plan::Reloaded(r) => Plan::Reloaded(std::sync::Arc::new(Reloaded::new(
                r.before.capped(reloads - 1),
                r.at_us,
                r.after.clone(),
            ))),
            plan => plan.clone(),
        }
    }

    /// How many reloads this plan remembers.
    pub fn reloads_remembered(&self) -> usize {
        match self {
            Plan::Reloaded(r) => 1 + r.before.reloads_remembered(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests;
