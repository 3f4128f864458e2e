//! A deterministic simulation of many replicas sharing one store through their local layers
//! ([`tollgate::store::local`]: the over-limit cache and token leases), on a simulated clock
//! and network, with store nodes failing and recovering. `tests/suite/simulation.rs` runs it
//! with 100 replicas and asserts what it checks; `benches/simulation.rs` runs it with 1,000
//! (benches/README.md, "Simulation"). Both include this file, so it uses nothing else of the
//! test support.
//!
//! **What is simulated.** One discrete-event loop: a binary heap of events ordered by
//! simulated time, ties broken by the order they were scheduled in, so a seed fixes
//! everything. Time is microseconds from a fixed epoch.
//! - *Replicas*: each has its own [`LocalLayer`] (`LocalSettings::default()`: the cache on,
//!   leases on, held a second; [`Config`] can say otherwise) and its own clock error, a fixed
//!   offset drawn in ±[`CLOCK_ERROR_US`] added to every `now_us` it gives the layer (its
//!   estimate of the store's clock; the cache's margin is
//!   [`tollgate::store::local::CLOCK_MARGIN_US`]). Every
//!   100 ms (a phase of its own) its upkeep gives back the leases whose hold ended
//!   (`due_returns`, then `returned` and a refund call, and `returned` again when that call is
//!   done), as `Local`'s upkeep task does, and sweeps the cache every 5 s. Lease orders
//!   (`take_orders`) go out as calls after every step of the layer, and their answers come
//!   back through `granted`; at the end every replica shuts down (`return_all`).
//! - *The store*: [`NODES`] store nodes, each a [`MemoryStore`], all on one [`ManualClock`] set
//!   to the simulated time whenever a node decides (the store's clock is the true time). A
//!   bucket lives on the node a hash of its key's tag picks (`{tag}name`, as Redis Cluster's
//!   hash tags): the two buckets of a request share a tag, so one node decides the request all
//!   or nothing.
//! - *The network*: every call (a request, a lease grant, a lease return) takes a one-way
//!   latency each way, drawn from a hash of the seed and the call's identity: 50-500 µs, and
//!   1 leg in 100 a slow one of up to [`MAX_ONE_WAY_US`]. So hundreds of calls are in flight
//!   at once and answers arrive out of order; a request's latencies are the same with the layer
//!   and without it.
//! - *Failures*: each node is down for 50-300 ms at a time, about once every 1.5 s (a seeded
//!   schedule; its state survives, as a paused or partitioned node's). A call reaching a down
//!   node fails with [`StoreError::Unavailable`]; a node going down while its answer is on the
//!   way loses the answer (the call decided, the caller sees the error). A failed request is
//!   counted denied (`failure_mode: deny`); a failed lease call leaves the tokens it debited
//!   with nobody (an under-admission).
//! - *Traffic* (its own seeded generator, so it is the same with and without the layer):
//!   Poisson arrivals, 200 a second per replica, 2.5 times that in the middle third of the run:
//!   35% on the global bucket (1 hit, 1 in 10 asks 3); 20% on a tenant's bucket and its
//!   client's together (all or nothing), 15% on a tenant's alone; 19.5% flooding a small
//!   exhausted bucket; 8% on a client's bucket alone (2 or 5 hits); 2% refunds of a hit (on a
//!   client's bucket, or a tenant's); 0.5% from a client that talks to one replica only and
//!   asks more than it refills, a fifth of them refunds it retries 10 µs later (a retry that
//!   overtakes its refund in the network). Clients are skewed (client `floor(M u^2)` of
//!   `M` = 5 per replica): a few exhaust their buckets, most do not; 70% of a client's requests
//!   reach its own replica, the rest any. The global bucket (lease 16) has room at the base
//!   rate and is scarce in the burst; the tenants' (lease 8) likewise; the others have no
//!   lease.
//!
//! One thing is arranged for determinism: a replica sends a refund or a lease return, and
//! hands a refund's answer or a return's end to its layer, only when no other of its requests
//! awaits the store (at most a round trip later). Those steps move the cache's epoch of the
//! bucket's shard (a shard of a random hash of the key), so an answer then on its way for
//! another bucket of the same shard would not be learnt: which buckets share a shard changes
//! with the hash key, drawn afresh by every layer, and two runs of one seed would differ.
//!
//! **What is checked.** Every bucket keeps a log of what took or gave its tokens, each at the
//! instant it happened: a store debit at the store's decision, a client's admission at the
//! instant its tokens were taken (the store's decision for a bucket the store decided, the
//! replica's spending of leased tokens for a bucket a lease served), a refund or a lease
//! return when the store credited it, a lease grant when the store debited it.
//! - (a) *Never over-admits*: over every window `[s, e]`, the hits admitted to clients satisfy
//!   `admitted <= capacity + refill x (e - s) + refunds credited in [s, e] + leased(s)`,
//!   where `leased(s)` is the slack `store/local/lease.rs` promises: the tokens leased and
//!   unspent at the window's start, counting grants and returns on their way (debited by the
//!   store, not yet spent nor credited back). It holds exactly: the store held at most its
//!   capacity at `s`, gained at most the refill, the refunds and the returns, and every hit
//!   admitted came out of the store or out of a lease. Counting an admission at the instant
//!   its tokens were taken makes the check exact, whatever the latencies; a client hears of it
//!   up to one one-way latency later, so over windows of answer instants the same bound holds
//!   with the window widened by [`MAX_ONE_WAY_US`] at its start (its refill, refunds and
//!   leases from there). Windows are checked all at once, in one pass per bucket over its log
//!   in time order ([`check_windows`]: O(n), not O(n^2)). Also: leased tokens never go below
//!   zero, per replica (the layer never spends a leased token it was not granted) and per
//!   bucket; what each layer says it holds (`leased_ut`) is always what the simulation counted
//!   it was granted, less what it spent and gave back; no replica ever holds more than its
//!   `lease` of a bucket, tokens reserved by requests being decided included; and after the
//!   shutdown nothing is held anywhere.
//! - (b) *The store never over-admits*: the same windows over the store's own debits (requests
//!   and lease grants) with its credits (refunds, returns) and no slack; and no node evicted a
//!   bucket that was not full.
//! - (c) *Local denials*: each is compared with the store's own state at that instant: would
//!   the store have passed every demand the cache failed? If so it is *contrary*, and it must be
//!   explained by what the module docs allow: a credit (a refund or a lease return) the store
//!   applied to the bucket since the state the cache denied on (whose instant the denial's
//!   answer shows), from another replica, or from this one while its answer is not back (a
//!   request sent after the refund overtook it); or the replica's clock: its estimate behind
//!   the store's, and the cached state, refilled to the true instant, passing (a denial within
//!   the margin while a probe is awaited). Any other contrary denial is a failure, among them
//!   one on a state older than this replica's own refund once that refund's answer is back.
//! - (d) *Under-admission*: the same traffic with no layer (every request to the store): the
//!   hits admitted per bucket both ways and the difference, store calls per request, local
//!   denials, lease admissions. What the layer costs: leased tokens unspent (at most `lease`
//!   per replica holding one, back at the hold's end), tokens lost with failed lease calls or
//!   capped when a return found the bucket full, and contrary local denials; what it gains: a
//!   lease keeps admitting while its bucket's node is down.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tollgate::core::bucket::{Demand, DemandKind, Limit, Rate, Refilling, MICRO};
use tollgate::core::clock::ManualClock;
use tollgate::core::schedule::Plan;
use tollgate::store::local::{
    lease_demand, return_demand, Ask, LeaseOrder, LeaseReturn, LocalLayer, LocalSettings, Route,
};
use tollgate::store::{Applied, BucketRef, Cause, MemoryStore, StoreError};

