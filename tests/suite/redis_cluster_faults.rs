// The tests that load the machine hold a std Mutex across awaits on purpose: it only keeps
// them from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! A Redis Cluster losing a node under load, on a running `tollgate serve` against a private
//! cluster of three masters with a replica each (`RedisCluster::with_replicas`, a short
//! `cluster-node-timeout`): a coordinated `CLUSTER FAILOVER` costs no request; a master killed
//! (`kill -9`) fails only the requests whose buckets live on its slots, each by the failure mode,
//! and none once its replica is promoted and tollgate has seen it; `/readyz` says degraded
//! meanwhile; the killed node restarted rejoins as a replica without tollgate noticing; a hot
//! bucket never admits more than its capacity and refill through it all.

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use support::faults::{connect, eventually, one_at_a_time, readyz, real_decisions, scrape, CAPACITY};
use support::redis::{redis_binaries_or_skip, RedisCluster};
use support::{descriptor, request, yaml_str, Tollgate};
use tokio::task::{block_in_place, JoinHandle};
use tollgate::rules::instance_key;
use tollgate::store::redis::keys::{bucket_key, slot};

const DOMAIN: &str = "cluster";
const PREFIX: &str = "tg:";
/// The hot bucket's capacity and refill (one token per `HOT_REFILL`).
const HOT_CAPACITY: u64 = 30;
const HOT_REFILL: Duration = Duration::from_secs(10);
const RULES: &str = r#"
domain: cluster
buckets:
  per_user: {capacity: 5, refill: 1/1h}
  hot: {capacity: 30, refill: 1/10s}
  tight: {capacity: 1, refill: 1/1h}
  roomy: {capacity: 3, refill: 1/1h}
descriptors:
  - {key: user, bucket: per_user}
  - {key: hot, bucket: hot}
  - {key: tight, bucket: tight}
  - {key: roomy, bucket: roomy}
"#;
/// `cluster-node-timeout`: a killed master's replica takes over after about twice this.
const NODE_TIMEOUT_MS: u64 = 1000;
/// `redis.command_timeout_ms` (a debug build on a busy two-core machine). A coordinated
/// failover pauses writes on the master until its replica has caught up and won its election
/// (under 50 ms here); a request on its slots waits that long, then goes to the new master.
const COMMAND_TIMEOUT_MS: u64 = 300;
/// Clients on many users each, and clients on the one hot bucket.
const CLIENTS: usize = 6;
const USERS_PER_CLIENT: usize = 16;
const HOT_CLIENTS: usize = 2;
/// How long after the cluster has promoted a replica tollgate may still fail the lost slots'
/// requests: its slot map refresh, generous for a loaded machine.
const REFRESH_BOUND: Duration = Duration::from_secs(3);

// The phases of a run, by when a request was sent and answered.
const STEADY: u8 = 0;
const FAILOVER: u8 = 1;
const SETTLED: u8 = 2;
const KILLED: u8 = 3;
const CATCHING_UP: u8 = 4;
const PROMOTED: u8 = 5;
const REJOINING: u8 = 6;
const AFTER: u8 = 7;
const PHASES: [(u8, &str); 8] = [
    (STEADY, "steady"),
    (FAILOVER, "failover"),
    (SETTLED, "settled"),
    (KILLED, "killed"),
    (CATCHING_UP, "catching up"),
    (PROMOTED, "promoted"),
    (REJOINING, "rejoining"),
    (AFTER, "after"),
];

/// The Cluster slot of the bucket `bucket` for descriptor `key: value`, as tollgate names it.
fn slot_of(bucket: &str, key: &str, value: &str) -> u16 {
    let entries = [Entry {
        key: key.into(),
        value: value.into(),
    }];
    let mut identity = String::new();
    instance_key(&mut identity, DOMAIN, bucket, &entries, &[None]);
    slot(&bucket_key(PREFIX, &identity))
}

/// The Redis key of the bucket `bucket` for descriptor `key: value`, as tollgate names it.
fn key_of(bucket: &str, key: &str, value: &str) -> Vec<u8> {
    let entries = [Entry {
        key: key.into(),
        value: value.into(),
    }];
    let mut identity = String::new();
    instance_key(&mut identity, DOMAIN, bucket, &entries, &[None]);
    bucket_key(PREFIX, &identity)
}

