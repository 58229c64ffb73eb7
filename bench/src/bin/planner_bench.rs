//! The SLA planner under a ramp: `tandem up --planner` (real processes)
//! offered a load that climbs from 0.5x to 3x of one prefill+decode pair's
//! capacity and back, long and short prompts mixed.
//!
//! ```text
//! cargo build --release -p tandem -p tandem-bench
//! target/release/planner-bench --tandem target/release/tandem --model MODEL \
//!     --profile profile.json --out-dir bench/results/planner/ramp
//! ```
//!
//! The pair's capacity in requests/s comes from the profile and the
//! workload: one prefill worker's tokens/s over the mean uncached prompt
//! tokens a request puts on the prefill pool (prompts from the remote-
//! prefill threshold up), and one decode worker's over the mean output, the
//! lower of the two. Each phase offers `multiplier × capacity` requests/s
//! (Poisson) for `--phase-s` seconds. Reported per phase: SLO attainment of
//! the requests sent in it (all, and those sent after `--reaction-s`, the
//! planner's allowance to react), failed requests, and the workers per pool
//! over time (the planner's own log); in all, worker-seconds against a
//! static cluster sized for the peak (the most workers the planner used, for
//! the whole run). `ramp.json` and `ramp.png` (load, workers, attainment).
//!
//! Workers of one machine share its cores: more workers add capacity only
//! where there are cores for them (see bench/RESULTS.md).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_loadgen::client::{connect, run, RunOptions};
use tandem_loadgen::metrics::{RequestRecord, Slo};
use tandem_loadgen::plot::{line_chart, Chart, Series};
use tandem_loadgen::{Arrival, LengthDist, WorkloadSpec};

#[derive(Parser, Debug)]
#[command(about = "tandem SLA planner ramp benchmark (JSON and a plot)")]
struct Args {
    #[arg(long, default_value = "target/release/tandem")]
    tandem: PathBuf,
    /// Checkpoint directory (default: generate `small` in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The planner's profile (`tandem planner profile`).
    #[arg(long)]
    profile: PathBuf,
    /// Load multipliers of one pair's capacity, one phase each.
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,2,3,2,1,0.5")]
    multipliers: Vec<f64>,
    #[arg(long, default_value_t = 40.0)]
    phase_s: f64,
    /// Requests sent this long into a phase are judged (the planner's time
    /// to react: an interval or two and a worker's start).
    #[arg(long, default_value_t = 15.0)]
    reaction_s: f64,
    #[arg(long, default_value = "uniform:32-768")]
    input_len: LengthDist,
    #[arg(long, default_value = "uniform:16-128")]
    output_len: LengthDist,
    /// Prompt tokens from which the router uses a prefill worker.
    #[arg(long, default_value_t = 256)]
    remote_prefill_threshold: u32,
    #[arg(long, default_value_t = 6)]
    max_workers: usize,
    #[arg(long, default_value_t = 5.0)]
    planner_interval_s: f64,
    #[arg(long, default_value_t = 3)]
    scale_down_after: u32,
    /// The planner's `--utilisation` (share of a worker's profiled
    /// capacity it plans for).
    #[arg(long, default_value_t = 0.8)]
    utilisation: f64,
    #[arg(long, default_value = "bench/results/planner/ramp")]
    out_dir: PathBuf,
}

fn up(args: &Args, model: &str, log: &str) -> Result<tandem_bench::TandemUp> {
    let mut a: Vec<String> = ["--model", model, "--addr", "127.0.0.1:0", "--no-http"]
        .iter()
        .chain(&["--prefill", "1", "--decode", "1", "--planner"])
        .map(|s| (*s).to_string())
        .collect();
    a.extend([
        format!("--planner-profile={}", args.profile.display()),
        format!("--planner-log={log}"),
        format!("--planner-interval-s={}", args.planner_interval_s),
        format!("--max-workers={}", args.max_workers),
        format!("--scale-down-after={}", args.scale_down_after),
        format!("--utilisation={}", args.utilisation),
        format!(
            "--remote-prefill-threshold={}",
            args.remote_prefill_threshold
        ),
    ]);
    tandem_bench::TandemUp::start(&args.tandem, &a, Stdio::inherit())
}

