//! RLQS at fleet scale, simulated deterministically: 1,000 Envoys (the model of
//! `rlqs_model.rs`) with skewed demand share one global bucket through tollgate's hub, beside an
//! RLS client of the same rule; a hundred leave part way and a hundred new ones join. Time is a
//! manual clock moved in 10 ms steps; assignments reach each Envoy 20 ms after they are sent.
//!
//! Checked: at every step, everything admitted (the Envoys on their assignments and the RLS
//! client) is within the bucket's capacity plus its refill so far; over the minute measured,
//! no Envoy with demand gets less than half its max-min fair share of the refill; the store is
//! called per assignment round, not per request.

use std::collections::VecDeque;
use std::sync::Arc;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use tokio::sync::mpsc;
use tollgate::core::clock::ManualClock;
use tollgate::decision::Limiter;
use tollgate::rlqs::plan::fair_split;
use tollgate::rlqs::{Hub, RlqsSettings};
use tollgate::store::MemoryStore;

use crate::harness::{desc, options, req, rules, OK};
use crate::rlqs_model::{key, EnvoyModel, Key, REPORT_EVERY_US};

const RULES: &str = "domain: fleet\ndescriptors:\n  - key: api_key\n    name: shared\n    token_bucket: {capacity: 4000, refill: 2000/s}\n";
const CAPACITY: u64 = 4_000;
const REFILL: u64 = 2_000;
const START_US: u64 = 1_700_000_000_000_000;
const STEP_US: u64 = 10_000;
const DELAY_US: u64 = 20_000;

type Outgoing = Result<RateLimitQuotaResponse, tonic::Status>;

struct SimEnvoy {
    model: EnvoyModel,
    stream: Option<u64>,
    rx: Option<mpsc::Receiver<Outgoing>>,
    inbox: VecDeque<(u64, RateLimitQuotaResponse)>,
    /// Requests a second.
    demand: f64,
    carry: f64,
    next_report_us: u64,
    /// Admitted within the measured window: from `measure_from_us` to the end.
    measured: u64,
    measure_from_us: u64,
    active_to_us: u64,
}

fn demand_of(i: usize) -> f64 {
    50.0 / (1.0 + i as f64 / 20.0)
}

