//! Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention (Qwen3-MoE with
//! per-head q/k RMSNorm) over MLPs that are mixtures of experts on the
//! layers `decoder_sparse_step` and `mlp_only_layers` pick (the others are
//! dense MLPs of `intermediate_size`). The router's softmax top-k weights
//! are renormalised only with `norm_topk_prob`; Qwen2-MoE adds a shared
//! expert on every sparse layer, gated by `sigmoid(shared_expert_gate · x)`.

use super::llama::qwen_windows;
use super::moe::{self, ExpertStorage, MoeSpec, Routing};
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
    (LayerTensor::Router, "mlp.gate"),
    (LayerTensor::ExpertGate, "mlp.experts.*.gate_proj"),
    (LayerTensor::ExpertUp, "mlp.experts.*.up_proj"),
    (LayerTensor::ExpertDown, "mlp.experts.*.down_proj"),
    (LayerTensor::SharedGate, "mlp.shared_expert.gate_proj"),
    (LayerTensor::SharedUp, "mlp.shared_expert.up_proj"),
    (LayerTensor::SharedDown, "mlp.shared_expert.down_proj"),
    (LayerTensor::SharedExpertGate, "mlp.shared_expert_gate"),
];

pub static FAMILY: Family = Family {
    classes: &[
        ("Qwen2MoeForCausalLM", Architecture::Qwen2Moe),
        ("Qwen3MoeForCausalLM", Architecture::Qwen3Moe),
    ],
    nested_text_config: super::never_nested,
    default_head_dim: None,
    head_dim_key: None,
    tied_by_default: false,
    rope_aliases: &[],
    describe,
    default_windows,
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    let (num_experts, top_k) = moe::experts(c, &["num_experts", "num_local_experts"])?;
    let qwen3 = c.architecture == Architecture::Qwen3Moe;
    let shared_intermediate = match qwen3 {
        true => None,
        false => Some(moe::size(c, "shared_expert_intermediate_size")?),
    };
    Ok(ArchSpec {
        qk_norm: if qwen3 { QkNorm::PerHead } else { QkNorm::None },
        moe: Some(MoeSpec {
            num_experts,
            top_k,
            expert_intermediate: moe::size(c, "moe_intermediate_size")?,
            routing: Routing::SoftmaxTopK {
                renormalize: moe::flag(c, "norm_topk_prob", false),
            },
            storage: ExpertStorage::PerExpert,
            shared_intermediate,
            shared_gated: true,
            choice_bias: false,
            sparse_layers: moe::qwen_sparse_layers(c)?,
        }),
        ..ArchSpec::llama(LAYER_NAMES, c)?
    })
}

/// Qwen2-MoE windows as Qwen2's (from `max_window_layers` on); Qwen3-MoE's
/// window, when `use_sliding_window`, is on every layer.
fn default_windows(c: &FamilyInput<'_>) -> Result<Vec<Option<usize>>> {
    Ok(match c.architecture {
        Architecture::Qwen3Moe => {
            let window = c.usize("sliding_window");
            let on = moe::flag(c, "use_sliding_window", false);
            vec![window.filter(|_| on); c.num_layers]
        }
        _ => qwen_windows(c),
    })
}
