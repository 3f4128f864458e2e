//! One schedule entry: a five-field cron window in a timezone, and what it does to the limit.

use chrono::{DateTime, Datelike, Duration, NaiveDate, NaiveDateTime, Offset, TimeZone, Timelike};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;

use super::ScheduleError;
use crate::core::bucket::{Rate, MAX_CAPACITY, MICRO};

/// All 60 minutes of an hour, as a bit mask.
const ALL_MINUTES: u64 = (1 << 60) - 1;
/// All 24 hours of a day, as a bit mask.
const ALL_HOURS: u32 = (1 << 24) - 1;
/// How far apart [`ScheduleEntry`] probes a zone's UTC offset when looking for its next change:
/// six hours. Assumes a zone never changes its offset twice within six hours (a change and a
/// change back would be missed). Checked for every zone chrono-tz has, from 1970 to 2100 at
/// 15-minute resolution: the two closest changes are 7 days apart (America/Boa_Vista, 2000).
const OFFSET_PROBE_S: i64 = 6 * 3600;
/// The last second searched for a change (or a quota's reset edge): 9999-12-31T23:59:59Z.
pub(super) const LAST_SEARCHED_S: i64 = 253_402_300_799;
/// The largest scale factor accepted.
pub const MAX_SCALE: f64 = 1_000_000.0;

/// What an active entry does to the base limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Effect {
    /// Multiply capacity and refill together by `millionths / 1_000_000` (the factor as given,
    /// rounded to the nearest millionth), so the time to fill from empty is kept.
    Scale {
        /// The factor in millionths: 500_000 is 0.5.
        millionths: u64,
    },
    /// Replace the capacity (whole tokens) and/or the refill rate; what is not given is the base's.
    Set {
        /// The capacity in whole tokens, or `None` to keep the base capacity.
        capacity: Option<u64>,
        /// The refill rate, or `None` to keep the base rate.
        refill: Option<Rate>,
    },
}

/// A window of time (every minute a cron pattern matches, in local time of a timezone) and the
/// [`Effect`] it has while it is active.
///
/// The pattern has five fields, `minute hour day-of-month month day-of-week`, with ranges, lists,
/// steps and names (`JAN`-`DEC`, `SUN`-`SAT`; 0 and 7 are both Sunday). When both day fields
/// are restricted a day matches if either does (standard cron); a day field counts as
/// unrestricted only when it is exactly `*`. Seconds, years, `?`, `@nicknames` and the `L`,
/// `W`, `#` extensions are rejected.
///
/// **Activity.** The entry is active at an instant when the pattern matches the local wall-clock
/// minute of that instant in its timezone. So `* 9-17 * * MON-FRI` is active from 09:00:00 to
/// 17:59:59.999999 local time on weekdays, whatever the UTC offset that day.
///
/// **DST.** Because activity is read off the local time of each instant: a local minute that
/// does not exist (the gap when clocks go forward) is never active, and a window containing the
/// gap simply spans it (`* 1-3 * * *` on a spring-forward night at 02:00 runs 01:00-03:59 local,
/// one hour shorter in real time); a local minute that occurs twice (the overlap when clocks go
/// back) is active both times (`30 1 * * *` is active 01:30-01:30:59 in both the summer and the
/// winter offset). A window such as 9-17 local stays 9-17 local across both transitions.
#[derive(Clone)]
pub struct ScheduleEntry {
    pattern: String,
    cron: CronPattern,
    timezone: Tz,
    effect: Effect,
    /// `Some(active)` when the pattern matches every minute or none at all.
    constant: Option<bool>,
}

