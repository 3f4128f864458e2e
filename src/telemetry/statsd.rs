//! envoyproxy/ratelimit's statsd counters (`metrics.statsd`, docs/monitoring.md): a registry of
//! named atomic counters that the decision path adds to, and that the statsd sink
//! (`crate::statsd`) drains at each flush, sending what each gained since the last one, as
//! their stats library does. No I/O here; with the sink off every handle is a no-op.
//!
//! The names are theirs: `ratelimit.service.rate_limit.<stat key>.<stat>`,
//! `ratelimit.service.call.should_rate_limit.redis_error`, `ratelimit.service.config_load_success`,
//! `ratelimit.service.config_load_error`, `ratelimit_server.ShouldRateLimit.total_requests`,
//! `ratelimit.service.rate_limit.<domain>.domain_not_found`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The scope of their per-rule stats: `<this>.<stat key>.<stat>`.
pub const RATE_LIMIT_SCOPE: &str = "ratelimit.service.rate_limit";
/// Their counter of requests answered with an error because the backend failed.
pub const REDIS_ERROR: &str = "ratelimit.service.call.should_rate_limit.redis_error";
/// Their counter of configuration loads that took effect (the first one included).
pub const CONFIG_LOAD_SUCCESS: &str = "ratelimit.service.config_load_success";
/// Their counter of configuration loads refused (the configuration in force stays).
pub const CONFIG_LOAD_ERROR: &str = "ratelimit.service.config_load_error";
/// The suffix of their count of descriptors whose request named a domain no rules declare:
/// `ratelimit.service.rate_limit.<domain>.domain_not_found`.
pub const DOMAIN_NOT_FOUND: &str = "domain_not_found";
/// Their gRPC server's counter of `ShouldRateLimit` calls.
pub const TOTAL_REQUESTS: &str = "ratelimit_server.ShouldRateLimit.total_requests";
/// Their gRPC server's timer of `ShouldRateLimit` calls, in whole milliseconds (one sample
/// per call).
pub const RESPONSE_TIME: &str = "ratelimit_server.ShouldRateLimit.response_time";
/// The suffix of their per-rule stats, in [`crate::telemetry::EnvoyproxyStats`] order.
pub const RULE_STATS: [&str; 5] = ["total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode"];

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Every counter handed out, by its full name. Handles of one name share their atomic, so rules
/// whose stat keys are alike add up, as theirs do; the set only grows (by the rules' stat keys,
/// and `detailed_metric` keys within [`crate::telemetry::DETAILED_SERIES_MAX`]).
static REGISTRY: Mutex<BTreeMap<String, Arc<AtomicU64>>> = Mutex::new(BTreeMap::new());

/// One statsd counter: an atomic add when the sink is on, nothing otherwise.
#[derive(Clone, Debug, Default)]
pub struct StatsdCounter(Option<Arc<AtomicU64>>);

