//! Redis behind Sentinel (`redis.sentinel`, docs/backends.md): the client configuration that
//! makes fred ask the sentinels for the master at every (re)connect, so a failover moves the
//! pool to the promoted replica without a restart, and the start-up check that the sentinels
//! know the master at all (a wrong name would otherwise look like an outage forever).

use std::time::Duration;

use fred::clients::SentinelClient;
use fred::interfaces::{ClientLike, SentinelInterface};
use fred::prelude::{Config, Server, ServerConfig, TlsConnector};
use fred::types::config::{ConnectionConfig, PerformanceConfig, SentinelConfig};

use super::settings::SentinelSettings;

/// The client configuration of `sentinel` (its master name, sentinels, their credentials and
/// TLS); the master's credentials and database are the caller's. `None` when Sentinel is off.
///
/// Errors: a sentinel URL that is not `redis://host:port`, or TLS that cannot be set up.
pub(super) fn config(sentinel: &SentinelSettings) -> Option<Result<Config, String>> {
    let name = sentinel.master_name.as_ref()?;
    let build = || {
        let hosts = sentinel
            .addresses()?
            .into_iter()
            .map(|(host, port)| Server::new(host, port))
            .collect();
        let mut config = Config {
            server: ServerConfig::Sentinel {
                hosts,
                service_name: name.clone(),
                username: sentinel.username.clone(),
                password: sentinel.password.clone(),
            },
            ..Config::default()
        };
        if sentinel.tls() {
            let tls = TlsConnector::default_rustls().map_err(|e| format!("TLS: {}", e.details()))?;
            config.tls = Some(tls.into());
        }
        Ok(config)
    };
    Some(build())
}

/// `sentinel master "<name>" via host:port,host:port`, for logs and errors (no credentials).
pub(super) fn describe(sentinel: &SentinelSettings) -> String {
    let sentinels = sentinel
        .addresses()
        .map(|a| a.iter().map(|(h, p)| format!("{h}:{p}")).collect::<Vec<_>>().join(","))
        .unwrap_or_default();
    format!(
        "sentinel master {:?} via {sentinels}",
        sentinel.master_name.as_deref().unwrap_or_default()
    )
}

/// What the sentinels said of the master at start.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum MasterCheck {
    /// At least one sentinel gave its address.
    Known,
    /// Sentinels answered, none with an address for the name: a configuration error.
    Unknown(String),
    /// No sentinel answered at all: an outage (or wrong addresses).
    Unreachable(String),
}

/// Asks every sentinel of `sentinel` (at once, each within `timeout`) for the master's address
/// (`SENTINEL GET-MASTER-ADDR-BY-NAME`). The messages name the master and the sentinels asked,
/// never a password.
/// `tls`: whether the sentinels speak TLS (their `rediss://` URLs or `redis.tls`).
pub(super) async fn check_master(sentinel: &SentinelSettings, tls: bool, timeout: Duration) -> MasterCheck {
    let name = sentinel.master_name.clone().unwrap_or_default();
    let Ok(addresses) = sentinel.addresses() else {
        return MasterCheck::Unreachable("the sentinel URLs do not parse".into());
    };
    let tls = if tls {
        match TlsConnector::default_rustls() {
            Ok(tls) => Some(tls),
            Err(e) => return MasterCheck::Unreachable(format!("TLS: {}", e.details())),
        }
    } else {
        None
    };
    let asks = addresses.iter().map(|(host, port)| {
        let config = SentinelConfig {
            host: host.clone(),
            port: *port,
            username: sentinel.username.clone(),
            password: sentinel.password.clone(),
            tls: tls.clone().map(Into::into),
        };
        let connection = ConnectionConfig {
            connection_timeout: timeout,
            internal_command_timeout: timeout,
            max_command_attempts: 1,
            ..ConnectionConfig::default()
        };
        let performance = PerformanceConfig {
            default_command_timeout: timeout,
            ..PerformanceConfig::default()
        };
        let name = name.clone();
        async move {
            let client = SentinelClient::new(config, Some(performance), Some(connection), None);
            let answer = async {
                client.init().await?;
                client.get_master_addr_by_name::<Option<(String, u16)>, _>(name).await
            };
            let answer = match tokio::time::timeout(timeout, answer).await {
                Ok(Ok(addr)) => Ok(addr),
                Ok(Err(e)) => Err(e.details().chars().take(120).collect::<String>()),
                Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
            };
            let _ = client.quit().await;
            answer
        }
    });
    let answers = futures_util::future::join_all(asks).await;
    let mut answered = Vec::new();
    let mut unreachable = Vec::new();
    for ((host, port), answer) in addresses.iter().zip(answers) {
        match answer {
            Ok(Some(_)) => return MasterCheck::Known,
            Ok(None) => answered.push(format!("{host}:{port}")),
            Err(why) => unreachable.push(format!("{host}:{port} ({why})")),
        }
    }
    if answered.is_empty() {
        return MasterCheck::Unreachable(format!(
            "no sentinel could be asked for master {name:?}: {}",
            unreachable.join(", ")
        ));
    }
    let mut message = format!(
        "no sentinel knows a master named {name:?}: asked {}, which answered that they monitor no such master",
        answered.join(", ")
    );
    if !unreachable.is_empty() {
        message.push_str(&format!("; not reachable: {}", unreachable.join(", ")));
    }
    message.push_str("; set redis.sentinel.master_name to the name in the sentinels' `sentinel monitor` line");
    MasterCheck::Unknown(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(urls: &[&str]) -> SentinelSettings {
        SentinelSettings {
            master_name: Some("mymaster".into()),
            urls: urls.iter().map(|u| (*u).to_owned()).collect(),
            username: Some("watcher".into()),
            password: Some("sentinel-secret".into()),
        }
    }

    #[test]
    fn the_sentinels_their_credentials_and_tls_reach_freds_configuration() {
        let built = config(&settings(&["redis://10.0.0.1:26379", "redis://s-1:26380"]))
            .expect("sentinel on")
            .expect("a configuration");
        let ServerConfig::Sentinel {
            hosts,
            service_name,
            username,
            password,
        } = &built.server
        else {
            panic!("not a sentinel configuration: {:?}", built.server);
        };
        assert_eq!(service_name, "mymaster");
        assert_eq!(hosts, &[Server::new("10.0.0.1", 26379), Server::new("s-1", 26380)]);
        assert_eq!(username.as_deref(), Some("watcher"));
        assert_eq!(password.as_deref(), Some("sentinel-secret"));
        // The master's credentials are the caller's (redis.username, redis.password).
        assert_eq!(built.password, None);
        assert!(built.tls.is_none());
        let tls = config(&settings(&["rediss://s-0:26379"])).unwrap().unwrap();
        assert!(tls.tls.is_some(), "rediss:// sentinels: TLS");
        assert!(
            config(&SentinelSettings::default()).is_none(),
            "off without a master name"
        );
        let shown = describe(&settings(&["redis://10.0.0.1:26379", "redis://s-1:26380"]));
        assert_eq!(shown, "sentinel master \"mymaster\" via 10.0.0.1:26379,s-1:26380");
    }
}
