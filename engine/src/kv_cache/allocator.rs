//! The block pool: reference counts, the prefix cache, LRU eviction.
//!
//! Every block is either *referenced* (refcount > 0, owned by one or more
//! [`BlockTable`](super::BlockTable)s) or *free*. Free blocks sit in one
//! queue, least recently freed at the head; allocation pops the head. A full
//! block whose K/V is computed can be *registered* under its chained
//! [`BlockHash`]; it keeps that name while free, so a later request with the
//! same prefix takes it back out of the queue instead of recomputing it
//! (vLLM v1's design). Its name is dropped only when allocation evicts it for
//! reuse. Cached blocks therefore cost nothing: they are ordinary free blocks
//! that happen to still hold valid K/V.
//!
//! The queue is an intrusive doubly linked list over block ids, so taking a
//! cached block out of the middle is O(1).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tandem_block_hash::{BlockHash, PrefixClosure, SetDigest};

use super::groups::{KvGroups, FREED};
use super::{BlockId, KvError};

const NIL: u32 = u32::MAX;

/// A change to the prefix cache, for routers that track which worker holds
/// which prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheEvent {
    /// `hash` (whose parent block is `parent`, [`ROOT`](tandem_block_hash::ROOT)
    /// for a first block) is now cached.
    Stored { parent: BlockHash, hash: BlockHash },
    /// `hash` was evicted.
    Removed { hash: BlockHash },
    /// `hash` (after `parent`) is now in the disk tier under the pool
    /// (written through; the engine emits these, not the pool).
    DiskStored { parent: BlockHash, hash: BlockHash },
    /// `hash` left the disk tier (evicted, a failed write, a corrupt file).
    DiskRemoved { hash: BlockHash },
}

impl CacheEvent {
    /// What the event's block counts as in the worker's set digest: its
    /// hash, salted when it is a disk-tier block.
    pub fn digest_member(&self) -> BlockHash {
        match *self {
            Self::Stored { hash, .. } | Self::Removed { hash } => hash,
            Self::DiskStored { hash, .. } | Self::DiskRemoved { hash } => {
                hash ^ tandem_block_hash::DISK_TIER_SALT
            }
        }
    }
}

#[derive(Debug, Clone)]
struct BlockMeta {
    refcount: u32,
    hash: Option<BlockHash>,
    parent: BlockHash,
    /// Whether routers were told of its hash (group 0's blocks only).
    announced: bool,
    prev: u32,
    next: u32,
}

/// Prefix-cache counters since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Blocks looked up on admission.
    pub queried_blocks: u64,
    /// Of those, blocks found cached.
    pub hit_blocks: u64,
    /// Cached blocks whose hash was dropped to reuse the block.
    pub evicted_blocks: u64,
}

#[derive(Debug)]
struct State {
    meta: Vec<BlockMeta>,
    /// Free queue: `head` is evicted first.
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
    stats: PrefixCacheStats,
    /// Changes since the last `drain_events`.
    events: Vec<CacheEvent>,
    /// The announced cached set, as its events describe it.
    announced: SetDigest,
    /// Whether the announced set holds every announced block's parent
    /// (routers binary-search a closed set's matches).
    closure: PrefixClosure,
    /// Announced registrations since the last `drain_registered`, while a
    /// lower tier wants them (`log_registrations`).
    registered: Option<Vec<Registered>>,
}

/// Announced cache changes, and the announced set after them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnouncedChanges {
    pub events: Vec<CacheEvent>,
    pub digest: SetDigest,
    /// Every announced block's parent is announced too
    /// ([`PrefixClosure`]).
    pub prefix_closed: bool,
}

/// A block the prefix cache named: a lower tier (the disk) copies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    pub block: BlockId,
    pub hash: BlockHash,
    pub parent: BlockHash,
}

