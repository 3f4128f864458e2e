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
//! them ([`EnvoyproxyStats`]; the stat keys are the rules' own, `rules::counters`).
//!
//! Without an installed recorder (tests, `tollgate check`) every handle is a no-op.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use metrics::{counter, gauge, Counter, Gauge, Histogram};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

pub mod call;
pub mod denials;
pub mod statsd;

/// `RateLimitRequest`s answered, by `code`: `ok`, `over_limit` (the `overall_code`),
/// `invalid_argument` (not a `RateLimitRequest` at all), `out_of_range` (a message over
/// `grpc.max_message_bytes`), `unavailable` (the backend failed, or no rules from the xDS
/// server yet).
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
/// Tokens debited from debt buckets by usage reports (docs/usage-budgets.md), by `domain` and
/// `bucket`: what was taken, down to the floor.
pub const DEBITED_TOKENS: &str = "tollgate_debited_tokens_total";
/// Tokens of usage reports that found a debt bucket at its floor, by `domain` and `bucket`:
/// usage counted here and nowhere else (a token only part of which fitted above the floor
/// counts here), so that with [`DEBITED_TOKENS`] it adds up to every token reported.
pub const DEBT_LOST_TOKENS: &str = "tollgate_debt_lost_tokens_total";
/// The debt, in tokens (0 when the balance is positive), of the instance of a debt bucket
/// decided last, by `domain` and `bucket`: one gauge per bucket name, however many clients.
pub const DEBT_TOKENS: &str = "tollgate_debt_tokens";
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
/// Requests a replica on a shared backend denied without a store call: the over-limit cache
/// showed the store would deny them (docs/backends.md, "Deciding locally").
pub const LOCAL_DENIALS: &str = "tollgate_local_denials_total";
/// Buckets the over-limit cache holds.
pub const LOCAL_CACHE_ENTRIES: &str = "tollgate_local_cache_entries";
/// Buckets the over-limit cache evicted at `local.over_limit_cache_entries` (their requests ask
/// the store again).
pub const LOCAL_CACHE_EVICTIONS: &str = "tollgate_local_cache_evictions_total";
/// Requests admitted on leased tokens alone, without a store call.
pub const LEASE_ADMISSIONS: &str = "tollgate_lease_admissions_total";
/// Store calls for token leases, by `kind`: `grant` (taking a lease), `return` (giving back
/// what a lease did not spend).
pub const LEASE_CALLS: &str = "tollgate_lease_calls_total";
/// Leased tokens a replica holds unspent, all buckets together.
pub const LEASE_TOKENS: &str = "tollgate_lease_tokens";
/// Redis Cluster: 1 while a master answers, 0 while it fails (its circuit open, or its
/// connections down), by `first_slot`, the first slot it serves (a bounded label that names no
/// address and stays when a replica takes over the master's slots).
pub const REDIS_CLUSTER_NODE_UP: &str = "tollgate_redis_cluster_node_up";
/// Redis Cluster: how many of the 16384 slots are lost now (their master failing, or none
/// known): their requests get the failure answer (or the fallback's decision).
pub const REDIS_CLUSTER_SLOTS_FAILING: &str = "tollgate_redis_cluster_slots_failing";
/// Redis Cluster: reads of the slot map (`CLUSTER SLOTS`) by `result`: `ok`, `error` (no node
/// answered).
pub const REDIS_CLUSTER_REFRESHES: &str = "tollgate_redis_cluster_slot_map_refreshes_total";
/// Redis Cluster: calls redirected by a node, by `kind`: `moved` (the slot has a new master:
/// a failover or a resharding), `ask` (a slot being migrated).
pub const REDIS_CLUSTER_REDIRECTS: &str = "tollgate_redis_cluster_redirects_total";
/// Rules reloads by `result`: `success`, `failure` (the previous rules stay in force).
pub const RELOADS: &str = "tollgate_rules_reloads_total";
/// The generation of the rules in force: 1 at start, plus one per reload that took effect.
pub const RULES_GENERATION: &str = "tollgate_rules_generation";
/// 1 when the latest reload attempt succeeded (or none was made), 0 when it failed.
pub const LAST_RELOAD_SUCCESSFUL: &str = "tollgate_rules_last_reload_successful";
/// Unix time, in seconds, of the latest reload that took effect (or of the start).
pub const LAST_RELOAD_SUCCESS_TIME: &str = "tollgate_rules_last_reload_success_timestamp_seconds";
/// Updates from the xDS server (`rules_source: xds`) by `result`: `ack` (in force, or the same
/// rules again), `nack` (refused; the rules in force stay).
pub const XDS_UPDATES: &str = "tollgate_xds_updates_total";
/// 1 while a connection to the xDS server is up, else 0.
pub const XDS_CONNECTED: &str = "tollgate_xds_connected";
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
/// Calls whose `traceparent` (or `b3`) header did not parse while tracing is on: each was
/// served under a new root span instead of the caller's (docs/monitoring.md, "Traces").
pub const TRACE_CONTEXT_INVALID: &str = "tollgate_trace_context_invalid_total";
/// Finished spans dropped because the export queue (`OTEL_BSP_MAX_QUEUE_SIZE`) was full: the
/// collector is slow or gone; decisions are never held up for it.
pub const TRACE_SPANS_DROPPED: &str = "tollgate_trace_spans_dropped_total";
/// Always 1, with the `version` label.
pub const BUILD_INFO: &str = "tollgate_build_info";
/// When the certificate a TLS listener serves expires (its notAfter), in Unix seconds, by
/// `listener` (`grpc`, `http`, `admin`): set at start and at each certificate reload.
pub const TLS_CERT_EXPIRY: &str = "tollgate_tls_certificate_expiry_timestamp_seconds";
/// Certificate reloads of a TLS listener by `listener` and `result`: `success` (changed files
/// loaded), `failure` (changed files that did not load, once per content; the certificate in
/// use stays).
pub const TLS_RELOADS: &str = "tollgate_tls_certificate_reloads_total";
/// TLS handshakes a listener failed or that timed out, by `listener`: a client without a
/// certificate where one is required, one from another CA or without the required name, a
/// client that does not trust tollgate's certificate, or no TLS at all.
pub const TLS_HANDSHAKE_FAILURES: &str = "tollgate_tls_handshake_failures_total";

