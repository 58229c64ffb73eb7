//! The CUDA model's reading of the engine's architecture description
//! (`tandem_engine::arch`): which families its kernels run, and which
//! checkpoint tensors its loader fuses into which device matrices.
//!
//! Host code, tested without a GPU. The kernels run the Llama skeleton
//! (pre-norm RMSNorm, SiLU, q/k/v and gate/up fused, any attention scale,
//! per-layer sliding windows) and per-head q/k RMSNorm (Qwen3); a
//! description that needs more is refused here, by the name of each missing
//! feature, before anything is uploaded.

use tandem_engine::arch::{
    Activation, LayerTensor, NormPlacement, Projections, QkNorm, TensorNames,
};
use tandem_engine::ModelConfig;

use crate::error::CudaError;

/// The features of `config`'s family that have no CUDA kernel yet.
pub fn missing_features(config: &ModelConfig) -> Vec<&'static str> {
    let s = &config.arch;
    let mut missing = Vec::new();
    match s.norm {
        NormPlacement::Pre => {}
        NormPlacement::Sandwich => {
            missing.push("sandwich norms (RMSNorm on attention and MLP outputs)")
        }
        NormPlacement::Post => {
            missing.push("post-norm blocks (RMSNorm on attention and MLP outputs only)")
        }
    }
    match s.qk_norm {
        QkNorm::None => {}
        QkNorm::PerHead => {}
        QkNorm::Full => missing.push("whole-projection q/k RMSNorm"),
    }
    if s.residual_scale.is_some() {
        missing.push("residual scaling");
    }
    if s.mla.is_some() {
        missing.push("multi-head latent attention");
    }
    if s.logits_divisor.is_some() {
        missing.push("logit scaling");
    }
    if config.rope_scaling.position_dependent() {
        missing.push("position-dependent RoPE frequencies (longrope, dynamic)");
    }
    match s.activation {
        Activation::Silu => {}
        Activation::GeluTanh => missing.push("GELU-tanh MLP activation"),
        Activation::ClampedSwiglu { .. } => missing.push("clamped SwiGLU activation"),
    }
    if s.embed_scale.is_some() {
        missing.push("embedding scaling");
    }
    if s.attn_softcap.is_some() {
        missing.push("attention-logit soft-capping");
    }
    if s.final_softcap.is_some() {
        missing.push("final-logit soft-capping");
    }
    if s.local_rope.is_some() {
        missing.push("a separate RoPE base for sliding-window layers");
    }
    if s.moe.is_some() {
        missing.push("mixture-of-experts layers");
    }
    if s.attn_sinks {
        missing.push("attention sinks");
    }
    missing
}

/// Refuses a family the kernels cannot run, naming what is missing.
pub fn check_supported(config: &ModelConfig) -> Result<(), CudaError> {
    let missing = missing_features(config);
    if missing.is_empty() {
        return Ok(());
    }
    Err(CudaError::Unsupported(format!(
        "{} on the CUDA backend: no kernel yet for {} (run it with --device cpu)",
        config.architecture.hf_name(),
        missing.join(", ")
    )))
}

/// Tensors concatenated row-wise into one `[rows, cols]` device matrix:
/// each part's weight name and rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fused {
    /// (module path, rows); the weight is `{path}.weight`, the optional
    /// bias `{path}.bias`.
    pub parts: Vec<(String, usize)>,
    pub cols: usize,
}

impl Fused {
    fn new(parts: Vec<(String, usize)>, cols: usize) -> Self {
        Self { parts, cols }
    }

    /// Rows of the fused matrix.
    pub fn rows(&self) -> usize {
        self.parts.iter().map(|(_, r)| r).sum()
    }

    /// Each part's `(weight name, rows)`.
    pub fn weights(&self) -> Vec<(String, usize)> {
        self.parts
            .iter()
            .map(|(p, r)| (format!("{p}.weight"), *r))
            .collect()
    }

    /// Each part's `(bias name, rows)`.
    pub fn biases(&self) -> Vec<(String, usize)> {
        self.parts
            .iter()
            .map(|(p, r)| (format!("{p}.bias"), *r))
            .collect()
    }
}

