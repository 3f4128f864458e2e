//! A TCP listener whose connections come out once their TLS handshake is done: a stream for
//! tonic's `serve_with_incoming` and an `axum::serve::Listener`. Each handshake runs in a task of
//! its own, under [`HANDSHAKE_TIMEOUT`], so a slow or silent client holds up no other; one that
//! fails is counted and logged (at most one warning per [`WARN_EVERY`] per listener, each at
//! debug), and the listener goes on accepting. A connection is worth a TLS session only once
//! its first byte arrives: one closed before (a TCP probe: a load balancer's, the kubelet's
//! `tcpSocket`) is no failed handshake, logged at debug only. At most [`MAX_HANDSHAKES`] run at
//! once; past that, a connection that has spoken waits (within its 10 s) for one to finish, so
//! a flood of clients that start a handshake and stall costs bounded memory and CPU.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How long a client has to complete its handshake once connected.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// At most one warning about failed handshakes per listener this often (each is logged at
/// debug, and counted).
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(10);

/// Handshaken connections waiting for the server to take them.
const QUEUE: usize = 64;

/// Handshakes in progress at once, per listener (far more than Envoy's connections, which
/// are few and long-lived, ever need).
pub(crate) const MAX_HANDSHAKES: usize = 1024;

/// A listener's TLS acceptor and its name (`grpc`, `http`, `admin`), for metrics and logs.
#[derive(Clone)]
pub(crate) struct Acceptor {
    /// The acceptor, over the listener's `ServerConfig`.
    pub(crate) tls: TlsAcceptor,
    /// `grpc`, `http` or `admin`.
    pub(crate) listener: &'static str,
}

/// The connections of a TCP listener after their handshake. Dropping it stops accepting and
/// closes the listening socket; connections already handed out are not touched.
pub(crate) struct TlsIncoming {
    ready: mpsc::Receiver<(TlsConn, SocketAddr)>,
    accepting: JoinHandle<()>,
    local_addr: std::io::Result<SocketAddr>,
}

impl TlsIncoming {
    /// Starts accepting on `listener` with `acceptor` (on the current runtime).
    pub(crate) fn new(listener: TcpListener, acceptor: Acceptor) -> TlsIncoming {
        let local_addr = listener.local_addr();
        let (tx, ready) = mpsc::channel(QUEUE);
        let accepting = tokio::spawn(accept_loop(listener, acceptor, tx));
        TlsIncoming {
            ready,
            accepting,
            local_addr,
        }
    }
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// Accepts TCP connections and starts a handshake for each, until the receiver is gone.
async fn accept_loop(listener: TcpListener, acceptor: Acceptor, ready: mpsc::Sender<(TlsConn, SocketAddr)>) {
    let failures = Arc::new(Failures::default());
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // A connection reset before it was accepted is the client's; anything else
                // (out of file descriptors) is waited out briefly instead of spinning.
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) {
                    tracing::warn!(listener = acceptor.listener, error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        if ready.is_closed() {
            return;
        }
        // As on the plain gRPC listener: no Nagle delay on a response written in pieces.
        let _ = tcp.set_nodelay(true);
        let (acceptor, ready, failures, slots) = (acceptor.clone(), ready.clone(), failures.clone(), slots.clone());
        tokio::spawn(async move {
            let handshake = async {
                // Nothing sent before the close (or a reset): a probe of the port. The peek
                // takes nothing from what the acceptor reads.
                if matches!(tcp.peek(&mut [0u8; 1]).await, Ok(0) | Err(_)) {
                    return None;
                }
                let slot = slots.acquire_owned().await.ok();
                let accepted = acceptor.tls.accept(tcp).await;
                drop(slot);
                Some(accepted)
            };
            let outcome = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await;
            match outcome {
                Ok(Some(Ok(tls))) => {
                    let _ = ready.send((TlsConn(tls), peer)).await;
                }
                Ok(Some(Err(e))) => failures.record(acceptor.listener, peer, &e.to_string()),
                Ok(None) => {
                    tracing::debug!(listener = acceptor.listener, %peer, "connection closed before its TLS handshake")
                }
                Err(_) => failures.record(acceptor.listener, peer, "no handshake within 10 s"),
            }
        });
    }
}

/// Failed handshakes of one listener, for logging them at a bounded rate.
#[derive(Default)]
struct Failures {
    last_warned: Mutex<Option<Instant>>,
    unlogged: AtomicU64,
}

impl Failures {
    fn record(&self, listener: &'static str, peer: SocketAddr, error: &str) {
        crate::telemetry::tls_handshake_failed(listener);
        tracing::debug!(listener, %peer, error, "TLS handshake failed");
        let mut last = self.last_warned.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return;
        }
        *last = Some(Instant::now());
        let also = self.unlogged.swap(0, Ordering::Relaxed);
        tracing::warn!(
            listener,
            %peer,
            error,
            also_failed = also,
            "TLS handshake failed (the connection is closed; more failures within 10 s are logged at debug)"
        );
    }
}

impl futures_util::Stream for TlsIncoming {
    type Item = std::io::Result<TlsConn>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut()
            .ready
            .poll_recv(cx)
            .map(|conn| conn.map(|(conn, _)| Ok(conn)))
    }
}

impl axum::serve::Listener for TlsIncoming {
    type Io = TlsConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TlsConn, SocketAddr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop ended (it never does while this lives): accept nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.local_addr
            .as_ref()
            .map(|a| *a)
            .map_err(|e| std::io::Error::new(e.kind(), e.to_string()))
    }
}

/// A server-side TLS connection over TCP.
pub(crate) struct TlsConn(TlsStream<TcpStream>);

impl AsyncRead for TlsConn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.connect_info()
    }
}
