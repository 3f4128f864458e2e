//! Schedules: limits that follow the clock (docs/schedules-and-quotas.md). Pure like [`crate::core::bucket`]: every
//! function takes the time and returns an answer; nothing reads a clock or does I/O.
//!
//! A [`Schedule`] is a base [`Limit`] and a list of [`ScheduleEntry`]s, each a cron window in a
//! timezone. At any instant the first active entry decides the limit ([`Schedule::limit_at`]);
//! with none active the base applies. The limit is constant between boundaries
//! ([`Schedule::next_boundary`]), so a bucket's future is a walk over constant-limit segments,
//! each computed with the [`crate::core::bucket::refill`] arithmetic ([`refill_scheduled`],
//! [`wait_until_us`]).
//!
//! Units are those of the bucket core: microseconds since the Unix epoch, micro-tokens.

mod entry;
mod expiring;
mod plan;
mod quota;
mod reloaded;

pub use entry::{Effect, ScheduleEntry, MAX_SCALE};
pub use expiring::{Expiring, MAX_EXPIRES_US};
pub use plan::Plan;
pub use quota::{Quota, QUOTA_HORIZON_US};
pub use reloaded::{Reloaded, MAX_RELOADS_REMEMBERED};

use std::sync::Arc;

use arc_swap::ArcSwapOption;

use crate::core::bucket::{refill, wait_us, BucketState, Limit, Rate, MAX_CAPACITY, MICRO};

/// How far ahead callers search for boundaries and admissions by default: 62 days. That is
/// longer than the longest gap between two days a day-of-month pattern can match (the 31st:
/// 31 January to 31 March is 59 days), so every window that opens at all in a year of normal
/// months is seen to open. The search skips whole days, so a call costs about one step per
/// day searched per entry (and a few offset probes per day), not one per minute.
pub const DEFAULT_HORIZON_US: u64 = 62 * 86_400 * MICRO;

/// How many changes of limit a look ahead (a wait, a time until full) walks at most, within
/// [`DEFAULT_HORIZON_US`], after the instant it looks from (a wait's `now`; a time until full
/// looks from the state's last write). Each costs a search for the next change, so a bucket
/// that fills slowly under windows that change every few minutes would otherwise walk tens of
/// thousands on every decision. Past it the answer is "not within the horizon": no retry-after, no reset
/// time, and a store keeps the bucket until it is decided on again or evicted.
pub const MAX_CHANGES_AHEAD: usize = 256;

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
    /// An absolute capacity above [`MAX_CAPACITY`] whole tokens.
    #[error("capacity {0} tokens is above the maximum of 9000000000")]
    CapacityTooLarge(u64),
    /// A scaled capacity above [`MAX_CAPACITY`] whole tokens.
    #[error("the capacity scaled by {millionths}/1000000 is {capacity} tokens, above the maximum of 9000000000")]
    ScaledCapacityTooLarge {
        /// Index of the entry in the schedule.
        entry: usize,
        /// The scale in millionths.
        millionths: u64,
        /// The scaled capacity in whole tokens.
        capacity: u64,
    },
    /// A window whose pattern matches no day (`* * 30 FEB *`): it would never be active.
    #[error("cron `{0}` matches no day, so the window would never be active")]
    NeverActive(String),
    /// A scale that leaves a capacity above zero but below one token: no request could pass.
    #[error("scale {scale} leaves a capacity of {capacity_ut} micro-tokens, less than one token, so no request could pass; use `capacity: 0` for a window that denies everything")]
    ScaledBelowOneToken {
        /// Index of the entry in the schedule.
        entry: usize,
        /// The scale as a decimal.
        scale: String,
        /// The scaled capacity in micro-tokens.
        capacity_ut: u64,
    },
    /// A quota's `limit` of 0.
    #[error("a quota's limit must be at least 1 token")]
    QuotaLimitZero,
    /// A quota's `limit` above [`MAX_CAPACITY`].
    #[error("a quota's limit of {0} tokens is above the maximum of 9000000000")]
    QuotaLimitTooLarge(u64),
    /// A quota reset pattern that matches no day, so the quota would never reset.
    #[error("reset `{0}` matches no day, so the quota would never reset")]
    NeverResets(String),
    /// The scaled refill rate cannot be represented exactly (see [`crate::core::bucket::RateError`]).
    #[error("the refill rate scaled by {millionths}/1000000 cannot be computed exactly; use a simpler scale or an absolute refill")]
    InexactScaledRate {
        /// Index of the entry in the schedule.
        entry: usize,
        /// The scale in millionths.
        millionths: u64,
    },
}

