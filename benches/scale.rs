//! How tollgate's core scales, measured side by side in one run: `cargo bench --bench scale`.
//! See benches/README.md.
//!
//! - `matching/*`: [`find_rule`] on a tree of 10 and of 10,000 exact values under one key (plus
//!   three wildcard nodes and a key-only default at the same level), for values that match
//!   exactly (a thousand spread over the tree, and the same ten in both trees), one that
//!   matches a wildcard and one that falls to the default. `matching/gateway_wildcard/*`: 10 and
//!   10,000 routes as Envoy Gateway writes them (per route a key whose wildcard value is its own
//!   name, `httproute/.../match/0/*`, and the rule's match below it), for a route in the middle;
//!   `matching/prefix_wildcard/*`: 10 and 10,000 path prefixes (`/route/<i>/*`) under one key,
//!   for a path under the middle one. Wildcards are found through a trie of their literal
//!   prefixes, not scanned, so neither should grow with the rules.
//! - `memory_store/cardinality/*`: one decision ([`MemoryStore::apply_now`]) on a random one of
//!   1,000 and of 1,000,000 held buckets.
//! - `memory_store/contention/*`: decisions from 1 and from 2 threads at once, on one hot bucket
//!   and on distinct buckets (time per decision, all threads together).
//!
//! Before the timings it prints, counted by this benchmark's allocator (exact, unlike resident
//! memory), the heap one held bucket costs in the memory store (allocated bytes after holding a
//! million buckets, minus before, per bucket) and the allocations one decision makes on the
//! whole decision path ([`Limiter::should_rate_limit`], its response included) with one and
//! with three descriptors.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use std::future::Future;
use tollgate::core::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::core::clock::ManualClock;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::core::schedule::Plan;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::rules::load_rules;
use tollgate::rules::{find_rule, instance_key};
use tollgate::store::{BucketRef, MemoryStore};

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static ALLOCATIONS: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A fixed instant (2026-12-01 00:00 UTC), so nothing depends on when the benchmark runs.
const START_US: u64 = 1_796_083_200 * MICRO;

/// A tree of `n` exact values under `user`, three wildcards and a default, in a temporary file.
fn tree_yaml(n: usize) -> String {
    let mut yaml = String::from("domain: big\nbuckets:\n  b: {capacity: 10, refill: 10/s}\ndescriptors:\n");
    for i in 0..n {
        yaml.push_str(&format!("  - {{key: user, value: \"u{i}\", bucket: b}}\n"));
    }
    for pattern in ["*-bot", "crawler-*", "*internal*"] {
        yaml.push_str(&format!("  - {{key: user, value: \"{pattern}\", bucket: b}}\n"));
    }
    yaml.push_str("  - {key: user, bucket: b}\n");
    yaml
}

/// Envoy Gateway's route `i`: the key and the value of its descriptor (its host name `*`).
fn gateway_route(i: usize) -> String {
    format!("httproute/default/route-{i}/rule/0/match/0/*")
}

/// `n` routes as Envoy Gateway writes them, each with a header match below its route.
fn gateway_yaml(n: usize) -> String {
    let mut yaml = String::from("domain: gateway\ndescriptors:\n");
    for i in 0..n {
        let route = gateway_route(i);
        yaml.push_str(&format!(
            "  - key: {route}\n    value: \"{route}\"\n    descriptors:\n      - key: rule-0-match-0\n        \
             rate_limit: {{unit: minute, requests_per_unit: 100}}\n"
        ));
    }
    yaml
}

/// `n` path prefixes under one key, and a default.
fn prefix_yaml(n: usize) -> String {
    let mut yaml = String::from("domain: prefixes\nbuckets:\n  b: {capacity: 10, refill: 10/s}\ndescriptors:\n");
    for i in 0..n {
        yaml.push_str(&format!("  - {{key: path, value: \"/route/{i}/*\", bucket: b}}\n"));
    }
    yaml.push_str("  - {key: path, bucket: b}\n");
    yaml
}

fn entry(key: &str, value: &str) -> Entry {
    Entry {
        key: key.to_owned(),
        value: value.to_owned(),
    }
}

