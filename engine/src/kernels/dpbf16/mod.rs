//! bf16 weights against activations rounded to bf16, on AVX512-BF16's
//! `vdpbf16ps` ([`super::MatmulPolicy::Bf16Activations`]).
//!
//! On a CPU with AVX-512 but no AMX (AMD Zen 4 and 5, Intel before
//! Sapphire Rapids) the vector kernels widen each bf16 weight to f32 and
//! retire 16 products an instruction. `vdpbf16ps` takes 32 bf16 pairs
//! (each 32-bit lane adds two products) at the same rate, so a compute-bound
//! prefill or batched decode can run twice as fast, and a batch-1 step
//! issues a third of the instructions per weight byte. The price is the
//! activations: each is rounded to bf16 (8 significant bits, a relative
//! error up to 2⁻⁹) before it meets the weights, as llama.cpp's bf16 path,
//! oneDNN's and a bf16 PyTorch model do. The sums stay f32. `quality-bench`
//! measures what that costs on a real checkpoint.
//!
//! A model's linear layers run on `panels`, weights packed so that no
//! reduction follows (on CPUs with AVX2 but not AVX512-BF16, on [`fma`]'s
//! kernel over the same panels); `rows` here takes a bf16 matrix as loaded (one
//! outside a linear layer, or a caller's own), and [`Bf16Tokens`] rounds
//! the activations for both.
//!
//! **Layout.** The weights are read as loaded (`[n][k]` row-major): a
//! 64-byte load is 32 columns of one row, and the activations, packed per
//! call into bf16 rows padded to a multiple of 32 ([`Bf16Tokens`]), are the
//! other operand as they lie. Lane `i` of an accumulator then holds the
//! sum over columns `32s + 2i, 32s + 2i + 1` of every step `s`; a group of
//! 16 weight rows' accumulators for one token is reduced at once by a
//! transposing add tree ([`hsum16`]) into the 16 adjacent outputs, one
//! store.
//!
//! **Tiles.** 4 weight rows × up to 6 tokens (24 accumulators, 6 token
//! registers, 4 weight registers); a lone token reads each weight row alone
//! in memory order (batch-1 decode streams the weights). Tokens are taken
//! in chunks whose packed rows fit in L2 while a thread passes over its
//! weight rows. The next group's rows are asked for into L2 by a group's
//! token tiles in turn ([`Prefetch`]), so at batches of 6 to 32 the weights
//! stream from memory while the tiles compute (batch-8 decode 1.4x over
//! asking for them into L1 from the first tile alone).
//!
//! **Batch invariance.** Every output is one accumulator's `vdpbf16ps`
//! chain in column order and then the same reduction tree, whatever tile it
//! ran in, so a token's results do not depend on the batch: this policy is
//! batch invariant by construction.

pub mod fma;
pub(crate) mod panels;

use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

use half::bf16;

/// Columns one `vdpbf16ps` takes (64 bytes of bf16).
const STEP: usize = 32;
/// Weight rows one reduction and one store cover.
const GROUP: usize = 16;
/// Token rows per tile.
const TOKENS: usize = 6;
/// Bytes of packed activations a thread keeps hot while it passes over its
/// weight rows (half of a 1 MiB L2).
const CHUNK_BYTES: usize = 512 << 10;

/// Whether this CPU runs the kernel (asked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    })
}

/// `m` token rows of `k` activations rounded to bf16 (to nearest, ties to
/// even), each row zero-padded to `stride`, a multiple of 32.
#[derive(Debug)]
pub struct Bf16Tokens {
    x: Vec<bf16>,
    m: usize,
    k: usize,
    stride: usize,
}

impl Bf16Tokens {
    /// Rounds `x` (`m × k`, row-major).
    pub fn new(x: &[f32], m: usize, k: usize) -> Self {
        assert!(x.len() >= m * k, "x holds m × k values");
        assert!(available(), "AVX512-BF16 is not available");
        let stride = k.next_multiple_of(STEP);
        let mut packed = vec![bf16::ZERO; m * stride];
        for (src, dst) in x.chunks_exact(k).zip(packed.chunks_exact_mut(stride)) {
            // SAFETY: `available()` (asserted above); `dst` is at least as
            // long as `src`.
            unsafe { round_row(src, dst) };
        }
        Self {
            x: packed,
            m,
            k,
            stride,
        }
    }
}

impl Bf16Tokens {
    /// The rows as [`panels::rows`] reads them.
    pub(crate) fn rows(&self) -> panels::TokenRows<bf16> {
        panels::TokenRows {
            x: self.x.as_ptr(),
            m: self.m,
            k: self.k,
            stride: self.stride,
        }
    }
}