/// Open RLQS streams (Envoy's Rate Limit Quota Service, docs/rlqs.md): one per Envoy filter
/// domain.
pub const RLQS_STREAMS: &str = "tollgate_rlqs_streams";
/// RLQS streams refused at `rlqs.max_streams`.
pub const RLQS_STREAMS_REFUSED: &str = "tollgate_rlqs_streams_refused_total";
/// Bucket usage reports received (one per bucket per report message).
pub const RLQS_REPORTS: &str = "tollgate_rlqs_reports_total";
/// Requests Envoys reported, by `outcome`: `allowed`, `denied` (by their assignments).
pub const RLQS_REPORTED_REQUESTS: &str = "tollgate_rlqs_reported_requests_total";
/// Report parts ignored, by `reason`: `empty_domain`, `empty_bucket_id`, `bad_duration`,
/// `absurd_count`, `too_many_buckets`, `slow_stream` (a stream whose Envoy did not read, ended).
pub const RLQS_IGNORED: &str = "tollgate_rlqs_ignored_total";
/// Bucket ids that no rule matched, by `reason`: `unknown_domain`, `no_rule`, `invalid`, `debt_bucket` (a rule with a debt bucket, not served over RLQS).
pub const RLQS_UNMATCHED: &str = "tollgate_rlqs_unmatched_total";
/// Envoy buckets bound on open streams.
pub const RLQS_BUCKETS: &str = "tollgate_rlqs_buckets";
/// Global buckets with Envoys on this replica.
pub const RLQS_GLOBAL_BUCKETS: &str = "tollgate_rlqs_global_buckets";
/// Assignments sent, by `strategy`: `token_bucket`, `allow_all`, `deny_all`, `abandon`.
pub const RLQS_ASSIGNMENTS: &str = "tollgate_rlqs_assignments_total";
/// Tokens the Envoys of this replica may still admit on what was paid for (their shares
/// outstanding), at the latest assignment round.
pub const RLQS_OUTSTANDING_TOKENS: &str = "tollgate_rlqs_outstanding_tokens";
/// Store calls paying for (or giving back) assignments, by `result`: `ok`, `error`.
pub const RLQS_STORE_CALLS: &str = "tollgate_rlqs_store_calls_total";

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
/// Their `ratelimit_service_config_load_success`: rules loads that took effect, the one at start
/// (or the first from the xDS server) included, as theirs counts its first configuration.
pub const ERL_CONFIG_LOAD_SUCCESS: &str = "ratelimit_service_config_load_success";
/// Their `ratelimit_service_config_load_error`: rules loads refused (files or an xDS update);
/// the rules in force stay.
pub const ERL_CONFIG_LOAD_ERROR: &str = "ratelimit_service_config_load_error";
/// Their `ratelimit_service_should_rate_limit_error{err_type}`: requests answered with an
/// error because the backend failed (`err_type="redis_error"`, whatever the backend).
pub const ERL_SHOULD_RATE_LIMIT_ERROR: &str = "ratelimit_service_should_rate_limit_error";

