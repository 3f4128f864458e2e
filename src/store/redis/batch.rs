//! Implicit pipelining: the decisions of concurrent requests go to Redis together, as one call
//! of `lua/decide.lua` over several requests.
//!
//! Each request's decision stays one atomic step (the script decides the requests of a call one
//! after the other, and Redis runs a script alone), so a batch decides exactly what the same
//! requests would decide with one call each, in the batch's order. What a batch saves is the
//! fixed cost of a call: a socket write and a wake-up on tollgate's side, a read, a script
//! invocation and a reply on Redis's (most of Redis's CPU per request when calls go one by one).
//!
//! There is no timer to fill a batch. Each connection of the pool has one *lane*: a task that
//! takes the first waiting request, lets the runtime's ready tasks run for two turns (so that
//! requests that arrived with it queue theirs), takes everything waiting then (up to
//! [`MAX_BATCH`]), makes the call, hands out the answers, and goes back for more. With no load
//! nothing else is ready and a request goes out alone at once; under load requests gather while
//! the lanes' calls are in flight, so batches grow with load. A request whose caller has given up (its timeout passed)
//! while it waited is dropped before the call, so it consumes nothing.
//!
//! **Cluster.** Redis Cluster refuses a script call whose declared keys lie in several slots
//! (CROSSSLOT); a job is one slot's part of a request (`RedisStore` splits a request over
//! several slots first). In Cluster mode each master has lanes of its own (on a pool to it
//! alone, `super::cluster`). A lane sends the lean jobs it took, whatever their slots, in one
//! call of the Cluster form of the script (Redis 7's `allow-cross-slot-keys`: the first key
//! declared, every key in ARGV), and the others one call per slot, all at once on its
//! connection. A redirect is the caller's to follow; a job sent after an `ASK` goes in a call of
//! its own, after `ASKING`. A Cluster-form call that fails as a whole (not a timeout) goes again
//! slot by slot, and a slot's call of several jobs answered `ASK` or `TRYAGAIN` (a migration
//! half done) goes again one job at a time, so that an error about one slot or key never
//! reaches another's request.
//!
//! **Traces.** While traces are exported, a job carries its request's span, and each call is a
//! span of its own (`crate::store::round_trip`) linked from the spans of the requests it
//! decided: a call sent again slot by slot, or one job at a time, is a span per call.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use fred::clients::Client;
use fred::types::{Key, Value};
use futures_util::future::join_all;
use tokio::sync::{mpsc, oneshot, Mutex};
use tracing::{Instrument, Span};

use super::cluster::nodes::{redirect_of, Redirect};
use super::script::{encode_header, is_lean, split_answers, CallSettings};
use super::{keys, Conn};
use crate::core::clock::Clock;
use crate::store::round_trip::{self, Carried};
use crate::store::{batch_failure, gather, StoreError};

/// The most requests one call decides. Bounds the script's run time (Redis serves nothing else
/// meanwhile): a few hundred microseconds for the largest batch.
pub(crate) const MAX_BATCH: usize = 64;

/// One request's share of a call: its keys and ARGV fields
/// ([`encode_request`](super::script::encode_request)), and where its answer goes.
pub(crate) struct Job {
    /// The request's bucket keys, in the order of its fields.
    pub keys: Vec<Key>,
    /// The request's ARGV fields.
    pub args: Vec<Value>,
    /// Cluster only: send `ASKING` first, on the same connection (the slot is being migrated
    /// to this node, which answered `ASK`). Such jobs are called apart from the others.
    pub asking: bool,
    /// Receives the request's answer, with the local clock's readings (µs) when the call was
    /// sent and when it was answered.
    pub reply: oneshot::Sender<Result<Answer, StoreError>>,
    /// The submitting request's span while traces are exported
    /// ([`round_trip::origin`](crate::store::round_trip::origin)): the span of the call that
    /// decides the job links from it.
    pub origin: Option<tracing::Span>,
}

