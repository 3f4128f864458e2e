//! Rules from an xDS server (`rules_source: xds`, docs/operations.md): the way Envoy Gateway
//! and Envoy AI Gateway feed envoyproxy/ratelimit, which tollgate takes the place of.
//!
//! - **The stream** ([`client`]): one aggregated discovery stream (ADS, state of the world) to
//!   `xds.server_url`, subscribed to every `RateLimitConfig` for the node `xds.node_id`, with
//!   the node's metadata and `xds.headers` as gRPC metadata, over TLS with a client
//!   certificate when configured. Lost or refused, it is opened again after a capped
//!   exponential backoff with jitter, and resumes: its first request carries the version of
//!   the rules in force, so a server with nothing newer sends nothing.
//! - **An update** is a whole snapshot, one resource per domain: mapped onto the rules model
//!   ([`map`]), exactly as the rules files of the same content, and compiled all or nothing by
//!   the files' compiler. Valid, it is put in force by the step every rules source shares
//!   ([`crate::server::reload::put_in_force`]) and ACKed (the response's version and nonce);
//!   invalid, it is NACKed (the version in force, the nonce, and an `error_detail` naming each
//!   resource, rule and reason) and the rules in force stay, as after a failed file reload.
//!   A snapshot identical to the one in force is ACKed without a swap.
//! - **Readiness** ([`XdsState`]): not ready, and no decisions (`UNAVAILABLE`, so Envoy's
//!   `failure_mode_deny` decides, as when theirs has not started), until the first rules are
//!   in force, unless `xds.force_start` (ready at once, nothing limited until then).

mod client;
pub(crate) mod map;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::json;

use crate::decision::limiter::Limiter;
use crate::server::reload::unix_now;
use crate::server::settings::XdsSettings;
use crate::store::Store;

/// What the xDS client has done, shared with `/config`, `/readyz` and the gRPC service.
pub(crate) struct XdsState {
    server: String,
    node: String,
    tls: bool,
    force_start: bool,
    /// Rules from the server are in force (set at the first ACK; read on every request while
    /// decisions wait, so not behind the lock).
    applied: AtomicBool,
    progress: Mutex<Progress>,
}

/// The client's progress (see [`XdsState`]).
#[derive(Debug, Default)]
struct Progress {
    /// A connection to the server is up.
    connected: bool,
    /// The version of the rules in force (the last ACKed response's); `None` before the first.
    version: Option<String>,
    /// The last ACK: the version and when (Unix seconds).
    last_ack: Option<(String, u64)>,
    /// The last NACK: the version refused, why (one line per problem), when.
    last_nack: Option<(String, Vec<String>, u64)>,
    /// The latest update was NACKed (cleared by the next ACK).
    failing: bool,
    /// The last failure of the connection or stream, and when; cleared by a response.
    last_error: Option<(String, u64)>,
    /// The kind of the last failure, for `/readyz` (kept until the next connection).
    last_failure: Option<Failure>,
}

/// What kind of failure ended a connection attempt or a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// No connection was made (TCP, TLS or HTTP/2).
    Connect,
    /// The stream failed, or the server closed it, after the connection was made.
    Stream,
    /// A response was larger than `xds.max_message_bytes`.
    TooLarge,
}

impl XdsState {
    /// The state of a client configured by `settings`, before it has connected.
    pub(crate) fn new(settings: &XdsSettings) -> XdsState {
        XdsState {
            server: settings.server_url.clone(),
            node: settings.node_id.clone(),
            tls: settings.tls.enabled,
            force_start: settings.force_start,
            applied: AtomicBool::new(false),
            progress: Mutex::default(),
        }
    }

    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether rules from the server are in force.
    fn applied(&self) -> bool {
        self.applied.load(Ordering::Acquire)
    }

    /// Why decisions are not taken yet: no rules from the server and no `force_start`.
    pub(crate) fn waiting(&self) -> bool {
        !self.force_start && !self.applied()
    }

