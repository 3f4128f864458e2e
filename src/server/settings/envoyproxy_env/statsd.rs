//! Their statsd sink: `USE_STATSD` (on by default in theirs) and the variables it reads, as
//! `metrics.statsd`. Their stats library reads `STATSD_HOST`, `STATSD_PORT` and
//! `STATSD_PROTOCOL` (TCP unless `udp`) itself; their service adds `STATS_FLUSH_INTERVAL`,
//! `EXTRA_TAGS` and `DISABLE_STATS`.

use serde_json::json;

use super::{go_duration_ms, Reader};

/// The variables of their statsd sink besides `USE_STATSD` and `USE_DOG_STATSD`.
pub(super) const VARIABLES: [&str; 6] = [
    "STATSD_HOST",
    "STATSD_PORT",
    "STATSD_PROTOCOL",
    "STATS_FLUSH_INTERVAL",
    "EXTRA_TAGS",
    "DISABLE_STATS",
];

impl Reader<'_> {
    /// `USE_STATSD`: on when true, and when unset unless `USE_PROMETHEUS=true` (theirs refuses
    /// to start with both, so an environment that sets only `USE_PROMETHEUS=true` means
    /// Prometheus); off with `DISABLE_STATS=true`, which turns every sink of theirs off
    /// (tollgate's Prometheus metrics stay).
    pub(super) fn statsd(&mut self) {
        let use_statsd = self.bool("USE_STATSD");
        let prometheus = self.bool("USE_PROMETHEUS") == Some(true);
        let disabled = self.bool("DISABLE_STATS") == Some(true);
        let on = !disabled && use_statsd.unwrap_or(!prometheus);
        if !on {
            let why = if disabled {
                "DISABLE_STATS=true: no statsd (tollgate's Prometheus metrics are exported either way)"
            } else {
                "only read with USE_STATSD=true"
            };
            for name in VARIABLES.into_iter().filter(|n| *n != "DISABLE_STATS") {
                if self.get(name).is_some() {
                    self.out.notes.push((name.into(), why.into()));
                }
            }
            if disabled {
                self.out.notes.push((
                    "DISABLE_STATS".into(),
                    "no statsd; tollgate's Prometheus metrics are exported either way".into(),
                ));
            }
            return;
        }
        let host = self.get("STATSD_HOST").unwrap_or("localhost").to_owned();
        let port = match self.get("STATSD_PORT") {
            None => Some(8125),
            Some(_) => match self.port("STATSD_PORT") {
                Some(0) => {
                    self.refuse(
                        "STATSD_PORT",
                        "0 is not a port to send to; use the statsd server's port",
                    );
                    None
                }
                port => port,
            },
        };
        if host.is_empty() || host.contains(char::is_whitespace) {
            let shown = self.shown("STATSD_HOST");
            self.refuse("STATSD_HOST", format!("{shown} is not a host name or address"));
        } else if let Some(port) = port {
            // An IPv6 address is written in brackets before the port, as Go's JoinHostPort does.
            let addr = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            let from = match use_statsd {
                Some(_) => "USE_STATSD, STATSD_HOST, STATSD_PORT (their defaults localhost, 8125)",
                None => {
                    "USE_STATSD unset (their default: true), STATSD_HOST, STATSD_PORT (their defaults localhost, 8125)"
                }
            };
            self.set("metrics.statsd.addr", json!(addr), from);
        }
        match self.get("STATSD_PROTOCOL").map(str::to_ascii_lowercase).as_deref() {
            None | Some("tcp" | "tcp4" | "tcp6") => {
                let from = if self.get("STATSD_PROTOCOL").is_some() {
                    "STATSD_PROTOCOL"
                } else {
                    "STATSD_PROTOCOL unset (their default: tcp)"
                };
                self.set("metrics.statsd.protocol", json!("tcp"), from);
            }
            Some("udp" | "udp4" | "udp6") => self.set("metrics.statsd.protocol", json!("udp"), "STATSD_PROTOCOL"),
            Some(_) => {
                let shown = self.shown("STATSD_PROTOCOL");
                self.refuse("STATSD_PROTOCOL", format!("{shown} is not a protocol; use tcp or udp"));
            }
        }
        let interval = self.get("STATS_FLUSH_INTERVAL").unwrap_or("10s").to_owned();
        match go_duration_ms(&interval) {
            Some(ms) if ms >= 1 => self.set(
                "metrics.statsd.flush_interval_ms",
                json!(ms),
                "STATS_FLUSH_INTERVAL (their default 10s)",
            ),
            _ => {
                let shown = self.shown("STATS_FLUSH_INTERVAL");
                self.refuse(
                    "STATS_FLUSH_INTERVAL",
                    format!("{shown} is not a positive duration; use one like 10s or 500ms"),
                );
            }
        }
        if let Some(text) = self.get("EXTRA_TAGS").map(str::to_owned) {
            match extra_tags(&text) {
                Some(tags) => self.set("metrics.statsd.tags", json!(tags), "EXTRA_TAGS"),
                None => {
                    let shown = self.shown("EXTRA_TAGS");
                    self.refuse(
                        "EXTRA_TAGS",
                        format!("{shown} is not a list of key:value pairs; use k1:v1,k2:v2"),
                    );
                }
            }
        }
    }
}