fn user_slot(user: &str) -> u16 {
    slot_of("per_user", "user", user)
}

/// The over-limit cache is off: these tests judge which requests reach a failing master and
/// what they get, and their load hammers exhausted buckets, which the cache answers without the
/// store (docs/backends.md, "Deciding locally").
fn settings(cluster: &RedisCluster, mode: &str) -> String {
    let urls: Vec<String> = cluster.urls().iter().map(|u| yaml_str(u)).collect();
    format!(
        "backend: redis\nredis:\n  urls: [{}]\n  cluster: true\n  key_prefix: \"{PREFIX}\"\n  \
         command_timeout_ms: {COMMAND_TIMEOUT_MS}\n  failure_mode: {mode}\n  fallback: memory\n  \
         connect_timeout_ms: 2000\nlocal: {{over_limit_cache: false}}\n",
        urls.join(", ")
    )
}

/// One request of the load.
#[derive(Debug)]
struct Sample {
    /// The user, or `None` for the hot bucket.
    user: Option<String>,
    sent: u8,
    answered: u8,
    /// When the answer came.
    at: Instant,
    result: Result<Code, (tonic::Code, String)>,
}

impl Sample {
    fn slot(&self) -> u16 {
        match &self.user {
            Some(u) => user_slot(u),
            None => slot_of("hot", "hot", "1"),
        }
    }
}

/// Clients on their own users (five tokens each, then OVER_LIMIT: real decisions) and on the
/// hot bucket, every request tagged with the phase it was sent and answered in.
struct ClusterLoad {
    phase: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Vec<Sample>>>,
}

impl ClusterLoad {
    async fn start(tollgate: &Tollgate) -> ClusterLoad {
        let phase = Arc::new(AtomicU8::new(STEADY));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for i in 0..CLIENTS + HOT_CLIENTS {
            let mut client = connect(tollgate).await;
            let (phase, stop) = (phase.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let users: Vec<Option<String>> = if i < CLIENTS {
                    (0..USERS_PER_CLIENT).map(|k| Some(format!("u{i}-{k}"))).collect()
                } else {
                    vec![None]
                };
                let mut samples = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let user = users[n % users.len()].clone();
                    n += 1;
                    let entries = match &user {
                        Some(u) => vec![("user", u.as_str())],
                        None => vec![("hot", "1")],
                    };
                    let sent = phase.load(Ordering::SeqCst);
                    let result = tokio::time::timeout(
                        Duration::from_secs(10),
                        client.should_rate_limit(request(DOMAIN, &entries, 0)),
                    )
                    .await
                    .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer within 10 s")));
                    let answered = phase.load(Ordering::SeqCst);
                    samples.push(Sample {
                        user,
                        sent,
                        answered,
                        at: Instant::now(),
                        result: result
                            .map(|r| Code::try_from(r.into_inner().overall_code).expect("a known code"))
                            .map_err(|e| (e.code(), e.message().to_owned())),
                    });
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                samples
            }));
        }
        ClusterLoad { phase, stop, tasks }
    }

    fn set_phase(&self, phase: u8) {
        self.phase.store(phase, Ordering::SeqCst);
    }

    async fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.extend(t.await.expect("a load task"));
        }
        all
    }
}

/// Per phase (by when answered): requests, and errors on the lost slots and elsewhere.
fn summary(samples: &[Sample], lost: &[(u16, u16)]) -> String {
    let mut by: BTreeMap<u8, (usize, usize, usize)> = BTreeMap::new();
    for s in samples {
        let e = by.entry(s.answered).or_default();
        e.0 += 1;
        if s.result.is_err() {
            if in_ranges(s.slot(), lost) {
                e.1 += 1;
            } else {
                e.2 += 1;
            }
        }
    }
    let mut out = String::new();
    for (phase, name) in PHASES {
        let (n, on_lost, elsewhere) = by.get(&phase).copied().unwrap_or_default();
        out.push_str(&format!(
            "{name}: {n} requests, {on_lost} errors on the lost slots, {elsewhere} elsewhere; "
        ));
    }
    out
}

fn in_ranges(slot: u16, ranges: &[(u16, u16)]) -> bool {
    ranges.iter().any(|&(a, b)| (a..=b).contains(&slot))
}

