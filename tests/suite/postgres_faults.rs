// The tests that load the machine hold a std Mutex across awaits on purpose: it only keeps
// them from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! The Postgres backend when Postgres fails, on a running `tollgate serve` against a private
//! throwaway PostgreSQL cluster (`initdb` in a temporary directory, another loopback port; never
//! the shared server on 5432): Postgres crashed (an immediate shutdown) and restarted under load,
//! in `failure_mode: error` and `fallback`; Postgres paused (SIGSTOP), so every call times out;
//! Postgres not there at start; and Redis's fallback to a Postgres that is paused too. Each
//! request is answered within the command timeout plus a little, never by a panic; the breaker
//! opens and closes by itself; `/readyz` and the metrics tell; and decisions return to Postgres
//! once it answers.

use crate::support;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::faults::{
    self, call, calls, circuit_open, connect, eventually, one_at_a_time, readyz, real_decisions, scrape,
    start_tollgate, summary, Load, Sample, AFTER, BEFORE, CAPACITY, CHANGING, CLIENTS, OUTAGE_PHASE, RULES,
};
use support::postgres::{server_bin_or_skip, PostgresServer};
use support::redis::RedisServer;
use support::{yaml_str, Tollgate};
use tokio::task::block_in_place;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

/// `postgres.command_timeout_ms` in these tests (a debug build on a busy two-core machine).
const COMMAND_TIMEOUT_MS: u64 = 300;
/// What a request may take beyond the command timeout.
const SLACK: Duration = Duration::from_millis(750);
/// How long Postgres stays away in the outage tests.
const OUTAGE: Duration = Duration::from_secs(2);
const BREAKER_FAILURES: u32 = 3;
const BREAKER_OPEN_MS: u64 = 200;
/// How long recovery (new connections, then a probe through the breaker) may take.
const RECOVERY: Duration = Duration::from_secs(10);

const ERRORS: &str = "tollgate_backend_errors_total";
const FALLBACKS: &str = "tollgate_backend_fallbacks_total";
const FAILURE_ANSWERS: &str = "tollgate_backend_failure_answers_total";

fn max_latency() -> Duration {
    Duration::from_millis(COMMAND_TIMEOUT_MS) + SLACK
}

/// The `postgres:` settings map for `url` with `failure_mode: mode`; `extra` is appended inside
/// it (`, key: value`).
fn postgres_section(url: &str, mode: &str, extra: &str) -> String {
    format!(
        "postgres: {{url: {}, command_timeout_ms: {COMMAND_TIMEOUT_MS}, failure_mode: {mode}, \
         breaker_failures: {BREAKER_FAILURES}, breaker_open_ms: {BREAKER_OPEN_MS}, connect_timeout_ms: 1000{extra}}}",
        yaml_str(url)
    )
}

/// [`faults::exhaust`] within this file's latency bound.
async fn exhaust(client: &mut RateLimitServiceClient<Channel>, user: &str) -> Vec<Code> {
    faults::exhaust(client, user, max_latency()).await
}

/// How many bucket rows in the private cluster's `tollgate` schema end with `user`.
fn rows_for(postgres: &PostgresServer, user: &str) -> u64 {
    let sql = format!(
        "SELECT count(*) FROM tollgate.tollgate_buckets WHERE position(convert_to('{user}', 'UTF8') in key) > 0"
    );
    postgres
        .psql("tollgate", &sql)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("count the rows for {user}"))
}

/// No request slower than the bound, and the process never panicked.
fn check_no_slow_request_and_no_panic(tollgate: &Tollgate, samples: &[Sample]) {
    let slow: Vec<&Sample> = samples.iter().filter(|s| s.took > max_latency()).collect();
    assert!(
        slow.is_empty(),
        "{} requests took over {:?}: {:?}\n{}",
        slow.len(),
        max_latency(),
        slow.iter().take(10).collect::<Vec<_>>(),
        summary(samples)
    );
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
}

/// gRPC health of `""` and of the `RateLimitService`.
async fn grpc_health(tollgate: &Tollgate) -> [ServingStatus; 2] {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let channel = Channel::from_shared(format!("http://{}", tollgate.grpc_addr))
        .unwrap()
        .connect()
        .await
        .expect("connect for health");
    let mut health = HealthClient::new(channel);
    let mut out = [ServingStatus::Unknown; 2];
    for (i, service) in ["", "envoy.service.ratelimit.v3.RateLimitService"].iter().enumerate() {
        let status = health
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .expect("health answers")
            .into_inner()
            .status;
        out[i] = ServingStatus::try_from(status).expect("a known status");
    }
    out
}

/// What an outage scenario saw.
struct Outage {
    postgres: PostgresServer,
    tollgate: Tollgate,
    samples: Vec<Sample>,
    readyz_during: (u16, String),
    circuit_during: f64,
    /// One call for a fresh user during the outage.
    during: Result<Code, tonic::Code>,
    calls_at_restart: f64,
    calls_at_end: f64,
    recovered_in: Duration,
    exhaust_after: Vec<Code>,
}

