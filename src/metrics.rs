//! Prometheus metrics (docs/operations.md): the names, their labels, and the handles the decision path
//! keeps so that counting costs an atomic add, not a registry lookup.
//!
//! Names follow Prometheus conventions: a `tollgate_` prefix, `_total` on counters, base units
//! (`_seconds`). Label values are bounded: `domain` and `bucket` come from the loaded rules
//! (never from a request: a request for an unknown domain is counted without its name), `code`,
//! `result` and `backend` from fixed sets. No rule can opt runtime descriptor values into
//! tollgate's own labels; envoyproxy/ratelimit's `detailed_metric` only shapes their series,
//! within [`DETAILED_SERIES_MAX`].
//!
//! With `metrics.envoyproxy_names` (on when envoyproxy/ratelimit's environment is in use),
//! their series are exported too, named and labelled as their default Prometheus mapper names
//! them ([`EnvoyproxyStats`], [`envoyproxy_stat_key`]).
//!
//! Without an installed recorder (tests, `tollgate check`) every handle is a no-op.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, Counter, Gauge, Histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

use crate::bucket::{DemandKind, MICRO};
use crate::response::Target;
use crate::rules::RuleSet;
use crate::store::Applied;

/// `RateLimitRequest`s answered, by `code`: `ok`, `over_limit` (the `overall_code`),
/// `invalid_argument` (not a `RateLimitRequest` at all), `out_of_range` (a message over
/// `grpc.max_message_bytes`), `unavailable` (the backend failed).
pub const REQUESTS: &str = "tollgate_requests_total";
/// Time from a decoded request to its response, in seconds (histogram).
pub const REQUEST_DURATION: &str = "tollgate_request_duration_seconds";
/// Requests whose domain no rules file declares (answered OK).
pub const UNKNOWN_DOMAIN: &str = "tollgate_unknown_domain_requests_total";
/// Bucket decisions, one per descriptor and bucket it reaches, by `domain`, `bucket` and
/// `code`: `ok`, `near_limit` (admitted, with at least the near-limit ratio of the capacity
/// used), `over_limit`, `shadow_over_limit` (would have been over, but shadow mode), `refund`
/// (`is_negative_hits`). The codes exclude each other, so their sum is every decision.
pub const DECISIONS: &str = "tollgate_decisions_total";
/// Hits (`hits_addend` summed) by `domain`, `bucket` and the same `code`s as [`DECISIONS`];
/// a denial adds at most the capacity + 1 and a refund at most the capacity (what could
/// matter), whatever `hits_addend` says.
pub const HITS: &str = "tollgate_hits_total";
/// Calls to the backend, by `backend`.
pub const BACKEND_CALLS: &str = "tollgate_backend_calls_total";
/// Failed backend calls, by `backend` and `kind` (`error`, `timeout`).
pub const BACKEND_ERRORS: &str = "tollgate_backend_errors_total";
/// Backend call time in seconds, by `backend` (histogram).
pub const BACKEND_DURATION: &str = "tollgate_backend_call_duration_seconds";
/// Decisions taken by a fallback backend, by `backend` (the one that failed).
pub const BACKEND_FALLBACKS: &str = "tollgate_backend_fallbacks_total";
/// 1 while a backend's circuit breaker is open (calls are not tried), else 0, by `backend`.
pub const BACKEND_CIRCUIT_OPEN: &str = "tollgate_backend_circuit_open";
/// Counter `{answer}`: requests answered by `failure_mode` because the backend failed
/// (`allow`: OK without a decision; `deny`: OVER_LIMIT without one).
pub const BACKEND_FAILURE_ANSWERS: &str = "tollgate_backend_failure_answers_total";
/// Rules reloads by `result`: `success`, `failure` (the previous rules stay in force).
pub const RELOADS: &str = "tollgate_rules_reloads_total";
/// The generation of the rules in force: 1 at start, plus one per reload that took effect.
pub const RULES_GENERATION: &str = "tollgate_rules_generation";
/// 1 when the latest reload attempt succeeded (or none was made), 0 when it failed.
pub const LAST_RELOAD_SUCCESSFUL: &str = "tollgate_rules_last_reload_successful";
/// Unix time, in seconds, of the latest reload that took effect (or of the start).
pub const LAST_RELOAD_SUCCESS_TIME: &str = "tollgate_rules_last_reload_success_timestamp_seconds";
/// Buckets the memory store holds (not full).
pub const MEMORY_BUCKETS: &str = "tollgate_memory_buckets";
/// Buckets the memory store evicted before they were full, to stay under `max_buckets`; each
/// may let a client through early.
pub const MEMORY_EVICTED_NOT_FULL: &str = "tollgate_memory_evicted_not_full_total";
/// Malformed parts of requests, by `reason` (docs/rules.md, "Malformed requests"): one per
/// descriptor for a descriptor's reason (`no_entries`, `too_many_entries`, `empty_key`,
/// `value_too_long`, `override_unit`, `override_capped`), one per request for a request's
/// (`empty_domain`, `too_many_descriptors`), and one per message for `message_too_large`. None
/// of them makes the request an error Envoy would let through.
pub const MALFORMED: &str = "tollgate_malformed_total";
/// Always 1, with the `version` label.
pub const BUILD_INFO: &str = "tollgate_build_info";