/// A coordinated failover of the hot bucket's master, then a `kill -9` of another master under
/// load in `failure_mode: error`, then the killed node restarted: (a) the failover costs no
/// request; (b) while the killed master's replica is not yet promoted and seen, only requests
/// on its slots fail, the others are decided, `/readyz` is 200 and says degraded (no address),
/// the metrics count the failing slots; none fails once tollgate has seen the promotion;
/// (c) the old master rejoins as a replica and costs nothing; (d) the hot bucket admits at
/// most its capacity and refill through both events.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_master_fails_only_its_own_slots() {
    if !redis_binaries_or_skip("a_lost_master_fails_only_its_own_slots") {
        return;
    }
    let _one = one_at_a_time();
    let mut cluster = block_in_place(|| RedisCluster::with_replicas(NODE_TIMEOUT_MS));
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("cluster.yaml", RULES)
            .settings(&settings(&cluster, "error"))
            // This one with the over-limit cache on, as by default: what it answers is never an
            // error, and the rest must still fail only on the killed master's slots.
            .env("TOLLGATE_LOCAL__OVER_LIMIT_CACHE", "true")
            .start()
    });
    assert_eq!(readyz(&tollgate).0, 200, "ready on a healthy cluster");
    let hot_master = block_in_place(|| cluster.master_of(slot_of("hot", "hot", "1")));
    let masters = block_in_place(|| cluster.masters());
    let victim = *masters.iter().find(|&&m| m != hot_master).expect("another master");
    let lost = block_in_place(|| cluster.slots_of(victim));
    let users_on_lost = (0..CLIENTS)
        .flat_map(|i| (0..USERS_PER_CLIENT).map(move |k| format!("u{i}-{k}")))
        .filter(|u| in_ranges(user_slot(u), &lost))
        .count();
    assert!(users_on_lost > 0, "no user on the victim's slots {lost:?}");
    let started = Instant::now();
    let load = ClusterLoad::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // (a) A coordinated failover of the hot bucket's master.
    load.set_phase(FAILOVER);
    let replica = block_in_place(|| cluster.replica_of(hot_master));
    let failing_over = Instant::now();
    block_in_place(|| cluster.failover(replica));
    eprintln!(
        "failover from {} to {} took {:?}",
        cluster.ports()[hot_master],
        cluster.ports()[replica],
        failing_over.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    load.set_phase(SETTLED);
    tokio::time::sleep(Duration::from_millis(1000)).await;

    // (b) kill -9 of another master.
    load.set_phase(KILLED);
    let killed = Instant::now();
    block_in_place(|| cluster.kill(victim));
    let mut degraded = None;
    let mut failing_slots = 0.0;
    let promoted = loop {
        let (status, body) = readyz(&tollgate);
        if status == 200 && body.contains("degraded") && degraded.is_none() {
            degraded = Some(body);
            failing_slots = scrape(&tollgate)
                .get("tollgate_redis_cluster_slots_failing", &[])
                .unwrap_or(0.0);
        }
        let replaced = block_in_place(|| cluster.masters().len() == 3 && !cluster.masters().contains(&victim));
        if replaced {
            break Instant::now();
        }
        assert!(killed.elapsed() < Duration::from_secs(30), "no promotion within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    load.set_phase(CATCHING_UP);
    tokio::time::sleep(REFRESH_BOUND).await;
    load.set_phase(PROMOTED);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (ready_after, ready_body_after) = readyz(&tollgate);

    // (c) The killed node comes back, as a replica.
    load.set_phase(REJOINING);
    block_in_place(|| cluster.restart(victim));
    let rejoined = Instant::now();
    loop {
        let view = block_in_place(|| cluster.view_from(victim));
        if view
            .iter()
            .any(|v| v.node == victim && !v.master && v.replica_of.is_some())
        {
            break;
        }
        assert!(
            rejoined.elapsed() < Duration::from_secs(30),
            "{victim} did not rejoin as a replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    block_in_place(|| cluster.wait_ok(Duration::from_secs(30)));
    load.set_phase(AFTER);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let samples = load.stop().await;
    let ran = started.elapsed();
    let metrics = block_in_place(|| support::http_get(tollgate.http_addr, "/metrics")).expect("/metrics");
    let last_error = samples.iter().filter(|s| s.result.is_err()).map(|s| s.at).max();
    eprintln!(
        "promotion seen {:?} after the kill, the last error {:?} after that; {}; readyz while degraded: {degraded:?}",
        promoted - killed,
        last_error.map(|t| t.saturating_duration_since(promoted)),
        summary(&samples, &lost)
    );

    // (a) and (c): no error outside the time the victim's slots had no master tollgate knew.
    let errors = |pred: &dyn Fn(&Sample) -> bool| samples.iter().filter(|s| s.result.is_err() && pred(s)).count();
    let outside: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.result.is_err() && s.answered != KILLED && s.answered != CATCHING_UP)
        .collect();
    assert!(
        outside.is_empty(),
        "errors outside the outage: {outside:?}\n{}",
        summary(&samples, &lost)
    );
    // (b) Only the lost slots' requests failed, and they did (the kill mattered).
    let elsewhere = errors(&|s| !in_ranges(s.slot(), &lost));
    assert_eq!(elsewhere, 0, "errors on healthy masters\n{}", summary(&samples, &lost));
    let decided_elsewhere = samples
        .iter()
        .filter(|s| s.sent == KILLED && s.answered == KILLED && s.result.is_ok() && !in_ranges(s.slot(), &lost))
        .count();
    assert!(
        decided_elsewhere > 0,
        "nothing decided during the outage\n{}",
        summary(&samples, &lost)
    );
    let mut lost_errors: Vec<&Sample> = samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(
        !lost_errors.is_empty(),
        "the kill cost nothing: {}",
        summary(&samples, &lost)
    );
    lost_errors.retain(|s| !matches!(&s.result, Err((tonic::Code::Unavailable, _))));
    assert!(
        lost_errors.is_empty(),
        "failure_mode error answers UNAVAILABLE: {lost_errors:?}"
    );
    // Readiness: degraded, naming slots and no address; the metrics counted the lost slots.
    let degraded = degraded.expect("/readyz said degraded while a master was lost");
    assert!(degraded.contains("slots"), "{degraded}");
    assert!(!degraded.contains("127.0.0.1"), "/readyz shows an address: {degraded}");
    assert!(
        failing_slots > 0.0,
        "tollgate_redis_cluster_slots_failing while degraded"
    );
    assert_eq!(ready_after, 200);
    assert!(!ready_body_after.contains("degraded"), "{ready_body_after}");
    assert!(!metrics.1.contains("127.0.0.1"), "/metrics shows an address");
    // (d) The hot bucket: at most its capacity and what refilled over the run.
    let hot_ok = samples
        .iter()
        .filter(|s| s.user.is_none() && s.result == Ok(Code::Ok))
        .count() as u64;
    let refilled = ran.as_secs() / HOT_REFILL.as_secs() + 1;
    assert!(
        hot_ok <= HOT_CAPACITY + refilled,
        "the hot bucket admitted {hot_ok} > {HOT_CAPACITY} + {refilled}"
    );
    assert!(hot_ok >= HOT_CAPACITY, "the hot bucket admitted only {hot_ok}");
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
}

/// A value for descriptor `key` whose bucket `bucket` lies (or not, as `inside` says) in `ranges`.
fn value_where(bucket: &str, key: &str, ranges: &[(u16, u16)], inside: bool) -> String {
    (0..10_000)
        .map(|i| format!("{key}-{i}"))
        .find(|v| in_ranges(slot_of(bucket, key, v), ranges) == inside)
        .expect("a value on either side")
}

/// One request with a descriptor per `(key, value)`.
async fn call_many(
    client: &mut envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
        tonic::transport::Channel,
    >,
    entries: &[(&str, &str)],
) -> Result<Code, tonic::Status> {
    let request = envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: DOMAIN.into(),
        descriptors: entries.iter().map(|e| descriptor(&[*e])).collect(),
        hits_addend: 0,
    };
    client
        .should_rate_limit(request)
        .await
        .map(|r| Code::try_from(r.into_inner().overall_code).expect("a known code"))
}

/// With `failure_mode: fallback` (memory) and a master killed (no replica: its slots stay
/// lost): a request on its slots is decided on the fallback, one on the others on Redis (the
/// fallback counts only the first); a request over a lost slot and a healthy one is all or
/// nothing across Redis and the fallback (a denial on Redis gives back what the fallback took);
/// `/readyz` says the fallback decides the lost slots; once the master is back, without a
/// restart of tollgate, its slots are decided on Redis again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fallback_decides_only_the_lost_slots() {
    if !redis_binaries_or_skip("the_fallback_decides_only_the_lost_slots") {
        return;
    }
    let _one = one_at_a_time();
    let mut cluster = block_in_place(RedisCluster::start);
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("cluster.yaml", RULES)
            .settings(&settings(&cluster, "fallback"))
            .start()
    });
    let victim = 0;
    let lost = block_in_place(|| cluster.slots_of(victim));
    let mut client = connect(&tollgate).await;
    let fallbacks = || scrape(&tollgate).counter("tollgate_backend_fallbacks_total", &[("backend", "redis")]);
    assert_eq!(fallbacks(), 0.0);

    block_in_place(|| cluster.kill(victim));
    eventually(Duration::from_secs(10), "/readyz says slots are lost", || {
        readyz(&tollgate).1.contains("slots lost")
    })
    .await;
    let (status, body) = readyz(&tollgate);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("deciding on the memory fallback"), "{body}");
    assert!(!body.contains("127.0.0.1"), "{body}");

    // Real decisions on either side; only the lost slot's are the fallback's.
    let on_lost = value_where("per_user", "user", &lost, true);
    let elsewhere = value_where("per_user", "user", &lost, false);
    let bound = Duration::from_millis(COMMAND_TIMEOUT_MS) + Duration::from_secs(1);
    let errors = || scrape(&tollgate).sum("tollgate_backend_errors_total", &[("backend", "redis")]);
    let errors_before = errors();
    let requests = (CAPACITY + 2) as f64;
    assert_eq!(exhaust_on(&mut client, &on_lost, bound).await, real_decisions());
    assert_eq!(fallbacks(), requests, "the lost slot's requests, on the fallback");
    assert_eq!(
        errors() - errors_before,
        requests,
        "each a failed call to Redis, counted"
    );
    assert_eq!(exhaust_on(&mut client, &elsewhere, bound).await, real_decisions());
    assert_eq!(fallbacks(), requests, "the healthy slot's requests, on Redis");
    assert_eq!(errors() - errors_before, requests, "and no failed call");

    // All or nothing across Redis and the fallback: tight (capacity 1) on a healthy master,
    // roomy (capacity 3) on the lost one.
    let tight = value_where("tight", "tight", &lost, false);
    let roomy = value_where("roomy", "roomy", &lost, true);
    let both = [("tight", tight.as_str()), ("roomy", roomy.as_str())];
    assert_eq!(call_many(&mut client, &both).await.expect("decided"), Code::Ok);
    assert_eq!(call_many(&mut client, &both).await.expect("decided"), Code::OverLimit);
    let mut roomy_alone = Vec::new();
    for _ in 0..3 {
        roomy_alone.push(
            call_many(&mut client, &[("roomy", roomy.as_str())])
                .await
                .expect("decided"),
        );
    }
    // Two left: the denied request's take from roomy was given back on the fallback.
    assert_eq!(roomy_alone, vec![Code::Ok, Code::Ok, Code::OverLimit]);

    // The master comes back (empty: no persistence): its slots are Redis's again.
    block_in_place(|| cluster.restart(victim));
    block_in_place(|| cluster.wait_ok(Duration::from_secs(30)));
    eventually(Duration::from_secs(10), "/readyz ready again", || {
        readyz(&tollgate) == (200, "ready\n".to_string())
    })
    .await;
    let before = fallbacks();
    let back = value_where("per_user", "user-back", &lost, true);
    assert_eq!(exhaust_on(&mut client, &back, bound).await, real_decisions());
    assert_eq!(fallbacks(), before, "decided on Redis once the master is back");
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
}

