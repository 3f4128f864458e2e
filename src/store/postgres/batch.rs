//! What a lane ([`super::lane`]) does with a batch: it decides all its requests in one
//! statement, `tollgate_decide` inside PostgreSQL (the module above), or for the requests it
//! leaves, in one transaction that locks their rows, decides in Rust, writes and commits.
//!
//! Each request is still decided all or nothing on its own, in the batch's order, at one
//! instant of Postgres's clock, so a batch decides exactly what the same requests would decide
//! one call each (a test below checks it for the transaction). What a batch saves is the fixed
//! cost of a call: its round trip, a socket write and a wake-up on both sides, and its commit
//! record and WAL flush. A lane keeps its connection from batch to batch, so a batch the
//! function decides costs one round trip.

use sqlx::postgres::PgConnection;
use sqlx::Row;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::connections::session_ended;
use super::{column, function, row_state, store_error, CLOCK_US};
use crate::core::bucket::{decide, BucketState, Demand};
use crate::core::clock::Clock;
use crate::store::redis::script::BucketArgs;
use crate::store::{batch_failure, Applied, BucketRef, StoreError};

/// The most requests one transaction decides. Bounds how long its rows stay locked.
pub(crate) const MAX_BATCH: usize = 64;

/// One request waiting for a lane.
pub(crate) struct Job {
    /// Its bucket instances (distinct).
    pub buckets: Vec<BucketRef>,
    /// Its demands, indexing `buckets`.
    pub demands: Vec<Demand>,
    /// When its caller's time is up: its transaction is not kept running past it.
    pub deadline: Instant,
    /// The latest instant it may be started at (half its budget, so that a batch is never cut
    /// short by one request that has almost none left); one still waiting then is answered
    /// with a timeout and consumes nothing.
    pub start_by: Instant,
    /// Receives its decision.
    pub reply: oneshot::Sender<Result<Applied, StoreError>>,
    /// The submitting request's span while traces are exported
    /// ([`round_trip::origin`](crate::store::round_trip::origin)): the span of the batch that
    /// decides the job links from it.
    pub origin: Option<tracing::Span>,
}

/// What a batch found out about its lane's connection, worst last.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Broken {
    /// It served.
    No,
    /// A statement timed out (PostgreSQL's `statement_timeout`, or abandoned at the deadline):
    /// the server may only be slow.
    InDoubt,
    /// It failed (an I/O error, or PostgreSQL ended the session).
    Dead,
}

pub(super) fn late() -> StoreError {
    StoreError::Timeout("no decision from Postgres in time".into())
}

/// Decides `jobs`: those [`function::request_args`] accepts in one call of `tollgate_decide`
/// (one statement in autocommit: one round trip, the rows locked only inside the server), and
/// the rest, with those it answered "again", in one transaction decided in Rust. Either step
/// that PostgreSQL refuses is done again one job at a time, so only the job at fault fails;
/// the function's commits are never undone nor repeated by the transaction's failure.
/// Sets `broken` when the connection failed, or a statement timed out (rather than PostgreSQL
/// refusing a statement).
pub(super) async fn decide_jobs(
    conn: &mut PgConnection,
    jobs: &[Job],
    clock: Option<&dyn Clock>,
    broken: &mut Broken,
) -> Vec<Result<Applied, StoreError>> {
    let mut note = |f: Failure| {
        if !f.refused {
            let this = match f.error {
                StoreError::Timeout(_) => Broken::InDoubt,
                _ => Broken::Dead,
            };
            *broken = (*broken).max(this);
        }
        f.error
    };
    let all: Vec<&Job> = jobs.iter().collect();
    let mut results = match in_function(conn, &all, clock).await {
        Ok(results) => results,
        Err(Failure { refused: true, .. }) if all.len() > 1 => {
            let mut results = Vec::with_capacity(all.len());
            for job in &all {
                results.push(match in_function(conn, std::slice::from_ref(job), clock).await {
                    Ok(mut one) => one.pop().flatten(),
                    Err(f) => Some(Err(note(f))),
                });
            }
            results
        }
        Err(f) => batch_failure(note(f), all.len()).into_iter().map(Some).collect(),
    };
    let rest: Vec<&Job> = all
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_none())
        .map(|(j, _)| *j)
        .collect();
    if !rest.is_empty() {
        if crate::telemetry::traces_on() {
            // The batch's span, entered around this call by the lane (a no-op without one).
            tracing::Span::current().record("ratelimit.transaction", rest.len());
        }
        let decided = match transact(conn, &rest, clock).await {
            Ok(decided) => decided,
            Err(Failure { refused: true, .. }) if rest.len() > 1 => {
                let mut decided = Vec::with_capacity(rest.len());
                for job in &rest {
                    decided.push(match transact(conn, std::slice::from_ref(job), clock).await {
                        Ok(mut one) => one.pop().unwrap_or_else(|| Err(late())),
                        Err(f) => Err(note(f)),
                    });
                }
                decided
            }
            Err(f) => batch_failure(note(f), rest.len()),
        };
        let mut decided = decided.into_iter();
        for slot in results.iter_mut().filter(|r| r.is_none()) {
            *slot = decided.next();
        }
    }
    results.into_iter().map(|r| r.unwrap_or_else(|| Err(late()))).collect()
}

