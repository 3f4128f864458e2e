//! The Redis backend end to end: real `tollgate serve` processes deciding over gRPC with their
//! buckets in a real Redis, either the shared single node (`scripts/ensure-redis`, each test
//! under its own key prefix) or a private three-master cluster.
//!
//! Replicas whose clocks disagree by a minute admit exactly the capacity between them (refill
//! runs on Redis `TIME`); descriptor values that look like hash tags or length prefixes never
//! share a bucket; every key has a time to live; a request over buckets in different cluster
//! slots is all or nothing; a corrupt stored value is a counted backend error that harms nothing
//! else.
//!
//! Rules refill slowly (a token per 36 s at the fastest where counts are asserted), so the
//! exact figures do not move while a test runs.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use support::redis::{
    info_commandstats, scan_keys_raw, shared_redis, unique_prefix, RedisCluster, RedisServer, RedisTarget, RespValue,
};
use support::{descriptor, http_get, wait_until, yaml_str, Scrape, Tollgate};
use tollgate::admin::BucketsResponse;
use tollgate::core::bucket::MICRO;
use tollgate::rules::instance_key;
use tollgate::store::redis::keys::{bucket_key, slot};
use tonic::transport::Channel;

// ---- where the buckets live --------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Deployment {
    /// The shared server, under a key prefix unique to the test.
    Single,
    /// A private three-master cluster (`RedisCluster::start`).
    Cluster,
    /// A private single server (`RedisServer::start`), for tests that read its command counts.
    Private,
}

/// The Redis a test's tollgates use, and raw access to it for the checks.
struct Backend {
    // Killed on drop, after the tollgates (declared later in each test) are gone.
    _cluster: Option<RedisCluster>,
    _server: Option<RedisServer>,
    urls: Vec<String>,
    cluster: bool,
    prefix: String,
    /// Every node (one for the single server).
    nodes: Vec<RedisTarget>,
}

impl Backend {
    /// The backend for `test`, or `None` when the shared server is missing and the test is
    /// skipped (see [`shared_redis`]).
    fn new(deployment: Deployment, test: &str) -> Option<Backend> {
        let prefix = unique_prefix(test);
        match deployment {
            Deployment::Single => {
                let url = shared_redis(test)?;
                Some(Backend {
                    _cluster: None,
                    _server: None,
                    nodes: vec![RedisTarget::from(&url)],
                    urls: vec![url],
                    cluster: false,
                    prefix,
                })
            }
            Deployment::Cluster => {
                let cluster = RedisCluster::start();
                Some(Backend {
                    urls: cluster.urls(),
                    nodes: cluster.ports().into_iter().map(RedisTarget::port).collect(),
                    _cluster: Some(cluster),
                    _server: None,
                    cluster: true,
                    prefix,
                })
            }
            Deployment::Private => {
                let server = RedisServer::start();
                Some(Backend {
                    urls: vec![server.url()],
                    nodes: vec![server.target()],
                    _cluster: None,
                    _server: Some(server),
                    cluster: false,
                    prefix,
                })
            }
        }
    }

    /// Starts a `tollgate serve` on this backend with `rules` (domain file `api.yaml`), extra
    /// `redis:` settings (`key: value` YAML) and environment, and waits until it is ready.
    fn start(&self, rules: &str, redis: &[(&str, &str)], env: &[(&str, &str)]) -> Tollgate {
        let urls: Vec<String> = self.urls.iter().map(|u| yaml_str(u)).collect();
        // Generous timeouts: tests run side by side on a loaded machine.
        let mut settings = format!(
            "backend: redis\nredis:\n  urls: [{}]\n  cluster: {}\n  key_prefix: {}\n{}",
            urls.join(", "),
            self.cluster,
            yaml_str(&self.prefix),
            "  command_timeout_ms: 200\n  connect_timeout_ms: 5000\n",
        );
        for (k, v) in redis {
            settings.push_str(&format!("  {k}: {v}\n"));
        }
        let builder = env.iter().fold(
            Tollgate::builder().rules_file("api.yaml", rules).settings(&settings),
            |b, (k, v)| b.env(k, v),
        );
        let mut tollgate = builder.start();
        let http = tollgate.http_addr;
        wait_until(&mut tollgate.process, || {
            http_get(http, "/readyz").filter(|(status, _)| *status == 200)
        })
        .unwrap_or_else(|why| panic!("tollgate not ready: {why}\n{}", tollgate.process.log_tail(60)));
        tollgate
    }

    /// Every key under the prefix with the index of the node holding it.
    fn keys(&self) -> Vec<(usize, Vec<u8>)> {
        self.nodes
            .iter()
            .enumerate()
            .flat_map(|(n, node)| {
                scan_keys_raw(node, self.prefix.as_bytes())
                    .into_iter()
                    .map(move |k| (n, k))
            })
            .collect()
    }

    /// `PTTL` of every key under the prefix (-1: no time to live).
    fn pttls(&self) -> Vec<(String, i64)> {
        self.keys()
            .into_iter()
            .filter_map(|(n, key)| {
                let pttl = self.nodes[n]
                    .cmd(&[b"PTTL", &key])
                    .as_int()
                    .expect("PTTL answers a number");
                // -2: expired (or deleted by a full refill) since the SCAN.
                (pttl != -2).then(|| (String::from_utf8_lossy(&key).into_owned(), pttl))
            })
            .collect()
    }

    /// Panics, listing them, when some key under the prefix never expires; returns how many
    /// keys there are.
    fn assert_every_key_expires(&self) -> usize {
        let pttls = self.pttls();
        let forever: Vec<&(String, i64)> = pttls.iter().filter(|(_, t)| *t < 0).collect();
        assert!(forever.is_empty(), "keys without a time to live: {forever:#?}");
        // At most the longest fill the rules accept (10 years; these tests' rules have no
        // rarer quota) plus the two margins.
        let longest = 3_650 * 86_400_000 + 2_000;
        let too_long: Vec<&(String, i64)> = pttls.iter().filter(|(_, t)| *t > longest).collect();
        assert!(too_long.is_empty(), "keys living longer than 10 years: {too_long:#?}");
        pttls.len()
    }

    /// `EVALSHA` calls so far, summed over the nodes (`INFO commandstats`).
    fn evalsha_calls(&self) -> u64 {
        self.nodes
            .iter()
            .map(|node| info_commandstats(node).get("evalsha").map_or(0, |(n, _)| *n))
            .sum()
    }

    /// The key of the bucket instance `bucket` for `entries` in domain `api`, as tollgate names it.
    fn key_of(&self, bucket: &str, entries: &[(&str, &str)]) -> Vec<u8> {
        let entries: Vec<Entry> = entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect();
        let mut identity = String::new();
        instance_key(&mut identity, "api", bucket, &entries, &vec![None; entries.len()]);
        bucket_key(&self.prefix, &identity)
    }

    /// The node holding `key` (found by SCAN).
    fn node_of(&self, key: &[u8]) -> usize {
        let found: Vec<usize> = self
            .keys()
            .into_iter()
            .filter(|(_, k)| k == key)
            .map(|(n, _)| n)
            .collect();
        assert_eq!(found.len(), 1, "{:?} on nodes {found:?}", String::from_utf8_lossy(key));
        found[0]
    }
}