/// One request's answer from a batched call.
pub(crate) struct Answer {
    /// The script's answer for this request.
    pub value: Value,
    /// Redis time of the call (the script's `TIME`, or the test override), in microseconds.
    pub now_us: u64,
    /// Local time the call was sent, in microseconds.
    pub sent_us: u64,
    /// Local time the answer came, in microseconds.
    pub received_us: u64,
}

/// Hands requests to the lanes. Dropping it ends them once they have answered what they hold.
pub(crate) struct Batcher {
    jobs: mpsc::UnboundedSender<Job>,
}

/// What a lane needs besides its connection: the clock for the send and receive readings, the
/// test time override, and the per-call settings.
pub(crate) struct LaneSettings {
    /// The local clock.
    pub clock: Arc<dyn Clock>,
    /// Tests only: the time sent instead of Redis `TIME`.
    pub time_override: Option<Arc<dyn Clock>>,
    /// TTL settings sent with every call.
    pub call: CallSettings,
}

impl Batcher {
    /// Starts one lane per client of the pool. Call within a Tokio runtime.
    pub(super) fn start(conn: Arc<Conn>, settings: LaneSettings) -> Batcher {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(rx));
        let settings = Arc::new(settings);
        for client in conn.pool.clients() {
            tokio::spawn(lane(conn.clone(), client.clone(), rx.clone(), settings.clone()));
        }
        Batcher { jobs: tx }
    }

    /// Queues a request; its answer arrives on the job's `reply`.
    ///
    /// Errors: the lanes have ended (the store is being dropped).
    pub(crate) fn submit(&self, job: Job) -> Result<(), StoreError> {
        self.jobs
            .send(job)
            .map_err(|_| StoreError::Unavailable("the Redis store is shutting down".into()))
    }
}

async fn lane(
    conn: Arc<Conn>,
    client: Client,
    rx: Arc<Mutex<mpsc::UnboundedReceiver<Job>>>,
    settings: Arc<LaneSettings>,
) {
    let mut jobs: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    loop {
        {
            let mut rx = rx.lock().await;
            match rx.recv().await {
                Some(job) => jobs.push(job),
                None => return,
            }
            gather(&mut rx, &mut jobs, MAX_BATCH).await;
        }
        jobs.retain(|j| !j.reply.is_closed());
        if jobs.is_empty() {
            continue;
        }
        if conn.cluster && jobs.len() > 1 {
            // Lean requests of any slot of this master share one call of the Cluster form;
            // the others (and all of them before Redis 7.0) one call per slot.
            let mut cross: Vec<Job> = if conn.cross_slot.load(Ordering::Relaxed) {
                jobs.extract_if(.., |j| !j.asking && is_lean(&j.args)).collect()
            } else {
                Vec::new()
            };
            let mut groups = by_slot(&mut jobs);
            if cross.len() == 1 {
                groups.push(cross);
                cross = Vec::new();
            }
            let cross_call = async {
                if !cross.is_empty() {
                    call_cross_slot(&conn, &client, &settings, &mut cross).await;
                }
            };
            let slot_calls = join_all(groups.iter_mut().map(|group| call(&conn, &client, &settings, group)));
            futures_util::future::join(cross_call, slot_calls).await;
        } else {
            call(&conn, &client, &settings, &mut jobs).await;
        }
    }
}

/// Splits `jobs` (emptied) into runs of one Cluster slot each, every run in arrival order.
fn by_slot(jobs: &mut Vec<Job>) -> Vec<Vec<Job>> {
    // A job's keys all share its slot (see the module docs), so its first key tells it; jobs
    // that must follow an `ASKING` go in calls of their own.
    let slot_of = |job: &Job| (job.keys.first().map_or(0, |k| keys::slot(k.as_bytes())), job.asking);
    jobs.sort_by_cached_key(slot_of);
    let mut groups: Vec<Vec<Job>> = Vec::new();
    let mut last = None;
    for job in jobs.drain(..) {
        let slot = slot_of(&job);
        match groups.last_mut() {
            Some(group) if last == Some(slot) => group.push(job),
            _ => groups.push(vec![job]),
        }
        last = Some(slot);
    }
    groups
}

