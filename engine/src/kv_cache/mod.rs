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
//! A latent layout ([`KvRows::Latent`], multi-head latent attention) has one
//! row per token and no V pool: attention reads its values from the same
//! row it scores.
//! Elements are f32, 16-bit floats ([`KvCacheDtype::Bf16`],
//! [`KvCacheDtype::F16`], `half.rs`), or 8-bit codes ([`KvCacheDtype::Int8`],
//! [`KvCacheDtype::Fp8E4m3`]) of Hadamard-rotated rows with one scale per
//! row (`q8.rs`); attention reads each through [`LayerView`], a row at a
//! time.

mod allocator;
mod dtype;
mod groups;
mod half;
mod q8;
mod table;

use std::borrow::Cow;

use half::Half;
use q8::{Code, Q8Pool};

pub use q8::{rotate as rotate_row, unrotate as unrotate_row};

pub use allocator::{BlockAllocator, CacheEvent, PrefixCacheStats, Registered};
pub use dtype::KvCacheDtype;
pub use groups::{KvFootprint, KvGroups, SlidingLayers, FREED};
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
    /// Which layers slide: their blocks are freed once out of the window
    /// (see [`KvGroups`]).
    pub sliding: SlidingLayers,
    /// What a row holds: a head's K and V, or one token's latent.
    pub rows: KvRows,
}

/// What one cached row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum KvRows {
    /// A KV head's key, and beside it in the V pool its value
    /// (`num_kv_heads × head_dim` each per token).
    #[default]
    PerHead,
    /// One latent of `head_dim` per token and layer (`num_kv_heads` is 1),
    /// no V pool: multi-head latent attention scores the latent and sums it
    /// as the value (DeepSeek-V2/V3, `crate::model::mla`).
    Latent,
}

impl KvLayout {
    /// f32 elements of K in one block of one layer (and of V, per head).
    pub fn block_elems(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    /// f32 elements of V in one block of one layer: none for a latent.
    pub fn value_elems(&self) -> usize {
        match self.rows {
            KvRows::PerHead => self.block_elems(),
            KvRows::Latent => 0,
        }
    }

    /// Pools per layer: K and V, or the latent alone.
    pub fn pools_per_layer(&self) -> usize {
        match self.rows {
            KvRows::PerHead => 2,
            KvRows::Latent => 1,
        }
    }

    /// f32 values of one block in every layer, K then V per layer (what a
    /// block read out for a transfer or a disk holds).
    pub fn block_values(&self) -> usize {
        self.num_layers * (self.block_elems() + self.value_elems())
    }

    /// Layers one physical block holds: all of them unless some slide and
    /// some do not (then the gcd of the two counts, [`KvGroups`]).
    pub fn layers_per_block(&self) -> usize {
        let windowed = self.sliding.count(self.num_layers);
        match windowed {
            0 => self.num_layers.max(1),
            w if w == self.num_layers => self.num_layers,
            w => groups::gcd(w, self.num_layers - w),
        }
    }

    /// Bytes of K and V, every layer it holds, for one physical block.
    pub fn block_bytes(&self) -> usize {
        let per_layer = self.block_elems() + self.value_elems();
        self.layers_per_block() * per_layer * std::mem::size_of::<f32>()
    }
}

/// Per layer, K and V pools in the cache's element type.
#[derive(Debug)]
enum Storage {
    F32 {
        k: Vec<Vec<f32>>,
        v: Vec<Vec<f32>>,
    },
    Half {
        half: Half,
        k: Vec<Vec<u16>>,
        v: Vec<Vec<u16>>,
    },
    Q8 {
        code: Code,
        k: Vec<Q8Pool>,
        v: Vec<Q8Pool>,
    },
}

/// Read access to one layer's K and V, a row (one token of one KV head) at
/// a time; rows are numbered by [`KvCache::offset`]` / head_dim`.
#[derive(Debug, Clone, Copy)]
pub struct LayerView<'a>(View<'a>);

#[derive(Debug, Clone, Copy)]
enum View<'a> {
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    Half {
        half: Half,
        k: &'a [u16],
        v: &'a [u16],
    },
    Q8 {
        code: Code,
        k: &'a Q8Pool,
        v: &'a Q8Pool,
    },
}

