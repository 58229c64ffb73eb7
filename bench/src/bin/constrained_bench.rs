//! What constrained decoding costs: decode throughput with and without a
//! JSON-schema constraint at batch 1 and 32, and the time spent computing
//! token masks per step.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin constrained-bench -- --out constrained.json
//! ```
//!
//! Without `--model` it generates the `bench-100m` preset (≈88M params, bf16,
//! 8000-token vocabulary). Each run drives an [`EngineCore`] directly: `batch`
//! requests are admitted and prefilled, then the decode phase is timed until
//! every sequence has produced `--tokens` tokens. The constrained runs use a
//! schema for a long array of small objects (integers with bounds, bounded
//! strings, enums, numbers) with `minItems` high enough that no sequence
//! finishes early, so the batch stays full and every step masks every
//! sequence. Three variants: unconstrained; constrained with masks computed
//! on the compute pool during the forward pass (the default); constrained with
//! masks computed on the engine thread before it (`overlap: false`), which
//! shows what the overlap hides. Mask times are per step (all the step's
//! sequences), from `EngineStats::last_step_mask_time`; "exposed" is what the
//! engine waited for after its forward pass.
//!
//! Two sampling modes. `greedy` is argmax with or without the mask, so the
//! difference is the constraint's own cost (mask computation, applying it,
//! committing the token); the schema asks for compact JSON so a greedy
//! random model cannot idle in whitespace. `temp1` samples at temperature 1
//! through the full sampler, whose cost depends on how many candidates
//! there are: a mask that leaves a few dozen allowed tokens out of 8000
//! makes the draw itself cheaper, so constrained decoding can come out
//! *faster* there.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_bench::percentile;
use tandem_engine::serving::{
    EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent, ResponseFormat,
};
use tandem_engine::{Checkpoint, FinishReason, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Parser, Debug)]
#[command(about = "tandem constrained-decoding benchmark (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    batches: Vec<usize>,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 48)]
    tokens: usize,
    /// Prompt length.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Repetitions of each run (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Sampling modes: `greedy` (argmax either way, so the difference is the
    /// constraint's own cost) and `temp1` (temperature 1, full sampler).
    #[arg(long, value_delimiter = ',', default_value = "greedy,temp1")]
    sampling: Vec<String>,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn schema() -> Value {
    json!({
        // Compact JSON: a greedy random model could otherwise idle in
        // whitespace, where masks come from llguidance's cache.
        "x-guidance": {"whitespace_flexible": false},
        "type": "array",
        "minItems": 200,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 100000},
                "name": {"type": "string", "maxLength": 12},
                "tag": {"enum": ["alpha", "beta", "gamma"]},
                "score": {"type": "number", "minimum": -10, "maximum": 10}
            },
            "required": ["id", "name", "tag", "score"],
            "additionalProperties": false
        }
    })
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    Unconstrained,
    Overlapped,
    Inline,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Unconstrained => "unconstrained",
            Self::Overlapped => "constrained",
            Self::Inline => "constrained_no_overlap",
        }
    }
}

/// One timed decode phase.
struct Run {
    tok_s: f64,
    /// Per decode step, seconds.
    mask: Vec<f64>,
    exposed: Vec<f64>,
    masks_per_step: f64,
}

