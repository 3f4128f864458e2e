// The load test holds a std Mutex across awaits on purpose: it only keeps the loaded tests
// from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! Redis behind Sentinel and Redis over a Unix socket, with real processes: a master, its
//! replica and three sentinels (`support::redis::RedisSentinels`, passwords on both), and a
//! `redis-server` with `port 0` and a `unixsocket` (`support::redis::UnixRedis`), each under a
//! running `tollgate serve`.
//!
//! The failover: the master is killed (`SIGKILL`) under steady load on a hot bucket and on
//! users' buckets; requests fail (`failure_mode: error`) only until the sentinels have promoted
//! the replica and tollgate's pool has reconnected through them, then they are decided again
//! by the same tollgate process, and nothing is admitted twice.
//!
//! **A write the killed master may lose.** Replication is asynchronous: the master answers a
//! decision before its replica has the write, so a kill can lose the last few milliseconds of
//! writes, and the promoted replica then hands out again what they had consumed. Every user's
//! bucket is exhausted long before the kill (five tokens, none refilled in an hour), so no
//! user's write near the kill consumes anything; the hot bucket is empty too and refills one
//! token per ten seconds, so at most one admission (the token that last refilled) can fall in
//! the replication lag of a loopback link. The bound the test holds the hot bucket to is
//! therefore its capacity, plus what refilled over the run, plus that one admission; a replica
//! that had lost the bucket (or a tollgate that had written elsewhere) would admit a whole
//! capacity again and fail it.

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use support::faults::{connect, one_at_a_time, readyz};
use support::redis::{redis_binaries_or_skip, RedisSentinels, UnixRedis, SENTINEL_MASTER};
use support::{request, yaml_str, Tollgate};
use tokio::task::{block_in_place, JoinHandle};

const DOMAIN: &str = "sentinel";
const RULES: &str = r#"
domain: sentinel
buckets:
  per_user: {capacity: 5, refill: 1/1h}
  hot: {capacity: 30, refill: 1/10s}
descriptors:
  - {key: user, bucket: per_user}
  - {key: hot, bucket: hot}
"#;
const USER_CAPACITY: usize = 5;
const HOT_CAPACITY: u64 = 30;
const HOT_REFILL: Duration = Duration::from_secs(10);
/// The data nodes' and the sentinels' passwords: neither may appear in a log or `/config`.
const PASSWORD: &str = "data-Pa55-never-shown";
const SENTINEL_PASSWORD: &str = "sentinel-Pa55-never-shown";
/// `down-after-milliseconds` and `failover-timeout` of the sentinels.
const DOWN_AFTER_MS: u64 = 500;
const FAILOVER_TIMEOUT_MS: u64 = 2000;
/// How long after the sentinels name the new master tollgate may still fail requests: its pool
/// reconnects every 200 ms through the sentinels, and a circuit breaker the outage opened
/// lets a probe through after `breaker_open_ms` (1 s); generous for a loaded machine.
const CATCH_UP_BOUND: Duration = Duration::from_secs(3);
const USER_CLIENTS: usize = 4;
const USERS_PER_CLIENT: usize = 8;
const HOT_CLIENTS: usize = 2;

const STEADY: u8 = 0;
const KILLED: u8 = 1;
const CATCHING_UP: u8 = 2;
const PROMOTED: u8 = 3;
const PHASES: [(u8, &str); 4] = [
    (STEADY, "steady"),
    (KILLED, "killed"),
    (CATCHING_UP, "catching up"),
    (PROMOTED, "promoted"),
];

fn sentinel_settings(sentinels: &RedisSentinels, master_name: &str, extra: &str) -> String {
    let urls: Vec<String> = sentinels.urls().iter().map(|u| yaml_str(u)).collect();
    format!(
        "backend: redis\nredis:\n  password: {}\n  sentinel:\n    master_name: {}\n    urls: [{}]\n    \
         password: {}\n  key_prefix: \"tg:\"\n  command_timeout_ms: 300\n  connect_timeout_ms: 2000\n  \
         failure_mode: error\n{extra}local: {{over_limit_cache: false}}\n",
        yaml_str(sentinels.password()),
        yaml_str(master_name),
        urls.join(", "),
        yaml_str(sentinels.sentinel_password()),
    )
}

/// One request of the load.
#[derive(Debug)]
struct Sample {
    /// The user, or `None` for the hot bucket.
    user: Option<String>,
    answered: u8,
    /// When the answer came.
    at: Instant,
    result: Result<Code, (tonic::Code, String)>,
}

/// Clients on their own users and on the hot bucket, each request tagged with the phase it was
/// answered in.
struct Load {
    phase: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Vec<Sample>>>,
}

