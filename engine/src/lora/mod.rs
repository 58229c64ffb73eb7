//! LoRA adapters: many fine-tunes of one base model served side by side.
//!
//! An adapter is PEFT's format (`adapter_config.json` +
//! `adapter_model.safetensors`): for some linear layers `W` of the base
//! model, a low-rank pair `A` (`[r, in]`) and `B` (`[out, r]`) so the layer
//! computes `y = x Wᵀ + s · (x Aᵀ) Bᵀ`, with `s = lora_alpha / r` (or
//! `/ √r` with `use_rslora`). The base weights are never touched: one step
//! runs every row of the batch through the base GEMM once, then adds each
//! row's own adapter's low-rank update ([`LoraRows::apply`]) — rows of
//! different adapters, and rows of none, in one batch (the Punica/SGMV
//! idea, on the CPU one row at a time: the update costs `r · (in + out)`
//! multiply-adds per row against the base's `in · out`). A row's update is
//! independent of its neighbours, so a request gets the same tokens alone
//! or batched with other adapters.
//!
//! What can be adapted: the q/k/v/o projections of every layer, and the
//! gate/up/down projections of dense MLP layers (not experts, not fused
//! projections, not the embedding or head); a tensor naming anything else
//! is refused by name. The scale is folded into `Bᵀ` at load.
//!
//! An adapter's weights are hashed at load ([`LoraAdapter::digest`]); the
//! prefix cache chains a request's block hashes from
//! [`tandem_block_hash::adapter_root`] of it, so a prefix computed under one
//! adapter never serves another (or the base model).

mod apply;
mod registry;
mod synth;

pub(crate) use apply::{LayerLora, LoraRows};
pub use registry::{AdapterInfo, LoraRegistry, LoraSettings};
pub use synth::write_random_adapter;

use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use tandem_block_hash::BlockHash;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kernels::{axpy_f32, dot_f32};

/// The largest rank an adapter may have unless configured otherwise.
pub const DEFAULT_MAX_LORA_RANK: usize = 64;
/// The largest rank any configuration allows.
pub const MAX_LORA_RANK: usize = 512;

