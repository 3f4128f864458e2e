//! The public HTTP port: `/healthz` (the process is up), `/readyz` (rules are loaded, the
//! backend answers, and the server is not shutting down), `/metrics` (Prometheus text format),
//! and `/healthcheck` as envoyproxy/ratelimit answers it (200 `OK` when ready, else 500 with an
//! empty body, so their probes work unchanged). Nothing here changes state, and nothing here
//! tells more than health: anyone who reaches the port (every Envoy, every pod a NetworkPolicy
//! lets in) reads it, so `/readyz` gives a short reason without hosts or URLs (the log has the
//! details) and `/config`, which shows rule values (they can be API keys) and backend hosts, is
//! on the admin listener ([`crate::admin`]).
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::store::Health;

/// Shared readiness flag: set once serving, cleared when shutting down.
#[derive(Clone, Debug, Default)]
pub(crate) struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Marks the service ready or not.
    pub(crate) fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    /// Whether the service is ready.
    pub(crate) fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Whether decisions can be taken, and what `/readyz` may say about it; see
/// [`crate::store::AnyStore::ready`].
pub(crate) type BackendCheck = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Health> + Send>> + Send + Sync>;

/// What the HTTP routes read.
#[derive(Clone)]
pub(crate) struct HttpState {
    /// Cleared while shutting down.
    pub ready: Readiness,
    /// Asked by `/readyz` on each call.
    pub backend: BackendCheck,
    /// Renders `/metrics`; absent when no recorder is installed (then `/metrics` is 404).
    pub metrics: Option<PrometheusHandle>,
    /// Brings gauges read at scrape time (such as the memory store's size) up to date.
    pub refresh: Arc<dyn Fn() + Send + Sync>,
    /// How `/readyz` names the backend in its short reasons.
    pub backend_names: BackendNames,
    /// The backend's last detailed reason, logged when it changes (not on every probe).
    last_reason: Arc<Mutex<Option<String>>>,
    /// Whether the rules allow serving, and if not, why (no address in it): rules from an xDS
    /// server that have not arrived yet (`crate::server::rules_source`).
    rules: Arc<dyn Fn() -> Option<String> + Send + Sync>,
}

/// The names `/readyz` uses for the backend and its fallback (`Redis`, `Postgres`, `memory`):
/// kinds, never addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BackendNames {
    /// The backend deciding: `Redis`, `Postgres` or `memory`.
    pub primary: &'static str,
    /// Its fallback under `failure_mode: fallback`: `postgres` or `memory` (as the
    /// `redis.fallback` setting names them).
    pub fallback: Option<&'static str>,
}

impl HttpState {
    /// A state over these parts, the backend named by `backend_names`.
    pub(crate) fn new(
        ready: Readiness,
        backend: BackendCheck,
        metrics: Option<PrometheusHandle>,
        refresh: Arc<dyn Fn() + Send + Sync>,
        backend_names: BackendNames,
    ) -> HttpState {
        HttpState {
            ready,
            backend,
            metrics,
            refresh,
            backend_names,
            last_reason: Arc::default(),
            rules: Arc::new(|| None),
        }
    }

    /// This state with the rules' readiness asked by `/readyz` too (before the backend's).
    pub(crate) fn with_rules(mut self, rules: Arc<dyn Fn() -> Option<String> + Send + Sync>) -> HttpState {
        self.rules = rules;
        self
    }
}

impl HttpState {
    /// A state that is ready, with a memory backend that always answers and no metrics (for
    /// tests of the routes).
    #[cfg(test)]
    pub(crate) fn basic(ready: Readiness) -> HttpState {
        HttpState::new(
            ready,
            Arc::new(|| {
                Box::pin(async {
                    Health {
                        verdict: Ok(None),
                        notice: None,
                    }
                })
            }),
            None,
            Arc::new(|| {}),
            BackendNames {
                primary: "memory",
                fallback: None,
            },
        )
    }
}