/// envoyproxy/ratelimit's `ratelimit_service_rate_limit_total_hits`: hits (`hits_addend`) of
/// every decision of a rule with a limit, by `domain`, `key1`, `key2` ([`envoyproxy_labels`]).
pub const ERL_TOTAL_HITS: &str = "ratelimit_service_rate_limit_total_hits";
/// Their `_over_limit`: hits of denied decisions (in shadow mode too, as theirs counts).
pub const ERL_OVER_LIMIT: &str = "ratelimit_service_rate_limit_over_limit";
/// Their `_near_limit`: hits of admitted decisions that landed beyond the near-limit
/// threshold (`floor(capacity * near_limit_ratio)` tokens used).
pub const ERL_NEAR_LIMIT: &str = "ratelimit_service_rate_limit_near_limit";
/// Their `_within_limit`: hits of admitted decisions.
pub const ERL_WITHIN_LIMIT: &str = "ratelimit_service_rate_limit_within_limit";
/// Their `_shadow_mode`: hits a rule with `shadow_mode: true` would have denied.
pub const ERL_SHADOW_MODE: &str = "ratelimit_service_rate_limit_shadow_mode";
/// Their `ratelimit_service_should_rate_limit_error{err_type}`: requests answered with an
/// error because the backend failed (`err_type="redis_error"`, whatever the backend).
pub const ERL_SHOULD_RATE_LIMIT_ERROR: &str = "ratelimit_service_should_rate_limit_error";

static ENVOYPROXY_NAMES: AtomicBool = AtomicBool::new(false);

/// Turns envoyproxy/ratelimit's series on or off for rules registered from now on
/// (`metrics.envoyproxy_names`); `serve` sets it before loading rules.
pub fn set_envoyproxy_names(on: bool) {
    ENVOYPROXY_NAMES.store(on, Ordering::Relaxed);
    if on {
        counter!(ERL_SHOULD_RATE_LIMIT_ERROR, "err_type" => "redis_error").increment(0);
    }
}

/// Whether envoyproxy/ratelimit's series are exported.
pub fn envoyproxy_names() -> bool {
    ENVOYPROXY_NAMES.load(Ordering::Relaxed)
}

/// Counts a request that failed because the backend did, in
/// [`ERL_SHOULD_RATE_LIMIT_ERROR`] (when their names are on).
pub fn count_envoyproxy_backend_error() {
    if envoyproxy_names() {
        counter!(ERL_SHOULD_RATE_LIMIT_ERROR, "err_type" => "redis_error").increment(1);
    }
}

