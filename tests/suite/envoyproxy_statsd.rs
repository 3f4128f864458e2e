//! `USE_STATSD=true`: tollgate started with envoyproxy/ratelimit's environment (their compose
//! file's `USE_STATSD`, `STATSD_HOST`, `STATSD_PORT`) sends their stats, under their names, to
//! a statsd server that is a socket of the test on 127.0.0.1: exact counts after known
//! requests, reloads counted in `config_load_success` / `config_load_error` (in statsd and in
//! Prometheus), TCP by default as theirs, UDP with `STATSD_PROTOCOL=udp`, and a server that is
//! gone costing no decision.
//!
//! Each test runs a private `redis-server` (their environment's backend) on a free loopback port.

use crate::support;

use std::collections::BTreeMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::redis::RedisServer;
use support::{free_port, http_get, raw_call, request, ChildGuard};

/// Three rules in their schema: `client: vip` 10 a minute, any other `client` 2, and `trial`
/// once a minute in shadow mode.
const RULES: &str = r#"domain: rl
descriptors:
  - key: client
    value: vip
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: client
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: trial
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

/// What the statsd server received: counters summed over flushes, timer samples by name, and
/// every line as it came.
#[derive(Default, Debug)]
struct Received {
    counters: BTreeMap<String, u64>,
    timers: BTreeMap<String, Vec<u64>>,
    lines: Vec<String>,
}

impl Received {
    /// Adds the lines of `text`; panics on a line that is not `name:value|c` or `name:value|ms`.
    fn add(&mut self, text: &str) {
        for line in text.lines().filter(|l| !l.is_empty()) {
            let (name, rest) = line
                .rsplit_once(':')
                .unwrap_or_else(|| panic!("not a statsd line: {line:?}"));
            let (value, kind) = rest.split_once('|').unwrap_or_else(|| panic!("no type: {line:?}"));
            let value: u64 = value.parse().unwrap_or_else(|_| panic!("not a whole value: {line:?}"));
            match kind {
                "c" => {
                    assert!(value > 0, "a counter that gained nothing was sent: {line:?}");
                    *self.counters.entry(name.to_owned()).or_default() += value;
                }
                "ms" => self.timers.entry(name.to_owned()).or_default().push(value),
                _ => panic!("unexpected type in {line:?}"),
            }
            self.lines.push(line.to_owned());
        }
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }
}

/// Their folder layout under a temporary root: `<root>/ratelimit/config/config.yaml`.
struct Runtime {
    root: tempfile::TempDir,
}

impl Runtime {
    fn new(rules: &str) -> Runtime {
        let root = tempfile::Builder::new().prefix("tollgate-statsd.").tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("ratelimit/config")).unwrap();
        let runtime = Runtime { root };
        runtime.write(rules);
        runtime
    }

    /// Replaces the rules file in one rename, so a reload never reads it half-written.
    fn write(&self, rules: &str) {
        let dir = self.root.path().join("ratelimit/config");
        std::fs::write(dir.join(".next"), rules).unwrap();
        std::fs::rename(dir.join(".next"), dir.join("config.yaml")).unwrap();
    }

    fn path(&self) -> &Path {
        self.root.path()
    }
}

/// A tollgate started as `tollgate serve` with exactly their environment `env` (plus listeners
/// on free loopback ports and a private admin port), healthy.
struct Started {
    process: ChildGuard,
    http: SocketAddr,
    grpc: String,
    _dir: tempfile::TempDir,
}

fn start(runtime: &Runtime, redis: &RedisServer, env: &[(&str, String)]) -> Started {
    let dir = tempfile::tempdir().unwrap();
    let (http_port, grpc_port) = (free_port(), free_port());
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .arg("serve")
        .env_clear()
        .env("NO_COLOR", "1")
        .current_dir(dir.path())
        .env("HOST", "127.0.0.1")
        .env("PORT", http_port.to_string())
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc_port.to_string())
        .env("TOLLGATE_ADMIN__ADDR", format!("127.0.0.1:{}", free_port()))
        .env("TOLLGATE_REDIS__COMMAND_TIMEOUT_MS", "1000")
        .env("TOLLGATE_SHUTDOWN__DRAIN_SECONDS", "0")
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port()))
        .env("RUNTIME_ROOT", runtime.path())
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_WATCH_ROOT", "false")
        .env("LOG_LEVEL", "info");
    for (k, v) in env {
        command.env(k, v);
    }
    let mut process = ChildGuard::spawn("tollgate", &mut command, &dir.path().join("tollgate.log"));
    let http = SocketAddr::from(([127, 0, 0, 1], http_port));
    support::wait_until(&mut process, || {
        http_get(http, "/healthcheck").filter(|(status, body)| *status == 200 && body == "OK")
    })
    .unwrap_or_else(|why| panic!("tollgate did not become healthy: {why}\n{}", process.log_tail(60)));
    Started {
        process,
        http,
        grpc: format!("http://127.0.0.1:{grpc_port}"),
        _dir: dir,
    }
}

