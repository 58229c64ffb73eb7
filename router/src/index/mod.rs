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
//! Fewer lookups beat cheaper ones: a worker whose feed certifies its set
//! prefix-closed (every block's parent held too: engines evict a chain's
//! tail first) holds a prompt's block `i` only with all before it, so its
//! match is found by bisection (`bisect.rs`: O(distinct matches × log
//! blocks) lookups). The flag is per worker, from its feed, and a decision
//! reads it with every shard held: a change between two closed sets
//! leaves it on (a set half through an insert-only or remove-only change
//! lies between the two, and so does its bisected match, as a walk's
//! would), any other is applied with it off. Uncertified workers are
//! walked as before.
//!
//! The map is split into [`SHARDS`] read-write-locked shards by hash.
//! Event writers lock one shard at a time for a run of their hashes, in
//! increasing shard order; a decision takes every shard's read lock once,
//! in *decreasing* order (writers hold at most one lock, so no order can
//! deadlock), and walks without further locking. Taken in the writers'
//! order, a decision trailed a long `Stored` event's writer from shard to
//! shard (each read waiting on the write ahead of it: `std`'s lock
//! prefers writers) and waited for the whole event; against it, the two
//! meet once and the decision waits for one run at most. Each worker's
//! writes are serialized by its own books, which also keep its block count
//! and [`SetDigest`], so a digest check and a purge see exactly the
//! applied events.
//!
//! **Architecture Invariant:** an entry never outlives its worker's
//! membership: [`KvIndex::retire`] removes a worker's entries and refuses
//! its later events under the same lock its event writes take.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tandem_block_hash::{BlockHash, SetDigest};

mod bisect;
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
/// `ids` and `closed`, never a worker's books, so a long event apply does
/// not hold one up.
#[derive(Debug, Default)]
struct Registry {
    books: HashMap<usize, Arc<Mutex<Books>>>,
    /// Slot → dense id; `None` once retired.
    ids: HashMap<usize, Option<usize>>,
    free_ids: Vec<usize>,
    next_id: usize,
    /// Bits over dense ids: the worker certified its indexed set
    /// prefix-closed ([`KvIndex::set_prefix_closed`]), so its matches are
    /// found by bisection.
    closed: Vec<u64>,
}

impl Registry {
    fn is_closed(&self, id: usize) -> bool {
        self.closed
            .get(id / 64)
            .is_some_and(|w| w >> (id % 64) & 1 == 1)
    }

    fn set_closed(&mut self, id: usize, closed: bool) {
        if self.closed.len() <= id / 64 {
            self.closed.resize(id / 64 + 1, 0);
        }
        let bit = 1u64 << (id % 64);
        if closed {
            self.closed[id / 64] |= bit;
        } else {
            self.closed[id / 64] &= !bit;
        }
    }
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
        reg.set_closed(id, false);
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

    /// Whether worker `slot`'s indexed set is prefix-closed, as its feed
    /// says after each batch of changes: true lets decisions bisect its
    /// matches. A follower keeps it on through a `Stored` or `Removed`
    /// from one closed set to another, and otherwise clears it before the
    /// change and sets it from the change's flag after; a decision reads
    /// the flags with every shard's read lock held, so it never bisects a
    /// set that is not between two closed ones. A retired slot is ignored.
    pub fn set_prefix_closed(&self, slot: usize, closed: bool) {
        let books = self.books(slot);
        let id = lock(&books).id;
        let mut reg = lock(&self.registry);
        if reg.ids.get(&slot) == Some(&Some(id)) {
            reg.set_closed(id, closed);
        }
    }

    /// Forgets everything worker `slot` cached (it restarted, or its feed
    /// broke and a dump follows). Its set is no longer certified closed
    /// until its feed says so again.
    pub fn clear(&self, slot: usize) {
        let Some(books) = self.existing_books(slot) else {
            return;
        };
        self.set_prefix_closed(slot, false);
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
        reg.set_closed(id, false);
        reg.free_ids.push(id);
    }

