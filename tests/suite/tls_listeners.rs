//! TLS on tollgate's listeners (docs/operations.md, "TLS"): `tollgate serve` with certificates
//! made in each test by a CA of its own (`support/tls.rs`), and real handshakes over 127.0.0.1.
//!
//! - mTLS on the gRPC listener, from tollgate's settings and from envoyproxy/ratelimit's and
//!   Envoy Gateway's variables: a client with a certificate from the CA is answered over HTTP/2;
//!   none, one from another CA, or one without a required name is refused by the server
//!   (counted in `tollgate_tls_handshake_failures_total`); Envoy Gateway's own shape of
//!   certificates (RSA keys in PKCS#1, a wildcard name, no extended key usage) works.
//! - Rotation: new files are used for new connections while an open one keeps being answered
//!   on the old certificate; files that do not load keep the certificate in use.
//! - HTTPS on the HTTP and admin listeners (HTTP/1.1 and HTTP/2 by ALPN), the metrics listener
//!   staying plain; the expiry metric and `/config`; start-up errors naming the setting and
//!   never a key.

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use serde_json::Value;
use support::openssl::{Certs, Key};
use support::tls::{ask, channel, client_config, connect_and_ask, h2_get, https_get, unix_now, Ca, Files};
use support::{Scrape, Tollgate};

const RULES: &str = r#"
domain: tls
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 100, refill: 100/1h}
"#;

/// The request every test asks: one hit of `user=alice`.
fn request() -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    support::request("tls", &[("user", "alice")], 0)
}

/// A whole number of seconds some days ahead: a certificate's notAfter, exactly as read back.
fn days_ahead(days: i64) -> i64 {
    unix_now() + days * 86_400
}

/// Failed handshakes on `listener` as tollgate counts them (its plain HTTP port).
fn handshake_failures(http: SocketAddr, listener: &str) -> f64 {
    Scrape::from(http)
        .get("tollgate_tls_handshake_failures_total", &[("listener", listener)])
        .unwrap_or(0.0)
}

/// Waits up to 10 s for `done`, polling every 50 ms; panics with `what` otherwise.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen within 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The admin `/config` as JSON (the admin listener plain).
fn config_of(tg: &Tollgate) -> Value {
    let (status, body) = tg.config().expect("/config answers");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// mTLS from tollgate's settings: the right client is answered over HTTP/2 (`h2` by ALPN) with a
/// decision; a client without a certificate, with one from another CA, offering only
/// `http/1.1`, or speaking plain text is refused, and each refusal is the server's (counted).
/// The expiry metric and `/config` show the certificate served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_on_the_grpc_listener_from_tollgates_settings() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, other_ca) = (Ca::new("tollgate test CA"), Ca::new("another CA"));
    let not_after = days_ahead(30);
    let server = ca.server("tollgate", 4242, not_after);
    let files = Files::write(dir.path(), &server, &ca);
    let tg = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("tls.yaml", RULES)
            .settings(&format!("tls: {{grpc: {}}}", files.yaml(true, "")))
            .start()
    });
    let envoy = ca.client("envoy", &["envoy.gateway.svc"]);

    let seen = Arc::new(Mutex::new(Vec::new()));
    let good = channel(tg.grpc_addr, client_config(&ca, Some(&envoy), &[b"h2"]), seen.clone())
        .await
        .unwrap();
    let first = ask(&good, request()).await.unwrap();
    let second = ask(&good, request()).await.unwrap();
    assert_eq!(first.overall_code, Code::Ok as i32);
    assert_eq!(
        (first.statuses[0].limit_remaining, second.statuses[0].limit_remaining),
        (99, 98),
        "decided, on one bucket"
    );
    let connections = seen.lock().unwrap().clone();
    assert_eq!(connections.len(), 1);
    assert_eq!(
        connections[0].server_cert,
        server.der(),
        "the certificate of tls.grpc.cert_file"
    );
    assert_eq!(
        connections[0].alpn.as_deref(),
        Some(&b"h2"[..]),
        "HTTP/2 agreed by ALPN"
    );

    let refused = [
        ("no client certificate", client_config(&ca, None, &[b"h2"])),
        (
            "a certificate from another CA",
            client_config(&ca, Some(&other_ca.client("envoy", &["envoy.gateway.svc"])), &[b"h2"]),
        ),
        (
            "only http/1.1 offered",
            client_config(&ca, Some(&envoy), &[b"http/1.1"]),
        ),
    ];
    for (what, config) in refused {
        let before = tokio::task::block_in_place(|| handshake_failures(tg.http_addr, "grpc"));
        let answer = connect_and_ask(tg.grpc_addr, config, request()).await;
        assert!(answer.is_err(), "{what}: answered {answer:?}");
        let http = tg.http_addr;
        eventually(&format!("{what}: the failure counted"), || {
            tokio::task::block_in_place(|| handshake_failures(http, "grpc")) > before
        })
        .await;
    }
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{}", tg.grpc_addr))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await;
    let plain_answer = match plain {
        Ok(channel) => ask(&channel, request()).await,
        Err(e) => Err(e.to_string()),
    };
    assert!(plain_answer.is_err(), "plain text answered: {plain_answer:?}");
    // The open connection is still the one it was, and still answered.
    assert_eq!(ask(&good, request()).await.unwrap().statuses[0].limit_remaining, 97);
    assert_eq!(seen.lock().unwrap().len(), 1);

    let scrape = tokio::task::block_in_place(|| Scrape::from(tg.http_addr));
    assert_eq!(
        scrape.get(
            "tollgate_tls_certificate_expiry_timestamp_seconds",
            &[("listener", "grpc")]
        ),
        Some(not_after as f64)
    );
    let config = config_of(&tg);
    let grpc = &config["tls"]["grpc"];
    assert_eq!(grpc["certificate"]["not_after_unix"], not_after);
    assert_eq!(grpc["certificate"]["serial"], "10:92", "4242");
    assert_eq!(grpc["certificate"]["subject"], "CN=tollgate");
    assert_eq!(grpc["client_ca_file"], files.ca.to_string_lossy().as_ref());
    assert_eq!(grpc["last_failure"], Value::Null);
    assert_eq!(
        config["settings"]["tls"]["grpc"]["key_file"],
        files.key.to_string_lossy().as_ref(),
        "paths shown, never contents"
    );
    assert!(!config.to_string().contains("PRIVATE KEY"), "{config}");
}

