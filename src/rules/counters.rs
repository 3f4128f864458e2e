//! The counters the rules own: each bucket's decision counters and, with envoyproxy/ratelimit's
//! names or their statsd sink on, each rule's series under their stat key. Registered once per load, so the decision
//! path counts with an atomic add and never builds labels.

use super::{Domain, Rule, RuleSet, OVERRIDE_BUCKET};
use crate::telemetry::{envoyproxy_names, statsd, DecisionCounters, EnvoyproxyStats};

/// The stat key envoyproxy/ratelimit gives the rule on `node` of `domain`: the domain, then per
/// level from the top `key`, or `key_value` for a node with a value (a wildcard's pattern as
/// written, `*` included), joined by `.`; e.g. `edge.remote_address.path_/api/*`.
pub fn envoyproxy_stat_key(domain: &Domain, node: usize) -> String {
    envoyproxy_stat_keys(domain).swap_remove(node)
}

/// [`envoyproxy_stat_key`] of every node of `domain` (same index as its nodes), in one pass
/// over the tree: a domain of many rules is registered in linear time.
pub(crate) fn envoyproxy_stat_keys(domain: &Domain) -> Vec<String> {
    let mut names: Vec<String> = vec![String::new(); domain.nodes.len()];
    let levels = std::iter::once(&domain.root).chain(domain.nodes.iter().map(|n| &n.children));
    for level in levels {
        for (key, values) in &level.exact {
            for (value, n) in values {
                names[*n] = format!("{key}_{value}");
            }
        }
        for (key, pattern, n) in &level.wildcard {
            names[*n] = format!("{key}_{}", pattern.text());
        }
        for (key, n) in &level.any {
            names[*n] = key.clone();
        }
    }
    // A node's parent comes before it in the arena (compile pushes a node, then its children).
    let mut keys: Vec<String> = Vec::with_capacity(names.len());
    for (n, name) in names.iter().enumerate() {
        let prefix = match domain.nodes[n].parent {
            Some(p) if p < n => keys[p].clone(),
            Some(p) => envoyproxy_stat_key_walk(domain, &names, p),
            None => domain.name.clone(),
        };
        keys.push(format!("{prefix}.{name}"));
    }
    keys
}

/// The stat key of `node` by walking up to the top (for an arena not in parent-first order).
fn envoyproxy_stat_key_walk(domain: &Domain, names: &[String], node: usize) -> String {
    let mut path = vec![node];
    let mut at = node;
    while let Some(parent) = domain.nodes[at].parent {
        path.push(parent);
        at = parent;
    }
    let mut key = domain.name.clone();
    for &n in path.iter().rev() {
        key.push('.');
        key.push_str(&names[n]);
    }
    key
}

/// Gives every bucket of `rules` (and each domain's Envoy `limit` overrides, labelled
/// `bucket="override"`) its decision counters, so the decision path never builds labels.
/// Counters of a bucket that keeps its domain and name across a reload continue from their
/// values.
pub(crate) fn register_rules(rules: &mut RuleSet) {
    for domain in rules.domains.values_mut() {
        domain.counters = domain
            .buckets
            .iter()
            .map(|b| DecisionCounters::new(&domain.name, &b.name))
            .collect();
        domain.override_counters = DecisionCounters::new(&domain.name, OVERRIDE_BUCKET);
        domain.envoyproxy_stats = if envoyproxy_names() || statsd::enabled() {
            let keys = envoyproxy_stat_keys(domain);
            (0..domain.nodes.len())
                .map(|n| match &domain.nodes[n].rule {
                    Some(Rule::Limited { shadow, .. }) => {
                        EnvoyproxyStats::new(&domain.name, &keys[n], *shadow, domain.nodes[n].detailed_metric)
                    }
                    _ => EnvoyproxyStats::default(),
                })
                .collect()
        } else {
            Vec::new()
        };
    }
}
