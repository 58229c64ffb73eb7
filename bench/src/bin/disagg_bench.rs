//! Disaggregation experiment: colocated serving on 2 cores against one
//! prefill worker (core 0) plus one decode worker (core 1), on a
//! long-prompt workload.
//!
//! ```text
//! cargo build --release -p tandem -p tandem-bench
//! target/release/disagg-bench --tandem target/release/tandem --out-dir bench/results/disagg
//! ```
//!
//! * **Goodput.** Each configuration is swept over request rates (Poisson)
//!   with prompts of 1024–1792 tokens and outputs of 64–256; goodput is the
//!   highest rate at which 90% of requests meet both SLOs. The SLOs are
//!   multiples of the unloaded colocated TTFT and TPOT (`--slo-*-scale`),
//!   unless given in ms. Target: disaggregated ≥ 1.5x colocated.
//! * **Interference.** At one rate, TPOT p99 of fresh long prompts (each
//!   request prefills while others decode) against the same prompts sent
//!   again (all in the prefix cache: decode only, over the same context
//!   lengths) on the same configuration. Target: ≤ 1.2x with
//!   disaggregation.
//!
//! Processes are pinned with `taskset`; the load generator runs in this
//! process on both cores. Writes `disagg.json` and the sweep plots.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_loadgen::sweep::{sweep, Sweep};
use tandem_loadgen::{Arrival, LengthDist, RunOptions, Slo, WorkloadSpec};

#[derive(Parser, Debug)]
#[command(about = "colocated vs disaggregated goodput and decode interference")]
struct Args {
    /// The tandem binary.
    #[arg(long, default_value = "target/release/tandem")]
    tandem: PathBuf,
    /// Checkpoint directory (default: generate the `small` preset).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "uniform:1024-1792")]
    input_len: LengthDist,
    #[arg(long, default_value = "uniform:64-256")]
    output_len: LengthDist,
    /// Request rates of the sweeps (req/s).
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75,1")]
    rates: Vec<f64>,
    /// Requests per rate.
    #[arg(long, default_value_t = 16)]
    num_requests: usize,
    /// TTFT SLO as a multiple of the unloaded colocated TTFT p50.
    #[arg(long, default_value_t = 4.0)]
    slo_ttft_scale: f64,
    /// TPOT SLO as a multiple of the unloaded colocated TPOT p50.
    #[arg(long, default_value_t = 2.0)]
    slo_tpot_scale: f64,
    #[arg(long)]
    slo_ttft_ms: Option<f64>,
    #[arg(long)]
    slo_tpot_ms: Option<f64>,
    /// Rate of the interference comparison (default: the second rate).
    #[arg(long)]
    interference_rate: Option<f64>,
    #[arg(long, default_value = "disagg-results")]
    out_dir: PathBuf,
    /// Which configurations to run.
    #[arg(long, value_delimiter = ',', default_value = "colocated,disaggregated")]
    configs: Vec<ConfigKind>,
    /// Skip the goodput sweeps: only the unloaded run and the interference
    /// comparison (minutes instead of tens of minutes on a real model).
    #[arg(long)]
    interference_only: bool,
    /// An extra flag for every serving process (not the router), e.g.
    /// `--serve-arg=--max-step-ms=off`; repeatable.
    #[arg(long, allow_hyphen_values = true)]
    serve_arg: Vec<String>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum ConfigKind {
    Colocated,
    Disaggregated,
}

/// A child process, killed at the end.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `taskset -c CPUS tandem ARGS` and reads its `listening on` line.
fn start(tandem: &Path, cpus: &str, args: &[&str]) -> Result<(Proc, String)> {
    let mut child = Command::new("taskset")
        .args(["-c", cpus])
        .arg(tandem)
        .args(args)
        // The workers' shared secret: from the environment, never argv.
        .env("TANDEM_CLUSTER_TOKEN", "disagg-bench")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {} {}", tandem.display(), args.join(" ")))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let proc = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        if let Some(a) = line?.strip_prefix("listening on ") {
            let addr = a.to_string();
            std::thread::spawn(move || for _ in lines {});
            return Ok((proc, addr));
        }
    }
    bail!("tandem {} exited before listening", args[0])
}

struct Config {
    name: &'static str,
    _procs: Vec<Proc>,
    addr: String,
}

/// A serving process's arguments: the role's, the common ones, the extras.
fn serve_args<'a>(role: &[&'a str], model: &'a str, extra: &'a [String]) -> Vec<&'a str> {
    let mut a = role.to_vec();
    a.extend([
        "--model",
        model,
        "--addr",
        "127.0.0.1:0",
        "--kv-cache-memory",
        "1GiB",
    ]);
    a.extend(extra.iter().map(String::as_str));
    a
}

