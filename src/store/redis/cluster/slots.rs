//! The slot map of a Redis Cluster: which master serves each of the 16384 slots, read from
//! `CLUSTER SLOTS`, and which slots are lost while masters fail (for readiness and the
//! metrics). Pure: no I/O.

use std::fmt;

use fred::types::Value;

/// The number of Redis Cluster slots.
pub(crate) const SLOTS: usize = 16384;

/// A node's address as the cluster announces it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Addr {
    /// The host (an IP address or a name).
    pub(crate) host: String,
    /// The port.
    pub(crate) port: u16,
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// One row of `CLUSTER SLOTS`: the slots `start..=end`, their master and its replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) start: u16,
    pub(crate) end: u16,
    pub(crate) master: Addr,
    pub(crate) replicas: Vec<Addr>,
}

/// Reads an answer to `CLUSTER SLOTS` (RESP2 or RESP3: arrays either way). A node's host may be
/// empty or `?` ("the node you asked", as Redis writes it for itself when it knows no address):
/// `answering` stands in for it.
///
/// Errors: an answer of another shape (a sentence saying what was wrong).
pub(crate) fn parse_cluster_slots(value: &Value, answering: &str) -> Result<Vec<Range>, String> {
    let Value::Array(rows) = value else {
        return Err(format!("CLUSTER SLOTS answered {value:?}"));
    };
    let node = |v: &Value| -> Result<Addr, String> {
        let Value::Array(fields) = v else {
            return Err(format!("a node of CLUSTER SLOTS is {v:?}"));
        };
        let host = fields.first().and_then(Value::as_string).unwrap_or_default();
        let port = fields
            .get(1)
            .and_then(Value::as_i64)
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| format!("a node of CLUSTER SLOTS has no port: {fields:?}"))?;
        let host = if host.is_empty() || host == "?" {
            answering.to_string()
        } else {
            host
        };
        Ok(Addr { host, port })
    };
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let Value::Array(fields) = row else {
            return Err(format!("a row of CLUSTER SLOTS is {row:?}"));
        };
        let slot = |i: usize| {
            fields
                .get(i)
                .and_then(Value::as_i64)
                .and_then(|s| u16::try_from(s).ok())
                .filter(|&s| usize::from(s) < SLOTS)
                .ok_or_else(|| format!("a row of CLUSTER SLOTS has no slot range: {fields:?}"))
        };
        let (start, end) = (slot(0)?, slot(1)?);
        if start > end {
            return Err(format!("CLUSTER SLOTS has the range {start}-{end}"));
        }
        let master = node(fields.get(2).ok_or("a row of CLUSTER SLOTS has no master")?)?;
        let replicas = fields[3..].iter().map(node).collect::<Result<Vec<_>, _>>()?;
        out.push(Range {
            start,
            end,
            master,
            replicas,
        });
    }
    out.sort_by_key(|r| r.start);
    Ok(out)
}

/// Who serves each slot: a master's index into [`SlotMap::masters`], or none (a slot no master
/// serves, as `CLUSTER SLOTS` leaves out while its master has failed and has no replica to
/// promote).
pub(crate) struct SlotMap {
    masters: Vec<Addr>,
    replicas: Vec<Addr>,
    /// Per slot, the index of its master, or [`NONE`].
    owner: Box<[u16]>,
}

const NONE: u16 = u16::MAX;

impl SlotMap {
    /// The map of `ranges` (a later row wins a slot two rows claim). Masters are ordered by
    /// their first slot, so an index names the same shard across refreshes while slots do not
    /// move.
    pub(crate) fn new(ranges: &[Range]) -> SlotMap {
        let mut firsts: Vec<(u16, Addr)> = Vec::new();
        for r in ranges {
            match firsts.iter_mut().find(|(_, a)| *a == r.master) {
                Some((first, _)) => *first = (*first).min(r.start),
                None => firsts.push((r.start, r.master.clone())),
            }
        }
        firsts.sort();
        let masters: Vec<Addr> = firsts.into_iter().map(|(_, a)| a).collect();
        let mut owner = vec![NONE; SLOTS].into_boxed_slice();
        for r in ranges {
            let i = masters.iter().position(|a| *a == r.master).unwrap_or(0);
            let i = u16::try_from(i).unwrap_or(NONE);
            owner[usize::from(r.start)..=usize::from(r.end)].fill(i);
        }
        let mut replicas: Vec<Addr> = ranges.iter().flat_map(|r| r.replicas.iter().cloned()).collect();
        replicas.sort();
        replicas.dedup();
        SlotMap {
            masters,
            replicas,
            owner,
        }
    }

    /// The master of `slot`, as an index into [`SlotMap::masters`].
    pub(crate) fn owner(&self, slot: u16) -> Option<usize> {
        match self.owner.get(usize::from(slot)).copied() {
            None | Some(NONE) => None,
            Some(i) => Some(usize::from(i)),
        }
    }

    /// The masters, ordered by their first slot.
    pub(crate) fn masters(&self) -> &[Addr] {
        &self.masters
    }

    /// Every replica the map names.
    pub(crate) fn replicas(&self) -> &[Addr] {
        &self.replicas
    }

    /// The first slot master `i` serves: a label for it that names no address and stays the
    /// same when a replica takes over its slots.
    pub(crate) fn first_slot(&self, i: usize) -> Option<u16> {
        self.ranges_where(|m| m == Some(i)).first().map(|&(a, _)| a)
    }