impl ScheduleEntry {
    /// Validates and builds an entry. `timezone` is an IANA name (`None`: UTC). Give either
    /// `scale` (a positive factor, applied with a resolution of one millionth, at most
    /// [`MAX_SCALE`]) or `capacity` (whole tokens) and/or `refill`, never both.
    ///
    /// Errors, each a [`ScheduleError`] whose message names the reason: a pattern without five
    /// fields (six-field patterns with seconds get their own message), the `L`/`W`/`#`
    /// extensions, any other invalid pattern, an unknown timezone, scale together with absolute
    /// values, a scale that is not positive (or rounds to zero, or exceeds [`MAX_SCALE`]), neither
    /// given, a capacity above [`MAX_CAPACITY`].
    pub fn new(
        cron: &str,
        timezone: Option<&str>,
        scale: Option<f64>,
        capacity: Option<u64>,
        refill: Option<Rate>,
    ) -> Result<ScheduleEntry, ScheduleError> {
        let parsed = CronPattern::parse(cron)?;
        let timezone = parse_timezone(timezone)?;
        let effect = match (scale, capacity, refill) {
            (Some(_), Some(_), _) | (Some(_), _, Some(_)) => return Err(ScheduleError::ScaleWithAbsolute),
            (None, None, None) => return Err(ScheduleError::NoEffect),
            (Some(factor), None, None) => Effect::Scale {
                millionths: scale_millionths(factor)?,
            },
            (None, capacity, refill) => {
                if let Some(c) = capacity.filter(|c| *c > MAX_CAPACITY) {
                    return Err(ScheduleError::CapacityTooLarge(c));
                }
                Effect::Set { capacity, refill }
            }
        };
        parsed.require_some_minute(cron)?;
        let (any, all) = parsed.day_coverage();
        if !any {
            return Err(ScheduleError::NeverActive(cron.trim().to_string()));
        }
        let constant = if all && parsed.every_minute_of_day() {
            Some(true)
        } else {
            None
        };
        Ok(ScheduleEntry {
            pattern: cron.trim().to_string(),
            cron: parsed,
            timezone,
            effect,
            constant,
        })
    }

    /// The cron pattern as given (trimmed).
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The entry's timezone.
    pub fn timezone(&self) -> Tz {
        self.timezone
    }

    /// What the entry does while active.
    pub fn effect(&self) -> Effect {
        self.effect
    }

    /// Whether the entry is active at `t_us` (microseconds since the epoch): whether its pattern
    /// matches the local wall-clock minute of that instant. Instants that chrono cannot
    /// represent (hundreds of thousands of years away) are never active.
    pub fn is_active(&self, t_us: u64) -> bool {
        if let Some(active) = self.constant {
            return active;
        }
        self.local_at(secs(t_us)).is_some_and(|local| self.matches(local))
    }

    /// The first instant in `(t_us, limit_us]` at which [`ScheduleEntry::is_active`] differs
    /// from its value at `t_us`, or `None`. Always a whole second (a local minute mark, or a
    /// change of UTC offset).
    ///
    /// Walks the zone's spans of constant UTC offset: within a span local time is UTC shifted,
    /// and the next local minute of the other activity is found a day, an hour, then a minute at
    /// a time (days and hours that cannot change the answer are skipped whole), so the cost
    /// grows with the days searched, not the minutes. Offset changes are looked for (by probing,
    /// see `OFFSET_PROBE_S`) only up to that candidate. Searches no further than the end of
    /// year 9999.
    pub fn next_change(&self, t_us: u64, limit_us: u64) -> Option<u64> {
        if self.constant.is_some() {
            return None;
        }
        let limit_s = secs(limit_us).min(LAST_SEARCHED_S);
        let mut cur = secs(t_us);
        let was = self.matches(self.local_at(cur)?);
        loop {
            // With the offset at `cur` held, the first local minute of the other activity...
            let offset = self.offset_at(cur)?;
            let from = floor_minute(utc_naive(cur + offset)?).checked_add_signed(Duration::minutes(1))?;
            let until = utc_naive(limit_s + 1 + offset)?;
            let candidate = self
                .cron
                .find_local(from, until, !was)
                .map(|m| m.and_utc().timestamp() - offset);
            // ...is the answer unless the offset changes first (or at that very second).
            match self.next_offset_change(cur, offset, candidate.unwrap_or(limit_s)) {
                None => return candidate.and_then(|s| u64::try_from(s).ok()).map(|s| s * MICRO),
                Some(end) => {
                    if self.matches(self.local_at(end)?) != was {
                        return u64::try_from(end).ok().map(|s| s * MICRO);
                    }
                    cur = end;
                }
            }
        }
    }

    /// Whether the pattern matches a local wall-clock time (its minute; seconds ignored).
    pub(crate) fn matches(&self, local: NaiveDateTime) -> bool {
        self.cron.matches(local)
    }

    /// The local wall-clock time at `s` seconds since the epoch.
    fn local_at(&self, s: i64) -> Option<NaiveDateTime> {
        local_at(self.timezone, s)
    }

    /// The zone's UTC offset at `s`, in seconds (local minus UTC).
    fn offset_at(&self, s: i64) -> Option<i64> {
        offset_at(self.timezone, s)
    }

    /// The first second in `(s, limit_s]` at which the offset is no longer `offset`.
    fn next_offset_change(&self, s: i64, offset: i64, limit_s: i64) -> Option<i64> {
        let mut lo = s;
        while lo < limit_s {
            let hi = lo.saturating_add(OFFSET_PROBE_S).min(limit_s);
            if self.offset_at(hi) != Some(offset) {
                return Some(bisect_offset_change(self.timezone, lo, hi, offset));
            }
            lo = hi;
        }
        None
    }
}

