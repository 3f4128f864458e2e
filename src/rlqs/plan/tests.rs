use super::*;

const TERMS: Terms = Terms {
    ttl_us: 2_000_000,
    margin_us: 250_000,
    period_us: 500_000,
};

#[test]
fn fair_split_meets_small_demands_and_shares_the_rest_equally() {
    assert_eq!(fair_split(100, &[10, 1000, 1000]), vec![10, 45, 45]);
    // Every demand met: the rest spread equally.
    assert_eq!(fair_split(100, &[10, 20]), vec![45, 55]);
    assert_eq!(fair_split(100, &[]), Vec::<u64>::new());
    assert_eq!(fair_split(0, &[5, 5]), vec![0, 0]);
    let s = fair_split(1_000, &[1, 2, 3, 500, 700, 900]);
    assert!(s.iter().sum::<u64>() <= 1_000 && s.iter().sum::<u64>() >= 1_000 - 6);
    // Max-min: no share under its demand while another gets more than it.
    assert_eq!(s[3], s[4]);
}

#[test]
fn a_new_bucket_is_paid_for_its_burst_and_its_refill_until_it_can_expire() {
    let shape = Shape::fit(5 * MICRO, 5);
    let a = assign(&Held::Nothing, shape, 10_000_000, &TERMS);
    assert_eq!(a.take_ut, 5 * MICRO + shape.refill_ut(2_250_000));
    assert_eq!(a.take_ut, 5 * MICRO + 11_250_000);
    assert_eq!(a.give_ut, 0);
    // Sent again a second later: only the second's refill more.
    let b = assign(&a.held, shape, 11_000_000, &TERMS);
    assert_eq!(b.take_ut, 5 * MICRO);
    assert_eq!(b.give_ut, 0);
    // Too late to be sure the old one still runs: a new bucket, paid in full.
    let late = assign(&b.held, shape, 11_000_000 + 1_800_000, &TERMS);
    assert_eq!(late.take_ut, a.take_ut);
}

#[test]
fn a_replaced_bucket_gives_back_the_refill_paid_beyond_its_replacement() {
    let old = Shape::fit(4 * MICRO, 4);
    let a = assign(&Held::Nothing, old, 0, &TERMS);
    let new = Shape::fit(2 * MICRO, 2);
    let b = assign(&a.held, new, 1_000_000, &TERMS);
    // Paid until 2.25 s; replaced by 1.25 s at the latest: one second of 4/s back.
    assert_eq!(b.give_ut, 4 * MICRO);
    let d = deny(&b.held, 1_000_000, &TERMS);
    // Paid until 3.25 s, replaced by 1.25 s at the latest.
    assert_eq!(d.give_ut, new.refill_ut(2_000_000));
    assert_eq!(d.take_ut, 0);
}

#[test]
fn a_budget_scales_the_targets_down_and_denies_when_nothing_fits() {
    let held = [Held::Nothing, Held::Nothing];
    let targets = [5 * MICRO, 5 * MICRO];
    // The look-ahead (2 x 5/s x 2.25 s) is more than the pool: the least burst each, 2 tokens
    // (a quarter of a second of 5/s is less).
    let full = plan(&held, &targets, 20 * MICRO, 20 * MICRO, 0, &TERMS, None, &|_| true);
    assert_eq!(full.net_ut(), 2 * (2 * i128::from(MICRO) + 11_250_000));
    // A quiet large bucket: half the rest of the pool goes out as bursts (77.5 / 2 / 2).
    let quiet = plan(&held, &targets, 100 * MICRO, 100 * MICRO, 0, &TERMS, None, &|_| true);
    assert!(quiet
        .shares
        .iter()
        .all(|s| matches!(s.action, Action::Bucket(b) if b.max_tokens == 19)));
    let cut = plan(
        &held,
        &targets,
        20 * MICRO,
        20 * MICRO,
        0,
        &TERMS,
        Some(20 * MICRO),
        &|_| true,
    );
    assert!(cut.net_ut() <= 20 * i128::from(MICRO) && cut.net_ut() > 10 * i128::from(MICRO));
    assert!(cut.scale > 0.0 && cut.scale < 1.0);
    let none = plan(&held, &targets, 0, 20 * MICRO, 0, &TERMS, Some(MICRO / 2), &|_| true);
    assert!(none.denies_all());
    assert_eq!(none.net_ut(), 0);
}

