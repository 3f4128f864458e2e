//! The store `tollgate serve` runs on, chosen by the `backend` setting at start.

use super::{
    Applied, BucketRef, MemoryStore, Metered, Peeked, PostgresStore, RedisStore, Resilient, Store, StoreError,
};
use crate::bucket::Demand;

/// How long the readiness probe of an open circuit may take: it is off the request path.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// One of the backends, each with its calls metered.
pub enum AnyStore {
    /// `backend: memory`.
    Memory(Metered<MemoryStore>),
    /// `backend: redis`, behind a circuit breaker (and a memory fallback when so configured).
    Redis(Resilient<RedisStore>),
    /// `backend: postgres`, behind a circuit breaker (and a memory fallback when so configured).
    Postgres(Resilient<PostgresStore>),
}

impl AnyStore {
    /// Whether the backend can take decisions now (`/readyz`): always for memory; for Redis,
    /// while its connections are up and its circuit is closed. While the circuit is open this
    /// sends the due probe (loading the scripts) itself, so a replica taken out of rotation for an outage
    /// comes back when Redis does, without needing requests.
    pub async fn ready(&self) -> Result<(), String> {
        match self {
            AnyStore::Memory(_) => Ok(()),
            AnyStore::Redis(r) => {
                let redis = r.primary();
                if !redis.is_connected() {
                    return Err(format!("not connected to Redis at {}", redis.describe()));
                }
                if !r.probe_if_open(|| redis.probe(PROBE_TIMEOUT)).await {
                    return Err(format!("Redis at {} is failing (circuit open)", redis.describe()));
                }
                Ok(())
            }
            AnyStore::Postgres(p) => {
                let postgres = p.primary();
                if !postgres.is_migrated() {
                    return Err(format!("not connected to Postgres at {}", postgres.describe()));
                }
                if !p.probe_if_open(|| postgres.probe(PROBE_TIMEOUT)).await {
                    return Err(format!("Postgres at {} is failing (circuit open)", postgres.describe()));
                }
                Ok(())
            }
        }
    }
}

impl Store for AnyStore {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        match self {
            AnyStore::Memory(s) => s.apply(buckets, demands).await,
            AnyStore::Redis(s) => s.apply(buckets, demands).await,
            AnyStore::Postgres(s) => s.apply(buckets, demands).await,
        }
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            AnyStore::Memory(s) => s.peek(buckets).await,
            AnyStore::Redis(s) => s.peek(buckets).await,
            AnyStore::Postgres(s) => s.peek(buckets).await,
        }
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            AnyStore::Memory(s) => s.reset(buckets).await,
            AnyStore::Redis(s) => s.reset(buckets).await,
            AnyStore::Postgres(s) => s.reset(buckets).await,
        }
    }

    fn rules_changed(&self) {
        match self {
            AnyStore::Memory(s) => s.rules_changed(),
            AnyStore::Redis(s) => s.rules_changed(),
            AnyStore::Postgres(s) => s.rules_changed(),
        }
    }
}
