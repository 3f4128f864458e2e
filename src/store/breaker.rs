//! A circuit breaker for a backend. It opens on an outage, not on a latency tail: it counts the
//! requests of the last `window` (a rolling window of [`SLOTS`] slots) and opens when at least
//! `failure_ratio` of them failed *and* at least `min_failures` backend calls failed in it. While
//! open, calls fail at once (or go to the fallback) instead of each waiting for a timeout; after
//! `open_for` it lets one call through as a probe, which closes it on success (with an empty
//! window) or opens it again.
//!
//! Why both conditions: under load a backend that is fine misses its timeout now and then (a
//! busy core, a pause of Redis's event loop), and each miss fails every request in flight at
//! that moment together; counted as consecutive failures, that opened the breaker and refused
//! every request for `open_for`, again and again. A ratio over a window of thousands of
//! requests does not move for those. The minimum of failed calls keeps a handful of requests
//! from deciding on their own: at low traffic, a dead backend still opens it after
//! `min_failures` failed calls, as a consecutive count did.
//!
//! A dead backend that each call waits a timeout for slows closed-loop clients down, so its
//! failures can take long to outweigh the window's earlier successes. Hence a fast path: it also
//! opens when `min_failures` calls failed since the last success and nothing succeeded for a
//! whole slot (`window / SLOTS`). Under load successes keep coming between the misses, so that
//! does not happen on a latency tail.
//!
//! A request of a batch whose one backend call failed ([`Outcome::FailedInBatch`]) counts in the
//! ratio (its request failed) but not as a failed call: the batch's first request counted that.
//! Time is an argument (microseconds, any monotonic source), so the logic is tested without
//! sleeping.

use std::sync::Mutex;

/// The rolling window is this many slots of `window / SLOTS` each; a slot older than the window
/// is cleared when its turn comes again. So the window the ratio sees spans between
/// `window * (SLOTS - 1) / SLOTS` and `window`.
pub(crate) const SLOTS: usize = 10;

/// When the breaker opens, and for how long (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BreakerPolicy {
    /// Failed backend calls in the window below which it never opens (at least 1).
    pub min_failures: u32,
    /// The share of the window's requests that must have failed for it to open, in (0, 1].
    pub failure_ratio: f64,
    /// The rolling window, in microseconds (at least `SLOTS`).
    pub window_us: u64,
    /// How long it stays open before a probe, in microseconds.
    pub open_for_us: u64,
}

/// The breaker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go to the backend; their outcomes are counted in the window.
    Closed,
    /// Calls do not go to the backend until `until_us`.
    Open {
        /// When a probe may go.
        until_us: u64,
    },
    /// One probe is in flight; other calls stay away until it answers.
    Probing {
        /// When the probe started; a probe that never reports back is replaced after
        /// another `open_for`.
        since_us: u64,
    },
}

/// What [`Breaker::allow`] lets through: an ordinary call, or the probe of an open breaker
/// (whose outcome alone closes it or opens it again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permit {
    /// A call while the breaker is closed.
    Call,
    /// The one call while it is open and a probe is due.
    Probe,
}

/// How a call ended, for the breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The backend answered (a refusal of one request's data included: the backend is fine).
    Success,
    /// The backend call failed or timed out.
    Failure,
    /// The request was in a batch whose one backend call failed, counted by the batch's first
    /// request: a failed request, not another failed call.
    FailedInBatch,
}

/// A change of state a [`Breaker::record`] made, for the caller to log and export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// No change.
    None,
    /// The breaker opened (or a probe failed and it opened again).
    Opened,
    /// A probe succeeded: it closed.
    Closed,
}

/// One slot of the window: counts of the slot's `epoch` (its start divided by the slot length).
#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    epoch: u64,
    requests: u64,
    failed_requests: u64,
    failed_calls: u64,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    /// When a call last succeeded (or the breaker closed), and the calls failed since.
    last_success_us: u64,
    failed_calls_since_success: u64,
    /// Boxed: a breaker sits inside every guarded store, and the stores are enum variants.
    slots: Box<[Slot; SLOTS]>,
}

