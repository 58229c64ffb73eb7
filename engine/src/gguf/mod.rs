//! GGUF checkpoints (llama.cpp's single-file format) read as the Hugging
//! Face checkpoints the rest of the engine knows.
//!
//! A GGUF file says the same things as a checkpoint directory in other
//! words: `general.architecture` and `{arch}.*` keys instead of
//! `config.json`, `blk.N.attn_q.weight` instead of
//! `model.layers.N.self_attn.q_proj.weight`, a vocabulary instead of
//! `tokenizer.json`. This module translates each into the Hugging Face
//! form ([`config_json`], [`hf_tensor_names`], [`tokenizer`]), so a family
//! stays one definition (`crate::arch`) whatever file it came from. What
//! llama.cpp's converter changed on the way is undone here: Llama's Q and
//! K rows are permuted for its interleaved RoPE ([`TensorMap::rope_rows`]),
//! Gemma's norms hold `1 + w` ([`TensorMap::shift`]), Llama 3.1's RoPE
//! scaling is stored as its result (`rope.rs`).
//!
//! Families: `llama`, `qwen2`, `qwen3`, `phi3`, `gemma2`, `gemma3`. Tensor
//! types and the path each takes are in [`crate::weights`].

mod gemma;
mod rope;
mod sentencepiece;
mod tokenizer;

use std::path::Path;

use serde_json::{json, Map, Value};
use tandem_gguf::Gguf;

pub use tandem_gguf::is_gguf;
pub use tokenizer::tokenizer;

use crate::error::{EngineError, Result};

/// Opens a GGUF file (any shard of a split), as an engine error.
pub fn open(path: &Path) -> Result<Gguf> {
    Gguf::open(path).map_err(|e| gguf_error(path, e))
}

pub(crate) fn gguf_error(path: &Path, e: tandem_gguf::GgufError) -> EngineError {
    EngineError::InvalidCheckpoint(format!("{}: {e}", path.display()))
}

/// A family as GGUF names it, with what its checkpoint class is.
struct Family {
    arch: &'static str,
    class: &'static str,
    /// llama.cpp's converter permuted Q/K rows for interleaved RoPE.
    permuted_rope: bool,
    /// The MLP's up tensor holds gate and up fused (Phi-3).
    fused_gate_up: bool,
    /// Gemma's sandwich norms, stored as `1 + w` ([`gemma`]).
    gemma: Option<gemma::Gemma>,
}

const FAMILIES: [Family; 6] = [
    Family {
        arch: "llama",
        class: "LlamaForCausalLM",
        permuted_rope: true,
        fused_gate_up: false,
        gemma: None,
    },
    Family {
        arch: "qwen2",
        class: "Qwen2ForCausalLM",
        permuted_rope: false,
        fused_gate_up: false,
        gemma: None,
    },
    Family {
        arch: "qwen3",
        class: "Qwen3ForCausalLM",
        permuted_rope: false,
        fused_gate_up: false,
        gemma: None,
    },
    Family {
        arch: "phi3",
        class: "Phi3ForCausalLM",
        permuted_rope: false,
        fused_gate_up: true,
        gemma: None,
    },
    Family {
        arch: "gemma2",
        class: "Gemma2ForCausalLM",
        permuted_rope: false,
        fused_gate_up: false,
        gemma: Some(gemma::GEMMA2),
    },
    Family {
        arch: "gemma3",
        class: "Gemma3ForCausalLM",
        permuted_rope: false,
        fused_gate_up: false,
        gemma: Some(gemma::GEMMA3),
    },
];

fn family(g: &Gguf) -> Result<&'static Family> {
    let arch = g
        .str("general.architecture")
        .map_err(|e| gguf_error(g.path(), e))?;
    FAMILIES.iter().find(|f| f.arch == arch).ok_or_else(|| {
        EngineError::Unsupported(format!(
            "{}: GGUF architecture `{arch}` (supported: {})",
            g.path().display(),
            FAMILIES.map(|f| f.arch).join(", ")
        ))
    })
}

