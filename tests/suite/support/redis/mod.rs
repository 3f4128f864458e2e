//! Redis for the integration tests: the shared server (`scripts/ensure-redis`) and how to
//! address any server ([`RedisTarget`]), here; a tiny blocking RESP2 client for checks that must
//! see raw bytes (`client`); private `redis-server` processes (`server`) and a three-master
//! cluster (`cluster`) on free loopback ports; and reading tollgate's keys (`keys`: SCAN for
//! keys without a TTL, deleting a test's prefix).
//!
//! Like the rest of `support`, everything is synchronous and blocks; from an async test call it
//! inside `tokio::task::block_in_place` or `spawn_blocking`. Private servers run without
//! persistence in their own temporary directory and are killed when dropped (their log is
//! printed when that happens during a panic). Nothing here ever flushes a server: tests on the
//! shared one keep to their own [`unique_prefix`].

mod client;
mod cluster;
mod keys;
mod sentinel;
mod server;

pub use client::*;
pub use cluster::*;
pub use keys::*;
pub use sentinel::*;
pub use server::*;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The shared server's URL when `TOLLGATE_REDIS_URL` is not set.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// The URL of the shared Redis (`$TOLLGATE_REDIS_URL`, else [`DEFAULT_REDIS_URL`]) for test
/// `test` when it answers PING, or `None` to skip the test: without Redis the test fails when
/// `CI=true` and is skipped (with a note on stderr) otherwise.
pub fn shared_redis(test: &str) -> Option<String> {
    let url = std::env::var("TOLLGATE_REDIS_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_REDIS_URL.to_owned());
    let why = match RedisTarget::parse(&url) {
        Ok(target) => match target.command_timeout(&[b"PING"], RESP_TIMEOUT) {
            Ok(RespValue::Simple(pong)) if pong == "PONG" => return Some(url),
            Ok(other) => format!("PING answered {other:?}"),
            Err(e) => e,
        },
        Err(e) => e,
    };
    let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    assert!(
        !ci,
        "{test}: no Redis at {url} ({why}) and CI=true: run scripts/ensure-redis or set TOLLGATE_REDIS_URL"
    );
    eprintln!("skipping {test}: no Redis at {url} (run scripts/ensure-redis)");
    None
}

/// Whether `redis-server` and `redis-cli` can be run, for a test that starts private servers:
/// without them the test fails when `CI=true` and is skipped (with a note on stderr) otherwise.
pub fn redis_binaries_or_skip(test: &str) -> bool {
    let runs = |bin: &str| {
        std::process::Command::new(bin)
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if runs("redis-server") && runs("redis-cli") {
        return true;
    }
    let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    assert!(
        !ci,
        "{test}: no redis-server or redis-cli and CI=true: run scripts/ensure-redis"
    );
    eprintln!("skipping {test}: no redis-server or redis-cli (run scripts/ensure-redis)");
    false
}

/// A key prefix unique to this call (test name, pid, wall-clock nanoseconds and a counter), so
/// tests on the shared server never see each other's keys: `tollgate-test:<test>:<pid>:<nanos>-<n>:`.
/// Any `{`, `}` (hash tags) and glob characters in `test` are replaced with `_`.
pub fn unique_prefix(test: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let test: String = test
        .chars()
        .map(|c| if "{}*?[]\\ \t\r\n".contains(c) { '_' } else { c })
        .collect();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("tollgate-test:{test}:{}:{nanos}-{n}:", std::process::id())
}

// ---- RESP ---------------------------------------------------------------------------------

/// Where a Redis server is and how to log in to it.
#[derive(Clone, Debug, PartialEq)]
pub struct RedisTarget {
    pub addr: SocketAddr,
    pub username: Option<String>,
    pub password: Option<String>,
}

impl RedisTarget {
    /// A server on `127.0.0.1:port` without a password.
    pub fn port(port: u16) -> RedisTarget {
        RedisTarget {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            username: None,
            password: None,
        }
    }

    /// Parses `redis://[[user]:password@]host:port[/db]` (user and password percent-decoded; the
    /// database number is ignored: everything here uses database 0).
    pub fn parse(url: &str) -> Result<RedisTarget, String> {
        let rest = url
            .strip_prefix("redis://")
            .ok_or_else(|| format!("{url}: not a redis:// URL"))?;
        let authority = rest.split(['/', '?']).next().unwrap_or_default();
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(u) => match u.split_once(':') {
                Some((user, pass)) => (
                    Some(percent_decode(user)).filter(|s| !s.is_empty()),
                    Some(percent_decode(pass)),
                ),
                None => (None, Some(percent_decode(u))),
            },
        };
        let hostport = if hostport.contains(':') {
            hostport.to_owned()
        } else {
            format!("{hostport}:6379")
        };
        let addr = hostport
            .to_socket_addrs()
            .map_err(|e| format!("{url}: {e}"))?
            .next()
            .ok_or_else(|| format!("{url}: no address"))?;
        Ok(RedisTarget {
            addr,
            username,
            password,
        })
    }

    /// A fresh connection (logged in when there is a password).
    pub fn connect(&self, timeout: Duration) -> Result<RespConn, String> {
        RespConn::connect(self, timeout)
    }

    /// One command on a fresh connection, waiting at most `timeout` to connect and for the
    /// reply. `Err` for a network or protocol failure or a failed login; a command the server
    /// refuses is `Ok(RespValue::Error)`.
    pub fn command_timeout(&self, args: &[&[u8]], timeout: Duration) -> Result<RespValue, String> {
        self.connect(timeout)?.command(args)
    }

    /// [`Self::command_timeout`] with [`RESP_TIMEOUT`]; panics on an error or error reply.
    pub fn cmd(&self, args: &[&[u8]]) -> RespValue {
        self.command_timeout(args, RESP_TIMEOUT)
            .and_then(RespValue::ok)
            .unwrap_or_else(|e| panic!("{} {}: {e}", self.addr, show_args(args)))
    }
}

impl From<&str> for RedisTarget {
    /// Parses a URL; panics when it is not one.
    fn from(url: &str) -> RedisTarget {
        RedisTarget::parse(url).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl From<&String> for RedisTarget {
    fn from(url: &String) -> RedisTarget {
        RedisTarget::from(url.as_str())
    }
}

impl From<u16> for RedisTarget {
    fn from(port: u16) -> RedisTarget {
        RedisTarget::port(port)
    }
}

impl From<&RedisServer> for RedisTarget {
    fn from(server: &RedisServer) -> RedisTarget {
        server.target()
    }
}

impl From<&RedisTarget> for RedisTarget {
    fn from(target: &RedisTarget) -> RedisTarget {
        target.clone()
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn show_args(args: &[&[u8]]) -> String {
    args.iter()
        .map(|a| format!("{:?}", String::from_utf8_lossy(a)))
        .collect::<Vec<_>>()
        .join(" ")
}

// ---- checks on any server -----------------------------------------------------------------
