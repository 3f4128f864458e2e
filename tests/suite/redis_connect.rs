//! Connecting to Redis: `RedisStore::connect` sees its connections come up, every time.
//!
//! fred announces a connection once, to whoever waits at that moment; a wait that starts just
//! before a connection comes up used to miss it and time out ("not reachable within ...") with
//! Redis answering all along: about one connect in 600 on this machine, a `tollgate serve` that
//! failed to start now and then in the suite.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::core::clock::SystemClock;
use tollgate::server::settings::RedisSettings;
use tollgate::store::RedisStore;

/// 3,000 connects of a four-connection pool to the shared Redis, one after another (each pool
/// closed after it): every one is up within its 10 s (generous, so that a busy machine is not
/// mistaken for a missed connection, which waits the whole timeout). Before the first fix, a
/// run of this test missed three to five of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connect_sees_its_connections_come_up() {
    let Some(url) = support::redis::shared_redis("every_connect_sees_its_connections_come_up") else {
        return;
    };
    let settings = RedisSettings {
        urls: vec![url],
        pool_size: 4,
        ..RedisSettings::default()
    };
    let mut failed = Vec::new();
    for i in 0..3000 {
        let store = RedisStore::new(&settings, Arc::new(SystemClock)).unwrap();
        let started = Instant::now();
        if let Err(e) = store.connect(Duration::from_secs(10)).await {
            failed.push(format!("connect {i}: {e} after {:?}", started.elapsed()));
        }
        store.quit().await;
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// Loading the scripts (at connect, and in the readiness probe that reloads them) is not a
/// decision: it may take longer than `command_timeout_ms` (a busy machine, a distant Redis) and
/// still succeed within its own timeout. A private Redis holds every client's commands for
/// 300 ms (`CLIENT PAUSE`) while a store with a 10 ms decision timeout probes with 2 s: the probe
/// must pass once the pause ends. (Before, the `SCRIPT LOAD`s ran under the 10 ms decision
/// timeout: the probe failed with "Request timed out", and so did a connect in the suite once,
/// with Redis answering.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loading_the_scripts_is_not_held_to_the_decision_timeout() {
    if support::redis::shared_redis("loading_the_scripts_is_not_held_to_the_decision_timeout").is_none() {
        return;
    }
    let server = tokio::task::block_in_place(support::redis::RedisServer::start);
    let settings = RedisSettings {
        urls: vec![server.url()],
        pool_size: 1,
        command_timeout_ms: tollgate::core::units::Millis(10),
        connect_timeout_ms: tollgate::core::units::Millis(2_000),
        ..RedisSettings::default()
    };
    let store = RedisStore::new(&settings, Arc::new(SystemClock)).unwrap();
    store
        .connect(Duration::from_secs(2))
        .await
        .expect("connect to the private Redis");
    let paused = support::redis::resp_command(server.addr(), None, &[b"CLIENT", b"PAUSE", b"300", b"ALL"]);
    assert!(paused.is_ok(), "CLIENT PAUSE: {paused:?}");
    let started = Instant::now();
    let probed = store.probe(Duration::from_secs(2)).await;
    let took = started.elapsed();
    store.quit().await;
    assert!(probed.is_ok(), "{probed:?} after {took:?}");
    assert!(
        took >= Duration::from_millis(250),
        "probed in {took:?}: the pause did not hold it"
    );
}

/// A wrong password is named, every time: 300 connects with it to a private Redis that requires
/// a password each fail with Redis's own answer (WRONGPASS), never a timeout. Before the fix the
/// pool's connections were started and only then waited for, and an authentication error sent
/// before the wait began was lost: the connect waited its whole timeout and said "not reachable
/// within 2000 ms" (a `serve` exited so, and an operator chases the network, not the password).
/// Each connect has 10 s, so a busy machine does not make a slow answer look like the bug.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_named_every_time() {
    if support::redis::shared_redis("a_wrong_password_is_named_every_time").is_none() {
        return;
    }
    let server = tokio::task::block_in_place(|| support::redis::RedisServer::builder().requirepass("right").start());
    let settings = RedisSettings {
        urls: vec![format!("redis://:wrong@127.0.0.1:{}", server.port())],
        pool_size: 4,
        connect_timeout_ms: tollgate::core::units::Millis(10_000),
        ..RedisSettings::default()
    };
    let mut wrong = Vec::new();
    for i in 0..300 {
        let store = RedisStore::new(&settings, Arc::new(SystemClock)).unwrap();
        let started = Instant::now();
        match store.connect(Duration::from_secs(10)).await {
            Ok(()) => panic!("connect {i} succeeded with a wrong password"),
            Err(e) => {
                let text = e.to_string();
                if !text.contains("WRONGPASS") || text.contains("wrong@") {
                    wrong.push(format!("connect {i} after {:?}: {text}", started.elapsed()));
                }
            }
        }
        store.quit().await;
    }
    assert!(wrong.is_empty(), "{} of 300: {wrong:#?}", wrong.len());
}
