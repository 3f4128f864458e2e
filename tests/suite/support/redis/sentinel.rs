//! Redis behind Sentinel, privately: a master, one replica and three sentinels
//! (`redis-server --sentinel`, from the same package) on free loopback ports with short
//! timeouts, passwords on the data nodes and on the sentinels; and a `redis-server` on a Unix
//! socket only (`port 0`). All killed when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::*;
use crate::support::{free_port, wait_until, ChildGuard, STARTUP_TIMEOUT};

/// The master's name the sentinels monitor.
pub const SENTINEL_MASTER: &str = "tollgate-master";

/// A master with a replica, watched by three sentinels (quorum 2).
pub struct RedisSentinels {
    // Declared first: the sentinels go before the data nodes, so none fails over at the end.
    sentinels: Vec<(ChildGuard, u16)>,
    /// The master at start; killed by [`Self::kill_master`].
    pub master: RedisServer,
    /// The replica at start, promoted after the master dies.
    pub replica: RedisServer,
    password: String,
    sentinel_password: String,
    _dir: TempDir,
}

impl RedisSentinels {
    /// Starts the master and replica (`requirepass password`) and three sentinels
    /// (`requirepass sentinel_password`) that call the master down after `down_after_ms`
    /// and give a failover `failover_timeout_ms`; returns once every sentinel knows the
    /// replica and the other two sentinels, and the replica is in sync. Panics, with the logs,
    /// when that does not happen within [`STARTUP_TIMEOUT`].
    pub fn start(
        password: &str,
        sentinel_password: &str,
        down_after_ms: u64,
        failover_timeout_ms: u64,
    ) -> RedisSentinels {
        let master = RedisServer::builder()
            .requirepass(password)
            .args(&[
                "--masterauth",
                password,
                "--repl-diskless-sync",
                "yes",
                "--repl-diskless-sync-delay",
                "0",
            ])
            .start();
        let master_port = master.port().to_string();
        let replica = RedisServer::builder()
            .requirepass(password)
            .args(&["--masterauth", password, "--replicaof", "127.0.0.1", &master_port])
            .start();
        let dir = tempfile::Builder::new()
            .prefix("tollgate-sentinel.")
            .tempdir()
            .expect("create a temporary directory");
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let conf = dir.path().join(format!("sentinel-{i}.conf"));
            // The file must be writable: a sentinel rewrites it with what it learns.
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndaemonize no\nlogfile \"\"\ndir {dir}\n\
                     requirepass {sentinel_password}\nsentinel sentinel-pass {sentinel_password}\n\
                     sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master_port} 2\n\
                     sentinel auth-pass {SENTINEL_MASTER} {password}\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} {down_after_ms}\n\
                     sentinel failover-timeout {SENTINEL_MASTER} {failover_timeout_ms}\n",
                    dir = dir.path().display()
                ),
            )
            .expect("write a sentinel's configuration");
            let log = dir.path().join(format!("sentinel-{i}.log"));
            let mut command = Command::new("redis-server");
            command.arg(&conf).arg("--sentinel").current_dir(dir.path());
            let mut process = ChildGuard::spawn(&format!("redis-sentinel-{i}"), &mut command, &log);
            let target = RedisTarget {
                password: Some(sentinel_password.to_owned()),
                ..RedisTarget::port(port)
            };
            let up = wait_until(&mut process, || {
                matches!(
                    target.command_timeout(&[b"PING"], Duration::from_millis(500)),
                    Ok(RespValue::Simple(p)) if p == "PONG"
                )
                .then_some(())
            });
            if let Err(why) = up {
                panic!("sentinel {i} did not start: {why}\n{}", process.log_tail(30));
            }
            sentinels.push((process, port));
        }
        let set = RedisSentinels {
            sentinels,
            master,
            replica,
            password: password.to_owned(),
            sentinel_password: sentinel_password.to_owned(),
            _dir: dir,
        };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while !set.settled() {
            assert!(
                Instant::now() < deadline,
                "the sentinels did not settle within {STARTUP_TIMEOUT:?}: {:?}",
                set.sentinel_views()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        set
    }

    /// `redis://127.0.0.1:PORT` of each sentinel.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|(_, p)| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// `127.0.0.1:PORT` of each sentinel.
    pub fn addrs(&self) -> Vec<String> {
        self.sentinels.iter().map(|(_, p)| format!("127.0.0.1:{p}")).collect()
    }

    /// The data nodes' password.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The sentinels' password.
    pub fn sentinel_password(&self) -> &str {
        &self.sentinel_password
    }

    /// A command to sentinel `i`.
    pub fn sentinel_cmd(&self, i: usize, args: &[&[u8]]) -> Result<RespValue, String> {
        let target = RedisTarget {
            password: Some(self.sentinel_password.clone()),
            ..RedisTarget::port(self.sentinels[i].1)
        };
        target.command_timeout(args, Duration::from_secs(2))
    }

    /// The master's port as sentinel `i` names it now.
    pub fn master_port(&self, i: usize) -> Option<u16> {
        let answer = self
            .sentinel_cmd(
                i,
                &[b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER.as_bytes()],
            )
            .ok()?;
        answer.as_array()?.get(1)?.as_text()?.parse().ok()
    }

    /// Per sentinel, what `SENTINEL MASTER` says (flags, other sentinels, replicas), for
    /// messages.
    fn sentinel_views(&self) -> Vec<Result<RespValue, String>> {
        (0..self.sentinels.len())
            .map(|i| self.sentinel_cmd(i, &[b"SENTINEL", b"MASTER", SENTINEL_MASTER.as_bytes()]))
            .collect()
    }

    /// Every sentinel names the master, knows the other two and one replica, and the replica
    /// is in sync.
    fn settled(&self) -> bool {
        let field = |view: &RespValue, name: &str| -> Option<String> {
            let items = view.as_array()?;
            let at = items.iter().position(|v| v.as_text().as_deref() == Some(name))?;
            items.get(at + 1)?.as_text()
        };
        let sentinels_agree = self.sentinel_views().iter().all(|view| {
            view.as_ref().is_ok_and(|v| {
                field(v, "num-other-sentinels").as_deref() == Some("2")
                    && field(v, "num-slaves").as_deref() == Some("1")
                    && field(v, "flags").as_deref() == Some("master")
            })
        });
        let synced = info(self.replica.target(), "replication").contains("master_link_status:up");
        sentinels_agree && synced
    }

    /// SIGKILL of the master: the sentinels promote the replica after `down_after_ms` and an
    /// election.
    pub fn kill_master(&mut self) {
        self.master.kill();
    }
}