impl LayerView<'_> {
    /// Whether rows are stored rotated ([`rotate_row`]): attention must
    /// then rotate each query before scoring and its output after summing
    /// values (`q8.rs` explains why 8-bit rows are).
    #[inline]
    pub fn rotated(&self) -> bool {
        matches!(self.0, View::Q8 { .. })
    }

    /// Key row `row` in f32 (borrowed for f32 storage, decoded into `buf`
    /// otherwise) and the factor it must be multiplied by.
    #[inline]
    pub fn key<'b>(&'b self, row: usize, buf: &'b mut [f32]) -> (&'b [f32], f32) {
        let mut scale = [0.0];
        let key = self.rows(true, row, buf, &mut scale);
        (key, scale[0])
    }

    /// Key rows `row0..row0 + scales.len()` in f32, row after row
    /// (borrowed for f32 storage, decoded into `buf` otherwise, which must
    /// hold them), with each row's factor written to `scales`.
    #[inline]
    pub fn key_rows<'b>(
        &'b self,
        row0: usize,
        buf: &'b mut [f32],
        scales: &mut [f32],
    ) -> &'b [f32] {
        self.rows(true, row0, buf, scales)
    }

    /// As [`key_rows`](Self::key_rows) for value rows.
    #[inline]
    pub fn value_rows<'b>(
        &'b self,
        row0: usize,
        buf: &'b mut [f32],
        scales: &mut [f32],
    ) -> &'b [f32] {
        self.rows(false, row0, buf, scales)
    }

    #[inline]
    fn rows<'b>(
        &'b self,
        keys: bool,
        row0: usize,
        buf: &'b mut [f32],
        scales: &mut [f32],
    ) -> &'b [f32] {
        match &self.0 {
            View::F32 { k, v } => {
                let pool = if keys { k } else { v };
                rows_f32(pool, row0, buf.len() / scales.len().max(1), scales)
            }
            View::Half { half, k, v } => {
                rows_half(*half, if keys { k } else { v }, row0, buf, scales)
            }
            View::Q8 { code, k, v } => rows_q8(*code, if keys { k } else { v }, row0, buf, scales),
        }
    }
}

/// `scales.len()` rows of `d` f32 from `row0`, borrowed.
fn rows_f32<'b>(pool: &'b [f32], row0: usize, d: usize, scales: &mut [f32]) -> &'b [f32] {
    scales.fill(1.0);
    &pool[row0 * d..(row0 + scales.len()) * d]
}

/// `scales.len()` 16-bit rows from `row0`, decoded into `buf`.
fn rows_half<'b>(
    half: Half,
    pool: &[u16],
    row0: usize,
    buf: &'b mut [f32],
    scales: &mut [f32],
) -> &'b [f32] {
    let d = buf.len() / scales.len().max(1);
    let n = scales.len() * d;
    half.decode_into(&pool[row0 * d..row0 * d + n], &mut buf[..n]);
    scales.fill(1.0);
    &buf[..n]
}

/// `scales.len()` 8-bit rows from `row0`, decoded into `buf`, with their
/// scales.
fn rows_q8<'b>(
    code: Code,
    pool: &Q8Pool,
    row0: usize,
    buf: &'b mut [f32],
    scales: &mut [f32],
) -> &'b [f32] {
    let d = buf.len() / scales.len().max(1);
    let n = scales.len() * d;
    code.decode_into(&pool.codes[row0 * d..row0 * d + n], &mut buf[..n]);
    for (i, s) in scales.iter_mut().enumerate() {
        *s = pool.scales[row0 + i].to_f32();
    }
    &buf[..n]
}

/// The K/V storage for every block of every layer: one pool per slot of a
/// block ([`KvGroups`]; one per layer when no layer slides).
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    groups: KvGroups,
    num_blocks: usize,
    dtype: KvCacheDtype,
    storage: Storage,
}

