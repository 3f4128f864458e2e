//! The Prometheus recorder of the process: installed once by `serve`, with every metric of
//! [`crate::telemetry`] described and the histograms' buckets set.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::telemetry::*;

/// Histogram buckets for the `_seconds` histograms: 50 µs to 1 s, dense around Envoy's 20 ms
/// filter timeout.
const SECONDS_BUCKETS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.05, 0.1, 0.25, 1.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global `metrics` recorder (once; later
/// calls return the same handle) and describes every metric. Call it before loading rules, so
/// the rules' counters register with it.
///
/// Errors: another `metrics` recorder is already installed in this process.
pub(crate) fn install() -> anyhow::Result<PrometheusHandle> {
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| anyhow::anyhow!("cannot install the metrics recorder: {e}"))?;
    describe();
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    // At zero from the start, so that `rate()` in an alert sees the first failure answer (a
    // series that appears with its first increment has no earlier sample to rate against).
    for answer in ["allow", "deny"] {
        counter!(BACKEND_FAILURE_ANSWERS, "answer" => answer).increment(0);
    }
    counter!(TRACE_CONTEXT_INVALID).increment(0);
    counter!(TRACE_SPANS_DROPPED).increment(0);
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// Keeps the recorder's histograms drained; run it every few seconds.
pub(crate) async fn run_upkeep(handle: PrometheusHandle, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        handle.run_upkeep();
    }
}

fn describe() {
    describe_counter!(REQUESTS, "RateLimitRequests answered, by code");
    describe_histogram!(REQUEST_DURATION, Unit::Seconds, "Time to decide one RateLimitRequest");
    describe_counter!(UNKNOWN_DOMAIN, "Requests for a domain no rules file declares");
    describe_counter!(MALFORMED, "Malformed parts of requests, by reason (none is an error)");
    describe_counter!(
        TRACE_CONTEXT_INVALID,
        "Calls whose traceparent or b3 header did not parse (served under a new root span)"
    );
    describe_counter!(
        TRACE_SPANS_DROPPED,
        "Finished spans dropped because the trace export queue was full"
    );
    describe_counter!(DECISIONS, "Bucket decisions, one per descriptor and bucket, by code");
    describe_counter!(HITS, "Hits (hits_addend) per bucket decision code");
    describe_counter!(DEBITED_TOKENS, "Tokens debited from debt buckets by usage reports");
    describe_counter!(
        DEBT_LOST_TOKENS,
        "Tokens of usage reports that found a debt bucket at its floor"
    );
    describe_gauge!(DEBT_TOKENS, "Debt in tokens of the debt bucket instance decided last");
    describe_gauge!(RLQS_STREAMS, "Open RLQS streams");
    describe_counter!(RLQS_STREAMS_REFUSED, "RLQS streams refused at rlqs.max_streams");
    describe_counter!(RLQS_REPORTS, "RLQS bucket usage reports received");
    describe_counter!(RLQS_REPORTED_REQUESTS, "Requests Envoys reported over RLQS, by outcome");
    describe_counter!(RLQS_IGNORED, "RLQS report parts ignored, by reason");
    describe_counter!(RLQS_UNMATCHED, "RLQS bucket ids no rule matched, by reason");
    describe_gauge!(RLQS_BUCKETS, "Envoy buckets bound on open RLQS streams");
    describe_gauge!(RLQS_GLOBAL_BUCKETS, "Global buckets with RLQS Envoys on this replica");
    describe_counter!(RLQS_ASSIGNMENTS, "RLQS assignments sent, by strategy");
    describe_gauge!(
        RLQS_OUTSTANDING_TOKENS,
        "Tokens RLQS Envoys may still admit on what was paid for"
    );
    describe_counter!(RLQS_STORE_CALLS, "Store calls paying for RLQS assignments, by result");
    describe_counter!(BACKEND_CALLS, "Calls to the bucket backend");
    describe_counter!(BACKEND_ERRORS, "Failed backend calls, by kind");
    describe_histogram!(BACKEND_DURATION, Unit::Seconds, "Backend call time");
    describe_counter!(BACKEND_FALLBACKS, "Decisions taken by the fallback backend");
    describe_gauge!(BACKEND_CIRCUIT_OPEN, "1 while the backend's circuit breaker is open");
    describe_gauge!(
        REDIS_CLUSTER_NODE_UP,
        "Redis Cluster: 1 while the master serving from first_slot answers, 0 while it fails"
    );
    describe_gauge!(
        REDIS_CLUSTER_SLOTS_FAILING,
        "Redis Cluster: slots whose master fails or is unknown"
    );
    describe_counter!(
        REDIS_CLUSTER_REFRESHES,
        "Redis Cluster: reads of the slot map, by result"
    );
    describe_counter!(REDIS_CLUSTER_REDIRECTS, "Redis Cluster: calls redirected (moved, ask)");
    describe_counter!(
        BACKEND_FAILURE_ANSWERS,
        "Requests answered by failure_mode (allow or deny) because the backend failed"
    );
    describe_counter!(RELOADS, "Rules reloads, by result");
    describe_gauge!(RULES_GENERATION, "Generation of the rules in force");
    describe_gauge!(LAST_RELOAD_SUCCESSFUL, "1 if the latest rules reload succeeded");
    describe_gauge!(
        LAST_RELOAD_SUCCESS_TIME,
        Unit::Seconds,
        "Unix time of the latest rules load that took effect"
    );
    describe_counter!(
        XDS_UPDATES,
        "Rules updates from the xDS server, by result (ack or nack)"
    );
    describe_gauge!(XDS_CONNECTED, "1 while connected to the xDS server");
    describe_gauge!(MEMORY_BUCKETS, "Buckets held by the memory store");
    describe_counter!(MEMORY_EVICTED_NOT_FULL, "Buckets evicted before they were full");
    describe_gauge!(BUILD_INFO, "Build information");
    describe_gauge!(
        TLS_CERT_EXPIRY,
        Unit::Seconds,
        "Unix time at which the certificate a TLS listener serves expires"
    );
    describe_counter!(TLS_RELOADS, "Certificate reloads of a TLS listener, by result");
    describe_counter!(TLS_HANDSHAKE_FAILURES, "Failed TLS handshakes, by listener");
}
