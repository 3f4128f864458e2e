//! The PostgreSQL the tests share (`scripts/ensure-postgres`), and a private schema per test so
//! that tests never see each other's rows.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::ChildGuard;

use tollgate::server::settings::PostgresSettings;
use tollgate::store::PostgresStore;

/// Where `scripts/ensure-postgres` puts the test database.
pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/tollgate_test";

/// The shared server's URL (`TOLLGATE_POSTGRES_URL`, else [`DEFAULT_POSTGRES_URL`]) when it
/// answers. Under `CI=true` a missing server fails the test; otherwise the test is skipped
/// with a printed reason.
pub async fn shared_postgres(test: &str) -> Option<String> {
    let url = std::env::var("TOLLGATE_POSTGRES_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_POSTGRES_URL.to_owned());
    let probe = async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&url).await?;
        sqlx::query("SELECT 1").execute(&mut conn).await?;
        conn.close().await
    };
    let why = match tokio::time::timeout(Duration::from_secs(5), probe).await {
        Ok(Ok(())) => return Some(url),
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 5 s".to_string(),
    };
    let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    assert!(
        !ci,
        "{test}: no PostgreSQL at {url} ({why}) and CI=true: run scripts/ensure-postgres or set TOLLGATE_POSTGRES_URL"
    );
    eprintln!("skipping {test}: no PostgreSQL at {url} ({why}; run scripts/ensure-postgres)");
    None
}

/// A schema name unique to this call: `t_<pid>_<nanos>_<n>`.
pub fn unique_schema() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000_000_000)
        .unwrap_or(0);
    format!(
        "t_{}_{}_{}",
        std::process::id(),
        nanos,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Settings for a store on `url` in `schema`, with timeouts generous enough for a loaded
/// machine.
pub fn settings(url: &str, schema: &str) -> PostgresSettings {
    PostgresSettings {
        url: url.to_owned(),
        schema: schema.to_owned(),
        pool_size: 8,
        connect_timeout_ms: tollgate::core::units::Millis(10_000),
        command_timeout_ms: tollgate::core::units::Millis(10_000),
        ..PostgresSettings::default()
    }
}

/// A connected store on `url` in `schema` (created and migrated).
pub async fn store(url: &str, schema: &str) -> PostgresStore {
    let store = PostgresStore::new(&settings(url, schema)).expect("valid settings");
    store
        .connect(Duration::from_secs(10))
        .await
        .expect("connects and migrates");
    store
}

/// Drops `schema` and everything in it.
pub async fn drop_schema(url: &str, schema: &str) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connects");
    sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .execute(&mut conn)
        .await
        .expect("drops the schema");
}

/// A schema of its own on the shared server, for one test.
pub struct TestSchema {
    /// The shared server's URL.
    pub url: String,
    /// The schema's name ([`unique_schema`]).
    pub name: String,
}

impl TestSchema {
    /// A fresh schema name on the shared server, or `None` (the test skips) when there is no
    /// server outside CI; see [`shared_postgres`].
    pub async fn new(test: &str) -> Option<TestSchema> {
        let url = shared_postgres(test).await?;
        Some(TestSchema {
            url,
            name: unique_schema(),
        })
    }

    /// A connected store in this schema (created and migrated on first use).
    pub async fn store(&self) -> PostgresStore {
        store(&self.url, &self.name).await
    }

    /// Drops the schema and everything in it.
    pub async fn drop(self) {
        drop_schema(&self.url, &self.name).await;
    }
}

// ---- a private server ---------------------------------------------------------------------

/// The directory of the newest PostgreSQL server binaries (`initdb`, `postgres`): Debian keeps
/// them under `/usr/lib/postgresql/<version>/bin`, off `PATH`; else wherever `pg_config
/// --bindir` says.
pub fn server_bin() -> Option<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, e.path().join("bin")))
        })
        .collect();
    dirs.sort();
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    dirs.into_iter()
        .rev()
        .map(|(_, d)| d)
        .chain(from_pg_config)
        .find(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
}

/// The server binaries, or `None` (the test skips with a printed reason) outside CI; under
/// `CI=true` a missing server fails the test (`scripts/ensure-postgres` installs it).
pub fn server_bin_or_skip(test: &str) -> Option<PathBuf> {
    if let Some(bin) = server_bin() {
        return Some(bin);
    }
    let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    assert!(
        !ci,
        "{test}: no PostgreSQL server binaries (initdb, postgres) and CI=true: run scripts/ensure-postgres"
    );
    eprintln!("skipping {test}: no PostgreSQL server binaries (initdb, postgres; run scripts/ensure-postgres)");
    None
}

