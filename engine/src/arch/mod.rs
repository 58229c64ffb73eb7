//! Architecture descriptions: what differs between model families, as data.
//!
//! Every family the engine runs is a decoder of the same skeleton (embed,
//! N × [norm, attention, norm, MLP] with residuals, final norm, head). What
//! differs is described once, here, by an [`ArchSpec`] that a family's file
//! builds from its `config.json`:
//!
//! - which tensors exist and under which names ([`LayerTensor`],
//!   [`TensorNames`]);
//! - where the RMSNorms sit ([`NormPlacement`]) and their form (Gemma's
//!   `(1 + w)` weight: [`ArchSpec::norm_offset`]);
//! - the MLP's [`Activation`], the embedding scale, per-head q/k RMSNorm;
//! - attention: the score scale (`query_pre_attn_scalar`), logit
//!   soft-capping, and per layer (resolved at load, [`LayerAttention`]) its
//!   sliding window and whether it uses the local RoPE base;
//! - final-logit soft-capping.
//!
//! The CPU model (`crate::model`) and the CUDA loader read the description;
//! neither names a tensor. Adding a family is one file here (a
//! [`Family`] entry in [`FAMILIES`]) plus any kernel its variants need.
//!
//! **Architecture Invariant:** model code names no tensor and matches no
//! family name; only the files of this module do.

pub mod deepseek;
pub mod gemma;
pub mod gpt_oss;
pub mod granite;
pub mod llama;
pub mod mixtral;
pub mod moe;
pub mod olmo2;
pub mod phi3;
pub mod qwen3;
pub mod qwen_moe;

use serde_json::Value;

use crate::config::{Architecture, RopeScaling};
use crate::error::{EngineError, Result};
pub use deepseek::MlaSpec;
pub use moe::{ExpertStorage, GroupScore, MoeSpec, Routing};

/// Where a decoder layer's RMSNorms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormPlacement {
    /// On the input of attention and of the MLP (Llama, Qwen).
    Pre,
    /// On the input and on the output of each, before the residual add
    /// (Gemma 2 and 3).
    Sandwich,
    /// On the output of each only, before the residual add (OLMo 2).
    Post,
}

impl NormPlacement {
    /// Whether attention's and the MLP's inputs are normed.
    pub fn on_inputs(self) -> bool {
        matches!(self, Self::Pre | Self::Sandwich)
    }

    /// Whether attention's and the MLP's outputs are normed.
    pub fn on_outputs(self) -> bool {
        matches!(self, Self::Sandwich | Self::Post)
    }
}

/// An RMSNorm of the queries and keys, before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head, one `head_dim` weight shared by all heads (Qwen3,
    /// Gemma 3).
    PerHead,
    /// Over the whole projection (`num_heads * head_dim` for q,
    /// `num_kv_heads * head_dim` for k), before the split into heads
    /// (OLMo 2). A tensor-parallel split would cut it: such a model runs
    /// unsplit.
    Full,
}

/// The MLP's gate activation (`act(gate) * up`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `x · sigmoid(x)` (`silu`).
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// gpt-oss's: `(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)` with
    /// `g = min(gate, limit)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl Activation {
    /// Parses a Hugging Face `hidden_act` / `hidden_activation` value.
    pub fn from_hf(name: &str) -> Result<Self> {
        match name {
            "silu" | "swish" => Ok(Self::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Ok(Self::GeluTanh),
            other => Err(EngineError::Unsupported(format!(
                "activation `{other}` (supported: silu, gelu_pytorch_tanh)"
            ))),
        }
    }
}

/// Whether related projections are separate tensors or one fused tensor
/// (rows concatenated in order: q, k, v; gate, up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projections {
    Split,
    Fused,
}

