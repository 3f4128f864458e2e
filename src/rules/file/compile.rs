//! Validation and compilation of parsed rules files into a [`RuleSet`].

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::metadata::metadata_struct;
use super::model::{BucketSpec, DescriptorSpec, QuotaSpec, RateLimitSpec, RulesFile, ScheduleEntrySpec};
use super::{parse_refill, ConfigError};
use crate::core::bucket::{Limit, Rate, RateError, MAX_CAPACITY, MICRO};
use crate::core::schedule::{Expiring, Plan, Quota, Schedule, ScheduleEntry, ScheduleError, MAX_EXPIRES_US};
use crate::core::units::{Seconds, DAY_US, ENVOY_UNITS, SECOND_US};
use crate::rules::OVERRIDE_BUCKET;
use crate::rules::{shown, BucketPolicy, Domain, Level, Node, Pattern, ReportedLimit, Rule, RuleSet};
use envoy_types::pb::google::protobuf::Struct;

/// The longest time a bucket may take to fill from empty: 10 years of 365 days. Slower buckets
/// are almost certainly a mistake (`capacity: 1000000000, refill: 1/d`), and every wait and
/// reset time then stays far from saturating.
const MAX_FILL_US: u64 = 10 * 365 * DAY_US;

/// Compiles parsed files into one rule set, or every problem found. With `merge_domains`,
/// files declaring the same domain become one (see [`merge_domains`]).
pub(super) fn compile(files: Vec<(PathBuf, RulesFile)>, merge_domains: bool) -> Result<RuleSet, Vec<ConfigError>> {
    let mut errors = Vec::new();
    let mut set = RuleSet {
        files: files.iter().map(|(path, _)| path.clone()).collect(),
        ..RuleSet::default()
    };
    let files = if merge_domains {
        self::merge_domains(files, &mut errors)
    } else {
        files
    };
    for (path, file) in files {
        if file.domain.trim().is_empty() {
            errors.push(ConfigError::file(&path, "`domain` must not be empty"));
            continue;
        }
        if let Some(other) = set.domains.get(&file.domain) {
            errors.push(ConfigError::file(
                &path,
                format!(
                    "domain `{}` is already declared in {}",
                    file.domain,
                    other.file.display()
                ),
            ));
            continue;
        }
        let mut builder = DomainBuilder::new(&path);
        builder.compile(file.buckets, &file.descriptors);
        match builder.finish(&file.domain) {
            Ok(domain) => {
                set.domains.insert(file.domain, domain);
            }
            Err(mut e) => errors.append(&mut e),
        }
    }
    if errors.is_empty() {
        Ok(set)
    } else {
        Err(errors)
    }
}

/// envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`: the files that declare one domain become
/// one, under the first file's name, in file order: the later files' top-level descriptors are
/// added after the earlier ones', and their `buckets` beside them. As in theirs, nothing is
/// merged below the top level: a top-level key and value declared by two files is the
/// compiler's duplicate-descriptor error, and so is a bucket name declared by two files.
fn merge_domains(files: Vec<(PathBuf, RulesFile)>, errors: &mut Vec<ConfigError>) -> Vec<(PathBuf, RulesFile)> {
    let mut out: Vec<(PathBuf, RulesFile)> = Vec::with_capacity(files.len());
    for (path, file) in files {
        let first = out
            .iter_mut()
            .find(|(_, f)| !file.domain.trim().is_empty() && f.domain == file.domain);
        let Some((first_path, merged)) = first else {
            out.push((path, file));
            continue;
        };
        for (name, spec) in file.buckets {
            match merged.buckets.entry(name) {
                std::collections::btree_map::Entry::Occupied(taken) => errors.push(ConfigError::file(
                    &path,
                    format!(
                        "bucket `{}` of domain `{}` is already declared in {} (MERGE_DOMAIN_CONFIG merges descriptors, not buckets)",
                        taken.key(),
                        file.domain,
                        first_path.display()
                    ),
                )),
                std::collections::btree_map::Entry::Vacant(slot) => {
                    slot.insert(spec);
                }
            }
        }
        // A top-level key and value a file before declared: reported against this file, naming
        // the one before (the merged domain's later errors can only name the first file).
        for d in file.descriptors {
            let taken = merged.descriptors.iter().any(|m| m.key == d.key && m.value == d.value);
            if taken {
                let value = d.value.as_deref().map_or(String::new(), |v| format!("={v}"));
                errors.push(ConfigError::file(
                    &path,
                    format!(
                        "duplicate descriptor `{}{value}` of domain `{}`: already declared in {} (MERGE_DOMAIN_CONFIG merges distinct top-level descriptors)",
                        d.key,
                        file.domain,
                        first_path.display()
                    ),
                ));
            } else {
                merged.descriptors.push(d);
            }
        }
    }
    out
}

/// A bucket spec compiled: a token bucket (constant or scheduled), a quota, or both.
struct Compiled {
    bucket: Option<Plan>,
    quota: Option<Arc<Quota>>,
    /// `hidden: true` on the bucket (both the token bucket and its quota).
    hidden: bool,
    /// `hidden: true` on the quota, or on the bucket.
    quota_hidden: bool,
    /// The token bucket's debt floor depth in micro-tokens (`None`: not a debt bucket; a floor
    /// of 0 is `Some(0)`); its plan's capacities are raised by it.
    debt_ut: Option<u64>,
    /// The quota's, likewise.
    quota_debt_ut: Option<u64>,
    /// The token bucket's `lease`, in micro-tokens (0: none).
    lease_ut: u64,
}

/// The name under which the quota of a policy that also has a token bucket is reported and
/// stored: `<name>.quota`.
fn quota_name(name: &str) -> String {
    format!("{name}.quota")
}