/// What the CUDA loader uploads for one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlan {
    /// RMSNorm weights (`hidden_size` long) before attention and the MLP.
    pub attn_norm: String,
    pub mlp_norm: String,
    /// Per-head q and k RMSNorm weights (`head_dim` long), if the family
    /// has them.
    pub qk_norm: Option<(String, String)>,
    pub qkv: Fused,
    pub o: Fused,
    pub gate_up: Fused,
    pub down: Fused,
}

/// The tensors of layer `i`, fused as the kernels want them.
pub fn layer_plan(c: &ModelConfig, names: &TensorNames, i: usize) -> Result<LayerPlan, CudaError> {
    use LayerTensor as T;
    let (h, d, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (q_out, kv_out) = (c.num_heads * d, c.num_kv_heads * d);
    let part = |t: T, rows: usize| -> Result<(String, usize), CudaError> {
        Ok((names.layer(i, t)?, rows))
    };
    Ok(LayerPlan {
        attn_norm: names.layer_weight(i, T::AttnNorm)?,
        mlp_norm: names.layer_weight(i, T::MlpNorm)?,
        qk_norm: match c.arch.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead | QkNorm::Full => Some((
                names.layer_weight(i, T::QNorm)?,
                names.layer_weight(i, T::KNorm)?,
            )),
        },
        // Already fused in the checkpoint (Phi-3): the same rows in the
        // same order (q, k, v; gate, up) as the fused device matrix.
        qkv: match c.arch.qkv {
            Projections::Split => Fused::new(
                vec![part(T::Q, q_out)?, part(T::K, kv_out)?, part(T::V, kv_out)?],
                h,
            ),
            Projections::Fused => Fused::new(vec![part(T::Qkv, q_out + 2 * kv_out)?], h),
        },
        o: Fused::new(vec![part(T::O, h)?], q_out),
        gate_up: match c.arch.gate_up {
            Projections::Split => Fused::new(vec![part(T::Gate, inter)?, part(T::Up, inter)?], h),
            Projections::Fused => Fused::new(vec![part(T::GateUp, 2 * inter)?], h),
        },
        down: Fused::new(vec![part(T::Down, h)?], inter),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn config(arch: &str, extra: Value) -> ModelConfig {
        let mut v = json!({
            "architectures": [arch],
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 100,
        });
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        ModelConfig::from_json(&v).expect("config")
    }

    #[test]
    fn llama_plan_fuses_the_llama_names_with_their_shapes() {
        let c = config("LlamaForCausalLM", json!({}));
        check_supported(&c).expect("llama runs on CUDA");
        let names = c
            .arch
            .names(|n| n == "model.embed_tokens.weight")
            .expect("names");
        let p = layer_plan(&c, &names, 1).expect("plan");
        assert_eq!(p.attn_norm, "model.layers.1.input_layernorm.weight");
        assert_eq!(p.mlp_norm, "model.layers.1.post_attention_layernorm.weight");
        assert_eq!(
            p.qkv.weights(),
            vec![
                ("model.layers.1.self_attn.q_proj.weight".to_string(), 64),
                ("model.layers.1.self_attn.k_proj.weight".to_string(), 32),
                ("model.layers.1.self_attn.v_proj.weight".to_string(), 32),
            ]
        );
        assert_eq!((p.qkv.rows(), p.qkv.cols), (128, 64));
        assert_eq!((p.o.rows(), p.o.cols), (64, 64));
        assert_eq!((p.gate_up.rows(), p.gate_up.cols), (192, 64));
        assert_eq!((p.down.rows(), p.down.cols), (64, 96));
        assert_eq!(
            p.gate_up.biases()[1].0,
            "model.layers.1.mlp.up_proj.bias".to_string()
        );
    }

    #[test]
    fn phi3_uploads_its_fused_tensors_whole() {
        let c = config("Phi3ForCausalLM", json!({}));
        check_supported(&c).expect("phi3 runs on CUDA");
        let names = c
            .arch
            .names(|n| n == "model.embed_tokens.weight")
            .expect("names");
        let p = layer_plan(&c, &names, 0).expect("plan");
        assert_eq!(
            p.qkv.weights(),
            vec![("model.layers.0.self_attn.qkv_proj.weight".to_string(), 128)]
        );
        assert_eq!(
            p.gate_up.weights(),
            vec![("model.layers.0.mlp.gate_up_proj.weight".to_string(), 192)]
        );
        assert_eq!((p.qkv.cols, p.gate_up.cols), (64, 64));
    }

    #[test]
    fn qwen3_runs_with_its_per_head_qk_norms() {
        let c = config("Qwen3ForCausalLM", json!({}));
        check_supported(&c).expect("Qwen3 runs on CUDA");
        let names = c
            .arch
            .names(|n| n == "model.embed_tokens.weight")
            .expect("names");
        let p = layer_plan(&c, &names, 1).expect("plan");
        assert_eq!(
            p.qk_norm,
            Some((
                "model.layers.1.self_attn.q_norm.weight".to_string(),
                "model.layers.1.self_attn.k_norm.weight".to_string()
            ))
        );
        let llama = config("LlamaForCausalLM", json!({}));
        let names = llama.arch.names(|_| true).expect("names");
        assert_eq!(layer_plan(&llama, &names, 0).expect("plan").qk_norm, None);
    }

    #[test]
    fn gemma_families_name_every_missing_feature() {
        let g2 = missing_features(&config("Gemma2ForCausalLM", json!({})));
        for want in [
            "sandwich norms",
            "GELU-tanh",
            "embedding scaling",
            "attention-logit soft-capping",
            "final-logit soft-capping",
        ] {
            assert!(g2.iter().any(|m| m.contains(want)), "{want} in {g2:?}");
        }
        assert!(!g2.iter().any(|m| m.contains("q/k")), "{g2:?}");
        let g3 = missing_features(&config("Gemma3ForCausalLM", json!({})));
        assert!(g3.iter().any(|m| m.contains("sandwich norms")), "{g3:?}");
        assert!(
            !g3.iter().any(|m| m.contains("q/k")),
            "its q/k norms run: {g3:?}"
        );
        assert!(g3.iter().any(|m| m.contains("RoPE base")), "{g3:?}");
        assert!(!g3.iter().any(|m| m.contains("soft-capping")), "{g3:?}");
    }

    #[test]
    fn olmo2_and_granite_name_what_they_lack_and_yarn_runs() {
        let o = missing_features(&config("Olmo2ForCausalLM", json!({})));
        assert!(o.iter().any(|m| m.contains("post-norm")), "{o:?}");
        assert!(
            o.iter().any(|m| m.contains("whole-projection q/k")),
            "{o:?}"
        );
        let g = missing_features(&config(
            "GraniteForCausalLM",
            json!({"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                   "logits_scaling": 8.0, "attention_multiplier": 0.01}),
        ));
        for want in ["embedding scaling", "residual scaling", "logit scaling"] {
            assert!(g.iter().any(|m| m.contains(want)), "{want} in {g:?}");
        }
        // YaRN is one table of frequencies and an attention scale: it runs.
        let yarn = config(
            "LlamaForCausalLM",
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        );
        check_supported(&yarn).expect("yarn runs on CUDA");
        let long = config(
            "Phi3ForCausalLM",
            json!({"original_max_position_embeddings": 64, "max_position_embeddings": 256,
                   "rope_scaling": {"rope_type": "longrope",
                   "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                   "long_factor": [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]}}),
        );
        let m = missing_features(&long);
        assert!(m.iter().any(|m| m.contains("position-dependent")), "{m:?}");
    }

    #[test]
    fn a_multimodal_text_tower_is_planned_under_its_root() {
        let c = config(
            "Gemma3ForConditionalGeneration",
            json!({"text_config": {
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 100}}),
        );
        let names = c
            .arch
            .names(|n| n == "language_model.model.embed_tokens.weight")
            .expect("names");
        let p = layer_plan(&c, &names, 0).expect("plan");
        assert_eq!(
            p.attn_norm,
            "language_model.model.layers.0.input_layernorm.weight"
        );
        assert_eq!(
            p.mlp_norm,
            "language_model.model.layers.0.pre_feedforward_layernorm.weight"
        );
        assert!(check_supported(&c).is_err());
    }
}