/// The stat key envoyproxy/ratelimit gives the rule on `node` of `domain`: the domain, then per
/// level from the top `key`, or `key_value` for a node with a value (a wildcard's pattern as
/// written, `*` included), joined by `.`; e.g. `edge.remote_address.path_/api/*`.
pub fn envoyproxy_stat_key(domain: &crate::rules::Domain, node: usize) -> String {
    envoyproxy_stat_keys(domain).swap_remove(node)
}

/// [`envoyproxy_stat_key`] of every node of `domain` (same index as its nodes), in one pass
/// over the tree: a domain of many rules is registered in linear time.
pub fn envoyproxy_stat_keys(domain: &crate::rules::Domain) -> Vec<String> {
    let mut names: Vec<String> = vec![String::new(); domain.nodes.len()];
    let levels = std::iter::once(&domain.root).chain(domain.nodes.iter().map(|n| &n.children));
    for level in levels {
        for (key, values) in &level.exact {
            for (value, n) in values {
                names[*n] = format!("{key}_{value}");
            }
        }
        for (key, pattern, n) in &level.wildcard {
            names[*n] = format!("{key}_{}", pattern.text());
        }
        for (key, n) in &level.any {
            names[*n] = key.clone();
        }
    }
    // A node's parent comes before it in the arena (compile pushes a node, then its children).
    let mut keys: Vec<String> = Vec::with_capacity(names.len());
    for (n, name) in names.iter().enumerate() {
        let prefix = match domain.nodes[n].parent {
            Some(p) if p < n => keys[p].clone(),
            Some(p) => envoyproxy_stat_key_walk(domain, &names, p),
            None => domain.name.clone(),
        };
        keys.push(format!("{prefix}.{name}"));
    }
    keys
}

/// The stat key of `node` by walking up to the top (for an arena not in parent-first order).
fn envoyproxy_stat_key_walk(domain: &crate::rules::Domain, names: &[String], node: usize) -> String {
    let mut path = vec![node];
    let mut at = node;
    while let Some(parent) = domain.nodes[at].parent {
        path.push(parent);
        at = parent;
    }
    let mut key = domain.name.clone();
    for &n in path.iter().rev() {
        key.push('.');
        key.push_str(&names[n]);
    }
    key
}

/// The labels their default Prometheus mapper gives a stat key (`domain.level1.level2...`):
/// `domain` and `key1` for one level; `domain`, `key1`, `key2` for two or more (deeper levels
/// are dropped). Their stat-name sanitizer runs first: `:` and `|` become `_`, and so do the
/// dots of anything shaped like an IPv4 address (`\d{1,3}` four times, joined by dots), so
/// `remote_address_10.0.0.1` stays one level. Any other `.` inside a value splits it into
/// levels, as it does in theirs.
pub fn envoyproxy_labels(stat_key: &str) -> Vec<(&'static str, String)> {
    let sanitized = ipv4_dots_to_underscores(&stat_key.replace([':', '|'], "_"));
    let parts: Vec<&str> = sanitized.split('.').collect();
    let mut labels = vec![("domain", parts[0].to_owned())];
    if let Some(k1) = parts.get(1) {
        labels.push(("key1", (*k1).to_owned()));
    }
    if let Some(k2) = parts.get(2) {
        labels.push(("key2", (*k2).to_owned()));
    }
    labels
}