#[test]
fn a_share_near_its_target_keeps_its_bucket() {
    let a = assign(&Held::Nothing, Shape::fit(5 * MICRO, 5), 0, &TERMS);
    let p = plan(&[a.held], &[5_000_000], 0, 20 * MICRO, 1_000_000, &TERMS, None, &|_| {
        true
    });
    assert_eq!(p.shares[0].action, a.action);
    assert_eq!(p.shares[0].take_ut, 5 * MICRO);
    // Well above: a larger bucket.
    let p = plan(&[a.held], &[9 * MICRO], 0, 20 * MICRO, 1_000_000, &TERMS, None, &|_| {
        true
    });
    assert_ne!(p.shares[0].action, a.action);
}

#[test]
fn a_starved_share_is_topped_up_with_what_the_pool_holds_beyond_the_round() {
    let running = assign(&Held::Nothing, Shape::fit(5 * MICRO, 2), 0, &TERMS).held;
    let held = [running, running];
    let targets = [5 * MICRO, 5 * MICRO];
    let hungry = [true, false];
    // A second later each renewal costs a second of 5/s; of a pool of 30, 20 are left.
    let renewals = plan(
        &held,
        &targets,
        30 * MICRO,
        40 * MICRO,
        1_000_000,
        &TERMS,
        None,
        &|_| true,
    );
    assert!(renewals.shares.iter().all(|s| !s.fresh && s.take_ut == 5 * MICRO));
    let top = |pool: u64, hungry: &[bool]| {
        top_up(
            renewals.clone(),
            &held,
            &targets,
            hungry,
            pool,
            40 * MICRO,
            1_000_000,
            &TERMS,
        )
    };
    let p = top(30 * MICRO, &hungry);
    // The hungry share: a new bucket whose burst is the 20 left plus the renewal it replaces
    // and the refill it gives back (5 + 5), less the new bucket's look-ahead (2.25 s of 5/s).
    assert!(p.shares[0].fresh);
    assert!(
        matches!(p.shares[0].action, Action::Bucket(b) if b.max_tokens == 18),
        "{p:?}"
    );
    assert_eq!(p.shares[0].take_ut, 18 * MICRO + 11_250_000);
    assert_eq!(p.shares[0].give_ut, 5 * MICRO);
    // The other keeps its bucket; together they take no more than the pool.
    assert_eq!((p.shares[1].fresh, p.shares[1].take_ut), (false, 5 * MICRO));
    assert!(p.net_ut() <= 30 * i128::from(MICRO) && p.net_ut() > 29 * i128::from(MICRO));
    // Both hungry: 10 each.
    let p = top(30 * MICRO, &[true, true]);
    assert!(
        p.shares
            .iter()
            .all(|s| matches!(s.action, Action::Bucket(b) if b.max_tokens == 8)),
        "{p:?}"
    );
    assert!(p.net_ut() <= 30 * i128::from(MICRO));
    // Too little left for a burst of the least (2 tokens): renewals only.
    assert_eq!(top(12 * MICRO, &hungry), renewals);
    // Nor more than the capacity.
    let p = top_up(
        renewals.clone(),
        &held,
        &targets,
        &hungry,
        30 * MICRO,
        12 * MICRO,
        1_000_000,
        &TERMS,
    );
    assert_eq!(p, renewals);
}

#[test]
fn lumps_are_new_buckets_and_raises_and_can_be_left_out() {
    let running = assign(&Held::Nothing, Shape::fit(5 * MICRO, 2), 0, &TERMS).held;
    let held = [running, running, running, Held::Nothing];
    // A second later: share 0 kept, 1 raised, 2 brought down, 3 new.
    let p = plan(
        &held,
        &[5 * MICRO, 8 * MICRO, MICRO, 5 * MICRO],
        100 * MICRO,
        100 * MICRO,
        1_000_000,
        &TERMS,
        None,
        &|_| true,
    );
    let lumps: Vec<bool> = (0..4).map(|i| is_lump(&p, &held, i, 1_000_000, &TERMS)).collect();
    assert_eq!(lumps, vec![false, true, false, true], "{p:?}");
    assert!(has_lumps(&p, &held, 1_000_000, &TERMS));
    // Without them: the raised share renews what it runs, the new one is denied; the others
    // as planned, and the whole costs less.
    let q = without_lumps(p.clone(), &held, 1_000_000, &TERMS);
    assert_eq!(q.shares[0], p.shares[0]);
    assert_eq!(q.shares[2], p.shares[2]);
    assert_eq!(
        q.shares[1],
        assign(&running, Shape::fit(5 * MICRO, 2), 1_000_000, &TERMS)
    );
    assert!(!q.shares[1].fresh);
    assert_eq!(q.shares[3].action, Action::DenyAll);
    assert!(!has_lumps(&q, &held, 1_000_000, &TERMS));
    assert!(q.net_ut() < p.net_ut());
}