fn run(
    ck: &Checkpoint,
    args: &Args,
    batch: usize,
    variant: Variant,
    temperature: f32,
    seed: u64,
) -> Result<Run> {
    let model = tandem_engine::Model::load(&ck.dir)?;
    let config = EngineConfig {
        kv_pool: KvPoolSize::Blocks(batch * (args.prompt_len + args.tokens).div_ceil(16) + 16),
        max_model_len: Some(args.prompt_len + args.tokens + 16),
        ..EngineConfig::default()
    };
    let tokenizer = tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json"))?;
    let mut core = EngineCore::new(
        model,
        Some(Arc::new(tokenizer)),
        ck.eos_token_ids.clone(),
        &config,
    )?;
    core.set_mask_overlap(variant != Variant::Inline);
    let format = ResponseFormat::JsonSchema(schema().to_string());
    let mut streams: Vec<UnboundedReceiver<RequestEvent>> = Vec::new();
    for i in 0..batch {
        // Distinct prompts: no prefix-cache sharing between runs' sequences.
        let prompt: Vec<u32> = (0..args.prompt_len)
            .map(|k| ((k * 31 + i * 7 + seed as usize * 13) % 250) as u32 + 1)
            .collect();
        let mut r = Request::new(Prompt::Tokens(prompt), args.tokens);
        r.ignore_eos = true;
        r.sampling = SamplingParams {
            temperature,
            seed: Some(seed * 1000 + i as u64),
            ..SamplingParams::default()
        };
        if variant != Variant::Unconstrained {
            r.response_format = Some(format.clone());
        }
        let (tx, rx) = unbounded_channel();
        core.add_request(i as u64, r, tx)?;
        streams.push(rx);
    }
    // Prefill (and the first token) until every sequence is decoding.
    let mut produced = vec![0usize; batch];
    let mut finished = vec![None; batch];
    let drain = |streams: &mut [UnboundedReceiver<RequestEvent>],
                 produced: &mut [usize],
                 finished: &mut [Option<FinishReason>]|
     -> Result<()> {
        for (i, rx) in streams.iter_mut().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    RequestEvent::Delta(d) => {
                        produced[i] += d.token_ids.len();
                        if d.finish_reason.is_some() {
                            finished[i] = d.finish_reason;
                        }
                    }
                    RequestEvent::Error(e) => bail!("request {i} failed: {e}"),
                    _ => {}
                }
            }
        }
        Ok(())
    };
    while produced.contains(&0) {
        core.step();
        drain(&mut streams, &mut produced, &mut finished)?;
    }
    let start_tokens: usize = produced.iter().sum();
    let mut mask = Vec::new();
    let mut exposed = Vec::new();
    let mut masks = 0u64;
    let t0 = Instant::now();
    while core.has_work() {
        let before = core.stats();
        core.step();
        let after = core.stats();
        if let Some(m) = after.last_step_mask_time {
            mask.push(m.as_secs_f64());
            exposed.push((after.mask_exposed - before.mask_exposed).as_secs_f64());
            masks += after.masks_computed - before.masks_computed;
        }
        drain(&mut streams, &mut produced, &mut finished)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let decoded: usize = produced.iter().sum::<usize>() - start_tokens;
    if let Some(i) = finished
        .iter()
        .position(|f| *f != Some(FinishReason::Length))
    {
        bail!(
            "sequence {i} ended with {:?} before {} tokens: the batch would shrink",
            finished[i],
            args.tokens
        );
    }
    Ok(Run {
        tok_s: decoded as f64 / secs,
        masks_per_step: masks as f64 / mask.len().max(1) as f64,
        mask,
        exposed,
    })
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bench_model =
        tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "bench-100m")?;
    let dir = bench_model.dir.clone();
    let ck = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    let vocab = ck.model.config().vocab_size;
    let threads = rayon::current_num_threads();
    eprintln!("vocab {vocab}, {threads} compute threads");

    // Grammar compilation: cold, then from the cache.
    let compile = {
        let model = tandem_engine::Model::load(&ck.dir)?;
        let tokenizer =
            tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json"))?;
        let mut core = EngineCore::new(
            model,
            Some(Arc::new(tokenizer)),
            ck.eos_token_ids.clone(),
            &EngineConfig {
                kv_pool: KvPoolSize::Blocks(64),
                ..EngineConfig::default()
            },
        )?;
        let mut times = Vec::new();
        for i in 0..2 {
            let mut r = Request::new(Prompt::Tokens(vec![1, 2, 3]), 1);
            r.response_format = Some(ResponseFormat::JsonSchema(schema().to_string()));
            let (tx, _rx) = unbounded_channel();
            let t = Instant::now();
            core.add_request(i, r, tx)?;
            times.push(t.elapsed());
        }
        json!({
            "first_request_ms": ms(times[0]),
            "cached_ms": ms(times[1]),
        })
    };
    eprintln!("compile: {compile}");

    let mut results = Vec::new();
    let mut summary = serde_json::Map::new();
    for mode in &args.sampling {
        let temperature = match mode.as_str() {
            "greedy" => 0.0,
            "temp1" => 1.0,
            other => bail!("unknown sampling mode {other:?} (greedy, temp1)"),
        };
        for &batch in &args.batches {
            let mut by_variant = serde_json::Map::new();
            let mut tok_s_of = |v: Variant, runs: &[Run]| {
                let mut t: Vec<f64> = runs.iter().map(|r| r.tok_s).collect();
                t.sort_by(f64::total_cmp);
                let median = t[t.len() / 2];
                let best = t[t.len() - 1];
                let mask: Vec<f64> = runs.iter().flat_map(|r| r.mask.clone()).collect();
                let exposed: Vec<f64> = runs.iter().flat_map(|r| r.exposed.clone()).collect();
                let entry = json!({
                    "decode_tok_s": median,
                    "decode_tok_s_best": best,
                    "decode_tok_s_runs": t,
                    "mask_ms_per_step_mean": mean(&mask) * 1e3,
                    "mask_ms_per_step_p99": p99(&mask) * 1e3,
                    "mask_exposed_ms_per_step_mean": mean(&exposed) * 1e3,
                    "mask_exposed_ms_per_step_p99": p99(&exposed) * 1e3,
                    "masks_per_step": mean(&runs.iter().map(|r| r.masks_per_step).collect::<Vec<_>>()),
                    "mask_ms_per_sequence_mean": mean(&mask) * 1e3 / mean(&runs.iter().map(|r| r.masks_per_step).collect::<Vec<_>>()).max(1.0),
                    "steps_with_masks": mask.len(),
                });
                eprintln!("{mode} batch {batch} {}: {entry}", v.name());
                by_variant.insert(v.name().into(), entry);
                (median, best)
            };
            // Variants interleaved within each repetition, so that a noisy
            // neighbour on a shared machine hits them alike.
            let variants = [Variant::Unconstrained, Variant::Overlapped, Variant::Inline];
            let mut runs: Vec<Vec<Run>> = variants.iter().map(|_| Vec::new()).collect();
            for rep in 0..args.reps {
                for (k, &v) in variants.iter().enumerate() {
                    runs[k].push(run(&ck, &args, batch, v, temperature, rep as u64 + 1)?);
                }
            }
            let stats: Vec<(f64, f64)> = variants
                .iter()
                .zip(&runs)
                .map(|(&v, r)| tok_s_of(v, r))
                .collect();
            let medians: Vec<f64> = stats.iter().map(|s| s.0).collect();
            let best: Vec<f64> = stats.iter().map(|s| s.1).collect();
            let slowdown_best = 1.0 - best[1] / best[0];
            let slowdown = 1.0 - medians[1] / medians[0];
            let slowdown_inline = 1.0 - medians[2] / medians[0];
            by_variant.insert("batch".into(), json!(batch));
            by_variant.insert("sampling".into(), json!(mode));
            by_variant.insert("slowdown".into(), json!(slowdown));
            by_variant.insert("slowdown_no_overlap".into(), json!(slowdown_inline));
            summary.insert(
                format!("{mode}_batch_{batch}"),
                json!({
                    "tok_s_unconstrained": medians[0],
                    "tok_s_constrained": medians[1],
                    "slowdown_pct": slowdown * 100.0,
                    "slowdown_no_overlap_pct": slowdown_inline * 100.0,
                    "slowdown_best_of_reps_pct": slowdown_best * 100.0,
                }),
            );
            results.push(Value::Object(by_variant));
        }
    }
    let report = json!({
        "model": {
            "path": dir.display().to_string(),
            "vocab": vocab,
            "layers": ck.model.config().num_layers,
            "hidden": ck.model.config().hidden_size,
        },
        "threads": threads,
        "tokens_per_sequence": args.tokens,
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "schema": schema(),
        "compile": compile,
        "summary": summary,
        "runs": results,
        "target": "slowdown under 10% at batch 32",
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn p99(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        percentile(v, 99.0)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
