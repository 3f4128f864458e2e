//! What the shared backends (Redis, Postgres) have in common for starting and readiness:
//! connecting at start or in the background, saying why they cannot decide yet, and a probe.
//! `serve` starts either through [`start_shared`], and readiness asks either the same way.

use std::future::Future;
use std::time::Duration;

use super::{ConnectError, StoreError, UnreachableAtStart};

/// A backend shared by every replica, reached over the network.
pub trait SharedBackend: Clone + Send + Sync + 'static {
    /// `Redis` or `Postgres`, for messages.
    const NAME: &'static str;
    /// Whether readiness probes it on every check (Postgres: with no traffic nothing else
    /// would notice it is gone) or only while its circuit is open (Redis: its connections
    /// report their own state).
    const PROBE_EVERY_CHECK: bool;

    /// Where it is, passwords redacted (for logs, never for `/readyz`).
    fn describe(&self) -> &str;

    /// One attempt to connect and prepare everything a decision needs (pool, scripts or
    /// schema), within `timeout`. Errors: unreachable, refused, or not prepared.
    fn connect(&self, timeout: Duration) -> impl Future<Output = Result<(), ConnectError>> + Send;

    /// Keeps connecting in the background (each attempt within `timeout`) until it succeeds.
    fn connect_in_background(&self, timeout: Duration);

    /// Why it cannot decide yet (not connected, scripts still loading), with its address for
    /// the log; `None` once connected and prepared.
    fn not_ready_yet(&self) -> Option<String>;

    /// A cheap call that fails when the backend does, within `timeout`.
    fn probe(&self, timeout: Duration) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// Connects `backend` at start as `unreachable_at_start` says: `exit` fails when it cannot be
/// reached within `timeout`; `not_ready` starts anyway and connects in the background.
/// `detail` is logged beside the address on success (say, the Cluster flag or the schema).
///
/// Errors: `exit` and the backend could not be reached or prepared.
pub async fn start_shared<B: SharedBackend>(
    backend: &B,
    unreachable_at_start: UnreachableAtStart,
    timeout: Duration,
    detail: &str,
) -> Result<(), ConnectError> {
    match (backend.connect(timeout).await, unreachable_at_start) {
        (Ok(()), _) => {
            tracing::info!(at = %backend.describe(), detail, "connected to {}", B::NAME);
            Ok(())
        }
        (Err(e), UnreachableAtStart::Exit) => Err(e),
        (Err(e), UnreachableAtStart::NotReady) => {
            tracing::warn!(
                error = %e,
                "{} not reachable at start: not ready until it is; connecting in the background",
                B::NAME
            );
            backend.connect_in_background(timeout);
            Ok(())
        }
    }
}
