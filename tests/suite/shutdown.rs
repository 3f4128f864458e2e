//! Graceful shutdown of a running `tollgate serve`: on SIGTERM under load it reports not ready
//! while it keeps answering, then closes, answers every request it accepted, and exits within
//! its deadline.

use crate::support;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use support::{http_get, Tollgate};
use tokio::task::block_in_place;

const RULES: &str = r#"
domain: shutdown
descriptors:
  - key: user
    token_bucket: {capacity: 1000000, refill: 1000/s}
"#;

fn request(user: u64) -> RateLimitRequest {
    RateLimitRequest {
        domain: "shutdown".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: format!("u{}", user % 50),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// Whether a failed call is one the closing server never took: the connection was refused or
/// closed under it (`Unavailable`, `Cancelled`), or the stream was above the last one the
/// server's GOAWAY (`NO_ERROR`) said it processed, which RFC 9113 section 6.8 guarantees was not
/// processed (h2 fails it with a `GoAway` error, which tonic reports as `Internal`).
fn not_accepted(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled => true,
        tonic::Code::Internal => {
            let detail = format!("{status:?}");
            detail.contains("GoAway(") && detail.contains("NO_ERROR")
        }
        _ => false,
    }
}

#[derive(Default)]
struct Tally {
    answered: AtomicU64,
    answered_after_signal: AtomicU64,
    /// Failures that cannot be "the server no longer takes requests": any failure before the
    /// listeners closed, and any but a refused or closed connection after.
    lost: AtomicU64,
    refused: AtomicU64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_every_accepted_request_and_exits_in_time() {
    let mut tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shutdown.yaml", RULES)
            .settings("shutdown: {drain_seconds: 2, timeout_seconds: 3}")
            .start()
    });
    let target = format!("http://{}", tollgate.grpc_addr);
    let tally = Arc::new(Tally::default());
    let signalled = Arc::new(AtomicBool::new(false));
    // Set once the drain period is surely over: from then on the listeners may be closed.
    let closing = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for i in 0..16u64 {
        let (target, tally, signalled, closing) = (target.clone(), tally.clone(), signalled.clone(), closing.clone());
        clients.push(tokio::spawn(async move {
            let Ok(mut c) = RateLimitServiceClient::connect(target).await else {
                return;
            };
            let mut n = i;
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(12) {
                n += 16;
                match c.should_rate_limit(request(n)).await {
                    Ok(_) => {
                        tally.answered.fetch_add(1, Ordering::Relaxed);
                        if signalled.load(Ordering::Relaxed) {
                            tally.answered_after_signal.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // The server closed its listener and connections: the request was not
                    // accepted. Before the drain ended, that would be a loss.
                    Err(status) if closing.load(Ordering::Relaxed) && not_accepted(&status) => {
                        tally.refused.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Err(status) => {
                        eprintln!("lost: {status:?}");
                        tally.lost.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(tally.answered.load(Ordering::Relaxed) > 0, "load is running");
    let signal_at = Instant::now();
    signalled.store(true, Ordering::Relaxed);
    let status = Command::new("kill")
        .args(["-TERM", &tollgate.process.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());

    let closing_after = {
        let closing = closing.clone();
        tokio::spawn(async move {
            // The drain lasts 2 s from the signal; "kill" returned after sending it.
            tokio::time::sleep(Duration::from_millis(1900)).await;
            closing.store(true, Ordering::Relaxed);
        })
    };
    // Draining: not ready, still answering.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let readyz = block_in_place(|| http_get(tollgate.http_addr, "/readyz"));
    assert_eq!(readyz.map(|(s, _)| s), Some(503), "not ready while draining");
    let during_drain = tally.answered_after_signal.load(Ordering::Relaxed);
    assert!(during_drain > 0, "requests are still answered while draining");

    // Exits within drain (2 s) + timeout (3 s), with a margin for a loaded machine.
    let exited = block_in_place(|| loop {
        if let Some(status) = tollgate.process.exited() {
            break status;
        }
        assert!(
            signal_at.elapsed() < Duration::from_secs(9),
            "still running {:?} after SIGTERM\n{}",
            signal_at.elapsed(),
            tollgate.process.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    });
    assert!(
        exited.success(),
        "exit status {exited:?}\n{}",
        tollgate.process.log_tail(30)
    );
    assert!(
        signal_at.elapsed() >= Duration::from_secs(2),
        "the drain period was skipped"
    );
    for c in clients {
        c.await.unwrap();
    }
    closing_after.await.unwrap();
    assert_eq!(
        tally.lost.load(Ordering::Relaxed),
        0,
        "accepted requests left unanswered"
    );
    // The server finished every stream it had accepted before its deadline (it did not abort).
    let log = tollgate.process.log();
    assert!(log.contains("all requests in flight answered"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let mut tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shutdown.yaml", RULES)
            .settings("shutdown: {drain_seconds: 30, timeout_seconds: 30}")
            .start()
    });
    // A half-sent HTTP request: the HTTP server would wait for it until the deadline (30 s).
    let mut half = std::net::TcpStream::connect(tollgate.http_addr).unwrap();
    std::io::Write::write_all(&mut half, b"GET /readyz HTTP/1.1\r\nHost: x\r\n").unwrap();
    let pid = tollgate.process.id().to_string();
    let started = Instant::now();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    Command::new("kill").args(["-INT", &pid]).status().unwrap();
    let exited = block_in_place(|| loop {
        if let Some(status) = tollgate.process.exited() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the second signal was ignored"
        );
        std::thread::sleep(Duration::from_millis(50));
    });
    assert!(exited.success(), "{exited:?}");
}

/// Envoy keeps its connections and keeps sending on them until told to go away: every request
/// on an open connection is answered from the signal until shortly before the deadline, also
/// after the listener closed (64 callers on their own connections; before, the GOAWAY sent when
/// the listener closed made the last moments' requests fail on a closed listener).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_callers_keep_being_answered_on_open_connections_until_the_deadline() {
    let mut tollgate = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shutdown.yaml", RULES)
            .settings("shutdown: {drain_seconds: 2, timeout_seconds: 5}")
            .start()
    });
    let target = format!("http://{}", tollgate.grpc_addr);
    let answered = Arc::new(AtomicU64::new(0));
    let answered_after_close = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    // The listener closes 2 s after the signal, the GOAWAY comes 4 s after that (5 s timeout,
    // 1 s before the deadline): callers send until 4.5 s after the signal, 1.5 s before it.
    let signal_at: Arc<std::sync::OnceLock<Instant>> = Arc::new(std::sync::OnceLock::new());
    let mut clients = Vec::new();
    for i in 0..64u64 {
        let (target, answered, after, failed, signal_at) = (
            target.clone(),
            answered.clone(),
            answered_after_close.clone(),
            failed.clone(),
            signal_at.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut c = RateLimitServiceClient::connect(target)
                .await
                .expect("connect before the signal");
            let mut n = i;
            loop {
                let since = signal_at.get().map(Instant::elapsed);
                if since.is_some_and(|s| s >= Duration::from_millis(4500)) {
                    return;
                }
                n += 64;
                match c.should_rate_limit(request(n)).await {
                    Ok(_) => {
                        answered.fetch_add(1, Ordering::Relaxed);
                        if since.is_some_and(|s| s >= Duration::from_millis(2300)) {
                            after.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(status) => {
                        eprintln!("failed {since:?} after the signal: {status:?}");
                        failed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while answered.load(Ordering::Relaxed) < 64 {
        assert!(Instant::now() < deadline, "load is not running");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal_at.set(Instant::now()).unwrap();
    let status = Command::new("kill")
        .args(["-TERM", &tollgate.process.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0, "requests on open connections failed");
    assert!(
        answered_after_close.load(Ordering::Relaxed) > 0,
        "nothing was answered after the listener closed"
    );
    // The callers hung up: with no connection left it exits before the deadline.
    let signal_at = *signal_at.get().unwrap();
    let exited = block_in_place(|| loop {
        if let Some(status) = tollgate.process.exited() {
            break status;
        }
        assert!(
            signal_at.elapsed() < Duration::from_secs(12),
            "still running {:?} after SIGTERM\n{}",
            signal_at.elapsed(),
            tollgate.process.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    });
    assert!(exited.success(), "{exited:?}\n{}", tollgate.process.log_tail(30));
    let log = tollgate.process.log();
    assert!(log.contains("all requests in flight answered"), "{log}");
}

/// At start, readiness comes before the HTTP listeners answer: a probe that reaches `/readyz`
/// the moment the port first answers (a Kubernetes readiness probe, the tests' harness) sees
/// the backend's own state, never "starting". It raced: the HTTP listeners were served before
/// the gRPC server had started, and an early probe was told 503 once in a while. Several
/// starts, each probed as fast as a loop can, from before the process starts.
#[test]
fn the_first_readyz_answer_is_ready_not_starting() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let rules = dir.path().join("rules");
    std::fs::create_dir(&rules).expect("create the rules directory");
    std::fs::write(rules.join("shutdown.yaml"), RULES).expect("write the rules");
    for start in 0..8 {
        let grpc = std::net::SocketAddr::from(([127, 0, 0, 1], support::free_port()));
        let http = std::iter::repeat_with(support::free_port)
            .find(|p| *p != grpc.port())
            .map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p)))
            .expect("an endless iterator");
        let settings = dir.path().join("tollgate.yaml");
        std::fs::write(
            &settings,
            format!(
                "grpc_addr: {grpc}\nhttp_addr: {http}\nadmin: {{enabled: false}}\nrules: {}\n",
                support::yaml_str(&rules.to_string_lossy())
            ),
        )
        .expect("write the settings");
        let prober = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Some(answer) = http_get(http, "/readyz") {
                    return Some(answer);
                }
                if Instant::now() > deadline {
                    return None;
                }
            }
        });
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command.arg("serve").arg("--config").arg(&settings).env("NO_COLOR", "1");
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("TOLLGATE_") {
                command.env_remove(key);
            }
        }
        let log = dir.path().join(format!("tollgate.{start}.log"));
        let process = support::ChildGuard::spawn("tollgate", &mut command, &log);
        let first = prober.join().expect("the prober");
        assert_eq!(
            first,
            Some((200, "ready\n".to_owned())),
            "start {start}: the first /readyz answer\n{}",
            process.log()
        );
    }
}
