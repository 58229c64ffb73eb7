//! The AVX-512 forms of [`BlockMath`](super::BlockMath): scores from keys
//! transposed or as stored (one order of sums either way, see the parent
//! module), the softmax step's max and exponentials, and the weighted sums
//! of values held in registers.

use std::arch::x86_64::*;
use std::ops::Range;

use half::{bf16, f16};

use super::{Rows, WeightedSum, MAX_QUERIES};
use crate::kernels::simd512::{exp16, transpose16, Wide16};

/// Lanes `0..n` (n ≤ 16).
fn first(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        (1u16 << n) - 1
    }
}

/// `rows` (≤ 16) key rows of `d` into `kt` (`d × 16`): `kt[c·16 + j] =
/// keys[j·d + c]` widened to f32, lanes past `rows` zero.
///
/// # Safety
/// AVX-512F; `d` a multiple of 16; `kt` holds `d · 16` floats.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_keys<E: Wide16>(keys: &[E], rows: usize, d: usize, kt: &mut [f32]) {
    assert!(rows <= 16 && keys.len() >= rows * d && kt.len() >= d * 16);
    for c in (0..d).step_by(16) {
        let mut block = [_mm512_setzero_si512(); 16];
        for (j, r) in block.iter_mut().enumerate().take(rows) {
            // SAFETY: row j < rows has d elements from j·d; c + 16 ≤ d.
            *r = _mm512_castps_si512(unsafe { E::load16(keys.as_ptr().add(j * d + c)) });
        }
        for (i, col) in transpose16(block).into_iter().enumerate() {
            // SAFETY: (c + i)·16 + 16 ≤ d·16 ≤ kt's length.
            unsafe { _mm512_storeu_si512(kt.as_mut_ptr().add((c + i) * 16).cast(), col) };
        }
    }
}

/// What a score is scaled by and which slots are written.
pub(super) struct Scoring<'a> {
    pub scale: f32,
    pub factors: &'a [f32],
    pub slots: Range<usize>,
}

impl Scoring<'_> {
    /// Each query's 16 sums (a vector over slots) times `scale ·
    /// factors[j]`, into its out's slots.
    ///
    /// # Safety
    /// AVX-512F; `factors` and each out hold `slots.end` (≤ 16) floats.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store<const Q: usize>(&self, sums: &[__m512; Q], outs: &mut [&mut [f32]]) {
        let mask = first(self.slots.end) & !first(self.slots.start);
        // SAFETY: only the masked lanes, inside `factors` and each out, are
        // read or written.
        unsafe {
            let f = _mm512_maskz_loadu_ps(mask, self.factors.as_ptr());
            let f = _mm512_mul_ps(_mm512_set1_ps(self.scale), f);
            for (sum, out) in sums.iter().zip(outs.iter_mut()) {
                _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, _mm512_mul_ps(*sum, f));
            }
        }
    }
}

/// `a + b` per query.
#[inline]
#[target_feature(enable = "avx512f")]
fn add_each<const Q: usize>(mut a: [__m512; Q], b: [__m512; Q]) -> [__m512; Q] {
    for (x, y) in a.iter_mut().zip(b) {
        *x = _mm512_add_ps(*x, y);
    }
    a
}

/// `Q` queries' scores against a transposed block: the 16 lanes' sums
/// ([`lane_sum`]) added as every score's are, `l` with `l + 8`, then with
/// `l + 4`, `l + 2`, `l + 1`. The lanes are made in the tree's order and
/// added as soon as a pair is ready, so at most four partial sums per query
/// are live (sixteen lanes of four queries held at once spilled, and
/// prefill slowed by a tenth); written out, as a closure per level was not
/// inlined.
///
/// # Safety
/// As [`lane_sum`].
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn lane_tree<const Q: usize>(q: &[*const f32; Q], kt: &[f32], d: usize) -> [__m512; Q] {
    // SAFETY (every call): the caller's promise.
    unsafe {
        let t0 = add_each(lane_sum(q, kt, 0, d), lane_sum(q, kt, 8, d));
        let t4 = add_each(lane_sum(q, kt, 4, d), lane_sum(q, kt, 12, d));
        let u0 = add_each(t0, t4);
        let t2 = add_each(lane_sum(q, kt, 2, d), lane_sum(q, kt, 10, d));
        let t6 = add_each(lane_sum(q, kt, 6, d), lane_sum(q, kt, 14, d));
        let w0 = add_each(u0, add_each(t2, t6));
        let t1 = add_each(lane_sum(q, kt, 1, d), lane_sum(q, kt, 9, d));
        let t5 = add_each(lane_sum(q, kt, 5, d), lane_sum(q, kt, 13, d));
        let u1 = add_each(t1, t5);
        let t3 = add_each(lane_sum(q, kt, 3, d), lane_sum(q, kt, 11, d));
        let t7 = add_each(lane_sum(q, kt, 7, d), lane_sum(q, kt, 15, d));
        add_each(w0, add_each(u1, add_each(t3, t7)))
    }
}

