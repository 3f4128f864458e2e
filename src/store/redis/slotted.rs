//! A request over several Redis Cluster slots (docs/backends.md, "Cluster"): one script call
//! per slot, in parallel, each on its slot's master; all or nothing across them (when any slot
//! denies, what the others took is given back at once: a brief under-admission, never an
//! over-admission); the slots' states moved to the latest master's clock. A slot whose master
//! failed ([`StoreError::NodeFailed`]) is decided on the fallback when there is one, and its
//! share given back there.

use futures_util::future::join_all;

use super::{script, RedisStore};
use crate::core::bucket::{Decision, Demand, DemandKind, InstanceOutcome};
use crate::store::{Applied, BucketRef, PartFallback, StoreError};

impl RedisStore {
    /// Decides the buckets of one slot ([`RedisStore::decide_group`]); when that slot's Cluster
    /// master failed ([`StoreError::NodeFailed`]) and there is a `fallback`, decides them there
    /// instead. Also whether the fallback decided.
    async fn decide_part<F: PartFallback>(
        &self,
        buckets: &[&BucketRef],
        demands: &[Demand],
        fallback: Option<&F>,
        deadline: tokio::time::Instant,
    ) -> Result<(script::Decided, bool), StoreError> {
        // The result goes out of scope before the fallback's await, so the future does not
        // keep room for it there.
        let (fallback, timed_out) = match (self.decide_group(buckets, demands, Some(deadline)).await, fallback) {
            (Err(e @ StoreError::NodeFailed(_)), Some(fallback)) => {
                (fallback, matches!(e.cause(), StoreError::Timeout(_)))
            }
            (result, _) => return result.map(|d| (d, false)),
        };
        if let Some(c) = self.cluster() {
            c.node_failed(timed_out);
        }
        // Boxed: the fallback's future (a Postgres decision's) would otherwise sit inside every
        // Redis decision's, which is moved at every request.
        Box::pin(decide_on_fallback(fallback, buckets, demands)).await
    }

    /// Decides a request in Cluster mode: one call per slot, all or nothing across them, a
    /// slot whose master failed decided on `fallback` when there is one.
    pub(super) async fn apply_slots<F: PartFallback>(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
        fallback: Option<&F>,
        deadline: tokio::time::Instant,
    ) -> Result<Applied, StoreError> {
        let groups = self.groups(buckets);
        if groups.len() == 1 {
            let refs: Vec<&BucketRef> = buckets.iter().collect();
            let (d, _) = self.decide_part(&refs, demands, fallback, deadline).await?;
            return Ok(Applied {
                now_us: d.now_us,
                decision: Decision {
                    denied: d.denied,
                    passed: d.passed,
                    instances: d.instances,
                },
            });
        }
        // Cluster, several slots: one call per slot, in parallel.
        let split: Vec<(Vec<&BucketRef>, Vec<Demand>, Vec<usize>)> = groups
            .iter()
            .map(|g| {
                let refs = g.iter().map(|&i| &buckets[i]).collect();
                let (ds, idx): (Vec<Demand>, Vec<usize>) = demands
                    .iter()
                    .enumerate()
                    .filter_map(|(j, d)| {
                        let local = g.iter().position(|&i| i == d.instance)?;
                        Some((Demand { instance: local, ..*d }, j))
                    })
                    .unzip();
                (refs, ds, idx)
            })
            .collect();
        let results = join_all(
            split
                .iter()
                .map(|(refs, ds, _)| self.decide_part(refs, ds, fallback, deadline)),
        )
        .await;
        let denied = results.iter().any(|r| matches!(r, Ok((d, _)) if d.denied));
        let failed = results.iter().any(|r| r.is_err());
        if denied || failed {
            // All or nothing across slots: give back exactly what the admitting slots took,
            // shadow demands' share included (a single call takes nothing on a denial either);
            // their refunds stay applied, as refunds always are.
            // A refund has a budget of its own: the request's may be spent.
            let refund_deadline = Some(tokio::time::Instant::now() + self.inner.timeout);
            let refunds = split.iter().zip(&results).filter_map(|((refs, _, _), r)| {
                let (d, on_fallback) = r.as_ref().ok()?;
                let back: Vec<Demand> = d
                    .instances
                    .iter()
                    .enumerate()
                    .filter_map(|(i, o)| {
                        let taken = taken_ut(d, o);
                        (taken > 0).then_some(Demand {
                            instance: i,
                            kind: DemandKind::Refund(taken),
                            enforced: false,
                        })
                    })
                    .collect();
                (!back.is_empty()).then_some(async move {
                    match (on_fallback, fallback) {
                        (true, Some(f)) => {
                            let owned: Vec<BucketRef> = refs.iter().map(|&b| b.clone()).collect();
                            f.give_back(&owned, &back).await.map(|_| ())
                        }
                        _ => self.decide_group(refs, &back, refund_deadline).await.map(|_| ()),
                    }
                })
            });
            let refunded = join_all(refunds).await;
            for r in &refunded {
                if let Err(e) = r {
                    crate::telemetry::call::error_about_call!(error = %e, "could not refund a slot after another slot denied: tokens are held until they refill");
                }
            }
        }
        let mut decided = Vec::with_capacity(results.len());
        for r in results {
            decided.push(r?.0);
        }
        Ok(merge_slots(buckets, demands.len(), &groups, &split, decided, denied))
    }