/// The `config.json` a Hugging Face checkpoint of the same model would
/// have.
pub fn config_json(g: &Gguf) -> Result<Value> {
    let f = family(g)?;
    let err = |e| gguf_error(g.path(), e);
    let key = |k: &str| format!("{}.{k}", f.arch);
    let int = |k: &str| g.u64(&key(k)).map_err(err);
    let opt_int = |k: &str| {
        g.optional(&key(k), tandem_gguf::Value::as_u64, "an integer")
            .map_err(err)
    };
    let opt_f64 = |k: &str| {
        g.optional(&key(k), tandem_gguf::Value::as_f64, "a number")
            .map_err(err)
    };
    let hidden = int("embedding_length")?;
    let heads = int("attention.head_count")?;
    if heads == 0 || hidden == 0 {
        return Err(EngineError::InvalidCheckpoint(format!(
            "{}: {} heads over a hidden size of {hidden}",
            g.path().display(),
            heads
        )));
    }
    let head_dim = opt_int("attention.key_length")?.unwrap_or(hidden / heads);
    if head_dim == 0 {
        return Err(EngineError::InvalidCheckpoint(format!(
            "{}: a head size of 0",
            g.path().display()
        )));
    }
    let embed = g.tensor("token_embd.weight").ok_or_else(|| {
        EngineError::InvalidCheckpoint(format!("{}: no token_embd.weight", g.path().display()))
    })?;
    let vocab = opt_int("vocab_size")?.unwrap_or(embed.shape()[0] as u64);
    let mut c = Map::new();
    c.insert("architectures".into(), json!([f.class]));
    c.insert("model_type".into(), json!(f.arch));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert(
        "intermediate_size".into(),
        json!(int("feed_forward_length")?),
    );
    let layers = int("block_count")?;
    // Every layer has tensors: a count beyond the table is a damaged (or
    // hostile) header, refused before anything is sized by it.
    if layers == 0 || layers > g.tensors().count() as u64 {
        return Err(EngineError::InvalidCheckpoint(format!(
            "{}: block_count {layers} for {} tensors",
            g.path().display(),
            g.tensors().count()
        )));
    }
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert(
        "num_key_value_heads".into(),
        json!(opt_int("attention.head_count_kv")?.unwrap_or(heads)),
    );
    c.insert("head_dim".into(), json!(head_dim));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert(
        "max_position_embeddings".into(),
        json!(opt_int("context_length")?.unwrap_or(2048)),
    );
    if let Some(eps) = opt_f64("attention.layer_norm_rms_epsilon")? {
        c.insert("rms_norm_eps".into(), json!(eps));
    }
    c.insert(
        "tie_word_embeddings".into(),
        json!(g.tensor("output.weight").is_none()),
    );
    let mut rope = Map::new();
    rope.insert(
        "rope_theta".into(),
        json!(opt_f64("rope.freq_base")?.unwrap_or(10_000.0)),
    );
    rope.insert("rope_type".into(), json!("default"));
    if let Some(dims) = opt_int("rope.dimension_count")? {
        if dims != head_dim {
            rope.insert(
                "partial_rotary_factor".into(),
                json!(dims as f64 / head_dim as f64),
            );
        }
    }
    rope_scaling(g, f, &mut rope, &mut c)?;
    c.insert("rope_parameters".into(), Value::Object(rope));
    // 0 is the converter's "no window" (Phi-4 and longrope Phi-3).
    if let Some(w) = opt_int("attention.sliding_window")?.filter(|&w| w > 0) {
        c.insert("sliding_window".into(), json!(w));
    }
    if let Some(id) = g
        .optional(
            "tokenizer.ggml.bos_token_id",
            tandem_gguf::Value::as_u64,
            "a token id",
        )
        .map_err(err)?
    {
        c.insert("bos_token_id".into(), json!(id));
    }
    let ends = tokenizer::end_ids(g);
    if !ends.is_empty() {
        c.insert("eos_token_id".into(), json!(ends));
    }
    if let Some(spec) = &f.gemma {
        gemma::config(g, f.arch, spec, &mut c)?;
    }
    let stored_scaling = match rope_freqs(g, head_dim as usize)? {
        Some(llama3) => Some(llama3),
        None => longrope(g, f)?,
    };
    if let Some(Value::Object(scaling)) = stored_scaling {
        if let Some(Value::Object(rope)) = c.get_mut("rope_parameters") {
            rope.extend(scaling);
        }
    }
    Ok(Value::Object(c))
}

