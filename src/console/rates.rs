//! Decisions and denials per second over the last minutes, sampled from the process's own
//! answer counters ([`crate::telemetry::denials::ANSWERS`]) once a second.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use crate::core::clock::{Clock, SystemClock};
use crate::telemetry::denials::ANSWERS;

/// Samples kept: one a second, five minutes.
pub(crate) const SAMPLES: usize = 300;

/// The counters' totals, one a second.
#[derive(Debug, Default)]
pub(crate) struct Rates {
    samples: Mutex<VecDeque<Sample>>,
}

/// The totals at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sample {
    /// Unix seconds.
    pub(crate) at_s: u64,
    /// Requests answered since start.
    pub(crate) answered: u64,
    /// Requests answered `OVER_LIMIT` since start.
    pub(crate) denied: u64,
}

/// Per-second rates between two samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Rate {
    /// The later sample's instant, Unix seconds.
    pub(crate) at_s: u64,
    /// Decisions per second.
    pub(crate) decisions: f64,
    /// Denials per second.
    pub(crate) denials: f64,
}

impl Rates {
    /// Sampling from now on, until the returned handle's last clone is dropped.
    pub(crate) fn start() -> Arc<Rates> {
        let rates = Arc::new(Rates::default());
        rates.sample();
        let weak: Weak<Rates> = Arc::downgrade(&rates);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            tick.tick().await;
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(rates) => rates.sample(),
                    None => return,
                }
            }
        });
        rates
    }

    fn sample(&self) {
        let (answered, denied) = ANSWERS.totals();
        let at_s = SystemClock.now_us() / 1_000_000;
        self.push(Sample { at_s, answered, denied });
    }

    fn push(&self, sample: Sample) {
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        if samples.len() == SAMPLES + 1 {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// The rates between consecutive samples, oldest first (at most [`SAMPLES`]).
    pub(crate) fn per_second(&self) -> Vec<Rate> {
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let per = |a: &Sample, b: &Sample, f: fn(&Sample) -> u64| {
            let seconds = b.at_s.saturating_sub(a.at_s).max(1) as f64;
            f(b).saturating_sub(f(a)) as f64 / seconds
        };
        samples
            .iter()
            .zip(samples.iter().skip(1))
            .map(|(a, b)| Rate {
                at_s: b.at_s,
                decisions: per(a, b, |s| s.answered),
                denials: per(a, b, |s| s.denied),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_differences_per_second_and_bounded() {
        let rates = Rates::default();
        rates.push(Sample {
            at_s: 100,
            answered: 10,
            denied: 0,
        });
        rates.push(Sample {
            at_s: 101,
            answered: 30,
            denied: 5,
        });
        rates.push(Sample {
            at_s: 103,
            answered: 50,
            denied: 5,
        });
        let got = rates.per_second();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].decisions, got[0].denials), (20.0, 5.0));
        assert_eq!((got[1].at_s, got[1].decisions, got[1].denials), (103, 10.0, 0.0));
        for i in 0..2 * SAMPLES as u64 {
            rates.push(Sample {
                at_s: 200 + i,
                answered: i,
                denied: 0,
            });
        }
        assert_eq!(rates.per_second().len(), SAMPLES);
    }
}
