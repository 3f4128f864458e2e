use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::core::bucket::{Demand, DemandKind, Limit, Rate, MICRO};
use crate::core::clock::{Clock, ManualClock};
use crate::core::schedule::Plan;
use crate::store::MemoryStore;

const T0: u64 = 1_780_000_000_000_000;
const SECOND: u64 = 1_000_000;

fn bucket(key: &str, capacity: u64, per_second: u64, lease: u64) -> BucketRef {
    BucketRef {
        key: key.to_owned(),
        plan: Plan::Fixed(Limit::new(capacity, Rate::per(per_second, SECOND).unwrap())),
        lease_ut: lease * MICRO,
    }
}

fn demand(instance: usize, kind: DemandKind) -> Demand {
    Demand {
        instance,
        kind,
        enforced: true,
    }
}

fn consume(instance: usize, n: u64) -> Demand {
    demand(instance, DemandKind::Consume(n * MICRO))
}

/// A replica's layer in front of a memory store on a manual clock, with the store calls it
/// made counted; lease calls run at once, as the background tasks would.
struct Rig {
    clock: ManualClock,
    store: MemoryStore,
    layer: LocalLayer,
    store_calls: u64,
}

impl Rig {
    fn new(settings: LocalSettings) -> Rig {
        let clock = ManualClock::new(T0);
        Rig {
            store: MemoryStore::new(4, 1_000, Arc::new(clock.clone())),
            clock,
            layer: LocalLayer::new(&settings),
            store_calls: 0,
        }
    }

    fn now(&self) -> u64 {
        self.clock.now_us()
    }

    fn apply(&mut self, buckets: &[BucketRef], demands: &[Demand]) -> Applied {
        let applied = match self.layer.route(buckets, demands, self.now()) {
            Route::Local(a) => a,
            Route::Store(ask) => {
                self.store_calls += 1;
                let answer = {
                    let (b, d) = ask.request(buckets, demands);
                    self.store.apply_now(b, d)
                };
                self.layer
                    .finish(*ask, buckets, demands, Ok(answer))
                    .expect("no store error")
            }
        };
        for order in self.layer.take_orders() {
            self.store_calls += 1;
            let answer = self
                .store
                .apply_now(std::slice::from_ref(&order.bucket), &[lease_demand(&order)]);
            if let Some(ret) = self.layer.granted(&order, Some(&answer)) {
                self.give_back(ret);
            }
        }
        applied
    }

    fn give_back(&mut self, ret: LeaseReturn) {
        self.layer.returned(&ret);
        self.store_calls += 1;
        self.store
            .apply_now(std::slice::from_ref(&ret.bucket), &[return_demand(&ret)]);
        self.layer.returned(&ret);
    }

    fn return_due(&mut self) {
        for ret in self.layer.due_returns(self.now()) {
            self.give_back(ret);
        }
    }
}

/// A flood on an exhausted bucket: after the first denial, requests are denied locally until
/// the bucket can serve one again; the store sees one admission and one denial per token
/// refilled, and the decisions are the store's own.
#[test]
fn a_flood_on_an_exhausted_bucket_costs_a_store_call_per_refill() {
    let mut rig = Rig::new(LocalSettings::default());
    let mut plain = Rig::new(LocalSettings {
        over_limit_cache: false,
        ..LocalSettings::default()
    });
    let b = [bucket("user", 10, 1, 0)];
    let (mut admitted, mut denied) = (0, 0);
    // 10 s of a request every millisecond.
    for _ in 0..10_000 {
        let a = rig.apply(&b, &[consume(0, 1)]);
        let p = plain.apply(&b, &[consume(0, 1)]);
        assert_eq!(
            a.decision,
            p.decision,
            "the same decision as the store's, at {}",
            rig.now()
        );
        assert_eq!(a.now_us, p.now_us);
        if a.decision.denied {
            denied += 1;
        } else {
            admitted += 1;
        }
        rig.clock.advance_us(1_000);
        plain.clock.advance_us(1_000);
    }
    // Capacity 10, then one a second: exactly what the store admits.
    assert_eq!(admitted, 10 + 9, "tokens at 1 s .. 9 s after the start");
    let calls_for_denials = rig.store_calls - admitted;
    assert!(
        calls_for_denials * 100 <= denied,
        "{calls_for_denials} store calls for {denied} denials"
    );
    assert_eq!(plain.store_calls, 10_000);
}