/// `CAPACITY + 2` requests for `user` in this file's domain, each within `bound`: the codes.
async fn exhaust_on(
    client: &mut envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
        tonic::transport::Channel,
    >,
    user: &str,
    bound: Duration,
) -> Vec<Code> {
    let mut codes = Vec::new();
    for _ in 0..CAPACITY + 2 {
        let started = Instant::now();
        let code = call_many(client, &[("user", user)])
            .await
            .unwrap_or_else(|e| panic!("request for {user}: {e:?}"));
        assert!(
            started.elapsed() <= bound,
            "request for {user} took {:?}",
            started.elapsed()
        );
        codes.push(code);
    }
    codes
}

/// Three masters without replicas in `failure_mode: error`: one killed, a third of the slots
/// lost, `/readyz` is 200 and degraded; a second killed, two thirds lost, it is 503 (no
/// fallback can decide them), naming slots and no address; both back, it is ready again and
/// decides on every master, with no restart of tollgate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn half_the_slots_lost_is_not_ready() {
    if !redis_binaries_or_skip("half_the_slots_lost_is_not_ready") {
        return;
    }
    let _one = one_at_a_time();
    let mut cluster = block_in_place(RedisCluster::start);
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("cluster.yaml", RULES)
            .settings(&settings(&cluster, "error"))
            .start()
    });
    assert_eq!(readyz(&tollgate), (200, "ready\n".to_string()));
    let first = block_in_place(|| cluster.slots_of(0));
    let mut client = connect(&tollgate).await;

    block_in_place(|| cluster.kill(0));
    eventually(Duration::from_secs(10), "/readyz degraded with a third lost", || {
        let (status, body) = readyz(&tollgate);
        status == 200 && body.contains("5461 of 16384 slots lost")
    })
    .await;
    // The lost slots fail, the others are decided.
    let on_lost = value_where("per_user", "user", &first, true);
    let elsewhere = value_where("per_user", "user", &first, false);
    let failed = call_many(&mut client, &[("user", on_lost.as_str())]).await;
    assert_eq!(failed.map_err(|e| e.code()), Err(tonic::Code::Unavailable));
    assert_eq!(
        call_many(&mut client, &[("user", elsewhere.as_str())])
            .await
            .expect("decided"),
        Code::Ok
    );

    block_in_place(|| cluster.kill(1));
    eventually(Duration::from_secs(10), "/readyz 503 with two thirds lost", || {
        readyz(&tollgate).0 == 503
    })
    .await;
    let (_, body) = readyz(&tollgate);
    assert!(body.starts_with("not ready"), "{body}");
    assert!(body.contains("slots lost"), "{body}");
    assert!(!body.contains("127.0.0.1"), "{body}");
    let metrics = block_in_place(|| support::http_get(tollgate.http_addr, "/metrics")).expect("/metrics");
    assert!(!metrics.1.contains("127.0.0.1"), "/metrics shows an address");
    let failing = scrape(&tollgate)
        .get("tollgate_redis_cluster_slots_failing", &[])
        .expect("the gauge");
    assert!(failing >= 10922.0, "{failing}");

    block_in_place(|| {
        cluster.restart(0);
        cluster.restart(1);
        cluster.wait_ok(Duration::from_secs(30));
    });
    eventually(Duration::from_secs(15), "/readyz ready again", || {
        readyz(&tollgate) == (200, "ready\n".to_string())
    })
    .await;
    assert_eq!(
        scrape(&tollgate).get("tollgate_redis_cluster_slots_failing", &[]),
        Some(0.0)
    );
    let back = value_where("per_user", "user-back", &first, true);
    let bound = Duration::from_millis(COMMAND_TIMEOUT_MS) + Duration::from_secs(1);
    assert_eq!(exhaust_on(&mut client, &back, bound).await, real_decisions());
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
}

