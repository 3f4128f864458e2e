//! Wiring for `tollgate serve`: load settings and rules, build the store and limiter, and run
//! the gRPC and HTTP listeners until a shutdown signal.

pub(crate) mod backend;
pub mod check;
pub(crate) mod config_view;
pub(crate) mod grpc;
pub(crate) mod http;
pub(crate) mod metrics;
pub mod reload;
pub(crate) mod rules_source;
pub(crate) mod service;
pub mod settings;
pub mod tls;
pub(crate) mod uds;
pub(crate) mod wire;
pub(crate) mod xds;

pub use backend::TEST_CLOCK_SKEW_ENV;
pub use grpc::{
    serve_grpc, serve_rate_limit_service, serve_rate_limit_service_draining, serve_rate_limit_service_with_health,
    serve_rate_limit_service_with_limits,
};
pub use wire::decode_request;

/// The `RateLimitService` that `tollgate serve` answers with, over `limiter`: request
/// validation, the decision, the response with its headers, and the request metrics; what runs
/// between the gRPC codec ([`decode_request`]) and the network. For measuring the request path
/// without one (`examples/instructions.rs`, the instruction-count gate in benches/README.md).
pub fn rate_limit_service<S: crate::store::Store>(
    limiter: Arc<Limiter<S>>,
) -> impl envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService {
    service::RateLimitGrpc::new(limiter)
}

/// Installs the Prometheus recorder `tollgate serve` installs (its histogram buckets, its
/// series at zero), so a benchmark records metrics at the cost they have in production.
///
/// Errors: another `metrics` recorder is already installed in this process.
pub fn install_metrics_recorder() -> anyhow::Result<()> {
    metrics::install().map(drop)
}

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::decision::limiter::{Limiter, LimiterOptions};
use crate::server::config_view::config_json;
use crate::server::http::{router, HttpState, Readiness};
use crate::server::rules_source::{RulesCheck, RulesSource};
use crate::server::service::RateLimitGrpc;
use crate::server::settings::{Backend, FailureMode, FallbackBackend, RuntimeFlavor, Settings, ShutdownSettings};
use crate::server::tls::{accept::Acceptor, Listener, Tls};
use crate::server::wire::RateLimitServer;
use crate::store::{AnyStore, MemoryStore};

impl LimiterOptions {
    /// The limiter options in `settings`.
    pub fn from_settings(settings: &Settings) -> LimiterOptions {
        LimiterOptions {
            limits: settings.limits,
            headers: settings.headers.clone(),
            shadow_mode: settings.shadow_mode,
            shadow_headers: settings.shadow_headers.clone(),
            overrides: settings.overrides,
            refunds: settings.refunds,
            near_limit_ratio: settings.metrics.near_limit_ratio,
            on_store_failure: match settings.backend {
                Backend::Memory => FailureMode::Error,
                Backend::Redis => settings.redis.failure_mode,
                Backend::Postgres => settings.postgres.failure_mode,
            },
            response: settings.response,
        }
    }
}

/// How `/readyz` names the configured backend and its fallback.
fn backend_names(settings: &Settings) -> crate::server::http::BackendNames {
    let fallback_of = |mode: FailureMode, fallback: Option<&'static str>| match mode {
        FailureMode::Fallback => fallback,
        _ => None,
    };
    match settings.backend {
        Backend::Memory => crate::server::http::BackendNames {
            primary: "memory",
            fallback: None,
        },
        Backend::Redis => crate::server::http::BackendNames {
            primary: "Redis",
            fallback: fallback_of(
                settings.redis.failure_mode,
                Some(match settings.redis.fallback {
                    FallbackBackend::Postgres => "postgres",
                    FallbackBackend::Memory => "memory",
                }),
            ),
        },
        Backend::Postgres => crate::server::http::BackendNames {
            primary: "Postgres",
            fallback: fallback_of(settings.postgres.failure_mode, Some("memory")),
        },
    }
}