impl Load {
    async fn start(tollgate: &Tollgate) -> Load {
        let phase = Arc::new(AtomicU8::new(STEADY));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for i in 0..USER_CLIENTS + HOT_CLIENTS {
            let mut client = connect(tollgate).await;
            let (phase, stop) = (phase.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let users: Vec<Option<String>> = if i < USER_CLIENTS {
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
                    let result = tokio::time::timeout(
                        Duration::from_secs(10),
                        client.should_rate_limit(request(DOMAIN, &entries, 0)),
                    )
                    .await
                    .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer within 10 s")));
                    samples.push(Sample {
                        user,
                        answered: phase.load(Ordering::SeqCst),
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
        Load { phase, stop, tasks }
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

/// Per phase: requests, errors, decisions.
fn summary(samples: &[Sample]) -> String {
    let mut by: BTreeMap<u8, (usize, usize)> = BTreeMap::new();
    for s in samples {
        let e = by.entry(s.answered).or_default();
        e.0 += 1;
        e.1 += usize::from(s.result.is_err());
    }
    PHASES
        .iter()
        .map(|(phase, name)| {
            let (n, errors) = by.get(phase).copied().unwrap_or_default();
            format!("{name}: {n} requests, {errors} errors")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The master killed under load: errors only until the sentinels have promoted the replica
/// (and tollgate's pool has reconnected through them), each UNAVAILABLE as `failure_mode:
/// error` says; then decisions again from the same process, ready again, with no bucket
/// admitting more than its capacity and refill (and, for the hot bucket, the one admission a
/// kill can lose before replication: see the module's documentation).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_master_costs_errors_only_until_the_sentinels_promote_its_replica() {
    if !redis_binaries_or_skip("a_killed_master_costs_errors_only_until_the_sentinels_promote_its_replica") {
        return;
    }
    let _one = one_at_a_time();
    let mut sentinels =
        block_in_place(|| RedisSentinels::start(PASSWORD, SENTINEL_PASSWORD, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS));
    let mut tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("sentinel.yaml", RULES)
            .settings(&sentinel_settings(&sentinels, SENTINEL_MASTER, ""))
            .start()
    });
    assert_eq!(readyz(&tollgate).0, 200, "ready through the sentinels");
    let pid = tollgate.process.id();
    let old_master = sentinels.master.port();
    let new_master = sentinels.replica.port();
    assert_eq!(block_in_place(|| sentinels.master_port(0)), Some(old_master));

    let started = Instant::now();
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    load.set_phase(KILLED);
    let killed = Instant::now();
    block_in_place(|| sentinels.kill_master());
    let promoted = loop {
        let named = block_in_place(|| (0..3).all(|i| sentinels.master_port(i) == Some(new_master)));
        if named {
            break Instant::now();
        }
        assert!(killed.elapsed() < Duration::from_secs(30), "no promotion within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    load.set_phase(CATCHING_UP);
    tokio::time::sleep(CATCH_UP_BOUND).await;
    load.set_phase(PROMOTED);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let samples = load.stop().await;
    let ran = started.elapsed();
    let last_error = samples.iter().filter(|s| s.result.is_err()).map(|s| s.at).max();
    eprintln!(
        "the sentinels named the replica {:?} after the kill, the last error came {:?} after that; {}",
        promoted - killed,
        last_error.map(|t| t.saturating_duration_since(promoted)),
        summary(&samples)
    );

    // The same process all along, ready again.
    assert!(tollgate.process.exited().is_none(), "tollgate exited");
    assert_eq!(tollgate.process.id(), pid);
    let (ready, body) = block_in_place(|| support::http_get(tollgate.http_addr, "/readyz")).expect("/readyz");
    assert_eq!(ready, 200, "ready on the promoted replica: {body}");

    // Errors only while the master was gone or just replaced, each UNAVAILABLE.
    let errors: Vec<&Sample> = samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(!errors.is_empty(), "the kill cost nothing: {}", summary(&samples));
    let outside: Vec<&&Sample> = errors
        .iter()
        .filter(|s| s.answered != KILLED && s.answered != CATCHING_UP)
        .collect();
    assert!(
        outside.is_empty(),
        "errors outside the outage: {outside:?}\n{}",
        summary(&samples)
    );
    let not_unavailable: Vec<&&Sample> = errors
        .iter()
        .filter(|s| !matches!(&s.result, Err((tonic::Code::Unavailable, _))))
        .collect();
    assert!(
        not_unavailable.is_empty(),
        "failure_mode error answers UNAVAILABLE: {not_unavailable:?}"
    );
    // Decided again on the promoted replica: real decisions, every user's bucket still
    // exhausted (its state came across with replication).
    let after: Vec<&Sample> = samples.iter().filter(|s| s.answered == PROMOTED).collect();
    assert!(
        after.len() > 100,
        "few requests after the promotion: {}",
        summary(&samples)
    );
    assert!(
        after.iter().all(|s| s.result.is_ok()),
        "errors after the promotion: {}",
        summary(&samples)
    );
    let user_over = after
        .iter()
        .filter(|s| s.user.is_some() && s.result == Ok(Code::OverLimit))
        .count();
    assert!(user_over > 0, "no user denied after the promotion");

    // No over-admission across the run.
    let mut per_user: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &samples {
        if let (Some(u), Ok(Code::Ok)) = (&s.user, &s.result) {
            *per_user.entry(u.as_str()).or_default() += 1;
        }
    }
    assert_eq!(per_user.len(), USER_CLIENTS * USERS_PER_CLIENT, "every user admitted");
    for (user, ok) in &per_user {
        assert!(*ok <= USER_CAPACITY, "user {user} admitted {ok} > {USER_CAPACITY}");
    }
    let hot_ok = samples
        .iter()
        .filter(|s| s.user.is_none() && s.result == Ok(Code::Ok))
        .count() as u64;
    let refilled = ran.as_secs() / HOT_REFILL.as_secs() + 1;
    let lost_write = 1;
    assert!(
        hot_ok <= HOT_CAPACITY + refilled + lost_write,
        "the hot bucket admitted {hot_ok} > {HOT_CAPACITY} + {refilled} + {lost_write}"
    );
    assert!(hot_ok >= HOT_CAPACITY, "the hot bucket admitted only {hot_ok}");

    // No secret in the log or in /config.
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
    let config = block_in_place(|| {
        support::http_get(tollgate.admin_addr, "/config")
            .map(|(_, body)| body)
            .unwrap_or_default()
    });
    for secret in [PASSWORD, SENTINEL_PASSWORD] {
        assert!(!log.contains(secret), "a password in the log");
        assert!(!config.contains(secret), "a password in /config: {config}");
    }
    assert!(
        config.contains(SENTINEL_MASTER),
        "/config shows the sentinel settings: {config}"
    );
}

/// Seven requests of `user`: its five tokens, then two denials (or the errors).
async fn decide_user(tollgate: &Tollgate, user: &str) -> Vec<Result<Code, tonic::Status>> {
    let mut client = connect(tollgate).await;
    let mut codes = Vec::new();
    for _ in 0..USER_CAPACITY + 2 {
        let answer = client.should_rate_limit(request(DOMAIN, &[("user", user)], 0)).await;
        codes.push(answer.map(|r| Code::try_from(r.into_inner().overall_code).expect("a known code")));
    }
    codes
}

/// Five admitted, then denied: decided by the store.
fn real_decisions() -> Vec<Code> {
    let mut codes = vec![Code::Ok; USER_CAPACITY];
    codes.extend([Code::OverLimit, Code::OverLimit]);
    codes
}

fn codes(answers: Vec<Result<Code, tonic::Status>>) -> Vec<Code> {
    answers
        .into_iter()
        .map(|a| a.unwrap_or_else(|e| panic!("an error instead of a decision: {e:?}")))
        .collect()
}

/// A master name the sentinels do not monitor stops `serve` with a message naming it and the
/// sentinels asked, in either `unreachable_at_start` mode (retrying cannot fix a name), and
/// no password; sentinels that cannot be reached stop it with `exit`, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_name_no_sentinel_knows_stops_start_up() {
    if !redis_binaries_or_skip("a_master_name_no_sentinel_knows_stops_start_up") {
        return;
    }
    let _one = one_at_a_time();
    let sentinels =
        block_in_place(|| RedisSentinels::start(PASSWORD, SENTINEL_PASSWORD, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS));
    for mode in ["exit", "not_ready"] {
        let settings = sentinel_settings(
            &sentinels,
            "no-such-master",
            &format!("  unreachable_at_start: {mode}\n"),
        );
        let (status, _, stderr, took) =
            block_in_place(|| crate::redis_faults::serve_to_exit(&settings, Duration::from_secs(20)));
        eprintln!("{mode}: {status:?} after {took:?}: {stderr}");
        let status = status.unwrap_or_else(|| panic!("{mode}: still running after 20 s: {stderr}"));
        assert!(!status.success(), "{mode}: exit status {status}");
        assert!(
            stderr.contains("no sentinel knows a master named \"no-such-master\""),
            "{mode}: {stderr}"
        );
        for addr in sentinels.addrs() {
            assert!(stderr.contains(&addr), "{mode}: {addr} not named: {stderr}");
        }
        assert!(stderr.contains("redis.sentinel.master_name"), "{stderr}");
        for secret in [PASSWORD, SENTINEL_PASSWORD] {
            assert!(!stderr.contains(secret), "a password in the message: {stderr}");
        }
    }
    // Sentinels where nothing listens: `exit` stops, saying none could be asked.
    let nobody = format!(
        "backend: redis\nredis:\n  sentinel:\n    master_name: m\n    urls: [\"redis://127.0.0.1:{}\"]\n  connect_timeout_ms: 1000\n",
        support::free_port()
    );
    let (status, _, stderr, _) =
        block_in_place(|| crate::redis_faults::serve_to_exit(&nobody, Duration::from_secs(20)));
    assert!(status.is_some_and(|s| !s.success()), "{status:?}: {stderr}");
    assert!(
        stderr.contains("no sentinel could be asked for master \"m\""),
        "{stderr}"
    );
}

/// envoyproxy/ratelimit's Sentinel environment (`REDIS_TYPE=SENTINEL`, `REDIS_URL` the master's
/// name then the sentinels, `REDIS_AUTH` for the master, `REDIS_SENTINEL_AUTH` for the
/// sentinels): decisions through the sentinels' master, and no password in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_sentinel_environment_decides_on_the_sentinels_master() {
    if !redis_binaries_or_skip("their_sentinel_environment_decides_on_the_sentinels_master") {
        return;
    }
    let sentinels =
        block_in_place(|| RedisSentinels::start(PASSWORD, SENTINEL_PASSWORD, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS));
    let url = format!("{SENTINEL_MASTER},{}", sentinels.addrs().join(","));
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("sentinel.yaml", RULES)
            .env("REDIS_TYPE", "SENTINEL")
            .env("REDIS_URL", &url)
            .env("REDIS_AUTH", PASSWORD)
            .env("REDIS_SENTINEL_AUTH", SENTINEL_PASSWORD)
            .env("USE_STATSD", "false")
            .start()
    });
    support::faults::eventually(Duration::from_secs(10), "ready", || readyz(&tollgate).0 == 200).await;
    assert_eq!(codes(decide_user(&tollgate, "theirs").await), real_decisions());
    let keys = block_in_place(|| sentinels.master.cli(&["DBSIZE"]));
    assert_ne!(keys, "0", "no bucket on the master");
    let log = tollgate.process.log();
    for secret in [PASSWORD, SENTINEL_PASSWORD] {
        assert!(!log.contains(secret), "a password in the log");
    }
}

/// Redis on a Unix socket only: `redis.urls: [unix:///path?db=2]` with `redis.password`, and
/// envoyproxy/ratelimit's `REDIS_SOCKET_TYPE=unix` with the socket's path in `REDIS_URL` and
/// `REDIS_AUTH`: both decide on that Redis (the first in database 2, the second in 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_a_unix_socket_from_settings_and_their_environment() {
    if !redis_binaries_or_skip("redis_over_a_unix_socket_from_settings_and_their_environment") {
        return;
    }
    let redis = block_in_place(|| UnixRedis::start(Some(PASSWORD)));
    let ours = block_in_place(|| {
        Tollgate::builder()
            .rules_file("sentinel.yaml", RULES)
            .settings(&format!(
                "backend: redis\nredis:\n  urls: [{}]\n  password: {}\n",
                yaml_str(&format!("{}?db=2", redis.url())),
                yaml_str(PASSWORD)
            ))
            .start()
    });
    assert_eq!(readyz(&ours).0, 200, "ready on the socket");
    assert_eq!(codes(decide_user(&ours, "ours").await), real_decisions());
    assert_ne!(
        block_in_place(|| redis.cli(&["-n", "2", "DBSIZE"])),
        "0",
        "nothing in database 2"
    );
    assert_eq!(block_in_place(|| redis.cli(&["-n", "0", "DBSIZE"])), "0");

    let theirs = block_in_place(|| {
        Tollgate::builder()
            .rules_file("sentinel.yaml", RULES)
            .env("REDIS_SOCKET_TYPE", "unix")
            .env("REDIS_URL", &redis.socket().to_string_lossy())
            .env("REDIS_AUTH", PASSWORD)
            .env("USE_STATSD", "false")
            .start()
    });
    support::faults::eventually(Duration::from_secs(10), "ready", || readyz(&theirs).0 == 200).await;
    assert_eq!(codes(decide_user(&theirs, "theirs").await), real_decisions());
    assert_ne!(
        block_in_place(|| redis.cli(&["-n", "0", "DBSIZE"])),
        "0",
        "nothing in database 0"
    );
    for tollgate in [&ours, &theirs] {
        let log = tollgate.process.log();
        assert!(!log.contains(PASSWORD), "a password in the log");
    }
}
