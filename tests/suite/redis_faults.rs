// The tests that load the machine hold a std Mutex across awaits on purpose: it only keeps
// them from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! The Redis backend when Redis fails, on a running `tollgate serve` against private
//! `redis-server` processes (never the shared one): Redis killed and restarted on the same port
//! under load, in each `failure_mode`; Redis paused (SIGSTOP), so every call times out; Redis not
//! there at start; a password. Each request must be answered within the command timeout plus a
//! little, the breaker must open and close by itself, `/readyz` and the metrics must tell, and
//! decisions must go back to Redis once it answers.

use crate::support;

use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::faults::{
    self, call, calls, circuit_open, connect, eventually, one_at_a_time, readyz, real_decisions, scrape,
    start_tollgate, summary, Load, Sample, AFTER, BEFORE, CAPACITY, CHANGING, CLIENTS, OUTAGE_PHASE, RULES,
};
use support::redis::{keys_without_ttl, scan_keys_raw, RedisServer};
use support::{free_port, yaml_str, Scrape, Tollgate};
use tokio::task::block_in_place;
use tonic::transport::Channel;

/// `redis.command_timeout_ms` in these tests.
const COMMAND_TIMEOUT_MS: u64 = 100;
/// What a request may take beyond the command timeout (gRPC, a debug build, a busy machine).
const SLACK: Duration = Duration::from_millis(750);
/// How long Redis stays away in the outage tests.
const OUTAGE: Duration = Duration::from_secs(2);
/// `redis.breaker_failures` and `redis.breaker_open_ms`.
const BREAKER_FAILURES: u32 = 3;
const BREAKER_OPEN_MS: u64 = 200;
/// How long recovery (reconnect, then a probe through the breaker) may take.
const RECOVERY: Duration = Duration::from_secs(5);

const CALLS: &str = "tollgate_backend_calls_total";
const ERRORS: &str = "tollgate_backend_errors_total";
const FALLBACKS: &str = "tollgate_backend_fallbacks_total";
const FAILURE_ANSWERS: &str = "tollgate_backend_failure_answers_total";

fn max_latency() -> Duration {
    Duration::from_millis(COMMAND_TIMEOUT_MS) + SLACK
}

/// The settings for `backend: redis` at `url` with `failure_mode: mode`; `extra` is appended
/// inside the `redis:` map (`, key: value`).
fn redis_settings(url: &str, mode: &str, extra: &str) -> String {
    format!(
        "backend: redis\nredis: {{urls: [{}], command_timeout_ms: {COMMAND_TIMEOUT_MS}, failure_mode: {mode}, \
         breaker_failures: {BREAKER_FAILURES}, breaker_open_ms: {BREAKER_OPEN_MS}, connect_timeout_ms: 2000{extra}}}",
        yaml_str(url)
    )
}

/// [`faults::exhaust`] within this file's latency bound.
async fn exhaust(client: &mut RateLimitServiceClient<Channel>, user: &str) -> Vec<Code> {
    faults::exhaust(client, user, max_latency()).await
}

fn gauge_circuit_open(tollgate: &Tollgate) -> f64 {
    circuit_open(tollgate, "redis")
}

// ---- an outage under load -----------------------------------------------------------------

/// What an outage scenario saw.
struct Outage {
    /// The `failure_mode`.
    mode: String,
    redis: RedisServer,
    tollgate: Tollgate,
    samples: Vec<Sample>,
    /// `/readyz` a moment into the outage.
    readyz_during: (u16, String),
    /// The circuit gauge a moment into the outage.
    circuit_during: f64,
    /// `redis` backend calls when the restarted Redis answered PING, and at the end.
    calls_at_restart: f64,
    calls_at_end: f64,
    /// From the restart until the circuit closed and `/readyz` said 200.
    recovered_in: Duration,
    /// The codes of `exhaust` on a fresh user during the outage and after recovery.
    exhaust_during: Vec<Code>,
    exhaust_after: Vec<Code>,
}

/// Private Redis, tollgate in `failure_mode: mode` on it, load from `CLIENTS` clients; Redis is
/// killed for `OUTAGE`, then restarted on the same port; the load goes on until tollgate has
/// recovered by itself (circuit closed, `/readyz` 200) and a little after.
async fn outage(mode: &str) -> Outage {
    outage_with(mode, "", "").await
}

