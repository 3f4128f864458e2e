//! The response's dynamic metadata, in envoyproxy/ratelimit's shape (their
//! `RESPONSE_DYNAMIC_METADATA`; docs/rules.md, "Response metadata"). Envoy's rate limit filter
//! puts it under its own namespace (`envoy.filters.http.ratelimit`), where routes, access logs
//! and later filters read it.
//!
//! ```text
//! domain:      the request's domain
//! descriptors: per request descriptor, in order:
//!                entries:    ["key=value", ...]
//!                limit:      "requests_per_unit:N unit:UNIT"   when it carries Envoy's override
//!                hitsAddend: its own hits_addend                when set
//! hitsAddend:  the request's hits_addend                        when not 0
//! metadata:    the rules' `metadata` of the descriptors that were not OVER_LIMIT, merged in
//!              request order (a key already there keeps its value; two mappings merge)
//!              when there is any
//! ```

use std::collections::HashMap;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};

use crate::decision::response::Target;

/// The dynamic metadata of the answer to `req`, whose descriptors were matched to `targets`
/// and answered with `statuses`.
pub(crate) fn dynamic_metadata(
    req: &RateLimitRequest,
    targets: &[Option<Target<'_>>],
    statuses: &[DescriptorStatus],
) -> Struct {
    let mut fields = HashMap::with_capacity(4);
    fields.insert("domain".to_owned(), string(req.domain.clone()));
    let descriptors = req
        .descriptors
        .iter()
        .map(|d| {
            let mut f = HashMap::with_capacity(3);
            let entries = d
                .entries
                .iter()
                .map(|e| {
                    let mut s = String::with_capacity(e.key.len() + 1 + e.value.len());
                    s.push_str(&e.key);
                    s.push('=');
                    s.push_str(&e.value);
                    string(s)
                })
                .collect();
            f.insert("entries".to_owned(), list(entries));
            if let Some(o) = &d.limit {
                f.insert("limit".to_owned(), string(override_text(o)));
            }
            if let Some(h) = &d.hits_addend {
                f.insert("hitsAddend".to_owned(), number(h.value as f64));
            }
            structure(Struct { fields: f })
        })
        .collect();
    fields.insert("descriptors".to_owned(), list(descriptors));
    if req.hits_addend != 0 {
        fields.insert("hitsAddend".to_owned(), number(f64::from(req.hits_addend)));
    }
    let mut passed = Struct::default();
    for (t, status) in targets.iter().zip(statuses) {
        if status.code == Code::OverLimit as i32 {
            continue;
        }
        if let Some(m) = t.as_ref().and_then(|t| t.metadata) {
            merge(&mut passed, m);
        }
    }
    if !passed.fields.is_empty() {
        fields.insert("metadata".to_owned(), structure(passed));
    }
    Struct { fields }
}

/// `src` merged into `dest`: a key `dest` lacks is added; where both hold a mapping, the two
/// merge; otherwise `dest` keeps its value (the earlier descriptor's wins).
fn merge(dest: &mut Struct, src: &Struct) {
    for (k, v) in &src.fields {
        match dest.fields.get_mut(k) {
            None => {
                dest.fields.insert(k.clone(), v.clone());
            }
            Some(Value {
                kind: Some(Kind::StructValue(d)),
            }) => {
                if let Some(Kind::StructValue(s)) = &v.kind {
                    merge(d, s);
                }
            }
            Some(_) => {}
        }
    }
}

/// Envoy's override as the protobuf text of `RateLimitOverride`, fields at their default left
/// out (`requests_per_unit:10 unit:MINUTE`). envoyproxy/ratelimit prints it with Go's text
/// format, which may put two spaces between the fields at random: match on its parts.
fn override_text(o: &RateLimitOverride) -> String {
    let mut parts: Vec<String> = Vec::with_capacity(2);
    if o.requests_per_unit != 0 {
        parts.push(format!("requests_per_unit:{}", o.requests_per_unit));
    }
    if o.unit != 0 {
        match Unit::try_from(o.unit) {
            Ok(u) => parts.push(format!("unit:{}", u.as_str_name())),
            Err(_) => parts.push(format!("unit:{}", o.unit)),
        }
    }
    parts.join(" ")
}

fn string(s: String) -> Value {
    Value {
        kind: Some(Kind::StringValue(s)),
    }
}

fn number(n: f64) -> Value {
    Value {
        kind: Some(Kind::NumberValue(n)),
    }
}

fn list(values: Vec<Value>) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue { values })),
    }
}

fn structure(s: Struct) -> Value {
    Value {
        kind: Some(Kind::StructValue(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(pairs: &[(&str, Value)]) -> Struct {
        Struct {
            fields: pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect(),
        }
    }

    #[test]
    fn the_first_value_wins_and_mappings_merge() {
        let mut dest = Struct::default();
        merge(
            &mut dest,
            &s(&[
                ("name", string("service_1".into())),
                ("nested", structure(s(&[("a", number(1.0))]))),
            ]),
        );
        merge(
            &mut dest,
            &s(&[
                ("name", string("service_2".into())),
                ("other", string("x".into())),
                ("nested", structure(s(&[("a", number(2.0)), ("b", number(3.0))]))),
            ]),
        );
        let want = s(&[
            ("name", string("service_1".into())),
            ("other", string("x".into())),
            ("nested", structure(s(&[("a", number(1.0)), ("b", number(3.0))]))),
        ]);
        assert_eq!(dest, want);
    }

    #[test]
    fn an_override_reads_as_protobuf_text() {
        let o = |requests_per_unit, unit| RateLimitOverride {
            requests_per_unit,
            unit,
        };
        assert_eq!(
            override_text(&o(10, Unit::Minute as i32)),
            "requests_per_unit:10 unit:MINUTE"
        );
        assert_eq!(override_text(&o(0, Unit::Second as i32)), "unit:SECOND");
        assert_eq!(override_text(&o(5, 0)), "requests_per_unit:5");
        assert_eq!(override_text(&o(5, 42)), "requests_per_unit:5 unit:42");
    }
}
