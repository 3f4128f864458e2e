//! The bucket admin API: look at one client's buckets on a running server and fix them.
//!
//! **Who may reach it.** Operators only. It can refill or empty any client's limits (a reset
//! hands a client its whole capacity again, a refund any number of tokens), so it listens on
//! its own address, `127.0.0.1:8082` by default (`admin.addr`), apart from the gRPC and HTTP
//! listeners Envoy and probes use. Keep it on loopback (reach it with `kubectl exec` or
//! `kubectl port-forward`), or behind a NetworkPolicy that admits operators alone, and set a
//! token (`admin.token`, `TOLLGATE_ADMIN__TOKEN`): every request must then carry
//! `Authorization: Bearer <token>`. A token set to the empty string admits nobody; an
//! `admin.addr` beyond loopback without a token is refused at start.
//!
//! **Browsers.** Without a token, the pages in an operator's browser can reach a loopback
//! listener too. Every request must therefore name the listener in `Host` (an IP address,
//! `localhost` or an `admin.allowed_hosts` name: DNS rebinding gives a page's own name), carry
//! no `Origin` but the listener's own, and every `POST` must be `Content-Type:
//! application/json` (a form or `text/plain` needs no CORS preflight; JSON does, and none is
//! granted). Refusals come before the body is read and change nothing.
//!
//! **Addressing.** A bucket is addressed as a request would reach it: a domain and one
//! descriptor's entries, matched by the rules in force exactly as `ShouldRateLimit` matches
//! them ([`Limiter::resolve`]): wildcards, `share_threshold`, and a rule's quota beside its
//! token bucket. Envoy `limit` overrides are not addressable.
//!
//! **Endpoints.** The bucket endpoints are all `POST`, with a JSON [`BucketRequest`] body (at
//! most [`MAX_BODY_BYTES`]); each answers `200` with a [`BucketsResponse`]: per bucket instance
//! the descriptor reaches, its state after the operation. `GET /config` ([`CONFIG_PATH`]) is the
//! rules in force and the settings (`crate::server::config_view`), here rather than on the public
//! HTTP port because rule values can be API keys and the settings name the backends.
//!
//! | path | body | does |
//! |---|---|---|
//! | `/v1/buckets/peek` | `{"domain":"api","descriptor":[{"key":"user","value":"alice"}],"hits":1}` (`hits` optional, default 1) | nothing: reads the buckets as a decision would, and when `hits` tokens would be there |
//! | `/v1/buckets/refund` | `{"domain":..., "descriptor":..., "tokens":5}` (required, at least 1) | gives `tokens` back to every instance, never above its capacity in force (as `is_negative_hits` does) |
//! | `/v1/buckets/reset` | `{"domain":..., "descriptor":...}` | makes every instance full again, as if never used |
//! | `/v1/explain` | a whole `RateLimitRequest` in JSON ([`explain`]) | nothing: what `ShouldRateLimit` would answer now, and why |
//! | `/v1/login` | `{"token": "<admin.token>"}` | opens a browser session: `204` and an `HttpOnly`, `SameSite=Strict` cookie accepted like the bearer token ([`session`]) |
//! | `/v1/logout` | `{}` | ends the caller's session (`204`) |
//!
//! **Pages.** With [`AdminOptions::pages`] (the operator console, `crate::console`), the same
//! gate also guards a router of pages: a `GET` for HTML without the token or a session is sent
//! to their login page, and their login page and assets are served without either. Every
//! answer of the listener carries a strict `Content-Security-Policy` (`gate.rs`).
//!
//! Errors are `{"error": "<message>"}` ([`ErrorResponse`]): `400` for a body that is not
//! such JSON (unknown or missing fields, `tokens` or `hits` of 0, an empty domain or key),
//! `401` when a token is configured and the request does not carry it, `403` for a `Host` that
//! does not name the listener or a foreign `Origin`, `415` for a `POST` that is not
//! `application/json`, `404` for an unknown
//! domain, a descriptor no rule matches, or an `unlimited` rule (no bucket), `405` for a
//! method other than `POST`, `413` for a body over the limit, `503` when the store fails.
//!
//! Refunds and resets are logged (`info`) with the domain, rule and bucket names, never the
//! descriptor values, which can be client identities or keys.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use serde::{Deserialize, Serialize};