/// `client_sans`: a client certificate from the CA must also carry one of the names: a DNS name
/// (exactly, or under a certificate's wildcard) or a URI; another name from the same CA is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_must_carry_a_required_name() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("tollgate test CA");
    let files = Files::write(dir.path(), &ca.server("tollgate", 1, days_ahead(30)), &ca);
    let sans = r#"client_sans: [envoy-1.gateway.svc, "spiffe://cluster.local/ns/gw/sa/envoy"]"#;
    let tg = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("tls.yaml", RULES)
            .settings(&format!("tls: {{grpc: {}}}", files.yaml(true, sans)))
            .start()
    });
    for (name, accepted) in [
        ("envoy-1.gateway.svc", true),
        ("*.gateway.svc", true),
        ("spiffe://cluster.local/ns/gw/sa/envoy", true),
        ("intruder.gateway.svc", false),
        ("spiffe://cluster.local/ns/gw/sa/intruder", false),
        ("envoy-1.gateway.svc.evil", false),
    ] {
        let client = ca.client("client", &[name]);
        let answer = connect_and_ask(tg.grpc_addr, client_config(&ca, Some(&client), &[b"h2"]), request()).await;
        assert_eq!(answer.is_ok(), accepted, "a certificate for {name}: {answer:?}");
    }
}