    /// The slots lost while the masters `failing` says fail (indexed as [`SlotMap::masters`]),
    /// and those no master serves, as ranges.
    pub(crate) fn lost(&self, failing: &[bool]) -> Vec<(u16, u16)> {
        self.ranges_where(|m| m.is_none_or(|i| failing.get(i).copied().unwrap_or(true)))
    }

    /// The slot ranges of master `i`.
    pub(crate) fn ranges_of(&self, i: usize) -> Vec<(u16, u16)> {
        self.ranges_where(|m| m == Some(i))
    }

    /// Maximal ranges of slots whose owner satisfies `pred`.
    fn ranges_where(&self, pred: impl Fn(Option<usize>) -> bool) -> Vec<(u16, u16)> {
        let mut out: Vec<(u16, u16)> = Vec::new();
        for slot in 0..SLOTS as u16 {
            if !pred(self.owner(slot)) {
                continue;
            }
            match out.last_mut() {
                Some((_, end)) if *end + 1 == slot => *end = slot,
                _ => out.push((slot, slot)),
            }
        }
        out
    }
}

/// How many slots `ranges` cover.
pub(crate) fn count(ranges: &[(u16, u16)]) -> usize {
    ranges.iter().map(|&(a, b)| usize::from(b - a) + 1).sum()
}

/// `ranges` for a person: `0-5460, 10923`, at most four ranges then how many more.
pub(crate) fn describe(ranges: &[(u16, u16)]) -> String {
    let mut parts: Vec<String> = ranges
        .iter()
        .take(4)
        .map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
        .collect();
    if ranges.len() > 4 {
        parts.push(format!("and {} more ranges", ranges.len() - 4));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: &str, port: i64, id: &str) -> Value {
        Value::Array(vec![host.into(), Value::Integer(port), id.into(), Value::Array(vec![])])
    }

    fn row(start: i64, end: i64, nodes: Vec<Value>) -> Value {
        let mut fields = vec![Value::Integer(start), Value::Integer(end)];
        fields.extend(nodes);
        Value::Array(fields)
    }

    fn addr(port: u16) -> Addr {
        Addr {
            host: "10.0.0.1".into(),
            port,
        }
    }

    #[test]
    fn cluster_slots_is_read_with_replicas_and_unknown_hosts() {
        let answer = Value::Array(vec![
            row(
                5461,
                10922,
                vec![node("10.0.0.1", 7001, "b"), node("10.0.0.1", 7004, "e")],
            ),
            row(0, 5460, vec![node("", 7000, "a"), node("?", 7003, "d")]),
            row(10923, 16383, vec![node("10.0.0.1", 7002, "c")]),
        ]);
        let ranges = parse_cluster_slots(&answer, "10.0.0.1").unwrap();
        assert_eq!(ranges.len(), 3);
        assert_eq!((ranges[0].start, ranges[0].end), (0, 5460));
        assert_eq!(ranges[0].master, addr(7000));
        assert_eq!(ranges[0].replicas, vec![addr(7003)]);
        let map = SlotMap::new(&ranges);
        assert_eq!(map.masters(), &[addr(7000), addr(7001), addr(7002)]);
        assert_eq!(map.replicas(), &[addr(7003), addr(7004)]);
        assert_eq!(map.owner(0), Some(0));
        assert_eq!(map.owner(5461), Some(1));
        assert_eq!(map.owner(16383), Some(2));
        assert_eq!(map.first_slot(2), Some(10923));
        assert_eq!(map.ranges_of(1), vec![(5461, 10922)]);
    }

    #[test]
    fn answers_of_another_shape_are_errors() {
        for bad in [
            Value::Null,
            Value::Array(vec![Value::Integer(1)]),
            Value::Array(vec![row(0, 16384, vec![node("h", 1, "a")])]),
            Value::Array(vec![row(10, 5, vec![node("h", 1, "a")])]),
            Value::Array(vec![row(0, 5, vec![])]),
            Value::Array(vec![row(0, 5, vec![Value::Array(vec!["h".into()])])]),
        ] {
            assert!(parse_cluster_slots(&bad, "h").is_err(), "{bad:?}");
        }
    }

    /// A failing master loses its slots; slots no row names (a master failed without a
    /// replica) are lost too; ranges merge across masters.
    #[test]
    fn lost_slots_are_the_failing_masters_and_the_unserved() {
        let ranges = vec![
            Range {
                start: 0,
                end: 99,
                master: addr(1),
                replicas: vec![],
            },
            Range {
                start: 100,
                end: 199,
                master: addr(2),
                replicas: vec![],
            },
            Range {
                start: 300,
                end: 16383,
                master: addr(3),
                replicas: vec![],
            },
        ];
        let map = SlotMap::new(&ranges);
        assert_eq!(map.lost(&[false, false, false]), vec![(200, 299)]);
        assert_eq!(map.lost(&[false, true, false]), vec![(100, 299)]);
        assert_eq!(count(&map.lost(&[true, true, false])), 300);
        assert_eq!(describe(&map.lost(&[true, false, false])), "0-99, 200-299");
        assert_eq!(
            describe(&[(1, 1), (3, 4), (6, 6), (8, 8), (10, 10), (12, 12)]),
            "1, 3-4, 6, 8, and 2 more ranges"
        );
        assert_eq!(map.owner(250), None);
    }
}