impl State {
    fn push_back(&mut self, b: BlockId) {
        let tail = self.tail;
        self.meta[b as usize].prev = tail;
        self.meta[b as usize].next = NIL;
        if tail == NIL {
            self.head = b;
        } else {
            self.meta[tail as usize].next = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let (prev, next) = (self.meta[b as usize].prev, self.meta[b as usize].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        self.meta[b as usize].prev = NIL;
        self.meta[b as usize].next = NIL;
        self.num_free -= 1;
    }

    fn forget_hash(&mut self, b: BlockId) {
        if let Some(h) = self.meta[b as usize].hash.take() {
            if self.cached.get(&h) == Some(&b) {
                self.cached.remove(&h);
                if std::mem::take(&mut self.meta[b as usize].announced) {
                    self.announced.remove(h);
                    self.closure.remove(h);
                    self.events.push(CacheEvent::Removed { hash: h });
                }
            }
        }
    }
}

/// Hands out physical blocks and keeps the prefix cache. Cheap to clone;
/// clones share one pool.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    state: Arc<Mutex<State>>,
    num_blocks: usize,
    block_size: usize,
    groups: Arc<KvGroups>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `block_size` tokens, one table entry
    /// per logical block (no layer slides).
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        Self::with_groups(num_blocks, block_size, KvGroups::single(1))
    }

    /// A pool whose tables keep one entry per layer group per logical block
    /// ([`KvCache::allocator`](super::KvCache::allocator)).
    pub fn with_groups(
        num_blocks: usize,
        block_size: usize,
        groups: KvGroups,
    ) -> Result<Self, KvError> {
        if num_blocks == 0 || block_size == 0 || num_blocks >= NIL as usize {
            return Err(KvError::EmptyPool);
        }
        let mut st = State {
            meta: vec![
                BlockMeta {
                    refcount: 0,
                    hash: None,
                    parent: 0,
                    announced: false,
                    prev: NIL,
                    next: NIL,
                };
                num_blocks
            ],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
            stats: PrefixCacheStats::default(),
            events: Vec::new(),
            announced: SetDigest::default(),
            closure: PrefixClosure::default(),
            registered: None,
        };
        // Low ids first, which keeps tests readable.
        for b in 0..num_blocks as BlockId {
            st.push_back(b);
        }
        Ok(Self {
            state: Arc::new(Mutex::new(st)),
            num_blocks,
            block_size,
            groups: Arc::new(groups),
        })
    }

