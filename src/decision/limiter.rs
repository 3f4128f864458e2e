//! The decision path, independent of gRPC: a `RateLimitRequest` in, a `RateLimitResponse` out.
//!
//! 1. screen the request (bounds and required fields, docs/rules.md): a malformed part is
//!    counted in [`crate::telemetry::MALFORMED`] and decided as documented, never an error (an
//!    error is a failed check, which Envoy lets through by default: every other limit of the
//!    request with it);
//! 2. per descriptor, find the rule ([`crate::rules::matcher`]) or the Envoy `limit` override;
//! 3. drop rules that another matched rule `replaces`;
//! 4. build the distinct bucket instances and the demands on them (`hits_addend`);
//! 5. let the store decide all of them atomically;
//! 6. turn the decision into statuses and headers ([`crate::decision::response`]).
//!
//! [`Limiter::resolve`] runs steps 2 and 4 alone, for one descriptor, so that the admin API
//! ([`crate::admin`]) addresses exactly the bucket instances a request would.

use std::sync::Arc;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Struct;
use smallvec::SmallVec;
use tracing::Instrument;

use super::counting::{count_decisions, count_failure_answer};
use super::settings::{HeaderSettings, RequestLimits, ResponseSettings};
use crate::core::bucket::{Demand, DemandKind, Limit, Rate, MAX_CAPACITY, MICRO};
use crate::core::schedule::Plan;
use crate::core::units::envoy_unit_us;
use crate::decision::metadata::dynamic_metadata;
use crate::decision::quota_mode::QuotaWalk;
use crate::decision::response::{build_response, failure_response, Part, PolicyRef, Target};
use crate::rules::matcher::{find_node, find_rule, instance_key, shared_patterns};
use crate::rules::{BucketPolicy, Domain, ReportedLimit, Rule, RuleSet, OVERRIDE_BUCKET};
use crate::store::FailureMode;
use crate::store::{Applied, BucketRef, Store, StoreError};
use crate::telemetry::DecisionCounters;

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// The store failed. (A malformed request is never an error: its malformed parts are
    /// decided, see `Malformed`, so Envoy never fails open on one.)
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a descriptor addresses no bucket ([`Limiter::resolve`]).
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The domain or descriptor is malformed (empty domain, no entries, an empty key, more
    /// entries than the configured maximum), as a request would be.
    #[error("{0}")]
    Invalid(String),
    /// No rules are loaded for the domain.
    #[error("unknown domain {0:?}")]
    UnknownDomain(String),
    /// The descriptor reaches no rule of the domain: a request with it is not limited.
    #[error("no rule of domain {0:?} matches the descriptor")]
    NoRule(String),
    /// The descriptor reaches a rule with `unlimited: true`, which has no bucket. Holds the
    /// rule's path in the descriptor tree.
    #[error("rule {0} is unlimited: it has no bucket")]
    Unlimited(String),
}

/// A malformed part of a request, and how it is decided (docs/rules.md, "Malformed requests").
/// Each is counted in [`crate::telemetry::MALFORMED`] with [`Malformed::as_str`] as its `reason`
/// and logged at most once a second per reason; none makes the request an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Malformed {
    /// An empty domain: no rules file can declare it, so it is answered as an unknown domain
    /// (`OK`, no limits, no override).
    EmptyDomain,
    /// More descriptors than `limits.max_descriptors`: the first that many are decided, the
    /// rest denied (`OVER_LIMIT` without a limit), so the request is denied.
    TooManyDescriptors,
    /// A descriptor without entries: it reaches no rule (and no override applies), `OK`.
    NoEntries,
    /// More entries than `limits.max_entries`: the descriptor is denied.
    TooManyEntries,
    /// An entry with an empty key: decided as sent (no rule key is empty, so matching stops
    /// there; an override still applies).
    EmptyKey,
    /// A value longer than `limits.max_value_bytes`: cut to that length (at a character
    /// boundary), U+FFFD appended so it equals no rule value, and decided on its rule.
    ValueTooLong,
    /// An override with an unknown unit: the override is ignored, the descriptor decided on
    /// its rule.
    OverrideUnit,
    /// An override beyond what every backend computes exactly: capped (or rounded down), and
    /// applied as capped.
    OverrideCapped,
}

impl Malformed {
    /// Every reason, in `Malformed::index` order.
    pub(crate) const ALL: [Malformed; 8] = [
        Malformed::EmptyDomain,
        Malformed::TooManyDescriptors,
        Malformed::NoEntries,
        Malformed::TooManyEntries,
        Malformed::EmptyKey,
        Malformed::ValueTooLong,
        Malformed::OverrideUnit,
        Malformed::OverrideCapped,
    ];

