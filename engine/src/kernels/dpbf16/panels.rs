//! The `vdpbf16ps` kernel over weights packed in panels of 16 rows
//! ([`crate::kernels::Panels`]).
//!
//! **Tiles.** Up to 4 panels (64 output rows) × up to 12 tokens, at most
//! 24 accumulators, each 16 finished outputs. A step takes one pair of
//! columns: a 64-byte load per panel and, per token, its pair of
//! activations broadcast to every lane, for `panels × tokens` `vdpbf16ps`;
//! no reduction follows. A batch of up to 12 tokens takes one pass (8
//! tokens: 3 panels × 8), so each panel is read into registers once; larger
//! batches are split into passes as even as 12 at most allows.
//!
//! **Blocks.** A thread's panels are taken a tile's width at a time, and
//! every pass runs over those before the next: the first reads them from
//! memory (or L2), the others from L2. At batches of 2 or more the passes
//! ask for the next block into L2 between them ([`Prefetch`]), so memory
//! streams while they compute (asked for by one pass, a batch of 8 ran 5%
//! slower than the row kernel); a lone token leaves its streams to the
//! hardware prefetcher (software hints slowed a batch-1 stream,
//! RESULTS.md).

use std::arch::x86_64::*;
use std::ops::Range;

use half::bf16;

use crate::kernels::panels::{Panels, LANES};

/// Panels a tile reads side by side.
pub(crate) const PANELS: usize = 4;
/// Token rows per tile, at most.
const MAX_TOKENS: usize = 12;
/// Accumulators a tile holds (of 32 registers: the rest hold panels and
/// a broadcast pair).
const ACCUMULATORS: usize = 24;

/// Token rows as a panel kernel reads them: `m` rows `stride` elements
/// apart, each readable for `2 * pairs` elements.
#[derive(Clone, Copy)]
pub(crate) struct TokenRows<X> {
    pub(crate) x: *const X,
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) stride: usize,
}

// SAFETY: the rows are only read while a linear's tasks run, and the
// caller (`kernels::panels`) keeps them alive until its parallel region
// returns.
unsafe impl<X> Sync for TokenRows<X> {}

/// A kernel over weights packed in panels: how it tiles a batch and how
/// it runs one tile. [`rows`] drives either.
pub(crate) trait PanelKernel {
    /// A token's activation as the kernel reads it.
    type X;
    /// Whether a block's passes ask for the next block ([`Prefetch`]).
    const PREFETCH: bool;
    /// How `m` tokens are tiled: the number of token tiles (passes over a
    /// block) and the panels of a block (one tile's).
    fn shape(m: usize) -> (usize, usize);
    /// The tile of `count` panels × `tokens` tokens, stored.
    ///
    /// # Safety
    /// The CPU has the kernel's features; the tile's panels and token
    /// rows exist and its outputs lie inside `t.out`.
    unsafe fn run(t: Tile<Self::X>, count: usize, tokens: usize);
}

/// `vdpbf16ps` on AVX512-BF16: activations as bf16 pairs.
pub(crate) struct Dpbf16;

impl PanelKernel for Dpbf16 {
    type X = bf16;
    const PREFETCH: bool = true;

    /// Token tiles of at most [`MAX_TOKENS`], and as many panels as
    /// [`ACCUMULATORS`] hold against the largest tile (at most
    /// [`PANELS`]). One pass reads a block's panels into registers once;
    /// each further pass reads them again from L2, so up to 12 tokens take
    /// one pass (8 tokens: 3 panels × 8).
    fn shape(m: usize) -> (usize, usize) {
        let tiles = m.div_ceil(MAX_TOKENS).max(1);
        let tokens = m.div_ceil(tiles).max(1);
        (tiles, (ACCUMULATORS / tokens).clamp(1, PANELS))
    }

    unsafe fn run(t: Tile<bf16>, count: usize, tokens: usize) {
        // SAFETY: the caller's promise (the CPU has AVX512-BF16:
        // `Bf16Tokens::new` asserts it).
        unsafe { run(t, count, tokens) }
    }
}