/// The simulated clock's origin (store time, microseconds since the epoch).
const T0: u64 = 1_780_000_000_000_000;
const SECOND: u64 = 1_000_000;
/// Store nodes.
pub const NODES: usize = 3;
/// The fastest and slowest ordinary one-way latency, in microseconds.
const LATENCY_US: (u64, u64) = (50, 500);
/// The slowest one-way latency (1 leg in 100), in microseconds.
pub const MAX_ONE_WAY_US: u64 = 2_000;
/// A replica's clock error is a fixed offset within ± this, in microseconds, unless the
/// [`Config`] says otherwise.
pub const CLOCK_ERROR_US: i64 = 400;
/// The replicas' upkeep period (`Local`'s), and how many ticks between cache sweeps.
const UPKEEP_US: u64 = 100_000;
const SWEEP_EVERY_TICKS: u32 = 50;
/// Node outages: about one every this long per node, each lasting within this range.
const MEAN_UP_US: f64 = 1.5e6;
const OUTAGE_US: (u64, u64) = (50_000, 300_000);
const TENANTS: usize = 4;
const CLIENTS_PER_REPLICA: usize = 5;
/// How long after its refund the refunding client retries, in microseconds.
const RETRY_US: u64 = 10;
/// The share of a client's requests that reach its own replica.
const STICKY: f64 = 0.7;
/// The middle third of a run has this many times the base arrival rate.
const BURST: f64 = 2.5;

/// One simulation run.
#[derive(Clone, Debug)]
pub struct Config {
    pub seed: u64,
    pub replicas: usize,
    /// How long clients send requests (the run then drains and shuts the replicas down).
    pub duration_us: u64,
    /// Client requests a second per replica at the base rate.
    pub rate_per_replica: f64,
    /// Whether the replicas decide through their local layers (else every request goes to the
    /// store).
    pub local: bool,
    /// A broken replica, to show that the checks catch one: every n-th request on the flooded
    /// bucket is admitted with no tokens from anywhere (0: none).
    pub over_admit_every: u64,
    /// Every replica's layer's settings.
    pub settings: LocalSettings,
    /// A replica's clock error is a fixed offset within ± this, in microseconds.
    pub clock_error_us: i64,
}

impl Config {
    /// `replicas` replicas with their layers, for `duration_us` of traffic.
    pub fn new(seed: u64, replicas: usize, duration_us: u64) -> Config {
        Config {
            seed,
            replicas,
            duration_us,
            rate_per_replica: 200.0,
            local: true,
            over_admit_every: 0,
            settings: LocalSettings::default(),
            clock_error_us: CLOCK_ERROR_US,
        }
    }

    /// The same run with no local layer.
    pub fn without_layer(&self) -> Config {
        Config {
            local: false,
            ..self.clone()
        }
    }
}

/// The kinds of buckets, one row each in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Global,
    Tenant,
    Client,
    Flood,
    Refunder,
}

const KINDS: [(Kind, &str); 5] = [
    (Kind::Global, "global"),
    (Kind::Tenant, "tenant"),
    (Kind::Client, "client"),
    (Kind::Flood, "flood"),
    (Kind::Refunder, "refunder"),
];

struct Spec {
    kind: Kind,
    capacity: u64,
    per_second: u64,
    lease: u64,
    node: usize,
    bucket: BucketRef,
}

const GLOBAL: usize = 0;
const FLOOD: usize = 1;
const REFUNDER: usize = 2;
const FIRST_TENANT: usize = 3;
const FIRST_CLIENT: usize = FIRST_TENANT + TENANTS;

/// FNV-1a: a stable hash for node placement and the event digest.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The buckets of a run, sized to its traffic (`lambda`: base requests a second in all).
fn buckets(replicas: usize, lambda: f64) -> Vec<Spec> {
    let spec = |kind, tag: &str, name: &str, capacity: u64, per_second: u64, lease: u64| {
        let key = format!("{{{tag}}}{name}");
        Spec {
            kind,
            capacity,
            per_second,
            lease,
            node: (fnv(FNV_START, tag.as_bytes()) % NODES as u64) as usize,
            bucket: BucketRef {
                plan: Plan::Fixed(Limit::new(capacity, Rate::per(per_second, SECOND).unwrap())),
                lease_ut: lease * MICRO,
                key,
            },
        }
    };
    // The global bucket: 0.42 x lambda tokens a second asked at the base rate (35% of the
    // requests, 1.2 hits each), 0.5 x lambda refilled: room to lease, until the burst asks
    // twice the refill.
    let mut all = vec![
        spec(
            Kind::Global,
            "global",
            "api",
            ((lambda * 0.1) as u64).max(100),
            ((lambda * 0.5) as u64).max(10),
            16,
        ),
        spec(Kind::Flood, "flood", "scraper", 10, 20, 0),
        // A client that talks to one replica: it asks more than it refills, and 1 request in 5
        // gives back a hit its upstream did not use and retries at once (10 µs later).
        spec(Kind::Refunder, "refunder", "client", 5, 5, 0),
    ];
    // A tenant: up to 0.35 x lambda / TENANTS hits a second asked at the base rate (35% of
    // the requests, 20 points of them with a client, whose bucket denies some), 0.08 x lambda
    // refilled: room at the base rate, scarce in the burst.
    for k in 0..TENANTS {
        all.push(spec(
            Kind::Tenant,
            &format!("t{k}"),
            "tenant",
            ((lambda * 0.1) as u64).max(50),
            ((lambda * 0.08) as u64).max(10),
            8,
        ));
    }
    for i in 0..replicas * CLIENTS_PER_REPLICA {
        all.push(spec(
            Kind::Client,
            &format!("t{}", i % TENANTS),
            &format!("client-{i}"),
            20,
            10,
            0,
        ));
    }
    all
}

/// A client request: bucket indices and the demands on them.
struct Request {
    id: u64,
    replica: usize,
    buckets: Vec<usize>,
    demands: Vec<Demand>,
    refund: bool,
    /// A refund its client follows with a retry at once.
    retried: bool,
}

/// The client traffic: its own generator, so it is the same whatever the store answers.
struct Traffic {
    rng: SmallRng,
    next_id: u64,
    lambda: f64,
    duration_us: u64,
    replicas: usize,
    clients: usize,
}

fn consume(instance: usize, hits: u64) -> Demand {
    Demand {
        instance,
        kind: DemandKind::Consume(hits * MICRO),
        enforced: true,
    }
}

impl Traffic {
    /// Microseconds to the next arrival after `t` (relative to the start).
    fn gap(&mut self, t: u64) -> u64 {
        let third = self.duration_us / 3;
        let burst = if (third..2 * third).contains(&t) { BURST } else { 1.0 };
        let per_us = self.lambda * burst / SECOND as f64;
        let u: f64 = self.rng.random();
        (-(1.0 - u).ln() / per_us) as u64
    }

    /// A client (skewed: a few send most), and the replica its request reaches: mostly its
    /// own (`c mod replicas`, as an Envoy keeps its connection), any other else.
    fn client(&mut self, replica: &mut usize) -> usize {
        let u: f64 = self.rng.random();
        let c = ((self.clients as f64 * u * u) as usize).min(self.clients - 1);
        if self.rng.random::<f64>() < STICKY {
            *replica = c % self.replicas;
        }
        c
    }