/// The known requests: `client: vip` three times, `client: bob` four times, `trial` twice.
async fn send_known_requests(grpc: &str) {
    for _ in 0..3 {
        raw_call(grpc, request("rl", &[("client", "vip")], 0)).await.unwrap();
    }
    for _ in 0..4 {
        raw_call(grpc, request("rl", &[("client", "bob")], 0)).await.unwrap();
    }
    for _ in 0..2 {
        raw_call(grpc, request("rl", &[("trial", "t")], 0)).await.unwrap();
    }
}

/// The value of the unlabelled Prometheus series `name` on `/metrics`.
fn prometheus_value(http: SocketAddr, name: &str) -> Option<f64> {
    let (status, body) = http_get(http, "/metrics")?;
    assert_eq!(status, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Their per-rule stats of the known requests, as their limiter counts them (the same counts
/// `envoyproxy_env.rs` checks on their Prometheus names).
fn expected_rule_stats() -> BTreeMap<String, u64> {
    let mut expected = BTreeMap::new();
    let mut put = |key: &str, stats: &[(&str, u64)]| {
        for (stat, n) in stats {
            expected.insert(format!("ratelimit.service.rate_limit.rl.{key}.{stat}"), *n);
        }
    };
    // 3 hits within 10: the near-limit threshold (8 used) unreached.
    put("client_vip", &[("total_hits", 3), ("within_limit", 3)]);
    // Capacity 2, threshold floor(1.6) = 1: the second hit is near, the last two over.
    put(
        "client",
        &[
            ("total_hits", 4),
            ("within_limit", 2),
            ("near_limit", 1),
            ("over_limit", 2),
        ],
    );
    // Shadow mode: the second hit is over (and counted in shadow_mode) but admitted.
    put(
        "trial",
        &[
            ("total_hits", 2),
            ("within_limit", 1),
            ("near_limit", 1),
            ("over_limit", 1),
            ("shadow_mode", 1),
        ],
    );
    expected
}

/// Over UDP (`STATSD_PROTOCOL=udp`): after the known requests, an invalid rules edit and a
/// valid one, the server has received exactly their stats: the per-rule counters, the calls'
/// counter and one response-time sample per call, an unknown domain's descriptors, the config loads (the one at start, the
/// valid edit; the invalid one as an error), and nothing else. Prometheus agrees on the loads.
/// Then Redis goes away and the failed call is their `redis_error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_lines_carry_their_names_and_exact_counts() {
    let redis = tokio::task::block_in_place(RedisServer::start);
    let runtime = Runtime::new(RULES);
    let server = UdpSocket::bind("127.0.0.1:0").unwrap();
    server.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let port = server.local_addr().unwrap().port();
    let env = [
        ("USE_STATSD", "true".to_owned()),
        ("STATSD_HOST", "127.0.0.1".to_owned()),
        ("STATSD_PORT", port.to_string()),
        ("STATSD_PROTOCOL", "udp".to_owned()),
        ("STATS_FLUSH_INTERVAL", "200ms".to_owned()),
    ];
    let tollgate = tokio::task::block_in_place(|| start(&runtime, &redis, &env));
    send_known_requests(&tollgate.grpc).await;
    // A domain no rules declare: theirs counts each of its descriptors under its name.
    let unknown = envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: "nope".into(),
        descriptors: vec![support::descriptor(&[("a", "1")]), support::descriptor(&[("b", "2")])],
        hits_addend: 0,
    };
    raw_call(&tollgate.grpc, unknown).await.unwrap();

    // A broken edit is refused (their config_load_error), then a valid one is loaded.
    runtime.write("domain: rl\ndescriptors: [\n");
    let http = tollgate.http;
    let load_error = || prometheus_value(http, "ratelimit_service_config_load_error");
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::task::block_in_place(load_error) != Some(1.0) {
        assert!(Instant::now() < deadline, "the broken edit was not refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    runtime.write(&RULES.replace("requests_per_unit: 10", "requests_per_unit: 11"));
    let load_success = || prometheus_value(http, "ratelimit_service_config_load_success");
    while tokio::task::block_in_place(load_success) != Some(2.0) {
        assert!(Instant::now() < deadline, "the valid edit was not loaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(tokio::task::block_in_place(load_error), Some(1.0));

    let mut expected = expected_rule_stats();
    expected.insert("ratelimit_server.ShouldRateLimit.total_requests".into(), 10);
    expected.insert("ratelimit.service.rate_limit.nope.domain_not_found".into(), 2);
    expected.insert("ratelimit.service.config_load_success".into(), 2);
    expected.insert("ratelimit.service.config_load_error".into(), 1);
    let received = tokio::task::block_in_place(|| {
        let mut received = Received::default();
        let mut buf = [0u8; 65536];
        let deadline = Instant::now() + Duration::from_secs(20);
        while received.counters != expected || received.timers.values().map(Vec::len).sum::<usize>() < 10 {
            if Instant::now() > deadline {
                break;
            }
            if let Ok(n) = server.recv(&mut buf) {
                assert!(n <= 1432, "a datagram of {n} bytes");
                received.add(std::str::from_utf8(&buf[..n]).unwrap());
            }
        }
        // A further flush or two: nothing more may come (nothing gained since).
        let quiet = Instant::now() + Duration::from_millis(600);
        while Instant::now() < quiet {
            if let Ok(n) = server.recv(&mut buf) {
                received.add(std::str::from_utf8(&buf[..n]).unwrap());
            }
        }
        received
    });
    assert_eq!(
        received.counters,
        expected,
        "{}\n{}",
        received.lines.join("\n"),
        tollgate.process.log_tail(30)
    );
    let times: Vec<&String> = received.timers.keys().collect();
    assert_eq!(times, ["ratelimit_server.ShouldRateLimit.response_time"]);
    let samples = &received.timers["ratelimit_server.ShouldRateLimit.response_time"];
    assert_eq!(samples.len(), 10, "one sample per call: {samples:?}");
    assert!(samples.iter().all(|ms| *ms < 5_000), "{samples:?}");

    // Redis gone: the next call fails (UNAVAILABLE), counted as their redis_error.
    drop(redis);
    let failed = raw_call(&tollgate.grpc, request("rl", &[("client", "vip")], 0)).await;
    assert_eq!(failed.map_err(|e| e.code()).err(), Some(tonic::Code::Unavailable));
    let more = tokio::task::block_in_place(|| {
        let mut more = Received::default();
        let mut buf = [0u8; 65536];
        let deadline = Instant::now() + Duration::from_secs(20);
        let error = "ratelimit.service.call.should_rate_limit.redis_error";
        let calls = "ratelimit_server.ShouldRateLimit.total_requests";
        while (more.counter(error) == 0 || more.counter(calls) == 0) && Instant::now() < deadline {
            if let Ok(n) = server.recv(&mut buf) {
                more.add(std::str::from_utf8(&buf[..n]).unwrap());
            }
        }
        more
    });
    assert_eq!(
        more.counter("ratelimit.service.call.should_rate_limit.redis_error"),
        1,
        "{more:?}"
    );
    assert_eq!(
        more.counter("ratelimit_server.ShouldRateLimit.total_requests"),
        1,
        "{more:?}"
    );
}

/// By default over TCP, as their stats library; `EXTRA_TAGS` suffix every name as theirs
/// does. While the server is gone decisions are answered as before, and the lines resume once
/// it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_by_default_and_a_server_gone_costs_no_decision() {
    let redis = tokio::task::block_in_place(RedisServer::start);
    let runtime = Runtime::new(RULES);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let env = [
        ("USE_STATSD", "true".to_owned()),
        ("STATSD_HOST", "127.0.0.1".to_owned()),
        ("STATSD_PORT", port.to_string()),
        ("EXTRA_TAGS", "env:ci,version:1.2".to_owned()),
        ("STATS_FLUSH_INTERVAL", "300ms".to_owned()),
    ];
    let tollgate = tokio::task::block_in_place(|| start(&runtime, &redis, &env));
    let (mut conn, _) = tokio::task::block_in_place(|| listener.accept()).unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let calls = "ratelimit_server.ShouldRateLimit.total_requests.__env=ci.__version=1_2";
    let loads = "ratelimit.service.config_load_success.__env=ci.__version=1_2";
    raw_call(&tollgate.grpc, request("rl", &[("client", "vip")], 0))
        .await
        .unwrap();
    let read_until = |conn: &mut std::net::TcpStream, received: &mut Received, done: &dyn Fn(&Received) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut pending = String::new();
        let mut buf = [0u8; 4096];
        while !done(received) && Instant::now() < deadline {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    pending.push_str(std::str::from_utf8(&buf[..n]).unwrap());
                    if let Some(end) = pending.rfind('\n') {
                        received.add(&pending[..=end]);
                        pending.drain(..=end);
                    }
                }
                Err(_) => {}
            }
        }
    };
    let mut received = Received::default();
    tokio::task::block_in_place(|| {
        read_until(&mut conn, &mut received, &|r| {
            r.counter(calls) == 1 && r.counter(loads) == 1
        })
    });
    assert_eq!(
        (received.counter(calls), received.counter(loads)),
        (1, 1),
        "{received:?}"
    );
    assert_eq!(
        received.counter("ratelimit.service.rate_limit.rl.client_vip.total_hits.__env=ci.__version=1_2"),
        1,
        "{received:?}"
    );

    // The server goes away: 200 decisions are answered, none waiting on it.
    drop(conn);
    drop(listener);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for _ in 0..200 {
        let one = Instant::now();
        raw_call(&tollgate.grpc, request("rl", &[("client", "vip")], 0))
            .await
            .unwrap();
        slowest = slowest.max(one.elapsed());
    }
    assert!(slowest < Duration::from_secs(1), "a decision took {slowest:?}");
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());

    // Back on the same port: after the retry pause (3 s, their library's), lines arrive again.
    // What is gained during the pause is dropped, so a call is made until the server is
    // reached; the calls after the connection are all counted.
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut conn = loop {
        raw_call(&tollgate.grpc, request("rl", &[("trial", "t")], 0))
            .await
            .unwrap();
        match listener.accept() {
            Ok((conn, _)) => break conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no connection again: {e}\n{}", tollgate.process.log_tail(30)),
        }
    };
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let trial = "ratelimit.service.rate_limit.rl.trial.total_hits.__env=ci.__version=1_2";
    let mut after = Received::default();
    tokio::task::block_in_place(|| read_until(&mut conn, &mut after, &|r| r.counter(trial) >= 1));
    assert!(
        after.counter(trial) >= 1,
        "{after:?}\n{}",
        tollgate.process.log_tail(30)
    );
}

