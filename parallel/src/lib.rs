//! Tensor and pipeline parallelism on CPUs: one process per rank.
//!
//! A worker started with `--tp N --pp M` is `N × M` processes. Rank 0, the
//! **leader**, runs the serving engine as usual; its backend is a
//! [`ParallelBackend`], which implements the engine's `ComputeBackend` seam,
//! so the scheduler, the prefix cache and the KV transfer are unchanged.
//! Every other rank is a **follower** ([`run_follower`]) holding its shard of
//! the weights and of the KV pool and waiting for commands.
//!
//! Rank `r` is TP rank `r % N` of pipeline stage `r / N`
//! ([`Parallelism::place`]). Each step the leader sends every follower the
//! step's sequences (token ids, positions, block tables: the block ids come
//! from the leader's allocator, and every rank's pool has the same number
//! of blocks, so a table means the same thing everywhere), split into
//! micro-batches when pipelined; then every rank runs
//! `Model::forward_stage` on each micro-batch, all-reducing inside its
//! stage and passing activations to the next stage, so stage `s` works on
//! micro-batch `i + 1` while stage `s + 1` works on micro-batch `i`. The
//! last stage's TP rank 0 returns the logits to the leader once the step's
//! micro-batches are done (sending them earlier could block it on a leader
//! that is still sending activations).
//!
//! KV blocks cross the seam whole (every KV head, every layer), as the
//! engine expects: a block read for export is gathered from the ranks that
//! hold its layer and heads, and a received block is re-sliced by head and
//! written on those ranks. So a prefill pool with TP=a feeds a decode pool
//! with TP=b: the transfer carries the model's layout, never a rank's.
//!
//! Failure model: any communicator error (a rank's process gone, a
//! timeout) is permanent: the backend reports it through
//! `ComputeBackend::failure`, the engine fails every request and refuses
//! new ones, and the worker leaves the cluster. A follower whose leader is
//! gone exits.
//!
//! **Architecture Invariant:** only the leader schedules, samples and owns
//! block ids; followers compute exactly what they are told, in the order
//! they are told, and never answer except to `Setup`, `Read` and with
//! logits.

mod follower;
mod leader;
mod peers;
mod protocol;

use std::ops::Range;

pub use follower::run_follower;
pub use leader::{CommStats, LeaderOptions, ParallelBackend};
pub use tandem_comm::{CommConfig, CommError, Communicator, Rendezvous, TcpComm};
use tandem_engine::{shard, EngineError, ModelConfig};

/// How a worker's model is split: `tp` ranks per stage, `pp` stages, and
/// each stage's experts in `ep` groups of `tp / ep` ranks
/// ([`tandem_engine::shard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    pub tp: usize,
    pub pp: usize,
    pub ep: usize,
}

/// Where a rank sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub stage: usize,
    pub tp_rank: usize,
}

impl Parallelism {
    /// One rank: no parallelism.
    pub const NONE: Self = Self {
        tp: 1,
        pp: 1,
        ep: 1,
    };

    /// `tp` ranks per stage, `pp` stages, no expert parallelism.
    pub fn tp_pp(tp: usize, pp: usize) -> Self {
        Self { tp, pp, ep: 1 }
    }

    /// Rank `tp_rank` of stage `stage`'s split of the model.
    pub fn split(&self, place: Place) -> shard::Split {
        shard::Split {
            tp: self.tp,
            tp_rank: place.tp_rank,
            pp: self.pp,
            stage: place.stage,
            ep: self.ep,
        }
    }

    /// Ranks in all.
    pub fn world(&self) -> usize {
        self.tp * self.pp
    }

    /// Rank `rank`'s stage and TP rank.
    pub fn place(&self, rank: usize) -> Place {
        Place {
            stage: rank / self.tp,
            tp_rank: rank % self.tp,
        }
    }

    /// The rank at a place.
    pub fn rank(&self, place: Place) -> usize {
        place.stage * self.tp + place.tp_rank
    }

    /// The ranks of stage `stage` (its TP group).
    pub fn stage_ranks(&self, stage: usize) -> Range<usize> {
        stage * self.tp..(stage + 1) * self.tp
    }

    /// The stage that runs global layer `layer`.
    pub fn stage_of_layer(&self, num_layers: usize, layer: usize) -> Option<usize> {
        (0..self.pp).find(|&s| {
            shard::stage_layers(num_layers, self.pp, s).is_ok_and(|r| r.contains(&layer))
        })
    }

    /// Checks that `config` splits this way (every rank's shard exists).
    pub fn check(&self, config: &ModelConfig) -> Result<(), ParallelError> {
        if self.tp == 0 || self.pp == 0 {
            return Err(ParallelError::Setup(
                "--tp and --pp must be at least 1".into(),
            ));
        }
        for stage in 0..self.pp {
            shard::ShardSpec::of(config, self.split(Place { stage, tp_rank: 0 }))?;
        }
        Ok(())
    }
}

/// What can go wrong between ranks.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// A rank could not be reached or was lost.
    #[error("communicator: {0}")]
    Comm(#[from] CommError),
    /// The model cannot be split so, or a shard failed to run.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A malformed command or reply.
    #[error("rank protocol: {0}")]
    Protocol(String),
    /// The ranks disagree (another model, another pool), or the layout is
    /// impossible.
    #[error("rank setup: {0}")]
    Setup(String),
}

/// A short description of the model every rank must share.
pub(crate) fn fingerprint(c: &ModelConfig) -> String {
    format!(
        "{:?} hidden {} intermediate {} layers {} heads {}/{} head_dim {} vocab {}",
        c.architecture,
        c.hidden_size,
        c.intermediate_size,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_stage_major() {
        let p = Parallelism::tp_pp(2, 3);
        assert_eq!(p.world(), 6);
        assert_eq!(
            p.place(3),
            Place {
                stage: 1,
                tp_rank: 1
            }
        );
        assert_eq!(
            p.rank(Place {
                stage: 2,
                tp_rank: 0
            }),
            4
        );
        assert_eq!(p.stage_ranks(1), 2..4);
        assert_eq!(p.stage_of_layer(8, 2), Some(0));
        assert_eq!(p.stage_of_layer(8, 3), Some(1));
        assert_eq!(p.stage_of_layer(8, 7), Some(2));
        assert_eq!(p.stage_of_layer(8, 8), None);
    }
}
