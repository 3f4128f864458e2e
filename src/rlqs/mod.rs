//! Envoy's Rate Limit Quota Service (RLQS, `envoy.service.rate_limit_quota.v3`): Envoys decide
//! locally on token-bucket assignments streamed to them and report their usage; tollgate hands
//! out shares of the same global buckets its `ShouldRateLimit` decides on (docs/rlqs.md).
//!
//! A room beside `server/`, on the same gRPC listener: it uses the rules and the limiter's
//! resolution (`decision/`), and pays for every assignment in the store (`store/`), so RLS
//! clients, RLQS clients and replicas share one limit.
//!
//! - `shape.rs`: the token bucket Envoy runs for an assignment, and what it can admit (pure).
//! - `plan.rs`: what each Envoy of a global bucket is sent next and what that costs the bucket
//!   (pure): shares paid for before they are sent.
//! - `group.rs`: one global bucket's Envoys on this replica: reports, demand, fair targets (pure).
//! - `bucket_id.rs`: a bucket id (a map) as a descriptor of the rules' tree.
//! - `hub.rs`: streams, bindings, the assignment loop, the store calls.
//! - `service.rs`: the tonic service; `settings.rs`: the `rlqs` section; `metrics.rs`.

pub mod bucket_id;
pub mod group;
pub mod hub;
mod metrics;
pub mod plan;
pub mod service;
pub mod settings;
pub mod shape;

pub use hub::{Hub, RlqsView};
pub use service::QuotaService;
pub use settings::{RlqsSettings, Unmatched};
