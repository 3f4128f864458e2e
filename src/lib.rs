//! Tollgate: an exact token-bucket rate-limit service for Envoy's
//! `envoy.service.ratelimit.v3.RateLimitService`.
//!
//! The crate is a library so the core can be tested and benchmarked without gRPC; the
//! `tollgate` binary in `main.rs` is a thin CLI over it. See `ARCHITECTURE.md` for the map.

#![warn(missing_docs, unreachable_pub)]

// The layers, lowest first; each module's documentation says what it offers. What the binaries,
// benches, fuzz targets and integration tests use is public; the rest is `pub(crate)`.
pub mod admin;
pub mod console;
pub mod core;
pub mod decision;
pub mod rlqs;
pub mod rules;
pub mod server;
pub mod statsd;
pub mod store;
pub mod telemetry;
pub mod traces;

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
