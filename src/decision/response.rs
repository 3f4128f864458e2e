//! From a decision to a `RateLimitResponse`: statuses in request order and the headers Envoy
//! forwards to the client (docs/rules.md).

use smallvec::SmallVec;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::Duration;

use super::settings::{HeaderSettings, LimitHeaders, ShadowHeaderSettings};
use crate::core::bucket::{DemandKind, Limit, MICRO};
use crate::core::schedule::Plan;
use crate::rules::{BucketPolicy, ReportedLimit};
use crate::store::Applied;
use crate::telemetry::DecisionCounters;

/// A descriptor that matched a rule: the buckets it asks of, all or nothing.
#[derive(Clone, Debug)]
pub(crate) struct Target<'r> {
    /// The rule's buckets, never empty, in the rule's order (a quota beside a token bucket
    /// right after it): each decided as its own instance with the same demand.
    pub parts: SmallVec<[Part<'r>; 2]>,
    /// What the descriptor asked of each bucket.
    pub kind: DemandKind,
    /// Shadow mode (the rule's or the global switch).
    pub shadow: bool,
    /// In shadow mode by the global switch alone: the descriptor's status still says what it
    /// would have been (`OVER_LIMIT`) while the request passes, as envoyproxy/ratelimit's
    /// `SHADOW_MODE` answers (a rule's own `shadow_mode` answers `OK`).
    pub global_shadow: bool,
    /// Quota mode (the rule's or the global switch) on a descriptor that asks for tokens (not
    /// a refund): over its limit, it denies the request only when every quota-mode descriptor
    /// of the request is over ([`crate::decision::quota_mode`]).
    pub quota: bool,
    /// The rule's `metadata`, passed on in the response's dynamic metadata when it passes.
    pub metadata: Option<&'r envoy_types::pb::google::protobuf::Struct>,
    /// Where the decision is counted under envoyproxy/ratelimit's names (the rule's node).
    pub envoyproxy: &'r crate::telemetry::EnvoyproxyStats,
    /// The descriptor's entries, for envoyproxy/ratelimit's `detailed_metric` series.
    pub entries: &'r [envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry],
    /// Per entry, the `share_threshold` pattern standing for its value (usually empty).
    pub shared: Vec<Option<&'r str>>,
}

/// One bucket instance a descriptor asks of.
#[derive(Clone, Debug)]
pub(crate) struct Part<'r> {
    /// The bucket's policy, the rules' own or an Envoy `limit` override's.
    pub policy: PolicyRef<'r>,
    /// Index of the bucket instance in the store request.
    pub instance: usize,
    /// Index of the demand in the store request.
    pub demand: usize,
    /// Where the bucket's decision is counted.
    pub counters: &'r DecisionCounters,
}

/// A bucket's policy as a decision holds it: the rules' own, or an Envoy `limit` override's,
/// built per request. Two words either way: a `Cow` would hold a whole policy inline in every
/// match and part of a request, copied at each move (a tenth of a four-descriptor decision's
/// instructions went to `memcpy`).
#[derive(Clone, Debug)]
pub(crate) enum PolicyRef<'r> {
    /// A bucket of the rules.
    Rule(&'r BucketPolicy),
    /// The policy of an Envoy `limit` override.
    Override(std::sync::Arc<BucketPolicy>),
}

impl std::ops::Deref for PolicyRef<'_> {
    type Target = BucketPolicy;

    fn deref(&self) -> &BucketPolicy {
        match self {
            PolicyRef::Rule(policy) => policy,
            PolicyRef::Override(policy) => policy,
        }
    }
}

/// One bucket's verdict for one descriptor, before it becomes a `DescriptorStatus`.
struct Verdict<'a> {
    /// Index of the request descriptor.
    descriptor: usize,
    policy: &'a BucketPolicy,
    /// The limit in force at the decision.
    limit: Limit,
    /// `current_limit` at the decision.
    reported: ReportedLimit,
    over: bool,
    /// Over its limit, but in shadow mode: it would have denied.
    would_deny: bool,
    remaining_ut: u64,
    until_full_us: Option<u64>,
    /// For a denied enforced descriptor: the wait until the same demand would pass.
    retry_after_us: Option<u64>,
}