use crate::core::bucket::{BucketState, Demand, DemandKind, MICRO};
use crate::core::schedule::Plan;
use crate::decision::limiter::{Limiter, ResolveError, Resolved};
use crate::decision::response::ceil_seconds;
use crate::rules::BucketPolicy;
use crate::store::{Store, StoreError};

pub mod explain;
mod gate;
pub mod session;

use gate::{admit, is_json, normalise_host, secure, Gate};
use session::{login, logout, Sessions, LOGIN_PATH, LOGOUT_PATH};

/// The largest request body accepted, in bytes; a larger one is answered `413`.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// What an admin endpoint does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    /// `POST /v1/buckets/peek`: read, change nothing.
    Peek,
    /// `POST /v1/buckets/refund`: give tokens back.
    Refund,
    /// `POST /v1/buckets/reset`: back to full.
    Reset,
}

impl Operation {
    /// The endpoint's path, e.g. `/v1/buckets/peek`.
    pub fn path(self) -> &'static str {
        match self {
            Operation::Peek => "/v1/buckets/peek",
            Operation::Refund => "/v1/buckets/refund",
            Operation::Reset => "/v1/buckets/reset",
        }
    }

    /// `peek`, `refund` or `reset`.
    pub fn name(self) -> &'static str {
        match self {
            Operation::Peek => "peek",
            Operation::Refund => "refund",
            Operation::Reset => "reset",
        }
    }
}

/// One entry of a request descriptor: `{"key": "user", "value": "alice"}`. Both fields are
/// required; the value may be empty, the key may not.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorEntry {
    /// The descriptor key, as Envoy sends it.
    pub key: String,
    /// The descriptor value, as Envoy sends it.
    pub value: String,
}

/// The body of every endpoint: which buckets, and for peek and refund how many tokens.
///
/// ```json
/// {"domain": "api", "descriptor": [{"key": "user", "value": "alice"}], "hits": 1}
/// ```
///
/// Unknown fields are rejected, so a misspelt `tokens` is an error rather than a no-op.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketRequest {
    /// The rate-limit domain (Envoy's `domain`); not empty.
    pub domain: String,
    /// One descriptor's entries, in order, as Envoy would send them; at least one.
    pub descriptor: Vec<DescriptorEntry>,
    /// Peek only: the whole tokens a request would ask for (its `hits_addend`), for
    /// [`BucketView::retry_after`]; at least 1, default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hits: Option<u64>,
    /// Refund only, required: the whole tokens to give back to each instance, at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
}

/// The answer of every endpoint: the buckets the descriptor reaches, after the operation
/// (a peek: as they are).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketsResponse {
    /// The domain, as asked.
    pub domain: String,
    /// The descriptor, as asked.
    pub descriptor: Vec<DescriptorEntry>,
    /// The path of the matched rule in the domain's descriptor tree, e.g. `user` or
    /// `api_key.path=/upload`.
    pub rule: String,
    /// Whether the rule is in shadow mode (its own `shadow_mode` or the global switch): its
    /// buckets are kept but never deny.
    pub shadow: bool,
    /// The instant the store read or changed the buckets, in microseconds since the Unix
    /// epoch by the store's clock; every figure below is as of then.
    pub now_us: u64,
    /// Peek only: the `hits` the retry-afters are for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hits: Option<u64>,
    /// The instances: the rule's bucket, then its calendar quota when it has one.
    pub buckets: Vec<BucketView>,
}

/// How a bucket's limit behaves over time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanKind {
    /// A token bucket whose capacity and refill never change.
    TokenBucket,
    /// A token bucket whose capacity and refill follow schedule windows.
    Scheduled,
    /// A calendar quota: no refill, full again at each reset.
    Quota,
    /// A fixed allowance whole again a set time (`expires`) after its first use.
    ExpiringAllowance,
}

impl PlanKind {
    fn of(plan: &Plan) -> PlanKind {
        match plan {
            Plan::Fixed(_) => PlanKind::TokenBucket,
            Plan::Scheduled(_) => PlanKind::Scheduled,
            Plan::Quota(_) => PlanKind::Quota,
            Plan::Expiring(_) => PlanKind::ExpiringAllowance,
            Plan::Reloaded(r) => PlanKind::of(r.after()),
        }
    }
}

