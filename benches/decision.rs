//! The cost of one decision on a scheduled bucket (and on a calendar quota) relative to an
//! unscheduled one, measured in one run: `cargo bench --bench decision`. See benches/README.md.
//!
//! `decision/*` runs [`Limiter::should_rate_limit`], the whole decision path without gRPC
//! (validation, tree match, instance key, the memory store's refill and consume, statuses and
//! headers), over a [`MemoryStore`] on a [`ManualClock`] that moves [`STEP_US`] forward before
//! every decision, so each one refills as in production. Every benchmark has its own store and
//! clock, started at a fixed instant, so which schedule window is active does not depend on when
//! the benchmark runs. `core/*` times the pure schedule functions those decisions call.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use criterion::{criterion_group, criterion_main, Criterion};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::core::bucket::{refill, wait_us, BucketState, Limit, Rate, MICRO};
use tollgate::core::clock::ManualClock;
use tollgate::core::schedule::{refill_scheduled, wait_until_us, Schedule, ScheduleEntry, DEFAULT_HORIZON_US};
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::rules::load_rules;
use tollgate::store::MemoryStore;

/// Wednesday 2026-12-02 12:00 in New York (17:00 UTC): the weekday window `* 9-17 * * MON-FRI`
/// (scale 0.5) is active.
const WEEKDAY_NOON_US: u64 = 1_796_230_800 * MICRO;
/// Wednesday 2026-12-02 03:00 in New York (08:00 UTC): no window is active, the base applies
/// (and deciding so tests both entries).
const WEEKDAY_NIGHT_US: u64 = 1_796_198_400 * MICRO;
/// Saturday 2026-12-05 12:00 UTC: the weekend window `* * * * SAT,SUN` (capacity 200) is active,
/// after the weekday entry was tested and found inactive.
const SATURDAY_US: u64 = 1_796_472_000 * MICRO;
/// Wednesday 2026-12-02 18:00 in New York (23:00 UTC): the weekday window closes.
const WEEKDAY_WINDOW_END_US: u64 = 1_796_252_400 * MICRO;

/// How far the clock moves before each decision. At 1,000,000 tokens per second (500,000 in the
/// weekday window) that refills one or two tokens, so the `admitted` buckets, asked for one token
/// per decision, are full again by the next decision and every decision is admitted: each one
/// refills, consumes and stores the bucket one token short (the store keeps an entry until it is
/// full again), as for a client that is not near its limit. Criterion runs a few million
/// iterations per benchmark: tens of simulated seconds, far from any window edge.
const STEP_US: u64 = 2;

/// The schedule of the `scheduled` buckets: business hours in New York at half the limit,
/// weekends at a capacity of 200.
const SCHEDULE: &str = r#"
    schedule:
      - cron: "* 9-17 * * MON-FRI"
        timezone: America/New_York
        scale: 0.5
      - cron: "* * * * SAT,SUN"
        capacity: 200
"#;

/// A monthly quota, reset at midnight on the 1st in Berlin.
fn quota(limit: u64) -> String {
    format!("    quota: {{limit: {limit}, reset: \"0 0 1 * *\", timezone: Europe/Berlin}}\n")
}

/// One domain, one descriptor `(plan, <bucket name>)` per bucket. The `admitted` buckets are
/// large (1,000,000 tokens at 1,000,000 per second); the `denied` ones are small (10 tokens at 10
/// per second, a quota of 10), so all but a few decisions are denied and compute a retry-after.
fn rules_yaml() -> String {
    let big = "    capacity: 1000000\n    refill: 1000000/s\n";
    let small = "    capacity: 10\n    refill: 10/s\n";
    let buckets = [
        ("fixed", big.to_owned()),
        ("scheduled", format!("{big}{SCHEDULE}")),
        ("quota", quota(1_000_000_000)),
        ("bucket_quota", format!("{big}{}", quota(1_000_000_000))),
        ("fixed_small", small.to_owned()),
        ("scheduled_small", format!("{small}{SCHEDULE}")),
        ("quota_small", quota(10)),
        // The token bucket admits, the quota denies.
        ("bucket_quota_small", format!("{big}{}", quota(10))),
    ];
    let mut yaml = String::from("domain: bench\nbuckets:\n");
    for (name, spec) in &buckets {
        yaml.push_str(&format!("  {name}:\n{spec}"));
    }
    yaml.push_str("descriptors:\n");
    for (name, _) in &buckets {
        yaml.push_str(&format!("  - key: plan\n    value: {name}\n    bucket: {name}\n"));
    }
    yaml
}

/// Drives a future that completes without waiting, as the memory store's always does (it never
/// awaits). Polling it once with a no-op waker adds nothing to what is measured; a future that
/// does wait is finished on a current-thread tokio runtime instead.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a tokio runtime")
            .block_on(future),
    }
}