    /// The `reason` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Malformed::EmptyDomain => "empty_domain",
            Malformed::TooManyDescriptors => "too_many_descriptors",
            Malformed::NoEntries => "no_entries",
            Malformed::TooManyEntries => "too_many_entries",
            Malformed::EmptyKey => "empty_key",
            Malformed::ValueTooLong => "value_too_long",
            Malformed::OverrideUnit => "override_unit",
            Malformed::OverrideCapped => "override_capped",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// At most one log line per second per [`Malformed`] reason, and the count left unlogged:
/// a client sending malformed requests at line rate must not turn into a log flood.
struct LogGate {
    /// Per reason, when it was last logged (ms since [`log_epoch`], 0: never).
    last_ms: [std::sync::atomic::AtomicU64; Malformed::ALL.len()],
    unlogged: [std::sync::atomic::AtomicU64; Malformed::ALL.len()],
}

static LOG_GATE: LogGate = LogGate {
    last_ms: [const { std::sync::atomic::AtomicU64::new(0) }; Malformed::ALL.len()],
    unlogged: [const { std::sync::atomic::AtomicU64::new(0) }; Malformed::ALL.len()],
};

fn log_epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

impl LogGate {
    /// `Some(unlogged since the last line)` when a line for `reason` may be written now.
    fn admit(&self, reason: Malformed) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let i = reason.index();
        // +1: 0 means "never logged".
        let now_ms = u64::try_from(log_epoch().elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1;
        let last = self.last_ms[i].load(Relaxed);
        if (last == 0 || now_ms.saturating_sub(last) >= 1_000)
            && self.last_ms[i].compare_exchange(last, now_ms, Relaxed, Relaxed).is_ok()
        {
            return Some(self.unlogged[i].swap(0, Relaxed));
        }
        self.unlogged[i].fetch_add(1, Relaxed);
        None
    }
}

thread_local! {
    /// While [`noting`] runs: the malformed parts found, instead of counting and logging them.
    static NOTES: std::cell::RefCell<Option<Vec<(Malformed, String)>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` (screening or preparing a request that is only explained) with the malformed
/// parts it finds added to `notes` rather than counted in [`crate::telemetry::MALFORMED`] and
/// logged: explaining a request is not serving one.
pub(super) fn noting<T>(notes: &mut Vec<(Malformed, String)>, f: impl FnOnce() -> T) -> T {
    /// Puts back what was there, even when `f` panics: a later request on this thread must
    /// be counted.
    struct Restore<'n> {
        notes: &'n mut Vec<(Malformed, String)>,
        before: Option<Vec<(Malformed, String)>>,
    }
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            let noted = NOTES.with(|n| n.replace(self.before.take()));
            *self.notes = noted.unwrap_or_default();
        }
    }
    let before = NOTES.with(|n| n.replace(Some(std::mem::take(notes))));
    let _restore = Restore { notes, before };
    f()
}

/// Counts a malformed part of a request and logs it, rate-limited. `detail` never holds a
/// descriptor value (values carry API keys and addresses) and is only built when logged (or
/// noted, while [`noting`]).
fn report(reason: Malformed, domain: &str, detail: impl FnOnce() -> String) {
    if NOTES.with(|n| n.borrow().is_some()) {
        let note = detail();
        NOTES.with(|n| n.borrow_mut().as_mut().map(|notes| notes.push((reason, note))));
        return;
    }
    metrics::counter!(crate::telemetry::MALFORMED, "reason" => reason.as_str()).increment(1);
    if let Some(also) = LOG_GATE.admit(reason) {
        // The domain is the client's too: a prefix is enough to find the route.
        let domain: String = domain.chars().take(64).collect();
        crate::telemetry::call::warn_about_call!(
            reason = reason.as_str(),
            %domain,
            also_unlogged = also,
            "malformed request part, decided anyway: {}",
            detail()
        );
    }
}

/// The bucket instances one descriptor reaches, found by [`Limiter::resolve`].
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The path of the rule in the domain's descriptor tree (`user`, `api_key.path=/upload`).
    pub rule: String,
    /// Whether the rule is evaluated in shadow mode (its own `shadow_mode` or the global one).
    pub shadow: bool,
    /// The instances, as the store is asked for them: one per bucket of the rule, in the
    /// rule's order (a calendar quota beside a token bucket right after it).
    pub buckets: Vec<BucketRef>,
    /// Per instance, in the same order, its policy: the bucket name and plan, and how its
    /// limit is reported to Envoy ([`BucketPolicy::reported_at`]).
    pub policies: Vec<BucketPolicy>,
}

/// Limiter behaviour that is not rules.
#[derive(Clone, Debug)]
pub struct LimiterOptions {
    /// Request bounds.
    pub limits: RequestLimits,
    /// Response headers to add.
    pub headers: HeaderSettings,
    /// Global shadow mode.
    pub shadow_mode: bool,
    /// The headers sent upstream when shadow mode let through a request it would have denied.
    pub shadow_headers: crate::decision::ShadowHeaderSettings,
    /// Honour Envoy's per-descriptor `limit` override.
    pub overrides: bool,
    /// Honour `is_negative_hits` refunds from the gRPC port. When false, a refund descriptor
    /// is answered `OK` (as a refund always is) without a bucket: nothing is given back, so a
    /// caller of the gRPC port cannot refill buckets; the rest of the request is decided as
    /// usual.
    pub refunds: bool,
    /// Decisions are counted `near_limit` from this fraction of the capacity used.
    pub near_limit_ratio: f64,
    /// What to answer when the store fails (`redis.failure_mode`; `Error` for memory, which
    /// does not fail).
    pub on_store_failure: FailureMode,
    /// envoyproxy/ratelimit's global quota mode and response dynamic metadata.
    pub response: ResponseSettings,
}

/// Rules plus a store: decides requests.
pub struct Limiter<S> {
    rules: ArcSwap<RuleSet>,
    store: S,
    options: LimiterOptions,
    /// [`crate::telemetry::UNKNOWN_DOMAIN`].
    unknown_domain: metrics::Counter,
}

/// What one descriptor was matched to, before the store is asked.
/// Policies are borrowed from the rules in force, so the hot path copies no names.
struct Matched<'r> {
    /// The rule's buckets, never empty, in the rule's order, with where each is counted.
    parts: SmallVec<[(PolicyRef<'r>, &'r DecisionCounters); 2]>,
    shadow: bool,
    /// The rule's own `quota_mode` (the global switch is added in [`demands_of`]).
    quota_mode: bool,
    /// The rule's `metadata`, for the response's dynamic metadata.
    metadata: Option<&'r Struct>,
    replaces: &'r [usize],
    /// The rule's buckets as indices into the domain's; empty for an Envoy `limit` override.
    bucket_indices: &'r [usize],
    /// Per entry, the `share_threshold` pattern standing for its value (usually empty).
    shared: Vec<Option<&'r str>>,
    /// The rule's node's envoyproxy/ratelimit-named counters.
    envoyproxy: &'r crate::telemetry::EnvoyproxyStats,
}

impl<'r> Matched<'r> {
    /// What a descriptor that ends on `node` (`depth` entries down) of `dom` is decided by;
    /// `None` for a node without a rule or with `unlimited: true`.
    fn at(dom: &'r Domain, node: usize, depth: usize) -> Option<Matched<'r>> {
        match &dom.nodes[node].rule {
            Some(Rule::Limited {
                buckets,
                shadow,
                quota_mode,
                replaces,
            }) => Some(Matched {
                parts: buckets
                    .iter()
                    .map(|b| (PolicyRef::Rule(&dom.buckets[*b]), dom.counters_of(*b)))
                    .collect(),
                shadow: *shadow,
                quota_mode: *quota_mode,
                metadata: dom.nodes[node].metadata.as_ref(),
                replaces,
                bucket_indices: buckets,
                shared: shared_patterns(dom, node, depth),
                envoyproxy: dom.envoyproxy_stats_of(node),
            }),
            _ => None,
        }
    }

    /// The instance key of the rule's bucket `policy` for a descriptor with `entries` in
    /// `domain`. An override's key also carries its limit (`#<requests_per_unit>/<UNIT>`), so
    /// overrides of different limits never share an instance.
    fn key(&self, domain: &str, policy: &BucketPolicy, entries: &[Entry]) -> String {
        let is_override = self.bucket_indices.is_empty();
        let extra = if is_override { 16 } else { 0 } + if policy.debt { 24 } else { 0 };
        let mut key = String::with_capacity(key_capacity(domain, &policy.name, entries) + extra);
        instance_key(&mut key, domain, &policy.name, entries, &self.shared);
        if policy.debt {
            // Stored tokens are the balance plus the floor's depth: another depth reads them
            // differently, so a changed floor (or `debt` itself) starts the accounts afresh.
            key.push_str("#debt");
            key.push_str(itoa::Buffer::new().format(policy.debt_depth_ut));
        }
        if is_override {
            key.push('#');
            key.push_str(itoa::Buffer::new().format(policy.reported.requests_per_unit));
            key.push('/');
            key.push_str(policy.reported.unit.as_str_name());
        }
        key
    }
}

impl<S: Store> Limiter<S> {
    /// A limiter over `rules` and `store`.
    pub fn new(rules: RuleSet, store: S, options: LimiterOptions) -> Limiter<S> {
        Limiter {
            rules: ArcSwap::from_pointee(rules),
            store,
            options,
            unknown_domain: metrics::counter!(crate::telemetry::UNKNOWN_DOMAIN),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The options it decides with.
    pub fn options(&self) -> &LimiterOptions {
        &self.options
    }

    /// The rules in force.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.load_full()
    }

    /// Replaces the rules in force; requests already being decided finish on the old ones.
    ///
    /// Rates change from now on, by the store's clock ([`RuleSet::carry_history`]): a bucket
    /// policy whose limit changed brings its buckets forward under the old limit up to now.
    /// The store is told twice ([`Store::rules_changed`]): now, and once the last request that
    /// loaded the old rules is done ([`Store::on_rules_retired`]), so that what such a request
    /// writes after the swap is not trusted as if the new rules had written it.
    pub fn swap_rules(&self, mut rules: RuleSet) {
        let old = self.rules.load_full();
        rules.carry_history(&old, self.store.clock_estimate_us());
        if let Some(hook) = self.store.on_rules_retired() {
            old.on_retire.set(hook);
        }
        drop(old);
        self.rules.store(Arc::new(rules));
        self.store.rules_changed();
    }

    /// Decides one request. A malformed part of it (see `Malformed`) is counted, logged at a
    /// bounded rate and decided as documented there; it never makes the request an error.
    ///
    /// Errors: [`LimitError::Store`] when the store fails (and `on_store_failure` says to
    /// answer an error).
    pub async fn should_rate_limit(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, LimitError> {
        let screened = screen(req, &self.options.limits);
        let rules = self.rules.load();
        // An empty domain cannot be declared by a rules file: it is an unknown one.
        let domain = if screened.empty_domain {
            None
        } else {
            rules.domain(&req.domain)
        };
        if domain.is_none() && !screened.empty_domain {
            self.unknown_domain.increment(1);
            crate::telemetry::statsd::count_domain_not_found(&req.domain, req.descriptors.len());
        }
        // Descriptors denied as malformed make the request denied: the others are then only
        // checked, so that, as for any denied request, nothing is consumed anywhere (global
        // shadow mode denies nothing, so there they are decided as usual).
        let denying = screened.denies() && !self.options.shadow_mode;
        // Child spans of a sampled call's server span; none otherwise (one relaxed load while
        // tracing is off).
        let traced = crate::telemetry::in_sampled_call();
        let matching = traced.then(|| tracing::debug_span!(target: "tollgate::decision", "match_rules").entered());
        let mut prepared = prepare(req, &screened, domain, &self.options, denying);
        drop(matching);
        let metadata = self.options.response.dynamic_metadata;
        let unlimited = prepared.unlimited.take();
        let finish = |resp: RateLimitResponse, targets: &[Option<Target<'_>>]| {
            let unlimited = unlimited.as_deref().map_or(&[][..], Vec::as_slice);
            finish(resp, req, &screened, denying, unlimited, metadata, targets)
        };
        if prepared.buckets.is_empty() {
            let resp = build_response(
                &prepared.targets,
                None,
                &self.options.headers,
                &self.options.shadow_headers,
            );
            return Ok(finish(resp, &prepared.targets));
        }
        let applied = if traced {
            let buckets = prepared.buckets.len();
            in_store_span(self.apply(&mut prepared, denying), buckets).await
        } else {
            self.apply(&mut prepared, denying).await
        };
        let applied = match applied {
            Ok(applied) => applied,
            Err(e) => {
                let answer = store_failure_answer(&prepared.targets, e, self.options.on_store_failure)?;
                return Ok(finish(answer, &prepared.targets));
            }
        };
        count_decisions(&prepared.targets, &applied, self.options.near_limit_ratio);
        let resp = build_response(
            &prepared.targets,
            Some(&applied),
            &self.options.headers,
            &self.options.shadow_headers,
        );
        Ok(finish(resp, &prepared.targets))
    }

    /// The store's decision on `prepared`. With quota-mode descriptors (none unless a rule or
    /// the global switch asks for them) the request stands on one of them at a time, each call
    /// all or nothing ([`super::quota_mode`]): a denied call changes nothing, so trying the next
    /// quota-mode descriptor that passes costs another call, never a refund; refunds are
    /// given on the first call only.
    async fn apply(&self, prepared: &mut Prepared<'_>, denying: bool) -> Result<Applied, StoreError> {
        let Some(mut walk) = QuotaWalk::start(&prepared.targets, &mut prepared.demands, denying) else {
            return self.store.apply(&prepared.buckets, &prepared.demands).await;
        };
        // At most one call per quota-mode descriptor, so contention cannot keep a request going.
        loop {
            let applied = self.store.apply(&prepared.buckets, &prepared.demands).await?;
            if !walk.again(&prepared.targets, &mut prepared.demands, &applied.decision) {
                return Ok(applied);
            }
        }
    }

    /// The bucket instances a request descriptor with `entries` in `domain` reaches under the
    /// rules in force, by the same matching and instance keys as [`Self::should_rate_limit`]
    /// (wildcards, `share_threshold`, a quota beside a token bucket as `<name>.quota`): what the
    /// admin API peeks at, refunds and resets. Touches no bucket.
    ///
    /// Envoy `limit` overrides are not addressable: their buckets exist only for the requests
    /// that carry them, so a descriptor here is always matched against the rules (`replaces`,
    /// which drops a rule only when another matches in the same request, does not apply
    /// either).
    ///
    /// Errors: [`ResolveError::Invalid`] for an empty domain or key, no entries or more than
    /// the configured maximum; [`ResolveError::UnknownDomain`], [`ResolveError::NoRule`] and
    /// [`ResolveError::Unlimited`] when the descriptor addresses no bucket.
    pub fn resolve(&self, domain: &str, entries: &[Entry]) -> Result<Resolved, ResolveError> {
        if domain.is_empty() {
            return Err(ResolveError::Invalid("domain must not be empty".into()));
        }
        check_entries(entries, &self.options.limits).map_err(|e| ResolveError::Invalid(format!("descriptor {e}")))?;
        // The same cut as a request's, so an over-long value addresses the bucket it reaches.
        let cut;
        let entries = if entries
            .iter()
            .any(|e| e.value.len() > self.options.limits.max_value_bytes)
        {
            cut = cut_values(entries, self.options.limits.max_value_bytes);
            &cut[..]
        } else {
            entries
        };
        let rules = self.rules.load();
        let dom = rules
            .domain(domain)
            .ok_or_else(|| ResolveError::UnknownDomain(domain.to_owned()))?;
        let no_rule = || ResolveError::NoRule(domain.to_owned());
        let node = find_node(dom, entries).ok_or_else(no_rule)?;
        let Some(m) = Matched::at(dom, node, entries.len()) else {
            return Err(match find_rule(dom, entries) {
                Some(Rule::Unlimited { .. }) => ResolveError::Unlimited(dom.nodes[node].path.clone()),
                _ => no_rule(),
            });
        };
        let buckets = m
            .parts
            .iter()
            .map(|(policy, _)| BucketRef {
                key: m.key(domain, policy, entries),
                plan: policy.plan.clone(),
                lease_ut: policy.lease_ut,
            })
            .collect();
        let policies = m.parts.iter().map(|(policy, _)| BucketPolicy::clone(policy)).collect();
        Ok(Resolved {
            rule: dom.nodes[node].path.clone(),
            shadow: m.shadow || self.options.shadow_mode,
            buckets,
            policies,
        })
    }
}

/// The last touches of the response to `req` (screened as `screened`, `denying` when a
/// malformed part denies it): `limit_remaining` at the `uint32` maximum for the `unlimited`
/// descriptors, the malformed descriptors denied, and the dynamic metadata when `metadata`.
pub(super) fn finish(
    mut resp: RateLimitResponse,
    req: &RateLimitRequest,
    screened: &Screened,
    denying: bool,
    unlimited: &[usize],
    metadata: bool,
    targets: &[Option<Target<'_>>],
) -> RateLimitResponse {
    for &i in unlimited {
        if let Some(s) = resp.statuses.get_mut(i) {
            s.limit_remaining = u32::MAX;
        }
    }
    if denying {
        screened.deny(&mut resp);
    }
    if metadata {
        resp.dynamic_metadata = Some(dynamic_metadata(req, targets, &resp.statuses));
    }
    resp
}

/// A request's call on the store, prepared from the request and the rules alone: the
/// distinct bucket instances, the demands on them, and per descriptor its target (`None`: no
/// limit applies). It is alive across the store's await, so part of the future tonic boxes and
/// moves: the inline buffers are kept to what the store is handed.
pub(super) struct Prepared<'a> {
    pub(super) buckets: SmallVec<[BucketRef; 4]>,
    pub(super) demands: SmallVec<[Demand; 4]>,
    pub(super) targets: Vec<Option<Target<'a>>>,
    /// The indices of the descriptors that reached an `unlimited` rule: answered `OK` with
    /// `limit_remaining` at the `uint32` maximum, as envoyproxy/ratelimit answers them. Boxed
    /// (8 bytes, and no allocation unless a descriptor is unlimited) because it is held across
    /// the store call, and every byte of the decision's future is copied per request.
    #[allow(clippy::box_collection)] // the box is the point: a pointer's width in the future
    pub(super) unlimited: Option<Box<Vec<usize>>>,
}

/// Prepares the store's call for `req` (screened as `screened`, in `domain` when known): every
/// descriptor matched, replaced rules dropped, demands only checked while `denying`. Touches
/// no bucket.
pub(super) fn prepare<'a>(
    req: &'a RateLimitRequest,
    screened: &'a Screened,
    domain: Option<&'a Domain>,
    options: &LimiterOptions,
    denying: bool,
) -> Prepared<'a> {
    let mut unlimited = None;
    let matched = match_descriptors(req, screened, domain, options, &mut unlimited);
    // Built in place: a `Prepared` moved after it is built is a copy of a few hundred bytes
    // per request.
    demands_of(req, screened, matched, options, denying, unlimited)
}

/// Per descriptor of `req`, what decides it (`None`: nothing), the rules another matched rule
/// `replaces` already dropped; the descriptors that reached an `unlimited` rule are marked in
/// `unlimited` ([`Prepared::unlimited`]).
#[allow(clippy::box_collection)] // see `Prepared::unlimited`
fn match_descriptors<'a>(
    req: &'a RateLimitRequest,
    screened: &'a Screened,
    domain: Option<&'a Domain>,
    options: &LimiterOptions,
    unlimited: &mut Option<Box<Vec<usize>>>,
) -> Vec<Option<Matched<'a>>> {
    let mut matched: Vec<Option<Matched>> = Vec::with_capacity(req.descriptors.len());
    // Buckets named by the `replaces` of matched unlimited rules (they match nothing else).
    let mut unlimited_replaces: SmallVec<[usize; 4]> = SmallVec::new();
    for (i, d) in req.descriptors.iter().enumerate() {
        if screened.skipped(i) || (d.is_negative_hits && !options.refunds) {
            // Skipped by the screen; or a refund refused (`refunds: false`): answered OK
            // as a refund always is, nothing given back, no bucket (nor its `replaces`)
            // involved.
            matched.push(None);
            continue;
        }
        let entries = screened.entries(i, d);
        // As in envoyproxy/ratelimit, an unknown domain is OK before overrides are looked at.
        let by_override = match (&d.limit, options.overrides && domain.is_some()) {
            (Some(o), true) => override_matched(&req.domain, i, o, domain),
            _ => None,
        };
        let m = by_override.or_else(|| {
            domain.and_then(|dom| {
                let node = find_node(dom, entries)?;
                if let Some(Rule::Unlimited { replaces }) = &dom.nodes[node].rule {
                    unlimited_replaces.extend_from_slice(replaces);
                    unlimited.get_or_insert_with(Box::default).push(i);
                }
                Matched::at(dom, node, entries.len())
            })
        });
        matched.push(m);
    }
    drop_replaced(&mut matched, &unlimited_replaces);
    matched
}