/// An F32 vector the file stores (RoPE factors); `None` when absent.
fn stored_vector(g: &Gguf, name: &str) -> Result<Option<Vec<f32>>> {
    let (Some(t), Some(bytes)) = (g.tensor(name), g.bytes(name)) else {
        return Ok(None);
    };
    if t.ty != tandem_gguf::GgmlType::F32 || t.dims.len() != 1 {
        return Err(EngineError::Unsupported(format!(
            "{}: {name} is a {} tensor of shape {:?}, not an F32 vector",
            g.path().display(),
            t.ty.name(),
            t.shape()
        )));
    }
    let mut v = vec![0.0f32; t.len()];
    tandem_gguf::dequantize(t.ty, bytes, &mut v);
    Ok(Some(v))
}

/// Llama 3.1's scaling from its stored divisors (`rope_freqs.weight`);
/// `None` without them, an error when no Llama 3.1 parameters make them.
fn rope_freqs(g: &Gguf, head_dim: usize) -> Result<Option<Value>> {
    let Some(stored) = stored_vector(g, "rope_freqs.weight")? else {
        return Ok(None);
    };
    let base = family(g)
        .and_then(|f| {
            g.f64(&format!("{}.rope.freq_base", f.arch))
                .map_err(|e| gguf_error(g.path(), e))
        })
        .unwrap_or(10_000.0);
    rope::llama3_parameters(base, head_dim, &stored)
        .map(Some)
        .ok_or_else(|| {
            EngineError::Unsupported(format!(
                "{}: rope_freqs.weight holds per-frequency RoPE divisors that no Llama 3.1 \
                 scaling parameters reproduce",
                g.path().display()
            ))
        })
}

/// Phi-3's LongRoPE (`rope_factors_long/short.weight`, one divisor per
/// frequency each) as `longrope` parameters; its attention factor is left
/// to the engine, which derives it from the two context lengths as
/// transformers does.
fn longrope(g: &Gguf, f: &Family) -> Result<Option<Value>> {
    let long = stored_vector(g, "rope_factors_long.weight")?;
    let short = stored_vector(g, "rope_factors_short.weight")?;
    let (long, short) = match (long, short) {
        (None, None) => return Ok(None),
        (Some(l), Some(s)) => (l, s),
        _ => {
            return Err(EngineError::InvalidCheckpoint(format!(
                "{}: one of rope_factors_long/short.weight without the other",
                g.path().display()
            )))
        }
    };
    let original = g
        .u64(&format!("{}.rope.scaling.original_context_length", f.arch))
        .map_err(|e| gguf_error(g.path(), e))?;
    Ok(Some(json!({
        "rope_type": "longrope",
        "long_factor": long,
        "short_factor": short,
        "original_max_position_embeddings": original,
    })))
}

/// `{arch}.rope.scaling.*` as `rope_parameters`.
fn rope_scaling(
    g: &Gguf,
    f: &Family,
    rope: &mut Map<String, Value>,
    c: &mut Map<String, Value>,
) -> Result<()> {
    let key = |k: &str| format!("{}.rope.scaling.{k}", f.arch);
    let err = |e| gguf_error(g.path(), e);
    let kind = g
        .optional(&key("type"), tandem_gguf::Value::as_str, "a string")
        .map_err(err)?;
    let factor = g
        .optional(&key("factor"), tandem_gguf::Value::as_f64, "a number")
        .map_err(err)?;
    let original = g
        .optional(
            &key("original_context_length"),
            tandem_gguf::Value::as_u64,
            "an integer",
        )
        .map_err(err)?;
    if let Some(o) = original {
        c.insert("original_max_position_embeddings".into(), json!(o));
    }
    match (kind, factor) {
        (None | Some("none"), _) => Ok(()),
        (Some(t @ ("linear" | "yarn")), Some(factor)) => {
            rope.insert("rope_type".into(), json!(t));
            rope.insert("factor".into(), json!(factor));
            if let Some(o) = original {
                rope.insert("original_max_position_embeddings".into(), json!(o));
            }
            Ok(())
        }
        (Some(t), _) => Err(EngineError::Unsupported(format!(
            "{}: RoPE scaling `{t}` from GGUF (linear and yarn with a factor are read)",
            g.path().display()
        ))),
    }
}

/// How the GGUF tensors become the Hugging Face ones.
#[derive(Debug, Clone)]
pub struct TensorMap {
    /// (Hugging Face name, GGUF name).
    pub names: Vec<(String, String)>,
    /// Q and K heads when their rows must be un-permuted (Llama).
    q_heads: Option<(usize, usize)>,
    /// What the converter added to every norm weight (Gemma's 1).
    norm_shift: f32,
}

