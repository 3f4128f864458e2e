//! Adversarial inputs from an xDS server (a buggy control plane): what tollgate does with them,
//! checked on the gRPC port, `/config` and `/readyz`. Loopback only.

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{RateLimitConfig, RateLimitDescriptor, RateLimitUnit};
use prost::Message;
use tokio::task::block_in_place;
use tonic::transport::Channel;

use super::xds_rules::{
    answer_to, ask_in, client, config, eventually, hits, limit, listener, node, readyz, start_plain, Ads, DOMAIN, OK,
    OVER, PATIENCE, TYPE_URL,
};
use crate::support::Tollgate;

const BACKOFF: &str = "{initial_ms: 50, max_ms: 200}";

fn any(c: &RateLimitConfig) -> Any {
    Any {
        type_url: TYPE_URL.into(),
        value: c.encode_to_vec(),
    }
}

fn response(version: &str, resources: Vec<Any>) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.into(),
        resources,
        type_url: TYPE_URL.into(),
        ..Default::default()
    }
}

/// Starts tollgate on a new ADS server and puts `listener(1)` in force as v1.
async fn started(extra: &str) -> (Ads, Tollgate, RateLimitServiceClient<Channel>) {
    let ads = Ads::default();
    let addr = ads.serve(None).await;
    let tollgate = if extra.is_empty() {
        block_in_place(|| start_plain(addr, BACKOFF))
    } else {
        block_in_place(|| {
            Tollgate::builder()
                .settings(&format!(
                    "rules_source: xds\nxds:\n  server_url: {addr}\n  node_id: envoy-ratelimit\n  backoff: {BACKOFF}\n{extra}"
                ))
                .start()
        })
    };
    let c = client(&tollgate).await;
    ads.request(1).await;
    (ads, tollgate, c)
}

async fn apply_v1(ads: &Ads) {
    let nonce = ads.push("v1", &[listener(1)]);
    let ack = answer_to(ads, &nonce).await;
    assert!(ack.error_detail.is_none(), "{ack:?}");
}

/// `n` levels of descriptors (`k0=v0 / k1=v1 / ...`) under `domain`, the last limited to 1 a
/// minute, encoded by hand (no recursion in the test).
fn deep(domain: &str, n: usize) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    let leaf = limit(
        node(&format!("k{}", n - 1), &format!("v{}", n - 1)),
        RateLimitUnit::Minute,
        1,
    );
    let mut inner = leaf.encode_to_vec();
    for i in (0..n - 1).rev() {
        let mut d = node(&format!("k{i}"), &format!("v{i}")).encode_to_vec();
        encode_key(4, WireType::LengthDelimited, &mut d);
        encode_varint(inner.len() as u64, &mut d);
        d.extend_from_slice(&inner);
        inner = d;
    }
    let mut top = RateLimitConfig {
        name: domain.into(),
        domain: domain.into(),
        descriptors: vec![],
    }
    .encode_to_vec();
    encode_key(3, WireType::LengthDelimited, &mut top);
    encode_varint(inner.len() as u64, &mut top);
    top.extend_from_slice(&inner);
    top
}

/// 100 snapshots sent back to back, faster than they compile: the last is in force and ACKed,
/// and `/config` names its version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_snapshots_ends_with_the_last_in_force() {
    let (ads, tollgate, mut c) = started("").await;
    apply_v1(&ads).await;
    let mut last = String::new();
    for i in 2..=101 {
        let per = if i == 101 { 2 } else { 1000 + i };
        last = ads.push(&format!("v{i}"), &[listener(per)]);
    }
    let ack = answer_to(&ads, &last).await;
    assert_eq!(ack.version_info, "v101");
    assert!(ack.error_detail.is_none());
    assert_eq!(hits(&mut c, "burst", 3).await, [OK, OK, OVER]);
    assert_eq!(block_in_place(|| config(&tollgate))["rules_source"]["version"], "v101");
}

