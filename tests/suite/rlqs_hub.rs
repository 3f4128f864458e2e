//! The RLQS hub driven by hand on a manual clock and the memory store: what each kind of bucket
//! id is assigned, bad input, bounds on streams and buckets, reloads, spent allowances, idle
//! buckets and shutdown. Envoys are the model of `rlqs_model.rs`.

use std::sync::Arc;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tokio::sync::mpsc;
use tollgate::core::clock::ManualClock;
use tollgate::decision::Limiter;
use tollgate::rlqs::{Hub, RlqsSettings, Unmatched};
use tollgate::store::MemoryStore;

use crate::harness::{options, rules};
use crate::rlqs_model::{key, EnvoyModel};

const START_US: u64 = 1_700_000_000_000_000;

const RULES: &str = "domain: edge
buckets:
  trial: {capacity: 30, expires: 10s}
descriptors:
  - key: api_key
    token_bucket: {capacity: 20, refill: 10/s}
  - key: tenant
    descriptors:
      - key: path
        value: /upload
        token_bucket: {capacity: 5, refill: 1/s}
  - key: static
    unlimited: true
  - key: trying
    shadow_mode: true
    token_bucket: {capacity: 1, refill: 1/m}
  - key: trial
    bucket: trial
";

type Outgoing = Result<RateLimitQuotaResponse, tonic::Status>;

struct Setup {
    hub: Arc<Hub<MemoryStore>>,
    limiter: Arc<Limiter<MemoryStore>>,
    clock: ManualClock,
}

fn setup(settings: RlqsSettings) -> Setup {
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(4, 10_000, Arc::new(clock.clone()));
    let limiter = Arc::new(Limiter::new(rules(RULES), store, options()));
    let hub = Hub::with_clock(limiter.clone(), settings, Arc::new(clock.clone()));
    Setup { hub, limiter, clock }
}

fn open<S: tollgate::store::Store>(hub: &Hub<S>) -> (u64, mpsc::Receiver<Outgoing>) {
    let (tx, rx) = mpsc::channel(1_024);
    (hub.open(tx).expect("a stream"), rx)
}

fn usage(pairs: &[(&str, &str)], allowed: u64, denied: u64, elapsed_s: i64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }),
        time_elapsed: Some(PbDuration {
            seconds: elapsed_s,
            nanos: 0,
        }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

fn reports(domain: &str, usages: Vec<BucketQuotaUsage>) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.into(),
        bucket_quota_usages: usages,
    }
}

/// How `limiter` resolves the descriptor `api_key=k1` of domain `edge`.
fn k1<S: tollgate::store::Store>(limiter: &Limiter<S>) -> tollgate::decision::Resolved {
    let entry = envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry {
        key: "api_key".into(),
        value: "k1".into(),
    };
    limiter.resolve("edge", &[entry]).expect("the rule")
}

/// Every action received so far, with its bucket id as `k=v,...`.
fn drain(rx: &mut mpsc::Receiver<Outgoing>) -> Vec<(String, Action)> {
    let mut out = Vec::new();
    while let Ok(msg) = rx.try_recv() {
        for a in msg.expect("no status").bucket_action {
            let mut pairs: Vec<String> = a
                .bucket_id
                .expect("every action names its bucket")
                .bucket
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            pairs.sort();
            out.push((pairs.join(","), a.bucket_action.expect("an action")));
        }
    }
    out
}

/// What an action is, in short: `token_bucket`, `allow_all`, `deny_all`, `abandon`.
fn kind(a: &Action) -> &'static str {
    match a {
        Action::AbandonAction(_) => "abandon",
        Action::QuotaAssignmentAction(q) => {
            assert!(
                q.assignment_time_to_live.is_some_and(|d| d.seconds >= 1),
                "every assignment carries a TTL of whole seconds: {q:?}"
            );
            match q.rate_limit_strategy.and_then(|s| s.strategy) {
                Some(Strategy::TokenBucket(tb)) => {
                    assert!(tb.max_tokens >= 1 && tb.tokens_per_fill.is_some_and(|v| v.value >= 1));
                    // Whole seconds, and the seconds again as nanos (Envoy compares only those).
                    assert!(tb
                        .fill_interval
                        .is_some_and(|d| d.seconds >= 1 && i64::from(d.nanos) == d.seconds));
                    "token_bucket"
                }
                Some(Strategy::BlanketRule(r)) if r == BlanketRule::AllowAll as i32 => "allow_all",
                Some(Strategy::BlanketRule(_)) => "deny_all",
                other => panic!("unexpected strategy {other:?}"),
            }
        }
    }
}

