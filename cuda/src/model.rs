//! [`CudaModel`]: the engine's flattened-batch forward pass on a GPU.
//!
//! Same semantics as `tandem_engine::Model::forward`: a batch of sequences,
//! each with new tokens, a start position and a block table, in one pass.
//! Weights live in device memory as f32 or bf16, with q/k/v and gate/up
//! fused into one matrix each (one GEMM instead of three and two);
//! activations are f32; the KV pool is `[layer][block][kv_head][slot][dim]`
//! as on the CPU, in f32 or bf16.
//!
//! A step: the host flattens the batch ([`StepLayout`]) and uploads it into
//! fixed device buffers, then the layer loop runs on the stream. A decode
//! batch that fits a captured size replays a CUDA graph of that loop instead
//! of launching ~12 kernels per layer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::borrow::Cow;
use tandem_engine::kernels::{MatmulPolicy, RopeTable};
use tandem_engine::weights::{Matrix, WeightData, WeightStore};

use tandem_engine::{
    BlockCopy, BlockId, ComputeBackend, EngineError, KvBlocks, KvLayout, Logits, ModelConfig,
    SeqInput, SlidingLayers,
};

use crate::arch::{check_supported, layer_plan, Fused};
use crate::device::{Arg, DevBuf, Gemm, GemmType, Gpu};
use crate::error::CudaError;
use crate::graphs::GraphSizes;
use crate::layout::{choose_splits, heads_per_cta, LayoutShape, StepLayout};

mod blocks;
mod load;
mod step;

type Result<T> = std::result::Result<T, CudaError>;

/// Storage type of weights or KV on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceDType {
    F32,
    Bf16,
}

impl DeviceDType {
    fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }

    fn gemm(self) -> GemmType {
        match self {
            Self::F32 => GemmType::F32,
            Self::Bf16 => GemmType::Bf16,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

/// How to build a [`CudaModel`].
#[derive(Debug, Clone)]
pub struct CudaOptions {
    pub device: usize,
    /// Weight storage: f32 for exact parity with the CPU engine, bf16 for speed.
    pub weights: DeviceDType,
    pub kv: DeviceDType,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Most rows (new tokens) one step may have.
    pub max_tokens: usize,
    /// Most sequences one step may have.
    pub max_seqs: usize,
    /// Most rows whose logits one step may ask for.
    pub max_logit_rows: usize,
    /// Context limit; sets the block-table stride.
    pub max_model_len: usize,
    /// Largest decode batch replayed from a CUDA graph; 0 turns graphs off.
    pub graph_max_batch: usize,
    pub ptx_cache: PathBuf,
}

impl CudaOptions {
    /// Defaults for `config`: bf16 weights and KV, 16-token blocks.
    pub fn new(config: &ModelConfig, num_blocks: usize) -> Self {
        Self {
            device: 0,
            weights: DeviceDType::Bf16,
            kv: DeviceDType::Bf16,
            block_size: 16,
            num_blocks,
            max_tokens: 4096,
            max_seqs: 256,
            max_logit_rows: 256,
            max_model_len: config.max_position_embeddings,
            graph_max_batch: 256,
            ptx_cache: crate::ptx::default_cache_dir(),
        }
    }
}

/// A row-major `[rows, cols]` weight matrix on the device.
#[derive(Debug)]
struct DevMatrix {
    buf: DevBuf,
    rows: usize,
    cols: usize,
}

#[derive(Debug)]
struct DevLayer {
    input_norm: DevBuf,
    /// Per-head q and k RMSNorm weights (`head_dim` each), if any.
    qk_norm: Option<(DevBuf, DevBuf)>,
    qkv: DevMatrix,
    qkv_bias: Option<DevBuf>,
    o: DevMatrix,
    o_bias: Option<DevBuf>,
    post_norm: DevBuf,
    gate_up: DevMatrix,
    gate_up_bias: Option<DevBuf>,
    down: DevMatrix,
    down_bias: Option<DevBuf>,
}

/// Fixed device buffers for one step's inputs and activations.
#[derive(Debug)]
struct Scratch {
    x: DevBuf,
    h: DevBuf,
    qkv: DevBuf,
    attn: DevBuf,
    attn_in: DevBuf,
    gate_up: DevBuf,
    act: DevBuf,
    final_h: DevBuf,
    logits: DevBuf,
    part_o: DevBuf,
    part_ml: DevBuf,
    tokens: DevBuf,
    positions: DevBuf,
    slots: DevBuf,
    tiles: DevBuf,
    block_tables: DevBuf,
    logit_rows: DevBuf,
    inv_freq: DevBuf,
    sampled: DevBuf,
    /// cuBLAS workspace, set explicitly so graph capture never allocates.
    _blas_workspace: DevBuf,
}

/// What a step left on the device: logits rows and where each sequence's start.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Rows of logits computed (padding included).
    pub rows: usize,
    /// Per real sequence, its first logits row, plus an end marker.
    pub starts: Vec<usize>,
}

/// Most flash-decoding splits per (row, head).
const MAX_SPLITS: usize = 16;
/// Splitting is only used for steps of at most this many rows.
const SPLIT_ROWS: usize = 512;
/// Steps of at most this many rows use the GEMV kernel (`GEMV_MAX_ROWS`).
const GEMV_MAX_ROWS: usize = 8;

/// Every weight of the model, on the device.
#[derive(Debug)]
struct DevWeights {
    embed: DevMatrix,
    layers: Vec<DevLayer>,
    final_norm: DevBuf,
    /// `None` when tied to the embedding.
    lm_head: Option<DevMatrix>,
}

/// The model on a GPU, with its KV pool.
pub struct CudaModel {
    gpu: Gpu,
    config: ModelConfig,
    opts: CudaOptions,
    weights: DevWeights,
    /// Per layer: (K pool, V pool).
    kv: Vec<(DevBuf, DevBuf)>,
    scratch: Scratch,
    shape: LayoutShape,
    hpc: usize,
    graph_sizes: GraphSizes,
    graphs: HashMap<usize, SendGraph>,
}

/// A captured graph that may move to another thread with its model.
struct SendGraph(cudarc::driver::CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as uses are not
// concurrent (CUDA's graph thread-safety rules); it is only reached through
// its `CudaModel`, whose `&mut`/`&` borrows serialise every use, and the
// context is bound on the using thread before each launch.
unsafe impl Send for SendGraph {}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModel")
            .field("gpu", &self.gpu)
            .field("layers", &self.weights.layers.len())
            .field("opts", &self.opts)
            .finish()
    }
}

