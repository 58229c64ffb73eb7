//! The Llama-family decoder and its forward pass over a flattened batch.
//!
//! One [`Model::forward`] call takes any mix of sequences, each with its new
//! tokens, the position of the first one and its block table: a 500-token
//! prefill chunk of one request and single decode tokens of thirty others run
//! as one `[total_tokens, hidden]` activation matrix through every GEMM. Only
//! attention looks at sequence boundaries. This is what lets chunked prefill
//! and continuous batching be one mechanism in the scheduler.
//!
//! Llama, Mistral and Qwen2 differ only in data: biases are used when the
//! checkpoint has them (Qwen2's q/k/v, Llama's `attention_bias`), sliding
//! windows come from the config, and a tied head reuses the embedding matrix.
//!
//! A linear layer's weight is dense (the checkpoint's dtype, read in place)
//! or INT4 ([`crate::quant`]): loaded so from an AWQ/GPTQ checkpoint, or
//! quantized at load by [`Model::quantize_int4`] (which also quantizes the
//! output head; the embedding always stays dense).

use std::path::Path;

use crate::attention::{paged_attention, AttnSeq, Heads};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kernels::{
    self, add_in_place, linear, linear_int4, rms_norm, silu_mul, MatmulPolicy, RopeTable,
};
use crate::kv_cache::{BlockId, KvCache, KvLayout};
use crate::quant::hf::HfQuantization;
use crate::quant::{Int4Config, Int4Matrix};
use crate::shard::{NoPeers, ShardPeers, ShardSpec};
use crate::weights::{DType, Matrix, WeightStore};

/// A linear layer's weight: dense in the checkpoint's dtype, or INT4.
#[derive(Debug)]
enum LinearWeight {
    Dense(Matrix),
    Int4(Int4Matrix),
}

impl LinearWeight {
    fn bytes(&self) -> usize {
        match self {
            Self::Dense(m) => m.bytes(),
            Self::Int4(q) => q.bytes(),
        }
    }

    fn is_mapped(&self) -> bool {
        match self {
            Self::Dense(m) => m.is_mapped(),
            Self::Int4(_) => false,
        }
    }
}

/// A weight matrix with an optional bias.
#[derive(Debug)]
struct Linear {
    w: LinearWeight,
    b: Option<Vec<f32>>,
}

/// Which part of a `[out, in]` linear layer a tensor-parallel rank holds.
#[derive(Debug, Clone)]
enum Split {
    Whole,
    /// Column-parallel: these output features (weight rows, bias elements).
    Outputs(std::ops::Range<usize>),
    /// Row-parallel: these input features (weight columns); the bias is
    /// added by the rank that `keeps_bias` only, so the all-reduce adds it
    /// once.
    Inputs {
        range: std::ops::Range<usize>,
        keeps_bias: bool,
    },
}

impl Linear {
    /// Loads a rank's part of the layer (reading only that part):
    /// `prefix.weight`, or the `prefix.qweight` family of a pre-quantized
    /// checkpoint (whole layers only).
    fn load_part(
        ws: &WeightStore,
        quant: Option<&HfQuantization>,
        prefix: &str,
        out: usize,
        inp: usize,
        split: Split,
    ) -> Result<Self> {
        let name = format!("{prefix}.weight");
        let bias = format!("{prefix}.bias");
        let packed = quant.filter(|_| ws.contains(&format!("{prefix}.qweight")));
        match (packed, split) {
            (Some(q), Split::Whole) => Ok(Self {
                w: LinearWeight::Int4(q.load_linear(ws, prefix, out, inp)?),
                b: ws.optional_vector(&bias, out)?,
            }),
            (Some(_), _) => Err(EngineError::Unsupported(format!(
                "{prefix}: pre-quantized (AWQ/GPTQ) checkpoints run without tensor parallelism"
            ))),
            (None, Split::Whole) => Ok(Self {
                w: LinearWeight::Dense(ws.matrix(&name, out, inp)?),
                b: ws.optional_vector(&bias, out)?,
            }),
            (None, Split::Outputs(rows)) => Ok(Self {
                w: LinearWeight::Dense(ws.matrix_rows(&name, out, inp, rows.clone())?),
                b: match ws.contains(&bias) {
                    true => Some(ws.vector_part(&bias, out, rows)?),
                    false => None,
                },
            }),
            (None, Split::Inputs { range, keeps_bias }) => Ok(Self {
                w: LinearWeight::Dense(ws.matrix_cols(&name, out, inp, range)?),
                b: match keeps_bias {
                    true => ws.optional_vector(&bias, out)?,
                    false => None,
                },
            }),
        }
    }

