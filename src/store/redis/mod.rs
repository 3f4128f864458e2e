//! The Redis store (docs/backends.md): bucket state shared by every tollgate replica, decided by a Lua
//! script (`lua/decide.lua`) that reads Redis `TIME`, refills, checks and consumes from all of a
//! request's buckets or none, atomically. Concurrent requests share a call (`batch`; in
//! Cluster mode, those of one slot); each is still decided on its own.
//!
//! **Time.** Refill uses Redis time, so replicas with skewed clocks agree (docs/backends.md).
//! Schedules and quotas are evaluated here in Rust, at an estimate of Redis time: the local
//! clock plus the offset to Redis `TIME` measured on the previous answer ([`ClockOffset`]).
//! The script is told over which interval `[lo, hi)` of Redis time the limit it is given holds,
//! and answers "retry" with Redis time when its clock falls outside, so a wrong estimate costs a
//! second call, never a decision under the wrong limit. A scheduled bucket crossed by a change
//! of limit since its last write is walked over the changes here (the script answers "walk"
//! with its stored value; tollgate brings it forward to the last change and calls again with
//! the value it expects, compare-and-set): the first decision on such a bucket after each
//! change costs two calls, every other decision one.
//!
//! **Keys** (see [`keys`]) expire between one and two margins ([`TTL_MARGIN_MS`]) after the
//! bucket would be full again: a write keeps the key's expiry (recorded in its value) while it
//! lies in that range, which spares Redis most expiry updates; a full bucket is deleted. In Cluster mode a request's buckets may lie in several slots: one script
//! call per slot, in parallel (each batched with other requests on that slot); if any denies, what the others consumed is refunded at once (a
//! brief under-admission, never an over-admission). Each slot's call goes to its master
//! through that master's own pool, lanes and breaker (`cluster`): a master that fails fails
//! only its slots' part ([`StoreError::NodeFailed`]), which a fallback may decide instead
//! ([`Store::apply_or_fall_back`]).

pub(crate) mod batch;
mod cluster;
pub mod keys;
pub mod script;
mod sentinel;
mod settings;
mod slotted;

pub use cluster::ClusterHealth;
pub use settings::{FallbackBackend, RedisSettings, SentinelSettings};

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fred::bytes::Bytes;
use fred::clients::Client;
use fred::prelude::{
    Builder, ClientLike, Config, Error as FredError, ErrorKind, EventInterface, LuaInterface, Pool, ReconnectPolicy,
    Server, ServerConfig, TlsConnector,
};
use fred::types::{Key, Value};

use self::batch::{Answer, Batcher, Job, LaneSettings};
use self::script::{
    bucket_args, encode_lean, encode_request, lean_limits, parse_lean, parse_reply, parse_value, replacement,
    BucketArgs, CallSettings, LeanReply, Replacement, Reply,
};
use self::slotted::NoFallback;
use super::{redact_url, UnreachableAtStart};
use super::{Applied, BucketRef, Cause, ConnectError, Peeked, Store, StoreError};
use crate::core::bucket::{decide, BucketState, Decision, Demand, DemandKind, Limit};
use crate::core::clock::Clock;

/// The decision script.
pub const DECIDE_LUA: &str = include_str!("../../../lua/decide.lua");
/// The Cluster form of the decision script: lean requests of several slots of one master in one
/// call (`lua/cross_slot.lua`, then `lua/decide.lua`); Redis 7.0 or later.
pub const DECIDE_CROSS_SLOT_LUA: &str = concat!(
    "#!lua flags=allow-cross-slot-keys\n",
    include_str!("../../../lua/cross_slot.lua"),
    include_str!("../../../lua/decide.lua")
);
/// The peek script.
pub const PEEK_LUA: &str = include_str!("../../../lua/peek.lua");
/// The reset script.
pub const RESET_LUA: &str = include_str!("../../../lua/reset.lua");

/// The margin of a key's expiry: a key outlives the instant its bucket is full by one to two
/// margins, so expiry never comes early by ms rounding or a slow clock, and a write can keep
/// the expiry it finds while that stays in range (`lua/decide.lua`).
pub const TTL_MARGIN_MS: u64 = 1_000;

/// The time to live of a key whose bucket's full time is not known: 0, no expiry. Such a
/// bucket (a schedule whose refill is not found within the look-ahead of
/// [`crate::core::schedule::DEFAULT_HORIZON_US`] and [`crate::core::schedule::MAX_CHANGES_AHEAD`]) is
/// kept until a write finds it full, as the memory and Postgres stores keep theirs: forgetting
/// it at any fixed age could forget a bucket not yet full (it once was 400 days, while rules
/// accept a 10-year fill). A known full time, however far, is the key's expiry.
pub const UNKNOWN_TTL_MS: u64 = 0;

/// Calls one decision may make: a retry for a wrong time estimate and a walk over changes of
/// limit each cost one more.
const MAX_ATTEMPTS: usize = 4;

/// How often [`RedisStore::connect`] looks again at whether its connections are up, in case a
/// connect notification was missed.
const CONNECT_RECHECK: Duration = Duration::from_millis(50);

/// The offset from the local clock to Redis `TIME`, in microseconds, learned from each answer.
#[derive(Debug, Default)]
pub struct ClockOffset(AtomicI64);

impl ClockOffset {
    /// Redis time now, estimated from the local clock reading `local_us`.
    pub fn estimate(&self, local_us: u64) -> u64 {
        local_us.saturating_add_signed(self.0.load(Ordering::Relaxed))
    }

    /// Records that Redis answered `redis_us` to a call sent at local `sent_us` and answered at
    /// local `received_us`: the offset is taken against the middle of the round trip.
    pub fn observe(&self, redis_us: u64, sent_us: u64, received_us: u64) {
        let mid = sent_us / 2 + received_us / 2;
        let offset = i64::try_from(i128::from(redis_us) - i128::from(mid)).unwrap_or(0);
        self.0.store(offset, Ordering::Relaxed);
    }

