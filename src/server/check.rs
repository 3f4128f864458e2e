//! `tollgate check`: the compiled rules as an operator reads them; with `--explain`, how each
//! rule maps onto a bucket and where tollgate differs from envoyproxy/ratelimit.

mod difference;

use difference::Difference;

use std::collections::BTreeSet;
use std::fmt::Write;

use chrono::DateTime;
use chrono_tz::Tz;

use crate::core::bucket::{Limit, MICRO};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

use crate::core::schedule::{Effect, Expiring, Plan, Schedule, DEFAULT_HORIZON_US, QUOTA_HORIZON_US};
use crate::core::units::ENVOY_UNITS;
use crate::rules::file::DescriptorSpec;
use crate::rules::{BucketPolicy, Domain, Level, Rule, RuleSet};

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
        // `check` compiles files afresh: a plan is never one a reload built.
        match b.plan.current() {
            Plan::Fixed(limit) => {
                let _ = writeln!(out, "    {}: {}", b.name, describe(&b.shown(*limit), b));
                write_debt(out, b, 6);
            }
            Plan::Expiring(e) => {
                let _ = writeln!(
                    out,
                    "    {}: {} (reported as {})",
                    b.name,
                    expiring_text(e),
                    reported(b, now_us)
                );
            }
            Plan::Scheduled(s) => render_schedule(out, b, s, now_us),
            Plan::Quota(q) => {
                let tz = q.timezone();
                let _ = writeln!(
                    out,
                    "    {}: quota of {} tokens, reset at `{}` ({tz}), no refill in between",
                    b.name,
                    q.allowance_ut() / MICRO,
                    q.pattern()
                );
                write_debt(out, b, 6);
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
            // `current()` is the compiled plan, never one a reload built.
            Plan::Reloaded(_) => {}
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
            Some(Rule::Unlimited { replaces }) if replaces.is_empty() => "unlimited".to_owned(),
            Some(Rule::Unlimited { replaces }) => {
                format!("unlimited [replaces {}]", d.replaced_names(replaces).join(", "))
            }
            Some(Rule::Limited {
                buckets,
                shadow,
                quota_mode,
                replaces,
            }) => {
                let mut s = String::from("->");
                for (i, b) in buckets.iter().map(|b| &d.buckets[*b]).enumerate() {
                    let kind = if i > 0 && matches!(b.plan, crate::core::schedule::Plan::Quota(_)) {
                        "quota"
                    } else {
                        "bucket"
                    };
                    let _ = write!(s, "{} {kind} {}", if i > 0 { " and" } else { "" }, b.name);
                    if b.hidden {
                        s.push_str(" [hidden]");
                    }
                    if b.lease_ut > 0 {
                        let _ = write!(s, " [lease {}]", b.lease_ut / crate::core::bucket::MICRO);
                    }
                }
                if *shadow {
                    s.push_str(" [shadow]");
                }
                if *quota_mode {
                    s.push_str(" [quota mode]");
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

/// A debt bucket's floor and what its account does (docs/usage-budgets.md), on a line of its
/// own indented by `indent`; nothing for an ordinary bucket. The limits around it are shown as
/// declared ([`BucketPolicy::shown`]), so the floor is the one place its depth appears.
fn write_debt(out: &mut String, b: &BucketPolicy, indent: usize) {
    if !b.debt {
        return;
    }
    let floor = -i128::from(b.debt_depth_ut / MICRO);
    let reset = if matches!(b.plan.current(), Plan::Quota(_)) {
        "; a reset adds the allowance, up to it, so a debt is repaid, not forgiven"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "{:indent$}debt: usage is debited in full down to a floor of {floor} tokens; hits_addend 0 passes while the \
         balance is positive{reset} (docs/usage-budgets.md)",
        ""
    );
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
    if rate.is_zero() && limit.capacity_ut > 0 {
        return format!("a fixed allowance of {} tokens, never refilled", limit.capacity());
    }
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

/// An expiring allowance in words: its capacity and its period.
fn expiring_text(e: &Expiring) -> String {
    format!(
        "a fixed allowance of {} tokens, whole again {} after its first use",
        e.limit().capacity(),
        seconds(e.expires_us())
    )
}

fn reported(b: &BucketPolicy, now_us: u64) -> String {
    let r = b.reported_at(now_us);
    format!("{} per {}", r.requests_per_unit, r.unit.as_str_name().to_lowercase())
}

/// A scheduled bucket: its base, its entries, the limit in force at `now_us` and which entry
/// gives it, then the next few changes of limit within the horizon.
fn render_schedule(out: &mut String, b: &BucketPolicy, s: &Schedule, now_us: u64) {
    let _ = writeln!(out, "    {}: base {}", b.name, limit_text(&b.shown(*s.base())));
    write_debt(out, b, 6);
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
            limit_text(&b.shown(*limit))
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
        limit_text(&b.shown(s.limit_at(now_us))),
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
            limit_text(&b.shown(s.limit_at(change))),
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

/// `tollgate check --explain`: for every rule of `rules`, how it maps onto a tollgate bucket and,
/// for a rule in envoyproxy/ratelimit's schema (`rate_limit: {unit, requests_per_unit}`), what
/// its fixed window did there, what tollgate does, and where they differ (tags explained once at
/// the end). Reads no clock: the text depends only on the files, with paths as given, so it can
/// be compared with a stored copy. Each domain's file is read again for the fields as written;
/// a file that cannot be read again (changed since) says so in its place.
pub fn explain(rules: &RuleSet) -> String {
    let mut out = String::new();
    let mut used = BTreeSet::new();
    let mut names: Vec<&String> = rules.domains.keys().collect();
    names.sort();
    for name in names {
        let d = &rules.domains[name];
        let _ = writeln!(out, "domain {} ({})", d.name, d.file.display());
        match crate::rules::file::parse_file(&d.file) {
            Ok(file) => {
                let mut steps = Vec::new();
                for spec in &file.descriptors {
                    explain_node(&mut out, d, spec, "", &mut steps, &mut used);
                }
            }
            Err(e) => {
                let _ = writeln!(out, "  (cannot read the file again: {e})");
            }
        }
        if !d.notes.is_empty() {
            let _ = writeln!(out, "  notes:");
            for (rule, note) in &d.notes {
                let _ = writeln!(out, "    {rule}: {note}");
            }
        }
    }
    if !used.is_empty() {
        let _ = writeln!(out, "differences:");
        for diff in used {
            let _ = writeln!(out, "  {} {}", diff.tag(), diff.legend());
        }
    }
    out
}

/// One level of a descriptor path: its key and how its value is matched.
struct Step {
    key: String,
    value: StepValue,
}

enum StepValue {
    Exact,
    Pattern { text: String, shared: bool },
    Any,
}

/// Explains the rule of `spec` (at `parent`.`spec`) and then of its children, in file order.
fn explain_node(
    out: &mut String,
    d: &Domain,
    spec: &DescriptorSpec,
    parent: &str,
    steps: &mut Vec<Step>,
    used: &mut BTreeSet<Difference>,
) {
    // The node's path as the compiler builds it, to find its compiled rule.
    let value = spec.value.as_deref().filter(|v| !v.is_empty());
    let path = crate::rules::file::node_path(parent, spec);
    steps.push(Step {
        key: spec.key.clone(),
        value: match value {
            Some(v) if v.contains('*') => StepValue::Pattern {
                text: v.to_owned(),
                shared: spec.share_threshold,
            },
            Some(_) => StepValue::Exact,
            None => StepValue::Any,
        },
    });
    if let Some(node) = d.nodes.iter().find(|n| n.path == path) {
        explain_rule(out, d, spec, &node.rule, &path, steps, used);
    }
    for child in &spec.descriptors {
        explain_node(out, d, child, &path, steps, used);
    }
    steps.pop();
}

/// Which bucket instances a rule reached through `steps` has: one per combination of the values
/// that vary (a key alone, a wildcard without share_threshold); a shared wildcard stands for all
/// its values.
fn instances(steps: &[Step]) -> String {
    let mut per = Vec::new();
    let mut shared = Vec::new();
    for s in steps {
        match &s.value {
            StepValue::Exact => {}
            StepValue::Any => per.push(format!("value of `{}`", s.key)),
            StepValue::Pattern { text, shared: false } => per.push(format!("value of `{}` matching `{text}`", s.key)),
            StepValue::Pattern { text, shared: true } => {
                shared.push(format!("every value of `{}` matching `{text}` shares it", s.key));
            }
        }
    }
    let mut text = if per.is_empty() {
        "one instance".to_owned()
    } else {
        format!("one instance per {}", per.join(" and "))
    };
    if !shared.is_empty() {
        let _ = write!(text, " ({})", shared.join("; "));
    }
    text
}

/// A length of time in seconds, without trailing zeros: `0.1s`, `60s`, `2592s`.
fn seconds(us: u64) -> String {
    let whole = us / 1_000_000;
    let frac = us % 1_000_000;
    if frac == 0 {
        return format!("{whole}s");
    }
    let digits = format!("{frac:06}");
    format!("{whole}.{}s", digits.trim_end_matches('0'))
}

/// Their window for `unit`: its length and where windows start (their cache key holds
/// `now / length * length` in Unix seconds).
fn their_window(unit: Unit, unit_us: u64) -> String {
    let len = seconds(unit_us);
    match unit {
        Unit::Second => "of 1s".to_owned(),
        Unit::Minute => format!("of {len} starting on each minute"),
        Unit::Hour => format!("of {len} starting on each hour"),
        Unit::Day => format!("of {len} starting at 00:00 UTC"),
        Unit::Week => format!("of {len} starting on Thursdays at 00:00 UTC"),
        Unit::Month | Unit::Year => {
            // A fixed instant, not the clock, so the text is stable: the window that holds
            // 2027-01-01T00:00:00Z.
            const AT_S: u64 = 1_798_761_600;
            let len_s = unit_us / 1_000_000;
            let start = AT_S / len_s * len_s;
            let day = |t: u64| {
                DateTime::from_timestamp(t as i64, 0)
                    .map_or_else(|| format!("{t}"), |t| t.format("%Y-%m-%d").to_string())
            };
            format!(
                "of {} days counted from the Unix epoch (the one holding 2027-01-01 runs from {} to {})",
                len_s / 86_400,
                day(start),
                day(start + len_s)
            )
        }
        _ => format!("of {len}"),
    }
}

fn explain_rule(
    out: &mut String,
    d: &Domain,
    spec: &DescriptorSpec,
    rule: &Option<Rule>,
    path: &str,
    steps: &[Step],
    used: &mut BTreeSet<Difference>,
) {
    let _ = writeln!(out, "  rule {path}");
    let mut diffs = node_differences(spec, rule, steps);
    match rule {
        None => {
            let _ = writeln!(
                out,
                "    no limit here: requests whose last entry is this one are not limited in either"
            );
        }
        Some(Rule::Unlimited { .. }) => explain_unlimited(out, spec, &mut diffs),
        Some(Rule::Limited {
            buckets,
            shadow,
            quota_mode,
            replaces,
        }) => {
            let b = &d.buckets[buckets[0]];
            explain_bucket(out, d, spec, b, steps);
            explain_limit(out, envoy_limit(spec), b, &mut diffs);
            write_debt(out, b, 14);
            for other in buckets[1..].iter().map(|i| &d.buckets[*i]) {
                match other.plan {
                    crate::core::schedule::Plan::Quota(_) => {
                        explain_quota(out, other);
                        write_debt(out, other, 14);
                    }
                    _ => explain_bucket(out, d, spec, other, steps),
                }
            }
            if *shadow {
                diffs.push((
                    Difference::Shadow,
                    "never denies; charged while it has tokens".to_owned(),
                ));
            }
            if *quota_mode {
                diffs.push((
                    Difference::QuotaMode,
                    "over its limit, denies only when every quota-mode descriptor of the request is over".to_owned(),
                ));
            }
            if !replaces.is_empty() {
                diffs.push((
                    Difference::Replaces,
                    format!(
                        "drops {} when both match one request",
                        d.replaced_names(replaces).join(", ")
                    ),
                ));
            }
        }
    }
    list_differences(out, diffs, used);
}

/// The differences of the rule at a node, whatever its limit: a wildcard on its path,
/// `share_threshold`, and fields that only name envoyproxy/ratelimit's series.
fn node_differences(spec: &DescriptorSpec, rule: &Option<Rule>, steps: &[Step]) -> Vec<(Difference, String)> {
    let mut diffs: Vec<(Difference, String)> = Vec::new();
    if steps.iter().any(|s| matches!(s.value, StepValue::Pattern { .. })) && rule.is_some() {
        diffs.push((Difference::Wildcard, "the path holds a wildcard value".to_owned()));
    }
    if spec.share_threshold {
        diffs.push((
            Difference::ShareThreshold,
            "share_threshold: true on this value".to_owned(),
        ));
    }
    if !spec.ignored_fields().is_empty() {
        diffs.push((
            Difference::Metrics,
            format!(
                "{}: affect at most the envoyproxy/ratelimit-named series, never tollgate's metrics",
                spec.ignored_fields().join(", ")
            ),
        ));
    }
    diffs
}

/// Lists `diffs` under `differs:`, recording each in `used` for the legend.
fn list_differences(out: &mut String, diffs: Vec<(Difference, String)>, used: &mut BTreeSet<Difference>) {
    if !diffs.is_empty() {
        let _ = writeln!(out, "    differs:");
        for (diff, detail) in diffs {
            let _ = writeln!(out, "      {} {detail}", diff.tag());
            used.insert(diff);
        }
    }
}

/// Explains an `unlimited` rule: its schema and what it does in both.
fn explain_unlimited(out: &mut String, spec: &DescriptorSpec, diffs: &mut Vec<(Difference, String)>) {
    let rl = spec.rate_limit.as_ref();
    let _ = writeln!(out, "    schema:   {}", schema(spec));
    let _ = writeln!(out, "    both:     unlimited: never limited, no counter or bucket");
    let replaces = spec
        .replaces
        .iter()
        .chain(rl.and_then(|r| r.replaces.as_ref()))
        .flatten();
    let names: Vec<&str> = replaces.map(|r| r.name.as_str()).collect();
    let detail = if names.is_empty() {
        "never limited in either".to_owned()
    } else {
        format!(
            "never limited in either; its `replaces` of {} applies in both",
            names.join(", ")
        )
    };
    diffs.push((Difference::Unlimited, detail));
}

/// The rule's schema and bucket `b`, and how many rules share its name.
fn explain_bucket(out: &mut String, d: &Domain, spec: &DescriptorSpec, b: &BucketPolicy, steps: &[Step]) {
    let _ = writeln!(out, "    schema:   {}", schema(spec));
    let _ = writeln!(out, "    bucket:   `{}`, {}", b.name, instances(steps));
    let same_name = d.buckets.iter().filter(|o| o.name == b.name).count();
    let rules_on_it = d
        .nodes
        .iter()
        .filter(|n| matches!(&n.rule, Some(Rule::Limited { buckets, .. }) if buckets.iter().any(|o| d.buckets[*o].name == b.name)))
        .count();
    if rules_on_it > 1 {
        let _ = writeln!(
            out,
            "              the name is on {rules_on_it} rules ({same_name} limit{}); instances stay apart, as each \
             rule's descriptors differ",
            if same_name == 1 { "" } else { "s" }
        );
    }
}

/// The rule's envoyproxy/ratelimit limit, when it has one that limits: its unit, the unit's
/// length in microseconds, and `requests_per_unit`.
fn envoy_limit(spec: &DescriptorSpec) -> Option<(Unit, u64, u64)> {
    spec.rate_limit.as_ref().filter(|r| !r.unlimited).and_then(|r| {
        let unit_text = r.unit.as_deref()?;
        let (unit, _, unit_us) = ENVOY_UNITS
            .iter()
            .find(|(_, name, _)| name.eq_ignore_ascii_case(unit_text))
            .copied()?;
        Some((unit, unit_us, r.requests_per_unit.unwrap_or(0)))
    })
}

/// The limit in theirs and in tollgate: `envoy`'s (from [`envoy_limit`]), else the plan of
/// `b`'s, as declared.
fn explain_limit(
    out: &mut String,
    envoy: Option<(Unit, u64, u64)>,
    b: &BucketPolicy,
    diffs: &mut Vec<(Difference, String)>,
) {
    match (envoy, b.plan.current()) {
        (Some((unit, _, 0)), _) => {
            let unit = unit.as_str_name();
            let _ = writeln!(
                out,
                "    theirs:   0 per {unit}: every request over the limit, hits still counted"
            );
            let _ = writeln!(
                out,
                "    tollgate: denies every request, consumes nothing (reported as 0 per {unit})"
            );
            diffs.push((Difference::Zero, "requests_per_unit is 0".to_owned()));
        }
        (Some((unit, unit_us, rpu)), plan) => explain_envoy_rate(out, unit, unit_us, rpu, plan, diffs),
        (None, Plan::Fixed(limit)) => {
            let _ = writeln!(out, "    tollgate: {}", limit_text(&b.shown(*limit)));
        }
        (None, Plan::Expiring(e)) => {
            let _ = writeln!(out, "    tollgate: {}", expiring_text(e));
        }
        (None, Plan::Scheduled(s)) => {
            let _ = writeln!(
                out,
                "    tollgate: base {}, changed by {} schedule window(s) (see `tollgate check`)",
                limit_text(&b.shown(*s.base())),
                s.entries().len()
            );
        }
        (None, Plan::Quota(q)) => {
            let _ = writeln!(
                out,
                "    tollgate: quota of {} tokens, reset at `{}` ({}), no refill in between",
                q.allowance_ut() / MICRO,
                q.pattern(),
                q.timezone()
            );
        }
        // `current()` is the compiled plan, never one a reload built.
        (None, Plan::Reloaded(_)) => {}
    }
}

/// An envoyproxy/ratelimit limit of `rpu` (not 0) per `unit`: their fixed window against
/// tollgate's token bucket.
fn explain_envoy_rate(
    out: &mut String,
    unit: Unit,
    unit_us: u64,
    rpu: u64,
    plan: &Plan,
    diffs: &mut Vec<(Difference, String)>,
) {
    let name = unit.as_str_name();
    let _ = writeln!(
        out,
        "    theirs:   up to {rpu} hit{} per fixed window {}; every hit counted, admitted or not",
        if rpu == 1 { "" } else { "s" },
        their_window(unit, unit_us)
    );
    let _ = writeln!(
        out,
        "    tollgate: token bucket, capacity {rpu}, refill {rpu} per {} (one token every {}), reported as \
         {rpu} per {name}",
        seconds(unit_us),
        seconds(unit_us / rpu)
    );
    if let Plan::Scheduled(s) = plan {
        let _ = writeln!(
            out,
            "              changed by {} schedule window(s) (see `tollgate check`)",
            s.entries().len()
        );
    }
    diffs.push((
        Difference::TokenBucket,
        format!(
            "after the first {rpu}, one token every {} instead of {rpu} at the next edge",
            seconds(unit_us / rpu)
        ),
    ));
    diffs.push((
        Difference::WindowEdge,
        format!(
            "theirs: up to {} within a moment across an edge; tollgate: at most {rpu} plus one per {}",
            rpu.saturating_mul(2),
            seconds(unit_us / rpu)
        ),
    ));
    diffs.push((Difference::DeniedHits, "a denied request charges nothing".to_owned()));
    if let Some(diff) = epoch_window(unit, rpu) {
        diffs.push(diff);
    }
}

/// Where their window of `unit` is not what its name says (`rpu` per `unit`).
fn epoch_window(unit: Unit, rpu: u64) -> Option<(Difference, String)> {
    let name = unit.as_str_name();
    let calendar = match unit {
        Unit::Week => Some(("not a calendar week", "0 0 * * MON")),
        Unit::Month => Some(("not a calendar month", "0 0 1 * *")),
        Unit::Year => Some(("not a calendar year", "0 0 1 1 *")),
        _ => None,
    };
    if let Some((what, cron)) = calendar {
        Some((
            Difference::EpochWindow,
            format!("their {name} is {what}; for one use `quota: {{limit: {rpu}, reset: \"{cron}\"}}`"),
        ))
    } else if unit == Unit::Day {
        Some((
            Difference::EpochWindow,
            "their DAY starts at 00:00 UTC; tollgate refills through the day".to_owned(),
        ))
    } else {
        None
    }
}

/// The quota `q` a rule's request must also pass.
fn explain_quota(out: &mut String, q: &BucketPolicy) {
    if let Plan::Quota(quota) = &q.plan {
        let _ = writeln!(
            out,
            "              and quota `{}`: {} tokens, reset at `{}` ({}); a request must pass both",
            q.name,
            quota.allowance_ut() / MICRO,
            quota.pattern(),
            quota.timezone()
        );
    }
}

/// The rule's limit as the file writes it.
fn schema(spec: &DescriptorSpec) -> String {
    if let Some(r) = &spec.rate_limit {
        if r.unlimited {
            return "envoyproxy/ratelimit, rate_limit {unlimited: true}".to_owned();
        }
        let mut s = format!(
            "envoyproxy/ratelimit, rate_limit {{unit: {}, requests_per_unit: {}",
            r.unit.as_deref().unwrap_or("(none)"),
            r.requests_per_unit.map_or("(missing)".to_owned(), |n| n.to_string())
        );
        // `name: ""` is no name (as Envoy Gateway writes it out).
        if let Some(name) = r.name.as_deref().filter(|n| !n.is_empty()) {
            let _ = write!(s, ", name: {name}");
        }
        s.push('}');
        return s;
    }
    if spec.unlimited {
        return "tollgate, unlimited: true".to_owned();
    }
    match (&spec.bucket, &spec.token_bucket, &spec.quota) {
        (Some(name), _, _) => format!("tollgate, bucket: {name}"),
        (None, Some(_), _) => "tollgate, token_bucket".to_owned(),
        (None, None, Some(_)) => "tollgate, quota".to_owned(),
        _ => "tollgate".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::render;
    use crate::rules::file::load_rules;
    use crate::rules::RuleSet;

    fn rules(yaml: &str) -> RuleSet {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.yaml");
        std::fs::write(&file, yaml).unwrap();
        load_rules(&file).unwrap_or_else(|e| panic!("rules should load: {e}"))
    }

    /// Their windows start at multiples of the unit since the Unix epoch: day 20790
    /// (2026-12-03) is 693 x 30 days, and 57 x 365 days is day 20805 (2026-12-18).
    #[test]
    fn their_windows_are_counted_from_the_epoch() {
        use super::{seconds, their_window, Unit};
        let unit_us = |u: Unit| crate::core::units::envoy_unit_us(u).unwrap();
        assert_eq!(
            their_window(Unit::Month, unit_us(Unit::Month)),
            "of 30 days counted from the Unix epoch (the one holding 2027-01-01 runs from 2026-12-03 to 2027-01-02)"
        );
        assert_eq!(
            their_window(Unit::Year, unit_us(Unit::Year)),
            "of 365 days counted from the Unix epoch (the one holding 2027-01-01 runs from 2026-12-18 to 2027-12-18)"
        );
        assert_eq!(
            their_window(Unit::Week, unit_us(Unit::Week)),
            "of 604800s starting on Thursdays at 00:00 UTC"
        );
        assert_eq!(seconds(250_000), "0.25s");
        assert_eq!(seconds(86_400_000_000), "86400s");
        assert_eq!(seconds(1), "0.000001s");
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
