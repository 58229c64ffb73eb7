//! A sequence's block table: RAII ownership of its blocks.

use tandem_block_hash::BlockHash;

use super::{BlockAllocator, BlockId, KvError, FREED};

/// A block that was shared and had to be copied before it could be written:
/// copy `src`'s K/V into `dst` (see [`KvCache::copy_block`](super::KvCache::copy_block))
/// before the next forward pass writes to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// The blocks of one sequence, in logical order. Returns them on drop.
///
/// Entries are logical-major: logical block `i` of layer group `g` is
/// `blocks()[i * groups + g]` ([`KvGroups`](super::KvGroups); one group,
/// one entry per logical block, unless some layers slide). A windowed
/// group's entries before its window are [`FREED`].
#[derive(Debug)]
pub struct BlockTable {
    allocator: BlockAllocator,
    blocks: Vec<BlockId>,
    num_tokens: usize,
    /// Leading logical blocks already registered in (or taken from) the
    /// prefix cache.
    num_registered: usize,
    /// Logical blocks below this are freed in every windowed group.
    windowed_from: usize,
}

impl BlockTable {
    /// An empty table drawing from `allocator`.
    pub fn new(allocator: &BlockAllocator) -> Self {
        Self {
            allocator: allocator.clone(),
            blocks: Vec::new(),
            num_tokens: 0,
            num_registered: 0,
            windowed_from: 0,
        }
    }

    /// A table starting with the cached blocks of the longest cached prefix
    /// of `hashes` (full blocks only). Its token count is the prefix length.
    pub fn from_cached_prefix(allocator: &BlockAllocator, hashes: &[BlockHash]) -> Self {
        let (n, blocks) = allocator.acquire_cached(hashes);
        let bs = allocator.block_size();
        Self {
            allocator: allocator.clone(),
            num_tokens: n * bs,
            blocks,
            num_registered: n,
            windowed_from: allocator.groups().window_start(n * bs, bs).min(n),
        }
    }

    fn groups(&self) -> usize {
        self.allocator.groups().num_groups()
    }

    /// Table entries, logical-major (see the type's docs).
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Logical blocks (entries per group).
    pub fn num_logical(&self) -> usize {
        self.blocks.len() / self.groups()
    }

    /// Physical blocks held (freed entries not counted).
    pub fn num_held(&self) -> usize {
        self.blocks.iter().filter(|&&b| b != FREED).count()
    }