/// `text` with the dots of every IPv4-shaped run replaced by `_`, matched as their sanitizer's
/// regular expression `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}` matches: leftmost first, each
/// `\d{1,3}` as long as the rest still matches, matches not overlapping.
fn ipv4_dots_to_underscores(text: &str) -> String {
    /// The end of a match of `groups` more dot-separated `\d{1,3}` starting at `at`.
    fn groups_end(b: &[u8], at: usize, groups: usize) -> Option<usize> {
        let digits = b[at..].iter().take(3).take_while(|c| c.is_ascii_digit()).count();
        (1..=digits).rev().find_map(|n| {
            let end = at + n;
            if groups == 1 {
                Some(end)
            } else if b.get(end) == Some(&b'.') {
                groups_end(b, end + 1, groups - 1)
            } else {
                None
            }
        })
    }
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match groups_end(b, i, 4) {
            Some(end) => {
                out.extend(b[i..end].iter().map(|&c| if c == b'.' { b'_' } else { c }));
                i = end;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    // Only ASCII dots were replaced, by an ASCII byte: still UTF-8.
    String::from_utf8(out).expect("ASCII replacements keep UTF-8")
}

/// One rule's envoyproxy/ratelimit-named counters. Each series is registered on its first count;
/// rules whose stat keys give the same labels (levels beyond the second) add up, as theirs do.
#[derive(Debug, Default)]
pub struct EnvoyproxyStats {
    inner: Option<Box<ErlLabelled>>,
}

#[derive(Debug)]
struct ErlLabelled {
    /// The rule's domain, for `detailed_metric` stat keys.
    domain: String,
    /// `detailed_metric: true` on the rule.
    detailed: bool,
    labels: Vec<metrics::Label>,
    /// `shadow_mode: true` on the rule itself (their `_shadow_mode` ignores global shadow mode).
    rule_shadow: bool,
    series: [OnceLock<Counter>; 5],
}

/// Most distinct `detailed_metric` stat keys (request values in labels) a process exports;
/// beyond it, decisions count under their rule's own series.
pub const DETAILED_SERIES_MAX: usize = 1000;

static DETAILED_KEYS: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Their per-rule series, in [`EnvoyproxyStats`] order.
pub const ENVOYPROXY_RULE_SERIES: [&str; 5] = ERL_NAMES;

const ERL_NAMES: [&str; 5] = [
    ERL_TOTAL_HITS,
    ERL_OVER_LIMIT,
    ERL_NEAR_LIMIT,
    ERL_WITHIN_LIMIT,
    ERL_SHADOW_MODE,
];

impl EnvoyproxyStats {
    /// The counters of a rule of `domain` with stat key `stat_key` ([`envoyproxy_stat_key`]);
    /// `detailed`: the rule has `detailed_metric: true` ([`EnvoyproxyStats::for_request`]).
    pub fn new(domain: &str, stat_key: &str, rule_shadow: bool, detailed: bool) -> EnvoyproxyStats {
        let labels = envoyproxy_labels(stat_key)
            .into_iter()
            .map(|(k, v)| metrics::Label::new(k, v))
            .collect();
        EnvoyproxyStats {
            inner: Some(Box::new(ErlLabelled {
                domain: domain.to_owned(),
                detailed,
                labels,
                rule_shadow,
                series: Default::default(),
            })),
        }
    }

    /// Where a decision for a descriptor with `entries` is counted: the rule's own series, or,
    /// for a rule with `detailed_metric: true`, series keyed as theirs by the request's entries
    /// (`domain.key_value.key_value...`; a `share_threshold` entry shows its pattern). Label sets
    /// are bounded: once [`DETAILED_SERIES_MAX`] detailed stat keys exist in the process, new
    /// ones are counted under their rule's own series.
    pub fn for_request(&self, entries: &[Entry], shared: &[Option<&str>]) -> Option<EnvoyproxyStats> {
        let l = self.inner.as_ref()?;
        if !l.detailed {
            return None;
        }
        let mut key = l.domain.clone();
        for (i, e) in entries.iter().enumerate() {
            key.push('.');
            key.push_str(&e.key);
            key.push('_');
            key.push_str(shared.get(i).copied().flatten().unwrap_or(&e.value));
        }
        let mut seen = DETAILED_KEYS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !seen.contains(&key) {
            if seen.len() >= DETAILED_SERIES_MAX {
                return None;
            }
            seen.insert(key.clone());
        }
        drop(seen);
        Some(EnvoyproxyStats::new(&l.domain, &key, l.rule_shadow, false))
    }

    /// Counters that count nothing.
    pub fn noop() -> &'static EnvoyproxyStats {
        static NOOP: EnvoyproxyStats = EnvoyproxyStats { inner: None };
        &NOOP
    }

    fn add(&self, which: usize, n: u64) {
        let Some(l) = &self.inner else { return };
        l.series[which]
            .get_or_init(|| metrics::counter!(ERL_NAMES[which], l.labels.clone()))
            .increment(n);
    }

    /// Counts one decision of `hits` hits as theirs would: `used_before` whole tokens of
    /// `capacity` were used before it, `admitted` whether the bucket (and its quota) had room.
    pub fn count(&self, hits: u64, capacity: u64, used_before: u64, admitted: bool, near_limit_ratio: f64) {
        let Some(l) = &self.inner else { return };
        self.add(0, hits);
        if admitted {
            // Their near-limit threshold, in tokens used; the hits past it are near the limit.
            let near = (capacity as f64 * near_limit_ratio).floor() as u64;
            let after = used_before + hits;
            if after > near {
                self.add(2, after - used_before.max(near));
            }
            self.add(3, hits);
        } else {
            self.add(1, hits);
            if l.rule_shadow {
                self.add(4, hits);
            }
        }
    }
}

/// Histogram buckets for the `_seconds` histograms: 50 µs to 1 s, dense around Envoy's 20 ms
/// filter timeout.
const SECONDS_BUCKETS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.05, 0.1, 0.25, 1.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global `metrics` recorder (once; later
/// calls return the same handle) and describes every metric. Call it before loading rules, so
/// the rules' counters register with it.
///
/// Errors: another `metrics` recorder is already installed in this process.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| anyhow::anyhow!("cannot install the metrics recorder: {e}"))?;
    describe();
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    // At zero from the start, so that `rate()` in an alert sees the first failure answer (a
    // series that appears with its first increment has no earlier sample to rate against).
    for answer in ["allow", "deny"] {
        counter!(BACKEND_FAILURE_ANSWERS, "answer" => answer).increment(0);
    }
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// Keeps the recorder's histograms drained; run it every few seconds.
pub async fn run_upkeep(handle: PrometheusHandle, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        handle.run_upkeep();
    }
}

fn describe() {
    describe_counter!(REQUESTS, "RateLimitRequests answered, by code");
    describe_histogram!(REQUEST_DURATION, Unit::Seconds, "Time to decide one RateLimitRequest");
    describe_counter!(UNKNOWN_DOMAIN, "Requests for a domain no rules file declares");
    describe_counter!(MALFORMED, "Malformed parts of requests, by reason (none is an error)");
    describe_counter!(DECISIONS, "Bucket decisions, one per descriptor and bucket, by code");
    describe_counter!(HITS, "Hits (hits_addend) per bucket decision code");
    describe_counter!(BACKEND_CALLS, "Calls to the bucket backend");
    describe_counter!(BACKEND_ERRORS, "Failed backend calls, by kind");
    describe_histogram!(BACKEND_DURATION, Unit::Seconds, "Backend call time");
    describe_counter!(BACKEND_FALLBACKS, "Decisions taken by the fallback backend");
    describe_gauge!(BACKEND_CIRCUIT_OPEN, "1 while the backend's circuit breaker is open");
    describe_counter!(
        BACKEND_FAILURE_ANSWERS,
        "Requests answered by failure_mode (allow or deny) because the backend failed"
    );
    describe_counter!(RELOADS, "Rules reloads, by result");
    describe_gauge!(RULES_GENERATION, "Generation of the rules in force");
    describe_gauge!(LAST_RELOAD_SUCCESSFUL, "1 if the latest rules reload succeeded");
    describe_gauge!(
        LAST_RELOAD_SUCCESS_TIME,
        Unit::Seconds,
        "Unix time of the latest rules load that took effect"
    );
    describe_gauge!(MEMORY_BUCKETS, "Buckets held by the memory store");
    describe_counter!(MEMORY_EVICTED_NOT_FULL, "Buckets evicted before they were full");
    describe_gauge!(BUILD_INFO, "Build information");
}

/// A decision's `code` label (see [`DECISIONS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionCode {
    /// Admitted, below the near-limit ratio.
    Ok,
    /// Admitted, at or above the near-limit ratio of the capacity used.
    NearLimit,
    /// Denied.
    OverLimit,
    /// Would have been denied; shadow mode admitted it.
    ShadowOverLimit,
    /// Tokens returned (`is_negative_hits`).
    Refund,
}