/// No resources after good rules: the server means nothing limited; ACKed, ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_snapshot_limits_nothing_and_later_rules_apply() {
    let (ads, tollgate, mut c) = started("").await;
    apply_v1(&ads).await;
    assert_eq!(hits(&mut c, "a", 2).await, [OK, OVER]);
    let n = ads.push("v2", &[]);
    assert!(answer_to(&ads, &n).await.error_detail.is_none());
    assert_eq!(hits(&mut c, "b", 3).await, [OK, OK, OK]);
    assert_eq!(block_in_place(|| readyz(&tollgate)).0, 200);
    let n = ads.push("v3", &[listener(1)]);
    assert!(answer_to(&ads, &n).await.error_detail.is_none());
    assert_eq!(hits(&mut c, "c", 2).await, [OK, OVER]);
}

/// Each broken snapshot is NACKed with a reason naming it, and v1 stays enforced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_snapshots_are_nacked_and_the_rules_stay() {
    let (ads, tollgate, mut c) = started("").await;
    apply_v1(&ads).await;
    let other = |domain: &str| RateLimitConfig {
        name: "other".into(),
        domain: domain.into(),
        descriptors: vec![limit(node("k", ""), RateLimitUnit::Second, 1)],
    };
    let mut dup_keys = listener(1);
    dup_keys.descriptors.push(dup_keys.descriptors[0].clone());
    let mut empty_key = listener(1);
    empty_key.descriptors[0].descriptors[0].key = String::new();
    let mut unit99 = listener(1);
    unit99.descriptors[0].descriptors[0].rate_limit.as_mut().unwrap().unit = 99;
    let cases: Vec<(&str, Vec<Any>, &str)> = vec![
        (
            "same domain twice",
            vec![any(&listener(1)), any(&other(DOMAIN))],
            "already declared",
        ),
        (
            "empty domain",
            vec![any(&listener(1)), any(&other(""))],
            "`domain` must not be empty",
        ),
        (
            "blank domain",
            vec![any(&listener(1)), any(&other("  "))],
            "`domain` must not be empty",
        ),
        (
            "bytes that do not decode",
            vec![
                any(&listener(1)),
                Any {
                    type_url: TYPE_URL.into(),
                    value: vec![0xff, 0xff, 0xff],
                },
            ],
            "not a RateLimitConfig",
        ),
        (
            "a 0-byte resource",
            vec![
                any(&listener(1)),
                Any {
                    type_url: TYPE_URL.into(),
                    value: vec![],
                },
            ],
            "must not be empty",
        ),
        (
            "an Any of another type",
            vec![
                any(&listener(1)),
                Any {
                    type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
                    value: vec![],
                },
            ],
            "not a RateLimitConfig",
        ),
        ("duplicate keys", vec![any(&dup_keys)], "duplicate descriptor"),
        ("empty key", vec![any(&empty_key)], "`key` must not be empty"),
        ("unit 99", vec![any(&unit99)], "unknown unit `99`"),
        (
            "10,000 levels",
            vec![Any {
                type_url: TYPE_URL.into(),
                value: deep("deep", 10_000),
            }],
            "not a RateLimitConfig",
        ),
    ];
    let total = cases.len();
    for (i, (what, resources, reason)) in cases.into_iter().enumerate() {
        let n = ads.send(response(&format!("bad{i}"), resources));
        let nack = answer_to(&ads, &n).await;
        let detail = nack.error_detail.unwrap_or_else(|| panic!("{what}: ACKed"));
        assert!(detail.message.contains(reason), "{what}: {}", detail.message);
        assert_eq!(nack.version_info, "v1", "{what}");
        assert_eq!(hits(&mut c, &format!("v{i}"), 2).await, [OK, OVER], "{what}");
    }
    let log = tollgate.process.log();
    assert_eq!(
        log.matches("rules from the xDS server rejected").count(),
        total,
        "each refusal logged:\n{log}"
    );
    assert_eq!(block_in_place(|| config(&tollgate))["rules_source"]["version"], "v1");
}

