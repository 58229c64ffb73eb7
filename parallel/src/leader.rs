//! The leader's side: a `ComputeBackend` whose forward pass runs on every
//! rank.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ops::Range;
use std::path::Path;

use tandem_comm::Communicator;
use tandem_engine::kernels::MatmulPolicy;
use tandem_engine::serving::KvPoolSize;
use tandem_engine::shard::{kv_heads_of, stage_layers};
use tandem_engine::{
    BlockCopy, BlockId, BlockKv, ComputeBackend, EngineError, KvBlocks, KvCache, KvCacheDtype,
    KvLayout, Logits, Model, ModelConfig, SeqInput,
};

pub use crate::peers::CommStats;
use crate::peers::{comm_error, CommPeers};
use crate::protocol::{decode_ready, Command, OwnedSeq};
use crate::{fingerprint, ParallelError, Parallelism, Place};

/// How the leader sets its ranks up.
#[derive(Debug, Clone)]
pub struct LeaderOptions {
    pub parallelism: Parallelism,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Every rank's pool: this many blocks, or as many as fit in these bytes
    /// of the leader's shard (each rank gets the same budget and the same
    /// block count).
    pub pool: KvPoolSize,
    pub kv_dtype: KvCacheDtype,
    /// Micro-batches per step when pipelined (sequences are split between
    /// them by token count); 1 without pipeline parallelism.
    pub micro_batches: usize,
}

impl LeaderOptions {
    /// Defaults: 16-token blocks, `pp` micro-batches, f32 KV.
    pub fn new(parallelism: Parallelism, pool: KvPoolSize) -> Self {
        Self {
            parallelism,
            block_size: 16,
            pool,
            kv_dtype: KvCacheDtype::F32,
            micro_batches: parallelism.pp,
        }
    }
}

/// The model split over `tp × pp` ranks, driven from rank 0.
#[derive(Debug)]
pub struct ParallelBackend {
    par: Parallelism,
    /// Rank 0's shard: stage 0, TP rank 0.
    model: Model,
    kv: KvCache,
    comm: Box<dyn Communicator>,
    /// The whole model's KV layout, which blocks cross the seam in.
    layout: KvLayout,
    micro_batches: usize,
    stats: CommStats,
    /// Set by the first communicator error; every later call fails with it.
    lost: Option<String>,
}

impl ParallelBackend {
    /// Loads rank 0's shard and sets up every follower's pool; fails, naming
    /// the rank, when a follower runs another model or cannot load its shard.
    pub fn start(
        dir: &Path,
        opts: LeaderOptions,
        mut comm: Box<dyn Communicator>,
    ) -> Result<Self, ParallelError> {
        let par = opts.parallelism;
        if comm.rank() != 0 || comm.world_size() != par.world() {
            return Err(ParallelError::Setup(format!(
                "the leader is rank 0 of {} ranks, the communicator says rank {} of {}",
                par.world(),
                comm.rank(),
                comm.world_size()
            )));
        }
        let first = par.split(crate::Place {
            stage: 0,
            tp_rank: 0,
        });
        let model = Model::load_split(dir, first)?;
        par.check(model.config())?;
        let local = model.kv_layout(opts.block_size);
        let num_blocks = match opts.pool {
            KvPoolSize::Blocks(n) => n,
            KvPoolSize::Bytes(b) => b / opts.kv_dtype.block_bytes(&local).max(1),
        };
        if num_blocks == 0 || opts.block_size == 0 {
            return Err(ParallelError::Setup(format!(
                "a KV pool of {num_blocks} blocks of {} tokens holds nothing",
                opts.block_size
            )));
        }
        let c = model.config();
        let (rows, num_kv_heads, head_dim) = c.kv_rows();
        let layout = KvLayout {
            rows,
            num_layers: c.num_layers,
            num_kv_heads,
            head_dim,
            block_size: opts.block_size,
            // Windowed layers free blocks only when one rank holds them all
            // (no pipeline split): every rank's cache then groups alike.
            sliding: local.sliding,
        };
        let setup = Command::Setup {
            block_size: opts.block_size,
            num_blocks,
            kv_dtype: opts.kv_dtype.to_string(),
            fingerprint: fingerprint(c),
        }
        .encode();
        for r in 1..par.world() {
            comm.send(r, &setup)?;
        }
        for r in 1..par.world() {
            if let Err(why) = decode_ready(&comm.recv(r)?)? {
                return Err(ParallelError::Setup(format!("rank {r}: {why}")));
            }
        }
        tracing::info!(
            ranks_per_stage = par.tp,
            pp = par.pp,
            expert_groups = par.ep,
            num_blocks,
            "tensor/pipeline/expert-parallel ranks ready"
        );
        Ok(Self {
            par,
            kv: KvCache::with_dtype(local, num_blocks, opts.kv_dtype),
            model,
            comm,
            layout,
            micro_batches: if par.pp > 1 {
                opts.micro_batches.max(1)
            } else {
                1
            },
            stats: CommStats::default(),
            lost: None,
        })
    }

