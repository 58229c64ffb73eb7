//! What tracing costs when nothing is exported: serving throughput with no
//! `tracing` subscriber at all against the subscriber every `tandem`
//! process installs (env filter at `info`, the log layer; no OTLP).
//!
//! ```text
//! cargo run --release -p tandem-bench --bin tracing-bench -- --out tracing.json
//! ```
//!
//! A global subscriber cannot be removed once installed, so each
//! measurement is a child process of this binary (`--mode none|logs`),
//! alternating `none, logs, logs, none, ...` over `--rounds` rounds so
//! drift on a noisy machine hits both alike; the report is each mode's
//! median and the ratio `logs / none`. A child serves `--requests`
//! concurrent greedy requests through the real `Generation` service in
//! process (request spans, the engine's phase spans, per-request metrics
//! and the engine collector all live), on the `small` preset, whose steps
//! are short, so per-request and per-step overheads weigh the most.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use futures_util::StreamExt;
use serde_json::json;
use tandem_bench::median;
use tandem_engine::serving::{EngineConfig, EngineCore, EngineHandle, KvPoolSize};
use tandem_proto::v1;
use tandem_proto::v1::generation_server::Generation;

#[derive(Parser, Debug)]
#[command(about = "tracing overhead benchmark (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate the `small` preset).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Concurrent requests per measurement.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    output_len: u32,
    /// Measurements per mode.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Internal: run one measurement in this mode and print it.
    #[arg(long, hide = true)]
    mode: Option<String>,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    match args.mode.as_deref() {
        Some(mode) => child(&args, mode),
        None => parent(&args),
    }
}

/// Output tokens per second of one workload in this process.
fn child(args: &Args, mode: &str) -> Result<()> {
    let _telemetry = match mode {
        "none" => None,
        "logs" => {
            let mut c = tandem_telemetry::TelemetryConfig::new("tracing-bench");
            c.log_filter = Some("info".into());
            Some(tandem_telemetry::init(&c)?)
        }
        other => bail!("unknown mode {other:?}"),
    };
    let dir = args.model.clone().context("the parent passes --model")?;
    let ckpt = tandem_engine::Checkpoint::open(&dir)?;
    let config = EngineConfig {
        kv_pool: KvPoolSize::Bytes(256 << 20),
        ..EngineConfig::default()
    };
    let core = EngineCore::new(
        ckpt.model,
        ckpt.tokenizer.map(Arc::new),
        ckpt.eos_token_ids,
        &config,
    )?;
    let engine = EngineHandle::spawn(core)?;
    let registry = tandem_telemetry::Registry::new();
    tandem_server::register_engine(&registry, engine.clone());
    let service = Arc::new(
        tandem_server::GenerationService::new(engine)
            .with_metrics(tandem_server::ServingMetrics::register(&registry)),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let run = |n: usize, salt: u32| {
        let _in_runtime = rt.enter();
        let calls: Vec<_> = (0..n)
            .map(|i| {
                let service = service.clone();
                let prompt: Vec<u32> = (0..args.prompt_len as u32)
                    .map(|t| (t * 31 + i as u32 * 7 + salt * 1013) % 200 + 1)
                    .collect();
                let req = v1::GenerateRequest {
                    prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                        ids: prompt,
                    })),
                    sampling: Some(v1::SamplingParams {
                        temperature: Some(0.0),
                        ..Default::default()
                    }),
                    max_tokens: Some(args.output_len),
                    ignore_eos: true,
                    ..Default::default()
                };
                tokio::spawn(async move {
                    let mut stream = service
                        .generate(tonic::Request::new(req))
                        .await?
                        .into_inner();
                    let mut tokens = 0usize;
                    while let Some(msg) = stream.next().await {
                        if let Some(v1::generate_response::Event::Delta(d)) = msg?.event {
                            tokens += d.token_ids.len();
                        }
                    }
                    Ok::<usize, tonic::Status>(tokens)
                })
            })
            .collect();
        rt.block_on(async {
            let mut total = 0usize;
            for c in calls {
                total += c.await.context("request task")??;
            }
            anyhow::Ok(total)
        })
    };
    run(4, 1)?; // warm up
    let start = Instant::now();
    let tokens = run(args.requests, 2)?;
    let seconds = start.elapsed().as_secs_f64();
    // A scrape, as Prometheus would do now and then.
    let scraped = registry.render().len();
    println!(
        "{}",
        json!({"mode": mode, "tokens": tokens, "seconds": seconds,
               "tok_s": tokens as f64 / seconds, "scrape_bytes": scraped})
    );
    Ok(())
}

fn parent(args: &Args) -> Result<()> {
    let model = tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "small")?;
    let exe = std::env::current_exe()?;
    let mut samples: Vec<serde_json::Value> = Vec::new();
    let (mut none, mut logs) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            ["none", "logs"]
        } else {
            ["logs", "none"]
        };
        for mode in order {
            let out = Command::new(&exe)
                .args(["--mode", mode, "--model"])
                .arg(&model.dir)
                .args(["--requests", &args.requests.to_string()])
                .args(["--prompt-len", &args.prompt_len.to_string()])
                .args(["--output-len", &args.output_len.to_string()])
                .output()
                .context("running a measurement")?;
            if !out.status.success() {
                bail!(
                    "measurement ({mode}) failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let line = String::from_utf8_lossy(&out.stdout);
            let v: serde_json::Value = serde_json::from_str(line.trim())
                .with_context(|| format!("measurement printed {line:?}"))?;
            let tok_s = v["tok_s"].as_f64().context("tok_s")?;
            eprintln!("round {round}: {mode:>4} {tok_s:.0} tok/s");
            if mode == "none" {
                none.push(tok_s);
            } else {
                logs.push(tok_s);
            }
            samples.push(v);
        }
    }
    let (m_none, m_logs) = (median(&none), median(&logs));
    let report = json!({
        "benchmark": "tracing-overhead",
        "model": model.dir.display().to_string(),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "median_tok_s_no_subscriber": m_none,
        "median_tok_s_tracing_layers": m_logs,
        "ratio_tracing_over_none": m_logs / m_none,
        "samples": samples,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    Ok(())
}