/// A parsed five-field cron pattern, matched against local wall-clock minutes. Schedule
/// entries and quota resets (docs/schedules-and-quotas.md) share it, so both read a pattern the same way. The
/// minute and hour fields are kept as bit masks so that searches skip whole hours and days.
#[derive(Clone)]
pub(super) struct CronPattern {
    cron: Cron,
    minutes: u64,
    hours: u32,
    first_hour: u32,
    first_minute: u32,
}

impl CronPattern {
    /// Checks the shape of the pattern (see [`parse_cron`]) and parses it. A pattern that
    /// parses can still match no minute at all; see [`CronPattern::require_some_minute`].
    pub(super) fn parse(cron: &str) -> Result<CronPattern, ScheduleError> {
        let parsed = parse_cron(cron)?;
        let mut minutes = 0u64;
        for m in 0..60u32 {
            if parsed.pattern.minute_match(m).unwrap_or(false) {
                minutes |= 1 << m;
            }
        }
        let mut hours = 0u32;
        for h in 0..24u32 {
            if parsed.pattern.hour_match(h).unwrap_or(false) {
                hours |= 1 << h;
            }
        }
        Ok(CronPattern {
            cron: parsed,
            minutes,
            hours,
            first_hour: hours.trailing_zeros(),
            first_minute: minutes.trailing_zeros(),
        })
    }

    /// Rejects a pattern whose minute or hour field matches nothing. Separate from
    /// [`CronPattern::parse`] so that callers keep their order of validation.
    pub(super) fn require_some_minute(&self, cron: &str) -> Result<(), ScheduleError> {
        if self.minutes == 0 || self.hours == 0 {
            return Err(ScheduleError::BadCron {
                cron: cron.to_string(),
                reason: "it matches no minute or no hour".to_string(),
            });
        }
        Ok(())
    }

    /// Whether the day fields match some day, and whether they match every day.
    pub(super) fn day_coverage(&self) -> (bool, bool) {
        // Which days match depends only on the month, the day of the month, whether February
        // has a 29th, and the weekday, and eight years from 2024 (two leap years) have every
        // combination: a pattern that matches none of those days matches none ever.
        let days = (0..8 * 366)
            .filter_map(|d| NaiveDate::from_ymd_opt(2024, 1, 1)?.checked_add_days(chrono::Days::new(d)))
            .filter(|d| d.year() < 2032);
        let (mut any, mut all) = (false, true);
        for d in days {
            let ok = self.day_ok(d);
            any |= ok;
            all &= ok;
        }
        (any, all)
    }

    /// Whether the minute and hour fields match every minute of a day.
    pub(super) fn every_minute_of_day(&self) -> bool {
        self.minutes == ALL_MINUTES && self.hours == ALL_HOURS
    }

    /// Whether the pattern matches a local wall-clock time (its minute; seconds ignored).
    pub(super) fn matches(&self, local: NaiveDateTime) -> bool {
        self.minutes & (1 << local.minute()) != 0 && self.hours & (1 << local.hour()) != 0 && self.day_ok(local.date())
    }

    /// Whether the day fields (day of month, month, day of week, combined as cron does) match.
    pub(super) fn day_ok(&self, date: NaiveDate) -> bool {
        date.and_hms_opt(self.first_hour, self.first_minute, 0)
            .is_some_and(|probe| self.cron.is_time_matching(&probe).unwrap_or(false))
    }

    /// The first local minute in `[from, until)` (from on a minute mark) at which the pattern's
    /// match is `want`.
    pub(super) fn find_local(&self, from: NaiveDateTime, until: NaiveDateTime, want: bool) -> Option<NaiveDateTime> {
        let mut m = from;
        while m < until {
            let date = m.date();
            let next_day = date.succ_opt()?.and_hms_opt(0, 0, 0)?;
            if !self.day_ok(date) {
                if want {
                    m = next_day;
                    continue;
                }
                return Some(m);
            }
            if !want && self.every_minute_of_day() {
                m = next_day;
                continue;
            }
            let hour = m.hour();
            let hour_start = date.and_hms_opt(hour, 0, 0)?;
            let next_hour = hour_start.checked_add_signed(Duration::hours(1))?;
            if self.hours & (1 << hour) == 0 {
                if want {
                    m = next_hour;
                    continue;
                }
                return Some(m);
            }
            let bits = if want {
                self.minutes
            } else {
                !self.minutes & ALL_MINUTES
            };
            let rest = bits >> m.minute();
            if rest != 0 {
                let found = m.checked_add_signed(Duration::minutes(i64::from(rest.trailing_zeros())))?;
                return (found < until).then_some(found);
            }
            m = next_hour;
        }
        None
    }

