//! Loading one decoder layer (this rank's part of it) as the family's
//! [`ArchSpec`](crate::arch::ArchSpec) describes it: split or fused
//! projections, the norms its placement needs, and a dense or sparse MLP.

use crate::arch::{ExpertStorage, LayerTensor, MlaSpec, MoeSpec, Projections, QkNorm, TensorNames};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::quant::hf::HfQuantization;
use crate::weights::WeightStore;

use super::linear::{FusedPart, Linear, Split};
use super::mla::{LatentAttention, LatentQuery};
use super::mlp::{DenseMlp, Mlp, SharedExpert, SparseMlp};
use super::{AttnProj, Layer};

/// Which shard of each projection this rank loads.
pub(super) struct LayerSplits {
    pub(super) q_cols: Split,
    pub(super) kv_cols: Split,
    pub(super) o_rows: Split,
    /// This rank's query heads (its attention sinks).
    pub(super) heads: std::ops::Range<usize>,
    /// A gated MLP's (dense, expert, shared expert) intermediate features.
    pub(super) inter: MlpSplit,
    pub(super) expert: MlpSplit,
    pub(super) shared: MlpSplit,
    /// The experts this rank holds (expert parallelism).
    pub(super) experts: std::ops::Range<usize>,
}

/// One gated MLP's shard: gate/up columns, down rows.
#[derive(Clone)]
pub(super) struct MlpSplit {
    pub(super) cols: Split,
    pub(super) rows: Split,
}

/// A norm's weight, with the family's offset folded in (Gemma's `1 + w`).
pub(super) fn norm_vector(
    c: &ModelConfig,
    ws: &WeightStore,
    name: &str,
    len: usize,
) -> Result<Vec<f32>> {
    let mut w = ws.vector(name, len)?;
    if c.arch.norm_offset != 0.0 {
        for v in &mut w {
            *v += c.arch.norm_offset;
        }
    }
    Ok(w)
}

/// The `N` projections loaded from one fused tensor.
fn parts<const N: usize>(loaded: Vec<Linear>) -> Result<[Linear; N]> {
    let n = loaded.len();
    loaded.try_into().map_err(|_| {
        EngineError::InvalidCheckpoint(format!("a fused tensor gave {n} parts, not {N}"))
    })
}

/// The checkpoint a layer is read from.
pub(super) struct Source<'a> {
    pub(super) config: &'a ModelConfig,
    pub(super) ws: &'a WeightStore,
    pub(super) quant: Option<&'a HfQuantization>,
    pub(super) names: &'a TensorNames,
}

