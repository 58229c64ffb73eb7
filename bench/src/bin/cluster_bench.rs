//! Cluster benchmark: local `tandem up` clusters of real processes.
//!
//! ```text
//! cargo build --release -p tandem -p tandem-bench
//! target/release/cluster-bench --tandem target/release/tandem --out cluster.json
//! ```
//!
//! * **Overlap.** On an idle cluster (1 prefill + 1 decode worker), the
//!   engine-measured TTFT of 1k-token prompts prefilled remotely (pushed
//!   layer by layer) against the same prompts prefilled on the decode worker
//!   itself (threshold above the prompt length). Target: remote ≤ 1.2x local.
//! * **Prefix affinity.** Over 4 decode workers, a workload of requests that
//!   share a few long prefixes, routed with `kv` and with `round-robin`;
//!   mean TTFT of each. Target: kv ≤ 1/3 of round-robin. Peer fetch is
//!   off for both (`--no-peer-fetch`) unless `--peer-fetch` is given: with
//!   it, a round-robin pick that lacks a prefix pulls it from the worker
//!   the index names, so the baseline would ride on the index too.
//!
//! Each measurement starts its own cluster; ratios compare runs made one
//! after the other on the same machine.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "tandem cluster benchmark (JSON output)")]
struct Args {
    /// The tandem binary.
    #[arg(long, default_value = "target/release/tandem")]
    tandem: PathBuf,
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt length for the overlap test.
    #[arg(long, default_value_t = 1024)]
    prompt_len: usize,
    /// Prompts per overlap measurement.
    #[arg(long, default_value_t = 4)]
    overlap_prompts: usize,
    /// Shared prefixes (not a multiple of the 4 workers, so round-robin does
    /// not land on affinity by accident), prefix length, and requests per
    /// prefix (affinity test).
    #[arg(long, default_value_t = 5)]
    prefixes: usize,
    #[arg(long, default_value_t = 512)]
    prefix_len: usize,
    #[arg(long, default_value_t = 4)]
    per_prefix: usize,
    /// Leave peer fetch on for the prefix-affinity runs.
    #[arg(long)]
    peer_fetch: bool,
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write TTFT CDF charts (`affinity_ttft_cdf.png`,
    /// `overlap_ttft_cdf.png`) here.
    #[arg(long)]
    plot_dir: Option<PathBuf>,
}

fn up(args: &Args, model: &str, extra: &[&str]) -> Result<tandem_bench::TandemUp> {
    let a: Vec<String> = [
        "--model",
        model,
        "--addr",
        "127.0.0.1:0",
        "--no-http",
        "--kv-cache-memory",
        "1GiB",
    ]
    .iter()
    .chain(extra)
    .map(|s| (*s).to_string())
    .collect();
    tandem_bench::TandemUp::start(&args.tandem, &a, Stdio::null())
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, m: u64) -> u32 {
        (tandem_bench::xorshift(&mut self.0) % m) as u32
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bench_model =
        tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "bench-100m")?;
    let model = bench_model.dir.display().to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let vocab = 8000;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);

    // Overlap: remote against local prefill, same prompts (fresh each, so
    // nothing is cached).
    let prompts: Vec<Vec<u32>> = (0..args.overlap_prompts)
        .map(|_| (0..args.prompt_len).map(|_| rng.next(vocab)).collect())
        .collect();
    let mut results = Vec::new();
    for (mode, threshold) in [("remote", "256"), ("local", "1000000")] {
        let cluster = up(
            &args,
            &model,
            &[
                "--prefill",
                "1",
                "--decode",
                "1",
                "--remote-prefill-threshold",
                threshold,
            ],
        )?;
        let t: Vec<f64> = rt.block_on(async {
            // One warm-up request (page cache, connections), not counted.
            let warm: Vec<u32> = (0..64).map(|i| i + 1).collect();
            tandem_bench::engine_ttft(&cluster.addr, warm).await?;
            let mut t = Vec::new();
            for p in &prompts {
                t.push(tandem_bench::engine_ttft(&cluster.addr, p.clone()).await?);
            }
            Ok::<_, anyhow::Error>(t)
        })?;
        eprintln!("{mode} prefill: mean TTFT {:.3}s over {t:?}", mean(&t));
        results.push((mode, t));
        std::thread::sleep(Duration::from_millis(500));
    }
    let (remote, local) = (mean(&results[0].1), mean(&results[1].1));

    // Prefix affinity over 4 decode workers.
    let prefixes: Vec<Vec<u32>> = (0..args.prefixes)
        .map(|_| (0..args.prefix_len).map(|_| rng.next(vocab)).collect())
        .collect();
    let mut work = Vec::new();
    for round in 0..args.per_prefix {
        for p in &prefixes {
            let mut v = p.clone();
            v.extend((0..32).map(|_| rng.next(vocab)));
            work.push((round, v));
        }
    }
    let mut affinity = Vec::new();
    for policy in ["kv", "round-robin"] {
        let mut flags = vec!["--prefill", "0", "--decode", "4", "--decode-policy", policy];
        if !args.peer_fetch {
            flags.push("--router-arg=--no-peer-fetch");
        }
        let cluster = up(&args, &model, &flags)?;
        let t: Vec<f64> = rt.block_on(async {
            let mut t = Vec::new();
            for (_, p) in &work {
                t.push(tandem_bench::engine_ttft(&cluster.addr, p.clone()).await?);
                // Let the KV events reach the router between requests.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok::<_, anyhow::Error>(t)
        })?;
        eprintln!("{policy}: mean TTFT {:.3}s", mean(&t));
        affinity.push((policy, t));
    }
    let (kv, rr) = (mean(&affinity[0].1), mean(&affinity[1].1));
    let report = json!({
        "model": model,
        "overlap": {
            "prompt_len": args.prompt_len,
            "remote_ttft_s": results[0].1, "local_ttft_s": results[1].1,
            "remote_mean_s": remote, "local_mean_s": local,
            "remote_over_local": remote / local, "target_max": 1.2,
        },
        "affinity": {
            "decode_workers": 4, "prefixes": args.prefixes, "prefix_len": args.prefix_len,
            "requests": work.len(), "peer_fetch": args.peer_fetch,
            "kv_ttft_s": affinity[0].1, "round_robin_ttft_s": affinity[1].1,
            "kv_mean_s": kv, "round_robin_mean_s": rr,
            "kv_over_round_robin": kv / rr, "target_max": 1.0 / 3.0,
        },
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    if let Some(dir) = &args.plot_dir {
        use tandem_loadgen::plot::{cdf, line_chart, Chart, Series};
        std::fs::create_dir_all(dir)?;
        let ms = |v: &[f64]| cdf(&v.iter().map(|x| x * 1e3).collect::<Vec<_>>());
        line_chart(
            &dir.join("affinity_ttft_cdf.png"),
            &Chart {
                title: format!(
                    "TTFT over 4 decode workers, {} shared {}-token prefixes",
                    args.prefixes, args.prefix_len
                ),
                x_label: "TTFT (ms)".into(),
                y_label: "fraction of requests".into(),
                x_log: false,
                series: affinity
                    .iter()
                    .map(|(p, t)| Series::new(*p, ms(t)))
                    .collect(),
            },
        )?;
        line_chart(
            &dir.join("overlap_ttft_cdf.png"),
            &Chart {
                title: format!(
                    "TTFT of {}-token prompts: remote vs local prefill",
                    args.prompt_len
                ),
                x_label: "TTFT (ms)".into(),
                y_label: "fraction of requests".into(),
                x_log: false,
                series: results
                    .iter()
                    .map(|(m, t)| Series::new(*m, ms(t)))
                    .collect(),
            },
        )?;
        eprintln!("wrote plots to {}", dir.display());
    }
    Ok(())
}
