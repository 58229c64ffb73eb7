//! Decode with many LoRA adapters mixed in one batch against the base model
//! alone, in one run.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin lora-bench -- --out bench/results/lora.json
//! ```
//!
//! Generates the `bench-100m` preset (bf16) and `--adapters` random
//! adapters of rank `--rank` on all seven projections of every layer, then
//! times decode steps at each batch size in alternating rounds: the base
//! model alone, then the same batch with row `i` under adapter `i mod
//! adapters` (the base GEMM once, each row's low-rank update after it).
//! Each round's ratio is reported, and the median of them is the result.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_bench::{decode_tok_s, median};
use tandem_engine::lora::{write_random_adapter, LoraAdapter, LoraTarget};
use tandem_engine::{synth, DType, Model};

#[derive(Parser, Debug)]
#[command(about = "Mixed-adapter LoRA decode against the base model (JSON output)")]
struct Args {
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    batches: Vec<usize>,
    /// Adapters mixed in a batch.
    #[arg(long, default_value_t = 8)]
    adapters: usize,
    /// Their rank.
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// Context already in the cache for each sequence.
    #[arg(long, default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per round.
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// Alternating rounds per batch size.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The base model's preset.
    #[arg(long, default_value = "bench-100m")]
    preset: String,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.adapters > 0, "--adapters must be positive");
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("base");
    eprintln!(
        "generating {} (bf16) and {} adapters…",
        args.preset, args.adapters
    );
    synth::preset(&args.preset)?.write(&dir, 0, DType::Bf16)?;
    let model = Model::load(&dir).context("loading the base model")?;
    let mut adapters = Vec::new();
    for i in 0..args.adapters {
        let adir = tmp.path().join(format!("adapter{i}"));
        write_random_adapter(&adir, model.config(), args.rank, &LoraTarget::ALL, i as u64)?;
        let name = format!("adapter{i}");
        adapters.push(LoraAdapter::load(&name, &adir, model.config(), args.rank)?);
    }
    let adapter_bytes: usize = adapters.iter().map(LoraAdapter::bytes).sum();

    let mut results = Vec::new();
    for &batch in &args.batches {
        let (mut base_tok_s, mut mixed_tok_s, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..args.rounds {
            let (ctx, steps) = (args.decode_context, args.decode_steps);
            let b = decode_tok_s(&model, &[], batch, ctx, steps)?;
            let m = decode_tok_s(&model, &adapters, batch, ctx, steps)?;
            eprintln!(
                "batch {batch} round {round}: base {b:.1} tok/s, {} adapters {m:.1} tok/s ({:.2}x)",
                args.adapters,
                m / b
            );
            base_tok_s.push(b);
            mixed_tok_s.push(m);
            ratios.push(m / b);
        }
        results.push(json!({
            "batch": batch,
            "base_tok_s": base_tok_s,
            "mixed_tok_s": mixed_tok_s,
            "ratio_per_round": ratios,
            "ratio_median": median(&ratios),
        }));
    }
    let report = json!({
        "threads": rayon::current_num_threads(),
        "preset": args.preset,
        "base_weight_bytes": model.weight_bytes(),
        "adapters": args.adapters,
        "rank": args.rank,
        "targets": LoraTarget::ALL.iter().map(|t| t.module()).collect::<Vec<_>>(),
        "adapter_bytes": adapter_bytes,
        "decode_context": args.decode_context,
        "decode_steps": args.decode_steps,
        "decode": results,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