/// Envoy Gateway's variables (its CA as `GRPC_SERVER_TLS_CA_CERT`, which envoyproxy/ratelimit
/// does not read) and envoyproxy/ratelimit's own (`GRPC_CLIENT_TLS_CACERT`,
/// `GRPC_CLIENT_TLS_SAN`) turn on mTLS on the gRPC listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_environment_turns_on_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("envoy-gateway");
    let files = Files::write(dir.path(), &ca.server("envoy", 7, days_ahead(30)), &ca);
    let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let gateway = [
        ("GRPC_SERVER_USE_TLS", "true".to_owned()),
        ("GRPC_SERVER_TLS_CERT", path(&files.cert)),
        ("GRPC_SERVER_TLS_KEY", path(&files.key)),
        ("GRPC_SERVER_TLS_CA_CERT", path(&files.ca)),
        ("USE_STATSD", "false".to_owned()),
    ];
    let theirs = [
        ("GRPC_SERVER_USE_TLS", "true".to_owned()),
        ("GRPC_SERVER_TLS_CERT", path(&files.cert)),
        ("GRPC_SERVER_TLS_KEY", path(&files.key)),
        ("GRPC_CLIENT_TLS_CACERT", path(&files.ca)),
        ("GRPC_CLIENT_TLS_SAN", "envoy.gateway.svc".to_owned()),
    ];
    let envoy = ca.client("envoy", &["envoy.gateway.svc"]);
    let stranger = ca.client("stranger", &["stranger.gateway.svc"]);
    for (environment, env, stranger_accepted) in [("Envoy Gateway's", &gateway, true), ("theirs", &theirs, false)] {
        let tg = tokio::task::block_in_place(|| {
            env.iter()
                .fold(Tollgate::builder().rules_file("tls.yaml", RULES), |b, (k, v)| {
                    b.env(k, v)
                })
                .start()
        });
        let ok = connect_and_ask(tg.grpc_addr, client_config(&ca, Some(&envoy), &[b"h2"]), request()).await;
        assert_eq!(ok.map(|r| r.overall_code), Ok(Code::Ok as i32), "{environment}");
        let none = connect_and_ask(tg.grpc_addr, client_config(&ca, None, &[b"h2"]), request()).await;
        assert!(none.is_err(), "{environment}: no client certificate answered");
        let other = connect_and_ask(tg.grpc_addr, client_config(&ca, Some(&stranger), &[b"h2"]), request()).await;
        assert_eq!(other.is_ok(), stranger_accepted, "{environment}: {other:?}");
        let config = config_of(&tg);
        assert_eq!(
            config["tls"]["grpc"]["client_ca_file"],
            path(&files.ca),
            "{environment}"
        );
        assert!(
            tg.process
                .log()
                .contains("setting from the envoyproxy/ratelimit environment")
                && tg.process.log().contains("setting=tls.grpc.cert_file"),
            "{environment}: {}",
            tg.process.log()
        );
    }
}

/// A rotation (cert-manager renewing the certificate: new files, same CA): after the reload,
/// a new connection gets the new certificate while the connection opened before keeps being
/// answered on the old one, never reconnecting; the expiry metric follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_serves_new_connections_and_open_ones_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("tollgate test CA");
    let old = ca.server("tollgate", 1, days_ahead(10));
    let files = Files::write(dir.path(), &old, &ca);
    let tg = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("tls.yaml", RULES)
            .settings(&format!("tls: {{grpc: {}, reload_seconds: 1}}", files.yaml(true, "")))
            .start()
    });
    let envoy = client_config(&ca, Some(&ca.client("envoy", &["envoy"])), &[b"h2"]);
    let before = Arc::new(Mutex::new(Vec::new()));
    let open = channel(tg.grpc_addr, envoy.clone(), before.clone()).await.unwrap();
    assert_eq!(ask(&open, request()).await.unwrap().statuses[0].limit_remaining, 99);

    let renewed_until = days_ahead(90);
    let renewed = ca.server("tollgate-renewed", 2, renewed_until);
    renewed.write(&files.cert, &files.key);
    let http = tg.http_addr;
    eventually("the reload", || {
        tokio::task::block_in_place(|| Scrape::from(http)).get(
            "tollgate_tls_certificate_expiry_timestamp_seconds",
            &[("listener", "grpc")],
        ) == Some(renewed_until as f64)
    })
    .await;

    let after = Arc::new(Mutex::new(Vec::new()));
    let fresh = channel(tg.grpc_addr, envoy.clone(), after.clone()).await.unwrap();
    assert_eq!(ask(&fresh, request()).await.unwrap().statuses[0].limit_remaining, 98);
    assert_eq!(after.lock().unwrap()[0].server_cert, renewed.der(), "a new connection");
    for remaining in [97, 96] {
        assert_eq!(
            ask(&open, request()).await.unwrap().statuses[0].limit_remaining,
            remaining
        );
    }
    let before = before.lock().unwrap().clone();
    assert_eq!(before.len(), 1, "the open channel never reconnected");
    assert_eq!(before[0].server_cert, old.der());
    let scrape = tokio::task::block_in_place(|| Scrape::from(http));
    let reloads = |result| {
        scrape.get(
            "tollgate_tls_certificate_reloads_total",
            &[("listener", "grpc"), ("result", result)],
        )
    };
    assert_eq!((reloads("success"), reloads("failure")), (Some(1.0), Some(0.0)));
    assert_eq!(
        config_of(&tg)["tls"]["grpc"]["certificate"]["subject"],
        "CN=tollgate-renewed"
    );
}

