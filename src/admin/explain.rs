//! `POST /v1/explain`: what `ShouldRateLimit` would answer for a whole request now, and why,
//! consuming nothing ([`Limiter::explain`]; docs/operations.md, "Why was this request
//! limited?").
//!
//! The body is a `RateLimitRequest` in JSON, with the proto's field names:
//!
//! ```json
//! {"domain": "edge",
//!  "descriptors": [{"entries": [{"key": "api_key", "value": "demo"}]},
//!                  {"entries": [{"key": "tenant", "value": "a"}, {"key": "path", "value": "/x"}],
//!                   "hits_addend": 2, "limit": {"requests_per_unit": 10, "unit": "MINUTE"}}],
//!  "hits_addend": 1}
//! ```
//!
//! The answer is an [`ExplainResponse`]: the overall code, the statuses and headers Envoy
//! would get, and per descriptor the rule it reached (or the nearest one and the entry that
//! matched nothing), each bucket's state (as `/v1/buckets/peek` shows it) with what was asked
//! of it, the bucket that decides, and when the request would pass. Errors as the bucket
//! endpoints': `400` for a body that is no such request, `503` when the store fails.

use axum::http::HeaderMap;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use serde::{Deserialize, Serialize};

use super::{json_body, view, ApiError, Body, BucketView, DescriptorEntry};
use crate::core::bucket::DemandKind;
use crate::decision::limiter::{LimitError, Limiter};
use crate::decision::response::ceil_seconds;
use crate::decision::{Explanation, Found};
use crate::store::Store;

/// The body of `POST /v1/explain`: a `RateLimitRequest` (envoy.service.ratelimit.v3) in JSON.
/// Unknown fields are refused.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainRequest {
    /// `domain`.
    pub domain: String,
    /// `descriptors`, in order (absent: none, as proto JSON reads it).
    #[serde(default)]
    pub descriptors: Vec<ExplainDescriptor>,
    /// `hits_addend`: the hits of every descriptor without its own; 0 or absent means 1.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hits_addend: u32,
}

/// One `RateLimitDescriptor` (envoy.extensions.common.ratelimit.v3) in JSON.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainDescriptor {
    /// `entries`, in order.
    pub entries: Vec<DescriptorEntry>,
    /// `limit`: Envoy's override of the rule's limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<ExplainOverride>,
    /// `hits_addend`: this descriptor's own hits (0 is a check that consumes nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hits_addend: Option<u64>,
    /// `is_negative_hits`: give the hits back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_negative_hits: bool,
}

/// `RateLimitOverride`: `requests_per_unit` per `unit` (`SECOND`, `MINUTE`, `HOUR`, `DAY`,
/// `WEEK`, `MONTH`, `YEAR`, in any case).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainOverride {
    /// `requests_per_unit`.
    pub requests_per_unit: u32,
    /// `unit`, by its proto name.
    pub unit: String,
}

/// The answer of `POST /v1/explain`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExplainResponse {
    /// The domain, as asked.
    pub domain: String,
    /// `OK` or `OVER_LIMIT`: `overall_code` as `ShouldRateLimit` would answer it now.
    pub overall_code: String,
    /// The instant decided at, in microseconds since the Unix epoch by the store's clock.
    pub now_us: u64,
    /// Seconds until the same request would pass, rounded up (0: it passes now); `null` when
    /// no wait makes it pass.
    pub passes_in_seconds: Option<u64>,
    /// The same, in microseconds.
    pub passes_in_us: Option<u64>,
    /// The `DescriptorStatus`es, in order.
    pub statuses: Vec<StatusView>,
    /// `response_headers_to_add`: the headers Envoy adds to the client's response.
    pub response_headers: Vec<DescriptorEntry>,
    /// `request_headers_to_add`: the headers Envoy adds to the request sent upstream.
    pub request_headers: Vec<DescriptorEntry>,
    /// Per descriptor, in order, how it was decided.
    pub descriptors: Vec<DescriptorView>,
    /// The request's malformed parts, as decided (not counted: explaining is not serving).
    pub malformed: Vec<MalformedView>,
}

/// One `DescriptorStatus`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusView {
    /// `OK` or `OVER_LIMIT`.
    pub code: String,
    /// `current_limit`: the bucket's name and its limit as Envoy is told it; `null` when no
    /// limit applies.
    pub current_limit: Option<CurrentLimit>,
    /// `limit_remaining`, whole tokens.
    pub limit_remaining: u32,
    /// `duration_until_reset`, whole seconds; `null` when not set.
    pub duration_until_reset_seconds: Option<i64>,
}

