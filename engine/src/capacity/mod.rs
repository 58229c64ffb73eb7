//! Capacity planning: how many KV blocks fit in a memory budget, and how many
//! sequences of full length can run at once.
//!
//! The budget is split three ways:
//!
//! ```text
//! memory = weights + activations + KV pool
//! ```
//!
//! * **Weights** are what the checkpoint stores ([`checkpoint_weight_bytes`]
//!   sums the tensor sizes in the safetensors headers without loading or
//!   mapping the data). The engine keeps weights in their stored dtype.
//! * **Activations** are the f32 buffers of one forward step of
//!   `max_num_batched_tokens` tokens ([`activation_bytes`]). Layers run one
//!   after another and reuse their buffers, so one layer's set is the peak.
//! * **The KV pool** is everything left, cut into blocks of `block_size`
//!   tokens; each token costs [`kv_bytes_per_token`] =
//!   `2 (K and V) × layers × kv_heads × head_dim × dtype bytes`.
//!
//! A sequence of `max_model_len` tokens needs `ceil(max_model_len /
//! block_size)` blocks, so at most `pool_blocks / that` such sequences fit at
//! once. A model whose layers mix sliding-window and global attention
//! (Gemma 2/3) keeps its blocks in layer groups ([`crate::KvGroups`]): a
//! block holds fewer layers, a sequence holds one block per group per
//! `block_size` tokens, and a windowed group keeps only its window's blocks,
//! so `blocks_per_seq` counts a long sequence's global groups in full and
//! its windowed ones at about `window / block_size + 1`. Shorter sequences and shared prefixes fit more; this is the
//! guaranteed floor. [`CapacityPlan::plan`] does the arithmetic and
//! [`Capacity`]'s `Display` is the one-line summary the engine logs at
//! start-up; `tandem plan` prints the same numbers as a table or JSON.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::config::ModelConfig;
use crate::kv_cache::KvCacheDtype;

mod params;
use crate::error::{EngineError, Result};
pub use params::{format_count, parameter_counts, weight_bytes_per_rank, ParamCounts};

/// Tokens per KV block unless told otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Most tokens in one forward step unless told otherwise.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;
/// Most sequences in one forward step unless told otherwise.
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;

/// Why a plan cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapacityError {
    /// The budget does not hold the weights and one step's activations.
    #[error(
        "a memory budget of {} cannot hold the weights ({}) plus the activations of one \
         {max_num_batched_tokens}-token step ({}); it needs more than {}: raise the memory or \
         lower max_num_batched_tokens / max_num_seqs",
        format_bytes(*memory), format_bytes(*weights), format_bytes(*activations),
        format_bytes(weights.saturating_add(*activations))
    )]
    InsufficientMemory {
        memory: u64,
        weights: u64,
        activations: u64,
        max_num_batched_tokens: usize,
    },
    /// `max_model_len` is longer than the model's positions.
    #[error(
        "max_model_len {requested} exceeds the model's context of {limit} tokens \
         (max_position_embeddings, extended by its rope scaling); use at most {limit}"
    )]
    MaxModelLenTooLong { requested: usize, limit: usize },
    /// A size that must be positive is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A memory size did not parse.
    #[error(
        "invalid memory size `{0}`: expected a number of bytes with an optional unit, \
         e.g. 16GiB, 512MiB, 1.5GB, 1000000"
    )]
    InvalidMemorySize(String),
}

/// Bytes of K and V that one token occupies across all layers:
/// `2 × num_layers × num_kv_heads × head_dim × dtype.bytes()`, or for a
/// latent cache (multi-head latent attention) `num_layers × (kv_lora_rank +
/// qk_rope_head_dim) × dtype.bytes()`.
pub fn kv_bytes_per_token(cfg: &ModelConfig, dtype: KvCacheDtype) -> u64 {
    cfg.num_layers as u64 * cfg.kv_values_per_token_layer() as u64 * dtype.bytes() as u64
}

