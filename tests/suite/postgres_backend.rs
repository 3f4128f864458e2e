//! The Postgres store against the real PostgreSQL on the machine (`scripts/ensure-postgres`),
//! each test in a schema of its own: exact admission under concurrency, with and without the
//! bucket's row at the start; no deadlock between requests that name the same buckets in
//! opposite orders; the sweep. The shared vectors run in `tests/suite/vectors.rs`.

use crate::support;

use tollgate::core::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::core::schedule::Plan;
use tollgate::store::{BucketRef, PostgresStore, Store, StoreError};

use support::postgres::{bucket, take};

/// `requests` requests at once, spread over two stores (two pools, as two replicas would
/// have), each taking one token from `key`; how many were admitted.
async fn admitted(stores: &[PostgresStore], key: &str, capacity: u64, requests: usize) -> usize {
    let tasks: Vec<_> = (0..requests)
        .map(|i| {
            let store = stores[i % stores.len()].clone();
            let b = bucket(key, capacity);
            tokio::spawn(async move { store.apply(&[b], &[take(0)]).await })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let applied = t.await.expect("the task ends").expect("every request is decided");
        if !applied.decision.denied {
            ok += 1;
        }
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_admit_exactly_the_capacity_with_or_without_a_row() {
    let test = "concurrent_requests_admit_exactly_the_capacity_with_or_without_a_row";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let stores = [db.store().await, db.store().await];
    // No row at the start: 32 first touches at once must not each see a full bucket.
    assert_eq!(admitted(&stores, "cold", 10, 32).await, 10);
    // A row already there (one token taken): 9 more, whatever the concurrency.
    assert_eq!(admitted(&stores, "warm", 10, 1).await, 1);
    assert_eq!(admitted(&stores, "warm", 10, 32).await, 9);
    // A full batch's worth of requests on one bucket: exactly its capacity, every round.
    for round in 0..3 {
        assert_eq!(admitted(&stores, &format!("many-{round}"), 40, 64).await, 40);
    }
    db.drop().await;
}

/// Requests that take a token and give it back at once delete the row of a full bucket while
/// they hold it; others take a token or give one back. However they interleave, no write may
/// be lost: what the bucket holds at the end is its capacity plus every request's own change
/// (after minus before, as each decision reports it). (With the row inserted `ON CONFLICT DO
/// NOTHING` and locked by a separate `SELECT ... FOR UPDATE`, a request that found the row and
/// then lost it to such a delete decided on a full bucket and its write went nowhere.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_deleted_under_a_request_never_loses_its_write() {
    let test = "a_row_deleted_under_a_request_never_loses_its_write";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let stores = [db.store().await, db.store().await];
    // 10 tokens refilled over 1,000 hours: a few micro-tokens over the test.
    let churn = || BucketRef {
        lease_ut: 0,
        key: "churn".into(),
        plan: Plan::Fixed(Limit::new(10, Rate::per(10, 3_600_000_000_000).unwrap())),
    };
    let give = |instance| Demand {
        instance,
        kind: DemandKind::Refund(MICRO),
        enforced: false,
    };
    let tasks: Vec<_> = (0..600)
        .map(|i| {
            let store = stores[i % 2].clone();
            let b = churn();
            let demands = match i % 3 {
                0 => vec![take(0)],
                1 => vec![give(0)],
                _ => vec![take(0), give(0)],
            };
            tokio::spawn(async move { store.apply(&[b], &demands).await.expect("decided") })
        })
        .collect();
    let mut change: i128 = 0;
    for t in tasks {
        let outcome = t.await.unwrap().decision.instances[0];
        change += i128::from(outcome.after.tokens_ut) - i128::from(outcome.before.tokens_ut);
    }
    let held = stores[0].peek(&[churn()]).await.unwrap().kept[0].tokens_ut;
    let expected = i128::from(10 * MICRO) + change;
    assert!(
        (i128::from(held) - expected).abs() <= 1_000,
        "the bucket holds {held} µt, its requests left {expected}: writes were lost"
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_over_the_same_buckets_in_opposite_orders_never_deadlock() {
    let test = "requests_over_the_same_buckets_in_opposite_orders_never_deadlock";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    // Two stores (two pools, as two replicas): the {A, B} requests and the {B, A} ones never
    // share a batch, so their transactions meet on the rows' locks.
    let stores = [db.store().await, db.store().await];
    let store = stores[0].clone();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let store = stores[i % 2].clone();
            tokio::spawn(async move {
                let names = if i % 2 == 0 { ["a", "b"] } else { ["b", "a"] };
                let buckets = [bucket(names[0], 1_000), bucket(names[1], 1_000)];
                store.apply(&buckets, &[take(0), take(1)]).await
            })
        })
        .collect();
    let mut errors: Vec<StoreError> = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.expect("the task ends") {
            errors.push(e);
        }
    }
    assert!(
        errors.is_empty(),
        "{} requests failed, first: {:?}",
        errors.len(),
        errors.first()
    );
    // All 200 took one token from each (and under one token refilled meanwhile).
    let peeked = store.peek(&[bucket("a", 1_000), bucket("b", 1_000)]).await.unwrap();
    for s in &peeked.kept {
        assert!((800 * MICRO..801 * MICRO).contains(&s.tokens_ut), "{peeked:?}");
    }
    db.drop().await;
}

/// A bucket full again is swept; one still short is kept; and a check on a bucket that has no
/// row leaves none behind.
#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_deletes_only_buckets_full_again() {
    let test = "the_sweep_deletes_only_buckets_full_again";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let store = db.store().await;
    // 1,000 tokens a second: one token short is full again 1 ms later.
    let fast = BucketRef {
        lease_ut: 0,
        key: "fast".into(),
        plan: Plan::Fixed(Limit::new(1_000, Rate::per(1_000, 1_000_000).unwrap())),
    };
    store.apply(&[fast], &[take(0)]).await.unwrap();
    store.apply(&[bucket("slow", 10)], &[take(0)]).await.unwrap();
    let check = Demand {
        instance: 0,
        kind: DemandKind::Check,
        enforced: true,
    };
    store.apply(&[bucket("untouched", 10)], &[check]).await.unwrap();
    let rows = || async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let keys: Vec<Vec<u8>> =
            sqlx::query_scalar(&format!("SELECT key FROM {}.tollgate_buckets ORDER BY key", db.name))
                .fetch_all(&mut conn)
                .await
                .unwrap();
        keys.into_iter()
            .map(|k| String::from_utf8(k).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(rows().await, ["fast", "slow"]);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(store.sweep(100).await.unwrap(), 1);
    assert_eq!(rows().await, ["slow"]);
    db.drop().await;
}

/// A pass deletes at most `statements * batch` rows, oldest first, whatever is due; the next
/// pass takes the rest.
#[tokio::test(flavor = "multi_thread")]
async fn a_sweep_pass_is_bounded() {
    let test = "a_sweep_pass_is_bounded";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let store = db.store().await;
    // 1,000 tokens a second: one token short is full again 1 ms later.
    let fast = |i: usize| BucketRef {
        lease_ut: 0,
        key: format!("fast{i:02}"),
        plan: Plan::Fixed(Limit::new(1_000, Rate::per(1_000, 1_000_000).unwrap())),
    };
    for i in 0..25 {
        store.apply(&[fast(i)], &[take(0)]).await.unwrap();
    }
    store.apply(&[bucket("slow", 10)], &[take(0)]).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(store.sweep_pass(10, 2).await, 20, "two statements of ten");
    assert_eq!(
        store.sweep_pass(10, 2).await,
        5,
        "the rest, then a short statement ends the pass"
    );
    assert_eq!(store.sweep_pass(10, 2).await, 0);
    let peeked = store.peek(&[bucket("slow", 10)]).await.unwrap();
    assert!(
        peeked.kept[0].tokens_ut < 10 * MICRO,
        "the bucket short of full stays: {peeked:?}"
    );
    db.drop().await;
}

#[tokio::test]
async fn a_bad_url_or_schema_is_a_clear_error() {
    let mut settings = support::postgres::settings("mysql://127.0.0.1/x", "tollgate");
    let e = PostgresStore::new(&settings).err().expect("refused");
    assert!(e.to_string().contains("postgres.url"), "{e}");
    settings.url = support::postgres::DEFAULT_POSTGRES_URL.into();
    settings.schema = "x; DROP TABLE y".into();
    let e = PostgresStore::new(&settings).err().expect("refused");
    assert!(e.to_string().contains("postgres.schema"), "{e}");
    // Nothing listens on port 1: connecting fails in time, naming the server.
    settings.url = "postgres://postgres@127.0.0.1:1/x".into();
    settings.schema = "tollgate".into();
    let store = PostgresStore::new(&settings).unwrap();
    let e = store
        .connect(std::time::Duration::from_secs(5))
        .await
        .expect_err("unreachable");
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
}

const FIVE_PER_HOUR: &str = r#"
domain: api
descriptors:
  - key: user
    name: per_user
    token_bucket: {capacity: 5, refill: 5/1h}
"#;

/// `tollgate serve` with `backend: postgres` on `schema`, ready.
fn serve_on_postgres(url: &str, schema: &str) -> support::Tollgate {
    let settings = format!(
        "backend: postgres\npostgres:\n  url: {}\n  schema: {schema}\n  command_timeout_ms: 2000\n  connect_timeout_ms: 10000\n",
        support::yaml_str(url)
    );
    let mut tollgate = support::Tollgate::builder()
        .rules_file("api.yaml", FIVE_PER_HOUR)
        .settings(&settings)
        .start();
    let http = tollgate.http_addr;
    support::wait_until(&mut tollgate.process, || {
        support::http_get(http, "/readyz").filter(|(status, _)| *status == 200)
    })
    .unwrap_or_else(|why| panic!("tollgate not ready: {why}\n{}", tollgate.process.log_tail(60)));
    tollgate
}

/// Two replicas of `tollgate serve` with `backend: postgres` on one schema enforce one bucket
/// between them: 5 of 8 requests pass, whichever replica they reach.
#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_on_postgres_share_a_bucket() {
    let test = "two_replicas_on_postgres_share_a_bucket";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let (a, b) = {
        let (url, schema) = (db.url.clone(), db.name.clone());
        tokio::task::spawn_blocking(move || (serve_on_postgres(&url, &schema), serve_on_postgres(&url, &schema)))
            .await
            .unwrap()
    };
    let mut clients = Vec::new();
    for addr in [a.grpc_addr, b.grpc_addr] {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        clients.push(
            envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(
                channel,
            ),
        );
    }
    let mut ok = 0;
    for i in 0..8 {
        let response = clients[i % 2]
            .should_rate_limit(support::request("api", &[("user", "shared")], 1))
            .await
            .expect("answered")
            .into_inner();
        if response.overall_code == 1 {
            ok += 1;
        }
    }
    assert_eq!(ok, 5, "one bucket of 5 across both replicas");
    assert!(
        a.process.log().contains("connected to Postgres"),
        "{}",
        a.process.log_tail(20)
    );
    db.drop().await;
}

