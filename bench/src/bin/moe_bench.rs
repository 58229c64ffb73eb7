//! Mixture-of-experts decode against a dense model of the same active
//! parameters, in one run.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin moe-bench -- --out bench/results/moe.json
//! ```
//!
//! Generates the `bench-moe` preset (a Qwen3-MoE shape: 80 experts of 128
//! features, 8 per token; ≈314M parameters, ≈60M active) and its dense
//! equivalent (the same model with one MLP of `8 × 128` features per layer,
//! so each token reads as many parameters), both bf16, then times decode
//! steps of each at every batch size in alternating rounds (MoE, dense,
//! MoE, dense, ...) so machine noise hits both alike; each round's ratio is
//! reported and the median of them is the result. At batch 1 both read
//! about the same bytes per step (the active weights); at large batches the
//! mixture's tokens spread over most experts, so it reads far more weights
//! than the dense model for the same work. Per-expert token counts show the
//! routing's balance.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_bench::{decode_tok_s, median};
use tandem_engine::capacity::parameter_counts;
use tandem_engine::{synth, DType, Model};

#[derive(Parser, Debug)]
#[command(about = "MoE against dense decode throughput (JSON output)")]
struct Args {
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    batches: Vec<usize>,
    /// Context already in the cache for each sequence.
    #[arg(long, default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per round.
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// Alternating rounds per batch size.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The mixture's preset.
    #[arg(long, default_value = "bench-moe")]
    preset: String,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let moe_cfg = synth::preset(&args.preset)?;
    anyhow::ensure!(moe_cfg.experts.is_some(), "{} has no experts", args.preset);
    let dense_cfg = moe_cfg.dense_equivalent();
    let tmp = tempfile::tempdir()?;
    let (moe_dir, dense_dir) = (tmp.path().join("moe"), tmp.path().join("dense"));
    eprintln!(
        "generating {} and its dense equivalent (bf16)…",
        args.preset
    );
    moe_cfg.write(&moe_dir, 0, DType::Bf16)?;
    dense_cfg.write(&dense_dir, 0, DType::Bf16)?;
    let moe = Model::load(&moe_dir).context("loading the mixture")?;
    let dense = Model::load(&dense_dir).context("loading the dense model")?;
    let moe_params = parameter_counts(&moe_dir, moe.config())?;
    let dense_params = parameter_counts(&dense_dir, dense.config())?;
    eprintln!(
        "moe: {} total, {} active; dense: {}",
        moe_params.total, moe_params.active, dense_params.total
    );

    let mut results = Vec::new();
    for &batch in &args.batches {
        let (mut moe_tok_s, mut dense_tok_s, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..args.rounds {
            let (ctx, steps) = (args.decode_context, args.decode_steps);
            let m = decode_tok_s(&moe, &[], batch, ctx, steps)?;
            let d = decode_tok_s(&dense, &[], batch, ctx, steps)?;
            eprintln!(
                "batch {batch} round {round}: moe {m:.1} tok/s, dense {d:.1} tok/s ({:.2}x)",
                m / d
            );
            moe_tok_s.push(m);
            dense_tok_s.push(d);
            ratios.push(m / d);
        }
        results.push(json!({
            "batch": batch,
            "moe_tok_s": moe_tok_s,
            "dense_tok_s": dense_tok_s,
            "ratio_per_round": ratios,
            "ratio_median": median(&ratios),
        }));
    }
    let routed = moe.routed_tokens();
    let balance: Vec<_> = routed
        .iter()
        .map(|(layer, counts)| {
            let total: u64 = counts.iter().sum();
            let hottest = counts.iter().copied().max().unwrap_or(0);
            let mean = total as f64 / counts.len().max(1) as f64;
            json!({"layer": layer, "tokens": total, "hottest_over_mean": hottest as f64 / mean})
        })
        .collect();
    let report = json!({
        "threads": rayon::current_num_threads(),
        "moe": model_json(&args.preset, &moe_dir, &moe, moe_params),
        "dense": model_json("dense equivalent", &dense_dir, &dense, dense_params),
        "decode_context": args.decode_context,
        "decode_steps": args.decode_steps,
        "decode": results,
        "expert_balance": balance,
        "routed_tokens": routed,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn model_json(
    name: &str,
    dir: &Path,
    model: &Model,
    p: tandem_engine::capacity::ParamCounts,
) -> serde_json::Value {
    let c = model.config();
    json!({
        "name": name,
        "architecture": c.architecture.hf_name(),
        "total_params": p.total,
        "active_params": p.active,
        "weight_bytes": model.weight_bytes(),
        "weights_mapped": model.weights_mapped(),
        "layers": c.num_layers, "hidden": c.hidden_size,
        "intermediate": c.intermediate_size,
        "experts": c.arch.moe.as_ref().map(|m| json!({
            "num_experts": m.num_experts, "top_k": m.top_k, "features": m.expert_intermediate,
        })),
        "path": dir.display().to_string(),
    })
}