/// Peak f32 activation bytes of one forward step of `max_num_batched_tokens`
/// tokens from at most `max_num_seqs` sequences.
///
/// With `T = max_num_batched_tokens`, `S = min(max_num_seqs, T)` (a step
/// never has more sequences than tokens, and each sequence gets one row of
/// next-token logits), `q = num_heads × head_dim`, `kv = num_kv_heads ×
/// head_dim`, `I = intermediate_size`:
///
/// ```text
/// 4 × ( T × (2·hidden + q + 2·kv + q + 2·I)  +  S × vocab )
///            │          │   │      │   └ MLP gate and up projections
///            │          │   │      └ attention output
///            │          │   └ k and v
///            │          └ q
///            └ residual stream and its normalised copy
/// ```
///
/// A mixture of experts adds, per token, its router's `E` logits and for
/// each of its `k` picks the gathered input and output rows (`2·hidden`)
/// and the expert's gate and up features (`2·I_expert`).
///
/// Multi-head latent attention (`model/mla.rs`) replaces q, k, v and the
/// attention output by, per token, the query (`H·qk`), the latent row
/// (`L`), the absorbed form's folded queries and sums (`2·H·L`) and the
/// values (`H·v`); and, for the one sequence at a time the expanded form
/// runs, every position of the context expanded into keys and values
/// (`context × H × (qk + v + nope + v)`, with `kv_b_proj`'s output).
///
/// Layers run in turn and reuse these buffers, so this is the peak; the KV
/// cache itself is counted separately.
pub fn activation_bytes(
    cfg: &ModelConfig,
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
) -> u64 {
    let t = max_num_batched_tokens as u64;
    let s = max_num_seqs.min(max_num_batched_tokens) as u64;
    let q = (cfg.num_heads * cfg.head_dim) as u64;
    let kv = (cfg.num_kv_heads * cfg.head_dim) as u64;
    let residual_and_mlp = 2 * cfg.hidden_size as u64 + 2 * cfg.intermediate_size as u64;
    let (attention, per_step) = match &cfg.arch.mla {
        None => (q + 2 * kv + q, 0),
        Some(m) => {
            let h = cfg.num_heads as u64;
            let (qk, v, nope) = (
                m.qk_head_dim() as u64,
                m.v_head_dim as u64,
                m.qk_nope_head_dim as u64,
            );
            let latent = m.latent_width() as u64;
            let per_token = h * qk + latent + 2 * h * latent + h * v;
            let expanded = cfg.max_context() as u64 * h * (qk + v + nope + v);
            (per_token, expanded)
        }
    };
    let mut per_token = residual_and_mlp + attention;
    if let Some(m) = &cfg.arch.moe {
        // Router logits, each pick's gathered input and output rows, and
        // its gate and up features.
        let picks = m.top_k as u64;
        per_token += m.num_experts as u64
            + picks * (2 * cfg.hidden_size as u64 + 2 * m.expert_intermediate as u64);
    }
    let f32_bytes = std::mem::size_of::<f32>() as u64;
    f32_bytes * (t * per_token + s * cfg.vocab_size as u64 + per_step)
}

/// The inputs of a capacity plan. [`CapacityPlan::new`] fills in the
/// defaults; set the public fields to change them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityPlan {
    /// The whole budget: weights, activations and the KV pool.
    pub memory_bytes: u64,
    /// Bytes of the model's weights ([`checkpoint_weight_bytes`]).
    pub weight_bytes: u64,
    /// Tokens per KV block (default [`DEFAULT_BLOCK_SIZE`]).
    pub block_size: usize,
    /// The longest sequence to plan for (default: the model's context,
    /// [`crate::ModelConfig::max_context`]).
    pub max_model_len: Option<usize>,
    /// Most tokens per forward step (default
    /// [`DEFAULT_MAX_NUM_BATCHED_TOKENS`]).
    pub max_num_batched_tokens: usize,
    /// Most sequences per forward step (default [`DEFAULT_MAX_NUM_SEQS`]).
    pub max_num_seqs: usize,
    /// What the KV cache stores (default f32, as the CPU engine does).
    pub kv_dtype: KvCacheDtype,
}

