//! Model configuration, parsed from a Hugging Face `config.json`.
//!
//! Published checkpoints and transformers 5 disagree on a few spellings
//! (`rope_theta` + `rope_scaling` versus `rope_parameters`, `torch_dtype`
//! versus `dtype`); both are accepted and normalised into [`ModelConfig`], so
//! nothing downstream sees the difference.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::arch::{self, ArchSpec, FamilyInput, RopeParams};
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvLayout, KvRows, SlidingLayers};

/// The model families the engine runs. What each does differently is
/// described by its [`ArchSpec`] (`crate::arch`), built from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    Olmo2,
    Granite,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    GptOss,
    DeepseekV2,
    DeepseekV3,
}

impl Architecture {
    /// The Hugging Face class name, as written in `config.json` (the text
    /// model's, for a multimodal checkpoint served as its text tower).
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Gemma2 => "Gemma2ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Phi3 => "Phi3ForCausalLM",
            Self::Olmo2 => "Olmo2ForCausalLM",
            Self::Granite => "GraniteForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Qwen2Moe => "Qwen2MoeForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::GptOss => "GptOssForCausalLM",
            Self::DeepseekV2 => "DeepseekV2ForCausalLM",
            Self::DeepseekV3 => "DeepseekV3ForCausalLM",
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
    /// YaRN (Qwen, DeepSeek): each frequency blended between kept and
    /// divided by `factor`, by a ramp over the dimensions that turn between
    /// `beta_slow` and `beta_fast` times in the original context; queries
    /// and keys scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Whether the ramp's ends are rounded to whole dimensions.
        truncate: bool,
        attention_factor: f64,
    },
    /// Dynamic NTK: from the original context on, theta grows with the
    /// sequence length (`theta · (factor·len/orig − (factor−1))^(d/(d−2))`).
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    /// LongRoPE (Phi-3 128k, Phi-3.5): a divisor per frequency,
    /// `short_factor` within the original context and `long_factor` from
    /// it on; queries and keys scaled by `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// What rotated queries and keys are multiplied by (YaRN, LongRoPE:
    /// transformers scales cos and sin); attention scores by its square.
    pub fn attention_factor(&self) -> f64 {
        match self {
            Self::Yarn {
                attention_factor, ..
            }
            | Self::LongRope {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// Whether a position's frequencies depend on the position (LongRoPE,
    /// dynamic NTK): one table of frequencies does not describe them.
    pub fn position_dependent(&self) -> bool {
        matches!(self, Self::Dynamic { .. } | Self::LongRope { .. })
    }

    /// Checks the scaling against the rotated head size.
    fn check(&self, head_dim: usize) -> Result<()> {
        if let Self::LongRope {
            short_factor,
            long_factor,
            ..
        } = self
        {
            for (name, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if f.len() != head_dim / 2 {
                    return Err(EngineError::InvalidCheckpoint(format!(
                        "longrope `{name}` has {} entries; head_dim {head_dim} needs {}",
                        f.len(),
                        head_dim / 2
                    )));
                }
                if f.iter().any(|x| !x.is_finite() || *x <= 0.0) {
                    return Err(EngineError::InvalidCheckpoint(format!(
                        "longrope `{name}` has a non-positive entry"
                    )));
                }
            }
        }
        Ok(())
    }
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
    /// What this family does differently from a plain Llama.
    pub arch: ArchSpec,
}

#[derive(Deserialize)]
struct RawConfig {
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
    partial_rotary_factor: Option<f64>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
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

/// RoPE theta and scaling from one parameter object (`rope_scaling`, or a
/// `rope_parameters` entry), `theta` when the object has none; `config`
/// (the whole text config) gives the context lengths scalings refer to.
pub(crate) fn rope_params(
    params: Option<&Value>,
    theta: f64,
    config: &Value,
    aliases: &[(&str, &str)],
) -> Result<RopeParams> {
    let theta = params
        .and_then(|p| field_f64(p, "rope_theta"))
        .unwrap_or(theta);
    let Some(scaling) = params else {
        return Ok(RopeParams {
            theta,
            scaling: RopeScaling::None,
        });
    };
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let kind = aliases
        .iter()
        .find(|(alias, _)| *alias == kind)
        .map_or(kind, |&(_, name)| name);
    let need = |key: &str| {
        field_f64(scaling, key)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| {
                EngineError::InvalidCheckpoint(format!(
                    "rope scaling `{kind}` needs a positive `{key}`"
                ))
            })
    };
    let max_position =
        field_f64(config, "max_position_embeddings").unwrap_or(default_max_pos() as f64);
    let scaling = match kind {
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
        "yarn" => yarn(scaling, config, max_position)?,
        "dynamic" => RopeScaling::Dynamic {
            factor: need("factor")?,
            // transformers measures the original context by
            // max_position_embeddings for dynamic NTK.
            original_max_position_embeddings: max_position as usize,
        },
        "longrope" => longrope(scaling, config, max_position)?,
        other => {
            return Err(EngineError::Unsupported(format!(
                "rope scaling type `{other}` (supported: default, linear, llama3, yarn, dynamic, longrope)"
            )))
        }
    };
    Ok(RopeParams { theta, scaling })
}

/// `0.1 · m · ln(s) + 1`, YaRN's attention temperature (1 for `s ≤ 1`).
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// The pretraining context a YaRN or LongRoPE scaling refers to, as
/// transformers 5 resolves it: the config's own
/// `original_max_position_embeddings` (Phi-3 writes it at the top level),
/// else the parameters', else `max_position_embeddings`.
fn original_context(p: &Value, config: &Value, max_position: f64) -> f64 {
    field_f64(config, "original_max_position_embeddings")
        .or_else(|| field_f64(p, "original_max_position_embeddings"))
        .filter(|o| *o > 0.0)
        .unwrap_or(max_position)
}

/// The scaling factor: the parameters' `factor`, else (DeepSeek-V3,
/// Phi-3) `max_position_embeddings / original`.
fn context_factor(p: &Value, original: f64, max_position: f64) -> f64 {
    field_f64(p, "factor").unwrap_or(max_position / original)
}

/// YaRN: the attention factor, unless given, comes from `mscale` /
/// `mscale_all_dim` or the factor alone.
fn yarn(p: &Value, config: &Value, max_position: f64) -> Result<RopeScaling> {
    let original = original_context(p, config, max_position);
    let factor = context_factor(p, original, max_position);
    if !(factor.is_finite() && factor > 0.0) {
        return Err(EngineError::InvalidCheckpoint(format!(
            "rope scaling `yarn` has factor {factor}; it must be positive"
        )));
    }
    let attention_factor = match field_f64(p, "attention_factor") {
        Some(a) => a,
        None => match (field_f64(p, "mscale"), field_f64(p, "mscale_all_dim")) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                yarn_mscale(factor, m) / yarn_mscale(factor, all)
            }
            _ => yarn_mscale(factor, 1.0),
        },
    };
    let beta = |key: &str, default: f64| field_f64(p, key).filter(|b| *b != 0.0).unwrap_or(default);
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: beta("beta_fast", 32.0),
        beta_slow: beta("beta_slow", 1.0),
        truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
        attention_factor,
    })
}