    /// `/readyz`'s short reason while not ready (no server address: anyone who reaches the
    /// port reads it), `None` when ready.
    pub(crate) fn not_ready(&self) -> Option<String> {
        if !self.waiting() {
            return None;
        }
        let p = self.progress();
        // The connection first: a rejection before it was lost is not the reason now.
        let state = match (p.connected, p.last_failure) {
            (true, _) if p.failing => "its rules were rejected; see the log",
            (true, _) => "connected, waiting for its first response",
            (false, Some(Failure::TooLarge)) => "its response is larger than xds.max_message_bytes; see the log",
            (false, Some(Failure::Stream)) => "the stream failed; see the log",
            (false, Some(Failure::Connect) | None) => "not connected; see the log",
        };
        Some(format!("no rules received from the xDS server yet ({state})"))
    }

    /// The detailed reason for the log while not ready: the server, the node and the last
    /// error.
    fn waiting_reason(&self, error: &str) -> String {
        format!(
            "no rules received from xDS server {} (node {}) yet: {error}",
            self.server, self.node
        )
    }

    /// `/config`'s `rules_source`: `{"kind": "xds", "server", "node", "tls", "connected",
    /// "force_start", "version", "last_ack": null | {"version", "at_unix_seconds"},
    /// "last_nack": null | {"version", "reason", "at_unix_seconds"}, "last_error": null |
    /// {"error", "at_unix_seconds"}}`; `version` is that of the rules in force (`null`: none
    /// from the server yet).
    pub(crate) fn status_json(&self) -> serde_json::Value {
        let p = self.progress();
        json!({
            "kind": "xds",
            "server": self.server,
            "node": self.node,
            "tls": self.tls,
            "force_start": self.force_start,
            "connected": p.connected,
            "version": p.version,
            "last_ack": p.last_ack.as_ref().map(|(v, at)| json!({"version": v, "at_unix_seconds": at})),
            "last_nack": p.last_nack.as_ref().map(|(v, problems, at)| json!({
                "version": v, "reason": problems.join("\n"), "at_unix_seconds": at
            })),
            "last_error": p.last_error.as_ref().map(|(e, at)| json!({"error": e, "at_unix_seconds": at})),
        })
    }

    /// `/config`'s `reload`, as the files' reloader shows it: `{"generation", "last_reload_failed",
    /// "last_failure": null | {"at_unix_seconds", "problems"}}`, the failure that of the latest
    /// update when it was NACKed.
    pub(crate) fn reload_json(&self, generation: u64) -> serde_json::Value {
        let p = self.progress();
        let failure = p
            .last_nack
            .as_ref()
            .filter(|_| p.failing)
            .map(|(_, problems, at)| json!({"at_unix_seconds": at, "problems": problems}));
        json!({
            "generation": generation,
            "last_reload_failed": failure.is_some(),
            "last_failure": failure,
        })
    }

    fn set_connected(&self, connected: bool) {
        let mut p = self.progress();
        p.connected = connected;
        if connected {
            p.last_failure = None;
        }
        drop(p);
        crate::telemetry::xds_connected(connected);
    }

    /// Records a failed connection or stream; the log line says it, with why the service is
    /// not ready while it has no rules.
    fn failed(&self, error: String, failure: Failure, retry_in: std::time::Duration) {
        let first = {
            let mut p = self.progress();
            p.connected = false;
            p.last_failure = Some(failure);
            let changed = p.last_error.as_ref().is_none_or(|(e, _)| *e != error);
            p.last_error = Some((error.clone(), unix_now()));
            changed
        };
        crate::telemetry::xds_connected(false);
        if !self.applied() {
            let reason = self.waiting_reason(&error);
            let state = if self.force_start {
                "ready, nothing limited (xds.force_start)"
            } else {
                "not ready"
            };
            if first {
                tracing::warn!(retry_in = ?retry_in, "{state}: {reason}");
            } else {
                tracing::debug!(retry_in = ?retry_in, "{state}: {reason}");
            }
        } else if first {
            tracing::warn!(server = %self.server, retry_in = ?retry_in, error = %error, "xDS stream lost; the rules in force stay");
        } else {
            tracing::debug!(server = %self.server, retry_in = ?retry_in, error = %error, "xDS stream lost again");
        }
    }