/// The outcome of [`CapacityPlan::plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    pub memory_bytes: u64,
    pub weight_bytes: u64,
    pub activation_bytes: u64,
    pub kv_dtype: KvCacheDtype,
    pub kv_bytes_per_token: u64,
    pub block_size: usize,
    /// `block_size × kv_bytes_per_token`, plus the 8-bit dtypes' scales
    /// (`2 × layers × kv_heads × 4`).
    pub bytes_per_block: u64,
    /// `(memory − weights − activations) / bytes_per_block`, rounded down.
    pub pool_blocks: u64,
    /// Tokens of every layer the pool holds: `pool_blocks × block_size`
    /// divided by the layer groups (1 without sliding-window layers).
    pub pool_tokens: u64,
    /// `pool_blocks × bytes_per_block`.
    pub kv_pool_bytes: u64,
    pub max_model_len: usize,
    /// Physical blocks a sequence of `max_model_len` tokens holds:
    /// `ceil(max_model_len / block_size)` without sliding-window layers;
    /// with them, every layer group's blocks after its windowed groups have
    /// freed what left the window ([`crate::KvGroups::blocks_held`]).
    pub blocks_per_seq: u64,
    /// What it would hold if no layer freed its blocks (equal to
    /// `blocks_per_seq` without sliding-window layers).
    pub global_blocks_per_seq: u64,
    /// Layers per block (all of them without sliding-window layers).
    pub layers_per_block: usize,
    /// The sliding window and how many layers have it (0 and 0: none).
    pub sliding_window: usize,
    pub windowed_layers: usize,
    /// `pool_blocks / blocks_per_seq`: sequences of `max_model_len` tokens
    /// that fit at once (0 when not even one does).
    pub max_concurrent_seqs: u64,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
}

impl CapacityPlan {
    /// A plan for `memory_bytes` with `weight_bytes` of weights and the
    /// default block size, step limits, `max_model_len` and KV dtype.
    pub fn new(memory_bytes: u64, weight_bytes: u64) -> Self {
        Self {
            memory_bytes,
            weight_bytes,
            block_size: DEFAULT_BLOCK_SIZE,
            max_model_len: None,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            kv_dtype: KvCacheDtype::default(),
        }
    }

    /// Works out the pool and the concurrency for `cfg`.
    pub fn plan(&self, cfg: &ModelConfig) -> std::result::Result<Capacity, CapacityError> {
        for (name, v) in [
            ("block_size", self.block_size),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_num_seqs", self.max_num_seqs),
        ] {
            if v == 0 {
                return Err(CapacityError::Zero(name));
            }
        }
        let limit = cfg.max_context();
        let max_model_len = self.max_model_len.unwrap_or(limit);
        if max_model_len == 0 {
            return Err(CapacityError::Zero("max_model_len"));
        }
        if max_model_len > limit {
            return Err(CapacityError::MaxModelLenTooLong {
                requested: max_model_len,
                limit,
            });
        }
        let activations = activation_bytes(cfg, self.max_num_batched_tokens, self.max_num_seqs);
        let free = self
            .memory_bytes
            .checked_sub(self.weight_bytes)
            .and_then(|m| m.checked_sub(activations))
            .filter(|&m| m > 0)
            .ok_or(CapacityError::InsufficientMemory {
                memory: self.memory_bytes,
                weights: self.weight_bytes,
                activations,
                max_num_batched_tokens: self.max_num_batched_tokens,
            })?;
        let kv_bytes_per_token = kv_bytes_per_token(cfg, self.kv_dtype);
        let layout = cfg.kv_layout(self.block_size);
        let groups = crate::KvGroups::of(&layout);
        let slots = layout.layers_per_block() as u64;
        // What the engine's pool takes per block (scales and FP8's recent
        // window included).
        let bytes_per_block = self.kv_dtype.block_bytes(&layout) as u64;
        // A model without KV (no layers) would divide by zero; it has no
        // pool to plan either.
        let pool_blocks = free.checked_div(bytes_per_block).unwrap_or(0);
        let global_blocks_per_seq =
            (max_model_len.div_ceil(self.block_size) * groups.num_groups()) as u64;
        let blocks_per_seq = groups.blocks_held(max_model_len, self.block_size) as u64;
        Ok(Capacity {
            memory_bytes: self.memory_bytes,
            weight_bytes: self.weight_bytes,
            activation_bytes: activations,
            kv_dtype: self.kv_dtype,
            kv_bytes_per_token,
            block_size: self.block_size,
            bytes_per_block,
            pool_blocks,
            pool_tokens: pool_blocks * self.block_size as u64 / groups.num_groups() as u64,
            kv_pool_bytes: pool_blocks * bytes_per_block,
            max_model_len,
            blocks_per_seq,
            global_blocks_per_seq,
            layers_per_block: slots as usize,
            sliding_window: layout.sliding.window,
            windowed_layers: layout.sliding.count(cfg.num_layers),
            max_concurrent_seqs: pool_blocks.checked_div(blocks_per_seq).unwrap_or(0),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
        })
    }
}

