//! Descriptor matching (docs/rules.md), through rules loaded from YAML.

use std::io::Write;

use super::*;
use crate::rules::file::load_rules;
use crate::rules::RuleSet;

/// The rule set of `yaml`, loaded from a file as the server loads it.
pub(crate) fn load(yaml: &str) -> RuleSet {
    let mut file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    file.write_all(yaml.as_bytes()).unwrap();
    load_rules(file.path()).unwrap_or_else(|e| panic!("rules should load: {e}"))
}

/// A descriptor's entries from `(key, value)` pairs.
pub(crate) fn entries(pairs: &[(&str, &str)]) -> Vec<Entry> {
    pairs
        .iter()
        .map(|(k, v)| Entry {
            key: (*k).to_owned(),
            value: (*v).to_owned(),
        })
        .collect()
}

/// What a request descriptor matches in domain `d`: the bucket name, `unlimited`, or `None`.
fn matched(set: &RuleSet, pairs: &[(&str, &str)]) -> Option<String> {
    let domain = set.domain("d").expect("domain d");
    find_rule(domain, &entries(pairs)).map(|rule| match rule {
        Rule::Unlimited { .. } => "unlimited".to_owned(),
        Rule::Limited { buckets, .. } => domain.buckets[buckets[0]].name.clone(),
    })
}

fn key(domain: &str, bucket: &str, pairs: &[(&str, &str)]) -> String {
    let mut out = String::new();
    instance_key(&mut out, domain, bucket, &entries(pairs), &[]);
    out
}

const TB: &str = "token_bucket: {capacity: 1, refill: 1/s}";

/// A node line with an inline limit named `name`.
fn limited(indent: usize, key: &str, value: Option<&str>, name: &str) -> String {
    let pad = " ".repeat(indent);
    let value = value.map_or(String::new(), |v| format!("{pad}  value: \"{v}\"\n"));
    format!("{pad}- key: {key}\n{value}{pad}  name: {name}\n{pad}  {TB}\n")
}

#[test]
fn exact_before_wildcard_before_default_whatever_the_config_order() {
    // Declared in the reverse of matching order.
    let yaml = format!(
        "domain: d\ndescriptors:\n{}{}{}",
        limited(2, "path", None, "default"),
        limited(2, "path", Some("/api/*"), "wildcard"),
        limited(2, "path", Some("/api/v1"), "exact"),
    );
    let set = load(&yaml);
    assert_eq!(matched(&set, &[("path", "/api/v1")]).as_deref(), Some("exact"));
    assert_eq!(matched(&set, &[("path", "/api/v2")]).as_deref(), Some("wildcard"));
    assert_eq!(matched(&set, &[("path", "/api/")]).as_deref(), Some("wildcard"));
    assert_eq!(matched(&set, &[("path", "/other")]).as_deref(), Some("default"));
    assert_eq!(matched(&set, &[("path", "")]).as_deref(), Some("default"));
    // Keys and values are case-sensitive; another key matches nothing.
    assert_eq!(matched(&set, &[("path", "/API/v1")]).as_deref(), Some("default"));
    assert_eq!(matched(&set, &[("Path", "/api/v1")]), None);
    assert_eq!(matched(&set, &[("host", "/api/v1")]), None);
    // An exact value of another key does not match.
    let yaml = format!(
        "domain: d\ndescriptors:\n{}{}",
        limited(2, "a", Some("x"), "a_x"),
        limited(2, "b", None, "b_any"),
    );
    let set = load(&yaml);
    assert_eq!(matched(&set, &[("b", "x")]).as_deref(), Some("b_any"));
    assert_eq!(matched(&set, &[("a", "y")]), None);
}

