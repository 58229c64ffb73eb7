//! A follower rank: its shard of the model and of the KV pool, run on the
//! leader's command.

use std::path::Path;

use tandem_comm::Communicator;
use tandem_engine::kernels::GEMV_MAX_ROWS;
use tandem_engine::{BlockCopy, KvCache, KvCacheDtype, Model, SeqInput};

use crate::peers::{CommPeers, CommStats};
use crate::protocol::{encode_ready, Command, OwnedSeq};
use crate::{fingerprint, ParallelError, Parallelism, Place};

/// Runs rank `comm.rank()` until the leader says `Shutdown` (`Ok`) or is
/// gone (`Err`): loads its shard of the checkpoint at `dir` when the leader
/// sends the pool's geometry, answers whether it is ready, then executes
/// commands. A failure here is fatal for the rank; the leader sees it as a
/// lost rank.
pub fn run_follower(
    dir: &Path,
    par: Parallelism,
    mut comm: Box<dyn Communicator>,
) -> Result<(), ParallelError> {
    let rank = comm.rank();
    if rank == 0 || comm.world_size() != par.world() {
        return Err(ParallelError::Setup(format!(
            "a follower is rank 1..{} of {}, the communicator says rank {rank} of {}",
            par.world(),
            par.world(),
            comm.world_size()
        )));
    }
    let place = par.place(rank);
    let (model, kv) = set_up(dir, par, place, &mut *comm)?;
    // Small steps run as one job on a pool of this rank's own (as the
    // leader's engine runs them on rayon's), so their row kernels start
    // without waking this thread. A private pool, because the job blocks in
    // collectives: ranks sharing a process (tests) must not starve each
    // other's kernels of threads.
    let small_steps = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(move |i| format!("rank{rank}-{i}"))
        .build()
        .map_err(|e| ParallelError::Setup(format!("starting rank {rank}'s compute pool: {e}")))?;
    tracing::info!(
        rank,
        stage = place.stage,
        tp_rank = place.tp_rank,
        layers = ?model.shard().layers,
        weight_bytes = model.weight_bytes(),
        "rank ready"
    );
    Follower {
        comm,
        par,
        place,
        model,
        kv,
        stats: CommStats::default(),
        small_steps,
    }
    .serve()
}

/// Waits for the leader's `Setup`, loads this rank's shard and KV pool, and
/// answers whether it is ready (a model fingerprint check).
fn set_up(
    dir: &Path,
    par: Parallelism,
    place: Place,
    comm: &mut dyn Communicator,
) -> Result<(Model, KvCache), ParallelError> {
    let Command::Setup {
        block_size,
        num_blocks,
        kv_dtype,
        fingerprint: leaders,
    } = Command::decode(&comm.recv_idle(0)?)?
    else {
        return Err(ParallelError::Protocol(
            "the leader's first command was not Setup".into(),
        ));
    };
    let prepared = (|| -> Result<(Model, KvCache), String> {
        let model = Model::load_split(dir, par.split(place)).map_err(|e| e.to_string())?;
        let mine = fingerprint(model.config());
        if mine != leaders {
            return Err(format!(
                "runs another model ({mine}; the leader runs {leaders})"
            ));
        }
        let dtype: KvCacheDtype = kv_dtype.parse()?;
        let kv = KvCache::with_dtype(model.kv_layout(block_size), num_blocks, dtype);
        Ok((model, kv))
    })();
    comm.send(
        0,
        &encode_ready(&prepared.as_ref().map(|_| ()).map_err(Clone::clone)),
    )?;
    prepared.map_err(ParallelError::Setup)
}

/// A ready rank: its shard, its part of the pool, its links.
struct Follower {
    comm: Box<dyn Communicator>,
    par: Parallelism,
    place: Place,
    model: Model,
    kv: KvCache,
    stats: CommStats,
    small_steps: rayon::ThreadPool,
}

impl Follower {
    /// Executes the leader's commands until `Shutdown`.
    fn serve(mut self) -> Result<(), ParallelError> {
        loop {
            match Command::decode(&self.comm.recv_idle(0)?)? {
                Command::Step { micro_batches } => self.step(&micro_batches)?,
                Command::Copy { src, dst } => {
                    self.in_pool(src)?;
                    self.in_pool(dst)?;
                    self.kv.copy_block(BlockCopy { src, dst });
                }
                Command::Write { layer, block, k, v } => {
                    self.in_pool(block)?;
                    let layer = self.local(layer)?;
                    self.kv
                        .write_block(layer, block, &k, &v)
                        .map_err(|e| ParallelError::Protocol(e.to_string()))?;
                }
                Command::Read { layer, block } => {
                    self.in_pool(block)?;
                    let (k, v) = self.kv.block(self.local(layer)?, block);
                    let mut both = k.into_owned();
                    both.extend_from_slice(&v);
                    self.comm.send_f32(0, &both)?;
                }
                Command::MatmulPolicy(policy) => self.model.set_matmul_policy(policy),
                Command::Shutdown => return Ok(()),
                Command::Setup { .. } => {
                    return Err(ParallelError::Protocol("Setup sent twice".into()))
                }
            }
        }
    }

    /// One step's micro-batches through this rank's stage; the last
    /// stage's TP rank 0 sends the logits after the whole step (see the
    /// crate docs).
    fn step(&mut self, micro_batches: &[Vec<OwnedSeq>]) -> Result<(), ParallelError> {
        let rows: usize = micro_batches.iter().flatten().map(|s| s.tokens.len()).sum();
        let Self {
            comm,
            par,
            place,
            model,
            kv,
            stats,
            small_steps,
        } = self;
        let mut run = || {
            let mut logits = Vec::new();
            let mut peers = CommPeers::new(&mut **comm, *par, *place, stats);
            for mb in micro_batches {
                let inputs: Vec<SeqInput<'_>> = mb.iter().map(|s| s.input()).collect();
                if let Some(l) = model.forward_stage(&inputs, kv, &mut peers, &mut |_, _| {})? {
                    logits.push(l);
                }
            }
            Ok::<_, ParallelError>(logits)
        };
        let logits = if rows <= GEMV_MAX_ROWS {
            small_steps.install(run)?
        } else {
            run()?
        };
        for l in logits {
            comm.send_f32(0, l.rows())?;
        }
        Ok(())
    }

    /// `layer`'s index in this rank's part of the pool.
    fn local(&self, layer: usize) -> Result<usize, ParallelError> {
        let layers = &self.model.shard().layers;
        layer
            .checked_sub(layers.start)
            .filter(|_| layers.contains(&layer))
            .ok_or_else(|| {
                ParallelError::Protocol(format!("layer {layer} is not on this rank ({layers:?})"))
            })
    }

    fn in_pool(&self, b: u32) -> Result<(), ParallelError> {
        let n = self.kv.num_blocks();
        if (b as usize) < n {
            Ok(())
        } else {
            Err(ParallelError::Protocol(format!(
                "block {b} is outside the pool ({n} blocks)"
            )))
        }
    }
}
