//! Activations quantized to int8 in the two block shapes ggml's CPU dot
//! products take: 32-element blocks with an f16 scale and the block's
//! scaled sum (`Q8_0`/`Q8_1`, for `Q4_0`..`Q8_0`), and 256-element blocks
//! with an f32 scale and sums per 16 (`Q8_K`, for the K-quants).
//!
//! The rounding follows ggml's reference quantizers, with one change: a
//! block's loudest entry, when it dominates the rest (twice the next,
//! [`loudest`]), is taken out of the integer path and multiplied exactly
//! (`outliers`), as the INT4 kernels do. Small real models have a few such
//! channels, and left in, each sets its whole block's step: on
//! SmolLM2-135M's `Q4_1` file, teacher-forced against transformers, top-1
//! agreement went 0.967 → 0.980 and mean |Δ log p| 0.059 → 0.029 with them
//! taken out (bench/RESULTS.md, "GGUF").

use half::f16;

use crate::kernels::int4::{loudest, Loudest};

/// Elements per `Q8_0`-shaped block.
pub const QK8: usize = 32;
/// Elements per `Q8_K` block (the K-quants' super-block).
pub const QK_K: usize = 256;

/// One token row in 32-element blocks: `x ≈ d · q`.
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    pub q: Vec<i8>,
    /// Per block: the scale, rounded through f16 as ggml stores it.
    pub d: Vec<f32>,
    /// Per block: `d · Σ q`, rounded through f16 (`Q8_1`'s min term).
    pub s: Vec<f32>,
    /// Per block: `Σ q` (the offset term of `Q4_0`, `Q5_0`).
    pub sum: Vec<i32>,
    /// Entries taken out of `q` (coded 0 there), kept exact.
    pub outliers: Vec<(usize, f32)>,
}

/// One token row in 256-element blocks: `x ≈ d · q`.
#[derive(Debug, Clone, Default)]
pub struct Q8KRow {
    pub q: Vec<i8>,
    /// Per block: the scale (f32, as ggml keeps it).
    pub d: Vec<f32>,
    /// Per 16 elements: `Σ q`.
    pub bsums: Vec<i16>,
    /// Entries taken out of `q` (coded 0 there), kept exact.
    pub outliers: Vec<(usize, f32)>,
}

/// Quantizes a row whose length is a multiple of [`QK8`]: per block,
/// `d = max|x| / 127` and `q = round(x / d)` (ties away from zero).
pub fn quantize_q8(x: &[f32]) -> Q8Row {
    let blocks = x.len() / QK8;
    let mut row = Q8Row {
        q: vec![0; x.len()],
        d: Vec::with_capacity(blocks),
        s: Vec::with_capacity(blocks),
        sum: Vec::with_capacity(blocks),
        outliers: Vec::new(),
    };
    for (b, (xb, qb)) in x
        .chunks_exact(QK8)
        .zip(row.q.chunks_exact_mut(QK8))
        .enumerate()
    {
        let Loudest { taken, amax } = loudest(xb);
        if let Some(i) = taken {
            row.outliers.push((b * QK8 + i, xb[i]));
        }
        let kept = |i: usize| Some(i) != taken;
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (i, (q, &v)) in qb.iter_mut().zip(xb).enumerate() {
            if kept(i) {
                *q = (v * id).round() as i8;
                sum += i32::from(*q);
            }
        }
        let d = f16::from_f32(d).to_f32();
        row.d.push(d);
        row.s.push(f16::from_f32(d * sum as f32).to_f32());
        row.sum.push(sum);
    }
    row
}