/// A master paused (SIGSTOP: its connections open, nothing answered) under load in
/// `failure_mode: error`: its slots' requests time out (at the command timeout) and
/// open its breaker; every other request is decided and the store-wide breaker stays closed;
/// resumed, its slots are decided again with no restart of tollgate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_master_stalls_only_its_own_slots() {
    if !redis_binaries_or_skip("a_paused_master_stalls_only_its_own_slots") {
        return;
    }
    let _one = one_at_a_time();
    let cluster = block_in_place(RedisCluster::start);
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("cluster.yaml", RULES)
            .settings(&settings(&cluster, "error"))
            .start()
    });
    let lost = block_in_place(|| cluster.slots_of(0));
    let load = ClusterLoad::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    load.set_phase(KILLED);
    block_in_place(|| cluster.pause(0));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let circuit = scrape(&tollgate).get("tollgate_backend_circuit_open", &[("backend", "redis")]);
    let node_up = scrape(&tollgate).get("tollgate_redis_cluster_node_up", &[("first_slot", "0")]);
    load.set_phase(CATCHING_UP);
    block_in_place(|| cluster.resume(0));
    eventually(Duration::from_secs(10), "/readyz ready again", || {
        readyz(&tollgate) == (200, "ready\n".to_string())
    })
    .await;
    load.set_phase(AFTER);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let samples = load.stop().await;
    eprintln!("{}", summary(&samples, &lost));

    let elsewhere: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.result.is_err() && !in_ranges(s.slot(), &lost))
        .collect();
    assert!(elsewhere.is_empty(), "errors on healthy masters: {elsewhere:?}");
    let after: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.result.is_err() && s.sent == AFTER)
        .collect();
    assert!(after.is_empty(), "errors after the master was back: {after:?}");
    assert!(
        samples.iter().any(|s| s.answered == KILLED && s.result.is_err()),
        "the pause cost nothing: {}",
        summary(&samples, &lost)
    );
    assert!(
        samples
            .iter()
            .any(|s| s.sent == KILLED && s.answered == KILLED && s.result.is_ok() && !in_ranges(s.slot(), &lost)),
        "nothing decided during the pause"
    );
    assert_eq!(circuit, Some(0.0), "the store-wide breaker opened");
    assert_eq!(node_up, Some(0.0), "the paused master is down in the metrics");
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
}

