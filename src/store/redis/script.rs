//! The calling convention of `lua/decide.lua`: what tollgate sends for each bucket instance and
//! demand, and what the script answers. Pure: no I/O, so it is unit-tested without Redis.

use fred::types::Value;

use crate::core::bucket::{BucketState, Demand, DemandKind, InstanceOutcome, Limit};
use crate::core::schedule::{refill_to_last_change, Plan, Quota, DEFAULT_HORIZON_US, QUOTA_HORIZON_US};

/// How far back the start of the stretch of constant limit holding an instant is looked for:
/// the script asks again ([`Reply::Retry`]) when Redis time falls before it, so it only needs
/// to cover the error of tollgate's estimate of Redis time (well under a second).
pub const LOOKBACK_US: u64 = 1_000_000;

/// The longest time between two reset edges of a quota that rules may declare: 8 years and
/// 10 days. The rarest day a pattern can match is 29 February, 8 years apart across a century
/// that is not a leap year (2096 to 2104); the days over cover a zone changing its UTC offset in
/// between. A quota's next edge is searched this far, so its key expires at that edge, not at
/// the 368 days of [`QUOTA_HORIZON_US`] that bound a retry-after.
pub const QUOTA_LONGEST_PERIOD_US: u64 = (8 * 365 + 2 + 10) * 86_400 * 1_000_000;

/// What the script needs about one bucket instance's limit at (about) an instant `t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketArgs {
    /// `F` (a constant limit), `S` (a schedule), `Q` (a calendar quota), `D` (a debt quota) or
    /// `E` (an expiring allowance).
    pub kind: u8,
    /// The limit in force over `[lo, hi)`.
    pub limit: Limit,
    /// `F`: 0. `S`: where the stretch of that limit starts (or `t - LOOKBACK_US`). `Q`: the last
    /// reset edge at or before `t` (0: none within the quota horizon).
    pub lo: u64,
    /// `F`: 0 (unbounded). `S`: the next change of limit (or the horizon). `Q`: the next edge
    /// (searched [`QUOTA_LONGEST_PERIOD_US`] ahead).
    pub hi: u64,
    /// `S`: when a bucket emptied at `hi` would be full again (0: not within the horizon); the
    /// expiry of a bucket not full by `hi`. `D`: the edge after `hi`. `E`: `expires`, the
    /// length of a period from its first use. Otherwise 0.
    pub bound: u64,
    /// When a reload replaced the limit (0: no reload is remembered): a value written before
    /// it is brought forward here under the old rules first (the script answers "walk").
    pub since: u64,
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
            since: 0,
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
                since: 0,
            }
        }
        Plan::Quota(q) => quota_args(q, t_us),
        // The period's end depends on the stored first use: the script works it out.
        Plan::Expiring(e) => BucketArgs {
            kind: b'E',
            limit: e.limit(),
            lo: 0,
            hi: 0,
            bound: e.expires_us(),
            since: 0,
        },
        // From the reload on: the new limit, which holds only from the reload (an estimate of
        // Redis time before it is asked again), for values written from then on.
        Plan::Reloaded(r) if t_us >= r.at_us() => {
            let mut args = bucket_args(r.after(), t_us);
            args.lo = args.lo.max(r.at_us());
            args.since = r.at_us();
            args
        }
        // Before it (Redis's clock behind tollgate's): the old limit, up to the reload.
        Plan::Reloaded(r) => {
            let mut args = bucket_args(r.before(), t_us);
            args.hi = if args.hi == 0 {
                r.at_us()
            } else {
                args.hi.min(r.at_us())
            };
            args
        }
    }
}