    /// A Cluster decision: every call to a master within `command_timeout_ms` of the request's
    /// arrival, so that a master that does not answer fails its slots' part as that master's
    /// failure ([`StoreError::NodeFailed`]), not the store's; a fallback then has its own
    /// budget. The whole is still bounded: by the budget twice over (a refund after a denial
    /// has one of its own) and the fallback's.
    pub(super) async fn apply_cluster<F: PartFallback>(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
        fallback: Option<&F>,
    ) -> Result<Applied, StoreError> {
        let deadline = tokio::time::Instant::now() + self.inner.timeout;
        self.apply_slots(buckets, demands, fallback, deadline).await
    }
}

/// `buckets` decided on `fallback` (their Cluster master failed), as a slot's decision, and
/// `true`. Errors: the fallback's, as the node's failure: the store-wide breaker must not count
/// it, nor the whole request be sent to the fallback again.
async fn decide_on_fallback<F: PartFallback>(
    fallback: &F,
    buckets: &[&BucketRef],
    demands: &[Demand],
) -> Result<(script::Decided, bool), StoreError> {
    let owned: Vec<BucketRef> = buckets.iter().map(|&b| b.clone()).collect();
    let applied = fallback
        .decide(&owned, demands)
        .await
        .map_err(|e| StoreError::NodeFailed(Box::new(e)))?;
    let Decision {
        denied,
        passed,
        instances,
    } = applied.decision;
    let decided = script::Decided {
        now_us: applied.now_us,
        denied,
        passed,
        instances,
    };
    Ok((decided, true))
}

/// The fallback of a store that has none (`None` of it is what is passed).
pub(super) enum NoFallback {}

impl PartFallback for NoFallback {
    async fn decide(&self, _: &[BucketRef], _: &[Demand]) -> Result<Applied, StoreError> {
        match *self {}
    }

    async fn give_back(&self, _: &[BucketRef], _: &[Demand]) -> Result<Applied, StoreError> {
        match *self {}
    }
}

/// Micro-tokens a slot's decision `d` took from the bucket `o` (the script takes a bucket's
/// consuming demands, shadow ones included, only when the request is admitted and the bucket
/// holds them all): what a refund must give back. Not `consumed_ut`, which is what was asked.
fn taken_ut(d: &script::Decided, o: &InstanceOutcome) -> u64 {
    if !d.denied && o.consumed_ut > 0 && o.before.tokens_ut >= o.consumed_ut {
        o.consumed_ut
    } else {
        0
    }
}

