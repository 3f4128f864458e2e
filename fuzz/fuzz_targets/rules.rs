//! The rules loader and compiler (both schemas, node by node) on arbitrary bytes as one rules
//! file. Either a clear error or a rule set that keeps the compiler's promises: every index
//! in range, every bucket name printable ASCII, every limit within the load-time bounds that
//! keep the arithmetic exact, every exact rule reachable by the descriptor that spells it, and
//! `tollgate check`'s rendering of it does not panic.
#![no_main]

use std::path::Path;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use libfuzzer_sys::fuzz_target;
use tollgate::core::bucket::{Limit, EXACT_LIMIT, MAX_CAPACITY, MICRO};
use tollgate::rules::load_rules_text;
use tollgate::rules::find_node;
use tollgate::rules::{Domain, Level, Rule, RuleSet};

/// 2026-03-29 00:30 UTC: a Sunday, an hour before Europe's clocks move on, so schedules and
/// quotas are rendered across a DST change.
const NOW_US: u64 = 1_774_744_200_000_000;

fn check_limit(what: &str, limit: &Limit) {
    assert!(
        limit.capacity_ut <= MAX_CAPACITY * MICRO,
        "{what}: capacity {} µt",
        limit.capacity_ut
    );
    let (num, den) = (u128::from(limit.rate.num()), u128::from(limit.rate.den()));
    assert!(den > 0, "{what}: a rate over 0 µs");
    assert!(
        num * den < u128::from(EXACT_LIMIT),
        "{what}: rate {num}/{den} is not exact in doubles"
    );
}

fn check_level(dom: &Domain, level: &Level, parent: Option<usize>, path: &mut Vec<Entry>) {
    let n = dom.nodes.len();
    for (key, values) in &level.exact {
        for (value, &node) in values {
            assert!(node < n, "{}: node {node} of {n}", dom.name);
            assert_eq!(
                dom.nodes[node].parent, parent,
                "{}: parent of {}",
                dom.name, dom.nodes[node].path
            );
            path.push(Entry {
                key: key.clone(),
                value: value.to_string(),
            });
            // Exact values take precedence at every level: the entries that spell an exact
            // path reach its node.
            if dom.nodes[node].rule.is_some() {
                let found = find_node(dom, path);
                assert_eq!(
                    found,
                    Some(node),
                    "{}: {:?} does not reach {}",
                    dom.name,
                    path,
                    dom.nodes[node].path
                );
            }
            check_level(dom, &dom.nodes[node].children, Some(node), path);
            path.pop();
        }
    }
    for (_, _, node) in &level.wildcard {
        assert!(*node < n, "{}: node {node} of {n}", dom.name);
    }
    for node in level.any.values() {
        assert!(*node < n, "{}: node {node} of {n}", dom.name);
    }
}

fn check_set(set: &RuleSet) {
    for (name, dom) in &set.domains {
        assert_eq!(name, &dom.name);
        assert!(!name.is_empty(), "an empty domain name");
        let buckets = dom.buckets.len();
        for b in &dom.buckets {
            assert!(
                !b.name.is_empty() && b.name.bytes().all(|c| (0x20..=0x7e).contains(&c)),
                "{name}: bucket name {:?} is shown in headers",
                b.name
            );
            check_limit(&b.name, &b.plan.base());
            check_limit(&b.name, &b.plan.limit_at(NOW_US));
        }
        for node in &dom.nodes {
            if let Some(parent) = node.parent {
                assert!(parent < dom.nodes.len(), "{name}: parent {parent}");
            }
            match &node.rule {
                Some(Rule::Limited {
                    buckets: rule_buckets,
                    replaces,
                    ..
                }) => {
                    assert!(!rule_buckets.is_empty(), "{}: a limited rule without buckets", node.path);
                    for bucket in rule_buckets {
                        assert!(*bucket < buckets, "{}: bucket {bucket} of {buckets}", node.path);
                    }
                    assert!(
                        replaces.iter().all(|r| *r < buckets),
                        "{}: replaces {replaces:?}",
                        node.path
                    );
                }
                Some(Rule::Unlimited { replaces }) => {
                    assert!(
                        replaces.iter().all(|r| *r < buckets),
                        "{}: replaces {replaces:?}",
                        node.path
                    );
                }
                None => {}
            }
        }
        check_level(dom, &dom.root, None, &mut Vec::new());
    }
}

fuzz_target!(|data: &[u8]| {
    // Files are read as UTF-8 text (`read_to_string`): other bytes never reach the parser.
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(set) = load_rules_text(Path::new("fuzz.yaml"), text) {
        check_set(&set);
        let _ = tollgate::server::check::render(&set, NOW_US);
    }
});
