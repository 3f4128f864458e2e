//! The gRPC `envoy.service.ratelimit.v3.RateLimitService`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::decision::limiter::{LimitError, Limiter};
use crate::store::Store;
use crate::telemetry::call::{CallIds, Deciding};
use crate::telemetry::RequestMetrics;

/// `ShouldRateLimit` over a [`Limiter`], counted in [`crate::telemetry::REQUESTS`] and timed in
/// [`crate::telemetry::REQUEST_DURATION`] (and in their statsd stats, [`crate::statsd::count_call`]).
pub(crate) struct RateLimitGrpc<S> {
    limiter: Arc<Limiter<S>>,
    metrics: RequestMetrics,
    /// When an `UNAVAILABLE` answer was last logged (ms since `started`), and how many went
    /// unlogged since: an outage logs about one line a second, not one per request.
    last_logged_ms: AtomicU64,
    unlogged: AtomicU64,
    started: Instant,
    /// True while decisions must wait for the rules (from an xDS server, before the first
    /// ones without `xds.force_start`): answered `UNAVAILABLE`, so Envoy's `failure_mode_deny`
    /// decides, as it does while envoyproxy/ratelimit has not started.
    gate: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
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
            gate: None,
        }
    }

    /// This service, answering `UNAVAILABLE` while `gate` says the rules are not there yet.
    pub(crate) fn with_gate(mut self, gate: Option<Arc<dyn Fn() -> bool + Send + Sync>>) -> Self {
        self.gate = gate;
        self
    }

    /// Logs why a request is answered `UNAVAILABLE`, about once a second at most (with how many
    /// went unlogged since), with the ids `metadata` (the call's) carries.
    fn log_unavailable(&self, why: &dyn std::fmt::Display, metadata: &MetadataMap) {
        let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.last_logged_ms.load(Ordering::Relaxed);
        if (last == 0 || now_ms.saturating_sub(last) >= 1_000)
            && self
                .last_logged_ms
                .compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let also = self.unlogged.swap(0, Ordering::Relaxed);
            let ids = CallIds::for_line(metadata);
            tracing::warn!(
                trace_id = ids.trace_id(),
                request_id = ids.request_id(),
                also_unlogged = also,
                "{why}: answering UNAVAILABLE"
            );
        } else {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
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
        // A disabled span while tracing is off: then nothing is read from the metadata.
        let span = crate::traces::server_span(request.metadata());
        // Kept for the warnings logged about this call (telemetry::call).
        let (metadata, _, req) = request.into_parts();
        if self.gate.as_ref().is_some_and(|waiting| waiting()) {
            let _entered = span.enter();
            self.metrics.unavailable.increment(1);
            self.log_unavailable(&"no rules received from the xDS server yet", &metadata);
            self.metrics.duration.record(started.elapsed().as_secs_f64());
            crate::statsd::count_call(started.elapsed());
            return Err(Status::unavailable("no rules received from the xDS server yet"));
        }
        let decide = std::pin::pin!(self.limiter.should_rate_limit(&req));
        let deciding = Deciding::new(&metadata, decide);
        let decided = if span.is_disabled() {
            deciding.await
        } else {
            deciding.instrument(span.clone()).await
        };
        crate::traces::record_decision(&span, &req, decided.as_ref().map_err(|_| "backend failed"));
        let _entered = span.enter();
        let answer = match decided {
            Ok(resp) => {
                let over_limit = resp.overall_code == Code::OverLimit as i32;
                crate::telemetry::denials::ANSWERS.count(over_limit);
                if over_limit {
                    self.metrics.over_limit.increment(1);
                    count_denied_instances(&req, &resp);
                } else {
                    self.metrics.ok.increment(1);
                }
                Ok(Response::new(resp))
            }
            Err(LimitError::Store(e)) => {
                self.metrics.unavailable.increment(1);
                crate::telemetry::count_envoyproxy_backend_error();
                self.log_unavailable(&format_args!("backend failed: {e}"), &metadata);
                Err(Status::unavailable(e.to_string()))
            }
        };
        let elapsed = started.elapsed();
        self.metrics.duration.record(elapsed.as_secs_f64());
        crate::statsd::count_call(elapsed);
        answer
    }
}

/// Counts each descriptor an `OVER_LIMIT` answer denied in the console's most-denied sketch
/// ([`crate::telemetry::denials::TOP_DENIED`]).
fn count_denied_instances(req: &RateLimitRequest, resp: &RateLimitResponse) {
    use crate::telemetry::denials::{kept_value, DeniedInstance, TOP_DENIED};
    TOP_DENIED.offer(|| {
        req.descriptors
            .iter()
            .zip(&resp.statuses)
            .filter(|(_, status)| status.code == Code::OverLimit as i32)
            .map(|(descriptor, status)| DeniedInstance {
                domain: req.domain.clone(),
                bucket: status
                    .current_limit
                    .as_ref()
                    .map(|l| l.name.clone())
                    .unwrap_or_default(),
                entries: descriptor
                    .entries
                    .iter()
                    .map(|e| (kept_value(&e.key), kept_value(&e.value)))
                    .collect(),
            })
    });
}
