use chrono::{DateTime, TimeZone, Timelike};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use proptest::prelude::*;

use super::*;
use crate::core::bucket::{decide, Demand, DemandKind};
use crate::core::schedule::testing::{ask, debt_decision_matches, one, utc};

const MIN: u64 = 60 * MICRO;
const HOUR: u64 = 60 * MIN;

fn per_s(tokens: u64) -> Rate {
    Rate::per(tokens, MICRO).unwrap()
}

fn per_min(tokens: u64) -> Rate {
    Rate::per(tokens, MIN).unwrap()
}

fn entry(cron: &str, tz: &str) -> ScheduleEntry {
    ScheduleEntry::new(cron, Some(tz), Some(0.5), None, None).unwrap()
}

/// Opens and closes at the given UTC instants: inactive just before `open`, active from it to
/// just before `close`, and those are the boundaries found.
fn assert_window(e: &ScheduleEntry, open: u64, close: u64) {
    assert!(!e.is_active(open - 1), "active just before {open}");
    assert!(e.is_active(open), "inactive at {open}");
    assert!(e.is_active(close - 1), "inactive just before {close}");
    assert!(!e.is_active(close), "active at {close}");
    assert_eq!(e.next_change(open - HOUR, open + DEFAULT_HORIZON_US), Some(open));
    assert_eq!(e.next_change(open - 1, open + DEFAULT_HORIZON_US), Some(open));
    assert_eq!(e.next_change(open, open + DEFAULT_HORIZON_US), Some(close));
    assert_eq!(e.next_change(close - 1, close + DEFAULT_HORIZON_US), Some(close));
}

/// 2026-03-08, a Sunday: New York springs forward at 02:00 EST (07:00 UTC). The weekday window
/// is 09:00-18:00 EST (14:00-23:00 UTC) on the Friday before and 09:00-18:00 EDT (13:00-22:00
/// UTC) on the Monday after, is closed all weekend, and the search from Friday's close crosses
/// the transition to Monday's open.
#[test]
fn business_hours_across_spring_forward() {
    let e = entry("* 9-17 * * MON-FRI", "America/New_York");
    assert_window(&e, utc(2026, 3, 6, 14, 0), utc(2026, 3, 6, 23, 0));
    assert_window(&e, utc(2026, 3, 9, 13, 0), utc(2026, 3, 9, 22, 0));
    assert_eq!(
        e.next_change(utc(2026, 3, 6, 23, 0), utc(2026, 4, 1, 0, 0)),
        Some(utc(2026, 3, 9, 13, 0))
    );
    assert!(!e.is_active(utc(2026, 3, 8, 15, 0)));
    // Every day, the DST day itself: before the change 9-17 would be 14-23 UTC; after it, 13-22.
    let daily = entry("* 9-17 * * *", "America/New_York");
    assert_window(&daily, utc(2026, 3, 7, 14, 0), utc(2026, 3, 7, 23, 0));
    assert_window(&daily, utc(2026, 3, 8, 13, 0), utc(2026, 3, 8, 22, 0));
}

/// 2026-11-01, a Sunday: New York falls back at 02:00 EDT (06:00 UTC). 09:00-18:00 EDT is
/// 13:00-22:00 UTC on the Friday before; 09:00-18:00 EST is 14:00-23:00 UTC on the Monday after.
#[test]
fn business_hours_across_fall_back() {
    let e = entry("* 9-17 * * MON-FRI", "America/New_York");
    assert_window(&e, utc(2026, 10, 30, 13, 0), utc(2026, 10, 30, 22, 0));
    assert_window(&e, utc(2026, 11, 2, 14, 0), utc(2026, 11, 2, 23, 0));
    assert_eq!(
        e.next_change(utc(2026, 10, 30, 22, 0), utc(2026, 12, 1, 0, 0)),
        Some(utc(2026, 11, 2, 14, 0))
    );
    let daily = entry("* 9-17 * * *", "America/New_York");
    assert_window(&daily, utc(2026, 10, 31, 13, 0), utc(2026, 10, 31, 22, 0));
    assert_window(&daily, utc(2026, 11, 1, 14, 0), utc(2026, 11, 1, 23, 0));
}

/// The documented DST treatment: a local minute in the gap is never active, a window that
/// contains the gap spans it, and a local minute that occurs twice is active twice.
#[test]
fn dst_gap_and_overlap() {
    let ny = "America/New_York";
    // 02:xx does not exist on 8 March: inactive all that day; next active 02:00 EDT on the 9th.
    let gap = entry("* 2 * * *", ny);
    let midnight = utc(2026, 3, 8, 5, 0); // 00:00 EST
    assert!(!gap.is_active(utc(2026, 3, 8, 7, 0)));
    assert_eq!(
        gap.next_change(midnight, midnight + DEFAULT_HORIZON_US),
        Some(utc(2026, 3, 9, 6, 0))
    );
    // 01:00 EST (06:00 UTC) to 04:00 EDT (08:00 UTC): the jump at 07:00 UTC changes nothing.
    let around = entry("* 1-3 * * *", ny);
    assert_window(&around, utc(2026, 3, 8, 6, 0), utc(2026, 3, 8, 8, 0));
    // 01:30 happens at 05:30 UTC (EDT) and again at 06:30 UTC (EST) on 1 November.
    let twice = entry("30 1 * * *", ny);
    let t = utc(2026, 11, 1, 5, 0);
    let mut seen = vec![];
    let mut cur = t;
    while let Some(b) = twice.next_change(cur, t + 2 * HOUR) {
        seen.push(b);
        cur = b;
    }
    assert_eq!(
        seen,
        vec![
            utc(2026, 11, 1, 5, 30),
            utc(2026, 11, 1, 5, 31),
            utc(2026, 11, 1, 6, 30),
            utc(2026, 11, 1, 6, 31)
        ]
    );
    // A window across the overlap runs on through it: 01:00 EDT (05:00 UTC) to 02:00 EST (07:00 UTC).
    let hour1 = entry("* 1 * * *", ny);
    assert_window(&hour1, utc(2026, 11, 1, 5, 0), utc(2026, 11, 1, 7, 0));
}

/// Standard cron: with both day fields restricted, either may match.
#[test]
fn day_of_month_or_day_of_week() {
    let e = entry("0 12 13 * FRI", "UTC");
    assert!(e.is_active(utc(2026, 3, 6, 12, 0))); // a Friday, not the 13th
    assert!(e.is_active(utc(2026, 10, 13, 12, 0))); // the 13th, a Tuesday
    assert!(e.is_active(utc(2026, 2, 13, 12, 0))); // both
    assert!(!e.is_active(utc(2026, 3, 5, 12, 0))); // neither
    assert!(!e.is_active(utc(2026, 3, 6, 12, 1)));
    // Names, lists, steps, lower case, 7 as Sunday.
    let e = entry("*/15 0-6,22-23 * jan-MAR sat,7", "UTC");
    assert!(e.is_active(utc(2026, 3, 8, 22, 45))); // Sunday
    assert!(!e.is_active(utc(2026, 3, 8, 22, 46)));
    assert!(!e.is_active(utc(2026, 4, 5, 22, 45))); // April
    assert!(!e.is_active(utc(2026, 3, 9, 22, 45))); // Monday
}