impl fmt::Display for Capacity {
    /// One line for the start-up log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KV pool: {} blocks × {} tokens = {} tokens ({} {}, {} B/token); \
             max {} concurrent sequences at max_model_len {}; \
             weights {}, activations {}, budget {}",
            self.pool_blocks,
            self.block_size,
            self.pool_tokens,
            format_bytes(self.kv_pool_bytes),
            self.kv_dtype,
            self.kv_bytes_per_token,
            self.max_concurrent_seqs,
            self.max_model_len,
            format_bytes(self.weight_bytes),
            format_bytes(self.activation_bytes),
            format_bytes(self.memory_bytes),
        )?;
        if self.windowed_layers > 0 {
            write!(
                f,
                "; sliding window {} on {} layers ({} layers per block): a max_model_len \
                 sequence holds {} blocks, {} without freeing",
                self.sliding_window,
                self.windowed_layers,
                self.layers_per_block,
                self.blocks_per_seq,
                self.global_blocks_per_seq,
            )?;
        }
        Ok(())
    }
}

/// Parses a memory size: a non-negative number with an optional unit, case
/// insensitive, optionally separated by a space. `B` or no unit: bytes;
/// `K`/`KB`, `M`/`MB`, `G`/`GB`, `T`/`TB`: powers of 1000; `KiB`, `MiB`,
/// `GiB`, `TiB` (or `Ki`, `Mi`, ...): powers of 1024. Fractions are allowed
/// (`1.5GB`) and rounded down to whole bytes.
pub fn parse_memory_size(s: &str) -> std::result::Result<u64, CapacityError> {
    let bad = || CapacityError::InvalidMemorySize(s.to_string());
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: String = number.chars().filter(|&c| c != '_').collect();
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "ki" | "kib" => 1 << 10,
        "mi" | "mib" => 1 << 20,
        "gi" | "gib" => 1 << 30,
        "ti" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    if number.is_empty() || number == "." {
        return Err(bad());
    }
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(multiplier).ok_or_else(bad);
    }
    let value: f64 = number.parse().map_err(|_| bad())?;
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.floor() as u64)
}

/// Formats bytes with a binary unit, e.g. `1.50 GiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// Total bytes of tensor data in a checkpoint's safetensors files, read from
/// their headers alone (the 8-byte little-endian header length and the JSON
/// header; the tensor data is never read or mapped). Finds the files as
/// loading does: `model.safetensors`, or every shard named in
/// `model.safetensors.index.json`. For a GGUF file, what loading keeps
/// ([`sum_gguf`]) plus the head's blocks, from its tensor table.
pub fn checkpoint_weight_bytes(dir: &Path) -> Result<u64> {
    let stored = |_: &str, _: &[u64], stored: u64| stored;
    match gguf_table(dir)? {
        Some((g, map)) => Ok(sum_gguf(&g, &map, &stored) + gguf_head_blocks(&g, &map)),
        None => sum_tensors(dir, &stored),
    }
}

/// A GGUF file and its tensors' Hugging Face names; `None` for a
/// safetensors checkpoint.
fn gguf_table(dir: &Path) -> Result<Option<(tandem_gguf::Gguf, crate::gguf::TensorMap)>> {
    if !crate::gguf::is_gguf(dir) {
        return Ok(None);
    }
    let g = crate::gguf::open(dir)?;
    let map = crate::gguf::hf_tensor_names(&g)?;
    Ok(Some((g, map)))
}

/// The bytes of a GGUF file's output head kept in its quantized blocks (the
/// embedding's, when tied) besides its f16 copy: 0 for a float head.
fn gguf_head_blocks(g: &tandem_gguf::Gguf, map: &crate::gguf::TensorMap) -> u64 {
    let named = |want: &str| map.names.iter().find(|(hf, _)| hf == want);
    let head = named("lm_head.weight").or_else(|| named("model.embed_tokens.weight"));
    head.and_then(|(_, name)| g.tensor(name))
        .filter(|t| !t.ty.is_float())
        .map_or(0, tiled_bytes)
}

