//! One round of a group: plan, pay in the store, queue the messages, give back.

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::TokenBucket;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use std::collections::HashMap;

use super::messages::assignment;
use super::{limit_at, GroupCell, GroupState, Hub, ShareKey};
use crate::core::bucket::{Demand, DemandKind, MICRO};
use crate::rlqs::group::METER_CAPACITY;
use crate::rlqs::plan::{self, GroupPlan};
use crate::store::Store;

/// Plans cut to a budget tried in one round before every share is denied.
const CUT_ATTEMPTS: usize = 3;

/// What the store made of a plan.
enum Settled {
    /// Taken (or given back): the plan may be sent.
    Paid(GroupPlan),
    /// Denied: the global bucket holds only `budget_ut` micro-tokens, one token is there
    /// again in `wait_us` (none: not within the look-ahead).
    Short { budget_ut: u64, wait_us: Option<u64> },
    /// The store failed.
    Failed,
}

impl Settled {
    fn paid(self) -> Option<GroupPlan> {
        match self {
            Settled::Paid(plan) => Some(plan),
            _ => None,
        }
    }
}

impl<S: Store> Hub<S> {
    /// Plans, pays for and sends the next assignments of one group.
    pub(super) async fn run_group(&self, cell: &GroupCell, only: Option<&[ShareKey]>) {
        let mut state = cell.lock().await;
        if state.group.is_empty() {
            return;
        }
        // Every stream must have room for its message before anything is paid for: a
        // message that cannot be queued would leave an Envoy on an assignment whose refill
        // was given back.
        let mut permits = HashMap::new();
        let mut gone = Vec::new();
        {
            let inner = self.lock();
            for ((stream, key), _) in state.group.shares() {
                if permits.contains_key(stream) {
                    continue;
                }
                match inner.streams.get(stream).map(|s| s.tx.clone().try_reserve_owned()) {
                    Some(Ok(p)) => {
                        permits.insert(*stream, (p, Vec::new()));
                    }
                    _ => gone.push((*stream, key.clone())),
                }
            }
        }
        for key in &gone {
            state.group.remove(key);
        }
        if state.group.is_empty() {
            return;
        }
        let now = self.clock.now_us();
        // The round must be on its way within half the delivery margin of `now` (what the
        // plan is timed from): past it, nothing is sent, and what was taken is an
        // under-admission (the Envoys keep what they hold, paid until it expires).
        let deadline = std::time::Duration::from_micros(self.terms.margin_us / 2);
        let plan = match tokio::time::timeout(deadline, self.pay(&mut state, now, only)).await {
            Ok(plan) => plan,
            Err(_) => {
                self.metrics.store_call(false);
                tracing::warn!(domain = %state.domain, "RLQS: the store took longer than half the delivery margin; assignments not renewed");
                None
            }
        };
        let Some(plan) = plan else { return };
        state.group.commit(&plan);
        for (((stream, key), _), assigned) in state.group.shares().zip(&plan.shares) {
            let action = match assigned.action {
                plan::Action::Bucket(shape) => {
                    self.metrics.assigned("token_bucket");
                    assignment(
                        key,
                        Strategy::TokenBucket(TokenBucket {
                            max_tokens: shape.max_tokens,
                            tokens_per_fill: Some(UInt32Value {
                                value: shape.tokens_per_fill,
                            }),
                            fill_interval: Some(PbDuration {
                                seconds: i64::from(shape.fill_seconds),
                                nanos: shape.fill_nanos(),
                            }),
                        }),
                        self.terms.ttl_us,
                    )
                }
                plan::Action::DenyAll => {
                    self.metrics.assigned("deny_all");
                    assignment(
                        key,
                        Strategy::BlanketRule(BlanketRule::DenyAll as i32),
                        self.terms.ttl_us,
                    )
                }
                plan::Action::Unchanged => continue,
            };
            if let Some((_, actions)) = permits.get_mut(stream) {
                actions.push(action);
            }
        }
        for (_, (permit, actions)) in permits {
            if !actions.is_empty() {
                permit.send(Ok(RateLimitQuotaResponse { bucket_action: actions }));
            }
        }
        // Only now, with the replacements queued, what the round gives back beyond what it
        // took goes back. A failed give-back is an under-admission.
        let give = u64::try_from(-plan.net_ut()).unwrap_or(0);
        if give > 0 {
            let demands: Vec<Demand> = (0..state.resolved.buckets.len())
                .map(|instance| Demand {
                    instance,
                    kind: DemandKind::Refund(give),
                    enforced: true,
                })
                .collect();
            let given = self.limiter.store().apply(&state.resolved.buckets, &demands).await;
            self.metrics.store_call(given.is_ok());
            if let Ok(given) = given {
                let instances = &given.decision.instances;
                let before = instances.iter().map(|i| i.before.tokens_ut).min().unwrap_or(0);
                let after = instances.iter().map(|i| i.after.tokens_ut).min().unwrap_or(0);
                let limit = limit_at(&state.resolved, given.now_us);
                state.group.saw_tokens(before, after, given.now_us, &limit);
            }
        }
    }