/// A base limit and the entries that override it while active, with each entry's limit worked
/// out once.
///
/// Evaluating windows means timezone lookups and cron matching (about 100 ns an entry), and
/// finding the next change means searching ahead, while decisions on a bucket mostly fall
/// within one stretch of constant limit. So the schedule remembers the latest such stretch it
/// found (a `Segment`) and answers [`Schedule::limit_at`] and [`Schedule::next_limit_change`]
/// inside it without evaluating anything (it keeps two, so a wait that looks into the next
/// stretch does not evict the current one). The cache only ever moves forward in time and is a
/// pure optimisation: every answer is the one the search gives (tested).
pub struct Schedule {
    base: Limit,
    entries: Vec<ScheduleEntry>,
    limits: Vec<Limit>,
    /// The latest two stretches of constant limit found, latest first: a wait that crosses
    /// into the next stretch caches it without evicting the one that holds now.
    segments: ArcSwapOption<[Option<Segment>; 2]>,
    /// The latest answer of [`Schedule::full_from_empty_at`]: `(t_us, answer)`.
    full_from_empty: ArcSwapOption<(u64, Option<u64>)>,
}

/// A stretch of time `[start_us, end_us)` over which the limit is `limit`. When `changes_at_end`
/// the limit differs at `end_us`; otherwise none of `(start_us, end_us]` changes it (the search
/// stopped at its horizon).
#[derive(Clone, Copy, Debug)]
struct Segment {
    start_us: u64,
    end_us: u64,
    changes_at_end: bool,
    limit: Limit,
    /// The entry active at `start_us` (`None`: the base). Later in the stretch another entry
    /// with the same limit may be the active one.
    entry: Option<usize>,
}

impl Clone for Schedule {
    fn clone(&self) -> Schedule {
        Schedule {
            base: self.base,
            entries: self.entries.clone(),
            limits: self.limits.clone(),
            segments: ArcSwapOption::empty(),
            full_from_empty: ArcSwapOption::empty(),
        }
    }
}

