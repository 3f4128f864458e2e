// The tests that load the machine hold a std Mutex across awaits on purpose: it only keeps
// them from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! The network between tollgate and its backend failing under load, on private `redis-server`
//! and PostgreSQL processes reached through a TCP proxy of the tests' own
//! (`tests/suite/support/proxy.rs`): the backend answering slower than the command timeout, and every
//! connection reset (RST) while requests are in flight. Under the continuous load of
//! `support::faults::Load`, each request must be answered within the command timeout plus a
//! little, by a real decision or by the configured `failure_mode`, never by anything else; and
//! once the network is healthy again, tollgate must decide on the backend again by itself,
//! without a restart.
//!
//! The load's users are spent (capacity 5) within their first requests, so a real decision is
//! OVER_LIMIT there and the failure mode's answer (OK for `allow`, UNAVAILABLE for `error`) is
//! told apart from it.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use support::faults::{one_at_a_time, scrape, start_tollgate, summary, Expect, FaultRun, BACKEND_ERRORS};
use support::postgres::{server_bin_or_skip, PostgresServer};
use support::proxy::FaultProxy;
use support::redis::RedisServer;
use support::{yaml_str, Tollgate};
use tokio::task::block_in_place;

/// `command_timeout_ms` of either backend in these tests (a debug build on a busy machine).
const COMMAND_TIMEOUT_MS: u64 = 200;
/// What a request may take beyond the command timeout (gRPC, a debug build, a busy machine).
const SLACK: Duration = Duration::from_millis(750);
/// How long the slow backend stays slow.
const FAULT: Duration = Duration::from_millis(1500);
/// How many times the connections are reset, and how far apart.
const RESETS: u32 = 6;
const RESET_EVERY: Duration = Duration::from_millis(250);

/// The breaker settings of both backends: it opens after 3 failed calls, half of the window's,
/// and probes again after 200 ms.
const BREAKER: &str = "breaker_failures: 3, breaker_open_ms: 200, breaker_failure_percent: 50, breaker_window_ms: 1000";

/// A private backend server and tollgate on it through the proxy.
struct Setup {
    expect: Expect,
    proxy: FaultProxy,
    tollgate: Tollgate,
    _redis: Option<RedisServer>,
    _postgres: Option<PostgresServer>,
}

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

/// Tollgate on a private Redis through the proxy, `failure_mode: allow`.
fn redis_setup() -> Setup {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(redis.addr());
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], command_timeout_ms: {COMMAND_TIMEOUT_MS}, failure_mode: allow, \
         connect_timeout_ms: 1000, {BREAKER}}}",
        yaml_str(&format!("redis://{}", proxy.addr()))
    );
    Setup {
        expect: expect("redis", Ok((Code::Ok, false)), Some("allow")),
        tollgate: start_tollgate(&settings),
        proxy,
        _redis: Some(redis),
        _postgres: None,
    }
}

/// Tollgate on a private PostgreSQL cluster through the proxy, `failure_mode: error`.
fn postgres_setup(bin: &std::path::Path) -> Setup {
    let postgres = PostgresServer::start(bin);
    let upstream: SocketAddr = ([127, 0, 0, 1], postgres.port()).into();
    let proxy = FaultProxy::start(upstream);
    let settings = format!(
        "backend: postgres\npostgres: {{url: {}, command_timeout_ms: {COMMAND_TIMEOUT_MS}, failure_mode: error, \
         connect_timeout_ms: 1000, pool_size: 4, {BREAKER}}}",
        yaml_str(&format!("postgres://postgres@{}/tollgate", proxy.addr()))
    );
    Setup {
        expect: expect("postgres", Err(tonic::Code::Unavailable), None),
        tollgate: start_tollgate(&settings),
        proxy,
        _redis: None,
        _postgres: Some(postgres),
    }
}

/// The backend slower than the timeout (every chunk held back three times the timeout): every
/// request during it gets the failure mode's answer, none waits past the timeout, and decisions
/// return when it is fast again.
async fn slower_than_the_timeout(setup: Setup) {
    let (tollgate, expect) = (&setup.tollgate, &setup.expect);
    let run = FaultRun::start(tollgate, expect).await;
    run.changing();
    setup.proxy.set_delay(Duration::from_millis(3 * COMMAND_TIMEOUT_MS));
    run.faulty();
    tokio::time::sleep(FAULT).await;
    run.changing();
    setup.proxy.set_delay(Duration::ZERO);
    let run = run.recover().await;
    eprintln!(
        "{} slow: {}; recovered {:?} after",
        expect.backend,
        summary(&run.samples),
        run.recovered_in
    );
    run.check(tollgate, expect).await;
    let during: Vec<_> = run.during().collect();
    assert!(!during.is_empty(), "no request while the backend was slow");
    for s in &during {
        assert_eq!(
            s.result, expect.failure_answer,
            "a request while the backend was slow: {s:?}"
        );
    }
    if let Some(counted) = run.failure_answers {
        assert!(
            counted >= during.len() as f64,
            "{counted} failure-mode answers counted, {} seen",
            during.len()
        );
    }
    let timeouts = scrape(tollgate).counter(BACKEND_ERRORS, &[("backend", expect.backend), ("kind", "timeout")]);
    assert!(timeouts > 0.0, "no timeout counted");
}

/// Every connection reset (RST) while requests are in flight, again and again: those requests
/// get the failure mode's answer (or a decision, when they went out on a new connection), none
/// waits past the timeout, and tollgate opens new connections by itself.
async fn connections_reset_mid_request(setup: Setup) {
    let (tollgate, expect) = (&setup.tollgate, &setup.expect);
    let accepted = setup.proxy.accepted();
    let run = FaultRun::start(tollgate, expect).await;
    run.changing();
    // A little delay, so requests are always in flight in the proxy when it resets.
    setup.proxy.set_delay(Duration::from_millis(20));
    run.faulty();
    for _ in 0..RESETS {
        tokio::time::sleep(RESET_EVERY).await;
        setup.proxy.reset_all();
    }
    run.changing();
    setup.proxy.set_delay(Duration::ZERO);
    let run = run.recover().await;
    eprintln!(
        "{} resets: {}; recovered {:?} after; {} proxy connections",
        expect.backend,
        summary(&run.samples),
        run.recovered_in,
        setup.proxy.accepted()
    );
    run.check(tollgate, expect).await;
    assert!(
        run.errors > 0.0,
        "no backend error counted: the resets hit no request in flight, so this run proved nothing"
    );
    assert!(
        setup.proxy.accepted() > accepted,
        "tollgate opened no new connection after the resets"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_slower_than_the_timeout_costs_at_most_the_timeout_and_recovers() {
    let _serial = one_at_a_time();
    slower_than_the_timeout(block_in_place(redis_setup)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_connections_reset_mid_request_are_answered_and_reopened() {
    let _serial = one_at_a_time();
    connections_reset_mid_request(block_in_place(redis_setup)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_slower_than_the_timeout_costs_at_most_the_timeout_and_recovers() {
    let Some(bin) = server_bin_or_skip("a_postgres_slower_than_the_timeout_costs_at_most_the_timeout_and_recovers")
    else {
        return;
    };
    let _serial = one_at_a_time();
    slower_than_the_timeout(block_in_place(|| postgres_setup(&bin))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_connections_reset_mid_request_are_answered_and_reopened() {
    let Some(bin) = server_bin_or_skip("postgres_connections_reset_mid_request_are_answered_and_reopened") else {
        return;
    };
    let _serial = one_at_a_time();
    connections_reset_mid_request(block_in_place(|| postgres_setup(&bin))).await;
}
