//! Gemma 2 and Gemma 3 (text): sandwich norms with `(1 + w)` weights,
//! GELU-tanh MLPs, embeddings scaled by `sqrt(hidden_size)`, attention
//! scaled by `query_pre_attn_scalar^-0.5`, and layers alternating between a
//! sliding window and global attention.
//!
//! Gemma 2 soft-caps attention scores and final logits (`cap · tanh(x /
//! cap)`). Gemma 3 drops the caps (unless the config sets them), adds a
//! per-head q/k RMSNorm, and rotates its sliding-window layers with their
//! own RoPE base (`rope_local_base_freq`, or `rope_parameters`'
//! `sliding_attention` entry), unscaled, while the global layers carry the
//! long-context scaling.
//!
//! A `Gemma3ForConditionalGeneration` checkpoint (text + vision) is served
//! as its text tower: the config is its `text_config`, the tensors live
//! under `model.language_model.` (transformers 5) or
//! `language_model.model.` (the published checkpoints); images are not
//! served.

use serde_json::Value;

use super::{
    Activation, ArchSpec, Family, FamilyInput, LayerTensor, NormPlacement, Projections, QkNorm,
    RopeParams,
};
use crate::config::{rope_params, Architecture};
use crate::error::{EngineError, Result};

const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::AttnNorm, "input_layernorm"),
    (LayerTensor::Q, "self_attn.q_proj"),
    (LayerTensor::K, "self_attn.k_proj"),
    (LayerTensor::V, "self_attn.v_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::QNorm, "self_attn.q_norm"),
    (LayerTensor::KNorm, "self_attn.k_norm"),
    (LayerTensor::AttnOutNorm, "post_attention_layernorm"),
    (LayerTensor::MlpNorm, "pre_feedforward_layernorm"),
    (LayerTensor::MlpOutNorm, "post_feedforward_layernorm"),
    (LayerTensor::Gate, "mlp.gate_proj"),
    (LayerTensor::Up, "mlp.up_proj"),
    (LayerTensor::Down, "mlp.down_proj"),
];

/// The text model's own names, then the text tower of a multimodal
/// checkpoint as transformers 5 saves it and as published.
const ROOTS: &[(&str, &str)] = &[
    ("model.", "lm_head"),
    ("model.language_model.", "lm_head"),
    ("language_model.model.", "language_model.lm_head"),
];

const MULTIMODAL: &str = "Gemma3ForConditionalGeneration";

pub static FAMILY: Family = Family {
    classes: &[
        ("Gemma2ForCausalLM", Architecture::Gemma2),
        ("Gemma3ForCausalLM", Architecture::Gemma3),
        (MULTIMODAL, Architecture::Gemma3),
    ],
    nested_text_config: |class| class == MULTIMODAL,
    // Gemma2Config's and Gemma3TextConfig's default.
    default_head_dim: Some(256),
    head_dim_key: None,
    tied_by_default: true,
    rope_aliases: &[],
    describe,
    default_windows,
};

/// A soft-cap field: absent means the class default, null means none.
fn cap(c: &FamilyInput<'_>, key: &str, default: Option<f64>) -> Result<Option<f32>> {
    let v =
        match c.json.get(key) {
            None => default,
            Some(Value::Null) => None,
            Some(v) => Some(v.as_f64().ok_or_else(|| {
                EngineError::InvalidCheckpoint(format!("`{key}` is not a number"))
            })?),
        };
    match v {
        Some(x) if x <= 0.0 => Err(EngineError::InvalidCheckpoint(format!(
            "`{key}` is {x}; a soft cap must be positive"
        ))),
        v => Ok(v.map(|x| x as f32)),
    }
}

