// The tests that load the machine hold a std Mutex across awaits on purpose: it only keeps
// them from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! A backend out of a resource under load, on private servers: Redis at `maxmemory` with
//! `maxmemory-policy noeviction` (every write refused with an OOM error), and PostgreSQL out of
//! connection slots (tollgate's connections gone and every new one refused with "too many
//! clients"). Under the continuous load of `support::faults::Load`, each request must be
//! answered within the command timeout plus a little, by a real decision or by the configured
//! `failure_mode`; once the resource is free again, tollgate decides on the backend again by
//! itself, without a restart.

use crate::support;

use std::str::FromStr;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;
use support::faults::{call, code, connect, one_at_a_time, readyz, start_tollgate, summary, Expect, FaultRun};
use support::postgres::{server_bin_or_skip, PostgresServer};
use support::redis::{RedisServer, RespValue};
use support::yaml_str;
use tokio::task::block_in_place;

/// `command_timeout_ms` of either backend in these tests (a debug build on a busy machine).
const COMMAND_TIMEOUT_MS: u64 = 200;
/// What a request may take beyond the command timeout (gRPC, a debug build, a busy machine).
const SLACK: Duration = Duration::from_millis(750);
/// How long the resource stays exhausted.
const FAULT: Duration = Duration::from_millis(1500);
/// The breaker settings of both backends: it opens after 3 failed calls, half of the window's,
/// and probes again after 200 ms.
const BREAKER: &str = "breaker_failures: 3, breaker_open_ms: 200, breaker_failure_percent: 50, breaker_window_ms: 1000";

fn expect(
    backend: &'static str,
    failure_answer: Result<(Code, bool), tonic::Code>,
    label: Option<&'static str>,
) -> Expect {
    Expect {
        backend,
        failure_answer,
        failure_label: label,
        max_latency: Duration::from_millis(COMMAND_TIMEOUT_MS) + SLACK,
        recovery: Duration::from_secs(10),
    }
}

// ---- Redis at maxmemory -------------------------------------------------------------------

/// `used_memory` from `INFO memory`.
fn used_memory(redis: &RedisServer) -> u64 {
    let info = redis.target().cmd(&[b"INFO", b"memory"]).as_text().unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("INFO memory gives used_memory")
}

fn config_set(redis: &RedisServer, key: &str, value: &str) {
    let set = redis
        .target()
        .cmd(&[b"CONFIG", b"SET", key.as_bytes(), value.as_bytes()]);
    assert!(
        matches!(set, RespValue::Simple(ref ok) if ok == "OK"),
        "CONFIG SET {key} {value}: {set:?}"
    );
}

/// Fills `redis` with 64 KiB values under `junk:` until a write is refused for memory (its
/// `maxmemory` set 4 MiB above what it used, `noeviction`), then holds it there: the limit is
/// lowered to 1 MiB under what it uses now, because the few KiB a client's buffers give back
/// when it goes idle would otherwise let small writes in again. How many values went in.
fn fill_to_maxmemory(redis: &RedisServer) -> usize {
    config_set(redis, "maxmemory-policy", "noeviction");
    config_set(redis, "maxmemory", &(used_memory(redis) + 4 * 1024 * 1024).to_string());
    let value = vec![b'x'; 64 * 1024];
    let mut conn = redis
        .target()
        .connect(Duration::from_secs(5))
        .expect("connect to Redis");
    for n in 0..1000 {
        let key = format!("junk:{n}");
        match conn.command(&[b"SET", key.as_bytes(), &value]) {
            Ok(RespValue::Simple(ok)) if ok == "OK" => continue,
            Ok(RespValue::Error(e)) if e.starts_with("OOM") => {
                config_set(redis, "maxmemory", &(used_memory(redis) - 1024 * 1024).to_string());
                return n;
            }
            other => panic!("SET {key}: {other:?}"),
        }
    }
    panic!("Redis took 1,000 values of 64 KiB within a 4 MiB margin");
}

/// Deletes what [`fill_to_maxmemory`] wrote, and lifts the limit.
fn free_memory(redis: &RedisServer, junk: usize) {
    for n in 0..=junk {
        redis.target().cmd(&[b"DEL", format!("junk:{n}").as_bytes()]);
    }
    redis.target().cmd(&[b"CONFIG", b"SET", b"maxmemory", b"0"]);
}

/// Redis at `maxmemory` with `noeviction` refuses the decision script's first write, so the
/// script writes nothing: a request that would take tokens gets the failure mode's answer
/// (`error`: UNAVAILABLE) at once, while a denial, which writes nothing, is still decided for
/// real (the load's users are spent; a denial that shared its script call with a refused write
/// gets the failure mode's answer too). Once memory is freed tollgate decides on Redis again, by
/// itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_at_maxmemory_with_noeviction_answers_by_the_failure_mode_and_recovers() {
    let _serial = one_at_a_time();
    let redis = block_in_place(RedisServer::start);
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], command_timeout_ms: {COMMAND_TIMEOUT_MS}, failure_mode: error, \
         connect_timeout_ms: 1000, {BREAKER}}}",
        yaml_str(&redis.url())
    );
    let tollgate = block_in_place(|| start_tollgate(&settings));
    let expect = expect("redis", Err(tonic::Code::Unavailable), None);

    let run = FaultRun::start(&tollgate, &expect).await;
    run.changing();
    let junk = block_in_place(|| fill_to_maxmemory(&redis));
    run.faulty();
    tokio::time::sleep(FAULT).await;
    // Users nobody used yet: their first request must write.
    let mut fresh = connect(&tollgate).await;
    let mut writes = Vec::new();
    for n in 0..5 {
        let (took, result) = call(&mut fresh, &format!("fresh-{n}")).await;
        writes.push((took, result.map(|r| code(&r)).map_err(|e| e.code())));
    }
    let (status, reason) = readyz(&tollgate);
    run.changing();
    block_in_place(|| free_memory(&redis, junk));
    let run = run.recover().await;
    eprintln!(
        "redis at maxmemory ({junk} values of 64 KiB): {}; /readyz during: {status} {reason}; recovered {:?} after",
        summary(&run.samples),
        run.recovered_in
    );
    run.check(&tollgate, &expect).await;
    for (took, result) in &writes {
        assert_eq!(
            *result,
            Err(tonic::Code::Unavailable),
            "a request that must write, while Redis was full"
        );
        assert!(*took <= expect.max_latency, "it took {took:?}");
    }
    assert!(run.errors > 0.0, "no backend error counted");
}