    fn request(&mut self) -> Request {
        let id = self.next_id;
        self.next_id += 1;
        let mut replica = self.rng.random_range(0..self.replicas);
        let x: f64 = self.rng.random();
        let (buckets, demands, refund) = if x < 0.35 {
            let hits = if self.rng.random::<f64>() < 0.1 { 3 } else { 1 };
            (vec![GLOBAL], vec![consume(0, hits)], false)
        } else if x < 0.55 {
            let c = self.client(&mut replica);
            (
                vec![FIRST_TENANT + c % TENANTS, FIRST_CLIENT + c],
                vec![consume(0, 1), consume(1, 1)],
                false,
            )
        } else if x < 0.70 {
            let c = self.client(&mut replica);
            (vec![FIRST_TENANT + c % TENANTS], vec![consume(0, 1)], false)
        } else if x < 0.895 {
            (vec![FLOOD], vec![consume(0, 1)], false)
        } else if x < 0.90 {
            // The last replica: the one the skewed clients reach least.
            replica = self.replicas - 1;
            if self.rng.random::<f64>() < 0.2 {
                (vec![REFUNDER], vec![refund(0)], true)
            } else {
                (vec![REFUNDER], vec![consume(0, 1)], false)
            }
        } else if x < 0.98 {
            let c = self.client(&mut replica);
            let hits = if self.rng.random::<f64>() < 0.7 { 2 } else { 5 };
            (vec![FIRST_CLIENT + c], vec![consume(0, hits)], false)
        } else {
            let c = self.client(&mut replica);
            let b = if self.rng.random::<f64>() < 0.8 {
                FIRST_CLIENT + c
            } else {
                FIRST_TENANT + c % TENANTS
            };
            (vec![b], vec![refund(0)], true)
        };
        let retried = refund && buckets == [REFUNDER];
        Request {
            id,
            replica,
            buckets,
            demands,
            refund,
            retried,
        }
    }

    /// The request that retries `refunded` (the refunding client's, after its upstream
    /// failed).
    fn retry(&mut self, refunded: &Request) -> Request {
        let id = self.next_id;
        self.next_id += 1;
        Request {
            id,
            replica: refunded.replica,
            buckets: refunded.buckets.clone(),
            demands: vec![consume(0, 1)],
            refund: false,
            retried: false,
        }
    }
}

/// A refund of one hit (`is_negative_hits`).
fn refund(instance: usize) -> Demand {
    Demand {
        instance,
        kind: DemandKind::Refund(MICRO),
        enforced: false,
    }
}

/// What a request consumes from its instance `i`, in micro-tokens.
fn consumption(demands: &[Demand], i: usize) -> u64 {
    demands
        .iter()
        .filter(|d| d.instance == i)
        .map(|d| match d.kind {
            DemandKind::Consume(n) => n,
            _ => 0,
        })
        .sum()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival,
    /// The retry that follows a refund of the refunding client.
    Retry,
    AtNode(usize),
    Reply(usize),
    Upkeep(usize),
}

/// A request on its way to the store and back.
struct InFlight {
    req: Request,
    refs: Vec<BucketRef>,
    /// The layer's ask (none without the layer: the whole request goes).
    ask: Option<Box<Ask>>,
    /// The buckets the store decides (the rest were served by leases).
    store_part: Vec<usize>,
    /// What the store took, per bucket: (bucket, instant, order, micro-tokens).
    takes: Vec<(usize, u64, u64, u64)>,
    /// A refund's credit, if the store made it: (bucket, index in its credits).
    credit: Option<(usize, usize)>,
}

enum What {
    Request(Box<InFlight>),
    Grant(LeaseOrder, usize),
    Return(LeaseReturn, usize),
}

struct Call {
    replica: usize,
    node: usize,
    back_us: u64,
    what: What,
    answer: Option<Result<Applied, StoreError>>,
    /// A grant the store debited (whether or not its answer arrives).
    debited: bool,
    /// A return the store credited: (bucket, index in its credits).
    credit: Option<(usize, usize)>,
}

/// What took or gave a bucket's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ev {
    /// Hits admitted to a client (taken by the store or spent from a lease).
    Admit,
    /// The store took tokens (a request or a lease grant).
    Debit,
    /// The store credited a client's refund.
    Refund,
    /// The store credited a lease return.
    ReturnCredit,
    /// Tokens leased (debited for a lease), and leased tokens spent, given back or lost.
    LeaseUp,
    LeaseDown,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    t: u64,
    order: u64,
    ev: Ev,
    ut: u64,
}

/// Work a replica holds back while one of its requests awaits the store (module docs).
enum Pending {
    /// A client's refund, to route.
    Refund(Request),
    /// A lease return, to send (`returned`, then the call).
    Return(LeaseReturn),
    /// A lease return's answer is back (`returned` again); its credit, if it was made.
    Returned(LeaseReturn, Option<(usize, usize)>),
}

struct Replica {
    layer: Option<LocalLayer>,
    offset_us: i64,
    /// Requests awaiting the store through the layer.
    asks: u32,
    pending: VecDeque<Pending>,
    /// A refund's answer, held until it is the only request awaiting the store.
    deferred: Option<(InFlight, Result<Applied, StoreError>)>,
    upkeep_due: bool,
    ticks: u32,
    lease_calls: u64,
    /// Leased tokens held, per leased bucket, as counted here.
    held: Vec<i64>,
}

/// Local denials the store would not have made at that instant, by what explains them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Contrary {
    /// A refund or return from another replica reached the store since the cached state.
    pub elsewhere: u64,
    /// A refund or return from this replica reached the store, and its answer is not back: a
    /// request sent after it, decided before it, answered with the bucket short of it.
    pub own_refund: u64,
    /// The replica's estimate was behind the store's clock, within the margin.
    pub clock: u64,
    /// None of these: a failure.
    pub unexplained: u64,
}

/// Per kind of bucket, added up over its buckets.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub name: &'static str,
    pub buckets: usize,
    pub capacity: u64,
    pub per_second: u64,
    pub lease: u64,
    pub admitted_ut: u64,
    pub leased_spent_ut: u64,
    pub local_denials: u64,
    /// The tightest window of check (a) and of check (b), micro-tokens to spare.
    pub margin_a_ut: Option<i128>,
    pub margin_b_ut: Option<i128>,
    pub over_a: u64,
    pub over_b: u64,
    /// The most tokens leased and unspent at once (one bucket, all replicas).
    pub peak_leased_ut: i64,
    /// Lost with failed lease calls (a grant whose answer was lost, a return that failed).
    pub lost_ut: u64,
    /// Returned to a bucket too full to take them all (capped at its capacity).
    pub capped_ut: u64,
}

/// What a run did and found.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub replicas: usize,
    pub duration_us: u64,
    pub requests: u64,
    pub refunds: u64,
    pub admitted: u64,
    pub denied_by_store: u64,
    pub failed: u64,
    pub local_denials: u64,
    pub local_agreeing: u64,
    pub contrary: Contrary,
    pub lease_admissions: u64,
    pub request_calls: u64,
    pub grant_calls: u64,
    pub return_calls: u64,
    pub failed_calls: u64,
    pub outages: usize,
    pub outage_us: u64,
    pub max_in_flight: usize,
    /// The most leased tokens one replica held of one bucket, over the bucket's lease.
    pub max_held_over_lease: f64,
    pub rows: Vec<Row>,
    /// Everything checked that did not hold (empty when all did).
    pub violations: Vec<String>,
    /// A digest of every event and decision, in order.
    pub digest: u64,
    pub wall: Duration,
}

