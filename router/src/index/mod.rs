//! Which worker caches which prefix: an index over chained block hashes,
//! fed by each worker's KV-event stream.
//!
//! A chained hash names a whole prefix, so the prefix tree every router
//! needs is already flattened by the hashes: block `i` of a prompt is in a
//! worker's cache exactly when that worker announced hash `h[i]`. The index
//! is therefore one hash map from block hash to the *set* of workers
//! holding it, kept as a bitmap over dense worker ids. Matching a prompt
//! for every candidate at once is one walk along its hashes, AND-ing the
//! bitmaps until no candidate is left: O(matched blocks × ⌈workers/64⌉),
//! where the map it replaced (hash → `HashSet` of workers) was walked once
//! per worker, O(workers × matched blocks), with a SipHash per step.
//! A radix tree over hashes would hold the same facts with a node per
//! block and pointer chasing; the map needs neither, since the chain
//! already encodes the tree.
//!
//! A walk is a run of lookups into a table far larger than the caches, so
//! its cost is cache and TLB misses: the map of ids below 64 is an
//! open-addressing table of its own (`table.rs`: one 16-byte slot a block,
//! huge pages), and each lookup requests the slot `LOOKAHEAD` hashes
//! ahead, so that many misses are in flight at once. Up to 64 workers, a
//! walk reads one word per block and nothing else
//! (`walk_narrow`). At 64 workers and 32k-token prompts a
//! decision's p50 went from 47–52 µs to 18–22 µs (bench/RESULTS.md).
//!
//! The map is split into [`SHARDS`] read-write-locked shards by hash.
//! Event writers lock one shard at a time for a run of their hashes, so a
//! long `Stored` event never holds up a decision for its whole length; a
//! decision takes every shard's read lock once, in order (writers hold at
//! most one, so the order rules out a deadlock), and walks without further
//! locking. Each worker's writes are serialized by its own books, which
//! also keep its block count and [`SetDigest`], so a digest check and a
//! purge see exactly the applied events.
//!
//! **Architecture Invariant:** an entry never outlives its worker's
//! membership: [`KvIndex::retire`] removes a worker's entries and refuses
//! its later events under the same lock its event writes take.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tandem_block_hash::{BlockHash, SetDigest};

mod table;

use table::BitsTable;

/// Shards of the hash map: enough that writers rarely meet a decision on
/// the same shard, few enough that a decision's lock round stays far below
/// a microsecond.
pub const SHARDS: usize = 16;

/// How far ahead of its lookups a walk requests slots; the general walk
/// also looks up in batches of this many. At 64 workers and 32k-token
/// prompts the one-word walk's p50 was 28 µs at 8, 22 at 16, 21 at 32 and
/// 20 at 64 (bench/RESULTS.md).
const LOOKAHEAD: usize = 32;

/// Hashes an event apply runs ahead of the one it writes, requesting their
/// slots' lines.
const EVENT_LOOKAHEAD: usize = 8;