    /// How the model is split.
    pub fn parallelism(&self) -> Parallelism {
        self.par
    }

    /// Rank 0's time in collectives so far.
    pub fn comm_stats(&self) -> CommStats {
        self.stats
    }

    fn alive(&self) -> tandem_engine::Result<()> {
        match &self.lost {
            Some(why) => Err(EngineError::Stopped(why.clone())),
            None => Ok(()),
        }
    }

    /// Records a permanent failure (the ranks are out of step for good) and
    /// returns it.
    fn lose(&mut self, e: EngineError) -> EngineError {
        if self.lost.is_none() {
            tracing::error!(error = %e, "lost a tensor/pipeline-parallel rank");
            self.lost = Some(e.to_string());
        }
        e
    }

    fn tell_followers(&mut self, cmd: &Command) -> tandem_engine::Result<()> {
        let bytes = cmd.encode();
        for r in 1..self.par.world() {
            if let Err(e) = self.comm.send(r, &bytes) {
                return Err(self.lose(comm_error(e)));
            }
        }
        Ok(())
    }

    fn block_elems(&self) -> usize {
        self.layout.block_size * self.layout.head_dim
    }

    /// V values per KV head of one block-layer: none for a latent layout.
    fn value_elems(&self) -> usize {
        match self.layout.rows {
            tandem_engine::KvRows::PerHead => self.block_elems(),
            tandem_engine::KvRows::Latent => 0,
        }
    }

    /// The stage holding `layer` and its layer range.
    fn stage_of(&self, layer: usize) -> tandem_engine::Result<(usize, Range<usize>)> {
        let n = self.layout.num_layers;
        let stage = self.par.stage_of_layer(n, layer).ok_or_else(|| {
            EngineError::InvalidRequest(format!("layer {layer} is outside the model ({n} layers)"))
        })?;
        Ok((stage, stage_layers(n, self.par.pp, stage)?))
    }

    fn check_block(&self, block: BlockId) -> tandem_engine::Result<()> {
        if block as usize >= self.kv.num_blocks() {
            return Err(EngineError::InvalidRequest(format!(
                "block {block} is outside the KV pool ({} blocks)",
                self.kv.num_blocks()
            )));
        }
        Ok(())
    }

    /// One layer of a block with every KV head, gathered from the ranks of
    /// the layer's stage (one holder per head when heads are replicated).
    fn read_whole(
        &mut self,
        layer: usize,
        block: BlockId,
    ) -> tandem_engine::Result<(Vec<f32>, Vec<f32>)> {
        self.alive()?;
        self.check_block(block)?;
        let (stage, layers) = self.stage_of(layer)?;
        let per_head = self.block_elems();
        let holders = self.head_holders(stage);
        for &(rank, _) in &holders {
            if rank != 0 {
                if let Err(e) = self
                    .comm
                    .send(rank, &Command::Read { layer, block }.encode())
                {
                    return Err(self.lose(comm_error(e)));
                }
            }
        }
        let total = self.layout.num_kv_heads * per_head;
        let (mut k, mut v) = (Vec::with_capacity(total), Vec::with_capacity(total));
        for (rank, heads) in holders {
            if rank == 0 {
                let (lk, lv) = self.kv.block(layer - layers.start, block);
                k.extend_from_slice(&lk);
                v.extend_from_slice(&lv);
            } else {
                let n = heads.len() * per_head;
                let mut buf = vec![0.0f32; n + heads.len() * self.value_elems()];
                if let Err(e) = self.comm.recv_f32(rank, &mut buf) {
                    return Err(self.lose(comm_error(e)));
                }
                k.extend_from_slice(&buf[..n]);
                v.extend_from_slice(&buf[n..]);
            }
        }
        Ok((k, v))
    }