/// A `redis-server` listening on a Unix socket only (`port 0`), optionally with a password.
pub struct UnixRedis {
    // Declared first so it is killed before its directory goes away.
    _process: ChildGuard,
    socket: PathBuf,
    password: Option<String>,
    _dir: TempDir,
}

/// `redis-cli -s socket args...`, logged in with `password`: stdout trimmed, or why it failed.
fn unix_cli(socket: &Path, password: Option<&str>, args: &[&str]) -> Result<String, String> {
    let mut command = Command::new("redis-cli");
    command.arg("-s").arg(socket).args(args);
    if let Some(pw) = password {
        command.env("REDISCLI_AUTH", pw);
    }
    let (status, stdout, stderr) = run(&mut command, CLI_TIMEOUT);
    if status.success() && !stdout.starts_with("Could not connect") {
        Ok(stdout.trim().to_owned())
    } else {
        Err(format!(
            "redis-cli -s {} {args:?}: {status}\n{stdout}\n{stderr}",
            socket.display()
        ))
    }
}

impl UnixRedis {
    /// Starts it and waits until `redis-cli -s` gets PONG; panics, with the log, otherwise.
    pub fn start(password: Option<&str>) -> UnixRedis {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-redis-unix.")
            .tempdir()
            .expect("create a temporary directory");
        let socket = dir.path().join("redis.sock");
        let mut command = Command::new("redis-server");
        command
            .args(["--port", "0", "--unixsocket"])
            .arg(&socket)
            .args([
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                "",
            ])
            .current_dir(dir.path());
        if let Some(pw) = password {
            command.args(["--requirepass", pw]);
        }
        let log = dir.path().join("redis.log");
        let mut process = ChildGuard::spawn("redis-server (unix socket)", &mut command, &log);
        let up = wait_until(&mut process, || {
            let pong = socket
                .exists()
                .then(|| unix_cli(&socket, password, &["PING"]).ok())
                .flatten();
            (pong.as_deref() == Some("PONG")).then_some(())
        });
        if let Err(why) = up {
            panic!(
                "redis-server on a Unix socket did not start: {why}\n{}",
                process.log_tail(30)
            );
        }
        UnixRedis {
            _process: process,
            socket,
            password: password.map(str::to_owned),
            _dir: dir,
        }
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `unix:///path/to/redis.sock`.
    pub fn url(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// `redis-cli -s SOCKET args...` (logged in when there is a password); stdout trimmed.
    /// Panics when redis-cli fails.
    pub fn cli(&self, args: &[&str]) -> String {
        unix_cli(&self.socket, self.password.as_deref(), args).unwrap_or_else(|e| panic!("{e}"))
    }
}