impl DecisionCode {
    /// Every code, in label order.
    pub const ALL: [DecisionCode; 5] = [
        DecisionCode::Ok,
        DecisionCode::NearLimit,
        DecisionCode::OverLimit,
        DecisionCode::ShadowOverLimit,
        DecisionCode::Refund,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionCode::Ok => "ok",
            DecisionCode::NearLimit => "near_limit",
            DecisionCode::OverLimit => "over_limit",
            DecisionCode::ShadowOverLimit => "shadow_over_limit",
            DecisionCode::Refund => "refund",
        }
    }
}

/// One bucket's [`DECISIONS`] and [`HITS`] counters, per [`DecisionCode`] (index: the code's
/// position in [`DecisionCode::ALL`]). Each series is registered on its first count, so
/// `/metrics` lists the codes a bucket has seen, not five series for every rule of a large
/// tree; after that a count is an atomic add. Cloning shares the counters.
#[derive(Clone, Debug, Default)]
pub struct DecisionCounters {
    inner: Option<Arc<Labelled>>,
}

#[derive(Debug)]
struct Labelled {
    domain: String,
    bucket: String,
    decisions: [OnceLock<Counter>; 5],
    hits: [OnceLock<Counter>; 5],
}

impl DecisionCounters {
    /// The counters of bucket `bucket` in domain `domain`, registered with the recorder
    /// installed when each is first counted (no-ops without one).
    pub fn new(domain: &str, bucket: &str) -> DecisionCounters {
        DecisionCounters {
            inner: Some(Arc::new(Labelled {
                domain: domain.to_owned(),
                bucket: bucket.to_owned(),
                decisions: Default::default(),
                hits: Default::default(),
            })),
        }
    }