// ---- gRPC ---------------------------------------------------------------------------------

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

async fn connect(addr: SocketAddr) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the gRPC listener")
}

/// A request in domain `api` with `descriptors`, one hit each.
fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: "api".into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn decide(client: &mut RateLimitServiceClient<Channel>, req: RateLimitRequest) -> RateLimitResponse {
    let shown = format!("{req:?}");
    client
        .should_rate_limit(req)
        .await
        .unwrap_or_else(|status| panic!("{shown}: {status:?}"))
        .into_inner()
}

/// The overall code of `hits` hits (0: one) for the single descriptor `entries`.
async fn code(client: &mut RateLimitServiceClient<Channel>, entries: &[(&str, &str)], hits: u32) -> Code {
    let r = decide(client, support::request("api", entries, hits)).await;
    Code::try_from(r.overall_code).expect("a known code")
}

fn overall(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).expect("a known code")
}

/// POSTs `/v1/buckets/peek` for `entries` in domain `api` on the admin listener.
async fn peek(admin: SocketAddr, entries: &[(&str, &str)]) -> BucketsResponse {
    let body = serde_json::json!({
        "domain": "api",
        "descriptor": entries.iter().map(|(k, v)| serde_json::json!({"key": k, "value": v})).collect::<Vec<_>>(),
    });
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{admin}/v1/buckets/peek"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("the admin API answers");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "peek {body}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("peek answer ({e}): {text}"))
}

// ---- 1. skewed replicas -------------------------------------------------------------------

const HUNDRED_PER_HOUR: &str = r#"
domain: api
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 100, refill: 100/1h}
"#;

/// Per client: how many requests were answered OK, OVER_LIMIT, or failed.
#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    over: usize,
    errors: Vec<String>,
}

/// Two replicas on the same Redis and prefix, one clock 30 s ahead and one 30 s behind, 8
/// clients each hammering the same descriptor with single hits until 400 requests are
/// answered: exactly the capacity is admitted. Were refill on the local clocks, the replica
/// ahead would credit the minute between its clock and the other's (1.6 tokens) on every write
/// the replica behind made.
fn skewed_replicas_admit_exactly_the_capacity(deployment: Deployment, test: &str) {
    const TOTAL: usize = 400;
    const CLIENTS_PER_REPLICA: usize = 8;
    let Some(backend) = Backend::new(deployment, test) else {
        return;
    };
    let ahead = backend.start(HUNDRED_PER_HOUR, &[], &[("TOLLGATE_TEST_CLOCK_SKEW_MS", "30000")]);
    let behind = backend.start(HUNDRED_PER_HOUR, &[], &[("TOLLGATE_TEST_CLOCK_SKEW_MS", "-30000")]);
    for tg in [&ahead, &behind] {
        assert!(
            tg.process.log().contains("the local clock is skewed"),
            "the skew did not reach the process:\n{}",
            tg.process.log_tail(20)
        );
    }

    let per_replica: Vec<Tally> = runtime().block_on(async {
        let mut clients = Vec::new();
        for tg in [&ahead, &behind] {
            for _ in 0..CLIENTS_PER_REPLICA {
                clients.push(connect(tg.grpc_addr).await);
            }
        }
        let sent = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(tokio::sync::Barrier::new(clients.len()));
        let tasks: Vec<_> = clients
            .into_iter()
            .map(|mut client| {
                let sent = sent.clone();
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    let mut tally = Tally::default();
                    while sent.fetch_add(1, Ordering::SeqCst) < TOTAL {
                        let req = support::request("api", &[("user", "everyone")], 0);
                        match client.should_rate_limit(req).await.map(|r| r.into_inner()) {
                            Ok(r) if r.overall_code == Code::Ok as i32 => tally.ok += 1,
                            Ok(r) if r.overall_code == Code::OverLimit as i32 => tally.over += 1,
                            Ok(r) => tally.errors.push(format!("unexpected answer {r:?}")),
                            Err(status) => tally.errors.push(format!("{status:?}")),
                        }
                    }
                    tally
                })
            })
            .collect();
        let mut per_replica = vec![Tally::default(), Tally::default()];
        for (i, task) in tasks.into_iter().enumerate() {
            let t = task.await.expect("a client task");
            let r = &mut per_replica[i / CLIENTS_PER_REPLICA];
            r.ok += t.ok;
            r.over += t.over;
            r.errors.extend(t.errors);
        }
        per_replica
    });

    let ok: usize = per_replica.iter().map(|t| t.ok).sum();
    let over: usize = per_replica.iter().map(|t| t.over).sum();
    let errors: Vec<&String> = per_replica.iter().flat_map(|t| &t.errors).collect();
    assert!(
        errors.is_empty(),
        "{} errors, e.g. {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    assert_eq!(ok + over, TOTAL, "{per_replica:?}");
    assert_eq!(ok, 100, "admitted (ahead, behind): {per_replica:?}");
    assert_eq!(over, TOTAL - 100, "{per_replica:?}");
    // Both replicas took part in admitting: the skew was exercised, not sidestepped.
    assert!(per_replica.iter().all(|t| t.ok > 0), "{per_replica:?}");
    // One bucket, one key, and it expires.
    assert_eq!(backend.assert_every_key_expires(), 1, "{:?}", backend.pttls());
}

#[test]
fn two_skewed_replicas_admit_exactly_the_capacity() {
    skewed_replicas_admit_exactly_the_capacity(Deployment::Single, "two_skewed_replicas_admit_exactly_the_capacity");
}

#[test]
fn two_skewed_replicas_admit_exactly_the_capacity_on_a_cluster() {
    skewed_replicas_admit_exactly_the_capacity(
        Deployment::Cluster,
        "two_skewed_replicas_admit_exactly_the_capacity_on_a_cluster",
    );
}

// ---- 2. values that look like keys --------------------------------------------------------

const ONE_PER_HOUR: &str = r#"
domain: api
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 1, refill: 1/1h}
  - key: org
    descriptors:
      - key: user
        name: per_org_user
        token_bucket: {capacity: 1, refill: 1/1h}
"#;

/// Values with hash-tag braces, length-prefix and separator look-alikes, and non-ASCII (é
/// precomposed and decomposed are different values).
const TRICKY_VALUES: &[&str] = &[
    "{",
    "}",
    "}{",
    "{}",
    "{x}",
    "{{x}}",
    ":",
    "::",
    "5:x",
    "1:a",
    "a",
    "a:",
    "4:user1:a",
    "8:per_user4:user1:a",
    "é",
    "e\u{301}",
    "e",
    "日本",
    "日本:{日本}",
];

/// Two-entry descriptors that would share a bucket if entries were joined without their
/// lengths.
const TRICKY_PAIRS: &[[&str; 2]] = &[
    ["a:b", "c"],
    ["a", "b:c"],
    ["1:a", "b"],
    ["1", "a1:b"],
    ["{", "}"],
    ["{}", ""],
];

