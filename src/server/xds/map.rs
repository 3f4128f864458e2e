//! `RateLimitConfig` resources onto the rules model: each descriptor becomes the
//! [`DescriptorSpec`] its YAML form (envoyproxy/ratelimit's rules file of the same content)
//! parses to, so both go through one compiler and a snapshot means exactly what the same
//! rules in files mean.
//!
//! Field by field: `key` and `value` as written (an empty value is a key-only node, any value;
//! a `*` in a value is a pattern, as in a file); `rate_limit` as `rate_limit:` with its `unit`
//! by name (`UNKNOWN`, their proto's 0, as no unit), `requests_per_unit` (left out on an
//! unlimited limit, where it does nothing), `unlimited`, `name` (empty: none) and `replaces`;
//! `shadow_mode`, `quota_mode`, `detailed_metric` (false: not written) and `metadata` (the
//! `Struct` as the mapping it came from) as the same fields; nested `descriptors` likewise.
//! The protos have no `value_to_metric` or `share_threshold`, so neither is ever set.

use std::path::PathBuf;

use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Any, Struct, Value};
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use prost::Message;

use crate::rules::file::{
    compile_models, ConfigError, ConfigErrors, DescriptorSpec, RateLimitSpec, ReplaceSpec, RulesFile,
};
use crate::rules::RuleSet;

/// The resource type tollgate subscribes to.
pub(crate) const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// The rules of one state-of-the-world snapshot (every resource, one domain each), compiled
/// all or nothing, as a reload compiles every rules file.
///
/// Errors: every problem, each naming its resource as `xds:<name>` (a resource that does not
/// decode, or of another type, as `xds:resource[<i>]`), the rule and the reason.
pub(crate) fn compile_resources(resources: &[Any]) -> Result<RuleSet, ConfigErrors> {
    let mut models = Vec::with_capacity(resources.len());
    let mut errors = Vec::new();
    for (i, any) in resources.iter().enumerate() {
        let at = PathBuf::from(format!("xds:resource[{i}]"));
        if any.type_url != TYPE_URL {
            errors.push(ConfigError::file(
                at,
                format!("a {} resource, not a RateLimitConfig", any.type_url),
            ));
            continue;
        }
        match RateLimitConfig::decode(any.value.as_slice()) {
            Ok(config) => models.push(to_model(&config)),
            Err(e) => errors.push(ConfigError::file(at, format!("not a RateLimitConfig: {e}"))),
        }
    }
    // The server's order is no order (go-control-plane walks a map): by name, so that the
    // files list and which of two clashing domains is reported do not vary.
    models.sort_by(|a, b| a.0.cmp(&b.0));
    match compile_models(models) {
        Ok(set) if errors.is_empty() => Ok(set),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(mut more)) => {
            errors.append(&mut more);
            Err(ConfigErrors(errors))
        }
    }
}

/// One `RateLimitConfig` as the rules file of the same content: `(xds:<name>, rules)`, the
/// name standing in for a file in errors and `/config` (the domain when the resource has no
/// name).
pub(crate) fn to_model(config: &RateLimitConfig) -> (PathBuf, RulesFile) {
    let name = if config.name.is_empty() {
        &config.domain
    } else {
        &config.name
    };
    let rules = RulesFile {
        domain: config.domain.clone(),
        buckets: Default::default(),
        descriptors: config.descriptors.iter().map(descriptor).collect(),
    };
    (PathBuf::from(format!("xds:{name}")), rules)
}

fn descriptor(d: &RateLimitDescriptor) -> DescriptorSpec {
    DescriptorSpec {
        key: d.key.clone(),
        value: (!d.value.is_empty()).then(|| d.value.clone()),
        name: None,
        bucket: None,
        buckets: None,
        token_bucket: None,
        rate_limit: d.rate_limit.as_ref().map(rate_limit),
        schedule: None,
        quota: None,
        unlimited: false,
        shadow_mode: d.shadow_mode,
        quota_mode: d.quota_mode,
        metadata: d.metadata.as_ref().map(mapping),
        replaces: None,
        descriptors: d.descriptors.iter().map(descriptor).collect(),
        detailed_metric: d.detailed_metric.then_some(serde_yaml::Value::Bool(true)),
        value_to_metric: None,
        share_threshold: false,
    }
}

fn rate_limit(p: &RateLimitPolicy) -> RateLimitSpec {
    RateLimitSpec {
        unit: unit_name(p.unit),
        requests_per_unit: (!p.unlimited || p.requests_per_unit > 0).then_some(u64::from(p.requests_per_unit)),
        unlimited: p.unlimited,
        name: (!p.name.is_empty()).then(|| p.name.clone()),
        replaces: (!p.replaces.is_empty()).then(|| {
            p.replaces
                .iter()
                .map(|r| ReplaceSpec { name: r.name.clone() })
                .collect()
        }),
    }
}

/// A unit as a rules file names it (`second`, ...); `UNKNOWN` (0, the proto's default) is no
/// unit, as their loader reads it, and a number outside the enumeration stays a number, which
/// the compiler refuses as an unknown unit.
fn unit_name(unit: i32) -> Option<String> {
    match RateLimitUnit::try_from(unit) {
        Ok(RateLimitUnit::Unknown) => None,
        Ok(known) => Some(known.as_str_name().to_ascii_lowercase()),
        Err(_) => Some(unit.to_string()),
    }
}

/// A `Struct` as the YAML mapping it stands for (keys sorted).
fn mapping(s: &Struct) -> serde_yaml::Value {
    let mut keys: Vec<&String> = s.fields.keys().collect();
    keys.sort();
    serde_yaml::Value::Mapping(
        keys.into_iter()
            .map(|k| (serde_yaml::Value::String(k.clone()), yaml(&s.fields[k])))
            .collect(),
    )
}

fn yaml(v: &Value) -> serde_yaml::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_yaml::Value::Null,
        Some(Kind::NumberValue(n)) => serde_yaml::Value::Number((*n).into()),
        Some(Kind::StringValue(s)) => serde_yaml::Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => serde_yaml::Value::Bool(*b),
        Some(Kind::StructValue(s)) => mapping(s),
        Some(Kind::ListValue(l)) => serde_yaml::Value::Sequence(l.values.iter().map(yaml).collect()),
    }
}

#[cfg(test)]
mod tests;
