//! The compiled rule set: per domain, a tree of descriptor nodes and the named bucket policies
//! they point at. Built by `crate::rules::file`, walked by `crate::rules::matcher`, swapped whole.

pub(crate) mod counters;
pub(crate) mod file;
pub(crate) mod matcher;
pub(crate) mod wildcard;

pub use counters::envoyproxy_stat_key;
pub use file::{load_rules, load_rules_merging, load_rules_text, parse_refill, ConfigError, Refill};
pub use matcher::{find_node, find_rule, instance_key};
pub use wildcard::{Candidates, Pattern, WildcardIndex};

use std::collections::HashMap;
use std::path::PathBuf;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

use crate::core::bucket::{DemandKind, Limit};
use crate::core::schedule::Plan;
use crate::core::units::ENVOY_UNITS;
use crate::telemetry::DecisionCounters;

/// The bucket name an Envoy `limit` override is decided and counted under (the
/// `RateLimitDescriptor.limit` field of the request); no rule may use it.
pub const OVERRIDE_BUCKET: &str = "override";

/// The maps a decision looks request values up in (domains, descriptor keys and values).
///
/// Hashed with foldhash, seeded at random per map, rather than SipHash: their keys come from
/// the rules, never from requests, so a client cannot fill them with colliding keys (what
/// SipHash guards against), and a request's lookups cost several times less (a tenth of a
/// four-descriptor decision's instructions went to SipHash).
pub type LookupMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// All loaded domains.
#[derive(Debug, Default)]
pub struct RuleSet {
    /// Domains by name.
    pub domains: LookupMap<String, Domain>,
    /// The files the rules came from, in load order.
    pub files: Vec<PathBuf>,
    /// Which successful load this is: 1 for the rules read at start, one more for each reload
    /// that took effect (0: not loaded by a server, as in `tollgate check`).
    pub generation: u64,
    /// Run when this set is dropped: after it was replaced, once the last request deciding on
    /// it is done ([`crate::decision::limiter::Limiter::swap_rules`]).
    pub on_retire: OnRetire,
}

/// A callback run once, when the [`RuleSet`] holding it is dropped; set at most once.
#[derive(Default)]
pub struct OnRetire(std::sync::OnceLock<std::sync::Arc<dyn Fn() + Send + Sync>>);

impl OnRetire {
    /// Sets the callback; a second one is ignored (a set is replaced only once).
    pub fn set(&self, hook: std::sync::Arc<dyn Fn() + Send + Sync>) {
        let _ = self.0.set(hook);
    }
}

impl Drop for OnRetire {
    fn drop(&mut self) {
        if let Some(hook) = self.0.get() {
            hook();
        }
    }
}

impl std::fmt::Debug for OnRetire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "OnRetire(set)"
        } else {
            "OnRetire"
        })
    }
}

impl Domain {
    /// The names of the buckets `replaces` points at, each once (several buckets may carry one
    /// envoyproxy/ratelimit name), in order.
    pub fn replaced_names(&self, replaces: &[usize]) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for name in replaces.iter().map(|r| self.buckets[*r].name.as_str()) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// The decision counters of bucket `index` (no-ops before
    /// `counters::register_rules` ran).
    pub fn counters_of(&self, index: usize) -> &DecisionCounters {
        self.counters.get(index).unwrap_or_else(|| DecisionCounters::noop())
    }
}

