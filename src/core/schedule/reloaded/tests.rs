//! Reloads against a naive reference model that applies each rule set over its own interval:
//! tokens as exact integers (rates of whole micro-tokens per microsecond, so no flooring), the
//! old limit up to the reload, the new one from it, a bucket full at the reload full under the
//! new limit.

use proptest::prelude::*;

use super::*;
use crate::core::bucket::{Limit, Rate, Refilling, MICRO};

const SEC: u64 = 1_000_000;

fn fixed(capacity: u64, per_second: u64) -> Plan {
    Plan::Fixed(Limit::new(capacity, Rate::per(per_second, SEC).unwrap()))
}

/// The model: one limit at a time, switched at each reload.
struct Reference {
    tokens_ut: u64,
    at_us: u64,
    capacity_ut: u64,
    /// Micro-tokens per microsecond.
    rate: u64,
}

impl Reference {
    fn advance(&mut self, t: u64) {
        let earned = self.rate.saturating_mul(t.saturating_sub(self.at_us));
        self.tokens_ut = self.tokens_ut.saturating_add(earned).min(self.capacity_ut);
        self.at_us = self.at_us.max(t);
    }

    fn reload(&mut self, t: u64, capacity: u64, per_second: u64) {
        self.advance(t);
        let capacity_ut = capacity * MICRO;
        self.tokens_ut = if self.tokens_ut >= self.capacity_ut {
            capacity_ut
        } else {
            self.tokens_ut.min(capacity_ut)
        };
        self.capacity_ut = capacity_ut;
        self.rate = per_second;
    }

    fn consume(&mut self, t: u64, n: u64) -> bool {
        self.advance(t);
        let ok = self.tokens_ut >= n * MICRO;
        if ok {
            self.tokens_ut -= n * MICRO;
        }
        ok
    }
}

/// A bucket as a store keeps it: absent when full (or, with `forget`, once its full time by
/// the plan in force has passed, as the memory store's sweep and Redis's expiry do).
struct Stored {
    plan: Plan,
    state: Option<BucketState>,
    forget: bool,
}

impl Stored {
    fn read(&mut self, t: u64) -> BucketState {
        if self.forget {
            if let Some(s) = self.state {
                if self.plan.full_at_us(s).is_some_and(|full| full <= t) {
                    self.state = None;
                }
            }
        }
        let s = self.state.unwrap_or(BucketState {
            tokens_ut: self.plan.capacity_ut_at(t),
            updated_us: t,
        });
        self.plan.refill_to(s, t)
    }

    fn consume(&mut self, t: u64, n: u64) -> bool {
        let mut s = self.read(t);
        let ok = s.tokens_ut >= n * MICRO;
        if ok {
            s.tokens_ut -= n * MICRO;
            self.state = (s.tokens_ut < self.plan.capacity_ut_at(t)).then_some(s);
        }
        ok
    }
}

#[derive(Clone, Debug)]
enum Event {
    Consume(u64),
    Reload(u64, u64),
}

fn event() -> impl Strategy<Value = (u64, Event)> {
    let dt = prop_oneof![Just(0u64), 1..2_000_000u64, 1..60_000_000u64];
    let ev = prop_oneof![
        3 => (1..40u64).prop_map(Event::Consume),
        1 => (1..60u64, prop::sample::select(vec![0u64, 1, 2, 5, 10, 100])).prop_map(|(c, r)| Event::Reload(c, r)),
    ];
    (dt, ev)
}

