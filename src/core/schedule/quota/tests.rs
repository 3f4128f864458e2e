use chrono::{DateTime, LocalResult, NaiveDateTime, Offset, TimeZone};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use proptest::prelude::*;

use super::*;
use std::sync::Arc;

use crate::core::bucket::{decide, DemandKind};
use crate::core::schedule::testing::{ask, debt_decision_matches, one, utc};
use crate::core::schedule::Plan;

const SEC: u64 = MICRO;
const MIN: u64 = 60 * SEC;
const HOUR: u64 = 60 * MIN;
const DAY: u64 = 24 * HOUR;

fn quota(limit: u64, reset: &str, tz: &str) -> Quota {
    Quota::new(limit, reset, Some(tz)).unwrap()
}

fn state(tokens: u64, updated_us: u64) -> BucketState {
    BucketState {
        tokens_ut: tokens * MICRO,
        updated_us,
    }
}

/// Every edge in `(from, to]`, walking `next_edge`.
fn edges(q: &Quota, from: u64, to: u64) -> Vec<u64> {
    let mut out = vec![];
    let mut cur = from;
    while let Some(e) = q.next_edge(cur, to) {
        out.push(e);
        cur = e;
    }
    out
}

/// Berlin's monthly reset is local midnight on the 1st: 23:00Z the day before in winter (CET),
/// 22:00Z in summer (CEST). An exhausted quota waits exactly until then and is full from then on.
#[test]
fn monthly_quota_resets_at_local_midnight_on_the_first() {
    let q = quota(100, "0 0 1 * *", "Europe/Berlin");
    assert_eq!(q.limit(), Limit::new(100, Rate::ZERO));
    assert_eq!(q.pattern(), "0 0 1 * *");
    assert_eq!(q.timezone(), chrono_tz::Europe::Berlin);
    let edge = utc(2026, 11, 30, 23, 0);
    let spring = utc(2026, 3, 31, 22, 0);
    assert_eq!(q.next_edge(utc(2026, 3, 15, 0, 0), u64::MAX), Some(spring));
    assert_eq!(q.prev_edge(utc(2026, 4, 15, 0, 0), 0), Some(spring));
    assert_eq!(q.next_edge(spring, u64::MAX), Some(utc(2026, 4, 30, 22, 0)));
    assert_eq!(q.prev_edge(spring, spring), Some(spring));
    assert_eq!(q.prev_edge(spring - 1, spring - DAY), None);

    let now = utc(2026, 11, 30, 10, 0);
    let empty = state(0, now);
    assert_eq!(q.wait_us(empty, MICRO, now, QUOTA_HORIZON_US), Some(edge - now));
    assert_eq!(q.wait_us(empty, 100 * MICRO, now, QUOTA_HORIZON_US), Some(edge - now));
    assert_eq!(q.wait_us(empty, 101 * MICRO, now, QUOTA_HORIZON_US), None);
    assert_eq!(q.wait_us(empty, MICRO, now, edge - now - 1), None);
    assert_eq!(q.wait_us(empty, 0, now, 0), Some(0));
    assert_eq!(q.advance(empty, edge - 1), state(0, edge - 1));
    assert_eq!(q.advance(empty, edge), state(100, edge));
    assert_eq!(q.advance(empty, edge + HOUR), state(100, edge + HOUR));
    // Asked later from the same stored state, the same instant.
    assert_eq!(
        q.wait_us(empty, MICRO, now + HOUR, QUOTA_HORIZON_US),
        Some(edge - now - HOUR)
    );
}

/// Three edges missed while idle reset once, to the capacity; tokens spent after that reset
/// stay spent until the next edge.
#[test]
fn idle_across_missed_edges_resets_once() {
    let q = quota(100, "0 0 1 * *", "Europe/Berlin");
    let idle = state(3, utc(2026, 8, 15, 12, 0));
    let now = utc(2026, 11, 15, 12, 0);
    assert_eq!(edges(&q, idle.updated_us, now).len(), 3);
    let after = q.advance(idle, now);
    assert_eq!(after, state(100, now));
    let spent = BucketState {
        tokens_ut: after.tokens_ut - 40 * MICRO,
        ..after
    };
    let later = utc(2026, 11, 20, 12, 0);
    assert_eq!(q.advance(spent, later), state(60, later));
    assert_eq!(
        q.advance(q.advance(spent, later), later + HOUR),
        state(60, later + HOUR)
    );
}