/// `src` rounded into the front of `dst`.
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16; `dst.len() >= src.len()`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round_row(src: &[f32], dst: &mut [bf16]) {
    let whole = src.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: i + 16 <= src.len() <= dst.len().
        unsafe {
            let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src.as_ptr().add(i)));
            _mm256_storeu_si256(
                dst.as_mut_ptr().add(i).cast(),
                std::mem::transmute::<__m256bh, __m256i>(v),
            );
        }
    }
    for (d, &s) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *d = bf16::from_f32(s);
    }
}

/// The 32 columns at `i` of a weight row (`k` long): a plain load, or a
/// masked one for a row's last, partial step.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn load_weights(w: *const bf16, i: usize, k: usize) -> __m512bh {
    // SAFETY: a full step lies inside the row; a partial one reads only
    // the `k − i` elements left (the mask's lanes), as the caller promises
    // the row is `k` long.
    unsafe {
        let bits = if i + STEP <= k {
            _mm512_loadu_si512(w.add(i).cast())
        } else {
            _mm512_maskz_loadu_epi16((1u32 << (k - i)) - 1, w.add(i).cast())
        };
        std::mem::transmute::<__m512i, __m512bh>(bits)
    }
}

/// 32 packed activations at `p` (always whole: rows are padded).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_tokens(p: *const bf16) -> __m512bh {
    // SAFETY: the caller points inside a padded row, 32 elements readable.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast())) }
}

/// One weight row against one token row: the unreduced accumulator.
///
/// # Safety
/// `w` holds `k` elements; `x` a padded row of `k.next_multiple_of(32)`;
/// AVX-512F/BW and AVX512-BF16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot1(w: *const bf16, k: usize, x: *const bf16) -> __m512 {
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < k {
        // The weights stream row after row: ask for the line 4 rows ahead
        // (a prefetch never faults, past-the-end addresses are fine).
        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(4 * k + i).cast());
        // SAFETY: i < k inside the row; x's padded row covers i + 32.
        unsafe { acc = _mm512_dpbf16_ps(acc, load_weights(w, i, k), load_tokens(x.add(i))) };
        i += STEP;
    }
    acc
}

/// Four weight rows (`w`, rows `k` apart) against `T` token rows (`x`,
/// `stride` apart): the unreduced accumulators, `[row][token]`. Each one is
/// the same chain [`dot1`] computes.
///
/// # Safety
/// As [`dot1`], for 4 rows of `w` and `T` rows of `x`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const T: usize>(
    w: *const bf16,
    k: usize,
    x: *const bf16,
    stride: usize,
    prefetch: Prefetch,
) -> [[__m512; T]; 4] {
    let mut acc = [[_mm512_setzero_ps(); T]; 4];
    let mut i = 0;
    // Which of `prefetch.every` steps this tile prefetches at.
    let mut phase = 0;
    while i < k {
        if phase == prefetch.share {
            // The same rows of the next group, into L2 (a prefetch never
            // faults): L1 cannot hold two groups and the token rows.
            for r in 0..4 {
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add((GROUP + r) * k + i).cast());
            }
        }
        phase += 1;
        if phase == prefetch.every {
            phase = 0;
        }
        // Whole steps load plainly; only a row's last, partial step masks.
        let whole = i + STEP <= k;
        let mut xv = [load_tokens_zero(); T];
        for (t, v) in xv.iter_mut().enumerate() {
            // SAFETY: token row t is padded past i + 32.
            *v = unsafe { load_tokens(x.add(t * stride + i)) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: row r is k long, i < k.
            let wv = unsafe {
                if whole {
                    load_tokens(w.add(r * k + i))
                } else {
                    load_weights(w.add(r * k), i, k)
                }
            };
            for (a, &xt) in acc_r.iter_mut().zip(&xv) {
                *a = _mm512_dpbf16_ps(*a, wv, xt);
            }
        }
        i += STEP;
    }
    acc
}

#[inline]
#[target_feature(enable = "avx512f")]
fn load_tokens_zero() -> __m512bh {
    // SAFETY: any 64 bytes are a valid __m512bh.
    unsafe { std::mem::transmute::<__m512, __m512bh>(_mm512_setzero_ps()) }
}

/// Which lines of the next group a tile asks for: the group's token tiles
/// share its prefetches, the `share`-th tile taking every `every`-th step,
/// so the next group's weights arrive while all of them compute (asked for
/// in the first tile alone, they arrived in a burst and a batch of 8 to 32
/// tokens left the memory idle for the rest of the group).
#[derive(Clone, Copy)]
struct Prefetch {
    share: usize,
    every: usize,
}

