//! Llama, Mistral and Qwen2: pre-norm decoders with SiLU MLPs.
//!
//! They differ only in data: biases are loaded when the checkpoint has them
//! (Qwen2's q/k/v, Llama's `attention_bias`), sliding windows come from the
//! config (Mistral: every layer; Qwen2: layers from `max_window_layers` on
//! when `use_sliding_window`), and a tied head reuses the embedding.

use super::{ArchSpec, Family, FamilyInput, LayerTensor};
use crate::config::Architecture;
use crate::error::Result;

/// The tensor names of a Llama-shaped layer (Qwen3 and Gemma reuse them).
pub const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::AttnNorm, "input_layernorm"),
    (LayerTensor::Q, "self_attn.q_proj"),
    (LayerTensor::K, "self_attn.k_proj"),
    (LayerTensor::V, "self_attn.v_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::MlpNorm, "post_attention_layernorm"),
    (LayerTensor::Gate, "mlp.gate_proj"),
    (LayerTensor::Up, "mlp.up_proj"),
    (LayerTensor::Down, "mlp.down_proj"),
];

/// `model.` root, `lm_head` head.
pub const ROOTS: &[(&str, &str)] = &[("model.", "lm_head")];

pub static FAMILY: Family = Family {
    classes: &[
        ("LlamaForCausalLM", Architecture::Llama),
        ("MistralForCausalLM", Architecture::Mistral),
        ("Qwen2ForCausalLM", Architecture::Qwen2),
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
    ArchSpec::llama(LAYER_NAMES, c)
}

/// Qwen2's rule, shared with Qwen3: with `use_sliding_window`, layers from
/// `max_window_layers` on have the window.
pub(crate) fn qwen_windows(c: &FamilyInput<'_>) -> Vec<Option<usize>> {
    let n = c.num_layers;
    let from = c.usize("max_window_layers").unwrap_or(n);
    let on = c
        .json
        .get("use_sliding_window")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    let window = c.usize("sliding_window");
    (0..n)
        .map(|i| (on && i >= from).then_some(window).flatten())
        .collect()
}

fn default_windows(c: &FamilyInput<'_>) -> Result<Vec<Option<usize>>> {
    let n = c.num_layers;
    Ok(match c.architecture {
        Architecture::Mistral => vec![c.usize("sliding_window"); n],
        Architecture::Qwen2 => qwen_windows(c),
        _ => vec![None; n],
    })
}
