//! One query's arithmetic over one decoded KV block (at most 16 rows): the
//! scores, the softmax step's exponentials and the weighted sum of values.
//!
//! The portable version is a dot product, an `exp` and an `axpy` per key.
//! On AVX2 without AVX-512 (`avx2.rs`, `head_dim` a multiple of 16) eight
//! keys are scored together with the portable scores' bits, key and value
//! rows are read as stored for up to four queries, and the output row stays
//! in registers across the block (on an AVX2 VM a 512-token prefill of
//! SmolLM2-135M ran 1.3–1.7x faster than with the portable math).
//! On AVX-512 (where `head_dim` is a multiple of 16) the sixteen keys of a
//! block are scored together, score `j` in lane `j`; the exponentials are
//! one vector polynomial; the weighted sum keeps each 16-lane slice of the
//! output in a register across the block's rows instead of loading and
//! storing it per key, for up to four queries that share each value row's
//! load (each query still sums its own slots in slot order).
//! Either way a query's arithmetic does not depend on the queries beside it.
//!
//! An AVX-512 score is one order of sums whichever way it is computed: lane
//! `l` of 16 multiplies and adds the elements `c ≡ l (mod 16)` in order of
//! `c`, then a fixed tree adds the 16 lanes (`l` with `l + 8`, then with
//! `l + 4`, `+ 2`, `+ 1`). A block scored by many queries (prefill) is
//! transposed once (`d × 16`: key `j` in lane `j`) and each lane's sum is
//! broadcast-multiply-adds down the columns; a block scored by a few
//! (decode: one token under a KV head's query heads) is read as stored, a
//! key row at a time against the query's vectors, and the 16 keys' lane
//! sums are added across by shuffles: no transpose, which had cost a
//! decode's attention a third of its time. The two give the same bits, so
//! a query's scores do not depend on what else the tile holds.

use std::ops::Range;

use half::{bf16, f16};

/// Most key slots one call takes (a block of more is taken in pieces).
pub(super) const SLOTS: usize = 16;

/// Most queries one [`BlockMath::scores`] or [`BlockMath::accumulate`] call
/// takes.
pub(super) const MAX_QUERIES: usize = 4;

/// A block's keys as [`BlockMath::keys`] laid them out.
pub(super) struct BlockKeys<'a> {
    form: KeyForm<'a>,
    d: usize,
}

