//! Shared helpers for the integration tests: free loopback ports, a temporary tollgate setup,
//! the `tollgate` binary and Envoy as child processes that are killed when dropped (also when a
//! test panics; their logs are printed then). Redis (the shared server, private servers, a
//! cluster, RESP checks) is in [`redis`].
//!
//! Everything here is synchronous and blocks while waiting for a process to come up; from an
//! async test call it inside `tokio::task::block_in_place` (multi-thread runtime) or
//! `spawn_blocking`. Nothing uses a fixed port, so test binaries can run side by side.

pub mod faults;
pub mod openssl;
pub mod postgres;
pub mod proxy;
pub mod redis;
pub mod simulation;
pub mod tls;
pub mod tools;

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How long a child process may take to become ready.
/// A usage budget (docs/usage-budgets.md) in domain `llm`: 1,000 tokens a minute per
/// `tenant`, a usage account (`debt: true`) whose floor is the default, minus the capacity.
pub const LLM_BUDGET_RULES: &str = r#"
domain: llm
buckets:
  tenant_tokens: {capacity: 1000, refill: 1000/1m, debt: true}
descriptors:
  - key: tenant
    bucket: tenant_tokens
"#;

pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A loopback port that was free a moment ago, and never handed out before by this test
/// process. Another process can take it before it is used: callers that hand it to a child
/// retry with a new one when the child cannot bind. (The kernel may give the same ephemeral
/// port to two binds in a row: a test once reserved a port for a Redis it started later, and
/// the tollgate it started meanwhile got the same number for its admin listener.)
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind an ephemeral loopback port")
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// `text` as a YAML scalar: a JSON string is valid YAML and quotes everything that needs it.
pub fn yaml_str(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// A minimal blocking HTTP/1.1 GET for health checks: the status code and body, or `None` if
/// the server is not answering (yet).
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http_get_with(addr, path, "")
}

/// [`http_get`] with `headers` (each line ending in `\r\n`) added to the request.
pub fn http_get_with(addr: SocketAddr, path: &str, headers: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let chunked = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
    let body = if chunked { dechunk(body)? } else { body.to_owned() };
    Some((status, body))
}

/// The payload of a `Transfer-Encoding: chunked` body (Envoy's admin API answers that way).
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// A child process that is killed (and reaped) on drop. Its stdout and stderr go to a log file;
/// when the drop happens during a panic, the end of that log is printed to stderr.
pub struct ChildGuard {
    name: String,
    child: Child,
    log: PathBuf,
}

impl ChildGuard {
    /// Spawns `command` with stdin closed and both output streams appended to `log`.
    pub fn spawn(name: &str, command: &mut Command, log: &Path) -> ChildGuard {
        let out = File::create(log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        let err = out.try_clone().expect("clone a file handle");
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name} ({command:?}): {e}"));
        ChildGuard {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        }
    }

    /// The exit status if the process has already exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Everything the process wrote so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- last lines of {} (pid {}) log {} ----\n{}\n---- end of {} log ----",
                self.name,
                self.child.id(),
                self.log.display(),
                self.log_tail(60),
                self.name
            );
        }
    }
}

/// Sends `signal` (a name such as `STOP`) to `pid` with `kill`; panics if that fails.
pub fn signal(pid: u32, signal: &str) {
    assert!(try_signal(pid, signal), "kill -{signal} {pid} failed");
}

/// Sends `signal` to `pid` with `kill`; whether it was delivered (false: no such process).
pub fn try_signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("run kill -{signal} {pid}: {e}"))
        .success()
}

