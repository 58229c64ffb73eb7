//! Peer fetch against recompute: the time to first token of a request
//! whose prefix another decode worker holds, when the chosen worker pulls
//! those blocks from it (the router names the holder as its prefill
//! worker) and when it computes them itself.
//!
//! ```text
//! cargo build --release -p tandem -p tandem-bench
//! target/release/peer-fetch-bench --tandem target/release/tandem --out peer-fetch.json
//! ```
//!
//! Each round starts `tandem up --prefill 0 --decode 2 --decode-policy
//! round-robin` twice: with the default remote-prefill threshold (peer
//! fetch on) and with one above the context (the router never fetches).
//! In each, a fresh `--context`-token prefix is asked with one tail (the
//! first worker computes it, cold) and then with another (round-robin
//! sends it to the second worker, which lacks it). Rounds alternate the
//! two clusters, so drift on a shared machine hits both.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::{ROUTED_DECODE_HEADER, ROUTED_PREFILL_HEADER};

#[derive(Parser, Debug)]
#[command(about = "tandem peer-fetch benchmark (JSON output)")]
struct Args {
    /// The tandem binary.
    #[arg(long, default_value = "target/release/tandem")]
    tandem: PathBuf,
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prefix tokens.
    #[arg(long, default_value_t = 2048)]
    context: usize,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One request's time to first token and where it ran.
struct Timed {
    ttft_s: f64,
    decode: String,
    prefill: Option<String>,
}

async fn timed(router: &str, prompt: Vec<u32>) -> Result<Timed> {
    let mut c = GenerationClient::connect(format!("http://{router}")).await?;
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt,
        })),
        max_tokens: Some(4),
        ignore_eos: true,
        ..Default::default()
    };
    let started = Instant::now();
    let resp = c.generate(req).await?;
    let header = |k: &str| {
        resp.metadata()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let decode = header(ROUTED_DECODE_HEADER).context("the routing header")?;
    let prefill = header(ROUTED_PREFILL_HEADER);
    let mut stream = resp.into_inner();
    let mut first = None;
    while let Some(msg) = stream.message().await? {
        if let Some(v1::generate_response::Event::Delta(_)) = msg.event {
            first.get_or_insert_with(|| started.elapsed().as_secs_f64());
        }
    }
    Ok(Timed {
        ttft_s: first.context("no token")?,
        decode,
        prefill,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
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
    let (mut fetched, mut recomputed, mut cold) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds {
        for fetch in [true, false] {
            let threshold = if fetch {
                "256".to_string()
            } else {
                (args.context * 4).to_string()
            };
            let cluster = tandem_tests::cluster::start(
                &args.tandem,
                &[
                    "up",
                    "--model",
                    &model,
                    "--prefill",
                    "0",
                    "--decode",
                    "2",
                    "--decode-policy",
                    "round-robin",
                    "--addr",
                    "127.0.0.1:0",
                    "--no-http",
                    "--kv-cache-memory",
                    "1GiB",
                    "--remote-prefill-threshold",
                    &threshold,
                ],
            );
            let prefix: Vec<u32> = (0..args.context)
                .map(|t| ((t * 131 + round * 7919 + usize::from(fetch) * 31) % 7900 + 3) as u32)
                .collect();
            let with = |tail: u32| {
                let mut p = prefix.clone();
                p.extend([tail, tail + 1, tail + 2]);
                p
            };
            let first = rt.block_on(timed(&cluster.addr, with(1)))?;
            // The router learns of the prefix from the holder's KV events.
            std::thread::sleep(Duration::from_millis(500));
            let second = rt.block_on(timed(&cluster.addr, with(7)))?;
            anyhow::ensure!(second.decode != first.decode, "round-robin alternates");
            anyhow::ensure!(
                (second.prefill.as_deref() == Some(first.decode.as_str())) == fetch,
                "peer fetch {} expected, prefill worker {:?}",
                if fetch { "" } else { "not" },
                second.prefill
            );
            eprintln!(
                "round {round}, {}: cold {:.3}s, second worker {:.3}s",
                if fetch { "fetched" } else { "recomputed" },
                first.ttft_s,
                second.ttft_s
            );
            cold.push(first.ttft_s);
            if fetch {
                fetched.push(second.ttft_s);
            } else {
                recomputed.push(second.ttft_s);
            }
            drop(cluster);
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    let text = serde_json::to_string_pretty(&json!({
        "model": model,
        "context": args.context,
        "cold_ttft_s": cold,
        "fetched_ttft_s": fetched,
        "recomputed_ttft_s": recomputed,
        "fetched_median_s": median(fetched.clone()),
        "recomputed_median_s": median(recomputed.clone()),
        "fetched_over_recomputed": median(fetched) / median(recomputed),
    }))?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    Ok(())
}
