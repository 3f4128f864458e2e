//! The calling convention of `lua/decide.lua`: what tollgate sends for each bucket instance and
//! demand, and what the script answers. Pure: no I/O, so it is unit-tested without Redis.

use fred::types::Value;

use crate::bucket::{BucketState, Demand, DemandKind, InstanceOutcome, Limit};
use crate::schedule::{refill_to_last_change, Plan, DEFAULT_HORIZON_US, QUOTA_HORIZON_US};

/// How far back the start of the stretch of constant limit holding an instant is looked for:
/// the script asks again ([`Reply::Retry`]) when Redis time falls before it, so it only needs
/// to cover the error of tollgate's estimate of Redis time (well under a second).
pub const LOOKBACK_US: u64 = 1_000_000;

/// What the script needs about one bucket instance's limit at (about) an instant `t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketArgs {
    /// `F` (a constant limit), `S` (a schedule) or `Q` (a calendar quota).
    pub kind: u8,
    /// The limit in force over `[lo, hi)`.
    pub limit: Limit,
    /// `F`: 0. `S`: where the stretch of that limit starts (or `t - LOOKBACK_US`). `Q`: the last
    /// reset edge at or before `t` (0: none within the quota horizon).
    pub lo: u64,
    /// `F`: 0 (unbounded). `S`: the next change of limit (or the horizon). `Q`: the next edge.
    pub hi: u64,
    /// `S`: when a bucket emptied at `hi` would be full again (0: not within the horizon); the
    /// expiry of a bucket not full by `hi`. Otherwise 0.
    pub bound: u64,
}

/// Works out [`BucketArgs`] for `plan` at `t_us`, tollgate's estimate of Redis time.
pub fn bucket_args(plan: &Plan, t_us: u64) -> BucketArgs {
    match plan {
        Plan::Fixed(limit) => BucketArgs {
            kind: b'F',
            limit: *limit,
            lo: 0,
            hi: 0,
            bound: 0,
        },
        Plan::Scheduled(s) => {
            let hi = s
                .next_limit_change(t_us, DEFAULT_HORIZON_US)
                .unwrap_or(t_us.saturating_add(DEFAULT_HORIZON_US));
            let lo = s
                .last_limit_change(t_us, LOOKBACK_US)
                .unwrap_or(t_us.saturating_sub(LOOKBACK_US));
            BucketArgs {
                kind: b'S',
                limit: s.limit_at(t_us),
                lo,
                hi,
                bound: s.full_from_empty_at(hi).unwrap_or(0),
            }
        }
        Plan::Quota(q) => BucketArgs {
            kind: b'Q',
            limit: q.limit(),
            lo: q.prev_edge(t_us, t_us.saturating_sub(QUOTA_HORIZON_US)).unwrap_or(0),
            hi: q
                .next_edge(t_us, t_us.saturating_add(QUOTA_HORIZON_US))
                .unwrap_or(t_us.saturating_add(QUOTA_HORIZON_US)),
            bound: 0,
        },
    }
}

/// A stored value the script could not bring forward (a change of limit lies between its
/// write and now), brought forward by tollgate: the script uses `rep` if the key still holds
/// `expect`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replacement {
    /// The value as read.
    pub expect: Vec<u8>,
    /// `tokens:updated` at the last change of limit.
    pub rep: String,
}

/// Parses a stored value `tokens:updated:end` into the state and `end`.
pub fn parse_value(raw: &[u8]) -> Option<(BucketState, u64)> {
    let text = std::str::from_utf8(raw).ok()?;
    let mut parts = text.split(':').map(|p| p.parse::<u64>().ok());
    let (tokens_ut, updated_us, end) = (parts.next()??, parts.next()??, parts.next()??);
    parts
        .next()
        .is_none()
        .then_some((BucketState { tokens_ut, updated_us }, end))
}

/// The replacement for a scheduled bucket stored as `raw`, walked to the last change of limit
/// at or before `now_us` (Redis time, as the script reported it).
pub fn replacement(plan: &Plan, raw: &[u8], now_us: u64) -> Option<Replacement> {
    let Plan::Scheduled(s) = plan else { return None };
    let (state, _) = parse_value(raw)?;
    let at = refill_to_last_change(state, s, now_us);
    Some(Replacement {
        expect: raw.to_vec(),
        rep: format!("{}:{}", at.tokens_ut, at.updated_us),
    })
}

