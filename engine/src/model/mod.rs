//! The decoder and its forward pass over a flattened batch.
//!
//! One [`Model::forward`] call takes any mix of sequences, each with its new
//! tokens, the position of the first one and its block table: a 500-token
//! prefill chunk of one request and single decode tokens of thirty others run
//! as one `[total_tokens, hidden]` activation matrix through every GEMM. Only
//! attention looks at sequence boundaries. This is what lets chunked prefill
//! and continuous batching be one mechanism in the scheduler.
//!
//! Families differ only in data, read from the config's [`ArchSpec`]
//! ([`crate::arch`]) once, at load: which tensors exist under which names,
//! the norms' placement and offset, the activation, q/k norms, attention
//! scale, soft caps and each layer's window and RoPE. Biases are used when
//! the checkpoint has them (Qwen2's q/k/v, Llama's `attention_bias`), and a
//! tied head reuses the embedding matrix. Nothing here names a tensor.
//!
//! A linear layer's weight is dense (the checkpoint's dtype, read in place),
//! INT4 ([`crate::quant`]): loaded so from an AWQ/GPTQ checkpoint, or
//! quantized at load by [`Model::quantize_int4`] (which also quantizes the
//! output head), or a GGUF file's quantized blocks as stored, head included
//! ([`crate::kernels::ggml`]). The embedding always stays dense.

use std::path::Path;

use crate::arch::LayerAttention;
use crate::attention::AttnSeq;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kernels::{
    self, add_in_place, linear_residual_int4, rms_norm, rms_norm_in_place, scale_in_place,
    softcap_in_place, GgmlMatrix, MatmulPolicy, Panels, RopeTable,
};
use crate::kv_cache::{BlockId, KvCache, KvLayout, SlidingLayers, FREED};
use crate::lora::{LoraAdapter, LoraRows};
use crate::quant::hf::HfQuantization;
use crate::quant::ResidualInt4;

mod attend;
mod linear;
mod load;
mod mla;
mod mlp;
mod quantize;
mod step;

use crate::shard::{NoPeers, ShardPeers, ShardSpec};
use crate::weights::{DType, Matrix, Residency, WeightStore};
use linear::{Linear, LinearWeight, Split};
use load::{norm_vector, LayerSplits, MlpSplit, Source};
use mla::LatentAttention;
use mlp::Mlp;
use step::Step;

pub use mla::MlaForm;

/// One decoder layer. Optional norms are those the family's placement or
/// q/k norm adds; every choice a step needs is a field, resolved at load.
#[derive(Debug)]
struct Layer {
    attn_norm: Option<Vec<f32>>,
    proj: AttnProj,
    o: Linear,
    /// Norms of queries and keys: `head_dim` wide (per head) or the whole
    /// projection wide ([`QkNorm`]).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    attn_out_norm: Option<Vec<f32>>,
    mlp_norm: Option<Vec<f32>>,
    mlp_out_norm: Option<Vec<f32>>,
    mlp: Mlp,
    attention: LayerAttention,
    /// This rank's heads' attention-sink logits (gpt-oss).
    sinks: Option<Vec<f32>>,
}

/// How a layer projects its input to attention.
#[derive(Debug)]
enum AttnProj {
    /// Queries, keys and values per head (`q`, `k`, `v`).
    Heads(Box<[Linear; 3]>),
    /// Multi-head latent attention ([`mla`]).
    Latent(Box<LatentAttention>),
}

impl Layer {
    /// Every linear layer, named for messages (the MoE router, kept dense,
    /// is not one).
    fn linears(&self) -> impl Iterator<Item = (String, &Linear)> {
        let mut attention = match &self.proj {
            AttnProj::Heads(qkv) => {
                let [q, k, v] = &**qkv;
                vec![("q_proj", q), ("k_proj", k), ("v_proj", v)]
            }
            AttnProj::Latent(mla) => mla.linears(),
        };
        attention.push(("o_proj", &self.o));
        let attention = attention.into_iter().map(|(n, l)| (n.to_string(), l));
        attention.chain(self.mlp.linears())
    }