/// One bucket instance's state at [`BucketsResponse::now_us`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketView {
    /// The bucket name (`current_limit.name`; a quota beside a token bucket is
    /// `<name>.quota`).
    pub name: String,
    /// `token_bucket` (a fixed allowance too), `scheduled`, `quota` or `expiring_allowance`.
    pub kind: PlanKind,
    /// Whole tokens held (rounded down), as `limit_remaining` would report them: a debt
    /// bucket's balance, 0 while in debt.
    pub tokens: u64,
    /// Tokens held, in micro-tokens (millionths of a token); a debt bucket's balance, 0 while
    /// in debt.
    pub tokens_micro: u64,
    /// The capacity in force, in whole tokens (a schedule window may change it); a debt
    /// bucket's as declared.
    pub capacity: u64,
    /// A debt bucket's balance in micro-tokens, below zero while in debt (docs/usage-budgets.md);
    /// absent for other buckets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance_micro: Option<i64>,
    /// A debt bucket's floor, in tokens (at most 0), as `/config` shows it; absent for other
    /// buckets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debt_floor: Option<i64>,
    /// The limit in force.
    pub limit: LimitView,
    /// Seconds until the bucket is full again, rounded up (the `t` of the `RateLimit`
    /// header); 0 when it is full; `null` when it never refills (or not within the horizon
    /// the schedules and quotas are walked to).
    pub full_in_seconds: Option<u64>,
    /// The same, exact, in microseconds.
    pub full_in_us: Option<u64>,
    /// Peek only: when a request for `hits` tokens would pass this bucket; on a debt bucket,
    /// when the balance is positive again (a check or a usage report passes then, whatever
    /// `hits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<RetryAfter>,
}

/// The limit in force, as Envoy is told it and as the bucket refills.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LimitView {
    /// `current_limit.requests_per_unit` as reported to Envoy now.
    pub requests_per_unit: u32,
    /// `current_limit.unit` as reported to Envoy now: `SECOND`, `MINUTE`, `HOUR`, `DAY`,
    /// `WEEK`, `MONTH` or `YEAR`.
    pub unit: String,
    /// The refill rate in force, in tokens per second (0 for a quota or a bucket that never
    /// refills). For display: the bucket computes with the exact fraction.
    pub refill_per_second: f64,
}

/// When a request for [`BucketsResponse::hits`] tokens would pass one bucket, as
/// `Retry-After` would say it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryAfter {
    /// Seconds, rounded up: 0 if it would pass now; `null` if never within the horizon
    /// (more than the capacity, or a bucket that never refills).
    pub seconds: Option<u64>,
    /// The same, exact, in microseconds.
    pub us: Option<u64>,
}

/// The body of every error answer: `{"error": "<message>"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// What went wrong, for a person to read.
    pub error: String,
}

/// Builds the `/config` document (the rules in force and the settings, secrets redacted) on
/// each call; see `crate::server::config_view`.
pub type ConfigView = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// How the admin listener admits requests, and what it serves beside the bucket endpoints.
#[derive(Clone, Default)]
pub struct AdminOptions {
    /// With a token, every request must carry `Authorization: Bearer <token>` (compared in
    /// constant time); an empty token admits nobody (`admin.token`).
    pub token: Option<String>,
    /// Host names accepted in `Host` besides `localhost` and IP addresses, compared without
    /// the port and case (`admin.allowed_hosts`): the name a port-forward, a proxy or an
    /// ingress uses to reach the listener.
    pub allowed_hosts: Vec<String>,
    /// `GET /config` when given (else it is 404).
    pub config: Option<ConfigView>,
    /// `GET /rlqs` when given (else it is 404): the RLQS streams and shares of this replica.
    pub rlqs: Option<RlqsProbe>,
    /// Mark the session cookie `Secure` (the listener speaks TLS).
    pub secure_cookies: bool,
    /// Pages served behind the same gate (the operator console, `crate::console`).
    pub pages: Option<Pages>,
}