    fn held(&self) -> impl DoubleEndedIterator<Item = BlockId> + '_ {
        self.blocks.iter().copied().filter(|&b| b != FREED)
    }

    /// Tokens whose K/V the table holds (or is about to).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Token capacity of the blocks already held.
    pub fn capacity(&self) -> usize {
        self.num_logical() * self.allocator.block_size()
    }

    /// Physical blocks needed to grow to `total_tokens` (not counting a
    /// copy-on-write).
    pub fn blocks_needed(&self, total_tokens: usize) -> usize {
        total_tokens
            .div_ceil(self.allocator.block_size())
            .saturating_sub(self.num_logical())
            * self.groups()
    }

    /// Grows the table so it can hold `n` more tokens, and counts them. On
    /// failure nothing changes.
    ///
    /// If the last logical block is partly filled and shared with another
    /// table (a fork), its entries are replaced by private copies first; the
    /// returned [`BlockCopy`]s must be applied to the KV cache before the
    /// next write.
    pub fn append(&mut self, n: usize) -> Result<Vec<BlockCopy>, KvError> {
        let total = self.num_tokens + n;
        let grow = self.blocks_needed(total);
        let partial = !self.num_tokens.is_multiple_of(self.allocator.block_size());
        let g = self.groups();
        let tail = self.blocks.len().saturating_sub(g);
        let shared: Vec<usize> = if n > 0 && partial {
            (tail..self.blocks.len())
                .filter(|&i| self.blocks[i] != FREED && self.allocator.refcount(self.blocks[i]) > 1)
                .collect()
        } else {
            Vec::new()
        };
        let mut copy_dst = self.allocator.take(grow + shared.len())?;
        let new = copy_dst.split_off(shared.len());
        let mut copies = Vec::with_capacity(shared.len());
        for (i, dst) in shared.into_iter().zip(copy_dst) {
            let src = std::mem::replace(&mut self.blocks[i], dst);
            self.allocator.release([src]);
            copies.push(BlockCopy { src, dst });
        }
        self.blocks.extend(new);
        self.num_tokens = total;
        Ok(copies)
    }

    /// A second table sharing every block of this one (each gains a
    /// reference). The first append to a shared partial block copies it.
    pub fn fork(&self) -> Self {
        let held: Vec<BlockId> = self.held().collect();
        self.allocator.share(&held);
        Self {
            allocator: self.allocator.clone(),
            blocks: self.blocks.clone(),
            num_tokens: self.num_tokens,
            num_registered: self.num_registered,
            windowed_from: self.windowed_from,
        }
    }

    /// Registers in the prefix cache every full block whose K/V is computed:
    /// logical blocks `0 .. computed_tokens / block_size`, named by `hashes`
    /// (the chained hashes of the sequence's full blocks). Idempotent.
    pub fn register_computed(&mut self, hashes: &[BlockHash], computed_tokens: usize) {
        let full = (computed_tokens / self.allocator.block_size())
            .min(hashes.len())
            .min(self.num_logical());
        let from = self.num_registered.min(full);
        let groups = self.allocator.groups().clone();
        let g = groups.num_groups();
        for i in from..full {
            for group in 0..g {
                let block = self.blocks[i * g + group];
                if block == FREED {
                    continue;
                }
                let parent = match i {
                    0 => tandem_block_hash::ROOT,
                    _ => groups.hash(group, hashes[i - 1]),
                };
                let hash = groups.hash(group, hashes[i]);
                self.allocator.register(block, hash, parent, group == 0);
            }
        }
        self.num_registered = self.num_registered.max(full);
    }

    /// Returns the blocks of windowed groups that no query from position
    /// `next_pos` on reads (their last position is before its window).
    /// Returns how many went back to the pool; full ones stay in the prefix
    /// cache until evicted.
    pub fn release_outside_window(&mut self, next_pos: usize) -> usize {
        let groups = self.allocator.groups();
        if !groups.any_windowed() {
            return 0;
        }
        let g = groups.num_groups();
        let upto = groups
            .window_start(next_pos, self.allocator.block_size())
            .min(self.num_logical());
        let windowed: Vec<usize> = (0..g).filter(|&x| groups.is_windowed(x)).collect();
        let mut gone = Vec::new();
        for i in self.windowed_from..upto {
            for &group in &windowed {
                let entry = std::mem::replace(&mut self.blocks[i * g + group], FREED);
                if entry != FREED {
                    gone.push(entry);
                }
            }
        }
        self.windowed_from = self.windowed_from.max(upto);
        let n = gone.len();
        self.allocator.release(gone);
        n
    }

    /// Forgets the last `n` tokens, returning blocks that become empty
    /// (e.g. rejected speculative tokens). A block left partly filled loses
    /// its cached name if this table owns it alone, since it will be
    /// overwritten.
    pub fn truncate(&mut self, n: usize) {
        let bs = self.allocator.block_size();
        let g = self.groups();
        self.num_tokens = self.num_tokens.saturating_sub(n);
        let keep = self.num_tokens.div_ceil(bs);
        if keep < self.num_logical() {
            let gone: Vec<BlockId> = self
                .blocks
                .drain(keep * g..)
                .rev()
                .filter(|&b| b != FREED)
                .collect();
            self.allocator.release(gone);
        }
        let full = self.num_tokens / bs;
        if self.num_registered > full {
            for group in 0..g {
                if let Some(&b) = self.blocks.get(full * g + group) {
                    if b != FREED && self.allocator.refcount(b) == 1 {
                        self.allocator.unregister(b);
                    }
                }
            }
            self.num_registered = full;
        }
        self.windowed_from = self.windowed_from.min(self.num_logical());
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        // Tail first: the last blocks of a sequence are the least likely to
        // be shared by a later request, so they are evicted first.
        let held: Vec<BlockId> = self.held().rev().collect();
        self.allocator.release(held);
    }
}
