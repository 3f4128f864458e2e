//! The shape of `src/` (ARCHITECTURE.md, "Layers"): each top-level module is a layer that uses
//! only the layers below it, and no two modules use each other, directly or round a loop. The
//! check reads the source: every `crate::` and `super::` path outside comments, resolved to the
//! module that defines it. Re-exports (`pub use`) and module declarations are not uses.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each layer and the layers it may use, besides itself.
const LAYERS: [(&str, &[&str]); 11] = [
    ("core", &[]),
    ("telemetry", &[]),
    ("rules", &["core", "telemetry"]),
    ("store", &["core", "telemetry"]),
    ("decision", &["core", "telemetry", "rules", "store"]),
    ("rlqs", &["core", "telemetry", "rules", "store", "decision"]),
    // envoyproxy/ratelimit's stats over statsd: a surface of its own beside `server`.
    ("statsd", &["core", "telemetry"]),
    ("traces", &["core", "telemetry", "rules", "store", "decision"]),
    // The admin API (buckets, explain, /config) on its own listener.
    ("admin", &["core", "telemetry", "rules", "store", "decision", "rlqs"]),
    // The operator console: pages on the admin listener over the admin API.
    ("console", &["core", "telemetry", "rules", "store", "decision", "admin"]),
    (
        "server",
        &[
            "core",
            "telemetry",
            "rules",
            "store",
            "decision",
            "rlqs",
            "statsd",
            "traces",
            "admin",
            "console",
        ],
    ),
];

/// The items `lib.rs` defines itself (not re-exports of a module's).
const LIB_ITEMS: [&str; 1] = ["error_chain"];

/// A module's path from the crate root, e.g. `["store", "redis", "keys"]`.
type ModPath = Vec<String>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `src/`, sorted.
fn rust_files() -> Vec<PathBuf> {
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
    let mut files = Vec::new();
    walk(&src(), &mut files);
    files.sort();
    files
}

