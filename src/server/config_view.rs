//! The JSON behind `/config`: the rules in force (as compiled, not the files' text), which load
//! they are and which files they came from, and the effective settings with secrets redacted.
//!
//! The shape, with every field (keys of JSON objects come out sorted; arrays keep the order
//! given here):
//!
//! ```json
//! {
//!   "generation": 3,
//!   "files": ["config/rules/edge.yaml"],
//!   "domains": {
//!     "edge": {
//!       "file": "config/rules/edge.yaml",
//!       "buckets": [
//!         {
//!           "name": "per_key", "kind": "token_bucket",
//!           "capacity": 100,
//!           "refill": {"tokens": 10, "period_seconds": 1, "text": "10/s"},
//!           "reported_limit": {"requests_per_unit": 10, "unit": "second"},
//!           "schedule": [
//!             {
//!               "cron": "* 9-17 * * MON-FRI", "timezone": "America/New_York",
//!               "effect": {"scale": 0.5},
//!               "capacity": 50,
//!               "refill": {"tokens": 5, "period_seconds": 1, "text": "5/s"},
//!               "reported_limit": {"requests_per_unit": 5, "unit": "second"}
//!             }
//!           ]
//!         },
//!         {
//!           "name": "per_key.quota", "kind": "quota",
//!           "quota": {"limit": 10000, "reset": "0 0 1 * *", "timezone": "Europe/Berlin"}
//!         }
//!       ],
//!       "rules": [
//!         {
//!           "path": "api_key",
//!           "descriptor": [{"key": "api_key", "value": null}],
//!           "buckets": ["per_key", "per_key.quota"], "bucket_indices": [0, 1],
//!           "bucket": "per_key", "bucket_index": 0,
//!           "quota": "per_key.quota", "quota_index": 1,
//!           "unlimited": false, "shadow_mode": false, "share_threshold": false,
//!           "replaces": []
//!         }
//!       ],
//!       "notes": [{"path": "api_key", "note": "..."}]
//!     }
//!   },
//!   "settings": {"admin": {"token": "<redacted>", "...": "..."}, "...": "..."}
//! }
//! ```
//!
//! Units: capacities and quota limits are tokens (a fraction only where a schedule's `scale`
//! leaves one); a refill is `tokens` every `period_seconds`; Envoy's `unit` is lowercase as in
//! the rules files (`second` ... `year`).

use serde::Serialize;
use serde_json::{Number, Value};

use crate::core::bucket::{Limit, Rate, MICRO};
use crate::core::schedule::{Effect, Plan, Quota, Schedule};
use crate::core::units::{gcd, DURATION_SUFFIXES, SECOND_US};
use crate::rules::{BucketPolicy, Domain, Level, LevelValue, ReportedLimit, Rule, RuleSet};
use crate::server::settings::Settings;

/// What a secret setting (`admin.token`) is shown as when it is set; an unset one is `null`.
pub(crate) const REDACTED: &str = "<redacted>";

