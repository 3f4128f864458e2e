//! Configuration errors that name the file, the rule and the reason.

use std::fmt;
use std::path::PathBuf;

/// One problem found in a rules file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The file the problem is in (or the path that could not be read).
    pub file: PathBuf,
    /// The rule: a descriptor path like `api_key.path=/upload`, `buckets.per_key`, or `None`
    /// for problems with the file as a whole.
    pub rule: Option<String>,
    /// What is wrong, in words an operator can act on.
    pub reason: String,
}

impl ConfigError {
    /// A problem with a whole file.
    pub fn file(file: impl Into<PathBuf>, reason: impl Into<String>) -> ConfigError {
        ConfigError {
            file: file.into(),
            rule: None,
            reason: reason.into(),
        }
    }

    /// `path` holds no rules file (see `crate::rules::file::rule_files`): a directory with no
    /// `*.yaml` / `*.yml` file directly inside, other than hidden ones.
    pub fn no_rules_files(path: impl Into<PathBuf>) -> ConfigError {
        ConfigError::file(
            path,
            "no rules files found (expected *.yaml or *.yml files directly inside; hidden entries are skipped)",
        )
    }

    /// A problem with one rule of a file.
    pub fn rule(file: impl Into<PathBuf>, rule: impl Into<String>, reason: impl Into<String>) -> ConfigError {
        ConfigError {
            file: file.into(),
            rule: Some(rule.into()),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.rule {
            Some(rule) => write!(f, "{}: rule `{}`: {}", self.file.display(), rule, self.reason),
            None => write!(f, "{}: {}", self.file.display(), self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in one load; a load with any problem is rejected whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}
