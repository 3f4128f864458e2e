//! Redis for the integration tests: the shared server (`scripts/ensure-redis`), private
//! `redis-server` processes and a three-master cluster on free loopback ports, and a tiny
//! blocking RESP2 client for checks that must see the raw bytes of keys (SCAN for keys without a
//! TTL, `INFO commandstats`, the server's pid).
//!
//! Like the rest of `support`, everything is synchronous and blocks; from an async test call it
//! inside `tokio::task::block_in_place` or `spawn_blocking`. Private servers run without
//! persistence in their own temporary directory and are killed when dropped (their log is
//! printed when that happens during a panic). Nothing here ever flushes a server: tests on the
//! shared one keep to their own [`unique_prefix`].

// Each test crate includes this module and uses a different part of it.
#![allow(dead_code)]

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tempfile::TempDir;

use super::{free_port, signal, wait_until, ChildGuard, STARTUP_TIMEOUT};

/// The shared server's URL when `TOLLGATE_REDIS_URL` is not set.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// How long [`resp_command`] waits to connect and for each reply.
pub const RESP_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a `redis-cli` run may take before it is killed and the test fails.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(10);

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

/// One RESP2 reply.
#[derive(Clone, Debug, PartialEq)]
pub enum RespValue {
    /// `+OK`
    Simple(String),
    /// `-ERR ...`: the server refused the command.
    Error(String),
    /// `:42`
    Integer(i64),
    /// `$3\r\nabc`
    Bulk(Vec<u8>),
    /// `$-1` or `*-1`
    Nil,
    /// `*2\r\n...`
    Array(Vec<RespValue>),
}