static ENVOYPROXY_NAMES: AtomicBool = AtomicBool::new(false);

static TRACES_ON: AtomicBool = AtomicBool::new(false);

/// Whether OpenTelemetry traces are exported (docs/monitoring.md, "Traces"): set once at start
/// by `traces::Traces::start`. The decision path and the stores make their spans only then, so
/// that with tracing off a decision pays one relaxed load instead of a span's bookkeeping.
#[inline]
pub fn traces_on() -> bool {
    TRACES_ON.load(Ordering::Relaxed)
}

/// The target prefix of the crate's spans, the only ones OpenTelemetry gets.
pub(crate) const OWN_TARGET: &str = "tollgate";

/// Whether the code running now is part of a sampled call, so that a child span it makes is
/// exported: traces are on and the current span is one of the crate's (a call makes its server
/// span, `traces::server_span`, only when its trace is sampled). One relaxed load while traces
/// are off; then the current span's lookup.
#[inline]
pub fn in_sampled_call() -> bool {
    traces_on()
        && tracing::dispatcher::get_default(|d| {
            d.current_span()
                .metadata()
                .is_some_and(|m| m.target().starts_with(OWN_TARGET))
        })
}

/// Sets what [`traces_on`] answers.
pub fn set_traces_on(on: bool) {
    TRACES_ON.store(on, Ordering::Relaxed);
}

