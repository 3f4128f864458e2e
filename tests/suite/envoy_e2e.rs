//! End to end through a real Envoy (1.40): a client talks HTTP to Envoy, Envoy asks tollgate
//! over gRPC (`envoy.filters.http.ratelimit`), and an in-process upstream answers what passes.
//!
//! Envoy is found by `support::envoy_or_skip`: `$TOLLGATE_ENVOY_BIN`, the copy that
//! `scripts/ensure-envoy` installs, or `envoy` on `PATH`. Without one these tests are skipped,
//! except under `CI=true`, where they fail. All traffic stays on 127.0.0.1, on ports picked at
//! run time.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use support::{envoy_or_skip, envoy_validate, Envoy, Tollgate};

/// The bucket under test: 5 tokens, one more every 2.4 s (25 per minute), full from empty in 12 s.
/// A request every few milliseconds empties it long before a token comes back, and 2.4 s is not
/// a whole number of seconds, so a `retry-after` rounded down or to nearest (2) differs from one
/// rounded up (3).
pub(crate) const RULES: &str = r#"
domain: e2e
buckets:
  per_key:
    capacity: 5
    refill: 25/1m
descriptors:
  - key: api_key
    bucket: per_key
"#;
const CAPACITY: u64 = 5;
/// Microseconds to earn one token.
const TOKEN_US: u64 = 2_400_000;
/// Microseconds to fill the bucket from empty.
const FILL_US: u64 = CAPACITY * TOKEN_US;

/// Envoy in front of the upstream. `/limited` sends `("api_key", <x-api-key>)`; `/unmatched`
/// sends `("generic_key", "unmatched")`, which no rule matches. The filter timeout is generous
/// (a debug build on a busy machine): with `failure_mode_deny: false` a late answer would let
/// the request through without tollgate's headers, and the assertions on headers and on Envoy's
/// `ratelimit.error` counter would catch that.
pub(crate) const BOOTSTRAP: &str = r#"
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
static_resources:
  listeners:
    - name: ingress
      address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                route_config:
                  virtual_hosts:
                    - name: test
                      domains: ["*"]
                      routes:
                        - match: { path: /limited }
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - request_headers: { header_name: x-api-key, descriptor_key: api_key }
                        - match: { path: /unmatched }
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - generic_key: { descriptor_value: unmatched }
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: e2e
                      failure_mode_deny: false
                      timeout: 2s
                      enable_x_ratelimit_headers: DRAFT_VERSION_03
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service: { envoy_grpc: { cluster_name: ratelimit } }
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: upstream
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: upstream
        endpoints:
          - lb_endpoints:
              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: @UPSTREAM_PORT@ } } }
    - name: ratelimit
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: { http2_protocol_options: {} }
      load_assignment:
        cluster_name: ratelimit
        endpoints:
          - lb_endpoints:
              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: @RATELIMIT_PORT@ } } }
"#;

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// An upstream on a free loopback port that answers every request 200 with `x-upstream: yes`,
/// so a response that carries it went through Envoy to the upstream.
pub(crate) async fn start_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the upstream");
    let addr = listener.local_addr().expect("upstream address");
    let app = axum::Router::new().fallback(|| async { ([("x-upstream", "yes")], "hello from upstream\n") });
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream server") });
    addr
}

/// An HTTP client for Envoy's listeners: no proxy, 10 s per request.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy() // straight to 127.0.0.1, whatever the environment says
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTP client")
}

/// One response: status, headers, and when it arrived (since the test's reference instant).
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) headers: HeaderMap,
    pub(crate) at: Duration,
}

impl Reply {
    /// The header `name`, if the response has it.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("an ASCII header value"))
    }

    /// The header `name`; panics without it.
    pub(crate) fn required(&self, name: &str) -> &str {
        self.header(name)
            .unwrap_or_else(|| panic!("no `{name}` header in a {} response: {:?}", self.status, self.headers))
    }

    /// The header `name` as a whole number; panics without one.
    pub(crate) fn number(&self, name: &str) -> u64 {
        let text = self.required(name);
        text.parse()
            .unwrap_or_else(|_| panic!("`{name}: {text}` is not a whole number"))
    }

    /// The status line and headers, for assertion messages.
    pub(crate) fn dump(&self) -> String {
        let mut out = format!("HTTP {}\n", self.status);
        for (name, value) in &self.headers {
            out.push_str(&format!("{name}: {}\n", value.to_str().unwrap_or("<binary>")));
        }
        out
    }
}