/// A status's `current_limit`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CurrentLimit {
    /// `name`: the bucket.
    pub name: String,
    /// `requests_per_unit`.
    pub requests_per_unit: u32,
    /// `unit`, by its proto name.
    pub unit: String,
}

/// How one descriptor was decided.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DescriptorView {
    /// What its entries reached: `rule`, `override` (Envoy's `limit`), `unlimited`, `no_rule`,
    /// `unknown_domain`, `replaced` (another matched rule's `replaces` dropped it),
    /// `refund_refused` (`refunds: false`) or `malformed`.
    pub found: String,
    /// The rule's path in the descriptor tree, for `rule`, `unlimited` and `replaced`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// For `no_rule`: the path of the deepest node the entries reached (`null`: not even the
    /// first entry matched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nearest: Option<String>,
    /// For `no_rule`: the index of the first entry no node took, and its key (`null` when all
    /// matched, and that node has no rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_entry: Option<FailedEntry>,
    /// Shadow mode: its buckets count but never deny.
    pub shadow: bool,
    /// Quota mode (docs/rules.md, "Quota mode").
    pub quota_mode: bool,
    /// The name of the bucket that decides it: of those that deny, the one with the longest
    /// wait; else the one its status names.
    pub deciding: Option<String>,
    /// The buckets it asked of.
    pub buckets: Vec<ExplainedBucket>,
}

/// The entry where matching stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedEntry {
    /// Its index in the descriptor's entries.
    pub index: usize,
    /// Its key (the value is the client's, and stays out).
    pub key: String,
}

/// One bucket a descriptor asked of: its state as `/v1/buckets/peek` shows it, and the demand.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExplainedBucket {
    /// The bucket's state and limit.
    #[serde(flatten)]
    pub bucket: BucketView,
    /// What the descriptor asks: `consume`, `check` (hits 0), `refund`, `usage_report` or
    /// `debt_check` (a debt bucket, docs/usage-budgets.md).
    pub demand: String,
    /// The whole tokens asked (consumed, given back or reported); 0 for a check.
    pub asked: u64,
    /// Whether the demand passes.
    pub passed: bool,
    /// Whether its failure counts against the request (not in shadow mode; in quota mode,
    /// the request is denied when every quota-mode descriptor is over).
    pub enforced: bool,
    /// A hidden bucket (`hidden: true`, or the over-limit account a `rate_limit` of
    /// envoyproxy/ratelimit's schema keeps for a descriptor's own hits): it decides, but stays
    /// out of the statuses and headers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hidden: bool,
    /// Seconds until it would pass, rounded up (0: now); `null`: never within the horizon,
    /// or a refund.
    pub passes_in_seconds: Option<u64>,
    /// The same, in microseconds.
    pub passes_in_us: Option<u64>,
    /// The schedule window in force, on a scheduled bucket outside its base limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowView>,
}

/// A schedule window in force.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowView {
    /// The entry's index in the bucket's `schedule`.
    pub entry: usize,
    /// Its cron pattern.
    pub cron: String,
    /// Its IANA time zone.
    pub timezone: String,
}

/// A malformed part of the request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MalformedView {
    /// `tollgate_malformed_total`'s `reason`.
    pub reason: String,
    /// What was found, and how it is decided.
    pub note: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl ExplainRequest {
    /// The `RateLimitRequest` it stands for.
    ///
    /// Errors: an override whose `unit` is no proto unit name.
    pub fn to_request(&self) -> Result<RateLimitRequest, String> {
        let mut descriptors = Vec::with_capacity(self.descriptors.len());
        for (i, d) in self.descriptors.iter().enumerate() {
            let limit = match &d.limit {
                None => None,
                Some(o) => {
                    let unit = Unit::from_str_name(&o.unit.to_ascii_uppercase()).ok_or_else(|| {
                        format!(
                            "descriptor {i}: unit {:?} is not one of SECOND, MINUTE, HOUR, DAY, WEEK, MONTH, YEAR",
                            o.unit
                        )
                    })?;
                    Some(RateLimitOverride {
                        requests_per_unit: o.requests_per_unit,
                        unit: unit as i32,
                    })
                }
            };
            descriptors.push(RateLimitDescriptor {
                entries: d
                    .entries
                    .iter()
                    .map(|e| Entry {
                        key: e.key.clone(),
                        value: e.value.clone(),
                    })
                    .collect(),
                limit,
                hits_addend: d
                    .hits_addend
                    .map(|value| envoy_types::pb::google::protobuf::UInt64Value { value }),
                is_negative_hits: d.is_negative_hits,
            });
        }
        Ok(RateLimitRequest {
            domain: self.domain.clone(),
            descriptors,
            hits_addend: self.hits_addend,
        })
    }
}

