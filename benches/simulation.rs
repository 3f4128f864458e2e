//! The simulation of replicas sharing one store through their local layers (the over-limit
//! cache and token leases), at scale: `cargo bench --bench simulation` runs 1,000 replicas for
//! 5 s of simulated traffic, with the layers and without, checks every bucket's bounds and
//! prints the table and the wall time of each run (benches/README.md, "Simulation"). Run by
//! `cargo test --bench simulation` (no `--bench` argument) it runs 20 replicas for a second, a
//! smoke test. `TOLLGATE_SIM_REPLICAS`, `TOLLGATE_SIM_SECONDS` and `TOLLGATE_SIM_SEED` change the
//! run. The simulation itself is the test suite's, `tests/suite/support/simulation.rs`, whose
//! module docs say what is simulated and checked.

#[path = "../tests/suite/support/simulation.rs"]
mod simulation;

use simulation::{run, table, Config};

fn setting(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v}: not a whole number")),
        Err(_) => default,
    }
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (replicas, seconds) = if bench { (1_000, 5) } else { (20, 1) };
    let replicas = setting("TOLLGATE_SIM_REPLICAS", replicas) as usize;
    let seconds = setting("TOLLGATE_SIM_SECONDS", seconds);
    let seed = setting("TOLLGATE_SIM_SEED", 1);
    let cfg = Config::new(seed, replicas, seconds * 1_000_000);
    let on = run(&cfg);
    let off = run(&cfg.without_layer());
    print!("{}", table(seed, &on, &off));
    println!(
        "wall time of the simulation: {:.2} s with the layers, {:.2} s without ({:.2} µs per request with them)",
        on.wall.as_secs_f64(),
        off.wall.as_secs_f64(),
        on.wall.as_secs_f64() * 1e6 / on.requests.max(1) as f64
    );
    let violations: Vec<&String> = on.violations.iter().chain(&off.violations).collect();
    if !violations.is_empty() {
        eprintln!("{violations:#?}");
        std::process::exit(1);
    }
}
