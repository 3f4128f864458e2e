// The tests that load the machine hold a std Mutex across awaits on purpose: it only keeps
// them from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! Cold start: the first decisions after `/readyz` first says ready must not pay for what the
//! start left undone (a connection still opening, a script not yet loaded, a statement not yet
//! prepared) and time out. Tollgate starts on a private Redis or PostgreSQL reached through the
//! tests' proxy with 25 ms each way (a 50 ms round trip, so each round trip the first decisions
//! would add shows against the timeout), `failure_mode: error`, and a command timeout between
//! what a warm decision takes and what one more round trip would add; the moment it is ready, a
//! burst of requests for users nobody used yet, all at once, must all be decided (OK), with no
//! backend error counted.

use crate::support;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::faults::{call, code, one_at_a_time, readyz, scrape, BACKEND_ERRORS, RULES};
use support::postgres::{server_bin_or_skip, PostgresServer};
use support::proxy::FaultProxy;
use support::redis::RedisServer;
use support::{yaml_str, Tollgate};
use tokio::task::block_in_place;

/// The proxy's delay each way: a round trip costs twice this.
const ONE_WAY: Duration = Duration::from_millis(25);
/// The burst: this many requests at once, over this many connections (as many as the Postgres
/// lanes, so no request waits for another's transaction).
const BURST: usize = 8;
const CONNECTIONS: usize = 4;

/// Starts tollgate with `settings` and waits for its first ready `/readyz`, polled every 5 ms
/// so the burst comes right after.
fn start_and_wait_ready(settings: &str) -> Tollgate {
    let tollgate = Tollgate::builder()
        .rules_file("faults.yaml", RULES)
        .settings(settings)
        .start();
    let deadline = Instant::now() + Duration::from_secs(30);
    while readyz(&tollgate).0 != 200 {
        assert!(
            Instant::now() < deadline,
            "not ready within 30 s: {:?}",
            readyz(&tollgate)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    tollgate
}

/// One burst of [`BURST`] requests at once, each for a user nobody used yet (named after
/// `round`): each one's time and code, or gRPC error.
async fn burst(tollgate: &Tollgate, round: &str) -> Vec<(Duration, Result<Code, String>)> {
    let mut clients = Vec::new();
    for _ in 0..CONNECTIONS {
        clients.push(
            RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
                .await
                .expect("connect to tollgate"),
        );
    }
    let calls: Vec<_> = (0..BURST)
        .map(|i| {
            let mut client = clients[i % CONNECTIONS].clone();
            let user = format!("{round}-{i}");
            tokio::spawn(async move {
                let (took, result) = call(&mut client, &user).await;
                (
                    took,
                    result
                        .map(|r| code(&r))
                        .map_err(|e| format!("{:?}: {}", e.code(), e.message())),
                )
            })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("a request task"));
    }
    answers
}

/// The first burst right after ready, then (the control) another once everything is warm:
/// both must be decided in full. A warm burst that fails means the timeout is too tight for
/// this machine and the test proves nothing; a cold one that fails alone is the defect.
async fn first_decisions(tollgate: &Tollgate, backend: &str) {
    let cold = burst(tollgate, "cold").await;
    let errors_cold = block_in_place(|| scrape(tollgate)).sum(BACKEND_ERRORS, &[("backend", backend)]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let warm = burst(tollgate, "warm").await;
    let slowest = |a: &[(Duration, Result<Code, String>)]| a.iter().map(|(took, _)| *took).max().unwrap_or_default();
    let failed = |a: &[(Duration, Result<Code, String>)]| {
        a.iter()
            .filter(|(_, r)| *r != Ok(Code::Ok))
            .cloned()
            .collect::<Vec<_>>()
    };
    eprintln!(
        "{backend}: {BURST} requests right after ready, slowest {:?}; warm, slowest {:?}",
        slowest(&cold),
        slowest(&warm)
    );
    let failed_warm = failed(&warm);
    assert!(
        failed_warm.is_empty(),
        "the control failed: {} of {BURST} warm requests not decided: {failed_warm:?}",
        failed_warm.len()
    );
    let failed_cold = failed(&cold);
    assert!(
        failed_cold.is_empty(),
        "{} of {BURST} first requests not decided: {failed_cold:?}",
        failed_cold.len()
    );
    assert_eq!(errors_cold, 0.0, "backend errors counted in the first decisions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_first_decisions_on_redis_after_ready_do_not_time_out() {
    let _serial = one_at_a_time();
    let redis = block_in_place(RedisServer::start);
    let proxy = FaultProxy::start(redis.addr());
    proxy.set_delay(ONE_WAY);
    // A decision is one round trip (EVALSHA), 50 ms; a script loaded inside it would add two
    // (NOSCRIPT, SCRIPT LOAD), a connection opened inside it at least one.
    let settings = format!(
        "backend: redis\nredis: {{urls: [{}], command_timeout_ms: 120, failure_mode: error, pool_size: 4}}",
        yaml_str(&format!("redis://{}", proxy.addr()))
    );
    let tollgate = block_in_place(|| start_and_wait_ready(&settings));
    first_decisions(&tollgate, "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_first_decisions_on_postgres_after_ready_do_not_time_out() {
    let Some(bin) = server_bin_or_skip("the_first_decisions_on_postgres_after_ready_do_not_time_out") else {
        return;
    };
    let _serial = one_at_a_time();
    let postgres = block_in_place(|| PostgresServer::start(&bin));
    let proxy = FaultProxy::start(([127, 0, 0, 1], postgres.port()).into());
    proxy.set_delay(ONE_WAY);
    // A warm decision takes about eight round trips here (the pool's check of the connection,
    // BEGIN, the locking INSERT, the UPDATE, COMMIT, and what sqlx adds), under 400 ms; a
    // connection opened inside it would add at least three (startup, authentication, the
    // session settings).
    let settings = format!(
        "backend: postgres\npostgres: {{url: {}, command_timeout_ms: 480, failure_mode: error, pool_size: 8, \
         connect_timeout_ms: 5000}}",
        yaml_str(&format!("postgres://postgres@{}/tollgate", proxy.addr()))
    );
    let tollgate = block_in_place(|| start_and_wait_ready(&settings));
    first_decisions(&tollgate, "postgres").await;
}
