//! envoyproxy/ratelimit's quota mode over tollgate's all-or-nothing decisions (docs/rules.md,
//! "Quota mode").
//!
//! Their rule: a request is over the limit iff a descriptor without quota mode is over, or every
//! quota-mode descriptor is. A store decides one way only (denied iff an enforced demand
//! fails; then nothing is taken anywhere), so the limiter makes the request stand on one
//! quota-mode descriptor at a time: that descriptor's demands are enforced, the other
//! quota-mode ones are not (they take tokens where they can, like shadow ones).
//!
//! - Admitted: every descriptor without quota mode passed and so did the one stood on, so by
//!   their rule the request passes; the store took what it took atomically.
//! - Denied by a descriptor without quota mode: denied by their rule too.
//! - Denied only by the one stood on: nothing was taken; if another quota-mode descriptor passed
//!   in that same decision the request stands on it in a new call, else every quota-mode
//!   descriptor was over at one instant and the request is denied.
//!
//! So every call is all or nothing and a denied request takes nothing, as without quota mode;
//! the cost is one more call for each quota-mode descriptor found over first, at most one per
//! quota-mode descriptor. A request with one quota-mode descriptor is decided as without quota
//! mode (it is then the only one that can let the request pass), and one with a shadow
//! quota-mode descriptor never stands on any (a shadow descriptor always passes, so the
//! quota-mode ones can never all be over).

use smallvec::SmallVec;

use crate::core::bucket::{Decision, Demand, DemandKind};
use crate::decision::response::Target;

/// The quota-mode descriptors of a request that the limiter has to choose between: indices
/// into the request's targets, in request order. Empty when none, when one of them is in
/// shadow mode, and on a request denied anyway (a malformed part).
#[derive(Default)]
pub(crate) struct QuotaGroup(SmallVec<[usize; 4]>);

impl QuotaGroup {
    /// The group of `targets`.
    pub(crate) fn of(targets: &[Option<Target<'_>>]) -> QuotaGroup {
        let mut group = SmallVec::new();
        for (i, t) in targets.iter().enumerate() {
            if let Some(t) = t.as_ref().filter(|t| t.quota) {
                if t.shadow {
                    return QuotaGroup::default();
                }
                group.push(i);
            }
        }
        QuotaGroup(group)
    }

    /// The first descriptor to stand on, if any.
    pub(crate) fn first(&self) -> Option<usize> {
        self.0.first().copied()
    }

    /// How many quota-mode descriptors the group holds.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Enforces the demands of the descriptor `standing` and no other quota-mode one's.
    pub(crate) fn stand_on(&self, standing: usize, targets: &[Option<Target<'_>>], demands: &mut [Demand]) {
        for &i in &self.0 {
            for p in targets[i].iter().flat_map(|t| &t.parts) {
                demands[p.demand].enforced = i == standing;
            }
        }
    }

    /// After `decision` on `demands` while standing on `standing`: the quota-mode descriptor to
    /// stand on next, or `None` when `decision` is the request's (admitted; denied by a
    /// descriptor without quota mode; or every quota-mode descriptor over).
    pub(crate) fn next(
        &self,
        standing: usize,
        targets: &[Option<Target<'_>>],
        demands: &[Demand],
        decision: &Decision,
    ) -> Option<usize> {
        if !decision.denied {
            return None;
        }
        let parts_of = |i: usize| targets[i].iter().flat_map(|t| &t.parts);
        let by_standing = |d: usize| parts_of(standing).any(|p| p.demand == d);
        let denied_by_other = demands
            .iter()
            .enumerate()
            .any(|(d, demand)| demand.enforced && !decision.passed[d] && !by_standing(d));
        if denied_by_other {
            return None;
        }
        self.0
            .iter()
            .copied()
            .find(|&i| i != standing && parts_of(i).all(|p| decision.passed[p.demand]))
    }
}

/// One request's walk over its quota-mode descriptors: the descriptor it stands on, and how
/// many tries it made. The limiter walks it with store calls, `explain` with the pure core,
/// so both stand on the same descriptors in the same order.
pub(crate) struct QuotaWalk {
    group: QuotaGroup,
    /// The descriptor stood on, and the tries made: `u32`s, as this is held across the
    /// limiter's store call, and every byte of that future is copied per request.
    standing: u32,
    tries: u32,
}

impl QuotaWalk {
    /// The walk of a request with `targets`, with `demands` set for its first try; `None`
    /// when it has no quota-mode group (or is `denying`: a malformed part denies it anyway),
    /// so that its one try keeps nothing of this.
    pub(crate) fn start(targets: &[Option<Target<'_>>], demands: &mut [Demand], denying: bool) -> Option<QuotaWalk> {
        if denying {
            return None;
        }
        let group = QuotaGroup::of(targets);
        let standing = group.first()?;
        group.stand_on(standing, targets, demands);
        Some(QuotaWalk {
            group,
            standing: u32::try_from(standing).ok()?,
            tries: 0,
        })
    }

    /// After a try decided `decision`: whether the request tries again, at most once per
    /// quota-mode descriptor; then `demands` are set for that try (standing on the next
    /// descriptor, refunds and reports spent: the try before applied them).
    pub(crate) fn again(
        &mut self,
        targets: &[Option<Target<'_>>],
        demands: &mut [Demand],
        decision: &Decision,
    ) -> bool {
        self.tries += 1;
        let next = self.group.next(self.standing as usize, targets, demands, decision);
        match next.and_then(|n| u32::try_from(n).ok()) {
            Some(next) if (self.tries as usize) < self.group.len() => {
                self.standing = next;
                self.group.stand_on(next as usize, targets, demands);
                spend_refunds(demands);
                true
            }
            _ => false,
        }
    }
}

/// Makes every refund and usage report of `demands` give and take nothing: a store applies
/// both whatever it decides, and a request's were applied on its first call. A report is still
/// answered by the balance before it: the one its first call took from, so its threshold is
/// lowered by what that call debited.
fn spend_refunds(demands: &mut [Demand]) {
    for d in demands {
        match d.kind {
            DemandKind::Refund(_) => d.kind = DemandKind::Refund(0),
            DemandKind::Debit { amount_ut, depth_ut } => {
                d.kind = DemandKind::Debit {
                    amount_ut: 0,
                    depth_ut: depth_ut.saturating_sub(amount_ut),
                }
            }
            _ => {}
        }
    }
}
