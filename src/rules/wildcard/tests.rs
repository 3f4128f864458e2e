//! Patterns, and the index's answers against the precedence it documents.

use proptest::prelude::*;

use super::*;
use crate::rules::find_node;
use crate::rules::matcher::tests::{entries, load};

fn p(text: &str) -> Pattern {
    Pattern::parse(text).unwrap()
}

/// An index of `(key, pattern)` in config order, the entry at position `i` leading to node `i`.
fn build(entries: &[(&str, &str)]) -> WildcardIndex {
    let mut index = WildcardIndex::default();
    for (node, (key, text)) in entries.iter().enumerate() {
        index.insert((*key).to_owned(), p(text), node);
    }
    index
}

/// What the index's precedence means, spelled out: of the patterns of `key` that match, those
/// with the longest literal prefix, and of them the first in config order.
fn reference(entries: &[(&str, &str)], key: &str, value: &str) -> Option<usize> {
    let matching: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .filter(|(_, (k, text))| *k == key && p(text).matches(value))
        .map(|(node, (_, text))| (node, p(text).prefix().len()))
        .collect();
    let longest = matching.iter().map(|(_, len)| *len).max()?;
    matching.iter().find(|(_, len)| *len == longest).map(|(node, _)| *node)
}

#[test]
fn patterns() {
    assert!(p("*").matches(""));
    assert!(p("/api/*").matches("/api/v1"));
    assert!(!p("/api/*").matches("/apx/v1"));
    assert!(p("*.png").matches("a.png"));
    assert!(p("a*b*c").matches("abc"));
    assert!(p("a*b*c").matches("aXbYc"));
    assert!(!p("a*b*c").matches("acb"));
    assert!(!p("ab*ba").matches("aba"), "prefix and suffix must not overlap");
    assert!(p("*x*x*").matches("xx"));
    assert!(!p("*x*x*").matches("x"));
    assert!(Pattern::parse("plain").is_none());
    for text in ["*", "/api/*", "a*b*c", "*x*x*", "**"] {
        assert_eq!(p(text).text(), text);
    }
    assert_eq!(p("/api/*/x").prefix(), "/api/");
    assert_eq!(p("*.png").prefix(), "");
    assert!(p("ab*ba").matches_after_prefix("ba"));
    assert!(!p("ab*ba").matches_after_prefix("a"));
    for (text, prefix_only) in [
        ("/api/*", true),
        ("*", true),
        ("a**", true),
        ("a*b", false),
        ("*x*", false),
    ] {
        assert_eq!(p(text).is_prefix_only(), prefix_only, "{text}");
    }
}

#[test]
fn the_longest_literal_prefix_wins_then_config_order() {
    // Shorter prefixes listed first, as a file growing route by route often lists them.
    let entries = [
        ("path", "*"),
        ("path", "/api/*"),
        ("path", "/api/*.json"),
        ("path", "/api/v1/*"),
        ("path", "/api/v1/*"),
        ("path", "/api/v1/users/*"),
        ("other", "/api/v1/users/*"),
    ];
    let index = build(&entries);
    let find = |value| index.find("path", value);
    assert_eq!(find("/api/v1/users/7"), Some(5));
    assert_eq!(find("/api/v1/orders"), Some(3), "the first of two equal patterns");
    assert_eq!(find("/api/v2/a.json"), Some(1), "same prefix: config order");
    assert_eq!(find("/api/v1"), Some(1), "a value shorter than the longer prefixes");
    assert_eq!(find("/ap"), Some(0));
    assert_eq!(find(""), Some(0));
    assert_eq!(index.find("other", "/api/v1/users/"), Some(6));
    assert_eq!(index.find("other", "/api/v1/users"), None);
    assert_eq!(index.find("missing", "/api/v1/users/7"), None);
    // Listed from the longest prefix down, the answers are the same.
    let reversed: Vec<_> = entries.iter().rev().copied().collect();
    let flipped = build(&reversed);
    let last = entries.len() - 1;
    assert_eq!(flipped.find("path", "/api/v1/users/7"), Some(last - 5));
    assert_eq!(
        flipped.find("path", "/api/v2/a.json"),
        Some(last - 2),
        "same prefix: config order"
    );
    for value in [
        "/api/v1/users/7",
        "/api/v1/orders",
        "/api/v2/a.json",
        "/api/v1",
        "/ap",
        "",
    ] {
        assert_eq!(index.find("path", value), reference(&entries, "path", value), "{value}");
        assert_eq!(
            flipped.find("path", value),
            reference(&reversed, "path", value),
            "{value}"
        );
    }
}

