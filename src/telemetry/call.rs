//! The call a task is deciding, so that a warning or error about it names it.
//!
//! An operator who finds a warning in the log ("malformed request part", "backend call
//! failed") wants the request it was about: Envoy's `x-request-id`, which its access log
//! prints, and the trace id, which finds the trace. A sampled call's server span carries both
//! (`traces::server_span`), but most calls are not sampled and make no span (a span costs more
//! than the 3 % tracing may add to such a call). So the gRPC service polls each decision
//! inside [`Deciding`], which lends the call's metadata to the thread while the decision runs,
//! and the sites that log about a request read the two ids from it only when they log
//! ([`CallIds::current`], through the crate's `warn_about_call!` and `error_about_call!`).
//!
//! Not `tokio::task_local!`: its scope owns the future it runs, and moving the decision's
//! future (several KiB) into it cost about 500 instructions a call in copies (the
//! instruction gate's grpc path); [`Deciding`] polls a future pinned where it was made, and
//! lends the metadata by reference (a pointer in a thread-local, `scoped-tls`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::metadata::MetadataMap;

scoped_tls::scoped_thread_local! {
    /// The gRPC metadata of the call whose decision this thread is polling, if any.
    static CALL: MetadataMap
}

/// A call's decision (`decide`, pinned by the caller) polled with the call's gRPC metadata
/// lent to the thread, so that [`CallIds::current`] finds it: a pointer set before each poll
/// and put back after (even when the poll panics, so a later call on the thread never logs
/// this one's ids). Nothing is read from the metadata unless a line is logged.
pub struct Deciding<'a, F> {
    metadata: &'a MetadataMap,
    decide: Pin<&'a mut F>,
}

impl<'a, F: Future> Deciding<'a, F> {
    /// `decide` polled as the decision of the call `metadata` came with.
    pub fn new(metadata: &'a MetadataMap, decide: Pin<&'a mut F>) -> Self {
        Deciding { metadata, decide }
    }
}

impl<F: Future> Future for Deciding<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        CALL.set(this.metadata, || this.decide.as_mut().poll(cx))
    }
}

/// The ids a log line about the current call carries, read from its metadata.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallIds {
    /// The caller's trace id, 32 lowercase hex digits: from a W3C `traceparent`
    /// (`00-<trace id>-<span id>-<flags>`, W3C Trace Context §3.2), else a B3 `b3` single
    /// header (`<trace id>-<span id>...`) or `x-b3-traceid` (a 64-bit B3 id is widened with
    /// leading zeros, as OpenTelemetry reads it). `None` when the call carries none that parses.
    pub trace_id: Option<String>,
    /// Envoy's `x-request-id`, when the call carries one that is visible ASCII (at most 128
    /// bytes: it is the client's, when Envoy is told to keep it).
    pub request_id: Option<String>,
}

impl CallIds {
    /// The ids of the call the current task decides; none outside a [`Deciding`] poll, and none while
    /// a sampled call's span is current (`crate::telemetry::in_sampled_call`): that span
    /// carries them already, and a line would show them twice.
    pub fn current() -> CallIds {
        if crate::telemetry::in_sampled_call() {
            return CallIds::default();
        }
        if !CALL.is_set() {
            return CallIds::default();
        }
        CALL.with(CallIds::of)
    }

    /// The ids of the call `metadata` came with, for a line logged outside its decision;
    /// none while a sampled call's span is current, as [`CallIds::current`].
    pub fn for_line(metadata: &MetadataMap) -> CallIds {
        if crate::telemetry::in_sampled_call() {
            return CallIds::default();
        }
        CallIds::of(metadata)
    }

    /// The ids `metadata` carries.
    pub fn of(metadata: &MetadataMap) -> CallIds {
        let text = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok());
        let trace_id = text("traceparent")
            .and_then(w3c_trace_id)
            .or_else(|| text("b3").and_then(|b3| b3_trace_id(b3.split('-').next().unwrap_or(""))))
            .or_else(|| text("x-b3-traceid").and_then(b3_trace_id));
        let request_id = text("x-request-id")
            .filter(|id| !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()))
            .map(str::to_owned);
        CallIds { trace_id, request_id }
    }

    /// The trace id as a log field's value (shown bare, as the span's own `trace_id`).
    pub fn trace_id(&self) -> Option<tracing::field::DisplayValue<&str>> {
        self.trace_id.as_deref().map(tracing::field::display)
    }

    /// The request id as a log field's value.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }
}

/// The trace id of a W3C `traceparent`: its second field, 32 lowercase hex digits, not all
/// zero, after a two-digit version other than `ff` (W3C Trace Context §3.2.2).
fn w3c_trace_id(value: &str) -> Option<String> {
    let mut fields = value.trim().split('-');
    let version = fields.next()?;
    if version.len() != 2 || !is_lower_hex(version) || version == "ff" {
        return None;
    }
    let id = fields.next()?;
    (id.len() == 32 && is_lower_hex(id) && !is_zero(id)).then(|| id.to_owned())
}

