//! Serving-engine benchmark: prefix-cache TTFT, continuous against static
//! batching, and KV fragmentation of the paged pool.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin serving-bench -- --out bench-serving.json
//! ```
//!
//! Everything runs in one process through the engine thread
//! ([`EngineHandle`]), so the numbers are the engine's own, free of network
//! costs, and every comparison is a ratio inside one run:
//!
//! * **Prefix cache:** pairs of requests share a `--prefix-len` token prefix;
//!   the second's TTFT (engine-measured) against the first's.
//! * **Continuous vs static batching** on one mixed workload (prompt lengths
//!   uniform, output lengths long-tailed as in chat traces). Continuous: all
//!   requests submitted at once, the scheduler keeps up to `--batch` running.
//!   Static, classic: batches of `--batch`, each decoding until its longest
//!   member is done (finished members still occupy their slot, as in a padded
//!   `generate` batch; only real tokens are counted). Static, early exit: the
//!   same batches, but finished members leave (a stronger baseline than most
//!   static servers). Throughput counts real output tokens over wall time.
//! * **Fragmentation:** of the continuous run, averaged over steps: the share
//!   of allocated KV slots holding no token, beside the share a contiguous
//!   `max_model_len` reservation per sequence would leave empty.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_bench::percentile;
use tandem_engine::serving::{
    EngineConfig, EngineCore, EngineHandle, KvPoolSize, Prompt, Request, RequestEvent,
    RequestStream, RequestSummary,
};
use tandem_engine::Checkpoint;