/// A linear layer an adapter may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraTarget {
    /// Every target, attention first.
    pub const ALL: [LoraTarget; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// The module's name in Hugging Face checkpoints.
    pub fn module(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    fn from_module(parent: &str, module: &str) -> Option<Self> {
        let t = Self::ALL.into_iter().find(|t| t.module() == module)?;
        let want = match t {
            Self::Q | Self::K | Self::V | Self::O => "self_attn",
            Self::Gate | Self::Up | Self::Down => "mlp",
        };
        (parent == want).then_some(t)
    }

    fn is_mlp(self) -> bool {
        matches!(self, Self::Gate | Self::Up | Self::Down)
    }

    /// `(in, out)` features of this layer in the base model.
    fn shape(self, c: &ModelConfig) -> (usize, usize) {
        let (h, q, kv, i) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        match self {
            Self::Q => (h, q),
            Self::K | Self::V => (h, kv),
            Self::O => (q, h),
            Self::Gate | Self::Up => (h, i),
            Self::Down => (i, h),
        }
    }
}

/// One adapted layer's low-rank pair.
#[derive(Debug)]
struct LowRank {
    rank: usize,
    inp: usize,
    out: usize,
    /// `A`, `[rank][inp]`.
    a: Vec<f32>,
    /// `s · Bᵀ`, `[rank][out]`: the update of a row is `Σ_j (x·A_j) bt_j`.
    bt: Vec<f32>,
}

impl LowRank {
    /// `s · (x Aᵀ) Bᵀ` for rows `rows` of `x` (rows of `self.inp`), as
    /// `rows.len()` rows of `self.out`: `A_j` and `Bᵀ_j` are read once for
    /// all the rows. Each row's sums run in the same order whatever the
    /// other rows, so a row's update does not depend on its company.
    fn delta(&self, x: &[f32], rows: &[usize]) -> Vec<f32> {
        let (n, r, inp, out) = (rows.len(), self.rank, self.inp, self.out);
        let mut t = vec![0.0f32; n * r];
        for j in 0..r {
            let a = &self.a[j * inp..(j + 1) * inp];
            for (k, &row) in rows.iter().enumerate() {
                t[k * r + j] = dot_f32(&x[row * inp..(row + 1) * inp], a);
            }
        }
        let mut y = vec![0.0f32; n * out];
        for j in 0..r {
            let bt = &self.bt[j * out..(j + 1) * out];
            for (k, yk) in y.chunks_exact_mut(out).enumerate() {
                axpy_f32(yk, t[k * r + j], bt);
            }
        }
        y
    }
}

/// A loaded adapter.
#[derive(Debug)]
pub struct LoraAdapter {
    name: String,
    digest: u64,
    rank: usize,
    /// Per base layer, per [`LoraTarget`] (in `ALL` order).
    layers: Vec<[Option<LowRank>; 7]>,
}

impl LoraAdapter {
    /// Loads a PEFT adapter directory for a base model of `config`,
    /// refusing (by name) what does not fit it or what tandem does not run.
    pub fn load(name: &str, dir: &Path, config: &ModelConfig, max_rank: usize) -> Result<Self> {
        let bad = |msg: String| EngineError::InvalidCheckpoint(format!("adapter `{name}`: {msg}"));
        if config.arch.mla.is_some() {
            // Its projections are not q/k/v/o per head; an adapter of them
            // would have nothing to apply to.
            return Err(EngineError::Unsupported(format!(
                "adapter `{name}`: LoRA on a model with multi-head latent attention \
                 ({})",
                config.architecture.hf_name()
            )));
        }
        let cfg_path = dir.join("adapter_config.json");
        let cfg_bytes = read(&cfg_path, "a PEFT adapter's config")?;
        let cfg: Value =
            serde_json::from_slice(&cfg_bytes).map_err(|source| EngineError::Json {
                path: cfg_path.clone(),
                source,
            })?;
        let alpha = PeftConfig::read(&cfg).map_err(bad)?;
        let weights_path = dir.join("adapter_model.safetensors");
        let bytes = read(&weights_path, "a PEFT adapter's weights")?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("{e}")))?;
        let mut layers: Vec<[Option<LowRank>; 7]> =
            (0..config.num_layers).map(|_| Default::default()).collect();
        let mut rank = 0;
        for (tensor, view) in st.tensors() {
            let Some(prefix) = tensor.strip_suffix(".lora_A.weight") else {
                if tensor.ends_with(".lora_B.weight") {
                    continue; // read with its A
                }
                return Err(bad(format!(
                    "tensor `{tensor}` is not a LoRA A/B weight (DoRA, biases and \
                     modules_to_save are not supported)"
                )));
            };
            let (layer, target) = parse_module(prefix, config).map_err(&bad)?;
            let (inp, out) = target.shape(config);
            let a = to_f32(&view).map_err(|e| bad(format!("`{tensor}`: {e}")))?;
            let r = match view.shape() {
                [r, i] if *i == inp => *r,
                s => {
                    return Err(bad(format!(
                        "tensor `{tensor}` has shape {s:?}; the base model's {} of layer \
                         {layer} takes {inp} inputs (an adapter of another base model?)",
                        target.module()
                    )))
                }
            };
            if r == 0 || r > max_rank {
                return Err(bad(format!(
                    "rank {r} of `{prefix}` is outside 1..={max_rank} (max_lora_rank)"
                )));
            }
            let b_name = format!("{prefix}.lora_B.weight");
            let b_view = st
                .tensor(&b_name)
                .map_err(|_| bad(format!("tensor `{b_name}` is missing")))?;
            if b_view.shape() != [out, r] {
                return Err(bad(format!(
                    "tensor `{b_name}` has shape {:?}; the base model's {} of layer {layer} \
                     needs [{out}, {r}] (an adapter of another base model?)",
                    b_view.shape(),
                    target.module()
                )));
            }
            let b = to_f32(&b_view).map_err(|e| bad(format!("`{b_name}`: {e}")))?;
            let scale = alpha.scale(r);
            let mut bt = vec![0.0f32; r * out];
            for o in 0..out {
                for j in 0..r {
                    bt[j * out + o] = scale * b[o * r + j];
                }
            }
            rank = rank.max(r);
            layers[layer][target as usize] = Some(LowRank {
                rank: r,
                inp,
                out,
                a,
                bt,
            });
        }
        if rank == 0 {
            return Err(bad("it adapts no layer".into()));
        }
        let mut digest = xxhash_rust::xxh3::Xxh3::new();
        digest.update(&cfg_bytes);
        digest.update(&bytes);
        Ok(Self {
            name: name.to_string(),
            digest: digest.digest(),
            rank,
            layers,
        })
    }

    /// The name requests use.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A hash of its config and weights.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// Where its requests' block-hash chains start.
    pub fn hash_root(&self) -> BlockHash {
        tandem_block_hash::adapter_root(self.digest)
    }

    /// Its largest rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes of its weights in memory.
    pub fn bytes(&self) -> usize {
        let pairs = self.layers.iter().flatten().flatten();
        pairs.map(|p| 4 * (p.a.len() + p.bt.len())).sum()
    }

    fn pair(&self, layer: usize, target: LoraTarget) -> Option<&LowRank> {
        self.layers.get(layer)?[target as usize].as_ref()
    }
}

