//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` over tonic: one task per stream
//! reads its usage reports into the [`Hub`]; the hub's messages are the response stream.

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{RateLimitQuotaResponse, RateLimitQuotaUsageReports};
use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::hub::{Hub, Outgoing};
use crate::store::Store;

/// Messages queued per stream before its Envoy counts as not reading (the stream is then
/// ended): a stream gets one message per global bucket per assignment period.
const QUEUE_PER_BUCKET: usize = 2;

/// The RLQS gRPC service of a [`Hub`].
pub struct QuotaService<S> {
    hub: Arc<Hub<S>>,
}

impl<S> QuotaService<S> {
    /// The service answering from `hub`.
    pub fn new(hub: Arc<Hub<S>>) -> QuotaService<S> {
        QuotaService { hub }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<S: Store> RateLimitQuotaService for QuotaService<S> {
    type StreamRateLimitQuotasStream = ResponseStream;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let queue = self
            .hub
            .settings()
            .max_buckets_per_stream
            .saturating_mul(QUEUE_PER_BUCKET)
            .max(16);
        let (tx, rx) = mpsc::channel::<Outgoing>(queue);
        let id = self.hub.open(tx)?;
        let hub = self.hub.clone();
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            // Ends when Envoy half-closes or the stream breaks; nothing is read after that. A
            // message that cannot be read (over `grpc.max_message_bytes`: OUT_OF_RANGE, not
            // protobuf) ends the stream with its status.
            loop {
                match inbound.next().await {
                    Some(Ok(reports)) => hub.report(id, reports).await,
                    Some(Err(status)) => {
                        hub.end(id, status);
                        break;
                    }
                    None => break,
                }
            }
            hub.close(id).await;
        });
        let out = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(Box::pin(out)))
    }
}
