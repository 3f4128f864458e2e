//! Wildcard values (`*` in a rule's `value`) and the index a [`Level`](super::Level) looks them
//! up in.
//!
//! Envoy Gateway gives each route a wildcard value of its own, so a level may hold thousands of
//! patterns; scanning them all on every request made matching cost grow with the rules. The
//! index finds the patterns that can match a value by its bytes instead: a lookup costs the
//! value's length plus the patterns whose literal prefix the value starts with, whatever the
//! number of other patterns.

use super::LookupMap;

/// A value pattern where `*` matches any run of characters (possibly empty), anywhere and
/// several times: `/api/*`, `*.png`, `/v1/*/items/*`, `*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    /// The literal pieces between stars (two at least); the first is a prefix, the last a
    /// suffix.
    pieces: Vec<String>,
}

impl Pattern {
    /// A pattern from its text; `None` when it has no `*` (an exact value).
    pub fn parse(text: &str) -> Option<Pattern> {
        text.contains('*').then(|| Pattern {
            pieces: text.split('*').map(str::to_owned).collect(),
        })
    }

    /// The pattern as written, stars included (`/api/*`).
    pub fn text(&self) -> String {
        self.pieces.join("*")
    }

    /// The literal text before the first `*` (`/api/` of `/api/*`, empty for `*.png`): what a
    /// matching value starts with, and what ranks overlapping patterns (the longer wins).
    pub fn prefix(&self) -> &str {
        &self.pieces[0]
    }

    /// Whether `value` matches: the first piece is a prefix, the last a suffix, and the middle
    /// pieces occur in order, without overlapping, in between.
    pub fn matches(&self, value: &str) -> bool {
        value
            .strip_prefix(self.prefix())
            .is_some_and(|rest| self.matches_after_prefix(rest))
    }

    /// Whether a value that starts with [`Pattern::prefix`] and goes on with `rest` matches: the
    /// index has already compared the prefix while walking its trie, so it checks only the
    /// pieces after it.
    pub fn matches_after_prefix(&self, rest: &str) -> bool {
        let (last, middle) = self.pieces[1..]
            .split_last()
            .expect("a pattern has two pieces at least");
        // The suffix is taken from `rest`, after the prefix, so the two never overlap
        // (`ab*ba` does not match `aba`).
        let Some(mut inner) = rest.strip_suffix(last.as_str()) else {
            return false;
        };
        for piece in middle {
            match inner.find(piece.as_str()) {
                Some(at) => inner = &inner[at + piece.len()..],
                None => return false,
            }
        }
        true
    }

    /// Whether every value that starts with the prefix matches (`/api/*`, `*`, `a**`): such a
    /// pattern listed before one with a longer prefix took all its values in file order.
    pub fn is_prefix_only(&self) -> bool {
        self.pieces[1..].iter().all(String::is_empty)
    }
}

/// The wildcard nodes of one level: `(key, pattern, node)` entries, and per key a trie of their
/// literal prefixes for lookups.
///
/// Precedence among the patterns of a key that match a value: the **longer literal prefix**
/// wins (`/api/v1/*` over `/api/*`, whichever the file lists first), then the one listed first.
/// Exact values and the key-only default are the [`Level`](super::Level)'s, before and after.
///
/// The trie is a radix trie over bytes, one per key, all in one arena: each edge carries a run
/// of bytes, and each node the patterns whose prefix ends there. A lookup hashes the key, walks
/// down as far as the value's bytes follow the edges, then climbs back checking the patterns of
/// each node on the way, deepest first: O(value length + candidates checked), the candidates
/// being only patterns whose prefix the value starts with. Building it costs O(prefix length)
/// per pattern.
#[derive(Default)]
pub struct WildcardIndex {
    /// Every entry, in config order: what listings show, and the order among patterns of one
    /// prefix.
    entries: Vec<(String, Pattern, usize)>,
    /// Per key, the root of its trie in `trie`.
    roots: LookupMap<String, u32>,
    /// The trie nodes of every key.
    trie: Vec<TrieNode>,
}

/// One node of a key's trie: the prefix spelled by the edges from the root down to it.
struct TrieNode {
    /// The bytes on the edge from the parent; empty only at a root. A node may end inside a
    /// multibyte character (an edge splits where two prefixes part), but never one that holds
    /// patterns: their prefixes are whole strings.
    label: Box<[u8]>,
    /// The length in bytes of the prefix this node spells: where in a value the rest of its
    /// patterns is matched from.
    depth: usize,
    /// The node above, for the climb back: a lookup keeps no path of its own, so it allocates
    /// nothing.
    parent: Option<u32>,
    /// The nodes below, by the first byte of their label, sorted.
    children: Vec<(u8, u32)>,
    /// The entries whose prefix is exactly this node's, as indices into `entries`, in config
    /// order.
    patterns: Vec<u32>,
}

impl WildcardIndex {
    /// Adds the entry of `node`, a wildcard node of key `key`, after those added before it in
    /// config order. The same pattern twice is kept twice, the first winning; the compiler
    /// refuses such a level as a duplicate.
    pub fn insert(&mut self, key: String, pattern: Pattern, node: usize) {
        let entry = index(self.entries.len());
        let root = match self.roots.get(&key) {
            Some(root) => *root,
            None => {
                let root = self.push_node(Box::default(), 0, None);
                self.roots.insert(key.clone(), root);
                root
            }
        };
        let at = self.node_for(root, pattern.prefix().as_bytes());
        self.trie[at as usize].patterns.push(entry);
        self.entries.push((key, pattern, node));
    }

