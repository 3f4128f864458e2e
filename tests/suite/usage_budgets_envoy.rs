//! Usage budgets (docs/usage-budgets.md) end to end through a real Envoy (1.40): a client talks
//! HTTP to Envoy, Envoy asks tollgate on the request path (`hits_addend` 0) and reports each
//! response's usage after the stream ends (`apply_on_stream_done`, `hits_addend` from the
//! upstream's `x-tokens-used` response header), and an in-process upstream stands in for an LLM
//! API, streaming some of its responses.
//!
//! The Envoy route is the one docs/usage-budgets.md shows, read from that page, so the page's
//! example is what runs here. Envoy is found by `support::envoy_or_skip` (skipped without one,
//! except under `CI=true`). All traffic stays on 127.0.0.1, on ports picked at run time.

use crate::support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Response};
use support::{envoy_or_skip, Envoy, Scrape, Tollgate};
use tokio::sync::Notify;
use tokio::task::block_in_place;
use tollgate::admin::{BucketView, BucketsResponse};

/// The acceptance budget, [`support::LLM_BUDGET_RULES`].
const RULES: &str = support::LLM_BUDGET_RULES;
const CAPACITY: i64 = 1000;
const MICRO: i64 = 1_000_000;
/// The refill, 1,000 tokens a minute, as micro-tokens per microsecond: 10^9 / (6 * 10^7).
const REFILL_NUM: i64 = 50;
const REFILL_DEN: i64 = 3;

/// Envoy in front of the upstream, `@ROUTE@` the route of docs/usage-budgets.md (as JSON, which
/// is YAML). The filter's timeout is generous for a debug build on a busy machine; with
/// `failure_mode_deny: false` a late answer would let a request through untold, which the
/// `ratelimit.error` and `failure_mode_allowed` counters at the end would show.
const BOOTSTRAP: &str = r#"
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
                    - name: llm
                      domains: ["*"]
                      routes: [ @ROUTE@ ]
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: llm
                      failure_mode_deny: false
                      timeout: 2s
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service: { envoy_grpc: { cluster_name: ratelimit } }
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: llm_upstream
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: llm_upstream
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

