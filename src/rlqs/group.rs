//! One global bucket's Envoys on this replica: what each reported, holds and is owed. Pure:
//! time comes in as arguments.

use std::hash::Hash;

use indexmap::IndexMap;

use super::plan::{self, fair_split, GroupPlan, Held, Terms};
use crate::core::bucket::{Limit, MICRO};

/// A bucket that does not refill (a calendar quota, a fixed allowance) is handed out as if it
/// refilled its capacity over this long, in microseconds: in slices, each paid for before it
/// is sent, so an Envoy never holds much of an allowance another Envoy could use.
pub const NO_REFILL_SLICE_US: u64 = 10_000_000;

/// Of the refill the shares split, this much is left unassigned: a share keeps its bucket
/// while within 2% above its target, and the refill is split again only once a period.
pub const HEADROOM_PERCENT: u64 = 5;

/// What others take is measured over windows this long (microseconds): long enough that
/// another replica's new shares, paid ahead and partly given back, do not swing the split.
pub const OTHERS_WINDOW_US: u64 = 1_500_000;

/// The other replicas' demand is averaged over about this long (microseconds): readings are
/// weighted by `e^(-age / METER_WINDOW_US)`, so the first reading counts at once (a replica
/// that joins is split with within a period or two) and later ones smooth the noise of when
/// each replica's additions land; Envoys report their demand only every 5 s anyway.
pub const METER_WINDOW_US: u64 = 5_000_000;

/// The first estimate of the other replicas' demand waits until the meter's readings span this
/// long (microseconds): a reading a millisecond after the last (a cut's second store call) holds
/// one addition of another replica's or none, and would read as hundreds of times its demand, or
/// as no other replica at all.
pub const METER_FIRST_SPAN_US: u64 = 200_000;

/// The demand meter: a second bucket per global bucket, with no refill, from which every
/// replica takes its Envoys' demand each round, so that each can read the others' (the meter's
/// fall between its own calls). Demand is measured in the global bucket's refill: a replica
/// whose Envoys ask for the whole refill takes one micro-token a microsecond (one token a
/// second). So a reload that changes the refill changes every replica's reading at once, not
/// only after the old readings have aged out of the average.
pub const METER_UT_PER_REFILL_SECOND: u64 = MICRO;

/// The demand meter's capacity, in tokens: nine billion requests' worth. A replica that
/// finds it under a tenth full fills it again.
pub const METER_CAPACITY: u64 = crate::core::bucket::MAX_CAPACITY;

/// A share's demand estimate never falls under this fraction of an equal share: an Envoy that
/// was idle for a report still gets a bucket to start again with.
const FLOOR_DIVISOR: u64 = 10;

/// One Envoy's share of the bucket.
#[derive(Clone, Debug, Default)]
pub struct Share {
    /// What it holds.
    pub held: Held,
    /// Requests it saw (allowed + denied) per second, in micro-tokens a second, smoothed over
    /// reports; `None` before a report that covers some time.
    pub demand_ut_per_s: Option<u64>,
    /// When it last reported (tollgate's clock, microseconds).
    pub last_report_us: u64,
    /// When it last reported a request, or was first seen.
    pub last_use_us: u64,
    /// Its latest report over some time counted denied requests, and that report's window
    /// began after its last new bucket was sent: the bucket it runs ran dry, so it holds next
    /// to nothing and would use more ([`plan::top_up`] tops such buckets up).
    pub starved: bool,
    /// When it was last sent a new bucket (tollgate's clock, microseconds).
    pub fresh_at_us: u64,
}

