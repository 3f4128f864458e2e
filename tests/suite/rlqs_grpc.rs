//! RLQS on a running `tollgate serve`, over its gRPC listener with a tonic client: the stream
//! answers reports with assignments beside `RateLimitService`; a message over
//! `grpc.max_message_bytes` ends only its own stream, with `OUT_OF_RANGE`; `rlqs.enabled: false`
//! leaves the service unserved; a graceful shutdown ends the streams with `UNAVAILABLE` so their
//! Envoys reconnect elsewhere.

use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tokio::sync::mpsc;
use tonic::Streaming;

use crate::support::{signal, Tollgate};

const RULES: &str = "domain: edge\ndescriptors:\n  - key: api_key\n    token_bucket: {capacity: 20, refill: 10/s}\n";

fn report(value: &str) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: "edge".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("api_key".to_string(), value.to_string())].into_iter().collect(),
            }),
            time_elapsed: Some(PbDuration { seconds: 0, nanos: 0 }),
            num_requests_allowed: 1,
            num_requests_denied: 0,
        }],
    }
}

/// Opens a stream; returns the sender of reports and the responses.
async fn open(
    tollgate: &Tollgate,
) -> Result<
    (
        mpsc::Sender<RateLimitQuotaUsageReports>,
        Streaming<RateLimitQuotaResponse>,
    ),
    tonic::Status,
> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(16);
    let outbound = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let responses = client.stream_rate_limit_quotas(outbound).await?.into_inner();
    Ok((tx, responses))
}

async fn next(
    responses: &mut Streaming<RateLimitQuotaResponse>,
) -> Result<Option<RateLimitQuotaResponse>, tonic::Status> {
    tokio::time::timeout(Duration::from_secs(10), responses.message())
        .await
        .expect("an answer within 10 s")
}

fn is_token_bucket(response: &RateLimitQuotaResponse) -> bool {
    response.bucket_action.iter().all(|a| {
        matches!(&a.bucket_action, Some(Action::QuotaAssignmentAction(q))
            if matches!(q.rate_limit_strategy.as_ref().and_then(|s| s.strategy.as_ref()),
                Some(envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy::TokenBucket(_))))
    }) && !response.bucket_action.is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_served_and_an_oversized_message_ends_only_its_own() {
    let tollgate = Tollgate::builder()
        .rules_file("edge.yaml", RULES)
        .settings("grpc:\n  max_message_bytes: 2048\n")
        .start();
    let (tx, mut responses) = open(&tollgate).await.expect("the stream opens");
    tx.send(report("k1")).await.unwrap();
    let first = next(&mut responses).await.expect("no error").expect("a response");
    assert!(is_token_bucket(&first), "{first:?}");

    let (big_tx, mut big_responses) = open(&tollgate).await.expect("a second stream");
    big_tx.send(report(&"x".repeat(4_096))).await.unwrap();
    let ended = next(&mut big_responses)
        .await
        .expect_err("the oversized message ends its stream");
    assert_eq!(ended.code(), tonic::Code::OutOfRange, "{ended:?}");

    // The first stream goes on: its next round arrives.
    let again = next(&mut responses).await.expect("no error").expect("a renewal");
    assert!(is_token_bucket(&again), "{again:?}");
    drop(tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turned_off_the_service_is_not_served() {
    let tollgate = Tollgate::builder()
        .rules_file("edge.yaml", RULES)
        .settings("rlqs:\n  enabled: false\n")
        .start();
    let refused = match open(&tollgate).await {
        Err(status) => status,
        Ok((tx, mut responses)) => {
            tx.send(report("k1")).await.unwrap();
            next(&mut responses).await.expect_err("no RLQS")
        }
    };
    assert_eq!(refused.code(), tonic::Code::Unimplemented, "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_ends_the_streams_with_unavailable() {
    let tollgate = Tollgate::builder()
        .rules_file("edge.yaml", RULES)
        .settings("shutdown:\n  drain_seconds: 1\n  timeout_seconds: 5\n")
        .start();
    let (tx, mut responses) = open(&tollgate).await.expect("the stream opens");
    tx.send(report("k1")).await.unwrap();
    assert!(next(&mut responses).await.expect("ok").is_some());
    signal(tollgate.process.id(), "TERM");
    let ended = loop {
        match next(&mut responses).await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
    assert!(ended.message().contains("reconnect"), "{ended:?}");
    drop(tx);
}
