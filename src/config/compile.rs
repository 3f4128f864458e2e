//! Validation and compilation of parsed rules files into a [`RuleSet`].

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use super::model::{BucketSpec, DescriptorSpec, RulesFile};
use super::{parse_refill, ConfigError};
use crate::bucket::{Limit, Rate, RateError, MAX_CAPACITY};
use crate::limiter::OVERRIDE_BUCKET;
use crate::rules::{BucketPolicy, Domain, Level, Node, Pattern, ReportedLimit, Rule, RuleSet, UNITS};

const DAY_US: u64 = 86_400_000_000;

/// The longest time a bucket may take to fill from empty: 10 years of 365 days. Slower buckets
/// are almost certainly a mistake (`capacity: 1000000000, refill: 1/d`), and every wait and
/// reset time then stays far from saturating.
const MAX_FILL_US: u64 = 10 * 365 * DAY_US;

/// Compiles parsed files into one rule set, or every problem found.
pub(super) fn compile(files: Vec<(PathBuf, RulesFile)>) -> Result<RuleSet, Vec<ConfigError>> {
    let mut errors = Vec::new();
    let mut set = RuleSet::default();
    for (path, file) in files {
        set.files.push(path.clone());
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
            match self.token_bucket(&rule, &spec) {
                Some(limit) => {
                    self.add_policy(&rule, name, limit);
                }
                None => {
                    self.rejected.insert(name);
                }
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
        })
    }

    fn token_bucket(&mut self, rule: &str, spec: &BucketSpec) -> Option<Limit> {
        if spec.capacity == 0 {
            self.error(rule, "capacity must be at least 1 token");
            return None;
        }
        if spec.capacity > MAX_CAPACITY {
            self.error(
                rule,
                format!(
                    "capacity {} is above the maximum of {MAX_CAPACITY} tokens",
                    spec.capacity
                ),
            );
            return None;
        }
        let refill = match parse_refill(&spec.refill) {
            Ok(r) => r,
            Err(reason) => {
                self.error(rule, reason);
                return None;
            }
        };
        let rate = match Rate::per(refill.tokens, refill.period_us) {
            Ok(rate) => rate,
            Err(RateError::TooFine { .. }) => {
                self.error(
                    rule,
                    format!(
                        "refill `{}` cannot be computed exactly on every backend; use a token count that is a \
                         multiple of 1000 with a period in whole minutes, hours or days, or a shorter period",
                        spec.refill
                    ),
                );
                return None;
            }
            Err(e) => {
                self.error(rule, format!("refill `{}`: {e}", spec.refill));
                return None;
            }
        };
        let limit = Limit::new(spec.capacity, rate);
        // Exact, without the saturation of `time_to_fill_us`: capacity * den / num, rounded up.
        let fill_us = (u128::from(limit.capacity_ut) * u128::from(rate.den())).div_ceil(u128::from(rate.num()));
        if fill_us > u128::from(MAX_FILL_US) {
            let days = fill_us.div_ceil(u128::from(DAY_US));
            self.error(
                rule,
                format!(
                    "capacity {} at refill `{}` takes {days} days (about {} years) to fill from empty, more than \
                     the maximum of 10 years ({} days); raise the refill or lower the capacity",
                    spec.capacity,
                    spec.refill,
                    days / 365,
                    MAX_FILL_US / DAY_US
                ),
            );
            return None;
        }
        Some(limit)
    }

    /// Registers a tollgate-schema policy under `name`; a second declaration of the same name
    /// must be identical (then both rules share the bucket).
    fn add_policy(&mut self, rule: &str, name: String, limit: Limit) -> Option<usize> {
        let reported = ReportedLimit::of(&limit);
        if let Some(&idx) = self.by_name.get(&name) {
            let existing = &self.buckets[idx];
            if existing.limit == limit && existing.reported == reported {
                return Some(idx);
            }
            self.error(
                rule,
                format!("bucket `{name}` is already declared with a different limit"),
            );
            return None;
        }
        self.buckets.push(BucketPolicy {
            name: name.clone(),
            limit,
            reported,
        });
        self.by_name.insert(name, self.buckets.len() - 1);
        Some(self.buckets.len() - 1)
    }

    /// Registers an envoyproxy/ratelimit limit named `name`. There a `rate_limit.name` is a label
    /// (what `replaces` refers to), not an identity: a policy with the same name and the same
    /// limit is shared, and a different limit gets a policy of its own under the same name. Two
    /// such policies never share an instance: an instance key holds the request's entries, and
    /// one list of entries reaches one node.
    fn add_label(&mut self, name: String, limit: Limit, reported: ReportedLimit) -> usize {
        if let Some(idx) = self
            .buckets
            .iter()
            .position(|b| b.name == name && b.limit == limit && b.reported == reported)
        {
            return idx;
        }
        self.buckets.push(BucketPolicy { name, limit, reported });
        self.buckets.len() - 1
    }

    fn node(&mut self, spec: &DescriptorSpec, parent: &str, parent_id: Option<usize>, level: &mut Level) {
        let value = spec.value.as_deref().filter(|v| !v.is_empty());
        let step = match value {
            Some(v) => format!("{}={v}", spec.key),
            None => spec.key.clone(),
        };
        let path = if parent.is_empty() {
            step
        } else {
            format!("{parent}.{step}")
        };
        for field in spec.ignored_fields() {
            self.note(
                &path,
                format!("`{field}` is accepted for envoyproxy/ratelimit compatibility and has no effect"),
            );
        }
        if spec.key.is_empty() {
            self.error(&path, "`key` must not be empty");
            return;
        }
        let rule = self.rule(spec, &path);
        let id = self.nodes.len();
        let duplicate = match value {
            None => level.any.insert(spec.key.clone(), id).is_some(),
            Some(v) => match Pattern::parse(v) {
                Some(pattern) => {
                    let dup = level.wildcard.iter().any(|(k, p, _)| *k == spec.key && *p == pattern);
                    level.wildcard.push((spec.key.clone(), pattern, id));
                    dup
                }
                None => level
                    .exact
                    .entry(spec.key.clone())
                    .or_default()
                    .insert(v.to_owned(), id)
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
        });
        let mut children = Level::default();
        for child in &spec.descriptors {
            self.node(child, &path, Some(id), &mut children);
        }
        self.nodes[id].children = children;
    }

    /// The node's rule; errors are recorded and give `None`.
    fn rule(&mut self, spec: &DescriptorSpec, path: &str) -> Option<Rule> {
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
        let sources = [spec.bucket.is_some(), spec.token_bucket.is_some(), rl_limit.is_some()];
        let count = sources.iter().filter(|s| **s).count();
        if count > 1 {
            self.error(
                path,
                "a rule gives its limit once: use one of `bucket`, `token_bucket`, `rate_limit`",
            );
            return None;
        }
        let replaces: Vec<String> = match (&spec.replaces, rl.and_then(|r| r.replaces.as_ref())) {
            (Some(_), Some(_)) => {
                self.error(
                    path,
                    "`replaces` is given twice (on the descriptor and in `rate_limit`)",
                );
                return None;
            }
            (Some(r), None) | (None, Some(r)) => r.iter().map(|r| r.name.clone()).collect(),
            (None, None) => Vec::new(),
        };
        if unlimited {
            if count > 0 {
                self.error(path, "`unlimited: true` cannot be combined with a limit");
                return None;
            }
            self.pending_replaces(path, replaces, Some("`replaces` has no effect on an unlimited rule"));
            return Some(Rule::Unlimited);
        }
        if spec.name.is_some() && (spec.bucket.is_some() || rl.is_some()) {
            let why = if spec.bucket.is_some() {
                "`name` names an inline limit; this rule references a bucket, whose name is used"
            } else {
                "`name` goes inside `rate_limit` in the envoyproxy/ratelimit schema"
            };
            self.error(path, why);
            return None;
        }
        let bucket = if let Some(name) = &spec.bucket {
            match self.by_name.get(name) {
                Some(&idx) => idx,
                // The bucket's own error is reported; an "unknown bucket" here would only add noise.
                None if self.rejected.contains(name) => return None,
                None => {
                    let mut known: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
                    known.sort_unstable();
                    self.error(
                        path,
                        format!("unknown bucket `{name}`; declared buckets: [{}]", known.join(", ")),
                    );
                    return None;
                }
            }
        } else if let Some(tb) = &spec.token_bucket {
            let name = spec.name.clone().unwrap_or_else(|| path.to_owned());
            if let Err(reason) = check_bucket_name(&name) {
                self.error(path, format!("{reason}; give the rule a `name`"));
                return None;
            }
            let limit = self.token_bucket(path, tb)?;
            self.add_policy(path, name, limit)?
        } else if let Some(rl) = rl_limit {
            let name = rl.name.clone().unwrap_or_else(|| path.to_owned());
            if let Err(reason) = check_bucket_name(&name) {
                self.error(path, format!("{reason}; give the rate_limit a `name`"));
                return None;
            }
            let (limit, reported) = self.envoy_limit(path, rl.unit.as_deref(), rl.requests_per_unit)?;
            self.add_label(name, limit, reported)
        } else {
            if spec.shadow_mode {
                self.note(path, "`shadow_mode` has no effect on a rule without a limit");
            }
            self.pending_replaces(
                path,
                replaces,
                Some("`replaces` has no effect on a rule without a limit"),
            );
            return None;
        };
        self.pending_replaces(path, replaces, None);
        Some(Rule::Limited {
            bucket,
            shadow: spec.shadow_mode,
            replaces: Vec::new(),
        })
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
        let Some((unit, unit_us)) = UNITS
            .iter()
            .find(|(u, _)| u.as_str_name().eq_ignore_ascii_case(unit_text))
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
            let own = match &self.nodes[p.node].rule {
                Some(Rule::Limited { bucket, .. }) => Some(*bucket),
                _ => None,
            };
            let mut resolved = Vec::new();
            let mut unknown = false;
            for name in &p.names {
                let named: Vec<usize> = (0..self.buckets.len())
                    .filter(|&i| self.buckets[i].name == *name)
                    .collect();
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
                } else if own.is_some_and(|own| self.buckets[own].name == *name) {
                    self.error(&p.path, format!("`replaces` names the rule's own bucket `{name}`"));
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
            if let Some(Rule::Limited { replaces, .. }) = &mut self.nodes[p.node].rule {
                *replaces = resolved;
            }
        }
        // A cycle (a replaces b, b replaces a) would drop both: reject it.
        let mut edges: HashMap<usize, Vec<usize>> = HashMap::new();
        for node in &self.nodes {
            if let Some(Rule::Limited { bucket, replaces, .. }) = &node.rule {
                edges.entry(*bucket).or_default().extend(replaces);
            }
        }
        for p in &pending {
            if let Some(Rule::Limited { bucket, .. }) = &self.nodes[p.node].rule {
                if let Some(cycle) = find_cycle(*bucket, &edges) {
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
