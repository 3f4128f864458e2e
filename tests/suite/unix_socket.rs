//! The gRPC listener on a Unix domain socket (`grpc_addr: unix:<path>`, and envoyproxy/ratelimit's
//! `GRPC_UDS`): RLS, health and RLQS over the socket, the file's mode, a stale file replaced, a
//! live one and a regular file left alone, the file removed at a clean shutdown; and a real
//! Envoy whose `ratelimit` cluster is a `pipe` address (skipped without Envoy, failing under
//! `CI=true`).

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::envoy_e2e::{client, get_with, start_upstream, BOOTSTRAP, RULES};
use crate::support::{self, envoy_or_skip, free_port, http_get, ChildGuard, Envoy, Tollgate};

/// A tonic channel to the gRPC server on the Unix socket `path` (the URI is a placeholder: the
/// connector ignores it).
async fn unix_channel(path: &Path) -> Channel {
    let path = path.to_owned();
    Endpoint::from_static("http://tollgate.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .expect("connect over the Unix socket")
}

/// A temporary directory with a short path: a socket path must fit in 107 bytes.
fn short_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("tg-uds.")
        .tempdir_in("/tmp")
        .expect("a temporary directory")
}

/// One `RateLimitRequest` of domain `e2e` for `api_key`, answered over `channel`.
async fn ask(channel: &Channel, key: &str) -> i32 {
    let mut client = RateLimitServiceClient::new(channel.clone());
    let request = support::request("e2e", &[("api_key", key)], 1);
    client
        .should_rate_limit(request)
        .await
        .expect("an answer")
        .into_inner()
        .overall_code
}

/// Sends SIGTERM and waits for the process to exit (at most 30 s).
fn stop(process: &mut ChildGuard) {
    support::signal(process.id(), "TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    while process.exited().is_none() {
        assert!(
            Instant::now() < deadline,
            "tollgate did not exit\n{}",
            process.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rls_health_and_rlqs_are_served_on_a_unix_socket_removed_at_shutdown() {
    let dir = short_dir();
    let socket = dir.path().join("rls.sock");
    let mut tollgate = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("e2e.yaml", RULES)
            .grpc_unix_socket(&socket)
            .settings("grpc: {unix_socket_mode: \"0600\"}\nshutdown: {drain_seconds: 0, timeout_seconds: 2}")
            .start()
    });
    let meta = std::fs::metadata(&socket).expect("the socket file");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "grpc.unix_socket_mode");
    let (_, config) = tollgate.config().expect("/config");
    assert!(
        config.contains(&format!("\"grpc_addr\":\"unix:{}\"", socket.display())),
        "{config}"
    );

    let channel = unix_channel(&socket).await;
    for _ in 0..5 {
        assert_eq!(ask(&channel, "alice").await, Code::Ok as i32);
    }
    assert_eq!(
        ask(&channel, "alice").await,
        Code::OverLimit as i32,
        "the sixth is over"
    );

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await
        .expect("health answers")
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // RLQS shares the listener: a report is answered with an assignment.
    let mut rlqs = RateLimitQuotaServiceClient::new(channel.clone());
    let report = RateLimitQuotaUsageReports {
        domain: "e2e".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("api_key".to_owned(), "bob".to_owned())].into_iter().collect(),
            }),
            time_elapsed: Some(Default::default()),
            num_requests_allowed: 1,
            num_requests_denied: 0,
        }],
    };
    let mut responses = rlqs
        .stream_rate_limit_quotas(futures_util::stream::iter([report]).chain(futures_util::stream::pending()))
        .await
        .expect("the RLQS stream opens")
        .into_inner();
    let answer = tokio::time::timeout(Duration::from_secs(10), responses.message())
        .await
        .expect("an RLQS answer within 10 s")
        .expect("no error")
        .expect("a response");
    assert!(!answer.bucket_action.is_empty(), "{answer:?}");
    drop(responses);
    drop(channel);

    tokio::task::block_in_place(|| stop(&mut tollgate.process));
    assert!(!socket.exists(), "the socket file is removed at a clean shutdown");
    assert!(
        tollgate.process.log().contains("removed the gRPC socket file"),
        "{}",
        tollgate.process.log_tail(20)
    );
}