/// Every tricky value is its own capacity-1 bucket: the first request passes and the second
/// does not, for each, with all first requests made before any second one (two values sharing
/// a bucket would see a first request denied). Redis then holds exactly one key per instance,
/// each named as `keys::bucket_key` says and each expiring; on a cluster each key's slot is
/// that of its 16-hex-digit tag, whatever braces the value holds.
fn values_never_share_a_bucket(deployment: Deployment, test: &str) {
    let Some(backend) = Backend::new(deployment, test) else {
        return;
    };
    let tg = backend.start(ONE_PER_HOUR, &[], &[]);
    let mut instances: Vec<(&str, Vec<(&str, &str)>)> =
        TRICKY_VALUES.iter().map(|v| ("per_user", vec![("user", *v)])).collect();
    instances.extend(
        TRICKY_PAIRS
            .iter()
            .map(|[org, user]| ("per_org_user", vec![("org", *org), ("user", *user)])),
    );

    runtime().block_on(async {
        let mut client = connect(tg.grpc_addr).await;
        for round in ["first", "second"] {
            for (_, entries) in &instances {
                let got = code(&mut client, entries, 0).await;
                let want = if round == "first" { Code::Ok } else { Code::OverLimit };
                assert_eq!(got, want, "{round} request for {entries:?}");
            }
        }
    });

    let found: BTreeSet<Vec<u8>> = backend.keys().into_iter().map(|(_, k)| k).collect();
    let expected: BTreeSet<Vec<u8>> = instances.iter().map(|(b, e)| backend.key_of(b, e)).collect();
    assert_eq!(expected.len(), instances.len(), "the test's instances are distinct");
    let show = |keys: &BTreeSet<Vec<u8>>| -> Vec<String> {
        keys.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect()
    };
    assert_eq!(
        found.len(),
        instances.len(),
        "one key per instance: {:#?}",
        show(&found)
    );
    assert_eq!(show(&found), show(&expected));
    assert_eq!(backend.assert_every_key_expires(), instances.len());

    if deployment == Deployment::Cluster {
        for (n, key) in backend.keys() {
            let text = String::from_utf8_lossy(&key).into_owned();
            let tag_end = backend.prefix.len() + 18;
            let tag = &key[backend.prefix.len()..tag_end];
            assert!(
                tag[0] == b'{' && tag[17] == b'}' && tag[1..17].iter().all(u8::is_ascii_hexdigit),
                "{text}"
            );
            let key_slot = backend.nodes[n].cmd(&[b"CLUSTER", b"KEYSLOT", &key]).as_int().unwrap();
            let tag_slot = backend.nodes[n].cmd(&[b"CLUSTER", b"KEYSLOT", tag]).as_int().unwrap();
            assert_eq!(key_slot, tag_slot, "{text}");
            assert_eq!(key_slot, i64::from(slot(&key)), "{text}");
        }
    }
}

#[test]
fn descriptor_values_that_look_like_keys_never_share_a_bucket() {
    values_never_share_a_bucket(
        Deployment::Single,
        "descriptor_values_that_look_like_keys_never_share_a_bucket",
    );
}

#[test]
fn descriptor_values_that_look_like_keys_never_share_a_bucket_on_a_cluster() {
    values_never_share_a_bucket(
        Deployment::Cluster,
        "descriptor_values_that_look_like_keys_never_share_a_bucket_on_a_cluster",
    );
}

// ---- 3. time to live ----------------------------------------------------------------------

const MIXED: &str = r#"
domain: api
buckets:
  slow: {capacity: 5, refill: 5/1h}
  fast: {capacity: 3, refill: 3/s}
  daily: {quota: {limit: 5, reset: "0 0 * * *"}}
  metered: {capacity: 5, refill: 5/1h, quota: {limit: 100, reset: "0 0 1 * *"}}
  weekly:
    capacity: 5
    refill: 5/1h
    schedule:
      - {cron: "* * * * SAT,SUN", capacity: 10, refill: 10/1h}
      - {cron: "*/2 * * * MON-FRI", scale: 2}
descriptors:
  - {key: slow, bucket: slow}
  - {key: fast, bucket: fast}
  - {key: legacy, rate_limit: {unit: minute, requests_per_unit: 4}}
  - {key: daily, bucket: daily}
  - {key: metered, bucket: metered}
  - {key: weekly, bucket: weekly}
"#;

fn with_hits(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend: Some(UInt64Value { value: hits }),
        ..descriptor(entries)
    }
}

fn refund(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        is_negative_hits: true,
        ..with_hits(entries, hits)
    }
}

/// Consumes of one and several hits, checks (descriptor `hits_addend` 0), refunds that leave a
/// bucket short and refunds that fill it (the key is deleted), denied requests, requests over
/// several buckets, and Envoy's limit override, on constant, scheduled and quota buckets:
/// afterwards every key under the prefix expires.
fn keys_expire(deployment: Deployment, test: &str) {
    let Some(backend) = Backend::new(deployment, test) else {
        return;
    };
    let tg = backend.start(MIXED, &[], &[]);
    runtime().block_on(async {
        let mut client = connect(tg.grpc_addr).await;
        for kind in ["slow", "fast", "legacy", "daily", "metered", "weekly"] {
            for n in 0..4 {
                let value = format!("{kind}-{n}");
                let e = [(kind, value.as_str())];
                let e = &e[..];
                match n {
                    // Consume, check, consume more than is left (denied), refund part.
                    0 => {
                        decide(&mut client, request(vec![descriptor(e)])).await;
                        decide(&mut client, request(vec![with_hits(e, 0)])).await;
                        decide(&mut client, request(vec![with_hits(e, 50)])).await;
                        decide(&mut client, request(vec![with_hits(e, 2)])).await;
                        decide(&mut client, request(vec![refund(e, 1)])).await;
                    }
                    // Consume, then refund everything: full again, the key goes.
                    1 => {
                        decide(&mut client, request(vec![with_hits(e, 2)])).await;
                        decide(&mut client, request(vec![refund(e, 100)])).await;
                    }
                    // Only checks and refunds on a full bucket: nothing to write.
                    2 => {
                        decide(&mut client, request(vec![with_hits(e, 0)])).await;
                        decide(&mut client, request(vec![refund(e, 3)])).await;
                    }
                    // Empty it, then a check, a denial and a refund in one request.
                    _ => {
                        decide(&mut client, request(vec![with_hits(e, 3)])).await;
                        let r = request(vec![with_hits(e, 0), with_hits(e, 5), refund(e, 1)]);
                        decide(&mut client, r).await;
                    }
                }
            }
        }
        // Several buckets in one request, one denying; and an override.
        let all: Vec<RateLimitDescriptor> = ["slow", "fast", "legacy", "daily", "metered", "weekly"]
            .iter()
            .map(|k| descriptor(&[(k, "together")]))
            .collect();
        assert_eq!(overall(&decide(&mut client, request(all.clone())).await), Code::Ok);
        let mut greedy = all.clone();
        greedy.push(with_hits(&[("slow", "together")], 5));
        assert_eq!(overall(&decide(&mut client, request(greedy)).await), Code::OverLimit);
        let overridden = RateLimitDescriptor {
            limit: Some(RateLimitOverride {
                requests_per_unit: 7,
                unit: RateLimitUnit::Minute as i32,
            }),
            ..descriptor(&[("unmatched", "x")])
        };
        assert_eq!(overall(&decide(&mut client, request(vec![overridden])).await), Code::Ok);
    });
    let keys = backend.assert_every_key_expires();
    assert!(keys >= 10, "the load left only {keys} keys: {:#?}", backend.pttls());
}

#[test]
fn keys_always_have_a_ttl() {
    keys_expire(Deployment::Single, "keys_always_have_a_ttl");
}