/// Decisions through the layer equal the store's alone, request for request (one replica, so
/// the cache always holds the truth), over random sequences of consumption, checks, refunds,
/// resets and time.
fn same_as_the_store(ops: Vec<(u8, u8, u8, u16)>) -> Result<(), TestCaseError> {
    let mut rig = Rig::new(LocalSettings::default());
    let mut plain = Rig::new(LocalSettings {
        over_limit_cache: false,
        ..LocalSettings::default()
    });
    let all = [bucket("a", 5, 1, 0), bucket("b", 3, 2, 0), bucket("c", 20, 10, 0)];
    for (op, which, n, wait_ms) in ops {
        let pick: Vec<BucketRef> = all
            .iter()
            .enumerate()
            .filter(|(i, _)| which & (1 << i) != 0)
            .map(|(_, b)| b.clone())
            .collect();
        let pick = if pick.is_empty() { vec![all[0].clone()] } else { pick };
        let n = u64::from(n % 4);
        let kind = match op % 8 {
            0 => DemandKind::Check,
            1 => DemandKind::Refund((n + 1) * MICRO),
            _ => DemandKind::Consume((n + 1) * MICRO),
        };
        let demands: Vec<Demand> = (0..pick.len()).map(|i| demand(i, kind)).collect();
        if op % 16 == 15 {
            rig.layer.reset(&pick);
            let _ = futures_now(rig.store.reset(&pick));
            let _ = futures_now(plain.store.reset(&pick));
        } else {
            let a = rig.apply(&pick, &demands);
            let p = plain.apply(&pick, &demands);
            prop_assert_eq!(&a.decision, &p.decision);
            prop_assert_eq!(a.now_us, p.now_us);
        }
        rig.clock.advance_us(u64::from(wait_ms) * 1_000);
        plain.clock.advance_us(u64::from(wait_ms) * 1_000);
    }
    Ok(())
}

/// Runs a future that never waits (the memory store's) to its end.
fn futures_now<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let waker = std::task::Waker::noop();
    match f.as_mut().poll(&mut std::task::Context::from_waker(waker)) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("the memory store does not wait"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn the_cache_decides_as_the_store(ops in proptest::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), 0u16..800), 1..120)) {
        same_as_the_store(ops)?;
    }
}

/// A request asking less than the one denied still goes to the store when the cached state
/// could serve it.
#[test]
fn a_smaller_request_is_not_denied_by_a_larger_ones_denial() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [bucket("user", 5, 1, 0)];
    assert!(!rig.apply(&b, &[consume(0, 3)]).decision.denied);
    assert!(rig.apply(&b, &[consume(0, 3)]).decision.denied, "2 left");
    let calls = rig.store_calls;
    assert!(rig.apply(&b, &[consume(0, 3)]).decision.denied);
    assert_eq!(rig.store_calls, calls, "the same request again: denied locally");
    assert!(!rig.apply(&b, &[consume(0, 2)]).decision.denied, "2 left: admitted");
    assert_eq!(rig.store_calls, calls + 1);
}

/// A refund through this replica, a reset, and a reload each end local denials at once.
#[test]
fn refunds_resets_and_reloads_end_local_denials() {
    let b = [bucket("user", 2, 1, 0)];
    let exhausted = |rig: &mut Rig| {
        rig.apply(&b, &[consume(0, 2)]);
        assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied);
        let calls = rig.store_calls;
        assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied);
        assert_eq!(rig.store_calls, calls, "denied locally");
    };
    let mut rig = Rig::new(LocalSettings::default());
    exhausted(&mut rig);
    rig.apply(&b, &[demand(0, DemandKind::Refund(MICRO))]);
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied, "after a refund");

    let mut rig = Rig::new(LocalSettings::default());
    exhausted(&mut rig);
    rig.layer.reset(&b);
    let _ = futures_now(rig.store.reset(&b));
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied, "after a reset");

    let mut rig = Rig::new(LocalSettings::default());
    exhausted(&mut rig);
    // A refund on the store that this replica did not see (another replica's): denied
    // locally until the bucket would have refilled what the denied request needed.
    rig.store.apply_now(&b, &[demand(0, DemandKind::Refund(2 * MICRO))]);
    assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied);
    rig.layer.rules_changed();
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied, "after a reload");
}