    /// The layer groups its tables serve.
    pub fn groups(&self) -> &KvGroups {
        &self.groups
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update completes before the lock is released and none can
        // panic half-way through a list splice (indices are in range by
        // construction), so a poisoned lock still guards a sound state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks no table references (cached ones included: they are evictable).
    pub fn num_free(&self) -> usize {
        self.lock().num_free
    }

    /// Blocks registered in the prefix cache, referenced or not.
    pub fn num_cached(&self) -> usize {
        self.lock().cached.len()
    }

    /// Prefix-cache counters.
    pub fn prefix_stats(&self) -> PrefixCacheStats {
        self.lock().stats
    }

    /// Takes `n` blocks from the head of the free queue, all or none,
    /// evicting their cached names.
    pub(super) fn take(&self, n: usize) -> Result<Vec<BlockId>, KvError> {
        let mut st = self.lock();
        if st.num_free < n {
            return Err(KvError::OutOfBlocks {
                needed: n,
                free: st.num_free,
                total: self.num_blocks,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = st.head;
            st.unlink(b);
            if st.meta[b as usize].hash.is_some() {
                st.forget_hash(b);
                st.stats.evicted_blocks += 1;
            }
            st.meta[b as usize].refcount = 1;
            out.push(b);
        }
        Ok(out)
    }

    /// Drops one reference to each block, in order; a block whose count
    /// reaches zero joins the tail of the free queue (evicted last).
    pub(super) fn release(&self, blocks: impl IntoIterator<Item = BlockId>) {
        let mut st = self.lock();
        for b in blocks {
            let rc = st.meta[b as usize].refcount;
            debug_assert!(rc > 0, "double free of block {b}");
            if rc == 0 {
                continue;
            }
            st.meta[b as usize].refcount = rc - 1;
            if rc == 1 {
                st.push_back(b);
            }
        }
    }

    /// Adds a reference to blocks already referenced (a fork).
    pub(super) fn share(&self, blocks: &[BlockId]) {
        let mut st = self.lock();
        for &b in blocks {
            debug_assert!(st.meta[b as usize].refcount > 0, "sharing free block {b}");
            st.meta[b as usize].refcount += 1;
        }
    }

    /// Reference count of one block.
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.lock()
            .meta
            .get(block as usize)
            .map_or(0, |m| m.refcount)
    }

    /// How many leading logical blocks of `hashes` a new table would take
    /// from the cache ([`acquire_cached`](Self::acquire_cached)), and how
    /// many of the blocks it would take are free (taking them shrinks the
    /// free pool). Changes nothing.
    pub fn probe(&self, hashes: &[BlockHash]) -> (usize, usize) {
        let st = self.lock();
        let hits = self.cached_prefix(&st, hashes);
        let free = self
            .prefix_names(hashes, hits)
            .flatten()
            .filter(|h| {
                st.cached
                    .get(h)
                    .is_some_and(|&b| st.meta[b as usize].refcount == 0)
            })
            .count();
        (hits, free)
    }

    /// Takes a reference to the cached blocks of the longest cached prefix
    /// of `hashes` and returns them as table entries (logical-major, one per
    /// group; [`FREED`] where a windowed group needs no block). Never fails:
    /// a miss ends the prefix.
    pub(super) fn acquire_cached(&self, hashes: &[BlockHash]) -> (usize, Vec<BlockId>) {
        let mut st = self.lock();
        let hits = self.cached_prefix(&st, hashes);
        st.stats.queried_blocks += hashes.len() as u64;
        st.stats.hit_blocks += hits as u64;
        let mut out = Vec::with_capacity(hits * self.groups.num_groups());
        for name in self.prefix_names(hashes, hits) {
            let Some(b) = name.and_then(|h| st.cached.get(&h).copied()) else {
                out.push(FREED);
                continue;
            };
            if st.meta[b as usize].refcount == 0 {
                st.unlink(b);
            }
            st.meta[b as usize].refcount += 1;
            out.push(b);
        }
        (hits, out)
    }

    /// Logical blocks of the longest prefix of `hashes` a table can start
    /// with: every global group holds each of them, and every windowed group
    /// the ones the next position's window reads.
    fn cached_prefix(&self, st: &State, hashes: &[BlockHash]) -> usize {
        let g = &self.groups;
        let cached = |i: usize, group: usize| st.cached.contains_key(&g.hash(group, hashes[i]));
        let mut n = hashes.len();
        for group in (0..g.num_groups()).filter(|&x| !g.is_windowed(x)) {
            n = (0..n).find(|&i| !cached(i, group)).unwrap_or(n);
        }
        while n > 0 {
            let from = g.window_start(n * self.block_size, self.block_size);
            let windowed_hit = (0..g.num_groups())
                .filter(|&x| g.is_windowed(x))
                .all(|group| (from..n).all(|i| cached(i, group)));
            if windowed_hit {
                break;
            }
            n -= 1;
        }
        n
    }

    /// The cache names of the first `hits` logical blocks' entries,
    /// logical-major; `None` for a windowed entry before the window.
    fn prefix_names<'h>(
        &'h self,
        hashes: &'h [BlockHash],
        hits: usize,
    ) -> impl Iterator<Item = Option<BlockHash>> + 'h {
        let g = &self.groups;
        let from = g.window_start(hits * self.block_size, self.block_size);
        (0..hits).flat_map(move |i| {
            (0..g.num_groups()).map(move |group| {
                (!g.is_windowed(group) || i >= from).then(|| g.hash(group, hashes[i]))
            })
        })
    }

    /// Names a full, computed, referenced block by its hash so later
    /// requests can reuse it. A hash already cached under another block
    /// (two requests computed the same prefix at once) is left as it is.
    /// Only group 0's names are announced to routers
    /// ([`drain_events`](Self::drain_events), [`snapshot`](Self::snapshot)):
    /// the others are salted copies no prompt's hashes match.
    pub(super) fn register(
        &self,
        block: BlockId,
        hash: BlockHash,
        parent: BlockHash,
        announce: bool,
    ) {
        let mut st = self.lock();
        if st.meta[block as usize].hash.is_some() || st.cached.contains_key(&hash) {
            return;
        }
        let meta = &mut st.meta[block as usize];
        meta.hash = Some(hash);
        meta.parent = parent;
        meta.announced = announce;
        st.cached.insert(hash, block);
        if announce {
            st.announced.insert(hash);
            st.closure.insert(hash, parent);
            st.events.push(CacheEvent::Stored { parent, hash });
            if let Some(log) = st.registered.as_mut() {
                log.push(Registered {
                    block,
                    hash,
                    parent,
                });
            }
        }
    }

    /// From now on, records every announced registration for
    /// [`drain_registered`](Self::drain_registered).
    pub fn log_registrations(&self) {
        self.lock().registered.get_or_insert_with(Vec::new);
    }

