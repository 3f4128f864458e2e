//! Schedules and quotas through the decision path (docs/schedules-and-quotas.md, docs/rules.md): rules from YAML, the memory
//! store on a manual clock moved across real window edges, DST days and month ends.

use crate::harness;

use chrono::NaiveDate;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::Duration;
use harness::{desc, harness_at, header, hits, limit_of, one, options, req, Harness, OK, OVER};

const S: u64 = 1_000_000;

/// A UTC instant in microseconds.
fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> u64 {
    let t = NaiveDate::from_ymd_opt(y, mo, d)
        .unwrap()
        .and_hms_opt(h, mi, 0)
        .unwrap();
    t.and_utc().timestamp() as u64 * S
}

fn harness(yaml: &str, now_us: u64) -> Harness {
    harness_at(yaml, options(), now_us)
}

/// Asks `n` single hits of `key=value` and returns how many were admitted.
async fn admitted(h: &Harness, key: &str, value: &str, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        if h.ask(&one(&[(key, value)])).await.overall_code == OK {
            ok += 1;
        }
    }
    ok
}

/// `requests_per_unit` reported for `key` at `t_us`, by a non-consuming check.
async fn reported_at(h: &Harness, key: &str, t_us: u64) -> u32 {
    h.clock.set_us(t_us);
    let resp = h.ask(&req("d", vec![hits(&[(key, "probe")], 0)])).await;
    limit_of(&resp.statuses[0]).expect("a limited descriptor").1
}

fn retry_after(resp: &RateLimitResponse) -> Option<u64> {
    header(resp, "retry-after").map(|v| v.parse().unwrap())
}

fn until_reset(resp: &RateLimitResponse) -> Option<Duration> {
    resp.statuses[0].duration_until_reset
}

fn secs(s: u64) -> Option<Duration> {
    Some(Duration {
        seconds: s as i64,
        nanos: 0,
    })
}

const BUSINESS_HOURS: &str = r#"
domain: d
buckets:
  weekdays:
    capacity: 1000
    refill: 1000/s
    schedule:
      - cron: "* 9-17 * * MON-FRI"
        timezone: America/New_York
        capacity: 10
        refill: 10/s
  daily:
    capacity: 1000
    refill: 1000/s
    schedule:
      - cron: "* 9-17 * * *"
        timezone: America/New_York
        capacity: 10
        refill: 10/s
descriptors:
  - key: weekdays
    bucket: weekdays
  - key: daily
    bucket: daily
"#;

/// The window is in force from `open` to just before `close` (UTC instants), not outside.
async fn assert_window(h: &Harness, key: &str, open: u64, close: u64) {
    assert_eq!(
        reported_at(h, key, open - 1).await,
        1000,
        "{key}: closed just before {open}"
    );
    assert_eq!(reported_at(h, key, open).await, 10, "{key}: open at {open}");
    assert_eq!(
        reported_at(h, key, close - 1).await,
        10,
        "{key}: open just before {close}"
    );
    assert_eq!(reported_at(h, key, close).await, 1000, "{key}: closed at {close}");
}

