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
pub mod envoyproxy_env;
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

/// An error and its sources, `: `-separated, each said once (a layer that only wraps another
/// repeats its text): `transport error: tcp connect error: Connection refused (os error 111)`
/// where the error itself says only `transport error`. For messages to a person (the CLI, the
/// load generator).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(e) = next {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}
