//! Hot reload of the rules (docs/operations.md): when the files at the rules path change, on SIGHUP, and
//! on a poll, the rules are loaded again and, if every file is valid, swapped in whole.
//!
//! - **What counts as a change.** A [`Fingerprint`]: the list of rules files, their names and
//!   their bytes (or the error reading them). Touching a file or rewriting it unchanged is no
//!   change; a reload is only attempted when the fingerprint differs from the last one
//!   attempted, so a broken file is reported once, not on every event or poll.
//! - **All or nothing.** One invalid file rejects the whole new set: every problem is logged
//!   (file, rule, reason), the failure is counted, and the last good rules stay in force. A
//!   path that holds no rules file any more is rejected too (an emptied directory, half-way
//!   through a copy, would otherwise drop every limit at once).
//! - **State.** Buckets are keyed by domain, bucket name and entries, so a bucket whose domain
//!   and name survive a reload keeps its tokens ([`Limiter::swap_rules`] tells the store, which
//!   clamps a shrunk capacity).
//! - **Watching.** A non-recursive `notify` watch on the rules path (when it is a directory)
//!   and on its parent, so in-place edits, atomic renames (`mv tmp.yaml rules.yaml`),
//!   Kubernetes ConfigMap `..data` symlink swaps and the rules directory itself being replaced
//!   are all seen. Events are debounced; hidden `..data`-style folders are never loaded (see
//!   `crate::rules::file::rule_files`), only the top-level links into them.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::decision::limiter::Limiter;
use crate::rules::file::{load_rules_merging, rule_files, ConfigError, ConfigErrors};
use crate::rules::RuleSet;
use crate::server::settings::ReloadSettings;
use crate::store::Store;
use crate::telemetry;

/// What is on disk at a rules path, summarised: changes iff a rules file's list, name or bytes
/// change (or the read error changes). Modification times and other metadata are not part of
/// it, so touching a file is no change.
#[derive(Clone, PartialEq, Eq)]
pub struct Fingerprint(Result<Vec<(PathBuf, FileContent)>, String>);

/// A rules file's bytes, or why they could not be read.
type FileContent = Result<Vec<u8>, String>;

impl std::fmt::Debug for Fingerprint {
    /// File names and sizes, not the bytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Err(e) => f.debug_tuple("Fingerprint").field(&format_args!("error: {e}")).finish(),
            Ok(files) => {
                let mut list = f.debug_list();
                for (path, content) in files {
                    match content {
                        Ok(bytes) => list.entry(&format_args!("{} ({} bytes)", path.display(), bytes.len())),
                        Err(e) => list.entry(&format_args!("{} (error: {e})", path.display())),
                    };
                }
                list.finish()
            }
        }
    }
}

/// The [`Fingerprint`] of the rules at `path` (a file or a directory, as
/// [`crate::rules::file::load_rules`] reads it): the same files, read the same way.
pub fn fingerprint(path: &Path) -> Fingerprint {
    Fingerprint(rule_files(path).map_err(|e| e.to_string()).map(|files| {
        files
            .into_iter()
            .map(|file| {
                let content = std::fs::read(&file).map_err(|e| e.to_string());
                (file, content)
            })
            .collect()
    }))
}

/// Loads the rules at start: the fingerprint first (so that a change during the load is seen
/// by the next check), then the rules, as generation 1, with their metrics registered and the
/// load recorded ([`telemetry::rules_loaded`]).
///
/// Errors: every problem in the rules files (file, rule, reason). An empty rules directory is
/// not an error here; the caller decides (the server warns and limits nothing).
pub fn load_initial(path: &Path) -> Result<(RuleSet, Fingerprint), ConfigErrors> {
    load_initial_merging(path, false)
}

/// As [`load_initial`], files declaring one domain merged when `merge_domains` (the setting
/// `merge_domains`, envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`; see
/// [`crate::rules::load_rules_merging`]).
///
/// Errors: as [`load_initial`].
pub fn load_initial_merging(path: &Path, merge_domains: bool) -> Result<(RuleSet, Fingerprint), ConfigErrors> {
    let print = fingerprint(path);
    let mut rules = load_rules_merging(path, merge_domains)?;
    rules.generation = 1;
    crate::rules::counters::register_rules(&mut rules);
    telemetry::rules_loaded(1, true, true);
    Ok((rules, print))
}

