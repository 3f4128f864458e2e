//! The public HTTP port: `/healthz` (the process is up), `/readyz` (rules are loaded, the
//! backend answers, and the server is not shutting down), `/metrics` (Prometheus text format)
//! and `/config` (the rules in force as JSON, secrets redacted), and `/healthcheck` as
//! envoyproxy/ratelimit answers it (200 `OK` when ready, else 500 with an empty body, so their
//! probes work unchanged). Nothing here changes state;
//! the bucket admin API has its own listener ([`crate::admin`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
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
        // Theirs answers /healthcheck whatever the method; some probes send HEAD or POST.
        .route("/healthcheck", any(healthcheck))
        .route("/metrics", get(metrics))
        .route("/config", get(config))
        .with_state(state)
}

/// The metrics alone at `path`, for a listener of their own (`metrics.addr`, their
/// `PROMETHEUS_ADDR`).
pub fn metrics_router(state: HttpState, path: &str) -> Router {
    Router::new().route(path, get(metrics)).with_state(state)
}

/// envoyproxy/ratelimit's `/healthcheck`, for any method: what `/readyz` says, in their form.
async fn healthcheck(State(state): State<HttpState>) -> Response {
    let (code, _) = readyz(State(state)).await;
    if code == StatusCode::OK {
        (StatusCode::OK, "OK").into_response()
    } else {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
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

// Rendering `/metrics` (tens of milliseconds with many buckets' series) and `/config` (as long
// for 10,000 rules) runs on a blocking thread: on a current-thread runtime it would otherwise
// hold up every decision for that long.

async fn metrics(State(state): State<HttpState>) -> Response {
    let Some(handle) = state.metrics.clone() else {
        return (StatusCode::NOT_FOUND, "metrics are not enabled\n").into_response();
    };
    let refresh = state.refresh.clone();
    let rendered = tokio::task::spawn_blocking(move || {
        refresh();
        handle.render()
    })
    .await;
    match rendered {
        Ok(text) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            text,
        )
            .into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "rendering the metrics failed\n").into_response(),
    }
}

async fn config(State(state): State<HttpState>) -> Response {
    let build = state.config.clone();
    match tokio::task::spawn_blocking(move || build()).await {
        Ok(view) => Json(view).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "building the view failed\n").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Building `/config` (and rendering `/metrics`) can take tens of milliseconds; on a
    /// current-thread runtime, done on the runtime's thread, it held up every decision that long.
    /// A view that takes 300 ms to build must leave a 50 ms timer on the same runtime on time.
    #[test]
    fn a_slow_view_does_not_hold_up_the_runtime() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut state = HttpState::basic(Readiness::default());
            state.config = Arc::new(|| {
                std::thread::sleep(Duration::from_millis(300));
                serde_json::json!({"slow": true})
            });
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, router(state)).await });
            let fetch = tokio::spawn(async move {
                let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
                conn.write_all(b"GET /config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .await
                    .unwrap();
                let mut answer = String::new();
                conn.read_to_string(&mut answer).await.unwrap();
                answer
            });
            // The request reaches the handler while this timer runs: built on the runtime's
            // thread, the view would make the timer fire 300 ms late.
            let started = Instant::now();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let took = started.elapsed();
            let answer = fetch.await.unwrap();
            assert!(answer.contains("\"slow\":true"), "{answer}");
            assert!(took < Duration::from_millis(200), "a 50 ms timer took {took:?}");
        });
    }

    /// Their `/healthcheck` answers any method; tollgate's answered GET (and HEAD) only.
    #[tokio::test]
    async fn healthcheck_answers_every_method() {
        let ready = Readiness::default();
        ready.set(true);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router(HttpState::basic(ready))).await });
        for method in ["GET", "HEAD", "POST", "PUT", "OPTIONS"] {
            let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
            let request =
                format!("{method} /healthcheck HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            conn.write_all(request.as_bytes()).await.unwrap();
            let mut answer = String::new();
            conn.read_to_string(&mut answer).await.unwrap();
            assert!(answer.starts_with("HTTP/1.1 200"), "{method}: {answer}");
            if method != "HEAD" {
                assert!(answer.ends_with("\r\n\r\nOK"), "{method}: {answer}");
            }
        }
    }
}
