//! The calling convention of `tollgate_decide`, the PL/pgSQL function that decides a batch
//! inside PostgreSQL (its migration in `migrations/` documents it): the per-bucket arguments
//! of `lua/decide.lua` ([`bucket_args`], worked out here from each bucket's plan at an estimate
//! of Postgres's time), sent as `bigint[]`s, and its answers. Pure: no I/O.

use crate::core::bucket::{BucketState, Decision, Demand, DemandKind, InstanceOutcome, EXACT_LIMIT};
use crate::store::redis::script::{bucket_args, demand_code, kind_code, BucketArgs};
use crate::store::{Applied, BucketRef, StoreError};

/// One call's arguments (after the time override): every array the function takes.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Call {
    /// Per request: #buckets, #demands.
    pub req: Vec<i64>,
    /// Per bucket 9: key (1-based, into the batch's sorted keys), kind, cap, num, den, lo, hi,
    /// bound, since.
    pub bk: Vec<i64>,
    /// Per demand 5: instance (1-based), kind, amount (µt), enforced, need (µt).
    pub dm: Vec<i64>,
}

/// A number for the function: all of tollgate's are below 2^63 (the far future saturates).
fn n(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// The function's arguments for one request's `buckets` at `t_us` (tollgate's estimate of
/// Postgres time), or `None` when it must be decided in a transaction: a scheduled limit (its
/// walk over changes of limit is tollgate's), or one instance named twice (refused there).
pub(crate) fn request_args(buckets: &[BucketRef], index: &[usize], t_us: u64) -> Option<Vec<BucketArgs>> {
    if index.iter().enumerate().any(|(i, k)| index[..i].contains(k)) {
        return None;
    }
    let args: Vec<BucketArgs> = buckets.iter().map(|b| bucket_args(&b.plan, t_us)).collect();
    args.iter().all(|a| a.kind != b'S').then_some(args)
}

impl Call {
    /// Appends one request: its buckets' `args`, their keys' places `index` in the batch's
    /// sorted keys, and its `demands`.
    pub(crate) fn push(&mut self, args: &[BucketArgs], index: &[usize], demands: &[Demand]) {
        self.req.extend([args.len() as i64, demands.len() as i64]);
        for (a, &k) in args.iter().zip(index) {
            self.bk.extend([
                k as i64 + 1,
                n(kind_code(a.kind)),
                n(a.limit.capacity_ut),
                n(a.limit.rate.num()),
                n(a.limit.rate.den()),
                n(a.lo),
                n(a.hi),
                n(a.bound),
                n(a.since),
            ]);
        }
        for d in demands {
            // Amounts capped at 2^53 as for the script, so both answer alike: more than any
            // capacity, so still failing every consume and filling every refund.
            let (kind, amount, need) = demand_code(d.kind);
            self.dm.extend([
                d.instance as i64 + 1,
                n(kind),
                n(amount.min(EXACT_LIMIT)),
                i64::from(d.enforced),
                n(need),
            ]);
        }
    }
}

/// What the function answered for one request.
#[derive(Debug)]
pub(crate) enum Answer {
    /// Decided (and written).
    Decided(Applied),
    /// Not decided, nothing changed: its limit must be looked up at another time, or a value
    /// walked over a change of limit; a transaction decides it.
    Again,
    /// A stored state that is not tollgate's: refused.
    Bad(StoreError),
}

/// Parses the function's answer `a` for a request of `buckets` buckets and `demands`.
///
/// Errors: an answer of another shape (a function that is not this build's).
pub(crate) fn parse_answer(a: &[i64], buckets: usize, demands: &[Demand]) -> Result<Answer, String> {
    let u = |x: i64| u64::try_from(x).map_err(|_| format!("negative number {x} from tollgate_decide"));
    match a.first() {
        Some(1 | 2) if a.len() == 2 => Ok(Answer::Again),
        Some(3) if a.len() == 2 => Ok(Answer::Bad(StoreError::Rejected(
            "negative bucket state in a row of the batch".into(),
        ))),
        Some(0) if a.len() == 3 + demands.len() + 8 * buckets => {
            let now_us = u(a[1])?;
            let state = |t: i64, w: i64| -> Result<BucketState, String> {
                Ok(BucketState {
                    tokens_ut: u(t)?,
                    updated_us: u(w)?,
                })
            };
            let mut instances = a[3 + demands.len()..]
                .chunks_exact(8)
                .map(|c| {
                    Ok(InstanceOutcome {
                        stored: state(c[0], c[1])?,
                        before: state(c[2], c[3])?,
                        after: state(c[4], c[5])?,
                        consumed_ut: 0,
                        debited_ut: 0,
                        lost_ut: u(c[7])?,
                        changed: c[6] == 1,
                    })
                })
                .collect::<Result<Vec<_>, String>>()?;
            // What was asked, as the core reports it; the function answers what its debits
            // (capped at 2^53) lost, the rest of them was taken.
            for d in demands {
                let o = instances
                    .get_mut(d.instance)
                    .ok_or_else(|| format!("demand on instance {} of {buckets}", d.instance))?;
                match d.kind {
                    DemandKind::Consume(a) => o.consumed_ut = o.consumed_ut.saturating_add(a),
                    DemandKind::Debit { amount_ut, .. } => o.debited_ut = o.debited_ut.saturating_add(amount_ut),
                    _ => {}
                }
            }
            for o in &mut instances {
                let taken = o.debited_ut.min(EXACT_LIMIT).saturating_sub(o.lost_ut);
                o.lost_ut = o.debited_ut - taken;
                o.debited_ut = taken;
            }
            Ok(Answer::Decided(Applied {
                now_us,
                decision: Decision {
                    denied: a[2] == 1,
                    passed: a[3..3 + demands.len()].iter().map(|&p| p == 1).collect(),
                    instances,
                },
            }))
        }
        _ => Err(format!(
            "unexpected answer of {} numbers from tollgate_decide for {buckets} buckets and {} demands",
            a.len(),
            demands.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bucket::MICRO;
    use crate::store::postgres::batch::tests::bucket as fixed;

    #[test]
    fn a_request_is_its_counts_then_nine_numbers_a_bucket_and_five_a_demand() {
        let buckets = [fixed("a"), fixed("b")];
        let args = request_args(&buckets, &[1, 0], 1_000).expect("fixed limits go to the function");
        let demands = [
            Demand {
                instance: 1,
                kind: DemandKind::Consume(u64::MAX),
                enforced: true,
            },
            Demand {
                instance: 0,
                kind: DemandKind::DebtCheck { depth_ut: 7 },
                enforced: false,
            },
        ];
        let mut call = Call::default();
        call.push(&args, &[1, 0], &demands);
        assert_eq!(call.req, [2, 2]);
        assert_eq!(
            &call.bk[..5],
            &[
                2,
                1,
                n(3 * MICRO),
                n(args[0].limit.rate.num()),
                n(args[0].limit.rate.den())
            ]
        );
        assert_eq!(call.bk[9], 1, "the second bucket's key is the first of the batch");
        assert_eq!(call.dm, [2, 1, n(EXACT_LIMIT), 1, 0, 1, 5, 0, 0, 8]);
    }

    #[test]
    fn an_instance_named_twice_is_left_to_a_transaction() {
        assert_eq!(request_args(&[fixed("a"), fixed("a")], &[0, 0], 1_000), None);
    }

    #[test]
    fn answers_are_checked() {
        let take = [Demand {
            instance: 0,
            kind: DemandKind::Consume(MICRO),
            enforced: true,
        }];
        let decided = [0, 100, 0, 1, 5, 1, 5, 100, 4, 100, 1, 0];
        let Ok(Answer::Decided(a)) = parse_answer(&decided, 1, &take) else {
            panic!("decided")
        };
        assert_eq!(
            (a.now_us, a.decision.denied, a.decision.passed.clone()),
            (100, false, vec![true])
        );
        assert_eq!(a.decision.instances[0].after.tokens_ut, 4);
        assert_eq!(a.decision.instances[0].consumed_ut, MICRO);
        assert!(matches!(parse_answer(&[1, 100], 1, &take), Ok(Answer::Again)));
        assert!(matches!(parse_answer(&[2, 100], 1, &take), Ok(Answer::Again)));
        assert!(matches!(
            parse_answer(&[3, 100], 1, &take),
            Ok(Answer::Bad(StoreError::Rejected(_)))
        ));
        assert!(parse_answer(&decided[..11], 1, &take).is_err());
        assert!(parse_answer(&[0, -1, 0, 1, 5, 1, 5, 100, 4, 100, 1, 0], 1, &take).is_err());
        assert!(parse_answer(&[9, 100], 1, &take).is_err());
    }
}
