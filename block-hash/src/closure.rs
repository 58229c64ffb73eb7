//! Whether a set of chained blocks is *prefix-closed*: every member's
//! parent is a member too (or [`ROOT`]).
//!
//! A closed set holding block `i` of a chain holds blocks `0..i` as well,
//! so the leading blocks of a prompt that such a set holds can be found by
//! a binary search over the prompt instead of a walk along it. A router's
//! index does that for workers that certify their set closed; the worker
//! keeps this tracker beside its announced set to know when it may.
//! Engines evict a chain's tail first, so their sets are closed but for
//! rare cases (the same prefix computed twice at once, a lost event), which
//! the count of orphans catches.

use std::collections::HashMap;

use crate::{BlockHash, ROOT};

/// Counts the members of a set whose parent is missing from it.
#[derive(Debug, Default, Clone)]
pub struct PrefixClosure {
    /// Member → its parent.
    parents: HashMap<BlockHash, BlockHash>,
    /// Hash → how many members have it as their parent.
    children: HashMap<BlockHash, u32>,
    /// Members whose parent is neither [`ROOT`] nor a member.
    orphans: usize,
}

impl PrefixClosure {
    /// Adds `hash`, whose chain parent is `parent`; false when it was a
    /// member already (nothing changes).
    pub fn insert(&mut self, hash: BlockHash, parent: BlockHash) -> bool {
        if self.parents.contains_key(&hash) {
            return false;
        }
        // Members waiting for this one as their parent stop being orphans.
        self.orphans -= self.children.get(&hash).copied().unwrap_or(0) as usize;
        self.parents.insert(hash, parent);
        if parent != ROOT {
            *self.children.entry(parent).or_default() += 1;
            if !self.parents.contains_key(&parent) {
                self.orphans += 1;
            }
        }
        true
    }

    /// Removes `hash`; false when it was not a member.
    pub fn remove(&mut self, hash: BlockHash) -> bool {
        let Some(parent) = self.parents.remove(&hash) else {
            return false;
        };
        if parent != ROOT {
            if let Some(n) = self.children.get_mut(&parent) {
                *n -= 1;
                if *n == 0 {
                    self.children.remove(&parent);
                }
            }
            if parent != hash && !self.parents.contains_key(&parent) {
                self.orphans -= 1;
            }
        }
        // Its children that are members lose their parent.
        self.orphans += self.children.get(&hash).copied().unwrap_or(0) as usize;
        true
    }

    /// Empties the set.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Whether every member's parent is a member or [`ROOT`].
    pub fn is_closed(&self) -> bool {
        self.orphans == 0
    }

    /// Members whose parent is missing.
    pub fn orphans(&self) -> usize {
        self.orphans
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.parents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_is_closed_until_a_middle_block_goes() {
        let mut set = PrefixClosure::default();
        assert!(set.insert(1, ROOT));
        assert!(set.insert(2, 1));
        assert!(set.insert(3, 2));
        assert!(!set.insert(3, 2));
        assert!(set.is_closed());
        assert!(set.remove(2));
        assert_eq!(set.orphans(), 1, "3 lost its parent");
        assert!(set.insert(2, 1));
        assert!(set.is_closed());
        // The tail first, as engines evict: closed all the way.
        for h in [3, 2, 1] {
            assert!(set.remove(h));
            assert!(set.is_closed());
        }
        assert!(set.is_empty());
        assert!(!set.remove(1));
    }

    #[test]
    fn a_child_stored_before_its_parent_waits_for_it() {
        let mut set = PrefixClosure::default();
        set.insert(5, 4);
        set.insert(6, 4);
        assert_eq!(set.orphans(), 2);
        set.insert(4, ROOT);
        assert!(set.is_closed());
        // A hash that names itself as parent is its own (member) parent.
        set.insert(9, 9);
        assert!(set.is_closed());
        set.remove(9);
        assert!(set.is_closed());
        assert_eq!(set.len(), 3);
    }

    /// Random inserts and removes over a small branching forest, against
    /// counting the orphans from scratch.
    #[test]
    fn the_count_matches_a_recount() {
        let mut set = PrefixClosure::default();
        let mut model: HashMap<BlockHash, BlockHash> = HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        // Block h's parent is h / 3 (0 is the root): a forest of fan-out 3.
        for step in 0..20_000 {
            let h = 1 + next(60);
            if next(2) == 0 {
                assert_eq!(set.insert(h, h / 3), model.insert(h, h / 3).is_none());
            } else {
                assert_eq!(set.remove(h), model.remove(&h).is_some());
            }
            let want = model
                .values()
                .filter(|&&p| p != ROOT && !model.contains_key(&p))
                .count();
            assert_eq!(set.orphans(), want, "step {step}");
            if step % 5000 == 4999 {
                set.clear();
                model.clear();
            }
        }
    }
}
