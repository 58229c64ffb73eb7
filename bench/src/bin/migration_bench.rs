//! Migration benchmark: the stall a client sees when its decode worker is
//! drained (SIGTERM) mid-stream, with the request's KV moved to the other
//! decode worker against re-prefilled there.
//!
//! ```text
//! cargo build --release -p tandem -p tandem-bench
//! target/release/migration-bench --tandem target/release/tandem --out migration.json
//! ```
//!
//! Each round starts `tandem up --prefill 0 --decode 2`, streams one greedy
//! request with a `context`-token prompt, and sends SIGTERM to its decode
//! worker after a few tokens. The drained worker hands the request over;
//! the router resumes it on the other worker, naming the drained one as the
//! source of its KV. The survivor pulls the blocks over the KV transport
//! (`kv_moved`: remote-prefill threshold 16), or computes them itself
//! (`reprefilled`: threshold above the context). The stall is the longest
//! gap between two tokens the client received after the signal; the
//! median gap before it is the normal pace. Rounds alternate the two paths
//! so drift on a shared machine hits both alike.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::ROUTED_DECODE_HEADER;

#[derive(Parser, Debug)]
#[command(about = "tandem migration benchmark (JSON output)")]
struct Args {
    /// The tandem binary.
    #[arg(long, default_value = "target/release/tandem")]
    tandem: PathBuf,
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Context lengths (prompt tokens) to measure (bench-100m holds 4096
    /// positions: prompt plus `max_tokens`).
    #[arg(long, value_delimiter = ',', default_value = "1024,4000")]
    contexts: Vec<usize>,
    /// Rounds per context and path.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Tokens received before the signal.
    #[arg(long, default_value_t = 8)]
    before: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 40)]
    max_tokens: u32,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One drained stream, as its client saw it.
struct Round {
    stall_s: f64,
    pace_s: f64,
    tokens: usize,
}

/// Streams `prompt` through `router`, SIGTERMs the decode worker serving
/// it after `before` tokens, and times the gaps.
async fn drained_stream(
    router: &str,
    pids: &std::collections::HashMap<String, u32>,
    prompt: Vec<u32>,
    args: &Args,
) -> Result<Round> {
    let mut c = GenerationClient::connect(format!("http://{router}")).await?;
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt,
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        max_tokens: Some(args.max_tokens),
        ignore_eos: true,
        ..Default::default()
    };
    let resp = c.generate(req).await?;
    let decode = resp
        .metadata()
        .get(ROUTED_DECODE_HEADER)
        .and_then(|v| v.to_str().ok())
        .context("the router names the decode worker")?
        .to_string();
    let pid = *pids.get(&decode).context("the decode worker's pid")?;
    let mut stream = resp.into_inner();
    let (mut arrivals, mut signalled) = (Vec::new(), None);
    while let Some(msg) = stream.message().await? {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            for _ in &d.token_ids {
                arrivals.push(Instant::now());
            }
        }
        if signalled.is_none() && arrivals.len() >= args.before {
            Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()?;
            signalled = Some(arrivals.len());
        }
    }
    let Some(at) = signalled else {
        bail!("the stream ended before {} tokens", args.before);
    };
    let gaps =
        |a: &[Instant]| -> Vec<f64> { a.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect() };
    let mut before = gaps(&arrivals[..at]);
    before.sort_by(f64::total_cmp);
    let after = gaps(&arrivals[at - 1..]);
    Ok(Round {
        stall_s: after.iter().copied().fold(0.0, f64::max),
        pace_s: before.get(before.len() / 2).copied().unwrap_or(0.0),
        tokens: arrivals.len(),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
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
    let mut results = Vec::new();
    for &context in &args.contexts {
        let mut by_path: Vec<(&str, Vec<Round>)> =
            vec![("kv_moved", vec![]), ("reprefilled", vec![])];
        for round in 0..args.rounds {
            for (path, rounds) in &mut by_path {
                let threshold = if *path == "kv_moved" {
                    "16".to_string()
                } else {
                    (context * 4).to_string()
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
                        "--addr",
                        "127.0.0.1:0",
                        "--no-http",
                        "--kv-cache-memory",
                        "1GiB",
                        "--remote-prefill-threshold",
                        &threshold,
                    ],
                );
                // Fresh tokens each round: nothing cached anywhere.
                let prompt: Vec<u32> = (0..context)
                    .map(|t| ((t * 131 + round * 7919 + context) % 7900 + 3) as u32)
                    .collect();
                let r = rt.block_on(drained_stream(&cluster.addr, &cluster.pids, prompt, &args))?;
                eprintln!(
                    "context {context}, {path}, round {round}: stall {:.3}s (pace {:.3}s/token, {} tokens)",
                    r.stall_s, r.pace_s, r.tokens
                );
                rounds.push(r);
                drop(cluster);
                std::thread::sleep(Duration::from_millis(500));
            }
        }
        let stall = |i: usize| median(by_path[i].1.iter().map(|r| r.stall_s).collect());
        let (moved, reprefilled) = (stall(0), stall(1));
        results.push(json!({
            "context": context,
            "kv_moved_stall_s": by_path[0].1.iter().map(|r| r.stall_s).collect::<Vec<_>>(),
            "reprefilled_stall_s": by_path[1].1.iter().map(|r| r.stall_s).collect::<Vec<_>>(),
            "pace_s": median(by_path.iter().flat_map(|p| p.1.iter().map(|r| r.pace_s)).collect()),
            "kv_moved_median_s": moved,
            "reprefilled_median_s": reprefilled,
            "kv_moved_over_reprefilled": moved / reprefilled,
        }));
    }
    let text = serde_json::to_string_pretty(&json!({
        "model": model,
        "before_tokens": args.before,
        "max_tokens": args.max_tokens,
        "contexts": results,
    }))?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    Ok(())
}
