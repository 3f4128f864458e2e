//! Refill strings (`10/s`, `600/1m`, `1/250ms`) and durations (`250ms`, `1m`, `s`).

use crate::core::units::DURATION_SUFFIXES;

/// A refill rate as written: `tokens` every `period_us` microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refill {
    /// Whole tokens added per period.
    pub tokens: u64,
    /// The period, in microseconds.
    pub period_us: u64,
}

/// Parses a duration: an optional whole number followed by a unit, one of `ms`, `s`, `m`, `h`,
/// `d` (`s` alone means `1s`). Returns microseconds. Errors with a sentence saying what is
/// expected.
pub(crate) fn parse_duration_us(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let Some((_, unit_us)) = DURATION_SUFFIXES.iter().find(|(name, _)| *name == unit) else {
        return Err(format!(
            "bad duration `{text}`: expected a whole number and a unit (ms, s, m, h, d), like 250ms or 1m"
        ));
    };
    let count: u64 = if digits.is_empty() {
        1
    } else {
        digits
            .parse()
            .map_err(|_| format!("bad duration `{text}`: the number is too large"))?
    };
    if count == 0 {
        return Err(format!("bad duration `{text}`: must be longer than zero"));
    }
    count
        .checked_mul(*unit_us)
        .ok_or_else(|| format!("bad duration `{text}`: too long"))
}

/// Parses a refill rate `<tokens>/<duration>`, e.g. `10/s`, `600/1m`, `1/250ms`.
///
/// ```
/// use tollgate::rules::{parse_refill, Refill};
/// assert_eq!(parse_refill("600/1m"), Ok(Refill { tokens: 600, period_us: 60_000_000 }));
/// assert!(parse_refill("10 per second").is_err());
/// ```
pub fn parse_refill(text: &str) -> Result<Refill, String> {
    let expected = "expected `<tokens>/<duration>` like 10/s, 600/1m or 1/250ms";
    let Some((tokens, period)) = text.split_once('/') else {
        return Err(format!("bad refill `{text}`: {expected}"));
    };
    let tokens: u64 = tokens.trim().parse().map_err(|_| {
        format!(
            "bad refill `{text}`: `{}` is not a whole number of tokens; {expected}",
            tokens.trim()
        )
    })?;
    if tokens == 0 {
        return Err(format!("bad refill `{text}`: must add at least one token per period"));
    }
    let period_us = parse_duration_us(period).map_err(|e| format!("bad refill `{text}`: {e}"))?;
    Ok(Refill { tokens, period_us })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_refills() {
        assert_eq!(
            parse_refill("10/s"),
            Ok(Refill {
                tokens: 10,
                period_us: 1_000_000
            })
        );
        assert_eq!(
            parse_refill("600/1m"),
            Ok(Refill {
                tokens: 600,
                period_us: 60_000_000
            })
        );
        assert_eq!(
            parse_refill("1/250ms"),
            Ok(Refill {
                tokens: 1,
                period_us: 250_000
            })
        );
        assert_eq!(parse_refill("5 / 2h").unwrap().period_us, 7_200_000_000);
    }

    #[test]
    fn rejects_bad_refills() {
        for bad in [
            "", "10", "10/", "/s", "x/s", "-1/s", "0/s", "10/0s", "10/5w", "10/s/2", "1.5/s",
        ] {
            assert!(parse_refill(bad).is_err(), "{bad} should be rejected");
        }
    }
}
