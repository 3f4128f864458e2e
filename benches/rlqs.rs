//! Store calls with RLQS against RLS for the same traffic: `cargo bench --bench rlqs`.
//!
//! A fleet of Envoys (the test suite's model of Envoy's `rate_limit_quota` filter,
//! `tests/suite/rlqs_model.rs`) sends steady traffic over some buckets of one rule, on a manual
//! clock in 10 ms steps, for 20 s of simulated time. The same requests go once through
//! tollgate's RLQS hub (the Envoys decide on their assignments; the hub pays for them in the
//! store) and once through `ShouldRateLimit` (one decision per request), each on its own memory
//! store that counts its calls. The table gives store calls per second of each, for request
//! rates a hundred-fold apart, for 1 and 10 buckets, and for two assignment periods: RLS follows
//! the request rate, RLQS the number of buckets and the period. Run by `cargo test --bench rlqs`
//! (no `--bench` argument) it runs one small row, a smoke test.

#[path = "../tests/suite/rlqs_model.rs"]
#[allow(dead_code)]
mod rlqs_model;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use rlqs_model::{key, EnvoyModel, REPORT_EVERY_US};
use tokio::sync::mpsc;
use tollgate::core::bucket::Demand;
use tollgate::core::clock::ManualClock;
use tollgate::core::units::Millis;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::rlqs::{Hub, RlqsSettings};
use tollgate::rules::load_rules_text;
use tollgate::store::{Applied, BucketRef, MemoryStore, Peeked, Store, StoreError};

const START_US: u64 = 1_700_000_000_000_000;
const STEP_US: u64 = 10_000;

/// A memory store that counts the calls deciding on buckets.
#[derive(Clone)]
struct Counting {
    inner: MemoryStore,
    calls: Arc<AtomicU64>,
}

impl Store for Counting {
    fn apply(
        &self,
        buckets: &[BucketRef],
        demands: &[Demand],
    ) -> impl Future<Output = Result<Applied, StoreError>> + Send {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Store::apply(&self.inner, buckets, demands)
    }

    fn peek(&self, buckets: &[BucketRef]) -> impl Future<Output = Result<Peeked, StoreError>> + Send {
        Store::peek(&self.inner, buckets)
    }

    fn reset(&self, buckets: &[BucketRef]) -> impl Future<Output = Result<Peeked, StoreError>> + Send {
        Store::reset(&self.inner, buckets)
    }
}

struct Row {
    envoys: usize,
    buckets: usize,
    per_envoy: u64,
    period_ms: u64,
}

struct Measured {
    requests: u64,
    rls_calls: u64,
    rlqs_calls: u64,
    rls_admitted: u64,
    rlqs_admitted: u64,
}

fn limiter(rules: &str, clock: &ManualClock) -> (Arc<Limiter<Counting>>, Arc<AtomicU64>) {
    let calls = Arc::new(AtomicU64::new(0));
    let store = Counting {
        inner: MemoryStore::new(4, 100_000, Arc::new(clock.clone())),
        calls: calls.clone(),
    };
    let rules = load_rules_text(std::path::Path::new("bench.yaml"), rules).expect("rules");
    let options = LimiterOptions::from_settings(&tollgate::server::settings::Settings::default());
    (Arc::new(Limiter::new(rules, store, options)), calls)
}

