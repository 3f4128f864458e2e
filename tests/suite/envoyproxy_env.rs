//! tollgate as a drop-in for envoyproxy/ratelimit: started with only their environment (the
//! ones Istio's rate-limit sample and Envoy Gateway's managed deployment set), in their folder
//! layout, behind a real Envoy; and every variable or value tollgate refuses.
//!
//! Envoy is found by `support::envoy_or_skip` (skipped without one, failing under `CI=true`).
//! Each test runs a private `redis-server` on a free loopback port. Ports their manifests fix
//! (8080, 8081, `PROMETHEUS_ADDR=:19001`) are free ports here, and `HOST`/`GRPC_HOST` are
//! 127.0.0.1 instead of Istio's `::`, so that tests run side by side and traffic stays on
//! loopback; tollgate's admin API, which has no counterpart of theirs, gets a free port through
//! `TOLLGATE_ADMIN__ADDR`.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::redis::RedisServer;
use support::{envoy_or_skip, free_port, http_get, ChildGuard, Envoy};

/// Istio's sample rules (their ConfigMap `ratelimit-config`, `config.yaml`): `PATH` `/` once a
/// minute, any other path 100 times a minute.
const ISTIO_RULES: &str = r#"domain: echo-ratelimit
descriptors:
  - key: PATH
    value: "/"
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: PATH
    rate_limit:
      unit: minute
      requests_per_unit: 100
"#;

/// The same, after an edit that limits `/swapped` to once a minute too.
const ISTIO_RULES_SWAPPED: &str = r#"domain: echo-ratelimit
descriptors:
  - key: PATH
    value: "/"
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: PATH
    value: "/swapped"
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: PATH
    rate_limit:
      unit: minute
      requests_per_unit: 100
"#;

/// An Envoy listener whose every route sends the descriptors its `rate_limits` say to the
/// `ratelimit` cluster for `domain`, then forwards to the upstream.
fn bootstrap(domain: &str, actions: &str, upstream: SocketAddr, grpc: SocketAddr) -> String {
    format!(
        r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
static_resources:
  listeners:
    - name: ingress
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
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
{actions}
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: {domain}
                      failure_mode_deny: false
                      timeout: 2s
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service: {{ envoy_grpc: {{ cluster_name: ratelimit }} }}
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
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {up} }} }} }}
    - name: ratelimit
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{ http2_protocol_options: {{}} }}
      load_assignment:
        cluster_name: ratelimit
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {rl} }} }} }}
"#,
        up = upstream.port(),
        rl = grpc.port(),
    )
}

/// A Kubernetes ConfigMap volume mounted at `dir`: `..<version>/config.yaml`,
/// `..data -> ..<version>`, `config.yaml -> ..data/config.yaml`.
struct ConfigMapVolume {
    dir: PathBuf,
    version: u32,
}