#[derive(Parser, Debug)]
#[command(about = "tandem serving benchmark (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Shared prefix length for the prefix-cache test.
    #[arg(long, default_value_t = 512)]
    prefix_len: usize,
    /// Prefix-cache request pairs.
    #[arg(long, default_value_t = 3)]
    prefix_pairs: usize,
    /// Requests in the mixed workload.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Batch size (static) and max_num_seqs (continuous).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Prompt lengths are uniform in [min, max].
    #[arg(long, value_delimiter = ',', default_value = "16,256")]
    prompt_lens: Vec<usize>,
    /// Output lengths: this share of requests is long ...
    #[arg(long, default_value_t = 0.2)]
    long_share: f64,
    /// ... with lengths uniform in this range; the rest uniform in the short range.
    #[arg(long, value_delimiter = ',', default_value = "128,384")]
    long_outputs: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "8,48")]
    short_outputs: Vec<usize>,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the TTFT CDF of the batching modes here (PNG).
    #[arg(long)]
    plot: Option<PathBuf>,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        tandem_bench::xorshift(&mut self.0)
    }
    fn range(&mut self, r: &[usize]) -> usize {
        r[0] + (self.next() % (r[1] - r[0] + 1) as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn engine(ck: &Checkpoint, config: &EngineConfig) -> Result<EngineHandle> {
    let model = tandem_engine::Model::load(&ck.dir)?;
    let tok = ck
        .tokenizer
        .as_ref()
        .map(|_| tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json")))
        .transpose()?;
    let core = EngineCore::new(model, tok.map(Arc::new), ck.eos_token_ids.clone(), config)?;
    Ok(EngineHandle::spawn(core)?)
}

fn finish(mut s: RequestStream) -> Result<(RequestSummary, Vec<f64>)> {
    let t0 = Instant::now();
    let mut gaps = Vec::new();
    let mut last = t0;
    while let Some(ev) = s.blocking_next() {
        match ev {
            RequestEvent::Delta(_) => {
                let now = Instant::now();
                gaps.push((now - last).as_secs_f64());
                last = now;
            }
            RequestEvent::Finished(sum) => return Ok((sum, gaps)),
            RequestEvent::Error(e) => bail!("request failed: {e}"),
            RequestEvent::RemotePrefill(_) => bail!("unexpected remote prefill"),
            RequestEvent::PromptLogprobs(_) => bail!("unexpected prompt scores"),
        }
    }
    Err(anyhow!("stream ended without a summary"))
}

fn prefix_cache(ck: &Checkpoint, args: &Args) -> Result<serde_json::Value> {
    let handle = engine(ck, &EngineConfig::default())?;
    let vocab = handle.limits().vocab_size as u64;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut pairs = Vec::new();
    for _ in 0..args.prefix_pairs {
        let prefix: Vec<u32> = (0..args.prefix_len)
            .map(|_| (rng.next() % vocab) as u32)
            .collect();
        let mut ttfts = Vec::new();
        let mut cached = Vec::new();
        for _ in 0..2 {
            let mut p = prefix.clone();
            p.extend((0..16).map(|_| (rng.next() % vocab) as u32));
            let (sum, _) = finish(handle.submit(Request::new(Prompt::Tokens(p), 1))?)?;
            ttfts.push(sum.timings.ttft.context("no ttft")?.as_secs_f64());
            cached.push(sum.usage.cached_tokens);
        }
        pairs.push(json!({
            "cold_ttft_s": ttfts[0], "warm_ttft_s": ttfts[1],
            "speedup": ttfts[0] / ttfts[1],
            "cold_cached_tokens": cached[0], "warm_cached_tokens": cached[1],
        }));
        eprintln!(
            "prefix cache: cold {:.3}s, warm {:.3}s ({:.1}x), warm cached {} tokens",
            ttfts[0],
            ttfts[1],
            ttfts[0] / ttfts[1],
            cached[1]
        );
    }
    let mut speedups: Vec<f64> = pairs.iter().filter_map(|p| p["speedup"].as_f64()).collect();
    speedups.sort_by(f64::total_cmp);
    Ok(json!({
        "prefix_len": args.prefix_len,
        "suffix_len": 16,
        "pairs": pairs,
        "median_ttft_speedup": percentile(&speedups, 50.0),
        "target_speedup": 5.0,
    }))
}

fn workload(args: &Args, vocab: usize) -> Vec<(Vec<u32>, usize)> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    (0..args.requests)
        .map(|_| {
            let len = rng.range(&args.prompt_lens);
            let prompt = (0..len)
                .map(|_| (rng.next() % vocab as u64) as u32)
                .collect();
            let out = if rng.unit() < args.long_share {
                rng.range(&args.long_outputs)
            } else {
                rng.range(&args.short_outputs)
            };
            (prompt, out)
        })
        .collect()
}

fn request(prompt: &[u32], max_tokens: usize) -> Request {
    let mut r = Request::new(Prompt::Tokens(prompt.to_vec()), max_tokens);
    r.ignore_eos = true; // output lengths are the workload's
    r
}

/// Runs the workload; `static_batches` gives the batches' decode lengths
/// (`None`: continuous). Returns (useful tokens, seconds, engine stats).
fn run_workload(
    ck: &Checkpoint,
    args: &Args,
    work: &[(Vec<u32>, usize)],
    mode: &str,
) -> Result<serde_json::Value> {
    let config = EngineConfig {
        max_num_seqs: args.batch,
        // Prefix caching off: the workload has no shared prefixes, and the
        // modes must not help each other through the cache.
        enable_prefix_caching: false,
        kv_pool: KvPoolSize::Bytes(4 << 30),
        ..EngineConfig::default()
    };
    let handle = engine(ck, &config)?;
    let t0 = Instant::now();
    let mut useful = 0usize;
    let mut ttfts = Vec::new();
    let mut tpots = Vec::new();
    let mut collect = |sum: &RequestSummary, want: usize| {
        useful += want;
        if let Some(t) = sum.timings.ttft {
            ttfts.push(t.as_secs_f64());
        }
        if let Some(t) = sum.timings.tpot {
            tpots.push(t.as_secs_f64());
        }
    };
    match mode {
        "continuous" => {
            let streams = work
                .iter()
                .map(|(p, n)| handle.submit(request(p, *n)))
                .collect::<Result<Vec<_>, _>>()?;
            for (s, (_, n)) in streams.into_iter().zip(work) {
                collect(&finish(s)?.0, *n);
            }
        }
        "static" | "static_early_exit" => {
            for batch in work.chunks(args.batch) {
                let longest = batch.iter().map(|w| w.1).max().unwrap_or(1);
                let streams = batch
                    .iter()
                    .map(|(p, n)| {
                        let len = if mode == "static" { longest } else { *n };
                        handle.submit(request(p, len))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                for (s, (_, n)) in streams.into_iter().zip(batch) {
                    collect(&finish(s)?.0, *n);
                }
            }
        }
        other => bail!("unknown mode {other}"),
    }
    let secs = t0.elapsed().as_secs_f64();
    let stats = handle.stats();
    ttfts.sort_by(f64::total_cmp);
    tpots.sort_by(f64::total_cmp);
    eprintln!(
        "{mode}: {useful} output tokens in {secs:.1}s = {:.1} tok/s",
        useful as f64 / secs
    );
    Ok(json!({
        "mode": mode,
        "output_tokens": useful,
        "seconds": secs,
        "output_tok_per_s": useful as f64 / secs,
        "ttft_s": ttfts,
        "ttft_p50_s": percentile(&ttfts, 50.0),
        "ttft_p99_s": percentile(&ttfts, 99.0),
        "tpot_p50_s": percentile(&tpots, 50.0),
        "steps": stats.steps,
        "kv_paged_fragmentation": stats.paged_fragmentation(),
        "kv_contiguous_waste": stats.contiguous_waste(),
        "max_model_len": stats.max_model_len,
    }))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.batch == 0 || args.requests == 0 {
        bail!("--batch and --requests must be positive");
    }
    let bench_model =
        tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "bench-100m")?;
    let dir = bench_model.dir.clone();
    let ck = Checkpoint::open(&dir).with_context(|| format!("loading {}", dir.display()))?;
    let vocab = ck.model.config().vocab_size;
    let threads = rayon::current_num_threads();

    let prefix = prefix_cache(&ck, &args)?;
    let work = workload(&args, vocab);
    let continuous = run_workload(&ck, &args, &work, "continuous")?;
    let classic = run_workload(&ck, &args, &work, "static")?;
    let early = run_workload(&ck, &args, &work, "static_early_exit")?;
    let tput = |v: &serde_json::Value| v["output_tok_per_s"].as_f64().unwrap_or(0.0);
    let report = json!({
        "model": dir.display().to_string(),
        "threads": threads,
        "prefix_cache": prefix,
        "workload": {
            "requests": args.requests,
            "batch": args.batch,
            "prompt_lens": args.prompt_lens,
            "short_outputs": args.short_outputs,
            "long_outputs": args.long_outputs,
            "long_share": args.long_share,
        },
        "continuous": continuous,
        "static": classic,
        "static_early_exit": early,
        "continuous_over_static": tput(&continuous) / tput(&classic),
        "continuous_over_static_early_exit": tput(&continuous) / tput(&early),
        "target_continuous_over_static": 2.0,
        "kv_paged_fragmentation": continuous["kv_paged_fragmentation"],
        "kv_contiguous_waste": continuous["kv_contiguous_waste"],
        "target_kv_paged_fragmentation": 0.04,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(path) = &args.plot {
        use tandem_loadgen::plot::{cdf, line_chart, Chart, Series};
        let series = [&continuous, &classic, &early]
            .iter()
            .map(|r| {
                let ms: Vec<f64> = r["ttft_s"]
                    .as_array()
                    .map(|v| {
                        v.iter()
                            .filter_map(|x| x.as_f64())
                            .map(|x| x * 1e3)
                            .collect()
                    })
                    .unwrap_or_default();
                let name = format!(
                    "{} ({:.0} tok/s)",
                    r["mode"].as_str().unwrap_or("?"),
                    r["output_tok_per_s"].as_f64().unwrap_or(0.0)
                );
                Series::new(name, cdf(&ms))
            })
            .collect();
        line_chart(
            path,
            &Chart {
                title: "TTFT: continuous against static batching (same workload)".into(),
                x_label: "TTFT (ms)".into(),
                y_label: "fraction of requests".into(),
                x_log: false,
                series,
            },
        )?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
