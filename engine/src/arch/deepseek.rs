//! DeepSeek-V2 and DeepSeek-V3 (and the checkpoints that reuse their
//! classes, e.g. Kimi K2): multi-head latent attention over a mixture of
//! experts.
//!
//! **Attention** ([`MlaSpec`]). Each token's keys and values are one
//! compressed latent: `kv_a_proj_with_mqa` gives `kv_lora_rank` latent
//! features (RMSNormed by `kv_a_layernorm`) and `qk_rope_head_dim` features
//! of a key part shared by every head, which alone is rotated. `kv_b_proj`
//! expands the latent into each head's unrotated key (`qk_nope_head_dim`)
//! and value (`v_head_dim`). Queries come from `q_proj`, or through a
//! low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj` when `q_lora_rank` is
//! set. The cache holds the normed latent and the rotated key part, one
//! row per token and layer (`crate::kv_cache::KvRows::Latent`); how the
//! CPU model attends over it is `crate::model::mla`. RoPE pairs are
//! interleaved (V2 always; V3 with `rope_interleave`, its default). With a
//! YaRN scaling, scores are multiplied by `mscale(factor,
//! mscale_all_dim)²` besides YaRN's own factor on the rotated part.
//!
//! **Experts.** Layers from `first_k_dense_replace` on are sparse:
//! `n_routed_experts` experts routed by [`Routing::Grouped`] (V2: softmax
//! scores, greedy or `group_limited_greedy` by the best expert of each
//! group; V3: sigmoid scores plus `e_score_correction_bias` for the choice,
//! groups ranked by their two best, renormalised with `norm_topk_prob`),
//! times `routed_scaling_factor`, plus `n_shared_experts` always-on
//! experts as one ungated MLP.
//!
//! **Not loaded.** The multi-token-prediction layers some V3 checkpoints
//! carry (`num_nextn_predict_layers`) are skipped: transformers does not
//! run them either, so nothing here could be checked against it.

use serde_json::Value;

use super::moe::{self, ExpertStorage, GroupScore, MoeSpec, Routing};
use super::{ArchSpec, Family, FamilyInput, LayerTensor};
use crate::config::Architecture;
use crate::error::{EngineError, Result};

const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::AttnNorm, "input_layernorm"),
    (LayerTensor::Q, "self_attn.q_proj"),
    (LayerTensor::QA, "self_attn.q_a_proj"),
    (LayerTensor::QANorm, "self_attn.q_a_layernorm"),
    (LayerTensor::QB, "self_attn.q_b_proj"),
    (LayerTensor::KvA, "self_attn.kv_a_proj_with_mqa"),
    (LayerTensor::KvANorm, "self_attn.kv_a_layernorm"),
    (LayerTensor::KvB, "self_attn.kv_b_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::MlpNorm, "post_attention_layernorm"),
    (LayerTensor::Gate, "mlp.gate_proj"),
    (LayerTensor::Up, "mlp.up_proj"),
    (LayerTensor::Down, "mlp.down_proj"),
    (LayerTensor::Router, "mlp.gate"),
    (
        LayerTensor::RouterChoiceBias,
        "mlp.gate.e_score_correction_bias",
    ),
    (LayerTensor::ExpertGate, "mlp.experts.*.gate_proj"),
    (LayerTensor::ExpertUp, "mlp.experts.*.up_proj"),
    (LayerTensor::ExpertDown, "mlp.experts.*.down_proj"),
    (LayerTensor::SharedGate, "mlp.shared_experts.gate_proj"),
    (LayerTensor::SharedUp, "mlp.shared_experts.up_proj"),
    (LayerTensor::SharedDown, "mlp.shared_experts.down_proj"),
];

pub static FAMILY: Family = Family {
    classes: &[
        ("DeepseekV2ForCausalLM", Architecture::DeepseekV2),
        ("DeepseekV3ForCausalLM", Architecture::DeepseekV3),
    ],
    nested_text_config: super::never_nested,
    default_head_dim: None,
    // RoPE turns only the `qk_rope_head_dim` part of each query and key.
    head_dim_key: Some("qk_rope_head_dim"),
    tied_by_default: false,
    rope_aliases: &[],
    describe,
    default_windows: |c| Ok(vec![None; c.num_layers]),
};

/// The shape of multi-head latent attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaSpec {
    /// The query's low rank (`q_a_proj`'s outputs); `None`: one `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Latent features per token (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Per head: unrotated query/key features, rotated ones, value features.
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Whether the rotated features pair up as `(x0, x1), (x2, x3)…`
    /// rather than `(x_i, x_{i + d/2})`.
    pub rope_interleave: bool,
}