/// Runs tollgate with `settings` until SIGINT or SIGTERM, then shuts down gracefully: reports
/// not ready (`/readyz` 503, gRPC health `NOT_SERVING`) for `shutdown.drain_seconds` while
/// still answering, then stops accepting and gives in-flight requests
/// `shutdown.timeout_seconds` to finish; open gRPC connections keep being served, new streams
/// too, until `go_away_margin` before that deadline, then get a graceful GOAWAY. A second
/// signal skips the wait.
///
/// Errors: invalid settings or rules (every problem, with file, rule and reason), TLS files
/// that cannot serve (every problem, with the setting and the file), or a listener that cannot
/// bind.
pub async fn serve(settings: Settings) -> anyhow::Result<()> {
    settings
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid settings: {e}"))?;
    // Before the rules, so their decision counters register with it.
    let prometheus = install_metrics(&settings)?;
    // Before the rules too: the files' problems are reported before anything connects.
    let tls = Arc::new(Tls::load(&settings.tls).map_err(|e| anyhow::anyhow!("cannot serve TLS:\n  {e}"))?);
    tls.spawn_reload();
    let mut initial = crate::server::rules_source::load(&settings)?;
    let clock = backend::local_clock();
    let memory = backend::memory_store(&settings, clock.clone());
    let store = backend::build_store(&settings, &memory, clock).await?;
    let limiter = Arc::new(Limiter::new(
        std::mem::take(&mut initial.rules),
        store,
        LimiterOptions::from_settings(&settings),
    ));
    let (source, reload_task) = initial.start(&limiter, &settings);
    // Held to the end: the socket file of a Unix listener is removed when it drops.
    let (grpc, _socket_file, http) = bind_listeners(&settings, &tls).await?;

    let ready = Readiness::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http_state = http_state(&settings, &limiter, &memory, &ready, prometheus).with_rules(source.check());
    let mut tasks = JoinSet::new();
    let grpc_tls = tls.acceptor(Listener::Grpc);
    let rlqs = settings
        .rlqs
        .enabled
        .then(|| crate::rlqs::Hub::new(limiter.clone(), settings.rlqs));
    let (health_reporter, serving) = start_grpc(
        &mut tasks,
        grpc,
        &limiter,
        &settings,
        &stop_rx,
        &source,
        grpc_tls,
        rlqs.clone(),
    )
    .await;
    // Ready before the HTTP listeners are served, so the first probe that gets an answer
    // hears the backend's state and never "starting" (the ports are bound already; a probe
    // that came early waits in the backlog).
    ready.set(true);
    start_http_listeners(
        &mut tasks, http, http_state, &settings, &limiter, &source, &stop_rx, rlqs,
    );
    let health_follower = tokio::spawn(follow_readiness(
        health_reporter.clone(),
        limiter.clone(),
        source.check(),
        serving,
    ));

    let failed = until_stop(&mut tasks).await;
    report_not_serving(&ready, &health_follower, &health_reporter).await;
    let result = shut_down(stop_tx, reload_task, settings.shutdown, failed, tasks).await;
    // Leased tokens this replica did not spend go back to the shared store, so the other
    // replicas can spend them (docs/backends.md, token leases).
    limiter.store().return_leases(LEASE_RETURN_TIMEOUT).await;
    // What the counters gained since the last flush is sent, not lost with the process (off
    // the runtime's threads: it may wait on the network).
    let _ = tokio::task::spawn_blocking(crate::statsd::stop).await;
    result
}

/// How long a shutdown waits for the store to take unspent leased tokens back.
const LEASE_RETURN_TIMEOUT: Duration = Duration::from_secs(1);

/// The listener tasks of `serve`: each ends with its server's error, if it failed.
type Tasks = JoinSet<anyhow::Result<()>>;

/// How a listener task ended: `Err` when it panicked.
type TaskResult = Result<anyhow::Result<()>, tokio::task::JoinError>;

