//! Private `redis-server` processes (no persistence, a temporary directory each, killed when
//! dropped) and `redis-cli`.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::*;
use crate::support::{free_port, signal, wait_until, ChildGuard, STARTUP_TIMEOUT};

/// How long a `redis-cli` run may take before it is killed and the test fails.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(10);

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
pub(super) fn run(command: &mut Command, timeout: Duration) -> (ExitStatus, String, String) {
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
pub(super) fn spawn_redis(
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
    args: Vec<String>,
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

    /// More `redis-server` arguments (`--replicaof 127.0.0.1 PORT`, `--masterauth PW`), after
    /// the builder's own.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
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
        args.extend(self.options.args.iter().cloned());
        let log = self.dir.path().join(format!("redis-{}.{}.log", self.port, self.starts));
        spawn_redis("redis-server", &args, self.dir.path(), &log, &self.target())
    }
}

// ---- a cluster ----------------------------------------------------------------------------
