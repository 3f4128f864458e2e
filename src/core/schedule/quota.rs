//! Calendar quotas (docs/schedules-and-quotas.md): a bucket that never refills on its own and is handed back
//! whole at each edge of a reset cron, such as `0 0 1 * *` for a monthly allowance.
//!
//! Pure like the rest of [`crate::core::schedule`]: the time is always passed in (microseconds since
//! the Unix epoch), tokens are micro-tokens, and nothing reads a clock or does I/O.
//!
//! **Edges.** Every local wall-clock minute `L` that the pattern matches in the quota's zone
//! gives one edge instant: the instant of `L` when it occurs once; its first occurrence when
//! clocks go back and it occurs twice; and, when clocks go forward over it (it never occurs),
//! the instant of the change, which is the first instant after the gap. Several minutes in one
//! gap give one edge. Later minutes never give earlier edges, which is what lets a search stop
//! at the first edge it finds.

use std::sync::Mutex;

use chrono::{Duration, LocalResult, NaiveDateTime, TimeZone};
use chrono_tz::Tz;

use super::entry::{
    bisect_offset_change, floor_minute, local_at, offset_at, parse_timezone, secs, utc_naive, CronPattern,
    LAST_SEARCHED_S,
};
use super::ScheduleError;
use crate::core::bucket::{BucketState, Limit, Rate, MAX_CAPACITY, MICRO};

/// How far ahead callers search for a quota's next reset (for a retry-after or a reset time):
/// 368 days. A yearly reset (`0 0 1 1 *`) is at most 366 days after the previous one in local
/// time; the two days over cover a zone changing its UTC offset in between (by up to a whole
/// day in tzdb since 1970: Kwajalein, 1993). Rarer resets, such as `0 0 29 2 *`, can be
/// further away than this, and then no retry-after is given.
pub const QUOTA_HORIZON_US: u64 = 368 * 86_400 * MICRO;

/// How far back from an instant the zone is examined for clocks going back: if they did within
/// this time, local times up to the one just before the change have already been seen, and an
/// edge comes only after them. Twelve hours: the longest step back in tzdb from 1970 to 2100 is
/// seven hours (Antarctica/Vostok, 1994), and offset changes are at least seven days apart
/// (America/Boa_Vista, 2000), so at most one change falls in this window. Checked over every
/// zone chrono-tz has.
const OVERLAP_SLACK_S: i64 = 12 * 3600;

/// Bounds on a UTC offset used to bracket the end of a gap: tzdb offsets since 1970 lie between
/// -12:00 and +14:00, so the instant a local time would have is within 16 hours of it read as
/// UTC.
const OFFSET_BOUND_S: i64 = 16 * 3600;

/// A calendar quota: `limit` whole tokens, no refill, handed back whole at each reset edge of a
/// five-field cron in an IANA timezone (docs/schedules-and-quotas.md).
///
/// The reset pattern is read exactly as a [`super::ScheduleEntry`] pattern is (five fields,
/// names, day-of-month or day-of-week when both are restricted). Where its edges fall is
/// described in the module documentation: a reset never comes before its local time, a reset
/// in a DST gap comes at the first instant after the gap, and a local time that occurs twice
/// resets once, at its first occurrence.
///
/// Holds a small cache of reset periods, so that the calls made on every decision
/// ([`Quota::advance`], [`Quota::next_edge`]) rarely search; the answers are the same with or
/// without it. `Send + Sync`: share it behind an `Arc`.
pub struct Quota {
    limit: Limit,
    /// Micro-tokens each reset edge adds, up to the capacity: the capacity, but for a debt
    /// quota's, whose capacity is raised by the floor's depth ([`Quota::with_debt_depth`]).
    allowance_ut: u64,
    pattern: String,
    timezone: Tz,
    cron: CronPattern,
    /// The two periods asked about most recently, newest first: the current one, and the one
    /// before it, so that questions about now and about a bucket's last update alternate
    /// without searching.
    periods: Mutex<[Option<Period>; 2]>,
}

/// Knowledge about the edges around some instant: none lies strictly between `start_us` and
/// `end_us`, and each end is an edge exactly when its flag says so. An end that is not an edge
/// is where the search that built the period stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Period {
    start_us: u64,
    start_is_edge: bool,
    end_us: u64,
    end_is_edge: bool,
}

impl Period {
    fn contains(&self, t_us: u64) -> bool {
        self.start_us <= t_us && t_us < self.end_us
    }
}