impl ConfigMapVolume {
    fn create(dir: &Path, contents: &str) -> ConfigMapVolume {
        std::fs::create_dir_all(dir).unwrap();
        let volume = ConfigMapVolume {
            dir: dir.to_owned(),
            version: 1,
        };
        let folder = volume.folder();
        std::fs::create_dir(dir.join(&folder)).unwrap();
        std::fs::write(dir.join(&folder).join("config.yaml"), contents).unwrap();
        std::os::unix::fs::symlink(&folder, dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/config.yaml", dir.join("config.yaml")).unwrap();
        volume
    }

    fn folder(&self) -> String {
        format!("..2026_12_02_12_00_{:02}.{}", self.version, 1000 + self.version)
    }

    /// The kubelet's update: a new timestamped folder, `..data_tmp` renamed over `..data`, the
    /// old folder deleted.
    fn swap(&mut self, contents: &str) {
        let old = self.folder();
        self.version += 1;
        let folder = self.folder();
        std::fs::create_dir(self.dir.join(&folder)).unwrap();
        std::fs::write(self.dir.join(&folder).join("config.yaml"), contents).unwrap();
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&folder, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        std::fs::remove_dir_all(self.dir.join(old)).unwrap();
    }
}

/// A `tollgate` process started with exactly `env` (nothing inherited but `NO_COLOR`), as
/// `ratelimit` (a symlink of that name to the binary, no arguments) or as `tollgate serve`.
pub(crate) struct Started {
    pub(crate) process: ChildGuard,
    pub(crate) http: SocketAddr,
    pub(crate) grpc: SocketAddr,
    /// The admin API and `/config`.
    pub(crate) admin: SocketAddr,
    _dir: tempfile::TempDir,
}

fn command(as_ratelimit: bool, dir: &Path) -> Command {
    let mut command = if as_ratelimit {
        let link = dir.join("ratelimit");
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_tollgate"), &link).unwrap();
        Command::new(link)
    } else {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        c.arg("serve");
        c
    };
    command.env_clear().env("NO_COLOR", "1").current_dir(dir);
    command
}

/// Starts tollgate with `env` plus free `PORT`, `GRPC_PORT` on 127.0.0.1 and a free admin
/// port, and waits until `/healthcheck` answers 200 `OK`.
pub(crate) fn start(as_ratelimit: bool, env: &[(&str, String)]) -> Started {
    let mut started = spawn(as_ratelimit, env);
    let http = started.http;
    support::wait_until(&mut started.process, || {
        http_get(http, "/healthcheck").filter(|(status, body)| *status == 200 && body == "OK")
    })
    .unwrap_or_else(|why| {
        panic!(
            "tollgate did not become healthy: {why}\n{}",
            started.process.log_tail(60)
        )
    });
    started
}

/// [`start`] without waiting.
fn spawn(as_ratelimit: bool, env: &[(&str, String)]) -> Started {
    let dir = tempfile::Builder::new().prefix("tollgate-dropin.").tempdir().unwrap();
    let (http_port, grpc_port, admin_port) = (free_port(), free_port(), free_port());
    let mut command = command(as_ratelimit, dir.path());
    command
        .env("HOST", "127.0.0.1")
        .env("PORT", http_port.to_string())
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc_port.to_string())
        .env("TOLLGATE_ADMIN__ADDR", format!("127.0.0.1:{admin_port}"))
        // A debug build on a busy machine can miss the 10 ms Redis budget now and then; the
        // decision is then `UNAVAILABLE`, Envoy lets the request through, and a count or a 429
        // these tests expect goes missing. None of them is about that budget.
        .env("TOLLGATE_REDIS__COMMAND_TIMEOUT_MS", "1000");
    for (k, v) in env {
        command.env(k, v);
    }
    let process = ChildGuard::spawn("tollgate", &mut command, &dir.path().join("tollgate.log"));
    Started {
        process,
        http: SocketAddr::from(([127, 0, 0, 1], http_port)),
        grpc: SocketAddr::from(([127, 0, 0, 1], grpc_port)),
        admin: SocketAddr::from(([127, 0, 0, 1], admin_port)),
        _dir: dir,
    }
}