/// Settings that go into every call.
#[derive(Clone, Copy, Debug)]
pub struct CallSettings {
    /// Added to every key's time to live, in milliseconds.
    pub ttl_margin_ms: u64,
    /// The longest time to live, in milliseconds (a bucket that may never be full again).
    pub max_ttl_ms: u64,
}

/// The fields of the script's ARGV that precede the requests of one call.
pub const HEADER_FIELDS: usize = 4;

/// The start of the script's ARGV for a call deciding `requests` requests (see
/// `lua/decide.lua`): the time override (tests; `None` = Redis `TIME`), the TTL margin, the
/// longest TTL, the number of requests. Each request's own fields ([`encode_request`]) follow.
pub fn encode_header(now_override: Option<u64>, settings: CallSettings, requests: usize) -> Vec<Value> {
    vec![
        match now_override {
            Some(now) => int_value(now),
            None => Value::String("".into()),
        },
        int_value(settings.ttl_margin_ms),
        int_value(settings.max_ttl_ms),
        int_value(requests as u64),
    ]
}

fn int_value(n: u64) -> Value {
    Value::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}

/// One request's ARGV fields (see `lua/decide.lua`): the number of buckets and of demands,
/// then 9 fields per bucket and 4 per demand. Its keys go into KEYS in the same order as
/// `buckets`.
pub fn encode_request(buckets: &[(BucketArgs, Option<&Replacement>)], demands: &[Demand]) -> Vec<Value> {
    let mut argv: Vec<Value> = Vec::with_capacity(2 + buckets.len() * 9 + demands.len() * 4);
    let int = int_value;
    argv.push(int(buckets.len() as u64));
    argv.push(int(demands.len() as u64));
    for (b, rep) in buckets {
        argv.push(Value::String(char::from(b.kind).to_string().into()));
        argv.push(int(b.limit.capacity_ut));
        argv.push(int(b.limit.rate.num()));
        argv.push(int(b.limit.rate.den()));
        argv.push(int(b.lo));
        argv.push(int(b.hi));
        argv.push(int(b.bound));
        match rep {
            Some(r) => {
                argv.push(Value::Bytes(r.expect.clone().into()));
                argv.push(Value::String(r.rep.clone().into()));
            }
            None => {
                argv.push(Value::String("".into()));
                argv.push(Value::String("".into()));
            }
        }
    }
    for d in demands {
        argv.push(int(d.instance as u64 + 1));
        let (kind, n) = match d.kind {
            DemandKind::Consume(n) => ("c", n),
            DemandKind::Check => ("k", 0),
            DemandKind::Refund(n) => ("r", n),
        };
        argv.push(Value::String(kind.into()));
        // Lua's numbers are doubles: an amount beyond 2^53 µt (9 billion tokens) is more than any
        // capacity, so it is sent as 2^53, which still fails every consume and fills every refund.
        argv.push(int(n.min(crate::bucket::EXACT_LIMIT)));
        argv.push(int(u64::from(d.enforced)));
    }
    argv
}

/// Splits the script's answer to a call over `requests` requests into one answer per request.
///
/// Errors: not an array of that length.
pub fn split_answers(value: Value, requests: usize) -> Result<Vec<Value>, String> {
    match value {
        Value::Array(answers) if answers.len() == requests => Ok(answers),
        Value::Array(answers) => Err(format!("the script answered {} of {requests} requests", answers.len())),
        other => Err(format!("expected an array from the script, got {other:?}")),
    }
}

/// The script's decision for one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decided {
    /// Redis time of the decision, in microseconds.
    pub now_us: u64,
    /// Whether some enforced demand failed.
    pub denied: bool,
    /// Per demand.
    pub passed: Vec<bool>,
    /// Per bucket: stored, before, after, changed (`consumed_ut` is filled in by the caller).
    pub instances: Vec<InstanceOutcome>,
}

