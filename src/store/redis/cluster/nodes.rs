//! One master of a Redis Cluster as tollgate uses it: a connection pool to it alone (a fred
//! centralized pool, with the credentials, TLS and timeouts of the settings), its own batching
//! lanes and its own circuit breaker. A node that fails fails the calls routed to it, and only
//! those: the other masters' pools, lanes and breakers never wait for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use fred::clients::Client;
use fred::prelude::{ClientLike, Error as FredError, ErrorKind};
use fred::types::{Key, Value};
use tokio::sync::oneshot;

use super::super::batch::{Answer, Batcher, Job, LaneSettings};
use super::super::Conn;
use super::slots::Addr;
use crate::store::{Breaker, BreakerPolicy, Outcome, Permit, StoreError, Transition};

/// What a node answered instead of running a call, read from the error Redis sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Redirect {
    /// `MOVED <slot> <host:port>`: the slot has a new master; ask it, and refresh the map.
    Moved(Addr),
    /// `ASK <slot> <host:port>`: the slot is being migrated; ask that node once, after `ASKING`.
    Ask(Addr),
    /// `TRYAGAIN`: a multi-key call during a migration; try again shortly.
    TryAgain,
    /// `CLUSTERDOWN`: the node serves no slot now (the cluster is down, or it lost its slots).
    Down,
}

/// The redirect in a failed call's error, if it is one.
pub(crate) fn redirect_of(e: &StoreError) -> Option<Redirect> {
    let StoreError::Unavailable(cause) = e.cause() else {
        return None;
    };
    let details = std::error::Error::source(cause)
        .and_then(|s| s.downcast_ref::<FredError>())
        .map_or(cause.message(), |f| f.details());
    parse_redirect(details)
}

/// Reads `MOVED 3999 127.0.0.1:6381`, `ASK ...`, `TRYAGAIN ...`, `CLUSTERDOWN ...`.
pub(crate) fn parse_redirect(details: &str) -> Option<Redirect> {
    let mut words = details.split_whitespace();
    let kind = words.next()?;
    let addr = |mut words: std::str::SplitWhitespace<'_>| {
        let _slot = words.next()?;
        let (host, port) = words.next()?.rsplit_once(':')?;
        Some(Addr {
            host: host.trim_start_matches('[').trim_end_matches(']').to_string(),
            port: port.parse().ok()?,
        })
    };
    match kind {
        "MOVED" => addr(words).map(Redirect::Moved),
        "ASK" => addr(words).map(Redirect::Ask),
        "TRYAGAIN" => Some(Redirect::TryAgain),
        "CLUSTERDOWN" => Some(Redirect::Down),
        _ => None,
    }
}

/// A master of the cluster, with its own pool, lanes and breaker.
pub(crate) struct Node {
    pub(crate) addr: Addr,
    pub(crate) conn: Arc<Conn>,
    batcher: Batcher,
    breaker: Breaker,
    started: Instant,
    /// Whether any of its connections was ever up: a node that was up and has none now is
    /// failing (fail at once); one still connecting for the first time is waited for.
    was_up: AtomicBool,
    /// Whether its pool was told to connect (once: each time would start more connections).
    connecting: AtomicBool,
}

impl Node {
    /// A node over `conn` (a pool to it alone, not connected yet), its lanes started. Call
    /// within a Tokio runtime.
    pub(crate) fn new(addr: Addr, conn: Arc<Conn>, lane: LaneSettings, policy: BreakerPolicy) -> Node {
        Node {
            batcher: Batcher::start(conn.clone(), lane),
            addr,
            conn,
            breaker: Breaker::new(policy),
            started: Instant::now(),
            was_up: AtomicBool::new(false),
            connecting: AtomicBool::new(false),
        }
    }

