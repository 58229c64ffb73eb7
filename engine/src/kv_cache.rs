//! The paged KV cache.
//!
//! K and V live in fixed-size blocks (default 16 tokens) in one pool per layer;
//! a sequence owns a [`BlockTable`] mapping its logical block `i` (positions
//! `i*block_size ..`) to a physical block. There are no per-sequence KV
//! buffers anywhere: attention reads through the table.
//!
//! Ownership is RAII: a [`BlockTable`] returns its blocks to the
//! [`BlockAllocator`] when dropped, so no error path can leak KV memory, and
//! an allocation that cannot be met fails with [`KvError::OutOfBlocks`]
//! without taking any block.
//!
//! Storage layout, per layer, for K and for V: `[block][kv_head][slot][head_dim]`,
//! so one head's keys of one block are contiguous (what attention streams) and
//! one block of one layer is one contiguous range (what a transfer sends).

use std::sync::{Arc, Mutex, MutexGuard};

/// A physical block index into the pool.
pub type BlockId = u32;

/// Errors of the block allocator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Not enough free blocks for the request.
    #[error("KV cache exhausted: need {needed} more blocks, {free} free of {total}")]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
    },
    /// The pool was configured with nothing to give.
    #[error("KV cache must have at least one block of at least one token")]
    EmptyPool,
}

/// The shape of one worker's KV cache. Two workers can exchange blocks only
/// if their layouts are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl KvLayout {
    /// f32 elements of K (or of V) in one block of one layer.
    pub fn block_elems(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Bytes of K and V, all layers, for one block.
    pub fn block_bytes(&self) -> usize {
        2 * self.num_layers * self.block_elems() * std::mem::size_of::<f32>()
    }
}

#[derive(Debug)]
struct AllocatorState {
    free: Vec<BlockId>,
    refcount: Vec<u32>,
}

/// Hands out physical blocks. Cheap to clone; clones share one pool.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    state: Arc<Mutex<AllocatorState>>,
    num_blocks: usize,
    block_size: usize,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(KvError::EmptyPool);
        }
        // Pop from the end: hand out low ids first, which keeps tests readable.
        let free = (0..num_blocks as BlockId).rev().collect();
        Ok(Self {
            state: Arc::new(Mutex::new(AllocatorState {
                free,
                refcount: vec![0; num_blocks],
            })),
            num_blocks,
            block_size,
        })
    }

    fn lock(&self) -> MutexGuard<'_, AllocatorState> {
        // A panic while holding this lock cannot leave the state half-updated
        // (every update is a single push/pop plus a counter), so poisoning is
        // safe to ignore.
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

    /// Blocks not owned by any table.
    pub fn num_free(&self) -> usize {
        self.lock().free.len()
    }

    /// Takes `n` blocks, all or none.
    fn take(&self, n: usize) -> Result<Vec<BlockId>, KvError> {
        let mut st = self.lock();
        if st.free.len() < n {
            return Err(KvError::OutOfBlocks {
                needed: n,
                free: st.free.len(),
                total: self.num_blocks,
            });
        }
        let at = st.free.len() - n;
        let blocks: Vec<BlockId> = st.free.drain(at..).rev().collect();
        for &b in &blocks {
            st.refcount[b as usize] = 1;
        }
        Ok(blocks)
    }

    fn release(&self, blocks: &[BlockId]) {
        let mut st = self.lock();
        for &b in blocks {
            let rc = &mut st.refcount[b as usize];
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                st.free.push(b);
            }
        }
    }

    /// Blocks with a nonzero reference count; equals `num_blocks - num_free`
    /// when the accounting is sound (tests check it after every step).
    pub fn referenced(&self) -> usize {
        let st = self.lock();
        st.refcount.iter().filter(|&&r| r > 0).count()
    }
}

/// The blocks of one sequence, in logical order. Returns them on drop.
#[derive(Debug)]
pub struct BlockTable {
    allocator: BlockAllocator,
    blocks: Vec<BlockId>,
    num_tokens: usize,
}

