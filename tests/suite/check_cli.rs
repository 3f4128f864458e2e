//! `tollgate check --rules PATH`: exit 1 with `FILE: rule `PATH`: REASON` for every invalid
//! fixture, exit 0 and the compiled tree for every valid one (docs/rules.md, docs/schedules-and-quotas.md, docs/operations.md).
//! `check --explain` is compared with the stored outputs in tests/snapshots/
//! (`TOLLGATE_UPDATE_SNAPSHOTS=1` rewrites them; see `explain_matches_the_stored_snapshots`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Datelike, Timelike, Weekday};
use chrono_tz::Tz;

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
        "debt_on_allowance.yaml",
        Some("buckets.trial"),
        &["nothing would ever repay the debt; give the bucket a `refill`, or use a `quota`"],
    ),
    inv(
        "debt_span_too_large.yaml",
        Some("buckets.month"),
        &[
            "a debt bucket of capacity 5000000000 with its floor at -5000000000 spans more than 9000000000 tokens, \
             the most every backend computes exactly; set `debt_floor` to -4000000000 or higher",
        ],
    ),
    inv(
        "debt_quota_floor_too_deep.yaml",
        Some("buckets.month"),
        &["at most one allowance below zero (-100), so that a reset or two always repays the debt"],
    ),
    inv(
        "debt_floor_without_debt.yaml",
        Some("buckets.tokens"),
        &["`debt_floor` is for a debt bucket: add `debt: true`"],
    ),
    inv(
        "debt_beside_rate_limit.yaml",
        Some("tenant"),
        &["declare the budget as a bucket of its own (`buckets:` with `debt: true`)"],
    ),
    inv(
        "capacity_too_large.yaml",
        Some("api_key"),
        &["capacity 9000000001 is above the maximum of 9000000000"],
    ),
    inv(
        "requests_per_unit_too_large.yaml",
        Some("api_key"),
        &["requests_per_unit 9000000001 is above the maximum"],
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
        &["a rule gives its limit once", "`bucket`, `buckets`, `token_bucket`, `rate_limit`"],
    ),
    inv(
        "buckets_with_bucket.yaml",
        Some("api_key"),
        &["a rule gives its limit once", "`bucket`, `buckets`, `token_bucket`, `rate_limit`"],
    ),
    inv(
        "buckets_empty.yaml",
        Some("api_key"),
        &["`buckets` is empty: name at least one bucket declared under `buckets:`"],
    ),
    inv("buckets_twice.yaml", Some("api_key"), &["`buckets` names `per_second` twice"]),
    inv(
        "buckets_unknown.yaml",
        Some("api_key"),
        &["unknown bucket `per_hoor`", "declared buckets: [per_second]"],
    ),
    inv(
        "buckets_names_a_quota.yaml",
        Some("api_key"),
        &["`buckets` names `monthly.quota`, the quota of bucket `monthly`: name `monthly`"],
    ),
    inv(
        "allowance_with_schedule.yaml",
        Some("buckets.trial"),
        &["`schedule` on a fixed allowance (`capacity` without `refill`)"],
    ),
    inv(
        "expires_on_token_bucket.yaml",
        Some("buckets.per_key"),
        &["`expires` is for a fixed allowance (`capacity` without `refill`)"],
    ),
    inv(
        "lease_on_quota.yaml",
        Some("buckets.per_key"),
        &["`lease` is for a token bucket", "a bucket with a `quota`"],
    ),
    inv(
        "lease_on_allowance.yaml",
        Some("buckets.trial"),
        &["`lease` is for a token bucket", "a fixed allowance"],
    ),
    inv(
        "lease_on_debt.yaml",
        Some("buckets.budget"),
        &["`lease` is for a token bucket", "a debt bucket"],
    ),
    inv(
        "lease_too_large.yaml",
        Some("buckets.global"),
        &["`lease: 500` must be between 1 and the bucket's capacity (100)"],
    ),
    inv(
        "lease_zero.yaml",
        Some("buckets.global"),
        &["`lease: 0` must be between 1 and the bucket's capacity (100)"],
    ),
    inv(
        "expires_zero.yaml",
        Some("buckets.trial"),
        &["`expires: 0s` must be from 1 second to 3660 days"],
    ),
    inv("expires_fraction.yaml", None, &["`1500ms` is not a whole number of seconds"]),
    inv(
        "allowance_beside_quota.yaml",
        Some("buckets.per_key"),
        &["`capacity` without `refill` beside a `quota`"],
    ),
    inv(
        "hidden_differs.yaml",
        Some("b"),
        &["bucket `shared` is already declared, with `hidden: true`"],
    ),
    inv(
        "buckets_with_schedule.yaml",
        Some("api_key"),
        &["`schedule` on a rule that references buckets: declare it on the bucket under `buckets:`"],
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
    // Schedules and quotas (docs/schedules-and-quotas.md): an entry's problem names the entry.
    inv(
        "schedule_bad_cron_hour.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["cron `* 25 * * *` is invalid: 25 is out of range for the hour field (0-23)"],
    ),
    inv(
        "schedule_bad_cron_word.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["cron `bogus` has 1 fields", "use five (minute hour day-of-month month day-of-week)"],
    ),
    inv(
        "schedule_six_fields.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["cron `0 * 9-17 * * MON-FRI` has six fields", "seconds are not supported"],
    ),
    inv(
        "schedule_cron_last.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["cron `* * L * *` uses the L, W or # extension, which is not supported"],
    ),
    inv(
        "schedule_cron_weekday.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["cron `* * 15W * *` uses the L, W or # extension"],
    ),
    inv(
        "schedule_cron_hash.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["cron `* * * * MON#1` uses the L, W or # extension"],
    ),
    inv(
        "schedule_unknown_timezone.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["unknown timezone `Mars/Olympus`", "use an IANA name"],
    ),
    inv(
        "schedule_scale_with_capacity.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["either scale or capacity and/or refill, not both"],
    ),
    inv(
        "schedule_zero_scale.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["scale must be a positive number, not 0"],
    ),
    inv(
        "schedule_negative_scale.yaml",
        Some("buckets.per_key.schedule[1]"),
        &["scale must be a positive number, not -1"],
    ),
    inv(
        "schedule_no_effect.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["must set scale, or capacity and/or refill"],
    ),
    inv(
        "schedule_bad_refill.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["bad refill `10/1w`", "bad duration `1w`"],
    ),
    inv(
        "schedule_unknown_field.yaml",
        None,
        &["buckets.per_key.schedule[0]", "unknown field `timzone`", "line 9"],
    ),
    inv(
        "schedule_on_quota_only.yaml",
        Some("buckets.monthly"),
        &["`schedule` changes a token bucket's capacity and refill, and this bucket has none"],
    ),
    inv(
        "schedule_on_unlimited.yaml",
        Some("api_key"),
        &["`schedule` on an unlimited rule"],
    ),
    inv(
        "schedule_with_bucket_reference.yaml",
        Some("api_key"),
        &["`schedule` on a rule that references bucket `per_key`", "declare it on the bucket under `buckets:`"],
    ),
    inv(
        "schedule_without_limit.yaml",
        Some("api_key"),
        &["`schedule` changes a limit, and this rule has none"],
    ),
    inv(
        "schedule_given_twice.yaml",
        Some("tenant"),
        &["`schedule` is given twice (on the rule and in `token_bucket`)"],
    ),
    inv(
        "quota_with_refill.yaml",
        Some("buckets.monthly"),
        &["a quota does not refill between its resets", "remove `refill` from `quota`"],
    ),
    inv(
        "quota_refill_without_capacity.yaml",
        Some("buckets.monthly"),
        &["a quota does not refill between its resets", "`refill` needs a `capacity` too"],
    ),
    inv(
        "quota_on_unlimited.yaml",
        Some("api_key"),
        &["`unlimited: true` cannot be combined with a quota"],
    ),
    inv(
        "quota_with_bucket_reference.yaml",
        Some("api_key"),
        &["`quota` on a rule that references bucket `per_key`", "declare it on the bucket under `buckets:`"],
    ),
    inv(
        "quota_zero_limit.yaml",
        Some("buckets.monthly"),
        &["quota: a quota's limit must be at least 1 token"],
    ),
    inv(
        "quota_bad_reset.yaml",
        Some("plan"),
        &["quota: cron `0 0 32 * *` is invalid: 32 is out of range for the day-of-month field (1-31)"],
    ),
    inv(
        "replaces_quota_companion.yaml",
        Some("j"),
        &["`replaces` names `metered.quota`, the quota of bucket `metered`", "so name `metered`"],
    ),
    inv(
        "schedule_never_active.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["cron `* * 30 FEB *` matches no day, so the window would never be active"],
    ),
    inv(
        "schedule_scale_below_one_token.yaml",
        Some("buckets.tiny.schedule[0]"),
        &["scale 0.5 leaves a capacity of 500000 micro-tokens, less than one token", "use `capacity: 0`"],
    ),
    inv(
        "schedule_on_blocked_rule.yaml",
        Some("client=blocked"),
        &["`schedule` on a rule with `requests_per_unit: 0`"],
    ),
    inv(
        "quota_companion_name_taken.yaml",
        Some("buckets.metered.quota"),
        &["bucket `metered.quota` is the name of bucket `metered`'s quota", "rename one of them"],
    ),
    inv(
        "quota_never_resets.yaml",
        Some("buckets.yearly"),
        &["quota: reset `0 0 30 FEB *` matches no day, so the quota would never reset"],
    ),
    inv(
        "schedule_backwards_range.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["range `22-6` in the hour field runs backwards", "write `22-23,0-6`"],
    ),
    inv(
        "schedule_nickname.yaml",
        Some("buckets.per_key.schedule[0]"),
        &["nicknames such as `@daily` are not supported"],
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
        "remote_address: `detailed_metric` shapes only the envoyproxy/ratelimit-named series (metrics.envoyproxy_names)",
        "api_key: `value_to_metric` is accepted for envoyproxy/ratelimit compatibility but not applied",
        "legacy: `requests_per_unit` is missing: read as 0, which denies every request",
    ];
    for e in expected {
        assert!(stdout.contains(e), "missing {e:?} in:\n{stdout}");
    }
    assert!(!stdout.contains("`shadow_mode` is accepted"), "{stdout}");
}