    /// The plan for a group, paid for in the store: in full, else cut to what the global
    /// bucket holds, else `DENY_ALL` (which only gives back). `None` when the store failed:
    /// nothing is sent, and the Envoys keep what they hold until it expires.
    ///
    /// A plan with lumps (new buckets, raises, top-ups: paid ahead, a look-ahead's refill at
    /// once) is paid only if the global bucket keeps, after it, a period of the refill the
    /// others (other replicas, RLS clients) are counted on: taken from under another replica's
    /// renewal, a lump would cut that replica's share down, and its raise back would cut this
    /// one's. Renewals alone may take the bucket to empty.
    async fn pay(&self, state: &mut GroupState, now: u64, only: Option<&[ShareKey]>) -> Option<GroupPlan> {
        let limit = limit_at(&state.resolved, now);
        if now < state.group.blocked_until_us {
            let plan = state.group.deny_all(now, &self.terms, only);
            return self.settle(state, plan, 0).await.paid();
        }
        let keep = state.group.reserve_ut(&limit, &self.terms);
        let held: Vec<plan::Held> = state.group.shares().map(|(_, s)| s.held).collect();
        let lumps = |p: &GroupPlan| plan::has_lumps(p, &held, now, &self.terms);
        let full = state.group.plan(&limit, now, &self.terms, None, only);
        tracing::debug!(
            rule = %state.resolved.rule,
            shares = state.group.len(),
            split_per_s = state.group.split_ut_per_s(&limit) as f64 / 1e6,
            pool = state.group.pool_left_ut(&limit, now) as f64 / 1e6,
            net = full.net_ut() as f64 / 1e6,
            fresh = full.shares.iter().filter(|s| s.fresh).count(),
            keep = keep as f64 / 1e6,
            "RLQS round"
        );
        let keep_full = if lumps(&full) { keep } else { 0 };
        let (mut budget, mut wait) = match self.settle(state, full, keep_full).await {
            Settled::Paid(plan) => return Some(plan),
            Settled::Short { budget_ut, wait_us } => (budget_ut, wait_us),
            Settled::Failed => return None,
        };
        // Cut to what the bucket holds, lumps to what it holds beyond the others' renewals
        // while every running bucket is still renewed (else without lumps: renewals may take
        // what is kept for the others, lumps never); when others took some meanwhile (RLS
        // clients, other replicas), cut again to what it then holds, a few times, before
        // denying.
        for _ in 0..CUT_ATTEMPTS {
            let cut = state.group.plan(&limit, now, &self.terms, Some(budget), only);
            let within = state
                .group
                .plan(&limit, now, &self.terms, Some(budget.saturating_sub(keep)), only);
            let (cut, kept) = if !lumps(&cut) {
                (cut, 0)
            } else if renews_all(&cut, &within) && !within.denies_all() {
                let kept = if lumps(&within) { keep } else { 0 };
                (within, kept)
            } else {
                (plan::without_lumps(cut, &held, now, &self.terms), 0)
            };
            tracing::debug!(
                budget = budget as f64 / 1e6,
                net = cut.net_ut() as f64 / 1e6,
                scale = cut.scale,
                denies = cut.denies_all(),
                "RLQS round cut to the budget"
            );
            if cut.denies_all() {
                // Spent: no store call until one token is there again (a quota's reset), for
                // at most 30 periods, so a refund by an operator shows soon.
                let most = self.settings.assignment_period_ms.0.saturating_mul(30_000);
                state.group.blocked_until_us = now.saturating_add(wait.unwrap_or(most).min(most));
            }
            match self.settle(state, cut, kept).await {
                Settled::Paid(plan) => return Some(plan),
                Settled::Short { budget_ut, wait_us } => (budget, wait) = (budget_ut, wait_us),
                Settled::Failed => return None,
            }
        }
        let plan = state.group.deny_all(now, &self.terms, only);
        self.settle(state, plan, 0).await.paid()
    }