/// Turns envoyproxy/ratelimit's series on or off for rules registered from now on
/// (`metrics.envoyproxy_names`); `serve` sets it before loading rules.
pub fn set_envoyproxy_names(on: bool) {
    ENVOYPROXY_NAMES.store(on, Ordering::Relaxed);
    if on {
        counter!(ERL_SHOULD_RATE_LIMIT_ERROR, "err_type" => "redis_error").increment(0);
        counter!(ERL_CONFIG_LOAD_SUCCESS).increment(0);
        counter!(ERL_CONFIG_LOAD_ERROR).increment(0);
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
    // A handle kept, not looked up: during an outage every request comes here.
    static REDIS_ERROR: OnceLock<statsd::StatsdCounter> = OnceLock::new();
    if statsd::enabled() {
        REDIS_ERROR.get_or_init(|| statsd::counter(statsd::REDIS_ERROR)).add(1);
    }
}

/// Counts a rules load under their names ([`ERL_CONFIG_LOAD_SUCCESS`] or
/// [`ERL_CONFIG_LOAD_ERROR`], and the statsd ones when that sink is on).
fn count_envoyproxy_config_load(success: bool) {
    if envoyproxy_names() {
        counter!(if success {
            ERL_CONFIG_LOAD_SUCCESS
        } else {
            ERL_CONFIG_LOAD_ERROR
        })
        .increment(1);
    }
    statsd::add(
        if success {
            statsd::CONFIG_LOAD_SUCCESS
        } else {
            statsd::CONFIG_LOAD_ERROR
        },
        1,
    );
}

/// `stat_key` as their stat-name sanitizer leaves it: `:` and `|` become `_`, and so do the
/// dots of anything shaped like an IPv4 address (see [`envoyproxy_labels`]).
pub fn sanitize_stat_key(stat_key: &str) -> String {
    ipv4_dots_to_underscores(&stat_key.replace([':', '|'], "_"))
}

/// The labels their default Prometheus mapper gives a stat key (`domain.level1.level2...`):
/// `domain` and `key1` for one level; `domain`, `key1`, `key2` for two or more (deeper levels
/// are dropped). Their stat-name sanitizer runs first: `:` and `|` become `_`, and so do the
/// dots of anything shaped like an IPv4 address (`\d{1,3}` four times, joined by dots), so
/// `remote_address_10.0.0.1` stays one level. Any other `.` inside a value splits it into
/// levels, as it does in theirs.
pub fn envoyproxy_labels(stat_key: &str) -> Vec<(&'static str, String)> {
    let sanitized = sanitize_stat_key(stat_key);
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

/// One rule's envoyproxy/ratelimit-named counters: their Prometheus series (with
/// `metrics.envoyproxy_names`) and their statsd counters (with `metrics.statsd`, [`statsd`]).
/// Each series is registered on its first count; rules whose stat keys give the same labels
/// (levels beyond the second) add up, as theirs do.
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
    /// Their Prometheus series, with `metrics.envoyproxy_names`.
    series: [OnceLock<Counter>; 5],
    /// Their statsd counters, with `metrics.statsd` (empty without).
    statsd: Vec<statsd::StatsdCounter>,
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
    /// The counters of a rule of `domain` with stat key `stat_key` (`rules::counters::envoyproxy_stat_key`);
    /// `detailed`: the rule has `detailed_metric: true` ([`EnvoyproxyStats::for_request`]).
    pub fn new(domain: &str, stat_key: &str, rule_shadow: bool, detailed: bool) -> EnvoyproxyStats {
        let labels = envoyproxy_labels(stat_key)
            .into_iter()
            .map(|(k, v)| metrics::Label::new(k, v))
            .collect();
        let statsd = if statsd::enabled() {
            statsd::RULE_STATS
                .iter()
                .map(|stat| statsd::counter(&statsd::rule_stat_name(stat_key, stat)))
                .collect()
        } else {
            Vec::new()
        };
        EnvoyproxyStats {
            inner: Some(Box::new(ErlLabelled {
                domain: domain.to_owned(),
                detailed,
                labels,
                rule_shadow,
                series: Default::default(),
                statsd,
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
        if envoyproxy_names() {
            l.series[which]
                .get_or_init(|| metrics::counter!(ERL_NAMES[which], l.labels.clone()))
                .increment(n);
        }
        if let Some(c) = l.statsd.get(which) {
            c.add(n);
        }
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
    debited: OnceLock<Counter>,
    lost: OnceLock<Counter>,
    debt: OnceLock<Gauge>,
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
                debited: OnceLock::new(),
                lost: OnceLock::new(),
                debt: OnceLock::new(),
            })),
        }
    }

    /// Shared counters that count nothing, for rules not registered (`rules::counters::register_rules`).
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

    /// Counts a debt bucket's usage reports of one decision: `debited` tokens taken, `lost`
    /// tokens that found it at its floor, and `debt` tokens owed after the decision
    /// ([`DEBITED_TOKENS`], [`DEBT_LOST_TOKENS`], [`DEBT_TOKENS`]).
    pub fn count_debt(&self, debited: u64, lost: u64, debt: u64) {
        let Some(l) = &self.inner else { return };
        let labels = || [("domain", l.domain.clone()), ("bucket", l.bucket.clone())];
        if debited > 0 {
            l.debited
                .get_or_init(|| counter!(DEBITED_TOKENS, &labels()))
                .increment(debited);
        }
        if lost > 0 {
            l.lost
                .get_or_init(|| counter!(DEBT_LOST_TOKENS, &labels()))
                .increment(lost);
        }
        l.debt.get_or_init(|| gauge!(DEBT_TOKENS, &labels())).set(debt as f64);
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

/// The Redis Cluster handles ([`REDIS_CLUSTER_NODE_UP`], [`REDIS_CLUSTER_SLOTS_FAILING`],
/// [`REDIS_CLUSTER_REFRESHES`], [`REDIS_CLUSTER_REDIRECTS`]).
#[derive(Clone, Debug)]
pub struct ClusterMetrics {
    refreshed: Counter,
    refresh_failed: Counter,
    moved: Counter,
    ask: Counter,
    slots_failing: Gauge,
    errors: Counter,
    timeouts: Counter,
}

impl ClusterMetrics {
    /// Registers the counters at zero and no slot failing.
    pub fn new() -> ClusterMetrics {
        let m = ClusterMetrics {
            refreshed: counter!(REDIS_CLUSTER_REFRESHES, "result" => "ok"),
            refresh_failed: counter!(REDIS_CLUSTER_REFRESHES, "result" => "error"),
            moved: counter!(REDIS_CLUSTER_REDIRECTS, "kind" => "moved"),
            ask: counter!(REDIS_CLUSTER_REDIRECTS, "kind" => "ask"),
            slots_failing: gauge!(REDIS_CLUSTER_SLOTS_FAILING),
            errors: counter!(BACKEND_ERRORS, "backend" => "redis", "kind" => "error"),
            timeouts: counter!(BACKEND_ERRORS, "backend" => "redis", "kind" => "timeout"),
        };
        for c in [&m.refreshed, &m.refresh_failed, &m.moved, &m.ask] {
            c.increment(0);
        }
        m.slots_failing.set(0.0);
        m
    }

    /// A read of the slot map, `ok` or not.
    pub fn refresh(&self, ok: bool) {
        if ok { &self.refreshed } else { &self.refresh_failed }.increment(1);
    }

    /// A call redirected: `moved` or `ask`.
    pub fn redirect(&self, kind: &'static str) {
        if kind == "ask" { &self.ask } else { &self.moved }.increment(1);
    }

    /// A master's failure that the fallback decided around (the request succeeded, so the
    /// store's own count does not see it): one more in [`BACKEND_ERRORS`] for `redis`, `kind`
    /// `timeout` or `error`.
    pub fn node_failed(&self, timeout: bool) {
        if timeout { &self.timeouts } else { &self.errors }.increment(1);
    }

    /// Whether the master whose first slot is `first_slot` answers.
    pub fn node_up(&self, first_slot: u16, up: bool) {
        gauge!(REDIS_CLUSTER_NODE_UP, "first_slot" => first_slot.to_string()).set(if up { 1.0 } else { 0.0 });
    }

    /// How many slots are lost now.
    pub fn slots_failing(&self, slots: usize) {
        self.slots_failing.set(slots as f64);
    }
}

impl Default for ClusterMetrics {
    fn default() -> Self {
        ClusterMetrics::new()
    }
}

/// The rules files are back to the rules in force after a failed reload (an invalid edit was
/// reverted): the latest attempt no longer stands, so `tollgate_rules_last_reload_successful`
/// reads 1 again; nothing was loaded, so no reload is counted and the generation stays.
pub fn reload_failure_cleared() {
    gauge!(LAST_RELOAD_SUCCESSFUL).set(1.0);
}

/// The xDS client starts: its series at zero (so `rate()` sees the first update), no rules
/// loaded yet (generation 0).
pub fn xds_started() {
    for result in ["ack", "nack"] {
        counter!(XDS_UPDATES, "result" => result).increment(0);
    }
    gauge!(XDS_CONNECTED).set(0.0);
    for result in ["success", "failure"] {
        counter!(RELOADS, "result" => result).increment(0);
    }
    gauge!(RULES_GENERATION).set(0.0);
    gauge!(LAST_RELOAD_SUCCESSFUL).set(1.0);
}

/// The connection to the xDS server went up or down.
pub fn xds_connected(up: bool) {
    gauge!(XDS_CONNECTED).set(if up { 1.0 } else { 0.0 });
}

/// An xDS update was ACKed (`true`) or NACKed.
pub fn xds_update(ack: bool) {
    counter!(XDS_UPDATES, "result" => if ack { "ack" } else { "nack" }).increment(1);
}

/// Records a rules load: `generation` is the generation now in force; `success` whether this
/// attempt took effect. The load at start counts as a success but not as a reload (in
/// envoyproxy/ratelimit's `config_load_success` it counts, as theirs counts its first load).
pub fn rules_loaded(generation: u64, success: bool, at_start: bool) {
    count_envoyproxy_config_load(success);
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

/// Records the certificate `listener` serves from now on, which expires at `not_after` (Unix
/// seconds): [`TLS_CERT_EXPIRY`], and a [`TLS_RELOADS`] success unless `at_start` (which sets
/// both of its series at zero).
pub fn tls_certificate_loaded(listener: &'static str, not_after: i64, at_start: bool) {
    gauge!(TLS_CERT_EXPIRY, "listener" => listener).set(not_after as f64);
    if at_start {
        counter!(TLS_RELOADS, "listener" => listener, "result" => "success").increment(0);
        counter!(TLS_RELOADS, "listener" => listener, "result" => "failure").increment(0);
        counter!(TLS_HANDSHAKE_FAILURES, "listener" => listener).increment(0);
    } else {
        counter!(TLS_RELOADS, "listener" => listener, "result" => "success").increment(1);
    }
}

/// Counts changed files of `listener` that did not load ([`TLS_RELOADS`] `failure`).
pub fn tls_reload_failed(listener: &'static str) {
    counter!(TLS_RELOADS, "listener" => listener, "result" => "failure").increment(1);
}

/// Counts a failed TLS handshake on `listener` ([`TLS_HANDSHAKE_FAILURES`]).
pub fn tls_handshake_failed(listener: &'static str) {
    counter!(TLS_HANDSHAKE_FAILURES, "listener" => listener).increment(1);
}