/// Decides `jobs` (all of one slot in Cluster mode) in one call on `client` and hands each its
/// answer, or the call's failure; leaves `jobs` empty. On a Cluster, several requests answered
/// `ASK` or `TRYAGAIN` go again one by one.
async fn call(conn: &Conn, client: &Client, settings: &LaneSettings, jobs: &mut Vec<Job>) {
    if !conn.cluster || jobs.len() < 2 {
        return call_once(conn, client, settings, jobs).await;
    }
    // Copies (reference-counted bytes), to send the requests again one by one.
    let copies: Vec<(Vec<Key>, Vec<Value>)> = jobs.iter().map(|j| (j.keys.clone(), j.args.clone())).collect();
    let sent = send_jobs(conn, client, settings, jobs).await;
    match sent {
        // While the slot migrates, a call whose keys are partly on each master is answered
        // `TRYAGAIN`, or `ASK` for keys that are all gone: with several requests' keys in one
        // call that may never change (no write lands while every call fails), so each request
        // goes again alone, and its own route follows what Redis says about its keys.
        Err(e) if matches!(redirect_of(&e), Some(Redirect::Ask(_) | Redirect::TryAgain)) => {
            for (job, (keys, args)) in jobs.iter_mut().zip(copies) {
                job.keys = keys;
                job.args = args;
            }
            let mut alone: Vec<Vec<Job>> = jobs.drain(..).map(|job| vec![job]).collect();
            join_all(alone.iter_mut().map(|one| call_once(conn, client, settings, one))).await;
        }
        sent => answer(jobs, sent),
    }
}

/// Decides `jobs` in one call of the decision script, and hands each its answer or the call's
/// failure; leaves `jobs` empty.
async fn call_once(conn: &Conn, client: &Client, settings: &LaneSettings, jobs: &mut Vec<Job>) {
    let sent = send_jobs(conn, client, settings, jobs).await;
    answer(jobs, sent);
}

/// Sends one call of the decision script over `jobs` (their fields moved out).
async fn send_jobs(conn: &Conn, client: &Client, settings: &LaneSettings, jobs: &mut [Job]) -> Sent {
    let (keys, argv, asking) = fields(settings, jobs);
    let span = round_trip::span(
        jobs.iter().map(|j| &j.origin),
        Carried {
            backend: "redis",
            call: "decide",
            requests: jobs.len(),
            buckets: keys.len(),
        },
    );
    let sent = send(
        conn,
        client,
        settings,
        &conn.scripts.decide,
        keys,
        argv,
        asking,
        jobs.len(),
    )
    .instrument(span.clone().unwrap_or_else(Span::none))
    .await;
    if let Err(e) = &sent {
        round_trip::failed(span.as_ref(), e);
    }
    sent
}

/// The keys and ARGV of one call over `jobs` (their fields moved out), and whether it follows
/// an `ASK`.
fn fields(settings: &LaneSettings, jobs: &mut [Job]) -> (Vec<Key>, Vec<Value>, bool) {
    let now_override = settings.time_override.as_ref().map(|c| c.now_us());
    let mut argv = encode_header(now_override, settings.call, jobs.len());
    let mut keys = Vec::with_capacity(jobs.len());
    for job in jobs.iter_mut() {
        keys.append(&mut job.keys);
        argv.append(&mut job.args);
    }
    (keys, argv, jobs.first().is_some_and(|j| j.asking))
}

