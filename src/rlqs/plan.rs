//! What each Envoy of one global bucket is assigned next, and what the assignments cost the
//! bucket. Pure: the hub ([`super::hub`]) reads the clock, asks the store and sends.
//!
//! **Shares are paid for in advance.** An assignment lets an Envoy admit, until it expires,
//! what its token bucket holds and refills ([`super::shape`]). Before it is sent, the hub takes
//! exactly that many tokens from the global bucket, in the same store, with the same
//! all-or-nothing decision as any `ShouldRateLimit` (so RLS clients of the rule and other
//! replicas share the one limit): a new bucket costs its burst plus its refill until it can
//! expire, `ttl + margin` after it is sent (the margin covers the message's way to Envoy); an
//! unchanged one costs its refill from where it was paid to the new expiry. A bucket that a new
//! assignment replaces gives back the refill it was paid for beyond the instant it is replaced.
//! Every token an Envoy admits was therefore taken from the global bucket first: over any
//! window, Envoys and RLS clients together admit at most its capacity plus its refill (plus
//! refunds), whatever the reports say, whenever streams come and go.
//!
//! What it costs is the shares' look-ahead: at full demand about `rate x (ttl + margin)` tokens
//! are paid for and not yet spent, so a bucket whose capacity is under that cannot hand out its
//! whole refill (docs/rlqs.md).

use super::shape::Shape;
use crate::core::bucket::MICRO;

/// The timing of every assignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terms {
    /// `assignment_time_to_live`, in microseconds (whole seconds: Envoy reads only those).
    pub ttl_us: u64,
    /// How long a message may take to reach Envoy and be applied, in microseconds: an
    /// assignment is paid for until `ttl + margin` after it is sent.
    pub margin_us: u64,
    /// How often shares are renewed, in microseconds (`assignment_period_ms`).
    pub period_us: u64,
}

impl Terms {
    /// The look-ahead a new assignment is paid for, in microseconds.
    pub fn lookahead_us(&self) -> u64 {
        self.ttl_us.saturating_add(self.margin_us)
    }
}

/// What the hub knows an Envoy holds for a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Held {
    /// Nothing sent yet (a new bucket, or a new stream).
    #[default]
    Nothing,
    /// A blanket rule (`ALLOW_ALL`, `DENY_ALL`): no token bucket running.
    Blanket,
    /// A token bucket of `shape`, last sent at `sent_us`, paid for until `paid_until_us`
    /// (tollgate's clock, microseconds).
    Bucket {
        /// The shape sent.
        shape: Shape,
        /// When it was last sent.
        sent_us: u64,
        /// Until when its refill is paid for.
        paid_until_us: u64,
    },
}

/// What one Envoy is sent for the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// A `token_bucket` assignment.
    Bucket(Shape),
    /// A `DENY_ALL` blanket rule.
    DenyAll,
    /// Nothing sent: the share is not part of this round ([`GroupPlan::only`]).
    Unchanged,
}

/// One Envoy's next assignment: what is sent and what it then holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assigned {
    /// What is sent.
    pub action: Action,
    /// What the Envoy holds once it is applied.
    pub held: Held,
    /// Micro-tokens this share takes from the global bucket.
    pub take_ut: u64,
    /// Micro-tokens this share gives back (refill paid for a bucket it replaces).
    pub give_ut: u64,
    /// Whether Envoy starts a new bucket, full (the burst is paid for), rather than keep the
    /// one it runs.
    pub fresh: bool,
}

/// The next assignments of every Envoy of a bucket, and what they cost together.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupPlan {
    /// Per share, in the order given.
    pub shares: Vec<Assigned>,
    /// The scale applied to the targets of new buckets, or of all (1 when the plan was not cut
    /// to a budget; 0 when none is sent a new bucket).
    pub scale: f64,
}

impl GroupPlan {
    /// What the plan takes from the global bucket in all, in micro-tokens.
    pub fn take_ut(&self) -> u64 {
        self.shares.iter().fold(0u64, |a, s| a.saturating_add(s.take_ut))
    }

    /// What the plan gives back in all, in micro-tokens.
    pub fn give_ut(&self) -> u64 {
        self.shares.iter().fold(0u64, |a, s| a.saturating_add(s.give_ut))
    }

