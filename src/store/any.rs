//! The store `tollgate serve` runs on, chosen by the `backend` setting at start.

use super::{Applied, BucketRef, MemoryStore, Metered, Peeked, RedisStore, Resilient, Store, StoreError};
use crate::bucket::Demand;

/// One of the backends, each with its calls metered.
pub enum AnyStore {
    /// `backend: memory`.
    Memory(Metered<MemoryStore>),
    /// `backend: redis`, behind a circuit breaker (and a memory fallback when so configured).
    Redis(Resilient<RedisStore>),
}

impl AnyStore {
    /// Whether the backend can take decisions now: always for memory; for Redis, while its
    /// connections are up and its circuit is closed (`/readyz`).
    pub fn ready(&self) -> Result<(), String> {
        match self {
            AnyStore::Memory(_) => Ok(()),
            AnyStore::Redis(r) => {
                if !r.primary().is_connected() {
                    Err(format!("not connected to Redis at {}", r.primary().describe()))
                } else if r.circuit_open() {
                    Err(format!("Redis at {} is failing (circuit open)", r.primary().describe()))
                } else {
                    Ok(())
                }
            }
        }
    }
}

impl Store for AnyStore {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        match self {
            AnyStore::Memory(s) => s.apply(buckets, demands).await,
            AnyStore::Redis(s) => s.apply(buckets, demands).await,
        }
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            AnyStore::Memory(s) => s.peek(buckets).await,
            AnyStore::Redis(s) => s.peek(buckets).await,
        }
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            AnyStore::Memory(s) => s.reset(buckets).await,
            AnyStore::Redis(s) => s.reset(buckets).await,
        }
    }

    fn rules_changed(&self) {
        match self {
            AnyStore::Memory(s) => s.rules_changed(),
            AnyStore::Redis(s) => s.rules_changed(),
        }
    }
}