impl RuleSet {
    /// Whether no rules file was found (an empty directory, or one whose files are all hidden
    /// or not `*.yaml` / `*.yml`): almost always a mistyped path. `tollgate check` fails on it
    /// with [`crate::rules::file::ConfigError::no_rules_files`].
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The domain named `name`, if loaded.
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// Makes this set, about to replace `old` at `at_us` (by the store's clock), change rates
    /// from then on only: each bucket policy that `old` has too (same domain, same name, so
    /// the same bucket instances) and whose behaviour changed gets a plan that brings a bucket
    /// forward under the old plan up to `at_us` and under the new one from it
    /// ([`Plan::after_reload`]); one whose behaviour did not change keeps `old`'s plan and
    /// history. New policies are left as compiled.
    pub fn carry_history(&mut self, old: &RuleSet, at_us: u64) {
        for (name, domain) in &mut self.domains {
            let Some(old_domain) = old.domains.get(name) else {
                continue;
            };
            let old_buckets: HashMap<&str, &BucketPolicy> =
                old_domain.buckets.iter().map(|b| (b.name.as_str(), b)).collect();
            for bucket in &mut domain.buckets {
                let Some(old) = old_buckets.get(bucket.name.as_str()) else {
                    continue;
                };
                bucket.plan = Plan::after_reload(&old.plan, bucket.plan.clone(), at_us);
                if let (Some(own), Some(old_own)) = (&mut bucket.over_account, &old.over_account) {
                    let own = std::sync::Arc::make_mut(own);
                    own.bucket.plan = bucket.plan.clone();
                    own.account.plan = Plan::after_reload(&old_own.account.plan, own.account.plan.clone(), at_us);
                }
            }
        }
    }
}

/// One domain: its descriptor tree and bucket policies.
#[derive(Debug)]
pub struct Domain {
    /// The `domain` field of the file.
    pub name: String,
    /// The file that declared it.
    pub file: PathBuf,
    /// Bucket policies; [`Rule::Limited`] points into this by index.
    pub buckets: Vec<BucketPolicy>,
    /// Node arena; [`Level`] refers to nodes by index.
    pub nodes: Vec<Node>,
    /// The first level of the tree.
    pub root: Level,
    /// Whether any node has a [`Node::shared_pattern`]; when not, instance keys skip the walk.
    pub has_shared: bool,
    /// Things `tollgate check` should tell the operator that are not errors, such as
    /// envoyproxy/ratelimit fields without effect here: `(rule path, note)`.
    pub notes: Vec<(String, String)>,
    /// Per bucket (same index as `buckets`), its decision counters; empty until
    /// `counters::register_rules` fills it.
    pub counters: Vec<DecisionCounters>,
    /// The decision counters of Envoy `limit` overrides in this domain.
    pub override_counters: DecisionCounters,
    /// Per node (same index as `nodes`), its envoyproxy/ratelimit-named counters; empty
    /// unless `counters::register_rules` ran with their names on.
    pub envoyproxy_stats: Vec<crate::telemetry::EnvoyproxyStats>,
}

impl Domain {
    /// The envoyproxy/ratelimit-named counters of node `node` (no-ops when not registered).
    pub fn envoyproxy_stats_of(&self, node: usize) -> &crate::telemetry::EnvoyproxyStats {
        self.envoyproxy_stats
            .get(node)
            .unwrap_or(crate::telemetry::EnvoyproxyStats::noop())
    }
}

