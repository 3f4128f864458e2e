//! The Redis script's calling convention (`store/redis/script.rs`), pure: what tollgate packs
//! for `lua/decide.lua` read back by the script's layout (three counts, then 9 numbers per
//! bucket and 4 per demand, little-endian doubles, then two strings per replacement), stored
//! values and replacements packed and parsed back, decisions packed as the script packs them
//! and parsed back; and the parsers on arbitrary bytes and arbitrary answers never panic and
//! accept only counts a double holds exactly.
#![no_main]

use arbitrary::Arbitrary;
use fred::types::Value;
use libfuzzer_sys::fuzz_target;
use tollgate::core::bucket::{BucketState, Demand, DemandKind, InstanceOutcome, Limit, Rate, EXACT_LIMIT};
use tollgate::store::redis::script::{
    encode_request, parse_reply, parse_value, split_answers, BucketArgs, Decided, Replacement, Reply, VALUE_LEN,
};

#[derive(Arbitrary, Debug)]
enum Answer {
    Bytes(Vec<u8>),
    Text(String),
    Integer(i64),
    Array(Vec<Item>),
}

#[derive(Arbitrary, Debug)]
enum Item {
    Integer(i64),
    Text(String),
    Bytes(Vec<u8>),
    Tag(u8),
}

#[derive(Arbitrary, Debug)]
struct Bucket {
    kind: u8,
    capacity_ut: u64,
    tokens: u32,
    period_us: u32,
    lo: u64,
    hi: u64,
    bound: u64,
    since: u64,
    replacement: Option<(Vec<u8>, Vec<u8>)>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    raw: Vec<u8>,
    answer: Answer,
    buckets_n: u8,
    demands_n: u8,
    state: (u64, u64, u64),
    buckets: Vec<Bucket>,
    demands: Vec<(u8, u8, u64, bool)>,
    decided: (u64, bool, Vec<bool>, Vec<[u64; 6]>, Vec<bool>),
}

fn value(a: &Answer) -> Value {
    match a {
        Answer::Bytes(b) => Value::Bytes(b.clone().into()),
        Answer::Text(s) => Value::String(s.clone().into()),
        Answer::Integer(n) => Value::Integer(*n),
        Answer::Array(items) => Value::Array(
            items
                .iter()
                .map(|i| match i {
                    Item::Integer(n) => Value::Integer(*n),
                    Item::Text(s) => Value::String(s.clone().into()),
                    Item::Bytes(b) => Value::Bytes(b.clone().into()),
                    Item::Tag(t) => Value::String(["retry", "walk", "bad"][usize::from(*t) % 3].into()),
                })
                .collect(),
        ),
    }
}

fn doubles(numbers: &[u64]) -> Vec<u8> {
    numbers.iter().flat_map(|&n| (n as f64).to_le_bytes()).collect()
}

/// Reads the packed doubles as `lua/decide.lua` does (`struct.unpack('<d')`), as integers.
fn read(bytes: &[u8]) -> Vec<u64> {
    assert_eq!(bytes.len() % 8, 0, "packed numbers are whole doubles");
    bytes
        .chunks_exact(8)
        .map(|c| {
            let x = f64::from_le_bytes(c.try_into().unwrap());
            assert!(
                x >= 0.0 && x <= EXACT_LIMIT as f64 && x.fract() == 0.0,
                "{x} is not exact"
            );
            x as u64
        })
        .collect()
}

fn clamp(n: u64) -> u64 {
    n.min(EXACT_LIMIT)
}