/// LongRoPE: the attention factor, unless given, is
/// `sqrt(1 + ln(factor) / ln(original))` (1 for a factor ≤ 1).
fn longrope(p: &Value, config: &Value, max_position: f64) -> Result<RopeScaling> {
    let factors = |key: &str| -> Result<Vec<f64>> {
        p.get(key)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_f64).collect::<Vec<_>>())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                EngineError::InvalidCheckpoint(format!("rope scaling `longrope` lacks `{key}`"))
            })
    };
    let original = original_context(p, config, max_position);
    let factor = context_factor(p, original, max_position);
    let attention_factor = field_f64(p, "attention_factor").unwrap_or(if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / original.ln()).sqrt()
    });
    Ok(RopeScaling::LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original as usize,
        attention_factor,
    })
}

/// The global layers' RoPE: transformers 5 folds theta and scaling into
/// `rope_parameters` (per layer type for Gemma 3: its `full_attention`
/// entry); published checkpoints carry `rope_theta` + `rope_scaling`.
fn parse_rope(raw: &RawConfig, config: &Value, aliases: &[(&str, &str)]) -> Result<RopeParams> {
    let params = raw.rope_parameters.as_ref().filter(|v| v.is_object());
    let params = params.map(|p| {
        p.get("full_attention")
            .filter(|f| f.is_object())
            .unwrap_or(p)
    });
    let legacy = raw.rope_scaling.as_ref().filter(|v| v.is_object());
    // Rotating only part of each head (Phi-4-mini, GPT-NeoX style) needs a
    // kernel that leaves the rest alone: refused by name.
    let partial = raw
        .partial_rotary_factor
        .or_else(|| params.and_then(|p| field_f64(p, "partial_rotary_factor")));
    if let Some(f) = partial.filter(|&f| f != 1.0) {
        return Err(EngineError::Unsupported(format!(
            "partial_rotary_factor {f} (rotary embeddings over part of each head)"
        )));
    }
    let theta = raw
        .rope_theta
        .or_else(|| params.and_then(|p| field_f64(p, "rope_theta")))
        .unwrap_or(10000.0);
    rope_params(legacy.or(params), theta, config, aliases)
}