/// Starts moving `slot` from master `from` to master `to` (`IMPORTING` on `to`, then
/// `MIGRATING` on `from`), as `redis-cli --cluster reshard` does before it moves keys; returns
/// `to`'s node id.
fn begin_migration(cluster: &RedisCluster, slot: u16, from: usize, to: usize) -> String {
    let id = |node: usize| cluster.cmd(node, &[b"CLUSTER", b"MYID"]).as_text().expect("an id");
    let (from_id, to_id) = (id(from), id(to));
    let slot = slot.to_string();
    cluster.cmd(
        to,
        &[
            b"CLUSTER",
            b"SETSLOT",
            slot.as_bytes(),
            b"IMPORTING",
            from_id.as_bytes(),
        ],
    );
    cluster.cmd(
        from,
        &[b"CLUSTER", b"SETSLOT", slot.as_bytes(), b"MIGRATING", to_id.as_bytes()],
    );
    to_id
}

/// A slot migrated between masters under tollgate: while it is half way (`MIGRATING` on its
/// master, `IMPORTING` on the other), a bucket not yet on the old master is answered `ASK` and
/// decided on the new one after `ASKING` (real decisions, its key there); once the slot is the
/// new master's, the old one answers `MOVED` and the call goes to the new one, with the bucket's
/// state as it was. Both redirects are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_migrating_between_masters_is_followed() {
    if !redis_binaries_or_skip("a_slot_migrating_between_masters_is_followed") {
        return;
    }
    let _one = one_at_a_time();
    let cluster = block_in_place(RedisCluster::start);
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("cluster.yaml", RULES)
            .settings(&settings(&cluster, "error"))
            .start()
    });
    let user = "migrating";
    let slot = user_slot(user);
    let (from, to) = block_in_place(|| {
        let from = cluster.master_of(slot);
        (from, (from + 1) % 3)
    });
    let to_id = block_in_place(|| begin_migration(&cluster, slot, from, to));
    let slot_arg = slot.to_string();
    let redirects = |kind: &str| scrape(&tollgate).counter("tollgate_redis_cluster_redirects_total", &[("kind", kind)]);
    let mut client = connect(&tollgate).await;
    let bound = Duration::from_millis(COMMAND_TIMEOUT_MS) + Duration::from_secs(1);
    assert_eq!(exhaust_on(&mut client, user, bound).await, real_decisions());
    assert!(redirects("ask") >= 1.0, "no ASK followed");
    let key = key_of("per_user", "user", user);
    let on_new = block_in_place(|| {
        let mut conn = support::redis::RespConn::connect(
            &support::redis::RedisTarget::port(cluster.ports()[to]),
            Duration::from_secs(5),
        )
        .expect("connect");
        conn.pipeline(&[vec![b"ASKING".to_vec()], vec![b"EXISTS".to_vec(), key.clone()]])
            .expect("ASKING, EXISTS")
    });
    assert_eq!(on_new[1].as_int(), Some(1), "the bucket is on the importing master");

    // The slot is the new master's: the old one answers MOVED.
    block_in_place(|| {
        for node in 0..3 {
            cluster.cmd(
                node,
                &[b"CLUSTER", b"SETSLOT", slot_arg.as_bytes(), b"NODE", to_id.as_bytes()],
            );
        }
    });
    let moved_before = redirects("moved");
    let answer = call_many(&mut client, &[("user", user)]).await.expect("decided");
    assert_eq!(answer, Code::OverLimit, "the bucket kept its state across the move");
    let other = (0..1_000_000)
        .map(|i| format!("moved-{i}"))
        .find(|u| user_slot(u) == slot)
        .expect("another user on the slot");
    assert_eq!(exhaust_on(&mut client, &other, bound).await, real_decisions());
    assert!(redirects("moved") > moved_before, "no MOVED followed");
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
}

