//! A follower rank: its shard of the model and of the KV pool, run on the
//! leader's command.

use std::path::Path;

use tandem_comm::Communicator;
use tandem_engine::kernels::{MatmulPolicy, GEMV_MAX_ROWS};
use tandem_engine::{BlockCopy, KvCache, KvCacheDtype, Model, SeqInput};

use crate::peers::{CommPeers, CommStats};
use crate::protocol::{encode_ready, Command};
use crate::{fingerprint, ParallelError, Parallelism};

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
    let (mut model, mut kv) = prepared.map_err(ParallelError::Setup)?;
    let layers = model.shard().layers.clone();
    let local = |layer: usize| {
        layer
            .checked_sub(layers.start)
            .filter(|_| layers.contains(&layer))
            .ok_or_else(|| {
                ParallelError::Protocol(format!("layer {layer} is not on this rank ({layers:?})"))
            })
    };
    let in_pool = |b: u32| {
        if (b as usize) < num_blocks {
            Ok(())
        } else {
            Err(ParallelError::Protocol(format!(
                "block {b} is outside the pool ({num_blocks} blocks)"
            )))
        }
    };
    let mut stats = CommStats::default();
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
        ?layers,
        weight_bytes = model.weight_bytes(),
        "rank ready"
    );
    loop {
        match Command::decode(&comm.recv_idle(0)?)? {
            Command::Step { micro_batches } => {
                let rows: usize = micro_batches.iter().flatten().map(|s| s.tokens.len()).sum();
                let mut run = || {
                    let mut logits = Vec::new();
                    let mut peers = CommPeers::new(&mut *comm, par, place, &mut stats);
                    for mb in &micro_batches {
                        let inputs: Vec<SeqInput<'_>> = mb.iter().map(|s| s.input()).collect();
                        if let Some(l) =
                            model.forward_stage(&inputs, &mut kv, &mut peers, &mut |_, _| {})?
                        {
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
                // Sent after the whole step: see the crate docs.
                for l in logits {
                    comm.send_f32(0, l.rows())?;
                }
            }
            Command::Copy { src, dst } => {
                in_pool(src)?;
                in_pool(dst)?;
                kv.copy_block(BlockCopy { src, dst });
            }
            Command::Write { layer, block, k, v } => {
                in_pool(block)?;
                kv.write_block(local(layer)?, block, &k, &v)
                    .map_err(|e| ParallelError::Protocol(e.to_string()))?;
            }
            Command::Read { layer, block } => {
                in_pool(block)?;
                let (k, v) = kv.block(local(layer)?, block);
                let mut both = k.into_owned();
                both.extend_from_slice(&v);
                comm.send_f32(0, &both)?;
            }
            Command::BatchInvariant(on) => {
                model.set_matmul_policy(MatmulPolicy::batch_invariant(on))
            }
            Command::Shutdown => return Ok(()),
            Command::Setup { .. } => {
                return Err(ParallelError::Protocol("Setup sent twice".into()))
            }
        }
    }
}