async fn get(client: &reqwest::Client, url: &str, api_key: Option<&str>, since: Instant) -> Reply {
    let headers: Vec<_> = api_key.map(|key| ("x-api-key", key)).into_iter().collect();
    get_with(client, url, &headers, since).await
}

/// A GET of `url` with `headers`; its reply, timed from `since`.
pub(crate) async fn get_with(client: &reqwest::Client, url: &str, headers: &[(&str, &str)], since: Instant) -> Reply {
    let mut request = client.get(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    Reply {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        at: since.elapsed(),
    }
}

/// Microseconds rounded up to whole seconds.
fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// The range a value "`us` minus the time that passed between two decisions" can take, rounded
/// up to seconds, when at most `elapsed` passed: `[ceil(us - elapsed), ceil(us)]`. Elapsed time
/// only ever shortens a wait, so this is the only slack the assertions allow.
/// A 429 that Envoy answered itself (the upstream never saw it) whose `retry-after` is the wait
/// for one token arriving every `token_us`, minus whatever refilled since the first decision,
/// rounded up. Returns the `retry-after`.
fn assert_denied_waiting_one_token(denied: &Reply, token_us: u64) -> u64 {
    assert_eq!(denied.status, 429, "{}", denied.dump());
    assert_eq!(denied.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(denied.header("x-upstream"), None);
    let retry_after = denied.number("retry-after");
    let expected = ceil_secs_range(token_us, denied.at);
    assert!(
        expected.contains(&retry_after),
        "retry-after {retry_after}, expected {expected:?} (one token every {token_us} us, {:?} elapsed)",
        denied.at
    );
    retry_after
}

fn ceil_secs_range(us: u64, elapsed: Duration) -> std::ops::RangeInclusive<u64> {
    let elapsed_us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
    ceil_secs(us.saturating_sub(elapsed_us))..=ceil_secs(us)
}

/// Parses one-item `RateLimit` / `RateLimit-Policy` values such as `"per_key";r=4;t=3` into the
/// item name and its integer parameters.
fn sf_item(value: &str) -> (String, Vec<(String, u64)>) {
    let mut parts = value.split(';');
    let name = parts.next().unwrap_or_default();
    let name = name
        .strip_prefix('"')
        .and_then(|n| n.strip_suffix('"'))
        .unwrap_or_else(|| panic!("`{value}`: the item is not a quoted string"));
    let params = parts
        .map(|p| {
            let (k, v) = p
                .split_once('=')
                .unwrap_or_else(|| panic!("`{value}`: bad parameter `{p}`"));
            let v = v
                .parse()
                .unwrap_or_else(|_| panic!("`{value}`: `{p}` is not a whole number"));
            (k.to_owned(), v)
        })
        .collect();
    (name.to_owned(), params)
}

fn param(value: &str, key: &str) -> u64 {
    let (_, params) = sf_item(value);
    params
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no `{key}` in `{value}`"))
}

/// The items of a structured-field list, sorted, so two lists compare regardless of order.
fn sorted_items(value: &str) -> Vec<String> {
    let mut items: Vec<String> = value.split(',').map(|i| i.trim().to_owned()).collect();
    items.sort();
    items
}

/// What no rate limit looks like: the upstream answered and no limit headers came with it.
fn assert_unlimited(reply: &Reply, what: &str) {
    assert_eq!(reply.status, 200, "{what}:\n{}", reply.dump());
    assert_eq!(reply.header("x-upstream"), Some("yes"), "{what}:\n{}", reply.dump());
    for name in [
        "retry-after",
        "ratelimit",
        "ratelimit-policy",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-envoy-ratelimited",
    ] {
        assert!(
            reply.header(name).is_none(),
            "{what}: unexpected `{name}`:\n{}",
            reply.dump()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_enforces_tollgate_buckets_and_forwards_its_headers() {
    let Some(envoy_bin) = envoy_or_skip("envoy_enforces_tollgate_buckets_and_forwards_its_headers") else {
        return;
    };
    let upstream = start_upstream().await;
    let tollgate = tokio::task::block_in_place(|| Tollgate::start(&[("e2e.yaml", RULES)]));
    let bootstrap = BOOTSTRAP
        .replace("@UPSTREAM_PORT@", &upstream.port().to_string())
        .replace("@RATELIMIT_PORT@", &tollgate.grpc_addr.port().to_string());
    let envoy = tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &bootstrap));
    let base = format!("http://{}", envoy.listener("ingress"));
    let limited = format!("{base}/limited");
    let client = client();

    // A fresh key: the bucket starts full and every admitted request takes one token. Its first
    // decision happens after `start`, its k-th before the k-th reply arrives, so at the k-th
    // decision at most `reply.at` has passed since the first.
    let start = Instant::now();
    let mut admitted = Vec::new();
    for k in 1..=CAPACITY {
        let reply = get(&client, &limited, Some("alice"), start).await;
        assert_eq!(reply.status, 200, "request {k} of {CAPACITY}:\n{}", reply.dump());
        assert_eq!(reply.header("x-upstream"), Some("yes"));
        admitted.push(reply);
    }
    let denied = get(&client, &limited, Some("alice"), start).await;
    eprintln!("first admitted response:\n{}", admitted[0].dump());
    eprintln!("sixth response:\n{}", denied.dump());
    if admitted[0].header("ratelimit-policy").is_none() {
        let errors = tokio::task::block_in_place(|| envoy.stat("cluster.upstream.ratelimit.error"));
        panic!(
            "no tollgate headers on a limited route: Envoy's checks failed and `failure_mode_deny: \
             false` let the requests through (cluster.upstream.ratelimit.error = {errors}). Does the \
             ratelimit cluster speak HTTP/2?\n{}",
            admitted[0].dump()
        );
    }
    assert!(
        denied.at < Duration::from_micros(TOKEN_US),
        "six requests took {:?}, longer than it takes to earn a token: this machine is too slow \
         for the exact assertions below",
        denied.at
    );

    for (k, reply) in (1..).zip(&admitted) {
        let left = CAPACITY - k;
        // Envoy's own DRAFT_VERSION_03 headers, built from tollgate's DescriptorStatus.
        assert_eq!(
            reply.number("x-ratelimit-remaining"),
            left,
            "request {k}:\n{}",
            reply.dump()
        );
        assert_eq!(reply.required("x-ratelimit-limit"), r#"25, 25;w=60;name="per_key""#);
        // tollgate's draft-10 headers, forwarded by Envoy on a 200.
        assert_eq!(reply.required("ratelimit-policy"), r#""per_key";q=5;w=12"#);
        let state = reply.required("ratelimit");
        assert_eq!(sf_item(state).0, "per_key");
        assert_eq!(param(state, "r"), left, "request {k}: {state}");
        let t = param(state, "t");
        let expected = ceil_secs_range(k * TOKEN_US, reply.at);
        assert!(
            expected.contains(&t),
            "request {k}: {state}, expected t in {expected:?}"
        );
        assert!(
            reply.header("retry-after").is_none(),
            "retry-after on a 200:\n{}",
            reply.dump()
        );
    }

    // The sixth request finds less than one token: 429, never reaching the upstream.
    let retry_after = assert_denied_waiting_one_token(&denied, TOKEN_US);
    assert_eq!(denied.number("x-ratelimit-remaining"), 0);
    assert_eq!(denied.required("ratelimit-policy"), r#""per_key";q=5;w=12"#);
    let state = denied.required("ratelimit");
    assert_eq!(param(state, "r"), 0, "{state}");
    let expected = ceil_secs_range(FILL_US, denied.at);
    assert!(
        expected.contains(&param(state, "t")),
        "{state}, expected t in {expected:?}"
    );

    // Another key has its own bucket.
    let other = get(&client, &limited, Some("bob"), start).await;
    assert_eq!(other.status, 200, "{}", other.dump());
    assert_eq!(other.number("x-ratelimit-remaining"), CAPACITY - 1);
    assert_eq!(param(other.required("ratelimit"), "r"), CAPACITY - 1);

    // Waiting as long as retry-after said (counted from after the decision) is enough.
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let again = get(&client, &limited, Some("alice"), start).await;
    assert_eq!(again.status, 200, "after waiting {retry_after} s:\n{}", again.dump());

    // A descriptor no rule matches is never limited, and carries no limit headers.
    let unmatched = format!("{base}/unmatched");
    for i in 0..3 * CAPACITY {
        let reply = get(&client, &unmatched, Some("alice"), start).await;
        assert_unlimited(&reply, &format!("/unmatched request {i}"));
    }

    // A key whose bytes are not UTF-8 (HTTP allows them; Envoy copies them into the descriptor)
    // is limited like any other, rather than failing the check and so failing open.
    let odd_key = reqwest::header::HeaderValue::from_bytes(b"caf\xe9\xff").expect("obs-text is a valid header value");
    for k in 1..=CAPACITY + 1 {
        let response = client
            .get(&limited)
            .header("x-api-key", odd_key.clone())
            .send()
            .await
            .expect("GET /limited with a non-UTF-8 key");
        let expected = if k <= CAPACITY { 200 } else { 429 };
        assert_eq!(response.status().as_u16(), expected, "request {k} with a non-UTF-8 key");
    }

    // Every check got an answer: none failed open, nothing else was denied.
    let calls = CAPACITY + 1 + 1 + 1 + 3 * CAPACITY + CAPACITY + 1;
    tokio::task::block_in_place(|| {
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.error"), 0);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.failure_mode_allowed"), 0);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.over_limit"), 2);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.ok"), calls - 2);
    });
}

/// The shipped demo (`envoy/envoy.yaml` + `config/rules`) on free loopback ports: the
/// descriptors it builds are the ones the example rules expect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_demo_config_matches_the_example_rules() {
    let Some(envoy_bin) = envoy_or_skip("shipped_demo_config_matches_the_example_rules") else {
        return;
    };
    let upstream = start_upstream().await;
    let tollgate = tokio::task::block_in_place(|| Tollgate::builder().rules_path(repo_path("config/rules")).start());
    let demo = std::fs::read_to_string(repo_path("envoy/envoy.yaml")).expect("read envoy/envoy.yaml");
    let mut bootstrap = demo.clone();
    for (from, to) in [
        // Loopback only, and ports chosen at run time.
        (
            "{ address: 0.0.0.0, port_value: 10000 }".to_owned(),
            "{ address: 127.0.0.1, port_value: 0 }".to_owned(),
        ),
        ("port_value: 9901".to_owned(), "port_value: 0".to_owned()),
        (
            "port_value: 8000".to_owned(),
            format!("port_value: {}", upstream.port()),
        ),
        (
            "port_value: 8081".to_owned(),
            format!("port_value: {}", tollgate.grpc_addr.port()),
        ),
        // A debug build on a busy machine: see BOOTSTRAP.
        ("timeout: 0.1s".to_owned(), "timeout: 2s".to_owned()),
    ] {
        assert_eq!(
            demo.matches(&from).count(),
            1,
            "envoy/envoy.yaml changed: expected `{from}` exactly once"
        );
        bootstrap = bootstrap.replace(&from, &to);
    }
    let envoy = tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &bootstrap));
    let base = format!("http://{}", envoy.listener("ingress"));
    let client = client();

    // Checks must be fast: Envoy's default filter timeout is 20 ms and a slower check fails open.
    // On loopback one takes a few milliseconds; a floor of ~40 ms is a delayed-ACK stall (Nagle
    // left on tollgate's sockets), which showed on this three-descriptor route. The median of a
    // few requests keeps one slow outlier on a busy machine from failing the test.
    let upload = format!("{base}/upload");
    let mut latencies = Vec::new();
    for i in 0..9 {
        let sent = Instant::now();
        let reply = get(&client, &upload, Some(&format!("latency-{i}")), sent).await;
        assert_eq!(reply.status, 200, "{}", reply.dump());
        latencies.push(reply.at);
    }
    latencies.sort();
    let median = latencies[latencies.len() / 2];
    eprintln!("request latency through Envoy and tollgate: median {median:?} of {latencies:?}");
    assert!(
        median < Duration::from_millis(30),
        "median request latency through Envoy and tollgate is {median:?} ({latencies:?}): \
         checks this slow fail open under Envoy's default 20 ms timeout"
    );

    // /upload with a key: per client IP, per key, and per key on uploads (5, one per 12 s).
    let start = Instant::now();
    for k in 1..=5 {
        let reply = get(&client, &upload, Some("alice"), start).await;
        assert_eq!(reply.status, 200, "upload {k}:\n{}", reply.dump());
        assert_eq!(
            sorted_items(reply.required("ratelimit-policy")),
            [
                r#""per_api_key";q=60;w=60"#,
                r#""per_client_ip";q=20;w=2"#,
                r#""uploads_per_key";q=5;w=60"#
            ],
            "upload {k}"
        );
        // Envoy reports the status with the fewest tokens left: the uploads bucket.
        assert_eq!(reply.number("x-ratelimit-remaining"), 5 - k);
    }
    let denied = get(&client, &upload, Some("alice"), start).await;
    assert_eq!(denied.status, 429, "{}", denied.dump());
    let retry_after = denied.number("retry-after");
    let expected = ceil_secs_range(12_000_000, denied.at);
    assert!(
        expected.contains(&retry_after),
        "retry-after {retry_after}, expected {expected:?}"
    );

    // Without a key only the per-IP descriptor is left (Envoy drops a descriptor whose header
    // is missing); other paths get the virtual host's limits; /search its global bucket too.
    let no_key = get(&client, &upload, None, start).await;
    assert_eq!(no_key.status, 200, "{}", no_key.dump());
    assert_eq!(no_key.required("ratelimit-policy"), r#""per_client_ip";q=20;w=2"#);
    let other_key = get(&client, &format!("{base}/anything"), Some("bob"), start).await;
    assert_eq!(
        sorted_items(other_key.required("ratelimit-policy")),
        [r#""per_api_key";q=60;w=60"#, r#""per_client_ip";q=20;w=2"#]
    );
    let search = get(&client, &format!("{base}/search?q=x"), None, start).await;
    assert_eq!(
        sorted_items(search.required("ratelimit-policy")),
        [r#""per_client_ip";q=20;w=2"#, r#""search_global";q=100;w=2"#]
    );

    // /static/ sends only ("path", <path>), which the `/static/*` rule leaves unlimited.
    for i in 0..25 {
        let reply = get(&client, &format!("{base}/static/app.css?v={i}"), Some("alice"), start).await;
        assert_unlimited(&reply, &format!("/static/ request {i}"));
    }
    tokio::task::block_in_place(|| {
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.error"), 0);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.failure_mode_allowed"), 0);
    });
}