/// [`BucketArgs`] of a calendar quota at `t_us`: `Q`, or `D` for a debt quota, whose reset
/// adds its allowance rather than filling the bucket. The script leaves a `D` value written
/// before the last edge to tollgate (a walk: [`Quota::advance`] counts the edges crossed), and
/// its key lives to the edge after the next (`bound`), when any balance is full again.
fn quota_args(q: &Quota, t_us: u64) -> BucketArgs {
    // The next edge however far (a quota reset on 29 February): it is the key's expiry.
    let hi = q
        .next_edge(t_us, t_us.saturating_add(QUOTA_LONGEST_PERIOD_US))
        .unwrap_or(t_us.saturating_add(QUOTA_LONGEST_PERIOD_US));
    let debt = q.has_debt();
    BucketArgs {
        kind: if debt { b'D' } else { b'Q' },
        limit: q.limit(),
        lo: q.prev_edge(t_us, t_us.saturating_sub(QUOTA_HORIZON_US)).unwrap_or(0),
        hi,
        bound: if debt {
            q.next_edge(hi, hi.saturating_add(QUOTA_LONGEST_PERIOD_US)).unwrap_or(0)
        } else {
            0
        },
        since: 0,
    }
}

/// A stored value the script could not bring forward (a change of limit lies between its
/// write and now), brought forward by tollgate: the script uses `rep` if the key still holds
/// `expect`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replacement {
    /// The value as read.
    pub expect: Vec<u8>,
    /// Tokens (µt) and updated (µs) at the last change of limit: two little-endian doubles.
    pub rep: Vec<u8>,
}

/// Bytes of a stored value: three little-endian doubles (see [`parse_value`]).
pub const VALUE_LEN: usize = 24;

/// Parses a stored value: 24 bytes, three little-endian doubles holding integers from 0 to
/// 2^53: tokens (µt), updated (µs) and end (µs: when the limit it was written under stops
/// holding, 0 = never); or the text form `tokens:updated:end` that earlier versions wrote.
/// Returns the state and `end`; `None` for anything else (`lua/decide.lua` refuses the same
/// values).
pub fn parse_value(raw: &[u8]) -> Option<(BucketState, u64)> {
    // Binary, else text (as in `lua/decide.lua`): a text value can be 24 bytes long too, but
    // its digits and colons read as doubles are tiny fractions, never valid numbers.
    let binary = (raw.len() == VALUE_LEN).then(|| unpack_numbers(raw).ok()).flatten();
    let n = match binary {
        Some(n) => n,
        None => parse_text_value(raw)?,
    };
    Some((
        BucketState {
            tokens_ut: n[0],
            updated_us: n[1],
        },
        n[2],
    ))
}

/// The text form of earlier versions, `tokens:updated:end`, each at most 2^53 (as the
/// script's `^(%d+):(%d+):(%d+)$` and exact doubles allow).
fn parse_text_value(raw: &[u8]) -> Option<Vec<u64>> {
    let text = std::str::from_utf8(raw).ok()?;
    let n: Vec<u64> = text
        .split(':')
        .map(|p| {
            let digits = !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
            digits.then(|| p.parse::<u64>().ok()).flatten()
        })
        .collect::<Option<_>>()?;
    (n.len() == 3 && n.iter().all(|&x| x <= crate::core::bucket::EXACT_LIMIT)).then_some(n)
}

/// The replacement for a scheduled bucket stored as `raw`, walked to the last change of limit
/// at or before `now_us` (Redis time, as the script reported it).
pub fn replacement(plan: &Plan, raw: &[u8], now_us: u64) -> Option<Replacement> {
    let (state, _) = parse_value(raw)?;
    let at = walked(plan, state, now_us)?;
    Some(Replacement {
        expect: raw.to_vec(),
        rep: [at.tokens_ut, at.updated_us]
            .iter()
            .flat_map(|&n| (n as f64).to_le_bytes())
            .collect(),
    })
}

/// `state` brought forward to the last change of limit at or before `now_us` that the script
/// cannot cross itself: a schedule's, or a reload's (the old rules up to it, then the new
/// ones' schedule). `None` for a plan with no such change.
fn walked(plan: &Plan, state: BucketState, now_us: u64) -> Option<BucketState> {
    match plan {
        Plan::Scheduled(s) => Some(refill_to_last_change(state, s, now_us)),
        Plan::Reloaded(r) if now_us < r.at_us() => walked(r.before(), state, now_us),
        Plan::Reloaded(r) => {
            let at = if r.predates(state.updated_us) {
                r.at_reload(state)
            } else {
                state
            };
            Some(walked(r.after(), at, now_us).unwrap_or(at))
        }
        // A debt quota's reset counts the edges crossed, which the script leaves to tollgate.
        Plan::Quota(q) if q.has_debt() => Some(q.advance(state, now_us)),
        Plan::Fixed(_) | Plan::Quota(_) | Plan::Expiring(_) => None,
    }
}

