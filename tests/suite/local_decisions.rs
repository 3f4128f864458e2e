// The tests that load the machine hold a std Mutex across awaits on purpose: it only keeps
// them from running at the same time, and no task ever waits on it from the same thread.
#![allow(clippy::await_holding_lock)]
//! What replicas on a shared backend decide without a store call (docs/backends.md, "Deciding
//! locally"), on real `tollgate serve` processes and a private `redis-server` whose own
//! `INFO commandstats` counts the script calls: a flood on an exhausted bucket costs under 1 %
//! of its denials in store calls and admits exactly what the store alone would; a hot bucket
//! with a lease is decided mostly without the store, never over-admits, and gets its unspent
//! tokens back at the end of a hold and at shutdown; Postgres gets the same cache.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use serde_json::{json, Value};
use support::faults::{connect, one_at_a_time, scrape};
use support::redis::{info_commandstats, unique_prefix, RedisServer};
use support::{request, yaml_str, Tollgate};
use tokio::task::block_in_place;
use tollgate::core::bucket::MICRO;

/// One user's bucket: 5 tokens, one a second.
const FLOOD_RULES: &str = "domain: flood\ndescriptors:\n  - key: user\n    token_bucket: {capacity: 5, refill: 1/s}\n";

/// A bucket every request shares: 1,000 tokens, one a second, leased 50 at a time.
const HOT_RULES: &str =
    "domain: hot\ndescriptors:\n  - key: route\n    token_bucket: {capacity: 1000, refill: 1/s, lease: 50}\n";

/// EVALSHA calls the server has answered so far.
fn script_calls(redis: &RedisServer) -> u64 {
    info_commandstats(redis.target())
        .get("evalsha")
        .map_or(0, |(calls, _)| *calls)
}

/// A replica on `redis` under `prefix` with `rules` (file `rules.yaml`) and `more` settings.
fn replica(redis: &RedisServer, prefix: &str, rules: &str, more: &str) -> Tollgate {
    let settings = format!(
        "backend: redis\nredis:\n  urls: [{}]\n  key_prefix: {}\n  command_timeout_ms: 1000\n  connect_timeout_ms: 5000\n\
         shutdown: {{drain_seconds: 0}}\n{more}",
        yaml_str(&redis.url()),
        yaml_str(prefix)
    );
    block_in_place(|| {
        Tollgate::builder()
            .rules_file("rules.yaml", rules)
            .settings(&settings)
            .start()
    })
}

/// What a load saw: answers by code, and when the first and last were sent.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    denied: AtomicU64,
    /// Denials without `retry-after: 1` (a bucket of one token a second always has one).
    wrong_wait: AtomicU64,
}