    /// Waits until a connection of the pool is up, or `deadline`. fred's `wait_for_connect`
    /// misses a connection that comes up while it subscribes (see `RedisStore::connect`), so
    /// the wait is renewed every `CONNECT_RECHECK`. Errors: not connected by `deadline`, or
    /// fred's error.
    pub(crate) async fn wait_connected(&self, deadline: tokio::time::Instant) -> Result<(), String> {
        loop {
            if self.connected() {
                return Ok(());
            }
            let step = deadline.min(tokio::time::Instant::now() + super::super::CONNECT_RECHECK);
            match tokio::time::timeout_at(step, self.conn.pool.wait_for_connect()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) if step >= deadline => return Err("not reachable in time".into()),
                Err(_) => {}
            }
        }
    }

    /// Whether the caller is the first to start this node's connections (and must).
    pub(crate) fn start_connecting(&self) -> bool {
        !self.connecting.swap(true, Ordering::AcqRel)
    }

    fn mono_us(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether any of its connections is up.
    pub(crate) fn connected(&self) -> bool {
        let up = self.conn.pool.clients().iter().any(|c| c.is_connected());
        if up {
            self.was_up.store(true, Ordering::Relaxed);
        }
        up
    }

    /// Whether it is failing: its breaker is open, or its connections went down.
    pub(crate) fn failing(&self) -> bool {
        self.breaker.is_open() || (!self.connected() && self.was_up.load(Ordering::Relaxed))
    }

    /// Whether it has been up since it was made.
    pub(crate) fn was_up(&self) -> bool {
        self.connected() || self.was_up.load(Ordering::Relaxed)
    }

    /// One request's call on this node (through its lanes), within `deadline`; `asking`
    /// sends `ASKING` before it on the same connection. Records the outcome in the node's
    /// breaker. Errors: as the call failed, a redirect included ([`redirect_of`]); an open
    /// breaker or a node whose connections are down fails at once.
    pub(crate) async fn call(
        &self,
        keys: Vec<Key>,
        args: Vec<Value>,
        asking: bool,
        deadline: tokio::time::Instant,
    ) -> Result<Answer, StoreError> {
        let Some(permit) = self.breaker.allow(self.mono_us()) else {
            return Err(StoreError::Unavailable(
                format!("Redis Cluster node {} is failing (circuit open)", self.addr).into(),
            ));
        };
        if !self.connected() {
            if self.was_up.load(Ordering::Relaxed) {
                let e = StoreError::Unavailable(format!("not connected to Redis Cluster node {}", self.addr).into());
                self.record::<()>(permit, &Err(e.clone()));
                return Err(e);
            }
            // A node new to the map (a promoted replica): its pool is still connecting.
            let _ = self.wait_connected(deadline).await;
        }
        let (reply, answer) = oneshot::channel();
        let result = match self.batcher.submit(Job {
            keys,
            args,
            asking,
            reply,
            origin: crate::store::round_trip::origin(),
        }) {
            Ok(()) => match tokio::time::timeout_at(deadline, answer).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(StoreError::Unavailable("the Redis store is shutting down".into())),
                Err(_) => Err(StoreError::Timeout(
                    format!("no answer from Redis Cluster node {} in time", self.addr).into(),
                )),
            },
            Err(e) => Err(e),
        };
        self.record(permit, &result);
        result
    }

    fn record<T>(&self, permit: Permit, result: &Result<T, StoreError>) {
        let outcome = match result {
            Ok(_) => Outcome::Success,
            Err(e) => match (e, redirect_of(e)) {
                // The node answered: a refusal of one request's data, or a redirect.
                (StoreError::Rejected(_), _) => Outcome::Success,
                (_, Some(Redirect::Moved(_) | Redirect::Ask(_) | Redirect::TryAgain)) => Outcome::Success,
                (StoreError::InFailedBatch(_), _) => Outcome::FailedInBatch,
                _ => Outcome::Failure,
            },
        };
        match self.breaker.record(self.mono_us(), permit, outcome) {
            Transition::Opened => tracing::error!(
                node = %self.addr,
                "Redis Cluster node failing: its circuit is open; its slots' requests get the failure answer"
            ),
            Transition::Closed => tracing::info!(node = %self.addr, "Redis Cluster node answers again: circuit closed"),
            Transition::None => {}
        }
    }

    /// While its breaker is open and a probe is due, loads the scripts as that probe (a node
    /// that restarted has lost them) and records the outcome: how the breaker of a node that is
    /// back closes without waiting for a request to its slots (readiness would otherwise report
    /// its slots lost until one came).
    pub(crate) async fn probe_if_open(&self, timeout: std::time::Duration) {
        if !self.breaker.is_open() || !self.connected() {
            return;
        }
        if let Some(permit) = self.breaker.allow(self.mono_us()) {
            let loaded = match tokio::time::timeout(timeout, self.conn.load_scripts(Some(timeout))).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(super::super::store_error(&e)),
                Err(_) => Err(StoreError::Timeout("probe timed out".into())),
            };
            self.record(permit, &loaded);
        }
    }

    /// `CLUSTER SLOTS` as this node sees it, within `timeout`.
    pub(crate) async fn cluster_slots(&self, timeout: std::time::Duration) -> Result<Value, FredError> {
        if !self.connected() {
            return Err(FredError::new(ErrorKind::IO, "not connected"));
        }
        cluster_slots_on(self.conn.pool.next(), timeout).await
    }
}