/// Pages served on the admin listener behind its gate: every rule of `admit` holds for them,
/// but for `open_paths`, which need no token (a login page and its assets: they show nothing
/// of the rules or buckets), and a `GET` for HTML without the token is sent to `login_page`.
#[derive(Clone)]
pub struct Pages {
    /// The pages' routes.
    pub router: Router,
    /// Paths served without the token: exact, or a prefix when ending in `/`.
    pub open_paths: &'static [&'static str],
    /// Where a browser without the token is sent (`303 See Other`).
    pub login_page: &'static str,
}

/// Builds the `/rlqs` document ([`crate::rlqs::RlqsView`] as JSON) on each call.
pub type RlqsProbe =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = serde_json::Value> + Send>> + Send + Sync>;

/// The `/rlqs` document of `hub`.
pub fn rlqs_probe<S: Store>(hub: Arc<crate::rlqs::Hub<S>>) -> RlqsProbe {
    Arc::new(move || {
        let hub = hub.clone();
        Box::pin(async move { serde_json::to_value(hub.view().await).unwrap_or_default() })
    })
}

/// The admin API over `limiter`'s rules and store, admitting requests as `options` says
/// (see [the module](self): who may reach it). The caller binds the router to its listener
/// (`admin.addr`).
pub fn router<S: Store>(limiter: Arc<Limiter<S>>, options: AdminOptions) -> Router {
    if options.token.as_deref() == Some("") {
        tracing::warn!("admin.token is set but empty: every admin request will be refused");
    }
    let sessions = Arc::new(Sessions::new(options.token, options.secure_cookies));
    let gate = Arc::new(Gate {
        sessions: sessions.clone(),
        allowed_hosts: options.allowed_hosts.iter().map(|h| normalise_host(h)).collect(),
        open_paths: options.pages.as_ref().map_or(&[][..], |p| p.open_paths),
        login_page: options.pages.as_ref().map(|p| p.login_page),
    });
    let admin = Arc::new(Admin { limiter });
    let mut app = Router::new()
        .route(
            LOGIN_PATH,
            post({
                let sessions = sessions.clone();
                move |headers: HeaderMap, body: Body| login(sessions.clone(), headers, body)
            })
            .fallback(method_not_allowed),
        )
        .route(
            LOGOUT_PATH,
            post(move |headers: HeaderMap, body: Body| logout(sessions.clone(), headers, body))
                .fallback(method_not_allowed),
        )
        .route(Operation::Peek.path(), post(peek::<S>).fallback(method_not_allowed))
        .route(Operation::Refund.path(), post(refund::<S>).fallback(method_not_allowed))
        .route(Operation::Reset.path(), post(reset::<S>).fallback(method_not_allowed))
        .route(EXPLAIN_PATH, post(explain::<S>).fallback(method_not_allowed))
        .with_state(admin);
    if let Some(view) = options.config {
        app = app.route(CONFIG_PATH, get(move || config(view.clone())).fallback(get_only));
    }
    if let Some(probe) = options.rlqs {
        app = app.route(
            RLQS_PATH,
            get(move || {
                let probe = probe.clone();
                async move { Json(probe().await).into_response() }
            })
            .fallback(get_only),
        );
    }
    if let Some(pages) = options.pages {
        app = app.merge(pages.router);
    }
    app.fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(gate, admit))
        .layer(axum::middleware::from_fn(secure))
}

/// The path of the explain endpoint on the admin listener ([`explain`]).
pub const EXPLAIN_PATH: &str = "/v1/explain";

/// The path of the rules-and-settings document on the admin listener.
pub const CONFIG_PATH: &str = "/config";

/// The path of the RLQS document on the admin listener: streams, global buckets, shares.
pub const RLQS_PATH: &str = "/rlqs";

struct Admin<S> {
    limiter: Arc<Limiter<S>>,
}

async fn config(view: ConfigView) -> Response {
    match config_document(&view).await {
        Some(view) => Json(view).into_response(),
        None => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "building the view failed").into_response(),
    }
}

