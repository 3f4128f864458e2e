//! The `metrics.statsd` settings section.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::core::units::Millis;

/// Sending envoyproxy/ratelimit's stats to a statsd server (docs/monitoring.md, "statsd"); their
/// `USE_STATSD`, `STATSD_HOST`, `STATSD_PORT`, `STATSD_PROTOCOL`, `STATS_FLUSH_INTERVAL` and
/// `EXTRA_TAGS` map onto it. Prometheus metrics are exported either way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StatsdSettings {
    /// The statsd server, `host:port` (a name is looked up at each connection attempt);
    /// `null`: no statsd.
    pub addr: Option<String>,
    /// `udp` (one datagram of at most 1432 bytes per batch of lines) or `tcp` (lines on one
    /// connection, opened again after a failure), as their `STATSD_PROTOCOL`.
    pub protocol: StatsdProtocol,
    /// How often the counters are sent, each with what it gained since the last time (their
    /// `STATS_FLUSH_INTERVAL`, 10 s by default); timers are sent within a second of each
    /// sample.
    pub flush_interval_ms: Millis,
    /// Tags added to every name as their stats library adds them to a statsd name:
    /// `.__<key>=<value>` after the name, keys in order, `.`, `:` and `|` in a value replaced by
    /// `_` (their `EXTRA_TAGS`).
    pub tags: BTreeMap<String, String>,
    /// Most lines waiting to be sent (timer samples); beyond it samples are dropped, so a slow
    /// or absent statsd server never holds up a decision.
    pub queue_lines: usize,
}

/// How lines reach the statsd server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatsdProtocol {
    /// Datagrams: nothing waits for the server.
    #[default]
    Udp,
    /// One stream connection (their stats library's default).
    Tcp,
}

impl Default for StatsdSettings {
    fn default() -> Self {
        StatsdSettings {
            addr: None,
            protocol: StatsdProtocol::Udp,
            flush_interval_ms: Millis(10_000),
            tags: BTreeMap::new(),
            queue_lines: 10_000,
        }
    }
}

impl StatsdSettings {
    /// Every problem of these settings, each naming its setting.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(addr) = &self.addr {
            match addr.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {}
                _ => problems.push(format!(
                    "metrics.statsd.addr: {addr:?} is not host:port (e.g. 127.0.0.1:8125 or statsd:9125)"
                )),
            }
        }
        if self.flush_interval_ms.0 == 0 {
            problems.push("metrics.statsd.flush_interval_ms must be at least 1ms".into());
        }
        if self.queue_lines == 0 {
            problems.push("metrics.statsd.queue_lines must be at least 1".into());
        }
        for key in self.tags.keys() {
            if key.is_empty() || key.contains(['.', ':', '|', '=', '\n']) {
                problems.push(format!(
                    "metrics.statsd.tags: the key {key:?} must be non-empty and hold none of . : | ="
                ));
            }
        }
        problems
    }

    /// The suffix the tags give every name (`.__k=v` per tag, keys in order; see [`Self::tags`]).
    pub fn tag_suffix(&self) -> String {
        self.tags
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!(".__{k}={}", v.replace(['.', ':', '|'], "_")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_name_the_setting() {
        let mut s = StatsdSettings {
            addr: Some("statsd".into()),
            ..Default::default()
        };
        s.flush_interval_ms = Millis(0);
        s.tags.insert("a.b".into(), "x".into());
        let problems = s.problems();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("metrics.statsd.addr"));
        s = StatsdSettings {
            addr: Some("statsd:9125".into()),
            ..Default::default()
        };
        assert!(s.problems().is_empty());
        s.addr = Some("[::1]:8125".into());
        assert!(s.problems().is_empty());
    }

    #[test]
    fn tags_follow_their_libraries_form() {
        let mut s = StatsdSettings::default();
        s.tags.insert("version".into(), "1.2:3".into());
        s.tags.insert("env".into(), "prod".into());
        assert_eq!(s.tag_suffix(), ".__env=prod.__version=1_2_3");
    }
}
