//! envoyproxy/ratelimit's descriptor `metadata`: any YAML mapping, read once at load into the
//! `google.protobuf.Struct` a response's dynamic metadata carries (docs/rules.md).

use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, NullValue, Struct, Value};

/// The `metadata` of a rules file as a `Struct`: a mapping whose keys are strings (a number or
/// a boolean key is taken as its text, as YAML readers commonly do), with values of any JSON
/// kind; numbers become doubles, as in any `Struct`.
///
/// Errors: the reason, when `yaml` is not a mapping, or holds a tagged value or a key that is
/// not a scalar.
pub(crate) fn metadata_struct(yaml: &serde_yaml::Value) -> Result<Struct, String> {
    match yaml {
        serde_yaml::Value::Mapping(m) => mapping(m, "metadata"),
        _ => Err("`metadata` must be a mapping (key: value)".into()),
    }
}

fn mapping(m: &serde_yaml::Mapping, at: &str) -> Result<Struct, String> {
    let mut fields = std::collections::HashMap::with_capacity(m.len());
    for (k, v) in m {
        let key = match k {
            serde_yaml::Value::String(s) => s.clone(),
            serde_yaml::Value::Number(n) => n.to_string(),
            serde_yaml::Value::Bool(b) => b.to_string(),
            _ => return Err(format!("`{at}` has a key that is not a string")),
        };
        let value = value(v, &format!("{at}.{key}"))?;
        fields.insert(key, value);
    }
    Ok(Struct { fields })
}

fn value(v: &serde_yaml::Value, at: &str) -> Result<Value, String> {
    let kind = match v {
        serde_yaml::Value::Null => Kind::NullValue(NullValue::NullValue as i32),
        serde_yaml::Value::Bool(b) => Kind::BoolValue(*b),
        serde_yaml::Value::Number(n) => match n.as_f64() {
            Some(f) if f.is_finite() => Kind::NumberValue(f),
            _ => return Err(format!("`{at}` is not a finite number")),
        },
        serde_yaml::Value::String(s) => Kind::StringValue(s.clone()),
        serde_yaml::Value::Sequence(items) => Kind::ListValue(ListValue {
            values: items
                .iter()
                .enumerate()
                .map(|(i, item)| value(item, &format!("{at}[{i}]")))
                .collect::<Result<_, _>>()?,
        }),
        serde_yaml::Value::Mapping(m) => Kind::StructValue(mapping(m, at)?),
        serde_yaml::Value::Tagged(_) => return Err(format!("`{at}` is a tagged value, which metadata cannot hold")),
    };
    Ok(Value { kind: Some(kind) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Struct, String> {
        metadata_struct(&serde_yaml::from_str(text).unwrap())
    }

    #[test]
    fn every_json_kind_is_read() {
        let s = parse("name: service_1\nn: 2\nok: true\nnone: null\nlist: [a, 1]\nnested: {k: v}\n3: three\n").unwrap();
        let kind = |k: &str| s.fields[k].kind.clone().unwrap();
        assert_eq!(kind("name"), Kind::StringValue("service_1".into()));
        assert_eq!(kind("n"), Kind::NumberValue(2.0));
        assert_eq!(kind("ok"), Kind::BoolValue(true));
        assert_eq!(kind("none"), Kind::NullValue(0));
        assert!(matches!(kind("list"), Kind::ListValue(l) if l.values.len() == 2));
        assert!(matches!(kind("nested"), Kind::StructValue(n) if n.fields.contains_key("k")));
        assert_eq!(kind("3"), Kind::StringValue("three".into()));
    }

    #[test]
    fn what_a_struct_cannot_hold_is_refused() {
        assert!(parse("[a, b]").unwrap_err().contains("must be a mapping"));
        assert!(parse("a: !tag x")
            .unwrap_err()
            .contains("`metadata.a` is a tagged value"));
        assert!(parse("a: {[1]: x}").unwrap_err().contains("`metadata.a` has a key"));
        assert!(parse("a: .inf").unwrap_err().contains("finite"));
    }
}