/// On 2026-03-29 Berlin skips 02:00-02:59 local (01:00Z, CET to CEST): a reset at 02:30 or
/// 02:00 comes at 01:00:00Z, the first instant after the gap; every minute of the gap together
/// resets once. On other days 02:30 is 02:30 local.
#[test]
fn reset_in_a_dst_gap_comes_at_the_end_of_the_gap() {
    let gap_end = utc(2026, 3, 29, 1, 0);
    let before = utc(2026, 3, 28, 12, 0);
    for (reset, minute) in [("30 2 * * *", 30), ("0 2 * * *", 0), ("59 2 * * *", 59)] {
        let q = quota(10, reset, "Europe/Berlin");
        assert_eq!(q.next_edge(before, u64::MAX), Some(gap_end), "{reset}");
        assert_eq!(q.next_edge(gap_end - 1, gap_end), Some(gap_end), "{reset}");
        assert_eq!(q.prev_edge(gap_end, 0), Some(gap_end), "{reset}");
        assert_eq!(
            q.prev_edge(gap_end - 1, 0),
            Some(utc(2026, 3, 28, 1, minute)),
            "{reset}"
        );
        assert_eq!(q.advance(state(0, gap_end - 1), gap_end), state(10, gap_end));
        assert_eq!(q.advance(state(0, gap_end - HOUR), gap_end - 1), state(0, gap_end - 1));
    }
    let q = quota(10, "30 2 * * *", "Europe/Berlin");
    assert_eq!(q.prev_edge(before, 0), Some(utc(2026, 3, 28, 1, 30))); // CET
    assert_eq!(q.next_edge(gap_end, u64::MAX), Some(utc(2026, 3, 30, 0, 30))); // CEST
    let hour = quota(10, "* 2 * * *", "Europe/Berlin");
    assert_eq!(
        edges(&hour, utc(2026, 3, 28, 23, 0), utc(2026, 3, 30, 0, 1)),
        vec![gap_end, utc(2026, 3, 30, 0, 0), utc(2026, 3, 30, 0, 1)]
    );
}

/// On 2026-10-25 Berlin runs 02:00-02:59 local twice (00:00-00:59Z in CEST, 01:00-01:59Z in
/// CET): 02:30 resets once, at its first occurrence, and not again at the second.
#[test]
fn ambiguous_reset_time_resets_once_at_its_first_occurrence() {
    let q = quota(10, "30 2 * * *", "Europe/Berlin");
    let first = utc(2026, 10, 25, 0, 30);
    assert_eq!(q.next_edge(utc(2026, 10, 24, 12, 0), u64::MAX), Some(first));
    assert_eq!(q.next_edge(first, u64::MAX), Some(utc(2026, 10, 26, 1, 30)));
    assert_eq!(q.prev_edge(utc(2026, 10, 25, 1, 45), 0), Some(first));
    let updated = utc(2026, 10, 25, 0, 45);
    assert_eq!(
        q.advance(state(0, updated), utc(2026, 10, 25, 1, 45)),
        state(0, utc(2026, 10, 25, 1, 45))
    );
    assert_eq!(
        q.wait_us(state(0, updated), MICRO, updated, QUOTA_HORIZON_US),
        Some(utc(2026, 10, 26, 1, 30) - updated)
    );
    // The whole repeated hour: 60 edges in the first pass, none in the second.
    let hour = quota(10, "* 2 * * *", "Europe/Berlin");
    let all = edges(&hour, utc(2026, 10, 24, 23, 0), utc(2026, 10, 25, 3, 0));
    assert_eq!(all.len(), 60);
    assert_eq!(all[0], utc(2026, 10, 25, 0, 0));
    assert_eq!(all[59], utc(2026, 10, 25, 0, 59));
    // Asked from inside the second pass, the next edge is the next day's.
    assert_eq!(
        hour.next_edge(utc(2026, 10, 25, 1, 10), u64::MAX),
        Some(utc(2026, 10, 26, 1, 0))
    );
    assert_eq!(
        hour.prev_edge(utc(2026, 10, 25, 1, 10), 0),
        Some(utc(2026, 10, 25, 0, 59))
    );
}