/// Files that do not load (a key that is not the certificate's) keep the certificate in use:
/// new connections still get it, the failure is counted once and shown in `/config`; once the
/// files are right again they are loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_that_do_not_load_keep_the_certificate_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("tollgate test CA");
    let good = ca.server("tollgate", 1, days_ahead(10));
    let files = Files::write(dir.path(), &good, &ca);
    let tg = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("tls.yaml", RULES)
            .settings(&format!("tls: {{grpc: {}, reload_seconds: 1}}", files.yaml(false, "")))
            .start()
    });
    let client = client_config(&ca, None, &[b"h2"]);
    let next = ca.server("tollgate-next", 2, days_ahead(20));
    std::fs::write(&files.cert, &next.cert_pem).unwrap();
    let http = tg.http_addr;
    let failures = move || {
        tokio::task::block_in_place(|| Scrape::from(http))
            .get(
                "tollgate_tls_certificate_reloads_total",
                &[("listener", "grpc"), ("result", "failure")],
            )
            .unwrap_or(0.0)
    };
    eventually("the failed reload counted", || failures() == 1.0).await;
    let last_failure = config_of(&tg)["tls"]["grpc"]["last_failure"]["error"].clone();
    assert!(
        last_failure
            .as_str()
            .is_some_and(|e| e.contains("tls.grpc.key_file") && e.contains("tls.key")),
        "{last_failure}"
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let conn = channel(tg.grpc_addr, client.clone(), seen.clone()).await.unwrap();
    assert!(ask(&conn, request()).await.is_ok());
    assert_eq!(
        seen.lock().unwrap()[0].server_cert,
        good.der(),
        "the certificate in use stays"
    );
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(failures(), 1.0, "counted once, not at every check");

    std::fs::write(&files.key, &next.key_pem).unwrap();
    eventually("the reload", || {
        config_of(&tg)["tls"]["grpc"]["certificate"]["subject"] == "CN=tollgate-next"
    })
    .await;
    assert_eq!(config_of(&tg)["tls"]["grpc"]["last_failure"], Value::Null);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let conn = channel(tg.grpc_addr, client, seen.clone()).await.unwrap();
    assert!(ask(&conn, request()).await.is_ok());
    assert_eq!(seen.lock().unwrap()[0].server_cert, next.der());
}

/// HTTPS on the HTTP listener (HTTP/1.1 and HTTP/2 by ALPN) and the admin listener with client
/// certificates; the metrics listener stays plain; plain text to a TLS port gets no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_on_the_http_and_admin_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("tollgate test CA");
    let not_after = days_ahead(60);
    let files = Files::write(dir.path(), &ca.server("tollgate", 9, not_after), &ca);
    let anonymous = client_config(&ca, None, &[b"http/1.1"]);
    let operator = client_config(&ca, Some(&ca.client("operator", &["ops.example"])), &[b"http/1.1"]);
    let probe = anonymous.clone();
    let metrics = SocketAddr::from(([127, 0, 0, 1], support::free_port()));
    let tg = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("tls.yaml", RULES)
            .settings(&format!(
                "tls: {{http: {}, admin: {}}}\nmetrics: {{addr: {metrics}}}",
                files.yaml(false, ""),
                files.yaml(true, "")
            ))
            .ready_when(move |_, http, _| {
                https_get(http, probe.clone(), "/healthz").is_ok_and(|(status, _)| status == 200)
            })
            .start()
    });

    let (http, admin) = (tg.http_addr, tg.admin_addr);
    let healthz = tokio::task::block_in_place(|| https_get(http, anonymous.clone(), "/healthz")).unwrap();
    assert_eq!(healthz.0, 200, "{healthz:?}");
    let h2 = h2_get(http, client_config(&ca, None, &[b"h2", b"http/1.1"]), "/readyz")
        .await
        .unwrap();
    assert_eq!((h2.0.as_deref(), h2.1), (Some(&b"h2"[..]), 200), "{h2:?}");
    assert_eq!(
        tokio::task::block_in_place(|| support::http_get(http, "/healthz")),
        None,
        "plain text to the HTTPS port"
    );

    let (status, body) = tokio::task::block_in_place(|| https_get(admin, operator, "/config")).unwrap();
    assert_eq!(status, 200, "{body}");
    let config: Value = serde_json::from_str(&body).unwrap();
    for listener in ["http", "admin"] {
        assert_eq!(
            config["tls"][listener]["certificate"]["not_after_unix"], not_after,
            "{listener}"
        );
    }
    assert_eq!(
        config["tls"]["admin"]["client_ca_file"],
        files.ca.to_string_lossy().as_ref()
    );
    assert!(config["tls"].get("grpc").is_none(), "gRPC stays plain: {config}");
    let refused = tokio::task::block_in_place(|| https_get(admin, anonymous, "/config"));
    assert!(
        refused.is_err(),
        "the admin listener without a client certificate: {refused:?}"
    );

    // The metrics listener stays plain, and counts the refusal.
    let scrape = tokio::task::block_in_place(|| Scrape::from(metrics));
    for listener in ["http", "admin"] {
        assert_eq!(
            scrape.get(
                "tollgate_tls_certificate_expiry_timestamp_seconds",
                &[("listener", listener)]
            ),
            Some(not_after as f64),
            "{listener}"
        );
    }
    assert!(
        scrape
            .get("tollgate_tls_handshake_failures_total", &[("listener", "admin")])
            .is_some_and(|n| n >= 1.0),
        "the refused admin client counted"
    );
    // gRPC stays plain text here.
    let mut grpc =
        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
            format!("http://{}", tg.grpc_addr),
        )
        .await
        .unwrap();
    assert!(grpc.should_rate_limit(request()).await.is_ok());
}

