//! One query's arithmetic over one decoded KV block (at most 16 rows): the
//! scores, the softmax step's exponentials and the weighted sum of values.
//!
//! The portable version is a dot product, an `exp` and an `axpy` per key.
//! On AVX-512 (where `head_dim` is a multiple of 16) the sixteen keys of a
//! block are scored together, score `j` in lane `j`; the exponentials are
//! one vector polynomial; the weighted sum keeps each 16-lane slice of the
//! output in a register across the block's rows instead of loading and
//! storing it per key, for up to four queries that share each value row's
//! load (each query still sums its own slots in slot order).
//! Either way a query's arithmetic does not depend on the queries beside it.
//!
//! The AVX-512 scores read the block's keys transposed (`d × 16`: key `j` in
//! lane `j`), made once per block for every query of the tile: a query is
//! then `d` broadcast-multiply-adds into four accumulators and three adds,
//! with no per-query transpose (prefill scores each block against tens of
//! queries).

use std::ops::Range;

use half::{bf16, f16};

/// Most key slots one call takes (a block of more is taken in pieces).
pub(super) const SLOTS: usize = 16;

/// Most queries one [`BlockMath::scores`] or [`BlockMath::accumulate`] call
/// takes.
pub(super) const MAX_QUERIES: usize = 4;

/// A block's keys as [`BlockMath::keys`] laid them out.
pub(super) struct BlockKeys<'a> {
    data: &'a [f32],
    d: usize,
}

/// A block's K or V rows as the math reads them: f32 (an f32 cache's own,
/// or decoded), or a 16-bit cache's elements as stored, widened where they
/// are read (exact, so the same sums as decoded first; AVX-512 only, see
/// [`BlockMath::widens_half`]).
#[derive(Clone, Copy)]
pub(super) enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Rows<'_> {
    /// The rows as f32, decoded into `buf` if they are not.
    fn decoded<'b>(self, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        Self: 'b,
    {
        match self {
            Rows::F32(x) => x,
            Rows::Bf16(x) => {
                buf.extend(x.iter().map(|v| v.to_f32()));
                buf
            }
            Rows::F16(x) => {
                buf.extend(x.iter().map(|v| v.to_f32()));
                buf
            }
        }
    }
}

