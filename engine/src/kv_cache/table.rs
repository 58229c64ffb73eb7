//! A sequence's block table: RAII ownership of its blocks.

use tandem_block_hash::BlockHash;

use super::{BlockAllocator, BlockId, KvError};

/// A block that was shared and had to be copied before it could be written:
/// copy `src`'s K/V into `dst` (see [`KvCache::copy_block`](super::KvCache::copy_block))
/// before the next forward pass writes to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// The blocks of one sequence, in logical order. Returns them on drop.
#[derive(Debug)]
pub struct BlockTable {
    allocator: BlockAllocator,
    blocks: Vec<BlockId>,
    num_tokens: usize,
    /// Leading blocks already registered in (or taken from) the prefix cache.
    num_registered: usize,
}

impl BlockTable {
    /// An empty table drawing from `allocator`.
    pub fn new(allocator: &BlockAllocator) -> Self {
        Self {
            allocator: allocator.clone(),
            blocks: Vec::new(),
            num_tokens: 0,
            num_registered: 0,
        }
    }

    /// A table starting with the cached blocks of the longest cached prefix
    /// of `hashes` (full blocks only). Its token count is the prefix length.
    pub fn from_cached_prefix(allocator: &BlockAllocator, hashes: &[BlockHash]) -> Self {
        let blocks = allocator.acquire_cached(hashes);
        let n = blocks.len();
        Self {
            allocator: allocator.clone(),
            num_tokens: n * allocator.block_size(),
            blocks,
            num_registered: n,
        }
    }

    /// Physical blocks, logical order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Tokens whose K/V the table holds (or is about to).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Token capacity of the blocks already held.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.allocator.block_size()
    }

    /// Blocks needed to grow to `total_tokens` (not counting a copy-on-write).
    pub fn blocks_needed(&self, total_tokens: usize) -> usize {
        total_tokens
            .div_ceil(self.allocator.block_size())
            .saturating_sub(self.blocks.len())
    }

    /// Grows the table so it can hold `n` more tokens, and counts them. On
    /// failure nothing changes.
    ///
    /// If the last block is partly filled and shared with another table (a
    /// fork), it is replaced by a private copy first; the returned
    /// [`BlockCopy`] must be applied to the KV cache before the next write.
    pub fn append(&mut self, n: usize) -> Result<Option<BlockCopy>, KvError> {
        let total = self.num_tokens + n;
        let grow = self.blocks_needed(total);
        let partial = !self.num_tokens.is_multiple_of(self.allocator.block_size());
        let shared_tail = match self.blocks.last() {
            Some(&b) if n > 0 && partial => self.allocator.refcount(b) > 1,
            _ => false,
        };
        let mut new = self.allocator.take(grow + usize::from(shared_tail))?;
        let copy = if shared_tail {
            let dst = new.remove(0);
            let last = self.blocks.len() - 1;
            let src = std::mem::replace(&mut self.blocks[last], dst);
            self.allocator.release([src]);
            Some(BlockCopy { src, dst })
        } else {
            None
        };
        self.blocks.extend(new);
        self.num_tokens = total;
        Ok(copy)
    }

    /// A second table sharing every block of this one (each gains a
    /// reference). The first append to a shared partial block copies it.
    pub fn fork(&self) -> Self {
        self.allocator.share(&self.blocks);
        Self {
            allocator: self.allocator.clone(),
            blocks: self.blocks.clone(),
            num_tokens: self.num_tokens,
            num_registered: self.num_registered,
        }
    }

    /// Registers in the prefix cache every full block whose K/V is computed:
    /// blocks `0 .. computed_tokens / block_size`, named by `hashes` (the
    /// chained hashes of the sequence's full blocks). Idempotent.
    pub fn register_computed(&mut self, hashes: &[BlockHash], computed_tokens: usize) {
        let full = (computed_tokens / self.allocator.block_size())
            .min(hashes.len())
            .min(self.blocks.len());
        let from = self.num_registered.min(full);
        let blocks = self.blocks[from..full].iter();
        for (i, (&block, &hash)) in (from..).zip(blocks.zip(&hashes[from..full])) {
            let parent = match i {
                0 => tandem_block_hash::ROOT,
                _ => hashes[i - 1],
            };
            self.allocator.register(block, hash, parent);
        }
        self.num_registered = self.num_registered.max(full);
    }

    /// Forgets the last `n` tokens, returning blocks that become empty
    /// (e.g. rejected speculative tokens). A block left partly filled loses
    /// its cached name if this table owns it alone, since it will be
    /// overwritten.
    pub fn truncate(&mut self, n: usize) {
        let bs = self.allocator.block_size();
        self.num_tokens = self.num_tokens.saturating_sub(n);
        let keep = self.num_tokens.div_ceil(bs);
        if keep < self.blocks.len() {
            let gone: Vec<BlockId> = self.blocks.drain(keep..).rev().collect();
            self.allocator.release(gone);
        }
        let full = self.num_tokens / bs;
        if self.num_registered > full {
            if let Some(&b) = self.blocks.get(full) {
                if self.allocator.refcount(b) == 1 {
                    self.allocator.unregister(b);
                }
            }
            self.num_registered = full;
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        // Tail first: the last blocks of a sequence are the least likely to
        // be shared by a later request, so they are evicted first.
        self.allocator.release(self.blocks.iter().rev().copied());
    }
}