#[test]
fn wildcard_patterns() {
    let yaml = format!(
        "domain: d\ndescriptors:\n{}{}{}{}{}",
        limited(2, "prefix", Some("/static/*"), "prefix"),
        limited(2, "suffix", Some("*.png"), "suffix"),
        limited(2, "middle", Some("/v1/*/items"), "middle"),
        limited(2, "several", Some("a*b*c*"), "several"),
        limited(2, "star", Some("*"), "star"),
    );
    let set = load(&yaml);
    let cases: &[(&str, &str, bool)] = &[
        ("prefix", "/static/", true),
        ("prefix", "/static/css/site.css", true),
        ("prefix", "/static", false),
        ("prefix", "x/static/a", false),
        ("suffix", ".png", true),
        ("suffix", "logo.png", true),
        ("suffix", "a/b.png", true),
        ("suffix", "logo.png.gz", false),
        ("suffix", "logo.PNG", false),
        ("middle", "/v1/x/items", true),
        ("middle", "/v1//items", true),
        ("middle", "/v1/a/b/items", true),
        ("middle", "/v1/x/items/y", false),
        ("middle", "/v2/x/items", false),
        ("middle", "/v1/items", false),
        ("several", "abc", true),
        ("several", "aXbYcZ", true),
        ("several", "a-c-b-c", true),
        ("several", "acb", false),
        ("several", "bac", false),
        ("star", "", true),
        ("star", "anything at all", true),
    ];
    for (key, value, hit) in cases {
        let got = matched(&set, &[(key, value)]);
        assert_eq!(got.is_some(), *hit, "{key}={value:?} matched {got:?}");
        if *hit {
            assert_eq!(got.as_deref(), Some(*key));
        }
    }
}

#[test]
fn the_longest_literal_prefix_wins_then_config_order() {
    // `a*` has the longer literal prefix (`a` against nothing): it wins for `az`, whichever the
    // file lists first.
    for (first, second) in [("a*", "*z"), ("*z", "a*")] {
        let yaml = format!(
            "domain: d\ndescriptors:\n{}{}",
            limited(2, "k", Some(first), if first == "a*" { "starts_a" } else { "ends_z" }),
            limited(2, "k", Some(second), if second == "a*" { "starts_a" } else { "ends_z" }),
        );
        let set = load(&yaml);
        assert_eq!(
            matched(&set, &[("k", "az")]).as_deref(),
            Some("starts_a"),
            "{first} first"
        );
        assert_eq!(matched(&set, &[("k", "bz")]).as_deref(), Some("ends_z"));
        assert_eq!(matched(&set, &[("k", "ab")]).as_deref(), Some("starts_a"));
    }
    // The shorter prefix listed first no longer hides the longer one; the same prefix twice
    // (`/api/*.json` and `/api/*`) goes by config order.
    let yaml = format!(
        "domain: d\ndescriptors:\n{}{}{}{}",
        limited(2, "path", Some("/api/*.json"), "api_json"),
        limited(2, "path", Some("/api/*"), "api"),
        limited(2, "path", Some("/api/v1/*"), "api_v1"),
        limited(2, "path", Some("/api/v1/users"), "exact"),
    );
    let set = load(&yaml);
    assert_eq!(matched(&set, &[("path", "/api/v1/users")]).as_deref(), Some("exact"));
    assert_eq!(
        matched(&set, &[("path", "/api/v1/orders.json")]).as_deref(),
        Some("api_v1")
    );
    assert_eq!(
        matched(&set, &[("path", "/api/v2/orders.json")]).as_deref(),
        Some("api_json")
    );
    assert_eq!(matched(&set, &[("path", "/api/v2/orders")]).as_deref(), Some("api"));
}

