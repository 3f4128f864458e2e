//! `tollgate-loadgen http` and `tollgate-loadgen upstream`: an open-loop HTTP/1.1 load generator
//! and the minimal upstream it is measured against (`scripts/bench-envoy`).
//!
//! Open loop: request `k` is due at `start + k / rate`, whatever happened to the requests before
//! it, and its latency is measured from that due time, not from when it was written to a socket.
//! A stall (in Envoy, the rate-limit service, or a connection all busy) then shows as latency of
//! every request that should have gone out during it, instead of silently lowering the rate a
//! closed loop would send (coordinated omission).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::{clock_ticks, emit, parse_duration, read_cpu, BoxError, CpuReading};

/// A request sent more than this after its due time counts as late (the generator fell
/// behind), and one that waited longer than this for a free connection as queued.
const LATE: Duration = Duration::from_millis(1);

/// How long requests still in flight when the schedule ends may take before they are given up
/// (and reported as unanswered).
const DRAIN: Duration = Duration::from_secs(10);

/// The due times of requests no more than this far ahead are handed out at once: sleeping for
/// less costs more than it gains (Linux's default timer slack is 50 µs).
const DISPATCH_AHEAD: Duration = Duration::from_micros(20);

/// `tollgate-loadgen http`'s arguments.
#[derive(Args, Clone)]
pub(crate) struct HttpArgs {
    /// The URL every request GETs; loopback only (`http://127.0.0.1:PORT/path`).
    #[arg(long)]
    url: String,
    /// Requests per second, on a fixed schedule (open loop).
    #[arg(long)]
    rate: f64,
    /// Length of the measured window (`10s`, `500ms`, `1m`): requests due in it are measured.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// Load at the same rate before the window, not measured.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    warmup: Duration,
    /// HTTP/1.1 keep-alive connections, each with one request in flight at a time; a due
    /// request waits for the first one free.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// A process whose CPU time in the measured window is reported (repeatable), in the order
    /// given.
    #[arg(long = "server-pid")]
    server_pids: Vec<u32>,
    /// Print one JSON object instead of the human summary.
    #[arg(long)]
    json: bool,
}

/// Where the requests go: a loopback address, the Host header and the path.
struct Target {
    addr: SocketAddr,
    authority: String,
    path: String,
}

impl Target {
    /// Parses `http://IP:PORT[/path]`; only loopback addresses, as the benchmark never leaves
    /// the machine.
    fn parse(url: &str) -> Result<Target, String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("bad --url `{url}`: an http:// URL, like http://127.0.0.1:10000/"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let addr: SocketAddr = authority
            .parse()
            .map_err(|_| format!("bad --url `{url}`: the host must be IP:PORT, like 127.0.0.1:10000"))?;
        if !addr.ip().is_loopback() {
            return Err(format!("bad --url `{url}`: only loopback addresses are load-tested"));
        }
        Ok(Target {
            addr,
            authority: authority.to_owned(),
            path: path.to_owned(),
        })
    }
}

/// One request of the schedule.
struct Job {
    /// When it should be sent; its latency counts from here.
    due: Instant,
}

/// The measured window: requests due in `[start, end)` are counted.
#[derive(Clone, Copy)]
struct Window {
    start: Instant,
    end: Instant,
}

impl Window {
    fn holds(&self, due: Instant) -> bool {
        due >= self.start && due < self.end
    }
}

/// What the measured window's requests came to.
struct HttpStats {
    /// From due time to the end of the response body, µs.
    latency_us: Histogram<u64>,
    /// From due time to the request leaving on a connection, µs.
    send_delay_us: Histogram<u64>,
    ok_2xx: u64,
    too_many_429: u64,
    other_status: BTreeMap<u16, u64>,
    errors: BTreeMap<String, u64>,
    first_error: Option<String>,
    /// Requests that waited longer than [`LATE`] for a free connection.
    queued: u64,
}

impl HttpStats {
    fn new() -> HttpStats {
        let histogram = || Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds");
        HttpStats {
            latency_us: histogram(),
            send_delay_us: histogram(),
            ok_2xx: 0,
            too_many_429: 0,
            other_status: BTreeMap::new(),
            errors: BTreeMap::new(),
            first_error: None,
            queued: 0,
        }
    }

    fn completed(&self) -> u64 {
        self.ok_2xx + self.too_many_429 + self.other_status.values().sum::<u64>() + self.error_count()
    }

    fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    fn error(&mut self, kind: &str, detail: String) {
        *self.errors.entry(kind.to_owned()).or_default() += 1;
        self.first_error.get_or_insert(detail);
    }
}

/// Microseconds, at least 1 (the histogram's lowest value).
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The due time of request `k` of a schedule at `rate` req/s from `start`.
fn due_time(start: Instant, rate: f64, k: u64) -> Instant {
    start + Duration::from_secs_f64(k as f64 / rate)
}

/// Requests in a schedule of `length` at `rate` req/s.
fn schedule_len(rate: f64, length: Duration) -> u64 {
    (rate * length.as_secs_f64()).ceil() as u64
}

/// Hands out `total` due requests at `rate` from `start` on a thread of its own: a tokio timer
/// has a 1 ms resolution, which would bunch 10 requests at 10,000 req/s and add up to 1 ms to
/// each. Returns how many requests due in `window` it handed out more than [`LATE`] after
/// their due time.
fn schedule(tx: mpsc::UnboundedSender<Job>, start: Instant, rate: f64, total: u64, window: Window) -> u64 {
    let mut late = 0;
    for k in 0..total {
        let due = due_time(start, rate, k);
        let now = Instant::now();
        if due > now + DISPATCH_AHEAD {
            std::thread::sleep(due - now);
        } else if now > due + LATE && window.holds(due) {
            late += 1;
        }
        if tx.send(Job { due }).is_err() {
            break;
        }
    }
    late
}

/// A keep-alive HTTP/1.1 connection to `addr`, Nagle off (a request is one small write).
async fn connect(addr: SocketAddr) -> Result<SendRequest<Empty<Bytes>>, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    stream.set_nodelay(true).map_err(|e| format!("TCP_NODELAY: {e}"))?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP/1.1 handshake with {addr}: {e}"))?;
    tokio::spawn(connection);
    Ok(sender)
}

/// One GET on `sender` (a new connection if it is gone); the status, body read to its end.
async fn get(sender: &mut Option<SendRequest<Empty<Bytes>>>, target: &Target) -> Result<u16, (&'static str, String)> {
    if sender.as_ref().is_none_or(|s| s.is_closed()) {
        *sender = Some(connect(target.addr).await.map_err(|e| ("connect", e))?);
    }
    let conn = sender.as_mut().expect("connected above");
    let request = hyper::Request::get(target.path.as_str())
        .header(hyper::header::HOST, target.authority.as_str())
        .body(Empty::new())
        .map_err(|e| ("request", e.to_string()))?;
    let outcome = async {
        conn.ready().await.map_err(|e| ("send", e.to_string()))?;
        let response = conn.send_request(request).await.map_err(|e| ("send", e.to_string()))?;
        let status = response.status().as_u16();
        response
            .into_body()
            .collect()
            .await
            .map_err(|e| ("body", e.to_string()))?;
        Ok(status)
    }
    .await;
    if outcome.is_err() {
        *sender = None;
    }
    outcome
}

/// Takes due requests, one at a time, on its own connection, until the schedule ends.
async fn worker(
    mut sender: Option<SendRequest<Empty<Bytes>>>,
    target: Arc<Target>,
    jobs: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Job>>>,
    window: Window,
    stats: Arc<Mutex<HttpStats>>,
) {
    loop {
        // Idle workers queue on the lock in order, so the next due request goes to the worker
        // idle the longest.
        let Some(job) = jobs.lock().await.recv().await else {
            return;
        };
        let sent = Instant::now();
        let result = get(&mut sender, &target).await;
        let done = Instant::now();
        if !window.holds(job.due) {
            continue;
        }
        let mut stats = stats.lock().expect("stats lock");
        let waited = sent.saturating_duration_since(job.due);
        stats.send_delay_us.saturating_record(micros(waited));
        stats.queued += u64::from(waited > LATE);
        match result {
            Ok(status) => {
                stats.latency_us.saturating_record(micros(done - job.due));
                match status {
                    200..=299 => stats.ok_2xx += 1,
                    429 => stats.too_many_429 += 1,
                    other => *stats.other_status.entry(other).or_default() += 1,
                }
            }
            Err((kind, detail)) => stats.error(kind, detail),
        }
    }
}