/// A private cluster, tollgate on it in `failure_mode: mode`, load from `CLIENTS` clients;
/// Postgres is crashed (immediate shutdown) for `OUTAGE`, then restarted on the same port and
/// data; the load goes on until tollgate has recovered by itself and a little after.
async fn outage(bin: &std::path::Path, mode: &str) -> Outage {
    let mut postgres = block_in_place(|| PostgresServer::start(bin));
    let settings = format!("backend: postgres\n{}", postgres_section(&postgres.url(), mode, ""));
    let tollgate = block_in_place(|| start_tollgate(&settings));
    assert_eq!(
        readyz(&tollgate),
        (200, "ready\n".to_owned()),
        "ready on a healthy Postgres"
    );
    let mut probe = connect(&tollgate).await;
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    load.set_phase(CHANGING);
    block_in_place(|| postgres.crash());
    load.set_phase(OUTAGE_PHASE);
    let crashed = Instant::now();
    eventually(Duration::from_secs(3), "circuit open after the crash", || {
        circuit_open(&tollgate, "postgres") == 1.0
    })
    .await;
    let readyz_during = readyz(&tollgate);
    let circuit_during = circuit_open(&tollgate, "postgres");
    let during = call(&mut probe, "probe-during")
        .await
        .1
        .map(|r| faults::code(&r))
        .map_err(|e| e.code());
    tokio::time::sleep(OUTAGE.saturating_sub(crashed.elapsed())).await;

    load.set_phase(CHANGING);
    block_in_place(|| postgres.restart());
    load.set_phase(AFTER);
    let calls_at_restart = calls(&tollgate, "postgres");
    let recovered_in = eventually(RECOVERY, "circuit closed and /readyz ready after the restart", || {
        circuit_open(&tollgate, "postgres") == 0.0 && readyz(&tollgate) == (200, "ready\n".to_owned())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let samples = load.stop().await;
    let exhaust_after = exhaust(&mut probe, "probe-after").await;
    let calls_at_end = calls(&tollgate, "postgres");
    eprintln!(
        "{mode}: {}; recovered {recovered_in:?} after the restart",
        summary(&samples)
    );
    Outage {
        postgres,
        tollgate,
        samples,
        readyz_during,
        circuit_during,
        during,
        calls_at_restart,
        calls_at_end,
        recovered_in,
        exhaust_after,
    }
}

impl Outage {
    /// What every mode shares: answers within the bound and no panic, decisions on Postgres
    /// before, the outage seen in the circuit gauge and the log, recovery by itself, and
    /// decisions on Postgres again (rows there).
    fn check_common(&self) {
        check_no_slow_request_and_no_panic(&self.tollgate, &self.samples);
        for phase in [BEFORE, OUTAGE_PHASE, AFTER] {
            assert!(
                self.samples.iter().filter(|s| s.within(phase)).count() >= CLIENTS,
                "too few requests in phase {phase}: {}",
                summary(&self.samples)
            );
        }
        let before: Vec<&Sample> = self.samples.iter().filter(|s| s.within(BEFORE)).collect();
        assert!(before.iter().all(|s| s.result.is_ok()), "{}", summary(&self.samples));
        assert!(
            before.iter().any(|s| s.result == Ok((Code::OverLimit, true))),
            "no OVER_LIMIT before the outage: {}",
            summary(&self.samples)
        );
        assert_eq!(self.circuit_during, 1.0, "circuit gauge during the outage");
        let log = self.tollgate.process.log();
        assert!(log.contains("backend failing: circuit open"), "{log}");
        assert!(log.contains("backend answers again: circuit closed"), "{log}");
        assert!(self.recovered_in < RECOVERY);
        assert!(
            self.calls_at_end > self.calls_at_restart,
            "no Postgres calls after the restart: {} then {}",
            self.calls_at_restart,
            self.calls_at_end
        );
        assert_eq!(self.exhaust_after, real_decisions(), "decisions after the restart");
        assert_eq!(
            block_in_place(|| rows_for(&self.postgres, "probe-after")),
            1,
            "the decision after the restart is a row in Postgres"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn error_mode_answers_unavailable_while_postgres_is_down_then_recovers() {
    let Some(bin) = server_bin_or_skip("error_mode_answers_unavailable_while_postgres_is_down_then_recovers") else {
        return;
    };
    let _serial = one_at_a_time();
    let o = outage(&bin, "error").await;
    o.check_common();
    assert_eq!(o.readyz_during.0, 503, "{:?}", o.readyz_during);
    assert!(o.readyz_during.1.contains("Postgres"), "{:?}", o.readyz_during);
    assert_eq!(o.during, Err(tonic::Code::Unavailable));
    let outage: Vec<&Sample> = o.samples.iter().filter(|s| s.within(OUTAGE_PHASE)).collect();
    assert!(
        outage.iter().all(|s| s.result == Err(tonic::Code::Unavailable)),
        "{}",
        summary(&o.samples)
    );
    let m = scrape(&o.tollgate);
    assert!(
        m.counter(ERRORS, &[("backend", "postgres"), ("kind", "error")])
            + m.counter(ERRORS, &[("backend", "postgres"), ("kind", "timeout")])
            >= f64::from(BREAKER_FAILURES)
    );
    // Thousands of UNAVAILABLE answers, about one log line a second (the outage is ~2 s).
    let log = o.tollgate.process.log();
    let lines = log.matches("answering UNAVAILABLE").count();
    assert!(
        (1..=6).contains(&lines),
        "{lines} UNAVAILABLE lines for {} answers",
        outage.len()
    );
    // Each names the request it answered (its x-request-id).
    for line in log.lines().filter(|l| l.contains("answering UNAVAILABLE")) {
        assert!(
            line.contains(&format!("request_id=\"{}", support::faults::REQUEST_ID)),
            "{line}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fallback_mode_decides_locally_while_postgres_is_down_then_returns() {
    let Some(bin) = server_bin_or_skip("fallback_mode_decides_locally_while_postgres_is_down_then_returns") else {
        return;
    };
    let _serial = one_at_a_time();
    let o = outage(&bin, "fallback").await;
    o.check_common();
    assert_eq!(
        o.readyz_during.0, 200,
        "still ready with a fallback: {:?}",
        o.readyz_during
    );
    assert!(
        o.readyz_during.1.contains("degraded") && o.readyz_during.1.contains("memory fallback"),
        "{:?}",
        o.readyz_during
    );
    assert_eq!(o.during, Ok(Code::Ok), "the memory fallback decides");
    let failed: Vec<&Sample> = o.samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    let m = scrape(&o.tollgate);
    assert!(m.counter(FALLBACKS, &[("backend", "postgres")]) > 0.0);
    assert!(calls(&o.tollgate, "memory") > 0.0);
    // Back on Postgres: the fallback is no longer asked.
    let fallbacks = m.counter(FALLBACKS, &[("backend", "postgres")]);
    let mut c = connect(&o.tollgate).await;
    assert_eq!(exhaust(&mut c, "probe-later").await, real_decisions());
    assert_eq!(
        scrape(&o.tollgate).counter(FALLBACKS, &[("backend", "postgres")]),
        fallbacks
    );
}

/// A paused Postgres (SIGSTOP: connections and statements go unanswered) costs each request at
/// most the command timeout; once the breaker opens, Postgres is asked about once per
/// `breaker_open_ms`; after SIGCONT decisions are on Postgres again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_postgres_costs_at_most_the_command_timeout() {
    let Some(bin) = server_bin_or_skip("a_paused_postgres_costs_at_most_the_command_timeout") else {
        return;
    };
    let _serial = one_at_a_time();
    let postgres = block_in_place(|| PostgresServer::start(&bin));
    let settings = format!("backend: postgres\n{}", postgres_section(&postgres.url(), "allow", ""));
    let tollgate = block_in_place(|| start_tollgate(&settings));
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    load.set_phase(CHANGING);
    block_in_place(|| postgres.pause());
    load.set_phase(OUTAGE_PHASE);
    let opened_in = eventually(Duration::from_secs(3), "circuit open while Postgres is paused", || {
        circuit_open(&tollgate, "postgres") == 1.0
    })
    .await;
    let (status, body) = readyz(&tollgate);
    assert_eq!(status, 503, "/readyz with the circuit open: {body}");
    let mut probe = connect(&tollgate).await;
    assert_eq!(exhaust(&mut probe, "probe-during").await, vec![Code::Ok; CAPACITY + 2]);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let m = scrape(&tollgate);
    let timeouts = m.counter(ERRORS, &[("backend", "postgres"), ("kind", "timeout")]);
    assert!(timeouts >= f64::from(BREAKER_FAILURES), "timeouts counted: {timeouts}");
    assert!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]) > 0.0);
    let calls_paused = calls(&tollgate, "postgres");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let probes = calls(&tollgate, "postgres") - calls_paused;
    assert!(
        probes <= (1000 / BREAKER_OPEN_MS + 2) as f64,
        "{probes} Postgres calls in 1 s with the circuit open"
    );

    load.set_phase(CHANGING);
    block_in_place(|| postgres.resume());
    load.set_phase(AFTER);
    let recovered = eventually(RECOVERY, "circuit closed and /readyz 200 after SIGCONT", || {
        circuit_open(&tollgate, "postgres") == 0.0 && readyz(&tollgate).0 == 200
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = load.stop().await;
    eprintln!(
        "paused: {}; circuit opened {opened_in:?} into the pause, closed {recovered:?} after SIGCONT",
        summary(&samples)
    );
    check_no_slow_request_and_no_panic(&tollgate, &samples);
    let failed: Vec<&Sample> = samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    for s in samples.iter().filter(|s| s.within(OUTAGE_PHASE)) {
        assert_eq!(s.result, Ok((Code::Ok, false)), "answer while paused");
    }
    assert_eq!(exhaust(&mut probe, "probe-after").await, real_decisions());
    assert_eq!(block_in_place(|| rows_for(&postgres, "probe-after")), 1);
}

/// Postgres not there at start, with `unreachable_at_start: not_ready`: tollgate starts, says
/// not ready naming Postgres, answers by its failure mode; once the cluster starts on that port
/// it connects, migrates and gets ready by itself, without traffic, and decides on Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_at_start_until_postgres_comes() {
    let Some(bin) = server_bin_or_skip("not_ready_at_start_until_postgres_comes") else {
        return;
    };
    let _serial = one_at_a_time();
    let mut postgres = block_in_place(|| PostgresServer::init(&bin, None));
    let settings = format!(
        "backend: postgres\n{}",
        postgres_section(&postgres.url(), "deny", ", unreachable_at_start: not_ready")
    );
    let tollgate = block_in_place(|| start_tollgate(&settings));
    let (status, body) = readyz(&tollgate);
    assert_eq!(status, 503, "/readyz without Postgres: {body}");
    // Public: it names the backend, not its address; the log has that.
    let address = format!("127.0.0.1:{}", postgres.port());
    assert!(
        !body.contains(&address) && body.contains("Postgres"),
        "/readyz names Postgres, not its address: {body}"
    );
    assert!(
        tollgate.process.log().contains(&address),
        "the log names the address: {}",
        tollgate.process.log_tail(20)
    );
    assert!(
        tollgate.process.log().contains("Postgres not reachable at start"),
        "{}",
        tollgate.process.log()
    );
    let mut c = connect(&tollgate).await;
    assert_eq!(
        exhaust(&mut c, "early").await,
        vec![Code::OverLimit; CAPACITY + 2],
        "failure_mode: deny"
    );
    assert_eq!(
        scrape(&tollgate).counter(FAILURE_ANSWERS, &[("answer", "deny")]),
        (CAPACITY + 2) as f64
    );

    // gRPC health says the same as /readyz (Envoy can health-check the rate-limit cluster).
    let deadline = Instant::now() + Duration::from_secs(3);
    while grpc_health(&tollgate).await != [ServingStatus::NotServing; 2] {
        assert!(Instant::now() < deadline, "gRPC health still SERVING without Postgres");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    block_in_place(|| postgres.restart());
    let ready_in = eventually(RECOVERY, "/readyz 200 once Postgres is there, without traffic", || {
        readyz(&tollgate).0 == 200
    })
    .await;
    let deadline = Instant::now() + RECOVERY;
    while grpc_health(&tollgate).await != [ServingStatus::Serving; 2] {
        assert!(
            Instant::now() < deadline,
            "gRPC health not SERVING once Postgres is there"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("not_ready: ready {ready_in:?} after Postgres started");
    let log = tollgate.process.log();
    assert!(log.contains("connected to Postgres"), "{log}");
    assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
    assert_eq!(exhaust(&mut c, "late").await, real_decisions());
    assert_eq!(block_in_place(|| rows_for(&postgres, "late")), 1);
}

/// Redis's `failure_mode: fallback` onto Postgres, with Redis killed and Postgres paused: the
/// fallback has a breaker of its own, so once both circuits are open a request fails at once
/// (UNAVAILABLE: neither store can decide) instead of waiting for Postgres's timeout each time;
/// `/readyz` says both are failing; when both are back, decisions are on Redis again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_and_its_postgres_fallback_both_down_requests_fail_fast() {
    let test = "with_redis_and_its_postgres_fallback_both_down_requests_fail_fast";
    let Some(bin) = server_bin_or_skip(test) else {
        return;
    };
    let _serial = one_at_a_time();
    let mut redis = block_in_place(RedisServer::start);
    let postgres = block_in_place(|| PostgresServer::start(&bin));
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], command_timeout_ms: 100, failure_mode: fallback, breaker_failures: 3, \
         breaker_open_ms: {BREAKER_OPEN_MS}, connect_timeout_ms: 2000}}\n{}",
        yaml_str(&redis.url()),
        // The fallback's timeout is long, so a request that waits for it stands out.
        postgres_section(&postgres.url(), "error", "").replace(
            &format!("command_timeout_ms: {COMMAND_TIMEOUT_MS}"),
            "command_timeout_ms: 1500"
        )
    );
    let tollgate = block_in_place(|| start_tollgate(&settings));
    assert_eq!(readyz(&tollgate), (200, "ready\n".to_owned()));
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    load.set_phase(CHANGING);
    block_in_place(|| {
        postgres.pause();
        redis.kill();
    });
    eventually(Duration::from_secs(10), "both circuits open", || {
        circuit_open(&tollgate, "redis") == 1.0 && circuit_open(&tollgate, "postgres") == 1.0
    })
    .await;
    // From here on, both breakers are open.
    load.set_phase(OUTAGE_PHASE);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, body) = readyz(&tollgate);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("Redis") && body.contains("postgres fallback"), "{body}");

    load.set_phase(CHANGING);
    block_in_place(|| {
        postgres.resume();
        redis.restart();
    });
    load.set_phase(AFTER);
    eventually(RECOVERY, "both circuits closed and ready", || {
        circuit_open(&tollgate, "redis") == 0.0 && readyz(&tollgate) == (200, "ready\n".to_owned())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = load.stop().await;
    eprintln!("both down: {}", summary(&samples));

    let outage: Vec<&Sample> = samples.iter().filter(|s| s.within(OUTAGE_PHASE)).collect();
    assert!(outage.len() >= CLIENTS, "{}", summary(&samples));
    assert!(
        outage.iter().all(|s| s.result == Err(tonic::Code::Unavailable)),
        "{}",
        summary(&samples)
    );
    // A probe of each store at most (100 ms for Redis, 1.5 s for a paused Postgres) now and
    // then; every other request fails at once.
    let mut took: Vec<Duration> = outage.iter().map(|s| s.took).collect();
    took.sort();
    let median = took[took.len() / 2];
    assert!(
        median < Duration::from_millis(100),
        "median {median:?} with both circuits open: {}",
        summary(&samples)
    );
    let log = tollgate.process.log();
    assert!(!log.contains("panicked"), "{log}");
    let mut c = connect(&tollgate).await;
    let fallbacks = scrape(&tollgate).counter(FALLBACKS, &[("backend", "redis")]);
    assert_eq!(exhaust(&mut c, "probe-after").await, real_decisions());
    assert_eq!(
        scrape(&tollgate).counter(FALLBACKS, &[("backend", "redis")]),
        fallbacks,
        "back on Redis"
    );
}

/// With Redis the primary and Postgres its fallback, a Postgres that went down while Redis
/// answered (so the fallback got no calls and its breaker stayed closed) is found out by
/// readiness as soon as Redis fails too, without any traffic: `/readyz` is 503, not "ready
/// (degraded)" while nothing can decide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_probes_an_unused_fallback_when_the_primary_fails() {
    let Some(bin) = server_bin_or_skip("readiness_probes_an_unused_fallback_when_the_primary_fails") else {
        return;
    };
    let _serial = one_at_a_time();
    let mut redis = block_in_place(RedisServer::start);
    let mut postgres = block_in_place(|| PostgresServer::start(&bin));
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], command_timeout_ms: 100, failure_mode: fallback, breaker_failures: 3, \
         breaker_open_ms: {BREAKER_OPEN_MS}, connect_timeout_ms: 2000}}\n{}",
        yaml_str(&redis.url()),
        postgres_section(&postgres.url(), "error", "")
    );
    let tollgate = block_in_place(|| start_tollgate(&settings));
    assert_eq!(readyz(&tollgate), (200, "ready\n".to_owned()));
    block_in_place(|| postgres.crash());
    assert_eq!(readyz(&tollgate).0, 200, "Redis still answers");
    block_in_place(|| redis.kill());
    eventually(
        Duration::from_secs(5),
        "/readyz 503 with Redis and its fallback down",
        || {
            let (status, body) = readyz(&tollgate);
            status == 503 && body.contains("Redis") && body.contains("postgres fallback")
        },
    )
    .await;
    // And back: Postgres alone is enough to be ready (degraded).
    block_in_place(|| postgres.restart());
    eventually(RECOVERY, "/readyz 200 degraded once the fallback answers", || {
        let (status, body) = readyz(&tollgate);
        status == 200 && body.contains("degraded")
    })
    .await;
}