#[test]
fn middle_pieces_and_suffixes() {
    let entries = [
        ("k", "*.png"),
        ("k", "/v1/*/items/*"),
        ("k", "/v1/*/items"),
        ("k", "a*b*c"),
        ("k", "*"),
    ];
    let index = build(&entries);
    let find = |value| index.find("k", value);
    assert_eq!(find("logo.png"), Some(0));
    assert_eq!(
        find("/v1/x/items"),
        Some(2),
        "a longer prefix than `*.png`, same as `/v1/*/items/*`"
    );
    assert_eq!(
        find("/v1/x/items/a.png"),
        Some(1),
        "the longer prefix wins over `*.png`"
    );
    assert_eq!(
        find("/v1/x/other.png"),
        Some(0),
        "`/v1/` patterns checked first, none matches"
    );
    assert_eq!(find("/v1/x/other"), Some(4));
    assert_eq!(find("aXbYc"), Some(3));
    assert_eq!(find("acb"), Some(4));
    assert_eq!(find(""), Some(4));
}

#[test]
fn values_shorter_than_a_prefix_or_parting_inside_an_edge() {
    let entries = [("k", "/api/users/*"), ("k", "/api/orders/*")];
    let index = build(&entries);
    for value in ["", "/", "/api", "/api/", "/api/user", "/api/users", "/api/orderz/1"] {
        assert_eq!(index.find("k", value), None, "{value}");
    }
    assert_eq!(index.find("k", "/api/users/"), Some(0));
    assert_eq!(index.find("k", "/api/orders/9"), Some(1));
}

#[test]
fn multibyte_values() {
    // `é` (C3 A9) and `ê` (C3 AA) part inside a character: the trie splits at C3.
    let entries = [("k", "é*"), ("k", "ê*"), ("k", "日本*"), ("k", "日*語"), ("k", "*ü")];
    let index = build(&entries);
    let find = |value| index.find("k", value);
    assert_eq!(find("éa"), Some(0));
    assert_eq!(find("ê"), Some(1));
    assert_eq!(find("ë"), None, "shares the first byte with é and ê");
    assert_eq!(find("ëü"), Some(4));
    assert_eq!(find("日本語"), Some(2), "the longer prefix");
    assert_eq!(find("日の語"), Some(3));
    assert_eq!(find("日"), None);
    assert_eq!(find("éü"), Some(0));
    for value in ["éa", "ê", "ë", "ëü", "日本語", "日の語", "日", "éü", "", "ü"] {
        assert_eq!(find(value), reference(&entries, "k", value), "{value}");
    }
}