/// A named bucket policy: a token bucket (constant or scheduled) or a calendar quota.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPolicy {
    /// What operators see: `current_limit.name` (unless [`BucketPolicy::unnamed`]), the
    /// `RateLimit-Policy` item, metrics labels.
    pub name: String,
    /// The rule gave no name: `name` was made from the rule's descriptor path, which may spell
    /// out internal names (Envoy Gateway's routes), so `current_limit.name` is left empty, as
    /// envoyproxy/ratelimit leaves it for a `rate_limit` without `name`, and Envoy's
    /// `x-ratelimit-limit` carries no `name=`.
    pub unnamed: bool,
    /// Capacity and refill, and how they change over time.
    pub plan: Plan,
    /// `current_limit` as sent to Envoy for the base limit (docs/rules.md); a policy whose limit
    /// varies is reported by the limit in force ([`BucketPolicy::reported_at`]).
    pub reported: ReportedLimit,
    /// `hidden: true`: decided like any bucket, but kept out of what clients see of the limits
    /// (the `RateLimit` and `RateLimit-Policy` headers, the `DescriptorStatus` limit fields that
    /// Envoy turns into `x-ratelimit-*`); a denial it causes still gets its true `Retry-After`.
    pub hidden: bool,
    /// `debt: true` (docs/usage-budgets.md): usage reports are debited down to a floor and the
    /// request-path check asks for a positive balance ([`BucketPolicy::demand_kind`]). Not the
    /// same as a positive [`BucketPolicy::debt_depth_ut`]: a floor may be 0.
    pub debt: bool,
    /// A debt bucket's floor: how far below zero it lies, in micro-tokens (0 for an ordinary
    /// bucket, and for a debt bucket with `debt_floor: 0`). The plan's capacities are raised by
    /// it, so the stores keep `tokens = balance + depth` with the arithmetic of an ordinary
    /// bucket; what clients and operators see is brought back down ([`BucketPolicy::shown`],
    /// [`BucketPolicy::balance_ut`]).
    pub debt_depth_ut: u64,
    /// `lease: N` (docs/backends.md, token leases): a replica may reserve `N` tokens of this
    /// bucket from the shared store at a time and spend them locally, in micro-tokens; 0 for
    /// none.
    pub lease_ut: u64,
    /// For a scheduled policy, [`ReportedLimit::of`] each entry's limit, worked out once.
    entry_reported: Vec<ReportedLimit>,
    /// On a `rate_limit` of the envoyproxy/ratelimit schema: how descriptors carrying their own
    /// `hits_addend` (a check with 0, a usage report with N) are counted, as that server counts
    /// them. `None` elsewhere, and where the limit refills nothing or has a schedule.
    pub over_account: Option<std::sync::Arc<OverAccount>>,
    /// What a descriptor's own `hits_addend` asks of this policy ([`BucketPolicy::demand_kind`]).
    pub own_hits: OwnHits,
}

/// The two policies a descriptor carrying its own `hits_addend` is decided by, on a
/// `rate_limit` of the envoyproxy/ratelimit schema, whose fixed-window counter counts every
/// hit, over the limit too, and is over when the hits after the increase exceed the limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverAccount {
    /// The rule's token bucket itself ([`OwnHits::Bucket`]): what the request's own hits take
    /// from, so a check sees them and a report takes from it.
    pub bucket: BucketPolicy,
    /// The account ([`OwnHits::Account`]): the bucket as a hidden debt bucket one capacity
    /// deep, keyed apart, which remembers usage that went past the limit.
    pub account: BucketPolicy,
}

/// What a descriptor's own `hits_addend` asks of a policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OwnHits {
    /// As the request's own hits do.
    #[default]
    Plain,
    /// [`OverAccount::bucket`]: a check (0) never fails (at the limit is not over), N hits pass
    /// while the bucket holds N and take what it holds, up to N, whatever the decision.
    Bucket,
    /// [`OverAccount::account`]: a check passes while the balance is 0 or more, N hits while it
    /// is N or more, and are debited whatever the decision, down to the floor.
    Account,
}

impl BucketPolicy {
    /// A policy named `name` following `plan`, reported to Envoy as `reported` when its base
    /// limit is in force.
    pub fn new(name: String, plan: Plan, reported: ReportedLimit) -> BucketPolicy {
        let entry_reported = match &plan {
            Plan::Scheduled(s) => (0..s.entries().len())
                .filter_map(|i| s.entry_limit(i).map(ReportedLimit::of))
                .collect(),
            _ => Vec::new(),
        };
        BucketPolicy {
            name,
            plan,
            reported,
            unnamed: false,
            hidden: false,
            debt: false,
            debt_depth_ut: 0,
            lease_ut: 0,
            entry_reported,
            over_account: None,
            own_hits: OwnHits::Plain,
        }
    }

    /// A debt bucket's policy (docs/usage-budgets.md): `plan` must already have its capacities
    /// raised by `depth_ut` ([`crate::core::schedule::Schedule::with_debt_depth`],
    /// [`crate::core::schedule::Quota::with_debt_depth`], or the capacity plus the depth for
    /// a constant limit); `reported` describes the limit as declared. A depth of 0 (`debt_floor:
    /// 0`) is a debt bucket too, whose balance never goes below zero.
    pub fn with_debt_depth(mut self, depth_ut: u64) -> BucketPolicy {
        self.debt = true;
        self.debt_depth_ut = depth_ut;
        if let Plan::Scheduled(s) = &self.plan {
            self.entry_reported = (0..s.entries().len())
                .filter_map(|i| s.entry_limit(i).map(|l| ReportedLimit::of(&shown(*l, depth_ut))))
                .collect();
        }
        self
    }

