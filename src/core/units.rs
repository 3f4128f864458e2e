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

/// A duration setting kept in milliseconds: written as a whole number of milliseconds (`250`,
/// as every `*_ms` setting always was) or as a number with a suffix (`250ms`, `10s`, `1m`,
/// `1h`, `1d`). Shown (in `/config`) as the number of milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Millis(pub u64);

/// A duration setting kept in whole seconds: written as a whole number of seconds (`30`, as
/// every `*_seconds` setting always was) or as a number with a suffix (`30s`, `2m`, `1h`,
/// `1d`; `1500ms` is refused: not whole seconds). Shown as the number of seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Seconds(pub u64);

impl Millis {
    /// As a [`std::time::Duration`].
    pub fn duration(self) -> std::time::Duration {
        std::time::Duration::from_millis(self.0)
    }
}

impl Seconds {
    /// As a [`std::time::Duration`].
    pub fn duration(self) -> std::time::Duration {
        std::time::Duration::from_secs(self.0)
    }
}

/// A settings duration in microseconds: a whole number (in `unit_us`) or a whole number and a
/// suffix of [`DURATION_SUFFIXES`]; zero allowed (a setting may mean "off" by it). Errors:
/// a sentence naming the text and what is expected.
fn parse_setting_us(text: &str, unit_us: u64) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let count: u64 = digits.parse().map_err(|_| {
        format!("`{text}` is not a duration: expected a whole number and a unit (ms, s, m, h, d), like 250ms or 10s")
    })?;
    let suffix_us = if suffix.is_empty() {
        unit_us
    } else {
        DURATION_SUFFIXES
            .iter()
            .find(|(name, _)| *name == suffix.trim())
            .map(|(_, us)| *us)
            .ok_or_else(|| format!("`{text}` is not a duration: the unit must be one of ms, s, m, h, d"))?
    };
    count
        .checked_mul(suffix_us)
        .ok_or_else(|| format!("`{text}` is too long"))
}

macro_rules! duration_setting {
    ($name:ident, $unit_us:expr, $what:literal) => {
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_u64(self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$name, D::Error> {
                struct Visitor;
                impl serde::de::Visitor<'_> for Visitor {
                    type Value = $name;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        write!(
                            f,
                            concat!("a whole number of ", $what, ", or a duration like 250ms or 10s")
                        )
                    }
                    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<$name, E> {
                        Ok($name(v))
                    }
                    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<$name, E> {
                        u64::try_from(v)
                            .map($name)
                            .map_err(|_| E::custom(concat!("a duration cannot be negative (", $what, ")")))
                    }
                    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<$name, E> {
                        let us = parse_setting_us(v, $unit_us).map_err(E::custom)?;
                        if us % $unit_us != 0 {
                            return Err(E::custom(format!(
                                concat!("`{}` is not a whole number of ", $what),
                                v.trim()
                            )));
                        }
                        Ok($name(us / $unit_us))
                    }
                }
                d.deserialize_any(Visitor)
            }
        }
    };
}

duration_setting!(Millis, 1_000, "milliseconds");
duration_setting!(Seconds, SECOND_US, "seconds");

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

    /// Duration settings take today's numbers and durations with a unit; a fraction of their
    /// unit, a negative number, an unknown unit and text are refused with the reason.
    #[test]
    fn duration_settings_take_numbers_and_units() {
        let ms = |v: serde_json::Value| serde_json::from_value::<Millis>(v).map_err(|e| e.to_string());
        let secs = |v: serde_json::Value| serde_json::from_value::<Seconds>(v).map_err(|e| e.to_string());
        assert_eq!(ms(serde_json::json!(250)), Ok(Millis(250)));
        assert_eq!(ms(serde_json::json!("250ms")), Ok(Millis(250)));
        assert_eq!(ms(serde_json::json!("10s")), Ok(Millis(10_000)));
        assert_eq!(ms(serde_json::json!("2m")), Ok(Millis(120_000)));
        assert_eq!(ms(serde_json::json!("0")), Ok(Millis(0)));
        assert_eq!(secs(serde_json::json!(30)), Ok(Seconds(30)));
        assert_eq!(secs(serde_json::json!("1h")), Ok(Seconds(3_600)));
        assert_eq!(secs(serde_json::json!("2000ms")), Ok(Seconds(2)));
        assert!(secs(serde_json::json!("1500ms"))
            .unwrap_err()
            .contains("whole number of seconds"));
        assert!(ms(serde_json::json!(-5)).unwrap_err().contains("negative"));
        assert!(ms(serde_json::json!("5 parsecs"))
            .unwrap_err()
            .contains("unit must be one of"));
        assert!(ms(serde_json::json!("soon")).unwrap_err().contains("not a duration"));
        assert!(ms(serde_json::json!(1.5)).is_err());
        assert_eq!(serde_json::to_value(Millis(250)).unwrap(), serde_json::json!(250));
        assert_eq!(Seconds(3).duration(), std::time::Duration::from_secs(3));
    }
}
