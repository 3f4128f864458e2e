//! The gRPC `envoy.service.ratelimit.v3.RateLimitService`.

use std::sync::Arc;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use crate::limiter::{LimitError, Limiter};
use crate::store::Store;

/// `ShouldRateLimit` over a [`Limiter`].
pub struct RateLimitGrpc<S> {
    limiter: Arc<Limiter<S>>,
}

impl<S> RateLimitGrpc<S> {
    /// Serves `limiter`.
    pub fn new(limiter: Arc<Limiter<S>>) -> Self {
        RateLimitGrpc { limiter }
    }
}

#[tonic::async_trait]
impl<S: Store> RateLimitService for RateLimitGrpc<S> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        match self.limiter.should_rate_limit(&req).await {
            Ok(resp) => Ok(Response::new(resp)),
            Err(LimitError::InvalidRequest(msg)) => {
                tracing::debug!(domain = %req.domain, %msg, "invalid request");
                Err(Status::invalid_argument(msg))
            }
            Err(LimitError::Store(e)) => {
                tracing::warn!(error = %e, "backend failed");
                Err(Status::unavailable(e.to_string()))
            }
        }
    }
}
