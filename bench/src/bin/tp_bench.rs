//! Tensor-parallel prefill on CPUs: TP=2 over two processes pinned to one
//! core each, against one process on one core, and what the all-reduces
//! cost.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin tp-bench -- --out bench/results/tp.json
//! tp-bench --preset bench-moe --ep --out bench/results/ep.json   # EP=2 against EP=1
//! ```
//!
//! Every measurement is a set of child processes of this binary under
//! `taskset` with one compute thread each: `--role single` on core 0, or
//! `--role leader` on core 0 with `--role rank` on core 1 (the real
//! `tandem-parallel` backend and `tandem-comm` communicator; same-host ranks
//! use its shared-memory links). Rounds alternate which goes first, so
//! drift on a shared machine hits both alike; the report has per-round
//! speed-ups and their median. Each child times `--reps` prefills of a
//! `--prompt-len`-token prompt (median) and `--decode-steps` single-token
//! decode steps, and the leader reports the time inside all-reduces per
//! layer (two per layer, after attention and after the MLP) — inside the
//! forward pass (transfer plus waiting for the other rank) and alone (two
//! pinned processes doing nothing but a layer's all-reduces).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_engine::serving::KvPoolSize;
use tandem_engine::{
    BlockAllocator, BlockTable, ComputeBackend, CpuBackend, DType, Model, SeqInput,
};
use tandem_parallel::{
    run_follower, CommConfig, LeaderOptions, ParallelBackend, Parallelism, Rendezvous, TcpComm,
};

#[derive(Parser, Debug)]
#[command(about = "tensor-parallel prefill benchmark (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate the `bench-100m` preset, bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Prefills timed per measurement.
    #[arg(long, default_value_t = 4)]
    reps: usize,
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// Measurements per configuration.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Split the two ranks' experts instead of their features (expert
    /// parallelism, `--ep 2`; a mixture-of-experts model).
    #[arg(long)]
    ep: bool,
    /// The preset generated without `--model`.
    #[arg(long, default_value = "bench-100m")]
    preset: String,
    /// Internal: `single`, `leader` or `rank`.
    #[arg(long, hide = true)]
    role: Option<String>,
    #[arg(long, hide = true)]
    leader: Option<SocketAddr>,
}

const BLOCK: usize = 16;

fn main() -> Result<()> {
    let args = Args::parse();
    match args.role.as_deref() {
        None => parent(&args),
        Some(role) => {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build_global()
                .context("one compute thread")?;
            let dir = args.model.clone().context("--model")?;
            let par = Parallelism {
                tp: 2,
                pp: 1,
                ep: if args.ep { 2 } else { 1 },
            };
            let leader = args.leader.context("--leader");
            match role {
                "single" => {
                    let model = Model::load(&dir)?;
                    let blocks = args.prompt_len / BLOCK + 2;
                    let mut backend = CpuBackend::new(model, BLOCK, blocks);
                    println!("{}", measure(&mut backend, &args)?);
                    Ok(())
                }
                "leader" => {
                    let rv = Rendezvous::bind(leader?)?;
                    let comm = rv.accept(2, CommConfig::default())?;
                    let shm = comm.shared_memory_links();
                    let blocks = args.prompt_len / BLOCK + 2;
                    let mut opts = LeaderOptions::new(par, KvPoolSize::Blocks(blocks));
                    opts.block_size = BLOCK;
                    let mut backend = ParallelBackend::start(&dir, opts, Box::new(comm))?;
                    let mut out = measure_leader(&mut backend, &args)?;
                    out["shared_memory_links"] = json!(shm);
                    println!("{out}");
                    Ok(())
                }
                "rank" => {
                    let comm = TcpComm::connect(leader?, 1, 2, CommConfig::default())?;
                    run_follower(&dir, par, Box::new(comm))?;
                    Ok(())
                }
                "allreduce-0" => {
                    let rv = Rendezvous::bind(leader?)?;
                    let mut comm = rv.accept(2, CommConfig::default())?;
                    let hidden = Model::load(&dir)?.config().hidden_size;
                    println!("{}", all_reduce_cost(&mut comm, hidden, &args)?);
                    Ok(())
                }
                "allreduce-1" => {
                    let mut comm = TcpComm::connect(leader?, 1, 2, CommConfig::default())?;
                    let hidden = Model::load(&dir)?.config().hidden_size;
                    all_reduce_cost(&mut comm, hidden, &args)?;
                    Ok(())
                }
                other => bail!("unknown role {other}"),
            }
        }
    }
}

/// The prompt and its blocks, for one backend's measurements.
struct Workload {
    prompt: Vec<u32>,
    _pool: BlockAllocator,
    table: BlockTable,
}