/// `id <args>` as a number.
fn id(args: &[&str]) -> u32 {
    let out = Command::new("id").args(args).output().expect("run id");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("id {args:?} printed {:?}", String::from_utf8_lossy(&out.stdout)))
}

/// PostgreSQL refuses to run as root: as root, the user and group `postgres` (Debian's package
/// creates them) run the server and own its files.
fn server_user() -> Option<(u32, u32)> {
    (id(&["-u"]) == 0).then(|| (id(&["-u", "postgres"]), id(&["-g", "postgres"])))
}

/// A throwaway PostgreSQL cluster of its own (`initdb` in a temporary directory, trust
/// authentication, no durability: `fsync` off), listening on a loopback port nobody else uses;
/// never the shared server. Killed when dropped. Tests stop, crash, pause and restart it.
pub struct PostgresServer {
    // Declared first so the server is stopped before its directory goes away.
    process: Option<ChildGuard>,
    bin: PathBuf,
    port: u16,
    dir: TempDir,
    user: Option<(u32, u32)>,
    starts: u32,
    /// Whether it serves TLS ([`PostgresServer::enable_tls`]).
    tls: bool,
    /// The password of `postgres`, if not trust.
    password: Option<String>,
    /// `max_connections` from the next start ([`PostgresServer::set_max_connections`]).
    max_connections: u32,
}

impl PostgresServer {
    /// Creates the cluster (`initdb`) without starting it, for `port` (a free one if `None`).
    /// Panics if `initdb` fails.
    pub fn init(bin: &Path, port: Option<u16>) -> PostgresServer {
        PostgresServer::init_with(bin, port, None)
    }

    /// [`PostgresServer::init`], and with `password` the user `postgres` must log in with it
    /// (`scram-sha-256`) instead of trust.
    pub fn init_with(bin: &Path, port: Option<u16>, password: Option<&str>) -> PostgresServer {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-postgres.")
            .tempdir()
            .expect("create a temporary directory");
        let user = server_user();
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown the cluster directory");
        }
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .args(["-D"])
            .arg(dir.path().join("data"))
            .args(["-U", "postgres", "--no-sync", "-E", "UTF8"])
            // Its own directory, not the test process's: initdb, run as another user, fails
            // when it cannot resolve the directory it starts in.
            .current_dir(dir.path())
            .stdin(Stdio::null());
        match password {
            Some(pw) => {
                let file = dir.path().join("pwfile");
                std::fs::write(&file, pw).expect("write the password file");
                if let Some((uid, gid)) = user {
                    std::os::unix::fs::chown(&file, Some(uid), Some(gid)).expect("chown the password file");
                }
                initdb
                    .arg("--auth=scram-sha-256")
                    .arg(format!("--pwfile={}", file.display()));
            }
            None => {
                initdb.arg("--auth=trust");
            }
        }
        if let Some((uid, gid)) = user {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb.output().expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        PostgresServer {
            process: None,
            bin: bin.to_owned(),
            port: port.unwrap_or_else(super::free_port),
            dir,
            user,
            starts: 0,
            tls: false,
            password: password.map(str::to_owned),
            max_connections: 60,
        }
    }

    /// A new cluster, started on a free loopback port, with a database `tollgate`.
    pub fn start(bin: &Path) -> PostgresServer {
        let mut server = PostgresServer::init(bin, None);
        server.restart();
        server
    }