/// Postgres's time as tollgate estimates it, to work out the function's arguments: the local
/// clock (or the test override). An estimate off by enough to cross a change of limit costs
/// the request a transaction (the function answers "again"), never a wrong decision.
fn estimate_us(clock: Option<&dyn Clock>) -> u64 {
    match clock {
        Some(c) => c.now_us(),
        None => crate::core::clock::SystemClock.now_us(),
    }
}

/// `jobs` in one call of `tollgate_decide`. Per job, its decision or refusal, or `None`: not
/// sent (see [`function::request_args`]) or answered "again", left for a transaction.
async fn in_function(
    conn: &mut PgConnection,
    jobs: &[&Job],
    clock: Option<&dyn Clock>,
) -> Result<Vec<Option<Result<Applied, StoreError>>>, Failure> {
    let buckets: Vec<&[BucketRef]> = jobs.iter().map(|j| j.buckets.as_slice()).collect();
    let (keys, index) = keys_of(&buckets);
    let t = estimate_us(clock);
    let accepted: Vec<(usize, Vec<BucketArgs>)> = jobs
        .iter()
        .enumerate()
        .filter_map(|(j, job)| Some((j, function::request_args(&job.buckets, &index[j], t)?)))
        .collect();
    let mut results: Vec<Option<Result<Applied, StoreError>>> = (0..jobs.len()).map(|_| None).collect();
    if accepted.is_empty() {
        return Ok(results);
    }
    // Only the rows of the jobs sent are locked here; the others' are the transaction's.
    let mut used: Vec<usize> = accepted.iter().flat_map(|(j, _)| index[*j].iter().copied()).collect();
    used.sort_unstable();
    used.dedup();
    let mut call = function::Call::default();
    for (j, args) in &accepted {
        let local: Vec<usize> = index[*j]
            .iter()
            .map(|k| used.binary_search(k).expect("a key of the list"))
            .collect();
        call.push(args, &local, &jobs[*j].demands);
    }
    let sent_keys: Vec<&Vec<u8>> = used.iter().map(|&k| &keys[k]).collect();
    let answers: Vec<Vec<i64>> = sqlx::query_scalar("SELECT a FROM tollgate_decide($1, $2, $3, $4, $5) AS a")
        .bind(clock.map(|c| column(c.now_us())))
        .bind(&sent_keys)
        .bind(&call.req)
        .bind(&call.bk)
        .bind(&call.dm)
        .fetch_all(&mut *conn)
        .await?;
    if answers.len() != accepted.len() {
        return Err(StoreError::Unavailable(
            format!(
                "tollgate_decide answered {} of {} requests",
                answers.len(),
                accepted.len()
            )
            .into(),
        )
        .into());
    }
    for ((j, _), answer) in accepted.iter().zip(&answers) {
        let (j, job) = (*j, jobs[*j]);
        results[j] = match function::parse_answer(answer, job.buckets.len(), &job.demands) {
            Ok(function::Answer::Decided(applied)) => Some(Ok(applied)),
            Ok(function::Answer::Bad(e)) => Some(Err(e)),
            Ok(function::Answer::Again) => None,
            Err(e) => Some(Err(StoreError::Unavailable(e.into()))),
        };
    }
    Ok(results)
}

