//! The shape of `src/` (ARCHITECTURE.md, "Layers"): each top-level module is a layer that uses
//! only the layers below it, and no two modules use each other, directly or round a loop. The
//! check reads the source: every `crate::` and `super::` path outside comments, resolved to the
//! module that defines it. Re-exports (`pub use`) and module declarations are not uses.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each layer and the layers it may use, besides itself.
const LAYERS: [(&str, &[&str]); 6] = [
    ("core", &[]),
    ("telemetry", &[]),
    ("rules", &["core", "telemetry"]),
    ("store", &["core", "telemetry"]),
    ("decision", &["core", "telemetry", "rules", "store"]),
    ("server", &["core", "telemetry", "rules", "store", "decision"]),
];

/// The items `lib.rs` defines itself (not re-exports of a module's).
const LIB_ITEMS: [&str; 1] = ["error_chain"];

/// A module's path from the crate root, e.g. `["store", "redis", "keys"]`.
type ModPath = Vec<String>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every source file of the library (not `lib.rs`, `main.rs` or `bin/`) and its module path.
fn library_files() -> Vec<(PathBuf, ModPath)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = src();
    let mut files = Vec::new();
    walk(&root, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|path| {
            let rel = path.strip_prefix(&root).unwrap().with_extension("");
            let mut parts: ModPath = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if parts.first().is_some_and(|p| p == "bin") || parts == ["lib"] || parts == ["main"] {
                return None;
            }
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            Some((path, parts))
        })
        .collect()
}

/// `text` without its inline `#[cfg(test)] mod ... { ... }` blocks: tests may reach anywhere.
fn without_test_modules(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "#[cfg(test)]" {
            // Past the other attributes of the item, to the item itself.
            let mut j = i + 1;
            while j < lines.len() && lines[j].trim_start().starts_with("#[") {
                j += 1;
            }
            if j < lines.len() && lines[j].trim_start().starts_with("mod ") && lines[j].trim_end().ends_with('{') {
                let mut depth = 0i32;
                while j < lines.len() {
                    depth += lines[j].matches('{').count() as i32 - lines[j].matches('}').count() as i32;
                    j += 1;
                    if depth <= 0 {
                        break;
                    }
                }
                i = j;
                continue;
            }
        }
        out.push_str(lines[i]);
        out.push('\n');
        i += 1;
    }
    out
}

/// The code of a file without comments (line and doc comments; block comments are not used in
/// this code base) and without the lines that only declare or re-export modules.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut in_use = false;
    let mut skip_use = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        if !in_use && (trimmed.starts_with("pub use ") || trimmed.starts_with("pub(crate) use ")) {
            in_use = true;
            skip_use = true;
        } else if !in_use && trimmed.starts_with("use ") {
            in_use = true;
            skip_use = false;
        }
        let code = match line.find("//") {
            // `//` inside a string (a URL) keeps the line whole; a comment after code is cut.
            Some(i) if !line[..i].contains('"') => &line[..i],
            _ => line,
        };
        if !skip_use {
            out.push_str(code);
            out.push('\n');
        }
        if in_use && code.trim_end().ends_with(';') {
            in_use = false;
            skip_use = false;
        }
    }
    out
}

/// The paths a piece of code names from `crate::`, `super::` or `self::` (braced groups
/// expanded one level), resolved against `module` to paths from the crate root.
fn named_paths(code: &str, module: &ModPath) -> Vec<ModPath> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let starts_ident =
            i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':');
        let prefix = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|p| rest.starts_with(p));
        let Some(prefix) = prefix.filter(|_| starts_ident) else {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        // Where the path starts from: the crate root, or this module's parent (`super`) or
        // itself (`self`); a `mod.rs` file is the module of its folder.
        let mut base: ModPath = match prefix {
            "crate::" => Vec::new(),
            "self::" => module.clone(),
            _ => {
                let mut b = module.clone();
                b.pop();
                b
            }
        };
        let mut j = i + prefix.len();
        while code[j..].starts_with("super::") {
            base.pop();
            j += "super::".len();
        }
        if code[j..].starts_with('{') {
            let end = matching_brace(code, j);
            for item in split_top_level(&code[j + 1..end]) {
                let mut p = base.clone();
                p.extend(segments(item.trim()));
                found.push(p);
            }
            i = end + 1;
        } else {
            let seg = segments(&code[j..]);
            let len: usize = seg.iter().map(|s| s.len() + 2).sum();
            let mut p = base;
            p.extend(seg);
            found.push(p);
            i = j + len.max(1);
        }
    }
    found
}

fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0;
    for (k, c) in code[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k;
                }
            }
            _ => {}
        }
    }
    code.len() - 1
}

fn split_top_level(group: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0, 0, Vec::new());
    for (k, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&group[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    out.push(&group[start..]);
    out
}

/// The leading `a::b::c` identifiers of `text`.
fn segments(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        out.push(rest[..end].to_owned());
        rest = &rest[end..];
        match rest.strip_prefix("::") {
            Some(r) if !r.starts_with('{') => rest = r,
            _ => break,
        }
    }
    out
}

