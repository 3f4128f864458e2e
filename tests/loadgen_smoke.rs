//! Smoke test for `tollgate-loadgen`: a one-second `run` against its own `noop` server and
//! against `tollgate serve` with the benchmark rules.

mod support;

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{free_port, wait_until, ChildGuard, Tollgate};

const LOADGEN: &str = env!("CARGO_BIN_EXE_tollgate-loadgen");

fn run_loadgen(grpc: SocketAddr, server_pid: u32) -> serde_json::Value {
    let out = Command::new(LOADGEN)
        .args(["run", "--json", "--duration", "1s", "--warmup", "0s"])
        .args(["--concurrency", "8", "--connections", "2", "--keys", "100"])
        .args(["--domain", "bench", "--key", "k"])
        .arg("--target")
        .arg(format!("http://{grpc}"))
        .arg("--server-pid")
        .arg(server_pid.to_string())
        .stderr(Stdio::inherit())
        .output()
        .expect("run tollgate-loadgen");
    assert!(out.status.success(), "loadgen failed: {}", out.status);
    let stdout = String::from_utf8(out.stdout).expect("utf-8 output");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
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
    let tollgate = Tollgate::builder()
        .rules_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/bench.yaml"))
        .settings("log: {level: warn}")
        .start();
    let report = run_loadgen(tollgate.grpc_addr, tollgate.process.id());
    check_report(&report);
    assert!(report["ok"].as_u64().unwrap_or(0) > 0, "{report}");
}

/// Zipf draws, three descriptors per request and `hits_addend` 2, for a fixed number of
/// requests: tollgate counts three bucket decisions and six hits for every request it answered,
/// so the flags reach the wire as stated.
#[test]
fn loadgen_zipf_descriptors_and_hits_addend_reach_tollgate() {
    let tollgate = Tollgate::builder()
        .rules_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/bench.yaml"))
        .settings("log: {level: warn}")
        .start();
    let out = Command::new(LOADGEN)
        .args([
            "run",
            "--json",
            "--duration",
            "10s",
            "--warmup",
            "0s",
            "--requests",
            "300",
        ])
        .args(["--concurrency", "4", "--connections", "1", "--keys", "50"])
        .args(["--distribution", "zipf", "--descriptors", "3", "--hits-addend", "2"])
        .arg("--target")
        .arg(format!("http://{}", tollgate.grpc_addr))
        .stderr(Stdio::inherit())
        .output()
        .expect("run tollgate-loadgen");
    assert!(out.status.success(), "loadgen failed: {}", out.status);
    let stdout = String::from_utf8(out.stdout).expect("utf-8 output");
    let report: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    let reported = report["requests"].as_u64().expect("requests");
    assert!((300..=304).contains(&reported), "{report}");
    assert_eq!(report["errors"].as_u64(), Some(0), "{report}");

    let m = support::Scrape::from(tollgate.http_addr);
    let answered = m.counter("tollgate_requests_total", &[("code", "ok")]);
    let decisions = m.counter("tollgate_decisions_total", &[("domain", "bench"), ("code", "ok")]);
    let hits = m.counter("tollgate_hits_total", &[("domain", "bench"), ("code", "ok")]);
    assert!(answered >= reported as f64, "{answered} answered, {reported} reported");
    assert_eq!(decisions, 3.0 * answered, "three descriptors a request");
    assert_eq!(hits, 2.0 * decisions, "hits_addend 2 on each");
}

/// `--requests 0` would end the window before it began (a 1 µs window, a CPU utilisation in the
/// millions): refused before any connection is made, naming the flag.
#[test]
fn loadgen_refuses_zero_requests() {
    let out = Command::new(LOADGEN)
        .args(["run", "--requests", "0", "--target", "http://127.0.0.1:9"])
        .output()
        .expect("run tollgate-loadgen");
    assert!(!out.status.success(), "accepted --requests 0");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--requests must be at least 1"), "{stderr}");
}

/// A duration without its unit, a target without its scheme, a target nobody listens on:
/// refused, saying what is wrong.
#[test]
fn loadgen_refuses_a_bare_duration_and_a_target_without_scheme() {
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
    refused(
        &["--duration", "500", "--target", "http://127.0.0.1:9"],
        "say `500s` or `500ms`",
    );
    refused(
        &["--duration", "1s", "--target", "127.0.0.1:9"],
        "like http://127.0.0.1:8081",
    );
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
    let tollgate = Tollgate::builder()
        .rules_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/bench.yaml"))
        .settings("log: {level: warn}")
        .start();
    let out = Command::new(LOADGEN)
        .args([
            "run",
            "--json",
            "--duration",
            "1s",
            "--warmup",
            "0s",
            "--concurrency",
            "2",
        ])
        .arg("--target")
        .arg(format!("http://{}", tollgate.http_addr))
        .output()
        .expect("run tollgate-loadgen");
    assert!(!out.status.success(), "exit 0 with no call answered");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no call was answered"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    assert!(report["errors"].as_u64().unwrap_or(0) > 0, "{report}");
}