/// A replica with no traffic notices a Postgres that went away (readiness sends its own probe),
/// says why, and is ready again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_replica_is_not_ready_while_postgres_is_down() {
    let Some(bin) = server_bin_or_skip("an_idle_replica_is_not_ready_while_postgres_is_down") else {
        return;
    };
    let _serial = one_at_a_time();
    let mut postgres = block_in_place(|| PostgresServer::start(&bin));
    let settings = format!("backend: postgres\n{}", postgres_section(&postgres.url(), "error", ""));
    let tollgate = block_in_place(|| start_tollgate(&settings));
    assert_eq!(readyz(&tollgate), (200, "ready\n".to_owned()));
    block_in_place(|| postgres.crash());
    eventually(
        Duration::from_secs(5),
        "/readyz 503 naming why, without traffic",
        || {
            let (status, body) = readyz(&tollgate);
            // The reason in full is in the log; `/readyz` is public.
            status == 503 && body.contains("Postgres") && tollgate.process.log().contains("refused")
        },
    )
    .await;
    block_in_place(|| postgres.restart());
    eventually(RECOVERY, "/readyz 200 again", || {
        readyz(&tollgate) == (200, "ready\n".to_owned())
    })
    .await;
}

/// With Redis the primary, a Postgres fallback that fails while Redis answers leaves the
/// replica ready but says so ("degraded: the postgres fallback is failing"), and once it is
/// back the fallback's circuit gauge clears and readiness is plain again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fallback_is_reported_while_the_primary_answers() {
    let Some(bin) = server_bin_or_skip("a_failing_fallback_is_reported_while_the_primary_answers") else {
        return;
    };
    let _serial = one_at_a_time();
    let redis = block_in_place(RedisServer::start);
    let mut postgres = block_in_place(|| PostgresServer::start(&bin));
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], command_timeout_ms: 100, failure_mode: fallback, connect_timeout_ms: 2000}}\n{}",
        yaml_str(&redis.url()),
        postgres_section(&postgres.url(), "error", "")
    );
    let tollgate = block_in_place(|| start_tollgate(&settings));
    assert_eq!(readyz(&tollgate), (200, "ready\n".to_owned()));
    block_in_place(|| postgres.crash());
    eventually(
        Duration::from_secs(10),
        "ready, degraded: the fallback is failing",
        || {
            let (status, body) = readyz(&tollgate);
            status == 200 && body.contains("degraded") && body.contains("postgres fallback is failing")
        },
    )
    .await;
    eventually(Duration::from_secs(10), "the fallback's circuit opens", || {
        circuit_open(&tollgate, "postgres") == 1.0
    })
    .await;
    block_in_place(|| postgres.restart());
    eventually(RECOVERY, "plain ready and the gauge cleared", || {
        readyz(&tollgate) == (200, "ready\n".to_owned()) && circuit_open(&tollgate, "postgres") == 0.0
    })
    .await;
    drop(redis);
}

