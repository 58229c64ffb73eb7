//! `--tp` / `--pp`: a worker split over several processes, and `tandem
//! rank`, one of those processes.
//!
//! The process the user starts is rank 0, the leader: it runs the serving
//! engine over a `tandem_parallel::ParallelBackend`. Unless
//! `--external-ranks` is given it starts the other ranks itself, as child
//! processes of this binary (`tandem rank --leader ADDR --rank R ...`),
//! which join at `--rank-addr`; in Kubernetes the manifests start them
//! instead. Ranks on one host talk through shared memory, across hosts over
//! TCP (`tandem-comm`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_engine::serving::EngineConfig;
use tandem_parallel::{
    run_follower, CommConfig, LeaderOptions, ParallelBackend, Parallelism, Rendezvous, TcpComm,
};

/// How one worker's model is split over processes.
#[derive(Args, Debug, Clone)]
pub struct ParallelArgs {
    /// Tensor-parallel ranks per pipeline stage (one process each: the
    /// attention heads and MLP features are split among them).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages (contiguous layer ranges, one set of `--tp` × `--ep`
    /// ranks each).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Expert parallelism (mixture-of-experts models): each stage has
    /// `--tp` × `--ep` ranks; every MoE layer's experts are split by index
    /// into `--ep` groups (each group's `--tp` ranks split its experts'
    /// features), attention and dense layers tensor-parallel over all of
    /// the stage's ranks.
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Micro-batches per step when pipelined (default: `--pp`).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Where this worker's other ranks join it (port 0 picks one; ranks on
    /// other hosts need a reachable address).
    #[arg(long, default_value = "127.0.0.1:0")]
    rank_addr: SocketAddr,
    /// Do not start the other ranks: they are started elsewhere (`tandem
    /// rank --leader ADDR`, e.g. by the deploy manifests) and join at
    /// `--rank-addr`.
    #[arg(long)]
    external_ranks: bool,
    /// Compute threads per rank (default: the cores divided among the
    /// ranks this process starts, at least 1).
    #[arg(long)]
    rank_threads: Option<usize>,
}

impl ParallelArgs {
    /// The split, when there is one.
    pub fn parallelism(&self) -> Result<Option<Parallelism>> {
        let par = parallelism(self.tp, self.pp, self.ep)?;
        Ok((par.world() > 1).then_some(par))
    }

    fn threads(&self, par: Parallelism) -> usize {
        self.rank_threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            (cores / par.world()).max(1)
        })
    }
}

/// `--tp`, `--pp`, `--ep` as the ranks see them: `tp × ep` ranks per stage.
fn parallelism(tp: usize, pp: usize, ep: usize) -> Result<Parallelism> {
    if tp == 0 || pp == 0 || ep == 0 {
        bail!("--tp, --pp and --ep must be at least 1");
    }
    Ok(Parallelism {
        tp: tp * ep,
        pp,
        ep,
    })
}

/// The other ranks this process started; killed with it.
#[derive(Debug)]
pub struct RankProcesses(Vec<Child>);

impl Drop for RankProcesses {
    fn drop(&mut self) {
        // They exit on the leader's Shutdown or when its connection closes;
        // this is for a leader that fails before either. One grace period
        // for all of them, not one each.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        for c in &mut self.0 {
            while std::time::Instant::now() < deadline {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts (or waits for) the other ranks and sets up the leader's backend.
pub fn start_leader(
    dir: &Path,
    args: &ParallelArgs,
    par: Parallelism,
    config: &EngineConfig,
) -> Result<(ParallelBackend, RankProcesses)> {
    if config.weight_quantization.is_some() {
        bail!("--quantize int4 runs without --tp/--pp (INT4 shards are not supported yet)");
    }
    // A split the model cannot take is refused before any rank starts.
    let model_config = tandem_engine::ModelConfig::from_dir(dir)
        .with_context(|| format!("reading the config of {}", dir.display()))?;
    par.check(&model_config)
        .with_context(|| format!("splitting {} over {} ranks", dir.display(), par.world()))?;
    set_compute_threads(args.threads(par));
    let rendezvous = Rendezvous::bind(args.rank_addr)
        .with_context(|| format!("binding the rank rendezvous at {}", args.rank_addr))?;
    let addr = rendezvous.local_addr()?;
    let mut children = RankProcesses(Vec::new());
    if args.external_ranks {
        tracing::info!(%addr, ranks = par.world() - 1, "waiting for the other ranks to join");
    } else {
        let exe = std::env::current_exe().context("finding this executable")?;
        for rank in 1..par.world() {
            let child = Command::new(&exe)
                .arg("rank")
                .args(["--leader", &addr.to_string()])
                .args(["--rank", &rank.to_string()])
                .args(["--tp", &(par.tp / par.ep).to_string()])
                .args(["--pp", &par.pp.to_string()])
                .args(["--ep", &par.ep.to_string()])
                .args(["--threads", &args.threads(par).to_string()])
                .arg("--model")
                .arg(dir)
                // The leader draws the load's progress; its ranks do not.
                .arg("--no-progress")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .with_context(|| format!("starting rank {rank}"))?;
            children.0.push(child);
        }
    }
    let comm = rendezvous
        .accept(par.world(), CommConfig::default())
        .context("waiting for the other ranks")?;
    let opts = LeaderOptions {
        parallelism: par,
        block_size: config.block_size,
        pool: config.kv_pool,
        kv_dtype: config.kv_cache_dtype,
        micro_batches: args.micro_batches.unwrap_or(par.pp),
    };
    let backend = ParallelBackend::start(dir, opts, Box::new(comm))
        .with_context(|| format!("setting up {} ranks", par.world()))?;
    Ok((backend, children))
}

fn set_compute_threads(n: usize) {
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
    {
        tracing::warn!(error = %e, "the compute pool was already started");
    }
}

/// `tandem rank`: one follower rank of a `--tp`/`--pp` worker.
#[derive(Args, Debug)]
pub struct RankArgs {
    /// The leader's `--rank-addr`.
    #[arg(long)]
    leader: SocketAddr,
    /// This rank (1 .. tp × ep × pp − 1; with `n = tp × ep` ranks per
    /// stage, rank r is rank r % n of stage r / n).
    #[arg(long)]
    rank: usize,
    #[arg(long)]
    tp: usize,
    #[arg(long, default_value_t = 1)]
    pp: usize,
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Checkpoint directory (default: the built-in model); the leader checks
    /// that it is the same model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
}

pub fn run_rank(args: RankArgs) -> Result<()> {
    if let Some(n) = args.threads {
        set_compute_threads(n);
    }
    let dir = match args.model {
        Some(d) => d,
        None => crate::default_model::default_model_dir()?,
    };
    let par = parallelism(args.tp, args.pp, args.ep)?;
    let comm = TcpComm::connect(args.leader, args.rank, par.world(), CommConfig::default())
        .with_context(|| format!("rank {} joining {}", args.rank, args.leader))?;
    run_follower(&dir, par, Box::new(comm)).with_context(|| format!("rank {}", args.rank))?;
    tracing::info!(rank = args.rank, "the leader shut the ranks down");
    Ok(())
}