/// What decides descriptor `i` of a request to `request_domain` (`domain`, known) by Envoy's
/// `limit` override `o`; `None` when its unit is unknown and the override is ignored.
fn override_matched<'a>(
    request_domain: &str,
    i: usize,
    o: &RateLimitOverride,
    domain: Option<&'a Domain>,
) -> Option<Matched<'a>> {
    match override_policy(o.requests_per_unit, o.unit) {
        Ok((policy, capped)) => {
            if capped {
                report(Malformed::OverrideCapped, request_domain, || {
                    format!(
                        "descriptor {i}: override of {} per unit capped to {} per unit",
                        o.requests_per_unit, policy.reported.requests_per_unit
                    )
                });
            }
            Some(Matched {
                parts: smallvec::smallvec![(
                    PolicyRef::Override(std::sync::Arc::new(policy)),
                    domain.map_or(DecisionCounters::noop(), |d| &d.override_counters)
                )],
                shadow: false,
                // As in envoyproxy/ratelimit: an override is in quota mode only by the global
                // switch, and carries no metadata.
                quota_mode: false,
                metadata: None,
                replaces: &[],
                bucket_indices: &[],
                shared: Vec::new(),
                // Their override series are named by the request's values: unbounded.
                envoyproxy: crate::telemetry::EnvoyproxyStats::noop(),
            })
        }
        Err(()) => {
            report(Malformed::OverrideUnit, request_domain, || {
                format!("descriptor {i}: override with unknown unit {}, ignored", o.unit)
            });
            None
        }
    }
}