#[test]
fn keys_always_have_a_ttl_on_a_cluster() {
    keys_expire(Deployment::Cluster, "keys_always_have_a_ttl_on_a_cluster");
}

// ---- 4. all or nothing across slots -------------------------------------------------------

const SLOW_AND_FAST: &str = r#"
domain: api
descriptors:
  - key: slow
    name: slow
    token_bucket: {capacity: 100, refill: 100/1h}
  - key: fast
    name: fast
    token_bucket: {capacity: 1000, refill: 1000/s}
"#;

/// A bucket key's stored value, three little-endian doubles (tokens µt, updated µs, end µs),
/// and its expiry (`PEXPIRETIME`, Redis ms; -1 for none).
fn stored_and_expiry(backend: &Backend, key: &[u8]) -> ([f64; 3], i64) {
    let node = &backend.nodes[0];
    let value = node.cmd(&[b"GET", key]);
    let raw = value
        .as_bytes()
        .filter(|v| v.len() == 24)
        .unwrap_or_else(|| panic!("a bucket value: {value:?}"));
    let mut v = [0.0; 3];
    for (i, x) in v.iter_mut().enumerate() {
        *x = f64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    }
    let expires = node
        .cmd(&[b"PEXPIRETIME", key])
        .as_int()
        .expect("PEXPIRETIME answers a number");
    (v, expires)
}

/// A written key expires between one and two margins (1 s each) after the instant its bucket
/// would be full again, in the lean form (the takes) as in the general one (the refund): a
/// bigger deficit moves it later, a refund earlier, and a key that lost its expiry (`PERSIST`
/// by hand, a restore without one) gets one again at its next write.
#[test]
fn a_key_expires_one_to_two_margins_after_its_bucket_would_be_full() {
    let Some(backend) = Backend::new(
        Deployment::Single,
        "a_key_expires_one_to_two_margins_after_its_bucket_would_be_full",
    ) else {
        return;
    };
    let tg = backend.start(SLOW_AND_FAST, &[], &[]);
    let rt = runtime();
    let mut client = rt.block_on(connect(tg.grpc_addr));
    let mut send = |d: RateLimitDescriptor| rt.block_on(decide(&mut client, request(vec![d])));
    // The expiry lies within [updated + time to full + 1 s, + 2 s] (ms), give or take the ms
    // rounding of the times involved.
    let check = |what: &str, key: &[u8], full_in_ms: f64| -> i64 {
        let ([tokens, updated_us, _], expires) = stored_and_expiry(&backend, key);
        let after_full = expires as f64 - updated_us / 1000.0 - full_in_ms;
        assert!(
            (998.0..=2_002.0).contains(&after_full),
            "{what}: expires {after_full} ms after full (tokens {tokens}, expires {expires})"
        );
        expires
    };

    let slow = [("slow", "a")];
    let slow_key = backend.key_of("slow", &slow);
    send(with_hits(&slow, 1));
    let first = check("one token short", &slow_key, 36_000.0);
    send(with_hits(&slow, 1));
    let second = check("two tokens short", &slow_key, 72_000.0);
    assert!(second > first + 30_000, "a bigger deficit moves the expiry later");
    send(refund(&slow, 1));
    let third = check("refunded to one short", &slow_key, 36_000.0);
    assert!(third < second - 30_000, "a refund moves the expiry earlier");
    backend.nodes[0].cmd(&[b"PERSIST", &slow_key]);
    send(with_hits(&slow, 1));
    check("written after PERSIST", &slow_key, 72_000.0);

    // 1,000 tokens a second: one token short is full 1 ms later.
    let fast = [("fast", "a")];
    let fast_key = backend.key_of("fast", &fast);
    send(with_hits(&fast, 1));
    check("fast, one short", &fast_key, 1.0);
    send(with_hits(&fast, 1));
    check("fast, again", &fast_key, 1.0);
    backend.assert_every_key_expires();
}

/// A value in the text form earlier versions wrote (`tokens:updated:end`) is read as it was
/// meant, and the next write replaces it with the binary form.
#[test]
fn a_value_in_the_earlier_text_form_is_read_and_rewritten() {
    let Some(backend) = Backend::new(
        Deployment::Single,
        "a_value_in_the_earlier_text_form_is_read_and_rewritten",
    ) else {
        return;
    };
    let tg = backend.start(SLOW_AND_FAST, &[], &[]);
    let slow = [("slow", "legacy")];
    let key = backend.key_of("slow", &slow);
    // 3 tokens left, written just now (Redis's clock), under a constant limit (end 0).
    let time = backend.nodes[0].cmd(&[b"TIME"]);
    let parts: Vec<u64> = time
        .as_array()
        .expect("TIME answers two numbers")
        .iter()
        .map(|p| p.as_text().and_then(|t| t.parse().ok()).expect("a number"))
        .collect();
    let now_us = parts[0] * 1_000_000 + parts[1];
    let text = format!("3000000:{now_us}:0");
    backend.nodes[0].cmd(&[b"SET", &key, text.as_bytes(), b"PX", b"600000"]);
    let rt = runtime();
    let mut client = rt.block_on(connect(tg.grpc_addr));
    for want in [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit] {
        assert_eq!(rt.block_on(code(&mut client, &slow, 1)), want);
    }
    let ([tokens, _, end], expires) = stored_and_expiry(&backend, &key);
    assert!(tokens < 1e6, "under one token left: {tokens}");
    assert_eq!(end, 0.0);
    assert!(expires > 0, "{expires}");

    // 0.03 tokens: a text value of exactly 24 bytes, the length of a binary one, is still read
    // as text (it was refused as a corrupt binary value before).
    let nearly_empty = [("slow", "legacy-24")];
    let key = backend.key_of("slow", &nearly_empty);
    let text = format!("30000:{now_us}:0");
    assert_eq!(text.len(), 24);
    backend.nodes[0].cmd(&[b"SET", &key, text.as_bytes(), b"PX", b"600000"]);
    assert_eq!(rt.block_on(code(&mut client, &nearly_empty, 1)), Code::OverLimit);
}

/// Rules of two buckets, `tight` and `roomy`, of the capacities given, refilling too slowly to
/// move the counts while a test runs.
fn tight_and_roomy(tight: u32, roomy: u32) -> String {
    format!(
        "domain: api\ndescriptors:\n  - key: tight\n    name: tight\n    token_bucket: {{capacity: {tight}, refill: {tight}/1h}}\n  \
         - key: roomy\n    name: roomy\n    token_bucket: {{capacity: {roomy}, refill: 1/1h}}\n"
    )
}

/// The node owning each slot, from `CLUSTER SLOTS`.
fn slot_owners(node: &RedisTarget) -> BTreeMap<(i64, i64), u16> {
    let reply = node.cmd(&[b"CLUSTER", b"SLOTS"]);
    reply
        .as_array()
        .expect("CLUSTER SLOTS answers an array")
        .iter()
        .map(|range| {
            let r = range.as_array().expect("a slot range");
            let master = r[2].as_array().expect("the range's master");
            let port = master[1].as_int().expect("a port") as u16;
            ((r[0].as_int().unwrap(), r[1].as_int().unwrap()), port)
        })
        .collect()
}