fn kinds(actions: &[(String, Action)]) -> Vec<(String, &'static str)> {
    actions.iter().map(|(id, a)| (id.clone(), kind(a))).collect()
}

#[tokio::test]
async fn each_kind_of_bucket_id_gets_what_its_rule_says() {
    let s = setup(RlqsSettings {
        unmatched: Unmatched::DenyAll,
        ..RlqsSettings::default()
    });
    let (id, mut rx) = open(&s.hub);
    s.hub
        .report(
            id,
            reports(
                "edge",
                vec![
                    usage(&[("api_key", "k1")], 1, 0, 0),
                    // Keys in the tree's order, whatever order the map gives.
                    usage(&[("path", "/upload"), ("tenant", "acme")], 1, 0, 0),
                    usage(&[("static", "x")], 1, 0, 0),
                    usage(&[("trying", "x")], 1, 0, 0),
                    usage(&[("nothing", "here")], 1, 0, 0),
                ],
            ),
        )
        .await;
    let mut got = kinds(&drain(&mut rx));
    got.sort();
    assert_eq!(
        got,
        vec![
            ("api_key=k1".into(), "token_bucket"),
            ("nothing=here".into(), "deny_all"),
            ("path=/upload,tenant=acme".into(), "token_bucket"),
            ("static=x".into(), "allow_all"),
            ("trying=x".into(), "allow_all"),
        ]
    );

    // An unknown domain is unmatched too; with `no_assignment` nothing is sent.
    let quiet = setup(RlqsSettings::default());
    let (id, mut rx) = open(&quiet.hub);
    quiet
        .hub
        .report(id, reports("elsewhere", vec![usage(&[("api_key", "k1")], 1, 0, 0)]))
        .await;
    quiet
        .hub
        .report(id, reports("edge", vec![usage(&[("nothing", "here")], 1, 0, 0)]))
        .await;
    quiet.hub.tick().await;
    assert!(drain(&mut rx).is_empty());
}

#[tokio::test]
async fn bad_reports_are_ignored_and_the_stream_goes_on() {
    let s = setup(RlqsSettings::default());
    let (id, mut rx) = open(&s.hub);
    let bad = vec![
        // No bucket id, an empty one.
        BucketQuotaUsage {
            bucket_id: None,
            ..usage(&[], 1, 0, 0)
        },
        usage(&[], 1, 0, 0),
        // A negative duration, nanoseconds out of range, over a day.
        usage(&[("api_key", "neg")], 1, 0, -5),
        BucketQuotaUsage {
            time_elapsed: Some(PbDuration {
                seconds: 1,
                nanos: 2_000_000_000,
            }),
            ..usage(&[("api_key", "nanos")], 1, 0, 0)
        },
        usage(&[("api_key", "long")], 1, 0, 10 * 86_400),
        // Seconds whose microseconds overflow once the nanoseconds are added.
        BucketQuotaUsage {
            time_elapsed: Some(PbDuration {
                seconds: 18_446_744_073_709,
                nanos: 999_999_999,
            }),
            ..usage(&[("api_key", "overflow")], 1, 0, 0)
        },
        // Absurd counts.
        usage(&[("api_key", "huge")], u64::MAX, u64::MAX, 5),
        // A key or value Envoy could never have sent in a descriptor: empty key, a huge value.
        usage(&[("", "v")], 1, 0, 0),
        usage(&[("api_key", &"x".repeat(100_000))], 1, 0, 0),
    ];
    s.hub.report(id, reports("edge", bad.clone())).await;
    s.hub.report(id, reports("", bad)).await;
    let got = kinds(&drain(&mut rx));
    // Only the over-long value reaches a rule (cut as a request's would be): a bucket of its own.
    assert!(
        got.iter()
            .all(|(id, k)| id.starts_with("api_key=xxx") && *k == "token_bucket"),
        "{got:?}"
    );
    // The stream still works.
    s.hub
        .report(id, reports("edge", vec![usage(&[("api_key", "ok")], 1, 0, 0)]))
        .await;
    assert_eq!(kinds(&drain(&mut rx)), vec![("api_key=ok".into(), "token_bucket")]);
}

