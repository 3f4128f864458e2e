//! Schedules: limits that follow the clock (DESIGN 1.3). Pure like [`crate::bucket`]: every
//! function takes the time and returns an answer; nothing reads a clock or does I/O.
//!
//! A [`Schedule`] is a base [`Limit`] and a list of [`ScheduleEntry`]s, each a cron window in a
//! timezone. At any instant the first active entry decides the limit ([`Schedule::limit_at`]);
//! with none active the base applies. The limit is constant between boundaries
//! ([`Schedule::next_boundary`]), so a bucket's future is a walk over constant-limit segments,
//! each computed with the [`crate::bucket::refill`] arithmetic ([`refill_scheduled`],
//! [`wait_until_us`]).
//!
//! Units are those of the bucket core: microseconds since the Unix epoch, micro-tokens.

mod entry;

pub use entry::{Effect, ScheduleEntry, MAX_SCALE};

use crate::bucket::{refill, wait_us, BucketState, Limit, Rate, MAX_CAPACITY, MICRO};

/// How far ahead callers search for boundaries and admissions by default: 62 days. That is
/// longer than the longest gap between two days a day-of-month pattern can match (the 31st:
/// 31 January to 31 March is 59 days), so every window that opens at all in a year of normal
/// months is seen to open. The search skips whole days, so a call costs about one step per
/// day searched per entry (and a few offset probes per day), not one per minute.
pub const DEFAULT_HORIZON_US: u64 = 62 * 86_400 * MICRO;

/// Why a schedule entry or schedule was rejected. The messages name the reason; the config
/// loader adds the file and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// Six fields: a seconds field (or a year).
    #[error(
        "cron `{0}` has six fields; use five (minute hour day-of-month month day-of-week): seconds are not supported"
    )]
    SixFields(String),
    /// Any other number of fields.
    #[error("cron `{cron}` has {found} fields; use five (minute hour day-of-month month day-of-week)")]
    FieldCount {
        /// The pattern as given.
        cron: String,
        /// How many fields it had.
        found: usize,
    },
    /// `L`, `W` or `#`.
    #[error("cron `{0}` uses the L, W or # extension, which is not supported")]
    Extension(String),
    /// Anything else wrong with the pattern.
    #[error("cron `{cron}` is invalid: {reason}")]
    BadCron {
        /// The pattern as given.
        cron: String,
        /// What is wrong.
        reason: String,
    },
    /// Not an IANA timezone name.
    #[error("unknown timezone `{0}`; use an IANA name such as Europe/Berlin or America/New_York")]
    UnknownTimezone(String),
    /// `scale` with `capacity` or `refill`.
    #[error("a schedule entry sets either scale or capacity and/or refill, not both")]
    ScaleWithAbsolute,
    /// Zero, negative, or not a number.
    #[error("scale must be a positive number, not {0}")]
    NonPositiveScale(String),
    /// Rounds to zero millionths, or above [`MAX_SCALE`].
    #[error("scale {0} is out of range: it must be at least 0.000001 and at most 1000000")]
    ScaleOutOfRange(String),
    /// Neither `scale` nor an absolute value.
    #[error("a schedule entry must set scale, or capacity and/or refill")]
    NoEffect,
    /// An absolute or scaled capacity above [`MAX_CAPACITY`] whole tokens.
    #[error("capacity {0} tokens is above the maximum of 1000000000")]
    CapacityTooLarge(u64),
    /// The scaled refill rate cannot be represented exactly (see [`crate::bucket::RateError`]).
    #[error("entry {entry}: the refill rate scaled by {millionths}/1000000 cannot be computed exactly; use a simpler scale or an absolute refill")]
    InexactScaledRate {
        /// Index of the entry in the schedule.
        entry: usize,
        /// The scale in millionths.
        millionths: u64,
    },
}

/// A base limit and the entries that override it while active, with each entry's limit worked
/// out once.
#[derive(Clone, Debug)]
pub struct Schedule {
    base: Limit,
    entries: Vec<ScheduleEntry>,
    limits: Vec<Limit>,
}

