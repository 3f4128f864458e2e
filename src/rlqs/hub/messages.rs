//! The protobuf side of the hub: bucket ids, report durations, assignments.

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use envoy_types::pb::envoy::r#type::v3::RateLimitStrategy;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::google::protobuf::Duration as PbDuration;

use super::{BucketKey, LONGEST_REPORT};

/// The bucket id as sorted pairs; `None` when empty.
pub(super) fn bucket_key(id: Option<&BucketId>) -> Option<BucketKey> {
    let id = id?;
    if id.bucket.is_empty() {
        return None;
    }
    let mut pairs: Vec<(String, String)> = id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    pairs.sort();
    Some(pairs.into())
}

pub(super) fn bucket_id(key: &BucketKey) -> BucketId {
    BucketId {
        bucket: key.iter().cloned().collect(),
    }
}

/// `time_elapsed` in microseconds (absent: 0, as Envoy's first report); `None` when negative,
/// malformed or over a day.
pub(super) fn elapsed_us(d: Option<&PbDuration>) -> Option<u64> {
    let Some(d) = d else { return Some(0) };
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 {
        return None;
    }
    let us = u64::try_from(d.seconds)
        .ok()?
        .checked_mul(1_000_000)?
        .checked_add(u64::try_from(d.nanos / 1_000).ok()?)?;
    (us <= LONGEST_REPORT.as_micros() as u64).then_some(us)
}

/// A `quota_assignment_action` for `key` with `strategy`, living `ttl_us` (whole seconds).
pub(super) fn assignment(key: &BucketKey, strategy: Strategy, ttl_us: u64) -> BucketAction {
    BucketAction {
        bucket_id: Some(bucket_id(key)),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(PbDuration {
                seconds: i64::try_from(ttl_us / 1_000_000).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}