async fn start_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|| async { "upstream\n" });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn status(client: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> u16 {
    let mut request = client.get(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    request
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .status()
        .as_u16()
}

/// `/metrics` at `addr`, parsed. (Not `support::Scrape`, which also holds tollgate's own names
/// to Prometheus's conventions: their counters have no `_total`, and dashboards query them so.)
fn scrape(addr: SocketAddr) -> Vec<prometheus_parse::Sample> {
    let (status, body) = http_get(addr, "/metrics").expect("metrics answer");
    assert_eq!(status, 200, "{body}");
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
        .expect("the text format parses")
        .samples
}

/// The sample of `name` whose labels are exactly `labels`.
fn exact(samples: &[prometheus_parse::Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<f64> = samples
        .iter()
        .filter(|s| {
            s.metric == name
                && s.labels.len() == labels.len()
                && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
        })
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
            ref other => panic!("{name} is not a counter: {other:?}"),
        })
        .collect();
    assert!(found.len() <= 1, "several {name} samples with {labels:?}");
    found.first().copied()
}

/// (a) Istio's sample: their environment and ConfigMap layout, launched as `ratelimit`; Envoy
/// limits as the sample's rules say, `/healthcheck` is 200, a ConfigMap swap is picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_sample_environment_launched_as_ratelimit() {
    let Some(envoy_bin) = envoy_or_skip("istio_sample_environment_launched_as_ratelimit") else {
        return;
    };
    let redis = tokio::task::block_in_place(RedisServer::start);
    let root = tempfile::Builder::new().prefix("tollgate-istio.").tempdir().unwrap();
    let data = root.path().join("data");
    let mut volume = ConfigMapVolume::create(&data.join("ratelimit/config"), ISTIO_RULES);
    let env = [
        ("LOG_LEVEL", "debug".to_owned()),
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port())),
        ("USE_STATSD", "false".to_owned()),
        ("RUNTIME_ROOT", data.to_string_lossy().into_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("RUNTIME_WATCH_ROOT", "false".to_owned()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_owned()),
    ];
    let tollgate = tokio::task::block_in_place(|| start(true, &env));
    let upstream = start_upstream().await;
    let actions = r#"                        - match: { prefix: / }
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - request_headers: { header_name: ":path", descriptor_key: PATH }"#;
    let envoy = tokio::task::block_in_place(|| {
        Envoy::start(
            &envoy_bin,
            &bootstrap("echo-ratelimit", actions, upstream, tollgate.grpc),
        )
    });
    let base = format!("http://{}", envoy.listener("ingress"));
    let c = client();

    // `/`: once a minute. Any other path: 100 a minute.
    assert_eq!(status(&c, &format!("{base}/"), &[]).await, 200);
    assert_eq!(status(&c, &format!("{base}/"), &[]).await, 429);
    for _ in 0..5 {
        assert_eq!(status(&c, &format!("{base}/swapped"), &[]).await, 200);
    }
    assert_eq!(envoy.stat("cluster.ratelimit.ratelimit.error"), 0);

    let log = tollgate.process.log();
    for variable in ["REDIS_URL", "RUNTIME_ROOT, RUNTIME_SUBDIRECTORY", "LOG_LEVEL"] {
        assert!(
            log.lines()
                .any(|l| l.contains("setting from the envoyproxy/ratelimit environment") && l.contains(variable)),
            "no start-up line for {variable}:\n{log}"
        );
    }

    // The kubelet swaps the ConfigMap: `/swapped` becomes once a minute.
    volume.swap(ISTIO_RULES_SWAPPED);
    let admin = tollgate.admin;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_get(admin, "/config").is_some_and(|(_, body)| body.contains("/swapped")) {
        assert!(
            Instant::now() < deadline,
            "the swap was not picked up:\n{}",
            tollgate.process.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status(&c, &format!("{base}/swapped"), &[]).await, 200);
    assert_eq!(status(&c, &format!("{base}/swapped"), &[]).await, 429);
    assert_eq!(status(&c, &format!("{base}/"), &[]).await, 429, "`/` keeps its bucket");
    assert_eq!(http_get(tollgate.http, "/healthcheck"), Some((200, "OK".to_owned())));
    // Every check was answered: no 200 above is Envoy failing open.
    assert_eq!(envoy.stat("cluster.ratelimit.ratelimit.error"), 0);
}

/// Envoy Gateway's rules shape: a value, a key-only default, a two-level tree, a shadow rule.
const EG_RULES: &str = r#"domain: eg
descriptors:
  - key: client
    value: vip
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: client
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: tenant
    descriptors:
      - key: path
        rate_limit: {unit: minute, requests_per_unit: 3}
  - key: trial
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

/// A statsd-exporter mapper of the kind Envoy Gateway mounts at PROMETHEUS_MAPPER_YAML: each
/// per-rule series mapped with (domain, key1) and (domain, key1, key2).
fn mapper_yaml() -> String {
    let mut out = String::from("mappings:\n");
    for stat in ["total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode"] {
        out.push_str(&format!(
            "  - match: \"ratelimit.service.rate_limit.*.*.{stat}\"\n    name: \"ratelimit_service_rate_limit_{stat}\"\n    labels: {{domain: \"$1\", key1: \"$2\"}}\n"
        ));
        out.push_str(&format!(
            "  - match: \"ratelimit\\\\.service\\\\.rate_limit\\\\.([^.]*)\\\\.([^.]*)\\\\.([^.]*)(\\\\..*)?\\\\.{stat}\"\n    match_type: regex\n    name: \"ratelimit_service_rate_limit_{stat}\"\n    labels: {{domain: \"$1\", key1: \"$2\", key2: \"$3\"}}\n"
        ));
    }
    out
}