/// A B3 trace id (16 or 32 lowercase hex digits, not all zero), as 32 digits.
fn b3_trace_id(id: &str) -> Option<String> {
    let id = id.trim();
    if !(id.len() == 16 || id.len() == 32) || !is_lower_hex(id) || is_zero(id) {
        return None;
    }
    Some(format!("{id:0>32}"))
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn is_zero(s: &str) -> bool {
    s.bytes().all(|b| b == b'0')
}

/// `tracing::warn!` about the call the current task decides: the same arguments, with its
/// `trace_id` and `request_id` ([`CallIds::current`]) as the line's first fields when it has
/// them. Read only when the line is logged.
macro_rules! warn_about_call {
    ($($rest:tt)+) => {{
        let ids = $crate::telemetry::call::CallIds::current();
        ::tracing::warn!(trace_id = ids.trace_id(), request_id = ids.request_id(), $($rest)+)
    }};
}

/// `tracing::error!` about the call the current task decides, as [`warn_about_call!`].
macro_rules! error_about_call {
    ($($rest:tt)+) => {{
        let ids = $crate::telemetry::call::CallIds::current();
        ::tracing::error!(trace_id = ids.trace_id(), request_id = ids.request_id(), $($rest)+)
    }};
}

pub(crate) use {error_about_call, warn_about_call};

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(pairs: &[(&'static str, &'static str)]) -> MetadataMap {
        let mut m = MetadataMap::new();
        for (k, v) in pairs {
            m.insert(*k, v.parse().unwrap());
        }
        m
    }

    #[test]
    fn ids_from_w3c_then_b3() {
        let w3c = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let ids = CallIds::of(&metadata(&[
            ("traceparent", w3c),
            ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
            ("x-request-id", "r-1"),
        ]));
        assert_eq!(ids.trace_id.as_deref(), Some("5bf92f3577b34da6a3ce929d0e0e4736"));
        assert_eq!(ids.request_id.as_deref(), Some("r-1"));
        // An unreadable traceparent leaves B3's.
        let ids = CallIds::of(&metadata(&[
            ("traceparent", "00-not-a-trace-01"),
            ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
        ]));
        assert_eq!(ids.trace_id.as_deref(), Some("80f198ee56343ba864fe8b2a57d3eff7"));
        // A 64-bit B3 id, widened; multi headers.
        let ids = CallIds::of(&metadata(&[
            ("x-b3-traceid", "a3ce929d0e0e4736"),
            ("x-b3-spanid", "00f067aa0ba902b7"),
        ]));
        assert_eq!(ids.trace_id.as_deref(), Some("0000000000000000a3ce929d0e0e4736"));
        assert_eq!(ids.request_id, None);
    }

    #[test]
    fn unreadable_ids_are_left_out() {
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "ff-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-5BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-5bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "",
        ] {
            assert_eq!(
                CallIds::of(&metadata(&[("traceparent", bad)])).trace_id,
                None,
                "{bad:?}"
            );
        }
        assert_eq!(CallIds::of(&metadata(&[("b3", "0")])).trace_id, None);
        assert_eq!(CallIds::of(&metadata(&[("x-b3-traceid", "xyz")])).trace_id, None);
        let long = Box::leak("r".repeat(129).into_boxed_str());
        assert_eq!(CallIds::of(&metadata(&[("x-request-id", long)])).request_id, None);
        assert_eq!(CallIds::of(&metadata(&[("x-request-id", "a b")])).request_id, None);
    }

    #[tokio::test]
    async fn current_is_the_deciding_call() {
        assert_eq!(CallIds::current(), CallIds::default());
        let metadata = metadata(&[("x-request-id", "r-2")]);
        let decide = std::pin::pin!(async {
            let first = CallIds::current();
            tokio::task::yield_now().await;
            (first, CallIds::current())
        });
        let (first, second) = Deciding::new(&metadata, decide).await;
        assert_eq!(first.request_id.as_deref(), Some("r-2"));
        assert_eq!(second.request_id.as_deref(), Some("r-2"));
        // Gone from the thread.
        assert_eq!(CallIds::current(), CallIds::default());
    }

    #[test]
    fn a_panicking_decision_leaves_no_call_behind() {
        let metadata = metadata(&[("x-request-id", "r-3")]);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let decide = std::pin::pin!(async { panic!("a decision that panics") });
            let mut deciding = std::pin::pin!(Deciding::<_>::new(&metadata, decide));
            let mut cx = Context::from_waker(std::task::Waker::noop());
            let _: Poll<()> = deciding.as_mut().poll(&mut cx);
        }));
        assert!(panicked.is_err());
        assert_eq!(CallIds::current(), CallIds::default());
    }
}