/// A multimodal checkpoint's text config (`text_config`), with the
/// top-level keys it leaves out (token ids, tying) filled in.
fn text_config(value: &Value) -> Result<Value> {
    let mut text = value
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or_else(|| {
            EngineError::InvalidCheckpoint("a multimodal config.json without `text_config`".into())
        })?;
    if let (Some(obj), Some(top)) = (text.as_object_mut(), value.as_object()) {
        for (k, v) in top {
            if k != "text_config" && k != "vision_config" && !obj.contains_key(k) {
                obj.insert(k.clone(), v.clone());
            }
        }
        // The class that names the family stays the multimodal one.
        if let Some(a) = top.get("architectures") {
            obj.insert("architectures".into(), a.clone());
        }
    }
    Ok(text)
}

impl ModelConfig {
    /// Reads and validates `config.json` in a checkpoint directory.
    ///
    /// A path to a `.gguf` file reads its metadata instead
    /// ([`crate::gguf::config_json`]).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if crate::gguf::is_gguf(dir) {
            return Self::from_json(&crate::gguf::config_json(&crate::gguf::open(dir)?)?);
        }
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
        let class = value
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| {
                EngineError::InvalidCheckpoint("config.json has no `architectures`".into())
            })?
            .to_owned();
        let (family, architecture) = arch::lookup(&class).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "architecture `{class}` (supported: {})",
                arch::supported_classes().join(", ")
            ))
        })?;
        let nested;
        let value = match (family.nested_text_config)(&class) {
            true => {
                nested = text_config(value)?;
                &nested
            }
            false => value,
        };
        let raw: RawConfig = serde_json::from_value(value.clone())
            .map_err(|e| EngineError::InvalidCheckpoint(format!("config.json: {e}")))?;
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
        let head_dim = family
            .head_dim_key
            .and_then(|key| value.get(key).and_then(Value::as_u64))
            .map(|d| d as usize)
            .or(raw.head_dim)
            .or(family.default_head_dim)
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "head_dim {head_dim} must be even and positive for rotary embeddings"
            )));
        }
        let rope = parse_rope(&raw, value, family.rope_aliases)?;
        rope.scaling.check(head_dim)?;
        let input = FamilyInput {
            json: value,
            architecture,
            class: &class,
            hidden_size: raw.hidden_size,
            head_dim,
            num_layers: raw.num_hidden_layers,
        };
        let spec = (family.describe)(&input)?;
        if let Some(local) = &spec.local_rope {
            local.scaling.check(head_dim)?;
        }
        let sliding_window = match &raw.layer_types {
            Some(types) => layer_windows(&raw, types)?,
            None => (family.default_windows)(&input)?,
        };
        let tie_word_embeddings = raw.tie_word_embeddings.unwrap_or(family.tied_by_default);
        // Latent attention's absorbed form is multi-query attention over one
        // latent "head": a tensor-parallel split replicates it on every rank
        // as it does any single KV head.
        let num_kv_heads = match spec.mla {
            Some(_) => 1,
            None => num_kv_heads,
        };
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
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            tie_word_embeddings,
            sliding_window,
            bos_token_id: token_ids(raw.bos_token_id.as_ref()).first().copied(),
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            arch: spec,
        })
    }

    /// The longest sequence the model serves: `max_position_embeddings`,
    /// or for scalings that extend past it (as vLLM reads them), the
    /// extended length: dynamic NTK `max_position_embeddings · factor`,
    /// YaRN `original · factor` where that is longer.
    pub fn max_context(&self) -> usize {
        let extended = match &self.rope_scaling {
            RopeScaling::Dynamic { factor, .. } => self.max_position_embeddings as f64 * factor,
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } => original_max_position_embeddings * factor,
            _ => 0.0,
        };
        self.max_position_embeddings.max(extended as usize)
    }

    /// Query heads that share one KV head.
    pub fn gqa_group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// What the KV cache of this model holds per token and layer: the kind
    /// of row, rows (KV heads, or one latent), and each row's width.
    pub fn kv_rows(&self) -> (KvRows, usize, usize) {
        match &self.arch.mla {
            Some(m) => (KvRows::Latent, 1, m.latent_width()),
            None => (KvRows::PerHead, self.num_kv_heads, self.head_dim),
        }
    }

    /// Cached values one token occupies in one layer: K and V of every KV
    /// head, or one latent.
    pub fn kv_values_per_token_layer(&self) -> usize {
        let (rows, heads, width) = self.kv_rows();
        let pools = match rows {
            KvRows::PerHead => 2,
            KvRows::Latent => 1,
        };
        pools * heads * width
    }

    /// Bytes of K and V one token occupies across all layers, in f32.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.num_layers * self.kv_values_per_token_layer() * std::mem::size_of::<f32>()
    }

    /// The KV layout of the whole (unsharded) model for `block_size`, every
    /// sliding layer marked.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        let (rows, num_kv_heads, head_dim) = self.kv_rows();
        KvLayout {
            num_layers: self.num_layers,
            num_kv_heads,
            head_dim,
            block_size,
            sliding: SlidingLayers::from_windows(self.sliding_window.iter().copied()),
            rows,
        }
    }
}

