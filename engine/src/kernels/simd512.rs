//! The row kernel on AVX-512: tiles of 4 weight rows × up to 6 token rows.
//!
//! Batched decode and the short prefill chunks the step-time budget makes
//! run here, and at batch ≥ 4 they are compute-bound: the AVX2 kernel's
//! 4 × 3 tile of 8-lane registers leaves half of an AVX-512 core's FMA
//! width unused and re-widens each weight row once per 3 tokens. Here a
//! 16-column step loads each weight row once (widened from bf16/f16 in
//! registers) for 6 tokens: 24 accumulators, 6 activation registers and
//! one weight register of the 32. Each output is still one accumulator's
//! FMAs in column order, then one reduction, so a token's result does not
//! depend on the tokens beside it (batch invariance holds as in the AVX2
//! kernel; the two kernels differ from each other in the last bits).

use std::arch::x86_64::*;

use half::{bf16, f16};

/// A weight element widened 16 at a time.
pub(super) trait Wide16: Copy {
    /// Loads 16 consecutive elements as f32 lanes.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 elements; the CPU must support
    /// AVX-512F.
    unsafe fn load16(p: *const Self) -> __m512;
    fn widen(self) -> f32;
}

impl Wide16 for f32 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: the caller guarantees 16 readable floats.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Wide16 for bf16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bf16 (32 bytes); a bf16
        // is the top half of an f32, so widening is a 16-bit left shift.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Wide16 for f16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f16 (32 bytes).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// Whether this CPU runs [`rows`].
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// One tile: weight rows `w[0..R]` (each `k` long) against token rows
/// `x[0..T]`, written to `out[t * n + col + r]`.
///
/// # Safety
/// `w` must hold `R * k` elements, `x` `T * k`, `out` reach index
/// `(T - 1) * n + col + R - 1`; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile<E: Wide16, const R: usize, const T: usize>(
    w: *const E,
    k: usize,
    x: *const f32,
    out: *mut f32,
    n: usize,
    col: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let k16 = k / 16 * 16;
    let mut i = 0;
    while i < k16 {
        // The next tile's rows at this column, once per 64 bytes of row
        // (row-major weights cross pages often; see the AVX2 kernel).
        if i % (64 / std::mem::size_of::<E>()) == 0 {
            for r in 0..R {
                // A prefetch never faults: past-the-end addresses are fine.
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((R + r) * k + i).cast());
            }
        }
        let mut xv = [_mm512_setzero_ps(); T];
        for (t, v) in xv.iter_mut().enumerate() {
            // SAFETY: i + 16 <= k, so token row t has 16 floats here.
            *v = unsafe { _mm512_loadu_ps(x.add(t * k + i)) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: i + 16 <= k within weight row r.
            let wv = unsafe { E::load16(w.add(r * k + i)) };
            for (a, &xt) in acc_r.iter_mut().zip(&xv) {
                *a = _mm512_fmadd_ps(wv, xt, *a);
            }
        }
        i += 16;
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (t, &a) in acc_r.iter().enumerate() {
            let mut s = _mm512_reduce_add_ps(a);
            for j in k16..k {
                // SAFETY: j < k inside row r of w and row t of x.
                s += unsafe { (*w.add(r * k + j)).widen() * *x.add(t * k + j) };
            }
            // SAFETY: within the bounds promised by the caller.
            unsafe { *out.add(t * n + col + r) = s };
        }
    }
}

/// Token rows per tile: 6 × 4 accumulators fill 24 of the 32 registers.
const TOKENS: usize = 6;

/// `out[t * n + r0 + r] = w_row(r) · x_row(t)` for the rows of `w` (a chunk
/// of a larger `n`-row matrix starting at row `r0`) and `m` token rows.
///
/// # Safety
/// The CPU must support AVX-512F ([`supported`]); `w` holds whole rows of
/// `k`, `x` holds `m * k`, `out` holds `m * n` with `r0 + w.len() / k <= n`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rows<E: Wide16>(
    w: &[E],
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    n: usize,
    r0: usize,
) {
    let num_rows = w.len() / k;
    let mut r = 0;
    while r < num_rows {
        let rr = (num_rows - r).min(4);
        let mut t = 0;
        while t < m {
            let tt = (m - t).min(TOKENS);
            // SAFETY: rows r..r+rr of this chunk and token rows t..t+tt
            // exist; the last output index (t+tt-1)*n + r0+r+rr-1 is below
            // m*n = out.len() (the caller's bounds).
            unsafe {
                let wp = w.as_ptr().add(r * k);
                let xp = x.as_ptr().add(t * k);
                let op = out.as_mut_ptr().add(t * n);
                match (rr, tt) {
                    (4, 6) => tile::<E, 4, 6>(wp, k, xp, op, n, r0 + r),
                    (4, 5) => tile::<E, 4, 5>(wp, k, xp, op, n, r0 + r),
                    (4, 4) => tile::<E, 4, 4>(wp, k, xp, op, n, r0 + r),
                    (4, 3) => tile::<E, 4, 3>(wp, k, xp, op, n, r0 + r),
                    (4, 2) => tile::<E, 4, 2>(wp, k, xp, op, n, r0 + r),
                    (4, _) => tile::<E, 4, 1>(wp, k, xp, op, n, r0 + r),
                    // The last 1–3 rows of a chunk, one at a time.
                    (_, tt) => {
                        for i in 0..rr {
                            let wp = wp.add(i * k);
                            let col = r0 + r + i;
                            match tt {
                                6 => tile::<E, 1, 6>(wp, k, xp, op, n, col),
                                5 => tile::<E, 1, 5>(wp, k, xp, op, n, col),
                                4 => tile::<E, 1, 4>(wp, k, xp, op, n, col),
                                3 => tile::<E, 1, 3>(wp, k, xp, op, n, col),
                                2 => tile::<E, 1, 2>(wp, k, xp, op, n, col),
                                _ => tile::<E, 1, 1>(wp, k, xp, op, n, col),
                            }
                        }
                    }
                }
            }
            t += tt;
        }
        r += rr;
    }
}
