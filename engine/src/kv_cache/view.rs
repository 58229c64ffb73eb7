//! [`LayerView`]: attention's read access to one layer's K and V rows, in
//! whatever form the cache stores them.

use super::half::Half;
use super::q8::{Code, Q8Pool};
use super::recent::RecentView;
use super::RECENT_TOKENS;

/// Read access to one layer's K and V, a row (one token of one KV head) at
/// a time; rows are numbered by [`KvCache::offset`](super::KvCache::offset)` / head_dim`.
#[derive(Debug, Clone, Copy)]
pub struct LayerView<'a>(pub(super) View<'a>);

#[derive(Debug, Clone, Copy)]
pub(super) enum View<'a> {
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
        recent: Option<RecentView<'a>>,
    },
}

/// A 16-bit cache's rows as stored ([`LayerView::half_rows`]).
#[derive(Debug, Clone, Copy)]
pub enum HalfRows<'a> {
    Bf16(&'a [::half::bf16]),
    F16(&'a [::half::f16]),
}

impl<'a> LayerView<'a> {
    /// `rows` rows of `d` of a 16-bit cache's K (`keys`) or V from row
    /// `row0`, as stored, for a reader that widens them itself (to exactly
    /// what [`key_rows`](Self::key_rows) would decode); `None` for the
    /// other caches.
    #[inline]
    pub fn half_rows(
        &self,
        keys: bool,
        row0: usize,
        rows: usize,
        d: usize,
    ) -> Option<HalfRows<'a>> {
        let View::Half { half, k, v } = self.0 else {
            return None;
        };
        let bits = &(if keys { k } else { v })[row0 * d..(row0 + rows) * d];
        Some(match half {
            Half::Bf16 => HalfRows::Bf16(bytemuck::cast_slice(bits)),
            Half::F16 => HalfRows::F16(bytemuck::cast_slice(bits)),
        })
    }
}

impl LayerView<'_> {
    /// Whether rows are stored rotated ([`rotate_row`]): attention must
    /// then rotate each query before scoring and its output after summing
    /// values (`q8.rs` explains why 8-bit rows are).
    #[inline]
    pub fn rotated(&self) -> bool {
        matches!(self.0, View::Q8 { .. })
    }

    /// Positions behind a query (itself included) that it reads through
    /// [`recent_rows`](Self::recent_rows) where their block has a copy
    /// (an FP8 cache's recent window, `recent.rs`).
    #[inline]
    pub fn recent_window(&self) -> Option<usize> {
        match self.0 {
            View::Q8 {
                recent: Some(_), ..
            } => Some(RECENT_TOKENS),
            _ => None,
        }
    }

    /// Asks for key and value rows `row0..row0 + rows` (`d` wide) to be
    /// brought into cache `to`: attention asks for the blocks ahead of the
    /// one it works on, since a decode step reads each block once, from
    /// memory (the weights streamed through the caches since), and blocks
    /// lie anywhere in the pool.
    #[inline]
    pub fn prefetch(&self, row0: usize, rows: usize, d: usize, to: CacheLevel) {
        let (start, len) = (row0 * d, rows * d);
        match &self.0 {
            View::F32 { k, v } => {
                prefetch_range(k, start, len, to);
                prefetch_range(v, start, len, to);
            }
            View::Half { k, v, .. } => {
                prefetch_range(k, start, len, to);
                prefetch_range(v, start, len, to);
            }
            View::Q8 { k, v, .. } => {
                prefetch_range(&k.codes, start, len, to);
                prefetch_range(&v.codes, start, len, to);
            }
        }
    }

    /// Key (or value) rows `row0..row0 + buf.len() / d`, all of one block,
    /// from the block's 16-bit copy (rotated like the codes, factor 1),
    /// decoded into `buf`; `None` when the block has no copy.
    #[inline]
    pub fn recent_rows<'b>(
        &self,
        keys: bool,
        row0: usize,
        d: usize,
        buf: &'b mut [f32],
    ) -> Option<&'b [f32]> {
        match &self.0 {
            View::Q8 {
                recent: Some(r), ..
            } => r.rows(keys, row0, d, buf),
            _ => None,
        }
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
            View::Q8 { code, k, v, .. } => {
                rows_q8(*code, if keys { k } else { v }, row0, buf, scales)
            }
        }
    }
}

/// Where [`LayerView::prefetch`] brings rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLevel {
    /// The nearest cache: for the block worked on next.
    L1,
    /// L2: for blocks further ahead (L1 holds a few blocks only).
    L2,
}

/// Prefetches the cache lines of `xs[start..start + len]` (clipped to
/// `xs`) into `to`.
#[inline]
fn prefetch_range<T>(xs: &[T], start: usize, len: usize, to: CacheLevel) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let end = (start + len).min(xs.len());
        let bytes = end.saturating_sub(start) * std::mem::size_of::<T>();
        let base = xs.as_ptr().wrapping_add(start).cast::<i8>();
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint: it never faults and reads
            // nothing; the address lies inside `xs` (start < end <= xs.len()).
            unsafe {
                match to {
                    CacheLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(base.add(line)),
                    CacheLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(base.add(line)),
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (xs, start, len, to);
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