    /// The offset in microseconds (Redis minus local).
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The scripts, by SHA1.
#[derive(Clone)]
struct Scripts {
    decide: String,
    /// [`DECIDE_CROSS_SLOT_LUA`]: loaded on Cluster masters only.
    cross_slot: String,
    peek: String,
    reset: String,
}

/// The Redis store. Cheap to clone; clones share the connections.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

/// The connections to one Redis (a single node, or one master of a Cluster) and what every
/// call on them needs; shared with the batch lanes, which must not keep the store itself alive.
struct Conn {
    pool: Pool,
    /// A master of a Cluster: a call carries the requests of one slot only, but for lean ones
    /// when `cross_slot` holds.
    cluster: bool,
    scripts: Scripts,
    /// Whether [`DECIDE_CROSS_SLOT_LUA`] loaded (a Cluster master of Redis 7.0 or later), so
    /// lean requests of different slots share calls.
    cross_slot: std::sync::atomic::AtomicBool,
    /// The URLs, passwords redacted.
    describe: String,
}

/// One Redis, or a Cluster master by master.
enum Backend {
    /// A single node: its pool, and its lanes (started on the first decision: they need the
    /// runtime).
    Single {
        conn: Arc<Conn>,
        batcher: OnceLock<Batcher>,
    },
    /// A Redis Cluster: a pool, lanes and a breaker per master (`cluster`).
    Cluster(Arc<cluster::Cluster>),
}

struct Inner {
    backend: Backend,
    /// The URLs, passwords redacted.
    describe: String,
    prefix: String,
    /// The local clock, to estimate Redis time between answers.
    clock: Arc<dyn Clock>,
    offset: ClockOffset,
    /// Tests only: use this clock's time instead of Redis `TIME` (see [`RedisStore::with_time_override`]).
    time_override: Option<Arc<dyn Clock>>,
    /// Whether requests that can take the lean form do ([`RedisStore::general_form_only`]).
    lean: bool,
    call: CallSettings,
    /// How long one decision may take, all calls included.
    timeout: Duration,
    /// Whether a first connection that fails is an error at once (`unreachable_at_start: exit`).
    fail_fast: bool,
    /// What `maxmemory-policy` showed at connect ([`RedisStore::eviction_warning`]).
    eviction: std::sync::Mutex<Option<String>>,
    /// The sentinels that name the master, when there are (`redis.sentinel`).
    sentinel: Option<SentinelSettings>,
    /// Whether the sentinels speak TLS: `rediss://` sentinel URLs, or `redis.tls`, which the
    /// client applies to the sentinels and the master alike.
    sentinel_tls: bool,
    /// Whether the scripts have been loaded since start ([`RedisStore::is_warm`]).
    warm: std::sync::atomic::AtomicBool,
}

/// The policy in an answer to `CONFIG GET maxmemory-policy`: a name and value pair (RESP2) or
/// a map (RESP3).
fn policy_of(answer: Value) -> Option<String> {
    match answer {
        Value::Array(items) => items.get(1).and_then(|v| v.as_string()),
        Value::Map(map) => map.inner().into_iter().next().and_then(|(_, v)| v.as_string()),
        _ => None,
    }
}

/// A client's stream of connection errors.
type ErrorStream = tokio::sync::broadcast::Receiver<(FredError, Option<Server>)>;

/// The last error any of `streams` received since it was subscribed (or last read).
fn last_error(streams: &mut [ErrorStream]) -> Option<FredError> {
    let mut last = None;
    for rx in streams.iter_mut() {
        loop {
            match rx.try_recv() {
                Ok((e, _)) => last = Some(e),
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => {}
                Err(_) => break,
            }
        }
    }
    last
}

fn store_error(e: &FredError) -> StoreError {
    let details = e.details();
    // The scripts' own complaints about a stored value, and a key of another type.
    if details.contains("tollgate: bad") || details.contains("WRONGTYPE") {
        return StoreError::Rejected(Cause::from_error(e.clone()));
    }
    match e.kind() {
        ErrorKind::Timeout => StoreError::Timeout(Cause::from_error(e.clone())),
        _ => StoreError::Unavailable(Cause::from_error(e.clone())),
    }
}

impl Conn {
    async fn load_scripts(&self, timeout: Option<Duration>) -> Result<(), FredError> {
        // Each `SCRIPT LOAD` within `timeout` when given, not the decisions' few milliseconds
        // (`default_command_timeout`): at start and in readiness probes a busy machine or a
        // distant Redis may take longer than one decision may, and that is no failure (a
        // connect once timed out so, with Redis answering, on a loaded test machine). `None`:
        // the default, for the reload inside a decision. fred's script commands ignore
        // per-command options, so `SCRIPT LOAD` is sent as a custom command, which takes them
        // (a Cluster's masters each have a pool of their own: this loads on one master).
        let client = self.pool.next();
        for lua in [DECIDE_LUA, PEEK_LUA, RESET_LUA] {
            let options = fred::types::config::Options {
                timeout,
                ..Default::default()
            };
            let load = fred::types::CustomCommand::new_static("SCRIPT", fred::types::ClusterHash::Random, false);
            client
                .with_options(&options)
                .custom::<Value, _>(load, vec!["LOAD", lua])
                .await?;
        }
        if self.cluster {
            let options = fred::types::config::Options {
                timeout,
                ..Default::default()
            };
            let load = fred::types::CustomCommand::new_static("SCRIPT", fred::types::ClusterHash::Random, false);
            let loaded = client
                .with_options(&options)
                .custom::<Value, _>(load, vec!["LOAD", DECIDE_CROSS_SLOT_LUA])
                .await;
            // Before Redis 7.0 (no script flags) it does not load: calls stay one slot each.
            if let Err(e) = &loaded {
                tracing::info!(redis = %self.describe, error = %e, "the Cluster form of the decision script did not load; calls carry one slot each");
            }
            self.cross_slot.store(loaded.is_ok(), Ordering::Relaxed);
        }
        Ok(())
    }