#[test]
fn the_limit_applies_only_at_the_last_entry() {
    let yaml = "domain: d
descriptors:
  - key: k1
    value: v1
    name: outer
    token_bucket: {capacity: 1, refill: 1/s}
    descriptors:
      - key: k2
        value: v2
        name: inner
        token_bucket: {capacity: 1, refill: 1/s}
  - key: tenant
    descriptors:
      - key: user
        name: per_user
        token_bucket: {capacity: 1, refill: 1/s}
";
    let set = load(yaml);
    assert_eq!(matched(&set, &[("k1", "v1")]).as_deref(), Some("outer"));
    assert_eq!(matched(&set, &[("k1", "v1"), ("k2", "v2")]).as_deref(), Some("inner"));
    // Deeper than the leaf: no limit, not the leaf's nor the parent's.
    assert_eq!(matched(&set, &[("k1", "v1"), ("k2", "v2"), ("k3", "v3")]), None);
    // The second entry matches nothing below k1=v1: no limit, not the parent's.
    assert_eq!(matched(&set, &[("k1", "v1"), ("k2", "other")]), None);
    assert_eq!(matched(&set, &[("k1", "v1"), ("k1", "v1")]), None);
    // Entries are matched in order, one per level.
    assert_eq!(matched(&set, &[("k2", "v2"), ("k1", "v1")]), None);
    // Shorter than the path, ending on a node without a limit.
    assert_eq!(matched(&set, &[("tenant", "acme")]), None);
    assert_eq!(
        matched(&set, &[("tenant", "acme"), ("user", "bob")]).as_deref(),
        Some("per_user")
    );
    assert_eq!(matched(&set, &[]), None);
}

#[test]
fn matching_does_not_backtrack() {
    let yaml = "domain: d
descriptors:
  - key: k
    value: v
    descriptors:
      - key: c
        value: '1'
        name: exact_branch
        token_bucket: {capacity: 1, refill: 1/s}
  - key: k
    value: v*
    descriptors:
      - key: c
        name: first_wildcard_branch
        token_bucket: {capacity: 1, refill: 1/s}
  - key: k
    value: '*x'
    descriptors:
      - key: c
        name: second_wildcard_branch
        token_bucket: {capacity: 1, refill: 1/s}
  - key: k
    descriptors:
      - key: c
        name: default_branch
        token_bucket: {capacity: 1, refill: 1/s}
";
    let set = load(yaml);
    assert_eq!(
        matched(&set, &[("k", "v"), ("c", "1")]).as_deref(),
        Some("exact_branch")
    );
    // The exact branch dead-ends: neither the wildcard nor the default sibling applies.
    assert_eq!(matched(&set, &[("k", "v"), ("c", "2")]), None);
    // One matching wildcard is walked (`v*`, the longer literal prefix), even when the other
    // would apply below.
    assert_eq!(
        matched(&set, &[("k", "vx"), ("c", "2")]).as_deref(),
        Some("first_wildcard_branch")
    );
    assert_eq!(
        matched(&set, &[("k", "wx"), ("c", "2")]).as_deref(),
        Some("second_wildcard_branch")
    );
    assert_eq!(
        matched(&set, &[("k", "w"), ("c", "2")]).as_deref(),
        Some("default_branch")
    );
    // The wildcard branch dead-ends (no `d` below it): the default is not tried.
    assert_eq!(matched(&set, &[("k", "vx"), ("d", "2")]), None);
}