/// The HTTP routes.
pub(crate) fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        // Theirs answers /healthcheck whatever the method; some probes send HEAD or POST.
        .route("/healthcheck", any(healthcheck))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// The metrics alone at `path`, for a listener of their own (`metrics.addr`, their
/// `PROMETHEUS_ADDR`).
pub(crate) fn metrics_router(state: HttpState, path: &str) -> Router {
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
    if let Some(why) = (state.rules)() {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n"));
    }
    let Health { verdict, notice } = (state.backend)().await;
    let detail = match (&verdict, &notice) {
        (Ok(None), None) => None,
        (Ok(None), Some(why)) => Some(why.clone()),
        (Ok(Some(why)) | Err(why), None) => Some(why.clone()),
        (Ok(Some(why)) | Err(why), Some(notice)) => Some(format!("{why}; {notice}")),
    };
    log_change(&state.last_reason, detail, verdict.is_ok());
    let BackendNames { primary, fallback } = state.backend_names;
    let (status, reason) = short_reason(verdict, primary, fallback);
    // The notice names no host (`Health::notice`): a Redis that may evict buckets says so
    // where readiness is read.
    match notice {
        Some(notice) if status == StatusCode::OK && reason == "ready\n" => {
            (status, format!("ready (degraded): {notice}\n"))
        }
        Some(notice) => (status, format!("{}; {notice}\n", reason.trim_end())),
        None => (status, reason),
    }
}

/// `/readyz`'s short reason for a verdict: the kinds of backend, never a URL or a host.
fn short_reason(
    verdict: Result<Option<String>, String>,
    primary: &str,
    fallback: Option<&str>,
) -> (StatusCode, String) {
    match (verdict, fallback) {
        (Ok(None), _) => (StatusCode::OK, "ready\n".into()),
        // `AnyStore::ready` says "deciding on the <name> fallback" when the primary fails and
        // the fallback decides, "the <name> fallback is failing" when only the fallback fails.
        (Ok(Some(why)), Some(fallback)) if why.contains("deciding on the") => (
            StatusCode::OK,
            format!("ready (degraded): {primary} is failing; deciding on the {fallback} fallback\n"),
        ),
        (Ok(Some(_)), Some(fallback)) => (
            StatusCode::OK,
            format!("ready (degraded): the {fallback} fallback is failing\n"),
        ),
        (Ok(Some(_)), None) => (StatusCode::OK, format!("ready (degraded): {primary}; see the log\n")),
        (Err(_), Some(fallback)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {primary} and the {fallback} fallback are failing\n"),
        ),
        (Err(_), None) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {primary} is failing\n"),
        ),
    }
}

/// Logs the backend's detailed reason (URLs redacted by the stores) when it differs from the
/// last one: probes ask every few seconds, and the log should say when things changed.
fn log_change(last: &Mutex<Option<String>>, detail: Option<String>, ready: bool) {
    let mut last = last.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if *last == detail {
        return;
    }
    match &detail {
        Some(why) if ready => tracing::warn!(reason = %why, "ready, degraded"),
        Some(why) => tracing::warn!(reason = %why, "not ready"),
        None => tracing::info!("ready: the backend answers again"),
    }
    *last = detail;
}