/// The tree shows each node's own `key=value`, even when the value contains `.` (a path
/// separator in bucket names), in matching order: exact, wildcards (the longest literal prefix
/// first: `/v1.2/*/items/*` before `*.png`, listed first), default.
#[test]
fn tree_prints_each_node_step_in_matching_order() {
    let out = check(&fixtures().join("valid/tollgate_schema.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    let expected = "    api_key  -> bucket per_api_key [replaces per_client_ip]\n      \
                    path=/upload  -> bucket uploads_per_key\n      \
                    path=/v1.2/*/items/*  -> bucket api_key.path=/v1.2/*/items/* [shadow]\n      \
                    path=*.png  -> bucket api_key.path=*.png\n      \
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
/// (each keeps its limit), and `replaces` names all of them, on an unlimited rule too (as in
/// envoyproxy/ratelimit, it drops the named rules from the request).
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
        "internal  unlimited [replaces per_tenant]\n",
    ] {
        assert!(stdout.contains(e), "missing {e:?} in:\n{stdout}");
    }
    assert!(!stdout.contains("has no effect on an unlimited rule"), "{stdout}");
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

/// The example under "## Tollgate's schema" in docs/rules.md checks clean through the CLI
/// (tests/suite/docs_examples.rs loads every rules example through the library).
#[test]
fn rules_reference_schema_example_checks_clean() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/rules.md")).unwrap();
    let section = readme
        .split_once("## Tollgate's schema")
        .expect("docs/rules.md has a \"## Tollgate's schema\" section")
        .1;
    let block = section
        .split_once("```yaml rules\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("the section has a ```yaml rules block")
        .0;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("readme.yaml");
    std::fs::write(&file, block).unwrap();
    let out = check(&file);
    assert_eq!(
        out.status.code(),
        Some(0),
        "docs/rules.md example:\n{block}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("domain "));
}

/// A scheduled bucket of `valid/schedules.yaml` as the preview must show it: its base, its
/// entries, and which entry (`Some(i)`) or the base (`None`) is in force at any instant, read in
/// `tz`, the first entry's zone, in which the preview shows instants.
struct Scheduled {
    name: &'static str,
    tz: Tz,
    base: &'static str,
    entries: &'static [&'static str],
    active: fn(&DateTime<Tz>) -> Option<usize>,
}

const TB_100_10: &str = "capacity 100, refill 10.000000 tokens/s, full from empty in 10.000s";

const SCHEDULED: &[Scheduled] = &[
    Scheduled {
        name: "business_hours",
        tz: chrono_tz::America::New_York,
        base: TB_100_10,
        entries: &["`* 9-17 * * MON-FRI` (America/New_York) scale 0.5: capacity 50, refill 5.000000 tokens/s, full from empty in 10.000s"],
        active: |t| (t.weekday().num_days_from_monday() < 5 && (9..=17).contains(&t.hour())).then_some(0),
    },
    Scheduled {
        name: "weekend",
        tz: chrono_tz::UTC,
        base: TB_100_10,
        entries: &["`* * * * SAT,SUN` (UTC) set: capacity 200, refill 10.000000 tokens/s, full from empty in 20.000s"],
        active: |t| (t.weekday().num_days_from_monday() >= 5).then_some(0),
    },
    Scheduled {
        name: "maintenance",
        tz: chrono_tz::Europe::Berlin,
        base: TB_100_10,
        entries: &["`* 4-5 * * SUN` (Europe/Berlin) set: denies every request"],
        active: |t| (t.weekday() == Weekday::Sun && (4..=5).contains(&t.hour())).then_some(0),
    },
    Scheduled {
        name: "per_key",
        tz: chrono_tz::UTC,
        base: TB_100_10,
        entries: &[
            "`* * * * SAT,SUN` (UTC) set: capacity 300, refill 30.000000 tokens/s, full from empty in 10.000s",
            "`* 0-5 * * *` (UTC) set: capacity 100, refill 20.000000 tokens/s, full from empty in 5.000s",
        ],
        active: |t| {
            if t.weekday().num_days_from_monday() >= 5 {
                Some(0)
            } else {
                (t.hour() <= 5).then_some(1)
            }
        },
    },
    Scheduled {
        name: "tenant",
        tz: chrono_tz::Europe::Berlin,
        base: "capacity 10, refill 1.000000 tokens/s, full from empty in 10.000s",
        entries: &["`* 9-17 * * MON-FRI` (Europe/Berlin) set: capacity 10, refill 2.000000 tokens/s, full from empty in 5.000s"],
        active: |t| (t.weekday().num_days_from_monday() < 5 && (9..=17).contains(&t.hour())).then_some(0),
    },
    Scheduled {
        name: "legacy",
        tz: chrono_tz::UTC,
        base: "capacity 10, refill 0.166667 tokens/s, full from empty in 60.000s",
        entries: &["`* 0-5 * * *` (UTC) scale 2: capacity 20, refill 0.333333 tokens/s, full from empty in 60.000s"],
        active: |t| (t.hour() <= 5).then_some(0),
    },
];

/// The header line of bucket `name` in `check` output and the lines indented under it.
fn bucket_block<'a>(stdout: &'a str, name: &str) -> Vec<&'a str> {
    let header = format!("    {name}: ");
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with(&header));
    match lines.next() {
        Some(first) => std::iter::once(first)
            .chain(lines.take_while(|l| l.starts_with("      ")))
            .collect(),
        None => Vec::new(),
    }
}

/// An instant as the preview prints it (`2026-12-01T00:00:00+01:00 CET`), checked to be shown
/// in `tz`, as Unix seconds.
fn preview_instant(text: &str, tz: Tz) -> i64 {
    let rfc3339 = text.split_whitespace().next().unwrap_or_default();
    let t = DateTime::parse_from_rfc3339(rfc3339).unwrap_or_else(|e| panic!("instant {text:?}: {e}"));
    let in_tz = t.with_timezone(&tz).format("%Y-%m-%dT%H:%M:%S%:z %Z").to_string();
    assert_eq!(text, in_tz, "instant not shown in {tz}");
    t.timestamp()
}

/// `schedule[i]` or `base` as the preview names who gives the limit.
fn by_index(by: &str) -> Option<usize> {
    if by == "base" {
        return None;
    }
    let i = by
        .strip_prefix("schedule[")
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or_else(|| panic!("bad `by {by}`"));
    Some(i.parse().unwrap())
}

/// `valid/schedules.yaml` checks clean and its preview shows, for each scheduled bucket, the
/// base, each entry, the limit now and by whom, and exactly the upcoming changes of limit; for
/// each quota its last and next reset. `now` is the real clock, so every assertion is one that
/// holds at any time: who is in force is worked out here from the local time of each instant.
#[test]
fn schedules_preview_base_entries_now_and_changes() {
    let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    let out = check(&fixtures().join("valid/schedules.yaml"));
    let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for s in SCHEDULED {
        let block = bucket_block(&stdout, s.name);
        let ctx = format!("bucket {}:\n{}", s.name, block.join("\n"));
        assert_eq!(
            block.first().copied(),
            Some(format!("    {}: base {}", s.name, s.base).as_str()),
            "{ctx}"
        );
        for (i, e) in s.entries.iter().enumerate() {
            assert_eq!(
                block.get(1 + i).copied(),
                Some(format!("      schedule[{i}]: {e}").as_str()),
                "{ctx}"
            );
        }
        // The text of the limit each entry (or the base) puts in force.
        let limit_of = |by: Option<usize>| match by {
            None => s.base,
            Some(i) => s.entries[i].split_once(": ").unwrap().1,
        };
        let now_line = block.get(1 + s.entries.len()).copied().unwrap_or_default();
        let (now_text, rest) = now_line
            .strip_prefix("      now (")
            .and_then(|l| l.split_once("): "))
            .unwrap_or_else(|| panic!("no `now` line after the entries: {ctx}"));
        let now = preview_instant(now_text, s.tz);
        assert!(
            (before..=after).contains(&now),
            "now {now_text} is not the clock: {ctx}"
        );
        let (limit, by) = rest
            .split_once(" (reported as ")
            .unwrap()
            .0
            .rsplit_once(" by ")
            .unwrap();
        let at = |t: i64| (s.active)(&DateTime::from_timestamp(t, 0).unwrap().with_timezone(&s.tz));
        assert_eq!(by_index(by), at(now), "wrong entry in force now: {ctx}");
        assert_eq!(limit, limit_of(at(now)), "{ctx}");
        // Every following line is a change: strictly later, within the 62-day horizon, a
        // different limit from the one before.
        let changes: Vec<(i64, Option<usize>)> = block[2 + s.entries.len()..]
            .iter()
            .map(|l| {
                let (t, rest) = l
                    .strip_prefix("      from ")
                    .and_then(|l| l.split_once(": "))
                    .unwrap_or_else(|| panic!("not a `from` line: {l:?} in {ctx}"));
                let (limit, by) = rest.rsplit_once(" by ").unwrap();
                let by = by_index(by);
                assert_eq!(limit, limit_of(by), "{ctx}");
                (preview_instant(t, s.tz), by)
            })
            .collect();
        assert!(
            (2..=4).contains(&changes.len()),
            "a weekly or daily window changes at least twice in 62 days: {ctx}"
        );
        let last = changes.last().unwrap().0;
        assert!(last <= now + 62 * 86_400, "{ctx}");
        // Walking every minute from now to the last change listed finds exactly those changes.
        let mut expected = Vec::new();
        let mut current = at(now);
        let mut t = now - now.rem_euclid(60) + 60;
        while t <= last {
            if at(t) != current {
                current = at(t);
                expected.push((t, current));
            }
            t += 60;
        }
        assert_eq!(changes, expected, "{ctx}");
    }

    // Quotas: the last reset is not after now and the next is after it, both in the quota's zone.
    for (name, line, period) in [
        (
            "monthly",
            "quota of 1000 tokens, reset at `0 0 1 * *` (Europe/Berlin), no refill in between",
            "1000 per month",
        ),
        (
            "per_key.quota",
            "quota of 10000 tokens, reset at `0 0 1 * *` (Europe/Berlin), no refill in between",
            "10000 per month",
        ),
        (
            "plan",
            "quota of 5 tokens, reset at `0 0 * * *` (UTC), no refill in between",
            "5 per day",
        ),
    ] {
        let block = bucket_block(&stdout, name);
        let ctx = format!("quota {name}:\n{}", block.join("\n"));
        assert_eq!(block.len(), 2, "{ctx}");
        assert_eq!(block[0], format!("    {name}: {line}"), "{ctx}");
        let (last, next) = block[1]
            .strip_prefix("      last reset ")
            .and_then(|l| l.strip_suffix(&format!(" (reported as {period})")))
            .and_then(|l| l.split_once(", next reset "))
            .unwrap_or_else(|| panic!("no reset line: {ctx}"));
        let tz = if name == "plan" {
            chrono_tz::UTC
        } else {
            chrono_tz::Europe::Berlin
        };
        let (last_s, next_s) = (preview_instant(last, tz), preview_instant(next, tz));
        assert!(last_s <= after && next_s > before, "{ctx}");
        if name == "plan" {
            assert!(last.ends_with("T00:00:00+00:00 UTC"), "{ctx}");
            assert_eq!(next_s - last_s, 86_400, "{ctx}");
        } else {
            // Berlin midnight on the 1st, in winter or summer time, one calendar month apart.
            for reset in [last, next] {
                assert!(
                    reset.ends_with("-01T00:00:00+01:00 CET") || reset.ends_with("-01T00:00:00+02:00 CEST"),
                    "{ctx}"
                );
            }
            let month = |t: &str| t[..4].parse::<u32>().unwrap() * 12 + t[5..7].parse::<u32>().unwrap();
            assert_eq!(month(next), month(last) + 1, "{ctx}");
        }
    }

    for e in [
        "    api_key  -> bucket per_key and quota per_key.quota\n",
        "    legacy  -> bucket legacy\n",
        "    plan  -> bucket plan\n",
        "    tenant  -> bucket tenant\n",
    ] {
        assert!(stdout.contains(e), "missing {e:?} in:\n{stdout}");
    }
}

/// The line under a debt bucket's header that gives its floor (`floor` tokens); a debt
/// quota's adds what its reset does.
fn debt_line(floor: &str, quota: bool) -> String {
    format!(
        "      debt: usage is debited in full down to a floor of {floor} tokens; hits_addend 0 passes while \
         the balance is positive{} (docs/usage-budgets.md)",
        if quota {
            "; a reset adds the allowance, up to it, so a debt is repaid, not forgiven"
        } else {
            ""
        }
    )
}

/// `valid/debt.yaml`: each debt bucket is one block, its header with its limits as declared
/// (the stores hold capacities raised by the floor's depth: never shown), then its floor; a
/// scheduled one's limit now and at each change is the declared limit of the window (or base)
/// that gives it, and a debt quota's line says a reset adds the allowance. `debt_floor: 0` is
/// a debt bucket with its floor at 0. `check --explain` shows the same limits and floors.
#[test]
fn debt_buckets_show_their_floor_and_their_limits_as_declared() {
    let out = check(&fixtures().join("valid/debt.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // 1000 a minute: 16.666667 a second; a capacity of 1000 fills in 60 s, 200 in 12 s.
    let base = "capacity 1000, refill 16.666667 tokens/s, full from empty in 60.000s";
    assert_eq!(
        bucket_block(&stdout, "tokens"),
        [
            format!("    tokens: {base} (reported as 1000 per minute)"),
            debt_line("-1000", false)
        ],
        "{stdout}"
    );
    let window = [
        "capacity 200, refill 16.666667 tokens/s, full from empty in 12.000s",
        "capacity 2000, refill 33.333333 tokens/s, full from empty in 60.000s",
    ];
    let peak = bucket_block(&stdout, "peak");
    let ctx = peak.join("\n");
    assert_eq!(
        peak[..4],
        [
            format!("    peak: base {base}"),
            debt_line("-300", false),
            format!("      schedule[0]: `* 9-17 * * *` (UTC) set: {}", window[0]),
            format!("      schedule[1]: `* 0-5 * * *` (UTC) scale 2: {}", window[1]),
        ],
        "{ctx}"
    );
    let limit_of = |by: &str| match by {
        "base" => base,
        "schedule[0]" => window[0],
        "schedule[1]" => window[1],
        other => panic!("by {other}: {ctx}"),
    };
    let (now, rest) = peak[4]
        .strip_prefix("      now (")
        .and_then(|l| l.split_once("): "))
        .unwrap_or_else(|| panic!("no `now` line: {ctx}"));
    let (limit, by) = rest
        .split_once(" (reported as ")
        .unwrap()
        .0
        .rsplit_once(" by ")
        .unwrap();
    assert_eq!(limit, limit_of(by), "now ({now}): {ctx}");
    // Daily windows: the 4 changes the preview lists are within 62 days.
    assert_eq!(peak.len(), 9, "{ctx}");
    for line in &peak[5..] {
        let (limit, by) = line
            .strip_prefix("      from ")
            .and_then(|l| l.split_once(": "))
            .and_then(|(_, rest)| rest.rsplit_once(" by "))
            .unwrap_or_else(|| panic!("not a `from` line: {line:?} in {ctx}"));
        assert_eq!(limit, limit_of(by), "{ctx}");
    }
    let month = bucket_block(&stdout, "month");
    assert_eq!(
        month[..2],
        [
            "    month: quota of 5000 tokens, reset at `0 0 1 * *` (UTC), no refill in between".to_owned(),
            debt_line("-1000", true)
        ],
        "{stdout}"
    );
    assert!(month[2].starts_with("      last reset "), "{stdout}");
    assert_eq!(
        bucket_block(&stdout, "both"),
        [
            "    both: capacity 10, refill 0.166667 tokens/s, full from empty in 60.000s (reported as 10 per minute)"
                .to_owned(),
            debt_line("-10", false)
        ],
        "{stdout}"
    );
    // The quota beside it has a floor of its own, minus its allowance by default.
    assert_eq!(
        bucket_block(&stdout, "both.quota")[..2],
        [
            "    both.quota: quota of 100 tokens, reset at `0 0 * * *` (UTC), no refill in between".to_owned(),
            debt_line("-100", true)
        ],
        "{stdout}"
    );
    assert_eq!(
        bucket_block(&stdout, "level"),
        [
            "    level: capacity 50, refill 0.833333 tokens/s, full from empty in 60.000s (reported as 50 per minute)"
                .to_owned(),
            debt_line("0", false)
        ],
        "{stdout}"
    );
    assert_eq!(
        bucket_block(&stdout, "plain"),
        ["    plain: capacity 50, refill 0.833333 tokens/s, full from empty in 60.000s (reported as 50 per minute)"],
        "{stdout}"
    );

    // --explain: the same limits as declared, each followed by its floor.
    let out = explain("tests/fixtures/valid/debt.yaml");
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    let explained = |line: &str| line.replacen("      debt: ", "              debt: ", 1);
    for expected in [
        format!("    tollgate: {base}\n{}\n", explained(&debt_line("-1000", false))),
        format!(
            "    tollgate: base {base}, changed by 2 schedule window(s) (see `tollgate check`)\n{}\n",
            explained(&debt_line("-300", false))
        ),
        format!(
            "    tollgate: quota of 5000 tokens, reset at `0 0 1 * *` (UTC), no refill in between\n{}\n",
            explained(&debt_line("-1000", true))
        ),
        format!(
            "    tollgate: capacity 10, refill 0.166667 tokens/s, full from empty in 60.000s\n{}\n              and \
             quota `both.quota`: 100 tokens, reset at `0 0 * * *` (UTC); a request must pass both\n{}\n",
            explained(&debt_line("-10", false)),
            explained(&debt_line("-100", true))
        ),
        format!(
            "    tollgate: capacity 50, refill 0.833333 tokens/s, full from empty in 60.000s\n{}\n",
            explained(&debt_line("0", false))
        ),
    ] {
        assert!(text.contains(&expected), "missing:\n{expected}\nin:\n{text}");
    }
    // The ordinary bucket, last, has no floor.
    assert!(
        text.ends_with(
            "  rule f\n    schema:   tollgate, bucket: plain\n    bucket:   `plain`, one instance per value of `f`\n    \
             tollgate: capacity 50, refill 0.833333 tokens/s, full from empty in 60.000s\n"
        ),
        "{text}"
    );
}

/// `tollgate serve --rules PATH` serves those rules instead of the `rules` setting: an invalid
/// file given that way stops it at start with the same file, rule and reason as `check`.
/// `check` describes a fixed allowance, and an expiring one with its period and the unit
/// Envoy is told (the one nearest the period).
#[test]
fn allowances_are_described() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("allowances.yaml");
    std::fs::write(
        &path,
        "domain: allowances
buckets:
  trial: {capacity: 3}
  daily: {capacity: 5, expires: 24h}
  weekly: {capacity: 40, expires: 7d}
descriptors:
  - {key: a, bucket: trial}
  - {key: b, bucket: daily}
  - {key: c, bucket: weekly}
",
    )
    .unwrap();
    let out = check(&path);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in [
        "trial: a fixed allowance of 3 tokens, never refilled (reported as 3 per year)",
        "daily: a fixed allowance of 5 tokens, whole again 86400s after its first use (reported as 5 per day)",
        "weekly: a fixed allowance of 40 tokens, whole again 604800s after its first use (reported as 40 per week)",
    ] {
        assert!(stdout.contains(line), "missing `{line}` in:\n{stdout}");
    }
}

#[test]
fn serve_takes_rules_from_the_flag() {
    let fixture = fixtures().join("invalid/schedule_nickname.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--rules"])
        .arg(&fixture)
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "error")
        .output()
        .expect("run tollgate serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let expected = format!(
        "{}: rule `buckets.per_key.schedule[0]`: cron `@daily` is invalid",
        fixture.display()
    );
    assert!(stderr.contains(&expected), "expected {expected:?} in:\n{stderr}");
}

// ---- check --explain: snapshots ---------------------------------------------------------

/// The stored outputs of `check --explain`, one per envoyproxy/ratelimit fixture, compared
/// exactly. After an intended change of the text, rewrite them with
/// `TOLLGATE_UPDATE_SNAPSHOTS=1 cargo test --test suite -- check_cli::explain_` and review the diff.
fn snapshots() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots")
}

/// `check --explain` on `rules` (relative to the crate root, run from there so the paths it
/// prints are relative too).
fn explain(rules: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["check", "--explain", "--rules", rules])
        .output()
        .expect("run tollgate check --explain")
}

#[test]
fn explain_matches_the_stored_snapshots() {
    let update = std::env::var_os("TOLLGATE_UPDATE_SNAPSHOTS").is_some_and(|v| v == "1");
    let dir = fixtures().join("envoyproxy");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut failures = Vec::new();
    for name in &names {
        let out = explain(&format!("tests/fixtures/envoyproxy/{name}"));
        assert_eq!(
            out.status.code(),
            Some(0),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = String::from_utf8(out.stdout).unwrap();
        let stem = name.trim_end_matches(".yaml");
        let file = snapshots().join(format!("explain_{stem}.txt"));
        if update {
            std::fs::create_dir_all(snapshots()).unwrap();
            std::fs::write(&file, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}; create it with TOLLGATE_UPDATE_SNAPSHOTS=1", file.display()));
        if got != want {
            let line = got
                .lines()
                .zip(want.lines())
                .position(|(a, b)| a != b)
                .map_or("(a line added or missing at the end)".to_owned(), |i| {
                    format!("line {}", i + 1)
                });
            failures.push(format!("{name}: differs from {} at {line}:\n{got}", file.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // No stored snapshot without its fixture.
    for entry in std::fs::read_dir(snapshots()).unwrap() {
        let file = entry.unwrap().file_name().into_string().unwrap();
        if let Some(stem) = file.strip_prefix("explain_").and_then(|f| f.strip_suffix(".txt")) {
            assert!(
                names.iter().any(|n| n.trim_end_matches(".yaml") == stem),
                "snapshot {file} has no fixture"
            );
        }
    }
}

/// The explanation reads no clock: two runs a second apart give the same bytes, and it never
/// prints the absolute path of the crate.
#[test]
fn explain_is_stable_and_prints_paths_as_given() {
    let first = explain("tests/fixtures/envoyproxy/month_year.yaml");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let second = explain("tests/fixtures/envoyproxy/month_year.yaml");
    assert_eq!(first.stdout, second.stdout);
    let text = String::from_utf8(first.stdout).unwrap();
    assert!(
        text.starts_with("domain billing (tests/fixtures/envoyproxy/month_year.yaml)\n"),
        "{text}"
    );
    assert!(!text.contains(env!("CARGO_MANIFEST_DIR")), "{text}");
}

/// Each difference the explanation claims, on the rule it concerns.
#[test]
fn explain_names_each_difference_on_its_rule() {
    let text = |name: &str| String::from_utf8(explain(&format!("tests/fixtures/envoyproxy/{name}")).stdout).unwrap();
    let month = text("month_year.yaml");
    for expected in [
        "tollgate: token bucket, capacity 30, refill 30 per 2592000s (one token every 86400s), reported as 30 per MONTH",
        "fixed window of 30 days counted from the Unix epoch (the one holding 2027-01-01 runs from 2026-12-03 to 2027-01-02)",
        "[window-edge] theirs: up to 60 within a moment across an edge; tollgate: at most 30 plus one per 86400s",
        "[epoch-window] their MONTH is not a calendar month; for one use `quota: {limit: 30, reset: \"0 0 1 * *\"}`",
        "[epoch-window] their YEAR is not a calendar year",
        "\n  [denied-hits] Denied hits consume nothing in tollgate",
    ] {
        assert!(month.contains(expected), "missing {expected:?} in:\n{month}");
    }
    let shared = text("share_threshold.yaml");
    assert!(
        shared.contains(
            "bucket:   `bucket=uploads-*`, one instance (every value of `bucket` matching `uploads-*` shares it)"
        ),
        "{shared}"
    );
    assert!(shared.contains("bucket:   `bucket=logs-*`, one instance per value of `bucket` matching `logs-*`"));
    let zero = text("zero.yaml");
    assert!(
        zero.contains("tollgate: denies every request, consumes nothing (reported as 0 per SECOND)"),
        "{zero}"
    );
    assert!(!zero.contains("[window-edge] theirs: up to 0"), "{zero}");
    assert!(text("shadow_mode.yaml").contains("[shadow] never denies"));
    assert!(text("replaces.yaml").contains("[replaces] drops per_region when both match one request"));
    let unlimited = text("unlimited.yaml");
    assert!(
        unlimited.contains("both:     unlimited: never limited, no counter or bucket"),
        "{unlimited}"
    );
    assert!(
        unlimited.contains("[unlimited] never limited in either; its `replaces` of per_caller applies in both"),
        "{unlimited}"
    );
    assert!(text("detailed_metric.yaml").contains(
        "[metrics] value_to_metric: affect at most the envoyproxy/ratelimit-named series, never tollgate's metrics"
    ));
    // The legend explains only the tags used.
    assert!(!zero.contains("[shadow]"), "{zero}");
}

/// A tollgate-schema rule is explained by its own limit, and a quota beside it is named.
#[test]
fn explain_covers_tollgate_schema_rules() {
    let out = explain("tests/fixtures/valid/tollgate_schema.yaml");
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("    schema:   tollgate, bucket: per_api_key\n"), "{text}");
    assert!(!text.contains("theirs:"), "no envoyproxy/ratelimit rule in it: {text}");
}

/// The excerpt of `check --explain` that docs/migration.md shows is the stored output, line
/// for line, so the guide cannot drift from what the command prints.
#[test]
fn migration_guide_shows_real_explain_output() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("docs/migration.md")).unwrap();
    let start = guide
        .find("```text\n")
        .expect("docs/migration.md shows an excerpt in a ```text block")
        + 8;
    let excerpt = &guide[start..start + guide[start..].find("```").unwrap()];
    let snapshot = std::fs::read_to_string(snapshots().join("explain_month_year.txt")).unwrap();
    assert!(
        snapshot.contains(excerpt),
        "docs/migration.md's excerpt is not in explain_month_year.txt:\n{excerpt}"
    );
}

/// `valid/lease.yaml`: a bucket's `lease` is shown beside it in the tree.
#[test]
fn a_lease_is_shown_in_the_tree() {
    let out = check(&fixtures().join("valid/lease.yaml"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("-> bucket everyone [lease 100]"), "{stdout}");
    assert!(stdout.contains("-> bucket per_client\n"), "{stdout}");
}
