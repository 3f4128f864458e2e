//! The `tollgate` command line: `serve` and `check`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tollgate::settings::{LogFormat, Settings};
use tracing_subscriber::EnvFilter;

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
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { rules } => match tollgate::config::load_rules(&rules) {
            Ok(set) if set.is_empty() => {
                eprintln!("{}", tollgate::config::ConfigError::no_rules_files(&rules));
                ExitCode::FAILURE
            }
            Ok(set) => {
                let now = tollgate::clock::Clock::now_us(&tollgate::clock::SystemClock);
                print!("{}", tollgate::check::render(&set, now));
                ExitCode::SUCCESS
            }
            Err(errors) => {
                eprintln!("{errors}");
                ExitCode::FAILURE
            }
        },
        Command::Serve { config, rules } => {
            let mut settings = match Settings::load(config.as_deref()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("invalid settings: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if let Some(rules) = rules {
                settings.rules = rules;
            }
            init_logging(&settings);
            for name in tollgate::settings::unknown_env_vars() {
                tracing::warn!(variable = %name, "environment variable names no setting; ignored");
            }
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(tollgate::server::serve(settings)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn init_logging(settings: &Settings) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&settings.log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match settings.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}