/// The tensors of one decoder layer, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerTensor {
    /// Norm on attention's input.
    AttnNorm,
    Q,
    K,
    V,
    /// q, k and v in one tensor (`Projections::Fused`).
    Qkv,
    O,
    /// RMSNorm of the queries (before RoPE; [`QkNorm`]).
    QNorm,
    /// RMSNorm of the keys (before RoPE; [`QkNorm`]).
    KNorm,
    /// Norm on attention's output (sandwich placement).
    AttnOutNorm,
    /// Norm on the MLP's input.
    MlpNorm,
    /// Norm on the MLP's output (sandwich placement).
    MlpOutNorm,
    Gate,
    Up,
    /// gate and up in one tensor (`Projections::Fused`).
    GateUp,
    Down,
    /// A sparse layer's router, `[num_experts, hidden]` ([`MoeSpec`]).
    Router,
    /// A routed expert's projections; the module path has a `*` where
    /// the expert's index goes ([`TensorNames::expert`]).
    ExpertGate,
    ExpertUp,
    ExpertDown,
    /// The shared expert's projections (Qwen2-MoE).
    SharedGate,
    SharedUp,
    SharedDown,
    /// The shared expert's `[1, hidden]` output gate.
    SharedExpertGate,
    /// Every expert's gate and up projections in one 3-D tensor, and their
    /// down projections in another ([`ExpertStorage::Stacked`]).
    ExpertsGateUp,
    ExpertsDown,
    /// One attention-sink logit per head (gpt-oss).
    Sinks,
    /// Multi-head latent attention ([`MlaSpec`]): the query's down
    /// projection, its RMSNorm and up projection (with a `q_lora_rank`;
    /// without one the query is `Q`).
    QA,
    QANorm,
    QB,
    /// The latent's projection (`kv_lora_rank + qk_rope_head_dim` rows),
    /// the latent's RMSNorm, and its up projection to per-head keys and
    /// values.
    KvA,
    KvANorm,
    KvB,
    /// A router's per-expert bias added to the scores when choosing, not
    /// when weighting (DeepSeek-V3's `e_score_correction_bias`).
    RouterChoiceBias,
}

/// A layer's attention, resolved at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerAttention {
    /// The sliding window, if this layer has one.
    pub window: Option<usize>,
    /// Whether this layer rotates with the local RoPE ([`ArchSpec::local_rope`]).
    pub local_rope: bool,
}

/// RoPE parameters of one kind of layer.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// What a family does differently, resolved from its `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchSpec {
    /// Module path of each layer tensor, relative to `layers.{i}.`.
    pub layer_names: &'static [(LayerTensor, &'static str)],
    /// Candidate (root, head) name pairs, tried in order at load: the root
    /// precedes `embed_tokens`, `layers.{i}.` and `norm`; the head is the
    /// output projection's module path.
    pub roots: &'static [(&'static str, &'static str)],
    /// q/k/v as three tensors or one.
    pub qkv: Projections,
    /// gate/up as two tensors or one.
    pub gate_up: Projections,
    pub norm: NormPlacement,
    /// Added to every RMSNorm weight at load: Gemma's norms scale by
    /// `1 + w`.
    pub norm_offset: f32,
    pub activation: Activation,
    /// Embedding rows are multiplied by this (Gemma: `sqrt(hidden_size)`).
    pub embed_scale: Option<f32>,
    /// q/k RMSNorm before RoPE (Qwen3, Gemma 3: per head; OLMo 2: whole).
    pub qk_norm: QkNorm,
    /// Attention scores are `q·k · attn_scale` (`head_dim^-0.5`, Gemma's
    /// `query_pre_attn_scalar^-0.5`, Granite's `attention_multiplier`).
    pub attn_scale: f32,
    /// Attention's and the MLP's outputs are multiplied by this before the
    /// residual add (Granite's `residual_multiplier`).
    pub residual_scale: Option<f32>,
    /// Logits are divided by this (Granite's `logits_scaling`).
    pub logits_divisor: Option<f32>,
    /// Scores become `cap · tanh(score / cap)` (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits become `cap · tanh(logit / cap)` (Gemma 2).
    pub final_softcap: Option<f32>,
    /// RoPE of the sliding-window layers when it differs from the global
    /// one (Gemma 3's `rope_local_base_freq`).
    pub local_rope: Option<RopeParams>,
    /// Set when the checkpoint is a multimodal model whose text tower is
    /// served alone (its class name).
    pub text_tower_of: Option<&'static str>,
    /// The mixture-of-experts layers, if the family has them.
    pub moe: Option<MoeSpec>,
    /// A learned per-head logit in every attention softmax (gpt-oss).
    pub attn_sinks: bool,
    /// Multi-head latent attention (DeepSeek-V2/V3) instead of q/k/v.
    pub mla: Option<MlaSpec>,
}