/// Descriptors nested 90 deep (within the protobuf decoder's limit): compiled and enforced, as
/// the same YAML would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_descriptors_within_the_decode_limit_apply() {
    let (ads, _tollgate, mut c) = started("").await;
    let n = ads.send(response(
        "deep",
        vec![Any {
            type_url: TYPE_URL.into(),
            value: deep("deep", 30),
        }],
    ));
    let ack = answer_to(&ads, &n).await;
    assert!(ack.error_detail.is_none(), "{:?}", ack.error_detail);
    let keys: Vec<(String, String)> = (0..30).map(|i| (format!("k{i}"), format!("v{i}"))).collect();
    let entries: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(ask_in(&mut c, "deep", &entries).await, Ok(OK));
    assert_eq!(ask_in(&mut c, "deep", &entries).await, Ok(OVER));
}

/// 50,000 limited descriptors at one level (about 1.4 MB, within the default 4 MiB
/// max_message_bytes) compile in well under 5 s, a debug build included. The compile was
/// quadratic (each unnamed `rate_limit` looked for a bucket like it among all so far): 10k took
/// 1.5 s, 20k 5.6 s, 40k 25.6 s in a debug build, during which the stream was not read and
/// nothing was ACKed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_thousand_descriptors_compile_in_seconds() {
    let (ads, _tollgate, mut c) = started("").await;
    let count: usize = std::env::var("XDS_BREAK_WIDE").map_or(50_000, |v| v.parse().unwrap());
    let descriptors: Vec<RateLimitDescriptor> = (0..count)
        .map(|i| limit(node("path", &format!("/api/{i}")), RateLimitUnit::Minute, 1))
        .collect();
    let wide = RateLimitConfig {
        name: "wide".into(),
        domain: "wide".into(),
        descriptors,
    };
    eprintln!("resource bytes: {}", wide.encoded_len());
    let started = Instant::now();
    let n = ads.push("wide", &[wide]);
    let ack = answer_to(&ads, &n).await;
    eprintln!("ACK after {:?}", started.elapsed());
    assert!(ack.error_detail.is_none(), "{:?}", ack.error_detail);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "compile took {:?}",
        started.elapsed()
    );
    let t = Instant::now();
    assert_eq!(ask_in(&mut c, "wide", &[("path", "/api/49999")]).await, Ok(OK));
    eprintln!("a decision: {:?}", t.elapsed());
}

/// A response larger than `xds.max_message_bytes`: the rules stay, and the state says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_response_keeps_the_rules_and_says_why() {
    let (ads, tollgate, mut c) = started("  max_message_bytes: 4096\n").await;
    apply_v1(&ads).await;
    let mut big = listener(5);
    big.descriptors[0].descriptors.push(node(&"x".repeat(8000), ""));
    ads.push("v2", &[big]);
    eventually("a second stream", || ads.streams() >= 2).await;
    let shown = block_in_place(|| config(&tollgate));
    eprintln!("{}", serde_json::to_string_pretty(&shown["rules_source"]).unwrap());
    eprintln!("requests seen: {}", ads.requests());
    assert_eq!(hits(&mut c, "big", 2).await, [OK, OVER]);
    assert_eq!(shown["rules_source"]["version"], "v1");
    let error = shown["rules_source"]["last_error"].to_string();
    assert!(
        error.contains("too large") || error.contains("max_message_bytes") || error.contains("length"),
        "{error}"
    );
}

