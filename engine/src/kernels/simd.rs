//! Explicit SIMD inner loops (AVX2 + FMA + F16C on x86-64), with portable
//! scalar fallbacks chosen at run time.
//!
//! Float reductions do not auto-vectorise without fast-math, so the dot
//! products that dominate decode are written out by hand. The row kernel
//! works on tiles of 4 weight rows × 3 token rows: 12 accumulators, 4 weight
//! loads and 3 activation loads per 8 columns, within AVX2's 16 registers.
//! Where the CPU has AVX-512 the row kernel is `simd512`'s instead.

use half::{bf16, f16};

/// A weight element the kernels can widen to f32.
pub(crate) trait Elem: Copy + Send + Sync {
    fn widen(self) -> f32;
    /// Loads 8 consecutive elements as f32 lanes.
    ///
    /// # Safety
    /// `p` must be valid for reading 8 elements, and the CPU must support
    /// AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

impl Elem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bf16 (16 bytes); a bf16 is
        // the top half of an f32, so widening is a 16-bit left shift.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f16 (16 bytes).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// Whether this CPU runs the AVX2 + FMA + F16C kernels of this module.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// One tile: rows `w[0..R]` (each `k` long, `R` rows starting at `w`) against
/// token rows `x[0..T]`, written to `out[t * n + col + r]`.
///
/// # Safety
/// `w` must hold `R * k` elements, `x` `T * k`, `out` reach index
/// `(T - 1) * n + col + R - 1`; the CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<E: Elem, const R: usize, const T: usize>(
    w: *const E,
    k: usize,
    x: *const f32,
    out: *mut f32,
    n: usize,
    col: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let k8 = k / 8 * 8;
    let mut i = 0;
    while i < k8 {
        // Row-major weights make each tile 4 short streams that cross 4 KiB
        // pages often, which the hardware prefetcher handles badly: fetch the
        // next tile's cache line at this column, once per 64 bytes of row.
        if i % (64 / std::mem::size_of::<E>()) == 0 {
            for r in 0..R {
                // A prefetch is a hint that never faults, so the address may
                // lie past the end of the weights (last tiles).
                _mm_prefetch::<_MM_HINT_T0>(
                    w.wrapping_add((PREFETCH_TILES * R + r) * k + i).cast(),
                );
            }
        }
        let mut xv = [_mm256_setzero_ps(); T];
        for (t, v) in xv.iter_mut().enumerate() {
            // SAFETY: i + 8 <= k, so x row t has 8 readable floats here.
            *v = unsafe { _mm256_loadu_ps(x.add(t * k + i)) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8 <= k within weight row r.
            let wv = unsafe { E::load8(w.add(r * k + i)) };
            for (a, &xt) in acc_r.iter_mut().zip(&xv) {
                *a = _mm256_fmadd_ps(wv, xt, *a);
            }
        }
        i += 8;
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (t, &a) in acc_r.iter().enumerate() {
            let mut s = hsum(a);
            for j in k8..k {
                // SAFETY: j < k inside row r of w and row t of x.
                s += unsafe { (*w.add(r * k + j)).widen() * *x.add(t * k + j) };
            }
            // SAFETY: within the bounds promised by the caller.
            unsafe { *out.add(t * n + col + r) = s };
        }
    }
}

/// How many tiles ahead [`tile`] prefetches weights.
const PREFETCH_TILES: usize = 1;

macro_rules! dispatch_tile {
    ($e:ty, $r:expr, $t:expr, $($args:expr),*) => {
        match ($r, $t) {
            (4, 3) => tile::<$e, 4, 3>($($args),*),
            (4, 2) => tile::<$e, 4, 2>($($args),*),
            (4, 1) => tile::<$e, 4, 1>($($args),*),
            (3, 3) => tile::<$e, 3, 3>($($args),*),
            (3, 2) => tile::<$e, 3, 2>($($args),*),
            (3, 1) => tile::<$e, 3, 1>($($args),*),
            (2, 3) => tile::<$e, 2, 3>($($args),*),
            (2, 2) => tile::<$e, 2, 2>($($args),*),
            (2, 1) => tile::<$e, 2, 1>($($args),*),
            (1, 3) => tile::<$e, 1, 3>($($args),*),
            (1, 2) => tile::<$e, 1, 2>($($args),*),
            _ => tile::<$e, 1, 1>($($args),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_avx2<E: Elem>(
    w: &[E],
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    n: usize,
    r0: usize,
) {
    let rows = w.len() / k;
    let mut r = 0;
    while r < rows {
        let rr = (rows - r).min(4);
        let mut t = 0;
        while t < m {
            let tt = (m - t).min(3);
            // SAFETY: rows r..r+rr of this chunk and token rows t..t+tt
            // exist; out index (t+tt-1)*n + r0+r+rr-1 < m*n = out.len().
            unsafe {
                let wp = w.as_ptr().add(r * k);
                let xp = x.as_ptr().add(t * k);
                let op = out.as_mut_ptr().add(t * n);
                dispatch_tile!(E, rr, tt, wp, k, xp, op, n, r0 + r);
            }
            t += tt;
        }
        r += rr;
    }
}

fn rows_scalar<E: Elem>(
    w: &[E],
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    n: usize,
    r0: usize,
) {
    for (r, wr) in w.chunks_exact(k).enumerate() {
        for t in 0..m {
            let xr = &x[t * k..(t + 1) * k];
            out[t * n + r0 + r] = wr.iter().zip(xr).map(|(a, b)| a.widen() * b).sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn rows<E: Elem + super::simd512::Wide16>(
    w: &[E],
    k: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    n: usize,
    r0: usize,
) {
    if super::simd512::supported() {
        // SAFETY: the CPU supports AVX-512F; `w` holds whole rows of `k`
        // (chunks of the matrix), `x` m rows and `out` m × n values, as the
        // callers of `rows_*` promise.
        unsafe { super::simd512::rows(w, k, x, m, out, n, r0) };
        return;
    }
    if has_avx2() {
        // SAFETY: the CPU supports the features `rows_avx2` is compiled for.
        unsafe { rows_avx2(w, k, x, m, out, n, r0) };
        return;
    }
    rows_scalar(w, k, x, m, out, n, r0);
}

#[cfg(not(target_arch = "x86_64"))]
fn rows<E: Elem>(w: &[E], k: usize, x: &[f32], m: usize, out: &mut [f32], n: usize, r0: usize) {
    rows_scalar(w, k, x, m, out, n, r0);
}

/// `out[t * n + r0 + r] = w_row(r) · x_row(t)` for the rows of `w` (a chunk
/// of a larger `n`-row matrix starting at row `r0`).
pub fn rows_f32(w: &[f32], k: usize, x: &[f32], m: usize, out: &mut [f32], n: usize, r0: usize) {
    rows(w, k, x, m, out, n, r0);
}
/// As [`rows_f32`] for bf16 weights.
pub fn rows_bf16(w: &[bf16], k: usize, x: &[f32], m: usize, out: &mut [f32], n: usize, r0: usize) {
    rows(w, k, x, m, out, n, r0);
}
/// As [`rows_f32`] for f16 weights.
pub fn rows_f16(w: &[f16], k: usize, x: &[f32], m: usize, out: &mut [f32], n: usize, r0: usize) {
    rows(w, k, x, m, out, n, r0);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let n16 = n / 16 * 16;
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n16 {
        // SAFETY: i + 16 <= n for both slices.
        unsafe {
            s0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                s0,
            );
            s1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                s1,
            );
        }
        i += 16;
    }
    let mut s = hsum(_mm256_add_ps(s0, s1));
    for j in n16..n {
        s += a[j] * b[j];
    }
    s
}

/// `a · b` over the shorter length.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports the features `dot_avx2` is compiled for.
        return unsafe { dot_avx2(a, b) };
    }
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_avx2(acc: &mut [f32], s: f32, x: &[f32]) {
    let n = acc.len().min(x.len());
    let n8 = n / 8 * 8;
    let sv = _mm256_set1_ps(s);
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            let p = acc.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                p,
                _mm256_fmadd_ps(sv, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)),
            );
        }
        i += 8;
    }
    for j in n8..n {
        acc[j] += s * x[j];
    }
}

/// `acc += s * x`.
pub fn axpy_f32(acc: &mut [f32], s: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports the features `axpy_avx2` is compiled for.
        unsafe { axpy_avx2(acc, s, x) };
        return;
    }
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += s * v;
    }
}