#[tokio::test]
async fn streams_and_buckets_per_stream_are_bounded() {
    let s = setup(RlqsSettings {
        max_streams: 2,
        max_buckets_per_stream: 3,
        ..RlqsSettings::default()
    });
    let (id, mut rx) = open(&s.hub);
    let _second = open(&s.hub);
    let (tx, _rx) = mpsc::channel(1);
    let refused = s.hub.open(tx).expect_err("a third stream is refused");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    let many: Vec<BucketQuotaUsage> = (0..10)
        .map(|i| usage(&[("api_key", &format!("k{i}"))], 1, 0, 0))
        .collect();
    s.hub.report(id, reports("edge", many)).await;
    assert_eq!(drain(&mut rx).len(), 3);
    s.hub.tick().await;
    assert_eq!(drain(&mut rx).len(), 3, "only the buckets bound are renewed");
    // A closed stream frees its place.
    s.hub.close(id).await;
    let (tx, _rx) = mpsc::channel(1);
    assert!(s.hub.open(tx).is_ok());
}

#[tokio::test]
async fn a_spent_allowance_is_denied_until_it_is_whole_again() {
    let s = setup(RlqsSettings::default());
    let (id, mut rx) = open(&s.hub);
    let mut envoy = EnvoyModel::new("edge", false);
    let trial = key(&[("trial", "t1")]);
    let mut admitted = 0;
    let mut denied_all_seen = false;
    let mut token_bucket_after_reset = false;
    // 25 seconds of 20 requests a second; the allowance is 30 per 10 s from first use.
    for step in 0..2_500u64 {
        let now = START_US + step * 10_000;
        s.clock.set_us(now);
        for (_, action) in drain(&mut rx).iter() {
            let response = RateLimitQuotaResponse {
                bucket_action: vec![
                    envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction {
                        bucket_id: Some(BucketId {
                            bucket: trial.iter().cloned().collect(),
                        }),
                        bucket_action: Some(*action),
                    },
                ],
            };
            if kind(action) == "deny_all" {
                denied_all_seen = true;
            } else if denied_all_seen && kind(action) == "token_bucket" {
                token_bucket_after_reset = true;
            }
            envoy.apply(&response, now);
        }
        if step % 5 == 0 {
            let (ok, first) = envoy.request(&trial, now);
            admitted += u64::from(ok);
            if let Some(r) = first {
                s.hub.report(id, r).await;
            }
        }
        if step % 500 == 499 {
            let r = envoy.report(now);
            s.hub.report(id, r).await;
        }
        if step % 100 == 99 {
            s.hub.tick().await;
        }
        // Within the first period, never more than the allowance.
        if step < 1_000 {
            assert!(
                admitted <= 30,
                "{admitted} admitted of an allowance of 30 at step {step}"
            );
        }
    }
    assert!(denied_all_seen, "a spent allowance is DENY_ALL");
    assert!(token_bucket_after_reset, "whole again, it is handed out again");
    // Three periods started in 25 s at most: 90 at most.
    assert!((30..=90).contains(&admitted), "{admitted}");
}

#[tokio::test]
async fn a_reload_reassigns_and_a_removed_rule_is_abandoned() {
    let s = setup(RlqsSettings::default());
    let (id, mut rx) = open(&s.hub);
    s.hub
        .report(
            id,
            reports(
                "edge",
                vec![usage(&[("api_key", "k1")], 1, 0, 0), usage(&[("static", "x")], 1, 0, 0)],
            ),
        )
        .await;
    let first = drain(&mut rx);
    assert_eq!(first.len(), 2);
    s.clock.advance_us(1_000_000);
    s.hub.tick().await;
    let before = drain(&mut rx);
    // A slower refill for api_key; `static` gone.
    s.limiter.swap_rules(rules(
        "domain: edge\ndescriptors:\n  - key: api_key\n    token_bucket: {capacity: 20, refill: 2/s}\n",
    ));
    s.clock.advance_us(1_000_000);
    s.hub.tick().await;
    let after = drain(&mut rx);
    let of = |actions: &[(String, Action)], id: &str| actions.iter().find(|(i, _)| i == id).map(|(_, a)| *a);
    assert_ne!(
        of(&before, "api_key=k1"),
        of(&after, "api_key=k1"),
        "the new refill gives a new bucket"
    );
    assert_eq!(of(&after, "static=x").map(|a| kind(&a)), Some("abandon"));
}

