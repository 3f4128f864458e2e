//! `tollgate check --rules PATH`: exit 1 with `FILE: rule `PATH`: REASON` for every invalid
//! fixture, exit 0 and the compiled tree for every valid one (DESIGN 1.1, 1.3, 3).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn check(path: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("check")
        .arg("--rules")
        .arg(path)
        .output()
        .expect("run tollgate check")
}

/// One invalid fixture: the file the error must name (relative to `tests/fixtures/invalid`,
/// same as the fixture unless it is a directory), the rule (`None` for whole-file problems)
/// and substrings the reason must contain.
struct Invalid {
    fixture: &'static str,
    file: &'static str,
    rule: Option<&'static str>,
    reason: &'static [&'static str],
}

const fn inv(fixture: &'static str, rule: Option<&'static str>, reason: &'static [&'static str]) -> Invalid {
    Invalid {
        fixture,
        file: fixture,
        rule,
        reason,
    }
}

const INVALID: &[Invalid] = &[
    inv("bad_yaml.yaml", None, &["invalid rules", "line 5"]),
    inv(
        "unknown_field.yaml",
        None,
        &["buckets.per_key", "unknown field `capcity`", "line 5"],
    ),
    inv(
        "unknown_field_descriptor.yaml",
        None,
        &["descriptors[0]", "unknown field `limit`"],
    ),
    inv(
        "unknown_field_rate_limit.yaml",
        None,
        &["descriptors[0].rate_limit", "unknown field `burst`"],
    ),
    Invalid {
        fixture: "duplicate_domain",
        file: "duplicate_domain/b.yaml",
        rule: None,
        reason: &["domain `shared` is already declared in", "duplicate_domain/a.yaml"],
    },
    inv(
        "duplicate_descriptor.yaml",
        Some("path=/upload"),
        &["duplicate descriptor", "twice at this level"],
    ),
    inv("duplicate_default.yaml", Some("api_key"), &["duplicate descriptor"]),
    inv(
        "duplicate_wildcard.yaml",
        Some("path=/static/*"),
        &["duplicate descriptor"],
    ),
    inv("empty_key.yaml", Some("api_key.=x"), &["`key` must not be empty"]),
    inv(
        "bad_refill.yaml",
        Some("buckets.weekly"),
        &["bad refill `10/1w`", "bad duration `1w`"],
    ),
    inv(
        "zero_refill_tokens.yaml",
        Some("api_key"),
        &["bad refill `0/s`", "at least one token"],
    ),
    inv(
        "zero_capacity.yaml",
        Some("buckets.nothing"),
        &["capacity must be at least 1 token"],
    ),
    inv(
        "capacity_too_large.yaml",
        Some("api_key"),
        &["capacity 1000000001 is above the maximum of 1000000000"],
    ),
    inv(
        "requests_per_unit_too_large.yaml",
        Some("api_key"),
        &["requests_per_unit 1000000001 is above the maximum"],
    ),
    inv(
        "too_fine_rate.yaml",
        Some("api_key"),
        &[
            "refill `999999937/3650d` cannot be computed exactly on every backend",
            "use a token count that is a multiple of 1000",
        ],
    ),
    inv(
        "too_fine_rate_envoy.yaml",
        Some("api_key"),
        &["999999937 per year cannot be computed exactly on every backend; use a count that is a multiple of 1000, or a shorter unit"],
    ),
    inv(
        "fill_too_slow.yaml",
        Some("buckets.glacial"),
        &[
            "takes 1000000000 days (about 2739726 years) to fill from empty",
            "more than the maximum of 10 years",
        ],
    ),
    inv(
        "duplicate_bucket.yaml",
        None,
        &["buckets: bucket `b` is declared twice", "line 4 column 3"],
    ),
    inv(
        "reserved_bucket_name.yaml",
        Some("buckets.override"),
        &["the bucket name `override` is reserved for Envoy's per-descriptor limit overrides"],
    ),
    inv(
        "reserved_rate_limit_name.yaml",
        Some("override"),
        &["the bucket name `override` is reserved", "give the rate_limit a `name`"],
    ),
    inv(
        "replaces_unknown_unlimited.yaml",
        Some("api_key"),
        &["`replaces` names unknown bucket `per_ipp`", "buckets in this file: [per_ip]"],
    ),
    inv(
        "replaces_unknown_no_limit.yaml",
        Some("api_key"),
        &["`replaces` names unknown bucket `per_ipp`"],
    ),
    inv(
        "unlimited_with_bucket.yaml",
        Some("api_key"),
        &["`unlimited: true` cannot be combined with a limit"],
    ),
    inv(
        "unlimited_with_token_bucket.yaml",
        Some("api_key"),
        &["`unlimited: true` cannot be combined with a limit"],
    ),
    inv(
        "unlimited_with_limit_envoy.yaml",
        Some("api_key"),
        &["`unlimited: true` with a `unit`"],
    ),
    inv(
        "unlimited_with_unit.yaml",
        Some("api_key"),
        &["`unlimited: true` with a `unit`"],
    ),
    inv(
        "replaces_self.yaml",
        Some("api_key"),
        &["`replaces` names the rule's own bucket `per_key`"],
    ),
    inv(
        "replaces_unknown.yaml",
        Some("api_key"),
        &["`replaces` names unknown bucket `per_ky`"],
    ),
    inv(
        "replaces_cycle.yaml",
        Some("api_key"),
        &["`replaces` forms a cycle", "a -> b -> a"],
    ),
    inv("replaces_twice.yaml", Some("api_key"), &["`replaces` is given twice"]),
    inv(
        "unknown_bucket.yaml",
        Some("api_key"),
        &["unknown bucket `per_kee`", "declared buckets: [per_key]"],
    ),
    inv(
        "bad_unit.yaml",
        Some("remote_address"),
        &[
            "unknown unit `fortnight`",
            "second, minute, hour, day, week, month or year",
        ],
    ),
    inv(
        "missing_unit.yaml",
        Some("remote_address"),
        &["`rate_limit` needs `unit`"],
    ),
    inv(
        "non_ascii_bucket_name.yaml",
        Some("buckets.débit"),
        &["bucket name `d\\u{e9}bit` must be printable ASCII"],
    ),
    inv(
        "non_ascii_default_name.yaml",
        Some("city=Zürich"),
        &["must be printable ASCII", "give the rate_limit a `name`"],
    ),
    inv("empty_domain.yaml", None, &["`domain` must not be empty"]),
    inv("empty_file.yaml", None, &["invalid rules", "missing field `domain`"]),
    inv(
        "two_limits.yaml",
        Some("api_key"),
        &["a rule gives its limit once", "`bucket`, `token_bucket`, `rate_limit`"],
    ),
    inv(
        "name_with_bucket.yaml",
        Some("api_key"),
        &["`name` names an inline limit"],
    ),
    inv(
        "conflicting_bucket_name.yaml",
        Some("remote_address"),
        &["bucket `shared` is already declared with a different limit"],
    ),
];