/// New York weekdays at 09:00 across spring forward (2026-03-08, a Sunday): 14:00Z on Friday
/// (EST), 13:00Z from Monday (EDT). Walking forward with `next_edge` and back with `prev_edge`
/// gives the same edges.
#[test]
fn weekday_mornings_in_new_york_forward_and_back() {
    let q = quota(5, "0 9 * * MON-FRI", "America/New_York");
    let from = utc(2026, 3, 5, 0, 0);
    let to = utc(2026, 3, 12, 0, 0);
    let forward = edges(&q, from, to);
    assert_eq!(
        forward,
        vec![
            utc(2026, 3, 5, 14, 0),
            utc(2026, 3, 6, 14, 0),
            utc(2026, 3, 9, 13, 0),
            utc(2026, 3, 10, 13, 0),
            utc(2026, 3, 11, 13, 0),
        ]
    );
    let mut backward = vec![];
    let mut cur = to;
    while let Some(e) = q.prev_edge(cur, from) {
        backward.push(e);
        cur = e - 1;
    }
    backward.reverse();
    assert_eq!(backward, forward);
    // Friday evening, exhausted: the retry-after runs over the weekend and the clock change.
    let friday = utc(2026, 3, 6, 22, 0);
    assert_eq!(
        q.wait_us(state(0, friday), MICRO, friday, QUOTA_HORIZON_US),
        Some(utc(2026, 3, 9, 13, 0) - friday)
    );
}

/// The horizon is long enough for a yearly quota in a leap year, and short of a four-yearly one.
#[test]
fn yearly_quota_gets_a_retry_after() {
    let q = quota(1000, "0 0 1 1 *", "Pacific/Chatham");
    let start = q.prev_edge(utc(2028, 6, 1, 0, 0), 0).unwrap();
    let next = q.next_edge(start, u64::MAX).unwrap();
    assert_eq!(next - start, 366 * DAY); // 2028 is a leap year; January is summer time both ends
    let just_after = start + SEC;
    assert_eq!(
        q.wait_us(state(0, just_after), MICRO, just_after, QUOTA_HORIZON_US),
        Some(next - just_after)
    );
    let leap_day = quota(1000, "0 0 29 2 *", "UTC");
    let t = utc(2028, 3, 1, 0, 0);
    assert_eq!(leap_day.wait_us(state(0, t), MICRO, t, QUOTA_HORIZON_US), None);
    assert_eq!(leap_day.next_edge(t, u64::MAX), Some(utc(2032, 2, 29, 0, 0)));
    assert_eq!(leap_day.prev_edge(t, 0), Some(utc(2028, 2, 29, 0, 0)));
}

/// A lowered limit trims without resetting; a clock that stepped back never resets and never
/// moves `updated_us` back; a pattern that matches no day never resets.
#[test]
fn trims_clock_steps_and_patterns_that_never_match() {
    let q = quota(10, "0 0 * * *", "UTC");
    let t = utc(2026, 6, 1, 12, 0);
    assert_eq!(q.advance(state(50, t), t + HOUR), state(10, t + HOUR));
    let midnight = utc(2026, 6, 2, 0, 0);
    // Stored after midnight, asked before it: only the trim.
    assert_eq!(q.advance(state(50, midnight + HOUR), t), state(10, midnight + HOUR));
    assert_eq!(q.advance(state(0, midnight + HOUR), t), state(0, midnight + HOUR));
    // The wait then counts from the stored time, the next midnight after it.
    assert_eq!(
        q.wait_us(state(0, midnight + HOUR), MICRO, t, QUOTA_HORIZON_US),
        Some(utc(2026, 6, 3, 0, 0) - t)
    );
    // Beyond the last searched second and at the ends of the range: answers, no panics.
    assert_eq!(q.next_edge(u64::MAX - 1, u64::MAX), None);
    assert_eq!(q.next_edge(0, HOUR), None);
    assert_eq!(q.prev_edge(u64::MAX, u64::MAX - DAY), None);
    assert_eq!(q.prev_edge(DAY, 0), Some(DAY));
    assert_eq!(q.advance(state(0, u64::MAX), u64::MAX), state(0, u64::MAX));
}