// ---- Postgres out of connections ----------------------------------------------------------

/// Connections of the test's own (`application_name` `hog`), taking every free slot.
struct Hogs {
    options: PgConnectOptions,
    held: Vec<PgConnection>,
}

impl Hogs {
    fn new(postgres: &PostgresServer) -> Hogs {
        let options = PgConnectOptions::from_str(&postgres.url())
            .expect("the server's URL")
            .application_name("hog");
        Hogs {
            options,
            held: Vec::new(),
        }
    }

    /// Connects until the server refuses for want of slots (SQLSTATE 53300).
    async fn take_free_slots(&mut self) {
        loop {
            match PgConnection::connect_with(&self.options).await {
                Ok(conn) => self.held.push(conn),
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("53300") => return,
                Err(e) => panic!("a hog connection: {e}"),
            }
        }
    }

    /// Client connections that are not the hogs': tollgate's.
    async fn others(&mut self) -> i64 {
        let conn = self.held.first_mut().expect("a hog holds a slot");
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND application_name <> 'hog'",
        )
        .fetch_one(conn)
        .await
        .expect("count the other connections")
    }

    /// Takes every slot, tollgate's too: its connections are terminated and their slots taken
    /// before it can reconnect, until it holds none.
    ///
    /// Done only once a pause frees no slot and shows none of tollgate's: a terminated backend
    /// leaves `pg_stat_activity` before it gives its slot back, and a connection still starting
    /// holds a slot before it shows there, so an empty `others` alone can be followed by
    /// tollgate connecting to a slot freed a moment later (a CI failure: 2 connections).
    async fn take_every_slot(&mut self) {
        self.take_free_slots().await;
        for _ in 0..50 {
            if self.others().await == 0 {
                let held = self.held.len();
                tokio::time::sleep(Duration::from_millis(500)).await;
                self.take_free_slots().await;
                if self.held.len() == held && self.others().await == 0 {
                    return;
                }
                continue;
            }
            let conn = self.held.first_mut().expect("a hog holds a slot");
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE backend_type = 'client backend' AND application_name <> 'hog'",
            )
            .execute(conn)
            .await
            .expect("terminate tollgate's connections");
            self.take_free_slots().await;
        }
        panic!("tollgate kept a connection through 50 rounds of terminating them");
    }

    fn release(&mut self) {
        self.held.clear();
    }
}

/// Postgres out of connection slots while tollgate has lost its own: each request gets the
/// failure mode's answer (`allow`) within the timeout (no wait for a connection beyond it), and
/// once slots are free tollgate reconnects and decides on Postgres again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_out_of_connections_answers_by_the_failure_mode_and_recovers() {
    let Some(bin) = server_bin_or_skip("postgres_out_of_connections_answers_by_the_failure_mode_and_recovers") else {
        return;
    };
    let _serial = one_at_a_time();
    let postgres = block_in_place(|| {
        let mut postgres = PostgresServer::init(&bin, None);
        postgres.set_max_connections(12);
        postgres.restart();
        postgres
    });
    let settings = format!(
        "backend: postgres\npostgres: {{url: {}, command_timeout_ms: {COMMAND_TIMEOUT_MS}, failure_mode: allow, \
         connect_timeout_ms: 1000, pool_size: 2, {BREAKER}}}",
        yaml_str(&postgres.url())
    );
    let tollgate = block_in_place(|| start_tollgate(&settings));
    let expect = expect("postgres", Ok((Code::Ok, false)), Some("allow"));
    let mut hogs = Hogs::new(&postgres);

    let run = FaultRun::start(&tollgate, &expect).await;
    run.changing();
    hogs.take_every_slot().await;
    run.faulty();
    tokio::time::sleep(FAULT).await;
    let still_out = hogs.others().await;
    let (status, reason) = readyz(&tollgate);
    run.changing();
    let held = hogs.held.len();
    hogs.release();
    let run = run.recover().await;
    eprintln!(
        "postgres out of connections ({held} held by the test): {}; /readyz during: {status} {reason}; recovered {:?} after",
        summary(&run.samples),
        run.recovered_in
    );
    assert_eq!(still_out, 0, "tollgate got a connection while every slot was taken");
    run.check(&tollgate, &expect).await;
    let during: Vec<_> = run.during().collect();
    assert!(!during.is_empty(), "no request while Postgres was out of connections");
    for s in &during {
        assert_eq!(
            s.result, expect.failure_answer,
            "a request while Postgres was out of connections: {s:?}"
        );
    }
    assert!(
        run.failure_answers.is_some_and(|n| n >= during.len() as f64),
        "failure-mode answers counted: {:?}, seen {}",
        run.failure_answers,
        during.len()
    );
    assert_eq!(status, 503, "/readyz while Postgres refuses connections: {reason}");
}
