//! Concurrent decisions share a call: each of `postgres.pool_size` *lanes*, on a connection of
//! its own ([`super::connections`]), takes every request waiting and decides them together
//! ([`super::batch`]).
//!
//! As for Redis ([`crate::store::redis::batch`]) no timer fills a batch: a lane takes the first
//! waiting request, lets the runtime's ready tasks run twice so the requests that arrived with
//! it queue theirs, takes everything waiting then (up to [`MAX_BATCH`]), and goes. Every request
//! has a deadline (its arrival plus `postgres.command_timeout_ms`): one whose deadline passed
//! while it waited, or whose caller gave up, is dropped before its batch is sent and consumes
//! nothing; a batch still running at the earliest deadline of its requests is abandoned and
//! they are answered with a timeout (a transaction is rolled back; a function call that
//! completes anyway may have spent tokens for them: an under-admission, never an over-admission).
//!
//! While traces are exported, a job carries its request's span and each batch is a span of its
//! own (`crate::store::round_trip`), linked from those: its connection check, its function
//! call and any transaction, with an error status when the whole batch failed or timed out.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Mutex};
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::batch::{decide_jobs, late, Broken, Job, MAX_BATCH};
use super::connections::{back_off, renewed, Connections, Held, Renewal, IDLE_CHECK};
use crate::core::clock::Clock;
use crate::store::round_trip::{self, Carried};
use crate::store::{batch_failure, gather, Applied, StoreError};

/// Hands requests to the lanes. Dropping it ends them once they have answered what they hold.
pub(crate) struct Batcher {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Starts `lanes` lanes, each deciding one batch at a time on a connection of its own from
    /// `connections`. `time_override` (tests only) replaces Postgres's clock. Call within a
    /// Tokio runtime.
    pub(crate) fn start(connections: Arc<Connections>, lanes: u32, time_override: Option<Arc<dyn Clock>>) -> Batcher {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..lanes.max(1) {
            let (connections, rx, time_override) = (connections.clone(), rx.clone(), time_override.clone());
            // A lane that panicked (a bug: nothing in it should) is started again, so the store
            // does not lose its lanes one by one; the requests it held see their channel close.
            tokio::spawn(async move {
                loop {
                    let run = tokio::spawn(lane(connections.clone(), rx.clone(), time_override.clone()));
                    match run.await {
                        Err(e) if e.is_panic() => {
                            tracing::error!("a Postgres decision lane panicked; starting it again");
                        }
                        // The queue closed (the store is gone), or the runtime is shutting down.
                        _ => return,
                    }
                }
            });
        }
        Batcher { jobs: tx }
    }

    /// Queues a request; its decision arrives on the job's `reply`.
    ///
    /// Errors: the lanes have ended (the store is being dropped).
    pub(crate) fn submit(&self, job: Job) -> Result<(), StoreError> {
        self.jobs
            .send(job)
            .map_err(|_| StoreError::Unavailable("the Postgres store is shutting down".into()))
    }
}

