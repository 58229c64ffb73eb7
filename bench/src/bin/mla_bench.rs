//! Latent KV against per-head KV across the prefill → decode seam: a
//! DeepSeek-V3-shaped model (`bench-mla`, multi-head latent attention)
//! beside the GQA model of the same hidden size, layers and heads
//! (`bench-100m`), each behind `tandem up --prefill 1 --decode 1`.
//!
//! ```text
//! cargo build --release -p tandem -p tandem-bench
//! target/release/mla-bench --tandem target/release/tandem --out bench/results/mla-bench.json
//! ```
//!
//! For each model: the KV bytes the decode worker received per prompt of
//! `--prompt-len` tokens prefilled remotely (its
//! `tandem_kv_transfer_received_bytes_total`, warm-up excluded), and the
//! engine-measured TTFT of the same fresh prompts prefilled remotely and on
//! the decode worker itself. Both models run one after the other on the
//! same machine; compare ratios.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use serde_json::json;
use tandem_tests::cluster::Started;
use tandem_tests::prometheus::scrape;

#[derive(Parser, Debug)]
#[command(about = "latent (MLA) vs per-head KV: bytes moved and remote/local TTFT")]
struct Args {
    /// The tandem binary.
    #[arg(long, default_value = "target/release/tandem")]
    tandem: PathBuf,
    #[arg(long, default_value_t = 1024)]
    prompt_len: usize,
    /// Prompts per measurement.
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

fn received_bytes(cluster: &Started) -> f64 {
    cluster
        .metrics_addr("decode-worker", &cluster.decode[0])
        .map_or(0.0, |m| {
            scrape(m).sum("tandem_kv_transfer_received_bytes_total", &[])
        })
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// TTFTs of `prompts` and the KV bytes received for them.
fn measure(
    args: &Args,
    model: &str,
    threshold: &str,
    prompts: &[Vec<u32>],
    rt: &tokio::runtime::Runtime,
) -> Result<(Vec<f64>, f64)> {
    let cluster = tandem_tests::cluster::start(
        &args.tandem,
        &[
            "up",
            "--model",
            model,
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--no-etcd",
            "--kv-cache-memory",
            "1GiB",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--remote-prefill-threshold",
            threshold,
        ],
    );
    rt.block_on(async {
        // A warm-up request (page cache, connections), not counted.
        tandem_bench::engine_ttft(&cluster.addr, (1..65).collect()).await?;
        let before = received_bytes(&cluster);
        let mut t = Vec::new();
        for p in prompts {
            t.push(tandem_bench::engine_ttft(&cluster.addr, p.clone()).await?);
        }
        let bytes = (received_bytes(&cluster) - before) / prompts.len().max(1) as f64;
        Ok((t, bytes))
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let prompts: Vec<Vec<u32>> = (0..args.prompts)
        .map(|_| {
            (0..args.prompt_len)
                .map(|_| (tandem_bench::xorshift(&mut seed) % 8000) as u32)
                .collect()
        })
        .collect();
    let mut rows = Vec::new();
    for preset in ["bench-100m", "bench-mla"] {
        let model = tandem_bench::BenchModel::given_or_generated(None, preset)?;
        let dir = model.dir.display().to_string();
        let cfg = tandem_engine::ModelConfig::from_dir(&model.dir)?;
        let (remote, moved) = measure(&args, &dir, "256", &prompts, &rt)?;
        let (local, _) = measure(&args, &dir, "1000000", &prompts, &rt)?;
        let (r, l) = (mean(&remote), mean(&local));
        eprintln!(
            "{preset}: {:.0} KiB moved per prompt, TTFT remote {r:.3}s local {l:.3}s ({:.2}x)",
            moved / 1024.0,
            r / l
        );
        rows.push(json!({
            "preset": preset,
            "architecture": cfg.architecture.hf_name(),
            "kv_bytes_per_token_f32": cfg.kv_bytes_per_token(),
            "kv_bytes_moved_per_prompt": moved,
            "remote_ttft_s": remote, "local_ttft_s": local,
            "remote_mean_s": r, "local_mean_s": l, "remote_over_local": r / l,
        }));
    }
    let moved = |i: usize| rows[i]["kv_bytes_moved_per_prompt"].as_f64().unwrap_or(0.0);
    let report = json!({
        "prompt_len": args.prompt_len,
        "prompts": args.prompts,
        "models": rows,
        "mla_bytes_over_gqa": moved(1) / moved(0).max(1.0),
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    Ok(())
}
