//! The deterministic simulation of 100 replicas sharing one store through their local layers
//! (the over-limit cache and token leases), store nodes failing and recovering:
//! `support/simulation.rs` says what is simulated and what each check means. Per seed it runs
//! the traffic with the layers and without, asserts that no bucket ever admitted more than its
//! bound (a) and that the store never took more than its own (b), that every local denial the
//! store would not have made is one the module docs allow (c), and prints the table of what
//! the layer costs and saves (d). `cargo test --test suite -- simulation:: --nocapture` shows
//! the tables; `cargo bench --bench simulation` runs 1,000 replicas.

use tollgate::core::bucket::MICRO;

use crate::support::simulation::{check_windows, run, table, Config, Outcome, Step};

const SECOND: u64 = 1_000_000;
const REPLICAS: usize = 100;

/// Everything a run checks held, and the run did what it is for.
fn assert_sound(seed: u64, on: &Outcome, off: &Outcome) {
    assert!(
        on.violations.is_empty(),
        "seed {seed}, with the layer: {:#?}",
        on.violations
    );
    assert!(off.violations.is_empty(), "seed {seed}, without: {:#?}", off.violations);
    for row in on.rows.iter().chain(&off.rows) {
        // (a) and (b), also counted among the violations: the tightest window of every bucket
        // kept room, however little.
        assert_eq!((row.over_a, row.over_b), (0, 0), "seed {seed}, {}", row.name);
        assert!(row.margin_a_ut.is_some_and(|m| m >= 0), "seed {seed}, {}", row.name);
        assert!(row.margin_b_ut.is_some_and(|m| m >= 0), "seed {seed}, {}", row.name);
    }
    // The run exercised what it checks: requests served by leases and denied by the cache,
    // lease calls and returns, nodes down and calls failing, answers out of order.
    assert!(
        on.lease_admissions > 1_000,
        "seed {seed}: {} lease admissions",
        on.lease_admissions
    );
    assert!(
        on.local_denials > 1_000,
        "seed {seed}: {} local denials",
        on.local_denials
    );
    assert!(on.grant_calls > 0 && on.return_calls > 0);
    assert!(on.outages > 0 && on.failed_calls > 0 && off.failed_calls > 0);
    assert!(
        on.max_in_flight > 100,
        "seed {seed}: {} calls in flight at most",
        on.max_in_flight
    );
    assert_eq!(on.requests, off.requests, "the same traffic both ways");
    // (c) The contrary local denials are the documented ones, and few: a credit the replica
    // could not see, or its clock behind the store's within the margin.
    assert_eq!(on.contrary.unexplained, 0);
    let contrary = on.contrary.elsewhere + on.contrary.own_refund + on.contrary.clock;
    assert!(
        contrary * 100 <= on.local_denials,
        "seed {seed}: {contrary} of {} local denials contrary to the store",
        on.local_denials
    );
    // (d) What the layer saves and costs (the figures are printed; documented in
    // benches/README.md): fewer store calls, lease calls included; and on every kind of bucket
    // no fewer hits admitted than without the layer but for what leases hold (at most `lease`
    // per replica), what failed lease calls lost, and 2% for requests decided at other
    // instants (a tenant served by a lease lets its client's bucket take a hit the store would
    // have refused whole).
    let calls = on.request_calls + on.grant_calls + on.return_calls;
    assert!(
        calls * 10 < off.request_calls * 9,
        "seed {seed}: {calls} store calls with the layer, {} without",
        off.request_calls
    );
    for (a, b) in on.rows.iter().zip(&off.rows) {
        let allowed = a.lease * MICRO * REPLICAS as u64 + a.lost_ut + b.admitted_ut / 50;
        assert!(
            a.admitted_ut + allowed >= b.admitted_ut,
            "seed {seed}, {}: {} µt admitted with the layer, {} without",
            a.name,
            a.admitted_ut,
            b.admitted_ut
        );
    }
}

fn seed(seed: u64) {
    let cfg = Config::new(seed, REPLICAS, 3 * SECOND);
    let on = run(&cfg);
    let off = run(&cfg.without_layer());
    println!("{}", table(seed, &on, &off));
    println!(
        "simulated in {:.2} s with the layers, {:.2} s without",
        on.wall.as_secs_f64(),
        off.wall.as_secs_f64()
    );
    assert_sound(seed, &on, &off);
}

#[test]
fn a_hundred_replicas_seed_1() {
    seed(1);
}

#[test]
fn a_hundred_replicas_seed_2() {
    seed(2);
}

#[test]
fn a_hundred_replicas_seed_3() {
    seed(3);
}