/// A step of a bucket's log as [`check_windows`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Tokens taken (admitted): bounded.
    Take(u64),
    /// Tokens credited to the bucket (refunds): they raise the bound from then on.
    Credit(u64),
    /// The slack allowed at a window's start moves by this much (leased and unspent tokens).
    Slack(i64),
}

/// What [`check_windows`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Windows {
    /// The smallest room left by any window (micro-tokens; negative: over the bound), and that
    /// window: its start and end (microseconds from the run's start) and what it took.
    pub worst: Option<(i128, u64, u64, u64)>,
    /// Windows ending at an admission that passed the bound (each end counted once).
    pub over: u64,
    /// Steps that left the slack below zero.
    pub negative_slack: u64,
    pub peak_slack_ut: i64,
    pub final_slack_ut: i64,
}

/// Checks `taken in [s, e] <= capacity + rate x (e - s) + credits in [s, e] + slack(s)` for
/// every window of `steps` (instants in microseconds, in the order they happened; `rate` in
/// micro-tokens a microsecond, exact: refills here are whole tokens a second).
///
/// One pass: written as `(taken_e - rate e - credits_e) - (taken_<s - rate s - credits_<s +
/// slack_<s) <= capacity` (totals before `s`, and up to `e`), the tightest start for an end
/// is the one with the smallest second term, a running minimum. A window can start anywhere,
/// but between two logged instants the bound only grows as the start moves earlier (more
/// refill and credits, the same slack), so starts at logged instants are every case; ends
/// likewise at admissions.
pub fn check_windows(steps: impl IntoIterator<Item = (u64, Step)>, capacity_ut: u64, rate_ut_per_us: u64) -> Windows {
    let (rate, capacity) = (i128::from(rate_ut_per_us), i128::from(capacity_ut));
    let (mut taken, mut credits, mut slack) = (0i128, 0i128, 0i128);
    // The best start so far: its term, instant, and the tokens taken before it.
    let mut best: Option<(i128, u64, i128)> = None;
    let mut w = Windows::default();
    for (t, step) in steps {
        let start = taken - rate * i128::from(t) - credits + slack;
        if best.is_none_or(|(b, ..)| start < b) {
            best = Some((start, t, taken));
        }
        match step {
            Step::Take(ut) => {
                taken += i128::from(ut);
                let (b, from, before) = best.expect("a start at or before every end");
                let room = capacity + b - (taken - rate * i128::from(t) - credits);
                if room < 0 {
                    w.over += 1;
                }
                if w.worst.is_none_or(|(r, ..)| room < r) {
                    w.worst = Some((room, from, t, (taken - before) as u64));
                }
            }
            Step::Credit(ut) => credits += i128::from(ut),
            Step::Slack(d) => {
                slack += i128::from(d);
                if slack < 0 {
                    w.negative_slack += 1;
                }
                w.peak_slack_ut = w.peak_slack_ut.max(slack as i64);
            }
        }
    }
    w.final_slack_ut = slack as i64;
    w
}

struct Sim {
    cfg: Config,
    specs: Vec<Spec>,
    index: HashMap<String, usize>,
    clock: ManualClock,
    nodes: Vec<MemoryStore>,
    outages: Vec<Vec<(u64, u64)>>,
    replicas: Vec<Replica>,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    scheduled: u64,
    now: u64,
    end: u64,
    calls: Vec<Option<Call>>,
    free: Vec<usize>,
    in_flight: usize,
    traffic: Traffic,
    /// Retries on their way, in the order they were sent.
    retries: VecDeque<Request>,
    /// Per bucket, what took or gave its tokens.
    log: Vec<Vec<Entry>>,
    /// The order of logged steps (ties of instants).
    order: u64,
    /// Per bucket, the credits the store applied: (instant, replica, when that replica's layer
    /// was told the call was done; `u64::MAX` until then).
    credits: Vec<Vec<(u64, usize, u64)>>,
    admitted_ut: Vec<u64>,
    leased_spent_ut: Vec<u64>,
    local_denials_by: Vec<u64>,
    lost_ut: Vec<u64>,
    capped_ut: Vec<u64>,
    out: Outcome,
}

fn unavailable(why: &str) -> StoreError {
    StoreError::Unavailable(Cause::from(why))
}

