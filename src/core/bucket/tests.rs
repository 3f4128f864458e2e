//! The bucket core against a naive reference model: a floating-point simulation of a
//! continuously refilled bucket. The core floors to whole micro-tokens, so it may hold up to one
//! micro-token per admitted decision less than the model, never more.

use super::*;
use proptest::prelude::*;

const SEC: u64 = 1_000_000;

fn limit(capacity: u64, tokens: u64, period_us: u64) -> Limit {
    Limit::new(capacity, Rate::per(tokens, period_us).unwrap())
}

fn one(kind: DemandKind) -> Vec<Demand> {
    vec![Demand {
        instance: 0,
        kind,
        enforced: true,
    }]
}

/// The naive model: tokens as a real number, refilled continuously.
struct Reference {
    tokens: f64,
    at: u64,
    capacity: f64,
    per_us: f64,
}

impl Reference {
    fn new(l: &Limit, tokens_per_period: u64, period_us: u64) -> Reference {
        Reference {
            tokens: l.capacity() as f64,
            at: 0,
            capacity: l.capacity() as f64,
            per_us: tokens_per_period as f64 / period_us as f64,
        }
    }
    fn advance(&mut self, now: u64) {
        let elapsed = now.saturating_sub(self.at) as f64;
        self.tokens = (self.tokens + elapsed * self.per_us).min(self.capacity);
        self.at = self.at.max(now);
    }
}

#[test]
fn new_bucket_starts_full_and_admits_capacity() {
    let l = limit(3, 3, 60 * SEC);
    let mut s = BucketState::full(&l, 0);
    for expected in [true, true, true, false] {
        let d = decide(1, &[s], &[l], &one(DemandKind::Consume(MICRO)));
        assert_eq!(!d.denied, expected);
        s = d.instances[0].after;
    }
    assert_eq!(s.tokens_ut, 0);
}

#[test]
fn refill_is_lazy_and_capped() {
    let l = limit(10, 10, SEC); // 10 per second
    let s = BucketState {
        tokens_ut: 0,
        updated_us: 0,
    };
    assert_eq!(refill(s, &l, 100_000).tokens_ut, MICRO); // 100 ms -> 1 token
    assert_eq!(refill(s, &l, 99_999).tokens_ut, MICRO - 10);
    assert_eq!(refill(s, &l, 5 * SEC).tokens_ut, 10 * MICRO); // capped
    assert_eq!(refill(s, &l, u64::MAX).tokens_ut, 10 * MICRO);
}

#[test]
fn clock_stepping_back_counts_as_zero_and_never_rewinds() {
    let l = limit(10, 10, SEC);
    let s = BucketState {
        tokens_ut: 0,
        updated_us: 10 * SEC,
    };
    let r = refill(s, &l, 9 * SEC);
    assert_eq!(
        r,
        BucketState {
            tokens_ut: 0,
            updated_us: 10 * SEC
        }
    );
}

#[test]
fn capacity_drop_trims_before_deciding() {
    let big = limit(100, 100, 3600 * SEC);
    let small = limit(10, 10, 3600 * SEC);
    let mut s = BucketState::full(&big, 0);
    let mut admitted = 0;
    for _ in 0..50 {
        let d = decide(1, &[s], &[small], &one(DemandKind::Consume(MICRO)));
        admitted += u32::from(!d.denied);
        s = d.instances[0].after;
    }
    assert_eq!(admitted, 10);
}

#[test]
fn more_than_capacity_is_never_admissible() {
    let l = limit(5, 5, SEC);
    let s = BucketState::full(&l, 0);
    let d = decide(0, &[s], &[l], &one(DemandKind::Consume(6 * MICRO)));
    assert!(d.denied);
    assert_eq!(d.instances[0].after.tokens_ut, 5 * MICRO);
    assert_eq!(wait_us(s, 6 * MICRO, &l, 0), None);
    // Saturating: u64::MAX hits is just "too many".
    let d = decide(0, &[s], &[l], &one(DemandKind::Consume(u64::MAX)));
    assert!(d.denied);
}

