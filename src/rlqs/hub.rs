//! The replica's RLQS state: its streams, what each Envoy reported, the global buckets they
//! share, and the loop that pays for and sends their assignments.
//!
//! A report binds each bucket id to what the rules say of it ([`super::bucket_id`], then
//! [`Limiter::resolve`]): a global bucket (a group, keyed by the bucket instances, so every
//! bucket id that reaches the same instances, and every RLS request that does, shares one
//! limit), a blanket rule (`unlimited`, shadow mode, the `unmatched` setting), or nothing. A
//! new share is assigned at once; then every share every `assignment_period_ms`, one store
//! call per group ([`super::plan`]: paid for before it is sent). A group is planned, paid for
//! and sent under its own lock, so what the plan assumed an Envoy holds is what it was sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{RateLimitQuotaResponse, RateLimitQuotaUsageReports};
use tokio::sync::mpsc;
use tonic::Status;

mod messages;
mod round;
mod view;

use self::messages::{assignment, bucket_id, bucket_key, elapsed_us};
pub use self::view::{RlqsBucketView, RlqsView, ShareView};
use super::bucket_id::entries_in_tree_order;
use super::group::{split_rate_ut_per_s, Group, METER_CAPACITY};
use super::metrics::{Ignored, RlqsMetrics};
use super::plan::{Held, Terms};
use super::settings::{RlqsSettings, Unmatched};
use crate::core::bucket::{Limit, Rate};
use crate::core::clock::{Clock, SystemClock};
use crate::core::schedule::Plan;
use crate::decision::limiter::{Limiter, ResolveError, Resolved};
use crate::store::{BucketRef, Store};

/// A message to one stream: assignments, or the status that ends it.
pub type Outgoing = Result<RateLimitQuotaResponse, Status>;

/// A bucket id as sorted `(key, value)` pairs: how streams and groups name it.
pub type BucketKey = Arc<[(String, String)]>;

/// One Envoy's bucket: its stream and its bucket id.
type ShareKey = (u64, BucketKey);

/// Most usage reports one message may carry past the stream's bucket bound before the rest
/// are only counted (a message is at most `grpc.max_message_bytes` anyway).
const LONGEST_REPORT: Duration = Duration::from_secs(86_400);

/// Largest request count one report may give a bucket (about 10^12: a million requests a
/// second for 11 days); more is ignored as absurd.
const MOST_REQUESTS: u64 = 1 << 40;

/// What the rules make of one bucket id.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Binding {
    /// A global bucket, by its group key.
    Group(Arc<str>),
    /// `ALLOW_ALL` (`true`) or `DENY_ALL`.
    Blanket(bool),
    /// Nothing is sent (`unmatched: no_assignment`).
    Silent,
}

struct StreamState {
    tx: mpsc::Sender<Outgoing>,
    /// The domain of its latest report (one Envoy filter, one domain, one stream).
    domain: String,
    buckets: HashMap<BucketKey, Binding>,
}

/// A bucket that a reload moved: its stream, its id, its old group and its new one.
type Move = (u64, BucketKey, Option<Arc<str>>, Option<Arc<str>>);

/// A global bucket and its Envoys on this replica.
struct GroupState {
    domain: String,
    resolved: Resolved,
    group: Group<ShareKey>,
    /// The demand meter ([`super::group::METER_UT_PER_REFILL_SECOND`]).
    meter: BucketRef,
    /// The descriptor it was resolved from, to resolve it again after a reload.
    entries: Vec<Entry>,
}

type GroupCell = Arc<tokio::sync::Mutex<GroupState>>;

struct Inner {
    streams: HashMap<u64, StreamState>,
    groups: HashMap<Arc<str>, GroupCell>,
    /// The rules the bindings were made under (a weak reference: compared, never kept alive,
    /// so the old rules retire when their last request is done).
    rules: std::sync::Weak<crate::rules::RuleSet>,
    closed: bool,
}

/// The RLQS state of one replica, shared by its streams and its assignment loop.
pub struct Hub<S> {
    limiter: Arc<Limiter<S>>,
    settings: RlqsSettings,
    terms: Terms,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
    next_stream: AtomicU64,
    metrics: RlqsMetrics,
}

impl<S: Store> Hub<S> {
    /// A hub deciding on `limiter`'s rules and store, with `settings`.
    pub fn new(limiter: Arc<Limiter<S>>, settings: RlqsSettings) -> Arc<Hub<S>> {
        Self::with_clock(limiter, settings, Arc::new(SystemClock))
    }

