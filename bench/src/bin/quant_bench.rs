//! INT4 weights against bf16: batch-1 decode speed on one model, in one run.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin quant-bench -- --out bench/results/quant.json
//! ```
//!
//! Without `--model` it generates the `bench-100m` preset (≈88M params,
//! bf16). The same checkpoint is loaded twice, once as stored and once
//! quantized to INT4 at load (`Model::quantize_int4`, the path behind
//! `--quantize int4`). Each round decodes `--steps` single tokens on each
//! model after a `--context`-token prefill, alternating which model goes
//! first, so both see the same machine state; the report gives the median
//! step of each and their ratio.
//!
//! It also reports KV capacity in `--kv-memory` bytes for the same model:
//! the plan (`tandem plan`'s arithmetic, `CapacityPlan`) for bf16, int8 and
//! fp8, and the live pool an engine actually builds for f32, int8 and
//! fp8-e4m3 (`EngineCore::new` with `kv_cache_dtype`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_bench::percentile;
use tandem_engine::quant::{ActivationCodes, Int4Config};
use tandem_engine::{BlockId, KvCache, Model, SeqInput};

#[derive(Parser, Debug)]
#[command(about = "INT4 vs bf16 decode benchmark (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// INT4 group size.
    #[arg(long, default_value_t = tandem_engine::quant::DEFAULT_GROUP_SIZE)]
    group_size: usize,
    /// How activations are coded against the INT4 weights: two-pass or int8.
    #[arg(long, default_value = "two-pass")]
    activations: ActivationCodes,
    /// Tokens in the cache before decoding.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Decode steps per round and model.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Rounds (each runs both models).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// KV memory for the capacity comparison.
    #[arg(long, default_value_t = 1 << 30)]
    kv_memory: u64,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Prefills `context` tokens, then times `steps` batch-1 decode steps.
fn decode_steps(model: &Model, context: usize, steps: usize) -> Result<Vec<f64>> {
    let bs = 16;
    let vocab = model.config().vocab_size;
    let blocks: Vec<BlockId> = (0..(context + steps).div_ceil(bs) as BlockId).collect();
    let mut kv = KvCache::new(model.kv_layout(bs), blocks.len());
    let prompt: Vec<u32> = (0..context).map(|i| (i * 7919 % vocab) as u32).collect();
    let logits = model.forward(
        &[SeqInput {
            tokens: &prompt,
            start_pos: 0,
            blocks: &blocks,
            all_logits: false,
            lora: None,
        }],
        &mut kv,
    )?;
    let mut next = argmax(logits.last(0));
    let mut secs = Vec::with_capacity(steps);
    for step in 0..steps {
        let t = Instant::now();
        // On a pool thread, as the engine runs a small step.
        let logits = rayon::scope(|_| {
            model.forward(
                &[SeqInput {
                    tokens: &[next],
                    start_pos: context + step,
                    blocks: &blocks,
                    all_logits: false,
                    lora: None,
                }],
                &mut kv,
            )
        })?;
        secs.push(t.elapsed().as_secs_f64());
        next = argmax(logits.last(0));
    }
    Ok(secs)
}

/// One `[n, k]` projection at batch 1, bf16 against INT4: the best of many
/// repetitions (the kernels alone, without the rest of a decode step).
fn kernel_microbench(
    n: usize,
    k: usize,
    group: usize,
    activations: ActivationCodes,
) -> Result<serde_json::Value> {
    use tandem_engine::kernels::{linear, linear_int4, MatmulPolicy};
    use tandem_engine::quant::Int4Matrix;
    use tandem_engine::weights::{Matrix, WeightData};

    let mut s = 0x9e37_79b9_u32;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s % 2001) as f32 / 1000.0 - 1.0
    };
    let values: Vec<f32> = (0..n * k).map(|_| next() * 0.05).collect();
    let bf16 = Matrix {
        rows: n,
        cols: k,
        data: WeightData::Bf16(
            values
                .iter()
                .map(|&v| half::bf16::from_f32(v))
                .collect::<Vec<_>>()
                .into(),
        ),
    };
    let int4 = Int4Matrix::quantize(&bf16, Int4Config::new(group)?.with_activations(activations))?;
    let x: Vec<f32> = (0..k).map(|_| next()).collect();
    let mut out = vec![0f32; n];
    let reps = 400;
    let best = |f: &mut dyn FnMut()| {
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    };
    let bf16_s = best(&mut || linear(&x, 1, &bf16, None, MatmulPolicy::Fastest, &mut out));
    let int4_s = best(&mut || linear_int4(&x, 1, &int4, None, MatmulPolicy::Fastest, &mut out));
    eprintln!(
        "kernel {n}x{k} batch 1: bf16 {:.1} µs, INT4 {:.1} µs ({:.2}x)",
        bf16_s * 1e6,
        int4_s * 1e6,
        bf16_s / int4_s
    );
    Ok(json!({
        "shape": [n, k],
        "bf16_us_best": bf16_s * 1e6,
        "int4_us_best": int4_s * 1e6,
        "speedup": bf16_s / int4_s,
    }))
}