// Rendering `/metrics` (tens of milliseconds with many buckets' series) runs on a blocking
// thread: on a current-thread runtime it would otherwise hold up every decision that long.

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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Rendering `/metrics` can take tens of milliseconds; on a current-thread runtime, done
    /// on the runtime's thread, it held up every decision that long. A scrape that takes
    /// 300 ms must leave a 50 ms timer on the same runtime on time.
    #[test]
    fn a_slow_scrape_does_not_hold_up_the_runtime() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut state = HttpState::basic(Readiness::default());
            state.metrics = Some(
                metrics_exporter_prometheus::PrometheusBuilder::new()
                    .build_recorder()
                    .handle(),
            );
            state.refresh = Arc::new(|| std::thread::sleep(Duration::from_millis(300)));
            let addr = serve(state).await;
            let fetch = tokio::spawn(get(addr, "/metrics"));
            // The request reaches the handler while this timer runs: rendered on the runtime's
            // thread, the scrape would make the timer fire 300 ms late.
            let started = Instant::now();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let took = started.elapsed();
            let answer = fetch.await.unwrap();
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(took < Duration::from_millis(200), "a 50 ms timer took {took:?}");
        });
    }

    async fn serve(state: HttpState) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router(state)).await });
        addr
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.unwrap();
        answer
    }

    /// `/readyz` is public: its reasons name the kind of backend, never a URL, a host or a
    /// password (it showed the stores' reasons, `not connected to Redis at redis://...`).
    #[tokio::test]
    async fn readyz_reasons_show_no_hosts_or_passwords() {
        let detail = "not connected to Redis at redis://app:hunter2pw@cache-7.internal.example:6390/0";
        for (check, fallback, status) in [
            (Err(detail.to_owned()), None, 503),
            (
                Err(format!(
                    "{detail}; and the postgres fallback: postgres://u:pw2@db-3.internal/x"
                )),
                Some("postgres"),
                503,
            ),
            (
                Ok(Some(
                    "the postgres fallback is failing: postgres://u:pw2@db-3.internal/x".to_owned(),
                )),
                Some("postgres"),
                200,
            ),
            (
                Ok(Some(format!("{detail}; deciding on the memory fallback"))),
                Some("memory"),
                200,
            ),
        ] {
            let ready = Readiness::default();
            ready.set(true);
            let mut state = HttpState::basic(ready);
            let answer = check.clone();
            state.backend = Arc::new(move || {
                let answer = answer.clone();
                Box::pin(async move {
                    Health {
                        verdict: answer,
                        notice: None,
                    }
                })
            });
            state.backend_names = BackendNames {
                primary: "Redis",
                fallback,
            };
            let response = get(serve(state).await, "/readyz").await;
            assert!(response.starts_with(&format!("HTTP/1.1 {status}")), "{response}");
            for secret in [
                "hunter2pw",
                "cache-7",
                "internal",
                "6390",
                "redis://",
                "postgres://",
                "pw2",
                "db-3",
                "app:",
            ] {
                assert!(!response.contains(secret), "/readyz shows {secret:?}: {response}");
            }
            assert!(
                response.contains("Redis") || response.contains("fallback is failing"),
                "{response}"
            );
            if let Some(fallback) = fallback {
                assert!(response.contains(&format!("{fallback} fallback")), "{response}");
            }
        }
    }

    /// A notice (a Redis `maxmemory-policy` that may evict buckets) is served on `/readyz`
    /// whatever the verdict: degraded when all else is well, added to the reason otherwise. It
    /// read "ready (degraded): Redis; see the log", which left an operator to guess.
    #[tokio::test]
    async fn readyz_serves_the_notice() {
        let notice = "Redis maxmemory-policy allkeys-lru can evict buckets; use noeviction";
        for (verdict, status, start) in [
            (Ok(None), 200, "ready (degraded): "),
            (
                Err("not connected to Redis at redis://h:1".to_owned()),
                503,
                "not ready: Redis is failing; ",
            ),
        ] {
            let ready = Readiness::default();
            ready.set(true);
            let mut state = HttpState::basic(ready);
            state.backend = Arc::new(move || {
                let verdict = verdict.clone();
                Box::pin(async move {
                    Health {
                        verdict,
                        notice: Some(notice.to_owned()),
                    }
                })
            });
            state.backend_names = BackendNames {
                primary: "Redis",
                fallback: None,
            };
            let response = get(serve(state).await, "/readyz").await;
            assert!(response.starts_with(&format!("HTTP/1.1 {status}")), "{response}");
            assert!(response.ends_with(&format!("\r\n\r\n{start}{notice}\n")), "{response}");
        }
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
