//! What the backend fault tests share (`tests/suite/redis_faults.rs`, `tests/suite/postgres_faults.rs`):
//! the rules, a client that times each call, continuous load from several clients tagged by the
//! phase of the outage each request was sent and answered in, and polling for a condition.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use tokio::task::{block_in_place, JoinHandle};
use tonic::transport::Channel;

use super::{http_get, request, Scrape, Tollgate};

/// The domain of [`RULES`].
pub const DOMAIN: &str = "faults";
/// Each user's capacity in [`RULES`].
pub const CAPACITY: usize = 5;
/// Five tokens per user, refilled over an hour: nothing refills during a test.
pub const RULES: &str = r#"
domain: faults
descriptors:
  - key: user
    token_bucket: {capacity: 5, refill: 1/1h}
"#;

/// Clients sending requests continuously during an outage.
pub const CLIENTS: usize = 8;

/// The tests that load the machine (the fault tests, the soak, the load generator's smoke runs)
/// run one at a time, so latency bounds measure tollgate, not the other tests: the machine may
/// have two cores, and every test is in one binary, whose tests run side by side.
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// `tollgate serve` on `settings` with [`RULES`] (file `faults.yaml`). The over-limit cache is
/// off: the fault tests judge what `failure_mode` answers for requests that reach a failing
/// store, and their load hammers exhausted buckets, which the cache answers without the store
/// (docs/backends.md, "Deciding locally"; `tests/suite/local_decisions.rs` shows it through an
/// outage).
pub fn start_tollgate(settings: &str) -> Tollgate {
    Tollgate::builder()
        .rules_file("faults.yaml", RULES)
        .settings(settings)
        .env("TOLLGATE_LOCAL__OVER_LIMIT_CACHE", "false")
        .start()
}

/// A gRPC client of `tollgate`.
pub async fn connect(tollgate: &Tollgate) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect to tollgate")
}

/// Whether the response carries `Retry-After`.
pub fn retry_after(resp: &RateLimitResponse) -> bool {
    resp.response_headers_to_add
        .iter()
        .any(|h| h.key.eq_ignore_ascii_case("retry-after"))
}

/// The start of the `x-request-id` of every [`call`].
pub const REQUEST_ID: &str = "faults-";

/// One request for user `user`, timed; a call that takes over 10 s is a failure of its own.
/// It carries Envoy's `x-request-id` as [`REQUEST_ID`] followed by the user, which the
/// warnings logged about it repeat.
pub async fn call(
    client: &mut RateLimitServiceClient<Channel>,
    user: &str,
) -> (Duration, Result<RateLimitResponse, tonic::Status>) {
    let started = Instant::now();
    let mut call = tonic::Request::new(request(DOMAIN, &[("user", user)], 0));
    if let Ok(id) = format!("{REQUEST_ID}{user}").parse() {
        call.metadata_mut().insert("x-request-id", id);
    }
    let result = tokio::time::timeout(Duration::from_secs(10), client.should_rate_limit(call))
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer within 10 s (test bound)")))
        .map(tonic::Response::into_inner);
    (started.elapsed(), result)
}

/// The response's `overall_code`.
pub fn code(resp: &RateLimitResponse) -> Code {
    Code::try_from(resp.overall_code).expect("a known code")
}

/// Sends `CAPACITY + 2` requests for a user nobody used yet, each answered within `bound`, and
/// returns the codes: a bucket decided for real gives exactly `CAPACITY` OK, then OVER_LIMIT.
pub async fn exhaust(client: &mut RateLimitServiceClient<Channel>, user: &str, bound: Duration) -> Vec<Code> {
    let mut codes = Vec::new();
    for _ in 0..CAPACITY + 2 {
        let (took, result) = call(client, user).await;
        let resp = result.unwrap_or_else(|e| panic!("request for {user}: {e:?}"));
        assert!(took <= bound, "request for {user} took {took:?}");
        codes.push(code(&resp));
    }
    codes
}

/// What [`exhaust`] gives on a bucket decided for real.
pub fn real_decisions() -> Vec<Code> {
    let mut codes = vec![Code::Ok; CAPACITY];
    codes.extend([Code::OverLimit, Code::OverLimit]);
    codes
}

/// `/readyz`: status and body.
pub fn readyz(tollgate: &Tollgate) -> (u16, String) {
    block_in_place(|| http_get(tollgate.http_addr, "/readyz")).expect("/readyz answers")
}

/// `/metrics`, parsed.
pub fn scrape(tollgate: &Tollgate) -> Scrape {
    block_in_place(|| Scrape::from(tollgate.http_addr))
}

/// `tollgate_backend_circuit_open{backend}`.
pub fn circuit_open(tollgate: &Tollgate, backend: &str) -> f64 {
    scrape(tollgate)
        .get("tollgate_backend_circuit_open", &[("backend", backend)])
        .expect("the circuit gauge exists")
}

/// `tollgate_backend_calls_total{backend}`.
pub fn calls(tollgate: &Tollgate, backend: &str) -> f64 {
    scrape(tollgate).counter("tollgate_backend_calls_total", &[("backend", backend)])
}

