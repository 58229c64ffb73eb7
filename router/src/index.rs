//! Which worker caches which prefix: an index over chained block hashes,
//! fed by each worker's KV-event stream.
//!
//! A chained hash names a whole prefix, so "how many leading blocks of this
//! prompt does worker `w` hold" is a walk along the prompt's hashes until
//! the first one `w` lacks.

use std::collections::{HashMap, HashSet};

use tandem_block_hash::BlockHash;

/// Hash → the workers (by index) caching that block.
#[derive(Debug, Default)]
pub struct KvIndex {
    holders: HashMap<BlockHash, HashSet<usize>>,
    by_worker: HashMap<usize, HashSet<BlockHash>>,
}

impl KvIndex {
    pub fn stored(&mut self, worker: usize, hash: BlockHash) {
        self.holders.entry(hash).or_default().insert(worker);
        self.by_worker.entry(worker).or_default().insert(hash);
    }

    pub fn removed(&mut self, worker: usize, hash: BlockHash) {
        if let Some(h) = self.holders.get_mut(&hash) {
            h.remove(&worker);
            if h.is_empty() {
                self.holders.remove(&hash);
            }
        }
        if let Some(w) = self.by_worker.get_mut(&worker) {
            w.remove(&hash);
        }
    }

    /// Forgets everything about `worker` (it restarted, left, or its feed
    /// broke).
    pub fn clear(&mut self, worker: usize) {
        for hash in self.by_worker.remove(&worker).unwrap_or_default() {
            self.removed(worker, hash);
        }
    }

    /// Leading blocks of `hashes` that `worker` caches.
    pub fn matched(&self, worker: usize, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.holders.get(h).is_some_and(|s| s.contains(&worker)))
            .count()
    }

    /// Blocks indexed for `worker`.
    pub fn blocks_of(&self, worker: usize) -> usize {
        self.by_worker.get(&worker).map_or(0, HashSet::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_stop_at_the_first_missing_block() {
        let mut ix = KvIndex::default();
        for h in [1, 2, 3] {
            ix.stored(0, h);
        }
        ix.stored(1, 1);
        assert_eq!(ix.matched(0, &[1, 2, 3, 4]), 3);
        assert_eq!(ix.matched(1, &[1, 2, 3]), 1);
        ix.removed(0, 2);
        assert_eq!(ix.matched(0, &[1, 2, 3]), 1);
        ix.clear(0);
        assert_eq!(ix.matched(0, &[1]), 0);
        assert_eq!(ix.matched(1, &[1]), 1);
        assert_eq!(ix.blocks_of(0), 0);
    }
}
