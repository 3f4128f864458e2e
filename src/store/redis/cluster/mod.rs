//! Redis Cluster, one master at a time (docs/backends.md, "Cluster").
//!
//! fred's clustered client is one task for every node: when a node's connection drops, it
//! resynchronises with the whole cluster, and while the dead master is still listed in
//! `CLUSTER SLOTS` that fails and starts over, with every other command waiting meanwhile. One
//! lost master thus stopped the decisions on every slot for seconds. So tollgate keeps the slot
//! map itself ([`slots`]) and gives each master its own pool, lanes and breaker ([`nodes`]): a
//! call goes to its slot's master only, and a master that fails fails only the calls routed to
//! it, answered as [`StoreError::NodeFailed`], which the store-wide breaker does not count.
//!
//! The map comes from `CLUSTER SLOTS`, asked of a healthy master (else a replica, else a
//! configured URL): at connect, every couple of seconds, every [`FAST_REFRESH`] while a master
//! is failing or a slot has none, and at once (debounced) on a `MOVED`, a `CLUSTERDOWN` or a
//! failed call. A `MOVED` call is sent again to the node it names within the request's budget,
//! so a coordinated failover costs no request; an `ASK` is answered with `ASKING` and the call
//! on one connection; a `TRYAGAIN` is tried again shortly.

pub(crate) mod nodes;
pub(crate) mod slots;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use fred::clients::Client;
use fred::prelude::{Builder, ClientLike, Config, Server, ServerConfig};
use fred::types::{Key, Value};
use tokio::sync::Notify;

use self::nodes::{cluster_slots_on, redirect_of, Node, Redirect};
use self::slots::{parse_cluster_slots, Addr, Range, SlotMap};
use super::batch::{Answer, LaneSettings};
use super::script::CallSettings;
use super::{build_pool, keys, Conn, RedisSettings, Scripts};
use crate::core::clock::Clock;
use crate::store::{ConnectError, StoreError};
use crate::telemetry::ClusterMetrics;

/// How often the slot map is read again while every master answers.
const SLOW_REFRESH: Duration = Duration::from_secs(2);
/// How often while a master fails or a slot has none: the promotion of its replica is seen
/// within this of the moment the cluster made it.
pub(crate) const FAST_REFRESH: Duration = Duration::from_millis(100);
/// The least time between two refreshes, however many calls asked for one.
const MIN_GAP: Duration = Duration::from_millis(20);
/// Redirects one call follows (a `MOVED` then an `ASK` is the most a migration needs).
const MAX_REDIRECTS: usize = 5;
/// The pause before a `TRYAGAIN` call is sent again.
const TRYAGAIN_PAUSE: Duration = Duration::from_millis(10);

/// The masters now: the slot map and a node per master, indexed alike.
struct Topology {
    map: SlotMap,
    nodes: Vec<Arc<Node>>,
}

/// What the lanes of every node share.
struct LaneTemplate {
    clock: Arc<dyn Clock>,
    time_override: Option<Arc<dyn Clock>>,
    call: CallSettings,
}

/// The slots lost now (their master failing, or none known), for readiness.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterHealth {
    /// The lost slots, as ranges.
    pub lost: Vec<(u16, u16)>,
    /// The failing masters' addresses (for the log only).
    pub failing: Vec<String>,
    /// How many masters the map has.
    pub masters: usize,
}

impl ClusterHealth {
    /// How many of the 16384 slots are lost.
    pub fn lost_slots(&self) -> usize {
        slots::count(&self.lost)
    }

    /// The lost ranges for a person, naming no host: `5461-10922`.
    pub fn lost_ranges(&self) -> String {
        slots::describe(&self.lost)
    }
}

/// A Redis Cluster, master by master (see the module docs).
pub(crate) struct Cluster {
    settings: RedisSettings,
    /// The client configuration every node's pool starts from (credentials, TLS).
    template: Config,
    seeds: Vec<Addr>,
    lane: LaneTemplate,
    scripts: Scripts,
    topology: ArcSwap<Topology>,
    /// Nodes made for a redirect to a master the map does not name yet.
    spare: Mutex<Vec<Arc<Node>>>,
    wake: Arc<Notify>,
    refreshing: tokio::sync::Mutex<()>,
    refresher: AtomicBool,
    metrics: ClusterMetrics,
}