/// Runs `tollgate-loadgen http`: the schedule, then the report.
///
/// Errors: bad arguments, no connection, or no request of the window answered.
pub(crate) async fn http(args: HttpArgs) -> Result<(), BoxError> {
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return Err("--rate must be a number of requests per second above zero".into());
    }
    if args.connections == 0 || args.duration.is_zero() {
        return Err("--connections must be at least 1 and --duration longer than zero".into());
    }
    let target = Arc::new(Target::parse(&args.url)?);
    let clk_tck = clock_ticks();
    // Every connection is open before the first request is due: connecting is not measured.
    let mut senders = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        senders.push(connect(target.addr).await?);
    }
    let start = Instant::now() + Duration::from_millis(20);
    let window = Window {
        start: start + args.warmup,
        end: start + args.warmup + args.duration,
    };
    let total = schedule_len(args.rate, args.warmup + args.duration);
    let sent = total - schedule_len(args.rate, args.warmup);
    let (tx, rx) = mpsc::unbounded_channel();
    let rate = args.rate;
    let scheduler = std::thread::spawn(move || schedule(tx, start, rate, total, window));
    let jobs = Arc::new(tokio::sync::Mutex::new(rx));
    let stats = Arc::new(Mutex::new(HttpStats::new()));
    let workers: Vec<_> = senders
        .into_iter()
        .map(|s| tokio::spawn(worker(Some(s), target.clone(), jobs.clone(), window, stats.clone())))
        .collect();

    tokio::time::sleep_until(window.start.into()).await;
    let cpu_before = read_cpu(&args.server_pids, &[])?;
    tokio::time::sleep_until(window.end.into()).await;
    let cpu_after = read_cpu(&args.server_pids, &[])?;

    let late = tokio::task::spawn_blocking(move || scheduler.join())
        .await?
        .map_err(|_| "the scheduler thread panicked")?;
    let drain_deadline = tokio::time::Instant::now() + DRAIN;
    for w in workers {
        let abort = w.abort_handle();
        if tokio::time::timeout_at(drain_deadline, w).await.is_err() {
            abort.abort(); // a request hung past the drain: it stays unanswered
        }
    }
    let stats = std::mem::replace(&mut *stats.lock().expect("stats lock"), HttpStats::new());
    let report = HttpReport {
        args: &args,
        clk_tck,
        sent,
        late,
        stats: &stats,
        cpu_before: &cpu_before,
        cpu_after: &cpu_after,
    };
    let answered = stats.completed() > stats.error_count();
    emit(
        args.json,
        &report.json(),
        &report.human(),
        answered,
        stats.first_error.as_deref(),
        "request",
    )
}

/// What `tollgate-loadgen http` prints.
struct HttpReport<'a> {
    args: &'a HttpArgs,
    clk_tck: u64,
    /// Requests due in the window.
    sent: u64,
    /// Of those, handed out more than [`LATE`] after their due time.
    late: u64,
    stats: &'a HttpStats,
    cpu_before: &'a [CpuReading],
    cpu_after: &'a [CpuReading],
}