/// Runs `tollgate serve` with `settings` (and rules) until it exits or `within` passes; its
/// exit status (`None`: still running, then killed) and stderr.
fn serve_until_exit(settings: &str, within: std::time::Duration) -> (Option<std::process::ExitStatus>, String) {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("api.yaml");
    std::fs::write(&rules, FIVE_PER_HOUR).unwrap();
    let config = dir.path().join("tollgate.yaml");
    let (grpc, http) = (support::free_port(), support::free_port());
    std::fs::write(
        &config,
        format!(
            "grpc_addr: 127.0.0.1:{grpc}\nhttp_addr: 127.0.0.1:{http}\nadmin: {{enabled: false}}\nrules: {}\n{settings}",
            support::yaml_str(&rules.to_string_lossy())
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

/// Postgres unreachable at start: with `unreachable_at_start: exit` (the default) `serve`
/// refuses to start, naming the server and the reason; with `not_ready` it starts, answers
/// not ready naming Postgres, and answers requests by its failure mode meanwhile.
#[test]
fn unreachable_postgres_at_start() {
    let port = support::free_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/x");
    let settings = format!(
        "backend: postgres\npostgres: {{url: {}, connect_timeout_ms: 1000}}",
        support::yaml_str(&url)
    );
    let (status, stderr) = serve_until_exit(&settings, std::time::Duration::from_secs(15));
    let status = status.unwrap_or_else(|| panic!("still running after 15 s: {stderr}"));
    // Exit 1 with a message, not a panic (101).
    assert_eq!(status.code(), Some(1), "{status}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{port}")),
        "stderr does not name the server: {stderr}"
    );

    let settings = format!(
        "backend: postgres\npostgres: {{url: {}, connect_timeout_ms: 500, unreachable_at_start: not_ready, failure_mode: deny}}",
        support::yaml_str(&url)
    );
    let mut tollgate = support::Tollgate::builder()
        .rules_file("api.yaml", FIVE_PER_HOUR)
        .settings(&settings)
        .start();
    let (code, body) = support::http_get(tollgate.http_addr, "/readyz").expect("/readyz answers");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("Postgres"), "{body}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let response = rt.block_on(async {
        let mut client =
            envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
                format!("http://{}", tollgate.grpc_addr),
            )
            .await
            .unwrap();
        client
            .should_rate_limit(support::request("api", &[("user", "u")], 1))
            .await
            .expect("answered by the failure mode")
            .into_inner()
    });
    assert_eq!(response.overall_code, 2, "failure_mode: deny answers OVER_LIMIT");
    assert!(tollgate.process.exited().is_none(), "{}", tollgate.process.log_tail(20));
}