fn owner(owners: &BTreeMap<(i64, i64), u16>, slot: i64) -> u16 {
    *owners
        .iter()
        .find(|((lo, hi), _)| (*lo..=*hi).contains(&slot))
        .unwrap_or_else(|| panic!("no node owns slot {slot}: {owners:?}"))
        .1
}

/// One request over two buckets on different nodes (so in different slots), one of them
/// empty: the request is denied, the other bucket's tokens are untouched (the call to its slot
/// consumed and was refunded), in either descriptor order and repeatedly. Then the empty
/// bucket's value is corrupted: the request fails, and the other bucket is untouched still.
#[test]
fn a_request_over_buckets_in_different_slots_is_all_or_nothing() {
    let backend = Backend::new(
        Deployment::Cluster,
        "a_request_over_buckets_in_different_slots_is_all_or_nothing",
    )
    .expect("a private cluster");
    let owners = slot_owners(&backend.nodes[0]);
    let slot_of = |bucket: &str, entries: &[(&str, &str)]| i64::from(slot(&backend.key_of(bucket, entries)));
    // Pick values whose buckets land on different masters.
    let roomy_value = "r";
    let roomy_port = owner(&owners, slot_of("roomy", &[("roomy", roomy_value)]));
    let tight_value = (0..)
        .map(|i| format!("t{i}"))
        .find(|v| owner(&owners, slot_of("tight", &[("tight", v.as_str())])) != roomy_port)
        .expect("an endless iterator");
    let roomy = [("roomy", roomy_value)];
    let tight = [("tight", tight_value.as_str())];
    // The over-limit cache off: a value corrupted under it is the store's to report, and the
    // cache would answer the exhausted bucket from what the store said before.
    let tg = backend.start(
        &tight_and_roomy(1, 10),
        &[("failure_mode", "error")],
        &[("TOLLGATE_LOCAL__OVER_LIMIT_CACHE", "false")],
    );

    let rt = runtime();
    rt.block_on(async {
        let mut client = connect(tg.grpc_addr).await;
        assert_eq!(code(&mut client, &roomy, 1).await, Code::Ok);
        assert_eq!(code(&mut client, &tight, 1).await, Code::Ok);
    });

    // Redis agrees: two keys, in different slots, on different nodes.
    let keys = backend.keys();
    assert_eq!(keys.len(), 2, "{keys:?}");
    let slots: Vec<i64> = keys
        .iter()
        .map(|(n, k)| backend.nodes[*n].cmd(&[b"CLUSTER", b"KEYSLOT", k]).as_int().unwrap())
        .collect();
    assert_ne!(slots[0], slots[1], "{keys:?}");
    assert_ne!(keys[0].0, keys[1].0, "both keys on one node: {keys:?}");
    let roomy_key = backend.key_of("roomy", &roomy);
    let tight_key = backend.key_of("tight", &tight);
    assert!(keys.iter().any(|(_, k)| *k == roomy_key) && keys.iter().any(|(_, k)| *k == tight_key));

    rt.block_on(async {
        let mut client = connect(tg.grpc_addr).await;
        for round in 0..3 {
            for order in [[&roomy[..], &tight[..]], [&tight[..], &roomy[..]]] {
                let r = decide(&mut client, request(order.iter().map(|e| descriptor(e)).collect())).await;
                assert_eq!(overall(&r), Code::OverLimit, "round {round} {order:?}: {r:?}");
                let roomy_at = if order[0] == &roomy[..] { 0 } else { 1 };
                let roomy_status = &r.statuses[roomy_at];
                let tight_status = &r.statuses[1 - roomy_at];
                assert_eq!(roomy_status.code, Code::Ok as i32, "{r:?}");
                assert_eq!(roomy_status.limit_remaining, 9, "{r:?}");
                assert_eq!(tight_status.code, Code::OverLimit as i32, "{r:?}");
            }
        }
        // The admin API sees 9 tokens (and a sliver of refill, far from a tenth token).
        let peeked = peek(tg.admin_addr, &roomy).await;
        assert_eq!(peeked.buckets[0].tokens, 9, "{peeked:?}");
        assert!(peeked.buckets[0].tokens_micro < 9 * MICRO + MICRO / 10, "{peeked:?}");
    });

    // The tight bucket's value corrupted: its slot fails, the roomy slot's take is given back.
    let tight_node = backend.node_of(&tight_key);
    backend.nodes[tight_node].cmd(&[b"SET", &tight_key, b"not a bucket", b"PX", b"600000"]);
    rt.block_on(async {
        let mut client = connect(tg.grpc_addr).await;
        for order in [[&roomy[..], &tight[..]], [&tight[..], &roomy[..]]] {
            let req = request(order.iter().map(|e| descriptor(e)).collect());
            let status = client.should_rate_limit(req).await.expect_err("a failed decision");
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        }
        let peeked = peek(tg.admin_addr, &roomy).await;
        assert_eq!(peeked.buckets[0].tokens, 9, "{peeked:?}");
        // And by requests: 9 more pass, the tenth does not.
        assert_eq!(code(&mut client, &roomy, 9).await, Code::Ok);
        assert_eq!(code(&mut client, &roomy, 1).await, Code::OverLimit);
    });
    assert_eq!(backend.assert_every_key_expires(), 2);
}