/// scale 0.5 halves capacity and refill while the window is open, and the base comes back.
#[test]
fn scale_halves_and_restores() {
    let base = Limit::new(100, per_s(10));
    let s = Schedule::new(base, vec![entry("* 9-17 * * *", "UTC")]).unwrap();
    let half = Limit::new(50, per_s(5));
    assert_eq!(s.limit_at(utc(2026, 6, 1, 8, 59)), base);
    assert_eq!(s.limit_at(utc(2026, 6, 1, 9, 0)), half);
    assert_eq!(s.limit_at(utc(2026, 6, 1, 17, 59) + MIN - 1), half);
    assert_eq!(s.limit_at(utc(2026, 6, 1, 18, 0)), base);
    assert_eq!(base.time_to_fill_us(), half.time_to_fill_us());
    assert_eq!(
        s.next_boundary(utc(2026, 6, 1, 12, 0), DEFAULT_HORIZON_US),
        Some(utc(2026, 6, 1, 18, 0))
    );
    // A factor that does not divide: the capacity floors to the micro-token, the rate is exact.
    let third = ScheduleEntry::new("* * * * *", None, Some(1.0 / 3.0), None, None).unwrap();
    assert_eq!(third.effect(), Effect::Scale { millionths: 333_333 });
    let s = Schedule::new(Limit::new(10, per_s(7)), vec![third]).unwrap();
    let l = s.limit_at(0);
    assert_eq!(l.capacity_ut, 3_333_330);
    assert_eq!(l.rate, Rate::per(7 * 333_333, MICRO * MICRO).unwrap());
}

/// The first active entry wins, so the order of overlapping entries matters.
#[test]
fn first_match_wins() {
    let day = ScheduleEntry::new("* 9-17 * * *", None, None, Some(5), None).unwrap();
    let noon = ScheduleEntry::new("* 12-13 * * *", None, None, Some(50), Some(per_s(50))).unwrap();
    let base = Limit::new(100, per_s(1));
    let a = Schedule::new(base, vec![day.clone(), noon.clone()]).unwrap();
    let b = Schedule::new(base, vec![noon, day]).unwrap();
    let t = utc(2026, 6, 1, 12, 30);
    assert_eq!(a.limit_at(t), Limit::new(5, per_s(1)));
    assert_eq!(b.limit_at(t), Limit::new(50, per_s(50)));
    let t = utc(2026, 6, 1, 10, 0);
    assert_eq!(a.limit_at(t), b.limit_at(t));
    assert_eq!(a.limit_at(utc(2026, 6, 1, 20, 0)), base);
    // At 11:00 the noon entry's opening is a boundary, but in `a` it is shadowed.
    let t = utc(2026, 6, 1, 11, 0);
    assert_eq!(a.next_boundary(t, DEFAULT_HORIZON_US), Some(utc(2026, 6, 1, 12, 0)));
    assert_eq!(a.next_limit_change(t, DEFAULT_HORIZON_US), Some(utc(2026, 6, 1, 18, 0)));
    assert_eq!(b.next_limit_change(t, DEFAULT_HORIZON_US), Some(utc(2026, 6, 1, 12, 0)));
}

/// A request denied 5 minutes before a window that doubles the refill rate waits across the
/// boundary. Base: 10 tokens, 1 per minute; from 09:00 UTC, 2 per minute. Empty at 08:55, a
/// request for 8 tokens: 5 come by 09:00, the other 3 take 90 s at the doubled rate, so 390 s
/// (the flat estimate would be 480 s).
#[test]
fn wait_across_a_boundary_that_doubles_the_rate() {
    let window = ScheduleEntry::new("* 9-17 * * *", None, None, None, Some(per_min(2))).unwrap();
    let s = Schedule::new(Limit::new(10, per_min(1)), vec![window]).unwrap();
    let now = utc(2026, 6, 1, 8, 55);
    let empty = BucketState {
        tokens_ut: 0,
        updated_us: now,
    };
    assert_eq!(wait_us(empty, 8 * MICRO, s.base(), now), Some(480 * MICRO));
    assert_eq!(
        wait_until_us(empty, 8 * MICRO, &s, now, DEFAULT_HORIZON_US),
        Some(390 * MICRO)
    );
    assert_exact_wait(empty, 8 * MICRO, &s, now, 390 * MICRO);

    // Where the segment walk floors: 7 per hour, 14 per hour from 09:00, one token needed.
    // The rates are 7/3600 and 7/1800 micro-tokens per µs. By 09:00, 300 s earn
    // floor(300e6 * 7 / 3600) = 583_333 micro-tokens (a third of one is floored away at the
    // boundary); the other 416_667 take ceil(416_667 * 1800 / 7) = 107_142_943 µs. Total
    // 407_142_943 µs; continuously it would be 407_142_857.1, so the floor at the boundary
    // costs 86 µs here (a third of a micro-token at the doubled rate), never an early admission.
    let window = ScheduleEntry::new("* 9-17 * * *", None, None, None, Some(Rate::per(14, HOUR).unwrap())).unwrap();
    let s = Schedule::new(Limit::new(10, Rate::per(7, HOUR).unwrap()), vec![window]).unwrap();
    assert_eq!(
        wait_until_us(empty, MICRO, &s, now, DEFAULT_HORIZON_US),
        Some(407_142_943)
    );
    assert_exact_wait(empty, MICRO, &s, now, 407_142_943);
    // Asked later, from the same stored state, the same instant.
    assert_eq!(
        wait_until_us(empty, MICRO, &s, now + 6 * MIN, DEFAULT_HORIZON_US),
        Some(407_142_943 - 6 * MIN)
    );
}

/// The answer is the first instant at which the scheduled refill holds the need.
fn assert_exact_wait(state: BucketState, need: u64, s: &Schedule, now: u64, wait: u64) {
    assert!(refill_scheduled(state, s, now + wait).tokens_ut >= need);
    if wait > 0 {
        assert!(refill_scheduled(state, s, now + wait - 1).tokens_ut < need);
    }
}

/// A bucket written after `now` (the clock stepped back since) that already holds what is
/// asked waits 0, as under a constant limit: brought to an instant before its update, a state
/// changes by nothing (`refill_scheduled`), so it admits at `now`. The wait used to run from
/// the update instead, answering `updated - now` for a request that passes at once (found by
/// `a_client_that_retries_at_retry_after_passes`: a debt check at a balance of one
/// micro-token, 1 µs behind the write).
#[test]
fn a_state_written_after_now_that_holds_enough_waits_nothing() {
    let window = ScheduleEntry::new("* 9-17 * * *", None, None, Some(5), None).unwrap();
    let s = Schedule::new(Limit::new(10, per_min(1)), vec![window]).unwrap();
    for now in [utc(2026, 6, 1, 8, 0), utc(2026, 6, 1, 12, 0)] {
        let ahead = BucketState {
            tokens_ut: 3 * MICRO,
            updated_us: now + 1,
        };
        assert_eq!(refill_scheduled(ahead, &s, now).tokens_ut, 3 * MICRO);
        assert_eq!(wait_us(ahead, 3 * MICRO, s.base(), now), Some(0), "a constant limit");
        assert_eq!(wait_until_us(ahead, 3 * MICRO, &s, now, DEFAULT_HORIZON_US), Some(0));
        assert_exact_wait(ahead, 3 * MICRO, &s, now, 0);
        // One micro-token more comes 60 µs after the write (a token a minute), 61 µs from now.
        assert_eq!(
            wait_until_us(ahead, 3 * MICRO + 1, &s, now, DEFAULT_HORIZON_US),
            Some(61)
        );
        assert_exact_wait(ahead, 3 * MICRO + 1, &s, now, 61);
    }
}