/// Files that cannot serve stop the start with every problem, naming the setting and the
/// path, and never a key file's contents.
#[test]
fn unusable_files_stop_the_start_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("tollgate test CA");
    let files = Files::write(dir.path(), &ca.server("tollgate", 1, days_ahead(10)), &ca);
    let secret_key = dir.path().join("garbage.key");
    std::fs::write(&secret_key, "not a key but a secret: Pa55-never-shown\n").unwrap();
    let other = dir.path().join("other.key");
    std::fs::write(&other, ca.server("x", 2, days_ahead(10)).key_pem).unwrap();
    let missing = dir.path().join("missing.crt");
    let yaml = |p: &std::path::Path| support::yaml_str(&p.to_string_lossy());
    let settings = dir.path().join("tollgate.yaml");
    std::fs::write(
        &settings,
        format!(
            "grpc_addr: 127.0.0.1:{}\nhttp_addr: 127.0.0.1:{}\nadmin: {{enabled: false}}\nrules: {}\ntls:\n  \
             grpc: {{cert_file: {}, key_file: {}}}\n  http: {{cert_file: {}, key_file: {}}}\n  \
             admin: {{cert_file: {}, key_file: {}}}\n",
            support::free_port(),
            support::free_port(),
            yaml(&dir.path().join("rules")),
            yaml(&files.cert),
            yaml(&secret_key),
            yaml(&missing),
            yaml(&files.key),
            yaml(&files.cert),
            yaml(&other),
        ),
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("rules")).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("serve")
        .arg("--config")
        .arg(&settings)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(output.status.code(), Some(1), "{text}");
    for part in [
        format!("tls.grpc.key_file {}", secret_key.display()),
        format!("tls.http.cert_file: cannot read {}", missing.display()),
        format!("tls.admin.key_file {}", other.display()),
    ] {
        assert!(text.contains(&part), "{part} missing from: {text}");
    }
    assert!(!text.contains("Pa55-never-shown"), "{text}");
    assert!(!text.contains("BEGIN PRIVATE KEY"), "{text}");
}