    /// The port it listens on (the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/tollgate`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/tollgate", self.port)
    }

    /// Starts the server (again) on its port and waits until it accepts connections; creates
    /// the database `tollgate` on the first start. Panics with the log if it does not come up.
    pub fn restart(&mut self) {
        self.crash();
        self.starts += 1;
        let mut command = Command::new(self.bin.join("postgres"));
        command
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                &format!("max_connections={}", self.max_connections),
                // Superusers get no slots of their own: every client counts against the limit.
                "-c",
                "superuser_reserved_connections=0",
                "-c",
                "shared_buffers=16MB",
            ]);
        if self.tls {
            command.args(["-c", "ssl=on"]);
        }
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        let log = self.dir.path().join(format!("server.{}.log", self.starts));
        let mut process = ChildGuard::spawn("postgres", &mut command, &log);
        let up = super::wait_until(&mut process, || {
            let exists = self.psql(
                "postgres",
                "SELECT count(*) FROM pg_database WHERE datname = 'tollgate'",
            )?;
            if exists == "0" {
                self.psql("postgres", "CREATE DATABASE tollgate")?;
            }
            Some(())
        });
        if let Err(why) = up {
            panic!(
                "postgres did not start on port {}: {why}\n{}",
                self.port,
                process.log_tail(30)
            );
        }
        self.process = Some(process);
    }

    /// At most `n` client connections from the next start (60 unless set); superusers included.
    pub fn set_max_connections(&mut self, n: u32) {
        self.max_connections = n;
    }

    /// Makes the server (from its next start) accept TLS, with a self-signed certificate made by
    /// `openssl`, as well as plain connections. Panics if `openssl` fails.
    pub fn enable_tls(&mut self) {
        let data = self.dir.path().join("data");
        let out = Command::new("openssl")
            .args(["req", "-new", "-x509", "-days", "2", "-nodes", "-subj", "/CN=127.0.0.1"])
            .arg("-out")
            .arg(data.join("server.crt"))
            .arg("-keyout")
            .arg(data.join("server.key"))
            .stdin(Stdio::null())
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if let Some((uid, gid)) = self.user {
            for f in ["server.crt", "server.key"] {
                std::os::unix::fs::chown(data.join(f), Some(uid), Some(gid)).expect("chown the certificate");
            }
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(data.join("server.key"), std::fs::Permissions::from_mode(0o600))
            .expect("chmod the key");
        self.tls = true;
    }

    /// The postmaster and every process it started (backends, checkpointer, ...).
    fn pids(&self) -> Vec<u32> {
        let Some(main) = self.process.as_ref().map(ChildGuard::id) else {
            return Vec::new();
        };
        let mut pids = vec![main];
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // pid (comm) state ppid ...: comm may hold spaces, so read after its last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(main) {
                pids.push(pid);
            }
        }
        pids
    }

    /// An immediate shutdown (SIGQUIT, as `pg_ctl stop -m immediate`): connections are cut
    /// at once, as in a crash; the data stays for [`Self::restart`]. Waits until it is gone.
    /// A no-op when it is not running.
    pub fn crash(&mut self) {
        self.stop_with("QUIT");
    }

    /// Stops the server as `pg_ctl stop` does by default (SIGINT, a fast shutdown: each session
    /// is sent `FATAL 57P01` before its socket closes); the data stays for [`Self::restart`].
    /// Waits until it is gone.
    pub fn stop_fast(&mut self) {
        self.stop_with("INT");
    }

    /// Sends the postmaster `signal` and waits (10 s at most) until it is gone; then the guard
    /// kills and reaps whatever is left. A no-op when it is not running.
    fn stop_with(&mut self, signal: &str) {
        // A paused server would not act on the signal.
        self.resume();
        if let Some(mut process) = self.process.take() {
            super::try_signal(process.id(), signal);
            let deadline = Instant::now() + Duration::from_secs(10);
            while process.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// `psql` on database `db` running `sql`: its trimmed output, or `None` if it failed.
    pub fn psql(&self, db: &str, sql: &str) -> Option<String> {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-w",
                "-X",
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
            ])
            .args(["-tAc", sql])
            .env("PGCONNECT_TIMEOUT", "2")
            .env("PGPASSWORD", self.password.as_deref().unwrap_or(""))
            .stdin(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Stops the postmaster and all its processes (SIGSTOP): connections are accepted by the
    /// kernel, and statements sent, but nothing answers.
    pub fn pause(&self) {
        for pid in self.pids() {
            super::try_signal(pid, "STOP");
        }
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        for pid in self.pids() {
            super::try_signal(pid, "CONT");
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.crash();
    }
}

/// `capacity` tokens refilled `capacity` an hour: nothing refills over a test.
pub fn bucket(key: &str, capacity: u64) -> tollgate::store::BucketRef {
    use tollgate::core::bucket::{Limit, Rate};
    tollgate::store::BucketRef {
        lease_ut: 0,
        key: key.to_owned(),
        plan: tollgate::core::schedule::Plan::Fixed(Limit::new(capacity, Rate::per(capacity, 3_600_000_000).unwrap())),
    }
}

/// An enforced demand of one token on the request's bucket `instance`.
pub fn take(instance: usize) -> tollgate::core::bucket::Demand {
    use tollgate::core::bucket::{Demand, DemandKind, MICRO};
    Demand {
        instance,
        kind: DemandKind::Consume(MICRO),
        enforced: true,
    }
}