/// [`outage`] with `extra` inside the `redis:` settings (`, key: value`) and `more` top-level
/// settings YAML after them.
async fn outage_with(mode: &str, extra: &str, more: &str) -> Outage {
    let mut redis = block_in_place(RedisServer::start);
    let settings = format!("{}\n{more}", redis_settings(&redis.url(), mode, extra));
    let tollgate = block_in_place(|| start_tollgate(&settings));
    assert_eq!(readyz(&tollgate).0, 200, "ready on a healthy Redis");
    let mut probe = connect(&tollgate).await;
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    load.set_phase(CHANGING);
    block_in_place(|| redis.kill());
    load.set_phase(OUTAGE_PHASE);
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let readyz_during = readyz(&tollgate);
    let circuit_during = gauge_circuit_open(&tollgate);
    let exhaust_during = exhaust(&mut probe, "probe-during").await;
    tokio::time::sleep(OUTAGE.saturating_sub(killed.elapsed())).await;

    load.set_phase(CHANGING);
    block_in_place(|| redis.restart());
    load.set_phase(AFTER);
    let calls_at_restart = calls(&tollgate, "redis");
    let recovered_in = eventually(RECOVERY, "circuit closed and /readyz 200 after the restart", || {
        gauge_circuit_open(&tollgate) == 0.0 && readyz(&tollgate).0 == 200
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = load.stop().await;
    let exhaust_after = exhaust(&mut probe, "probe-after").await;
    let calls_at_end = calls(&tollgate, "redis");
    eprintln!(
        "{mode}: {}; recovered {recovered_in:?} after the restart",
        summary(&samples)
    );
    Outage {
        mode: mode.to_owned(),
        redis,
        tollgate,
        samples,
        readyz_during,
        circuit_during,
        calls_at_restart,
        calls_at_end,
        recovered_in,
        exhaust_during,
        exhaust_after,
    }
}

impl Outage {
    /// What every mode shares: answers within the bound, the outage seen in `/readyz`, the
    /// circuit gauge and the log, recovery by itself, decisions on Redis again, keys with TTLs.
    fn check_common(&self) {
        let slow: Vec<&Sample> = self.samples.iter().filter(|s| s.took > max_latency()).collect();
        assert!(
            slow.is_empty(),
            "{} requests took over {:?}: {:?}\n{}",
            slow.len(),
            max_latency(),
            slow.iter().take(10).collect::<Vec<_>>(),
            summary(&self.samples)
        );
        for phase in [BEFORE, OUTAGE_PHASE, AFTER] {
            assert!(
                self.samples.iter().filter(|s| s.within(phase)).count() >= CLIENTS,
                "too few requests in phase {phase}: {}",
                summary(&self.samples)
            );
        }
        // Before the outage, on Redis: the load users have used up their five tokens.
        let before_over = self
            .samples
            .iter()
            .filter(|s| s.within(BEFORE) && matches!(s.result, Ok((Code::OverLimit, true))))
            .count();
        assert!(
            before_over > 0,
            "no OVER_LIMIT before the outage: {}",
            summary(&self.samples)
        );
        assert!(
            self.samples
                .iter()
                .filter(|s| s.within(BEFORE))
                .all(|s| s.result.is_ok()),
            "{}",
            summary(&self.samples)
        );

        if self.mode == "fallback" {
            // Still ready, so replicas stay in rotation and the fallback is used; the body says
            // what is degraded.
            assert_eq!(
                self.readyz_during.0, 200,
                "/readyz during the outage with a fallback: {:?}",
                self.readyz_during
            );
            assert!(
                self.readyz_during.1.contains("degraded") && self.readyz_during.1.contains("fallback"),
                "/readyz during the outage with a fallback: {:?}",
                self.readyz_during
            );
        } else {
            assert_eq!(
                self.readyz_during.0, 503,
                "/readyz during the outage: {:?}",
                self.readyz_during
            );
        }
        assert_eq!(
            self.circuit_during,
            1.0,
            "circuit gauge during the outage\n{}",
            self.tollgate.process.log()
        );
        let log = self.tollgate.process.log();
        assert!(
            log.contains("backend failing: circuit open"),
            "no circuit-open error in the log:\n{log}"
        );
        assert!(
            log.contains("backend answers again: circuit closed"),
            "no recovery line in the log:\n{log}"
        );
        // At most about one "backend call failed" warning a second (the outage is ~2 s).
        let warnings = log.matches("backend call failed").count();
        assert!(
            warnings <= 5,
            "{warnings} 'backend call failed' lines: not rate limited\n{log}"
        );
        // Each names the request whose call failed (its x-request-id), as the circuit's
        // opening does.
        for line in log
            .lines()
            .filter(|l| l.contains("backend call failed") || l.contains("backend failing: circuit open"))
        {
            assert!(line.contains(&format!("request_id=\"{}", faults::REQUEST_ID)), "{line}");
        }

        assert!(self.recovered_in < RECOVERY);
        assert_eq!(gauge_circuit_open(&self.tollgate), 0.0);
        assert_eq!(readyz(&self.tollgate), (200, "ready\n".to_owned()));
        assert!(
            self.calls_at_end > self.calls_at_restart,
            "redis calls did not go on after the restart: {} then {}",
            self.calls_at_restart,
            self.calls_at_end
        );
        // The restarted Redis (no persistence) decides again: a fresh user gets exactly five.
        assert_eq!(self.exhaust_after, real_decisions(), "decisions after the restart");
        // And the load users' buckets, empty on the new Redis, were decided there again.
        let after_over = self
            .samples
            .iter()
            .filter(|s| s.within(AFTER) && matches!(s.result, Ok((Code::OverLimit, true))))
            .count();
        assert!(
            after_over > 0,
            "no real OVER_LIMIT after the restart: {}",
            summary(&self.samples)
        );
        let on_redis = block_in_place(|| scan_keys_raw(&self.redis, b""));
        assert!(
            on_redis.iter().any(|k| k.ends_with(b"probe-after")),
            "the decision after the restart left no key on Redis: {:?}",
            on_redis.iter().map(|k| String::from_utf8_lossy(k)).collect::<Vec<_>>()
        );
        let no_ttl = block_in_place(|| keys_without_ttl(&self.redis, ""));
        assert!(no_ttl.is_empty(), "keys without a TTL: {no_ttl:?}");
    }

    fn outage_samples(&self) -> Vec<&Sample> {
        let during: Vec<&Sample> = self.samples.iter().filter(|s| s.within(OUTAGE_PHASE)).collect();
        assert!(during.len() >= CLIENTS, "{}", summary(&self.samples));
        during
    }

    fn metrics(&self) -> Scrape {
        scrape(&self.tollgate)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn allow_mode_answers_every_request_through_an_outage() {
    let _serial = one_at_a_time();
    let o = outage("allow").await;
    o.check_common();
    let failed: Vec<&Sample> = o.samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    for s in o.outage_samples() {
        assert_eq!(s.result, Ok((Code::Ok, false)), "answer during the outage");
    }
    assert_eq!(o.exhaust_during, vec![Code::Ok; CAPACITY + 2], "allow: everything OK");
    let m = o.metrics();
    assert!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]) > 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "deny")]), 0.0);
    let errors = m.counter(ERRORS, &[("backend", "redis"), ("kind", "error")])
        + m.counter(ERRORS, &[("backend", "redis"), ("kind", "timeout")]);
    assert!(errors > 0.0, "no backend errors counted");
    assert_eq!(m.counter(FALLBACKS, &[("backend", "redis")]), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deny_mode_denies_during_the_outage() {
    let _serial = one_at_a_time();
    let o = outage("deny").await;
    o.check_common();
    let failed: Vec<&Sample> = o.samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    // Denied, and without Retry-After: nobody knows when Redis is back.
    for s in o.outage_samples() {
        assert_eq!(s.result, Ok((Code::OverLimit, false)), "answer during the outage");
    }
    assert_eq!(
        o.exhaust_during,
        vec![Code::OverLimit; CAPACITY + 2],
        "deny: everything denied"
    );
    let m = o.metrics();
    assert!(m.counter(FAILURE_ANSWERS, &[("answer", "deny")]) > 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn error_mode_answers_unavailable() {
    let _serial = one_at_a_time();
    let mut redis = block_in_place(RedisServer::start);
    let tollgate = block_in_place(|| start_tollgate(&redis_settings(&redis.url(), "error", "")));
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    load.set_phase(CHANGING);
    block_in_place(|| redis.kill());
    load.set_phase(OUTAGE_PHASE);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(readyz(&tollgate).0, 503);
    let mut probe = connect(&tollgate).await;
    let (took, result) = call(&mut probe, "probe-during").await;
    let status = result.expect_err("error mode: a gRPC error during the outage");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(took <= max_latency(), "UNAVAILABLE took {took:?}");
    tokio::time::sleep(Duration::from_millis(1400)).await;
    load.set_phase(CHANGING);
    block_in_place(|| redis.restart());
    load.set_phase(AFTER);
    let recovered = eventually(RECOVERY, "circuit closed and /readyz 200", || {
        gauge_circuit_open(&tollgate) == 0.0 && readyz(&tollgate).0 == 200
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = load.stop().await;
    eprintln!(
        "error: {}; recovered {recovered:?} after the restart",
        summary(&samples)
    );

    let slow: Vec<&Sample> = samples.iter().filter(|s| s.took > max_latency()).collect();
    assert!(slow.is_empty(), "slow requests: {slow:?}\n{}", summary(&samples));
    let before: Vec<&Sample> = samples.iter().filter(|s| s.within(BEFORE)).collect();
    let failed: Vec<&&Sample> = before.iter().filter(|s| s.result.is_err()).collect();
    assert!(
        failed.is_empty(),
        "failed before the outage: {failed:?}\n{}",
        summary(&samples)
    );
    let during: Vec<&Sample> = samples.iter().filter(|s| s.within(OUTAGE_PHASE)).collect();
    assert!(during.len() >= CLIENTS, "{}", summary(&samples));
    for s in &during {
        assert_eq!(s.result, Err(tonic::Code::Unavailable), "answer during the outage");
    }
    // Nothing but UNAVAILABLE ever fails.
    assert!(
        samples
            .iter()
            .all(|s| matches!(s.result, Ok(_) | Err(tonic::Code::Unavailable))),
        "{}",
        summary(&samples)
    );
    assert_eq!(exhaust(&mut probe, "probe-after").await, real_decisions());
    let m = scrape(&tollgate);
    assert!(m.counter("tollgate_requests_total", &[("code", "unavailable")]) >= during.len() as f64);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]), 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "deny")]), 0.0);
    assert!(tollgate.process.log().contains("backend failing: circuit open"));
    let no_ttl = block_in_place(|| keys_without_ttl(&redis, ""));
    assert!(no_ttl.is_empty(), "keys without a TTL: {no_ttl:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fallback_mode_decides_locally_during_the_outage() {
    let _serial = one_at_a_time();
    let o = outage_with("fallback", ", fallback: memory", "").await;
    o.check_common();
    let failed: Vec<&Sample> = o.samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    // The local store starts full for the load users, then limits them again: real decisions.
    let during = o.outage_samples();
    assert!(
        during.iter().any(|s| s.result == Ok((Code::OverLimit, true))),
        "no local OVER_LIMIT during the outage: {}",
        summary(&o.samples)
    );
    assert_eq!(o.exhaust_during, real_decisions(), "fallback: exact local decisions");
    let m = o.metrics();
    assert!(m.counter(FALLBACKS, &[("backend", "redis")]) > 0.0);
    assert!(m.counter(CALLS, &[("backend", "memory")]) > 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]), 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "deny")]), 0.0);
    // The outage's decisions stayed local: Redis never saw that user.
    let on_redis = block_in_place(|| scan_keys_raw(&o.redis, b""));
    assert!(
        !on_redis.iter().any(|k| k.ends_with(b"probe-during")),
        "a decision during the outage reached Redis"
    );
    // Back on Redis: the fallback is no longer asked.
    let fallbacks = m.counter(FALLBACKS, &[("backend", "redis")]);
    let mut c = connect(&o.tollgate).await;
    assert_eq!(exhaust(&mut c, "probe-later").await, real_decisions());
    assert_eq!(o.metrics().counter(FALLBACKS, &[("backend", "redis")]), fallbacks);
}

