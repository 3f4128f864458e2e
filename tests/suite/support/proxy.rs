//! A TCP proxy on loopback between tollgate and a private backend, for the network fault tests
//! (`tests/suite/network_faults.rs`): it forwards bytes both ways and, on command, holds every chunk
//! back for a while (a backend slower than the timeout, without pausing it) or resets every
//! open connection with a TCP RST (a crashed peer, a restarted load balancer) while requests
//! are in flight. It runs on its own runtime thread, so it keeps forwarding whatever the test's
//! runtime is doing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the connections share: the delay per chunk and the reset generation.
struct State {
    upstream: SocketAddr,
    delay_ms: AtomicU64,
    accepted: AtomicU64,
    resets: watch::Sender<u64>,
}

/// A running proxy; stopped (every connection reset) when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`.
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("a runtime for the proxy");
        // Bound here and handed over, so this works from inside a test's runtime too (where
        // blocking on another runtime is not allowed).
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        std_listener.set_nonblocking(true).expect("a non-blocking listener");
        let addr = std_listener.local_addr().expect("the proxy's address");
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(std_listener).expect("the proxy's listener")
        };
        let (resets, _) = watch::channel(0);
        let state = Arc::new(State {
            upstream,
            delay_ms: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            resets,
        });
        let shared = state.clone();
        runtime.spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(forward(client, shared.clone()));
            }
        });
        FaultProxy {
            addr,
            state,
            runtime: Some(runtime),
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds every chunk, in both directions, back for `delay` before forwarding it (zero:
    /// forward at once), as a network path that long each way would: a round trip costs twice
    /// `delay`. Applies to open connections too, from the next chunk read.
    pub fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.state.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Resets every connection open now, on both sides (RST, not FIN), whatever is in flight;
    /// new connections are forwarded as before.
    pub fn reset_all(&self) {
        self.state.resets.send_modify(|generation| *generation += 1);
    }

    /// Connections accepted so far: a client that reconnected after [`Self::reset_all`] shows
    /// here.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.reset_all();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// One client connection: forwarded until either side closes or a reset is ordered.
async fn forward(client: TcpStream, state: Arc<State>) {
    let mut reset = state.resets.subscribe();
    // Zero linger: closing the sockets sends an RST, which is what a reset must look like to
    // both peers (an error on their next read or write, not an orderly end of stream).
    let _ = client.set_zero_linger();
    let Ok(server) = TcpStream::connect(state.upstream).await else {
        return;
    };
    let _ = server.set_zero_linger();
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = async {
            tokio::join!(
                pump(client_read, server_write, &state),
                pump(server_read, client_write, &state)
            )
        } => {}
        _ = reset.changed() => {}
    }
    // Both halves of both sockets are dropped here: closed with an RST.
}

/// Copies `from` to `to`, each chunk `delay` after it was read (the delay set when it was
/// read): a delay line, so chunks in flight together arrive together, as over a long network
/// path, rather than one delay after another. At end of stream, half-closes `to` as the peer
/// did.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, state: &State) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let due = tokio::time::Instant::now() + Duration::from_millis(state.delay_ms.load(Ordering::SeqCst));
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
