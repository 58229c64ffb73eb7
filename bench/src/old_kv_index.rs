//! The router's KV index before the bitmap index (tandem up to stop 56):
//! hash → `HashSet` of workers, matched by one walk per worker. Kept here
//! only so `router-bench` compares the present index against it in the
//! same run.

use std::collections::{HashMap, HashSet};

/// Hash → the workers (by index) caching that block.
#[derive(Debug, Default)]
pub struct OldKvIndex {
    holders: HashMap<u64, HashSet<usize>>,
    by_worker: HashMap<usize, HashSet<u64>>,
}

impl OldKvIndex {
    pub fn stored(&mut self, worker: usize, hash: u64) {
        self.holders.entry(hash).or_default().insert(worker);
        self.by_worker.entry(worker).or_default().insert(hash);
    }

    pub fn removed(&mut self, worker: usize, hash: u64) {
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

    /// Leading blocks of `hashes` that `worker` caches.
    pub fn matched(&self, worker: usize, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.holders.get(h).is_some_and(|s| s.contains(&worker)))
            .count()
    }
}
