//! Why a request would be limited: [`Limiter::explain`] answers what
//! [`Limiter::should_rate_limit`] would answer for a request now, and why, consuming nothing
//! (docs/operations.md, "Why was this request limited?").
//!
//! It runs the decision path itself up to the store (screening, matching, overrides,
//! `replaces`, the demands), then reads the buckets with [`Store::peek`] (one instant of the
//! store's clock, nothing written) and decides on what it read with the pure core
//! ([`decide`]: the memory store's own decision, and the arithmetic the Redis script and the
//! Postgres function are held to by the shared test vectors), walking quota mode as a decision
//! does (a denied try's refunds and usage reports carried into the next, as the store keeps
//! them); the response is then built by the same
//! code as a real answer's. So the verdict, the statuses and the headers are the ones a request
//! sent at that instant would get. What it cannot see: tokens a replica holds in a lease (they
//! are out of the store until given back), and requests decided between the explanation and
//! the next request.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

use super::limiter::{finish, noting, prepare, screen, LimitError, Limiter, Prepared};
use super::quota_mode::QuotaWalk;
use super::response::build_response;
use crate::core::bucket::{decide, BucketState, Decision, DemandKind, Refilling};
use crate::core::schedule::Plan;
use crate::rules::matcher::deepest_node;
use crate::rules::{BucketPolicy, Domain, Rule};
use crate::store::{Applied, Store};

/// What [`Limiter::explain`] found: the answer, and per descriptor why.
#[derive(Clone, Debug)]
pub struct Explanation {
    /// The instant it was decided at: microseconds since the Unix epoch, by the store's clock
    /// (the process's when no bucket was read).
    pub now_us: u64,
    /// Exactly what `ShouldRateLimit` would answer: `overall_code`, the `DescriptorStatus`es,
    /// the headers for the client and for the upstream.
    pub response: RateLimitResponse,
    /// Per descriptor of the request, in order.
    pub descriptors: Vec<DescriptorExplained>,
    /// The request's malformed parts, as decided (docs/rules.md, "Malformed requests"): the
    /// reason (`tollgate_malformed_total`'s label) and what was done. Explaining counts and
    /// logs none of them.
    pub malformed: Vec<(&'static str, String)>,
    /// Microseconds until the same request would pass: 0 when it passes now; `None` when no
    /// wait makes it pass (a malformed part denies it, it asks more than a capacity, or its
    /// buckets do not refill within the horizon schedules and quotas are walked to).
    pub passes_in_us: Option<u64>,
}

/// How one descriptor was decided.
#[derive(Clone, Debug)]
pub struct DescriptorExplained {
    /// What the descriptor reached.
    pub found: Found,
    /// Shadow mode (the rule's or the global switch): its buckets count but never deny.
    pub shadow: bool,
    /// Quota mode (the rule's or the global switch; docs/rules.md, "Quota mode").
    pub quota_mode: bool,
    /// The bucket instances it asked of, in the rule's order.
    pub buckets: Vec<BucketExplained>,
    /// The index in [`Self::buckets`] of the bucket that decides it: of those that deny, the
    /// one with the longest wait; when none denies, the one nearest to denying as its status
    /// picks it (fewest tokens left, the first on a tie, a hidden bucket only when all are).
    /// `None` without buckets.
    pub deciding: Option<usize>,
}

/// What a descriptor's entries reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// A rule: its path in the domain's descriptor tree (`api_key`, `tenant.path=/upload`).
    Rule(String),
    /// Envoy's `limit` override on the descriptor (`RateLimitDescriptor.limit`).
    Override,
    /// A rule with `unlimited: true` (its path): `OK`, `limit_remaining` the `uint32` maximum.
    Unlimited(String),
    /// No rule. `nearest` is the path of the deepest node the entries reached (`None`: not
    /// even the first entry matched); `failed_entry` the index of the first entry no node
    /// took (`None`: they all matched, and that node has no rule).
    NoRule {
        /// The deepest node reached.
        nearest: Option<String>,
        /// The first entry that matched nothing.
        failed_entry: Option<usize>,
    },
    /// The domain is not declared: the request is answered `OK`.
    UnknownDomain,
    /// Replaced by another matched rule's `replaces`.
    Replaced(String),
    /// A refund (`is_negative_hits`) refused by `refunds: false`: `OK`, nothing given back.
    RefundRefused,
    /// Malformed beyond deciding on a rule (see [`Explanation::malformed`]).
    Malformed,
}