    /// As [`linears`](Self::linears), to change them (INT4).
    fn linears_mut(&mut self) -> impl Iterator<Item = (String, &mut Linear)> {
        let mut attention = match &mut self.proj {
            AttnProj::Heads(qkv) => {
                let [q, k, v] = &mut **qkv;
                vec![("q_proj", q), ("k_proj", k), ("v_proj", v)]
            }
            AttnProj::Latent(mla) => mla.linears_mut(),
        };
        attention.push(("o_proj", &mut self.o));
        let attention = attention.into_iter().map(|(n, l)| (n.to_string(), l));
        attention.chain(self.mlp.linears_mut())
    }
}

/// The output head in a form of its own, used instead of the dense one.
#[derive(Debug)]
enum HeadForm {
    /// Quantized at load (`quantize_int4`) to about 8 bits ([`ResidualInt4`]).
    Int4(ResidualInt4),
    /// A GGUF file's head (or tied embedding) in its stored blocks.
    Blocks(GgmlMatrix),
    /// bf16 packed into panels ([`MatmulPolicy::packs_weights`]); a tied
    /// embedding stays as stored for the lookups.
    Panels(Panels),
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<Matrix>,
    /// The output head in a form of its own, used instead of the dense one.
    head_form: Option<HeadForm>,
    rope: RopeTable,
    /// The sliding-window layers' RoPE, where it differs (Gemma 3).
    local_rope: Option<RopeTable>,
    matmul: MatmulPolicy,
    /// The part of the model this rank holds (all of it unless sharded).
    shard: ShardSpec,
    /// Which form latent attention runs in ([`MlaForm`]).
    mla_form: MlaForm,
    _weights: WeightStore,
}

/// One sequence's part of a batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// New tokens to run.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; K/V for positions before it are in the cache.
    pub start_pos: usize,
    /// Block table covering at least `start_pos + tokens.len()` positions.
    pub blocks: &'a [BlockId],
    /// Logits for every new token (prompt scoring, speculative verification)
    /// rather than for the last one only.
    pub all_logits: bool,
    /// The LoRA adapter its rows run under (see [`crate::lora`]).
    pub lora: Option<&'a LoraAdapter>,
}

impl SeqInput<'_> {
    /// How many logits rows this sequence gets back.
    pub fn logit_rows(&self) -> usize {
        if self.all_logits {
            self.tokens.len()
        } else {
            1
        }
    }
}

/// Logits of a batch: for each sequence, rows of `vocab` floats.
#[derive(Debug)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
    /// First row of each sequence, plus a final end marker.
    starts: Vec<usize>,
}

impl Logits {
    /// Logits computed elsewhere (another backend): `data` holds rows of
    /// `vocab` floats and sequence `i` owns rows `starts[i]..starts[i + 1]`.
    pub fn from_rows(data: Vec<f32>, vocab: usize, starts: Vec<usize>) -> Self {
        debug_assert_eq!(data.len(), starts.last().copied().unwrap_or(0) * vocab);
        Self {
            data,
            vocab,
            starts,
        }
    }

    /// Rows of sequence `i` (one row unless it asked for all logits).
    pub fn seq(&self, i: usize) -> &[f32] {
        &self.data[self.starts[i] * self.vocab..self.starts[i + 1] * self.vocab]
    }