/// Polls `check` every 20 ms for up to `within`; returns how long it took, or panics with `what`.
pub async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    loop {
        if check() {
            return started.elapsed();
        }
        assert!(started.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---- load ---------------------------------------------------------------------------------

/// Before the backend fails.
pub const BEFORE: u8 = 0;
/// While it is down (or paused).
pub const OUTAGE_PHASE: u8 = 1;
/// After it is back.
pub const AFTER: u8 = 2;
/// While the backend is being killed, paused, restarted or resumed: a request that overlaps a
/// change belongs to no phase.
pub const CHANGING: u8 = 3;

/// One request of the load: the phase when it was sent and when it was answered, how long it
/// took, and its answer (code and whether it carried Retry-After) or gRPC error.
#[derive(Debug)]
pub struct Sample {
    pub sent: u8,
    pub answered: u8,
    pub took: Duration,
    pub result: Result<(Code, bool), tonic::Code>,
    /// The gRPC error's message, if any (shown by `Debug` in failure messages).
    #[allow(dead_code)]
    pub error: Option<String>,
}

impl Sample {
    /// Sent and answered in `phase`.
    pub fn within(&self, phase: u8) -> bool {
        self.sent == phase && self.answered == phase
    }
}

/// `CLIENTS` tasks, each on its own connection, sending requests for its own user (capacity 5,
/// so OVER_LIMIT after five: the decisions are real) until stopped.
pub struct Load {
    phase: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Vec<Sample>>>,
}

impl Load {
    /// Starts the clients on `tollgate`, in phase [`BEFORE`].
    pub async fn start(tollgate: &Tollgate) -> Load {
        let phase = Arc::new(AtomicU8::new(BEFORE));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for i in 0..CLIENTS {
            let mut client = connect(tollgate).await;
            let (phase, stop) = (phase.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let user = format!("load-{i}");
                let mut samples = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = phase.load(Ordering::SeqCst);
                    let (took, result) = call(&mut client, &user).await;
                    let answered = phase.load(Ordering::SeqCst);
                    let error = result.as_ref().err().map(|e| e.message().to_owned());
                    samples.push(Sample {
                        sent,
                        answered,
                        took,
                        result: result.map(|r| (code(&r), retry_after(&r))).map_err(|e| e.code()),
                        error,
                    });
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
                samples
            }));
        }
        Load { phase, stop, tasks }
    }

    /// Tags the requests sent from now on.
    pub fn set_phase(&self, phase: u8) {
        self.phase.store(phase, Ordering::SeqCst);
    }

    /// Stops the clients; every sample.
    pub async fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.extend(t.await.expect("a load task"));
        }
        all
    }
}

/// A summary of samples for messages.
pub fn summary(samples: &[Sample]) -> String {
    let mut by_phase = String::new();
    for (phase, name) in [(BEFORE, "before"), (OUTAGE_PHASE, "outage"), (AFTER, "after")] {
        let s: Vec<&Sample> = samples.iter().filter(|s| s.within(phase)).collect();
        let ok = s.iter().filter(|s| matches!(s.result, Ok((Code::Ok, _)))).count();
        let over = s
            .iter()
            .filter(|s| matches!(s.result, Ok((Code::OverLimit, _))))
            .count();
        let err = s.iter().filter(|s| s.result.is_err()).count();
        let max = s.iter().map(|s| s.took).max().unwrap_or_default();
        by_phase.push_str(&format!(
            "{name}: {} requests ({ok} ok, {over} over_limit, {err} errors), max {max:?}; ",
            s.len()
        ));
    }
    let straddling = samples.iter().filter(|s| s.sent != s.answered).count();
    let max = samples.iter().map(|s| s.took).max().unwrap_or_default();
    format!("{by_phase}{straddling} straddling a change; max latency overall {max:?}")
}

// ---- a fault under load, checked ------------------------------------------------------------

/// What a fault test expects of tollgate on one backend while the backend cannot be used.
pub struct Expect {
    /// The backend's label in the metrics: `redis` or `postgres`.
    pub backend: &'static str,
    /// The configured failure mode's answer to a request (OK for `allow`, UNAVAILABLE for
    /// `error`; the load's users are spent, so a real decision is OVER_LIMIT).
    pub failure_answer: Result<(Code, bool), tonic::Code>,
    /// Its label in `tollgate_backend_failure_answers_total`; `None` for `error`, answered as a
    /// gRPC error rather than a response.
    pub failure_label: Option<&'static str>,
    /// The most any request may take: the command timeout plus a margin.
    pub max_latency: Duration,
    /// How long tollgate may take to decide on the backend again once it is healthy.
    pub recovery: Duration,
}

/// A fault under [`Load`]: phase BEFORE from [`FaultRun::start`], CHANGING from
/// [`FaultRun::changing`] (call it before making the backend fail), OUTAGE from
/// [`FaultRun::faulty`], and [`FaultRun::recover`] once the fault is over.
pub struct FaultRun<'a> {
    tollgate: &'a Tollgate,
    expect: &'a Expect,
    load: Load,
    before: Scrape,
}