#[test]
fn shipped_envoy_config_is_valid() {
    let Some(envoy_bin) = envoy_or_skip("shipped_envoy_config_is_valid") else {
        return;
    };
    let config = repo_path("envoy/envoy.yaml");
    if let Err(e) = envoy_validate(&envoy_bin, &config) {
        panic!("envoy --mode validate rejects {}:\n{e}", config.display());
    }
}

/// Schedules through Envoy: two buckets with the same base (10 tokens, 10 per second, full from
/// empty in 1 s) and the same window effect (2 tokens, one every 10 s: full from empty in 20 s).
/// `peak`'s window, `* * * * *`, is active at every minute, so the real clock tollgate reads is
/// always inside it; `off_peak`'s, `* @OTHER_HOUR@ * * *`, is the hour twelve hours from now
/// (UTC), so it is not active while the test runs. `/limited` with key `base` reaches
/// `off_peak`, any other key `peak` (the exact value is tried first).
const SCHEDULED_RULES: &str = r#"
domain: e2e
buckets:
  peak:
    capacity: 10
    refill: 10/s
    schedule:
      - cron: "* * * * *"
        capacity: 2
        refill: 1/10s
  off_peak:
    capacity: 10
    refill: 10/s
    schedule:
      - cron: "* @OTHER_HOUR@ * * *"
        capacity: 2
        refill: 1/10s