impl Sim {
    fn new(cfg: &Config) -> Sim {
        let lambda = cfg.replicas as f64 * cfg.rate_per_replica;
        let specs = buckets(cfg.replicas, lambda);
        let index = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.bucket.key.clone(), i))
            .collect();
        let clock = ManualClock::new(T0);
        let nodes = (0..NODES)
            .map(|_| MemoryStore::new(16, 1 << 24, Arc::new(clock.clone())))
            .collect();
        let mut fail = SmallRng::seed_from_u64(cfg.seed ^ 0x6661_696c);
        let outages = (0..NODES)
            .map(|_| {
                let mut t = 0u64;
                let mut down = Vec::new();
                loop {
                    let u: f64 = fail.random();
                    t += (-(1.0 - u).ln() * MEAN_UP_US) as u64;
                    if t >= cfg.duration_us {
                        return down;
                    }
                    let len = fail.random_range(OUTAGE_US.0..=OUTAGE_US.1);
                    down.push((T0 + t, T0 + t + len));
                    t += len;
                }
            })
            .collect::<Vec<_>>();
        let mut rep = SmallRng::seed_from_u64(cfg.seed ^ 0x7265_706c);
        let replicas = (0..cfg.replicas)
            .map(|_| Replica {
                layer: cfg.local.then(|| LocalLayer::new(&cfg.settings)),
                offset_us: rep.random_range(-cfg.clock_error_us..=cfg.clock_error_us),
                asks: 0,
                pending: VecDeque::new(),
                deferred: None,
                upkeep_due: false,
                ticks: 0,
                lease_calls: 0,
                held: vec![0; FIRST_CLIENT],
            })
            .collect();
        let n = specs.len();
        let mut out = Outcome {
            replicas: cfg.replicas,
            duration_us: cfg.duration_us,
            ..Outcome::default()
        };
        out.outages = outages.iter().map(Vec::len).sum();
        out.outage_us = outages.iter().flatten().map(|(a, b)| b - a).sum();
        out.digest = FNV_START;
        let mut sim = Sim {
            cfg: cfg.clone(),
            specs,
            index,
            clock,
            nodes,
            outages,
            replicas,
            queue: BinaryHeap::new(),
            scheduled: 0,
            now: T0,
            end: T0 + cfg.duration_us,
            calls: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            traffic: Traffic {
                rng: SmallRng::seed_from_u64(cfg.seed),
                next_id: 0,
                lambda,
                duration_us: cfg.duration_us,
                replicas: cfg.replicas,
                clients: cfg.replicas * CLIENTS_PER_REPLICA,
            },
            retries: VecDeque::new(),
            log: vec![Vec::new(); n],
            order: 0,
            credits: vec![Vec::new(); n],
            admitted_ut: vec![0; n],
            leased_spent_ut: vec![0; n],
            local_denials_by: vec![0; n],
            lost_ut: vec![0; n],
            capped_ut: vec![0; n],
            out,
        };
        let first = sim.traffic.gap(0);
        sim.schedule(T0 + first, Event::Arrival);
        if cfg.local {
            for r in 0..cfg.replicas {
                let phase = rep.random_range(0..UPKEEP_US);
                sim.schedule(T0 + phase, Event::Upkeep(r));
            }
        }
        sim
    }

    fn schedule(&mut self, at: u64, event: Event) {
        self.scheduled += 1;
        self.queue.push(Reverse((at, self.scheduled, event)));
    }

    fn note(&mut self, values: &[u64]) {
        for v in values {
            self.out.digest = fnv(self.out.digest, &v.to_le_bytes());
        }
    }

    fn violation(&mut self, what: String) {
        if self.out.violations.len() < 20 {
            self.out.violations.push(what);
        } else if self.out.violations.len() == 20 {
            self.out.violations.push("(and more)".into());
        }
    }

    fn log(&mut self, b: usize, t: u64, order: u64, ev: Ev, ut: u64) {
        self.log[b].push(Entry { t, order, ev, ut });
    }

    fn next_order(&mut self) -> u64 {
        self.order += 1;
        self.order
    }

    /// Logs `ut` admitted to a client on bucket `b`, taken at (`t`, `order`).
    fn admit(&mut self, b: usize, t: u64, order: u64, ut: u64) {
        self.log(b, t, order, Ev::Admit, ut);
        self.admitted_ut[b] += ut;
    }

    /// Replica `r` spent `ut` leased tokens of `b` on an admitted request, now.
    fn spend_lease(&mut self, r: usize, b: usize, ut: u64) {
        let (t, o) = (self.now, self.next_order());
        // The admission first: the slack at a window starting here still holds these tokens.
        self.admit(b, t, o, ut);
        let o = self.next_order();
        self.log(b, t, o, Ev::LeaseDown, ut);
        self.leased_spent_ut[b] += ut;
        let held = &mut self.replicas[r].held[b];
        *held -= ut as i64;
        if *held < 0 {
            let h = *held;
            self.violation(format!(
                "replica {r} spent leased tokens of {} it was not granted ({h} µt)",
                self.specs[b].bucket.key
            ));
        }
    }

    fn estimate(&self, r: usize) -> u64 {
        self.now.saturating_add_signed(self.replicas[r].offset_us)
    }

    fn down(&self, node: usize, t: u64) -> bool {
        self.outages[node].iter().any(|&(a, b)| a <= t && t < b)
    }

    fn goes_down(&self, node: usize, from: u64, to: u64) -> bool {
        self.outages[node].iter().any(|&(a, _)| from < a && a <= to)
    }

    fn latency(&self, id: u64, leg: u64) -> u64 {
        let h = mix(self.cfg.seed ^ mix(id ^ (leg << 62)));
        if h.is_multiple_of(100) {
            LATENCY_US.1 + (h >> 8) % (MAX_ONE_WAY_US - LATENCY_US.1 + 1)
        } else {
            LATENCY_US.0 + (h >> 8) % (LATENCY_US.1 - LATENCY_US.0 + 1)
        }
    }

    fn send(&mut self, replica: usize, node: usize, identity: u64, what: What) {
        let (out, back_us) = (self.latency(identity, 0), self.latency(identity, 1));
        let call = Call {
            replica,
            node,
            back_us,
            what,
            answer: None,
            debited: false,
            credit: None,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.calls[id] = Some(call);
                id
            }
            None => {
                self.calls.push(Some(call));
                self.calls.len() - 1
            }
        };
        self.in_flight += 1;
        self.out.max_in_flight = self.out.max_in_flight.max(self.in_flight);
        self.schedule(self.now + out, Event::AtNode(id));
    }

    fn lease_identity(&mut self, r: usize) -> u64 {
        let rep = &mut self.replicas[r];
        rep.lease_calls += 1;
        (1 << 63) | ((r as u64) << 32) | rep.lease_calls
    }

    fn refs(&self, buckets: &[usize]) -> Vec<BucketRef> {
        buckets.iter().map(|&b| self.specs[b].bucket.clone()).collect()
    }

    fn run(&mut self) {
        while let Some(Reverse((t, _, event))) = self.queue.pop() {
            self.now = t;
            match event {
                Event::Arrival => self.arrival(),
                Event::AtNode(id) => self.at_node(id),
                Event::Reply(id) => self.reply(id),
                Event::Upkeep(r) => self.upkeep(r),
                Event::Retry => {
                    let req = self.retries.pop_front().expect("a retry");
                    self.note(&[self.now, req.id]);
                    self.out.requests += 1;
                    self.dispatch(req);
                }
            }
        }
    }

    fn arrival(&mut self) {
        let req = self.traffic.request();
        let gap = self.traffic.gap(self.now - T0);
        if self.now + gap < self.end {
            self.schedule(self.now + gap, Event::Arrival);
        }
        self.out.requests += 1;
        if req.refund {
            self.out.refunds += 1;
        }
        self.note(&[self.now, req.id, req.replica as u64]);
        if req.retried {
            let retry = self.traffic.retry(&req);
            self.retries.push_back(retry);
            self.schedule(self.now + RETRY_US, Event::Retry);
        }
        self.dispatch(req);
    }

    /// A client's request reaches its replica.
    fn dispatch(&mut self, req: Request) {
        let r = req.replica;
        let n = self.cfg.over_admit_every;
        if n > 0 && req.buckets == [FLOOD] && req.id.is_multiple_of(n) {
            let (t, o) = (self.now, self.next_order());
            self.admit(FLOOD, t, o, consumption(&req.demands, 0));
            self.out.admitted += 1;
            return;
        }
        if !self.cfg.local {
            let node = self.specs[req.buckets[0]].node;
            let refs = self.refs(&req.buckets);
            let store_part = req.buckets.clone();
            let id = req.id;
            self.out.request_calls += 1;
            let fl = InFlight {
                req,
                refs,
                ask: None,
                store_part,
                takes: Vec::new(),
                credit: None,
            };
            self.send(r, node, id, What::Request(Box::new(fl)));
            return;
        }
        let rep = &mut self.replicas[r];
        if req.refund && (rep.asks > 0 || !rep.pending.is_empty()) {
            rep.pending.push_back(Pending::Refund(req));
            return;
        }
        self.route(req);
    }

    /// A request through replica `r`'s layer.
    fn route(&mut self, req: Request) {
        let r = req.replica;
        let refs = self.refs(&req.buckets);
        let t_est = self.estimate(r);
        let route = self.replicas[r]
            .layer
            .as_ref()
            .expect("a layer")
            .route(&refs, &req.demands, t_est);
        match route {
            Route::Local(applied) if applied.decision.denied => {
                self.note(&[1]);
                self.local_denial(&req, &refs, &applied);
            }
            Route::Local(_) => {
                self.note(&[2]);
                // Wholly on leases: every bucket of the request was served by one.
                for (i, &b) in req.buckets.iter().enumerate() {
                    if self.specs[b].lease == 0 {
                        self.violation(format!(
                            "admitted locally on {}, which has no lease",
                            self.specs[b].bucket.key
                        ));
                    }
                    self.spend_lease(r, b, consumption(&req.demands, i));
                }
                self.out.lease_admissions += 1;
                self.out.admitted += 1;
            }
            Route::Store(ask) => {
                let (sent, _) = ask.request(&refs, &req.demands);
                let store_part: Vec<usize> = sent.iter().map(|b| self.index[&b.key]).collect();
                let node = self.specs[store_part[0]].node;
                let id = req.id;
                self.replicas[r].asks += 1;
                self.out.request_calls += 1;
                let fl = InFlight {
                    req,
                    refs,
                    ask: Some(ask),
                    store_part,
                    takes: Vec::new(),
                    credit: None,
                };
                self.send(r, node, id, What::Request(Box::new(fl)));
            }
        }
        self.settle(r);
    }

    /// A request replica `r`'s layer denied itself: compared with the store at this instant.
    fn local_denial(&mut self, req: &Request, refs: &[BucketRef], applied: &Applied) {
        let r = req.replica;
        self.out.local_denials += 1;
        self.clock.set_us(self.now);
        let (mut contrary, mut failed) = (true, false);
        let (mut elsewhere, mut own, mut own_answered, mut cached_passes) = (false, false, false, true);
        for (j, d) in req.demands.iter().enumerate() {
            if applied.decision.passed[j] || !d.enforced {
                continue;
            }
            failed = true;
            let b = req.buckets[d.instance];
            self.local_denials_by[b] += 1;
            let need = d.kind.need_ut(consumption(&req.demands, d.instance)).unwrap_or(0);
            let node = self.specs[b].node;
            let held = self.nodes[node].peek_now(std::slice::from_ref(&refs[d.instance]));
            if held.states[0].tokens_ut < need {
                contrary = false;
                continue;
            }
            // The state the cache denied on, and whether anything was credited since.
            let cached = applied.decision.instances[d.instance].stored;
            for &(at, by, told) in self.credits[b].iter().rev() {
                if at < cached.updated_us {
                    break;
                }
                if by != r {
                    elsewhere = true;
                } else if told <= self.now && at > cached.updated_us {
                    // This replica's own refund, answered already: the layer forgot every
                    // state from before it then, and learns none since. (A credit at the very
                    // microsecond of the cached state may be in it: not counted.)
                    own_answered = true;
                } else {
                    own = true;
                }
            }
            if refs[d.instance].plan.refill_to(cached, self.now).tokens_ut < need {
                cached_passes = false;
            }
        }
        if !failed {
            self.violation(format!("request {} denied locally with every demand passing", req.id));
        }
        if !contrary {
            self.out.local_agreeing += 1;
            return;
        }
        let c = &mut self.out.contrary;
        if elsewhere {
            c.elsewhere += 1;
        } else if own {
            c.own_refund += 1;
        } else if own_answered {
            c.unexplained += 1;
            let t = self.now - T0;
            self.violation(format!(
                "request {} denied locally at {t} µs on replica {r} on a state from before its own refund, whose answer was back",
                req.id
            ));
        } else if cached_passes && self.replicas[r].offset_us < 0 {
            c.clock += 1;
        } else {
            c.unexplained += 1;
            let (t, off) = (self.now - T0, self.replicas[r].offset_us);
            self.violation(format!(
                "request {} denied locally at {t} µs on replica {r} (clock {off:+} µs): the store held enough, and no credit nor the clock explains it",
                req.id
            ));
        }
    }

    /// After replica `r`'s layer did something: the lease calls it ordered go out, and what
    /// it says it holds is what was counted here.
    fn settle(&mut self, r: usize) {
        let Some(layer) = self.replicas[r].layer.as_ref() else {
            return;
        };
        let orders = layer.take_orders();
        let said = layer.leased_ut();
        let counted: i64 = self.replicas[r].held.iter().sum();
        if counted < 0 || said != counted as u64 {
            self.violation(format!(
                "replica {r} says it holds {said} leased µt, {counted} counted at {} µs",
                self.now - T0
            ));
        }
        for order in orders {
            let b = self.index[&order.bucket.key];
            let node = self.specs[b].node;
            let id = self.lease_identity(r);
            self.out.grant_calls += 1;
            self.send(r, node, id, What::Grant(order, b));
        }
    }

    /// Replica `r` gives `ret` back (already out of what it holds).
    fn give_back(&mut self, r: usize, ret: LeaseReturn) {
        let b = self.index[&ret.bucket.key];
        self.replicas[r].layer.as_ref().expect("a layer").returned(&ret);
        let node = self.specs[b].node;
        let id = self.lease_identity(r);
        self.out.return_calls += 1;
        self.send(r, node, id, What::Return(ret, b));
    }

    /// Replica `r`'s lease returns, ordered by bucket (the layer's order is a hash map's).
    fn give_back_all(&mut self, r: usize, mut rets: Vec<LeaseReturn>) {
        rets.sort_by(|a, b| a.bucket.key.cmp(&b.bucket.key));
        for ret in rets {
            let b = self.index[&ret.bucket.key];
            self.replicas[r].held[b] -= ret.tokens_ut as i64;
            self.give_back(r, ret);
        }
        self.settle(r);
    }

    /// What replica `r` held back, now that none of its requests awaits the store.
    fn idle(&mut self, r: usize) {
        loop {
            let rep = &mut self.replicas[r];
            if rep.asks == 1 && rep.deferred.is_some() {
                let (fl, answer) = rep.deferred.take().expect("a refund's answer");
                self.answered(fl, answer);
                continue;
            }
            if rep.asks > 0 {
                break;
            }
            if std::mem::take(&mut rep.upkeep_due) {
                let t_est = self.estimate(r);
                let rets = self.replicas[r].layer.as_ref().expect("a layer").due_returns(t_est);
                self.give_back_all(r, rets);
                continue;
            }
            match self.replicas[r].pending.pop_front() {
                Some(Pending::Refund(req)) => self.route(req),
                Some(Pending::Return(ret)) => {
                    self.give_back(r, ret);
                    self.settle(r);
                }
                Some(Pending::Returned(ret, credit)) => {
                    self.replicas[r].layer.as_ref().expect("a layer").returned(&ret);
                    self.told(credit);
                }
                None => break,
            }
        }
    }

    fn upkeep(&mut self, r: usize) {
        if self.now >= self.end {
            return;
        }
        self.schedule(self.now + UPKEEP_US, Event::Upkeep(r));
        let rep = &mut self.replicas[r];
        rep.ticks += 1;
        if rep.ticks.is_multiple_of(SWEEP_EVERY_TICKS) {
            let t_est = self.estimate(r);
            self.replicas[r].layer.as_ref().expect("a layer").sweep(t_est);
        }
        self.replicas[r].upkeep_due = true;
        self.idle(r);
    }

    fn at_node(&mut self, id: usize) {
        let mut call = self.calls[id].take().expect("a call in flight");
        let (t, node, r) = (self.now, call.node, call.replica);
        self.clock.set_us(t);
        let answer = if self.down(node, t) {
            if let What::Return(ret, b) = &call.what {
                // Never credited: these tokens are gone (they come back by refill).
                let (b, ut) = (*b, ret.tokens_ut);
                let o = self.next_order();
                self.log(b, t, o, Ev::LeaseDown, ut);
                self.lost_ut[b] += ut;
            }
            self.note(&[t, id as u64, 0]);
            Err(unavailable("the node is down"))
        } else {
            let applied = self.decide(&mut call, node, r);
            self.note(&[t, id as u64, 1 + u64::from(applied.decision.denied)]);
            if self.goes_down(node, t, t + call.back_us) {
                Err(unavailable("the node went down before answering"))
            } else {
                Ok(applied)
            }
        };
        call.answer = Some(answer);
        let back = call.back_us;
        self.calls[id] = Some(call);
        self.schedule(t + back, Event::Reply(id));
    }

    /// A node decides `call` now, and what it took and gave is logged.
    fn decide(&mut self, call: &mut Call, node: usize, r: usize) -> Applied {
        let t = self.now;
        match &mut call.what {
            What::Request(fl) => {
                let applied = {
                    let (b, d) = match &fl.ask {
                        Some(ask) => ask.request(&fl.refs, &fl.req.demands),
                        None => (&fl.refs[..], &fl.req.demands[..]),
                    };
                    self.nodes[node].apply_now(b, d)
                };
                let denied = applied.decision.denied;
                for (k, o) in applied.decision.instances.iter().enumerate() {
                    let b = fl.store_part[k];
                    let taken = if denied { 0 } else { o.consumed_ut };
                    let credited = (o.after.tokens_ut + taken).saturating_sub(o.before.tokens_ut);
                    if taken > 0 {
                        let ord = self.next_order();
                        self.log(b, t, ord, Ev::Debit, taken);
                        fl.takes.push((b, t, ord, taken));
                    }
                    if credited > 0 {
                        let ord = self.next_order();
                        self.log(b, t, ord, Ev::Refund, credited);
                        fl.credit = Some((b, self.credits[b].len()));
                        self.credits[b].push((t, r, u64::MAX));
                    }
                }
                applied
            }
            What::Grant(order, b) => {
                let b = *b;
                let applied = self.nodes[node].apply_now(std::slice::from_ref(&order.bucket), &[lease_demand(order)]);
                if !applied.decision.denied {
                    let ord = self.next_order();
                    self.log(b, t, ord, Ev::Debit, order.tokens_ut);
                    let ord = self.next_order();
                    self.log(b, t, ord, Ev::LeaseUp, order.tokens_ut);
                    call.debited = true;
                }
                applied
            }
            What::Return(ret, b) => {
                let b = *b;
                let applied = self.nodes[node].apply_now(std::slice::from_ref(&ret.bucket), &[return_demand(ret)]);
                let o = applied.decision.instances[0];
                let credited = o.after.tokens_ut.saturating_sub(o.before.tokens_ut);
                if credited > 0 {
                    let ord = self.next_order();
                    self.log(b, t, ord, Ev::ReturnCredit, credited);
                    call.credit = Some((b, self.credits[b].len()));
                    self.credits[b].push((t, r, u64::MAX));
                }
                let ord = self.next_order();
                self.log(b, t, ord, Ev::LeaseDown, ret.tokens_ut);
                self.capped_ut[b] += ret.tokens_ut - credited;
                applied
            }
        }
    }

    fn reply(&mut self, id: usize) {
        let call = self.calls[id].take().expect("a call answered");
        self.free.push(id);
        self.in_flight -= 1;
        let r = call.replica;
        let answer = call.answer.expect("decided at the node");
        if answer.is_err() {
            self.out.failed_calls += 1;
        }
        match call.what {
            // A refund's answer moves the cache's epochs (`finish` forgets its buckets): held
            // while other requests of this replica await the store (module docs).
            What::Request(fl) if fl.req.refund && self.cfg.local && self.replicas[r].asks > 1 => {
                self.replicas[r].deferred = Some((*fl, answer));
            }
            What::Request(fl) => self.answered(*fl, answer),
            What::Grant(order, b) => {
                let admitted = matches!(&answer, Ok(a) if !a.decision.denied);
                let ret = self.replicas[r]
                    .layer
                    .as_ref()
                    .expect("a layer")
                    .granted(&order, answer.as_ref().ok());
                self.note(&[self.now, id as u64, u64::from(admitted), u64::from(ret.is_some())]);
                if admitted {
                    match ret {
                        None => {
                            let held = &mut self.replicas[r].held[b];
                            *held += order.tokens_ut as i64;
                            let ratio = *held as f64 / self.specs[b].bucket.lease_ut as f64;
                            self.out.max_held_over_lease = self.out.max_held_over_lease.max(ratio);
                            if ratio > 1.0 {
                                let key = self.specs[b].bucket.key.clone();
                                self.violation(format!(
                                    "replica {r} holds {ratio:.2} x the lease of {key}, reserved tokens counted"
                                ));
                            }
                        }
                        // The lease was dropped meanwhile: straight back.
                        Some(ret) => self.replicas[r].pending.push_back(Pending::Return(ret)),
                    }
                } else if call.debited {
                    // Debited, but the answer was lost: nobody holds these tokens.
                    let o = self.next_order();
                    self.log(b, self.now, o, Ev::LeaseDown, order.tokens_ut);
                    self.lost_ut[b] += order.tokens_ut;
                }
                self.settle(r);
            }
            What::Return(ret, _) => self.replicas[r].pending.push_back(Pending::Returned(ret, call.credit)),
        }
        if self.cfg.local {
            self.idle(r);
        }
    }

    /// The layer was told that the call of `credit` is done.
    fn told(&mut self, credit: Option<(usize, usize)>) {
        if let Some((b, i)) = credit {
            self.credits[b][i].2 = self.now;
        }
    }

    /// The store's answer to a request reaches its replica.
    fn answered(&mut self, mut fl: InFlight, answer: Result<Applied, StoreError>) {
        let r = fl.req.replica;
        let result = match fl.ask.take() {
            Some(ask) => {
                self.replicas[r].asks -= 1;
                let layer = self.replicas[r].layer.as_ref().expect("a layer");
                layer.finish(*ask, &fl.refs, &fl.req.demands, answer)
            }
            None => answer,
        };
        self.told(fl.credit);
        let code = match &result {
            Ok(a) if !a.decision.denied => 0,
            Ok(_) => 1,
            Err(_) => 2,
        };
        self.note(&[self.now, fl.req.id, code]);
        match result {
            Ok(a) if !a.decision.denied => {
                if fl.req.refund {
                    self.settle(r);
                    return;
                }
                self.out.admitted += 1;
                for &(b, t, o, ut) in &fl.takes {
                    self.admit(b, t, o, ut);
                }
                for (i, &b) in fl.req.buckets.iter().enumerate() {
                    if !fl.store_part.contains(&b) {
                        self.spend_lease(r, b, consumption(&fl.req.demands, i));
                    }
                }
            }
            Ok(_) => self.out.denied_by_store += 1,
            Err(_) => self.out.failed += 1,
        }
        self.settle(r);
    }

    /// The end: every replica gives back what it holds (a shutdown), and the run drains.
    fn shutdown(&mut self) {
        for r in 0..self.replicas.len() {
            let Some(layer) = self.replicas[r].layer.as_ref() else {
                continue;
            };
            let rets = layer.return_all();
            self.give_back_all(r, rets);
        }
        self.run();
        for r in 0..self.replicas.len() {
            let rep = &self.replicas[r];
            let Some(layer) = rep.layer.as_ref() else {
                continue;
            };
            let (said, counted): (u64, i64) = (layer.leased_ut(), rep.held.iter().sum());
            if said != 0 || counted != 0 || rep.asks != 0 || !rep.pending.is_empty() || rep.deferred.is_some() {
                self.violation(format!(
                    "replica {r} still holds {said} leased µt ({counted} counted) after the shutdown"
                ));
            }
        }
    }

    fn finish(mut self, wall: Duration) -> Outcome {
        let evicted: u64 = self
            .nodes
            .iter()
            .map(|n| n.stats().evicted_not_full.load(std::sync::atomic::Ordering::Relaxed))
            .sum();
        if evicted > 0 {
            self.violation(format!("the store evicted {evicted} buckets that were not full"));
        }
        let mut rows: Vec<Row> = KINDS
            .iter()
            .map(|&(kind, name)| {
                let first = self
                    .specs
                    .iter()
                    .find(|s| s.kind == kind)
                    .expect("a bucket of each kind");
                Row {
                    name,
                    capacity: first.capacity,
                    per_second: first.per_second,
                    lease: first.lease,
                    ..Row::default()
                }
            })
            .collect();
        let mut log = std::mem::take(&mut self.log);
        for (b, entries) in log.iter_mut().enumerate() {
            // Admissions were logged when their answers arrived, at the instant of their take.
            entries.sort_by_key(|e| (e.t, e.order));
            let spec = &self.specs[b];
            let (cap, rate, kind, key) = (
                spec.capacity * MICRO,
                spec.per_second,
                spec.kind,
                spec.bucket.key.clone(),
            );
            let a = check_windows(
                entries.iter().filter_map(|e| {
                    let step = match e.ev {
                        Ev::Admit => Step::Take(e.ut),
                        Ev::Refund => Step::Credit(e.ut),
                        Ev::LeaseUp => Step::Slack(e.ut as i64),
                        Ev::LeaseDown => Step::Slack(-(e.ut as i64)),
                        Ev::Debit | Ev::ReturnCredit => return None,
                    };
                    Some((e.t - T0, step))
                }),
                cap,
                rate,
            );
            let s = check_windows(
                entries.iter().filter_map(|e| {
                    let step = match e.ev {
                        Ev::Debit => Step::Take(e.ut),
                        Ev::Refund | Ev::ReturnCredit => Step::Credit(e.ut),
                        _ => return None,
                    };
                    Some((e.t - T0, step))
                }),
                cap,
                rate,
            );
            for (what, w) in [("admitted", &a), ("the store took", &s)] {
                if w.over > 0 {
                    let (room, from, to, ut) = w.worst.expect("a window");
                    self.violation(format!(
                        "{key}: {what} {} tokens in [{from}, {to}] µs, {} over the bound ({} windows over)",
                        ut as f64 / MICRO as f64,
                        -room as f64 / MICRO as f64,
                        w.over
                    ));
                }
            }
            if a.negative_slack > 0 || a.final_slack_ut != 0 {
                self.violation(format!(
                    "{key}: leased tokens went below zero {} times, {} µt at the end",
                    a.negative_slack, a.final_slack_ut
                ));
            }
            let row = &mut rows[KINDS.iter().position(|(k, _)| *k == kind).expect("a row")];
            row.buckets += 1;
            row.admitted_ut += self.admitted_ut[b];
            row.leased_spent_ut += self.leased_spent_ut[b];
            row.local_denials += self.local_denials_by[b];
            row.lost_ut += self.lost_ut[b];
            row.capped_ut += self.capped_ut[b];
            row.over_a += a.over;
            row.over_b += s.over;
            row.peak_leased_ut = row.peak_leased_ut.max(a.peak_slack_ut);
            let min = |x: Option<i128>, y: Option<(i128, u64, u64, u64)>| match (x, y) {
                (Some(x), Some((y, ..))) => Some(x.min(y)),
                (x, y) => x.or(y.map(|w| w.0)),
            };
            row.margin_a_ut = min(row.margin_a_ut, a.worst);
            row.margin_b_ut = min(row.margin_b_ut, s.worst);
        }
        self.out.rows = rows;
        self.out.wall = wall;
        self.out
    }
}