async fn lane(
    connections: Arc<Connections>,
    rx: Arc<Mutex<mpsc::UnboundedReceiver<Job>>>,
    time_override: Option<Arc<dyn Clock>>,
) {
    let mut jobs: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    let mut breaks = connections.breaks();
    let mut held: Option<Held> = None;
    // Getting the lane a connection, in the background (`connections`): a check of one a break
    // made suspect, or a new one, `retry` after the last failed attempt.
    let mut renewal: Option<Renewal> = None;
    let mut retry = Duration::ZERO;
    loop {
        let seen = *breaks.borrow_and_update();
        if renewal.is_none() {
            if held.as_ref().is_some_and(|h| h.breaks != seen) {
                renewal = Some(connections.renew(held.take(), Duration::ZERO, false));
            } else if held.is_none() {
                renewal = Some(connections.renew(None, retry, false));
            }
        }
        {
            // Waiting for requests, a lane also wakes when its renewal ends, and on a break. A
            // lane without a connection leaves requests to those with one; when no lane has
            // one (PostgreSQL down) it takes them, to try for them and fail them with the reason.
            let mut rx = tokio::select! {
                got = renewed(&mut renewal) => {
                    renewal = None;
                    settle(got, &mut held, &mut retry);
                    continue;
                }
                Ok(()) = breaks.changed() => continue,
                rx = rx.lock(), if held.is_some() || connections.holding() == 0 => rx,
            };
            let first = tokio::select! {
                got = renewed(&mut renewal) => {
                    renewal = None;
                    settle(got, &mut held, &mut retry);
                    continue;
                }
                Ok(()) = breaks.changed() => continue,
                first = rx.recv() => first,
            };
            match first {
                Some(job) => jobs.push(job),
                None => return,
            }
            gather(&mut rx, &mut jobs, MAX_BATCH).await;
        }
        // A job whose caller gave up, or that waited past its start-by instant, is dropped with
        // its sender: its caller reports the timeout, and it consumes nothing.
        let now = Instant::now();
        jobs.retain(|j| !j.reply.is_closed() && j.start_by > now);
        let Some(deadline) = jobs.iter().map(|j| j.deadline).min() else {
            continue;
        };
        let span = round_trip::span(
            jobs.iter().map(|j| &j.origin),
            Carried {
                backend: "postgres",
                call: "tollgate_decide",
                requests: jobs.len(),
                buckets: jobs.iter().map(|j| j.buckets.len()).sum(),
            },
        );
        let clock = time_override.as_deref();
        // Past the deadline, a batch whose function call or transaction already committed
        // spent tokens for requests answered with a timeout (never an over-admission).
        let mut broken = Broken::No;
        let run = async {
            if let Some(h) = held.as_mut() {
                let seen = *breaks.borrow();
                if h.breaks != seen || h.used.elapsed() > IDLE_CHECK {
                    if sqlx::Connection::ping(&mut h.conn).await.is_ok() {
                        h.breaks = seen;
                    } else {
                        held = None;
                        connections.broke();
                    }
                }
            }
            if held.is_none() {
                // A renewal waiting out its back-off starts again now: a request is waiting.
                // One that is under way is waited for; at the deadline it goes on without us.
                if renewal.as_ref().is_none_or(Renewal::waiting) {
                    renewal = Some(connections.renew(None, Duration::ZERO, false));
                }
                let got = renewed(&mut renewal).await;
                renewal = None;
                if let Err(e) = got {
                    retry = back_off(retry);
                    return Err(e);
                }
                settle(got, &mut held, &mut retry);
            }
            let h = held.as_mut().expect("a connection was just got");
            Ok::<_, StoreError>(decide_jobs(&mut h.conn, &jobs, clock, &mut broken).await)
        };
        let run = run.instrument(span.clone().unwrap_or_else(Span::none));
        let results = match tokio::time::timeout_at(deadline, run).await {
            Ok(Ok(results)) => results,
            Ok(Err(e)) => batch_failure(e, jobs.len()),
            Err(_) => {
                broken = broken.max(Broken::InDoubt);
                batch_failure(late(), jobs.len())
            }
        };
        if let Some(e) = span.as_ref().and_then(|_| failure(&results)) {
            round_trip::failed(span.as_ref(), e);
        }
        drop(span);
        match broken {
            // Checked in the background before it serves again: kept if it answers (a slow
            // statement), else replaced, and then the other lanes check theirs.
            Broken::InDoubt => {
                if let Some(h) = held.take() {
                    renewal = renewal.or_else(|| Some(connections.renew(Some(h), Duration::ZERO, true)));
                }
            }
            // Dead: closed, and the other lanes check theirs at once, before their next batch.
            Broken::Dead => {
                if held.take().is_some() {
                    connections.broke();
                }
            }
            Broken::No => {
                if let Some(h) = held.as_mut() {
                    h.used = Instant::now();
                }
            }
        }
        for (job, result) in jobs.drain(..).zip(results) {
            let _ = job.reply.send(result);
        }
    }
}

/// What failed a whole batch: the first error when every request failed and not all of them
/// were refused for their own data (a refusal is about a request, not the round trip).
fn failure(results: &[Result<Applied, StoreError>]) -> Option<&StoreError> {
    let mut errors = results.iter().map(|r| r.as_ref().err());
    let all_failed = errors.clone().all(|e| e.is_some());
    let first = errors.find_map(|e| e.filter(|e| !matches!(e.cause(), StoreError::Rejected(_))))?;
    all_failed.then_some(first.cause())
}

/// Takes what a renewal got: the lane's connection, or the error of a failed attempt, which
/// `retry` backs off.
fn settle(got: Result<Held, StoreError>, held: &mut Option<Held>, retry: &mut Duration) {
    match got {
        Ok(h) => {
            *held = Some(h);
            *retry = Duration::ZERO;
        }
        Err(e) => {
            tracing::debug!(error = %e, "a Postgres decision lane could not connect");
            *retry = back_off(*retry);
        }
    }
}
