//! One query's arithmetic over one decoded KV block (at most 16 rows): the
//! scores, the softmax step's exponentials and the weighted sum of values.
//!
//! The portable version is a dot product, an `exp` and an `axpy` per key.
//! On AVX-512 (where `head_dim` is a multiple of 16) the sixteen keys of a
//! block are scored together: sixteen accumulators of `q ⊙ k_j`, then one
//! 16 × 16 transpose and fifteen adds leave score `j` in lane `j` (instead
//! of sixteen horizontal sums); the exponentials are one vector polynomial;
//! the weighted sum keeps each 16-lane slice of the output in a register
//! across the block's rows instead of loading and storing it per key.
//! Either way a query's arithmetic does not depend on the queries beside it.

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

    /// `out[j] = q·keys[j] · scale · factors[j]` for the `factors.len()`
    /// (≤ 16) rows of `keys` (each `q.len()` long).
    pub fn scores(self, q: &[f32], keys: &[f32], scale: f32, factors: &[f32], out: &mut [f32]) {
        let (d, span) = (q.len(), factors.len());
        assert!(span <= 16 && keys.len() >= span * d && out.len() >= span);
        match self {
            Self::Portable => {
                for (j, o) in out[..span].iter_mut().enumerate() {
                    *o = crate::kernels::dot_f32(q, &keys[j * d..(j + 1) * d])
                        * (scale * factors[j]);
                }
            }
            // SAFETY: `Avx512` is chosen only where the CPU has AVX-512F
            // and `d` is a multiple of 16; the lengths are checked above.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { avx512::scores(q, keys, scale, factors, out) },
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

    /// `acc += Σ_j weights[j] · values[j]` over the `weights.len()` rows of
    /// `values` (each `acc.len()` long).
    pub fn accumulate(self, acc: &mut [f32], weights: &[f32], values: &[f32]) {
        let d = acc.len();
        assert!(values.len() >= weights.len() * d);
        match self {
            Self::Portable => {
                for (j, &w) in weights.iter().enumerate() {
                    crate::kernels::axpy_f32(acc, w, &values[j * d..(j + 1) * d]);
                }
            }
            // SAFETY: as in `scores`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { avx512::accumulate(acc, weights, values) },
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::kernels::simd512::{exp16, transpose16};

    /// Lanes `0..n` (n ≤ 16).
    fn first(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    }

    /// # Safety
    /// AVX-512F; `q.len()` a multiple of 16; `keys` holds `factors.len()`
    /// (≤ 16) rows of `q.len()`; `out` at least that many floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores(
        q: &[f32],
        keys: &[f32],
        scale: f32,
        factors: &[f32],
        out: &mut [f32],
    ) {
        let (d, span) = (q.len(), factors.len());
        // Rows past the block's end repeat row 0; their lanes are dropped.
        let rows: [*const f32; 16] =
            std::array::from_fn(|j| keys[if j < span { j * d } else { 0 }..].as_ptr());
        let mut acc = [_mm512_setzero_ps(); 16];
        for c in (0..d).step_by(16) {
            // SAFETY: c + 16 ≤ d, and each row pointer starts a row of d.
            unsafe {
                let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                for (a, row) in acc.iter_mut().zip(rows) {
                    *a = _mm512_fmadd_ps(qv, _mm512_loadu_ps(row.add(c)), *a);
                }
            }
        }
        let lanes = transpose16(acc.map(|a| _mm512_castps_si512(a)));
        let mut sum = _mm512_castsi512_ps(lanes[0]);
        for l in &lanes[1..] {
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(*l));
        }
        let mask = first(span);
        // SAFETY: `factors` and `out` hold `span` floats, the masked lanes.
        unsafe {
            let f = _mm512_mul_ps(
                _mm512_set1_ps(scale),
                _mm512_maskz_loadu_ps(mask, factors.as_ptr()),
            );
            _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, _mm512_mul_ps(sum, f));
        }
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

    /// # Safety
    /// AVX-512F; `acc.len()` a multiple of 16; `values` holds
    /// `weights.len()` rows of `acc.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn accumulate(acc: &mut [f32], weights: &[f32], values: &[f32]) {
        let d = acc.len();
        for c in (0..d).step_by(16) {
            // SAFETY: c + 16 ≤ d; row j's slice starts at j·d + c and
            // values holds weights.len() rows of d.
            unsafe {
                let mut a = _mm512_loadu_ps(acc.as_ptr().add(c));
                for (j, &w) in weights.iter().enumerate() {
                    let v = _mm512_loadu_ps(values.as_ptr().add(j * d + c));
                    a = _mm512_fmadd_ps(_mm512_set1_ps(w), v, a);
                }
                _mm512_storeu_ps(acc.as_mut_ptr().add(c), a);
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
            BlockMath::Portable.scores(&q, &keys, 0.125, &factors, &mut a);
            fast.scores(&q, &keys, 0.125, &factors, &mut b);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-5, "span {span}: {x} vs {y}");
            }
            let max = a.iter().copied().fold(f32::MIN, f32::max);
            let (sa, sb) = (
                BlockMath::Portable.exp_sum(&mut a, max),
                fast.exp_sum(&mut b, max),
            );
            assert!((sa - sb).abs() < 1e-5 * sa, "{sa} vs {sb}");
            let (mut acc_a, mut acc_b) = (pseudo(d, 5), pseudo(d, 5));
            BlockMath::Portable.accumulate(&mut acc_a, &a, &keys);
            fast.accumulate(&mut acc_b, &b, &keys);
            for (x, y) in acc_a.iter().zip(&acc_b) {
                assert!((x - y).abs() < 1e-5, "span {span}: {x} vs {y}");
            }
        }
    }
}
