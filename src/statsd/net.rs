//! The sink under cadence's client: lines batched into UDP datagrams or written to one TCP
//! connection. cadence ships UDP sinks that resolve the server's name once, at start, and no
//! TCP sink; this one looks the name up at each connection attempt (a compose service or a
//! Kubernetes Service may not resolve yet when tollgate starts) and speaks both protocols, as
//! their stats library does. It runs only on the statsd threads, never on a request's.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cadence::MetricSink;

use super::settings::StatsdProtocol;

/// The largest UDP datagram sent: fits a 1500-byte MTU with room for the headers, so no
/// datagram is fragmented (their library's size too).
const UDP_DATAGRAM_BYTES: usize = 1432;
/// The most bytes gathered before a write on a TCP connection.
const TCP_BUFFER_BYTES: usize = 64 * 1024;
/// The pause after a failed connection attempt, during which lines are dropped.
const RETRY: Duration = Duration::from_secs(3);
/// How long a TCP connection attempt or write may take.
const IO_TIMEOUT: Duration = Duration::from_millis(1500);
/// At most one warning about an unreachable server per this long.
const WARN_EVERY: Duration = Duration::from_secs(60);

enum Conn {
    Udp(UdpSocket),
    Tcp(TcpStream),
}

struct State {
    conn: Option<Conn>,
    buf: Vec<u8>,
    /// No connection attempt before this instant (after a failed one).
    retry_at: Option<Instant>,
    last_warned: Option<Instant>,
}

/// A statsd server at `addr` (`host:port`) over `protocol`; cheap to clone (shared).
#[derive(Clone)]
pub(crate) struct NetSink(Arc<Inner>);

struct Inner {
    addr: String,
    protocol: StatsdProtocol,
    state: Mutex<State>,
    /// Lines dropped since the last warning: an atomic, not part of `state`, because the
    /// decision path counts here when the queue is full, and must never wait for the lock a
    /// flush holds while it connects or writes to a slow server.
    dropped: AtomicU64,
}

impl NetSink {
    pub(crate) fn new(addr: &str, protocol: StatsdProtocol) -> NetSink {
        NetSink(Arc::new(Inner {
            addr: addr.to_owned(),
            protocol,
            state: Mutex::new(State {
                conn: None,
                buf: Vec::new(),
                retry_at: None,
                last_warned: None,
            }),
            dropped: AtomicU64::new(0),
        }))
    }

    /// Counts `lines` lost (a full queue, a failed write) for the next warning.
    pub(crate) fn dropped(&self, lines: u64) {
        self.0.dropped.fetch_add(lines, Ordering::Relaxed);
    }

    fn limit(&self) -> usize {
        match self.0.protocol {
            StatsdProtocol::Udp => UDP_DATAGRAM_BYTES,
            StatsdProtocol::Tcp => TCP_BUFFER_BYTES,
        }
    }

    fn connect(&self) -> io::Result<Conn> {
        let addr: SocketAddr = self
            .0
            .addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the name has no address"))?;
        Ok(match self.0.protocol {
            StatsdProtocol::Udp => {
                let local: SocketAddr = if addr.is_ipv4() {
                    (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
                } else {
                    (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
                };
                let socket = UdpSocket::bind(local)?;
                socket.connect(addr)?;
                Conn::Udp(socket)
            }
            StatsdProtocol::Tcp => {
                let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
                stream.set_write_timeout(Some(IO_TIMEOUT))?;
                stream.set_nodelay(true)?;
                Conn::Tcp(stream)
            }
        })
    }

    /// Sends what is gathered in `state.buf`, connecting first if needed; on failure the lines
    /// are dropped (and counted), a TCP connection is closed, and a warning is logged at most
    /// once a minute.
    fn send(&self, state: &mut State) -> io::Result<()> {
        if state.buf.is_empty() {
            return Ok(());
        }
        let lines = state.buf.iter().filter(|&&b| b == b'\n').count() as u64;
        let result = self.write(state);
        state.buf.clear();
        if let Err(e) = &result {
            self.0.dropped.fetch_add(lines, Ordering::Relaxed);
            let now = Instant::now();
            if state.last_warned.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
                state.last_warned = Some(now);
                tracing::warn!(
                    addr = %self.0.addr,
                    dropped_lines = self.0.dropped.swap(0, Ordering::Relaxed),
                    "statsd server unreachable: {e}; its lines are dropped until it answers"
                );
            }
        }
        result
    }

    fn write(&self, state: &mut State) -> io::Result<()> {
        if state.conn.is_none() {
            if state.retry_at.is_some_and(|at| Instant::now() < at) {
                return Err(io::Error::new(io::ErrorKind::NotConnected, "not connected (retrying)"));
            }
            match self.connect() {
                Ok(conn) => {
                    state.conn = Some(conn);
                    state.retry_at = None;
                }
                Err(e) => {
                    state.retry_at = Some(Instant::now() + RETRY);
                    return Err(e);
                }
            }
        }
        let written = match state.conn.as_mut() {
            Some(Conn::Udp(socket)) => socket.send(&state.buf).map(drop),
            Some(Conn::Tcp(stream)) => stream.write_all(&state.buf),
            None => Ok(()),
        };
        // Connected again (the name looked up again) after any failure: a UDP socket stays
        // bound to the address first resolved, which a restarted statsd may no longer have.
        if written.is_err() {
            state.conn = None;
        }
        written
    }
}

impl MetricSink for NetSink {
    fn emit(&self, metric: &str) -> io::Result<usize> {
        let mut state = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !state.buf.is_empty() && state.buf.len() + metric.len() + 1 > self.limit() {
            // A failure was counted and logged; the new line still waits for the next send.
            let _ = self.send(&mut state);
        }
        state.buf.extend_from_slice(metric.as_bytes());
        state.buf.push(b'\n');
        Ok(0)
    }