impl std::fmt::Debug for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schedule")
            .field("base", &self.base)
            .field("entries", &self.entries)
            .field("limits", &self.limits)
            .finish()
    }
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
        Ok(Schedule {
            base,
            entries,
            limits,
            segments: ArcSwapOption::empty(),
            full_from_empty: ArcSwapOption::empty(),
        })
    }

    /// This schedule as a debt bucket's (docs/usage-budgets.md): every capacity, the base's and
    /// each entry's, raised by `depth_ut`, the micro-tokens between a balance of zero and the
    /// floor, so that the bucket's tokens are its balance plus `depth_ut` and the arithmetic of
    /// an ordinary bucket applies unchanged (a maintenance window of capacity 0 holds the
    /// balance at zero at most). Saturates; the rules compiler keeps the sums below 2^53.
    pub fn with_debt_depth(mut self, depth_ut: u64) -> Schedule {
        let raise = |l: &mut Limit| l.capacity_ut = l.capacity_ut.saturating_add(depth_ut);
        raise(&mut self.base);
        self.limits.iter_mut().for_each(raise);
        self
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
        match self.segment_at(t_us) {
            Some(seg) => seg.limit,
            None => self.search_limit_at(t_us),
        }
    }

    /// An entry whose limit is in force at `t_us` (`None`: the base's is), answered from the
    /// cache when it can be: the first active entry, or another with the same limit. For what
    /// depends only on the limit (how it is reported); [`Schedule::active_entry`] says which
    /// entry is active.
    pub fn limit_entry_at(&self, t_us: u64) -> Option<usize> {
        match self.segment_at(t_us) {
            Some(seg) => seg.entry,
            None => self.active_entry(t_us),
        }
    }

    fn search_limit_at(&self, t_us: u64) -> Limit {
        self.active_entry(t_us).map_or(self.base, |i| self.limits[i])
    }

    /// The cached segment holding `t_us`, after moving the cache forward to the segment that
    /// starts at `t_us` when `t_us` lies beyond the cached one (or nothing is cached). `None`
    /// for an instant before the cached segment, which the caller searches for directly.
    fn segment_at(&self, t_us: u64) -> Option<Segment> {
        if self.entries.is_empty() {
            return None;
        }
        let cached = match self.segments.load().as_deref() {
            Some(segs) => {
                if let Some(seg) = segs.iter().flatten().find(|s| s.start_us <= t_us && t_us < s.end_us) {
                    return Some(*seg);
                }
                *segs
            }
            None => [None; 2],
        };
        // Only ever cache forward: an instant before both cached stretches (a bucket last
        // updated long ago) is searched for directly.
        if cached.iter().flatten().count() == 2 && cached.iter().flatten().all(|s| t_us < s.start_us) {
            return None;
        }
        let entry = self.active_entry(t_us);
        let limit = entry.map_or(self.base, |i| self.limits[i]);
        let (end_us, changes_at_end) = match self.search_limit_change(t_us, DEFAULT_HORIZON_US) {
            Some(end) => (end, true),
            None => (t_us.saturating_add(DEFAULT_HORIZON_US), false),
        };
        if end_us <= t_us {
            return None;
        }
        let seg = Segment {
            start_us: t_us,
            end_us,
            changes_at_end,
            limit,
            entry,
        };
        // Keep the two latest stretches, latest first.
        let mut all = [Some(seg), cached[0], cached[1]];
        all.sort_by_key(|s| std::cmp::Reverse(s.map(|s| s.start_us)));
        self.segments.store(Some(Arc::new([all[0], all[1]])));
        Some(seg)
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
        if let Some(seg) = self.segment_at(t_us) {
            let end = t_us.saturating_add(horizon_us);
            if seg.changes_at_end {
                return (seg.end_us <= end).then_some(seg.end_us);
            }
            if end <= seg.end_us {
                return None;
            }
        }
        self.search_limit_change(t_us, horizon_us)
    }

    /// The last change of limit in `(t_us - lookback_us, t_us]`, if any: where the stretch of
    /// constant limit holding `t_us` begins, when it began that recently.
    pub fn last_limit_change(&self, t_us: u64, lookback_us: u64) -> Option<u64> {
        let mut cur = t_us.saturating_sub(lookback_us);
        let mut last = None;
        while let Some(b) = self.next_limit_change(cur, t_us - cur) {
            last = Some(b);
            cur = b;
        }
        last
    }

    /// When a bucket emptied at `t_us` is full again ([`full_at_us`] with the default horizon),
    /// remembered for the latest `t_us` asked: a shared store asks it once per stretch of
    /// constant limit, for the end of the stretch, to bound how long it keeps a bucket. Since
    /// every state is at least empty, no bucket written at or before `t_us` is full later.
    pub fn full_from_empty_at(&self, t_us: u64) -> Option<u64> {
        if let Some(cached) = self.full_from_empty.load().as_deref() {
            if cached.0 == t_us {
                return cached.1;
            }
        }
        let empty = BucketState {
            tokens_ut: 0,
            updated_us: t_us,
        };
        let answer = full_at_us(empty, self, DEFAULT_HORIZON_US);
        self.full_from_empty.store(Some(Arc::new((t_us, answer))));
        answer
    }

    fn search_limit_change(&self, t_us: u64, horizon_us: u64) -> Option<u64> {
        let end = t_us.saturating_add(horizon_us);
        let limit = self.search_limit_at(t_us);
        let mut cur = t_us;
        loop {
            let b = self.next_boundary(cur, end - cur)?;
            if self.search_limit_at(b) != limit {
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
                .ok_or(ScheduleError::ScaledCapacityTooLarge {
                    entry: i,
                    millionths,
                    capacity: u64::try_from(capacity / u128::from(MICRO)).unwrap_or(u64::MAX),
                })?;
            if capacity_ut > 0 && capacity_ut < MICRO {
                return Err(ScheduleError::ScaledBelowOneToken {
                    entry: i,
                    scale: (millionths as f64 / 1e6).to_string(),
                    capacity_ut,
                });
            }
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
/// A bucket full at a change of limit is full under the next limit too (`cross`): raising a
/// capacity grants nothing at once to a bucket that is not full, and a full one is the same as
/// a missing one, which starts full at the capacity in force (docs/schedules-and-quotas.md).
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
                st = cross(st, &limit, b);
                if st.tokens_ut == u64::MAX {
                    // Full, so full under every later limit too: no need to walk on.
                    return BucketState {
                        tokens_ut: schedule.limit_at(now_us).capacity_ut,
                        updated_us: st.updated_us.max(now_us),
                    };
                }
                cur = b;
            }
            None => return refill(st, &limit, now_us),
        }
    }
}

