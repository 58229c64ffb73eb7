//! Model configuration, parsed from a Hugging Face `config.json`.
//!
//! Published checkpoints and transformers 5 disagree on a few spellings
//! (`rope_theta` + `rope_scaling` versus `rope_parameters`, `torch_dtype`
//! versus `dtype`); both are accepted and normalised into [`ModelConfig`], so
//! nothing downstream sees the difference.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{EngineError, Result};

/// The model families the engine runs. All are Llama-shaped decoders; they
/// differ only in details captured by [`ModelConfig`] fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
}

impl Architecture {
    fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Self::Llama),
            "MistralForCausalLM" => Some(Self::Mistral),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The Hugging Face class name, as written in `config.json`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// How rotary frequencies are scaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's piecewise scaling of low and medium frequencies.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// A normalised model configuration.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Per layer: the sliding attention window, if that layer has one.
    pub sliding_window: Vec<Option<usize>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
}

fn default_max_pos() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}

/// Reads and parses one JSON file of a checkpoint.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| EngineError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// Token ids may be written as one integer, a list, or null.
pub(crate) fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| v as u32).into_iter().collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect(),
        _ => Vec::new(),
    }
}

fn field_f64(obj: &Value, key: &str) -> Option<f64> {
    obj.get(key).and_then(Value::as_f64)
}

fn parse_rope(raw: &RawConfig) -> Result<(f64, RopeScaling)> {
    // transformers 5 folds theta and scaling into `rope_parameters`;
    // published checkpoints carry `rope_theta` + `rope_scaling`.
    let params = raw.rope_parameters.as_ref().filter(|v| v.is_object());
    let scaling = raw
        .rope_scaling
        .as_ref()
        .filter(|v| v.is_object())
        .or(params);
    let theta = raw
        .rope_theta
        .or_else(|| params.and_then(|p| field_f64(p, "rope_theta")))
        .unwrap_or(10000.0);
    let Some(scaling) = scaling else {
        return Ok((theta, RopeScaling::None));
    };
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |key: &str| {
        field_f64(scaling, key).ok_or_else(|| {
            EngineError::InvalidCheckpoint(format!("rope scaling `{kind}` lacks `{key}`"))
        })
    };
    let rope = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        },
        other => {
            return Err(EngineError::Unsupported(format!(
                "rope scaling type `{other}` (supported: default, linear, llama3)"
            )))
        }
    };
    Ok((theta, rope))
}

impl ModelConfig {
    /// Reads and validates `config.json` in a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(EngineError::MissingFile {
                path,
                what: "a Hugging Face checkpoint needs config.json",
            });
        }
        Self::from_json(&read_json(&path)?)
    }

    /// Builds a config from the parsed JSON of a `config.json`.
    pub fn from_json(value: &Value) -> Result<Self> {
        let raw: RawConfig = serde_json::from_value(value.clone())
            .map_err(|e| EngineError::InvalidCheckpoint(format!("config.json: {e}")))?;
        let arch_name = raw.architectures.first().ok_or_else(|| {
            EngineError::InvalidCheckpoint("config.json has no `architectures`".into())
        })?;
        let architecture = Architecture::from_hf_name(arch_name).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "architecture `{arch_name}` (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"
            ))
        })?;
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(EngineError::Unsupported(format!(
                    "hidden_act `{act}` (only silu)"
                )));
            }
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if raw.num_attention_heads == 0 || num_kv_heads == 0 {
            return Err(EngineError::InvalidCheckpoint(
                "attention needs at least one head".into(),
            ));
        }
        if !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv_heads}",
                raw.num_attention_heads
            )));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "head_dim {head_dim} must be even and positive for rotary embeddings"
            )));
        }
        let (rope_theta, rope_scaling) = parse_rope(&raw)?;
        let sliding_window = sliding_windows(&raw, architecture)?;
        let tie_word_embeddings = raw.tie_word_embeddings.unwrap_or(false);
        Ok(Self {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings,
            sliding_window,
            bos_token_id: token_ids(raw.bos_token_id.as_ref()).first().copied(),
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
        })
    }

    /// Query heads that share one KV head.
    pub fn gqa_group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Bytes of K and V one token occupies across all layers, in f32.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }
}

fn sliding_windows(raw: &RawConfig, arch: Architecture) -> Result<Vec<Option<usize>>> {
    let n = raw.num_hidden_layers;
    if let Some(types) = &raw.layer_types {
        if types.len() != n {
            return Err(EngineError::InvalidCheckpoint(format!(
                "layer_types has {} entries for {n} layers",
                types.len()
            )));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(None),
                "sliding_attention" => raw.sliding_window.map(Some).ok_or_else(|| {
                    EngineError::InvalidCheckpoint(
                        "sliding_attention layer without sliding_window".into(),
                    )
                }),
                other => Err(EngineError::Unsupported(format!("layer type `{other}`"))),
            })
            .collect();
    }
    Ok(match arch {
        Architecture::Llama => vec![None; n],
        Architecture::Mistral => vec![raw.sliding_window; n],
        Architecture::Qwen2 => {
            let from = raw.max_window_layers.unwrap_or(n);
            (0..n)
                .map(|i| {
                    (raw.use_sliding_window.unwrap_or(false) && i >= from)
                        .then_some(raw.sliding_window)
                        .flatten()
                })
                .collect()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        })
    }

    #[test]
    fn defaults_and_gqa() {
        let c = ModelConfig::from_json(&base()).expect("config");
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.gqa_group(), 2);
        assert_eq!(c.rope_scaling, RopeScaling::None);
        assert_eq!(c.rope_theta, 10000.0);
    }

    #[test]
    fn rope_parameters_and_legacy_spelling_agree() {
        let mut legacy = base();
        legacy["rope_theta"] = json!(500000.0);
        legacy["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let mut v5 = base();
        v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let a = ModelConfig::from_json(&legacy).expect("legacy");
        let b = ModelConfig::from_json(&v5).expect("v5");
        assert_eq!(a.rope_theta, b.rope_theta);
        assert_eq!(a.rope_scaling, b.rope_scaling);
        assert!(matches!(a.rope_scaling, RopeScaling::Llama3 { .. }));
    }

    #[test]
    fn unsupported_architecture_is_an_error() {
        let mut c = base();
        c["architectures"] = json!(["GPT2LMHeadModel"]);
        let err = ModelConfig::from_json(&c).expect_err("must fail");
        assert!(err.to_string().contains("GPT2LMHeadModel"), "{err}");
    }

    #[test]
    fn bad_head_ratio_is_an_error() {
        let mut c = base();
        c["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&c).is_err());
    }
}