impl Quota {
    /// Validates and builds a quota of `limit` whole tokens that resets at each edge of the
    /// five-field cron `reset`, read in the IANA zone `timezone` (`None`: UTC).
    ///
    /// Errors, each a [`ScheduleError`]: the cron and timezone errors of
    /// [`super::ScheduleEntry::new`] (wrong number of fields, seconds, the `L`/`W`/`#`
    /// extensions, any other invalid pattern, an unknown zone), then a `limit` of 0
    /// ([`ScheduleError::QuotaLimitZero`]) or above [`MAX_CAPACITY`]
    /// ([`ScheduleError::QuotaLimitTooLarge`]), and a pattern that matches no day at all
    /// (`0 0 30 2 *`), with which the quota would never reset ([`ScheduleError::NeverResets`]).
    pub fn new(limit: u64, reset: &str, timezone: Option<&str>) -> Result<Quota, ScheduleError> {
        let cron = CronPattern::parse(reset)?;
        let timezone = parse_timezone(timezone)?;
        if limit == 0 {
            return Err(ScheduleError::QuotaLimitZero);
        }
        if limit > MAX_CAPACITY {
            return Err(ScheduleError::QuotaLimitTooLarge(limit));
        }
        cron.require_some_minute(reset)?;
        let (any_day, _) = cron.day_coverage();
        if !any_day {
            return Err(ScheduleError::NeverResets(reset.trim().to_string()));
        }
        Ok(Quota {
            limit: Limit::new(limit, Rate::ZERO),
            allowance_ut: limit * MICRO,
            pattern: reset.trim().to_string(),
            timezone,
            cron,
            periods: Mutex::new([None; 2]),
        })
    }

    /// The bucket's limit: capacity `limit` tokens (in micro-tokens), zero refill rate; for a
    /// debt quota, raised by the floor's depth.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// This quota as a debt bucket's (docs/usage-budgets.md): its capacity raised by
    /// `depth_ut`, the micro-tokens between a balance of zero and the floor, while a reset
    /// still adds one allowance: a balance in debt starts the next period that much short
    /// (overshoot is repaid, not forgiven at the edge), an unused one is not carried over.
    /// `depth_ut` must be at most the allowance (the rules compiler refuses more), so two
    /// edges always make the bucket full.
    pub fn with_debt_depth(mut self, depth_ut: u64) -> Quota {
        self.limit.capacity_ut = self.limit.capacity_ut.saturating_add(depth_ut);
        self
    }

    /// Micro-tokens a reset edge adds: the allowance (the capacity of a quota without debt).
    pub fn allowance_ut(&self) -> u64 {
        self.allowance_ut
    }

    /// Whether a reset adds less than the capacity: a debt quota's, whose resets must be
    /// counted (the Redis script leaves them to tollgate).
    pub fn has_debt(&self) -> bool {
        self.allowance_ut < self.limit.capacity_ut
    }

    /// The reset pattern as given (trimmed).
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The zone the reset pattern is read in.
    pub fn timezone(&self) -> Tz {
        self.timezone
    }

    /// The first reset edge in `(t_us, limit_us]`, or `None`. Edges are whole seconds, never
    /// after the end of year 9999. Answered from a cached period when `t_us` lies in one;
    /// otherwise by a search a day, an hour, then a minute at a time, whose period is cached.
    pub fn next_edge(&self, t_us: u64, limit_us: u64) -> Option<u64> {
        if limit_us <= t_us {
            return None;
        }
        let p = self.period_at(t_us);
        if p.end_is_edge {
            (p.end_us <= limit_us).then_some(p.end_us)
        } else if limit_us <= p.end_us {
            None
        } else {
            self.search_next(p.end_us, limit_us)
        }
    }

    /// The last reset edge in `[floor_us, t_us]`, or `None`. Cached and searched like
    /// [`Quota::next_edge`].
    pub fn prev_edge(&self, t_us: u64, floor_us: u64) -> Option<u64> {
        if floor_us > t_us {
            return None;
        }
        let p = self.period_at(t_us);
        if p.start_is_edge {
            (p.start_us >= floor_us).then_some(p.start_us)
        } else if floor_us >= p.start_us {
            None
        } else {
            self.search_prev(p.start_us, floor_us)
        }
    }

