//! Element-wise activations of a gated MLP (`gate ← act(gate) · up`) and
//! logit soft-capping, in place.
//!
//! SiLU runs eight or sixteen lanes at a time (AVX2 / AVX-512, one `exp`
//! polynomial for every element, the tail included, so an element's bits
//! do not depend on the batch) and, over a prefill's rows, on the pool: a
//! 512-token gate of SmolLM2 (786k elements a layer) had run a serial libm
//! `exp` per element while the pool's other threads waited.

use rayon::prelude::*;

/// `gate = silu(gate) * up`, in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert!(up.len() >= gate.len(), "up is as long as gate");
    // A prefill's gate (512 tokens × 1536) took a serial `exp` per element
    // while the pool's other threads waited: split it over the pool.
    const PART: usize = 16 * 1024;
    if gate.len() > 2 * PART {
        gate.par_chunks_mut(PART)
            .zip(up.par_chunks(PART))
            .for_each(|(g, u)| silu_mul_part(g, u));
    } else {
        silu_mul_part(gate, up);
    }
}

fn silu_mul_part(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::simd512::supported() {
            // SAFETY: AVX-512F is present (checked); `up` is as long as
            // `gate` (asserted by the caller and the function).
            unsafe { super::simd512::silu_mul(gate, up) };
            return;
        }
        if super::simd::has_avx2() {
            // SAFETY: AVX2, FMA and F16C are present (checked); `up` is as
            // long as `gate` (asserted by the caller).
            unsafe { super::simd::silu_mul(gate, up) };
            return;
        }
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        let s = *g / (1.0 + (-*g).exp());
        *g = s * u;
    }
}

/// gpt-oss's clamped SwiGLU, in place: `gate = (clamp(up, ±limit) + 1) ·
/// g · sigmoid(alpha · g)` with `g = min(gate, limit)`.
pub fn clamped_swiglu_mul(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = g.min(limit);
        let u = u.clamp(-limit, limit);
        *g = (u + 1.0) * x / (1.0 + (-alpha * x).exp());
    }
}

/// `gate = gelu_tanh(gate) * up`, in place: PyTorch's
/// `gelu(approximate="tanh")`, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
        *g = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
}

/// `x = cap · tanh(x / cap)`, in place (Gemma 2's logit soft-capping).
pub fn softcap_in_place(x: &mut [f32], cap: f32) {
    for v in x.iter_mut() {
        *v = cap * (*v / cap).tanh();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values as pseudo;

    #[test]
    fn silu_mul_matches_its_formula_at_every_length() {
        for len in [1, 7, 8, 15, 16, 17, 100, 70_001] {
            let gate: Vec<f32> = pseudo(len, 11).iter().map(|v| v * 30.0).collect();
            let up = pseudo(len, 12);
            let mut got = gate.clone();
            silu_mul(&mut got, &up);
            for ((g, u), o) in gate.iter().zip(&up).zip(&got) {
                let want = g / (1.0 + (-g).exp()) * u;
                assert!(
                    (o - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{g}: {o} vs {want}"
                );
            }
        }
    }
}