/// Lane `l`'s sums for `Q` queries against a transposed block: columns
/// `l, l + 16, …` of `kt` broadcast-multiplied and added in order.
///
/// # Safety
/// AVX-512F; each query holds `d` floats and `kt` `d · 16`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn lane_sum<const Q: usize>(
    q: &[*const f32; Q],
    kt: &[f32],
    l: usize,
    d: usize,
) -> [__m512; Q] {
    let mut acc = [_mm512_setzero_ps(); Q];
    for c in (l..d).step_by(16) {
        // SAFETY: c < d; kt row c has 16 floats, each query d.
        let k = unsafe { _mm512_loadu_ps(kt.as_ptr().add(c * 16)) };
        for (a, qp) in acc.iter_mut().zip(q) {
            // SAFETY: as above.
            let x = _mm512_set1_ps(unsafe { *qp.add(c) });
            *a = if c == l {
                _mm512_mul_ps(x, k)
            } else {
                _mm512_fmadd_ps(x, k, *a)
            };
        }
    }
    acc
}

/// A block's keys in a form [`scores`] reads.
#[derive(Clone, Copy)]
pub(super) enum Keys<'a> {
    /// `d × 16`, slot `j` in lane `j` ([`transpose_keys`]): for many
    /// queries.
    Transposed(&'a [f32]),
    /// The block's rows as stored, `rows` of them: for a few.
    Stored(Rows<'a>, usize),
}

/// [`scores`] for `qs.len()` (1 to [`MAX_QUERIES`]) queries.
///
/// # Safety
/// As [`scores`].
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scores_by(
    qs: &[&[f32]],
    keys: Keys<'_>,
    d: usize,
    sc: &Scoring<'_>,
    outs: &mut [&mut [f32]],
) {
    const { assert!(MAX_QUERIES == 4) };
    // SAFETY (each arm): the caller's promise.
    unsafe {
        match qs.len() {
            4 => scores::<4>(qs, keys, d, sc, outs),
            3 => scores::<3>(qs, keys, d, sc, outs),
            2 => scores::<2>(qs, keys, d, sc, outs),
            1 => scores::<1>(qs, keys, d, sc, outs),
            _ => {}
        }
    }
}

/// `Q` queries' scores against one block, in either form (the same bits):
/// [`lane_tree`] over a transposed block, [`stored_sums`] over the rows as
/// stored; then scaled into each out.
///
/// # Safety
/// AVX-512F; `d` a multiple of 16; `qs` holds `Q` queries of `d` and
/// `outs` `Q` rows; a transposed block holds `d · 16` floats, stored rows
/// `rows · d` elements; `factors` and each out reach `slots.end` (≤ 16).
#[target_feature(enable = "avx512f")]
unsafe fn scores<const Q: usize>(
    qs: &[&[f32]],
    keys: Keys<'_>,
    d: usize,
    sc: &Scoring<'_>,
    outs: &mut [&mut [f32]],
) {
    let q: [*const f32; Q] = std::array::from_fn(|i| qs[i].as_ptr());
    // SAFETY (every arm, and the store): the caller's promise.
    unsafe {
        let sums = match keys {
            Keys::Transposed(kt) => lane_tree::<Q>(&q, kt, d),
            Keys::Stored(Rows::F32(k), rows) => stored_sums::<Q, f32>(&q, k, rows, d),
            Keys::Stored(Rows::Bf16(k), rows) => stored_sums::<Q, bf16>(&q, k, rows, d),
            Keys::Stored(Rows::F16(k), rows) => stored_sums::<Q, f16>(&q, k, rows, d),
        };
        sc.store(&sums, outs)
    }
}

/// `Q` queries against a block's `rows` (≤ 16) key rows as stored: per
/// key, each query's 16 lane sums (`q[c]·k[c]` for `c ≡ l mod 16`, in
/// order of `c`) in one vector, the key's 16-element pieces loaded once
/// for the queries; then the 16 keys' vectors are added across in the
/// order of [`lane_tree`] with the keys fed so that key `j` lands in
/// lane `j`. The same bits as [`lane_tree`] on the transposed block.
///
/// # Safety
/// AVX-512F; `d` a multiple of 16; each query holds `d` floats and
/// `keys` `rows · d` elements.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn stored_sums<const Q: usize, E: Wide16>(
    q: &[*const f32; Q],
    keys: &[E],
    rows: usize,
    d: usize,
) -> [__m512; Q] {
    // Input `p` of the adds across lands in lane `4·(p mod 4) + p / 4`
    // (a 4 × 4 transpose, its own inverse), so input p is that key.
    // SAFETY: the caller's promise.
    let input = |p: usize| unsafe { key_lanes::<Q, E>(q, keys, 4 * (p % 4) + p / 4, rows, d) };
    let l1: [[__m512; Q]; 8] =
        std::array::from_fn(|i| across::<Q, 1>(input(2 * i), input(2 * i + 1)));
    let l2: [[__m512; Q]; 4] = std::array::from_fn(|i| across::<Q, 2>(l1[2 * i], l1[2 * i + 1]));
    let l3 = [across::<Q, 3>(l2[0], l2[1]), across::<Q, 3>(l2[2], l2[3])];
    across::<Q, 4>(l3[0], l3[1])
}

