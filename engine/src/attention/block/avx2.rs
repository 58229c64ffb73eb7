//! [`BlockMath::Avx2`](super::BlockMath): the block math on CPUs with AVX2,
//! FMA and F16C but no AVX-512, for rows of a multiple of 16.
//!
//! **Same bits as the portable math.** The portable score is
//! `kernels::dot_f32`, which on these CPUs sums lane `l` of two 8-lane
//! accumulators over the elements `c ≡ l (mod 16)` in order, adds the two
//! (`l` with `l + 8`), then halves (`l` with `l + 4`, `+ 2`, `+ 1`): the
//! AVX-512 order too. Here each key's two accumulators are the same; eight
//! keys' vectors are then reduced together by shuffles that pair the same
//! lanes at each level, so key `j`'s score lands in lane `j` with the bits
//! `dot_f32` gives. A key row is loaded once for up to four queries, and
//! 16-bit rows are widened as they load (no decoded copy). The weighted
//! sum is `axpy_f32`'s per element (one FMA per slot, in slot order) with
//! the output row held in registers across the block. Only `exp` differs
//! from the portable math: a vector polynomial (as AVX-512's), the same
//! for a query whatever shares its block.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{WeightedSum, MAX_QUERIES};
use crate::kernels::simd::{exp8, Elem};

/// Key slots reduced together (one per f32 lane).
const KEYS: usize = 8;

/// For each query `i`: `outs[i][j] = qs[i]·key[j] · (scale · factors[j])`
/// for `j` in `slots` (keys: rows of `d` from slot 0).
///
/// # Safety
/// AVX2, FMA and F16C; `d` a multiple of 16; `keys` holds `slots.end`
/// rows of `d`; each query holds `d` values; `factors` and each out reach
/// `slots.end`; at most [`MAX_QUERIES`] queries.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<E: Elem>(
    qs: &[&[f32]],
    keys: &[E],
    d: usize,
    scale: f32,
    factors: &[f32],
    outs: &mut [&mut [f32]],
    slots: Range<usize>,
) {
    const { assert!(MAX_QUERIES == 4) };
    // SAFETY (each arm): the caller's promise.
    unsafe {
        match qs.len() {
            4 => scores_q::<4, E>(qs, keys, d, scale, factors, outs, slots),
            3 => scores_q::<3, E>(qs, keys, d, scale, factors, outs, slots),
            2 => scores_q::<2, E>(qs, keys, d, scale, factors, outs, slots),
            1 => scores_q::<1, E>(qs, keys, d, scale, factors, outs, slots),
            _ => {}
        }
    }
}

/// [`scores`] for `Q` queries, eight slots at a time.
///
/// # Safety
/// As [`scores`], with `qs.len() == Q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_q<const Q: usize, E: Elem>(
    qs: &[&[f32]],
    keys: &[E],
    d: usize,
    scale: f32,
    factors: &[f32],
    outs: &mut [&mut [f32]],
    slots: Range<usize>,
) {
    let q: [*const f32; Q] = std::array::from_fn(|i| qs[i].as_ptr());
    let mut j0 = slots.start;
    while j0 < slots.end {
        let n = (slots.end - j0).min(KEYS);
        let mut lanes = [[_mm256_setzero_ps(); KEYS]; Q];
        for jj in 0..n {
            // SAFETY: slot j0 + jj < slots.end: a row of d inside `keys`.
            let sums = unsafe { key_lanes::<Q, E>(&q, keys.as_ptr().add((j0 + jj) * d), d) };
            for (l, s) in lanes.iter_mut().zip(sums) {
                l[jj] = s;
            }
        }
        let mut sf = [0f32; KEYS];
        for (jj, f) in sf.iter_mut().enumerate().take(n) {
            *f = scale * factors[j0 + jj];
        }
        // SAFETY: `sf` holds 8 floats.
        let sf = unsafe { _mm256_loadu_ps(sf.as_ptr()) };
        for (l, out) in lanes.iter().zip(outs.iter_mut()) {
            let mut s = [0f32; KEYS];
            // SAFETY: `s` holds 8 floats.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr(), _mm256_mul_ps(across(l), sf)) };
            out[j0..j0 + n].copy_from_slice(&s[..n]);
        }
        j0 += n;
    }
}

/// One key row against `Q` queries: each query's two accumulators (lanes
/// `c mod 16` below 8 and from 8) added, as `dot_f32` adds them.
///
/// # Safety
/// `key` and each query hold `d` (a multiple of 16) values; AVX2, FMA,
/// F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn key_lanes<const Q: usize, E: Elem>(
    q: &[*const f32; Q],
    key: *const E,
    d: usize,
) -> [__m256; Q] {
    let mut s0 = [_mm256_setzero_ps(); Q];
    let mut s1 = [_mm256_setzero_ps(); Q];
    for c in (0..d).step_by(16) {
        // SAFETY: c + 16 <= d for the key and every query.
        unsafe {
            let (k0, k1) = (E::load8(key.add(c)), E::load8(key.add(c + 8)));
            for i in 0..Q {
                s0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q[i].add(c)), k0, s0[i]);
                s1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q[i].add(c + 8)), k1, s1[i]);
            }
        }
    }
    std::array::from_fn(|i| _mm256_add_ps(s0[i], s1[i]))
}