impl Cluster {
    /// A cluster reached first through `seeds`, its nodes' pools configured from `template`
    /// and `settings`; connects nothing.
    pub(crate) fn new(
        settings: &RedisSettings,
        template: Config,
        seeds: Vec<(String, u16)>,
        scripts: Scripts,
        clock: Arc<dyn Clock>,
        time_override: Option<Arc<dyn Clock>>,
        call: CallSettings,
    ) -> Cluster {
        Cluster {
            settings: settings.clone(),
            template,
            seeds: seeds.into_iter().map(|(host, port)| Addr { host, port }).collect(),
            lane: LaneTemplate {
                clock,
                time_override,
                call,
            },
            scripts,
            topology: ArcSwap::from_pointee(Topology {
                map: SlotMap::new(&[]),
                nodes: Vec::new(),
            }),
            spare: Mutex::new(Vec::new()),
            wake: Arc::new(Notify::new()),
            refreshing: tokio::sync::Mutex::new(()),
            refresher: AtomicBool::new(false),
            metrics: ClusterMetrics::new(),
        }
    }

    /// Tests only: the lanes send `clock`'s time instead of Redis `TIME` (see
    /// `RedisStore::with_time_override`). Before any node is made.
    pub(crate) fn set_time_override(&mut self, clock: Arc<dyn Clock>) {
        self.lane.time_override = Some(clock);
    }

    /// The scripts' SHA1s.
    pub(crate) fn scripts(&self) -> &Scripts {
        &self.scripts
    }

    fn config_for(&self, addr: &Addr) -> Config {
        let mut config = self.template.clone();
        config.server = ServerConfig::new_centralized(addr.host.clone(), addr.port);
        config
    }

    /// A node for `addr`, its pool built but not connected.
    fn make_node(&self, addr: &Addr) -> Result<Arc<Node>, String> {
        let pool = build_pool(
            &self.settings,
            self.config_for(addr),
            self.settings.command_timeout_ms.duration(),
        )
        .map_err(|e| format!("{addr}: {}", e.details()))?;
        let conn = Arc::new(Conn {
            pool,
            cluster: true,
            scripts: self.scripts.clone(),
            cross_slot: std::sync::atomic::AtomicBool::new(false),
            describe: format!("Redis Cluster node {addr}"),
        });
        let lane = LaneSettings {
            clock: self.lane.clock.clone(),
            time_override: self.lane.time_override.clone(),
            call: self.lane.call,
        };
        Ok(Arc::new(Node::new(
            addr.clone(),
            conn,
            lane,
            self.settings.breaker_policy(),
        )))
    }

    /// Connects a node made while running, in the background, and loads the scripts on it
    /// once it is up (a promoted replica may not have them).
    fn start_node(&self, node: &Arc<Node>) {
        if !node.start_connecting() {
            return;
        }
        let _tasks = node.conn.pool.connect_pool();
        let node = node.clone();
        let wait = self.settings.connect_timeout_ms.duration().max(Duration::from_secs(1));
        tokio::spawn(async move {
            if node.wait_connected(tokio::time::Instant::now() + wait).await.is_ok() {
                if let Err(e) = node.conn.load_scripts(Some(wait)).await {
                    tracing::warn!(node = %node.addr, error = %e, "could not load the scripts on a Redis Cluster node");
                }
            }
        });
    }

    /// The map from `CLUSTER SLOTS` at `addr`, on a connection of its own (a replica or a
    /// configured URL: no pool of ours goes there), within `timeout`.
    async fn slots_at(&self, addr: &Addr, timeout: Duration) -> Result<Vec<Range>, String> {
        let mut config = self.config_for(addr);
        config.fail_fast = true;
        let client = Builder::from_config(config)
            .with_connection_config(|c| {
                c.connection_timeout = timeout;
                c.internal_command_timeout = timeout;
                c.max_command_attempts = 1;
            })
            .with_performance_config(|p| p.default_command_timeout = timeout)
            .build()
            .map_err(|e| e.details().to_string())?;
        let asked = tokio::time::timeout(timeout, async {
            client.init().await?;
            cluster_slots_on(&client, timeout).await
        })
        .await;
        let _ = tokio::time::timeout(timeout, client.quit()).await;
        match asked {
            Ok(Ok(value)) => parse_cluster_slots(&value, &addr.host),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
        }
    }