/// (b) Envoy Gateway's environment without xDS, as `tollgate serve`: their series on
/// `PROMETHEUS_ADDR`'s `/metrics`, with exact counts after a known request mix, and the
/// backend error series once Redis is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_environment_exports_their_metric_names() {
    let Some(envoy_bin) = envoy_or_skip("envoy_gateway_environment_exports_their_metric_names") else {
        return;
    };
    let redis = tokio::task::block_in_place(RedisServer::start);
    let root = tempfile::Builder::new().prefix("tollgate-eg.").tempdir().unwrap();
    let data = root.path().join("data");
    ConfigMapVolume::create(&data.join("ratelimit/config"), EG_RULES);
    let mapper = root.path().join("statsd-exporter.yaml");
    std::fs::write(&mapper, mapper_yaml()).unwrap();
    let prom_port = free_port();
    let env = [
        ("RUNTIME_ROOT", data.to_string_lossy().into_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_owned()),
        ("RUNTIME_WATCH_ROOT", "false".to_owned()),
        ("LOG_LEVEL", "info".to_owned()),
        ("USE_STATSD", "false".to_owned()),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".to_owned()),
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port())),
        ("USE_PROMETHEUS", "true".to_owned()),
        ("PROMETHEUS_ADDR", format!(":{prom_port}")),
        ("PROMETHEUS_MAPPER_YAML", mapper.to_string_lossy().into_owned()),
    ];
    let tollgate = tokio::task::block_in_place(|| start(false, &env));
    let upstream = start_upstream().await;
    let actions = r#"                        - match: { prefix: /a }
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - request_headers: { header_name: x-client, descriptor_key: client }
                        - match: { prefix: /b }
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - request_headers: { header_name: x-tenant, descriptor_key: tenant }
                                  - request_headers: { header_name: ":path", descriptor_key: path }
                        - match: { prefix: /s }
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - generic_key: { descriptor_value: t, descriptor_key: trial }"#;
    let envoy =
        tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &bootstrap("eg", actions, upstream, tollgate.grpc)));
    let base = format!("http://{}", envoy.listener("ingress"));
    let c = client();

    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(status(&c, &format!("{base}/a"), &[("x-client", "vip")]).await);
    }
    for _ in 0..4 {
        codes.push(status(&c, &format!("{base}/a"), &[("x-client", "bob")]).await);
    }
    for _ in 0..4 {
        codes.push(status(&c, &format!("{base}/b"), &[("x-tenant", "t1")]).await);
    }
    for _ in 0..2 {
        codes.push(status(&c, &format!("{base}/s"), &[]).await);
    }
    assert_eq!(
        codes,
        [200, 200, 200, 200, 200, 429, 429, 200, 200, 200, 429, 200, 200],
        "vip 10/min, other clients 2/min, tenant+path 3/min, trial 1/min in shadow mode"
    );

    let metrics = SocketAddr::from(([127, 0, 0, 1], prom_port));
    let samples = tokio::task::block_in_place(|| scrape(metrics));
    let expect = |labels: &[(&str, &str)], series: [(&str, f64); 5]| {
        for (stat, value) in series {
            let name = format!("ratelimit_service_rate_limit_{stat}");
            assert_eq!(exact(&samples, &name, labels).unwrap_or(0.0), value, "{name}{labels:?}");
        }
    };
    // Stat key `eg.client_vip`: 3 hits within 10; the near-limit threshold (8 used) unreached.
    expect(
        &[("domain", "eg"), ("key1", "client_vip")],
        [
            ("total_hits", 3.0),
            ("within_limit", 3.0),
            ("near_limit", 0.0),
            ("over_limit", 0.0),
            ("shadow_mode", 0.0),
        ],
    );
    // `eg.client`: capacity 2, threshold floor(1.6) = 1: the second hit is near, two over.
    expect(
        &[("domain", "eg"), ("key1", "client")],
        [
            ("total_hits", 4.0),
            ("within_limit", 2.0),
            ("near_limit", 1.0),
            ("over_limit", 2.0),
            ("shadow_mode", 0.0),
        ],
    );
    // `eg.tenant.path`: two levels, so key2; capacity 3, threshold 2: the third hit is near.
    expect(
        &[("domain", "eg"), ("key1", "tenant"), ("key2", "path")],
        [
            ("total_hits", 4.0),
            ("within_limit", 3.0),
            ("near_limit", 1.0),
            ("over_limit", 1.0),
            ("shadow_mode", 0.0),
        ],
    );
    // `eg.trial`: shadow mode; the second hit is over (counted as theirs counts) but admitted.
    expect(
        &[("domain", "eg"), ("key1", "trial")],
        [
            ("total_hits", 2.0),
            ("within_limit", 1.0),
            ("near_limit", 1.0),
            ("over_limit", 1.0),
            ("shadow_mode", 1.0),
        ],
    );
    // Runtime values (`bob`, `t1`, `/b`) are never labels.
    let text = http_get(metrics, "/metrics").unwrap().1;
    for value in ["bob", "t1", "\"/b\""] {
        assert!(!text.contains(value), "{value} in a label:\n{text}");
    }
    let error = "ratelimit_service_should_rate_limit_error";
    assert_eq!(exact(&samples, error, &[("err_type", "redis_error")]), Some(0.0));
    // The load at start is their first config load; none failed (the series is there at 0).
    assert_eq!(exact(&samples, "ratelimit_service_config_load_success", &[]), Some(1.0));
    assert_eq!(exact(&samples, "ratelimit_service_config_load_error", &[]), Some(0.0));

    // Redis gone: one request fails (Envoy lets it through), counted; /healthcheck is 500.
    drop(redis);
    assert_eq!(status(&c, &format!("{base}/a"), &[("x-client", "vip")]).await, 200);
    let samples = tokio::task::block_in_place(|| scrape(metrics));
    assert_eq!(exact(&samples, error, &[("err_type", "redis_error")]), Some(1.0));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answer = tokio::task::block_in_place(|| http_get(tollgate.http, "/healthcheck"));
        if answer == Some((500, String::new())) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/healthcheck still {answer:?} with Redis gone"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Tollgate's own settings win over theirs, and the start-up log says which source won.