/// `* 9-17 * * MON-FRI` in New York across the DST changes of 2026: 09:00 to 18:00 local on
/// the Friday before (EST, UTC-5 in March; EDT, UTC-4 in October) and the Monday after, closed
/// on the Sunday of the change; an every-day window opens at 09:00 and closes at 18:00 local on
/// the day of the change itself.
#[tokio::test]
async fn business_hours_stay_local_across_dst() {
    let h = harness(BUSINESS_HOURS, utc(2026, 3, 1, 0, 0));
    // Spring forward, Sunday 8 March 2026 at 02:00 EST.
    assert_window(&h, "weekdays", utc(2026, 3, 6, 14, 0), utc(2026, 3, 6, 23, 0)).await;
    for hour in [0, 7, 13, 14, 18, 22, 23] {
        assert_eq!(
            reported_at(&h, "weekdays", utc(2026, 3, 8, hour, 0)).await,
            1000,
            "Sunday"
        );
    }
    assert_window(&h, "weekdays", utc(2026, 3, 9, 13, 0), utc(2026, 3, 9, 22, 0)).await;
    assert_window(&h, "daily", utc(2026, 3, 8, 13, 0), utc(2026, 3, 8, 22, 0)).await;
    // Fall back, Sunday 1 November 2026 at 02:00 EDT.
    assert_window(&h, "weekdays", utc(2026, 10, 30, 13, 0), utc(2026, 10, 30, 22, 0)).await;
    for hour in [0, 6, 13, 14, 18, 22, 23] {
        assert_eq!(
            reported_at(&h, "weekdays", utc(2026, 11, 1, hour, 0)).await,
            1000,
            "Sunday"
        );
    }
    assert_window(&h, "weekdays", utc(2026, 11, 2, 14, 0), utc(2026, 11, 2, 23, 0)).await;
    assert_window(&h, "daily", utc(2026, 11, 1, 14, 0), utc(2026, 11, 1, 23, 0)).await;
}

const HALF_AT_NOON: &str = r#"
domain: d
buckets:
  half:
    capacity: 10
    refill: 10/m
    schedule:
      - cron: "* 12 * * *"
        scale: 0.5
descriptors:
  - key: k
    bucket: half
"#;