/// The module a path names: its longest prefix that is a module of `modules`.
fn module_of(path: &ModPath, modules: &BTreeSet<ModPath>) -> Option<ModPath> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
}

/// The unit the cycle check works on: a module two levels down (`store::redis`,
/// `core::bucket`) with everything below it, or a top-level module's own file.
fn unit(module: &ModPath) -> String {
    module.iter().take(2).cloned().collect::<Vec<_>>().join("::")
}

/// Every use of another unit: `(from, to) -> the files and paths that make it`.
fn uses() -> BTreeMap<(String, String), Vec<String>> {
    let files = library_files();
    let modules: BTreeSet<ModPath> = files.iter().map(|(_, m)| m.clone()).collect();
    let mut edges: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (path, module) in &files {
        let text = std::fs::read_to_string(path).unwrap();
        // Tests may reach anywhere: `tests.rs` files are skipped whole, inline test modules
        // cut out.
        if path.file_stem().is_some_and(|s| s == "tests") {
            continue;
        }
        for named in named_paths(&code_of(&without_test_modules(&text)), module) {
            let Some(target) = module_of(&named, &modules) else {
                // Only what `lib.rs` itself defines is outside every module.
                let rel = path.strip_prefix(src()).unwrap().display().to_string();
                assert!(
                    LIB_ITEMS.contains(&named.first().map_or("", String::as_str)),
                    "{rel}: `{}` names no module of src/ (a re-exported path?)",
                    named.join("::")
                );
                continue;
            };
            let (from, to) = (unit(module), unit(&target));
            if from != to {
                let rel = path.strip_prefix(src()).unwrap().display().to_string();
                edges
                    .entry((from, to))
                    .or_default()
                    .push(format!("{rel}: {}", named.join("::")));
            }
        }
    }
    edges
}

#[test]
fn each_layer_uses_only_the_layers_below_it() {
    let allowed: BTreeMap<&str, &[&str]> = LAYERS.into_iter().collect();
    let mut wrong = Vec::new();
    for ((from, to), why) in uses() {
        let (from_layer, to_layer) = (from.split("::").next().unwrap(), to.split("::").next().unwrap());
        if from_layer == to_layer {
            continue;
        }
        let Some(may) = allowed.get(from_layer) else {
            wrong.push(format!("{from}: not in a layer (ARCHITECTURE.md, \"Layers\")"));
            continue;
        };
        if !may.contains(&to_layer) {
            wrong.push(format!("{from} uses {to}: {}", why.join(", ")));
        }
    }
    assert!(wrong.is_empty(), "uses against the layers:\n{}", wrong.join("\n"));
}

#[test]
fn no_two_modules_use_each_other_round_a_loop() {
    let edges = uses();
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        next.entry(from).or_default().push(to);
    }
    // Depth-first search for a back edge; report the loop it closes.
    fn visit<'a>(
        n: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
        loops: &mut Vec<Vec<&'a str>>,
    ) {
        state.insert(n, 1);
        stack.push(n);
        for &m in next.get(n).into_iter().flatten() {
            match state.get(m) {
                Some(1) => {
                    let at = stack.iter().position(|&s| s == m).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m);
                    loops.push(cycle);
                }
                Some(_) => {}
                None => visit(m, next, state, stack, loops),
            }
        }
        stack.pop();
        state.insert(n, 2);
    }
    let (mut state, mut stack, mut loops) = (BTreeMap::new(), Vec::new(), Vec::new());
    let nodes: Vec<&str> = next.keys().copied().collect();
    for n in nodes {
        if !state.contains_key(n) {
            visit(n, &next, &mut state, &mut stack, &mut loops);
        }
    }
    let shown: Vec<String> = loops
        .iter()
        .map(|cycle| {
            let steps: Vec<String> = cycle
                .windows(2)
                .map(|w| {
                    format!(
                        "{} -> {} ({})",
                        w[0],
                        w[1],
                        edges[&(w[0].to_owned(), w[1].to_owned())][0]
                    )
                })
                .collect();
            steps.join("; ")
        })
        .collect();
    assert!(shown.is_empty(), "modules that use each other:\n{}", shown.join("\n"));
}

/// The check itself finds what it should: a path through `super`, a braced group, a use in
/// code beside a comment.
#[test]
fn the_check_reads_paths_as_the_compiler_does() {
    let module: ModPath = vec!["store".into(), "redis".into(), "keys".into()];
    let code = code_of(
        "use super::{script::Args, batch};\n// crate::server::x is a comment\nlet a = crate::core::bucket::MICRO; // crate::rules\npub use crate::server::y;\n",
    );
    let found = named_paths(&code, &module);
    let shown: Vec<String> = found.iter().map(|p| p.join("::")).collect();
    assert_eq!(
        shown,
        [
            "store::redis::script::Args",
            "store::redis::batch",
            "core::bucket::MICRO"
        ],
        "{code}"
    );
}
