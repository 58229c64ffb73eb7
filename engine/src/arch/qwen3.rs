//! Qwen3: Qwen2's decoder with a per-head RMSNorm on queries and keys
//! before RoPE (`self_attn.q_norm`, `self_attn.k_norm`, `head_dim` wide)
//! and no q/k/v biases unless `attention_bias`.

use super::llama::{qwen_windows, ROOTS};
use super::{Activation, ArchSpec, Family, FamilyInput, LayerTensor, NormPlacement, Projections};
use crate::config::Architecture;
use crate::error::Result;

const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::AttnNorm, "input_layernorm"),
    (LayerTensor::Q, "self_attn.q_proj"),
    (LayerTensor::K, "self_attn.k_proj"),
    (LayerTensor::V, "self_attn.v_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::QNorm, "self_attn.q_norm"),
    (LayerTensor::KNorm, "self_attn.k_norm"),
    (LayerTensor::MlpNorm, "post_attention_layernorm"),
    (LayerTensor::Gate, "mlp.gate_proj"),
    (LayerTensor::Up, "mlp.up_proj"),
    (LayerTensor::Down, "mlp.down_proj"),
];

pub static FAMILY: Family = Family {
    classes: &[("Qwen3ForCausalLM", Architecture::Qwen3)],
    nested_text_config: super::never_nested,
    // Qwen3Config's default.
    default_head_dim: Some(128),
    tied_by_default: false,
    describe,
    default_windows: |c| Ok(qwen_windows(c)),
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    Ok(ArchSpec {
        layer_names: LAYER_NAMES,
        roots: ROOTS,
        qkv: Projections::Split,
        gate_up: Projections::Split,
        norm: NormPlacement::Pre,
        norm_offset: 0.0,
        activation: c.activation(Activation::Silu)?,
        embed_scale: None,
        qk_norm: true,
        attn_scale: c.default_attn_scale(),
        attn_softcap: None,
        final_softcap: None,
        local_rope: None,
        text_tower_of: None,
    })
}