#[test]
fn invalid_fixtures_exit_1_naming_file_rule_and_reason() {
    let dir = fixtures().join("invalid");
    let mut failures = Vec::new();
    for case in INVALID {
        let out = check(&dir.join(case.fixture));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let file = dir.join(case.file);
        let mut prefix = format!("{}: ", file.display());
        if let Some(rule) = case.rule {
            prefix.push_str(&format!("rule `{rule}`: "));
        }
        let line = stderr.lines().find(|l| l.starts_with(&prefix));
        let ok = out.status.code() == Some(1)
            && out.stdout.is_empty()
            && line.is_some_and(|l| case.reason.iter().all(|r| l.contains(r)));
        if !ok {
            failures.push(format!(
                "{}: exit {:?}, expected a line starting {prefix:?} containing {:?}; stderr:\n{stderr}",
                case.fixture,
                out.status.code(),
                case.reason
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every `.yaml` in `tests/fixtures/invalid` (and every fixture directory) is in the table, so a
/// new fixture cannot go untested.
#[test]
fn every_invalid_fixture_is_in_the_table() {
    let dir = fixtures().join("invalid");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            INVALID.iter().any(|c| c.fixture == name),
            "fixture {name} has no expectation in INVALID"
        );
    }
}

/// A whole directory is rejected when one of its files is invalid, and every problem is
/// reported, not only the first.
#[test]
fn invalid_directory_reports_every_problem() {
    let out = check(&fixtures().join("invalid"));
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for name in [
        "bad_yaml.yaml",
        "zero_capacity.yaml",
        "replaces_cycle.yaml",
        "empty_domain.yaml",
    ] {
        assert!(stderr.contains(name), "{name} not reported:\n{stderr}");
    }
}

#[test]
fn valid_fixtures_and_repository_rules_exit_0() {
    let dir = fixtures().join("valid");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 4, "valid fixtures missing: {paths:?}");
    paths.push(dir.clone());
    paths.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/rules"));
    for path in paths {
        let out = check(&path);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}: stderr:\n{}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.starts_with("domain "), "{}: {stdout}", path.display());
    }
}