/// The keys of the bucket rows in Postgres schema `schema` at `url`.
async fn postgres_bucket_keys(url: &str, schema: &str) -> Vec<Vec<u8>> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query_scalar(&format!("SELECT key FROM \"{schema}\".tollgate_buckets"))
        .fetch_all(&mut conn)
        .await
        .unwrap()
}

/// `failure_mode: fallback` with `redis.fallback: postgres` (the default): Redis killed under
/// load, no request fails, decisions go on in Postgres (counted as fallbacks and as Postgres
/// calls; the outage's buckets are rows there), and after the restart they return to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fallback_mode_decides_on_postgres_during_the_outage() {
    let test = "fallback_mode_decides_on_postgres_during_the_outage";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let _serial = one_at_a_time();
    let (url, schema) = (&db.url, &db.name);
    let more = format!(
        "postgres: {{url: {}, schema: {schema}, command_timeout_ms: 2000, connect_timeout_ms: 10000}}",
        yaml_str(url)
    );
    let o = outage_with("fallback", "", &more).await;
    o.check_common();
    let failed: Vec<&Sample> = o.samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert_eq!(
        o.exhaust_during,
        real_decisions(),
        "fallback: exact decisions on Postgres"
    );
    let m = o.metrics();
    assert!(m.counter(FALLBACKS, &[("backend", "redis")]) > 0.0);
    assert!(m.counter(CALLS, &[("backend", "postgres")]) > 0.0);
    assert_eq!(m.counter(CALLS, &[("backend", "memory")]), 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]), 0.0);
    // The outage's decisions are rows in Postgres, not keys in Redis.
    let rows = postgres_bucket_keys(url, schema).await;
    assert!(
        rows.iter().any(|k| k.ends_with(b"probe-during")),
        "no row in Postgres for the outage's probe user"
    );
    let on_redis = block_in_place(|| scan_keys_raw(&o.redis, b""));
    assert!(
        !on_redis.iter().any(|k| k.ends_with(b"probe-during")),
        "a decision during the outage reached Redis"
    );
    // Back on Redis: neither the fallback nor Postgres is asked any more.
    let (fallbacks, on_postgres) = (
        m.counter(FALLBACKS, &[("backend", "redis")]),
        m.counter(CALLS, &[("backend", "postgres")]),
    );
    let mut c = connect(&o.tollgate).await;
    assert_eq!(exhaust(&mut c, "probe-later").await, real_decisions());
    let m = o.metrics();
    assert_eq!(m.counter(FALLBACKS, &[("backend", "redis")]), fallbacks);
    assert_eq!(m.counter(CALLS, &[("backend", "postgres")]), on_postgres);
    db.drop().await;
}

