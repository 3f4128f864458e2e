//! What the shared backends' settings sections have in common: the answer when a backend
//! fails, what to do when it cannot be reached at start, the circuit breaker's policy, and
//! URLs with their passwords hidden.

use serde::{Deserialize, Serialize};

use super::BreakerPolicy;

/// What a request gets when its backend fails (docs/backends.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Answer `OK` (every descriptor `OK`, nothing consumed) and count it.
    Allow,
    /// Answer `OVER_LIMIT` without `Retry-After`.
    Deny,
    /// Answer gRPC `UNAVAILABLE`, so Envoy's `failure_mode_deny` decides.
    Error,
    /// Decide on another store until the backend is back: for Redis, the store named by
    /// `redis.fallback` (Postgres by default); for Postgres, a local memory store.
    Fallback,
}

/// Starting while Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnreachableAtStart {
    /// `tollgate serve` exits with an error naming the URL and the reason.
    Exit,
    /// Start anyway, not ready (`/readyz` 503), and keep connecting in the background;
    /// requests meanwhile get the failure mode's answer.
    NotReady,
}

/// `Ok` when there is no problem, else every problem joined by `separator`: the answer of a
/// settings section's `validate`.
pub fn all_problems(problems: Vec<String>, separator: &str) -> Result<(), String> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join(separator))
    }
}

pub(crate) fn breaker_policy(failures: u32, percent: u8, window_ms: u64, open_ms: u64) -> BreakerPolicy {
    BreakerPolicy {
        min_failures: failures,
        failure_ratio: f64::from(percent) / 100.0,
        window_us: window_ms.saturating_mul(1_000),
        open_for_us: open_ms.saturating_mul(1_000),
    }
}

/// Refuses a `breaker_failure_percent` outside 1..=100 and a `breaker_window_ms` under 10 (the
/// window's ten slots need a millisecond each) in section `section`.
pub(crate) fn breaker_window(section: &str, percent: u8, window_ms: u64) -> Result<(), String> {
    if !(1..=100).contains(&percent) {
        return Err(format!(
            "{section}.breaker_failure_percent must be between 1 and 100, not {percent}"
        ));
    }
    if window_ms < 10 {
        return Err(format!(
            "{section}.breaker_window_ms must be at least 10, not {window_ms}"
        ));
    }
    Ok(())
}

/// `url` with any password replaced by `<redacted>`, for messages and `/config`: the password
/// of the userinfo (everything up to the last `@` counts as userinfo, so a password holding an
/// unencoded `/`, `?`, `#` or `@` is hidden whole; a query value holding `@` makes it hide more
/// than it must, never less) and the value of a `password`, `pass` or `sslpassword` query
/// parameter (libpq's and sqlx's URL forms accept those). Text that is not a URL at all (no
/// `://`) keeps only what follows its last `@`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return match url.rsplit_once('@') {
            Some((_, host)) => format!("<redacted>@{host}"),
            None => url.to_string(),
        };
    };
    let mut out = format!("{scheme}://");
    let after_userinfo = match rest.rsplit_once('@') {
        Some((userinfo, after)) => {
            match userinfo.split_once(':') {
                Some((user, _)) => out.push_str(&format!("{user}:<redacted>@")),
                None => out.push_str(&format!("{userinfo}@")),
            }
            after
        }
        None => rest,
    };
    let (host_path, query) = match after_userinfo.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (after_userinfo, None),
    };
    out.push_str(host_path);
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((key, _))
                    if ["password", "pass", "sslpassword"]
                        .iter()
                        .any(|secret| key.eq_ignore_ascii_case(secret)) =>
                {
                    format!("{key}=<redacted>")
                }
                _ => param.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url;

    #[test]
    fn passwords_are_hidden_wherever_a_url_carries_them() {
        for (url, shown) in [
            ("postgres://app:s3cret@db:5432/x", "postgres://app:<redacted>@db:5432/x"),
            ("postgres://app@db:5432/x", "postgres://app@db:5432/x"),
            ("postgres://db/x", "postgres://db/x"),
            ("redis://:pw@127.0.0.1:6379/2", "redis://:<redacted>@127.0.0.1:6379/2"),
            // An unencoded '/' or '@' in the password.
            (
                "postgres://app:hun/ter2@db:5432/x",
                "postgres://app:<redacted>@db:5432/x",
            ),
            ("postgres://app:a@b@db/x", "postgres://app:<redacted>@db/x"),
            // Query parameters.
            (
                "postgres://app@db/x?password=hunter2&sslmode=require",
                "postgres://app@db/x?password=<redacted>&sslmode=require",
            ),
            (
                "postgres://db/x?sslmode=verify-full&SSLPassword=k",
                "postgres://db/x?sslmode=verify-full&SSLPassword=<redacted>",
            ),
            ("not a url", "not a url"),
            // A raw '?' or '#' in the password; not a URL at all.
            (
                "postgres://u:Sec?r3tX@127.0.0.1:5/p",
                "postgres://u:<redacted>@127.0.0.1:5/p",
            ),
            (
                "postgres://u:a#b@127.0.0.1/p?sslmode=disable",
                "postgres://u:<redacted>@127.0.0.1/p?sslmode=disable",
            ),
            (
                "postgres//u:Secr3tX@127.0.0.1:55499/postgres",
                "<redacted>@127.0.0.1:55499/postgres",
            ),
            (
                "postgres:/u:Secr3tX@127.0.0.1/postgres",
                "<redacted>@127.0.0.1/postgres",
            ),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}
