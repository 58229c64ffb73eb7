//! Granite (IBM Granite 3.x dense): Llama's tensors with four scalars
//! (`embedding_multiplier` on the embeddings, `attention_multiplier` as
//! the attention scale in place of `head_dim^-0.5`, `residual_multiplier`
//! on every block's output before the residual add, and logits divided by
//! `logits_scaling`).

use super::llama::LAYER_NAMES;
use super::{ArchSpec, Family, FamilyInput};
use crate::config::Architecture;
use crate::error::{EngineError, Result};

pub static FAMILY: Family = Family {
    classes: &[("GraniteForCausalLM", Architecture::Granite)],
    nested_text_config: super::never_nested,
    default_head_dim: None,
    head_dim_key: None,
    tied_by_default: false,
    rope_aliases: &[],
    describe,
    default_windows: |c| Ok(vec![None; c.num_layers]),
};

/// A multiplier field (GraniteConfig's default is 1.0): finite and
/// positive, or the checkpoint is refused. `None` when it is 1.
fn multiplier(c: &FamilyInput<'_>, key: &str) -> Result<Option<f32>> {
    let Some(v) = c.json.get(key).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match v.as_f64() {
        Some(x) if x.is_finite() && x > 0.0 => Ok((x != 1.0).then_some(x as f32)),
        _ => Err(EngineError::InvalidCheckpoint(format!(
            "`{key}` is {v}; it must be a positive number"
        ))),
    }
}

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    let base = ArchSpec::llama(LAYER_NAMES, c)?;
    Ok(ArchSpec {
        embed_scale: multiplier(c, "embedding_multiplier")?,
        attn_scale: multiplier(c, "attention_multiplier")?.unwrap_or(1.0),
        residual_scale: multiplier(c, "residual_multiplier")?,
        logits_divisor: multiplier(c, "logits_scaling")?,
        ..base
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(json: &serde_json::Value) -> Result<ArchSpec> {
        describe(&FamilyInput {
            json,
            architecture: Architecture::Granite,
            class: "GraniteForCausalLM",
            hidden_size: 64,
            head_dim: 16,
            num_layers: 2,
        })
    }

    #[test]
    fn granite_reads_its_four_multipliers() {
        let s = spec(&json!({
            "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
            "residual_multiplier": 0.22, "logits_scaling": 8.0,
        }))
        .expect("spec");
        assert_eq!(s.embed_scale, Some(12.0));
        assert_eq!(s.attn_scale, 0.0078125);
        assert_eq!(s.residual_scale, Some(0.22));
        assert_eq!(s.logits_divisor, Some(8.0));
        // GraniteConfig's defaults: every multiplier 1, including the
        // attention scale (not head_dim^-0.5).
        let d = spec(&json!({})).expect("defaults");
        assert_eq!(
            (d.embed_scale, d.residual_scale, d.logits_divisor),
            (None, None, None)
        );
        assert_eq!(d.attn_scale, 1.0);
    }

    #[test]
    fn a_non_positive_multiplier_is_refused_by_name() {
        let err = spec(&json!({"logits_scaling": 0.0})).expect_err("refused");
        assert!(err.to_string().contains("logits_scaling"), "{err}");
    }
}