/// `failure_mode: fallback` onto Postgres when Redis does not answer at all (paused: every call
/// times out rather than being refused): no request fails, each takes at most Redis's command
/// timeout plus Postgres's, decisions go on exactly in Postgres (timeouts and fallbacks
/// counted, a row for the probe user), and after SIGCONT they are on Redis again without
/// Postgres being asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_redis_with_the_postgres_fallback_decides_on_postgres() {
    const PG_TIMEOUT_MS: u64 = 1_000;
    let test = "a_paused_redis_with_the_postgres_fallback_decides_on_postgres";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let _serial = one_at_a_time();
    let bound = Duration::from_millis(COMMAND_TIMEOUT_MS + PG_TIMEOUT_MS) + SLACK;
    let redis = block_in_place(RedisServer::start);
    let settings = format!(
        "{}\npostgres: {{url: {}, schema: {}, command_timeout_ms: {PG_TIMEOUT_MS}, connect_timeout_ms: 10000}}",
        redis_settings(&redis.url(), "fallback", ""),
        yaml_str(&db.url),
        db.name
    );
    let tollgate = block_in_place(|| start_tollgate(&settings));
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    load.set_phase(CHANGING);
    block_in_place(|| redis.pause());
    load.set_phase(OUTAGE_PHASE);
    eventually(Duration::from_secs(2), "circuit open while Redis is paused", || {
        gauge_circuit_open(&tollgate) == 1.0
    })
    .await;
    let mut probe = connect(&tollgate).await;
    assert_eq!(
        faults::exhaust(&mut probe, "probe-during", bound).await,
        real_decisions(),
        "exact decisions on Postgres while Redis is paused"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = scrape(&tollgate);
    assert!(m.counter(ERRORS, &[("backend", "redis"), ("kind", "timeout")]) >= f64::from(BREAKER_FAILURES));
    assert!(m.counter(FALLBACKS, &[("backend", "redis")]) > 0.0);
    assert!(m.counter(CALLS, &[("backend", "postgres")]) > 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]), 0.0);
    assert_eq!(m.counter(FAILURE_ANSWERS, &[("answer", "deny")]), 0.0);
    let rows = postgres_bucket_keys(&db.url, &db.name).await;
    assert!(
        rows.iter().any(|k| k.ends_with(b"probe-during")),
        "no row in Postgres for the probe user"
    );

    load.set_phase(CHANGING);
    block_in_place(|| redis.resume());
    load.set_phase(AFTER);
    eventually(RECOVERY, "circuit closed and /readyz 200 after SIGCONT", || {
        gauge_circuit_open(&tollgate) == 0.0 && readyz(&tollgate).0 == 200
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = load.stop().await;
    eprintln!("paused, postgres fallback: {}", summary(&samples));
    let failed: Vec<&Sample> = samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    let slow: Vec<&Sample> = samples.iter().filter(|s| s.took > bound).collect();
    assert!(
        slow.is_empty(),
        "requests over {bound:?}: {slow:?}\n{}",
        summary(&samples)
    );
    assert!(
        samples
            .iter()
            .any(|s| s.within(OUTAGE_PHASE) && s.result == Ok((Code::OverLimit, true))),
        "no real OVER_LIMIT while paused: {}",
        summary(&samples)
    );

    // Back on Redis: neither the fallback nor Postgres is asked any more.
    let m = scrape(&tollgate);
    let (fallbacks, on_postgres) = (
        m.counter(FALLBACKS, &[("backend", "redis")]),
        m.counter(CALLS, &[("backend", "postgres")]),
    );
    assert_eq!(exhaust(&mut probe, "probe-after").await, real_decisions());
    let m = scrape(&tollgate);
    assert_eq!(m.counter(FALLBACKS, &[("backend", "redis")]), fallbacks);
    assert_eq!(m.counter(CALLS, &[("backend", "postgres")]), on_postgres);
    let on_redis = block_in_place(|| scan_keys_raw(&redis, b""));
    // (A key for probe-during may be there too: a call that timed out in the paused Redis's
    // socket runs when it resumes, charging a request Postgres decided: under-admission.)
    assert!(
        on_redis.iter().any(|k| k.ends_with(b"probe-after")),
        "no Redis key after SIGCONT"
    );
    drop(tollgate);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_redis_costs_at_most_the_command_timeout() {
    let _serial = one_at_a_time();
    let redis = block_in_place(RedisServer::start);
    let tollgate = block_in_place(|| start_tollgate(&redis_settings(&redis.url(), "allow", "")));
    let load = Load::start(&tollgate).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    load.set_phase(CHANGING);
    block_in_place(|| redis.pause());
    load.set_phase(OUTAGE_PHASE);
    let opened_in = eventually(Duration::from_secs(2), "circuit open while Redis is paused", || {
        gauge_circuit_open(&tollgate) == 1.0
    })
    .await;
    let (status, body) = readyz(&tollgate);
    assert_eq!(status, 503, "/readyz with the circuit open: {body}");
    let mut probe = connect(&tollgate).await;
    assert_eq!(exhaust(&mut probe, "probe-during").await, vec![Code::Ok; CAPACITY + 2]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = scrape(&tollgate);
    let timeouts = m.counter(ERRORS, &[("backend", "redis"), ("kind", "timeout")]);
    assert!(timeouts >= f64::from(BREAKER_FAILURES), "timeouts counted: {timeouts}");
    assert!(m.counter(FAILURE_ANSWERS, &[("answer", "allow")]) > 0.0);
    // With the breaker open, Redis is asked about once per breaker_open_ms, not per request.
    let calls_paused = m.counter(CALLS, &[("backend", "redis")]);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let probes = calls(&tollgate, "redis") - calls_paused;
    assert!(
        probes <= (1000 / BREAKER_OPEN_MS + 2) as f64,
        "{probes} redis calls in 1 s with the circuit open"
    );

    load.set_phase(CHANGING);
    block_in_place(|| redis.resume());
    load.set_phase(AFTER);
    let recovered = eventually(RECOVERY, "circuit closed and /readyz 200 after SIGCONT", || {
        gauge_circuit_open(&tollgate) == 0.0 && readyz(&tollgate).0 == 200
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = load.stop().await;
    eprintln!(
        "paused: {}; circuit opened {opened_in:?} into the pause, closed {recovered:?} after SIGCONT",
        summary(&samples)
    );
    let failed: Vec<&Sample> = samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    let slow: Vec<&Sample> = samples.iter().filter(|s| s.took > max_latency()).collect();
    assert!(slow.is_empty(), "slow requests: {slow:?}\n{}", summary(&samples));
    for s in samples.iter().filter(|s| s.within(OUTAGE_PHASE)) {
        assert_eq!(s.result, Ok((Code::Ok, false)), "answer while paused");
    }
    assert_eq!(exhaust(&mut probe, "probe-after").await, real_decisions());
    let log = tollgate.process.log();
    assert!(log.contains("backend failing: circuit open"), "{log}");
    assert!(log.contains("backend answers again: circuit closed"), "{log}");
    let no_ttl = block_in_place(|| keys_without_ttl(&redis, ""));
    assert!(no_ttl.is_empty(), "keys without a TTL: {no_ttl:?}");
}

// ---- at start -----------------------------------------------------------------------------

/// Runs `tollgate serve` with `settings` (addresses and rules added) to its end, killing it
/// after `limit`: exit status (`None` if killed), stdout, stderr, time taken.
pub(crate) fn serve_to_exit(settings: &str, limit: Duration) -> (Option<ExitStatus>, String, String, Duration) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let rules = dir.path().join("rules");
    std::fs::create_dir(&rules).expect("create rules/");
    std::fs::write(rules.join("faults.yaml"), RULES).expect("write rules");
    let config = dir.path().join("tollgate.yaml");
    std::fs::write(
        &config,
        format!(
            "grpc_addr: 127.0.0.1:{}\nhttp_addr: 127.0.0.1:{}\nadmin: {{addr: 127.0.0.1:{}}}\nrules: {}\n{settings}\n",
            free_port(),
            free_port(),
            free_port(),
            yaml_str(&rules.to_string_lossy())
        ),
    )
    .expect("write tollgate.yaml");
    run_with_limit(&config, dir.path(), limit)
}

fn run_with_limit(config: &Path, dir: &Path, limit: Duration) -> (Option<ExitStatus>, String, String, Duration) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .arg("serve")
        .arg("--config")
        .arg(config)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::fs::File::create(dir.join("stdout")).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(dir.join("stderr")).unwrap()));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TOLLGATE_") {
            command.env_remove(key);
        }
    }
    let started = Instant::now();
    let mut child = command.spawn().expect("spawn tollgate");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for tollgate") {
            break Some(status);
        }
        if started.elapsed() > limit {
            // Our own child, by its handle.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    (status, read("stdout"), read("stderr"), took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_at_start() {
    let _serial = one_at_a_time();
    // (a) exit: a port where nothing listens.
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let (status, _, stderr, took) = block_in_place(|| {
        serve_to_exit(
            &redis_settings(&url, "allow", ", unreachable_at_start: exit"),
            Duration::from_secs(15),
        )
    });
    eprintln!("unreachable, exit: {status:?} after {took:?}: {stderr}");
    let status = status.unwrap_or_else(|| panic!("still running after 15 s: {stderr}"));
    assert!(!status.success(), "exit status {status}");
    assert!(took < Duration::from_secs(5), "took {took:?} to give up");
    assert!(stderr.contains(&url), "stderr does not name {url}: {stderr}");
    let reason = stderr.split(&url).nth(1).unwrap_or_default();
    assert!(
        reason.trim_start_matches(':').trim().len() > 3,
        "no reason after the URL: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // (b) not a Redis URL: refused by the settings check, naming the setting.
    let (status, _, stderr, took) =
        block_in_place(|| serve_to_exit(&redis_settings("http://x", "allow", ""), Duration::from_secs(15)));
    eprintln!("http://x: {status:?} after {took:?}: {stderr}");
    let status = status.unwrap_or_else(|| panic!("still running after 15 s: {stderr}"));
    assert!(!status.success());
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(stderr.contains("redis.urls") && stderr.contains("http://x"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_at_start_until_redis_comes() {
    let _serial = one_at_a_time();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let tollgate =
        block_in_place(|| start_tollgate(&redis_settings(&url, "allow", ", unreachable_at_start: not_ready")));
    let (status, body) = readyz(&tollgate);
    assert_eq!(status, 503, "/readyz without Redis: {body}");
    // Public: it names the backend, not its address (the log has that).
    assert!(
        body.contains("Redis") && !body.contains(&format!("127.0.0.1:{port}")),
        "/readyz names Redis, not its address: {body}"
    );
    assert!(
        tollgate.process.log().contains("Redis not reachable at start"),
        "{}",
        tollgate.process.log()
    );
    // Answered by the failure mode, quickly.
    let mut c = connect(&tollgate).await;
    assert_eq!(exhaust(&mut c, "early").await, vec![Code::Ok; CAPACITY + 2]);
    assert_eq!(
        scrape(&tollgate).counter(FAILURE_ANSWERS, &[("answer", "allow")]),
        (CAPACITY + 2) as f64
    );

    let redis = block_in_place(|| RedisServer::builder().port(port).start());
    // No traffic now: a replica that is not ready gets none (Kubernetes takes it out of the
    // Service, Envoy's health check out of the cluster), so it must get ready on its own.
    let ready_in = eventually(RECOVERY, "/readyz 200 once Redis is there, without traffic", || {
        readyz(&tollgate).0 == 200
    })
    .await;
    eprintln!("not_ready: ready {ready_in:?} after Redis started");
    assert_eq!(exhaust(&mut c, "late").await, real_decisions());
    assert_eq!(gauge_circuit_open(&tollgate), 0.0);
    let no_ttl = block_in_place(|| keys_without_ttl(&redis, ""));
    assert!(no_ttl.is_empty(), "keys without a TTL: {no_ttl:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_at_start_gets_ready_with_traffic_once_redis_comes() {
    let _serial = one_at_a_time();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let tollgate =
        block_in_place(|| start_tollgate(&redis_settings(&url, "deny", ", unreachable_at_start: not_ready")));
    assert_eq!(readyz(&tollgate).0, 503);
    let mut c = connect(&tollgate).await;
    assert_eq!(exhaust(&mut c, "early").await, vec![Code::OverLimit; CAPACITY + 2]);
    let redis = block_in_place(|| RedisServer::builder().port(port).start());
    // With requests coming in (one every 50 ms), a probe closes the circuit.
    let started = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        let (took, result) = call(&mut c, &format!("trickle-{n}")).await;
        result.expect("an answer");
        assert!(took <= max_latency(), "took {took:?}");
        if readyz(&tollgate).0 == 200 {
            break;
        }
        assert!(
            started.elapsed() < RECOVERY,
            "not ready {RECOVERY:?} after Redis started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "not_ready with traffic: ready {:?} after Redis started",
        started.elapsed()
    );
    assert_eq!(exhaust(&mut c, "late").await, real_decisions());
    let no_ttl = block_in_place(|| keys_without_ttl(&redis, ""));
    assert!(no_ttl.is_empty(), "keys without a TTL: {no_ttl:?}");
}

// ---- a password ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_protected_redis() {
    let _serial = one_at_a_time();
    let password = "s3cr3t/p@ss:word";
    let redis = block_in_place(|| RedisServer::builder().requirepass(password).start());

    // The password in the setting, the URL without it.
    let extra = format!(", password: {}", yaml_str(password));
    let tollgate = block_in_place(|| start_tollgate(&redis_settings(&redis.url(), "error", &extra)));
    assert_eq!(readyz(&tollgate).0, 200);
    let mut c = connect(&tollgate).await;
    assert_eq!(exhaust(&mut c, "by-setting").await, real_decisions());
    let config = block_in_place(|| tollgate.config()).expect("/config");
    assert!(!config.1.contains(password), "/config shows the password: {}", config.1);
    drop(tollgate);

    // The password in the URL (percent-encoded).
    let tollgate = block_in_place(|| start_tollgate(&redis_settings(&redis.auth_url(), "error", "")));
    assert_eq!(readyz(&tollgate).0, 200);
    let mut c = connect(&tollgate).await;
    assert_eq!(exhaust(&mut c, "by-url").await, real_decisions());
    let log = tollgate.process.log();
    assert!(
        !log.contains("p%40ss") && !log.contains(password),
        "the log shows the password: {log}"
    );
    drop(tollgate);

    let on_redis = block_in_place(|| scan_keys_raw(&redis, b""));
    for user in [&b"by-setting"[..], b"by-url"] {
        assert!(
            on_redis.iter().any(|k| k.ends_with(user)),
            "no key for {user:?} on Redis"
        );
    }

    // A wrong password: tollgate does not start, and says why (without a panic or the password).
    let wrong = "not-the-password-42";
    for (how, settings) in [
        (
            "setting",
            redis_settings(&redis.url(), "error", &format!(", password: {}", yaml_str(wrong))),
        ),
        (
            "url",
            redis_settings(&format!("redis://:{wrong}@127.0.0.1:{}", redis.port()), "error", ""),
        ),
    ] {
        let (status, _, stderr, took) = block_in_place(|| serve_to_exit(&settings, Duration::from_secs(15)));
        eprintln!("wrong password by {how}: {status:?} after {took:?}: {stderr}");
        let status = status.unwrap_or_else(|| panic!("wrong password by {how}: still running after 15 s: {stderr}"));
        assert!(!status.success());
        assert!(took < Duration::from_secs(5), "took {took:?}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!stderr.contains(wrong), "stderr shows the password: {stderr}");
        assert!(
            stderr.contains(&format!("127.0.0.1:{}", redis.port())),
            "names no URL: {stderr}"
        );
        let lower = stderr.to_lowercase();
        assert!(
            lower.contains("wrongpass") || lower.contains("password") || lower.contains("auth"),
            "no reason about the password: {stderr}"
        );
    }
    let no_ttl = block_in_place(|| keys_without_ttl(&redis, ""));
    assert!(no_ttl.is_empty(), "keys without a TTL: {no_ttl:?}");
}

/// A replica whose circuit opened during an outage must get ready again once Redis is back even
/// if no request comes: while it is not ready it gets none (Kubernetes takes it out of the
/// Service, Envoy's health checks out of the cluster), so a readiness that waits for a request
/// to probe Redis never comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_recovers_without_traffic_after_an_outage() {
    let _serial = one_at_a_time();
    let mut redis = block_in_place(RedisServer::start);
    let tollgate = block_in_place(|| start_tollgate(&redis_settings(&redis.url(), "allow", "")));
    let mut c = connect(&tollgate).await;
    assert_eq!(exhaust(&mut c, "before").await, real_decisions());
    block_in_place(|| redis.kill());
    // A few requests during the outage open the circuit; then traffic stops.
    assert_eq!(exhaust(&mut c, "during").await, vec![Code::Ok; CAPACITY + 2]);
    assert_eq!(gauge_circuit_open(&tollgate), 1.0);
    assert_eq!(readyz(&tollgate).0, 503);
    block_in_place(|| redis.restart());
    let ready_in = eventually(RECOVERY, "/readyz 200 once Redis is back, without traffic", || {
        readyz(&tollgate).0 == 200
    })
    .await;
    eprintln!("ready {ready_in:?} after the restart, without traffic");
    assert_eq!(gauge_circuit_open(&tollgate), 0.0);
    assert_eq!(exhaust(&mut c, "after").await, real_decisions());
}