    /// `limit` (the plan's) as declared: a debt bucket's capacity without the floor's depth.
    pub fn shown(&self, limit: Limit) -> Limit {
        shown(limit, self.debt_depth_ut)
    }

    /// The capacity in force at `now_us`, in whole tokens, as declared (a debt bucket's without
    /// its floor's depth).
    pub fn capacity_at(&self, now_us: u64) -> u64 {
        self.shown(self.plan.limit_at(now_us)).capacity()
    }

    /// The micro-tokens clients are told are left of a bucket holding `tokens_ut`: a debt
    /// bucket's balance, 0 while in debt.
    pub fn balance_ut(&self, tokens_ut: u64) -> u64 {
        tokens_ut.saturating_sub(self.debt_depth_ut)
    }

    /// What a descriptor asking `kind` asks of this bucket: on a debt bucket a consume is a
    /// usage report ([`DemandKind::Debit`]) and a check asks whether the balance is positive
    /// ([`DemandKind::DebtCheck`]); otherwise `kind` itself.
    ///
    /// The two policies of an [`OverAccount`] have envoyproxy/ratelimit's thresholds
    /// ([`OwnHits`]), whose counter is over when the hits after the increase exceed the limit.
    pub fn demand_kind(&self, kind: DemandKind) -> DemandKind {
        let depth_ut = self.debt_depth_ut;
        match (self.own_hits, kind) {
            // Hits are at least a token, and the account's depth too (`with_over_account`),
            // so no threshold goes below 0.
            (OwnHits::Bucket, DemandKind::Consume(amount_ut)) => DemandKind::Debit {
                amount_ut,
                depth_ut: amount_ut.saturating_sub(1),
            },
            (OwnHits::Bucket, DemandKind::Check) => DemandKind::Consume(0),
            (OwnHits::Account, DemandKind::Consume(amount_ut)) => DemandKind::Debit {
                amount_ut,
                depth_ut: depth_ut.saturating_add(amount_ut).saturating_sub(1),
            },
            (OwnHits::Account, DemandKind::Check) => DemandKind::DebtCheck {
                depth_ut: depth_ut.saturating_sub(1),
            },
            _ => self.plain_demand_kind(kind),
        }
    }

    /// [`BucketPolicy::demand_kind`] outside an [`OverAccount`].
    fn plain_demand_kind(&self, kind: DemandKind) -> DemandKind {
        let depth_ut = self.debt_depth_ut;
        match kind {
            DemandKind::Consume(amount_ut) if self.debt => DemandKind::Debit { amount_ut, depth_ut },
            DemandKind::Check if self.debt => DemandKind::DebtCheck { depth_ut },
            kind => kind,
        }
    }

    /// This policy with its [`BucketPolicy::over_account`]: itself as [`OwnHits::Bucket`], and
    /// as the account a hidden copy following `raised` (the plan with its capacities raised by
    /// `depth_ut`, at least one token), a debt bucket of that depth. The account's instances are
    /// keyed apart from the bucket's (a debt bucket's key carries its depth), so the two never
    /// share stored tokens.
    pub fn with_over_account(mut self, raised: Plan, depth_ut: u64) -> BucketPolicy {
        debug_assert!(depth_ut >= crate::core::bucket::MICRO);
        let plain = BucketPolicy {
            over_account: None,
            ..self.clone()
        };
        let mut account = BucketPolicy {
            plan: raised,
            hidden: true,
            ..plain.clone()
        }
        .with_debt_depth(depth_ut);
        account.own_hits = OwnHits::Account;
        let bucket = BucketPolicy {
            own_hits: OwnHits::Bucket,
            ..plain
        };
        self.over_account = Some(std::sync::Arc::new(OverAccount { bucket, account }));
        self
    }

