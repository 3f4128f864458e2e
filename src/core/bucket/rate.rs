//! A refill rate as an exact fraction: `num` micro-tokens every `den` microseconds.
//!
//! Rates are reduced to lowest terms when built so that the refill formula in [`Rate::credit`]
//! keeps every intermediate value below 2^53. That bound is what lets the Redis Lua script
//! (whose numbers are IEEE doubles) and the Postgres SQL compute bit-identical results.

use super::MICRO;
use crate::core::units::{gcd, DURATION_SUFFIXES, ENVOY_UNITS};

/// The largest value every intermediate of the refill formula may reach: 2^53, the limit of
/// exact integers in an IEEE double (Lua's only number type on Redis 7).
pub const EXACT_LIMIT: u64 = 1 << 53;

/// A refill rate: `num` micro-tokens per `den` microseconds, in lowest terms.
///
/// A zero rate (`num == 0`) never refills; it is how an envoyproxy/ratelimit rule with
/// `requests_per_unit: 0` (deny everything) is represented.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    num: u64,
    den: u64,
}

/// Why a rate cannot be represented exactly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    /// The period was zero microseconds.
    #[error("the refill period must be longer than zero")]
    ZeroPeriod,
    /// `num * den` would reach 2^53 even in lowest terms, so the backends could not agree.
    /// Any count that is a multiple of 1000, up to 10^9, works over any of Envoy's units (a second
    /// up to a year of 365 days).
    #[error("{} cannot be computed exactly on every backend; use a count that is a multiple of 1000, or a shorter {}", describe_rate(*tokens, *period_us), if is_envoy_unit(*period_us) { "unit" } else { "period" })]
    TooFine {
        /// Tokens per period, as given.
        tokens: u64,
        /// The period in microseconds, as given.
        period_us: u64,
    },
}

fn is_envoy_unit(period_us: u64) -> bool {
    ENVOY_UNITS.iter().any(|(_, _, us)| *us == period_us)
}

/// `999999937 per year`, or `7 per 3650d` for a period that is not one of Envoy's units.
fn describe_rate(tokens: u64, period_us: u64) -> String {
    if let Some((_, name, _)) = ENVOY_UNITS.iter().find(|(_, _, us)| *us == period_us) {
        return format!("{tokens} per {name}");
    }
    match DURATION_SUFFIXES.iter().find(|(_, us)| period_us.is_multiple_of(*us)) {
        Some((suffix, us)) => format!("{tokens} per {}{suffix}", period_us / us),
        None => format!("{tokens} per {period_us}µs"),
    }
}

impl Rate {
    /// The rate that never refills.
    pub const ZERO: Rate = Rate { num: 0, den: 1 };

    /// `tokens` whole tokens every `period_us` microseconds.
    ///
    /// Errors: [`RateError::ZeroPeriod`], and [`RateError::TooFine`] when the reduced fraction's
    /// `num * den` reaches [`EXACT_LIMIT`].
    pub fn per(tokens: u64, period_us: u64) -> Result<Rate, RateError> {
        if period_us == 0 {
            return Err(RateError::ZeroPeriod);
        }
        if tokens == 0 {
            return Ok(Rate::ZERO);
        }
        let too_fine = RateError::TooFine { tokens, period_us };
        let micro = tokens.checked_mul(MICRO).ok_or_else(|| too_fine.clone())?;
        let g = gcd(micro, period_us);
        let (num, den) = (micro / g, period_us / g);
        if u128::from(num) * u128::from(den) >= u128::from(EXACT_LIMIT) {
            return Err(too_fine);
        }
        Ok(Rate { num, den })
    }

    /// Micro-tokens added every [`Rate::den`] microseconds.
    pub fn num(&self) -> u64 {
        self.num
    }

    /// The period, in microseconds, over which [`Rate::num`] micro-tokens are added.
    pub fn den(&self) -> u64 {
        self.den
    }

    /// Whether this rate never refills.
    pub fn is_zero(&self) -> bool {
        self.num == 0
    }

    /// Micro-tokens earned over `elapsed_us`, given that the bucket lacks `missing_ut`:
    /// `floor(elapsed * num / den)`, or `None` when that reaches `missing_ut` (the bucket is
    /// full). Written so that no intermediate exceeds `max(missing_ut + num, num * den)`,
    /// which the load-time bounds keep below 2^53; the Lua and SQL versions follow this shape.
    pub fn credit(&self, elapsed_us: u64, missing_ut: u64) -> Option<u64> {
        if self.num == 0 {
            return Some(0);
        }
        let whole_periods = elapsed_us / self.den;
        if whole_periods > missing_ut / self.num {
            return None;
        }
        let credit = whole_periods * self.num + (elapsed_us % self.den) * self.num / self.den;
        (credit < missing_ut).then_some(credit)
    }

    /// The shortest time, in microseconds, after which [`Rate::credit`] reaches `deficit_ut`:
    /// `ceil(deficit * den / num)`. `None` for a zero rate and a positive deficit.
    pub fn time_to_earn(&self, deficit_ut: u64) -> Option<u64> {
        if deficit_ut == 0 {
            return Some(0);
        }
        if self.num == 0 {
            return None;
        }
        let wait = (u128::from(deficit_ut) * u128::from(self.den)).div_ceil(u128::from(self.num));
        Some(u64::try_from(wait).unwrap_or(u64::MAX))
    }