/// Puts `rules` in force on `limiter` as the generation after the one in force: their counters
/// registered, swapped in ([`Limiter::swap_rules`]: rates change from now on, buckets keep their
/// tokens), and the load counted ([`telemetry::rules_loaded`]). The one step every rules source
/// takes, the files' [`Reloader`] and the xDS client (`crate::server::xds`) alike. Returns the
/// generation now in force.
pub(crate) fn put_in_force<S: Store>(limiter: &Limiter<S>, mut rules: RuleSet) -> u64 {
    let generation = limiter.rules().generation + 1;
    rules.generation = generation;
    crate::rules::counters::register_rules(&mut rules);
    limiter.swap_rules(rules);
    telemetry::rules_loaded(generation, true, false);
    generation
}

/// The domains of `rules`, sorted, joined with `, ` (for the log).
pub(crate) fn domain_list(rules: &RuleSet) -> String {
    let mut domains: Vec<&str> = rules.domains.keys().map(String::as_str).collect();
    domains.sort_unstable();
    domains.join(", ")
}

/// Logs every problem of rejected rules (file or resource, rule, reason) and counts the failed
/// attempt, the generation `current` staying in force; returns one line per problem (for
/// `/config`). The other step every rules source shares.
pub(crate) fn count_rejected(errors: &ConfigErrors, current: u64) -> Vec<String> {
    for e in &errors.0 {
        tracing::error!(
            file = %e.file.display(),
            rule = e.rule.as_deref().unwrap_or("-"),
            reason = %e.reason,
            "invalid rules"
        );
    }
    telemetry::rules_loaded(current, false, false);
    errors.0.iter().map(ToString::to_string).collect()
}

/// Now, in whole seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What one [`Reloader::reload`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// New rules are in force, as this generation.
    Applied {
        /// The generation now in force.
        generation: u64,
    },
    /// Nothing was loaded: the files are those of the rules in force (a failure reported
    /// before is cleared: an invalid edit was reverted), or, without `force`, those of the last
    /// attempt.
    Unchanged,
    /// The new rules were rejected (every problem is here and in the log); the previous
    /// rules stay in force.
    Failed(ConfigErrors),
}

/// Reloads a limiter's rules from a path: on demand ([`Reloader::reload`]) and, once
/// [spawned](Reloader::spawn), on file events, SIGHUP and a poll.
pub struct Reloader<S> {
    limiter: Arc<Limiter<S>>,
    path: PathBuf,
    /// Files declaring one domain are merged ([`load_initial_merging`]).
    merge_domains: bool,
    /// The fingerprints of the last load attempted (successful or not) and of the rules in
    /// force. The lock also serialises reloads (and is held through one).
    last: Mutex<Attempts>,
    /// Why the latest attempt failed, when it did: Unix seconds and one line per problem. A lock
    /// of its own, held for moments only, so `/config` never waits for a reload in progress.
    failure: Mutex<Option<(u64, Vec<String>)>>,
}

struct Attempts {
    attempted: Fingerprint,
    in_force: Fingerprint,
}

impl<S: Store> Reloader<S> {
    /// A reloader for `limiter`'s rules, read from `path`; `loaded` is the fingerprint of the
    /// rules in force (from [`load_initial`]).
    pub fn new(limiter: Arc<Limiter<S>>, path: PathBuf, loaded: Fingerprint) -> Arc<Reloader<S>> {
        Reloader::new_merging(limiter, path, loaded, false)
    }

    /// As [`Reloader::new`], merging files that declare one domain when `merge_domains`
    /// ([`load_initial_merging`]).
    pub fn new_merging(
        limiter: Arc<Limiter<S>>,
        path: PathBuf,
        loaded: Fingerprint,
        merge_domains: bool,
    ) -> Arc<Reloader<S>> {
        Arc::new(Reloader {
            limiter,
            path,
            merge_domains,
            last: Mutex::new(Attempts {
                attempted: loaded.clone(),
                in_force: loaded,
            }),
            failure: Mutex::new(None),
        })
    }