impl Source<'_> {
    /// The projections stored in one fused tensor of layer `i`, in order:
    /// (rows, split).
    fn fused(&self, i: usize, t: LayerTensor, parts: &[(usize, &Split)]) -> Result<Vec<Linear>> {
        let prefix = self.names.layer(i, t)?;
        let total_rows = parts.iter().map(|p| p.0).sum();
        let h = self.config.hidden_size;
        let mut offset = 0;
        parts
            .iter()
            .map(|&(rows, split)| {
                let part = FusedPart {
                    prefix: &prefix,
                    total_rows,
                    offset,
                };
                offset += rows;
                Linear::load_fused_part(self.ws, self.quant, part, rows, h, split.clone())
            })
            .collect()
    }

    fn linear(&self, prefix: &str, out: usize, inp: usize, split: &Split) -> Result<Linear> {
        Linear::load_part(self.ws, self.quant, prefix, out, inp, split.clone())
    }

    /// A gated MLP of `inter` features whose three projections are
    /// separate tensors under these module paths.
    fn gated(&self, paths: [String; 3], inter: usize, split: &MlpSplit) -> Result<DenseMlp> {
        let h = self.config.hidden_size;
        let [gate, up, down] = paths;
        Ok(DenseMlp {
            gate: self.linear(&gate, inter, h, &split.cols)?,
            up: self.linear(&up, inter, h, &split.cols)?,
            down: self.linear(&down, h, inter, &split.rows)?,
        })
    }

    /// Layer `i`'s dense MLP.
    fn dense_mlp(&self, i: usize, split: &MlpSplit) -> Result<DenseMlp> {
        use LayerTensor as T;
        let c = self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let names = self.names;
        match c.arch.gate_up {
            Projections::Split => {
                let paths = [T::Gate, T::Up, T::Down].map(|t| names.layer(i, t));
                let [g, u, d] = paths;
                self.gated([g?, u?, d?], inter, split)
            }
            Projections::Fused => {
                let cols = &split.cols;
                let [gate, up] =
                    parts(self.fused(i, T::GateUp, &[(inter, cols), (inter, cols)])?)?;
                let down = names.layer(i, T::Down)?;
                Ok(DenseMlp {
                    gate,
                    up,
                    down: self.linear(&down, h, inter, &split.rows)?,
                })
            }
        }
    }

    /// Expert `e` of layer `i` from the stacked tensors (gpt-oss): gate
    /// and up interleaved in `[E, hidden, 2I]`, down `[E, I, hidden]`, each
    /// with an `_bias` `[E, out]`.
    fn stacked_expert(
        &self,
        i: usize,
        e: usize,
        moe: &MoeSpec,
        split: &MlpSplit,
    ) -> Result<DenseMlp> {
        use LayerTensor as T;
        let (h, inter, n) = (
            self.config.hidden_size,
            moe.expert_intermediate,
            moe.num_experts,
        );
        let gate_up = self.names.layer(i, T::ExpertsGateUp)?;
        let down = self.names.layer(i, T::ExpertsDown)?;
        let features = split.cols.range(inter);
        let bias_row = |name: String, width: usize| -> Result<Option<Vec<f32>>> {
            if !self.ws.contains(&name) {
                return Ok(None);
            }
            let m = self.ws.matrix(&name, n, width)?;
            let mut row = vec![0.0; width];
            m.row_to_f32(e, &mut row);
            Ok(Some(row))
        };
        let gate_up_bias = bias_row(format!("{gate_up}_bias"), 2 * inter)?;
        // The published checkpoints store them as MXFP4 (output-major),
        // dequantized here; a bf16 or f32 one, input-major.
        let mxfp4 = self.ws.contains(&format!("{gate_up}_blocks"));
        let load = |name: &str, [out, inp]: [usize; 2], rows: &[usize], inputs| match mxfp4 {
            true => self.ws.mxfp4_rows(name, [n, out, inp], e, rows, inputs),
            false => self
                .ws
                .stacked_transposed(name, [n, inp, out], e, rows, inputs),
        };
        let half = |parity: usize| -> Result<Linear> {
            let cols: Vec<usize> = features.clone().map(|j| 2 * j + parity).collect();
            let w = load(&gate_up, [2 * inter, h], &cols, 0..h)?;
            let b = gate_up_bias
                .as_ref()
                .map(|b| cols.iter().map(|&c| b[c]).collect());
            Ok(Linear::dense(w, b))
        };
        let all: Vec<usize> = (0..h).collect();
        let w = load(&down, [h, inter], &all, features.clone())?;
        let b = match split.rows.keeps_bias() {
            true => bias_row(format!("{down}_bias"), h)?,
            false => None,
        };
        Ok(DenseMlp {
            gate: half(0)?,
            up: half(1)?,
            down: Linear::dense(w, b),
        })
    }

    /// Layer `i`'s mixture of experts.
    fn sparse_mlp(&self, i: usize, moe: &MoeSpec, splits: &LayerSplits) -> Result<SparseMlp> {
        use LayerTensor as T;
        let names = self.names;
        let h = self.config.hidden_size;
        let router_path = names.layer(i, T::Router)?;
        let router = (
            self.ws
                .matrix(&format!("{router_path}.weight"), moe.num_experts, h)?,
            self.ws
                .optional_vector(&format!("{router_path}.bias"), moe.num_experts)?,
        );
        let experts = splits
            .experts
            .clone()
            .map(|e| match moe.storage {
                ExpertStorage::PerExpert => {
                    let [g, u, d] =
                        [T::ExpertGate, T::ExpertUp, T::ExpertDown].map(|t| names.expert(i, e, t));
                    self.gated([g?, u?, d?], moe.expert_intermediate, &splits.expert)
                }
                ExpertStorage::Stacked => self.stacked_expert(i, e, moe, &splits.expert),
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = match moe.shared_intermediate {
            None => None,
            Some(inter) => {
                let [g, u, d] =
                    [T::SharedGate, T::SharedUp, T::SharedDown].map(|t| names.layer(i, t));
                let gate = match moe.shared_gated {
                    true => Some(self.ws.matrix(
                        &names.layer_weight(i, T::SharedExpertGate)?,
                        1,
                        h,
                    )?),
                    false => None,
                };
                Some(SharedExpert {
                    mlp: self.gated([g?, u?, d?], inter, &splits.shared)?,
                    gate,
                })
            }
        };
        let mut sparse = SparseMlp::new(router, (splits.experts.start, experts), shared, moe);
        if moe.choice_bias {
            let name = names.layer(i, T::RouterChoiceBias)?;
            sparse.choice_bias = Some(self.ws.vector(&name, moe.num_experts)?);
        }
        Ok(sparse)
    }

    /// Layer `i`'s latent attention, this rank's query heads of it: the
    /// query's rows and `kv_b_proj`'s for those heads; the latent's
    /// projection and norm whole (every rank keeps the whole latent).
    fn latent_attention(
        &self,
        i: usize,
        mla: &MlaSpec,
        splits: &LayerSplits,
    ) -> Result<LatentAttention> {
        use LayerTensor as T;
        let (c, names) = (self.config, self.names);
        let h = c.hidden_size;
        let q_rows = c.num_heads * mla.qk_head_dim();
        let (whole, q_cols) = (&Split::Whole, &splits.q_cols);
        let q = match mla.q_lora_rank {
            None => LatentQuery::Direct(self.linear(&names.layer(i, T::Q)?, q_rows, h, q_cols)?),
            Some(rank) => LatentQuery::LowRank {
                a: self.linear(&names.layer(i, T::QA)?, rank, h, whole)?,
                norm: norm_vector(c, self.ws, &names.layer_weight(i, T::QANorm)?, rank)?,
                b: self.linear(&names.layer(i, T::QB)?, q_rows, rank, q_cols)?,
            },
        };
        let kv_a = self.linear(&names.layer(i, T::KvA)?, mla.latent_width(), h, whole)?;
        let kv_a_norm = norm_vector(
            c,
            self.ws,
            &names.layer_weight(i, T::KvANorm)?,
            mla.kv_lora_rank,
        )?;
        let per_head = mla.qk_nope_head_dim + mla.v_head_dim;
        let heads = splits.heads.clone();
        let kv_b = self.ws.matrix_rows(
            &names.layer_weight(i, T::KvB)?,
            c.num_heads * per_head,
            mla.kv_lora_rank,
            heads.start * per_head..heads.end * per_head,
        )?;
        Ok(LatentAttention::new(
            mla.clone(),
            heads.len(),
            q,
            (kv_a, kv_a_norm),
            kv_b,
        ))
    }

    /// Loads layer `i` (this rank's part of it).
    pub(super) fn layer(&self, i: usize, splits: &LayerSplits) -> Result<Layer> {
        use LayerTensor as T;
        let (c, names) = (self.config, self.names);
        let (h, d) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out) = (c.num_heads * d, c.num_kv_heads * d);
        let spec = &c.arch;
        let norm = |t: T, len: usize| norm_vector(c, self.ws, &names.layer_weight(i, t)?, len);
        let optional_norm = |on: bool, t: T, len: usize| on.then(|| norm(t, len)).transpose();
        let (inputs, outputs) = (spec.norm.on_inputs(), spec.norm.on_outputs());
        let (q_norm_len, k_norm_len) = match spec.qk_norm {
            QkNorm::Full => (q_out, kv_out),
            _ => (d, d),
        };
        let qk_norm = spec.qk_norm != QkNorm::None;
        let proj = match (&spec.mla, spec.qkv) {
            (Some(mla), _) => AttnProj::Latent(Box::new(self.latent_attention(i, mla, splits)?)),
            (None, Projections::Split) => AttnProj::Heads(Box::new([
                self.linear(&names.layer(i, T::Q)?, q_out, h, &splits.q_cols)?,
                self.linear(&names.layer(i, T::K)?, kv_out, h, &splits.kv_cols)?,
                self.linear(&names.layer(i, T::V)?, kv_out, h, &splits.kv_cols)?,
            ])),
            (None, Projections::Fused) => {
                let kv = &splits.kv_cols;
                let [q, k, v] = parts(self.fused(
                    i,
                    T::Qkv,
                    &[(q_out, &splits.q_cols), (kv_out, kv), (kv_out, kv)],
                )?)?;
                AttnProj::Heads(Box::new([q, k, v]))
            }
        };
        let o_in = match &spec.mla {
            Some(mla) => c.num_heads * mla.v_head_dim,
            None => q_out,
        };

        let mlp = match spec.moe.as_ref().filter(|m| m.is_sparse(i)) {
            Some(moe) => Mlp::Sparse(Box::new(self.sparse_mlp(i, moe, splits)?)),
            None => Mlp::Dense(Box::new(self.dense_mlp(i, &splits.inter)?)),
        };
        let sinks = match spec.attn_sinks {
            true => {
                let name = names.layer(i, T::Sinks)?;
                Some(
                    self.ws
                        .vector_part(&name, c.num_heads, splits.heads.clone())?,
                )
            }
            false => None,
        };
        Ok(Layer {
            sinks,
            attn_norm: optional_norm(inputs, T::AttnNorm, h)?,
            proj,
            o: self.linear(&names.layer(i, T::O)?, h, o_in, &splits.o_rows)?,
            q_norm: optional_norm(qk_norm, T::QNorm, q_norm_len)?,
            k_norm: optional_norm(qk_norm, T::KNorm, k_norm_len)?,
            attn_out_norm: optional_norm(outputs, T::AttnOutNorm, h)?,
            mlp_norm: optional_norm(inputs, T::MlpNorm, h)?,
            mlp_out_norm: optional_norm(outputs, T::MlpOutNorm, h)?,
            mlp,
            attention: spec.layer_attention(c.sliding_window[i]),
        })
    }
}
