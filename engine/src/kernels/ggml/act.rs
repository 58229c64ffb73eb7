//! Activations quantized to int8 in 32-element blocks, the shape ggml's
//! CPU dot products take for `Q4_0`..`Q8_0` (`Q8_0`/`Q8_1`: an f16 scale
//! and the block's scaled sum), with the sums per 16 besides for `Q6_K`.
//!
//! The rounding follows ggml's AVX2 quantizer (`d = max|x| / 127`, codes
//! rounded to nearest, ties to even; an AVX2 form here, tested bit for bit
//! against the portable one), with two changes:
//! - a block's loudest entry, when it dominates the rest (twice the next,
//!   [`loudest`]), is taken out of the integer path and multiplied exactly
//!   (`outliers`), as the INT4 kernels do. Small real models have a few such
//!   channels, and left in, each sets its whole block's step: on
//!   SmolLM2-135M's `Q4_1` file, teacher-forced against transformers, top-1
//!   agreement went 0.967 → 0.980 and mean |Δ log p| 0.059 → 0.029 with them
//!   taken out (bench/RESULTS.md, "GGUF");
//! - the K-quants take these 32-element blocks too, not ggml's 256-element
//!   `Q8_K`: one scale per 256 activations set by the loudest of them
//!   rounds the rest coarsely. On SmolLM2's `Q4_K_M` file mean |Δ log p|
//!   against transformers went 0.051 → 0.033 (its K-quant layers are
//!   the MLP's down projections, whose inputs are heavy-tailed).

use half::f16;

use crate::kernels::int4::{loudest, Loudest};

/// Elements per `Q8_0`-shaped block.
pub const QK8: usize = 32;
/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// One token row in 32-element blocks: `x ≈ d · q`.
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    pub q: Vec<i8>,
    /// Per block: the scale, rounded through f16 as ggml stores it.
    pub d: Vec<f32>,
    /// Per block: `d · Σ q`, rounded through f16 (`Q8_1`'s min term).
    pub s: Vec<f32>,
    /// Per block: `Σ q` (the offset term of `Q4_0`, `Q5_0`, `Q8_0`).
    pub sum: Vec<i32>,
    /// Per 16 elements: `Σ q` (`Q6_K`'s offset term, per its sub-blocks).
    pub sums16: Vec<i16>,
    /// Entries taken out of `q` (coded 0 there), kept exact.
    pub outliers: Vec<(usize, f32)>,
}

