//! `tandem bench serve`: load a running server or router with a workload and
//! report TTFT / TPOT / ITL / E2E percentiles, throughput and goodput.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use tandem_loadgen::{Arrival, LengthDist, SharedPrefix, Slo, WorkloadSpec};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Load a running router (or `tandem serve`) and measure it.
    Serve(ServeBenchArgs),
    /// Offer a workload at rising request rates to one or more running
    /// configurations and find each one's goodput; JSON and PNG plots.
    Sweep(SweepArgs),
}

/// What to send and how to judge it, shared by `serve` and `sweep`.
#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
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
    /// Requests to send (per rate, in a sweep).
    #[arg(long, default_value_t = 100)]
    num_requests: usize,
    /// Stop sending after this many seconds (per rate, in a sweep).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Gamma shape of the inter-arrival times: 1 is Poisson, below 1
    /// burstier.
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
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
}

#[derive(Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The gRPC address of the router or server.
    #[arg(long, default_value = "127.0.0.1:50051")]
    router: String,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Open loop: mean requests per second (default: all at once).
    #[arg(long, conflicts_with = "concurrency")]
    request_rate: Option<f64>,
    /// Closed loop: keep this many requests in flight.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Write the config, summary and per-request records here as JSON.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the TTFT, TPOT, ITL and E2E latency CDFs as PNGs into this
    /// directory.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    /// A configuration to sweep, `NAME=HOST:PORT` (repeat to compare).
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// Request rates to offer (req/s), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    rates: Vec<f64>,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Where `sweep.json` and the PNG plots go.
    #[arg(long, default_value = "sweep")]
    out_dir: PathBuf,
}

pub fn run(args: BenchArgs) -> Result<()> {
    match args.command {
        BenchCommand::Serve(a) => serve(&a),
        BenchCommand::Sweep(a) => sweep(&a),
    }
}

fn vocab_size(args: &WorkloadArgs) -> Result<u32> {
    if let Some(v) = args.vocab_size {
        return Ok(v);
    }
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    // A checkpoint directory's config.json, or a GGUF file's metadata.
    let config = tandem_engine::ModelConfig::from_dir(&dir)
        .with_context(|| format!("reading the config of {}", dir.display()))?;
    u32::try_from(config.vocab_size)
        .with_context(|| format!("{}: vocab_size {}", dir.display(), config.vocab_size))
}

impl WorkloadArgs {
    fn items(&self) -> Result<Vec<tandem_loadgen::WorkItem>> {
        self.items_seeded(self.seed)
    }

    /// The workload with synthetic prompts drawn from `seed` (a dataset's
    /// prompts are the same whatever the seed).
    fn items_seeded(&self, seed: u64) -> Result<Vec<tandem_loadgen::WorkItem>> {
        if self.num_requests == 0 {
            bail!("--num-requests must be at least 1");
        }
        Ok(match &self.dataset {
            Some(path) => tandem_loadgen::workload::from_jsonl(
                path,
                self.num_requests,
                self.output_len
                    .sample(&mut tandem_loadgen::rng::Rng::new(self.seed)),
            )?,
            None => WorkloadSpec {
                input: self.input_len,
                output: self.output_len,
                shared_prefix: (self.prefix_len > 0).then_some(SharedPrefix {
                    len: self.prefix_len,
                    groups: self.prefix_groups,
                }),
                vocab_size: vocab_size(self)?,
                seed,
            }
            .generate(self.num_requests)?,
        })
    }

    fn slo(&self) -> Slo {
        Slo {
            ttft_s: self.slo_ttft_ms.map(|ms| ms / 1e3),
            tpot_s: self.slo_tpot_ms.map(|ms| ms / 1e3),
        }
    }

    fn options(&self, arrival: Arrival) -> Result<tandem_loadgen::RunOptions> {
        if self.burstiness.is_nan() || self.burstiness <= 0.0 {
            bail!("--burstiness must be positive");
        }
        Ok(tandem_loadgen::RunOptions {
            arrival,
            max_duration: self.duration_s.map(Duration::from_secs_f64),
            request_timeout: Duration::from_secs_f64(self.request_timeout_s),
            temperature: self.temperature,
            seed: self.seed,
            observer: crate::bench_report::LiveBench::new(self.slo())
                .map(|b| std::sync::Arc::new(b) as std::sync::Arc<dyn tandem_loadgen::RunObserver>),
        })
    }

    fn config_json(&self) -> serde_json::Value {
        json!({
            "input_len": format!("{:?}", self.input_len),
            "output_len": format!("{:?}", self.output_len),
            "prefix_len": self.prefix_len,
            "prefix_groups": self.prefix_groups,
            "dataset": self.dataset,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "burstiness": self.burstiness,
            "seed": self.seed,
        })
    }
}