#[test]
fn envoyproxy_schema_loads_and_lists_ignored_fields() {
    let out = check(&fixtures().join("valid/envoyproxy_schema.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let expected = [
        // the limits, with envoyproxy's N per unit read as capacity N refilled N per unit
        "per_ip: capacity 10, refill 10.000000 tokens/s, full from empty in 1.000s (reported as 10 per second)",
        "per_key: capacity 100, refill 1.666667 tokens/s, full from empty in 60.000s (reported as 100 per minute)",
        "client=blocked: denies every request (reported as 0 per second)",
        "database=users.tier: capacity 1000",
        "path=/api/*: capacity 3600, refill 1.000000 tokens/s, full from empty in 3600.000s (reported as 3600 per hour)",
        "status=404  -> bucket status=404",
        "legacy: denies every request (reported as 0 per second)",
        // shadow_mode and replaces are honoured
        "api_key  -> bucket per_key [shadow] [replaces per_ip]",
        "path=/health  unlimited",
        "database=users  (no limit)",
        "notes:",
        "remote_address: `detailed_metric` is accepted for envoyproxy/ratelimit compatibility and has no effect",
        "api_key: `value_to_metric` is accepted for envoyproxy/ratelimit compatibility and has no effect",
        "legacy: `requests_per_unit` is missing: read as 0, which denies every request",
    ];
    for e in expected {
        assert!(stdout.contains(e), "missing {e:?} in:\n{stdout}");
    }
    assert!(!stdout.contains("`shadow_mode` is accepted"), "{stdout}");
}

/// The tree shows each node's own `key=value`, even when the value contains `.` (a path
/// separator in bucket names), in matching order: exact, wildcards in config order, default.
#[test]
fn tree_prints_each_node_step_in_matching_order() {
    let out = check(&fixtures().join("valid/tollgate_schema.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    let expected = "    api_key  -> bucket per_api_key [replaces per_client_ip]\n      \
                    path=/upload  -> bucket uploads_per_key\n      \
                    path=*.png  -> bucket api_key.path=*.png\n      \
                    path=/v1.2/*/items/*  -> bucket api_key.path=/v1.2/*/items/* [shadow]\n      \
                    path  unlimited\n";
    assert!(stdout.contains(expected), "expected\n{expected}in:\n{stdout}");
}

#[test]
fn missing_path_is_an_error() {
    let path = fixtures().join("does-not-exist");
    let out = check(&path);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}: cannot read rules", path.display())),
        "{stderr}"
    );
}

/// envoyproxy/ratelimit's `rate_limit.name` is a label: two different limits may carry one name
/// (each keeps its limit), and `replaces` names all of them. A `replaces` on an unlimited rule
/// naming a known bucket is only a note.
#[test]
fn envoyproxy_names_are_labels() {
    let out = check(&fixtures().join("valid/envoyproxy_duplicate_names.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for e in [
        "    per_client: capacity 10, refill 10.000000 tokens/s, full from empty in 1.000s (reported as 10 per second)\n    \
         per_client: capacity 100, refill 1.666667 tokens/s, full from empty in 60.000s (reported as 100 per minute)\n    \
         per_tenant:",
        "tenant  -> bucket per_tenant [replaces per_client]\n",
        "internal: `replaces` has no effect on an unlimited rule",
    ] {
        assert!(stdout.contains(e), "missing {e:?} in:\n{stdout}");
    }
    // `user` declares the same name and limit as `remote_address`: one policy, listed once.
    assert_eq!(stdout.matches("    per_client: ").count(), 2, "{stdout}");
}

/// YAML merge keys are expanded: the merged fields apply, the node's own fields win, merges
/// nest, and a number in a `value` is still the text written.
#[test]
fn merge_keys_are_expanded() {
    let out = check(&fixtures().join("valid/merge_keys.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for e in [
        "remote_address: capacity 60, refill 1.000000 tokens/s, full from empty in 60.000s (reported as 60 per minute)",
        "api_key: capacity 10, refill 0.166667 tokens/s, full from empty in 60.000s (reported as 10 per minute)",
        "per_tenant: capacity 10, refill 0.166667 tokens/s, full from empty in 60.000s (reported as 10 per minute)",
        "status=404: capacity 60, refill 0.016667 tokens/s, full from empty in 3600.000s (reported as 60 per hour)",
    ] {
        assert!(stdout.contains(e), "missing {e:?} in:\n{stdout}");
    }
}

/// A file with merge keys still rejects a misspelt field, naming where it is.
#[test]
fn merge_keys_keep_unknown_fields_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(
        &file,
        "domain: m\ndescriptors:\n  - key: a\n    rate_limit: &r {unit: minute, requests_per_unit: 5}\n  \
         - key: b\n    rate_limit: {<<: *r, burst: 3}\n",
    )
    .unwrap();
    let out = check(&file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("descriptors[1].rate_limit: unknown field `burst`") && stderr.contains("merge keys"),
        "{stderr}"
    );
}

/// A directory without rules files is a mistake (a mistyped path, a missing mount): exit 1,
/// naming the path, on stderr. Hidden files and other extensions do not count.
#[test]
fn directory_without_rules_files_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("README.txt"), "not rules").unwrap();
    std::fs::write(dir.path().join(".hidden.yaml"), "domain: hidden\n").unwrap();
    let out = check(dir.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        stderr.starts_with(&format!("{}: no rules files found", dir.path().display())),
        "{stderr}"
    );
}

/// `.YAML` and `.Yml` are rules files too; hidden entries are still skipped.
#[test]
fn rules_file_extensions_are_case_insensitive() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("A.YAML"), "domain: upper\n").unwrap();
    std::fs::write(dir.path().join("b.Yml"), "domain: mixed\n").unwrap();
    std::fs::write(dir.path().join(".hidden.YAML"), "not: [valid\n").unwrap();
    let out = check(dir.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("domain mixed (") && stdout.contains("domain upper ("),
        "{stdout}"
    );
}

/// The example under "### Tollgate's schema" in README.md checks clean, so it cannot rot.
#[test]
fn readme_schema_example_checks_clean() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let section = readme
        .split_once("### Tollgate's schema")
        .expect("README.md has a \"### Tollgate's schema\" section")
        .1;
    let block = section
        .split_once("```yaml\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("the section has a ```yaml block")
        .0;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("readme.yaml");
    std::fs::write(&file, block).unwrap();
    let out = check(&file);
    assert_eq!(
        out.status.code(),
        Some(0),
        "README example:\n{block}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("domain "));
}