/// What the load saw, with tollgate's own counts of the run.
pub struct Run {
    pub samples: Vec<Sample>,
    /// Counted in `tollgate_backend_failure_answers_total` during the run (`None` for `error`).
    pub failure_answers: Option<f64>,
    /// `tollgate_backend_errors_total` of the backend, every kind, during the run.
    pub errors: f64,
    /// How long after the fault ended tollgate was ready with its breaker closed.
    pub recovered_in: Duration,
}

impl<'a> FaultRun<'a> {
    /// Starts the load and lets every user spend its bucket.
    pub async fn start(tollgate: &'a Tollgate, expect: &'a Expect) -> FaultRun<'a> {
        let load = Load::start(tollgate).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        FaultRun {
            before: scrape(tollgate),
            tollgate,
            expect,
            load,
        }
    }

    /// The fault is being made (or undone): requests now belong to no phase.
    pub fn changing(&self) {
        self.load.set_phase(CHANGING);
    }

    /// The fault is in force.
    pub fn faulty(&self) {
        self.load.set_phase(OUTAGE_PHASE);
    }

    /// The fault is over: waits until tollgate has recovered by itself (breaker closed,
    /// `/readyz` 200), then runs the AFTER phase a while and stops the load.
    pub async fn recover(self) -> Run {
        let FaultRun {
            tollgate,
            expect,
            load,
            before,
        } = self;
        load.set_phase(CHANGING);
        let recovered_in = eventually(
            expect.recovery,
            "circuit closed and /readyz 200 after the fault",
            || circuit_open(tollgate, expect.backend) == 0.0 && readyz(tollgate).0 == 200,
        )
        .await;
        // A request the breaker let through as its probe just before it closed may still be on
        // its way back: let that round finish before counting on real decisions only.
        tokio::time::sleep(Duration::from_millis(300)).await;
        load.set_phase(AFTER);
        tokio::time::sleep(Duration::from_millis(700)).await;
        let samples = load.stop().await;
        let after = scrape(tollgate);
        let backend = [("backend", expect.backend)];
        Run {
            failure_answers: expect.failure_label.map(|label| {
                let answer = [("answer", label)];
                after.counter(FAILURE_ANSWERS, &answer) - before.counter(FAILURE_ANSWERS, &answer)
            }),
            errors: after.sum(BACKEND_ERRORS, &backend) - before.sum(BACKEND_ERRORS, &backend),
            recovered_in,
            samples,
        }
    }
}

/// `tollgate_backend_failure_answers_total`.
pub const FAILURE_ANSWERS: &str = "tollgate_backend_failure_answers_total";
/// `tollgate_backend_errors_total`.
pub const BACKEND_ERRORS: &str = "tollgate_backend_errors_total";

impl Run {
    /// Every request answered within the bound, each by a real decision or the failure mode's
    /// answer, and only by real decisions before and after the fault (each user's first
    /// [`CAPACITY`] admitted before it); tollgate never panicked, and decides for real for a
    /// new user. Panics, with a summary, otherwise.
    pub async fn check(&self, tollgate: &Tollgate, expect: &Expect) {
        let slow: Vec<&Sample> = self.samples.iter().filter(|s| s.took > expect.max_latency).collect();
        assert!(
            slow.is_empty(),
            "{} requests took over {:?}: {:?}\n{}",
            slow.len(),
            expect.max_latency,
            slow.iter().take(10).collect::<Vec<_>>(),
            summary(&self.samples)
        );
        let spending = Ok((Code::Ok, false));
        let admitted_before = self
            .samples
            .iter()
            .filter(|s| s.within(BEFORE) && s.result == spending)
            .count();
        assert_eq!(
            admitted_before,
            CLIENTS * CAPACITY,
            "admitted before the fault\n{}",
            summary(&self.samples)
        );
        let real = Ok((Code::OverLimit, true));
        for s in &self.samples {
            if s.sent == BEFORE && s.result == spending {
                continue;
            }
            assert!(
                s.result == real || s.result == expect.failure_answer,
                "neither a decision nor the failure mode's answer: {s:?}"
            );
            if s.within(BEFORE) || s.within(AFTER) {
                assert_eq!(s.result, real, "a request while the backend was healthy: {s:?}");
            }
        }
        assert!(
            self.samples.iter().any(|s| s.within(AFTER)),
            "no request after recovery\n{}",
            summary(&self.samples)
        );
        let log = tollgate.process.log();
        assert!(!log.contains("panicked"), "tollgate panicked:\n{log}");
        let mut probe = connect(tollgate).await;
        assert_eq!(
            exhaust(&mut probe, "probe-after", expect.max_latency).await,
            real_decisions()
        );
    }

    /// The requests sent and answered while the fault was in force.
    pub fn during(&self) -> impl Iterator<Item = &Sample> {
        self.samples.iter().filter(|s| s.within(OUTAGE_PHASE))
    }
}