/// One bucket instance a descriptor asked of, at [`Explanation::now_us`].
#[derive(Clone, Debug)]
pub struct BucketExplained {
    /// Its policy: name, plan, how it is reported.
    pub policy: BucketPolicy,
    /// Its state brought forward to now (refilled, trimmed to the capacity in force).
    pub state: BucketState,
    /// Its state as the store keeps it, which waits are measured from.
    pub kept: BucketState,
    /// What the descriptor asks of it (`hits_addend` in micro-tokens, a check, a refund, a
    /// usage report on a debt bucket).
    pub demand: DemandKind,
    /// Micro-tokens it must hold for the demand to pass (the request's other consuming
    /// demands on the same instance included); `None` for a refund.
    pub need_ut: Option<u64>,
    /// Whether the demand passes.
    pub passed: bool,
    /// Whether a failure counts against the request: not in shadow mode. In quota mode it
    /// denies only when every quota-mode descriptor of the request is over.
    pub enforced: bool,
    /// Microseconds until it passes (0: it passes now, as a refund always does); `None` when
    /// no wait makes it pass (more than the capacity, or no refill within the horizon
    /// schedules and quotas are walked to).
    pub wait_us: Option<u64>,
    /// Micro-tokens left after the decision, as `limit_remaining` counts them (a debt
    /// bucket's balance, 0 while in debt).
    pub remaining_ut: u64,
    /// The schedule window in force, when its plan follows schedule windows: the entry's index
    /// in the bucket's `schedule` and its cron pattern and time zone.
    pub window: Option<(usize, String, String)>,
}

impl<S: Store> Limiter<S> {
    /// What [`Limiter::should_rate_limit`] would answer for `req` now, and why; consumes
    /// nothing, counts no decision, logs no malformed part (they are in
    /// [`Explanation::malformed`]).
    ///
    /// Errors: [`LimitError::Store`] when reading the buckets fails (whatever
    /// `on_store_failure` says: an explanation of a failure mode is not one).
    pub async fn explain(&self, req: &RateLimitRequest) -> Result<Explanation, LimitError> {
        let options = self.options();
        let mut notes = Vec::new();
        let screened = noting(&mut notes, || screen(req, &options.limits));
        let rules = self.rules();
        let domain = if screened.empty_domain {
            None
        } else {
            rules.domain(&req.domain)
        };
        let denying = screened.denies() && !options.shadow_mode;
        let mut prepared = noting(&mut notes, || prepare(req, &screened, domain, options, denying));
        let unlimited = prepared.unlimited.take();
        let unlimited = unlimited.as_deref().map_or(&[][..], Vec::as_slice);
        let metadata = options.response.dynamic_metadata;
        // The demands as the request makes them: a quota-mode walk spends its refunds and
        // reports on the first try.
        let asked = prepared.demands.clone();
        let (now_us, applied, kept) = if prepared.buckets.is_empty() {
            (self.store().clock_estimate_us(), None, Vec::new())
        } else {
            let peeked = self.store().peek(&prepared.buckets).await?;
            let plans: Vec<&Plan> = prepared.buckets.iter().map(|b| &b.plan).collect();
            let mut kept = peeked.kept;
            // Quota mode as the limiter walks it.
            let mut walk = QuotaWalk::start(&prepared.targets, &mut prepared.demands, denying);
            let decision = loop {
                let decision = decide(peeked.now_us, &kept, &plans, &prepared.demands);
                let again = walk.as_mut();
                if !again.is_some_and(|w| w.again(&prepared.targets, &mut prepared.demands, &decision)) {
                    break decision;
                }
                // A denied try writes its refunds and usage reports all the same (`decide`):
                // the next try decides on the states the store would then hold.
                kept = decision.instances.iter().map(|o| o.kept()).collect();
            };
            let applied = Applied {
                now_us: peeked.now_us,
                decision,
            };
            (peeked.now_us, Some(applied), kept)
        };
        let resp = build_response(
            &prepared.targets,
            applied.as_ref(),
            &options.headers,
            &options.shadow_headers,
        );
        let response = finish(resp, req, &screened, denying, unlimited, metadata, &prepared.targets);
        let mut descriptors = Vec::with_capacity(req.descriptors.len());
        for (i, d) in req.descriptors.iter().enumerate() {
            let entries = screened.entries(i, d);
            let found = if screened.empty_domain {
                // No rules file can declare it: answered as an unknown domain (docs/rules.md).
                Found::UnknownDomain
            } else if screened.skipped(i) {
                Found::Malformed
            } else if d.is_negative_hits && !options.refunds {
                Found::RefundRefused
            } else if is_override(&prepared, i) {
                Found::Override
            } else {
                match domain {
                    None => Found::UnknownDomain,
                    Some(dom) => found_in(dom, entries, prepared.targets[i].is_some()),
                }
            };
            let target = prepared.targets[i].as_ref();
            let buckets: Vec<BucketExplained> = match (target, &applied) {
                (Some(t), Some(applied)) => t
                    .parts
                    .iter()
                    .map(|part| {
                        let demand = prepared.demands[part.demand];
                        let outcome = &applied.decision.instances[part.instance];
                        let kept = kept[part.instance];
                        let plan = &prepared.buckets[part.instance].plan;
                        let need_ut = demand.kind.need_ut(outcome.consumed_ut);
                        let passed = applied.decision.passed[part.demand];
                        BucketExplained {
                            policy: BucketPolicy::clone(&part.policy),
                            state: plan.refill_to(kept, now_us),
                            kept,
                            demand: asked[part.demand].kind,
                            need_ut,
                            passed,
                            // A quota-mode descriptor counts against the request with the others
                            // of its group, whichever the limiter's last try stood on.
                            enforced: demand.enforced || (t.quota && !t.shadow),
                            wait_us: if passed {
                                Some(0)
                            } else {
                                need_ut.and_then(|need| plan.wait_us(kept, need, now_us))
                            },
                            remaining_ut: part.policy.balance_ut(outcome.after.tokens_ut),
                            window: window_of(plan, now_us),
                        }
                    })
                    .collect(),
                _ => Vec::new(),
            };
            let deciding = deciding(&buckets);
            descriptors.push(DescriptorExplained {
                found,
                shadow: target.is_some_and(|t| t.shadow),
                quota_mode: target.is_some_and(|t| t.quota),
                buckets,
                deciding,
            });
        }
        let passes_in_us = passes_in(&response, &descriptors, applied.as_ref().map(|a| &a.decision), denying);
        Ok(Explanation {
            now_us,
            response,
            descriptors,
            malformed: notes.into_iter().map(|(m, note)| (m.as_str(), note)).collect(),
            passes_in_us,
        })
    }
}