#[test]
fn validation_errors() {
    let err = |limit, reset: &str, tz| Quota::new(limit, reset, tz).unwrap_err();
    let zero = err(0, "0 0 1 * *", None);
    assert!(
        zero.to_string().contains("a quota's limit must be at least 1 token"),
        "{zero}"
    );
    assert_eq!(err(0, "0 0 1 * *", None), ScheduleError::QuotaLimitZero);
    assert_eq!(
        err(MAX_CAPACITY + 1, "0 0 1 * *", None),
        ScheduleError::QuotaLimitTooLarge(MAX_CAPACITY + 1)
    );
    // A reset that matches no day would never hand the allowance back: rejected.
    assert_eq!(
        err(10, "0 0 30 FEB *", None),
        ScheduleError::NeverResets("0 0 30 FEB *".to_string())
    );
    assert!(Quota::new(MAX_CAPACITY, "0 0 1 * *", None).is_ok());
    assert!(Quota::new(1, "0 0 1 * *", None).is_ok());
    assert_eq!(
        err(10, "0 0 0 1 * *", None),
        ScheduleError::SixFields("0 0 0 1 * *".to_string())
    );
    assert!(matches!(
        err(10, "0 0 1 *", None),
        ScheduleError::FieldCount { found: 4, .. }
    ));
    assert!(matches!(err(10, "0 0 L * *", None), ScheduleError::Extension(_)));
    assert!(matches!(err(10, "0 0 32 * *", None), ScheduleError::BadCron { .. }));
    assert_eq!(
        err(10, "0 0 1 * *", Some("Mars/Olympus")),
        ScheduleError::UnknownTimezone("Mars/Olympus".to_string())
    );
    // The cron is checked first, as for schedule entries.
    assert!(matches!(
        err(0, "0 0 1 *", Some("Mars/Olympus")),
        ScheduleError::FieldCount { .. }
    ));
}

#[test]
fn quota_is_shareable_and_clones_answer_alike() {
    fn shareable<T: Send + Sync + Clone + std::fmt::Debug>() {}
    shareable::<Quota>();
    let q = quota(10, "0 0 1 * *", "Europe/Berlin");
    let t = utc(2026, 5, 10, 0, 0);
    let e = q.next_edge(t, u64::MAX);
    assert_eq!(q.clone().next_edge(t, u64::MAX), e);
    assert!(format!("{q:?}").contains("0 0 1 * *"));
}

/// Questions about now and about a bucket's last update, in another period, alternate without
/// evicting each other, and every answer is the uncached one.
#[test]
fn cache_keeps_the_two_latest_periods() {
    let q = quota(10, "0 0 1 * *", "Europe/Berlin");
    let (old, now) = (utc(2026, 5, 20, 0, 0), utc(2026, 7, 3, 0, 0));
    for _ in 0..3 {
        for t in [now, old] {
            assert_eq!(q.next_edge(t, u64::MAX), q.search_next(t, u64::MAX));
            assert_eq!(q.prev_edge(t, 0), q.search_prev(t, 0));
        }
    }
    let cached = *q.periods.lock().unwrap();
    let june = utc(2026, 5, 31, 22, 0);
    let july = utc(2026, 6, 30, 22, 0);
    let august = utc(2026, 7, 31, 22, 0);
    let period = |start_us, end_us| Period {
        start_us,
        start_is_edge: true,
        end_us,
        end_is_edge: true,
    };
    assert_eq!(
        cached,
        [Some(period(utc(2026, 4, 30, 22, 0), june)), Some(period(july, august))]
    );
    // A third period pushes out the older of the two.
    assert_eq!(q.next_edge(august, u64::MAX), Some(utc(2026, 8, 31, 22, 0)));
    assert_eq!(
        q.periods.lock().unwrap()[1],
        Some(period(utc(2026, 4, 30, 22, 0), june))
    );
}

// ---- The property test against a naive, minute-by-minute reference. ----

const ZONES: [&str; 6] = [
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe", // DST of half an hour
    "Pacific/Chatham",     // +12:45 / +13:45, changes at 02:45 local
    "Asia/Kolkata",        // +05:30, no DST
];

/// Where each of [`ZONES`] changes its offset during 2026, in seconds since the epoch.
fn changes_2026(zone: usize) -> &'static [i64] {
    static CHANGES: std::sync::OnceLock<Vec<Vec<i64>>> = std::sync::OnceLock::new();
    &CHANGES.get_or_init(|| ZONES.iter().map(|z| scan_2026(z.parse().unwrap())).collect())[zone]
}

fn scan_2026(tz: Tz) -> Vec<i64> {
    let offset = |s: i64| {
        let t = DateTime::from_timestamp(s, 0).unwrap().naive_utc();
        tz.offset_from_utc_datetime(&t).fix().local_minus_utc()
    };
    let start = (utc(2026, 1, 1, 0, 0) / MICRO) as i64;
    let mut out = vec![];
    for h in 0..365 * 24 {
        let (lo, hi) = (start + h * 3600, start + (h + 1) * 3600);
        if offset(lo) != offset(hi) {
            let (mut lo, mut hi) = (lo, hi);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                if offset(mid) == offset(lo) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            out.push(hi);
        }
    }
    out
}