    /// Every shard's read lock (a decision's view), indexed by shard and
    /// taken last shard first, against the writers' order.
    fn read_all(&self) -> Vec<RwLockReadGuard<'_, Shard>> {
        let mut guards: Vec<_> = self.shards.iter().rev().map(read).collect();
        guards.reverse();
        guards
    }

    /// Leading blocks of `hashes` that each of `slots` caches, in order.
    /// Candidates whose set is certified prefix-closed are bisected
    /// ([`bisect`]), the others walked.
    pub fn matched(&self, slots: &[usize], hashes: &[BlockHash]) -> Vec<usize> {
        let mut out = vec![0; slots.len()];
        // The shards first: a change that may open a set is applied with
        // its flag off, so with every shard held, a set whose flag reads
        // closed is closed or between two closed sets
        // (`set_prefix_closed`).
        let guards = self.read_all();
        // Dense ids of the candidates that have books (others match 0).
        let (ids, closed): (Vec<Option<usize>>, Vec<u64>) = {
            let reg = lock(&self.registry);
            let ids = slots
                .iter()
                .map(|s| reg.ids.get(s).copied().flatten())
                .collect();
            (ids, reg.closed.clone())
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
        let closed_word = |w: usize| closed.get(w).copied().unwrap_or(0);
        let mut open: Vec<u64> = (0..words).map(|w| want[w] & !closed_word(w)).collect();
        // The walk reads words up to the highest uncertified candidate's.
        open.truncate(open.iter().rposition(|&a| a != 0).map_or(0, |i| i + 1));
        let mut depth = match open.len() {
            0 => Vec::new(),
            1 => walk_narrow(&guards, open[0], hashes),
            _ => walk(&guards, &open, hashes),
        };
        depth.resize(words * 64, 0);
        for (w, &a) in want.iter().enumerate() {
            bisect::bisect(&guards, w, a & closed_word(w), hashes, &mut depth);
        }
        for (o, id) in out.iter_mut().zip(&ids) {
            if let Some(id) = id {
                *o = depth[*id];
            }
        }
        out
    }
}

/// [`walk`] when every candidate's id is below 64 (up to 64 workers): one
/// word of holders per block, read from the slot alone, with no spilled
/// map to consult.
fn walk_narrow(
    guards: &[RwLockReadGuard<'_, Shard>],
    mut alive: u64,
    hashes: &[BlockHash],
) -> Vec<usize> {
    let mut depth = vec![hashes.len(); 64];
    // Each lookup requests the slot `LOOKAHEAD` hashes ahead, so that
    // many misses are in flight while the walk reads hits.
    for &h in &hashes[..hashes.len().min(LOOKAHEAD)] {
        prefetch_slot(guards, h);
    }
    for (i, &h) in hashes.iter().enumerate() {
        if let Some(&a) = hashes.get(i + LOOKAHEAD) {
            prefetch_slot(guards, a);
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

/// Walks `hashes` with every candidate in `alive` (a bitmap), and says how
/// far each id's match reached (indexed by id).
fn walk(guards: &[RwLockReadGuard<'_, Shard>], alive: &[u64], hashes: &[BlockHash]) -> Vec<usize> {
    let mut alive = alive.to_vec();
    let mut depth = vec![0; alive.len() * 64];
    // Lookups in batches of [`LOOKAHEAD`]: they are independent, so
    // the core overlaps their cache misses instead of waiting on each
    // (the map is far larger than the caches once workers hold much),
    // and the next batch's lines are requested before this batch is
    // read.
    let prefetch = |chunk: &[BlockHash]| {
        for &h in chunk {
            prefetch_slot(guards, h);
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

impl KvIndex {
    /// Words of holder bits per block over every dense id in use: what a
    /// walk of any candidates reads at most.
    pub fn id_words(&self) -> usize {
        lock(&self.registry).next_id.div_ceil(64)
    }

    /// Words of holder bits a match of `slots` reads per block it walks:
    /// one per 64 dense ids up to the highest candidate's whose set is not
    /// certified closed (0 when all are: bisection costs a few lookups per
    /// distinct match, whatever the prompt's length).
    pub fn walk_words(&self, slots: &[usize]) -> usize {
        let reg = lock(&self.registry);
        slots
            .iter()
            .filter_map(|s| reg.ids.get(s).copied().flatten())
            .filter(|&id| !reg.is_closed(id))
            .map(|id| id / 64 + 1)
            .max()
            .unwrap_or(0)
    }

    /// Whether worker `slot`'s set is certified prefix-closed now (its
    /// matches are bisected).
    pub fn prefix_closed(&self, slot: usize) -> bool {
        let reg = lock(&self.registry);
        match reg.ids.get(&slot) {
            Some(&Some(id)) => reg.is_closed(id),
            _ => false,
        }
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
mod tests;
