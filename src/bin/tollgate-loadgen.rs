//! `tollgate-loadgen`: a gRPC load generator for `envoy.service.ratelimit.v3.RateLimitService`,
//! and a no-op `RateLimitService` on the same server stack as `tollgate serve`, so that the two
//! can be measured side by side (see `benches/README.md` and `scripts/bench-compare`).
//!
//! - `run`: drives `--concurrency` request loops over `--connections` HTTP/2 channels, each
//!   request with `--descriptors` descriptors whose values are drawn from `--keys` values
//!   (`--distribution sequential`, `uniform` or `zipf` with `--zipf-s`), or with `--shape envoy`
//!   the four descriptors of a typical Envoy route (see [`ENVOY_PATHS`]), for `--duration` (or
//!   `--requests`) after `--warmup`; then reports throughput, response codes, latency
//!   percentiles (p50, p90, p99, p99.9, max) and the CPU time each `--server-pid` (a process)
//!   or `--server-tree` (a process and all below it: a PostgreSQL cluster) and the load
//!   generator itself spent per request in the measured window; `--json` for one JSON object.
//! - `noop`: answers every request `OK`, one `OK` status per descriptor, nothing else, on
//!   tollgate's own server stack and runtime choice: the ceiling every figure is compared to.
//! - `http`: GETs a URL at a fixed open-loop `--rate` (requests per second) over `--connections`
//!   HTTP/1.1 connections, latency counted from each request's due time; `upstream`: answers
//!   every HTTP request `200`. Both for `scripts/bench-envoy` (see [`open_loop`]).

// A file of its own in a directory named after the binary; a binary root finds modules beside
// it (src/bin/), so the path is given.
#[path = "tollgate-loadgen/open_loop.rs"]
mod open_loop;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// mimalloc, not the system allocator: a request's short-lived buffers (HTTP/2 frames, protobuf
// messages, Redis commands and replies) cost markedly less CPU to allocate and free; see
// benches/README.md. The no-op server in tollgate-loadgen uses the same, so it stays a fair
// ceiling.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Args, Parser, Subcommand};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use hdrhistogram::Histogram;
use tokio::net::TcpListener;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

#[derive(Parser)]
#[command(
    name = "tollgate-loadgen",
    version,
    about = "Load generator and no-op server for Envoy's RateLimitService"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Drive ShouldRateLimit calls at a server and report throughput, latency and CPU/request.
    Run(RunArgs),
    /// Serve a RateLimitService that answers OK to everything, on tollgate's server stack.
    Noop {
        /// Address to listen on for gRPC.
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: SocketAddr,
        /// The runtime, as `tollgate serve`'s `runtime` setting (the same default), so the
        /// ceiling runs on what tollgate runs on.
        #[arg(long, value_enum, default_value_t = tollgate::server::settings::RuntimeFlavor::Auto)]
        runtime: tollgate::server::settings::RuntimeFlavor,
    },
    /// GET a URL at a fixed rate (open loop) and report latency from each request's due time,
    /// response codes and CPU/request.
    Http(open_loop::HttpArgs),
    /// Serve HTTP/1.1 answering 200 to every request: an upstream for Envoy.
    Upstream {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8082")]
        listen: SocketAddr,
    },
}

