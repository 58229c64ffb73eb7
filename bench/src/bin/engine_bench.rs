//! Engine throughput on one machine: prefill, decode at several batch sizes,
//! and how close decode gets to the memory-bandwidth roofline.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin engine-bench -- --out bench-engine.json
//! ```
//!
//! Without `--model` it generates the `bench-100m` preset (≈88M params, bf16)
//! into a temporary directory. Decode's roofline is
//! `(weight bytes + KV bytes read) / measured read bandwidth` per step,
//! the bandwidth measured over a buffer the size of the weights (in L3 when
//! they fit);
//! prefill is compared with the measured f32 GEMM peak.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_bench::{percentile, read_bandwidth};
use tandem_engine::kernels::{linear, MatmulPolicy};
use tandem_engine::weights::{Matrix, Residency, WeightData};
use tandem_engine::{BlockAllocator, BlockTable, KvCache, KvCacheDtype, Model, SeqInput};

#[derive(Parser, Debug)]
#[command(about = "tandem engine benchmark (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prefill prompt length.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    batches: Vec<usize>,
    /// Context already in the cache for each decoding sequence.
    #[arg(long, default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 24)]
    decode_steps: usize,
    /// Prefill repetitions.
    #[arg(long, default_value_t = 3)]
    prefill_reps: usize,
    /// KV block size.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Run every size through the row kernels (`MatmulPolicy::BatchInvariant`)
    /// instead of the GEMM above 48 rows.
    #[arg(long)]
    batch_invariant: bool,
    /// Keep bf16 weights off AMX tiles (`MatmulPolicy::VectorOnly`): the
    /// vector kernels only, to measure the tiles against.
    #[arg(long, conflicts_with = "batch_invariant")]
    no_amx: bool,
    /// bf16 weights against activations rounded to bf16
    /// (`MatmulPolicy::Bf16Activations`: `vdpbf16ps` on AVX512-BF16).
    #[arg(long, conflicts_with_all = ["batch_invariant", "no_amx"])]
    bf16_activations: bool,
    /// What the KV cache stores (f32, bf16, f16, int8, fp8-e4m3).
    #[arg(long, default_value = "f32")]
    kv_dtype: KvCacheDtype,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the decode roofline chart (step time against batch) here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bench_model =
        tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "bench-100m")?;
    let dir = bench_model.dir.clone();
    // As a server holds them: mapped where the linears are packed (the
    // packed copies replace the file's bytes), else a huge-page copy.
    let residency = match args.bf16_activations && MatmulPolicy::Bf16Activations.packs_weights() {
        true => Residency::Mapped,
        false => Residency::HugePages,
    };
    let mut model =
        Model::load_with(&dir, residency).with_context(|| format!("loading {}", dir.display()))?;
    if args.batch_invariant {
        model.set_matmul_policy(MatmulPolicy::BatchInvariant);
    }
    if args.no_amx {
        model.set_matmul_policy(MatmulPolicy::VectorOnly);
    }
    if args.bf16_activations {
        model.set_matmul_policy(MatmulPolicy::Bf16Activations);
    }
    let cfg = model.config().clone();
    let bs = args.block_size;
    let threads = rayon::current_num_threads();
    eprintln!(
        "model: {} layers, hidden {}, vocab {}, {:?} weights ({:.1} MB), {threads} threads",
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        model.weight_dtype(),
        model.weight_bytes() as f64 / 1e6
    );

    eprintln!("measuring read bandwidth…");
    // The roofline's bandwidth is a stream the size of what a step reads:
    // a small model's weights fit a large L3 (480 MiB on the
    // Sapphire Rapids VMs here) and stream from it faster than a buffer
    // past the caches does (reported beside it).
    let bw = read_bandwidth(model.weight_bytes().max(1 << 26), 20);
    let dram_bw = read_bandwidth(1 << 30, 5);

    eprintln!("measuring f32 GEMM peak…");
    let gemm_flops = gemm_peak(args.prompt_len, cfg.hidden_size, cfg.intermediate_size);

    // Prefill: one sequence of prompt_len tokens, one forward.
    let prompt: Vec<u32> = (0..args.prompt_len)
        .map(|i| (i * 7919 % cfg.vocab_size) as u32)
        .collect();
    let blocks = args.prompt_len.div_ceil(bs);
    let pool = BlockAllocator::new(blocks, bs)?;
    let mut kv = KvCache::with_dtype(model.kv_layout(bs), blocks, args.kv_dtype);
    let mut prefill_secs = Vec::new();
    for _ in 0..args.prefill_reps + 1 {
        let mut table = BlockTable::new(&pool);
        table.append(prompt.len())?;
        let t = Instant::now();
        let inputs = [SeqInput {
            tokens: &prompt,
            start_pos: 0,
            blocks: table.blocks(),
            all_logits: false,
            lora: None,
        }];
        on_pool(|| model.forward(&inputs, &mut kv))?;
        prefill_secs.push(t.elapsed().as_secs_f64());
    }
    prefill_secs.remove(0); // warm-up
    let prefill_best = prefill_secs.iter().copied().fold(f64::INFINITY, f64::min);
    let prefill_tok_s = args.prompt_len as f64 / prefill_best;
    // Linear-layer FLOPs only (attention is a small share at 512 tokens).
    let prefill_flops = 2.0
        * args.prompt_len as f64
        * (model.weight_bytes() as f64 / model.weight_dtype().size() as f64);
    drop(kv);

    let mut decode = Vec::new();
    for &batch in &args.batches {
        let ctx = args.decode_context;
        let per_seq = (ctx + args.decode_steps + 1).div_ceil(bs);
        let pool = BlockAllocator::new(per_seq * batch, bs)?;
        let mut kv = KvCache::with_dtype(model.kv_layout(bs), per_seq * batch, args.kv_dtype);
        let mut tables: Vec<BlockTable> = (0..batch).map(|_| BlockTable::new(&pool)).collect();
        // Fill every sequence's context with one batched prefill.
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|s| {
                (0..ctx)
                    .map(|i| ((s * 131 + i * 17) % cfg.vocab_size) as u32)
                    .collect()
            })
            .collect();
        for t in &mut tables {
            t.append(ctx)?;
        }
        let inputs: Vec<SeqInput> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| SeqInput {
                tokens: p,
                start_pos: 0,
                blocks: t.blocks(),
                all_logits: false,
                lora: None,
            })
            .collect();
        model.forward(&inputs, &mut kv)?;
        let mut step_secs = Vec::new();
        let next: Vec<[u32; 1]> = (0..batch).map(|s| [(s % cfg.vocab_size) as u32]).collect();
        for step in 0..args.decode_steps {
            for t in &mut tables {
                t.append(1)?;
            }
            let inputs: Vec<SeqInput> = next
                .iter()
                .zip(&tables)
                .map(|(tok, t)| SeqInput {
                    tokens: tok,
                    start_pos: ctx + step,
                    blocks: t.blocks(),
                    all_logits: false,
                    lora: None,
                })
                .collect();
            let t0 = Instant::now();
            on_pool(|| model.forward(&inputs, &mut kv))?;
            step_secs.push(t0.elapsed().as_secs_f64());
        }
        step_secs.remove(0); // warm-up
        let median = percentile(&step_secs, 50.0);
        let kv_read = batch as f64
            * (ctx + args.decode_steps / 2) as f64
            * cfg.kv_bytes_per_token() as f64
            * args.kv_dtype.bytes() as f64
            / 4.0;
        let bytes = model.weight_bytes() as f64 + kv_read;
        let ideal = bytes / bw;
        // Linear layers: 2 FLOPs per weight per token.
        let params = model.weight_bytes() as f64 / model.weight_dtype().size() as f64;
        let compute = 2.0 * params * batch as f64 / gemm_flops;
        let entry = json!({
            "batch": batch,
            "context": ctx,
            "step_ms_p50": median * 1e3,
            "step_ms_p90": percentile(&step_secs, 90.0) * 1e3,
            "tok_s": batch as f64 / median,
            "bytes_per_step": bytes,
            "roofline_step_ms": ideal * 1e3,
            "roofline_fraction": ideal / median,
            "compute_bound_step_ms": compute * 1e3,
            "bound": if compute > ideal { "compute" } else { "bandwidth" },
        });
        eprintln!(
            "decode batch {batch}: {:.1} tok/s, step {:.2} ms, roofline {:.0}%",
            batch as f64 / median,
            median * 1e3,
            100.0 * ideal / median
        );
        decode.push(entry);
    }

    // Where the bounds cross: the batch from which a decode step's linear
    // FLOPs take longer at the GEMM peak than reading the weights does.
    let params = model.weight_bytes() as f64 / model.weight_dtype().size() as f64;
    let crossover_batch = (model.weight_bytes() as f64 / bw) / (2.0 * params / gemm_flops);
    let measured_compute_bound = decode
        .iter()
        .find(|d| d["bound"] == "compute")
        .map(|d| d["batch"].clone());
    if let Some(path) = &args.plot {
        let series = |name: &str, key: &str| {
            tandem_loadgen::plot::Series::new(
                name,
                decode
                    .iter()
                    .filter_map(|d| Some((d["batch"].as_f64()?, d[key].as_f64()?)))
                    .collect(),
            )
        };
        tandem_loadgen::plot::line_chart(
            path,
            &tandem_loadgen::plot::Chart {
                title: format!(
                    "decode step time against batch ({:.0} GB/s, {:.0} GFLOP/s peak)",
                    bw / 1e9,
                    gemm_flops / 1e9
                ),
                x_label: "batch (sequences)".into(),
                y_label: "step time (ms)".into(),
                x_log: true,
                series: vec![
                    series("measured p50", "step_ms_p50"),
                    series("bandwidth bound (weights + KV)", "roofline_step_ms"),
                    series(
                        "compute bound (linear FLOPs at GEMM peak)",
                        "compute_bound_step_ms",
                    ),
                ],
            },
        )?;
        eprintln!("wrote {}", path.display());
    }

    let report = json!({
        "model": {
            "path": dir.display().to_string(),
            "params": (model.weight_bytes() / model.weight_dtype().size()),
            "weight_dtype": format!("{:?}", model.weight_dtype()),
            "weight_bytes": model.weight_bytes(),
            "weights_mapped": model.weights_mapped(),
            "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "vocab": cfg.vocab_size,
        },
        "threads": threads,
        "kv_dtype": args.kv_dtype.name(),
        "memory_read_bandwidth_gb_s": bw / 1e9,
        "dram_read_bandwidth_gb_s": dram_bw / 1e9,
        "gemm_f32_peak_gflop_s": gemm_flops / 1e9,
        "prefill": {
            "prompt_len": args.prompt_len,
            "tok_s": prefill_tok_s,
            "seconds_best": prefill_best,
            "linear_gflop_s": prefill_flops / prefill_best / 1e9,
            "fraction_of_gemm_peak": prefill_flops / prefill_best / gemm_flops,
        },
        "decode": decode,
        "roofline_crossover_batch": crossover_batch,
        "first_compute_bound_batch": measured_compute_bound,
        // Mixtures of experts: tokens each expert got over the run, per
        // sparse layer (empty for a dense model).
        "routed_tokens": model.routed_tokens(),
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Runs one forward pass as the serving engine runs its steps
/// (`EngineCore::forward_placed`): on a thread of rayon's pool, the other
/// threads kept awake until it returns.
fn on_pool<R: Send>(step: impl FnOnce() -> R + Send) -> R {
    tandem_engine::pool::run_step(step)
}

/// Best f32 GEMM rate (FLOP/s) on a prefill-shaped problem.
fn gemm_peak(m: usize, k: usize, n: usize) -> f64 {
    let w = Matrix {
        rows: n,
        cols: k,
        data: WeightData::F32(vec![0.01f32; n * k].into()),
    };
    let x = vec![0.5f32; m * k];
    let mut out = vec![0.0f32; m * n];
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        linear(&x, m, &w, None, MatmulPolicy::Fastest, &mut out);
        best = best.max(2.0 * (m * n * k) as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&out);
    best
}