    /// The node an entry `(key, value)` matches among the wildcards, by the precedence of
    /// [`WildcardIndex`]; `None` when no pattern of the key matches.
    pub fn find(&self, key: &str, value: &str) -> Option<usize> {
        // Most levels have no wildcard: one branch, no hashing.
        if self.entries.is_empty() {
            return None;
        }
        self.candidates(key, value)
            .find(|(rest, (_, pattern, _))| pattern.matches_after_prefix(rest))
            .map(|(_, (_, _, node))| *node)
    }

    /// The entries of `key` whose literal prefix `value` starts with, longest prefix first and
    /// then in config order, each with the part of `value` after its prefix.
    pub fn candidates<'a>(&'a self, key: &str, value: &'a str) -> Candidates<'a> {
        let mut at = self.roots.get(key).copied();
        if let Some(mut node) = at {
            let bytes = value.as_bytes();
            loop {
                let depth = self.trie[node as usize].depth;
                let Some(next) = bytes.get(depth).and_then(|b| self.child(node, *b)) else {
                    break;
                };
                if !bytes[depth..].starts_with(&self.trie[next as usize].label) {
                    break;
                }
                node = next;
            }
            at = Some(node);
        }
        Candidates {
            index: self,
            value,
            at,
            next: 0,
        }
    }

    /// Every entry, in config order (the order the rules list them).
    pub fn iter(&self) -> std::slice::Iter<'_, (String, Pattern, usize)> {
        self.entries.iter()
    }

    /// Every entry in precedence order: longest literal prefix first, then config order. Two
    /// keys never compete for a value, so their entries interleave by prefix length alone.
    pub fn in_precedence_order(&self) -> Vec<&(String, Pattern, usize)> {
        let mut out: Vec<_> = self.entries.iter().collect();
        // A stable sort: config order among equal prefix lengths.
        out.sort_by_key(|(_, pattern, _)| std::cmp::Reverse(pattern.prefix().len()));
        out
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the level has no wildcard node.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn child(&self, node: u32, byte: u8) -> Option<u32> {
        let children = &self.trie[node as usize].children;
        children
            .binary_search_by_key(&byte, |(b, _)| *b)
            .ok()
            .map(|i| children[i].1)
    }

    fn push_node(&mut self, label: Box<[u8]>, depth: usize, parent: Option<u32>) -> u32 {
        let id = index(self.trie.len());
        self.trie.push(TrieNode {
            label,
            depth,
            parent,
            children: Vec::new(),
            patterns: Vec::new(),
        });
        id
    }

    /// The node spelling `prefix` under `root`, made if missing (splitting an edge where
    /// `prefix` parts from it).
    fn node_for(&mut self, root: u32, prefix: &[u8]) -> u32 {
        let mut at = root;
        loop {
            let depth = self.trie[at as usize].depth;
            let rest = &prefix[depth..];
            let Some(&first) = rest.first() else {
                return at;
            };
            let Some(child) = self.child(at, first) else {
                let leaf = self.push_node(rest.into(), prefix.len(), Some(at));
                let children = &mut self.trie[at as usize].children;
                let slot = children.partition_point(|(b, _)| *b < first);
                children.insert(slot, (first, leaf));
                return leaf;
            };
            let label = &self.trie[child as usize].label;
            let common = label.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if common == label.len() {
                at = child;
                continue;
            }
            // `prefix` parts from the edge inside it: a node where they part, between `at`
            // and `child`, takes the common bytes.
            let (head, tail): (Box<[u8]>, Box<[u8]>) = (label[..common].into(), label[common..].into());
            let split = self.push_node(head, depth + common, Some(at));
            self.trie[split as usize].children.push((tail[0], child));
            let moved = &mut self.trie[child as usize];
            moved.label = tail;
            moved.parent = Some(split);
            let children = &mut self.trie[at as usize].children;
            let slot = children
                .binary_search_by_key(&first, |(b, _)| *b)
                .expect("the child is listed under its first byte");
            children[slot].1 = split;
            at = split;
        }
    }
}

/// A trie index from an arena position; the arena never holds more nodes than a `u32` counts
/// (two per pattern at most, and a root per key).
fn index(at: usize) -> u32 {
    u32::try_from(at).expect("fewer than 2^32 wildcard patterns in one level")
}

/// The entries [`WildcardIndex::candidates`] yields: climbing from the deepest trie node the
/// value reached to the root, each node's patterns in config order.
pub struct Candidates<'a> {
    index: &'a WildcardIndex,
    value: &'a str,
    /// The trie node whose patterns are being yielded; `None` once past the root.
    at: Option<u32>,
    /// The next of `at`'s patterns to yield.
    next: usize,
}

impl<'a> Iterator for Candidates<'a> {
    /// The part of the value after the pattern's literal prefix, and the entry.
    type Item = (&'a str, &'a (String, Pattern, usize));

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let node = &self.index.trie[self.at? as usize];
            if let Some(entry) = node.patterns.get(self.next) {
                self.next += 1;
                // A node with patterns spells a whole prefix of the value, so its depth is a
                // character boundary of the value.
                let rest = &self.value[node.depth..];
                return Some((rest, &self.index.entries[*entry as usize]));
            }
            self.at = node.parent;
            self.next = 0;
        }
    }
}

impl<'a> IntoIterator for &'a WildcardIndex {
    type Item = &'a (String, Pattern, usize);
    type IntoIter = std::slice::Iter<'a, (String, Pattern, usize)>;

    /// In config order, as [`WildcardIndex::iter`].
    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter()
    }
}

impl std::fmt::Debug for WildcardIndex {
    /// The entries in config order: the trie is derived from them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.entries).finish()
    }
}

#[cfg(test)]
mod tests;
