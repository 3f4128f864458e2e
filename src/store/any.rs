//! The store `tollgate serve` runs on, chosen by the `backend` setting at start.

use super::redis::ClusterHealth;
use super::resilient::failing;
use super::{
    Applied, BucketRef, Local, MemoryStore, Metered, Peeked, PostgresStore, RedisStore, Resilient, SharedBackend,
    Store, StoreError,
};
use crate::core::bucket::Demand;

/// The number of Redis Cluster slots.
const SLOTS: usize = 16384;

/// How long the readiness probe of an open circuit may take: it is off the request path.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// One of the backends, each with its calls metered.
pub enum AnyStore {
    /// `backend: memory`.
    Memory(Metered<MemoryStore>),
    /// `backend: redis`, behind a circuit breaker (and a fallback when so configured), with the
    /// replica's local layer in front (the over-limit cache, leases).
    Redis(Local<Resilient<RedisStore>>),
    /// `backend: postgres`, behind a circuit breaker (and a memory fallback when so configured),
    /// with the replica's local layer in front.
    Postgres(Local<Resilient<PostgresStore>>),
}

/// What a readiness check of the backend found ([`AnyStore::ready`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// `Ok(None)`: decisions are taken as configured (but see `notice`); `Ok(Some(detail))`:
    /// ready, but degraded (a fallback decides, or is failing);
    /// `Err(detail)`: nothing can decide. The details may name hosts (redacted URLs): they are
    /// logged, never served.
    pub verdict: Result<Option<String>, String>,
    /// A short sentence naming no host or secret, fit for the public `/readyz`: the Redis
    /// `maxmemory-policy` warning ([`RedisStore::eviction_warning`]), which an operator must
    /// see where readiness is read, not only in the log.
    pub notice: Option<String>,
}

impl Health {
    /// Whether decisions can be taken (degraded or not).
    pub fn is_ready(&self) -> bool {
        self.verdict.is_ok()
    }
}

impl AnyStore {
    /// Whether decisions can be taken now (`/readyz`, gRPC health): `Ok(None)` when the
    /// backend answers (and its fallback, if any, does too); `Ok(Some(why))` when only one of
    /// them does: still ready (with the backend down, taking every replica out of rotation
    /// would leave Envoy with no one to ask, and the fallback unused), but degraded; `Err(why)`
    /// when nothing can decide. Memory always answers; Redis while its connections are up and
    /// its circuit is closed; Postgres while its schema is in place and it answers a `SELECT 1`
    /// (sent on each call: with no traffic nothing else would notice it is gone; while its
    /// circuit is open, at most once per `breaker_open_ms`). So a replica taken out of rotation
    /// comes back when its backend does, without needing requests. A Redis whose
    /// `maxmemory-policy` may evict buckets, or could not be checked, is ready with that said
    /// ([`RedisStore::eviction_warning`]).
    pub async fn ready(&self) -> Health {
        let (problem, fallback) = match self {
            AnyStore::Memory(_) => {
                return Health {
                    verdict: Ok(None),
                    notice: None,
                }
            }
            AnyStore::Redis(r) => (shared_problem(r.inner()).await, r.inner().fallback()),
            AnyStore::Postgres(p) => (shared_problem(p.inner()).await, p.inner().fallback()),
        };
        let fallback_ready = match fallback {
            Some(f) => Some((f.name(), f.ready(PROBE_TIMEOUT).await)),
            None => None,
        };
        // Redis that may evict buckets still decides (taking every replica out of rotation for
        // a setting would leave Envoy no one to ask), but says so.
        let eviction = match self {
            AnyStore::Redis(r) => r.inner().primary().eviction_warning(),
            _ => None,
        };
        let ready = match (problem, fallback_ready.clone()) {
            (None, None | Some((_, Ok(())))) => Ok(None),
            // The backend decides, but the safety net is gone: say so (and the fallback's
            // circuit gauge clears once it answers again).
            (None, Some((name, Err(why)))) => Ok(Some(format!("the {name} fallback is failing: {why}"))),
            (Some(problem), None) => Err(problem),
            (Some(problem), Some((name, Ok(())))) => Ok(Some(format!("{problem}; deciding on the {name} fallback"))),
            (Some(problem), Some((name, Err(also)))) => Err(format!("{problem}; and the {name} fallback: {also}")),
        };
        // A Redis Cluster that lost some masters still decides the other slots.
        let cluster = match self {
            AnyStore::Redis(r) => r.inner().primary().cluster_health().filter(|h| h.lost_slots() > 0),
            _ => None,
        };
        let (verdict, notice) = match cluster {
            Some(lost) => cluster_verdict(&lost, ready, fallback_ready.as_ref(), eviction),
            None => (ready, eviction),
        };
        Health { verdict, notice }
    }
}