/// One tile's operands and where its outputs go.
#[derive(Clone, Copy)]
pub(crate) struct Tile<X> {
    /// The tile's first panel.
    pub(crate) w: *const bf16,
    /// Elements per panel.
    pub(crate) panel_len: usize,
    pub(crate) pairs: usize,
    /// The tile's first token row.
    pub(crate) x: *const X,
    /// Elements from one token row to the next.
    pub(crate) stride: usize,
    /// The lines of the next block to ask for, if any.
    pub(crate) prefetch: Option<Prefetch>,
    /// The whole `m × n` output.
    pub(crate) out: *mut f32,
    pub(crate) n: usize,
    /// The tile's first panel and token.
    pub(crate) panel: usize,
    pub(crate) token: usize,
}

impl<X: Copy> Tile<X> {
    /// The tile's `count` panels × `tokens` tokens as tiles of one panel
    /// and one token each: where a kernel has no code for a shape.
    pub(crate) fn singles(self, count: usize, tokens: usize) -> impl Iterator<Item = Self> {
        (0..count).flat_map(move |p| {
            (0..tokens).map(move |tok| Tile {
                // Inside the tile's panels and token rows.
                w: self.w.wrapping_add(p * self.panel_len),
                x: self.x.wrapping_add(tok * self.stride),
                panel: self.panel + p,
                token: self.token + tok,
                ..self
            })
        })
    }
}

/// `out[t * n + r]` for the rows `r` of `panels` of `w` (`n = w.rows()`)
/// and every token row `t` of `x`, on kernel `K`.
///
/// # Safety
/// `K`'s CPU features are present; `x`'s rows are readable as
/// [`TokenRows`] says; `panels` lie inside `w`.
pub(crate) unsafe fn rows<K: PanelKernel>(
    w: &Panels,
    x: TokenRows<K::X>,
    out: &mut [f32],
    panels: Range<usize>,
) {
    let (n, m) = (w.rows(), x.m);
    assert!(x.k == w.cols() && out.len() >= m * n && panels.end <= w.panels());
    let panel_len = w.panel_len();
    let base = w.packed().as_ptr();
    let (tiles, block) = K::shape(m);
    for b0 in panels.clone().step_by(block) {
        let b1 = (b0 + block).min(panels.end);
        let count = b1 - b0;
        // The same panels of the next block while the matrix has them,
        // past the range's end too: the task after this one starts there,
        // on this thread as a rule (its first block had come cold from
        // memory: o and down, tasks of 5–8 panels, ran 3–5% slower).
        let next = b0 + block + count <= w.panels();
        let mut t0 = 0;
        for tile_index in 0..tiles {
            // Tiles as even as the limit allows (16 tokens: 8 + 8).
            let tokens = (m - t0).div_ceil(tiles - tile_index);
            let prefetch = (K::PREFETCH && m > 1 && next)
                .then(|| Prefetch::new(block * panel_len, tile_index, tiles))
                .flatten();
            let tile = Tile {
                // SAFETY: panel b0 < panels.end <= w.panels().
                w: unsafe { base.add(b0 * panel_len) },
                panel_len,
                pairs: w.pairs(),
                x: x.x.wrapping_add(t0 * x.stride),
                stride: x.stride,
                prefetch,
                out: out.as_mut_ptr(),
                n,
                panel: b0,
                token: t0,
            };
            // SAFETY: the tile's panels and token rows exist (the loops'
            // bounds); out holds m × n (asserted above); the features are
            // the caller's promise.
            unsafe { K::run(tile, count, tokens) };
            t0 += tokens;
        }
    }
}

/// Which lines of the next block a tile asks for into L2: a block's token
/// tiles share them, the `share`-th taking every `every`-th pair, so the
/// next block streams in while every pass over this one computes (asked
/// for by one pass, memory idled through the others).
#[derive(Clone, Copy)]
pub(crate) struct Prefetch {
    /// Elements from a tile's panels to the next block's.
    pub(crate) ahead: usize,
    pub(crate) share: usize,
    pub(crate) every: usize,
}

impl Prefetch {
    /// At most this many token tiles share a block's prefetches.
    const SHARERS: usize = 4;