/// Before any rules: an oversized first response. What `/readyz` says while it is so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_first_response_reason_on_readyz() {
    let (ads, tollgate, _c) = started("  max_message_bytes: 4096\n").await;
    ads.behave(super::xds_rules::OnNack::Wait, true);
    let mut big = listener(5);
    big.descriptors[0].descriptors.push(node(&"x".repeat(8000), ""));
    ads.push("v1", &[big]);
    eventually("a third stream", || ads.streams() >= 3).await;
    let (status, body) = block_in_place(|| readyz(&tollgate));
    let shown = block_in_place(|| config(&tollgate));
    eprintln!(
        "readyz {status}: {body}\n{}",
        serde_json::to_string_pretty(&shown["rules_source"]).unwrap()
    );
    assert_eq!(status, 503);
    // Between two attempts (the waits grow; a new connection says `connected, ...`).
    let reason = "not ready: no rules received from the xDS server yet (its response is larger than \
                  xds.max_message_bytes; see the log)\n";
    let body = if body == reason {
        body
    } else {
        tokio::time::sleep(Duration::from_millis(100)).await;
        block_in_place(|| readyz(&tollgate)).1
    };
    assert_eq!(body, reason);
    let error = shown["rules_source"]["last_error"]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.starts_with("a response larger than xds.max_message_bytes (4096 bytes) was refused"),
        "{error}"
    );
}

/// The server sends a snapshot and drops the stream at once: whatever tollgate did with it, the
/// version it resumes from is the one whose rules it enforces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_closed_right_after_a_response() {
    let (ads, tollgate, mut c) = started("").await;
    apply_v1(&ads).await;
    ads.push("v2", &[listener(2)]);
    ads.drop_stream();
    eventually("a second stream", || ads.streams() >= 2).await;
    let deadline = Instant::now() + PATIENCE;
    let resumed = loop {
        let seen = ads.request(ads.requests()).await;
        if seen.stream == 2 {
            break seen;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let version = resumed.request.version_info.clone();
    let got = hits(&mut c, "closed", 3).await;
    let expected = if version == "v2" {
        vec![OK, OK, OVER]
    } else {
        vec![OK, OVER, OVER]
    };
    assert_eq!(got, expected, "resumed from {version}");
    assert_eq!(block_in_place(|| config(&tollgate))["rules_source"]["version"], version);
}

/// `xds.headers` values never reach the log, even at debug, while the stream fails and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_values_stay_out_of_the_debug_log() {
    let ads = Ads::default();
    let addr = ads.serve(None).await;
    let tollgate = block_in_place(|| {
        Tollgate::builder()
            .settings(&format!(
                "log:\n  level: debug\nrules_source: xds\nxds:\n  server_url: {addr}\n  node_id: n\n  headers: {{authorization: Bearer s3cr3t-9137}}\n  backoff: {BACKOFF}\n"
            ))
            .start()
    });
    ads.request(1).await;
    apply_v1(&ads).await;
    ads.drop_stream();
    eventually("a second stream", || ads.streams() >= 2).await;
    let log = tollgate.process.log();
    assert!(!log.contains("s3cr3t-9137"), "{log}");
}

/// envoyproxy/ratelimit takes any uint32 requests_per_unit with any unit; so does tollgate for
/// the huge "practically unlimited" counts control planes write (holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_count_per_month_is_accepted_as_theirs_accepts_it() {
    let (ads, _tollgate, _c) = started("").await;
    for (unit, count) in [
        (RateLimitUnit::Second, u32::MAX),
        (RateLimitUnit::Month, u32::MAX),
        (RateLimitUnit::Year, 999_999_999),
    ] {
        let mut huge = listener(1);
        huge.descriptors[0].descriptors[0]
            .rate_limit
            .as_mut()
            .unwrap()
            .requests_per_unit = count;
        huge.descriptors[0].descriptors[0].rate_limit.as_mut().unwrap().unit = unit as i32;
        let n = ads.push(&format!("{unit:?}"), &[huge]);
        let answer = answer_to(&ads, &n).await;
        assert!(
            answer.error_detail.is_none(),
            "{count} per {unit:?}: {:?}",
            answer.error_detail
        );
    }
}