/// Polls `ready` every 20 ms until it returns `Some`, `process` exits, or [`STARTUP_TIMEOUT`]
/// passes. `Err` carries why it gave up.
pub fn wait_until<T>(process: &mut ChildGuard, mut ready: impl FnMut() -> Option<T>) -> Result<T, String> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Some(v) = ready() {
            return Ok(v);
        }
        if let Some(status) = process.exited() {
            return Err(format!("{} exited with {status}", process.name));
        }
        if Instant::now() > deadline {
            return Err(format!("{} not ready after {STARTUP_TIMEOUT:?}", process.name));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `tollgate serve` with its own settings and rules in a temporary directory.
pub struct Tollgate {
    // Declared first so it is dropped (killed) before the directory holding its log goes away.
    pub process: ChildGuard,
    /// `RateLimitService` and `grpc.health.v1` (a free port nothing listens on with
    /// [`TollgateBuilder::grpc_unix_socket`]).
    pub grpc_addr: SocketAddr,
    /// `/healthz`, `/readyz`, `/metrics`.
    pub http_addr: SocketAddr,
    /// The bucket admin API and `/config`.
    pub admin_addr: SocketAddr,
    /// `TOLLGATE_ADMIN__TOKEN` as given to [`TollgateBuilder::env`], for [`Tollgate::config`].
    pub admin_token: Option<String>,
    /// Holds `tollgate.yaml`, `rules/` (unless another rules path was given) and the log.
    pub dir: TempDir,
}

/// Configures a [`Tollgate`] before starting it.
#[derive(Default)]
pub struct TollgateBuilder {
    rule_files: Vec<(String, String)>,
    rules_path: Option<PathBuf>,
    settings: String,
    env: Vec<(String, String)>,
    ready: Option<ReadyProbe>,
    grpc_port: Option<u16>,
    unix_socket: Option<PathBuf>,
}

/// A readiness check of a starting tollgate, given its gRPC, HTTP and admin addresses.
type ReadyProbe = std::sync::Arc<dyn Fn(SocketAddr, SocketAddr, SocketAddr) -> bool + Send + Sync>;

impl TollgateBuilder {
    /// Adds a rules file `name` (e.g. `e2e.yaml`) with YAML `contents` to the temporary rules
    /// directory.
    pub fn rules_file(mut self, name: &str, contents: &str) -> Self {
        self.rule_files.push((name.to_owned(), contents.to_owned()));
        self
    }

    /// Loads the rules from `path` (a file or a directory) instead of the temporary directory.
    pub fn rules_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.rules_path = Some(path.into());
        self
    }

    /// Extra top-level settings YAML appended to the generated `tollgate.yaml` (anything but
    /// `grpc_addr`, `http_addr`, `admin` and `rules`, which the builder writes; admin
    /// settings go in with `TOLLGATE_ADMIN__TOKEN` and the like through [`Self::env`]).
    pub fn settings(mut self, yaml: &str) -> Self {
        self.settings.push_str(yaml);
        self.settings.push('\n');
        self
    }

    /// An environment variable for the process (`TOLLGATE_*` from the test's own environment
    /// are not passed on, so a developer's shell cannot change what the tests run).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Binds the gRPC listener to loopback port `port` instead of a free one: a tollgate started
    /// again where its clients (an Envoy's static cluster) still point. The HTTP and admin
    /// ports stay free ones; when the port cannot be bound, the start is retried on it a few
    /// times (a moment apart, for a process that is only just gone), then fails.
    pub fn grpc_port(mut self, port: u16) -> Self {
        self.grpc_port = Some(port);
        self
    }

    /// Puts the gRPC listener on the Unix socket `path` (`grpc_addr: unix:<path>`) instead of
    /// a loopback port.
    pub fn grpc_unix_socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.unix_socket = Some(path.into());
        self
    }

    /// Waits until `ready(grpc_addr, http_addr, admin_addr)` holds instead of the admin
    /// `/config` answering (for a tollgate whose admin or HTTP listener serves TLS, which the
    /// plain-text probes cannot read).
    pub fn ready_when(
        mut self,
        ready: impl Fn(SocketAddr, SocketAddr, SocketAddr) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.ready = Some(std::sync::Arc::new(ready));
        self
    }

    /// Starts `tollgate serve` on free loopback ports and waits until its admin `/config` answers
    /// 200 with its own gRPC address (the gRPC listener is bound before the HTTP one). Retries
    /// with new ports when a port was taken in the meantime. Panics, with the process log, if it does not come up.
    pub fn start(self) -> Tollgate {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-test.")
            .tempdir()
            .expect("create a temporary directory");
        let rules = match &self.rules_path {
            Some(path) => path.clone(),
            None => {
                let rules = dir.path().join("rules");
                fs::create_dir(&rules).expect("create the rules directory");
                for (name, contents) in &self.rule_files {
                    fs::write(rules.join(name), contents).expect("write a rules file");
                }
                rules
            }
        };
        let settings_path = dir.path().join("tollgate.yaml");
        let mut attempt = 0;
        loop {
            attempt += 1;
            let grpc_port = self.grpc_port.unwrap_or_else(free_port);
            let http_port = std::iter::repeat_with(free_port)
                .find(|p| *p != grpc_port)
                .expect("an endless iterator");
            let admin_port = std::iter::repeat_with(free_port)
                .find(|p| *p != grpc_port && *p != http_port)
                .expect("an endless iterator");
            let grpc_addr = SocketAddr::from(([127, 0, 0, 1], grpc_port));
            let http_addr = SocketAddr::from(([127, 0, 0, 1], http_port));
            let admin_addr = SocketAddr::from(([127, 0, 0, 1], admin_port));
            // `TOLLGATE_TEST_RUNTIME=current_thread` runs every tollgate on that runtime (the
            // one `runtime: auto` picks with one CPU; unpinned here, tests get multi_thread).
            let runtime = match std::env::var("TOLLGATE_TEST_RUNTIME") {
                Ok(r) if !self.settings.contains("runtime:") => format!("runtime: {r}\n"),
                _ => String::new(),
            };
            let grpc_listen = match &self.unix_socket {
                Some(path) => format!("unix:{}", path.display()),
                None => grpc_addr.to_string(),
            };
            let settings = format!(
                "grpc_addr: {grpc_listen}\nhttp_addr: {http_addr}\nadmin: {{addr: {admin_addr}}}\nrules: {}\n{runtime}{}",
                yaml_str(&rules.to_string_lossy()),
                self.settings
            );
            fs::write(&settings_path, settings).expect("write tollgate.yaml");

            let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
            command
                .arg("serve")
                .arg("--config")
                .arg(&settings_path)
                .current_dir(dir.path());
            for (key, _) in std::env::vars_os() {
                if key.to_string_lossy().starts_with("TOLLGATE_") {
                    command.env_remove(key);
                }
            }
            // Plain log lines in the log file (tracing-subscriber honours NO_COLOR).
            command.env("NO_COLOR", "1");
            command.envs(self.env.iter().map(|(k, v)| (k, v)));
            let log = dir.path().join(format!("tollgate.{attempt}.log"));
            let mut process = ChildGuard::spawn("tollgate", &mut command, &log);
            // `/config` (on the admin listener) names the gRPC address, so an answer from
            // another process that holds the port (a test running alongside) is not taken for
            // this one's. With the admin API off, `/healthz` on the HTTP port has to do.
            let ours = grpc_listen.clone();
            let admin_token = self
                .env
                .iter()
                .rev()
                .find(|(k, _)| k == "TOLLGATE_ADMIN__TOKEN")
                .map(|(_, v)| v.clone());
            let admin_off = self
                .env
                .iter()
                .rev()
                .find(|(k, _)| k == "TOLLGATE_ADMIN__ENABLED")
                .is_some_and(|(_, v)| v == "false");
            let auth = admin_token
                .as_ref()
                .map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
            match wait_until(&mut process, || {
                if let Some(ready) = &self.ready {
                    ready(grpc_addr, http_addr, admin_addr).then_some((200, String::new()))
                } else if admin_off {
                    http_get(http_addr, "/healthz").filter(|(status, _)| *status == 200)
                } else {
                    http_get_with(admin_addr, "/config", &auth)
                        .filter(|(status, body)| *status == 200 && body.contains(&ours))
                }
            }) {
                Ok(_) => {
                    return Tollgate {
                        process,
                        grpc_addr,
                        http_addr,
                        admin_addr,
                        admin_token,
                        dir,
                    }
                }
                Err(why) if attempt < 5 && process.log().contains("cannot listen") => {
                    eprintln!("tollgate could not bind ({why}); retrying on other ports");
                    if self.grpc_port.is_some() {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
                Err(why) => panic!("tollgate did not start: {why}\n{}", process.log_tail(60)),
            }
        }
    }
}

impl Tollgate {
    /// `GET /config` on the admin listener (with the token, if one was given): the status and
    /// body.
    pub fn config(&self) -> Option<(u16, String)> {
        let auth = self
            .admin_token
            .as_ref()
            .map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        http_get_with(self.admin_addr, "/config", &auth)
    }

    /// A builder: add rules files or a rules path, extra settings, environment.
    pub fn builder() -> TollgateBuilder {
        TollgateBuilder::default()
    }

    /// Starts tollgate with these rules files `(name, yaml)` and default settings.
    pub fn start(rules: &[(&str, &str)]) -> Tollgate {
        rules
            .iter()
            .fold(Tollgate::builder(), |b, (name, yaml)| b.rules_file(name, yaml))
            .start()
    }
}

/// Where an Envoy binary is: `$TOLLGATE_ENVOY_BIN`, else `~/.cache/tollgate/envoy-1.40.0/envoy`
/// (installed by `scripts/ensure-envoy`), else `envoy` on `PATH`.
///
/// Panics when `TOLLGATE_ENVOY_BIN` is set but names no file: an explicit choice that does not
/// work should not silently fall back to another Envoy.
pub fn find_envoy() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TOLLGATE_ENVOY_BIN").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        assert!(path.is_file(), "TOLLGATE_ENVOY_BIN={} is not a file", path.display());
        return Some(path);
    }
    if let Some(home) = std::env::var_os("HOME") {
        let cached = Path::new(&home).join(".cache/tollgate/envoy-1.40.0/envoy");
        if cached.is_file() {
            return Some(cached);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("envoy"))
        .find(|candidate| candidate.is_file())
}

