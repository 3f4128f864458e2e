//! The instruction-count gate (`scripts/instruction-gate`, benches/README.md) fails when a path
//! gets slower: the driver's deliberate slowdown (`TOLLGATE_INSTRUCTIONS_SLOWDOWN`, busy work
//! added to every measured decision, never set outside this test) makes the memory path cost
//! more than the committed baseline allows, and the gate exits 1 naming it; without it the same
//! measurement passes. Needs valgrind: fails under `CI=true` without it, else skips.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The gate's driver: `INSTRUCTIONS_BIN` (scripts/test builds it), or built here.
fn driver() -> PathBuf {
    if let Ok(path) = std::env::var("INSTRUCTIONS_BIN") {
        return PathBuf::from(path);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--release", "--example", "instructions"])
        .current_dir(root)
        .status()
        .expect("run cargo");
    assert!(built.success(), "cargo build --release --example instructions failed");
    root.join("target/release/examples/instructions")
}

/// The gate on the memory path only, with `slowdown` rounds of busy work per decision.
fn gate(slowdown: u32) -> Output {
    Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/instruction-gate"))
        .args(["--only", "memory"])
        .env("INSTRUCTIONS_BIN", driver())
        .env("INSTRUCTIONS_DECISIONS", "2000")
        .env("TOLLGATE_INSTRUCTIONS_SLOWDOWN", slowdown.to_string())
        .output()
        .expect("run scripts/instruction-gate")
}

#[test]
fn a_slowdown_fails_the_gate_and_the_committed_code_passes_it() {
    if Command::new("valgrind").arg("--version").output().is_err() {
        let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        assert!(!ci, "no valgrind and CI=true (scripts/apt-install valgrind)");
        eprintln!("a_slowdown_fails_the_gate_and_the_committed_code_passes_it: skipped, no valgrind");
        return;
    }
    let text = |o: &Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let passed = gate(0);
    assert_eq!(passed.status.code(), Some(0), "{}", text(&passed));
    // About 7 instructions a round: 200 rounds are some 1,400 more per decision, 14% of the
    // baseline's ~10,000, far past its 3% tolerance.
    let slowed = gate(200);
    let out = text(&slowed);
    assert_eq!(slowed.status.code(), Some(1), "{out}");
    assert!(
        out.contains("REGRESSION") && out.contains("memory cost more instructions"),
        "{out}"
    );
}
