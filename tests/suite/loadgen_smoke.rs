//! Smoke tests for `tollgate-loadgen`: short `run`s against its own `noop` server and against
//! `tollgate serve` with the benchmark rules, the flags reaching the wire, and bad arguments.

use crate::support;

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use support::{free_port, wait_until, ChildGuard, Tollgate};

const LOADGEN: &str = env!("CARGO_BIN_EXE_tollgate-loadgen");

/// `tollgate serve` on `benches/rules/bench.yaml` (domain `bench`, key `k`, a bucket every
/// request fits in).
fn bench_tollgate() -> Tollgate {
    Tollgate::builder()
        .rules_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/bench.yaml"))
        .settings("log: {level: warn}")
        .start()
}

/// `tollgate-loadgen run --json --warmup 0s ARGS --target http://TARGET`, its stderr passed on.
fn loadgen_run(args: &[&str], target: SocketAddr) -> Output {
    Command::new(LOADGEN)
        .args(["run", "--json", "--warmup", "0s"])
        .args(args)
        .arg("--target")
        .arg(format!("http://{target}"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run tollgate-loadgen")
}

/// The JSON report a run printed.
fn report_of(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn run_loadgen(grpc: SocketAddr, server_pid: u32) -> serde_json::Value {
    let pid = server_pid.to_string();
    let out = loadgen_run(
        &[
            "--duration",
            "1s",
            "--concurrency",
            "8",
            "--connections",
            "2",
            "--keys",
            "100",
            "--domain",
            "bench",
            "--key",
            "k",
            "--server-pid",
            &pid,
        ],
        grpc,
    );
    assert!(out.status.success(), "loadgen failed: {}", out.status);
    report_of(&out)
}

fn check_report(report: &serde_json::Value) {
    let requests = report["requests"].as_u64().expect("requests");
    assert!(requests > 0, "no requests completed: {report}");
    assert_eq!(report["errors"].as_u64(), Some(0), "errors: {report}");
    assert!(report["latency_us"]["p99"].as_u64().unwrap_or(0) > 0, "{report}");
    assert!(report["servers"][0]["cpu_s"].is_number(), "{report}");
}

#[test]
fn loadgen_against_noop() {
    let _serial = crate::support::faults::one_at_a_time();
    let dir = tempfile::tempdir().expect("temp dir");
    let grpc = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut server = ChildGuard::spawn(
        "tollgate-loadgen noop",
        Command::new(LOADGEN).arg("noop").arg("--listen").arg(grpc.to_string()),
        &dir.path().join("noop.log"),
    );
    wait_until(&mut server, || {
        TcpStream::connect_timeout(&grpc, Duration::from_millis(200)).ok()
    })
    .unwrap_or_else(|why| panic!("noop server did not start: {why}"));
    let report = run_loadgen(grpc, server.id());
    check_report(&report);
    assert_eq!(report["ok"], report["requests"], "{report}");
}

#[test]
fn loadgen_against_tollgate() {
    let _serial = crate::support::faults::one_at_a_time();
    let tollgate = bench_tollgate();
    let report = run_loadgen(tollgate.grpc_addr, tollgate.process.id());
    check_report(&report);
    assert!(report["ok"].as_u64().unwrap_or(0) > 0, "{report}");
}

/// Zipf draws, three descriptors per request and `hits_addend` 2, for a fixed number of
/// requests: tollgate counts three bucket decisions and six hits for every request it answered,
/// so the flags reach the wire as stated.
#[test]
fn loadgen_zipf_descriptors_and_hits_addend_reach_tollgate() {
    let tollgate = bench_tollgate();
    let out = loadgen_run(
        &[
            "--duration",
            "10s",
            "--requests",
            "300",
            "--concurrency",
            "4",
            "--connections",
            "1",
            "--keys",
            "50",
            "--distribution",
            "zipf",
            "--descriptors",
            "3",
            "--hits-addend",
            "2",
        ],
        tollgate.grpc_addr,
    );
    assert!(out.status.success(), "loadgen failed: {}", out.status);
    let report = report_of(&out);
    // With no warmup the window holds every call: exactly the 300 sent, each one counted once
    // by tollgate and once in the report.
    let reported = report["requests"].as_u64().expect("requests");
    assert_eq!(reported, 300, "{report}");
    assert_eq!(report["errors"].as_u64(), Some(0), "{report}");

    let m = support::Scrape::from(tollgate.http_addr);
    let answered = m.counter("tollgate_requests_total", &[("code", "ok")]);
    let decisions = m.counter("tollgate_decisions_total", &[("domain", "bench"), ("code", "ok")]);
    let hits = m.counter("tollgate_hits_total", &[("domain", "bench"), ("code", "ok")]);
    assert_eq!(answered, reported as f64, "{answered} answered, {reported} reported");
    assert_eq!(decisions, 3.0 * answered, "three descriptors a request");
    assert_eq!(hits, 2.0 * decisions, "hits_addend 2 on each");
}

/// `--shape envoy` against `tollgate serve` on `benches/rules/envoy-shape.yaml` for a second:
/// every request answered `OK` with four statuses, and tollgate decided exactly one bucket per
/// descriptor: the per-client, the nested per key and path, the shared global and the nested
/// per-tenant bucket once per request each, and the per-key bucket above the path never (the
/// last entry of a descriptor decides). A shape that lost a descriptor, an entry of a nested
/// one, or a value the rules do not match fails here.
#[test]
fn loadgen_envoy_shape_decides_four_buckets_a_request() {
    let _serial = crate::support::faults::one_at_a_time();
    let tollgate = Tollgate::builder()
        .rules_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/envoy-shape.yaml"))
        .settings("log: {level: warn}")
        .start();
    let pid = tollgate.process.id().to_string();
    let out = loadgen_run(
        &[
            "--shape",
            "envoy",
            "--domain",
            "bench_envoy",
            "--duration",
            "1s",
            "--concurrency",
            "8",
            "--connections",
            "2",
            "--keys",
            "300",
            "--server-pid",
            &pid,
        ],
        tollgate.grpc_addr,
    );
    assert!(out.status.success(), "loadgen failed: {}", out.status);
    let report = report_of(&out);
    check_report(&report);
    let requests = report["requests"].as_u64().expect("requests");
    assert_eq!(report["shape"], "envoy", "{report}");
    assert_eq!(report["descriptors_per_request"].as_u64(), Some(4), "{report}");
    assert_eq!(report["ok"].as_u64(), Some(requests), "every request OK: {report}");
    assert_eq!(
        report["statuses"].as_u64(),
        Some(4 * requests),
        "four statuses each: {report}"
    );
    assert_eq!(report["status_mismatches"].as_u64(), Some(0), "{report}");

    // With no warmup tollgate answered what the report counts, and calls in flight when the
    // window closed: at least as many.
    let m = support::Scrape::from(tollgate.http_addr);
    let answered = m.counter("tollgate_requests_total", &[("code", "ok")]);
    assert!(answered >= requests as f64, "{answered} answered, {requests} reported");
    assert_eq!(m.sum("tollgate_requests_total", &[]), answered, "every answer OK");
    let decisions = |bucket: &str| {
        m.sum(
            "tollgate_decisions_total",
            &[("domain", "bench_envoy"), ("bucket", bucket)],
        )
    };
    for bucket in ["per_client_ip", "per_api_key_path", "global", "per_premium_tenant"] {
        assert_eq!(decisions(bucket), answered, "{bucket}: one decision a request");
        let ok = m.counter(
            "tollgate_decisions_total",
            &[("domain", "bench_envoy"), ("bucket", bucket), ("code", "ok")],
        );
        assert_eq!(ok, answered, "{bucket}: every decision admitted, none near its limit");
    }
    assert_eq!(decisions("per_api_key"), 0.0, "[api_key, path] is decided at the path");
    assert_eq!(
        m.sum("tollgate_decisions_total", &[("domain", "bench_envoy")]),
        4.0 * answered,
        "four decisions a request"
    );
}

/// `--descriptors` belongs to `--shape single`: with `--shape envoy` it is refused rather than
/// ignored.
#[test]
fn loadgen_envoy_shape_refuses_descriptors() {
    let out = Command::new(LOADGEN)
        .args([
            "run",
            "--shape",
            "envoy",
            "--descriptors",
            "3",
            "--target",
            "http://127.0.0.1:9",
        ])
        .output()
        .expect("run tollgate-loadgen");
    assert!(!out.status.success(), "accepted --descriptors with --shape envoy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--descriptors is for --shape single"), "{stderr}");
}

/// The exactness checks of `scripts/bench-compare` in small: 16 streams on one key of a
/// 20-token bucket that does not refill meanwhile, with no warmup and the CPU of a process
/// tree read at the start (a slow read, as for a PostgreSQL cluster). The report counts
/// exactly the 20 admissions tollgate made: none answered before the window opened is lost.
#[test]
fn loadgen_without_warmup_counts_every_admission() {
    let tollgate = Tollgate::builder()
        .rules_file(
            "exact.yaml",
            "domain: exact\nbuckets:\n  twenty: {capacity: 20, refill: 20/d}\n\
             descriptors:\n  - key: k\n    bucket: twenty\n",
        )
        .settings("log: {level: warn}")
        .start();
    let pid = tollgate.process.id().to_string();
    let out = loadgen_run(
        &[
            "--duration",
            "2s",
            "--concurrency",
            "16",
            "--connections",
            "2",
            "--keys",
            "1",
            "--domain",
            "exact",
            "--key",
            "k",
            "--server-tree",
            &pid,
        ],
        tollgate.grpc_addr,
    );
    assert!(out.status.success(), "loadgen failed: {}", out.status);
    let report = report_of(&out);
    let served = support::Scrape::from(tollgate.http_addr).counter("tollgate_requests_total", &[("code", "ok")]);
    assert_eq!(served, 20.0, "tollgate admitted {served}");
    assert_eq!(report["ok"].as_u64(), Some(20), "{report}");
    assert!(report["over_limit"].as_u64().unwrap_or(0) > 0, "{report}");
    assert_eq!(report["errors"].as_u64(), Some(0), "{report}");
}

/// Bad arguments are refused, saying what is wrong: `--requests 0` (it would end the window
/// before it began: a 1 µs window, a CPU utilisation in the millions), a duration without its
/// unit, a target without its scheme or with TLS, a target nobody listens on.
#[test]
fn loadgen_refuses_bad_arguments() {
    let refused = |args: &[&str], expected: &str| {
        let out = Command::new(LOADGEN)
            .arg("run")
            .args(args)
            .output()
            .expect("run tollgate-loadgen");
        assert!(!out.status.success(), "accepted {args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    };
    let nobody = "http://127.0.0.1:9";
    refused(
        &["--requests", "0", "--target", nobody],
        "--requests must be at least 1",
    );
    refused(&["--duration", "500", "--target", nobody], "say `500s` or `500ms`");
    refused(&["--target", "127.0.0.1:9"], "like http://127.0.0.1:8081");
    refused(&["--target", "https://127.0.0.1:9"], "an http:// URL");
    // Nobody listens on port 1: the cause is named, not only tonic's "transport error" (after
    // the five seconds the load generator gives a server to start).
    refused(
        &["--duration", "1s", "--target", "http://127.0.0.1:1"],
        "Connection refused",
    );
}

/// Aimed at a server that answers every call with an error (tollgate's HTTP port, which speaks
/// HTTP/2 but is no RateLimitService): the report is printed, and the exit status says that
/// nothing was measured.
#[test]
fn loadgen_fails_when_no_call_is_answered() {
    let tollgate = bench_tollgate();
    let out = loadgen_run(&["--duration", "1s", "--concurrency", "2"], tollgate.http_addr);
    assert!(!out.status.success(), "exit 0 with no call answered");
    let report = report_of(&out);
    assert!(report["errors"].as_u64().unwrap_or(0) > 0, "{report}");
    assert_eq!(report["ok"].as_u64(), Some(0), "{report}");
}

/// `tollgate-loadgen upstream` on a free loopback port, its log in `dir`.
fn start_upstream(dir: &Path) -> (ChildGuard, SocketAddr) {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut server = ChildGuard::spawn(
        "tollgate-loadgen upstream",
        Command::new(LOADGEN)
            .arg("upstream")
            .arg("--listen")
            .arg(addr.to_string()),
        &dir.join("upstream.log"),
    );
    wait_until(&mut server, || {
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()
    })
    .unwrap_or_else(|why| panic!("upstream did not start: {why}"));
    (server, addr)
}

/// The open-loop generator at 500 req/s for a second against the upstream: the 500 requests
/// of the window are sent, each answered 200, and the report's CPU reading names the upstream.
#[test]
fn loadgen_http_sends_the_scheduled_requests() {
    let _serial = crate::support::faults::one_at_a_time();
    let dir = tempfile::tempdir().expect("temp dir");
    let (upstream, addr) = start_upstream(dir.path());
    let out = Command::new(LOADGEN)
        .args(["http", "--json", "--rate", "500", "--duration", "1s", "--warmup", "0s"])
        .args(["--connections", "4", "--server-pid", &upstream.id().to_string()])
        .arg("--url")
        .arg(format!("http://{addr}/anything"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run tollgate-loadgen http");
    assert!(out.status.success(), "loadgen http failed: {}", out.status);
    let report = report_of(&out);
    assert_eq!(report["sent"].as_u64(), Some(500), "{report}");
    assert_eq!(report["completed"].as_u64(), Some(500), "{report}");
    assert_eq!(report["status_2xx"].as_u64(), Some(500), "{report}");
    assert_eq!(report["errors"].as_u64(), Some(0), "{report}");
    assert_eq!(report["unanswered"].as_u64(), Some(0), "{report}");
    assert_eq!(report["achieved_rps"].as_f64(), Some(500.0), "{report}");
    assert!(report["latency_us"]["p50"].as_u64().unwrap_or(0) > 0, "{report}");
    assert_eq!(
        report["servers"][0]["pid"].as_u64(),
        Some(u64::from(upstream.id())),
        "{report}"
    );
}

/// Only loopback URLs are load-tested, and a rate must be above zero.
#[test]
fn loadgen_http_refuses_other_hosts_and_no_rate() {
    let refused = |url: &str, rate: &str, expected: &str| {
        let out = Command::new(LOADGEN)
            .args(["http", "--url", url, "--rate", rate, "--duration", "1s"])
            .output()
            .expect("run tollgate-loadgen http");
        assert!(!out.status.success(), "accepted {url} at {rate}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{url} at {rate}: {stderr}");
    };
    refused("http://192.0.2.1:80/", "100", "only loopback addresses");
    refused("http://127.0.0.1:9/", "0", "--rate must be");
}

/// `scripts/bench-envoy` smoke-run on the debug binaries (a few seconds a configuration): every
/// configuration's run is printed, every request of the window came back 2xx, the filter asked
/// its server for each, and the table of medians and added latency has numbers. Needs Envoy
/// (see `support::envoy_or_skip`).
#[test]
fn bench_envoy_smoke() {
    let Some(envoy) = support::envoy_or_skip("bench_envoy_smoke") else {
        return;
    };
    let _serial = crate::support::faults::one_at_a_time();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The binaries this test was built with: <target>/debug/tollgate-loadgen.
    let target_dir = Path::new(LOADGEN)
        .parent()
        .and_then(Path::parent)
        .expect("the target directory");
    let out = Command::new(root.join("scripts/bench-envoy"))
        .env("PROFILE", "debug")
        .env("NO_BUILD", "1")
        .env("CARGO_TARGET_DIR", target_dir)
        .env("ENVOY", &envoy)
        .env("RATES", "200")
        .env("RUNS", "1")
        .env("DURATION", "1s")
        .env("WARMUP", "0.5s")
        .env("CONNECTIONS", "4")
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/bench-envoy");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench-envoy failed ({}):\n{stdout}", out.status);
    for config in ["none", "noop", "tollgate"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("rate 200 run 1 {config} ")))
            .unwrap_or_else(|| panic!("no run line for {config}:\n{stdout}"));
        assert!(line.contains("2xx 200 429 0 other 0 errors 0 unanswered 0"), "{line}");
        if config != "none" {
            // The warmup's 100 and the window's 200 (and the probe before them), each asked.
            let (_, filter) = line.split_once("filter ok ").unwrap_or_else(|| panic!("{line}"));
            let asked: u64 = filter.split(' ').next().and_then(|n| n.parse().ok()).expect("a count");
            assert!(asked >= 300 && filter.ends_with(" error 0"), "{line}");
        }
    }
    let numbers = |label: &str| -> Vec<f64> {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no `{label}` row:\n{stdout}"));
        row[label.len()..]
            .split_whitespace()
            .map(|v| v.parse().expect("a number"))
            .collect()
    };
    assert!(stdout.contains("rate 200 req/s: medians over 1 runs"), "{stdout}");
    let p99 = numbers("p99 latency us");
    assert!(p99.len() == 3 && p99.iter().all(|&v| v > 0.0), "{p99:?}");
    assert_eq!(numbers("achieved req/s"), [200.0, 200.0, 200.0]);
    assert_eq!(numbers("added p99 us").len(), 2, "{stdout}");
    assert!(stdout.contains("target: tollgate added p99 <= 1.1x noop added p99 at 200 req/s:"));
    assert!(
        stdout.contains("errors (transport errors, non-2xx, unanswered): none 0, noop 0, tollgate 0"),
        "{stdout}"
    );
}
