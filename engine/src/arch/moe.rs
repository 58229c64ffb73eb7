//! Mixture-of-experts layers, as data: how many experts, how a token picks
//! its `top_k` of them, and which layers are sparse.
//!
//! A sparse layer's MLP is a router (a `[num_experts, hidden]` linear
//! layer) and `num_experts` gated MLPs of `expert_intermediate` features,
//! plus, in Qwen2-MoE, one always-on shared expert whose output is scaled
//! by `sigmoid(shared_expert_gate · x)`. Families differ in the order of
//! the router's softmax and top-k ([`Routing`]) and in which layers are
//! sparse (Qwen's `decoder_sparse_step` and `mlp_only_layers`); the
//! families' files read their configs into a [`MoeSpec`] with the helpers
//! here, which refuse what cannot be run by the field's name.

use super::FamilyInput;
use crate::error::{EngineError, Result};

/// How a token's router logits become its experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Softmax over every expert, then the `top_k` largest probabilities,
    /// renormalised to sum to one when `renormalize` (Mixtral always;
    /// Qwen when `norm_topk_prob`).
    SoftmaxTopK { renormalize: bool },
    /// The `top_k` largest logits, then a softmax over those alone
    /// (gpt-oss).
    TopKSoftmax,
    /// DeepSeek's: scores (a softmax in V2, sigmoids in V3) plus, for the
    /// choice only, the router's choice bias; the experts split into
    /// `groups` equal groups, ranked by [`GroupScore`], and only the best
    /// `topk_groups` groups' experts may be chosen; the chosen experts'
    /// scores (without the bias), renormalised when `renormalize`, times
    /// `scale` (`routed_scaling_factor`).
    Grouped {
        sigmoid: bool,
        groups: usize,
        topk_groups: usize,
        group_score: GroupScore,
        renormalize: bool,
        scale: f32,
    },
}

/// How [`Routing::Grouped`] ranks a group of experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupScore {
    /// Its best expert's score (DeepSeek-V2's `group_limited_greedy`).
    Max,
    /// Its two best experts' scores summed (DeepSeek-V3).
    TopTwoSum,
}

/// How a checkpoint stores its experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertStorage {
    /// One module per expert, each with its own gate, up and down
    /// `[out, in]` tensors (Mixtral, Qwen).
    PerExpert,
    /// All experts stacked, input-major: `gate_up_proj` `[E, hidden, 2I]`
    /// with gate and up interleaved along the last axis (gate at even
    /// columns), `down_proj` `[E, I, hidden]`, biases `*_bias` `[E, out]`
    /// (gpt-oss).
    Stacked,
}

/// A model's mixture-of-experts layers.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Intermediate features of each routed expert.
    pub expert_intermediate: usize,
    pub routing: Routing,
    pub storage: ExpertStorage,
    /// Intermediate features of the shared expert, if the family has one
    /// (Qwen2-MoE's `shared_expert_intermediate_size`; DeepSeek's
    /// `n_shared_experts × moe_intermediate_size`).
    pub shared_intermediate: Option<usize>,
    /// Whether the shared expert's output is scaled by
    /// `sigmoid(shared_expert_gate · x)` (Qwen2-MoE) or added as is
    /// (DeepSeek).
    pub shared_gated: bool,
    /// Whether the router has a choice bias ([`Routing::Grouped`]).
    pub choice_bias: bool,
    /// Per layer: whether its MLP is sparse (the others are dense MLPs of
    /// `intermediate_size`).
    pub sparse_layers: Vec<bool>,
}

impl MoeSpec {
    /// Whether layer `i` routes its tokens to experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.sparse_layers.get(i).copied().unwrap_or(false)
    }

    /// How many layers are sparse.
    pub fn sparse_count(&self) -> usize {
        self.sparse_layers.iter().filter(|&&s| s).count()
    }
}

/// The number of experts, from the first of `keys` the config has, and the
/// experts per token, checked against it.
pub(crate) fn experts(c: &FamilyInput<'_>, keys: &[&str]) -> Result<(usize, usize)> {
    let (key, n) = keys
        .iter()
        .find_map(|k| c.usize(k).map(|n| (*k, n)))
        .ok_or_else(|| missing(keys.join(" or ")))?;
    if n == 0 {
        return Err(invalid(format!("{key} is 0")));
    }
    let top_k = c
        .usize("num_experts_per_tok")
        .ok_or_else(|| missing("num_experts_per_tok".into()))?;
    if top_k == 0 || top_k > n {
        return Err(invalid(format!(
            "num_experts_per_tok is {top_k}; it must be between 1 and {key} ({n})"
        )));
    }
    Ok((n, top_k))
}

/// A size field that must be present and positive.
pub(crate) fn size(c: &FamilyInput<'_>, key: &str) -> Result<usize> {
    match c.usize(key) {
        Some(0) => Err(invalid(format!("{key} is 0"))),
        Some(n) => Ok(n),
        None => Err(missing(key.into())),
    }
}

/// Qwen's rule: layer `i` is sparse unless listed in `mlp_only_layers`,
/// and only every `decoder_sparse_step`-th layer (`(i + 1) % step == 0`).
pub(crate) fn qwen_sparse_layers(c: &FamilyInput<'_>) -> Result<Vec<bool>> {
    let step = c.usize("decoder_sparse_step").unwrap_or(1);
    if step == 0 {
        return Err(invalid("decoder_sparse_step is 0".into()));
    }
    let dense: Vec<usize> = match c.json.get("mlp_only_layers") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|_| invalid("mlp_only_layers must be a list of layer indices".into()))?,
    };
    if let Some(bad) = dense.iter().find(|&&i| i >= c.num_layers) {
        return Err(invalid(format!(
            "mlp_only_layers names layer {bad} of a {}-layer model",
            c.num_layers
        )));
    }
    Ok((0..c.num_layers)
        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
        .collect())
}

/// A boolean field, `default` when absent.
pub(crate) fn flag(c: &FamilyInput<'_>, key: &str, default: bool) -> bool {
    c.json
        .get(key)
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(default)
}

fn missing(what: String) -> EngineError {
    EngineError::InvalidCheckpoint(format!("mixture-of-experts config has no {what}"))
}

pub(crate) fn invalid(what: String) -> EngineError {
    EngineError::InvalidCheckpoint(format!("mixture-of-experts config: {what}"))
}
