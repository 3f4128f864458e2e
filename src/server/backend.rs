//! The store `serve` decides on, built from the settings: the memory store with its sweep, and
//! Redis or Postgres behind their circuit breakers, with their fallbacks and the local layer
//! (docs/backends.md).

use std::sync::Arc;
use std::time::Duration;

use crate::core::clock::{Clock, SkewedClock, SystemClock};
use crate::server::settings::{Backend, FailureMode, FallbackBackend, Settings};
use crate::store::{
    start_shared, AnyStore, Fallback, Guarded, Local, MemoryStore, Metered, PostgresStore, RedisStore, Resilient,
};

/// The memory store, with its sweep started: the backend itself, or a fallback
/// (`failure_mode: fallback`).
pub(super) fn memory_store(settings: &Settings, clock: Arc<dyn Clock>) -> MemoryStore {
    let memory = MemoryStore::new(settings.memory.shards, settings.memory.max_buckets, clock);
    spawn_sweeper(
        memory.clone(),
        Duration::from_secs(settings.memory.sweep_interval_seconds.0.max(1)),
    );
    memory
}

/// The configured backend, connected: `memory` itself, or Redis or Postgres with `memory` as
/// their fallback where configured.
///
/// Errors: see [`redis_store`] and [`postgres_store`].
pub(super) async fn build_store(
    settings: &Settings,
    memory: &MemoryStore,
    clock: Arc<dyn Clock>,
) -> anyhow::Result<AnyStore> {
    Ok(match settings.backend {
        Backend::Memory => AnyStore::Memory(Metered::new(memory.clone(), "memory")),
        Backend::Redis => AnyStore::Redis(Local::new(
            redis_store(settings, memory.clone(), clock).await?,
            &settings.local,
        )),
        Backend::Postgres => AnyStore::Postgres(Local::new(
            postgres_store(settings, memory.clone()).await?,
            &settings.local,
        )),
    })
}

/// The environment variable that skews the local clock, for tests of replicas whose clocks
/// disagree (milliseconds, may be negative). Not a setting: nothing in production should set it.
pub const TEST_CLOCK_SKEW_ENV: &str = "TOLLGATE_TEST_CLOCK_SKEW_MS";

/// The system clock, skewed by [`TEST_CLOCK_SKEW_ENV`] when that is set.
pub(super) fn local_clock() -> Arc<dyn Clock> {
    match std::env::var(TEST_CLOCK_SKEW_ENV)
        .ok()
        .and_then(|v| v.parse::<i64>().ok())
    {
        Some(ms) => {
            tracing::warn!(
                skew_ms = ms,
                "{TEST_CLOCK_SKEW_ENV} is set: the local clock is skewed (for tests only)"
            );
            Arc::new(SkewedClock::new(SystemClock, ms.saturating_mul(1000)))
        }
        None => Arc::new(SystemClock),
    }
}

/// Builds and connects the Redis store (docs/backends.md) behind its circuit breaker.
///
/// Errors: when Redis cannot be reached at start and `redis.unreachable_at_start` is `exit`.
async fn redis_store(
    settings: &Settings,
    memory: MemoryStore,
    clock: Arc<dyn Clock>,
) -> anyhow::Result<Resilient<RedisStore>> {
    let r = &settings.redis;
    let redis = RedisStore::new(r, clock)?;
    let detail = match (r.cluster, r.sentinel.enabled()) {
        (true, _) => "cluster",
        (false, true) => "sentinel",
        (false, false) => "single node",
    };
    // A master name no sentinel knows is a setting to fix, not an outage to wait out.
    let known = redis.check_sentinel_master(r.connect_timeout_ms.duration()).await;
    known.map_err(|e| anyhow::anyhow!("cannot use {e}"))?;
    start_shared(&redis, r.unreachable_at_start, r.connect_timeout_ms.duration(), detail)
        .await
        .map_err(|e| anyhow::anyhow!("cannot use {e}"))?;
    let fallback = match (r.failure_mode, r.fallback) {
        (FailureMode::Fallback, FallbackBackend::Memory) => Some(Fallback::Memory(Metered::new(memory, "memory"))),
        (FailureMode::Fallback, FallbackBackend::Postgres) => {
            let postgres = connect_postgres(settings).await.map_err(|e| {
                anyhow::anyhow!(
                    "redis.failure_mode: fallback decides on Postgres (redis.fallback: postgres, the default), \
                     which cannot be used: {e:#}; configure the postgres section, or set redis.fallback: memory \
                     for a local store per replica"
                )
            })?;
            let p = &settings.postgres;
            Some(Fallback::Postgres(Guarded::with_policy(
                Metered::new(postgres, "postgres"),
                "postgres",
                p.breaker_policy(),
            )))
        }
        _ => None,
    };
    Ok(Resilient::with_policy(
        Metered::new(redis, "redis"),
        "redis",
        r.breaker_policy(),
        fallback,
    ))
}

/// Builds and connects the Postgres store (docs/backends.md) behind its circuit breaker, and starts
/// its sweep.
///
/// Errors: invalid settings, or Postgres not reachable (or its migrations failing) at start
/// when `postgres.unreachable_at_start` is `exit`.
async fn postgres_store(settings: &Settings, memory: MemoryStore) -> anyhow::Result<Resilient<PostgresStore>> {
    let p = &settings.postgres;
    let postgres = connect_postgres(settings).await?;
    let fallback = (p.failure_mode == FailureMode::Fallback).then(|| Fallback::Memory(Metered::new(memory, "memory")));
    Ok(Resilient::with_policy(
        Metered::new(postgres, "postgres"),
        "postgres",
        p.breaker_policy(),
        fallback,
    ))
}

/// Builds and connects the Postgres store of the `postgres` section (as the backend, or as
/// Redis's fallback), and starts its sweep.
///
/// Errors: invalid settings, or Postgres not reachable (or its migrations failing) at start
/// when `postgres.unreachable_at_start` is `exit`.
async fn connect_postgres(settings: &Settings) -> anyhow::Result<PostgresStore> {
    let p = &settings.postgres;
    let postgres = PostgresStore::new(p)?;
    let detail = format!("schema {}", p.schema);
    start_shared(
        &postgres,
        p.unreachable_at_start,
        p.connect_timeout_ms.duration(),
        &detail,
    )
    .await
    .map_err(|e| anyhow::anyhow!("cannot use {e}"))?;
    let sweeper = postgres.clone();
    let (every, batch) = (p.sweep_interval_seconds.duration(), p.sweep_batch);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !sweeper.is_migrated() {
                continue;
            }
            // Bounded work per pass: at most 10 statements of `batch` rows.
            sweeper.sweep_pass(batch, 10).await;
        }
    });
    Ok(postgres)
}

fn spawn_sweeper(store: MemoryStore, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // Off the runtime's threads: on a current-thread runtime a sweep of a million
            // buckets would otherwise hold up every request for its whole length (it locks one
            // shard at a time, a few hundred buckets at a time, so requests wait microseconds).
            let store = store.clone();
            let swept = tokio::task::spawn_blocking(move || (store.sweep(), store.len())).await;
            if let Ok((dropped, held)) = swept {
                tracing::trace!(dropped, held, "swept full buckets");
            }
        }
    });
}