impl ArchSpec {
    /// The Llama description with `layer_names`: pre-norm, split
    /// projections, the config's activation (SiLU by default), the usual
    /// attention scale, nothing else. Families override what differs.
    pub fn llama(
        layer_names: &'static [(LayerTensor, &'static str)],
        c: &FamilyInput<'_>,
    ) -> Result<Self> {
        Ok(Self {
            layer_names,
            roots: llama::ROOTS,
            qkv: Projections::Split,
            gate_up: Projections::Split,
            norm: NormPlacement::Pre,
            norm_offset: 0.0,
            activation: c.activation(Activation::Silu)?,
            embed_scale: None,
            qk_norm: QkNorm::None,
            attn_scale: c.default_attn_scale(),
            residual_scale: None,
            logits_divisor: None,
            attn_softcap: None,
            final_softcap: None,
            local_rope: None,
            text_tower_of: None,
            moe: None,
            attn_sinks: false,
            mla: None,
        })
    }

    /// A layer's module path for `t`, if this family has one.
    pub fn layer_module(&self, t: LayerTensor) -> Option<&'static str> {
        self.layer_names
            .iter()
            .find(|(role, _)| *role == t)
            .map(|&(_, name)| name)
    }

    /// The tensors the layers of this model must have: every layer's
    /// attention tensors and norms, the dense MLP's where a layer is dense,
    /// the router's and experts' where one is sparse.
    pub fn required_layer_tensors(&self) -> Vec<LayerTensor> {
        use LayerTensor::*;
        let mut t = vec![O];
        if self.norm.on_inputs() {
            t.extend([AttnNorm, MlpNorm]);
        }
        if self.norm.on_outputs() {
            t.extend([AttnOutNorm, MlpOutNorm]);
        }
        match (&self.mla, self.qkv) {
            (Some(m), _) => {
                t.extend([KvA, KvANorm, KvB]);
                match m.q_lora_rank {
                    Some(_) => t.extend([QA, QANorm, QB]),
                    None => t.push(Q),
                }
            }
            (None, Projections::Split) => t.extend([Q, K, V]),
            (None, Projections::Fused) => t.push(Qkv),
        }
        let num_layers = self.moe.as_ref().map_or(1, |m| m.sparse_layers.len());
        let any_dense = (0..num_layers).any(|i| !self.is_sparse(i));
        match self.gate_up {
            Projections::Split if any_dense => t.extend([Gate, Up, Down]),
            Projections::Fused if any_dense => t.extend([GateUp, Down]),
            _ => {}
        }
        if let Some(moe) = self.moe.as_ref().filter(|m| m.sparse_count() > 0) {
            t.push(Router);
            match moe.storage {
                ExpertStorage::PerExpert => t.extend([ExpertGate, ExpertUp, ExpertDown]),
                ExpertStorage::Stacked => t.extend([ExpertsGateUp, ExpertsDown]),
            }
            if moe.shared_intermediate.is_some() {
                t.extend([SharedGate, SharedUp, SharedDown]);
                if moe.shared_gated {
                    t.push(SharedExpertGate);
                }
            }
        }
        if self.qk_norm != QkNorm::None {
            t.extend([QNorm, KNorm]);
        }
        if self.attn_sinks {
            t.push(Sinks);
        }
        t
    }

    /// Whether layer `i`'s MLP is a mixture of experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(i))
    }

    /// Picks the naming a checkpoint uses: the first root whose
    /// `embed_tokens.weight` it holds.
    pub fn names(&self, contains: impl Fn(&str) -> bool) -> Result<TensorNames> {
        for &(root, head) in self.roots {
            if contains(&format!("{root}embed_tokens.weight")) {
                return Ok(TensorNames {
                    root,
                    head,
                    spec: self.clone(),
                });
            }
        }
        let tried: Vec<String> = self
            .roots
            .iter()
            .map(|(root, _)| format!("`{root}embed_tokens.weight`"))
            .collect();
        Err(EngineError::InvalidCheckpoint(format!(
            "no embedding tensor: expected one of {}",
            tried.join(", ")
        )))
    }

    /// How layer `layer` attends, given the config's per-layer windows.
    pub fn layer_attention(&self, window: Option<usize>) -> LayerAttention {
        LayerAttention {
            window,
            local_rope: window.is_some() && self.local_rope.is_some(),
        }
    }
}