/// Settings that go into every call.
#[derive(Clone, Copy, Debug)]
pub struct CallSettings {
    /// Added to every key's time to live, in milliseconds.
    pub ttl_margin_ms: u64,
    /// The time to live, in milliseconds, of a key whose bucket's full time is not known (a
    /// schedule whose refill the look-ahead does not reach); 0: no expiry, so that it is kept
    /// until a write finds it full. A known full time is never cut short.
    pub unknown_ttl_ms: u64,
}

/// The start of the script's ARGV for a call deciding `requests` requests (see
/// `lua/decide.lua`): the time override (tests; `None` = Redis `TIME`), the TTL margin, the
/// TTL of a bucket whose full time is unknown, the number of requests. Each request's own fields ([`encode_request`]) follow.
pub fn encode_header(now_override: Option<u64>, settings: CallSettings, requests: usize) -> Vec<Value> {
    vec![
        match now_override {
            Some(now) => int_value(now),
            None => Value::String("".into()),
        },
        int_value(settings.ttl_margin_ms),
        int_value(settings.unknown_ttl_ms),
        int_value(requests as u64),
    ]
}

fn int_value(n: u64) -> Value {
    Value::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}

/// A bucket's kind as the script and the Postgres function number it: 1 a constant limit
/// (`F`), 2 a schedule (`S`), 3 a calendar quota (`Q`), 4 a debt quota (`D`), 5 an expiring
/// allowance (`E`).
pub fn kind_code(kind: u8) -> u64 {
    match kind {
        b'F' => 1,
        b'S' => 2,
        b'D' => 4,
        b'E' => 5,
        _ => 3,
    }
}

/// A demand as the script and the Postgres function take it: `(kind, amount in µt, need in
/// µt)`, kind 1 consume, 2 check, 3 refund, 4 debit, 5 debt check; `need` is what the bucket
/// must hold to pass (debits and debt checks: one more than their depth).
pub fn demand_code(kind: DemandKind) -> (u64, u64, u64) {
    match kind {
        DemandKind::Consume(n) => (1, n, 0),
        DemandKind::Check => (2, 0, 0),
        DemandKind::Refund(n) => (3, n, 0),
        DemandKind::Debit { amount_ut, depth_ut } => (4, amount_ut, depth_ut.saturating_add(1)),
        DemandKind::DebtCheck { depth_ut } => (5, 0, depth_ut.saturating_add(1)),
    }
}

/// One request's ARGV fields (see `lua/decide.lua`): one string of little-endian `f64`s (the
/// counts, 9 numbers per bucket, 5 per demand; every number an integer below 2^53, so exact),
/// then the two strings of each [`Replacement`], in bucket order. Its keys go into KEYS in the
/// same order as `buckets`. Packed numbers spare Redis a string object per number and the
/// script a text-to-number parse per number.
pub fn encode_request(buckets: &[(BucketArgs, Option<&Replacement>)], demands: &[Demand]) -> Vec<Value> {
    let replaced = buckets.iter().filter(|(_, r)| r.is_some()).count();
    let mut packed = Vec::with_capacity(8 * (3 + buckets.len() * 9 + demands.len() * 5));
    // Lua's numbers are doubles: nothing tollgate sends exceeds 2^53 but an amount, which is
    // capped there (9 billion tokens is more than any capacity, so it still fails every
    // consume and fills every refund).
    let mut put = |n: u64| packed.extend_from_slice(&(n.min(crate::core::bucket::EXACT_LIMIT) as f64).to_le_bytes());
    put(buckets.len() as u64);
    put(demands.len() as u64);
    put(replaced as u64);
    for (b, rep) in buckets {
        put(kind_code(b.kind));
        put(b.limit.capacity_ut);
        put(b.limit.rate.num());
        put(b.limit.rate.den());
        put(b.lo);
        put(b.hi);
        put(b.bound);
        put(u64::from(rep.is_some()));
        put(b.since);
    }
    for d in demands {
        put(d.instance as u64 + 1);
        let (kind, n, need) = demand_code(d.kind);
        put(kind);
        put(n);
        put(u64::from(d.enforced));
        put(need);
    }
    let mut argv = Vec::with_capacity(1 + 2 * replaced);
    argv.push(Value::Bytes(packed.into()));
    for r in buckets.iter().filter_map(|(_, r)| *r) {
        argv.push(Value::Bytes(r.expect.clone().into()));
        argv.push(Value::Bytes(r.rep.clone().into()));
    }
    argv
}