/// What a quantized GGUF matrix takes as [`crate::kernels::GgmlMatrix`]
/// tiles (the file's blocks, give or take the K-quants' unpacked scales).
fn tiled_bytes(t: &tandem_gguf::TensorInfo) -> u64 {
    match t.shape()[..] {
        [rows, cols] => crate::kernels::GgmlMatrix::tiled_bytes(t.ty, rows, cols) as u64,
        _ => (t.end - t.start) as u64,
    }
}

/// Sums `bytes(name, shape, resident bytes)` over every tensor of a
/// checkpoint: the safetensors headers of a directory, or a GGUF file's
/// tensor table ([`sum_gguf`]).
pub(crate) fn sum_tensors(dir: &Path, bytes: &dyn Fn(&str, &[u64], u64) -> u64) -> Result<u64> {
    if let Some((g, map)) = gguf_table(dir)? {
        return Ok(sum_gguf(&g, &map, bytes));
    }
    let mut total = 0u64;
    for path in crate::weights::safetensors_files(dir)? {
        total += safetensors_data_bytes(&path, bytes)?;
    }
    Ok(total)
}

/// [`sum_tensors`] over a GGUF file's tensor table, under the Hugging Face
/// names. A tensor's resident bytes are what loading keeps of it
/// ([`crate::weights`]): float tensors as stored; a quantized linear layer's
/// blocks as tiles; anything else quantized (the embedding, the output
/// head) decoded to f16. The head's blocks, which the logits run on, are
/// [`gguf_head_blocks`].
fn sum_gguf(
    g: &tandem_gguf::Gguf,
    map: &crate::gguf::TensorMap,
    bytes: &dyn Fn(&str, &[u64], u64) -> u64,
) -> u64 {
    map.names
        .iter()
        .filter_map(|(hf, name)| g.tensor(name).map(|t| (hf, t)))
        .map(|(hf, t)| {
            let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
            let (blocks, decoded) = ((t.end - t.start) as u64, 2 * t.len() as u64);
            let resident = match t.ty.is_float() {
                true => blocks,
                false if shape.len() == 2 && hf.ends_with("_proj.weight") => tiled_bytes(t),
                false => decoded,
            };
            bytes(hf, &shape, resident)
        })
        .sum()
}

/// As [`checkpoint_weight_bytes`], for the model quantized at load to INT4
/// with `group_size` (`--quantize int4`): every 2-D
/// `model.layers.*.{self_attn,mlp}.*_proj.weight` (routed and shared
/// experts among them; Mixtral's `block_sparse_moe.experts.*`; not the
/// routers, which stay dense) counts what its [`crate::quant::Int4Matrix`]
/// takes ([`crate::quant::int4_bytes`], with
/// [`crate::quant::Int4Config::group_for`]'s group), and `lm_head.weight`
/// twice that (its [`crate::quant::ResidualInt4`]); a checkpoint without
/// `lm_head.weight` (tied) adds such a copy of the embedding as its head;
/// the embedding, norms and biases stay as stored.
pub fn checkpoint_weight_bytes_int4(dir: &Path, group_size: usize) -> Result<u64> {
    let config = crate::quant::Int4Config::new(group_size)?;
    let int4 = |rows: u64, cols: u64| {
        let g = config.group_for(cols as usize).unwrap_or(group_size);
        crate::quant::int4_bytes(rows as usize, cols as usize, g) as u64
    };
    let head_seen = std::cell::Cell::new(false);
    let embed_shape = std::cell::Cell::new(None);
    let quantized = |name: &str, shape: &[u64], stored: u64| {
        // Mixtral's experts are `block_sparse_moe.experts.{e}.w1` etc.
        let is_linear = name.starts_with("model.layers.")
            && (name.contains(".self_attn.") || name.contains(".mlp."))
            && name.ends_with("_proj.weight")
            || name.contains(".block_sparse_moe.experts.");
        if name == "model.embed_tokens.weight" {
            if let [rows, cols] = shape {
                embed_shape.set(Some((*rows, *cols)));
            }
        }
        match shape {
            [rows, cols] if is_linear => int4(*rows, *cols),
            [rows, cols] if name == "lm_head.weight" => {
                head_seen.set(true);
                2 * int4(*rows, *cols)
            }
            _ => stored,
        }
    };
    let mut total = sum_tensors(dir, &quantized)?;
    if let (false, Some((rows, cols))) = (head_seen.get(), embed_shape.get()) {
        total += 2 * int4(rows, cols);
    }
    Ok(total)
}

