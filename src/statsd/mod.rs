//! envoyproxy/ratelimit's stats over statsd (`metrics.statsd`; docs/monitoring.md, "statsd"),
//! through the cadence client: their names, their types (counters sent as what each gained
//! since the last flush, every `flush_interval_ms`, skipped when nothing was gained; the
//! response-time timer one sample per call, in whole milliseconds), their line format
//! (`name:value|c`, `name:value|ms`).
//!
//! The counters live in [`crate::telemetry::statsd`] (an atomic add on the decision path); a
//! thread of this module drains them at each flush. A timer sample is handed to cadence's
//! queuing sink, whose own thread sends it: a request never waits for the network, and when
//! the queue (`queue_lines`) is full the sample is dropped and counted in the next warning.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cadence::{Counted, MetricSink, QueuingMetricSink, StatsdClient, Timed};

use crate::telemetry::statsd::{self as counters, StatsdCounter};

mod net;
pub mod settings;

pub use settings::{StatsdProtocol, StatsdSettings};

use net::NetSink;

/// The sink in use, once [`start`] ran.
static SINK: OnceLock<Started> = OnceLock::new();

struct Started {
    /// Timer samples, through the queue.
    queued: StatsdClient,
    /// That queue, to see it drained at shutdown.
    queue: QueuingMetricSink,
    /// The counters' total of `ShouldRateLimit` calls.
    total_requests: StatsdCounter,
    /// [`counters::RESPONSE_TIME`] with the tags.
    response_time: String,
    net: NetSink,
    /// The client the flushing thread sends counters with (straight to the network sink).
    direct: StatsdClient,
    suffix: String,
    stopped: AtomicBool,
}

/// Starts sending to `settings.addr` (nothing when it is `None`): turns the statsd counters on
/// (call it before the rules are loaded, so their counters are made) and starts the flushing
/// thread. Never fails on an unreachable server: lines are dropped until it answers.
///
/// Errors: the thread could not be started.
pub fn start(settings: &StatsdSettings) -> std::io::Result<()> {
    let Some(addr) = &settings.addr else {
        return Ok(());
    };
    if SINK.get().is_some() {
        return Ok(());
    }
    counters::enable();
    let net = NetSink::new(addr, settings.protocol);
    let queue = QueuingMetricSink::with_capacity(net.clone(), settings.queue_lines.max(1));
    let suffix = settings.tag_suffix();
    let started = Started {
        queued: StatsdClient::from_sink("", queue.clone()),
        queue,
        total_requests: counters::counter(counters::TOTAL_REQUESTS),
        response_time: format!("{}{suffix}", counters::RESPONSE_TIME),
        net: net.clone(),
        direct: StatsdClient::from_sink("", net),
        suffix,
        stopped: AtomicBool::new(false),
    };
    if SINK.set(started).is_err() {
        return Ok(());
    }
    let every = settings.flush_interval_ms.duration().max(Duration::from_millis(1));
    std::thread::Builder::new()
        .name("statsd-flush".into())
        .spawn(move || flush_loop(every))?;
    tracing::info!(
        addr = %addr,
        protocol = ?settings.protocol,
        flush_interval_ms = settings.flush_interval_ms.0,
        "sending envoyproxy/ratelimit's stats to statsd"
    );
    Ok(())
}

/// Counts one `ShouldRateLimit` call that took `elapsed` (whatever its answer), in their
/// `ratelimit_server.ShouldRateLimit.total_requests` and `.response_time` (whole milliseconds,
/// rounded down, as theirs). Nothing without a sink.
pub fn count_call(elapsed: Duration) {
    let Some(s) = SINK.get() else { return };
    s.total_requests.add(1);
    let ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
    if s.queued.time(&s.response_time, ms).is_err() {
        s.net.dropped(1);
    }
}

/// Sends the counters' gains now and stops the flushing thread (at shutdown, so the last
/// interval is not lost).
pub fn stop() {
    let Some(s) = SINK.get() else { return };
    if !s.stopped.swap(true, Ordering::Relaxed) {
        // The samples still queued reach the network sink first (a short wait at most).
        let deadline = Instant::now() + Duration::from_millis(200);
        while s.queue.queued() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        flush_counters(s);
        let _ = s.net.flush();
    }
}

fn flush_counters(s: &Started) {
    counters::drain(|name, gained| {
        if s.direct.count(&format!("{name}{}", s.suffix), gained).is_err() {
            s.net.dropped(1);
        }
    });
}

/// Every `every`, the counters' gains; at least every second, whatever is gathered (timer
/// samples), as their library flushes its buffer every second.
fn flush_loop(every: Duration) {
    let Some(s) = SINK.get() else { return };
    let tick = every.min(Duration::from_secs(1));
    let mut next_counters = Instant::now() + every;
    while !s.stopped.load(Ordering::Relaxed) {
        std::thread::sleep(tick);
        if s.stopped.load(Ordering::Relaxed) {
            break;
        }
        if Instant::now() >= next_counters {
            flush_counters(s);
            next_counters += every;
            let now = Instant::now();
            if next_counters < now {
                next_counters = now + every;
            }
        }
        // Failures are counted and logged by the sink.
        let _ = s.net.flush();
    }
}
