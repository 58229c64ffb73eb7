//! OLMo 2: a SiLU decoder whose RMSNorms sit on the outputs of attention
//! and of the MLP only (`post_attention_layernorm`,
//! `post_feedforward_layernorm`, before each residual add; nothing norms
//! their inputs), and whose q/k RMSNorms span the whole projection
//! (`num_heads * head_dim` wide for q), before the split into heads.

use super::{ArchSpec, Family, FamilyInput, LayerTensor, NormPlacement, QkNorm};
use crate::config::Architecture;
use crate::error::Result;

const LAYER_NAMES: &[(LayerTensor, &str)] = &[
    (LayerTensor::Q, "self_attn.q_proj"),
    (LayerTensor::K, "self_attn.k_proj"),
    (LayerTensor::V, "self_attn.v_proj"),
    (LayerTensor::O, "self_attn.o_proj"),
    (LayerTensor::QNorm, "self_attn.q_norm"),
    (LayerTensor::KNorm, "self_attn.k_norm"),
    (LayerTensor::AttnOutNorm, "post_attention_layernorm"),
    (LayerTensor::MlpOutNorm, "post_feedforward_layernorm"),
    (LayerTensor::Gate, "mlp.gate_proj"),
    (LayerTensor::Up, "mlp.up_proj"),
    (LayerTensor::Down, "mlp.down_proj"),
];

pub static FAMILY: Family = Family {
    classes: &[("Olmo2ForCausalLM", Architecture::Olmo2)],
    nested_text_config: super::never_nested,
    default_head_dim: None,
    head_dim_key: None,
    tied_by_default: false,
    rope_aliases: &[],
    describe,
    default_windows: |c| Ok(vec![None; c.num_layers]),
};

fn describe(c: &FamilyInput<'_>) -> Result<ArchSpec> {
    Ok(ArchSpec {
        norm: NormPlacement::Post,
        qk_norm: QkNorm::Full,
        ..ArchSpec::llama(LAYER_NAMES, c)?
    })
}

#[cfg(test)]
mod tests {
    use super::super::llama::LAYER_NAMES as LLAMA_NAMES;
    use super::*;

    #[test]
    fn olmo2_names_its_output_norms_where_llama_names_its_input_ones() {
        let json = serde_json::json!({});
        let input = FamilyInput {
            json: &json,
            architecture: Architecture::Olmo2,
            class: "Olmo2ForCausalLM",
            hidden_size: 64,
            head_dim: 16,
            num_layers: 2,
        };
        let spec = describe(&input).expect("spec");
        let required = spec.required_layer_tensors();
        assert!(!required.contains(&LayerTensor::AttnNorm));
        assert!(required.contains(&LayerTensor::MlpOutNorm));
        // The same module name, another role: Llama's MLP input norm is
        // OLMo 2's attention output norm.
        let llama_mlp_norm = LLAMA_NAMES
            .iter()
            .find(|(t, _)| *t == LayerTensor::MlpNorm)
            .map(|&(_, n)| n);
        assert_eq!(spec.layer_module(LayerTensor::AttnOutNorm), llama_mlp_norm);
    }
}