#[test]
fn tollgates_own_settings_win_and_the_log_says_so() {
    let env = [
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", "127.0.0.1:1".to_owned()),
        ("RUNTIME_ROOT", "/nonexistent".to_owned()),
        ("TOLLGATE_BACKEND", "memory".to_owned()),
        (
            "TOLLGATE_RULES",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/rules").to_owned(),
        ),
        ("DEBUG_PORT", "6070".to_owned()),
    ];
    let started = start(true, &env);
    let log = started.process.log();
    let line = |setting: &str| {
        log.lines()
            .find(|l| l.contains("overridden by tollgate's own") && l.contains(&format!("setting={setting}")))
            .unwrap_or_else(|| panic!("no override line for {setting}:\n{log}"))
            .to_owned()
    };
    assert!(line("backend").contains("TOLLGATE_"), "{log}");
    assert!(line("rules").contains("RUNTIME_ROOT"), "{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("DEBUG_PORT") && l.contains("changes nothing") && l.contains("no debug listener")),
        "{log}"
    );
    let config = http_get(started.admin, "/config").unwrap().1;
    assert!(config.contains("\"backend\":\"memory\""), "{config}");
}

/// `REDIS_AUTH` logs in to a password-protected Redis (a wrong one keeps tollgate not ready),
/// and the password shows neither in the log nor in `/config`.
#[test]
fn redis_auth_logs_in_and_is_never_shown() {
    let password = "S3cret-Redis-pw";
    let redis = RedisServer::builder().requirepass(password).start();
    let rules = tempfile::tempdir().unwrap();
    ConfigMapVolume::create(&rules.path().join("ratelimit/config"), ISTIO_RULES);
    let env = |auth: &str| {
        vec![
            ("LOG_LEVEL", "debug".to_owned()),
            ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
            ("REDIS_URL", format!("127.0.0.1:{}", redis.port())),
            ("REDIS_AUTH", auth.to_owned()),
            ("RUNTIME_ROOT", rules.path().to_string_lossy().into_owned()),
            ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ]
    };
    let good = start(true, &env(password));
    let config = http_get(good.admin, "/config").unwrap().1;
    assert!(config.contains("<redacted>"), "{config}");
    assert!(!config.contains(password), "{config}");
    assert!(!good.process.log().contains(password), "{}", good.process.log());

    let wrong = "Wrong-pw-never-shown";
    let mut bad = spawn(true, &env(wrong));
    let http = bad.http;
    let answer = support::wait_until(&mut bad.process, || http_get(http, "/healthcheck"))
        .unwrap_or_else(|why| panic!("no answer: {why}\n{}", bad.process.log_tail(40)));
    assert_eq!(answer, (500, String::new()), "a wrong password must not be ready");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(http_get(http, "/healthcheck"), Some((500, String::new())));
    assert!(!bad.process.log().contains(wrong), "{}", bad.process.log());
}