/// Answers one `POST /v1/explain`.
pub(super) async fn answer<S: Store>(
    limiter: &Limiter<S>,
    headers: &HeaderMap,
    body: Body,
) -> Result<ExplainResponse, ApiError> {
    explain(limiter, json_body(headers, body)?).await
}

/// What `ShouldRateLimit` would answer for `asked` now, and why, as `POST /v1/explain`
/// answers it (the console's explain page asks through it).
pub(crate) async fn explain<S: Store>(
    limiter: &Limiter<S>,
    asked: ExplainRequest,
) -> Result<ExplainResponse, ApiError> {
    let request = asked.to_request().map_err(ApiError::bad_request)?;
    let explained = limiter.explain(&request).await.map_err(|e| match e {
        LimitError::Store(e) => ApiError::from(e),
    })?;
    Ok(ExplainResponse::of(&asked, &explained))
}

impl ExplainResponse {
    /// The answer for `explained`, the explanation of `asked`.
    pub fn of(asked: &ExplainRequest, explained: &Explanation) -> ExplainResponse {
        let response = &explained.response;
        let headers = |list: &[envoy_types::pb::envoy::config::core::v3::HeaderValue]| {
            list.iter()
                .map(|h| DescriptorEntry {
                    key: h.key.clone(),
                    value: h.value.clone(),
                })
                .collect()
        };
        let statuses = response
            .statuses
            .iter()
            .map(|s| StatusView {
                code: code_name(s.code),
                current_limit: s.current_limit.as_ref().map(|l| CurrentLimit {
                    name: l.name.clone(),
                    requests_per_unit: l.requests_per_unit,
                    unit: Unit::try_from(l.unit).map_or("UNKNOWN", |u| u.as_str_name()).to_owned(),
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset_seconds: s.duration_until_reset.as_ref().map(|d| d.seconds),
            })
            .collect();
        let descriptors = explained
            .descriptors
            .iter()
            .zip(&asked.descriptors)
            .map(|(d, sent)| {
                let (found, rule, nearest, failed) = match &d.found {
                    Found::Rule(path) => ("rule", Some(path.clone()), None, None),
                    Found::Override => ("override", None, None, None),
                    Found::Unlimited(path) => ("unlimited", Some(path.clone()), None, None),
                    Found::Replaced(path) => ("replaced", Some(path.clone()), None, None),
                    Found::NoRule { nearest, failed_entry } => ("no_rule", None, nearest.clone(), *failed_entry),
                    Found::UnknownDomain => ("unknown_domain", None, None, None),
                    Found::RefundRefused => ("refund_refused", None, None, None),
                    Found::Malformed => ("malformed", None, None, None),
                };
                DescriptorView {
                    found: found.to_owned(),
                    rule,
                    nearest,
                    failed_entry: failed.map(|index| FailedEntry {
                        index,
                        key: sent.entries.get(index).map(|e| e.key.clone()).unwrap_or_default(),
                    }),
                    shadow: d.shadow,
                    quota_mode: d.quota_mode,
                    deciding: d.deciding.map(|i| d.buckets[i].policy.name.clone()),
                    buckets: d
                        .buckets
                        .iter()
                        .map(|b| {
                            let (demand, asked_ut) = demand_name(b.demand);
                            ExplainedBucket {
                                bucket: view(&b.policy, b.state, b.kept, explained.now_us, None),
                                demand: demand.to_owned(),
                                asked: asked_ut / crate::core::bucket::MICRO,
                                passed: b.passed,
                                enforced: b.enforced,
                                hidden: b.policy.hidden,
                                passes_in_seconds: b.wait_us.map(ceil_seconds),
                                passes_in_us: b.wait_us,
                                window: b.window.as_ref().map(|(entry, cron, timezone)| WindowView {
                                    entry: *entry,
                                    cron: cron.clone(),
                                    timezone: timezone.clone(),
                                }),
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        ExplainResponse {
            domain: asked.domain.clone(),
            overall_code: code_name(response.overall_code),
            now_us: explained.now_us,
            passes_in_seconds: explained.passes_in_us.map(ceil_seconds),
            passes_in_us: explained.passes_in_us,
            statuses,
            response_headers: headers(&response.response_headers_to_add),
            request_headers: headers(&response.request_headers_to_add),
            descriptors,
            malformed: explained
                .malformed
                .iter()
                .map(|(reason, note)| MalformedView {
                    reason: (*reason).to_owned(),
                    note: note.clone(),
                })
                .collect(),
        }
    }
}

/// A refill rate for a person: `5 per s`, or `1 per 360 s` below a token a second.
pub(crate) fn refill_text(per_second: f64) -> String {
    if per_second <= 0.0 {
        "no refill".to_owned()
    } else if per_second >= 1.0 {
        format!("refill {} per s", (per_second * 1000.0).round() / 1000.0)
    } else {
        format!("refill 1 per {} s", (1.0 / per_second * 1000.0).round() / 1000.0)
    }
}

/// `OK`, `OVER_LIMIT` or `UNKNOWN`, by the proto's names.
fn code_name(code: i32) -> String {
    Code::try_from(code).map_or("UNKNOWN", |c| c.as_str_name()).to_owned()
}

/// A demand's name and the micro-tokens it asks.
fn demand_name(kind: DemandKind) -> (&'static str, u64) {
    match kind {
        DemandKind::Consume(ut) => ("consume", ut),
        DemandKind::Check => ("check", 0),
        DemandKind::Refund(ut) => ("refund", ut),
        DemandKind::Debit { amount_ut, .. } => ("usage_report", amount_ut),
        DemandKind::DebtCheck { .. } => ("debt_check", 0),
    }
}

impl ExplainResponse {
    /// The answer as a person reads it: the verdict and when the request passes, then per
    /// descriptor its code, what it reached and its buckets, then the headers.
    pub fn summary(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let passes = match self.passes_in_seconds {
            Some(0) => String::new(),
            Some(s) => format!(": passes in {s} s"),
            None => ": no wait lets it pass".to_owned(),
        };
        let _ = writeln!(out, "{}{passes}", self.overall_code);
        for (i, (d, status)) in self.descriptors.iter().zip(&self.statuses).enumerate() {
            let reached = match (d.found.as_str(), &d.rule, &d.nearest, &d.failed_entry) {
                ("rule", Some(rule), ..) => format!("rule {rule}"),
                ("unlimited", Some(rule), ..) => format!("unlimited rule {rule}"),
                ("replaced", Some(rule), ..) => format!("rule {rule}, replaced by another rule's `replaces`"),
                ("no_rule", _, nearest, Some(failed)) => format!(
                    "no rule: entry {} ({}) matched nothing {}",
                    failed.index,
                    failed.key,
                    nearest
                        .as_ref()
                        .map_or("at the top".to_owned(), |n| format!("below {n}"))
                ),
                ("no_rule", _, Some(nearest), None) => format!("no rule: {nearest} has none"),
                (other, ..) => other.replace('_', " "),
            };
            let mode = match (d.shadow, d.quota_mode) {
                (true, _) => ", shadow mode",
                (false, true) => ", quota mode",
                _ => "",
            };
            let by = d
                .deciding
                .as_ref()
                .map_or(String::new(), |b| format!(", decided by {b}"));
            let _ = writeln!(out, "descriptor {i}: {} ({reached}{mode}){by}", status.code);
            for b in &d.buckets {
                let verdict = match (b.passed, b.enforced, d.quota_mode) {
                    (true, ..) => "passes",
                    (false, true, true) => "over (quota mode: denies when every quota-mode descriptor is over)",
                    (false, true, false) => "denies",
                    (false, false, _) => "over (shadow mode: never denies)",
                };
                let when = match (b.passed, b.passes_in_seconds) {
                    (true, _) => String::new(),
                    (false, Some(s)) => format!(", passes in {s} s"),
                    (false, None) => ", and no wait lets it pass".to_owned(),
                };
                let window = b
                    .window
                    .as_ref()
                    .map_or(String::new(), |w| format!(", window `{}` ({})", w.cron, w.timezone));
                let hidden = if b.hidden { " (hidden)" } else { "" };
                let _ = writeln!(
                    out,
                    "  {}{hidden}: {} of {} tokens, {}, asks {} ({}): {verdict}{when}{window}",
                    b.bucket.name,
                    b.bucket.tokens,
                    b.bucket.capacity,
                    refill_text(b.bucket.limit.refill_per_second),
                    b.asked,
                    b.demand,
                );
            }
        }
        for h in &self.response_headers {
            let _ = writeln!(out, "response header {}: {}", h.key, h.value);
        }
        for h in &self.request_headers {
            let _ = writeln!(out, "upstream header {}: {}", h.key, h.value);
        }
        for m in &self.malformed {
            let _ = writeln!(out, "malformed ({}): {}", m.reason, m.note);
        }
        out.truncate(out.trim_end().len());
        out
    }
}
