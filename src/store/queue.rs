//! How a batching lane (the Redis and Postgres stores' `batch` lanes) fills its batch from the
//! queue of waiting requests. No timer: a batch never waits for requests that are not there.

use tokio::sync::mpsc;

/// Moves the jobs waiting in `rx` into `jobs` (up to `max` in all); unless that fills the
/// batch, lets the runtime's ready tasks run twice and takes what they queued meanwhile.
///
/// Why twice: a request takes two turns from bytes on its connection to a queued job (the
/// connection task reads it, then the request's own task queues it), so the requests that
/// arrived together join one call. Idle, nothing else is ready and this returns at once; under
/// load each call carries more requests (26 instead of 10 at 64 streams on Redis,
/// benches/README.md).
pub(crate) async fn gather<J>(rx: &mut mpsc::UnboundedReceiver<J>, jobs: &mut Vec<J>, max: usize) {
    take_waiting(rx, jobs, max);
    if jobs.len() < max {
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        take_waiting(rx, jobs, max);
    }
}

fn take_waiting<J>(rx: &mut mpsc::UnboundedReceiver<J>, jobs: &mut Vec<J>, max: usize) {
    while jobs.len() < max {
        match rx.try_recv() {
            Ok(job) => jobs.push(job),
            Err(_) => break,
        }
    }
}