/// (c) Every refused variable or value: exit 1, a message naming the variable, why and what to
/// do instead; the Redis password never appears.
#[test]
fn refused_variables_name_the_variable_why_and_what_instead() {
    let dir = tempfile::tempdir().unwrap();
    let custom_mapper = dir.path().join("mapper.yaml");
    std::fs::write(
        &custom_mapper,
        "mappings:\n  - match: \"ratelimit.service.rate_limit.*.*.total_hits\"\n    name: \"my_hits\"\n    labels: {d: \"$1\"}\n",
    )
    .unwrap();
    let secret = "Pa55-w0rd-never-shown";
    let cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("USE_DOG_STATSD", vec![("USE_DOG_STATSD", "true".into())]),
        (
            "STATSD_PROTOCOL",
            vec![("USE_STATSD", "true".into()), ("STATSD_PROTOCOL", "quic".into())],
        ),
        ("BACKEND_TYPE", vec![("BACKEND_TYPE", "memcache".into())]),
        (
            "REDIS_TYPE",
            vec![
                ("REDIS_SOCKET_TYPE", "tcp".into()),
                ("REDIS_URL", "127.0.0.1:1".into()),
                ("REDIS_TYPE", "SHARDED".into()),
            ],
        ),
        (
            "REDIS_SOCKET_TYPE",
            vec![
                ("REDIS_SOCKET_TYPE", "unix".into()),
                ("REDIS_URL", "127.0.0.1:6379".into()),
            ],
        ),
        (
            "REDIS_URL",
            vec![
                ("REDIS_TYPE", "SENTINEL".into()),
                ("REDIS_URL", "127.0.0.1:26379".into()),
            ],
        ),
        (
            "REDIS_URL",
            vec![("REDIS_SOCKET_TYPE", "tcp".into()), ("REDIS_URL", "a:1,b:2".into())],
        ),
        ("CONFIG_TYPE", vec![("CONFIG_TYPE", "GRPC_XDS_DELTA".into())]),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            vec![
                ("CONFIG_TYPE", "GRPC_XDS_SOTW".into()),
                ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "Bearer x".into()),
            ],
        ),
        (
            "CONFIG_GRPC_XDS_SERVER_URL",
            vec![
                ("CONFIG_TYPE", "GRPC_XDS_SOTW".into()),
                ("CONFIG_GRPC_XDS_SERVER_URL", "dns:///envoy-gateway".into()),
            ],
        ),
        (
            "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
            vec![
                ("CONFIG_TYPE", "GRPC_XDS_SOTW".into()),
                ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "soon".into()),
            ],
        ),
        ("GRPC_SERVER_USE_TLS", vec![("GRPC_SERVER_USE_TLS", "true".into())]),
        (
            "GRPC_UDS",
            vec![
                ("GRPC_UDS", "/tmp/ratelimit.sock".into()),
                ("GRPC_SERVER_USE_TLS", "true".into()),
                ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt".into()),
                ("GRPC_SERVER_TLS_KEY", "/certs/tls.key".into()),
            ],
        ),
        ("REDIS_PERSECOND", vec![("REDIS_PERSECOND", "true".into())]),
        ("QUOTA_MODE", vec![("QUOTA_MODE", "maybe".into())]),
        ("MERGE_DOMAIN_CONFIG", vec![("MERGE_DOMAIN_CONFIG", "perhaps".into())]),
        (
            "LIMIT_LIMIT_HEADER",
            vec![
                ("LIMIT_RESPONSE_HEADERS_ENABLED", "true".into()),
                ("LIMIT_LIMIT_HEADER", "Rate Limit".into()),
            ],
        ),
        (
            "PROMETHEUS_MAPPER_YAML",
            vec![
                ("USE_PROMETHEUS", "true".into()),
                ("PROMETHEUS_ADDR", format!("127.0.0.1:{}", free_port())),
                ("PROMETHEUS_MAPPER_YAML", custom_mapper.to_string_lossy().into_owned()),
            ],
        ),
        (
            "LOG_LEVEL",
            vec![("USE_STATSD", "false".into()), ("LOG_LEVEL", "verbose".into())],
        ),
        (
            "LOG_FORMAT",
            vec![("USE_STATSD", "false".into()), ("LOG_FORMAT", "xml".into())],
        ),
        ("SHADOW_MODE", vec![("SHADOW_MODE", "maybe".into())]),
        (
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            vec![
                ("REDIS_SOCKET_TYPE", "tcp".into()),
                ("REDIS_URL", "127.0.0.1:1".into()),
                ("REDIS_TLS", "true".into()),
                ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true".into()),
            ],
        ),
        (
            "REDIS_TLS_CLIENT_CERT",
            vec![
                ("REDIS_SOCKET_TYPE", "tcp".into()),
                ("REDIS_URL", "127.0.0.1:1".into()),
                ("REDIS_TLS", "true".into()),
                ("REDIS_TLS_CLIENT_CERT", "/redis-certs/tls.crt".into()),
            ],
        ),
    ];
    for (variable, env) in cases {
        for as_ratelimit in [true, false] {
            let run = tempfile::tempdir().unwrap();
            let mut command = command(as_ratelimit, run.path());
            command.env("REDIS_AUTH", secret).env("PORT", free_port().to_string());
            for (k, v) in &env {
                command.env(k, v);
            }
            let output = command.output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            assert_eq!(output.status.code(), Some(1), "{variable} ({env:?}): {text}");
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{variable}:")))
                .unwrap_or_else(|| panic!("no message for {variable}: {text}"));
            assert!(
                [" use ", " set ", "unset", "point "].iter().any(|w| line.contains(w)),
                "{variable}: no alternative given: {line}"
            );
            assert!(!text.contains(secret), "the password leaked: {text}");
        }
    }
}

