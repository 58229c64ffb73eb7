//! `out = x · wᵀ` with INT4 weights ([`Int4Matrix`]).
//!
//! Decode and small batches (`m <= GEMV_MAX_ROWS`, or any `m` under
//! [`MatmulPolicy::BatchInvariant`]) never widen a weight to f32. Each token
//! row is quantized on the fly to int8 with one scale per weight group
//! (`x ≈ sx · xq`, `|xq| <= 127`), and its f32 sum per group is kept.
//! A group's contribution to one output is then
//!
//! ```text
//! Σ_{i∈g} (s·q_i + m) · x_i ≈ s · sx · Σ q_i·xq_i + m · Σ x_i
//! ```
//!
//! an integer dot product of unsigned 4-bit codes with signed 8-bit
//! activations (AVX-VNNI / AVX-512 VNNI `vpdpbusd`, or AVX2
//! `vpmaddubsw` + `vpmaddwd`) accumulated in i32 across the group, then one
//! float multiply-add per group; the zero-point term is one multiply per
//! group against the exact f32 sums.
//!
//! By default ([`ActivationCodes::TwoPass`]) each entry gets a second int8
//! code for what the first left, `fine = round(128 · (x/sx − xq))` (within
//! ±64), and the kernels keep a second i32 sum per group of codes × fine
//! codes, joined at the group's end as `128 · Σ q·xq + Σ q·fine` (no
//! overflow: at most 15·127·128·128 + 15·64·128): about 15-bit
//! activations, the precision GPU W4A16 kernels compute in, for one more
//! `vpdpbusd` per register and no extra fold. On SmolLM2-135M it took INT4
//! g32 from +0.63% perplexity and 12 of 13 answers to +0.21% and 13, for
//! 11–23% of batch-1 decode speed (bench/RESULTS.md);
//! `--int4-activations int8` keeps one pass. Rows of the weight are split over
//! rayon's pool as in the dense row kernel. The integer kernels live in
//! `int4_simd.rs`; [`rows_int4_scalar`] is the portable fallback and the
//! reference they are tested against.
//!
//! Prefill (`m > GEMV_MAX_ROWS`) dequantizes the matrix to f32 once per call
//! and runs the same `gemm` path as bf16 weights: O(n·k) extra work against
//! the GEMM's O(m·n·k).

use half::f16;

use super::{int4_simd, linear_gemm, MatmulPolicy};
use crate::quant::{nibble, zero_point, ActivationCodes, Int4Matrix, ResidualInt4};
use crate::weights::{Matrix, WeightData};

/// Token rows quantized to int8 per weight group, their outliers apart.
#[derive(Debug)]
pub struct QuantizedActivations {
    /// `m × k` codes (0 where an outlier was taken out).
    pub codes: Vec<i8>,
    /// With [`ActivationCodes::TwoPass`], `m × k` codes of what `codes`
    /// left, in steps of 1/128 of theirs: `x ≈ scale · (128·code + fine)`.
    pub fine: Option<Vec<i8>>,
    /// `m × groups` scales (`x ≈ scale · code`, or as above).
    pub scales: Vec<f32>,
    /// `m × groups` exact f32 sums of `x` over each group, outliers
    /// excluded.
    pub sums: Vec<f32>,
    /// The entries taken out of the integer path, kept exact.
    pub outliers: Vec<Outlier>,
}

/// One activation entry multiplied in f32 rather than int8.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outlier {
    /// Token row.
    pub token: usize,
    /// Input column.
    pub col: usize,
    pub value: f32,
}

/// A group's loudest entry is an outlier when it is more than this many
/// times the next loudest: taking it out then at least halves the group's
/// step. Measured on SmolLM2-135M (bench/RESULTS.md).
pub(crate) const DOMINANCE: f32 = 2.0;

/// What quantizing a group makes of its loudest entry.
pub(crate) struct Loudest {
    /// The loudest entry's index when it dominates: more than
    /// [`DOMINANCE`] times the next loudest (it is then multiplied
    /// exactly).
    pub taken: Option<usize>,
    /// The largest magnitude left in the integer path.
    pub amax: f32,
}

