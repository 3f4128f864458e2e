//! The `admin.console` settings section.

use serde::{Deserialize, Serialize};

/// The operator console on the admin listener (docs/console.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleSettings {
    /// Serve the console's pages at `/` on the admin listener (the JSON API is served either
    /// way).
    pub enabled: bool,
    /// Show the descriptor values of the most-denied buckets (they can be client identities or
    /// API keys); off, each value is masked and told apart by a short digest that changes with
    /// every restart.
    pub show_values: bool,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        ConsoleSettings {
            enabled: true,
            show_values: false,
        }
    }
}