fn serve(args: &ServeBenchArgs) -> Result<()> {
    let w = &args.workload;
    let arrival = match (args.concurrency, args.request_rate) {
        (Some(0), _) => bail!("--concurrency must be at least 1"),
        (Some(n), _) => Arrival::Concurrency(n),
        (None, Some(r)) if r.is_nan() || r <= 0.0 => bail!("--request-rate must be positive"),
        (None, r) => Arrival::Rate {
            rate: r.unwrap_or(f64::INFINITY),
            burstiness: w.burstiness,
        },
    };
    let items = w.items()?;
    let opts = w.options(arrival)?;
    let rt = crate::engine_args::runtime()?;
    let records = rt.block_on(async {
        let channel = tandem_loadgen::connect(&args.router).await?;
        Ok::<_, anyhow::Error>(tandem_loadgen::run(channel, items, &opts).await)
    })?;
    // The bar goes before the table is printed.
    drop(opts);
    let summary = tandem_loadgen::summarize(&records, w.slo());
    let ok = records.iter().filter(|r| r.ok());
    let input: u64 = ok.clone().map(|r| u64::from(r.input_tokens)).sum();
    let output: u64 = ok.map(|r| u64::from(r.output_tokens)).sum();
    crate::bench_report::print_summary(&summary, input, output);
    if let Some(first) = records.iter().find_map(|r| r.error.as_deref()) {
        eprintln!("first error: {first}");
    }
    if let Some(path) = &args.out {
        let mut config = w.config_json();
        config["router"] = json!(args.router);
        config["arrival"] = json!(format!("{arrival:?}"));
        let report = json!({
            "config": config,
            "summary": summary,
            "requests": records,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if let Some(dir) = &args.plot {
        let files = crate::bench_report::plot_cdfs(dir, &records)?;
        println!("wrote {}", files.join(", "));
    }
    Ok(())
}

fn sweep(args: &SweepArgs) -> Result<()> {
    let w = &args.workload;
    if args.rates.iter().any(|r| r.is_nan() || *r <= 0.0) {
        bail!("--rates must be positive");
    }
    let targets: Vec<(String, String)> = args
        .targets
        .iter()
        .map(|t| {
            t.split_once('=')
                .map(|(n, a)| (n.to_string(), a.to_string()))
                .with_context(|| format!("--target {t:?}: want NAME=HOST:PORT"))
        })
        .collect::<Result<_>>()?;
    // Fresh prompts for every rate (and the warm-up), so no rate rides on
    // the prefix cache an earlier one filled.
    let workloads = (0..=args.rates.len())
        .map(|i| w.items_seeded(w.seed.wrapping_add(i as u64)))
        .collect::<Result<Vec<_>>>()?;
    let workload = |i: usize| workloads[i.min(args.rates.len())].clone();
    let opts = w.options(Arrival::poisson(1.0))?;
    let rt = crate::engine_args::runtime()?;
    let mut sweeps = Vec::new();
    for (name, addr) in &targets {
        let s = rt.block_on(async {
            let channel = tandem_loadgen::connect(addr).await?;
            Ok::<_, anyhow::Error>(
                tandem_loadgen::sweep::sweep(name, channel, workload, &args.rates, &opts, w.slo())
                    .await,
            )
        })?;
        crate::progress::suspend(|| print_sweep(name, &s));
        sweeps.push(s);
    }
    drop(opts);
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    let path = args.out_dir.join("sweep.json");
    let mut config = w.config_json();
    config["rates"] = json!(args.rates);
    config["slo"] = json!(w.slo());
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&json!({"config": config, "sweeps": sweeps}))?,
    )
    .with_context(|| format!("writing {}", path.display()))?;
    tandem_loadgen::sweep::plot_sweeps(&args.out_dir, &sweeps)?;
    println!(
        "wrote {} and attainment.png, ttft_cdf.png, tpot_cdf.png",
        path.display()
    );
    Ok(())
}

/// One configuration's sweep, a line per rate and its goodput.
fn print_sweep(name: &str, s: &tandem_loadgen::sweep::Sweep) {
    for p in &s.points {
        println!(
            "{name} @ {:.2} req/s: attainment {:.1}%, TTFT p99 {:.1} ms, TPOT p99 {:.2} ms, {} failed",
            p.rate,
            p.summary.slo_attainment * 100.0,
            p.summary.ttft.p99 * 1e3,
            p.summary.tpot.p99 * 1e3,
            p.summary.failed
        );
    }
    match s.goodput {
        Some(g) => println!("{name}: goodput {g:.2} req/s"),
        None => println!("{name}: no rate met the SLOs"),
    }
}
