//! One rank's part of a tensor- and pipeline-parallel model.
//!
//! Megatron-style tensor parallelism (TP) splits every layer across the
//! ranks of a stage: q/k/v, gate and up are *column-parallel* (each rank
//! computes a slice of their output features: whole attention heads, a slice
//! of the MLP's intermediate features), o and down are *row-parallel* (each
//! rank multiplies its slice of their input features and the partial sums
//! are added by one all-reduce after attention and one after the MLP). A
//! rank holds only its rows or columns of those weights and only its KV
//! heads. When the model has fewer KV heads than ranks, each KV head is
//! replicated on the ranks whose query heads use it.
//!
//! Expert parallelism (EP) splits the experts of every mixture-of-experts
//! layer by index into `ep_size` groups of whole experts, each group held
//! by `tp_size / ep_size` ranks of the stage (which split its experts'
//! features as TP would). Attention and dense MLPs stay tensor-parallel
//! over all the stage's ranks, so every rank has every token's hidden
//! state after attention's all-reduce: dispatch needs no communication,
//! each rank runs its experts on the tokens routed to them (the router is
//! replicated), and the all-reduce after the MLP that TP already does
//! combines the experts' weighted outputs. On loopback and shared memory
//! that one all-reduce of `tokens × hidden` floats moves the same bytes as
//! an all-to-all dispatch and combine would, in one collective instead of
//! two, and the ranks keep whole experts (wider matrices than a TP split).
//!
//! Pipeline parallelism (PP) gives each stage a contiguous range of layers;
//! the first stage embeds, the last one normalises and runs the output head
//! (on its TP rank 0 only), and activations pass between stages.
//!
//! The engine knows nothing of how ranks talk: a sharded forward pass gets a
//! [`ShardPeers`], which `tandem-parallel` implements over a communicator.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// Which part of the model a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    /// Ranks in this rank's tensor-parallel group.
    pub tp_size: usize,
    /// This rank's place in its tensor-parallel group.
    pub tp_rank: usize,
    /// The layers this rank's pipeline stage runs (global indices).
    pub layers: Range<usize>,
    /// Layers in the whole model.
    pub total_layers: usize,
    /// Expert groups in this rank's stage (1: every rank holds a feature
    /// slice of every expert).
    pub ep_size: usize,
}

/// How a model is split over ranks, and which rank this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Ranks per stage (attention heads and dense MLP features split this
    /// many ways).
    pub tp: usize,
    pub tp_rank: usize,
    pub pp: usize,
    pub stage: usize,
    /// Expert groups per stage; divides `tp`.
    pub ep: usize,
}

impl ShardSpec {
    /// The whole model on one rank.
    pub fn full(config: &ModelConfig) -> Self {
        Self {
            tp_size: 1,
            tp_rank: 0,
            layers: 0..config.num_layers,
            total_layers: config.num_layers,
            ep_size: 1,
        }
    }

    /// Stage `stage` of `pp` (contiguous layer ranges, the first stages
    /// taking one more layer when `pp` does not divide the layers), TP rank
    /// `tp_rank` of `tp`. Refuses what cannot be split, naming why.
    pub fn new(
        config: &ModelConfig,
        tp: usize,
        tp_rank: usize,
        pp: usize,
        stage: usize,
    ) -> Result<Self> {
        let split = Split {
            tp,
            tp_rank,
            pp,
            stage,
            ep: 1,
        };
        Self::of(config, split)
    }

    /// The shard `split` describes, checked against `config`.
    pub fn of(config: &ModelConfig, split: Split) -> Result<Self> {
        let layers = stage_layers(config.num_layers, split.pp, split.stage)?;
        let spec = Self {
            tp_size: split.tp,
            tp_rank: split.tp_rank,
            layers,
            total_layers: config.num_layers,
            ep_size: split.ep,
        };
        spec.check(config)?;
        Ok(spec)
    }

