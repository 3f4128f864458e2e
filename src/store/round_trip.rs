//! The span of a batched round trip (docs/monitoring.md, "Traces"): the Redis and Postgres
//! lanes decide several requests in one call, and that call is one span of its own, linked
//! (`follows_from`, an OpenTelemetry span link) from the `store` span of each request it served.
//!
//! A round trip serves requests of several traces, so its span is the root of a trace of its
//! own rather than a child of one of them: made with `parent: None`, never the lane's current
//! span. It exists only while traces are exported and one of its requests was traced; the
//! sampler (`crate::traces`) keeps it exactly when one of the spans it links is sampled.

use tracing::field::Empty;
use tracing::Span;

use super::StoreError;

/// The span of the request submitting a job to a lane (its `store` span), while traces are
/// exported and the request is part of a sampled call; `None` otherwise, for the cost of one
/// relaxed load while traces are off.
#[inline]
pub(crate) fn origin() -> Option<Span> {
    crate::telemetry::in_sampled_call().then(Span::current)
}

/// What a round trip carried, for its span's attributes.
pub(crate) struct Carried {
    /// `ratelimit.backend`: `redis` or `postgres`.
    pub backend: &'static str,
    /// `ratelimit.call`: what the round trip was: a call of the decision script on Redis
    /// (`decide`, or `decide_cross_slot`, its Cluster form), a batch on Postgres
    /// (`tollgate_decide`, its function; the requests it leaves to a transaction are counted
    /// in `ratelimit.transaction`, recorded by the batch).
    pub call: &'static str,
    /// `ratelimit.requests`: the jobs it decided (in Cluster mode, a job is one slot's part of
    /// a request).
    pub requests: usize,
    /// `ratelimit.buckets`: the bucket instances it read, summed over its jobs.
    pub buckets: usize,
}

/// The span of one round trip serving jobs whose submitters' spans are `origins`, linked from
/// each of them; `None`, and nothing made, when none of them carries a span (traces off, or
/// requests outside any trace).
pub(crate) fn span<'a>(origins: impl Iterator<Item = &'a Option<Span>>, carried: Carried) -> Option<Span> {
    let mut origins = origins.flatten().peekable();
    origins.peek()?;
    // `parent: None`: a contextual span would be the child of whatever is current on the
    // lane's thread (the trace layer takes the OpenTelemetry context current there), and a
    // round trip belongs to none of the traces it serves.
    let span = tracing::debug_span!(
        target: "tollgate::store",
        parent: None,
        "store.round_trip",
        ratelimit.backend = carried.backend,
        ratelimit.call = carried.call,
        ratelimit.requests = carried.requests,
        ratelimit.buckets = carried.buckets,
        ratelimit.transaction = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    );
    if span.is_disabled() {
        return None;
    }
    // Before the span is first entered: the links are then the span's own from its start, so
    // the sampler sees them.
    for origin in origins {
        span.follows_from(origin);
    }
    Some(span)
}

/// Marks `span` (a round trip's, if any) as failed with `error`: an OpenTelemetry error status
/// whose description is the error's message.
pub(crate) fn failed(span: Option<&Span>, error: &StoreError) {
    if let Some(span) = span {
        span.record("otel.status_code", "error");
        span.record("otel.status_description", tracing::field::display(error));
    }
}
