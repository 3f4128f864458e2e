//! What the operator console (`crate::console`) shows of the traffic, counted in process: how
//! many requests were answered and denied, and which buckets deny most.
//!
//! Both are fed by the gRPC service once per answer: an answer costs one relaxed atomic add;
//! an `OVER_LIMIT` one also offers its denied descriptors to the sketch, which never makes a
//! request wait: while another thread holds it, the denial is not counted there
//! ([`TopDenied::offer`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError};

/// Requests answered since start: `OK` and `OVER_LIMIT` (`overall_code`), never reset.
#[derive(Debug, Default)]
pub struct Answers {
    ok: AtomicU64,
    over_limit: AtomicU64,
}

impl Answers {
    /// Counts one answer.
    pub fn count(&self, over_limit: bool) {
        let counter = if over_limit { &self.over_limit } else { &self.ok };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// `(answered, denied)` since start: every answer, and the `OVER_LIMIT` ones.
    pub fn totals(&self) -> (u64, u64) {
        let over = self.over_limit.load(Ordering::Relaxed);
        (self.ok.load(Ordering::Relaxed) + over, over)
    }
}

/// The process's answers.
pub static ANSWERS: Answers = Answers {
    ok: AtomicU64::new(0),
    over_limit: AtomicU64::new(0),
};

/// The most-denied bucket instances: a Space-Saving sketch (Metwally, Agrawal, El Abbadi, 2005)
/// of at most [`TopDenied::CAPACITY`] instances, so a flood of distinct clients costs bounded
/// memory. An instance counted `count` times with `error` is certain to have been denied at
/// least `count - error` times; any instance denied more than a `1 / CAPACITY` share of all
/// denials is in it.
#[derive(Debug)]
pub struct TopDenied {
    counted: Mutex<HashMap<DeniedInstance, Tally>>,
}

/// One bucket instance that denied: its domain, the bucket's name (`current_limit.name`, empty
/// for an unnamed limit) and the descriptor's entries as Envoy sent them (each value cut to
/// [`TopDenied::MAX_VALUE_BYTES`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeniedInstance {
    /// The domain.
    pub domain: String,
    /// The bucket's name.
    pub bucket: String,
    /// The descriptor's `(key, value)` entries.
    pub entries: Vec<(String, String)>,
}

/// How often an instance was counted, and by how much that may overstate it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Denials counted: at least the true number, at most `error` more.
    pub count: u64,
    /// The count of the instance this one replaced when it came in.
    pub error: u64,
}

impl TopDenied {
    /// Instances kept.
    pub const CAPACITY: usize = 64;
    /// The longest descriptor value kept, in bytes; a longer one is cut at a character boundary.
    pub const MAX_VALUE_BYTES: usize = 128;

    fn new() -> TopDenied {
        TopDenied {
            counted: Mutex::new(HashMap::with_capacity(Self::CAPACITY)),
        }
    }

