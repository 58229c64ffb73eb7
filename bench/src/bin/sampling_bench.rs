//! What picking one token costs on a real vocabulary size, per sampling
//! mode, against a sort of the whole vocabulary in the same run.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin sampling-bench -- --out bench/results/sampling.json
//! ```
//!
//! For each vocabulary size (Llama-2's 32,000, Llama-3's 128,256 and
//! Qwen2's 151,936 by default) and two logit shapes — `peaked`, a trained
//! model's usual next-token row (a few likely tokens over a Gaussian
//! floor), and `flat`, where top-p's nucleus spans a large share of the
//! vocabulary (its worst case) — it times `Sampler::sample` per mode:
//! greedy, temperature 1, top-k 50, top-p 0.9 and min-p 0.05. The
//! yardstick `full_sort_us` is one sort of the vocabulary's (token, weight)
//! pairs by weight, what every sampled draw cost before the sampler
//! stopped sorting it; each mode's `of_full_sort` is its time over that.
//! Modes are timed round-robin within each round, so drift hits all alike;
//! figures are medians over `--rounds`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use serde_json::json;
use tandem_bench::median;
use tandem_engine::sampling::Rng;
use tandem_engine::{Sampler, SamplingParams};

#[derive(Parser, Debug)]
#[command(about = "sampler cost per token benchmark (JSON output)")]
struct Args {
    /// Vocabulary sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [32_000usize, 128_256, 151_936])]
    vocab: Vec<usize>,
    /// Rounds; each times every mode once over `--tokens` draws.
    #[arg(long, default_value_t = 9)]
    rounds: usize,
    /// Draws per mode and round.
    #[arg(long, default_value_t = 50)]
    tokens: usize,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One logit row of `vocab` entries.
fn logits(vocab: usize, shape: &str, rng: &mut Rng) -> Vec<f32> {
    // An approximately normal floor (Irwin–Hall, 4 uniforms).
    let mut normal = || (0..4).map(|_| rng.next_f64()).sum::<f64>() - 2.0;
    match shape {
        // Standard deviation ≈ 1.7 around 0, eight tokens 12–19 above it.
        "peaked" => {
            let mut z: Vec<f32> = (0..vocab).map(|_| (normal() * 3.0) as f32).collect();
            for (i, boost) in [19.0f32, 18.0, 17.0, 16.0, 15.0, 14.0, 13.0, 12.0]
                .into_iter()
                .enumerate()
            {
                z[(i * 7919) % vocab] += boost;
            }
            z
        }
        // Standard deviation ≈ 0.6: most of the mass is spread thin.
        _ => (0..vocab).map(|_| normal() as f32).collect(),
    }
}

fn modes() -> Vec<(&'static str, SamplingParams)> {
    let sampled = |p: SamplingParams| SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        ..p
    };
    vec![
        ("greedy", SamplingParams::default()),
        ("temperature", sampled(SamplingParams::default())),
        (
            "top_k_50",
            sampled(SamplingParams {
                top_k: 50,
                ..Default::default()
            }),
        ),
        (
            "top_p_0.9",
            sampled(SamplingParams {
                top_p: 0.9,
                ..Default::default()
            }),
        ),
        (
            "min_p_0.05",
            sampled(SamplingParams {
                min_p: 0.05,
                ..Default::default()
            }),
        ),
    ]
}

/// Microseconds for one sort of the row's (token, weight) pairs by weight,
/// most likely first, ties by token: what a draw used to cost on top.
fn full_sort_us(z: &[f32]) -> f64 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut pairs: Vec<(u32, f32)> = z
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, (v - max).exp()))
        .collect();
    let start = Instant::now();
    pairs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let us = start.elapsed().as_secs_f64() * 1e6;
    std::hint::black_box(&pairs);
    us
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut rng = Rng::seeded(1);
    let mut rows = Vec::new();
    for &vocab in &args.vocab {
        for shape in ["peaked", "flat"] {
            let z = logits(vocab, shape, &mut rng);
            let modes = modes();
            let mut samplers: Vec<Sampler> = modes
                .iter()
                .map(|(_, p)| Sampler::new(p.clone(), &[]))
                .collect::<Result<_, _>>()?;
            let mut per_mode = vec![Vec::new(); modes.len()];
            let mut sort = Vec::new();
            for _ in 0..args.rounds {
                for (i, s) in samplers.iter_mut().enumerate() {
                    let start = Instant::now();
                    for _ in 0..args.tokens {
                        std::hint::black_box(s.sample(&z));
                    }
                    per_mode[i].push(start.elapsed().as_secs_f64() * 1e6 / args.tokens as f64);
                }
                sort.push(full_sort_us(&z));
            }
            let sort = median(&sort);
            let mut entry = json!({
                "vocab": vocab,
                "shape": shape,
                "full_sort_us": sort,
            });
            for ((name, _), times) in modes.iter().zip(&per_mode) {
                let us = median(times);
                entry[*name] = json!({ "us_per_token": us, "of_full_sort": us / sort });
                eprintln!(
                    "vocab {vocab:>7} {shape:<6} {name:<12} {us:>9.1} µs/token  ({:.2}x a full sort, {sort:.1} µs)",
                    us / sort
                );
            }
            rows.push(entry);
        }
    }
    let report = json!({
        "benchmark": "sampling",
        "rounds": args.rounds,
        "tokens_per_round": args.tokens,
        "rows": rows,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, &text)?;
    }
    Ok(())
}