/// The `/config` document for `rules` loaded under `settings` (see the module documentation
/// for an example):
///
/// - `generation`: [`RuleSet::generation`] (1 for the rules read at start, one more per reload
///   that took effect; 0 when not loaded by a server);
/// - `files`: the rules files, in load order (paths as given, lossily converted to UTF-8);
/// - `domains`: by name, each with its `file`, its `buckets` (the compiled bucket policies, in
///   the order rules refer to them by `bucket_index`), its `rules` (one per descriptor-tree
///   node, in tree order: depth first, and at each level in matching order, exact values by
///   path, then wildcards by precedence, the longest literal prefix first and then config order,
///   then key-only nodes), and the `notes` that `tollgate check` prints;
/// - `settings`: the effective [`Settings`], with `admin.token` shown as [`REDACTED`] when set.
///
/// A bucket is `{"name", "kind": "token_bucket", "capacity", "refill", "reported_limit",
/// "schedule"?, "expires_seconds"?}` or `{"name", "kind": "quota", "quota": {"limit", "reset", "timezone"}}`. A
/// policy with a token bucket and a quota is two buckets, the quota named `<name>.quota`, as
/// the rules and responses name it. Either may carry `"hidden": true` and, for a debt bucket,
/// `"debt_floor"` (tokens, at most 0), its capacity shown as declared. `capacity` is in tokens; `refill` is `null` for a bucket
/// that never refills (a fixed allowance, or envoyproxy/ratelimit's `requests_per_unit: 0`), else `{"tokens",
/// "period_seconds", "text"}`, the exact rate in force as a whole number of tokens per the
/// first of a second, minute, hour or day in which it is whole (a `1/250ms` refill is shown as
/// `4/s`), else per the shortest period in which it is, with `text` in the rules' refill syntax
/// (`<tokens>/<duration>`; a period finer than a millisecond, which only a `scale` can give, is
/// written in `us`). `reported_limit` is the `current_limit` Envoy is told while the base limit
/// is in force. A quota has none here: it is reported per the Envoy unit nearest its current
/// period, which depends on the date.
///
/// A schedule window is `{"cron", "timezone", "effect", "capacity", "refill",
/// "reported_limit"}`: `effect` as declared (`{"scale": 0.5}`, or `{"capacity": 0}` and/or
/// `{"refill": ...}`) and the rest the limit in force while the window is active (the first
/// active window wins, else the base applies).
///
/// A rule is `{"path", "descriptor", "buckets", "bucket_indices", "bucket", "bucket_index",
/// "quota", "quota_index", "unlimited", "shadow_mode", "share_threshold", "replaces"}`.
/// `buckets` names every policy the rule decides by (all or nothing, in the rule's order);
/// `bucket` and `quota` are the first of them and the quota beside it, as before lists. `descriptor` lists the entries
/// that lead to the node from the root, each `{"key", "value"}` with `value` the exact value, a
/// pattern with `*`, or `null` for a key-only node (any value). `bucket` and `quota` name the
/// policies a request ending on the node takes tokens from (`null`: none; with `unlimited`
/// false as well the node has no limit of its own); `*_index` is the policy's position in
/// `buckets`, which tells apart envoyproxy/ratelimit limits that share a name. `replaces` lists
/// bucket names, each once.
pub(crate) fn config_json(rules: &RuleSet, settings: &Settings) -> Value {
    let mut names: Vec<&String> = rules.domains.keys().collect();
    names.sort();
    let domains: serde_json::Map<String, Value> = names
        .into_iter()
        .map(|name| (name.clone(), to_value(&domain_view(&rules.domains[name]))))
        .collect();
    let files: Vec<String> = rules.files.iter().map(|f| f.to_string_lossy().into_owned()).collect();
    serde_json::json!({
        "generation": rules.generation,
        "files": files,
        "domains": domains,
        "settings": settings_json(settings),
    })
}

/// `settings` as JSON with secrets redacted before serializing, so they never reach the value.
fn settings_json(settings: &Settings) -> Value {
    let mut shown = settings.clone();
    if shown.admin.token.is_some() {
        shown.admin.token = Some(REDACTED.to_owned());
    }
    if shown.redis.password.is_some() {
        shown.redis.password = Some(REDACTED.to_owned());
    }
    if shown.redis.sentinel.password.is_some() {
        shown.redis.sentinel.password = Some(REDACTED.to_owned());
    }
    shown.redis.urls = shown
        .redis
        .urls
        .iter()
        .map(|u| crate::server::settings::redact_url(u))
        .collect();
    shown.postgres.url = crate::server::settings::redact_url(&shown.postgres.url);
    if shown.postgres.password.is_some() {
        shown.postgres.password = Some(REDACTED.to_owned());
    }
    for value in shown.xds.headers.values_mut() {
        *value = REDACTED.to_owned();
    }
    // A path that is not UTF-8 would fail to serialize: show it lossily instead.
    shown.rules = shown.rules.to_string_lossy().into_owned().into();
    to_value(&shown)
}

/// Serializes a view; the views hold only strings, numbers and booleans, so this cannot fail,
/// but an error is shown rather than panicking.
fn to_value<T: Serialize>(view: &T) -> Value {
    serde_json::to_value(view).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }))
}

/// One domain.
#[derive(Serialize)]
struct DomainView<'a> {
    /// The file that declared it.
    file: String,
    /// Its bucket policies, in [`Domain::buckets`] order.
    buckets: Vec<BucketView<'a>>,
    /// Its descriptor-tree nodes, in tree order.
    rules: Vec<RuleView<'a>>,
    /// What `tollgate check` notes.
    notes: Vec<NoteView<'a>>,
}

/// One bucket policy.
#[derive(Serialize)]
struct BucketView<'a> {
    /// The policy's name.
    name: &'a str,
    /// A token bucket or a quota.
    #[serde(flatten)]
    kind: KindView<'a>,
    /// `hidden: true`: kept out of the limits clients see; absent otherwise.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    hidden: bool,
    /// A debt bucket's floor, in tokens (at most 0; docs/usage-budgets.md); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    debt_floor: Option<i64>,
    /// `lease`: tokens a replica reserves from the shared store at a time (docs/backends.md);
    /// absent when none.
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<u64>,
}