#[tokio::test]
async fn idle_buckets_are_abandoned_and_shutdown_ends_every_stream() {
    let s = setup(RlqsSettings {
        idle_seconds: tollgate::core::units::Seconds(10),
        ..RlqsSettings::default()
    });
    let (id, mut rx) = open(&s.hub);
    s.hub
        .report(id, reports("edge", vec![usage(&[("api_key", "k1")], 1, 0, 0)]))
        .await;
    for _ in 0..11 {
        s.clock.advance_us(1_000_000);
        s.hub
            .report(id, reports("edge", vec![usage(&[("api_key", "k1")], 0, 0, 1)]))
            .await;
        s.hub.tick().await;
    }
    let got = kinds(&drain(&mut rx));
    assert_eq!(got.last().map(|(_, k)| *k), Some("abandon"), "{got:?}");

    s.hub.shut_down();
    match rx.recv().await {
        Some(Err(status)) => assert_eq!(status.code(), tonic::Code::Unavailable),
        other => panic!("the stream ends with UNAVAILABLE, not {other:?}"),
    }
    assert!(rx.recv().await.is_none(), "and then ends");
    let (tx, _rx) = mpsc::channel(1);
    assert_eq!(
        s.hub.open(tx).expect_err("no new stream").code(),
        tonic::Code::Unavailable
    );
}

/// Two replicas on one PostgreSQL schema: each pays for its Envoy's share in the shared table.
/// The first Envoy, on a quiet bucket, bursts half of what the look-ahead leaves of it (the
/// rest waits for the Envoys that report next); the second replica's share is cut to what is
/// left, and the bursts never add up to more than the capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_postgres_pay_from_one_bucket() {
    use envoy_types::pb::envoy::r#type::v3::TokenBucket;
    const TEST: &str = "two_replicas_on_postgres_pay_from_one_bucket";
    let Some(url) = crate::support::postgres::shared_postgres(TEST).await else {
        return;
    };
    let schema = crate::support::postgres::unique_schema();
    let rules_yaml = "domain: edge\ndescriptors:\n  - key: api_key\n    token_bucket: {capacity: 20, refill: 1/s}\n";
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let store = crate::support::postgres::store(&url, &schema).await;
        let limiter = Arc::new(Limiter::new(rules(rules_yaml), store, options()));
        replicas.push(Hub::new(limiter, RlqsSettings::default()));
    }
    // A token bucket's burst, or 0 for DENY_ALL.
    let burst_of = |actions: Vec<(String, Action)>| -> u32 {
        match actions.into_iter().next().map(|(_, a)| a) {
            Some(Action::QuotaAssignmentAction(q)) => match q.rate_limit_strategy.and_then(|s| s.strategy) {
                Some(Strategy::TokenBucket(TokenBucket { max_tokens, .. })) => max_tokens,
                Some(Strategy::BlanketRule(r)) if r == BlanketRule::DenyAll as i32 => 0,
                other => panic!("a token bucket or DENY_ALL, not {other:?}"),
            },
            other => panic!("an assignment, not {other:?}"),
        }
    };
    let mut bursts = Vec::new();
    for hub in &replicas {
        let (id, mut rx) = open(hub);
        hub.report(id, reports("edge", vec![usage(&[("api_key", "k1")], 1, 0, 0)]))
            .await;
        bursts.push(burst_of(drain(&mut rx)));
    }
    // 20 less the look-ahead (1.25 s of 1/s), halved: 9.
    assert!(
        bursts[0] >= 9,
        "the first Envoy bursts half of a quiet bucket: {bursts:?}"
    );
    let bursts: u32 = bursts.iter().sum();
    assert!(bursts <= 20, "bursts of {bursts} tokens in all from a bucket of 20");
    // What the shares were paid with is gone from the shared bucket.
    let resolved = k1(replicas[0].limiter());
    let peeked = tollgate::store::Store::peek(replicas[0].limiter().store(), &resolved.buckets)
        .await
        .expect("peek");
    assert!(
        peeked.states[0].tokens_ut <= (20 - u64::from(bursts)) * 1_000_000 + 2_000_000,
        "the bucket holds {} µt after paying for {bursts} tokens of bursts",
        peeked.states[0].tokens_ut
    );
    crate::support::postgres::drop_schema(&url, &schema).await;
}

