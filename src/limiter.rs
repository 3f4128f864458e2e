//! The decision path, independent of gRPC: a `RateLimitRequest` in, a `RateLimitResponse` out.
//!
//! 1. validate the request (bounds and required fields, docs/rules.md);
//! 2. per descriptor, find the rule ([`crate::matcher`]) or the Envoy `limit` override;
//! 3. drop rules that another matched rule `replaces`;
//! 4. build the distinct bucket instances and the demands on them (`hits_addend`);
//! 5. let the store decide all of them atomically;
//! 6. turn the decision into statuses and headers ([`crate::response`]).
//!
//! [`Limiter::resolve`] runs steps 2 and 4 alone, for one descriptor, so that the admin API
//! ([`crate::admin`]) addresses exactly the bucket instances a request would.

use std::borrow::Cow;
use std::sync::Arc;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use smallvec::SmallVec;

use crate::bucket::{Demand, DemandKind, Limit, Rate, MAX_CAPACITY, MICRO};
use crate::matcher::{find_node, find_rule, instance_key, shared_patterns};
use crate::metrics::{count_decisions, DecisionCounters};
use crate::response::{build_response, failure_response, Part, Target};
use crate::rules::{BucketPolicy, Domain, ReportedLimit, Rule, RuleSet, UNITS};
use crate::schedule::Plan;
use crate::settings::{FailureMode, HeaderSettings, RequestLimits};
use crate::store::{BucketRef, Store, StoreError};

/// The bucket name reported for Envoy `limit` overrides.
pub const OVERRIDE_BUCKET: &str = "override";

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// The request is malformed; answered `INVALID_ARGUMENT`.
    #[error("{0}")]
    InvalidRequest(String),
    /// The store failed.
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

/// The bucket instances one descriptor reaches, found by [`Limiter::resolve`].
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The path of the rule in the domain's descriptor tree (`user`, `api_key.path=/upload`).
    pub rule: String,
    /// Whether the rule is evaluated in shadow mode (its own `shadow_mode` or the global one).
    pub shadow: bool,
    /// The instances, as the store is asked for them: the rule's bucket, then its calendar
    /// quota when the rule has one beside a token bucket.
    pub buckets: Vec<BucketRef>,
    /// Per instance, in the same order, its policy: the bucket name and plan, and how its
    /// limit is reported to Envoy ([`BucketPolicy::reported_at`]).
    pub policies: Vec<BucketPolicy>,
}

/// Limiter behaviour that is not rules.
#[derive(Clone, Copy, Debug)]
pub struct LimiterOptions {
    /// Request bounds.
    pub limits: RequestLimits,
    /// Response headers to add.
    pub headers: HeaderSettings,
    /// Global shadow mode.
    pub shadow_mode: bool,
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
}

/// Rules plus a store: decides requests.
pub struct Limiter<S> {
    rules: ArcSwap<RuleSet>,
    store: S,
    options: LimiterOptions,
    /// [`crate::metrics::UNKNOWN_DOMAIN`].
    unknown_domain: metrics::Counter,
}

/// What one descriptor was matched to, before the store is asked.
/// Policies are borrowed from the rules in force, so the hot path copies no names.
struct Matched<'r> {
    policy: Cow<'r, BucketPolicy>,
    /// The calendar quota the rule also carries, if any.
    quota: Option<&'r BucketPolicy>,
    shadow: bool,
    replaces: &'r [usize],
    bucket_index: Option<usize>,
    /// Per entry, the `share_threshold` pattern standing for its value (usually empty).
    shared: Vec<Option<&'r str>>,
    /// Where the bucket's and the quota's decisions are counted.
    counters: &'r DecisionCounters,
    quota_counters: &'r DecisionCounters,
    /// The rule's node's envoyproxy/ratelimit-named counters.
    envoyproxy: &'r crate::metrics::EnvoyproxyStats,
}