impl HttpReport<'_> {
    /// Per CPU reading (the generator's first): pid, CPU seconds in the window, µs per
    /// completed request, and the share of one core.
    fn cpu(&self) -> Vec<(Option<u32>, f64, f64, f64)> {
        let secs = self.args.duration.as_secs_f64();
        let completed = self.stats.completed().max(1) as f64;
        self.cpu_before
            .iter()
            .zip(self.cpu_after)
            .map(|(b, a)| {
                let cpu_s = a.ticks.saturating_sub(b.ticks) as f64 / self.clk_tck as f64;
                (b.pid, cpu_s, cpu_s * 1e6 / completed, cpu_s / secs)
            })
            .collect()
    }

    fn percentiles(h: &Histogram<u64>) -> serde_json::Value {
        let q = |q: f64| if h.is_empty() { 0 } else { h.value_at_quantile(q) };
        serde_json::json!({
            "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "p999": q(0.999),
            "max": h.max(), "mean": h.mean(),
        })
    }

    fn json(&self) -> serde_json::Value {
        use serde_json::json;
        let s = self.stats;
        let secs = self.args.duration.as_secs_f64();
        let cpu = self.cpu();
        let usage = |(pid, cpu_s, per_req, util): &(Option<u32>, f64, f64, f64)| json!({"pid": pid, "cpu_s": cpu_s, "cpu_us_per_req": per_req, "cpu_utilisation": util});
        json!({
            "url": self.args.url,
            "rate_rps": self.args.rate,
            "connections": self.args.connections,
            "warmup_s": self.args.warmup.as_secs_f64(),
            "duration_s": secs,
            "sent": self.sent,
            "completed": s.completed(),
            "unanswered": self.sent.saturating_sub(s.completed()),
            "achieved_rps": s.completed() as f64 / secs,
            "status_2xx": s.ok_2xx,
            "status_429": s.too_many_429,
            "status_other": s.other_status.values().sum::<u64>(),
            "other_statuses": s.other_status,
            "errors": s.error_count(),
            "error_kinds": s.errors,
            "first_error": s.first_error,
            "late": self.late,
            "queued": s.queued,
            "latency_us": Self::percentiles(&s.latency_us),
            "send_delay_us": Self::percentiles(&s.send_delay_us),
            "clk_tck": self.clk_tck,
            "client": usage(&cpu[0]),
            "servers": cpu[1..].iter().map(usage).collect::<Vec<_>>(),
        })
    }

    fn human(&self) -> String {
        let j = self.json();
        let l = &j["latency_us"];
        let mut out = format!(
            "{} at {} req/s over {} connections, window {:.2}s: sent {} completed {} ({:.0} req/s) \
             2xx {} 429 {} other {} errors {} unanswered {} late {} queued {}\n\
             latency us (from due time)  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}\n",
            self.args.url,
            self.args.rate,
            self.args.connections,
            j["duration_s"],
            j["sent"],
            j["completed"],
            j["achieved_rps"].as_f64().unwrap_or(0.0),
            j["status_2xx"],
            j["status_429"],
            j["status_other"],
            j["errors"],
            j["unanswered"],
            j["late"],
            j["queued"],
            l["p50"],
            l["p90"],
            l["p99"],
            l["p999"],
            l["max"],
        );
        if let Some(e) = &self.stats.first_error {
            out += &format!("  first error: {e}\n");
        }
        for (i, (pid, cpu_s, per_req, util)) in self.cpu().into_iter().enumerate() {
            let name = if i == 0 {
                "loadgen".to_owned()
            } else {
                format!("pid {}", pid.unwrap_or(0))
            };
            out += &format!(
                "cpu {name}: {cpu_s:.2}s ({:.0}% of one core), {per_req:.2} us/request\n",
                util * 100.0
            );
        }
        out
    }
}

/// Serves `tollgate-loadgen upstream`: `200 ok` to every request, on HTTP/1.1, until SIGINT or
/// SIGTERM; the cheapest upstream Envoy can route to, so the figures are Envoy's and the
/// rate-limit service's.
pub(crate) async fn upstream(listen: SocketAddr) -> Result<(), BoxError> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let bound = listener.local_addr().unwrap_or(listen);
    eprintln!("tollgate-loadgen upstream: listening on {bound} (HTTP/1.1)");
    let app = axum::Router::new().fallback(|| async { "ok\n" });
    axum::serve(listener, app)
        .with_graceful_shutdown(tollgate::server::shutdown_signal())
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_times_follow_the_rate_from_start() {
        let start = Instant::now();
        assert_eq!(due_time(start, 2000.0, 0), start);
        assert_eq!(due_time(start, 2000.0, 1), start + Duration::from_micros(500));
        assert_eq!(due_time(start, 2000.0, 4000), start + Duration::from_secs(2));
        assert_eq!(schedule_len(2000.0, Duration::from_secs(3)), 6000);
        assert_eq!(schedule_len(3.0, Duration::from_millis(500)), 2);
    }

    #[test]
    fn targets_are_loopback_urls() {
        let t = Target::parse("http://127.0.0.1:10000/bench").expect("a loopback URL");
        assert_eq!(
            (t.addr.port(), t.authority.as_str(), t.path.as_str()),
            (10000, "127.0.0.1:10000", "/bench")
        );
        assert_eq!(Target::parse("http://[::1]:80").expect("IPv6 loopback").path, "/");
        for bad in [
            "https://127.0.0.1:1/",
            "http://10.0.0.1:80/",
            "http://localhost:80/",
            "127.0.0.1:80",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad} accepted");
        }
    }

    /// The scheduler hands out every request of its schedule, none before it is due.
    #[test]
    fn the_schedule_hands_out_every_request_when_due() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let start = Instant::now() + Duration::from_millis(5);
        let window = Window {
            start,
            end: start + Duration::from_millis(50),
        };
        let late = schedule(tx, start, 1000.0, 50, window);
        let mut n = 0;
        while let Ok(job) = rx.try_recv() {
            assert_eq!(job.due, due_time(start, 1000.0, n));
            n += 1;
        }
        assert_eq!(n, 50);
        assert!(
            Instant::now() >= due_time(start, 1000.0, 49),
            "returned before the last was due"
        );
        assert!(late <= n, "{late} late of {n}");
    }
}