    /// Whether every share of the round is sent `DENY_ALL`.
    pub fn denies_all(&self) -> bool {
        self.shares
            .iter()
            .all(|s| matches!(s.action, Action::DenyAll | Action::Unchanged))
    }

    /// The plan for the shares `selected` says, the others left as they are (nothing sent,
    /// nothing paid): a new Envoy is assigned at once without a round for every other.
    pub fn only(mut self, held: &[Held], selected: impl Fn(usize) -> bool) -> GroupPlan {
        for (i, (share, h)) in self.shares.iter_mut().zip(held).enumerate() {
            if !selected(i) {
                *share = Assigned {
                    action: Action::Unchanged,
                    held: *h,
                    take_ut: 0,
                    give_ut: 0,
                    fresh: false,
                };
            }
        }
        self
    }

    /// The net change asked of the store: positive, to take; negative, to give back.
    pub fn net_ut(&self) -> i128 {
        i128::from(self.take_ut()) - i128::from(self.give_ut())
    }
}

/// A share's current bucket keeps running when the new assignment reaches Envoy before the
/// old one can have expired (Envoy restarts the TTL on each assignment it applies; an expired
/// one's bucket is gone, and the next starts full).
fn still_running(sent_us: u64, now_us: u64, terms: &Terms) -> bool {
    now_us.saturating_add(terms.margin_us) < sent_us.saturating_add(terms.ttl_us)
}

/// Refill paid for a running bucket beyond the instant a new assignment can replace it (at
/// the latest `now + margin`), rounded down: given back once the replacement is on its way.
fn unused_refill_ut(held: &Held, now_us: u64, terms: &Terms) -> u64 {
    match *held {
        Held::Bucket {
            shape, paid_until_us, ..
        } => shape.refill_floor_ut(paid_until_us.saturating_sub(now_us.saturating_add(terms.margin_us))),
        _ => 0,
    }
}

/// What sending `shape` to an Envoy holding `held` costs, and what it holds after.
pub fn assign(held: &Held, shape: Shape, now_us: u64, terms: &Terms) -> Assigned {
    let paid_until_us = now_us.saturating_add(terms.lookahead_us());
    if let Held::Bucket {
        shape: old,
        sent_us,
        paid_until_us: old_paid,
    } = *held
    {
        if old == shape && still_running(sent_us, now_us, terms) {
            return Assigned {
                action: Action::Bucket(shape),
                held: Held::Bucket {
                    shape,
                    sent_us: now_us,
                    paid_until_us: paid_until_us.max(old_paid),
                },
                take_ut: shape.refill_ut(paid_until_us.saturating_sub(old_paid)),
                give_ut: 0,
                fresh: false,
            };
        }
    }
    Assigned {
        action: Action::Bucket(shape),
        held: Held::Bucket {
            shape,
            sent_us: now_us,
            paid_until_us,
        },
        take_ut: shape.burst_ut().saturating_add(shape.refill_ut(terms.lookahead_us())),
        give_ut: unused_refill_ut(held, now_us, terms),
        fresh: true,
    }
}

/// `DENY_ALL` for an Envoy holding `held`: free, and gives back a replaced bucket's refill.
pub fn deny(held: &Held, now_us: u64, terms: &Terms) -> Assigned {
    Assigned {
        action: Action::DenyAll,
        held: Held::Blanket,
        take_ut: 0,
        give_ut: unused_refill_ut(held, now_us, terms),
        fresh: false,
    }
}

/// A share keeps its running bucket while its rate is within this band of its target: a new
/// bucket costs a burst and loses what the old one held, so small moves are not worth it. The
/// band is narrow above, so that the shares of Envoys that stay make room for one that joins.
const KEEP_BELOW: f64 = 0.9;
const KEEP_ABOVE: f64 = 1.02;

/// What one share is asked to do in a plan.
#[derive(Clone, Copy, Debug)]
struct Want {
    /// Target rate, micro-tokens a second.
    rate: u64,
    /// Burst of a new bucket, in tokens.
    burst: u64,
}