impl Schedule {
    /// Builds a schedule, computing each entry's limit from `base`:
    /// - `scale` (f = millionths / 10^6): capacity `floor(base.capacity_ut * f)` micro-tokens
    ///   (floored to the micro-token), rate exactly `base.rate * f` via [`Rate::per`] (so the
    ///   scaled rate has no rounding at all);
    /// - absolute values replace the base's, the missing one is kept.
    ///
    /// Errors: a scaled capacity above [`MAX_CAPACITY`] tokens, or a scaled rate that
    /// [`Rate::per`] cannot keep exact.
    pub fn new(base: Limit, entries: Vec<ScheduleEntry>) -> Result<Schedule, ScheduleError> {
        let limits = entries
            .iter()
            .enumerate()
            .map(|(i, e)| entry_limit(&base, e.effect(), i))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Schedule { base, entries, limits })
    }

    /// The limit when no entry is active.
    pub fn base(&self) -> &Limit {
        &self.base
    }

    /// The entries, in order of precedence.
    pub fn entries(&self) -> &[ScheduleEntry] {
        &self.entries
    }

    /// The limit entry `i` puts in force while it is active.
    pub fn entry_limit(&self, i: usize) -> Option<&Limit> {
        self.limits.get(i)
    }

    /// The index of the first entry active at `t_us`, if any.
    pub fn active_entry(&self, t_us: u64) -> Option<usize> {
        self.entries.iter().position(|e| e.is_active(t_us))
    }

    /// The limit in force at `t_us`: the first active entry's, else the base.
    pub fn limit_at(&self, t_us: u64) -> Limit {
        self.active_entry(t_us).map_or(self.base, |i| self.limits[i])
    }

    /// The first instant in `(t_us, t_us + horizon_us]` at which some entry's activity changes,
    /// or `None` if there is none. The effective limit can change only there (it may not, when
    /// the entry that changes is shadowed by an earlier active one or has the same limit), and
    /// [`Schedule::limit_at`] is constant on `[t_us, boundary)`. Boundaries are local minute
    /// marks or UTC-offset changes, so always whole seconds.
    pub fn next_boundary(&self, t_us: u64, horizon_us: u64) -> Option<u64> {
        let mut limit = t_us.saturating_add(horizon_us);
        let mut best = None;
        for e in &self.entries {
            if let Some(at) = e.next_change(t_us, limit) {
                best = Some(at);
                limit = at;
            }
        }
        best
    }

    /// The first instant in `(t_us, t_us + horizon_us]` at which [`Schedule::limit_at`] differs
    /// from its value at `t_us`: [`Schedule::next_boundary`] with the boundaries that change
    /// nothing (a shadowed entry, or an entry with the same limit) skipped.
    pub fn next_limit_change(&self, t_us: u64, horizon_us: u64) -> Option<u64> {
        let end = t_us.saturating_add(horizon_us);
        let limit = self.limit_at(t_us);
        let mut cur = t_us;
        loop {
            let b = self.next_boundary(cur, end - cur)?;
            if self.limit_at(b) != limit {
                return Some(b);
            }
            cur = b;
        }
    }
}

/// The limit an entry puts in force over `base`.
fn entry_limit(base: &Limit, effect: Effect, i: usize) -> Result<Limit, ScheduleError> {
    match effect {
        Effect::Set { capacity, refill } => Ok(Limit {
            capacity_ut: capacity.map_or(base.capacity_ut, |c| c * MICRO),
            rate: refill.unwrap_or(base.rate),
        }),
        Effect::Scale { millionths } => {
            let capacity = u128::from(base.capacity_ut) * u128::from(millionths) / u128::from(MICRO);
            let capacity_ut = u64::try_from(capacity)
                .ok()
                .filter(|c| *c <= MAX_CAPACITY * MICRO)
                .ok_or(ScheduleError::CapacityTooLarge((capacity / u128::from(MICRO)) as u64))?;
            let inexact = ScheduleError::InexactScaledRate { entry: i, millionths };
            let rate = if base.rate.is_zero() {
                Rate::ZERO
            } else {
                // num/den micro-tokens per µs times millionths/10^6: Rate::per takes whole tokens
                // per period, (num * millionths) tokens per (den * 10^6 * 10^6) µs.
                let tokens = base.rate.num().checked_mul(millionths).ok_or(inexact.clone())?;
                let period = base.rate.den().checked_mul(MICRO * MICRO).ok_or(inexact.clone())?;
                Rate::per(tokens, period).map_err(|_| inexact)?
            };
            Ok(Limit { capacity_ut, rate })
        }
    }
}