/// Their `EXTRA_TAGS` (`k1:v1,k2:v2`, as their settings loader reads a map: pairs split at `,`,
/// each at its first `:`), or `None` for a pair without `:` or with an empty key. A later key
/// wins, as in theirs.
fn extra_tags(text: &str) -> Option<std::collections::BTreeMap<String, String>> {
    let mut tags = std::collections::BTreeMap::new();
    for pair in text.split(',') {
        let (k, v) = pair.split_once(':')?;
        let k = k.trim();
        if k.is_empty() || k.contains(['.', '|', '=']) {
            return None;
        }
        tags.insert(k.to_owned(), v.trim().to_owned());
    }
    Some(tags)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{notes_of, read};
    use serde_json::json;

    #[test]
    fn their_compose_environment_turns_statsd_on() {
        let env = read(&[
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "statsd"),
            ("STATSD_PORT", "9125"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
        ])
        .unwrap();
        let doc = env.document();
        assert_eq!(
            doc["metrics"]["statsd"],
            json!({"addr": "statsd:9125", "protocol": "tcp", "flush_interval_ms": 10000})
        );
        assert!(env.origins["metrics.statsd.addr"].starts_with("USE_STATSD, STATSD_HOST"));
    }

    #[test]
    fn unset_follows_their_default_unless_prometheus_is_asked_for() {
        let doc = read(&[("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "redis:6379")])
            .unwrap()
            .document();
        assert_eq!(doc["metrics"]["statsd"]["addr"], "localhost:8125");
        let doc = read(&[("USE_PROMETHEUS", "true"), ("STATSD_PORT", "9125")])
            .unwrap()
            .document();
        assert!(doc["metrics"].get("statsd").is_none(), "{doc}");
        let env = read(&[("USE_STATSD", "false"), ("STATSD_PORT", "9125")]).unwrap();
        assert!(env.document()["metrics"].get("statsd").is_none());
        assert_eq!(notes_of(&env, "STATSD_PORT"), ["only read with USE_STATSD=true"]);
        let env = read(&[("USE_STATSD", "true"), ("DISABLE_STATS", "true")]).unwrap();
        assert!(env.document()["metrics"].get("statsd").is_none());
        assert_eq!(notes_of(&env, "DISABLE_STATS").len(), 1);
    }

    #[test]
    fn protocol_interval_tags_and_refusals() {
        let doc = read(&[
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "::1"),
            ("STATSD_PROTOCOL", "UDP"),
            ("STATS_FLUSH_INTERVAL", "1m30s"),
            ("EXTRA_TAGS", "env:prod, version:1.2"),
        ])
        .unwrap()
        .document();
        assert_eq!(
            doc["metrics"]["statsd"],
            json!({
                "addr": "[::1]:8125",
                "protocol": "udp",
                "flush_interval_ms": 90000,
                "tags": {"env": "prod", "version": "1.2"}
            })
        );
        let err = read(&[
            ("USE_STATSD", "true"),
            ("STATSD_PORT", "eighty"),
            ("STATSD_PROTOCOL", "quic"),
            ("STATS_FLUSH_INTERVAL", "0s"),
            ("EXTRA_TAGS", "novalue"),
        ])
        .unwrap_err();
        let vars: Vec<&str> = err.0.iter().map(|e| e.variable.as_str()).collect();
        assert_eq!(
            vars,
            ["STATSD_PORT", "STATSD_PROTOCOL", "STATS_FLUSH_INTERVAL", "EXTRA_TAGS"],
            "{err}"
        );
    }
}
