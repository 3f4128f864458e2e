//! A shared backend with a circuit breaker and, optionally, a fallback store (DESIGN 2).
//!
//! While the breaker is closed every call goes to the primary (Redis or Postgres). Repeated failures open
//! it ([`Breaker`]): calls then skip the primary for a while instead of each waiting for its
//! timeout, and a probe tests it again later. A call the primary fails, or skips, goes to the
//! fallback when there is one (`failure_mode: fallback`: for Redis, the Postgres store or a
//! local memory store; see [`Fallback`]), else returns the error, which the limiter answers by
//! the failure mode (`allow`, `deny` or `error`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Applied, Breaker, BucketRef, MemoryStore, Metered, Peeked, PostgresStore, Store, StoreError};
use crate::bucket::Demand;
use crate::metrics::BACKEND_FALLBACKS;

/// `P` behind a circuit breaker, with an optional fallback.
pub struct Resilient<P> {
    primary: Metered<P>,
    fallback: Option<Fallback>,
    breaker: Breaker,
    started: Instant,
    /// When a failure was last logged (µs since `started`), so an outage logs its failures
    /// about once a second, not once a request.
    last_logged_us: AtomicU64,
    fallbacks: metrics::Counter,
    backend: &'static str,
}

/// Logged failures are at least this far apart.
const LOG_EVERY_US: u64 = 1_000_000;

impl<P: Store> Resilient<P> {
    /// `primary` (whose calls are counted under its `backend` label) with a breaker that opens
    /// after `breaker_failures` consecutive failures for `breaker_open`, and `fallback` for
    /// the calls the primary fails or skips.
    pub fn new(
        primary: Metered<P>,
        backend: &'static str,
        breaker_failures: u32,
        breaker_open: Duration,
        fallback: Option<Fallback>,
    ) -> Resilient<P> {
        let fallbacks = metrics::counter!(BACKEND_FALLBACKS, "backend" => backend);
        fallbacks.increment(0);
        Resilient {
            primary,
            fallback,
            breaker: Breaker::new(
                breaker_failures,
                u64::try_from(breaker_open.as_micros()).unwrap_or(u64::MAX),
            ),
            started: Instant::now(),
            last_logged_us: AtomicU64::new(0),
            fallbacks,
            backend,
        }
    }

    /// The primary store.
    pub fn primary(&self) -> &P {
        self.primary.inner()
    }

    /// Whether the breaker is open: the primary is being skipped.
    pub fn circuit_open(&self) -> bool {
        self.breaker.is_open()
    }

    fn mono_us(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// While the circuit is open and a probe is due, runs `probe` as that probe and records
    /// its outcome: how readiness brings the breaker back without waiting for a request (a
    /// replica that is not ready gets none). Returns whether the circuit is closed after.
    pub async fn probe_if_open<F: std::future::Future<Output = Result<(), StoreError>>>(
        &self,
        probe: impl FnOnce() -> F,
    ) -> bool {
        if !self.breaker.is_open() {
            return true;
        }
        if self.breaker.allow(self.mono_us()) {
            match probe().await {
                Ok(()) => self.succeeded(),
                Err(e) => self.failed(&e),
            }
        }
        !self.breaker.is_open()
    }

    fn succeeded(&self) {
        if self.breaker.success() {
            self.primary.metrics().circuit_open.set(0.0);
            tracing::info!(
                backend = self.backend,
                "backend answers again: circuit closed, deciding on it"
            );
        }
    }

    fn failed(&self, error: &StoreError) {
        let now = self.mono_us();
        if self.breaker.failure(now) {
            self.primary.metrics().circuit_open.set(1.0);
            tracing::error!(
                backend = self.backend,
                %error,
                fallback = self.fallback.is_some(),
                "backend failing: circuit open, not asking it until a probe succeeds"
            );
            return;
        }
        let last = self.last_logged_us.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= LOG_EVERY_US
            && self
                .last_logged_us
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(backend = self.backend, %error, "backend call failed");
        }
    }

    /// Runs `call` on the primary unless the breaker says not to; on failure (or a skip) on the
    /// fallback if there is one.
    async fn run<'a, T, F, G>(&'a self, primary: F, fallback: G) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
        G: FnOnce(
            &'a Fallback,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + 'a>>,
    {
        let error = if self.breaker.allow(self.mono_us()) {
            match primary.await {
                Ok(v) => {
                    self.succeeded();
                    return Ok(v);
                }
                // A refusal concerns this request's buckets only: Redis itself is fine.
                Err(e @ StoreError::Rejected(_)) => e,
                Err(e) => {
                    self.failed(&e);
                    e
                }
            }
        } else {
            StoreError::Unavailable(format!("{} circuit open", self.backend))
        };
        match &self.fallback {
            Some(f) => {
                self.fallbacks.increment(1);
                fallback(f).await
            }
            None => Err(error),
        }
    }
}

impl<P: Store> Store for Resilient<P> {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        self.run(self.primary.apply(buckets, demands), |f| {
            Box::pin(f.apply(buckets, demands))
        })
        .await
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.run(self.primary.peek(buckets), |f| Box::pin(f.peek(buckets)))
            .await
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.run(self.primary.reset(buckets), |f| Box::pin(f.reset(buckets)))
            .await
    }

    fn rules_changed(&self) {
        self.primary.rules_changed();
        if let Some(f) = &self.fallback {
            f.rules_changed();
        }
    }
}

/// The store a [`Resilient`] decides on while its primary fails (`failure_mode: fallback`).
pub enum Fallback {
    /// A local memory store, per replica.
    Memory(Metered<MemoryStore>),
    /// The Postgres store, shared by every replica (`redis.fallback: postgres`). No breaker of
    /// its own: with both backends down, each request waits for Postgres's timeout.
    Postgres(Metered<PostgresStore>),
}

impl Store for Fallback {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        match self {
            Fallback::Memory(s) => s.apply(buckets, demands).await,
            Fallback::Postgres(s) => s.apply(buckets, demands).await,
        }
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            Fallback::Memory(s) => s.peek(buckets).await,
            Fallback::Postgres(s) => s.peek(buckets).await,
        }
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            Fallback::Memory(s) => s.reset(buckets).await,
            Fallback::Postgres(s) => s.reset(buckets).await,
        }
    }

    fn rules_changed(&self) {
        match self {
            Fallback::Memory(s) => s.rules_changed(),
            Fallback::Postgres(s) => s.rules_changed(),
        }
    }
}
