//! One forward step's buffers: activations sized for the rank's shard,
//! RoPE angles per position (global and, where the family has one, local),
//! and the batch's sequences.

use crate::attention::{AttnSeq, Heads};
use crate::kernels::RopeTable;
use crate::lora::LoraRows;

use super::Model;

/// One step's activations and RoPE angles, sized for this rank's shard.
pub(super) struct Step<'a> {
    pub(super) seqs: Vec<AttnSeq<'a>>,
    /// Each row's adapter.
    pub(super) lora: LoraRows<'a>,
    pub(super) rows: usize,
    pub(super) heads: Heads,
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
    /// Angles of the local RoPE (empty when the model has none).
    pub(super) local_cos: Vec<f32>,
    pub(super) local_sin: Vec<f32>,
    pub(super) h: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) attn: Vec<f32>,
    pub(super) proj: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
}

impl<'a> Step<'a> {
    pub(super) fn new(
        model: &Model,
        positions: &[usize],
        seqs: Vec<AttnSeq<'a>>,
        lora: LoraRows<'a>,
    ) -> Self {
        let c = &model.config;
        let (t, d, hsz) = (positions.len(), c.head_dim, c.hidden_size);
        let heads = Heads {
            num_heads: model.shard.q_heads(c).len(),
            num_kv_heads: model.shard.kv_heads(c).len(),
            head_dim: d,
        };
        let inter = model.shard.intermediate(c).len();
        let (q_out, kv_out) = (heads.num_heads * d, heads.num_kv_heads * d);
        let angles = |rope: &RopeTable| {
            let half = d / 2;
            let mut cos = vec![0.0f32; t * half];
            let mut sin = vec![0.0f32; t * half];
            for (i, &p) in positions.iter().enumerate() {
                rope.angles(
                    p,
                    &mut cos[i * half..(i + 1) * half],
                    &mut sin[i * half..(i + 1) * half],
                );
            }
            (cos, sin)
        };
        let (cos, sin) = angles(&model.rope);
        let (local_cos, local_sin) = model.local_rope.as_ref().map(angles).unwrap_or_default();
        Self {
            seqs,
            lora,
            rows: t,
            heads,
            cos,
            sin,
            local_cos,
            local_sin,
            h: vec![0.0; t * hsz],
            q: vec![0.0; t * q_out],
            k: vec![0.0; t * kv_out],
            v: vec![0.0; t * kv_out],
            attn: vec![0.0; t * q_out],
            proj: vec![0.0; t * hsz],
            gate: vec![0.0; t * inter],
            up: vec![0.0; t * inter],
        }
    }
}