/// A refund made where this replica cannot see it is honoured at the latest when the denied
/// request could have passed by refill (the reopen time), and never later than the hold.
#[test]
fn a_refund_elsewhere_is_honoured_by_the_reopen_time() {
    let mut rig = Rig::new(LocalSettings::default());
    // One token every 10 s.
    let b = [BucketRef {
        plan: Plan::Fixed(Limit::new(1, Rate::per(1, 10 * SECOND).unwrap())),
        ..bucket("user", 1, 1, 0)
    }];
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied);
    let denial = rig.apply(&b, &[consume(0, 1)]);
    assert!(denial.decision.denied);
    rig.store.apply_now(&b, &[demand(0, DemandKind::Refund(MICRO))]);
    // The default hold (5 s) comes before the reopen time (10 s).
    rig.clock.advance_us(5 * SECOND - 1);
    assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied, "within the hold");
    rig.clock.advance_us(1);
    assert!(
        !rig.apply(&b, &[consume(0, 1)]).decision.denied,
        "the hold ended: asked the store"
    );
}

/// A denial answer that left before a refund and came back after it is not learnt: it would
/// bring back the state the refund raised.
#[test]
fn an_answer_from_before_a_refund_is_not_learnt() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [bucket("user", 1, 1, 0)];
    rig.apply(&b, &[consume(0, 1)]);
    let now = rig.now();
    let Route::Store(ask) = rig.layer.route(&b, &[consume(0, 1)], now) else {
        panic!("nothing held yet");
    };
    let answer = rig.store.apply_now(&b, &[consume(0, 1)]);
    assert!(answer.decision.denied);
    // Meanwhile, a refund through this replica.
    rig.apply(&b, &[demand(0, DemandKind::Refund(MICRO))]);
    rig.layer.finish(*ask, &b, &[consume(0, 1)], Ok(answer)).unwrap();
    assert!(rig.layer.cache().unwrap().is_empty(), "the stale denial was not learnt");
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied);
}

/// A state is not trusted past the next change of its limit by the clock.
#[test]
fn a_schedule_edge_ends_a_local_denial() {
    use crate::core::schedule::{Schedule, ScheduleEntry};
    let base = Limit::new(1, Rate::per(1, 3_600 * SECOND).unwrap());
    // Ten times the capacity and refill during the first minute of every hour.
    let entry = ScheduleEntry::new("0 * * * *", None, Some(10.0), None, None).unwrap();
    let schedule = Schedule::new(base, vec![entry]).unwrap();
    let plan = Plan::Scheduled(Arc::new(schedule));
    // Start 30 s before an hour.
    let mut rig = Rig::new(LocalSettings {
        over_limit_hold_ms: crate::core::units::Millis(600_000),
        ..LocalSettings::default()
    });
    let hour = 3_600 * SECOND;
    rig.clock.set_us((T0 / hour + 1) * hour - 30 * SECOND);
    let b = [BucketRef {
        plan,
        ..bucket("user", 1, 1, 0)
    }];
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied);
    assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied);
    let held = rig.layer.cache().unwrap().len();
    assert_eq!(held, 1);
    rig.clock.advance_us(30 * SECOND);
    let calls = rig.store_calls;
    let a = rig.apply(&b, &[consume(0, 1)]);
    assert_eq!(rig.store_calls, calls + 1, "the window opened: the store is asked");
    // The window raises the capacity, but a bucket that is not full gains nothing at once:
    // the store's own answer, whatever it is, is what the client gets.
    let _ = a;
}

/// At the cap the cache evicts, and counts it.
#[test]
fn the_cache_is_bounded_and_counts_evictions() {
    let mut rig = Rig::new(LocalSettings {
        over_limit_cache_entries: 8,
        ..LocalSettings::default()
    });
    for i in 0..100 {
        let b = [bucket(&format!("user-{i}"), 1, 1, 0)];
        rig.apply(&b, &[consume(0, 1)]);
        assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied);
    }
    let cache = rig.layer.cache().unwrap();
    assert!(cache.len() <= 8 + 1, "{} entries", cache.len());
    assert!(cache.evictions() >= 90, "{} evictions", cache.evictions());
}

