//! Counting decisions: which code each bucket decision gets (`ok`, `near_limit`,
//! `over_limit`, `shadow_over_limit`, `refund`), the hits it adds, and the answers given by
//! `failure_mode` when the backend failed.

use metrics::counter;

use super::response::Target;
use crate::core::bucket::{DemandKind, MICRO};
use crate::store::Applied;
use crate::store::FailureMode;
use crate::telemetry::{count_envoyproxy_backend_error, DecisionCode, BACKEND_FAILURE_ANSWERS};

/// Counts each bucket decision of a request in its rule's [`DECISIONS`](crate::telemetry::DECISIONS) and [`HITS`](crate::telemetry::HITS): one per
/// descriptor and bucket (a quota beside a token bucket is a second decision). `code` is that
/// bucket's own verdict: a descriptor whose bucket had room is `ok` or `near_limit` even when
/// another descriptor denied the request. Near the limit: admitted with at least
/// `near_limit_ratio` of the capacity in force used after the decision.
pub(crate) fn count_decisions(targets: &[Option<Target<'_>>], applied: &Applied, near_limit_ratio: f64) {
    for t in targets.iter().flatten() {
        if let DemandKind::Consume(ut) = t.kind {
            // envoyproxy/ratelimit's series have one limit per rule: the rule's first bucket.
            let first = &t.parts[0];
            let instance = &applied.decision.instances[first.instance];
            let capacity = first.policy.capacity_at(applied.now_us);
            let used_before = capacity.saturating_sub(first.policy.balance_ut(instance.before.tokens_ut) / MICRO);
            let admitted = t.parts.iter().all(|p| applied.decision.passed[p.demand]);
            let detailed = t.envoyproxy.for_request(t.entries, &t.shared);
            detailed.as_ref().unwrap_or(t.envoyproxy).count(
                counted_hits(ut / MICRO, capacity, admitted),
                capacity,
                used_before,
                admitted,
                near_limit_ratio,
            );
        }
        for p in &t.parts {
            let (policy, instance, demand, counters) = (&*p.policy, p.instance, p.demand, p.counters);
            let passed = applied.decision.passed[demand];
            let out = &applied.decision.instances[instance];
            let kind = policy.demand_kind(t.kind);
            let (hits_ut, refund) = match kind {
                DemandKind::Consume(ut) | DemandKind::Debit { amount_ut: ut, .. } => (ut, false),
                DemandKind::Refund(ut) => (ut, true),
                DemandKind::Check | DemandKind::DebtCheck { .. } => (0, false),
            };
            if policy.debt {
                let debt_ut = policy.debt_depth_ut.saturating_sub(out.after.tokens_ut);
                // Reports are whole tokens, but what a report takes down to the floor need not
                // be (refill is counted in micro-tokens): the part cut off counts as lost, so
                // that debited and lost add up to the tokens reported.
                counters.count_debt(
                    out.debited_ut / MICRO,
                    out.lost_ut.div_ceil(MICRO),
                    debt_ut.div_ceil(MICRO),
                );
            }
            let capacity = policy.capacity_at(applied.now_us);
            let code = if refund {
                DecisionCode::Refund
            } else if !passed && t.shadow {
                DecisionCode::ShadowOverLimit
            } else if !passed {
                DecisionCode::OverLimit
            } else {
                // In whole tokens, as `limit_remaining` reports them: the micro-tokens refilled
                // since the last decision must not hide the threshold.
                let left = policy.balance_ut(out.after.tokens_ut) / MICRO;
                let used = capacity.saturating_sub(left) as f64;
                if capacity > 0 && used + 1e-9 >= near_limit_ratio * capacity as f64 {
                    DecisionCode::NearLimit
                } else {
                    DecisionCode::Ok
                }
            };
            let hits = match kind {
                // A refund beyond the capacity gives back nothing more: the bucket is full.
                DemandKind::Refund(_) => (hits_ut / MICRO).min(capacity),
                // An over account's report past the floor counts as a denial does: no more than
                // the least that cannot pass.
                DemandKind::Debit { .. } if policy.own_hits != crate::rules::OwnHits::Plain => {
                    counted_hits(hits_ut / MICRO, capacity + policy.debt_depth_ut / MICRO, passed)
                }
                // Usage is recorded whatever the decision: every hit of it counts.
                DemandKind::Debit { .. } => hits_ut / MICRO,
                _ => counted_hits(hits_ut / MICRO, capacity, passed),
            };
            counters.count(code, hits);
        }
    }
}

/// The hits one decision adds to [`HITS`](crate::telemetry::HITS) (and to envoyproxy/ratelimit's hit series): all of
/// them when admitted (at most the capacity, but for a shadow rule's would-be denials, which
/// are not admitted), and for a denial at most `capacity + 1`, the least that cannot pass: a
/// single request with `hits_addend` near 2^64 would otherwise add about 1.8e13 to a counter
/// whose rate is read as traffic.
fn counted_hits(hits: u64, capacity: u64, admitted: bool) -> u64 {
    if admitted {
        hits
    } else {
        hits.min(capacity.saturating_add(1))
    }
}

/// Counts a request answered by `mode` because the backend failed, in
/// [`BACKEND_FAILURE_ANSWERS`]. Decision counters are left alone: no decision was taken.
pub(crate) fn count_failure_answer(mode: FailureMode) {
    let answer = match mode {
        FailureMode::Allow => "allow",
        FailureMode::Deny => "deny",
        FailureMode::Error => "error",
        FailureMode::Fallback => "fallback",
    };
    counter!(BACKEND_FAILURE_ANSWERS, "answer" => answer).increment(1);
    count_envoyproxy_backend_error();
}
