//! Hot reload of the rules (`tollgate::server::reload`).
//!
//! In-process, on a `Limiter` over a `MemoryStore`: fingerprints, `reload` outcomes (unchanged,
//! rejected once, emptied directory), the ConfigMap layout loaded once, the watch following
//! in-place edits, renames, ConfigMap swaps and a replaced rules directory, and 1000 reloads
//! under continuous gRPC load losing no request.
//!
//! Through the real binary (`support::Tollgate`), observed over gRPC, `/metrics` and `/config`:
//! in-place edit, atomic rename, ConfigMap swap, an invalid edit, SIGHUP, polling, and a bucket
//! keeping its tokens across a reload.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use support::{Scrape, Tollgate};
use tollgate::core::clock::SystemClock;
use tollgate::decision::{Limiter, LimiterOptions};
use tollgate::server::reload::{fingerprint, load_initial, ReloadOutcome, Reloader};
use tollgate::server::settings::{ReloadSettings, Settings};
use tollgate::store::MemoryStore;
use tonic::transport::Channel;

const DOMAIN: &str = "reload_test";

/// How long a change may take to show.
const WITHIN: Duration = Duration::from_secs(10);

/// Rules with two independent buckets: `user` (capacity 3, effectively no refill) and `tenant`
/// (capacity `tenant`, likewise). Tests change the tenant capacity and watch it take effect
/// through fresh tenant values, whose first request reports `capacity - 1` remaining.
fn rules(tenant: u32) -> String {
    format!(
        "domain: {DOMAIN}
buckets:
  per_user: {{capacity: 3, refill: 3/1h}}
  per_tenant: {{capacity: {tenant}, refill: {tenant}/1h}}
descriptors:
  - key: user
    bucket: per_user
  - key: tenant
    bucket: per_tenant
"
    )
}

/// A rules file that does not load (a descriptor without a key).
const INVALID: &str = "domain: reload_test\ndescriptors:\n  - value: no_key_here\n";

fn request(key: &str, value: &str) -> RateLimitRequest {
    support::request(DOMAIN, &[(key, value)], 0)
}

/// The capacity a fresh bucket of `response`'s descriptor had: what remains after one hit, plus
/// that hit.
fn capacity_of(response: &RateLimitResponse) -> u32 {
    assert_eq!(
        response.overall_code,
        Code::Ok as i32,
        "a fresh bucket admits: {response:?}"
    );
    response.statuses[0].limit_remaining + 1
}

