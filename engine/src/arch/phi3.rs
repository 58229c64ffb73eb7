//! Phi-3: a pre-norm SiLU decoder whose q/k/v are one tensor
//! (`self_attn.qkv_proj`, rows q then k then v) and whose gate and up are
//! one tensor (`mlp.gate_up_proj`, rows gate then up). A configured
//! `sliding_window` applies to every layer. The 128k variants' `longrope`
//! scaling is `crate::kernels::rope`'s.

use super::{ArchSpec, Family, FamilyInput, LayerTensor, Projections};
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
    head_dim_key: None,
    tied_by_default: false,
    // Phi3Config reads both as LongRoPE (the names of early releases).
    rope_aliases: &[("su", "longrope"), ("yarn", "longrope")],
    describe,
    default_windows: |c| Ok(vec![c.usize("sliding_window"); c.num_layers]),
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    Ok(ArchSpec {
        qkv: Projections::Fused,
        gate_up: Projections::Fused,
        ..ArchSpec::llama(LAYER_NAMES, c)?
    })
}