/// Key `j`'s 16 lane sums against each of `Q` queries (zero past
/// `rows`): lane `l` multiplies and adds `c ≡ l mod 16` in order of `c`.
///
/// # Safety
/// AVX-512F; `d` a multiple of 16; each query holds `d` floats and
/// `keys` `rows · d` elements.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn key_lanes<const Q: usize, E: Wide16>(
    q: &[*const f32; Q],
    keys: &[E],
    j: usize,
    rows: usize,
    d: usize,
) -> [__m512; Q] {
    let mut acc = [_mm512_setzero_ps(); Q];
    if j < rows {
        for c in (0..d).step_by(16) {
            // SAFETY: key j < rows has d elements from j·d; c + 16 ≤ d;
            // each query has d floats.
            let k = unsafe { E::load16(keys.as_ptr().add(j * d + c)) };
            for (a, qp) in acc.iter_mut().zip(q) {
                // SAFETY: as above.
                let x = unsafe { _mm512_loadu_ps(qp.add(c)) };
                *a = if c == 0 {
                    _mm512_mul_ps(x, k)
                } else {
                    _mm512_fmadd_ps(x, k, *a)
                };
            }
        }
    }
    acc
}

/// One level of the adds across two inputs of [`stored_sums`]: level
/// 1 gives lanes 0–7 of `a` and 8–15 of `b`, each `l + (l + 8)`; level
/// 2 adds 128-bit quarters (`l + 4`), levels 3 and 4 within quarters
/// (`l + 2`, `l + 1`).
#[inline]
#[target_feature(enable = "avx512f")]
fn across<const Q: usize, const LEVEL: usize>(a: [__m512; Q], b: [__m512; Q]) -> [__m512; Q] {
    std::array::from_fn(|i| {
        let (x, y) = match LEVEL {
            1 => (
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a[i], b[i]),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a[i], b[i]),
            ),
            2 => (
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a[i], b[i]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a[i], b[i]),
            ),
            3 => (
                _mm512_shuffle_ps::<0b01_00_01_00>(a[i], b[i]),
                _mm512_shuffle_ps::<0b11_10_11_10>(a[i], b[i]),
            ),
            _ => (
                _mm512_shuffle_ps::<0b10_00_10_00>(a[i], b[i]),
                _mm512_shuffle_ps::<0b11_01_11_01>(a[i], b[i]),
            ),
        };
        _mm512_add_ps(x, y)
    })
}