/// `tollgate migrate` with `settings` in a settings file: exit status, stdout, stderr.
fn migrate(settings: &str) -> (std::process::ExitStatus, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.yaml");
    std::fs::write(&config, settings).unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.args(["migrate", "--config"]).arg(&config);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TOLLGATE_") {
            command.env_remove(key);
        }
    }
    let out = command.output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `tollgate migrate` creates the schema and applies the migrations once (a second run finds
/// them in place); with `postgres.migrate: false`, `serve` refuses a schema that lacks them,
/// naming the command to run, and uses one that has them; an unreachable server is named with
/// the reason.
#[tokio::test(flavor = "multi_thread")]
async fn tollgate_migrate_prepares_the_schema_that_serve_then_only_checks() {
    let test = "tollgate_migrate_prepares_the_schema_that_serve_then_only_checks";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let postgres = format!(
        "postgres: {{url: {}, schema: {}, migrate: false, command_timeout_ms: 2000, connect_timeout_ms: 10000}}",
        support::yaml_str(&db.url),
        db.name
    );
    let settings = format!("backend: postgres\n{postgres}");

    let (status, stderr) =
        tokio::task::block_in_place(|| serve_until_exit(&settings, std::time::Duration::from_secs(20)));
    assert!(
        status.is_some_and(|s| !s.success()),
        "serve without the schema: {status:?} {stderr}"
    );
    assert!(
        stderr.contains("does not exist") && stderr.contains("tollgate migrate"),
        "the error says the schema is missing and names the command: {stderr}"
    );
    {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::query(&format!("CREATE SCHEMA \"{}\"", db.name))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let (status, stderr) =
        tokio::task::block_in_place(|| serve_until_exit(&settings, std::time::Duration::from_secs(20)));
    assert!(
        status.is_some_and(|s| !s.success()),
        "serve on an unmigrated schema: {status:?} {stderr}"
    );
    assert!(
        stderr.contains("tollgate migrate") && stderr.contains("20261130000001"),
        "the error names the missing migration and the command: {stderr}"
    );

    let (status, stdout, stderr) = tokio::task::block_in_place(|| migrate(&postgres));
    assert!(status.success(), "{status}: {stdout}{stderr}");
    assert!(
        stdout.contains(&format!("schema {}: applied 20261130000001 buckets", db.name)),
        "{stdout}"
    );
    let (status, stdout, _) = tokio::task::block_in_place(|| migrate(&postgres));
    assert!(status.success());
    let migrations = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "sql"))
        .count();
    assert!(
        stdout.contains(&format!("up to date ({migrations} migrations in place)")),
        "{stdout}"
    );

    let tollgate = {
        let (url, schema) = (db.url.clone(), db.name.clone());
        tokio::task::spawn_blocking(move || {
            let settings = format!(
                "backend: postgres\npostgres:\n  url: {}\n  schema: {schema}\n  migrate: false\n  command_timeout_ms: 2000\n  connect_timeout_ms: 10000\n",
                support::yaml_str(&url)
            );
            let mut tollgate = support::Tollgate::builder()
                .rules_file("api.yaml", FIVE_PER_HOUR)
                .settings(&settings)
                .start();
            let http = tollgate.http_addr;
            support::wait_until(&mut tollgate.process, || {
                support::http_get(http, "/readyz").filter(|(status, _)| *status == 200)
            })
            .unwrap_or_else(|why| panic!("not ready: {why}\n{}", tollgate.process.log_tail(40)));
            tollgate
        })
        .await
        .unwrap()
    };
    let mut client =
        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
            format!("http://{}", tollgate.grpc_addr),
        )
        .await
        .unwrap();
    let mut codes = Vec::new();
    for _ in 0..6 {
        let r = client
            .should_rate_limit(support::request("api", &[("user", "m")], 1))
            .await
            .expect("answered")
            .into_inner();
        codes.push(r.overall_code);
    }
    assert_eq!(
        codes,
        [1, 1, 1, 1, 1, 2],
        "five of six on a schema tollgate migrate made"
    );

    let port = support::free_port();
    let refused = format!(
        "postgres: {{url: {}, connect_timeout_ms: 2000}}",
        support::yaml_str(&format!("postgres://postgres:hunter2@127.0.0.1:{port}/x"))
    );
    let (status, stdout, stderr) = tokio::task::block_in_place(|| migrate(&refused));
    assert!(!status.success(), "{stdout}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{port}")) && stderr.contains("refused") && !stderr.contains("hunter2"),
        "names the server and the reason, not the password: {stderr}"
    );
    db.drop().await;
}

