//! The `local` settings section: the over-limit cache and token leases of a replica on a
//! shared backend (docs/backends.md, "Deciding locally").

use serde::{Deserialize, Serialize};

use crate::core::units::Millis;

/// What a replica on Redis or Postgres decides without a store call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalSettings {
    /// Deny locally what the store's last answer shows it would deny (exact: never admits
    /// anything the store would not).
    pub over_limit_cache: bool,
    /// Most buckets the over-limit cache holds; beyond it the one trusted for the shortest
    /// time is evicted (counted in `tollgate_local_cache_evictions_total`).
    pub over_limit_cache_entries: usize,
    /// Longest a local denial stands without asking the store, in milliseconds: a refund or
    /// reset made on another replica is honoured here within this time at the latest (sooner
    /// when the bucket refills earlier).
    pub over_limit_hold_ms: Millis,
    /// How long a replica keeps leased tokens (a rule's `lease`) before giving back what it
    /// did not spend, in milliseconds.
    pub lease_hold_ms: Millis,
}

impl Default for LocalSettings {
    fn default() -> Self {
        LocalSettings {
            over_limit_cache: true,
            over_limit_cache_entries: 100_000,
            over_limit_hold_ms: Millis(5_000),
            lease_hold_ms: Millis(1_000),
        }
    }
}

impl LocalSettings {
    /// Every problem with these settings, each a sentence naming the setting; empty when
    /// there is none: a cache of no entries, a hold of 0.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.over_limit_cache && self.over_limit_cache_entries == 0 {
            problems.push(
                "local.over_limit_cache_entries must be at least 1 (or set local.over_limit_cache: false)".into(),
            );
        }
        if self.over_limit_hold_ms.0 == 0 {
            problems.push("local.over_limit_hold_ms must be at least 1".into());
        }
        if self.lease_hold_ms.0 == 0 {
            problems.push("local.lease_hold_ms must be at least 1".into());
        }
        problems
    }
}