impl BlockTable {
    /// An empty table drawing from `allocator`.
    pub fn new(allocator: &BlockAllocator) -> Self {
        Self {
            allocator: allocator.clone(),
            blocks: Vec::new(),
            num_tokens: 0,
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
        self.blocks.len() * self.allocator.block_size
    }

    /// Blocks needed to grow to `total_tokens`.
    pub fn blocks_needed(&self, total_tokens: usize) -> usize {
        total_tokens
            .div_ceil(self.allocator.block_size)
            .saturating_sub(self.blocks.len())
    }

    /// Grows the table so it can hold `n` more tokens, and counts them.
    /// On failure nothing changes.
    pub fn append(&mut self, n: usize) -> Result<(), KvError> {
        let total = self.num_tokens + n;
        let need = self.blocks_needed(total);
        if need > 0 {
            let new = self.allocator.take(need)?;
            self.blocks.extend(new);
        }
        self.num_tokens = total;
        Ok(())
    }

    /// Forgets the last `n` tokens, returning blocks that become empty
    /// (e.g. rejected speculative tokens).
    pub fn truncate(&mut self, n: usize) {
        self.num_tokens = self.num_tokens.saturating_sub(n);
        let keep = self.num_tokens.div_ceil(self.allocator.block_size);
        if keep < self.blocks.len() {
            let gone: Vec<BlockId> = self.blocks.drain(keep..).collect();
            self.allocator.release(&gone);
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.allocator.release(&self.blocks);
    }
}

/// The K/V storage for every block of every layer.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    num_blocks: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// Zeroed storage for `num_blocks` blocks of `layout`.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let per_layer = num_blocks * layout.block_elems();
        Self {
            layout,
            num_blocks,
            k: (0..layout.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
            v: (0..layout.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
        }
    }

    /// The cache's layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks of storage.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Offset of `(block, head, slot)` inside one layer's K or V.
    #[inline]
    pub fn offset(&self, block: BlockId, head: usize, slot: usize) -> usize {
        let l = &self.layout;
        ((block as usize * l.num_kv_heads + head) * l.block_size + slot) * l.head_dim
    }

    /// One layer's K and V pools, read-only.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// Writes one token's K and V rows (`[kv_head][head_dim]`) at `slot` of
    /// `block` in `layer`.
    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.layout.head_dim;
        for h in 0..self.layout.num_kv_heads {
            let o = self.offset(block, h, slot);
            self.k[layer][o..o + d].copy_from_slice(&k[h * d..(h + 1) * d]);
            self.v[layer][o..o + d].copy_from_slice(&v[h * d..(h + 1) * d]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_append_free() {
        let pool = BlockAllocator::new(4, 16).expect("pool");
        let mut t = BlockTable::new(&pool);
        t.append(1).expect("first token");
        assert_eq!(t.blocks().len(), 1);
        t.append(15).expect("fill the block");
        assert_eq!(t.blocks().len(), 1, "16 tokens fit one block");
        t.append(1).expect("spill");
        assert_eq!(t.blocks().len(), 2);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.referenced(), 2);
        drop(t);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.referenced(), 0);
    }

    #[test]
    fn exhaustion_is_an_error_and_takes_nothing() {
        let pool = BlockAllocator::new(3, 4).expect("pool");
        let mut a = BlockTable::new(&pool);
        a.append(8).expect("two blocks");
        let mut b = BlockTable::new(&pool);
        let err = b.append(8).expect_err("only one block left");
        assert_eq!(
            err,
            KvError::OutOfBlocks {
                needed: 2,
                free: 1,
                total: 3
            }
        );
        assert_eq!(b.num_tokens(), 0);
        assert!(b.blocks().is_empty());
        assert_eq!(pool.num_free(), 1, "a failed append takes no block");
        b.append(4).expect("one block still fits");
        assert!(a.append(1).is_err());
    }

    #[test]
    fn truncate_returns_emptied_blocks() {
        let pool = BlockAllocator::new(4, 4).expect("pool");
        let mut t = BlockTable::new(&pool);
        t.append(9).expect("three blocks");
        t.truncate(5);
        assert_eq!(t.num_tokens(), 4);
        assert_eq!(t.blocks().len(), 1);
        assert_eq!(pool.num_free(), 3);
    }

    #[test]
    fn empty_pool_is_rejected() {
        assert_eq!(BlockAllocator::new(0, 16).err(), Some(KvError::EmptyPool));
        assert_eq!(BlockAllocator::new(4, 0).err(), Some(KvError::EmptyPool));
    }

    #[test]
    fn write_lands_in_the_right_block_and_head() {
        let layout = KvLayout {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 3,
            block_size: 4,
        };
        let mut kv = KvCache::new(layout, 5);
        kv.write(
            1,
            3,
            2,
            &[1., 2., 3., 4., 5., 6.],
            &[7., 8., 9., 10., 11., 12.],
        );
        let (k, v) = kv.layer(1);
        let o = kv.offset(3, 1, 2);
        assert_eq!(&k[o..o + 3], &[4., 5., 6.]);
        assert_eq!(&v[o..o + 3], &[10., 11., 12.]);
        assert!(kv.layer(0).0.iter().all(|&x| x == 0.0));
    }
}