/// `CLUSTER SLOTS` on `client`, within `timeout`.
pub(crate) async fn cluster_slots_on(
    client: &fred::clients::Client,
    timeout: std::time::Duration,
) -> Result<Value, FredError> {
    let options = fred::types::config::Options {
        timeout: Some(timeout),
        ..Default::default()
    };
    let command = fred::types::CustomCommand::new_static("CLUSTER", fred::types::ClusterHash::Random, false);
    client
        .with_options(&options)
        .custom::<Value, _>(command, vec!["SLOTS"])
        .await
}

impl Conn {
    /// `ASKING` then `EVALSHA` on `client`, back to back on its one connection (a Cluster node
    /// answered `ASK`: the slot is being migrated here, and only a call after `ASKING` on the
    /// same connection is served), loading the scripts again on `NOSCRIPT`.
    pub(crate) async fn asking_evalsha_on(
        &self,
        client: &Client,
        sha: &str,
        keys: Vec<Key>,
        argv: Vec<Value>,
    ) -> Result<Value, StoreError> {
        for attempt in 0..2 {
            let pipeline = client.pipeline();
            let asking = fred::types::CustomCommand::new_static("ASKING", fred::types::ClusterHash::Random, false);
            // fred's pipelines have no script commands: `EVALSHA` as a custom command.
            let evalsha = fred::types::CustomCommand::new_static("EVALSHA", fred::types::ClusterHash::FirstKey, false);
            let mut args: Vec<Value> = Vec::with_capacity(2 + keys.len() + argv.len());
            args.push(sha.into());
            args.push(Value::Integer(keys.len() as i64));
            args.extend(keys.iter().cloned().map(Value::from));
            args.extend(argv.iter().cloned());
            let queued: Result<(), FredError> = async {
                pipeline.custom::<(), _>(asking, Vec::<Value>::new()).await?;
                pipeline.custom::<(), _>(evalsha, args).await
            }
            .await;
            queued.map_err(|e| super::super::store_error(&e))?;
            match pipeline.try_all::<Value>().await.into_iter().nth(1) {
                Some(Err(e)) if attempt == 0 && e.details().starts_with("NOSCRIPT") => {
                    self.load_scripts(None)
                        .await
                        .map_err(|e| super::super::store_error(&e))?;
                }
                Some(answer) => return answer.map_err(|e| super::super::store_error(&e)),
                None => break,
            }
        }
        Err(StoreError::Unavailable(
            "ASKING and EVALSHA: no answer to the call".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Cause;

    #[test]
    fn redirects_are_read_from_the_errors_redis_sends() {
        let addr = |host: &str, port| Addr {
            host: host.into(),
            port,
        };
        assert_eq!(
            parse_redirect("MOVED 3999 127.0.0.1:6381"),
            Some(Redirect::Moved(addr("127.0.0.1", 6381)))
        );
        assert_eq!(
            parse_redirect("ASK 3999 [::1]:7000"),
            Some(Redirect::Ask(addr("::1", 7000)))
        );
        assert_eq!(
            parse_redirect("TRYAGAIN Multiple keys request during rehashing of slot"),
            Some(Redirect::TryAgain)
        );
        assert_eq!(parse_redirect("CLUSTERDOWN The cluster is down"), Some(Redirect::Down));
        assert_eq!(parse_redirect("NOSCRIPT No matching script"), None);
        assert_eq!(parse_redirect("MOVED 3999"), None);
        let fred = FredError::new(ErrorKind::Cluster, "MOVED 12 10.0.0.2:7001");
        let e = StoreError::InFailedBatch(Box::new(StoreError::Unavailable(Cause::from_error(fred))));
        assert_eq!(redirect_of(&e), Some(Redirect::Moved(addr("10.0.0.2", 7001))));
    }
}