/// The key of sqlx's migration lock for database `name`: `0x3d32ad9e` times the CRC-32
/// (ISO-HDLC) of the name, as sqlx's `generate_lock_id` computes it.
fn migration_lock_id(name: &str) -> i64 {
    let mut crc = !0u32;
    for &b in name.as_bytes() {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    0x3d32_ad9e_i64 * i64::from(!crc)
}

/// Another replica (or any sqlx application in the same database) holding the migration lock
/// makes `tollgate migrate` wait for it, not fail after the decisions' 15 ms statement timeout.
#[tokio::test(flavor = "multi_thread")]
async fn tollgate_migrate_waits_for_the_migration_lock() {
    use sqlx::Connection;
    let test = "tollgate_migrate_waits_for_the_migration_lock";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(migration_lock_id(&database))
        .execute(&mut holder)
        .await
        .unwrap();
    let postgres = format!("postgres: {{url: {}, schema: {}}}", support::yaml_str(&db.url), db.name);
    let started = std::time::Instant::now();
    let migrating = tokio::task::spawn_blocking(move || migrate(&postgres));
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(!migrating.is_finished(), "tollgate migrate did not wait for the lock");
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(migration_lock_id(&database))
        .execute(&mut holder)
        .await
        .unwrap();
    let (status, stdout, stderr) = migrating.await.unwrap();
    assert!(status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("applied 20261130000001"), "{stdout}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(1500));
    db.drop().await;
}

/// A user without the right to create schemas in the database, but owning the configured one,
/// can migrate it (CREATE SCHEMA IF NOT EXISTS would be refused even though it exists).
#[tokio::test(flavor = "multi_thread")]
async fn a_user_owning_an_existing_schema_can_migrate_it() {
    use sqlx::Connection;
    let test = "a_user_owning_an_existing_schema_can_migrate_it";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let role = format!("r_{}", db.name);
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    for sql in [
        format!("CREATE ROLE \"{role}\" LOGIN"),
        format!("CREATE SCHEMA \"{}\" AUTHORIZATION \"{role}\"", db.name),
    ] {
        sqlx::query(&sql).execute(&mut admin).await.unwrap();
    }
    let url = db
        .url
        .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    assert_ne!(url, db.url, "the test URL names the user postgres: {}", db.url);
    let store = support::postgres::store(&url, &db.name).await;
    assert!(store.is_migrated());
    drop(store);
    db.drop().await;
    sqlx::query(&format!("DROP ROLE \"{role}\""))
        .execute(&mut admin)
        .await
        .unwrap();
}

/// Requests at once on one store: for each, `(key, capacity)`; their results in order.
async fn at_once(store: &PostgresStore, requests: &[(String, u64)]) -> Vec<Result<bool, StoreError>> {
    let tasks: Vec<_> = requests
        .iter()
        .map(|(key, capacity)| {
            let (store, b) = (store.clone(), bucket(key, *capacity));
            tokio::spawn(async move { store.apply(&[b], &[take(0)]).await.map(|a| !a.decision.denied) })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// An instance key longer than PostgreSQL can index (a descriptor value can be a long header)
/// is stored as a digest: it is decided exactly like any other, and the requests batched with
/// it are unaffected. (Stored as it was, the batch's locking statement failed for everyone in
/// the batch: "index row size exceeds btree maximum".)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_very_long_key_is_decided_and_fails_no_one_else() {
    let test = "a_very_long_key_is_decided_and_fails_no_one_else";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let store = db.store().await;
    // Random letters: PostgreSQL compresses a repetitive value below the index limit.
    let mut seed = 0x9E37_79B9_7F4A_7C15_u64;
    let noise: String = (0..8_000)
        .map(|_| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b'a' + ((seed >> 33) % 26) as u8)
        })
        .collect();
    let long = format!("api.user={noise}");
    let mut requests: Vec<(String, u64)> = (0..24).map(|i| (format!("short-{}", i % 6), 3)).collect();
    requests.extend((0..8).map(|_| (long.clone(), 5)));
    let results = at_once(&store, &requests).await;
    let failed: Vec<_> = results.iter().filter(|r| r.is_err()).collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
    let admitted = |prefix: &str| {
        requests
            .iter()
            .zip(&results)
            .filter(|((k, _), r)| k.starts_with(prefix) && matches!(r, Ok(true)))
            .count()
    };
    assert_eq!(admitted("short-"), 6 * 3, "each short key admits its capacity");
    assert_eq!(admitted("api.user="), 5, "the long key admits its capacity");
    // A key one byte different is another bucket.
    let other = format!("api.user={}!", &noise[..7_999]);
    assert!(matches!(at_once(&store, &[(other, 5)]).await[0], Ok(true)));
    db.drop().await;
}

/// When the database refuses a statement of a batch because of one request's row, the lane
/// decides its requests one by one, so only that request fails. (A trigger in the test schema
/// refuses the key `poison`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_the_database_refuses_fails_alone() {
    use sqlx::Connection;
    let test = "a_request_the_database_refuses_fails_alone";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let store = db.store().await;
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let schema = &db.name;
    for sql in [
        format!(
            "CREATE FUNCTION \"{schema}\".refuse_poison() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF NEW.key = convert_to('poison', 'UTF8') THEN RAISE EXCEPTION 'poison refused'; END IF; \
             RETURN NEW; END $$"
        ),
        format!(
            "CREATE TRIGGER refuse_poison BEFORE INSERT OR UPDATE ON \"{schema}\".tollgate_buckets \
             FOR EACH ROW EXECUTE FUNCTION \"{schema}\".refuse_poison()"
        ),
    ] {
        sqlx::query(&sql).execute(&mut admin).await.unwrap();
    }
    let mut requests: Vec<(String, u64)> = (0..30).map(|i| (format!("good-{i}"), 3)).collect();
    requests.insert(15, ("poison".to_owned(), 3));
    let results = at_once(&store, &requests).await;
    for ((key, _), result) in requests.iter().zip(&results) {
        if key == "poison" {
            assert!(result.is_err(), "the poison request: {result:?}");
        } else {
            assert!(matches!(result, Ok(true)), "{key}: {result:?}");
        }
    }
    db.drop().await;
}

/// A request that waited in the queue for more than half its budget is answered with a timeout
/// before its lane starts, so it cannot cut short the transaction of the requests batched with
/// it. One lane; rows `slow-1` and `slow-2` are locked by other transactions: request A (on
/// `slow-1`) holds the lane until `slow-1` is released; B waits behind it past half its budget;
/// C, sent later, goes in the next batch, whose transaction waits for `slow-2`. (With the batch
/// bounded by its oldest request's deadline, B's nearly spent budget timed C out too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_that_waited_too_long_does_not_time_out_the_rest_of_its_batch() {
    use sqlx::Connection;
    use std::time::Duration;
    let test = "a_request_that_waited_too_long_does_not_time_out_the_rest_of_its_batch";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let mut settings = support::postgres::settings(&db.url, &db.name);
    settings.pool_size = 1;
    settings.command_timeout_ms.0 = 2_000;
    let store = PostgresStore::new(&settings).unwrap();
    store.connect(Duration::from_secs(10)).await.unwrap();
    // The rows exist (one token taken), then two transactions lock one each.
    let made = at_once(&store, &[("slow-1".into(), 5), ("slow-2".into(), 5)]).await;
    assert!(made.iter().all(|r| matches!(r, Ok(true))), "{made:?}");
    // A connection of its own holding `key`'s row in an open transaction.
    let lock = |key: &'static str| {
        let (url, schema) = (db.url.clone(), db.name.clone());
        async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            for sql in [
                "BEGIN".to_owned(),
                format!(
                    "SELECT 1 FROM \"{schema}\".tollgate_buckets WHERE key = convert_to('{key}', 'UTF8') FOR UPDATE"
                ),
            ] {
                sqlx::query(&sql).execute(&mut conn).await.unwrap();
            }
            conn
        }
    };
    let release = |mut conn: sqlx::PgConnection| async move {
        sqlx::query("ROLLBACK").execute(&mut conn).await.unwrap();
    };
    let lock1 = lock("slow-1").await;
    let lock2 = lock("slow-2").await;
    let send = |key: &str| {
        let (store, b) = (store.clone(), bucket(key, 5));
        tokio::spawn(async move { store.apply(&[b], &[take(0)]).await.map(|a| !a.decision.denied) })
    };
    let started = std::time::Instant::now();
    let a = send("slow-1");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = send("b");
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let c = send("slow-2");
    // At 1.9 s: the lane is freed with B at 1.8 s of its 2 s; C's batch then waits for slow-2.
    tokio::time::sleep(Duration::from_millis(100)).await;
    release(lock1).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    release(lock2).await;
    let (a, b, c) = (a.await.unwrap(), b.await.unwrap(), c.await.unwrap());
    assert!(matches!(a, Ok(true)), "A waited for slow-1 within its budget: {a:?}");
    assert!(
        matches!(b, Err(StoreError::Timeout(_))),
        "B waited past half its budget: {b:?}"
    );
    assert!(matches!(c, Ok(true)), "C is decided once slow-2 is free: {c:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    db.drop().await;
}