    /// This policy with [`BucketPolicy::hidden`] set to `hidden`.
    pub fn with_hidden(mut self, hidden: bool) -> BucketPolicy {
        self.hidden = hidden;
        self
    }

    /// The policy with `lease` ([`BucketPolicy::lease_ut`], micro-tokens; 0: none).
    pub fn with_lease(mut self, lease_ut: u64) -> BucketPolicy {
        self.lease_ut = lease_ut;
        self
    }

    /// `current_limit` at `now_us`: the precomputed one for a constant limit; for a scheduled
    /// one, [`ReportedLimit::of`] the limit in force; for a quota, its allowance per the Envoy
    /// unit nearest its current period ([`ReportedLimit::quota`]).
    pub fn reported_at(&self, now_us: u64) -> ReportedLimit {
        // `reported` and `entry_reported` describe the plan the rules file compiled, which a
        // reload's plan follows from the reload on.
        let plan = match &self.plan {
            Plan::Reloaded(r) if now_us < r.at_us() => return self.reported,
            plan => plan.current(),
        };
        match plan {
            Plan::Fixed(_) | Plan::Expiring(_) | Plan::Reloaded(_) => self.reported,
            Plan::Scheduled(s) => s
                .limit_entry_at(now_us)
                .and_then(|i| self.entry_reported.get(i).copied())
                .unwrap_or(self.reported),
            Plan::Quota(q) => {
                ReportedLimit::quota(q.allowance_ut() / crate::core::bucket::MICRO, plan.window_us(now_us))
            }
        }
    }
}

/// `limit` without a debt bucket's floor depth `depth_ut`: what the rules declared.
pub(crate) fn shown(limit: Limit, depth_ut: u64) -> Limit {
    Limit {
        capacity_ut: limit.capacity_ut.saturating_sub(depth_ut),
        rate: limit.rate,
    }
}

/// `DescriptorStatus.current_limit`: requests per unit, as Envoy understands a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReportedLimit {
    /// `RateLimit.requests_per_unit`.
    pub requests_per_unit: u32,
    /// `RateLimit.unit`.
    pub unit: Unit,
}

impl ReportedLimit {
    /// How a [`Limit`] is reported (docs/rules.md): when its time to fill from empty is exactly
    /// one unit, `capacity` per that unit; otherwise the refill rate in the first of SECOND,
    /// MINUTE, HOUR, DAY, WEEK, MONTH, YEAR in which it is a whole number (1 per 250 ms is 4
    /// per SECOND), else per YEAR rounded down, but at least 1: Envoy and clients read 0 as
    /// "blocks everything", which a bucket that refills does not (1 per 400 days is reported as
    /// 1 per YEAR). Saturates at `u32::MAX`. A fixed allowance (a capacity that never
    /// refills) reports its capacity per YEAR. Only a limit that denies every request (a zero
    /// capacity, such as a maintenance window's or `requests_per_unit: 0`) reports 0, per
    /// SECOND.
    pub fn of(limit: &Limit) -> ReportedLimit {
        let sat = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        if limit.rate.is_zero() && limit.capacity_ut > 0 {
            // A fixed allowance never refills: its capacity per YEAR, Envoy's longest unit (0
            // would read as "blocks everything", which it does not until it is spent).
            return ReportedLimit {
                requests_per_unit: sat(limit.capacity()),
                unit: Unit::Year,
            };
        }
        if limit.rate.is_zero() || limit.capacity_ut == 0 {
            return ReportedLimit {
                requests_per_unit: 0,
                unit: Unit::Second,
            };
        }
        if let Some(fill) = limit.time_to_fill_us() {
            if let Some((unit, _)) = ENVOY_UNITS
                .iter()
                .map(|(u, _, us)| (u, *us))
                .find(|(_, us)| *us == fill)
            {
                return ReportedLimit {
                    requests_per_unit: sat(limit.capacity()),
                    unit: *unit,
                };
            }
        }
        for (unit, _, us) in &ENVOY_UNITS {
            if let Some(n) = limit.rate.whole_tokens_per(*us).filter(|n| *n > 0) {
                return ReportedLimit {
                    requests_per_unit: sat(n),
                    unit: *unit,
                };
            }
        }
        let per_year = u128::from(limit.rate.num()) * u128::from(ENVOY_UNITS[6].2)
            / (u128::from(limit.rate.den()) * u128::from(crate::core::bucket::MICRO));
        ReportedLimit {
            requests_per_unit: sat(u64::try_from(per_year).unwrap_or(u64::MAX)).max(1),
            unit: Unit::Year,
        }
    }
}