impl Workload {
    fn new(backend: &dyn ComputeBackend, args: &Args) -> Result<Self> {
        let vocab = backend.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..args.prompt_len as u32)
            .map(|i| (i * 7919 + 13) % vocab)
            .collect();
        let pool = BlockAllocator::new(args.prompt_len / BLOCK + 2, BLOCK)?;
        let mut table = BlockTable::new(&pool);
        table.append(args.prompt_len + args.decode_steps)?;
        Ok(Self {
            prompt,
            _pool: pool,
            table,
        })
    }

    /// Median time of `reps` prefills of the prompt (after one warm-up).
    fn prefill(
        &self,
        backend: &mut dyn ComputeBackend,
        reps: usize,
        warm: bool,
    ) -> Result<Duration> {
        let input = SeqInput {
            tokens: &self.prompt,
            start_pos: 0,
            blocks: self.table.blocks(),
            all_logits: false,
            lora: None,
        };
        if warm {
            backend.forward(&[input], &mut |_, _| {})?;
        }
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            backend.forward(&[input], &mut |_, _| {})?;
            times.push(t.elapsed());
        }
        Ok(median(&times))
    }

    /// Median time of single-token decode steps after the prompt.
    fn decode(&self, backend: &mut dyn ComputeBackend, steps: usize) -> Result<Duration> {
        let mut times = Vec::with_capacity(steps);
        for i in 0..steps {
            let tok = [self.prompt[i % self.prompt.len()]];
            let step = SeqInput {
                tokens: &tok,
                start_pos: self.prompt.len() + i,
                blocks: self.table.blocks(),
                all_logits: false,
                lora: None,
            };
            let t = Instant::now();
            // On a pool thread, as the engine runs a small step.
            rayon::scope(|_| backend.forward(&[step], &mut |_, _| {}))?;
            times.push(t.elapsed());
        }
        Ok(median(&times))
    }
}

fn measure(backend: &mut dyn ComputeBackend, args: &Args) -> Result<Value> {
    let w = Workload::new(backend, args)?;
    let prefill = w.prefill(backend, args.reps, true)?;
    let decode = w.decode(backend, args.decode_steps)?;
    Ok(json!({
        "prefill_s": prefill.as_secs_f64(),
        "decode_step_s": decode.as_secs_f64(),
    }))
}

/// As [`measure`], with the time inside all-reduces per layer per pass.
fn measure_leader(backend: &mut ParallelBackend, args: &Args) -> Result<Value> {
    let layers = backend.config().num_layers as f64;
    let w = Workload::new(backend, args)?;
    w.prefill(backend, 0, true)?;
    let a = backend.comm_stats();
    let prefill = w.prefill(backend, args.reps, false)?;
    let b = backend.comm_stats();
    let decode = w.decode(backend, args.decode_steps)?;
    let c = backend.comm_stats();
    let per_layer =
        |x: tandem_parallel::CommStats, y: tandem_parallel::CommStats, passes: usize| {
            (y.all_reduce_time - x.all_reduce_time).as_secs_f64() / (passes.max(1) as f64 * layers)
        };
    Ok(json!({
        "prefill_s": prefill.as_secs_f64(),
        "decode_step_s": decode.as_secs_f64(),
        "all_reduce_per_layer_prefill_s": per_layer(a, b, args.reps),
        "all_reduce_per_layer_decode_s": per_layer(b, c, args.decode_steps),
        "all_reduces": c.all_reduces,
    }))
}

/// The communicator alone: the all-reduces of one layer (two of
/// `tokens × hidden` floats) back to back between the two ranks, for a
/// prefill's and a decode step's token counts. Median of many.
fn all_reduce_cost(comm: &mut TcpComm, hidden: usize, args: &Args) -> Result<Value> {
    use tandem_parallel::Communicator;
    let group = [0, 1];
    let mut time = |tokens: usize, reps: usize| -> Result<Duration> {
        let mut buf = vec![1.0f32; tokens * hidden];
        comm.all_reduce_sum(&group, &mut buf)?; // warm-up
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            comm.all_reduce_sum(&group, &mut buf)?;
            comm.all_reduce_sum(&group, &mut buf)?;
            times.push(t.elapsed());
        }
        Ok(median(&times))
    };
    let prefill = time(args.prompt_len, 20)?;
    let decode = time(1, 200)?;
    Ok(json!({
        "per_layer_prefill_s": prefill.as_secs_f64(),
        "per_layer_decode_s": decode.as_secs_f64(),
        "shared_memory_links": comm.shared_memory_links(),
    }))
}

