//! The checkers the deployment and documentation tests run (`hadolint`, `kubernetes-validate`,
//! `promtool`), installed by `scripts/ensure-tools`.

use std::path::{Path, PathBuf};

/// Where tool `name` is: `$TOLLGATE_TOOLS_DIR/<name>`, else
/// `~/.cache/tollgate/tools/bin/<name>` (where `scripts/ensure-tools` links it), else `name` on
/// `PATH`.
///
/// Panics when `TOLLGATE_TOOLS_DIR` is set but holds no such file: an explicit choice that does
/// not work should not silently fall back to another copy.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TOLLGATE_TOOLS_DIR").filter(|v| !v.is_empty()) {
        let path = Path::new(&dir).join(name);
        assert!(path.is_file(), "TOLLGATE_TOOLS_DIR has no {}", path.display());
        return Some(path);
    }
    if let Some(home) = std::env::var_os("HOME") {
        let cached = Path::new(&home).join(".cache/tollgate/tools/bin").join(name);
        if cached.is_file() {
            return Some(cached);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Tool `name` for test `test`, or `None` to skip it: without the tool the test fails when
/// `CI=true` and is skipped (with a note on stderr) otherwise.
pub fn tool_or_skip(test: &str, name: &str) -> Option<PathBuf> {
    let found = find_tool(name);
    if found.is_none() {
        let how = "run scripts/ensure-tools, or set TOLLGATE_TOOLS_DIR";
        let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        assert!(!ci, "{test}: {name} not found and CI=true: {how}");
        eprintln!("SKIPPED {test}: {name} not found ({how})");
    }
    found
}