/// `src` widened to f32 into the front of `out`: sixteen an instruction
/// on AVX-512, eight on AVX2 (the portable loop compiles to SSE2's four,
/// and a decode step's attention spent a third of its time there).
pub(crate) fn widen_bf16(src: &[bf16], out: &mut [f32]) {
    let out = &mut out[..src.len()];
    #[cfg(target_arch = "x86_64")]
    {
        if super::simd512::supported() {
            // SAFETY: AVX-512F is present (checked).
            unsafe { super::simd512::widen(src, out) };
            return;
        }
        if has_avx2() {
            // SAFETY: the CPU supports the features `widen_avx2` is compiled for.
            unsafe { widen_avx2(src, out) };
            return;
        }
    }
    for (o, s) in out.iter_mut().zip(src) {
        *o = s.widen();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_avx2(src: &[bf16], out: &mut [f32]) {
    let whole = src.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= whole, inside both slices (out is src's length).
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), bf16::load8(src.as_ptr().add(i))) };
    }
    for (o, s) in out[whole..].iter_mut().zip(&src[whole..]) {
        *o = s.widen();
    }
}

/// The `exp` polynomial both vector widths use ([`exp8`] and
/// `simd512::exp16`): `x = n·ln 2 + r`, ln 2 in two parts so `n·ln 2` is
/// subtracted without rounding, `e^r ≈ 1 + r + r²·p(r)` with `p`'s
/// coefficients highest first.
#[cfg(target_arch = "x86_64")]
pub(crate) mod exp_poly {
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
}

