//! The two paths into the rules, a `RateLimitConfig` pushed over xDS and the rules file of the
//! same content, give the same rule set: compared whole, every part of each domain but the
//! name of where it came from.

use std::collections::BTreeMap;
use std::path::Path;

use envoy_types::pb::google::protobuf::{ListValue, Struct};
use envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitReplace;

use super::*;
use crate::rules::{Domain, Level};

fn node(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        ..Default::default()
    }
}

fn limited(key: &str, value: &str, unit: RateLimitUnit, requests_per_unit: u32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        rate_limit: Some(RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit,
            ..Default::default()
        }),
        ..node(key, value)
    }
}

fn with(mut parent: RateLimitDescriptor, children: Vec<RateLimitDescriptor>) -> RateLimitDescriptor {
    parent.descriptors = children;
    parent
}

fn config(name: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitConfig {
    RateLimitConfig {
        name: name.into(),
        domain: name.into(),
        descriptors,
    }
}

fn any(config: &RateLimitConfig) -> Any {
    Any {
        type_url: TYPE_URL.into(),
        value: config.encode_to_vec(),
    }
}

/// A level with its maps in order.
fn level(l: &Level) -> String {
    let exact: BTreeMap<&String, BTreeMap<String, usize>> = l
        .exact
        .iter()
        .map(|(k, values)| (k, values.iter().map(|(v, n)| (v.to_string(), *n)).collect()))
        .collect();
    let wildcard: Vec<(&String, String, usize)> = l.wildcard.iter().map(|(k, p, n)| (k, p.text(), *n)).collect();
    let any: BTreeMap<&String, &usize> = l.any.iter().collect();
    format!("exact {exact:?} wildcard {wildcard:?} any {any:?}")
}

/// Everything of a compiled domain but its `file`, in a form that compares (maps in order).
fn canonical(d: &Domain) -> String {
    let mut out = format!("domain {}\nbuckets {:?}\nroot {}\n", d.name, d.buckets, level(&d.root));
    for (i, n) in d.nodes.iter().enumerate() {
        let metadata = n.metadata.as_ref().map(mapping);
        out += &format!(
            "node {i} {:?} rule {:?} parent {:?} shared {:?} detailed {} metadata {:?}\n  children {}\n",
            n.path,
            n.rule,
            n.parent,
            n.shared_pattern,
            n.detailed_metric,
            metadata,
            level(&n.children)
        );
    }
    out + &format!("has_shared {} notes {:?}", d.has_shared, d.notes)
}

fn from_yaml(text: &str) -> RuleSet {
    crate::rules::load_rules_text(Path::new("rules.yaml"), text).unwrap_or_else(|e| panic!("YAML: {e}"))
}

fn from_xds(configs: &[RateLimitConfig]) -> RuleSet {
    compile_resources(&configs.iter().map(any).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("xDS: {e}"))
}

/// What Envoy Gateway pushes for one listener and one shared policy, and the same rules in the
/// YAML it writes for them (its translator's dump: every field written out, `rate_limit: null`,
/// `name: ""`, `replaces: []`, the metric flags `false`).
#[test]
fn envoy_gateway_snapshots_compile_as_their_yaml() {
    let route = "httproute/default/backend/rule/0/match/0/*";
    let shadow = |mut d: RateLimitDescriptor| {
        d.shadow_mode = true;
        d
    };
    let listener = config(
        "envoy-gateway/gateway-1/http",
        vec![with(
            node(route, route),
            vec![
                // A distinct header: key only (an empty value), one bucket per value.
                limited("rule-0-match-0", "", RateLimitUnit::Minute, 3),
                // A header value match, then a CIDR whose addresses each get a bucket.
                with(
                    node("rule-1-match-0", "rule-1-match-0"),
                    vec![with(
                        node("masked_remote_address", "192.168.0.0/16"),
                        vec![limited("remote_address", "", RateLimitUnit::Second, 5)],
                    )],
                ),
                // No match: all traffic, in shadow mode.
                shadow(limited("rule-2-match--1", "rule-2-match--1", RateLimitUnit::Hour, 1000)),
            ],
        )],
    );
    let shared = config(
        "default/shared-policy",
        vec![with(
            node("default/shared-policy/rule/0", "default/shared-policy/rule/0"),
            vec![limited("rule-0-match-0", "rule-0-match-0", RateLimitUnit::Day, 10_000)],
        )],
    );
    let rest = "    shadow_mode: false\n    quota_mode: false\n    detailed_metric: false\n    value_to_metric: false\n    share_threshold: false";
    let limit = |unit: &str, n: u32| {
        format!("\n      requests_per_unit: {n}\n      unit: {unit}\n      unlimited: false\n      name: \"\"\n      replaces: []")
    };
    let indent = |text: &str, by: usize| {
        text.lines()
            .map(|l| format!("{}{l}", " ".repeat(by)))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let leaf = |key: &str, value: &str, rate_limit: &str, shadow: bool, children: &str| {
        let rest = rest.replace("shadow_mode: false", &format!("shadow_mode: {shadow}"));
        format!(
            "  - key: {key}\n    value: \"{value}\"\n    rate_limit:{}\n    descriptors:{children}\n{rest}",
            indent(rate_limit, 0)
        )
    };
    let nest = |items: Vec<String>| format!("\n{}", indent(&items.join("\n"), 4));
    let remote = leaf("remote_address", "", &limit("SECOND", 5), false, " []");
    let masked = leaf(
        "masked_remote_address",
        "192.168.0.0/16",
        " null",
        false,
        &nest(vec![remote]),
    );
    let listener_yaml = format!(
        "name: envoy-gateway/gateway-1/http\ndomain: envoy-gateway/gateway-1/http\ndescriptors:\n{}",
        leaf(
            route,
            route,
            " null",
            false,
            &nest(vec![
                leaf("rule-0-match-0", "", &limit("MINUTE", 3), false, " []"),
                leaf("rule-1-match-0", "rule-1-match-0", " null", false, &nest(vec![masked])),
                leaf("rule-2-match--1", "rule-2-match--1", &limit("HOUR", 1000), true, " []"),
            ])
        )
    );
    // Their dump has a top-level `name`, which a rules file does not: the rest is the file.
    let listener_yaml = listener_yaml.split_once('\n').unwrap().1;
    let shared_yaml = format!(
        "domain: default/shared-policy\ndescriptors:\n{}",
        leaf(
            "default/shared-policy/rule/0",
            "default/shared-policy/rule/0",
            " null",
            false,
            &nest(vec![leaf(
                "rule-0-match-0",
                "rule-0-match-0",
                &limit("DAY", 10000),
                false,
                " []"
            )])
        )
    );

    let xds = from_xds(&[listener.clone(), shared.clone()]);
    assert_eq!(
        xds.files,
        [
            Path::new("xds:default/shared-policy"),
            Path::new("xds:envoy-gateway/gateway-1/http")
        ]
    );
    for (yaml, name) in [
        (listener_yaml, &listener.domain),
        (shared_yaml.as_str(), &shared.domain),
    ] {
        let files = from_yaml(yaml);
        let (a, b) = (&files.domains[name], &xds.domains[name]);
        assert_eq!(canonical(a), canonical(b), "{name}:\n{yaml}");
        assert_eq!(b.file, Path::new(&format!("xds:{name}")));
    }
    // The route's `*` (a wildcard host name) is a pattern, as in a file and in theirs; the
    // empty value is a key-only node.
    let d = &xds.domains["envoy-gateway/gateway-1/http"];
    assert_eq!(d.root.wildcard.len(), 1);
    assert!(d
        .nodes
        .iter()
        .any(|n| n.path.ends_with(".rule-0-match-0") && n.rule.is_some()));
}

/// Every field of the protos, against the rules file written by hand.
#[test]
fn every_field_maps_as_the_same_yaml() {
    let mut metadata = Struct::default();
    metadata.fields.insert(
        "tier".into(),
        Value {
            kind: Some(Kind::StringValue("gold".into())),
        },
    );
    metadata.fields.insert(
        "weight".into(),
        Value {
            kind: Some(Kind::NumberValue(2.5)),
        },
    );
    metadata.fields.insert(
        "tags".into(),
        Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![
                    Value {
                        kind: Some(Kind::BoolValue(true)),
                    },
                    Value {
                        kind: Some(Kind::NullValue(0)),
                    },
                ],
            })),
        },
    );
    let mut premium = limited("plan", "premium", RateLimitUnit::Minute, 100);
    premium.quota_mode = true;
    premium.detailed_metric = true;
    premium.metadata = Some(metadata);
    if let Some(p) = premium.rate_limit.as_mut() {
        p.name = "premium_plan".into();
        p.replaces = vec![RateLimitReplace {
            name: "per_user".into(),
        }];
    }
    let mut per_user = limited("user", "", RateLimitUnit::Week, 7);
    per_user.rate_limit.as_mut().unwrap().name = "per_user".into();
    let mut internal = node("user", "internal-*");
    internal.rate_limit = Some(RateLimitPolicy {
        unlimited: true,
        replaces: vec![RateLimitReplace {
            name: "per_user".into(),
        }],
        ..Default::default()
    });
    let blocked = limited("path", "/admin/*", RateLimitUnit::Year, 0);
    let monthly = limited("path", "/reports", RateLimitUnit::Month, 3);
    let xds = config(
        "shop",
        vec![
            with(node("plan", "basic"), vec![per_user.clone(), internal]),
            with(premium, vec![per_user, blocked, monthly]),
        ],
    );
    let yaml = r#"