impl CudaModel {
    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The options the model was built with.
    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    /// Bytes of weights read by one forward pass (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        let m = |x: &DevMatrix| x.buf.bytes;
        let layers: usize = self
            .weights
            .layers
            .iter()
            .map(|l| m(&l.qkv) + m(&l.o) + m(&l.gate_up) + m(&l.down))
            .sum();
        layers + m(self.head())
    }

    fn head(&self) -> &DevMatrix {
        self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed)
    }

    /// Uploads a step's layout: every per-step buffer the kernels read.
    fn upload_layout(&self, l: &StepLayout) -> Result<()> {
        let s = &self.scratch;
        let g = &self.gpu;
        if l.rows() > self.opts.max_tokens {
            return Err(CudaError::InvalidBatch(format!(
                "{} tokens in one step (at most {})",
                l.rows(),
                self.opts.max_tokens
            )));
        }
        if l.logit_rows.len() > self.opts.max_logit_rows {
            return Err(CudaError::InvalidBatch(format!(
                "{} logits rows in one step (at most {})",
                l.logit_rows.len(),
                self.opts.max_logit_rows
            )));
        }
        g.upload(s.tokens.ptr, s.tokens.bytes, &l.tokens)?;
        g.upload(s.positions.ptr, s.positions.bytes, &l.positions)?;
        g.upload(s.slots.ptr, s.slots.bytes, &l.slots)?;
        g.upload(s.tiles.ptr, s.tiles.bytes, &l.tiles)?;
        g.upload(s.block_tables.ptr, s.block_tables.bytes, &l.block_tables)?;
        g.upload(s.logit_rows.ptr, s.logit_rows.bytes, &l.logit_rows)
    }

    /// Runs one step: writes the new tokens' K/V into their blocks and leaves
    /// the asked-for logits on the device (read them with [`Self::logits`] or
    /// [`Self::argmax`]).
    pub fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<StepOutput> {
        if batch.len() > self.opts.max_seqs {
            return Err(CudaError::InvalidBatch(format!(
                "{} sequences in one step (at most {})",
                batch.len(),
                self.opts.max_seqs
            )));
        }
        if let Some(&bad) = batch
            .iter()
            .flat_map(|s| s.tokens)
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(CudaError::InvalidBatch(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.config.vocab_size
            )));
        }
        let decode_only = batch.iter().all(|s| s.tokens.len() == 1 && !s.all_logits);
        let graph_size = if decode_only && self.opts.graph_max_batch > 0 {
            self.graph_sizes.pick(batch.len())
        } else {
            None
        };
        let layout = StepLayout::build(batch, self.shape, graph_size)?;
        self.upload_layout(&layout)?;
        let starts = layout.logit_starts.clone();
        match graph_size {
            Some(p) => {
                if !self.graphs.contains_key(&p) {
                    let graph = self.capture(p)?;
                    self.graphs.insert(p, SendGraph(graph));
                }
                if let Some(graph) = self.graphs.get(&p) {
                    graph
                        .0
                        .launch()
                        .map_err(|e| CudaError::driver("graph launch", e))?;
                }
                Ok(StepOutput { rows: p, starts })
            }
            None => {
                let splits =
                    self.splits_for(layout.rows(), layout.num_tiles(), layout.max_context_blocks);
                self.run(
                    layout.rows(),
                    layout.num_tiles(),
                    layout.max_tile_rows,
                    splits,
                    layout.logit_rows.len(),
                )?;
                Ok(StepOutput {
                    rows: layout.logit_rows.len(),
                    starts,
                })
            }
        }
    }

    fn splits_for(&self, rows: usize, tiles: usize, context_blocks: usize) -> usize {
        if rows > SPLIT_ROWS.min(self.opts.max_tokens) {
            return 1;
        }
        let ctas = tiles * (self.config.num_heads / self.hpc);
        choose_splits(ctas, self.gpu.sm_count, context_blocks, MAX_SPLITS)
    }

    /// Captures the layer loop for a padded decode batch of `p` rows.
    fn capture(&self, p: usize) -> Result<cudarc::driver::CudaGraph> {
        let splits = self.splits_for(p, p, self.shape.max_blocks);
        self.gpu.sync()?;
        self.gpu.begin_capture()?;
        let ran = self.run(p, p, 1, splits, p);
        let graph = self.gpu.end_capture();
        ran?;
        let graph = graph?;
        tracing::debug!(batch = p, splits, "captured decode graph");
        Ok(graph)
    }

    /// `y = rms_norm(x) · wᵀ` for the residual stream `x`: RMSNorm into `h`
    /// (in the GEMM's input type), then the GEMM. (Fusing the norm into the
    /// decode GEMV, each CTA normalising the rows into shared memory, was
    /// measured slower on an H200: the per-CTA prologue delays the stream.)
    fn norm_matmul(&self, norm: &DevBuf, w: &DevMatrix, y: u64, rows: usize) -> Result<()> {
        let s = &self.scratch;
        self.rms_norm(norm, s.h.ptr, rows, 0)?;
        self.matmul(s.h.ptr, w, y, rows, 0.0)
    }

    /// `out[r] = rms_norm(x[gather[r]])` (`gather` 0: row `r`), in the GEMM
    /// input type.
    fn rms_norm(&self, weight: &DevBuf, out: u64, rows: usize, gather: u64) -> Result<()> {
        let kernel = match self.opts.weights {
            DeviceDType::F32 => "rms_norm_f32",
            DeviceDType::Bf16 => "rms_norm_bf16",
        };
        self.gpu.launch(
            kernel,
            (rows as u32, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(self.scratch.x.ptr),
                Arg::Ptr(weight.ptr),
                Arg::Ptr(out),
                Arg::Ptr(gather),
                Arg::I32(self.config.hidden_size as i32),
                Arg::F32(self.config.rms_norm_eps),
            ],
        )
    }

    /// `y[rows, w.rows] = x · wᵀ + beta · y`: our GEMV for a few bf16 rows
    /// (decode), cuBLAS otherwise.
    fn matmul(&self, x: u64, w: &DevMatrix, y: u64, rows: usize, beta: f32) -> Result<()> {
        let wty = self.opts.weights;
        if wty == DeviceDType::Bf16 && rows <= GEMV_MAX_ROWS && w.cols.is_multiple_of(8) {
            let warps_per_block = 8;
            return self.gpu.launch(
                "gemv_bf16",
                (w.rows.div_ceil(warps_per_block) as u32, 1, 1),
                (warps_per_block * 32) as u32,
                0,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(w.buf.ptr),
                    Arg::Ptr(y),
                    Arg::I32(rows as i32),
                    Arg::I32(w.rows as i32),
                    Arg::I32(w.cols as i32),
                    Arg::F32(beta),
                ],
            );
        }
        self.gpu.gemm(Gemm {
            ty: wty.gemm(),
            x,
            w: w.buf.ptr,
            y,
            t: rows,
            n: w.rows,
            k: w.cols,
            beta,
        })
    }

    fn embed_ty(&self) -> DeviceDType {
        self.opts.weights
    }

    /// Copies a step's logits to the host as the engine's [`Logits`].
    pub fn logits(&self, out: &StepOutput) -> Result<Logits> {
        let vocab = self.config.vocab_size;
        let n = out.starts.last().copied().unwrap_or(0);
        let mut data = vec![0.0f32; n * vocab];
        self.gpu.download(&mut data, self.scratch.logits.ptr)?;
        Ok(Logits::from_rows(data, vocab, out.starts.clone()))
    }

    /// Greedy tokens on the device: the argmax of each sequence's last row.
    pub fn argmax(&self, out: &StepOutput) -> Result<Vec<u32>> {
        let vocab = self.config.vocab_size as i32;
        self.gpu.launch(
            "argmax_rows",
            (out.rows.max(1) as u32, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(self.scratch.logits.ptr),
                Arg::I32(vocab),
                Arg::Ptr(self.scratch.sampled.ptr),
            ],
        )?;
        self.last_rows(out)
    }

    fn last_rows(&self, out: &StepOutput) -> Result<Vec<u32>> {
        let mut all = vec![0i32; out.rows];
        self.gpu.download(&mut all, self.scratch.sampled.ptr)?;
        Ok(out
            .starts
            .windows(2)
            .map(|w| all[w[1] - 1] as u32)
            .collect())
    }

    /// Runs `batch` eagerly (no graph) with every launch timed; returns per
    /// kernel: seconds and launches. For finding where a step's time goes.
    pub fn profile_step(
        &mut self,
        batch: &[SeqInput<'_>],
    ) -> Result<Vec<(&'static str, f64, usize)>> {
        let layout = StepLayout::build(batch, self.shape, None)?;
        self.upload_layout(&layout)?;
        let splits = self.splits_for(layout.rows(), layout.num_tiles(), layout.max_context_blocks);
        self.gpu.sync()?;
        self.gpu.start_profile();
        let ran = self.run(
            layout.rows(),
            layout.num_tiles(),
            layout.max_tile_rows,
            splits,
            layout.logit_rows.len(),
        );
        let profile = self.gpu.finish_profile();
        ran?;
        profile
    }

    /// Device time of one replay of the batch-`p` decode graph, mean of `n`
    /// back-to-back replays of the last uploaded step (no host work between
    /// them): what a step costs the GPU, without the host's share.
    pub fn graph_replay_secs(&self, p: usize, n: usize) -> Result<f64> {
        let graph = self
            .graphs
            .get(&p)
            .ok_or_else(|| CudaError::Unsupported(format!("no graph captured for batch {p}")))?;
        let secs = self.gpu.time(|| {
            for _ in 0..n {
                graph
                    .0
                    .launch()
                    .map_err(|e| CudaError::driver("graph launch", e))?;
            }
            Ok(())
        })?;
        Ok(secs / n.max(1) as f64)
    }

    /// The decode batch sizes with a captured graph so far.
    pub fn captured_graphs(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.graphs.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The suffix of this model's KV kernels (`f32` or `bf16`).
    pub fn kv_dtype_name(&self) -> &'static str {
        self.opts.kv.suffix()
    }
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Engine(inner) => inner,
            CudaError::InvalidBatch(m) => EngineError::InvalidRequest(m),
            CudaError::Unsupported(m) => EngineError::Unsupported(m),
            other => EngineError::Backend {
                device: "cuda",
                message: other.to_string(),
            },
        }
    }
}

/// Bytes one KV block takes on the device, every layer's K and V: what a
/// byte budget for the pool is divided by.
pub fn kv_block_bytes(config: &ModelConfig, block_size: usize, kv: DeviceDType) -> usize {
    2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim * kv.size()
}

/// The attention kernel for a KV dtype and head size (one instantiation per
/// supported head size, so a lane's slice of the head stays in registers).
fn attention_kernel(kv: DeviceDType, head_dim: usize, decode: bool) -> Result<&'static str> {
    let suffix = if decode { "_decode" } else { "" };
    let want = format!("attention_{}_{head_dim}{suffix}", kv.suffix());
    crate::KERNEL_NAMES
        .iter()
        .copied()
        .find(|&n| n == want)
        .ok_or_else(|| {
            CudaError::Unsupported(format!(
                "head_dim {head_dim} (attention kernels exist for 16, 32, 64, 128 and 256)"
            ))
        })
}
