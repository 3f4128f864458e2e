//! The timeline: a bucket's capacity and refill in force over the next 7 days, as its schedule
//! windows (cron patterns read in their time zones, DST included) and a quota's resets make
//! them. The walk is the decision path's own: [`Plan::limit_at`] and [`Plan::next_change_us`].

use axum::response::Response;
use chrono_tz::Tz;
use maud::{html, Markup};

use super::chart::{number, steps, Chart, Series};
use super::page::{first, frame, link, query_pairs, PageError, Section};
use super::Console;
use crate::core::bucket::MICRO;
use crate::core::schedule::Plan;
use crate::rules::BucketPolicy;

/// How far ahead the timeline looks: 7 days, in microseconds.
pub(crate) const SPAN_US: u64 = 7 * 24 * 3_600 * 1_000_000;

/// Changes walked at most; a schedule that changes more often is cut there (and says so).
pub(crate) const MAX_CHANGES: usize = 2_000;

/// A limit in force from an instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Segment {
    /// From, in microseconds since the Unix epoch.
    pub(crate) from_us: u64,
    /// The capacity in force, tokens (as a decision reports it).
    pub(crate) capacity: f64,
    /// The refill in force, tokens per second.
    pub(crate) refill_per_second: f64,
}

/// What a bucket's limit does over `[from, to)`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Timeline {
    /// The limits in force, the first from `from`; a new one where the limit changes.
    pub(crate) segments: Vec<Segment>,
    /// A quota's resets (the bucket whole again), in microseconds since the Unix epoch.
    pub(crate) resets: Vec<u64>,
    /// Whether the walk stopped at [`MAX_CHANGES`] before `to`.
    pub(crate) cut: bool,
}

/// `policy`'s limit over `[from_us, to_us)`. Pure.
pub(crate) fn timeline(policy: &BucketPolicy, from_us: u64, to_us: u64) -> Timeline {
    let plan = &policy.plan;
    let at = |t: u64| {
        let limit = policy.shown(plan.limit_at(t));
        Segment {
            from_us: t,
            capacity: limit.capacity_ut as f64 / MICRO as f64,
            refill_per_second: limit.rate.num() as f64 / limit.rate.den() as f64,
        }
    };
    let mut out = Timeline {
        segments: vec![at(from_us)],
        resets: Vec::new(),
        cut: false,
    };
    let mut t = from_us;
    let mut changes = 0;
    while let Some(next) = plan.next_change_us(t, to_us.saturating_sub(t)) {
        if next >= to_us || next <= t {
            break;
        }
        changes += 1;
        if changes > MAX_CHANGES {
            out.cut = true;
            break;
        }
        if is_quota(plan) {
            out.resets.push(next);
        }
        let segment = at(next);
        let last = out.segments.last().copied();
        if last.is_none_or(|l| (l.capacity, l.refill_per_second) != (segment.capacity, segment.refill_per_second)) {
            out.segments.push(segment);
        }
        t = next;
    }
    out
}

fn is_quota(plan: &Plan) -> bool {
    match plan {
        Plan::Quota(_) => true,
        Plan::Reloaded(r) => is_quota(r.after()),
        _ => false,
    }
}

/// The time zone the bucket's windows or resets are read in (the first entry's), if any.
fn zone(plan: &Plan) -> Option<Tz> {
    match plan {
        Plan::Scheduled(s) => s.entries().first().map(|e| e.timezone()),
        Plan::Quota(q) => Some(q.timezone()),
        Plan::Reloaded(r) => zone(r.after()),
        Plan::Fixed(_) | Plan::Expiring(_) => None,
    }
}