/// Installs the Prometheus recorder (and starts its upkeep), the `metrics.envoyproxy_names`
/// choice and the statsd sink (`metrics.statsd`); returns the recorder's handle.
fn install_metrics(settings: &Settings) -> anyhow::Result<PrometheusHandle> {
    let prometheus = crate::server::metrics::install()?;
    tokio::spawn(crate::server::metrics::run_upkeep(
        prometheus.clone(),
        Duration::from_secs(5),
    ));
    crate::telemetry::set_envoyproxy_names(settings.metrics.envoyproxy_names);
    crate::statsd::start(&settings.metrics.statsd)
        .map_err(|e| anyhow::anyhow!("cannot start the statsd sink (metrics.statsd): {e}"))?;
    Ok(prometheus)
}

/// The listeners served over HTTP: the main one, and the metrics and admin ones when
/// configured; `tls` for those that serve TLS.
struct HttpListeners {
    http: TcpListener,
    metrics: Option<TcpListener>,
    admin: Option<TcpListener>,
    tls: Arc<Tls>,
}

/// Binds every configured listener (gRPC, HTTP, metrics, admin, in that order) and logs where
/// it listens; returns the gRPC listener (with its socket file, on a Unix socket) and the others.
///
/// Errors: a listener that cannot bind.
async fn bind_listeners(
    settings: &Settings,
    tls: &Arc<Tls>,
) -> anyhow::Result<(grpc::GrpcListener, Option<uds::SocketFile>, HttpListeners)> {
    let (grpc, socket_file) = grpc::bind(&settings.grpc_addr, settings.grpc.unix_socket_mode).await?;
    let http = TcpListener::bind(settings.http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {}", settings.http_addr))?;
    let metrics = match settings.metrics.addr {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen for metrics on {addr} (metrics.addr)"))?,
        ),
        None => None,
    };
    let admin = match settings.admin.enabled {
        true => Some(
            TcpListener::bind(settings.admin.addr)
                .await
                .with_context(|| format!("cannot listen for the admin API on {}", settings.admin.addr))?,
        ),
        false => None,
    };
    tracing::info!(
        grpc = %settings.grpc_addr,
        http = %settings.http_addr,
        admin = %admin.as_ref().map_or("disabled".to_owned(), |_| settings.admin.addr.to_string()),
        admin_token = settings.admin.token.is_some(),
        metrics = %settings.metrics.addr.map_or("on the HTTP port".to_owned(), |a| format!("{a}{} and on the HTTP port", settings.metrics.path)),
        tls = %tls.summary(),
        "listening"
    );
    let listeners = HttpListeners {
        http,
        metrics,
        admin,
        tls: tls.clone(),
    };
    Ok((grpc, socket_file, listeners))
}

/// Completes once `stop` says so (or its sender is gone).
fn stopped(stop: &tokio::sync::watch::Receiver<bool>) -> impl Future<Output = ()> + Send + 'static {
    let mut stop = stop.clone();
    async move {
        let _ = stop.wait_for(|s| *s).await;
    }
}

/// The state of the HTTP and metrics listeners: readiness, the backend's, and the metrics
/// refreshed at each scrape.
fn http_state(
    settings: &Settings,
    limiter: &Arc<Limiter<AnyStore>>,
    memory: &MemoryStore,
    ready: &Readiness,
    prometheus: PrometheusHandle,
) -> HttpState {
    let gauges = memory.clone();
    let buckets = ::metrics::gauge!(crate::telemetry::MEMORY_BUCKETS);
    let evicted = ::metrics::counter!(crate::telemetry::MEMORY_EVICTED_NOT_FULL);
    // process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...: the
    // standard process metrics, read at each scrape.
    let process = metrics_process::Collector::default();
    process.describe();
    HttpState::new(
        ready.clone(),
        {
            let limiter = limiter.clone();
            Arc::new(move || {
                let limiter = limiter.clone();
                Box::pin(async move { limiter.store().ready().await })
            })
        },
        Some(prometheus),
        Arc::new(move || {
            process.collect();
            buckets.set(gauges.len() as f64);
            evicted.absolute(gauges.stats().evicted_not_full.load(Ordering::Relaxed));
        }),
        backend_names(settings),
    )
}

