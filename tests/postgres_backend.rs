//! The Postgres store against the real PostgreSQL on the machine (`scripts/ensure-postgres`),
//! each test in a schema of its own: exact admission under concurrency, with and without the
//! bucket's row at the start; no deadlock between requests that name the same buckets in
//! opposite orders; the sweep. The shared vectors run in `tests/vectors.rs`.

mod support;

use tollgate::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use tollgate::schedule::Plan;
use tollgate::store::{BucketRef, PostgresStore, Store, StoreError};

/// `capacity` tokens refilled `capacity` an hour: nothing refills over a test.
fn bucket(key: &str, capacity: u64) -> BucketRef {
    BucketRef {
        key: key.to_owned(),
        plan: Plan::Fixed(Limit::new(capacity, Rate::per(capacity, 3_600_000_000).unwrap())),
    }
}

fn take(instance: usize) -> Demand {
    Demand {
        instance,
        kind: DemandKind::Consume(MICRO),
        enforced: true,
    }
}

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
    let Some(url) = support::postgres::shared_postgres(test).await else {
        return;
    };
    let schema = support::postgres::unique_schema();
    let stores = [
        support::postgres::store(&url, &schema).await,
        support::postgres::store(&url, &schema).await,
    ];
    // No row at the start: 32 first touches at once must not each see a full bucket.
    assert_eq!(admitted(&stores, "cold", 10, 32).await, 10);
    // A row already there (one token taken): 9 more, whatever the concurrency.
    assert_eq!(admitted(&stores, "warm", 10, 1).await, 1);
    assert_eq!(admitted(&stores, "warm", 10, 32).await, 9);
    support::postgres::drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_over_the_same_buckets_in_opposite_orders_never_deadlock() {
    let test = "requests_over_the_same_buckets_in_opposite_orders_never_deadlock";
    let Some(url) = support::postgres::shared_postgres(test).await else {
        return;
    };
    let schema = support::postgres::unique_schema();
    let store = support::postgres::store(&url, &schema).await;
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let store = store.clone();
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
    support::postgres::drop_schema(&url, &schema).await;
}

/// A bucket full again is swept; one still short is kept; and a check on a bucket that has no
/// row leaves none behind.
#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_deletes_only_buckets_full_again() {
    let test = "the_sweep_deletes_only_buckets_full_again";
    let Some(url) = support::postgres::shared_postgres(test).await else {
        return;
    };
    let schema = support::postgres::unique_schema();
    let store = support::postgres::store(&url, &schema).await;
    // 1,000 tokens a second: one token short is full again 1 ms later.
    let fast = BucketRef {
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
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        let keys: Vec<Vec<u8>> = sqlx::query_scalar(&format!("SELECT key FROM {schema}.tollgate_buckets ORDER BY key"))
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
    support::postgres::drop_schema(&url, &schema).await;
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