    /// The state of reloading, for `/config`: `{"generation": n, "last_reload_failed": bool,
    /// "last_failure": null | {"at_unix_seconds": s, "problems": ["<file>: <rule>: <reason>",
    /// ...]}}`. A failure stays shown until a reload succeeds or the files are back to the
    /// rules in force.
    pub fn status_json(&self) -> serde_json::Value {
        let failure = self
            .failure()
            .as_ref()
            .map(|(at, problems)| serde_json::json!({ "at_unix_seconds": at, "problems": problems }));
        serde_json::json!({
            "generation": self.generation(),
            "last_reload_failed": failure.is_some(),
            "last_failure": failure,
        })
    }

    /// Why the latest attempt failed, if it did (see the field).
    fn failure(&self) -> MutexGuard<'_, Option<(u64, Vec<String>)>> {
        self.failure.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The generation of the rules in force (1: the rules read at start).
    pub fn generation(&self) -> u64 {
        self.limiter.rules().generation
    }

    /// Reloads now, blocking on file reads. Without `force`, does nothing when the files'
    /// fingerprint equals the last one attempted, successful or not (so a broken file is
    /// reported once, not on every poll); with it (SIGHUP), loads unless the files are exactly
    /// those of the rules in force (a broken file is then tried and reported again). Rules are
    /// never swapped for identical ones: each swap makes the memory store keep the buckets that
    /// were not full at that moment until they are used again.
    ///
    /// On success the new rules get the next generation and their metrics, replace the rules in
    /// force, and the reload is logged and counted. On failure every problem is logged and the
    /// failure counted; the rules in force do not change. Two reloads never interleave.
    pub fn reload(&self, force: bool) -> ReloadOutcome {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        // Fingerprint before loading: if the files change during the load, the next check sees
        // a fingerprint that differs from this one and loads again.
        let print = fingerprint(&self.path);
        // The files are those of the rules in force (say, an invalid edit was reverted): never
        // swapped in again, and whatever failed before is no longer on disk.
        if print == last.in_force {
            if force {
                tracing::info!(path = %self.path.display(), "rules files unchanged; nothing to reload");
            } else if last.attempted != print {
                tracing::info!(path = %self.path.display(), "rules files are back to the rules in force");
            }
            last.attempted = print;
            if self.failure().take().is_some() {
                telemetry::reload_failure_cleared();
            }
            return ReloadOutcome::Unchanged;
        }
        // A broken version already tried and reported: only SIGHUP tries it again.
        if !force && print == last.attempted {
            return ReloadOutcome::Unchanged;
        }
        last.attempted = print.clone();
        let current = self.generation();
        let loaded = load_rules_merging(&self.path, self.merge_domains).and_then(|rules| {
            if rules.is_empty() {
                Err(ConfigErrors(vec![ConfigError::no_rules_files(&self.path)]))
            } else {
                Ok(rules)
            }
        });
        match loaded {
            Ok(rules) => self.apply(&mut last, print, rules, current),
            Err(errors) => self.reject(errors, current),
        }
    }

    /// Puts `rules` (read from files of fingerprint `print`) in force as the generation after
    /// `current`, and logs and counts the reload.
    fn apply(&self, last: &mut Attempts, print: Fingerprint, rules: RuleSet, current: u64) -> ReloadOutcome {
        debug_assert_eq!(current, self.generation());
        let domains = domain_list(&rules);
        let files = rules
            .files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        // Cleared first: `/config` never shows the new generation with the old failure.
        *self.failure() = None;
        let generation = put_in_force(&self.limiter, rules);
        last.in_force = print;
        tracing::info!(
            path = %self.path.display(),
            generation,
            domains = %domains,
            files = %files,
            "rules reloaded"
        );
        ReloadOutcome::Applied { generation }
    }

    /// Logs, counts and keeps (for `/config`) every problem of a rejected reload; the
    /// generation `current` stays in force.
    fn reject(&self, errors: ConfigErrors, current: u64) -> ReloadOutcome {
        let problems = count_rejected(&errors, current);
        tracing::error!(
            path = %self.path.display(),
            problems = errors.0.len(),
            generation = current,
            "rules reload rejected; the previous rules stay in force"
        );
        *self.failure() = Some((unix_now(), problems));
        ReloadOutcome::Failed(errors)
    }