    /// Checks that `config` can be split this way.
    pub fn check(&self, c: &ModelConfig) -> Result<()> {
        let tp = self.tp_size;
        if tp == 0 || self.tp_rank >= tp {
            return Err(EngineError::InvalidRequest(format!(
                "tensor-parallel rank {} of {tp} does not exist",
                self.tp_rank
            )));
        }
        let fail = |what: String| {
            Err(EngineError::Unsupported(format!(
                "tensor parallelism {tp} cannot split this model: {what}"
            )))
        };
        self.check_experts(c)?;
        if tp > 1 && c.arch.qk_norm == crate::arch::QkNorm::Full {
            return fail("its q/k RMSNorm spans every head (OLMo 2)".into());
        }
        if !c.num_heads.is_multiple_of(tp) {
            return fail(format!("{} attention heads", c.num_heads));
        }
        if !c.intermediate_size.is_multiple_of(tp) {
            return fail(format!("intermediate size {}", c.intermediate_size));
        }
        if let Some(moe) = &c.arch.moe {
            let ways = self.expert_ways();
            if !moe.expert_intermediate.is_multiple_of(ways) {
                return fail(format!("moe_intermediate_size {}", moe.expert_intermediate));
            }
            if let Some(n) = moe.shared_intermediate.filter(|n| !n.is_multiple_of(tp)) {
                return fail(format!("shared_expert_intermediate_size {n}"));
            }
        }
        let kv = c.num_kv_heads;
        if kv >= tp && !kv.is_multiple_of(tp) || kv < tp && !tp.is_multiple_of(kv) {
            return fail(format!(
                "{kv} KV heads (they must divide among the ranks, or the ranks among them)"
            ));
        }
        if self.layers.is_empty()
            || self.layers.end > c.num_layers
            || self.total_layers != c.num_layers
        {
            return Err(EngineError::InvalidRequest(format!(
                "layers {:?} are not a stage of a {}-layer model",
                self.layers, c.num_layers
            )));
        }
        Ok(())
    }

    /// Whether this rank embeds the tokens (the first stage).
    pub fn first_stage(&self) -> bool {
        self.layers.start == 0
    }

    /// Whether this rank's stage ends the model (final norm and head).
    pub fn last_stage(&self) -> bool {
        self.layers.end == self.total_layers
    }

    /// Whether this rank computes the logits (TP rank 0 of the last stage).
    pub fn computes_logits(&self) -> bool {
        self.last_stage() && self.tp_rank == 0
    }

    /// Whether this is the whole model.
    pub fn is_full(&self) -> bool {
        self.tp_size == 1 && self.layers.start == 0 && self.last_stage()
    }

    /// This rank's query heads.
    pub fn q_heads(&self, c: &ModelConfig) -> Range<usize> {
        let n = c.num_heads / self.tp_size;
        self.tp_rank * n..(self.tp_rank + 1) * n
    }

    /// This rank's KV heads (one replicated head when there are fewer KV
    /// heads than ranks).
    pub fn kv_heads(&self, c: &ModelConfig) -> Range<usize> {
        kv_heads_of(c.num_kv_heads, self.tp_size, self.tp_rank)
    }

    /// This rank's slice of the MLP's intermediate features.
    pub fn intermediate(&self, c: &ModelConfig) -> Range<usize> {
        self.features(c.intermediate_size)
    }

    /// This rank's slice of `n` features split evenly over the ranks (a
    /// shared expert's intermediate features).
    pub fn features(&self, n: usize) -> Range<usize> {
        let n = n / self.tp_size;
        self.tp_rank * n..(self.tp_rank + 1) * n
    }

    /// Ranks that share one expert group (splitting its features).
    fn expert_ways(&self) -> usize {
        self.tp_size / self.ep_size.max(1)
    }

    /// The experts (of `n`) this rank holds: its expert group's.
    pub fn experts(&self, n: usize) -> Range<usize> {
        let per_group = n / self.ep_size;
        let group = self.tp_rank / self.expert_ways();
        group * per_group..(group + 1) * per_group
    }