/// The bound on changes of limit a wait walks is on those ahead of `now`: the ones between a
/// state's last write and `now` are the past, which every decision walks anyway
/// (`refill_scheduled`). A bucket written at 18:00 and asked at 03:00, under a window that
/// toggles the refill every minute and a maintenance window (capacity 0) from 00:00 to 05:59,
/// is denied until 06:00, when it comes out of the maintenance full: a wait of 3 h exactly,
/// with no change of limit in between. It used to have none (no `Retry-After`), the 360
/// changes from 18:00 to midnight counted against the 256 ahead (found by
/// `a_client_that_retries_at_retry_after_passes`).
#[test]
fn changes_before_now_do_not_count_against_the_look_ahead() {
    let closed = ScheduleEntry::new("* 0-5 * * *", None, None, Some(0), None).unwrap();
    let toggling = ScheduleEntry::new("*/2 * * * *", None, None, None, Some(per_min(2))).unwrap();
    let s = Schedule::new(Limit::new(10, per_min(1)), vec![closed, toggling]).unwrap();
    let written = BucketState {
        tokens_ut: 0,
        updated_us: utc(2026, 6, 1, 18, 0),
    };
    let now = utc(2026, 6, 2, 3, 0);
    assert_eq!(refill_scheduled(written, &s, now).tokens_ut, 0, "closed");
    assert_eq!(
        wait_until_us(written, MICRO, &s, now, DEFAULT_HORIZON_US),
        Some(3 * HOUR)
    );
    assert_exact_wait(written, MICRO, &s, now, 3 * HOUR);
    // The bucket is full at the end of the maintenance, 10 tokens.
    assert_eq!(
        reopen_at_us(written, &s, now, DEFAULT_HORIZON_US),
        Some(utc(2026, 6, 2, 6, 0))
    );
}

/// A window with a lower capacity trims the bucket at its start; one with a higher capacity
/// grants nothing at once to a bucket that is not full, while a full one stays full (it is the
/// same as no bucket). A need above the window's capacity waits for the window to end.
#[test]
fn trims_at_a_lower_capacity_and_waits_out_the_window() {
    let small = ScheduleEntry::new("* 9 * * *", None, None, Some(10), None).unwrap();
    let s = Schedule::new(Limit::new(100, per_s(1)), vec![small]).unwrap();
    let full = BucketState {
        tokens_ut: 100 * MICRO,
        updated_us: utc(2026, 6, 1, 8, 59),
    };
    // Trimmed from the first instant of the window.
    assert_eq!(refill_scheduled(full, &s, utc(2026, 6, 1, 9, 0)).tokens_ut, 10 * MICRO);
    assert_eq!(
        refill_scheduled(full, &s, utc(2026, 6, 1, 9, 0) - 1).tokens_ut,
        100 * MICRO
    );
    let at_930 = refill_scheduled(full, &s, utc(2026, 6, 1, 9, 30));
    assert_eq!(at_930.tokens_ut, 10 * MICRO);
    // Full under 10 when the window closes, so full under 100 after it.
    let now = utc(2026, 6, 1, 9, 30);
    assert_eq!(
        refill_scheduled(full, &s, utc(2026, 6, 1, 10, 0)).tokens_ut,
        100 * MICRO
    );
    assert_eq!(
        wait_until_us(full, 20 * MICRO, &s, now, DEFAULT_HORIZON_US),
        Some(30 * MIN)
    );
    assert_exact_wait(full, 20 * MICRO, &s, now, 30 * MIN);
    // Within the window, 5 tokens are there already.
    assert_eq!(wait_until_us(full, 5 * MICRO, &s, now, DEFAULT_HORIZON_US), Some(0));
    // Emptied 2 s before the window closes, a bucket holds 2 tokens at 10:00 and refills from
    // there: 18 s more for 20.
    let emptied = BucketState {
        tokens_ut: 0,
        updated_us: utc(2026, 6, 1, 10, 0) - 2 * MICRO,
    };
    assert_eq!(
        refill_scheduled(emptied, &s, utc(2026, 6, 1, 10, 0)).tokens_ut,
        2 * MICRO
    );
    assert_exact_wait(emptied, 20 * MICRO, &s, emptied.updated_us, 20 * MICRO);
}

#[test]
fn nothing_within_the_horizon_is_none() {
    let closed = ScheduleEntry::new("* * * * *", None, None, None, Some(Rate::ZERO)).unwrap();
    let s = Schedule::new(Limit::new(10, per_s(1)), vec![closed]).unwrap();
    let empty = BucketState {
        tokens_ut: 0,
        updated_us: utc(2026, 6, 1, 0, 0),
    };
    assert_eq!(
        wait_until_us(empty, MICRO, &s, empty.updated_us, DEFAULT_HORIZON_US),
        None
    );
    // Closed on Sundays only: 1 token per second again on Monday.
    let sundays = ScheduleEntry::new("* * * * SUN", None, None, None, Some(Rate::ZERO)).unwrap();
    let s = Schedule::new(Limit::new(10, per_s(1)), vec![sundays]).unwrap();
    let sunday = utc(2026, 5, 31, 12, 0);
    let empty = BucketState {
        tokens_ut: 0,
        updated_us: sunday,
    };
    assert_eq!(
        wait_until_us(empty, MICRO, &s, sunday, DEFAULT_HORIZON_US),
        Some(12 * HOUR + MICRO)
    );
    assert_eq!(wait_until_us(empty, MICRO, &s, sunday, 12 * HOUR), None);
    // More than the capacity never comes.
    assert_eq!(wait_until_us(empty, 11 * MICRO, &s, sunday, DEFAULT_HORIZON_US), None);
    // No entries: the unscheduled wait, whatever the horizon.
    let plain = Schedule::new(Limit::new(10, per_s(1)), vec![]).unwrap();
    assert_eq!(wait_until_us(empty, MICRO, &plain, sunday, 0), Some(MICRO));
    assert_eq!(plain.next_boundary(sunday, DEFAULT_HORIZON_US), None);
}