#[test]
fn check_consumes_nothing_and_fails_on_an_empty_bucket() {
    let l = limit(1, 1, 3600 * SEC);
    let s = BucketState::full(&l, 0);
    let d = decide(0, &[s], &[l], &one(DemandKind::Check));
    assert!(!d.denied);
    assert!(!d.instances[0].changed);
    assert_eq!(d.instances[0].after.tokens_ut, MICRO);
    let empty = BucketState {
        tokens_ut: 0,
        updated_us: 0,
    };
    let d = decide(0, &[empty], &[l], &one(DemandKind::Check));
    assert!(d.denied);
    assert!(!d.instances[0].changed);
}

#[test]
fn refund_applies_even_when_denied_and_caps_at_capacity() {
    let l = limit(10, 10, 3600 * SEC);
    let a = BucketState {
        tokens_ut: 0,
        updated_us: 0,
    };
    let b = BucketState {
        tokens_ut: 9 * MICRO,
        updated_us: 0,
    };
    let demands = vec![
        Demand {
            instance: 0,
            kind: DemandKind::Consume(MICRO),
            enforced: true,
        },
        Demand {
            instance: 1,
            kind: DemandKind::Refund(5 * MICRO),
            enforced: true,
        },
    ];
    let d = decide(0, &[a, b], &[l, l], &demands);
    assert!(d.denied);
    assert_eq!(d.passed, vec![false, true]);
    assert_eq!(d.instances[1].after.tokens_ut, 10 * MICRO);
    assert!(d.instances[1].changed);
    assert!(!d.instances[0].changed);
}

#[test]
fn shadow_demand_never_denies_and_keeps_its_tokens_when_short() {
    let l = limit(10, 10, 3600 * SEC);
    let empty = BucketState {
        tokens_ut: 0,
        updated_us: 0,
    };
    let full = BucketState::full(&l, 0);
    let demands = vec![
        Demand {
            instance: 0,
            kind: DemandKind::Consume(MICRO),
            enforced: false,
        },
        Demand {
            instance: 1,
            kind: DemandKind::Consume(MICRO),
            enforced: true,
        },
    ];
    let d = decide(0, &[empty, full], &[l, l], &demands);
    assert!(!d.denied);
    assert_eq!(d.passed, vec![false, true]);
    assert_eq!(d.instances[0].after.tokens_ut, 0);
    assert_eq!(d.instances[1].after.tokens_ut, 9 * MICRO);
}

#[test]
fn hits_on_one_instance_add_up() {
    let l = limit(3, 3, 3600 * SEC);
    let s = BucketState::full(&l, 0);
    let two = |n| Demand {
        instance: 0,
        kind: DemandKind::Consume(n * MICRO),
        enforced: true,
    };
    let d = decide(0, &[s], &[l], &[two(2), two(2)]);
    assert!(d.denied, "2 + 2 > 3");
    let d = decide(0, &[s], &[l], &[two(1), two(2)]);
    assert!(!d.denied);
    assert_eq!(d.instances[0].after.tokens_ut, 0);
}

#[test]
fn zero_rate_zero_capacity_denies_forever() {
    let l = Limit::new(0, Rate::ZERO);
    let s = BucketState::full(&l, 0);
    let d = decide(u64::MAX, &[s], &[l], &one(DemandKind::Consume(MICRO)));
    assert!(d.denied);
    assert_eq!(wait_us(s, MICRO, &l, u64::MAX), None);
    assert_eq!(time_to_full_us(0, &l), Some(0));
}

#[test]
fn a_fine_rate_stays_exact_over_a_year_of_idleness() {
    // 7 tokens per hour, capacity 1e9 tokens: credit() must not overflow or lose exactness.
    let l = limit(MAX_CAPACITY, 7, 3600 * SEC);
    let s = BucketState {
        tokens_ut: 0,
        updated_us: 0,
    };
    let year = 365 * 24 * 3600 * SEC;
    let r = refill(s, &l, year);
    assert_eq!(r.tokens_ut, 7 * 365 * 24 * MICRO);
}