impl RespValue {
    /// The bytes of a bulk or simple string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            RespValue::Bulk(b) => Some(b),
            RespValue::Simple(s) => Some(s.as_bytes()),
            _ => None,
        }
    }

    /// A bulk or simple string as text (invalid UTF-8 replaced).
    pub fn as_text(&self) -> Option<String> {
        self.as_bytes().map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// An integer reply, or a string reply holding an integer.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            RespValue::Integer(i) => Some(*i),
            other => std::str::from_utf8(other.as_bytes()?).ok()?.parse().ok(),
        }
    }

    /// The elements of an array reply.
    pub fn as_array(&self) -> Option<&[RespValue]> {
        match self {
            RespValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// `Err` with the message for an error reply, `Ok(self)` otherwise.
    pub fn ok(self) -> Result<RespValue, String> {
        match self {
            RespValue::Error(e) => Err(e),
            other => Ok(other),
        }
    }
}

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

/// One command to `addr` on a fresh connection (logging in with `password` first when given),
/// waiting at most [`RESP_TIMEOUT`] to connect and for each reply. `Err` for a network or
/// protocol failure (a stopped server times out) or a failed login; a command the server
/// refuses is `Ok(RespValue::Error)`.
pub fn resp_command(addr: SocketAddr, password: Option<&str>, args: &[&[u8]]) -> Result<RespValue, String> {
    resp_command_timeout(addr, password, args, RESP_TIMEOUT)
}

/// [`resp_command`] with its own timeout.
pub fn resp_command_timeout(
    addr: SocketAddr,
    password: Option<&str>,
    args: &[&[u8]],
    timeout: Duration,
) -> Result<RespValue, String> {
    let target = RedisTarget {
        addr,
        username: None,
        password: password.map(str::to_owned),
    };
    target.command_timeout(args, timeout)
}

/// A blocking RESP2 connection.
pub struct RespConn {
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
}

impl RespConn {
    /// Connects to `target` and logs in (`AUTH [user] password`) when it has a password.
    pub fn connect(target: &RedisTarget, timeout: Duration) -> Result<RespConn, String> {
        let addr = target.addr;
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .and_then(|()| stream.set_nodelay(true))
            .map_err(|e| format!("{addr}: {e}"))?;
        let mut conn = RespConn {
            addr,
            reader: BufReader::new(stream),
        };
        if let Some(password) = &target.password {
            let reply = match &target.username {
                Some(user) => conn.command(&[b"AUTH", user.as_bytes(), password.as_bytes()])?,
                None => conn.command(&[b"AUTH", password.as_bytes()])?,
            };
            if let RespValue::Error(e) = reply {
                return Err(format!("AUTH on {addr}: {e}"));
            }
        }
        Ok(conn)
    }

    /// Sends one command and reads its reply.
    pub fn command(&mut self, args: &[&[u8]]) -> Result<RespValue, String> {
        let mut replies = self.pipeline(&[args.iter().map(|a| a.to_vec()).collect()])?;
        Ok(replies.remove(0))
    }

    /// Sends all `commands` at once, then reads one reply for each.
    pub fn pipeline(&mut self, commands: &[Vec<Vec<u8>>]) -> Result<Vec<RespValue>, String> {
        let mut out = Vec::new();
        for args in commands {
            out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
            for arg in args {
                out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
                out.extend_from_slice(arg);
                out.extend_from_slice(b"\r\n");
            }
        }
        let addr = self.addr;
        self.reader
            .get_mut()
            .write_all(&out)
            .map_err(|e| format!("write to {addr}: {e}"))?;
        (0..commands.len())
            .map(|_| read_value(&mut self.reader).map_err(|e| format!("read from {addr}: {e}")))
            .collect()
    }
}

fn read_line(reader: &mut impl BufRead) -> Result<Vec<u8>, String> {
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line).map_err(|e| e.to_string())?;
    if line.is_empty() {
        return Err("connection closed".to_owned());
    }
    if !line.ends_with(b"\r\n") {
        return Err(format!("truncated line {:?}", String::from_utf8_lossy(&line)));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn read_value(reader: &mut impl BufRead) -> Result<RespValue, String> {
    let line = read_line(reader)?;
    let (kind, rest) = line.split_first().ok_or("empty reply line")?;
    let text = String::from_utf8_lossy(rest).into_owned();
    let number = || {
        text.parse::<i64>()
            .map_err(|_| format!("bad length or integer {text:?}"))
    };
    match kind {
        b'+' => Ok(RespValue::Simple(text.clone())),
        b'-' => Ok(RespValue::Error(text.clone())),
        b':' => Ok(RespValue::Integer(number()?)),
        b'$' => {
            let len = number()?;
            if len < 0 {
                return Ok(RespValue::Nil);
            }
            let mut data = vec![0; len as usize + 2];
            reader.read_exact(&mut data).map_err(|e| e.to_string())?;
            if !data.ends_with(b"\r\n") {
                return Err("bulk string not followed by CRLF".to_owned());
            }
            data.truncate(len as usize);
            Ok(RespValue::Bulk(data))
        }
        b'*' => {
            let len = number()?;
            if len < 0 {
                return Ok(RespValue::Nil);
            }
            (0..len)
                .map(|_| read_value(reader))
                .collect::<Result<_, _>>()
                .map(RespValue::Array)
        }
        other => Err(format!(
            "unknown reply type {:?} in {:?}",
            *other as char,
            String::from_utf8_lossy(&line)
        )),
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

/// `prefix` as a SCAN MATCH pattern that matches exactly the keys starting with it: the glob
/// characters `*`, `?`, `[`, `]` and `\` escaped, then `*`.
pub fn scan_pattern(prefix: &[u8]) -> Vec<u8> {
    let mut pattern = Vec::with_capacity(prefix.len() + 1);
    for &b in prefix {
        if b"*?[]\\".contains(&b) {
            pattern.push(b'\\');
        }
        pattern.push(b);
    }
    pattern.push(b'*');
    pattern
}

/// Every key starting with `prefix` on one server (SCAN over database 0), as raw bytes.
pub fn scan_keys_raw(target: impl Into<RedisTarget>, prefix: &[u8]) -> Vec<Vec<u8>> {
    let target = target.into();
    let mut conn = target
        .connect(RESP_TIMEOUT)
        .unwrap_or_else(|e| panic!("SCAN on {}: {e}", target.addr));
    let pattern = scan_pattern(prefix);
    let mut cursor = b"0".to_vec();
    let mut keys = BTreeSet::new();
    loop {
        let reply = conn
            .command(&[b"SCAN", &cursor, b"MATCH", &pattern, b"COUNT", b"1000"])
            .and_then(RespValue::ok)
            .unwrap_or_else(|e| panic!("SCAN on {}: {e}", target.addr));
        let parts = reply.as_array().unwrap_or_default();
        let (Some(next), Some(RespValue::Array(batch))) = (parts.first().and_then(RespValue::as_bytes), parts.get(1))
        else {
            panic!("SCAN on {}: unexpected reply {reply:?}", target.addr);
        };
        // SCAN can return a key more than once; the set keeps one.
        keys.extend(batch.iter().filter_map(|k| k.as_bytes().map(<[u8]>::to_vec)));
        cursor = next.to_vec();
        if cursor == b"0" {
            break;
        }
    }
    keys.into_iter().collect()
}

/// Every key starting with `prefix` on one server whose PTTL is -1 (it never expires), as raw
/// bytes, sorted.
pub fn keys_without_ttl_raw(target: impl Into<RedisTarget>, prefix: &[u8]) -> Vec<Vec<u8>> {
    let target = target.into();
    let keys = scan_keys_raw(&target, prefix);
    if keys.is_empty() {
        return keys;
    }
    let mut conn = target
        .connect(RESP_TIMEOUT)
        .unwrap_or_else(|e| panic!("PTTL on {}: {e}", target.addr));
    let mut found = Vec::new();
    for chunk in keys.chunks(500) {
        let commands: Vec<Vec<Vec<u8>>> = chunk.iter().map(|k| vec![b"PTTL".to_vec(), k.clone()]).collect();
        let replies = conn
            .pipeline(&commands)
            .unwrap_or_else(|e| panic!("PTTL on {}: {e}", target.addr));
        for (key, reply) in chunk.iter().zip(replies) {
            // -2: the key expired or was deleted since SCAN saw it.
            match reply {
                RespValue::Integer(-1) => found.push(key.clone()),
                RespValue::Integer(_) => {}
                other => panic!("PTTL {:?} on {}: {other:?}", String::from_utf8_lossy(key), target.addr),
            }
        }
    }
    found
}

/// [`keys_without_ttl_raw`] for a text prefix, each key as text (invalid UTF-8 replaced), for
/// assertions and messages. `target`: a URL (`&str`), a port on 127.0.0.1, a
/// [`RedisServer`] or a [`RedisTarget`].
pub fn keys_without_ttl(target: impl Into<RedisTarget>, prefix: &str) -> Vec<String> {
    keys_without_ttl_raw(target, prefix.as_bytes())
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect()
}

/// `INFO <section>` as text.
pub fn info(target: impl Into<RedisTarget>, section: &str) -> String {
    target
        .into()
        .cmd(&[b"INFO", section.as_bytes()])
        .as_text()
        .expect("INFO answers a bulk string")
}

/// `INFO commandstats` per command (lower case, `client|setname` for subcommands): the number of
/// calls and the total microseconds spent in them.
pub fn info_commandstats(target: impl Into<RedisTarget>) -> HashMap<String, (u64, f64)> {
    parse_commandstats(&info(target, "commandstats"))
}

/// Parses lines like `cmdstat_evalsha:calls=3,usec=45,usec_per_call=15.00,...`.
pub fn parse_commandstats(text: &str) -> HashMap<String, (u64, f64)> {
    text.lines()
        .filter_map(|line| {
            let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |key: &str| {
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
                    .map(str::to_owned)
            };
            let calls = field("calls")?.parse().ok()?;
            let usec = field("usec")?.parse().ok()?;
            Some((name.to_owned(), (calls, usec)))
        })
        .collect()
}

/// The server's process id (`process_id` in `INFO server`), e.g. to read its CPU time from
/// `/proc/<pid>/stat`.
pub fn redis_server_pid(target: impl Into<RedisTarget>) -> u32 {
    let text = info(target, "server");
    text.lines()
        .find_map(|l| l.trim().strip_prefix("process_id:")?.parse().ok())
        .unwrap_or_else(|| panic!("no process_id in INFO server:\n{text}"))
}

/// Runs `redis-cli` with `args` against 127.0.0.1:`port` (`-c` first in `args` to follow
/// cluster redirections); the password goes in through `REDISCLI_AUTH`. Returns stdout trimmed;
/// panics when redis-cli fails (e.g. cannot connect) or takes longer than [`CLI_TIMEOUT`].
pub fn redis_cli(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let mut command = Command::new("redis-cli");
    command.args(["-h", "127.0.0.1", "-p", &port.to_string()]).args(args);
    if let Some(password) = password {
        command.env("REDISCLI_AUTH", password);
    }
    let (status, stdout, stderr) = run(&mut command, CLI_TIMEOUT);
    assert!(
        status.success(),
        "redis-cli -p {port} {args:?}: {status}\nstdout: {stdout}\nstderr: {stderr}"
    );
    stdout.trim().to_owned()
}

/// Runs `command` to the end with piped output; kills it (the child it spawned, by its handle)
/// after `timeout`.
fn run(command: &mut Command, timeout: Duration) -> (ExitStatus, String, String) {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {command:?}: {e} (run scripts/ensure-redis to install Redis)"));
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let out_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for a child") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = String::from_utf8_lossy(&out_thread.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_thread.join().unwrap_or_default()).into_owned();
    (status, stdout, stderr)
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid` with kill(1).
/// Spawns `redis-server` with `args` under a [`ChildGuard`] logging to `log` and waits until it
/// answers PING. `Err((why, port_taken))` when it does not come up (the process is reaped).
fn spawn_redis(
    name: &str,
    args: &[String],
    dir: &std::path::Path,
    log: &std::path::Path,
    target: &RedisTarget,
) -> Result<ChildGuard, (String, bool)> {
    let mut command = Command::new("redis-server");
    command.args(args).current_dir(dir);
    let mut process = ChildGuard::spawn(name, &mut command, log);
    match wait_until(&mut process, || {
        matches!(
            target.command_timeout(&[b"PING"], Duration::from_millis(500)),
            Ok(RespValue::Simple(p)) if p == "PONG"
        )
        .then_some(())
    }) {
        Ok(()) => Ok(process),
        Err(why) => {
            let log = process.log();
            let taken = log.contains("Address already in use") || log.contains("Could not create server TCP");
            let why = format!("{why}\n{}", process.log_tail(30));
            // Killed and reaped here; no log print (the caller decides whether to panic).
            drop(process);
            Err((why, taken))
        }
    }
}

// ---- a private server ---------------------------------------------------------------------

/// Configures a [`RedisServer`] before starting it.
#[derive(Clone, Debug, Default)]
pub struct RedisServerBuilder {
    password: Option<String>,
    maxmemory: Option<u64>,
    port: Option<u16>,
}

impl RedisServerBuilder {
    /// Clients must log in with `password` (`requirepass`).
    pub fn requirepass(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self
    }

    /// At most `bytes` of data, refusing writes beyond (`maxmemory-policy noeviction`).
    pub fn maxmemory(mut self, bytes: u64) -> Self {
        self.maxmemory = Some(bytes);
        self
    }

    /// Listen on this loopback port instead of a free one (e.g. one a tollgate was told to use
    /// before any server ran there). [`Self::start`] then panics if the port is taken.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Starts the server on a free loopback port (another one when that is taken by the time
    /// the server binds), or on the port given to [`Self::port`], and waits until it answers
    /// PING. Panics, with the log, if it does not come up.
    pub fn start(self) -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-redis.")
            .tempdir()
            .expect("create a temporary directory");
        let mut server = RedisServer {
            process: None,
            port: 0,
            options: self,
            starts: 0,
            dir,
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            server.port = server.options.port.unwrap_or_else(free_port);
            match server.spawn() {
                Ok(process) => {
                    server.process = Some(process);
                    return server;
                }
                Err((_, true)) if attempt < 5 && server.options.port.is_none() => continue,
                Err((why, _)) => panic!("redis-server did not start: {why}"),
            }
        }
    }
}

/// A private `redis-server` on a free loopback port: no persistence, its own temporary
/// directory, killed when dropped.
pub struct RedisServer {
    // Declared first so it is dropped (killed) before its directory goes away.
    process: Option<ChildGuard>,
    port: u16,
    options: RedisServerBuilder,
    starts: u32,
    dir: TempDir,
}

impl RedisServer {
    /// A server without password or memory limit; see [`RedisServerBuilder::start`].
    pub fn start() -> RedisServer {
        RedisServer::builder().start()
    }

    /// Options for a server.
    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// `redis://127.0.0.1:PORT` (without the password: see [`Self::auth_url`]).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis://:PASSWORD@127.0.0.1:PORT` when there is a password, else [`Self::url`].
    pub fn auth_url(&self) -> String {
        match &self.options.password {
            Some(pw) => format!("redis://:{}@127.0.0.1:{}", percent_encode(pw), self.port),
            None => self.url(),
        }
    }

    /// The port it listens on (the same across [`Self::restart`]).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The `requirepass` password, if any.
    pub fn password(&self) -> Option<&str> {
        self.options.password.as_deref()
    }

    /// Address and password, for [`keys_without_ttl`] and friends.
    pub fn target(&self) -> RedisTarget {
        RedisTarget {
            addr: self.addr(),
            username: None,
            password: self.options.password.clone(),
        }
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ChildGuard::id)
    }

    /// Everything the current process logged.
    pub fn log(&self) -> String {
        self.process.as_ref().map(ChildGuard::log).unwrap_or_default()
    }

    /// Kills the server (SIGKILL) and reaps it; a no-op when it is not running. Its data is
    /// gone: there is no persistence.
    pub fn kill(&mut self) {
        // ChildGuard's drop kills and waits; a stopped process dies of SIGKILL too.
        self.process.take();
    }

    /// Starts the server again on the same port (killing it first if it still runs) and waits
    /// until it answers PING. Panics if it does not come up (e.g. the port was taken meanwhile).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            match self.spawn() {
                Ok(process) => {
                    self.process = Some(process);
                    return;
                }
                Err((_, true)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
                Err((why, _)) => panic!("redis-server did not restart on port {}: {why}", self.port),
            }
        }
    }

    /// Stops the process (SIGSTOP): connections are accepted by the kernel but nothing answers.
    pub fn pause(&self) {
        signal(self.pid().expect("pause: redis-server is not running"), "STOP");
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) {
        signal(self.pid().expect("resume: redis-server is not running"), "CONT");
    }

    /// Runs `redis-cli` with `args` against this server (logged in when there is a password):
    /// see [`redis_cli`].
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, self.password(), args)
    }

    /// One command over RESP; panics on an error or error reply.
    pub fn cmd(&self, args: &[&[u8]]) -> RespValue {
        self.target().cmd(args)
    }

    /// Whether it answers PING within a second.
    pub fn ping(&self) -> bool {
        matches!(
            self.target().command_timeout(&[b"PING"], Duration::from_secs(1)),
            Ok(RespValue::Simple(p)) if p == "PONG"
        )
    }

    /// [`keys_without_ttl`] on this server.
    pub fn keys_without_ttl(&self, prefix: &str) -> Vec<String> {
        keys_without_ttl(self.target(), prefix)
    }

    fn spawn(&mut self) -> Result<ChildGuard, (String, bool)> {
        self.starts += 1;
        let mut args: Vec<String> = [
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            "",
            "--dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(self.dir.path().to_string_lossy().into_owned());
        if let Some(pw) = &self.options.password {
            args.extend(["--requirepass".to_owned(), pw.clone()]);
        }
        if let Some(bytes) = self.options.maxmemory {
            args.extend([
                "--maxmemory".to_owned(),
                bytes.to_string(),
                "--maxmemory-policy".to_owned(),
                "noeviction".to_owned(),
            ]);
        }
        let log = self.dir.path().join(format!("redis-{}.{}.log", self.port, self.starts));
        spawn_redis("redis-server", &args, self.dir.path(), &log, &self.target())
    }
}