impl StatsdCounter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        if let Some(c) = &self.0 {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// Turns the counters on for handles made from now on (`serve` does, before loading rules,
/// when `metrics.statsd.addr` is set).
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Whether the statsd sink is on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The counter named `name` (a no-op while the sink is off).
pub fn counter(name: &str) -> StatsdCounter {
    if !enabled() {
        return StatsdCounter(None);
    }
    let mut registry = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    let c = registry.entry(name.to_owned()).or_default();
    StatsdCounter(Some(Arc::clone(c)))
}

/// Adds `n` to the counter named `name` (for counts too rare to keep a handle for).
pub fn add(name: &str, n: u64) {
    counter(name).add(n);
}

/// Calls `send` with the name and the gain of every counter that gained since the last drain,
/// and takes that gain off (a counter that gained nothing is not sent, as in theirs).
pub fn drain(mut send: impl FnMut(&str, u64)) {
    let registry = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    for (name, c) in registry.iter() {
        let gained = c.swap(0, Ordering::Relaxed);
        if gained > 0 {
            send(name, gained);
        }
    }
}

/// Most distinct unknown domains counted under their own names (their names come from
/// requests); beyond it, a new one is not counted in statsd (`tollgate_unknown_domain_requests_total`
/// still counts every request).
pub const UNKNOWN_DOMAINS_MAX: usize = 1000;

/// Unknown domains longer than this (bytes) are not counted by name: a request's domain is the
/// caller's to choose, and each counted one is held for the life of the process and sent at
/// every flush.
pub const UNKNOWN_DOMAIN_BYTES_MAX: usize = 256;

static UNKNOWN_DOMAINS: Mutex<BTreeMap<String, StatsdCounter>> = Mutex::new(BTreeMap::new());

/// Counts `descriptors` descriptors of a request for `domain`, which no rules declare, as theirs
/// does (one per descriptor): `ratelimit.service.rate_limit.<domain>.domain_not_found`, for at
/// most [`UNKNOWN_DOMAINS_MAX`] distinct domains of at most [`UNKNOWN_DOMAIN_BYTES_MAX`] bytes.
pub fn count_domain_not_found(domain: &str, descriptors: usize) {
    if !enabled() || descriptors == 0 || domain.len() > UNKNOWN_DOMAIN_BYTES_MAX {
        return;
    }
    let mut seen = UNKNOWN_DOMAINS.lock().unwrap_or_else(PoisonError::into_inner);
    if !seen.contains_key(domain) {
        if seen.len() >= UNKNOWN_DOMAINS_MAX {
            return;
        }
        let name = format!(
            "{RATE_LIMIT_SCOPE}.{}.{DOMAIN_NOT_FOUND}",
            line_safe(&crate::telemetry::sanitize_stat_key(domain))
        );
        seen.insert(domain.to_owned(), counter(&name));
    }
    if let Some(c) = seen.get(domain) {
        c.add(descriptors as u64);
    }
}

/// Their name of a stat of a rule with stat key `stat_key`: `ratelimit.service.rate_limit.` then
/// the key as their stat-name sanitizer leaves it (`:` and `|` as `_`, an IPv4 address's dots
/// as `_`), then `.` and `stat`.
pub fn rule_stat_name(stat_key: &str, stat: &str) -> String {
    format!(
        "{RATE_LIMIT_SCOPE}.{}.{stat}",
        line_safe(&crate::telemetry::sanitize_stat_key(stat_key))
    )
}

/// `name` with control characters and whitespace as `_`: a stat name that holds a request's
/// text (an unknown domain, a `detailed_metric` value) must stay one statsd line and one name
/// (a `\n` would start a line of the caller's choosing).
fn line_safe(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_control() || c.is_whitespace() { '_' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sanitized_as_theirs() {
        assert_eq!(
            rule_stat_name("edge.remote_address_10.0.0.1", "total_hits"),
            "ratelimit.service.rate_limit.edge.remote_address_10_0_0_1.total_hits"
        );
        assert_eq!(
            rule_stat_name("d.k_a:b|c.path_/api/*", "over_limit"),
            "ratelimit.service.rate_limit.d.k_a_b_c.path_/api/*.over_limit"
        );
        // A request's text in a name cannot start a statsd line of its own.
        assert_eq!(
            rule_stat_name("d.k_a\nevil.metric:1000000|c", "total_hits"),
            "ratelimit.service.rate_limit.d.k_a_evil.metric_1000000_c.total_hits"
        );
    }

    /// An unknown domain over the byte bound is not counted, so a caller cannot make the
    /// process hold (and send at every flush) megabytes per domain.
    #[test]
    fn an_overlong_unknown_domain_is_not_held() {
        enable();
        let long = "d".repeat(UNKNOWN_DOMAIN_BYTES_MAX + 1);
        count_domain_not_found(&long, 1);
        assert!(!UNKNOWN_DOMAINS.lock().unwrap().contains_key(&long));
        let short = "unknown-short-domain";
        count_domain_not_found(short, 2);
        assert!(UNKNOWN_DOMAINS.lock().unwrap().contains_key(short));
    }

    #[test]
    fn a_drain_sends_gains_once_and_skips_the_idle() {
        enable();
        let a = counter("test.drain.a");
        let a2 = counter("test.drain.a");
        let _b = counter("test.drain.b");
        a.add(2);
        a2.add(3);
        let mut sent = Vec::new();
        drain(|name, n| {
            if name.starts_with("test.drain.") {
                sent.push((name.to_owned(), n));
            }
        });
        assert_eq!(sent, [("test.drain.a".to_owned(), 5)]);
        sent.clear();
        drain(|name, n| {
            if name.starts_with("test.drain.") {
                sent.push((name.to_owned(), n));
            }
        });
        assert!(sent.is_empty(), "{sent:?}");
    }
}