/// Quantizes a row whose length is a multiple of [`QK8`]: per block,
/// `d = max|x| / 127` and `q = x / d` rounded to nearest, ties to even (as
/// ggml's AVX2 quantizer rounds), the dominant entry aside.
pub fn quantize_q8(x: &[f32]) -> Q8Row {
    let blocks = x.len() / QK8;
    let mut row = Q8Row {
        q: vec![0; x.len()],
        d: Vec::with_capacity(blocks),
        s: Vec::with_capacity(blocks),
        sum: Vec::with_capacity(blocks),
        sums16: Vec::with_capacity(2 * blocks),
        outliers: Vec::new(),
    };
    #[cfg(target_arch = "x86_64")]
    let simd = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    for (b, (xb, qb)) in x
        .chunks_exact(QK8)
        .zip(row.q.chunks_exact_mut(QK8))
        .enumerate()
    {
        #[cfg(target_arch = "x86_64")]
        let block = if simd {
            // SAFETY: AVX2 and FMA were detected just above.
            unsafe { simd::quantize_block(xb, qb) }
        } else {
            quantize_block(xb, qb)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let block = quantize_block(xb, qb);
        if let Some(i) = block.taken {
            row.outliers.push((b * QK8 + i, xb[i]));
        }
        row.sums16.extend(block.sums16);
        let (d, sum) = (
            f16::from_f32(block.d).to_f32(),
            block.sums16[0] + block.sums16[1],
        );
        row.d.push(d);
        row.s.push(f16::from_f32(d * f32::from(sum)).to_f32());
        row.sum.push(i32::from(sum));
    }
    row
}

/// What quantizing one block gives besides its codes.
#[derive(Debug, PartialEq)]
struct Block {
    /// The dominant entry taken out (coded 0), if any.
    taken: Option<usize>,
    /// The scale, before its rounding to f16.
    d: f32,
    /// `Σ q` over each half.
    sums16: [i16; 2],
}

/// One block, portably: the reference the SIMD quantizer matches exactly.
fn quantize_block(xb: &[f32], qb: &mut [i8]) -> Block {
    let Loudest { taken, amax } = loudest(xb);
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sums16 = [0i16; 2];
    for (i, (q, &v)) in qb.iter_mut().zip(xb).enumerate() {
        *q = match Some(i) == taken {
            true => 0,
            false => (v * id).round_ties_even() as i8,
        };
        sums16[i / 16] += i16::from(*q);
    }
    Block { taken, d, sums16 }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{Block, QK8};
    use crate::kernels::int4::DOMINANCE;

    /// The largest lane of `v`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    /// [`super::quantize_block`] in AVX2: the same loudest entry, scale,
    /// products and rounding, so the same codes.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_block(xb: &[f32], qb: &mut [i8]) -> Block {
        assert!(xb.len() == QK8 && qb.len() == QK8, "one block");
        let sign = _mm256_set1_ps(-0.0);
        // SAFETY: `xb` holds 32 f32 (checked above).
        let x: [__m256; 4] =
            std::array::from_fn(|k| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * k)) });
        let abs = x.map(|v| _mm256_andnot_ps(sign, v));
        let first = hmax(_mm256_max_ps(
            _mm256_max_ps(abs[0], abs[1]),
            _mm256_max_ps(abs[2], abs[3]),
        ));
        // The first lane holding the maximum, as `loudest` takes it.
        let at = (0..4).fold(0u32, |mask, k| {
            let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs[k], _mm256_set1_ps(first)));
            mask | ((eq as u32) << (8 * k))
        });
        let at = at.trailing_zeros() as usize;
        // The loudest of the others (a tie for loudest leaves it equal).
        let mut rest = [0f32; QK8];
        for (k, v) in abs.iter().enumerate() {
            // SAFETY: `rest` holds 32 f32.
            unsafe { _mm256_storeu_ps(rest.as_mut_ptr().add(8 * k), *v) };
        }
        if let Some(r) = rest.get_mut(at) {
            *r = 0.0;
        }
        // SAFETY: `rest` holds 32 f32.
        let r: [__m256; 4] =
            std::array::from_fn(|k| unsafe { _mm256_loadu_ps(rest.as_ptr().add(8 * k)) });
        let second = hmax(_mm256_max_ps(
            _mm256_max_ps(r[0], r[1]),
            _mm256_max_ps(r[2], r[3]),
        ));
        let taken = at < QK8 && first > DOMINANCE * second;
        let amax = if taken { second } else { first };
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let mut q: [__m256i; 4] = std::array::from_fn(|k| {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x[k], id),
            );
            _mm256_cvtps_epi32(r)
        });
        if taken {
            let lane = _mm256_cmpeq_epi32(
                _mm256_set1_epi32((at % 8) as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            q[at / 8] = _mm256_andnot_si256(lane, q[at / 8]);
        }
        // i32 → i8 in column order: the packs work per 128-bit half.
        let words = [
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        ];
        let bytes = _mm256_packs_epi16(words[0], words[1]);
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `qb` holds 32 bytes.
        unsafe { _mm256_storeu_si256(qb.as_mut_ptr().cast(), ordered) };
        let half = |a: __m256i, b: __m256i| {
            let mut lanes = [0i32; 8];
            // SAFETY: `lanes` holds eight i32.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), _mm256_add_epi32(a, b)) };
            lanes.iter().sum::<i32>() as i16
        };
        Block {
            taken: taken.then_some(at),
            d,
            sums16: [half(q[0], q[1]), half(q[2], q[3])],
        }
    }
}

/// `m` token rows of `k` activations, quantized.
#[derive(Debug)]
pub struct Activations(Vec<Q8Row>);

impl Activations {
    /// Quantizes the rows of `x` (`m × k`, `k` a multiple of [`QK8`]).
    pub fn quantize(x: &[f32], m: usize, k: usize) -> Self {
        Self(x[..m * k].chunks_exact(k).map(quantize_q8).collect())
    }

    /// Token row `t`.
    pub fn row(&self, t: usize) -> &Q8Row {
        &self.0[t]
    }

    /// Token row `t`'s entries taken out of the integer path.
    pub fn outliers(&self, t: usize) -> &[(usize, f32)] {
        &self.0[t].outliers
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
        assert_eq!(r.sums16, vec![47, 0, -27, 0]);
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
        assert_eq!(r.sum[0], -127 + 30);
    }

    /// The AVX2 quantizer gives the portable one's codes, bit for bit:
    /// ties, a dominant entry, a tie for loudest, zeros.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_blocks_match_the_portable_ones() {
        if !is_x86_feature_detected!("avx2") || !is_x86_feature_detected!("fma") {
            return;
        }
        let mut seed = 12345u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed % 20001) as f32 / 1000.0 - 10.0
        };
        let mut blocks: Vec<Vec<f32>> = (0..200)
            .map(|_| (0..32).map(|_| next()).collect())
            .collect();
        blocks[0] = vec![0.0; 32];
        blocks[1] = (0..32).map(|i| i as f32 * 0.5 - 8.0).collect(); // halves: ties
        blocks[2][17] = 500.0; // dominant
        blocks[3][4] = -500.0;
        blocks[3][30] = 500.0; // a tie for loudest: nothing taken
        blocks[4][31] = -80.0; // dominant, last lane
        for (n, xb) in blocks.iter().enumerate() {
            let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
            let want = quantize_block(xb, &mut a);
            // SAFETY: AVX2 and FMA were detected above.
            let got = unsafe { simd::quantize_block(xb, &mut b) };
            assert_eq!((got, b), (want, a), "block {n}");
        }
    }
}