#[derive(Args, Clone)]
struct RunArgs {
    /// The server, e.g. http://127.0.0.1:8081.
    #[arg(long)]
    target: String,
    /// Concurrent request loops; each has one call in flight at a time.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// HTTP/2 connections the loops are spread over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Length of the measured window (`10s`, `500ms`, `1m`).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// Load before the measured window, not counted. `0s`: no warmup, and the window opens
    /// before the first request is sent, so every call answered in it is counted (as an
    /// exactness check needs).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    warmup: Duration,
    /// The request domain.
    #[arg(long, default_value = "bench")]
    domain: String,
    /// The descriptor entry key.
    #[arg(long, default_value = "k")]
    key: String,
    /// Distinct entry values ("0" .. keys-1): the key cardinality.
    #[arg(long, default_value_t = 1000)]
    keys: usize,
    /// How each descriptor's value is drawn from the `--keys` values: `sequential` (every
    /// value in turn, shared by all loops: each is used equally often), `uniform` (at random),
    /// or `zipf` (at random, value `i` with weight 1/(i+1)^s: a few hot keys and a long tail).
    #[arg(long, value_enum, default_value_t = Distribution::Sequential)]
    distribution: Distribution,
    /// The exponent `s` of `--distribution zipf` (0: uniform; 1: classic Zipf).
    #[arg(long, default_value_t = 1.0)]
    zipf_s: f64,
    /// Descriptors per request, each with its own value drawn as above (`--shape single` only).
    #[arg(long, default_value_t = 1)]
    descriptors: usize,
    /// What a request carries. `single`: `--descriptors` one-entry descriptors `(--key, <i>)`.
    /// `envoy`: the four descriptors a typical Envoy route sends (benches/rules/envoy-shape.yaml,
    /// domain `bench_envoy`): `[remote_address=10.0.x.y]`, `[api_key=<key>, path=<one of 8>]`,
    /// `[generic_key=global]` and `[header_match=premium, tenant=<one of 50>]`, where a client
    /// `i` drawn from `--keys` as above gives the address, the API key and the tenant (`i` mod
    /// 50), and the path rotates over the eight per request loop; `--key` is not used.
    /// `gateway`: one descriptor as Envoy Gateway sends for a route rule with a client selector,
    /// `[httproute/default/route-<r>/rule/0/match/0/*=<same>, rule-0-match-0=<i>]`, where `i` is
    /// drawn from `--keys` as above and `r` is `i` mod `--routes` (the rules:
    /// `scripts/bench-compare` with `SHAPE=gateway` writes them).
    #[arg(long, value_enum, default_value_t = ShapeKind::Single)]
    shape: ShapeKind,
    /// Routes of `--shape gateway`.
    #[arg(long, default_value_t = 10)]
    routes: usize,
    /// End the measured window after this many requests were sent in it (or after
    /// `--duration`, whichever comes first), at the last answer: to touch every key of a
    /// `sequential` run once (with `--descriptors d`, every `d` keys). Calls already in flight
    /// when the window opens are counted too: up to `--concurrency` more.
    #[arg(long)]
    requests: Option<u64>,
    /// Seed of the random draws (each loop adds its index), so runs can be repeated.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The request's hits_addend (0 means 1 to the server).
    #[arg(long, default_value_t = 0)]
    hits_addend: u32,
    /// gRPC metadata every call carries, `KEY=VALUE` (repeatable): a trace context, say
    /// `traceparent=00-<trace id>-<span id>-00`, as Envoy sends for a request it does not sample.
    #[arg(long = "metadata", value_parser = parse_metadata)]
    metadata: Vec<(String, String)>,
    /// A server process whose CPU time in the measured window is reported (repeatable).
    #[arg(long = "server-pid")]
    server_pids: Vec<u32>,
    /// A server made of several processes (PostgreSQL: a postmaster and a backend per
    /// connection), counted as this process, every descendant, and the children they reaped
    /// (repeatable).
    #[arg(long = "server-tree")]
    server_trees: Vec<u32>,
    /// Print one JSON object instead of the human summary.
    #[arg(long)]
    json: bool,
}

/// What a request carries (`--shape`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ShapeKind {
    Single,
    Envoy,
    Gateway,
}

impl ShapeKind {
    fn name(self) -> &'static str {
        match self {
            ShapeKind::Single => "single",
            ShapeKind::Envoy => "envoy",
            ShapeKind::Gateway => "gateway",
        }
    }
}

/// The paths of `--shape envoy`'s `[api_key, path]` descriptor: a small API's routes.
const ENVOY_PATHS: [&str; 8] = [
    "/api/v1/users",
    "/api/v1/users/me",
    "/api/v1/orders",
    "/api/v1/orders/search",
    "/api/v1/products",
    "/api/v1/cart",
    "/api/v1/checkout",
    "/api/v1/auth/token",
];

/// The distinct tenants of `--shape envoy`'s `[header_match=premium, tenant]` descriptor.
const ENVOY_TENANTS: usize = 50;

/// Clients `--shape envoy` can tell apart: one IPv4 address each in 10.0.0.0/8.
const ENVOY_MAX_KEYS: usize = 1 << 24;

impl RunArgs {
    /// Descriptors per request.
    fn shape_descriptors(&self) -> usize {
        match self.shape {
            ShapeKind::Single => self.descriptors,
            ShapeKind::Envoy => 4,
            ShapeKind::Gateway => 1,
        }
    }
}

/// How descriptor values are drawn (`--distribution`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Distribution {
    Sequential,
    Uniform,
    Zipf,
}

impl Distribution {
    fn name(self) -> &'static str {
        match self {
            Distribution::Sequential => "sequential",
            Distribution::Uniform => "uniform",
            Distribution::Zipf => "zipf",
        }
    }
}

/// Draws the index (0 .. keys-1) of each descriptor's value, per request loop.
enum KeyDraw {
    /// The next of a counter shared by all loops.
    Sequential(Arc<AtomicUsize>),
    Uniform(rand::rngs::SmallRng),
    Zipf(rand::rngs::SmallRng, rand_distr::Zipf<f64>),
}

