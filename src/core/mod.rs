//! The pure core: token-bucket math, schedules and quotas, the clock trait, and the table of
//! Envoy's units. Nothing here does I/O or reads a clock: every function takes the time and
//! the state and returns a decision, so the stores, the Lua script and the Postgres path can
//! be pinned to it by the shared test vectors.

pub mod bucket;
pub mod clock;
pub mod schedule;
pub mod units;