    /// Counts the denials `instances` yields, unless another thread holds the sketch: then
    /// nothing is counted and nothing is built (a flood of denials on every core must not
    /// queue the requests behind one lock; the sketch then undercounts, as it says it may).
    /// Returns whether they were counted.
    pub fn offer<I: IntoIterator<Item = DeniedInstance>>(&self, instances: impl FnOnce() -> I) -> bool {
        let mut counted = match self.counted.try_lock() {
            Ok(counted) => counted,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        for instance in instances() {
            Self::count_in(&mut counted, instance);
        }
        true
    }

    /// One more for `instance` if it is kept; else it takes the place of the least counted
    /// instance once the sketch is full, with that one's count plus one.
    fn count_in(counted: &mut HashMap<DeniedInstance, Tally>, instance: DeniedInstance) {
        if let Some(tally) = counted.get_mut(&instance) {
            tally.count += 1;
            return;
        }
        let mut tally = Tally { count: 1, error: 0 };
        if counted.len() >= Self::CAPACITY {
            let least = counted
                .iter()
                .min_by_key(|(_, t)| t.count)
                .map(|(k, t)| (k.clone(), t.count));
            if let Some((key, count)) = least {
                counted.remove(&key);
                tally = Tally {
                    count: count + 1,
                    error: count,
                };
            }
        }
        counted.insert(instance, tally);
    }

    /// The `n` most counted instances, most first (ties by domain, bucket, entries).
    pub fn top(&self, n: usize) -> Vec<(DeniedInstance, Tally)> {
        let counted = self.counted.lock().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<_> = counted.iter().map(|(k, t)| (k.clone(), *t)).collect();
        drop(counted);
        all.sort_by(|(a, ta), (b, tb)| {
            tb.count
                .cmp(&ta.count)
                .then_with(|| (&a.domain, &a.bucket, &a.entries).cmp(&(&b.domain, &b.bucket, &b.entries)))
        });
        all.truncate(n);
        all
    }
}

/// A descriptor value as kept: at most [`TopDenied::MAX_VALUE_BYTES`], cut at a character
/// boundary.
pub fn kept_value(value: &str) -> String {
    let mut end = value.len().min(TopDenied::MAX_VALUE_BYTES);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].to_owned()
}

/// The process's most-denied instances.
pub static TOP_DENIED: LazyLock<TopDenied> = LazyLock::new(TopDenied::new);

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(value: &str) -> DeniedInstance {
        DeniedInstance {
            domain: "edge".into(),
            bucket: "per_key".into(),
            entries: vec![("api_key".into(), value.into())],
        }
    }

    #[test]
    fn a_heavy_hitter_survives_a_flood_of_distinct_instances() {
        let sketch = TopDenied::new();
        for i in 0..10_000 {
            if i % 4 == 0 {
                sketch.offer(|| [instance("heavy")]);
            }
            sketch.offer(|| [instance(&format!("client-{i}"))]);
        }
        assert_eq!(sketch.counted.lock().unwrap().len(), TopDenied::CAPACITY, "bounded");
        let top = sketch.top(3);
        assert_eq!(top[0].0, instance("heavy"));
        let tally = top[0].1;
        assert!(tally.count >= 2_500 && tally.count - tally.error <= 2_500, "{tally:?}");
    }

    #[test]
    fn counts_are_exact_below_the_capacity() {
        let sketch = TopDenied::new();
        for _ in 0..3 {
            sketch.offer(|| [instance("a")]);
        }
        sketch.offer(|| [instance("b")]);
        let top = sketch.top(10);
        assert_eq!(top.len(), 2);
        assert_eq!(
            (top[0].0.clone(), top[0].1),
            (instance("a"), Tally { count: 3, error: 0 })
        );
        assert_eq!(top[1].1, Tally { count: 1, error: 0 });
    }

    #[test]
    fn an_offer_never_waits_for_the_sketch() {
        let sketch = TopDenied::new();
        assert!(sketch.offer(|| [instance("a"), instance("a")]));
        let held = sketch.counted.lock().unwrap();
        let mut built = false;
        assert!(!sketch.offer(|| {
            built = true;
            [instance("b")]
        }));
        assert!(!built, "nothing is built while another thread holds it");
        drop(held);
        assert_eq!(sketch.top(1)[0].1.count, 2);
    }

    #[test]
    fn long_values_are_cut_at_a_character_boundary() {
        let long = "é".repeat(100);
        let kept = kept_value(&long);
        assert!(kept.len() <= TopDenied::MAX_VALUE_BYTES && kept.len() >= TopDenied::MAX_VALUE_BYTES - 1);
        assert!(long.starts_with(&kept));
    }

    #[test]
    fn answers_are_totalled() {
        let answers = Answers::default();
        answers.count(false);
        answers.count(true);
        answers.count(false);
        assert_eq!(answers.totals(), (3, 1));
    }
}
