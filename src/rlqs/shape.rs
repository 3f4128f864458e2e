//! The token bucket an assignment hands to Envoy, as Envoy's `rate_limit_quota` filter runs it,
//! and what it can admit: the arithmetic every share is paid for with. Pure.
//!
//! How Envoy 1.40 runs a `token_bucket` assignment (`envoy.type.v3.TokenBucket`, read in its
//! `global_client_impl.cc`), which this module is written against:
//! - the bucket starts **full**, with `max_tokens`, and refills continuously at
//!   `tokens_per_fill / fill_interval` tokens a second, the interval read in **whole seconds**
//!   (so an interval under a second divides by zero: never sent);
//! - an unset `tokens_per_fill` is read as 0 (no refill), not as the proto's default of 1: it is
//!   always sent;
//! - a new assignment **keeps** the running bucket (its tokens) when `max_tokens`,
//!   `tokens_per_fill` and the `nanos` of `fill_interval` are unchanged, even if the interval's
//!   seconds changed (and the rate with them). So tollgate sends the interval's seconds again as
//!   its nanoseconds ([`Shape::fill_nanos`]; the rate reads whole seconds, so they change
//!   nothing): Envoy keeps a running bucket exactly when the shape is the same, whatever
//!   tollgate remembers of what it sent before (a reload, a reconnect).
//!
//! So from the instant a bucket of shape `s` is created, it admits at most
//! `s.max_tokens + rate(s) x elapsed` requests: [`Shape::burst_ut`] plus [`Shape::refill_ut`].

use crate::core::bucket::MICRO;

/// The longest `fill_interval` sent, in seconds: a share of under one token an hour is sent as
/// one token an hour (paid for as such).
pub const MAX_FILL_SECONDS: u32 = 3_600;

/// Intervals up to this many seconds are tried for the closest rate at or under a target.
const FINE_FILL_SECONDS: u32 = 60;

/// An Envoy token bucket: `max_tokens`, refilled `tokens_per_fill` every `fill_seconds`
/// (`envoy.type.v3.TokenBucket`, with `fill_interval` in whole seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// The burst, in tokens (at least 1): what the bucket holds when created.
    pub max_tokens: u32,
    /// Tokens added per interval (at least 1).
    pub tokens_per_fill: u32,
    /// The interval, in whole seconds, 1 to [`MAX_FILL_SECONDS`].
    pub fill_seconds: u32,
}

impl Shape {
    /// The shape closest to `rate_ut_per_s` (micro-tokens a second) without exceeding it, with
    /// `burst` tokens (raised to 1): the largest `tokens_per_fill / fill_seconds` at or under the
    /// rate over intervals of 1 to 60 seconds, the smaller interval on a tie; under one token a
    /// minute, one token per the interval that rate takes (at most [`MAX_FILL_SECONDS`], so a
    /// rate under one token an hour is exceeded: the caller pays for what is sent, never for the
    /// target).
    pub fn fit(rate_ut_per_s: u64, burst: u64) -> Shape {
        let max_tokens = u32::try_from(burst.max(1)).unwrap_or(u32::MAX);
        // The best (k, n) with k / n <= rate / 10^6.
        let mut best: Option<(u64, u64)> = None;
        for n in 1..=u64::from(FINE_FILL_SECONDS) {
            let k = (u128::from(rate_ut_per_s) * u128::from(n) / u128::from(MICRO)).min(u128::from(u32::MAX)) as u64;
            if k == 0 {
                continue;
            }
            // k / n > bk / bn
            if best.is_none_or(|(bk, bn)| u128::from(k) * u128::from(bn) > u128::from(bk) * u128::from(n)) {
                best = Some((k, n));
            }
        }
        let (tokens_per_fill, fill_seconds) = match best {
            Some((k, n)) => (k as u32, n as u32),
            None => {
                let n = match rate_ut_per_s {
                    0 => u64::from(MAX_FILL_SECONDS),
                    r => MICRO
                        .div_ceil(r)
                        .clamp(u64::from(FINE_FILL_SECONDS), u64::from(MAX_FILL_SECONDS)),
                };
                (1, n as u32)
            }
        };
        Shape {
            max_tokens,
            tokens_per_fill,
            fill_seconds,
        }
    }