/// A circuit breaker (see the module docs). Shared by all requests.
#[derive(Debug)]
pub struct Breaker {
    policy: BreakerPolicy,
    slot_us: u64,
    inner: Mutex<Inner>,
}

impl Breaker {
    /// A closed breaker with `policy` (clamped: `min_failures` at least 1, `failure_ratio` into
    /// (0, 1], `window_us` at least `SLOTS`; settings validation refuses values outside).
    pub fn new(policy: BreakerPolicy) -> Breaker {
        let ratio = if policy.failure_ratio > 0.0 && policy.failure_ratio <= 1.0 {
            policy.failure_ratio
        } else {
            1.0
        };
        let policy = BreakerPolicy {
            min_failures: policy.min_failures.max(1),
            failure_ratio: ratio,
            window_us: policy.window_us.max(SLOTS as u64),
            open_for_us: policy.open_for_us,
        };
        Breaker {
            slot_us: policy.window_us / SLOTS as u64,
            policy,
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                last_success_us: 0,
                failed_calls_since_success: 0,
                slots: Box::new([Slot::default(); SLOTS]),
            }),
        }
    }

    /// The policy in force (after clamping).
    pub fn policy(&self) -> BreakerPolicy {
        self.policy
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a call at `now_us` may go to the backend, and as what: `None` while open (or
    /// while another call probes).
    pub fn allow(&self, now_us: u64) -> Option<Permit> {
        let mut inner = self.lock();
        let wait_until = match inner.state {
            BreakerState::Closed => return Some(Permit::Call),
            BreakerState::Open { until_us } => until_us,
            BreakerState::Probing { since_us } => since_us.saturating_add(self.policy.open_for_us),
        };
        if now_us < wait_until {
            return None;
        }
        inner.state = BreakerState::Probing { since_us: now_us };
        Some(Permit::Probe)
    }

    /// Records at `now_us` the outcome of a call `allow` let through as `permit`.
    ///
    /// While closed, every outcome is counted, and a failure that brings the window to the
    /// policy's ratio and minimum opens the breaker. A probe's outcome closes it or opens it
    /// again. The outcome of an ordinary call that ends while the breaker is open or probing (it
    /// started before the breaker opened) is dropped: a straggler's success says less about the
    /// backend than the probe will, and its failure is already what the breaker acts on.
    pub fn record(&self, now_us: u64, permit: Permit, outcome: Outcome) -> Transition {
        let mut inner = self.lock();
        match (inner.state, permit) {
            (BreakerState::Closed, _) => {
                let slot = self.slot(&mut inner, now_us);
                slot.requests += 1;
                if outcome == Outcome::Success {
                    inner.last_success_us = inner.last_success_us.max(now_us);
                    inner.failed_calls_since_success = 0;
                    return Transition::None;
                }
                slot.failed_requests += 1;
                if outcome == Outcome::Failure {
                    slot.failed_calls += 1;
                    inner.failed_calls_since_success += 1;
                }
                let min = u64::from(self.policy.min_failures);
                let (requests, failed_requests, failed_calls) = self.totals(&inner, now_us);
                let ratio_reached = failed_requests as f64 >= self.policy.failure_ratio * requests as f64;
                let dead = inner.failed_calls_since_success >= min
                    && now_us.saturating_sub(inner.last_success_us) >= self.slot_us;
                if (failed_calls >= min && ratio_reached) || dead {
                    self.open(&mut inner, now_us);
                    return Transition::Opened;
                }
                Transition::None
            }
            (_, Permit::Probe) => {
                if outcome == Outcome::Success {
                    inner.state = BreakerState::Closed;
                    *inner.slots = [Slot::default(); SLOTS];
                    inner.last_success_us = now_us;
                    inner.failed_calls_since_success = 0;
                    Transition::Closed
                } else {
                    self.open(&mut inner, now_us);
                    Transition::Opened
                }
            }
            (_, Permit::Call) => Transition::None,
        }
    }

    fn open(&self, inner: &mut Inner, now_us: u64) {
        inner.state = BreakerState::Open {
            until_us: now_us.saturating_add(self.policy.open_for_us),
        };
        // Each open (and close) starts a new window: the outage's failures must not reopen it
        // at once after a successful probe.
        *inner.slots = [Slot::default(); SLOTS];
        inner.failed_calls_since_success = 0;
    }

    /// The slot of `now_us`, cleared first if it still holds an older epoch's counts.
    fn slot<'a>(&self, inner: &'a mut Inner, now_us: u64) -> &'a mut Slot {
        let epoch = now_us / self.slot_us;
        let slot = &mut inner.slots[(epoch % SLOTS as u64) as usize];
        if slot.epoch != epoch {
            *slot = Slot {
                epoch,
                ..Slot::default()
            };
        }
        slot
    }

    /// Requests, failed requests and failed calls in the window ending at `now_us`.
    fn totals(&self, inner: &Inner, now_us: u64) -> (u64, u64, u64) {
        let epoch = now_us / self.slot_us;
        let oldest = epoch.saturating_sub(SLOTS as u64 - 1);
        inner
            .slots
            .iter()
            .filter(|s| s.epoch >= oldest && s.epoch <= epoch)
            .fold((0, 0, 0), |(r, fr, fc), s| {
                (r + s.requests, fr + s.failed_requests, fc + s.failed_calls)
            })
    }

    /// Whether the breaker is open (or probing).
    pub fn is_open(&self) -> bool {
        self.lock().state != BreakerState::Closed
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        self.lock().state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 5 failed calls and half the requests of a 1 s window (100 ms slots); open for 1 ms.
    fn policy() -> BreakerPolicy {
        BreakerPolicy {
            min_failures: 5,
            failure_ratio: 0.5,
            window_us: 1_000_000,
            open_for_us: 1_000,
        }
    }

    fn call(b: &Breaker, now: u64, outcome: Outcome) -> Transition {
        let permit = b.allow(now).expect("closed");
        b.record(now, permit, outcome)
    }

    #[test]
    fn a_dead_backend_opens_it_after_the_minimum_of_failed_calls() {
        let b = Breaker::new(policy());
        for t in 0..4 {
            assert_eq!(call(&b, t, Outcome::Failure), Transition::None);
        }
        assert_eq!(
            call(&b, 4, Outcome::Failure),
            Transition::Opened,
            "the fifth failed call"
        );
        assert!(b.is_open());
        assert_eq!(b.allow(5), None);
        assert_eq!(b.allow(1_003), None);
        // After open_for: one probe, the others stay away.
        assert_eq!(b.allow(1_004), Some(Permit::Probe));
        assert_eq!(b.allow(1_005), None);
        // The probe fails: open again for another while.
        assert_eq!(b.record(1_006, Permit::Probe, Outcome::Failure), Transition::Opened);
        assert_eq!(b.allow(2_005), None);
        assert_eq!(b.allow(2_006), Some(Permit::Probe));
        // The probe succeeds: closed.
        assert_eq!(b.record(2_007, Permit::Probe, Outcome::Success), Transition::Closed);
        assert_eq!(b.allow(2_008), Some(Permit::Call));
        assert_eq!(b.state(), BreakerState::Closed);
    }

    /// The shape of the load that opened the old breaker: thousands of requests a second, and
    /// now and then every request in flight times out at once. A few dozen failures in a window
    /// of thousands of successes keep it closed.
    #[test]
    fn a_latency_tail_under_load_does_not_open_it() {
        let b = Breaker::new(policy());
        let mut now = 0;
        for round in 0..100 {
            for _ in 0..500 {
                now += 100;
                assert_eq!(call(&b, now, Outcome::Success), Transition::None);
            }
            // 64 requests in flight time out together, each its own call.
            for _ in 0..64 {
                assert_eq!(call(&b, now, Outcome::Failure), Transition::None, "round {round}");
            }
        }
        assert!(!b.is_open());
    }

    #[test]
    fn it_opens_when_the_ratio_is_reached_and_not_before() {
        let b = Breaker::new(policy());
        for t in 0..10 {
            call(&b, t, Outcome::Success);
        }
        // 9 failures of 19 requests: under half.
        for t in 10..19 {
            assert_eq!(call(&b, t, Outcome::Failure), Transition::None);
        }
        // The tenth makes 10 of 20.
        assert_eq!(call(&b, 19, Outcome::Failure), Transition::Opened);
    }

    #[test]
    fn requests_of_a_failed_batch_count_in_the_ratio_but_not_as_calls() {
        let b = Breaker::new(policy());
        for t in 0..100 {
            assert_eq!(call(&b, t, Outcome::FailedInBatch), Transition::None);
        }
        assert!(!b.is_open(), "no failed call yet");
        for t in 100..104 {
            assert_eq!(call(&b, t, Outcome::Failure), Transition::None);
        }
        assert_eq!(call(&b, 104, Outcome::Failure), Transition::Opened);

        // And they do push the ratio: 5 failed calls of batches of 10 among 50 successes.
        let b = Breaker::new(policy());
        for t in 0..50 {
            call(&b, t, Outcome::Success);
        }
        let mut opened = false;
        for t in 0..5 {
            call(&b, 100 + t, Outcome::Failure);
            for _ in 0..9 {
                opened |= call(&b, 100 + t, Outcome::FailedInBatch) == Transition::Opened;
            }
            opened |= b.is_open();
        }
        assert!(opened, "50 failed requests of 100, 5 failed calls");
    }

    /// A closed-loop client on a backend that stopped answering: each call waits its timeout,
    /// so failures trickle in after many successes. With no success for a slot (100 ms here)
    /// and 5 failed calls since the last one, it opens without waiting for the share.
    #[test]
    fn a_backend_that_stopped_answering_opens_it_without_the_share() {
        let b = Breaker::new(policy());
        for t in 0..1_000 {
            call(&b, 200_000 + t * 100, Outcome::Success);
        }
        let last = 200_000 + 999 * 100;
        for i in 1..=4 {
            assert_eq!(call(&b, last + i * 30_000, Outcome::Failure), Transition::None);
        }
        assert_eq!(call(&b, last + 150_000, Outcome::Failure), Transition::Opened);
    }

    #[test]
    fn failures_older_than_the_window_are_forgotten() {
        let b = Breaker::new(policy());
        for t in 0..4 {
            call(&b, t, Outcome::Failure);
        }
        // A success in between, and a window later the four are gone: four more do not open it.
        call(&b, 500_000, Outcome::Success);
        for t in 0..4 {
            assert_eq!(call(&b, 1_000_000 + t, Outcome::Failure), Transition::None);
        }
        assert!(!b.is_open());
        assert_eq!(call(&b, 1_000_004, Outcome::Failure), Transition::Opened);
    }

    #[test]
    fn closing_starts_an_empty_window() {
        let b = Breaker::new(policy());
        for t in 0..5 {
            call(&b, t, Outcome::Failure);
        }
        assert_eq!(b.allow(2_000), Some(Permit::Probe));
        assert_eq!(b.record(2_001, Permit::Probe, Outcome::Success), Transition::Closed);
        for t in 0..4 {
            assert_eq!(call(&b, 2_002 + t, Outcome::Failure), Transition::None);
        }
        assert!(!b.is_open());
    }

    #[test]
    fn a_straggler_does_not_close_it_and_a_lost_probe_is_replaced() {
        let b = Breaker::new(BreakerPolicy {
            min_failures: 1,
            failure_ratio: 1.0,
            window_us: 1_000,
            open_for_us: 100,
        });
        let straggler = b.allow(0).expect("closed");
        assert_eq!(call(&b, 0, Outcome::Failure), Transition::Opened);
        // A call that started before it opened answers: the breaker waits for its probe.
        assert_eq!(b.record(10, straggler, Outcome::Success), Transition::None);
        assert!(b.is_open());
        assert_eq!(b.allow(100), Some(Permit::Probe));
        // The probe never reports back (its task was cancelled): another may go later.
        assert_eq!(b.allow(150), None);
        assert_eq!(b.allow(200), Some(Permit::Probe));
    }

    #[derive(Clone, Copy, Debug)]
    enum Step {
        Wait(u64),
        Call(Outcome),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u64..300_000).prop_map(Step::Wait),
            Just(Step::Call(Outcome::Success)),
            Just(Step::Call(Outcome::Failure)),
            Just(Step::Call(Outcome::FailedInBatch)),
        ]
    }

    proptest! {
        /// Against a plain model (every outcome since the window's oldest slot began, kept in a
        /// list): the breaker opens exactly when the model's window reaches the ratio and the
        /// minimum, a closed breaker lets every call through, and an open one lets none
        /// through until `open_for` has passed, then exactly one probe.
        #[test]
        fn matches_a_model(
            min_failures in 1u32..8,
            ratio_pct in 1u32..=100,
            steps in proptest::collection::vec(step(), 1..400),
        ) {
            let p = BreakerPolicy {
                min_failures,
                failure_ratio: f64::from(ratio_pct) / 100.0,
                window_us: 1_000_000,
                open_for_us: 50_000,
            };
            let b = Breaker::new(p);
            let slot = p.window_us / SLOTS as u64;
            let mut now = 0u64;
            // The model: outcomes (time, outcome) since the last open or close.
            let mut seen: Vec<(u64, Outcome)> = Vec::new();
            let mut open_until: Option<u64> = None;
            let mut last_success = 0u64;
            let mut since_success = 0u32;
            for s in steps {
                match s {
                    Step::Wait(d) => now += d,
                    Step::Call(outcome) => {
                        let permit = b.allow(now);
                        match open_until {
                            None => prop_assert_eq!(permit, Some(Permit::Call)),
                            Some(until) if now < until => {
                                prop_assert_eq!(permit, None);
                                continue;
                            }
                            Some(_) => prop_assert_eq!(permit, Some(Permit::Probe)),
                        }
                        let got = b.record(now, permit.unwrap(), outcome);
                        if open_until.is_some() {
                            if outcome == Outcome::Success {
                                prop_assert_eq!(got, Transition::Closed);
                                open_until = None;
                                last_success = now;
                            } else {
                                prop_assert_eq!(got, Transition::Opened);
                                open_until = Some(now + p.open_for_us);
                            }
                            seen.clear();
                            since_success = 0;
                            continue;
                        }
                        seen.push((now, outcome));
                        match outcome {
                            Outcome::Success => {
                                last_success = now;
                                since_success = 0;
                            }
                            Outcome::Failure => since_success += 1,
                            Outcome::FailedInBatch => {}
                        }
                        let oldest = (now / slot).saturating_sub(SLOTS as u64 - 1) * slot;
                        let window: Vec<Outcome> =
                            seen.iter().filter(|(t, _)| *t >= oldest).map(|(_, o)| *o).collect();
                        let requests = window.len() as f64;
                        let failed = window.iter().filter(|o| **o != Outcome::Success).count() as f64;
                        let calls = window.iter().filter(|o| **o == Outcome::Failure).count() as u32;
                        let dead = since_success >= min_failures && now - last_success >= slot;
                        let opens = outcome != Outcome::Success
                            && ((calls >= min_failures && failed >= p.failure_ratio * requests) || dead);
                        if opens {
                            prop_assert_eq!(got, Transition::Opened);
                            open_until = Some(now + p.open_for_us);
                            seen.clear();
                            since_success = 0;
                        } else {
                            prop_assert_eq!(got, Transition::None);
                        }
                    }
                }
            }
        }
    }
}
