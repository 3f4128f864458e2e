//! Validation and compilation of parsed rules files into a [`RuleSet`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::model::{BucketSpec, DescriptorSpec, RulesFile};
use super::{parse_refill, ConfigError};
use crate::bucket::{Limit, Rate, MAX_CAPACITY};
use crate::rules::{BucketPolicy, Domain, Level, Node, Pattern, ReportedLimit, Rule, RuleSet, UNITS};

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
}

struct DomainBuilder<'a> {
    file: &'a Path,
    buckets: Vec<BucketPolicy>,
    by_name: HashMap<String, usize>,
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
                continue;
            }
            if let Some(limit) = self.token_bucket(&rule, &spec) {
                self.add_policy(&rule, name, limit, None);
            }
        }
        let mut root = Level::default();
        for spec in descriptors {
            self.node(spec, "", &mut root);
        }
        self.nodes.push(Node {
            path: String::new(),
            children: root,
            rule: None,
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
        match Rate::per(refill.tokens, refill.period_us) {
            Ok(rate) => Some(Limit::new(spec.capacity, rate)),
            Err(e) => {
                self.error(rule, format!("refill `{}`: {e}", spec.refill));
                None
            }
        }
    }

    /// Registers a policy under `name`; a second declaration of the same name must be
    /// identical (then both rules share the bucket).
    fn add_policy(&mut self, rule: &str, name: String, limit: Limit, reported: Option<ReportedLimit>) -> Option<usize> {
        let reported = reported.unwrap_or_else(|| ReportedLimit::of(&limit));
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

    fn node(&mut self, spec: &DescriptorSpec, parent: &str, level: &mut Level) {
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
        self.nodes.push(Node {
            path: path.clone(),
            children: Level::default(),
            rule,
        });
        let mut children = Level::default();
        for child in &spec.descriptors {
            self.node(child, &path, &mut children);
        }
        self.nodes[id].children = children;
    }

    /// The node's rule; errors are recorded and give `None`.
    fn rule(&mut self, spec: &DescriptorSpec, path: &str) -> Option<Rule> {
        let rl = spec.rate_limit.as_ref();
        let unlimited = spec.unlimited || rl.is_some_and(|r| r.unlimited);
        // envoyproxy/ratelimit rejects a unit on an unlimited rate_limit but ignores a count.
        if let Some(r) = rl.filter(|r| r.unlimited) {
            if r.unit.is_some() {
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
            if !replaces.is_empty() {
                self.note(path, "`replaces` has no effect on an unlimited rule");
            }
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
            self.add_policy(path, name, limit, None)?
        } else if let Some(rl) = rl_limit {
            let name = rl.name.clone().unwrap_or_else(|| path.to_owned());
            if let Err(reason) = check_bucket_name(&name) {
                self.error(path, format!("{reason}; give the rate_limit a `name`"));
                return None;
            }
            let (limit, reported) = self.envoy_limit(path, rl.unit.as_deref(), rl.requests_per_unit)?;
            self.add_policy(path, name, limit, Some(reported))?
        } else {
            if spec.shadow_mode {
                self.note(path, "`shadow_mode` has no effect on a rule without a limit");
            }
            if !replaces.is_empty() {
                self.note(path, "`replaces` has no effect on a rule without a limit");
            }
            return None;
        };
        if !replaces.is_empty() {
            self.replaces.push(PendingReplaces {
                node: self.nodes.len(),
                path: path.to_owned(),
                names: replaces,
            });
        }
        Some(Rule::Limited {
            bucket,
            shadow: spec.shadow_mode,
            replaces: Vec::new(),
        })
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
            Err(e) => {
                self.error(path, e.to_string());
                None
            }
        }
    }

    fn resolve_replaces(&mut self) {
        let pending = std::mem::take(&mut self.replaces);
        for p in &pending {
            let Some(Rule::Limited { bucket: own, .. }) = self.nodes[p.node].rule.clone() else {
                continue;
            };
            let mut resolved = Vec::new();
            for name in &p.names {
                match self.by_name.get(name) {
                    Some(&idx) if idx == own => {
                        self.error(&p.path, format!("`replaces` names the rule's own bucket `{name}`"))
                    }
                    Some(&idx) => resolved.push(idx),
                    None => self.error(&p.path, format!("`replaces` names unknown bucket `{name}`")),
                }
            }
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
    let mut seen = std::collections::HashSet::new();
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

/// Bucket names are shown in headers and metrics: non-empty printable ASCII.
fn check_bucket_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a bucket name must not be empty".into());
    }
    if !name.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(format!(
            "bucket name `{}` must be printable ASCII",
            name.escape_default()
        ));
    }
    Ok(())
}
