//! An RLQS bucket id (a map of strings) as a descriptor of the rules: its entries ordered as
//! the domain's tree nests their keys.
//!
//! A `bucket_id` has no order (`map<string, string>` in `rlqs.proto`), a descriptor does. The
//! entries are put in the order that walks the tree from its root through every key of the
//! bucket id, each level taking one of the keys left ([`crate::rules::Level::find`], so exact
//! values, wildcards and key-only nodes match as for `ShouldRateLimit`), ending on a node with
//! a rule. Where several keys could come first (a tree with both `tenant` and `path` at the
//! root), the keys are tried in their sorted order and the first complete walk wins. A bucket
//! id of one key is the one-entry descriptor.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

use crate::rules::{Domain, Level};

/// Walks tried at most before giving up (a bucket id of many keys over a tree with all of
/// them at every level could otherwise try every order).
const MAX_STEPS: usize = 4_096;

/// The bucket id's entries in tree order, or, when no walk through all of them ends on a rule,
/// in sorted key order (which the limiter then finds no rule for, and says so).
pub fn entries_in_tree_order(domain: &Domain, bucket: &[(String, String)]) -> Vec<Entry> {
    let mut sorted: Vec<&(String, String)> = bucket.iter().collect();
    sorted.sort();
    let mut path = Vec::with_capacity(sorted.len());
    let mut used = vec![false; sorted.len()];
    let mut steps = 0;
    if walk(domain, &domain.root, &sorted, &mut used, &mut path, &mut steps) {
        return path.into_iter().map(|i| entry(sorted[i])).collect();
    }
    sorted.into_iter().map(entry).collect()
}

fn entry((key, value): &(String, String)) -> Entry {
    Entry {
        key: key.clone(),
        value: value.clone(),
    }
}

/// Depth-first: takes each unused key this level matches, in sorted order, until every key is
/// used on a node with a rule.
fn walk(
    domain: &Domain,
    level: &Level,
    keys: &[&(String, String)],
    used: &mut [bool],
    path: &mut Vec<usize>,
    steps: &mut usize,
) -> bool {
    for i in 0..keys.len() {
        if used[i] {
            continue;
        }
        *steps += 1;
        if *steps > MAX_STEPS {
            return false;
        }
        let (key, value) = keys[i];
        let Some(node) = level.find(key, value) else {
            continue;
        };
        used[i] = true;
        path.push(i);
        let done = path.len() == keys.len();
        if (done && domain.nodes[node].rule.is_some())
            || (!done && walk(domain, &domain.nodes[node].children, keys, used, path, steps))
        {
            return true;
        }
        used[i] = false;
        path.pop();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::load_rules_text;

    fn domain() -> crate::rules::RuleSet {
        load_rules_text(
            std::path::Path::new("edge.yaml"),
            "domain: edge\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: path\n        value: /upload\n        \
             rate_limit: { unit: second, requests_per_unit: 5 }\n  - key: api_key\n    rate_limit: { unit: second, requests_per_unit: 10 }\n",
        )
        .expect("rules")
    }

    fn id(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn keys(entries: &[Entry]) -> Vec<&str> {
        entries.iter().map(|e| e.key.as_str()).collect()
    }

    #[test]
    fn keys_are_ordered_as_the_tree_nests_them() {
        let rules = domain();
        let d = rules.domain("edge").unwrap();
        let e = entries_in_tree_order(d, &id(&[("path", "/upload"), ("tenant", "acme")]));
        assert_eq!(keys(&e), ["tenant", "path"]);
        let e = entries_in_tree_order(d, &id(&[("api_key", "k1")]));
        assert_eq!(keys(&e), ["api_key"]);
        // No walk ends on a rule: sorted, for the limiter to find nothing.
        let e = entries_in_tree_order(d, &id(&[("tenant", "acme"), ("path", "/other")]));
        assert_eq!(keys(&e), ["path", "tenant"]);
    }

    #[test]
    fn many_keys_are_bounded() {
        let rules = domain();
        let d = rules.domain("edge").unwrap();
        let many: Vec<(String, String)> = (0..40).map(|i| (format!("k{i}"), "v".into())).collect();
        assert_eq!(entries_in_tree_order(d, &many).len(), 40);
    }
}