    /// The state of a quota bucket brought forward to `now_us` (docs/schedules-and-quotas.md: the reset applies
    /// on the first decision after an edge, and several missed edges apply once). If an edge
    /// lies in `(state.updated_us, now_us]` the bucket is full (`tokens_ut` = capacity, never
    /// more) as of `now_us`; otherwise the tokens are only trimmed to the capacity (a limit
    /// lowered by a reload) and `updated_us` becomes `max(updated_us, now_us)`. A clock that
    /// stepped back (`now_us < updated_us`) changes nothing but the trim and never resets.
    ///
    /// A debt quota's edge adds its allowance instead ([`Quota::with_debt_depth`]): one edge
    /// gives `min(tokens + allowance, capacity)`, two or more the capacity.
    pub fn advance(&self, state: BucketState, now_us: u64) -> BucketState {
        let capacity_ut = self.limit.capacity_ut;
        if now_us > state.updated_us {
            if let Some(edge) = self.prev_edge(now_us, state.updated_us + 1) {
                let one_edge = self.has_debt() && self.prev_edge(edge - 1, state.updated_us + 1).is_none();
                let tokens_ut = if one_edge {
                    state
                        .tokens_ut
                        .min(capacity_ut)
                        .saturating_add(self.allowance_ut)
                        .min(capacity_ut)
                } else {
                    capacity_ut
                };
                return BucketState {
                    tokens_ut,
                    updated_us: now_us,
                };
            }
        }
        BucketState {
            tokens_ut: state.tokens_ut.min(capacity_ut),
            updated_us: state.updated_us.max(now_us),
        }
    }

    /// Microseconds from `now_us` until a quota bucket stored as `state` holds `need_ut`
    /// micro-tokens: the first instant `t >= now_us` at which
    /// [`Quota::advance`]`(state, t)` holds them. `Some(0)` if it does at `now_us`; `None` if
    /// `need_ut` is above the capacity or that instant is after `now_us + horizon_us` (see
    /// [`QUOTA_HORIZON_US`]). Otherwise it is the next edge after both `now_us` and
    /// `state.updated_us`, since nothing before an edge adds tokens.
    pub fn wait_us(&self, state: BucketState, need_ut: u64, now_us: u64, horizon_us: u64) -> Option<u64> {
        self.first_holding(state, need_ut, now_us, horizon_us)
            .map(|at| at - now_us)
    }

    /// The first instant `t >= now_us` (and within `horizon_us` of it) at which
    /// [`Quota::advance`]`(state, t)` holds `need_ut`: `now_us`, or a reset edge after both
    /// `now_us` and the state's update (the first, or for a debt quota the second at most).
    pub fn first_holding(&self, state: BucketState, need_ut: u64, now_us: u64, horizon_us: u64) -> Option<u64> {
        if need_ut > self.limit.capacity_ut {
            return None;
        }
        if self.advance(state, now_us).tokens_ut >= need_ut {
            return Some(now_us);
        }
        let limit_us = now_us.saturating_add(horizon_us);
        let mut from = now_us.max(state.updated_us);
        // Nothing before an edge adds tokens, and two edges fill the bucket.
        for _ in 0..2 {
            let edge = self.next_edge(from, limit_us)?;
            // An edge fills a quota without debt: no need to work out the state there.
            if !self.has_debt() || self.advance(state, edge).tokens_ut >= need_ut {
                return Some(edge);
            }
            from = edge;
        }
        None
    }

    /// The period around `t_us`, from the cache or found by searching a horizon each way (and
    /// then cached in place of the older of the two).
    fn period_at(&self, t_us: u64) -> Period {
        let cached = *self.periods.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cached.into_iter().flatten().find(|p| p.contains(t_us)) {
            return p;
        }
        let p = self.search_period(t_us);
        if p.contains(t_us) {
            let mut periods = self.periods.lock().unwrap_or_else(|e| e.into_inner());
            *periods = [Some(p), periods[0]];
        }
        p
    }

    /// The period around `t_us` without the cache: the edges on either side, or where a search
    /// of [`QUOTA_HORIZON_US`] stopped.
    fn search_period(&self, t_us: u64) -> Period {
        let floor_us = t_us.saturating_sub(QUOTA_HORIZON_US);
        let limit_us = t_us.saturating_add(QUOTA_HORIZON_US);
        let prev = self.search_prev(t_us, floor_us);
        let next = self.search_next(t_us, limit_us);
        Period {
            start_us: prev.unwrap_or(floor_us),
            start_is_edge: prev.is_some(),
            end_us: next.unwrap_or(limit_us),
            end_is_edge: next.is_some(),
        }
    }