/// The Envoys of one global bucket on this replica, keyed by `K` (a stream and its bucket id).
#[derive(Debug)]
pub struct Group<K> {
    shares: IndexMap<K, Share>,
    /// No store call before this instant (the bucket was found spent; microseconds).
    pub blocked_until_us: u64,
    /// The global bucket's tokens as the latest store answer left them (micro-tokens) and
    /// when; `None` before one (counted as full).
    pool: Option<(u64, u64)>,
    /// What others (RLS clients, other replicas) take from the global bucket, in micro-tokens
    /// a second (negative while they give back more than they take): the refill the shares
    /// here do not split.
    others_ut_per_s: i128,
    /// Since when (microseconds) and how much (micro-tokens) others took in the window being
    /// summed.
    others_window: (u64, i128),
    /// The demand meter ([`METER_UT_PER_REFILL_SECOND`]): its level after this replica's latest call
    /// and when that was, when this replica last added its demand to it, and what others added
    /// (meter micro-tokens) over how long (microseconds), both decayed by age
    /// ([`METER_WINDOW_US`]).
    meter_after: Option<(u64, u64)>,
    meter_at_us: Option<u64>,
    meter_sums: (f64, f64),
    /// What the other replicas' Envoys of this bucket ask for, in refills (1.0: the whole
    /// refill).
    others_refills: f64,
    /// Before a reading of the meter: the first store answer found the global bucket in use
    /// (under its capacity), so another replica may be splitting it too, and is counted as
    /// asking as much as this one ([`Group::split_ut_per_s`]).
    others_assumed: bool,
}

impl<K> Default for Group<K> {
    fn default() -> Self {
        Group {
            shares: IndexMap::new(),
            blocked_until_us: 0,
            pool: None,
            others_ut_per_s: 0,
            others_window: (0, 0),
            meter_after: None,
            meter_at_us: None,
            meter_sums: (0.0, 0.0),
            others_refills: 0.0,
            others_assumed: false,
        }
    }
}

impl<K: Hash + Eq + Clone> Group<K> {
    /// Records a usage report of `allowed` + `denied` requests over `elapsed_us` (0 for Envoy's
    /// first report of a bucket) at `now_us`. Returns whether the share is to be assigned as
    /// new: unknown here, or reported with no time elapsed, which Envoy does for a bucket it
    /// has just created (after an `abandon_action`, or an expiry): whatever this replica last
    /// sent, that Envoy holds nothing now, so its next bucket is paid for in full.
    pub fn report(&mut self, key: &K, allowed: u64, denied: u64, elapsed_us: u64, now_us: u64) -> bool {
        let mut new = !self.shares.contains_key(key);
        if elapsed_us == 0 {
            if let Some(share) = self.shares.get_mut(key) {
                share.held = Held::Nothing;
                new = true;
            }
        }
        let share = self.shares.entry(key.clone()).or_insert_with(|| Share {
            last_use_us: now_us,
            ..Share::default()
        });
        let seen = allowed.saturating_add(denied);
        if seen > 0 {
            share.last_use_us = now_us;
        }
        if elapsed_us > 0 {
            let rate = (u128::from(seen) * u128::from(MICRO) * u128::from(MICRO) / u128::from(elapsed_us))
                .min(u128::from(u64::MAX)) as u64;
            share.demand_ut_per_s = Some(match share.demand_ut_per_s {
                Some(old) => old / 2 + rate / 2,
                None => rate,
            });
            share.starved = denied > 0 && now_us.saturating_sub(elapsed_us) >= share.fresh_at_us;
        }
        share.last_report_us = now_us;
        new
    }

    /// Forgets a share (its stream ended, or it was abandoned). What it was paid for stays
    /// taken: its Envoy may spend it until its assignment expires.
    pub fn remove(&mut self, key: &K) -> Option<Share> {
        self.shares.shift_remove(key)
    }

    /// The shares, in the order plans list them.
    pub fn shares(&self) -> impl Iterator<Item = (&K, &Share)> {
        self.shares.iter()
    }

    /// How many shares.
    pub fn len(&self) -> usize {
        self.shares.len()
    }

    /// Whether no Envoy holds a share.
    pub fn is_empty(&self) -> bool {
        self.shares.is_empty()
    }