pub(super) async fn page<S: crate::store::Store>(console: &Console<S>, query: Option<&str>) -> Response {
    let pairs = query_pairs(query);
    let domain = first(&pairs, "domain").unwrap_or_default().trim().to_owned();
    let rule = first(&pairs, "rule").map(str::to_owned);
    let bucket = first(&pairs, "bucket").map(str::to_owned);
    // The `/config` document (tens of milliseconds for 10,000 rules) only where it is read:
    // the index and a rule's path; a bucket is found by name in the rules alone.
    let config = if domain.is_empty() || rule.is_some() {
        console.config().await
    } else {
        serde_json::Value::Null
    };
    let rules = console.limiter.rules();
    let now_us = crate::core::clock::Clock::now_us(&crate::core::clock::SystemClock);
    // A rule's buckets are looked up by name in the rules read here: the `/config` document
    // read a moment before may be of another generation, so its indices are not used.
    let picked: Result<Picked<'_>, PageError> = match (rules.domain(&domain), &rule, &bucket) {
        _ if domain.is_empty() => Ok(Picked::Index),
        (None, ..) => Err(PageError::not_found(format!(
            "no domain `{domain}` in the rules in force"
        ))),
        (Some(d), Some(path), _) => {
            let found = config["domains"][&domain]["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|r| r["path"].as_str() == Some(path.as_str()));
            match found {
                None => Err(PageError::not_found(format!("no rule `{path}` in domain `{domain}`"))),
                Some(r) if r["unlimited"].as_bool() == Some(true) => {
                    Ok(Picked::Nothing("The rule is unlimited: no bucket."))
                }
                Some(r) => {
                    let names: Vec<&str> = r["buckets"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|n| n.as_str())
                        .collect();
                    let policies: Vec<&BucketPolicy> = names
                        .iter()
                        .filter_map(|n| d.buckets.iter().find(|b| b.name == *n))
                        .collect();
                    if names.is_empty() {
                        Ok(Picked::Nothing(
                            "This node of the descriptor tree has no limit of its own: its deeper rules do.",
                        ))
                    } else if policies.len() < names.len() {
                        Err(PageError::not_found(format!(
                            "the rules changed while reading rule `{path}`: reload the page"
                        )))
                    } else {
                        Ok(Picked::Buckets(policies))
                    }
                }
            }
        }
        (Some(d), None, Some(name)) => match d.buckets.iter().find(|b| &b.name == name) {
            Some(b) => Ok(Picked::Buckets(vec![b])),
            None => Err(PageError::not_found(format!("no bucket `{name}` in domain `{domain}`"))),
        },
        (Some(_), None, None) => Err(PageError::bad_request(
            "name a rule (rule=PATH) or a bucket (bucket=NAME)".to_owned(),
        )),
    };
    let status = PageError::status_of(Some(&picked));
    let title = match (&rule, &bucket) {
        (Some(r), _) => format!("Timeline of rule {r}"),
        (None, Some(b)) => format!("Timeline of bucket {b}"),
        _ => "Timeline".to_owned(),
    };
    let body = html! {
        @match picked {
            Err(e) => (e.card("timeline-error")),
            Ok(Picked::Nothing(message)) => section.card { p { (message) } },
            Ok(Picked::Index) => (index(&config)),
            Ok(Picked::Buckets(policies)) => {
                p.muted { "The next 7 days from " (utc(now_us)) " UTC, as the rules in force say; changes in UTC, and in local time for a bucket whose windows or resets have a time zone." }
                @for policy in policies {
                    (bucket_timeline(&domain, policy, now_us))
                }
            },
        }
    };
    frame(Section::Timeline, &title, console.logout, status, body)
}