/// The Envoy binary for test `test`, or `None` to skip it: without Envoy the test fails when
/// `CI=true` and is skipped (with a note on stderr) otherwise.
pub fn envoy_or_skip(test: &str) -> Option<PathBuf> {
    let found = find_envoy();
    if found.is_none() {
        let how = "set TOLLGATE_ENVOY_BIN, run scripts/ensure-envoy, or put envoy on PATH";
        let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        assert!(!ci, "{test}: no Envoy binary found and CI=true: {how}");
        eprintln!("SKIPPED {test}: no Envoy binary found ({how})");
    }
    found
}

/// Runs `envoy --mode validate` on `config`: `Ok` with Envoy's output when it accepts the file.
pub fn envoy_validate(envoy: &Path, config: &Path) -> Result<String, String> {
    let out = Command::new(envoy)
        .args(["--mode", "validate", "--disable-hot-restart", "-l", "warning", "-c"])
        .arg(config)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", envoy.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{} ({})", text.trim_end(), out.status))
    }
}

/// A running Envoy with a bootstrap given as text. Bind its admin interface and listeners to
/// `127.0.0.1` port `0`: the admin address is read back from `--admin-address-path` and the
/// listeners' ports from the admin API, so no port is guessed.
pub struct Envoy {
    // Held for their drop: the process first, so it is killed before its directory goes away.
    _process: ChildGuard,
    /// The admin interface.
    pub admin_addr: SocketAddr,
    /// Holds the bootstrap, the admin address file and the log.
    _dir: TempDir,
}