/// One cron field, biased towards values that land in or next to DST gaps and overlaps
/// (hours 0-4, minutes on the quarter hour) so that those cases come up often.
fn field(lo: u32, hi: u32, likely: &'static [u32]) -> impl Strategy<Value = String> {
    let any = lo..=hi;
    let near = prop::sample::select(likely);
    prop_oneof![
        2 => Just("*".to_string()),
        3 => near.clone().prop_map(|v| v.to_string()),
        1 => any.clone().prop_map(|v| v.to_string()),
        2 => (near.clone(), 0..4u32).prop_map(move |(a, w)| format!("{a}-{}", (a + w).min(hi))),
        1 => (2..=(hi - lo).div_ceil(2)).prop_map(|s| format!("*/{s}")),
        2 => (near, any).prop_map(|(a, b)| format!("{a},{b}")),
    ]
}

fn reset_pattern() -> impl Strategy<Value = String> {
    let dom = prop_oneof![
        6 => Just("*".to_string()),
        1 => (1..=31u32).prop_map(|d| d.to_string()),
        1 => (1..=28u32, 0..6u32).prop_map(|(d, w)| format!("{d}-{}", (d + w).min(31))),
    ];
    let month = prop_oneof![6 => Just("*".to_string()), 1 => Just("MAR,APR,SEP-nov".to_string())];
    let dow = prop_oneof![
        5 => Just("*".to_string()),
        1 => Just("SUN".to_string()),
        1 => Just("MON-FRI".to_string()),
        1 => (0..=7u32).prop_map(|d| d.to_string()),
    ];
    (
        field(0, 59, &[0, 15, 29, 30, 44, 45, 59]),
        field(0, 23, &[0, 1, 2, 3, 4]),
        dom,
        month,
        dow,
    )
        .prop_map(|(mi, h, dom, mo, dow)| format!("{mi} {h} {dom} {mo} {dow}"))
}

/// The edges with instants in `[lo_s, hi_s]`, from every local minute around that range that
/// croner matches: a single instant as it is, an ambiguous one at its first occurrence, one in
/// a gap at the first existing minute after it.
fn reference_edges(reset: &str, tz: Tz, lo_s: i64, hi_s: i64) -> Vec<u64> {
    let cron = CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build()
        .parse(reset)
        .unwrap();
    let naive = |s: i64| DateTime::from_timestamp(s - s.rem_euclid(60), 0).unwrap().naive_utc();
    let instant = |l: NaiveDateTime| match tz.from_local_datetime(&l) {
        LocalResult::Single(t) => Some(t.timestamp()),
        LocalResult::Ambiguous(a, b) => Some(a.timestamp().min(b.timestamp())),
        LocalResult::None => None,
    };
    let mut out: Vec<u64> = vec![];
    let mut l = naive(lo_s - 16 * 3600);
    let end = naive(hi_s + 16 * 3600);
    while l <= end {
        if cron.is_time_matching(&l).unwrap() {
            let mut m = l;
            let edge = loop {
                if let Some(t) = instant(m) {
                    break t;
                }
                m += chrono::Duration::minutes(1);
            };
            if (lo_s..=hi_s).contains(&edge) && out.last() != Some(&(edge as u64 * MICRO)) {
                out.push(edge as u64 * MICRO);
            }
        }
        l += chrono::Duration::minutes(1);
    }
    assert!(out.windows(2).all(|w| w[0] < w[1]), "edges out of order: {out:?}");
    out
}

/// The quota rules of docs/schedules-and-quotas.md applied to a list of edges.
struct Reference<'a>(&'a [u64]);

impl Reference<'_> {
    fn next(&self, t: u64, limit: u64) -> Option<u64> {
        self.0.iter().copied().find(|e| *e > t).filter(|e| *e <= limit)
    }
    fn prev(&self, t: u64, floor: u64) -> Option<u64> {
        self.0.iter().copied().rfind(|e| *e <= t).filter(|e| *e >= floor)
    }
    fn advance(&self, st: BucketState, cap: u64, now: u64) -> BucketState {
        if self.0.iter().any(|e| st.updated_us < *e && *e <= now) {
            BucketState {
                tokens_ut: cap,
                updated_us: now,
            }
        } else {
            BucketState {
                tokens_ut: st.tokens_ut.min(cap),
                updated_us: st.updated_us.max(now),
            }
        }
    }
    /// The first instant from `now` at which the brought-forward state holds `need`, by trying
    /// `now` and every edge.
    fn wait(&self, st: BucketState, need: u64, cap: u64, now: u64, horizon: u64) -> Option<u64> {
        std::iter::once(now)
            .chain(self.0.iter().copied().filter(|e| *e > now))
            .take_while(|t| *t <= now + horizon)
            .find(|t| self.advance(st, cap, *t).tokens_ut >= need)
            .map(|t| t - now)
    }
}

