//! What speculative decoding buys: single-stream decode speed and
//! acceptance for each drafter against `k`, and batch-32 throughput with
//! adaptive speculation against none.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin spec-bench -- --out spec.json
//! ```
//!
//! Without `--model` it generates the `bench-100m` preset (≈88M params,
//! bf16). The drafters: prompt lookup (`ngram`) and draft models made of the
//! target's first `L` layers (`early-exit-L`: same embedding, final norm and
//! head). Each run drives an [`EngineCore`] directly: the requests are
//! admitted and prefilled, then the decode phase is timed until every
//! sequence has its `--tokens` tokens. Greedy decoding throughout, and every
//! speculative run's tokens are checked against the plain run's
//! (`same_tokens`).
//!
//! Two targets. `random` is the preset as generated: its layers are
//! unrelated random maps, so its first layers predict nothing of its output
//! and no draft model at hand agrees with it (a random-weight checkpoint has
//! no trained smaller sibling). `aligned` is the same random draws with the
//! residual outputs (`o_proj`, `down_proj`) of every layer from
//! `--aligned-layers` on damped by `--aligned-damping`, so its first layers
//! decide most of its tokens, as a trained model's early layers often do
//! (the premise of LayerSkip-style self-speculation). Its shapes, and so its
//! cost per step, are the random target's; it stands in for a real aligned
//! pair, and its acceptance rate is reported with every number.
//!
//! The prompt is a random 16-token phrase repeated: prompt lookup needs
//! repetition to find anything, and how often a random model's continuation
//! repeats is what it is (reported as the acceptance rate).
//!
//! Batch 32: plain, speculation as configured by default (adaptive `k`, off
//! while the step's decode rows would exceed the memory-bound limit — 32
//! sequences leave no room, so it stands down), and `forced` (the row limit
//! lifted) to show what leaving it on would cost. Every comparison is a
//! plain engine and a speculative engine decoding the same batch in one
//! process, one step each in turn (who goes first alternates), each timed
//! over its own steps only, so both see the same machine at millisecond
//! scale; repeated `--reps` times, the median ratio is reported. (Whole
//! runs back to back were at the mercy of the shared machine: two identical
//! code paths measured 0.85 to 1.0 of each other.)

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_engine::serving::{EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent};
use tandem_engine::speculative::{
    DraftModelDrafter, Drafter, NgramDrafter, SpecCounts, SpeculativeConfig,
};
use tandem_engine::{CpuBackend, Model};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Parser, Debug)]
#[command(about = "tandem speculative-decoding benchmark (JSON output)")]
struct Args {
    /// Checkpoint directory (default: generate bench-100m in bf16).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Draft lengths to try single-stream.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,6")]
    ks: Vec<usize>,
    /// Early-exit draft models: the target's first L layers.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    draft_layers: Vec<usize>,
    /// The large batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Tokens per sequence in the batch runs.
    #[arg(long, default_value_t = 48)]
    batch_tokens: usize,
    /// The aligned target: layers from this one on are damped ...
    #[arg(long, default_value_t = 1)]
    aligned_layers: usize,
    /// ... by this factor on their residual outputs.
    #[arg(long, default_value_t = 0.005)]
    aligned_damping: f64,
    /// A separate draft model for the `--model` target.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Prompts, one per line (`\n` for a line break), tokenized with the
    /// target's tokenizer (default: a random phrase repeated, per request).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Skip the aligned stand-in target.
    #[arg(long)]
    no_aligned: bool,
    /// Skip the single-stream sweep (batch runs only).
    #[arg(long)]
    batch_only: bool,
    /// Repetitions of every comparison (median ratio reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Which drafter a run uses.
#[derive(Debug, Clone)]
enum Method {
    Plain,
    Ngram,
    /// The target's first `L` layers.
    EarlyExit(usize),
    /// A separate draft checkpoint.
    Draft(PathBuf),
}

impl Method {
    fn name(&self) -> String {
        match self {
            Self::Plain => "plain".into(),
            Self::Ngram => "ngram".into(),
            Self::EarlyExit(l) => format!("early-exit-{l}"),
            Self::Draft(d) => format!(
                "draft:{}",
                d.file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
            ),
        }
    }