    /// Starts reloading in the background, until the returned task is aborted:
    ///
    /// - file events (unless `settings.watch` is off): a non-recursive watch on the rules path
    ///   (a directory) and on its parent; once events have been quiet for
    ///   `settings.debounce_ms` (or at most ten times that after the first), a
    ///   [`reload(false)`](Self::reload). If the watch cannot be set up, a warning is logged
    ///   and polling has to do;
    /// - SIGHUP: [`reload(true)`](Self::reload);
    /// - every `settings.poll_seconds` (0: never): a look at the files' fingerprint; when it
    ///   differs from the last attempt, a [`reload(false)`](Self::reload) once the files read
    ///   the same again `settings.debounce_ms` later (a file caught half-written by the poll is
    ///   not reported as broken).
    ///
    /// The watch and the SIGHUP handler are in place when this returns. Reloads run on the
    /// blocking pool, so they never hold up request handling. Call it within a Tokio runtime.
    pub fn spawn(self: &Arc<Self>, settings: ReloadSettings) -> tokio::task::JoinHandle<()> {
        let (tx, rx) = mpsc::unbounded_channel();
        let watch = if settings.watch {
            Watch::start(&self.path, tx.clone(), settings.poll_seconds.0)
        } else {
            None
        };
        let hangup = Hangup::register();
        let this = Arc::clone(self);
        tokio::spawn(async move { this.run(settings, watch, tx, rx, hangup).await })
    }

    async fn run(
        self: Arc<Self>,
        settings: ReloadSettings,
        mut watch: Option<Watch>,
        // Held so that `rx` never reports closed, with or without a watcher.
        _tx: mpsc::UnboundedSender<notify::Result<Event>>,
        mut rx: mpsc::UnboundedReceiver<notify::Result<Event>>,
        mut hangup: Hangup,
    ) {
        let debounce = settings.debounce_ms.duration();
        let longest_wait = debounce * 10;
        let mut poll = (settings.poll_seconds.0 > 0).then(|| {
            let every = settings.poll_seconds.duration();
            let mut poll = tokio::time::interval_at(Instant::now() + every, every);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            poll
        });
        // A change between the initial load and the watch being set up raised no event.
        self.reload_in_background(false).await;
        let mut pending: Option<Pending> = None;
        loop {
            let due = pending.as_ref().map(|p| p.due);
            tokio::select! {
                Some(event) = rx.recv() => {
                    if watch.as_ref().is_some_and(|w| w.relevant(&event)) {
                        let now = Instant::now();
                        let first = pending.as_ref().map_or(now, |p| p.first);
                        let due = (now + debounce).min(first + longest_wait);
                        pending = Some(Pending { first, due, seen: None });
                    }
                }
                () = sleep_until(due) => {
                    let Some(p) = pending.take() else { continue };
                    if let Some(seen) = p.seen {
                        // Found by a poll: reload once the files read the same twice in a row,
                        // so a file caught half-written is not reported as broken.
                        let now_seen = self.fingerprint_in_background().await;
                        if now_seen != seen && Instant::now() < p.first + longest_wait {
                            let due = (Instant::now() + debounce).min(p.first + longest_wait);
                            pending = Some(Pending { first: p.first, due, seen: Some(now_seen) });
                            continue;
                        }
                    }
                    if let Some(w) = watch.as_mut() {
                        w.rearm();
                    }
                    self.reload_in_background(false).await;
                }
                () = hangup.recv() => {
                    tracing::info!(path = %self.path.display(), "SIGHUP: reloading the rules");
                    self.reload_in_background(true).await;
                }
                () = tick(&mut poll) => {
                    if pending.is_none() {
                        if let Some(seen) = self.changed_in_background().await {
                            let now = Instant::now();
                            pending = Some(Pending { first: now, due: now + debounce, seen: Some(seen) });
                        }
                    }
                }
            }
        }
    }

