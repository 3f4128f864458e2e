//! The bucket admin API (peek, refund, reset) and `tollgate bucket`.
//!
//! The acceptance tests run a real `tollgate serve` (decisions over gRPC, the admin API on its
//! own listener, the `tollgate bucket` binary); on the system clock with slow refills (10 per
//! hour: a token every 360 s), so whole-token figures do not move while a test runs. The
//! in-process tests serve [`tollgate::admin::router`] over a limiter on a manual clock, for
//! exact figures and for a failing store.

use crate::support;

use std::net::SocketAddr;
use std::process::Output;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use serde_json::{json, Value};
use support::Tollgate;
use tollgate::admin::{AdminOptions, BucketView, BucketsResponse, PlanKind};
use tollgate::core::bucket::{Demand, MICRO};
use tollgate::core::clock::ManualClock;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::server::settings::Settings;
use tollgate::store::{Applied, BucketRef, MemoryStore, Peeked, Store, StoreError};
use tonic::transport::Channel;

const RULES: &str = r#"
domain: api
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 10, refill: 10/1h}
  - key: plan
    value: free
    name: free_plan
    token_bucket: {capacity: 10, refill: 10/1h}
    quota: {limit: 100, reset: "0 0 1 1 *"}
  - key: health
    unlimited: true
"#;

const HOUR_US: u64 = 3_600_000_000;
/// One token of a 10-per-hour bucket, in microseconds.
const TOKEN_US: u64 = HOUR_US / 10;

// ---- helpers -----------------------------------------------------------------------------

fn start(token: Option<&str>) -> Tollgate {
    let builder = Tollgate::builder().rules_file("api.yaml", RULES);
    let builder = match token {
        Some(token) => builder.env("TOLLGATE_ADMIN__TOKEN", token),
        None => builder,
    };
    tokio::task::block_in_place(|| builder.start())
}

async fn grpc(tg: &Tollgate) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", tg.grpc_addr))
        .await
        .expect("connect to the gRPC listener")
}

/// Asks for `hits` tokens for the descriptor `entries` in domain `api`:
/// `(OK?, limit_remaining)` of its status.
async fn hit(client: &mut RateLimitServiceClient<Channel>, entries: &[(&str, &str)], hits: u32) -> (bool, u32) {
    let request = support::request("api", entries, hits);
    let status = client.should_rate_limit(request).await.unwrap().into_inner().statuses[0].clone();
    (status.code == Code::Ok as i32, status.limit_remaining)
}

/// A request body for `entries` in domain `api`, with `extra` fields (`hits`, `tokens`).
fn body(entries: &[(&str, &str)], extra: Value) -> Value {
    let mut body = json!({
        "domain": "api",
        "descriptor": entries.iter().map(|(k, v)| json!({"key": k, "value": v})).collect::<Vec<_>>(),
    });
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    body
}

/// POSTs `body` (raw, as JSON) to `path` on `addr`: the status and the JSON answer.
async fn post_raw(addr: SocketAddr, path: &str, body: &str, token: Option<&str>) -> (u16, Value) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth));
    }
    send(reqwest::Method::POST, addr, path, body, &headers).await
}

/// Sends `body` to `path` on `addr` with exactly these `headers` (reqwest adds `Host` from
/// `addr` unless one is given): the status and the JSON answer.
async fn send(
    method: reqwest::Method,
    addr: SocketAddr,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let mut call = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .request(method, format!("http://{addr}{path}"))
        .body(body.to_owned());
    for (name, value) in headers {
        call = call.header(*name, *value);
    }
    let response = call.send().await.expect("the admin API answers");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    (status, json)
}

/// POSTs to `/v1/buckets/<op>`; panics unless the answer is 200.
async fn call(addr: SocketAddr, op: &str, body: &Value, token: Option<&str>) -> BucketsResponse {
    let (status, json) = post_raw(addr, &format!("/v1/buckets/{op}"), &body.to_string(), token).await;
    assert_eq!(status, 200, "{op} {body}: {json}");
    serde_json::from_value(json).unwrap()
}

/// The answer's only bucket, or the one named `name`.
fn only(r: &BucketsResponse) -> &BucketView {
    assert_eq!(r.buckets.len(), 1, "{r:?}");
    &r.buckets[0]
}

/// The error message of a non-200 answer with status `want`.
async fn error(addr: SocketAddr, path: &str, body: &str, token: Option<&str>, want: u16) -> String {
    let (status, json) = post_raw(addr, path, body, token).await;
    assert_eq!(status, want, "{path} {body}: {json}");
    json["error"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message: {json}"))
        .to_owned()
}

/// Runs `tollgate bucket <args>` with no `TOLLGATE_*` from the test's environment.
async fn cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.arg("bucket").args(args);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TOLLGATE_") {
            command.env_remove(key);
        }
    }
    command.envs(env.iter().copied());
    command.output().await.expect("run tollgate bucket")
}