/// Blocks of KV in `memory` bytes: planned (weights and activations
/// excluded, so the whole budget is KV) and as an engine's live pool.
fn kv_capacity(
    dir: &std::path::Path,
    cfg: &tandem_engine::ModelConfig,
    memory: u64,
) -> Result<serde_json::Value> {
    use tandem_engine::capacity::{activation_bytes, CapacityPlan};
    use tandem_engine::serving::{EngineConfig, EngineCore, KvPoolSize};
    use tandem_engine::KvCacheDtype;

    let plan = CapacityPlan::new(0, 0);
    let activations = activation_bytes(cfg, plan.max_num_batched_tokens, plan.max_num_seqs);
    let mut planned = serde_json::Map::new();
    for dtype in [
        KvCacheDtype::Bf16,
        KvCacheDtype::Int8,
        KvCacheDtype::Fp8E4m3,
    ] {
        let c = CapacityPlan {
            kv_dtype: dtype,
            ..CapacityPlan::new(memory + activations, 0)
        }
        .plan(cfg)?;
        planned.insert(dtype.name().into(), json!(c.pool_blocks));
    }
    let mut live = serde_json::Map::new();
    for dtype in [KvCacheDtype::F32, KvCacheDtype::Int8, KvCacheDtype::Fp8E4m3] {
        let config = EngineConfig {
            kv_pool: KvPoolSize::Bytes(usize::try_from(memory)?),
            kv_cache_dtype: dtype,
            ..EngineConfig::default()
        };
        let core = EngineCore::new(Model::load(dir)?, None, vec![0], &config)?;
        live.insert(dtype.name().into(), json!(core.stats().num_blocks));
    }
    let ratio = |a: &str, b: &str| {
        planned[a].as_f64().unwrap_or(f64::NAN) / planned[b].as_f64().unwrap_or(f64::NAN)
    };
    let live_ratio = live["int8"].as_f64().unwrap_or(f64::NAN)
        / (live["f32"].as_f64().unwrap_or(f64::NAN) * 2.0);
    eprintln!(
        "KV blocks in {memory} B: plan {planned:?}, live {live:?}; int8/bf16 {:.3} (plan), {live_ratio:.3} (live, against twice the f32 pool)",
        ratio("int8", "bf16")
    );
    Ok(json!({
        "memory_bytes": memory,
        "planned_blocks": planned,
        "live_pool_blocks": live,
        "planned_int8_over_bf16": ratio("int8", "bf16"),
        "planned_fp8_over_bf16": ratio("fp8-e4m3", "bf16"),
        "live_int8_over_16bit": live_ratio,
    }))
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bench_model =
        tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "bench-100m")?;
    let dir = bench_model.dir.clone();
    let dense = Model::load(&dir).with_context(|| format!("loading {}", dir.display()))?;
    let mut int4 = Model::load(&dir)?;
    let t = Instant::now();
    int4.quantize_int4(Int4Config::new(args.group_size)?.with_activations(args.activations))?;
    let quantize_secs = t.elapsed().as_secs_f64();
    let cfg = dense.config().clone();
    let threads = rayon::current_num_threads();
    eprintln!(
        "model: {} layers, hidden {}, {:?} weights {:.1} MB; INT4 g{} {:.1} MB (quantized in {:.2} s); {threads} threads",
        cfg.num_layers,
        cfg.hidden_size,
        dense.weight_dtype(),
        dense.weight_bytes() as f64 / 1e6,
        args.group_size,
        int4.weight_bytes() as f64 / 1e6,
        quantize_secs,
    );

    // Warm both (page in the mapped weights, size rayon's pool).
    decode_steps(&dense, args.context, 2)?;
    decode_steps(&int4, args.context, 2)?;
    let (mut dense_secs, mut int4_secs) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let order: [(&Model, &mut Vec<f64>); 2] = if round % 2 == 0 {
            [(&dense, &mut dense_secs), (&int4, &mut int4_secs)]
        } else {
            [(&int4, &mut int4_secs), (&dense, &mut dense_secs)]
        };
        for (model, out) in order {
            out.extend(decode_steps(model, args.context, args.steps)?);
        }
        eprintln!(
            "round {round}: {:?} p50 {:.2} ms, INT4 p50 {:.2} ms",
            dense.weight_dtype(),
            percentile(&dense_secs, 50.0) * 1e3,
            percentile(&int4_secs, 50.0) * 1e3
        );
    }
    let (d50, q50) = (percentile(&dense_secs, 50.0), percentile(&int4_secs, 50.0));
    let speedup = d50 / q50;
    eprintln!(
        "batch-1 decode: {:?} {:.1} tok/s, INT4 {:.1} tok/s: {speedup:.2}x",
        dense.weight_dtype(),
        1.0 / d50,
        1.0 / q50
    );
    let report = json!({
        "model": {
            "path": dir.display().to_string(),
            "layers": cfg.num_layers, "hidden": cfg.hidden_size,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
        },
        "threads": threads,
        "context": args.context,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "dense": {
            "weight_dtype": format!("{:?}", dense.weight_dtype()),
            "weight_bytes": dense.weight_bytes(),
            "step_ms_p50": d50 * 1e3,
            "step_ms_p90": percentile(&dense_secs, 90.0) * 1e3,
            "tok_s": 1.0 / d50,
        },
        "int4": {
            "group_size": args.group_size,
            "activations": args.activations.name(),
            "kernel": tandem_engine::kernels::int4::kernel_name(),
            "weight_bytes": int4.weight_bytes(),
            "quantize_seconds": quantize_secs,
            "step_ms_p50": q50 * 1e3,
            "step_ms_p90": percentile(&int4_secs, 90.0) * 1e3,
            "tok_s": 1.0 / q50,
        },
        "int4_speedup_batch1": speedup,
    });
    let mut report = report;
    report["kernel"] = kernel_microbench(
        cfg.intermediate_size,
        cfg.hidden_size,
        args.group_size,
        args.activations,
    )?;
    report["kv_capacity"] = kv_capacity(&dir, &cfg, args.kv_memory)?;
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