/// Every source file of the library (not `lib.rs`, `main.rs` or `bin/`) and its module path.
fn library_files() -> Vec<(PathBuf, ModPath)> {
    let root = src();
    rust_files()
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
        let code = without_trailing_comment(line);
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

/// The uses in `edges` that go against [`LAYERS`]: a layer using one above it or beside it, or
/// a module in no layer.
fn layer_violations(edges: &BTreeMap<(String, String), Vec<String>>) -> Vec<String> {
    let allowed: BTreeMap<&str, &[&str]> = LAYERS.into_iter().collect();
    let mut wrong = Vec::new();
    for ((from, to), why) in edges {
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
    wrong
}

#[test]
fn each_layer_uses_only_the_layers_below_it() {
    let wrong = layer_violations(&uses());
    assert!(wrong.is_empty(), "uses against the layers:\n{}", wrong.join("\n"));
}

/// The loops among the modules of `edges`, each as its steps with the first use behind each.
fn module_loops(edges: &BTreeMap<(String, String), Vec<String>>) -> Vec<String> {
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
    shown
}

#[test]
fn no_two_modules_use_each_other_round_a_loop() {
    let shown = module_loops(&uses());
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

/// Crates and `std` modules that do I/O, spawn, or run tasks: the core takes a time and a state
/// and returns a decision, so it names none of them (its clock reads `std::time` only).
const IO_PATHS: [&str; 13] = [
    "tokio",
    "fred",
    "sqlx",
    "tonic",
    "axum",
    "hyper",
    "notify",
    "reqwest",
    "metrics",
    "std::fs",
    "std::net",
    "std::io",
    "std::process",
];

/// What reads settings from their sources: only `server/` (and the binaries) name these.
const SETTINGS_CRATES: [&str; 2] = ["clap", "figment"];

/// The I/O paths (see [`IO_PATHS`]) that `code` names.
fn io_uses(code: &str) -> Vec<String> {
    paths_named(code, &IO_PATHS)
}

/// Which of `paths` (crates, or `std` modules) `code` names as the start of a path.
fn paths_named(code: &str, paths: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for &io in paths {
        let mut from = 0;
        while let Some(i) = code[from..].find(io).map(|i| i + from) {
            from = i + io.len();
            let before = code[..i].chars().next_back();
            let after = &code[from..];
            // A path start (not `my_tokio`, `x::tokio`), followed by `::`, `;` or `}`.
            let starts = !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            if starts && (after.starts_with("::") || after.starts_with(';') || after.starts_with('}')) {
                found.push(io.to_string());
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// Where the library's own code (test modules left out) in layers `layer` picks names one of
/// `paths`, as `file: path`.
fn named_in_layers(layer: impl Fn(&str) -> bool, paths: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, module) in library_files() {
        if module.first().is_some_and(|m| layer(m)) && path.file_stem().is_none_or(|s| s != "tests") {
            let code = code_of_with_uses(&without_test_modules(&std::fs::read_to_string(&path).unwrap()));
            for name in paths_named(&code, paths) {
                found.push(format!("{}: {name}", path.strip_prefix(src()).unwrap().display()));
            }
        }
    }
    found
}

#[test]
fn only_the_server_reads_settings() {
    let wrong = named_in_layers(|m| m != "server", &SETTINGS_CRATES);
    assert!(
        wrong.is_empty(),
        "below the server, code names a settings loader:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_core_does_no_io() {
    let wrong = named_in_layers(|m| m == "core", &IO_PATHS);
    assert!(
        wrong.is_empty(),
        "the core names I/O crates or modules:\n{}",
        wrong.join("\n")
    );
}

/// `line` without a comment after its code. A `//` after a quote (a URL in a string) keeps the
/// line whole.
fn without_trailing_comment(line: &str) -> &str {
    match line.find("//") {
        Some(i) if !line[..i].contains('"') => &line[..i],
        _ => line,
    }
}

/// The code of a file without its comments, `use` lines kept (a `use tokio::...` is a use).
fn code_of_with_uses(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(without_trailing_comment)
        .collect::<Vec<_>>()
        .join("\n")
}

/// How long a source file's own code may grow (its lines without inline test modules; `tests.rs`
/// files are tests): past this, split it by what it does. 800, not less: a dozen files hold
/// 600 to 800 lines of one concern each (a store, the admin API, the settings), and splitting
/// them would scatter one concern over several files.
const MAX_FILE_LINES: usize = 800;

/// Files allowed past [`MAX_FILE_LINES`], each with why.
const LONG_FILES: [(&str, &str); 5] = [
    (
        "bin/tollgate-loadgen.rs",
        "the load generator binary: its options, its open- and closed-loop drivers and its report, \
         a tool apart from the service",
    ),
    (
        "server/settings/envoyproxy_env.rs",
        "the envoyproxy/ratelimit environment: one table of their variables and its mapping, read as one",
    ),
    (
        "rules/file/compile.rs",
        "the rules compiler: one pass from the file's model to the rule set, every part sharing the \
         compiler's state (the file and rule named in each error)",
    ),
    (
        "store/redis/mod.rs",
        "the Redis store: connecting, loading the scripts, deciding, peeking and resetting share one \
         connection type; the batcher, the keys, the scripts' codec, a request over Cluster slots and \
         the Cluster's masters are already files of their own",
    ),
    (
        "decision/limiter.rs",
        "the decision path, read top to bottom: resolving descriptors, the demands, the store call, the \
         answer; the response and the counting are already files of their own",
    ),
];

/// The files of `files` (path relative to `src/`, text) whose own code is longer than `max`
/// lines and not in `allowed`, with their length.
fn long_files(files: &[(String, String)], max: usize, allowed: &[(&str, &str)]) -> Vec<String> {
    files
        .iter()
        .filter(|(rel, _)| !rel.ends_with("/tests.rs") && rel != "tests.rs")
        .filter(|(rel, _)| !allowed.iter().any(|(a, _)| a == rel))
        .filter_map(|(rel, text)| {
            let lines = without_test_modules(text).lines().count();
            (lines > max).then(|| format!("{rel}: {lines} lines (at most {max})"))
        })
        .collect()
}

/// Every `.rs` file under `src/` (binaries too), as its path relative to `src/` and its text.
fn all_source_files() -> Vec<(String, String)> {
    rust_files()
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(src()).unwrap().display().to_string();
            (rel, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

#[test]
fn no_source_file_grows_past_its_bound() {
    let files = all_source_files();
    let long = long_files(&files, MAX_FILE_LINES, &LONG_FILES);
    assert!(
        long.is_empty(),
        "files to split (or to allow in LONG_FILES, saying why):\n{}",
        long.join("\n")
    );
    // An allowance for a file that is short again, or gone, is stale.
    for (allowed, _) in LONG_FILES {
        let still_long = files
            .iter()
            .any(|(rel, text)| rel == allowed && without_test_modules(text).lines().count() > MAX_FILE_LINES);
        assert!(
            still_long,
            "{allowed} is in LONG_FILES but no longer past {MAX_FILE_LINES} lines"
        );
    }
}

/// The checks fail on purpose-made violations: a use upward, a loop, I/O in the core, a long
/// file, each from the same functions the real checks call.
#[test]
fn the_checks_fail_on_violations() {
    let edge = |from: &str, to: &str| {
        (
            (from.to_string(), to.to_string()),
            vec![format!("{from}.rs: crate::{to}::x")],
        )
    };
    let upward: BTreeMap<_, _> = [
        edge("core::bucket", "server::settings"),
        edge("store::redis", "decision::limiter"),
    ]
    .into();
    let wrong = layer_violations(&upward);
    assert_eq!(wrong.len(), 2, "{wrong:?}");
    assert!(wrong[0].starts_with("core::bucket uses server::settings"), "{wrong:?}");
    let sideways: BTreeMap<_, _> = [edge("store::memory", "rules::matcher")].into();
    assert_eq!(layer_violations(&sideways).len(), 1);
    let outside: BTreeMap<_, _> = [edge("extra::thing", "core::bucket")].into();
    assert!(layer_violations(&outside)[0].contains("not in a layer"));
    let downward: BTreeMap<_, _> = [
        edge("server::check", "core::bucket"),
        edge("decision::limiter", "rules"),
    ]
    .into();
    assert!(layer_violations(&downward).is_empty());

    let a_loop: BTreeMap<_, _> = [
        edge("rules", "telemetry"),
        edge("telemetry", "decision::limiter"),
        edge("decision::limiter", "rules"),
    ]
    .into();
    let loops = module_loops(&a_loop);
    assert_eq!(loops.len(), 1, "{loops:?}");
    assert!(
        loops[0].contains("rules -> telemetry") && loops[0].contains("decision::limiter -> rules"),
        "{loops:?}"
    );
    let no_loop: BTreeMap<_, _> = [edge("rules", "telemetry"), edge("decision", "rules")].into();
    assert!(module_loops(&no_loop).is_empty());

    let io = code_of_with_uses("use tokio::sync::Mutex;\nlet f = std::fs::read(p); // sqlx::query\nuse std::time::Duration;\nlet my_tokio = 1;\n");
    assert_eq!(io_uses(&io), ["std::fs", "tokio"]);
    assert!(io_uses("use std::time::{Duration, SystemTime};\nlet t = crate::core::clock::now;").is_empty());
    let derive = code_of_with_uses("#[derive(Clone, clap::ValueEnum)]\nenum Mode {}\n");
    assert_eq!(paths_named(&derive, &SETTINGS_CRATES), ["clap"]);

    let long = "fn x() {}\n".repeat(MAX_FILE_LINES + 1);
    let files = vec![
        ("store/big.rs".to_string(), long.clone()),
        ("store/tests.rs".to_string(), long.clone()),
        ("store/allowed.rs".to_string(), long.clone()),
        (
            "store/with_tests.rs".to_string(),
            format!("fn a() {{}}\n#[cfg(test)]\nmod tests {{\n{long}}}\n"),
        ),
    ];
    assert_eq!(
        long_files(&files, MAX_FILE_LINES, &[("store/allowed.rs", "a reason")]),
        [format!(
            "store/big.rs: {} lines (at most {MAX_FILE_LINES})",
            MAX_FILE_LINES + 1
        )]
    );
}
