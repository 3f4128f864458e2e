//! The rules YAML as written. Both schemas share these structs; `deny_unknown_fields` makes a
//! misspelt field an error in either.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{Deserializer, Error as _, MapAccess, Visitor};
use serde::Deserialize;

/// One rules file: one domain.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RulesFile {
    pub domain: String,
    /// Named token-bucket policies that descriptors reference with `bucket:`. A name given twice
    /// is an error (a plain map would keep the last one silently).
    #[serde(default, deserialize_with = "unique_buckets")]
    pub buckets: BTreeMap<String, BucketSpec>,
    #[serde(default)]
    pub descriptors: Vec<DescriptorSpec>,
}

/// The `buckets:` map, rejecting a name that appears twice.
fn unique_buckets<'de, D: Deserializer<'de>>(deserializer: D) -> Result<BTreeMap<String, BucketSpec>, D::Error> {
    struct Unique;
    impl<'de> Visitor<'de> for Unique {
        type Value = BTreeMap<String, BucketSpec>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map from bucket names to buckets")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(name) = map.next_key::<String>()? {
                let spec: BucketSpec = map.next_value()?;
                if out.contains_key(&name) {
                    // serde_yaml appends the map's position: "... in the map at line 4 column 3".
                    return Err(A::Error::custom(format!(
                        "bucket `{name}` is declared twice (a bucket name must be unique) in the map"
                    )));
                }
                out.insert(name, spec);
            }
            Ok(out)
        }
    }
    deserializer.deserialize_map(Unique)
}

/// A bucket policy: a token bucket of `capacity` whole tokens refilled at `refill` (`10/s`,
/// `600/1m`, `1/250ms`), optionally changed by `schedule` windows; a calendar `quota`; or a
/// token bucket and a quota together (a request must pass both).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BucketSpec {
    pub capacity: Option<u64>,
    pub refill: Option<String>,
    /// Windows that change the token bucket's limit while active; the first active one wins.
    pub schedule: Option<Vec<ScheduleEntrySpec>>,
    pub quota: Option<QuotaSpec>,
    /// Kept out of the limits clients see (headers, `DescriptorStatus`); still decides.
    #[serde(default)]
    pub hidden: bool,
    /// A usage account (docs/usage-budgets.md): admitted while the balance is positive, usage
    /// reports debited in full, past zero down to `debt_floor`. On the bucket it covers its
    /// token bucket and its quota.
    #[serde(default)]
    pub debt: bool,
    /// How low a debt bucket's balance goes, in tokens (at most 0); default minus the capacity.
    pub debt_floor: Option<i64>,
    /// A fixed allowance's period: whole again this long after its first use (`24h`, or whole
    /// seconds).
    pub expires: Option<crate::core::units::Seconds>,
    /// Token leases (docs/backends.md): a replica may reserve this many tokens of the bucket
    /// from the shared store at a time and spend them without asking it. Only on a token
    /// bucket (`capacity` and `refill`, schedules allowed), at most its capacity.
    pub lease: Option<u64>,
}

/// One schedule window (docs/schedules-and-quotas.md): a five-field `cron` in `timezone` (IANA, default UTC), and
/// either `scale` or absolute `capacity` and/or `refill`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ScheduleEntrySpec {
    pub cron: String,
    pub timezone: Option<String>,
    pub scale: Option<f64>,
    pub capacity: Option<u64>,
    pub refill: Option<String>,
}

/// A calendar quota (docs/schedules-and-quotas.md): `limit` tokens, handed back whole at each edge of the `reset`
/// cron in `timezone`. `refill` is read only to reject it with a clear reason: a quota does not
/// drip.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QuotaSpec {
    pub limit: u64,
    pub reset: String,
    pub timezone: Option<String>,
    pub refill: Option<serde_yaml::Value>,
    /// Kept out of the limits clients see, as [`BucketSpec::hidden`].
    #[serde(default)]
    pub hidden: bool,
    /// A usage account, as [`BucketSpec::debt`]: the quota's reset adds its `limit` to the
    /// balance (a debt is repaid, not forgiven), up to the limit.
    #[serde(default)]
    pub debt: bool,
    /// As [`BucketSpec::debt_floor`]; default minus the quota's `limit`, and no deeper.
    pub debt_floor: Option<i64>,
}