impl ReportedLimit {
    /// How a quota of `allowance` tokens per period of `period_us` is reported: the allowance
    /// per the Envoy unit whose length is nearest the period (by ratio, so a month of 28 to 31
    /// days is a MONTH and a day of 23 or 25 hours around a DST change is a DAY). Envoy has no
    /// unit for other periods (every two weeks, say): the nearest is the honest approximation.
    /// Without a period (no edge within the horizon) the unit is YEAR.
    pub fn quota(allowance: u64, period_us: Option<u64>) -> ReportedLimit {
        let unit = period_us.map_or(Unit::Year, |period| {
            let ratio = |unit_us: u64| {
                let (a, b) = (period.max(1) as f64, unit_us as f64);
                if a > b {
                    a / b
                } else {
                    b / a
                }
            };
            ENVOY_UNITS
                .iter()
                .min_by(|a, b| ratio(a.2).total_cmp(&ratio(b.2)))
                .map_or(Unit::Year, |(unit, _, _)| *unit)
        });
        ReportedLimit {
            requests_per_unit: u32::try_from(allowance).unwrap_or(u32::MAX),
            unit,
        }
    }
}

/// One node of a descriptor tree.
#[derive(Debug)]
pub struct Node {
    /// The node's path: keys and values joined with `.`, e.g. `api_key.path=/upload`.
    pub path: String,
    /// The next level.
    pub children: Level,
    /// What applies when a descriptor's last entry lands here; `None` means no limit.
    pub rule: Option<Rule>,
    /// The node one level up; `None` at the first level.
    pub parent: Option<usize>,
    /// `share_threshold: true` on a wildcard node: the pattern, which stands in the bucket
    /// instance key for the value, so every matching value shares one bucket.
    pub shared_pattern: Option<String>,
    /// envoyproxy/ratelimit's `detailed_metric: true`: their metric names (when exported) are
    /// labelled by the request's entries, within a bound ([`crate::telemetry::DETAILED_SERIES_MAX`]).
    pub detailed_metric: bool,
    /// envoyproxy/ratelimit's descriptor `metadata`, on a node with a limited rule: passed on in
    /// the response's dynamic metadata when the rule's descriptor passes (docs/rules.md).
    pub metadata: Option<envoy_types::pb::google::protobuf::Struct>,
}

/// What a node does to a request that ends on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `unlimited: true`: never limited, no bucket touched. Its `replaces` still drop the rules
    /// of those buckets from the request, as in envoyproxy/ratelimit (`rate_limit.replaces`).
    Unlimited {
        /// Bucket indices this rule replaces when both match one request.
        replaces: Vec<usize>,
    },
    /// One bucket or several (a token bucket and its quota; `buckets: [a, b]`), all or nothing.
    Limited {
        /// Indices into [`Domain::buckets`], never empty: the rule's buckets in the order the
        /// rules file gives them, each bucket's quota right after it. A request must pass every
        /// one; each is decided as its own instance with the descriptor's demand.
        buckets: Vec<usize>,
        /// `shadow_mode: true`: evaluated and counted, never denies.
        shadow: bool,
        /// envoyproxy/ratelimit's `quota_mode: true`: over its limit, the rule denies a request
        /// only when every quota-mode descriptor of the request is over as well.
        quota_mode: bool,
        /// Bucket indices this rule replaces when both match one request.
        replaces: Vec<usize>,
    },
}