    /// The shares not used (no request reported) since `since_us`.
    pub fn idle_since(&self, since_us: u64) -> Vec<K> {
        self.shares
            .iter()
            .filter(|(_, s)| s.last_use_us < since_us)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Target rates, in micro-tokens a second: `total` split max-min fairly over the shares'
    /// demands, a share not yet measured counted as wanting an equal part, none under a tenth
    /// of one.
    pub fn targets(&self, total_ut_per_s: u64) -> Vec<u64> {
        let n = self.shares.len().max(1) as u64;
        let equal = total_ut_per_s / n;
        let floor = equal / FLOOR_DIVISOR;
        let demands: Vec<u64> = self
            .shares
            .values()
            .map(|s| s.demand_ut_per_s.unwrap_or(equal).max(floor))
            .collect();
        fair_split(total_ut_per_s, &demands)
    }

    /// Records a store answer at `at_us`: the global bucket held `before_ut` before this
    /// replica's call and `after_ut` after it. What it lacked against the previous answer
    /// brought forward by `limit`'s refill, others took; what it had beyond, others gave back
    /// (another replica's shares replaced). Both are summed over [`OTHERS_WINDOW_US`], so that
    /// another replica's paying ahead for a new share and its giving back the unused part
    /// cancel out: what remains is what the others spend.
    pub fn saw_tokens(&mut self, before_ut: u64, after_ut: u64, at_us: u64, limit: &Limit) {
        if self.pool.is_some() {
            let expected = i128::from(self.pool_ut(limit, at_us));
            self.others_window.1 += expected - i128::from(before_ut);
            let span = at_us.saturating_sub(self.others_window.0);
            if span >= OTHERS_WINDOW_US {
                self.others_ut_per_s = self.others_window.1 * i128::from(MICRO) / i128::from(span);
                self.others_window = (at_us, 0);
            }
        } else {
            self.others_window = (at_us, 0);
            self.others_assumed = self.meter_sums.1 == 0.0 && before_ut < limit.capacity_ut;
        }
        self.pool = Some((after_ut, at_us));
    }

    /// What this replica's Envoys of the bucket ask for, in micro-tokens a second: their
    /// demands as [`Group::targets`] counts them, each at most the whole refill.
    pub fn demand_ut_per_s(&self, limit: &Limit) -> u64 {
        let refill = split_rate_ut_per_s(limit);
        let n = self.shares.len().max(1) as u64;
        self.shares
            .values()
            .map(|s| s.demand_ut_per_s.unwrap_or(refill / n).min(refill))
            .fold(0u64, u64::saturating_add)
    }

    /// Micro-tokens to take from the demand meter for this replica's demand since it last
    /// did, at `now_us` (0 the first time).
    pub fn meter_take_ut(&mut self, limit: &Limit, now_us: u64) -> u64 {
        let since = self.meter_at_us.replace(now_us).unwrap_or(now_us);
        let refill = split_rate_ut_per_s(limit).max(1);
        // Refills asked for, times the microseconds since, times METER_UT_PER_REFILL_SECOND
        // over a second's microseconds (1).
        (u128::from(self.demand_ut_per_s(limit)) * u128::from(now_us.saturating_sub(since)) / u128::from(refill))
            .min(u128::from(u64::MAX)) as u64
    }

    /// Whether the demand meter, as last seen, is under a tenth full: then this replica fills
    /// it again rather than take from it.
    pub fn meter_low(&self) -> bool {
        self.meter_after.is_some_and(|(m, _)| m < METER_CAPACITY / 10 * MICRO)
    }

    /// Records the demand meter's level before and after this replica's call at `at_us`: what
    /// it lost meanwhile beyond this replica's own takes, the other replicas' Envoys asked for.
    pub fn saw_meter(&mut self, before_ut: u64, after_ut: u64, at_us: u64) {
        if let Some((last, seen_us)) = self.meter_after {
            let span = at_us.saturating_sub(seen_us) as f64;
            let decay = (-span / METER_WINDOW_US as f64).exp();
            // A refill by another replica reads as a negative demand: counted as none.
            let added = last.saturating_sub(before_ut) as f64;
            let (sum, time) = self.meter_sums;
            self.meter_sums = (sum * decay + added, time * decay + span);
            if self.meter_sums.1 >= METER_FIRST_SPAN_US as f64 {
                self.others_assumed = false;
                // Meter micro-tokens a microsecond, as refills.
                self.others_refills =
                    self.meter_sums.0 / self.meter_sums.1 * (MICRO as f64 / METER_UT_PER_REFILL_SECOND as f64);
            }
        }
        self.meter_after = Some((after_ut, at_us));
    }

    /// The refill the shares here split, in micro-tokens a second: `limit`'s
    /// ([`split_rate_ut_per_s`]) less what others take, less a margin of [`HEADROOM_PERCENT`]
    /// so that shares kept near their targets do not overdraw it.
    pub fn split_ut_per_s(&self, limit: &Limit) -> u64 {
        self.mine_ut_per_s(limit) / 100 * (100 - HEADROOM_PERCENT)
    }

    /// This replica's part of the refill, in micro-tokens a second, before the headroom
    /// ([`Group::split_ut_per_s`]): the rest is what the others are counted on.
    fn mine_ut_per_s(&self, limit: &Limit) -> u64 {
        let refill = split_rate_ut_per_s(limit);
        let mine = self.demand_ut_per_s(limit);
        // Other replicas' Envoys want some too: this replica's part of the demand (offered
        // load, which does not move with what each replica takes, so the replicas do not chase
        // each other's takes). Alone, the refill that others (RLS clients) leave.
        let others = if self.others_assumed {
            mine
        } else {
            (self.others_refills * refill as f64).min(u64::MAX as f64) as u64
        };
        if others > 0 && mine > 0 {
            let all = u128::from(mine) + u128::from(others);
            (u128::from(refill) * u128::from(mine) / all) as u64
        } else {
            refill.saturating_sub(u64::try_from(self.others_ut_per_s.max(0)).unwrap_or(u64::MAX))
        }
    }

    /// The global bucket's tokens at `now_us` as far as this replica knows: the latest answer
    /// brought forward by `limit`'s refill (others may have taken some: an estimate, which the
    /// store corrects by denying), or full before any.
    pub fn pool_ut(&self, limit: &Limit, now_us: u64) -> u64 {
        match self.pool {
            None => limit.capacity_ut,
            Some((tokens, at)) => {
                crate::core::bucket::refill(
                    crate::core::bucket::BucketState {
                        tokens_ut: tokens,
                        updated_us: at,
                    },
                    limit,
                    now_us,
                )
                .tokens_ut
            }
        }
    }

    /// The global bucket's tokens at `now_us` less what others (RLS clients, other replicas)
    /// have taken since the latest answer at the rate they were last seen taking: what a plan
    /// counts on, so that two replicas topping up their Envoys do not both count on the same
    /// tokens (when they do, the store denies one and it cuts its plan).
    pub fn pool_left_ut(&self, limit: &Limit, now_us: u64) -> u64 {
        let pool = self.pool_ut(limit, now_us);
        let Some((_, at)) = self.pool else { return pool };
        let others = u128::try_from(self.others_ut_per_s.max(0)).unwrap_or(0);
        let taken = others * u128::from(now_us.saturating_sub(at)) / u128::from(MICRO);
        pool.saturating_sub(u64::try_from(taken).unwrap_or(u64::MAX))
    }

    /// The next assignments under `limit` (the global bucket's, in force now); cut to
    /// `budget_ut` when given ([`plan::plan`]); with `only`, of those shares alone (the others
    /// [`plan::Action::Unchanged`]). Without a budget, planned on what the global bucket is
    /// thought to hold ([`Group::pool_left_ut`]), and starved shares are topped up within
    /// [`Group::room_ut`] ([`plan::top_up`]), unless the others take well under their part.
    pub fn plan(
        &self,
        limit: &Limit,
        now_us: u64,
        terms: &Terms,
        budget_ut: Option<u64>,
        only: Option<&[K]>,
    ) -> GroupPlan {
        let held: Vec<Held> = self.shares.values().map(|s| s.held).collect();
        let targets = self.targets(self.split_ut_per_s(limit));
        let pool = budget_ut.unwrap_or_else(|| self.pool_left_ut(limit, now_us));
        let keys: Vec<&K> = self.shares.keys().collect();
        let selected = |i: usize| only.is_none_or(|o| o.contains(keys[i]));
        let p = plan::plan(
            &held,
            &targets,
            pool,
            limit.capacity_ut,
            now_us,
            terms,
            budget_ut,
            &selected,
        );
        if budget_ut.is_some() {
            return p;
        }
        // Not while the others take well under the refill they are counted on: their shares
        // were cut (by a lump of this replica's, or the store), and their raises back need the
        // stock a top-up would take.
        let others = split_rate_ut_per_s(limit).saturating_sub(self.mine_ut_per_s(limit));
        // (Under three quarters: a replica's shares run down to 90% of targets that leave 5%.)
        let others_short = (self.others_ut_per_s.max(0) as u128) * 4 < u128::from(others) * 3;
        let hungry: Vec<bool> = self
            .shares
            .values()
            .enumerate()
            .map(|(i, s)| s.starved && selected(i) && !others_short)
            .collect();
        plan::top_up(
            p,
            &held,
            &targets,
            &hungry,
            self.room_ut(limit, now_us, terms),
            limit.capacity_ut,
            now_us,
            terms,
        )
    }

    /// What a plan with lumps must leave in the global bucket, in micro-tokens: a period of
    /// the refill the others (other replicas, RLS clients) are counted on, which their
    /// renewals may need before this replica's next round.
    pub fn reserve_ut(&self, limit: &Limit, terms: &Terms) -> u64 {
        let others = split_rate_ut_per_s(limit).saturating_sub(self.mine_ut_per_s(limit));
        (u128::from(others) * u128::from(terms.period_us) / u128::from(MICRO)) as u64
    }

    /// What this replica can count on taking from the global bucket at `now_us`, in
    /// micro-tokens: [`Group::pool_left_ut`] less [`Group::reserve_ut`].
    pub fn room_ut(&self, limit: &Limit, now_us: u64, terms: &Terms) -> u64 {
        self.pool_left_ut(limit, now_us)
            .saturating_sub(self.reserve_ut(limit, terms))
    }

    /// `DENY_ALL` to every share (with `only`, to those alone).
    pub fn deny_all(&self, now_us: u64, terms: &Terms, only: Option<&[K]>) -> GroupPlan {
        let held: Vec<Held> = self.shares.values().map(|s| s.held).collect();
        let keys: Vec<&K> = self.shares.keys().collect();
        plan::deny_all(&held, now_us, terms).only(&held, |i| only.is_none_or(|o| o.contains(keys[i])))
    }

    /// Records what a plan's store call paid for: each share now holds what it was sent.
    ///
    /// # Panics
    /// When the plan was made for a different number of shares (plans are made and committed
    /// under the same lock).
    pub fn commit(&mut self, plan: &GroupPlan) {
        assert_eq!(
            plan.shares.len(),
            self.shares.len(),
            "a plan is committed to the group it was made for"
        );
        for (share, assigned) in self.shares.values_mut().zip(&plan.shares) {
            share.held = assigned.held;
            // A new bucket starts full: starved again only when a report of its own says so.
            if assigned.fresh {
                share.starved = false;
                if let Held::Bucket { sent_us, .. } = assigned.held {
                    share.fresh_at_us = sent_us;
                }
            }
        }
    }

    /// Micro-tokens the shares' Envoys may still admit on what was paid for, at `now_us` at
    /// most: each running bucket's burst plus its refill paid for beyond now.
    pub fn outstanding_ut(&self, now_us: u64) -> u64 {
        self.shares
            .values()
            .map(|s| match s.held {
                Held::Bucket {
                    shape, paid_until_us, ..
                } if paid_until_us > now_us => shape.burst_ut().saturating_add(shape.refill_ut(paid_until_us - now_us)),
                _ => 0,
            })
            .fold(0u64, u64::saturating_add)
    }
}

/// The refill a bucket's shares split, in micro-tokens a second: its rate, or for a bucket that
/// does not refill, its capacity over [`NO_REFILL_SLICE_US`].
pub fn split_rate_ut_per_s(limit: &Limit) -> u64 {
    let rate = limit.rate;
    if rate.is_zero() {
        return (u128::from(limit.capacity_ut) * u128::from(MICRO) / u128::from(NO_REFILL_SLICE_US)) as u64;
    }
    (u128::from(rate.num()) * u128::from(MICRO) / u128::from(rate.den())).min(u128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bucket::Rate;

    #[test]
    fn demand_follows_reports_and_a_new_share_counts_as_an_equal_part() {
        let mut g: Group<u32> = Group::default();
        assert!(g.report(&1, 1, 0, 0, 0));
        assert!(g.report(&2, 0, 0, 0, 0));
        assert!(!g.report(&1, 50, 50, 5_000_000, 5_000_000));
        // 100 requests over 5 s: 20 a second.
        assert_eq!(g.shares[&1].demand_ut_per_s, Some(20 * MICRO));
        // 10 a second in all: share 2, unmeasured, counts as wanting 5; 1 wants 20.
        assert_eq!(g.targets(10 * MICRO), vec![5 * MICRO, 5 * MICRO]);
        g.report(&2, 5, 0, 5_000_000, 5_000_000);
        assert_eq!(g.targets(10 * MICRO), vec![9 * MICRO, MICRO]);
        // An idle share keeps a floor.
        g.report(&2, 0, 0, 5_000_000, 10_000_000);
        g.report(&2, 0, 0, 5_000_000, 15_000_000);
        let t = g.targets(10 * MICRO);
        assert!(t[1] >= MICRO / 2, "{t:?}");
        g.report(&1, 3, 0, 5_000_000, 15_000_000);
        assert_eq!(g.idle_since(11_000_000), vec![2]);
    }

    const TERMS: Terms = Terms {
        ttl_us: 1_000_000,
        margin_us: 250_000,
        period_us: 500_000,
    };

    #[test]
    fn the_meter_takes_fractions_of_a_request() {
        // One share, unmeasured, so wanting the whole refill: 10 a second.
        let limit = Limit::new(40, Rate::per(10, 1_000_000).unwrap());
        let mut g: Group<u32> = Group::default();
        g.report(&1, 0, 1, 0, 0);
        assert_eq!(g.meter_take_ut(&limit, 1_000_000), 0);
        // 0.4999 s of the whole refill: 0.4999 of a refill-second, not 0.4 (whole requests,
        // as the meter once counted, dropped up to a fifth of this replica's demand).
        assert_eq!(
            g.meter_take_ut(&limit, 1_499_900),
            499_900 * METER_UT_PER_REFILL_SECOND / MICRO
        );
    }

    #[test]
    fn the_others_demand_is_read_from_the_first_fall_of_the_meter_and_smoothed() {
        let limit = Limit::new(40, Rate::per(10, 1_000_000).unwrap());
        let mut g: Group<u32> = Group::default();
        g.report(&1, 0, 1, 0, 0);
        let full = METER_CAPACITY * MICRO;
        // The first answer: the global bucket already in use, the meter not yet read. Another
        // replica may be there, counted as asking as much as this one: half the refill.
        g.saw_meter(full, full, 0);
        g.saw_tokens(30 * MICRO, 20 * MICRO, 0, &limit);
        assert_eq!(g.mine_ut_per_s(&limit), 5 * MICRO);
        assert_eq!(g.reserve_ut(&limit, &TERMS), 2_500_000);
        // A reading a millisecond later (a cut's second call) is too short to go by: a tenth of
        // a refill-second added meanwhile is not a hundred refills.
        g.saw_meter(full - 100_000, full - 100_000, 1_000);
        assert_eq!((g.others_refills, g.mine_ut_per_s(&limit)), (0.0, 5 * MICRO));
        let full = full - 100_000;
        // Half a second later the meter fell by a quarter of a refill-second (another replica
        // asking for half the refill): read at once, with the first millisecond's tenth
        // (weighed a little less): about 0.68 of a refill.
        let after = full - 250_000 * METER_UT_PER_REFILL_SECOND / MICRO;
        g.saw_meter(after, after, 500_000);
        assert!((0.65..0.7).contains(&g.others_refills), "{}", g.others_refills);
        // This replica asks 10, the other about 7: about 59% of the refill here.
        assert!((5_850_000..6_100_000).contains(&g.mine_ut_per_s(&limit)));
        // A reload to a tenth of the refill: both replicas' demands are read in the new
        // refill at once (this one asks for all of it, the other for 0.68 of it).
        let reloaded = Limit::new(4, Rate::per(1, 1_000_000).unwrap());
        assert!((585_000..610_000).contains(&g.mine_ut_per_s(&reloaded)));
        // Then nothing for half a second: the estimate falls, smoothly (not to 0).
        g.saw_meter(after, after, 1_000_000);
        assert!((0.2..0.6).contains(&g.others_refills), "{}", g.others_refills);
        // Alone from the first answer (a full bucket): the whole refill.
        let mut alone: Group<u32> = Group::default();
        alone.report(&1, 0, 1, 0, 0);
        alone.saw_meter(full, full, 0);
        alone.saw_tokens(40 * MICRO, 20 * MICRO, 0, &limit);
        assert_eq!(alone.mine_ut_per_s(&limit), 10 * MICRO);
        assert_eq!(alone.reserve_ut(&limit, &TERMS), 0);
    }

    #[test]
    fn a_share_is_starved_from_a_report_of_denials_until_it_is_sent_a_new_bucket() {
        let limit = Limit::new(40, Rate::per(10, 1_000_000).unwrap());
        let mut g: Group<u32> = Group::default();
        // The global bucket full at the first answer: no other replica assumed.
        g.saw_tokens(40 * MICRO, 40 * MICRO, 0, &limit);
        g.report(&1, 0, 1, 0, 0);
        // The first report (no time elapsed) says nothing of a bucket running dry.
        assert!(!g.shares[&1].starved);
        let p = g.plan(&limit, 0, &TERMS, None, None);
        assert!(p.shares[0].fresh);
        g.commit(&p);
        // Denials over the half second since: its bucket ran dry.
        g.report(&1, 20, 30, 500_000, 500_000);
        assert!(g.shares[&1].starved);
        // The global bucket (full at the last answer) holds more than the renewal: a top-up,
        // a new bucket, which starts full.
        let p = g.plan(&limit, 500_000, &TERMS, None, None);
        assert!(p.shares[0].fresh, "{p:?}");
        g.commit(&p);
        assert!(!g.shares[&1].starved);
        // A report whose window began before that new bucket does not say it ran dry.
        g.report(&1, 20, 30, 500_000, 900_000);
        assert!(!g.shares[&1].starved);
        // One that began after it does; with nothing left in the global bucket, a renewal,
        // and the share stays starved.
        g.report(&1, 20, 30, 400_000, 1_000_000);
        assert!(g.shares[&1].starved);
        g.saw_tokens(0, 0, 1_000_000, &limit);
        let p = g.plan(&limit, 1_000_000, &TERMS, None, None);
        assert!(!p.shares[0].fresh && p.shares[0].take_ut > 0, "{p:?}");
        g.commit(&p);
        assert!(g.shares[&1].starved);
    }

    #[test]
    fn a_bucket_without_refill_is_split_in_slices_of_its_capacity() {
        let quota = Limit::new(100, Rate::ZERO);
        assert_eq!(split_rate_ut_per_s(&quota), 10 * MICRO);
        let per_second = Limit::new(5, Rate::per(3, 2_000_000).unwrap());
        assert_eq!(split_rate_ut_per_s(&per_second), 1_500_000);
    }
}