/// `clients` callers per replica, each sending `domain` requests on `entries` one after
/// another until `until` or `max` requests in all; every answer must be OK or OVER_LIMIT.
async fn load(
    replicas: &[&Tollgate],
    clients: usize,
    domain: &'static str,
    entries: &'static [(&'static str, &'static str)],
    until: Instant,
    max: u64,
) -> Arc<Tally> {
    let tally = Arc::new(Tally::default());
    let sent = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for replica in replicas {
        for _ in 0..clients {
            let mut client = connect(replica).await;
            let (tally, sent) = (tally.clone(), sent.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until && sent.fetch_add(1, Ordering::Relaxed) < max {
                    let resp: RateLimitResponse = client
                        .should_rate_limit(request(domain, entries, 0))
                        .await
                        .expect("an answer")
                        .into_inner();
                    if resp.overall_code == Code::Ok as i32 {
                        tally.admitted.fetch_add(1, Ordering::Relaxed);
                    } else {
                        assert_eq!(resp.overall_code, Code::OverLimit as i32, "{resp:?}");
                        tally.denied.fetch_add(1, Ordering::Relaxed);
                        let wait = resp
                            .response_headers_to_add
                            .iter()
                            .find(|h| h.key.eq_ignore_ascii_case("retry-after"));
                        if wait.is_none_or(|h| h.value != "1") {
                            tally.wrong_wait.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("a load task");
    }
    tally
}

fn counter(tollgate: &Tollgate, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape(tollgate).counter(name, labels)
}

/// A flood on one exhausted bucket from two replicas: the script calls beyond one per admission
/// are under 1 % of the denials (Redis's own count), the admissions are exactly what the bucket
/// holds (its capacity, then a token a second), and every denial, local or not, carries the
/// store's `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_on_an_exhausted_bucket_costs_under_one_percent_of_its_denials_in_script_calls() {
    let _one = one_at_a_time();
    let redis = block_in_place(RedisServer::start);
    let prefix = unique_prefix("flood");
    let a = replica(&redis, &prefix, FLOOD_RULES, "");
    let b = replica(&redis, &prefix, FLOOD_RULES, "");
    let before = script_calls(&redis);
    let started = Instant::now();
    let tally = load(
        &[&a, &b],
        4,
        "flood",
        &[("user", "mallory")],
        started + Duration::from_secs(4),
        400_000,
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let calls = script_calls(&redis) - before;
    let (admitted, denied) = (
        tally.admitted.load(Ordering::Relaxed),
        tally.denied.load(Ordering::Relaxed),
    );
    let local = counter(&a, "tollgate_local_denials_total", &[]) + counter(&b, "tollgate_local_denials_total", &[]);
    eprintln!("flood: {admitted} admitted, {denied} denied ({local} locally) in {elapsed:.2} s; {calls} script calls");
    assert!(denied >= 1_000, "the flood was too thin to measure: {denied} denials");
    // Exact: 5 at once, then one a second (the last may fall just past the end).
    let most = 5 + elapsed.floor() as u64;
    assert!(admitted <= most, "{admitted} admitted, at most {most}");
    assert!(
        admitted + 1 >= most,
        "{admitted} admitted, at least {} expected",
        most - 1
    );
    assert!(
        (calls - admitted) * 100 <= denied,
        "{calls} script calls for {admitted} admissions and {denied} denials"
    );
    assert_eq!(
        tally.wrong_wait.load(Ordering::Relaxed),
        0,
        "every denial says retry-after: 1"
    );
    assert!(local >= 0.99 * denied as f64, "{local} of {denied} denials local");
}

/// POSTs a peek of the `route=all` bucket of domain `hot` to `tollgate`'s admin API: the
/// bucket's micro-tokens now.
async fn peek_hot(tollgate: &Tollgate) -> u64 {
    let body = json!({"domain": "hot", "descriptor": [{"key": "route", "value": "all"}]});
    let answer: Value = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{}/v1/buckets/peek", tollgate.admin_addr))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("the admin API answers")
        .text()
        .await
        .map(|text| serde_json::from_str(&text).expect("a JSON answer"))
        .expect("an answer");
    answer["buckets"][0]["tokens_micro"]
        .as_u64()
        .unwrap_or_else(|| panic!("no tokens in {answer}"))
}

/// A hot bucket with a lease, on two replicas: while it has tokens, most requests are admitted
/// on leased tokens without a script call, every one of them admitted; the unspent tokens come
/// back when the hold ends, to the micro-token; flooded past its capacity, it never admits
/// more than its capacity and refill, and at most two leases less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_bucket_with_a_lease_is_decided_locally_and_never_over_admits() {
    let _one = one_at_a_time();
    let redis = block_in_place(RedisServer::start);
    let prefix = unique_prefix("hot");
    let more = "local: {lease_hold_ms: 500}\n";
    let a = replica(&redis, &prefix, HOT_RULES, more);
    let b = replica(&redis, &prefix, HOT_RULES, more);
    let entries: &[(&str, &str)] = &[("route", "all")];

    let before = script_calls(&redis);
    let started = Instant::now();
    let tally = load(&[&a, &b], 4, "hot", entries, started + Duration::from_secs(30), 800).await;
    let calls = script_calls(&redis) - before;
    let leased =
        counter(&a, "tollgate_lease_admissions_total", &[]) + counter(&b, "tollgate_lease_admissions_total", &[]);
    eprintln!(
        "hot, plenty: {} admitted, {leased} on leases, {calls} script calls",
        tally.admitted.load(Ordering::Relaxed)
    );
    assert_eq!(tally.admitted.load(Ordering::Relaxed), 800);
    assert!(leased >= 600.0, "{leased} of 800 admitted on leases");
    assert!(calls <= 160, "{calls} script calls for 800 admissions");

    // The holds end: the unspent tokens go back.
    support::faults::eventually(Duration::from_secs(5), "leases given back", || {
        scrape(&a).get("tollgate_lease_tokens", &[]) == Some(0.0)
            && scrape(&b).get("tollgate_lease_tokens", &[]) == Some(0.0)
    })
    .await;
    let tokens = peek_hot(&a).await;
    let refilled = started.elapsed().as_secs() + 1;
    assert!(
        tokens >= 200 * MICRO && tokens <= (200 + refilled) * MICRO,
        "{tokens} micro-tokens after 800 of 1000 and {refilled} s of refill"
    );

    // Past the capacity.
    let started = Instant::now();
    let flood = load(
        &[&a, &b],
        4,
        "hot",
        entries,
        started + Duration::from_secs(3),
        1_000_000,
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = flood.admitted.load(Ordering::Relaxed);
    let most = tokens / MICRO + elapsed.ceil() as u64;
    eprintln!("hot, flooded: {admitted} admitted in {elapsed:.2} s, at most {most}");
    assert!(admitted <= most, "{admitted} admitted, at most {most}");
    assert!(
        admitted + 2 * 50 + 1 >= most,
        "{admitted} admitted: more than two leases short of {most}"
    );
}

/// A replica that shuts down gives its unspent leased tokens back: the other replica sees them,
/// to the micro-token (the bucket refills ten tokens an hour: nothing while the test runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_gives_its_leased_tokens_back_when_it_shuts_down() {
    const SLOW: &str =
        "domain: hot\ndescriptors:\n  - key: route\n    token_bucket: {capacity: 1000, refill: 10/1h, lease: 50}\n";
    let redis = block_in_place(RedisServer::start);
    let prefix = unique_prefix("hot-shutdown");
    let more = "local: {lease_hold_ms: 60000}\n";
    let mut a = replica(&redis, &prefix, SLOW, more);
    let b = replica(&redis, &prefix, SLOW, more);
    let mut client = connect(&a).await;
    for _ in 0..10 {
        let resp = client
            .should_rate_limit(request("hot", &[("route", "all")], 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(resp.overall_code, Code::Ok as i32);
    }
    support::faults::eventually(Duration::from_secs(5), "a lease held", || {
        scrape(&a).get("tollgate_lease_tokens", &[]).unwrap_or(0.0) > 0.0
    })
    .await;
    let held = peek_hot(&b).await;
    assert!(held <= 960 * MICRO, "{held}: a lease of 50 is out");
    support::signal(a.process.id(), "TERM");
    support::faults::eventually(Duration::from_secs(10), "a exited", || a.process.exited().is_some()).await;
    let back = peek_hot(&b).await;
    assert!(
        (990 * MICRO..991 * MICRO).contains(&back),
        "{back} micro-tokens: 10 spent of 1000, the rest back"
    );
}

/// The same cache in front of Postgres: a flood on an exhausted bucket is denied locally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_gets_the_same_cache() {
    let Some(url) = support::postgres::shared_postgres("postgres_gets_the_same_cache").await else {
        return;
    };
    let _one = one_at_a_time();
    let schema = support::postgres::unique_schema();
    let settings = format!(
        "backend: postgres\npostgres:\n  url: {}\n  schema: {schema}\n  command_timeout_ms: 2000\n  connect_timeout_ms: 10000\n",
        yaml_str(&url)
    );
    let tg = block_in_place(|| {
        Tollgate::builder()
            .rules_file("rules.yaml", FLOOD_RULES)
            .settings(&settings)
            .start()
    });
    let started = Instant::now();
    let tally = load(
        &[&tg],
        4,
        "flood",
        &[("user", "mallory")],
        started + Duration::from_secs(2),
        100_000,
    )
    .await;
    let (admitted, denied) = (
        tally.admitted.load(Ordering::Relaxed),
        tally.denied.load(Ordering::Relaxed),
    );
    let calls = counter(&tg, "tollgate_backend_calls_total", &[("backend", "postgres")]);
    eprintln!("postgres flood: {admitted} admitted, {denied} denied, {calls} store calls");
    assert!(admitted <= 5 + started.elapsed().as_secs());
    assert!(denied >= 500, "{denied} denials");
    assert!(calls <= (admitted + denied / 100 + 2) as f64, "{calls} store calls");
    drop(tg);
    support::postgres::drop_schema(&url, &schema).await;
}

/// Through a Redis outage with `failure_mode: allow`, a bucket the store denied a moment ago is
/// still denied (the cache knows the store's answer, which needs no store); a bucket it knows
/// nothing of gets the failure mode's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_an_outage_the_cache_still_denies_what_it_knows() {
    let _one = one_at_a_time();
    let mut redis = block_in_place(RedisServer::start);
    let prefix = unique_prefix("outage");
    let tg = block_in_place(|| {
        Tollgate::builder()
            .rules_file("rules.yaml", FLOOD_RULES)
            .settings(&format!(
                "backend: redis\nredis: {{urls: [{}], key_prefix: {}, command_timeout_ms: 200, failure_mode: allow}}\n",
                yaml_str(&redis.url()),
                yaml_str(&prefix)
            ))
            .start()
    });
    let mut client = connect(&tg).await;
    for _ in 0..5 {
        assert_eq!(flood_one(&mut client, "mallory").await.overall_code, Code::Ok as i32);
    }
    let from_store = flood_one(&mut client, "mallory").await;
    assert_eq!(from_store.overall_code, Code::OverLimit as i32, "from the store");
    block_in_place(|| redis.kill());
    let denied = flood_one(&mut client, "mallory").await;
    assert_eq!(
        denied.overall_code,
        Code::OverLimit as i32,
        "from the cache: {denied:?}"
    );
    let wait = |r: &RateLimitResponse| {
        r.response_headers_to_add
            .iter()
            .find(|h| h.key == "retry-after")
            .cloned()
    };
    assert!(wait(&denied).is_some(), "with the store's wait: {denied:?}");
    assert_eq!(
        denied.statuses[0].limit_remaining,
        from_store.statuses[0].limit_remaining
    );
    let allowed = flood_one(&mut client, "alice").await;
    assert_eq!(allowed.overall_code, Code::Ok as i32, "the failure mode: {allowed:?}");
    assert!(
        allowed.response_headers_to_add.is_empty(),
        "no decision, no headers: {allowed:?}"
    );
    assert!(counter(&tg, "tollgate_backend_failure_answers_total", &[("answer", "allow")]) >= 1.0);
}

/// One request of domain `flood` for `user`.
async fn flood_one(
    client: &mut envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
        tonic::transport::Channel,
    >,
    user: &str,
) -> RateLimitResponse {
    client
        .should_rate_limit(request("flood", &[("user", user)], 0))
        .await
        .expect("an answer")
        .into_inner()
}
