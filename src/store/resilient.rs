//! A shared backend with a circuit breaker ([`Guarded`]) and, optionally, a fallback store
//! ([`Resilient`]) (docs/backends.md).
//!
//! While the breaker is closed every call goes to the backend (Redis or Postgres). Repeated
//! failures open it ([`Breaker`]): calls then skip the backend for a while instead of each
//! waiting for its timeout, and a probe tests it again later. A call the backend fails, or
//! skips, goes to the fallback when there is one (`failure_mode: fallback`: for Redis, the
//! Postgres store, itself [`Guarded`] by a breaker of its own, or a local memory store; see
//! [`Fallback`]), else returns the error, which the limiter answers by the failure mode
//! (`allow`, `deny` or `error`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{
    Applied, Breaker, BreakerPolicy, BucketRef, MemoryStore, Metered, Outcome, Peeked, Permit, PostgresStore, Store,
    StoreError, Transition,
};
use crate::core::bucket::Demand;
use crate::telemetry::BACKEND_FALLBACKS;

/// Logged failures are at least this far apart.
const LOG_EVERY_US: u64 = 1_000_000;

/// `P` behind a circuit breaker: a call either goes to `P` or, while the breaker is open, fails
/// at once with [`StoreError::Unavailable`] (`"<backend> circuit open"`).
pub struct Guarded<P> {
    primary: Metered<P>,
    breaker: Breaker,
    started: Instant,
    /// When a failure was last logged (µs since `started`), so an outage logs its failures
    /// about once a second, not once a request.
    last_logged_us: AtomicU64,
    backend: &'static str,
    /// For the logs: whether a [`Resilient`] decides elsewhere while this one fails.
    has_fallback: bool,
    /// The latest failure, for readiness to say why.
    last_error: std::sync::Mutex<Option<String>>,
}

/// The breaker policy of `failures` failed calls, the default share (half the requests) and
/// window (1 s) of the settings, and `open`.
fn default_policy(failures: u32, open: Duration) -> BreakerPolicy {
    BreakerPolicy {
        min_failures: failures,
        failure_ratio: 0.5,
        window_us: 1_000_000,
        open_for_us: u64::try_from(open.as_micros()).unwrap_or(u64::MAX),
    }
}

impl<P: Store> Guarded<P> {
    /// `primary` (whose calls are counted under its `backend` label) with a breaker that opens
    /// once `breaker_failures` calls failed in a second, half its requests with them, for
    /// `breaker_open` (the settings' default share and window; see [`Guarded::with_policy`]).
    pub fn new(
        primary: Metered<P>,
        backend: &'static str,
        breaker_failures: u32,
        breaker_open: Duration,
    ) -> Guarded<P> {
        Guarded::with_policy(primary, backend, default_policy(breaker_failures, breaker_open))
    }

    /// `primary` (whose calls are counted under its `backend` label) behind a breaker with
    /// `policy` (`RedisSettings::breaker_policy`, `PostgresSettings::breaker_policy`).
    pub fn with_policy(primary: Metered<P>, backend: &'static str, policy: BreakerPolicy) -> Guarded<P> {
        Guarded {
            primary,
            breaker: Breaker::new(policy),
            started: Instant::now(),
            last_logged_us: AtomicU64::new(0),
            backend,
            has_fallback: false,
            last_error: std::sync::Mutex::new(None),
        }
    }

    /// The guarded store.
    pub fn primary(&self) -> &P {
        self.primary.inner()
    }

    /// Whether the breaker is open: the store is being skipped.
    pub fn circuit_open(&self) -> bool {
        self.breaker.is_open()
    }