/// Why a batch's transaction failed.
struct Failure {
    error: StoreError,
    /// Whether the database refused a statement (rather than the connection failing, or the
    /// statement timing out): something in the batch's data may be at fault.
    refused: bool,
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Failure {
        let refused = matches!(&e, sqlx::Error::Database(d) if !ends_the_connection(d.as_ref()));
        Failure {
            error: store_error(e),
            refused,
        }
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Failure {
        Failure { error, refused: false }
    }
}

/// Whether an error PostgreSQL sent is about the connection rather than the statement's data:
/// the session ended ([`session_ended`]), or the statement was cancelled (57014, the statement
/// timeout). Either way the lane's connection is checked before it serves again.
fn ends_the_connection(d: &dyn sqlx::error::DatabaseError) -> bool {
    session_ended(d) || d.code().as_deref() == Some("57014")
}

/// The longest instance key stored as it is; a longer one (a descriptor value can be a header of
/// many KiB, and a btree index entry must stay under about 2.7 KB) is stored as [`DIGEST_TAG`]
/// and its SHA-256: stable across replicas, and no client can make two keys collide.
pub(crate) const MAX_VERBATIM_KEY: usize = 512;

/// The first byte of a stored digest; it never occurs in UTF-8 text, so a digest never equals a
/// key kept as it is.
pub(crate) const DIGEST_TAG: u8 = 0xFF;

/// The row key of instance key `key` (see [`MAX_VERBATIM_KEY`]).
pub(crate) fn stored_key(key: &str) -> Vec<u8> {
    if key.len() <= MAX_VERBATIM_KEY {
        return key.as_bytes().to_vec();
    }
    use sha2::Digest;
    let mut out = Vec::with_capacity(33);
    out.push(DIGEST_TAG);
    out.extend_from_slice(&sha2::Sha256::digest(key.as_bytes()));
    out
}

/// The distinct row keys of all `jobs`' buckets ([`stored_key`]), sorted (the order every
/// transaction locks in), and per job, per bucket, the index of its key.
pub(super) fn keys_of(jobs: &[&[BucketRef]]) -> (Vec<Vec<u8>>, Vec<Vec<usize>>) {
    let per_job: Vec<Vec<Vec<u8>>> = jobs
        .iter()
        .map(|buckets| buckets.iter().map(|b| stored_key(&b.key)).collect())
        .collect();
    let mut keys: Vec<Vec<u8>> = per_job.iter().flatten().cloned().collect();
    keys.sort_unstable();
    keys.dedup();
    let index = per_job
        .iter()
        .map(|job| {
            job.iter()
                .map(|k| keys.binary_search(k).expect("a key of the list"))
                .collect()
        })
        .collect();
    (keys, index)
}

/// One batch's transaction, for the jobs the function does not decide: lock (inserting what is
/// missing), read Postgres's clock, decide each job in turn in Rust, write, commit. Per job,
/// its decision, or why it was refused.
async fn transact(
    conn: &mut PgConnection,
    jobs: &[&Job],
    time_override: Option<&dyn Clock>,
) -> Result<Vec<Result<Applied, StoreError>>, Failure> {
    let buckets: Vec<&[BucketRef]> = jobs.iter().map(|j| j.buckets.as_slice()).collect();
    let (keys, index) = keys_of(&buckets);
    let mut tx = sqlx::Connection::begin(conn).await?;
    let (stored, clock) = lock_rows(&mut tx, &keys).await?;
    let now = match time_override {
        Some(c) => c.now_us(),
        None => u64::try_from(clock).unwrap_or(0),
    };
    let demands: Vec<&[Demand]> = jobs.iter().map(|j| j.demands.as_slice()).collect();
    let outcome = decide_batch(now, &stored, &buckets, &index, &demands);
    write_rows(&mut tx, &keys, &outcome.writes).await?;
    tx.commit().await?;
    Ok(outcome.results)
}

/// Per stored key of `keys` (sorted), its row locked in `tx` (inserted when missing) and read,
/// and Postgres's clock once the last lock was taken.
async fn lock_rows(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    keys: &[Vec<u8>],
) -> Result<(Vec<Result<Option<BucketState>, StoreError>>, i64), Failure> {
    // One statement takes every row and its lock, in ascending key order: it inserts the rows
    // first touches need (NULL state, read as full) or waits for whoever holds them. Each row's
    // clock is read once it is locked, so the latest is after every lock.
    let rows = sqlx::query(&format!(
        "INSERT INTO tollgate_buckets AS b (key) SELECT k FROM unnest($1::bytea[]) AS k ORDER BY k \
         ON CONFLICT (key) DO UPDATE SET tokens_ut = b.tokens_ut \
         RETURNING key, tokens_ut, updated_us, {CLOCK_US}"
    ))
    .bind(keys)
    .fetch_all(&mut **tx)
    .await?;
    if rows.len() != keys.len() {
        return Err(
            StoreError::Unavailable(format!("locked {} of {} bucket rows", rows.len(), keys.len()).into()).into(),
        );
    }
    let mut stored: Vec<Result<Option<BucketState>, StoreError>> = (0..keys.len()).map(|_| Ok(None)).collect();
    let mut clock = 0i64;
    for row in rows {
        let key: Vec<u8> = row.try_get(0)?;
        let tokens: Option<i64> = row.try_get(1)?;
        let updated: Option<i64> = row.try_get(2)?;
        clock = clock.max(row.try_get::<i64, _>(3)?);
        if let Ok(i) = keys.binary_search(&key) {
            stored[i] = row_state(&key, tokens, updated);
        }
    }
    Ok((stored, clock))
}

/// Writes a batch's `writes` to the locked rows of `keys` in `tx`, in one statement.
async fn write_rows(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    keys: &[Vec<u8>],
    writes: &[Write],
) -> Result<(), Failure> {
    let (mut gone, mut kept, mut tokens, mut updated, mut full_at) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for write in writes {
        match *write {
            Write::Delete(k) => gone.push(&keys[k]),
            Write::Update { key, state, full_at_us } => {
                kept.push(&keys[key]);
                tokens.push(column(state.tokens_ut));
                updated.push(column(state.updated_us));
                full_at.push(column(full_at_us));
            }
        }
    }
    // Writes in one statement: the deletes ride along as a data-modifying CTE.
    if !kept.is_empty() {
        let done = sqlx::query(
            "WITH gone AS (DELETE FROM tollgate_buckets WHERE key = ANY($5)) \
             UPDATE tollgate_buckets AS b SET tokens_ut = u.t, updated_us = u.u, full_at_us = u.f \
             FROM unnest($1::bytea[], $2::int8[], $3::int8[], $4::int8[]) AS u(k, t, u, f) WHERE b.key = u.k",
        )
        .bind(&kept)
        .bind(&tokens)
        .bind(&updated)
        .bind(&full_at)
        .bind(&gone)
        .execute(&mut **tx)
        .await?;
        // The rows are locked since the first statement: each must still be there.
        if done.rows_affected() != kept.len() as u64 {
            return Err(StoreError::Unavailable(
                format!("wrote {} of {} locked bucket rows", done.rows_affected(), kept.len()).into(),
            )
            .into());
        }
    } else if !gone.is_empty() {
        sqlx::query("DELETE FROM tollgate_buckets WHERE key = ANY($1)")
            .bind(&gone)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// What a batch writes for one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// Delete the row of key `.0` (its bucket is full, or a row created for nothing).
    Delete(usize),
    /// Store `state` for `key`, full again at `full_at_us` (`u64::MAX`: never).
    Update {
        key: usize,
        state: BucketState,
        full_at_us: u64,
    },
}

/// A batch's decisions and the writes they need.
#[derive(Debug)]
pub(crate) struct BatchOutcome {
    /// Per job, in order: its decision, or why it was refused.
    pub results: Vec<Result<Applied, StoreError>>,
    /// One per key that needs a write, in key order.
    pub writes: Vec<Write>,
}

/// Decides `jobs` one after the other at `now_us`, pure: `stored[k]` is key `k`'s stored state
/// (`None`: no state, a full bucket; `Err`: unreadable, which refuses the jobs that touch it,
/// as is a job that names one key twice);
/// job `j` has buckets `buckets[j]`, whose keys are `index[j]`, and demands `demands[j]`. A job
/// sees the states the jobs before it left. Each key changed by some job is written with the
/// last state and the "full again" time by the plan of the last job that changed it, or
/// deleted when that state is full; a key none changed whose row was created by this batch
/// (no state) is deleted.
pub(crate) fn decide_batch(
    now_us: u64,
    stored: &[Result<Option<BucketState>, StoreError>],
    buckets: &[&[BucketRef]],
    index: &[Vec<usize>],
    demands: &[&[Demand]],
) -> BatchOutcome {
    let mut current: Vec<Option<BucketState>> = stored.iter().map(|s| s.clone().ok().flatten()).collect();
    // Per key: the job and bucket that last changed it.
    let mut changed_by: Vec<Option<(usize, usize)>> = vec![None; stored.len()];
    let mut results = Vec::with_capacity(buckets.len());
    for (j, (job_buckets, job_index)) in buckets.iter().zip(index).enumerate() {
        if let Some(Err(e)) = job_index.iter().map(|&k| &stored[k]).find(|s| s.is_err()) {
            results.push(Err(e.clone()));
            continue;
        }
        // The store's contract is distinct instances; two buckets on one row would each be
        // decided from the same state and one write would be lost.
        if job_index.iter().enumerate().any(|(i, k)| job_index[..i].contains(k)) {
            results.push(Err(StoreError::Rejected(
                "a request named the same bucket instance twice".into(),
            )));
            continue;
        }
        let states: Vec<BucketState> = job_buckets
            .iter()
            .zip(job_index)
            .map(|(b, &k)| current[k].unwrap_or_else(|| BucketState::full(&b.plan.limit_at(now_us), now_us)))
            .collect();
        let plans: Vec<_> = job_buckets.iter().map(|b| &b.plan).collect();
        let decision = decide(now_us, &states, &plans, demands[j]);
        for (i, (out, &k)) in decision.instances.iter().zip(job_index).enumerate() {
            if out.changed {
                current[k] = Some(out.after);
                changed_by[k] = Some((j, i));
            }
        }
        results.push(Ok(Applied { now_us, decision }));
    }
    let mut writes = Vec::new();
    for (k, by) in changed_by.iter().enumerate() {
        match (by, current[k]) {
            (Some((j, i)), Some(state)) => match buckets[*j][*i].plan.full_at_us(state) {
                Some(at) if at <= state.updated_us => writes.push(Write::Delete(k)),
                at => writes.push(Write::Update {
                    key: k,
                    state,
                    full_at_us: at.unwrap_or(u64::MAX),
                }),
            },
            // Created by this batch (no state) and left unchanged: no row needed.
            (None, _) if matches!(stored[k], Ok(None)) => writes.push(Write::Delete(k)),
            _ => {}
        }
    }
    BatchOutcome { results, writes }
}

#[cfg(test)]
pub(super) mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::core::bucket::{DemandKind, Limit, Rate, MICRO};
    use crate::core::schedule::Plan;

    /// A bucket of 3 tokens refilled 3 a minute.
    pub(in crate::store::postgres) fn bucket(key: &str) -> BucketRef {
        BucketRef {
            lease_ut: 0,
            key: key.to_owned(),
            plan: Plan::Fixed(Limit::new(3, Rate::per(3, 60_000_000).unwrap())),
        }
    }

    /// A job: (key names, per demand (instance, kind 0 consume / 1 check / 2 refund, tokens)).
    type JobSpec = (Vec<usize>, Vec<(usize, u8, u64)>);

    fn job(spec: &JobSpec) -> (Vec<BucketRef>, Vec<Demand>) {
        let buckets = spec.0.iter().map(|k| bucket(&format!("k{k}"))).collect();
        let demands = spec
            .1
            .iter()
            .map(|&(instance, kind, n)| Demand {
                instance,
                kind: match kind {
                    0 => DemandKind::Consume(n * MICRO),
                    1 => DemandKind::Check,
                    _ => DemandKind::Refund(n * MICRO),
                },
                enforced: true,
            })
            .collect();
        (buckets, demands)
    }

    fn job_spec() -> impl Strategy<Value = JobSpec> {
        prop::sample::subsequence(vec![0usize, 1, 2, 3], 1..=3).prop_flat_map(|keys| {
            let n = keys.len();
            (Just(keys), prop::collection::vec((0..n, 0u8..3, 1u64..3), 1..4))
        })
    }

    /// Runs `jobs` as one batch over the store `rows` (key name to state), applying the writes.
    fn run(rows: &mut std::collections::BTreeMap<String, BucketState>, now: u64, jobs: &[JobSpec]) -> Vec<Applied> {
        let built: Vec<(Vec<BucketRef>, Vec<Demand>)> = jobs.iter().map(job).collect();
        let buckets: Vec<&[BucketRef]> = built.iter().map(|(b, _)| b.as_slice()).collect();
        let demands: Vec<&[Demand]> = built.iter().map(|(_, d)| d.as_slice()).collect();
        let (keys, index) = keys_of(&buckets);
        let stored: Vec<_> = keys
            .iter()
            .map(|k| Ok(rows.get(std::str::from_utf8(k).unwrap()).copied()))
            .collect();
        let outcome = decide_batch(now, &stored, &buckets, &index, &demands);
        for w in outcome.writes {
            match w {
                Write::Delete(k) => {
                    rows.remove(std::str::from_utf8(&keys[k]).unwrap());
                }
                Write::Update { key, state, .. } => {
                    rows.insert(String::from_utf8(keys[key].clone()).unwrap(), state);
                }
            }
        }
        outcome.results.into_iter().map(|r| r.unwrap()).collect()
    }

    /// The reference: `jobs` one at a time on `rows` with [`decide`] itself, as a store that
    /// holds one request's transaction at a time would: absent is full, a changed bucket is
    /// written (deleted when full by its plan), an unchanged one left as it is.
    fn one_by_one(
        rows: &mut std::collections::BTreeMap<String, BucketState>,
        now: u64,
        jobs: &[JobSpec],
    ) -> Vec<Applied> {
        let mut out = Vec::new();
        for spec in jobs {
            let (buckets, demands) = job(spec);
            let states: Vec<BucketState> = buckets
                .iter()
                .map(|b| {
                    rows.get(&b.key)
                        .copied()
                        .unwrap_or_else(|| BucketState::full(&b.plan.limit_at(now), now))
                })
                .collect();
            let plans: Vec<_> = buckets.iter().map(|b| &b.plan).collect();
            let decision = decide(now, &states, &plans, &demands);
            for (b, o) in buckets.iter().zip(&decision.instances) {
                if o.changed {
                    match b.plan.full_at_us(o.after) {
                        Some(at) if at <= o.after.updated_us => rows.remove(&b.key),
                        _ => rows.insert(b.key.clone(), o.after),
                    };
                }
            }
            out.push(Applied { now_us: now, decision });
        }
        out
    }

    proptest! {
        /// A batch decides what the same jobs decide one at a time, in order, at the same
        /// instant, and leaves the same rows.
        #[test]
        fn a_batch_decides_what_single_jobs_would(
            start in prop::collection::vec((0usize..4, 0u64..=3), 0..4),
            jobs in prop::collection::vec(job_spec(), 1..8),
        ) {
            let now = 1_000_000_000_000;
            let mut rows = std::collections::BTreeMap::new();
            for (k, tokens) in start {
                if tokens < 3 {
                    rows.insert(format!("k{k}"), BucketState { tokens_ut: tokens * MICRO, updated_us: now });
                }
            }
            let mut reference = rows.clone();
            let batched = run(&mut rows, now, &jobs);
            let single = one_by_one(&mut reference, now, &jobs);
            prop_assert_eq!(batched.len(), single.len());
            for (b, s) in batched.iter().zip(&single) {
                prop_assert_eq!(&b.decision, &s.decision);
            }
            prop_assert_eq!(rows, reference);
        }
    }

    #[test]
    fn an_unreadable_row_refuses_only_the_jobs_that_touch_it() {
        let a = [bucket("a")];
        let b = [bucket("b")];
        let take = [Demand {
            instance: 0,
            kind: DemandKind::Consume(MICRO),
            enforced: true,
        }];
        let buckets: Vec<&[BucketRef]> = vec![&a, &b];
        let (_, index) = keys_of(&buckets);
        let stored = vec![Err(StoreError::Rejected("negative".into())), Ok(None)];
        let outcome = decide_batch(5, &stored, &buckets, &index, &[&take, &take]);
        assert!(matches!(outcome.results[0], Err(StoreError::Rejected(_))));
        assert!(!outcome.results[1].as_ref().unwrap().decision.denied);
        assert_eq!(outcome.writes.len(), 1, "only b is written: {:?}", outcome.writes);
        assert!(matches!(outcome.writes[0], Write::Update { key: 1, .. }));
    }

    #[test]
    fn keys_are_locked_in_one_order_whatever_the_request_order() {
        let (ab, ab_index) = keys_of(&[&[bucket("a"), bucket("b")]]);
        let (ba, ba_index) = keys_of(&[&[bucket("b"), bucket("a")]]);
        assert_eq!(ab, ba);
        assert_eq!(ab_index, vec![vec![0, 1]]);
        assert_eq!(ba_index, vec![vec![1, 0]]);
    }
}