fn colocated(tandem: &Path, model: &str, extra: &[String]) -> Result<Config> {
    let (p, addr) = start(tandem, "0,1", &serve_args(&["serve"], model, extra))?;
    Ok(Config {
        name: "colocated (2 cores)",
        _procs: vec![p],
        addr,
    })
}

fn disaggregated(tandem: &Path, model: &str, extra: &[String]) -> Result<Config> {
    let (prefill, paddr) = start(tandem, "0", &serve_args(&["prefill-worker"], model, extra))?;
    let decode_role = ["decode-worker", "--remote-prefill-threshold", "256"];
    let (decode, daddr) = start(tandem, "1", &serve_args(&decode_role, model, extra))?;
    let (router, addr) = start(
        tandem,
        "0,1",
        &[
            "router",
            "--model",
            model,
            "--addr",
            "127.0.0.1:0",
            "--decode",
            &daddr,
            "--prefill",
            &paddr,
            "--remote-prefill-threshold",
            "256",
        ],
    )?;
    Ok(Config {
        name: "disaggregated (1P core 0 + 1D core 1)",
        _procs: vec![prefill, decode, router],
        addr,
    })
}

/// The checkpoint's vocabulary size (prompts are drawn below it).
fn vocab_size(model: &Path) -> Result<u32> {
    let text = std::fs::read_to_string(model.join("config.json"))
        .with_context(|| format!("reading {}/config.json", model.display()))?;
    let config: serde_json::Value = serde_json::from_str(&text)?;
    let v = config["vocab_size"]
        .as_u64()
        .ok_or_else(|| anyhow!("config.json has no vocab_size"))?;
    Ok(u32::try_from(v)?)
}

/// TPOT p99 of fresh long prompts (every request prefills while others
/// decode) against the same prompts sent again (all in the prefix cache:
/// decode only, over the same context lengths), and what the prefill load
/// does to TTFT.
fn interference(
    rt: &tokio::runtime::Runtime,
    channel: tonic::transport::Channel,
    fresh: Vec<tandem_loadgen::WorkItem>,
    rate: f64,
    opts: &RunOptions,
    slo: Slo,
) -> serde_json::Value {
    let at = RunOptions {
        arrival: Arrival::poisson(rate),
        ..opts.clone()
    };
    let run = |reqs| {
        tandem_loadgen::summarize(
            &rt.block_on(tandem_loadgen::run(channel.clone(), reqs, &at)),
            slo,
        )
    };
    let with_prefill = run(fresh.clone());
    let decode_only = run(fresh);
    let ratio = with_prefill.tpot.p99 / decode_only.tpot.p99;
    eprintln!(
        "  TPOT p99 at {rate} req/s: {:.2} ms with long prompts, {:.2} ms decode-only ({ratio:.2}x); \
         TTFT p50/p99 {:.0}/{:.0} ms; {} failed",
        with_prefill.tpot.p99 * 1e3,
        decode_only.tpot.p99 * 1e3,
        with_prefill.ttft.p50 * 1e3,
        with_prefill.ttft.p99 * 1e3,
        with_prefill.failed + decode_only.failed,
    );
    json!({
        "interference_rate": rate,
        "tpot_p99_ms_with_prefill_load": with_prefill.tpot.p99 * 1e3,
        "tpot_p99_ms_decode_only": decode_only.tpot.p99 * 1e3,
        "tpot_p99_interference_ratio": ratio,
        "ttft_p50_ms_with_prefill_load": with_prefill.ttft.p50 * 1e3,
        "ttft_p99_ms_with_prefill_load": with_prefill.ttft.p99 * 1e3,
        "failed": with_prefill.failed + decode_only.failed,
    })
}

