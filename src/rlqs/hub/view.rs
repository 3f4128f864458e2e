//! What `/rlqs` and `/config` show of a hub: every global bucket with Envoys on this replica,
//! and each Envoy's share.

use serde::Serialize;

use super::{limit_at, Held, Hub};
use crate::core::bucket::MICRO;
use crate::rlqs::group::split_rate_ut_per_s;
use crate::store::Store;

impl<S: Store> Hub<S> {
    /// What `/config` and the admin API show: every global bucket with Envoys on this replica.
    pub async fn view(&self) -> RlqsView {
        let now = self.clock.now_us();
        let (streams, cells) = {
            let inner = self.lock();
            (inner.streams.len(), inner.groups.values().cloned().collect::<Vec<_>>())
        };
        let mut buckets = Vec::new();
        for cell in cells {
            let g = cell.lock().await;
            let limit = limit_at(&g.resolved, now);
            buckets.push(RlqsBucketView {
                domain: g.domain.clone(),
                rule: g.resolved.rule.clone(),
                buckets: g.resolved.policies.iter().map(|p| p.name.clone()).collect(),
                refill_per_second: split_rate_ut_per_s(&limit) as f64 / MICRO as f64,
                shares: g
                    .group
                    .shares()
                    .map(|((stream, _), s)| ShareView {
                        stream: *stream,
                        assignment: match s.held {
                            Held::Bucket { shape, .. } => format!(
                                "token_bucket max_tokens={} tokens_per_fill={} fill_interval={}s",
                                shape.max_tokens, shape.tokens_per_fill, shape.fill_seconds
                            ),
                            Held::Blanket => "deny_all".into(),
                            Held::Nothing => "none".into(),
                        },
                        demand_per_second: s.demand_ut_per_s.map(|d| d as f64 / MICRO as f64),
                    })
                    .collect(),
                outstanding_tokens: g.group.outstanding_ut(now) as f64 / MICRO as f64,
            });
        }
        buckets.sort_by(|a, b| (&a.domain, &a.rule).cmp(&(&b.domain, &b.rule)));
        RlqsView {
            enabled: true,
            streams,
            ttl_seconds: self.settings.ttl_seconds(),
            buckets,
        }
    }
}

/// The RLQS part of `/config`, and `/rlqs` on the admin listener.
#[derive(Clone, Debug, Serialize)]
pub struct RlqsView {
    /// Whether the service is served.
    pub enabled: bool,
    /// Open streams.
    pub streams: usize,
    /// `assignment_time_to_live` of every assignment, in seconds.
    pub ttl_seconds: u64,
    /// Global buckets with Envoys on this replica.
    pub buckets: Vec<RlqsBucketView>,
}

/// One global bucket's Envoys on this replica.
#[derive(Clone, Debug, Serialize)]
pub struct RlqsBucketView {
    /// Its domain.
    pub domain: String,
    /// The rule's path.
    pub rule: String,
    /// The rule's bucket names.
    pub buckets: Vec<String>,
    /// The refill split among the shares, in tokens a second.
    pub refill_per_second: f64,
    /// One per Envoy bucket.
    pub shares: Vec<ShareView>,
    /// Tokens the Envoys may still admit on what was paid for.
    pub outstanding_tokens: f64,
}

/// One Envoy's share.
#[derive(Clone, Debug, Serialize)]
pub struct ShareView {
    /// The stream (a number local to this replica).
    pub stream: u64,
    /// What it was last sent.
    pub assignment: String,
    /// Its requests a second, as reported; none before a report covering some time.
    pub demand_per_second: Option<f64>,
}