    /// The last row of sequence `i`: the next-token logits.
    pub fn last(&self, i: usize) -> &[f32] {
        let end = self.starts[i + 1] * self.vocab;
        &self.data[end - self.vocab..end]
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Every row, sequence after sequence (`vocab` floats each).
    pub fn rows(&self) -> &[f32] {
        &self.data
    }
}

impl Model {
    /// Loads `config.json` and the safetensors weights of a checkpoint,
    /// read once onto huge pages ([`Residency::HugePages`]: batch-1 decode
    /// streams them faster than through the page cache's 4 KiB pages).
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, Residency::HugePages)
    }

    /// [`Self::load`] with the weights held as `residency` asks:
    /// [`Residency::Mapped`] where the model is only read once (weights
    /// quantized at load, a GPU upload) or several processes on one host
    /// serve the same files and should share the page cache.
    pub fn load_with(dir: &Path, residency: Residency) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ws = WeightStore::open_with(dir, residency)?;
        let quant = HfQuantization::from_dir(dir)?;
        let shard = ShardSpec::full(&config);
        Self::from_parts(config, ws, quant.as_ref(), shard)
    }

    /// Loads one rank's shard of a checkpoint (see [`crate::shard`]): only
    /// its layers, and of those only its heads and intermediate features.
    /// Column-parallel weights are mapped in place; row-parallel ones have
    /// their columns copied out (the shard, never the whole matrix).
    pub fn load_shard(
        dir: &Path,
        tp: usize,
        tp_rank: usize,
        pp: usize,
        stage: usize,
    ) -> Result<Self> {
        let split = crate::shard::Split {
            tp,
            tp_rank,
            pp,
            stage,
            ep: 1,
        };
        Self::load_split(dir, split)
    }

    /// As [`load_shard`](Self::load_shard), with the experts split too
    /// ([`crate::shard`]).
    pub fn load_split(dir: &Path, split: crate::shard::Split) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let shard = ShardSpec::of(&config, split)?;
        // A rank reads only its part of each file: mapped, it touches only
        // that; a resident copy would hold the whole file in every rank.
        let residency = if shard.is_full() {
            Residency::HugePages
        } else {
            Residency::Mapped
        };
        let ws = WeightStore::open_with(dir, residency)?;
        let quant = HfQuantization::from_dir(dir)?;
        Self::from_parts(config, ws, quant.as_ref(), shard)
    }

    fn from_parts(
        config: ModelConfig,
        ws: WeightStore,
        quant: Option<&HfQuantization>,
        shard: ShardSpec,
    ) -> Result<Self> {
        let c = &config;
        shard.check(c)?;
        let names = c.arch.names(|n| ws.contains(n))?;
        if let Some(class) = c.arch.text_tower_of {
            tracing::warn!(
                "{class} checkpoint: serving its text tower only; images are not served \
                 (the vision tower's tensors are not loaded)"
            );
        }
        let h = c.hidden_size;
        let whole = shard.tp_size == 1;
        let (qh, kvh) = (shard.q_heads(c), shard.kv_heads(c));
        let outputs = |r: &std::ops::Range<usize>, scale: usize| match whole {
            true => Split::Whole,
            false => Split::Outputs(r.start * scale..r.end * scale),
        };
        let inputs = |r: &std::ops::Range<usize>, scale: usize| match whole {
            true => Split::Whole,
            false => Split::Inputs {
                range: r.start * scale..r.end * scale,
                keeps_bias: shard.tp_rank == 0,
            },
        };
        let d = c.head_dim;
        let mlp = |features: usize| {
            let r = shard.features(features);
            MlpSplit {
                cols: outputs(&r, 1),
                rows: inputs(&r, 1),
            }
        };
        let moe = c.arch.moe.as_ref();
        // Latent attention splits by whole query heads too: the query's
        // rows and `kv_b_proj`'s per head, `o_proj`'s inputs per head's
        // value; the latent's own projection is replicated.
        let (q_width, v_width) = match &c.arch.mla {
            Some(m) => (m.qk_head_dim(), m.v_head_dim),
            None => (d, d),
        };
        let splits = LayerSplits {
            q_cols: outputs(&qh, q_width),
            kv_cols: outputs(&kvh, d),
            o_rows: inputs(&qh, v_width),
            heads: qh.clone(),
            inter: mlp(c.intermediate_size),
            expert: {
                let r = shard.expert_features(moe.map_or(0, |m| m.expert_intermediate));
                MlpSplit {
                    cols: outputs(&r, 1),
                    // One rank of each expert group adds its down biases:
                    // the one with the first feature slice.
                    rows: match whole {
                        true => Split::Whole,
                        false => Split::Inputs {
                            keeps_bias: r.start == 0,
                            range: r,
                        },
                    },
                }
            },
            experts: shard.experts(moe.map_or(0, |m| m.num_experts)),
            shared: mlp(moe.and_then(|m| m.shared_intermediate).unwrap_or(0)),
        };
        let embed = ws.matrix(&names.embed(), c.vocab_size, h)?;
        let source = Source {
            config: c,
            ws: &ws,
            quant,
            names: &names,
        };
        let task = crate::progress::Task::begin("loading layers", shard.layers.len() as u64);
        let layers = shard
            .layers
            .clone()
            .map(|i| {
                let layer = source.layer(i, &splits);
                task.step();
                layer
            })
            .collect::<Result<Vec<_>>>()?;
        drop(task);
        let final_norm = norm_vector(c, &ws, &names.final_norm(), h)?;
        // Some tied checkpoints still carry a copy of the head; use it if so.
        let head_name = names.lm_head();
        let lm_head = if ws.contains(&head_name) {
            Some(ws.matrix(&head_name, c.vocab_size, h)?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(EngineError::InvalidCheckpoint(format!(
                "tensor `{head_name}` is missing and tie_word_embeddings is false"
            )));
        };
        // A GGUF file's quantized head runs in its blocks (on the rank that
        // computes logits); the dense copy stays for what reads rows of it
        // (INT4 re-quantization).
        let head_source = match lm_head {
            Some(_) => head_name,
            None => names.embed(),
        };
        let head_form = match shard.computes_logits() {
            true => ws
                .quantized_rows(&head_source, c.vocab_size, h, 0..c.vocab_size)?
                .map(HeadForm::Blocks),
            false => None,
        };
        let rope = RopeTable::new(c);
        let local_rope = c
            .arch
            .local_rope
            .as_ref()
            .map(|p| RopeTable::from_params(d, p));
        Ok(Self {
            config,
            embed,
            layers,
            final_norm,
            lm_head,
            head_form,
            rope,
            local_rope,
            matmul: MatmulPolicy::default(),
            shard,
            mla_form: MlaForm::Auto,
            _weights: ws,
        })
    }

    /// Keeps only the first `n` layers: an early-exit copy of the model
    /// (same embedding, final norm and head), cheap to run and close to the
    /// full model, which makes it a draft model for self-speculative
    /// decoding (as in LayerSkip).
    pub fn truncate_layers(&mut self, n: usize) -> Result<()> {
        if n == 0 || n > self.layers.len() {
            return Err(EngineError::InvalidRequest(format!(
                "cannot keep {n} of {} layers",
                self.layers.len()
            )));
        }
        if !self.shard.is_full() {
            return Err(EngineError::Unsupported(
                "an early-exit copy needs the whole model, not a shard".into(),
            ));
        }
        self.layers.truncate(n);
        self.config.num_layers = n;
        self.shard = ShardSpec::full(&self.config);
        Ok(())
    }

    /// Sets which form latent attention runs in (DeepSeek-V2/V3; nothing
    /// else reads it): both compute the same attention ([`MlaForm`]).
    pub fn set_mla_form(&mut self, form: MlaForm) {
        self.mla_form = form;
    }

    /// Chooses speed or batch invariance for the matrix products. Under
    /// a policy that [packs weights](MatmulPolicy::packs_weights) the bf16
    /// linear layers are packed into panels here (and unpacked when another
    /// policy follows).
    pub fn set_matmul_policy(&mut self, policy: MatmulPolicy) {
        self.matmul = policy;
        match policy.packs_weights() {
            true => self.pack_weights(),
            false => self.unpack_weights(),
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The part of the model this rank holds.
    pub fn shard(&self) -> &ShardSpec {
        &self.shard
    }

    /// The KV layout this model (this rank's shard of it: its layers, its
    /// KV heads) needs for a given block size. Its sliding-window layers are
    /// marked (their blocks are freed out of the window) unless the model is
    /// split into pipeline stages, whose ranks share one block table but
    /// not one layer grouping.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        let whole = self.shard.layers.len() == self.shard.total_layers;
        let (rows, _, head_dim) = self.config.kv_rows();
        // A latent is one KV head (`ModelConfig::num_kv_heads` is 1), which
        // every tensor-parallel rank keeps whole.
        KvLayout {
            rows,
            num_layers: self.layers.len(),
            num_kv_heads: self.shard.kv_heads(&self.config).len(),
            head_dim,
            block_size,
            sliding: match whole {
                true => SlidingLayers::from_windows(self.layers.iter().map(|l| l.attention.window)),
                false => SlidingLayers::NONE,
            },
        }
    }

    /// Tokens routed to each expert since load, per sparse layer this rank
    /// holds: `(layer, counts)`, the layer's global index.
    pub fn routed_tokens(&self) -> Vec<(usize, Vec<u64>)> {
        let first = self.shard.layers.start;
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match &l.mlp {
                Mlp::Sparse(s) => Some((first + i, s.routed_tokens())),
                Mlp::Dense(_) => None,
            })
            .collect()
    }

    /// The stored dtype of the weight matrices.
    pub fn weight_dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// Whether every weight matrix is read in place from the mapped file.
    pub fn weights_mapped(&self) -> bool {
        self.embed.is_mapped()
            && self.lm_head.as_ref().is_none_or(Matrix::is_mapped)
            && self
                .layers
                .iter()
                .all(|l| l.linears().all(|(_, lin)| lin.w.is_mapped()))
    }

    fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Checks a batch against the vocabulary, the context limit and the cache.
    pub fn validate(&self, batch: &[SeqInput<'_>], kv: &KvCache) -> Result<()> {
        let c = &self.config;
        let mut want = self.kv_layout(kv.layout().block_size);
        // A cache may keep every block of the windowed layers.
        if kv.layout().sliding == SlidingLayers::NONE {
            want.sliding = SlidingLayers::NONE;
        }
        if *kv.layout() != want {
            return Err(EngineError::InvalidRequest(format!(
                "KV cache layout {:?} does not fit the model ({want:?})",
                kv.layout()
            )));
        }
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence {i} has no tokens"
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    c.vocab_size
                )));
            }
            let end = s.start_pos + s.tokens.len();
            if end > c.max_context() {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence of {end} tokens exceeds the model's context of {} tokens \
                     (max_position_embeddings, extended by its rope scaling)",
                    c.max_context()
                )));
            }
            let groups = kv.groups().num_groups();
            if !s.blocks.len().is_multiple_of(groups) {
                return Err(EngineError::InvalidRequest(format!(
                    "block table of {} entries for {groups} layer groups",
                    s.blocks.len()
                )));
            }
            let cap = s.blocks.len() / groups * want.block_size;
            if cap < end {
                return Err(EngineError::InvalidRequest(format!(
                    "block table holds {cap} tokens, sequence needs {end}"
                )));
            }
            let held = s.blocks.iter().filter(|&&b| b != FREED);
            if let Some(&b) = held.clone().find(|&&b| b as usize >= kv.num_blocks()) {
                return Err(EngineError::InvalidRequest(format!(
                    "block id {b} is outside the cache ({} blocks)",
                    kv.num_blocks()
                )));
            }
            // The new tokens' blocks are written in every layer.
            let written =
                s.start_pos / want.block_size * groups..end.div_ceil(want.block_size) * groups;
            if s.blocks[written].contains(&FREED) {
                return Err(EngineError::InvalidRequest(format!(
                    "block table has a freed block where positions {}..{end} are written",
                    s.start_pos
                )));
            }
        }
        Ok(())
    }

    /// Runs one step over a flattened batch: writes the new tokens' K/V into
    /// their blocks and returns next-token logits (see [`SeqInput::all_logits`]).
    pub fn forward(&self, batch: &[SeqInput<'_>], kv: &mut KvCache) -> Result<Logits> {
        self.forward_with_layer_hook(batch, kv, &mut |_, _| {})
    }

    /// As [`forward`](Self::forward), calling `after_layer(layer, kv)` as
    /// soon as each layer's new K/V are in the cache, so a prefill worker can
    /// ship layer `l` while layer `l + 1` computes.
    pub fn forward_with_layer_hook(
        &self,
        batch: &[SeqInput<'_>],
        kv: &mut KvCache,
        after_layer: &mut dyn FnMut(usize, &KvCache),
    ) -> Result<Logits> {
        self.forward_stage(batch, kv, &mut NoPeers, after_layer)?
            .ok_or_else(|| {
                EngineError::InvalidRequest(
                    "this rank holds a shard of the model: run it with forward_stage".into(),
                )
            })
    }

    /// This rank's part of one step ([`crate::shard`]): the first stage
    /// embeds the tokens, a later one takes the previous stage's activations
    /// from `peers`; the rank's layers run on its heads and features, with an
    /// all-reduce after attention and after the MLP when tensor-parallel;
    /// then the activations go to the next stage, or (last stage, TP rank 0)
    /// the logits come back. `after_layer` gets the layer's index in this
    /// rank's KV cache. The unsharded model is the case with no peers.
    pub fn forward_stage(
        &self,
        batch: &[SeqInput<'_>],
        kv: &mut KvCache,
        peers: &mut dyn ShardPeers,
        after_layer: &mut dyn FnMut(usize, &KvCache),
    ) -> Result<Option<Logits>> {
        self.validate(batch, kv)?;
        let c = &self.config;
        let hsz = c.hidden_size;

        // Flatten: token ids, positions, and each sequence's row range.
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut seqs = Vec::with_capacity(batch.len());
        let mut lora = Vec::new();
        for s in batch {
            lora.extend(std::iter::repeat_n(s.lora, s.tokens.len()));
            seqs.push(AttnSeq {
                start_pos: s.start_pos,
                len: s.tokens.len(),
                row: tokens.len(),
                blocks: s.blocks,
            });
            tokens.extend_from_slice(s.tokens);
            positions.extend(s.start_pos..s.start_pos + s.tokens.len());
        }
        let t = tokens.len();

        let mut x = vec![0.0f32; t * hsz];
        if self.shard.first_stage() {
            for (row, &tok) in x.chunks_exact_mut(hsz).zip(&tokens) {
                self.embed.row_to_f32(tok as usize, row);
            }
            if let Some(s) = c.arch.embed_scale {
                scale_in_place(&mut x, s);
            }
        } else {
            peers.recv_activations(&mut x)?;
        }
        let lora = LoraRows::new(lora);
        if lora.any() && !self.shard.is_full() {
            return Err(EngineError::Unsupported(
                "LoRA adapters run on an unsharded model only".into(),
            ));
        }
        // An FP8 cache's recent window: the blocks this step's queries read
        // at 16 bits keep or take their copies before any row is written.
        kv.hold_recent(seqs.iter().map(|s| (s.start_pos, s.len, s.blocks)));
        let mut step = Step::new(self, &positions, seqs, lora);
        for (li, layer) in self.layers.iter().enumerate() {
            self.attention_block(li, layer, &mut x, &mut step, kv, peers)?;
            after_layer(li, kv);
            self.mlp_block(li, layer, &mut x, &mut step, peers)?;
        }
        if !self.shard.last_stage() {
            peers.send_activations(&x)?;
            return Ok(None);
        }
        if !self.shard.computes_logits() {
            return Ok(None);
        }
        Ok(Some(self.logits(batch, &step.seqs, &x)))
    }

    /// Norm, the MLP (dense, or routed to experts), all-reduced, output
    /// norm, residual.
    fn mlp_block(
        &self,
        li: usize,
        layer: &Layer,
        x: &mut [f32],
        s: &mut Step<'_>,
        peers: &mut dyn ShardPeers,
    ) -> Result<()> {
        let (t, eps) = (s.rows, self.config.rms_norm_eps);
        let act = self.config.arch.activation;
        input_norm(x, layer.mlp_norm.as_deref(), eps, &mut s.h);
        match &layer.mlp {
            Mlp::Dense(mlp) => {
                let scratch = (&mut s.gate[..], &mut s.up[..]);
                let lora = s.lora.layer(li);
                mlp.forward(&s.h, t, (act, self.matmul), lora, scratch, &mut s.proj);
            }
            Mlp::Sparse(moe) => moe.forward(&s.h, t, act, self.matmul, &mut s.proj),
        }
        if self.shard.tp_size > 1 {
            peers.all_reduce(&mut s.proj)?;
        }
        if let Some(n) = &layer.mlp_out_norm {
            rms_norm_in_place(&mut s.proj, n, eps);
        }
        self.residual_add(x, &mut s.proj);
        Ok(())
    }

    /// `x += out`, `out` scaled first where the family scales its blocks'
    /// outputs (Granite).
    fn residual_add(&self, x: &mut [f32], out: &mut [f32]) {
        if let Some(r) = self.config.arch.residual_scale {
            scale_in_place(out, r);
        }
        add_in_place(x, out);
    }

    /// Final norm and head over the rows whose logits were asked for, then
    /// the family's final soft cap.
    fn logits(&self, batch: &[SeqInput<'_>], seqs: &[AttnSeq<'_>], x: &[f32]) -> Logits {
        let c = &self.config;
        let hsz = c.hidden_size;
        let mut rows = Vec::new();
        let mut starts = Vec::with_capacity(batch.len() + 1);
        for (s, seq) in batch.iter().zip(seqs) {
            starts.push(rows.len());
            if s.all_logits {
                rows.extend(seq.row..seq.row + seq.len);
            } else {
                rows.push(seq.row + seq.len - 1);
            }
        }
        starts.push(rows.len());
        let mut sel = vec![0.0f32; rows.len() * hsz];
        for (dst, &r) in sel.chunks_exact_mut(hsz).zip(&rows) {
            rms_norm(
                &x[r * hsz..(r + 1) * hsz],
                &self.final_norm,
                c.rms_norm_eps,
                dst,
            );
        }
        let vocab = c.vocab_size;
        let mut data = vec![0.0f32; rows.len() * vocab];
        let m = rows.len();
        match &self.head_form {
            Some(HeadForm::Int4(head)) => {
                linear_residual_int4(&sel, m, head, self.matmul, &mut data)
            }
            Some(HeadForm::Blocks(head)) => {
                kernels::linear_ggml(&sel, m, head, None, self.matmul, &mut data)
            }
            Some(HeadForm::Panels(w)) => kernels::linear_panels(
                &sel,
                m,
                &mut [kernels::PanelLinear {
                    w,
                    bias: None,
                    out: &mut data,
                }],
            ),
            None => kernels::linear(&sel, m, self.head(), None, self.matmul, &mut data),
        }
        if let Some(divisor) = c.arch.logits_divisor {
            for v in &mut data {
                *v /= divisor;
            }
        }
        if let Some(cap) = c.arch.final_softcap {
            softcap_in_place(&mut data, cap);
        }
        Logits {
            data,
            vocab,
            starts,
        }
    }
}

/// A block's input: RMSNorm-ed where the family norms inputs, else `x`
/// itself (OLMo 2's post-norm blocks).
fn input_norm(x: &[f32], weight: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    match weight {
        Some(w) => rms_norm(x, w, eps, out),
        None => out[..x.len()].copy_from_slice(x),
    }
}