/// The next assignment of one share wanting `want`: its running bucket while within the band
/// (or whenever `keep_any` and it is not above the band), else a new bucket.
fn next(held: &Held, want: Want, keep_any: bool, now_us: u64, terms: &Terms) -> Assigned {
    if let Held::Bucket { shape, sent_us, .. } = held {
        let rate = shape.rate_ut_per_s() as f64;
        let target = want.rate as f64;
        let above = rate > target * KEEP_ABOVE + 1.0;
        if still_running(*sent_us, now_us, terms) && !above && (keep_any || rate >= target * KEEP_BELOW) {
            return assign(held, *shape, now_us, terms);
        }
    }
    assign(held, Shape::fit(want.rate, want.burst), now_us, terms)
}

/// The least burst of a new bucket refilled at `rate_ut_per_s`, in tokens: a quarter of a
/// second of its rate, but no more than its part (`part_ut`) of the global bucket's capacity,
/// and at least 2. A bucket of one token loses the refill of every interval between requests
/// shorter than a token's (a request at 1.9 a second on a share of 1.85 would pass one time in
/// two); two hold the jitter of requests that come about as fast as the share. More is paid for
/// at every new bucket, which a share raised towards its target needs to afford.
fn least_burst(rate_ut_per_s: u64, part_ut: u64) -> u64 {
    (rate_ut_per_s / 4 / MICRO)
        .min(part_ut / MICRO)
        .max(2)
        .min((part_ut / MICRO).max(1))
}

/// Scales tried, in order, when a plan must fit a budget.
const SCALES: [f64; 12] = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05, 0.0];

/// The next assignments of the Envoys holding `held`, with target rates `targets` (micro-tokens
/// a second, [`fair_split`]), for a bucket of `capacity_ut` thought to hold about `pool_ut`
/// now.
///
/// New buckets share out as bursts half of what the pool holds beyond the look-ahead the
/// targets need, each in proportion to its target and at least a quarter of a second of its rate (2 tokens or
/// more, within the capacity); so a quiet bucket's first Envoy can burst as an RLS client
/// could, and a bucket in steady use, with little pool, gives its new buckets the least.
///
/// With `budget_ut` (the micro-tokens the global bucket holds, from a denied attempt) the plan
/// is cut to fit, in this order of preference: running buckets kept (those above their target
/// brought down to it, which gives back) and new ones at a scaled target with the least burst,
/// or denied, then whole raises of the shares furthest under their targets while the budget
/// lasts; every target scaled; every share denied (`DENY_ALL` only gives back).
#[allow(clippy::too_many_arguments)] // a plan's inputs, each its own unit; none defaults
pub fn plan(
    held: &[Held],
    targets: &[u64],
    pool_ut: u64,
    capacity_ut: u64,
    now_us: u64,
    terms: &Terms,
    budget_ut: Option<u64>,
    selected: &dyn Fn(usize) -> bool,
) -> GroupPlan {
    let cut = |p: GroupPlan| p.only(held, selected);
    let total: u64 = targets.iter().fold(0u64, |a, t| a.saturating_add(*t));
    let lookahead_ut = (u128::from(total) * u128::from(terms.lookahead_us()) / u128::from(MICRO)) as u64;
    // Half: the rest waits for the Envoys that join next (a fleet's first reports come
    // together, and a large first burst brought down a moment later to make room for the
    // second Envoy would be lost unspent), else goes to starved buckets as top-ups.
    let spare_ut = pool_ut.min(capacity_ut).saturating_sub(lookahead_ut) / 2;
    let part = |t: u64| -> u64 {
        match total {
            0 => capacity_ut,
            _ => (u128::from(capacity_ut) * u128::from(t) / u128::from(total)) as u64,
        }
    };
    let least = |rate: u64, t: u64| least_burst(rate, part(t));
    let burst = |t: u64| -> u64 {
        if total == 0 {
            return least(t, t);
        }
        ((u128::from(spare_ut) * u128::from(t) / u128::from(total)) as u64 / MICRO).max(least(t, t))
    };
    // Each share's next assignment, `f(held, target)`, for one way of cutting the round.
    let round = |scale: f64, f: &dyn Fn(&Held, u64) -> Assigned| {
        cut(GroupPlan {
            shares: held.iter().zip(targets).map(|(h, &t)| f(h, t)).collect(),
            scale,
        })
    };
    let to = |h: &Held, rate: u64, burst: u64, keep_any: bool| next(h, Want { rate, burst }, keep_any, now_us, terms);
    let ideal = round(1.0, &|h, t| to(h, t, burst(t), false));
    let Some(budget) = budget_ut else {
        return ideal;
    };
    // A plan's net take must fit (what it gives back pays for what it takes: if the call
    // taking the net fails after the store applied it, nothing is sent, and the Envoys spend
    // only what they were paid; a plan that gives back more than it takes gives the rest
    // only once its messages are queued).
    let fits = |p: &GroupPlan| p.net_ut() <= i128::from(budget);
    if fits(&ideal) {
        return ideal;
    }
    let running = |h: &Held| matches!(h, Held::Bucket { sent_us, .. } if still_running(*sent_us, now_us, terms));
    // Running buckets kept (those above their target brought down to it, which gives back),
    // new ones at a part of their target, or denied.
    let mut base = None;
    for scale in SCALES {
        let p = round(scale, &|h, t| {
            if running(h) {
                to(h, t, least(t, t), true)
            } else if scale == 0.0 {
                deny(h, now_us, terms)
            } else {
                let rate = (t as f64 * scale) as u64;
                to(h, rate, least(rate, t), false)
            }
        });
        if fits(&p) {
            base = Some(p);
            break;
        }
    }
    if let Some(mut p) = base {
        // Then whole raises, the shares furthest under their targets first, while the budget
        // lasts: a raise is a new bucket, paid ahead, so a part of one is rarely worth its
        // burst; kept, a share leaves its surplus in the bucket until a whole raise fits.
        let below = |i: usize| match held[i] {
            Held::Bucket { shape, .. } => shape.rate_ut_per_s() as f64 / targets[i].max(1) as f64,
            _ => 1.0,
        };
        let mut order: Vec<usize> = (0..held.len())
            .filter(|&i| selected(i) && running(&held[i]) && below(i) < KEEP_BELOW)
            .collect();
        order.sort_by(|a, b| below(*a).total_cmp(&below(*b)));
        for i in order {
            let t = targets[i];
            let kept = p.shares[i];
            p.shares[i] = to(&held[i], t, least(t, t), false);
            if !fits(&p) {
                p.shares[i] = kept;
            }
        }
        return p;
    }
    // Everything scaled.
    for scale in SCALES {
        let p = round(scale, &|h, t| {
            let rate = (t as f64 * scale) as u64;
            to(h, rate, least(rate, t), false)
        });
        if scale > 0.0 && fits(&p) {
            return p;
        }
    }
    cut(deny_all(held, now_us, terms))
}