    /// The fingerprint of the files now, read on the blocking pool.
    async fn fingerprint_in_background(&self) -> Fingerprint {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || fingerprint(&path))
            .await
            .unwrap_or_else(|e| Fingerprint(Err(e.to_string())))
    }

    /// The fingerprint of the files now if it differs from the last one attempted.
    async fn changed_in_background(self: &Arc<Self>) -> Option<Fingerprint> {
        let this = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let print = fingerprint(&this.path);
            let last = this.last.lock().unwrap_or_else(PoisonError::into_inner);
            (print != last.attempted).then_some(print)
        })
        .await
        .ok()
        .flatten()
    }

    /// [`Self::reload`] on the blocking pool.
    async fn reload_in_background(self: &Arc<Self>, force: bool) {
        let this = Arc::clone(self);
        if let Err(e) = tokio::task::spawn_blocking(move || this.reload(force)).await {
            tracing::error!(error = %e, "rules reload did not complete");
        }
    }
}

/// A reload waiting for the files to settle.
struct Pending {
    /// When the first event (or the poll) of this change came.
    first: Instant,
    /// When to reload: after `debounce` without events, or at most ten times that after `first`.
    due: Instant,
    /// For a change a poll found (no events), the fingerprint it saw: the reload waits until
    /// the files read the same again.
    seen: Option<Fingerprint>,
}

/// Completes at `at`, never without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The next tick of the poll, never without one.
async fn tick(poll: &mut Option<tokio::time::Interval>) {
    match poll {
        Some(poll) => {
            poll.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// SIGHUP, where there is such a thing.
pub(crate) struct Hangup {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangup {
    /// Handles SIGHUP from now on (instead of the default, exiting). Logs a warning and never
    /// completes if the handler cannot be installed.
    pub(crate) fn register() -> Hangup {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let signal = signal(SignalKind::hangup())
                .inspect_err(|e| tracing::warn!(error = %e, "cannot handle SIGHUP; it will not reload the rules"))
                .ok();
            Hangup { signal }
        }
        #[cfg(not(unix))]
        Hangup {}
    }

    /// Completes at the next SIGHUP; never, where there is none or no handler.
    pub(crate) async fn recv(&mut self) {
        #[cfg(unix)]
        if let Some(signal) = self.signal.as_mut() {
            if signal.recv().await.is_some() {
                return;
            }
            self.signal = None;
        }
        std::future::pending().await
    }
}

/// The file watch: the rules path (when a directory) and its parent, both non-recursive.
struct Watch {
    watcher: notify::RecommendedWatcher,
    /// The rules path, absolute (event paths are the watched paths joined with names).
    path: PathBuf,
    /// Whether `path` was a directory when last armed.
    dir: bool,
}

impl Watch {
    /// Watches `path`, sending events to `tx`. `None` (with a warning) when no watch could be
    /// set up at all.
    fn start(path: &Path, tx: mpsc::UnboundedSender<notify::Result<Event>>, poll_seconds: u64) -> Option<Watch> {
        let fallback = if poll_seconds > 0 {
            format!("rules changes are picked up by polling every {poll_seconds} s")
        } else {
            "rules changes are picked up on SIGHUP only (polling is off)".to_owned()
        };
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
        let watcher = notify::recommended_watcher(move |event| {
            let _ = tx.send(event);
        });
        let watcher = match watcher {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot watch the rules; {fallback}");
                return None;
            }
        };
        let parent = path.parent().map(Path::to_owned);
        let mut watch = Watch {
            watcher,
            path,
            dir: false,
        };
        let mut watching = false;
        if let Some(parent) = &parent {
            match watch.watcher.watch(parent, RecursiveMode::NonRecursive) {
                Ok(()) => watching = true,
                Err(e) => tracing::warn!(path = %parent.display(), error = %e, "cannot watch the rules' directory"),
            }
        }
        watching |= watch.rearm();
        if !watching {
            tracing::warn!(path = %watch.path.display(), "cannot watch the rules; {fallback}");
            return None;
        }
        tracing::debug!(path = %watch.path.display(), directory = watch.dir, "watching the rules");
        Some(watch)
    }

    /// Watches the rules path again if it is a directory: it may be a new one (replaced by a
    /// rename, or a symlink now pointing elsewhere), and a watch follows the old one. Returns
    /// whether the path is watched.
    fn rearm(&mut self) -> bool {
        if self.dir {
            let _ = self.watcher.unwatch(&self.path);
        }
        self.dir = self.path.is_dir();
        if !self.dir {
            return false;
        }
        match self.watcher.watch(&self.path, RecursiveMode::NonRecursive) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(path = %self.path.display(), error = %e, "cannot watch the rules directory");
                self.dir = false;
                false
            }
        }
    }

    /// Whether `event` may have changed the rules (see [`relevant`]).
    fn relevant(&self, event: &notify::Result<Event>) -> bool {
        relevant(event, &self.path, self.dir)
    }
}