/// A `tollgate serve` on `socket` and HTTP port `http_port` with the admin API off, run to
/// its exit: its exit code and output.
fn serve_to_exit(dir: &Path, socket: &Path, http_port: u16) -> (Option<i32>, String) {
    let rules = dir.join("rules.yaml");
    std::fs::write(&rules, RULES).unwrap();
    let settings = dir.join("second.yaml");
    std::fs::write(
        &settings,
        format!(
            "grpc_addr: unix:{}\nhttp_addr: 127.0.0.1:{http_port}\nadmin: {{enabled: false}}\nrules: {}\n",
            socket.display(),
            rules.display()
        ),
    )
    .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.arg("serve").arg("--config").arg(&settings).env("NO_COLOR", "1");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TOLLGATE_") {
            command.env_remove(key);
        }
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // It should stop by itself at the bind; a process still running after 30 s took the socket.
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the second tollgate did not exit: it took the socket");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_socket_is_replaced_a_live_one_kept_and_a_regular_file_never_removed() {
    let dir = short_dir();
    let socket = dir.path().join("rls.sock");
    // What a crash leaves: a socket file nothing accepts on.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(std::os::unix::net::UnixStream::connect(&socket).is_err());
    let tollgate = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("e2e.yaml", RULES)
            .grpc_unix_socket(&socket)
            .start()
    });
    assert!(
        tollgate.process.log().contains("replacing a stale gRPC socket file"),
        "{}",
        tollgate.process.log_tail(20)
    );
    let channel = unix_channel(&socket).await;
    assert_eq!(ask(&channel, "carol").await, Code::Ok as i32);

    // A second process on the same path stops with a message and leaves the socket serving.
    let (code, text) = tokio::task::block_in_place(|| serve_to_exit(dir.path(), &socket, free_port()));
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("another process is accepting connections"), "{text}");
    assert!(text.contains(&socket.display().to_string()), "{text}");
    assert_eq!(ask(&channel, "carol").await, Code::Ok as i32, "the first still serves");
    let fresh = unix_channel(&socket).await;
    assert_eq!(
        ask(&fresh, "carol").await,
        Code::Ok as i32,
        "new connections still reach it"
    );

    // A regular file at the path is never removed.
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, "keep me").unwrap();
    let (code, text) = tokio::task::block_in_place(|| serve_to_exit(dir.path(), &file, free_port()));
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("exists and is not a socket"), "{text}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

/// A start-up that fails after the socket was bound (the HTTP port is taken) removes it again.
#[test]
fn a_failed_start_removes_the_socket_it_bound() {
    let dir = short_dir();
    let socket = dir.path().join("rls.sock");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let (code, text) = serve_to_exit(dir.path(), &socket, port);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("cannot listen for HTTP"), "{text}");
    assert!(!socket.exists(), "the socket bound before the failure is removed");
}

/// Envoy's bootstrap of `envoy_e2e`, its `ratelimit` cluster reaching tollgate on `socket`.
fn pipe_bootstrap(upstream_port: u16, socket: &Path) -> String {
    let tcp = "- endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: @RATELIMIT_PORT@ } } }";
    assert!(
        BOOTSTRAP.contains(tcp),
        "the ratelimit endpoint of envoy_e2e's bootstrap moved"
    );
    BOOTSTRAP
        .replace("@UPSTREAM_PORT@", &upstream_port.to_string())
        .replace(
            tcp,
            &format!(
                "- endpoint: {{ address: {{ pipe: {{ path: \"{}\" }} }} }}",
                socket.display()
            ),
        )
}

/// Through Envoy (its `ratelimit` cluster on the pipe `socket`): five requests of a fresh key
/// pass to the upstream, the sixth is answered 429, and Envoy's check never failed.
async fn five_pass_then_429_through_envoy(envoy_bin: &Path, socket: &Path) {
    let upstream = start_upstream().await;
    let bootstrap = pipe_bootstrap(upstream.port(), socket);
    let envoy = tokio::task::block_in_place(|| Envoy::start(envoy_bin, &bootstrap));
    let limited = format!("http://{}/limited", envoy.listener("ingress"));
    let client = client();
    let start = Instant::now();
    for k in 1..=5 {
        let reply = get_with(&client, &limited, &[("x-api-key", "dave")], start).await;
        assert_eq!(reply.status, 200, "request {k}:\n{}", reply.dump());
        assert_eq!(reply.header("x-upstream"), Some("yes"));
        assert!(
            reply.header("ratelimit-policy").is_some(),
            "tollgate answered:\n{}",
            reply.dump()
        );
    }
    let denied = get_with(&client, &limited, &[("x-api-key", "dave")], start).await;
    assert_eq!(denied.status, 429, "{}", denied.dump());
    assert_eq!(denied.header("x-upstream"), None);
    let errors = tokio::task::block_in_place(|| envoy.stat("cluster.upstream.ratelimit.error"));
    assert_eq!(errors, 0, "Envoy's checks over the pipe failed");
    let over = tokio::task::block_in_place(|| envoy.stat("cluster.upstream.ratelimit.over_limit"));
    assert_eq!(over, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reaches_tollgate_through_a_pipe_address() {
    let Some(envoy_bin) = envoy_or_skip("envoy_reaches_tollgate_through_a_pipe_address") else {
        return;
    };
    let dir = short_dir();
    let socket = dir.path().join("rls.sock");
    let _tollgate = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("e2e.yaml", RULES)
            .grpc_unix_socket(&socket)
            .start()
    });
    five_pass_then_429_through_envoy(&envoy_bin, &socket).await;
}

