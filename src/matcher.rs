//! Request descriptors to rules, and rules to bucket instance keys (DESIGN 1.1).

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

use crate::rules::{Domain, Rule};

/// The rule for one request descriptor: walk the tree one entry per level; the rule of the
/// node reached by the **last** entry applies. No match at some level, or a last node without
/// a rule, gives `None` (no limit). Matching does not backtrack: a dead end below an exact
/// match does not fall back to a wildcard or default sibling, as in envoyproxy/ratelimit.
pub fn find_rule<'a>(domain: &'a Domain, entries: &[Entry]) -> Option<&'a Rule> {
    let mut level = &domain.root;
    let mut node = None;
    for entry in entries {
        let id = level.find(&entry.key, &entry.value)?;
        let n = &domain.nodes[id];
        level = &n.children;
        node = Some(n);
    }
    node.and_then(|n| n.rule.as_ref())
}

/// Appends the identity of a bucket instance to `out`: the domain, the bucket name and the
/// request descriptor's entries, each part length-prefixed so that no value (whatever bytes it
/// holds) can forge another instance's key.
pub fn instance_key(out: &mut String, domain: &str, bucket: &str, entries: &[Entry]) {
    use std::fmt::Write;
    for part in [domain, bucket] {
        let _ = write!(out, "{}:{part}", part.len());
    }
    for e in entries {
        let _ = write!(out, "{}:{}{}:{}", e.key.len(), e.key, e.value.len(), e.value);
    }
}

#[cfg(test)]
mod tests;
