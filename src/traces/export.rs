//! Getting finished spans to the collector without slowing a decision: the SDK's batch
//! processor (its own thread, `OTEL_BSP_*`), a bound in front of it that drops and counts what
//! does not fit, and an exporter that logs a failing collector at most once a minute.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;

use crate::telemetry::TRACE_SPANS_DROPPED;

/// The queue's bound: `OTEL_BSP_MAX_QUEUE_SIZE`, else OpenTelemetry's 2048.
pub(crate) fn queue_bound() -> usize {
    std::env::var("OTEL_BSP_MAX_QUEUE_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(2048)
}

/// Spans handed to the batch processor and not yet through an export: at most the bound, so
/// the processor's own queue (of the same size) never fills and every drop is counted here.
#[derive(Debug, Default)]
pub(crate) struct InFlight(AtomicUsize);

/// The batch processor behind a bound of `bound` spans in flight.
#[derive(Debug)]
pub(crate) struct Bounded {
    pub(crate) inner: BatchSpanProcessor,
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) bound: usize,
}

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.in_flight.0.fetch_add(1, Ordering::Relaxed) >= self.bound {
            self.in_flight.0.fetch_sub(1, Ordering::Relaxed);
            metrics::counter!(TRACE_SPANS_DROPPED).increment(1);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// An exporter that releases its batch from the bound, and logs failures at most once a minute
/// (with how many batches failed since the last line).
#[derive(Debug)]
pub(crate) struct Watched<E> {
    pub(crate) inner: E,
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) started: Instant,
    /// When a failure was last logged (seconds since `started`, plus one; 0: never).
    pub(crate) last_logged: AtomicU64,
    pub(crate) failed_since: AtomicU64,
}

/// How often a failing collector is logged at most.
const LOG_EVERY: Duration = Duration::from_secs(60);

impl<E> Watched<E> {
    /// `inner`, counting against `in_flight`.
    pub(crate) fn new(inner: E, in_flight: Arc<InFlight>) -> Self {
        Watched {
            inner,
            in_flight,
            started: Instant::now(),
            last_logged: AtomicU64::new(0),
            failed_since: AtomicU64::new(0),
        }
    }

    fn failed(&self, spans: usize, why: &dyn std::fmt::Display) {
        let now = self.started.elapsed().as_secs() + 1;
        let last = self.last_logged.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= LOG_EVERY.as_secs())
            && self
                .last_logged
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let also = self.failed_since.swap(0, Ordering::Relaxed);
            tracing::warn!(
                spans,
                also_failed_batches = also,
                "cannot export traces to the OTLP collector: {why} (logged at most once a minute)"
            );
        } else {
            self.failed_since.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl<E: SpanExporter> SpanExporter for Watched<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        self.in_flight.0.fetch_sub(spans, Ordering::Relaxed);
        if let Err(e) = &result {
            self.failed(spans, e);
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}
