//! The sampler: the configured one (`tracing.sampling_ratio`, else `OTEL_TRACES_SAMPLER`),
//! except for a root span that links other spans, a batched round trip to Redis or Postgres
//! (`crate::store`'s `round_trip`), which is kept exactly when a span it links is sampled.
//!
//! A round trip serves requests of several traces and is the root of a trace of its own, so the
//! configured sampler would decide it as a new trace: at `sampling_ratio` it would drop the
//! round trips of sampled requests at that ratio, and keep some that served only unsampled
//! ones. Its links are its own from its start (`follows_from` before the span is entered), so
//! they are here to decide by.

use opentelemetry::trace::{Link, SpanKind, TraceContextExt, TraceId, TraceState};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SamplingDecision, SamplingResult, ShouldSample};

/// The configured sampler, but a root span with links follows them (see the module's docs).
#[derive(Clone, Debug)]
pub(super) struct FollowsLinks {
    configured: Box<dyn ShouldSample>,
}

impl FollowsLinks {
    pub(super) fn new(configured: Box<dyn ShouldSample>) -> FollowsLinks {
        FollowsLinks { configured }
    }
}

impl ShouldSample for FollowsLinks {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let root = parent_context.is_none_or(|cx| !cx.has_active_span());
        if !root || links.is_empty() {
            return self
                .configured
                .should_sample(parent_context, trace_id, name, span_kind, attributes, links);
        }
        let decision = if links.iter().any(|link| link.span_context.is_sampled()) {
            SamplingDecision::RecordAndSample
        } else {
            SamplingDecision::Drop
        };
        SamplingResult {
            decision,
            attributes: Vec::new(),
            trace_state: TraceState::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags};
    use opentelemetry_sdk::trace::Sampler;

    fn link(sampled: bool) -> Link {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let context = SpanContext::new(
            TraceId::from(7u128),
            SpanId::from(9u64),
            flags,
            true,
            TraceState::default(),
        );
        Link::with_context(context)
    }

    fn decide(sampler: &FollowsLinks, parent: Option<&Context>, links: &[Link]) -> SamplingDecision {
        sampler
            .should_sample(parent, TraceId::from(1u128), "s", &SpanKind::Internal, &[], links)
            .decision
    }

    /// Under a sampler that keeps no new trace, a round trip is still kept when a request it
    /// served was sampled, and dropped when none was; other spans are the sampler's.
    #[test]
    fn a_root_with_links_is_kept_when_a_linked_span_is_sampled() {
        let sampler = FollowsLinks::new(Box::new(Sampler::ParentBased(Box::new(Sampler::AlwaysOff))));
        let keep = SamplingDecision::RecordAndSample;
        assert_eq!(decide(&sampler, None, &[link(false), link(true)]), keep);
        assert_eq!(decide(&sampler, None, &[link(false)]), SamplingDecision::Drop);
        assert_eq!(decide(&sampler, None, &[]), SamplingDecision::Drop);
        let empty = Context::new();
        assert_eq!(decide(&sampler, Some(&empty), &[link(true)]), keep);

        let kept = FollowsLinks::new(Box::new(Sampler::ParentBased(Box::new(Sampler::AlwaysOn))));
        assert_eq!(decide(&kept, None, &[link(false)]), SamplingDecision::Drop);
        assert_eq!(decide(&kept, None, &[]), keep);
        // A child follows its parent, whatever it links.
        let unsampled_parent = Context::new().with_remote_span_context(link(false).span_context);
        assert_eq!(
            decide(&kept, Some(&unsampled_parent), &[link(true)]),
            SamplingDecision::Drop
        );
    }
}