impl<'r> Matched<'r> {
    /// What a descriptor that ends on `node` (`depth` entries down) of `dom` is decided by;
    /// `None` for a node without a rule or with `unlimited: true`.
    fn at(dom: &'r Domain, node: usize, depth: usize) -> Option<Matched<'r>> {
        match &dom.nodes[node].rule {
            Some(Rule::Limited {
                bucket,
                quota,
                shadow,
                replaces,
            }) => Some(Matched {
                policy: Cow::Borrowed(&dom.buckets[*bucket]),
                quota: quota.map(|q| &dom.buckets[q]),
                shadow: *shadow,
                replaces,
                bucket_index: Some(*bucket),
                shared: shared_patterns(dom, node, depth),
                counters: dom.counters_of(*bucket),
                quota_counters: quota.map_or(DecisionCounters::noop(), |q| dom.counters_of(q)),
                envoyproxy: dom.envoyproxy_stats_of(node),
            }),
            _ => None,
        }
    }

    /// The instance key of the rule's bucket for a descriptor with `entries` in `domain`. An
    /// override's key also carries its limit (`#<requests_per_unit>/<UNIT>`), so overrides of
    /// different limits never share an instance.
    fn bucket_key(&self, domain: &str, entries: &[Entry]) -> String {
        let mut key = String::with_capacity(key_capacity(domain, &self.policy.name, entries) + 16);
        instance_key(&mut key, domain, &self.policy.name, entries, &self.shared);
        if self.bucket_index.is_none() {
            key.push('#');
            key.push_str(itoa::Buffer::new().format(self.policy.reported.requests_per_unit));
            key.push('/');
            key.push_str(self.policy.reported.unit.as_str_name());
        }
        key
    }

    /// The instance key of the rule's quota `policy` for a descriptor with `entries`.
    fn quota_key(&self, domain: &str, policy: &BucketPolicy, entries: &[Entry]) -> String {
        let mut key = String::with_capacity(key_capacity(domain, &policy.name, entries));
        instance_key(&mut key, domain, &policy.name, entries, &self.shared);
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
            unknown_domain: metrics::counter!(crate::metrics::UNKNOWN_DOMAIN),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
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

    /// Decides one request.
    ///
    /// Errors: [`LimitError::InvalidRequest`] for an empty domain, a descriptor with no
    /// entries, an entry with an empty key, more descriptors or entries than the configured
    /// maximum, or an override with an unknown unit; [`LimitError::Store`] when the store fails.
    pub async fn should_rate_limit(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, LimitError> {
        validate(req, &self.options.limits)?;
        let rules = self.rules.load();
        let domain = rules.domain(&req.domain);
        if domain.is_none() {
            self.unknown_domain.increment(1);
        }
        // A Vec: everything here that is alive across the store's await is part of the future
        // tonic boxes and moves, so the inline buffers are kept to what the store is handed.
        let mut matched: Vec<Option<Matched>> = Vec::with_capacity(req.descriptors.len());
        // Buckets named by the `replaces` of matched unlimited rules (they match nothing else).
        let mut unlimited_replaces: SmallVec<[usize; 4]> = SmallVec::new();
        for d in &req.descriptors {
            if d.is_negative_hits && !self.options.refunds {
                // Refused: answered OK as a refund always is, nothing given back, no bucket
                // (nor its `replaces`) involved.
                matched.push(None);
                continue;
            }
            // As in envoyproxy/ratelimit, an unknown domain is OK before overrides are looked at.
            let m = match (&d.limit, self.options.overrides && domain.is_some()) {
                (Some(o), true) => Some(Matched {
                    policy: Cow::Owned(override_policy(o.requests_per_unit, o.unit)?),
                    quota: None,
                    shadow: false,
                    replaces: &[],
                    bucket_index: None,
                    shared: Vec::new(),
                    counters: domain.map_or(DecisionCounters::noop(), |d| &d.override_counters),
                    quota_counters: DecisionCounters::noop(),
                    // Their override series are named by the request's values: unbounded.
                    envoyproxy: crate::metrics::EnvoyproxyStats::noop(),
                }),
                _ => domain.and_then(|dom| {
                    let node = find_node(dom, &d.entries)?;
                    if let Some(Rule::Unlimited { replaces }) = &dom.nodes[node].rule {
                        unlimited_replaces.extend_from_slice(replaces);
                    }
                    Matched::at(dom, node, d.entries.len())
                }),
            };
            matched.push(m);
        }
        drop_replaced(&mut matched, &unlimited_replaces);

        let mut buckets: SmallVec<[BucketRef; 4]> = SmallVec::new();
        let mut targets: Vec<Option<Target>> = Vec::with_capacity(matched.len());
        let mut demands: SmallVec<[Demand; 4]> = SmallVec::new();
        for (d, m) in req.descriptors.iter().zip(matched) {
            let Some(m) = m else {
                targets.push(None);
                continue;
            };
            let key = m.bucket_key(&req.domain, &d.entries);
            let kind = demand_kind(d, req.hits_addend);
            let shadow = m.shadow || self.options.shadow_mode;
            let (instance, demand) = add_demand(&mut buckets, &mut demands, key, &m.policy.plan, kind, shadow);
            let quota = m.quota.map(|policy| {
                let key = m.quota_key(&req.domain, policy, &d.entries);
                let (instance, demand) = add_demand(&mut buckets, &mut demands, key, &policy.plan, kind, shadow);
                Part {
                    policy,
                    instance,
                    demand,
                    counters: m.quota_counters,
                }
            });
            targets.push(Some(Target {
                policy: m.policy,
                instance,
                demand,
                kind,
                shadow,
                quota,
                counters: m.counters,
                envoyproxy: m.envoyproxy,
                entries: &d.entries,
                shared: m.shared,
            }));
        }
        if buckets.is_empty() {
            return Ok(build_response(&targets, None, &self.options.headers));
        }
        let applied = match self.store.apply(&buckets, &demands).await {
            Ok(applied) => applied,
            Err(e) => {
                let answer = match self.options.on_store_failure {
                    FailureMode::Allow => failure_response(&targets, false),
                    FailureMode::Deny => failure_response(&targets, true),
                    // The store falls back by itself; an error that still comes back has
                    // nothing left to decide on.
                    FailureMode::Error | FailureMode::Fallback => return Err(e.into()),
                };
                crate::metrics::count_failure_answer(self.options.on_store_failure);
                return Ok(answer);
            }
        };
        count_decisions(&targets, &applied, self.options.near_limit_ratio);
        Ok(build_response(&targets, Some(&applied), &self.options.headers))
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
        let mut policies = vec![m.policy.clone().into_owned()];
        let mut buckets = vec![BucketRef {
            key: m.bucket_key(domain, entries),
            plan: m.policy.plan.clone(),
        }];
        if let Some(quota) = m.quota {
            buckets.push(BucketRef {
                key: m.quota_key(domain, quota, entries),
                plan: quota.plan.clone(),
            });
            policies.push(quota.clone());
        }
        Ok(Resolved {
            rule: dom.nodes[node].path.clone(),
            shadow: m.shadow || self.options.shadow_mode,
            buckets,
            policies,
        })
    }
}

/// About the length of an instance key (its parts and their length prefixes), so building it
/// allocates once.
fn key_capacity(domain: &str, bucket: &str, entries: &[Entry]) -> usize {
    let parts: usize = entries.iter().map(|e| e.key.len() + e.value.len() + 12).sum();
    domain.len() + bucket.len() + 12 + parts
}

/// Adds a demand of `kind` on the instance `key` (shared with an earlier descriptor of the
/// request that reached the same instance); returns the indices of the instance and the demand.
fn add_demand(
    buckets: &mut SmallVec<[BucketRef; 4]>,
    demands: &mut SmallVec<[Demand; 4]>,
    key: String,
    plan: &Plan,
    kind: DemandKind,
    shadow: bool,
) -> (usize, usize) {
    let instance = match buckets.iter().position(|b| b.key == key) {
        Some(i) => i,
        None => {
            buckets.push(BucketRef {
                key,
                plan: plan.clone(),
            });
            buckets.len() - 1
        }
    };
    demands.push(Demand {
        instance,
        kind,
        enforced: !shadow,
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

/// Envoy's `RateLimitOverride`: a bucket of `requests_per_unit` refilled that many per unit.
///
/// Overrides come from Envoy's configuration, not from a rules file tollgate could reject, so
/// one beyond the bounds every backend computes exactly is brought within them and reported as
/// applied: above [`MAX_CAPACITY`] it is capped, and a count too fine for its unit (only large
/// counts per MONTH or YEAR) is rounded down to a multiple of 1,000, which is always exact.
fn override_policy(requests_per_unit: u32, unit: i32) -> Result<BucketPolicy, LimitError> {
    let (unit, unit_us) = Unit::try_from(unit)
        .ok()
        .and_then(|u| UNITS.iter().find(|(x, _)| *x == u).copied())
        .ok_or_else(|| LimitError::InvalidRequest(format!("descriptor limit override has unknown unit {unit}")))?;
    let mut rpu = u64::from(requests_per_unit).min(MAX_CAPACITY);
    let rate = match Rate::per(rpu, unit_us) {
        _ if rpu == 0 => Rate::ZERO,
        Ok(rate) => rate,
        Err(_) => {
            rpu = rpu / 1000 * 1000;
            Rate::per(rpu, unit_us).map_err(|e| LimitError::InvalidRequest(e.to_string()))?
        }
    };
    Ok(BucketPolicy::new(
        OVERRIDE_BUCKET.to_owned(),
        Plan::Fixed(Limit::new(rpu, rate)),
        ReportedLimit {
            requests_per_unit: u32::try_from(rpu).unwrap_or(u32::MAX),
            unit,
        },
    ))
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
    for m in matched.iter_mut() {
        if m.as_ref()
            .and_then(|m| m.bucket_index)
            .is_some_and(|b| replaced.contains(&b))
        {
            *m = None;
        }
    }
}

fn validate(req: &RateLimitRequest, limits: &RequestLimits) -> Result<(), LimitError> {
    let invalid = |msg: String| Err(LimitError::InvalidRequest(msg));
    if req.domain.is_empty() {
        return invalid("domain must not be empty".into());
    }
    if req.descriptors.len() > limits.max_descriptors {
        return invalid(format!(
            "{} descriptors exceed the maximum of {}",
            req.descriptors.len(),
            limits.max_descriptors
        ));
    }
    for (i, d) in req.descriptors.iter().enumerate() {
        if let Err(e) = check_entries(&d.entries, limits) {
            return invalid(format!("descriptor {i} {e}"));
        }
    }
    Ok(())
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