/// One node of the descriptor tree.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DescriptorSpec {
    pub key: String,
    /// Exact value, or a pattern with `*`; absent means "any value" (one instance per value).
    pub value: Option<String>,
    /// The bucket name for an inline limit (`token_bucket` or `rate_limit` in tollgate's
    /// schema); defaults to the node's path.
    pub name: Option<String>,
    /// Reference to a policy in the file's `buckets:`.
    pub bucket: Option<String>,
    /// References to several policies in the file's `buckets:`, all of which a request must
    /// pass (a burst limit and a sustained one).
    pub buckets: Option<Vec<String>>,
    /// An inline token bucket.
    pub token_bucket: Option<BucketSpec>,
    /// envoyproxy/ratelimit's limit.
    pub rate_limit: Option<RateLimitSpec>,
    /// Schedule windows for the rule's inline limit (`token_bucket` or `rate_limit`).
    pub schedule: Option<Vec<ScheduleEntrySpec>>,
    /// A calendar quota: alone, or beside the rule's inline limit.
    pub quota: Option<QuotaSpec>,
    #[serde(default)]
    pub unlimited: bool,
    #[serde(default)]
    pub shadow_mode: bool,
    /// envoyproxy/ratelimit's quota mode: over its limit, the rule denies a request only when
    /// every quota-mode rule of the request is over too (docs/rules.md).
    #[serde(default)]
    pub quota_mode: bool,
    /// envoyproxy/ratelimit's descriptor `metadata`: any YAML mapping, passed on in the
    /// response's dynamic metadata when the rule passes (the `response.dynamic_metadata`
    /// setting).
    pub metadata: Option<serde_yaml::Value>,
    /// Bucket names this rule replaces when both match one request.
    pub replaces: Option<Vec<ReplaceSpec>>,
    #[serde(default)]
    pub descriptors: Vec<DescriptorSpec>,
    /// envoyproxy/ratelimit's metric fields: they shape only the envoyproxy/ratelimit-named
    /// series (`metrics.envoyproxy_names`), never tollgate's own; `tollgate check` lists them.
    pub detailed_metric: Option<serde_yaml::Value>,
    pub value_to_metric: Option<serde_yaml::Value>,
    /// envoyproxy/ratelimit: on a wildcard value, every matching value shares one bucket
    /// instead of one bucket per value.
    #[serde(default)]
    pub share_threshold: bool,
}

impl DescriptorSpec {
    /// The envoyproxy/ratelimit metric fields set on this node ([`metric_field_note`] says
    /// what each does in tollgate); `false`, which does nothing in theirs either (Envoy
    /// Gateway writes every field out), is not set.
    pub(crate) fn ignored_fields(&self) -> Vec<&'static str> {
        let set =
            |field: &Option<serde_yaml::Value>| field.as_ref().is_some_and(|v| *v != serde_yaml::Value::Bool(false));
        let mut out = Vec::new();
        if set(&self.detailed_metric) {
            out.push("detailed_metric");
        }
        if set(&self.value_to_metric) {
            out.push("value_to_metric");
        }
        out
    }
}

/// What envoyproxy/ratelimit's metric `field` (from [`DescriptorSpec::ignored_fields`]) does
/// in tollgate, as `tollgate check` prints it.
pub(crate) fn metric_field_note(field: &str) -> &'static str {
    match field {
        "detailed_metric" => {
            "shapes only the envoyproxy/ratelimit-named series (metrics.envoyproxy_names): their stat key \
             carries the request's values, for at most 1000 keys; tollgate's own metrics are unchanged"
        }
        _ => {
            "is accepted for envoyproxy/ratelimit compatibility but not applied: the envoyproxy/ratelimit-named \
             series (metrics.envoyproxy_names) keep the key alone (detailed_metric adds request values); \
             tollgate's own metrics are unchanged"
        }
    }
}

/// envoyproxy/ratelimit's `rate_limit` block.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RateLimitSpec {
    pub unit: Option<String>,
    pub requests_per_unit: Option<u64>,
    #[serde(default)]
    pub unlimited: bool,
    pub name: Option<String>,
    pub replaces: Option<Vec<ReplaceSpec>>,
}

/// `replaces: [{name: ...}]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReplaceSpec {
    pub name: String,
}