fn median(xs: &[Duration]) -> Duration {
    let mut v = xs.to_vec();
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn free_port() -> Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

fn spawn(
    exe: &Path,
    core: usize,
    dir: &Path,
    args: &Args,
    role: &str,
    leader: Option<SocketAddr>,
) -> Result<Child> {
    let mut c = Command::new("taskset");
    c.args(["-c", &core.to_string()])
        .arg(exe)
        .args(["--role", role, "--model"])
        .arg(dir)
        .args(["--prompt-len", &args.prompt_len.to_string()])
        .args(["--reps", &args.reps.to_string()])
        .args(["--decode-steps", &args.decode_steps.to_string()])
        .args(args.ep.then_some("--ep"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(a) = leader {
        c.args(["--leader", &a.to_string()]);
    }
    c.spawn()
        .with_context(|| format!("starting {role} (is `taskset` installed?)"))
}

fn result_of(mut child: Child) -> Result<Value> {
    let stdout = child.stdout.take().context("stdout")?;
    let line = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with('{'))
        .context("the child printed no result")?;
    let status = child.wait()?;
    if !status.success() {
        bail!("child failed: {status}");
    }
    Ok(serde_json::from_str(&line)?)
}

fn parent(args: &Args) -> Result<()> {
    let exe = std::env::current_exe()?;
    let tmp = tempfile::tempdir()?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => {
            tandem_engine::synth::preset(&args.preset)?.write(tmp.path(), 1, DType::Bf16)?;
            tmp.path().to_path_buf()
        }
    };
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let mut single = None;
        let mut tp2 = None;
        for first in [round % 2 == 0, round % 2 != 0] {
            if first {
                single = Some(result_of(spawn(&exe, 0, &dir, args, "single", None)?)?);
            } else {
                let addr = free_port()?;
                let leader = spawn(&exe, 0, &dir, args, "leader", Some(addr))?;
                let mut rank = spawn(&exe, 1, &dir, args, "rank", Some(addr))?;
                let out = result_of(leader)?;
                rank.wait()?;
                tp2 = Some(out);
            }
        }
        let (single, tp2) = (single.context("single")?, tp2.context("tp2")?);
        let addr = free_port()?;
        let ar0 = spawn(&exe, 0, &dir, args, "allreduce-0", Some(addr))?;
        let mut ar1 = spawn(&exe, 1, &dir, args, "allreduce-1", Some(addr))?;
        let all_reduce = result_of(ar0)?;
        ar1.wait()?;
        let speedup = single["prefill_s"].as_f64().unwrap_or(0.0)
            / tp2["prefill_s"].as_f64().unwrap_or(f64::INFINITY);
        let decode_speedup = single["decode_step_s"].as_f64().unwrap_or(0.0)
            / tp2["decode_step_s"].as_f64().unwrap_or(f64::INFINITY);
        eprintln!("round {round}: prefill speed-up {speedup:.2}x, decode {decode_speedup:.2}x");
        rounds.push(json!({
            "single": single,
            "tp2": tp2,
            "all_reduce_alone": all_reduce,
            "prefill_speedup": speedup,
            "decode_speedup": decode_speedup,
        }));
    }
    // The median over rounds of the number at `path` in each round's JSON.
    let med = |path: &[&str]| {
        let mut v: Vec<f64> = rounds
            .iter()
            .filter_map(|r| path.iter().fold(r, |v, k| &v[*k]).as_f64())
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let report = json!({
        "model": match &args.model {
            Some(_) => dir.display().to_string(),
            None => format!(
                "{} (bf16, {:.0}M params)",
                args.preset,
                tandem_engine::synth::preset(&args.preset)?.num_params() as f64 / 1e6
            ),
        },
        // How the two ranks split the model: features of every layer (tp),
        // or whole experts of the MoE layers (ep; attention still by head).
        "split": if args.ep { "ep" } else { "tp" },
        "prompt_len": args.prompt_len,
        "threads_per_process": 1,
        "prefill_speedup_median": med(&["prefill_speedup"]),
        "decode_speedup_median": med(&["decode_speedup"]),
        // Inside the forward pass: transfer plus waiting for the other
        // rank to arrive (imbalance, scheduling).
        "in_forward_all_reduce_per_layer_prefill_s_median": med(&["tp2", "all_reduce_per_layer_prefill_s"]),
        "in_forward_all_reduce_per_layer_decode_s_median": med(&["tp2", "all_reduce_per_layer_decode_s"]),
        // The communicator alone, both ranks ready: the transfer cost.
        "all_reduce_alone_per_layer_prefill_s_median": med(&["all_reduce_alone", "per_layer_prefill_s"]),
        "all_reduce_alone_per_layer_decode_s_median": med(&["all_reduce_alone", "per_layer_decode_s"]),
        "rounds": rounds,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, text + "\n")?;
    }
    Ok(())
}