/// The `/config` document `view` builds, built off the runtime's threads (as long as tens of
/// milliseconds for 10,000 rules); `None` when building it panicked.
pub(crate) async fn config_document(view: &ConfigView) -> Option<serde_json::Value> {
    let view = view.clone();
    tokio::task::spawn_blocking(move || view()).await.ok()
}

async fn get_only() -> Response {
    let mut response = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "use GET").into_response();
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET"));
    response
}

type Body = Result<Bytes, BytesRejection>;

async fn peek<S: Store>(State(admin): State<Arc<Admin<S>>>, headers: HeaderMap, body: Body) -> Response {
    answer(admin.handle(Operation::Peek, &headers, body).await)
}

async fn refund<S: Store>(State(admin): State<Arc<Admin<S>>>, headers: HeaderMap, body: Body) -> Response {
    answer(admin.handle(Operation::Refund, &headers, body).await)
}

async fn reset<S: Store>(State(admin): State<Arc<Admin<S>>>, headers: HeaderMap, body: Body) -> Response {
    answer(admin.handle(Operation::Reset, &headers, body).await)
}

async fn explain<S: Store>(State(admin): State<Arc<Admin<S>>>, headers: HeaderMap, body: Body) -> Response {
    match explain::answer(&admin.limiter, &headers, body).await {
        Ok(answer) => Json(answer).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no such endpoint: POST /v1/buckets/peek, /v1/buckets/refund, /v1/buckets/reset, /v1/explain, /v1/login or \
         /v1/logout; GET /config, /rlqs, or the console's pages at / (unless admin.console.enabled is false)",
    )
    .into_response()
}

async fn method_not_allowed() -> Response {
    let mut response = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "use POST").into_response();
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("POST"));
    response
}

fn answer(result: Result<BucketsResponse, ApiError>) -> Response {
    match result {
        Ok(body) => Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The JSON body of a `POST`: `415` unless it is sent as `application/json` (see the gate),
/// the body's own error (`413` over [`MAX_BODY_BYTES`]), `400` when it is not a `T`.
fn json_body<T: serde::de::DeserializeOwned>(headers: &HeaderMap, body: Body) -> Result<T, ApiError> {
    if !is_json(headers) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the body must be sent with Content-Type: application/json",
        ));
    }
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

impl<S: Store> Admin<S> {
    async fn handle(&self, op: Operation, headers: &HeaderMap, body: Body) -> Result<BucketsResponse, ApiError> {
        buckets(&self.limiter, op, json_body(headers, body)?).await
    }
}

/// Does `op` on the buckets `req` addresses, as its endpoint does (the console's bucket page
/// peeks through it).
pub(crate) async fn buckets<S: Store>(
    limiter: &Limiter<S>,
    op: Operation,
    req: BucketRequest,
) -> Result<BucketsResponse, ApiError> {
    let unexpected = |field: &str| ApiError::bad_request(format!("{} takes no `{field}`", op.name()));
    let hits = match op {
        Operation::Peek if req.tokens.is_some() => return Err(unexpected("tokens")),
        Operation::Peek => Some(req.hits.unwrap_or(1)),
        Operation::Refund | Operation::Reset if req.hits.is_some() => return Err(unexpected("hits")),
        Operation::Refund if req.tokens.is_none() => return Err(ApiError::bad_request("refund needs `tokens`")),
        Operation::Reset if req.tokens.is_some() => return Err(unexpected("tokens")),
        Operation::Refund | Operation::Reset => None,
    };
    if hits == Some(0) || req.tokens == Some(0) {
        return Err(ApiError::bad_request("`hits` and `tokens` must be at least 1"));
    }
    let entries: Vec<Entry> = req
        .descriptor
        .iter()
        .map(|e| Entry {
            key: e.key.clone(),
            value: e.value.clone(),
        })
        .collect();
    let resolved = limiter.resolve(&req.domain, &entries).map_err(ApiError::from)?;
    let store = limiter.store();
    let (now_us, states): (u64, Vec<(BucketState, BucketState)>) = match op {
        Operation::Peek | Operation::Reset => {
            let read = if op == Operation::Peek {
                store.peek(&resolved.buckets).await
            } else {
                store.reset(&resolved.buckets).await
            };
            let read = read.map_err(ApiError::from)?;
            (read.now_us, read.states.into_iter().zip(read.kept).collect())
        }
        Operation::Refund => {
            let give = req.tokens.unwrap_or(0).saturating_mul(MICRO);
            let demands: Vec<Demand> = (0..resolved.buckets.len())
                .map(|instance| Demand {
                    instance,
                    kind: DemandKind::Refund(give),
                    enforced: true,
                })
                .collect();
            let applied = store.apply(&resolved.buckets, &demands).await.map_err(ApiError::from)?;
            let outs = applied.decision.instances.iter().map(|o| (o.after, o.kept()));
            (applied.now_us, outs.collect())
        }
    };
    if op != Operation::Peek {
        log_change(op, &req, &resolved);
    }
    let buckets = resolved
        .policies
        .iter()
        .zip(states)
        .map(|(policy, (state, kept))| view(policy, state, kept, now_us, hits))
        .collect();
    Ok(BucketsResponse {
        domain: req.domain,
        descriptor: req.descriptor,
        rule: resolved.rule,
        shadow: resolved.shadow,
        now_us,
        hits,
        buckets,
    })
}