impl Envoy {
    /// Starts `envoy` with `bootstrap` (YAML) and waits until the admin API says `LIVE`.
    /// Runs with `--disable-hot-restart` (no shared memory, so several Envoys can run at once)
    /// and one worker thread. Panics, with the log, if Envoy rejects the config or exits.
    pub fn start(envoy: &Path, bootstrap: &str) -> Envoy {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-envoy.")
            .tempdir()
            .expect("create a temporary directory");
        let config = dir.path().join("envoy.yaml");
        fs::write(&config, bootstrap).expect("write the Envoy bootstrap");
        let admin_file = dir.path().join("admin-address");
        let mut command = Command::new(envoy);
        command
            .arg("-c")
            .arg(&config)
            .args(["--disable-hot-restart", "--concurrency", "1", "-l", "warning"])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .current_dir(dir.path());
        let mut process = ChildGuard::spawn("envoy", &mut command, &dir.path().join("envoy.log"));
        let admin_addr = wait_until(&mut process, || {
            fs::read_to_string(&admin_file).ok()?.trim().parse::<SocketAddr>().ok()
        })
        .unwrap_or_else(|why| panic!("Envoy did not start: {why}\n{}", process.log_tail(60)));
        wait_until(&mut process, || {
            http_get(admin_addr, "/ready").filter(|(status, body)| *status == 200 && body.trim() == "LIVE")
        })
        .unwrap_or_else(|why| panic!("Envoy did not get ready: {why}\n{}", process.log_tail(60)));
        Envoy {
            _process: process,
            admin_addr,
            _dir: dir,
        }
    }

