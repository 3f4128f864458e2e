//! `tollgate check`: the compiled rules as an operator reads them.

use std::fmt::Write;

use chrono::DateTime;
use chrono_tz::Tz;

use crate::bucket::Limit;
use crate::rules::{BucketPolicy, Domain, Level, Rule, RuleSet};
use crate::schedule::{Effect, Plan, Schedule, DEFAULT_HORIZON_US, QUOTA_HORIZON_US};

/// How many upcoming changes of limit the preview lists per scheduled bucket.
const PREVIEW_CHANGES: usize = 4;

/// Renders every domain of `rules`: its bucket policies (for a scheduled bucket or a quota, the
/// limit in force at `now_us` and what changes next, so operators can preview a schedule before
/// deploying it), then its descriptor tree with the rule on each node, then the notes (accepted
/// fields without effect and the like).
pub fn render(rules: &RuleSet, now_us: u64) -> String {
    let mut out = String::new();
    let mut names: Vec<&String> = rules.domains.keys().collect();
    names.sort();
    for name in names {
        render_domain(&mut out, &rules.domains[name], now_us);
    }
    out
}

fn render_domain(out: &mut String, d: &Domain, now_us: u64) {
    let _ = writeln!(out, "domain {} ({})", d.name, d.file.display());
    let _ = writeln!(out, "  buckets:");
    for b in &d.buckets {
        match &b.plan {
            Plan::Fixed(limit) => {
                let _ = writeln!(out, "    {}: {}", b.name, describe(limit, b));
            }
            Plan::Scheduled(s) => render_schedule(out, b, s, now_us),
            Plan::Quota(q) => {
                let tz = q.timezone();
                let _ = writeln!(
                    out,
                    "    {}: quota of {} tokens, reset at `{}` ({tz}), no refill in between",
                    b.name,
                    q.limit().capacity(),
                    q.pattern()
                );
                let horizon = now_us.saturating_add(QUOTA_HORIZON_US);
                let prev = q.prev_edge(now_us, now_us.saturating_sub(QUOTA_HORIZON_US));
                let next = q.next_edge(now_us, horizon);
                let _ = writeln!(
                    out,
                    "      last reset {}, next reset {} (reported as {})",
                    prev.map_or("(none within a year)".to_owned(), |t| instant(t, tz)),
                    next.map_or("(none within a year)".to_owned(), |t| instant(t, tz)),
                    reported(b, now_us),
                );
            }
        }
    }
    let _ = writeln!(out, "  descriptors:");
    render_level(out, d, &d.root, 2, "");
    if !d.notes.is_empty() {
        let _ = writeln!(out, "  notes:");
        for (rule, note) in &d.notes {
            let _ = writeln!(out, "    {rule}: {note}");
        }
    }
}

fn render_level(out: &mut String, d: &Domain, level: &Level, depth: usize, parent: &str) {
    for (_, _, id) in level.in_match_order(d) {
        let node = &d.nodes[id];
        // The node's own `key=value`: its path minus the parent's (a value may contain `.`).
        let step = match node.path.strip_prefix(parent) {
            Some(rest) if !parent.is_empty() => rest.strip_prefix('.').unwrap_or(rest),
            _ => &node.path,
        };
        let rule = match &node.rule {
            None => "(no limit)".to_owned(),
            Some(Rule::Unlimited) => "unlimited".to_owned(),
            Some(Rule::Limited {
                bucket,
                quota,
                shadow,
                replaces,
            }) => {
                let mut s = format!("-> bucket {}", d.buckets[*bucket].name);
                if let Some(q) = quota {
                    let _ = write!(s, " and quota {}", d.buckets[*q].name);
                }
                if *shadow {
                    s.push_str(" [shadow]");
                }
                if !replaces.is_empty() {
                    let _ = write!(s, " [replaces {}]", d.replaced_names(replaces).join(", "));
                }
                s
            }
        };
        let _ = writeln!(out, "{:indent$}{step}  {rule}", "", indent = depth * 2);
        render_level(out, d, &node.children, depth + 1, &node.path);
    }
}

