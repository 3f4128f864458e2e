//! Connecting to Redis: `RedisStore::connect` sees its connections come up, every time.
//!
//! fred announces a connection once, to whoever waits at that moment; a wait that starts just
//! before a connection comes up used to miss it and time out ("not reachable within ...") with
//! Redis answering all along: about one connect in 600 on this machine, a `tollgate serve` that
//! failed to start now and then in the suite.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::clock::SystemClock;
use tollgate::settings::RedisSettings;
use tollgate::store::redis::RedisStore;

/// 3,000 connects of a four-connection pool to the shared Redis, one after another (each pool
/// closed after it): every one is up well within its 2 s. Before the fix, a run of this test
/// missed three to five of them.
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
        if let Err(e) = store.connect(Duration::from_secs(2)).await {
            failed.push(format!("connect {i}: {e} after {:?}", started.elapsed()));
        }
        store.quit().await;
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