/// `postgres.password` logs in a URL without one (say, from a secret in an environment
/// variable); a wrong one is refused at start with the server named and the password never
/// printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_setting_logs_in_and_a_wrong_one_is_named_not_printed() {
    let Some(bin) = server_bin_or_skip("the_password_setting_logs_in_and_a_wrong_one_is_named_not_printed") else {
        return;
    };
    let _serial = one_at_a_time();
    let mut postgres = block_in_place(|| PostgresServer::init_with(&bin, None, Some("s3cret-pw")));
    block_in_place(|| postgres.restart());
    let url = postgres.url();
    let ok = block_in_place(|| {
        Tollgate::builder()
            .rules_file("faults.yaml", RULES)
            // The test is about logging in: a timeout well above a cold decision under CI load
            // (the default 15 ms one failed a first decision once).
            .settings(&format!(
                "backend: postgres\npostgres: {{url: {}, command_timeout_ms: {COMMAND_TIMEOUT_MS}}}",
                yaml_str(&url)
            ))
            .env("TOLLGATE_POSTGRES__PASSWORD", "s3cret-pw")
            .start()
    });
    assert_eq!(readyz(&ok), (200, "ready\n".to_owned()));
    let mut c = connect(&ok).await;
    assert_eq!(exhaust(&mut c, "pw").await, real_decisions());
    let config = block_in_place(|| ok.config()).unwrap().1;
    assert!(!config.contains("s3cret-pw"), "{config}");

    let dir = tempfile::tempdir().unwrap();
    let settings = dir.path().join("tollgate.yaml");
    std::fs::write(
        &settings,
        format!(
            "backend: postgres\npostgres: {{url: {}, password: wrong-pw}}\n",
            yaml_str(&url)
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["migrate", "--config"])
        .arg(&settings)
        .env_remove("TOLLGATE_POSTGRES__PASSWORD")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("127.0.0.1:{}", postgres.port())) && stderr.contains("password authentication failed"),
        "{stderr}"
    );
    assert!(!stderr.contains("wrong-pw"), "{stderr}");
}