/// Runs one simulation.
pub fn run(cfg: &Config) -> Outcome {
    let started = Instant::now();
    let mut sim = Sim::new(cfg);
    sim.run();
    sim.shutdown();
    sim.finish(started.elapsed())
}

fn tokens(ut: impl Into<i128>) -> String {
    let ut = ut.into();
    let whole = ut.div_euclid(i128::from(MICRO));
    thousands(whole)
}

fn thousands(n: i128) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

fn per_request(calls: u64, requests: u64) -> f64 {
    calls as f64 / requests.max(1) as f64
}

/// The table of a run with the layer (`on`) beside the same run without (`off`): what the
/// acceptance calls "printed". Deterministic (no wall time: see [`Outcome::wall`]).
pub fn table(seed: u64, on: &Outcome, off: &Outcome) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "seed {seed}: {} replicas, {NODES} store nodes, {:.1} s of traffic ({} requests, {} refunds), {} node outages ({:.2} s down in all), {} calls in flight at most",
        on.replicas,
        on.duration_us as f64 / SECOND as f64,
        thousands(on.requests.into()),
        thousands(on.refunds.into()),
        on.outages,
        on.outage_us as f64 / SECOND as f64,
        thousands(on.max_in_flight.max(off.max_in_flight) as i128),
    );
    let _ = writeln!(
        s,
        "{:<13} {:>6} {:>8} {:>5} | {:>10} {:>10} {:>7} | {:>9} {:>9} | {:>8} {:>8} | {:>7} {:>6}",
        "bucket",
        "cap",
        "refill/s",
        "lease",
        "admitted",
        "no layer",
        "under",
        "on leases",
        "denied",
        "room (a)",
        "room (b)",
        "leased",
        "lost"
    );
    for (a, b) in on.rows.iter().zip(&off.rows) {
        let name = if a.buckets > 1 {
            format!("{} x{}", a.name, a.buckets)
        } else {
            a.name.to_string()
        };
        let room = |r: Option<i128>| r.map_or("-".to_string(), tokens);
        let lease = if a.lease > 0 { a.lease.to_string() } else { "-".into() };
        let _ = writeln!(
            s,
            "{name:<13} {:>6} {:>8} {lease:>5} | {:>10} {:>10} {:>7} | {:>9} {:>9} | {:>8} {:>8} | {:>7} {:>6}",
            a.capacity,
            a.per_second,
            tokens(a.admitted_ut),
            tokens(b.admitted_ut),
            tokens(i128::from(b.admitted_ut) - i128::from(a.admitted_ut)),
            tokens(a.leased_spent_ut),
            thousands(a.local_denials.into()),
            room(a.margin_a_ut),
            room(a.margin_b_ut),
            tokens(a.peak_leased_ut),
            tokens(a.lost_ut),
        );
    }
    let calls = on.request_calls + on.grant_calls + on.return_calls;
    let _ = writeln!(
        s,
        "store calls per request: {:.3} with the layer (requests {:.3}, lease grants {:.3}, returns {:.3}), {:.3} without",
        per_request(calls, on.requests),
        per_request(on.request_calls, on.requests),
        per_request(on.grant_calls, on.requests),
        per_request(on.return_calls, on.requests),
        per_request(off.request_calls, off.requests),
    );
    let c = &on.contrary;
    let _ = writeln!(
        s,
        "requests admitted {} with the layer ({} wholly on leases), {} without; local denials {} ({} as the store would at that instant; the store would have admitted {}: after a credit elsewhere {}, after this replica's own refund {}, clock behind {}, unexplained {})",
        thousands(on.admitted.into()),
        thousands(on.lease_admissions.into()),
        thousands(off.admitted.into()),
        thousands(on.local_denials.into()),
        thousands(on.local_agreeing.into()),
        thousands((c.elsewhere + c.own_refund + c.clock + c.unexplained).into()),
        c.elsewhere,
        c.own_refund,
        c.clock,
        c.unexplained,
    );
    let _ = writeln!(
        s,
        "failed store calls {} with the layer ({} requests answered as failure_mode: deny), {} without ({}); returns capped at a full bucket {} tokens; most leased by one replica: {:.2} x its lease; violations {} with the layer, {} without",
        thousands(on.failed_calls.into()),
        thousands(on.failed.into()),
        thousands(off.failed_calls.into()),
        thousands(off.failed.into()),
        tokens(on.rows.iter().map(|r| r.capped_ut).sum::<u64>()),
        on.max_held_over_lease,
        on.violations.len(),
        off.violations.len(),
    );
    s
}