    /// Makes `ranges` the map: nodes kept by address, new masters' nodes made (returned, not
    /// connected), masters no longer listed let go.
    fn install(&self, ranges: &[Range]) -> Result<Vec<Arc<Node>>, String> {
        let map = SlotMap::new(ranges);
        let old = self.topology.load_full();
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        let mut fresh = Vec::new();
        let mut nodes = Vec::with_capacity(map.masters().len());
        for addr in map.masters() {
            let known = old.nodes.iter().chain(spare.iter()).find(|n| n.addr == *addr).cloned();
            let node = match known {
                Some(n) => n,
                None => {
                    let n = self.make_node(addr)?;
                    fresh.push(n.clone());
                    n
                }
            };
            nodes.push(node);
        }
        let gone: Vec<Arc<Node>> = old
            .nodes
            .iter()
            .chain(spare.iter())
            .filter(|n| !nodes.iter().any(|m| Arc::ptr_eq(m, n)))
            .cloned()
            .collect();
        spare.clear();
        drop(spare);
        let changed = old.map.masters() != map.masters()
            || (0..map.masters().len()).any(|i| old.map.ranges_of(i) != map.ranges_of(i));
        if changed && !old.nodes.is_empty() {
            let masters: Vec<String> = map.masters().iter().map(ToString::to_string).collect();
            tracing::info!(masters = %masters.join(", "), "Redis Cluster slot map changed");
        }
        self.topology.store(Arc::new(Topology { map, nodes }));
        // Calls already on their way to a master let go answer first (a MOVED sends them on):
        // closing its connections at once left them unanswered until their deadline (two or
        // three requests of a coordinated failover timed out so).
        let linger = self.settings.command_timeout_ms.duration() + Duration::from_secs(1);
        for node in gone {
            tracing::info!(node = %node.addr, "Redis Cluster node no longer a master: closing its connections");
            tokio::spawn(async move {
                tokio::time::sleep(linger).await;
                let _ = node.conn.pool.quit().await;
            });
        }
        Ok(fresh)
    }

