//! Phi-3: a pre-norm SiLU decoder whose q/k/v are one tensor
//! (`self_attn.qkv_proj`, rows q then k then v) and whose gate and up are
//! one tensor (`mlp.gate_up_proj`, rows gate then up). A configured
//! `sliding_window` applies to every layer. `longrope` scaling (Phi-3.5,
//! the 128k variants) is refused by name with the other unknown rope types.

use super::llama::ROOTS;
use super::{Activation, ArchSpec, Family, FamilyInput, LayerTensor, NormPlacement, Projections};
use crate::config::Architecture;
use crate::error::Result;

const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::AttnNorm, "input_layernorm"),
    (LayerTensor::Qkv, "self_attn.qkv_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::MlpNorm, "post_attention_layernorm"),
    (LayerTensor::GateUp, "mlp.gate_up_proj"),
    (LayerTensor::Down, "mlp.down_proj"),
];

pub static FAMILY: Family = Family {
    classes: &[("Phi3ForCausalLM", Architecture::Phi3)],
    nested_text_config: super::never_nested,
    default_head_dim: None,
    tied_by_default: false,
    describe,
    default_windows: |c| Ok(vec![c.usize("sliding_window"); c.num_layers]),
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    Ok(ArchSpec {
        layer_names: LAYER_NAMES,
        roots: ROOTS,
        qkv: Projections::Fused,
        gate_up: Projections::Fused,
        norm: NormPlacement::Pre,
        norm_offset: 0.0,
        activation: c.activation(Activation::Silu)?,
        embed_scale: None,
        qk_norm: false,
        attn_scale: c.default_attn_scale(),
        attn_softcap: None,
        final_softcap: None,
        local_rope: None,
        text_tower_of: None,
    })
}
