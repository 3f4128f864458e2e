//! A three-master Redis Cluster on free loopback ports, for the Cluster tests.

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::*;
use crate::support::{free_port, ChildGuard, STARTUP_TIMEOUT};

/// Three Redis Cluster masters without replicas on free loopback ports (each with its cluster
/// bus on port + 10000), all slots assigned, killed when dropped.
pub struct RedisCluster {
    // Declared first so they are dropped (killed) before their directory goes away.
    processes: Vec<ChildGuard>,
    ports: Vec<u16>,
    /// Held for its drop: the nodes' configuration and logs.
    _dir: TempDir,
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
        let cluster = RedisCluster {
            processes,
            ports,
            _dir: dir,
        };
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