/// The tensor names of one checkpoint (its family's names under the root
/// the checkpoint uses).
#[derive(Debug, Clone)]
pub struct TensorNames {
    root: &'static str,
    head: &'static str,
    spec: ArchSpec,
}

impl TensorNames {
    /// `{root}embed_tokens.weight`.
    pub fn embed(&self) -> String {
        format!("{}embed_tokens.weight", self.root)
    }

    /// `{root}norm.weight`.
    pub fn final_norm(&self) -> String {
        format!("{}norm.weight", self.root)
    }

    /// The output head's weight.
    pub fn lm_head(&self) -> String {
        format!("{}.weight", self.head)
    }

    /// Module path of layer `i`'s tensor `t` (a linear layer's prefix for
    /// `.weight` / `.bias` / `.qweight`).
    pub fn layer(&self, i: usize, t: LayerTensor) -> Result<String> {
        let module = self
            .spec
            .layer_module(t)
            .ok_or_else(|| EngineError::Unsupported(format!("this family has no {t:?} tensor")))?;
        Ok(format!("{}layers.{i}.{module}", self.root))
    }

    /// Module path of expert `e`'s tensor `t` in layer `i` (the `*` of the
    /// family's name replaced by `e`).
    pub fn expert(&self, i: usize, e: usize, t: LayerTensor) -> Result<String> {
        Ok(self.layer(i, t)?.replacen('*', &e.to_string(), 1))
    }

    /// Layer `i`'s weight tensor for `t` (norms).
    pub fn layer_weight(&self, i: usize, t: LayerTensor) -> Result<String> {
        Ok(format!("{}.weight", self.layer(i, t)?))
    }
}

/// What a family file hands the registry.
#[derive(Debug)]
pub struct Family {
    /// The `architectures` class names it reads, with the engine's name.
    pub classes: &'static [(&'static str, Architecture)],
    /// Whether the family's text config is nested under `text_config`
    /// (multimodal checkpoints).
    pub nested_text_config: fn(&str) -> bool,
    /// `head_dim` when the config leaves it out (transformers' default for
    /// the family); `None`: `hidden_size / num_attention_heads`.
    pub default_head_dim: Option<usize>,
    /// A config key whose value is the rotary `head_dim` wherever the
    /// config says otherwise (DeepSeek's `qk_rope_head_dim`: its RoPE
    /// turns only that part of each query).
    pub head_dim_key: Option<&'static str>,
    /// `tie_word_embeddings` when the config leaves it out.
    pub tied_by_default: bool,
    /// Rope types this family's published configs spell otherwise:
    /// (their spelling, transformers' name).
    pub rope_aliases: &'static [(&'static str, &'static str)],
    /// Builds the description from the (text) config.
    pub describe: fn(&FamilyInput<'_>) -> Result<ArchSpec>,
    /// Per-layer sliding windows when the config has no `layer_types`.
    pub default_windows: fn(&FamilyInput<'_>) -> Result<Vec<Option<usize>>>,
}

/// The parts of a config every family's description may depend on.
#[derive(Debug)]
pub struct FamilyInput<'a> {
    pub json: &'a Value,
    pub architecture: Architecture,
    /// The class named in `architectures`.
    pub class: &'a str,
    pub hidden_size: usize,
    pub head_dim: usize,
    pub num_layers: usize,
}