    /// Shared counters that count nothing, for rules not registered by [`register_rules`].
    pub fn noop() -> &'static DecisionCounters {
        static NOOP: DecisionCounters = DecisionCounters { inner: None };
        &NOOP
    }

    /// Counts one decision of `hits` hits with `code`.
    pub fn count(&self, code: DecisionCode, hits: u64) {
        let Some(l) = &self.inner else { return };
        let i = code as usize;
        let make = |name: &'static str| counter!(name, "domain" => l.domain.clone(), "bucket" => l.bucket.clone(), "code" => code.as_str());
        l.decisions[i].get_or_init(|| make(DECISIONS)).increment(1);
        l.hits[i].get_or_init(|| make(HITS)).increment(hits);
    }
}

/// Gives every bucket of `rules` (and each domain's Envoy `limit` overrides, labelled
/// `bucket="override"`) its decision counters, so the decision path never builds labels.
/// Counters of a bucket that keeps its domain and name across a reload continue from their
/// values.
pub fn register_rules(rules: &mut RuleSet) {
    for domain in rules.domains.values_mut() {
        domain.counters = domain
            .buckets
            .iter()
            .map(|b| DecisionCounters::new(&domain.name, &b.name))
            .collect();
        domain.override_counters = DecisionCounters::new(&domain.name, crate::limiter::OVERRIDE_BUCKET);
        domain.envoyproxy_stats = if envoyproxy_names() {
            let keys = envoyproxy_stat_keys(domain);
            (0..domain.nodes.len())
                .map(|n| match &domain.nodes[n].rule {
                    Some(crate::rules::Rule::Limited { shadow, .. }) => {
                        EnvoyproxyStats::new(&domain.name, &keys[n], *shadow, domain.nodes[n].detailed_metric)
                    }
                    _ => EnvoyproxyStats::default(),
                })
                .collect()
        } else {
            Vec::new()
        };
    }
}