/// `scale: 0.5` halves capacity and refill while the window is open and restores both after.
#[tokio::test]
async fn scale_halves_capacity_and_refill_then_restores_them() {
    let h = harness(HALF_AT_NOON, utc(2026, 6, 1, 11, 0));
    assert_eq!(admitted(&h, "k", "before", 11).await, 10);
    let resp = h.ask(&one(&[("k", "before")])).await;
    assert_eq!(header(&resp, "ratelimit-policy"), Some(r#""half";q=10;w=60"#));
    assert_eq!(retry_after(&resp), Some(6), "10 per minute: one token every 6 s");

    h.clock.set_us(utc(2026, 6, 1, 12, 0));
    assert_eq!(admitted(&h, "k", "during", 6).await, 5);
    let resp = h.ask(&one(&[("k", "during")])).await;
    assert_eq!(header(&resp, "ratelimit-policy"), Some(r#""half";q=5;w=60"#));
    assert_eq!(retry_after(&resp), Some(12), "5 per minute: one token every 12 s");
    assert_eq!(limit_of(&resp.statuses[0]), Some(("half", 5, Unit::Minute)));
    h.advance_ms(12_000 - 1);
    assert_eq!(admitted(&h, "k", "during", 1).await, 0);
    h.advance_ms(1);
    assert_eq!(admitted(&h, "k", "during", 2).await, 1);

    // Emptied 30 s before the window closes, a bucket holds 2.5 tokens at 13:00: raising the
    // capacity grants nothing at once, and the refill is back to 10 per minute (the half token
    // left needs 3 s).
    h.clock.set_us(utc(2026, 6, 1, 12, 59) + 30 * S);
    assert_eq!(admitted(&h, "k", "late", 6).await, 5);
    h.clock.set_us(utc(2026, 6, 1, 13, 0));
    assert_eq!(admitted(&h, "k", "late", 3).await, 2);
    let resp = h.ask(&one(&[("k", "late")])).await;
    assert_eq!(retry_after(&resp), Some(3));
    assert_eq!(limit_of(&resp.statuses[0]), Some(("half", 10, Unit::Minute)));
    // A bucket that was full when the window closed (the one emptied at noon, full again at 5
    // by 12:01:12) is the same as a new one: full at 10, like a key never seen.
    assert_eq!(admitted(&h, "k", "during", 11).await, 10);
    assert_eq!(admitted(&h, "k", "after", 11).await, 10);
}

/// The first active entry wins: reversing the order of two overlapping entries changes the
/// limit while both are active, and not while only one is.
#[tokio::test]
async fn first_active_entry_wins() {
    let yaml = r#"
domain: d
buckets:
  always_first:
    capacity: 100
    refill: 100/s
    schedule:
      - {cron: "* * * * *", capacity: 5}
      - {cron: "* 12 * * *", capacity: 20}
  noon_first:
    capacity: 100
    refill: 100/s
    schedule:
      - {cron: "* 12 * * *", capacity: 20}
      - {cron: "* * * * *", capacity: 5}
descriptors:
  - {key: a, bucket: always_first}
  - {key: b, bucket: noon_first}
"#;
    let h = harness(yaml, utc(2026, 6, 1, 12, 30));
    assert_eq!(admitted(&h, "a", "x", 30).await, 5);
    assert_eq!(admitted(&h, "b", "x", 30).await, 20);
    h.clock.set_us(utc(2026, 6, 1, 11, 30));
    assert_eq!(admitted(&h, "a", "y", 30).await, 5);
    assert_eq!(admitted(&h, "b", "y", 30).await, 5);
}

const MONTHLY: &str = r#"
domain: d
buckets:
  monthly:
    quota: {limit: 3, reset: "0 0 1 * *", timezone: Europe/Berlin}
descriptors:
  - key: k
    bucket: monthly
"#;

/// A monthly quota exhausted on the 30th waits for local midnight on the 1st (23:00 UTC in
/// Berlin winter time), says so in `Retry-After` and `duration_until_reset`, and admits from
/// the first decision at the edge on.
#[tokio::test]
async fn monthly_quota_resets_at_local_midnight_on_the_first() {
    let now = utc(2026, 11, 30, 10, 0);
    let edge = utc(2026, 11, 30, 23, 0);
    let h = harness(MONTHLY, now);
    assert_eq!(admitted(&h, "k", "x", 3).await, 3);
    let resp = h.ask(&one(&[("k", "x")])).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(retry_after(&resp), Some((edge - now) / S));
    assert_eq!(until_reset(&resp), secs((edge - now) / S));
    assert_eq!(limit_of(&resp.statuses[0]), Some(("monthly", 3, Unit::Month)));
    assert_eq!(resp.statuses[0].limit_remaining, 0);

    h.clock.set_us(edge - 1);
    let resp = h.ask(&one(&[("k", "x")])).await;
    assert_eq!(resp.overall_code, OVER, "a quota never resets before its edge");
    assert_eq!(retry_after(&resp), Some(1), "1 µs, rounded up to a second");

    h.clock.set_us(edge);
    assert_eq!(admitted(&h, "k", "x", 4).await, 3, "the whole allowance, once");
    let resp = h.ask(&one(&[("k", "x")])).await;
    // The next edge: 1 January 2027, 00:00 CET.
    assert_eq!(retry_after(&resp), Some((utc(2026, 12, 31, 23, 0) - edge) / S));
}

/// An idle quota bucket across three missed edges resets once, to its limit, not three times.
#[tokio::test]
async fn missed_edges_reset_once() {
    let h = harness(MONTHLY, utc(2026, 8, 15, 12, 0));
    assert_eq!(admitted(&h, "k", "idle", 3).await, 3);
    h.clock.set_us(utc(2026, 11, 15, 12, 0));
    assert_eq!(admitted(&h, "k", "idle", 10).await, 3);
}

/// A token bucket and a quota on one rule: a request must pass both, and a request one denies
/// takes nothing from the other.
#[tokio::test]
async fn token_bucket_and_quota_together_are_all_or_nothing() {
    let yaml = r#"
domain: d
buckets:
  metered:
    capacity: 5
    refill: 1/s
    quota: {limit: 8, reset: "0 0 * * *"}
descriptors:
  - key: k
    bucket: metered
"#;
    let h = harness(yaml, utc(2026, 6, 1, 12, 0));
    assert_eq!(admitted(&h, "k", "x", 5).await, 5);
    let resp = h.ask(&one(&[("k", "x")])).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(resp.statuses[0].current_limit.as_ref().unwrap().name, "metered");
    assert_eq!(retry_after(&resp), Some(1));
    assert_eq!(
        header(&resp, "ratelimit"),
        Some(r#""metered";r=0;t=5, "metered.quota";r=3;t=43200"#)
    );

    h.advance_ms(10_000);
    assert_eq!(admitted(&h, "k", "x", 5).await, 3, "the quota's 3 left");
    let resp = h.ask(&one(&[("k", "x")])).await;
    assert_eq!(resp.overall_code, OVER);
    let status = &resp.statuses[0];
    assert_eq!(limit_of(status), Some(("metered.quota", 8, Unit::Day)));
    assert_eq!(status.limit_remaining, 0);
    assert_eq!(retry_after(&resp), Some(12 * 3600 - 10), "to midnight UTC");
    // Denied by the quota, the token bucket kept its 2 tokens.
    assert_eq!(
        header(&resp, "ratelimit"),
        Some(r#""metered";r=2;t=3, "metered.quota";r=0;t=43190"#)
    );
}

/// A bucket holding 100 tokens whose capacity drops to 10 admits at most 10 before refilling:
/// when a window lowers the capacity, and when a rules reload does.
#[tokio::test]
async fn lower_capacity_clamps_held_tokens() {
    let scheduled = r#"
domain: d
buckets:
  big:
    capacity: 1000
    refill: 1/h
    schedule:
      - {cron: "* 12 * * *", capacity: 10}
descriptors:
  - {key: k, bucket: big}
"#;
    let h = harness(scheduled, utc(2026, 6, 1, 11, 0));
    assert_eq!(h.ask(&req("d", vec![hits(&[("k", "x")], 900)])).await.overall_code, OK);
    h.clock.set_us(utc(2026, 6, 1, 11, 59));
    let resp = h.ask(&req("d", vec![hits(&[("k", "x")], 0)])).await;
    assert_eq!(resp.statuses[0].limit_remaining, 100);
    h.clock.set_us(utc(2026, 6, 1, 12, 0));
    assert_eq!(admitted(&h, "k", "x", 100).await, 10);

    let fixed = |capacity: u64| {
        format!("domain: d\nbuckets:\n  big: {{capacity: {capacity}, refill: 1/h}}\ndescriptors:\n  - {{key: k, bucket: big}}\n")
    };
    let h = harness(&fixed(1000), utc(2026, 6, 1, 11, 0));
    assert_eq!(h.ask(&req("d", vec![hits(&[("k", "x")], 900)])).await.overall_code, OK);
    h.limiter.swap_rules(harness::rules(&fixed(10)));
    assert_eq!(admitted(&h, "k", "x", 100).await, 10);
    // Raising it again grants nothing at once: the bucket refills from where it is.
    h.limiter.swap_rules(harness::rules(&fixed(1000)));
    assert_eq!(admitted(&h, "k", "x", 10).await, 0);
}

/// Denied 5 minutes before a window that doubles the refill rate, the wait counts the faster
/// refill after the edge: 5 tokens by 12:00 at 1 per minute, the other 5 at 2 per minute in
/// 150 s, so 450 s, where the flat estimate would be 600 s. Exact to the microsecond.
#[tokio::test]
async fn retry_after_walks_across_a_rate_change() {
    let yaml = r#"
domain: d
buckets:
  doubling:
    capacity: 10
    refill: 1/m
    schedule:
      - {cron: "* 12-13 * * *", refill: 2/m}
descriptors:
  - {key: k, bucket: doubling}
"#;
    let now = utc(2026, 6, 1, 11, 55);
    let h = harness(yaml, now);
    assert_eq!(h.ask(&req("d", vec![hits(&[("k", "x")], 10)])).await.overall_code, OK);
    let ten = req("d", vec![hits(&[("k", "x")], 10)]);
    let resp = h.ask(&ten).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(retry_after(&resp), Some(450));
    assert_eq!(until_reset(&resp), secs(450));
    assert_eq!(header(&resp, "ratelimit"), Some(r#""doubling";r=0;t=450"#));
    h.clock.set_us(now + 450 * S - 1);
    assert_eq!(h.ask(&ten).await.overall_code, OVER);
    h.clock.set_us(now + 450 * S);
    assert_eq!(h.ask(&ten).await.overall_code, OK);
}

/// A maintenance window (capacity 0) denies until it closes, and the wait runs to its end: a
/// bucket trimmed to nothing is full under a capacity of 0, so it comes out of the window full,
/// like a new one. A window that never closes within the horizon gives no `Retry-After` at all.
#[tokio::test]
async fn maintenance_window_and_no_retry_after_beyond_the_horizon() {
    let yaml = r#"
domain: d
buckets:
  maintained:
    capacity: 10
    refill: 10/m
    schedule:
      - {cron: "* 2 * * *", capacity: 0}
  closed:
    capacity: 10
    refill: 10/m
    schedule:
      - {cron: "* * * * *", capacity: 0}
descriptors:
  - {key: m, bucket: maintained}
  - {key: c, bucket: closed}
"#;
    let h = harness(yaml, utc(2026, 6, 1, 1, 59));
    assert_eq!(admitted(&h, "m", "x", 5).await, 5);
    h.clock.set_us(utc(2026, 6, 1, 2, 30));
    let resp = h.ask(&one(&[("m", "x")])).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(retry_after(&resp), Some(30 * 60));
    // While closed it is reported as denying everything, and resetting when the window ends.
    assert_eq!(limit_of(&resp.statuses[0]), Some(("maintained", 0, Unit::Second)));
    assert_eq!(until_reset(&resp), secs(30 * 60));
    assert_eq!(header(&resp, "ratelimit-policy"), Some(r#""maintained";q=0"#));
    assert_eq!(header(&resp, "ratelimit"), Some(r#""maintained";r=0;t=1800"#));
    h.clock.set_us(utc(2026, 6, 1, 3, 0) - 1);
    assert_eq!(admitted(&h, "m", "x", 1).await, 0);
    h.clock.set_us(utc(2026, 6, 1, 3, 0));
    assert_eq!(admitted(&h, "m", "x", 11).await, 10);

    let resp = h.ask(&one(&[("c", "x")])).await;
    assert_eq!(resp.overall_code, OVER);
    assert_eq!(retry_after(&resp), None);
    // And when one denied descriptor has no wait, the response has none (docs/rules.md).
    let both = req("d", vec![desc(&[("m", "y")]), desc(&[("c", "y")])]);
    h.clock.set_us(utc(2026, 6, 1, 2, 10));
    let resp = h.ask(&both).await;
    assert_eq!(resp.statuses[0].code, OVER);
    assert_eq!(resp.statuses[1].code, OVER);
    assert_eq!(retry_after(&resp), None);
}

fn fixed(capacity: u64, refill: &str) -> String {
    format!("domain: d\nbuckets:\n  b: {{capacity: {capacity}, refill: {refill}}}\ndescriptors:\n  - {{key: k, bucket: b}}\n")
}

/// Whole tokens `key=x` holds, by a non-consuming check.
async fn remaining(h: &Harness, key: &str) -> u32 {
    h.ask(&req("d", vec![hits(&[(key, "x")], 0)])).await.statuses[0].limit_remaining
}

/// A reload applies to a bucket that was not full when it happened, even after the old rules
/// would have made it full: a raised capacity grants nothing at once, a lowered refill is not
/// bypassed, and a quota whose reset changed never resets at an edge of the old pattern.
/// (These went wrong when the store read a bucket as absent once it would have been full by
/// the old rules.)
#[tokio::test]
async fn a_reload_governs_buckets_that_were_not_full_when_it_happened() {
    let t0 = utc(2026, 6, 1, 12, 0);
    let h = harness(&fixed(10, "10/m"), t0);
    assert_eq!(admitted(&h, "k", "x", 10).await, 10);
    h.clock.set_us(t0 + 30 * S);
    h.limiter.swap_rules(harness::rules(&fixed(100, "10/m")));
    h.clock.set_us(t0 + 60 * S);
    assert_eq!(remaining(&h, "k").await, 10, "5 held at the reload, 5 refilled since");
    assert_eq!(admitted(&h, "k", "x", 200).await, 10);
    // Swept or not: the sweep must not drop it either.
    h.clock.set_us(t0 + 90 * S);
    h.limiter.store().sweep();
    assert_eq!(remaining(&h, "k").await, 5);

    let h = harness(&fixed(10, "10/m"), t0);
    assert_eq!(admitted(&h, "k", "x", 10).await, 10);
    h.clock.set_us(t0 + S);
    h.limiter.swap_rules(harness::rules(&fixed(10, "1/h")));
    h.clock.set_us(t0 + 61 * S);
    h.limiter.store().sweep();
    assert_eq!(
        admitted(&h, "k", "x", 20).await,
        0,
        "1 per hour since the last decision"
    );

    let quota = |reset: &str| {
        format!("domain: d\nbuckets:\n  b: {{quota: {{limit: 3, reset: \"{reset}\"}}}}\ndescriptors:\n  - {{key: k, bucket: b}}\n")
    };
    let h = harness(&quota("0 0 * * *"), utc(2026, 6, 10, 12, 0));
    assert_eq!(admitted(&h, "k", "x", 3).await, 3);
    h.limiter.swap_rules(harness::rules(&quota("0 0 1 * *")));
    h.clock.set_us(utc(2026, 6, 11, 0, 0));
    h.limiter.store().sweep();
    assert_eq!(admitted(&h, "k", "x", 5).await, 0, "no monthly edge on 11 June");
    h.clock.set_us(utc(2026, 7, 1, 0, 0));
    assert_eq!(admitted(&h, "k", "x", 5).await, 3);

    // A bucket already full when the rules change is the same as a new one.
    let h = harness(&fixed(10, "10/m"), t0);
    assert_eq!(admitted(&h, "k", "x", 10).await, 10);
    h.clock.set_us(t0 + 120 * S);
    h.limiter.swap_rules(harness::rules(&fixed(100, "10/m")));
    assert_eq!(admitted(&h, "k", "x", 200).await, 100);
}

/// A reload changes rates from the reload on (docs/operations.md): time before it counts at
/// the old rate, time after at the new one, for token buckets, scheduled buckets and quotas.
/// (Every store applied the new rate to the whole time since a bucket's last write: raising a
/// rate granted at once what the idle time would have earned at the new rate.)
#[tokio::test]
async fn a_reload_changes_rates_from_the_reload_on() {
    let t0 = utc(2026, 6, 1, 12, 0);
    // Raised: drained, idle 10 s at 1/s, then 10/s.
    let h = harness(&fixed(100, "1/s"), t0);
    assert_eq!(admitted(&h, "k", "x", 100).await, 100);
    h.clock.set_us(t0 + 10 * S);
    h.limiter.swap_rules(harness::rules(&fixed(100, "10/s")));
    assert_eq!(remaining(&h, "k").await, 10, "10 s at the old 1/s");
    h.clock.set_us(t0 + 11 * S);
    assert_eq!(admitted(&h, "k", "x", 200).await, 20, "and 1 s at the new 10/s");

    // Lowered: what was earned at the old rate stays.
    let h = harness(&fixed(100, "10/s"), t0);
    assert_eq!(admitted(&h, "k", "x", 100).await, 100);
    h.clock.set_us(t0 + 5 * S);
    h.limiter.swap_rules(harness::rules(&fixed(100, "1/s")));
    h.clock.set_us(t0 + 6 * S);
    assert_eq!(admitted(&h, "k", "x", 200).await, 51);

    // Scheduled: the same through a schedule's base rate.
    let scheduled = |refill: &str| {
        format!(
            "domain: d\nbuckets:\n  b:\n    capacity: 100\n    refill: {refill}\n    schedule:\n      - {{cron: \"* 3 * * *\", capacity: 0}}\ndescriptors:\n  - {{key: k, bucket: b}}\n"
        )
    };
    let h = harness(&scheduled("1/s"), t0);
    assert_eq!(admitted(&h, "k", "x", 100).await, 100);
    h.clock.set_us(t0 + 10 * S);
    h.limiter.swap_rules(harness::rules(&scheduled("10/s")));
    assert_eq!(remaining(&h, "k").await, 10);

    // A quota replaced by a token bucket: nothing was left of the quota at the reload.
    let quota =
        "domain: d\nbuckets:\n  b: {quota: {limit: 3, reset: \"0 0 * * *\"}}\ndescriptors:\n  - {key: k, bucket: b}\n";
    let h = harness(quota, t0);
    assert_eq!(admitted(&h, "k", "x", 3).await, 3);
    h.clock.set_us(utc(2026, 6, 1, 18, 0));
    h.limiter.swap_rules(harness::rules(&fixed(10, "10/h")));
    h.clock.set_us(utc(2026, 6, 1, 18, 30));
    assert_eq!(admitted(&h, "k", "x", 10).await, 5, "half an hour at 10/h");

    // Swept in between: the sweep must not forget a bucket by the old rules either.
    let h = harness(&fixed(100, "10/s"), t0);
    assert_eq!(admitted(&h, "k", "x", 100).await, 100);
    h.clock.set_us(t0 + 5 * S);
    h.limiter.swap_rules(harness::rules(&fixed(100, "1/s")));
    h.clock.set_us(t0 + 10 * S);
    h.limiter.store().sweep();
    assert_eq!(remaining(&h, "k").await, 55, "50 at 10/s, then 5 at 1/s");
}

/// A request that loaded the rules before a reload and writes its bucket after it (in flight
/// across the swap) must not make the memory store forget that bucket at the full time the
/// old rules give: the new rules decide it from its state. (The store was told of the reload
/// only at the swap, so such a write counted as one under the new rules, and the bucket,
/// drained under a 10/s refill, read as full a second later although the new rules refill
/// 1 per hour.)
#[tokio::test]
async fn a_request_in_flight_across_a_reload_does_not_make_the_store_forget_its_bucket() {
    use tollgate::core::bucket::{Demand, DemandKind, MICRO};
    use tollgate::store::Store;
    let t0 = utc(2026, 6, 1, 12, 0);
    let h = harness(&fixed(10, "10/s"), t0);
    // The request in flight: it resolved its bucket under the old rules and holds them.
    let entries = desc(&[("k", "x")]).entries;
    let old_bucket = h.limiter.resolve("d", &entries).unwrap().buckets;
    let in_flight = h.limiter.rules();
    h.limiter.swap_rules(harness::rules(&fixed(10, "1/h")));
    h.clock.set_us(t0 + 1000);
    let take_all = [Demand {
        instance: 0,
        kind: DemandKind::Consume(10 * MICRO),
        enforced: true,
    }];
    assert!(
        !h.limiter
            .store()
            .apply(&old_bucket, &take_all)
            .await
            .unwrap()
            .decision
            .denied
    );
    h.clock.set_us(t0 + 2000);
    drop(in_flight);
    // Full by the old rules a second later; by the new ones a token takes an hour.
    h.clock.set_us(t0 + 10 * S);
    h.limiter.store().sweep();
    assert_eq!(remaining(&h, "k").await, 0);
    h.clock.set_us(t0 + 3600 * S + 1000);
    assert_eq!(remaining(&h, "k").await, 1);
}