impl KeyDraw {
    fn new(args: &RunArgs, counter: &Arc<AtomicUsize>, loop_index: usize) -> Result<KeyDraw, String> {
        use rand::SeedableRng;
        // Loops of one run differ, and so do runs whose seeds differ by one (bench-keys).
        let seed = args
            .seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(loop_index as u64);
        let rng = || rand::rngs::SmallRng::seed_from_u64(seed);
        Ok(match args.distribution {
            Distribution::Sequential => KeyDraw::Sequential(counter.clone()),
            Distribution::Uniform => KeyDraw::Uniform(rng()),
            Distribution::Zipf => {
                let zipf = rand_distr::Zipf::new(args.keys as f64, args.zipf_s)
                    .map_err(|e| format!("--distribution zipf with --zipf-s {}: {e}", args.zipf_s))?;
                KeyDraw::Zipf(rng(), zipf)
            }
        })
    }

    fn next(&mut self, keys: usize) -> usize {
        use rand::Rng;
        match self {
            KeyDraw::Sequential(counter) => counter.fetch_add(1, Ordering::Relaxed) % keys,
            KeyDraw::Uniform(rng) => rng.random_range(0..keys),
            // Zipf draws ranks 1 ..= keys.
            KeyDraw::Zipf(rng, zipf) => (rng.sample(*zipf) as usize).clamp(1, keys) - 1,
        }
    }
}