/// `streams` concurrent request loops on one connection to `addr`, each sending `make()`'s
/// request as soon as its previous one is answered, until `total` have been sent: every answer
/// (or failure), in no particular order.
async fn concurrent_streams(
    addr: SocketAddr,
    streams: usize,
    total: usize,
    make: impl Fn(usize) -> RateLimitRequest + Send + Sync + 'static,
) -> Vec<Result<RateLimitResponse, tonic::Status>> {
    let client = connect(addr).await;
    let sent = Arc::new(AtomicUsize::new(0));
    let make = Arc::new(make);
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let (mut client, sent, make) = (client.clone(), sent.clone(), make.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                loop {
                    let i = sent.fetch_add(1, Ordering::SeqCst);
                    if i >= total {
                        return answers;
                    }
                    answers.push(client.should_rate_limit(make(i)).await.map(|r| r.into_inner()));
                }
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(total);
    for task in tasks {
        answers.extend(task.await.expect("a stream task"));
    }
    answers
}

/// A private three-master cluster for `test`.
fn private_cluster(test: &str) -> Backend {
    Backend::new(Deployment::Cluster, test).expect("a private cluster")
}

/// Starts a tollgate with `rules` on `backend` and runs [`concurrent_streams`] against it: the
/// tollgate, every answer, and the `EVALSHA` calls the nodes received meanwhile.
fn streams_on(
    backend: &Backend,
    rules: &str,
    total: usize,
    make: impl Fn(usize) -> RateLimitRequest + Send + Sync + 'static,
) -> (Tollgate, Vec<RateLimitResponse>, u64) {
    let tg = backend.start(rules, &[("failure_mode", "error")], &[]);
    let calls_before = backend.evalsha_calls();
    let answers = runtime().block_on(concurrent_streams(tg.grpc_addr, 64, total, make));
    let calls = backend.evalsha_calls() - calls_before;
    let answers = answers
        .into_iter()
        .map(|r| r.unwrap_or_else(|status| panic!("{status:?}")))
        .collect();
    (tg, answers, calls)
}

/// On a cluster, 64 streams on one bucket of 100 tokens (`src/store/redis/batch.rs`): the
/// requests waiting on the bucket's slot share script calls (fewer `EVALSHA` on all the nodes
/// together than requests), and exactly the capacity is admitted.
#[test]
fn concurrent_requests_on_a_cluster_share_calls_and_admit_exactly_the_capacity() {
    const TOTAL: usize = 512;
    let backend = private_cluster("concurrent_requests_on_a_cluster_share_calls_and_admit_exactly_the_capacity");
    let (_tg, answers, calls) = streams_on(&backend, &tight_and_roomy(10, 100), TOTAL, |_| {
        support::request("api", &[("roomy", "hot")], 1)
    });
    let codes: Vec<Code> = answers.iter().map(overall).collect();
    let ok = codes.iter().filter(|c| **c == Code::Ok).count();
    let over = codes.iter().filter(|c| **c == Code::OverLimit).count();
    assert_eq!((ok, over), (100, TOTAL - 100));
    eprintln!("{calls} script calls for {TOTAL} requests");
    assert!(
        calls < TOTAL as u64,
        "{calls} script calls for {TOTAL} requests: no call decided more than one"
    );
    assert_eq!(backend.assert_every_key_expires(), 1);
}

/// Keys spread, calls shared: 64 streams send 1,536 requests, each on a bucket of its own
/// (1,536 distinct values, so 1,536 keys in as many slots, nearly). The keys land on every
/// master, the busiest holding at most 1.5 times the mean (no hot master); and the requests
/// share script calls although no two share a slot: each master decides the lean requests of
/// all its slots in one call of the Cluster form (`lua/cross_slot.lua`). Before, calls were
/// per slot, so about one a request (0.9985 in the load benchmark).
#[test]
fn spread_keys_on_a_cluster_share_calls_and_spread_over_every_master() {
    const TOTAL: usize = 1_536;
    let backend = private_cluster("spread_keys_on_a_cluster_share_calls_and_spread_over_every_master");
    let (_tg, answers, calls) = streams_on(&backend, &tight_and_roomy(10, 100), TOTAL, |i| {
        support::request("api", &[("roomy", format!("v{i}").as_str())], 1)
    });
    assert!(answers.iter().all(|r| overall(r) == Code::Ok), "every bucket is fresh");
    let mut per_node = vec![0usize; backend.nodes.len()];
    for (n, _) in backend.keys() {
        per_node[n] += 1;
    }
    assert_eq!(per_node.iter().sum::<usize>(), TOTAL, "one key a request: {per_node:?}");
    let mean = TOTAL as f64 / per_node.len() as f64;
    let busiest = *per_node.iter().max().expect("three masters") as f64;
    assert!(busiest <= 1.5 * mean, "keys per master {per_node:?}: a hot master");
    eprintln!("{calls} script calls for {TOTAL} requests on keys per master {per_node:?}");
    assert!(
        calls * 2 < TOTAL as u64,
        "{calls} script calls for {TOTAL} requests in distinct slots: calls are not shared across slots"
    );
    backend.assert_every_key_expires();
}

/// Batched calls keep a request over two slots all or nothing: 64 streams send 256 requests
/// over a tight bucket (10 tokens) and a roomy one (100) on another node, in alternating
/// orders. Exactly 10 are admitted, each with both buckets OK; every other one is denied by the
/// tight bucket, and what its roomy slot took is given back exactly: 90 tokens remain in the
/// roomy bucket. The calls were shared (fewer than one per slot and request).
#[test]
fn a_request_over_several_slots_is_all_or_nothing_when_batched() {
    const TOTAL: usize = 256;
    let backend = private_cluster("a_request_over_several_slots_is_all_or_nothing_when_batched");
    let owners = slot_owners(&backend.nodes[0]);
    let slot_of = |bucket: &str, entries: &[(&str, &str)]| i64::from(slot(&backend.key_of(bucket, entries)));
    let roomy_port = owner(&owners, slot_of("roomy", &[("roomy", "r")]));
    let tight_value = (0..)
        .map(|i| format!("t{i}"))
        .find(|v| owner(&owners, slot_of("tight", &[("tight", v.as_str())])) != roomy_port)
        .expect("an endless iterator");
    let (tg, answers, calls) = streams_on(&backend, &tight_and_roomy(10, 100), TOTAL, move |i| {
        let (roomy, tight) = (
            descriptor(&[("roomy", "r")]),
            descriptor(&[("tight", tight_value.as_str())]),
        );
        request(if i % 2 == 0 {
            vec![roomy, tight]
        } else {
            vec![tight, roomy]
        })
    });
    let mut ok = 0;
    for r in &answers {
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        match overall(r) {
            Code::Ok => {
                ok += 1;
                assert_eq!(codes, [Code::Ok as i32; 2], "{r:?}");
            }
            Code::OverLimit => assert!(codes.contains(&(Code::OverLimit as i32)), "{r:?}"),
            other => panic!("{other:?}: {r:?}"),
        }
    }
    assert_eq!(ok, 10);
    eprintln!("{calls} script calls for {TOTAL} requests over two slots");
    assert!(
        calls < 2 * TOTAL as u64,
        "{calls} script calls for {TOTAL} requests over two slots: no call decided more than one"
    );
    runtime().block_on(async {
        let peeked = peek(tg.admin_addr, &[("roomy", "r")]).await;
        assert_eq!(peeked.buckets[0].tokens, 90, "{peeked:?}");
        assert!(peeked.buckets[0].tokens_micro < 90 * MICRO + MICRO / 10, "{peeked:?}");
        let mut client = connect(tg.grpc_addr).await;
        assert_eq!(code(&mut client, &[("roomy", "r")], 90).await, Code::Ok);
        assert_eq!(code(&mut client, &[("roomy", "r")], 1).await, Code::OverLimit);
    });
    assert_eq!(backend.assert_every_key_expires(), 2);
}

// ---- 5. a corrupt value -------------------------------------------------------------------

const TWO_PER_HOUR: &str = r#"
domain: api
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 2, refill: 2/1h}
"#;

fn errors(tg: &Tollgate, kind: &str) -> f64 {
    Scrape::from(tg.http_addr).counter("tollgate_backend_errors_total", &[("backend", "redis"), ("kind", kind)])
}