/// With their default flush interval far away, the counters' gains are still sent when
/// tollgate stops (SIGTERM), not lost with the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_gains_are_sent_at_shutdown() {
    let redis = tokio::task::block_in_place(RedisServer::start);
    let runtime = Runtime::new(RULES);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let env = [
        ("USE_STATSD", "true".to_owned()),
        ("STATSD_HOST", "127.0.0.1".to_owned()),
        ("STATSD_PORT", port.to_string()),
        ("STATS_FLUSH_INTERVAL", "1h".to_owned()),
    ];
    let mut tollgate = tokio::task::block_in_place(|| start(&runtime, &redis, &env));
    for _ in 0..2 {
        raw_call(&tollgate.grpc, request("rl", &[("client", "bob")], 0))
            .await
            .unwrap();
    }
    support::signal(tollgate.process.id(), "TERM");
    let text = tokio::task::block_in_place(|| {
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).unwrap();
        text
    });
    let mut received = Received::default();
    received.add(&text);
    let exited = tokio::task::block_in_place(|| support::wait_until(&mut tollgate.process, || None::<()>));
    assert!(exited.is_err_and(|why| why.contains("exited")), "tollgate did not exit");
    assert_eq!(
        received.counter("ratelimit_server.ShouldRateLimit.total_requests"),
        2,
        "{text}"
    );
    assert_eq!(
        received.counter("ratelimit.service.rate_limit.rl.client.total_hits"),
        2,
        "{text}"
    );
    assert_eq!(received.counter("ratelimit.service.config_load_success"), 1, "{text}");
    assert_eq!(
        received.timers["ratelimit_server.ShouldRateLimit.response_time"].len(),
        2
    );
}

/// Without `USE_STATSD` their service sends statsd to localhost:8125, and so does tollgate;
/// with `USE_PROMETHEUS=true` alone (which theirs cannot combine with statsd) it does not.
#[test]
fn unset_use_statsd_follows_their_default() {
    let env = |vars: &[(&str, &str)]| {
        tollgate::server::settings::envoyproxy_env::EnvoyproxyEnv::read(
            vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
            true,
        )
        .unwrap()
        .document()
    };
    assert_eq!(env(&[])["metrics"]["statsd"]["addr"], "localhost:8125");
    assert_eq!(env(&[])["metrics"]["statsd"]["protocol"], "tcp");
    assert!(env(&[("USE_PROMETHEUS", "true")])["metrics"].get("statsd").is_none());
}