/// Decides `jobs`, lean requests of any slots of one Cluster master, in one call of the
/// Cluster form of the script (`lua/cross_slot.lua`): the first key declared, for routing, and
/// all of them at the end of ARGV with their count. A failure that is not a timeout sends the
/// jobs again one slot at a time ([`call`]): an error about the call (a redirect or
/// `CLUSTERDOWN` for the declared key's slot, `TRYAGAIN`, the Cluster form missing after
/// `NOSCRIPT`, `OOM` for a script that may write) says nothing about the other slots' requests,
/// and each request's own route follows its own slot's redirects.
async fn call_cross_slot(conn: &Conn, client: &Client, settings: &LaneSettings, jobs: &mut Vec<Job>) {
    let now_override = settings.time_override.as_ref().map(|c| c.now_us());
    let mut argv = encode_header(now_override, settings.call, jobs.len());
    // Copies (reference-counted bytes), so that the jobs can be sent again if the call fails.
    let mut keys: Vec<Key> = Vec::with_capacity(jobs.len());
    for job in jobs.iter() {
        keys.extend(job.keys.iter().cloned());
        argv.extend(job.args.iter().cloned());
    }
    let count = keys.len();
    argv.extend(keys.iter().map(|k| Value::Bytes(k.clone().into_bytes())));
    argv.push(Value::Integer(count as i64));
    keys.truncate(1);
    let span = round_trip::span(
        jobs.iter().map(|j| &j.origin),
        Carried {
            backend: "redis",
            call: "decide_cross_slot",
            requests: jobs.len(),
            buckets: count,
        },
    );
    let sent = send(
        conn,
        client,
        settings,
        &conn.scripts.cross_slot,
        keys,
        argv,
        false,
        jobs.len(),
    )
    .instrument(span.clone().unwrap_or_else(Span::none))
    .await;
    if let Err(e) = &sent {
        round_trip::failed(span.as_ref(), e);
    }
    // Closed here: the slot-by-slot calls that may follow are round trips of their own.
    drop(span);
    match sent {
        Err(e) if !matches!(e.cause(), StoreError::Timeout(_)) => {
            tracing::debug!(redis = %conn.describe, error = %e, "a call across slots failed; its requests go again slot by slot");
            let mut groups = by_slot(jobs);
            join_all(groups.iter_mut().map(|group| call(conn, client, settings, group))).await;
        }
        sent => answer(jobs, sent),
    }
}

/// The answers of one call: one per request and the call's Redis time, with the local clock's
/// readings (µs) when it was sent and answered.
type Sent = Result<(Vec<Value>, u64, u64, u64), StoreError>;

/// Sends one call of the script `sha` deciding `requests` requests.
#[allow(clippy::too_many_arguments)]
async fn send(
    conn: &Conn,
    client: &Client,
    settings: &LaneSettings,
    sha: &str,
    keys: Vec<Key>,
    argv: Vec<Value>,
    asking: bool,
    requests: usize,
) -> Sent {
    let sent_us = settings.clock.now_us();
    let result = if asking {
        conn.asking_evalsha_on(client, sha, keys, argv).await
    } else {
        conn.evalsha_on(client, sha, keys, argv).await
    };
    let received_us = settings.clock.now_us();
    let (answers, now_us) = result.and_then(|v| {
        split_answers(v, requests).map_err(|e| StoreError::Unavailable(format!("decide.lua: {e}").into()))
    })?;
    Ok((answers, now_us, sent_us, received_us))
}

/// Hands each of `jobs` (emptied) its answer, or the call's failure.
fn answer(jobs: &mut Vec<Job>, sent: Sent) {
    match sent {
        Ok((answers, now_us, sent_us, received_us)) => {
            for (job, value) in jobs.drain(..).zip(answers) {
                let _ = job.reply.send(Ok(Answer {
                    value,
                    now_us,
                    sent_us,
                    received_us,
                }));
            }
        }
        Err(e) => {
            let answers = batch_failure(e, jobs.len());
            for (job, answer) in jobs.drain(..).zip(answers) {
                let _ = job.reply.send(answer);
            }
        }
    }
}