    fn flush(&self) -> io::Result<()> {
        let mut state = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        self.send(&mut state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_lines_arrive_in_datagrams_under_the_mtu() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        server.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let sink = NetSink::new(&server.local_addr().unwrap().to_string(), StatsdProtocol::Udp);
        let line = format!("a.{}:1|c", "x".repeat(100));
        for _ in 0..30 {
            sink.emit(&line).unwrap();
        }
        sink.flush().unwrap();
        let mut got = 0;
        let mut buf = [0u8; 65536];
        while got < 30 {
            let n = server.recv(&mut buf).unwrap();
            assert!(n <= UDP_DATAGRAM_BYTES, "{n}");
            let text = std::str::from_utf8(&buf[..n]).unwrap();
            for l in text.lines() {
                assert_eq!(l, line);
                got += 1;
            }
        }
        assert_eq!(got, 30);
    }

    /// The decision path counts a line its full queue dropped without waiting for a flush that
    /// holds the sink while it writes to a slow server (it waited for the lock before).
    #[test]
    fn counting_a_drop_never_waits_for_a_flush() {
        let sink = NetSink::new("127.0.0.1:9", StatsdProtocol::Tcp);
        let flushing = sink.0.state.lock().unwrap();
        let (done, counted) = std::sync::mpsc::channel();
        let counter = sink.clone();
        let _t = std::thread::spawn(move || {
            counter.dropped(1);
            let _ = done.send(());
        });
        let waited = counted.recv_timeout(Duration::from_secs(5));
        drop(flushing);
        assert!(waited.is_ok(), "dropped() waited for the flush's lock");
        assert_eq!(sink.0.dropped.load(Ordering::Relaxed), 1);
    }

    /// After a failed send a UDP sink connects again (looking the name up again), as TCP does:
    /// a restarted statsd at a new address gets the lines.
    #[test]
    fn udp_connects_again_after_a_failure() {
        let gone = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = gone.local_addr().unwrap();
        drop(gone);
        let sink = NetSink::new(&addr.to_string(), StatsdProtocol::Udp);
        // The port refuses (ICMP), reported on a later send of the connected socket.
        let mut failed = false;
        for _ in 0..50 {
            sink.emit("x:1|c").unwrap();
            if sink.flush().is_err() {
                failed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(failed, "a send to a closed UDP port fails");
        assert!(sink.0.state.lock().unwrap().conn.is_none(), "the socket is dropped");
    }

    #[test]
    fn tcp_reconnects_after_the_server_comes_back() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let sink = NetSink::new(&addr.to_string(), StatsdProtocol::Tcp);
        sink.emit("lost:1|c").unwrap();
        assert!(sink.flush().is_err(), "nothing listens");
        let listener = std::net::TcpListener::bind(addr).unwrap();
        // Within the retry pause the lines are dropped without a connection attempt.
        sink.emit("lost:2|c").unwrap();
        assert!(sink.flush().is_err());
        sink.0.state.lock().unwrap().retry_at = None;
        sink.emit("kept:3|c").unwrap();
        sink.flush().unwrap();
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut text = String::new();
        let mut buf = [0u8; 64];
        while !text.ends_with('\n') {
            let n = io::Read::read(&mut conn, &mut buf).unwrap();
            text.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        }
        assert_eq!(text, "kept:3|c\n");
    }
}