    /// [`Hub::new`] on `clock` (tests move time by hand).
    pub fn with_clock(limiter: Arc<Limiter<S>>, settings: RlqsSettings, clock: Arc<dyn Clock>) -> Arc<Hub<S>> {
        let rules = Arc::downgrade(&limiter.rules());
        Arc::new(Hub {
            limiter,
            terms: settings.terms(),
            settings,
            clock,
            inner: Mutex::new(Inner {
                streams: HashMap::new(),
                groups: HashMap::new(),
                rules,
                closed: false,
            }),
            next_stream: AtomicU64::new(1),
            metrics: RlqsMetrics::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The limiter whose rules and store it uses.
    pub fn limiter(&self) -> &Arc<Limiter<S>> {
        &self.limiter
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &RlqsSettings {
        &self.settings
    }

    /// Registers a new stream whose messages go to `tx`. Errors: `RESOURCE_EXHAUSTED` at
    /// `max_streams`, `UNAVAILABLE` once shutting down.
    pub fn open(&self, tx: mpsc::Sender<Outgoing>) -> Result<u64, Status> {
        let mut inner = self.lock();
        if inner.closed {
            return Err(Status::unavailable("shutting down: reconnect to another replica"));
        }
        if inner.streams.len() >= self.settings.max_streams {
            self.metrics.refused_stream();
            return Err(Status::resource_exhausted(format!(
                "this replica serves rlqs.max_streams ({}) RLQS streams already",
                self.settings.max_streams
            )));
        }
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        inner.streams.insert(
            id,
            StreamState {
                tx,
                domain: String::new(),
                buckets: HashMap::new(),
            },
        );
        self.metrics.streams(inner.streams.len());
        Ok(id)
    }

    /// Forgets stream `id` and its shares. What they were paid for stays taken: the Envoy may
    /// spend it until its assignments expire.
    pub async fn close(&self, id: u64) {
        let (bindings, cells) = {
            let mut inner = self.lock();
            let Some(stream) = inner.streams.remove(&id) else {
                return;
            };
            self.metrics.streams(inner.streams.len());
            let cells: Vec<(BucketKey, GroupCell)> = stream
                .buckets
                .iter()
                .filter_map(|(k, b)| match b {
                    Binding::Group(g) => inner.groups.get(g).map(|c| (k.clone(), c.clone())),
                    _ => None,
                })
                .collect();
            (stream.buckets.len(), cells)
        };
        self.metrics.buckets_delta(-(bindings as i64));
        for (key, cell) in cells {
            cell.lock().await.group.remove(&(id, key));
        }
        self.drop_empty_groups();
    }

    /// Ends stream `id` with `status` (its forgetting follows with [`Hub::close`]).
    pub fn end(&self, id: u64, status: Status) {
        if let Some(stream) = self.lock().streams.get(&id) {
            let _ = stream.tx.try_send(Err(status));
        }
    }

    /// Ends every stream with `UNAVAILABLE` (their Envoys reconnect, to another replica behind
    /// a load balancer) and refuses new ones: the start of a graceful shutdown.
    pub fn shut_down(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        for (_, stream) in inner.streams.drain() {
            let _ = stream
                .tx
                .try_send(Err(Status::unavailable("shutting down: reconnect to another replica")));
        }
        self.metrics.streams(0);
    }

    /// Takes one usage-reports message of stream `id`: binds new bucket ids, records usage,
    /// and assigns new shares at once. Bad parts are ignored and counted, never an error.
    pub async fn report(&self, id: u64, reports: RateLimitQuotaUsageReports) {
        let now = self.clock.now_us();
        if reports.domain.is_empty() {
            self.metrics
                .ignored(Ignored::EmptyDomain, reports.bucket_quota_usages.len());
            return;
        }
        let mut fresh: Vec<(GroupCell, Vec<ShareKey>)> = Vec::new();
        let mut blankets: Vec<BucketAction> = Vec::new();
        for usage in reports.bucket_quota_usages {
            self.metrics.report();
            let Some(key) = bucket_key(usage.bucket_id.as_ref()) else {
                self.metrics.ignored(Ignored::EmptyBucketId, 1);
                continue;
            };
            let Some(elapsed_us) = elapsed_us(usage.time_elapsed.as_ref()) else {
                self.metrics.ignored(Ignored::BadDuration, 1);
                continue;
            };
            if usage.num_requests_allowed > MOST_REQUESTS || usage.num_requests_denied > MOST_REQUESTS {
                self.metrics.ignored(Ignored::AbsurdCount, 1);
                continue;
            }
            self.metrics
                .requests(usage.num_requests_allowed, usage.num_requests_denied);
            let Some((binding, new)) = self.bind(id, &reports.domain, &key) else {
                continue;
            };
            match binding {
                Binding::Group(g) => {
                    let Some(cell) = self.lock().groups.get(&g).cloned() else {
                        continue;
                    };
                    tracing::debug!(
                        stream = id,
                        allowed = usage.num_requests_allowed,
                        denied = usage.num_requests_denied,
                        elapsed_us,
                        "RLQS report"
                    );
                    let is_new = cell.lock().await.group.report(
                        &(id, key.clone()),
                        usage.num_requests_allowed,
                        usage.num_requests_denied,
                        elapsed_us,
                        now,
                    );
                    if is_new {
                        let share = (id, key.clone());
                        match fresh.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &cell)) {
                            Some((_, keys)) => keys.push(share),
                            None => fresh.push((cell, vec![share])),
                        }
                    }
                }
                Binding::Blanket(allow) if new => blankets.push(self.blanket(&key, allow)),
                _ => {}
            }
        }
        if !blankets.is_empty() {
            self.send(id, blankets);
        }
        // Only the new shares: a fleet of Envoys starting together costs one message each,
        // not one per Envoy to every Envoy.
        for (cell, keys) in fresh {
            self.run_group(&cell, Some(&keys)).await;
        }
    }

    /// The binding of bucket `key` on stream `id`, made now if new (`true`); `None` when the
    /// stream is gone or already holds `max_buckets_per_stream` buckets.
    fn bind(&self, id: u64, domain: &str, key: &BucketKey) -> Option<(Binding, bool)> {
        let mut inner = self.lock();
        let stream = inner.streams.get(&id)?;
        if let Some(b) = stream.buckets.get(key) {
            return Some((b.clone(), false));
        }
        if stream.buckets.len() >= self.settings.max_buckets_per_stream {
            self.metrics.ignored(Ignored::TooManyBuckets, 1);
            return None;
        }
        let binding = self.binding_of(&mut inner, domain, key);
        let stream = inner.streams.get_mut(&id)?;
        if stream.domain != domain {
            stream.domain = domain.to_owned();
        }
        stream.buckets.insert(key.clone(), binding.clone());
        self.metrics.buckets_delta(1);
        Some((binding, true))
    }

    /// What the rules in force make of `key` in `domain`, creating its group if needed.
    fn binding_of(&self, inner: &mut Inner, domain: &str, key: &BucketKey) -> Binding {
        let rules = self.limiter.rules();
        let entries: Vec<Entry> = match rules.domain(domain) {
            Some(d) => entries_in_tree_order(d, key),
            None => Vec::new(),
        };
        let resolved = match self.limiter.resolve(domain, &entries) {
            Ok(r) => r,
            Err(ResolveError::Unlimited(_)) => return Binding::Blanket(true),
            Err(why) => {
                self.metrics.unmatched(&why);
                return self.unmatched_binding();
            }
        };
        if resolved.shadow {
            return Binding::Blanket(true);
        }
        // A debt bucket (docs/usage-budgets.md) passes down to a floor below zero and is
        // charged after use; a share paid ahead from it could spend the floor. Not served.
        if resolved.policies.iter().any(|p| p.debt) {
            self.metrics.unmatched_reason("debt_bucket");
            return self.unmatched_binding();
        }
        let group_key = group_key(domain, &resolved);
        let cell = inner.groups.entry(group_key.clone()).or_insert_with(|| {
            Arc::new(tokio::sync::Mutex::new(GroupState {
                domain: domain.to_owned(),
                meter: BucketRef {
                    key: format!("rlqs-demand\n{group_key}"),
                    plan: Plan::Fixed(Limit::new(METER_CAPACITY, Rate::ZERO)),
                    lease_ut: 0,
                },
                resolved: resolved.clone(),
                group: Group::default(),
                entries: entries.clone(),
            }))
        });
        // A reload may have changed the plan of the same instances: the latest resolution wins.
        if let Ok(mut g) = cell.try_lock() {
            g.resolved = resolved;
        }
        Binding::Group(group_key)
    }

    /// What the `unmatched` setting binds a bucket id to.
    fn unmatched_binding(&self) -> Binding {
        match self.settings.unmatched {
            Unmatched::NoAssignment => Binding::Silent,
            Unmatched::AllowAll => Binding::Blanket(true),
            Unmatched::DenyAll => Binding::Blanket(false),
        }
    }

    /// A blanket rule for bucket `key`.
    fn blanket(&self, key: &BucketKey, allow: bool) -> BucketAction {
        let rule = if allow {
            BlanketRule::AllowAll
        } else {
            BlanketRule::DenyAll
        };
        self.metrics.assigned(if allow { "allow_all" } else { "deny_all" });
        assignment(key, Strategy::BlanketRule(rule as i32), self.terms.ttl_us)
    }

    /// Queues `actions` on stream `id`; a stream whose queue is full is ended
    /// (`RESOURCE_EXHAUSTED`: its Envoy does not read), as its assignments could not arrive in
    /// time.
    fn send(&self, id: u64, actions: Vec<BucketAction>) -> bool {
        let tx = match self.lock().streams.get(&id) {
            Some(s) => s.tx.clone(),
            None => return false,
        };
        match tx.try_send(Ok(RateLimitQuotaResponse { bucket_action: actions })) {
            Ok(()) => true,
            Err(_) => {
                self.metrics.ignored(Ignored::SlowStream, 1);
                let _ = tx.try_send(Err(Status::resource_exhausted(
                    "RLQS stream not read: assignments backed up",
                )));
                self.lock().streams.remove(&id);
                false
            }
        }
    }

    /// One round of the assignment loop: rebinds after a reload, abandons idle and unbound
    /// buckets, renews every blanket rule and runs every group.
    pub async fn tick(&self) {
        let now = self.clock.now_us();
        self.rebind_after_reload().await;
        self.abandon_idle(now).await;
        let (blankets, cells): (Vec<(u64, Vec<BucketAction>)>, Vec<GroupCell>) = {
            let inner = self.lock();
            let blankets = inner
                .streams
                .iter()
                .map(|(id, s)| {
                    let actions = s
                        .buckets
                        .iter()
                        .filter_map(|(k, b)| match b {
                            Binding::Blanket(allow) => Some(self.blanket(k, *allow)),
                            _ => None,
                        })
                        .collect();
                    (*id, actions)
                })
                .collect();
            (blankets, inner.groups.values().cloned().collect())
        };
        for (id, actions) in blankets {
            if !actions.is_empty() {
                self.send(id, actions);
            }
        }
        use futures_util::StreamExt;
        futures_util::stream::iter(cells.iter())
            .for_each_concurrent(64, |cell| async move { self.run_group(cell, None).await })
            .await;
        let mut outstanding = 0u64;
        for cell in &cells {
            outstanding = outstanding.saturating_add(cell.lock().await.group.outstanding_ut(now));
        }
        self.metrics.outstanding(outstanding);
        self.drop_empty_groups();
    }

    /// After a reload (or an xDS update): every binding made again under the new rules. A
    /// bucket whose rule is gone is abandoned; one that moved leaves its old group (what it was
    /// paid for there stays taken) and joins its new one as a new share; one that became
    /// `unlimited` or shadow gets `ALLOW_ALL` at this tick.
    async fn rebind_after_reload(&self) {
        let rules = self.limiter.rules();
        let mut moves: Vec<Move> = Vec::new();
        let mut abandoned: Vec<ShareKey> = Vec::new();
        {
            let mut inner = self.lock();
            if std::ptr::eq(inner.rules.as_ptr(), Arc::as_ptr(&rules)) {
                return;
            }
            inner.rules = Arc::downgrade(&rules);
            let ids: Vec<u64> = inner.streams.keys().copied().collect();
            for id in ids {
                let stream = &inner.streams[&id];
                let domain = stream.domain.clone();
                let bound: Vec<(BucketKey, Binding)> =
                    stream.buckets.iter().map(|(k, b)| (k.clone(), b.clone())).collect();
                for (key, old) in bound {
                    let new = self.binding_of(&mut inner, &domain, &key);
                    if new == old {
                        continue;
                    }
                    let group = |b: &Binding| match b {
                        Binding::Group(g) => Some(g.clone()),
                        _ => None,
                    };
                    moves.push((id, key.clone(), group(&old), group(&new)));
                    let Some(s) = inner.streams.get_mut(&id) else { continue };
                    if new == Binding::Silent {
                        s.buckets.remove(&key);
                        self.metrics.buckets_delta(-1);
                        abandoned.push((id, key));
                    } else {
                        s.buckets.insert(key, new);
                    }
                }
            }
        }
        // Every group's limits as the new rules say (the same instances may have a new plan).
        let cells: Vec<GroupCell> = self.lock().groups.values().cloned().collect();
        for cell in cells {
            let mut g = cell.lock().await;
            if let Ok(resolved) = self.limiter.resolve(&g.domain, &g.entries) {
                if group_key(&g.domain, &resolved) == group_key(&g.domain, &g.resolved) {
                    g.resolved = resolved;
                    g.group.blocked_until_us = 0;
                }
            }
        }
        let now = self.clock.now_us();
        for (id, key, old, new) in moves {
            let (old, new) = {
                let inner = self.lock();
                (
                    old.and_then(|g| inner.groups.get(&g).cloned()),
                    new.and_then(|g| inner.groups.get(&g).cloned()),
                )
            };
            if let Some(old) = old {
                old.lock().await.group.remove(&(id, key.clone()));
            }
            if let Some(new) = new {
                new.lock().await.group.report(&(id, key), 0, 0, 0, now);
            }
        }
        self.abandon(abandoned);
    }

    /// Abandons the buckets whose Envoy reported no request for `idle_seconds`: Envoy forgets
    /// them until their next request, and so does this replica.
    async fn abandon_idle(&self, now: u64) {
        let since = now.saturating_sub(self.settings.idle_seconds.0.saturating_mul(1_000_000));
        let cells: Vec<GroupCell> = self.lock().groups.values().cloned().collect();
        let mut idle: Vec<ShareKey> = Vec::new();
        for cell in cells {
            let mut g = cell.lock().await;
            for key in g.group.idle_since(since) {
                g.group.remove(&key);
                idle.push(key);
            }
        }
        {
            let mut inner = self.lock();
            for (id, key) in &idle {
                if let Some(s) = inner.streams.get_mut(id) {
                    if s.buckets.remove(key).is_some() {
                        self.metrics.buckets_delta(-1);
                    }
                }
            }
        }
        self.abandon(idle);
    }

    /// Sends `abandon_action` for each bucket.
    fn abandon(&self, buckets: Vec<ShareKey>) {
        let mut by_stream: HashMap<u64, Vec<BucketAction>> = HashMap::new();
        for (id, key) in buckets {
            self.metrics.assigned("abandon");
            by_stream.entry(id).or_default().push(BucketAction {
                bucket_id: Some(bucket_id(&key)),
                bucket_action: Some(Action::AbandonAction(AbandonAction {})),
            });
        }
        for (id, actions) in by_stream {
            self.send(id, actions);
        }
    }

    fn drop_empty_groups(&self) {
        let mut inner = self.lock();
        let Inner { groups, streams, .. } = &mut *inner;
        groups.retain(|key, cell| {
            let bound = streams
                .values()
                .any(|s| s.buckets.values().any(|b| matches!(b, Binding::Group(g) if g == key)));
            bound || cell.try_lock().map(|g| !g.group.is_empty()).unwrap_or(true)
        });
        self.metrics.groups(groups.len());
    }

    /// Starts the assignment loop, and [`Hub::shut_down`] when `stop` completes; returns the
    /// hub.
    pub fn start(self: Arc<Self>, stop: impl std::future::Future<Output = ()> + Send + 'static) -> Arc<Self> {
        tokio::spawn(self.clone().run());
        let ending = self.clone();
        tokio::spawn(async move {
            stop.await;
            ending.shut_down();
        });
        self
    }

    /// Runs the assignment loop until the hub is shut down.
    pub async fn run(self: Arc<Self>) {
        let mut every = tokio::time::interval(self.settings.assignment_period_ms.duration());
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if self.lock().closed {
                return;
            }
            self.tick().await;
        }
    }
}

/// The limit the shares split: the tightest of the rule's buckets (least refill, least
/// capacity) in force at `now`.
fn limit_at(resolved: &Resolved, now: u64) -> Limit {
    let limits = resolved.buckets.iter().map(|b| b.plan.limit_at(now));
    limits
        .reduce(|a, b| Limit {
            capacity_ut: a.capacity_ut.min(b.capacity_ut),
            rate: if split_rate_ut_per_s(&a) <= split_rate_ut_per_s(&b) {
                a.rate
            } else {
                b.rate
            },
        })
        .unwrap_or(Limit {
            capacity_ut: 0,
            rate: crate::core::bucket::Rate::ZERO,
        })
}

/// A group's key: the domain and the rule's bucket instance keys.
fn group_key(domain: &str, resolved: &Resolved) -> Arc<str> {
    let mut key = String::from(domain);
    for b in &resolved.buckets {
        key.push('\n');
        key.push_str(&b.key);
    }
    key.into()
}