    /// The ranks of `stage` that hold each KV head first, with their heads.
    fn head_holders(&self, stage: usize) -> Vec<(usize, Range<usize>)> {
        let mut next = 0;
        let mut out = Vec::new();
        for tp_rank in 0..self.par.tp {
            let heads = kv_heads_of(self.layout.num_kv_heads, self.par.tp, tp_rank);
            if heads.start >= next {
                next = heads.end;
                out.push((self.par.rank(Place { stage, tp_rank }), heads));
            }
        }
        out
    }

    /// Runs the step on every rank; returns the logits rows.
    fn run_step(&mut self, batch: &[SeqInput<'_>]) -> tandem_engine::Result<Logits> {
        let parts = split(batch, self.micro_batches);
        self.tell_followers(&Command::Step {
            micro_batches: parts
                .iter()
                .map(|r| batch[r.clone()].iter().map(OwnedSeq::of).collect())
                .collect(),
        })?;
        let vocab = self.model.config().vocab_size;
        let mut data = Vec::new();
        let mut starts = vec![0];
        let mut rows = 0;
        for s in batch {
            rows += s.logit_rows();
            starts.push(rows);
        }
        let place = Place {
            stage: 0,
            tp_rank: 0,
        };
        let result = {
            let mut peers = CommPeers::new(&mut *self.comm, self.par, place, &mut self.stats);
            parts.iter().try_for_each(|r| {
                let out = self.model.forward_stage(
                    &batch[r.clone()],
                    &mut self.kv,
                    &mut peers,
                    &mut |_, _| {},
                )?;
                if let Some(l) = out {
                    data.extend_from_slice(l.rows());
                }
                Ok::<_, EngineError>(())
            })
        };
        if let Err(e) = result {
            // The followers ran (or are running) this step: whatever failed
            // here, the ranks are out of step for good.
            return Err(self.lose(e));
        }
        if self.par.pp > 1 {
            let last = self.par.rank(Place {
                stage: self.par.pp - 1,
                tp_rank: 0,
            });
            for r in &parts {
                let n: usize = batch[r.clone()].iter().map(SeqInput::logit_rows).sum();
                let mut buf = vec![0.0f32; n * vocab];
                if let Err(e) = self.comm.recv_f32(last, &mut buf) {
                    return Err(self.lose(comm_error(e)));
                }
                data.extend_from_slice(&buf);
            }
        }
        if data.len() != rows * vocab {
            return Err(self.lose(comm_error(format!(
                "the step returned {} logits rows, {rows} were expected",
                data.len() / vocab.max(1)
            ))));
        }
        Ok(Logits::from_rows(data, vocab, starts))
    }
}

/// Contiguous micro-batches of about equal token counts (never empty).
fn split(batch: &[SeqInput<'_>], parts: usize) -> Vec<Range<usize>> {
    let parts = parts.clamp(1, batch.len().max(1));
    let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
    let mut out = Vec::with_capacity(parts);
    let (mut start, mut acc) = (0, 0);
    for (i, s) in batch.iter().enumerate() {
        acc += s.tokens.len();
        let parts_after = parts - out.len() - 1;
        let seqs_after = batch.len() - i - 1;
        if parts_after > 0 && (acc * parts >= total * (out.len() + 1) || seqs_after == parts_after)
        {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < batch.len() {
        out.push(start..batch.len());
    }
    out
}

/// Blocks read for export, gathered from the ranks.
struct Gather<'a>(RefCell<&'a mut ParallelBackend>);

impl KvBlocks for Gather<'_> {
    fn read_block(&self, layer: usize, block: BlockId) -> tandem_engine::Result<BlockKv<'_>> {
        let mut leader = self
            .0
            .try_borrow_mut()
            .map_err(|_| EngineError::InvalidRequest("nested KV block read".into()))?;
        let (k, v) = leader.read_whole(layer, block)?;
        Ok((Cow::Owned(k), Cow::Owned(v)))
    }
}

impl ComputeBackend for ParallelBackend {
    fn device(&self) -> &'static str {
        "cpu"
    }

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    /// The leader's layers' counts (every rank of a stage routes alike; a
    /// later stage's layers are not counted here).
    fn routed_tokens(&self) -> Vec<(usize, Vec<u64>)> {
        self.model.routed_tokens()
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    /// This rank's bytes per block (every rank has the same block count).
    fn block_bytes(&self) -> usize {
        self.kv.block_bytes()
    }

    fn set_matmul_policy(&mut self, policy: MatmulPolicy) -> tandem_engine::Result<()> {
        self.alive()?;
        self.tell_followers(&Command::MatmulPolicy(policy))?;
        self.model.set_matmul_policy(policy);
        Ok(())
    }

    /// Runs the step on every rank, then hands each layer's blocks to
    /// `after_layer` (gathered from the ranks: after the pass, not between
    /// layers).
    fn forward(
        &mut self,
        batch: &[SeqInput<'_>],
        after_layer: &mut dyn FnMut(usize, &dyn KvBlocks),
    ) -> tandem_engine::Result<Logits> {
        self.alive()?;
        // Checked before the followers hear of the step, so a bad batch is
        // an error for its requests, not a broken group.
        self.model.validate(batch, &self.kv)?;
        let logits = self.run_step(batch)?;
        let layers = self.layout.num_layers;
        let gather = Gather(RefCell::new(self));
        for l in 0..layers {
            after_layer(l, &gather);
        }
        Ok(logits)
    }

    fn copy_block(&mut self, copy: BlockCopy) -> tandem_engine::Result<()> {
        self.alive()?;
        self.check_block(copy.src)?;
        self.check_block(copy.dst)?;
        self.tell_followers(&Command::Copy {
            src: copy.src,
            dst: copy.dst,
        })?;
        self.kv.copy_block(copy);
        Ok(())
    }

    /// Writes a whole block's layer: each rank of the layer's stage gets its
    /// KV heads.
    fn write_block(
        &mut self,
        layer: usize,
        block: BlockId,
        k: &[f32],
        v: &[f32],
    ) -> tandem_engine::Result<()> {
        self.alive()?;
        self.check_block(block)?;
        let (stage, layers) = self.stage_of(layer)?;
        let (per_head, v_per_head) = (self.block_elems(), self.value_elems());
        let (want, want_v) = (
            self.layout.num_kv_heads * per_head,
            self.layout.num_kv_heads * v_per_head,
        );
        if k.len() != want || v.len() != want_v {
            return Err(EngineError::InvalidRequest(format!(
                "a block layer holds {want} K and {want_v} V values, got {} and {}",
                k.len(),
                v.len()
            )));
        }
        for tp_rank in 0..self.par.tp {
            let heads = kv_heads_of(self.layout.num_kv_heads, self.par.tp, tp_rank);
            let part = heads.start * per_head..heads.end * per_head;
            let v_part = heads.start * v_per_head..heads.end * v_per_head;
            let rank = self.par.rank(Place { stage, tp_rank });
            if rank == 0 {
                self.kv
                    .write_block(layer - layers.start, block, &k[part.clone()], &v[v_part])
                    .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
            } else {
                let cmd = Command::Write {
                    layer,
                    block,
                    k: k[part.clone()].to_vec(),
                    v: v[v_part].to_vec(),
                };
                if let Err(e) = self.comm.send(rank, &cmd.encode()) {
                    return Err(self.lose(comm_error(e)));
                }
            }
        }
        Ok(())
    }

    fn failure(&self) -> Option<String> {
        self.lost.clone()
    }

    fn uses_cpu_pool(&self) -> bool {
        true
    }
}

impl Drop for ParallelBackend {
    fn drop(&mut self) {
        if self.lost.is_none() {
            let bytes = Command::Shutdown.encode();
            for r in 1..self.par.world() {
                let _ = self.comm.send(r, &bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_split_by_tokens_and_are_never_empty() {
        let toks: Vec<Vec<u32>> = [10, 1, 1, 10, 1, 1].iter().map(|&n| vec![0; n]).collect();
        let batch: Vec<SeqInput<'_>> = toks
            .iter()
            .map(|t| SeqInput {
                tokens: t,
                start_pos: 0,
                blocks: &[],
                all_logits: false,
                lora: None,
            })
            .collect();
        assert_eq!(split(&batch, 2), vec![0..3, 3..6]);
        assert_eq!(split(&batch, 1), vec![0..6]);
        assert_eq!(split(&batch[..1], 4), vec![0..1]);
        let parts = split(&batch, 6);
        assert_eq!(parts.len(), 6);
        assert!(parts.iter().all(|r| !r.is_empty()));
        assert!(split(&[], 3).is_empty());
    }
}