/// What the script answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Decided and written.
    Decided(Decided),
    /// Some bucket's time fell outside its `[lo, hi)`: ask again with each bucket's limit
    /// looked up at its time. Nothing was written.
    Retry {
        /// Redis time, in microseconds.
        now_us: u64,
        /// Per bucket, the instant its limit is wanted at: `now_us`, or a scheduled bucket's
        /// last write when Redis's clock reads before it (a clock that stepped back).
        at_us: Vec<u64>,
    },
    /// Scheduled buckets crossed by a change of limit since their write: walk them and ask
    /// again with [`Replacement`]s. Nothing was written.
    Walk {
        /// Redis time, in microseconds.
        now_us: u64,
        /// Bucket index (0-based) and stored value.
        stale: Vec<(usize, Vec<u8>)>,
    },
    /// A stored value the script cannot read, or a key of another type (another writer under
    /// the key prefix): this request only is refused. Nothing was written.
    Bad {
        /// Redis time, in microseconds.
        now_us: u64,
        /// What the script found.
        reason: String,
    },
}

fn int(v: &Value) -> Result<u64, String> {
    match v {
        Value::Integer(n) => u64::try_from(*n).map_err(|_| format!("negative number {n} from the script")),
        other => Err(format!("expected a number from the script, got {other:?}")),
    }
}

fn text(v: &Value) -> Result<&[u8], String> {
    v.as_bytes()
        .ok_or_else(|| format!("expected a string from the script, got {v:?}"))
}