/// Block hashes are xxh3 output: uniform already, so the map hashes them
/// with one multiply (which also spreads any structure in small test
/// hashes) instead of SipHash.
#[derive(Debug, Default, Clone, Copy)]
struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, h: u64) {
        self.0 = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type BlockMap<V> = HashMap<BlockHash, V, BuildHasherDefault<BlockHasher>>;

/// One shard of the map. The workers holding a block are bits over dense
/// worker ids: ids below 64 inline in the entry (16 bytes with its key, so
/// a cluster of up to 64 workers costs one small slot per block; [`table`]
/// says why it is not `std`'s map), higher ids spilled to a second map that
/// only blocks with such holders enter.
#[derive(Debug, Default)]
struct Shard {
    /// Hash → bits of ids 0..64. An entry exists iff someone holds the
    /// block (it may be 0 when only spilled ids do).
    low: BitsTable,
    /// Hash → bits of ids 64.. (word `i` holds ids `64 (i + 1)..`).
    high: BlockMap<Box<[u64]>>,
}

impl Shard {
    /// Sets `id`'s bit for `h`; true when it was not set.
    fn set(&mut self, h: BlockHash, id: usize) -> bool {
        let low = self.low.get_or_insert(h);
        let bit = 1u64 << (id % 64);
        if id < 64 {
            let fresh = *low & bit == 0;
            *low |= bit;
            return fresh;
        }
        let i = id / 64 - 1;
        let words = self
            .high
            .entry(h)
            .or_insert_with(|| vec![0; i + 1].into_boxed_slice());
        if words.len() <= i {
            let mut grown = vec![0; i + 1];
            grown[..words.len()].copy_from_slice(words);
            *words = grown.into_boxed_slice();
        }
        let fresh = words[i] & bit == 0;
        words[i] |= bit;
        fresh
    }

    /// Clears `id`'s bit for `h` (dropping entries left empty); true when
    /// it was set.
    fn unset(&mut self, h: BlockHash, id: usize) -> bool {
        let bit = 1u64 << (id % 64);
        if id < 64 {
            // One probe: the bit cleared, and the entry dropped when no one
            // is left (no spilled holder either).
            let spilled = !self.high.is_empty() && self.high.contains_key(&h);
            return self.low.clear_bits(h, bit, !spilled).unwrap_or(false);
        }
        let was = {
            let Some(words) = self.high.get_mut(&h) else {
                return false;
            };
            let was = words.get(id / 64 - 1).is_some_and(|w| w & bit != 0);
            if let Some(w) = words.get_mut(id / 64 - 1) {
                *w &= !bit;
            }
            if words.iter().all(|&w| w == 0) {
                self.high.remove(&h);
            }
            was
        };
        // The low entry goes too when it was kept only for this holder.
        let spilled = self.high.contains_key(&h);
        self.low.clear_bits(h, 0, !spilled);
        was
    }

    /// Clears `id` everywhere; how many blocks it held.
    fn purge(&mut self, id: usize) -> usize {
        let hashes: Vec<BlockHash> = if id < 64 {
            let bit = 1u64 << id;
            self.low
                .iter()
                .filter(|&(_, w)| w & bit != 0)
                .map(|(h, _)| h)
                .collect()
        } else {
            let (i, bit) = (id / 64 - 1, 1u64 << (id % 64));
            self.high
                .iter()
                .filter(|(_, ws)| ws.get(i).is_some_and(|w| w & bit != 0))
                .map(|(&h, _)| h)
                .collect()
        };
        for &h in &hashes {
            self.unset(h, id);
        }
        hashes.len()
    }

    fn bytes(&self) -> usize {
        // A hashbrown slot is the entry plus one control byte; buckets are
        // capacity / (7/8).
        let slot = |entry: usize, cap: usize| cap * 8 / 7 * (entry + 1);
        self.low.bytes()
            + slot(24, self.high.capacity())
            + self.high.values().map(|w| 8 * w.len()).sum::<usize>()
    }
}

/// A block's holders as a walk reads them: the low word, and the spilled
/// words when the walk has candidates there.
type Entry<'a> = (u64, Option<&'a [u64]>);

/// One worker's side of the index: how many blocks it holds, their
/// digest, and whether it has left. Its blocks themselves are only its bit
/// in the map: a purge scans the map (rare: a worker leaves or resyncs),
/// so the common path, an event, touches one map entry per hash.
#[derive(Debug, Default)]
struct Books {
    /// Dense id: its bit in [`Holders`].
    id: usize,
    blocks: usize,
    digest: SetDigest,
    retired: bool,
}

/// Dense ids for worker slots: an id is freed when its worker retires and
/// reused by the next new worker, so bitmaps stay as wide as the largest
/// number of workers present at once, not ever seen. Decisions read only
/// `ids`, never a worker's books, so a long event apply does not hold one up.
#[derive(Debug, Default)]
struct Registry {
    books: HashMap<usize, Arc<Mutex<Books>>>,
    /// Slot → dense id; `None` once retired.
    ids: HashMap<usize, Option<usize>>,
    free_ids: Vec<usize>,
    next_id: usize,
}

/// Hash → the workers caching that block, for every worker of a router.
#[derive(Debug)]
pub struct KvIndex {
    shards: Box<[RwLock<Shard>]>,
    registry: Mutex<Registry>,
    /// XORed into each hash a worker's digest counts (a disk-tier index
    /// counts what workers count for their disk blocks).
    digest_salt: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::with_digest_salt(0)
    }
}