fn stdout_json(out: &Output) -> BucketsResponse {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}, stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("stdout is not the answer ({e}): {text}"))
}

// ---- against `tollgate serve` -------------------------------------------------------------

/// An untouched bucket is full; after N hits it holds capacity - N; peeks never change what a
/// sequence of requests gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_shows_the_bucket_and_changes_nothing() {
    let tg = start(None);
    let mut client = grpc(&tg).await;
    let peek = |user: &str| body(&[("user", user)], json!({}));

    let r = call(tg.admin_addr, "peek", &peek("alice"), None).await;
    assert_eq!(
        (r.domain.as_str(), r.rule.as_str(), r.shadow, r.hits),
        ("api", "user", false, Some(1))
    );
    let b = only(&r);
    assert_eq!((b.name.as_str(), b.kind), ("per_user", PlanKind::TokenBucket));
    assert_eq!((b.tokens, b.tokens_micro, b.capacity), (10, 10 * MICRO, 10));
    assert_eq!((b.limit.requests_per_unit, b.limit.unit.as_str()), (10, "HOUR"));
    assert!((b.limit.refill_per_second - 10.0 / 3600.0).abs() < 1e-12);
    assert_eq!((b.full_in_seconds, b.full_in_us), (Some(0), Some(0)));
    let retry = b.retry_after.unwrap();
    assert_eq!((retry.seconds, retry.us), (Some(0), Some(0)));

    // Three hits: 7 left, full again in three tokens' time (less the few ms since).
    for user in ["alice", "bob"] {
        assert_eq!(hit(&mut client, &[("user", user)], 3).await, (true, 7));
    }
    let b = only(&call(tg.admin_addr, "peek", &peek("alice"), None).await).clone();
    assert_eq!((b.tokens, b.capacity), (7, 10));
    assert!(b.tokens_micro >= 7 * MICRO && b.tokens_micro < 8 * MICRO);
    let full_in = b.full_in_us.unwrap();
    assert!(
        full_in <= 3 * TOKEN_US && full_in > 3 * TOKEN_US - 60_000_000,
        "{full_in}"
    );
    assert_eq!(b.full_in_seconds, Some(full_in.div_ceil(1_000_000)));

    // Peek alice twice more; then alice (peeked) and bob (never peeked) get the same answers.
    call(tg.admin_addr, "peek", &peek("alice"), None).await;
    call(
        tg.admin_addr,
        "peek",
        &body(&[("user", "alice")], json!({"hits": 10})),
        None,
    )
    .await;
    let mut answers = Vec::new();
    for user in ["alice", "bob"] {
        let mut got = Vec::new();
        for _ in 0..9 {
            got.push(hit(&mut client, &[("user", user)], 1).await);
        }
        answers.push(got);
    }
    assert_eq!(answers[0], answers[1]);
    assert_eq!(answers[0][6], (true, 0));
    assert_eq!(answers[0][7], (false, 0));
}

/// Retry-after for n tokens, refunds (capped at capacity) and reset, each checked against the
/// decisions that follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_refund_and_reset() {
    let tg = start(None);
    let mut client = grpc(&tg).await;
    let carol = [("user", "carol")];
    assert_eq!(hit(&mut client, &carol, 10).await, (true, 0));

    // Empty: n tokens come back after n x 360 s (less the few ms since the drain).
    for n in [1u64, 3, 10] {
        let r = call(tg.admin_addr, "peek", &body(&carol, json!({"hits": n})), None).await;
        assert_eq!(r.hits, Some(n));
        let retry = only(&r).retry_after.unwrap();
        let us = retry.us.unwrap();
        assert!(us <= n * TOKEN_US && us > n * TOKEN_US - 60_000_000, "{n}: {us}");
        assert_eq!(retry.seconds, Some(us.div_ceil(1_000_000)));
    }
    // More than the capacity never passes.
    let r = call(tg.admin_addr, "peek", &body(&carol, json!({"hits": 11})), None).await;
    assert_eq!(only(&r).retry_after.unwrap().seconds, None);

    // Refund 4: four requests pass, the fifth does not.
    let r = call(tg.admin_addr, "refund", &body(&carol, json!({"tokens": 4})), None).await;
    let b = only(&r);
    assert_eq!((b.tokens, b.capacity, b.retry_after), (4, 10, None));
    assert_eq!(r.hits, None);
    assert_eq!(hit(&mut client, &carol, 4).await, (true, 0));
    assert_eq!(hit(&mut client, &carol, 1).await, (false, 0));

    // A refund beyond the capacity fills the bucket exactly, no more.
    let r = call(tg.admin_addr, "refund", &body(&carol, json!({"tokens": 1000})), None).await;
    let b = only(&r);
    assert_eq!((b.tokens, b.tokens_micro, b.full_in_us), (10, 10 * MICRO, Some(0)));
    let r = call(
        tg.admin_addr,
        "refund",
        &body(&carol, json!({"tokens": u64::MAX})),
        None,
    )
    .await;
    assert_eq!(only(&r).tokens_micro, 10 * MICRO);
    assert_eq!(
        hit(&mut client, &carol, 11).await,
        (false, 10),
        "never more than the capacity"
    );
    assert_eq!(hit(&mut client, &carol, 10).await, (true, 0));

    // Reset: full again.
    let r = call(tg.admin_addr, "reset", &body(&carol, json!({})), None).await;
    let b = only(&r);
    assert_eq!(
        (b.tokens, b.tokens_micro, b.full_in_seconds, b.retry_after),
        (10, 10 * MICRO, Some(0), None)
    );
    let peeked = only(&call(tg.admin_addr, "peek", &body(&carol, json!({})), None).await).clone();
    assert_eq!(peeked.tokens_micro, 10 * MICRO);
    assert_eq!(hit(&mut client, &carol, 10).await, (true, 0));
    assert_eq!(hit(&mut client, &carol, 1).await, (false, 0));
}