impl KvCache {
    /// Zeroed f32 storage for `num_blocks` blocks of `layout`.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        Self::with_dtype(layout, num_blocks, KvCacheDtype::F32)
    }

    /// Zeroed storage of `dtype` for `num_blocks` blocks of `layout`.
    pub fn with_dtype(layout: KvLayout, num_blocks: usize, dtype: KvCacheDtype) -> Self {
        let groups = KvGroups::of(&layout);
        let pools = if layout.num_layers == 0 {
            0
        } else {
            groups.slots()
        };
        let per_pool = num_blocks * layout.block_elems();
        // A latent layout has no V pool.
        let per_v_pool = num_blocks * layout.value_elems();
        let storage = match (dtype.code(), dtype.half()) {
            (None, None) => Storage::F32 {
                k: (0..pools).map(|_| vec![0.0; per_pool]).collect(),
                v: (0..pools).map(|_| vec![0.0; per_v_pool]).collect(),
            },
            (None, Some(half)) => Storage::Half {
                half,
                k: (0..pools).map(|_| vec![0; per_pool]).collect(),
                v: (0..pools).map(|_| vec![0; per_v_pool]).collect(),
            },
            (Some(code), _) => {
                let pool = |blocks| {
                    (0..pools)
                        .map(|_| {
                            Q8Pool::new(
                                blocks,
                                layout.num_kv_heads,
                                layout.block_size,
                                layout.head_dim,
                            )
                        })
                        .collect()
                };
                let v_blocks = match layout.rows {
                    KvRows::PerHead => num_blocks,
                    KvRows::Latent => 0,
                };
                Storage::Q8 {
                    code,
                    k: pool(num_blocks),
                    v: pool(v_blocks),
                }
            }
        };
        Self {
            layout,
            groups,
            num_blocks,
            dtype,
            storage,
        }
    }

    /// A block allocator over this cache's blocks and layer groups: the
    /// tables it hands out have the entries this cache's layers read.
    pub fn allocator(&self) -> Result<BlockAllocator, KvError> {
        BlockAllocator::with_groups(self.num_blocks, self.layout.block_size, self.groups.clone())
    }

    /// How layers share blocks.
    pub fn groups(&self) -> &KvGroups {
        &self.groups
    }

    /// What the cache stores.
    pub fn dtype(&self) -> KvCacheDtype {
        self.dtype
    }

    /// Bytes one block takes (every layer, K and V, scales included).
    pub fn block_bytes(&self) -> usize {
        self.dtype.block_bytes(&self.layout)
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

    /// One layer's K and V, for attention. A latent layout's values are
    /// its keys' rows.
    pub fn layer(&self, layer: usize) -> LayerView<'_> {
        let layer = self.groups.slot(layer);
        let latent = self.layout.rows == KvRows::Latent;
        LayerView(match &self.storage {
            Storage::F32 { k, v } => View::F32 {
                k: &k[layer],
                v: if latent { &k[layer] } else { &v[layer] },
            },
            Storage::Half { half, k, v } => View::Half {
                half: *half,
                k: &k[layer],
                v: if latent { &k[layer] } else { &v[layer] },
            },
            Storage::Q8 { code, k, v } => View::Q8 {
                code: *code,
                k: &k[layer],
                v: if latent { &k[layer] } else { &v[layer] },
            },
        })
    }

    /// Copies one block's K and V, every slot (copy-on-write).
    pub fn copy_block(&mut self, copy: BlockCopy) {
        let n = self.layout.block_elems();
        let (s, d) = (copy.src as usize, copy.dst as usize);
        // A latent layout's V pools are empty.
        let with_v = self.layout.rows == KvRows::PerHead;
        match &mut self.storage {
            Storage::F32 { k, v } => copy_in_pools(k, v, with_v, s * n..(s + 1) * n, d * n),
            Storage::Half { k, v, .. } => copy_in_pools(k, v, with_v, s * n..(s + 1) * n, d * n),
            Storage::Q8 { k, v, .. } => {
                let v = if with_v { &mut v[..] } else { &mut [] };
                for pool in k.iter_mut().chain(v.iter_mut()) {
                    pool.copy_block(s, d, n);
                }
            }
        }
    }

    /// One block's K and V in one layer (`[kv_head][slot][head_dim]` each),
    /// in f32, e.g. to send it to another worker: borrowed from an f32
    /// cache, widened from a 16-bit one, dequantized from an 8-bit one.
    /// A latent layout's V is empty.
    pub fn block(&self, layer: usize, block: BlockId) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let layer = self.groups.slot(layer);
        let n = self.layout.block_elems();
        let s = block as usize * n;
        if self.layout.rows == KvRows::Latent {
            let k = match &self.storage {
                Storage::F32 { k, .. } => Cow::Borrowed(&k[layer][s..s + n]),
                Storage::Half { half, k, .. } => Cow::Owned(half.decode(&k[layer][s..s + n])),
                Storage::Q8 { code, k, .. } => {
                    Cow::Owned(k[layer].read_block(*code, block as usize, n))
                }
            };
            return (k, Cow::Borrowed(&[]));
        }
        match &self.storage {
            Storage::F32 { k, v } => (
                Cow::Borrowed(&k[layer][s..s + n]),
                Cow::Borrowed(&v[layer][s..s + n]),
            ),
            Storage::Half { half, k, v } => (
                Cow::Owned(half.decode(&k[layer][s..s + n])),
                Cow::Owned(half.decode(&v[layer][s..s + n])),
            ),
            Storage::Q8 { code, k, v } => (
                Cow::Owned(k[layer].read_block(*code, block as usize, n)),
                Cow::Owned(v[layer].read_block(*code, block as usize, n)),
            ),
        }
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
        let (n, nv) = (self.layout.block_elems(), self.layout.value_elems());
        if layer >= self.layout.num_layers
            || block as usize >= self.num_blocks
            || k.len() != n
            || v.len() != nv
        {
            return Err(KvError::BadBlockWrite {
                layer,
                block,
                len: k.len() + v.len(),
                expected: n + nv,
            });
        }
        let s = block as usize * n;
        let layer = self.groups.slot(layer);
        if nv == 0 {
            match &mut self.storage {
                Storage::F32 { k: kp, .. } => kp[layer][s..s + n].copy_from_slice(k),
                Storage::Half { half, k: kp, .. } => half.encode_into(k, &mut kp[layer][s..s + n]),
                Storage::Q8 { code, k: kp, .. } => kp[layer].write_block(*code, block as usize, k),
            }
            return Ok(());
        }
        match &mut self.storage {
            Storage::F32 { k: kp, v: vp } => {
                kp[layer][s..s + n].copy_from_slice(k);
                vp[layer][s..s + n].copy_from_slice(v);
            }
            Storage::Half { half, k: kp, v: vp } => {
                half.encode_into(k, &mut kp[layer][s..s + n]);
                half.encode_into(v, &mut vp[layer][s..s + n]);
            }
            Storage::Q8 { code, k: kp, v: vp } => {
                kp[layer].write_block(*code, block as usize, k);
                vp[layer].write_block(*code, block as usize, v);
            }
        }
        Ok(())
    }

    /// Writes one token's K and V rows (`[kv_head][head_dim]`) at `slot` of
    /// `block` in `layer`. A latent layout's `v` is empty.
    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let layer = self.groups.slot(layer);
        let d = self.layout.head_dim;
        let heads = self.layout.num_kv_heads;
        let bs = self.layout.block_size;
        if self.layout.rows == KvRows::Latent {
            let o = (block as usize * bs + slot) * d;
            match &mut self.storage {
                Storage::F32 { k: kp, .. } => kp[layer][o..o + d].copy_from_slice(&k[..d]),
                Storage::Half { half, k: kp, .. } => {
                    half.encode_into(&k[..d], &mut kp[layer][o..o + d])
                }
                Storage::Q8 { code, k: kp, .. } => {
                    kp[layer].write_row(*code, block as usize, slot, bs, &k[..d])
                }
            }
            return;
        }
        match &mut self.storage {
            Storage::F32 { k: kp, v: vp } => {
                for h in 0..heads {
                    let o = ((block as usize * heads + h) * bs + slot) * d;
                    kp[layer][o..o + d].copy_from_slice(&k[h * d..(h + 1) * d]);
                    vp[layer][o..o + d].copy_from_slice(&v[h * d..(h + 1) * d]);
                }
            }
            Storage::Half { half, k: kp, v: vp } => {
                for h in 0..heads {
                    let o = ((block as usize * heads + h) * bs + slot) * d;
                    half.encode_into(&k[h * d..(h + 1) * d], &mut kp[layer][o..o + d]);
                    half.encode_into(&v[h * d..(h + 1) * d], &mut vp[layer][o..o + d]);
                }
            }
            Storage::Q8 { code, k: kp, v: vp } => {
                for h in 0..heads {
                    let bh = block as usize * heads + h;
                    kp[layer].write_row(*code, bh, slot, bs, &k[h * d..(h + 1) * d]);
                    vp[layer].write_row(*code, bh, slot, bs, &v[h * d..(h + 1) * d]);
                }
            }
        }
    }
}

