//! What the in-process maps (the memory store's buckets, the local layer's over-limit cache
//! and leases) key an instance by: a 128-bit keyed hash of its instance key, so that an entry
//! costs the same few bytes however long the descriptor values are, and a lookup reads no
//! other memory.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// An instance key as stored and looked up: its 128-bit SipHash-1-3 under a random 128-bit key
/// drawn when the map is made ([`Digester`]). By chance, two of `n` keys collide with
/// probability about `n^2 / 2^129`; by design, a client that does not know the hash key cannot
/// make its key collide with another's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Digest(pub(crate) [u64; 2]);

impl std::hash::Hash for Digest {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // The second half: the first picks the shard, so within a shard it is not uniform.
        state.write_u64(self.0[1]);
    }
}

impl Digest {
    /// The shard of `shards` this digest lives in: from the first half (the map hashes the
    /// second).
    #[inline]
    pub(crate) fn shard(&self, shards: usize) -> usize {
        ((u128::from(self.0[0]) * shards as u128) >> 64) as usize
    }
}

/// Hashes a [`Digest`] as the one `u64` it writes, unchanged.
#[derive(Clone, Copy, Default)]
pub(crate) struct DigestHash;

impl BuildHasher for DigestHash {
    type Hasher = PassThrough;
    fn build_hasher(&self) -> PassThrough {
        PassThrough(0)
    }
}

/// See [`DigestHash`].
pub(crate) struct PassThrough(u64);

impl std::hash::Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (by `Digest`); fold anything else in rather than drop it.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Makes [`Digest`]s under a hash key of its own, drawn at random when it is made.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Digester {
    key: [u8; 16],
}

impl Digester {
    /// A digester with a fresh random hash key, from the operating system's generator (through
    /// std's `RandomState`, whose keys come from it: two outputs of one keyed hash over
    /// different inputs are as good as fresh random bits to anyone who does not know its key).
    pub(crate) fn random() -> Digester {
        let state = RandomState::new();
        let mut key = [0; 16];
        key[..8].copy_from_slice(&state.hash_one(0u8).to_le_bytes());
        key[8..].copy_from_slice(&state.hash_one(1u8).to_le_bytes());
        Digester { key }
    }

    /// The digest of instance key `key`.
    #[inline]
    pub(crate) fn digest(&self, key: &str) -> Digest {
        use std::hash::Hasher;
        let mut hasher = siphasher::sip128::SipHasher13::new_with_key(&self.key);
        hasher.write(key.as_bytes());
        let h = siphasher::sip128::Hasher128::finish128(&hasher);
        Digest([h.h1, h.h2])
    }
}