/// What kind of limit a descriptor declares (the one it gives: two are an error).
enum LimitSource<'s> {
    /// `unlimited: true`, on the descriptor or in `rate_limit`; `with_limit` when it also
    /// gives a limit (an error).
    Unlimited { with_limit: bool },
    /// `bucket:`, a bucket declared under `buckets:`.
    Named(&'s str),
    /// `buckets: [a, b]`, several declared under `buckets:`, all of which a request must pass.
    NamedList(&'s [String]),
    /// An inline `token_bucket`, a `quota` alone, or both.
    Inline,
    /// envoyproxy/ratelimit's `rate_limit: {unit, requests_per_unit}`.
    Envoy(&'s RateLimitSpec),
    /// A `schedule` with no limit to change (an error).
    ScheduleOnly,
    /// No limit: the node only leads to its children.
    Nothing,
}

struct PendingReplaces {
    node: usize,
    path: String,
    names: Vec<String>,
    /// Set on a rule that cannot replace anything (unlimited, or without a limit): the names are
    /// still checked, then this note says the `replaces` has no effect.
    no_effect: Option<&'static str>,
}

struct DomainBuilder<'a> {
    file: &'a Path,
    buckets: Vec<BucketPolicy>,
    /// Buckets declared in tollgate's schema (`buckets:`, `token_bucket` with its name), which
    /// `bucket:` references and where a name is one bucket. An envoyproxy/ratelimit
    /// `rate_limit.name` is only a label and is not here (see [`DomainBuilder::add_label`]).
    by_name: HashMap<String, usize>,
    /// Every bucket by its name, in both schemas (an envoyproxy/ratelimit name may stand for
    /// several): so that finding a bucket by name stays a lookup in a domain of 100,000 rules.
    named: HashMap<String, Vec<usize>>,
    /// The wildcard values already at a level, `(parent node, key, pattern text)`, to refuse a
    /// second one without scanning the level.
    wildcards: HashSet<(Option<usize>, String, String)>,
    /// A policy with a token bucket and a quota: the token bucket's index to the quota's.
    companions: HashMap<usize, usize>,
    /// Names under `buckets:` that were rejected, so references to them are not also reported.
    rejected: HashSet<String>,
    nodes: Vec<Node>,
    notes: Vec<(String, String)>,
    replaces: Vec<PendingReplaces>,
    errors: Vec<ConfigError>,
}

impl<'a> DomainBuilder<'a> {
    fn new(file: &'a Path) -> Self {
        DomainBuilder {
            file,
            buckets: Vec::new(),
            by_name: HashMap::new(),
            named: HashMap::new(),
            wildcards: HashSet::new(),
            companions: HashMap::new(),
            rejected: HashSet::new(),
            nodes: Vec::new(),
            notes: Vec::new(),
            replaces: Vec::new(),
            errors: Vec::new(),
        }
    }

    fn note(&mut self, rule: &str, note: impl Into<String>) {
        self.notes.push((rule.to_owned(), note.into()));
    }

    fn error(&mut self, rule: &str, reason: impl Into<String>) {
        self.errors.push(ConfigError::rule(self.file, rule, reason));
    }

    fn compile(&mut self, buckets: std::collections::BTreeMap<String, BucketSpec>, descriptors: &[DescriptorSpec]) {
        for (name, spec) in buckets {
            let rule = format!("buckets.{name}");
            if let Err(reason) = check_bucket_name(&name) {
                self.error(&rule, reason);
                self.rejected.insert(name);
                continue;
            }
            let registered = self
                .bucket_spec(&rule, &spec)
                .and_then(|compiled| self.register(&rule, name.clone(), compiled));
            if registered.is_none() {
                self.rejected.insert(name);
            }
        }
        let mut root = Level::default();
        for spec in descriptors {
            self.node(spec, "", None, &mut root);
        }
        self.nodes.push(Node {
            path: String::new(),
            children: root,
            rule: None,
            parent: None,
            shared_pattern: None,
            detailed_metric: false,
            metadata: None,
        });
        self.resolve_replaces();
    }

    fn finish(self, name: &str) -> Result<Domain, Vec<ConfigError>> {
        if !self.errors.is_empty() {
            return Err(self.errors);
        }
        let mut nodes = self.nodes;
        let root = nodes.pop().expect("compile pushes the root last").children;
        Ok(Domain {
            name: name.to_owned(),
            file: self.file.to_owned(),
            buckets: self.buckets,
            has_shared: nodes.iter().any(|n| n.shared_pattern.is_some()),
            nodes,
            root,
            notes: self.notes,
            counters: Vec::new(),
            override_counters: Default::default(),
            envoyproxy_stats: Vec::new(),
        })
    }

    /// A bucket spec: its token bucket (with its schedule) and its quota, each validated.
    fn bucket_spec(&mut self, rule: &str, spec: &BucketSpec) -> Option<Compiled> {
        let quota = match &spec.quota {
            Some(q) => Some(self.quota(rule, q)?),
            None => None,
        };
        let token = match (spec.capacity, &spec.refill) {
            (Some(capacity), Some(refill)) => Some(self.limit(rule, capacity, refill)?),
            (None, None) => None,
            (Some(_), None) if quota.is_some() => {
                self.error(
                    rule,
                    "`capacity` without `refill` beside a `quota`: give the token bucket a `refill`, or drop \
                     `capacity` for a quota alone",
                );
                return None;
            }
            (Some(_), None) if spec.schedule.is_some() => {
                self.error(
                    rule,
                    "`schedule` on a fixed allowance (`capacity` without `refill`): a window would change a \
                     limit that never refills, and hand back a spent allowance when it closes",
                );
                return None;
            }
            // A fixed allowance: `capacity` tokens that never come back (a trial, a one-off
            // grant), until the admin API resets or refunds it, or its `expires` ends a period.
            (Some(capacity), None) => Some(self.allowance(rule, capacity)?),
            (None, Some(_)) if quota.is_some() => {
                self.error(
                    rule,
                    "a quota does not refill between its resets: `refill` needs a `capacity` too, for a token \
                     bucket beside the quota",
                );
                return None;
            }
            (None, Some(_)) => {
                self.error(rule, "`refill` without `capacity`: a token bucket needs both");
                return None;
            }
        };
        let expires_us = match (spec.expires, &token) {
            (None, _) => None,
            (Some(expires), Some(limit)) if limit.rate.is_zero() => Some(self.expires(rule, expires)?),
            (Some(_), _) => {
                self.error(
                    rule,
                    "`expires` is for a fixed allowance (`capacity` without `refill`): a token bucket refills and a \
                     quota resets on its own",
                );
                return None;
            }
        };
        let schedule = spec.schedule.as_deref().unwrap_or_default();
        let bucket = match (token, expires_us) {
            (Some(limit), Some(expires_us)) => Some(Plan::Expiring(Expiring::new(limit, expires_us))),
            (Some(limit), None) => Some(self.scheduled(rule, limit, schedule)?),
            (None, _) if !schedule.is_empty() => {
                self.error(
                    rule,
                    "`schedule` changes a token bucket's capacity and refill, and this bucket has none (a quota \
                     resets on its own `reset` cron)",
                );
                return None;
            }
            (None, _) if quota.is_none() => {
                self.error(
                    rule,
                    "a bucket needs `capacity` and `refill` (a token bucket), `capacity` alone (a fixed \
                     allowance), a `quota`, or a token bucket and a quota",
                );
                return None;
            }
            (None, _) => None,
        };
        let (bucket, debt_ut) = match bucket {
            Some(plan) if spec.debt || spec.debt_floor.is_some() => {
                let (plan, depth) = self.debt_bucket(rule, plan, spec.debt, spec.debt_floor)?;
                (Some(plan), Some(depth))
            }
            other => (other, None),
        };
        // The bucket's `debt_floor` is its quota's when the quota is all it has.
        let bucket_floor = if bucket.is_none() { spec.debt_floor } else { None };
        let (quota, quota_debt_ut) = match (quota, &spec.quota) {
            (Some(q), Some(qs)) if spec.debt || qs.debt || qs.debt_floor.or(bucket_floor).is_some() => {
                let floor = qs.debt_floor.or(bucket_floor);
                let (q, depth) = self.debt_quota(rule, &q, spec.debt || qs.debt, floor)?;
                (Some(q), Some(depth))
            }
            (q, _) => (q, None),
        };
        let lease_ut = match spec.lease {
            None => 0,
            Some(lease) => self.lease(rule, lease, &bucket, quota.is_some(), debt_ut.is_some())?,
        };
        Some(Compiled {
            bucket,
            quota,
            hidden: spec.hidden,
            quota_hidden: spec.hidden || spec.quota.as_ref().is_some_and(|q| q.hidden),
            debt_ut,
            quota_debt_ut,
            lease_ut,
        })
    }

    /// A bucket's `lease: lease` in micro-tokens; `None` (with the error recorded) unless the
    /// bucket is a plain token bucket (`capacity` and `refill`, schedules allowed: not a quota,
    /// a fixed allowance or a debt bucket, whose every use must reach the store) and
    /// `1 <= lease <= capacity`.
    fn lease(&mut self, rule: &str, lease: u64, bucket: &Option<Plan>, quota: bool, debt: bool) -> Option<u64> {
        let why = match bucket {
            _ if quota => Some("a bucket with a `quota` (its quota is asked on every request)"),
            _ if debt => Some("a debt bucket (every usage report must reach the store)"),
            Some(Plan::Fixed(limit)) if limit.rate.is_zero() => Some("a fixed allowance (it never refills)"),
            Some(Plan::Fixed(_)) | Some(Plan::Scheduled(_)) => None,
            _ => Some("this bucket"),
        };
        if let Some(what) = why {
            self.error(
                rule,
                format!("`lease` is for a token bucket (`capacity` and `refill`), not for {what}; remove `lease`"),
            );
            return None;
        }
        let capacity = bucket.as_ref().map_or(0, |p| p.base().capacity());
        if lease == 0 || lease > capacity {
            self.error(
                rule,
                format!(
                    "`lease: {lease}` must be between 1 and the bucket's capacity ({capacity}): the tokens a \
                     replica reserves at a time"
                ),
            );
            return None;
        }
        Some(lease.saturating_mul(crate::core::bucket::MICRO))
    }

    /// How deep a debt floor of `floor` tokens (default minus `capacity`) lies, in
    /// micro-tokens; `None` (with the error recorded) for `debt_floor` without `debt: true`, a
    /// floor above 0, or one that takes the account, at its `highest` capacity (a schedule
    /// window's may exceed the base's), beyond the exact range.
    fn debt_depth(&mut self, rule: &str, debt: bool, floor: Option<i64>, capacity: u64, highest: u64) -> Option<u64> {
        if !debt {
            self.error(
                rule,
                "`debt_floor` is for a debt bucket: add `debt: true`, or remove `debt_floor`",
            );
            return None;
        }
        let depth = match floor {
            None => capacity,
            Some(f) if f > 0 => {
                self.error(
                    rule,
                    format!("`debt_floor: {f}` must be 0 or below: how far below zero a balance may go, in tokens"),
                );
                return None;
            }
            Some(f) => f.unsigned_abs(),
        };
        if highest.saturating_add(depth) > MAX_CAPACITY {
            let room = MAX_CAPACITY.saturating_sub(highest);
            self.error(
                rule,
                format!(
                    "a debt bucket of capacity {highest} with its floor at -{depth} spans more than {MAX_CAPACITY} \
                     tokens, the most every backend computes exactly; set `debt_floor` to -{room} or higher"
                ),
            );
            return None;
        }
        Some(depth * MICRO)
    }

    /// A token bucket's plan as a debt bucket's: its capacities raised by the floor's depth.
    fn debt_bucket(&mut self, rule: &str, plan: Plan, debt: bool, floor: Option<i64>) -> Option<(Plan, u64)> {
        if plan.base().rate.is_zero() && debt {
            self.error(
                rule,
                "`debt` on a fixed allowance (`capacity` without `refill`): nothing would ever repay the debt; give \
                 the bucket a `refill`, or use a `quota` whose reset repays it",
            );
            return None;
        }
        let depth = self.debt_depth(rule, debt, floor, plan.base().capacity(), highest_capacity(&plan))?;
        Some((raised(plan, depth), depth))
    }

    /// A quota as a debt quota's: its capacity raised by the floor's depth, which is at most
    /// one allowance (so that two resets always repay a debt).
    fn debt_quota(&mut self, rule: &str, q: &Quota, debt: bool, floor: Option<i64>) -> Option<(Arc<Quota>, u64)> {
        let allowance = q.limit().capacity();
        let depth = self.debt_depth(rule, debt, floor, allowance, allowance)?;
        if depth > allowance * MICRO {
            self.error(
                rule,
                format!(
                    "a debt quota's `debt_floor` may lie at most one allowance below zero (-{allowance}), so that a \
                     reset or two always repays the debt"
                ),
            );
            return None;
        }
        Some((Arc::new(q.clone().with_debt_depth(depth)), depth))
    }

    /// An allowance's `expires` in microseconds: at least a second, at most
    /// [`MAX_EXPIRES_US`] (ten years).
    fn expires(&mut self, rule: &str, expires: Seconds) -> Option<u64> {
        let us = expires.0.saturating_mul(SECOND_US);
        if us == 0 || us > MAX_EXPIRES_US {
            self.error(
                rule,
                format!(
                    "`expires: {}s` must be from 1 second to {} days",
                    expires.0,
                    MAX_EXPIRES_US / DAY_US
                ),
            );
            return None;
        }
        Some(us)
    }

    /// A token bucket's limit: `capacity` whole tokens refilled at `refill`.
    fn limit(&mut self, rule: &str, capacity: u64, refill: &str) -> Option<Limit> {
        self.allowance(rule, capacity)?;
        let rate = self.rate(rule, refill)?;
        let limit = Limit::new(capacity, rate);
        self.check_fill(rule, &limit, refill).then_some(limit)
    }

    /// A fixed allowance: `capacity` whole tokens and no refill.
    fn allowance(&mut self, rule: &str, capacity: u64) -> Option<Limit> {
        if capacity == 0 {
            self.error(rule, "capacity must be at least 1 token");
            return None;
        }
        if capacity > MAX_CAPACITY {
            self.error(
                rule,
                format!("capacity {capacity} is above the maximum of {MAX_CAPACITY} tokens"),
            );
            return None;
        }
        Some(Limit::new(capacity, Rate::ZERO))
    }

    /// A refill string as an exact rate.
    fn rate(&mut self, rule: &str, refill: &str) -> Option<Rate> {
        let parsed = match parse_refill(refill) {
            Ok(r) => r,
            Err(reason) => {
                self.error(rule, reason);
                return None;
            }
        };
        match Rate::per(parsed.tokens, parsed.period_us) {
            Ok(rate) => Some(rate),
            Err(RateError::TooFine { .. }) => {
                self.error(
                    rule,
                    format!(
                        "refill `{refill}` cannot be computed exactly on every backend; use a token count that is a \
                         multiple of 1000 with a period in whole minutes, hours or days, or a shorter period"
                    ),
                );
                None
            }
            Err(e) => {
                self.error(rule, format!("refill `{refill}`: {e}"));
                None
            }
        }
    }

    /// Whether `limit` fills from empty within [`MAX_FILL_US`]; records the error if not.
    /// `refill` is for the message.
    fn check_fill(&mut self, rule: &str, limit: &Limit, refill: &str) -> bool {
        let rate = limit.rate;
        if rate.is_zero() || limit.capacity_ut == 0 {
            return true;
        }
        // Exact, without the saturation of `time_to_fill_us`: capacity * den / num, rounded up.
        let fill_us = (u128::from(limit.capacity_ut) * u128::from(rate.den())).div_ceil(u128::from(rate.num()));
        if fill_us <= u128::from(MAX_FILL_US) {
            return true;
        }
        let days = fill_us.div_ceil(u128::from(DAY_US));
        self.error(
            rule,
            format!(
                "capacity {} at refill `{refill}` takes {days} days (about {} years) to fill from empty, \
                 more than the maximum of 10 years ({} days); raise the refill or lower the capacity",
                limit.capacity(),
                days / 365,
                MAX_FILL_US / DAY_US
            ),
        );
        false
    }

    /// `base` under the schedule `entries`: a constant plan when there are none.
    fn scheduled(&mut self, rule: &str, base: Limit, entries: &[ScheduleEntrySpec]) -> Option<Plan> {
        if entries.is_empty() {
            return Some(Plan::Fixed(base));
        }
        let mut built = Vec::with_capacity(entries.len());
        let mut ok = true;
        for (i, e) in entries.iter().enumerate() {
            let refill = match &e.refill {
                Some(text) => match self.rate(&format!("{rule}.schedule[{i}]"), text) {
                    Some(rate) => Some(rate),
                    None => {
                        ok = false;
                        continue;
                    }
                },
                None => None,
            };
            match ScheduleEntry::new(&e.cron, e.timezone.as_deref(), e.scale, e.capacity, refill) {
                Ok(entry) => built.push(entry),
                Err(reason) => {
                    self.error(&format!("{rule}.schedule[{i}]"), reason.to_string());
                    ok = false;
                }
            }
        }
        if !ok {
            return None;
        }
        let schedule = match Schedule::new(base, built) {
            Ok(s) => s,
            Err(reason) => {
                let at = match reason {
                    ScheduleError::ScaledCapacityTooLarge { entry, .. }
                    | ScheduleError::ScaledBelowOneToken { entry, .. }
                    | ScheduleError::InexactScaledRate { entry, .. } => {
                        format!("{rule}.schedule[{entry}]")
                    }
                    _ => rule.to_owned(),
                };
                self.error(&at, reason.to_string());
                return None;
            }
        };
        for (i, e) in entries.iter().enumerate() {
            let limit = *schedule.entry_limit(i).expect("one limit per entry");
            let refill = e.refill.clone().unwrap_or_else(|| "(scaled)".to_owned());
            if !self.check_fill(&format!("{rule}.schedule[{i}]"), &limit, &refill) {
                return None;
            }
        }
        Some(Plan::Scheduled(Arc::new(schedule)))
    }

    /// A quota block; a `refill` in it is rejected (a quota does not drip).
    fn quota(&mut self, rule: &str, q: &QuotaSpec) -> Option<Arc<Quota>> {
        if q.refill.is_some() {
            self.error(
                rule,
                "a quota does not refill between its resets: remove `refill` from `quota` (for a token bucket \
                 beside the quota, give the bucket `capacity` and `refill`)",
            );
            return None;
        }
        match Quota::new(q.limit, &q.reset, q.timezone.as_deref()) {
            Ok(quota) => Some(Arc::new(quota)),
            Err(reason) => {
                self.error(rule, format!("quota: {reason}"));
                None
            }
        }
    }

    /// Registers a compiled tollgate-schema bucket under `name`: the token bucket (or the quota
    /// alone) under `name`, and a quota beside a token bucket under `<name>.quota`. Returns the
    /// index of the first and, when there are both, of the quota.
    fn register(&mut self, rule: &str, name: String, compiled: Compiled) -> Option<(usize, Option<usize>)> {
        match compiled {
            Compiled {
                bucket: Some(plan),
                quota: Some(quota),
                hidden,
                quota_hidden,
                debt_ut,
                quota_debt_ut,
                ..
            } => {
                let bucket = self.add_policy(rule, name.clone(), plan, hidden, debt_ut, 0)?;
                let companion = quota_name(&name);
                if self.by_name.contains_key(&companion) {
                    self.error(
                        rule,
                        format!(
                            "the quota of bucket `{name}` is named `{companion}`, which is already a bucket of this \
                             file; rename one of them"
                        ),
                    );
                    return None;
                }
                let quota = self.add_policy(rule, companion, Plan::Quota(quota), quota_hidden, quota_debt_ut, 0)?;
                self.companions.insert(bucket, quota);
                Some((bucket, Some(quota)))
            }
            Compiled {
                bucket: Some(plan),
                quota: None,
                hidden,
                debt_ut,
                lease_ut,
                ..
            } => Some((self.add_policy(rule, name, plan, hidden, debt_ut, lease_ut)?, None)),
            Compiled {
                bucket: None,
                quota: Some(quota),
                quota_hidden,
                quota_debt_ut,
                ..
            } => Some((
                self.add_policy(rule, name, Plan::Quota(quota), quota_hidden, quota_debt_ut, 0)?,
                None,
            )),
            Compiled {
                bucket: None,
                quota: None,
                ..
            } => None,
        }
    }

    /// The name of the bucket whose quota policy `idx` is, if it is one.
    fn companion_of(&self, idx: usize) -> Option<&str> {
        self.companions
            .iter()
            .find(|(_, q)| **q == idx)
            .map(|(b, _)| self.buckets[*b].name.as_str())
    }

    /// Registers a tollgate-schema policy under `name`; a second declaration of the same name
    /// must be identical (then both rules share the bucket).
    fn add_policy(
        &mut self,
        rule: &str,
        name: String,
        plan: Plan,
        hidden: bool,
        debt_ut: Option<u64>,
        lease_ut: u64,
    ) -> Option<usize> {
        let reported = reported_base(&plan, debt_ut.unwrap_or(0));
        if let Some(&idx) = self.by_name.get(&name) {
            let existing = &self.buckets[idx];
            let same_limit = existing.plan == plan
                && existing.reported == reported
                && existing.debt.then_some(existing.debt_depth_ut) == debt_ut
                && existing.lease_ut == lease_ut;
            if same_limit && existing.hidden == hidden {
                return Some(idx);
            }
            let reason = match self.companion_of(idx) {
                Some(owner) => format!(
                    "bucket `{name}` is the name of bucket `{owner}`'s quota (a quota beside a token bucket is \
                     named `<bucket>.quota`); rename one of them"
                ),
                None if same_limit => format!(
                    "bucket `{name}` is already declared, with `hidden: {}`: give every declaration the same \
                     `hidden`",
                    existing.hidden
                ),
                None => format!("bucket `{name}` is already declared with a different limit"),
            };
            self.error(rule, reason);
            return None;
        }
        let policy = BucketPolicy::new(name.clone(), plan, reported)
            .with_hidden(hidden)
            .with_lease(lease_ut);
        let idx = self.push_bucket(match debt_ut {
            Some(depth_ut) => policy.with_debt_depth(depth_ut),
            None => policy,
        });
        self.by_name.insert(name, idx);
        Some(idx)
    }

    /// Adds `policy` to the domain's buckets; returns its index.
    fn push_bucket(&mut self, policy: BucketPolicy) -> usize {
        let idx = self.buckets.len();
        self.named.entry(policy.name.clone()).or_default().push(idx);
        self.buckets.push(policy);
        idx
    }

    /// The buckets named `name`, in the order they were declared.
    fn buckets_named(&self, name: &str) -> &[usize] {
        self.named.get(name).map_or(&[], Vec::as_slice)
    }

    /// Registers an envoyproxy/ratelimit limit named `name`. There a `rate_limit.name` is a label
    /// (what `replaces` refers to), not an identity: a policy with the same name and the same
    /// limit is shared, and a different limit gets a policy of its own under the same name. Two
    /// such policies never share an instance: an instance key holds the request's entries, and
    /// one list of entries reaches one node.
    fn add_label(&mut self, name: String, plan: Plan, reported: ReportedLimit, hidden: bool) -> usize {
        if let Some(&idx) = self.buckets_named(&name).iter().find(|&&i| {
            let b = &self.buckets[i];
            b.plan == plan && b.reported == reported && b.hidden == hidden
        }) {
            return idx;
        }
        self.push_bucket(BucketPolicy::new(name, plan, reported).with_hidden(hidden))
    }

    fn node(&mut self, spec: &DescriptorSpec, parent: &str, parent_id: Option<usize>, level: &mut Level) {
        let value = spec.value.as_deref().filter(|v| !v.is_empty());
        let path = node_path(parent, spec);
        for field in spec.ignored_fields() {
            self.note(&path, format!("`{field}` {}", super::model::metric_field_note(field)));
        }
        if spec.key.is_empty() {
            self.error(&path, "`key` must not be empty");
            return;
        }
        let rule = self.rule(spec, &path);
        let metadata = self.metadata(spec, &path, rule.as_ref());
        let id = self.nodes.len();
        let duplicate = match value {
            None => level.any.insert(spec.key.clone(), id).is_some(),
            Some(v) => match Pattern::parse(v) {
                Some(pattern) => {
                    let dup = !self.wildcards.insert((parent_id, spec.key.clone(), pattern.text()));
                    self.note_outranked(&path, level, &spec.key, &pattern);
                    level.wildcard.insert(spec.key.clone(), pattern, id);
                    dup
                }
                None => level
                    .exact
                    .entry(spec.key.clone())
                    .or_default()
                    .insert(v.into(), id)
                    .is_some(),
            },
        };
        if duplicate {
            self.error(
                &path,
                "duplicate descriptor: the same key and value appear twice at this level",
            );
        }
        let shared_pattern = match value {
            Some(v) if spec.share_threshold && v.contains('*') => Some(v.to_owned()),
            _ => {
                if spec.share_threshold {
                    self.note(&path, "`share_threshold` has no effect on a value without `*`");
                }
                None
            }
        };
        self.nodes.push(Node {
            path: path.clone(),
            children: Level::default(),
            rule,
            parent: parent_id,
            shared_pattern,
            detailed_metric: matches!(spec.detailed_metric, Some(serde_yaml::Value::Bool(true))),
            metadata,
        });
        let mut children = Level::default();
        for child in &spec.descriptors {
            self.node(child, &path, Some(id), &mut children);
        }
        self.nodes[id].children = children;
    }

    /// Notes a wildcard that an earlier pattern of its key, with a shorter prefix, matches
    /// wholly (`/api/v1/*` after `/api/*`): the longer prefix wins, so it applies to its values,
    /// where file order (envoyproxy/ratelimit's, and tollgate's before) never reached it. Said
    /// once, naming the first such pattern, which file order applied instead.
    fn note_outranked(&mut self, path: &str, level: &Level, key: &str, pattern: &Pattern) {
        let prefix = pattern.prefix();
        let earlier = level
            .wildcard
            .candidates(key, prefix)
            .map(|(_, entry)| entry)
            .filter(|(_, p, _)| p.prefix().len() < prefix.len() && p.is_prefix_only())
            .min_by_key(|(_, _, node)| *node);
        if let Some((_, earlier, _)) = earlier {
            self.note(
                path,
                format!(
                    "`{}` wins over `{}`, listed before it, for every value it matches (the longer literal \
                     prefix wins); tried in file order, as envoyproxy/ratelimit tries wildcards, it would never \
                     apply",
                    pattern.text(),
                    earlier.text()
                ),
            );
        }
    }

    /// The node's rule; errors are recorded and give `None`.
    fn rule(&mut self, spec: &DescriptorSpec, path: &str) -> Option<Rule> {
        let source = self.limit_source(spec, path)?;
        let replaces = self.rule_replaces(spec, path)?;
        let one = |(bucket, quota): (usize, Option<usize>)| std::iter::once(bucket).chain(quota).collect();
        let buckets: Vec<usize> = match source {
            LimitSource::Unlimited { with_limit } => return self.unlimited_rule(spec, path, with_limit, replaces),
            LimitSource::Named(name) => one(self.named_bucket(spec, path, name)?),
            LimitSource::NamedList(names) => self.named_buckets(spec, path, names)?,
            LimitSource::Inline => one(self.inline_bucket(spec, path)?),
            LimitSource::Envoy(rl) => one(self.envoy_bucket(spec, path, rl)?),
            LimitSource::ScheduleOnly => {
                self.error(
                    path,
                    "`schedule` changes a limit, and this rule has none: add `token_bucket` or `rate_limit`, or \
                     reference a bucket",
                );
                return None;
            }
            LimitSource::Nothing => {
                if spec.shadow_mode {
                    self.note(path, "`shadow_mode` has no effect on a rule without a limit");
                }
                if spec.quota_mode {
                    self.note(path, "`quota_mode` has no effect on a rule without a limit");
                }
                self.pending_replaces(
                    path,
                    replaces,
                    Some("`replaces` has no effect on a rule without a limit"),
                );
                return None;
            }
        };
        self.pending_replaces(path, replaces, None);
        Some(Rule::Limited {
            buckets,
            shadow: spec.shadow_mode,
            quota_mode: spec.quota_mode,
            replaces: Vec::new(),
        })
    }

    /// The node's `metadata` as a `Struct`, kept only for a limited `rule` (as in
    /// envoyproxy/ratelimit, only a descriptor with a limit passes it on); errors are recorded
    /// and give `None`.
    fn metadata(&mut self, spec: &DescriptorSpec, path: &str, rule: Option<&Rule>) -> Option<Struct> {
        let yaml = spec.metadata.as_ref()?;
        let metadata = match metadata_struct(yaml) {
            Ok(m) => m,
            Err(reason) => {
                self.error(path, reason);
                return None;
            }
        };
        if !matches!(rule, Some(Rule::Limited { .. })) {
            let what = if matches!(rule, Some(Rule::Unlimited { .. })) {
                "an unlimited rule"
            } else {
                "a rule without a limit"
            };
            self.note(
                path,
                format!("`metadata` is never passed on from {what}: only a limited rule's is"),
            );
            return None;
        }
        Some(metadata)
    }

    /// What kind of limit `spec` declares; errors (a unit on an unlimited `rate_limit`, or
    /// more than one limit) are recorded and give `None`.
    fn limit_source<'s>(&mut self, spec: &'s DescriptorSpec, path: &str) -> Option<LimitSource<'s>> {
        let rl = spec.rate_limit.as_ref();
        let unlimited = spec.unlimited || rl.is_some_and(|r| r.unlimited);
        // envoyproxy/ratelimit rejects a unit on an unlimited rate_limit but ignores a count; an
        // empty `unit: ""` is no unit there.
        if let Some(r) = rl.filter(|r| r.unlimited) {
            if r.unit.as_deref().is_some_and(|u| !u.is_empty()) {
                self.error(
                    path,
                    "`unlimited: true` with a `unit`: an unlimited rate_limit has no unit",
                );
                return None;
            }
            if r.requests_per_unit.is_some() {
                self.note(path, "`requests_per_unit` has no effect on an unlimited rate_limit");
            }
        }
        let rl_limit = rl.filter(|r| !r.unlimited);
        let sources = [
            spec.bucket.is_some(),
            spec.buckets.is_some(),
            spec.token_bucket.is_some(),
            rl_limit.is_some(),
        ];
        let count = sources.iter().filter(|s| **s).count();
        if count > 1 {
            self.error(
                path,
                "a rule gives its limit once: use one of `bucket`, `buckets`, `token_bucket`, `rate_limit`",
            );
            return None;
        }
        Some(if unlimited {
            LimitSource::Unlimited { with_limit: count > 0 }
        } else if let Some(name) = &spec.bucket {
            LimitSource::Named(name)
        } else if let Some(names) = &spec.buckets {
            LimitSource::NamedList(names)
        } else if spec.token_bucket.is_some() || (spec.quota.is_some() && rl_limit.is_none()) {
            LimitSource::Inline
        } else if let Some(rl) = rl_limit {
            LimitSource::Envoy(rl)
        } else if spec.schedule.is_some() {
            LimitSource::ScheduleOnly
        } else {
            LimitSource::Nothing
        })
    }

    /// The bucket names the rule's `replaces` lists, on the descriptor or in `rate_limit`.
    fn rule_replaces(&mut self, spec: &DescriptorSpec, path: &str) -> Option<Vec<String>> {
        let rl = spec.rate_limit.as_ref();
        Some(match (&spec.replaces, rl.and_then(|r| r.replaces.as_ref())) {
            (Some(_), Some(_)) => {
                self.error(
                    path,
                    "`replaces` is given twice (on the descriptor and in `rate_limit`)",
                );
                return None;
            }
            (Some(r), None) | (None, Some(r)) => r.iter().map(|r| r.name.clone()).collect(),
            (None, None) => Vec::new(),
        })
    }

    /// An unlimited rule, unless it also has a `schedule`, a quota or a limit (`with_limit`).
    fn unlimited_rule(
        &mut self,
        spec: &DescriptorSpec,
        path: &str,
        with_limit: bool,
        replaces: Vec<String>,
    ) -> Option<Rule> {
        if spec.schedule.is_some() {
            self.error(
                path,
                "`schedule` on an unlimited rule: an unlimited rule has no limit for a schedule to change",
            );
            return None;
        }
        if spec.quota.is_some() {
            self.error(path, "`unlimited: true` cannot be combined with a quota");
            return None;
        }
        if with_limit {
            self.error(path, "`unlimited: true` cannot be combined with a limit");
            return None;
        }
        self.pending_replaces(path, replaces, None);
        if spec.quota_mode {
            self.note(path, "`quota_mode` has no effect on an unlimited rule");
        }
        Some(Rule::Unlimited { replaces: Vec::new() })
    }

    /// The bucket `name` under `buckets:` and its quota, if it has one.
    fn named_bucket(&mut self, spec: &DescriptorSpec, path: &str, name: &str) -> Option<(usize, Option<usize>)> {
        self.references_only(spec, path, &format!("bucket `{name}`"), "a bucket, whose name is used")?;
        self.declared(path, name)
    }

    /// `Some` when a rule that references declared buckets (`what`, of `kind`) gives no limit
    /// fields of its own (`schedule`, `quota`, `name`), which belong on the buckets; else the
    /// error is recorded.
    fn references_only(&mut self, spec: &DescriptorSpec, path: &str, what: &str, kind: &str) -> Option<()> {
        let field = match (spec.schedule.is_some(), spec.quota.is_some()) {
            (true, true) => Some("`schedule` and `quota`"),
            (true, false) => Some("`schedule`"),
            (false, true) => Some("`quota`"),
            (false, false) => None,
        };
        if let Some(field) = field {
            self.error(
                path,
                format!("{field} on a rule that references {what}: declare it on the bucket under `buckets:`"),
            );
            return None;
        }
        if spec.name.is_some() {
            self.error(
                path,
                format!("`name` names an inline limit; this rule references {kind}"),
            );
            return None;
        }
        Some(())
    }

    /// The bucket declared as `name` under `buckets:`, and its quota if it has one; an unknown
    /// name is recorded as an error.
    fn declared(&mut self, path: &str, name: &str) -> Option<(usize, Option<usize>)> {
        match self.by_name.get(name) {
            Some(&idx) => Some((idx, self.companions.get(&idx).copied())),
            // The bucket's own error is reported; an "unknown bucket" here would only add noise.
            None if self.rejected.contains(name) => None,
            None => {
                let mut known: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
                known.sort_unstable();
                self.error(
                    path,
                    format!("unknown bucket `{name}`; declared buckets: [{}]", known.join(", ")),
                );
                None
            }
        }
    }

    /// The buckets `names` under `buckets:`, each followed by its quota if it has one, in the
    /// order given; at least one, each once.
    fn named_buckets(&mut self, spec: &DescriptorSpec, path: &str, names: &[String]) -> Option<Vec<usize>> {
        if names.is_empty() {
            self.error(
                path,
                "`buckets` is empty: name at least one bucket declared under `buckets:`",
            );
            return None;
        }
        if let Some(twice) = names.iter().enumerate().find(|(i, n)| names[..*i].contains(n)) {
            self.error(path, format!("`buckets` names `{}` twice", twice.1));
            return None;
        }
        self.references_only(spec, path, "buckets", "buckets, whose names are used")?;
        let mut out = Vec::with_capacity(names.len());
        let mut failed = false;
        for name in names {
            if let Some(owner) = self
                .by_name
                .get(name.as_str())
                .and_then(|idx| self.companion_of(*idx))
                .map(str::to_owned)
            {
                let reason = format!(
                    "`buckets` names `{name}`, the quota of bucket `{owner}`: name `{owner}`, and its quota comes \
                     with it"
                );
                self.error(path, reason);
                failed = true;
                continue;
            }
            match self.declared(path, name) {
                Some((bucket, quota)) => out.extend(std::iter::once(bucket).chain(quota)),
                None => failed = true,
            }
        }
        (!failed).then_some(out)
    }

    /// The rule's inline `token_bucket`, quota, or both: registered under the rule's `name`,
    /// or its path.
    fn inline_bucket(&mut self, spec: &DescriptorSpec, path: &str) -> Option<(usize, Option<usize>)> {
        // An inline token bucket, a quota alone, or both; the rule's `schedule` and `quota`
        // join the inline bucket's own (given twice is an error).
        let mut merged = spec.token_bucket.clone().unwrap_or(BucketSpec {
            capacity: None,
            refill: None,
            schedule: None,
            quota: None,
            hidden: false,
            debt: false,
            debt_floor: None,
            expires: None,
            lease: None,
        });
        for (field, twice) in [
            ("schedule", merged.schedule.is_some() && spec.schedule.is_some()),
            ("quota", merged.quota.is_some() && spec.quota.is_some()),
        ] {
            if twice {
                self.error(
                    path,
                    format!("`{field}` is given twice (on the rule and in `token_bucket`)"),
                );
                return None;
            }
        }
        merged.schedule = merged.schedule.or_else(|| spec.schedule.clone());
        merged.quota = merged.quota.or_else(|| spec.quota.clone());
        let name = spec.name.clone().unwrap_or_else(|| path.to_owned());
        if let Err(reason) = check_bucket_name(&name) {
            self.error(path, format!("{reason}; give the rule a `name`"));
            return None;
        }
        let compiled = self.bucket_spec(path, &merged)?;
        self.register(path, name, compiled)
    }

    /// Marks the policies `ids` (a bucket and its quota) as named after their rule's path.
    fn mark_unnamed(&mut self, (bucket, quota): (usize, Option<usize>)) {
        for idx in std::iter::once(bucket).chain(quota) {
            self.buckets[idx].unnamed = true;
        }
    }

    /// The bucket of the rule's envoyproxy/ratelimit `rate_limit` `rl`, and of its quota if it
    /// has one.
    fn envoy_bucket(
        &mut self,
        spec: &DescriptorSpec,
        path: &str,
        rl: &RateLimitSpec,
    ) -> Option<(usize, Option<usize>)> {
        if spec.name.is_some() {
            self.error(
                path,
                "`name` goes inside `rate_limit` in the envoyproxy/ratelimit schema",
            );
            return None;
        }
        // `name: ""` is no name in theirs (Go's zero value; Envoy Gateway writes it out).
        let given = rl.name.clone().filter(|n| !n.is_empty());
        let unnamed = given.is_none();
        let name = given.unwrap_or_else(|| path.to_owned());
        if let Err(reason) = check_bucket_name(&name) {
            self.error(path, format!("{reason}; give the rate_limit a `name`"));
            return None;
        }
        let (limit, reported) = self.envoy_limit(path, rl.unit.as_deref(), rl.requests_per_unit)?;
        if limit.rate.is_zero() && spec.schedule.is_some() {
            self.error(
                path,
                "`schedule` on a rule with `requests_per_unit: 0`, which blocks every request: give it a \
                 positive limit, and a window with `capacity: 0` where it should block",
            );
            return None;
        }
        let plan = self.scheduled(path, limit, spec.schedule.as_deref().unwrap_or_default())?;
        let bucket = self.add_label(name.clone(), plan, reported, false);
        let quota = match &spec.quota {
            Some(q) if q.debt || q.debt_floor.is_some() => {
                self.error(
                    path,
                    "`debt` on a quota beside an envoyproxy/ratelimit `rate_limit`: declare the budget as a bucket \
                     of its own (`buckets:` with `debt: true`) and name it with `bucket:` or `buckets:`",
                );
                return None;
            }
            Some(q) => {
                let quota = Plan::Quota(self.quota(path, q)?);
                let reported = reported_base(&quota, 0);
                let idx = self.add_label(quota_name(&name), quota, reported, q.hidden);
                self.companions.insert(bucket, idx);
                Some(idx)
            }
            None => None,
        };
        if unnamed {
            self.mark_unnamed((bucket, quota));
        }
        self.add_over_account(bucket);
        Some((bucket, quota))
    }

    /// Gives the `rate_limit` bucket `idx` its [`BucketPolicy::over_account`]: envoyproxy/ratelimit
    /// counts every hit, those over the limit too, so a usage report that does not fit still
    /// counts and a later zero-hit check is over only once usage went past the limit. The
    /// account's floor lies one capacity below zero (less if that would leave the exact range),
    /// so an overshoot is repaid within about one unit of the limit, as their window forgets it
    /// at its end. A limit that refills nothing (`requests_per_unit: 0`) gets none (nothing
    /// would repay it), nor one with a `schedule`.
    fn add_over_account(&mut self, idx: usize) {
        let b = &self.buckets[idx];
        // A schedule's windows may hold less than the base (`capacity: 0` to block): an
        // account one base capacity deep would let checks pass through them. Their schema has
        // no schedules; tollgate's extension keeps the token bucket's meaning.
        if b.over_account.is_some() || !matches!(b.plan, Plan::Fixed(_)) || b.plan.base().rate.is_zero() {
            return;
        }
        let highest = highest_capacity(&b.plan);
        let depth = b.plan.base().capacity().min(MAX_CAPACITY.saturating_sub(highest));
        if depth == 0 {
            return;
        }
        let depth_ut = depth * MICRO;
        let plan = raised(b.plan.clone(), depth_ut);
        self.buckets[idx] = self.buckets[idx].clone().with_over_account(plan, depth_ut);
    }

    /// Records the `replaces` of the node being built (the next in `nodes`), resolved once every
    /// bucket of the file is known.
    fn pending_replaces(&mut self, path: &str, names: Vec<String>, no_effect: Option<&'static str>) {
        if !names.is_empty() {
            self.replaces.push(PendingReplaces {
                node: self.nodes.len(),
                path: path.to_owned(),
                names,
                no_effect,
            });
        }
    }

    /// envoyproxy/ratelimit's `{unit, requests_per_unit}`: N per unit is a bucket of capacity N
    /// refilled N per unit; 0 denies everything.
    fn envoy_limit(&mut self, path: &str, unit: Option<&str>, rpu: Option<u64>) -> Option<(Limit, ReportedLimit)> {
        let Some(unit_text) = unit else {
            self.error(
                path,
                "`rate_limit` needs `unit` (second, minute, hour, day, week, month or year)",
            );
            return None;
        };
        let Some((unit, _, unit_us)) = ENVOY_UNITS
            .iter()
            .find(|(_, name, _)| name.eq_ignore_ascii_case(unit_text))
            .copied()
        else {
            self.error(
                path,
                format!("unknown unit `{unit_text}`: expected second, minute, hour, day, week, month or year"),
            );
            return None;
        };
        // envoyproxy/ratelimit reads a missing requests_per_unit as 0, which denies everything.
        let rpu = rpu.unwrap_or_else(|| {
            self.note(
                path,
                "`requests_per_unit` is missing: read as 0, which denies every request",
            );
            0
        });
        if rpu > MAX_CAPACITY {
            self.error(
                path,
                format!("requests_per_unit {rpu} is above the maximum of {MAX_CAPACITY}"),
            );
            return None;
        }
        let reported = ReportedLimit {
            requests_per_unit: u32::try_from(rpu).unwrap_or(u32::MAX),
            unit,
        };
        if rpu == 0 {
            return Some((Limit::new(0, Rate::ZERO), reported));
        }
        match Rate::per(rpu, unit_us) {
            Ok(rate) => Some((Limit::new(rpu, rate), reported)),
            Err(RateError::TooFine { .. }) => {
                let unit = unit.as_str_name().to_lowercase();
                self.error(
                    path,
                    format!(
                        "{rpu} per {unit} cannot be computed exactly on every backend; use a count that is a \
                         multiple of 1000, or a shorter unit"
                    ),
                );
                None
            }
            Err(e) => {
                self.error(path, e.to_string());
                None
            }
        }
    }

    /// Resolves every `replaces` to bucket indices: a name stands for every bucket that carries it
    /// (several, for an envoyproxy/ratelimit name given to different limits). A name no bucket
    /// carries is an error, on any rule.
    fn resolve_replaces(&mut self) {
        let pending = std::mem::take(&mut self.replaces);
        for p in &pending {
            let own: Vec<usize> = match &self.nodes[p.node].rule {
                Some(Rule::Limited { buckets, .. }) => buckets.clone(),
                _ => Vec::new(),
            };
            let mut resolved = Vec::new();
            let mut unknown = false;
            for name in &p.names {
                let named = self.buckets_named(name).to_vec();
                if named.is_empty() && self.rejected.contains(name) {
                    // The bucket's own error is reported already.
                    unknown = true;
                } else if named.is_empty() {
                    unknown = true;
                    let mut known: Vec<&str> = self.buckets.iter().map(|b| b.name.as_str()).collect();
                    known.sort_unstable();
                    known.dedup();
                    let reason = format!(
                        "`replaces` names unknown bucket `{name}`; buckets in this file: [{}]",
                        known.join(", ")
                    );
                    self.error(&p.path, reason);
                } else if own.iter().any(|own| self.buckets[*own].name == *name) {
                    self.error(&p.path, format!("`replaces` names the rule's own bucket `{name}`"));
                } else if let Some(owner) = named.iter().find_map(|&i| self.companion_of(i)) {
                    let reason = format!(
                        "`replaces` names `{name}`, the quota of bucket `{owner}`: a token bucket and its quota \
                         are replaced together, so name `{owner}`"
                    );
                    self.error(&p.path, reason);
                } else {
                    resolved.extend(named);
                }
            }
            if let Some(note) = p.no_effect {
                if !unknown {
                    self.note(&p.path, note);
                }
                continue;
            }
            resolved.sort_unstable();
            resolved.dedup();
            match &mut self.nodes[p.node].rule {
                Some(Rule::Limited { replaces, .. } | Rule::Unlimited { replaces }) => *replaces = resolved,
                None => {}
            }
        }
        // A cycle (a replaces b, b replaces a) would drop both: reject it.
        let mut edges: HashMap<usize, Vec<usize>> = HashMap::new();
        for node in &self.nodes {
            if let Some(Rule::Limited { buckets, replaces, .. }) = &node.rule {
                for bucket in buckets {
                    edges.entry(*bucket).or_default().extend(replaces);
                }
            }
        }
        for p in &pending {
            if let Some(Rule::Limited { buckets, .. }) = &self.nodes[p.node].rule {
                if let Some(cycle) = buckets.iter().find_map(|b| find_cycle(*b, &edges)) {
                    let names: Vec<&str> = cycle.iter().map(|b| self.buckets[*b].name.as_str()).collect();
                    let reason = format!("`replaces` forms a cycle: {}", names.join(" -> "));
                    self.error(&p.path.clone(), reason);
                    return;
                }
            }
        }
    }
}