/// Starts the HTTP listener and, when configured, the metrics and admin listeners, each
/// serving until `stop` says so.
#[allow(clippy::too_many_arguments)]
fn start_http_listeners(
    tasks: &mut Tasks,
    listeners: HttpListeners,
    http_state: HttpState,
    settings: &Settings,
    limiter: &Arc<Limiter<AnyStore>>,
    source: &RulesSource,
    stop: &tokio::sync::watch::Receiver<bool>,
    rlqs: Option<Arc<crate::rlqs::Hub<AnyStore>>>,
) {
    let (app, tls) = (router(http_state.clone()), &listeners.tls);
    let http_tls = tls.acceptor(Listener::Http);
    spawn_axum(
        tasks,
        listeners.http,
        http_tls,
        app,
        stopped(stop),
        "HTTP server failed",
    );
    if let Some(listener) = listeners.metrics {
        let app = crate::server::http::metrics_router(http_state, &settings.metrics.path);
        spawn_axum(tasks, listener, None, app, stopped(stop), "metrics server failed");
    }
    if let Some(listener) = listeners.admin {
        let (app, admin_tls) = (
            admin_router(settings, limiter, source, tls, rlqs),
            tls.acceptor(Listener::Admin),
        );
        spawn_axum(tasks, listener, admin_tls, app, stopped(stop), "admin server failed");
    }
}

/// Serves `app` on `listener` (over TLS with `tls`) until `stop`, as one of `tasks`; a failure
/// is `failure`.
fn spawn_axum(
    tasks: &mut Tasks,
    listener: TcpListener,
    tls: Option<Acceptor>,
    app: axum::Router,
    stop: impl Future<Output = ()> + Send + 'static,
    failure: &'static str,
) {
    tasks.spawn(async move {
        let served = match tls {
            Some(tls) => {
                let listener = crate::server::tls::accept::TlsIncoming::new(listener, tls);
                axum::serve(listener, app).with_graceful_shutdown(stop).await
            }
            None => axum::serve(listener, app).with_graceful_shutdown(stop).await,
        };
        served.context(failure)
    });
}

/// The admin API, with `/config`: on the admin listener, since rule values can be API keys,
/// and it names the backends.
fn admin_router(
    settings: &Settings,
    limiter: &Arc<Limiter<AnyStore>>,
    source: &RulesSource,
    tls: &Arc<Tls>,
    rlqs: Option<Arc<crate::rlqs::Hub<AnyStore>>>,
) -> axum::Router {
    let rlqs = rlqs.map(crate::admin::rlqs_probe);
    let config_rlqs = rlqs.clone();
    let config_view: crate::admin::ConfigView = {
        let config_limiter = limiter.clone();
        let config_settings = settings.clone();
        let config_source = source.clone();
        let config_tls = tls.clone();
        Arc::new(move || {
            let rules = config_limiter.rules();
            let mut config = config_json(&rules, &config_settings);
            config_source.add_to_config(&mut config, rules.generation);
            config["tls"] = config_tls.status_json();
            // Run on a blocking thread (see admin's `config`): the hub's locks are awaited here.
            config["rlqs"] = match &config_rlqs {
                Some(probe) => tokio::runtime::Handle::current().block_on(probe()),
                None => serde_json::json!({"enabled": false}),
            };
            config
        })
    };
    let pages = settings.admin.console.enabled.then(|| {
        let options = crate::console::ConsoleOptions {
            config: config_view.clone(),
            show_values: settings.admin.console.show_values,
            token_required: settings.admin.token.is_some(),
        };
        crate::console::pages(limiter.clone(), options)
    });
    let options = crate::admin::AdminOptions {
        token: settings.admin.token.clone(),
        allowed_hosts: settings.admin.allowed_hosts.clone(),
        config: Some(config_view),
        rlqs,
        secure_cookies: tls.acceptor(Listener::Admin).is_some(),
        pages,
    };
    crate::admin::router(limiter.clone(), options)
}