fn bench_matching(c: &mut Criterion) {
    let mut group = c.benchmark_group("matching");
    for n in [10usize, 10_000] {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::write(dir.path().join("big.yaml"), tree_yaml(n)).expect("write the rules");
        let rules = load_rules(dir.path()).unwrap_or_else(|e| panic!("the rules load: {e}"));
        let domain = rules.domain("big").expect("the domain");
        // Values spread over the whole tree, visited in turn.
        let exact: Vec<[Entry; 1]> = (0..1_000)
            .map(|i| [entry("user", &format!("u{}", i * n / 1_000))])
            .collect();
        let mut i = 0;
        group.bench_with_input(BenchmarkId::new("exact", n), &n, |b, _| {
            b.iter(|| {
                i = (i + 1) % exact.len();
                black_box(find_rule(domain, black_box(&exact[i])))
            })
        });
        // The same ten values in both trees: the lookup's own cost, apart from how much of the
        // tree a workload touches (the `exact` case above touches a thousand values' entries
        // of the large tree, against the ten of the small one).
        let same: Vec<[Entry; 1]> = (0..10).map(|i| [entry("user", &format!("u{i}"))]).collect();
        let mut j = 0;
        group.bench_with_input(BenchmarkId::new("exact_same_values", n), &n, |b, _| {
            b.iter(|| {
                j = (j + 1) % same.len();
                black_box(find_rule(domain, black_box(&same[j])))
            })
        });
        let wildcard = [entry("user", "crawler-7")];
        group.bench_with_input(BenchmarkId::new("wildcard", n), &n, |b, _| {
            b.iter(|| black_box(find_rule(domain, black_box(&wildcard))))
        });
        let default = [entry("user", "someone-else")];
        group.bench_with_input(BenchmarkId::new("default", n), &n, |b, _| {
            b.iter(|| black_box(find_rule(domain, black_box(&default))))
        });

        std::fs::write(dir.path().join("gateway.yaml"), gateway_yaml(n)).expect("write the rules");
        std::fs::write(dir.path().join("prefixes.yaml"), prefix_yaml(n)).expect("write the rules");
        let rules = load_rules(dir.path()).unwrap_or_else(|e| panic!("the rules load: {e}"));
        let gateway = rules.domain("gateway").expect("the domain");
        let route = gateway_route(n / 2);
        let request = [entry(&route, &route), entry("rule-0-match-0", "alice")];
        assert!(find_rule(gateway, &request).is_some(), "the route matches");
        group.bench_with_input(BenchmarkId::new("gateway_wildcard", n), &n, |b, _| {
            b.iter(|| black_box(find_rule(gateway, black_box(&request))))
        });
        let prefixes = rules.domain("prefixes").expect("the domain");
        let path = [entry("path", &format!("/route/{}/users/7", n / 2))];
        assert!(find_rule(prefixes, &path).is_some(), "the path matches");
        group.bench_with_input(BenchmarkId::new("prefix_wildcard", n), &n, |b, _| {
            b.iter(|| black_box(find_rule(prefixes, black_box(&path))))
        });
    }
    group.finish();
}

/// A billion tokens (more than any run takes) refilled one a minute: a bucket used once stays
/// held for a minute, and every decision is admitted.
fn held_plan() -> Plan {
    Plan::Fixed(Limit::new(1_000_000_000, Rate::per(1, 60_000_000).expect("a rate")))
}

/// The instance key of value `i`, as the limiter builds it.
fn key_of(i: usize) -> String {
    let mut key = String::new();
    instance_key(&mut key, "bench", "held", &[entry("k", &i.to_string())], &[]);
    key
}

fn take() -> [Demand; 1] {
    [Demand {
        instance: 0,
        kind: DemandKind::Consume(MICRO),
        enforced: true,
    }]
}

/// A store holding the buckets of values `0..n`, its clock, and their keys.
fn held_store(n: usize) -> (MemoryStore, ManualClock, Vec<String>) {
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(64, 2 * n, Arc::new(clock.clone()));
    let keys: Vec<String> = (0..n).map(key_of).collect();
    let demand = take();
    for key in &keys {
        let bucket = [BucketRef {
            lease_ut: 0,
            key: key.clone(),
            plan: held_plan(),
        }];
        store.apply_now(&bucket, &demand);
    }
    assert_eq!(store.len(), n, "every bucket is held");
    (store, clock, keys)
}

