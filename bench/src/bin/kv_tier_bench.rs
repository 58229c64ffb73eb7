//! The KV disk tier's payoff: time to first token on a shared-prefix
//! workload whose working set is many times the KV pool, with the tier and
//! without, side by side in one run.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin kv-tier-bench -- --out bench/results/kv-tier.json
//! ```
//!
//! `--prefixes` prompts of `--prefix-len` tokens are asked in turn, each
//! with a fresh `--suffix-len`-token tail, for `--rounds` rounds after one
//! warm-up round. The pool (`--pool-blocks`) holds about one of them, so
//! without the tier every request recomputes its prefix (LRU over a cyclic
//! working set keeps nothing); with it, the prefix comes back from disk.
//! The two engines alternate request by request, so drift on a shared
//! machine hits both. The block files are freshly written, so most reads
//! come from the page cache: this measures the tier's own cost (read,
//! verify, copy into the pool) against recompute, not a cold disk.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_bench::{median, percentile, xorshift};
use tandem_engine::serving::{
    DiskTier, DiskTierConfig, EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent,
};
use tokio::sync::mpsc::unbounded_channel;

#[derive(Parser, Debug)]
#[command(about = "KV disk tier benchmark: TTFT with and without (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value_t = 13)]
    prefixes: usize,
    #[arg(long, default_value_t = 1024)]
    prefix_len: usize,
    #[arg(long, default_value_t = 16)]
    suffix_len: usize,
    /// Measured rounds over every prefix (after one warm-up round).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// KV pool size in blocks of 16 tokens.
    #[arg(long, default_value_t = 80)]
    pool_blocks: usize,
    /// Directory for the tier's files (default: a temporary one).
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Time to first token of one request (seconds) and the prompt tokens it
/// found cached.
fn ttft(core: &mut EngineCore, prompt: Vec<u32>) -> Result<(f64, usize)> {
    let (tx, mut rx) = unbounded_channel();
    let start = Instant::now();
    core.add_request(0, Request::new(Prompt::Tokens(prompt), 1), tx)?;
    let mut first = None;
    let mut cached = None;
    while core.has_work() {
        core.step();
        while let Ok(ev) = rx.try_recv() {
            match ev {
                RequestEvent::Delta(_) => {
                    first.get_or_insert_with(|| start.elapsed().as_secs_f64());
                }
                RequestEvent::Finished(s) => cached = Some(s.usage.cached_tokens),
                RequestEvent::Error(e) => anyhow::bail!("request failed: {e}"),
                _ => {}
            }
        }
    }
    Ok((first.context("no token")?, cached.context("no summary")?))
}

fn engine(
    dir: &std::path::Path,
    pool_blocks: usize,
    disk: Option<&std::path::Path>,
) -> Result<EngineCore> {
    let ck = tandem_engine::Checkpoint::open(dir)?;
    let config = EngineConfig {
        kv_pool: KvPoolSize::Blocks(pool_blocks),
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(ck.model, None, ck.eos_token_ids, &config)?;
    if let Some(d) = disk {
        let cfg = DiskTierConfig::new(d, 64 << 30, 1, core.disk_block_values());
        core.enable_disk_tier(DiskTier::open(cfg)?)?;
    }
    Ok(core)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let model = tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "bench-100m")?;
    let tmp = tempfile::tempdir()?;
    let disk_dir = args
        .disk_dir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let mut plain = engine(&model.dir, args.pool_blocks, None)?;
    let mut tiered = engine(&model.dir, args.pool_blocks, Some(&disk_dir))?;
    let vocab = plain.model_config().vocab_size as u64;
    let mut rng = 0x5eed_u64;
    let prefixes: Vec<Vec<u32>> = (0..args.prefixes)
        .map(|_| {
            (0..args.prefix_len)
                .map(|_| (xorshift(&mut rng) % vocab) as u32)
                .collect()
        })
        .collect();
    let working_set_blocks = args.prefixes * (args.prefix_len + args.suffix_len).div_ceil(16);
    eprintln!(
        "{} prefixes of {} tokens: {working_set_blocks} blocks, {:.1}x the {}-block pool",
        args.prefixes,
        args.prefix_len,
        working_set_blocks as f64 / args.pool_blocks as f64,
        args.pool_blocks
    );
    let (mut without, mut with) = (Vec::new(), Vec::new());
    // The warm-up round computes on both: the tiered engine also copies
    // every block out for the writer (the write-through's cost).
    let (mut warm_without, mut warm_with) = (Vec::new(), Vec::new());
    let (mut cached_without, mut cached_with, mut prompt_tokens) = (0usize, 0usize, 0usize);
    for round in 0..=args.rounds {
        for (i, prefix) in prefixes.iter().enumerate() {
            let mut prompt = prefix.clone();
            prompt.extend((0..args.suffix_len).map(|_| (xorshift(&mut rng) % vocab) as u32));
            let (a, ca) = ttft(&mut plain, prompt.clone())?;
            let (b, cb) = ttft(&mut tiered, prompt.clone())?;
            tiered.flush_disk_tier();
            if round == 0 {
                warm_without.push(a);
                warm_with.push(b);
                continue;
            }
            eprintln!(
                "round {round} prefix {i}: {a:.3}s without, {b:.3}s with (cached {ca} / {cb})"
            );
            without.push(a);
            with.push(b);
            cached_without += ca;
            cached_with += cb;
            prompt_tokens += prompt.len();
        }
    }
    let disk = tiered.stats().disk.context("disk stats")?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let report = json!({
        "bench": "kv-tier",
        "model": model.dir.display().to_string(),
        "prefixes": args.prefixes,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "pool_blocks": args.pool_blocks,
        "working_set_over_pool": working_set_blocks as f64 / args.pool_blocks as f64,
        "requests_measured": without.len(),
        "ttft_s": {
            "without": {"mean": mean(&without), "p50": median(&without), "p90": percentile(&without, 90.0)},
            "with": {"mean": mean(&with), "p50": median(&with), "p90": percentile(&with, 90.0)},
        },
        "warmup_ttft_s": {
            "without": mean(&warm_without),
            "with_writing_the_tier": mean(&warm_with),
        },
        "ttft_ratio_with_over_without": {
            "mean": mean(&with) / mean(&without),
            "p50": median(&with) / median(&without),
        },
        "hit_rate": {
            "without": cached_without as f64 / prompt_tokens.max(1) as f64,
            "with": cached_with as f64 / prompt_tokens.max(1) as f64,
        },
        "disk": {
            "restored_blocks": disk.restored_blocks,
            "restores": disk.restores,
            "written_blocks": disk.tier.written_blocks,
            "written_bytes": disk.tier.written_bytes,
            "read_bytes": disk.tier.loaded_bytes,
            "mean_load_ms": disk.tier.load_nanos as f64 / 1e6 / disk.tier.loads.max(1) as f64,
            "write_dropped": disk.tier.write_dropped,
            "load_failures": disk.tier.load_failures,
        },
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, text + "\n")?;
    }
    Ok(())
}