// ---- a cluster ----------------------------------------------------------------------------

/// Three Redis Cluster masters without replicas on free loopback ports (each with its cluster
/// bus on port + 10000), all slots assigned, killed when dropped.
pub struct RedisCluster {
    // Declared first so they are dropped (killed) before their directory goes away.
    processes: Vec<ChildGuard>,
    ports: Vec<u16>,
    dir: TempDir,
}

impl RedisCluster {
    /// Starts three masters, joins them with `redis-cli --cluster create` and waits until every
    /// node says `cluster_state:ok` with all 16384 slots. Panics, with the logs, if that fails.
    pub fn start() -> RedisCluster {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-redis-cluster.")
            .tempdir()
            .expect("create a temporary directory");
        let mut attempt = 0;
        let (processes, ports) = loop {
            attempt += 1;
            let ports = cluster_ports(3);
            let mut processes = Vec::new();
            let mut failure = None;
            for &port in &ports {
                let conf = dir.path().join(format!("nodes-{port}.conf"));
                let _ = std::fs::remove_file(&conf);
                let args: Vec<String> = vec![
                    "--port".into(),
                    port.to_string(),
                    "--bind".into(),
                    "127.0.0.1".into(),
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-config-file".into(),
                    conf.to_string_lossy().into_owned(),
                    "--cluster-node-timeout".into(),
                    "2000".into(),
                    "--save".into(),
                    "".into(),
                    "--appendonly".into(),
                    "no".into(),
                    "--daemonize".into(),
                    "no".into(),
                    "--logfile".into(),
                    "".into(),
                    "--dir".into(),
                    dir.path().to_string_lossy().into_owned(),
                ];
                let log = dir.path().join(format!("redis-{port}.{attempt}.log"));
                let name = format!("redis-server (cluster node {port})");
                match spawn_redis(&name, &args, dir.path(), &log, &RedisTarget::port(port)) {
                    Ok(process) => processes.push(process),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            match failure {
                None => break (processes, ports),
                Some((_, true)) if attempt < 5 => continue,
                Some((why, _)) => panic!("cluster node did not start: {why}"),
            }
        };
        let cluster = RedisCluster { processes, ports, dir };
        cluster.create();
        cluster
    }

    fn create(&self) {
        let mut command = Command::new("redis-cli");
        command.arg("--cluster").arg("create");
        command.args(self.ports.iter().map(|p| format!("127.0.0.1:{p}")));
        command.args(["--cluster-replicas", "0", "--cluster-yes"]);
        let (status, stdout, stderr) = run(&mut command, STARTUP_TIMEOUT);
        assert!(
            status.success() && !stdout.contains("[ERR]"),
            "redis-cli --cluster create: {status}\n{stdout}\n{stderr}\n{}",
            self.logs()
        );
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let states: Vec<String> = self
                .ports
                .iter()
                .map(|&p| {
                    RedisTarget::port(p)
                        .command_timeout(&[b"CLUSTER", b"INFO"], RESP_TIMEOUT)
                        .ok()
                        .and_then(|v| v.as_text())
                        .unwrap_or_default()
                })
                .collect();
            if states
                .iter()
                .all(|s| s.contains("cluster_state:ok") && s.contains("cluster_slots_ok:16384"))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster not ok after {STARTUP_TIMEOUT:?}: {states:#?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn logs(&self) -> String {
        self.processes
            .iter()
            .zip(&self.ports)
            .map(|(p, port)| format!("---- node {port} ----\n{}", p.log_tail(30)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `redis://127.0.0.1:P` for each node.
    pub fn urls(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect()
    }

    /// Each node's address.
    pub fn nodes(&self) -> Vec<SocketAddr> {
        self.ports
            .iter()
            .map(|&p| SocketAddr::from(([127, 0, 0, 1], p)))
            .collect()
    }

    /// Each node's port.
    pub fn ports(&self) -> Vec<u16> {
        self.ports.clone()
    }

    /// Each node's process id.
    pub fn pids(&self) -> Vec<u32> {
        self.processes.iter().map(ChildGuard::id).collect()
    }

    /// Runs `redis-cli -c` (following redirections) with `args` against node `node`.
    pub fn cli(&self, node: usize, args: &[&str]) -> String {
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        redis_cli(self.ports[node], None, &all)
    }

    /// One command over RESP to node `node` (no redirection); panics on an error reply.
    pub fn cmd(&self, node: usize, args: &[&[u8]]) -> RespValue {
        RedisTarget::port(self.ports[node]).cmd(args)
    }

    /// The keys starting with `prefix`, on any node, that never expire (PTTL -1), sorted.
    pub fn keys_with_ttl_problems(&self, prefix: &str) -> Vec<String> {
        let mut keys: Vec<String> = self.ports.iter().flat_map(|&p| keys_without_ttl(p, prefix)).collect();
        keys.sort();
        keys
    }

    /// Same as [`Self::keys_with_ttl_problems`].
    pub fn keys_without_ttl(&self, prefix: &str) -> Vec<String> {
        self.keys_with_ttl_problems(prefix)
    }
}

/// `count` distinct loopback ports that are free, each with port + 10000 (its cluster bus)
/// free too.
fn cluster_ports(count: usize) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < count {
        let port = free_port();
        let Some(bus) = port.checked_add(10000) else {
            continue;
        };
        let clash = ports
            .iter()
            .any(|&p| [p, p + 10000].contains(&port) || [p, p + 10000].contains(&bus));
        if !clash && TcpListener::bind(("127.0.0.1", bus)).is_ok() {
            ports.push(port);
        }
    }
    ports
}

/// Deletes every key starting with `prefix` on one server (a test's own keys on the shared
/// server: they would otherwise live until their TTL, years for some buckets).
/// Returns how many were deleted.
pub fn delete_prefix(target: impl Into<RedisTarget>, prefix: &str) -> usize {
    let target = target.into();
    let keys = scan_keys_raw(&target, prefix.as_bytes());
    for key in &keys {
        target.cmd(&[b"DEL", key]);
    }
    keys.len()
}

/// A Redis store on `urls` (a Cluster when `cluster`) under `prefix` whose scripts decide at
/// `clock`'s time instead of Redis `TIME`, connected: what the tests that pin exact states use.
pub async fn store_on_clock(
    urls: Vec<String>,
    cluster: bool,
    prefix: &str,
    clock: &tollgate::core::clock::ManualClock,
) -> tollgate::store::RedisStore {
    let settings = tollgate::server::settings::RedisSettings {
        urls,
        cluster,
        key_prefix: prefix.to_string(),
        command_timeout_ms: tollgate::core::units::Millis(5_000),
        ..tollgate::server::settings::RedisSettings::default()
    };
    let store = tollgate::store::RedisStore::new(&settings, std::sync::Arc::new(tollgate::core::clock::SystemClock))
        .expect("a valid Redis store")
        .with_time_override(std::sync::Arc::new(clock.clone()));
    store.connect(Duration::from_secs(10)).await.expect("Redis connects");
    store
}