proptest! {
    /// Admission, refill and the cap against the continuous model, over random request streams.
    #[test]
    fn single_bucket_matches_reference(
        capacity in 1u64..200,
        per in 1u64..500,
        period_ms in 1u64..120_000,
        steps in proptest::collection::vec((0u64..5_000_000, 0u64..8), 1..200),
    ) {
        let period_us = period_ms * 1000;
        let l = limit(capacity, per, period_us);
        let mut state = BucketState::full(&l, 0);
        let mut model = Reference::new(&l, per, period_us);
        let mut now = 0u64;
        let mut floors = 0f64; // micro-tokens the core may have lost to flooring
        for (gap, n) in steps {
            now += gap;
            model.advance(now);
            let d = decide(now, &[state], &[l], &one(DemandKind::Consume(n * MICRO)));
            let held = d.instances[0].before.tokens_ut as f64 / MICRO as f64;
            let slop = 1e-9 * model.capacity.max(1.0);
            // Never more than the model, never less than the model minus the flooring losses.
            prop_assert!(held <= model.tokens + slop, "core {} > model {}", held, model.tokens);
            prop_assert!(held >= model.tokens - (floors + 1.0) / MICRO as f64 - slop);
            // The decision agrees with the model wherever the model is clear of the band.
            let need = n as f64;
            if model.tokens + slop < need {
                prop_assert!(d.denied);
            }
            if model.tokens - (floors + 1.0) / MICRO as f64 - slop >= need {
                prop_assert!(!d.denied);
            }
            if !d.denied {
                model.tokens -= need;
                floors += 1.0;
            }
            // A denied request leaves the stored state as it was.
            prop_assert_eq!(d.instances[0].changed, !d.denied && n > 0);
            if d.instances[0].changed {
                state = d.instances[0].after;
            }
        }
    }

    /// retry-after is exact: one microsecond earlier the same request is still denied, at the
    /// reported instant it passes; and it agrees with the model's (n - tokens) / rate, counted
    /// from the stored state's time (so also after a clock stepped back).
    #[test]
    fn retry_after_is_exact(
        capacity in 1u64..1000,
        per in 1u64..1000,
        period_ms in 1u64..3_600_000,
        tokens_ut in 0u64..1_000_000_000,
        n in 1u64..1000,
        updated_us in 0u64..10_000_000,
        now_us in 0u64..20_000_000,
    ) {
        let period_us = period_ms * 1000;
        let l = limit(capacity, per, period_us);
        // `now_us` may be before `updated_us`: a clock that stepped back.
        let s = BucketState { tokens_ut: tokens_ut.min(l.capacity_ut), updated_us };
        let need = n * MICRO;
        match wait_us(s, need, &l, now_us) {
            None => prop_assert!(need > l.capacity_ut),
            Some(wait) => {
                let at = now_us + wait;
                prop_assert!(refill(s, &l, at).tokens_ut >= need);
                if wait > 0 {
                    prop_assert!(refill(s, &l, at - 1).tokens_ut < need);
                }
                // The model: the deficit over the rate, counted from the state's own time.
                let deficit = need.saturating_sub(s.tokens_ut) as f64 / MICRO as f64;
                let model_at = updated_us as f64 + deficit / (per as f64 / period_us as f64);
                let expected = if deficit == 0.0 { 0.0 } else { (model_at - now_us as f64).max(0.0) };
                prop_assert!((wait as f64 - expected).abs() <= 1.0 + expected * 1e-9, "{} vs {}", wait, expected);
            }
        }
    }

    /// All or nothing: a request over several buckets consumes from all of them or from none,
    /// and is denied iff some enforced demand lacks tokens.
    #[test]
    fn all_or_nothing(
        held in proptest::collection::vec(0u64..10, 1..5),
        asks in proptest::collection::vec((0usize..5, 0u64..6, any::<bool>()), 1..8),
    ) {
        let l = limit(10, 1, 3600 * SEC);
        let states: Vec<BucketState> = held.iter().map(|t| BucketState { tokens_ut: t * MICRO, updated_us: 0 }).collect();
        let limits = vec![l; states.len()];
        let demands: Vec<Demand> = asks.iter().map(|(i, n, enforced)| Demand {
            instance: i % states.len(),
            kind: DemandKind::Consume(n * MICRO),
            enforced: *enforced,
        }).collect();
        let d = decide(0, &states, &limits, &demands);
        let mut total = vec![0u64; states.len()];
        for dm in &demands {
            if let DemandKind::Consume(n) = dm.kind { total[dm.instance] += n; }
        }
        let lacking = |i: usize| states[i].tokens_ut < total[i];
        let expect_denied = demands.iter().any(|dm| dm.enforced && lacking(dm.instance));
        prop_assert_eq!(d.denied, expect_denied);
        for (i, out) in d.instances.iter().enumerate() {
            let expected = if expect_denied || lacking(i) { states[i].tokens_ut } else { states[i].tokens_ut - total[i] };
            prop_assert_eq!(out.after.tokens_ut, expected);
        }
    }
}