/// What the timeline page shows.
enum Picked<'a> {
    /// Every domain's rules, to pick from.
    Index,
    /// A rule or bucket that has no bucket to plot, and why.
    Nothing(&'static str),
    /// These buckets.
    Buckets(Vec<&'a BucketPolicy>),
}

/// Without a rule: each domain's rules, linked.
fn index(config: &serde_json::Value) -> Markup {
    html! {
        @for (domain, d) in config["domains"].as_object().into_iter().flatten() {
            section.card {
                h2 { "Domain " code { (domain) } }
                ul {
                    @for r in d["rules"].as_array().into_iter().flatten().filter(|r| r["buckets"].as_array().is_some_and(|b| !b.is_empty())) {
                        @if let Some(path) = r["path"].as_str() {
                            li { a href=(link("/timeline", &[("domain", domain), ("rule", path)])) { code { (path) } } }
                        }
                    }
                }
            }
        }
    }
}

fn bucket_timeline(domain: &str, policy: &BucketPolicy, now_us: u64) -> Markup {
    let end_us = now_us + SPAN_US;
    let line = timeline(policy, now_us, end_us);
    let tz = zone(&policy.plan);
    let hours = |t: u64| (t as f64 - now_us as f64) / 3_600e6;
    let end = hours(end_us);
    let changes = |pick: fn(&Segment) -> f64| {
        line.segments
            .iter()
            .map(|s| (hours(s.from_us), pick(s)))
            .collect::<Vec<_>>()
    };
    let x_ticks: Vec<(f64, String)> = (0u32..=7)
        .map(|d| {
            let label = if d == 0 {
                "now".to_owned()
            } else {
                day(now_us + u64::from(d) * 86_400_000_000)
            };
            (f64::from(d) * 24.0, label)
        })
        .collect();
    let markers: Vec<f64> = line.resets.iter().map(|t| hours(*t)).collect();
    let chart_id = format!("timeline-{}", policy.name);
    let refill_id = format!("refill-{}", policy.name);
    html! {
        section.card.timeline data-bucket=(policy.name) {
            h2 { "Bucket " code { (policy.name) } }
            p.muted {
                a href=(link("/timeline", &[("domain", domain), ("bucket", &policy.name)])) { "this bucket alone" }
                @if let Some(tz) = tz { " · time zone " (tz.name()) }
                @if !line.resets.is_empty() { " · dashed lines: quota resets" }
            }
            div.charts {
                (Chart {
                    id: &chart_id,
                    title: "Capacity in force, tokens, next 7 days",
                    x_range: (0.0, end),
                    y_floor: 1.0,
                    y_unit: "tokens",
                    series: vec![Series { class: "capacity", label: "capacity (tokens)", points: steps(&changes(|s| s.capacity), end) }],
                    x_ticks: x_ticks.clone(),
                    markers: markers.clone(),
                }.render())
                (Chart {
                    id: &refill_id,
                    title: "Refill in force, tokens per second, next 7 days",
                    x_range: (0.0, end),
                    y_floor: 0.0,
                    y_unit: "tokens/s",
                    series: vec![Series { class: "refill", label: "refill (tokens/s)", points: steps(&changes(|s| s.refill_per_second), end) }],
                    x_ticks,
                    markers,
                }.render())
            }
            table.changes {
                thead { tr { th { "From (UTC)" } @if tz.is_some() { th { "Local" } } th { "Capacity" } th { "Refill" } } }
                tbody {
                    @for s in line.segments.iter().take(50) {
                        tr {
                            td { (utc(s.from_us)) }
                            @if let Some(tz) = tz { td { (local(s.from_us, tz)) } }
                            td { (number(s.capacity)) }
                            td { (super::page::refill(s.refill_per_second)) }
                        }
                    }
                }
            }
            @if line.segments.len() > 50 { p.muted { (line.segments.len() - 50) " more changes in the 7 days." } }
            @if line.cut { p.muted { "The limit changes more than " (MAX_CHANGES) " times in 7 days; the walk stopped there." } }
            @if !line.resets.is_empty() {
                h3 { "Quota resets" }
                ul.resets {
                    @for t in line.resets.iter().take(50) {
                        li { (utc(*t)) @if let Some(tz) = tz { " (" (local(*t, tz)) ")" } }
                    }
                }
            }
        }
    }
}

/// `t_us` (microseconds since the Unix epoch) on the wall clock of `tz`, formatted with
/// `format`; empty past chrono's range.
fn formatted(t_us: u64, tz: Tz, format: &str) -> String {
    chrono::DateTime::from_timestamp_micros(i64::try_from(t_us).unwrap_or(i64::MAX))
        .map_or_else(String::new, |t| t.with_timezone(&tz).format(format).to_string())
}

/// A day for an axis: `Tue 08` (UTC).
fn day(t_us: u64) -> String {
    formatted(t_us, chrono_tz::UTC, "%a %d")
}

fn utc(t_us: u64) -> String {
    formatted(t_us, chrono_tz::UTC, "%a %Y-%m-%d %H:%M")
}

fn local(t_us: u64, tz: Tz) -> String {
    formatted(t_us, tz, "%a %H:%M %Z")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bucket::{Limit, Rate};
    use crate::core::schedule::{Quota, Schedule, ScheduleEntry};

    fn utc_us(y: i32, mo: u32, d: u32, h: u32) -> u64 {
        let t = chrono::NaiveDate::from_ymd_opt(y, mo, d)
            .unwrap()
            .and_hms_opt(h, 0, 0)
            .unwrap();
        u64::try_from(t.and_utc().timestamp()).unwrap() * 1_000_000
    }

    fn policy(plan: Plan) -> BucketPolicy {
        let reported = crate::rules::ReportedLimit::of(&plan.base());
        BucketPolicy::new("b".to_owned(), plan, reported)
    }

    #[test]
    fn business_hours_follow_new_york_across_the_dst_change() {
        let base = Limit::new(100, Rate::per(10, 1_000_000).unwrap());
        let window = ScheduleEntry::new("* 9-16 * * MON-FRI", Some("America/New_York"), Some(0.5), None, None).unwrap();
        let plan = Plan::Scheduled(std::sync::Arc::new(Schedule::new(base, vec![window]).unwrap()));
        // Friday 2027-03-12 (EST, UTC-5) to Tuesday 2027-03-16 (EDT since Sunday, UTC-4).
        let line = timeline(&policy(plan), utc_us(2027, 3, 12, 0), utc_us(2027, 3, 16, 0));
        let opens: Vec<u64> = line
            .segments
            .iter()
            .filter(|s| s.capacity == 50.0)
            .map(|s| s.from_us)
            .collect();
        let closes: Vec<u64> = line
            .segments
            .iter()
            .skip(1)
            .filter(|s| s.capacity == 100.0)
            .map(|s| s.from_us)
            .collect();
        assert_eq!(opens, vec![utc_us(2027, 3, 12, 14), utc_us(2027, 3, 15, 13)]);
        assert_eq!(closes, vec![utc_us(2027, 3, 12, 22), utc_us(2027, 3, 15, 21)]);
        assert_eq!(line.segments[0].refill_per_second, 10.0);
        assert_eq!(line.segments[1].refill_per_second, 5.0);
        assert!(line.resets.is_empty() && !line.cut);
    }

    #[test]
    fn a_quota_shows_its_resets_and_a_constant_capacity() {
        let plan = Plan::Quota(std::sync::Arc::new(
            Quota::new(1_000, "0 0 * * *", Some("Europe/Berlin")).unwrap(),
        ));
        let from = utc_us(2027, 3, 26, 12);
        let line = timeline(&policy(plan), from, from + SPAN_US);
        assert_eq!(line.segments.len(), 1, "{line:?}");
        assert_eq!(line.segments[0].capacity, 1_000.0);
        assert_eq!(line.resets.len(), 7);
        // Midnight in Berlin: 23:00 UTC in winter, 22:00 UTC from Sunday 2027-03-28 (CEST).
        assert_eq!(line.resets[0], utc_us(2027, 3, 26, 23));
        assert_eq!(line.resets[2], utc_us(2027, 3, 28, 22));
    }

    #[test]
    fn a_fixed_limit_is_one_segment() {
        let plan = Plan::Fixed(Limit::new(5, Rate::per(1, 1_000_000).unwrap()));
        let line = timeline(&policy(plan), 0, SPAN_US);
        assert_eq!(
            line.segments,
            vec![Segment {
                from_us: 0,
                capacity: 5.0,
                refill_per_second: 1.0
            }]
        );
    }
}