/// A rule with a quota beside its token bucket: both instances, in that order, through every
/// operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_beside_a_bucket_shows_both() {
    let tg = start(None);
    let mut client = grpc(&tg).await;
    let free = [("plan", "free")];
    assert_eq!(hit(&mut client, &free, 2).await, (true, 8));
    let summary = |r: &BucketsResponse| {
        r.buckets
            .iter()
            .map(|b| (b.name.clone(), b.kind, b.tokens, b.capacity))
            .collect::<Vec<_>>()
    };
    let both = |bucket: u64, quota: u64| {
        vec![
            ("free_plan".to_owned(), PlanKind::TokenBucket, bucket, 10),
            ("free_plan.quota".to_owned(), PlanKind::Quota, quota, 100),
        ]
    };
    let r = call(tg.admin_addr, "peek", &body(&free, json!({"hits": 9})), None).await;
    assert_eq!(r.rule, "plan=free");
    assert_eq!(summary(&r), both(8, 98));
    let quota = &r.buckets[1];
    assert_eq!(quota.limit.requests_per_unit, 100);
    assert_eq!(quota.limit.unit, "YEAR");
    assert_eq!(quota.limit.refill_per_second, 0.0);
    assert!(quota.full_in_seconds.unwrap() > 0, "full again at the next reset");
    assert_eq!(quota.retry_after.unwrap().seconds, Some(0));
    assert!(r.buckets[0].retry_after.unwrap().seconds.unwrap() > 0);

    let r = call(tg.admin_addr, "refund", &body(&free, json!({"tokens": 1})), None).await;
    assert_eq!(summary(&r), both(9, 99));
    let r = call(tg.admin_addr, "reset", &body(&free, json!({})), None).await;
    assert_eq!(summary(&r), both(10, 100));
    assert_eq!(hit(&mut client, &free, 10).await, (true, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_addresses_no_bucket_is_404_and_bad_requests_are_400() {
    let tg = start(None);
    let addr = tg.admin_addr;
    let peek = "/v1/buckets/peek";
    let req = |domain: &str, key: &str, value: &str| {
        json!({"domain": domain, "descriptor": [{"key": key, "value": value}]}).to_string()
    };
    let msg = error(addr, peek, &req("nope", "user", "a"), None, 404).await;
    assert!(msg.contains("unknown domain"), "{msg}");
    let msg = error(addr, peek, &req("api", "nobody", "a"), None, 404).await;
    assert!(msg.contains("no rule"), "{msg}");
    let msg = error(addr, peek, &req("api", "health", "x"), None, 404).await;
    assert!(msg.contains("unlimited"), "{msg}");
    for op in ["refund", "reset"] {
        let path = format!("/v1/buckets/{op}");
        let body = json!({"domain": "api", "descriptor": [{"key": "health", "value": "x"}], "tokens": 1});
        let mut body = body.as_object().unwrap().clone();
        if op == "reset" {
            body.remove("tokens");
        }
        error(addr, &path, &Value::Object(body).to_string(), None, 404).await;
    }

    let user = r#"[{"key": "user", "value": "a"}]"#;
    for (path, bad) in [
        (peek, "{".to_owned()),
        (peek, "".to_owned()),
        (peek, "[]".to_owned()),
        (peek, r#"{"domain": "api"}"#.to_owned()),
        (peek, format!(r#"{{"descriptor": {user}}}"#)),
        (peek, format!(r#"{{"domain": "", "descriptor": {user}}}"#)),
        (peek, r#"{"domain": "api", "descriptor": []}"#.to_owned()),
        (
            peek,
            r#"{"domain": "api", "descriptor": [{"key": "", "value": "a"}]}"#.to_owned(),
        ),
        (peek, r#"{"domain": "api", "descriptor": [{"key": "user"}]}"#.to_owned()),
        (peek, format!(r#"{{"domain": "api", "descriptor": {user}, "hits": 0}}"#)),
        (
            peek,
            format!(r#"{{"domain": "api", "descriptor": {user}, "hits": -1}}"#),
        ),
        (
            peek,
            format!(r#"{{"domain": "api", "descriptor": {user}, "tokens": 1}}"#),
        ),
        (peek, format!(r#"{{"domain": "api", "descriptor": {user}, "hit": 1}}"#)),
        (
            "/v1/buckets/refund",
            format!(r#"{{"domain": "api", "descriptor": {user}}}"#),
        ),
        (
            "/v1/buckets/refund",
            format!(r#"{{"domain": "api", "descriptor": {user}, "tokens": 0}}"#),
        ),
        (
            "/v1/buckets/refund",
            format!(r#"{{"domain": "api", "descriptor": {user}, "tokens": 1.5}}"#),
        ),
        (
            "/v1/buckets/reset",
            format!(r#"{{"domain": "api", "descriptor": {user}, "tokens": 1}}"#),
        ),
    ] {
        error(addr, path, &bad, None, 400).await;
    }
    // Other paths and methods.
    error(addr, "/v1/buckets/drain", &req("api", "user", "a"), None, 404).await;
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("http://{addr}{peek}"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 405);
    // Bodies over the limit.
    let huge = "x".repeat(tollgate::admin::MAX_BODY_BYTES + 1);
    error(addr, peek, &huge, None, 413).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_token_is_required() {
    let tg = start(Some("s3cret"));
    let addr = tg.admin_addr;
    let peek = body(&[("user", "dave")], json!({})).to_string();
    for token in [None, Some("wrong"), Some("s3cre"), Some("s3crets"), Some("")] {
        let msg = error(addr, "/v1/buckets/peek", &peek, token, 401).await;
        assert!(msg.contains("token"), "{msg}");
    }
    // Unauthorized comes before anything else is looked at.
    error(addr, "/v1/buckets/reset", "{", None, 401).await;
    let (status, _) = post_raw(addr, "/v1/buckets/peek", &peek, Some("s3cret")).await;
    assert_eq!(status, 200);

    // The CLI: --token, or the same variable the server reads.
    let admin = addr.to_string();
    let args = ["peek", "--domain", "api", "--entry", "user=dave", "--admin", &admin];
    let out = cli(&args, &[]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
    let out = cli(&[&args[..], &["--token", "s3cret"]].concat(), &[]).await;
    assert_eq!(only(&stdout_json(&out)).tokens, 10);
    let out = cli(&args, &[("TOLLGATE_ADMIN__TOKEN", "s3cret")]).await;
    assert_eq!(only(&stdout_json(&out)).tokens, 10);
}

/// `tollgate bucket peek|refund|reset`: JSON on stdout and exit 0, or the server's message and
/// exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_peeks_refunds_and_resets() {
    let tg = start(None);
    let mut client = grpc(&tg).await;
    let admin = tg.admin_addr.to_string();
    // A value may hold `=`: split at the first.
    let erin = [("user", "erin=ops")];
    assert_eq!(hit(&mut client, &erin, 6).await, (true, 4));
    let target = ["--domain", "api", "--entry", "user=erin=ops", "--admin", &admin];

    let out = cli(&[&["peek"], &target[..], &["--hits", "5"]].concat(), &[]).await;
    let r = stdout_json(&out);
    assert_eq!(r.descriptor[0].value, "erin=ops");
    assert_eq!(r.hits, Some(5));
    let b = only(&r);
    assert_eq!((b.tokens, b.capacity), (4, 10));
    assert!(b.retry_after.unwrap().seconds.unwrap() > 0);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\n  \"domain\": \"api\""), "pretty-printed: {text}");
    assert!(
        text.find("\"domain\"") < text.find("\"buckets\""),
        "in the documented order: {text}"
    );

    let r = stdout_json(&cli(&[&["refund"], &target[..], &["--tokens", "3"]].concat(), &[]).await);
    assert_eq!(only(&r).tokens, 7);
    assert_eq!(hit(&mut client, &erin, 1).await, (true, 6));

    // The address also comes from TOLLGATE_ADMIN__ADDR.
    let env_target = ["reset", "--domain", "api", "--entry", "user=erin=ops"];
    let r = stdout_json(&cli(&env_target, &[("TOLLGATE_ADMIN__ADDR", &admin)]).await);
    assert_eq!(only(&r).tokens, 10);
    assert_eq!(hit(&mut client, &erin, 10).await, (true, 0));

    // The server's error, exit 1.
    let out = cli(
        &["peek", "--domain", "nope", "--entry", "user=x", "--admin", &admin],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unknown domain \"nope\"") && stderr.contains("404"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    let out = cli(
        &["reset", "--domain", "api", "--entry", "health=x", "--admin", &admin],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unlimited"));
}

/// Nothing listening: a clear message naming the address, exit 1.
#[tokio::test]
async fn the_cli_says_when_it_cannot_reach_the_server() {
    let admin = format!("127.0.0.1:{}", support::free_port());
    let out = cli(
        &["peek", "--domain", "api", "--entry", "user=x", "--admin", &admin],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("cannot reach the admin API at http://{admin}/v1/buckets/peek")),
        "{stderr}"
    );
    assert!(stderr.contains("refused"), "{stderr}");
    // Refused before anything is sent: a refund without --tokens, an entry without `=`.
    let out = cli(
        &["refund", "--domain", "api", "--entry", "user=x", "--admin", &admin],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    let out = cli(&["peek", "--domain", "api", "--entry", "user", "--admin", &admin], &[]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("KEY=VALUE"));
}

// ---- in-process, on a manual clock ------------------------------------------------------

const T0: u64 = 1_700_000_000_000_000;

/// A limiter over `store` and the test rules.
fn limiter_over<S: Store>(store: S) -> Limiter<S> {
    limiter_with(RULES, store)
}

/// A limiter over `store` and the rules file `rules` (YAML).
fn limiter_with<S: Store>(rules: &str, store: S) -> Limiter<S> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, rules).unwrap();
    let rules = tollgate::rules::load_rules(&file).unwrap();
    Limiter::new(rules, store, LimiterOptions::from_settings(&Settings::default()))
}

/// Serves the admin router over a limiter on `store` on a loopback port, for as long as the
/// test's runtime runs.
async fn serve_in_process<S: Store>(store: S) -> (SocketAddr, Arc<Limiter<S>>) {
    serve_with(store, AdminOptions::default()).await
}

/// [`serve_in_process`] with these options.
async fn serve_with<S: Store>(store: S, options: AdminOptions) -> (SocketAddr, Arc<Limiter<S>>) {
    serve_limiter(Arc::new(limiter_over(store)), options).await
}

/// Serves the admin router over `limiter` on a loopback port.
async fn serve_limiter<S: Store>(limiter: Arc<Limiter<S>>, options: AdminOptions) -> (SocketAddr, Arc<Limiter<S>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = tollgate::admin::router(limiter.clone(), options);
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, limiter)
}

fn decide_request(user: &str, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: "api".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: user.into(),
            }],
            ..Default::default()
        }],
        hits_addend: hits,
    }
}

/// Exact figures: tokens in micro-tokens, time to full and retry-after in microseconds, as
/// the clock moves; and whole responses (headers included) identical with and without peeks.
#[tokio::test]
async fn exact_figures_on_a_manual_clock() {
    let clock = ManualClock::new(T0);
    let (addr, limiter) = serve_in_process(MemoryStore::new(4, 1000, Arc::new(clock.clone()))).await;
    let twin = limiter_over(MemoryStore::new(4, 1000, Arc::new(clock.clone())));
    let both = |hits: u32| {
        let (limiter, twin) = (limiter.clone(), &twin);
        async move {
            let a = limiter.should_rate_limit(&decide_request("u", hits)).await.unwrap();
            let b = twin.should_rate_limit(&decide_request("u", hits)).await.unwrap();
            assert_eq!(a, b, "a peeked bucket decides as one never peeked");
            a.overall_code == Code::Ok as i32
        }
    };
    let peek = |hits: u64| body(&[("user", "u")], json!({"hits": hits}));
    let figures = |r: &BucketsResponse| {
        let b = only(r);
        let retry = b.retry_after.unwrap();
        (b.tokens_micro, b.full_in_us, retry.us, retry.seconds)
    };

    assert!(both(3).await);
    let r = call(addr, "peek", &peek(8), None).await;
    assert_eq!(r.now_us, T0);
    assert_eq!(figures(&r), (7 * MICRO, Some(3 * TOKEN_US), Some(TOKEN_US), Some(360)));
    clock.advance_us(TOKEN_US / 2);
    let r = call(addr, "peek", &peek(8), None).await;
    assert_eq!(r.now_us, T0 + TOKEN_US / 2);
    assert_eq!(
        figures(&r),
        (
            7 * MICRO + MICRO / 2,
            Some(5 * TOKEN_US / 2),
            Some(TOKEN_US / 2),
            Some(180)
        )
    );
    // One microsecond early, 8 do not pass; at the retry-after they do.
    clock.advance_us(TOKEN_US / 2 - 1);
    call(addr, "peek", &peek(8), None).await;
    assert!(!both(8).await);
    clock.advance_us(1);
    assert_eq!(figures(&call(addr, "peek", &peek(8), None).await).2, Some(0));
    call(addr, "peek", &peek(1), None).await;
    assert!(both(8).await);
    assert!(!both(1).await);

    // Refund and reset, exact.
    let r = call(addr, "refund", &body(&[("user", "u")], json!({"tokens": 2})), None).await;
    assert_eq!(
        (only(&r).tokens_micro, only(&r).full_in_us),
        (2 * MICRO, Some(8 * TOKEN_US))
    );
    let r = call(addr, "reset", &body(&[("user", "u")], json!({})), None).await;
    assert_eq!((only(&r).tokens_micro, only(&r).full_in_us), (10 * MICRO, Some(0)));
    assert!(limiter.store().is_empty());
}

/// A usage budget, [`support::LLM_BUDGET_RULES`].
const BUDGET_RULES: &str = support::LLM_BUDGET_RULES;

/// A debt bucket as a peek shows it: `tokens` and `capacity` as clients are told them (the
/// balance, 0 while in debt, as `limit_remaining`; the capacity as declared), the signed
/// balance and the floor, and a `retry_after` that is when the request-path check passes
/// again, whatever `hits` (a usage report is admitted as soon as the balance is positive). The
/// stores keep a debt bucket's tokens as its balance plus the floor's depth, which a peek must
/// not show as they are: that read 800 tokens of 2,000, and no wait at all, for a tenant 200
/// tokens in debt.
#[tokio::test]
async fn a_debt_bucket_shows_its_balance_and_floor() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::new(4, 1000, Arc::new(clock.clone()));
    let (addr, limiter) = serve_limiter(Arc::new(limiter_with(BUDGET_RULES, store)), AdminOptions::default()).await;
    let request = |hits: u64| RateLimitRequest {
        domain: "llm".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tenant".into(),
                value: "acme".into(),
            }],
            hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: hits }),
            ..Default::default()
        }],
        hits_addend: 0,
    };
    let admitted = |hits: u64| {
        let limiter = limiter.clone();
        async move { limiter.should_rate_limit(&request(hits)).await.unwrap().overall_code == Code::Ok as i32 }
    };
    // The raw JSON: the fields of a debt bucket, and of no other.
    let peek = |hits: u64| async move {
        let body = json!({"domain": "llm", "descriptor": [{"key": "tenant", "value": "acme"}], "hits": hits});
        let (status, json) = post_raw(addr, "/v1/buckets/peek", &body.to_string(), None).await;
        assert_eq!(status, 200, "{json}");
        json["buckets"][0].clone()
    };
    let figures = |b: &Value| {
        (
            b["tokens"].as_u64(),
            b["tokens_micro"].as_u64(),
            b["capacity"].as_u64(),
            b["balance_micro"].as_i64(),
            b["debt_floor"].as_i64(),
        )
    };
    const M: i64 = MICRO as i64;

    let full = peek(1).await;
    assert_eq!(
        figures(&full),
        (Some(1000), Some(1000 * MICRO), Some(1000), Some(1000 * M), Some(-1000)),
        "{full}"
    );
    assert_eq!(full["full_in_us"], json!(0));
    assert_eq!(full["retry_after"], json!({"seconds": 0, "us": 0}));

    // A report of 1,200 leaves the balance 200 below zero: 0 as clients are told it, 12 s and a
    // micro-token's time (60 ns, rounded up to 1 us) from positive at 1,000 a minute, 72 s and
    // as much from full.
    assert!(admitted(1200).await, "the balance was positive before the report");
    assert!(!admitted(0).await, "in debt, the request-path check is denied");
    for hits in [1, 5000] {
        let b = peek(hits).await;
        assert_eq!(
            figures(&b),
            (Some(0), Some(0), Some(1000), Some(-200 * M), Some(-1000)),
            "{b}"
        );
        assert_eq!(b["full_in_us"], json!(72_000_000), "{b}");
        assert_eq!(
            b["retry_after"],
            json!({"seconds": 13, "us": 12_000_001}),
            "hits {hits}: {b}"
        );
    }
    // At exactly 0 the check is still denied and the peek says one microsecond more; then both
    // agree that it passes.
    clock.advance_us(12_000_000);
    assert_eq!(figures(&peek(1).await).3, Some(0));
    assert_eq!(peek(1).await["retry_after"]["us"], json!(1));
    assert!(!admitted(0).await);
    clock.advance_us(1);
    assert_eq!(peek(1).await["retry_after"]["us"], json!(0));
    assert!(admitted(0).await);
    // A reset makes the balance the capacity again.
    let reset = json!({"domain": "llm", "descriptor": [{"key": "tenant", "value": "acme"}]});
    let r = call(addr, "reset", &reset, None).await;
    let b = only(&r);
    assert_eq!(
        (b.tokens, b.capacity, b.balance_micro, b.debt_floor),
        (1000, 1000, Some(1000 * M), Some(-1000))
    );

    // An ordinary bucket has neither field.
    let (plain, _) = serve_in_process(MemoryStore::new(4, 1000, Arc::new(clock.clone()))).await;
    let (status, json) = post_raw(
        plain,
        "/v1/buckets/peek",
        &body(&[("user", "u")], json!({})).to_string(),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let bucket = json["buckets"][0].as_object().expect("a bucket");
    assert!(
        !bucket.contains_key("balance_micro") && !bucket.contains_key("debt_floor"),
        "{json}"
    );
}

/// A store that fails every call.
struct Broken;

impl Store for Broken {
    async fn apply(&self, _: &[BucketRef], _: &[Demand]) -> Result<Applied, StoreError> {
        Err(StoreError::Unavailable("down for the test".into()))
    }

    async fn peek(&self, _: &[BucketRef]) -> Result<Peeked, StoreError> {
        Err(StoreError::Unavailable("down for the test".into()))
    }

    async fn reset(&self, _: &[BucketRef]) -> Result<Peeked, StoreError> {
        Err(StoreError::Unavailable("down for the test".into()))
    }
}

#[tokio::test]
async fn a_failing_store_is_503() {
    let (addr, _) = serve_in_process(Broken).await;
    for (op, extra) in [
        ("peek", json!({})),
        ("refund", json!({"tokens": 1})),
        ("reset", json!({})),
    ] {
        let body = body(&[("user", "u")], extra).to_string();
        let msg = error(addr, &format!("/v1/buckets/{op}"), &body, None, 503).await;
        assert!(msg.contains("down for the test"), "{msg}");
    }
    // What addresses no bucket never reaches the store.
    error(
        addr,
        "/v1/buckets/peek",
        &body(&[("health", "x")], json!({})).to_string(),
        None,
        404,
    )
    .await;
}

// ---- a closed surface ----------------------------------------------------------------------

/// The tokens of `user=u` as a peek from the admin listener itself shows them.
async fn tokens_of(addr: SocketAddr) -> u64 {
    only(&call(addr, "peek", &body(&[("user", "u")], json!({})), None).await).tokens
}

/// A page in an operator's browser can send a form or `text/plain` to a loopback listener
/// without asking, and through DNS rebinding reach it under its own name and read the
/// answers: without a token, it could refund or reset any bucket. Every state-changing
/// request must be JSON (415 otherwise), every request must name the listener in `Host`, and
/// one with an `Origin` other than the listener is refused; nothing is changed by a refusal.
#[tokio::test]
async fn a_browser_page_cannot_reach_the_admin_api() {
    let clock = ManualClock::new(T0);
    let options = AdminOptions {
        allowed_hosts: vec!["Tollgate-Admin.ops.svc".into()],
        config: Some(Arc::new(|| json!({"settings": {"rules": "secret-api-key-value"}}))),
        ..AdminOptions::default()
    };
    let (addr, limiter) = serve_with(MemoryStore::new(4, 1000, Arc::new(clock.clone())), options).await;
    limiter.should_rate_limit(&decide_request("u", 4)).await.unwrap();
    assert_eq!(tokens_of(addr).await, 6);
    let refund = body(&[("user", "u")], json!({"tokens": 4})).to_string();
    let reset = body(&[("user", "u")], json!({})).to_string();
    let post = |path: &'static str, body: String, headers: Vec<(&'static str, String)>| async move {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        send(reqwest::Method::POST, addr, path, &body, &headers).await
    };
    // What a form or a no-cors fetch can send.
    for content_type in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
    ] {
        let headers: Vec<(&str, String)> = content_type
            .map(|c| ("content-type", c.to_owned()))
            .into_iter()
            .collect();
        for (path, body) in [
            ("/v1/buckets/refund", &refund),
            ("/v1/buckets/reset", &reset),
            ("/v1/buckets/peek", &reset),
        ] {
            let (status, json) = post(path, body.clone(), headers.clone()).await;
            assert_eq!(status, 415, "{path} as {content_type:?}: {json}");
            assert!(json["error"].as_str().unwrap().contains("application/json"), "{json}");
        }
    }
    assert_eq!(tokens_of(addr).await, 6, "a refused refund or reset changes nothing");
    // DNS rebinding: the page's own name in Host; also for reads (peeks, /config).
    let json_type = ("content-type", "application/json".to_owned());
    for host in [
        "evil.example",
        "evil.example:8082",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "",
    ] {
        let (status, json) = post(
            "/v1/buckets/reset",
            reset.clone(),
            vec![json_type.clone(), ("host", host.to_owned())],
        )
        .await;
        assert_eq!(status, 403, "Host {host:?}: {json}");
        let (status, json) = post(
            "/v1/buckets/peek",
            reset.clone(),
            vec![json_type.clone(), ("host", host.to_owned())],
        )
        .await;
        assert_eq!(status, 403, "peek with Host {host:?}: {json}");
        let (status, json) = send(reqwest::Method::GET, addr, "/config", "", &[("host", host)]).await;
        assert_eq!(status, 403, "/config with Host {host:?}: {json}");
        assert!(!json.to_string().contains("secret-api-key-value"));
    }
    assert_eq!(tokens_of(addr).await, 6);
    // A cross-site page: a foreign Origin, even with JSON (which a browser sends only after a
    // preflight this listener never grants).
    for origin in [
        "http://evil.example",
        "null",
        "http://localhost:1",
        "https://evil.example:443",
    ] {
        let (status, json) = post(
            "/v1/buckets/refund",
            refund.clone(),
            vec![json_type.clone(), ("origin", origin.to_owned())],
        )
        .await;
        assert_eq!(status, 403, "Origin {origin}: {json}");
    }
    let (status, _) = send(
        reqwest::Method::OPTIONS,
        addr,
        "/v1/buckets/refund",
        "",
        &[
            ("origin", "http://evil.example"),
            ("access-control-request-method", "POST"),
        ],
    )
    .await;
    assert_ne!(status, 200, "no preflight is granted");
    assert_eq!(tokens_of(addr).await, 6);
    // The listener's names: any IP address, localhost, an allowed name, on any port (a
    // port-forward picks its own); a same-origin Origin.
    for host in [
        addr.to_string(),
        "localhost:9999".into(),
        "LOCALHOST".into(),
        "[::1]:8082".into(),
        "10.0.0.7:8082".into(),
        "tollgate-admin.ops.svc:8082".into(),
        "tollgate-admin.ops.svc.".into(),
    ] {
        let (status, json) = post(
            "/v1/buckets/peek",
            reset.clone(),
            vec![json_type.clone(), ("host", host.clone())],
        )
        .await;
        assert_eq!(status, 200, "Host {host}: {json}");
    }
    let (status, json) = post(
        "/v1/buckets/refund",
        refund.clone(),
        vec![json_type.clone(), ("origin", format!("http://{addr}"))],
    )
    .await;
    assert_eq!(status, 200, "same origin: {json}");
    let (status, json) = post(
        "/v1/buckets/refund",
        refund.clone(),
        vec![("content-type", "Application/JSON; charset=utf-8".into())],
    )
    .await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(tokens_of(addr).await, 10);
    let (status, json) = send(reqwest::Method::GET, addr, "/config", "", &[]).await;
    assert_eq!(
        (status, json["settings"]["rules"].as_str()),
        (200, Some("secret-api-key-value"))
    );
}

/// `/config` shows rule values (which can be API keys) and backend hosts: it is on the admin
/// listener, behind its token, and gone from the public HTTP port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_is_on_the_admin_listener_only() {
    let tg = start(Some("8675309"));
    let (status, _) = tokio::task::block_in_place(|| support::http_get(tg.http_addr, "/config")).unwrap();
    assert_eq!(status, 404, "/config on the public HTTP port");
    let (status, _) = tokio::task::block_in_place(|| support::http_get(tg.admin_addr, "/config")).unwrap();
    assert_eq!(status, 401, "/config without the token");
    let (status, body) = tokio::task::block_in_place(|| tg.config()).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("per_user") && !body.contains("8675309"), "{body}");
    // A token that looks like a number is the string: the CLI, with the server's variable.
    let admin = tg.admin_addr.to_string();
    let args = ["peek", "--domain", "api", "--entry", "user=erin", "--admin", &admin];
    let out = cli(&args, &[("TOLLGATE_ADMIN__TOKEN", "8675309")]).await;
    assert_eq!(only(&stdout_json(&out)).tokens, 10);
    let log = tg.process.log();
    assert!(!log.contains("8675309"), "the log shows the token: {log}");
}

/// Without a token, an admin listener beyond loopback would let anyone who reaches it reset
/// every bucket: `serve` refuses to start, naming the settings. And a secret that is wrong is
/// refused without being shown.
#[tokio::test]
async fn serve_refuses_an_open_admin_listener_and_never_shows_a_secret() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("api.yaml"), RULES).unwrap();
    let rules = dir.path().join("api.yaml").to_string_lossy().into_owned();
    let serve = |env: &[(&str, &str)]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command.arg("serve").arg("--rules").arg(&rules).current_dir(dir.path());
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("TOLLGATE_") {
                command.env_remove(key);
            }
        }
        let port = support::free_port();
        command
            .env("TOLLGATE_GRPC_ADDR", format!("127.0.0.1:{}", support::free_port()))
            .env("TOLLGATE_HTTP_ADDR", format!("127.0.0.1:{port}"))
            .envs(env.iter().copied())
            .kill_on_drop(true);
        async move {
            tokio::time::timeout(std::time::Duration::from_secs(60), command.output())
                .await
                .expect("serve exits within a minute")
                .expect("run tollgate serve")
        }
    };
    let open = format!("0.0.0.0:{}", support::free_port());
    let out = serve(&[("TOLLGATE_ADMIN__ADDR", &open)]).await;
    let err = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("admin.addr") && err.contains("admin.token") && err.contains(&open),
        "{err}"
    );
    for env in [
        &[("TOLLGATE_ADMIN__TOKEN", " Zq8675309secret")][..],
        &[("TOLLGATE_POSTGRES", "{password=[Zq8675309secret]}")][..],
        &[
            ("TOLLGATE_BACKEND", "postgres"),
            ("TOLLGATE_POSTGRES__URL", "mysql://u:Zq8675309secret@db.internal/x"),
        ][..],
    ] {
        let out = serve(env).await;
        let err = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{env:?}: {err}");
        assert!(!err.contains("Zq8675309secret"), "{env:?} shows the secret: {err}");
    }
}