    fn mono_us(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// While the circuit is open and a probe is due, runs `probe` as that probe and records
    /// its outcome: how readiness brings the breaker back without waiting for a request (a
    /// replica that is not ready gets none). Returns whether the circuit is closed after.
    pub async fn probe_if_open<F: Future<Output = Result<(), StoreError>>>(&self, probe: impl FnOnce() -> F) -> bool {
        if !self.breaker.is_open() {
            return true;
        }
        if let Some(permit) = self.breaker.allow(self.mono_us()) {
            match probe().await {
                Ok(()) => self.succeeded(permit),
                Err(e) => self.failed(permit, &e),
            }
        }
        !self.breaker.is_open()
    }

    /// Readiness of a store that may not be getting calls (a fallback while its primary
    /// answers, or before the first request): runs `probe` now, or, while the circuit is open,
    /// when a probe is due ([`Guarded::probe_if_open`]), and records a failure. Whether the
    /// store answered (open and no probe due: `false`).
    pub async fn check<F: Future<Output = Result<(), StoreError>>>(&self, probe: impl FnOnce() -> F) -> bool {
        if self.breaker.is_open() {
            return self.probe_if_open(probe).await;
        }
        match probe().await {
            Ok(()) => true,
            Err(e) => {
                self.failed(Permit::Call, &e);
                false
            }
        }
    }

    fn succeeded(&self, permit: Permit) {
        if self.breaker.record(self.mono_us(), permit, Outcome::Success) == Transition::Closed {
            self.primary.metrics().circuit_open.set(0.0);
            tracing::info!(
                backend = self.backend,
                "backend answers again: circuit closed, deciding on it"
            );
        }
    }

    /// The latest failure (`None` before any).
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn failed(&self, permit: Permit, error: &StoreError) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.to_string());
        let now = self.mono_us();
        if self.breaker.record(now, permit, Outcome::Failure) == Transition::Opened {
            self.primary.metrics().circuit_open.set(1.0);
            crate::telemetry::call::error_about_call!(
                backend = self.backend,
                %error,
                fallback = self.has_fallback,
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
            crate::telemetry::call::warn_about_call!(backend = self.backend, %error, "backend call failed");
        }
    }

    /// Runs the call `call` makes unless the breaker says not to, and records its outcome.
    /// (It takes the maker, not the future: a future passed in by value is kept twice in this
    /// one's state, and a Redis decision's is several KiB, moved at every request.)
    async fn run<T, F: Future<Output = Result<T, StoreError>>>(
        &self,
        call: impl FnOnce() -> F,
    ) -> Result<T, StoreError> {
        let Some(permit) = self.breaker.allow(self.mono_us()) else {
            return Err(StoreError::Unavailable(format!("{} circuit open", self.backend).into()));
        };
        match call().await {
            Ok(v) => {
                self.succeeded(permit);
                Ok(v)
            }
            // A refusal concerns this request's buckets only: the backend itself answered.
            Err(e @ StoreError::Rejected(_)) => {
                self.succeeded(permit);
                Err(e)
            }
            // A request of a failed batch: a failed request for the breaker's share, but the
            // batch's first request counted the failed call.
            Err(e @ StoreError::InFailedBatch(_)) => {
                if self.breaker.record(self.mono_us(), permit, Outcome::FailedInBatch) == Transition::Opened {
                    self.primary.metrics().circuit_open.set(1.0);
                    crate::telemetry::call::error_about_call!(
                        backend = self.backend,
                        error = %e,
                        fallback = self.has_fallback,
                        "backend failing: circuit open, not asking it until a probe succeeds"
                    );
                }
                Err(e)
            }
            // One Redis Cluster master failed: its own breaker counted it. The backend as a
            // whole answered (a probe let through closes the store-wide breaker).
            Err(e @ StoreError::NodeFailed(_)) => {
                if permit == Permit::Probe {
                    self.succeeded(permit);
                }
                Err(e)
            }
            Err(e) => {
                self.failed(permit, &e);
                Err(e)
            }
        }
    }
}

impl<P: Store> Store for Guarded<P> {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        self.run(|| self.primary.apply(buckets, demands)).await
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.run(|| self.primary.peek(buckets)).await
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.run(|| self.primary.reset(buckets)).await
    }

    fn rules_changed(&self) {
        self.primary.rules_changed();
    }

    fn on_rules_retired(&self) -> Option<super::RetireHook> {
        self.primary.on_rules_retired()
    }

    fn clock_estimate_us(&self) -> u64 {
        self.primary.clock_estimate_us()
    }
}

/// `P` behind a circuit breaker, with an optional fallback for the calls `P` fails or skips.
pub struct Resilient<P> {
    guarded: Guarded<P>,
    fallback: Option<Fallback>,
    fallbacks: metrics::Counter,
}

impl<P: Store> Resilient<P> {
    /// `primary` (whose calls are counted under its `backend` label) with a breaker that opens
    /// once `breaker_failures` calls failed in a second, half its requests with them, for
    /// `breaker_open`, and `fallback` for the calls the primary fails or skips (counted in
    /// `tollgate_backend_fallbacks_total`). See [`Resilient::with_policy`].
    pub fn new(
        primary: Metered<P>,
        backend: &'static str,
        breaker_failures: u32,
        breaker_open: Duration,
        fallback: Option<Fallback>,
    ) -> Resilient<P> {
        Resilient::with_policy(
            primary,
            backend,
            default_policy(breaker_failures, breaker_open),
            fallback,
        )
    }