/// Headers larger than this are refused rather than read (safetensors' own
/// limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Sums `bytes(name, shape, end − start)` over every tensor's
/// `data_offsets` in one file's header, checking the offsets against the
/// file's length.
/// The dtype a checkpoint's weights load as (its embedding's, which
/// [`crate::Model::weight_dtype`] reports and `--kv-dtype auto` follows),
/// from the headers alone: a GGUF's quantized embedding loads as f16.
pub fn checkpoint_weight_dtype(dir: &Path) -> Result<crate::DType> {
    const EMBED: &str = "model.embed_tokens.weight";
    if let Some((g, map)) = gguf_table(dir)? {
        let embed = map.names.iter().find(|(hf, _)| hf == EMBED);
        return Ok(
            match embed.and_then(|(_, name)| g.tensor(name)).map(|t| t.ty) {
                Some(tandem_gguf::GgmlType::F32) => crate::DType::F32,
                Some(tandem_gguf::GgmlType::Bf16) => crate::DType::Bf16,
                _ => crate::DType::F16,
            },
        );
    }
    for path in crate::weights::safetensors_files(dir)? {
        let (tensors, _) = safetensors_header(&path)?;
        if let Some(dtype) = tensors.get(EMBED).and_then(|t| t.get("dtype")) {
            return match dtype.as_str() {
                Some("F32") => Ok(crate::DType::F32),
                Some("BF16") => Ok(crate::DType::Bf16),
                Some("F16") => Ok(crate::DType::F16),
                _ => Err(EngineError::InvalidCheckpoint(format!(
                    "{}: `{EMBED}` has dtype {dtype}, not F32, BF16 or F16",
                    path.display()
                ))),
            };
        }
    }
    Err(EngineError::InvalidCheckpoint(format!(
        "{}: no safetensors file names `{EMBED}`",
        dir.display()
    )))
}

/// A safetensors file's header (tensor name → dtype, shape, offsets) and
/// the length of its data section.
fn safetensors_header(path: &Path) -> Result<(serde_json::Map<String, serde_json::Value>, u64)> {
    let io = |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    };
    let invalid =
        |what: String| EngineError::InvalidCheckpoint(format!("{}: {what}", path.display()));
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(io)?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > file_len {
        return Err(invalid(format!(
            "safetensors header length {header_len} does not fit a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| invalid(format!("safetensors header is not JSON: {e}")))?;
    let serde_json::Value::Object(tensors) = header else {
        return Err(invalid("safetensors header is not a JSON object".into()));
    };
    Ok((tensors, file_len - 8 - header_len))
}

/// [`sum_tensors`] over one safetensors file.
fn safetensors_data_bytes(path: &Path, bytes: &dyn Fn(&str, &[u64], u64) -> u64) -> Result<u64> {
    let invalid =
        |what: String| EngineError::InvalidCheckpoint(format!("{}: {what}", path.display()));
    let (tensors, data_len) = safetensors_header(path)?;
    let mut total = 0u64;
    for (name, info) in &tensors {
        if name == "__metadata__" {
            continue;
        }
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|o| match o.as_slice() {
                [start, end] => Some((start.as_u64()?, end.as_u64()?)),
                _ => None,
            })
            .ok_or_else(|| invalid(format!("tensor `{name}` has no valid data_offsets")))?;
        let (start, end) = offsets;
        if start > end || end > data_len {
            return Err(invalid(format!(
                "tensor `{name}` data_offsets [{start}, {end}] lie outside the {data_len} data bytes"
            )));
        }
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|dims| dims.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        total += bytes(name, &shape, end - start);
    }
    Ok(total)
}

#[cfg(test)]
mod tests;
