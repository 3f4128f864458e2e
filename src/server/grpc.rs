//! The gRPC server: tollgate's `RateLimitService` and `grpc.health.v1` on one listener, with the
//! `grpc` settings' limits, and the drain `serve` needs (stop accepting at the stop, keep serving
//! the open connections, GOAWAY shortly before the deadline).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use tokio::net::{TcpListener, UnixListener};
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::health_server::{Health, HealthServer};

use crate::decision::limiter::Limiter;
use crate::server::service::RateLimitGrpc;
use crate::server::settings::GrpcSettings;
use crate::server::tls::accept::{Acceptor, TlsIncoming};
use crate::server::wire::RateLimitServer;
use crate::store::Store;

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
    serve_rate_limit_service_with_health(listener, service, health, shutdown).await
}

/// [`serve_rate_limit_service`] with a health service the caller keeps the reporter of (to
/// report `NOT_SERVING` while shutting down), and the default [`GrpcSettings`].
pub async fn serve_rate_limit_service_with_health<T: RateLimitService>(
    listener: TcpListener,
    service: T,
    health: HealthServer<impl Health>,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    serve_rate_limit_service_with_limits(listener, service, health, GrpcSettings::default(), shutdown).await
}

/// [`serve_rate_limit_service_with_health`] with the gRPC server's limits of `limits` (the
/// `grpc` settings: message size, streams per connection, keep-alive).
pub async fn serve_rate_limit_service_with_limits<T: RateLimitService>(
    listener: TcpListener,
    service: T,
    health: HealthServer<impl Health>,
    limits: GrpcSettings,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    // The listener closes with the GOAWAY, at `shutdown`.
    serve_rate_limit_service_draining(listener, service, health, limits, std::future::pending(), shutdown).await
}

/// How long before the shutdown deadline open gRPC connections are sent their GOAWAY: enough
/// for the streams sent meanwhile to be answered (a decision takes milliseconds), at most half
/// the timeout.
pub(crate) fn go_away_margin(timeout: Duration) -> Duration {
    (timeout / 2).min(Duration::from_secs(1))
}

/// The listener, until `close` completes: then it is dropped (new connections are refused) and
/// the stream stays pending, without ending, so the connections already accepted keep being
/// served (an ended stream makes tonic tell them to go away at once). `S` is the listener's
/// stream of connections: TCP ([`TcpIncoming`]) or TLS ([`TlsIncoming`]).
struct ClosableIncoming<S, F> {
    incoming: Option<S>,
    close: std::pin::Pin<Box<F>>,
}

impl<S, F, IO> futures_util::Stream for ClosableIncoming<S, F>
where
    S: futures_util::Stream<Item = std::io::Result<IO>> + Unpin,
    F: Future<Output = ()>,
{
    type Item = std::io::Result<IO>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = self.get_mut();
        // Polled only until it completes (`incoming` is then gone).
        if this.incoming.is_some() && this.close.as_mut().poll(cx).is_ready() {
            this.incoming = None;
            tracing::info!("gRPC listener closed; open connections still served until told to go away");
        }
        match &mut this.incoming {
            Some(incoming) => std::pin::Pin::new(incoming).poll_next(cx),
            None => std::task::Poll::Pending,
        }
    }
}

/// [`serve_rate_limit_service_with_limits`] that stops accepting connections at `close` but
/// keeps serving every stream of the open ones until `go_away`, when each is sent a graceful
/// GOAWAY (HTTP/2's two-step one: streams the client sent before it saw it are still served);
/// returns once every connection has closed.
pub async fn serve_rate_limit_service_draining<T: RateLimitService>(
    listener: TcpListener,
    service: T,
    health: HealthServer<impl Health>,
    limits: GrpcSettings,
    close: impl Future<Output = ()> + Send + 'static,
    go_away: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    serve_draining_tls(
        GrpcListener::Tcp(listener),
        None,
        service,
        None::<NoQuotaService>,
        health,
        limits,
        close,
        go_away,
    )
    .await
}

/// The RLQS service's type where none is served.
type NoQuotaService = crate::rlqs::QuotaService<crate::store::MemoryStore>;