/// A path from `start` back to itself through `edges`, if there is one.
fn find_cycle(start: usize, edges: &HashMap<usize, Vec<usize>>) -> Option<Vec<usize>> {
    let mut stack = vec![(start, vec![start])];
    let mut seen = HashSet::new();
    while let Some((at, path)) = stack.pop() {
        for &next in edges.get(&at).into_iter().flatten() {
            if next == start {
                let mut cycle = path.clone();
                cycle.push(start);
                return Some(cycle);
            }
            if seen.insert(next) {
                let mut longer = path.clone();
                longer.push(next);
                stack.push((next, longer));
            }
        }
    }
    None
}

/// `current_limit` for a policy's base limit; a quota's depends on its period and is worked out
/// per decision ([`BucketPolicy::reported_at`]).
/// How `plan`'s base limit is reported: a debt bucket's (floor `debt_ut` deep) as declared.
fn reported_base(plan: &Plan, debt_ut: u64) -> ReportedLimit {
    match plan {
        Plan::Quota(q) => ReportedLimit::quota(q.allowance_ut() / MICRO, None),
        // An allowance per the Envoy unit nearest its period, as a quota's.
        Plan::Expiring(e) => ReportedLimit::quota(e.limit().capacity(), Some(e.expires_us())),
        _ => ReportedLimit::of(&shown(plan.base(), debt_ut)),
    }
}

