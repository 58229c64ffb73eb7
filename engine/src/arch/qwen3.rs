//! Qwen3: Qwen2's decoder with a per-head RMSNorm on queries and keys
//! before RoPE (`self_attn.q_norm`, `self_attn.k_norm`, `head_dim` wide)
//! and no q/k/v biases unless `attention_bias`.

use super::llama::qwen_windows;
use super::{ArchSpec, Family, FamilyInput, LayerTensor, QkNorm};
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
    head_dim_key: None,
    tied_by_default: false,
    rope_aliases: &[],
    describe,
    default_windows: |c| Ok(qwen_windows(c)),
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    Ok(ArchSpec {
        qk_norm: QkNorm::PerHead,
        ..ArchSpec::llama(LAYER_NAMES, c)?
    })
}