/// Whether descriptor `i` is decided by Envoy's `limit` override (one whose unit is unknown
/// is ignored, and the descriptor decided on its rule).
fn is_override(prepared: &Prepared<'_>, i: usize) -> bool {
    prepared.targets[i].as_ref().is_some_and(|t| {
        t.parts
            .iter()
            .any(|p| matches!(p.policy, super::response::PolicyRef::Override(_)))
    })
}

/// What `entries` reach in `dom`; `decided`: whether a rule's buckets decide them (else a
/// rule they reach was dropped by another's `replaces`).
fn found_in(dom: &Domain, entries: &[Entry], decided: bool) -> Found {
    let path = |node: usize| dom.nodes[node].path.clone();
    match deepest_node(dom, entries) {
        (Some(node), n) if n == entries.len() => match &dom.nodes[node].rule {
            Some(Rule::Unlimited { .. }) => Found::Unlimited(path(node)),
            Some(Rule::Limited { .. }) if decided => Found::Rule(path(node)),
            Some(Rule::Limited { .. }) => Found::Replaced(path(node)),
            None => Found::NoRule {
                nearest: Some(path(node)),
                failed_entry: None,
            },
        },
        (node, n) => Found::NoRule {
            nearest: node.map(path),
            failed_entry: Some(n),
        },
    }
}

/// The bucket that decides a descriptor: of the enforced demands that fail, the longest wait
/// (`None`, never, is longest); else the one its status reports (`status_verdict`'s rule:
/// among the buckets not hidden, or all when all are, the fewest tokens left, the first on a
/// tie).
fn deciding(buckets: &[BucketExplained]) -> Option<usize> {
    let failing = buckets
        .iter()
        .enumerate()
        .filter(|(_, b)| b.enforced && !b.passed)
        .max_by_key(|(_, b)| b.wait_us.map_or(u128::MAX, u128::from))
        .map(|(i, _)| i);
    let all_hidden = buckets.iter().all(|b| b.policy.hidden);
    let nearest = buckets
        .iter()
        .enumerate()
        .filter(|(_, b)| all_hidden || !b.policy.hidden)
        .min_by_key(|(i, b)| (b.remaining_ut, *i))
        .map(|(i, _)| i);
    failing.or(nearest)
}

/// When the request passes: now when it does; else when every enforced demand that fails can
/// pass (each instance's wait for what the request asks of it). A malformed denial never
/// passes. In quota mode the request stands on one quota-mode descriptor at a time, so the
/// earliest of theirs is enough.
fn passes_in(
    response: &RateLimitResponse,
    descriptors: &[DescriptorExplained],
    decision: Option<&Decision>,
    denying: bool,
) -> Option<u64> {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    if response.overall_code != Code::OverLimit as i32 {
        return Some(0);
    }
    if denying || decision.is_none() {
        return None;
    }
    let wait = |d: &DescriptorExplained| -> Option<u64> {
        d.buckets
            .iter()
            .filter(|b| !b.passed && (b.enforced || d.quota_mode) && !d.shadow)
            .try_fold(0, |most, b| b.wait_us.map(|w| most.max(w)))
    };
    let mut overall = Some(0u64);
    let mut quota: Option<Option<u64>> = None;
    for d in descriptors {
        if d.quota_mode {
            let w = wait(d);
            quota = Some(match quota {
                None => w,
                Some(earliest) => match (earliest, w) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                },
            });
        } else {
            overall = overall.zip(wait(d)).map(|(a, b)| a.max(b));
        }
    }
    match quota {
        Some(q) => overall.zip(q).map(|(a, b)| a.max(b)),
        None => overall,
    }
}

/// The schedule window in force on `plan` at `now_us`: the active entry's index, pattern and
/// time zone.
fn window_of(plan: &Plan, now_us: u64) -> Option<(usize, String, String)> {
    match plan {
        Plan::Scheduled(schedule) => schedule.active_entry(now_us).map(|i| {
            let entry = &schedule.entries()[i];
            (i, entry.pattern().to_owned(), entry.timezone().name().to_owned())
        }),
        Plan::Reloaded(reloaded) => window_of(reloaded.after(), now_us),
        _ => None,
    }
}
