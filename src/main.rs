//! The `tollgate` command line: `serve`, `check`, `bucket` (a client of a running
//! server's admin API), `explain` (why a request would be limited, through the same API) and
//! `probe` (an HTTP health check for images without curl).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

// mimalloc, not the system allocator: a request's short-lived buffers (HTTP/2 frames, protobuf
// messages, Redis commands and replies) cost markedly less CPU to allocate and free; see
// benches/README.md. The no-op server in tollgate-loadgen uses the same, so it stays a fair
// ceiling.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Args, Parser, Subcommand};
use tollgate::admin::explain::{ExplainDescriptor, ExplainRequest, ExplainResponse};
use tollgate::admin::{BucketRequest, BucketsResponse, DescriptorEntry, ErrorResponse, Operation, EXPLAIN_PATH};
use tollgate::server::settings::{LogFormat, Settings};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "An exact token-bucket rate-limit service for Envoy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve Envoy's RateLimitService (gRPC) and the HTTP health endpoints.
    Serve {
        /// Settings file (YAML). Without it, config/tollgate.yaml is read if it exists.
        #[arg(long)]
        config: Option<PathBuf>,
        /// A rules file or a directory of rules files; overrides the `rules` setting.
        #[arg(long)]
        rules: Option<PathBuf>,
    },
    /// Validate rules and print the compiled descriptor tree; exit 1 on any error.
    Check {
        /// A rules file or a directory of rules files.
        #[arg(long, default_value = "config/rules")]
        rules: PathBuf,
        /// Instead of the tree: for each rule, its bucket, what envoyproxy/ratelimit's fixed
        /// window did with it and where tollgate behaves differently (reads no clock).
        #[arg(long)]
        explain: bool,
        /// Merge files that declare the same domain, as `serve` does with `merge_domains: true`
        /// (envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG).
        #[arg(long)]
        merge_domains: bool,
    },
    /// Create the Postgres schema and apply the migrations this build embeds, with the
    /// `postgres` settings `serve` would use (defaults, the settings file, TOLLGATE_POSTGRES__*);
    /// prints what it applied, or exits 1 naming the server and the reason. Safe to run again
    /// and beside running replicas.
    Migrate {
        /// Settings file (YAML). Without it, config/tollgate.yaml is read if it exists.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Look at or fix one client's buckets on a running server, through its admin API; prints
    /// the server's JSON answer, or exits 1 with its error.
    Bucket {
        #[command(subcommand)]
        action: BucketAction,
    },
    /// What ShouldRateLimit would answer for a request now, and why, consuming nothing: the
    /// verdict, each descriptor's rule and buckets, the bucket that decides and when the
    /// request would pass; through a running server's admin API (POST /v1/explain).
    Explain {
        /// The rate-limit domain.
        #[arg(long)]
        domain: String,
        /// An entry of the first descriptor, in order; repeat for each entry. The value may
        /// contain `=`.
        #[arg(long = "entry", value_name = "KEY=VALUE", value_parser = parse_entry)]
        entries: Vec<DescriptorEntry>,
        /// A descriptor, its entries separated by commas (`tenant=a,path=/x`), after the one the
        /// --entry options make (if any); repeat for each. A value with a comma, an override, a
        /// refund or a descriptor's own hits_addend need the JSON API (POST /v1/explain).
        #[arg(long = "descriptor", value_name = "KEY=VALUE[,KEY=VALUE...]", value_parser = parse_descriptor)]
        descriptors: Vec<Vec<DescriptorEntry>>,
        /// The request's hits_addend [default: 1].
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        hits: Option<u32>,
        /// Print the server's JSON answer instead of the summary.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        admin: AdminAddress,
    },
    /// GET a URL; exit 0 on a 2xx answer, else 1 with the status or why it could not connect.
    /// A health check for container images that carry no curl (the distroless image).
    Probe {
        /// The URL, such as http://127.0.0.1:8080/readyz (plain HTTP; proxies are not used).
        url: String,
        /// Milliseconds for the whole request, connecting included.
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
        timeout_ms: u64,
    },
}

