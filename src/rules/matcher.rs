//! Request descriptors to rules, and rules to bucket instance keys (docs/rules.md).

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

use crate::rules::{Domain, Rule};

/// The rule for one request descriptor: walk the tree one entry per level; the rule of the
/// node reached by the **last** entry applies. No match at some level, or a last node without
/// a rule, gives `None` (no limit). Matching does not backtrack: a dead end below an exact
/// match does not fall back to a wildcard or default sibling, as in envoyproxy/ratelimit.
pub fn find_rule<'a>(domain: &'a Domain, entries: &[Entry]) -> Option<&'a Rule> {
    find_node(domain, entries).and_then(|id| domain.nodes[id].rule.as_ref())
}

/// The node (an index into [`Domain::nodes`]) the last entry reaches, as in [`find_rule`].
pub fn find_node(domain: &Domain, entries: &[Entry]) -> Option<usize> {
    let mut level = &domain.root;
    let mut node = None;
    for entry in entries {
        let id = level.find(&entry.key, &entry.value)?;
        level = &domain.nodes[id].children;
        node = Some(id);
    }
    node
}

/// How far a descriptor's entries go down `domain`'s tree, for explaining one that reaches no
/// rule: the deepest node its entries reach in order (`None`: not even the first) and how many
/// of them matched. When fewer than all matched, entry number `matched` is the one no node of
/// that level takes; when all matched, the node itself has no rule (or `unlimited`).
pub(crate) fn deepest_node(domain: &Domain, entries: &[Entry]) -> (Option<usize>, usize) {
    let mut level = &domain.root;
    let mut node = None;
    for (i, entry) in entries.iter().enumerate() {
        let Some(id) = level.find(&entry.key, &entry.value) else {
            return (node, i);
        };
        level = &domain.nodes[id].children;
        node = Some(id);
    }
    (node, entries.len())
}

/// Per entry of a descriptor that reached `last` (a node `depth` levels down), the wildcard
/// pattern that stands for its value in the instance key when the node on that level has
/// `share_threshold: true` (envoyproxy/ratelimit), else `None`. Empty when the domain shares
/// nothing, which is the common case and costs nothing.
pub(crate) fn shared_patterns(domain: &Domain, last: usize, depth: usize) -> Vec<Option<&str>> {
    if !domain.has_shared {
        return Vec::new();
    }
    let mut out = vec![None; depth];
    let mut at = Some(last);
    for slot in out.iter_mut().rev() {
        let Some(id) = at else { break };
        *slot = domain.nodes[id].shared_pattern.as_deref();
        at = domain.nodes[id].parent;
    }
    out
}

/// Appends the identity of a bucket instance to `out`: the domain, the bucket name and the
/// request descriptor's entries, each part length-prefixed so that no value (whatever bytes it
/// holds) can forge another instance's key. An entry whose node shares its bucket
/// (`shared[i]` is a pattern, see `shared_patterns`) contributes the pattern, marked with
/// `*` where a value's length would stand, so all matching values share one instance.
pub fn instance_key(out: &mut String, domain: &str, bucket: &str, entries: &[Entry], shared: &[Option<&str>]) {
    push_part(out, domain);
    push_part(out, bucket);
    for (i, e) in entries.iter().enumerate() {
        push_part(out, &e.key);
        match shared.get(i).copied().flatten() {
            Some(pattern) => {
                out.push('*');
                push_part(out, pattern);
            }
            None => push_part(out, &e.value),
        }
    }
}

/// `<length>:<part>`: on every decision, so without the formatting machinery.
fn push_part(out: &mut String, part: &str) {
    out.push_str(itoa::Buffer::new().format(part.len()));
    out.push(':');
    out.push_str(part);
}

#[cfg(test)]
pub(crate) mod tests;