/// The instances and demands of the `matched` descriptors of `req`, and their targets; a
/// consuming demand is only a check while `denying`.
#[allow(clippy::box_collection)] // see `Prepared::unlimited`
fn demands_of<'a>(
    req: &'a RateLimitRequest,
    screened: &'a Screened,
    matched: Vec<Option<Matched<'a>>>,
    options: &LimiterOptions,
    denying: bool,
    unlimited: Option<Box<Vec<usize>>>,
) -> Prepared<'a> {
    let mut buckets: SmallVec<[BucketRef; 4]> = SmallVec::new();
    let mut targets: Vec<Option<Target>> = Vec::with_capacity(matched.len());
    let mut demands: SmallVec<[Demand; 4]> = SmallVec::new();
    for (d, m) in req.descriptors.iter().zip(matched) {
        let Some(mut m) = m else {
            targets.push(None);
            continue;
        };
        if d.hits_addend.is_some() && !d.is_negative_hits {
            // A descriptor with its own `hits_addend` (a check or a usage report) on a
            // `rate_limit` of their schema is counted as envoyproxy/ratelimit counts it: on the
            // bucket and on its account (counted once, on the bucket). A refund gives back to
            // the bucket alone, as the request's own hits take from it.
            let mut accounts: SmallVec<[(PolicyRef<'_>, &DecisionCounters); 2]> = SmallVec::new();
            for (policy, _) in &mut m.parts {
                if let PolicyRef::Rule(BucketPolicy {
                    over_account: Some(own),
                    ..
                }) = policy
                {
                    *policy = PolicyRef::Rule(&own.bucket);
                    accounts.push((PolicyRef::Rule(&own.account), DecisionCounters::noop()));
                }
            }
            m.parts.extend(accounts);
        }
        let entries = screened.entries(targets.len(), d);
        let kind = match demand_kind(d, req.hits_addend) {
            DemandKind::Consume(_) if denying => DemandKind::Check,
            kind => kind,
        };
        let shadow = m.shadow || options.shadow_mode;
        // A refund is never over a limit: it takes no part in quota mode's rule.
        let quota = (m.quota_mode || options.response.quota_mode) && !matches!(kind, DemandKind::Refund(_));
        let keys: SmallVec<[String; 2]> = m.parts.iter().map(|(p, _)| m.key(&req.domain, p, entries)).collect();
        let mut parts = SmallVec::new();
        for ((policy, counters), key) in m.parts.into_iter().zip(keys) {
            // A quota-mode demand is enforced only while it is the one the request stands on
            // (`super::quota_mode`).
            let enforced = !shadow && !quota;
            let own = policy.demand_kind(kind);
            let (instance, demand) = add_demand(
                &mut buckets,
                &mut demands,
                key,
                (&policy.plan, policy.lease_ut),
                own,
                enforced,
            );
            parts.push(Part {
                policy,
                instance,
                demand,
                counters,
            });
        }
        targets.push(Some(Target {
            parts,
            kind,
            shadow,
            global_shadow: options.shadow_mode && !m.shadow,
            quota,
            metadata: m.metadata,
            envoyproxy: m.envoyproxy,
            entries,
            shared: m.shared,
        }));
    }
    Prepared {
        buckets,
        demands,
        targets,
        unlimited,
    }
}

/// The answer `on_store_failure` gives when the store failed with `e`.
///
/// Errors: [`LimitError::Store`] when it says to answer an error.
fn store_failure_answer(
    targets: &[Option<Target<'_>>],
    e: StoreError,
    on_store_failure: FailureMode,
) -> Result<RateLimitResponse, LimitError> {
    let answer = match on_store_failure {
        FailureMode::Allow => failure_response(targets, false),
        FailureMode::Deny => failure_response(targets, true),
        // The store falls back by itself; an error that still comes back has
        // nothing left to decide on.
        FailureMode::Error | FailureMode::Fallback => return Err(e.into()),
    };
    count_failure_answer(on_store_failure);
    Ok(answer)
}

/// About the length of an instance key (its parts and their length prefixes), so building it
/// allocates once.
fn key_capacity(domain: &str, bucket: &str, entries: &[Entry]) -> usize {
    let parts: usize = entries.iter().map(|e| e.key.len() + e.value.len() + 12).sum();
    domain.len() + bucket.len() + 12 + parts
}

/// Adds a demand of `kind` (`enforced`: it can deny) on the instance `key` (shared with an earlier descriptor of the
/// request that reached the same instance) of a bucket following `plan` and leased `lease_ut` at a time
/// ([`BucketRef::lease_ut`]); returns the indices of the instance and the demand.
fn add_demand(
    buckets: &mut SmallVec<[BucketRef; 4]>,
    demands: &mut SmallVec<[Demand; 4]>,
    key: String,
    (plan, lease_ut): (&Plan, u64),
    kind: DemandKind,
    enforced: bool,
) -> (usize, usize) {
    let instance = match buckets.iter().position(|b| b.key == key) {
        Some(i) => i,
        None => {
            buckets.push(BucketRef {
                key,
                plan: plan.clone(),
                lease_ut,
            });
            buckets.len() - 1
        }
    };
    demands.push(Demand {
        instance,
        kind,
        enforced,
    });
    (instance, demands.len() - 1)
}

/// `hits_addend`: the descriptor's own (a wrapped `UInt64Value`, so an explicit 0 is a
/// non-consuming check) when present, else the request's, where 0 means 1 (proto3 cannot
/// tell 0 from unset and Envoy sends 0). `is_negative_hits` turns it into a refund.
fn demand_kind(d: &RateLimitDescriptor, request_hits: u32) -> DemandKind {
    let hits = match &d.hits_addend {
        Some(v) => v.value,
        None => u64::from(request_hits.max(1)),
    };
    let micro = hits.saturating_mul(MICRO);
    match (d.is_negative_hits, hits) {
        (true, _) => DemandKind::Refund(micro),
        (false, 0) => DemandKind::Check,
        (false, _) => DemandKind::Consume(micro),
    }
}

/// Envoy's `RateLimitOverride`: a bucket of `requests_per_unit` refilled that many per unit,
/// and whether the count had to be brought within bounds.
///
/// Overrides come from Envoy's configuration, not from a rules file tollgate could reject, so
/// one beyond the bounds every backend computes exactly is brought within them and reported as
/// applied: above [`MAX_CAPACITY`] it is capped, and a count too fine for its unit (only large
/// counts per MONTH or YEAR) is rounded down to a multiple of 1,000, which is always exact.
///
/// Errors: `()` for a unit Envoy does not define (the override is then ignored).
fn override_policy(requests_per_unit: u32, unit: i32) -> Result<(BucketPolicy, bool), ()> {
    let (unit, unit_us) = Unit::try_from(unit)
        .ok()
        .and_then(|u| Some((u, envoy_unit_us(u)?)))
        .ok_or(())?;
    let asked = u64::from(requests_per_unit);
    let mut rpu = asked.min(MAX_CAPACITY);
    let rate = match Rate::per(rpu, unit_us) {
        _ if rpu == 0 => Rate::ZERO,
        Ok(rate) => rate,
        Err(_) => {
            rpu = rpu / 1000 * 1000;
            // A multiple of 1,000 per unit is exact for every unit; should one ever not be,
            // the override is ignored rather than the request failed.
            Rate::per(rpu, unit_us).map_err(|_| ())?
        }
    };
    let policy = BucketPolicy::new(
        OVERRIDE_BUCKET.to_owned(),
        Plan::Fixed(Limit::new(rpu, rate)),
        ReportedLimit {
            requests_per_unit: u32::try_from(rpu).unwrap_or(u32::MAX),
            unit,
        },
    );
    Ok((policy, rpu != asked))
}

/// `replaces`: a matched rule (limited, or unlimited with its replaced buckets in
/// `by_unlimited`) drops every other matched rule whose bucket it names.
fn drop_replaced(matched: &mut [Option<Matched>], by_unlimited: &[usize]) {
    let replaced: Vec<usize> = matched
        .iter()
        .flatten()
        .flat_map(|m| m.replaces.iter().copied())
        .chain(by_unlimited.iter().copied())
        .collect();
    if replaced.is_empty() {
        return;
    }
    // A rule goes when any of its buckets is replaced.
    for m in matched.iter_mut() {
        if m.as_ref()
            .is_some_and(|m| m.bucket_indices.iter().any(|b| replaced.contains(b)))
        {
            *m = None;
        }
    }
}

/// What [`screen`] found malformed in a request, beyond what matching handles by itself.
/// Empty (and allocation-free) for a well-formed request.
pub(super) struct Screened {
    pub(super) empty_domain: bool,
    /// The descriptors from this index on are beyond `limits.max_descriptors`.
    decided: usize,
    /// Descriptors (below `decided`) denied as malformed.
    denied: SmallVec<[usize; 2]>,
    /// Descriptors decided on no rule (no entries).
    no_entries: SmallVec<[usize; 2]>,
    /// Descriptors with a value cut to `limits.max_value_bytes`, and their cut entries.
    cut: Vec<(usize, Vec<Entry>)>,
}

impl Screened {
    /// Whether the request has descriptors denied as malformed.
    pub(super) fn denies(&self) -> bool {
        !self.denied.is_empty() || self.decided < usize::MAX
    }

    /// Whether descriptor `i` matches nothing: the whole request (an empty domain), or the
    /// descriptor, is malformed beyond deciding on a rule.
    pub(super) fn skipped(&self, i: usize) -> bool {
        self.empty_domain || i >= self.decided || self.denied.contains(&i) || self.no_entries.contains(&i)
    }

    /// The entries descriptor `i` (`d`) is decided with.
    pub(super) fn entries<'a>(&'a self, i: usize, d: &'a RateLimitDescriptor) -> &'a [Entry] {
        match self.cut.iter().find(|(j, _)| *j == i) {
            Some((_, cut)) => cut,
            None => &d.entries,
        }
    }

    /// Marks the denied descriptors `OVER_LIMIT` (without a limit: none applies) and so the
    /// request. A `Retry-After` from the other descriptors goes: no wait lets it pass.
    fn deny(&self, resp: &mut RateLimitResponse) {
        use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
        let over = DescriptorStatus {
            code: Code::OverLimit as i32,
            ..Default::default()
        };
        for (i, status) in resp.statuses.iter_mut().enumerate() {
            if i >= self.decided || self.denied.contains(&i) {
                *status = over.clone();
            }
        }
        resp.overall_code = Code::OverLimit as i32;
        resp.response_headers_to_add.retain(|h| h.key != "retry-after");
    }
}

/// Screens a request against `limits` (see [`Malformed`] for what each finding means),
/// reporting each malformed part. Reads every entry once; allocates only for a cut value.
pub(super) fn screen(req: &RateLimitRequest, limits: &RequestLimits) -> Screened {
    let mut s = Screened {
        empty_domain: req.domain.is_empty(),
        decided: usize::MAX,
        denied: SmallVec::new(),
        no_entries: SmallVec::new(),
        cut: Vec::new(),
    };
    let domain = &req.domain;
    if s.empty_domain {
        report(Malformed::EmptyDomain, domain, || {
            "empty domain: answered as an unknown domain".into()
        });
        return s;
    }
    let n = req.descriptors.len();
    if n > limits.max_descriptors {
        s.decided = limits.max_descriptors;
        report(Malformed::TooManyDescriptors, domain, || {
            format!(
                "{n} descriptors, more than limits.max_descriptors {}: the rest are denied",
                limits.max_descriptors
            )
        });
    }
    for (i, d) in req.descriptors.iter().enumerate().take(limits.max_descriptors) {
        if d.entries.is_empty() {
            s.no_entries.push(i);
            report(Malformed::NoEntries, domain, || {
                format!("descriptor {i} has no entries: it reaches no rule")
            });
            continue;
        }
        if d.entries.len() > limits.max_entries {
            s.denied.push(i);
            report(Malformed::TooManyEntries, domain, || {
                format!(
                    "descriptor {i} has {} entries, more than limits.max_entries {}: denied",
                    d.entries.len(),
                    limits.max_entries
                )
            });
            continue;
        }
        if let Some(j) = d.entries.iter().position(|e| e.key.is_empty()) {
            report(Malformed::EmptyKey, domain, || {
                format!("descriptor {i} entry {j} has an empty key: decided as sent")
            });
        }
        if let Some(j) = d.entries.iter().position(|e| e.value.len() > limits.max_value_bytes) {
            report(Malformed::ValueTooLong, domain, || {
                format!(
                    "descriptor {i} entry {j} (key of {} bytes) has a value of {} bytes, more than \
                     limits.max_value_bytes {}: cut",
                    d.entries[j].key.len(),
                    d.entries[j].value.len(),
                    limits.max_value_bytes
                )
            });
            s.cut.push((i, cut_values(&d.entries, limits.max_value_bytes)));
        }
    }
    s
}

/// `entries` with every value longer than `max` bytes cut to at most `max` (at a character
/// boundary) and U+FFFD appended: the mark keeps a cut value from equalling a rule's value
/// (or a value sent whole), while a wildcard rule still sees its prefix, and values alike in
/// their first `max` bytes share a bucket (which errs on the side of limiting).
fn cut_values(entries: &[Entry], max: usize) -> Vec<Entry> {
    entries
        .iter()
        .map(|e| {
            if e.value.len() <= max {
                return e.clone();
            }
            let mut end = max;
            while !e.value.is_char_boundary(end) {
                end -= 1;
            }
            let mut value = String::with_capacity(end + 3);
            value.push_str(&e.value[..end]);
            value.push('\u{fffd}');
            Entry {
                key: e.key.clone(),
                value,
            }
        })
        .collect()
}

/// Whether a descriptor's `entries` are acceptable: at least one, at most the maximum, no
/// empty key. The error completes "descriptor ...".
#[inline]
fn check_entries(entries: &[Entry], limits: &RequestLimits) -> Result<(), String> {
    if entries.is_empty() {
        return Err("has no entries".into());
    }
    if entries.len() > limits.max_entries {
        return Err(format!(
            "has {} entries, more than the maximum of {}",
            entries.len(),
            limits.max_entries
        ));
    }
    if let Some(j) = entries.iter().position(|e| e.key.is_empty()) {
        return Err(format!("entry {j} has an empty key"));
    }
    Ok(())
}

/// `apply`, in a `store` span of the traced request's server span (docs/monitoring.md, "Traces"),
/// boxed: the span then costs the untraced decision's future (boxed by tonic, kept under 2 KiB)
/// nothing.
fn in_store_span<'a, T>(
    apply: impl std::future::Future<Output = T> + Send + 'a,
    buckets: usize,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>> {
    let span = tracing::debug_span!(
        target: "tollgate::store",
        "store",
        ratelimit.buckets = buckets,
        ratelimit.decided_by = tracing::field::Empty,
    );
    Box::pin(apply.instrument(span))
}
