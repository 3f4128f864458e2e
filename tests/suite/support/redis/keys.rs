//! tollgate's keys as a test sees them: SCAN under a prefix (raw bytes), keys without a TTL,
//! deleting a test's prefix from the shared server.

use std::collections::BTreeSet;
use std::time::Duration;

use super::*;

/// `prefix` as a SCAN MATCH pattern that matches exactly the keys starting with it: the glob
/// characters `*`, `?`, `[`, `]` and `\` escaped, then `*`.
pub fn scan_pattern(prefix: &[u8]) -> Vec<u8> {
    let mut pattern = Vec::with_capacity(prefix.len() + 1);
    for &b in prefix {
        if b"*?[]\\".contains(&b) {
            pattern.push(b'\\');
        }
        pattern.push(b);
    }
    pattern.push(b'*');
    pattern
}

/// Every key starting with `prefix` on one server (SCAN over database 0), as raw bytes.
pub fn scan_keys_raw(target: impl Into<RedisTarget>, prefix: &[u8]) -> Vec<Vec<u8>> {
    let target = target.into();
    let mut conn = target
        .connect(RESP_TIMEOUT)
        .unwrap_or_else(|e| panic!("SCAN on {}: {e}", target.addr));
    let pattern = scan_pattern(prefix);
    let mut cursor = b"0".to_vec();
    let mut keys = BTreeSet::new();
    loop {
        let reply = conn
            .command(&[b"SCAN", &cursor, b"MATCH", &pattern, b"COUNT", b"1000"])
            .and_then(RespValue::ok)
            .unwrap_or_else(|e| panic!("SCAN on {}: {e}", target.addr));
        let parts = reply.as_array().unwrap_or_default();
        let (Some(next), Some(RespValue::Array(batch))) = (parts.first().and_then(RespValue::as_bytes), parts.get(1))
        else {
            panic!("SCAN on {}: unexpected reply {reply:?}", target.addr);
        };
        // SCAN can return a key more than once; the set keeps one.
        keys.extend(batch.iter().filter_map(|k| k.as_bytes().map(<[u8]>::to_vec)));
        cursor = next.to_vec();
        if cursor == b"0" {
            break;
        }
    }
    keys.into_iter().collect()
}

/// Every key starting with `prefix` on one server whose PTTL is -1 (it never expires), as raw
/// bytes, sorted.
pub fn keys_without_ttl_raw(target: impl Into<RedisTarget>, prefix: &[u8]) -> Vec<Vec<u8>> {
    let target = target.into();
    let keys = scan_keys_raw(&target, prefix);
    if keys.is_empty() {
        return keys;
    }
    let mut conn = target
        .connect(RESP_TIMEOUT)
        .unwrap_or_else(|e| panic!("PTTL on {}: {e}", target.addr));
    let mut found = Vec::new();
    for chunk in keys.chunks(500) {
        let commands: Vec<Vec<Vec<u8>>> = chunk.iter().map(|k| vec![b"PTTL".to_vec(), k.clone()]).collect();
        let replies = conn
            .pipeline(&commands)
            .unwrap_or_else(|e| panic!("PTTL on {}: {e}", target.addr));
        for (key, reply) in chunk.iter().zip(replies) {
            // -2: the key expired or was deleted since SCAN saw it.
            match reply {
                RespValue::Integer(-1) => found.push(key.clone()),
                RespValue::Integer(_) => {}
                other => panic!("PTTL {:?} on {}: {other:?}", String::from_utf8_lossy(key), target.addr),
            }
        }
    }
    found
}

/// [`keys_without_ttl_raw`] for a text prefix, each key as text (invalid UTF-8 replaced), for
/// assertions and messages. `target`: a URL (`&str`), a port on 127.0.0.1, a
/// [`RedisServer`] or a [`RedisTarget`].
pub fn keys_without_ttl(target: impl Into<RedisTarget>, prefix: &str) -> Vec<String> {
    keys_without_ttl_raw(target, prefix.as_bytes())
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect()
}

/// Deletes every key starting with `prefix` on one server (a test's own keys on the shared
/// server: they would otherwise live until their TTL, years for some buckets).
/// Returns how many were deleted.
pub fn delete_prefix(target: impl Into<RedisTarget>, prefix: &str) -> usize {
    let target = target.into();
    let keys = scan_keys_raw(&target, prefix.as_bytes());
    for key in &keys {
        target.cmd(&[b"DEL", key]);
    }
    keys.len()
}

/// A Redis store on `urls` (a Cluster when `cluster`) under `prefix` whose scripts decide at
/// `clock`'s time instead of Redis `TIME`, connected: what the tests that pin exact states use.
pub async fn store_on_clock(
    urls: Vec<String>,
    cluster: bool,
    prefix: &str,
    clock: &tollgate::core::clock::ManualClock,
) -> tollgate::store::RedisStore {
    let settings = tollgate::server::settings::RedisSettings {
        urls,
        cluster,
        key_prefix: prefix.to_string(),
        command_timeout_ms: tollgate::core::units::Millis(5_000),
        ..tollgate::server::settings::RedisSettings::default()
    };
    let store = tollgate::store::RedisStore::new(&settings, std::sync::Arc::new(tollgate::core::clock::SystemClock))
        .expect("a valid Redis store")
        .with_time_override(std::sync::Arc::new(clock.clone()));
    store.connect(Duration::from_secs(10)).await.expect("Redis connects");
    store
}