fuzz_target!(|input: Input| {
    // Parsers on anything: no panic, and only exact counts.
    if let Some((state, end)) = parse_value(&input.raw) {
        for n in [state.tokens_ut, state.updated_us, end] {
            assert!(n <= EXACT_LIMIT, "{n} accepted from {:?}", input.raw);
        }
        assert_eq!(
            parse_value(&doubles(&[state.tokens_ut, state.updated_us, end])),
            Some((state, end))
        );
    }
    let _ = parse_reply(
        value(&input.answer),
        usize::from(input.buckets_n),
        usize::from(input.demands_n),
    );
    let _ = split_answers(value(&input.answer), usize::from(input.buckets_n));

    // Stored values: both forms round-trip.
    let (t, u, e) = (clamp(input.state.0), clamp(input.state.1), clamp(input.state.2));
    let want = Some((
        BucketState {
            tokens_ut: t,
            updated_us: u,
        },
        e,
    ));
    let packed = doubles(&[t, u, e]);
    assert_eq!(packed.len(), VALUE_LEN);
    assert_eq!(parse_value(&packed), want);
    assert_eq!(parse_value(format!("{t}:{u}:{e}").as_bytes()), want);

    // A request's fields, read back by the script's layout.
    let buckets: Vec<(BucketArgs, Option<Replacement>)> = input
        .buckets
        .iter()
        .take(16)
        .filter_map(|b| {
            let rate = Rate::per(u64::from(b.tokens), u64::from(b.period_us.max(1))).ok()?;
            let args = BucketArgs {
                kind: [b'F', b'S', b'Q', b'D', b'E'][usize::from(b.kind) % 5],
                limit: Limit {
                    capacity_ut: b.capacity_ut,
                    rate,
                },
                lo: b.lo,
                hi: b.hi,
                bound: b.bound,
                since: b.since,
            };
            let rep = b.replacement.clone().map(|(expect, rep)| Replacement { expect, rep });
            Some((args, rep))
        })
        .collect();
    if buckets.is_empty() {
        return;
    }
    let demands: Vec<Demand> = input
        .demands
        .iter()
        .take(16)
        .map(|&(i, k, n, enforced)| Demand {
            instance: usize::from(i) % buckets.len(),
            kind: match k % 5 {
                0 => DemandKind::Consume(n),
                1 => DemandKind::Check,
                2 => DemandKind::Refund(n),
                3 => DemandKind::Debit {
                    amount_ut: n,
                    depth_ut: n / 3,
                },
                _ => DemandKind::DebtCheck { depth_ut: n / 3 },
            },
            enforced,
        })
        .collect();
    let refs: Vec<(BucketArgs, Option<&Replacement>)> = buckets.iter().map(|(a, r)| (*a, r.as_ref())).collect();
    let argv = encode_request(&refs, &demands);
    let f = read(argv[0].as_bytes().expect("a packed string"));
    let (nb, nd, nrep) = (f[0] as usize, f[1] as usize, f[2] as usize);
    assert_eq!((nb, nd), (buckets.len(), demands.len()));
    assert_eq!(f.len(), 3 + nb * 9 + nd * 5);
    assert_eq!(argv.len(), 1 + 2 * nrep);
    let mut reps = argv[1..].chunks_exact(2);
    for (i, (args, rep)) in buckets.iter().enumerate() {
        let o = 3 + i * 9;
        let kind = match args.kind {
            b'F' => 1,
            b'S' => 2,
            b'D' => 4,
            b'E' => 5,
            _ => 3,
        };
        let want = [
            kind,
            clamp(args.limit.capacity_ut),
            args.limit.rate.num(),
            args.limit.rate.den(),
            clamp(args.lo),
            clamp(args.hi),
            clamp(args.bound),
            u64::from(rep.is_some()),
            clamp(args.since),
        ];
        assert_eq!(&f[o..o + 9], &want, "bucket {i}");
        if let Some(rep) = rep {
            let pair = reps.next().expect("a replacement's strings");
            assert_eq!(pair[0].as_bytes(), Some(&rep.expect[..]));
            assert_eq!(pair[1].as_bytes(), Some(&rep.rep[..]));
        }
    }
    assert!(reps.next().is_none(), "strings for replacements that are not there");
    for (j, d) in demands.iter().enumerate() {
        let o = 3 + nb * 9 + j * 5;
        let (kind, n, need) = match d.kind {
            DemandKind::Consume(n) => (1, clamp(n), 0),
            DemandKind::Check => (2, 0, 0),
            DemandKind::Refund(n) => (3, clamp(n), 0),
            DemandKind::Debit { amount_ut, depth_ut } => (4, clamp(amount_ut), clamp(depth_ut.saturating_add(1))),
            DemandKind::DebtCheck { depth_ut } => (5, 0, clamp(depth_ut.saturating_add(1))),
        };
        assert_eq!(
            &f[o..o + 5],
            &[d.instance as u64 + 1, kind, n, u64::from(d.enforced), need],
            "demand {j}"
        );
    }

    // A decision packed as the script packs it: now, denied, passed per demand, 8 per bucket.
    let (now_us, denied, passed, states, changed) = &input.decided;
    let nb = states.len().min(changed.len()).min(16);
    let nd = passed.len().min(16);
    let mut numbers = vec![clamp(*now_us), u64::from(*denied)];
    numbers.extend(passed[..nd].iter().map(|&p| u64::from(p)));
    let mut instances = Vec::new();
    for (s, &c) in states[..nb].iter().zip(&changed[..nb]) {
        let s = s.map(clamp);
        numbers.extend_from_slice(&s);
        numbers.push(u64::from(c));
        // What the bucket's reports lost, any count the script can send.
        let lost = s[4] / 3;
        numbers.push(lost);
        let state = |t, u| BucketState {
            tokens_ut: t,
            updated_us: u,
        };
        instances.push(InstanceOutcome {
            stored: state(s[0], s[1]),
            before: state(s[2], s[3]),
            after: state(s[4], s[5]),
            consumed_ut: 0,
            debited_ut: 0,
            lost_ut: lost,
            changed: c,
        });
    }
    let want = Reply::Decided(Decided {
        now_us: clamp(*now_us),
        denied: *denied,
        passed: passed[..nd].to_vec(),
        instances,
    });
    assert_eq!(parse_reply(Value::Bytes(doubles(&numbers).into()), nb, nd), Ok(want));
});