/// Eight keys' lane vectors reduced to one score each, key `j` in lane
/// `j`, by `hsum`'s pairings: lane `l` with `l + 4`, then `+ 2`, then
/// `+ 1` (a float add gives the same bits either way round).
#[inline]
#[target_feature(enable = "avx2")]
fn across(v: &[__m256; KEYS]) -> __m256 {
    // `l` with `l + 4`: keys 2p and 2p + 1 in the low and high halves.
    let halves = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    };
    let (a01, a23, a45, a67) = (
        halves(v[0], v[1]),
        halves(v[2], v[3]),
        halves(v[4], v[5]),
        halves(v[6], v[7]),
    );
    // `l` with `l + 2`: per half, lanes 0–1 of one pair and of the next.
    let quarters = |x: __m256, y: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0x44>(x, y),
            _mm256_shuffle_ps::<0xEE>(x, y),
        )
    };
    let (b0, b1) = (quarters(a01, a23), quarters(a45, a67));
    // `l` with `l + 1`: low half keys 0, 2, 4, 6; high half 1, 3, 5, 7.
    let c = _mm256_add_ps(
        _mm256_shuffle_ps::<0x88>(b0, b1),
        _mm256_shuffle_ps::<0xDD>(b0, b1),
    );
    _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Each `p` becomes `exp(p − max)`; returns their sum.
///
/// # Safety
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_sum(probs: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    let mut chunks = probs.chunks_exact_mut(KEYS);
    for chunk in chunks.by_ref() {
        // SAFETY: the chunk holds 8 floats.
        unsafe {
            let p = exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), m));
            _mm256_storeu_ps(chunk.as_mut_ptr(), p);
            sum = _mm256_add_ps(sum, p);
        }
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        // Padded with −∞, whose exponentials are 0.
        let mut lane = [f32::NEG_INFINITY; KEYS];
        lane[..tail.len()].copy_from_slice(tail);
        // SAFETY: `lane` holds 8 floats.
        unsafe {
            let p = exp8(_mm256_sub_ps(_mm256_loadu_ps(lane.as_ptr()), m));
            _mm256_storeu_ps(lane.as_mut_ptr(), p);
            sum = _mm256_add_ps(sum, p);
        }
        tail.copy_from_slice(&lane[..tail.len()]);
    }
    let mut s = [0f32; KEYS];
    // SAFETY: `s` holds 8 floats.
    unsafe { _mm256_storeu_ps(s.as_mut_ptr(), sum) };
    s.iter().sum()
}

/// For each sum: `out[row..row + d] += Σ_j weights[j] · values[j]` over its
/// slots in slot order, 64 columns at a time held in registers.
///
/// # Safety
/// AVX2, FMA and F16C; `d` a multiple of 16; `values` holds each sum's
/// slots' rows of `d`; each row inside `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn accumulate<E: Elem>(
    out: &mut [f32],
    sums: &[WeightedSum<'_>],
    values: &[E],
    d: usize,
) {
    const COLUMNS: usize = 64;
    for a in sums {
        let mut c0 = 0;
        while c0 < d {
            let width = match d - c0 {
                r if r >= COLUMNS => 8,
                r if r >= 48 => 6,
                r if r >= 32 => 4,
                _ => 2,
            };
            // SAFETY: the caller's promise; `c0 + 8 · width <= d` (d is a
            // multiple of 16).
            unsafe {
                match width {
                    8 => columns::<8, E>(out, a, values, d, c0),
                    6 => columns::<6, E>(out, a, values, d, c0),
                    4 => columns::<4, E>(out, a, values, d, c0),
                    _ => columns::<2, E>(out, a, values, d, c0),
                }
            }
            c0 += 8 * width;
        }
    }
}

/// Columns `c0..c0 + 8V` of one sum, in `V` registers across its slots.
///
/// # Safety
/// As [`accumulate`], with `c0 + 8V <= d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns<const V: usize, E: Elem>(
    out: &mut [f32],
    a: &WeightedSum<'_>,
    values: &[E],
    d: usize,
    c0: usize,
) {
    let dst = out[a.row + c0..a.row + c0 + 8 * V].as_mut_ptr();
    // SAFETY: dst holds 8V floats.
    let mut acc: [__m256; V] = std::array::from_fn(|v| unsafe { _mm256_loadu_ps(dst.add(8 * v)) });
    for j in a.slots.clone() {
        let w = _mm256_set1_ps(a.weights[j]);
        // SAFETY: slot j's row of d is inside `values` (the caller's
        // promise); c0 + 8V <= d.
        let row = unsafe { values.as_ptr().add(j * d + c0) };
        for (v, acc) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            *acc = _mm256_fmadd_ps(w, unsafe { E::load8(row.add(8 * v)) }, *acc);
        }
    }
    for (v, &acc) in acc.iter().enumerate() {
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(dst.add(8 * v), acc) };
    }
}