/// Puts the slots' decisions of one request back together in the request's order. Each slot
/// was decided at the clock of the node holding it, and nodes' clocks may differ: the request's
/// `now_us` is the latest, and every other slot's states are moved by the difference, so a wait
/// measured from them at that `now_us` is the wait at their own node's clock (a client told to
/// retry then is not early on a node that runs behind). When another slot denied, an admitting
/// slot's buckets are reported as its refund left them: as before, less nothing, plus their own
/// refunds.
fn merge_slots(
    buckets: &[BucketRef],
    demands: usize,
    groups: &[Vec<usize>],
    split: &[(Vec<&BucketRef>, Vec<Demand>, Vec<usize>)],
    decided: Vec<script::Decided>,
    denied: bool,
) -> Applied {
    let now_us = decided.iter().map(|d| d.now_us).max().unwrap_or(0);
    let mut passed = vec![false; demands];
    let mut instances = vec![None; buckets.len()];
    for ((_, _, idx), (g, d)) in split.iter().zip(groups.iter().zip(decided)) {
        let shift = now_us - d.now_us;
        for (local, &j) in idx.iter().enumerate() {
            passed[j] = d.passed[local];
        }
        for (local, &i) in g.iter().enumerate() {
            let mut o: InstanceOutcome = d.instances[local];
            if denied && !d.denied {
                let taken = taken_ut(&d, &o);
                if taken > 0 {
                    let capacity = buckets[i].plan.limit_at(o.after.updated_us).capacity_ut;
                    o.after.tokens_ut = o
                        .after
                        .tokens_ut
                        .saturating_add(taken)
                        .min(capacity.max(o.before.tokens_ut));
                }
            }
            for state in [&mut o.stored, &mut o.before, &mut o.after] {
                state.updated_us = state.updated_us.saturating_add(shift);
            }
            instances[i] = Some(o);
        }
    }
    Applied {
        now_us,
        decision: Decision {
            denied,
            passed,
            instances: instances
                .into_iter()
                .map(|o| o.expect("every bucket is in a group"))
                .collect(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bucket::BucketState;

    fn outcome(tokens: u64, updated_us: u64) -> InstanceOutcome {
        let state = BucketState {
            tokens_ut: tokens,
            updated_us,
        };
        InstanceOutcome {
            stored: state,
            before: state,
            after: state,
            consumed_ut: 0,
            debited_ut: 0,
            lost_ut: 0,
            changed: false,
        }
    }

    /// Two slots on nodes whose clocks differ by 5 s: the request's time is the later one and
    /// the other slot's states move by the difference, so that a wait measured from them at
    /// that time is the wait at their own node's clock. (Before, they kept their own node's
    /// times and a wait on the node behind came out 5 s short: a client retried too early.)
    #[test]
    fn slots_decided_at_different_clocks_are_merged_at_the_latest() {
        let plan = crate::core::schedule::Plan::Fixed(crate::core::bucket::Limit::new(
            10,
            crate::core::bucket::Rate::per(1, 1_000_000).unwrap(),
        ));
        let buckets = vec![
            BucketRef {
                key: "ahead".into(),
                plan: plan.clone(),
                lease_ut: 0,
            },
            BucketRef {
                key: "behind".into(),
                plan: plan.clone(),
                lease_ut: 0,
            },
        ];
        let groups = vec![vec![0], vec![1]];
        let split: Vec<(Vec<&BucketRef>, Vec<Demand>, Vec<usize>)> =
            vec![(vec![&buckets[0]], vec![], vec![]), (vec![&buckets[1]], vec![], vec![])];
        let t = 1_780_000_000_000_000;
        let decided = vec![
            script::Decided {
                now_us: t + 5_000_000,
                denied: false,
                passed: vec![],
                instances: vec![outcome(0, t + 5_000_000)],
            },
            script::Decided {
                now_us: t,
                denied: false,
                passed: vec![],
                instances: vec![outcome(0, t)],
            },
        ];
        let merged = merge_slots(&buckets, 0, &groups, &split, decided, false);
        assert_eq!(merged.now_us, t + 5_000_000);
        let behind = merged.decision.instances[1];
        assert_eq!(behind.after.updated_us, t + 5_000_000);
        // Empty at one token a second: a token in a second on its own node's clock.
        assert_eq!(plan.wait_us(behind.kept(), 1_000_000, merged.now_us), Some(1_000_000));
    }
}