/// One file of an adapter's directory, whole.
fn read(path: &Path, what: &'static str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => EngineError::MissingFile {
            path: path.to_path_buf(),
            what,
        },
        _ => EngineError::Io {
            path: path.to_path_buf(),
            source: e,
        },
    })
}

/// What of `adapter_config.json` decides the numbers.
struct PeftConfig {
    alpha: f32,
    rslora: bool,
}

impl PeftConfig {
    fn read(cfg: &Value) -> std::result::Result<Self, String> {
        let field = |k: &str| cfg.get(k).filter(|v| !v.is_null());
        if let Some(t) = field("peft_type").and_then(Value::as_str) {
            if t != "LORA" {
                return Err(format!("peft_type is {t}; only LORA adapters are served"));
            }
        }
        let flag = |k: &str| field(k).and_then(Value::as_bool).unwrap_or(false);
        for refused in ["use_dora", "fan_in_fan_out"] {
            if flag(refused) {
                return Err(format!("{refused} is not supported"));
            }
        }
        if let Some(b) = field("bias").and_then(Value::as_str) {
            if b != "none" {
                return Err(format!("bias is \"{b}\"; only \"none\" is supported"));
            }
        }
        let non_empty = |k: &str| match field(k) {
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
            None => false,
        };
        for refused in ["modules_to_save", "alpha_pattern"] {
            if non_empty(refused) {
                return Err(format!("{refused} is not supported"));
            }
        }
        let alpha = field("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or("lora_alpha is missing")?;
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(format!("lora_alpha must be positive, got {alpha}"));
        }
        Ok(Self {
            alpha: alpha as f32,
            rslora: flag("use_rslora"),
        })
    }

    /// PEFT's scale for a pair of rank `r` (its `rank_pattern` shows in the
    /// tensors' shapes).
    fn scale(&self, r: usize) -> f32 {
        match self.rslora {
            true => self.alpha / (r as f32).sqrt(),
            false => self.alpha / r as f32,
        }
    }
}

/// A standard normal sample (Box–Muller).
pub(crate) fn normal(rng: &mut crate::sampling::Rng) -> f32 {
    let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
    let u2 = rng.next_f64();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// `…layers.{i}.{self_attn|mlp}.{module}` → the layer and target.
fn parse_module(prefix: &str, c: &ModelConfig) -> std::result::Result<(usize, LoraTarget), String> {
    let unknown = || {
        format!(
            "`{prefix}` is not a layer tandem can adapt (q/k/v/o_proj of attention, \
             gate/up/down_proj of a dense MLP)"
        )
    };
    let (_, rest) = prefix.rsplit_once(".layers.").ok_or_else(unknown)?;
    let parts: Vec<&str> = rest.split('.').collect();
    let [layer, parent, module] = parts[..] else {
        return Err(unknown());
    };
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    let target = LoraTarget::from_module(parent, module).ok_or_else(unknown)?;
    if layer >= c.num_layers {
        return Err(format!(
            "`{prefix}`: the base model has {} layers",
            c.num_layers
        ));
    }
    if target.is_mlp() && c.arch.moe.as_ref().is_some_and(|m| m.is_sparse(layer)) {
        return Err(format!(
            "`{prefix}`: layer {layer}'s MLP is a mixture of experts; only attention \
             projections of sparse layers can be adapted"
        ));
    }
    Ok((layer, target))
}

fn to_f32(view: &safetensors::tensor::TensorView<'_>) -> std::result::Result<Vec<f32>, String> {
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => return Err(format!("dtype {other:?} (supported: F32, BF16, F16)")),
    })
}