/// A constant limit in words, with how Envoy is told about it.
fn describe(limit: &Limit, b: &BucketPolicy) -> String {
    let reported = format!(
        "reported as {} per {}",
        b.reported.requests_per_unit,
        b.reported.unit.as_str_name().to_lowercase()
    );
    format!("{} ({reported})", limit_text(limit))
}

fn limit_text(limit: &Limit) -> String {
    let rate = limit.rate;
    if rate.is_zero() || limit.capacity_ut == 0 {
        return "denies every request".to_owned();
    }
    let fill = limit.time_to_fill_us().unwrap_or(0);
    let per_second = rate.num() as f64 / rate.den() as f64;
    format!(
        "capacity {}, refill {per_second:.6} tokens/s, full from empty in {:.3}s",
        limit.capacity(),
        fill as f64 / 1e6
    )
}

fn reported(b: &BucketPolicy, now_us: u64) -> String {
    let r = b.reported_at(now_us);
    format!("{} per {}", r.requests_per_unit, r.unit.as_str_name().to_lowercase())
}

/// A scheduled bucket: its base, its entries, the limit in force at `now_us` and which entry
/// gives it, then the next few changes of limit within the horizon.
fn render_schedule(out: &mut String, b: &BucketPolicy, s: &Schedule, now_us: u64) {
    let _ = writeln!(out, "    {}: base {}", b.name, limit_text(s.base()));
    for (i, e) in s.entries().iter().enumerate() {
        let effect = match e.effect() {
            Effect::Scale { millionths } => format!("scale {}", millionths as f64 / 1e6),
            Effect::Set { .. } => "set".to_owned(),
        };
        let limit = s.entry_limit(i).expect("one limit per entry");
        let _ = writeln!(
            out,
            "      schedule[{i}]: `{}` ({}) {effect}: {}",
            e.pattern(),
            e.timezone(),
            limit_text(limit)
        );
    }
    // Instants are shown in the first entry's timezone, the one the schedule is usually written in.
    let tz = s.entries().first().map_or(Tz::UTC, |e| e.timezone());
    let by = |t: u64| match s.active_entry(t) {
        Some(i) => format!("schedule[{i}]"),
        None => "base".to_owned(),
    };
    let _ = writeln!(
        out,
        "      now ({}): {} by {} (reported as {})",
        instant(now_us, tz),
        limit_text(&s.limit_at(now_us)),
        by(now_us),
        reported(b, now_us)
    );
    let end = now_us.saturating_add(DEFAULT_HORIZON_US);
    let mut t = now_us;
    let mut shown = 0;
    while shown < PREVIEW_CHANGES {
        let Some(change) = s.next_limit_change(t, end - t) else {
            if shown == 0 {
                let _ = writeln!(
                    out,
                    "      no change of limit within {} days",
                    DEFAULT_HORIZON_US / 86_400_000_000
                );
            }
            break;
        };
        let _ = writeln!(
            out,
            "      from {}: {} by {}",
            instant(change, tz),
            limit_text(&s.limit_at(change)),
            by(change)
        );
        t = change;
        shown += 1;
    }
}

/// An instant as RFC 3339 in `tz` (with its offset), e.g. `2026-12-01T00:00:00+01:00`.
fn instant(t_us: u64, tz: Tz) -> String {
    DateTime::from_timestamp((t_us / 1_000_000) as i64, 0)
        .map(|t| t.with_timezone(&tz).format("%Y-%m-%dT%H:%M:%S%:z %Z").to_string())
        .unwrap_or_else(|| format!("{t_us}us"))
}

#[cfg(test)]
mod tests {
    use super::render;
    use crate::config::load_rules;
    use crate::rules::RuleSet;

    fn rules(yaml: &str) -> RuleSet {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.yaml");
        std::fs::write(&file, yaml).unwrap();
        load_rules(&file).unwrap_or_else(|e| panic!("rules should load: {e}"))
    }

    /// 2026-03-06T15:00:00Z: Friday 10:00 EST, two days before New York moves to EDT (Sunday
    /// 2026-03-08).
    const FRIDAY_10_EST_US: u64 = 1_772_809_200_000_000;