/// `sslmode=require` in the URL: tollgate's connections to a TLS-enabled PostgreSQL are
/// encrypted (PostgreSQL's `pg_stat_ssl` says so for each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_use_tls_when_the_url_asks() {
    let Some(bin) = server_bin_or_skip("connections_use_tls_when_the_url_asks") else {
        return;
    };
    let _serial = one_at_a_time();
    let mut postgres = block_in_place(|| PostgresServer::init(&bin, None));
    postgres.enable_tls();
    block_in_place(|| postgres.restart());
    let url = format!("{}?sslmode=require", postgres.url());
    let tollgate =
        block_in_place(|| start_tollgate(&format!("backend: postgres\n{}", postgres_section(&url, "error", ""))));
    assert_eq!(readyz(&tollgate), (200, "ready\n".to_owned()));
    let mut c = connect(&tollgate).await;
    assert_eq!(exhaust(&mut c, "tls").await, real_decisions());
    // Every client connection of the database tollgate, but psql's own (plain) one.
    let plain = postgres
        .psql(
            "postgres",
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.datname = 'tollgate' AND a.backend_type = 'client backend' AND NOT s.ssl",
        )
        .unwrap();
    let tls = postgres
        .psql(
            "postgres",
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.datname = 'tollgate' AND s.ssl",
        )
        .unwrap();
    assert_eq!(plain, "0", "plain connections from tollgate");
    assert!(tls.parse::<u32>().unwrap() >= 1, "TLS connections: {tls}");
}