    /// `EVALSHA` on the pool's next connection.
    async fn evalsha(&self, sha: &str, keys: Vec<Key>, argv: Vec<Value>) -> Result<Value, StoreError> {
        self.evalsha_on(self.pool.next(), sha, keys, argv).await
    }

    /// `EVALSHA` on `client`, loading the scripts again when Redis has lost them (`NOSCRIPT`: a
    /// restart, `SCRIPT FLUSH`, a failover).
    async fn evalsha_on(
        &self,
        client: &Client,
        sha: &str,
        keys: Vec<Key>,
        argv: Vec<Value>,
    ) -> Result<Value, StoreError> {
        match client.evalsha::<Value, _, _, _>(sha, keys.clone(), argv.clone()).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                tracing::info!(redis = %self.describe, "Redis lost the scripts; loading them again");
                self.load_scripts(None).await.map_err(|e| store_error(&e))?;
                client
                    .evalsha::<Value, _, _, _>(sha, keys, argv)
                    .await
                    .map_err(|e| store_error(&e))
            }
            other => other.map_err(|e| store_error(&e)),
        }
    }
}

/// The client configuration for `settings`, whose first URL is `first`: that node (a Cluster's
/// masters each get a copy, addressed to them; a Unix socket; or the sentinels that name the
/// master), the credentials, TLS and whether to fail fast.
///
/// Errors: a URL that does not parse, or TLS that cannot be set up (made by `fail`).
fn client_config(
    settings: &RedisSettings,
    first: &str,
    fail: &impl Fn(String) -> ConnectError,
) -> Result<Config, ConnectError> {
    let mut config = match (sentinel::config(&settings.sentinel), settings::unix_socket(first)) {
        (Some(config), _) => config.map_err(fail)?,
        (None, Some(unix)) => {
            let (path, database) = unix.map_err(fail)?;
            Config {
                server: ServerConfig::new_unix_socket(path),
                database,
                ..Config::default()
            }
        }
        (None, None) => Config::from_url(first).map_err(|e| fail(e.details().to_string()))?,
    };
    if settings.username.is_some() {
        config.username = settings.username.clone();
    }
    if settings.password.is_some() {
        config.password = settings.password.clone();
    }
    if settings.tls && config.tls.is_none() {
        let tls = TlsConnector::default_rustls().map_err(|e| fail(format!("TLS: {}", e.details())))?;
        config.tls = Some(tls.into());
    }
    // Failing fast makes a first connection that cannot be made an error at once (`exit`
    // names the reason); a server that may start without Redis instead keeps its first
    // connection attempts going under the reconnect policy, like every later one.
    config.fail_fast = settings.unreachable_at_start == UnreachableAtStart::Exit;
    Ok(config)
}

/// The connection pool over `config`, its commands bounded by `timeout`; connects nothing.
fn build_pool(settings: &RedisSettings, config: Config, timeout: Duration) -> Result<Pool, FredError> {
    Builder::from_config(config)
        .with_connection_config(|c| {
            c.connection_timeout = settings.connect_timeout_ms.duration();
            c.internal_command_timeout = Duration::from_millis(settings.connect_timeout_ms.0.max(100));
            c.max_command_attempts = 1;
            c.tcp.nodelay = Some(true);
        })
        .with_performance_config(|p| {
            p.default_command_timeout = timeout;
        })
        // Reconnect forever, every 200 ms: an outage ends by itself.
        .set_policy(ReconnectPolicy::new_constant(0, 200))
        .build_pool(settings.pool_size)
}

