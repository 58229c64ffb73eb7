//! Mixtral: Mistral's attention (a window on every layer when the config
//! has one) with every MLP a mixture of `num_local_experts` experts, each
//! token sent to `num_experts_per_tok` of them by a softmax router whose
//! top-k weights are renormalised (`block_sparse_moe`, experts' `w1` gate,
//! `w3` up, `w2` down).

use super::moe::{self, ExpertStorage, MoeSpec, Routing};
use super::{ArchSpec, Family, FamilyInput, LayerTensor};
use crate::config::Architecture;
use crate::error::Result;

const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::AttnNorm, "input_layernorm"),
    (LayerTensor::Q, "self_attn.q_proj"),
    (LayerTensor::K, "self_attn.k_proj"),
    (LayerTensor::V, "self_attn.v_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::MlpNorm, "post_attention_layernorm"),
    (LayerTensor::Router, "block_sparse_moe.gate"),
    (LayerTensor::ExpertGate, "block_sparse_moe.experts.*.w1"),
    (LayerTensor::ExpertUp, "block_sparse_moe.experts.*.w3"),
    (LayerTensor::ExpertDown, "block_sparse_moe.experts.*.w2"),
];

pub static FAMILY: Family = Family {
    classes: &[("MixtralForCausalLM", Architecture::Mixtral)],
    nested_text_config: super::never_nested,
    default_head_dim: None,
    head_dim_key: None,
    tied_by_default: false,
    rope_aliases: &[],
    describe,
    default_windows: |c| Ok(vec![c.usize("sliding_window"); c.num_layers]),
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    let (num_experts, top_k) = moe::experts(c, &["num_local_experts", "num_experts"])?;
    Ok(ArchSpec {
        moe: Some(MoeSpec {
            num_experts,
            top_k,
            // Mixtral's experts are as wide as its `intermediate_size`.
            expert_intermediate: moe::size(c, "intermediate_size")?,
            routing: Routing::SoftmaxTopK { renormalize: true },
            storage: ExpertStorage::PerExpert,
            shared_intermediate: None,
            shared_gated: false,
            choice_bias: false,
            sparse_layers: vec![true; c.num_layers],
        }),
        ..ArchSpec::llama(LAYER_NAMES, c)?
    })
}
