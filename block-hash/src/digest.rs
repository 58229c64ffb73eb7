//! An order-free digest of a set of block hashes.
//!
//! A worker and a router that follows its KV events each keep one over the
//! blocks the worker caches: the worker from its prefix cache, the router
//! from the events it applied. The worker sends its digest now and then;
//! when the router's differs, an event was lost, duplicated or reordered
//! on the way, and the router resyncs that worker. XOR of a mixed hash
//! makes insert and remove the same O(1) toggle, independent of order, and
//! the count catches what XOR alone cannot (a hash added twice cancels).

use crate::BlockHash;

/// Count and XOR of the (mixed) hashes of a set of blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SetDigest {
    /// Blocks in the set.
    pub blocks: u64,
    /// XOR of [`mix`] of every block's hash.
    pub xor: u64,
}

impl SetDigest {
    /// Records that `hash` joined the set (call once per new member).
    pub fn insert(&mut self, hash: BlockHash) {
        self.blocks = self.blocks.wrapping_add(1);
        self.xor ^= mix(hash);
    }

    /// Records that `hash` left the set (call once per member removed).
    pub fn remove(&mut self, hash: BlockHash) {
        self.blocks = self.blocks.wrapping_sub(1);
        self.xor ^= mix(hash);
    }

    /// The digest of two disjoint sets' union.
    pub fn combined(self, other: Self) -> Self {
        Self {
            blocks: self.blocks.wrapping_add(other.blocks),
            xor: self.xor ^ other.xor,
        }
    }

    /// The digest of `hashes`, taken as a set of distinct members.
    pub fn of(hashes: impl IntoIterator<Item = BlockHash>) -> Self {
        let mut d = Self::default();
        for h in hashes {
            d.insert(h);
        }
        d
    }
}

/// What a block on a worker's disk tier counts as in the worker's digest:
/// its hash XOR this, so one block in both the pool and the disk tier
/// counts twice instead of cancelling out. The digest a worker sends covers
/// both tiers ([`SetDigest::combined`]).
pub const DISK_TIER_SALT: u64 = 0x6469_736b_7469_6572;

/// SplitMix64's finalizer: block hashes are already xxh3 output, but the
/// digest must not depend on that (a fuzzer's or a test's hashes are small
/// integers, whose plain XOR cancels easily).
fn mix(h: BlockHash) -> u64 {
    let mut z = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_depends_on_the_set_not_the_order() {
        let a = SetDigest::of([1, 2, 3]);
        let mut b = SetDigest::of([3, 1]);
        assert_ne!(a, b);
        b.insert(2);
        assert_eq!(a, b);
        b.remove(2);
        assert_eq!(b, SetDigest::of([1, 3]));
        b.remove(1);
        b.remove(3);
        assert_eq!(b, SetDigest::default());
    }

    #[test]
    fn a_lost_or_duplicated_member_shows() {
        let truth = SetDigest::of([10, 11, 12]);
        assert_ne!(SetDigest::of([10, 12]), truth, "one lost");
        assert_ne!(SetDigest::of([10, 11, 12, 12]), truth, "one twice");
        assert_ne!(SetDigest::of([10, 11, 13]), truth, "one replaced");
    }
}
