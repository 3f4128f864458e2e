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
    /// Whether decisions can be taken now (`/readyz`): `Ok(None)` when the backend answers;
    /// `Ok(Some(why))` when it does not but its fallback (`failure_mode: fallback`) can decide
    /// (still ready: taking every replica out of rotation for a backend outage would leave
    /// Envoy with no one to ask, and the fallback unused); `Err(why)` otherwise. Memory always
    /// answers; Redis while its connections are up and its circuit is closed; Postgres while
    /// its schema is in place and its circuit is closed. While a circuit is open this sends the
    /// due probe itself, so a replica comes back when its backend does, without needing
    /// requests.
    pub async fn ready(&self) -> Result<Option<String>, String> {
        let (problem, fallback) = match self {
            AnyStore::Memory(_) => return Ok(None),
            AnyStore::Redis(r) => {
                let redis = r.primary();
                let problem = if !redis.is_connected() {
                    Some(format!("not connected to Redis at {}", redis.describe()))
                } else if !r.probe_if_open(|| redis.probe(PROBE_TIMEOUT)).await {
                    Some(format!("Redis at {} is failing (circuit open)", redis.describe()))
                } else {
                    None
                };
                (problem, r.fallback())
            }
            AnyStore::Postgres(p) => {
                let postgres = p.primary();
                let problem = if !postgres.is_migrated() {
                    Some(format!("not connected to Postgres at {}", postgres.describe()))
                } else if !p.probe_if_open(|| postgres.probe(PROBE_TIMEOUT)).await {
                    Some(format!("Postgres at {} is failing (circuit open)", postgres.describe()))
                } else {
                    None
                };
                (problem, p.fallback())
            }
        };
        match (problem, fallback) {
            (None, _) => Ok(None),
            (Some(problem), None) => Err(problem),
            (Some(problem), Some(f)) => match f.ready(PROBE_TIMEOUT).await {
                Ok(()) => Ok(Some(format!("{problem}; deciding on the {} fallback", f.name()))),
                Err(also) => Err(format!("{problem}; and the {} fallback: {also}", f.name())),
            },
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
