//! A circuit breaker for a backend: after `failures` consecutive failures it opens, and calls
//! fail at once (or go to the fallback) instead of each waiting for a timeout; after `open_for`
//! it lets one call through as a probe, which closes it on success or opens it again.
//! Time is an argument (microseconds, any monotonic source), so the logic is tested without
//! sleeping.

use std::sync::Mutex;

/// The breaker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go to the backend.
    Closed {
        /// Consecutive failures so far.
        failures: u32,
    },
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

/// A circuit breaker (see the module docs). Shared by all requests.
#[derive(Debug)]
pub struct Breaker {
    failures: u32,
    open_for_us: u64,
    state: Mutex<BreakerState>,
}

impl Breaker {
    /// Opens after `failures` consecutive failures (at least 1) for `open_for_us` microseconds.
    pub fn new(failures: u32, open_for_us: u64) -> Breaker {
        Breaker {
            failures: failures.max(1),
            open_for_us,
            state: Mutex::new(BreakerState::Closed { failures: 0 }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BreakerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a call at `now_us` may go to the backend. When it may while open, this call
    /// is the probe.
    pub fn allow(&self, now_us: u64) -> bool {
        let mut state = self.lock();
        let wait_until = match *state {
            BreakerState::Closed { .. } => return true,
            BreakerState::Open { until_us } => until_us,
            BreakerState::Probing { since_us } => since_us.saturating_add(self.open_for_us),
        };
        if now_us < wait_until {
            return false;
        }
        *state = BreakerState::Probing { since_us: now_us };
        true
    }

    /// Records a call's success. Returns `true` when this closed an open breaker.
    pub fn success(&self) -> bool {
        let mut state = self.lock();
        let was_open = !matches!(*state, BreakerState::Closed { .. });
        *state = BreakerState::Closed { failures: 0 };
        was_open
    }

    /// Records a call's failure at `now_us`. Returns `true` when this opened the breaker.
    pub fn failure(&self, now_us: u64) -> bool {
        let mut state = self.lock();
        match *state {
            BreakerState::Closed { failures } if failures + 1 < self.failures => {
                *state = BreakerState::Closed { failures: failures + 1 };
                false
            }
            BreakerState::Closed { .. } | BreakerState::Probing { .. } => {
                *state = BreakerState::Open {
                    until_us: now_us.saturating_add(self.open_for_us),
                };
                true
            }
            // A call that started before the breaker opened: it stays open as it is.
            BreakerState::Open { .. } => false,
        }
    }

    /// Whether the breaker is open (or probing).
    pub fn is_open(&self) -> bool {
        !matches!(*self.lock(), BreakerState::Closed { .. })
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        *self.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_probes_after_a_while() {
        let b = Breaker::new(3, 1_000);
        assert!(b.allow(0));
        assert!(!b.failure(0));
        assert!(!b.failure(1));
        // A success in between starts the count again.
        assert!(!b.success());
        assert!(!b.failure(2));
        assert!(!b.failure(3));
        assert!(b.failure(4), "the third consecutive failure opens it");
        assert!(b.is_open());
        assert!(!b.allow(5));
        assert!(!b.allow(1_003));
        // After open_for: one probe, the others stay away.
        assert!(b.allow(1_004));
        assert!(!b.allow(1_005));
        // The probe fails: open again for another while.
        assert!(b.failure(1_006));
        assert!(!b.allow(2_005));
        assert!(b.allow(2_006));
        // The probe succeeds: closed.
        assert!(b.success());
        assert!(b.allow(2_007));
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
    }

    #[test]
    fn a_lost_probe_is_replaced() {
        let b = Breaker::new(1, 100);
        assert!(b.failure(0));
        assert!(b.allow(100));
        // The probe never reports back (its task was cancelled): another may go later.
        assert!(!b.allow(150));
        assert!(b.allow(200));
    }
}