#[test]
fn validation_errors() {
    let err = |cron: &str| ScheduleEntry::new(cron, None, Some(2.0), None, None).unwrap_err();
    assert!(matches!(err("0 0 9 * * MON"), ScheduleError::SixFields(_)));
    assert!(matches!(err("0 9 * *"), ScheduleError::FieldCount { found: 4, .. }));
    assert!(matches!(
        err("0 9 * * * * 2026"),
        ScheduleError::FieldCount { found: 7, .. }
    ));
    for ext in [
        "0 0 L * *",
        "0 0 15W * *",
        "0 0 LW * *",
        "0 0 * * 5#3",
        "0 0 * * 5L",
        "0 0 * * L",
    ] {
        assert!(matches!(err(ext), ScheduleError::Extension(_)), "{ext}");
    }
    for bad in [
        "0 25 * * *",
        "60 * * * *",
        "0 0 0 * *",
        "0 0 * 13 *",
        "0 0 * * FOO",
        "0 0 * MON *",
        "0 0 ? * *",
    ] {
        assert!(
            matches!(err(bad), ScheduleError::BadCron { .. }),
            "{bad}: {:?}",
            err(bad)
        );
    }
    // Reasons that name the field and what it allows.
    for (bad, reason) in [
        (
            "@daily",
            "nicknames such as `@daily` are not supported; write the five fields (`0 0 * * *` is daily)",
        ),
        ("* 24 * * *", "24 is out of range for the hour field (0-23)"),
        ("0 0 0 * *", "0 is out of range for the day-of-month field (1-31)"),
        (
            "* 22-6 * * *",
            "range `22-6` in the hour field runs backwards; ranges do not wrap around (write `22-23,0-6`)",
        ),
        (
            "* * * DEC-JAN *",
            "range `DEC-JAN` in the month field runs backwards; ranges do not wrap around (write `12,1`)",
        ),
        (
            "* * * * MON-SUN",
            "range `MON-SUN` in the day-of-week field runs backwards; ranges do not wrap around (write `1-7`)",
        ),
        (
            "1/5 * * * *",
            "`1/5` in the minute field: a step needs `*` or a range before it (`*/5`, `1-59/5`)",
        ),
        (
            "*/0 * * * *",
            "step `/0` in the minute field must be a whole number of at least 1",
        ),
        ("* * * * 8", "8 is out of range for the day-of-week field (0-7)"),
    ] {
        assert_eq!(err(bad).to_string(), format!("cron `{bad}` is invalid: {reason}"));
    }
    assert_eq!(
        err("0 0 9 * * MON").to_string(),
        "cron `0 0 9 * * MON` has six fields; use five (minute hour day-of-month month day-of-week): seconds are not \
         supported"
    );
    assert_eq!(
        err("0 0 L * *").to_string(),
        "cron `0 0 L * *` uses the L, W or # extension, which is not supported"
    );
    assert_eq!(
        err("0 0 * * FOO").to_string(),
        "cron `0 0 * * FOO` is invalid: unknown name `FOO` in the day-of-week field"
    );

    let e = ScheduleEntry::new("* * * * *", Some("Mars/Olympus"), Some(2.0), None, None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown timezone `Mars/Olympus`; use an IANA name such as Europe/Berlin or America/New_York"
    );
    let new = |scale, capacity, refill| ScheduleEntry::new("* * * * *", None, scale, capacity, refill);
    assert_eq!(
        new(Some(0.5), Some(1), None).unwrap_err(),
        ScheduleError::ScaleWithAbsolute
    );
    assert_eq!(
        new(Some(0.5), None, Some(per_s(1))).unwrap_err(),
        ScheduleError::ScaleWithAbsolute
    );
    assert_eq!(new(None, None, None).unwrap_err(), ScheduleError::NoEffect);
    for s in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(
                new(Some(s), None, None).unwrap_err(),
                ScheduleError::NonPositiveScale(_)
            ),
            "{s}"
        );
    }
    assert!(matches!(
        new(Some(1e-9), None, None).unwrap_err(),
        ScheduleError::ScaleOutOfRange(_)
    ));
    assert!(matches!(
        new(Some(2e6), None, None).unwrap_err(),
        ScheduleError::ScaleOutOfRange(_)
    ));
    assert_eq!(
        new(None, Some(MAX_CAPACITY + 1), None).unwrap_err(),
        ScheduleError::CapacityTooLarge(MAX_CAPACITY + 1)
    );
    assert!(new(None, Some(MAX_CAPACITY), None).is_ok());
    assert!(new(None, None, Some(Rate::ZERO)).is_ok());
    // Scaled limits are checked against the base.
    let big = new(Some(2.0), None, None).unwrap();
    assert_eq!(
        Schedule::new(Limit::new(MAX_CAPACITY, per_s(1)), vec![big]).unwrap_err(),
        ScheduleError::ScaledCapacityTooLarge {
            entry: 0,
            millionths: 2_000_000,
            capacity: 2 * MAX_CAPACITY
        }
    );
    let odd = new(Some(0.999_999), None, None).unwrap();
    assert_eq!(
        Schedule::new(Limit::new(10, Rate::per(1, 999_999_937).unwrap()), vec![odd]).unwrap_err(),
        ScheduleError::InexactScaledRate {
            entry: 0,
            millionths: 999_999
        }
    );
}

// ---- The property test against a naive, minute-by-minute reference. ----

const ZONES: [&str; 6] = [
    "UTC",
    "America/New_York",
    "Europe/Berlin",
    "Australia/Lord_Howe", // half-hour DST
    "Asia/Kathmandu",      // +05:45
    "America/St_Johns",    // -03:30 / -02:30
];

/// One cron field: `*`, a value, a range, a step, a stepped range, a list, with names where
/// the field allows them.
fn field(lo: u32, hi: u32, names: &'static [&'static str], star: u32) -> impl Strategy<Value = String> {
    let value = move |v: u32| -> String {
        let i = (v - lo) as usize;
        if !names.is_empty() && i < names.len() && v.is_multiple_of(2) {
            names[i].to_string()
        } else {
            v.to_string()
        }
    };
    let span = hi - lo + 1;
    prop_oneof![
        star => Just("*".to_string()),
        2 => (lo..=hi).prop_map(value),
        3 => (lo..=hi, 0..span).prop_map(move |(a, w)| format!("{}-{}", value(a), value((a + w).min(hi)))),
        1 => (1..=span / 2 + 1).prop_map(|s| format!("*/{s}")),
        1 => (lo..=hi, 0..span, 1..=span / 2 + 1)
            .prop_map(move |(a, w, s)| format!("{}-{}/{s}", a, (a + w).min(hi))),
        2 => (lo..=hi, lo..=hi).prop_map(move |(a, b)| format!("{},{}", value(a), value(b))),
    ]
}

fn pattern() -> impl Strategy<Value = String> {
    (
        field(0, 59, &[], 3),
        field(0, 23, &[], 3),
        field(1, 31, &[], 12),
        field(
            1,
            12,
            &[
                "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
            ],
            12,
        ),
        field(0, 7, &["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT", "SUN"], 6),
    )
        .prop_map(|(mi, h, dom, mo, dow)| format!("{mi} {h} {dom} {mo} {dow}"))
}

fn entries() -> impl Strategy<Value = Vec<(String, usize, u64)>> {
    prop::collection::vec(
        (pattern(), 0..ZONES.len(), 1..50u64).prop_filter("ever active", |(p, z, _)| ever_active(p, *z)),
        1..4,
    )
}

/// Instants from 2024 to 2028, half of them within a day of a DST change in New York,
/// Berlin or Lord Howe.
fn instant() -> impl Strategy<Value = u64> {
    let changes = [
        utc(2026, 3, 8, 7, 0),
        utc(2026, 11, 1, 6, 0),
        utc(2026, 3, 29, 1, 0),
        utc(2026, 10, 25, 1, 0),
        utc(2026, 4, 4, 15, 0),
        utc(2026, 10, 3, 15, 30),
    ];
    prop_oneof![
        (utc(2024, 1, 1, 0, 0)..utc(2028, 1, 1, 0, 0)),
        (0..changes.len(), 0..2 * 86_400 * MICRO).prop_map(move |(i, d)| changes[i] - 86_400 * MICRO + d),
    ]
}

/// The reference: croner's own matcher on the local wall-clock time, one entry at a time.
fn reference_active(cron: &croner::Cron, zone: &str, t_us: u64) -> bool {
    let tz: Tz = zone.parse().unwrap();
    let utc_time = DateTime::from_timestamp((t_us / MICRO) as i64, 0).unwrap().naive_utc();
    let local = tz.from_utc_datetime(&utc_time).naive_local();
    let local = local.date().and_hms_opt(local.hour(), local.minute(), 0).unwrap();
    cron.is_time_matching(&local).unwrap()
}

/// Whether a generated pattern matches some day in the zone: one that matches none is rejected
/// (the window would never be active), so the generated schedules leave it out.
fn ever_active(pattern: &str, zone: usize) -> bool {
    !matches!(
        ScheduleEntry::new(pattern, Some(ZONES[zone]), Some(1.0), None, None),
        Err(ScheduleError::NeverActive(_))
    )
}