/// A new Envoy bucket is assigned alone: the other Envoys of the group get nothing until the
/// next round. A report with no time elapsed (Envoy created the bucket anew) is assigned at
/// once, as a new bucket paid in full.
#[tokio::test]
async fn a_new_envoy_is_assigned_alone_and_a_recreated_bucket_is_paid_in_full() {
    let s = setup(RlqsSettings::default());
    let mut streams: Vec<(u64, mpsc::Receiver<Outgoing>)> = (0..3).map(|_| open(&s.hub)).collect();
    for (id, rx) in streams.iter_mut() {
        s.hub
            .report(*id, reports("edge", vec![usage(&[("api_key", "k1")], 1, 0, 0)]))
            .await;
        assert_eq!(drain(rx).len(), 1);
    }
    // The bucket refills meanwhile, so the newcomer can be paid for.
    s.clock.advance_us(3_000_000);
    let (late, mut late_rx) = open(&s.hub);
    s.hub
        .report(late, reports("edge", vec![usage(&[("api_key", "k1")], 1, 0, 0)]))
        .await;
    assert_eq!(kinds(&drain(&mut late_rx)), vec![("api_key=k1".into(), "token_bucket")]);
    for (_, rx) in streams.iter_mut() {
        assert!(drain(rx).is_empty(), "the others wait for the next round");
    }
    // A periodic report changes nothing at once; a report with no time elapsed does.
    let (id, rx) = &mut streams[0];
    s.clock.advance_us(100_000);
    s.hub
        .report(*id, reports("edge", vec![usage(&[("api_key", "k1")], 5, 0, 5)]))
        .await;
    assert!(drain(rx).is_empty());
    let resolved = k1(&s.limiter);
    let level = || async {
        tollgate::store::Store::peek(s.limiter.store(), &resolved.buckets)
            .await
            .expect("peek")
            .states[0]
            .tokens_ut
    };
    let before = level().await;
    s.hub
        .report(*id, reports("edge", vec![usage(&[("api_key", "k1")], 1, 0, 0)]))
        .await;
    let sent = drain(rx);
    let burst = match sent.first().map(|(_, a)| *a) {
        Some(Action::QuotaAssignmentAction(q)) => match q.rate_limit_strategy.and_then(|s| s.strategy) {
            Some(Strategy::TokenBucket(tb)) => u64::from(tb.max_tokens),
            other => panic!("a token bucket, not {other:?}"),
        },
        other => panic!("an assignment, not {other:?}"),
    };
    let after = level().await;
    assert!(
        before - after >= burst * 1_000_000,
        "the recreated bucket's burst of {burst} was paid: {before} -> {after}"
    );
}

/// A rule with a debt bucket is not served over RLQS: a share paid ahead could spend its floor.
#[tokio::test]
async fn a_debt_bucket_is_not_served() {
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(4, 10_000, Arc::new(clock.clone()));
    let yaml = "domain: llm\nbuckets:\n  budget: {capacity: 100, refill: 10/s, debt: true}\ndescriptors:\n  - key: tenant\n    bucket: budget\n";
    let limiter = Arc::new(Limiter::new(rules(yaml), store, options()));
    let hub = Hub::with_clock(
        limiter,
        RlqsSettings {
            unmatched: Unmatched::DenyAll,
            ..RlqsSettings::default()
        },
        Arc::new(clock.clone()),
    );
    let (id, mut rx) = open(&hub);
    hub.report(id, reports("llm", vec![usage(&[("tenant", "t1")], 1, 0, 0)]))
        .await;
    assert_eq!(kinds(&drain(&mut rx)), vec![("tenant=t1".into(), "deny_all")]);
}