/// Reads little-endian `f64`s that must each hold an integer from 0 to 2^53.
fn unpack_numbers(bytes: &[u8]) -> Result<Vec<u64>, String> {
    if !bytes.len().is_multiple_of(8) {
        return Err(format!("{} bytes of packed numbers", bytes.len()));
    }
    bytes
        .chunks_exact(8)
        .map(|c| {
            let x = f64::from_le_bytes(c.try_into().expect("8 bytes"));
            // The cast saturates (NaN to 0), so only an integer in range survives the round
            // trip; cheaper than `fract`, a libm call on baseline x86-64.
            let n = x as u64;
            if n <= crate::core::bucket::EXACT_LIMIT && n as f64 == x {
                Ok(n)
            } else {
                Err(format!("{x} is not a count from the script"))
            }
        })
        .collect()
}

/// Splits the script's answer to a call over `requests` requests into one answer per request
/// and the call's Redis time in microseconds (the script's last element, which a lean answer
/// does not carry itself).
///
/// Errors: not an array of `requests` answers and a time.
pub fn split_answers(value: Value, requests: usize) -> Result<(Vec<Value>, u64), String> {
    match value {
        Value::Array(mut answers) if answers.len() == requests + 1 => {
            let now = answers.pop().as_ref().map(int).transpose()?.unwrap_or_default();
            Ok((answers, now))
        }
        Value::Array(answers) => Err(format!(
            "the script answered {} of {requests} requests and the time",
            answers.len()
        )),
        other => Err(format!("expected an array from the script, got {other:?}")),
    }
}

/// The limits of a request that can take the lean form (`decide_lean` in `lua/decide.lua`):
/// every bucket a constant limit that refills (no schedule, quota, reload or allowance), every
/// demand a consume of at least one micro-token. `None` for any other request, which takes the
/// general form. Nearly every request Envoy sends is lean.
pub fn lean_limits<'a>(
    plans: impl Iterator<Item = &'a Plan>,
    demands: &[Demand],
) -> Option<smallvec::SmallVec<[Limit; 4]>> {
    // (No demand: nothing to decide, and -0 buckets would not read as the lean form.)
    if demands.is_empty()
        || !demands
            .iter()
            .all(|d| matches!(d.kind, DemandKind::Consume(n) if n > 0))
    {
        return None;
    }
    plans
        .map(|p| match p {
            Plan::Fixed(limit) if !limit.rate.is_zero() => Some(*limit),
            _ => None,
        })
        .collect()
}

/// One lean request's ARGV field (see `lua/decide.lua`, `decide_lean`): one string of
/// little-endian `f64`s: -#buckets (the sign tells the script the form), #demands; per bucket
/// capacity in µt and rate num, den; per demand instance (1-based), amount in µt, enforced.
pub fn encode_lean(limits: &[Limit], demands: &[Demand]) -> Vec<Value> {
    let mut packed = Vec::with_capacity(8 * (2 + limits.len() * 3 + demands.len() * 3));
    let mut put = |x: f64| packed.extend_from_slice(&x.to_le_bytes());
    put(-(limits.len() as f64));
    put(demands.len() as f64);
    for l in limits {
        put(l.capacity_ut as f64);
        put(l.rate.num() as f64);
        put(l.rate.den() as f64);
    }
    for d in demands {
        let amount = match d.kind {
            DemandKind::Consume(n) => n,
            _ => 0,
        };
        put((d.instance + 1) as f64);
        // As in the general form: capped at 2^53, which still fails every consume.
        put(amount.min(crate::core::bucket::EXACT_LIMIT) as f64);
        put(if d.enforced { 1.0 } else { 0.0 });
    }
    vec![Value::Bytes(packed.into())]
}