/// After PostgreSQL restarts, every lane's kept connection is dead; none of them may fail a
/// request once the server is back. (A lane kept its connection from batch to batch and failed
/// its first batch after the restart: one failed request per lane, well after recovery, which
/// could open the circuit again.) A lane idle for a while pings its connection first; after a
/// restart sooner than that, the first lane to find its connection broken makes the others
/// check theirs before their next batch, so at most that one request fails.
#[tokio::test(flavor = "multi_thread")]
async fn kept_connections_that_died_in_a_restart_fail_no_request_after_it() {
    use support::postgres::{bucket, take};
    use tollgate::store::Store;
    let test = "kept_connections_that_died_in_a_restart_fail_no_request_after_it";
    let Some(bin) = server_bin_or_skip(test) else {
        return;
    };
    let mut server = block_in_place(|| PostgresServer::start(&bin));
    let store = four_lanes(&server).await;
    let one = |key: &str| ([bucket(key, 1_000)], [take(0)]);
    // One request at a time: the lanes take turns, so eight requests give each of the four
    // a connection. Then a restart; then eight requests again.
    let mut failed = Vec::new();
    // A crash (SIGQUIT: the sockets just close) and a fast shutdown (SIGINT, `pg_ctl stop`'s
    // default: each session is first sent `FATAL 57P01`, an error that is not about the request).
    for (phase, idle_first, fast) in [
        ("idle", true, false),
        ("at once", false, false),
        ("fast stop", false, true),
    ] {
        for i in 0..8 {
            let (b, d) = one(&format!("{phase}-before-{i}"));
            store.apply(&b, &d).await.expect("decided before the restart");
        }
        if idle_first {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
        }
        if fast {
            block_in_place(|| server.stop_fast());
        }
        block_in_place(|| server.restart());
        let mut failures = 0;
        for i in 0..8 {
            let (b, d) = one(&format!("{phase}-after-{i}"));
            if let Err(e) = store.apply(&b, &d).await {
                eprintln!("{phase}: request {i} after the restart failed: {e}");
                failures += 1;
            }
        }
        failed.push((phase, failures));
    }
    assert_eq!(
        failed[0].1, 0,
        "requests failed after a restart, lanes idle: {failed:?}"
    );
    assert!(
        failed[1].1 <= 1,
        "requests failed after a restart, lanes just used: {failed:?}"
    );
    assert!(
        failed[2].1 <= 1,
        "requests failed after a fast shutdown and a start, lanes just used: {failed:?}"
    );
}

