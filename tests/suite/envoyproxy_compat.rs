//! envoyproxy/ratelimit's own expectations, replayed against the drop-in mode: their
//! integration tests (a service started from their settings with their rules folder, asked over
//! gRPC), their example rules with the requests their example scripts make through Envoy (each
//! written here as the descriptors Envoy sends for it), and the service behaviours their unit
//! tests pin down (response headers, global shadow mode, merged domains, unlimited).
//!
//! Every test starts a real `ratelimit` process (the binary under their name) with only their
//! environment variables and their folder layout, once on the memory backend and once on the
//! shared Redis (`support::redis::shared_redis`: skipped without one, failing under `CI=true`).
//! Where tollgate differs by a documented choice, the assertion is tollgate's and names its row
//! of the table "Remaining differences" in docs/migration.md (`row: ...`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::transport::Channel;

use crate::envoyproxy_env::{start, Started};
use crate::support;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// Where the buckets live: tollgate's default memory store (their environment without Redis
/// variables), or Redis as their manifests point at it.
#[derive(Clone, Debug)]
enum Backend {
    Memory,
    Redis {
        addr: String,
        prefix: String,
        auth: Option<String>,
    },
}

/// Memory, and Redis when the shared server answers (`test` names the skip or the failure).
fn backends(test: &str) -> Vec<Backend> {
    let mut out = vec![Backend::Memory];
    if let Some(url) = support::redis::shared_redis(test) {
        let target = support::redis::RedisTarget::parse(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        let auth = match (&target.username, &target.password) {
            (Some(user), Some(pass)) => Some(format!("{user}:{pass}")),
            (None, Some(pass)) => Some(pass.clone()),
            _ => None,
        };
        out.push(Backend::Redis {
            addr: target.addr.to_string(),
            prefix: support::redis::unique_prefix(test),
            auth,
        });
    }
    out
}

impl Backend {
    /// Their variables for this backend.
    fn env(&self) -> Vec<(&'static str, String)> {
        match self {
            Backend::Memory => Vec::new(),
            Backend::Redis { addr, prefix, auth } => {
                let mut env = vec![
                    ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
                    ("REDIS_URL", addr.clone()),
                    ("CACHE_KEY_PREFIX", prefix.clone()),
                ];
                env.extend(auth.clone().map(|a| ("REDIS_AUTH", a)));
                env
            }
        }
    }
}

/// Their runtime layout: `RUNTIME_ROOT/ratelimit/config/<file>.yaml`.
struct Runtime {
    root: tempfile::TempDir,
}

impl Runtime {
    fn new(files: &[(&str, &str)]) -> Runtime {
        let root = tempfile::Builder::new().prefix("tollgate-compat.").tempdir().unwrap();
        let runtime = Runtime { root };
        std::fs::create_dir_all(runtime.config()).unwrap();
        for (name, text) in files {
            runtime.write(name, text);
        }
        runtime
    }

    fn config(&self) -> PathBuf {
        self.root.path().join("ratelimit/config")
    }

    fn write(&self, name: &str, text: &str) {
        // Written aside and renamed, so a reload never reads half a file.
        let tmp = self.root.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.config().join(name)).unwrap();
    }

    /// Their variables for this layout, as their integration tests' settings give them.
    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("USE_STATSD", "false".to_owned()),
            ("RUNTIME_ROOT", self.root.path().to_string_lossy().into_owned()),
            ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
            ("RUNTIME_APPDIRECTORY", "config".to_owned()),
        ]
    }
}

/// A started `ratelimit` and a gRPC client to it.
struct Service {
    started: Started,
    grpc: RateLimitServiceClient<Channel>,
}