#[derive(Subcommand)]
enum BucketAction {
    /// Show the buckets a descriptor reaches, changing nothing.
    Peek {
        #[command(flatten)]
        target: BucketTarget,
        /// The tokens a request would ask for: shows when they would be there [default: 1].
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        hits: Option<u64>,
    },
    /// Give tokens back to the buckets a descriptor reaches, never above their capacity.
    Refund {
        #[command(flatten)]
        target: BucketTarget,
        /// Whole tokens to give back to each bucket.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        tokens: u64,
    },
    /// Make the buckets a descriptor reaches full again.
    Reset {
        #[command(flatten)]
        target: BucketTarget,
    },
}

/// Which buckets, and where the admin API is.
#[derive(Args)]
struct BucketTarget {
    /// The rate-limit domain.
    #[arg(long)]
    domain: String,
    /// A descriptor entry, in order; repeat for each entry. The value may contain `=`.
    #[arg(long = "entry", value_name = "KEY=VALUE", required = true, value_parser = parse_entry)]
    entries: Vec<DescriptorEntry>,
    #[command(flatten)]
    admin: AdminAddress,
}

/// Where the admin API is.
#[derive(Args)]
struct AdminAddress {
    /// The admin API: host:port or http://host:port.
    #[arg(
        long,
        value_name = "ADDR",
        env = "TOLLGATE_ADMIN__ADDR",
        default_value = "127.0.0.1:8082"
    )]
    admin: String,
    /// The admin bearer token, if the server requires one.
    #[arg(long, env = "TOLLGATE_ADMIN__TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl AdminAddress {
    /// The URL of `path` on the admin API.
    fn url(&self, path: &str) -> String {
        let base = if self.admin.contains("://") {
            self.admin.trim_end_matches('/').to_owned()
        } else {
            format!("http://{}", self.admin)
        };
        format!("{base}{path}")
    }
}

/// `key=value[,key=value...]`: one descriptor's entries.
fn parse_descriptor(text: &str) -> Result<Vec<DescriptorEntry>, String> {
    text.split(',').map(parse_entry).collect()
}

/// `key=value`, split at the first `=`.
fn parse_entry(text: &str) -> Result<DescriptorEntry, String> {
    match text.split_once('=') {
        Some(("", _)) => Err("the key must not be empty".into()),
        Some((key, value)) => Ok(DescriptorEntry {
            key: key.to_owned(),
            value: value.to_owned(),
        }),
        None => Err(format!("expected KEY=VALUE, got {text:?}")),
    }
}

fn main() -> ExitCode {
    // Run as `ratelimit` (envoyproxy/ratelimit's /bin/ratelimit, which manifests start with no
    // arguments): `tollgate serve`, with their environment.
    let as_ratelimit = invoked_as_ratelimit();
    let cli = if as_ratelimit && std::env::args_os().len() <= 1 {
        Cli {
            command: Command::Serve {
                config: None,
                rules: None,
            },
        }
    } else {
        Cli::parse()
    };
    match cli.command {
        Command::Bucket { action } => bucket(action),
        Command::Explain {
            domain,
            entries,
            descriptors,
            hits,
            json,
            admin,
        } => explain(domain, entries, descriptors, hits, json, &admin),
        Command::Probe { url, timeout_ms } => probe(&url, Duration::from_millis(timeout_ms)),
        Command::Check {
            rules,
            explain,
            merge_domains,
        } => check(&rules, explain, merge_domains),
        Command::Migrate { config } => match load_settings(config.as_deref()) {
            Some(settings) => migrate(&settings),
            None => ExitCode::FAILURE,
        },
        Command::Serve { config, rules } => serve(config.as_deref(), rules, as_ratelimit),
    }
}

