//! A model of Envoy 1.40's `rate_limit_quota` filter, for driving tollgate's RLQS hub without
//! Envoy: how it applies assignments, decides requests on them and reports usage, as its
//! `global_client_impl.cc` and `filter.cc` do (docs/rlqs.md lists these behaviours):
//!
//! - a token-bucket assignment starts a bucket **full**, refilled continuously at
//!   `tokens_per_fill / fill_interval` (whole seconds); an assignment with the same
//!   `max_tokens` and `tokens_per_fill` keeps the running bucket and its tokens;
//! - every assignment expires `assignment_time_to_live` (whole seconds) after it is applied,
//!   then the fallback applies (here one blanket choice for both `no_assignment_behavior` and
//!   `expired_assignment_behavior`), as it does before the first assignment;
//! - `abandon_action` forgets the bucket;
//! - a new bucket is reported at once (`time_elapsed` 0), every bucket every 5 s (whole seconds,
//!   truncated), with the requests allowed and denied since its last report.
//!
//! Tokens are counted exactly (in micro-tokens times the fill interval), so the model never
//! admits a request a real Envoy's double arithmetic would round away in its favour.

use std::collections::HashMap;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;

/// A bucket id as sorted pairs.
pub type Key = Vec<(String, String)>;

/// Envoy's report period.
pub const REPORT_EVERY_US: u64 = 5_000_000;

const MICRO: u128 = 1_000_000;

#[derive(Clone, Copy, Debug)]
enum Held {
    Blanket {
        allow: bool,
    },
    Bucket {
        max_tokens: u32,
        per_fill: u32,
        fill_s: u32,
        /// The interval's nanos, which Envoy compares.
        fill_nanos: i32,
        /// Tokens in micro-tokens x `fill_s`, at `at_us`.
        scaled: u128,
        at_us: u64,
    },
}

#[derive(Debug)]
struct Bucket {
    held: Option<(Held, u64)>,
    allowed: u64,
    denied: u64,
    last_report_us: u64,
}

/// One Envoy's filter: its buckets and what it holds for each.
#[derive(Debug)]
pub struct EnvoyModel {
    domain: String,
    /// What applies without a live assignment: `true` ALLOW_ALL, `false` DENY_ALL.
    pub fallback_allow: bool,
    buckets: HashMap<Key, Bucket>,
    /// Requests admitted on token-bucket assignments and on `ALLOW_ALL`.
    pub admitted: u64,
}

impl EnvoyModel {
    /// A filter of `domain` with one fallback for both behaviours.
    pub fn new(domain: &str, fallback_allow: bool) -> EnvoyModel {
        EnvoyModel {
            domain: domain.to_owned(),
            fallback_allow,
            buckets: HashMap::new(),
            admitted: 0,
        }
    }

    /// Decides one request of bucket `key` at `now_us`; with the first request of a new bucket
    /// comes its immediate report.
    pub fn request(&mut self, key: &Key, now_us: u64) -> (bool, Option<RateLimitQuotaUsageReports>) {
        let new = !self.buckets.contains_key(key);
        let fallback = self.fallback_allow;
        let bucket = self.buckets.entry(key.clone()).or_insert(Bucket {
            held: None,
            allowed: 0,
            denied: 0,
            last_report_us: now_us,
        });
        let allowed = match &mut bucket.held {
            Some((_, until)) if *until <= now_us => {
                bucket.held = None;
                fallback
            }
            None => fallback,
            Some((Held::Blanket { allow }, _)) => *allow,
            Some((
                Held::Bucket {
                    max_tokens,
                    per_fill,
                    fill_s,
                    scaled,
                    at_us,
                    ..
                },
                _,
            )) => {
                let cap = u128::from(*max_tokens) * MICRO * u128::from(*fill_s);
                // k tokens per n seconds: k micro-tokens x n per microsecond, in these units.
                let refill = u128::from(*per_fill) * u128::from(now_us.saturating_sub(*at_us));
                *scaled = (*scaled + refill).min(cap);
                *at_us = now_us.max(*at_us);
                let one = MICRO * u128::from(*fill_s);
                if *scaled >= one {
                    *scaled -= one;
                    true
                } else {
                    false
                }
            }
        };
        if allowed {
            bucket.allowed += 1;
            self.admitted += 1;
        } else {
            bucket.denied += 1;
        }
        let report = new.then(|| {
            let usage = usage_of(key, bucket, now_us, 0);
            RateLimitQuotaUsageReports {
                domain: self.domain.clone(),
                bucket_quota_usages: vec![usage],
            }
        });
        (allowed, report)
    }