    /// The draft model this method runs, if any.
    fn draft_model(&self, target: &std::path::Path) -> Result<Option<Model>> {
        Ok(match self {
            Self::Plain | Self::Ngram => None,
            Self::EarlyExit(layers) => {
                let mut draft = Model::load(target)?;
                draft.truncate_layers(*layers)?;
                Some(draft)
            }
            Self::Draft(dir) => Some(Model::load(dir)?),
        })
    }
}

struct Outcome {
    tok_s: f64,
    tokens: Vec<Vec<u32>>,
    counts: SpecCounts,
    draft_cost: f64,
}

fn engine(dir: &std::path::Path, method: &Method, spec: SpeculativeConfig) -> Result<EngineCore> {
    let config = EngineConfig {
        kv_pool: KvPoolSize::Bytes(1 << 30),
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(Model::load(dir)?, None, Vec::new(), &config)?;
    let drafter: Box<dyn Drafter> = match (method, method.draft_model(dir)?) {
        (Method::Plain, _) => return Ok(core),
        (_, Some(draft)) => {
            let limits = core.limits();
            let backend = CpuBackend::new(draft, limits.block_size, limits.num_blocks);
            Box::new(DraftModelDrafter::new(
                Box::new(backend),
                core.model_config(),
            )?)
        }
        (_, None) => Box::new(NgramDrafter::default()),
    };
    core.enable_speculation(drafter, spec)?;
    Ok(core)
}

/// The prompts of a `--prompts` file, tokenized with the checkpoint's
/// tokenizer.
fn text_prompts(file: &std::path::Path, model: &std::path::Path) -> Result<Vec<Vec<u32>>> {
    let ck = tandem_engine::Checkpoint::open(model)?;
    let Some(tok) = ck.tokenizer else {
        bail!("--prompts needs a checkpoint with a tokenizer");
    };
    let mut out = Vec::new();
    for line in std::fs::read_to_string(file)?
        .lines()
        .filter(|l| !l.trim().is_empty())
    {
        out.push(tok.encode(&line.replace("\\n", "\n"))?);
    }
    if out.is_empty() {
        bail!("{}: no prompts", file.display());
    }
    Ok(out)
}

/// A random phrase of 16 tokens repeated four times, different per request.
fn prompt(i: usize, vocab: usize) -> Vec<u32> {
    let mut x = 0x9e37_79b9_u64.wrapping_mul(i as u64 + 1);
    let phrase: Vec<u32> = (0..16)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % (vocab as u64 - 1)) as u32 + 1
        })
        .collect();
    phrase.repeat(4)
}

fn drain(rx: &mut UnboundedReceiver<RequestEvent>, out: &mut Vec<u32>) -> Result<()> {
    while let Ok(ev) = rx.try_recv() {
        match ev {
            RequestEvent::Delta(d) => out.extend(d.token_ids),
            RequestEvent::Error(e) => bail!("request failed: {e}"),
            _ => {}
        }
    }
    Ok(())
}

/// An engine with `batch` requests prefilled (each has its first token).
struct Prefilled {
    core: EngineCore,
    rxs: Vec<UnboundedReceiver<RequestEvent>>,
    out: Vec<Vec<u32>>,
    /// Tokens out when decoding started.
    before: usize,
    /// Time spent in decode steps.
    secs: f64,
    steps: usize,
}

impl Prefilled {
    /// Adds `batch` requests and steps until each has its first token.
    /// Request `i` gets `prompts[i % len]`, or a random phrase without them.
    fn new(
        mut core: EngineCore,
        batch: usize,
        tokens: usize,
        prompts: Option<&[Vec<u32>]>,
    ) -> Result<Prefilled> {
        let vocab = core.model_config().vocab_size;
        let mut rxs = Vec::new();
        for i in 0..batch {
            let ids = match prompts {
                Some(p) if !p.is_empty() => p[i % p.len()].clone(),
                _ => prompt(i, vocab),
            };
            let mut req = Request::new(Prompt::Tokens(ids), tokens);
            req.ignore_eos = true;
            let (tx, rx) = unbounded_channel();
            core.add_request(i as u64, req, tx)?;
            rxs.push(rx);
        }
        let mut p = Prefilled {
            core,
            rxs,
            out: vec![Vec::new(); batch],
            before: 0,
            secs: 0.0,
            steps: 0,
        };
        while p.out.iter().any(Vec::is_empty) {
            p.core.step();
            p.drain()?;
            p.steps += 1;
            if p.steps > 10_000 {
                bail!("prefill did not finish");
            }
        }
        p.before = p.out.iter().map(Vec::len).sum();
        Ok(p)
    }