/// Sets gRPC health as the rules and the backend are now, and starts the gRPC server on
/// `listener`: it stops accepting when `stop` says so, and sends its GOAWAY shortly before the
/// shutdown deadline. Returns the health reporter and whether it says `SERVING`.
#[allow(clippy::too_many_arguments)]
async fn start_grpc(
    tasks: &mut Tasks,
    listener: grpc::GrpcListener,
    limiter: &Arc<Limiter<AnyStore>>,
    settings: &Settings,
    stop: &tokio::sync::watch::Receiver<bool>,
    source: &RulesSource,
    tls: Option<Acceptor>,
    rlqs: Option<Arc<crate::rlqs::Hub<AnyStore>>>,
) -> (HealthReporter, bool) {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    // Before the first connection is accepted: a probe that came early must not hear SERVING
    // while no rules have arrived from an xDS server yet (the reporter starts with "" serving).
    let serving = serving_now(limiter, &source.check()).await;
    set_health(&health_reporter, serving).await;
    // At the stop the gRPC listener closes, but the connections already open keep serving
    // new streams: Envoy keeps its connections and sends on them until told otherwise, so
    // a GOAWAY at the stop refused (or sent elsewhere, to a listener now closed) every
    // request of the last moments. Told to go away only shortly before the deadline,
    // Envoy moves on while the streams it already sent are still answered.
    let close = stopped(stop);
    // At the stop the RLQS streams end, so their Envoys reconnect to another replica (the open
    // connections keep serving RLS until their GOAWAY, but refuse new streams).
    let rlqs = rlqs.map(|hub| crate::rlqs::QuotaService::new(hub.start(stopped(stop))));
    let stop = stopped(stop);
    let timeout = settings.shutdown.timeout_seconds.duration();
    let go_away = async move {
        stop.await;
        tokio::time::sleep(timeout.saturating_sub(grpc::go_away_margin(timeout))).await;
    };
    let service = RateLimitGrpc::new(limiter.clone()).with_gate(source.gate());
    tasks.spawn(grpc::serve_draining_tls(
        listener,
        tls,
        service,
        rlqs,
        health,
        settings.grpc,
        close,
        go_away,
    ));
    (health_reporter, serving)
}

/// Waits for SIGINT or SIGTERM, or for a listener task to end by itself, which is returned:
/// that is an error (or a bug), and shuts the rest down.
async fn until_stop(tasks: &mut Tasks) -> Option<TaskResult> {
    tokio::select! {
        Some(done) = tasks.join_next() => Some(done),
        _ = shutdown_signal() => None,
    }
}

/// Reports not ready from now on: `/readyz` 503 and gRPC health `NOT_SERVING`, no longer
/// following the backend.
async fn report_not_serving(ready: &Readiness, health_follower: &JoinHandle<()>, health_reporter: &HealthReporter) {
    ready.set(false);
    health_follower.abort();
    health_reporter
        .set_not_serving::<RateLimitServer<RateLimitGrpc<AnyStore>>>()
        .await;
    health_reporter.set_service_status("", ServingStatus::NotServing).await;
}

/// Drains (unless a listener `failed`), closes the listeners and waits for the requests in
/// flight, as [`serve`] says; returns the failure of the listener that stopped, if one did.
async fn shut_down(
    stop_tx: tokio::sync::watch::Sender<bool>,
    reload_task: JoinHandle<()>,
    shutdown: ShutdownSettings,
    failed: Option<TaskResult>,
    mut tasks: Tasks,
) -> anyhow::Result<()> {
    if failed.is_none() && !drain(shutdown).await {
        reload_task.abort();
        tasks.abort_all();
        return Ok(());
    }
    tracing::info!(
        timeout_seconds = shutdown.timeout_seconds.0,
        "closing the listeners; finishing requests in flight"
    );
    reload_task.abort();
    let _ = stop_tx.send(true);
    finish_in_flight(tasks, failed, shutdown.timeout_seconds.duration()).await
}