/// The state of a bucket brought forward to `now_us` across the schedule: from
/// `state.updated_us`, each segment of constant limit is applied with [`refill`] (trim to that
/// segment's capacity, then refill, floored to the micro-token) up to the next change of the
/// limit ([`Schedule::next_limit_change`]), and so on up to `now_us`.
///
/// **Flooring.** Each change of limit crossed floors once, so a bucket can lose under one
/// micro-token per change crossed relative to continuous refill: an under-admission, never an
/// over-admission, and [`wait_until_us`] follows exactly the same arithmetic. Boundaries that
/// leave the limit as it was are not segment ends and do not floor.
///
/// Walks every change of limit in between, so callers should not bring a state forward over months
/// of minute-by-minute windows (an idle bucket is full and can be dropped instead).
pub fn refill_scheduled(state: BucketState, schedule: &Schedule, now_us: u64) -> BucketState {
    let mut st = state;
    let mut cur = state.updated_us;
    loop {
        let limit = schedule.limit_at(cur);
        // A change exactly at `now_us` is crossed too, so the result is trimmed to the limit in
        // force at `now_us`. A clock that stepped back (`now_us < updated_us`) is, as in
        // `refill`, zero elapsed time.
        match (cur < now_us)
            .then(|| schedule.next_limit_change(cur, now_us - cur))
            .flatten()
        {
            Some(b) => {
                st = refill(st, &limit, b);
                cur = b;
            }
            None => return refill(st, &limit, now_us),
        }
    }
}

/// Microseconds from `now_us` until a bucket stored as `state` holds `need_ut` micro-tokens,
/// with the limit changing as the schedule says: the exact wait under the arithmetic of
/// [`refill_scheduled`]. `Some(0)` if it holds them already.
///
/// Walks the constant-limit segments from `state.updated_us`: in each, tokens are trimmed to
/// the segment's capacity and earned at its rate ([`Rate::time_to_earn`], the exact inverse of
/// the flooring refill), and if `need_ut` is reached before the segment ends that is the
/// answer; otherwise the state is refilled (floored) to the boundary, where the next limit
/// trims it if its capacity is lower, and the walk goes on. `None` when no instant up to
/// `now_us + horizon_us` admits (the need is above every capacity met, the rate is zero, or
/// the time lies beyond the horizon: what comes after the horizon is unknown). With no entries
/// this is [`crate::bucket::wait_us`] exactly, with no horizon.
pub fn wait_until_us(
    state: BucketState,
    need_ut: u64,
    schedule: &Schedule,
    now_us: u64,
    horizon_us: u64,
) -> Option<u64> {
    if schedule.entries.is_empty() {
        return wait_us(state, need_ut, &schedule.base, now_us);
    }
    let end = now_us.saturating_add(horizon_us);
    let mut st = state;
    let mut cur = state.updated_us;
    loop {
        let limit = schedule.limit_at(cur);
        let boundary = schedule.next_limit_change(cur, end.saturating_sub(cur));
        let segment_end = boundary.unwrap_or(end.saturating_add(1));
        if need_ut <= limit.capacity_ut {
            let tokens = st.tokens_ut.min(limit.capacity_ut);
            if let Some(earn) = limit.rate.time_to_earn(need_ut.saturating_sub(tokens)) {
                // Tokens never fall within a segment, so from the first instant they suffice
                // they do up to its end.
                let at = cur.saturating_add(earn).max(now_us);
                if at < segment_end {
                    return Some(at - now_us);
                }
            }
        }
        let b = boundary?;
        st = refill(st, &limit, b);
        cur = b;
    }
}

#[cfg(test)]
mod tests;