/// One pair's capacity (requests/s) for `spec`'s mix, from the profile.
fn pair_capacity(profile: &Value, spec: &WorkloadSpec, threshold: u32) -> Result<f64> {
    let items = spec.generate(4000)?;
    let n = items.len() as f64;
    let prefill_per_request = items
        .iter()
        .map(|i| match &i.prompt {
            tandem_loadgen::workload::Prompt::Tokens(t) if t.len() as u32 >= threshold => {
                t.len() as f64
            }
            _ => 0.0,
        })
        .sum::<f64>()
        / n;
    let output_per_request = items.iter().map(|i| f64::from(i.max_tokens)).sum::<f64>() / n;
    let field = |k: &str| {
        profile[k]
            .as_f64()
            .ok_or_else(|| anyhow!("the profile has no {k}"))
    };
    let prefill = field("prefill_tokens_per_s")? / prefill_per_request.max(1e-9);
    let decode = field("decode_tokens_per_s")? / output_per_request.max(1e-9);
    Ok(prefill.min(decode))
}

/// Workers per pool over time from the planner's log: `(t, prefill, decode)`.
fn workers(log: &str) -> Vec<(f64, f64, f64)> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let t = v["t_s"].as_f64()?;
            let target = &v["decision"]["target"];
            Some((t, target["prefill"].as_f64()?, target["decode"].as_f64()?))
        })
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let model = tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "small")?;
    let profile: Value = serde_json::from_str(&std::fs::read_to_string(&args.profile)?)?;
    let slo = Slo {
        ttft_s: profile["slo"]["ttft_s"].as_f64(),
        tpot_s: profile["slo"]["tpot_s"].as_f64(),
    };
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(model.dir.join("config.json"))?)?;
    let vocab = config["vocab_size"].as_u64().unwrap_or(512) as u32;
    let spec = |seed: u64| WorkloadSpec {
        input: args.input_len,
        output: args.output_len,
        shared_prefix: None,
        vocab_size: vocab,
        seed,
    };
    let capacity = pair_capacity(&profile, &spec(0), args.remote_prefill_threshold)?;
    eprintln!("one pair sustains {capacity:.2} requests/s of this mix (profile)");
    std::fs::create_dir_all(&args.out_dir)?;
    let log = args.out_dir.join("decisions.jsonl");
    let _ = std::fs::remove_file(&log);
    let cluster = up(
        &args,
        &model.dir.display().to_string(),
        &log.display().to_string(),
    )?;
    let addr = cluster.addr.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let phase = Duration::from_secs_f64(args.phase_s);
    let phases: Vec<Vec<RequestRecord>> = rt.block_on(async {
        let channel = connect(&addr).await?;
        let mut tasks = Vec::new();
        for (i, m) in args.multipliers.iter().enumerate() {
            let rate = m * capacity;
            let items =
                spec(1 + i as u64).generate((rate * args.phase_s).ceil().max(1.0) as usize)?;
            let opts = RunOptions {
                arrival: Arrival::poisson(rate),
                max_duration: Some(phase),
                request_timeout: Duration::from_secs(120),
                temperature: Some(0.0),
                seed: i as u64,
                observer: None,
            };
            let channel = channel.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(phase * i as u32).await;
                run(channel, items, &opts).await
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await?);
        }
        anyhow::Ok(out)
    })?;
    // The planner's last decisions, then the cluster stops.
    std::thread::sleep(Duration::from_secs_f64(args.planner_interval_s));
    drop(cluster);
    report(
        &args,
        capacity,
        slo,
        &phases,
        &std::fs::read_to_string(&log).unwrap_or_default(),
    )
}

