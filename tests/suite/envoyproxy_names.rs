//! envoyproxy/ratelimit's `rate_limit.name` is a label, not an identity ("their files load
//! unchanged", docs/rules.md): through the limiter, two different limits under one name each keep their
//! own limit, and `replaces` drops every bucket of that name. And the stat keys their metric
//! names are labelled by (`metrics.envoyproxy_names`), built from the rules tree as theirs are.

use std::io::Write;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::core::clock::ManualClock;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::rules::load_rules;
use tollgate::store::MemoryStore;

const RULES: &str = "domain: d
descriptors:
  - key: remote_address
    rate_limit: {name: per_client, unit: second, requests_per_unit: 10}
  - key: api_key
    rate_limit: {name: per_client, unit: minute, requests_per_unit: 100}
  - key: tenant
    rate_limit:
      name: per_tenant
      unit: hour
      requests_per_unit: 1000
      replaces: [{name: per_client}]
";

fn limiter() -> Limiter<MemoryStore> {
    let mut file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    file.write_all(RULES.as_bytes()).unwrap();
    let rules = load_rules(file.path()).unwrap_or_else(|e| panic!("rules should load: {e}"));
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::new(4, 10_000, Arc::new(clock));
    let options = LimiterOptions::from_settings(&tollgate::server::settings::Settings::default());
    Limiter::new(rules, store, options)
}

fn desc(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![Entry {
            key: key.to_owned(),
            value: value.to_owned(),
        }],
        ..Default::default()
    }
}

fn req(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: "d".to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

fn limit_of(s: &DescriptorStatus) -> Option<(&str, u32, Unit)> {
    s.current_limit
        .as_ref()
        .map(|l| (l.name.as_str(), l.requests_per_unit, Unit::try_from(l.unit).unwrap()))
}

#[tokio::test]
async fn one_name_two_limits_each_keeps_its_own() {
    let l = limiter();
    let resp = l
        .should_rate_limit(&req(vec![desc("remote_address", "x"), desc("api_key", "x")]))
        .await
        .unwrap();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(limit_of(&resp.statuses[0]), Some(("per_client", 10, Unit::Second)));
    assert_eq!(resp.statuses[0].limit_remaining, 9);
    assert_eq!(limit_of(&resp.statuses[1]), Some(("per_client", 100, Unit::Minute)));
    assert_eq!(resp.statuses[1].limit_remaining, 99);
}

#[tokio::test]
async fn replaces_drops_every_bucket_of_the_name() {
    let l = limiter();
    let all = req(vec![
        desc("remote_address", "x"),
        desc("api_key", "x"),
        desc("tenant", "t"),
    ]);
    let resp = l.should_rate_limit(&all).await.unwrap();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(limit_of(&resp.statuses[0]), None, "per_client (10/s) is replaced");
    assert_eq!(limit_of(&resp.statuses[1]), None, "per_client (100/min) is replaced");
    assert_eq!(limit_of(&resp.statuses[2]), Some(("per_tenant", 1000, Unit::Hour)));
    assert_eq!(resp.statuses[2].limit_remaining, 999);
    assert_eq!(l.store().len(), 1, "only per_tenant holds state");
}

/// envoyproxy/ratelimit's stat key of each rule, and the labels their default Prometheus
/// mapper makes of it: `key` or `key_value` per level (a wildcard's pattern as written), one
/// level gives `domain`, `key1`; two or more give `domain`, `key1`, `key2` (deeper levels
/// dropped); a `.` in a value splits it as it does in theirs; `:` becomes `_`.
#[test]
fn stat_keys_and_their_labels() {
    use tollgate::rules::envoyproxy_stat_key;
    use tollgate::telemetry::envoyproxy_labels;
    let rules = "domain: shop
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: header_match
    value: api
    descriptors:
      - key: path
        value: /v1/*
        rate_limit: {unit: minute, requests_per_unit: 5}
        descriptors:
          - key: user
            rate_limit: {unit: hour, requests_per_unit: 100}
  - key: host
    value: a.example:8080
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: remote_address
    value: 10.0.0.1
    rate_limit: {unit: second, requests_per_unit: 1}
";
    let mut file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    file.write_all(rules.as_bytes()).unwrap();
    let set = load_rules(file.path()).unwrap_or_else(|e| panic!("rules should load: {e}"));
    let dom = set.domain("shop").unwrap();
    let key_of = |entries: &[(&str, &str)]| {
        let entries: Vec<Entry> = entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect();
        let node = tollgate::rules::find_node(dom, &entries).expect("a rule matches");
        envoyproxy_stat_key(dom, node)
    };
    let labels = |key: &str| {
        envoyproxy_labels(key)
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    };

    let k = key_of(&[("remote_address", "10.0.0.2")]);
    assert_eq!(
        k, "shop.remote_address",
        "a key-only rule never carries the request's value"
    );
    assert_eq!(labels(&k), "domain=shop,key1=remote_address");

    let k = key_of(&[("header_match", "api"), ("path", "/v1/users")]);
    assert_eq!(k, "shop.header_match_api.path_/v1/*");
    assert_eq!(labels(&k), "domain=shop,key1=header_match_api,key2=path_/v1/*");

    let k = key_of(&[("header_match", "api"), ("path", "/v1/x"), ("user", "u1")]);
    assert_eq!(k, "shop.header_match_api.path_/v1/*.user");
    assert_eq!(
        labels(&k),
        "domain=shop,key1=header_match_api,key2=path_/v1/*",
        "level 3 dropped"
    );

    let k = key_of(&[("host", "a.example:8080")]);
    assert_eq!(k, "shop.host_a.example:8080");
    assert_eq!(labels(&k), "domain=shop,key1=host_a,key2=example_8080");

    // Their sanitizer turns an IPv4 address's dots into `_` before the key is split.
    let k = key_of(&[("remote_address", "10.0.0.1")]);
    assert_eq!(k, "shop.remote_address_10.0.0.1", "the rule with that value");
    assert_eq!(labels(&k), "domain=shop,key1=remote_address_10_0_0_1");
    // A detailed_metric key carries the request's value the same way.
    assert_eq!(
        labels("shop.remote_address_192.168.1.20.user_u1"),
        "domain=shop,key1=remote_address_192_168_1_20,key2=user_u1"
    );
    // Their expression's edges: leftmost match, \d{1,3} per group, no overlap.
    assert_eq!(labels("d.k_1234.5.6.7"), "domain=d,key1=k_1234_5_6_7");
    assert_eq!(labels("d.k_1.2.3.4567"), "domain=d,key1=k_1_2_3_4567");
    assert_eq!(labels("d.k_1.2.3"), "domain=d,key1=k_1,key2=2");
    assert_eq!(labels("d.k_1.2.3.4.5.6.7.8"), "domain=d,key1=k_1_2_3_4,key2=5_6_7_8");
}
