//! `tollgate check`: the compiled rules as an operator reads them.

use std::fmt::Write;

use crate::bucket::Limit;
use crate::rules::{BucketPolicy, Domain, Level, Rule, RuleSet};

/// Renders every domain of `rules`: its bucket policies, then its descriptor tree with the
/// rule on each node, then the notes (accepted fields without effect and the like).
pub fn render(rules: &RuleSet) -> String {
    let mut out = String::new();
    let mut names: Vec<&String> = rules.domains.keys().collect();
    names.sort();
    for name in names {
        render_domain(&mut out, &rules.domains[name]);
    }
    out
}

fn render_domain(out: &mut String, d: &Domain) {
    let _ = writeln!(out, "domain {} ({})", d.name, d.file.display());
    let _ = writeln!(out, "  buckets:");
    for b in &d.buckets {
        let _ = writeln!(out, "    {}: {}", b.name, describe(b));
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
    // Print in matching order: exact values, then wildcards in config order, then defaults.
    let mut exact: Vec<usize> = level.exact.values().flat_map(|v| v.values().copied()).collect();
    exact.sort_by(|a, b| d.nodes[*a].path.cmp(&d.nodes[*b].path));
    let wildcard = level.wildcard.iter().map(|(_, _, n)| *n);
    let mut any: Vec<usize> = level.any.values().copied().collect();
    any.sort_by(|a, b| d.nodes[*a].path.cmp(&d.nodes[*b].path));
    for id in exact.into_iter().chain(wildcard).chain(any) {
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
                shadow,
                replaces,
            }) => {
                let mut s = format!("-> bucket {}", d.buckets[*bucket].name);
                if *shadow {
                    s.push_str(" [shadow]");
                }
                if !replaces.is_empty() {
                    // Several buckets may carry one envoyproxy/ratelimit name: show each name once.
                    let mut names: Vec<&str> = Vec::new();
                    for name in replaces.iter().map(|r| d.buckets[*r].name.as_str()) {
                        if !names.contains(&name) {
                            names.push(name);
                        }
                    }
                    let _ = write!(s, " [replaces {}]", names.join(", "));
                }
                s
            }
        };
        let _ = writeln!(out, "{:indent$}{step}  {rule}", "", indent = depth * 2);
        render_level(out, d, &node.children, depth + 1, &node.path);
    }
}

fn describe(b: &BucketPolicy) -> String {
    let Limit { rate, .. } = b.limit;
    let reported = format!(
        "reported as {} per {}",
        b.reported.requests_per_unit,
        b.reported.unit.as_str_name().to_lowercase()
    );
    if rate.is_zero() {
        return format!("denies every request ({reported})");
    }
    let fill = b.limit.time_to_fill_us().unwrap_or(0);
    let per_second = rate.num() as f64 / rate.den() as f64;
    format!(
        "capacity {}, refill {per_second:.6} tokens/s, full from empty in {:.3}s ({reported})",
        b.limit.capacity(),
        fill as f64 / 1e6
    )
}