/// The same seed gives the same run: every event and decision (the digest) and the table,
/// although every layer draws a fresh random hash key.
#[test]
fn a_seed_gives_the_same_run() {
    let cfg = Config::new(7, REPLICAS, 2 * SECOND);
    let off = run(&cfg.without_layer());
    let (a, b) = (run(&cfg), run(&cfg));
    assert_eq!(a.digest, b.digest);
    assert_eq!(table(7, &a, &off), table(7, &b, &off));
    let other = run(&Config::new(8, REPLICAS, 2 * SECOND));
    assert_ne!(a.digest, other.digest, "another seed, another run");
}

/// A replica that admits what nobody granted is caught: every 20th request on the flooded
/// bucket admitted with no tokens breaks its bound (a), and only there.
#[test]
fn an_over_admitting_replica_is_caught() {
    let cfg = Config {
        over_admit_every: 20,
        ..Config::new(1, 20, SECOND)
    };
    let out = run(&cfg);
    assert!(
        out.violations
            .iter()
            .any(|v| v.starts_with("{flood}scraper: admitted") && v.contains("over the bound")),
        "{:#?}",
        out.violations
    );
    assert!(
        out.violations.iter().all(|v| v.starts_with("{flood}scraper: admitted")),
        "{:#?}",
        out.violations
    );
    let flood = out.rows.iter().find(|r| r.name == "flood").unwrap();
    assert!(flood.over_a > 0 && flood.over_b == 0, "{flood:?}");
}

/// The window check on logs made for it: exactly at the bound passes with no room left, a
/// token more fails; refunds and leased tokens raise the bound by what they are; leased tokens
/// spent beyond what was leased are counted.
#[test]
fn the_window_check_finds_what_passes_the_bound() {
    const T: u64 = 1_000_000;
    // Capacity 2 tokens, 1 token a second (1 µt a µs).
    let at_bound = [(0, Step::Take(2 * T)), (T, Step::Take(T)), (2 * T, Step::Take(T))];
    let w = check_windows(at_bound, 2 * T, 1);
    assert_eq!(w.over, 0);
    assert_eq!(w.worst.map(|w| w.0), Some(0), "no room left");
    let one_more = [(0, Step::Take(2 * T)), (T, Step::Take(T)), (T + 1, Step::Take(T))];
    let w = check_windows(one_more, 2 * T, 1);
    assert_eq!(w.over, 1);
    let (room, from, to, taken) = w.worst.unwrap();
    assert_eq!((room, from, to, taken), (-(T as i128) + 1, 0, T + 1, 4 * T));
    // The worst window need not start at the first step: 3 tokens within 1 µs, late.
    let late = [
        (0, Step::Take(T)),
        (5 * T, Step::Take(2 * T)),
        (5 * T + 1, Step::Take(T)),
    ];
    let w = check_windows(late, 2 * T, 1);
    assert_eq!(w.over, 1);
    assert_eq!(w.worst.map(|w| (w.1, w.2)), Some((5 * T, 5 * T + 1)));
    // A refund credited in the window raises the bound by itself; one before the window
    // does not.
    let refunded = [(0, Step::Take(2 * T)), (10, Step::Credit(T)), (20, Step::Take(T))];
    assert_eq!(check_windows(refunded, 2 * T, 1).over, 0);
    let refunded_before = [(0, Step::Credit(T)), (10, Step::Take(2 * T)), (20, Step::Take(T))];
    assert_eq!(check_windows(refunded_before, 2 * T, 1).over, 1);
    // Tokens leased and unspent at a window's start raise its bound: a token leased at 0,
    // spent at 5 s beside the 2 the store refilled to by then. Without the lease, 3 at once
    // pass the bound; a token leased after the store was emptied is no slack either.
    let leased = [
        (0, Step::Slack(T as i64)),
        (5 * T, Step::Take(2 * T)),
        (5 * T, Step::Take(T)),
        (5 * T, Step::Slack(-(T as i64))),
    ];
    let w = check_windows(leased, 2 * T, 1);
    assert_eq!(
        (w.over, w.negative_slack, w.peak_slack_ut, w.final_slack_ut),
        (0, 0, T as i64, 0)
    );
    assert_eq!(w.worst.map(|w| w.0), Some(0));
    let unleased = [(5 * T, Step::Take(2 * T)), (5 * T, Step::Take(T))];
    assert_eq!(check_windows(unleased, 2 * T, 1).over, 1);
    let leased_late = [(1, Step::Take(2 * T)), (2, Step::Slack(T as i64)), (3, Step::Take(T))];
    assert_eq!(check_windows(leased_late, 2 * T, 1).over, 1);
    let overspent = [(0, Step::Slack(T as i64)), (1, Step::Slack(-2 * T as i64))];
    assert_eq!(check_windows(overspent, 2 * T, 1).negative_slack, 1);
}
