//! Smoke test for `tollgate-loadgen`: a one-second `run` against its own `noop` server and
//! against `tollgate serve` with the benchmark rules.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LOADGEN: &str = env!("CARGO_BIN_EXE_tollgate-loadgen");
const TOLLGATE: &str = env!("CARGO_BIN_EXE_tollgate");

/// Kills and reaps the child when dropped, so a failed assertion leaves no server behind.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address")
}

fn wait_until(what: &str, child: &mut KillOnDrop, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready() {
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("{what} exited early: {status}");
        }
        assert!(Instant::now() < deadline, "{what} did not come up within 10s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn healthz_ok(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = s.read_to_string(&mut response);
    response.starts_with("HTTP/1.1 200")
}

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
    let grpc = free_addr();
    let mut server = KillOnDrop(
        Command::new(LOADGEN)
            .arg("noop")
            .arg("--listen")
            .arg(grpc.to_string())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn tollgate-loadgen noop"),
    );
    wait_until("tollgate-loadgen noop", &mut server, || {
        TcpStream::connect_timeout(&grpc, Duration::from_millis(200)).is_ok()
    });
    let report = run_loadgen(grpc, server.0.id());
    check_report(&report);
    assert_eq!(report["ok"], report["requests"], "{report}");
}

#[test]
fn loadgen_against_tollgate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (grpc, http) = (free_addr(), free_addr());
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/rules/bench.yaml");
    let settings = dir.path().join("tollgate.yaml");
    std::fs::write(
        &settings,
        format!(
            "grpc_addr: {grpc}\nhttp_addr: {http}\nrules: {:?}\nlog: {{level: warn}}\n",
            rules
        ),
    )
    .expect("write settings");
    let mut server = KillOnDrop(
        Command::new(TOLLGATE)
            .arg("serve")
            .arg("--config")
            .arg(&settings)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn tollgate serve"),
    );
    wait_until("tollgate serve", &mut server, || healthz_ok(http));
    let report = run_loadgen(grpc, server.0.id());
    check_report(&report);
    assert!(report["ok"].as_u64().unwrap_or(0) > 0, "{report}");
}