/// `QUOTA_MODE=true` and `RESPONSE_DYNAMIC_METADATA=true` are used, not refused: every rule is
/// in quota mode (one plan over while the other passes: OK, its status OVER_LIMIT; both over:
/// denied), and the response carries their dynamic metadata, with the `metadata` of the rules
/// that passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_mode_and_response_metadata_from_their_variables() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::google::protobuf::value::Kind;
    let rules = tempfile::tempdir().unwrap();
    ConfigMapVolume::create(
        &rules.path().join("ratelimit/config"),
        "domain: eg\ndescriptors:\n  - key: plan\n    value: a\n    rate_limit: {unit: hour, requests_per_unit: 1}\n    metadata: {served_by: a}\n  - key: plan\n    value: b\n    rate_limit: {unit: hour, requests_per_unit: 1}\n    metadata: {served_by: b}\n",
    );
    let env = [
        ("USE_STATSD", "false".to_owned()),
        ("RUNTIME_ROOT", rules.path().to_string_lossy().into_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("QUOTA_MODE", "true".to_owned()),
        ("RESPONSE_DYNAMIC_METADATA", "true".to_owned()),
    ];
    let tollgate = tokio::task::block_in_place(|| start(true, &env));
    let mut grpc = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc))
        .await
        .unwrap();
    let only_a = support::request("eg", &[("plan", "a")], 0);
    let mut both = only_a.clone();
    both.descriptors.push(support::descriptor(&[("plan", "b")]));
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let served_by = |resp: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse| {
        let meta = resp.dynamic_metadata.as_ref().expect("dynamic metadata");
        assert_eq!(
            meta.fields["domain"].kind,
            Some(Kind::StringValue("eg".into())),
            "{meta:?}"
        );
        match meta.fields.get("metadata").and_then(|m| m.kind.as_ref()) {
            Some(Kind::StructValue(m)) => match &m.fields["served_by"].kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                other => panic!("served_by: {other:?}"),
            },
            _ => None,
        }
    };
    // `plan=a` spent alone, then the pair passes on `plan=b`.
    let first = grpc.should_rate_limit(only_a).await.unwrap().into_inner();
    assert_eq!(first.overall_code, ok);
    assert_eq!(served_by(&first).as_deref(), Some("a"));
    let second = grpc.should_rate_limit(both.clone()).await.unwrap().into_inner();
    let codes: Vec<i32> = second.statuses.iter().map(|s| s.code).collect();
    assert_eq!((second.overall_code, codes), (ok, vec![over, ok]));
    assert_eq!(served_by(&second).as_deref(), Some("b"));
    // Both spent: denied, and no rule passed.
    let third = grpc.should_rate_limit(both).await.unwrap().into_inner();
    assert_eq!(third.overall_code, over);
    assert_eq!(served_by(&third), None);
}