    /// Applies a response received at `now_us`.
    pub fn apply(&mut self, response: &RateLimitQuotaResponse, now_us: u64) {
        for action in &response.bucket_action {
            let Some(id) = &action.bucket_id else { continue };
            let key = key_of(id);
            let Some(bucket) = self.buckets.get_mut(&key) else {
                continue;
            };
            match &action.bucket_action {
                Some(Action::AbandonAction(_)) => {
                    self.buckets.remove(&key);
                }
                Some(Action::QuotaAssignmentAction(q)) => {
                    let ttl_s = q.assignment_time_to_live.map(|d| d.seconds.max(0) as u64).unwrap_or(0);
                    let until = now_us + ttl_s * 1_000_000;
                    let strategy = q.rate_limit_strategy.as_ref().and_then(|s| s.strategy.as_ref());
                    let held = match strategy {
                        Some(Strategy::BlanketRule(r)) => Held::Blanket {
                            allow: *r == BlanketRule::AllowAll as i32,
                        },
                        Some(Strategy::TokenBucket(tb)) => {
                            let per_fill = tb.tokens_per_fill.map(|v| v.value).unwrap_or(0);
                            let fill_s = tb.fill_interval.map(|d| d.seconds.max(0) as u32).unwrap_or(0);
                            assert!(fill_s >= 1, "a fill interval under a second divides by zero in Envoy");
                            match bucket.held {
                                // The same bucket: kept, tokens and all (only when still live).
                                // Envoy compares max_tokens, tokens_per_fill and the interval's
                                // nanos (not its seconds).
                                Some((
                                    Held::Bucket {
                                        max_tokens,
                                        per_fill: p,
                                        fill_nanos,
                                        ..
                                    },
                                    live_until,
                                )) if max_tokens == tb.max_tokens
                                    && p == per_fill
                                    && Some(fill_nanos) == tb.fill_interval.map(|d| d.nanos)
                                    && live_until > now_us =>
                                {
                                    let (held, _) = bucket.held.expect("matched");
                                    held
                                }
                                _ => Held::Bucket {
                                    max_tokens: tb.max_tokens,
                                    per_fill,
                                    fill_s,
                                    fill_nanos: tb.fill_interval.map(|d| d.nanos).unwrap_or(0),
                                    scaled: u128::from(tb.max_tokens) * MICRO * u128::from(fill_s),
                                    at_us: now_us,
                                },
                            }
                        }
                        _ => continue,
                    };
                    bucket.held = Some((held, until));
                }
                None => {}
            }
        }
    }

    /// The periodic report of every bucket at `now_us`.
    pub fn report(&mut self, now_us: u64) -> RateLimitQuotaUsageReports {
        let usages = self
            .buckets
            .iter_mut()
            .map(|(key, b)| {
                let elapsed = (now_us.saturating_sub(b.last_report_us)) / 1_000_000;
                usage_of(key, b, now_us, elapsed)
            })
            .collect();
        RateLimitQuotaUsageReports {
            domain: self.domain.clone(),
            bucket_quota_usages: usages,
        }
    }
}

fn usage_of(key: &Key, bucket: &mut Bucket, now_us: u64, elapsed_s: u64) -> BucketQuotaUsage {
    let usage = BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: key.iter().cloned().collect(),
        }),
        time_elapsed: Some(PbDuration {
            seconds: elapsed_s as i64,
            nanos: 0,
        }),
        num_requests_allowed: bucket.allowed,
        num_requests_denied: bucket.denied,
    };
    bucket.allowed = 0;
    bucket.denied = 0;
    bucket.last_report_us = now_us;
    usage
}

/// A bucket id's sorted pairs.
pub fn key_of(id: &BucketId) -> Key {
    let mut pairs: Key = id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    pairs.sort();
    pairs
}

/// The bucket id `{k: v, ...}`.
pub fn key(pairs: &[(&str, &str)]) -> Key {
    let mut k: Key = pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    k.sort();
    k
}