/// Copies `src` to `dst` in every K and V pool of plain elements.
fn copy_in_pools<T: Copy>(
    k: &mut [Vec<T>],
    v: &mut [Vec<T>],
    with_v: bool,
    src: std::ops::Range<usize>,
    dst: usize,
) {
    let v = if with_v { v } else { &mut [] };
    for pool in k.iter_mut().chain(v.iter_mut()) {
        pool.copy_within(src.clone(), dst);
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
        assert!(a.append(8).expect("two blocks").is_empty());
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
        let copy = *b
            .append(1)
            .expect("append")
            .first()
            .expect("a copy-on-write");
        assert_eq!(copy.src, a.blocks()[1]);
        assert_ne!(b.blocks()[1], a.blocks()[1]);
        assert_eq!(b.blocks()[0], a.blocks()[0], "the full block stays shared");
        // `a` now owns its tail alone and appends in place.
        assert!(a.append(1).expect("append").is_empty());
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
            rows: KvRows::PerHead,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 3,
            block_size: 4,
            sliding: SlidingLayers::NONE,
        };
        let mut kv = KvCache::new(layout, 5);
        kv.write(
            1,
            3,
            2,
            &[1., 2., 3., 4., 5., 6.],
            &[7., 8., 9., 10., 11., 12.],
        );
        let (k, v) = kv.block(1, 3);
        let o = kv.offset(0, 1, 2);
        assert_eq!(&k[o..o + 3], &[4., 5., 6.]);
        assert_eq!(&v[o..o + 3], &[10., 11., 12.]);
        assert!((0..5).all(|b| kv.block(0, b).0.iter().all(|&x| x == 0.0)));
    }
}