    /// The `tile`-th of `tiles` token tiles (`None` past [`Self::SHARERS`]).
    fn new(ahead: usize, tile: usize, tiles: usize) -> Option<Self> {
        (tile < Self::SHARERS).then_some(Self {
            ahead,
            share: tile,
            every: tiles.min(Self::SHARERS),
        })
    }
}

/// The tile of `count` (1–4) panels × `tokens` (1–12) tokens.
///
/// # Safety
/// As [`tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn run(t: Tile<bf16>, count: usize, tokens: usize) {
    /// Every shape with at most 24 accumulators, by (panels, tokens).
    macro_rules! shapes {
        ($($p:literal => [$($t:literal),*]);*) => {
            // SAFETY (every arm): the caller's promise, for this shape.
            unsafe {
                match (count, tokens) {
                    $($(($p, $t) => store(t, &tile::<$p, $t>(t)),)*)*
                    // Larger shapes are not made (`shape` never asks).
                    _ => {
                        for one in t.singles(count, tokens) {
                            store(one, &tile::<1, 1>(one));
                        }
                    }
                }
            }
        };
    }
    shapes! {
        4 => [1, 2, 3, 4, 5, 6];
        3 => [1, 2, 3, 4, 5, 6, 7, 8];
        2 => [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        1 => [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    }
}

/// `P` panels against `T` token rows: `[panel][token]` accumulators, each
/// the 16 outputs of one panel for one token.
///
/// # Safety
/// `t.w` starts `P` panels of `t.pairs` pairs; `t.x` starts `T` token rows
/// `t.stride` apart, each readable for `2 * t.pairs` elements (rows are
/// padded to 32); AVX-512F/BW and AVX512-BF16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const P: usize, const T: usize>(t: Tile<bf16>) -> [[__m512; T]; P] {
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    let step = 2 * LANES;
    // Which of `every` steps this tile prefetches at.
    let mut phase = 0;
    for j in 0..t.pairs {
        if let Some(f) = t.prefetch {
            if phase == f.share {
                for p in 0..P {
                    // A prefetch never faults; the caller keeps it inside
                    // the matrix.
                    let line = t.w.wrapping_add(f.ahead + p * t.panel_len + j * step);
                    _mm_prefetch::<_MM_HINT_T1>(line.cast());
                }
            }
            phase += 1;
            if phase == f.every {
                phase = 0;
            }
        }
        let mut wv = [_mm512_setzero_si512(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            // SAFETY: pair j < pairs of panel p < P.
            *v = unsafe { _mm512_loadu_si512(t.w.add(p * t.panel_len + j * step).cast()) };
        }
        for tok in 0..T {
            // SAFETY: token row tok < T holds 2 * pairs elements; the
            // pair is 4 bytes at an even element.
            let pair = unsafe {
                t.x.add(tok * t.stride + 2 * j)
                    .cast::<i32>()
                    .read_unaligned()
            };
            let xb = bh(_mm512_set1_epi32(pair));
            for (acc_p, &v) in acc.iter_mut().zip(&wv) {
                acc_p[tok] = _mm512_dpbf16_ps(acc_p[tok], bh(v), xb);
            }
        }
    }
    acc
}

#[inline]
#[target_feature(enable = "avx512f")]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: any 64 bytes are a valid __m512bh.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// A tile's accumulators into `out[token][16 · panel ..]`, the last
/// panel's rows past `n` masked off.
///
/// # Safety
/// The tile's panels are rows `< n` (but a last partial panel's lanes) and
/// its tokens rows of the `m × n` output.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store<const P: usize, const T: usize>(t: Tile<bf16>, acc: &[[__m512; T]; P]) {
    for (p, acc_p) in acc.iter().enumerate() {
        let r0 = (t.panel + p) * LANES;
        let lanes = (t.n - r0).min(LANES);
        let mask = ((1u32 << lanes) - 1) as u16;
        for (tok, &a) in acc_p.iter().enumerate() {
            // SAFETY: row (t.token + tok) of the output, columns r0..r0 +
            // lanes inside it (the caller's promise).
            unsafe { _mm512_mask_storeu_ps(t.out.add((t.token + tok) * t.n + r0), mask, a) };
        }
    }
}