    fn drain(&mut self) -> Result<()> {
        for (rx, o) in self.rxs.iter_mut().zip(&mut self.out) {
            drain(rx, o)?;
        }
        Ok(())
    }

    /// One timed decode step; false when there was nothing left to do.
    fn step(&mut self) -> Result<bool> {
        if !self.core.has_work() {
            return Ok(false);
        }
        let t0 = Instant::now();
        self.core.step();
        self.secs += t0.elapsed().as_secs_f64();
        self.steps += 1;
        if self.steps > 1_000_000 {
            bail!("decode did not finish");
        }
        Ok(true)
    }

    fn finish(mut self) -> Result<Outcome> {
        self.drain()?;
        let after: usize = self.out.iter().map(Vec::len).sum();
        Ok(Outcome {
            tok_s: (after - self.before) as f64 / self.secs,
            tokens: self.out,
            counts: self.core.speculation_counts(),
            draft_cost: 0.0,
        })
    }
}

/// Prefills `batch` requests, then times decoding to `tokens` each.
fn decode(
    core: EngineCore,
    batch: usize,
    tokens: usize,
    prompts: Option<&[Vec<u32>]>,
) -> Result<Outcome> {
    let mut p = Prefilled::new(core, batch, tokens, prompts)?;
    while p.step()? {}
    p.finish()
}

