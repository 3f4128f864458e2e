//! Reading rules files from disk.

use std::path::{Path, PathBuf};

use super::compile::compile;
use super::model::RulesFile;
use super::{ConfigError, ConfigErrors};
use crate::rules::RuleSet;

/// The rules files at `path`: the file itself, or the `*.yaml` / `*.yml` files directly inside a
/// directory, sorted by name. Hidden entries (`.foo`, and Kubernetes ConfigMap `..data`
/// folders) are skipped, so a mounted ConfigMap is read once through its top-level links.
pub fn rule_files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
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
        let yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        if name.starts_with('.') || !yaml || !p.is_file() {
            continue;
        }
        files.push(p);
    }
    files.sort();
    Ok(files)
}

/// Loads and compiles every rules file at `path` (a file or a directory, see [`rule_files`]).
///
/// Errors: every problem found, each naming the file, the rule and the reason; one bad file
/// rejects the whole set.
pub fn load_rules(path: &Path) -> Result<RuleSet, ConfigErrors> {
    let files = rule_files(path).map_err(|e| ConfigErrors(vec![e]))?;
    let mut parsed = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        match std::fs::read_to_string(&file) {
            Err(e) => errors.push(ConfigError::file(&file, format!("cannot read: {e}"))),
            Ok(text) if text.trim().is_empty() => errors.push(ConfigError::file(&file, "the file is empty")),
            Ok(text) => match serde_yaml::from_str::<RulesFile>(&text) {
                Ok(rules) => parsed.push((file, rules)),
                Err(e) => errors.push(ConfigError::file(&file, format!("invalid rules: {e}"))),
            },
        }
    }
    match compile(parsed) {
        Ok(set) if errors.is_empty() => Ok(set),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(mut more) => {
            errors.append(&mut more);
            Err(ConfigErrors(errors))
        }
    }
}