async fn join(hub: &Hub<MemoryStore>, i: usize, now: u64, until: u64) -> SimEnvoy {
    let (tx, rx) = mpsc::channel(4_096);
    let id = hub.open(tx).expect("a stream");
    SimEnvoy {
        model: EnvoyModel::new("fleet", false),
        stream: Some(id),
        rx: Some(rx),
        inbox: VecDeque::new(),
        demand: demand_of(i),
        carry: (i as f64 * 0.37) % 1.0,
        next_report_us: now + REPORT_EVERY_US + (i as u64 * 4_999) % REPORT_EVERY_US,
        measured: 0,
        // A joiner is measured from its first periodic report on, when its demand is known.
        measure_from_us: if now == START_US {
            START_US + 10_000_000
        } else {
            now + REPORT_EVERY_US
        },
        active_to_us: until,
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_thousand_envoys_share_one_global_bucket_fairly_and_within_it() {
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(4, 100_000, Arc::new(clock.clone()));
    let limiter = Arc::new(Limiter::new(rules(RULES), store, options()));
    let hub = Hub::with_clock(limiter.clone(), RlqsSettings::default(), Arc::new(clock.clone()));
    let shared: Key = key(&[("api_key", "shared")]);
    let rls_request = req("fleet", vec![desc(&[("api_key", "shared")])]);

    let end = START_US + 70_000_000;
    let leave = START_US + 20_000_000;
    let rejoin = START_US + 35_000_000;
    let measure_to = end;
    let mut fleet = Vec::new();
    for i in 0..1_000 {
        let until = if i >= 900 { leave } else { end };
        fleet.push(join(&hub, i, START_US, until).await);
    }
    let mut admitted: u64 = 0;
    let mut rls_admitted: u64 = 0;
    let mut next_tick = START_US;
    let mut now = START_US;
    while now < end {
        now += STEP_US;
        clock.set_us(now);
        if now == leave {
            for e in fleet.iter_mut().skip(900) {
                if let Some(id) = e.stream.take() {
                    hub.close(id).await;
                }
            }
        }
        if now == rejoin {
            for i in 900..1_000 {
                fleet.push(join(&hub, i, now, end).await);
            }
        }
        for e in fleet.iter_mut() {
            let Some(id) = e.stream else { continue };
            // Assignments sent are received DELAY_US later.
            if let Some(rx) = &mut e.rx {
                while let Ok(msg) = rx.try_recv() {
                    let msg = msg.expect("no stream ends in this run");
                    e.inbox.push_back((now + DELAY_US, msg));
                }
            }
            while e.inbox.front().is_some_and(|(at, _)| *at <= now) {
                let (_, msg) = e.inbox.pop_front().expect("front");
                e.model.apply(&msg, now);
            }
            if now >= e.active_to_us {
                continue;
            }
            e.carry += e.demand * STEP_US as f64 / 1e6;
            while e.carry >= 1.0 {
                e.carry -= 1.0;
                let (ok, first) = e.model.request(&shared, now);
                if ok {
                    admitted += 1;
                    if now >= e.measure_from_us {
                        e.measured += 1;
                    }
                }
                if let Some(report) = first {
                    hub.report(id, report).await;
                }
            }
            if now >= e.next_report_us {
                e.next_report_us += REPORT_EVERY_US;
                let report = e.model.report(now);
                hub.report(id, report).await;
            }
        }
        // An RLS client of the same rule, 100 requests a second.
        let response = limiter.should_rate_limit(&rls_request).await.expect("decided");
        if response.overall_code == OK {
            admitted += 1;
            rls_admitted += 1;
        }
        if now >= next_tick {
            next_tick += RlqsSettings::default().assignment_period_ms.0 * 1_000;
            hub.tick().await;
        }
        let elapsed_us = now - START_US;
        let bound = CAPACITY + REFILL * elapsed_us / 1_000_000;
        assert!(
            admitted <= bound,
            "at {:.2} s: {admitted} admitted, over the bound {bound}",
            elapsed_us as f64 / 1e6
        );
    }
    let run_s = (end - START_US) as f64 / 1e6;
    let bound = CAPACITY as f64 + REFILL as f64 * run_s;
    eprintln!(
        "1,000 Envoys + RLS: {admitted} admitted of a bound of {bound} ({:.1}%), {rls_admitted} by the RLS client",
        100.0 * admitted as f64 / bound
    );
    assert!(admitted as f64 >= 0.8 * bound, "only {admitted} of {bound} used");

    // Fairness: the fair share of each demand is its max-min share of the refill the RLS
    // client leaves, among the fleet at its largest (1,000 Envoys, 20 s to 35 s excepted).
    let demands: Vec<u64> = (0..1_000).map(|i| (demand_of(i) * 1e6) as u64).collect();
    let fair = fair_split((REFILL - 100) * 1_000_000, &demands);
    let mut worst = (f64::MAX, 0.0);
    for (i, e) in fleet.iter().enumerate() {
        if e.active_to_us != end {
            continue;
        }
        let f = fair[if i < 1_000 { i } else { i - 100 }] as f64 / 1e6;
        let window = (measure_to - e.measure_from_us) as f64 / 1e6;
        let got = e.measured as f64 / window;
        if got / f < worst.0 {
            worst = (got / f, e.demand);
        }
    }
    eprintln!(
        "worst Envoy: {:.2} of its fair share (demand {:.1}/s)",
        worst.0, worst.1
    );
    assert!(
        worst.0 >= 0.5,
        "an Envoy of demand {:.1}/s got {:.2} of its fair share",
        worst.1,
        worst.0
    );
}

/// Two replicas on one store, one Envoy each, both wanting more than the bucket gives: the
/// total stays within the bound and uses most of it, and neither Envoy is starved.
#[tokio::test(flavor = "current_thread")]
async fn two_replicas_share_one_bucket() {
    let rules_yaml = "domain: fleet\ndescriptors:\n  - key: api_key\n    token_bucket: {capacity: 40, refill: 10/s}\n";
    let clock = ManualClock::new(START_US);
    let store = MemoryStore::new(4, 100_000, Arc::new(clock.clone()));
    let settings = RlqsSettings::default();
    let hubs: Vec<Arc<Hub<MemoryStore>>> = (0..2)
        .map(|_| {
            let limiter = Arc::new(Limiter::new(rules(rules_yaml), store.clone(), options()));
            Hub::with_clock(limiter, settings, Arc::new(clock.clone()))
        })
        .collect();
    let shared: Key = key(&[("api_key", "demo")]);
    let mut envoys = Vec::new();
    for hub in &hubs {
        let (tx, rx) = mpsc::channel(4_096);
        envoys.push((
            EnvoyModel::new("fleet", false),
            hub.open(tx).expect("stream"),
            rx,
            VecDeque::new(),
            0u64,
        ));
    }
    let period = settings.assignment_period_ms.0 * 1_000;
    let end = START_US + 30_000_000;
    let mut now = START_US;
    // Envoy b starts a second after a; the replicas' rounds are a quarter period apart.
    let starts = [START_US, START_US + 1_000_000];
    let ticks = [START_US + period, START_US + period + period / 4];
    let mut next_tick = ticks;
    let mut next_report = [START_US + REPORT_EVERY_US, START_US + 1_000_000 + REPORT_EVERY_US];
    while now < end {
        now += STEP_US;
        clock.set_us(now);
        for (r, (model, id, rx, inbox, admitted)) in envoys.iter_mut().enumerate() {
            while let Ok(msg) = rx.try_recv() {
                inbox.push_back((now + DELAY_US, msg.expect("no status")));
            }
            while inbox.front().is_some_and(|(at, _)| *at <= now) {
                let (_, msg) = inbox.pop_front().expect("front");
                model.apply(&msg, now);
            }
            // 40 requests a second each: two steps of every five.
            if now >= starts[r] && (now / STEP_US) % 5 < 2 {
                let (ok, first) = model.request(&shared, now);
                *admitted += u64::from(ok);
                if let Some(report) = first {
                    hubs[r].report(*id, report).await;
                }
            }
            if now >= next_report[r] {
                next_report[r] += REPORT_EVERY_US;
                let report = model.report(now);
                hubs[r].report(*id, report).await;
            }
            if now >= next_tick[r] {
                next_tick[r] += period;
                hubs[r].tick().await;
            }
        }
        let total: u64 = envoys.iter().map(|e| e.4).sum();
        let bound = 40 + 10 * (now - START_US) / 1_000_000;
        assert!(total <= bound, "{total} admitted over the bound {bound}");
    }
    let (a, b) = (envoys[0].4, envoys[1].4);
    eprintln!("two replicas: a {a}, b {b}, {} of a bound of 340", a + b);
    assert!(a + b >= 272, "only {} of 340 used (a {a}, b {b})", a + b);
    assert!(a.min(b) >= 60, "an Envoy starved: a {a}, b {b}");
}