impl RedisStore {
    /// Builds the connection pool for `settings` without connecting; [`RedisStore::connect`]
    /// connects. `clock` is the local clock, used only to estimate Redis time.
    ///
    /// Errors: a URL that does not parse, or TLS that cannot be set up.
    pub fn new(settings: &RedisSettings, clock: Arc<dyn Clock>) -> Result<RedisStore, ConnectError> {
        let first = settings.urls.first().map(String::as_str).unwrap_or_default();
        let shown = if settings.sentinel.enabled() {
            sentinel::describe(&settings.sentinel)
        } else {
            redact_url(first)
        };
        let fail = |reason: String| ConnectError {
            backend: "Redis",
            url: shown.clone(),
            reason,
        };
        let config = client_config(settings, first, &fail)?;
        let config_fail_fast = config.fail_fast;
        let timeout = settings.command_timeout_ms.duration();
        let sha = |lua: &str| fred::util::sha1_hash(lua);
        let scripts = Scripts {
            decide: sha(DECIDE_LUA),
            cross_slot: sha(DECIDE_CROSS_SLOT_LUA),
            peek: sha(PEEK_LUA),
            reset: sha(RESET_LUA),
        };
        let describe = if settings.sentinel.enabled() {
            sentinel::describe(&settings.sentinel)
        } else {
            settings
                .urls
                .iter()
                .map(|u| redact_url(u))
                .collect::<Vec<_>>()
                .join(",")
        };
        let call = CallSettings {
            ttl_margin_ms: TTL_MARGIN_MS,
            unknown_ttl_ms: UNKNOWN_TTL_MS,
        };
        let backend = if settings.cluster {
            let seeds = cluster::seeds(settings, &fail)?;
            Backend::Cluster(Arc::new(cluster::Cluster::new(
                settings,
                config,
                seeds,
                scripts,
                clock.clone(),
                None,
                call,
            )))
        } else {
            let pool = build_pool(settings, config, timeout).map_err(|e| fail(e.details().to_string()))?;
            Backend::Single {
                conn: Arc::new(Conn {
                    pool,
                    cluster: false,
                    scripts,
                    cross_slot: std::sync::atomic::AtomicBool::new(false),
                    describe: describe.clone(),
                }),
                batcher: OnceLock::new(),
            }
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                backend,
                describe,
                prefix: settings.key_prefix.clone(),
                clock,
                offset: ClockOffset::default(),
                time_override: None,
                lean: true,
                call,
                timeout,
                fail_fast: config_fail_fast,
                eviction: std::sync::Mutex::new(None),
                sentinel: settings.sentinel.enabled().then(|| settings.sentinel.clone()),
                sentinel_tls: settings.sentinel.tls() || settings.tls,
                warm: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Tests only: decide at `clock`'s time instead of Redis `TIME` (sent to the scripts as an
    /// argument), so the shared test vectors can move time. Must be called before any clone.
    pub fn with_time_override(mut self, clock: Arc<dyn Clock>) -> RedisStore {
        let inner = Arc::get_mut(&mut self.inner).expect("with_time_override before the store is shared");
        if let Backend::Cluster(c) = &mut inner.backend {
            Arc::get_mut(c)
                .expect("with_time_override before the store is shared")
                .set_time_override(clock.clone());
        }
        inner.time_override = Some(clock);
        self
    }

    /// Tests only: every request in the general form of the script, as before the lean form,
    /// so that the shared test vectors check both forms. Must be called before any clone.
    pub fn general_form_only(mut self) -> RedisStore {
        Arc::get_mut(&mut self.inner)
            .expect("general_form_only before the store is shared")
            .lean = false;
        self
    }

    /// The Cluster, in Cluster mode.
    fn cluster(&self) -> Option<&Arc<cluster::Cluster>> {
        match &self.inner.backend {
            Backend::Cluster(c) => Some(c),
            Backend::Single { .. } => None,
        }
    }

    /// The slots of a Redis Cluster lost now (their master failing, or none known) and the
    /// failing masters; `None` on a single node.
    pub fn cluster_health(&self) -> Option<ClusterHealth> {
        self.cluster().map(|c| c.update_metrics())
    }

    /// Connects and loads the scripts, waiting at most `timeout`.
    ///
    /// Errors: Redis not reachable in time, authentication refused, or a script Redis rejects.
    pub async fn connect(&self, timeout: Duration) -> Result<(), ConnectError> {
        let fail = |reason: String| ConnectError {
            backend: "Redis",
            url: self.inner.describe.clone(),
            reason,
        };
        let conn = match &self.inner.backend {
            Backend::Single { conn, .. } => conn,
            Backend::Cluster(c) => {
                c.connect(timeout, self.inner.fail_fast).await.map_err(fail)?;
                self.inner.warm.store(true, Ordering::Release);
                self.check_eviction(timeout).await;
                return Ok(());
            }
        };
        if self.inner.fail_fast {
            // fred would say only "Failed to connect to all sentinel nodes" or "Missing primary
            // address"; this names the master and the sentinels asked.
            match self.check_sentinels(timeout).await {
                Some(sentinel::MasterCheck::Unknown(why) | sentinel::MasterCheck::Unreachable(why)) => {
                    return Err(fail(why))
                }
                Some(sentinel::MasterCheck::Known) | None => {}
            }
        }
        let pool = &conn.pool;
        let deadline = tokio::time::Instant::now() + timeout;
        // Every client's error stream is subscribed before its connection starts, so a
        // timeout can still say what went wrong meanwhile (refused, reset) instead of only
        // "not reachable".
        let mut errors: Vec<_> = pool.clients().iter().map(|c| c.error_rx()).collect();
        let not_reachable = |errors: &mut [ErrorStream]| {
            let within = format!("not reachable within {} ms", timeout.as_millis());
            match last_error(errors) {
                Some(e) => fail(format!("{within} (last error: {e})")),
                None => fail(within),
            }
        };
        if self.inner.fail_fast {
            // `init` subscribes to each client's connect notification before it starts the
            // client, so the first attempt's own error (a refused password, an unknown host)
            // always reaches it and wins over the timeout. (Starting the clients and then
            // waiting, as before, lost an error that came before the wait began: `serve` then
            // said "not reachable" for a wrong password.)
            match tokio::time::timeout_at(deadline, pool.init()).await {
                Ok(Ok(_task)) => {}
                Ok(Err(e)) => return Err(fail(e.to_string())),
                Err(_) => return Err(not_reachable(&mut errors)),
            }
        } else {
            let _tasks = pool.connect_pool();
            // Without fail_fast a failed attempt is retried, never announced, so this waits for
            // the connections to come up. fred's `wait_for_connect` reads a client's state, then
            // subscribes to its connect notification: a connection that comes up in between is
            // never announced to it (about one connect in 600 here), so the wait is renewed
            // every CONNECT_RECHECK and a client already up answers at once.
            loop {
                let step = deadline.min(tokio::time::Instant::now() + CONNECT_RECHECK);
                match tokio::time::timeout_at(step, pool.wait_for_connect()).await {
                    Ok(Ok(())) => break,
                    Ok(Err(e)) => return Err(fail(e.to_string())),
                    Err(_) if step >= deadline => return Err(not_reachable(&mut errors)),
                    Err(_) => {}
                }
            }
        }
        tokio::time::timeout(timeout, conn.load_scripts(Some(timeout)))
            .await
            .map_err(|_| fail("loading the scripts timed out".into()))?
            .map_err(|e| fail(e.to_string()))?;
        self.inner.warm.store(true, Ordering::Release);
        self.check_eviction(timeout).await;
        Ok(())
    }

    /// What the sentinels say of the master (`None` without Sentinel): see
    /// [`sentinel::check_master`].
    async fn check_sentinels(&self, timeout: Duration) -> Option<sentinel::MasterCheck> {
        let settings = self.inner.sentinel.as_ref()?;
        Some(sentinel::check_master(settings, self.inner.sentinel_tls, timeout).await)
    }

    /// Fails when the sentinels of `redis.sentinel` answer but none knows the master's name: a
    /// setting to fix, which stops start-up whatever `unreachable_at_start` says (retrying
    /// cannot help). Sentinels that cannot be reached are an outage, not this error. With
    /// `unreachable_at_start: exit` this does nothing: [`RedisStore::connect`] asks them then.
    ///
    /// Errors: the message names the master and the sentinels asked, never a password.
    pub async fn check_sentinel_master(&self, timeout: Duration) -> Result<(), ConnectError> {
        if self.inner.fail_fast {
            return Ok(());
        }
        match self.check_sentinels(timeout).await {
            Some(sentinel::MasterCheck::Unknown(reason)) => Err(ConnectError {
                backend: "Redis",
                url: self.inner.describe.clone(),
                reason,
            }),
            _ => Ok(()),
        }
    }

    /// Whether the store is ready for its first decisions: the scripts loaded (on every
    /// master of a Cluster) and, by then, every connection of the pool opened. Readiness waits
    /// for it, so the first decisions after start do not pay a connection or a `NOSCRIPT`
    /// reload under `command_timeout_ms` and fail.
    pub fn is_warm(&self) -> bool {
        self.inner.warm.load(Ordering::Acquire)
    }

    /// Reads `maxmemory-policy` on every node (`CONFIG GET`) and records, and logs, whether
    /// Redis may evict tollgate's keys: an evicted drained bucket comes back full, an
    /// over-admission. Every key of tollgate's has an expiry (but for buckets whose full time is
    /// unknown), so `volatile-*` policies evict them as `allkeys-*` do; only `noeviction` is safe
    /// (docs/backends.md). A Redis that refuses `CONFIG` (many managed ones) is reported as not
    /// checked. Never fails: the decisions do not depend on it.
    async fn check_eviction(&self, timeout: Duration) {
        let clients: Vec<Client> = match &self.inner.backend {
            Backend::Single { conn, .. } => vec![conn.pool.next().clone()],
            Backend::Cluster(c) => c.master_clients(),
        };
        let mut evicting = std::collections::BTreeSet::new();
        let mut unchecked = None;
        for client in clients {
            let options = fred::types::config::Options {
                timeout: Some(timeout),
                ..Default::default()
            };
            let get = fred::types::CustomCommand::new_static("CONFIG", fred::types::ClusterHash::Random, false);
            let answer = client
                .with_options(&options)
                .custom::<Value, _>(get, vec!["GET", "maxmemory-policy"])
                .await;
            match answer.map(policy_of) {
                Ok(Some(policy)) if policy == "noeviction" => {}
                Ok(Some(policy)) => {
                    evicting.insert(policy);
                }
                Ok(None) => unchecked = Some("no policy in the answer".to_string()),
                Err(e) => unchecked = Some(e.details().chars().take(80).collect()),
            }
        }
        let warning = if !evicting.is_empty() {
            let policies: Vec<String> = evicting.into_iter().collect();
            Some(format!(
                "Redis maxmemory-policy {} can evict buckets (an evicted bucket admits again); use noeviction",
                policies.join(",")
            ))
        } else {
            unchecked.map(|why| format!("Redis maxmemory-policy not checked ({why})"))
        };
        match &warning {
            Some(w) => tracing::warn!(redis = %self.describe(), "{w}"),
            None => tracing::info!(redis = %self.describe(), "Redis maxmemory-policy is noeviction"),
        }
        *self.inner.eviction.lock().unwrap_or_else(|p| p.into_inner()) = warning;
    }

    /// Why Redis may lose tollgate's keys to eviction, as found at connect: a short sentence
    /// naming the `maxmemory-policy` (no host), or that it could not be checked; `None` when
    /// every node has `noeviction` (or before the first connect). Readiness shows it.
    pub fn eviction_warning(&self) -> Option<String> {
        self.inner.eviction.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits in the background until the connections started by [`RedisStore::connect`] are
    /// up (they keep trying under the reconnect policy), then loads the scripts: for a server
    /// that starts not ready (`unreachable_at_start: not_ready`).
    pub fn connect_in_background(&self, retry: Duration) {
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                let wait = retry.max(Duration::from_secs(1));
                let ready = match &store.inner.backend {
                    Backend::Single { conn, .. } => {
                        let connected = tokio::time::timeout(retry, conn.pool.wait_for_connect()).await;
                        matches!(connected, Ok(Ok(()))) && conn.load_scripts(Some(wait)).await.is_ok()
                    }
                    Backend::Cluster(c) => c.connect(wait, false).await.is_ok(),
                };
                if ready {
                    tracing::info!(redis = %store.describe(), "connected to Redis");
                    store.inner.warm.store(true, Ordering::Release);
                    store.check_eviction(retry.max(Duration::from_secs(1))).await;
                    return;
                }
                tokio::time::sleep(retry).await;
            }
        });
    }