    /// Reads the map from the first configured URL that answers and connects every master's
    /// pool (each connection open when this returns `Ok`) and loads the scripts on each,
    /// within `timeout`; `fail_fast` makes a first connection that cannot be made an error at
    /// once. Starts the refresh task.
    ///
    /// Errors: no URL answered `CLUSTER SLOTS`, or a master could not be connected or prepared
    /// (a sentence naming it).
    pub(crate) async fn connect(self: &Arc<Self>, timeout: Duration, fail_fast: bool) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut why = String::from("no URL to ask");
        let mut ranges = None;
        for seed in &self.seeds {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.slots_at(seed, left).await {
                Ok(r) => {
                    ranges = Some(r);
                    break;
                }
                Err(e) => why = format!("{seed}: {e}"),
            }
        }
        let ranges = ranges.ok_or(why)?;
        if ranges.is_empty() {
            return Err("CLUSTER SLOTS lists no slot: is the cluster created?".into());
        }
        self.install(&ranges)?;
        let nodes = self.topology.load_full().nodes.clone();
        let prepared = futures_util::future::join_all(nodes.iter().map(|node| async move {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let first = node.start_connecting();
            let connected = if fail_fast && first {
                match tokio::time::timeout(left, node.conn.pool.init()).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("not reachable within {} ms", timeout.as_millis())),
                }
            } else {
                if first {
                    let _tasks = node.conn.pool.connect_pool();
                }
                node.wait_connected(deadline)
                    .await
                    .map_err(|e| format!("{e} (within {} ms)", timeout.as_millis()))
            };
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let loaded = match connected {
                Ok(()) => match tokio::time::timeout(left, node.conn.load_scripts(Some(left))).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("loading the scripts timed out".to_string()),
                },
                Err(e) => Err(e),
            };
            loaded.map_err(|e| format!("master {}: {e}", node.addr))
        }))
        .await;
        self.start_refresh();
        prepared.into_iter().collect::<Result<Vec<()>, String>>()?;
        let _ = self.update_metrics();
        Ok(())
    }

    /// Starts the task that keeps the map (once).
    fn start_refresh(self: &Arc<Self>) {
        if self.refresher.swap(true, Ordering::AcqRel) {
            return;
        }
        let cluster = Arc::downgrade(self);
        let wake = self.wake.clone();
        tokio::spawn(async move {
            loop {
                let period = match cluster.upgrade() {
                    Some(c) if c.health().lost.is_empty() => SLOW_REFRESH,
                    Some(_) => FAST_REFRESH,
                    None => return,
                };
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(period) => {}
                }
                let Some(c) = cluster.upgrade() else { return };
                c.refresh().await;
                c.probe_failing().await;
                let _ = c.update_metrics();
                drop(c);
                tokio::time::sleep(MIN_GAP).await;
            }
        });
    }

    /// Counts a master's failure that a fallback decided around (`timeout` or not) in the
    /// backend's errors, which the request's success hides from the store's own count.
    pub(crate) fn node_failed(&self, timeout: bool) {
        self.metrics.node_failed(timeout);
    }

    /// Probes the masters whose breaker is open, each when its probe is due.
    async fn probe_failing(&self) {
        let timeout = self.settings.connect_timeout_ms.duration().min(Duration::from_secs(1));
        let nodes = self.topology.load_full().nodes.clone();
        futures_util::future::join_all(nodes.iter().map(|n| n.probe_if_open(timeout))).await;
    }

    /// Asks for a refresh of the map soon (debounced).
    fn wake(&self) {
        self.wake.notify_one();
    }

    /// Reads the map again: from a healthy master, else a replica or a configured URL.
    async fn refresh(&self) {
        let _one = self.refreshing.lock().await;
        let timeout = self.settings.connect_timeout_ms.duration().min(Duration::from_secs(1));
        let topology = self.topology.load_full();
        let mut tried: Vec<&Addr> = Vec::new();
        let mut why = String::from("no node to ask");
        // Every healthy master at once (a few round trips in parallel), since they learn of a
        // promotion at different moments: the first map that no longer names a failing master
        // wins, else the first one read. (Asking one master, whose view could lag, let the
        // lost slots fail for a second or more after the promotion.)
        let healthy: Vec<&Arc<Node>> = topology
            .nodes
            .iter()
            .filter(|n| !n.failing() && n.connected())
            .collect();
        let failing: Vec<&Addr> = topology.nodes.iter().filter(|n| n.failing()).map(|n| &n.addr).collect();
        let answers = futures_util::future::join_all(healthy.iter().map(|n| n.cluster_slots(timeout))).await;
        let mut maps = Vec::new();
        for (node, answer) in healthy.iter().zip(answers) {
            tried.push(&node.addr);
            match answer
                .map_err(|e| e.to_string())
                .and_then(|v| parse_cluster_slots(&v, &node.addr.host))
            {
                Ok(ranges) if !ranges.is_empty() => maps.push(ranges),
                Ok(_) => why = format!("{}: no slot in CLUSTER SLOTS", node.addr),
                Err(e) => why = format!("{}: {e}", node.addr),
            }
        }
        let names_no_failing = |ranges: &Vec<Range>| ranges.iter().all(|r| !failing.contains(&&r.master));
        if let Some(ranges) = maps.iter().find(|r| names_no_failing(r)).or(maps.first()) {
            return self.installed(ranges);
        }
        let others: Vec<&Addr> = topology.map.replicas().iter().chain(&self.seeds).collect();
        for addr in others {
            if tried.contains(&addr) {
                continue;
            }
            tried.push(addr);
            match self.slots_at(addr, timeout).await {
                Ok(ranges) if !ranges.is_empty() => return self.installed(&ranges),
                Ok(_) => why = format!("{addr}: no slot in CLUSTER SLOTS"),
                Err(e) => why = format!("{addr}: {e}"),
            }
        }
        self.metrics.refresh(false);
        tracing::warn!(reason = %why, "Redis Cluster slot map not refreshed: no node answered");
    }

    fn installed(&self, ranges: &[Range]) {
        match self.install(ranges) {
            Ok(fresh) => {
                self.metrics.refresh(true);
                for node in &fresh {
                    self.start_node(node);
                }
            }
            Err(e) => {
                self.metrics.refresh(false);
                tracing::warn!(reason = %e, "Redis Cluster slot map not refreshed");
            }
        }
    }

    /// The node serving `slot`.
    fn owner(&self, slot: u16) -> Option<Arc<Node>> {
        let topology = self.topology.load();
        topology.map.owner(slot).and_then(|i| topology.nodes.get(i).cloned())
    }

    /// The node at `addr`: a master of the map, or one made for a redirect there.
    fn node_at(&self, addr: &Addr) -> Result<Arc<Node>, StoreError> {
        if let Some(n) = self.topology.load().nodes.iter().find(|n| n.addr == *addr) {
            return Ok(n.clone());
        }
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = spare.iter().find(|n| n.addr == *addr) {
            return Ok(n.clone());
        }
        let node = self
            .make_node(addr)
            .map_err(|e| StoreError::Unavailable(format!("Redis Cluster node {e}").into()))?;
        self.start_node(&node);
        spare.push(node.clone());
        Ok(node)
    }

    /// One request's call of the decision script on its slot's master, batched there, within
    /// `deadline`, following redirects (see the module docs).
    ///
    /// Errors: a refusal of the request's data ([`StoreError::Rejected`]) as it is; anything
    /// else as [`StoreError::NodeFailed`].
    pub(crate) async fn call(
        &self,
        keys: Vec<Key>,
        args: Vec<Value>,
        deadline: tokio::time::Instant,
    ) -> Result<Answer, StoreError> {
        let slot = keys.first().map_or(0, |k| keys::slot(k.as_bytes()));
        self.routed(slot, deadline, |node, asking| {
            let (keys, args) = (keys.clone(), args.clone());
            async move { node.call(keys, args, asking, deadline).await }
        })
        .await
    }

    /// `EVALSHA` of `sha` (peek, reset) on `slot`'s master, not batched, within `deadline`,
    /// following redirects. Errors: as [`Cluster::call`].
    pub(crate) async fn evalsha(
        &self,
        slot: u16,
        sha: &str,
        keys: Vec<Key>,
        argv: Vec<Value>,
        deadline: tokio::time::Instant,
    ) -> Result<Value, StoreError> {
        self.routed(slot, deadline, |node, asking| {
            let (keys, argv) = (keys.clone(), argv.clone());
            async move {
                let client = node.conn.pool.next();
                let call = async {
                    if asking {
                        node.conn.asking_evalsha_on(client, sha, keys, argv).await
                    } else {
                        node.conn.evalsha_on(client, sha, keys, argv).await
                    }
                };
                match tokio::time::timeout_at(deadline, call).await {
                    Ok(result) => result,
                    Err(_) => Err(StoreError::Timeout(
                        format!("no answer from Redis Cluster node {} in time", node.addr).into(),
                    )),
                }
            }
        })
        .await
    }

    /// Runs `call` on `slot`'s master, then wherever redirects send it.
    async fn routed<T, F: std::future::Future<Output = Result<T, StoreError>>>(
        &self,
        slot: u16,
        deadline: tokio::time::Instant,
        call: impl Fn(Arc<Node>, bool) -> F,
    ) -> Result<T, StoreError> {
        let mut next: Option<(Arc<Node>, bool)> = None;
        let mut last = None;
        for _ in 0..MAX_REDIRECTS {
            let (node, asking) = match next.take() {
                Some(n) => n,
                None => match self.owner(slot) {
                    Some(n) => (n, false),
                    None => {
                        self.wake();
                        return Err(node_failed(StoreError::Unavailable(
                            format!("no Redis Cluster master known for slot {slot}").into(),
                        )));
                    }
                },
            };
            let e = match call(node, asking).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            match redirect_of(&e) {
                Some(Redirect::Moved(to)) => {
                    self.metrics.redirect("moved");
                    self.wake();
                    next = Some((self.node_at(&to).map_err(node_failed)?, false));
                }
                Some(Redirect::Ask(to)) => {
                    self.metrics.redirect("ask");
                    next = Some((self.node_at(&to).map_err(node_failed)?, true));
                }
                Some(Redirect::TryAgain) if tokio::time::Instant::now() + TRYAGAIN_PAUSE < deadline => {
                    tokio::time::sleep(TRYAGAIN_PAUSE).await;
                }
                _ if matches!(e, StoreError::Rejected(_)) => return Err(e),
                _ => {
                    self.wake();
                    return Err(node_failed(e));
                }
            }
            last = Some(e);
        }
        Err(node_failed(last.unwrap_or_else(|| {
            StoreError::Unavailable(format!("too many Redis Cluster redirects for slot {slot}").into())
        })))
    }

    /// The slots lost now and the failing masters.
    pub(crate) fn health(&self) -> ClusterHealth {
        let topology = self.topology.load();
        let failing: Vec<bool> = topology.nodes.iter().map(|n| n.failing()).collect();
        ClusterHealth {
            lost: if topology.nodes.is_empty() {
                vec![(0, (slots::SLOTS - 1) as u16)]
            } else {
                topology.map.lost(&failing)
            },
            failing: topology
                .nodes
                .iter()
                .filter(|n| n.failing())
                .map(|n| n.addr.to_string())
                .collect(),
            masters: topology.nodes.len(),
        }
    }

    /// Sets the per-master and lost-slot gauges (on every refresh and readiness check, so
    /// `/metrics` and `/readyz` agree); the health they show.
    pub(crate) fn update_metrics(&self) -> ClusterHealth {
        let topology = self.topology.load();
        for (i, node) in topology.nodes.iter().enumerate() {
            if let Some(first) = topology.map.first_slot(i) {
                self.metrics.node_up(first, !node.failing() && node.was_up());
            }
        }
        let health = self.health();
        self.metrics.slots_failing(health.lost_slots());
        health
    }

    /// Whether the map is known and every master's pool has been up.
    pub(crate) fn is_connected(&self) -> bool {
        let topology = self.topology.load();
        !topology.nodes.is_empty() && topology.nodes.iter().all(|n| n.was_up())
    }

    /// One client of each master, for commands sent to every master (`CONFIG GET`).
    pub(crate) fn master_clients(&self) -> Vec<Client> {
        self.topology
            .load()
            .nodes
            .iter()
            .map(|n| n.conn.pool.next().clone())
            .collect()
    }

    /// Loads the scripts on every master that is up, within `timeout`: the probe of readiness.
    ///
    /// Errors: no master answered (the last error).
    pub(crate) async fn load_scripts(&self, timeout: Duration) -> Result<(), fred::prelude::Error> {
        let nodes = self.topology.load_full().nodes.clone();
        let mut last = None;
        let mut any = false;
        for node in nodes.iter().filter(|n| n.connected()) {
            match node.conn.load_scripts(Some(timeout)).await {
                Ok(()) => any = true,
                Err(e) => last = Some(e),
            }
        }
        match (any, last) {
            (true, _) => Ok(()),
            (false, Some(e)) => Err(e),
            (false, None) => Err(fred::prelude::Error::new(
                fred::prelude::ErrorKind::IO,
                "no Redis Cluster master connected",
            )),
        }
    }

    /// Closes every node's connections.
    pub(crate) async fn quit(&self) {
        let nodes = self.topology.load_full().nodes.clone();
        for node in nodes {
            let _ = node.conn.pool.quit().await;
        }
    }
}

/// Every URL's host and port: where a Cluster's slot map is first asked for.
///
/// Errors: a URL that does not parse (made by `fail`).
pub(super) fn seeds(
    settings: &RedisSettings,
    fail: &impl Fn(String) -> ConnectError,
) -> Result<Vec<(String, u16)>, ConnectError> {
    let mut hosts = Vec::new();
    for url in &settings.urls {
        let c = Config::from_url(url).map_err(|e| fail(e.details().to_string()))?;
        hosts.extend(
            c.server
                .hosts()
                .into_iter()
                .map(|s: Server| (s.host.to_string(), s.port)),
        );
    }
    Ok(hosts)
}

/// `e` as the failure of one node (a refusal of the request's data stays what it is).
fn node_failed(e: StoreError) -> StoreError {
    match e {
        e @ (StoreError::Rejected(_) | StoreError::NodeFailed(_)) => e,
        e => StoreError::NodeFailed(Box::new(e)),
    }
}