/// Whether the program was started under envoyproxy/ratelimit's name (`argv[0]`).
fn invoked_as_ratelimit() -> bool {
    std::env::args_os()
        .next()
        .and_then(|a| {
            PathBuf::from(a)
                .file_name()
                .map(|n| n == tollgate::server::settings::envoyproxy_env::RATELIMIT_ARGV0)
        })
        .unwrap_or(false)
}

/// `tollgate check`: prints the rules at `rules` (`explain`: how each maps onto a bucket;
/// `merge_domains`: files declaring one domain merged).
fn check(rules: &std::path::Path, explain: bool, merge_domains: bool) -> ExitCode {
    match tollgate::rules::load_rules_merging(rules, merge_domains) {
        Ok(set) if set.is_empty() => {
            eprintln!("{}", tollgate::rules::ConfigError::no_rules_files(rules));
            ExitCode::FAILURE
        }
        Ok(set) if explain => {
            print!("{}", tollgate::server::check::explain(&set));
            ExitCode::SUCCESS
        }
        Ok(set) => {
            let now = tollgate::core::clock::Clock::now_us(&tollgate::core::clock::SystemClock);
            print!("{}", tollgate::server::check::render(&set, now));
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate serve` (or `ratelimit`, when `as_ratelimit`): the settings, the logs and the
/// runtime, then the server until it shuts down.
fn serve(config: Option<&std::path::Path>, rules: Option<PathBuf>, as_ratelimit: bool) -> ExitCode {
    let theirs = match tollgate::server::settings::envoyproxy_env::EnvoyproxyEnv::from_process(as_ratelimit) {
        Ok(theirs) => theirs,
        Err(e) => {
            eprint!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let loaded = Settings::load_layers(config, Some(&theirs))
        .map_err(|e| e.to_string())
        .and_then(|(s, figment)| s.validate().map(|()| (s, figment)));
    let (mut settings, figment) = match loaded {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("invalid settings: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(rules) = rules {
        settings.rules = rules;
    }
    // The runtime first: the OTLP/gRPC exporter's connection lives on it, and the traces'
    // layer goes into the subscriber with the logs.
    let runtime = match tollgate::server::runtime(settings.runtime) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let backend = match settings.backend {
        tollgate::server::settings::Backend::Memory => "memory",
        tollgate::server::settings::Backend::Redis => "redis",
        tollgate::server::settings::Backend::Postgres => "postgres",
    };
    let traces = match tollgate::traces::Traces::start(&settings.tracing, runtime.handle(), backend) {
        Ok(traces) => traces,
        Err(e) => {
            eprintln!("cannot export traces: {e}");
            return ExitCode::FAILURE;
        }
    };
    init_logging(&settings, traces.as_ref());
    theirs.log_sources(&figment);
    for name in tollgate::server::settings::unknown_env_vars() {
        tracing::warn!(variable = %name, "environment variable names no setting; ignored");
    }
    if traces.is_some() {
        tracing::info!("exporting traces over OTLP");
    }
    let flavor = match runtime.handle().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::CurrentThread => "current_thread",
        _ => "multi_thread",
    };
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    tracing::info!(runtime = flavor, cpus, "runtime started");
    let served = runtime.block_on(tollgate::server::serve(settings));
    // Off the runtime's threads: the exporter's last batch waits for the collector.
    if let Some(traces) = traces {
        traces.shutdown();
    }
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The settings from defaults, `config` (or `config/tollgate.yaml`) and `TOLLGATE_*`, checked;
/// `None` after printing why they are not valid.
fn load_settings(config: Option<&std::path::Path>) -> Option<Settings> {
    let settings = Settings::load(config)
        .map_err(|e| e.to_string())
        .and_then(|s| s.validate().map(|()| s));
    settings.map_err(|e| eprintln!("invalid settings: {e}")).ok()
}

/// `tollgate migrate`: the Postgres schema and migrations of `settings.postgres`.
fn migrate(settings: &Settings) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let p = &settings.postgres;
    // Migrations may wait for another replica's advisory lock: far longer than a connection.
    let timeout = p.connect_timeout_ms.duration().max(Duration::from_secs(60));
    let outcome = runtime.block_on(async {
        let store = tollgate::store::PostgresStore::new(p)?;
        let report = store.migrate(timeout).await?;
        Ok::<_, tollgate::store::ConnectError>((store, report))
    });
    match outcome {
        Ok((store, report)) => {
            let target = format!("Postgres at {}, schema {}", store.describe(), store.schema());
            if report.applied.is_empty() {
                let plural = if report.in_place == 1 { "" } else { "s" };
                println!("{target}: up to date ({} migration{plural} in place)", report.in_place);
            } else {
                for (version, description) in &report.applied {
                    println!("{target}: applied {version} {description}");
                }
                println!(
                    "{target}: {} applied, {} already in place",
                    report.applied.len(),
                    report.in_place
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate migrate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate probe URL`: one GET, for container health checks. Prints the status on stdout
/// (or the error on stderr); success only for a 2xx answer within `timeout`.
fn probe(url: &str, timeout: Duration) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(timeout)
            .build()
            .map_err(|e| format!("cannot make an HTTP client: {}", tollgate::error_chain(&e)))?;
        let response = client.get(url).send().await.map_err(|e| {
            if e.is_timeout() {
                format!("no answer within {} ms", timeout.as_millis())
            } else if e.is_builder() {
                format!("not a usable URL: {}", root_cause(&e))
            } else {
                root_cause(&e)
            }
        })?;
        Ok::<_, String>(response.status())
    });
    match outcome {
        Ok(status) if status.is_success() => {
            println!("{url}: {status}");
            ExitCode::SUCCESS
        }
        Ok(status) => {
            eprintln!("tollgate probe: {url} answered {status}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("tollgate probe: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate bucket ...`: one request to the admin API.
fn bucket(action: BucketAction) -> ExitCode {
    let (op, target, hits, tokens) = match action {
        BucketAction::Peek { target, hits } => (Operation::Peek, target, hits, None),
        BucketAction::Refund { target, tokens } => (Operation::Refund, target, None, Some(tokens)),
        BucketAction::Reset { target } => (Operation::Reset, target, None, None),
    };
    let request = BucketRequest {
        domain: target.domain,
        descriptor: target.entries,
        hits,
        tokens,
    };
    let url = target.admin.url(op.path());
    let answer = admin_call(&url, &request, target.admin.token.as_deref()).and_then(|text| pretty_buckets(&text));
    print_answer(answer, &format!("tollgate bucket {}", op.name()))
}

/// Prints `answer`, or its error under `command`'s name (exit 1).
fn print_answer(answer: Result<String, String>, command: &str) -> ExitCode {
    match answer {
        Ok(answer) => {
            println!("{answer}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{command}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate explain ...`: one request to the admin API's explain endpoint.
fn explain(
    domain: String,
    first: Vec<DescriptorEntry>,
    more: Vec<Vec<DescriptorEntry>>,
    hits: Option<u32>,
    json: bool,
    admin: &AdminAddress,
) -> ExitCode {
    let descriptors: Vec<ExplainDescriptor> = std::iter::once(first)
        .filter(|entries| !entries.is_empty())
        .chain(more)
        .map(|entries| ExplainDescriptor {
            entries,
            ..Default::default()
        })
        .collect();
    if descriptors.is_empty() {
        eprintln!("tollgate explain: give the request's entries (--entry KEY=VALUE, --descriptor KEY=VALUE,...)");
        return ExitCode::FAILURE;
    }
    let request = ExplainRequest {
        domain,
        descriptors,
        hits_addend: hits.unwrap_or(0),
    };
    let answer = admin_call(&admin.url(EXPLAIN_PATH), &request, admin.token.as_deref()).and_then(|text| {
        let not_json = |e| format!("the admin API answered something other than an explanation: {e}: {text}");
        let explained: ExplainResponse = serde_json::from_str(&text).map_err(not_json)?;
        if json {
            serde_json::to_string_pretty(&explained).map_err(|e| e.to_string())
        } else {
            Ok(explained.summary())
        }
    });
    print_answer(answer, "tollgate explain")
}

/// POSTs `request` to `url` and waits for the answer: its body, or what went wrong.
fn admin_call(url: &str, request: &impl serde::Serialize, token: Option<&str>) -> Result<String, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(admin_post(url, request, token))
}

/// POSTs `request` to `url`; the answer's body, or what went wrong.
async fn admin_post(url: &str, request: &impl serde::Serialize, token: Option<&str>) -> Result<String, String> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| format!("cannot make an HTTP client: {}", tollgate::error_chain(&e)))?;
    let body = serde_json::to_vec(request).map_err(|e| e.to_string())?;
    let mut call = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body);
    if let Some(token) = token {
        call = call.bearer_auth(token);
    }
    let response = call.send().await.map_err(|e| {
        // reqwest's own message repeats the URL; the innermost cause says what happened.
        let cause = if e.is_timeout() {
            "timed out".to_owned()
        } else {
            root_cause(&e)
        };
        format!(
            "cannot reach the admin API at {url}: {cause} (is `tollgate serve` running there \
             with the admin API enabled? see --admin and the admin.addr setting)"
        )
    })?;
    let status = response.status();
    let text = response
        .text()
        .await
        .map_err(|e| format!("reading the answer from {url}: {}", tollgate::error_chain(&e)))?;
    if !status.is_success() {
        let message = serde_json::from_str::<ErrorResponse>(&text)
            .map(|e| e.error)
            .unwrap_or_else(|_| text.trim().to_owned());
        if message.is_empty() {
            return Err(format!(
                "{url} answered HTTP {status} with no message: is it the admin listener (admin.addr)?"
            ));
        }
        return Err(format!("{message} (HTTP {status})"));
    }
    Ok(text)
}

