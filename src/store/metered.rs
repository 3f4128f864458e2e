//! A store wrapper that counts and times every backend call in the backend metrics
//! ([`crate::telemetry::BACKEND_CALLS`], [`crate::telemetry::BACKEND_ERRORS`],
//! [`crate::telemetry::BACKEND_DURATION`]), whatever the backend.

use std::time::Instant;

use super::{Applied, BucketRef, Peeked, Store, StoreError};
use crate::core::bucket::Demand;
use crate::telemetry::BackendMetrics;

/// `S`, with its calls counted under the `backend` label given to [`Metered::new`].
pub struct Metered<S> {
    inner: S,
    metrics: BackendMetrics,
}

impl<S> Metered<S> {
    /// Wraps `inner`, labelling its metrics `backend` (`memory`, `redis`, `postgres`).
    pub fn new(inner: S, backend: &'static str) -> Metered<S> {
        Metered {
            inner,
            metrics: BackendMetrics::new(backend),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The metric handles, for a wrapper that also opens a circuit breaker.
    pub fn metrics(&self) -> &BackendMetrics {
        &self.metrics
    }

    fn record<T>(&self, started: Instant, result: &Result<T, StoreError>) {
        self.metrics.calls.increment(1);
        self.metrics.duration.record(started.elapsed().as_secs_f64());
        if let Err(e) = result {
            match e.cause() {
                StoreError::Unavailable(_) | StoreError::Rejected(_) => self.metrics.errors.increment(1),
                StoreError::Timeout(_) => self.metrics.timeouts.increment(1),
                StoreError::InFailedBatch(_) | StoreError::NodeFailed(_) => unreachable!("cause() unwraps it"),
            }
        }
    }
}

impl<S: Store> Store for Metered<S> {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        let started = Instant::now();
        let result = self.inner.apply(buckets, demands).await;
        self.record(started, &result);
        result
    }

    async fn apply_or_fall_back<F: super::PartFallback>(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
        fallback: &F,
    ) -> Result<Applied, StoreError> {
        let started = Instant::now();
        let result = self.inner.apply_or_fall_back(buckets, demands, fallback).await;
        self.record(started, &result);
        result
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        let started = Instant::now();
        let result = self.inner.peek(buckets).await;
        self.record(started, &result);
        result
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        let started = Instant::now();
        let result = self.inner.reset(buckets).await;
        self.record(started, &result);
        result
    }

    fn rules_changed(&self) {
        self.inner.rules_changed();
    }

    fn on_rules_retired(&self) -> Option<super::RetireHook> {
        self.inner.on_rules_retired()
    }

    fn clock_estimate_us(&self) -> u64 {
        self.inner.clock_estimate_us()
    }
}