fn build(spec: &[(String, usize, u64)]) -> (Schedule, Vec<croner::Cron>) {
    let parser = CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build();
    let entries = spec
        .iter()
        .map(|(p, z, c)| ScheduleEntry::new(p, Some(ZONES[*z]), None, Some(*c), None).unwrap())
        .collect();
    let crons = spec.iter().map(|(p, _, _)| parser.parse(p).unwrap()).collect();
    (Schedule::new(Limit::new(1000, per_s(1)), entries).unwrap(), crons)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// `limit_at` is the first entry whose pattern croner matches on the local minute, else the
    /// base; `next_boundary` is the first UTC minute at which any entry's match changes (every
    /// zone here has whole-minute offsets and changes, so boundaries fall on UTC minutes).
    #[test]
    fn matches_a_minute_by_minute_reference(spec in entries(), t in instant(), horizon_min in 1..3000u64) {
        let (s, crons) = build(&spec);
        let active = |t: u64| -> Vec<bool> {
            crons.iter().zip(&spec).map(|(c, (_, z, _))| reference_active(c, ZONES[*z], t)).collect()
        };
        let now = active(t);
        let want_limit = now.iter().position(|a| *a).map_or(*s.base(), |i| Limit::new(spec[i].2, per_s(1)));
        prop_assert_eq!(s.limit_at(t), want_limit);
        let horizon = horizon_min * MIN;
        let mut want_boundary = None;
        let mut m = t - t % MIN + MIN;
        while m <= t + horizon {
            if active(m) != now {
                want_boundary = Some(m);
                break;
            }
            m += MIN;
        }
        prop_assert_eq!(s.next_boundary(t, horizon), want_boundary);
    }

    /// The wait is the first instant at which the scheduled refill holds the need.
    #[test]
    fn wait_is_the_first_admitting_instant(
        spec in entries(),
        t in instant(),
        tokens in 0..1000u64,
        need in 1..1000u64,
        ago in 0..(2 * HOUR),
    ) {
        let (s, _) = build(&spec);
        let state = BucketState { tokens_ut: tokens * 1000, updated_us: t - ago };
        let need_ut = need * 1000;
        if let Some(w) = wait_until_us(state, need_ut, &s, t, 3 * 86_400 * MICRO) {
            prop_assert!(refill_scheduled(state, &s, t + w).tokens_ut >= need_ut);
            if w > 0 {
                prop_assert!(refill_scheduled(state, &s, t + w - 1).tokens_ut < need_ut);
            }
        }
    }
}

/// Patterns that never change, rare days, and horizons up to the end of time stay cheap.
#[test]
fn constant_and_rare_patterns() {
    let t = utc(2026, 6, 1, 12, 0);
    assert_eq!(
        ScheduleEntry::new("* * 30 FEB *", Some("Europe/Berlin"), Some(0.5), None, None).unwrap_err(),
        ScheduleError::NeverActive("* * 30 FEB *".to_string())
    );
    let always = entry("* * * * *", "Europe/Berlin");
    assert!(always.is_active(t));
    assert_eq!(always.next_change(t, u64::MAX), None);
    // The next 29 February after 2026, in Berlin time (UTC+1 in winter).
    let leap = entry("* * 29 2 *", "Europe/Berlin");
    assert_eq!(leap.next_change(t, u64::MAX), Some(utc(2028, 2, 28, 23, 0)));
    assert_eq!(leap.next_change(t, t + DEFAULT_HORIZON_US), None);
    let daily = entry("* 9-17 * * *", "America/New_York");
    assert_eq!(daily.next_change(t, u64::MAX), Some(utc(2026, 6, 1, 13, 0))); // 09:00 EDT
}

/// A minute-by-minute model of a scheduled token bucket, written independently of
/// [`refill_scheduled`] and [`wait_until_us`]: the limit of each UTC minute is read off
/// croner's matcher on the local minute (every zone in [`ZONES`] has whole-minute offsets and
/// changes, so the limit is constant within a UTC minute), and tokens are kept as an anchor
/// (micro-tokens at an instant) that moves only where the implementation writes: at a change of
/// limit (floored there, then trimmed to the new capacity) and at an admitted request.
struct Reference {
    crons: Vec<(croner::Cron, &'static str, Limit)>,
    base: Limit,
    tokens: u64,
    anchor: u64,
    limit: Limit,
}

impl Reference {
    fn limit_of_minute(&self, m: u64) -> Limit {
        self.crons
            .iter()
            .find(|(c, z, _)| reference_active(c, z, m))
            .map_or(self.base, |(_, _, l)| *l)
    }

    /// Tokens at `t` under the current limit, from the anchor: trimmed, then
    /// `floor(elapsed * num / den)` more, never above capacity.
    fn tokens_at(&self, t: u64) -> u64 {
        let cap = self.limit.capacity_ut;
        let held = self.tokens.min(cap);
        let earned =
            u128::from(t - self.anchor) * u128::from(self.limit.rate.num()) / u128::from(self.limit.rate.den());
        (u128::from(held) + earned).min(u128::from(cap)) as u64
    }

    /// Moves the model to `t`, minute mark by minute mark, re-anchoring at each change of limit.
    fn advance(&mut self, t: u64) {
        let mut m = self.anchor - self.anchor % MIN + MIN;
        while m <= t {
            let next = self.limit_of_minute(m);
            if next != self.limit {
                let held = self.tokens_at(m);
                // A full bucket is no bucket: it is full under the next limit too.
                self.tokens = if held >= self.limit.capacity_ut {
                    next.capacity_ut
                } else {
                    held.min(next.capacity_ut)
                };
                self.anchor = m;
                self.limit = next;
            }
            m += MIN;
        }
    }