/// Counts each bucket decision of a request in its rule's [`DECISIONS`] and [`HITS`]: one per
/// descriptor and bucket (a quota beside a token bucket is a second decision). `code` is that
/// bucket's own verdict: a descriptor whose bucket had room is `ok` or `near_limit` even when
/// another descriptor denied the request. Near the limit: admitted with at least
/// `near_limit_ratio` of the capacity in force used after the decision.
pub fn count_decisions(targets: &[Option<Target<'_>>], applied: &Applied, near_limit_ratio: f64) {
    for t in targets.iter().flatten() {
        if let DemandKind::Consume(ut) = t.kind {
            let instance = &applied.decision.instances[t.instance];
            let capacity = t.policy.plan.limit_at(applied.now_us).capacity();
            let used_before = capacity.saturating_sub(instance.before.tokens_ut / MICRO);
            let admitted =
                applied.decision.passed[t.demand] && t.quota.as_ref().is_none_or(|q| applied.decision.passed[q.demand]);
            let detailed = t.envoyproxy.for_request(t.entries, &t.shared);
            detailed.as_ref().unwrap_or(t.envoyproxy).count(
                counted_hits(ut / MICRO, capacity, admitted),
                capacity,
                used_before,
                admitted,
                near_limit_ratio,
            );
        }
        let parts = std::iter::once((&*t.policy, t.instance, t.demand, t.counters))
            .chain(t.quota.as_ref().map(|q| (q.policy, q.instance, q.demand, q.counters)));
        for (policy, instance, demand, counters) in parts {
            let passed = applied.decision.passed[demand];
            let (hits_ut, refund) = match t.kind {
                DemandKind::Consume(ut) => (ut, false),
                DemandKind::Refund(ut) => (ut, true),
                DemandKind::Check => (0, false),
            };
            let code = if refund {
                DecisionCode::Refund
            } else if !passed && t.shadow {
                DecisionCode::ShadowOverLimit
            } else if !passed {
                DecisionCode::OverLimit
            } else {
                // In whole tokens, as `limit_remaining` reports them: the micro-tokens refilled
                // since the last decision must not hide the threshold.
                let capacity = policy.plan.limit_at(applied.now_us).capacity();
                let left = applied.decision.instances[instance].after.tokens_ut / MICRO;
                let used = capacity.saturating_sub(left) as f64;
                if capacity > 0 && used + 1e-9 >= near_limit_ratio * capacity as f64 {
                    DecisionCode::NearLimit
                } else {
                    DecisionCode::Ok
                }
            };
            let capacity = policy.plan.limit_at(applied.now_us).capacity();
            let hits = match t.kind {
                // A refund beyond the capacity gives back nothing more: the bucket is full.
                DemandKind::Refund(_) => (hits_ut / MICRO).min(capacity),
                _ => counted_hits(hits_ut / MICRO, capacity, passed),
            };
            counters.count(code, hits);
        }
    }
}

/// The hits one decision adds to [`HITS`] (and to envoyproxy/ratelimit's hit series): all of
/// them when admitted (at most the capacity, but for a shadow rule's would-be denials, which
/// are not admitted), and for a denial at most `capacity + 1`, the least that cannot pass: a
/// single request with `hits_addend` near 2^64 would otherwise add about 1.8e13 to a counter
/// whose rate is read as traffic.
fn counted_hits(hits: u64, capacity: u64, admitted: bool) -> u64 {
    if admitted {
        hits
    } else {
        hits.min(capacity.saturating_add(1))
    }
}

/// The request-level handles: [`REQUESTS`] by code, [`REQUEST_DURATION`].
#[derive(Clone, Debug)]
pub struct RequestMetrics {
    /// `code="ok"`.
    pub ok: Counter,
    /// `code="over_limit"`.
    pub over_limit: Counter,
    /// `code="invalid_argument"`.
    pub invalid: Counter,
    /// `code="unavailable"`.
    pub unavailable: Counter,
    /// [`REQUEST_DURATION`].
    pub duration: Histogram,
}

impl RequestMetrics {
    /// Handles registered with the installed recorder (no-ops without one).
    pub fn new() -> RequestMetrics {
        RequestMetrics {
            ok: counter!(REQUESTS, "code" => "ok"),
            over_limit: counter!(REQUESTS, "code" => "over_limit"),
            invalid: counter!(REQUESTS, "code" => "invalid_argument"),
            unavailable: counter!(REQUESTS, "code" => "unavailable"),
            duration: metrics::histogram!(REQUEST_DURATION),
        }
    }
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics::new()
    }
}