/// envoyproxy/ratelimit's rules for `envoy_e2e`'s bootstrap: five a minute per `api_key`.
const THEIR_RULES: &str =
    "domain: e2e\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";

/// Started as `ratelimit` with only their environment, `GRPC_UDS` among it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_uds_from_their_environment_behind_envoy() {
    let Some(envoy_bin) = envoy_or_skip("grpc_uds_from_their_environment_behind_envoy") else {
        return;
    };
    let dir = short_dir();
    let socket: PathBuf = dir.path().join("ratelimit.sock");
    let config = dir.path().join("data/ratelimit/config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(config.join("config.yaml"), THEIR_RULES).unwrap();
    let link = dir.path().join("ratelimit");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_tollgate"), &link).unwrap();
    let http_port = free_port();
    let mut command = Command::new(&link);
    command
        .env_clear()
        .env("NO_COLOR", "1")
        .current_dir(dir.path())
        .env("USE_STATSD", "false")
        .env("RUNTIME_ROOT", dir.path().join("data"))
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_WATCH_ROOT", "false")
        .env("HOST", "127.0.0.1")
        .env("PORT", http_port.to_string())
        .env("GRPC_UDS", &socket)
        .env("TOLLGATE_ADMIN__ENABLED", "false");
    let mut process = ChildGuard::spawn("tollgate", &mut command, &dir.path().join("tollgate.log"));
    let http = std::net::SocketAddr::from(([127, 0, 0, 1], http_port));
    tokio::task::block_in_place(|| {
        support::wait_until(&mut process, || {
            http_get(http, "/healthcheck").filter(|(status, body)| *status == 200 && body == "OK")
        })
    })
    .unwrap_or_else(|why| panic!("tollgate did not become healthy: {why}\n{}", process.log_tail(40)));
    let meta = std::fs::metadata(&socket).expect("GRPC_UDS's socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o660,
        "the default grpc.unix_socket_mode"
    );

    five_pass_then_429_through_envoy(&envoy_bin, &socket).await;
    tokio::task::block_in_place(|| stop(&mut process));
    assert!(!socket.exists(), "removed at shutdown");
}

/// SIGTERM on the socket drains as on TCP: during `drain_seconds` new connections are still
/// answered while health says `NOT_SERVING`; then the listener closes (a connect is refused)
/// while an open connection is still answered; at the end the file is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_drains_the_socket_as_tcp() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let dir = short_dir();
    let socket = dir.path().join("rls.sock");
    let mut tollgate = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("e2e.yaml", RULES)
            .grpc_unix_socket(&socket)
            .settings("shutdown: {drain_seconds: 2, timeout_seconds: 6}")
            .start()
    });
    let open = unix_channel(&socket).await;
    assert_eq!(ask(&open, "gina").await, Code::Ok as i32);
    support::signal(tollgate.process.id(), "TERM");
    let mut health = tonic_health::pb::health_client::HealthClient::new(open.clone());
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
            .await
            .expect("health answers while draining")
            .into_inner()
            .status;
        if status == ServingStatus::NotServing as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "health still SERVING after the signal");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = unix_channel(&socket).await;
    assert_eq!(
        ask(&during, "gina").await,
        Code::Ok as i32,
        "a new connection during the drain"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        assert!(Instant::now() < deadline, "the listener did not close after the drain");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        ask(&open, "gina").await,
        Code::Ok as i32,
        "an open connection is still answered after the listener closed"
    );
    drop((health, open, during));
    tokio::task::block_in_place(|| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while tollgate.process.exited().is_none() {
            assert!(Instant::now() < deadline, "tollgate did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    assert!(!socket.exists(), "removed at the end");
}