/// Requests of many slots of one master ride one call (the Cluster form of the script), which
/// declares only the first request's key. While one of that master's slots is half migrated, a
/// call whose declared key is on that slot is answered `ASK` as a whole; that redirect concerns
/// its slot alone, so the call's requests go again slot by slot, each on its own route. 64
/// streams send requests on the migrating slot's users and on 40 other users of the same
/// master: none fails, and every user gets exactly its capacity.
///
/// Before, the `ASK` reached every request of the call: the others followed it to the
/// importing master, bounced back with `MOVED`, and ran out of redirects (errors on healthy
/// slots).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redirect_for_one_slot_leaves_the_other_slots_of_a_shared_call_decided() {
    if !redis_binaries_or_skip("a_redirect_for_one_slot_leaves_the_other_slots_of_a_shared_call_decided") {
        return;
    }
    let _one = one_at_a_time();
    let cluster = block_in_place(RedisCluster::start);
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("cluster.yaml", RULES)
            .settings(&settings(&cluster, "error"))
            .start()
    });
    let migrating_user = "migrating-0";
    let slot = user_slot(migrating_user);
    let (from, to) = block_in_place(|| {
        let from = cluster.master_of(slot);
        (from, (from + 1) % 3)
    });
    // More users on the migrating slot (their keys absent on the old master: `ASK`), and users
    // of other slots of the same master.
    let mut on_slot = vec![migrating_user.to_string()];
    on_slot.extend(
        (0..2_000_000)
            .map(|i| format!("migrating-{i}"))
            .filter(|u| user_slot(u) == slot)
            .skip(1)
            .take(3),
    );
    let others: Vec<String> = block_in_place(|| {
        (0..100_000)
            .map(|i| format!("other-{i}"))
            .filter(|u| user_slot(u) != slot && cluster.master_of(user_slot(u)) == from)
            .take(40)
            .collect()
    });
    assert_eq!((on_slot.len(), others.len()), (4, 40));
    block_in_place(|| begin_migration(&cluster, slot, from, to));
    let users: Arc<Vec<String>> = Arc::new(on_slot.iter().chain(&others).cloned().collect());
    // Every user asked CAPACITY + 3 times, interleaved, from 64 streams.
    let total = users.len() * (CAPACITY + 3);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Each stream's answers: (user index, answer).
    type Answers = Vec<(usize, Result<Code, tonic::Status>)>;
    let tasks: Vec<JoinHandle<Answers>> = (0..64)
        .map(|_| {
            let (users, next, addr) = (users.clone(), next.clone(), tollgate.grpc_addr);
            tokio::spawn(async move {
                let mut client =
                    envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
                        format!("http://{addr}"),
                    )
                    .await
                    .expect("connect to tollgate");
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= total {
                        return out;
                    }
                    let u = i % users.len();
                    out.push((u, call_many(&mut client, &[("user", users[u].as_str())]).await));
                }
            })
        })
        .collect();
    let mut admitted = vec![0usize; users.len()];
    for task in tasks {
        for (u, answer) in task.await.expect("a stream") {
            match answer {
                Ok(Code::Ok) => admitted[u] += 1,
                Ok(_) => {}
                Err(status) => panic!("request for {}: {status:?}", users[u]),
            }
        }
    }
    assert!(
        admitted.iter().all(|&n| n == CAPACITY),
        "admitted per user (capacity {CAPACITY}): {admitted:?}"
    );
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
}
