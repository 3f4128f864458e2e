//! The `rlqs` settings section (docs/rlqs.md).

use serde::{Deserialize, Serialize};

use super::plan::Terms;
use crate::core::units::{Millis, Seconds};

/// What a bucket id that no rule matches (an unknown domain, no descriptor, a rule's path
/// missed) is assigned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unmatched {
    /// Nothing: Envoy's `no_assignment_behavior` for the bucket applies.
    #[default]
    NoAssignment,
    /// `ALLOW_ALL`.
    AllowAll,
    /// `DENY_ALL`.
    DenyAll,
}

/// Envoy's Rate Limit Quota Service on the gRPC listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlqsSettings {
    /// Serve `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` beside
    /// `RateLimitService`.
    pub enabled: bool,
    /// How often every share is assigned again (its TTL renewed, its rate moved towards its
    /// fair part), in milliseconds. Envoy reports every 5 s whatever it is configured with;
    /// the assignments do not wait for reports.
    pub assignment_period_ms: Millis,
    /// `assignment_time_to_live`, in assignment periods, rounded up to whole seconds (Envoy
    /// reads whole seconds): 2 by default (1 s with the default period), so one late
    /// assignment does not expire a share. A share's refill is paid this long ahead.
    pub ttl_periods: u32,
    /// How long an assignment may take to reach Envoy, in milliseconds: a share is paid for
    /// until this long after its TTL would end.
    pub delivery_margin_ms: Millis,
    /// What a bucket id no rule matches is assigned.
    pub unmatched: Unmatched,
    /// Streams served at once; more are refused with `RESOURCE_EXHAUSTED`.
    pub max_streams: usize,
    /// Buckets one stream may report; reports of more are ignored and counted.
    pub max_buckets_per_stream: usize,
    /// A bucket whose Envoy reported no request for this long is abandoned (`abandon_action`:
    /// Envoy forgets it until its next request), in seconds.
    pub idle_seconds: Seconds,
}

impl Default for RlqsSettings {
    fn default() -> Self {
        RlqsSettings {
            enabled: true,
            assignment_period_ms: Millis(500),
            ttl_periods: 2,
            delivery_margin_ms: Millis(250),
            unmatched: Unmatched::NoAssignment,
            max_streams: 10_000,
            max_buckets_per_stream: 1_000,
            idle_seconds: Seconds(300),
        }
    }
}

impl RlqsSettings {
    /// `assignment_time_to_live` in whole seconds: `ttl_periods` periods, rounded up.
    pub fn ttl_seconds(&self) -> u64 {
        (self.assignment_period_ms.0.saturating_mul(u64::from(self.ttl_periods))).div_ceil(1_000)
    }

    /// The terms every assignment is made on.
    pub fn terms(&self) -> Terms {
        Terms {
            ttl_us: self.ttl_seconds().saturating_mul(1_000_000),
            margin_us: self.delivery_margin_ms.0.saturating_mul(1_000),
            period_us: self.assignment_period_ms.0.saturating_mul(1_000),
        }
    }

    /// Errors: a sentence naming the setting, when an assignment could expire before the next
    /// is sent, or a bound is zero.
    pub fn validate(&self) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        if self.assignment_period_ms.0 < 100 {
            return Err("rlqs.assignment_period_ms must be at least 100 ms".into());
        }
        let ttl_ms = self.ttl_seconds() * 1_000;
        if self.ttl_periods < 2 || ttl_ms < self.assignment_period_ms.0 + self.delivery_margin_ms.0 {
            return Err(format!(
                "rlqs.ttl_periods ({}) x rlqs.assignment_period_ms ({}) must be at least 2 periods and longer than a \
                 period plus rlqs.delivery_margin_ms ({}): otherwise an assignment expires before the next arrives",
                self.ttl_periods, self.assignment_period_ms.0, self.delivery_margin_ms.0
            ));
        }
        if self.max_streams == 0 || self.max_buckets_per_stream == 0 {
            return Err("rlqs.max_streams and rlqs.max_buckets_per_stream must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttl_is_whole_seconds_and_must_outlast_a_period() {
        let s = RlqsSettings::default();
        assert_eq!(s.ttl_seconds(), 1);
        assert!(s.validate().is_ok());
        let odd = RlqsSettings {
            assignment_period_ms: Millis(700),
            ttl_periods: 2,
            ..s
        };
        assert_eq!(odd.ttl_seconds(), 2);
        let short = RlqsSettings { ttl_periods: 1, ..s };
        assert!(short.validate().unwrap_err().contains("ttl_periods"));
        let tight = RlqsSettings {
            delivery_margin_ms: Millis(1_500),
            ..s
        };
        assert!(tight.validate().is_err());
    }
}