/// Per-layer windows from `layer_types` (transformers 5 writes it for
/// every family with sliding layers).
fn layer_windows(raw: &RawConfig, types: &[String]) -> Result<Vec<Option<usize>>> {
    let n = raw.num_hidden_layers;
    if types.len() != n {
        return Err(EngineError::InvalidCheckpoint(format!(
            "layer_types has {} entries for {n} layers",
            types.len()
        )));
    }
    types
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
        .collect()
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
    fn extending_scalings_extend_the_context() {
        let mut c = base();
        c["max_position_embeddings"] = json!(4096);
        assert_eq!(
            ModelConfig::from_json(&c).expect("plain").max_context(),
            4096
        );
        c["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 2.0});
        assert_eq!(
            ModelConfig::from_json(&c).expect("dynamic").max_context(),
            8192
        );
        // YaRN: an explicit factor wins over max / original (transformers 5).
        c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 2048});
        let y = ModelConfig::from_json(&c).expect("yarn");
        assert_eq!(y.max_context(), 8192);
        let RopeScaling::Yarn {
            factor,
            attention_factor,
            ..
        } = y.rope_scaling
        else {
            panic!("{:?}", y.rope_scaling);
        };
        assert_eq!(factor, 4.0);
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        // Without a factor, the ratio (DeepSeek-V3's configs).
        c["rope_scaling"] = json!({"rope_type": "yarn", "original_max_position_embeddings": 1024});
        let y = ModelConfig::from_json(&c).expect("yarn by ratio");
        assert!(matches!(y.rope_scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
        c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512});
        assert_eq!(
            ModelConfig::from_json(&c).expect("llama3").max_context(),
            4096
        );
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