    /// The preview of a New York business-hours window at a fixed instant: the window is active
    /// (capacity 50), it closes at 18:00 EST, and reopens on Monday at 09:00 EDT, local time
    /// held across the change of offset.
    #[test]
    fn schedule_preview_at_a_fixed_instant() {
        let set = rules(
            "domain: preview\nbuckets:\n  per_key:\n    capacity: 100\n    refill: 10/s\n    schedule:\n      \
             - cron: \"* 9-17 * * MON-FRI\"\n        timezone: America/New_York\n        scale: 0.5\n\
             descriptors:\n  - key: api_key\n    bucket: per_key\n",
        );
        let out = render(&set, FRIDAY_10_EST_US);
        let base = "capacity 100, refill 10.000000 tokens/s, full from empty in 10.000s";
        let half = "capacity 50, refill 5.000000 tokens/s, full from empty in 10.000s";
        let expected = format!(
            "  buckets:\n    \
             per_key: base {base}\n      \
             schedule[0]: `* 9-17 * * MON-FRI` (America/New_York) scale 0.5: {half}\n      \
             now (2026-03-06T10:00:00-05:00 EST): {half} by schedule[0] (reported as 5 per second)\n      \
             from 2026-03-06T18:00:00-05:00 EST: {base} by base\n      \
             from 2026-03-09T09:00:00-04:00 EDT: {half} by schedule[0]\n      \
             from 2026-03-09T18:00:00-04:00 EDT: {base} by base\n      \
             from 2026-03-10T09:00:00-04:00 EDT: {half} by schedule[0]\n  \
             descriptors:\n    \
             api_key  -> bucket per_key\n"
        );
        assert!(out.contains(&expected), "expected\n{expected}in:\n{out}");
    }

    /// One second before the window closes it is still active; at 18:00:00 EST the base is in
    /// force and the next change is Monday's opening.
    #[test]
    fn schedule_preview_at_the_edge_of_a_window() {
        let set = rules(
            "domain: preview\nbuckets:\n  per_key:\n    capacity: 100\n    refill: 10/s\n    schedule:\n      \
             - cron: \"* 9-17 * * MON-FRI\"\n        timezone: America/New_York\n        scale: 0.5\n",
        );
        let closing_us = FRIDAY_10_EST_US + 8 * 3_600_000_000;
        let before = render(&set, closing_us - 1_000_000);
        assert!(
            before.contains("now (2026-03-06T17:59:59-05:00 EST): capacity 50,")
                && before.contains("\n      from 2026-03-06T18:00:00-05:00 EST: capacity 100,"),
            "{before}"
        );
        let at = render(&set, closing_us);
        assert!(
            at.contains("now (2026-03-06T18:00:00-05:00 EST): capacity 100, refill 10.000000 tokens/s, full from empty in 10.000s by base (reported as 10 per second)\n      \
                         from 2026-03-09T09:00:00-04:00 EDT: capacity 50,"),
            "{at}"
        );
    }

    /// A quota shows its last and next reset in its own zone, and a rule with a token bucket and
    /// a quota names both.
    #[test]
    fn quota_preview_at_a_fixed_instant() {
        let set = rules(
            "domain: preview\nbuckets:\n  per_key:\n    capacity: 100\n    refill: 10/s\n    \
             quota: {limit: 10000, reset: \"0 0 1 * *\", timezone: Europe/Berlin}\n\
             descriptors:\n  - key: api_key\n    bucket: per_key\n",
        );
        let out = render(&set, FRIDAY_10_EST_US);
        let expected = "    per_key: capacity 100, refill 10.000000 tokens/s, full from empty in 10.000s (reported as 10 per second)\n    \
             per_key.quota: quota of 10000 tokens, reset at `0 0 1 * *` (Europe/Berlin), no refill in between\n      \
             last reset 2026-03-01T00:00:00+01:00 CET, next reset 2026-04-01T00:00:00+02:00 CEST (reported as 10000 per month)\n  \
             descriptors:\n    \
             api_key  -> bucket per_key and quota per_key.quota\n";
        assert!(out.contains(expected), "expected\n{expected}in:\n{out}");
    }
}
