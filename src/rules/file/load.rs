//! Reading rules files from disk.

use std::path::{Path, PathBuf};

use super::compile::compile;
use super::model::RulesFile;
use super::{ConfigError, ConfigErrors};
use crate::rules::RuleSet;

/// The rules files at `path`: the file itself, or the `*.yaml` / `*.yml` files directly inside a
/// directory (in any case: `.YAML` too), sorted by name. Hidden entries (`.foo`, and Kubernetes
/// ConfigMap `..data` folders) are skipped, so a mounted ConfigMap is read once through its
/// top-level links. An empty list is not an error here; `tollgate check` rejects it (see
/// [`RuleSet::is_empty`]).
pub(crate) fn rule_files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let meta = std::fs::metadata(path).map_err(|e| ConfigError::file(path, format!("cannot read rules: {e}")))?;
    if meta.is_file() {
        return Ok(vec![path.to_owned()]);
    }
    let entries = std::fs::read_dir(path).map_err(|e| ConfigError::file(path, format!("cannot list rules: {e}")))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| ConfigError::file(path, format!("cannot list rules: {e}")))?;
        let p = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let yaml = p
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
        if name.starts_with('.') || !yaml || !p.is_file() {
            continue;
        }
        files.push(p);
    }
    files.sort();
    Ok(files)
}

/// Loads and compiles every rules file at `path` (a file or a directory, see `rule_files`).
///
/// Errors: every problem found, each naming the file, the rule and the reason; one bad file
/// rejects the whole set.
pub fn load_rules(path: &Path) -> Result<RuleSet, ConfigErrors> {
    load_rules_merging(path, false)
}

/// As [`load_rules`]; with `merge_domains`, files that declare the same domain are merged
/// into one domain as envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG=true` merges them (their
/// top-level descriptors side by side, a key and value declared twice an error), instead of
/// the second being an error.
///
/// Errors: as [`load_rules`].
pub fn load_rules_merging(path: &Path, merge_domains: bool) -> Result<RuleSet, ConfigErrors> {
    let files = rule_files(path).map_err(|e| ConfigErrors(vec![e]))?;
    let mut parsed = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        match std::fs::read_to_string(&file) {
            Err(e) => errors.push(ConfigError::file(&file, format!("cannot read: {e}"))),
            Ok(text) => match parse_one(&file, &text) {
                Ok(rules) => parsed.push((file, rules)),
                Err(e) => errors.push(e),
            },
        }
    }
    match compile(parsed, merge_domains) {
        Ok(set) if errors.is_empty() => Ok(set),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(mut more) => {
            errors.append(&mut more);
            Err(ConfigErrors(errors))
        }
    }
}

/// Compiles one rules file from its text, exactly as [`load_rules`] compiles a file `file` holding
/// it (`file` only names it in errors and in [`RuleSet::files`]): for callers that hold the text
/// already, such as the fuzz targets (fuzz/), which must not touch the disk per input.
///
/// Errors: the file is empty, does not parse, or does not compile; each error names `file`.
pub fn load_rules_text(file: &Path, text: &str) -> Result<RuleSet, ConfigErrors> {
    let rules = parse_one(file, text).map_err(|e| ConfigErrors(vec![e]))?;
    compile(vec![(file.to_owned(), rules)], false).map_err(ConfigErrors)
}

/// Compiles rules given in the rules model rather than as files (the `RateLimitConfig`s an
/// xDS server pushes, mapped onto it), exactly as [`load_rules`] compiles files holding the
/// same rules: each `(name, rules)` is one domain, `name` standing in for the file in errors,
/// [`RuleSet::files`] and each domain's `file`.
///
/// Errors: every problem, each naming `name`, the rule and the reason.
pub(crate) fn compile_models(models: Vec<(PathBuf, RulesFile)>) -> Result<RuleSet, ConfigErrors> {
    compile(models, false).map_err(ConfigErrors)
}

/// One file's text parsed, or the error [`load_rules`] reports for it.
fn parse_one(file: &Path, text: &str) -> Result<RulesFile, ConfigError> {
    if text.trim().is_empty() {
        return Err(ConfigError::file(file, "the file is empty"));
    }
    parse(text).map_err(|reason| ConfigError::file(file, format!("invalid rules: {reason}")))
}

/// One rules file read and parsed as written, without compiling it: `tollgate check --explain`
/// reads the fields as the file gives them (units, `requests_per_unit`) beside the compiled
/// rules. Errors: the file cannot be read, or does not parse (the reason, as [`load_rules`]
/// reports it).
pub(crate) fn parse_file(path: &Path) -> Result<RulesFile, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))?;
    parse(&text)
}

/// How many levels of merge keys within merge keys are expanded.
const MAX_MERGE_DEPTH: usize = 32;

/// Parses one rules file. YAML merge keys (`<<: *anchor`, which envoyproxy/ratelimit's YAML
/// library supports) are expanded first; only text containing `<<` takes that path, so the errors
/// of every other file keep serde's line and column.
fn parse(text: &str) -> Result<RulesFile, String> {
    if !text.contains("<<") {
        return serde_yaml::from_str(text).map_err(|e| e.to_string());
    }
    let mut value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
    // `apply_merge` expands one level: a merged mapping that itself holds `<<` brings that key
    // back. Repeat until none is left (each pass removes one level of a finite document).
    let mut passes = 0;
    while has_merge_key(&value) {
        passes += 1;
        if passes > MAX_MERGE_DEPTH {
            return Err(format!("merge keys `<<` nested more than {MAX_MERGE_DEPTH} deep"));
        }
        value.apply_merge().map_err(|e| format!("merge key `<<`: {e}"))?;
    }
    // Deserialize through text again, not from the `Value`, which would refuse a number where a
    // string is expected: `value: 404` then reads as "404", as in a file without merge keys (a
    // number written unusually, like `0x1F`, comes back in its plain form, "31"). Positions in
    // that text are not the file's, so they are left out.
    let expanded = serde_yaml::to_string(&value).map_err(|e| e.to_string())?;
    serde_yaml::from_str(&expanded).map_err(|e| {
        let message = e.to_string();
        let message = match e.location() {
            Some(at) => {
                let suffix = format!(" at line {} column {}", at.line(), at.column());
                message.strip_suffix(&suffix).unwrap_or(&message).to_owned()
            }
            None => message,
        };
        format!("{message} (after expanding merge keys `<<`)")
    })
}

/// Whether a mapping anywhere in `value` still has a `<<` key.
fn has_merge_key(value: &serde_yaml::Value) -> bool {
    match value {
        serde_yaml::Value::Mapping(m) => m.contains_key("<<") || m.values().any(has_merge_key),
        serde_yaml::Value::Sequence(s) => s.iter().any(has_merge_key),
        serde_yaml::Value::Tagged(t) => has_merge_key(&t.value),
        _ => false,
    }
}