    /// The last local minute in `[until, from]` (from on a minute mark) that the pattern
    /// matches: [`CronPattern::find_local`] run backwards, skipping whole days and hours.
    pub(super) fn find_local_back(&self, from: NaiveDateTime, until: NaiveDateTime) -> Option<NaiveDateTime> {
        let mut m = from;
        while m >= until {
            let date = m.date();
            if !self.day_ok(date) {
                m = date.and_hms_opt(0, 0, 0)?.checked_sub_signed(Duration::minutes(1))?;
                continue;
            }
            let hour = m.hour();
            let hour_start = date.and_hms_opt(hour, 0, 0)?;
            if self.hours & (1 << hour) != 0 {
                // The minutes of this hour up to and including m's.
                let bits = self.minutes & ((2u64 << m.minute()) - 1);
                if bits != 0 {
                    let found =
                        hour_start.checked_add_signed(Duration::minutes(i64::from(63 - bits.leading_zeros())))?;
                    return (found >= until).then_some(found);
                }
            }
            m = hour_start.checked_sub_signed(Duration::minutes(1))?;
        }
        None
    }
}

impl std::fmt::Debug for ScheduleEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScheduleEntry")
            .field("pattern", &self.pattern)
            .field("timezone", &self.timezone)
            .field("effect", &self.effect)
            .finish()
    }
}

/// The local wall-clock time in `tz` at `s` seconds since the epoch.
pub(super) fn local_at(tz: Tz, s: i64) -> Option<NaiveDateTime> {
    Some(DateTime::from_timestamp(s, 0)?.with_timezone(&tz).naive_local())
}

/// The UTC offset of `tz` at `s`, in seconds (local minus UTC).
pub(super) fn offset_at(tz: Tz, s: i64) -> Option<i64> {
    let utc = DateTime::from_timestamp(s, 0)?.naive_utc();
    Some(i64::from(tz.offset_from_utc_datetime(&utc).fix().local_minus_utc()))
}

/// The first second in `(lo, hi]` whose offset is not `offset`, given that `lo` has `offset` and
/// `hi` does not; exact as long as the offset changes only once in between.
pub(super) fn bisect_offset_change(tz: Tz, mut lo: i64, mut hi: i64, offset: i64) -> i64 {
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if offset_at(tz, mid) == Some(offset) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

/// An IANA zone name, or UTC when none is given.
pub(super) fn parse_timezone(name: Option<&str>) -> Result<Tz, ScheduleError> {
    match name {
        None => Ok(Tz::UTC),
        Some(name) => name
            .parse::<Tz>()
            .map_err(|_| ScheduleError::UnknownTimezone(name.to_string())),
    }
}

/// Whole seconds of an instant in microseconds (it fits an `i64` for every `u64`).
pub(super) fn secs(t_us: u64) -> i64 {
    (t_us / MICRO) as i64
}

/// The naive date-time `s` seconds after the epoch.
pub(super) fn utc_naive(s: i64) -> Option<NaiveDateTime> {
    Some(DateTime::from_timestamp(s, 0)?.naive_utc())
}

/// `t` with its seconds dropped.
pub(super) fn floor_minute(t: NaiveDateTime) -> NaiveDateTime {
    t.with_second(0).and_then(|t| t.with_nanosecond(0)).unwrap_or(t)
}

/// A positive factor in millionths, rounded to the nearest.
fn scale_millionths(factor: f64) -> Result<u64, ScheduleError> {
    if !factor.is_finite() || factor <= 0.0 {
        return Err(ScheduleError::NonPositiveScale(factor.to_string()));
    }
    if factor > MAX_SCALE {
        return Err(ScheduleError::ScaleOutOfRange(factor.to_string()));
    }
    let millionths = (factor * 1e6).round() as u64;
    if millionths == 0 {
        return Err(ScheduleError::ScaleOutOfRange(factor.to_string()));
    }
    Ok(millionths)
}

const MONTH_NAMES: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const DAY_NAMES: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];
const FIELD_NAMES: [&str; 5] = ["minute", "hour", "day-of-month", "month", "day-of-week"];
/// The values each field allows (day-of-week 7 is Sunday, as 0).
const FIELD_BOUNDS: [(u32, u32); 5] = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)];