proptest! {
    /// Every decision and every micro-token agree with the model, whether the store forgets
    /// full buckets or keeps them.
    #[test]
    fn reloads_count_each_limit_over_its_own_interval(
        capacity in 1..60u64,
        per_second in prop::sample::select(vec![1u64, 2, 5, 10, 100]),
        events in prop::collection::vec(event(), 1..40),
        forget in any::<bool>(),
    ) {
        let t0 = 1_780_000_000 * SEC;
        let mut model = Reference { tokens_ut: capacity * MICRO, at_us: t0, capacity_ut: capacity * MICRO, rate: per_second };
        let mut store = Stored { plan: fixed(capacity, per_second), state: None, forget };
        let mut t = t0;
        let mut reloads = 0;
        for (dt, ev) in events {
            // A write at the very microsecond of a later reload counts as after it (the
            // store cannot tell), which can only hold fewer tokens than the model's order:
            // reloads here come at least a microsecond after what went before.
            t += if matches!(ev, Event::Reload(..)) { dt.max(1) } else { dt };
            match ev {
                // Within what a plan remembers: past it the oldest reloads are approximated.
                Event::Reload(..) if reloads == MAX_RELOADS_REMEMBERED => {}
                Event::Reload(c, r) => {
                    reloads += 1;
                    model.reload(t, c, r);
                    store.plan = Plan::after_reload(&store.plan, fixed(c, r), t);
                }
                Event::Consume(n) => {
                    prop_assert_eq!(store.consume(t, n), model.consume(t, n), "decision at {}", t - t0);
                }
            }
            prop_assert_eq!(store.read(t).tokens_ut, { model.advance(t); model.tokens_ut }, "tokens at {}", t - t0);
            prop_assert!(store.plan.reloads_remembered() <= MAX_RELOADS_REMEMBERED);
        }
    }

    /// The wait a denied request is told is exact under the chain of reloads: at it the bucket
    /// holds what was asked for, a microsecond before it does not.
    #[test]
    fn waits_cross_reloads_exactly(
        capacity in 1..60u64,
        rates in prop::collection::vec(prop::sample::select(vec![1u64, 2, 5, 10]), 1..4),
        gaps in prop::collection::vec(1..5_000_000u64, 1..4),
        need in 1..60u64,
        ask_at in 0..20_000_000u64,
    ) {
        let t0 = 1_780_000_000 * SEC;
        let empty = BucketState { tokens_ut: 0, updated_us: t0 };
        let mut plan = fixed(capacity, 1);
        let mut t = t0;
        for (rate, gap) in rates.iter().zip(&gaps) {
            t += gap;
            plan = Plan::after_reload(&plan, fixed(capacity, *rate), t);
        }
        let now = t0 + ask_at;
        let need_ut = need * MICRO;
        match plan.wait_us(empty, need_ut, now) {
            Some(0) => prop_assert!(plan.refill_to(empty, now).tokens_ut >= need_ut),
            Some(w) => {
                prop_assert!(plan.refill_to(empty, now + w).tokens_ut >= need_ut, "holds it at the wait");
                prop_assert!(plan.refill_to(empty, now + w - 1).tokens_ut < need_ut, "not before");
            }
            None => prop_assert!(need > capacity),
        }
        // And the time until full is where it becomes full.
        if let Some(full) = plan.full_at_us(empty) {
            prop_assert!(plan.refill_to(empty, full).tokens_ut >= plan.capacity_ut_at(full));
            prop_assert!(plan.refill_to(empty, full - 1).tokens_ut < plan.capacity_ut_at(full - 1));
        }
    }
}

#[test]
fn a_reload_that_changes_nothing_keeps_the_plan_and_its_history() {
    let t0 = 1_780_000_000 * SEC;
    let once = Plan::after_reload(&fixed(10, 1), fixed(10, 2), t0);
    let again = Plan::after_reload(&once, fixed(10, 2), t0 + SEC);
    assert_eq!(again, once);
    assert_eq!(again.reloads_remembered(), 1);
    assert_eq!(Plan::after_reload(&fixed(10, 1), fixed(10, 1), t0), fixed(10, 1));
}

#[test]
fn history_no_bucket_can_need_is_dropped() {
    let t0 = 1_780_000_000 * SEC;
    // 10 tokens at 10/s fill in 1 s: a reload 2 s later needs nothing from before the first.
    let first = Plan::after_reload(&fixed(10, 1), fixed(10, 10), t0);
    let second = Plan::after_reload(&first, fixed(10, 2), t0 + 2 * SEC);
    let Plan::Reloaded(r) = &second else { panic!("a reload") };
    assert_eq!(r.before(), &fixed(10, 10));
    // Half a second later it still may.
    let second = Plan::after_reload(&first, fixed(10, 2), t0 + SEC / 2);
    assert_eq!(second.reloads_remembered(), 2);
}

#[test]
fn at_most_so_many_reloads_are_remembered() {
    let t0 = 1_780_000_000 * SEC;
    // A rate of zero never fills, so nothing is pruned: only the cap bounds the chain.
    let mut plan = fixed(10, 0);
    for i in 0..3 * MAX_RELOADS_REMEMBERED as u64 {
        plan = Plan::after_reload(&plan, fixed(10, i % 2), t0 + i * SEC);
        assert!(plan.reloads_remembered() <= MAX_RELOADS_REMEMBERED);
    }
    assert_eq!(plan.reloads_remembered(), MAX_RELOADS_REMEMBERED);
}