/// Whether a request's ARGV fields are in the lean form ([`encode_lean`]): one packed string
/// whose first number is negative.
pub fn is_lean(args: &[Value]) -> bool {
    match args {
        [Value::Bytes(packed)] => packed
            .get(..8)
            .is_some_and(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) < 0.0),
        _ => false,
    }
}

/// What the script answered a lean request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeanReply {
    /// Decided (and written, if admitted): each bucket's stored state before the decision,
    /// `None` where the key was absent (full at the call's time).
    Decided(smallvec::SmallVec<[Option<BucketState>; 4]>),
    /// A value the lean form cannot read: nothing was written; send the general form.
    General,
}

/// Parses the answer to a lean request of `buckets` buckets: `general`, or each bucket's 24
/// stored bytes (all 0xFF for an absent key), concatenated.
///
/// Errors: any other shape, or a value that does not read.
pub fn parse_lean(value: &Value, buckets: usize) -> Result<LeanReply, String> {
    let raw = match value {
        Value::Bytes(b) => &b[..],
        Value::String(s) => s.as_bytes(),
        other => return Err(format!("expected a string from the script, got {other:?}")),
    };
    if raw == b"general" {
        return Ok(LeanReply::General);
    }
    if raw.len() != buckets * VALUE_LEN {
        return Err(format!(
            "the script answered {} bytes for {buckets} lean buckets",
            raw.len()
        ));
    }
    raw.chunks_exact(VALUE_LEN)
        .map(|c| {
            if c.iter().all(|&b| b == 0xFF) {
                return Ok(None);
            }
            parse_value(c)
                .map(|(state, _)| Some(state))
                .ok_or_else(|| "the script answered a value it should not have read".to_string())
        })
        .collect::<Result<_, _>>()
        .map(LeanReply::Decided)
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
    /// Per bucket: stored, before, after, changed, lost (`consumed_ut` and `debited_ut` are
    /// filled in by the caller, from the demands).
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
        /// Per bucket, the instant its limit is wanted at: `now_us`, or the bucket's last write
        /// when Redis's clock reads before it (a clock that stepped back).
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

/// Parses a decision: packed doubles now, denied, passed per demand, then 8 per bucket (see
/// `lua/decide.lua`).
fn parse_decided(packed: &[u8], buckets: usize, demands: usize) -> Result<Decided, String> {
    let n = unpack_numbers(packed)?;
    if n.len() != 2 + demands + buckets * 8 {
        return Err(format!(
            "the script answered {} numbers for {buckets} buckets and {demands} demands",
            n.len()
        ));
    }
    let state = |t, u| BucketState {
        tokens_ut: t,
        updated_us: u,
    };
    Ok(Decided {
        now_us: n[0],
        denied: n[1] == 1,
        passed: n[2..2 + demands].iter().map(|&p| p == 1).collect(),
        instances: n[2 + demands..]
            .chunks_exact(8)
            .map(|c| InstanceOutcome {
                stored: state(c[0], c[1]),
                before: state(c[2], c[3]),
                after: state(c[4], c[5]),
                consumed_ut: 0,
                debited_ut: 0,
                lost_ut: c[7],
                changed: c[6] == 1,
            })
            .collect(),
    })
}

/// Parses the script's answer for one request of `buckets` buckets and `demands` demands: a
/// packed string is a decision, an array a `retry`, `walk` or `bad`.
///
/// Errors: any other shape, or numbers that do not fit.
pub fn parse_reply(value: Value, buckets: usize, demands: usize) -> Result<Reply, String> {
    let items = match value {
        Value::Bytes(packed) => return parse_decided(&packed, buckets, demands).map(Reply::Decided),
        Value::String(packed) => return parse_decided(packed.as_bytes(), buckets, demands).map(Reply::Decided),
        Value::Array(items) => items,
        other => return Err(format!("expected a string or an array from the script, got {other:?}")),
    };
    let tag = items.first().map(text).transpose()?.unwrap_or_default();
    // Every answer but a decision (a packed string) has Redis time second.
    let now = || -> Result<u64, String> {
        items
            .get(1)
            .map(int)
            .transpose()?
            .ok_or_else(|| "the script's answer has no time".to_string())
    };
    match tag {
        b"retry" => {
            let now_us = now()?;
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
            let now_us = now()?;
            let reason = items.get(2).map(text).transpose()?.unwrap_or_default();
            Ok(Reply::Bad {
                now_us,
                reason: String::from_utf8_lossy(reason).into_owned(),
            })
        }
        b"walk" => {
            let now_us = now()?;
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
        other => Err(format!(
            "unexpected answer {:?} from the script",
            String::from_utf8_lossy(other)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bucket::{Rate, MICRO};

    fn doubles(numbers: &[f64]) -> Vec<u8> {
        numbers.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn values_are_three_doubles_or_the_earlier_text() {
        let want = Some((
            BucketState {
                tokens_ut: 5,
                updated_us: 17,
            },
            9,
        ));
        assert_eq!(parse_value(&doubles(&[5.0, 17.0, 9.0])), want);
        assert_eq!(parse_value(b"5:17:9"), want);
        // A text value of exactly 24 bytes is still text.
        let text24 = b"12345:1764489600123456:0";
        assert_eq!(text24.len(), VALUE_LEN);
        assert_eq!(
            parse_value(text24),
            Some((
                BucketState {
                    tokens_ut: 12345,
                    updated_us: 1_764_489_600_123_456
                },
                0
            ))
        );
        for bad in [
            Vec::new(),
            doubles(&[5.0, 17.0]),
            doubles(&[5.0, 17.0, 9.0, 1.0]),
            doubles(&[-1.0, 17.0, 9.0]),
            doubles(&[5.5, 17.0, 9.0]),
            doubles(&[5.0, f64::NAN, 9.0]),
            doubles(&[5.0, 17.0, f64::INFINITY]),
            doubles(&[5.0, 17.0, 2f64.powi(54)]),
            b"5:17".to_vec(),
            b"5:17:9:1".to_vec(),
            b"-5:17:9".to_vec(),
            b"+5:17:9".to_vec(),
            b"5::9".to_vec(),
            b"99999999999999999999:1:1".to_vec(),
        ] {
            assert_eq!(parse_value(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_fixed_limit_is_unbounded_in_time() {
        let limit = Limit::new(10, Rate::per(10, 60_000_000).unwrap());
        let args = bucket_args(&Plan::Fixed(limit), 1_700_000_000_000_000);
        assert_eq!((args.kind, args.lo, args.hi, args.bound), (b'F', 0, 0, 0));
    }

    fn packed(numbers: &[f64]) -> Value {
        Value::Bytes(numbers.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>().into())
    }

    #[test]
    fn replies_are_checked() {
        // now 100, not denied, demand passed, then stored 5@1, before 5@100, after 4@100, changed,
        // nothing lost.
        let ok = packed(&[100.0, 0.0, 1.0, 5.0, 1.0, 5.0, 100.0, 4.0, 100.0, 1.0, 0.0]);
        let Reply::Decided(d) = parse_reply(ok.clone(), 1, 1).unwrap() else {
            panic!("decided")
        };
        assert!(!d.denied);
        assert_eq!(d.passed, vec![true]);
        assert_eq!(d.instances[0].after.tokens_ut, 4);
        assert!(d.instances[0].changed);
        assert!(parse_reply(ok, 2, 1).is_err());
        for bad_numbers in [
            &[100.0, 0.0, 1.0, 5.0, 1.0, 5.0, 100.0, 4.0, 100.0, 1.0, -1.0][..],
            &[0.5; 11],
        ] {
            let bad = packed(bad_numbers);
            assert!(parse_reply(bad, 1, 1).is_err(), "{bad_numbers:?}");
        }
        let torn = Value::Bytes(vec![0u8; 87].into());
        assert!(parse_reply(torn, 1, 1).is_err());
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

    /// A reloaded limit holds from the reload on (earlier Redis time asks again) and makes the
    /// script send back values written before the reload; before it, the old limit holds up to
    /// the reload.
    #[test]
    fn a_reloaded_limit_holds_from_the_reload_and_walks_older_values() {
        let old = Plan::Fixed(Limit::new(10, Rate::per(1, 1_000_000).unwrap()));
        let new = Plan::Fixed(Limit::new(10, Rate::per(10, 1_000_000).unwrap()));
        let at = 1_700_000_000_000_000;
        let plan = Plan::after_reload(&old, new.clone(), at);
        let after = bucket_args(&plan, at + 5);
        assert_eq!((after.kind, after.lo, after.hi, after.since), (b'F', at, 0, at));
        assert_eq!(after.limit, new.limit_at(at));
        let before = bucket_args(&plan, at - 5);
        assert_eq!((before.kind, before.lo, before.hi, before.since), (b'F', 0, at, 0));
        assert_eq!(before.limit, old.limit_at(at));
        let packed = encode_request(&[(after, None)], &[]);
        let numbers = unpack_numbers(packed[0].as_bytes().unwrap()).unwrap();
        assert_eq!(numbers[3 + 8], at, "since is the ninth number of a bucket");
        // A value written 10 s before the reload, empty: 10 tokens at the old 1/s by the reload.
        let raw = [0.0f64, (at - 10_000_000) as f64, 0.0]
            .iter()
            .flat_map(|n| n.to_le_bytes())
            .collect::<Vec<u8>>();
        let rep = replacement(&plan, &raw, at + 1_000).unwrap();
        assert_eq!(rep.rep, doubles(&[10_000_000.0, at as f64]));
        assert_eq!(replacement(&old, &raw, at), None, "a constant limit is never walked");
    }

    #[test]
    fn a_call_is_a_header_then_each_request() {
        let settings = CallSettings {
            ttl_margin_ms: 1000,
            unknown_ttl_ms: 5000,
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
        assert_eq!(fields.len(), 1, "no replacements: one packed string");
        let numbers = unpack_numbers(fields[0].as_bytes().unwrap()).unwrap();
        assert_eq!(numbers.len(), 3 + 2 * 9 + 2 * 5);
        assert_eq!(&numbers[..4], &[2, 2, 0, 1], "2 buckets, 2 demands, no replacement, F");
        assert_eq!(&numbers[4..7], &[10 * MICRO, limit.rate.num(), limit.rate.den()]);
        // The first demand: bucket 2 (1-based), consume 3 µt, enforced, no debt threshold; then
        // a check.
        assert_eq!(&numbers[21..], &[2, 1, 3, 1, 0, 1, 2, 0, 0, 0]);
        // Usage reports and debt checks carry the micro-tokens the bucket must hold to pass.
        let debt = [
            Demand {
                instance: 0,
                kind: DemandKind::Debit {
                    amount_ut: 7,
                    depth_ut: 1000,
                },
                enforced: true,
            },
            Demand {
                instance: 0,
                kind: DemandKind::DebtCheck { depth_ut: 1000 },
                enforced: true,
            },
        ];
        let numbers = unpack_numbers(encode_request(&[(args, None)], &debt)[0].as_bytes().unwrap()).unwrap();
        assert_eq!(&numbers[12..], &[1, 4, 7, 1, 1001, 1, 5, 0, 1, 1001]);

        let rep = Replacement {
            expect: doubles(&[1.0, 2.0, 3.0]),
            rep: doubles(&[4.0, 5.0]),
        };
        let fields = encode_request(&[(args, None), (args, Some(&rep))], &demands[..1]);
        assert_eq!(
            &fields[1..],
            &[
                Value::Bytes(rep.expect.clone().into()),
                Value::Bytes(rep.rep.clone().into())
            ]
        );
        let numbers = unpack_numbers(fields[0].as_bytes().unwrap()).unwrap();
        assert_eq!((numbers[2], numbers[3 + 7], numbers[3 + 9 + 7]), (1, 0, 1));
        // Amounts past 2^53 µt are sent as 2^53, which Lua holds exactly.
        let huge = [Demand {
            instance: 0,
            kind: DemandKind::Consume(u64::MAX),
            enforced: true,
        }];
        let numbers = unpack_numbers(encode_request(&[(args, None)], &huge)[0].as_bytes().unwrap()).unwrap();
        assert_eq!(numbers[3 + 9 + 2], crate::core::bucket::EXACT_LIMIT);
    }

    #[test]
    fn only_plain_token_buckets_and_consumes_are_lean() {
        let limit = Limit::new(10, Rate::per(10, 1_000_000).unwrap());
        let consume = |n| Demand {
            instance: 0,
            kind: DemandKind::Consume(n),
            enforced: true,
        };
        let fixed = [Plan::Fixed(limit)];
        assert_eq!(
            lean_limits(fixed.iter(), &[consume(MICRO)]).unwrap().as_slice(),
            &[limit]
        );
        // A check (hits_addend 0) is not a consume of at least one micro-token.
        assert!(lean_limits(fixed.iter(), &[consume(0)]).is_none());
        let check = Demand {
            kind: DemandKind::Check,
            ..consume(0)
        };
        assert!(lean_limits(fixed.iter(), &[check]).is_none());
        let refund = Demand {
            kind: DemandKind::Refund(MICRO),
            ..consume(0)
        };
        assert!(lean_limits(fixed.iter(), &[refund]).is_none());
        // An allowance that never refills has no fill time to expire by.
        let allowance = [Plan::Fixed(Limit::new(10, Rate::ZERO))];
        assert!(lean_limits(allowance.iter(), &[consume(MICRO)]).is_none());
        // No bucket and no demand: -0 buckets would read as the general form.
        assert!(lean_limits(std::iter::empty(), &[]).is_none());
    }

    #[test]
    fn a_lean_request_packs_its_limits_and_demands() {
        let slow = Limit::new(10, Rate::per(10, 60_000_000).unwrap());
        let fast = Limit::new(5, Rate::per(5, 1_000_000).unwrap());
        let demands = [
            Demand {
                instance: 1,
                kind: DemandKind::Consume(2 * MICRO),
                enforced: false,
            },
            Demand {
                instance: 0,
                kind: DemandKind::Consume(u64::MAX),
                enforced: true,
            },
        ];
        let argv = encode_lean(&[slow, fast], &demands);
        assert_eq!(argv.len(), 1);
        let numbers: Vec<f64> = argv[0]
            .as_bytes()
            .unwrap()
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let (num, den) = (slow.rate.num() as f64, slow.rate.den() as f64);
        assert_eq!(
            numbers,
            vec![
                -2.0,
                2.0,
                10e6,
                num,
                den,
                5e6,
                fast.rate.num() as f64,
                fast.rate.den() as f64,
                2.0,
                2e6,
                0.0,
                1.0,
                crate::core::bucket::EXACT_LIMIT as f64,
                1.0
            ]
        );
    }

    #[test]
    fn lean_answers_are_stored_values_or_absent() {
        let absent = vec![0xFF; VALUE_LEN];
        let stored = doubles(&[5.0, 17.0, 0.0]);
        let both = Value::Bytes([stored.clone(), absent.clone()].concat().into());
        assert_eq!(
            parse_lean(&both, 2).unwrap(),
            LeanReply::Decided(smallvec::smallvec![
                Some(BucketState {
                    tokens_ut: 5,
                    updated_us: 17
                }),
                None
            ])
        );
        assert_eq!(parse_lean(&Value::from("general"), 2).unwrap(), LeanReply::General);
        assert!(parse_lean(&both, 1).is_err(), "a length that is not the buckets'");
        let invalid = Value::Bytes(doubles(&[-1.0, 17.0, 0.0]).into());
        assert!(parse_lean(&invalid, 1).is_err());
        assert!(parse_lean(&Value::Integer(1), 1).is_err());
    }

    #[test]
    fn answers_are_split_per_request() {
        // Two answers, then the call's time.
        let two = Value::Array(vec![Value::Integer(1), Value::Integer(2), Value::Integer(9)]);
        assert_eq!(
            split_answers(two.clone(), 2).unwrap(),
            (vec![Value::Integer(1), Value::Integer(2)], 9)
        );
        assert!(split_answers(two.clone(), 3).is_err());
        assert!(split_answers(two, 1).is_err());
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