    /// As [`Resilient::new`], with the breaker's `policy`.
    pub fn with_policy(
        primary: Metered<P>,
        backend: &'static str,
        policy: BreakerPolicy,
        fallback: Option<Fallback>,
    ) -> Resilient<P> {
        let fallbacks = metrics::counter!(BACKEND_FALLBACKS, "backend" => backend);
        fallbacks.increment(0);
        let mut guarded = Guarded::with_policy(primary, backend, policy);
        guarded.has_fallback = fallback.is_some();
        Resilient {
            guarded,
            fallback,
            fallbacks,
        }
    }

    /// The primary store behind its breaker.
    pub fn guarded(&self) -> &Guarded<P> {
        &self.guarded
    }

    /// The primary store.
    pub fn primary(&self) -> &P {
        self.guarded.primary()
    }

    /// The fallback, if `failure_mode: fallback`.
    pub fn fallback(&self) -> Option<&Fallback> {
        self.fallback.as_ref()
    }

    /// Whether the breaker is open: the primary is being skipped.
    pub fn circuit_open(&self) -> bool {
        self.guarded.circuit_open()
    }

    /// See [`Guarded::probe_if_open`].
    pub async fn probe_if_open<F: Future<Output = Result<(), StoreError>>>(&self, probe: impl FnOnce() -> F) -> bool {
        self.guarded.probe_if_open(probe).await
    }

    /// `primary`'s answer; when it fails (or the breaker skips it), `fallback`'s on the
    /// fallback store if there is one. Both are makers of the futures (see [`Guarded::run`]).
    async fn run<'a, T, F, G>(
        &'a self,
        primary: impl FnOnce() -> F,
        fallback: impl FnOnce(&'a Fallback) -> G,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
        G: Future<Output = Result<T, StoreError>>,
    {
        let error = match self.guarded.run(primary).await {
            Ok(v) => return Ok(v),
            // A Cluster master failed. A decision's part on it was the fallback's already
            // (`apply_or_fall_back`): deciding the whole request there again would decide the
            // other slots twice. A peek or reset is not answered from the fallback either: it
            // would show the fallback's state of buckets Redis holds.
            Err(e @ StoreError::NodeFailed(_)) => return Err(e),
            Err(e) => e,
        };
        match &self.fallback {
            Some(f) => {
                self.fallbacks.increment(1);
                if crate::telemetry::in_sampled_call() {
                    tracing::Span::current().record("ratelimit.decided_by", "fallback");
                }
                fallback(f).await
            }
            None => Err(error),
        }
    }
}

impl<P: Store> Store for Resilient<P> {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        let Some(fallback) = &self.fallback else {
            return self.guarded.run(|| self.guarded.primary.apply(buckets, demands)).await;
        };
        // The primary may decide part of the request on the fallback (a lost Cluster master's
        // slots); when it failed as a whole, the fallback decides it all.
        let partial = Counted {
            fallback,
            fallbacks: &self.fallbacks,
        };
        self.run(
            || self.guarded.primary.apply_or_fall_back(buckets, demands, &partial),
            |f| f.apply(buckets, demands),
        )
        .await
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.run(|| self.guarded.primary.peek(buckets), |f| f.peek(buckets))
            .await
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        self.run(|| self.guarded.primary.reset(buckets), |f| f.reset(buckets))
            .await
    }

    fn rules_changed(&self) {
        self.guarded.rules_changed();
        if let Some(f) = &self.fallback {
            f.rules_changed();
        }
    }

    fn on_rules_retired(&self) -> Option<super::RetireHook> {
        super::both_hooks(
            self.guarded.on_rules_retired(),
            self.fallback.as_ref().and_then(|f| f.on_rules_retired()),
        )
    }

    fn clock_estimate_us(&self) -> u64 {
        self.guarded.clock_estimate_us()
    }
}

/// A [`Fallback`] handed to a primary that decides part of a request on it, counting each such
/// decision in `tollgate_backend_fallbacks_total`.
struct Counted<'a> {
    fallback: &'a Fallback,
    fallbacks: &'a metrics::Counter,
}

impl super::PartFallback for Counted<'_> {
    async fn decide(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        self.fallbacks.increment(1);
        self.fallback.apply(buckets, demands).await
    }

    async fn give_back(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        self.fallback.apply(buckets, demands).await
    }
}

