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
//! time. An FP8 cache also keeps 16-bit copies of the blocks holding each
//! running sequence's last [`RECENT_TOKENS`] positions, which every query
//! reads in place of the codes (`recent.rs`; the engine calls
//! [`KvCache::hold_recent`] before each step).

mod allocator;
mod dtype;
mod groups;
mod half;
mod q8;
mod recent;
mod table;
mod view;

use std::borrow::Cow;

use half::Half;
use q8::{Code, Q8Pool};
use recent::RecentRows;

pub use q8::{rotate as rotate_row, unrotate as unrotate_row};
pub use recent::{RECENT_SHARE, RECENT_TOKENS};

pub use allocator::{AnnouncedChanges, BlockAllocator, CacheEvent, PrefixCacheStats, Registered};
pub use dtype::KvCacheDtype;
pub use groups::{KvFootprint, KvGroups, SlidingLayers, FREED};
pub use table::{BlockCopy, BlockTable};
use view::View;
pub use view::{CacheLevel, HalfRows, LayerView};

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
        /// 16-bit copies of recent blocks (FP8 only, `recent.rs`).
        recent: Option<RecentRows>,
    },
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
                let recent = (code == Code::Fp8E4m3).then(|| {
                    let (bs, elems) = (layout.block_size, layout.block_elems());
                    RecentRows::new(pools, num_blocks, bs, elems, v_blocks > 0)
                });
                Storage::Q8 {
                    code,
                    k: pool(num_blocks),
                    v: pool(v_blocks),
                    recent,
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
            Storage::Q8 { code, k, v, recent } => View::Q8 {
                code: *code,
                k: &k[layer],
                v: if latent { &k[layer] } else { &v[layer] },
                recent: recent.as_ref().map(|r| r.view(layer, latent)),
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
            Storage::Q8 { k, v, recent, .. } => {
                let v = if with_v { &mut v[..] } else { &mut [] };
                for pool in k.iter_mut().chain(v.iter_mut()) {
                    pool.copy_block(s, d, n);
                }
                if let Some(r) = recent {
                    r.copy_block(copy.src, copy.dst);
                }
            }
        }
    }

    /// One block's K and V in one layer (`[kv_head][slot][head_dim]` each),
    /// in f32, e.g. to send it to another worker: borrowed from an f32
    /// cache, widened from a 16-bit one, dequantized from an 8-bit one.
    /// A latent layout's V is empty. An FP8 block's rows come from its
    /// codes, as attention reads rows outside the recent window.
    pub fn block(&self, layer: usize, block: BlockId) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        self.read_block_rows(layer, block, false)
    }

    /// As [`block`](Self::block), but an FP8 block with a 16-bit copy (its
    /// sequence's recent window) is read from the copy: what a prompt's
    /// tail is sent as, so the receiver keeps it at 16 bits too.
    pub fn recent_block(&self, layer: usize, block: BlockId) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        self.read_block_rows(layer, block, true)
    }

    fn read_block_rows(
        &self,
        layer: usize,
        block: BlockId,
        from_copy: bool,
    ) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let layer = self.groups.slot(layer);
        let n = self.layout.block_elems();
        let s = block as usize * n;
        // A latent layout's V is empty.
        let with_v = self.layout.rows == KvRows::PerHead;
        let none = || Cow::Borrowed(&[][..]);
        match &self.storage {
            Storage::F32 { k, v } => (
                Cow::Borrowed(&k[layer][s..s + n]),
                if with_v {
                    Cow::Borrowed(&v[layer][s..s + n])
                } else {
                    none()
                },
            ),
            Storage::Half { half, k, v } => (
                Cow::Owned(half.decode(&k[layer][s..s + n])),
                if with_v {
                    Cow::Owned(half.decode(&v[layer][s..s + n]))
                } else {
                    none()
                },
            ),
            Storage::Q8 { code, k, v, recent } => {
                let copy = recent.as_ref().filter(|_| from_copy);
                let copy = copy.and_then(|r| Some((r, r.copy_of(block)?)));
                let read = |pool: &Q8Pool, keys: bool| {
                    let side = (layer, keys);
                    Cow::Owned(q8_block(&self.layout, *code, pool, copy, side, block))
                };
                (
                    read(&k[layer], true),
                    if with_v {
                        read(&v[layer], false)
                    } else {
                        none()
                    },
                )
            }
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
        let d = self.layout.head_dim;
        match &mut self.storage {
            // A latent layout has no V (`nv` 0, its V pools empty).
            Storage::F32 { k: kp, v: vp } => {
                kp[layer][s..s + n].copy_from_slice(k);
                if nv > 0 {
                    vp[layer][s..s + nv].copy_from_slice(v);
                }
            }
            Storage::Half { half, k: kp, v: vp } => {
                half.encode_into(k, &mut kp[layer][s..s + n]);
                if nv > 0 {
                    half.encode_into(v, &mut vp[layer][s..s + nv]);
                }
            }
            Storage::Q8 {
                code,
                k: kp,
                v: vp,
                recent,
            } => {
                // Rows rotated once, for the codes and, where the block has
                // one, its 16-bit copy (what a sender read from its own).
                let copy = recent.as_ref().and_then(|r| r.copy_of(block));
                for (keys, pool, rows) in [(true, &mut kp[layer], k), (false, &mut vp[layer], v)] {
                    if rows.is_empty() {
                        continue;
                    }
                    let rotated = q8::rotate_rows(rows, d);
                    pool.write_rotated_block(*code, block as usize, &rotated);
                    if let (Some(c), Some(r)) = (copy, recent.as_mut()) {
                        r.write_block(layer, c, keys, &rotated);
                    }
                }
            }
        }
        Ok(())
    }

    /// Gives `blocks` 16-bit copies (keeping those they have), filling new
    /// ones from the codes: before a step ([`hold_recent`](Self::hold_recent))
    /// and before a prompt's tail arrives from another worker, so an FP8
    /// cache keeps the rows the sender read from its own copies. Other
    /// dtypes have nothing to hold.
    pub fn hold_blocks(&mut self, blocks: &[BlockId]) {
        let with_v = self.layout.rows == KvRows::PerHead;
        let Storage::Q8 {
            code,
            k,
            v,
            recent: Some(recent),
        } = &mut self.storage
        else {
            return;
        };
        let mut rows = vec![0f32; self.layout.block_elems()];
        for (block, copy) in recent.hold(blocks) {
            // Rows written before the copy existed: the codes are all there is.
            for (keys, pools) in [(true, &*k), (false, &*v)] {
                for (p, pool) in pools.iter().enumerate().filter(|_| keys || with_v) {
                    pool.decode_block_rotated(*code, block as usize, &mut rows);
                    recent.write_block(p, copy, keys, &rows);
                }
            }
        }
    }

    /// Before a step: the blocks holding positions that some query of the
    /// step reads at 16 bits (an FP8 cache's recent window, `recent.rs`)
    /// keep or take a copy. `seqs` gives each sequence's first new
    /// position, its count of new tokens and its block table. Other dtypes
    /// have nothing to hold.
    pub fn hold_recent<'a>(
        &mut self,
        seqs: impl IntoIterator<Item = (usize, usize, &'a [BlockId])>,
    ) {
        if self.recent_window().is_none() {
            return;
        }
        let (bs, groups) = (self.layout.block_size, self.groups.num_groups());
        let mut blocks = Vec::new();
        for (start, len, table) in seqs {
            if len == 0 {
                continue;
            }
            // The step's first query reads recent rows from here on.
            let first = (start + 1).saturating_sub(RECENT_TOKENS) / bs;
            for logical in first..=(start + len - 1) / bs {
                for g in 0..groups {
                    match table.get(logical * groups + g) {
                        Some(&b) if b != FREED => blocks.push(b),
                        _ => {}
                    }
                }
            }
        }
        self.hold_blocks(&blocks);
    }

    /// Positions behind a query that it reads at 16 bits, if this cache
    /// keeps a recent window (FP8).
    pub fn recent_window(&self) -> Option<usize> {
        match &self.storage {
            Storage::Q8 {
                recent: Some(_), ..
            } => Some(RECENT_TOKENS),
            _ => None,
        }
    }

    /// Writes one token's K and V rows (`[kv_head][head_dim]`) at `slot` of
    /// `block` in `layer`. A latent layout's `v` is empty.
    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let layer = self.groups.slot(layer);
        let d = self.layout.head_dim;
        let bs = self.layout.block_size;
        // A latent layout has one row a token (and no V).
        let (rows, with_v) = match self.layout.rows {
            KvRows::PerHead => (self.layout.num_kv_heads, true),
            KvRows::Latent => (1, false),
        };
        let offset = |h: usize| ((block as usize * rows + h) * bs + slot) * d;
        match &mut self.storage {
            Storage::F32 { k: kp, v: vp } => {
                for h in 0..rows {
                    let o = offset(h);
                    kp[layer][o..o + d].copy_from_slice(&k[h * d..(h + 1) * d]);
                    if with_v {
                        vp[layer][o..o + d].copy_from_slice(&v[h * d..(h + 1) * d]);
                    }
                }
            }
            Storage::Half { half, k: kp, v: vp } => {
                for h in 0..rows {
                    let o = offset(h);
                    half.encode_into(&k[h * d..(h + 1) * d], &mut kp[layer][o..o + d]);
                    if with_v {
                        half.encode_into(&v[h * d..(h + 1) * d], &mut vp[layer][o..o + d]);
                    }
                }
            }
            Storage::Q8 {
                code,
                k: kp,
                v: vp,
                recent,
            } => {
                // Each row rotated once, for its codes and its 16-bit copy.
                let copy = recent.as_ref().and_then(|r| r.copy_of(block));
                let mut row = vec![0f32; d];
                for (keys, pool, src) in [(true, &mut kp[layer], k), (false, &mut vp[layer], v)] {
                    if !keys && !with_v {
                        continue;
                    }
                    for h in 0..rows {
                        row.copy_from_slice(&src[h * d..(h + 1) * d]);
                        q8::rotate(&mut row);
                        pool.write_rotated_row(*code, block as usize * rows + h, slot, bs, &row);
                        if let (Some(c), Some(r)) = (copy, recent.as_mut()) {
                            r.write_row(layer, c, keys, (h * bs + slot) * d, &row);
                        }
                    }
                }
            }
        }
    }
}

/// One 8-bit block's K (or V: `side.1`) rows in pool `side.0`, rotated
/// back: from the block's 16-bit copy where it has one (so a transfer
/// carries the recent rows as the sender reads them), else from the codes.
fn q8_block(
    layout: &KvLayout,
    code: Code,
    pool: &Q8Pool,
    copy: Option<(&RecentRows, usize)>,
    (slot, keys): (usize, bool),
    block: BlockId,
) -> Vec<f32> {
    let n = layout.block_elems();
    let Some((recent, copy)) = copy else {
        return pool.read_block(code, block as usize, n);
    };
    let mut out = vec![0f32; n];
    recent.read_block(slot, copy, keys, &mut out);
    for row in out.chunks_exact_mut(layout.head_dim.max(1)) {
        unrotate_row(row);
    }
    out
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
mod tests;