/// Finds a group's loudest entry and whether it dominates the rest.
pub(crate) fn loudest(x: &[f32]) -> Loudest {
    let (mut at, mut first, mut second) = (0, 0f32, 0f32);
    for (i, v) in x.iter().enumerate() {
        let a = v.abs();
        if a > first {
            (second, first, at) = (first, a, i);
        } else if a > second {
            second = a;
        }
    }
    let taken = (first > DOMINANCE * second).then_some(at);
    Loudest {
        taken,
        amax: if taken.is_some() { second } else { first },
    }
}

/// Quantizes `m` rows of `k` activations with one scale per `group` columns.
///
/// A group whose loudest entry dominates the rest (a model's outlier
/// features, a few fixed channels far louder than the others) would have
/// its step set by that one entry, leaving its neighbours a few levels: the
/// entry is taken out ([`Outlier`]) and multiplied exactly, as LLM.int8()
/// does, so the integer path sees the group without it. At most one entry
/// per group is taken, so the exact path's cost is bounded by `k / group`
/// per token. [`ActivationCodes::TwoPass`] adds the fine codes.
pub fn quantize_activations(
    x: &[f32],
    m: usize,
    k: usize,
    group: usize,
    coding: ActivationCodes,
) -> QuantizedActivations {
    let groups = k / group;
    let two_pass = coding == ActivationCodes::TwoPass;
    let mut codes = vec![0i8; m * k];
    let mut fine = vec![0i8; if two_pass { m * k } else { 0 }];
    let mut scales = vec![0f32; m * groups];
    let mut sums = vec![0f32; m * groups];
    let mut outliers = Vec::new();
    for (gi, (xg, cg)) in x[..m * k]
        .chunks_exact(group)
        .zip(codes.chunks_exact_mut(group))
        .enumerate()
    {
        let Loudest { taken, amax } = loudest(xg);
        if let Some(i) = taken {
            let (token, col) = (gi / groups, gi % groups * group + i);
            outliers.push(Outlier {
                token,
                col,
                value: xg[i],
            });
        }
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0f32;
        let fg = if two_pass {
            &mut fine[gi * group..(gi + 1) * group]
        } else {
            &mut []
        };
        for (i, (c, &v)) in cg.iter_mut().zip(xg).enumerate() {
            if Some(i) != taken {
                let scaled = v * inv;
                let coarse = scaled.round();
                *c = coarse as i8;
                if let Some(f) = fg.get_mut(i) {
                    // What rounding left is within half a step: ±64 in
                    // 1/128 steps.
                    *f = ((scaled - coarse) * 128.0).round() as i8;
                }
                sum += v;
            }
        }
        scales[gi] = amax / 127.0 / if two_pass { 128.0 } else { 1.0 };
        sums[gi] = sum;
    }
    QuantizedActivations {
        codes,
        fine: two_pass.then_some(fine),
        scales,
        sums,
        outliers,
    }
}