/// Gemma 3's sliding-window RoPE: `rope_parameters.sliding_attention`
/// (transformers 5) or `rope_local_base_freq` (published configs).
fn local_rope(c: &FamilyInput<'_>) -> Result<RopeParams> {
    let nested = c
        .json
        .get("rope_parameters")
        .and_then(|p| p.get("sliding_attention"))
        .filter(|p| p.is_object());
    let theta = c.f64("rope_local_base_freq").unwrap_or(10_000.0);
    rope_params(nested, theta, c.json, &[])
}

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    let gemma3 = c.architecture == Architecture::Gemma3;
    if c.json
        .get("use_bidirectional_attention")
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Err(EngineError::Unsupported(
            "use_bidirectional_attention (an embedding-model Gemma; tandem serves causal decoders)"
                .into(),
        ));
    }
    let scalar = c.f64("query_pre_attn_scalar").unwrap_or(256.0);
    if scalar <= 0.0 {
        return Err(EngineError::InvalidCheckpoint(format!(
            "query_pre_attn_scalar is {scalar}; it must be positive"
        )));
    }
    // Gemma 2 caps by default; Gemma 3 does not.
    let (attn_cap, final_cap) = match gemma3 {
        true => (None, None),
        false => (Some(50.0), Some(30.0)),
    };
    Ok(ArchSpec {
        layer_names: LAYER_NAMES,
        roots: ROOTS,
        qkv: Projections::Split,
        gate_up: Projections::Split,
        norm: NormPlacement::Sandwich,
        norm_offset: 1.0,
        activation: c.activation(Activation::GeluTanh)?,
        embed_scale: Some((c.hidden_size as f64).sqrt() as f32),
        qk_norm: match gemma3 {
            true => QkNorm::PerHead,
            false => QkNorm::None,
        },
        attn_scale: scalar.powf(-0.5) as f32,
        residual_scale: None,
        logits_divisor: None,
        attn_softcap: cap(c, "attn_logit_softcapping", attn_cap)?,
        final_softcap: cap(c, "final_logit_softcapping", final_cap)?,
        local_rope: match gemma3 {
            true => Some(local_rope(c)?),
            false => None,
        },
        text_tower_of: (c.class == MULTIMODAL).then_some(MULTIMODAL),
        moe: None,
        attn_sinks: false,
        mla: None,
    })
}

/// Without `layer_types`: every `sliding_window_pattern`-th layer is global
/// (Gemma 2: every 2nd; Gemma 3: every 6th), the others slide.
fn default_windows(c: &FamilyInput<'_>) -> Result<Vec<Option<usize>>> {
    let pattern = match c.architecture {
        Architecture::Gemma3 => c.usize("sliding_window_pattern").unwrap_or(6),
        _ => 2,
    };
    if pattern == 0 {
        return Err(EngineError::InvalidCheckpoint(
            "sliding_window_pattern is 0".into(),
        ));
    }
    let window = c.usize("sliding_window").unwrap_or(4096);
    Ok((0..c.num_layers)
        .map(|i| ((i + 1) % pattern != 0).then_some(window))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn input<'a>(json: &'a Value, architecture: Architecture, class: &'a str) -> FamilyInput<'a> {
        FamilyInput {
            json,
            architecture,
            class,
            hidden_size: 64,
            head_dim: 256,
            num_layers: 12,
        }
    }

    #[test]
    fn gemma2_caps_by_default_and_null_turns_them_off() {
        let j = json!({});
        let s = describe(&input(&j, Architecture::Gemma2, "Gemma2ForCausalLM")).expect("spec");
        assert_eq!((s.attn_softcap, s.final_softcap), (Some(50.0), Some(30.0)));
        assert!(s.qk_norm == QkNorm::None && s.local_rope.is_none());
        let j = json!({"attn_logit_softcapping": null, "final_logit_softcapping": 15.0});
        let s = describe(&input(&j, Architecture::Gemma2, "Gemma2ForCausalLM")).expect("spec");
        assert_eq!((s.attn_softcap, s.final_softcap), (None, Some(15.0)));
    }

    #[test]
    fn gemma3_local_rope_both_spellings() {
        let legacy = json!({"rope_local_base_freq": 10000.0, "rope_theta": 1e6});
        let v5 = json!({"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}});
        let a = describe(&input(&legacy, Architecture::Gemma3, "Gemma3ForCausalLM")).expect("a");
        let b = describe(&input(&v5, Architecture::Gemma3, "Gemma3ForCausalLM")).expect("b");
        assert_eq!(a.local_rope, b.local_rope);
        assert_eq!(a.local_rope.map(|r| r.theta), Some(10000.0));
        assert!(a.qk_norm == QkNorm::PerHead && a.attn_softcap.is_none());
        assert_eq!(a.attn_scale, 1.0 / 16.0);
    }

    #[test]
    fn legacy_pattern_gives_five_local_layers_per_global_one() {
        let j = json!({"sliding_window": 512});
        let w = default_windows(&input(&j, Architecture::Gemma3, "Gemma3ForCausalLM")).expect("w");
        let globals: Vec<usize> = (0..12).filter(|&i| w[i].is_none()).collect();
        assert_eq!(globals, vec![5, 11]);
        assert_eq!(w[0], Some(512));
        let w = default_windows(&input(&j, Architecture::Gemma2, "Gemma2ForCausalLM")).expect("w");
        assert_eq!(&w[..3], &[Some(512), None, Some(512)]);
    }

    #[test]
    fn bidirectional_gemma_is_refused() {
        let j = json!({"use_bidirectional_attention": true});
        let err = describe(&input(&j, Architecture::Gemma3, "Gemma3ForCausalLM")).expect_err("no");
        assert!(
            err.to_string().contains("use_bidirectional_attention"),
            "{err}"
        );
    }
}