/// One bucket instance as the admin API shows it, from the state brought forward to `now_us`
/// and the state the store keeps (waits are measured from it, as for a decision). A debt
/// bucket's stored tokens are its balance plus the floor's depth: they are shown as a decision
/// reports them (the balance, the capacity as declared, the wait by the demand a request would
/// make), never as stored.
fn view(policy: &BucketPolicy, state: BucketState, kept: BucketState, now_us: u64, hits: Option<u64>) -> BucketView {
    let plan = &policy.plan;
    let limit = policy.shown(plan.limit_at(now_us));
    let reported = policy.reported_at(now_us);
    let full_in_us = plan.full_at_us(kept).map(|at| at.saturating_sub(now_us));
    let retry_after = hits.map(|hits| {
        let asked_ut = hits.saturating_mul(MICRO);
        let need_ut = policy
            .demand_kind(DemandKind::Consume(asked_ut))
            .need_ut(asked_ut)
            .unwrap_or(0);
        let us = plan.wait_us(kept, need_ut, now_us);
        RetryAfter {
            seconds: us.map(ceil_seconds),
            us,
        }
    });
    let depth_ut = policy.debt_depth_ut;
    let signed = |ut: u64| i64::try_from(ut).unwrap_or(i64::MAX);
    let remaining_ut = policy.balance_ut(state.tokens_ut);
    BucketView {
        name: policy.name.clone(),
        kind: PlanKind::of(plan),
        tokens: remaining_ut / MICRO,
        tokens_micro: remaining_ut,
        capacity: limit.capacity(),
        balance_micro: policy.debt.then(|| signed(state.tokens_ut) - signed(depth_ut)),
        debt_floor: policy.debt.then(|| -signed(depth_ut / MICRO)),
        limit: LimitView {
            requests_per_unit: reported.requests_per_unit,
            unit: reported.unit.as_str_name().to_owned(),
            refill_per_second: limit.rate.num() as f64 / limit.rate.den() as f64,
        },
        full_in_seconds: full_in_us.map(ceil_seconds),
        full_in_us,
        retry_after,
    }
}

/// Logs a refund or reset for the audit trail, without the descriptor's values.
fn log_change(op: Operation, req: &BucketRequest, resolved: &Resolved) {
    let names: Vec<&str> = resolved.policies.iter().map(|p| p.name.as_str()).collect();
    tracing::info!(
        operation = op.name(),
        domain = %req.domain,
        rule = %resolved.rule,
        buckets = ?names,
        tokens = req.tokens,
        "admin changed buckets"
    );
}

/// An error answer: a status and `{"error": message}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    /// The answer's status.
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// What went wrong, for a person.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<ResolveError> for ApiError {
    fn from(e: ResolveError) -> ApiError {
        let status = match e {
            ResolveError::Invalid(_) => StatusCode::BAD_REQUEST,
            ResolveError::UnknownDomain(_) | ResolveError::NoRule(_) | ResolveError::Unlimited(_) => {
                StatusCode::NOT_FOUND
            }
        };
        ApiError::new(status, e.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(ErrorResponse { error: self.message })).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
