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
    /// Where the frequencies change with the position.
    beyond: Beyond,
    /// Queries and keys are scaled by this after rotation (YaRN, LongRoPE);
    /// folded into the attention scale ([`Self::score_factor`]).
    attention_factor: f64,
}

/// Frequencies that depend on the position.
#[derive(Debug, Clone)]
enum Beyond {
    /// One table for every position.
    Nowhere,
    /// LongRoPE: another table (the long factors') from `from` on.
    Table { from: usize, inv_freq: Vec<f32> },
    /// Dynamic NTK: past `original`, theta grown for the length `pos + 1`.
    Dynamic {
        theta: f64,
        factor: f64,
        original: usize,
        dim: usize,
    },
}

/// `theta^(-2i/dim)` for each rotated pair.
fn plain(theta: f64, dim: usize) -> Vec<f64> {
    (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / dim as f64))
        .collect()
}

fn to_f32(v: Vec<f64>) -> Vec<f32> {
    v.into_iter().map(|f| f as f32).collect()
}

/// Llama 3.1: low frequencies divided by `factor`, high ones kept, a
/// smooth blend between.
fn llama3(base: Vec<f64>, factor: f64, low: f64, high: f64, old_len: f64) -> Vec<f64> {
    let low_wavelen = old_len / low;
    let high_wavelen = old_len / high;
    base.iter()
        .map(|&f| {
            let wavelen = 2.0 * PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / factor
            } else {
                let smooth = (old_len / wavelen - low) / (high - low);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// YaRN's blend (transformers' `_compute_yarn_parameters`): pairs that
/// turn fewer than `beta_slow` times over the original context are
/// interpolated (divided by `factor`), more than `beta_fast` times kept,
/// with a linear ramp over the pairs between.
fn yarn(theta: f64, dim: usize, scaling: &RopeScaling) -> Vec<f64> {
    let RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: orig,
        beta_fast,
        beta_slow,
        truncate,
        ..
    } = *scaling
    else {
        return plain(theta, dim);
    };
    let correction_dim =
        |rotations: f64| dim as f64 * (orig / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    plain(theta, dim)
        .into_iter()
        .enumerate()
        .map(|(i, extrapolated)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            extrapolated / factor * (1.0 - keep) + extrapolated * keep
        })
        .collect()
}

/// Dynamic NTK's frequencies for a sequence of `len` tokens.
fn dynamic(theta: f64, factor: f64, original: usize, dim: usize, len: usize) -> Vec<f32> {
    let len = len.max(original) as f64;
    let grown =
        (factor * len / original as f64 - (factor - 1.0)).powf(dim as f64 / (dim as f64 - 2.0));
    to_f32(plain(theta * grown, dim))
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

    /// Builds the table for one head size, theta and scaling. (LongRoPE's
    /// factor lists have `dim / 2` entries: `ModelConfig` checks that.)
    pub fn from_params(dim: usize, params: &RopeParams) -> Self {
        let theta = params.theta;
        let base = plain(theta, dim);
        let mut beyond = Beyond::Nowhere;
        let inv_freq = match &params.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            &RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => llama3(
                base,
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            ),
            yarn_scaling @ RopeScaling::Yarn { .. } => yarn(theta, dim, yarn_scaling),
            &RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings: original,
            } => {
                beyond = Beyond::Dynamic {
                    theta,
                    factor,
                    original,
                    dim,
                };
                base
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                ..
            } => {
                // In f32, as transformers computes LongRoPE's frequencies:
                // its large divisors make the rounding show in logprobs.
                let divided = |factors: &[f64]| {
                    (0..dim / 2)
                        .zip(factors)
                        .map(|(i, &d)| {
                            let pow = (theta as f32).powf((2 * i) as f32 / dim as f32);
                            f64::from(1.0 / (d as f32 * pow))
                        })
                        .collect::<Vec<f64>>()
                };
                beyond = Beyond::Table {
                    from: *original_max_position_embeddings,
                    inv_freq: to_f32(divided(long_factor)),
                };
                divided(short_factor)
            }
        };
        Self {
            inv_freq: to_f32(inv_freq),
            beyond,
            attention_factor: params.scaling.attention_factor(),
        }
    }

    /// The inverse frequency of each rotated pair (`head_dim / 2` of them)
    /// at positions before any position-dependent change (LongRoPE's long
    /// factors, dynamic NTK's growth).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// What attention scores are multiplied by for this RoPE: the square
    /// of the factor transformers applies to the rotated queries and keys.
    pub fn score_factor(&self) -> f32 {
        (self.attention_factor * self.attention_factor) as f32
    }

    /// Fills `cos` and `sin` (each `head_dim / 2` long) for one position.
    ///
    /// Where frequencies depend on the position, a position uses those of
    /// a sequence ending at it, as transformers' decoding with a cache
    /// does one token at a time (and vLLM's LongRoPE cache does): tokens
    /// already in the cache keep their rotation.
    pub fn angles(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let grown;
        let inv_freq = match &self.beyond {
            Beyond::Table { from, inv_freq } if pos >= *from => inv_freq,
            &Beyond::Dynamic {
                theta,
                factor,
                original,
                dim,
            } if pos >= original => {
                grown = dynamic(theta, factor, original, dim, pos + 1);
                &grown
            }
            _ => &self.inv_freq,
        };
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn table(scaling: RopeScaling) -> RopeTable {
        RopeTable::from_params(
            8,
            &RopeParams {
                theta: 10_000.0,
                scaling,
            },
        )
    }

    fn angles(t: &RopeTable, pos: usize) -> Vec<f32> {
        let (mut cos, mut sin) = (vec![0.0; 4], vec![0.0; 4]);
        t.angles(pos, &mut cos, &mut sin);
        cos.into_iter().chain(sin).collect()
    }

    #[test]
    fn position_dependent_frequencies_change_only_from_the_original_context_on() {
        let plain = table(RopeScaling::None);
        let dynamic = table(RopeScaling::Dynamic {
            factor: 4.0,
            original_max_position_embeddings: 16,
        });
        let longrope = table(RopeScaling::LongRope {
            short_factor: vec![1.0; 4],
            long_factor: vec![1.0, 2.0, 4.0, 8.0],
            original_max_position_embeddings: 16,
            attention_factor: 1.2,
        });
        for pos in [0, 7, 15] {
            assert_eq!(angles(&dynamic, pos), angles(&plain, pos), "{pos}");
            assert_eq!(angles(&longrope, pos), angles(&plain, pos), "{pos}");
        }
        for pos in [16, 40] {
            assert_ne!(angles(&dynamic, pos), angles(&plain, pos), "{pos}");
            assert_ne!(angles(&longrope, pos), angles(&plain, pos), "{pos}");
        }
        // The fastest pair's divisor is 1 in the long factors too.
        assert_eq!(angles(&longrope, 40)[0], angles(&plain, 40)[0]);
        assert!((longrope.score_factor() - 1.44).abs() < 1e-6);
        assert_eq!(dynamic.score_factor(), 1.0);
    }

    #[test]
    fn yarn_keeps_fast_pairs_and_interpolates_slow_ones() {
        let plain = table(RopeScaling::None);
        let yarn = table(RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.1,
        });
        let (p, y) = (plain.inv_freq(), yarn.inv_freq());
        assert_eq!(y[0], p[0], "the fastest pair is kept");
        assert!((y[3] - p[3] / 4.0).abs() < 1e-9, "the slowest is divided");
    }
}