/// The answer when the backend failed and `failure_mode` says `allow` (`deny: false`: every
/// descriptor `OK`) or `deny` (`deny: true`: every enforced descriptor that matched a bucket
/// `OVER_LIMIT`, others `OK`). Nothing is known about the buckets, so the statuses carry no
/// limit or remaining count and no header is added: in particular no `Retry-After`, since no
/// wait is known to succeed (docs/backends.md).
pub(crate) fn failure_response(targets: &[Option<Target<'_>>], deny: bool) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = targets
        .iter()
        .map(|t| {
            let over = deny
                && t.as_ref()
                    .is_some_and(|t| !t.shadow && !matches!(t.kind, DemandKind::Refund(_)));
            DescriptorStatus {
                code: if over { Code::OverLimit } else { Code::Ok } as i32,
                ..Default::default()
            }
        })
        .collect();
    let denied = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    RateLimitResponse {
        overall_code: if denied { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        ..Default::default()
    }
}

/// Builds the response. `targets` has one entry per request descriptor (`None`: no limit
/// applies); `applied` is the store's decision, absent when no descriptor matched a bucket.
/// `shadow` says which headers go upstream when shadow mode let the request through.
pub(crate) fn build_response(
    targets: &[Option<Target<'_>>],
    applied: Option<&Applied>,
    headers: &HeaderSettings,
    shadow: &ShadowHeaderSettings,
) -> RateLimitResponse {
    let verdicts = verdicts(targets, applied);
    // The store's: with quota mode a descriptor can be over while the request passes.
    let denied = applied.is_some_and(|a| a.decision.denied);
    let statuses = statuses(targets, &verdicts);
    let mut response_headers_to_add = response_headers(targets, &verdicts, applied, headers, denied);
    if headers.limit_headers.enabled {
        push_limit_headers(&mut response_headers_to_add, targets, &statuses, &headers.limit_headers);
    }
    // Envoy forwards nothing of a denied request, so its would-be denials are not told.
    let request_headers_to_add = match shadow.enabled && !denied {
        true => shadow_headers(&verdicts, shadow),
        false => Vec::new(),
    };
    RateLimitResponse {
        overall_code: if denied { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        response_headers_to_add,
        request_headers_to_add,
        ..Default::default()
    }
}

/// The upstream request's headers when a bucket in shadow mode would have denied: the verdict
/// header `would-deny`, and the buckets header with the names of those buckets (each once,
/// in request order; hidden buckets left out, and the header too when only hidden ones
/// would have denied). None when no shadow bucket would have denied.
fn shadow_headers(verdicts: &[Verdict<'_>], shadow: &ShadowHeaderSettings) -> Vec<HeaderValue> {
    if !verdicts.iter().any(|v| v.would_deny) {
        return Vec::new();
    }
    let mut out = vec![header(&shadow.verdict, "would-deny".to_owned())];
    if !shadow.buckets.is_empty() {
        let mut names: Vec<&str> = Vec::new();
        for v in verdicts.iter().filter(|v| v.would_deny && !v.policy.hidden) {
            if !names.contains(&v.policy.name.as_str()) {
                names.push(&v.policy.name);
            }
        }
        if !names.is_empty() {
            out.push(header(&shadow.buckets, names.join(", ")));
        }
    }
    out
}

/// Per bucket each matched descriptor of `targets` asks of, in the rule's order, its verdict
/// from `applied`.
fn verdicts<'a>(targets: &'a [Option<Target<'_>>], applied: Option<&Applied>) -> Vec<Verdict<'a>> {
    let mut verdicts: Vec<Verdict<'_>> = Vec::with_capacity(targets.len());
    for (descriptor, t) in targets.iter().enumerate() {
        let Some(t) = t else { continue };
        let applied = applied.expect("a matched descriptor has a decision");
        for p in &t.parts {
            verdicts.push(verdict(
                descriptor,
                &p.policy,
                p.instance,
                p.demand,
                t.kind,
                (t.shadow, t.global_shadow),
                applied,
            ));
        }
    }
    verdicts
}

/// Per descriptor of `targets`, its status: `OVER_LIMIT` when one of its buckets denies, else
/// `OK`; with the limit fields of the bucket [`status_verdict`] picks among those not hidden,
/// and none when it matched no bucket or only hidden ones.
fn statuses(targets: &[Option<Target<'_>>], verdicts: &[Verdict<'_>]) -> Vec<DescriptorStatus> {
    targets
        .iter()
        .enumerate()
        .map(|(descriptor, t)| {
            let over = t.is_some() && verdicts.iter().any(|v| v.descriptor == descriptor && v.over);
            let code = if over { Code::OverLimit } else { Code::Ok } as i32;
            match t.as_ref().and_then(|_| status_verdict(verdicts, descriptor)) {
                None => DescriptorStatus {
                    code,
                    ..Default::default()
                },
                Some(v) => DescriptorStatus {
                    code,
                    current_limit: Some(RateLimit {
                        name: if v.policy.unnamed {
                            String::new()
                        } else {
                            v.policy.name.clone()
                        },
                        requests_per_unit: v.reported.requests_per_unit,
                        unit: v.reported.unit as i32,
                    }),
                    limit_remaining: whole_tokens(v.remaining_ut),
                    duration_until_reset: v.until_full_us.map(duration),
                    ..Default::default()
                },
            }
        })
        .collect()
}

/// The headers `headers` asks for: `Retry-After` when the request is `denied`, the structured
/// `RateLimit-Policy` and `RateLimit`, and the `X-RateLimit-*` of the lowest bucket.
fn response_headers(
    targets: &[Option<Target<'_>>],
    verdicts: &[Verdict<'_>],
    applied: Option<&Applied>,
    headers: &HeaderSettings,
    denied: bool,
) -> Vec<HeaderValue> {
    let mut response_headers_to_add = Vec::new();
    if denied && headers.retry_after {
        if let Some(wait) = retry_after_us(targets, verdicts) {
            response_headers_to_add.push(header("retry-after", decimal(ceil_seconds(wait))));
        }
    }
    let per_bucket = lowest_per_bucket(verdicts);
    if let Some(now_us) = applied
        .map(|a| a.now_us)
        .filter(|_| headers.ratelimit && !per_bucket.is_empty())
    {
        push_ratelimit_headers(&mut response_headers_to_add, &per_bucket, now_us);
    }
    if headers.x_ratelimit {
        if let Some(v) = per_bucket.iter().min_by_key(|v| v.remaining_ut) {
            push_x_ratelimit_headers(&mut response_headers_to_add, v);
        }
    }
    response_headers_to_add
}

/// Pushes `RateLimit-Policy` and `RateLimit`, one item per bucket of `per_bucket`.
fn push_ratelimit_headers(response_headers_to_add: &mut Vec<HeaderValue>, per_bucket: &[&Verdict<'_>], now_us: u64) {
    // Built in place, item after item: this runs on every decision.
    let mut policy = String::with_capacity(48 * per_bucket.len());
    let mut state = String::with_capacity(48 * per_bucket.len());
    for (i, v) in per_bucket.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        push_policy_item(&mut policy, v, now_us);
        push_state_item(&mut state, v);
    }
    response_headers_to_add.push(header("ratelimit-policy", policy));
    response_headers_to_add.push(header("ratelimit", state));
}

/// Pushes `X-RateLimit-Limit`, `-Remaining` and `-Reset` of the verdict `v`.
fn push_x_ratelimit_headers(response_headers_to_add: &mut Vec<HeaderValue>, v: &Verdict<'_>) {
    response_headers_to_add.push(header("x-ratelimit-limit", decimal(v.limit.capacity())));
    response_headers_to_add.push(header("x-ratelimit-remaining", decimal(v.remaining_ut / MICRO)));
    response_headers_to_add.push(header(
        "x-ratelimit-reset",
        decimal(v.until_full_us.map_or(0, ceil_seconds)),
    ));
}

/// Pushes envoyproxy/ratelimit's three headers ([`LimitHeaders`]) from the status they pick:
/// the last `OVER_LIMIT` one outside quota mode, else the first with the fewest
/// `limit_remaining` among those with a `current_limit`; none when no status has one.
fn push_limit_headers(
    response_headers_to_add: &mut Vec<HeaderValue>,
    targets: &[Option<Target<'_>>],
    statuses: &[DescriptorStatus],
    names: &LimitHeaders,
) {
    let mut picked: Option<&DescriptorStatus> = None;
    let mut fewest = u32::MAX;
    for (s, t) in statuses.iter().zip(targets) {
        if s.current_limit.is_some() && s.limit_remaining < fewest {
            picked = Some(s);
            fewest = s.limit_remaining;
        }
        let quota = t.as_ref().is_some_and(|t| t.quota);
        if s.code == Code::OverLimit as i32 && !quota {
            picked = Some(s);
            fewest = 0;
        }
    }
    let Some((s, limit)) = picked.and_then(|s| Some((s, s.current_limit.as_ref()?))) else {
        return;
    };
    let reset = s.duration_until_reset.map_or(0, |d| d.seconds.max(0).unsigned_abs());
    response_headers_to_add.push(header(&names.limit, decimal(limit.requests_per_unit.into())));
    response_headers_to_add.push(header(&names.remaining, decimal(s.limit_remaining.into())));
    response_headers_to_add.push(header(&names.reset, decimal(reset)));
}

/// One bucket's verdict for the descriptor `descriptor`, from the store's decision.
fn verdict<'a>(
    descriptor: usize,
    policy: &'a BucketPolicy,
    instance: usize,
    demand: usize,
    kind: DemandKind,
    (shadow, global_shadow): (bool, bool),
    applied: &Applied,
) -> Verdict<'a> {
    let out = &applied.decision.instances[instance];
    let now = applied.now_us;
    let plan = &policy.plan;
    let passed = applied.decision.passed[demand];
    let need = policy.demand_kind(kind).need_ut(out.consumed_ut).unwrap_or(0);
    // Waits run from the state the store keeps, not from the one refilled to now: its refill
    // is floored (overstating a wait by up to a micro-token's refill time) and it cannot tell a
    // clock that stepped back (understating it).
    let kept = out.kept();
    Verdict {
        descriptor,
        policy,
        limit: policy.shown(plan.limit_at(now)),
        reported: policy.reported_at(now),
        // Global shadow mode shows the would-be denial in the status (as envoyproxy/ratelimit's
        // `SHADOW_MODE`); a rule's own shadow mode answers `OK` there.
        over: !passed && (!shadow || global_shadow),
        would_deny: !passed && shadow,
        remaining_ut: policy.balance_ut(out.after.tokens_ut),
        until_full_us: plan.reset_in_us(kept, now),
        retry_after_us: if passed { None } else { plan.wait_us(kept, need, now) },
    }
}

/// The verdict whose limit a descriptor's status reports, among its buckets that are not
/// hidden: its only one, or with several, a denying one when one denies, else the one with the
/// fewest tokens left, the first of those in the rule's order (docs/rules.md). `None` when
/// every bucket of the descriptor is hidden.
fn status_verdict<'v, 'a>(verdicts: &'v [Verdict<'a>], descriptor: usize) -> Option<&'v Verdict<'a>> {
    let mut own = verdicts
        .iter()
        .filter(|v| v.descriptor == descriptor && !v.policy.hidden);
    let first = own.next()?;
    Some(own.fold(first, |best, v| {
        let better = match (v.over, best.over) {
            (true, false) => true,
            (false, true) => false,
            _ => v.remaining_ut < best.remaining_ut,
        };
        if better {
            v
        } else {
            best
        }
    }))
}

/// The largest wait among the denied descriptors; `None` if any of them can never pass (a
/// wait that cannot succeed would mislead the client). Quota-mode descriptors count when every
/// one of them is over, and then by the shortest of their waits: the request passes again once
/// one of them does.
fn retry_after_us(targets: &[Option<Target<'_>>], verdicts: &[Verdict<'_>]) -> Option<u64> {
    let is_quota = |d: usize| targets[d].as_ref().is_some_and(|t| t.quota);
    let mut longest = 0;
    for v in verdicts.iter().filter(|v| v.over && !is_quota(v.descriptor)) {
        longest = longest.max(v.retry_after_us?);
    }
    let quota = (0..targets.len()).filter(|d| is_quota(*d));
    let over = |d: usize| verdicts.iter().any(|v| v.descriptor == d && v.over);
    if quota.clone().next().is_some() && quota.clone().all(over) {
        // Per quota-mode descriptor, its wait (the longest of its buckets'; `None`: never).
        let wait = |d: usize| {
            verdicts
                .iter()
                .filter(|v| v.descriptor == d && v.over)
                .try_fold(0, |w: u64, v| v.retry_after_us.map(|r| w.max(r)))
        };
        longest = longest.max(quota.filter_map(wait).min()?);
    }
    Some(longest)
}

/// One verdict per bucket name, in request order of first appearance: the one with the fewest
/// tokens left when several instances share a name. Hidden buckets are left out.
fn lowest_per_bucket<'v, 'a>(verdicts: &'v [Verdict<'a>]) -> Vec<&'v Verdict<'a>> {
    let mut out: Vec<&Verdict<'_>> = Vec::new();
    for v in verdicts.iter().filter(|v| !v.policy.hidden) {
        match out.iter_mut().find(|o| o.policy.name == v.policy.name) {
            Some(o) if v.remaining_ut < o.remaining_ut => *o = v,
            Some(_) => {}
            None => out.push(v),
        }
    }
    out
}

/// Appends a `RateLimit-Policy` item: `"name";q=<capacity>;w=<seconds to fill from empty>`
/// (draft-ietf-httpapi-ratelimit-headers-10 section 4), by the limit in force now; for a quota
/// `w` is its current period. `w` is left out for a bucket that never refills.
fn push_policy_item(out: &mut String, v: &Verdict<'_>, now_us: u64) {
    push_sf_string(out, &v.policy.name);
    out.push_str(";q=");
    out.push_str(itoa::Buffer::new().format(v.limit.capacity()));
    // A debt bucket's plan holds its floor's depth too; the window is the declared limit's.
    let token_bucket = !matches!(v.policy.plan.current(), Plan::Quota(_) | Plan::Expiring(_));
    let fill = if token_bucket && v.policy.debt_depth_ut > 0 {
        v.limit.window_us()
    } else {
        v.policy.plan.window_us(now_us)
    };
    if let Some(fill) = fill {
        out.push_str(";w=");
        out.push_str(itoa::Buffer::new().format(ceil_seconds(fill)));
    }
}

/// Appends a `RateLimit` item: `"name";r=<whole tokens left>;t=<seconds until full, rounded
/// up>` (draft-ietf-httpapi-ratelimit-headers-10 section 5). `t` is left out for a bucket that
/// never refills.
fn push_state_item(out: &mut String, v: &Verdict<'_>) {
    push_sf_string(out, &v.policy.name);
    out.push_str(";r=");
    out.push_str(itoa::Buffer::new().format(v.remaining_ut / MICRO));
    if let Some(t) = v.until_full_us {
        out.push_str(";t=");
        out.push_str(itoa::Buffer::new().format(ceil_seconds(t)));
    }
}

/// Appends a structured-field String (RFC 8941 section 3.3.3): quoted, with `"` and `\`
/// escaped. Bucket names are printable ASCII, checked at load.
fn push_sf_string(out: &mut String, s: &str) {
    out.push('"');
    // Names rarely hold either character: copied whole then, not pushed char by char.
    if s.bytes().any(|b| b == b'"' || b == b'\\') {
        for c in s.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
    } else {
        out.push_str(s);
    }
    out.push('"');
}

/// `n` in decimal, without the formatting machinery `to_string` goes through (every decision
/// writes three of these).
fn decimal(n: u64) -> String {
    itoa::Buffer::new().format(n).to_owned()
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue {
        key: key.to_owned(),
        value,
        ..Default::default()
    }
}

/// `DescriptorStatus.limit_remaining`, a `uint32` in the RLS proto: whole tokens, saturating
/// at `u32::MAX` (4,294,967,295) for a larger budget, whose headers carry the full number.
fn whole_tokens(ut: u64) -> u32 {
    u32::try_from(ut / MICRO).unwrap_or(u32::MAX)
}

/// Microseconds as whole seconds, rounded up, as `Retry-After` and the `RateLimit` headers
/// give them (a client that waits that long is never early).
pub(crate) fn ceil_seconds(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// `duration_until_reset`: whole seconds, rounded up, as the headers give them. Envoy keeps only
/// the whole seconds of this field for its `x-ratelimit-reset` header, so a sub-second wait
/// passed with its nanoseconds would read `0` on a 429 (and theirs only ever sends whole
/// seconds).
fn duration(us: u64) -> Duration {
    Duration {
        seconds: i64::try_from(ceil_seconds(us)).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structured_field_strings_are_quoted_and_escaped() {
        let sf = |name: &str| {
            let mut out = String::from("x=");
            push_sf_string(&mut out, name);
            out
        };
        assert_eq!(sf("per_client_ip"), r#"x="per_client_ip""#);
        assert_eq!(sf(""), r#"x="""#);
        assert_eq!(sf(r#"a"b\c"#), r#"x="a\"b\\c""#);
        assert_eq!(sf(r#""\"#), r#"x="\"\\""#);
    }

    #[test]
    fn decimals_are_written_without_formatting() {
        assert_eq!(decimal(0), "0");
        assert_eq!(decimal(u64::MAX), u64::MAX.to_string());
    }
}
