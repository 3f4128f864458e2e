//! Tollgate: an exact token-bucket rate-limit service for Envoy's
//! `envoy.service.ratelimit.v3.RateLimitService`.
//!
//! The crate is a library so the core can be tested and benchmarked without gRPC; the
//! `tollgate` binary in `main.rs` is a thin CLI over it. See `ARCHITECTURE.md` for the map.

pub mod admin;
pub mod bucket;
pub mod check;
pub mod clock;
pub mod config;
pub mod config_view;
pub mod http;
pub mod limiter;
pub mod matcher;
pub mod metrics;
pub mod reload;
pub mod response;
pub mod rules;
pub mod schedule;
pub mod server;
pub mod service;
pub mod settings;
pub mod store;
pub mod wire;