/// Unloaded latencies, one request at a time after a warm-up of two.
fn unloaded_run(
    rt: &tokio::runtime::Runtime,
    channel: tonic::transport::Channel,
    reqs: &[tandem_loadgen::WorkItem],
    opts: &RunOptions,
) -> tandem_loadgen::Summary {
    let one = RunOptions {
        arrival: Arrival::Concurrency(1),
        ..opts.clone()
    };
    let _ = rt.block_on(tandem_loadgen::run(
        channel.clone(),
        reqs[..2].to_vec(),
        &one,
    ));
    let records = rt.block_on(tandem_loadgen::run(channel, reqs[2..].to_vec(), &one));
    tandem_loadgen::summarize(&records, Slo::default())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bench_model = tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "small")?;
    let model = bench_model.dir.clone();
    let model_str = model
        .to_str()
        .ok_or_else(|| anyhow!("model path is not UTF-8"))?;
    let vocab = vocab_size(&model)?;
    let spec = |input: LengthDist, seed: u64| WorkloadSpec {
        input,
        output: args.output_len,
        shared_prefix: None,
        vocab_size: vocab,
        seed,
    };
    // Fresh prompts for every run: a repeated prompt is a prefix-cache hit
    // and its prefill is free. Runs 0..rates are the sweep, `rates` its
    // warm-up, then the unloaded run and one interference run per config.
    let n_rates = args.rates.len();
    let long_runs: Vec<_> = (0..n_rates + 4)
        .map(|i| spec(args.input_len, 100 + i as u64).generate(args.num_requests))
        .collect::<Result<_, _>>()?;
    let opts = RunOptions {
        arrival: Arrival::poisson(1.0),
        max_duration: None,
        request_timeout: Duration::from_secs(300),
        temperature: None,
        seed: 0,
        observer: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    std::fs::create_dir_all(&args.out_dir)?;

    let mut slo = Slo {
        ttft_s: args.slo_ttft_ms.map(|m| m / 1e3),
        tpot_s: args.slo_tpot_ms.map(|m| m / 1e3),
    };
    let interference_rate = args
        .interference_rate
        .or_else(|| args.rates.get(1).or(args.rates.first()).copied())
        .unwrap_or(1.0);
    let mut sweeps: Vec<Sweep> = Vec::new();
    let mut results = Vec::new();
    let mut unloaded = None;
    for (k, kind) in args.configs.iter().enumerate() {
        let config = match kind {
            ConfigKind::Colocated => colocated(&args.tandem, model_str, &args.serve_arg)?,
            ConfigKind::Disaggregated => disaggregated(&args.tandem, model_str, &args.serve_arg)?,
        };
        eprintln!("{}: {}", config.name, config.addr);
        let channel = rt.block_on(tandem_loadgen::connect(&config.addr))?;
        if unloaded.is_none() {
            let reqs = &long_runs[n_rates + 1][..10.min(args.num_requests)];
            let s = unloaded_run(&rt, channel.clone(), reqs, &opts);
            slo.ttft_s.get_or_insert(s.ttft.p50 * args.slo_ttft_scale);
            slo.tpot_s.get_or_insert(s.tpot.p50 * args.slo_tpot_scale);
            eprintln!(
                "unloaded: TTFT p50 {:.1} ms, TPOT p50 {:.2} ms; SLOs TTFT {:.1} ms, TPOT {:.2} ms",
                s.ttft.p50 * 1e3,
                s.tpot.p50 * 1e3,
                slo.ttft_s.unwrap_or(0.0) * 1e3,
                slo.tpot_s.unwrap_or(0.0) * 1e3
            );
            unloaded = Some(s);
        }
        let mut goodput = None;
        if !args.interference_only {
            let s = rt.block_on(sweep(
                config.name,
                channel.clone(),
                |i: usize| long_runs[i.min(n_rates)].clone(),
                &args.rates,
                &opts,
                slo,
            ));
            for p in &s.points {
                eprintln!(
                    "  {:.2} req/s: attainment {:.0}%, TTFT p99 {:.0} ms, TPOT p99 {:.2} ms",
                    p.rate,
                    p.summary.slo_attainment * 100.0,
                    p.summary.ttft.p99 * 1e3,
                    p.summary.tpot.p99 * 1e3
                );
            }
            eprintln!("  goodput {:?} req/s", s.goodput);
            goodput = s.goodput;
            sweeps.push(s);
        }
        let fresh = long_runs[(n_rates + 2 + k).min(n_rates + 3)].clone();
        let mut result = interference(&rt, channel, fresh, interference_rate, &opts, slo);
        result["config"] = json!(config.name);
        result["goodput_rps"] = json!(goodput);
        results.push(result);
    }
    let goodput_ratio = match sweeps.as_slice() {
        [c, d] => c.goodput.zip(d.goodput).map(|(c, d)| d / c),
        _ => None,
    };
    let report = json!({
        "workload": {
            "input_len": format!("{:?}", args.input_len),
            "output_len": format!("{:?}", args.output_len),
            "num_requests_per_rate": args.num_requests,
            "rates": args.rates,
            "model": model_str,
            "serve_args": args.serve_arg,
        },
        "slo": slo,
        "unloaded_colocated": unloaded,
        "configs": results,
        "goodput_ratio_disaggregated_over_colocated": goodput_ratio,
        "targets": {"goodput_ratio": 1.5, "tpot_p99_interference_ratio": 1.2},
        "sweeps": sweeps,
    });
    let path = args.out_dir.join("disagg.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    if !sweeps.is_empty() {
        tandem_loadgen::sweep::plot_sweeps(&args.out_dir, &sweeps)?;
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "goodput_ratio_disaggregated_over_colocated": goodput_ratio,
            "configs": report["configs"],
            "slo": slo,
        }))?
    );
    eprintln!("wrote {}", path.display());
    Ok(())
}