    fn acked(&self, version: &str) {
        let mut p = self.progress();
        p.version = Some(version.to_owned());
        p.last_ack = Some((version.to_owned(), unix_now()));
        p.failing = false;
        p.last_error = None;
        self.applied.store(true, Ordering::Release);
        crate::telemetry::xds_update(true);
    }

    fn nacked(&self, version: &str, problems: Vec<String>) {
        let mut p = self.progress();
        p.last_nack = Some((version.to_owned(), problems, unix_now()));
        p.failing = true;
        p.last_error = None;
        crate::telemetry::xds_update(false);
    }

    /// The version of the rules in force, empty before the first (what a request carries as
    /// `version_info`).
    fn version(&self) -> String {
        self.progress().version.clone().unwrap_or_default()
    }
}

/// Checks what connecting takes before the start: the server URL, and the TLS files read and
/// parsed. Errors: the setting or file, and why.
pub(crate) fn check(settings: &XdsSettings) -> Result<(), String> {
    client::endpoint(settings).map(|_| ())
}

/// Starts the xDS client for `limiter`'s rules: it runs until the returned task is aborted.
/// The limiter starts with no rules (nothing limited); `state` tells how far the client got.
/// A SIGHUP is logged and changes nothing (the server pushes the rules). Call it within a Tokio
/// runtime.
pub(crate) fn spawn<S: Store>(
    settings: XdsSettings,
    limiter: Arc<Limiter<S>>,
    state: Arc<XdsState>,
) -> tokio::task::JoinHandle<()> {
    crate::telemetry::xds_started();
    if state.waiting() {
        tracing::warn!(
            server = %settings.server_url,
            node = %settings.node_id,
            "not ready until the first rules arrive from the xDS server (xds.force_start is off)"
        );
    } else {
        tracing::info!(
            server = %settings.server_url,
            node = %settings.node_id,
            "ready with nothing limited until the first rules arrive from the xDS server (xds.force_start)"
        );
    }
    let mut hangup = crate::server::reload::Hangup::register();
    let hangups = async move {
        loop {
            hangup.recv().await;
            tracing::info!("SIGHUP: the rules come from the xDS server; nothing to reload");
        }
    };
    tokio::spawn(async move {
        tokio::select! {
            () = client::run(settings, limiter, state) => {}
            () = hangups => {}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readiness_reason_says_the_connection_first() {
        let state = XdsState::new(&XdsSettings::default());
        let reason = || state.not_ready().expect("not ready");
        assert!(reason().contains("(not connected; see the log)"), "{}", reason());
        state.set_connected(true);
        assert!(
            reason().contains("(connected, waiting for its first response)"),
            "{}",
            reason()
        );
        state.nacked("v1", vec!["bad".into()]);
        assert!(
            reason().contains("(its rules were rejected; see the log)"),
            "{}",
            reason()
        );
        // The connection lost after the rejection: that is the reason now.
        state.failed(
            "the server closed the stream".into(),
            Failure::Stream,
            std::time::Duration::from_secs(1),
        );
        assert!(reason().contains("(the stream failed; see the log)"), "{}", reason());
        state.set_connected(true);
        state.failed(
            "a response larger than ...".into(),
            Failure::TooLarge,
            std::time::Duration::from_secs(1),
        );
        assert!(
            reason().contains("(its response is larger than xds.max_message_bytes; see the log)"),
            "{}",
            reason()
        );
        state.set_connected(true);
        state.failed(
            "cannot connect".into(),
            Failure::Connect,
            std::time::Duration::from_secs(1),
        );
        assert!(reason().contains("(not connected; see the log)"), "{}", reason());
        state.acked("v2");
        assert_eq!(state.not_ready(), None);
    }
}