/// What a bucket policy is.
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum KindView<'a> {
    /// A token bucket, constant or scheduled.
    TokenBucket {
        /// The base limit.
        #[serde(flatten)]
        limit: LimitView,
        /// `current_limit` for the base limit.
        reported_limit: ReportedView,
        /// The schedule windows, in order of precedence; absent for a constant limit.
        #[serde(skip_serializing_if = "Option::is_none")]
        schedule: Option<Vec<WindowView<'a>>>,
        /// A fixed allowance's `expires`, in seconds: whole again this long after its first
        /// use. Absent for any other bucket.
        #[serde(skip_serializing_if = "Option::is_none")]
        expires_seconds: Option<u64>,
    },
    /// A calendar quota.
    Quota {
        /// Its allowance and reset.
        quota: QuotaView<'a>,
    },
}

/// A capacity and refill.
#[derive(Serialize)]
struct LimitView {
    /// Tokens.
    capacity: Number,
    /// `null`: never refills.
    refill: Option<RefillView>,
}

/// A refill rate: `tokens` every `period_seconds`.
#[derive(Serialize)]
struct RefillView {
    /// Whole tokens added per period.
    tokens: u64,
    /// The period, in seconds.
    period_seconds: Number,
    /// The same in the rules' refill syntax, e.g. `10/s`, `1/12s`.
    text: String,
}

/// `current_limit` as Envoy is told it.
#[derive(Serialize)]
struct ReportedView {
    /// `requests_per_unit`.
    requests_per_unit: u32,
    /// `second`, `minute`, `hour`, `day`, `week`, `month` or `year`.
    unit: String,
}

/// One schedule window.
#[derive(Serialize)]
struct WindowView<'a> {
    /// The five-field cron pattern, trimmed.
    cron: &'a str,
    /// The IANA timezone it is read in.
    timezone: String,
    /// What the window does, as declared.
    effect: EffectView,
    /// The limit in force while the window is active.
    #[serde(flatten)]
    limit: LimitView,
    /// `current_limit` while the window is active.
    reported_limit: ReportedView,
}

/// A window's effect: `scale`, or `capacity` and/or `refill`.
#[derive(Serialize)]
struct EffectView {
    /// The factor applied to capacity and refill together (resolution one millionth).
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<Number>,
    /// The capacity set, in tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    capacity: Option<u64>,
    /// The refill set.
    #[serde(skip_serializing_if = "Option::is_none")]
    refill: Option<RefillView>,
}

/// A calendar quota.
#[derive(Serialize)]
struct QuotaView<'a> {
    /// Tokens per period.
    limit: u64,
    /// The five-field cron whose edges reset it, trimmed.
    reset: &'a str,
    /// The IANA timezone the cron is read in.
    timezone: String,
}

/// One node of the descriptor tree and what applies to a request ending on it.
#[derive(Serialize)]
struct RuleView<'a> {
    /// The node's path, as errors and notes name it (`api_key.path=/upload`).
    path: &'a str,
    /// The entries from the root to the node.
    descriptor: Vec<EntryView<'a>>,
    /// Every bucket the rule decides by (all or nothing), by name, in the rule's order.
    buckets: Vec<&'a str>,
    /// Their indices in the domain's `buckets`.
    bucket_indices: Vec<usize>,
    /// The rule's first bucket (a token bucket, or a lone quota) policy's name.
    bucket: Option<&'a str>,
    /// Its index in the domain's `buckets`.
    bucket_index: Option<usize>,
    /// The quota beside the first token bucket (`<name>.quota`), by name.
    quota: Option<&'a str>,
    /// Its index in the domain's `buckets`.
    quota_index: Option<usize>,
    /// Never limited.
    unlimited: bool,
    /// Evaluated and counted, never denies.
    shadow_mode: bool,
    /// Every value matching the wildcard shares one bucket.
    share_threshold: bool,
    /// Bucket names this rule replaces when both match one request.
    replaces: Vec<&'a str>,
}

/// One descriptor entry.
#[derive(Clone, Serialize)]
struct EntryView<'a> {
    /// The entry's key.
    key: &'a str,
    /// The exact value, a pattern with `*`, or `null` for any value.
    value: Option<String>,
}

/// A `tollgate check` note.
#[derive(Serialize)]
struct NoteView<'a> {
    /// The rule it is about.
    path: &'a str,
    /// What it says.
    note: &'a str,
}

fn domain_view(d: &Domain) -> DomainView<'_> {
    let mut rules = Vec::new();
    walk(d, &d.root, &mut Vec::new(), &mut rules);
    DomainView {
        file: d.file.to_string_lossy().into_owned(),
        buckets: d.buckets.iter().map(bucket_view).collect(),
        rules,
        notes: d.notes.iter().map(|(path, note)| NoteView { path, note }).collect(),
    }
}

