//! Wiring for `tollgate serve`: load settings and rules, build the store and limiter, and run
//! the gRPC and HTTP listeners until a shutdown signal.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use crate::clock::SystemClock;
use crate::config::load_rules;
use crate::http::{router, Readiness};
use crate::limiter::{Limiter, LimiterOptions};
use crate::service::RateLimitGrpc;
use crate::settings::{Backend, Settings};
use crate::store::{MemoryStore, Store};
use crate::wire::RateLimitServer;

impl LimiterOptions {
    /// The limiter options in `settings`.
    pub fn from_settings(settings: &Settings) -> LimiterOptions {
        LimiterOptions {
            limits: settings.limits,
            headers: settings.headers,
            shadow_mode: settings.shadow_mode,
            overrides: settings.overrides,
        }
    }
}

/// Runs tollgate with `settings` until SIGINT or SIGTERM.
///
/// Errors: invalid rules (every problem, with file, rule and reason), or a listener that
/// cannot bind.
pub async fn serve(settings: Settings) -> anyhow::Result<()> {
    let rules = load_rules(&settings.rules).map_err(|e| anyhow::anyhow!("invalid rules:\n{e}"))?;
    if rules.is_empty() {
        tracing::warn!(
            path = %settings.rules.display(),
            "no rules files found (*.yaml, *.yml): nothing will be limited"
        );
    }
    tracing::info!(
        path = %settings.rules.display(),
        domains = rules.domains.len(),
        files = rules.files.len(),
        "rules loaded"
    );
    let Backend::Memory = settings.backend;
    let store = MemoryStore::new(
        settings.memory.shards,
        settings.memory.max_buckets,
        Arc::new(SystemClock),
    );
    spawn_sweeper(
        store.clone(),
        Duration::from_secs(settings.memory.sweep_interval_seconds.max(1)),
    );
    let limiter = Arc::new(Limiter::new(rules, store, LimiterOptions::from_settings(&settings)));

    let grpc = TcpListener::bind(settings.grpc_addr)
        .await
        .with_context(|| format!("cannot listen for gRPC on {}", settings.grpc_addr))?;
    let http = TcpListener::bind(settings.http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {}", settings.http_addr))?;
    tracing::info!(grpc = %settings.grpc_addr, http = %settings.http_addr, "listening");

    let ready = Readiness::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http_task = {
        let mut stop = stop_rx.clone();
        let app = router(ready.clone());
        tokio::spawn(async move {
            axum::serve(http, app)
                .with_graceful_shutdown(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        })
    };
    ready.set(true);
    let mut stop = stop_rx;
    let grpc_result = serve_grpc(grpc, limiter, async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    tokio::pin!(grpc_result);
    tokio::select! {
        r = &mut grpc_result => r?,
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            ready.set(false);
            let _ = stop_tx.send(true);
            grpc_result.await?;
        }
    }
    let _ = http_task.await;
    Ok(())
}

/// Serves tollgate's `RateLimitService` and `grpc.health.v1` on `listener` until `shutdown`
/// completes.
pub async fn serve_grpc<S: Store>(
    listener: TcpListener,
    limiter: Arc<Limiter<S>>,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    serve_rate_limit_service(listener, RateLimitGrpc::new(limiter), shutdown).await
}

/// Serves any `RateLimitService` implementation, and `grpc.health.v1` reporting it serving, on
/// `listener` until `shutdown` completes. This is the whole gRPC stack; the load generator's
/// no-op server uses it too, so measurements compare decision paths and nothing else.
pub async fn serve_rate_limit_service<T: RateLimitService>(
    listener: TcpListener,
    service: T,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RateLimitServer<T>>().await;
    // TCP_NODELAY must be set on the accepted sockets here: tonic ignores `Server::tcp_nodelay`
    // for a caller-supplied incoming stream. With Nagle on, a response written in two pieces
    // waits for Envoy's delayed ACK (~40 ms), past Envoy's default 20 ms filter timeout.
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServer::new(service))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), shutdown)
        .await
        .context("gRPC server failed")
}

fn spawn_sweeper(store: MemoryStore, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let dropped = store.sweep();
            tracing::trace!(dropped, held = store.len(), "swept full buckets");
        }
    });
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