/// Which implementation runs, chosen once per attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BlockMath {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl BlockMath {
    /// The fastest implementation for rows of `head_dim`.
    pub fn for_head_dim(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        if head_dim.is_multiple_of(16) && is_x86_feature_detected!("avx512f") {
            return Self::Avx512;
        }
        let _ = head_dim;
        Self::Portable
    }

    /// Whether 16-bit rows are read as stored ([`Rows::Bf16`],
    /// [`Rows::F16`]) rather than decoded into a buffer first: on AVX-512,
    /// where the transpose and the weighted sum widen them as they load.
    pub fn widens_half(self) -> bool {
        self != Self::Portable
    }

    /// A block's `rows` (≤ 16) key rows of `d` in the layout [`Self::scores`]
    /// reads: as they are for the portable math (16-bit rows decoded into
    /// `scratch`); transposed into `scratch` (`d × 16`, slot `j` in lane
    /// `j`) for AVX-512, once for every query that scores the block.
    pub fn keys<'a>(
        self,
        keys: Rows<'a>,
        rows: usize,
        d: usize,
        scratch: &'a mut [f32],
    ) -> BlockKeys<'a> {
        match (self, keys) {
            (Self::Portable, Rows::F32(keys)) => {
                assert!(rows <= SLOTS && keys.len() >= rows * d);
                BlockKeys {
                    data: &keys[..rows * d],
                    d,
                }
            }
            (Self::Portable, half) => {
                let mut buf = Vec::with_capacity(rows * d);
                let decoded = half.decoded(&mut buf);
                assert!(rows <= SLOTS && decoded.len() >= rows * d && scratch.len() >= rows * d);
                scratch[..rows * d].copy_from_slice(&decoded[..rows * d]);
                BlockKeys {
                    data: &scratch[..rows * d],
                    d,
                }
            }
            #[cfg(target_arch = "x86_64")]
            (Self::Avx512, keys) => {
                assert!(rows <= SLOTS && scratch.len() >= d * SLOTS);
                // SAFETY (each arm): `Avx512` is chosen only where the CPU
                // has AVX-512F and `d` is a multiple of 16; the scratch
                // length is checked above, the rows' inside the call.
                unsafe {
                    match keys {
                        Rows::F32(k) => avx512::transpose_keys(k, rows, d, scratch),
                        Rows::Bf16(k) => avx512::transpose_keys(k, rows, d, scratch),
                        Rows::F16(k) => avx512::transpose_keys(k, rows, d, scratch),
                    }
                };
                BlockKeys {
                    data: &scratch[..d * SLOTS],
                    d,
                }
            }
        }
    }

    /// For each query `i` (at most [`MAX_QUERIES`]): `outs[i][j] =
    /// qs[i]·key[j] · scale · factors[j]` for the slots `j` in `slots`
    /// (within the block's rows; `factors` and each out are indexed by
    /// slot). A query's arithmetic is the same whichever queries share the
    /// call.
    pub fn scores(
        self,
        qs: &[&[f32]],
        keys: &BlockKeys<'_>,
        scale: f32,
        factors: &[f32],
        outs: &mut [&mut [f32]],
        slots: Range<usize>,
    ) {
        let d = keys.d;
        assert!(qs.len() <= MAX_QUERIES && qs.len() == outs.len());
        assert!(slots.end <= SLOTS && factors.len() >= slots.end);
        assert!(qs.iter().all(|q| q.len() == d) && outs.iter().all(|o| o.len() >= slots.end));
        match self {
            Self::Portable => {
                for (q, out) in qs.iter().zip(outs.iter_mut()) {
                    for j in slots.clone() {
                        out[j] = crate::kernels::dot_f32(q, &keys.data[j * d..(j + 1) * d])
                            * (scale * factors[j]);
                    }
                }
            }
            // SAFETY: `Avx512` is chosen only where the CPU has AVX-512F
            // and `d` is a multiple of 16; `keys` came from `Self::keys`
            // (d × 16); the lengths are checked above.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe {
                match qs.len() {
                    4 => avx512::scores::<4>(qs, keys.data, scale, factors, outs, slots),
                    3 => avx512::scores::<3>(qs, keys.data, scale, factors, outs, slots),
                    2 => avx512::scores::<2>(qs, keys.data, scale, factors, outs, slots),
                    1 => avx512::scores::<1>(qs, keys.data, scale, factors, outs, slots),
                    _ => {}
                }
            },
        }
    }

    /// The largest of `probs` (at most [`SLOTS`]); −∞ for none.
    pub fn max(self, probs: &[f32]) -> f32 {
        match self {
            Self::Portable => probs.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            // SAFETY: as in `scores`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { avx512::max(probs) },
        }
    }

    /// Each `p` becomes `exp(p − max)`; returns their sum.
    pub fn exp_sum(self, probs: &mut [f32], max: f32) -> f32 {
        match self {
            Self::Portable => probs
                .iter_mut()
                .map(|p| {
                    *p = (*p - max).exp();
                    *p
                })
                .sum(),
            // SAFETY: as in `scores`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { avx512::exp_sum(probs, max) },
        }
    }

    /// For each of `sums` (at most [`MAX_QUERIES`]): `out[row..row + d] +=
    /// Σ_j weights[j] · values[j]` over its slots, in slot order (`values`:
    /// the block's rows of `d` from slot 0). A query's arithmetic is the
    /// same whichever queries share the call; the rows must not overlap.
    pub fn accumulate(self, out: &mut [f32], sums: &[WeightedSum<'_>], values: Rows<'_>, d: usize) {
        let len = match values {
            Rows::F32(v) => v.len(),
            Rows::Bf16(v) => v.len(),
            Rows::F16(v) => v.len(),
        };
        assert!(sums.len() <= MAX_QUERIES);
        for (i, a) in sums.iter().enumerate() {
            assert!(a.row + d <= out.len() && a.slots.end <= a.weights.len());
            assert!(len >= a.slots.end * d);
            let apart = |b: &WeightedSum<'_>| a.row + d <= b.row || b.row + d <= a.row;
            assert!(sums[..i].iter().all(apart), "the sums' rows overlap");
        }
        match self {
            Self::Portable => {
                let mut buf = Vec::new();
                let values = values.decoded(&mut buf);
                for a in sums {
                    let acc = &mut out[a.row..a.row + d];
                    for j in a.slots.clone() {
                        crate::kernels::axpy_f32(acc, a.weights[j], &values[j * d..(j + 1) * d]);
                    }
                }
            }
            // SAFETY: `Avx512` is chosen only where the CPU has AVX-512F and
            // `d` is a multiple of 16; the bounds and the rows' disjointness
            // are checked above.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe {
                match values {
                    Rows::F32(v) => avx512::accumulate_by(out, sums, v, d),
                    Rows::Bf16(v) => avx512::accumulate_by(out, sums, v, d),
                    Rows::F16(v) => avx512::accumulate_by(out, sums, v, d),
                }
            },
        }
    }
}