/// The integer kernel this CPU runs, for reports: `avx-vnni`,
/// `avx512-vnni`, `avx2` or `scalar`.
pub fn kernel_name() -> &'static str {
    match int4_simd::best_kernel() {
        int4_simd::Kernel::AvxVnni => "avx-vnni",
        int4_simd::Kernel::Avx512Vnni => "avx512-vnni",
        int4_simd::Kernel::Avx2 => "avx2",
        int4_simd::Kernel::Scalar => "scalar",
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)` for an INT4 `w`.
pub fn linear_int4(
    x: &[f32],
    m: usize,
    w: &Int4Matrix,
    bias: Option<&[f32]>,
    policy: MatmulPolicy,
    out: &mut [f32],
) {
    let (n, k) = (w.rows(), w.cols());
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(out.len(), m * n);
    if policy.uses_row_kernel(m) {
        let xa = quantize_activations(x, m, k, w.group_size(), w.activations());
        linear_int4_rows(&xa, m, w, out, int4_simd::best_kernel());
    } else {
        linear_dequantized(x, m, (n, k), w.to_f32(), out);
    }
    if let Some(b) = bias {
        super::add_bias(out, n, b);
    }
}

/// `out[m, n] = x[m, k] · wᵀ` for a [`ResidualInt4`] `w`: the activations
/// are quantized once and multiplied into both parts.
pub fn linear_residual_int4(
    x: &[f32],
    m: usize,
    w: &ResidualInt4,
    policy: MatmulPolicy,
    out: &mut [f32],
) {
    let (n, k) = (w.rows(), w.cols());
    debug_assert_eq!(out.len(), m * n);
    let [coarse, fine] = w.parts();
    if policy.uses_row_kernel(m) {
        let kernel = int4_simd::best_kernel();
        let xa = quantize_activations(x, m, k, coarse.group_size(), coarse.activations());
        linear_int4_rows(&xa, m, coarse, out, kernel);
        let mut rest = vec![0f32; m * n];
        linear_int4_rows(&xa, m, fine, &mut rest, kernel);
        for (o, r) in out.iter_mut().zip(&rest) {
            *o += r;
        }
    } else {
        linear_dequantized(x, m, (n, k), w.to_f32(), out);
    }
}

/// The prefill path: the `[rows, cols]` weights dequantized once, then the
/// f32 GEMM.
fn linear_dequantized(
    x: &[f32],
    m: usize,
    (rows, cols): (usize, usize),
    values: Vec<f32>,
    out: &mut [f32],
) {
    let dense = Matrix {
        rows,
        cols,
        data: WeightData::F32(values.into()),
    };
    linear_gemm(x, m, &dense, out);
}

/// The row kernel over pre-quantized activations, split over rayon's pool.
pub(crate) fn linear_int4_rows(
    xa: &QuantizedActivations,
    m: usize,
    w: &Int4Matrix,
    out: &mut [f32],
    kernel: int4_simd::Kernel,
) {
    let n = w.rows();
    super::par_row_ranges(n, m, out, |r0, r1, out| {
        let rows = Int4Rows {
            packed: w.packed_rows(r0, r1),
            scales: w.scale_rows(r0, r1),
            zeros: w.zero_rows(r0, r1),
            k: w.cols(),
            group: w.group_size(),
        };
        int4_simd::rows_int4(kernel, &rows, xa, m, out, n, r0);
        add_outliers(&rows, &xa.outliers, out, n, r0);
    });
}

/// Adds the outliers' exact products to rows `r0..` of `out`.
fn add_outliers(w: &Int4Rows<'_>, outliers: &[Outlier], out: &mut [f32], n: usize, r0: usize) {
    let (k, gpr) = (w.k, w.k / w.group);
    for o in outliers {
        let (byte, shift) = nibble(o.col);
        let g = o.col / w.group;
        let dst = &mut out[o.token * n + r0..o.token * n + r0 + w.len()];
        for (r, d) in dst.iter_mut().enumerate() {
            let code = (w.packed[r * k / 2 + byte] >> shift) & 0x0f;
            let (s, z) = (f16_bits_to_f32(w.scales[r * gpr + g]), w.zeros[r * gpr + g]);
            *d += o.value * s * (f32::from(code) - zero_point(z));
        }
    }
}

/// A finite non-negative f16 as f32 in three operations: the bits moved
/// into f32's places, then the exponent bias fixed by one multiply, which
/// also makes subnormals right (scales are never negative, infinite or NaN).
#[inline]
fn f16_bits_to_f32(h: f16) -> f32 {
    f32::from_bits(u32::from(h.to_bits() & 0x7fff) << 13) * f32::from_bits(0x7780_0000)
}

/// A run of consecutive rows of an INT4 matrix.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Int4Rows<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [f16],
    /// Zero points in sixteenths ([`zero_point`]).
    pub zeros: &'a [u8],
    pub k: usize,
    pub group: usize,
}

impl Int4Rows<'_> {
    pub fn len(&self) -> usize {
        self.packed.len() * 2 / self.k
    }
}

/// The portable kernel: the same integer arithmetic as the SIMD kernels,
/// one element at a time.
pub(crate) fn rows_int4_scalar(
    w: &Int4Rows<'_>,
    xa: &QuantizedActivations,
    m: usize,
    out: &mut [f32],
    n: usize,
    r0: usize,
) {
    let (k, g) = (w.k, w.group);
    let gpr = k / g;
    for r in 0..w.len() {
        let packed = &w.packed[r * k / 2..(r + 1) * k / 2];
        for t in 0..m {
            let xq = &xa.codes[t * k..(t + 1) * k];
            let code = |c: usize| match &xa.fine {
                Some(f) => 128 * i32::from(xq[c]) + i32::from(f[t * k + c]),
                None => i32::from(xq[c]),
            };
            let mut acc = 0f32;
            for gi in 0..gpr {
                let isum: i32 = (gi * g..(gi + 1) * g)
                    .map(|c| {
                        let (byte, shift) = nibble(c);
                        i32::from((packed[byte] >> shift) & 0x0f) * code(c)
                    })
                    .sum();
                acc += isum as f32 * (w.scales[r * gpr + gi].to_f32() * xa.scales[t * gpr + gi]);
            }
            let zero_term: f32 = (0..gpr)
                .map(|gi| {
                    let (s, z) = (w.scales[r * gpr + gi].to_f32(), w.zeros[r * gpr + gi]);
                    -s * zero_point(z) * xa.sums[t * gpr + gi]
                })
                .sum();
            out[t * n + r0 + r] = acc + zero_term;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::linear;
    use crate::quant::{Int4Config, GROUP_SIZES};

    const CODINGS: [ActivationCodes; 2] = [ActivationCodes::Int8, ActivationCodes::TwoPass];

    use crate::kernels::test_values as pseudo;

    fn quantized(n: usize, k: usize, g: usize, seed: u32) -> Int4Matrix {
        let w = Matrix {
            rows: n,
            cols: k,
            data: WeightData::F32(pseudo(n * k, seed).into()),
        };
        Int4Matrix::quantize(&w, Int4Config::new(g).expect("group")).expect("quantize")
    }

    /// Every kernel this CPU runs gives the scalar reference's result (the
    /// same integer sums; only the float accumulation order differs), with
    /// either activation coding.
    #[test]
    fn simd_kernels_match_the_scalar_kernel() {
        for (g, coding) in GROUP_SIZES
            .into_iter()
            .flat_map(|g| CODINGS.map(|c| (g, c)))
        {
            for &(m, n, k) in &[
                (1, 9, 128),
                (2, 13, 256),
                (3, 8, 384),
                (5, 31, 128),
                (1, 16, 384),
                (2, 7, 768),
                (5, 6, 576),
                (3, 5, 1536),
            ] {
                let w = quantized(n, k, g, (m * n + g) as u32);
                // 576 columns take groups of 64 when asked for 128.
                let g = w.group_size();
                let x = pseudo(m * k, 3);
                let xa = quantize_activations(&x, m, k, g, coding);
                let mut want = vec![0f32; m * n];
                let rows = Int4Rows {
                    packed: w.packed_rows(0, n),
                    scales: w.scale_rows(0, n),
                    zeros: w.zero_rows(0, n),
                    k,
                    group: g,
                };
                rows_int4_scalar(&rows, &xa, m, &mut want, n, 0);
                add_outliers(&rows, &xa.outliers, &mut want, n, 0);
                for kernel in int4_simd::supported_kernels() {
                    let mut got = vec![0f32; m * n];
                    linear_int4_rows(&xa, m, &w, &mut got, kernel);
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "{kernel:?} {coding:?} g{g} {m}x{n}x{k}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// A group's dominant entry is taken out of the int8 path and multiplied
    /// exactly, so its neighbours keep their precision: with one entry 500
    /// times the rest, the product stays as close to the dequantized f32 one
    /// as without it, where int8 alone would leave the other 31 entries of
    /// that group a step each.
    #[test]
    fn a_dominant_activation_is_multiplied_exactly() {
        let (n, k, g) = (16, 256, 32);
        let w = quantized(n, k, g, 21).with_activations(ActivationCodes::Int8);
        let dense = Matrix {
            rows: n,
            cols: k,
            data: WeightData::F32(w.to_f32().into()),
        };
        let mut x = pseudo(k, 9);
        x[37] = 500.0;
        let xa = quantize_activations(&x, 1, k, g, ActivationCodes::Int8);
        assert_eq!(
            xa.outliers,
            vec![Outlier {
                token: 0,
                col: 37,
                value: 500.0
            }]
        );
        let mut want = vec![0f32; n];
        linear(&x, 1, &dense, None, MatmulPolicy::Fastest, &mut want);
        let mut got = vec![0f32; n];
        linear_int4(&x, 1, &w, None, MatmulPolicy::Fastest, &mut got);
        // The error of the rest of the row, measured without the outlier.
        let mut plain = x.clone();
        plain[37] = 0.0;
        let mut want_plain = vec![0f32; n];
        linear(
            &plain,
            1,
            &dense,
            None,
            MatmulPolicy::Fastest,
            &mut want_plain,
        );
        let mut got_plain = vec![0f32; n];
        linear_int4(&plain, 1, &w, None, MatmulPolicy::Fastest, &mut got_plain);
        let worst =
            |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let bound = 2.0 * worst(&got_plain, &want_plain) + 1e-3;
        assert!(worst(&got, &want) <= bound, "{:?} vs {:?}", got, want);
    }

    /// The fused kernel (int8 activations) and the prefill path (dequantize,
    /// then GEMM) stay close to the f32 product with the dequantized
    /// weights; a wrong nibble, scale or zero point is far outside the bound.
    #[test]
    fn int4_linear_matches_dequantized_f32() {
        for (g, coding) in GROUP_SIZES
            .into_iter()
            .flat_map(|g| CODINGS.map(|c| (g, c)))
        {
            for &m in &[1, 4, 60] {
                let (n, k) = (24, 256);
                let w = quantized(n, k, g, 11).with_activations(coding);
                let x = pseudo(m * k, 5);
                let dense = Matrix {
                    rows: n,
                    cols: k,
                    data: WeightData::F32(w.to_f32().into()),
                };
                let mut want = vec![0f32; m * n];
                linear(&x, m, &dense, None, MatmulPolicy::Fastest, &mut want);
                let mut got = vec![0f32; m * n];
                linear_int4(&x, m, &w, None, MatmulPolicy::Fastest, &mut got);
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                // int8 activations: about 1/254 of each group's range; two
                // passes 128 times finer (m = 60 is the dequantized GEMM).
                let bound = match coding {
                    ActivationCodes::TwoPass if m <= 4 => 0.0005,
                    _ => 0.02,
                };
                for (a, b) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= bound * scale,
                        "{coding:?} g{g} m{m}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// The second pass is what the first left, 128 times finer: the
    /// product's error against the dequantized weights in f32 falls by well
    /// over an order of magnitude (a fine code that was dropped, or a join
    /// of the two sums that was off by a bit, would not).
    #[test]
    fn two_passes_err_far_less_than_one() {
        let (n, k, g) = (32, 512, 32);
        let x = pseudo(k, 17);
        let w8 = quantized(n, k, g, 5).with_activations(ActivationCodes::Int8);
        let dense = Matrix {
            rows: n,
            cols: k,
            data: WeightData::F32(w8.to_f32().into()),
        };
        let mut want = vec![0f32; n];
        linear(&x, 1, &dense, None, MatmulPolicy::Fastest, &mut want);
        let err = |w: &Int4Matrix| {
            let mut got = vec![0f32; n];
            linear_int4(&x, 1, w, None, MatmulPolicy::Fastest, &mut got);
            got.iter()
                .zip(&want)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        let one = err(&w8);
        let two = err(&w8.clone().with_activations(ActivationCodes::TwoPass));
        assert!(
            one > 0.0 && two * 30.0 < one,
            "int8 {one}, two passes {two}"
        );
    }
}