impl AnyStore {
    /// Gives the unspent tokens of every lease back to the shared store, waiting at most
    /// `timeout` for it: for a shutdown. Nothing to do on the memory backend.
    pub async fn return_leases(&self, timeout: std::time::Duration) {
        match self {
            AnyStore::Memory(_) => {}
            AnyStore::Redis(s) => s.return_leases(timeout).await,
            AnyStore::Postgres(s) => s.return_leases(timeout).await,
        }
    }

    /// The local layer in front of a shared backend; `None` on the memory backend.
    pub fn local(&self) -> Option<&super::local::LocalLayer> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(s) => Some(s.layer()),
            AnyStore::Postgres(s) => Some(s.layer()),
        }
    }
}

/// Readiness with `lost` slots of a Redis Cluster, from `ready`, the verdict of the rest: still
/// ready (degraded) while fewer than half of the 16384 slots are lost (most requests are
/// decided; taking every replica out of rotation would fail them all) or while the fallback
/// decides them; not ready otherwise. The public notice names the slots, never a host; the
/// verdict's detail (logged) names the failing masters.
fn cluster_verdict(
    lost: &ClusterHealth,
    ready: Result<Option<String>, String>,
    fallback: Option<&(&'static str, Result<(), String>)>,
    eviction: Option<String>,
) -> (Result<Option<String>, String>, Option<String>) {
    let slots = lost.lost_slots();
    let said = format!("Redis Cluster: {slots} of {SLOTS} slots lost ({})", lost.lost_ranges());
    let notice = Some(match eviction {
        Some(e) => format!("{said}; {e}"),
        None => said.clone(),
    });
    let detail = if lost.failing.is_empty() {
        format!("{said}: no master known for them")
    } else {
        format!("{said}: failing master(s) {}", lost.failing.join(", "))
    };
    let verdict = match (ready, fallback) {
        (Err(why), _) => Err(format!("{why}; {detail}")),
        (Ok(_), Some((name, Ok(())))) => Ok(Some(format!("{detail}; deciding on the {name} fallback"))),
        (Ok(why), _) if slots * 2 < SLOTS => Ok(Some(match why {
            Some(why) => format!("{why}; {detail}; the other slots are decided"),
            None => format!("{detail}; the other slots are decided"),
        })),
        (Ok(_), _) => Err(format!("{detail}; half or more of the slots cannot be decided")),
    };
    (verdict, notice)
}

/// Why a shared backend cannot decide now, with its address (for the log): not connected or
/// prepared yet, or failing its probe (sent on every check, or only while its circuit is open,
/// as [`SharedBackend::PROBE_EVERY_CHECK`] says); `None` when it answers.
async fn shared_problem<B: SharedBackend + Store>(store: &Resilient<B>) -> Option<String> {
    let backend = store.primary();
    if let Some(why) = backend.not_ready_yet() {
        return Some(why);
    }
    let probe = || backend.probe(PROBE_TIMEOUT);
    let answers = if B::PROBE_EVERY_CHECK {
        store.guarded().check(probe).await
    } else {
        store.probe_if_open(probe).await
    };
    (!answers).then(|| failing(B::NAME, backend.describe(), store.guarded()))
}

impl Store for AnyStore {
    async fn apply(&self, buckets: &[BucketRef], demands: &[Demand]) -> Result<Applied, StoreError> {
        match self {
            AnyStore::Memory(s) => s.apply(buckets, demands).await,
            AnyStore::Redis(s) => s.apply(buckets, demands).await,
            AnyStore::Postgres(s) => s.apply(buckets, demands).await,
        }
    }

    async fn peek(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            AnyStore::Memory(s) => s.peek(buckets).await,
            AnyStore::Redis(s) => s.peek(buckets).await,
            AnyStore::Postgres(s) => s.peek(buckets).await,
        }
    }

    async fn reset(&self, buckets: &[BucketRef]) -> Result<Peeked, StoreError> {
        match self {
            AnyStore::Memory(s) => s.reset(buckets).await,
            AnyStore::Redis(s) => s.reset(buckets).await,
            AnyStore::Postgres(s) => s.reset(buckets).await,
        }
    }

    fn rules_changed(&self) {
        match self {
            AnyStore::Memory(s) => s.rules_changed(),
            AnyStore::Redis(s) => s.rules_changed(),
            AnyStore::Postgres(s) => s.rules_changed(),
        }
    }

    fn on_rules_retired(&self) -> Option<super::RetireHook> {
        match self {
            AnyStore::Memory(s) => s.on_rules_retired(),
            AnyStore::Redis(s) => s.on_rules_retired(),
            AnyStore::Postgres(s) => s.on_rules_retired(),
        }
    }

    fn clock_estimate_us(&self) -> u64 {
        match self {
            AnyStore::Memory(s) => s.clock_estimate_us(),
            AnyStore::Redis(s) => s.clock_estimate_us(),
            AnyStore::Postgres(s) => s.clock_estimate_us(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::core::clock::{Clock, SystemClock};
    use crate::server::settings::{PostgresSettings, RedisSettings};

    /// A Redis Cluster that lost some slots: ready and degraded below half of them (or with a
    /// fallback that decides them), not ready at half or more; the public notice names slots,
    /// never a host, which only the logged detail does.
    #[test]
    fn lost_cluster_slots_degrade_readiness_until_half_are_lost() {
        let lost = |end: u16| ClusterHealth {
            lost: vec![(0, end)],
            failing: vec!["10.1.2.3:7000".into()],
            masters: 3,
        };
        let memory_ok = ("memory", Ok(()));
        let memory_failing = ("memory", Err("no".to_string()));
        let (verdict, notice) = cluster_verdict(&lost(5460), Ok(None), None, None);
        let detail = verdict.expect("ready").expect("degraded");
        assert!(detail.contains("10.1.2.3:7000"), "{detail}");
        let notice = notice.expect("a notice");
        assert_eq!(notice, "Redis Cluster: 5461 of 16384 slots lost (0-5460)");
        let (verdict, _) = cluster_verdict(&lost(8191), Ok(None), None, None);
        assert!(verdict.is_err(), "half lost: {verdict:?}");
        let (verdict, _) = cluster_verdict(&lost(8191), Ok(None), Some(&memory_ok), None);
        let detail = verdict.expect("the fallback decides").expect("degraded");
        assert!(detail.contains("deciding on the memory fallback"), "{detail}");
        let (verdict, _) = cluster_verdict(&lost(8191), Ok(None), Some(&memory_failing), None);
        assert!(verdict.is_err());
        let (verdict, _) = cluster_verdict(&lost(100), Ok(None), Some(&memory_failing), None);
        let detail = verdict.expect("ready").expect("degraded");
        assert!(!detail.contains("deciding on the"), "{detail}");
        let (verdict, _) = cluster_verdict(&lost(100), Err("circuit open".into()), None, None);
        assert!(verdict.is_err());
        let (_, notice) = cluster_verdict(&lost(0), Ok(None), None, Some("maxmemory".into()));
        assert_eq!(
            notice.as_deref(),
            Some("Redis Cluster: 1 of 16384 slots lost (0); maxmemory")
        );
    }

    /// A decision's future is moved at least once per request (tonic boxes it), so its size is
    /// CPU on every request: it once reached 24 KiB (a Redis call's future held inline, and
    /// kept twice by a wrapper that took it by value), and memmove was 8% of tollgate's CPU on
    /// Redis. Every backend's stays under 2 KiB.
    #[tokio::test]
    async fn a_decisions_future_stays_small() {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let memory = MemoryStore::new(4, 100, clock.clone());
        let redis = RedisStore::new(&RedisSettings::default(), clock).expect("valid settings");
        let postgres = PostgresStore::new(&PostgresSettings::default()).expect("valid settings");
        let fallback = super::super::Fallback::Postgres(super::super::Guarded::new(
            Metered::new(postgres.clone(), "postgres"),
            "postgres",
            5,
            Duration::from_secs(1),
        ));
        let stores = [
            AnyStore::Memory(Metered::new(memory.clone(), "memory")),
            AnyStore::Redis(Local::new(
                Resilient::new(
                    Metered::new(redis, "redis"),
                    "redis",
                    5,
                    Duration::from_secs(1),
                    Some(fallback),
                ),
                &super::super::LocalSettings::default(),
            )),
            AnyStore::Postgres(Local::new(
                Resilient::new(
                    Metered::new(postgres, "postgres"),
                    "postgres",
                    5,
                    Duration::from_secs(1),
                    Some(super::super::Fallback::Memory(Metered::new(memory, "memory"))),
                ),
                &super::super::LocalSettings::default(),
            )),
        ];
        for store in &stores {
            let size = std::mem::size_of_val(&store.apply(&[], &[]));
            assert!(size < 2048, "a store decision's future is {size} bytes");
        }
        // And the whole decision path's, which tonic boxes.
        let request = envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest::default();
        let options =
            crate::decision::limiter::LimiterOptions::from_settings(&crate::server::settings::Settings::default());
        for store in stores {
            let limiter =
                crate::decision::limiter::Limiter::new(crate::rules::RuleSet::default(), store, options.clone());
            let size = std::mem::size_of_val(&limiter.should_rate_limit(&request));
            assert!(size < 2048, "the limiter's decision future is {size} bytes");
        }
    }
}