/// A bucket endpoint's answer, pretty-printed.
fn pretty_buckets(text: &str) -> Result<String, String> {
    let not_json = |_| format!("the admin API answered something other than JSON: {text}");
    let json: serde_json::Value = serde_json::from_str(text).map_err(not_json)?;
    // In the documented field order when the answer is exactly a `BucketsResponse`; any other
    // JSON (a newer server may answer more fields) as it is, keys sorted.
    let typed = serde_json::from_value::<BucketsResponse>(json.clone())
        .ok()
        .filter(|answer| serde_json::to_value(answer).ok().as_ref() == Some(&json));
    let pretty = match typed {
        Some(answer) => serde_json::to_string_pretty(&answer),
        None => serde_json::to_string_pretty(&json),
    };
    pretty.map_err(|e| e.to_string())
}

/// The innermost source of an error, such as `Connection refused (os error 111)`.
fn root_cause(e: &dyn std::error::Error) -> String {
    let mut e = e;
    while let Some(source) = e.source() {
        e = source;
    }
    e.to_string()
}

fn init_logging(settings: &Settings, traces: Option<&tollgate::traces::Traces>) {
    // sqlx logs the notices PostgreSQL sends ("relation ... already exists, skipping" at each
    // start, "there is no transaction in progress" after an abandoned transaction) and the
    // value of a connection parameter it does not know (which can be a password): kept out
    // unless RUST_LOG asks for them.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(format!(
            "{},sqlx::postgres::notice=error,sqlx_postgres::options=error",
            settings.log.level
        ))
    });
    // Colours only on a terminal: a file or a log collector would get escape codes.
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let fmt = match settings.log.format {
        LogFormat::Json => fmt.json().with_filter(filter).boxed(),
        LogFormat::Text => fmt.with_filter(filter).boxed(),
    };
    // The log's filter is the fmt layer's own, so RUST_LOG never hides a span from the traces.
    tracing_subscriber::registry()
        .with(traces.map(|t| t.layer()))
        .with(fmt)
        .init();
}