/// The children of one node (or the root): how one descriptor entry is matched.
#[derive(Debug, Default)]
pub struct Level {
    /// `key` -> `value` -> node, for exact values (a short value inline in its map slot, so
    /// comparing it reads no other memory: a big tree's lookups miss the cache once, not
    /// twice).
    pub exact: LookupMap<String, LookupMap<compact_str::CompactString, usize>>,
    /// The nodes whose value has a `*`, looked up by key and literal prefix (a level may hold
    /// one per route of a gateway); listed in config order.
    pub wildcard: WildcardIndex,
    /// `key` -> node, for nodes with no value (any value).
    pub any: LookupMap<String, usize>,
}

/// What a node of a [`Level`] matches in an entry's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LevelValue<'a> {
    /// Exactly this value.
    Exact(&'a str),
    /// Values matching this pattern.
    Wildcard(&'a Pattern),
    /// Any value (a key-only node).
    Any,
}

impl Level {
    /// Every node of this level as `(key, value, node)`, in matching precedence: exact values,
    /// then wildcards by [`WildcardIndex::in_precedence_order`] (the longest literal prefix
    /// first, then config order), then key-only nodes; exact and key-only nodes sorted by their
    /// path in `domain`, so listings are stable.
    pub fn in_match_order<'a>(&'a self, domain: &Domain) -> Vec<(&'a str, LevelValue<'a>, usize)> {
        let by_path = |a: &(&str, LevelValue, usize), b: &(&str, LevelValue, usize)| {
            domain.nodes[a.2].path.cmp(&domain.nodes[b.2].path)
        };
        let mut exact: Vec<_> = self
            .exact
            .iter()
            .flat_map(|(k, values)| {
                values
                    .iter()
                    .map(move |(v, n)| (k.as_str(), LevelValue::Exact(v.as_str()), *n))
            })
            .collect();
        exact.sort_by(by_path);
        let mut any: Vec<_> = self
            .any
            .iter()
            .map(|(k, n)| (k.as_str(), LevelValue::Any, *n))
            .collect();
        any.sort_by(by_path);
        let wildcard = self
            .wildcard
            .in_precedence_order()
            .into_iter()
            .map(|(k, p, n)| (k.as_str(), LevelValue::Wildcard(p), *n));
        exact.into_iter().chain(wildcard).chain(any).collect()
    }

    /// The node an entry `(key, value)` leads to: the exact value first, then the matching
    /// wildcard with the longest literal prefix (of equal ones, the first in config order), then
    /// the key-only default (docs/rules.md). Costs a hash lookup or two and, with wildcards of
    /// the key, the value's length plus the patterns it has the prefix of
    /// ([`WildcardIndex::find`]), however many rules the level holds.
    pub fn find(&self, key: &str, value: &str) -> Option<usize> {
        if let Some(node) = self.exact.get(key).and_then(|values| values.get(value)) {
            return Some(*node);
        }
        if let Some(node) = self.wildcard.find(key, value) {
            return Some(node);
        }
        self.any.get(key).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bucket::Rate;

    #[test]
    fn reported_limits() {
        let rl = |cap, tokens, period_us| ReportedLimit::of(&Limit::new(cap, Rate::per(tokens, period_us).unwrap()));
        assert_eq!(
            rl(10, 10, 60_000_000),
            ReportedLimit {
                requests_per_unit: 10,
                unit: Unit::Minute
            }
        );
        assert_eq!(
            rl(7, 1, 250_000),
            ReportedLimit {
                requests_per_unit: 4,
                unit: Unit::Second
            }
        );
        assert_eq!(
            rl(100, 10, 1_000_000),
            ReportedLimit {
                requests_per_unit: 10,
                unit: Unit::Second
            }
        );
        assert_eq!(
            rl(5, 1, 90_000_000),
            ReportedLimit {
                requests_per_unit: 40,
                unit: Unit::Hour
            }
        );
        assert_eq!(
            rl(5, 1, 7 * 86_400_000_000),
            ReportedLimit {
                requests_per_unit: 1,
                unit: Unit::Week
            }
        );
        assert_eq!(
            rl(5, 7, 3 * 1_000_000),
            ReportedLimit {
                requests_per_unit: 140,
                unit: Unit::Minute
            }
        );
        // Slower than one per year: still 1 per YEAR, never the 0 that means "blocks everything".
        assert_eq!(
            rl(1, 1, 400 * 86_400_000_000),
            ReportedLimit {
                requests_per_unit: 1,
                unit: Unit::Year
            }
        );
        // Whole per YEAR only when exact: 3 per 2 years is reported as 1 per YEAR (floor).
        assert_eq!(
            rl(1, 3, 2 * 365 * 86_400_000_000),
            ReportedLimit {
                requests_per_unit: 1,
                unit: Unit::Year
            }
        );
        assert_eq!(
            ReportedLimit::of(&Limit::new(0, Rate::ZERO)),
            ReportedLimit {
                requests_per_unit: 0,
                unit: Unit::Second
            }
        );
    }

    /// A `rate_limit` of their schema has an account for descriptors with their own
    /// `hits_addend`, one capacity deep, whose demands have their thresholds; a limit that
    /// refills nothing, and tollgate's own schema, have none.
    #[test]
    fn their_rate_limits_count_own_hits_in_an_over_account() {
        use crate::core::bucket::MICRO;
        let rules = crate::rules::file::load_rules_text(
            std::path::Path::new("their.yaml"),
            "domain: d
descriptors:
  - {key: a, rate_limit: {unit: minute, requests_per_unit: 2}}
  - {key: z, rate_limit: {unit: minute, requests_per_unit: 0}}
  - {key: own, token_bucket: {capacity: 2, refill: 2/1m}}
  - key: night
    rate_limit: {unit: minute, requests_per_unit: 10}
    schedule: [{cron: \"* 0-5 * * *\", capacity: 0}]
",
        )
        .unwrap();
        let dom = rules.domain("d").unwrap();
        let named = |n: &str| dom.buckets.iter().find(|b| b.name == n).unwrap();
        let a = named("a");
        let own = a.over_account.as_deref().expect("their rate_limit has an account");
        let account = &own.account;
        assert!(account.own_hits == OwnHits::Account && account.debt && account.hidden);
        assert_eq!(own.bucket.own_hits, OwnHits::Bucket);
        assert_eq!(
            (&own.bucket.plan, own.bucket.debt),
            (&a.plan, false),
            "the bucket itself"
        );
        // On the bucket a check never fails, and N hits need N there.
        assert_eq!(own.bucket.demand_kind(DemandKind::Check), DemandKind::Consume(0));
        assert_eq!(
            own.bucket.demand_kind(DemandKind::Consume(2 * MICRO)).need_ut(0),
            Some(2 * MICRO)
        );
        assert_eq!(account.debt_depth_ut, 2 * MICRO);
        assert_eq!(account.plan.base().capacity(), 4, "capacity raised by the depth");
        assert_eq!(account.reported, a.reported, "reported as declared");
        // A check passes at a balance of 0; two hits need a balance of 2.
        assert_eq!(account.demand_kind(DemandKind::Check).need_ut(0), Some(2 * MICRO));
        assert_eq!(
            account.demand_kind(DemandKind::Consume(2 * MICRO)).need_ut(0),
            Some(4 * MICRO)
        );
        assert!(matches!(
            account.demand_kind(DemandKind::Consume(MICRO)),
            DemandKind::Debit { amount_ut, .. } if amount_ut == MICRO
        ));
        assert!(named("z").over_account.is_none(), "nothing would repay it");
        // A window of capacity 0 blocks; an account one base capacity deep would not.
        assert!(
            named("night").over_account.is_none(),
            "a schedule keeps the token bucket's meaning"
        );
        let own = dom
            .buckets
            .iter()
            .find(|b| !["a", "z", "night"].contains(&b.name.as_str()))
            .unwrap();
        assert!(
            own.over_account.is_none(),
            "tollgate's schema keeps its meaning: {own:?}"
        );
    }
}