/// Prints the heap a held bucket costs.
fn report_bucket_memory() {
    const N: usize = 1_000_000;
    let keys: Vec<String> = (0..N).map(key_of).collect();
    let key_bytes: usize = keys.iter().map(String::len).sum();
    let clock = ManualClock::new(START_US);
    let before = LIVE.load(Ordering::Relaxed);
    let store = MemoryStore::new(64, 2 * N, Arc::new(clock));
    let demand = take();
    for key in &keys {
        let bucket = [BucketRef {
            lease_ut: 0,
            key: key.clone(),
            plan: held_plan(),
        }];
        store.apply_now(&bucket, &demand);
    }
    let after = LIVE.load(Ordering::Relaxed);
    let per_bucket = (after - before) as f64 / N as f64;
    println!(
        "memory store: {} buckets hold {:.1} MiB of heap: {per_bucket:.1} bytes per bucket, whatever the key's \
         length (each is stored as a 16-byte digest; these keys average {:.1} bytes)",
        store.len(),
        (after - before) as f64 / (1 << 20) as f64,
        key_bytes as f64 / N as f64
    );
}

/// Prints the allocations (and reallocations) one decision makes.
fn report_allocations() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("held.yaml"), include_str!("rules/held.yaml")).expect("write the rules");
    let rules = load_rules(dir.path()).unwrap_or_else(|e| panic!("the rules load: {e}"));
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(64, 1_000_000, Arc::new(clock.clone()));
    let options = LimiterOptions::from_settings(&tollgate::server::settings::Settings::default());
    let limiter = Limiter::new(rules, store, options);
    for descriptors in [1usize, 3] {
        let request = RateLimitRequest {
            domain: "bench_held".into(),
            descriptors: (0..descriptors)
                .map(|i| RateLimitDescriptor {
                    entries: vec![entry("k", &format!("v{i}"))],
                    ..Default::default()
                })
                .collect(),
            hits_addend: 0,
        };
        const N: isize = 10_000;
        let decide = || {
            clock.advance_us(1);
            let future = limiter.should_rate_limit(&request);
            let mut future = std::pin::pin!(future);
            match future
                .as_mut()
                .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
            {
                std::task::Poll::Ready(r) => {
                    black_box(r.expect("a decision"));
                }
                std::task::Poll::Pending => panic!("the memory store never waits"),
            }
        };
        for _ in 0..1_000 {
            decide();
        }
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        for _ in 0..N {
            decide();
        }
        let per = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / N as f64;
        println!("decision path: {per:.1} allocations per decision with {descriptors} descriptor(s)");
    }
}

fn bench_memory_store(c: &mut Criterion) {
    report_allocations();
    report_bucket_memory();
    let mut group = c.benchmark_group("memory_store/cardinality");
    for n in [1_000usize, 1_000_000] {
        let (store, clock, keys) = held_store(n);
        let refs: Vec<[BucketRef; 1]> = keys
            .iter()
            .map(|k| {
                [BucketRef {
                    lease_ut: 0,
                    key: k.clone(),
                    plan: held_plan(),
                }]
            })
            .collect();
        let demand = take();
        // A fixed pseudo-random walk over the buckets (an LCG), the same in every run.
        let mut x = 12_345u64;
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let i = (x >> 33) as usize % refs.len();
                clock.advance_us(1);
                black_box(store.apply_now(&refs[i], &demand))
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("memory_store/contention");
    for threads in [1usize, 2] {
        for hot in [true, false] {
            let id = format!(
                "{}_threads_{}",
                threads,
                if hot { "one_bucket" } else { "distinct_buckets" }
            );
            group.bench_function(id, |b| {
                b.iter_custom(|iters| contended(threads, hot, iters));
            });
        }
    }
    group.finish();
}

/// `threads` threads each make `iters` decisions at once, on one shared bucket (`hot`) or each
/// on buckets of its own; the wall time divided by the number of threads, so the figure is the
/// time per decision when all threads decide together.
fn contended(threads: usize, hot: bool, iters: u64) -> Duration {
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(64, 1_000_000, Arc::new(clock));
    let start = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (store, start) = (store.clone(), start.clone());
            std::thread::spawn(move || {
                let refs: Vec<[BucketRef; 1]> = (0..64)
                    .map(|i| {
                        [BucketRef {
                            lease_ut: 0,
                            key: if hot { key_of(0) } else { key_of(t * 1_000 + i) },
                            plan: held_plan(),
                        }]
                    })
                    .collect();
                let demand = take();
                start.wait();
                for i in 0..iters as usize {
                    black_box(store.apply_now(&refs[i % refs.len()], &demand));
                }
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    for w in workers {
        w.join().expect("a worker");
    }
    began.elapsed() / threads as u32
}

criterion_group!(benches, bench_matching, bench_memory_store);
criterion_main!(benches);
