//! The one table of durations every layer reads: Envoy's rate-limit units and the duration
//! suffixes of rules and settings, in microseconds.

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

/// Microseconds in a second.
pub const SECOND_US: u64 = 1_000_000;
/// Microseconds in a day.
pub const DAY_US: u64 = 86_400 * SECOND_US;

/// Envoy's fixed-length units (`RateLimitResponse.RateLimit.Unit`, SECOND to YEAR), each with
/// its lower-case name and length in microseconds; MONTH and YEAR as envoyproxy/ratelimit counts
/// them (30 and 365 days). Shortest first.
pub const ENVOY_UNITS: [(Unit, &str, u64); 7] = [
    (Unit::Second, "second", SECOND_US),
    (Unit::Minute, "minute", 60 * SECOND_US),
    (Unit::Hour, "hour", 3_600 * SECOND_US),
    (Unit::Day, "day", DAY_US),
    (Unit::Week, "week", 7 * DAY_US),
    (Unit::Month, "month", 30 * DAY_US),
    (Unit::Year, "year", 365 * DAY_US),
];

/// The length of an Envoy unit in microseconds; `None` for `UNKNOWN`.
pub fn envoy_unit_us(unit: Unit) -> Option<u64> {
    ENVOY_UNITS.iter().find(|(u, _, _)| *u == unit).map(|(_, _, us)| *us)
}

/// The duration suffixes of rules files and settings (`250ms`, `10s`, `1m`, `1h`, `1d`), in
/// microseconds, longest first (so the first that divides a period names it in whole units).
pub const DURATION_SUFFIXES: [(&str, u64); 5] = [
    ("d", DAY_US),
    ("h", 3_600 * SECOND_US),
    ("m", 60 * SECOND_US),
    ("s", SECOND_US),
    ("ms", 1_000),
];

/// The greatest common divisor (`gcd(0, b) == b`), for reducing rates and periods.
pub fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_ordered_and_whole() {
        assert!(ENVOY_UNITS.windows(2).all(|w| w[0].2 < w[1].2));
        assert!(DURATION_SUFFIXES.windows(2).all(|w| w[0].1 > w[1].1));
        assert_eq!(envoy_unit_us(Unit::Month), Some(2_592_000_000_000));
        assert_eq!(envoy_unit_us(Unit::Unknown), None);
        for (unit, name, _) in ENVOY_UNITS {
            assert_eq!(unit.as_str_name().to_lowercase(), name);
        }
        assert_eq!((gcd(12, 18), gcd(0, 7), gcd(7, 0)), (6, 7, 7));
    }
}
