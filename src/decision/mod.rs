//! The decision path: the limiter that turns a `RateLimitRequest` into demands on buckets,
//! asks the store, and builds the `RateLimitResponse` with its headers, counting each decision.

pub(crate) mod counting;
pub mod explain;
pub(crate) mod limiter;
pub(crate) mod metadata;
pub(crate) mod quota_mode;
pub(crate) mod response;
pub(crate) mod settings;

pub use explain::{BucketExplained, DescriptorExplained, Explanation, Found};
pub use limiter::{LimitError, Limiter, LimiterOptions, ResolveError, Resolved};

pub use settings::{HeaderSettings, LimitHeaders, RequestLimits, ResponseSettings, ShadowHeaderSettings};
