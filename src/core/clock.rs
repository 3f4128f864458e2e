//! Clocks. Decisions read time only through [`Clock`], so tests move time instead of sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in microseconds since the Unix epoch.
pub trait Clock: Send + Sync + 'static {
    /// Now, in microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        // A clock set before 1970 reads as the epoch: elapsed time is then zero, never negative.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to; clones share the same time.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `now_us`.
    pub fn new(now_us: u64) -> ManualClock {
        ManualClock(Arc::new(AtomicU64::new(now_us)))
    }

    /// Moves the clock forward by `us` microseconds.
    pub fn advance_us(&self, us: u64) {
        self.0.fetch_add(us, Ordering::SeqCst);
    }

    /// Sets the clock to `now_us`, forwards or backwards.
    pub fn set_us(&self, now_us: u64) {
        self.0.store(now_us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// Another clock, shifted by a fixed number of microseconds (tests of replicas whose clocks
/// disagree).
#[derive(Clone, Debug)]
pub struct SkewedClock<C> {
    inner: C,
    skew_us: i64,
}

impl<C: Clock> SkewedClock<C> {
    /// `inner`, reading `skew_us` microseconds ahead (behind, when negative).
    pub fn new(inner: C, skew_us: i64) -> SkewedClock<C> {
        SkewedClock { inner, skew_us }
    }
}

impl<C: Clock> Clock for SkewedClock<C> {
    fn now_us(&self) -> u64 {
        self.inner.now_us().saturating_add_signed(self.skew_us)
    }
}