impl Prefetch {
    /// At most this many tiles share a group's prefetches (more tiles than
    /// that compute long enough for the first ones' to arrive).
    const SHARERS: usize = 4;

    /// The `tile`-th of `tiles` token tiles over one group (a tile past
    /// [`Self::SHARERS`] asks for nothing).
    fn new(tile: usize, tiles: usize) -> Self {
        Self {
            share: tile,
            every: tiles.clamp(1, Self::SHARERS),
        }
    }
}

/// Lane `j` of the result is the sum of `v[j]`'s 16 lanes, by the same add
/// tree for every `j` (halves, quarters, then pairs), so a sum does not
/// depend on its neighbours.
#[inline]
#[target_feature(enable = "avx512f")]
fn hsum16(v: &[__m512; GROUP]) -> __m512 {
    // Plain loops rather than `array::from_fn` closures, which LLVM may
    // leave as calls inside this target-feature function.
    let zero = _mm512_setzero_ps();
    // The tree leaves vector 4j + g's sum in lane 4g + j: feed it the
    // vectors in that transposed order so lane j holds v[j]'s.
    let mut u = [zero; GROUP];
    for (s, slot) in u.iter_mut().enumerate() {
        *slot = v[(s % 4) * 4 + s / 4];
    }
    // Halves: each 256-bit half of h[i] holds one vector's x[l] + x[l + 8].
    let mut h = [zero; 8];
    for (i, slot) in h.iter_mut().enumerate() {
        let (a, b) = (u[2 * i], u[2 * i + 1]);
        *slot = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        );
    }
    // Quarters: each 128-bit lane of q[i] holds one vector's four partials.
    let mut q = [zero; 4];
    for (i, slot) in q.iter_mut().enumerate() {
        let (a, b) = (h[2 * i], h[2 * i + 1]);
        *slot = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        );
    }
    let t01 = _mm512_add_ps(
        _mm512_unpacklo_ps(q[0], q[1]),
        _mm512_unpackhi_ps(q[0], q[1]),
    );
    let t23 = _mm512_add_ps(
        _mm512_unpacklo_ps(q[2], q[3]),
        _mm512_unpackhi_ps(q[2], q[3]),
    );
    let (a, b) = (_mm512_castps_pd(t01), _mm512_castps_pd(t23));
    _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
    )
}

/// `out[t * n + r0 + r] = w_row(r) · x_row(t)` for the rows of `w` (a chunk
/// of a larger `n`-row matrix starting at row `r0`, rows as long as `x`'s)
/// and every token row of `x`.
///
/// # Safety
/// [`available`] must hold; `w` holds whole rows; `out` holds
/// `m * n` (`x`'s `m` token rows) with `r0 + w.len() / k <= n`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn rows(w: &[bf16], x: &Bf16Tokens, out: &mut [f32], n: usize, r0: usize) {
    let (k, m, stride) = (x.k, x.m, x.stride);
    let num_rows = w.len() / k;
    assert!(out.len() >= m * n && r0 + num_rows <= n);
    let chunk = (CHUNK_BYTES / (stride * 2)).max(TOKENS) / TOKENS * TOKENS;
    // Zeroed once: a lane of a slot no row fills is masked off at the store.
    let mut sums = [[_mm512_setzero_ps(); GROUP]; TOKENS];
    for t0 in (0..m).step_by(chunk) {
        let t1 = (t0 + chunk).min(m);
        for g in (0..num_rows).step_by(GROUP) {
            let group = (num_rows - g).min(GROUP);
            let mut t = t0;
            let tiles = (t1 - t0).div_ceil(TOKENS);
            while t < t1 {
                let tokens = (t1 - t).min(TOKENS);
                // The group's tiles ask for the next group's rows between
                // them: the later tiles find this group's in cache.
                let rows = &w[g * k..(g + group) * k];
                let prefetch = Prefetch::new((t - t0) / TOKENS, tiles);
                // SAFETY: token rows t..t + tokens exist (the loops' bounds).
                unsafe { group_sums(&mut sums, rows, k, x, t..t + tokens, prefetch) };
                for (i, v) in sums.iter().take(tokens).enumerate() {
                    let at = (t + i) * n + r0 + g;
                    // SAFETY: (t + i) < m and r0 + g + group <= n, so the
                    // `group` lanes stored lie inside out (asserted above).
                    unsafe {
                        _mm512_mask_storeu_ps(
                            out.as_mut_ptr().add(at),
                            ((1u32 << group) - 1) as u16,
                            hsum16(v),
                        )
                    };
                }
                t += tokens;
            }
        }
    }
}