/// Checks the values, ranges and steps of field `i` (already known to hold only digits, names
/// and `* , - /`), so that the error names the field and what it allows rather than passing on
/// the parser's terse one.
fn check_bounds(i: usize, field: &str) -> Result<(), String> {
    let (lo, hi) = FIELD_BOUNDS[i];
    let name = FIELD_NAMES[i];
    let value = |v: &str| -> Result<u32, String> {
        let upper = v.to_ascii_uppercase();
        let named = match i {
            3 => MONTH_NAMES.iter().position(|n| *n == upper).map(|p| p as u32 + 1),
            4 => DAY_NAMES.iter().position(|n| *n == upper).map(|p| p as u32),
            _ => None,
        };
        let n = match named {
            Some(n) => n,
            None => v
                .parse::<u32>()
                .map_err(|_| format!("`{v}` is not a value of the {name} field"))?,
        };
        if n < lo || n > hi {
            return Err(format!("{n} is out of range for the {name} field ({lo}-{hi})"));
        }
        Ok(n)
    };
    for item in field.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((range, step)) => (range, Some(step)),
            None => (item, None),
        };
        if let Some(step) = step {
            match step.parse::<u32>() {
                Ok(n) if n >= 1 => {}
                _ => {
                    return Err(format!(
                        "step `/{step}` in the {name} field must be a whole number of at least 1"
                    ))
                }
            }
        }
        if range == "*" {
            continue;
        }
        if step.is_some() && !range.contains('-') {
            return Err(format!(
                "`{item}` in the {name} field: a step needs `*` or a range before it (`*/{s}`, `{range}-{hi}/{s}`)",
                s = step.unwrap_or_default()
            ));
        }
        match range.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (value(a)?, value(b)?);
                if a > b {
                    let span = |x: u32, y: u32| if x == y { x.to_string() } else { format!("{x}-{y}") };
                    // Sunday is 7 as well as 0, so a weekday range up to Sunday needs no wrap.
                    let instead = if i == 4 && b == 0 {
                        span(a, 7)
                    } else {
                        format!("{},{}", span(a, hi), span(lo, b))
                    };
                    return Err(format!(
                        "range `{range}` in the {name} field runs backwards; ranges do not wrap around (write `{instead}`)"
                    ));
                }
            }
            None => {
                value(range)?;
            }
        }
    }
    Ok(())
}

/// Checks the pattern's shape (five fields, only digits, `* , - /` and the month and weekday
/// names where they belong) before croner parses it, so that croner's own extensions never
/// get through and each rejection has a plain reason.
fn parse_cron(cron: &str) -> Result<Cron, ScheduleError> {
    let bad = |reason: String| ScheduleError::BadCron {
        cron: cron.to_string(),
        reason,
    };
    if let Some(nickname) = cron.split_whitespace().next().filter(|w| w.starts_with('@')) {
        return Err(bad(format!(
            "nicknames such as `{nickname}` are not supported; write the five fields (`0 0 * * *` is daily)"
        )));
    }
    let fields: Vec<&str> = cron.split_whitespace().collect();
    match fields.len() {
        5 => {}
        6 => return Err(ScheduleError::SixFields(cron.to_string())),
        found => {
            return Err(ScheduleError::FieldCount {
                cron: cron.to_string(),
                found,
            })
        }
    }
    if cron.contains('#') {
        return Err(ScheduleError::Extension(cron.to_string()));
    }
    for (i, field) in fields.iter().enumerate() {
        if let Some(c) = field
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '*' | ',' | '-' | '/')))
        {
            return Err(bad(format!(
                "unexpected character `{c}` in the {} field",
                FIELD_NAMES[i]
            )));
        }
        for token in field.split(|c: char| !c.is_ascii_alphanumeric()) {
            if token.is_empty() || token.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let upper = token.to_ascii_uppercase();
            let names: &[&str] = match i {
                3 => &MONTH_NAMES,
                4 => &DAY_NAMES,
                _ => &[],
            };
            if names.contains(&upper.as_str()) {
                continue;
            }
            let digits_then = upper.trim_start_matches(|c: char| c.is_ascii_digit());
            if matches!(digits_then, "L" | "W" | "LW") {
                return Err(ScheduleError::Extension(cron.to_string()));
            }
            return Err(bad(format!("unknown name `{token}` in the {} field", FIELD_NAMES[i])));
        }
        check_bounds(i, field).map_err(bad)?;
    }
    CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build()
        .parse(cron)
        .map_err(|e| bad(e.to_string()))
}
