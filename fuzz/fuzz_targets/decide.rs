//! The request decoder (`wire::decode_request`, the lenient codec) and the whole decision path
//! (`Limiter` on the memory store, a manual clock) over the tests' valid rules files
//! (tests/fixtures/valid: both schemas, schedules, quotas, shadow mode, replaces, wildcards,
//! shared buckets). Each input is a run of steps: requests (built from the rules' own keys and
//! values, or raw bytes), clock advances, sweeps, reloads. Asserted over the run:
//! - nothing panics, and every response passes `tollgate_fuzz::check_response`;
//! - a denied request without refunds changes no bucket it reaches (peeked before and after);
//! - per bucket instance of a constant limit, admitted hits never exceed its capacity plus the
//!   refill over the run plus the refunds it was given.
#![no_main]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, LazyLock, Mutex};

use arbitrary::Arbitrary;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tollgate::core::bucket::Demand;
use tollgate::core::bucket::MICRO;
use tollgate::core::clock::{Clock, ManualClock};
use tollgate::rules::load_rules;
use tollgate::decision::Limiter;
use tollgate::rules::{Level, RuleSet};
use tollgate::core::schedule::Plan;
use tollgate::store::{Applied, BucketRef, MemoryStore, Peeked, Store, StoreError};
use tollgate_fuzz::{check_response, limiter_options, now};

/// 2026-03-29 00:30 UTC, an hour before Europe's clocks move on: schedules and quotas in the
/// fixtures change within a run.
const START_US: u64 = 1_774_744_200_000_000;

fn rules_dir() -> &'static Path {
    static DIR: LazyLock<std::path::PathBuf> =
        LazyLock::new(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/valid"));
    &DIR
}

fn load() -> RuleSet {
    load_rules(rules_dir()).unwrap_or_else(|e| panic!("{}: {e}", rules_dir().display()))
}

/// The domains, keys and values of the rules, for inputs that reach rules.
struct Vocabulary {
    domains: Vec<String>,
    keys: Vec<String>,
    values: Vec<String>,
}

fn harvest(level: &Level, rules: &tollgate::rules::Domain, v: &mut Vocabulary) {
    for (key, values) in &level.exact {
        v.keys.push(key.clone());
        for (value, node) in values {
            v.values.push(value.to_string());
            harvest(&rules.nodes[*node].children, rules, v);
        }
    }
    for (key, pattern, node) in &level.wildcard {
        v.keys.push(key.clone());
        v.values.push(pattern.text().replace('*', "x"));
        harvest(&rules.nodes[*node].children, rules, v);
    }
    for (key, node) in &level.any {
        v.keys.push(key.clone());
        harvest(&rules.nodes[*node].children, rules, v);
    }
}

static VOCABULARY: LazyLock<Vocabulary> = LazyLock::new(|| {
    let set = load();
    let mut v = Vocabulary {
        domains: set.domains.keys().cloned().collect(),
        keys: Vec::new(),
        values: Vec::new(),
    };
    for dom in set.domains.values() {
        harvest(&dom.root, dom, &mut v);
    }
    for list in [&mut v.domains, &mut v.keys, &mut v.values] {
        list.sort();
        list.dedup();
    }
    v
});

fn pick(list: &[String], i: u8) -> String {
    if list.is_empty() {
        String::new()
    } else {
        list[usize::from(i) % list.len()].clone()
    }
}

#[derive(Arbitrary, Debug)]
enum Value {
    /// A value of the rules.
    Known(u8),
    /// Anything else (lands on key-only and wildcard nodes).
    Other(String),
}

#[derive(Arbitrary, Debug)]
struct Descriptor {
    entries: Vec<(u8, Value)>,
    hits: Option<u16>,
    negative: bool,
    /// An Envoy `limit` override: requests per unit, unit (0-6 are the proto's; others invalid).
    limit: Option<(u16, u8)>,
}

#[derive(Arbitrary, Debug)]
struct Request {
    /// `None`: a domain the rules do not have.
    domain: Option<u8>,
    hits_addend: u8,
    descriptors: Vec<Descriptor>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Ask(Request),
    /// Protobuf bytes straight into the decoder.
    Raw(Vec<u8>),
    AdvanceUs(u16),
    AdvanceSeconds(u16),
    Sweep,
    /// The same rules compiled again and swapped in, as a reload of unchanged files is not
    /// (a fingerprint stops it) but a reload of an edit elsewhere is.
    Reload,
}

fn encode(r: &Request) -> Vec<u8> {
    let v = &*VOCABULARY;
    let req = RateLimitRequest {
        domain: r
            .domain
            .map_or_else(|| "no-such-domain".to_owned(), |i| pick(&v.domains, i)),
        hits_addend: u32::from(r.hits_addend),
        descriptors: r
            .descriptors
            .iter()
            .map(|d| RateLimitDescriptor {
                entries: d
                    .entries
                    .iter()
                    .map(|(k, value)| Entry {
                        key: pick(&v.keys, *k),
                        value: match value {
                            Value::Known(i) => pick(&v.values, *i),
                            Value::Other(s) => s.clone(),
                        },
                    })
                    .collect(),
                limit: d.limit.map(|(n, unit)| RateLimitOverride {
                    requests_per_unit: u32::from(n),
                    unit: i32::from(unit % 8),
                }),
                hits_addend: d.hits.map(|n| UInt64Value { value: u64::from(n) }),
                is_negative_hits: d.negative,
            })
            .collect(),
    };
    req.encode_to_vec()
}