/// One query's part of [`BlockMath::accumulate`]: where its output row
/// starts, its weights (indexed by slot) and the slots it sums.
#[derive(Default)]
pub(super) struct WeightedSum<'a> {
    pub row: usize,
    pub weights: &'a [f32],
    pub slots: Range<usize>,
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{WeightedSum, MAX_QUERIES};
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
    pub(super) unsafe fn transpose_keys<E: Wide16>(
        keys: &[E],
        rows: usize,
        d: usize,
        kt: &mut [f32],
    ) {
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

    /// `Q` queries against one transposed block: each query `d`
    /// broadcast-multiply-adds in four chains (columns `c ≡ 0, 1, 2, 3 mod
    /// 4`), then `(a0 + a1) + (a2 + a3)`; the queries share each key-column
    /// load.
    ///
    /// # Safety
    /// AVX-512F; `qs` holds `Q` queries of `d` (a multiple of 16) and
    /// `outs` `Q` rows; `kt` holds `d · 16` floats ([`transpose_keys`]);
    /// `factors` and each out reach `slots.end` (≤ 16).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores<const Q: usize>(
        qs: &[&[f32]],
        kt: &[f32],
        scale: f32,
        factors: &[f32],
        outs: &mut [&mut [f32]],
        slots: Range<usize>,
    ) {
        let d = kt.len() / 16;
        let mut q = [std::ptr::null::<f32>(); Q];
        for (p, qv) in q.iter_mut().zip(qs) {
            *p = qv.as_ptr();
        }
        let mut acc = [[_mm512_setzero_ps(); 4]; Q];
        for c in (0..d).step_by(4) {
            for u in 0..4 {
                // SAFETY: c + u < d; kt row c + u has 16 floats, each query d.
                unsafe {
                    let k = _mm512_loadu_ps(kt.as_ptr().add((c + u) * 16));
                    for (a, qp) in acc.iter_mut().zip(q) {
                        a[u] = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(c + u)), k, a[u]);
                    }
                }
            }
        }
        let mask = first(slots.end) & !first(slots.start);
        // SAFETY: `factors` and each out hold `slots.end` floats; only the
        // masked lanes are read or written.
        let f = unsafe {
            _mm512_mul_ps(
                _mm512_set1_ps(scale),
                _mm512_maskz_loadu_ps(mask, factors.as_ptr()),
            )
        };
        for (a, out) in acc.iter().zip(outs.iter_mut()) {
            let sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, _mm512_mul_ps(sum, f)) };
        }
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
            match sums.len() {
                4 => accumulate::<4, E>(out, sums, values, d),
                3 => accumulate::<3, E>(out, sums, values, d),
                2 => accumulate::<2, E>(out, sums, values, d),
                1 => accumulate::<1, E>(out, sums, values, d),
                _ => {}
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
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_values as pseudo;

    #[test]
    fn the_fast_block_math_agrees_with_the_portable_one() {
        let d = 64;
        let fast = BlockMath::for_head_dim(d);
        if fast == BlockMath::Portable {
            eprintln!("no AVX-512: nothing to compare");
            return;
        }
        for span in [1, 5, 16] {
            let (q, keys) = (pseudo(d, 1), pseudo(span * d, span as u32));
            let factors = pseudo(span, 9);
            let (mut a, mut b) = (vec![0.0; span], vec![0.0; span]);
            let mut scratch = vec![0.0; d * 16];
            let slow_keys = BlockMath::Portable.keys(Rows::F32(&keys), span, d, &mut []);
            let slots = 0..span;
            BlockMath::Portable.scores(&[&q], &slow_keys, 0.125, &factors, &mut [&mut a], slots);
            let fast_keys = fast.keys(Rows::F32(&keys), span, d, &mut scratch);
            fast.scores(&[&q], &fast_keys, 0.125, &factors, &mut [&mut b], 0..span);
            // Beside other queries a query's scores are the same bits; a
            // sub-range of slots writes those slots only.
            let (q2, q3) = (pseudo(d, 21), pseudo(d, 22));
            let (mut p2, mut p3) = (vec![0.0; span], vec![0.0; span]);
            let mut part = vec![7.0; span];
            fast.scores(
                &[&q2, &q, &q3],
                &fast_keys,
                0.125,
                &factors,
                &mut [&mut p2, &mut part, &mut p3],
                span / 2..span,
            );
            assert_eq!(part[..span / 2], vec![7.0; span / 2][..]);
            assert_eq!(part[span / 2..], b[span / 2..]);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-5, "span {span}: {x} vs {y}");
            }
            let max = BlockMath::Portable.max(&a);
            assert_eq!(fast.max(&a), max, "span {span}");
            let (sa, sb) = (
                BlockMath::Portable.exp_sum(&mut a, max),
                fast.exp_sum(&mut b, max),
            );
            assert!((sa - sb).abs() < 1e-5 * sa, "{sa} vs {sb}");
            let (mut acc_a, mut acc_b) = (pseudo(d, 5), pseudo(d, 5));
            let all = |w| WeightedSum {
                row: 0,
                weights: w,
                slots: 0..span,
            };
            BlockMath::Portable.accumulate(&mut acc_a, &[all(&a)], Rows::F32(&keys), d);
            fast.accumulate(&mut acc_b, &[all(&b)], Rows::F32(&keys), d);
            for (x, y) in acc_a.iter().zip(&acc_b) {
                assert!((x - y).abs() < 1e-5, "span {span}: {x} vs {y}");
            }
            // Beside other sums over other slots a sum is the same bits.
            let w2 = pseudo(span, 31);
            let mut rows = [pseudo(d, 7), pseudo(d, 5), pseudo(d, 8)].concat();
            let sums = [
                WeightedSum {
                    row: 0,
                    weights: &w2,
                    slots: span / 2..span,
                },
                WeightedSum { row: d, ..all(&b) },
                WeightedSum {
                    row: 2 * d,
                    weights: &w2,
                    slots: 0..span.div_ceil(2),
                },
            ];
            fast.accumulate(&mut rows, &sums, Rows::F32(&keys), d);
            assert_eq!(rows[d..2 * d], acc_b[..], "span {span}");
            for (i, sum) in [&sums[0], &sums[2]].into_iter().enumerate() {
                let mut alone = pseudo(d, [7, 8][i]);
                let one = WeightedSum {
                    row: 0,
                    weights: sum.weights,
                    slots: sum.slots.clone(),
                };
                fast.accumulate(&mut alone, &[one], Rows::F32(&keys), d);
                assert_eq!(rows[sum.row..sum.row + d], alone[..], "span {span}");
            }
        }
    }

    /// 16-bit rows widened as they are read give the bits of the same
    /// rows decoded first, on either math.
    #[test]
    fn half_rows_read_as_stored_match_them_decoded() {
        let d = 64;
        for math in [BlockMath::Portable, BlockMath::for_head_dim(d)] {
            for span in [3, 16] {
                let q = pseudo(d, 1);
                let raw = pseudo(span * d, 4);
                let b: Vec<bf16> = raw.iter().map(|&x| bf16::from_f32(x)).collect();
                let h: Vec<f16> = raw.iter().map(|&x| f16::from_f32(x)).collect();
                let b32: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
                let h32: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
                let weights = pseudo(span, 6);
                for (rows, decoded) in [(Rows::Bf16(&b), &b32), (Rows::F16(&h), &h32)] {
                    let score = |rows: Rows<'_>| {
                        let mut scratch = vec![0.0; d * SLOTS];
                        let keys = math.keys(rows, span, d, &mut scratch);
                        let mut out = vec![0.0; span];
                        let ones = vec![1.0; span];
                        math.scores(&[&q], &keys, 0.5, &ones, &mut [&mut out], 0..span);
                        out
                    };
                    assert_eq!(
                        score(rows),
                        score(Rows::F32(decoded)),
                        "{math:?} span {span}"
                    );
                    let sum = |values: Rows<'_>| {
                        let mut out = pseudo(d, 9);
                        let one = WeightedSum {
                            row: 0,
                            weights: &weights,
                            slots: 1..span,
                        };
                        math.accumulate(&mut out, &[one], values, d);
                        out
                    };
                    assert_eq!(sum(rows), sum(Rows::F32(decoded)), "{math:?} span {span}");
                }
            }
        }
    }
}
