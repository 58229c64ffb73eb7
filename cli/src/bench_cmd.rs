//! `tandem bench serve`: load a running server or router with a workload and
//! report TTFT / TPOT / ITL / E2E percentiles, throughput and goodput.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use tandem_loadgen::{Arrival, LengthDist, SharedPrefix, Slo, Summary, WorkloadSpec};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Load a running router (or `tandem serve`) and measure it.
    Serve(ServeBenchArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The gRPC address of the router or server.
    #[arg(long, default_value = "127.0.0.1:50051")]
    router: String,
    /// The served checkpoint, for its vocabulary size (default: the
    /// built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Token ids of synthetic prompts are drawn below this (default: the
    /// model's vocabulary size).
    #[arg(long)]
    vocab_size: Option<u32>,
    /// Prompt length: fixed:N, uniform:LO-HI or lognormal:MEAN,SIGMA.
    #[arg(long, default_value = "fixed:256")]
    input_len: LengthDist,
    /// Output length (requests ignore EOS and generate exactly this).
    #[arg(long, default_value = "fixed:64")]
    output_len: LengthDist,
    /// Shared prefix tokens before each prompt (0: none).
    #[arg(long, default_value_t = 0)]
    prefix_len: u32,
    /// Distinct shared prefixes.
    #[arg(long, default_value_t = 1)]
    prefix_groups: u32,
    /// Prompts from a JSONL file (`prompt` or `prompt_ids`, optional
    /// `max_tokens`) instead of synthetic ones.
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// Requests to send.
    #[arg(long, default_value_t = 100)]
    num_requests: usize,
    /// Stop sending after this many seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Open loop: mean requests per second (default: all at once).
    #[arg(long, conflicts_with = "concurrency")]
    request_rate: Option<f64>,
    /// Gamma shape of the inter-arrival times: 1 is Poisson, below 1
    /// burstier.
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Closed loop: keep this many requests in flight.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Sampling temperature (default: the server's).
    #[arg(long)]
    temperature: Option<f32>,
    /// TTFT objective for goodput (ms).
    #[arg(long)]
    slo_ttft_ms: Option<f64>,
    /// TPOT objective for goodput (ms).
    #[arg(long)]
    slo_tpot_ms: Option<f64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Cancel and fail a request that runs longer (s).
    #[arg(long, default_value_t = 600.0)]
    request_timeout_s: f64,
    /// Write the config, summary and per-request records here as JSON.
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress line.
    #[arg(long)]
    no_progress: bool,
}

pub fn run(args: BenchArgs) -> Result<()> {
    match args.command {
        BenchCommand::Serve(a) => serve(&a),
    }
}

fn vocab_size(args: &ServeBenchArgs) -> Result<u32> {
    if let Some(v) = args.vocab_size {
        return Ok(v);
    }
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    let path = dir.join("config.json");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))?;
    config["vocab_size"]
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .with_context(|| format!("{} has no vocab_size", path.display()))
}

fn serve(args: &ServeBenchArgs) -> Result<()> {
    if args.num_requests == 0 {
        bail!("--num-requests must be at least 1");
    }
    let arrival = match (args.concurrency, args.request_rate) {
        (Some(0), _) => bail!("--concurrency must be at least 1"),
        (Some(n), _) => Arrival::Concurrency(n),
        (None, Some(r)) if r.is_nan() || r <= 0.0 => bail!("--request-rate must be positive"),
        (None, r) => {
            if args.burstiness.is_nan() || args.burstiness <= 0.0 {
                bail!("--burstiness must be positive");
            }
            Arrival::Rate {
                rate: r.unwrap_or(f64::INFINITY),
                burstiness: args.burstiness,
            }
        }
    };
    let items = match &args.dataset {
        Some(path) => tandem_loadgen::workload::from_jsonl(
            path,
            args.num_requests,
            args.output_len
                .sample(&mut tandem_loadgen::rng::Rng::new(args.seed)),
        )?,
        None => WorkloadSpec {
            input: args.input_len,
            output: args.output_len,
            shared_prefix: (args.prefix_len > 0).then_some(SharedPrefix {
                len: args.prefix_len,
                groups: args.prefix_groups,
            }),
            vocab_size: vocab_size(args)?,
            seed: args.seed,
        }
        .generate(args.num_requests)?,
    };
    let slo = Slo {
        ttft_s: args.slo_ttft_ms.map(|ms| ms / 1e3),
        tpot_s: args.slo_tpot_ms.map(|ms| ms / 1e3),
    };
    let opts = tandem_loadgen::RunOptions {
        arrival,
        max_duration: args.duration_s.map(Duration::from_secs_f64),
        request_timeout: Duration::from_secs_f64(args.request_timeout_s),
        temperature: args.temperature,
        seed: args.seed,
        progress: !args.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    let rt = crate::engine_args::runtime()?;
    let records = rt.block_on(async {
        let channel = tandem_loadgen::connect(&args.router).await?;
        Ok::<_, anyhow::Error>(tandem_loadgen::run(channel, items, &opts).await)
    })?;
    let summary = tandem_loadgen::summarize(&records, slo);
    print_summary(&summary);
    if let Some(first) = records.iter().find_map(|r| r.error.as_deref()) {
        eprintln!("first error: {first}");
    }
    if let Some(path) = &args.out {
        let report = json!({
            "config": {
                "router": args.router,
                "input_len": format!("{:?}", args.input_len),
                "output_len": format!("{:?}", args.output_len),
                "prefix_len": args.prefix_len,
                "prefix_groups": args.prefix_groups,
                "dataset": args.dataset,
                "num_requests": args.num_requests,
                "arrival": format!("{arrival:?}"),
                "seed": args.seed,
            },
            "summary": summary,
            "requests": records,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn print_summary(s: &Summary) {
    println!(
        "requests: {} completed, {} failed in {:.2} s",
        s.completed, s.failed, s.duration_s
    );
    println!(
        "throughput: {:.2} req/s, {:.1} output tok/s, {:.1} input tok/s",
        s.request_throughput, s.output_token_throughput, s.input_token_throughput
    );
    println!(
        "{:<6} {:>10} {:>10} {:>10} {:>10}",
        "ms", "mean", "p50", "p90", "p99"
    );
    for (name, st) in [
        ("TTFT", s.ttft),
        ("TPOT", s.tpot),
        ("ITL", s.itl),
        ("E2E", s.e2e),
    ] {
        println!(
            "{name:<6} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            st.mean * 1e3,
            st.p50 * 1e3,
            st.p90 * 1e3,
            st.p99 * 1e3
        );
    }
    if s.slo.ttft_s.is_some() || s.slo.tpot_s.is_some() {
        println!(
            "SLO attainment {:.1}%, goodput {:.2} req/s",
            s.slo_attainment * 100.0,
            s.goodput
        );
    }
}
