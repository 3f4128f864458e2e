//! The shadow headers (`shadow_headers`) through a real Envoy (1.40): a request a shadow rule
//! would have denied reaches the upstream with `x-ratelimit-shadow: would-deny` and the
//! bucket's name, one admitted within its limit without them (skipped without Envoy, failing
//! under `CI=true`).

use std::net::SocketAddr;
use std::time::Instant;

use axum::http::HeaderMap;

use crate::envoy_e2e::{client, get_with, BOOTSTRAP};
use crate::support::{envoy_or_skip, Envoy, Tollgate};

/// Two requests a minute per `api_key`, in shadow mode.
const RULES: &str = r#"
domain: e2e
buckets:
  trial: {capacity: 2, refill: 2/1m}
descriptors:
  - key: api_key
    bucket: trial
    shadow_mode: true
"#;

/// An upstream that answers 200 with what it received of the shadow headers, as
/// `x-seen-shadow` and `x-seen-shadow-buckets` (`none` when absent).
async fn start_echo_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the upstream");
    let addr = listener.local_addr().expect("upstream address");
    let app = axum::Router::new().fallback(|headers: HeaderMap| async move {
        let seen = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_owned()
        };
        (
            [
                ("x-upstream", "yes".to_owned()),
                ("x-seen-shadow", seen("x-ratelimit-shadow")),
                ("x-seen-shadow-buckets", seen("x-ratelimit-shadow-buckets")),
            ],
            "hello from upstream\n",
        )
    });
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream server") });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_hears_of_a_shadow_denial_and_of_nothing_else() {
    let Some(envoy_bin) = envoy_or_skip("the_upstream_hears_of_a_shadow_denial_and_of_nothing_else") else {
        return;
    };
    let upstream = start_echo_upstream().await;
    let tollgate = tokio::task::block_in_place(|| {
        Tollgate::builder()
            .rules_file("e2e.yaml", RULES)
            .settings("shadow_headers: {enabled: true}")
            .start()
    });
    let bootstrap = BOOTSTRAP
        .replace("@UPSTREAM_PORT@", &upstream.port().to_string())
        .replace("@RATELIMIT_PORT@", &tollgate.grpc_addr.port().to_string());
    let envoy = tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &bootstrap));
    let limited = format!("http://{}/limited", envoy.listener("ingress"));
    let client = client();
    let start = Instant::now();
    for k in 1..=2 {
        let reply = get_with(&client, &limited, &[("x-api-key", "erin")], start).await;
        assert_eq!(reply.status, 200, "request {k}:\n{}", reply.dump());
        assert!(
            reply.header("ratelimit-policy").is_some(),
            "tollgate answered:\n{}",
            reply.dump()
        );
        assert_eq!(
            reply.header("x-seen-shadow"),
            Some("none"),
            "request {k}:\n{}",
            reply.dump()
        );
        assert_eq!(reply.header("x-seen-shadow-buckets"), Some("none"));
    }
    for k in 3..=4 {
        let reply = get_with(&client, &limited, &[("x-api-key", "erin")], start).await;
        assert_eq!(
            reply.status,
            200,
            "shadow mode lets request {k} through:\n{}",
            reply.dump()
        );
        assert_eq!(reply.header("x-upstream"), Some("yes"));
        assert_eq!(reply.header("x-seen-shadow"), Some("would-deny"), "{}", reply.dump());
        assert_eq!(reply.header("x-seen-shadow-buckets"), Some("trial"));
        assert_eq!(reply.header("retry-after"), None, "the client is told nothing");
    }
    // Another key's bucket is full: nothing told.
    let other = get_with(&client, &limited, &[("x-api-key", "frank")], start).await;
    assert_eq!(other.header("x-seen-shadow"), Some("none"), "{}", other.dump());
    let errors = tokio::task::block_in_place(|| envoy.stat("cluster.upstream.ratelimit.error"));
    assert_eq!(errors, 0);
}