/// `e^x` per lane ([`exp_poly`]), `2^n` built in the exponent bits; below
/// `e^-87` (where `2^n` would leave the normals) the result is 0, as are
/// `−∞`'s.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_poly::LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_poly::LN2_LO), r);
    let p = exp_poly::P[1..]
        .iter()
        .fold(_mm256_set1_ps(exp_poly::P[0]), |p, &c| {
            _mm256_fmadd_ps(p, r, _mm256_set1_ps(c))
        });
    let e = _mm256_fmadd_ps(
        p,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    // 2^n for n in -126..=127 (x was clamped): n + 127 in the exponent.
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_andnot_ps(tiny, _mm256_mul_ps(e, two_n))
}

/// `gate ← silu(gate) · up` on AVX2, eight lanes at a time; the last
/// partial eight through the same polynomial, so an element's bits do not
/// depend on where the slice ends.
///
/// # Safety
/// AVX2, FMA and F16C ([`has_avx2`]); `up` at least as long as `gate`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let silu_mul8 = |g: __m256, u: __m256| {
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
    };
    let whole = gate.len() / 8 * 8;
    let (body, tail) = gate.split_at_mut(whole);
    let (up_body, up_tail) = up[..whole + tail.len()].split_at(whole);
    for (g, u) in body.chunks_exact_mut(8).zip(up_body.chunks_exact(8)) {
        // SAFETY: both chunks hold 8 floats.
        unsafe {
            let v = silu_mul8(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr()));
            _mm256_storeu_ps(g.as_mut_ptr(), v);
        }
    }
    if !tail.is_empty() {
        let (mut gl, mut ul) = ([0f32; 8], [0f32; 8]);
        gl[..tail.len()].copy_from_slice(tail);
        ul[..tail.len()].copy_from_slice(up_tail);
        // SAFETY: both hold 8 floats.
        unsafe {
            let v = silu_mul8(_mm256_loadu_ps(gl.as_ptr()), _mm256_loadu_ps(ul.as_ptr()));
            _mm256_storeu_ps(gl.as_mut_ptr(), v);
        }
        tail.copy_from_slice(&gl[..tail.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row kernel the CPU has (AVX-512, AVX2, scalar) against f64
    /// sums, for row and token counts around the tiles' sizes and widths
    /// off the vector width.
    #[test]
    fn row_kernels_agree_with_exact_sums() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 2001) as f32 / 1000.0 - 1.0
        };
        for (k, rows_n, m) in [
            (40, 9, 13),
            (576, 7, 8),
            (33, 4, 6),
            (16, 5, 1),
            (100, 1, 7),
        ] {
            let w: Vec<bf16> = (0..rows_n * k).map(|_| bf16::from_f32(next())).collect();
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let exact: Vec<f64> = (0..m * rows_n)
                .map(|i| {
                    let (t, r) = (i / rows_n, i % rows_n);
                    (0..k)
                        .map(|j| f64::from(w[r * k + j].to_f32()) * f64::from(x[t * k + j]))
                        .sum()
                })
                .collect();
            let check = |name: &str, out: &[f32]| {
                for (i, (&got, &want)) in out.iter().zip(&exact).enumerate() {
                    assert!(
                        (f64::from(got) - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{name} k={k} rows={rows_n} m={m} output {i}: {got} vs {want}"
                    );
                }
            };
            let mut out = vec![0.0f32; m * rows_n];
            rows_scalar(&w, k, &x, m, &mut out, rows_n, 0);
            check("scalar", &out);
            #[cfg(target_arch = "x86_64")]
            {
                if has_avx2() {
                    out.fill(0.0);
                    // SAFETY: the CPU has AVX2, FMA and F16C.
                    unsafe { rows_avx2(&w, k, &x, m, &mut out, rows_n, 0) };
                    check("avx2", &out);
                }
                if super::super::simd512::supported() {
                    out.fill(0.0);
                    // SAFETY: the CPU has AVX-512F; the shapes are whole.
                    unsafe { super::super::simd512::rows(&w, k, &x, m, &mut out, rows_n, 0) };
                    check("avx512", &out);
                }
            }
        }
    }
}
