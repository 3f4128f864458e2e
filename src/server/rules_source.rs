//! Where the rules in force come from (`rules_source`): the files at `rules`, read at start and
//! reloaded when they change ([`crate::server::reload`]), or an xDS server that pushes them
//! ([`crate::server::xds`]). `serve` holds one [`RulesSource`] and asks it what `/config`,
//! `/readyz`, gRPC health and the gRPC service need to know.

use std::path::PathBuf;
use std::sync::Arc;

use crate::decision::limiter::Limiter;
use crate::rules::RuleSet;
use crate::server::reload::{load_initial_merging, Fingerprint, Reloader};
use crate::server::settings::{RulesSource as Kind, Settings};
use crate::server::xds::XdsState;
use crate::store::AnyStore;

/// Whether the rules allow serving, and if not, `/readyz`'s short reason.
pub(crate) type RulesCheck = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// The source of the rules in force, started.
#[derive(Clone)]
pub(crate) enum RulesSource {
    /// The rules files at `path`.
    Files {
        /// Reloads them.
        reloader: Arc<Reloader<AnyStore>>,
        /// The `rules` setting.
        path: PathBuf,
    },
    /// An xDS server.
    Xds(Arc<XdsState>),
}

/// What `serve` starts with: the rules, and what the source needs to carry on from them.
pub(crate) struct Initial {
    /// The rules to start the limiter with.
    pub(crate) rules: RuleSet,
    /// The files' fingerprint (`None` with xDS, whose rules arrive later).
    fingerprint: Option<Fingerprint>,
}

/// The rules `serve` starts with: the files' (logged, and an empty folder warned about), or
/// none when they come from xDS (the client's TLS files are read now, so a bad one stops the
/// start, naming it).
///
/// Errors: invalid rules files (every problem, with file, rule and reason), or an xDS
/// certificate, key or CA that cannot be read or parsed.
pub(crate) fn load(settings: &Settings) -> anyhow::Result<Initial> {
    if settings.rules_source == Kind::Xds {
        crate::server::xds::check(&settings.xds).map_err(|e| anyhow::anyhow!("cannot use the xDS server: {e}"))?;
        return Ok(Initial {
            rules: RuleSet::default(),
            fingerprint: None,
        });
    }
    let (rules, fingerprint) = load_initial_merging(&settings.rules, settings.merge_domains)
        .map_err(|e| anyhow::anyhow!("invalid rules:\n{e}"))?;
    if rules.is_empty() {
        tracing::warn!(
            path = %settings.rules.display(),
            "no rules files found (*.yaml, *.yml): nothing will be limited"
        );
    }
    tracing::info!(
        path = %settings.rules.display(),
        domains = rules.domains.len(),
        files = rules.files.len(),
        generation = rules.generation,
        "rules loaded"
    );
    Ok(Initial {
        rules,
        fingerprint: Some(fingerprint),
    })
}

impl Initial {
    /// Starts the source for `limiter` (which holds the initial rules by now): the files'
    /// reloader, or the xDS client. Returns it and its task (aborted at shutdown).
    pub(crate) fn start(
        self,
        limiter: &Arc<Limiter<AnyStore>>,
        settings: &Settings,
    ) -> (RulesSource, tokio::task::JoinHandle<()>) {
        match self.fingerprint {
            Some(fingerprint) => {
                let reloader = Reloader::new_merging(
                    limiter.clone(),
                    settings.rules.clone(),
                    fingerprint,
                    settings.merge_domains,
                );
                let task = reloader.spawn(settings.reload);
                let path = settings.rules.clone();
                (RulesSource::Files { reloader, path }, task)
            }
            None => {
                let state = Arc::new(XdsState::new(&settings.xds));
                let task = crate::server::xds::spawn(settings.xds.clone(), limiter.clone(), state.clone());
                (RulesSource::Xds(state), task)
            }
        }
    }
}

impl RulesSource {
    /// Adds to a `/config` document the state of reloading (`reload`: the generation, whether
    /// the latest load failed and why) and `rules_source`: `{"kind": "files", "path"}`, or the
    /// xDS client's (see [`XdsState::status_json`]). `generation` is that of the rules in force.
    pub(crate) fn add_to_config(&self, config: &mut serde_json::Value, generation: u64) {
        match self {
            RulesSource::Files { reloader, path } => {
                config["reload"] = reloader.status_json();
                config["rules_source"] = serde_json::json!({
                    "kind": "files",
                    "path": path.to_string_lossy(),
                });
            }
            RulesSource::Xds(state) => {
                config["reload"] = state.reload_json(generation);
                config["rules_source"] = state.status_json();
            }
        }
    }

    /// The readiness of the rules: always ready from files (loaded before serving); from xDS,
    /// not until the first rules are in force (unless `xds.force_start`).
    pub(crate) fn check(&self) -> RulesCheck {
        match self {
            RulesSource::Files { .. } => Arc::new(|| None),
            RulesSource::Xds(state) => {
                let state = state.clone();
                Arc::new(move || state.not_ready())
            }
        }
    }

    /// Whether decisions must wait (answered `UNAVAILABLE`): from xDS, before the first rules
    /// without `xds.force_start`; `None` from files.
    pub(crate) fn gate(&self) -> Option<Arc<dyn Fn() -> bool + Send + Sync>> {
        match self {
            RulesSource::Files { .. } => None,
            RulesSource::Xds(state) => {
                let state = state.clone();
                Some(Arc::new(move || state.waiting()))
            }
        }
    }
}