/// A limiter over fresh rules and a fresh memory store whose clock reads `start_us`.
fn limiter(rules: &std::path::Path, start_us: u64) -> (Limiter<MemoryStore>, ManualClock) {
    let rules = load_rules(rules).unwrap_or_else(|e| panic!("the benchmark rules should load: {e}"));
    let clock = ManualClock::new(start_us);
    let store = MemoryStore::new(64, 1_000_000, Arc::new(clock.clone()));
    let options = LimiterOptions::from_settings(&tollgate::server::settings::Settings::default());
    (Limiter::new(rules, store, options), clock)
}

/// A request for one token of bucket `name`: one descriptor `(plan, name)`.
fn request(name: &str) -> RateLimitRequest {
    let entry = |key: &str, value: &str| Entry {
        key: key.to_owned(),
        value: value.to_owned(),
    };
    RateLimitRequest {
        domain: "bench".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![entry("plan", name)],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// One `decision/*` benchmark.
struct Case {
    group: &'static str,
    id: &'static str,
    /// The bucket (and descriptor value) it asks of.
    bucket: &'static str,
    /// Where the clock starts.
    start_us: u64,
    /// The answer to the stream's decisions after the first ten.
    code: Code,
    /// Part of the `RateLimit-Policy` header of those decisions: the limit the case is meant to
    /// be deciding under.
    policy: &'static str,
}

const fn case(
    group: &'static str,
    id: &'static str,
    bucket: &'static str,
    start_us: u64,
    code: Code,
    policy: &'static str,
) -> Case {
    Case {
        group,
        id,
        bucket,
        start_us,
        code,
        policy,
    }
}

/// A quota's `w`: its current period, 1 December to 1 January in Berlin (31 days).
const DECEMBER: &str = "w=2678400";

const CASES: [Case; 11] = [
    case(
        "admitted",
        "fixed",
        "fixed",
        WEEKDAY_NOON_US,
        Code::Ok,
        r#""fixed";q=1000000;w=1"#,
    ),
    case(
        "admitted",
        "scheduled/weekday_window",
        "scheduled",
        WEEKDAY_NOON_US,
        Code::Ok,
        r#""scheduled";q=500000;w=1"#,
    ),
    case(
        "admitted",
        "scheduled/weekend_window",
        "scheduled",
        SATURDAY_US,
        Code::Ok,
        r#""scheduled";q=200;w=1"#,
    ),
    case(
        "admitted",
        "scheduled/no_window",
        "scheduled",
        WEEKDAY_NIGHT_US,
        Code::Ok,
        r#""scheduled";q=1000000;w=1"#,
    ),
    case(
        "admitted",
        "quota",
        "quota",
        WEEKDAY_NOON_US,
        Code::Ok,
        r#""quota";q=1000000000;"#,
    ),
    case(
        "admitted",
        "bucket_quota",
        "bucket_quota",
        WEEKDAY_NOON_US,
        Code::Ok,
        r#""bucket_quota.quota";q=1000000000;"#,
    ),
    case(
        "denied",
        "fixed",
        "fixed_small",
        WEEKDAY_NOON_US,
        Code::OverLimit,
        r#""fixed_small";q=10;w=1"#,
    ),
    case(
        "denied",
        "scheduled/weekday_window",
        "scheduled_small",
        WEEKDAY_NOON_US,
        Code::OverLimit,
        r#""scheduled_small";q=5;w=1"#,
    ),
    case(
        "denied",
        "scheduled/no_window",
        "scheduled_small",
        WEEKDAY_NIGHT_US,
        Code::OverLimit,
        r#""scheduled_small";q=10;w=1"#,
    ),
    case(
        "denied",
        "quota",
        "quota_small",
        WEEKDAY_NOON_US,
        Code::OverLimit,
        r#""quota_small";q=10;"#,
    ),
    case(
        "denied",
        "bucket_quota",
        "bucket_quota_small",
        WEEKDAY_NOON_US,
        Code::OverLimit,
        r#""bucket_quota_small.quota";q=10;"#,
    ),
];

fn bench_decisions(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let rules = dir.path().join("bench.yaml");
    std::fs::write(&rules, rules_yaml()).expect("write the benchmark rules");

    for group_name in ["admitted", "denied"] {
        let mut group = c.benchmark_group(format!("decision/{group_name}"));
        for case in CASES.iter().filter(|c| c.group == group_name) {
            let name = format!("{group_name}/{}", case.id);
            let (limiter, clock) = limiter(&rules, case.start_us);
            let req = request(case.bucket);
            // Empty the small buckets first (10 tokens, or 5 in the weekday window), then check
            // that the stream gets the answer, and decides under the limit, it is meant to measure.
            for _ in 0..10 {
                block_on(limiter.should_rate_limit(&req)).expect("a decision");
            }
            let first = block_on(limiter.should_rate_limit(&req)).expect("a decision");
            assert_eq!(first.overall_code, case.code as i32, "{name}: {first:?}");
            let header = |key: &str| {
                first
                    .response_headers_to_add
                    .iter()
                    .find(|h| h.key == key)
                    .map(|h| h.value.as_str())
            };
            let policy = header("ratelimit-policy").unwrap_or_default();
            assert!(
                policy.contains(case.policy),
                "{name}: policy `{policy}`, expected `{}`",
                case.policy
            );
            if case.bucket.starts_with("quota") || case.bucket.starts_with("bucket_quota") {
                assert!(
                    policy.contains(DECEMBER),
                    "{name}: policy `{policy}`, expected {DECEMBER}"
                );
            }
            if case.code == Code::OverLimit {
                assert!(
                    header("retry-after").is_some(),
                    "{name}: a denial without retry-after: {first:?}"
                );
            }
            group.bench_function(case.id, |b| {
                b.iter(|| {
                    clock.advance_us(STEP_US);
                    black_box(block_on(limiter.should_rate_limit(black_box(&req))).expect("a decision"))
                })
            });
        }
        group.finish();
    }
}

/// The schedule of [`SCHEDULE`] over a base of 10 tokens at 10 per second.
fn new_schedule() -> (Limit, Schedule) {
    let base = Limit::new(10, Rate::per(10, MICRO).expect("an exact rate"));
    let entries = vec![
        ScheduleEntry::new("* 9-17 * * MON-FRI", Some("America/New_York"), Some(0.5), None, None)
            .expect("a valid entry"),
        ScheduleEntry::new("* * * * SAT,SUN", None, None, Some(200), None).expect("a valid entry"),
    ];
    (base, Schedule::new(base, entries).expect("a valid schedule"))
}

fn bench_core(c: &mut Criterion) {
    let (base, schedule) = new_schedule();
    let scaled = schedule.limit_at(WEEKDAY_NOON_US);
    assert_eq!(scaled.capacity(), 5);

    let mut group = c.benchmark_group("core/limit_at");
    for (id, t) in [
        ("weekday_window", WEEKDAY_NOON_US),
        ("weekend_window", SATURDAY_US),
        ("no_window", WEEKDAY_NIGHT_US),
    ] {
        // A schedule of its own: each remembers the stretches of constant limit it was asked
        // about, and a shared one would carry them from one benchmark to the next.
        let (_, schedule) = new_schedule();
        group.bench_function(id, |b| b.iter(|| schedule.limit_at(black_box(t))));
    }
    group.finish();

    // Half full, brought forward by 1 ms inside the weekday window.
    let half = BucketState {
        tokens_ut: 2 * MICRO,
        updated_us: WEEKDAY_NOON_US,
    };
    let now = WEEKDAY_NOON_US + 1_000;
    let mut group = c.benchmark_group("core/refill_1ms");
    group.bench_function("fixed", |b| b.iter(|| refill(black_box(half), &scaled, black_box(now))));
    let (_, fresh) = new_schedule();
    group.bench_function("scheduled", |b| {
        b.iter(|| refill_scheduled(black_box(half), &fresh, black_box(now)))
    });
    group.finish();

    // An empty bucket asking for 5 tokens. Inside the window they come at 5 per second, in 1 s.
    // Half a second before the window closes, the walk earns 2.5 tokens at 5 per second, crosses
    // the close, and earns the other 2.5 at the base's 10 per second: 0.75 s.
    let empty_at = |t: u64| BucketState {
        tokens_ut: 0,
        updated_us: t,
    };
    let need = 5 * MICRO;
    let before_close = WEEKDAY_WINDOW_END_US - 500_000;
    assert_eq!(
        wait_until_us(
            empty_at(before_close),
            need,
            &schedule,
            before_close,
            DEFAULT_HORIZON_US
        ),
        Some(750_000)
    );
    let mut group = c.benchmark_group("core/wait_5_tokens");
    group.bench_function("fixed", |b| {
        b.iter(|| {
            wait_us(
                black_box(empty_at(WEEKDAY_NOON_US)),
                need,
                &base,
                black_box(WEEKDAY_NOON_US),
            )
        })
    });
    let (_, fresh) = new_schedule();
    group.bench_function("scheduled/within_window", |b| {
        b.iter(|| {
            wait_until_us(
                black_box(empty_at(WEEKDAY_NOON_US)),
                need,
                &fresh,
                black_box(WEEKDAY_NOON_US),
                DEFAULT_HORIZON_US,
            )
        })
    });
    let (_, fresh) = new_schedule();
    group.bench_function("scheduled/across_window_close", |b| {
        b.iter(|| {
            wait_until_us(
                black_box(empty_at(before_close)),
                need,
                &fresh,
                black_box(before_close),
                DEFAULT_HORIZON_US,
            )
        })
    });
    group.finish();
}

criterion_group!(benches, bench_decisions, bench_core);
criterion_main!(benches);
