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
//! without taking any block. Blocks are reference counted: prefix-cache hits
//! and forked sequences share them, and a shared partial block is copied
//! before it is written (copy-on-write). The allocator keeps freed full
//! blocks under their chained hash until it needs the memory
//! (the `allocator` module explains the LRU).
//!
//! Storage layout, per layer, for K and for V: `[block][kv_head][slot][head_dim]`,
//! so one head's keys of one block are contiguous (what attention streams) and
//! one block of one layer is one contiguous range (what a transfer sends).

mod allocator;
mod table;

pub use allocator::{BlockAllocator, CacheEvent, PrefixCacheStats};
pub use table::{BlockCopy, BlockTable};

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
    /// A whole-block write does not fit the cache.
    #[error(
        "bad KV block write: layer {layer}, block {block}, {len} values (a block holds {expected})"
    )]
    BadBlockWrite {
        layer: usize,
        block: BlockId,
        len: usize,
        expected: usize,
    },
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

    /// Copies one block's K and V, every layer (copy-on-write).
    pub fn copy_block(&mut self, copy: BlockCopy) {
        let n = self.layout.block_elems();
        let (s, d) = (copy.src as usize * n, copy.dst as usize * n);
        for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
            layer.copy_within(s..s + n, d);
        }
    }

    /// One block's K and V in one layer (`[kv_head][slot][head_dim]` each),
    /// e.g. to send it to another worker.
    pub fn block(&self, layer: usize, block: BlockId) -> (&[f32], &[f32]) {
        let n = self.layout.block_elems();
        let s = block as usize * n;
        (&self.k[layer][s..s + n], &self.v[layer][s..s + n])
    }

    /// Overwrites one block's K and V in one layer (a block received from
    /// another worker).
    pub fn write_block(
        &mut self,
        layer: usize,
        block: BlockId,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let n = self.layout.block_elems();
        if layer >= self.layout.num_layers
            || block as usize >= self.num_blocks
            || k.len() != n
            || v.len() != n
        {
            return Err(KvError::BadBlockWrite {
                layer,
                block,
                len: k.len().max(v.len()),
                expected: n,
            });
        }
        let s = block as usize * n;
        self.k[layer][s..s + n].copy_from_slice(k);
        self.v[layer][s..s + n].copy_from_slice(v);
        Ok(())
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

    fn hashes(n: usize) -> Vec<u64> {
        tandem_block_hash::block_hashes(&(0..n as u32 * 4).collect::<Vec<_>>(), 4)
    }

    #[test]
    fn freed_blocks_stay_cached_until_reused() {
        let pool = BlockAllocator::new(4, 4).expect("pool");
        let h = hashes(2);
        let mut a = BlockTable::new(&pool);
        assert_eq!(a.append(8).expect("two blocks"), None);
        a.register_computed(&h, 8);
        let a_blocks = a.blocks().to_vec();
        drop(a);
        assert_eq!(pool.num_free(), 4, "cached blocks are free");
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(pool.probe(&h), (2, 2));
        let b = BlockTable::from_cached_prefix(&pool, &h);
        assert_eq!(b.blocks(), &a_blocks[..]);
        assert_eq!(b.num_tokens(), 8);
        assert_eq!(pool.num_free(), 2);
        pool.check_accounting(2).expect("books");
        drop(b);
        // Two fresh blocks come from the never-cached ones first (LRU head).
        let mut c = BlockTable::new(&pool);
        c.append(8).expect("two");
        assert_eq!(pool.num_cached(), 2, "cached blocks were not evicted");
        // The next allocation must evict; the tail block of `a` goes first.
        let mut d = BlockTable::new(&pool);
        d.append(4).expect("one");
        assert_eq!(d.blocks(), &[a_blocks[1]]);
        assert_eq!(pool.probe(&h), (1, 1), "block 0 is still cached");
        assert_eq!(pool.prefix_stats().evicted_blocks, 1);
        pool.check_accounting(3).expect("books");
    }

    #[test]
    fn fork_shares_and_copy_on_write_splits_the_partial_block() {
        let pool = BlockAllocator::new(8, 4).expect("pool");
        let mut a = BlockTable::new(&pool);
        a.append(6).expect("prompt");
        let b = a.fork();
        let mut b = b;
        assert_eq!(pool.refcount(a.blocks()[1]), 2);
        pool.check_accounting(4).expect("books");
        let copy = b.append(1).expect("append").expect("a copy-on-write");
        assert_eq!(copy.src, a.blocks()[1]);
        assert_ne!(b.blocks()[1], a.blocks()[1]);
        assert_eq!(b.blocks()[0], a.blocks()[0], "the full block stays shared");
        // `a` now owns its tail alone and appends in place.
        assert_eq!(a.append(1).expect("append"), None);
        pool.check_accounting(4).expect("books");
        drop(a);
        drop(b);
        assert_eq!(pool.num_free(), 8);
        pool.check_accounting(0).expect("books");
    }

    #[test]
    fn a_failed_copy_on_write_changes_nothing() {
        let pool = BlockAllocator::new(2, 4).expect("pool");
        let mut a = BlockTable::new(&pool);
        a.append(6).expect("two blocks");
        let mut b = a.fork();
        assert!(b.append(1).is_err());
        assert_eq!(b.blocks(), a.blocks());
        assert_eq!(b.num_tokens(), 6);
        pool.check_accounting(4).expect("books");
    }

    #[test]
    fn truncating_into_a_cached_block_uncaches_it() {
        let pool = BlockAllocator::new(4, 4).expect("pool");
        let h = hashes(2);
        let mut a = BlockTable::new(&pool);
        a.append(8).expect("two");
        a.register_computed(&h, 8);
        a.truncate(2);
        assert_eq!(pool.probe(&h), (1, 0), "block 1 will be overwritten");
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