    /// Asks the store for a plan's net take (a net give-back goes back once the plan's
    /// messages are queued, in `run_group`), only if `keep_ut` micro-tokens are left after it
    /// (for a plan with lumps, [`Hub::pay`]).
    async fn settle(&self, state: &mut GroupState, plan: GroupPlan, keep_ut: u64) -> Settled {
        let Ok(take) = u64::try_from(plan.net_ut()) else {
            return Settled::Paid(plan);
        };
        if take == 0 {
            return Settled::Paid(plan);
        }
        let kind = DemandKind::Consume(take);
        let n = state.resolved.buckets.len();
        let mut demands: Vec<Demand> = (0..n)
            .map(|instance| Demand {
                instance,
                kind,
                enforced: true,
            })
            .collect();
        if keep_ut > 0 {
            // Passes iff the bucket holds more than its depth: the take and what is kept.
            let depth_ut = take.saturating_add(keep_ut) - 1;
            demands.extend((0..n).map(|instance| Demand {
                instance,
                kind: DemandKind::DebtCheck { depth_ut },
                enforced: true,
            }));
        }
        // This replica's demand goes on the meter in the same call, taken whatever the call
        // decides (a usage report's kind of demand), and never denying it.
        let now = self.clock.now_us();
        let limit = limit_at(&state.resolved, now);
        let mut buckets = state.resolved.buckets.clone();
        buckets.push(state.meter.clone());
        let low = state.group.meter_low();
        let metered = if low {
            METER_CAPACITY * MICRO
        } else {
            state.group.meter_take_ut(&limit, now)
        };
        demands.push(Demand {
            instance: n,
            kind: if low {
                DemandKind::Refund(metered)
            } else {
                DemandKind::Debit {
                    amount_ut: metered,
                    depth_ut: 0,
                }
            },
            enforced: false,
        });
        let applied = self.limiter.store().apply(&buckets, &demands).await;
        self.metrics.store_call(applied.is_ok());
        match applied {
            Ok(applied) => {
                let (instances, meter) = applied.decision.instances.split_at(n);
                let limit = limit_at(&state.resolved, applied.now_us);
                let before = instances.iter().map(|i| i.before.tokens_ut).min().unwrap_or(0);
                let after = instances.iter().map(|i| i.after.tokens_ut).min().unwrap_or(0);
                if let Some(m) = meter.first() {
                    state
                        .group
                        .saw_meter(m.before.tokens_ut, m.after.tokens_ut, applied.now_us);
                }
                if !applied.decision.denied {
                    state.group.saw_tokens(before, after, applied.now_us, &limit);
                    return Settled::Paid(plan);
                }
                state.group.saw_tokens(before, before, applied.now_us, &limit);
                Settled::Short {
                    budget_ut: before,
                    wait_us: instances
                        .iter()
                        .zip(&state.resolved.buckets)
                        .filter_map(|(i, b)| b.plan.wait_us(i.kept(), MICRO, applied.now_us))
                        .max(),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, domain = %state.domain, "RLQS: the store failed; assignments not renewed");
                Settled::Failed
            }
        }
    }
}

/// Whether `within` renews every bucket that `cut` renews, as `cut` does.
fn renews_all(cut: &GroupPlan, within: &GroupPlan) -> bool {
    cut.shares
        .iter()
        .zip(&within.shares)
        .all(|(c, w)| c.fresh || !matches!(c.action, plan::Action::Bucket(_)) || c == w)
}