#[test]
fn listings_keep_config_order_and_show_precedence() {
    let index = build(&[("k", "*.png"), ("k", "/a/*"), ("j", "/a/b/*"), ("k", "/b/*")]);
    let texts = |entries: Vec<&(String, Pattern, usize)>| {
        entries
            .iter()
            .map(|(k, p, _)| format!("{k}={}", p.text()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        texts(index.iter().collect()),
        ["k=*.png", "k=/a/*", "j=/a/b/*", "k=/b/*"]
    );
    assert_eq!(
        texts(index.in_precedence_order()),
        ["j=/a/b/*", "k=/a/*", "k=/b/*", "k=*.png"]
    );
    assert_eq!(index.len(), 4);
    assert!(WildcardIndex::default().is_empty());
    assert_eq!(WildcardIndex::default().find("k", "v"), None);
}

/// Texts over a few characters, multibyte ones among them, so that patterns overlap often.
fn text(stars: bool) -> impl Strategy<Value = String> {
    let chars: &[char] = if stars {
        &['a', 'b', '/', 'é', 'ê', '*', '*']
    } else {
        &['a', 'b', '/', 'é', 'ê']
    };
    proptest::collection::vec(proptest::sample::select(chars.to_vec()), 0..7).prop_map(|c| c.into_iter().collect())
}

/// A pattern of [`text`]: a star added at the end when it has none.
fn pattern() -> impl Strategy<Value = String> {
    text(true).prop_map(|t| if t.contains('*') { t } else { t + "*" })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]
    #[test]
    fn the_index_answers_as_the_reference(
        patterns in proptest::collection::vec((proptest::sample::select(vec!["k", "j"]), pattern()), 0..12),
        values in proptest::collection::vec((proptest::sample::select(vec!["k", "j", "x"]), text(false)), 1..12),
    ) {
        let entries: Vec<(&str, &str)> = patterns.iter().map(|(k, t)| (*k, t.as_str())).collect();
        let index = build(&entries);
        for (key, value) in &values {
            prop_assert_eq!(index.find(key, value), reference(&entries, key, value), "{}={:?}", key, value);
        }
        // And for values made from the patterns, which match some of them.
        for (key, text) in &entries {
            let value = text.replace('*', "a");
            prop_assert_eq!(index.find(key, &value), reference(&entries, key, &value), "{}={:?}", key, value);
        }
    }
}

const ROUTES: usize = 10_000;

/// Envoy Gateway's rules for `ROUTES` routes, as its translator writes them: per route a
/// descriptor whose key and value are the route's name, ending in its host name (`*` for any),
/// and below it the rule's match (here a header: one bucket per value). Every route's value is a
/// wildcard of its own key.
#[test]
fn ten_thousand_envoy_gateway_routes() {
    let route = |i: usize| format!("httproute/default/route-{i}/rule/0/match/0/*");
    let mut yaml = String::from("domain: envoy-gateway/gateway-1/http\ndescriptors:\n");
    for i in 0..ROUTES {
        let r = route(i);
        yaml.push_str(&format!(
            "  - key: {r}\n    value: \"{r}\"\n    descriptors:\n      - key: rule-0-match-0\n        \
             rate_limit: {{unit: minute, requests_per_unit: {}}}\n",
            i + 1
        ));
    }
    let set = load(&yaml);
    let domain = set.domain("envoy-gateway/gateway-1/http").unwrap();
    assert_eq!(domain.root.wildcard.len(), ROUTES);
    let limit = |pairs: &[(&str, &str)]| find_node(domain, &entries(pairs)).map(|n| domain.nodes[n].path.clone());
    for i in [0, 1, ROUTES / 2, ROUTES - 1] {
        let r = route(i);
        // Envoy sends the route's name as the value, `*` and all.
        assert_eq!(
            limit(&[(&r, &r), ("rule-0-match-0", "alice")]),
            Some(format!("{r}={r}.rule-0-match-0")),
            "route {i}"
        );
    }
    let r = route(7);
    assert_eq!(
        limit(&[(&r, "httproute/default/route-8/rule/0/match/0/*")]),
        None,
        "another route's name"
    );
    assert_eq!(
        limit(&[("httproute/default/route-x/rule/0/match/0/*", &r)]),
        None,
        "no such key"
    );
}

/// One key with `ROUTES` path prefixes, the shape the trie is for: every lookup walks a tree of
/// ten thousand prefixes, and a catch-all with a shorter prefix, listed last, loses to them.
#[test]
fn ten_thousand_path_prefixes_under_one_key() {
    let mut yaml = String::from("domain: d\ndescriptors:\n");
    for i in 0..ROUTES {
        yaml.push_str(&format!(
            "  - {{key: path, value: \"/route/{i}/*\", name: r{i}, token_bucket: {{capacity: 1, refill: 1/s}}}}\n"
        ));
    }
    yaml.push_str("  - {key: path, value: \"/route/*\", name: any_route, token_bucket: {capacity: 1, refill: 1/s}}\n");
    yaml.push_str(
        "  - {key: path, value: \"/route/42/exact\", name: exact, token_bucket: {capacity: 1, refill: 1/s}}\n",
    );
    yaml.push_str("  - {key: path, name: default, token_bucket: {capacity: 1, refill: 1/s}}\n");
    let set = load(&yaml);
    let domain = set.domain("d").unwrap();
    assert_eq!(domain.root.wildcard.len(), ROUTES + 1);
    let bucket = |value: &str| {
        let node = find_node(domain, &entries(&[("path", value)]))?;
        match domain.nodes[node].rule.as_ref()? {
            crate::rules::Rule::Limited { buckets, .. } => Some(domain.buckets[buckets[0]].name.clone()),
            crate::rules::Rule::Unlimited { .. } => None,
        }
    };
    assert_eq!(bucket("/route/0/").as_deref(), Some("r0"));
    assert_eq!(bucket("/route/1/users").as_deref(), Some("r1"));
    assert_eq!(bucket("/route/10/users").as_deref(), Some("r10"), "not /route/1/");
    assert_eq!(bucket("/route/5000/a/b").as_deref(), Some("r5000"));
    assert_eq!(bucket("/route/9999/x").as_deref(), Some("r9999"));
    assert_eq!(bucket("/route/42/exact").as_deref(), Some("exact"));
    assert_eq!(bucket("/route/10000/x").as_deref(), Some("any_route"), "no such route");
    assert_eq!(
        bucket("/route/5000").as_deref(),
        Some("any_route"),
        "shorter than its prefix"
    );
    assert_eq!(bucket("/other").as_deref(), Some("default"));
}

/// A wildcard listed after a pattern of its key that takes all its values in file order (a
/// shorter prefix, nothing after the `*`) is noted: the precedence changed what it does.
#[test]
fn a_wildcard_that_file_order_never_reached_is_noted() {
    let rule = |value: &str, name: &str| {
        format!("  - {{key: path, value: \"{value}\", name: {name}, token_bucket: {{capacity: 1, refill: 1/s}}}}\n")
    };
    let yaml = format!(
        "domain: d\ndescriptors:\n{}{}{}{}{}{}",
        rule("/api/*", "api"),
        rule("/api/*.json", "json"),
        rule("/api/v1/*", "v1"),
        rule("/api/v1/users/*", "users"),
        rule("/static/*", "static"),
        rule("/static*", "static_any"),
    );
    let set = load(&yaml);
    let notes: Vec<(&str, &str)> = set
        .domain("d")
        .unwrap()
        .notes
        .iter()
        .map(|(r, n)| (r.as_str(), n.as_str()))
        .collect();
    assert_eq!(
        notes,
        [
            (
                "path=/api/v1/*",
                "`/api/v1/*` wins over `/api/*`, listed before it, for every value it matches (the longer literal \
                 prefix wins); tried in file order, as envoyproxy/ratelimit tries wildcards, it would never apply"
            ),
            (
                "path=/api/v1/users/*",
                "`/api/v1/users/*` wins over `/api/*`, listed before it, for every value it matches (the longer \
                 literal prefix wins); tried in file order, as envoyproxy/ratelimit tries wildcards, it would never \
                 apply"
            ),
        ],
        "`/api/*.json` has the same prefix (file order applies), and `/static*` a shorter one listed after"
    );
}