/// A least-privilege user for `postgres.migrate: false`: without DELETE on the table `serve`
/// would start and then fail every decision, so the start refuses, naming the privilege; with
/// the grants docs/backends.md lists it starts and decides; with `migrate: true` it is told how to
/// migrate with another user.
#[tokio::test(flavor = "multi_thread")]
async fn a_least_privilege_user_is_checked_at_start() {
    use sqlx::Connection;
    let test = "a_least_privilege_user_is_checked_at_start";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    drop(db.store().await); // migrated by the (privileged) test user
    let role = format!("lp_{}", db.name);
    let schema = &db.name;
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut admin)
        .await
        .unwrap();
    for sql in [
        format!("CREATE ROLE \"{role}\" LOGIN"),
        format!("GRANT CONNECT ON DATABASE \"{database}\" TO \"{role}\""),
        format!("GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\""),
        format!("GRANT SELECT ON \"{schema}\"._sqlx_migrations TO \"{role}\""),
        format!("GRANT SELECT, INSERT, UPDATE ON \"{schema}\".tollgate_buckets TO \"{role}\""),
    ] {
        sqlx::query(&sql).execute(&mut admin).await.unwrap();
    }
    let url = db
        .url
        .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    let connect = |migrate: bool| {
        let mut settings = support::postgres::settings(&url, schema);
        settings.migrate = migrate;
        async move {
            let store = PostgresStore::new(&settings).unwrap();
            store.connect(std::time::Duration::from_secs(10)).await.map(|()| store)
        }
    };
    let refused = connect(false).await.err().expect("refused without DELETE").to_string();
    assert!(
        refused.contains("DELETE") && refused.contains("tollgate_buckets"),
        "{refused}"
    );
    sqlx::query(&format!("GRANT DELETE ON \"{schema}\".tollgate_buckets TO \"{role}\""))
        .execute(&mut admin)
        .await
        .unwrap();
    let store = connect(false).await.expect("starts with the grants");
    assert!(matches!(at_once(&store, &[("lp".into(), 1)]).await[0], Ok(true)));
    assert!(matches!(at_once(&store, &[("lp".into(), 1)]).await[0], Ok(false)));
    drop(store);
    let told = connect(true).await.err().expect("may not migrate").to_string();
    assert!(told.contains("postgres.migrate: false"), "{told}");
    db.drop().await;
    sqlx::query(&format!("DROP OWNED BY \"{role}\""))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query(&format!("DROP ROLE \"{role}\""))
        .execute(&mut admin)
        .await
        .unwrap();
}