domain: shop
descriptors:
  - key: plan
    value: basic
    descriptors:
      - key: user
        rate_limit: {unit: week, requests_per_unit: 7, name: per_user}
      - key: user
        value: internal-*
        rate_limit:
          unlimited: true
          replaces: [{name: per_user}]
  - key: plan
    value: premium
    quota_mode: true
    detailed_metric: true
    metadata: {tier: gold, weight: 2.5, tags: [true, null]}
    rate_limit:
      unit: minute
      requests_per_unit: 100
      name: premium_plan
      replaces: [{name: per_user}]
    descriptors:
      - key: user
        rate_limit: {unit: week, requests_per_unit: 7, name: per_user}
      - key: path
        value: /admin/*
        rate_limit: {unit: year, requests_per_unit: 0}
      - key: path
        value: /reports
        rate_limit: {unit: month, requests_per_unit: 3}
"#;
    let (a, b) = (from_yaml(yaml), from_xds(&[xds]));
    assert_eq!(canonical(&a.domains["shop"]), canonical(&b.domains["shop"]));
    let premium = b.domains["shop"]
        .nodes
        .iter()
        .find(|n| n.path == "plan=premium")
        .unwrap();
    assert!(premium.detailed_metric && premium.metadata.is_some());
    assert!(
        matches!(&premium.rule, Some(crate::rules::Rule::Limited { quota_mode: true, replaces, .. }) if replaces.len() == 1)
    );
}

/// A snapshot is compiled whole: any bad resource rejects it, every problem named by resource,
/// rule and reason.
#[test]
fn a_bad_resource_rejects_the_snapshot_naming_each_problem() {
    let good = config("a", vec![limited("k", "", RateLimitUnit::Second, 1)]);
    let no_unit = config("b", vec![limited("k", "v", RateLimitUnit::Unknown, 1)]);
    let odd_unit = config("c", vec![limited("k", "", RateLimitUnit::Second, 1)]);
    let mut odd_unit = odd_unit;
    odd_unit.descriptors[0].rate_limit.as_mut().unwrap().unit = 42;
    let mut twice = config("a-again", vec![]);
    twice.domain = "a".into();
    let mut resources: Vec<Any> = [good, no_unit, odd_unit, twice].iter().map(any).collect();
    resources.push(Any {
        type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
        value: vec![],
    });
    resources.push(Any {
        type_url: TYPE_URL.into(),
        value: vec![0xff, 0xff],
    });
    let errors = compile_resources(&resources).unwrap_err().to_string();
    for part in [
        "xds:b: rule `k=v`: `rate_limit` needs `unit`",
        "xds:c: rule `k`: unknown unit `42`",
        "xds:resource[4]: a type.googleapis.com/envoy.config.cluster.v3.Cluster resource, not a RateLimitConfig",
        "xds:resource[5]: not a RateLimitConfig",
    ] {
        assert!(errors.contains(part), "{part} missing from:\n{errors}");
    }
    // The one declared second (by name) is the one refused.
    assert!(
        errors.contains("xds:a-again: domain `a` is already declared in xds:a"),
        "{errors}"
    );
    // An empty snapshot is no rules at all, which the server may mean: nothing limited.
    assert!(compile_resources(&[]).unwrap().domains.is_empty());
}
