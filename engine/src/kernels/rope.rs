//! Rotary position embeddings, Hugging Face `rotate_half` convention.
//!
//! Dimension `i` of each head is paired with `i + head_dim/2` (not with its
//! neighbour, as in the original GPT-J layout), and the angle for position `p`
//! is `p * inv_freq[i]` computed in f32 exactly as transformers does, so the
//! rounding of large positions matches too.

use std::f64::consts::PI;

use crate::arch::RopeParams;
use crate::config::{ModelConfig, RopeScaling};

/// Inverse frequencies of one model, after any long-context scaling.
#[derive(Debug, Clone)]
pub struct RopeTable {
    inv_freq: Vec<f32>,
}

impl RopeTable {
    /// Builds the table for a model's head size and its global layers'
    /// theta and scaling.
    pub fn new(config: &ModelConfig) -> Self {
        Self::from_params(
            config.head_dim,
            &RopeParams {
                theta: config.rope_theta,
                scaling: config.rope_scaling.clone(),
            },
        )
    }

    /// Builds the table for one head size, theta and scaling.
    pub fn from_params(dim: usize, params: &RopeParams) -> Self {
        let base: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / params.theta.powf((2 * i) as f64 / dim as f64))
            .collect();
        let inv_freq = match params.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_len,
            } => {
                let low_wavelen = old_len / low_freq_factor;
                let high_wavelen = old_len / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old_len / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        Self {
            inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
        }
    }

    /// The inverse frequency of each rotated pair (`head_dim / 2` of them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Fills `cos` and `sin` (each `head_dim / 2` long) for one position.
    pub fn angles(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = f64::from(pos as f32 * f);
            *c = angle.cos() as f32;
            *s = angle.sin() as f32;
        }
    }

    /// Rotates every head of one token row in place.
    pub fn apply(&self, row: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = head_dim / 2;
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}