#[test]
fn unlimited_and_no_limit_nodes() {
    let yaml = "domain: d
descriptors:
  - key: path
    value: /static/*
    unlimited: true
  - key: path
    value: /health
  - key: envoy
    rate_limit: {unlimited: true}
";
    let set = load(yaml);
    assert_eq!(matched(&set, &[("path", "/static/a")]).as_deref(), Some("unlimited"));
    assert_eq!(matched(&set, &[("envoy", "x")]).as_deref(), Some("unlimited"));
    assert_eq!(matched(&set, &[("path", "/health")]), None);
}

#[test]
fn default_bucket_names_are_node_paths() {
    let yaml = "domain: d
descriptors:
  - key: api_key
    descriptors:
      - key: path
        value: /upload
        rate_limit: {unit: minute, requests_per_unit: 5}
      - key: path
        value: '*.png'
        token_bucket: {capacity: 5, refill: 5/s}
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 5}
";
    let set = load(yaml);
    assert_eq!(
        matched(&set, &[("api_key", "k"), ("path", "/upload")]).as_deref(),
        Some("api_key.path=/upload")
    );
    assert_eq!(
        matched(&set, &[("api_key", "k"), ("path", "a.png")]).as_deref(),
        Some("api_key.path=*.png")
    );
    assert_eq!(
        matched(&set, &[("remote_address", "10.0.0.1")]).as_deref(),
        Some("remote_address")
    );
}

#[test]
fn instances_differ_per_value_of_a_key_only_node() {
    let set = load(&format!(
        "domain: d\ndescriptors:\n{}",
        limited(2, "api_key", None, "per_key")
    ));
    let domain = set.domain("d").unwrap();
    let a = entries(&[("api_key", "alice")]);
    let b = entries(&[("api_key", "bob")]);
    // One rule, two instances.
    assert_eq!(find_rule(domain, &a), find_rule(domain, &b));
    assert!(find_rule(domain, &a).is_some());
    assert_ne!(
        key("d", "per_key", &[("api_key", "alice")]),
        key("d", "per_key", &[("api_key", "bob")])
    );
    // Identical entries, domain and bucket: one instance.
    assert_eq!(
        key("d", "per_key", &[("api_key", "alice")]),
        key("d", "per_key", &[("api_key", "alice")])
    );
    // Another bucket or domain with the same entries: another instance.
    assert_ne!(
        key("d", "per_key", &[("api_key", "alice")]),
        key("d", "other", &[("api_key", "alice")])
    );
    assert_ne!(
        key("d", "per_key", &[("api_key", "alice")]),
        key("e", "per_key", &[("api_key", "alice")])
    );
    // Appending to an existing key builds the same identity after the prefix.
    let mut out = String::from("prefix|");
    instance_key(&mut out, "d", "per_key", &a, &[]);
    assert_eq!(out, format!("prefix|{}", key("d", "per_key", &[("api_key", "alice")])));
}

#[test]
fn instance_keys_cannot_collide_through_separators_or_digits() {
    type Variant<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>);
    let variants: Vec<Variant<'_>> = vec![
        ("d", "b", vec![("a", "1:b")]),
        ("d", "b", vec![("a", "1"), ("b", "")]),
        ("d", "b", vec![("a", "1:b"), ("", "")]),
        ("d", "b", vec![("a", "11:b")]),
        ("d", "b", vec![("a1", ":b")]),
        ("d", "b", vec![("a1:", "b")]),
        ("d", "b", vec![("a", ""), ("b", "")]),
        ("d", "b", vec![("a", "1:b0:")]),
        ("d", "b", vec![("a", "0:"), ("", "b")]),
        ("d", "b", vec![("a=1", "b")]),
        ("d", "b", vec![("a", "1=b")]),
        ("d", "b", vec![]),
        ("d", "b1:a", vec![]),
        ("d", "b1:a1:", vec![]),
        ("d1:b", "", vec![]),
        ("d", "b", vec![("", "")]),
        ("d", "b", vec![("", ""), ("", "")]),
        ("d", "b1", vec![(":a", "1:b")]),
        ("d1", ":b", vec![("a", "1:b")]),
    ];
    let keys: Vec<String> = variants.iter().map(|(d, b, e)| key(d, b, e)).collect();
    for i in 0..keys.len() {
        for j in i + 1..keys.len() {
            assert_ne!(
                keys[i], keys[j],
                "{:?} and {:?} share an instance key",
                variants[i], variants[j]
            );
        }
    }
}

/// YAML scalars that look like numbers or booleans are matched as the text written, as
/// envoyproxy/ratelimit (Go YAML into a string field) reads them.
#[test]
fn values_are_matched_as_written() {
    let yaml = "domain: d
descriptors:
  - key: status
    value: 404
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: ratio
    value: 1.50
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: flag
    value: true
    rate_limit: {unit: second, requests_per_unit: 1}
";
    let set = load(yaml);
    assert_eq!(matched(&set, &[("status", "404")]).as_deref(), Some("status=404"));
    assert_eq!(matched(&set, &[("ratio", "1.50")]).as_deref(), Some("ratio=1.50"));
    assert_eq!(matched(&set, &[("ratio", "1.5")]), None);
    assert_eq!(matched(&set, &[("flag", "true")]).as_deref(), Some("flag=true"));
}