/// The route docs/usage-budgets.md gives for the two rate limit entries (its `yaml
/// envoy-fragment` with `apply_on_stream_done`), as JSON: running the page's own example keeps
/// it from drifting into one that Envoy accepts and then does not honour (as a route's own
/// `rate_limits` with `hits_addend` does, see that page).
fn docs_route() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/usage-budgets.md");
    let page = std::fs::read_to_string(path).expect("read docs/usage-budgets.md");
    let mut fences = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match &mut current {
            None if line.trim() == "```yaml envoy-fragment" => current = Some(String::new()),
            None => {}
            Some(_) if line.trim() == "```" => fences.extend(current.take()),
            Some(text) => {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    let route = fences
        .into_iter()
        .find(|f| f.contains("apply_on_stream_done"))
        .expect("docs/usage-budgets.md has an envoy-fragment with apply_on_stream_done");
    let json: serde_json::Value = serde_yaml::from_str(&route).expect("the docs route is YAML");
    serde_json::to_string(&json).expect("JSON")
}

/// Now by the system clock, in microseconds since the Unix epoch: the clock tollgate's memory
/// store reads, so instants taken here bracket its decisions.
fn now_us() -> i64 {
    let us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_micros();
    i64::try_from(us).expect("microseconds fit in i64")
}

/// `n / d` rounded up, for `n` of at least 0 (negative counts as 0) and `d` above 0.
fn div_ceil(n: i64, d: i64) -> i64 {
    let n = u64::try_from(n.max(0)).expect("not negative");
    let d = u64::try_from(d).expect("positive");
    i64::try_from(n.div_ceil(d)).expect("fits")
}

/// Micro-tokens refilled in `us` microseconds at most (rounded up).
fn refill_at_most_ut(us: i64) -> i64 {
    div_ceil(us * REFILL_NUM, REFILL_DEN)
}

/// Microseconds the refill takes to bring a balance of `balance_ut` to one micro-token above
/// zero, the least balance that is positive: rounded up, as tollgate rounds a wait.
fn time_to_positive_us(balance_ut: i64) -> i64 {
    div_ceil((1 - balance_ut) * REFILL_DEN, REFILL_NUM)
}

/// Microseconds rounded up to whole seconds, as `Retry-After` carries a wait.
fn ceil_secs(us: i64) -> i64 {
    div_ceil(us, 1_000_000)
}

// ---- the upstream ---------------------------------------------------------------------------

/// What the stand-in LLM API shares with the test: how many requests reached it, and the signal
/// that lets a held stream finish.
#[derive(Default)]
struct Shared {
    served: AtomicU64,
    release: Notify,
}

/// Time between two chunks of a streamed response: small, so a stream takes a while without
/// slowing the test down.
const CHUNK_GAP: Duration = Duration::from_millis(20);

/// The upstream's answer to one request, as the request's headers ask, so the test decides each
/// response's usage: `x-usage: N` is answered with `x-tokens-used: N` (a response header, sent
/// before the body, as an LLM API that knows its usage up front would); `x-chunks: K` streams K
/// chunks `CHUNK_GAP` apart (chunked encoding) instead of one body; with `x-hold` the last chunk
/// waits for [`Shared::release`], so the test decides when the stream ends and Envoy reports.
async fn answer(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response<Body> {
    shared.served.fetch_add(1, Ordering::SeqCst);
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let usage = header("x-usage").unwrap_or("0").to_owned();
    let chunks: u32 = header("x-chunks").map_or(0, |v| v.parse().expect("x-chunks is a number"));
    let hold = headers.contains_key("x-hold");
    let response = Response::builder()
        .header("x-tokens-used", usage)
        .header("x-upstream", "yes");
    let body = if chunks == 0 {
        Body::from("{\"choices\":[]}\n")
    } else {
        let stream = futures_util::stream::unfold(0, move |i| {
            let shared = shared.clone();
            async move {
                if i == chunks {
                    return None;
                }
                if i > 0 {
                    tokio::time::sleep(CHUNK_GAP).await;
                }
                if hold && i + 1 == chunks {
                    shared.release.notified().await;
                }
                Some((Ok::<_, Infallible>(Bytes::from(format!("data: chunk {i}\n\n"))), i + 1))
            }
        });
        Body::from_stream(stream)
    };
    response.body(body).expect("a response")
}

/// Serves [`answer`] on a free loopback port.
async fn start_upstream() -> (u16, Arc<Shared>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the upstream");
    let port = listener.local_addr().expect("upstream address").port();
    let shared = Arc::new(Shared::default());
    let app = axum::Router::new().fallback(answer).with_state(shared.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream server") });
    (port, shared)
}

/// The body of a streamed response of `chunks` chunks, as the client must receive it.
fn streamed_body(chunks: u32) -> String {
    (0..chunks).map(|i| format!("data: chunk {i}\n\n")).collect()
}

// ---- the client and tollgate's side -----------------------------------------------------------

/// One request for `tenant` whose response will report `usage` tokens, streamed in `chunks`
/// chunks (0: one body), held before its last chunk when `hold`.
async fn send(
    client: &reqwest::Client,
    url: &str,
    tenant: &str,
    usage: u64,
    chunks: u32,
    hold: bool,
) -> reqwest::Response {
    let mut request = client
        .get(url)
        .header("x-tenant", tenant)
        .header("x-usage", usage.to_string())
        .header("x-chunks", chunks.to_string());
    if hold {
        request = request.header("x-hold", "1");
    }
    request.send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

/// A request that must be admitted and reach the upstream: its whole body, checked.
async fn admitted(client: &reqwest::Client, url: &str, tenant: &str, usage: u64, chunks: u32) {
    let response = send(client, url, tenant, usage, chunks, false).await;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    assert_eq!(status, 200, "{tenant}, usage {usage}: {headers:?}");
    assert_eq!(headers.get("x-upstream").map(|v| v.as_bytes()), Some(&b"yes"[..]));
    let body = response.text().await.expect("the body");
    if chunks > 0 {
        assert_eq!(body, streamed_body(chunks), "a streamed response arrives whole");
    }
}

/// The tokens usage reports have debited from `tenant_tokens` so far, every tenant together
/// (`tollgate_debited_tokens_total`, whole tokens).
fn debited(tollgate: &Tollgate) -> u64 {
    let scrape = Scrape::from(tollgate.http_addr);
    let tokens = scrape.counter(
        "tollgate_debited_tokens_total",
        &[("domain", "llm"), ("bucket", "tenant_tokens")],
    );
    tokens as u64
}

/// Waits until usage reports have debited `expected` tokens in all. Envoy sends a report when
/// the stream is done, asynchronously, so it can arrive after the client has the whole response:
/// polling the metric, instead of sleeping, waits exactly as long as that takes. Overshooting
/// `expected` fails at once (a report debited twice, or one that should not exist).
async fn await_debited(tollgate: &Tollgate, expected: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = block_in_place(|| debited(tollgate));
        assert!(
            now <= expected,
            "debited {now} tokens, more than the {expected} reported"
        );
        if now == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "debited {now} tokens after 10 s, expected {expected}: a usage report did not arrive"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `tenant`'s bucket through the admin API's peek: tollgate's clock at the read, and the bucket.
async fn peek(client: &reqwest::Client, tollgate: &Tollgate, tenant: &str) -> (i64, BucketView) {
    let body = serde_json::json!({"domain": "llm", "descriptor": [{"key": "tenant", "value": tenant}]});
    let response = client
        .post(format!("http://{}/v1/buckets/peek", tollgate.admin_addr))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(response.status().as_u16(), 200);
    let mut answer: BucketsResponse =
        serde_json::from_str(&response.text().await.expect("a body")).expect("a peek answer");
    assert_eq!(answer.buckets.len(), 1, "{answer:?}");
    let now = i64::try_from(answer.now_us).expect("microseconds fit in i64");
    (now, answer.buckets.remove(0))
}

/// Checks the balance a peek at `at_us` shows after usage reports of `used` tokens in all, when
/// the bucket was first decided (full) no earlier than `since_us`, and returns it (micro-tokens).
/// Refill is capped at the capacity while the bucket is full, so from the first report on, the
/// balance is `capacity - used` plus what refilled since that report: at least 0 and at most
/// the refill over `at_us - since_us` (more than the time since the first report). The same
/// figure shows as `tokens`, clamped at 0 while in debt (what `limit_remaining` says).
fn assert_balance(view: &BucketView, at_us: i64, used: i64, since_us: i64) -> i64 {
    let least = (CAPACITY - used) * MICRO;
    let most = (least + refill_at_most_ut(at_us - since_us)).min(CAPACITY * MICRO);
    let balance = view.balance_micro.expect("a debt bucket shows its balance");
    assert!(
        (least..=most).contains(&balance),
        "balance {balance} micro-tokens after {used} tokens reported, expected {least}..={most} \
         ({} us since the first request)",
        at_us - since_us
    );
    assert_eq!(view.tokens_micro, u64::try_from(balance.max(0)).expect("not negative"));
    assert_eq!((view.capacity, view.debt_floor), (1000, Some(-CAPACITY)));
    balance
}

/// What tollgate answered so far, by `overall_code` (`ok`, `over_limit`): one per check and one
/// per report that Envoy sent.
fn answered(tollgate: &Tollgate, code: &str) -> f64 {
    Scrape::from(tollgate.http_addr).counter("tollgate_requests_total", &[("code", code)])
}

/// The acceptance test: 1,000 tokens a minute per tenant, Envoy 1.40 checking on the request
/// path and reporting each response's usage when its stream is done.
///
/// acme's responses use 400 (streamed), 400, then 20 (a stream held open) and 230: every check
/// before the last report finds a positive balance (the 230's finds about 200) and is admitted;
/// the 230 takes the balance below zero and the held stream's 20, reported while in debt, is
/// debited in full too. In debt, the request-path check is `429` with the exact `Retry-After`
/// (about 3 s: repaying 50 tokens at 1,000 a minute), another tenant is unaffected, and a
/// client that waits as long as `Retry-After` says is admitted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reports_usage_and_the_budget_goes_into_debt_and_back() {
    let Some(envoy_bin) = envoy_or_skip("envoy_reports_usage_and_the_budget_goes_into_debt_and_back") else {
        return;
    };
    let began = Instant::now();
    let (upstream_port, upstream) = start_upstream().await;
    let tollgate = block_in_place(|| Tollgate::builder().rules_file("llm.yaml", RULES).start());
    let bootstrap = BOOTSTRAP
        .replace("@ROUTE@", &docs_route())
        .replace("@UPSTREAM_PORT@", &upstream_port.to_string())
        .replace("@RATELIMIT_PORT@", &tollgate.grpc_addr.port().to_string());
    let envoy = block_in_place(|| Envoy::start(&envoy_bin, &bootstrap));
    let url = format!("http://{}/v1/chat/completions", envoy.listener("ingress"));
    let client = reqwest::Client::builder()
        .no_proxy() // straight to 127.0.0.1, whatever the environment says
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTP client");

    // acme's first request creates its bucket, full: no decision on it before this instant.
    let since = now_us();
    admitted(&client, &url, "acme", 400, 4).await;
    await_debited(&tollgate, 400).await;
    admitted(&client, &url, "acme", 400, 0).await;
    await_debited(&tollgate, 800).await;

    // A stream that has sent its headers (usage 20 among them) but not its end: admitted at a
    // balance of about 200, and not reported yet.
    let held = send(&client, &url, "acme", 20, 3, true).await;
    assert_eq!(held.status().as_u16(), 200, "{:?}", held.headers());
    assert_eq!(
        held.headers().get("x-tokens-used").map(|v| v.as_bytes()),
        Some(&b"20"[..])
    );
    let held = tokio::spawn(async move { held.text().await.expect("the held body") });

    // The balance is still about 200 (positive): admitted, and its report crosses zero.
    admitted(&client, &url, "acme", 230, 0).await;
    await_debited(&tollgate, 1030).await;
    let (at, view) = peek(&client, &tollgate, "acme").await;
    assert_balance(&view, at, 1030, since);
    assert_eq!(
        block_in_place(|| debited(&tollgate)),
        1030,
        "the held stream is not reported before it ends"
    );

    // The held stream ends; its report arrives while in debt and is debited in full.
    upstream.release.notify_one();
    assert_eq!(held.await.expect("the held stream's reader"), streamed_body(3));
    await_debited(&tollgate, 1050).await;
    let (peeked_at, view) = peek(&client, &tollgate, "acme").await;
    let balance = assert_balance(&view, peeked_at, 1050, since);
    assert!(
        balance < 0,
        "still in debt at the peek ({balance} micro-tokens): this machine took {} us for the \
         requests so far, longer than the refill needs to repay 50 tokens, too slow for this test",
        peeked_at - since
    );
    assert_eq!(view.tokens, 0, "in debt, no tokens are left");

    // In debt: the request-path check is 429, Envoy's own answer (the upstream never sees it).
    // The wait to a positive balance runs from the peek, less the time from the peek to the
    // decision, which lies between sending the request and its answer. The peek's balance is
    // floored to a micro-token, so the wait worked out from it is at most 1 us too long: the
    // shortest expected wait allows for that.
    let served = upstream.served.load(Ordering::SeqCst);
    let sent = now_us();
    let denied = send(&client, &url, "acme", 7, 0, false).await;
    let answered_at = now_us();
    let replied = Instant::now();
    let headers = denied.headers().clone();
    assert_eq!(denied.status().as_u16(), 429, "{headers:?}");
    assert_eq!(
        headers.get("x-envoy-ratelimited").map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert!(headers.get("x-upstream").is_none());
    assert_eq!(
        upstream.served.load(Ordering::SeqCst),
        served,
        "a denied request never reaches the upstream"
    );
    let retry_after: i64 = headers
        .get("retry-after")
        .unwrap_or_else(|| panic!("no retry-after on a 429: {headers:?}"))
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("whole seconds");
    let wait = time_to_positive_us(balance);
    let expected = ceil_secs(wait - (answered_at - peeked_at) - 1)..=ceil_secs(wait - (sent - peeked_at));
    eprintln!(
        "429 in debt: balance {balance} micro-tokens at the peek, {wait} us from positive; \
         retry-after {retry_after}, expected {expected:?}"
    );
    assert!(
        expected.contains(&retry_after),
        "retry-after {retry_after}, expected {expected:?}: {wait} us to repay {balance} micro-tokens \
         at the peek, the decision {}..={} us after it",
        sent - peeked_at,
        answered_at - peeked_at
    );
    assert!(retry_after >= 1, "a debt takes time to repay");
    // The balance is what clients are told is left: 0 while in debt.
    let state = headers
        .get("ratelimit")
        .unwrap_or_else(|| panic!("no ratelimit header: {headers:?}"));
    assert!(
        state.to_str().expect("ASCII").starts_with(r#""tenant_tokens";r=0;"#),
        "{state:?}"
    );

    // Another tenant's account is its own: full, whatever acme owes.
    let globex_since = now_us();
    admitted(&client, &url, "globex", 5, 2).await;
    await_debited(&tollgate, 1055).await;
    let (at, globex) = peek(&client, &tollgate, "globex").await;
    assert_balance(&globex, at, 5, globex_since);

    // A client that waits as long as Retry-After said (counted from its answer, after the
    // decision) finds the debt repaid: admitted, and its usage debited.
    tokio::time::sleep_until((replied + Duration::from_secs(retry_after.unsigned_abs())).into()).await;
    admitted(&client, &url, "acme", 1, 0).await;
    await_debited(&tollgate, 1056).await;
    let (at, view) = peek(&client, &tollgate, "acme").await;
    assert_balance(&view, at, 1051, since);

    // Every call was answered as the account stood. Checks admitted: acme's five and globex's
    // one; reports while positive: all but the held stream's. Over the limit: the 429's check and
    // the held stream's report. No report for the 429: Envoy's own reply has no x-tokens-used, so
    // it sends none. Envoy counts only its checks, none of which failed open.
    assert_eq!(block_in_place(|| answered(&tollgate, "ok")), 11.0);
    assert_eq!(block_in_place(|| answered(&tollgate, "over_limit")), 2.0);
    block_in_place(|| {
        assert_eq!(envoy.stat("cluster.llm_upstream.ratelimit.ok"), 6);
        assert_eq!(envoy.stat("cluster.llm_upstream.ratelimit.over_limit"), 1);
        assert_eq!(envoy.stat("cluster.llm_upstream.ratelimit.error"), 0);
        assert_eq!(envoy.stat("cluster.llm_upstream.ratelimit.failure_mode_allowed"), 0);
    });
    assert_eq!(upstream.served.load(Ordering::SeqCst), 6);
    eprintln!("usage budget through Envoy: {:?}", began.elapsed());
}
