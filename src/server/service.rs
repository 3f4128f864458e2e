//! The gRPC `envoy.service.ratelimit.v3.RateLimitService`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use crate::decision::limiter::{LimitError, Limiter};
use crate::store::Store;
use crate::telemetry::RequestMetrics;

/// `ShouldRateLimit` over a [`Limiter`], counted in [`crate::telemetry::REQUESTS`] and timed in
/// [`crate::telemetry::REQUEST_DURATION`].
pub(crate) struct RateLimitGrpc<S> {
    limiter: Arc<Limiter<S>>,
    metrics: RequestMetrics,
    /// When an `UNAVAILABLE` answer was last logged (ms since `started`), and how many went
    /// unlogged since: an outage logs about one line a second, not one per request.
    last_logged_ms: AtomicU64,
    unlogged: AtomicU64,
    started: Instant,
}

impl<S> RateLimitGrpc<S> {
    /// Serves `limiter`.
    pub(crate) fn new(limiter: Arc<Limiter<S>>) -> Self {
        RateLimitGrpc {
            limiter,
            metrics: RequestMetrics::new(),
            last_logged_ms: AtomicU64::new(0),
            unlogged: AtomicU64::new(0),
            started: Instant::now(),
        }
    }
}

#[tonic::async_trait]
impl<S: Store> RateLimitService for RateLimitGrpc<S> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = Instant::now();
        let req = request.into_inner();
        let answer = match self.limiter.should_rate_limit(&req).await {
            Ok(resp) => {
                if resp.overall_code == Code::OverLimit as i32 {
                    self.metrics.over_limit.increment(1);
                } else {
                    self.metrics.ok.increment(1);
                }
                Ok(Response::new(resp))
            }
            Err(LimitError::Store(e)) => {
                self.metrics.unavailable.increment(1);
                crate::telemetry::count_envoyproxy_backend_error();
                let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
                let last = self.last_logged_ms.load(Ordering::Relaxed);
                if (last == 0 || now_ms.saturating_sub(last) >= 1_000)
                    && self
                        .last_logged_ms
                        .compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                {
                    let also = self.unlogged.swap(0, Ordering::Relaxed);
                    tracing::warn!(error = %e, also_unlogged = also, "backend failed: answering UNAVAILABLE");
                } else {
                    self.unlogged.fetch_add(1, Ordering::Relaxed);
                }
                Err(Status::unavailable(e.to_string()))
            }
        };
        self.metrics.duration.record(started.elapsed().as_secs_f64());
        answer
    }
}