/// "`<backend>` at `<where>` is failing", with the circuit state and the latest failure.
pub(crate) fn failing<P: Store>(backend: &str, at: &str, guarded: &Guarded<P>) -> String {
    let open = if guarded.circuit_open() { " (circuit open)" } else { "" };
    match guarded.last_error() {
        Some(why) => format!("{backend} at {at} is failing{open}: {why}"),
        None => format!("{backend} at {at} is failing{open}"),
    }
}

/// The store a [`Resilient`] decides on while its primary fails (`failure_mode: fallback`).
pub enum Fallback {
    /// A local memory store, per replica.
    Memory(Metered<MemoryStore>),
    /// The Postgres store, shared by every replica (`redis.fallback: postgres`), behind a
    /// breaker of its own (`postgres.breaker_failures`, `postgres.breaker_open_ms`): with both
    /// backends down, a request fails at once instead of waiting for Postgres's timeout too.
    Postgres(Guarded<PostgresStore>),
}

impl Fallback {
    /// Whether the fallback can decide now: always for memory; for Postgres, while its schema
    /// is in place and it answers a probe (sent now, since a fallback gets no calls while its
    /// primary answers; while its breaker is open, at most once per `breaker_open_ms`). `Err`
    /// says why not.
    pub async fn ready(&self, probe_timeout: Duration) -> Result<(), String> {
        match self {
            Fallback::Memory(_) => Ok(()),
            Fallback::Postgres(g) => {
                let postgres = g.primary();
                if !postgres.is_migrated() {
                    return Err(format!("not connected to Postgres at {}", postgres.describe()));
                }
                if !g.check(|| postgres.probe(probe_timeout)).await {
                    return Err(failing("Postgres", postgres.describe(), g));
                }
                Ok(())
            }
        }
    }

    /// `memory` or `postgres`, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Fallback::Memory(_) => "memory",
            Fallback::Postgres(_) => "postgres",
        }
    }
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

    fn on_rules_retired(&self) -> Option<super::RetireHook> {
        match self {
            Fallback::Memory(s) => s.on_rules_retired(),
            Fallback::Postgres(s) => s.on_rules_retired(),
        }
    }

    fn clock_estimate_us(&self) -> u64 {
        match self {
            Fallback::Memory(s) => s.clock_estimate_us(),
            Fallback::Postgres(s) => s.clock_estimate_us(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store whose every call fails with the error it was given.
    struct Failing(StoreError);

    impl Store for Failing {
        async fn apply(&self, _: &[BucketRef], _: &[Demand]) -> Result<Applied, StoreError> {
            Err(self.0.clone())
        }
        async fn peek(&self, _: &[BucketRef]) -> Result<Peeked, StoreError> {
            Err(self.0.clone())
        }
        async fn reset(&self, _: &[BucketRef]) -> Result<Peeked, StoreError> {
            Err(self.0.clone())
        }
    }

    fn guarded(error: StoreError) -> Guarded<Failing> {
        Guarded::new(Metered::new(Failing(error), "test"), "test", 3, Duration::from_secs(60))
    }

    async fn fail_times(g: &Guarded<Failing>, n: usize) {
        for _ in 0..n {
            let r: Result<Applied, StoreError> = g.apply(&[], &[]).await;
            assert!(r.is_err());
        }
    }

    /// The breaker counts failed calls to the backend: the requests of a failed batch beyond
    /// its first do not count again, nor does a refusal of one request's data.
    #[tokio::test]
    async fn the_breaker_counts_calls_not_the_requests_of_a_failed_batch() {
        let timeout = StoreError::Timeout("slow".into());
        let g = guarded(StoreError::InFailedBatch(Box::new(timeout.clone())));
        fail_times(&g, 100).await;
        assert!(!g.circuit_open(), "100 requests of failed batches");
        let g = guarded(StoreError::Rejected("corrupt".into()));
        fail_times(&g, 100).await;
        assert!(!g.circuit_open(), "100 refusals");
        let g = guarded(timeout);
        fail_times(&g, 3).await;
        assert!(g.circuit_open(), "3 failed calls");
    }

    /// A Redis Cluster master's failure is counted by that master's own breaker: the
    /// store-wide one stays closed, so the other masters keep deciding.
    #[tokio::test]
    async fn a_cluster_nodes_failure_does_not_open_the_store_wide_breaker() {
        let node = StoreError::NodeFailed(Box::new(StoreError::Timeout("one master".into())));
        let g = guarded(node);
        fail_times(&g, 100).await;
        assert!(!g.circuit_open(), "100 requests on a failed master");
    }
}