/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn max(probs: &[f32]) -> f32 {
    let none = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut m = none;
    for chunk in probs.chunks(16) {
        // SAFETY: the mask covers the chunk's floats only.
        let p = unsafe { _mm512_mask_loadu_ps(none, first(chunk.len()), chunk.as_ptr()) };
        m = _mm512_max_ps(m, p);
    }
    _mm512_reduce_max_ps(m)
}

/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_sum(probs: &mut [f32], max: f32) -> f32 {
    let m = _mm512_set1_ps(max);
    let mut sum = _mm512_setzero_ps();
    for chunk in probs.chunks_mut(16) {
        let mask = first(chunk.len());
        // SAFETY: the mask covers the chunk's floats only.
        unsafe {
            let p = exp16(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(mask, chunk.as_ptr()),
                m,
            ));
            _mm512_mask_storeu_ps(chunk.as_mut_ptr(), mask, p);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, p));
        }
    }
    _mm512_reduce_add_ps(sum)
}

/// [`accumulate`] for `sums.len()` (1 to [`MAX_QUERIES`]) sums.
///
/// # Safety
/// As [`accumulate`].
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn accumulate_by<E: Wide16>(
    out: &mut [f32],
    sums: &[WeightedSum<'_>],
    values: &[E],
    d: usize,
) {
    const { assert!(MAX_QUERIES == 4) };
    // SAFETY (each arm): the caller's promise.
    unsafe {
        match (sums.len(), d) {
            // Every output slice in a register (at most 16 of them).
            (4, 64) => accumulate_resident::<4, 4, E>(out, sums, values),
            (3, 64) => accumulate_resident::<3, 4, E>(out, sums, values),
            (2, 64) => accumulate_resident::<2, 4, E>(out, sums, values),
            (1, 64) => accumulate_resident::<1, 4, E>(out, sums, values),
            (2, 128) => accumulate_resident::<2, 8, E>(out, sums, values),
            (1, 128) => accumulate_resident::<1, 8, E>(out, sums, values),
            _ => accumulate_by_columns(out, sums, values, d),
        }
    }
}

/// [`accumulate`] for `sums.len()` (1 to [`MAX_QUERIES`]) sums, 16
/// columns at a time.
///
/// # Safety
/// As [`accumulate`].
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn accumulate_by_columns<E: Wide16>(
    out: &mut [f32],
    sums: &[WeightedSum<'_>],
    values: &[E],
    d: usize,
) {
    // SAFETY (each arm): the caller's promise.
    unsafe {
        match sums.len() {
            4 => accumulate::<4, E>(out, sums, values, d),
            3 => accumulate::<3, E>(out, sums, values, d),
            2 => accumulate::<2, E>(out, sums, values, d),
            1 => accumulate::<1, E>(out, sums, values, d),
            _ => {}
        }
    }
}

/// `Q` weighted sums of rows of `d = 16·C`, every sum's output held in
/// `C` registers across the block (`Q·C ≤ 16`): a value row is loaded
/// once, each weight broadcast once, and each output element is the
/// same chain, in slot order, as [`accumulate`] makes it.
///
/// # Safety
/// As [`accumulate`], with `d = 16·C`.
#[target_feature(enable = "avx512f")]
unsafe fn accumulate_resident<const Q: usize, const C: usize, E: Wide16>(
    out: &mut [f32],
    sums: &[WeightedSum<'_>],
    values: &[E],
) {
    let d = 16 * C;
    let base = out.as_mut_ptr();
    let mut acc = [[_mm512_setzero_ps(); C]; Q];
    for (a, sum) in acc.iter_mut().zip(sums) {
        for (c, v) in a.iter_mut().enumerate() {
            // SAFETY: the row holds d floats from sum.row.
            *v = unsafe { _mm512_loadu_ps(base.add(sum.row + 16 * c)) };
        }
    }
    let lo = sums.iter().map(|s| s.slots.start).min().unwrap_or(0);
    let hi = sums.iter().map(|s| s.slots.end).max().unwrap_or(0);
    for j in lo..hi {
        // SAFETY: j < some sum's slots.end, inside values' rows of d.
        let row: [__m512; C] =
            std::array::from_fn(|c| unsafe { E::load16(values.as_ptr().add(j * d + 16 * c)) });
        for (a, sum) in acc.iter_mut().zip(sums) {
            if sum.slots.contains(&j) {
                let w = _mm512_set1_ps(sum.weights[j]);
                for (v, r) in a.iter_mut().zip(&row) {
                    *v = _mm512_fmadd_ps(w, *r, *v);
                }
            }
        }
    }
    for (a, sum) in acc.iter().zip(sums) {
        for (c, v) in a.iter().enumerate() {
            // SAFETY: as for the load; the rows are apart.
            unsafe { _mm512_storeu_ps(base.add(sum.row + 16 * c), *v) };
        }
    }
}

/// `Q` weighted sums sharing each value load: per 16 columns, every
/// slot any of them sums is loaded once and multiply-added into the
/// sums whose slots hold it, so each sum is the same chain, in slot
/// order, as alone. The slots all of them hold run without a test.
///
/// # Safety
/// AVX-512F; `d` a multiple of 16; `sums.len() == Q`, each row inside
/// `out` and apart from the others, its slots inside its weights and
/// `values` (rows of `d`).
#[target_feature(enable = "avx512f")]
unsafe fn accumulate<const Q: usize, E: Wide16>(
    out: &mut [f32],
    sums: &[WeightedSum<'_>],
    values: &[E],
    d: usize,
) {
    let (mut start, mut end, mut w) = ([0; Q], [0; Q], [std::ptr::null::<f32>(); Q]);
    for (q, sum) in sums.iter().enumerate().take(Q) {
        (start[q], end[q], w[q]) = (sum.slots.start, sum.slots.end, sum.weights.as_ptr());
    }
    let lo = start.iter().copied().min().unwrap_or(0);
    let hi = end.iter().copied().max().unwrap_or(0);
    // The slots every sum holds (empty when they do not meet).
    let shared_lo = start.iter().copied().max().unwrap_or(0);
    let shared_hi = end.iter().copied().min().unwrap_or(0).max(shared_lo);
    let base = out.as_mut_ptr();
    let v_at = |j: usize, c: usize| {
        // SAFETY: j < some sum's slots.end, inside values' rows; c + 16 ≤ d.
        unsafe { E::load16(values.as_ptr().add(j * d + c)) }
    };
    for c in (0..d).step_by(16) {
        let mut acc = [_mm512_setzero_ps(); Q];
        for (a, sum) in acc.iter_mut().zip(sums) {
            // SAFETY: the row holds d floats from sum.row; c + 16 ≤ d.
            *a = unsafe { _mm512_loadu_ps(base.add(sum.row + c)) };
        }
        let edge = |j: usize, acc: &mut [__m512; Q]| {
            let v = v_at(j, c);
            for q in 0..Q {
                if start[q] <= j && j < end[q] {
                    // SAFETY: j is inside sum q's slots, so its weights.
                    let wq = unsafe { *w[q].add(j) };
                    acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(wq), v, acc[q]);
                }
            }
        };
        // (start ≤ end for every sum, so lo ≤ shared_lo ≤ shared_hi ≤ hi.)
        for j in lo..shared_lo {
            edge(j, &mut acc);
        }
        for j in shared_lo..shared_hi {
            let v = v_at(j, c);
            for q in 0..Q {
                // SAFETY: j is inside every sum's slots.
                let wq = unsafe { *w[q].add(j) };
                acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(wq), v, acc[q]);
            }
        }
        for j in shared_hi..hi {
            edge(j, &mut acc);
        }
        for (a, sum) in acc.iter().zip(sums) {
            // SAFETY: as for the load; the rows are apart.
            unsafe { _mm512_storeu_ps(base.add(sum.row + c), *a) };
        }
    }
}