/// Whether `event`, from the watch on the rules path `path` (a directory when `dir`) or on its
/// parent, may have changed the rules. Reads (tollgate's own included) are not changes; in the
/// parent directory only `path` itself and, for a rules file, ConfigMap `..` entries count, so
/// a log file written next to the rules triggers nothing.
fn relevant(event: &notify::Result<Event>, path: &Path, dir: bool) -> bool {
    let event = match event {
        // Lost events (queue overflow) and watch errors: check the files.
        Err(_) => return true,
        Ok(event) => event,
    };
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
        EventKind::Access(_) => return false,
        _ => {}
    }
    if event.need_rescan() || event.paths.is_empty() {
        return true;
    }
    event.paths.iter().any(|p| {
        p.starts_with(path)
            || (!dir
                && p.parent() == path.parent()
                && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("..")))
    })
}

#[cfg(test)]
mod tests {
    use notify::event::{CreateKind, DataChange, ModifyKind, RenameMode};

    use super::*;

    fn event(kind: EventKind, paths: &[&str]) -> notify::Result<Event> {
        Ok(paths.iter().fold(Event::new(kind), |e, p| e.add_path(PathBuf::from(p))))
    }

    #[test]
    fn changes_to_the_rules_count_and_reads_and_neighbours_do_not() {
        let write = EventKind::Modify(ModifyKind::Data(DataChange::Any));
        let create = EventKind::Create(CreateKind::File);
        let rename = EventKind::Modify(ModifyKind::Name(RenameMode::Both));
        let open = EventKind::Access(AccessKind::Open(AccessMode::Any));
        let closed = EventKind::Access(AccessKind::Close(AccessMode::Write));
        let read = EventKind::Access(AccessKind::Close(AccessMode::Read));

        // A rules directory: anything inside it, and the directory itself in its parent.
        let dir = Path::new("/x/rules");
        assert!(relevant(&event(write, &["/x/rules/a.yaml"]), dir, true));
        assert!(relevant(&event(closed, &["/x/rules/a.yaml"]), dir, true));
        assert!(relevant(&event(create, &["/x/rules/..data_tmp"]), dir, true));
        assert!(relevant(&event(rename, &["/x/rules.new", "/x/rules"]), dir, true));
        assert!(
            !relevant(&event(open, &["/x/rules/a.yaml"]), dir, true),
            "tollgate's own read"
        );
        assert!(
            !relevant(&event(read, &["/x/rules"]), dir, true),
            "tollgate's own listing"
        );
        assert!(
            !relevant(&event(write, &["/x/tollgate.1.log"]), dir, true),
            "a log file next to it"
        );
        assert!(!relevant(&event(create, &["/x/..data"]), dir, true));

        // A rules file: itself, renames onto it, and ConfigMap entries beside it.
        let file = Path::new("/x/rules.yaml");
        assert!(relevant(&event(write, &["/x/rules.yaml"]), file, false));
        assert!(relevant(&event(rename, &["/x/tmp.yaml", "/x/rules.yaml"]), file, false));
        assert!(relevant(&event(rename, &["/x/..data_tmp", "/x/..data"]), file, false));
        assert!(!relevant(&event(write, &["/x/tmp.yaml"]), file, false));
        assert!(!relevant(&event(write, &["/x/rules.yaml.swp"]), file, false));
        assert!(!relevant(&event(open, &["/x/rules.yaml"]), file, false));

        // Lost events: look.
        assert!(relevant(&Err(notify::Error::generic("queue overflow")), file, false));
        assert!(relevant(
            &Ok(Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan)),
            file,
            false
        ));
    }
}
