//! A Redis Cluster on free loopback ports, for the Cluster tests: three masters
//! ([`RedisCluster::start`]), or three masters with a replica each
//! ([`RedisCluster::with_replicas`]) that a test can fail over, kill and restart.

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::*;
use crate::support::{free_port, signal, ChildGuard, STARTUP_TIMEOUT};

/// Redis Cluster nodes on free loopback ports (each with its cluster bus on port + 10000), all
/// slots assigned, killed when dropped.
pub struct RedisCluster {
    // Declared first so they are dropped (killed) before their directory goes away. `None`:
    // killed by the test.
    processes: Vec<Option<ChildGuard>>,
    ports: Vec<u16>,
    /// `cluster-node-timeout`, in milliseconds.
    node_timeout_ms: u64,
    /// How many times each node was started, for its log's name.
    starts: Vec<u32>,
    /// Held for its drop: the nodes' configuration and logs.
    dir: TempDir,
}

/// A node's role in `CLUSTER NODES`, as one live node sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    /// Index of the node in [`RedisCluster::ports`].
    pub node: usize,
    /// Whether it is a master (else a replica).
    pub master: bool,
    /// The master's index, for a replica.
    pub replica_of: Option<usize>,
    /// Whether it is flagged `fail` or `fail?`.
    pub failing: bool,
    /// Its slot ranges (inclusive), for a master.
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// Starts three masters, joins them with `redis-cli --cluster create` and waits until every
    /// node says `cluster_state:ok` with all 16384 slots. Panics, with the logs, if that fails.
    pub fn start() -> RedisCluster {
        RedisCluster::start_nodes(3, 0, 2000)
    }

    /// Starts three masters and three replicas (`--cluster-replicas 1`) with a
    /// `cluster-node-timeout` of `node_timeout_ms`, so a killed master's replica takes over
    /// within about twice that; waits for `cluster_state:ok` everywhere and every replica in sync.
    pub fn with_replicas(node_timeout_ms: u64) -> RedisCluster {
        RedisCluster::start_nodes(6, 1, node_timeout_ms)
    }

    fn start_nodes(count: usize, replicas: usize, node_timeout_ms: u64) -> RedisCluster {
        let mut dir = tempfile::Builder::new()
            .prefix("tollgate-redis-cluster.")
            .tempdir()
            .expect("create a temporary directory");
        let mut attempt = 0;
        let cluster = loop {
            attempt += 1;
            let ports = cluster_ports(count);
            let mut cluster = RedisCluster {
                processes: Vec::new(),
                ports: ports.clone(),
                node_timeout_ms,
                starts: vec![0; count],
                dir,
            };
            let mut failure = None;
            for (node, port) in ports.iter().enumerate() {
                let conf = cluster.dir.path().join(format!("nodes-{port}.conf"));
                let _ = std::fs::remove_file(&conf);
                match cluster.spawn(node) {
                    Ok(process) => cluster.processes.push(Some(process)),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            match failure {
                None => break cluster,
                Some((_, true)) if attempt < 5 => {
                    let RedisCluster { processes, dir: d, .. } = cluster;
                    drop(processes);
                    dir = d;
                    continue;
                }
                Some((why, _)) => panic!("cluster node did not start: {why}"),
            }
        };
        cluster.create(replicas);
        cluster
    }

    fn spawn(&mut self, node: usize) -> Result<ChildGuard, (String, bool)> {
        let port = self.ports[node];
        self.starts[node] += 1;
        let dir = self.dir.path();
        let conf = dir.join(format!("nodes-{port}.conf"));
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
            self.node_timeout_ms.to_string(),
            // The healthy masters keep answering while a lost master's slots have no owner (by
            // default every node refuses every command then, CLUSTERDOWN): docs/backends.md
            // asks for this setting.
            "--cluster-require-full-coverage".into(),
            "no".into(),
            "--save".into(),
            "".into(),
            "--appendonly".into(),
            "no".into(),
            "--daemonize".into(),
            "no".into(),
            "--logfile".into(),
            "".into(),
            "--dir".into(),
            dir.to_string_lossy().into_owned(),
        ];
        let log = dir.join(format!("redis-{port}.{}.log", self.starts[node]));
        let name = format!("redis-server (cluster node {port})");
        spawn_redis(&name, &args, dir, &log, &RedisTarget::port(port))
    }

    fn create(&self, replicas: usize) {
        let mut command = Command::new("redis-cli");
        command.arg("--cluster").arg("create");
        command.args(self.ports.iter().map(|p| format!("127.0.0.1:{p}")));
        command.args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]);
        let (status, stdout, stderr) = run(&mut command, STARTUP_TIMEOUT);
        assert!(
            status.success() && !stdout.contains("[ERR]"),
            "redis-cli --cluster create: {status}\n{stdout}\n{stderr}\n{}",
            self.logs()
        );
        self.wait_ok(STARTUP_TIMEOUT);
        if replicas > 0 {
            let deadline = Instant::now() + STARTUP_TIMEOUT;
            while !self.replicas_in_sync() {
                assert!(
                    Instant::now() < deadline,
                    "replicas not in sync after {STARTUP_TIMEOUT:?}\n{}",
                    self.logs()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Waits until every running node says `cluster_state:ok` with all 16384 slots ok and
    /// agrees on who the masters are; panics with the logs after `within`.
    pub fn wait_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let states: Vec<String> = self
                .running()
                .into_iter()
                .map(|n| {
                    RedisTarget::port(self.ports[n])
                        .command_timeout(&[b"CLUSTER", b"INFO"], RESP_TIMEOUT)
                        .ok()
                        .and_then(|v| v.as_text())
                        .unwrap_or_default()
                })
                .collect();
            let ok = !states.is_empty()
                && states
                    .iter()
                    .all(|s| s.contains("cluster_state:ok") && s.contains("cluster_slots_ok:16384"));
            if ok && self.views_agree() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster not ok after {within:?}: {states:#?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether every running node sees the same masters with the same slots and no node failing.
    fn views_agree(&self) -> bool {
        let views: Vec<Vec<NodeView>> = self.running().into_iter().map(|n| self.view_from(n)).collect();
        let masters = |v: &Vec<NodeView>| -> Vec<(usize, Vec<(u16, u16)>)> {
            let mut m: Vec<_> = v
                .iter()
                .filter(|n| n.master && !n.failing)
                .map(|n| (n.node, n.slots.clone()))
                .collect();
            m.sort();
            m
        };
        let Some(first) = views.first() else { return false };
        views
            .iter()
            .all(|v| masters(v) == masters(first) && v.iter().filter(|n| self.is_running(n.node)).all(|n| !n.failing))
    }

    /// Whether every replica's link to its master is up and its offset caught up.
    fn replicas_in_sync(&self) -> bool {
        self.running().into_iter().all(|n| {
            let info = RedisTarget::port(self.ports[n])
                .command_timeout(&[b"INFO", b"replication"], RESP_TIMEOUT)
                .ok()
                .and_then(|v| v.as_text())
                .unwrap_or_default();
            info.contains("role:master") || info.contains("master_link_status:up")
        })
    }

    /// The nodes as node `from` sees them (`CLUSTER NODES`); empty if it does not answer.
    pub fn view_from(&self, from: usize) -> Vec<NodeView> {
        let text = RedisTarget::port(self.ports[from])
            .command_timeout(&[b"CLUSTER", b"NODES"], RESP_TIMEOUT)
            .ok()
            .and_then(|v| v.as_text())
            .unwrap_or_default();
        let mut ids = Vec::new();
        let mut rows = Vec::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                continue;
            }
            let port: u16 = f[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            let Some(node) = self.ports.iter().position(|&p| p == port) else {
                continue;
            };
            ids.push((f[0].to_owned(), node));
            rows.push((node, f.clone().into_iter().map(str::to_owned).collect::<Vec<String>>()));
        }
        rows.into_iter()
            .map(|(node, f)| {
                let flags = &f[2];
                let master = flags.split(',').any(|x| x == "master");
                let replica_of = (!master)
                    .then(|| ids.iter().find(|(id, _)| *id == f[3]).map(|(_, n)| *n))
                    .flatten();
                let slots = f[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| {
                        let mut p = s.split('-');
                        let a: u16 = p.next()?.parse().ok()?;
                        let b: u16 = p.next().map_or(Some(a), |b| b.parse().ok())?;
                        Some((a, b))
                    })
                    .collect();
                NodeView {
                    node,
                    master,
                    replica_of,
                    failing: flags.split(',').any(|x| x == "fail" || x == "fail?"),
                    slots,
                }
            })
            .collect()
    }

    /// The running nodes' indexes.
    pub fn running(&self) -> Vec<usize> {
        (0..self.ports.len()).filter(|&n| self.is_running(n)).collect()
    }

    fn is_running(&self, node: usize) -> bool {
        self.processes.get(node).is_some_and(Option::is_some)
    }

    /// The node that is master of `slot` now, as the first running node sees it.
    pub fn master_of(&self, slot: u16) -> usize {
        let from = self.running()[0];
        self.view_from(from)
            .into_iter()
            .find(|v| v.master && !v.failing && v.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|v| v.node)
            .unwrap_or_else(|| panic!("no master for slot {slot}"))
    }

    /// The running masters, as the first running node sees them.
    pub fn masters(&self) -> Vec<usize> {
        let from = self.running()[0];
        let mut m: Vec<usize> = self
            .view_from(from)
            .into_iter()
            .filter(|v| v.master && !v.failing && !v.slots.is_empty())
            .map(|v| v.node)
            .collect();
        m.sort();
        m
    }

    /// The slot ranges of master `node`.
    pub fn slots_of(&self, node: usize) -> Vec<(u16, u16)> {
        let from = self.running()[0];
        self.view_from(from)
            .into_iter()
            .find(|v| v.node == node)
            .map(|v| v.slots)
            .unwrap_or_default()
    }

    /// A replica of master `node`.
    pub fn replica_of(&self, node: usize) -> usize {
        let from = self.running()[0];
        self.view_from(from)
            .into_iter()
            .find(|v| v.replica_of == Some(node) && !v.failing)
            .map(|v| v.node)
            .unwrap_or_else(|| panic!("no replica of node {node}"))
    }

    /// A coordinated failover: `CLUSTER FAILOVER` on `replica`, then waits until it is master
    /// and the cluster is ok again.
    pub fn failover(&self, replica: usize) {
        let answer = RedisTarget::port(self.ports[replica]).cmd(&[b"CLUSTER", b"FAILOVER"]);
        assert_eq!(answer.as_text().as_deref(), Some("OK"), "CLUSTER FAILOVER: {answer:?}");
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while !self.masters().contains(&replica) {
            assert!(Instant::now() < deadline, "no failover to {replica}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_ok(STARTUP_TIMEOUT);
    }

    /// `kill -9` of node `node` (a no-op when it is not running): its data is gone.
    pub fn kill(&mut self, node: usize) {
        // ChildGuard's drop kills (SIGKILL) and reaps.
        self.processes[node].take();
    }

    /// Stops node `node` (SIGSTOP): its connections stay open, nothing answers.
    pub fn pause(&self, node: usize) {
        let process = self.processes[node].as_ref().expect("pause: the node is not running");
        signal(process.id(), "STOP");
    }

    /// Lets a paused node go on (SIGCONT).
    pub fn resume(&self, node: usize) {
        let process = self.processes[node].as_ref().expect("resume: the node is not running");
        signal(process.id(), "CONT");
    }

    /// Starts node `node` again on its port with its cluster configuration, so it rejoins (a
    /// killed master as a replica of the node that took over); waits until it answers PING.
    pub fn restart(&mut self, node: usize) {
        self.kill(node);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            match self.spawn(node) {
                Ok(process) => {
                    self.processes[node] = Some(process);
                    return;
                }
                Err((_, true)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
                Err((why, _)) => panic!("cluster node {node} did not restart: {why}"),
            }
        }
    }

    fn logs(&self) -> String {
        self.processes
            .iter()
            .zip(&self.ports)
            .filter_map(|(p, port)| p.as_ref().map(|p| format!("---- node {port} ----\n{}", p.log_tail(30))))
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

    /// The keys starting with `prefix`, on any running node, that never expire (PTTL -1), sorted.
    pub fn keys_with_ttl_problems(&self, prefix: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .running()
            .into_iter()
            .flat_map(|n| keys_without_ttl(self.ports[n], prefix))
            .collect();
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