/// A value never used before in this process, so its bucket is fresh.
fn fresh(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Writes `contents` to `path` atomically: a hidden temporary file in the same directory (not
/// a rules file, being hidden), then a rename over `path`.
fn write_atomically(path: &Path, contents: &str) {
    let tmp = path.with_file_name(format!(".{}.tmp", path.file_name().unwrap().to_string_lossy()));
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A Kubernetes ConfigMap volume: `dir/..<version>/rules.yaml`, `dir/..data -> ..<version>`,
/// `dir/rules.yaml -> ..data/rules.yaml`.
struct ConfigMap {
    dir: PathBuf,
    version: u32,
}

impl ConfigMap {
    fn create(dir: &Path, contents: &str) -> ConfigMap {
        std::fs::create_dir_all(dir).unwrap();
        let map = ConfigMap {
            dir: dir.to_owned(),
            version: 0,
        };
        let data = map.dir.join(map.folder());
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("rules.yaml"), contents).unwrap();
        std::os::unix::fs::symlink(map.folder(), map.dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/rules.yaml", map.dir.join("rules.yaml")).unwrap();
        map
    }

    fn folder(&self) -> String {
        format!("..2026_11_30_{}", self.version)
    }

    /// What the kubelet does on an update: a new timestamped folder, a `..data_tmp` link to
    /// it renamed over `..data`, the old folder deleted.
    fn swap(&mut self, contents: &str) {
        let old = self.dir.join(self.folder());
        self.version += 1;
        let new = self.dir.join(self.folder());
        std::fs::create_dir(&new).unwrap();
        std::fs::write(new.join("rules.yaml"), contents).unwrap();
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(self.folder(), &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        std::fs::remove_dir_all(old).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// In-process
// ---------------------------------------------------------------------------------------------

type MemLimiter = Limiter<MemoryStore>;

/// A limiter over the rules at `path` and a reloader for them (not spawned).
fn reloader(path: &Path) -> (Arc<MemLimiter>, Arc<Reloader<MemoryStore>>) {
    let (rules, print) = load_initial(path).unwrap_or_else(|e| panic!("rules should load: {e}"));
    assert_eq!(rules.generation, 1);
    let store = MemoryStore::new(8, 100_000, Arc::new(SystemClock));
    let limiter = Arc::new(Limiter::new(
        rules,
        store,
        LimiterOptions::from_settings(&Settings::default()),
    ));
    let reloader = Reloader::new(Arc::clone(&limiter), path.to_owned(), print);
    (limiter, reloader)
}

/// The tenant capacity in force, from a fresh bucket.
async fn tenant_capacity(limiter: &MemLimiter) -> u32 {
    let response = limiter
        .should_rate_limit(&request("tenant", &fresh("t")))
        .await
        .unwrap();
    capacity_of(&response)
}

/// Waits until the tenant capacity in force is `expected`; panics after [`WITHIN`].
async fn await_tenant_capacity(limiter: &MemLimiter, expected: u32, what: &str) {
    let deadline = Instant::now() + WITHIN;
    loop {
        let now = tenant_capacity(limiter).await;
        if now == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: tenant capacity still {now}, not {expected}, after {WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Only the watch: no polling, a short debounce.
fn watch_only() -> ReloadSettings {
    ReloadSettings {
        watch: true,
        debounce_ms: tollgate::core::units::Millis(20),
        poll_seconds: tollgate::core::units::Seconds(0),
    }
}

#[test]
fn the_fingerprint_follows_the_files_list_names_and_bytes_only() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    std::fs::write(&a, rules(1)).unwrap();
    let first = fingerprint(dir.path());
    assert_eq!(fingerprint(dir.path()), first, "nothing changed");

    // Metadata and files that are not rules files are no change.
    let file = std::fs::File::options().write(true).open(&a).unwrap();
    file.set_modified(std::time::SystemTime::now() + Duration::from_secs(60))
        .unwrap();
    drop(file);
    std::fs::write(dir.path().join("notes.txt"), "not rules").unwrap();
    std::fs::write(dir.path().join(".hidden.yaml"), "hidden").unwrap();
    std::fs::create_dir(dir.path().join("..data")).unwrap();
    std::fs::write(dir.path().join("..data/x.yaml"), "inside a hidden folder").unwrap();
    std::fs::write(&a, rules(1)).unwrap();
    assert_eq!(
        fingerprint(dir.path()),
        first,
        "rewritten with the same bytes, touched, ignored files"
    );

    // Bytes, names and the list are.
    std::fs::write(&a, rules(2)).unwrap();
    let edited = fingerprint(dir.path());
    assert_ne!(edited, first, "bytes changed");
    std::fs::rename(&a, dir.path().join("b.yaml")).unwrap();
    let renamed = fingerprint(dir.path());
    assert_ne!(renamed, edited, "renamed");
    std::fs::write(dir.path().join("c.yml"), "").unwrap();
    assert_ne!(fingerprint(dir.path()), renamed, "a file added");

    // A path that cannot be read: stable, and different from any listing.
    let missing = dir.path().join("missing");
    assert_eq!(fingerprint(&missing), fingerprint(&missing));
    assert_ne!(fingerprint(&missing), fingerprint(dir.path()));
    // A single file works the same way.
    let single = dir.path().join("b.yaml");
    let before = fingerprint(&single);
    std::fs::write(&single, rules(3)).unwrap();
    assert_ne!(fingerprint(&single), before);
}

#[tokio::test]
async fn rules_identical_to_those_in_force_are_never_swapped() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rules.yaml"), rules(1)).unwrap();
    let (limiter, reloader) = reloader(dir.path());
    assert_eq!(reloader.generation(), 1);
    assert!(matches!(reloader.reload(false), ReloadOutcome::Unchanged));
    // Forced (SIGHUP) on the files in force: nothing to do, so the store is not told of a
    // reload (which would keep its not-yet-full buckets until they are used again).
    assert!(matches!(reloader.reload(true), ReloadOutcome::Unchanged));
    assert_eq!(limiter.rules().generation, 1);

    std::fs::write(dir.path().join("rules.yaml"), rules(5)).unwrap();
    assert!(matches!(
        reloader.reload(true),
        ReloadOutcome::Applied { generation: 2 }
    ));
    assert_eq!(tenant_capacity(&limiter).await, 5);
    assert!(matches!(reloader.reload(false), ReloadOutcome::Unchanged));
    assert!(matches!(reloader.reload(true), ReloadOutcome::Unchanged));
    // Back to the first rules: they differ from those in force, so they load.
    std::fs::write(dir.path().join("rules.yaml"), rules(1)).unwrap();
    assert!(matches!(
        reloader.reload(false),
        ReloadOutcome::Applied { generation: 3 }
    ));
    assert_eq!(tenant_capacity(&limiter).await, 1);
}

#[tokio::test]
async fn a_broken_file_rejects_the_whole_set_once_and_the_last_good_rules_stay() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), rules(1)).unwrap();
    let (limiter, reloader) = reloader(dir.path());

    // A valid change to one file and an invalid second file: all or nothing.
    std::fs::write(dir.path().join("a.yaml"), rules(5)).unwrap();
    std::fs::write(dir.path().join("b.yaml"), INVALID).unwrap();
    match reloader.reload(false) {
        ReloadOutcome::Failed(errors) => {
            assert!(
                errors.0.iter().any(|e| e.file.ends_with("b.yaml")),
                "the problem names the file: {errors}"
            );
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(reloader.generation(), 1);
    assert_eq!(tenant_capacity(&limiter).await, 1, "the last good rules stay in force");

    // Reported once: the same broken files are not tried again, unless forced (SIGHUP).
    assert!(matches!(reloader.reload(false), ReloadOutcome::Unchanged));
    assert!(matches!(reloader.reload(true), ReloadOutcome::Failed(_)));
    assert_eq!(tenant_capacity(&limiter).await, 1);

    // Fixed: the new set applies.
    std::fs::remove_file(dir.path().join("b.yaml")).unwrap();
    assert!(matches!(
        reloader.reload(false),
        ReloadOutcome::Applied { generation: 2 }
    ));
    assert_eq!(tenant_capacity(&limiter).await, 5);

    // A rules path that goes away is a failure too.
    let file = dir.path().join("a.yaml");
    let (limiter, reloader) = self::reloader(&file);
    std::fs::remove_file(&file).unwrap();
    assert!(matches!(reloader.reload(false), ReloadOutcome::Failed(_)));
    assert_eq!(tenant_capacity(&limiter).await, 5);
}

/// An invalid edit, then its revert: the files are again those in force, so nothing is swapped
/// in (no new generation: the memory store keeps every bucket as it is) and the failure is no
/// longer reported. (The revert used to be compared with the broken attempt only, and the
/// identical rules were swapped in as generation 2.)
#[tokio::test]
async fn reverting_an_invalid_edit_swaps_nothing_and_clears_the_failure() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), rules(1)).unwrap();
    let (limiter, reloader) = reloader(dir.path());
    std::fs::write(dir.path().join("a.yaml"), INVALID).unwrap();
    assert!(matches!(reloader.reload(false), ReloadOutcome::Failed(_)));
    assert_eq!(reloader.status_json()["last_reload_failed"], true);
    std::fs::write(dir.path().join("a.yaml"), rules(1)).unwrap();
    assert!(matches!(reloader.reload(false), ReloadOutcome::Unchanged));
    assert_eq!(reloader.generation(), 1);
    assert_eq!(limiter.rules().generation, 1);
    assert_eq!(reloader.status_json()["last_reload_failed"], false);
}

#[tokio::test]
async fn an_emptied_rules_directory_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rules.yaml"), rules(2)).unwrap();
    let (limiter, reloader) = reloader(dir.path());
    std::fs::rename(dir.path().join("rules.yaml"), dir.path().join("rules.yaml.bak")).unwrap();
    match reloader.reload(false) {
        ReloadOutcome::Failed(errors) => assert!(errors.to_string().contains("no rules files"), "{errors}"),
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(tenant_capacity(&limiter).await, 2, "limits stay in force");
}

#[test]
fn a_configmap_volume_is_loaded_once_through_its_top_level_links() {
    let dir = tempfile::tempdir().unwrap();
    let volume = dir.path().join("rules");
    let mut map = ConfigMap::create(&volume, &rules(1));
    // A hidden file declaring the same domain would be a duplicate domain if it were read.
    std::fs::write(volume.join(".backup.yaml"), rules(9)).unwrap();
    for round in 0..2 {
        let set = tollgate::rules::load_rules(&volume).unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(set.files, vec![volume.join("rules.yaml")], "round {round}");
        assert_eq!(set.domains.len(), 1);
        assert!(set.domain(DOMAIN).is_some());
        map.swap(&rules(2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_follows_in_place_edits_and_atomic_renames() {
    let dir = tempfile::tempdir().unwrap();
    let rules_dir = dir.path().join("rules");
    std::fs::create_dir(&rules_dir).unwrap();
    let file = rules_dir.join("rules.yaml");
    std::fs::write(&file, rules(1)).unwrap();
    let (limiter, reloader) = reloader(&rules_dir);
    let task = reloader.spawn(watch_only());

    std::fs::write(&file, rules(5)).unwrap();
    await_tenant_capacity(&limiter, 5, "in-place edit").await;
    write_atomically(&file, &rules(2));
    await_tenant_capacity(&limiter, 2, "atomic rename").await;
    // A new file in the directory counts too.
    std::fs::rename(&file, rules_dir.join("other.yaml")).unwrap();
    std::fs::write(rules_dir.join("other.yaml"), rules(4)).unwrap();
    await_tenant_capacity(&limiter, 4, "renamed and edited").await;
    task.abort();

    // A rules file (not a directory): `mv tmp.yaml rules.yaml` next to it, then in place.
    let (limiter, reloader) = self::reloader(&rules_dir.join("other.yaml"));
    let task = reloader.spawn(watch_only());
    let tmp = rules_dir.join("tmp.yaml");
    std::fs::write(&tmp, rules(6)).unwrap();
    std::fs::rename(&tmp, rules_dir.join("other.yaml")).unwrap();
    await_tenant_capacity(&limiter, 6, "rename over the rules file").await;
    std::fs::write(rules_dir.join("other.yaml"), rules(7)).unwrap();
    await_tenant_capacity(&limiter, 7, "in-place edit of the rules file").await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_follows_configmap_swaps() {
    let dir = tempfile::tempdir().unwrap();
    let volume = dir.path().join("rules");
    let mut map = ConfigMap::create(&volume, &rules(1));
    let (limiter, reloader) = reloader(&volume);
    let task = reloader.spawn(watch_only());
    for (round, capacity) in [5, 2, 8].into_iter().enumerate() {
        map.swap(&rules(capacity));
        await_tenant_capacity(&limiter, capacity, &format!("ConfigMap swap {round}")).await;
    }
    task.abort();

    // The rules path being the link `rules.yaml -> ..data/rules.yaml` itself.
    let (limiter, reloader) = self::reloader(&volume.join("rules.yaml"));
    let task = reloader.spawn(watch_only());
    map.swap(&rules(3));
    await_tenant_capacity(&limiter, 3, "ConfigMap swap under a file path").await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_follows_a_replaced_rules_directory() {
    let dir = tempfile::tempdir().unwrap();
    let rules_dir = dir.path().join("rules");
    std::fs::create_dir(&rules_dir).unwrap();
    std::fs::write(rules_dir.join("rules.yaml"), rules(1)).unwrap();
    let (limiter, reloader) = reloader(&rules_dir);
    let task = reloader.spawn(watch_only());

    let next = dir.path().join("rules.next");
    std::fs::create_dir(&next).unwrap();
    std::fs::write(next.join("rules.yaml"), rules(5)).unwrap();
    std::fs::rename(&rules_dir, dir.path().join("rules.old")).unwrap();
    std::fs::rename(&next, &rules_dir).unwrap();
    await_tenant_capacity(&limiter, 5, "directory replaced").await;
    // The new directory is watched, not the old one.
    std::fs::write(rules_dir.join("rules.yaml"), rules(2)).unwrap();
    await_tenant_capacity(&limiter, 2, "edit in the new directory").await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_alone_picks_up_changes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, rules(1)).unwrap();
    let (limiter, reloader) = reloader(&file);
    let task = reloader.spawn(ReloadSettings {
        watch: false,
        debounce_ms: tollgate::core::units::Millis(20),
        poll_seconds: tollgate::core::units::Seconds(1),
    });
    std::fs::write(&file, rules(5)).unwrap();
    await_tenant_capacity(&limiter, 5, "poll").await;
    assert_eq!(reloader.generation(), 2);
    task.abort();
}

/// Starts the gRPC service for `limiter` on a loopback port; returns its URL.
async fn serve(limiter: Arc<MemLimiter>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate::server::serve_grpc(listener, limiter, std::future::pending()));
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_reloads_under_continuous_load_lose_no_request() {
    const RELOADS: u64 = 1000;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    // Two valid sets: buckets that shrink and grow (clamping), and one renamed.
    let set_a = rules(1000);
    let set_b = rules(10).replace("per_tenant", "per_tenant_b");
    std::fs::write(&file, &set_a).unwrap();
    let (limiter, reloader) = reloader(dir.path());
    let url = serve(Arc::clone(&limiter)).await;

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for c in 0..8 {
        let channel = Channel::from_shared(url.clone()).unwrap().connect().await.unwrap();
        let mut client = RateLimitServiceClient::new(channel);
        let (stop, answered) = (Arc::clone(&stop), Arc::clone(&answered));
        clients.push(tokio::spawn(async move {
            let (mut ok, mut over, mut errors) = (0u64, 0u64, Vec::new());
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let (key, value) = if i.is_multiple_of(2) {
                    ("tenant", format!("c{c}-{}", i % 7))
                } else {
                    ("user", format!("c{c}"))
                };
                match client.should_rate_limit(request(key, &value)).await {
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => ok += 1,
                    Ok(r) if r.get_ref().overall_code == Code::OverLimit as i32 => over += 1,
                    Ok(r) => errors.push(format!("unexpected code {}", r.get_ref().overall_code)),
                    Err(status) => errors.push(status.to_string()),
                }
                answered.fetch_add(1, Ordering::Relaxed);
            }
            (ok, over, errors)
        }));
    }
    // Let the clients get going.
    while answered.load(Ordering::Relaxed) < 100 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let before = answered.load(Ordering::Relaxed);
    let reloads = tokio::task::spawn_blocking({
        let reloader = Arc::clone(&reloader);
        let file = file.clone();
        move || {
            for n in 1..=RELOADS {
                write_atomically(&file, if n % 2 == 1 { &set_b } else { &set_a });
                match reloader.reload(true) {
                    ReloadOutcome::Applied { generation } => assert_eq!(generation, n + 1),
                    other => panic!("reload {n}: {other:?}"),
                }
            }
        }
    });
    let started = Instant::now();
    reloads.await.unwrap();
    let elapsed = started.elapsed();
    let during = answered.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);

    let (mut ok, mut over) = (0, 0);
    for client in clients {
        let (o, v, errors) = client.await.unwrap();
        assert!(errors.is_empty(), "requests failed during reloads: {errors:?}");
        ok += o;
        over += v;
    }
    assert_eq!(
        ok + over,
        answered.load(Ordering::Relaxed),
        "every request was answered"
    );
    assert!(ok > 0 && over > 0, "both outcomes seen: {ok} OK, {over} OVER_LIMIT");
    assert!(
        during >= RELOADS / 4,
        "only {during} requests answered during {RELOADS} reloads ({elapsed:?})"
    );
    eprintln!("{RELOADS} reloads in {elapsed:?}; {during} requests answered meanwhile; {ok} OK, {over} OVER_LIMIT");
    assert_eq!(reloader.generation(), RELOADS + 1);
    assert_eq!(limiter.rules().generation, RELOADS + 1);
    assert_eq!(
        tenant_capacity(&limiter).await,
        1000,
        "set A is in force after an even count"
    );
}

// ---------------------------------------------------------------------------------------------
// Through the binary
// ---------------------------------------------------------------------------------------------

/// Reload settings for the binary: the watch alone (no polling), so a passing test shows the
/// watch worked.
const WATCH_ONLY: &str = "reload: {watch: true, debounce_ms: 100, poll_seconds: 0}";

async fn grpc_client(tollgate: &Tollgate) -> RateLimitServiceClient<Channel> {
    let url = format!("http://{}", tollgate.grpc_addr);
    RateLimitServiceClient::new(Channel::from_shared(url).unwrap().connect().await.unwrap())
}

/// Decides one request through the server.
async fn ask(client: &mut RateLimitServiceClient<Channel>, key: &str, value: &str) -> RateLimitResponse {
    client
        .should_rate_limit(request(key, value))
        .await
        .unwrap_or_else(|status| panic!("the request should be decided: {status}"))
        .into_inner()
}

/// Waits until the server's tenant capacity is `expected`; panics (with the log) after
/// [`WITHIN`].
async fn await_server_capacity(
    tollgate: &Tollgate,
    client: &mut RateLimitServiceClient<Channel>,
    expected: u32,
    what: &str,
) {
    let deadline = Instant::now() + WITHIN;
    loop {
        let now = capacity_of(&ask(client, "tenant", &fresh("t")).await);
        if now == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: tenant capacity still {now}, not {expected}, after {WITHIN:?}\n{}",
            tollgate.process.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn reloads(tollgate: &Tollgate, result: &str) -> f64 {
    Scrape::from(tollgate.http_addr).counter("tollgate_rules_reloads_total", &[("result", result)])
}

/// The rules generation as `/metrics` and `/config` report it; panics if they disagree.
fn generation(tollgate: &Tollgate) -> u64 {
    let metric = Scrape::from(tollgate.http_addr)
        .get("tollgate_rules_generation", &[])
        .expect("tollgate_rules_generation");
    let json = config_json(tollgate);
    let config = json["generation"]
        .as_u64()
        .unwrap_or_else(|| panic!("/config has a generation: {json}"));
    assert_eq!(
        json["reload"]["generation"], config,
        "/config's rules and reload status agree"
    );
    assert_eq!(metric, config as f64, "/metrics and /config agree on the generation");
    config
}

/// Starts tollgate with `rules` as `rules/rules.yaml` and extra `settings`.
fn start(settings: &str, rules: &str) -> Tollgate {
    tokio::task::block_in_place(|| {
        Tollgate::builder()
            .settings(settings)
            .rules_file("rules.yaml", rules)
            .start()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_in_place_edit_changes_the_limits_and_keeps_unchanged_buckets() {
    let tollgate = start(WATCH_ONLY, &rules(1));
    let mut client = grpc_client(&tollgate).await;
    assert_eq!(capacity_of(&ask(&mut client, "tenant", &fresh("t")).await), 1);
    assert_eq!(generation(&tollgate), 1);
    // Drain alice's bucket (capacity 3) under the rule that will not change.
    for _ in 0..3 {
        assert_eq!(ask(&mut client, "user", "alice").await.overall_code, Code::Ok as i32);
    }
    assert_eq!(
        ask(&mut client, "user", "alice").await.overall_code,
        Code::OverLimit as i32
    );

    std::fs::write(tollgate.dir.path().join("rules/rules.yaml"), rules(5)).unwrap();
    await_server_capacity(&tollgate, &mut client, 5, "in-place edit").await;
    assert_eq!(generation(&tollgate), 2);
    assert_eq!(reloads(&tollgate, "success"), 1.0);
    assert_eq!(
        ask(&mut client, "user", "alice").await.overall_code,
        Code::OverLimit as i32,
        "alice's bucket kept its state across the reload"
    );
    let bob = ask(&mut client, "user", "bob").await;
    assert_eq!(bob.statuses[0].limit_remaining, 2, "a fresh user bucket is full");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_atomic_rename_changes_the_limits() {
    let tollgate = start(WATCH_ONLY, &rules(1));
    let mut client = grpc_client(&tollgate).await;
    let file = tollgate.dir.path().join("rules/rules.yaml");
    write_atomically(&file, &rules(5));
    await_server_capacity(&tollgate, &mut client, 5, "atomic rename").await;
    write_atomically(&file, &rules(2));
    await_server_capacity(&tollgate, &mut client, 2, "second atomic rename").await;
    assert_eq!(generation(&tollgate), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_rename_over_a_rules_file_changes_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, rules(1)).unwrap();
    let tollgate = tokio::task::block_in_place(|| Tollgate::builder().settings(WATCH_ONLY).rules_path(&file).start());
    let mut client = grpc_client(&tollgate).await;
    assert_eq!(capacity_of(&ask(&mut client, "tenant", &fresh("t")).await), 1);
    // `mv tmp.yaml rules.yaml` in the same directory.
    let tmp = dir.path().join("tmp.yaml");
    std::fs::write(&tmp, rules(5)).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    await_server_capacity(&tollgate, &mut client, 5, "mv tmp.yaml rules.yaml").await;
    assert_eq!(generation(&tollgate), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_configmap_swap_changes_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let volume = dir.path().join("rules");
    let mut map = ConfigMap::create(&volume, &rules(1));
    let tollgate = tokio::task::block_in_place(|| Tollgate::builder().settings(WATCH_ONLY).rules_path(&volume).start());
    let mut client = grpc_client(&tollgate).await;
    assert_eq!(capacity_of(&ask(&mut client, "tenant", &fresh("t")).await), 1);
    map.swap(&rules(5));
    await_server_capacity(&tollgate, &mut client, 5, "ConfigMap swap").await;
    map.swap(&rules(2));
    await_server_capacity(&tollgate, &mut client, 2, "second ConfigMap swap").await;
    assert_eq!(generation(&tollgate), 3);
    assert_eq!(
        reloads(&tollgate, "failure"),
        0.0,
        "`..data` is never loaded next to the links"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_invalid_edit_keeps_the_previous_limits_and_is_counted_once() {
    // Polling on too, to show a broken file is not reported again on every poll.
    let tollgate = start("reload: {watch: true, debounce_ms: 100, poll_seconds: 1}", &rules(1));
    let mut client = grpc_client(&tollgate).await;
    assert_eq!(reloads(&tollgate, "failure"), 0.0);
    let file = tollgate.dir.path().join("rules/rules.yaml");
    write_atomically(&file, INVALID);

    await_failed_reload(&tollgate).await;
    assert_eq!(
        capacity_of(&ask(&mut client, "tenant", &fresh("t")).await),
        1,
        "the last good rules stay"
    );
    assert_eq!(generation(&tollgate), 1);
    let metrics = Scrape::from(tollgate.http_addr);
    assert_eq!(metrics.get("tollgate_rules_last_reload_successful", &[]), Some(0.0));
    assert_eq!(
        metrics.get("tollgate_rules_reloads_total", &[("result", "success")]),
        Some(0.0)
    );
    assert!(
        tollgate.process.log().contains("rules reload rejected"),
        "the rejection is logged\n{}",
        tollgate.process.log_tail(40)
    );
    // /config says why, while the old rules stay in force.
    let config = config_json(&tollgate);
    assert_eq!(config["reload"]["last_reload_failed"], true, "{config}");
    let problems = config["reload"]["last_failure"]["problems"].to_string();
    assert!(problems.contains("rules.yaml"), "{problems}");
    // Polls see the same broken file: no new attempt.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(reloads(&tollgate, "failure"), 1.0, "reported once");

    write_atomically(&file, &rules(5));
    await_server_capacity(&tollgate, &mut client, 5, "fixed").await;
    assert_eq!(generation(&tollgate), 2);
    assert_eq!(
        Scrape::from(tollgate.http_addr).get("tollgate_rules_last_reload_successful", &[]),
        Some(1.0)
    );
    let config = config_json(&tollgate);
    assert_eq!(config["reload"]["last_reload_failed"], false, "{config}");
    assert!(config["reload"]["last_failure"].is_null(), "{config}");
}

/// An invalid edit reverted by hand: the rules in force are on disk again, so nothing is swapped
/// (still generation 1), `/config` no longer reports the failure, and the
/// `tollgate_rules_last_reload_successful` gauge (what the reload alert watches) is back to 1. The gauge
/// used to stay at 0 until some later edit loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_reverting_an_invalid_edit_clears_the_failure_and_the_alert() {
    let tollgate = start("reload: {watch: true, debounce_ms: 100, poll_seconds: 1}", &rules(1));
    let file = tollgate.dir.path().join("rules/rules.yaml");
    write_atomically(&file, INVALID);
    await_failed_reload(&tollgate).await;
    let metrics = Scrape::from(tollgate.http_addr);
    assert_eq!(metrics.get("tollgate_rules_last_reload_successful", &[]), Some(0.0));

    write_atomically(&file, &rules(1));
    let deadline = Instant::now() + WITHIN;
    while config_json(&tollgate)["reload"]["last_reload_failed"] != false {
        assert!(
            Instant::now() < deadline,
            "the failure is still reported\n{}",
            tollgate.process.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = Scrape::from(tollgate.http_addr);
    assert_eq!(metrics.get("tollgate_rules_last_reload_successful", &[]), Some(1.0));
    assert_eq!(
        metrics.get("tollgate_rules_reloads_total", &[("result", "success")]),
        Some(0.0),
        "nothing was loaded"
    );
    assert_eq!(generation(&tollgate), 1);
}

/// Waits (up to [`WITHIN`]) until the server has counted a failed reload.
async fn await_failed_reload(tollgate: &Tollgate) {
    let deadline = Instant::now() + WITHIN;
    while reloads(tollgate, "failure") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "no failed reload counted\n{}",
            tollgate.process.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET /config` as JSON.
fn config_json(tollgate: &Tollgate) -> serde_json::Value {
    match tollgate.config() {
        Some((200, body)) => serde_json::from_str(&body).expect("/config is JSON"),
        other => panic!("GET /config: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_reloads_on_sighup() {
    // No watch and no polling: only SIGHUP can reload.
    let mut tollgate = start("reload: {watch: false, poll_seconds: 0}", &rules(1));
    let mut client = grpc_client(&tollgate).await;
    std::fs::write(tollgate.dir.path().join("rules/rules.yaml"), rules(5)).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        capacity_of(&ask(&mut client, "tenant", &fresh("t")).await),
        1,
        "nothing watches"
    );

    let status = std::process::Command::new("kill")
        .arg("-HUP")
        .arg(tollgate.process.id().to_string())
        .status()
        .expect("run kill");
    assert!(status.success());
    await_server_capacity(&tollgate, &mut client, 5, "SIGHUP").await;
    assert!(tollgate.process.exited().is_none(), "SIGHUP does not end the process");
    assert_eq!(generation(&tollgate), 2);
}