/// Depth first, each level in the order `tollgate check` prints it, which is the matcher's
/// precedence: exact values (sorted by path), wildcards (the longest literal prefix first, then
/// config order), key-only nodes (sorted by path).
fn walk<'a>(d: &'a Domain, level: &'a Level, prefix: &mut Vec<EntryView<'a>>, out: &mut Vec<RuleView<'a>>) {
    for (key, value, id) in level.in_match_order(d) {
        let value = match value {
            LevelValue::Exact(v) => Some(v.to_owned()),
            LevelValue::Wildcard(p) => Some(p.text()),
            LevelValue::Any => None,
        };
        let node = &d.nodes[id];
        prefix.push(EntryView { key, value });
        let (buckets, shadow, replaces) = match &node.rule {
            Some(Rule::Limited {
                buckets,
                shadow,
                replaces,
                ..
            }) => (buckets.as_slice(), *shadow, replaces.as_slice()),
            Some(Rule::Unlimited { replaces }) => (&[][..], false, replaces.as_slice()),
            None => (&[][..], false, &[][..]),
        };
        let bucket = buckets.first().copied();
        let quota = buckets
            .get(1)
            .copied()
            .filter(|q| bucket.is_some_and(|b| d.buckets[*q].name == format!("{}.quota", d.buckets[b].name)));
        out.push(RuleView {
            path: &node.path,
            descriptor: prefix.clone(),
            buckets: buckets.iter().map(|b| d.buckets[*b].name.as_str()).collect(),
            bucket_indices: buckets.to_vec(),
            bucket: bucket.map(|b| d.buckets[b].name.as_str()),
            bucket_index: bucket,
            quota: quota.map(|q| d.buckets[q].name.as_str()),
            quota_index: quota,
            unlimited: matches!(node.rule, Some(Rule::Unlimited { .. })),
            shadow_mode: shadow,
            share_threshold: node.shared_pattern.is_some(),
            replaces: d.replaced_names(replaces),
        });
        walk(d, &node.children, prefix, out);
        prefix.pop();
    }
}

fn bucket_view(b: &BucketPolicy) -> BucketView<'_> {
    BucketView {
        name: &b.name,
        kind: kind_view(b, &b.plan),
        hidden: b.hidden,
        debt_floor: b
            .debt
            .then(|| -i64::try_from(b.debt_depth_ut / MICRO).unwrap_or(i64::MAX)),
        lease: (b.lease_ut > 0).then_some(b.lease_ut / MICRO),
    }
}

/// What `plan` of `b` is; a plan a reload built is shown as the rules in force compiled it.
fn kind_view<'a>(b: &'a BucketPolicy, plan: &'a Plan) -> KindView<'a> {
    match plan {
        Plan::Fixed(limit) => KindView::TokenBucket {
            limit: limit_view(&b.shown(*limit)),
            reported_limit: reported_view(b.reported),
            schedule: None,
            expires_seconds: None,
        },
        Plan::Expiring(e) => KindView::TokenBucket {
            limit: limit_view(&e.limit()),
            reported_limit: reported_view(b.reported),
            schedule: None,
            expires_seconds: Some(e.expires_us() / SECOND_US),
        },
        Plan::Scheduled(s) => KindView::TokenBucket {
            limit: limit_view(&b.shown(*s.base())),
            reported_limit: reported_view(b.reported),
            schedule: Some(windows(b, s)),
            expires_seconds: None,
        },
        Plan::Quota(q) => KindView::Quota { quota: quota_view(q) },
        Plan::Reloaded(r) => kind_view(b, r.after()),
    }
}

fn windows<'a>(b: &BucketPolicy, s: &'a Schedule) -> Vec<WindowView<'a>> {
    s.entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let limit = b.shown(s.entry_limit(i).copied().unwrap_or(*s.base()));
            let effect = match e.effect() {
                Effect::Scale { millionths } => EffectView {
                    scale: Some(fraction(millionths, MICRO)),
                    capacity: None,
                    refill: None,
                },
                Effect::Set { capacity, refill } => EffectView {
                    scale: None,
                    capacity,
                    refill: refill.and_then(refill_view),
                },
            };
            WindowView {
                cron: e.pattern(),
                timezone: e.timezone().name().to_owned(),
                effect,
                limit: limit_view(&limit),
                reported_limit: reported_view(ReportedLimit::of(&limit)),
            }
        })
        .collect()
}

fn quota_view(q: &Quota) -> QuotaView<'_> {
    QuotaView {
        limit: q.allowance_ut() / MICRO,
        reset: q.pattern(),
        timezone: q.timezone().name().to_owned(),
    }
}

fn limit_view(limit: &Limit) -> LimitView {
    LimitView {
        capacity: fraction(limit.capacity_ut, MICRO),
        refill: refill_view(limit.rate),
    }
}

fn reported_view(r: ReportedLimit) -> ReportedView {
    ReportedView {
        requests_per_unit: r.requests_per_unit,
        unit: r.unit.as_str_name().to_lowercase(),
    }
}

