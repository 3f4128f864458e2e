//! The gRPC server's limits (`grpc:` settings) on a running `tollgate serve`, seen on the wire:
//! the streams per connection it announces, the keep-alive that closes a connection whose peer
//! stopped answering, and a message over the size limit answered with a clear status and
//! counted.

use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::{Scrape, Tollgate};
use tokio::task::block_in_place;

const RULES: &str = r#"
domain: limits
descriptors:
  - key: user
    token_bucket: {capacity: 100, refill: 100/1h}
"#;

/// One HTTP/2 frame: type, flags, payload.
struct Frame {
    kind: u8,
    flags: u8,
    payload: Vec<u8>,
}

/// Reads one frame; `None` when the server closed the connection.
fn read_frame(s: &mut TcpStream) -> Option<Frame> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).ok()?;
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let mut payload = vec![0; len];
    s.read_exact(&mut payload).ok()?;
    Some(Frame {
        kind: head[3],
        flags: head[4],
        payload,
    })
}

const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;

/// Opens an HTTP/2 connection by hand (the preface, empty SETTINGS, the ACK of the server's),
/// so that the test decides what the client answers; returns it with the server's SETTINGS.
fn handshake(addr: std::net::SocketAddr) -> (TcpStream, Vec<(u16, u32)>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    s.write_all(&[0, 0, 0, SETTINGS, 0, 0, 0, 0, 0]).unwrap();
    let settings = loop {
        let f = read_frame(&mut s).expect("the server's SETTINGS");
        if f.kind == SETTINGS && f.flags & 1 == 0 {
            break f
                .payload
                .chunks_exact(6)
                .map(|c| {
                    (
                        u16::from_be_bytes([c[0], c[1]]),
                        u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                    )
                })
                .collect();
        }
    };
    s.write_all(&[0, 0, 0, SETTINGS, 1, 0, 0, 0, 0]).unwrap();
    (s, settings)
}

#[test]
fn the_server_announces_its_stream_limit_and_closes_a_connection_that_stops_answering_pings() {
    let tollgate = Tollgate::builder()
        .rules_file("limits.yaml", RULES)
        .settings("grpc: {max_concurrent_streams: 7, keepalive_interval_seconds: 1, keepalive_timeout_seconds: 1}")
        .start();
    let (mut s, settings) = handshake(tollgate.grpc_addr);
    // SETTINGS_MAX_CONCURRENT_STREAMS (0x3).
    assert!(settings.contains(&(0x3, 7)), "{settings:?}");
    // Never answer a PING: the server must send one, then give up on the connection.
    let started = Instant::now();
    let mut pinged = false;
    loop {
        match read_frame(&mut s) {
            Some(f) if f.kind == PING && f.flags & 1 == 0 => pinged = true,
            Some(f) if f.kind == GOAWAY => {}
            Some(_) => {}
            None => break,
        }
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "the connection is still open {:?} after the handshake (pinged: {pinged})",
            started.elapsed()
        );
    }
    assert!(pinged, "closed without a keep-alive PING");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "closed too early: {:?}",
        started.elapsed()
    );
    // A connection that answers is kept: a client still gets decisions.
    let (mut s, _) = handshake(tollgate.grpc_addr);
    s.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let f = read_frame(&mut s).expect("an answered connection stays open");
        if f.kind == PING && f.flags & 1 == 0 {
            let mut ack = vec![0, 0, 8, PING, 1, 0, 0, 0, 0];
            ack.extend_from_slice(&f.payload);
            s.write_all(&ack).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_size_limit_is_out_of_range_and_counted() {
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("limits.yaml", RULES)
            .settings("grpc: {max_message_bytes: 2048}")
            .start()
    });
    let mut c = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect");
    let big = "v".repeat(4000);
    let status = c
        .should_rate_limit(support::request("limits", &[("user", big.as_str())], 0))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");
    // Within the limit, on the same connection: decided.
    let resp = c
        .should_rate_limit(support::request("limits", &[("user", "small")], 0))
        .await
        .expect("decided")
        .into_inner();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    let m = block_in_place(|| Scrape::from(tollgate.http_addr));
    assert_eq!(
        m.counter("tollgate_malformed_total", &[("reason", "message_too_large")]),
        1.0
    );
    assert_eq!(m.counter("tollgate_requests_total", &[("code", "out_of_range")]), 1.0);
}
