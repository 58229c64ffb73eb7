//! Which blocks the store holds, their bytes, and the LRU order the byte
//! budget evicts in.

use std::collections::{BTreeMap, HashMap};

/// Where a block stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// Handed to the writer, not on disk yet: not loadable, but not worth
    /// writing twice.
    Queued,
    /// On disk.
    Stored,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: State,
    /// The block before it in its prompt (`0` for a first block).
    parent: u64,
    bytes: u64,
    /// Position in the LRU order (higher: used later).
    tick: u64,
}

/// The store's books. Every change is O(log n).
#[derive(Debug)]
pub(crate) struct Index {
    entries: HashMap<u64, Entry>,
    /// Stored blocks by last use, oldest first.
    lru: BTreeMap<u64, u64>,
    next_tick: u64,
    stored_bytes: u64,
    budget: u64,
}

impl Index {
    pub(crate) fn new(budget: u64) -> Self {
        Self {
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            stored_bytes: 0,
            budget,
        }
    }

    pub(crate) fn state(&self, hash: u64) -> Option<State> {
        self.entries.get(&hash).map(|e| e.state)
    }

    /// Blocks on disk and their bytes.
    pub(crate) fn stored(&self) -> (usize, u64) {
        (self.lru.len(), self.stored_bytes)
    }

    /// Notes a block as queued for writing; false if it is known already.
    pub(crate) fn queue(&mut self, hash: u64) -> bool {
        if self.entries.contains_key(&hash) {
            return false;
        }
        self.entries.insert(
            hash,
            Entry {
                state: State::Queued,
                parent: 0,
                bytes: 0,
                tick: 0,
            },
        );
        true
    }

    /// Records a block now on disk (written, or found at start-up) as the
    /// most recently used, and returns the blocks to delete to get back
    /// under the budget (least recently used first; never this one).
    pub(crate) fn stored_block(&mut self, hash: u64, parent: u64, bytes: u64) -> Vec<u64> {
        self.forget(hash);
        let tick = self.tick();
        self.entries.insert(
            hash,
            Entry {
                state: State::Stored,
                parent,
                bytes,
                tick,
            },
        );
        self.lru.insert(tick, hash);
        self.stored_bytes += bytes;
        let mut evicted = Vec::new();
        while self.stored_bytes > self.budget {
            let Some((&t, &oldest)) = self.lru.iter().next() else {
                break;
            };
            if oldest == hash {
                break;
            }
            self.lru.remove(&t);
            if let Some(e) = self.entries.remove(&oldest) {
                self.stored_bytes -= e.bytes;
            }
            evicted.push(oldest);
        }
        evicted
    }

    /// Every stored block and its parent.
    pub(crate) fn stored_chain_links(&self) -> Vec<(u64, u64)> {
        self.lru
            .values()
            .filter_map(|h| self.entries.get(h).map(|e| (*h, e.parent)))
            .collect()
    }

    /// Marks a stored block used now (it is evicted last).
    pub(crate) fn touch(&mut self, hash: u64) {
        let tick = self.tick();
        if let Some(e) = self.entries.get_mut(&hash) {
            if e.state == State::Stored {
                self.lru.remove(&e.tick);
                e.tick = tick;
                self.lru.insert(tick, hash);
            }
        }
    }

    /// Drops a block (a failed write, a corrupt file).
    pub(crate) fn forget(&mut self, hash: u64) {
        if let Some(e) = self.entries.remove(&hash) {
            if e.state == State::Stored {
                self.lru.remove(&e.tick);
                self.stored_bytes -= e.bytes;
            }
        }
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_evicts_the_least_recently_used() {
        let mut ix = Index::new(300);
        for h in 1..=3 {
            assert!(ix.queue(h));
            assert!(!ix.queue(h), "queued twice");
            assert!(ix.stored_block(h, 0, 100).is_empty());
        }
        ix.touch(1);
        assert_eq!(ix.stored_block(4, 3, 100), vec![2]);
        assert_eq!(ix.stored(), (3, 300));
        assert_eq!(ix.state(2), None);
        ix.forget(3);
        assert_eq!(ix.stored(), (2, 200));
        // A block bigger than the budget is kept alone, evicting the rest.
        assert_eq!(ix.stored_block(5, 0, 1000).len(), 2);
        assert_eq!(ix.stored(), (1, 1000));
    }
}