/// What one constant-limit bucket instance was asked over the run.
#[derive(Default)]
struct Account {
    first_seen_us: u64,
    admitted_ut: u128,
    refunded_ut: u128,
}

/// The memory store of the input being run. Compiling the rules costs far more than a run, so
/// the limiter is built once; a fresh store (and clock) per input keeps inputs independent.
struct Current(Mutex<Arc<MemoryStore>>);

impl Current {
    fn get(&self) -> Arc<MemoryStore> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Store for Current {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        Store::apply(&*self.get(), buckets, demands).await
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        Store::peek(&*self.get(), buckets).await
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        Store::reset(&*self.get(), buckets).await
    }

    fn rules_changed(&self) {
        Store::rules_changed(&*self.get())
    }
}

static LIMITER: LazyLock<Limiter<Current>> = LazyLock::new(|| {
    let placeholder = MemoryStore::new(1, 1, Arc::new(ManualClock::new(START_US)));
    Limiter::new(load(), Current(Mutex::new(Arc::new(placeholder))), limiter_options())
});

fuzz_target!(|steps: Vec<Step>| {
    let clock = ManualClock::new(START_US);
    // Room for every bucket a run can touch: an eviction forgets a bucket on purpose
    // (`memory.max_buckets`), which the accounting below would take for an over-admission.
    let store = Arc::new(MemoryStore::new(4, 1 << 20, Arc::new(clock.clone())));
    let limiter = &*LIMITER;
    *limiter.store().0.lock().unwrap_or_else(|p| p.into_inner()) = store.clone();
    let mut accounts: HashMap<String, Account> = HashMap::new();
    for step in steps.iter().take(256) {
        let bytes = match step {
            Step::Ask(r) => encode(r),
            Step::Raw(b) => b.clone(),
            Step::AdvanceUs(us) => {
                clock.advance_us(u64::from(*us));
                continue;
            }
            Step::AdvanceSeconds(s) => {
                clock.advance_us(u64::from(*s) * 1_000_000);
                continue;
            }
            Step::Sweep => {
                store.sweep();
                continue;
            }
            Step::Reload => {
                limiter.swap_rules(load());
                continue;
            }
        };
        let Ok(req) = tollgate::server::decode_request(bytes.as_slice()) else {
            continue;
        };
        let t_us = clock.now_us();
        // The rule buckets each descriptor reaches (overrides' are the request's own).
        let resolved: Vec<_> = req
            .descriptors
            .iter()
            .map(|d| limiter.resolve(&req.domain, &d.entries).ok())
            .collect();
        let refs: Vec<BucketRef> = resolved.iter().flatten().flat_map(|r| r.buckets.clone()).collect();
        for r in refs.iter() {
            accounts.entry(r.key.clone()).or_insert_with(|| Account {
                first_seen_us: t_us,
                ..Default::default()
            });
        }
        let before = store.peek_now(&refs);
        let answer = now(limiter.should_rate_limit(&req));
        let after = store.peek_now(&refs);
        let refunds = req.descriptors.iter().any(|d| d.is_negative_hits);
        let resp = match answer {
            Ok(resp) => resp,
            Err(e) => panic!("the memory store failed: {e}"),
        };
        check_response(&resp, req.descriptors.len());
        let denied = resp.overall_code == Code::OverLimit as i32;
        if denied && !refunds {
            assert_eq!(before, after, "a denied request changed a bucket: {req:?}");
        }
        let known_domain = limiter.rules().domain(&req.domain).is_some();
        for ((d, r), status) in req.descriptors.iter().zip(&resolved).zip(&resp.statuses) {
            let Some(r) = r else { continue };
            if d.limit.is_some() && known_domain {
                continue; // decided by the override's bucket, not the rule's
            }
            let hits = d
                .hits_addend
                .as_ref()
                .map_or(u64::from(req.hits_addend.max(1)), |v| v.value);
            let ut = u128::from(hits) * u128::from(MICRO);
            for b in &r.buckets {
                let account = accounts.get_mut(&b.key).expect("seen");
                if d.is_negative_hits {
                    // Refunds always apply (when the rule is not replaced: counting one that
                    // was not given only loosens the bound).
                    account.refunded_ut += ut;
                } else if !denied && !r.shadow && status.current_limit.is_some() {
                    account.admitted_ut += ut;
                }
            }
        }
        for b in &refs {
            let Plan::Fixed(limit) = &b.plan else { continue };
            let account = &accounts[&b.key];
            let elapsed = u128::from(t_us - account.first_seen_us);
            let refill_ut = elapsed * u128::from(limit.rate.num()) / u128::from(limit.rate.den());
            let bound = u128::from(limit.capacity_ut) + refill_ut + account.refunded_ut;
            assert!(
                account.admitted_ut <= bound,
                "{}: admitted {} µt > capacity {} + refill {refill_ut} + refunds {} µt over {elapsed} µs",
                b.key,
                account.admitted_ut,
                limit.capacity_ut,
                account.refunded_ut
            );
        }
    }
});