/// Decodes the same batch on two engines one step each in turn (who goes
/// first alternates), timing each engine's own steps only: both see the
/// same machine at millisecond scale, so the ratio is not at the mercy of
/// what else the shared machine does during a whole run.
fn decode_interleaved(
    a: EngineCore,
    b: EngineCore,
    batch: usize,
    tokens: usize,
    prompts: Option<&[Vec<u32>]>,
) -> Result<(Outcome, Outcome)> {
    let mut a = Prefilled::new(a, batch, tokens, prompts)?;
    let mut b = Prefilled::new(b, batch, tokens, prompts)?;
    let mut turn = 0usize;
    loop {
        let (first, second) = if turn.is_multiple_of(2) {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        let (x, y) = (first.step()?, second.step()?);
        if !x && !y {
            break;
        }
        turn += 1;
    }
    Ok((a.finish()?, b.finish()?))
}

fn run(
    dir: &std::path::Path,
    method: &Method,
    spec: SpeculativeConfig,
    batch: usize,
    tokens: usize,
    prompts: Option<&[Vec<u32>]>,
) -> Result<Outcome> {
    let core = engine(dir, method, spec)?;
    let mut o = decode(core, batch, tokens, prompts)?;
    if let Some(draft) = method.draft_model(dir)? {
        let target = Model::load(dir)?;
        let backend = CpuBackend::new(draft, 16, 1);
        o.draft_cost = DraftModelDrafter::new(Box::new(backend), target.config())?.cost_per_token();
    }
    Ok(o)
}

/// The single-stream sweep on one target: each drafter at each fixed `k`
/// and adaptive, every run paired with a plain run just before it (the
/// machine is shared and drifts); the median ratio over `reps` pairs.
fn single_stream(
    label: &str,
    dir: &std::path::Path,
    methods: &[Method],
    ks: &[usize],
    tokens: usize,
    reps: usize,
    prompts: Option<&[Vec<u32>]>,
) -> Result<Vec<Value>> {
    let reference = run(dir, &Method::Plain, fixed(1), 1, tokens, prompts)?;
    let mut rows = Vec::new();
    let max_k = ks.iter().copied().max().unwrap_or(4);
    for method in methods {
        let mut configs: Vec<(String, SpeculativeConfig)> =
            ks.iter().map(|&k| (k.to_string(), fixed(k))).collect();
        configs.push((
            format!("adaptive<={max_k}"),
            SpeculativeConfig {
                adaptive: true,
                ..fixed(max_k)
            },
        ));
        for (k, spec) in configs {
            let (mut ratios, mut plain_tok_s, mut spec_tok_s) =
                (Vec::new(), Vec::new(), Vec::new());
            let mut last = None;
            for _ in 0..reps.max(1) {
                let plain = run(dir, &Method::Plain, fixed(1), 1, tokens, prompts)?;
                let o = run(dir, method, spec.clone(), 1, tokens, prompts)?;
                ratios.push(o.tok_s / plain.tok_s);
                plain_tok_s.push(plain.tok_s);
                spec_tok_s.push(o.tok_s);
                last = Some(o);
            }
            let Some(o) = last else {
                continue;
            };
            let c = o.counts;
            let same = o.tokens == reference.tokens;
            let speedup = median(ratios.clone());
            eprintln!(
                "{label}: single stream, {} k={k}: {:.1} tok/s vs {:.1} plain ({speedup:.2}x), \
                 acceptance {:.2}, mean accepted {:.2}, same tokens {same}",
                method.name(),
                median(spec_tok_s.clone()),
                median(plain_tok_s.clone()),
                c.acceptance_rate(),
                c.mean_accepted_len()
            );
            rows.push(json!({
                "target": label,
                "drafter": method.name(),
                "k": k,
                "draft_cost_per_token": o.draft_cost,
                "tok_s": median(spec_tok_s),
                "plain_tok_s": median(plain_tok_s),
                "speedup": speedup,
                "speedups": ratios,
                "acceptance_rate": c.acceptance_rate(),
                "mean_accepted_len": c.mean_accepted_len(),
                "drafted": c.drafted,
                "accepted": c.accepted,
                "verifications": c.verifications,
                "same_tokens": same,
            }));
        }
    }
    Ok(rows)
}

/// Fixed `k`, no batch limit.
fn fixed(k: usize) -> SpeculativeConfig {
    SpeculativeConfig {
        num_speculative_tokens: k,
        adaptive: false,
        max_batch_rows: usize::MAX,
        ..SpeculativeConfig::default()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The aligned stand-in: the preset's random draws with every layer from
/// `layers` on contributing `damping` times as much to the residual stream,
/// so its first layers decide most of its tokens. Same shapes, same cost.
fn write_aligned(dir: &std::path::Path, layers: usize, damping: f32) -> Result<()> {
    tandem_engine::synth::preset("bench-100m")?.write_scaled(
        dir,
        0,
        tandem_engine::DType::Bf16,
        |name| {
            let late = name
                .strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| i >= layers);
            if late && (name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight")) {
                damping
            } else {
                1.0
            }
        },
    )?;
    Ok(())
}

/// Batch runs, interleaved and repeated (the machine is shared): the
/// median ratio to the plain run of the same repetition.
fn batched(
    label: &str,
    target: &std::path::Path,
    methods: &[Method],
    args: &Args,
    prompts: Option<&[Vec<u32>]>,
) -> Result<Vec<Value>> {
    let variants: Vec<(Method, &str, SpeculativeConfig)> = methods
        .iter()
        .flat_map(|m| {
            [
                (m.clone(), "adaptive", SpeculativeConfig::default()),
                (
                    m.clone(),
                    "forced",
                    SpeculativeConfig {
                        max_batch_rows: usize::MAX,
                        ..SpeculativeConfig::default()
                    },
                ),
            ]
        })
        .collect();
    let mut plain_tok_s = Vec::new();
    let mut ratios = vec![Vec::new(); variants.len()];
    let mut last = vec![None; variants.len()];
    for rep in 0..args.reps {
        for (i, (method, mode, spec)) in variants.iter().enumerate() {
            // Each variant against a plain engine decoding the same batch
            // in the same process, one step each in turn.
            let (plain, o) = decode_interleaved(
                engine(target, &Method::Plain, fixed(1))?,
                engine(target, method, spec.clone())?,
                args.batch,
                args.batch_tokens,
                prompts,
            )?;
            plain_tok_s.push(plain.tok_s);
            eprintln!(
                "{label}: batch {} rep {rep}, {} {mode}: {:.1} tok/s ({:.3}x plain {:.1}), \
                 drafted {}, same tokens {}",
                args.batch,
                method.name(),
                o.tok_s,
                o.tok_s / plain.tok_s,
                plain.tok_s,
                o.counts.drafted,
                o.tokens == plain.tokens
            );
            ratios[i].push(o.tok_s / plain.tok_s);
            last[i] = Some((o.tok_s, o.counts, o.tokens == plain.tokens));
        }
    }
    let mut rows = vec![json!({
        "target": label, "drafter": "plain", "mode": "none",
        "tok_s": median(plain_tok_s), "ratio": 1.0,
    })];
    for (i, (method, mode, _)) in variants.iter().enumerate() {
        let Some((tok_s, counts, same)) = last[i] else {
            continue;
        };
        rows.push(json!({
            "target": label,
            "drafter": method.name(),
            "mode": mode,
            "tok_s_last": tok_s,
            "ratio_median": median(ratios[i].clone()),
            "ratios": ratios[i],
            "drafted": counts.drafted,
            "acceptance_rate": counts.acceptance_rate(),
            "same_tokens": same,
        }));
    }
    Ok(rows)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let model = tandem_bench::BenchModel::given_or_generated(args.model.as_deref(), "bench-100m")?;
    let label = if args.model.is_some() {
        "given"
    } else {
        "random"
    };
    let mut methods = vec![Method::Ngram];
    methods.extend(args.draft_layers.iter().map(|&l| Method::EarlyExit(l)));
    if let Some(d) = &args.draft_model {
        methods.push(Method::Draft(d.clone()));
    }
    let l = args.aligned_layers;
    let aligned = tempfile::tempdir()?;
    let mut targets: Vec<(&str, &std::path::Path, Vec<Method>)> =
        vec![(label, model.dir.as_path(), methods)];
    if !args.no_aligned {
        write_aligned(aligned.path(), l, args.aligned_damping as f32)?;
        targets.push((
            "aligned",
            aligned.path(),
            vec![Method::Ngram, Method::EarlyExit(l)],
        ));
    }
    // Text prompts are for the given model; the aligned stand-in has no
    // tokenizer worth the name.
    let prompts = match &args.prompts {
        Some(f) => Some(text_prompts(f, &model.dir)?),
        None => None,
    };
    let prompts_for = |label: &str| prompts.as_deref().filter(|_| label != "aligned");
    let mut single = Vec::new();
    for (label, dir, methods) in targets.iter().filter(|_| !args.batch_only) {
        single.extend(single_stream(
            label,
            dir,
            methods,
            &args.ks,
            args.tokens,
            args.reps,
            prompts_for(label),
        )?);
    }
    // The batch runs: prompt lookup and the cheapest model drafter (the
    // first `--draft-layers`, and `--draft-model`).
    let mut batch_rows = Vec::new();
    let cheapest = args.draft_layers.first().copied();
    for (label, dir, methods) in &targets {
        let pick: Vec<Method> = methods
            .iter()
            .filter(|m| match m {
                Method::EarlyExit(x) => *label == "aligned" || Some(*x) == cheapest,
                _ => true,
            })
            .cloned()
            .collect();
        batch_rows.extend(batched(label, dir, &pick, &args, prompts_for(label))?);
    }

    let report: Value = json!({
        "bench": "speculative",
        "model": model.dir.display().to_string(),
        "draft_model": args.draft_model.as_ref().map(|d| d.display().to_string()),
        "threads": rayon_threads(),
        "tokens": args.tokens,
        "aligned": (!args.no_aligned).then(|| json!({"layers": l, "damping": args.aligned_damping})),
        "single_stream": single,
        "batch": args.batch,
        "batch_tokens": args.batch_tokens,
        "reps": args.reps,
        "batched": batch_rows,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = args.out {
        std::fs::write(path, text)?;
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}