/// The unreduced accumulators of the (≤ 16) weight rows `w` against token
/// rows `tokens` (≤ 6) of `x` into `sums[token][row]` (other slots are left
/// as they were).
///
/// # Safety
/// As [`rows`], for those rows and tokens.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn group_sums(
    sums: &mut [[__m512; GROUP]; TOKENS],
    w: &[bf16],
    k: usize,
    x: &Bf16Tokens,
    tokens: Range<usize>,
    prefetch: Prefetch,
) {
    let (stride, group) = (x.stride, w.len() / k);
    let (w, t, tokens) = (w.as_ptr(), tokens.start, tokens.len());
    // SAFETY (every block below): token row t + i < m of a buffer of
    // m × stride (the caller's bounds); weight row r < group of `w`.
    let xp = unsafe { x.x.as_ptr().add(t * stride) };
    let mut r = 0;
    if tokens > 1 {
        while r + 4 <= group {
            let wp = unsafe { w.add(r * k) };
            match tokens {
                6 => put(sums, r, unsafe { tile::<6>(wp, k, xp, stride, prefetch) }),
                5 => put(sums, r, unsafe { tile::<5>(wp, k, xp, stride, prefetch) }),
                4 => put(sums, r, unsafe { tile::<4>(wp, k, xp, stride, prefetch) }),
                3 => put(sums, r, unsafe { tile::<3>(wp, k, xp, stride, prefetch) }),
                _ => put(sums, r, unsafe { tile::<2>(wp, k, xp, stride, prefetch) }),
            }
            r += 4;
        }
    }
    // A lone token, and the last 1-3 rows of a group: each row alone, in
    // memory order.
    for row in r..group {
        for (i, s) in sums.iter_mut().take(tokens).enumerate() {
            s[row] = unsafe { dot1(w.add(row * k), k, xp.add(i * stride)) };
        }
    }
}

/// A tile's `[row][token]` accumulators into `sums[token][r + row]`.
#[inline(always)]
fn put<const T: usize>(sums: &mut [[__m512; GROUP]; TOKENS], r: usize, acc: [[__m512; T]; 4]) {
    for (row, acc_r) in acc.iter().enumerate() {
        for (t, &a) in acc_r.iter().enumerate() {
            sums[t][r + row] = a;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_values as pseudo;

    #[test]
    fn hsum16_puts_each_vectors_sum_in_its_lane() {
        if !available() {
            return;
        }
        let vals = pseudo(256, 3);
        // SAFETY: AVX-512F is present (checked); each slice is 16 floats.
        let v: [__m512; GROUP] =
            std::array::from_fn(|j| unsafe { _mm512_loadu_ps(vals[j * 16..].as_ptr()) });
        let mut got = [0f32; 16];
        // SAFETY: as above; `got` holds 16 floats.
        unsafe { _mm512_storeu_ps(got.as_mut_ptr(), hsum16(&v)) };
        for (j, g) in got.iter().enumerate() {
            let want: f32 = vals[j * 16..(j + 1) * 16].iter().sum();
            assert!((g - want).abs() < 1e-5, "lane {j}: {g} vs {want}");
        }
    }

    /// Every shape (tiles of 6..2 tokens, lone tokens, partial groups,
    /// a partial last step) against f64 sums of the bf16-rounded inputs, and
    /// each token's outputs identical whatever the batch.
    #[test]
    fn sums_match_the_rounded_products_and_do_not_depend_on_the_batch() {
        if !available() {
            return;
        }
        for (n, k, m) in [(37, 80, 11), (16, 64, 1), (21, 32, 7), (5, 200, 3)] {
            let w: Vec<bf16> = pseudo(n * k, 1).into_iter().map(bf16::from_f32).collect();
            let x = pseudo(m * k, 2);
            let packed = Bf16Tokens::new(&x, m, k);
            let mut out = vec![0f32; m * n];
            // SAFETY: available() (checked); w holds n rows, out m × n.
            unsafe { rows(&w, &packed, &mut out, n, 0) };
            for t in 0..m {
                for r in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| w[r * k + c].to_f64() * bf16::from_f32(x[t * k + c]).to_f64())
                        .sum();
                    let got = out[t * n + r] as f64;
                    assert!(
                        (got - want).abs() < 1e-4,
                        "n{n} k{k} t{t} r{r}: {got} vs {want}"
                    );
                }
                // The same token alone.
                let alone = Bf16Tokens::new(&x[t * k..(t + 1) * k], 1, k);
                let mut one = vec![0f32; n];
                // SAFETY: as above, one token row.
                unsafe { rows(&w, &alone, &mut one, n, 0) };
                assert_eq!(one, out[t * n..(t + 1) * n], "n{n} k{k} token {t}");
            }
        }
    }
}