    /// Loads the scripts again (`SCRIPT LOAD` is idempotent), waiting at most `timeout`: the
    /// probe readiness sends while the circuit is open. A Redis that was restarted has lost
    /// them, and loading them here spares the first request after the outage a `NOSCRIPT`
    /// round trip that could exceed its command timeout.
    ///
    /// Errors: no answer in time, or an error answer.
    pub async fn probe(&self, timeout: Duration) -> Result<(), StoreError> {
        let loaded = async {
            match &self.inner.backend {
                Backend::Single { conn, .. } => conn.load_scripts(Some(timeout)).await,
                Backend::Cluster(c) => c.load_scripts(timeout).await,
            }
        };
        match tokio::time::timeout(timeout, loaded).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(store_error(&e)),
            Err(_) => Err(StoreError::Timeout(
                format!("scripts not loaded within {} ms", timeout.as_millis()).into(),
            )),
        }
    }

    /// Closes the pool's connections (`QUIT`) and stops their reconnecting: the store decides
    /// nothing afterwards. For a process that opens stores one after another (tests); `serve`
    /// keeps its one store until it exits.
    pub async fn quit(&self) {
        // An error here is a connection that was already gone: closed either way.
        match &self.inner.backend {
            Backend::Single { conn, .. } => {
                let _ = conn.pool.quit().await;
            }
            Backend::Cluster(c) => c.quit().await,
        }
    }

    /// How long one decision may take, all calls included (`redis.command_timeout_ms`).
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Whether every connection of the pool is up (a Cluster: its slot map is known and every
    /// master's pool has been up).
    pub fn is_connected(&self) -> bool {
        match &self.inner.backend {
            Backend::Single { conn, .. } => conn.pool.clients().iter().all(|c| c.is_connected()),
            Backend::Cluster(c) => c.is_connected(),
        }
    }

    /// The offset from the local clock to Redis time, as last measured (microseconds).
    pub fn clock_offset_us(&self) -> i64 {
        self.inner.offset.get()
    }

    /// The URLs, passwords redacted, for logs.
    pub fn describe(&self) -> &str {
        &self.inner.describe
    }

    fn now_override(&self) -> Option<u64> {
        self.inner.time_override.as_ref().map(|c| c.now_us())
    }

    fn estimate(&self) -> u64 {
        self.now_override()
            .unwrap_or_else(|| self.inner.offset.estimate(self.inner.clock.now_us()))
    }

    /// One request's call of the decision script (one slot's part of it in Cluster mode, sent
    /// to its master within `deadline`), batched with concurrent requests ([`batch`]).
    async fn call_decide(
        &self,
        keys: Vec<Key>,
        args: Vec<Value>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Answer, StoreError> {
        let (conn, batcher) = match &self.inner.backend {
            Backend::Single { conn, batcher } => (conn, batcher),
            Backend::Cluster(c) => {
                let deadline = deadline.unwrap_or_else(|| tokio::time::Instant::now() + self.inner.timeout);
                // Boxed, as every Cluster-only path here: a single node's decision future (moved
                // at every request) must not grow by what it never runs.
                return Box::pin(c.call(keys, args, deadline)).await;
            }
        };
        let batcher = batcher.get_or_init(|| {
            Batcher::start(
                conn.clone(),
                LaneSettings {
                    clock: self.inner.clock.clone(),
                    time_override: self.inner.time_override.clone(),
                    call: self.inner.call,
                },
            )
        });
        let (reply, answer) = tokio::sync::oneshot::channel();
        batcher.submit(Job {
            keys,
            args,
            asking: false,
            reply,
            origin: crate::store::round_trip::origin(),
        })?;
        answer
            .await
            .map_err(|_| StoreError::Unavailable("the Redis store is shutting down".into()))?
    }

    /// Decides the buckets of one slot (all of them on a single node); in Cluster mode every
    /// call within `deadline`.
    async fn decide_group(
        &self,
        buckets: &[&BucketRef],
        demands: &[Demand],
        deadline: Option<tokio::time::Instant>,
    ) -> Result<script::Decided, StoreError> {
        // Keys are reference-counted bytes: a retry or a batch moves them, never copies.
        let keys: Vec<Key> = buckets
            .iter()
            .map(|b| Key::from(Bytes::from(keys::bucket_key(&self.inner.prefix, &b.key))))
            .collect();
        if let Some(limits) = lean_limits(buckets.iter().map(|b| &b.plan), demands).filter(|_| self.inner.lean) {
            if let Some(decided) = Box::pin(self.decide_lean(&keys, &limits, demands, deadline)).await? {
                return Ok(decided);
            }
        }
        // Both forms boxed: inline, their states grew every store's decision future past the
        // bound `store::any`'s tests keep (one allocation a request, beside the batch's own).
        Box::pin(self.decide_general(buckets, keys, demands, deadline)).await
    }

    /// Decides the buckets of one slot in the general form of the script: any limit and demand,
    /// with the retries and walks a schedule or a reload may ask for.
    async fn decide_general(
        &self,
        buckets: &[&BucketRef],
        keys: Vec<Key>,
        demands: &[Demand],
        deadline: Option<tokio::time::Instant>,
    ) -> Result<script::Decided, StoreError> {
        let mut at = vec![self.estimate(); buckets.len()];
        let mut reps: Vec<Option<Replacement>> = vec![None; buckets.len()];
        for _ in 0..MAX_ATTEMPTS {
            let args: Vec<(BucketArgs, Option<&Replacement>)> = buckets
                .iter()
                .zip(&reps)
                .zip(&at)
                .map(|((b, r), t)| (bucket_args(&b.plan, *t), r.as_ref()))
                .collect();
            let answer = self
                .call_decide(keys.clone(), encode_request(&args, demands), deadline)
                .await?;
            let (sent, received) = (answer.sent_us, answer.received_us);
            let reply = parse_reply(answer.value, buckets.len(), demands.len())
                .map_err(|e| StoreError::Unavailable(format!("decide.lua: {e}").into()))?;
            let now = match &reply {
                Reply::Decided(d) => d.now_us,
                Reply::Retry { now_us, .. } | Reply::Walk { now_us, .. } | Reply::Bad { now_us, .. } => *now_us,
            };
            if self.inner.time_override.is_none() {
                self.inner.offset.observe(now, sent, received);
            }
            match reply {
                Reply::Decided(mut d) => {
                    for dm in demands {
                        let o = &mut d.instances[dm.instance];
                        match dm.kind {
                            DemandKind::Consume(n) => o.consumed_ut = o.consumed_ut.saturating_add(n),
                            DemandKind::Debit { amount_ut, .. } => {
                                o.debited_ut = o.debited_ut.saturating_add(amount_ut)
                            }
                            _ => {}
                        }
                    }
                    // The script answers what its debits lost (of amounts it was sent capped at
                    // 2^53); the rest of them was taken.
                    for o in &mut d.instances {
                        let taken = o
                            .debited_ut
                            .min(crate::core::bucket::EXACT_LIMIT)
                            .saturating_sub(o.lost_ut);
                        o.lost_ut = o.debited_ut - taken;
                        o.debited_ut = taken;
                    }
                    return Ok(d);
                }
                Reply::Bad { reason, .. } => return Err(StoreError::Rejected(reason.into())),
                Reply::Retry { at_us, .. } => at = at_us,
                Reply::Walk { now_us, stale } => {
                    at.fill(now_us);
                    for (i, raw) in stale {
                        // Walked to the value's own time when Redis's clock reads before it (it
                        // stepped back), the time its limit is then looked up at, as the
                        // script and the memory store do.
                        let t = parse_value(&raw).map_or(now_us, |(state, _)| now_us.max(state.updated_us));
                        at[i] = t;
                        reps[i] = replacement(&buckets[i].plan, &raw, t);
                        if reps[i].is_none() {
                            return Err(StoreError::Rejected(
                                format!(
                                    "decide.lua: cannot read the stored value {:?}",
                                    String::from_utf8_lossy(&raw)
                                )
                                .into(),
                            ));
                        }
                    }
                }
            }
        }
        Err(StoreError::Unavailable(
            format!("decide.lua: no decision after {MAX_ATTEMPTS} calls (limits changing under a busy bucket?)").into(),
        ))
    }

    /// Decides a request in the lean form (plain token buckets, consuming demands): the script
    /// answers the stored states and tollgate decides on them with the core's arithmetic, as
    /// the script did. `None` when the script found a value only the general form reads.
    async fn decide_lean(
        &self,
        keys: &[Key],
        limits: &[Limit],
        demands: &[Demand],
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Option<script::Decided>, StoreError> {
        let args = encode_lean(limits, demands);
        let answer = self.call_decide(keys.to_vec(), args, deadline).await?;
        let now = answer.now_us;
        if self.inner.time_override.is_none() {
            self.inner.offset.observe(now, answer.sent_us, answer.received_us);
        }
        let stored = match parse_lean(&answer.value, limits.len())
            .map_err(|e| StoreError::Unavailable(format!("decide.lua: {e}").into()))?
        {
            LeanReply::Decided(stored) => stored,
            LeanReply::General => return Ok(None),
        };
        let states: smallvec::SmallVec<[BucketState; 4]> = stored
            .iter()
            .zip(limits)
            .map(|(s, l)| s.unwrap_or_else(|| BucketState::full(l, now)))
            .collect();
        let d = decide(now, &states, limits, demands);
        Ok(Some(script::Decided {
            now_us: now,
            denied: d.denied,
            passed: d.passed,
            instances: d.instances,
        }))
    }

    /// Groups bucket indexes by Cluster slot (one group on a single node), in first-seen order.
    fn groups(&self, buckets: &[BucketRef]) -> Vec<Vec<usize>> {
        if self.cluster().is_none() {
            return vec![(0..buckets.len()).collect()];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            let slot = keys::slot(&keys::bucket_key(&self.inner.prefix, &b.key));
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, g)) => g.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }

    /// Decides a request on a single node: one call.
    async fn apply_single(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        let refs: Vec<&BucketRef> = buckets.iter().collect();
        let d = self.decide_group(&refs, demands, None).await?;
        Ok(Applied {
            now_us: d.now_us,
            decision: Decision {
                denied: d.denied,
                passed: d.passed,
                instances: d.instances,
            },
        })
    }

    /// The scripts' SHA1s.
    fn scripts(&self) -> &Scripts {
        match &self.inner.backend {
            Backend::Single { conn, .. } => &conn.scripts,
            Backend::Cluster(c) => c.scripts(),
        }
    }

    async fn read(&self, sha: &str, buckets: &[BucketRef]) -> Result<(u64, Vec<Option<Vec<u8>>>), StoreError> {
        let mut now = 0;
        let mut values = vec![None; buckets.len()];
        for g in self.groups(buckets) {
            let keys: Vec<Key> = g
                .iter()
                .map(|&i| Key::from(Bytes::from(keys::bucket_key(&self.inner.prefix, &buckets[i].key))))
                .collect();
            let over = match self.now_override() {
                Some(t) => Value::Integer(t as i64),
                None => Value::String("".into()),
            };
            let value = match &self.inner.backend {
                Backend::Single { conn, .. } => conn.evalsha(sha, keys, vec![over]).await?,
                Backend::Cluster(c) => {
                    let slot = keys.first().map_or(0, |k| keys::slot(k.as_bytes()));
                    let deadline = tokio::time::Instant::now() + self.inner.timeout;
                    c.evalsha(slot, sha, keys, vec![over], deadline).await?
                }
            };
            let bad = |what: &str| StoreError::Unavailable(format!("peek/reset script: {what}").into());
            match value {
                Value::Integer(t) => now = now.max(t as u64),
                Value::Array(items) => {
                    let t = items.first().and_then(Value::as_i64).ok_or_else(|| bad("no time"))?;
                    now = now.max(t as u64);
                    for (&i, v) in g.iter().zip(items.iter().skip(1)) {
                        let raw = v.as_bytes().unwrap_or_default();
                        values[i] = (!raw.is_empty()).then(|| raw.to_vec());
                    }
                }
                other => return Err(bad(&format!("unexpected answer {other:?}"))),
            }
        }
        Ok((now, values))
    }
}

impl Store for RedisStore {
    fn clock_estimate_us(&self) -> u64 {
        self.estimate()
    }

    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        if self.cluster().is_some() {
            return Box::pin(self.apply_cluster::<NoFallback>(buckets, demands, None)).await;
        }
        match tokio::time::timeout(self.inner.timeout, self.apply_single(buckets, demands)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(
                format!("no answer from Redis within {} ms", self.inner.timeout.as_millis()).into(),
            )),
        }
    }

    /// In Cluster mode, the slots of a lost master are decided on `fallback`, the others on
    /// Redis, all or nothing (docs/backends.md, "Cluster"); on a single node, as `apply`.
    async fn apply_or_fall_back<F: super::PartFallback>(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
        fallback: &F,
    ) -> Result<Applied, StoreError> {
        if self.cluster().is_some() {
            return Box::pin(self.apply_cluster(buckets, demands, Some(fallback))).await;
        }
        self.apply(buckets, demands).await
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        let (now_us, values) = self.read(&self.scripts().peek, buckets).await?;
        let stored = values
            .into_iter()
            .map(|raw| raw.as_deref().and_then(script::parse_value).map(|(state, _)| state));
        Ok(Peeked::from_stored(buckets, stored, now_us))
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        let (now_us, _) = self.read(&self.scripts().reset, buckets).await?;
        Ok(Peeked::all_full(buckets, now_us))
    }
}