/// Quantizes a row whose length is a multiple of [`QK_K`]: per block the
/// scale maps the entry of largest magnitude to −127 (so its sign sets the
/// scale's), rounding to nearest even, as ggml's `quantize_row_q8_K`.
pub fn quantize_q8k(x: &[f32]) -> Q8KRow {
    let blocks = x.len() / QK_K;
    let mut row = Q8KRow {
        q: vec![0; x.len()],
        d: Vec::with_capacity(blocks),
        bsums: Vec::with_capacity(x.len() / 16),
        outliers: Vec::new(),
    };
    for (b, (xb, qb)) in x
        .chunks_exact(QK_K)
        .zip(row.q.chunks_exact_mut(QK_K))
        .enumerate()
    {
        let Loudest { taken, .. } = loudest(xb);
        if let Some(i) = taken {
            row.outliers.push((b * QK_K + i, xb[i]));
        }
        let (mut amax, mut max) = (0f32, 0f32);
        for (i, &v) in xb.iter().enumerate() {
            if Some(i) != taken && v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        if amax == 0.0 {
            row.d.push(0.0);
            row.bsums.extend([0i16; QK_K / 16]);
            continue;
        }
        let iscale = -127.0 / max;
        for (i, (q, &v)) in qb.iter_mut().zip(xb).enumerate() {
            if Some(i) != taken {
                *q = (iscale * v).round_ties_even().min(127.0) as i8;
            }
        }
        row.d.push(1.0 / iscale);
        for g in qb.chunks_exact(16) {
            row.bsums.push(g.iter().map(|&q| i16::from(q)).sum());
        }
    }
    row
}

/// `m` token rows of `k` activations, in the block shape a weight type's
/// dot product takes.
#[derive(Debug)]
pub enum Activations {
    Q8(Vec<Q8Row>),
    Q8K(Vec<Q8KRow>),
}

impl Activations {
    /// Quantizes the rows of `x` (`m × k`) for a weight of 32-element
    /// blocks (`k_quant` false) or 256-element super-blocks.
    pub fn quantize(x: &[f32], m: usize, k: usize, k_quant: bool) -> Self {
        let rows = x[..m * k].chunks_exact(k);
        match k_quant {
            false => Self::Q8(rows.map(quantize_q8).collect()),
            true => Self::Q8K(rows.map(quantize_q8k).collect()),
        }
    }

    /// Token row `t`'s entries taken out of the integer path.
    pub fn outliers(&self, t: usize) -> &[(usize, f32)] {
        match self {
            Self::Q8(rows) => &rows[t].outliers,
            Self::Q8K(rows) => &rows[t].outliers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_blocks_round_and_sum() {
        let mut x = vec![0.0f32; 64];
        x[0] = 1.27;
        x[1] = -0.8;
        x[40] = -2.54;
        x[41] = 2.0;
        let r = quantize_q8(&x);
        assert_eq!((r.q[0], r.q[1]), (127, -80));
        assert_eq!((r.q[40], r.q[41]), (-127, 100));
        assert!((r.d[0] - 0.01).abs() < 1e-5 && (r.d[1] - 0.02).abs() < 1e-5);
        assert!((r.s[0] - 0.01 * 47.0).abs() < 1e-3);
        assert_eq!(r.sum, vec![47, -27]);
        assert!(r.outliers.is_empty());
        assert_eq!(quantize_q8(&[0.0; 32]).d, vec![0.0]);
    }

    #[test]
    fn a_dominant_entry_is_kept_exact() {
        let mut x = vec![0.01f32; 32];
        x[5] = 3.0;
        x[6] = -1.0;
        let r = quantize_q8(&x);
        assert_eq!(r.outliers, vec![(5, 3.0)]);
        assert_eq!((r.q[5], r.q[6]), (0, -127));
        let mut x = vec![0.01f32; 256];
        x[200] = -5.0;
        let r = quantize_q8k(&x);
        assert_eq!(r.outliers, vec![(200, -5.0)]);
        assert_eq!(r.q[200], 0);
        assert_eq!(r.q[0], -127);
    }

    #[test]
    fn q8k_takes_the_sign_of_its_loudest_entry() {
        let mut x = vec![0.25f32; 256];
        x[3] = 2.0;
        x[4] = 1.5;
        let r = quantize_q8k(&x);
        // iscale = -127 / 2: the loudest entry becomes -127, d is negative.
        assert_eq!(r.q[3], -127);
        assert!(r.d[0] < 0.0);
        assert_eq!(r.q[0], -16); // -15.875 rounds to even
        assert_eq!(r.q[4], -95); // -95.25
        assert_eq!(r.bsums[0], -127 - 95 + 14 * -16);
        assert!((r.d[0] * f32::from(r.q[3]) - 2.0).abs() < 1e-6);
    }
}