/// A shadow-mode demand never denies, so the cache never answers for it.
#[test]
fn shadow_demands_always_reach_the_store() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [bucket("user", 1, 1, 0)];
    let shadow = Demand {
        enforced: false,
        ..consume(0, 1)
    };
    rig.apply(&b, &[consume(0, 1)]);
    assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied);
    let calls = rig.store_calls;
    for _ in 0..5 {
        assert!(!rig.apply(&b, &[shadow]).decision.denied);
    }
    assert_eq!(rig.store_calls, calls + 5);
}

/// A hot bucket with a lease: most admissions spend leased tokens without a store call; and
/// through exhaustion the bucket never admits more than its capacity plus its refill, nor
/// less by more than a lease.
#[test]
fn a_lease_serves_a_hot_bucket_locally_and_never_over_admits() {
    // Plenty: 100,000 tokens, 10,000 a second, leased 50 at a time; 10,000 requests a second.
    let mut rig = Rig::new(LocalSettings::default());
    let b = [bucket("global", 100_000, 10_000, 50)];
    for _ in 0..20_000u64 {
        assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied);
        rig.clock.advance_us(100);
        rig.return_due();
    }
    assert!(
        rig.store_calls * 20 < 20_000,
        "{} store calls for 20,000 admissions",
        rig.store_calls
    );
    // Scarce: 1,000 tokens, 100 a second, 10,000 requests a second for 2 s.
    let mut rig = Rig::new(LocalSettings::default());
    let b = [bucket("global", 1_000, 100, 50)];
    let mut admitted = 0u64;
    for _ in 0..20_000u64 {
        if !rig.apply(&b, &[consume(0, 1)]).decision.denied {
            admitted += 1;
        }
        rig.clock.advance_us(100);
        rig.return_due();
    }
    assert!(admitted <= 1_000 + 200, "{admitted} admitted");
    assert!(
        admitted >= 1_000 + 200 - 50,
        "{admitted} admitted: under-admits at most a lease"
    );
    assert!(
        rig.store_calls < 1_000,
        "{} store calls for 20,000 requests",
        rig.store_calls
    );
}

/// Unspent leased tokens go back to the store when the hold ends.
#[test]
fn unspent_leased_tokens_go_back_at_the_end_of_the_hold() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [bucket("global", 100, 1, 40)];
    // The first request decides on the store and orders a lease of 40.
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied);
    assert_eq!(rig.layer.leased_ut(), 40 * MICRO);
    let peek = |rig: &Rig| rig.store.peek("global").map_or(100 * MICRO, |s| s.tokens_ut);
    assert_eq!(peek(&rig), 59 * MICRO);
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied, "spent from the lease");
    assert_eq!(peek(&rig), 59 * MICRO, "no store call");
    // The lease was half spent? No: 39 left, above half; nothing ordered.
    rig.clock.advance_us(SECOND);
    rig.return_due();
    assert_eq!(rig.layer.leased_ut(), 0);
    // 59 + 1 s of refill (1) + 39 given back.
    assert_eq!(peek(&rig), 99 * MICRO);
}

/// A request on a leased bucket and another that denies: all or nothing, so the leased
/// tokens it reserved go back to the lease.
#[test]
fn a_denial_elsewhere_gives_reserved_leased_tokens_back() {
    let mut rig = Rig::new(LocalSettings::default());
    let global = bucket("global", 100, 1, 20);
    let user = bucket("user", 1, 1, 0);
    assert!(
        !rig.apply(std::slice::from_ref(&global), &[consume(0, 1)])
            .decision
            .denied
    );
    let leased = rig.layer.leased_ut();
    assert_eq!(leased, 20 * MICRO);
    let both = [global, user];
    assert!(!rig.apply(&both, &[consume(0, 1), consume(1, 1)]).decision.denied);
    assert_eq!(rig.layer.leased_ut(), leased - MICRO);
    let denied = rig.apply(&both, &[consume(0, 1), consume(1, 1)]);
    assert!(denied.decision.denied);
    assert_eq!(denied.decision.passed, vec![true, false]);
    assert_eq!(rig.layer.leased_ut(), leased - MICRO, "nothing spent on a denial");
}

/// No lease is taken while the store cannot spare one: requests then go to the store one by
/// one (exact to the token).
#[test]
fn no_lease_is_taken_from_a_bucket_that_cannot_spare_one() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [bucket("global", 30, 1, 20)];
    assert!(!rig.apply(&b, &[consume(0, 15)]).decision.denied);
    assert_eq!(rig.layer.leased_ut(), 0, "15 left, fewer than a lease");
    for i in 0..15 {
        assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied, "token {i}");
    }
    assert!(rig.apply(&b, &[consume(0, 1)]).decision.denied);
}

