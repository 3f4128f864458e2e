//! The decision path: the limiter that turns a `RateLimitRequest` into demands on buckets,
//! asks the store, and builds the `RateLimitResponse` with its headers, counting each decision.

pub mod counting;
pub mod limiter;
pub mod response;
pub mod settings;

pub use settings::{HeaderSettings, RequestLimits};