impl MlaSpec {
    /// One cached row: the latent and the rotated key part.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// A query head's width, unrotated and rotated parts.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    let v3 = c.architecture == Architecture::DeepseekV3;
    let mla = MlaSpec {
        q_lora_rank: c.usize("q_lora_rank").filter(|&r| r > 0),
        kv_lora_rank: moe::size(c, "kv_lora_rank")?,
        qk_nope_head_dim: moe::size(c, "qk_nope_head_dim")?,
        qk_rope_head_dim: moe::size(c, "qk_rope_head_dim")?,
        v_head_dim: moe::size(c, "v_head_dim")?,
        rope_interleave: !v3 || moe::flag(c, "rope_interleave", true),
    };
    let (num_experts, top_k) = moe::experts(c, &["n_routed_experts", "num_local_experts"])?;
    let expert_intermediate = moe::size(c, "moe_intermediate_size")?;
    let shared = c.usize("n_shared_experts").unwrap_or(0);
    let first_dense = c.usize("first_k_dense_replace").unwrap_or(0);
    let routing = routing(c, v3, num_experts, top_k)?;
    Ok(ArchSpec {
        attn_scale: attn_scale(c.json, mla.qk_head_dim()),
        mla: Some(mla),
        moe: Some(MoeSpec {
            num_experts,
            top_k,
            expert_intermediate,
            routing,
            storage: ExpertStorage::PerExpert,
            shared_intermediate: (shared > 0).then_some(shared * expert_intermediate),
            shared_gated: false,
            choice_bias: v3,
            sparse_layers: (0..c.num_layers).map(|i| i >= first_dense).collect(),
        }),
        ..ArchSpec::llama(LAYER_NAMES, c)?
    })
}

/// V2's `topk_method` (`greedy` or `group_limited_greedy`, softmax scores,
/// never renormalised, as transformers runs it) or V3's (sigmoid scores,
/// groups always, `norm_topk_prob`).
fn routing(c: &FamilyInput<'_>, v3: bool, experts: usize, top_k: usize) -> Result<Routing> {
    let grouped = |score| -> Result<(usize, usize, GroupScore)> {
        let groups = moe::size(c, "n_group")?;
        let topk_groups = moe::size(c, "topk_group")?;
        if !experts.is_multiple_of(groups) || topk_groups > groups {
            return Err(moe::invalid(format!(
                "{experts} experts in n_group {groups} groups, topk_group {topk_groups}"
            )));
        }
        if top_k > topk_groups * (experts / groups) {
            return Err(moe::invalid(format!(
                "num_experts_per_tok {top_k} is more than the {} experts of topk_group groups",
                topk_groups * (experts / groups)
            )));
        }
        Ok((groups, topk_groups, score))
    };
    let (groups, topk_groups, group_score) = match (v3, c.str("topk_method")) {
        (true, _) => grouped(GroupScore::TopTwoSum)?,
        (false, None | Some("greedy")) => (1, 1, GroupScore::Max),
        (false, Some("group_limited_greedy")) => grouped(GroupScore::Max)?,
        (false, Some(other)) => {
            return Err(EngineError::Unsupported(format!(
                "DeepSeek-V2 topk_method `{other}` (supported: greedy, group_limited_greedy)"
            )))
        }
    };
    if v3 && experts / groups < 2 {
        return Err(moe::invalid(format!(
            "V3 ranks groups by their two best experts; {groups} groups of {experts} have fewer"
        )));
    }
    Ok(Routing::Grouped {
        sigmoid: v3,
        groups,
        topk_groups,
        group_score,
        renormalize: v3 && moe::flag(c, "norm_topk_prob", true),
        scale: c.f64("routed_scaling_factor").unwrap_or(1.0) as f32,
    })
}

/// `qk_head_dim^-0.5`, times `mscale(factor, mscale_all_dim)²` under a
/// YaRN-type scaling that sets `mscale_all_dim` (transformers'
/// `yarn_apply_mscale`).
fn attn_scale(json: &Value, qk_head_dim: usize) -> f32 {
    let base = (qk_head_dim as f64).powf(-0.5);
    let params = ["rope_scaling", "rope_parameters"]
        .iter()
        .find_map(|k| json.get(*k).filter(|v| v.is_object()));
    let Some(p) = params else {
        return base as f32;
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str);
    let factor = p.get("factor").and_then(Value::as_f64);
    let all_dim = p.get("mscale_all_dim").and_then(Value::as_f64);
    match (kind, factor, all_dim) {
        (Some(k), Some(f), Some(m)) if k != "default" && m != 0.0 && f > 1.0 => {
            let mscale = 0.1 * m * f.ln() + 1.0;
            (base * mscale * mscale) as f32
        }
        _ => base as f32,
    }
}