/// Waits `shutdown.drain_seconds`, still answering, while load balancers move away; false when
/// a second signal cut that short (exit now).
async fn drain(shutdown: ShutdownSettings) -> bool {
    if shutdown.drain_seconds.0 == 0 {
        return true;
    }
    tracing::info!(
        drain_seconds = shutdown.drain_seconds.0,
        "shutting down: not ready; still answering while load balancers move away"
    );
    tokio::select! {
        _ = tokio::time::sleep(shutdown.drain_seconds.duration()) => true,
        _ = shutdown_signal() => {
            tracing::warn!("second signal: exiting now, without waiting for requests in flight");
            false
        }
    }
}

/// Gives the listener tasks until `deadline` (or another signal) to finish; then the result of
/// `failed`, the task that ended by itself, if one did.
async fn finish_in_flight(mut tasks: Tasks, failed: Option<TaskResult>, deadline: Duration) -> anyhow::Result<()> {
    let mut result = match failed {
        Some(done) => done.context("a listener task panicked")?,
        None => Ok(()),
    };
    let finish = async {
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done.context("a listener task panicked").and_then(|r| r) {
                tracing::error!("{e:#}");
            }
        }
    };
    tokio::select! {
        _ = finish => tracing::info!("all requests in flight answered; bye"),
        _ = tokio::time::sleep(deadline) => {
            tracing::warn!(?deadline, "requests still in flight at the shutdown deadline; exiting anyway");
            tasks.abort_all();
        }
        _ = shutdown_signal() => {
            tracing::warn!("another signal: exiting without waiting for requests in flight");
            tasks.abort_all();
        }
    }
    if let Err(e) = &result {
        tracing::error!("{e:#}");
        result = Err(anyhow::anyhow!("a listener stopped unexpectedly"));
    }
    result
}

/// The runtime for `flavor` (`tollgate serve`'s `runtime` setting; the load generator's no-op
/// server takes the same): see [`RuntimeFlavor`].
///
/// Errors: the runtime cannot be built (the operating system refused a thread or an epoll
/// instance).
pub fn runtime(flavor: RuntimeFlavor) -> std::io::Result<tokio::runtime::Runtime> {
    let one_cpu = std::thread::available_parallelism().is_ok_and(|n| n.get() == 1);
    let current = match flavor {
        RuntimeFlavor::Auto => one_cpu,
        RuntimeFlavor::CurrentThread => true,
        RuntimeFlavor::MultiThread => false,
    };
    if current {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Runtime::new()
    }
}

/// How often gRPC health is brought in line with the backend's readiness.
const HEALTH_EVERY: Duration = Duration::from_secs(1);

/// Keeps gRPC health (`""` and the `RateLimitService`) saying what `/readyz` says about the
/// rules and the backend: `NOT_SERVING` while the rules are not there (`rules`) or the backend
/// cannot decide (no fallback that can), `SERVING` again once both are. Checked every
/// [`HEALTH_EVERY`] from `serving`, what it says now; runs until aborted at shutdown.
async fn follow_readiness(
    reporter: HealthReporter,
    limiter: Arc<Limiter<AnyStore>>,
    rules: RulesCheck,
    mut serving: bool,
) {
    let mut tick = tokio::time::interval(HEALTH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = serving_now(&limiter, &rules).await;
        if now != serving {
            serving = now;
            set_health(&reporter, now).await;
        }
    }
}

/// Whether gRPC health should say `SERVING`: the rules are there and the backend can decide.
async fn serving_now(limiter: &Limiter<AnyStore>, rules: &RulesCheck) -> bool {
    rules().is_none() && limiter.store().ready().await.is_ready()
}

/// Sets gRPC health, `""` and the `RateLimitService`, to `SERVING` or `NOT_SERVING`.
async fn set_health(reporter: &HealthReporter, serving: bool) {
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    reporter
        .set_service_status(
            <RateLimitServer<RateLimitGrpc<AnyStore>> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
    reporter.set_service_status("", status).await;
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