/// Parses the script's answer for a call over `buckets` buckets and `demands` demands.
pub fn parse_reply(value: Value, buckets: usize, demands: usize) -> Result<Reply, String> {
    let Value::Array(items) = value else {
        return Err(format!("expected an array from the script, got {value:?}"));
    };
    let tag = items.first().map(text).transpose()?.unwrap_or_default();
    let now_us = items
        .get(1)
        .map(int)
        .transpose()?
        .ok_or("the script's answer has no time")?;
    match tag {
        b"retry" => {
            let at_us = items[2..].iter().map(int).collect::<Result<Vec<u64>, String>>()?;
            if at_us.len() != buckets {
                return Err(format!(
                    "the script asked again for {} of {buckets} buckets",
                    at_us.len()
                ));
            }
            Ok(Reply::Retry { now_us, at_us })
        }
        b"bad" => {
            let reason = items.get(2).map(text).transpose()?.unwrap_or_default();
            Ok(Reply::Bad {
                now_us,
                reason: String::from_utf8_lossy(reason).into_owned(),
            })
        }
        b"walk" => {
            let stale = items[2..]
                .chunks(2)
                .map(|pair| match pair {
                    [i, raw] => {
                        let i = int(i)? as usize;
                        if i == 0 || i > buckets {
                            return Err(format!("bucket {i} out of range"));
                        }
                        Ok((i - 1, text(raw)?.to_vec()))
                    }
                    _ => Err("odd walk list".to_string()),
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Reply::Walk { now_us, stale })
        }
        b"ok" => {
            if items.len() != 4 + buckets * 7 {
                return Err(format!(
                    "the script answered {} items for {buckets} buckets",
                    items.len()
                ));
            }
            let denied = int(&items[2])? == 1;
            let bits = text(&items[3])?;
            if bits.len() != demands {
                return Err(format!("the script answered {} demands of {demands}", bits.len()));
            }
            let passed = bits.iter().map(|b| *b == b'1').collect();
            let instances = items[4..]
                .chunks(7)
                .map(|c| {
                    let n = c.iter().map(int).collect::<Result<Vec<u64>, String>>()?;
                    let state = |t, u| BucketState {
                        tokens_ut: t,
                        updated_us: u,
                    };
                    Ok(InstanceOutcome {
                        stored: state(n[0], n[1]),
                        before: state(n[2], n[3]),
                        after: state(n[4], n[5]),
                        consumed_ut: 0,
                        changed: n[6] == 1,
                    })
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Reply::Decided(Decided {
                now_us,
                denied,
                passed,
                instances,
            }))
        }
        other => Err(format!(
            "unexpected answer {:?} from the script",
            String::from_utf8_lossy(other)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::Rate;

    #[test]
    fn values_round_trip() {
        assert_eq!(
            parse_value(b"5:17:0"),
            Some((
                BucketState {
                    tokens_ut: 5,
                    updated_us: 17
                },
                0
            ))
        );
        for bad in [&b""[..], b"5:17", b"5:17:0:1", b"a:1:2", b"-1:2:3", b"\xff"] {
            assert_eq!(parse_value(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_fixed_limit_is_unbounded_in_time() {
        let limit = Limit::new(10, Rate::per(10, 60_000_000).unwrap());
        let args = bucket_args(&Plan::Fixed(limit), 1_700_000_000_000_000);
        assert_eq!((args.kind, args.lo, args.hi, args.bound), (b'F', 0, 0, 0));
    }

    #[test]
    fn replies_are_checked() {
        let ok = Value::Array(vec![
            "ok".into(),
            Value::Integer(100),
            Value::Integer(0),
            "1".into(),
            Value::Integer(5),
            Value::Integer(1),
            Value::Integer(5),
            Value::Integer(100),
            Value::Integer(4),
            Value::Integer(100),
            Value::Integer(1),
        ]);
        let Reply::Decided(d) = parse_reply(ok.clone(), 1, 1).unwrap() else {
            panic!("decided")
        };
        assert!(!d.denied);
        assert_eq!(d.passed, vec![true]);
        assert_eq!(d.instances[0].after.tokens_ut, 4);
        assert!(d.instances[0].changed);
        assert!(parse_reply(ok, 2, 1).is_err());
        assert!(parse_reply(Value::Integer(3), 1, 1).is_err());
        assert!(parse_reply(Value::Array(vec!["what".into(), Value::Integer(1)]), 1, 1).is_err());
        let retry = Value::Array(vec!["retry".into(), Value::Integer(7), Value::Integer(9)]);
        assert_eq!(
            parse_reply(retry, 1, 1).unwrap(),
            Reply::Retry {
                now_us: 7,
                at_us: vec![9]
            }
        );
        assert!(parse_reply(Value::Array(vec!["retry".into(), Value::Integer(7)]), 1, 1).is_err());
        let walk = Value::Array(vec![
            "walk".into(),
            Value::Integer(7),
            Value::Integer(2),
            "1:2:3".into(),
        ]);
        assert_eq!(
            parse_reply(walk, 2, 1).unwrap(),
            Reply::Walk {
                now_us: 7,
                stale: vec![(1, b"1:2:3".to_vec())]
            }
        );
        let out_of_range = Value::Array(vec![
            "walk".into(),
            Value::Integer(7),
            Value::Integer(3),
            "1:2:3".into(),
        ]);
        assert!(parse_reply(out_of_range, 2, 1).is_err());
    }

    #[test]
    fn a_call_is_a_header_then_each_request() {
        let settings = CallSettings {
            ttl_margin_ms: 1000,
            max_ttl_ms: 5000,
        };
        assert_eq!(
            encode_header(None, settings, 3),
            vec![
                Value::String("".into()),
                Value::Integer(1000),
                Value::Integer(5000),
                Value::Integer(3)
            ]
        );
        assert_eq!(encode_header(Some(7), settings, 1)[0], Value::Integer(7));
        assert_eq!(encode_header(None, settings, 1).len(), HEADER_FIELDS);

        let limit = Limit::new(10, Rate::per(10, 60_000_000).unwrap());
        let args = bucket_args(&Plan::Fixed(limit), 1_700_000_000_000_000);
        let demands = [
            Demand {
                instance: 1,
                kind: DemandKind::Consume(3),
                enforced: true,
            },
            Demand {
                instance: 0,
                kind: DemandKind::Check,
                enforced: false,
            },
        ];
        let fields = encode_request(&[(args, None), (args, None)], &demands);
        assert_eq!(fields.len(), 2 + 2 * 9 + 2 * 4);
        assert_eq!(&fields[..2], &[Value::Integer(2), Value::Integer(2)]);
        assert_eq!(fields[2], Value::String("F".into()));
        // The first demand: bucket 2 (1-based), consume 3 µt, enforced.
        assert_eq!(
            &fields[20..24],
            &[
                Value::Integer(2),
                Value::String("c".into()),
                Value::Integer(3),
                Value::Integer(1)
            ]
        );
    }

    #[test]
    fn answers_are_split_per_request() {
        let two = Value::Array(vec![Value::Integer(1), Value::Integer(2)]);
        assert_eq!(
            split_answers(two.clone(), 2).unwrap(),
            vec![Value::Integer(1), Value::Integer(2)]
        );
        assert!(split_answers(two, 3).is_err());
        assert!(split_answers(Value::Integer(1), 1).is_err());
        let bad = Value::Array(vec![
            "bad".into(),
            Value::Integer(7),
            "tollgate: bad bucket value in k".into(),
        ]);
        assert_eq!(
            parse_reply(bad, 1, 1).unwrap(),
            Reply::Bad {
                now_us: 7,
                reason: "tollgate: bad bucket value in k".into()
            }
        );
    }
}