    /// Whole tokens added per `unit_us` microseconds, when that is a whole number.
    pub fn whole_tokens_per(&self, unit_us: u64) -> Option<u64> {
        let micro = u128::from(self.num) * u128::from(unit_us);
        let per_den = u128::from(self.den) * u128::from(MICRO);
        (micro % per_den == 0).then(|| u64::try_from(micro / per_den).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduces_to_lowest_terms() {
        let r = Rate::per(10, 1_000_000).unwrap();
        assert_eq!((r.num(), r.den()), (10, 1));
        let r = Rate::per(1, 250_000).unwrap();
        assert_eq!((r.num(), r.den()), (4, 1));
        let r = Rate::per(7, 3_600_000_000).unwrap();
        assert_eq!((r.num(), r.den()), (7, 3600));
    }

    #[test]
    fn credit_is_floor_of_exact_product_until_full() {
        let r = Rate::per(7, 3_600_000_000).unwrap();
        assert_eq!(r.credit(3600, u64::MAX), Some(7));
        assert_eq!(r.credit(3599, u64::MAX), Some(6));
        // Reaching the missing amount means full.
        assert_eq!(r.credit(3600, 7), None);
        assert_eq!(r.credit(3599, 7), Some(6));
        // A year of idleness on a tiny deficit does not overflow.
        assert_eq!(r.credit(u64::MAX, 5), None);
    }

    #[test]
    fn time_to_earn_is_the_inverse_of_credit() {
        let r = Rate::per(7, 3_600_000_000).unwrap();
        for deficit in [1u64, 6, 7, 8, 1_000_000, 999_999_999] {
            let w = r.time_to_earn(deficit).unwrap();
            assert!(r.credit(w, u64::MAX).unwrap() >= deficit);
            assert!(r.credit(w - 1, u64::MAX).unwrap() < deficit);
        }
        assert_eq!(Rate::ZERO.time_to_earn(1), None);
        assert_eq!(Rate::ZERO.time_to_earn(0), Some(0));
    }

    #[test]
    fn rejects_what_cannot_be_exact() {
        assert_eq!(Rate::per(1, 0), Err(RateError::ZeroPeriod));
        // 1 token per 2^53 + 1 µs cannot reduce below the bound.
        assert!(matches!(Rate::per(1, (1 << 53) + 1), Err(RateError::TooFine { .. })));
    }

    /// What the `TooFine` message advises: any multiple of 1000 tokens up to 10^9 (the largest
    /// capacity) is exact over each of Envoy's units, from a second to a year. Exhaustive.
    #[test]
    fn multiples_of_1000_are_exact_for_every_envoy_unit() {
        for (_, name, unit_us) in crate::core::units::ENVOY_UNITS {
            for k in 1..=1_000_000u64 {
                assert!(Rate::per(1000 * k, unit_us).is_ok(), "{} per {name}", 1000 * k);
            }
        }
        // And a count that is not one can fail: the message is not advice for nothing.
        assert!(Rate::per(999_999_937, 31_536_000_000_000).is_err());
    }

    /// The advice compile.rs gives for a refill string: a multiple of 1000 tokens (up to 10^9)
    /// over whole minutes, hours or days. With T = 1000k tokens and a period of n units of U µs,
    /// num * den = T * 10^6 * n * U / g^2 where g = gcd(T * 10^6, n * U) >= gcd(10^9, U): at most
    /// 150 k n for minutes, 90 k n for hours, 2160 k n for days, below 2^53 for k <= 10^6 and
    /// any period up to a century. Checked here at the extremes, with prime counts and periods
    /// (which share no factor, the worst case).
    #[test]
    fn multiples_of_1000_are_exact_over_whole_minutes_hours_and_days() {
        let century_days = 36_525u64;
        for (unit_us, max_n) in [
            (60_000_000u64, century_days * 1440),
            (3_600_000_000, century_days * 24),
            (86_400_000_000, century_days),
        ] {
            let g0 = gcd(1_000_000_000, unit_us);
            let bound = u128::from(1_000_000_000u64) * u128::from(MICRO) * u128::from(max_n) * u128::from(unit_us)
                / (u128::from(g0) * u128::from(g0));
            assert!(bound < u128::from(EXACT_LIMIT), "bound {bound} for {unit_us} µs units");
            for n in [1, 7, 9_973, 36_523, max_n - 1, max_n] {
                for k in [1u64, 7, 999_983, 1_000_000] {
                    assert!(
                        Rate::per(1000 * k, n * unit_us).is_ok(),
                        "{} per {n} x {unit_us} µs",
                        1000 * k
                    );
                }
            }
        }
    }

    #[test]
    fn too_fine_speaks_to_an_operator() {
        let e = Rate::per(999_999_937, 31_536_000_000_000).unwrap_err().to_string();
        assert_eq!(
            e,
            "999999937 per year cannot be computed exactly on every backend; use a count that is a multiple \
             of 1000, or a shorter unit"
        );
        let e = Rate::per(999_999_937, 3650 * 86_400_000_000).unwrap_err().to_string();
        assert!(e.starts_with("999999937 per 3650d cannot"), "{e}");
        assert!(e.ends_with("or a shorter period"), "{e}");
    }

    #[test]
    fn whole_tokens_per_unit() {
        let r = Rate::per(1, 250_000).unwrap();
        assert_eq!(r.whole_tokens_per(1_000_000), Some(4));
        assert_eq!(r.whole_tokens_per(100_000), None);
        let r = Rate::per(10, 60_000_000).unwrap();
        assert_eq!(r.whole_tokens_per(1_000_000), None);
        assert_eq!(r.whole_tokens_per(60_000_000), Some(10));
    }
}