    /// Registrations recorded since the last call.
    pub fn drain_registered(&self) -> Vec<Registered> {
        self.lock()
            .registered
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether `block` still holds the cache entry `hash` (it was not
    /// evicted, truncated or reused since it was named).
    pub fn holds(&self, block: BlockId, hash: BlockHash) -> bool {
        self.lock().cached.get(&hash) == Some(&block)
    }

    /// Takes the cache changes recorded since the last call.
    pub fn drain_events(&self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.lock().events)
    }

    /// [`drain_events`](Self::drain_events), with what the announced set
    /// is once they are applied (read under the same lock).
    pub fn drain_announced(&self) -> AnnouncedChanges {
        let mut st = self.lock();
        AnnouncedChanges {
            events: std::mem::take(&mut st.events),
            digest: st.announced,
            prefix_closed: st.closure.is_closed(),
        }
    }

    /// Every cached block as a `Stored` event, parents before children
    /// (a snapshot for a new subscriber).
    pub fn snapshot(&self) -> Vec<CacheEvent> {
        self.snapshot_and_closure().0
    }

    /// [`snapshot`](Self::snapshot), and whether the announced set is
    /// prefix-closed (read under the same lock).
    pub fn snapshot_and_closure(&self) -> (Vec<CacheEvent>, bool) {
        let st = self.lock();
        (Self::snapshot_of(&st), st.closure.is_closed())
    }

    fn snapshot_of(st: &State) -> Vec<CacheEvent> {
        let mut out: Vec<CacheEvent> = Vec::with_capacity(st.cached.len());
        let mut emitted = std::collections::HashSet::new();
        // A chain's parent may itself be cached; emit parents first.
        let mut pending: Vec<BlockHash> = st
            .cached
            .iter()
            .filter(|(_, &b)| st.meta[b as usize].announced)
            .map(|(&h, _)| h)
            .collect();
        pending.sort_unstable();
        while let Some(h) = pending.pop() {
            if emitted.contains(&h) {
                continue;
            }
            let mut chain = vec![h];
            let mut cur = h;
            while let Some(&b) = st.cached.get(&cur) {
                let parent = st.meta[b as usize].parent;
                if parent == tandem_block_hash::ROOT
                    || emitted.contains(&parent)
                    || !st.cached.contains_key(&parent)
                {
                    break;
                }
                chain.push(parent);
                cur = parent;
            }
            for &x in chain.iter().rev() {
                if emitted.insert(x) {
                    if let Some(&b) = st.cached.get(&x) {
                        out.push(CacheEvent::Stored {
                            parent: st.meta[b as usize].parent,
                            hash: x,
                        });
                    }
                }
            }
        }
        out
    }

    /// Drops a block's cached name (its contents are about to change).
    pub(super) fn unregister(&self, block: BlockId) {
        self.lock().forget_hash(block);
    }

    /// Blocks with a nonzero reference count.
    pub fn referenced(&self) -> usize {
        let st = self.lock();
        st.meta.iter().filter(|m| m.refcount > 0).count()
    }

    /// Checks the pool's books: the free queue holds exactly the
    /// unreferenced blocks, referenced plus free is the whole pool, every
    /// cached name points at a block carrying it, and the references sum to
    /// `expected_refs` (the caller's count of blocks over all live tables).
    pub fn check_accounting(&self, expected_refs: usize) -> Result<(), String> {
        let st = self.lock();
        let mut walked = 0;
        let mut b = st.head;
        while b != NIL {
            if st.meta[b as usize].refcount != 0 {
                return Err(format!("block {b} is in the free queue but referenced"));
            }
            walked += 1;
            if walked > self.num_blocks {
                return Err("the free queue has a cycle".into());
            }
            b = st.meta[b as usize].next;
        }
        let unreferenced = st.meta.iter().filter(|m| m.refcount == 0).count();
        if walked != st.num_free || unreferenced != st.num_free {
            return Err(format!(
                "free count {} but {walked} queued and {unreferenced} unreferenced",
                st.num_free
            ));
        }
        let referenced = self.num_blocks - unreferenced;
        if referenced + st.num_free != self.num_blocks {
            return Err("referenced + free != total".into());
        }
        for (h, &b) in &st.cached {
            if st.meta[b as usize].hash != Some(*h) {
                return Err(format!("cached hash {h:#x} points at block {b} without it"));
            }
        }
        let refs: usize = st.meta.iter().map(|m| m.refcount as usize).sum();
        if refs != expected_refs {
            return Err(format!(
                "{refs} block references held in the pool, {expected_refs} in live tables"
            ));
        }
        Ok(())
    }
}