/// A top-up granted while requests hold tokens reserved from the lease, and those requests
/// then denied by the store's part: the reserved tokens go back to the lease, which must
/// still hold no more than `lease` tokens (the bound on what leases cost, lease x replicas).
#[test]
fn a_lease_never_holds_more_than_its_size() {
    let mut rig = Rig::new(LocalSettings::default());
    let tenant = bucket("tenant", 100, 1, 4);
    assert!(
        !rig.apply(std::slice::from_ref(&tenant), &[consume(0, 1)])
            .decision
            .denied
    );
    assert_eq!(rig.layer.leased_ut(), 4 * MICRO);
    // Three clients whose own buckets are empty.
    let clients: Vec<BucketRef> = (0..3).map(|i| bucket(&format!("client-{i}"), 1, 1, 0)).collect();
    for c in &clients {
        assert!(!rig.apply(std::slice::from_ref(c), &[consume(0, 1)]).decision.denied);
    }
    let demands = [consume(0, 1), consume(1, 1)];
    // Each request reserves a leased token of the tenant and asks the store about its client;
    // the lease falls to half on the way.
    let asks: Vec<Box<Ask>> = clients
        .iter()
        .map(
            |c| match rig.layer.route(&[tenant.clone(), c.clone()], &demands, rig.now()) {
                Route::Store(ask) => ask,
                Route::Local(_) => panic!("the client's bucket is decided by the store"),
            },
        )
        .collect();
    // Whatever top-up was ordered meanwhile is granted before the answers come back.
    for order in rig.layer.take_orders() {
        let answer = rig
            .store
            .apply_now(std::slice::from_ref(&order.bucket), &[lease_demand(&order)]);
        assert!(rig.layer.granted(&order, Some(&answer)).is_none());
    }
    for (ask, c) in asks.into_iter().zip(&clients) {
        let both = [tenant.clone(), c.clone()];
        let answer = {
            let (b, d) = ask.request(&both, &demands);
            rig.store.apply_now(b, d)
        };
        assert!(answer.decision.denied, "the client's bucket is empty");
        assert!(
            rig.layer
                .finish(*ask, &both, &demands, Ok(answer))
                .unwrap()
                .decision
                .denied
        );
    }
    assert!(
        rig.layer.leased_ut() <= 4 * MICRO,
        "{} leased µt held, on a lease of 4 tokens",
        rig.layer.leased_ut()
    );
}

/// A refund through this replica, and a request sent after it that the store decides first
/// (the two went on different connections): that request's denial predates the refund, and
/// once the refund is through it must not deny here what the store would admit, whichever of
/// the two answers comes back first.
#[test]
fn an_answer_decided_before_this_replicas_refund_is_not_learnt() {
    for refund_answered_first in [true, false] {
        let mut rig = Rig::new(LocalSettings::default());
        // One token, back in a second.
        let b = [bucket("user", 1, 1, 0)];
        let one = [consume(0, 1)];
        let refund = [demand(0, DemandKind::Refund(MICRO))];
        assert!(!rig.apply(&b, &one).decision.denied);
        let now = rig.now();
        let Route::Store(give) = rig.layer.route(&b, &refund, now) else {
            panic!("a refund goes to the store");
        };
        let Route::Store(ask) = rig.layer.route(&b, &one, now) else {
            panic!("nothing is cached yet");
        };
        // The store decides the request before the refund reaches it.
        let denied = rig.store.apply_now(&b, &one);
        assert!(denied.decision.denied);
        let refunded = rig.store.apply_now(&b, &refund);
        if refund_answered_first {
            rig.layer.finish(*give, &b, &refund, Ok(refunded)).unwrap();
            rig.layer.finish(*ask, &b, &one, Ok(denied)).unwrap();
        } else {
            rig.layer.finish(*ask, &b, &one, Ok(denied)).unwrap();
            rig.layer.finish(*give, &b, &refund, Ok(refunded)).unwrap();
        }
        assert!(
            !rig.apply(&b, &one).decision.denied,
            "the store holds the refunded token (refund answered first: {refund_answered_first})"
        );
    }
}