/// The gRPC listener `serve` binds: TCP, or a Unix domain socket (`grpc_addr: unix:<path>`).
pub(crate) enum GrpcListener {
    /// A TCP listener, plain or TLS.
    Tcp(TcpListener),
    /// A Unix socket listener, plain text only (settings refuse `tls.grpc` with it).
    Unix(UnixListener),
}

/// Binds the gRPC listener at `addr`; a Unix socket's file gets the permission bits `mode` and
/// comes back with it, to be removed when dropped.
///
/// Errors: the address cannot be bound (see [`crate::server::uds::bind`] for a Unix socket).
pub(crate) async fn bind(
    addr: &crate::server::uds::GrpcAddr,
    mode: crate::server::uds::SocketMode,
) -> anyhow::Result<(GrpcListener, Option<crate::server::uds::SocketFile>)> {
    use crate::server::uds::GrpcAddr;
    match addr {
        GrpcAddr::Tcp(tcp) => {
            let listener = TcpListener::bind(tcp)
                .await
                .with_context(|| format!("cannot listen for gRPC on {tcp}"))?;
            Ok((GrpcListener::Tcp(listener), None))
        }
        GrpcAddr::Unix(path) => {
            let (listener, file) = crate::server::uds::bind(path, mode)?;
            Ok((GrpcListener::Unix(listener), Some(file)))
        }
    }
}

/// [`serve_rate_limit_service_draining`] on `listener`, over TLS with `tls` when given
/// (`tls.grpc`, TCP only): each connection is served once its handshake is done, and a failed
/// handshake closes only its own connection. With `rlqs`, Envoy's Rate Limit Quota Service is
/// served beside it, with the same message size limit.
///
/// Errors: the server failed, or `tls` was given with a Unix socket.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve_draining_tls<T: RateLimitService, Q: RateLimitQuotaService>(
    listener: GrpcListener,
    tls: Option<Acceptor>,
    service: T,
    rlqs: Option<Q>,
    health: HealthServer<impl Health>,
    limits: GrpcSettings,
    close: impl Future<Output = ()> + Send + 'static,
    go_away: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let keepalive = (limits.keepalive_interval_seconds.0 > 0).then(|| limits.keepalive_interval_seconds.duration());
    // TCP_NODELAY must be set on the accepted sockets here: tonic ignores `Server::tcp_nodelay`
    // for a caller-supplied incoming stream. With Nagle on, a response written in two pieces
    // waits for Envoy's delayed ACK (~40 ms), past Envoy's default 20 ms filter timeout.
    // (`TlsIncoming` sets it on the sockets it accepts.)
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .http2_keepalive_interval(keepalive)
        .http2_keepalive_timeout(Some(Duration::from_secs(limits.keepalive_timeout_seconds.0.max(1))))
        .add_service(health)
        .add_service(RateLimitServer::new(service).max_message_bytes(limits.max_message_bytes))
        .add_optional_service(rlqs.map(|q| {
            RateLimitQuotaServiceServer::new(q)
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(limits.max_message_bytes)
        }));
    let close = Box::pin(close);
    let served = match (listener, tls) {
        (GrpcListener::Tcp(listener), None) => {
            let incoming = Some(TcpIncoming::from(listener).with_nodelay(Some(true)));
            server
                .serve_with_incoming_shutdown(ClosableIncoming { incoming, close }, go_away)
                .await
        }
        (GrpcListener::Tcp(listener), Some(acceptor)) => {
            let incoming = Some(TlsIncoming::new(listener, acceptor));
            server
                .serve_with_incoming_shutdown(ClosableIncoming { incoming, close }, go_away)
                .await
        }
        (GrpcListener::Unix(listener), None) => {
            let incoming = Some(crate::server::uds::UnixIncoming(listener));
            server
                .serve_with_incoming_shutdown(ClosableIncoming { incoming, close }, go_away)
                .await
        }
        (GrpcListener::Unix(_), Some(_)) => anyhow::bail!("TLS is not served on a Unix socket (tls.grpc)"),
    };
    served.context("gRPC server failed")
}