impl KvIndex {
    /// An index whose per-worker digests count each hash XOR `salt`
    /// (`tandem_block_hash::DISK_TIER_SALT` for the disk tier's).
    pub fn with_digest_salt(salt: u64) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            registry: Mutex::default(),
            digest_salt: salt,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

fn shard_of(hash: BlockHash) -> usize {
    // The raw high bits: a table's slot comes from the top bits of the
    // hash times a multiplier, which mixes in every bit, so the keys of one
    // shard still spread over its slots.
    (hash >> 59) as usize % SHARDS
}

/// Requests `h`'s slot in its shard (a walk, ahead of its lookup).
#[inline]
fn prefetch_slot(guards: &[RwLockReadGuard<'_, Shard>], h: BlockHash) {
    guards[shard_of(h)].low.prefetch(h);
}

/// Records depth `d` for each id of word `w` set in `dropped`: the
/// candidates whose match ended there.
#[inline]
fn record_dropped(depth: &mut [usize], w: usize, mut dropped: u64, d: usize) {
    while dropped != 0 {
        depth[w * 64 + dropped.trailing_zeros() as usize] = d;
        dropped &= dropped - 1;
    }
}

impl KvIndex {
    /// The books of worker `slot`, made (with a fresh id) on first use.
    fn books(&self, slot: usize) -> Arc<Mutex<Books>> {
        let mut reg = lock(&self.registry);
        if let Some(b) = reg.books.get(&slot) {
            return b.clone();
        }
        let id = reg.free_ids.pop().unwrap_or_else(|| {
            reg.next_id += 1;
            reg.next_id - 1
        });
        reg.ids.insert(slot, Some(id));
        let books = Arc::new(Mutex::new(Books {
            id,
            ..Books::default()
        }));
        reg.books.insert(slot, books.clone());
        books
    }

    fn existing_books(&self, slot: usize) -> Option<Arc<Mutex<Books>>> {
        lock(&self.registry).books.get(&slot).cloned()
    }

    /// Worker `slot` announced `hashes` as cached.
    pub fn stored(&self, slot: usize, hashes: &[BlockHash]) {
        let books = self.books(slot);
        let mut b = lock(&books);
        if b.retired {
            return;
        }
        let (b, salt) = (&mut *b, self.digest_salt);
        self.for_each_shard_run(hashes, |shard, h| {
            if shard.set(h, b.id) {
                b.blocks += 1;
                b.digest.insert(h ^ salt);
            }
        });
    }

    /// Worker `slot` announced `hashes` as evicted.
    pub fn removed(&self, slot: usize, hashes: &[BlockHash]) {
        let Some(books) = self.existing_books(slot) else {
            return;
        };
        let mut b = lock(&books);
        // A retired worker's id may be another worker's now.
        if b.retired {
            return;
        }
        let (b, salt) = (&mut *b, self.digest_salt);
        self.for_each_shard_run(hashes, |shard, h| {
            if shard.unset(h, b.id) {
                b.blocks -= 1;
                b.digest.remove(h ^ salt);
            }
        });
    }

    /// Applies `f` to each hash under its shard's write lock, one lock per
    /// run of hashes in the same shard (hashes grouped by shard first).
    fn for_each_shard_run(&self, hashes: &[BlockHash], mut f: impl FnMut(&mut Shard, BlockHash)) {
        let mut by_shard: Vec<BlockHash> = hashes.to_vec();
        by_shard.sort_unstable_by_key(|&h| shard_of(h));
        for run in by_shard.chunk_by(|&a, &b| shard_of(a) == shard_of(b)) {
            let mut map = write(&self.shards[shard_of(run[0])]);
            // The table is far larger than the caches: the slots of the
            // run's first hashes are requested together, then each write
            // requests the one `EVENT_LOOKAHEAD` ahead, so misses overlap.
            for &h in &run[..run.len().min(EVENT_LOOKAHEAD)] {
                map.low.prefetch(h);
            }
            for (j, &h) in run.iter().enumerate() {
                if let Some(&ahead) = run.get(j + EVENT_LOOKAHEAD) {
                    map.low.prefetch(ahead);
                }
                f(&mut map, h);
            }
        }
    }

    /// Drops `books`' worker from every entry, one shard at a time.
    fn purge(&self, b: &mut Books) {
        for shard in self.shards.iter() {
            if b.blocks == 0 {
                break;
            }
            b.blocks -= write(shard).purge(b.id).min(b.blocks);
        }
        b.blocks = 0;
        b.digest = SetDigest::default();
    }

    /// Forgets everything worker `slot` cached (it restarted, or its feed
    /// broke and a dump follows).
    pub fn clear(&self, slot: usize) {
        let Some(books) = self.existing_books(slot) else {
            return;
        };
        let mut b = lock(&books);
        if !b.retired {
            self.purge(&mut b);
        }
    }

    /// Worker `slot` left: its entries go and its later events are
    /// ignored; its id is reused.
    pub fn retire(&self, slot: usize) {
        let books = self.books(slot);
        let mut b = lock(&books);
        if b.retired {
            return;
        }
        b.retired = true;
        self.purge(&mut b);
        let id = b.id;
        drop(b);
        let mut reg = lock(&self.registry);
        reg.ids.insert(slot, None);
        reg.free_ids.push(id);
    }

    /// Leading blocks of `hashes` that each of `slots` caches, in order.
    pub fn matched(&self, slots: &[usize], hashes: &[BlockHash]) -> Vec<usize> {
        let mut out = vec![0; slots.len()];
        // Dense ids of the candidates that have books (others match 0).
        let ids: Vec<Option<usize>> = {
            let reg = lock(&self.registry);
            slots
                .iter()
                .map(|s| reg.ids.get(s).copied().flatten())
                .collect()
        };
        let words = ids
            .iter()
            .flatten()
            .map(|id| id / 64 + 1)
            .max()
            .unwrap_or(0);
        if words == 0 || hashes.is_empty() {
            return out;
        }
        let mut want = vec![0u64; words];
        for id in ids.iter().flatten() {
            want[id / 64] |= 1 << (id % 64);
        }
        let depth = if words == 1 {
            self.walk_narrow(want[0], hashes)
        } else {
            self.walk(&want, hashes)
        };
        for (o, id) in out.iter_mut().zip(&ids) {
            if let Some(id) = id {
                *o = depth[*id];
            }
        }
        out
    }

    /// [`walk`](Self::walk) when every candidate's id is below 64 (up to 64
    /// workers): one word of holders per block, read from the slot alone,
    /// with no spilled map to consult.
    fn walk_narrow(&self, mut alive: u64, hashes: &[BlockHash]) -> Vec<usize> {
        let guards: Vec<_> = self.shards.iter().map(read).collect();
        let mut depth = vec![hashes.len(); 64];
        // Each lookup requests the slot `LOOKAHEAD` hashes ahead, so that
        // many misses are in flight while the walk reads hits.
        for &h in &hashes[..hashes.len().min(LOOKAHEAD)] {
            prefetch_slot(&guards, h);
        }
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(&a) = hashes.get(i + LOOKAHEAD) {
                prefetch_slot(&guards, a);
            }
            let kept = alive & guards[shard_of(h)].low.get(h).unwrap_or(0);
            record_dropped(&mut depth, 0, alive & !kept, i);
            alive = kept;
            if alive == 0 {
                return depth;
            }
        }
        depth
    }

    /// Walks `hashes` with every candidate in `alive` (a bitmap), and says
    /// how far each id's match reached (indexed by id).
    fn walk(&self, alive: &[u64], hashes: &[BlockHash]) -> Vec<usize> {
        let guards: Vec<_> = self.shards.iter().map(read).collect();
        let mut alive = alive.to_vec();
        let mut depth = vec![0; alive.len() * 64];
        // Lookups in batches of [`LOOKAHEAD`]: they are independent, so
        // the core overlaps their cache misses instead of waiting on each
        // (the map is far larger than the caches once workers hold much),
        // and the next batch's lines are requested before this batch is
        // read.
        let prefetch = |chunk: &[BlockHash]| {
            for &h in chunk {
                prefetch_slot(&guards, h);
            }
        };
        prefetch(&hashes[..hashes.len().min(LOOKAHEAD)]);
        for (c, chunk) in hashes.chunks(LOOKAHEAD).enumerate() {
            let next = ((c + 1) * LOOKAHEAD).min(hashes.len());
            prefetch(&hashes[next..(next + LOOKAHEAD).min(hashes.len())]);
            let wide = alive.iter().skip(1).any(|&a| a != 0);
            let found: [Option<Entry<'_>>; LOOKAHEAD] = std::array::from_fn(|k| {
                let h = chunk.get(k)?;
                let shard = &guards[shard_of(*h)];
                let low = shard.low.get(*h)?;
                Some((
                    low,
                    wide.then(|| shard.high.get(h).map(|w| &w[..])).flatten(),
                ))
            });
            for (k, entry) in found.iter().take(chunk.len()).enumerate() {
                let i = c * LOOKAHEAD + k;
                let mut any = false;
                for (w, a) in alive.iter_mut().enumerate() {
                    let bits = match entry {
                        Some((low, _)) if w == 0 => *low,
                        Some((_, Some(high))) => high.get(w - 1).copied().unwrap_or(0),
                        _ => 0,
                    };
                    let kept = bits & *a;
                    record_dropped(&mut depth, w, *a & !kept, i);
                    *a = kept;
                    any |= kept != 0;
                }
                if !any {
                    return depth;
                }
            }
        }
        for (w, &a) in alive.iter().enumerate() {
            record_dropped(&mut depth, w, a, hashes.len());
        }
        depth
    }