    fn forward(&self, x: &[f32], m: usize, policy: MatmulPolicy, out: &mut [f32]) {
        match &self.w {
            LinearWeight::Dense(w) => linear(x, m, w, self.b.as_deref(), policy, out),
            LinearWeight::Int4(w) => linear_int4(x, m, w, self.b.as_deref(), policy, out),
        }
    }

    /// Replaces a dense weight by its INT4 quantization.
    fn quantize(&mut self, config: Int4Config, name: &str) -> Result<()> {
        if let LinearWeight::Dense(m) = &self.w {
            let q = Int4Matrix::quantize(m, config).map_err(|e| match e {
                EngineError::Unsupported(msg) => EngineError::Unsupported(format!("{name}: {msg}")),
                other => other,
            })?;
            self.w = LinearWeight::Int4(q);
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
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
    /// The output head quantized at load (`quantize_int4`), used instead of
    /// the dense one.
    lm_head_int4: Option<Int4Matrix>,
    rope: RopeTable,
    matmul: MatmulPolicy,
    /// The part of the model this rank holds (all of it unless sharded).
    shard: ShardSpec,
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
    /// Loads `config.json` and the safetensors weights of a checkpoint.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ws = WeightStore::open(dir)?;
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
        let config = ModelConfig::from_dir(dir)?;
        let shard = ShardSpec::new(&config, tp, tp_rank, pp, stage)?;
        let ws = WeightStore::open(dir)?;
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
        let (h, d) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out) = (c.num_heads * d, c.num_kv_heads * d);
        let whole = shard.tp_size == 1;
        let (qh, kvh, inter) = (shard.q_heads(c), shard.kv_heads(c), shard.intermediate(c));
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
        let embed = ws.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        let layers = shard
            .layers
            .clone()
            .map(|i| {
                let p = format!("model.layers.{i}");
                let load = |name: &str, out: usize, inp: usize, split: Split| {
                    Linear::load_part(&ws, quant, &format!("{p}.{name}"), out, inp, split)
                };
                let i_size = c.intermediate_size;
                Ok(Layer {
                    input_norm: ws.vector(&format!("{p}.input_layernorm.weight"), h)?,
                    q: load("self_attn.q_proj", q_out, h, outputs(&qh, d))?,
                    k: load("self_attn.k_proj", kv_out, h, outputs(&kvh, d))?,
                    v: load("self_attn.v_proj", kv_out, h, outputs(&kvh, d))?,
                    o: load("self_attn.o_proj", h, q_out, inputs(&qh, d))?,
                    post_norm: ws.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                    gate: load("mlp.gate_proj", i_size, h, outputs(&inter, 1))?,
                    up: load("mlp.up_proj", i_size, h, outputs(&inter, 1))?,
                    down: load("mlp.down_proj", h, i_size, inputs(&inter, 1))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = ws.vector("model.norm.weight", h)?;
        // Some tied checkpoints still carry a copy of the head; use it if so.
        let lm_head = if ws.contains("lm_head.weight") {
            Some(ws.matrix("lm_head.weight", c.vocab_size, h)?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(EngineError::InvalidCheckpoint(
                "tensor `lm_head.weight` is missing and tie_word_embeddings is false".into(),
            ));
        };
        let rope = RopeTable::new(c);
        Ok(Self {
            config,
            embed,
            layers,
            final_norm,
            lm_head,
            lm_head_int4: None,
            rope,
            matmul: MatmulPolicy::default(),
            shard,
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

    /// Chooses speed or batch invariance for the matrix products.
    pub fn set_matmul_policy(&mut self, policy: MatmulPolicy) {
        self.matmul = policy;
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
    /// KV heads) needs for a given block size.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            num_layers: self.layers.len(),
            num_kv_heads: self.shard.kv_heads(&self.config).len(),
            head_dim: self.config.head_dim,
            block_size,
        }
    }

    /// Bytes of weights read per forward pass (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                    .iter()
                    .map(|lin| lin.w.bytes())
                    .sum::<usize>()
            })
            .sum();
        let head = match self.shard.computes_logits() {
            true => self
                .lm_head_int4
                .as_ref()
                .map_or_else(|| self.head().bytes(), Int4Matrix::bytes),
            false => 0,
        };
        layers + head
    }

    /// Quantizes every dense linear layer (attention and MLP projections)
    /// and the output head to INT4 in place; the embedding stays as stored
    /// (a tied head gets its own INT4 copy). Decode reads the head every
    /// step, so it is quantized too, unlike AWQ/GPTQ checkpoints, which keep
    /// it dense (and load so). Layers already INT4 are kept.
    pub fn quantize_int4(&mut self, config: Int4Config) -> Result<()> {
        for (i, l) in self.layers.iter_mut().enumerate() {
            for (name, lin) in [
                ("q_proj", &mut l.q),
                ("k_proj", &mut l.k),
                ("v_proj", &mut l.v),
                ("o_proj", &mut l.o),
                ("gate_proj", &mut l.gate),
                ("up_proj", &mut l.up),
                ("down_proj", &mut l.down),
            ] {
                lin.quantize(config, &format!("layer {i} {name}"))?;
            }
        }
        if self.shard.computes_logits() {
            self.lm_head_int4 = Some(Int4Matrix::quantize(self.head(), config)?);
        }
        Ok(())
    }

    /// How many of the linear layers' matrices are INT4 (out of
    /// `7 × num_layers`).
    pub fn int4_matrices(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
            .filter(|lin| matches!(lin.w, LinearWeight::Int4(_)))
            .count()
    }

    /// The stored dtype of the weight matrices.
    pub fn weight_dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// Whether every weight matrix is read in place from the mapped file.
    pub fn weights_mapped(&self) -> bool {
        self.embed.is_mapped()
            && self.lm_head.as_ref().is_none_or(Matrix::is_mapped)
            && self.layers.iter().all(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                    .iter()
                    .all(|lin| lin.w.is_mapped())
            })
    }

    fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Checks a batch against the vocabulary, the context limit and the cache.
    pub fn validate(&self, batch: &[SeqInput<'_>], kv: &KvCache) -> Result<()> {
        let c = &self.config;
        let want = self.kv_layout(kv.layout().block_size);
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
            if end > c.max_position_embeddings {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence of {end} tokens exceeds max_position_embeddings {}",
                    c.max_position_embeddings
                )));
            }
            let cap = s.blocks.len() * want.block_size;
            if cap < end {
                return Err(EngineError::InvalidRequest(format!(
                    "block table holds {cap} tokens, sequence needs {end}"
                )));
            }
            if let Some(&b) = s.blocks.iter().find(|&&b| b as usize >= kv.num_blocks()) {
                return Err(EngineError::InvalidRequest(format!(
                    "block id {b} is outside the cache ({} blocks)",
                    kv.num_blocks()
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
        let (hsz, d) = (c.hidden_size, c.head_dim);
        let num_heads = self.shard.q_heads(c).len();
        let num_kv_heads = self.shard.kv_heads(c).len();
        let inter = self.shard.intermediate(c).len();
        let (q_out, kv_out) = (num_heads * d, num_kv_heads * d);
        let tensor_parallel = self.shard.tp_size > 1;
        let bs = kv.layout().block_size;

        // Flatten: token ids, positions, and each sequence's row range.
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut seqs = Vec::with_capacity(batch.len());
        for s in batch {
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
        } else {
            peers.recv_activations(&mut x)?;
        }
        let half = d / 2;
        let mut cos = vec![0.0f32; t * half];
        let mut sin = vec![0.0f32; t * half];
        for (i, &p) in positions.iter().enumerate() {
            self.rope.angles(
                p,
                &mut cos[i * half..(i + 1) * half],
                &mut sin[i * half..(i + 1) * half],
            );
        }

        let mut h = vec![0.0f32; t * hsz];
        let mut q = vec![0.0f32; t * q_out];
        let mut k = vec![0.0f32; t * kv_out];
        let mut v = vec![0.0f32; t * kv_out];
        let mut attn = vec![0.0f32; t * q_out];
        let mut proj = vec![0.0f32; t * hsz];
        let mut gate = vec![0.0f32; t * inter];
        let mut up = vec![0.0f32; t * inter];
        let heads = Heads {
            num_heads,
            num_kv_heads,
            head_dim: d,
        };

        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.input_norm, c.rms_norm_eps, &mut h);
            layer.q.forward(&h, t, self.matmul, &mut q);
            layer.k.forward(&h, t, self.matmul, &mut k);
            layer.v.forward(&h, t, self.matmul, &mut v);
            for i in 0..t {
                let (cs, sn) = (
                    &cos[i * half..(i + 1) * half],
                    &sin[i * half..(i + 1) * half],
                );
                self.rope
                    .apply(&mut q[i * q_out..(i + 1) * q_out], d, cs, sn);
                self.rope
                    .apply(&mut k[i * kv_out..(i + 1) * kv_out], d, cs, sn);
            }
            for seq in &seqs {
                for j in 0..seq.len {
                    let pos = seq.start_pos + j;
                    let row = seq.row + j;
                    kv.write(
                        li,
                        seq.blocks[pos / bs],
                        pos % bs,
                        &k[row * kv_out..(row + 1) * kv_out],
                        &v[row * kv_out..(row + 1) * kv_out],
                    );
                }
            }
            after_layer(li, kv);
            let window = c.sliding_window[self.shard.layers.start + li];
            paged_attention(&q, kv, li, &seqs, heads, window, &mut attn);
            layer.o.forward(&attn, t, self.matmul, &mut proj);
            if tensor_parallel {
                peers.all_reduce(&mut proj)?;
            }
            add_in_place(&mut x, &proj);

            rms_norm(&x, &layer.post_norm, c.rms_norm_eps, &mut h);
            layer.gate.forward(&h, t, self.matmul, &mut gate);
            layer.up.forward(&h, t, self.matmul, &mut up);
            silu_mul(&mut gate, &up);
            layer.down.forward(&gate, t, self.matmul, &mut proj);
            if tensor_parallel {
                peers.all_reduce(&mut proj)?;
            }
            add_in_place(&mut x, &proj);
        }
        if !self.shard.last_stage() {
            peers.send_activations(&x)?;
            return Ok(None);
        }
        if !self.shard.computes_logits() {
            return Ok(None);
        }

        // Only the rows whose logits were asked for go through the head.
        let mut rows = Vec::new();
        let mut starts = Vec::with_capacity(batch.len() + 1);
        for (s, seq) in batch.iter().zip(&seqs) {
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
        match &self.lm_head_int4 {
            Some(head) => linear_int4(&sel, rows.len(), head, None, self.matmul, &mut data),
            None => kernels::linear(&sel, rows.len(), self.head(), None, self.matmul, &mut data),
        }
        Ok(Some(Logits {
            data,
            vocab,
            starts,
        }))
    }
}