/// The state of a bucket stored as `state` brought forward to the last change of limit in
/// `(state.updated_us, t_us]`, exactly as [`refill_scheduled`] passes it on its way to any
/// instant of the stretch that change begins; `state` itself when no change lies there. A
/// bucket full at that change holds the capacity in force from it.
///
/// For a store that keeps the walk over changes of limit here and refills within one stretch
/// itself (the Redis script): `refill(refill_to_last_change(s, t), limit_at(t), now)` equals
/// `refill_scheduled(s, now)` for every `now` in that stretch.
pub fn refill_to_last_change(state: BucketState, schedule: &Schedule, t_us: u64) -> BucketState {
    let mut st = state;
    let mut cur = state.updated_us;
    while cur < t_us {
        let Some(b) = schedule.next_limit_change(cur, t_us - cur) else {
            break;
        };
        st = cross(st, &schedule.limit_at(cur), b);
        if st.tokens_ut == u64::MAX {
            st.tokens_ut = schedule.limit_at(b).capacity_ut;
        }
        cur = b;
    }
    st
}

/// The state at a change of limit at `b_us`, refilled under the `limit` that ends there. A
/// bucket full at that instant stays full under the next limit, whatever its capacity: a full
/// bucket is the same as no bucket (a store may drop it at any time, and a missing bucket
/// starts full at the capacity in force), so a raised capacity finds it full rather than
/// holding the old capacity. Held as `u64::MAX`, which the next segment trims to its capacity.
fn cross(state: BucketState, limit: &Limit, b_us: u64) -> BucketState {
    let st = refill(state, limit, b_us);
    if st.tokens_ut >= limit.capacity_ut {
        BucketState {
            tokens_ut: u64::MAX,
            ..st
        }
    } else {
        st
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
/// this is [`crate::core::bucket::wait_us`] exactly, with no horizon.
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
    // A clock that stepped back: up to its update the state is only trimmed (as in
    // `refill_scheduled`), so if that holds enough it does now, not from the update on.
    if now_us < state.updated_us && refill_scheduled(state, schedule, now_us).tokens_ut >= need_ut {
        return Some(0);
    }
    let end = now_us.saturating_add(horizon_us);
    first_instant(state, schedule, now_us, end, |limit| {
        (need_ut <= limit.capacity_ut).then_some(need_ut)
    })
    .map(|at| at - now_us)
}

/// The first instant from `state.updated_us` (and within `horizon_us` of it) at which the
/// bucket stored as `state` is full under the schedule: it holds the capacity in force at that
/// instant. A window that lowers the capacity below the tokens held makes the bucket full at
/// once (it is trimmed); one that raises it makes it full later. `None` when that does not
/// happen within the horizon (a zero rate, or a capacity that keeps rising out of reach).
pub fn full_at_us(state: BucketState, schedule: &Schedule, horizon_us: u64) -> Option<u64> {
    let end = state.updated_us.saturating_add(horizon_us);
    first_instant(state, schedule, state.updated_us, end, |limit| Some(limit.capacity_ut))
}

/// The first instant from `now_us` (within `horizon_us` of it) at which the bucket stored as
/// `state` is full under a positive capacity: [`full_at_us`] for a bucket that can admit, and
/// for one inside a zero-capacity window (full, but admitting nothing) the end of that window.
/// What `duration_until_reset` announces.
pub fn reopen_at_us(state: BucketState, schedule: &Schedule, now_us: u64, horizon_us: u64) -> Option<u64> {
    let end = now_us.saturating_add(horizon_us);
    first_instant(state, schedule, now_us, end, |limit| {
        (limit.capacity_ut > 0).then_some(limit.capacity_ut)
    })
}

/// The first instant `t` in `[not_before, end]` at which the bucket stored as `state`, brought
/// forward by [`refill_scheduled`], holds `need(limit_at(t))` micro-tokens (`need` gives `None`
/// where a limit can never satisfy it).
///
/// Segment by segment from `state.updated_us`: the instant the tokens would suffice if the
/// segment's limit held on is worked out first, and boundaries are searched for only up to
/// it, so the cost grows with the changes of limit crossed, not with the horizon. At most
/// [`MAX_CHANGES_AHEAD`] changes after `not_before` are crossed; those before it are walked
/// as [`refill_scheduled`] walks them.
fn first_instant(
    state: BucketState,
    schedule: &Schedule,
    not_before: u64,
    end: u64,
    need: impl Fn(&Limit) -> Option<u64>,
) -> Option<u64> {
    let mut st = state;
    let mut cur = state.updated_us;
    // Changes of limit crossed after `not_before`: the bound is on those. The ones before it
    // are the past, which bringing the state forward to `not_before` walks anyway.
    let mut ahead = 0;
    loop {
        let limit = schedule.limit_at(cur);
        let candidate = need(&limit).and_then(|n| {
            let tokens = st.tokens_ut.min(limit.capacity_ut);
            // Tokens never fall within a segment, so from the first instant they suffice they
            // do up to its end.
            limit
                .rate
                .time_to_earn(n.saturating_sub(tokens))
                .map(|earn| cur.saturating_add(earn).max(not_before))
        });
        let search_to = candidate.unwrap_or(end).min(end);
        let boundary = (search_to > cur)
            .then(|| schedule.next_limit_change(cur, search_to - cur))
            .flatten();
        match (boundary, candidate) {
            (Some(b), _) => {
                st = cross(st, &limit, b);
                cur = b;
                if b > not_before {
                    ahead += 1;
                    if ahead > MAX_CHANGES_AHEAD {
                        return None;
                    }
                }
            }
            (None, Some(at)) if at <= end => return Some(at),
            (None, _) => return None,
        }
    }
}

#[cfg(test)]
mod tests;

/// Helpers the schedule and quota tests share.
#[cfg(test)]
pub(crate) mod testing {
    use chrono::NaiveDate;
    use proptest::prelude::*;

    use crate::core::bucket::{Decision, Demand, DemandKind, MICRO};

    /// What a debt bucket is asked: the request-path check, a usage report of `n` tokens, a
    /// refund of `n`.
    #[derive(Clone, Copy, Debug)]
    pub(crate) enum Ask {
        Check,
        Report(u64),
        Refund(u64),
    }

    impl Ask {
        /// The demand this makes of a debt bucket whose floor lies `depth_ut` below zero.
        pub(crate) fn demand(self, depth_ut: u64) -> DemandKind {
            match self {
                Ask::Check => DemandKind::DebtCheck { depth_ut },
                Ask::Report(n) => DemandKind::Debit {
                    amount_ut: n * MICRO,
                    depth_ut,
                },
                Ask::Refund(n) => DemandKind::Refund(n * MICRO),
            }
        }
    }

    /// Checks, reports and refunds, in the proportions the debt property tests use.
    pub(crate) fn ask() -> impl Strategy<Value = Ask> {
        prop_oneof![
            3 => Just(Ask::Check),
            4 => (1..120u64).prop_map(Ask::Report),
            1 => (1..40u64).prop_map(Ask::Refund),
        ]
    }

    /// One enforced demand on instance 0.
    pub(crate) fn one(kind: DemandKind) -> [Demand; 1] {
        [Demand {
            instance: 0,
            kind,
            enforced: true,
        }]
    }

    /// Checks decision `d` (one demand `ask` on one debt bucket `depth` µt deep, decided at
    /// `t`) against a signed model whose balance before it is `balance` and whose capacity in
    /// force is `cap` (µt): the same balance before; admission iff it is positive; a report
    /// debited down to the floor, the rest lost; a refund up to `cap`; the balance after, and
    /// a write iff it moved. Returns the balance after.
    pub(crate) fn debt_decision_matches(
        d: &Decision,
        ask: Ask,
        balance: i128,
        depth: i128,
        cap: i128,
        t: u64,
    ) -> Result<i128, TestCaseError> {
        let o = d.instances[0];
        prop_assert_eq!(
            i128::from(o.before.tokens_ut) - depth,
            balance,
            "balance at {} ({:?})",
            t,
            ask
        );
        let after = match ask {
            Ask::Check => {
                prop_assert_eq!(d.denied, balance < 1);
                balance
            }
            Ask::Report(n) => {
                prop_assert_eq!(d.denied, balance < 1, "a report passes iff the balance was positive");
                let amount = i128::from(n * MICRO);
                let taken = amount.min(balance + depth);
                prop_assert_eq!(i128::from(o.debited_ut), taken);
                prop_assert_eq!(i128::from(o.lost_ut), amount - taken);
                balance - taken
            }
            Ask::Refund(n) => {
                prop_assert!(!d.denied);
                if balance < cap {
                    (balance + i128::from(n * MICRO)).min(cap)
                } else {
                    balance
                }
            }
        };
        prop_assert_eq!(i128::from(o.after.tokens_ut) - depth, after);
        prop_assert_eq!(o.changed, after != balance, "written iff the balance moved");
        Ok(after)
    }

    /// A UTC instant in microseconds.
    pub(crate) fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> u64 {
        let t = NaiveDate::from_ymd_opt(y, mo, d)
            .and_then(|d| d.and_hms_opt(h, mi, 0))
            .expect("a valid date and time");
        t.and_utc().timestamp() as u64 * MICRO
    }
}