/// How [`BlockKeys`] holds a block's key rows.
enum KeyForm<'a> {
    /// f32 rows of `d` (the portable math).
    Rows(&'a [f32]),
    /// Transposed or as stored, for the AVX-512 math.
    #[cfg(target_arch = "x86_64")]
    Fast(avx512::Keys<'a>),
    /// As stored, for the AVX2 math.
    #[cfg(target_arch = "x86_64")]
    Stored(Rows<'a>),
}

/// Most queries scoring a block for which [`BlockMath::keys`] leaves the
/// keys as stored: each query then reduces its own 16 sums (30 shuffles),
/// against the transpose's 256 for any number of queries.
pub(super) const STORED_KEYS_MAX_QUERIES: usize = 8;

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
    /// Elements held.
    fn len(self) -> usize {
        match self {
            Rows::F32(x) => x.len(),
            Rows::Bf16(x) => x.len(),
            Rows::F16(x) => x.len(),
        }
    }

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
    /// AVX2 + FMA + F16C: the portable math's bits but `exp`'s.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl BlockMath {
    /// The fastest implementation for rows of `head_dim`.
    pub fn for_head_dim(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        if head_dim.is_multiple_of(16) && is_x86_feature_detected!("avx512f") {
            return Self::Avx512;
        }
        #[cfg(target_arch = "x86_64")]
        if head_dim.is_multiple_of(16) && crate::kernels::simd::has_avx2() {
            return Self::Avx2;
        }
        let _ = head_dim;
        Self::Portable
    }

    /// Whether this is the AVX-512 math (its key forms and kernels).
    #[cfg(test)]
    fn is_avx512(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self == Self::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Whether 16-bit rows are read as stored ([`Rows::Bf16`],
    /// [`Rows::F16`]) rather than decoded into a buffer first: on AVX-512
    /// and AVX2, where the scores and the weighted sum widen them as they
    /// load.
    pub fn widens_half(self) -> bool {
        self != Self::Portable
    }

    /// A block's `rows` (≤ 16) key rows of `d` in the layout [`Self::scores`]
    /// reads for `queries` queries: as they are for the portable math
    /// (16-bit rows decoded into `scratch`); on AVX-512 as stored for at
    /// most [`STORED_KEYS_MAX_QUERIES`], else transposed into `scratch`
    /// (`d × 16`, slot `j` in lane `j`) once for all of them.
    pub fn keys<'a>(
        self,
        keys: Rows<'a>,
        rows: usize,
        d: usize,
        scratch: &'a mut [f32],
        queries: usize,
    ) -> BlockKeys<'a> {
        // Only the AVX-512 forms choose by the number of queries.
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (queries, STORED_KEYS_MAX_QUERIES);
        match (self, keys) {
            (Self::Portable, Rows::F32(keys)) => {
                assert!(rows <= SLOTS && keys.len() >= rows * d);
                BlockKeys {
                    form: KeyForm::Rows(&keys[..rows * d]),
                    d,
                }
            }
            (Self::Portable, half) => {
                let mut buf = Vec::with_capacity(rows * d);
                let decoded = half.decoded(&mut buf);
                assert!(rows <= SLOTS && decoded.len() >= rows * d && scratch.len() >= rows * d);
                scratch[..rows * d].copy_from_slice(&decoded[..rows * d]);
                BlockKeys {
                    form: KeyForm::Rows(&scratch[..rows * d]),
                    d,
                }
            }
            #[cfg(target_arch = "x86_64")]
            (Self::Avx2, keys) => {
                assert!(rows <= SLOTS && keys.len() >= rows * d);
                BlockKeys {
                    form: KeyForm::Stored(keys),
                    d,
                }
            }
            #[cfg(target_arch = "x86_64")]
            (Self::Avx512, keys) if queries <= STORED_KEYS_MAX_QUERIES => {
                assert!(rows <= SLOTS && keys.len() >= rows * d);
                BlockKeys {
                    form: KeyForm::Fast(avx512::Keys::Stored(keys, rows)),
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
                    form: KeyForm::Fast(avx512::Keys::Transposed(&scratch[..d * SLOTS])),
                    d,
                }
            }
        }
    }

    /// For each query `i` (at most [`MAX_QUERIES`]): `outs[i][j] =
    /// qs[i]·key[j] · scale · factors[j]` for the slots `j` in `slots`
    /// (within the block's rows; `factors` and each out are indexed by
    /// slot). A query's arithmetic is the same whichever queries share the
    /// call and whichever form the keys are in.
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
        match &keys.form {
            KeyForm::Rows(data) => {
                for (q, out) in qs.iter().zip(outs.iter_mut()) {
                    for j in slots.clone() {
                        out[j] = crate::kernels::dot_f32(q, &data[j * d..(j + 1) * d])
                            * (scale * factors[j]);
                    }
                }
            }
            // SAFETY: the AVX-512 forms are made only where the CPU has
            // AVX-512F and `d` is a multiple of 16 (`Self::keys`, which also
            // checked the rows' length); the other lengths are checked
            // above.
            #[cfg(target_arch = "x86_64")]
            &KeyForm::Fast(keys) => unsafe {
                let sc = avx512::Scoring {
                    scale,
                    factors,
                    slots,
                };
                avx512::scores_by(qs, keys, d, &sc, outs)
            },
            // SAFETY: the AVX2 form is made only where the CPU has AVX2,
            // FMA and F16C and `d` is a multiple of 16 (`Self::keys`, which
            // also checked the rows' length); the rest is checked above.
            #[cfg(target_arch = "x86_64")]
            &KeyForm::Stored(keys) => unsafe {
                match keys {
                    Rows::F32(k) => avx2::scores(qs, k, d, scale, factors, outs, slots),
                    Rows::Bf16(k) => avx2::scores(qs, k, d, scale, factors, outs, slots),
                    Rows::F16(k) => avx2::scores(qs, k, d, scale, factors, outs, slots),
                }
            },
        }
    }

    /// The largest of `probs` (at most [`SLOTS`]); −∞ for none.
    pub fn max(self, probs: &[f32]) -> f32 {
        match self {
            // SAFETY: as in `scores`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { avx512::max(probs) },
            // At most 16 values: the AVX2 math takes the portable fold.
            _ => probs.iter().copied().fold(f32::NEG_INFINITY, f32::max),
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
            // SAFETY: `Avx2` is chosen only where the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { avx2::exp_sum(probs, max) },
        }
    }

    /// For each of `sums` (at most [`MAX_QUERIES`]): `out[row..row + d] +=
    /// Σ_j weights[j] · values[j]` over its slots, in slot order (`values`:
    /// the block's rows of `d` from slot 0). A query's arithmetic is the
    /// same whichever queries share the call; the rows must not overlap.
    pub fn accumulate(self, out: &mut [f32], sums: &[WeightedSum<'_>], values: Rows<'_>, d: usize) {
        let len = values.len();
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
            // SAFETY: `Avx2` is chosen only where the CPU has AVX2, FMA and
            // F16C and `d` is a multiple of 16; the bounds are checked above.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe {
                match values {
                    Rows::F32(v) => avx2::accumulate(out, sums, v, d),
                    Rows::Bf16(v) => avx2::accumulate(out, sums, v, d),
                    Rows::F16(v) => avx2::accumulate(out, sums, v, d),
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
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

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
            let slow_keys = BlockMath::Portable.keys(Rows::F32(&keys), span, d, &mut [], 1);
            let slots = 0..span;
            BlockMath::Portable.scores(&[&q], &slow_keys, 0.125, &factors, &mut [&mut a], slots);
            let fast_keys = fast.keys(Rows::F32(&keys), span, d, &mut scratch, 1);
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

    /// A block's keys scored as stored (a few queries) and transposed (many)
    /// give the same bits, for every row type, span, slot range and number
    /// of queries sharing the call: a decode's scores are a prefill's.
    #[test]
    fn stored_and_transposed_keys_score_the_same_bits() {
        let fast = BlockMath::for_head_dim(64);
        if !fast.is_avx512() {
            eprintln!("no AVX-512: nothing to compare");
            return;
        }
        for d in [16, 64, 128] {
            let qs: Vec<Vec<f32>> = (0..4).map(|i| pseudo(d, 40 + i)).collect();
            for span in [1, 5, 15, 16] {
                let raw = pseudo(span * d, span as u32 + 3);
                let b: Vec<bf16> = raw.iter().map(|&x| bf16::from_f32(x)).collect();
                let h: Vec<f16> = raw.iter().map(|&x| f16::from_f32(x)).collect();
                let factors = pseudo(span, 11);
                for rows in [Rows::F32(&raw), Rows::Bf16(&b), Rows::F16(&h)] {
                    for queries in 1..=4 {
                        let score = |hint: usize, slots: Range<usize>| {
                            let mut scratch = vec![0.0; d * SLOTS];
                            let keys = fast.keys(rows, span, d, &mut scratch, hint);
                            let mut outs = vec![vec![-1.0; span]; queries];
                            let q: Vec<&[f32]> = qs[..queries].iter().map(|q| &q[..]).collect();
                            let mut o: Vec<&mut [f32]> =
                                outs.iter_mut().map(|o| &mut o[..]).collect();
                            fast.scores(&q, &keys, 0.3, &factors, &mut o, slots);
                            outs
                        };
                        for slots in [0..span, span / 2..span] {
                            let stored = score(1, slots.clone());
                            let transposed = score(STORED_KEYS_MAX_QUERIES + 1, slots.clone());
                            let label = format!("d {d} span {span} queries {queries} {slots:?}");
                            assert_eq!(stored, transposed, "{label}");
                            // The slots before the range are left alone.
                            assert!(stored[0][..slots.start].iter().all(|&x| x == -1.0));
                        }
                    }
                }
            }
        }
    }

    /// The weighted sums kept in registers across a block (rows of 64 or
    /// 128) are the bits of the sums taken 16 columns at a time, for every
    /// row type, number of sums and slot ranges that differ between them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn resident_weighted_sums_match_them_by_columns() {
        if !BlockMath::for_head_dim(64).is_avx512() {
            eprintln!("no AVX-512: nothing to compare");
            return;
        }
        for d in [64, 128] {
            let raw = pseudo(16 * d, 8);
            let b: Vec<bf16> = raw.iter().map(|&x| bf16::from_f32(x)).collect();
            let weights: Vec<Vec<f32>> = (0..4).map(|i| pseudo(16, 50 + i)).collect();
            let ranges = [0..16, 3..11, 0..1, 5..16];
            for count in 1..=4 {
                let sums: Vec<WeightedSum<'_>> = (0..count)
                    .map(|i| WeightedSum {
                        row: i * d,
                        weights: &weights[i],
                        slots: ranges[i].clone(),
                    })
                    .collect();
                let run = |resident: bool, values: Rows<'_>| {
                    let mut out = pseudo(4 * d, 9);
                    // SAFETY: AVX-512F is present (checked above); d is a
                    // multiple of 16; the rows lie inside `out` apart, the
                    // slots inside the weights and the 16 value rows.
                    unsafe {
                        match (resident, values) {
                            (true, Rows::F32(v)) => avx512::accumulate_by(&mut out, &sums, v, d),
                            (false, Rows::F32(v)) => {
                                avx512::accumulate_by_columns(&mut out, &sums, v, d)
                            }
                            (true, Rows::Bf16(v)) => avx512::accumulate_by(&mut out, &sums, v, d),
                            (false, Rows::Bf16(v)) => {
                                avx512::accumulate_by_columns(&mut out, &sums, v, d)
                            }
                            _ => unreachable!("f32 and bf16 only here"),
                        }
                    }
                    out
                };
                for values in [Rows::F32(&raw), Rows::Bf16(&b)] {
                    assert_eq!(run(true, values), run(false, values), "d {d}, {count} sums");
                }
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
                        let keys = math.keys(rows, span, d, &mut scratch, 1);
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

    /// The AVX2 math's scores and weighted sums are the portable math's
    /// bits (its exponentials within 2 ulp of libm's), for every row type,
    /// row length, span, slot range and number of queries in a call.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_math_gives_the_portable_bits() {
        if BlockMath::for_head_dim(64) != BlockMath::Avx2 {
            eprintln!("not the AVX2 math here: nothing to compare");
            return;
        }
        let fast = BlockMath::Avx2;
        for d in [16, 64, 128, 96] {
            let qs: Vec<Vec<f32>> = (0..4).map(|i| pseudo(d, 60 + i)).collect();
            for span in [1, 7, 8, 9, 16] {
                let raw = pseudo(span * d, span as u32 + 5);
                let b: Vec<bf16> = raw.iter().map(|&x| bf16::from_f32(x)).collect();
                let h: Vec<f16> = raw.iter().map(|&x| f16::from_f32(x)).collect();
                let factors = pseudo(span, 12);
                for rows in [Rows::F32(&raw), Rows::Bf16(&b), Rows::F16(&h)] {
                    for queries in 1..=4 {
                        for slots in [0..span, span / 2..span, 0..span.div_ceil(3)] {
                            let score = |math: BlockMath| {
                                let mut scratch = vec![0.0; d * SLOTS];
                                let keys = math.keys(rows, span, d, &mut scratch, queries);
                                let mut outs = vec![vec![-1.0; span]; queries];
                                let q: Vec<&[f32]> = qs[..queries].iter().map(|q| &q[..]).collect();
                                let mut o: Vec<&mut [f32]> =
                                    outs.iter_mut().map(|o| &mut o[..]).collect();
                                math.scores(&q, &keys, 0.3, &factors, &mut o, slots.clone());
                                outs
                            };
                            let label = format!("d {d} span {span} queries {queries} {slots:?}");
                            assert_eq!(score(fast), score(BlockMath::Portable), "{label}");
                            let sums: Vec<WeightedSum<'_>> = (0..queries)
                                .map(|i| WeightedSum {
                                    row: i * d,
                                    weights: &factors,
                                    slots: [slots.clone(), 0..span, 1.min(span)..span][i % 3]
                                        .clone(),
                                })
                                .collect();
                            let sum = |math: BlockMath| {
                                let mut out = pseudo(4 * d, 13);
                                math.accumulate(&mut out, &sums, rows, d);
                                out
                            };
                            assert_eq!(sum(fast), sum(BlockMath::Portable), "{label}");
                        }
                    }
                }
            }
        }
        let mut worst = 0f32;
        let mut probs: Vec<f32> = (0..4001).map(|i| -95.0 + i as f32 * 0.025).collect();
        probs.push(f32::NEG_INFINITY);
        let mut fast_probs = probs.clone();
        let total = fast.exp_sum(&mut fast_probs, 5.0);
        for (&p, &e) in probs.iter().zip(&fast_probs) {
            let want = (p - 5.0).exp();
            if want < 1e-37 {
                // Below the normals: 0 or as near it.
                assert!((e - want).abs() < 1e-37, "exp({}) = {e}", p - 5.0);
                continue;
            }
            worst = worst.max(((e - want) / want).abs() / f32::EPSILON);
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        let want: f32 = probs.iter().map(|p| (p - 5.0).exp()).sum();
        assert!((total - want).abs() <= 1e-5 * want, "{total} vs {want}");
    }
}
