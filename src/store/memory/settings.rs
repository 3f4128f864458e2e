//! The `memory` settings section, as the memory store takes it.

use crate::core::units::Seconds;
use serde::{Deserialize, Serialize};

/// The memory backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemorySettings {
    /// Lock shards; more shards, less contention.
    pub shards: usize,
    /// Most buckets held; beyond it the bucket closest to full is evicted (and counted).
    pub max_buckets: usize,
    /// Seconds between sweeps that drop buckets which have refilled to full.
    pub sweep_interval_seconds: Seconds,
}

impl Default for MemorySettings {
    fn default() -> Self {
        MemorySettings {
            shards: 64,
            max_buckets: 1_000_000,
            sweep_interval_seconds: Seconds(10),
        }
    }
}