/// The same for a lease return: a request sent after the return left but decided before it
/// arrived answers with the bucket short of the returned tokens; `returned` again once the
/// return's answer is back (as `Local` calls it) forgets that answer.
#[test]
fn an_answer_decided_before_this_replicas_lease_return_is_forgotten() {
    let mut rig = Rig::new(LocalSettings::default());
    // 20 tokens, one back every 100 s, leased 10 at a time.
    let b = [BucketRef {
        plan: Plan::Fixed(Limit::new(20, Rate::per(1, 100 * SECOND).unwrap())),
        ..bucket("global", 20, 1, 10)
    }];
    assert!(!rig.apply(&b, &[consume(0, 1)]).decision.denied);
    assert_eq!(rig.layer.leased_ut(), 10 * MICRO);
    // Another replica takes what the store has left.
    assert!(!rig.store.apply_now(&b, &[consume(0, 9)]).decision.denied);
    // The hold ends: the 10 leased tokens go back.
    rig.clock.advance_us(SECOND);
    let ret = rig.layer.due_returns(rig.now()).pop().expect("a return");
    rig.layer.returned(&ret);
    // Meanwhile a request of 10, which the store decides before the return arrives.
    let ten = [consume(0, 10)];
    let Route::Store(ask) = rig.layer.route(&b, &ten, rig.now()) else {
        panic!("the lease's hold ended: the store decides");
    };
    let denied = rig.store.apply_now(&b, &ten);
    assert!(denied.decision.denied);
    rig.layer.finish(*ask, &b, &ten, Ok(denied)).unwrap();
    rig.store
        .apply_now(std::slice::from_ref(&ret.bucket), &[return_demand(&ret)]);
    rig.layer.returned(&ret);
    assert!(
        !rig.apply(&b, &ten).decision.denied,
        "the returned tokens are in the store"
    );
}

/// 20 tokens, one back every 100 s, leased 10 at a time: slow enough that refill never hides
/// a miscount in these tests.
fn slow_leased(key: &str) -> BucketRef {
    BucketRef {
        plan: Plan::Fixed(Limit::new(20, Rate::per(1, 100 * SECOND).unwrap())),
        ..bucket(key, 20, 1, 10)
    }
}

/// Admits single tokens through the layer until one is denied; how many were admitted.
fn admit_until_denied(rig: &mut Rig, b: &[BucketRef]) -> u64 {
    let mut admitted = 0;
    while !rig.apply(b, &[consume(0, 1)]).decision.denied {
        admitted += 1;
        assert!(admitted <= 1_000, "no denial in sight");
    }
    admitted
}

/// Admits one token of `b` through the store and takes the lease order that follows (19 tokens
/// left, a lease of 10 to spare), without sending it: the test decides when it reaches the store.
fn first_lease_order(rig: &mut Rig, b: &[BucketRef]) -> LeaseOrder {
    let Route::Store(ask) = rig.layer.route(b, &[consume(0, 1)], rig.now()) else {
        panic!("no lease yet");
    };
    let first = rig.store.apply_now(b, &[consume(0, 1)]);
    rig.layer.finish(*ask, b, &[consume(0, 1)], Ok(first)).unwrap();
    rig.layer.take_orders().pop().expect("19 left: a lease is ordered")
}

/// A lease order the store denies (the bucket cannot spare a lease), whose answer comes back
/// after a refund through this replica reached the store: the denial predates the refund and
/// must not be learnt, or the cache denies what the store admits.
#[test]
fn a_denied_lease_order_is_not_learnt_past_a_refund() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [slow_leased("global")];
    let order = first_lease_order(&mut rig, &b);
    // Another replica takes 15: 4 left, fewer than the lease.
    assert!(!rig.store.apply_now(&b, &[consume(0, 15)]).decision.denied);
    let denied = rig
        .store
        .apply_now(std::slice::from_ref(&order.bucket), &[lease_demand(&order)]);
    assert!(denied.decision.denied);
    // A refund of 10 through this replica, answered before the lease's denial comes back.
    let refund = [demand(0, DemandKind::Refund(10 * MICRO))];
    let Route::Store(give) = rig.layer.route(&b, &refund, rig.now()) else {
        panic!("a refund goes to the store");
    };
    let refunded = rig.store.apply_now(&b, &refund);
    rig.layer.finish(*give, &b, &refund, Ok(refunded)).unwrap();
    assert!(rig.layer.granted(&order, Some(&denied)).is_none());
    assert!(
        !rig.apply(&b, &[consume(0, 10)]).decision.denied,
        "the store holds 14 tokens"
    );
}