/// Requests keep coming while PostgreSQL crashes and starts again: those started once it
/// accepts connections again are all decided within their budget. (The lanes took their
/// connections from a pool that, refused while the server was down or starting up, retried
/// with a growing back-off and held its connection slots while it slept: requests well after
/// the server was back waited out their 300 ms for a connection.)
#[tokio::test(flavor = "multi_thread")]
async fn requests_after_a_restart_do_not_wait_for_attempts_made_during_it() {
    use support::postgres::{bucket, take};
    use tollgate::store::Store;
    let Some(bin) = server_bin_or_skip("requests_after_a_restart_do_not_wait_for_attempts_made_during_it") else {
        return;
    };
    let mut server = block_in_place(|| PostgresServer::start(&bin));
    let store = four_lanes(&server).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Four callers, each one request at a time, 5 ms apart: (start, result).
    let callers: Vec<_> = (0..4)
        .map(|c| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut i = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (b, d) = ([bucket(&format!("c{c}-{i}"), 1_000)], [take(0)]);
                    let started = Instant::now();
                    seen.push((
                        started,
                        store.apply(&b, &d).await.map(|_| ()).map_err(|e| e.to_string()),
                    ));
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                seen
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    block_in_place(|| server.crash());
    tokio::time::sleep(Duration::from_millis(700)).await;
    block_in_place(|| server.restart());
    let back = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut after = Vec::new();
    for caller in callers {
        after.extend(
            caller
                .await
                .unwrap()
                .into_iter()
                .filter(|(started, _)| *started >= back),
        );
    }
    let failed: Vec<&String> = after.iter().filter_map(|(_, r)| r.as_ref().err()).collect();
    assert!(after.len() >= 40, "too few requests after the restart: {}", after.len());
    assert!(
        failed.is_empty(),
        "{} of {} requests after the restart failed: {failed:?}",
        failed.len(),
        after.len()
    );
}

/// Lanes that lost their connections in an outage connect again in the background once
/// PostgreSQL is back, before any request needs them: a decision's budget (15 ms by default)
/// cannot always afford a handshake, and a lane that only reconnected for a request would fail
/// the circuit breaker's probes one lane after another.
#[tokio::test(flavor = "multi_thread")]
async fn lanes_connect_again_in_the_background_once_postgres_is_back() {
    use support::postgres::{bucket, take};
    use tollgate::store::Store;
    let Some(bin) = server_bin_or_skip("lanes_connect_again_in_the_background_once_postgres_is_back") else {
        return;
    };
    let mut server = block_in_place(|| PostgresServer::start(&bin));
    let store = four_lanes(&server).await;
    let one = |key: &str| ([bucket(key, 1_000)], [take(0)]);
    for i in 0..8 {
        let (b, d) = one(&format!("before-{i}"));
        store.apply(&b, &d).await.expect("decided before the outage");
    }
    let sessions = |server: &PostgresServer| {
        server
            .psql(
                "tollgate",
                "SELECT count(*) FROM pg_stat_activity WHERE datname = 'tollgate' AND pid <> pg_backend_pid()",
            )
            .and_then(|n| n.parse::<u32>().ok())
    };
    assert!(sessions(&server) >= Some(4), "the lanes' sessions before the outage");
    block_in_place(|| server.crash());
    // Requests during the outage: the lanes find their connections dead.
    for i in 0..4 {
        let (b, d) = one(&format!("during-{i}"));
        assert!(store.apply(&b, &d).await.is_err(), "decided with PostgreSQL down");
    }
    block_in_place(|| server.restart());
    // No request now: the lanes' attempts are at most a second apart.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let after = sessions(&server);
    assert!(
        after >= Some(4),
        "sessions 2 s after PostgreSQL came back, with no request: {after:?} (4 lanes)"
    );
    for i in 0..8 {
        let (b, d) = one(&format!("after-{i}"));
        store.apply(&b, &d).await.expect("decided after the outage");
    }
}

/// A connected store on `server` with four lanes and a 300 ms budget (1 s to connect).
async fn four_lanes(server: &PostgresServer) -> tollgate::store::PostgresStore {
    let mut settings = support::postgres::settings(&server.url(), "tollgate");
    settings.pool_size = 4;
    settings.command_timeout_ms = tollgate::core::units::Millis(300);
    settings.connect_timeout_ms = tollgate::core::units::Millis(1_000);
    let store = tollgate::store::PostgresStore::new(&settings).unwrap();
    store.connect(Duration::from_secs(10)).await.unwrap();
    store
}

/// Requests that time out on a slow server (here a lock another session holds on the table)
/// leave the lanes their connections: each is checked after its abandoned statement and kept,
/// so slowness does not make every timeout cost a new session (a fork and an authentication on
/// a server already struggling). The lanes' sessions are the same before and after.
#[tokio::test(flavor = "multi_thread")]
async fn timeouts_on_a_slow_server_keep_the_lanes_connections() {
    use sqlx::Connection;
    use support::postgres::{bucket, take};
    use tollgate::store::Store;
    let Some(bin) = server_bin_or_skip("timeouts_on_a_slow_server_keep_the_lanes_connections") else {
        return;
    };
    let server = block_in_place(|| PostgresServer::start(&bin));
    let store = four_lanes(&server).await;
    let one = |key: &str| ([bucket(key, 1_000)], [take(0)]);
    for i in 0..8 {
        let (b, d) = one(&format!("before-{i}"));
        store.apply(&b, &d).await.expect("decided before the lock");
    }
    let mut locker = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    let lanes = "SELECT coalesce(string_agg(pid::text, ',' ORDER BY pid), '') FROM pg_stat_activity \
                 WHERE datname = 'tollgate' AND pid <> pg_backend_pid()";
    let before: String = sqlx::query_scalar(lanes).fetch_one(&mut locker).await.unwrap();
    sqlx::query("BEGIN").execute(&mut locker).await.unwrap();
    sqlx::query("LOCK TABLE tollgate.tollgate_buckets IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .unwrap();
    for i in 0..12 {
        let (b, d) = one(&format!("locked-{i}"));
        let e = store.apply(&b, &d).await.expect_err("decided under the table lock");
        assert!(e.to_string().contains("timed out"), "{e}");
    }
    sqlx::query("ROLLBACK").execute(&mut locker).await.unwrap();
    for i in 0..8 {
        let (b, d) = one(&format!("after-{i}"));
        store.apply(&b, &d).await.expect("decided after the lock");
    }
    let after: String = sqlx::query_scalar(lanes).fetch_one(&mut locker).await.unwrap();
    assert_eq!(
        after, before,
        "the lanes' sessions (PIDs) after 12 timeouts, besides the locker's"
    );
}

/// A lane that cannot connect again while the others can (PostgreSQL at `max_connections`
/// after one of the lanes' sessions was terminated) leaves the requests to the lanes that have
/// a connection, instead of failing every fourth one with "too many clients".
#[tokio::test(flavor = "multi_thread")]
async fn a_lane_that_cannot_connect_leaves_requests_to_the_others() {
    use sqlx::Connection;
    use support::postgres::{bucket, take};
    use tollgate::store::Store;
    let test = "a_lane_that_cannot_connect_leaves_requests_to_the_others";
    let Some(bin) = server_bin_or_skip(test) else {
        return;
    };
    let mut server = block_in_place(|| PostgresServer::start(&bin));
    // Four lanes, this test's own session and two more: full once one lane lost its own.
    server.set_max_connections(6);
    block_in_place(|| server.restart());
    let store = four_lanes(&server).await;
    let one = |key: &str| ([bucket(key, 1_000)], [take(0)]);
    for i in 0..8 {
        let (b, d) = one(&format!("before-{i}"));
        store.apply(&b, &d).await.expect("decided with every lane connected");
    }
    let mut admin = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    let terminated: bool = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'tollgate' \
         AND pid <> pg_backend_pid() ORDER BY pid LIMIT 1",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(terminated);
    // The lanes' sessions left, besides this one: three once the terminated one is gone.
    let lanes = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
                 AND pid <> pg_backend_pid()";
    let gone_by = Instant::now() + Duration::from_secs(5);
    while sqlx::query_scalar::<_, i64>(lanes).fetch_one(&mut admin).await.unwrap() != 3 {
        assert!(Instant::now() < gone_by, "the terminated session is still there");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut fillers = Vec::new();
    for _ in 0..2 {
        fillers.push(sqlx::PgConnection::connect(&server.url()).await.unwrap());
    }
    let mut failed = Vec::new();
    for i in 0..40 {
        let (b, d) = one(&format!("full-{i}"));
        if let Err(e) = store.apply(&b, &d).await {
            failed.push(format!("{i}: {e}"));
        }
    }
    // The one that finds the terminated session may fail; none after it.
    assert!(
        failed.len() <= 1,
        "requests failed with three lanes connected: {failed:?}"
    );
    drop(fillers);
}