    /// This rank's slice of each of its experts' `n` features.
    pub fn expert_features(&self, n: usize) -> Range<usize> {
        let ways = self.expert_ways();
        let part = n / ways;
        let i = self.tp_rank % ways;
        i * part..(i + 1) * part
    }

    /// Refuses an expert split the model cannot take, by name.
    fn check_experts(&self, c: &ModelConfig) -> Result<()> {
        let ep = self.ep_size;
        if ep == 1 {
            return Ok(());
        }
        let refuse = |why: String| Err(EngineError::Unsupported(format!("--ep {ep}: {why}")));
        let Some(moe) = &c.arch.moe else {
            return refuse(format!(
                "{} has no mixture-of-experts layers to split",
                c.architecture.hf_name()
            ));
        };
        if ep == 0 || !self.tp_size.is_multiple_of(ep) {
            return refuse(format!("{ep} expert groups over {} ranks", self.tp_size));
        }
        if !moe.num_experts.is_multiple_of(ep) {
            return refuse(format!(
                "num_experts {} does not divide into {ep} groups",
                moe.num_experts
            ));
        }
        Ok(())
    }
}

/// The KV heads TP rank `rank` of `tp` holds.
pub fn kv_heads_of(kv_heads: usize, tp: usize, rank: usize) -> Range<usize> {
    if kv_heads >= tp {
        let n = kv_heads / tp;
        rank * n..(rank + 1) * n
    } else {
        let h = rank * kv_heads / tp;
        h..h + 1
    }
}

/// Stage `stage` of `pp`'s layers.
pub fn stage_layers(num_layers: usize, pp: usize, stage: usize) -> Result<Range<usize>> {
    if pp == 0 || stage >= pp {
        return Err(EngineError::InvalidRequest(format!(
            "pipeline stage {stage} of {pp} does not exist"
        )));
    }
    if pp > num_layers {
        return Err(EngineError::Unsupported(format!(
            "pipeline parallelism {pp} needs at least {pp} layers (the model has {num_layers})"
        )));
    }
    let (base, extra) = (num_layers / pp, num_layers % pp);
    let start = stage * base + stage.min(extra);
    let len = base + usize::from(stage < extra);
    Ok(start..start + len)
}

/// What a sharded forward pass needs from the other ranks.
pub trait ShardPeers {
    /// Sums `buf` over this rank's tensor-parallel group (every member gets
    /// the same bits).
    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<()>;
    /// The previous stage's activations for this micro-batch.
    fn recv_activations(&mut self, buf: &mut [f32]) -> Result<()>;
    /// This stage's activations, to the next stage.
    fn send_activations(&mut self, buf: &[f32]) -> Result<()>;
}

/// The peers of an unsharded model: there are none.
#[derive(Debug, Default)]
pub struct NoPeers;

impl ShardPeers for NoPeers {
    fn all_reduce(&mut self, _: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn recv_activations(&mut self, _: &mut [f32]) -> Result<()> {
        Err(EngineError::InvalidRequest(
            "an unsharded model has no previous stage".into(),
        ))
    }

    fn send_activations(&mut self, _: &[f32]) -> Result<()> {
        Err(EngineError::InvalidRequest(
            "an unsharded model has no next stage".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_cover_the_layers_contiguously() {
        let ranges: Vec<_> = (0..3)
            .map(|s| stage_layers(8, 3, s).expect("stage"))
            .collect();
        assert_eq!(ranges, vec![0..3, 3..6, 6..8]);
        assert!(stage_layers(2, 3, 0).is_err());
        assert!(stage_layers(8, 2, 2).is_err());
    }

    #[test]
    fn kv_heads_split_or_replicate() {
        assert_eq!(kv_heads_of(4, 2, 1), 2..4);
        assert_eq!(kv_heads_of(2, 4, 0), 0..1);
        assert_eq!(kv_heads_of(2, 4, 1), 0..1);
        assert_eq!(kv_heads_of(2, 4, 2), 1..2);
        assert_eq!(kv_heads_of(1, 2, 1), 0..1);
    }
}