/// One round of questions, at instants derived from `t` that stay where the reference is exact.
#[derive(Clone, Debug)]
struct Ask {
    /// Shift of the question time from the case's centre, in seconds (-12 h to +12 h).
    shift_s: i64,
    /// Ask instead at (an index into) the edges within 12 h of the centre, less 1 µs, at it, or
    /// 1 µs after it.
    snap: Option<(usize, u64)>,
    /// `None`: the limit is the next edge itself.
    ahead_s: Option<u64>,
    back_s: u64,
    tokens: u64,
    updated_ago_s: u64,
    now_shift_s: i64,
    need: u64,
    horizon_s: u64,
}

fn asks() -> impl Strategy<Value = Vec<Ask>> {
    let ask = (
        prop_oneof![-43_200..43_200i64, -7200..7200i64],
        prop::option::weighted(0.3, (any::<usize>(), 0..3u64)),
        prop::option::weighted(0.8, 0..(36 * 3600u64)),
        prop_oneof![1 => Just(0u64), 4 => 0..(12 * 3600u64)],
        0..15u64,
        0..(12 * 3600u64),
        -7200..(12 * 3600i64),
        0..12u64,
        0..(24 * 3600u64),
    )
        .prop_map(
            |(shift_s, snap, ahead_s, back_s, tokens, updated_ago_s, now_shift_s, need, horizon_s)| Ask {
                shift_s,
                snap,
                ahead_s,
                back_s,
                tokens,
                updated_ago_s,
                now_shift_s,
                need,
                horizon_s,
            },
        );
    prop::collection::vec(ask, 1..6)
}

