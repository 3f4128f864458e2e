//! A refill rate as an exact fraction: `num` micro-tokens every `den` microseconds.
//!
//! Rates are reduced to lowest terms when built so that the refill formula in [`Rate::credit`]
//! keeps every intermediate value below 2^53. That bound is what lets the Redis Lua script
//! (whose numbers are IEEE doubles) and the Postgres SQL compute bit-identical results.

use super::MICRO;

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
    #[error("{tokens} tokens per {period_us} µs is too fine a rate to compute exactly (num x den must stay below 2^53 micro-tokens)")]
    TooFine {
        /// Tokens per period, as given.
        tokens: u64,
        /// The period in microseconds, as given.
        period_us: u64,
    },
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
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