/// A bucket's key overwritten with something that is not a bucket value (garbage, too few or
/// too many fields, a negative number, an empty string, another type): a request for it is
/// UNAVAILABLE (`failure_mode: error`) and counted as a backend error; the process lives on
/// and other descriptors decide as before (one good request between bad ones keeps the
/// circuit breaker closed).
fn corrupt_value_is_a_counted_error(deployment: Deployment, test: &str) {
    let Some(backend) = Backend::new(deployment, test) else {
        return;
    };
    let mut tg = backend.start(TWO_PER_HOUR, &[("failure_mode", "error")], &[]);
    // A stored value is three little-endian doubles, each an integer from 0 to 2^53 (or the
    // text form "tokens:updated:end" of earlier versions).
    let doubles = |xs: &[f64]| -> Vec<u8> { xs.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (two, four) = (doubles(&[1e6, 0.0]), doubles(&[1e6, 0.0, 0.0, 0.0]));
    let (negative, fraction) = (doubles(&[-1e6, 0.0, 0.0]), doubles(&[0.5, 0.0, 0.0]));
    let (nan, huge) = (doubles(&[1e6, f64::NAN, 0.0]), doubles(&[1e6, 0.0, 1e300]));
    let corruptions: &[(&str, &[&[u8]])] = &[
        ("garbage", &[b"SET", b"$KEY", b"garbage", b"PX", b"600000"]),
        ("two numbers", &[b"SET", b"$KEY", &two, b"PX", b"600000"]),
        ("four numbers", &[b"SET", b"$KEY", &four, b"PX", b"600000"]),
        ("text, two fields", &[b"SET", b"$KEY", b"1000000:5", b"PX", b"600000"]),
        ("text, negative", &[b"SET", b"$KEY", b"-1000000:0:0", b"PX", b"600000"]),
        ("negative", &[b"SET", b"$KEY", &negative, b"PX", b"600000"]),
        ("a fraction", &[b"SET", b"$KEY", &fraction, b"PX", b"600000"]),
        ("not a number", &[b"SET", b"$KEY", &nan, b"PX", b"600000"]),
        ("past 2^53", &[b"SET", b"$KEY", &huge, b"PX", b"600000"]),
        ("empty", &[b"SET", b"$KEY", b"", b"PX", b"600000"]),
        ("a list", &[b"RPUSH", b"$KEY", b"1000000:0:0"]),
    ];
    let rt = runtime();
    let mut client = rt.block_on(connect(tg.grpc_addr));
    for (n, (what, command)) in corruptions.iter().enumerate() {
        let victim_value = format!("victim-{n}");
        let victim = [("user", victim_value.as_str())];
        assert_eq!(rt.block_on(code(&mut client, &victim, 0)), Code::Ok, "{what}");
        let key = backend.key_of("per_user", &victim);
        let node = backend.node_of(&key);
        backend.nodes[node].cmd(&[b"DEL", &key]);
        let command: Vec<&[u8]> = command
            .iter()
            .map(|a| if *a == b"$KEY" { &key[..] } else { *a })
            .collect();
        backend.nodes[node].cmd(&command);
        if *what == "a list" {
            backend.nodes[node].cmd(&[b"PEXPIRE", &key, b"600000"]);
        }

        let (errors_before, timeouts_before) = (errors(&tg, "error"), errors(&tg, "timeout"));
        let status = rt
            .block_on(client.should_rate_limit(support::request("api", &victim, 0)))
            .expect_err(what);
        assert_eq!(status.code(), tonic::Code::Unavailable, "{what}: {status:?}");
        assert_eq!(errors(&tg, "error"), errors_before + 1.0, "{what}");
        assert_eq!(errors(&tg, "timeout"), timeouts_before, "{what}");
        assert!(
            tg.process.exited().is_none(),
            "{what}: tollgate exited\n{}",
            tg.process.log_tail(30)
        );
        assert_eq!(http_get(tg.http_addr, "/healthz").map(|(s, _)| s), Some(200), "{what}");

        // Another descriptor: 2 pass, the third does not.
        let other_value = format!("bystander-{n}");
        let other = [("user", other_value.as_str())];
        for want in [Code::Ok, Code::Ok, Code::OverLimit] {
            assert_eq!(rt.block_on(code(&mut client, &other, 0)), want, "{what}");
        }
        // The corrupt value is left as it was: nothing overwrote it.
        let still = backend.nodes[node].cmd(&[b"TYPE", &key]);
        let want_type = if *what == "a list" { "list" } else { "string" };
        assert_eq!(still, RespValue::Simple(want_type.into()), "{what}");
    }
    assert_eq!(
        Scrape::from(tg.http_addr).counter("tollgate_backend_circuit_open", &[("backend", "redis")]),
        0.0
    );
    assert_eq!(
        http_get(tg.http_addr, "/readyz").map(|(s, _)| s),
        Some(200),
        "the breaker stayed closed"
    );
    backend.assert_every_key_expires();
}

#[test]
fn a_corrupt_bucket_value_is_a_counted_backend_error() {
    corrupt_value_is_a_counted_error(Deployment::Single, "a_corrupt_bucket_value_is_a_counted_backend_error");
}

#[test]
fn a_corrupt_bucket_value_is_a_counted_backend_error_on_a_cluster() {
    corrupt_value_is_a_counted_error(
        Deployment::Cluster,
        "a_corrupt_bucket_value_is_a_counted_backend_error_on_a_cluster",
    );
}

/// A client retrying a descriptor whose stored value is corrupt: every try is UNAVAILABLE, but
/// a corrupt value is a fault of one key, not of Redis, so it must not open the circuit
/// breaker that every other descriptor (and `/readyz`) depends on.
///
/// This failed before `StoreError::Rejected`: every error from the decision script counted as a
/// backend failure, so `breaker_failures` (5) requests in a row for the one poisoned key opened
/// the breaker; then every descriptor was UNAVAILABLE ("redis circuit open") and `/readyz` 503
/// for `breaker_open_ms`, again whenever the probe was that key.
#[test]
fn a_corrupt_bucket_value_does_not_open_the_circuit_for_everyone() {
    let test = "a_corrupt_bucket_value_does_not_open_the_circuit_for_everyone";
    let Some(backend) = Backend::new(Deployment::Single, test) else {
        return;
    };
    let tg = backend.start(
        TWO_PER_HOUR,
        &[
            ("failure_mode", "error"),
            ("breaker_failures", "5"),
            ("breaker_open_ms", "10000"),
        ],
        &[],
    );
    let rt = runtime();
    let mut client = rt.block_on(connect(tg.grpc_addr));
    let victim = [("user", "victim")];
    assert_eq!(rt.block_on(code(&mut client, &victim, 0)), Code::Ok);
    let key = backend.key_of("per_user", &victim);
    backend.nodes[0].cmd(&[b"SET", &key, b"garbage", b"PX", b"600000"]);
    for i in 0..10 {
        let status = rt
            .block_on(client.should_rate_limit(support::request("api", &victim, 0)))
            .expect_err("a corrupt value is no decision");
        assert_eq!(status.code(), tonic::Code::Unavailable, "try {i}: {status:?}");
    }
    let bystander = [("user", "bystander")];
    let answer = rt
        .block_on(client.should_rate_limit(support::request("api", &bystander, 0)))
        .map(|r| overall(&r.into_inner()))
        .map_err(|status| format!("{status:?}"));
    assert_eq!(
        answer,
        Ok(Code::Ok),
        "another descriptor after the corrupt one was retried"
    );
    assert_eq!(
        Scrape::from(tg.http_addr).counter("tollgate_backend_circuit_open", &[("backend", "redis")]),
        0.0
    );
    assert_eq!(http_get(tg.http_addr, "/readyz").map(|(s, _)| s), Some(200));
}

/// A partial failure stays partial with a fallback too: with `failure_mode: fallback` (memory)
/// on a single Redis, a descriptor whose stored value is corrupt is decided on the fallback
/// (for real: two admitted, then denied), and only it: another descriptor is decided on Redis
/// (its key written there), the fallback counts only the poisoned requests, the breaker stays
/// closed and `/readyz` is ready, not degraded.
#[test]
fn a_corrupt_value_with_a_fallback_sends_only_its_own_requests_there() {
    let test = "a_corrupt_value_with_a_fallback_sends_only_its_own_requests_there";
    let Some(backend) = Backend::new(Deployment::Single, test) else {
        return;
    };
    let tg = backend.start(
        TWO_PER_HOUR,
        &[
            ("failure_mode", "fallback"),
            ("fallback", "memory"),
            ("breaker_failures", "2"),
            ("breaker_open_ms", "10000"),
        ],
        &[],
    );
    let rt = runtime();
    let mut client = rt.block_on(connect(tg.grpc_addr));
    let fallbacks = || Scrape::from(tg.http_addr).counter("tollgate_backend_fallbacks_total", &[("backend", "redis")]);
    let victim = [("user", "victim")];
    let key = backend.key_of("per_user", &victim);
    backend.nodes[0].cmd(&[b"SET", &key, b"garbage", b"PX", b"600000"]);
    let codes: Vec<Code> = (0..3).map(|_| rt.block_on(code(&mut client, &victim, 0))).collect();
    assert_eq!(
        codes,
        vec![Code::Ok, Code::Ok, Code::OverLimit],
        "decided on the fallback"
    );
    assert_eq!(fallbacks(), 3.0);
    let bystander = [("user", "bystander")];
    assert_eq!(rt.block_on(code(&mut client, &bystander, 0)), Code::Ok);
    assert_eq!(fallbacks(), 3.0, "the bystander was decided on Redis");
    let written = backend.key_of("per_user", &bystander);
    assert_eq!(backend.nodes[0].cmd(&[b"EXISTS", &written]).as_int(), Some(1));
    assert_eq!(
        Scrape::from(tg.http_addr).counter("tollgate_backend_circuit_open", &[("backend", "redis")]),
        0.0
    );
    assert_eq!(http_get(tg.http_addr, "/readyz"), Some((200, "ready\n".to_string())));
}

/// Concurrent requests on a single node share script calls (`src/store/redis/batch.rs`): 128
/// requests sent at once over one connection take fewer calls than requests, every request is
/// still decided on its own, and a corrupt value refuses only the request that reads it, not
/// the others decided in the same call.
#[test]
fn concurrent_requests_share_calls_and_a_corrupt_value_refuses_only_its_own() {
    let backend = Backend::new(
        Deployment::Private,
        "concurrent_requests_share_calls_and_a_corrupt_value_refuses_only_its_own",
    )
    .expect("a private server");
    let tg = backend.start(TWO_PER_HOUR, &[("failure_mode", "error"), ("pool_size", "1")], &[]);
    let rt = runtime();
    let victim = [("user", "victim")];
    rt.block_on(async {
        let mut client = connect(tg.grpc_addr).await;
        assert_eq!(code(&mut client, &victim, 0).await, Code::Ok);
    });
    let key = backend.key_of("per_user", &victim);
    backend.nodes[0].cmd(&[b"SET", &key, b"garbage", b"PX", b"600000"]);

    let calls_before = backend.evalsha_calls();
    const EACH: usize = 64;
    let (good, bad) = rt.block_on(async {
        let client = connect(tg.grpc_addr).await;
        let good = (0..EACH).map(|i| {
            let mut client = client.clone();
            async move {
                let user = format!("good-{i}");
                let r = client
                    .should_rate_limit(support::request("api", &[("user", user.as_str())], 1))
                    .await;
                r.map(|r| overall(r.get_ref()))
            }
        });
        let bad = (0..EACH).map(|_| {
            let mut client = client.clone();
            async move {
                client
                    .should_rate_limit(support::request("api", &victim, 1))
                    .await
                    .map(|r| overall(r.get_ref()))
            }
        });
        futures_util::join!(
            futures_util::future::join_all(good),
            futures_util::future::join_all(bad)
        )
    });
    let calls_made = backend.evalsha_calls() - calls_before;

    for (i, r) in good.iter().enumerate() {
        assert_eq!(r.as_ref().map_err(|s| s.code()), Ok(&Code::Ok), "good-{i}");
    }
    for r in &bad {
        assert_eq!(
            r.as_ref().map_err(|s| s.code()).err(),
            Some(tonic::Code::Unavailable),
            "{r:?}"
        );
    }
    assert!(
        calls_made < 2 * EACH as u64,
        "{calls_made} script calls for {} requests: no call decided more than one",
        2 * EACH
    );
    // Each good user's bucket holds exactly one token less; the corrupt value is untouched.
    for i in 0..EACH {
        let user = format!("good-{i}");
        let value = backend.nodes[0].cmd(&[b"GET", &backend.key_of("per_user", &[("user", user.as_str())])]);
        let tokens = value
            .as_bytes()
            .filter(|v| v.len() == 24)
            .map(|v| f64::from_le_bytes(v[..8].try_into().expect("8 bytes")));
        assert_eq!(tokens, Some(1e6), "good-{i}: {value:?}");
    }
    assert_eq!(
        backend.nodes[0].cmd(&[b"GET", &key]).as_text().as_deref(),
        Some("garbage")
    );
    backend.assert_every_key_expires();
}

// ---- maxmemory-policy ---------------------------------------------------------------------

/// A Redis whose `maxmemory-policy` can evict keys (`allkeys-lru`) may drop a drained bucket,
/// which then admits again: tollgate says so at start (log) and on `/readyz`, still ready (a
/// setting is no reason to leave Envoy without a rate-limit service), with a short reason that
/// names no host. With `noeviction`, the only safe policy, `/readyz` is plain "ready", and on a
/// Cluster every node is checked.
fn eviction_is_reported(deployment: Deployment, test: &str) {
    let Some(backend) = Backend::new(deployment, test) else {
        return;
    };
    let set_policy = |policy: &str, nodes: &[RedisTarget]| {
        for node in nodes {
            let answer = node.cmd(&[b"CONFIG", b"SET", b"maxmemory-policy", policy.as_bytes()]);
            assert!(matches!(answer, RespValue::Simple(_)), "CONFIG SET: {answer:?}");
        }
    };
    // On a Cluster only the last node evicts: every node must be looked at.
    set_policy("noeviction", &backend.nodes);
    set_policy("allkeys-lru", &backend.nodes[backend.nodes.len() - 1..]);
    let tg = backend.start(ONE_PER_HOUR, &[], &[]);
    let (status, body) = http_get(tg.http_addr, "/readyz").expect("/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("maxmemory-policy allkeys-lru"), "{body}");
    assert!(body.contains("noeviction"), "says what to use: {body}");
    assert!(!body.contains("127.0.0.1"), "names a host: {body}");
    let log = tg.process.log();
    assert!(
        log.contains("maxmemory-policy allkeys-lru"),
        "{}",
        tg.process.log_tail(40)
    );
    drop(tg);

    set_policy("noeviction", &backend.nodes);
    let tg = backend.start(ONE_PER_HOUR, &[], &[]);
    let (status, body) = http_get(tg.http_addr, "/readyz").expect("/readyz");
    assert_eq!((status, body.as_str()), (200, "ready\n"));
}

#[test]
fn an_evicting_maxmemory_policy_is_reported() {
    eviction_is_reported(Deployment::Private, "an_evicting_maxmemory_policy_is_reported");
}

#[test]
fn an_evicting_maxmemory_policy_is_reported_on_a_cluster() {
    eviction_is_reported(
        Deployment::Cluster,
        "an_evicting_maxmemory_policy_is_reported_on_a_cluster",
    );
}