/// `(updates, HOT updates)` of the schema's bucket table as the statistics report them, once
/// they report at least `min_updates` (backends send their counts when idle, within seconds).
async fn table_updates(db: &support::postgres::TestSchema, min_updates: i64) -> (i64, i64) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let started = std::time::Instant::now();
    loop {
        let (upd, hot): (i64, i64) = sqlx::query_as(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables \
             WHERE schemaname = $1 AND relname = 'tollgate_buckets'",
        )
        .bind(&db.name)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if upd >= min_updates || started.elapsed() > std::time::Duration::from_secs(30) {
            return (upd, hot);
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Decisions rewrite a bucket's row in place: no index covers a column they change, and the
/// fillfactor leaves room on the page, so nearly every update is heap-only (HOT). (With the
/// index on `full_at_us`, none was.)
#[tokio::test(flavor = "multi_thread")]
async fn decisions_update_their_rows_hot() {
    let test = "decisions_update_their_rows_hot";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let store = db.store().await;
    let requests = 600;
    for i in 0..requests {
        let applied = store
            .apply(&[bucket(&format!("hot-{}", i % 4), 1_000_000)], &[take(0)])
            .await
            .unwrap();
        assert!(!applied.decision.denied);
    }
    // The first decision on each bucket inserts its row; every other one updates it.
    let (updates, hot) = table_updates(&db, requests - 4).await;
    assert!(updates >= requests - 4, "{updates} updates reported");
    assert!(
        hot * 10 >= updates * 9,
        "{hot} of {updates} updates were HOT: most should be"
    );
    db.drop().await;
}

/// `postgres.unlogged: true` makes the bucket table UNLOGGED at migration, `false` makes it
/// logged again; with `migrate: false` a table that differs refuses the start, naming the
/// setting.
#[tokio::test(flavor = "multi_thread")]
async fn the_unlogged_setting_switches_the_table_both_ways() {
    use sqlx::Connection;
    use std::time::Duration;
    let test = "the_unlogged_setting_switches_the_table_both_ways";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let persistence = || async {
        let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let p: i8 = sqlx::query_scalar(&format!(
            "SELECT relpersistence::\"char\" FROM pg_class WHERE oid = '\"{}\".tollgate_buckets'::regclass",
            db.name
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        char::from(p as u8)
    };
    let with = |unlogged: bool, migrate: bool| {
        let mut settings = support::postgres::settings(&db.url, &db.name);
        settings.unlogged = unlogged;
        settings.migrate = migrate;
        PostgresStore::new(&settings).unwrap()
    };
    let store = db.store().await;
    assert_eq!(persistence().await, 'p', "logged by default");
    store.apply(&[bucket("kept", 10)], &[take(0)]).await.unwrap();

    let unlogged = with(true, true);
    unlogged.connect(Duration::from_secs(10)).await.unwrap();
    assert_eq!(persistence().await, 'u');
    // Its rows survive the switch, and decisions go on.
    let applied = unlogged.apply(&[bucket("kept", 10)], &[take(0)]).await.unwrap();
    assert_eq!(applied.decision.instances[0].after.tokens_ut / MICRO, 8, "{applied:?}");
    // Checked, not changed, without migrations.
    let e = with(false, false)
        .connect(Duration::from_secs(10))
        .await
        .expect_err("a table that is not as configured");
    assert!(e.to_string().contains("postgres.unlogged is false"), "{e}");
    assert_eq!(persistence().await, 'u');
    with(true, false).connect(Duration::from_secs(10)).await.unwrap();

    with(false, true).connect(Duration::from_secs(10)).await.unwrap();
    assert_eq!(persistence().await, 'p', "logged again");
    let e = with(true, false).connect(Duration::from_secs(10)).await.unwrap_err();
    assert!(e.to_string().contains("postgres.unlogged is true"), "{e}");
    db.drop().await;
}

/// A loopback TCP proxy in front of PostgreSQL that counts the client's round trips: each
/// `Sync` (extended protocol) or `Query` (simple protocol) message ends one.
struct RoundTrips {
    port: u16,
    count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl RoundTrips {
    async fn start(upstream: std::net::SocketAddr) -> RoundTrips {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = count.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut from_server, &mut to_client).await });
                let counter = counter.clone();
                tokio::spawn(async move {
                    // Untyped messages (SSL request, startup) until the startup message, then
                    // typed ones: a type byte and a length that counts itself.
                    let mut typed = false;
                    loop {
                        let tag = if typed {
                            match from_client.read_u8().await {
                                Ok(t) => Some(t),
                                Err(_) => return,
                            }
                        } else {
                            None
                        };
                        let Ok(len) = from_client.read_u32().await else { return };
                        let mut body = vec![0u8; len as usize - 4];
                        if from_client.read_exact(&mut body).await.is_err() {
                            return;
                        }
                        match tag {
                            Some(b'S' | b'Q') => {
                                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                            Some(_) => {}
                            // SSLRequest and GSSENCRequest come before the startup message.
                            None => typed = !matches!(body.get(..4), Some([4, 210, 22, 47] | [4, 210, 22, 48])),
                        }
                        let mut frame = Vec::with_capacity(len as usize + 1);
                        frame.extend(tag);
                        frame.extend_from_slice(&len.to_be_bytes());
                        frame.extend_from_slice(&body);
                        if to_server.write_all(&frame).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        RoundTrips { port, count }
    }

    fn get(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A decision on constant limits is one round trip to PostgreSQL: one statement in
/// autocommit, with the rows locked only inside the server. (In a transaction decided in Rust,
/// it was four: BEGIN, the locking statement, the write, COMMIT.)
#[tokio::test(flavor = "multi_thread")]
async fn a_decision_is_one_round_trip() {
    use std::time::Duration;
    let test = "a_decision_is_one_round_trip";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let url: url_parts::Url = db.url.parse().unwrap();
    let upstream = tokio::net::lookup_host((url.host.as_str(), url.port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = RoundTrips::start(upstream).await;
    let mut settings = support::postgres::settings(&url.with_port(proxy.port), &db.name);
    settings.pool_size = 1;
    let store = PostgresStore::new(&settings).unwrap();
    store.connect(Duration::from_secs(10)).await.unwrap();
    let both = [bucket("a", 1_000), bucket("b", 1_000)];
    // The first call prepares the statement (a round trip of its own).
    store.apply(&both, &[take(0), take(1)]).await.unwrap();
    let before = proxy.get();
    for _ in 0..20 {
        let applied = store.apply(&both, &[take(0), take(1)]).await.unwrap();
        assert!(!applied.decision.denied);
    }
    assert_eq!(proxy.get() - before, 20, "round trips for 20 decisions, one at a time");
    db.drop().await;
}

mod url_parts {
    //! Just enough of a `postgres://user@host:port/db` URL to put a proxy's port in it.

    pub struct Url {
        pub host: String,
        pub port: u16,
        before: String,
        after: String,
    }

    impl std::str::FromStr for Url {
        type Err = String;
        fn from_str(url: &str) -> Result<Url, String> {
            let at = url.find('@').map_or("postgres://".len(), |i| i + 1);
            let rest = &url[at..];
            let end = rest.find('/').unwrap_or(rest.len());
            let (host, port) = rest[..end].rsplit_once(':').unwrap_or((&rest[..end], "5432"));
            Ok(Url {
                host: host.to_owned(),
                port: port.parse().map_err(|_| format!("port in {url}"))?,
                before: url[..at].to_owned(),
                after: rest[end..].to_owned(),
            })
        }
    }

    impl Url {
        /// The same URL to 127.0.0.1 at `port`, without TLS (the proxy reads the messages).
        pub fn with_port(&self, port: u16) -> String {
            let join = if self.after.contains('?') { '&' } else { '?' };
            format!("{}127.0.0.1:{port}{}{join}sslmode=disable", self.before, self.after)
        }
    }
}

/// The batch function finds its rows through the primary key, however many keys a batch
/// carries and however many rows the table holds. (PostgreSQL planned its joins of the batch's
/// keys to the table as a sequential scan of every row and a hash join once a batch carried a
/// few dozen keys and the table a few thousand rows: about a fifth of PostgreSQL's CPU under
/// load, for rows the batch never touches.) Called here in a transaction of the test's own, so
/// `pg_stat_xact_user_tables` counts exactly its scans; the arguments are laid out as the
/// migration `20261204000001_decide_in_postgres.sql` describes.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_reads_its_rows_through_the_primary_key() {
    use sqlx::Connection;
    let test = "a_batch_reads_its_rows_through_the_primary_key";
    let Some(db) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let store = db.store().await; // creates and migrates the schema
    drop(store);
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    for sql in [
        "SET search_path TO \"{}\"",
        // Rows of other buckets, as a busy table holds, with fresh statistics.
        "INSERT INTO tollgate_buckets (key, tokens_ut, updated_us, full_at_us) \
         SELECT convert_to('other-' || g, 'UTF8'), 1, 1, 1 FROM generate_series(1, 3000) AS g",
        "ANALYZE tollgate_buckets",
        "BEGIN",
    ] {
        sqlx::query(&sql.replace("{}", &db.name))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    // One request over 40 constant buckets of 1,000 tokens, taking a token from each.
    let n: i64 = 40;
    let mut keys: Vec<Vec<u8>> = (0..n).map(|i| format!("wide-{i:02}").into_bytes()).collect();
    keys.sort();
    let bk: Vec<i64> = (1..=n)
        .flat_map(|k| [k, 1, 1_000 * MICRO as i64, MICRO as i64, 3_600_000_000, 0, 0, 0, 0])
        .collect();
    let dm: Vec<i64> = (1..=n).flat_map(|i| [i, 1, MICRO as i64, 1, 0]).collect();
    let batches = 20;
    for _ in 0..batches {
        let answers: Vec<Vec<i64>> = sqlx::query_scalar("SELECT tollgate_decide(NULL, $1, $2, $3, $4)")
            .bind(&keys)
            .bind(vec![n, n])
            .bind(&bk)
            .bind(&dm)
            .fetch_all(&mut conn)
            .await
            .unwrap();
        assert_eq!(answers.len(), 1);
        assert_eq!(&answers[0][..1], &[0], "decided");
        assert_eq!(answers[0][2], 0, "admitted");
    }
    let (seq, idx): (i64, i64) = sqlx::query_as(
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables \
         WHERE schemaname = $1 AND relname = 'tollgate_buckets'",
    )
    .bind(&db.name)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(idx >= batches, "{idx} index scans for {batches} batches");
    assert_eq!(
        seq, 0,
        "sequential scans of the whole table for {batches} batches of {n} keys"
    );
    sqlx::query("ROLLBACK").execute(&mut conn).await.unwrap();
    db.drop().await;
}
