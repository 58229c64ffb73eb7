//! Deterministic random-weight checkpoints in Hugging Face format.
//!
//! `tandem gen-model` writes `config.json`, `generation_config.json`,
//! `model.safetensors`, a byte-level BPE `tokenizer.json` and a
//! `tokenizer_config.json` with a chat template, so tests and
//! benchmarks need no downloads. The same preset and seed always give the
//! same bytes. Weights follow Hugging Face's Llama initialisation
//! (normal, std = `initializer_range`), norms are ones.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::error::{EngineError, Result};
use crate::lora::normal;
use crate::sampling::Rng;
use crate::weights::DType;

/// The chat template of generated models (written to their
/// `tokenizer_config.json`): each message on its own line as `role: text`,
/// ended by EOS, after one BOS.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

/// The shape of a generated model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// Make every MLP a mixture of experts: a Qwen3-MoE checkpoint (per-head
    /// q/k norms, `mlp.gate` router, `mlp.experts.{e}.*`) instead of Llama.
    pub experts: Option<SynthExperts>,
    /// Multi-head latent attention instead of q/k/v: a DeepSeek-V3
    /// checkpoint whose MLPs are all dense (`first_k_dense_replace` is the
    /// layer count; `experts` must be `None`).
    pub latent: Option<SynthLatent>,
}

/// The latent attention of a generated DeepSeek-V3 model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthLatent {
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

/// The experts of a generated mixture-of-experts model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthExperts {
    pub num_experts: usize,
    pub top_k: usize,
    /// Each expert's intermediate features.
    pub intermediate_size: usize,
}

/// Named presets: `(name, description, config)`.
pub fn presets() -> Vec<(&'static str, &'static str, SynthConfig)> {
    let tiny = SynthConfig {
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        vocab_size: 512,
        max_position_embeddings: 512,
        rope_theta: 10000.0,
        tie_word_embeddings: false,
        experts: None,
        latent: None,
    };
    let bench = SynthConfig {
        hidden_size: 768,
        intermediate_size: 2048,
        num_layers: 12,
        num_heads: 12,
        num_kv_heads: 4,
        vocab_size: 8000,
        max_position_embeddings: 4096,
        rope_theta: 10000.0,
        tie_word_embeddings: false,
        experts: None,
        latent: None,
    };
    vec![
        (
            "tiny",
            "64 hidden, 2 layers, GQA 4:2, 512 vocab (~0.2M params): unit tests",
            tiny.clone(),
        ),
        (
            "tiny-mqa",
            "as tiny with one KV head and tied embeddings",
            SynthConfig {
                num_kv_heads: 1,
                tie_word_embeddings: true,
                ..tiny.clone()
            },
        ),
        (
            "small",
            "256 hidden, 4 layers, GQA 8:4, 2048 vocab (~4M params): quick demos",
            SynthConfig {
                hidden_size: 256,
                intermediate_size: 688,
                num_layers: 4,
                num_heads: 8,
                num_kv_heads: 4,
                vocab_size: 2048,
                max_position_embeddings: 2048,
                ..tiny
            },
        ),
        (
            "bench-100m",
            "768 hidden, 12 layers, GQA 12:4, 8000 vocab (~88M params): performance work",
            bench.clone(),
        ),
        (
            "bench-smol",
            "576 hidden, 30 layers, GQA 9:3, 49152 vocab, tied (~135M params): \
             SmolLM2-135M's shape, deep and narrow with a large head",
            SynthConfig {
                hidden_size: 576,
                intermediate_size: 1536,
                num_layers: 30,
                num_heads: 9,
                num_kv_heads: 3,
                vocab_size: 49152,
                max_position_embeddings: 2048,
                rope_theta: 100000.0,
                tie_word_embeddings: true,
                ..bench.clone()
            },
        ),
        (
            "tiny-moe",
            "as tiny, a Qwen3-MoE: 8 experts of 64 features, 2 per token",
            SynthConfig {
                experts: Some(SynthExperts {
                    num_experts: 8,
                    top_k: 2,
                    intermediate_size: 64,
                }),
                ..tiny.clone()
            },
        ),
        (
            "bench-moe",
            "as bench-100m, a Qwen3-MoE: 80 experts of 128 features, 8 per token \
             (~314M params, ~60M active): moe-bench",
            SynthConfig {
                experts: Some(SynthExperts {
                    num_experts: 80,
                    top_k: 8,
                    intermediate_size: 128,
                }),
                ..bench.clone()
            },
        ),
        (
            "tiny-mla",
            "as tiny with 2048 positions, a DeepSeek-V3 with latent attention \
             (a 40-wide latent per token and layer): KV transfer tests",
            SynthConfig {
                max_position_embeddings: 2048,
                latent: Some(SynthLatent {
                    q_lora_rank: 32,
                    kv_lora_rank: 32,
                    qk_nope_head_dim: 16,
                    qk_rope_head_dim: 8,
                    v_head_dim: 16,
                }),
                ..tiny.clone()
            },
        ),
        (
            "bench-mla",
            "as bench-100m, a DeepSeek-V3 with latent attention (a 224-wide latent \
             per token and layer against bench-100m's 2 × 4 × 64): kv-transfer-bench",
            SynthConfig {
                latent: Some(SynthLatent {
                    q_lora_rank: 384,
                    kv_lora_rank: 192,
                    qk_nope_head_dim: 64,
                    qk_rope_head_dim: 32,
                    v_head_dim: 64,
                }),
                ..bench
            },
        ),
    ]
}