/// Parses `<number><unit>` with unit `ms`, `s` or `m`; the number may have a fraction. The unit
/// is required: a bare `500` could mean seconds or milliseconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("bad duration `{text}`: expected a number and a unit (ms, s, m), like 10s"))?;
    let secs = match unit {
        "ms" => number / 1000.0,
        "" => {
            return Err(format!(
                "bad duration `{text}`: no unit; say `{text}s` or `{text}ms` (ms, s, m)"
            ))
        }
        "s" => number,
        "m" => number * 60.0,
        _ => return Err(format!("bad duration `{text}`: unknown unit `{unit}` (ms, s, m)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("bad duration `{text}`: {e}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The no-op server on the very runtime `tollgate serve` would pick; the load generator on
    // a multi-thread one.
    let runtime = match cli.command {
        Command::Noop { runtime, .. } => tollgate::server::runtime(runtime),
        Command::Run(_) => tokio::runtime::Runtime::new(),
        // Both run pinned to one core: a second worker thread would only contend for it.
        Command::Http(_) | Command::Upstream { .. } => {
            tokio::runtime::Builder::new_current_thread().enable_all().build()
        }
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Run(args) => runtime.block_on(run(args)),
        Command::Noop { listen, .. } => runtime.block_on(noop(listen)),
        Command::Http(args) => runtime.block_on(open_loop::http(args)),
        Command::Upstream { listen } => runtime.block_on(open_loop::upstream(listen)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate-loadgen: {e}");
            ExitCode::FAILURE
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// noop

/// Answers OK, with one OK status per descriptor, and nothing else.
struct Noop;

#[tonic::async_trait]
impl RateLimitService for Noop {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        let statuses = req
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses,
            ..Default::default()
        }))
    }
}

/// Serves [`Noop`] on exactly tollgate's gRPC stack (`tollgate::server::serve_rate_limit_service`)
/// until SIGINT or SIGTERM.
async fn noop(listen: SocketAddr) -> Result<(), BoxError> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let bound = listener.local_addr().unwrap_or(listen);
    eprintln!("tollgate-loadgen noop: listening on {bound} (gRPC)");
    tollgate::server::serve_rate_limit_service(listener, Noop, tollgate::server::shutdown_signal()).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// run

const WARMUP: u8 = 0;
const MEASURE: u8 = 1;
const STOP: u8 = 2;

/// What one request loop saw in the measured window.
struct LoopStats {
    latency_us: Histogram<u64>,
    ok: u64,
    over_limit: u64,
    unknown_code: u64,
    /// Descriptor statuses in the answers.
    statuses: u64,
    /// Answers whose statuses were not one per descriptor sent.
    status_mismatches: u64,
    errors: BTreeMap<String, u64>,
    first_error: Option<String>,
}

impl LoopStats {
    fn new() -> LoopStats {
        LoopStats {
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds"),
            ok: 0,
            over_limit: 0,
            unknown_code: 0,
            statuses: 0,
            status_mismatches: 0,
            errors: BTreeMap::new(),
            first_error: None,
        }
    }

    fn merge(&mut self, other: LoopStats) {
        self.latency_us.add(&other.latency_us).expect("same histogram bounds");
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        self.unknown_code += other.unknown_code;
        self.statuses += other.statuses;
        self.status_mismatches += other.status_mismatches;
        for (code, n) in other.errors {
            *self.errors.entry(code).or_default() += n;
        }
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

async fn connect(target: &str) -> Result<Channel, BoxError> {
    if !target.starts_with("http://") {
        // No TLS in this build: an https:// target could only fail after the retries.
        return Err(format!("bad target `{target}`: an http:// URL (h2c), like http://127.0.0.1:8081").into());
    }
    let endpoint = Endpoint::from_shared(target.to_owned())
        .map_err(|e| format!("bad target `{target}`: {e}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2));
    // The server may still be starting: retry for a few seconds.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match endpoint.connect().await {
            Ok(ch) => return Ok(ch),
            Err(e) if Instant::now() >= deadline => {
                // tonic's own text is only "transport error": the cause is in the chain.
                return Err(format!("cannot connect to {target}: {}", tollgate::error_chain(&e)).into());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// What every request of a run shares.
struct Shape {
    kind: ShapeKind,
    domain: String,
    key: String,
    keys: usize,
    /// Descriptors per request (four for `envoy`).
    descriptors: usize,
    /// `--routes` (`gateway`).
    routes: usize,
    hits_addend: u32,
    /// `--metadata`, sent with every call.
    metadata: tonic::metadata::MetadataMap,
}

/// A descriptor of `entries`.
fn descriptor<const N: usize>(entries: [(&str, String); N]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .into_iter()
            .map(|(key, value)| Entry {
                key: key.to_owned(),
                value,
            })
            .collect(),
        ..Default::default()
    }
}

impl Shape {
    /// The next request of a loop: `--shape single`, `descriptors` descriptors, each
    /// `(key, <drawn index>)`; `--shape envoy`, see [`Shape::envoy_descriptors`]. `sent` counts
    /// the loop's requests so far.
    fn request(&self, draw: &mut KeyDraw, sent: u64) -> RateLimitRequest {
        let descriptors = match self.kind {
            ShapeKind::Single => (0..self.descriptors)
                .map(|_| descriptor([(self.key.as_str(), draw.next(self.keys).to_string())]))
                .collect(),
            ShapeKind::Envoy => Shape::envoy_descriptors(draw.next(self.keys), sent),
            ShapeKind::Gateway => {
                let i = draw.next(self.keys);
                let route = format!("httproute/default/route-{}/rule/0/match/0/*", i % self.routes);
                vec![descriptor([
                    (route.as_str(), route.clone()),
                    ("rule-0-match-0", i.to_string()),
                ])]
            }
        };
        RateLimitRequest {
            domain: self.domain.clone(),
            descriptors,
            hits_addend: self.hits_addend,
        }
    }

    /// What an Envoy route with four `rate_limits` entries sends for client `client` (its
    /// address, API key and tenant) on the loop's `sent`-th request (the path):
    ///
    /// 1. `remote_address`: the client's address, `10.0.x.y` (a per-client limit);
    /// 2. `request_headers` x-api-key and path: `[api_key, path]`, nested (a per key and path
    ///    limit under the per-key node);
    /// 3. `generic_key` without a `descriptor_key`: `[generic_key=global]`, one bucket every
    ///    request shares;
    /// 4. `header_value_match` then `request_headers` x-tenant: `[header_match=premium,
    ///    tenant]`, nested (a per-tenant limit for premium traffic).
    fn envoy_descriptors(client: usize, sent: u64) -> Vec<RateLimitDescriptor> {
        let ip = format!(
            "10.{}.{}.{}",
            (client >> 16) & 0xff,
            (client >> 8) & 0xff,
            client & 0xff
        );
        let api_key = format!("ak_live_{client:016x}");
        // The path rotates with the loop's count, offset by the client, so every client sees
        // every path whatever the distribution.
        let path = ENVOY_PATHS[(client as u64).wrapping_add(sent) as usize % ENVOY_PATHS.len()];
        let tenant = format!("tenant-{:02}", client % ENVOY_TENANTS);
        vec![
            descriptor([("remote_address", ip)]),
            descriptor([("api_key", api_key), ("path", path.to_owned())]),
            descriptor([("generic_key", "global".to_owned())]),
            descriptor([("header_match", "premium".to_owned()), ("tenant", tenant)]),
        ]
    }
}

/// Requests sent in the measured window, against `--requests`.
struct Budget {
    sent: AtomicU64,
    limit: u64,
    /// When the latest call answered in the window was answered, in µs since `base`: where a
    /// `--requests` window ends.
    base: Instant,
    last_done_us: AtomicU64,
}

async fn request_loop(
    mut client: RateLimitServiceClient<Channel>,
    shape: Arc<Shape>,
    mut draw: KeyDraw,
    phase: Arc<AtomicU8>,
    budget: Arc<Budget>,
) -> LoopStats {
    let mut stats = LoopStats::new();
    let per_request = shape.descriptors;
    let mut sent = 0u64;
    loop {
        let p = phase.load(Ordering::Relaxed);
        if p == STOP || (p == MEASURE && budget.sent.fetch_add(1, Ordering::Relaxed) >= budget.limit) {
            return stats;
        }
        let req = Request::from_parts(
            shape.metadata.clone(),
            tonic::Extensions::new(),
            shape.request(&mut draw, sent),
        );
        sent += 1;
        let started = Instant::now();
        let result = client.should_rate_limit(req).await;
        let elapsed = started.elapsed();
        // A call counts when it completes inside the measured window.
        if phase.load(Ordering::Relaxed) != MEASURE {
            continue;
        }
        let done = u64::try_from(budget.base.elapsed().as_micros()).unwrap_or(u64::MAX);
        budget.last_done_us.fetch_max(done, Ordering::Relaxed);
        match result {
            Ok(resp) => {
                let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX).max(1);
                stats.latency_us.saturating_record(us);
                let statuses = resp.get_ref().statuses.len();
                stats.statuses += statuses as u64;
                stats.status_mismatches += u64::from(statuses != per_request);
                match Code::try_from(resp.get_ref().overall_code) {
                    Ok(Code::Ok) => stats.ok += 1,
                    Ok(Code::OverLimit) => stats.over_limit += 1,
                    _ => stats.unknown_code += 1,
                }
            }
            Err(status) => {
                *stats.errors.entry(format!("{:?}", status.code())).or_default() += 1;
                if stats.first_error.is_none() {
                    stats.first_error = Some(status.to_string());
                }
            }
        }
    }
}

/// Clock ticks per second for `/proc/PID/stat` (`getconf CLK_TCK`; 100 if that fails).
fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&t| t > 0)
        .unwrap_or(100)
}

/// The fields of `/proc/<pid>/stat` from field 3 (state) on. The command name (field 2) is in
/// parentheses and may hold spaces, so fields resume after the last ')'.
fn stat_fields(pid: &str) -> Result<Vec<String>, String> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| format!("unexpected {path}"))?;
    Ok(rest.split_whitespace().map(str::to_owned).collect())
}

/// Field `n` (1-based, as in proc(5)) of `fields` from [`stat_fields`].
fn stat_field(fields: &[String], n: usize) -> Option<u64> {
    fields.get(n - 3).and_then(|f| f.parse().ok())
}

/// utime + stime of a process (all its threads), in clock ticks. `pid` is a number or `self`.
fn cpu_ticks(pid: &str) -> Result<u64, String> {
    let fields = stat_fields(pid)?;
    match (stat_field(&fields, 14), stat_field(&fields, 15)) {
        (Some(utime), Some(stime)) => Ok(utime + stime),
        _ => Err(format!("unexpected /proc/{pid}/stat: no utime or stime")),
    }
}

/// utime + stime + cutime + cstime of `root` and of every process below it, in clock ticks:
/// a process tree's CPU, counting children that exited and were reaped in the window through
/// their parent's cutime and cstime.
fn tree_cpu_ticks(root: u32) -> Result<u64, String> {
    let mut parent_of = Vec::new();
    let mut ticks_of = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc")
        .map_err(|e| format!("cannot list /proc: {e}"))?
        .flatten()
    {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        // A process may exit between the listing and the read.
        let Ok(fields) = stat_fields(&pid.to_string()) else {
            continue;
        };
        let ticks: u64 = [14, 15, 16, 17].iter().filter_map(|&n| stat_field(&fields, n)).sum();
        if let Some(ppid) = stat_field(&fields, 4) {
            parent_of.push((pid, ppid as u32));
        }
        ticks_of.insert(pid, ticks);
    }
    if !ticks_of.contains_key(&root) {
        return Err(format!("no process {root}"));
    }
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(parent_of.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    Ok(tree.iter().filter_map(|p| ticks_of.get(p)).sum())
}

struct CpuReading {
    name: String,
    pid: Option<u32>,
    ticks: u64,
}

fn read_cpu(pids: &[u32], trees: &[u32]) -> Result<Vec<CpuReading>, String> {
    let mut out = Vec::with_capacity(pids.len() + trees.len() + 1);
    out.push(CpuReading {
        name: "loadgen".into(),
        pid: None,
        ticks: cpu_ticks("self")?,
    });
    for &pid in pids {
        out.push(CpuReading {
            name: format!("server {pid}"),
            pid: Some(pid),
            ticks: cpu_ticks(&pid.to_string())?,
        });
    }
    for &pid in trees {
        out.push(CpuReading {
            name: format!("server tree {pid}"),
            pid: Some(pid),
            ticks: tree_cpu_ticks(pid)?,
        });
    }
    Ok(out)
}

/// A `--metadata` argument, `KEY=VALUE`.
fn parse_metadata(arg: &str) -> Result<(String, String), String> {
    let (key, value) = arg.split_once('=').ok_or("expected KEY=VALUE")?;
    Ok((key.trim().to_ascii_lowercase(), value.to_owned()))
}

/// The `--metadata` pairs as gRPC metadata (ASCII entries).
///
/// Errors: a key or value gRPC metadata cannot carry.
fn metadata_map(pairs: &[(String, String)]) -> Result<tonic::metadata::MetadataMap, BoxError> {
    let mut map = tonic::metadata::MetadataMap::new();
    for (key, value) in pairs {
        let name: tonic::metadata::AsciiMetadataKey =
            key.parse().map_err(|_| format!("--metadata: bad key {key:?}"))?;
        map.insert(
            name,
            value.parse().map_err(|_| format!("--metadata: bad value for {key}"))?,
        );
    }
    Ok(map)
}

async fn run(args: RunArgs) -> Result<(), BoxError> {
    check_run_args(&args)?;
    let clk_tck = clock_ticks();
    let mut channels = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        channels.push(connect(&args.target).await?);
    }
    let budget = Arc::new(Budget {
        sent: AtomicU64::new(0),
        limit: args.requests.unwrap_or(u64::MAX),
        base: Instant::now(),
        last_done_us: AtomicU64::new(0),
    });
    let shape = Arc::new(Shape {
        kind: args.shape,
        domain: args.domain.clone(),
        key: args.key.clone(),
        keys: args.keys,
        descriptors: args.shape_descriptors(),
        routes: args.routes,
        hits_addend: args.hits_addend,
        metadata: metadata_map(&args.metadata)?,
    });
    let next = Arc::new(AtomicUsize::new(0));
    let draws = (0..args.concurrency)
        .map(|i| KeyDraw::new(&args, &next, i))
        .collect::<Result<Vec<_>, _>>()?;
    // Without a warmup the window opens before the first request is sent: a call answered
    // while the phase still said WARMUP would be served and never counted (an exactness check
    // then sees 999 of 1,000 admissions).
    let open_window = || read_cpu(&args.server_pids, &args.server_trees).map(|cpu| (cpu, Instant::now()));
    let warm = !args.warmup.is_zero();
    let opened = if warm { None } else { Some(open_window()?) };
    let phase = Arc::new(AtomicU8::new(if warm { WARMUP } else { MEASURE }));
    let loops = spawn_loops(draws, &channels, &shape, &phase, &budget);

    let (cpu_before, started) = match opened {
        Some(opened) => opened,
        None => {
            tokio::time::sleep(args.warmup).await;
            let opened = open_window()?;
            phase.store(MEASURE, Ordering::Relaxed);
            opened
        }
    };
    let window = measure_window(&args, &loops, &phase, &budget, started).await;
    let cpu_after = read_cpu(&args.server_pids, &args.server_trees)?;
    let stats = collect_loops(loops).await?;
    print_report(&args, window, clk_tck, &stats, &cpu_before, &cpu_after)
}

/// Refuses a count of zero and an empty `--duration`.
fn check_run_args(args: &RunArgs) -> Result<(), BoxError> {
    if args.concurrency == 0 || args.connections == 0 || args.keys == 0 || args.descriptors == 0 {
        return Err("--concurrency, --connections, --keys and --descriptors must be at least 1".into());
    }
    if args.shape != ShapeKind::Single && args.descriptors != 1 {
        return Err("--descriptors is for --shape single: --shape envoy sends four, gateway one".into());
    }
    if args.routes == 0 {
        return Err("--routes must be at least 1".into());
    }
    if args.shape == ShapeKind::Envoy && args.keys > ENVOY_MAX_KEYS {
        return Err(format!("--shape envoy tells at most {ENVOY_MAX_KEYS} clients apart (--keys)").into());
    }
    if args.duration.is_zero() {
        return Err("--duration must be longer than zero".into());
    }
    if args.requests == Some(0) {
        return Err("--requests must be at least 1".into());
    }
    Ok(())
}

/// Starts one request loop per draw, round-robin over `channels`.
fn spawn_loops(
    draws: Vec<KeyDraw>,
    channels: &[Channel],
    shape: &Arc<Shape>,
    phase: &Arc<AtomicU8>,
    budget: &Arc<Budget>,
) -> Vec<tokio::task::JoinHandle<LoopStats>> {
    draws
        .into_iter()
        .enumerate()
        .map(|(i, draw)| {
            let client = RateLimitServiceClient::new(channels[i % channels.len()].clone());
            tokio::spawn(request_loop(client, shape.clone(), draw, phase.clone(), budget.clone()))
        })
        .collect()
}

/// Waits out the measured window (opened at `started`), then stops the loops; returns the
/// window's length.
async fn measure_window(
    args: &RunArgs,
    loops: &[tokio::task::JoinHandle<LoopStats>],
    phase: &AtomicU8,
    budget: &Budget,
    started: Instant,
) -> Duration {
    let ends = tokio::time::Instant::now() + args.duration;
    // With --requests, also end once that many were sent (and have had time to be answered:
    // the loops stop by themselves, the window closes when they are done or time is up).
    while tokio::time::Instant::now() < ends && loops.iter().any(|l| !l.is_finished()) {
        tokio::time::sleep_until(ends.min(tokio::time::Instant::now() + Duration::from_millis(5))).await;
    }
    phase.store(STOP, Ordering::Relaxed);
    let mut window = started.elapsed();
    if loops.iter().all(|l| l.is_finished()) {
        // Every loop stopped at --requests: the window ends at the last answer, not at the
        // poll that noticed (up to 5 ms later).
        let measure_from = started.duration_since(budget.base);
        let last = Duration::from_micros(budget.last_done_us.load(Ordering::Relaxed));
        window = last.saturating_sub(measure_from).max(Duration::from_micros(1));
    }
    window
}

/// Every loop's counts, merged; a loop that hangs past 10 s is aborted and its counts lost.
///
/// Errors: a request loop panicked.
async fn collect_loops(loops: Vec<tokio::task::JoinHandle<LoopStats>>) -> Result<LoopStats, BoxError> {
    let mut stats = LoopStats::new();
    let drain_deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for handle in loops {
        let abort = handle.abort_handle();
        match tokio::time::timeout_at(drain_deadline, handle).await {
            Ok(Ok(s)) => stats.merge(s),
            Ok(Err(e)) => return Err(format!("a request loop failed: {e}").into()),
            Err(_) => abort.abort(), // a call hung past the window; its counts are lost
        }
    }
    Ok(stats)
}

/// Prints the report, as JSON or for people.
///
/// Errors: no call was answered in the window.
fn print_report(
    args: &RunArgs,
    window: Duration,
    clk_tck: u64,
    stats: &LoopStats,
    cpu_before: &[CpuReading],
    cpu_after: &[CpuReading],
) -> Result<(), BoxError> {
    let report = Report::new(args, window, clk_tck, stats, cpu_before, cpu_after);
    let answered = stats.ok + stats.over_limit + stats.unknown_code > 0;
    emit(
        args.json,
        &report.json,
        &report.human,
        answered,
        stats.first_error.as_deref(),
        "call",
    )
}

/// Prints a report, `json` or `human` as `as_json` says. A run with no answer (`answered`
/// false) measured nothing: then an error naming `first_error`, so the exit status says so too;
/// `what` is what was sent (a call, a request).
fn emit(
    as_json: bool,
    json: &serde_json::Value,
    human: &str,
    answered: bool,
    first_error: Option<&str>,
    what: &str,
) -> Result<(), BoxError> {
    if as_json {
        println!("{json}");
    } else {
        print!("{human}");
    }
    if !answered {
        let first = first_error.unwrap_or("none completed in the window");
        return Err(format!("no {what} was answered (first error: {first})").into());
    }
    Ok(())
}

struct Report {
    json: serde_json::Value,
    human: String,
}

impl Report {
    fn new(
        args: &RunArgs,
        window: Duration,
        clk_tck: u64,
        stats: &LoopStats,
        before: &[CpuReading],
        after: &[CpuReading],
    ) -> Report {
        let m = Measures::new(window, clk_tck, stats, before, after);
        Report {
            json: m.json(args, clk_tck, stats),
            human: m.human(args, stats),
        }
    }
}

/// What a report says, worked out once for both of its forms.
struct Measures {
    errors: u64,
    requests: u64,
    /// The window, in seconds.
    secs: f64,
    throughput: f64,
    /// Latency percentiles in µs: p50, p90, p99 and p99.9.
    pct: [u64; 4],
    /// Per CPU reading (the client's first): name, pid, CPU seconds in the window, and µs per
    /// request.
    cpu: Vec<(String, Option<u32>, f64, Option<f64>)>,
}

impl Measures {
    fn new(window: Duration, clk_tck: u64, stats: &LoopStats, before: &[CpuReading], after: &[CpuReading]) -> Measures {
        let errors = stats.error_count();
        let requests = stats.ok + stats.over_limit + stats.unknown_code + errors;
        // Throughput and CPU per request count every completed call, errors included: a
        // server's UNAVAILABLE or timeout is work it did (the errors are reported beside them).
        let secs = window.as_secs_f64();
        let throughput = requests as f64 / secs;
        let h = &stats.latency_us;
        let pct = |q: f64| if h.is_empty() { 0 } else { h.value_at_quantile(q) };
        let per_req = |cpu_s: f64| {
            if requests == 0 {
                None
            } else {
                Some(cpu_s * 1e6 / requests as f64)
            }
        };
        let cpu: Vec<(String, Option<u32>, f64, Option<f64>)> = before
            .iter()
            .zip(after)
            .map(|(b, a)| {
                let cpu_s = a.ticks.saturating_sub(b.ticks) as f64 / clk_tck as f64;
                (b.name.clone(), b.pid, cpu_s, per_req(cpu_s))
            })
            .collect();
        Measures {
            errors,
            requests,
            secs,
            throughput,
            pct: [pct(0.50), pct(0.90), pct(0.99), pct(0.999)],
            cpu,
        }
    }

    /// The report as JSON.
    fn json(&self, args: &RunArgs, clk_tck: u64, stats: &LoopStats) -> serde_json::Value {
        use serde_json::json;

        let Measures {
            errors,
            requests,
            secs,
            throughput,
            pct: [p50, p90, p99, p999],
            ref cpu,
        } = *self;
        let h = &stats.latency_us;
        let (_, _, client_cpu_s, client_per_req) = cpu[0].clone();
        let servers: Vec<_> = cpu[1..]
            .iter()
            .map(|(_, pid, cpu_s, us)| {
                json!({
                    "pid": pid,
                    "cpu_s": cpu_s,
                    "cpu_us_per_req": us,
                    "cpu_utilisation": cpu_s / secs,
                })
            })
            .collect();
        json!({
            "target": args.target,
            "concurrency": args.concurrency,
            "connections": args.connections,
            "keys": args.keys,
            "distribution": args.distribution.name(),
            "zipf_s": (args.distribution == Distribution::Zipf).then_some(args.zipf_s),
            "shape": args.shape.name(),
            "descriptors_per_request": args.shape_descriptors(),
            "hits_addend": args.hits_addend,
            "warmup_s": args.warmup.as_secs_f64(),
            "duration_s": secs,
            "requests": requests,
            "throughput_rps": throughput,
            "ok": stats.ok,
            "over_limit": stats.over_limit,
            "unknown_code": stats.unknown_code,
            "statuses": stats.statuses,
            "status_mismatches": stats.status_mismatches,
            "errors": errors,
            "error_codes": stats.errors,
            "first_error": stats.first_error,
            "latency_us": {
                "p50": p50,
                "p90": p90,
                "p99": p99,
                "p999": p999,
                "min": h.min(),
                "max": h.max(),
                "mean": h.mean(),
            },
            "clk_tck": clk_tck,
            "client": {
                "cpu_s": client_cpu_s,
                "cpu_us_per_req": client_per_req,
                "cpu_utilisation": client_cpu_s / secs,
            },
            "servers": servers,
        })
    }

    /// The report for people.
    fn human(&self, args: &RunArgs, stats: &LoopStats) -> String {
        use std::fmt::Write;

        let Measures {
            errors,
            requests,
            secs,
            throughput,
            pct: [p50, p90, p99, p999],
            ref cpu,
        } = *self;
        let h = &stats.latency_us;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "target {}  concurrency {}  connections {}  keys {} ({})  shape {}  descriptors {}  window {:.2}s",
            args.target,
            args.concurrency,
            args.connections,
            args.keys,
            args.distribution.name(),
            args.shape.name(),
            args.shape_descriptors(),
            secs
        );
        let _ = writeln!(
            s,
            "requests {requests}  throughput {throughput:.0} req/s  ok {}  over_limit {}  unknown {}  errors {errors}",
            stats.ok, stats.over_limit, stats.unknown_code
        );
        let _ = writeln!(
            s,
            "statuses {}  answers without one status per descriptor {}",
            stats.statuses, stats.status_mismatches
        );
        for (code, n) in &stats.errors {
            let _ = writeln!(s, "  error {code}: {n}");
        }
        if let Some(e) = &stats.first_error {
            let _ = writeln!(s, "  first error: {e}");
        }
        let _ = writeln!(
            s,
            "latency us  p50 {p50}  p90 {p90}  p99 {p99}  p99.9 {p999}  max {}",
            h.max()
        );
        for (name, _, cpu_s, us) in cpu {
            let us = us.map_or("-".to_owned(), |u| format!("{u:.2}"));
            let _ = writeln!(
                s,
                "cpu {name}: {cpu_s:.2}s ({:.0}% of one core), {us} us/request",
                100.0 * cpu_s / secs
            );
        }
        s
    }
}
