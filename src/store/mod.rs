//! Where bucket state lives. A store runs one request's decision atomically: it reads the
//! states of the request's bucket instances, calls [`crate::bucket::decide`], and writes back
//! what changed, all before any other request may see those buckets.

mod memory;

use std::future::Future;

pub use memory::{MemoryStore, MemoryStoreStats};

use crate::bucket::{Decision, Demand};
use crate::schedule::Plan;

/// One bucket instance a request touches.
#[derive(Clone, Debug)]
pub struct BucketRef {
    /// The instance identity, from [`crate::matcher::instance_key`].
    pub key: String,
    /// Its limit and how the limit changes over time; the store evaluates it at its own clock's
    /// now (DESIGN 1.5).
    pub plan: Plan,
}

/// A store's answer: the decision and the instant, by the store's clock, it was taken at.
#[derive(Clone, Debug)]
pub struct Applied {
    /// Microseconds since the epoch, by the store's clock.
    pub now_us: u64,
    /// What was decided, per demand and per instance.
    pub decision: Decision,
}

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backend could not be reached or did not answer in time.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
}

/// A place to keep bucket state and decide on it atomically.
pub trait Store: Send + Sync + 'static {
    /// Decides one request over `buckets` (distinct instances) with `demands` (whose
    /// `instance` index into `buckets`), all or nothing, and persists the result.
    fn apply(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
    ) -> impl Future<Output = Result<Applied, StoreError>> + Send;

    /// Told when the rules in force are replaced, so that what a store remembers about a bucket
    /// under the old rules (such as when it would be full) is not applied under the new ones.
    fn rules_changed(&self) {}
}