/// A backend's handles: [`BACKEND_CALLS`], [`BACKEND_ERRORS`], [`BACKEND_DURATION`], and its
/// circuit-breaker gauge, all labelled `backend`.
#[derive(Clone, Debug)]
pub struct BackendMetrics {
    /// Calls made.
    pub calls: Counter,
    /// Calls that failed with an error.
    pub errors: Counter,
    /// Calls that timed out.
    pub timeouts: Counter,
    /// Call time.
    pub duration: Histogram,
    /// 1 while the circuit is open.
    pub circuit_open: Gauge,
}

impl BackendMetrics {
    /// The handles for `backend` (`memory`, `redis`, `postgres`). Registers its error, timeout
    /// and fallback series at zero so that alerts on their rate see them from the start.
    pub fn new(backend: &'static str) -> BackendMetrics {
        let m = BackendMetrics {
            calls: counter!(BACKEND_CALLS, "backend" => backend),
            errors: counter!(BACKEND_ERRORS, "backend" => backend, "kind" => "error"),
            timeouts: counter!(BACKEND_ERRORS, "backend" => backend, "kind" => "timeout"),
            duration: metrics::histogram!(BACKEND_DURATION, "backend" => backend),
            circuit_open: gauge!(BACKEND_CIRCUIT_OPEN, "backend" => backend),
        };
        m.errors.increment(0);
        m.timeouts.increment(0);
        m.circuit_open.set(0.0);
        m
    }
}

/// Counts a request answered by `mode` because the backend failed, in
/// [`BACKEND_FAILURE_ANSWERS`]. Decision counters are left alone: no decision was taken.
pub fn count_failure_answer(mode: crate::settings::FailureMode) {
    let answer = match mode {
        crate::settings::FailureMode::Allow => "allow",
        crate::settings::FailureMode::Deny => "deny",
        crate::settings::FailureMode::Error => "error",
        crate::settings::FailureMode::Fallback => "fallback",
    };
    counter!(BACKEND_FAILURE_ANSWERS, "answer" => answer).increment(1);
    count_envoyproxy_backend_error();
}

/// The rules files are back to the rules in force after a failed reload (an invalid edit was
/// reverted): the latest attempt no longer stands, so `tollgate_rules_last_reload_successful`
/// reads 1 again; nothing was loaded, so no reload is counted and the generation stays.
pub fn reload_failure_cleared() {
    gauge!(LAST_RELOAD_SUCCESSFUL).set(1.0);
}

/// Records a rules load: `generation` is the generation now in force; `success` whether this
/// attempt took effect. The load at start counts as a success but not as a reload.
pub fn rules_loaded(generation: u64, success: bool, at_start: bool) {
    if !at_start {
        counter!(RELOADS, "result" => if success { "success" } else { "failure" }).increment(1);
    } else {
        counter!(RELOADS, "result" => "success").increment(0);
        counter!(RELOADS, "result" => "failure").increment(0);
    }
    gauge!(LAST_RELOAD_SUCCESSFUL).set(if success { 1.0 } else { 0.0 });
    if success {
        gauge!(RULES_GENERATION).set(generation as f64);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        gauge!(LAST_RELOAD_SUCCESS_TIME).set(now.as_secs_f64());
    }
}