fn report(
    args: &Args,
    capacity: f64,
    slo: Slo,
    phases: &[Vec<RequestRecord>],
    log: &str,
) -> Result<()> {
    let mut rows = Vec::new();
    for (i, (records, m)) in phases.iter().zip(&args.multipliers).enumerate() {
        let share = |r: &[&RequestRecord]| {
            r.iter().filter(|x| x.meets(&slo)).count() as f64 / r.len().max(1) as f64
        };
        let all: Vec<&RequestRecord> = records.iter().collect();
        let settled: Vec<&RequestRecord> = records
            .iter()
            .filter(|r| r.sent_at >= args.reaction_s)
            .collect();
        let failed = records.iter().filter(|r| !r.ok()).count();
        // Why requests failed, the commonest first (a status's first words).
        let mut why: std::collections::BTreeMap<String, usize> = Default::default();
        for e in records.iter().filter_map(|r| r.error.as_deref()) {
            *why.entry(e.chars().take(60).collect()).or_default() += 1;
        }
        eprintln!(
            "phase {i} ({m}x, {:.2} req/s): {} requests, attainment {:.1}% (after {} s: {:.1}%), {failed} failed",
            m * capacity,
            records.len(),
            100.0 * share(&all),
            args.reaction_s,
            100.0 * share(&settled)
        );
        rows.push(json!({
            "phase": i, "multiplier": m, "rate": m * capacity, "start_s": i as f64 * args.phase_s,
            "requests": records.len(), "failed": failed,
            "attainment": share(&all), "attainment_after_reaction": share(&settled),
            "errors": why,
        }));
    }
    let timeline = workers(log);
    let end = args.multipliers.len() as f64 * args.phase_s;
    // Worker-seconds: the planner's targets held from each decision on.
    let mut worker_s = 0.0;
    let (mut t0, mut n0) = (0.0, 2.0);
    let mut peak: f64 = 2.0;
    for &(t, p, d) in &timeline {
        let t = t.min(end);
        worker_s += n0 * (t - t0);
        (t0, n0) = (t, p + d);
        peak = peak.max(p + d);
    }
    worker_s += n0 * (end - t0).max(0.0);
    let static_s = peak * end;
    eprintln!(
        "worker-seconds {worker_s:.0} against {static_s:.0} for a static cluster of {peak} workers"
    );
    let out = json!({
        "config": {
            "multipliers": args.multipliers, "phase_s": args.phase_s, "reaction_s": args.reaction_s,
            "input_len": format!("{:?}", args.input_len), "output_len": format!("{:?}", args.output_len),
            "max_workers": args.max_workers, "planner_interval_s": args.planner_interval_s,
            "utilisation": args.utilisation,
            "pair_capacity_rps": capacity, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        },
        "phases": rows,
        "workers": timeline.iter().map(|(t, p, d)| json!({"t_s": t, "prefill": p, "decode": d})).collect::<Vec<_>>(),
        "worker_seconds": worker_s,
        "static_peak_worker_seconds": static_s,
    });
    std::fs::write(
        args.out_dir.join("ramp.json"),
        serde_json::to_string_pretty(&out)?,
    )?;
    let step = |f: &dyn Fn(&(f64, f64, f64)) -> f64| -> Vec<(f64, f64)> {
        timeline.iter().map(|w| (w.0, f(w))).collect()
    };
    let per_phase = |f: &dyn Fn(usize) -> f64| -> Vec<(f64, f64)> {
        (0..phases.len())
            .map(|i| ((i as f64 + 0.5) * args.phase_s, f(i)))
            .collect()
    };
    line_chart(
        &args.out_dir.join("ramp.png"),
        &Chart {
            title: "SLA planner under a ramp".into(),
            x_label: "seconds".into(),
            y_label: "workers / load (x one pair) / attainment (x10)".into(),
            x_log: false,
            series: vec![
                Series::new("load (x pair)", per_phase(&|i| args.multipliers[i])),
                Series::new("prefill workers", step(&|w| w.1)),
                Series::new("decode workers", step(&|w| w.2)),
                Series::new(
                    "attainment after reaction (x10)",
                    per_phase(&|i| {
                        10.0 * rows[i]["attainment_after_reaction"].as_f64().unwrap_or(0.0)
                    }),
                ),
            ],
        },
    )?;
    eprintln!("wrote {}", args.out_dir.join("ramp.json").display());
    Ok(())
}
