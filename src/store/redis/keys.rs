//! Redis keys for bucket instances.
//!
//! A key is `<prefix>{<tag>}<identity>`: the identity is the instance key of
//! [`crate::matcher::instance_key`] (domain, bucket name and entries, each length-prefixed, so
//! no value can forge another instance's identity), and the tag is 16 hex digits of a hash of
//! that identity (XXH3-64). Redis Cluster hashes only what lies between the first `{` and the
//! next `}`; the prefix may hold neither (checked when settings load), so that is always the
//! tag, whatever bytes a descriptor value carries, and no client picks a slot.

use xxhash_rust::xxh3::xxh3_64;

/// The Redis key of the bucket instance `identity` under `prefix`.
pub fn bucket_key(prefix: &str, identity: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(prefix.len() + 18 + identity.len());
    key.extend_from_slice(prefix.as_bytes());
    key.push(b'{');
    let tag = xxh3_64(identity.as_bytes());
    for shift in (0..16).rev() {
        key.push(b"0123456789abcdef"[((tag >> (shift * 4)) & 0xf) as usize]);
    }
    key.push(b'}');
    key.extend_from_slice(identity.as_bytes());
    key
}

/// The Redis Cluster slot of `key` (CRC16 of its hash tag, mod 16384).
pub fn slot(key: &[u8]) -> u16 {
    fred::util::redis_keyslot(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matcher::instance_key;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

    fn identity(value: &str) -> String {
        let mut out = String::new();
        let entries = [Entry {
            key: "user".into(),
            value: value.into(),
        }];
        instance_key(&mut out, "api", "per_user", &entries, &[None]);
        out
    }

    #[test]
    fn the_tag_is_ours_whatever_the_value() {
        for value in ["plain", "{evil}", "}{", "a}b{c", "5:x", "ünï©ødé", ""] {
            let key = bucket_key("tollgate:", &identity(value));
            let text = String::from_utf8(key.clone()).unwrap();
            assert!(text.starts_with("tollgate:{"), "{text}");
            let tag = &text["tollgate:{".len()..text.find('}').unwrap()];
            assert_eq!(tag.len(), 16, "{text}");
            assert!(tag.bytes().all(|b| b.is_ascii_hexdigit()), "{text}");
            // The slot is the tag's, not the value's.
            assert_eq!(slot(&key), slot(format!("{{{tag}}}").as_bytes()));
        }
    }

    #[test]
    fn distinct_instances_get_distinct_keys() {
        let values = ["a", "a:", "1:a", "{a}", "}", "{", "é", "e\u{301}", "a\u{0}b"];
        let keys: std::collections::HashSet<Vec<u8>> = values.iter().map(|v| bucket_key("p:", &identity(v))).collect();
        assert_eq!(keys.len(), values.len());
    }

    #[test]
    fn keys_are_stable_across_processes() {
        // Replicas must agree on keys: the hash is a fixed algorithm, not a seeded one.
        let key = bucket_key("tollgate:", "3:api8:per_user4:user5:alice");
        assert_eq!(
            String::from_utf8(key).unwrap(),
            format!(
                "tollgate:{{{:016x}}}3:api8:per_user4:user5:alice",
                xxh3_64(b"3:api8:per_user4:user5:alice")
            )
        );
    }
}