    /// Blocks indexed for worker `slot`.
    pub fn blocks_of(&self, slot: usize) -> usize {
        self.existing_books(slot).map_or(0, |b| lock(&b).blocks)
    }

    /// The digest of worker `slot`'s indexed blocks (compared with the one
    /// the worker sends).
    pub fn digest_of(&self, slot: usize) -> SetDigest {
        self.existing_books(slot)
            .map_or_else(SetDigest::default, |b| lock(&b).digest)
    }

    /// Distinct blocks indexed, over all workers.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| read(s).low.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the index's maps hold (at capacity, with spilled bitmaps): an
    /// estimate, for the memory-per-block figure.
    pub fn memory_bytes(&self) -> usize {
        self.shards.iter().map(|s| read(s).bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_stop_at_the_first_missing_block() {
        let ix = KvIndex::default();
        ix.stored(0, &[1, 2, 3]);
        ix.stored(1, &[1]);
        assert_eq!(ix.matched(&[0, 1, 7], &[1, 2, 3, 4]), [3, 1, 0]);
        ix.removed(0, &[2]);
        assert_eq!(ix.matched(&[0, 1], &[1, 2, 3]), [1, 1]);
        ix.clear(0);
        assert_eq!(ix.matched(&[0, 1], &[1]), [0, 1]);
        assert_eq!(ix.blocks_of(0), 0);
        assert_eq!(ix.len(), 1);
    }

    #[test]
    fn a_retired_worker_leaves_no_entry_and_its_late_events_are_ignored() {
        let ix = KvIndex::default();
        ix.stored(0, &[1, 2]);
        ix.stored(1, &[1]);
        ix.retire(0);
        ix.stored(0, &[5]);
        assert_eq!(ix.matched(&[0, 1], &[1, 2]), [0, 1]);
        assert_eq!(ix.len(), 1, "only worker 1's block is left");
        // Its id goes to the next worker, which starts empty.
        ix.stored(2, &[9]);
        assert_eq!(ix.matched(&[2, 1], &[1]), [0, 1]);
        assert_eq!(ix.matched(&[2], &[9]), [1]);
    }

    #[test]
    fn digests_follow_the_applied_set() {
        let ix = KvIndex::default();
        ix.stored(3, &[1, 2, 3]);
        ix.stored(3, &[3]);
        ix.removed(3, &[2, 8]);
        assert_eq!(ix.digest_of(3), SetDigest::of([1, 3]));
        assert_eq!(ix.blocks_of(3), 2);
    }

    #[test]
    fn wide_clusters_match_like_the_per_worker_walk() {
        // 200 workers: worker w holds the first w % 37 blocks of a chain.
        let ix = KvIndex::default();
        let chain: Vec<BlockHash> = (100..140).collect();
        for w in 0..200 {
            ix.stored(w, &chain[..w % 37]);
        }
        let slots: Vec<usize> = (0..200).collect();
        let got = ix.matched(&slots, &chain);
        let want: Vec<usize> = slots.iter().map(|w| w % 37).collect();
        assert_eq!(got, want);
        for w in 0..200 {
            ix.retire(w);
        }
        assert!(ix.is_empty());
    }

    #[test]
    fn random_events_match_a_set_per_worker() {
        use std::collections::{BTreeSet, HashMap};
        // The model: each worker's set of hashes; the walk per worker.
        let mut model: HashMap<usize, BTreeSet<BlockHash>> = HashMap::new();
        let mut gone = std::collections::HashSet::new();
        let ix = KvIndex::default();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let chain: Vec<BlockHash> = (1..=24).collect();
        for step in 0..4000 {
            let w = next(90) as usize;
            let from = next(24) as usize;
            let to = (from + 1 + next(8) as usize).min(24);
            if gone.contains(&w) {
                // A retired slot's events are ignored; checked below.
                ix.stored(w, &chain[from..to]);
                continue;
            }
            match next(10) {
                0..=4 => {
                    ix.stored(w, &chain[from..to]);
                    model.entry(w).or_default().extend(&chain[from..to]);
                }
                5..=7 => {
                    ix.removed(w, &chain[from..to]);
                    let set = model.entry(w).or_default();
                    for h in &chain[from..to] {
                        set.remove(h);
                    }
                }
                8 => {
                    ix.clear(w);
                    model.remove(&w);
                }
                _ => {
                    // Retire, and a new slot takes over (ids are reused).
                    ix.retire(w);
                    model.remove(&w);
                    gone.insert(w);
                    let fresh = 1000 + step;
                    assert_eq!(ix.matched(&[fresh], &chain), [0]);
                }
            }
            if step % 50 == 0 {
                let slots: Vec<usize> = (0..90).collect();
                let want: Vec<usize> = slots
                    .iter()
                    .map(|w| {
                        let set = model.get(w);
                        chain
                            .iter()
                            .take_while(|h| set.is_some_and(|s| s.contains(h)))
                            .count()
                    })
                    .collect();
                let got = ix.matched(&slots, &chain);
                assert_eq!(got, want, "step {step}");
                for (slot, set) in &model {
                    let want = SetDigest::of(set.iter().copied());
                    assert_eq!(ix.digest_of(*slot), want, "step {step}");
                    assert_eq!(ix.blocks_of(*slot), set.len());
                }
            }
        }
    }

    /// Up to 64 workers take the one-word walk: it gives what the general
    /// walk gives, on random holders of a branching set of chains long
    /// enough to cross several lookahead windows.
    #[test]
    fn the_one_word_walk_matches_the_general_walk() {
        let ix = KvIndex::default();
        let mut x = 0x1234_5678_9abc_def1_u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        // Four chains sharing their first 50 blocks.
        let chains: Vec<Vec<BlockHash>> = (0..4u64)
            .map(|c| {
                (0..200u64)
                    .map(|i| if i < 50 { i + 1 } else { 1000 * (c + 1) + i })
                    .collect()
            })
            .collect();
        for w in 0..64 {
            let chain = &chains[next(4) as usize];
            let upto = next(201) as usize;
            ix.stored(w, &chain[..upto]);
            // Holes: some blocks evicted out of order.
            for _ in 0..next(3) {
                let at = next(200) as usize;
                ix.removed(w, &chain[at..at + 1]);
            }
        }
        for chain in &chains {
            for cut in [0, 1, 31, 32, 33, 50, 120, 200] {
                let hashes = &chain[..cut];
                let mut want = 0u64;
                for w in 0..64u64 {
                    if next(4) != 0 {
                        want |= 1 << w;
                    }
                }
                let general = ix.walk(&[want], hashes);
                let narrow = ix.walk_narrow(want, hashes);
                for id in 0..64 {
                    if want & (1 << id) != 0 {
                        assert_eq!(narrow[id], general[id], "cut {cut} id {id}");
                    }
                }
            }
        }
    }
}
