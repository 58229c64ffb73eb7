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

use super::simd::exp_poly;

/// A weight element widened 16 at a time.
pub(crate) trait Wide16: Copy {
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

/// `src` widened to f32 into the front of `out`, sixteen an instruction
/// (the kernels' own [`Wide16::load16`]); elements past the last 16 one by
/// one.
///
/// # Safety
/// The CPU must support AVX-512F ([`supported`]).
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn widen<E: Wide16>(src: &[E], out: &mut [f32]) {
    let n = src.len().min(out.len());
    let whole = n / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: i + 16 <= n, inside both slices; AVX-512F (the caller).
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), E::load16(src.as_ptr().add(i))) };
    }
    for (o, s) in out[whole..n].iter_mut().zip(&src[whole..n]) {
        *o = s.widen();
    }
}

/// Whether this CPU runs [`rows`].
pub(crate) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// One tile: weight rows `w[0..R]` (each `k` long) against token rows
/// `x[0..T]`, written to `out[t * n + col + r]`. `far`: also ask for the
/// weights 16 rows ahead (into L2).
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
    far: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let k16 = k / 16 * 16;
    let mut i = 0;
    while i < k16 {
        // The next tile's rows at this column, once per 64 bytes of row
        // (row-major weights cross pages often; see the AVX2 kernel).
        if i % (64 / std::mem::size_of::<E>()) == 0 {
            // A lone row (batch 1) looks 4 rows ahead: one row is only
            // 1-3 KB of lead.
            let ahead = if R == 1 { 4 } else { R };
            for r in 0..R {
                // A prefetch never faults: past-the-end addresses are fine.
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((ahead + r) * k + i).cast());
                if far {
                    // Four tiles ahead into L2 as well, from a row tile's
                    // first token tile only: with 6–12 tokens the next
                    // tile's line arrives too late for the weights to
                    // stream while the tokens compute (cold weights, 6
                    // tokens: 6.5 → 4.6–5.2 ms over a 49k-row matrix).
                    _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add((16 + r) * k + i).cast());
                }
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
                    // One token row: each weight row alone, so the weights
                    // stream in memory order (one stream, not four a row
                    // apart): batch-1 decode 1.2-1.3x faster. A row's sum is
                    // the 4-row tile's, bit for bit (its own accumulator, the
                    // same order).
                    (_, 1) => {
                        for i in 0..rr {
                            tile::<E, 1, 1>(wp.add(i * k), k, xp, op, n, r0 + r + i, false);
                        }
                    }
                    (4, 6) => tile::<E, 4, 6>(wp, k, xp, op, n, r0 + r, t == 0),
                    (4, 5) => tile::<E, 4, 5>(wp, k, xp, op, n, r0 + r, t == 0),
                    (4, 4) => tile::<E, 4, 4>(wp, k, xp, op, n, r0 + r, t == 0),
                    (4, 3) => tile::<E, 4, 3>(wp, k, xp, op, n, r0 + r, t == 0),
                    (4, 2) => tile::<E, 4, 2>(wp, k, xp, op, n, r0 + r, t == 0),
                    // The last 1–3 rows of a chunk, one at a time.
                    (_, tt) => {
                        for i in 0..rr {
                            let wp = wp.add(i * k);
                            let col = r0 + r + i;
                            match tt {
                                6 => tile::<E, 1, 6>(wp, k, xp, op, n, col, false),
                                5 => tile::<E, 1, 5>(wp, k, xp, op, n, col, false),
                                4 => tile::<E, 1, 4>(wp, k, xp, op, n, col, false),
                                3 => tile::<E, 1, 3>(wp, k, xp, op, n, col, false),
                                2 => tile::<E, 1, 2>(wp, k, xp, op, n, col, false),
                                _ => tile::<E, 1, 1>(wp, k, xp, op, n, col, false),
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

/// Transposes 16 rows of 16 32-bit lanes (an AMX tile's packing and
/// write-back; attention's sixteen scores at once). Inlined: called, its
/// two 1 KiB arrays went through memory (`memmove`, 2–3% of a batch-32
/// decode step with the key transposes around it).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // Rows 4g..4g+3 of column 4L+c end up in lane L of u[4g + c].
    let mut u = [_mm512_setzero_si512(); 16];
    for g in 0..4 {
        let b = 4 * g;
        let t0 = _mm512_unpacklo_epi32(r[b], r[b + 1]);
        let t1 = _mm512_unpackhi_epi32(r[b], r[b + 1]);
        let t2 = _mm512_unpacklo_epi32(r[b + 2], r[b + 3]);
        let t3 = _mm512_unpackhi_epi32(r[b + 2], r[b + 3]);
        u[b] = _mm512_unpacklo_epi64(t0, t2);
        u[b + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[b + 2] = _mm512_unpacklo_epi64(t1, t3);
        u[b + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let v_even = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]);
        let v_odd = _mm512_shuffle_i32x4::<0xdd>(u[c], u[4 + c]);
        let w_even = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
        let w_odd = _mm512_shuffle_i32x4::<0xdd>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_i32x4::<0x88>(v_even, w_even);
        out[8 + c] = _mm512_shuffle_i32x4::<0xdd>(v_even, w_even);
        out[4 + c] = _mm512_shuffle_i32x4::<0x88>(v_odd, w_odd);
        out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(v_odd, w_odd);
    }
    out
}

/// `e^x` lane by lane (Cephes' `expf`: `x = n·ln 2 + r`, a degree-6
/// polynomial for `e^r`, `scalef` for `2^n`; within 2 ulp of libm's).
#[target_feature(enable = "avx512f")]
pub(crate) fn exp16(x: __m512) -> __m512 {
    // Below e^-103 the result is 0 or denormal either way.
    let x = _mm512_max_ps(x, _mm512_set1_ps(-103.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp_poly::LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp_poly::LN2_LO), r);
    let p = exp_poly::P[1..]
        .iter()
        .fold(_mm512_set1_ps(exp_poly::P[0]), |p, &c| {
            _mm512_fmadd_ps(p, r, _mm512_set1_ps(c))
        });
    let e = _mm512_fmadd_ps(
        p,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    _mm512_scalef_ps(e, n)
}

/// `gate ← silu(gate) · up`, sixteen lanes at a time.
///
/// # Safety
/// AVX-512F; `up` at least as long as `gate`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert!(up.len() >= gate.len());
    let one = _mm512_set1_ps(1.0);
    for (g, u) in gate.chunks_mut(16).zip(up.chunks(16)) {
        let mask: __mmask16 = if g.len() == 16 {
            0xffff
        } else {
            (1u16 << g.len()) - 1
        };
        // SAFETY: the mask covers the chunk's floats only.
        unsafe {
            let gv = _mm512_maskz_loadu_ps(mask, g.as_ptr());
            let uv = _mm512_maskz_loadu_ps(mask, u.as_ptr());
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(g.as_mut_ptr(), mask, _mm512_mul_ps(s, uv));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp16_is_within_two_ulp_of_libm() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("no AVX-512: nothing to check");
            return;
        }
        let mut worst = 0f32;
        for i in 0..200_000 {
            let x = -90.0 + i as f32 * (100.0 / 200_000.0);
            let mut lanes = [0f32; 16];
            // SAFETY: AVX-512F checked above; 16 floats each way.
            unsafe {
                let v = exp16(_mm512_set1_ps(x));
                _mm512_storeu_ps(lanes.as_mut_ptr(), v);
            }
            let want = x.exp();
            if want > f32::MIN_POSITIVE {
                let ulp = (want.to_bits() as i64 - lanes[0].to_bits() as i64).unsigned_abs() as f32;
                worst = worst.max(ulp);
            }
        }
        assert!(worst <= 2.0, "{worst} ulp");
    }
}