/// A rate as whole tokens per period: per second, minute, hour or day, the first in which the
/// count is whole; else the shortest period with a whole count. `None` for the zero rate.
fn refill_view(rate: Rate) -> Option<RefillView> {
    if rate.is_zero() {
        return None;
    }
    let preferred = DURATION_SUFFIXES[..4]
        .iter()
        .rev()
        .find_map(|(_, us)| rate.whole_tokens_per(*us).filter(|n| *n > 0).map(|n| (n, *us)));
    let (tokens, period_us) = preferred.unwrap_or_else(|| {
        // num micro-tokens per den µs = (num / g) tokens per (den * MICRO / g) µs, g = gcd(num, MICRO).
        let g = gcd(rate.num(), MICRO);
        let period = u128::from(rate.den()) * u128::from(MICRO / g);
        (rate.num() / g, u64::try_from(period).unwrap_or(u64::MAX))
    });
    Some(RefillView {
        tokens,
        period_seconds: fraction(period_us, MICRO),
        text: format!("{tokens}/{}", duration_text(period_us)),
    })
}

/// A duration in the rules' syntax: `s`, `12s`, `250ms`, `7d`; `us` below a millisecond.
fn duration_text(us: u64) -> String {
    match DURATION_SUFFIXES.iter().find(|(_, unit)| us.is_multiple_of(*unit)) {
        Some((suffix, unit)) if us == *unit => (*suffix).to_owned(),
        Some((suffix, unit)) => format!("{}{suffix}", us / unit),
        None => format!("{us}us"),
    }
}