impl TensorMap {
    /// What to subtract from tensor `hf_name` to get the checkpoint's
    /// weight back: Gemma's converter stored each norm as `1 + w`, and the
    /// family adds the 1 itself (`ArchSpec::norm_offset`).
    pub fn shift(&self, hf_name: &str) -> f32 {
        match hf_name.ends_with("norm.weight") {
            true => self.norm_shift,
            false => 0.0,
        }
    }

    /// For a tensor stored with llama.cpp's interleaved-RoPE row order,
    /// the stored row of each Hugging Face row; `None` for the others.
    pub fn rope_rows(&self, hf_name: &str, rows: usize) -> Option<Vec<usize>> {
        let (q_heads, kv_heads) = self.q_heads?;
        let heads = match hf_name.rsplit('.').nth(1)? {
            "q_proj" => q_heads,
            "k_proj" => kv_heads,
            _ => return None,
        };
        if heads == 0 || !rows.is_multiple_of(heads * 2) {
            return None;
        }
        let d = rows / heads;
        // The converter reshaped each head to (2, d/2) and swapped the
        // axes: Hugging Face row (h, j, i) is stored at h·d + 2i + j.
        Some(
            (0..rows)
                .map(|r| {
                    let (h, within) = (r / d, r % d);
                    let (j, i) = (within / (d / 2), within % (d / 2));
                    h * d + 2 * i + j
                })
                .collect(),
        )
    }
}

/// The Hugging Face name of every tensor in the file.
pub fn hf_tensor_names(g: &Gguf) -> Result<TensorMap> {
    let f = family(g)?;
    let mut names = Vec::new();
    for t in g.tensors() {
        let hf = hf_name(f, &t.name).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "{}: tensor `{}` has no meaning for a GGUF `{}` model here",
                g.path().display(),
                t.name,
                f.arch
            ))
        })?;
        names.push((hf, t.name.clone()));
    }
    let q_heads = match f.permuted_rope {
        true => {
            let c = config_json(g)?;
            let n = |k: &str| c.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
            Some((n("num_attention_heads"), n("num_key_value_heads")))
        }
        false => None,
    };
    Ok(TensorMap {
        names,
        q_heads,
        norm_shift: if f.gemma.is_some() { 1.0 } else { 0.0 },
    })
}

fn hf_name(f: &Family, gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        // Read into the config (Llama 3.1's and Phi-3's RoPE scaling).
        "rope_freqs.weight" | "rope_factors_long.weight" | "rope_factors_short.weight" => {
            return Some(gguf.into())
        }
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    if !matches!(kind, "weight" | "bias") {
        return None;
    }
    let gemma = f.gemma.is_some();
    let hf_module = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "post_ffw_norm" if gemma => "post_feedforward_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_qkv" => "self_attn.qkv_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" if f.fused_gate_up => "mlp.gate_up_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf_module}.{kind}"))
}

/// The chat template the file carries (`tokenizer.chat_template`).
pub fn chat_template(g: &Gguf) -> Option<String> {
    g.get("tokenizer.chat_template")
        .and_then(tandem_gguf::Value::as_str)
        .map(str::to_owned)
}

/// The model's name: the file name without `.gguf` (and without a split's
/// `-00001-of-0000N`).
pub fn model_name(path: &Path) -> String {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    match tandem_gguf::split_stem(stem) {
        Some((prefix, _)) => prefix.to_owned(),
        None => stem.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rows_undo_the_converters_permutation() {
        let map = TensorMap {
            names: vec![],
            q_heads: Some((2, 1)),
            norm_shift: 0.0,
        };
        // One head of 4 dims: HF rows (j, i) = (0,0) (0,1) (1,0) (1,1) are
        // stored at 2i + j = 0, 2, 1, 3.
        let k = map
            .rope_rows("model.layers.0.self_attn.k_proj.weight", 4)
            .expect("k");
        assert_eq!(k, [0, 2, 1, 3]);
        let q = map
            .rope_rows("model.layers.0.self_attn.q_proj.weight", 8)
            .expect("q");
        assert_eq!(q, [0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(
            map.rope_rows("model.layers.0.self_attn.v_proj.weight", 4),
            None
        );
    }

    #[test]
    fn split_names_drop_their_shard_suffix() {
        assert_eq!(
            model_name(Path::new("/m/Qwen3-8B-Q4_K_M-00001-of-00003.gguf")),
            "Qwen3-8B-Q4_K_M"
        );
        assert_eq!(model_name(Path::new("smollm2.gguf")), "smollm2");
    }
}
