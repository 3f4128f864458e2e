//! Load is not an outage: `tollgate serve` on a private `redis-server` with the default settings
//! (only the Redis URL given), under the closed-loop load of the benchmarks: 64 requests in
//! flight over 4 HTTP/2 connections, each request with the 4 descriptors real Envoy routes
//! send, for 10 s, driven by `tollgate-loadgen`. Every request must be decided: no
//! `UNAVAILABLE`, so Envoy never fails open because tollgate was busy.
//!
//! Before the breaker counted a share of a rolling window, and before the default command
//! timeout left room for a busy machine, a few decisions past the 10 ms timeout opened the
//! breaker after 5 consecutive failures (64 requests in flight time out together), which then
//! refused every request for a second, again and again: most requests of such a run were
//! `UNAVAILABLE`.

use crate::support;

use std::path::Path;
use std::process::{Command, Stdio};

use support::faults::one_at_a_time;
use support::redis::RedisServer;
use support::{yaml_str, Scrape, Tollgate};

const LOADGEN: &str = env!("CARGO_BIN_EXE_tollgate-loadgen");

#[test]
fn the_default_settings_hold_64_in_flight_with_four_descriptors_on_redis() {
    let _one = one_at_a_time();
    let redis = RedisServer::start();
    // benches/rules/bench.yaml: domain `bench`, key `k`, a bucket every request fits in, so
    // every answer is OK and anything else is a failure.
    let tollgate = Tollgate::builder()
        .rules_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/bench.yaml"))
        .settings(&format!(
            "backend: redis\nlog: {{level: warn}}\nredis: {{urls: [{}]}}",
            yaml_str(&redis.url())
        ))
        .start();
    let out = Command::new(LOADGEN)
        .args(["run", "--json", "--warmup", "1s", "--duration", "10s"])
        .args(["--concurrency", "64", "--connections", "4", "--descriptors", "4"])
        .args(["--domain", "bench", "--key", "k", "--keys", "1000"])
        .arg("--target")
        .arg(format!("http://{}", tollgate.grpc_addr))
        .stderr(Stdio::inherit())
        .output()
        .expect("run tollgate-loadgen");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("loadgen printed no report ({e}, {}): {stdout}", out.status));
    let scrape = Scrape::from(tollgate.http_addr);
    let requests = report["requests"].as_u64().expect("requests");
    let errors = report["errors"].as_u64().expect("errors");
    let timeouts = scrape.counter(
        "tollgate_backend_errors_total",
        &[("backend", "redis"), ("kind", "timeout")],
    );
    let opened = tollgate.process.log().matches("circuit open").count();
    eprintln!(
        "{requests} requests, {errors} errors, {:.0}/s, p99 {} µs, max {} µs; {timeouts} Redis timeouts",
        report["throughput_rps"].as_f64().unwrap_or(0.0),
        report["latency_us"]["p99"],
        report["latency_us"]["max"],
    );
    // A run that barely ran proves nothing: at least a few requests per loop.
    assert!(requests >= 64 * 5, "only {requests} requests: {report}");
    assert_eq!(
        errors,
        0,
        "{errors} of {requests} requests failed ({}; first: {}); Redis timeouts {timeouts}, \
         the breaker logged 'circuit open' {opened} times\n{}",
        report["error_codes"],
        report["first_error"],
        tollgate.process.log_tail(20)
    );
    assert_eq!(
        report["ok"].as_u64(),
        Some(requests),
        "every request admitted: {report}"
    );
    assert_eq!(
        scrape.get("tollgate_backend_circuit_open", &[("backend", "redis")]),
        Some(0.0)
    );
}