/// Starts `ratelimit` on `runtime` and `backend`, with `extra` variables of theirs.
async fn serve(runtime: &Runtime, backend: &Backend, extra: &[(&'static str, &str)]) -> Service {
    let mut env = runtime.env();
    env.extend(backend.env());
    env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    let started = tokio::task::block_in_place(|| start(true, &env));
    let grpc = RateLimitServiceClient::connect(format!("http://{}", started.grpc))
        .await
        .unwrap();
    Service { started, grpc }
}

impl Service {
    /// Asks for one hit (Envoy's request-level `hits_addend` 0) on `descriptors` in `domain`.
    async fn ask(&mut self, domain: &str, descriptors: &[&[(&str, &str)]]) -> RateLimitResponse {
        let req = RateLimitRequest {
            domain: domain.into(),
            descriptors: descriptors.iter().map(|d| support::descriptor(d)).collect(),
            hits_addend: 0,
        };
        self.send(req).await
    }

    async fn send(&mut self, req: RateLimitRequest) -> RateLimitResponse {
        let resp = self
            .grpc
            .should_rate_limit(req.clone())
            .await
            .unwrap_or_else(|e| panic!("{req:?}: {e}\n{}", self.started.process.log_tail(30)))
            .into_inner();
        // Envoy keeps only the whole seconds of `duration_until_reset`: every reset is whole
        // seconds, as theirs always are.
        for s in &resp.statuses {
            if let Some(d) = s.duration_until_reset {
                assert_eq!(d.nanos, 0, "{resp:?}");
            }
        }
        resp
    }
}

/// A status as their tests compare it: code, `current_limit` (requests per unit, unit),
/// `limit_remaining`.
type Shape = (i32, Option<(u32, Unit)>, u32);

fn shapes(resp: &RateLimitResponse) -> Vec<Shape> {
    resp.statuses.iter().map(shape).collect()
}

fn shape(s: &DescriptorStatus) -> Shape {
    let limit = s
        .current_limit
        .as_ref()
        .map(|l| (l.requests_per_unit, Unit::try_from(l.unit).unwrap()));
    (s.code, limit, s.limit_remaining)
}

fn reset_seconds(s: &DescriptorStatus) -> i64 {
    s.duration_until_reset
        .expect("a limited status announces its reset")
        .seconds
}

/// The value of response header `name` (compared as Envoy compares names, ignoring case).
fn header<'a>(resp: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    resp.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

/// A value no earlier run can have used (their tests draw a random number).
fn fresh(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{tag}-{}-{nanos}", std::process::id())
}

// ---- their integration tests' rules -----------------------------------------------------

const BASIC: &str = "domain: basic
descriptors:
  - {key: key1, rate_limit: {unit: second, requests_per_unit: 50}}
  - {key: one_per_minute, rate_limit: {unit: minute, requests_per_unit: 1}}
";

const ANOTHER: &str = "domain: another
descriptors:
  - {key: key2, rate_limit: {unit: minute, requests_per_unit: 20}}
  - {key: key3, rate_limit: {unit: hour, requests_per_unit: 10}}
  - {key: key4, rate_limit: {unit: day, requests_per_unit: 20}}
";

const SHARE_THRESHOLD: &str = "domain: share-threshold-test
descriptors:
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: files_no_share
    value: files_no_share/*
    rate_limit: {unit: hour, requests_per_unit: 10}
";

const RELOAD: &str = "domain: reload
descriptors:
  - {key: key1, rate_limit: {unit: second, requests_per_unit: 50}}
  - {key: block, rate_limit: {unit: second, requests_per_unit: 0}}
";

/// Their basic integration test: an unknown domain, a per-second limit, a per-minute limit run
/// over, two limits in one request, and the reset announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_integration_test_basic_config() {
    for backend in backends("their_integration_test_basic_config") {
        let runtime = Runtime::new(&[("basic.yaml", BASIC), ("another.yaml", ANOTHER)]);
        let mut svc = serve(&runtime, &backend, &[]).await;

        // A domain no file declares: OK, no limit.
        let resp = svc.ask("foo", &[&[("hello", "world")]]).await;
        assert_eq!(
            (resp.overall_code, shapes(&resp)),
            (OK, vec![(OK, None, 0)]),
            "{backend:?}"
        );

        let resp = svc.ask("basic", &[&[("key1", "foo")]]).await;
        assert_eq!(
            (resp.overall_code, shapes(&resp)),
            (OK, vec![(OK, Some((50, Unit::Second)), 49)]),
            "{backend:?}"
        );
        // One token of 50 per second comes back in 20 ms: a whole second, rounded up.
        assert_eq!(reset_seconds(&resp.statuses[0]), 1);

        // 20 per minute run over with a fresh value. A token comes back every 3 s, so the
        // expected count allows for the time the loop took.
        let value = fresh("key2");
        let began = Instant::now();
        for i in 0..25u32 {
            let resp = svc.ask("another", &[&[("key2", &value)]]).await;
            let refilled = (began.elapsed().as_secs() / 3) as u32;
            if i < 20 {
                let (code, limit, left) = shapes(&resp)[0];
                assert_eq!(
                    (resp.overall_code, code, limit),
                    (OK, OK, Some((20, Unit::Minute))),
                    "{backend:?} hit {i}"
                );
                assert!(
                    (19 - i..=19 - i + refilled).contains(&left),
                    "{backend:?} hit {i}: {left}"
                );
            } else if refilled == 0 {
                assert_eq!(
                    (resp.overall_code, shapes(&resp)),
                    (OVER, vec![(OVER, Some((20, Unit::Minute)), 0)]),
                    "{backend:?} hit {i}"
                );
            }
        }

        // Two limits in one request: the hourly one (10) runs out first. Theirs goes on
        // counting the minute limit on denied requests; tollgate charges neither bucket of a
        // denied request, so the minute limit stays at 10 (row: denied-hits).
        let value = fresh("pair");
        let began = Instant::now();
        for i in 0..15u32 {
            let resp = svc.ask("another", &[&[("key2", &value)], &[("key3", &value)]]).await;
            let refilled = (began.elapsed().as_secs() / 3) as u32;
            let statuses = shapes(&resp);
            if i < 10 {
                assert_eq!(resp.overall_code, OK, "{backend:?} hit {i}");
                assert_eq!(statuses[1], (OK, Some((10, Unit::Hour)), 9 - i), "{backend:?} hit {i}");
                assert!(
                    (19 - i..=19 - i + refilled).contains(&statuses[0].2),
                    "{backend:?} hit {i}: {statuses:?}"
                );
            } else {
                assert_eq!(resp.overall_code, OVER, "{backend:?} hit {i}");
                assert_eq!(statuses[1], (OVER, Some((10, Unit::Hour)), 0), "{backend:?} hit {i}");
                assert_eq!(statuses[0].0, OK);
                assert!(
                    (10..=10 + refilled).contains(&statuses[0].2),
                    "{backend:?} hit {i}: the denied requests took nothing: {statuses:?}"
                );
            }
        }

        // The reset, asked twice 2 s apart. Theirs counts down to the day's end; tollgate's is
        // the time until the bucket is full again: one token of 20 a day is 4320 s, two less the
        // 2 s waited are 8638 s (row: reset).
        let value = fresh("key4");
        let first = svc.ask("another", &[&[("key4", &value)]]).await;
        assert_eq!(reset_seconds(&first.statuses[0]), 4320, "{backend:?}");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let second = svc.ask("another", &[&[("key4", &value)]]).await;
        let reset = reset_seconds(&second.statuses[0]);
        assert!((8636..=8638).contains(&reset), "{backend:?}: {reset}");
    }
}

/// Their reload test: a domain that appears when its file is added to the folder (a limit of
/// 0 blocks), and is gone again when the file is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_integration_test_config_reload() {
    for backend in backends("their_integration_test_config_reload") {
        let runtime = Runtime::new(&[("basic.yaml", BASIC)]);
        let mut svc = serve(&runtime, &backend, &[]).await;
        let resp = svc.ask("reload", &[&[("block", "foo")]]).await;
        assert_eq!((resp.overall_code, shapes(&resp)), (OK, vec![(OK, None, 0)]));

        runtime.write("reload.yaml", RELOAD);
        let deadline = Instant::now() + Duration::from_secs(30);
        let resp = loop {
            let resp = svc.ask("reload", &[&[("key1", "foo")]]).await;
            if resp.statuses[0].current_limit.is_some() {
                break resp;
            }
            assert!(Instant::now() < deadline, "the new file was not loaded");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            (resp.overall_code, shapes(&resp)),
            (OK, vec![(OK, Some((50, Unit::Second)), 49)]),
            "{backend:?}"
        );
        let resp = svc.ask("reload", &[&[("block", "foo")]]).await;
        assert_eq!(resp.overall_code, OVER, "{backend:?}: requests_per_unit 0 blocks");

        std::fs::remove_file(runtime.config().join("reload.yaml")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while svc.ask("reload", &[&[("block", "foo")]]).await.overall_code != OK {
            assert!(Instant::now() < deadline, "the removed file stayed loaded");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Their share-threshold test: every value matching `files/*` shares one limit; values of a
/// pattern without it have one each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_integration_test_share_threshold() {
    for backend in backends("their_integration_test_share_threshold") {
        let runtime = Runtime::new(&[("share_threshold.yaml", SHARE_THRESHOLD)]);
        let mut svc = serve(&runtime, &backend, &[]).await;
        let domain = "share-threshold-test";
        for i in 0..10u32 {
            let resp = svc.ask(domain, &[&[("files", "files/a.pdf")]]).await;
            assert_eq!(shapes(&resp), vec![(OK, Some((10, Unit::Hour)), 9 - i)], "{backend:?}");
        }
        let resp = svc.ask(domain, &[&[("files", "files/b.csv")]]).await;
        assert_eq!(
            (resp.overall_code, shapes(&resp)),
            (OVER, vec![(OVER, Some((10, Unit::Hour)), 0)]),
            "{backend:?}"
        );
        for i in 0..10 {
            let value = format!("files_no_share/{}", fresh(&i.to_string()));
            let resp = svc.ask(domain, &[&[("files_no_share", &value)]]).await;
            assert_eq!(
                (resp.overall_code, shapes(&resp)),
                (OK, vec![(OK, Some((10, Unit::Hour)), 9)]),
                "{backend:?}"
            );
        }
    }
}

// ---- their example ----------------------------------------------------------------------

/// Their example rules (`examples/ratelimit/config/example.yaml`), the parts their scripts
/// exercise.
const EXAMPLE: &str = r#"domain: rl
descriptors:
  - key: category
    value: account
    rate_limit:
      replaces: [{name: bkthomps}, {name: fake_name}]
      unit: minute
      requests_per_unit: 4
  - key: source_cluster
    value: proxy
    descriptors:
      - key: destination_cluster
        value: bkthomps
        rate_limit: {replaces: [{name: bkthomps}], unit: minute, requests_per_unit: 2}
      - key: destination_cluster
        value: mock
        rate_limit: {unit: minute, requests_per_unit: 1}
      - key: destination_cluster
        value: override
        rate_limit: {replaces: [{name: banned_limit}], unit: minute, requests_per_unit: 2}
      - key: destination_cluster
        value: fake
        rate_limit: {name: fake_name, unit: minute, requests_per_unit: 2}
  - key: foo
    rate_limit: {unit: minute, requests_per_unit: 2}
    descriptors:
      - key: bar
        rate_limit: {unit: minute, requests_per_unit: 3}
      - key: bar
        value: bkthomps
        rate_limit: {name: bkthomps, unit: minute, requests_per_unit: 1}
      - key: bar
        value: banned
        rate_limit: {name: banned_limit, unit: minute, requests_per_unit: 0}
      - key: baz
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: baz
        value: not-so-shady
        rate_limit: {unit: minute, requests_per_unit: 3}
      - key: baz
        value: shady
        rate_limit: {unit: minute, requests_per_unit: 3}
        shadow_mode: true
      - key: bay
        rate_limit: {unlimited: true}
  - key: qux
    rate_limit: {unlimited: true}
  - key: service
    value: service_1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {service_with_quota: {name: service_1}}
  - key: service
    value: service_2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {service_with_quota: {name: service_2}}
"#;

/// What their example Envoy sends for `/twoheader`, `/fourheader` and `/fiveheader` with
/// these request headers: one descriptor per action list whose headers are all present.
fn routed<'a>(headers: &[(&'a str, &'a str)], lists: &[&[&'a str]]) -> Vec<Vec<(&'a str, &'a str)>> {
    lists
        .iter()
        .filter_map(|keys| {
            keys.iter()
                .map(|k| headers.iter().find(|(h, _)| h == k).copied())
                .collect::<Option<Vec<_>>>()
        })
        .collect()
}

/// One request of a script: its headers, its route's action lists, whether it passes.
type Step<'a> = (&'a [(&'a str, &'a str)], &'a [&'a [&'a str]], bool);

const TWO: &[&[&str]] = &[&["foo", "bar"], &["foo", "baz"]];
const FOUR: &[&[&str]] = &[&["foo", "bar"], &["source_cluster", "destination_cluster"]];
const FIVE: &[&[&str]] = &[
    &["foo", "bar"],
    &["source_cluster", "destination_cluster"],
    &["category"],
];

impl Service {
    /// Whether their example Envoy would let a request with `headers` on a route of `lists`
    /// through (their scripts' `curl -f`).
    async fn passes(&mut self, headers: &[(&str, &str)], lists: &[&[&str]]) -> bool {
        let descriptors = routed(headers, lists);
        let refs: Vec<&[(&str, &str)]> = descriptors.iter().map(Vec::as_slice).collect();
        self.ask("rl", &refs).await.overall_code == OK
    }
}

/// Their example scripts: `trigger-ratelimit.sh`, `trigger-shadow-mode-key.sh`, `replaces.sh`,
/// `quota.sh`, and the unlimited key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_example_scripts() {
    for backend in backends("their_example_scripts") {
        let runtime = Runtime::new(&[("example.yaml", EXAMPLE)]);
        let mut svc = serve(&runtime, &backend, &[("RESPONSE_DYNAMIC_METADATA", "true")]).await;

        // trigger-ratelimit.sh: three a minute, the fourth and fifth are 429.
        let h = [("foo", "pelle"), ("baz", "not-so-shady")];
        for i in 0..5 {
            assert_eq!(svc.passes(&h, TWO).await, i < 3, "{backend:?} request {i}");
        }

        // trigger-shadow-mode-key.sh: a shadow limit of three a minute never denies; past it,
        // the status is OK and nothing is left.
        let h = [("foo", "pelle"), ("baz", "shady")];
        for i in 0..6 {
            let resp = svc.ask("rl", &[&h]).await;
            assert_eq!(resp.overall_code, OK, "{backend:?} request {i}");
            assert_eq!(resp.statuses[0].code, OK);
            assert_eq!(resp.statuses[0].limit_remaining, 2u32.saturating_sub(i));
        }

        // replaces.sh, request by request.
        let script: &[Step] = &[
            (&[("foo", "bkthomps"), ("bar", "banned")], TWO, false),
            (
                &[
                    ("foo", "bkthomps"),
                    ("bar", "banned"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "mock"),
                ],
                FOUR,
                false,
            ),
            (
                &[
                    ("foo", "bkthomps"),
                    ("bar", "banned"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "override"),
                ],
                FOUR,
                true,
            ),
            (
                &[
                    ("foo", "bkthomps"),
                    ("bar", "banned"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "override"),
                ],
                FOUR,
                true,
            ),
            (
                &[
                    ("foo", "bkthomps"),
                    ("bar", "banned"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "override"),
                ],
                FOUR,
                false,
            ),
            (
                &[
                    ("foo", "my_foo"),
                    ("bar", "bkthomps"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "bkthomps"),
                ],
                FOUR,
                true,
            ),
            (
                &[
                    ("foo", "my_foo"),
                    ("bar", "bkthomps"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "bkthomps"),
                ],
                FOUR,
                true,
            ),
            (
                &[
                    ("foo", "my_foo"),
                    ("bar", "bkthomps"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "bkthomps"),
                ],
                FOUR,
                false,
            ),
            (
                &[
                    ("foo", "my_foo"),
                    ("bar", "bkthomps"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "not_bkthomps"),
                ],
                FOUR,
                true,
            ),
            (
                &[
                    ("foo", "my_foo"),
                    ("bar", "bkthomps"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "not_bkthomps"),
                ],
                FOUR,
                false,
            ),
            (
                &[
                    ("foo", "my_foo"),
                    ("bar", "bkthomps"),
                    ("source_cluster", "proxy"),
                    ("destination_cluster", "bkthomps"),
                ],
                FOUR,
                false,
            ),
        ];
        for (i, (headers, lists, passes)) in script.iter().enumerate() {
            assert_eq!(
                svc.passes(headers, lists).await,
                *passes,
                "{backend:?} replaces step {i}"
            );
        }
        let five = [
            ("foo", "my_foo"),
            ("bar", "bkthomps"),
            ("source_cluster", "proxy"),
            ("destination_cluster", "fake"),
            ("category", "account"),
        ];
        for i in 0..5 {
            assert_eq!(
                svc.passes(&five, FIVE).await,
                i < 4,
                "{backend:?} five headers, request {i}"
            );
        }
        let h = [("foo", "foo_2"), ("bar", "bkthomps")];
        assert!(svc.passes(&h, TWO).await);
        assert!(!svc.passes(&h, TWO).await);
        let h = [
            ("foo", "foo_3"),
            ("bar", "bar_3"),
            ("source_cluster", "proxy"),
            ("destination_cluster", "fake"),
        ];
        for i in 0..3 {
            assert_eq!(svc.passes(&h, FOUR).await, i < 2, "{backend:?} foo_3, request {i}");
        }
        assert!(!svc.passes(&five, FIVE).await);

        // quota.sh: two quota-mode descriptors (1 and 2 a minute); a request passes while one
        // of them has room, so three pass and the fourth is 429. The metadata says which
        // passed (their route picks the upstream from it).
        let mut served = Vec::new();
        for _ in 0..4 {
            let resp = svc
                .ask("rl", &[&[("service", "service_1")], &[("service", "service_2")]])
                .await;
            served.push((
                resp.overall_code,
                resp.statuses.iter().map(|s| s.code).collect::<Vec<_>>(),
            ));
        }
        assert_eq!(
            served,
            vec![
                (OK, vec![OK, OK]),
                (OK, vec![OVER, OK]),
                (OVER, vec![OVER, OVER]),
                (OVER, vec![OVER, OVER]),
            ],
            "{backend:?}"
        );

        // `unlimited`: OK, no limit, and the most a uint32 holds left, as theirs.
        let resp = svc.ask("rl", &[&[("qux", "anything")]]).await;
        assert_eq!(shapes(&resp), vec![(OK, None, u32::MAX)], "{backend:?}");
        let resp = svc.ask("rl", &[&[("foo", "x"), ("bay", "y")]]).await;
        assert_eq!(shapes(&resp), vec![(OK, None, u32::MAX)], "{backend:?}");
    }
}

/// A descriptor carrying its own `hits_addend` on `service_2` of their example (2 a minute).
fn own_hits(hits: u64) -> RateLimitRequest {
    let mut d = support::descriptor(&[("service", "service_2")]);
    d.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: hits });
    RateLimitRequest {
        domain: "rl".into(),
        descriptors: vec![d],
        hits_addend: 0,
    }
}

/// `token-quota.sh`: a check (`hits_addend` 0) on the request and a report of one hit when the
/// stream ends, on a limit of 2 a minute. As theirs: the check at usage 2 of 2 is `OK`, its
/// report takes usage to 3 (and is itself over), and the fourth check is denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_token_quota_script() {
    for backend in backends("their_token_quota_script") {
        let runtime = Runtime::new(&[("example.yaml", EXAMPLE)]);
        let mut svc = serve(&runtime, &backend, &[]).await;
        let mut admitted = 0;
        let mut reports = Vec::new();
        for _ in 0..4 {
            let check = svc.send(own_hits(0)).await;
            if check.overall_code == OK {
                admitted += 1;
                // The report after the response, whose answer Envoy ignores.
                reports.push(svc.send(own_hits(1)).await.overall_code);
            }
        }
        assert_eq!(admitted, 3, "{backend:?}");
        assert_eq!(
            reports,
            vec![OK, OK, OVER],
            "{backend:?}: the third report took usage past 2"
        );
        let resp = svc.send(own_hits(0)).await;
        assert_eq!(shapes(&resp), vec![(OVER, Some((2, Unit::Minute)), 0)], "{backend:?}");
    }
}

/// Their counting of a descriptor's own `hits_addend`: a check at the limit is `OK` and over
/// only once usage went past it; a report of N is over when it takes usage past the limit and
/// counts all the same, in the rule's token bucket and in an account that remembers what went
/// past the limit (row: own-hits-account).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_counting_of_a_descriptors_own_hits() {
    for backend in backends("their_counting_of_a_descriptors_own_hits") {
        let runtime = Runtime::new(&[("example.yaml", EXAMPLE)]);
        let mut svc = serve(&runtime, &backend, &[]).await;
        // A report of 2 at 0 of 2 fits: remaining 0, and a check there is still OK.
        assert_eq!(
            shapes(&svc.send(own_hits(2)).await),
            vec![(OK, Some((2, Unit::Minute)), 0)],
            "{backend:?}"
        );
        assert_eq!(
            shapes(&svc.send(own_hits(0)).await),
            vec![(OK, Some((2, Unit::Minute)), 0)],
            "{backend:?}"
        );
        // One more hit is over, and counted: the check is over from then on.
        assert_eq!(
            shapes(&svc.send(own_hits(1)).await),
            vec![(OVER, Some((2, Unit::Minute)), 0)],
            "{backend:?}"
        );
        let check = svc.send(own_hits(0)).await;
        assert_eq!(check.overall_code, OVER, "{backend:?}");
        // The reset is the bucket's: the report took its last token, full again in a minute.
        let reset = check.statuses[0].duration_until_reset.as_ref().map(|d| d.seconds);
        assert!(matches!(reset, Some(59..=60)), "{backend:?}: {check:?}");
        // The policy header gives the declared window, the floor below zero aside.
        let policy: Vec<_> = check
            .response_headers_to_add
            .iter()
            .filter(|h| h.key.eq_ignore_ascii_case("ratelimit-policy"))
            .map(|h| h.value.clone())
            .collect();
        assert!(
            policy.len() == 1 && policy[0].ends_with(";q=2;w=60"),
            "{backend:?}: {policy:?}"
        );
        // One count, as theirs: a request's own hit finds the limit spent too.
        assert_eq!(
            shapes(&svc.ask("rl", &[&[("service", "service_2")]]).await),
            vec![(OVER, Some((2, Unit::Minute)), 0)],
            "{backend:?}"
        );
    }
}

/// A check sees the request's own hits: at the limit they spent it is `OK`, and a report past
/// it is over. The account remembers only a descriptor's own hits past the limit, so the check
/// after it is still `OK`, where theirs, one count, is over (row: own-hits-account).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_check_sees_the_requests_own_hits() {
    for backend in backends("their_check_sees_the_requests_own_hits") {
        let runtime = Runtime::new(&[("example.yaml", EXAMPLE)]);
        let mut svc = serve(&runtime, &backend, &[]).await;
        for _ in 0..2 {
            assert_eq!(svc.ask("rl", &[&[("service", "service_2")]]).await.overall_code, OK);
        }
        assert_eq!(
            shapes(&svc.send(own_hits(0)).await),
            vec![(OK, Some((2, Unit::Minute)), 0)],
            "{backend:?}"
        );
        assert_eq!(svc.send(own_hits(1)).await.overall_code, OVER, "{backend:?}");
        assert_eq!(svc.send(own_hits(0)).await.overall_code, OK, "{backend:?}");
    }
}

/// In quota mode a request stands on its second descriptor when the first is over: a report
/// there is judged by the usage before it, as on the first try, not after it was counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_quota_mode_judges_a_report_once() {
    for backend in backends("their_quota_mode_judges_a_report_once") {
        let runtime = Runtime::new(&[("example.yaml", EXAMPLE)]);
        let mut svc = serve(&runtime, &backend, &[]).await;
        // service_1 (1 a minute) spent; service_2 (2 a minute) at 1 of 2.
        assert_eq!(svc.ask("rl", &[&[("service", "service_1")]]).await.overall_code, OK);
        assert_eq!(svc.send(own_hits(1)).await.overall_code, OK, "{backend:?}");
        let mut both = own_hits(1);
        both.descriptors
            .insert(0, support::descriptor(&[("service", "service_1")]));
        let resp = svc.send(both).await;
        assert_eq!(
            (
                resp.overall_code,
                resp.statuses.iter().map(|s| s.code).collect::<Vec<_>>()
            ),
            (OK, vec![OVER, OK]),
            "{backend:?}: service_2 at 2 of 2 after the report passes, so the request does"
        );
    }
}

// ---- their service's settings -----------------------------------------------------------

const HEADERS_RULES: &str = "domain: headers
descriptors:
  - {key: foo, rate_limit: {unit: minute, requests_per_unit: 10}}
  - {key: hello, rate_limit: {unit: minute, requests_per_unit: 3}}
  - {key: quota, quota_mode: true, rate_limit: {unit: minute, requests_per_unit: 1}}
";

/// `LIMIT_RESPONSE_HEADERS_ENABLED` with their default names and with names of one's own: the
/// limit, remaining and reset of the descriptor theirs picks (the lowest remaining, or the
/// last one over its limit outside quota mode), beside tollgate's own headers (row:
/// extra-headers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_response_headers() {
    for backend in backends("their_response_headers") {
        let runtime = Runtime::new(&[("headers.yaml", HEADERS_RULES)]);
        for names in [
            None,
            Some(("A-Ratelimit-Limit", "A-Ratelimit-Remaining", "A-Ratelimit-Reset")),
        ] {
            let mut extra = vec![("LIMIT_RESPONSE_HEADERS_ENABLED", "true")];
            if let Some((l, r, t)) = names {
                extra.extend([
                    ("LIMIT_LIMIT_HEADER", l),
                    ("LIMIT_REMAINING_HEADER", r),
                    ("LIMIT_RESET_HEADER", t),
                ]);
            }
            let (limit, remaining, reset) =
                names.unwrap_or(("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"));
            let mut svc = serve(&runtime, &backend, &extra).await;
            let theirs =
                |resp: &RateLimitResponse| [limit, remaining, reset].map(|n| header(resp, n).map(str::to_owned));
            let (foo, hello) = (fresh("foo"), fresh("hello"));
            // The lowest remaining: `hello` (3 a minute, 2 left) over `foo` (9 left).
            let resp = svc.ask("headers", &[&[("foo", &foo)], &[("hello", &hello)]]).await;
            assert_eq!(
                theirs(&resp),
                [Some("3".into()), Some("2".into()), Some("20".into())],
                "{backend:?}: {resp:?}"
            );
            // Their exact names, as given.
            assert!(resp.response_headers_to_add.iter().any(|h| h.key == limit));
            // Tollgate's own headers are there too (row: extra-headers).
            assert!(header(&resp, "ratelimit-policy").is_some());
            for _ in 0..2 {
                svc.ask("headers", &[&[("hello", &hello)]]).await;
            }
            // Over the limit: the denied descriptor's, though another has less left.
            let resp = svc.ask("headers", &[&[("hello", &hello)], &[("foo", &foo)]]).await;
            assert_eq!(resp.overall_code, OVER);
            assert_eq!(theirs(&resp)[..2], [Some("3".into()), Some("0".into())], "{backend:?}");
            // No descriptor with a limit: no header.
            let resp = svc.ask("headers", &[&[("nothing", "here")]]).await;
            assert_eq!(theirs(&resp), [None, None, None]);
            // Of two descriptors over their limits, the last one outside quota mode: `hello`,
            // not the quota-mode one after it.
            let q = fresh("q");
            svc.ask("headers", &[&[("quota", &q)]]).await;
            let resp = svc.ask("headers", &[&[("hello", &hello)], &[("quota", &q)]]).await;
            assert_eq!(
                shapes(&resp).iter().map(|s| s.0).collect::<Vec<_>>(),
                [OVER, OVER],
                "{resp:?}"
            );
            assert_eq!(theirs(&resp)[..2], [Some("3".into()), Some("0".into())], "{backend:?}");
        }
    }
}

/// `SHADOW_MODE=true`: nothing is denied, and each descriptor's status still says what it
/// would have been, as theirs; a rule's own `shadow_mode` answers OK on its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_global_shadow_mode() {
    for backend in backends("their_global_shadow_mode") {
        let runtime = Runtime::new(&[("example.yaml", EXAMPLE)]);
        let mut svc = serve(&runtime, &backend, &[("SHADOW_MODE", "true")]).await;
        let user = fresh("pelle");
        let (over_rule, shadow_rule) = (
            [("foo", user.as_str()), ("baz", "not-so-shady")],
            [("foo", user.as_str()), ("baz", "shady")],
        );
        for i in 0..5u32 {
            let resp = svc.ask("rl", &[&over_rule, &shadow_rule, &[("hello", "world")]]).await;
            assert_eq!(resp.overall_code, OK, "{backend:?} request {i}");
            let code = if i < 3 { OK } else { OVER };
            assert_eq!(
                shapes(&resp),
                vec![
                    (code, Some((3, Unit::Minute)), 2u32.saturating_sub(i)),
                    (OK, Some((3, Unit::Minute)), 2u32.saturating_sub(i)),
                    (OK, None, 0),
                ],
                "{backend:?} request {i}"
            );
            assert_eq!(header(&resp, "retry-after"), None);
        }
    }
}

/// `MERGE_DOMAIN_CONFIG=true`: two files of one domain are one domain; the same top-level key
/// and value in both is refused, as theirs refuses it (the rules in force stay on a reload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_merged_domains() {
    const FIRST: &str = "domain: test-domain\ndescriptors:\n  - {key: key1, value: value1, rate_limit: {unit: minute, requests_per_unit: 10}}\n";
    const SECOND: &str = "domain: test-domain\ndescriptors:\n  - {key: key2, value: value2, rate_limit: {unit: minute, requests_per_unit: 20}}\n";
    for backend in backends("their_merged_domains") {
        let runtime = Runtime::new(&[("merge_domain_key1.yaml", FIRST), ("merge_domain_key2.yaml", SECOND)]);
        let mut svc = serve(&runtime, &backend, &[("MERGE_DOMAIN_CONFIG", "true")]).await;
        let resp = svc
            .ask("test-domain", &[&[("key1", "value1")], &[("key2", "value2")]])
            .await;
        assert_eq!(
            shapes(&resp),
            vec![(OK, Some((10, Unit::Minute)), 9), (OK, Some((20, Unit::Minute)), 19)],
            "{backend:?}"
        );
        // A third file repeating key1=value1: refused, the merged rules stay in force.
        runtime.write("merge_domain_key1_again.yaml", FIRST);
        let deadline = Instant::now() + Duration::from_secs(30);
        // The error names the file that repeats it, and the one that declared it first.
        let named = |log: &str| {
            log.lines().any(|l| {
                l.contains("duplicate descriptor")
                    && l.contains("merge_domain_key1_again.yaml")
                    && l.contains("merge_domain_key1.yaml")
            })
        };
        while !named(&svc.started.process.log()) {
            assert!(
                Instant::now() < deadline,
                "the duplicate was not reported:\n{}",
                svc.started.process.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let resp = svc
            .ask("test-domain", &[&[("key1", "value1")], &[("key2", "value2")]])
            .await;
        let limits: Vec<_> = shapes(&resp).iter().map(|s| (s.0, s.1)).collect();
        assert_eq!(
            limits,
            [(OK, Some((10, Unit::Minute))), (OK, Some((20, Unit::Minute)))],
            "{backend:?}"
        );
    }
    // Without it, a domain declared twice stops the start, as in theirs.
    let runtime = Runtime::new(&[("a.yaml", FIRST), ("b.yaml", SECOND)]);
    let mut env = runtime.env();
    env.push(("PORT", support::free_port().to_string()));
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("ratelimit");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_tollgate"), &link).unwrap();
    let out = std::process::Command::new(link)
        .env_clear()
        .envs(env)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("domain `test-domain` is already declared"), "{text}");
}

/// Their service refuses an empty domain with an error; tollgate answers OK without limits
/// (row: empty-domain). A descriptor no rule matches is OK with nothing left, in both. A
/// denied request says what is left (row: denied-remaining), and an override's bucket is named
/// (row: override-name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn their_empty_domain_and_unmatched_descriptors() {
    let runtime = Runtime::new(&[("basic.yaml", BASIC), ("another.yaml", ANOTHER)]);
    let mut svc = serve(&runtime, &Backend::Memory, &[]).await;
    let resp = svc.ask("", &[&[("key1", "foo")]]).await;
    assert_eq!((resp.overall_code, shapes(&resp)), (OK, vec![(OK, None, 0)]));
    let resp = svc.ask("basic", &[&[("unknown", "x")], &[("key1", "y")]]).await;
    assert_eq!(
        (resp.overall_code, shapes(&resp)),
        (OK, vec![(OK, None, 0), (OK, Some((50, Unit::Second)), 49)])
    );

    // Ten hours' worth of key3 (10 an hour) asked at once after 7 were used: denied, and the
    // 3 tokens left are still there, where theirs would say 0 and count the 10.
    let value = fresh("key3");
    for _ in 0..7 {
        svc.ask("another", &[&[("key3", &value)]]).await;
    }
    let resp = svc.send(support::request("another", &[("key3", &value)], 10)).await;
    assert_eq!(
        (resp.overall_code, shapes(&resp)),
        (OVER, vec![(OVER, Some((10, Unit::Hour)), 3)])
    );
    let resp = svc.ask("another", &[&[("key3", &value)]]).await;
    assert_eq!(shapes(&resp), vec![(OK, Some((10, Unit::Hour)), 2)]);

    // Envoy's `limit` override: its bucket is named `override`; theirs leaves the name empty.
    let mut d = support::descriptor(&[("key1", "override")]);
    d.limit = Some(
        envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
            requests_per_unit: 5,
            unit: envoy_types::pb::envoy::r#type::v3::RateLimitUnit::Minute as i32,
        },
    );
    let resp = svc
        .send(RateLimitRequest {
            domain: "basic".into(),
            descriptors: vec![d],
            hits_addend: 0,
        })
        .await;
    assert_eq!(shapes(&resp), vec![(OK, Some((5, Unit::Minute)), 4)]);
    assert_eq!(resp.statuses[0].current_limit.as_ref().unwrap().name, "override");
}