/// A lease granted by the store before an admin reset of the bucket, whose answer arrives
/// after it: the reset wiped the debit, so spending those tokens would admit beyond what the
/// reset bucket holds. They are dropped (an under-admission, never an over-admission).
#[test]
fn a_grant_across_a_reset_is_not_spent() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [slow_leased("global")];
    let order = first_lease_order(&mut rig, &b);
    let granted = rig
        .store
        .apply_now(std::slice::from_ref(&order.bucket), &[lease_demand(&order)]);
    assert!(!granted.decision.denied);
    rig.layer.reset(&b);
    rig.store.reset_now(&b);
    assert!(rig.layer.granted(&order, Some(&granted)).is_none());
    assert_eq!(rig.layer.leased_ut(), 0, "the grant predates the reset");
    assert_eq!(admit_until_denied(&mut rig, &b), 20, "the reset bucket's 20 tokens");
}

/// A request holding leased tokens reserved while the store decides its other bucket, across
/// a reset of the leased bucket, then denied: its reservation predates the reset and must not
/// come back as spendable (or given back as a refund) on top of the reset bucket.
#[test]
fn a_reservation_across_a_reset_is_dropped() {
    let mut rig = Rig::new(LocalSettings::default());
    let global = slow_leased("global");
    let user = bucket("user", 1, 1, 0);
    assert!(
        !rig.apply(std::slice::from_ref(&global), &[consume(0, 1)])
            .decision
            .denied
    );
    assert!(!rig.apply(std::slice::from_ref(&user), &[consume(0, 1)]).decision.denied);
    assert_eq!(rig.layer.leased_ut(), 10 * MICRO);
    let both = [global.clone(), user];
    let demands = [consume(0, 1), consume(1, 1)];
    let Route::Store(ask) = rig.layer.route(&both, &demands, rig.now()) else {
        panic!("the user's bucket is decided by the store");
    };
    rig.layer.reset(std::slice::from_ref(&global));
    rig.store.reset_now(std::slice::from_ref(&global));
    // Another replica spends 5 of the reset bucket.
    assert!(
        !rig.store
            .apply_now(std::slice::from_ref(&global), &[consume(0, 5)])
            .decision
            .denied
    );
    let answer = {
        let (b, d) = ask.request(&both, &demands);
        rig.store.apply_now(b, d)
    };
    assert!(answer.decision.denied, "the user's bucket is empty");
    assert!(
        rig.layer
            .finish(*ask, &both, &demands, Ok(answer))
            .unwrap()
            .decision
            .denied
    );
    rig.clock.advance_us(2 * SECOND);
    rig.return_due();
    assert_eq!(
        admit_until_denied(&mut rig, std::slice::from_ref(&global)),
        15,
        "20 after the reset, less the other replica's 5"
    );
}

/// A lease order in flight when the rules are reloaded: the lease ended with the old rules,
/// so its grant goes straight back to the store instead of filling a lease the new rules may
/// size smaller.
#[test]
fn a_grant_across_a_reload_goes_back() {
    let mut rig = Rig::new(LocalSettings::default());
    let b = [slow_leased("global")];
    let order = first_lease_order(&mut rig, &b);
    rig.layer.rules_changed();
    assert!(rig.layer.return_all().is_empty(), "nothing granted yet");
    let granted = rig
        .store
        .apply_now(std::slice::from_ref(&order.bucket), &[lease_demand(&order)]);
    let back = rig.layer.granted(&order, Some(&granted)).expect("the grant goes back");
    assert_eq!(back.tokens_ut, 10 * MICRO);
    assert_eq!(rig.layer.leased_ut(), 0);
    rig.give_back(back);
    // The new rules lease 2 at a time: no lease holds more.
    let smaller = [BucketRef {
        lease_ut: 2 * MICRO,
        ..slow_leased("global")
    }];
    assert!(!rig.apply(&smaller, &[consume(0, 1)]).decision.denied);
    assert!(
        rig.layer.leased_ut() <= 2 * MICRO,
        "{} µt leased",
        rig.layer.leased_ut()
    );
    assert_eq!(admit_until_denied(&mut rig, &smaller), 18, "20 less the two admitted");
}
