//! The public HTTP port: `/healthz` (the process is up), `/readyz` (rules are loaded, the
//! backend answers, and the server is not shutting down), `/metrics` (Prometheus text format)
//! and `/config` (the rules in force as JSON, secrets redacted). Nothing here changes state;
//! the bucket admin API has its own listener ([`crate::admin`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;

/// Shared readiness flag: set once serving, cleared when shutting down.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Marks the service ready or not.
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    /// Whether the service is ready.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Whether decisions can be taken: `Ok(None)`, `Ok(Some(why))` when only a fallback can take
/// them (still ready, `/readyz` says why), or `Err(why)` (not ready); see
/// [`crate::store::AnyStore::ready`].
pub type BackendCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Option<String>, String>> + Send>> + Send + Sync>;

/// What the HTTP routes read.
#[derive(Clone)]
pub struct HttpState {
    /// Cleared while shutting down.
    pub ready: Readiness,
    /// Asked by `/readyz` on each call.
    pub backend: BackendCheck,
    /// Renders `/metrics`; absent when no recorder is installed (then `/metrics` is 404).
    pub metrics: Option<PrometheusHandle>,
    /// Brings gauges read at scrape time (such as the memory store's size) up to date.
    pub refresh: Arc<dyn Fn() + Send + Sync>,
    /// The `/config` document.
    pub config: Arc<dyn Fn() -> serde_json::Value + Send + Sync>,
}

impl HttpState {
    /// A state that is ready, with a backend that always answers, no metrics and an empty
    /// `/config` (for tests of the routes).
    pub fn basic(ready: Readiness) -> HttpState {
        HttpState {
            ready,
            backend: Arc::new(|| Box::pin(async { Ok(None) })),
            metrics: None,
            refresh: Arc::new(|| {}),
            config: Arc::new(|| serde_json::json!({})),
        }
    }
}

/// The HTTP routes.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/config", get(config))
        .with_state(state)
}

async fn readyz(State(state): State<HttpState>) -> (StatusCode, String) {
    if !state.ready.get() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: shutting down or starting\n".into(),
        );
    }
    match (state.backend)().await {
        Ok(None) => (StatusCode::OK, "ready\n".into()),
        Ok(Some(degraded)) => (StatusCode::OK, format!("ready (degraded): backend: {degraded}\n")),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: backend: {why}\n")),
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    let Some(handle) = &state.metrics else {
        return (StatusCode::NOT_FOUND, "metrics are not enabled\n").into_response();
    };
    (state.refresh)();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        handle.render(),
    )
        .into_response()
}

async fn config(State(state): State<HttpState>) -> Json<serde_json::Value> {
    Json((state.config)())
}