/// Asks every question in `asks` around `centre_s` of a quota resetting at `reset` in
/// `ZONES[zone]`, and compares with [`Reference`]: on one quota whose cache carries over from
/// question to question, on a copy with an empty cache for each question, and on the searches
/// without any cache.
fn check_against_reference(
    reset: &str,
    zone: usize,
    centre_s: i64,
    sub_us: u64,
    asks: &[Ask],
) -> Result<(), TestCaseError> {
    let tz: Tz = ZONES[zone].parse().unwrap();
    // Every question below stays within a day before and two days after the centre.
    let (lo_s, hi_s) = (centre_s - 86_400, centre_s + 2 * 86_400);
    let edges = reference_edges(reset, tz, lo_s, hi_s);
    let r = Reference(&edges);
    // A pattern that matches no day is rejected (it would never reset): nothing to compare.
    let Ok(q) = Quota::new(7, reset, Some(ZONES[zone])) else {
        prop_assert!(edges.is_empty());
        return Ok(());
    };
    let cap = 7 * MICRO;
    let centre_us = centre_s as u64 * MICRO;
    let near: Vec<u64> = edges
        .iter()
        .copied()
        .filter(|e| e.abs_diff(centre_us) < 12 * HOUR)
        .collect();
    for a in asks {
        let t = match a.snap {
            Some((i, k)) if !near.is_empty() => near[i % near.len()] + k - 1,
            _ => ((centre_s + a.shift_s) as u64) * MICRO + sub_us,
        };
        let fresh = || {
            let mut q = q.clone();
            *q.periods.get_mut().unwrap() = [None; 2];
            q
        };
        let limit = match a.ahead_s {
            Some(ahead_s) => t + ahead_s * MICRO,
            None => r.next(t, t + 36 * HOUR).unwrap_or(t),
        };
        let floor = t - a.back_s * MICRO;
        prop_assert_eq!(q.next_edge(t, limit), r.next(t, limit), "next_edge({}, {})", t, limit);
        prop_assert_eq!(fresh().next_edge(t, limit), r.next(t, limit));
        prop_assert_eq!(q.search_next(t, limit), r.next(t, limit));
        prop_assert_eq!(q.prev_edge(t, floor), r.prev(t, floor), "prev_edge({}, {})", t, floor);
        prop_assert_eq!(fresh().prev_edge(t, floor), r.prev(t, floor));
        prop_assert_eq!(q.search_prev(t, floor), r.prev(t, floor));

        let st = BucketState {
            tokens_ut: a.tokens * MICRO,
            updated_us: t - a.updated_ago_s * MICRO,
        };
        let now = (t as i64 + a.now_shift_s * MICRO as i64) as u64;
        let want = r.advance(st, cap, now);
        prop_assert_eq!(q.advance(st, now), want, "advance({:?}, {})", st, now);
        prop_assert_eq!(fresh().advance(st, now), want);
        let need = a.need * MICRO;
        let horizon = a.horizon_s * MICRO;
        let want = r.wait(st, need, cap, now, horizon);
        prop_assert_eq!(
            q.wait_us(st, need, now, horizon),
            want,
            "wait_us({:?}, {}, {}, {})",
            st,
            need,
            now,
            horizon
        );
        prop_assert_eq!(fresh().wait_us(st, need, now, horizon), want);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// `next_edge`, `prev_edge`, `advance` and `wait_us` agree with the rules applied to edges
    /// found minute by minute, for random patterns and zones, half the time near a change of
    /// the zone's offset in 2026.
    #[test]
    fn matches_a_minute_by_minute_reference(
        reset in reset_pattern(),
        zone in 0..ZONES.len(),
        change in 0..8usize,
        jitter_s in 0..(6 * 3600i64),
        uniform_s in 0..(3 * 365 * 86_400i64),
        sub_us in 0..MICRO,
        asks in asks(),
    ) {
        let changes = changes_2026(zone);
        let centre_s = match changes.get(change % (changes.len() * 2).max(1)) {
            Some(c) => c - 3 * 3600 + jitter_s,
            None => (utc(2025, 1, 1, 0, 0) / MICRO) as i64 + uniform_s,
        };
        check_against_reference(&reset, zone, centre_s, sub_us, &asks)?;
    }

    /// The same, with resets in the hours around the local time of the change and questions
    /// within two hours of it, so that gaps and both passes of an overlap come up every time.
    #[test]
    fn matches_the_reference_around_clock_changes(
        minutes in field(0, 59, &[0, 15, 29, 30, 44, 45, 59]),
        first_hour in 0..4u32,
        hours in 0..3u32,
        zone in 1..5usize,
        change in 0..2usize,
        shift_s in -7200..7200i64,
        sub_us in 0..MICRO,
        asks in asks(),
    ) {
        let reset = format!("{minutes} {first_hour}-{} * * *", first_hour + hours);
        let asks: Vec<Ask> = asks.into_iter().map(|a| Ask { shift_s: a.shift_s % 7200, ..a }).collect();
        let centre_s = changes_2026(zone)[change] + shift_s;
        check_against_reference(&reset, zone, centre_s, sub_us, &asks)?;
    }
}

// ---- Debt quotas (docs/usage-budgets.md) ---------------------------------------------------

/// A UTC reset whose edges are plain arithmetic on the minute, for the debt model below
/// (croner's edges are compared with the quota's above).
#[derive(Clone, Copy, Debug)]
enum Reset {
    /// `*/k * * * *`: minutes 0, k, 2k, ... of every hour.
    Every(u64),
    /// `m * * * *`.
    Hourly(u64),
    /// `m h * * *`.
    Daily(u64, u64),
}

impl Reset {
    fn cron(self) -> String {
        match self {
            Reset::Every(k) => format!("*/{k} * * * *"),
            Reset::Hourly(m) => format!("{m} * * * *"),
            Reset::Daily(m, h) => format!("{m} {h} * * *"),
        }
    }

    /// Whether `t` is an edge: a whole minute the pattern matches.
    fn is_edge(self, t: u64) -> bool {
        let (minute, hour) = (t / MIN % 60, t / HOUR % 24);
        t.is_multiple_of(MIN)
            && match self {
                Reset::Every(k) => minute.is_multiple_of(k),
                Reset::Hourly(m) => minute == m,
                Reset::Daily(m, h) => minute == m && hour == h,
            }
    }

    /// The longest time between two edges.
    fn period(self) -> u64 {
        match self {
            Reset::Every(k) => k * MIN,
            Reset::Hourly(_) => HOUR,
            Reset::Daily(..) => DAY,
        }
    }

    /// The first edge after `t`.
    fn next(self, t: u64) -> u64 {
        let mut m = t - t % MIN + MIN;
        while !self.is_edge(m) {
            m += MIN;
        }
        m
    }
}

fn reset() -> impl Strategy<Value = Reset> {
    prop_oneof![
        (2..=30u64).prop_map(Reset::Every),
        (0..60u64).prop_map(Reset::Hourly),
        (0..60u64, 0..24u64).prop_map(|(m, h)| Reset::Daily(m, h)),
    ]
}

/// The signed model of a debt quota, from docs/usage-budgets.md: a balance in micro-tokens
/// that usage reports take down to `-depth` (the rest is lost), refunds raise up to the
/// allowance, and each reset edge raises by one allowance, up to the allowance (an unused
/// allowance is not carried over, a debt is repaid rather than forgiven). Edges apply one at a
/// time, in order, whenever the model is brought past them.
struct DebtQuotaModel {
    reset: Reset,
    allowance: i128,
    depth: i128,
    balance: i128,
    at: u64,
}

impl DebtQuotaModel {
    fn advance(&mut self, t: u64) {
        let mut m = self.at - self.at % MIN + MIN;
        while m <= t {
            if self.reset.is_edge(m) {
                self.balance = (self.balance + self.allowance).min(self.allowance);
            }
            m += MIN;
        }
        self.at = self.at.max(t);
    }

    /// The first instant from `at` at which the balance is positive: now, or the first edge
    /// that makes it so.
    fn positive_from(&self) -> u64 {
        let (mut balance, mut t) = (self.balance, self.at);
        while balance < 1 {
            t = self.reset.next(t);
            balance = (balance + self.allowance).min(self.allowance);
        }
        t
    }
}

/// When the next demand comes: after a gap (up to two and a half periods of the reset), or at
/// the next edge less a microsecond, at it, or just after.
#[derive(Clone, Copy, Debug)]
enum When {
    After(u64),
    NextEdge(u64),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// A debt quota (`Quota::with_debt_depth`, its floor at most one allowance deep as the
    /// rules compiler requires) asked checks, usage reports and refunds at random instants
    /// across one or more reset edges, against the signed [`DebtQuotaModel`]: the same balance
    /// before and after every decision (so after each reset: the balance before it plus the
    /// allowance, never above the allowance; two resets make any debt whole), admission iff
    /// the balance is positive, reports debited down to the floor with the rest lost; and
    /// while the balance is not positive, the retry-after is the model's first positive
    /// instant (the next edge, or the one after when a floor one allowance deep meets a
    /// reset that brings it to exactly 0), at which the check passes and a microsecond before
    /// which it does not.
    #[test]
    fn a_debt_quota_matches_the_signed_model(
        reset in reset(),
        allowance in 1..50u64,
        depth_pick in 0..3u64,
        depth_any in 1..50u64,
        start in utc(2026, 1, 1, 0, 0)..utc(2027, 1, 1, 0, 0),
        steps in prop::collection::vec(
            (
                prop_oneof![3 => (0..2500u64).prop_map(When::After), 1 => (0..3u64).prop_map(When::NextEdge)],
                ask(),
            ),
            1..40,
        ),
    ) {
        // A floor one allowance deep a third of the time, the deepest the compiler allows.
        let depth = if depth_pick == 0 { allowance } else { 1 + depth_any % allowance };
        let depth_ut = depth * MICRO;
        let q = Quota::new(allowance, &reset.cron(), Some("UTC")).unwrap().with_debt_depth(depth_ut);
        prop_assert_eq!(q.allowance_ut(), allowance * MICRO);
        prop_assert_eq!(q.limit().capacity_ut, (allowance + depth) * MICRO);
        let plan = Plan::Quota(Arc::new(q));
        let plans = std::slice::from_ref(&plan);
        let mut model = DebtQuotaModel {
            reset,
            allowance: i128::from(allowance * MICRO),
            depth: i128::from(depth_ut),
            balance: i128::from(allowance * MICRO),
            at: start,
        };
        // A new bucket is full: the allowance, with the depth below it.
        let mut state = BucketState { tokens_ut: (allowance + depth) * MICRO, updated_us: start };
        let mut t = start;
        for (when, ask) in steps {
            t = match when {
                // Thousandths of the longest period between edges.
                When::After(k) => t + reset.period() / 1000 * k,
                When::NextEdge(k) => reset.next(t) + k - 1,
            };
            model.advance(t);
            let balance = model.balance;
            let d = decide(t, &[state], plans, &one(ask.demand(depth_ut)));
            let o = d.instances[0];
            let after = debt_decision_matches(&d, ask, balance, model.depth, model.allowance, t)?;
            model.balance = after;
            state = o.kept();
            if after < 1 {
                let check = one(DemandKind::DebtCheck { depth_ut });
                let w = plan.wait_us(state, depth_ut + 1, t).expect("a reset within the horizon");
                prop_assert_eq!(t + w, model.positive_from(), "retry-after at {}", t);
                prop_assert!(!decide(t + w, &[state], plans, &check).denied);
                if w > 0 {
                    prop_assert!(decide(t + w - 1, &[state], plans, &check).denied);
                }
            }
        }
    }
}