/// The highest capacity `plan` ever has, in tokens: a schedule window's may exceed the base's.
fn highest_capacity(plan: &Plan) -> u64 {
    match plan {
        Plan::Scheduled(s) => (0..s.entries().len())
            .filter_map(|i| s.entry_limit(i))
            .chain(std::iter::once(s.base()))
            .map(Limit::capacity)
            .max()
            .unwrap_or(0),
        other => other.base().capacity(),
    }
}

/// A token bucket's `plan` with its capacities raised by `depth_ut` micro-tokens: a debt
/// bucket's, whose stored tokens are the balance plus the floor's depth.
fn raised(plan: Plan, depth_ut: u64) -> Plan {
    match plan {
        Plan::Fixed(l) => Plan::Fixed(Limit {
            capacity_ut: l.capacity_ut + depth_ut,
            rate: l.rate,
        }),
        Plan::Scheduled(s) => Plan::Scheduled(Arc::new(Schedule::clone(&s).with_debt_depth(depth_ut))),
        other => other,
    }
}

/// Bucket names are shown in headers and metrics: non-empty printable ASCII, and not
/// `override`, the name under which Envoy's per-descriptor limit overrides are reported.
fn check_bucket_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a bucket name must not be empty".into());
    }
    if name == OVERRIDE_BUCKET {
        return Err(format!(
            "the bucket name `{OVERRIDE_BUCKET}` is reserved for Envoy's per-descriptor limit overrides"
        ));
    }
    if !name.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(format!(
            "bucket name `{}` must be printable ASCII",
            name.escape_default()
        ));
    }
    Ok(())
}

/// The path of the node `spec` under the node at `parent` (empty for the root): the parent's
/// path, a `.`, then `key`, or `key=value` when the node has a value (an empty value counts as
/// none). Rules are named by it when they have no `name`, and messages and `tollgate check`
/// show it.
pub(crate) fn node_path(parent: &str, spec: &DescriptorSpec) -> String {
    let step = match spec.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!("{}={v}", spec.key),
        None => spec.key.clone(),
    };
    if parent.is_empty() {
        step
    } else {
        format!("{parent}.{step}")
    }
}