    /// [`Quota::next_edge`] without the cache.
    fn search_next(&self, t_us: u64, limit_us: u64) -> Option<u64> {
        let s = secs(t_us);
        let limit_s = secs(limit_us).min(LAST_SEARCHED_S);
        if s >= limit_s {
            return None;
        }
        // A minute after the latest local time seen by `limit_s` has its edge after it, so the
        // search stops there. It starts at the minute of the latest local time seen by `s`,
        // whose edge is normally by `s` (so each edge found is checked), and every earlier
        // minute's is too: a minute the clocks skipped would have to occur again after `s`,
        // which no zone does (offset changes are a week apart and shorter than that).
        let mut from = floor_minute(self.high_water(s)?);
        let until = floor_minute(self.high_water(limit_s)?).checked_add_signed(Duration::minutes(1))?;
        loop {
            let local = self.cron.find_local(from, until, true)?;
            from = local.checked_add_signed(Duration::minutes(1))?;
            match self.edge_of(local) {
                Some(edge) if edge > s => {
                    return (edge <= limit_s).then(|| edge as u64 * MICRO);
                }
                _ => {}
            }
        }
    }

    /// [`Quota::prev_edge`] without the cache.
    fn search_prev(&self, t_us: u64, floor_us: u64) -> Option<u64> {
        let s = secs(t_us).min(LAST_SEARCHED_S);
        let floor_s = i64::try_from(floor_us.div_ceil(MICRO)).ok()?;
        if floor_s > s {
            return None;
        }
        // An edge at or after `floor_s` comes from a local minute no earlier than the local
        // time at `floor_s` less the longest step back of the clocks.
        let mut from = floor_minute(self.high_water(s)?);
        let until =
            floor_minute(local_at(self.timezone, floor_s)?).checked_sub_signed(Duration::seconds(OVERLAP_SLACK_S))?;
        loop {
            let local = self.cron.find_local_back(from, until)?;
            from = local.checked_sub_signed(Duration::minutes(1))?;
            match self.edge_of(local) {
                Some(edge) if edge <= s => {
                    return (edge >= floor_s).then(|| edge as u64 * MICRO);
                }
                _ => {}
            }
        }
    }

    /// The latest local wall-clock time at any second up to `s`: the local time at `s`, unless
    /// the clocks went back within [`OVERLAP_SLACK_S`] before `s` and the time just before the
    /// change was later. Every local minute after it first occurs (or is skipped) after `s`.
    fn high_water(&self, s: i64) -> Option<NaiveDateTime> {
        let tz = self.timezone;
        let now = local_at(tz, s)?;
        let before = s - OVERLAP_SLACK_S;
        let (then, offset) = (offset_at(tz, before)?, offset_at(tz, s)?);
        if then <= offset {
            return Some(now);
        }
        let change = bisect_offset_change(tz, before, s, then);
        Some(now.max(utc_naive(change - 1 + then)?))
    }

    /// The edge of a matching local minute, in seconds since the epoch: its only or first
    /// occurrence, or for a minute that the clocks skip, the first instant after the gap.
    fn edge_of(&self, local: NaiveDateTime) -> Option<i64> {
        match self.timezone.from_local_datetime(&local) {
            LocalResult::Single(t) => Some(t.timestamp()),
            LocalResult::Ambiguous(a, b) => Some(a.timestamp().min(b.timestamp())),
            LocalResult::None => self.gap_end(local),
        }
    }

    /// The instant the clocks jumped over `local`: the first second whose local time is after
    /// it. Bracketed by the offset bounds, and found by bisection, which is exact because one
    /// offset change at most falls in the bracket.
    fn gap_end(&self, local: NaiveDateTime) -> Option<i64> {
        let tz = self.timezone;
        let as_utc = local.and_utc().timestamp();
        let (mut lo, mut hi) = (as_utc - OFFSET_BOUND_S, as_utc + OFFSET_BOUND_S);
        if local_at(tz, lo)? > local || local_at(tz, hi)? <= local {
            return None;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if local_at(tz, mid)? > local {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Some(hi)
    }
}

impl Clone for Quota {
    fn clone(&self) -> Quota {
        Quota {
            limit: self.limit,
            allowance_ut: self.allowance_ut,
            pattern: self.pattern.clone(),
            timezone: self.timezone,
            cron: self.cron.clone(),
            periods: Mutex::new(*self.periods.lock().unwrap_or_else(|e| e.into_inner())),
        }
    }
}

impl std::fmt::Debug for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quota")
            .field("limit", &self.limit)
            .field("allowance_ut", &self.allowance_ut)
            .field("pattern", &self.pattern)
            .field("timezone", &self.timezone)
            .finish()
    }
}

#[cfg(test)]
mod tests;