    /// A GET on the admin API; panics unless it answers 200.
    pub fn admin(&self, path: &str) -> String {
        match http_get(self.admin_addr, path) {
            Some((200, body)) => body,
            other => panic!("Envoy admin GET {path}: {other:?}"),
        }
    }

    /// The address the listener `name` is bound to (from `/listeners?format=json`).
    pub fn listener(&self, name: &str) -> SocketAddr {
        let body = self.admin("/listeners?format=json");
        let json: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("/listeners is not JSON ({e}): {body}"));
        let listener = json["listener_statuses"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|l| l["name"] == name)
            .unwrap_or_else(|| panic!("no listener {name} in {body}"));
        let socket = &listener["local_address"]["socket_address"];
        let ip = socket["address"].as_str().expect("listener address");
        let port = socket["port_value"].as_u64().expect("listener port");
        format!("{ip}:{port}")
            .parse()
            .unwrap_or_else(|e| panic!("listener address {ip}:{port}: {e}"))
    }

    /// The value of counter or gauge `name` (e.g. `cluster.upstream.ratelimit.ok`), 0 when
    /// Envoy has not created it (counters appear on first use).
    pub fn stat(&self, name: &str) -> u64 {
        // `filter` is a regex; an unescaped `.` also matches itself, and the exact line is
        // picked out below.
        let body = self.admin(&format!("/stats?filter={name}"));
        body.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(": ")?.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// A `/metrics` scrape: checked line by line against the Prometheus text exposition format
/// (0.0.4), then parsed with `prometheus-parse`.
pub struct Scrape {
    /// The parsed samples.
    pub samples: Vec<prometheus_parse::Sample>,
    /// `# TYPE` per metric family.
    pub types: std::collections::HashMap<String, String>,
}

impl Scrape {
    /// GETs `/metrics` from `addr`; panics unless it answers 200 with valid text format.
    pub fn from(addr: SocketAddr) -> Scrape {
        match http_get(addr, "/metrics") {
            Some((200, body)) => Scrape::parse(&body),
            other => panic!("GET /metrics: {other:?}"),
        }
    }

    /// Parses `text`; panics, naming the line, where it breaks the text format: a name that is
    /// not `[a-zA-Z_:][a-zA-Z0-9_:]*`, a malformed label set or value, a sample whose family
    /// has no `# TYPE` before it, an unknown type, or a counter not named `*_total`.
    pub fn parse(text: &str) -> Scrape {
        let mut types = std::collections::HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let n = n + 1;
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("line {n}: {line}"));
                assert!(valid_metric_name(name), "line {n}: bad name in {line}");
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                    "line {n}: unknown type in {line}"
                );
                if kind == "counter" {
                    assert!(name.ends_with("_total"), "line {n}: counter not named *_total: {line}");
                }
                types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default();
                assert!(valid_metric_name(name), "line {n}: bad name in {line}");
                continue;
            }
            assert!(!line.starts_with('#'), "line {n}: unknown comment form {line}");
            let name_end = line
                .find(['{', ' '])
                .unwrap_or_else(|| panic!("line {n}: no value: {line}"));
            let name = &line[..name_end];
            assert!(valid_metric_name(name), "line {n}: bad name in {line}");
            let mut rest = &line[name_end..];
            if let Some(labels) = rest.strip_prefix('{') {
                rest = check_labels(labels).unwrap_or_else(|| panic!("line {n}: bad labels in {line}"));
            }
            let value = rest.strip_prefix(' ').unwrap_or_else(|| panic!("line {n}: {line}"));
            let value = value.split(' ').next().unwrap_or_default();
            assert!(
                value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
                "line {n}: bad value in {line}"
            );
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| types.get(*f).is_some_and(|t| t == "histogram" || t == "summary"))
                })
                .unwrap_or(name);
            assert!(types.contains_key(family), "line {n}: no # TYPE before {line}");
        }
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .expect("prometheus-parse reads the text");
        Scrape {
            samples: scrape.samples,
            types,
        }
    }

    /// The value of the one counter or gauge sample named `name` whose labels include `labels`
    /// (`None` when there is none); panics when several match.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut found = self
            .samples
            .iter()
            .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)));
        let sample = found.next()?;
        assert!(found.next().is_none(), "several samples of {name} match {labels:?}");
        match sample.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            ref other => panic!("{name} is not a counter or gauge: {other:?}"),
        }
    }

    /// The value of [`Scrape::get`], or 0 when no sample matches (a counter not yet created).
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }

    /// The sum of every counter or gauge sample named `name` whose labels include `labels` (0
    /// when none does): e.g. a backend's errors of every kind.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("{name} is not a counter or gauge: {other:?}"),
            })
            .sum()
    }

    /// A histogram's `_count` (prometheus-parse reads it as a separate sample).
    pub fn histogram_count(&self, name: &str) -> Option<f64> {
        self.get(&format!("{name}_count"), &[])
    }
}

fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Checks `name="value",...}` and returns what follows the `}`.
fn check_labels(mut s: &str) -> Option<&str> {
    loop {
        if let Some(rest) = s.strip_prefix('}') {
            return Some(rest);
        }
        let eq = s.find('=')?;
        let name = &s[..eq];
        let mut chars = name.chars();
        let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return None;
        }
        s = s[eq + 1..].strip_prefix('"')?;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in s.char_indices() {
            match (escaped, c) {
                (true, '\\' | '"' | 'n') => escaped = false,
                (true, _) => return None,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = Some(i);
                    break;
                }
                (false, _) => {}
            }
        }
        s = &s[end? + 1..];
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

/// Field 1 as a number where the proto has a string: not a `RateLimitRequest` at all.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NotARequest {
    #[prost(uint64, tag = "1")]
    pub domain: u64,
}

/// One `ShouldRateLimit` call carrying any protobuf message `msg` as its body, at `addr`
/// (`http://host:port`).
pub async fn raw_call<M: prost::Message + Send + Sync + 'static>(
    addr: &str,
    msg: M,
) -> Result<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse, tonic::Status> {
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
    let channel = tonic::transport::Channel::from_shared(addr.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    let codec = tonic_prost::ProstCodec::<M, RateLimitResponse>::default();
    grpc.unary(tonic::Request::new(msg), path, codec)
        .await
        .map(|r| r.into_inner())
}

/// A `RateLimitRequest` in `domain` with one descriptor of `entries` (`(key, value)` pairs) and
/// the request-level `hits_addend` (0: Envoy's default, one hit).
pub fn request(
    domain: &str,
    entries: &[(&str, &str)],
    hits_addend: u32,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![descriptor(entries)],
        hits_addend,
    }
}

/// A descriptor of `(key, value)` entries, in order.
pub fn descriptor(
    entries: &[(&str, &str)],
) -> envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}