/// `n / per` as a JSON number: an integer when whole, else the nearest double.
fn fraction(n: u64, per: u64) -> Number {
    if n.is_multiple_of(per) {
        Number::from(n / per)
    } else {
        Number::from_f64(n as f64 / per as f64).unwrap_or_else(|| Number::from(n / per))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::rules::file::load_rules;

    const SECRET: &str = "s3cr3t-admin-token-4f9a";

    /// Two files: `b.yaml` (domain `edge`: named buckets with a schedule and a quota, a
    /// wildcard, an envoyproxy `rate_limit`, `replaces`) and `a.yaml` (domain `alpha`).
    fn loaded() -> (tempfile::TempDir, RuleSet) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("b.yaml"),
            r#"
domain: edge
buckets:
  per_key:
    capacity: 100
    refill: 10/s
    schedule:
      - cron: "* 9-17 * * MON-FRI"
        timezone: America/New_York
        scale: 0.5
      - cron: " 0-29 3 * * SUN "
        capacity: 0
    quota: {limit: 10000, reset: "0 0 1 * *", timezone: Europe/Berlin}
  monthly:
    quota: {limit: 500, reset: "0 0 1 * *"}
descriptors:
  - key: api_key
    bucket: per_key
    descriptors:
      - key: path
        value: /upload
        name: uploads
        token_bucket: {capacity: 5, refill: 1/250ms}
        replaces: [{name: per_key}]
  - key: database
    value: users
    rate_limit: {unit: minute, requests_per_unit: 600, name: db}
  - key: database
    value: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: user
    value: vip_*
    share_threshold: true
    shadow_mode: true
    bucket: monthly
  - key: path
    value: /static/*
    unlimited: true
"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("a.yaml"),
            "domain: alpha\ndescriptors:\n  - key: k\n    token_bucket: {capacity: 7, refill: 1/7d}\n",
        )
        .unwrap();
        let mut rules = load_rules(dir.path()).unwrap_or_else(|e| panic!("rules should load: {e}"));
        rules.generation = 7;
        (dir, rules)
    }

    fn settings_with_token() -> Settings {
        let mut settings = Settings::default();
        settings.admin.token = Some(SECRET.to_owned());
        settings
    }

    #[test]
    fn generation_files_and_domains() {
        let (dir, rules) = loaded();
        let v = config_json(&rules, &Settings::default());
        assert_eq!(v["generation"], 7);
        let a = dir.path().join("a.yaml").to_string_lossy().into_owned();
        let b = dir.path().join("b.yaml").to_string_lossy().into_owned();
        assert_eq!(v["files"], json!([a, b]));
        let names: Vec<&String> = v["domains"].as_object().unwrap().keys().collect();
        assert_eq!(names, ["alpha", "edge"]);
        assert_eq!(v["domains"]["edge"]["file"], json!(b));
        assert_eq!(v["domains"]["alpha"]["file"], json!(a));
    }

    #[test]
    fn buckets_as_compiled() {
        let (_dir, rules) = loaded();
        let v = config_json(&rules, &Settings::default());
        let buckets = &v["domains"]["edge"]["buckets"];
        let by_name = |name: &str| {
            buckets
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["name"] == name)
                .unwrap_or_else(|| panic!("no bucket {name} in {buckets}"))
                .clone()
        };
        assert_eq!(
            by_name("per_key"),
            json!({
                "name": "per_key",
                "kind": "token_bucket",
                "capacity": 100,
                "refill": {"tokens": 10, "period_seconds": 1, "text": "10/s"},
                "reported_limit": {"requests_per_unit": 10, "unit": "second"},
                "schedule": [
                    {
                        "cron": "* 9-17 * * MON-FRI",
                        "timezone": "America/New_York",
                        "effect": {"scale": 0.5},
                        "capacity": 50,
                        "refill": {"tokens": 5, "period_seconds": 1, "text": "5/s"},
                        "reported_limit": {"requests_per_unit": 5, "unit": "second"},
                    },
                    {
                        "cron": "0-29 3 * * SUN",
                        "timezone": "UTC",
                        "effect": {"capacity": 0},
                        "capacity": 0,
                        "refill": {"tokens": 10, "period_seconds": 1, "text": "10/s"},
                        "reported_limit": {"requests_per_unit": 0, "unit": "second"},
                    },
                ],
            })
        );
        assert_eq!(
            by_name("per_key.quota"),
            json!({
                "name": "per_key.quota",
                "kind": "quota",
                "quota": {"limit": 10000, "reset": "0 0 1 * *", "timezone": "Europe/Berlin"},
            })
        );
        assert_eq!(
            by_name("monthly")["quota"],
            json!({"limit": 500, "reset": "0 0 1 * *", "timezone": "UTC"})
        );
        // 1/250ms is the same rate as 4/s.
        assert_eq!(
            by_name("uploads"),
            json!({
                "name": "uploads",
                "kind": "token_bucket",
                "capacity": 5,
                "refill": {"tokens": 4, "period_seconds": 1, "text": "4/s"},
                "reported_limit": {"requests_per_unit": 4, "unit": "second"},
            })
        );
        // envoyproxy's 600 per minute: a bucket of 600 refilled 10 a second, reported as given.
        assert_eq!(
            by_name("db"),
            json!({
                "name": "db",
                "kind": "token_bucket",
                "capacity": 600,
                "refill": {"tokens": 10, "period_seconds": 1, "text": "10/s"},
                "reported_limit": {"requests_per_unit": 600, "unit": "minute"},
            })
        );
        // requests_per_unit: 0 never refills.
        let blocked = by_name("database=blocked");
        assert_eq!(blocked["capacity"], 0);
        assert_eq!(blocked["refill"], Value::Null);
        assert_eq!(
            blocked["reported_limit"],
            json!({"requests_per_unit": 0, "unit": "second"})
        );
        // Not whole per second, minute, hour or day: per the shortest whole period.
        let slow = &v["domains"]["alpha"]["buckets"][0];
        assert_eq!(
            slow["refill"],
            json!({"tokens": 1, "period_seconds": 604_800, "text": "1/7d"})
        );
        assert_eq!(slow["reported_limit"], json!({"requests_per_unit": 1, "unit": "week"}));
    }

    /// A fixed allowance has no refill; an expiring one says when it is whole again, and is
    /// reported per the Envoy unit nearest that period.
    #[test]
    fn allowances_show_their_expiry() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("t.yaml"),
            "domain: t\nbuckets:\n  trial: {capacity: 3}\n  daily: {capacity: 5, expires: 1d}\n\
             descriptors:\n  - {key: a, bucket: trial}\n  - {key: b, bucket: daily}\n",
        )
        .unwrap();
        let rules = load_rules(dir.path()).unwrap_or_else(|e| panic!("rules should load: {e}"));
        let v = config_json(&rules, &Settings::default());
        assert_eq!(
            v["domains"]["t"]["buckets"],
            json!([
                {
                    "name": "daily",
                    "kind": "token_bucket",
                    "capacity": 5,
                    "refill": null,
                    "reported_limit": {"requests_per_unit": 5, "unit": "day"},
                    "expires_seconds": 86400,
                },
                {
                    "name": "trial",
                    "kind": "token_bucket",
                    "capacity": 3,
                    "refill": null,
                    "reported_limit": {"requests_per_unit": 3, "unit": "year"},
                },
            ])
        );
    }

    #[test]
    fn rules_in_tree_order() {
        let (_dir, rules) = loaded();
        let v = config_json(&rules, &Settings::default());
        let edge = &v["domains"]["edge"];
        let index = |name: &str| {
            edge["buckets"]
                .as_array()
                .unwrap()
                .iter()
                .position(|b| b["name"] == name)
                .unwrap()
        };
        let rule = |path: &str, entries: Value, bucket: Option<&str>, quota: Option<&str>| {
            let buckets: Vec<&str> = bucket.into_iter().chain(quota).collect();
            json!({
                "path": path,
                "descriptor": entries,
                "buckets": buckets,
                "bucket_indices": buckets.iter().map(|b| index(b)).collect::<Vec<_>>(),
                "bucket": bucket,
                "bucket_index": bucket.map(index),
                "quota": quota,
                "quota_index": quota.map(index),
                "unlimited": false,
                "shadow_mode": false,
                "share_threshold": false,
                "replaces": [],
            })
        };
        let mut upload = rule(
            "api_key.path=/upload",
            json!([{"key": "api_key", "value": null}, {"key": "path", "value": "/upload"}]),
            Some("uploads"),
            None,
        );
        upload["replaces"] = json!(["per_key"]);
        let mut vip = rule(
            "user=vip_*",
            json!([{"key": "user", "value": "vip_*"}]),
            Some("monthly"),
            None,
        );
        vip["shadow_mode"] = json!(true);
        vip["share_threshold"] = json!(true);
        let mut statics = rule(
            "path=/static/*",
            json!([{"key": "path", "value": "/static/*"}]),
            None,
            None,
        );
        statics["unlimited"] = json!(true);
        // Exact values by path, wildcards by precedence (`/static/*`, the longer literal prefix,
        // before `vip_*`, listed first), key-only last; children after their parent.
        let expected = json!([
            rule(
                "database=blocked",
                json!([{"key": "database", "value": "blocked"}]),
                Some("database=blocked"),
                None
            ),
            rule(
                "database=users",
                json!([{"key": "database", "value": "users"}]),
                Some("db"),
                None
            ),
            statics,
            vip,
            rule(
                "api_key",
                json!([{"key": "api_key", "value": null}]),
                Some("per_key"),
                Some("per_key.quota")
            ),
            upload,
        ]);
        assert_eq!(edge["rules"], expected, "{:#}", edge["rules"]);
        assert_eq!(edge["notes"], json!([]));
    }

    /// Debt buckets (docs/usage-budgets.md) show their floor (`debt_floor`, tokens, at most 0) and
    /// their limits as declared, never raised by the floor's depth as the stores hold them: a
    /// constant bucket (floor at minus its capacity by default), a scheduled one (each window's
    /// capacity as declared), a quota (its allowance), a token bucket and quota under one
    /// `debt: true` (each its own default floor), and `debt_floor: 0`, a floor at zero, which is
    /// still a debt bucket. An ordinary bucket has no `debt_floor`.
    #[test]
    fn debt_buckets_show_their_floor_and_their_limits_as_declared() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("llm.yaml"),
            r#"
domain: llm
buckets:
  tokens: {capacity: 1000, refill: 1000/1m, debt: true}
  peak:
    capacity: 1000
    refill: 1000/1m
    debt: true
    debt_floor: -300
    schedule:
      - {cron: "* 9-17 * * *", capacity: 200}
      - {cron: "* 0-5 * * *", scale: 2}
  month:
    quota: {limit: 5000, reset: "0 0 1 * *"}
    debt: true
    debt_floor: -1000
  both: {capacity: 10, refill: 10/1m, quota: {limit: 100, reset: "0 0 * * *"}, debt: true}
  level: {capacity: 50, refill: 50/1m, debt: true, debt_floor: 0}
  plain: {capacity: 50, refill: 50/1m}
descriptors:
  - {key: a, bucket: tokens}
  - {key: b, bucket: peak}
  - {key: c, bucket: month}
  - {key: d, bucket: both}
  - {key: e, bucket: level}
  - {key: f, bucket: plain}
"#,
        )
        .unwrap();
        let rules = load_rules(dir.path()).unwrap_or_else(|e| panic!("rules should load: {e}"));
        let v = config_json(&rules, &Settings::default());
        let buckets = v["domains"]["llm"]["buckets"].as_array().unwrap().clone();
        let by_name = |name: &str| {
            buckets
                .iter()
                .find(|b| b["name"] == name)
                .unwrap_or_else(|| panic!("no bucket {name} in {buckets:?}"))
                .clone()
        };
        let per_minute = |n: u64| json!({"tokens": n, "period_seconds": 60, "text": format!("{n}/m")});
        assert_eq!(
            by_name("tokens"),
            json!({
                "name": "tokens",
                "kind": "token_bucket",
                "capacity": 1000,
                "refill": per_minute(1000),
                "reported_limit": {"requests_per_unit": 1000, "unit": "minute"},
                "debt_floor": -1000,
            })
        );
        let peak = by_name("peak");
        assert_eq!(peak["capacity"], 1000);
        assert_eq!(peak["debt_floor"], -300);
        assert_eq!(peak["schedule"][0]["capacity"], 200);
        // 200 fill in 12 s, not one of Envoy's units: reported by the refill, 1000 a minute.
        assert_eq!(
            peak["schedule"][0]["reported_limit"],
            json!({"requests_per_unit": 1000, "unit": "minute"})
        );
        assert_eq!(peak["schedule"][1]["capacity"], 2000, "twice the declared 1000");
        assert_eq!(peak["schedule"][1]["refill"], per_minute(2000));
        assert_eq!(
            by_name("month"),
            json!({
                "name": "month",
                "kind": "quota",
                "quota": {"limit": 5000, "reset": "0 0 1 * *", "timezone": "UTC"},
                "debt_floor": -1000,
            })
        );
        assert_eq!(by_name("both")["capacity"], 10);
        assert_eq!(by_name("both")["debt_floor"], -10);
        assert_eq!(by_name("both.quota")["quota"]["limit"], 100);
        assert_eq!(by_name("both.quota")["debt_floor"], -100);
        assert_eq!(by_name("level")["capacity"], 50);
        assert_eq!(
            by_name("level")["debt_floor"],
            0,
            "a floor at 0 is still a debt bucket's"
        );
        assert!(by_name("plain").get("debt_floor").is_none(), "{}", by_name("plain"));
    }

    #[test]
    fn settings_are_shown_with_the_token_redacted() {
        let (_dir, rules) = loaded();
        let settings = settings_with_token();
        let v = config_json(&rules, &settings);
        assert_eq!(v["settings"]["admin"]["token"], REDACTED);
        let text = serde_json::to_string(&v).unwrap();
        assert!(!text.contains(SECRET), "the token leaked: {text}");
        // Everything else is the effective settings as they serialize.
        let mut expected = serde_json::to_value(&settings).unwrap();
        expected["admin"]["token"] = json!(REDACTED);
        assert_eq!(v["settings"], expected);
        assert_eq!(v["settings"]["grpc_addr"], "0.0.0.0:8081");
        assert_eq!(v["settings"]["rules"], "config/rules");
        // Unset, it stays null (nothing to hide, and no hint of one).
        let v = config_json(&rules, &Settings::default());
        assert_eq!(v["settings"]["admin"]["token"], Value::Null);
    }

    #[test]
    fn redis_passwords_are_redacted_in_the_setting_and_in_urls() {
        let (_dir, rules) = loaded();
        let mut settings = Settings::default();
        settings.redis.password = Some(SECRET.to_owned());
        settings.redis.urls = vec![format!("redis://app:{SECRET}@127.0.0.1:6379/2")];
        settings.redis.sentinel.password = Some(SECRET.to_owned());
        let v = config_json(&rules, &settings);
        let text = serde_json::to_string(&v).unwrap();
        assert!(!text.contains(SECRET), "the password leaked: {text}");
        assert_eq!(v["settings"]["redis"]["password"], REDACTED);
        assert_eq!(v["settings"]["redis"]["sentinel"]["password"], REDACTED);
        assert_eq!(
            v["settings"]["redis"]["urls"][0],
            "redis://app:<redacted>@127.0.0.1:6379/2"
        );
    }

    #[test]
    fn postgres_passwords_are_redacted_in_the_url() {
        let (_dir, rules) = loaded();
        let mut settings = Settings::default();
        settings.postgres.url = format!("postgres://app:{SECRET}@127.0.0.1:5432/limits");
        let v = config_json(&rules, &settings);
        let text = serde_json::to_string(&v).unwrap();
        assert!(!text.contains(SECRET), "the password leaked: {text}");
        assert_eq!(
            v["settings"]["postgres"]["url"],
            "postgres://app:<redacted>@127.0.0.1:5432/limits"
        );
    }

    #[test]
    fn numbers_and_durations() {
        assert_eq!(duration_text(1_000_000), "s");
        assert_eq!(duration_text(12_000_000), "12s");
        assert_eq!(duration_text(250_000), "250ms");
        assert_eq!(duration_text(90_000_000), "90s");
        assert_eq!(duration_text(7), "7us");
        assert_eq!(fraction(1_500_000, MICRO), Number::from_f64(1.5).unwrap());
        assert_eq!(fraction(3_000_000, MICRO), Number::from(3));
        let r = |tokens, period_us| refill_view(Rate::per(tokens, period_us).unwrap()).unwrap().text;
        // Not whole per second, minute, hour or day: the shortest whole period.
        assert_eq!(r(1, 7), "1/7us");
        assert_eq!(r(1, 7_000), "1/7ms");
        assert_eq!(r(3, 7_000), "3/7ms");
        // Otherwise the first of second, minute, hour, day in which the count is whole.
        assert_eq!(r(1, 3_000_000), "20/m");
        assert_eq!(r(60, 60_000_000), "1/s");
        assert_eq!(r(7, 3 * 3_600_000_000), "56/d");
        assert_eq!(r(1, 12_000_000), "5/m");
        assert!(refill_view(Rate::ZERO).is_none());
    }
}