descriptors:
  - key: api_key
    value: base
    bucket: off_peak
  - key: api_key
    bucket: peak
"#;
/// The capacity the active window puts in force.
const SCHEDULED_CAPACITY: u64 = 2;
/// Microseconds to earn one token at the window's rate (1 per 10 s).
const SCHEDULED_TOKEN_US: u64 = 10_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_headers_follow_the_active_schedule_window() {
    let Some(envoy_bin) = envoy_or_skip("envoy_headers_follow_the_active_schedule_window") else {
        return;
    };
    let upstream = start_upstream().await;
    let hour_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_secs()
        / 3600
        % 24;
    let rules = SCHEDULED_RULES.replace("@OTHER_HOUR@", &((hour_now + 12) % 24).to_string());
    let tollgate = tokio::task::block_in_place(|| Tollgate::start(&[("e2e.yaml", rules.as_str())]));
    let bootstrap = BOOTSTRAP
        .replace("@UPSTREAM_PORT@", &upstream.port().to_string())
        .replace("@RATELIMIT_PORT@", &tollgate.grpc_addr.port().to_string());
    let envoy = tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &bootstrap));
    let limited = format!("http://{}/limited", envoy.listener("ingress"));
    let client = client();

    // A fresh key on `peak` starts full at the window's capacity (2, not the base's 10) and
    // every admitted request takes one token; the third finds less than one.
    let start = Instant::now();
    let mut admitted = Vec::new();
    for k in 1..=SCHEDULED_CAPACITY {
        let reply = get(&client, &limited, Some("carol"), start).await;
        assert_eq!(
            reply.status,
            200,
            "request {k} of {SCHEDULED_CAPACITY}:\n{}",
            reply.dump()
        );
        assert_eq!(reply.header("x-upstream"), Some("yes"));
        admitted.push(reply);
    }
    let denied = get(&client, &limited, Some("carol"), start).await;
    eprintln!("first admitted response:\n{}", admitted[0].dump());
    eprintln!("denied response:\n{}", denied.dump());
    if admitted[0].header("ratelimit-policy").is_none() {
        let errors = tokio::task::block_in_place(|| envoy.stat("cluster.upstream.ratelimit.error"));
        panic!(
            "no tollgate headers on a limited route (cluster.upstream.ratelimit.error = {errors}):\n{}",
            admitted[0].dump()
        );
    }
    // Waits here are whole seconds (10 s a token), so a wait shortened by the time elapsed since
    // the first decision still rounds up to the same whole second as long as less than a second
    // has passed: then each expected range below is one exact value.
    assert!(
        denied.at < Duration::from_secs(1),
        "three requests took {:?}: this machine is too slow for the exact assertions below",
        denied.at
    );

    for (k, reply) in (1..).zip(&admitted) {
        let left = SCHEDULED_CAPACITY - k;
        // q is the window's capacity and w its time to fill from empty (2 tokens x 10 s), not the
        // base's `q=10;w=1`.
        assert_eq!(
            reply.required("ratelimit-policy"),
            r#""peak";q=2;w=20"#,
            "request {k}:\n{}",
            reply.dump()
        );
        let state = reply.required("ratelimit");
        assert_eq!(sf_item(state).0, "peak");
        assert_eq!(param(state, "r"), left, "request {k}: {state}");
        // k tokens missing, minus what refilled since the first decision: 10 s, then 20 s.
        let t = param(state, "t");
        let expected = ceil_secs_range(k * SCHEDULED_TOKEN_US, reply.at);
        assert_eq!(expected, k * 10..=k * 10, "request {k}: reply after {:?}", reply.at);
        assert!(
            expected.contains(&t),
            "request {k}: {state}, expected t in {expected:?}"
        );
        // Envoy's DRAFT_VERSION_03 headers, from `current_limit` and `limit_remaining`: the
        // window's rate in the first unit where it is whole (1 per 10 s is 6 per minute).
        assert_eq!(reply.required("x-ratelimit-limit"), r#"6, 6;w=60;name="peak""#);
        assert_eq!(reply.number("x-ratelimit-remaining"), left, "request {k}");
        assert!(
            reply.header("retry-after").is_none(),
            "retry-after on a 200:\n{}",
            reply.dump()
        );
    }

    // The third request: 429 without reaching the upstream. One token is missing and comes at
    // the window's rate, one per 10 s (at the base's 10 per second it would be 1 s): 10 s minus
    // the time since the first decision (under a second), rounded up, is exactly 10.
    let retry_after = assert_denied_waiting_one_token(&denied, SCHEDULED_TOKEN_US);
    assert_eq!(retry_after, 10, "{}", denied.dump());
    assert_eq!(denied.required("ratelimit-policy"), r#""peak";q=2;w=20"#);
    let state = denied.required("ratelimit");
    assert_eq!(sf_item(state).0, "peak");
    assert_eq!(param(state, "r"), 0, "{state}");
    let expected = ceil_secs_range(SCHEDULED_CAPACITY * SCHEDULED_TOKEN_US, denied.at);
    assert!(
        expected.contains(&param(state, "t")),
        "{state}, expected t in {expected:?}"
    );
    assert_eq!(param(state, "t"), 20, "{state}");
    assert_eq!(denied.number("x-ratelimit-remaining"), 0);

    // `off_peak`'s window never opens: the base limit applies and is what the headers show.
    let base = get(&client, &limited, Some("base"), start).await;
    eprintln!("off-peak response:\n{}", base.dump());
    assert_eq!(base.status, 200, "{}", base.dump());
    assert_eq!(base.required("ratelimit-policy"), r#""off_peak";q=10;w=1"#);
    let state = base.required("ratelimit");
    assert_eq!(param(state, "r"), 9, "{state}");
    // One token missing at 10 per second: 100 ms, rounded up.
    assert_eq!(param(state, "t"), 1, "{state}");
    assert_eq!(base.required("x-ratelimit-limit"), r#"10, 10;w=1;name="off_peak""#);
    assert_eq!(base.number("x-ratelimit-remaining"), 9);

    tokio::task::block_in_place(|| {
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.error"), 0);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.failure_mode_allowed"), 0);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.over_limit"), 1);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.ok"), SCHEDULED_CAPACITY + 1);
    });
}
