//! gpt-oss: a pre-norm decoder whose attention has q/k/v/o biases, one
//! learned sink logit per head in every softmax (`self_attn.sinks`),
//! sliding-window and full layers alternating (`layer_types`; without it,
//! even layers slide) and YaRN RoPE; every MLP is a mixture of
//! `num_local_experts` experts with biases, stacked in two 3-D tensors
//! ([`ExpertStorage::Stacked`]), routed by the top-k logits of a biased
//! router with a softmax over those k, activated by a clamped SwiGLU
//! (`swiglu_alpha`, `swiglu_limit`).
//!
//! The published checkpoints store the experts as MXFP4 blocks and scales
//! (`*_blocks`, `*_scales`, `quant_method: mxfp4`); they are dequantized at
//! load into bf16 matrices (exact), which run as any expert does (and
//! `--quantize int4` can requantize). The experts are copied either way (a
//! stacked tensor is input-major), not mapped.

use super::moe::{self, ExpertStorage, MoeSpec, Routing};
use super::{Activation, ArchSpec, Family, FamilyInput, LayerTensor};
use crate::config::Architecture;
use crate::error::Result;

const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::AttnNorm, "input_layernorm"),
    (LayerTensor::Q, "self_attn.q_proj"),
    (LayerTensor::K, "self_attn.k_proj"),
    (LayerTensor::V, "self_attn.v_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::Sinks, "self_attn.sinks"),
    (LayerTensor::MlpNorm, "post_attention_layernorm"),
    (LayerTensor::Router, "mlp.router"),
    (LayerTensor::ExpertsGateUp, "mlp.experts.gate_up_proj"),
    (LayerTensor::ExpertsDown, "mlp.experts.down_proj"),
];

pub static FAMILY: Family = Family {
    classes: &[("GptOssForCausalLM", Architecture::GptOss)],
    nested_text_config: super::never_nested,
    // GptOssConfig's default.
    default_head_dim: Some(64),
    head_dim_key: None,
    tied_by_default: false,
    rope_aliases: &[],
    describe,
    default_windows: |c| {
        let window = c.usize("sliding_window");
        Ok((0..c.num_layers)
            .map(|i| window.filter(|_| i % 2 == 0))
            .collect())
    },
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    let (num_experts, top_k) = moe::experts(c, &["num_local_experts", "num_experts"])?;
    Ok(ArchSpec {
        activation: Activation::ClampedSwiglu {
            alpha: c.f64("swiglu_alpha").unwrap_or(1.702) as f32,
            limit: c.f64("swiglu_limit").unwrap_or(7.0) as f32,
        },
        attn_sinks: true,
        moe: Some(MoeSpec {
            num_experts,
            top_k,
            expert_intermediate: moe::size(c, "intermediate_size")?,
            routing: Routing::TopKSoftmax,
            storage: ExpertStorage::Stacked,
            shared_intermediate: None,
            shared_gated: false,
            choice_bias: false,
            sparse_layers: vec![true; c.num_layers],
        }),
        ..ArchSpec::llama(LAYER_NAMES, c)?
    })
}