async fn run(row: &Row, seconds: u64) -> Measured {
    // A refill of half the offered load: both paths deny as well as admit.
    let offered = row.envoys as u64 * row.per_envoy;
    let per_bucket = (offered / 2 / row.buckets as u64).max(1);
    let rules = format!(
        "domain: bench\ndescriptors:\n  - key: b\n    token_bucket: {{capacity: {}, refill: {}/s}}\n",
        per_bucket * 4,
        per_bucket
    );
    let clock = ManualClock::new(START_US);
    let (rls, rls_calls) = limiter(&rules, &clock);
    let (quota, rlqs_calls) = limiter(&rules, &clock);
    let settings = RlqsSettings {
        assignment_period_ms: Millis(row.period_ms),
        ..RlqsSettings::default()
    };
    let hub = Hub::with_clock(quota, settings, Arc::new(clock.clone()));
    let mut fleet = Vec::new();
    for i in 0..row.envoys {
        let (tx, rx) = mpsc::channel(4_096);
        let id = hub.open(tx).expect("a stream");
        fleet.push((
            EnvoyModel::new("bench", false),
            id,
            rx,
            0.0f64,
            (i as u64 * 997) % REPORT_EVERY_US,
        ));
    }
    let keys: Vec<_> = (0..row.buckets).map(|j| key(&[("b", &j.to_string())])).collect();
    let requests_of: Vec<RateLimitRequest> = (0..row.buckets)
        .map(|j| RateLimitRequest {
            domain: "bench".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "b".into(),
                    value: j.to_string(),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        })
        .collect();
    let (mut requests, mut rls_admitted) = (0u64, 0u64);
    let period_us = row.period_ms * 1_000;
    let mut next_tick = START_US + period_us;
    let end = START_US + seconds * 1_000_000;
    let mut now = START_US;
    let mut n = 0usize;
    while now < end {
        now += STEP_US;
        clock.set_us(now);
        for (model, id, rx, carry, report_at) in fleet.iter_mut() {
            while let Ok(Ok(msg)) = rx.try_recv() {
                model.apply(&msg, now);
            }
            *carry += row.per_envoy as f64 * STEP_US as f64 / 1e6;
            while *carry >= 1.0 {
                *carry -= 1.0;
                n = (n + 1) % row.buckets;
                requests += 1;
                let (_, first) = model.request(&keys[n], now);
                if let Some(r) = first {
                    hub.report(*id, r).await;
                }
                let answer = rls.should_rate_limit(&requests_of[n]).await.expect("decided");
                rls_admitted += u64::from(answer.overall_code == 1);
            }
            if (now - START_US) % REPORT_EVERY_US == *report_at - *report_at % STEP_US {
                let r = model.report(now);
                hub.report(*id, r).await;
            }
        }
        if now >= next_tick {
            next_tick += period_us;
            hub.tick().await;
        }
    }
    Measured {
        requests,
        rls_calls: rls_calls.load(Ordering::Relaxed),
        rlqs_calls: rlqs_calls.load(Ordering::Relaxed),
        rls_admitted,
        rlqs_admitted: fleet.iter().map(|f| f.0.admitted).sum(),
    }
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let rows: Vec<Row> = if bench {
        let mut rows = Vec::new();
        for (buckets, period_ms) in [(1, 1_000), (10, 1_000), (10, 2_000)] {
            for per_envoy in [10, 100, 1_000] {
                rows.push(Row {
                    envoys: 10,
                    buckets,
                    per_envoy,
                    period_ms,
                });
            }
        }
        rows
    } else {
        vec![Row {
            envoys: 2,
            buckets: 2,
            per_envoy: 50,
            period_ms: 1_000,
        }]
    };
    let seconds = if bench { 20 } else { 3 };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!("| Envoys | buckets | period | requests/s | RLS store calls/s | RLQS store calls/s | RLS admitted | RLQS admitted |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in &rows {
        let m = runtime.block_on(run(row, seconds));
        let per_s = |x: u64| x as f64 / seconds as f64;
        println!(
            "| {} | {} | {} ms | {:.0} | {:.0} | {:.1} | {} | {} |",
            row.envoys,
            row.buckets,
            row.period_ms,
            per_s(m.requests),
            per_s(m.rls_calls),
            per_s(m.rlqs_calls),
            m.rls_admitted,
            m.rlqs_admitted
        );
        assert!(m.rlqs_calls < m.rls_calls, "RLQS called the store more than RLS");
    }
}