/// Certificates shaped as Envoy Gateway's certgen makes them: RSA 2048 keys in PKCS#1 PEM
/// (`RSA PRIVATE KEY`), leaf certificates without extended key usages whose only name is a
/// namespace wildcard (`*.envoy-gateway-system`; `localhost` added for this test's client, which
/// checks the server's name where Envoy does not), one CA for Envoy's and the rate-limit
/// service's. Made with the `openssl` command (`support::openssl`; rcgen cannot make RSA keys
/// with ring); skipped without it, except under `CI=true`. Tollgate serves with them, and takes Envoy's
/// certificate, under their `GRPC_CLIENT_TLS_SAN` too (a name the wildcard covers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_shaped_rsa_certificates() {
    if std::process::Command::new("openssl").arg("version").output().is_err() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "no openssl command under CI=true"
        );
        eprintln!("envoy_gateway_shaped_rsa_certificates: skipped, no openssl command");
        return;
    }
    let certs = tokio::task::block_in_place(|| {
        let certs = Certs::with_ca("envoy-gateway", Key::RsaPkcs1);
        let ext = "subjectAltName=DNS:*.envoy-gateway-system,DNS:localhost\n\
                   keyUsage=digitalSignature,keyEncipherment,dataEncipherment,nonRepudiation\n";
        for (name, serial) in [("rate-limit", 1001), ("envoy", 1002)] {
            certs.issue(name, "envoy", ext, Key::RsaPkcs1, Some(serial));
        }
        certs
    });
    let read = |file: &str| String::from_utf8(certs.read(file)).unwrap();
    assert!(read("rate-limit.key").starts_with("-----BEGIN RSA PRIVATE KEY-----"));
    let path = |file: &str| certs.path(file).to_string_lossy().into_owned();
    let tg = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("tls.yaml", RULES)
            .env("GRPC_SERVER_USE_TLS", "true")
            .env("GRPC_SERVER_TLS_CERT", &path("rate-limit.crt"))
            .env("GRPC_SERVER_TLS_KEY", &path("rate-limit.key"))
            .env("GRPC_CLIENT_TLS_CACERT", &path("ca.crt"))
            .env("GRPC_CLIENT_TLS_SAN", "ratelimit-client.envoy-gateway-system")
            .start()
    });
    let config = |identity: Option<(&str, &str)>| {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(rustls::pki_types::pem::PemObject::from_pem_slice(read("ca.crt").as_bytes()).unwrap())
            .unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    vec![rustls::pki_types::pem::PemObject::from_pem_slice(read(cert).as_bytes()).unwrap()],
                    rustls::pki_types::pem::PemObject::from_pem_slice(read(key).as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    };
    let envoy = connect_and_ask(tg.grpc_addr, config(Some(("envoy.crt", "envoy.key"))), request()).await;
    assert_eq!(envoy.map(|r| r.overall_code), Ok(Code::Ok as i32));
    let none = connect_and_ask(tg.grpc_addr, config(None), request()).await;
    assert!(none.is_err(), "answered without a client certificate: {none:?}");
    assert_eq!(config_of(&tg)["tls"]["grpc"]["certificate"]["serial"], "03:e9", "1001");
}

/// At most 1,024 handshakes run at once on a listener (docs/operations.md, "TLS"): clients that
/// start one and stall fill the slots, and the next client waits until one frees. Clients that
/// connect and say nothing take no slot, and a connection closed before its first byte (a TCP
/// probe) is not a failed handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_at_once_are_capped_and_tcp_probes_are_not_failures() {
    const MAX_HANDSHAKES: usize = 1024;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("tollgate test CA");
    let files = Files::write(dir.path(), &ca.server("tollgate", 11, days_ahead(30)), &ca);
    let tg = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("tls.yaml", RULES)
            .settings(&format!("tls: {{grpc: {}}}", files.yaml(true, "")))
            .start()
    });
    let envoy = client_config(&ca, Some(&ca.client("envoy", &["envoy.gateway.svc"])), &[b"h2"]);
    let http = tg.http_addr;
    let failures = || tokio::task::block_in_place(|| handshake_failures(http, "grpc"));

    for _ in 0..5 {
        drop(tokio::net::TcpStream::connect(tg.grpc_addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(failures(), 0.0, "TCP probes are not failed handshakes");
    let log = tg.process.log();
    assert!(!log.contains("TLS handshake failed"), "{log}");

    use tokio::io::AsyncWriteExt;
    let mut silent = Vec::new();
    for _ in 0..MAX_HANDSHAKES {
        silent.push(tokio::net::TcpStream::connect(tg.grpc_addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answer = connect_and_ask(tg.grpc_addr, envoy.clone(), request()).await;
    assert!(answer.is_ok(), "silent connections take no slot: {answer:?}");
    // The first byte of a TLS record, and nothing more: a handshake begun and stalled.
    let mut stalled = silent;
    for tcp in &mut stalled {
        tcp.write_all(&[0x16]).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = tokio::time::timeout(
        Duration::from_millis(1_500),
        connect_and_ask(tg.grpc_addr, envoy.clone(), request()),
    )
    .await;
    assert!(waiting.is_err(), "answered while every slot was taken: {waiting:?}");
    drop(stalled);
    let answer = connect_and_ask(tg.grpc_addr, envoy, request()).await;
    assert_eq!(answer.unwrap().overall_code, Code::Ok as i32);
}