impl FamilyInput<'_> {
    /// A float field, if present and not null.
    pub fn f64(&self, key: &str) -> Option<f64> {
        self.json.get(key).and_then(Value::as_f64)
    }

    /// An integer field, if present and not null.
    pub fn usize(&self, key: &str) -> Option<usize> {
        self.json
            .get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
    }

    /// A string field, if present and not null.
    pub fn str(&self, key: &str) -> Option<&str> {
        self.json.get(key).and_then(Value::as_str)
    }

    /// The activation: `hidden_activation` (Gemma) or `hidden_act`, else
    /// `default`.
    pub fn activation(&self, default: Activation) -> Result<Activation> {
        match self
            .str("hidden_activation")
            .or_else(|| self.str("hidden_act"))
        {
            Some(name) => Activation::from_hf(name),
            None => Ok(default),
        }
    }

    /// `head_dim^-0.5`, the usual attention scale.
    pub fn default_attn_scale(&self) -> f32 {
        (self.head_dim as f64).powf(-0.5) as f32
    }
}

/// Every family the engine runs.
pub const FAMILIES: &[&Family] = &[
    &llama::FAMILY,
    &qwen3::FAMILY,
    &gemma::FAMILY,
    &phi3::FAMILY,
    &olmo2::FAMILY,
    &granite::FAMILY,
    &mixtral::FAMILY,
    &qwen_moe::FAMILY,
    &gpt_oss::FAMILY,
    &deepseek::FAMILY,
];

/// The family and engine architecture of a Hugging Face class name.
pub fn lookup(class: &str) -> Option<(&'static Family, Architecture)> {
    FAMILIES.iter().find_map(|f| {
        f.classes
            .iter()
            .find(|(name, _)| *name == class)
            .map(|&(_, arch)| (*f, arch))
    })
}

/// Every class name the engine runs, for error messages.
pub fn supported_classes() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.classes.iter().map(|&(name, _)| name))
        .collect()
}

/// A family with no multimodal classes.
pub(crate) fn never_nested(_: &str) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_required_tensor_has_a_name_in_every_family() {
        // What the mixture-of-experts families cannot do without.
        let json = serde_json::json!({
            "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
            "intermediate_size": 64, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "n_routed_experts": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": 24,
            "n_group": 2, "topk_group": 1,
        });
        for family in FAMILIES {
            for &(class, architecture) in family.classes {
                let input = FamilyInput {
                    json: &json,
                    architecture,
                    class,
                    hidden_size: 64,
                    head_dim: 16,
                    num_layers: 2,
                };
                let spec = (family.describe)(&input).expect("describe with defaults");
                for t in spec.required_layer_tensors() {
                    assert!(spec.layer_module(t).is_some(), "{class}: no name for {t:?}");
                }
                assert!(!spec.roots.is_empty(), "{class}: no root");
            }
        }
    }

    #[test]
    fn class_names_are_unique() {
        let names = supported_classes();
        for (i, a) in names.iter().enumerate() {
            assert!(!names[i + 1..].contains(a), "{a} listed twice");
        }
    }

    #[test]
    fn unknown_activation_is_refused_by_name() {
        let err = Activation::from_hf("relu2").expect_err("refused");
        assert!(err.to_string().contains("relu2"), "{err}");
    }
}