impl super::SharedBackend for RedisStore {
    const NAME: &'static str = "Redis";
    const PROBE_EVERY_CHECK: bool = false;

    fn describe(&self) -> &str {
        RedisStore::describe(self)
    }

    fn connect(&self, timeout: Duration) -> impl std::future::Future<Output = Result<(), ConnectError>> + Send {
        RedisStore::connect(self, timeout)
    }

    /// The pool keeps reconnecting on its own; this waits for it, 200 ms at a time.
    fn connect_in_background(&self, _timeout: Duration) {
        RedisStore::connect_in_background(self, Duration::from_millis(200));
    }

    fn not_ready_yet(&self) -> Option<String> {
        if self.cluster().is_some() {
            // Connected once, a Cluster is ready: a master that fails since loses its own
            // slots only, which readiness weighs (`cluster_health`).
            return (!self.is_warm()).then(|| format!("not connected to the Redis Cluster at {}", self.describe()));
        }
        if !self.is_connected() {
            Some(format!("not connected to Redis at {}", self.describe()))
        } else if !self.is_warm() {
            // Connected, but the scripts are still loading (`unreachable_at_start: not_ready`
            // connects in the background).
            Some("Redis scripts not loaded yet".to_string())
        } else {
            None
        }
    }

    fn probe(&self, timeout: Duration) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        RedisStore::probe(self, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `redis.tls` puts the sentinels on TLS for the client (fred applies one TLS setting to
    /// sentinels and master) and so for the start-up check that asks them for the master too;
    /// the check spoke plain text to them before, and start-up failed.
    #[tokio::test]
    async fn redis_tls_reaches_the_sentinels_start_up_check() {
        let mut settings = RedisSettings {
            tls: true,
            ..RedisSettings::default()
        };
        settings.sentinel.master_name = Some("mymaster".into());
        settings.sentinel.urls = vec!["redis://127.0.0.1:26379".into()];
        let store = RedisStore::new(&settings, Arc::new(crate::core::clock::SystemClock)).expect("a store");
        assert!(store.inner.sentinel_tls);
        settings.tls = false;
        let plain = RedisStore::new(&settings, Arc::new(crate::core::clock::SystemClock)).expect("a store");
        assert!(!plain.inner.sentinel_tls);
    }

    #[test]
    fn fred_errors_stay_the_source_of_store_errors() {
        let source = |e: &StoreError| {
            let cause = std::error::Error::source(e).expect("a cause");
            cause.source().and_then(|s| s.downcast_ref::<FredError>()).cloned()
        };
        let refused = store_error(&FredError::new(ErrorKind::IO, "Connection refused"));
        assert!(matches!(refused, StoreError::Unavailable(_)), "{refused:?}");
        assert_eq!(source(&refused).map(|e| e.kind().clone()), Some(ErrorKind::IO));
        let slow = store_error(&FredError::new(ErrorKind::Timeout, "Request timed out."));
        assert!(matches!(slow, StoreError::Timeout(_)), "{slow:?}");
        let bad = store_error(&FredError::new(ErrorKind::Unknown, "WRONGTYPE Operation against a key"));
        assert!(matches!(bad, StoreError::Rejected(_)), "{bad:?}");
        assert!(source(&bad).is_some());
    }

    #[test]
    fn the_policy_is_read_from_either_protocol() {
        let pair = Value::Array(vec!["maxmemory-policy".into(), "allkeys-lru".into()]);
        assert_eq!(policy_of(pair).as_deref(), Some("allkeys-lru"));
        let mut map = fred::types::Map::new();
        map.insert("maxmemory-policy".into(), "noeviction".into());
        assert_eq!(policy_of(Value::Map(map)).as_deref(), Some("noeviction"));
        assert_eq!(policy_of(Value::Array(vec![])), None);
        assert_eq!(policy_of(Value::Null), None);
    }
}
