//! The RLQS series ([`crate::telemetry`]'s `RLQS_*` names), counted through handles.

use metrics::{counter, gauge, Counter, Gauge};

use crate::core::bucket::MICRO;
use crate::decision::limiter::ResolveError;
use crate::telemetry::{
    RLQS_ASSIGNMENTS, RLQS_BUCKETS, RLQS_GLOBAL_BUCKETS, RLQS_IGNORED, RLQS_OUTSTANDING_TOKENS, RLQS_REPORTED_REQUESTS,
    RLQS_REPORTS, RLQS_STORE_CALLS, RLQS_STREAMS, RLQS_STREAMS_REFUSED, RLQS_UNMATCHED,
};

/// Why part of a report was ignored ([`RLQS_IGNORED`]'s `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ignored {
    /// A message without a domain.
    EmptyDomain,
    /// A usage without a bucket id, or with an empty one.
    EmptyBucketId,
    /// A negative, malformed or over-a-day `time_elapsed`.
    BadDuration,
    /// More than 2^40 requests in one report.
    AbsurdCount,
    /// A new bucket beyond `rlqs.max_buckets_per_stream`.
    TooManyBuckets,
    /// A stream whose Envoy did not read its assignments (ended).
    SlowStream,
}

/// [`RLQS_UNMATCHED`]'s reasons.
const UNMATCHED_REASONS: [&str; 4] = ["unknown_domain", "no_rule", "invalid", "debt_bucket"];

/// [`RLQS_ASSIGNMENTS`]'s strategies.
const STRATEGIES: [&str; 4] = ["token_bucket", "allow_all", "deny_all", "abandon"];

impl Ignored {
    const ALL: [Ignored; 6] = [
        Ignored::EmptyDomain,
        Ignored::EmptyBucketId,
        Ignored::BadDuration,
        Ignored::AbsurdCount,
        Ignored::TooManyBuckets,
        Ignored::SlowStream,
    ];

    fn label(self) -> &'static str {
        match self {
            Ignored::EmptyDomain => "empty_domain",
            Ignored::EmptyBucketId => "empty_bucket_id",
            Ignored::BadDuration => "bad_duration",
            Ignored::AbsurdCount => "absurd_count",
            Ignored::TooManyBuckets => "too_many_buckets",
            Ignored::SlowStream => "slow_stream",
        }
    }
}

/// The hub's handles.
pub(crate) struct RlqsMetrics {
    streams: Gauge,
    refused: Counter,
    reports: Counter,
    allowed: Counter,
    denied: Counter,
    buckets: Gauge,
    groups: Gauge,
    outstanding: Gauge,
    store_ok: Counter,
    store_error: Counter,
}

impl RlqsMetrics {
    pub(crate) fn new() -> RlqsMetrics {
        // Every labelled series from the start, at 0: a dashboard or an alert over a rate
        // finds them before the first one counts.
        for why in Ignored::ALL {
            counter!(RLQS_IGNORED, "reason" => why.label()).increment(0);
        }
        for reason in UNMATCHED_REASONS {
            counter!(RLQS_UNMATCHED, "reason" => reason).increment(0);
        }
        for strategy in STRATEGIES {
            counter!(RLQS_ASSIGNMENTS, "strategy" => strategy).increment(0);
        }
        RlqsMetrics {
            streams: gauge!(RLQS_STREAMS),
            refused: counter!(RLQS_STREAMS_REFUSED),
            reports: counter!(RLQS_REPORTS),
            allowed: counter!(RLQS_REPORTED_REQUESTS, "outcome" => "allowed"),
            denied: counter!(RLQS_REPORTED_REQUESTS, "outcome" => "denied"),
            buckets: gauge!(RLQS_BUCKETS),
            groups: gauge!(RLQS_GLOBAL_BUCKETS),
            outstanding: gauge!(RLQS_OUTSTANDING_TOKENS),
            store_ok: counter!(RLQS_STORE_CALLS, "result" => "ok"),
            store_error: counter!(RLQS_STORE_CALLS, "result" => "error"),
        }
    }

    pub(crate) fn streams(&self, open: usize) {
        self.streams.set(open as f64);
    }

    pub(crate) fn refused_stream(&self) {
        self.refused.increment(1);
    }

    pub(crate) fn report(&self) {
        self.reports.increment(1);
    }

    pub(crate) fn requests(&self, allowed: u64, denied: u64) {
        self.allowed.increment(allowed);
        self.denied.increment(denied);
    }

    pub(crate) fn ignored(&self, why: Ignored, count: usize) {
        counter!(RLQS_IGNORED, "reason" => why.label()).increment(count as u64);
    }

    pub(crate) fn unmatched(&self, why: &ResolveError) {
        let reason = match why {
            ResolveError::UnknownDomain(_) => "unknown_domain",
            ResolveError::Invalid(_) => "invalid",
            _ => "no_rule",
        };
        counter!(RLQS_UNMATCHED, "reason" => reason).increment(1);
    }

    pub(crate) fn unmatched_reason(&self, reason: &'static str) {
        counter!(RLQS_UNMATCHED, "reason" => reason).increment(1);
    }

    pub(crate) fn buckets_delta(&self, delta: i64) {
        if delta >= 0 {
            self.buckets.increment(delta as f64);
        } else {
            self.buckets.decrement((-delta) as f64);
        }
    }

    pub(crate) fn groups(&self, count: usize) {
        self.groups.set(count as f64);
    }

    pub(crate) fn assigned(&self, strategy: &'static str) {
        counter!(RLQS_ASSIGNMENTS, "strategy" => strategy).increment(1);
    }

    pub(crate) fn outstanding(&self, ut: u64) {
        self.outstanding.set(ut as f64 / MICRO as f64);
    }

    pub(crate) fn store_call(&self, ok: bool) {
        if ok {
            self.store_ok.increment(1);
        } else {
            self.store_error.increment(1);
        }
    }
}