/// Looks a preset up by name.
pub fn preset(name: &str) -> Result<SynthConfig> {
    presets()
        .into_iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, c)| c)
        .ok_or_else(|| {
            let names: Vec<&str> = presets().iter().map(|p| p.0).collect();
            EngineError::InvalidRequest(format!(
                "unknown model preset `{name}` (known: {})",
                names.join(", ")
            ))
        })
}

const BOS: u32 = 256;
const EOS: u32 = 257;

impl SynthConfig {
    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// The dense model that reads as many parameters per token: each MLP
    /// `top_k × expert features` wide (a mixture's own shape otherwise).
    pub fn dense_equivalent(&self) -> Self {
        let mut dense = self.clone();
        if let Some(x) = dense.experts.take() {
            dense.intermediate_size = x.top_k * x.intermediate_size;
        }
        dense
    }

    /// Parameters of the model (every expert's): every tensor it writes.
    pub fn num_params(&self) -> usize {
        self.tensors()
            .iter()
            .map(|(_, shape, _)| shape.iter().product::<usize>())
            .sum()
    }

    fn config_json(&self, dtype: DType) -> Value {
        let mut c = self.llama_config_json(dtype);
        if let Some(m) = self.latent {
            let mla = json!({
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "num_key_value_heads": self.num_heads,
                "head_dim": m.qk_rope_head_dim,
                "q_lora_rank": m.q_lora_rank,
                "kv_lora_rank": m.kv_lora_rank,
                "qk_nope_head_dim": m.qk_nope_head_dim,
                "qk_rope_head_dim": m.qk_rope_head_dim,
                "v_head_dim": m.v_head_dim,
                "rope_interleave": true,
                // Every layer dense: the experts' fields are there because
                // the config class has them, and unused.
                "first_k_dense_replace": self.num_layers,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "n_shared_experts": 1,
                "n_group": 1,
                "topk_group": 1,
                "routed_scaling_factor": 1.0,
                "norm_topk_prob": true,
                "num_nextn_predict_layers": 0,
            });
            for (k, v) in mla.as_object().into_iter().flatten() {
                c[k] = v.clone();
            }
        }
        if let Some(x) = self.experts {
            let moe = json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "num_experts": x.num_experts,
                "num_experts_per_tok": x.top_k,
                "moe_intermediate_size": x.intermediate_size,
                "norm_topk_prob": true,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            });
            for (k, v) in moe.as_object().into_iter().flatten() {
                c[k] = v.clone();
            }
        }
        c
    }

    fn llama_config_json(&self, dtype: DType) -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim(),
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": false,
            "mlp_bias": false,
            "initializer_range": 0.02,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "torch_dtype": match dtype { DType::F32 => "float32", DType::Bf16 => "bfloat16", DType::F16 => "float16" },
        })
    }

    fn tensors(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (h, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let (q, kv) = (self.num_heads * d, self.num_kv_heads * d);
        // (name, shape, is a norm weight)
        let mut t = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
            false,
        )];
        for l in 0..self.num_layers {
            let p = format!("model.layers.{l}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h], true));
            match self.latent {
                None => {
                    t.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h], false));
                    t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h], false));
                    t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h], false));
                    t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q], false));
                }
                Some(m) => t.extend(self.latent_tensors(&p, m)),
            }
            t.push((
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                true,
            ));
            match self.experts {
                None => t.extend(mlp_tensors(&format!("{p}.mlp"), h, i)),
                Some(x) => {
                    t.push((format!("{p}.self_attn.q_norm.weight"), vec![d], true));
                    t.push((format!("{p}.self_attn.k_norm.weight"), vec![d], true));
                    t.push((
                        format!("{p}.mlp.gate.weight"),
                        vec![x.num_experts, h],
                        false,
                    ));
                    for e in 0..x.num_experts {
                        let expert = format!("{p}.mlp.experts.{e}");
                        t.extend(mlp_tensors(&expert, h, x.intermediate_size));
                    }
                }
            }
        }
        t.push(("model.norm.weight".to_string(), vec![h], true));
        if !self.tie_word_embeddings {
            t.push((
                "lm_head.weight".to_string(),
                vec![self.vocab_size, h],
                false,
            ));
        }
        t
    }

    /// One layer's latent attention tensors (DeepSeek-V3's names).
    fn latent_tensors(&self, p: &str, m: SynthLatent) -> Vec<(String, Vec<usize>, bool)> {
        let (h, heads) = (self.hidden_size, self.num_heads);
        let attn = |name: &str, shape: Vec<usize>, norm: bool| {
            (format!("{p}.self_attn.{name}.weight"), shape, norm)
        };
        let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
        vec![
            attn("q_a_proj", vec![m.q_lora_rank, h], false),
            attn("q_a_layernorm", vec![m.q_lora_rank], true),
            attn("q_b_proj", vec![heads * qk, m.q_lora_rank], false),
            attn(
                "kv_a_proj_with_mqa",
                vec![m.kv_lora_rank + m.qk_rope_head_dim, h],
                false,
            ),
            attn("kv_a_layernorm", vec![m.kv_lora_rank], true),
            attn(
                "kv_b_proj",
                vec![heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
                false,
            ),
            attn("o_proj", vec![h, heads * m.v_head_dim], false),
        ]
    }

    /// Writes the checkpoint into `dir` (created if needed).
    pub fn write(&self, dir: &Path, seed: u64, dtype: DType) -> Result<()> {
        self.write_scaled(dir, seed, dtype, |_| 1.0)
    }

    /// As [`SynthConfig::write`], with each weight matrix multiplied by
    /// `scale(name)` (norms are left at one). Damping the residual outputs
    /// (`o_proj`, `down_proj`) of later layers makes a model whose first
    /// layers already decide its tokens: an aligned target for an
    /// early-exit draft in the speculative-decoding benchmark.
    pub fn write_scaled(
        &self,
        dir: &Path,
        seed: u64,
        dtype: DType,
        scale: impl Fn(&str) -> f32,
    ) -> Result<()> {
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_heads)
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
            || self.vocab_size < 258
            || (self.latent.is_some() && self.experts.is_some())
        {
            return Err(EngineError::InvalidRequest(format!(
                "inconsistent model shape {self:?}"
            )));
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EngineError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut rng = Rng::seeded(seed);
        let mut buffers = Vec::new();
        for (name, shape, is_norm) in self.tensors() {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if is_norm {
                vec![1.0; n]
            } else {
                let s = 0.02 * scale(&name);
                (0..n).map(|_| s * normal(&mut rng)).collect()
            };
            let bytes: Vec<u8> = match dtype {
                DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                DType::Bf16 => values
                    .iter()
                    .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                    .collect(),
                DType::F16 => values
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            };
            buffers.push((name, shape, bytes));
        }
        let st_dtype = match dtype {
            DType::F32 => Dtype::F32,
            DType::Bf16 => Dtype::BF16,
            DType::F16 => Dtype::F16,
        };
        let mut views = BTreeMap::new();
        for (name, shape, bytes) in &buffers {
            let view = TensorView::new(st_dtype, shape.clone(), bytes)
                .map_err(|e| EngineError::InvalidCheckpoint(e.to_string()))?;
            views.insert(name.clone(), view);
        }
        let weights_path = dir.join("model.safetensors");
        safetensors::serialize_to_file(&views, None, &weights_path)
            .map_err(|e| EngineError::InvalidCheckpoint(format!("writing weights: {e}")))?;

        let write_json = |name: &str, v: &Value| {
            let path = dir.join(name);
            let text = serde_json::to_string_pretty(v).map_err(|source| EngineError::Json {
                path: path.clone(),
                source,
            })?;
            std::fs::write(&path, text).map_err(io(&path))
        };
        write_json("config.json", &self.config_json(dtype))?;
        write_json(
            "generation_config.json",
            &json!({"bos_token_id": BOS, "eos_token_id": EOS}),
        )?;
        write_json("tokenizer.json", &byte_level_tokenizer(self.vocab_size))?;
        write_json(
            "tokenizer_config.json",
            &json!({
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": true,
                "chat_template": CHAT_TEMPLATE,
            }),
        )?;
        Ok(())
    }
}

