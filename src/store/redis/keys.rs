//! Redis keys for bucket instances.
//!
//! A key is `<prefix>{<tag>}<identity>`: the identity is the instance key of
//! [`crate::rules::matcher::instance_key`] (domain, bucket name and entries, each length-prefixed, so
//! no value can forge another instance's identity), and the tag is 16 hex digits of a hash of
//! that identity (XXH3-64). Redis Cluster hashes only what lies between the first `{` and the
//! next `}`; the prefix may hold neither (checked when settings load), so that is always the
//! tag, whatever bytes a descriptor value carries, and no client picks a slot.
//!
//! **Bounded.** A descriptor value can be as long as a header Envoy accepts (tens of KiB), so
//! an identity longer than [`MAX_VERBATIM_IDENTITY`] bytes is stored as [`DIGEST_TAG`] and its
//! SHA-256 instead (as the Postgres store stores its rows' keys): a key is at most the prefix
//! and 530 bytes. Identities up to the bound keep the keys earlier versions wrote, so an
//! upgrade loses no bucket. No two identities share a key: a digest starts with a byte that
//! UTF-8 text never holds, so it never equals an identity kept as it is, and SHA-256 is
//! collision-resistant.

use sha2::Digest;
use xxhash_rust::xxh3::xxh3_64;

/// The longest identity (bytes) a key holds as it is; a longer one is replaced by its digest.
pub const MAX_VERBATIM_IDENTITY: usize = 512;

/// The first byte of an identity's digest in a key: never found in UTF-8 text.
pub const DIGEST_TAG: u8 = 0xFF;

/// The Redis key of the bucket instance `identity` under `prefix`: at most `prefix.len() + 18 +`
/// [`MAX_VERBATIM_IDENTITY`] bytes.
pub fn bucket_key(prefix: &str, identity: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(prefix.len() + 18 + identity.len().min(MAX_VERBATIM_IDENTITY));
    key.extend_from_slice(prefix.as_bytes());
    key.push(b'{');
    let tag = xxh3_64(identity.as_bytes());
    for shift in (0..16).rev() {
        key.push(b"0123456789abcdef"[((tag >> (shift * 4)) & 0xf) as usize]);
    }
    key.push(b'}');
    if identity.len() <= MAX_VERBATIM_IDENTITY {
        key.extend_from_slice(identity.as_bytes());
    } else {
        key.push(DIGEST_TAG);
        key.extend_from_slice(&sha2::Sha256::digest(identity.as_bytes()));
    }
    key
}

/// The Redis Cluster slot of `key` (CRC16 of its hash tag, mod 16384).
pub fn slot(key: &[u8]) -> u16 {
    fred::util::redis_keyslot(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::matcher::instance_key;
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
    fn long_identities_are_digested_and_still_distinct() {
        let long = "v".repeat(64 * 1024);
        let key = bucket_key("tollgate:", &identity(&long));
        assert!(
            key.len() <= "tollgate:".len() + 18 + MAX_VERBATIM_IDENTITY,
            "{} bytes",
            key.len()
        );
        assert_eq!(key.len(), "tollgate:".len() + 18 + 33);
        assert_eq!(key["tollgate:".len() + 18], DIGEST_TAG);
        // One byte apart, and at the bound on either side: all distinct.
        let mut other = long.clone();
        other.replace_range(..1, "w");
        let at_bound = "x".repeat(MAX_VERBATIM_IDENTITY);
        let over = "x".repeat(MAX_VERBATIM_IDENTITY + 1);
        let keys: std::collections::HashSet<Vec<u8>> = [&long, &other, &at_bound, &over]
            .iter()
            .map(|v| bucket_key("p:", &identity(v)))
            .chain([bucket_key("p:", &at_bound), bucket_key("p:", &over)])
            .collect();
        assert_eq!(keys.len(), 6);
        // At the bound the identity is kept as it is: the key earlier versions wrote.
        assert!(bucket_key("p:", &at_bound).ends_with(at_bound.as_bytes()));
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