/// `detailed_metric: true`: their series carry the request's entries (`key1="user_u7"`), at most
/// `DETAILED_SERIES_MAX` (1000) stat keys per process; later values count under the rule's own
/// series, and a value already seen keeps its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detailed_metric_labels_are_bounded() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let rules = tempfile::tempdir().unwrap();
    ConfigMapVolume::create(
        &rules.path().join("ratelimit/config"),
        "domain: eg\ndescriptors:\n  - key: user\n    detailed_metric: true\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n",
    );
    let env = [
        ("USE_STATSD", "false".to_owned()),
        ("RUNTIME_ROOT", rules.path().to_string_lossy().into_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
    ];
    let tollgate = tokio::task::block_in_place(|| start(true, &env));
    let mut grpc = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc))
        .await
        .unwrap();
    for i in 0..1005 {
        let value = format!("u{i}");
        grpc.should_rate_limit(support::request("eg", &[("user", &value)], 0))
            .await
            .unwrap();
    }
    grpc.should_rate_limit(support::request("eg", &[("user", "u0")], 3))
        .await
        .unwrap();
    let samples = tokio::task::block_in_place(|| scrape(tollgate.http));
    let hits = "ratelimit_service_rate_limit_total_hits";
    let detailed = samples
        .iter()
        .filter(|s| s.metric == hits && s.labels.get("key1").is_some_and(|k| k.starts_with("user_u")))
        .count();
    assert_eq!(detailed, 1000, "detailed series beyond the bound");
    assert_eq!(
        exact(&samples, hits, &[("domain", "eg"), ("key1", "user_u0")]),
        Some(4.0)
    );
    assert_eq!(
        exact(&samples, hits, &[("domain", "eg"), ("key1", "user_u999")]),
        Some(1.0)
    );
    assert_eq!(exact(&samples, hits, &[("domain", "eg"), ("key1", "user_u1000")]), None);
    assert_eq!(
        exact(&samples, hits, &[("domain", "eg"), ("key1", "user")]),
        Some(5.0),
        "the five values past the bound count under the rule's own series"
    );
}

/// Their service listens with Go's `net.Listen` on `0.0.0.0` when `HOST` is unset, which
/// answers IPv4 and IPv6; so does tollgate under their environment: `[::1]` and 127.0.0.1
/// both reach `/healthcheck`. Binds every interface on a free port; traffic stays on loopback.
#[test]
fn an_unset_host_answers_ipv4_and_ipv6() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped an_unset_host_answers_ipv4_and_ipv6: this machine has no IPv6 loopback");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("data/config")).unwrap();
    std::fs::write(dir.path().join("data/config/config.yaml"), ISTIO_RULES).unwrap();
    let (http_port, grpc_port, admin_port) = (free_port(), free_port(), free_port());
    let mut command = command(false, dir.path());
    command
        .env("RUNTIME_ROOT", dir.path().join("data"))
        .env("PORT", http_port.to_string())
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc_port.to_string())
        .env("TOLLGATE_ADMIN__ADDR", format!("127.0.0.1:{admin_port}"));
    let mut process = ChildGuard::spawn("tollgate", &mut command, &dir.path().join("tollgate.log"));
    let v4 = SocketAddr::from(([127, 0, 0, 1], http_port));
    let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, http_port));
    let answer = support::wait_until(&mut process, || http_get(v6, "/healthcheck"))
        .unwrap_or_else(|why| panic!("no answer on [::1]: {why}\n{}", process.log_tail(40)));
    assert_eq!(answer, (200, "OK".to_owned()));
    assert_eq!(http_get(v4, "/healthcheck"), Some((200, "OK".to_owned())));
}

/// Their service loads every file under the rules folder; tollgate only the `*.yaml`/`*.yml`
/// directly in it. Under their environment each non-hidden file it skips is a warning at start.
#[test]
fn files_their_service_would_load_are_named_at_start() {
    let data = tempfile::tempdir().unwrap();
    let config = data.path().join("config");
    std::fs::create_dir_all(config.join("team")).unwrap();
    std::fs::create_dir_all(config.join("..data")).unwrap();
    std::fs::write(config.join("config.yaml"), ISTIO_RULES).unwrap();
    std::fs::write(config.join("limits.conf"), "domain: other\n").unwrap();
    std::fs::write(config.join("team/extra.yaml"), "domain: team\n").unwrap();
    std::fs::write(config.join(".hidden"), "x").unwrap();
    std::fs::write(config.join("..data/config.yaml"), ISTIO_RULES).unwrap();
    let env = [("RUNTIME_ROOT", data.path().to_string_lossy().into_owned())];
    let started = start(false, &env);
    let log = started.process.log();
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("not loaded as rules")).collect();
    assert_eq!(warned.len(), 2, "{log}");
    assert!(warned[0].contains("config/limits.conf"), "{log}");
    assert!(warned[1].contains("config/team/extra.yaml"), "{log}");
    assert!(!log.contains(".hidden") && !log.contains("..data"), "{log}");
}