/// Top-ups of plan `p` (made with `held` and `targets`, [`plan`]): what `pool_ut` (at most
/// `capacity_ut`) holds beyond `p`'s net take goes to the `hungry` shares (their Envoys
/// reported denials: their buckets run dry) whose running buckets `p` keeps, in proportion to
/// their targets. Each whose part makes a burst of at least its least is sent a new bucket of
/// its target with that burst instead, costing its renewal in `p` plus its part; the plan's
/// net take stays within `pool_ut`. Otherwise tokens the shares leave (the headroom, a quiet
/// start, a replica's split too small for its Envoys) would gather in the global bucket,
/// unused while its Envoys deny. A top-up loses what the replaced bucket still holds: next to
/// nothing for a bucket that runs dry.
#[allow(clippy::too_many_arguments)] // the plan's own inputs, passed on
pub fn top_up(
    mut p: GroupPlan,
    held: &[Held],
    targets: &[u64],
    hungry: &[bool],
    pool_ut: u64,
    capacity_ut: u64,
    now_us: u64,
    terms: &Terms,
) -> GroupPlan {
    let pool_ut = pool_ut.min(capacity_ut);
    let Ok(left) = u64::try_from(i128::from(pool_ut) - p.net_ut()) else {
        return p;
    };
    let all = targets.iter().fold(0u128, |a, &t| a + u128::from(t)).max(1);
    let kept = |i: usize| {
        matches!(
            p.shares[i],
            Assigned {
                action: Action::Bucket(_),
                fresh: false,
                ..
            }
        )
    };
    let eligible: Vec<usize> = (0..held.len()).filter(|&i| hungry[i] && kept(i)).collect();
    let total = eligible.iter().fold(0u128, |a, &i| a + u128::from(targets[i]));
    if left == 0 || total == 0 {
        return p;
    }
    for i in eligible {
        let t = targets[i];
        let part = (u128::from(left) * u128::from(t) / total) as u64;
        // A new bucket of rate `t` and burst `b` costs `b` plus its look-ahead's refill, less
        // what the running one gives back; the renewal it replaces costs `renewal`.
        let rate_only = Shape::fit(t, 1);
        let renewal = p.shares[i].take_ut;
        let room = u128::from(part) + u128::from(renewal) + u128::from(unused_refill_ut(&held[i], now_us, terms));
        let Some(burst_ut) = room.checked_sub(u128::from(rate_only.refill_ut(terms.lookahead_us()))) else {
            continue;
        };
        let burst = (burst_ut / u128::from(MICRO)).min(u128::from(pool_ut / MICRO)) as u64;
        let least = least_burst(t, (u128::from(capacity_ut) * u128::from(t) / all) as u64);
        if burst < least {
            continue;
        }
        let fresh = assign(&held[i], Shape::fit(t, burst), now_us, terms);
        let kept = std::mem::replace(&mut p.shares[i], fresh);
        if !fresh.fresh || p.net_ut() > i128::from(pool_ut) {
            p.shares[i] = kept;
        }
    }
    p
}

