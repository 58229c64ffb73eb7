//! The engine's `ShardPeers` over a communicator, with the time spent in
//! collectives counted.

use std::time::{Duration, Instant};

use tandem_comm::Communicator;
use tandem_engine::shard::ShardPeers;
use tandem_engine::EngineError;

use crate::{Parallelism, Place};

/// Time spent talking to other ranks during forward passes.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct CommStats {
    /// All-reduces run (two per layer per micro-batch under TP).
    pub all_reduces: u64,
    /// Wall time inside them (waiting for the slowest rank included).
    pub all_reduce_time: Duration,
    /// Activations sent to or received from a neighbouring stage.
    pub activation_messages: u64,
    pub activation_time: Duration,
}

pub(crate) fn comm_error(e: impl std::fmt::Display) -> EngineError {
    EngineError::Backend {
        device: "cpu",
        message: format!("a tensor/pipeline-parallel rank failed: {e}"),
    }
}

/// One rank's neighbours for a forward pass.
pub(crate) struct CommPeers<'a> {
    pub comm: &'a mut dyn Communicator,
    pub tp_group: Vec<usize>,
    pub prev: Option<usize>,
    pub next: Option<usize>,
    pub stats: &'a mut CommStats,
}

impl<'a> CommPeers<'a> {
    pub fn new(
        comm: &'a mut dyn Communicator,
        par: Parallelism,
        place: Place,
        stats: &'a mut CommStats,
    ) -> Self {
        let rank = par.rank(place);
        Self {
            comm,
            tp_group: par.stage_ranks(place.stage).collect(),
            prev: (place.stage > 0).then(|| rank - par.tp),
            next: (place.stage + 1 < par.pp).then(|| rank + par.tp),
            stats,
        }
    }
}

impl ShardPeers for CommPeers<'_> {
    fn all_reduce(&mut self, buf: &mut [f32]) -> tandem_engine::Result<()> {
        let t = Instant::now();
        self.comm
            .all_reduce_sum(&self.tp_group, buf)
            .map_err(comm_error)?;
        self.stats.all_reduces += 1;
        self.stats.all_reduce_time += t.elapsed();
        Ok(())
    }

    fn recv_activations(&mut self, buf: &mut [f32]) -> tandem_engine::Result<()> {
        let prev = self
            .prev
            .ok_or_else(|| comm_error("the first stage has no previous stage"))?;
        let t = Instant::now();
        self.comm.recv_f32(prev, buf).map_err(comm_error)?;
        self.stats.activation_messages += 1;
        self.stats.activation_time += t.elapsed();
        Ok(())
    }

    fn send_activations(&mut self, buf: &[f32]) -> tandem_engine::Result<()> {
        let next = self
            .next
            .ok_or_else(|| comm_error("the last stage has no next stage"))?;
        let t = Instant::now();
        self.comm.send_f32(next, buf).map_err(comm_error)?;
        self.stats.activation_messages += 1;
        self.stats.activation_time += t.elapsed();
        Ok(())
    }
}