    /// The first instant from `t` at which `need` micro-tokens are there, searched minute by
    /// minute up to `end` on a copy of the model.
    fn wait(&self, t: u64, need: u64, end: u64) -> Option<u64> {
        let mut model = Reference {
            crons: self.crons.clone(),
            ..*self
        };
        let mut from = t;
        loop {
            let seg_end = from - from % MIN + MIN;
            if need <= model.limit.capacity_ut {
                let held = model.tokens.min(model.limit.capacity_ut);
                let rate = model.limit.rate;
                let at = if held >= need {
                    Some(model.anchor)
                } else if rate.is_zero() {
                    None
                } else {
                    let missing = u128::from(need - held);
                    let earn = (missing * u128::from(rate.den())).div_ceil(u128::from(rate.num()));
                    Some(model.anchor + earn as u64)
                };
                if let Some(at) = at.map(|a| a.max(from)) {
                    if at < seg_end && at <= end {
                        return Some(at);
                    }
                }
            }
            if seg_end > end {
                return None;
            }
            model.advance(seg_end);
            from = seg_end;
        }
    }
}

impl Clone for Reference {
    fn clone(&self) -> Reference {
        Reference {
            crons: self.crons.clone(),
            ..*self
        }
    }
}

/// Patterns that change often (minute ranges, steps and lists in most hours), so that request
/// streams of an hour or two cross many boundaries; a third are the general [`pattern`]s.
fn busy_pattern() -> impl Strategy<Value = String> {
    let busy = (
        field(0, 59, &[], 0),
        prop_oneof![3 => Just("*".to_string()), 1 => field(0, 23, &[], 0)],
        prop_oneof![3 => Just("*".to_string()), 1 => field(0, 7, &["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT", "SUN"], 0)],
    )
        .prop_map(|(mi, h, dow)| format!("{mi} {h} * * {dow}"));
    prop_oneof![2 => busy, 1 => pattern()]
}

/// A schedule entry for the model test: a pattern, a zone, and either a scale (in tenths) or an
/// absolute capacity and refill (tokens per minute).
fn model_entries() -> impl Strategy<Value = Vec<(String, usize, Option<u64>, u64, u64)>> {
    prop::collection::vec(
        (
            busy_pattern(),
            0..ZONES.len(),
            prop::option::of(1..40u64),
            0..30u64,
            1..20u64,
        )
            .prop_filter("ever active", |(p, z, ..)| ever_active(p, *z)),
        1..4,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A scheduled bucket decided request by request ([`refill_scheduled`], admission, write
    /// only when admitted) against the minute-by-minute [`Reference`]: the same admissions, the
    /// same tokens, and for each denial the same wait ([`wait_until_us`]).
    #[test]
    fn scheduled_bucket_matches_a_minute_by_minute_reference(
        spec in model_entries(),
        base_cap in 1..40u64,
        base_per_min in 1..20u64,
        start in instant(),
        requests in prop::collection::vec((0..(5 * MIN), 1..12u64), 1..32),
    ) {
        let parser = CronParser::builder().seconds(Seconds::Disallowed).year(Year::Disallowed).build();
        let base = Limit::new(base_cap, per_min(base_per_min));
        let entries: Vec<ScheduleEntry> = spec
            .iter()
            .map(|(p, z, scale, cap, per_min_)| match scale {
                Some(tenths) => ScheduleEntry::new(p, Some(ZONES[*z]), Some(*tenths as f64 / 10.0), None, None),
                None => ScheduleEntry::new(p, Some(ZONES[*z]), None, Some(*cap), Some(per_min(*per_min_))),
            }
            .unwrap())
            .collect();
        // A scale that leaves less than a token of capacity is rejected at load.
        let s = match Schedule::new(base, entries) {
            Ok(s) => s,
            Err(ScheduleError::ScaledBelowOneToken { .. }) => return Ok(()),
            Err(e) => panic!("{e}"),
        };
        let crons = spec
            .iter()
            .enumerate()
            .map(|(i, (p, z, ..))| (parser.parse(p).unwrap(), ZONES[*z], *s.entry_limit(i).unwrap()))
            .collect();
        let mut model = Reference { crons, base, tokens: 0, anchor: start, limit: base };
        model.limit = model.limit_of_minute(start - start % MIN);
        model.tokens = model.limit.capacity_ut;
        let mut state = BucketState::full(&s.limit_at(start), start);
        let mut t = start;
        for (gap, n) in requests {
            t += gap;
            let need = n * MICRO;
            model.advance(t);
            let want_tokens = model.tokens_at(t);
            let now = refill_scheduled(state, &s, t);
            prop_assert_eq!(now.tokens_ut, want_tokens, "tokens at {}", t);
            if now.tokens_ut >= need {
                state = BucketState { tokens_ut: now.tokens_ut - need, updated_us: now.updated_us };
                model.tokens = want_tokens - need;
                model.anchor = t;
            } else {
                let horizon = 2 * HOUR;
                let got = wait_until_us(state, need, &s, t, horizon).map(|w| t + w);
                prop_assert_eq!(got, model.wait(t, need, t + horizon), "wait at {} for {}", t, need);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The segment cache changes no answer: a schedule asked a stream of questions (mostly
    /// forward in time, some back) answers each as the uncached search does.
    #[test]
    fn the_segment_cache_changes_no_answer(
        spec in entries(),
        start in instant(),
        steps in prop::collection::vec((0..(3 * HOUR), any::<bool>(), 1..(3 * 86_400 * MICRO)), 1..30),
    ) {
        let (s, _) = build(&spec);
        let mut t = start;
        for (step, back, horizon) in steps {
            t = if back { t.saturating_sub(step / 2) } else { t + step };
            prop_assert_eq!(s.limit_at(t), s.search_limit_at(t), "limit at {}", t);
            prop_assert_eq!(s.next_limit_change(t, horizon), s.search_limit_change(t, horizon), "change after {}", t);
        }
    }
}

/// A look ahead walks at most [`MAX_CHANGES_AHEAD`] changes of limit: under a window that
/// toggles every minute, a wait 100 changes away is found, one 400 changes away is not (a
/// decision would otherwise walk every change up to the horizon).
#[test]
fn look_ahead_is_bounded_in_changes() {
    let toggling = ScheduleEntry::new("*/2 * * * *", None, None, None, Some(per_min(2))).unwrap();
    let s = Schedule::new(Limit::new(1000, per_min(1)), vec![toggling]).unwrap();
    let now = utc(2026, 6, 1, 12, 1);
    let empty = BucketState {
        tokens_ut: 0,
        updated_us: now,
    };
    // 3 tokens per 2 minutes: 150 tokens take 100 minutes, 100 changes.
    assert_eq!(
        wait_until_us(empty, 150 * MICRO, &s, now, DEFAULT_HORIZON_US),
        Some(100 * MIN)
    );
    assert_exact_wait(empty, 150 * MICRO, &s, now, 100 * MIN);
    assert_eq!(wait_until_us(empty, 600 * MICRO, &s, now, DEFAULT_HORIZON_US), None);
    assert_eq!(full_at_us(empty, &s, DEFAULT_HORIZON_US), None);
    // Bringing a state forward is never bounded: it is what admission rests on.
    assert_eq!(refill_scheduled(empty, &s, now + 400 * MIN).tokens_ut, 600 * MICRO);
}

/// At the last instants chrono can represent, windows and waits answer without panicking.
#[test]
fn no_panic_at_the_end_of_representable_time() {
    let last_s = chrono::NaiveDateTime::MAX.and_utc().timestamp() as u64;
    let small = ScheduleEntry::new("* 12 * * *", None, None, Some(5), None).unwrap();
    let s = Schedule::new(Limit::new(10, per_s(1)), vec![small]).unwrap();
    for t in [last_s * MICRO - 30 * MICRO, last_s * MICRO, u64::MAX] {
        let st = BucketState {
            tokens_ut: 0,
            updated_us: t,
        };
        assert!([5 * MICRO, 10 * MICRO].contains(&s.limit_at(t).capacity_ut));
        let _ = s.next_limit_change(t, u64::MAX);
        assert!(refill_scheduled(st, &s, t).tokens_ut <= 10 * MICRO);
        let _ = wait_until_us(st, 3 * MICRO, &s, t, DEFAULT_HORIZON_US);
        let _ = full_at_us(st, &s, DEFAULT_HORIZON_US);
    }
}

// ---- Debt buckets under a schedule (docs/usage-budgets.md) ---------------------------------

/// A UTC window whose activity is plain arithmetic on the minute, so the debt model below
/// needs no cron matcher of its own (croner's is compared with the windows' elsewhere).
#[derive(Clone, Copy, Debug)]
enum Span {
    /// Minutes `a..=b` of every hour.
    Minutes(u64, u64),
    /// Hours `a..=b` of every day.
    Hours(u64, u64),
    /// `*/k`: minutes 0, k, 2k, ... of every hour, one minute each.
    Every(u64),
}

impl Span {
    fn cron(self) -> String {
        let range = |a: u64, b: u64| if a == b { a.to_string() } else { format!("{a}-{b}") };
        match self {
            Span::Minutes(a, b) => format!("{} * * * *", range(a, b)),
            Span::Hours(a, b) => format!("* {} * * *", range(a, b)),
            Span::Every(k) => format!("*/{k} * * * *"),
        }
    }

    fn active(self, t_us: u64) -> bool {
        let minute = t_us / MIN % 60;
        let hour = t_us / HOUR % 24;
        match self {
            Span::Minutes(a, b) => (a..=b).contains(&minute),
            Span::Hours(a, b) => (a..=b).contains(&hour),
            Span::Every(k) => minute.is_multiple_of(k),
        }
    }
}

fn span() -> impl Strategy<Value = Span> {
    prop_oneof![
        3 => (0..60u64, 0..30u64).prop_map(|(a, w)| Span::Minutes(a, (a + w).min(59))),
        2 => (0..24u64, 0..4u64).prop_map(|(a, w)| Span::Hours(a, (a + w).min(23))),
        1 => (2..=20u64).prop_map(Span::Every),
    ]
}

/// What a window does: a scale in tenths, or an absolute capacity (tokens) and/or refill
/// (tokens per minute, 0 for none at all).
#[derive(Clone, Copy, Debug)]
enum Change {
    Scale(u64),
    Set(Option<u64>, Option<u64>),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (1..=30u64).prop_map(Change::Scale),
        (0..40u64).prop_map(|c| Change::Set(Some(c), None)),
        (0..30u64).prop_map(|r| Change::Set(None, Some(r))),
        (0..40u64, 0..30u64).prop_map(|(c, r)| Change::Set(Some(c), Some(r))),
    ]
}

/// A limit in the model's terms: the declared capacity in micro-tokens (a balance's ceiling)
/// and a refill of `num` micro-tokens every `den` microseconds, not reduced.
#[derive(Clone, Copy, Debug)]
struct Declared {
    cap: i128,
    num: i128,
    den: i128,
}

impl PartialEq for Declared {
    fn eq(&self, o: &Declared) -> bool {
        self.cap == o.cap && self.num * o.den == o.num * self.den
    }
}

/// The periods the base refill is given over.
const BASE_PERIODS: [u64; 4] = [MICRO, 10 * MICRO, MIN, 10 * MIN];

/// A debt schedule as the core builds it and as the model reads it: the plan, the base limit
/// and each window's.
type DebtSchedule = (Plan, Declared, Vec<(Span, Declared)>);

/// The base limit of a generated debt schedule (`cap` tokens, `per` tokens per
/// `BASE_PERIODS[period]`) and its windows, as the core builds them (`Schedule::new`, then
/// `with_debt_depth` as the rules compiler does for `debt: true`) and as the model reads them.
/// `None` when `Schedule::new` refuses the windows (a scale that leaves less than a token, or
/// a scaled rate it cannot keep exact), as a rules file would be refused.
fn debt_schedule(cap: u64, per: u64, period: usize, windows: &[(Span, Change)], depth_ut: u64) -> Option<DebtSchedule> {
    let period_us = BASE_PERIODS[period];
    let base = Limit::new(cap, Rate::per(per, period_us).unwrap());
    let entries = windows
        .iter()
        .map(|(span, change)| match *change {
            Change::Scale(tenths) => ScheduleEntry::new(&span.cron(), None, Some(tenths as f64 / 10.0), None, None),
            Change::Set(c, r) => ScheduleEntry::new(&span.cron(), None, None, c, r.map(per_min)),
        })
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let schedule = match Schedule::new(base, entries) {
        Ok(s) => s.with_debt_depth(depth_ut),
        Err(ScheduleError::ScaledBelowOneToken { .. } | ScheduleError::InexactScaledRate { .. }) => return None,
        Err(e) => panic!("{e}"),
    };
    // The model's limits, worked out from the declaration alone.
    let declared_base = Declared {
        cap: i128::from(cap * MICRO),
        num: i128::from(per * MICRO),
        den: i128::from(period_us),
    };
    let model_windows = windows
        .iter()
        .map(|(span, change)| {
            let limit = match *change {
                Change::Scale(tenths) => Declared {
                    cap: declared_base.cap * i128::from(tenths) / 10,
                    num: declared_base.num * i128::from(tenths),
                    den: declared_base.den * 10,
                },
                Change::Set(c, r) => Declared {
                    cap: c.map_or(declared_base.cap, |c| i128::from(c * MICRO)),
                    num: r.map_or(declared_base.num, |r| i128::from(r * MICRO)),
                    den: r.map_or(declared_base.den, |_| i128::from(MIN)),
                },
            };
            (*span, limit)
        })
        .collect();
    Some((Plan::Scheduled(Arc::new(schedule)), declared_base, model_windows))
}

/// The signed model of a debt bucket under a schedule, written from docs/usage-budgets.md and
/// docs/schedules-and-quotas.md alone: a balance in micro-tokens that reports take down to
/// `-depth` (what does not fit is lost), refilled at the rate in force and never above the
/// capacity in force; at a change of limit a balance above the new capacity is trimmed to it,
/// and a full one (at the old capacity) is full at the new. Refill is lazy and floors to the
/// micro-token where tollgate documents it does (mod.rs: once per change of limit crossed,
/// and at each write), so the model keeps an anchor (a balance at an instant) that moves
/// exactly there and nowhere else, and the core must agree with it to the micro-token.
#[derive(Clone, Debug)]
struct DebtModel {
    windows: Vec<(Span, Declared)>,
    base: Declared,
    depth: i128,
    /// The balance at `anchor` under `limit`.
    balance: i128,
    anchor: u64,
    limit: Declared,
    /// Changes of limit are applied up to here.
    seen: u64,
}

impl DebtModel {
    fn new(windows: Vec<(Span, Declared)>, base: Declared, depth: i128, start: u64) -> DebtModel {
        let mut m = DebtModel {
            windows,
            base,
            depth,
            balance: 0,
            anchor: start,
            limit: base,
            seen: start,
        };
        m.limit = m.limit_of(start);
        // A new bucket is full.
        m.balance = m.limit.cap;
        m
    }

    fn limit_of(&self, t: u64) -> Declared {
        self.windows
            .iter()
            .find(|(s, _)| s.active(t))
            .map_or(self.base, |(_, l)| *l)
    }

    /// The balance at `t`, in the stretch of `limit`: trimmed, then the refill since the anchor
    /// (floored), never above the capacity.
    fn balance_at(&self, t: u64) -> i128 {
        let l = self.limit;
        let earned = if l.num == 0 {
            0
        } else {
            i128::from(t - self.anchor) * l.num / l.den
        };
        (self.balance.min(l.cap) + earned).min(l.cap)
    }

    /// Applies the changes of limit up to `t` (all at minute marks).
    fn advance(&mut self, t: u64) {
        let mut m = self.seen - self.seen % MIN + MIN;
        while m <= t {
            let next = self.limit_of(m);
            if next != self.limit {
                let held = self.balance_at(m);
                self.balance = if held >= self.limit.cap {
                    next.cap
                } else {
                    held.min(next.cap)
                };
                self.anchor = m;
                self.limit = next;
            }
            m += MIN;
        }
        self.seen = self.seen.max(t);
    }

    /// A write at `t` (after `advance(t)`): the balance becomes `balance`.
    fn write(&mut self, t: u64, balance: i128) {
        self.balance = balance;
        self.anchor = t;
    }

    /// The first instant from `t` (at most `end`) at which the balance is positive, and the
    /// changes of limit crossed to get there, walking a copy minute by minute.
    fn positive_from(&self, t: u64, end: u64) -> Option<(u64, usize)> {
        let mut m = self.clone();
        m.advance(t);
        let mut from = t;
        let mut changes = 0;
        loop {
            let seg_end = from - from % MIN + MIN;
            let l = m.limit;
            let held = m.balance.min(l.cap);
            let at = if l.cap < 1 {
                None
            } else if held >= 1 {
                Some(from)
            } else if l.num == 0 {
                None
            } else {
                // held + floor(e * num / den) >= 1  <=>  e >= ceil((1 - held) * den / num).
                let e = ((1 - held) * l.den + l.num - 1) / l.num;
                Some((m.anchor + u64::try_from(e).unwrap()).max(from))
            };
            if let Some(at) = at.filter(|at| *at < seg_end && *at <= end) {
                return Some((at, changes));
            }
            if seg_end > end {
                return None;
            }
            m.advance(seg_end);
            changes += usize::from(m.limit != l);
            from = seg_end;
        }
    }
}

/// When the next demand comes: after a gap, or at a minute mark (where windows change) less
/// one microsecond, at it, or just after.
#[derive(Clone, Copy, Debug)]
enum When {
    After(u64),
    NextMinute(u64),
}

impl When {
    fn from(self, t: u64) -> u64 {
        match self {
            When::After(gap) => t + gap,
            When::NextMinute(k) => (t - t % MIN + MIN + k).max(t + 1) - 1,
        }
    }
}

fn when() -> impl Strategy<Value = When> {
    prop_oneof![
        4 => (0..(12 * MIN)).prop_map(When::After),
        1 => (0..(3 * HOUR)).prop_map(When::After),
        2 => (0..3u64).prop_map(When::NextMinute),
    ]
}

/// The request-path check on a debt bucket `depth_ut` deep.
fn debt_check(depth_ut: u64) -> [Demand; 1] {
    one(DemandKind::DebtCheck { depth_ut })
}

/// Retry-after is exact for the bucket stored as `state` under `plan` at `now`: asked again
/// `wait` later, `demand` passes, and one microsecond earlier (if that is not before `now`) it
/// does not.
fn assert_retry_admits(
    plan: &Plan,
    state: BucketState,
    demand: &[Demand],
    now: u64,
    wait: u64,
) -> Result<(), TestCaseError> {
    let plans = std::slice::from_ref(plan);
    let at = now + wait;
    prop_assert!(
        !decide(at, &[state], plans, demand).denied,
        "denied at the retry-after {}",
        at
    );
    if wait > 0 {
        prop_assert!(
            decide(at - 1, &[state], plans, demand).denied,
            "admitted before the retry-after {}",
            at
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A debt bucket under a schedule (capacities raised by the floor's depth, as `debt: true`
    /// compiles), asked checks, usage reports and refunds at random instants across changes of
    /// limit, against the signed [`DebtModel`]: the same balance to the micro-token before each
    /// decision, admission iff that balance is positive, reports debited down to the floor with
    /// the rest lost, refunds up to the capacity in force, writes exactly when the balance
    /// moves; and while the balance is not positive, the retry-after is the model's first
    /// positive instant, at which the check passes and a microsecond before which it does not.
    #[test]
    fn a_scheduled_debt_bucket_matches_the_signed_model(
        windows in prop::collection::vec((span(), change()), 1..4),
        cap in 1..40u64,
        per in 1..30u64,
        period in 0..BASE_PERIODS.len(),
        depth in 1..60u64,
        start in utc(2026, 1, 1, 0, 0)..utc(2027, 1, 1, 0, 0),
        steps in prop::collection::vec((when(), ask()), 1..40),
    ) {
        let depth_ut = depth * MICRO;
        let Some((plan, base, model_windows)) = debt_schedule(cap, per, period, &windows, depth_ut) else {
            return Ok(());
        };
        let plans = std::slice::from_ref(&plan);
        let mut model = DebtModel::new(model_windows, base, i128::from(depth_ut), start);
        let mut state = BucketState::full(&plan.limit_at(start), start);
        let mut t = start;
        for (when, ask) in steps {
            t = when.from(t);
            model.advance(t);
            let balance = model.balance_at(t);
            let d = decide(t, &[state], plans, &one(ask.demand(depth_ut)));
            let o = d.instances[0];
            let after = debt_decision_matches(&d, ask, balance, model.depth, model.limit.cap, t)?;
            if o.changed {
                model.write(t, after);
            }
            state = o.kept();
            if after < 1 {
                let need = depth_ut + 1;
                let got = plan.wait_us(state, need, t);
                let want = model.positive_from(t, t + 3 * 86_400 * MICRO);
                match (got, want) {
                    (Some(w), Some((at, _))) => {
                        prop_assert_eq!(t + w, at, "retry-after at {}", t);
                        assert_retry_admits(&plan, state, &debt_check(depth_ut), t, w)?;
                    }
                    // A look ahead walks at most MAX_CHANGES_AHEAD changes of limit.
                    (None, Some((_, changes))) => prop_assert!(changes > MAX_CHANGES_AHEAD, "no retry-after at {}", t),
                    // Nothing admits within the model's three days; the core looks further.
                    (got, None) => prop_assert!(got.is_none_or(|w| w > 3 * 86_400 * MICRO), "retry-after {:?} at {}", got, t),
                }
            }
        }
    }
}

/// A plan for the retry-after property: constant, scheduled (windows as in the debt model),
/// or a quota resetting at one of [`QUOTA_RESETS`].
#[derive(Clone, Debug)]
enum PlanKind {
    Fixed,
    Scheduled(Vec<(Span, Change)>),
    Quota(&'static str),
}

const QUOTA_RESETS: [&str; 5] = ["*/5 * * * *", "0 * * * *", "30 */6 * * *", "0 0 * * *", "0 0 1 * *"];

fn plan_kind() -> impl Strategy<Value = PlanKind> {
    prop_oneof![
        1 => Just(PlanKind::Fixed),
        2 => prop::collection::vec((span(), change()), 1..4).prop_map(PlanKind::Scheduled),
        1 => prop::sample::select(&QUOTA_RESETS[..]).prop_map(PlanKind::Quota),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A client that retries at Retry-After passes: for a bucket in any state (a debt
    /// bucket's often in debt, at a balance of exactly 0, or one micro-token above it; an
    /// ordinary one's often empty), under a constant limit, a schedule whose windows change it,
    /// or a quota, with or without debt, and a state written before `now` or (a clock that
    /// stepped back) after it: the demand asked again at `now + Plan::wait_us` passes, and one
    /// microsecond earlier it does not. Checks and usage reports on a debt bucket (which pass
    /// iff the balance is positive), checks and consumes on an ordinary one.
    #[test]
    fn a_client_that_retries_at_retry_after_passes(
        kind in plan_kind(),
        debt in any::<bool>(),
        cap in 1..40u64,
        per in 1..30u64,
        period in 0..BASE_PERIODS.len(),
        depth in 1..60u64,
        held in (0..3u64, any::<u64>()),
        now in utc(2026, 1, 1, 0, 0)..utc(2027, 1, 1, 0, 0),
        ago in -(HOUR as i64)..(6 * HOUR as i64),
        (report, n) in (any::<bool>(), 1..50u64),
    ) {
        // A debt quota's floor is at most one allowance deep.
        let depth_ut = match (&kind, debt) {
            (_, false) => 0,
            (PlanKind::Quota(_), true) => depth.min(cap) * MICRO,
            (_, true) => depth * MICRO,
        };
        let plan = match &kind {
            PlanKind::Fixed => {
                let mut limit = Limit::new(cap, Rate::per(per, BASE_PERIODS[period]).unwrap());
                limit.capacity_ut += depth_ut;
                Plan::Fixed(limit)
            }
            PlanKind::Scheduled(windows) => match debt_schedule(cap, per, period, windows, depth_ut) {
                Some((plan, ..)) => plan,
                None => return Ok(()),
            },
            PlanKind::Quota(reset) => Plan::Quota(Arc::new(Quota::new(cap, reset, None).unwrap().with_debt_depth(depth_ut))),
        };
        let updated_us = now.checked_add_signed(-ago).unwrap();
        let capacity = plan.limit_at(updated_us).capacity_ut;
        let tokens_ut = match held.0 {
            0 if debt => depth_ut,
            0 => 0,
            1 if debt => depth_ut + 1,
            _ => held.1 % (capacity + 1),
        }
        .min(capacity);
        let state = BucketState { tokens_ut, updated_us };
        let kind = match (debt, report) {
            (true, false) => DemandKind::DebtCheck { depth_ut },
            (true, true) => DemandKind::Debit { amount_ut: n * MICRO, depth_ut },
            (false, false) => DemandKind::Check,
            (false, true) => DemandKind::Consume(n * MICRO),
        };
        let consumed = if let DemandKind::Consume(ut) = kind { ut } else { 0 };
        let need = kind.need_ut(consumed).unwrap();
        let demand = one(kind);
        match plan.wait_us(state, need, now) {
            Some(w) => assert_retry_admits(&plan, state, &demand, now, w)?,
            None => {
                prop_assert!(decide(now, &[state], std::slice::from_ref(&plan), &demand).denied);
                // Only more than any capacity, or (walking windows) nothing within the horizon.
                if !matches!(plan, Plan::Scheduled(_)) {
                    prop_assert!(need > plan.limit_at(now).capacity_ut, "no retry-after for {:?}", kind);
                }
            }
        }
    }
}