/// Whether share `i` of `p`, now holding `held`, is a *lump*: a new bucket paid its burst and a
/// look-ahead's refill at once for a share that had none running, or at a rate above the one
/// it ran (a raise, a top-up). A share brought down to a lower rate is not one: it makes room.
pub fn is_lump(p: &GroupPlan, held: &[Held], i: usize, now_us: u64, terms: &Terms) -> bool {
    let a = &p.shares[i];
    let Action::Bucket(new) = a.action else {
        return false;
    };
    if !a.fresh || a.take_ut == 0 {
        return false;
    }
    match held[i] {
        Held::Bucket { shape, sent_us, .. } if still_running(sent_us, now_us, terms) => {
            new.rate_ut_per_s() >= shape.rate_ut_per_s()
        }
        _ => true,
    }
}

/// Whether plan `p` (made for shares holding `held`) has a lump ([`is_lump`]).
pub fn has_lumps(p: &GroupPlan, held: &[Held], now_us: u64, terms: &Terms) -> bool {
    (0..p.shares.len()).any(|i| is_lump(p, held, i, now_us, terms))
}

/// Plan `p` without its lumps ([`is_lump`]): a share that would have been raised or topped up
/// renews the bucket it runs, a share with none running is sent `DENY_ALL`; the rest as in
/// `p`. What a replica pays when the global bucket holds its renewals but not, beyond them,
/// what the others' renewals need.
pub fn without_lumps(mut p: GroupPlan, held: &[Held], now_us: u64, terms: &Terms) -> GroupPlan {
    for i in 0..p.shares.len() {
        if !is_lump(&p, held, i, now_us, terms) {
            continue;
        }
        p.shares[i] = match held[i] {
            Held::Bucket { shape, sent_us, .. } if still_running(sent_us, now_us, terms) => {
                assign(&held[i], shape, now_us, terms)
            }
            h => deny(&h, now_us, terms),
        };
    }
    p
}

/// `DENY_ALL` to every share.
pub fn deny_all(held: &[Held], now_us: u64, terms: &Terms) -> GroupPlan {
    GroupPlan {
        shares: held.iter().map(|h| deny(h, now_us, terms)).collect(),
        scale: 0.0,
    }
}

/// Max-min fair shares of `total` among `demands` (any unit): each share gets its demand, or
/// an equal part of what the smaller demands leave, whichever is less; what is left when every
/// demand is met is spread equally, so the shares sum to `total` (less rounding) whenever there
/// is at least one.
pub fn fair_split(total: u64, demands: &[u64]) -> Vec<u64> {
    let n = demands.len();
    let mut out = vec![0u64; n];
    if n == 0 {
        return out;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| demands[i]);
    let mut left = total;
    for (rank, &i) in order.iter().enumerate() {
        let equal = left / (n - rank) as u64;
        let given = demands[i].min(equal);
        out[i] = given;
        left -= given;
    }
    let each = left / n as u64;
    for o in &mut out {
        *o += each;
    }
    out
}

#[cfg(test)]
mod tests;