/// A gated MLP's three projections under `prefix`.
fn mlp_tensors(prefix: &str, h: usize, i: usize) -> [(String, Vec<usize>, bool); 3] {
    [
        (format!("{prefix}.gate_proj.weight"), vec![i, h], false),
        (format!("{prefix}.up_proj.weight"), vec![i, h], false),
        (format!("{prefix}.down_proj.weight"), vec![h, i], false),
    ]
}

/// GPT-2's reversible byte → printable-char map used by byte-level BPE.
fn byte_to_char() -> Vec<char> {
    let mut direct: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut out = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if let Some(pos) = direct.iter().position(|&d| d == b) {
            direct.remove(pos);
            out[b as usize] = char::from_u32(b).unwrap_or('?');
        } else {
            out[b as usize] = char::from_u32(256 + extra).unwrap_or('?');
            extra += 1;
        }
    }
    out
}

/// A byte-level BPE tokenizer: ids 0–255 are bytes, 256 `<s>`, 257 `</s>`,
/// and the rest of the vocabulary is filled with merges of printable ASCII
/// pairs, so every id decodes to some text.
fn byte_level_tokenizer(vocab_size: usize) -> Value {
    let chars = byte_to_char();
    let mut vocab = serde_json::Map::new();
    for (b, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let mut merges = Vec::new();
    let printable: Vec<char> = (32u8..=126).map(|b| chars[b as usize]).collect();
    let mut next = 258;
    'fill: for &a in &printable {
        for &b in &printable {
            if next >= vocab_size {
                break 'fill;
            }
            vocab.insert(format!("{a}{b}"), json!(next));
            merges.push(format!("{a} {b}"));
            next += 1;
        }
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(BOS, "<s>"), special(EOS, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges
        }
    })
}