proptest! {
    /// A debt bucket (its limit's capacity raised by the floor's depth) against the signed
    /// model: the continuous [`Reference`], its tokens the balance, which reports take below
    /// zero down to the floor. Checks pass iff the balance is positive, reports are debited in
    /// full down to the floor whatever the decision, what the floor refuses is `lost_ut`,
    /// refill repays the debt, and a client that asks again after [`wait_us`] is admitted.
    #[test]
    fn a_debt_bucket_matches_the_signed_model(
        capacity in 1u64..200,
        depth in 1u64..200,
        per in 1u64..500,
        period_ms in 1u64..120_000,
        steps in proptest::collection::vec((0u64..5_000_000, 0u64..400), 1..100),
    ) {
        let period_us = period_ms * 1000;
        let depth_ut = depth * MICRO;
        let shown = limit(capacity, per, period_us);
        let l = Limit { capacity_ut: shown.capacity_ut + depth_ut, rate: shown.rate };
        let mut state = BucketState::full(&l, 0);
        let mut model = Reference::new(&shown, per, period_us);
        let floor = -(depth as f64);
        let mut now = 0u64;
        let mut floors = 0f64;
        for (gap, n) in steps {
            now += gap;
            model.advance(now);
            let kind = if n == 0 {
                DemandKind::DebtCheck { depth_ut }
            } else {
                DemandKind::Debit { amount_ut: n * MICRO, depth_ut }
            };
            let d = decide(now, &[state], &[l], &one(kind));
            let o = d.instances[0];
            let balance = (o.before.tokens_ut as f64 - depth_ut as f64) / MICRO as f64;
            let band = (floors + 1.0) / MICRO as f64 + 1e-9 * model.capacity;
            prop_assert!(balance <= model.tokens + 1e-9 * model.capacity, "core {} > model {}", balance, model.tokens);
            prop_assert!(balance >= model.tokens - band, "core {} < model {}", balance, model.tokens);
            // Admission by the sign of the balance, wherever the model is clear of the band.
            if model.tokens > band {
                prop_assert!(!d.denied);
            }
            if model.tokens <= 0.0 {
                prop_assert!(d.denied);
            }
            if n > 0 {
                let taken = (n as f64).min(model.tokens - floor);
                model.tokens -= taken;
                floors += 1.0;
                // Debited whatever the decision; exactly what the floor refused is lost.
                prop_assert_eq!(o.debited_ut + o.lost_ut, n * MICRO);
                prop_assert!(o.changed || o.debited_ut == 0);
                prop_assert!((o.lost_ut as f64 / MICRO as f64 - (n as f64 - taken)).abs() <= band + 1e-6);
            } else {
                prop_assert!(!o.changed, "a check takes nothing");
            }
            state = o.kept();
            prop_assert!(state.tokens_ut <= l.capacity_ut);
            // Retry-after on a denial: not a microsecond early, and admitted then.
            if d.denied {
                let wait = wait_us(state, depth_ut + 1, &l, now).expect("refill repays any debt");
                let at = now + wait;
                let check = one(DemandKind::DebtCheck { depth_ut });
                prop_assert!(!decide(at, &[state], &[l], &check).denied);
                if wait > 0 {
                    prop_assert!(decide(at - 1, &[state], &[l], &check).denied);
                }
            }
        }
    }
}