    /// The refill, in micro-tokens a second, rounded down.
    pub fn rate_ut_per_s(&self) -> u64 {
        u64::from(self.tokens_per_fill) * MICRO / u64::from(self.fill_seconds)
    }

    /// The burst, in micro-tokens.
    pub fn burst_ut(&self) -> u64 {
        u64::from(self.max_tokens) * MICRO
    }

    /// The most the bucket can refill over `duration_us`, in micro-tokens, rounded up:
    /// `tokens_per_fill x duration / fill_seconds` (tokens per second are micro-tokens per
    /// microsecond).
    pub fn refill_ut(&self, duration_us: u64) -> u64 {
        let ut = (u128::from(self.tokens_per_fill) * u128::from(duration_us)).div_ceil(u128::from(self.fill_seconds));
        u64::try_from(ut).unwrap_or(u64::MAX)
    }

    /// The `nanos` of `fill_interval` sent: the interval's seconds again, so that a shape of
    /// another interval is another bucket to Envoy (which compares `nanos`, not `seconds`).
    pub fn fill_nanos(&self) -> i32 {
        self.fill_seconds as i32
    }

    /// [`Shape::refill_ut`], rounded down: what to give back of a bucket's paid refill.
    pub fn refill_floor_ut(&self, duration_us: u64) -> u64 {
        let ut = u128::from(self.tokens_per_fill) * u128::from(duration_us) / u128::from(self.fill_seconds);
        u64::try_from(ut).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_never_exceeds_the_target_rate_and_comes_close() {
        for rate in [
            1,
            999,
            16_667,
            100_000,
            999_999,
            1_000_000,
            1_500_000,
            3_066_000,
            10_000_000,
            123_456_789,
        ] {
            let s = Shape::fit(rate, 3);
            assert!(s.fill_seconds >= 1 && s.tokens_per_fill >= 1, "{s:?}");
            if rate >= MICRO / u64::from(MAX_FILL_SECONDS) {
                assert!(s.rate_ut_per_s() <= rate, "{rate}: {s:?}");
            }
            if rate >= MICRO / 60 {
                // Within one token a minute of the target.
                assert!(rate - s.rate_ut_per_s() <= MICRO / 60 + 1, "{rate}: {s:?}");
            }
        }
        assert_eq!(
            Shape::fit(1_500_000, 0),
            Shape {
                max_tokens: 1,
                tokens_per_fill: 3,
                fill_seconds: 2
            }
        );
        // Under one token an hour: one an hour, paid for as such.
        assert_eq!(Shape::fit(0, 1).fill_seconds, MAX_FILL_SECONDS);
        assert_eq!(Shape::fit(200, 1).fill_seconds, MAX_FILL_SECONDS);
    }

    #[test]
    fn refill_rounds_up_so_a_share_is_never_underpaid() {
        let s = Shape {
            max_tokens: 1,
            tokens_per_fill: 1,
            fill_seconds: 3,
        };
        // One token every 3 s over 1 µs: a third of a micro-token, paid as one.
        assert_eq!(s.refill_ut(1), 1);
        assert_eq!(s.refill_ut(3_000_000), MICRO);
        assert_eq!(s.refill_ut(0), 0);
    }

    #[test]
    fn a_change_of_interval_alone_changes_the_nanos_envoy_compares() {
        let old = Shape {
            max_tokens: 5,
            tokens_per_fill: 2,
            fill_seconds: 1,
        };
        let new = Shape { fill_seconds: 2, ..old };
        assert_ne!(old.fill_nanos(), new.fill_nanos());
        assert_eq!(new.refill_floor_ut(1), 1);
        let third = Shape { fill_seconds: 3, ..old };
        assert_eq!(third.refill_floor_ut(1), 0);
        assert_eq!(third.refill_ut(1), 1);
    }
}
