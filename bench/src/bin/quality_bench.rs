//! Quantization quality against transformers on the same weights:
//! perplexity, teacher-forced top-1 agreement and factual answers, for
//! every precision mode the CPU engine has.
//!
//! ```text
//! cargo run --release -p tandem-bench --bin quality-bench -- \
//!     --model target/smollm2-135m --reference bench/quality/smollm2-135m.json \
//!     --out bench/results/quality-smollm2.json
//! ```
//!
//! The reference (`bench/quality/make_reference.py`) holds the token ids of
//! each held-out window, transformers' f32 top-1 token and log-probability
//! of the true next token at every position, and the question set as
//! chat-formatted token ids with the fact each answer contains. Every mode
//! scores the same windows through a cache of its KV dtype, fed
//! `--chunk` tokens per step (32 by default: each matmul takes the decode
//! path, and every later chunk reads the earlier ones back from the cache,
//! as serving does; `quant::eval::score_with`). The report gives per mode:
//!
//! - perplexity, and its change against the f32 mode (the acceptance
//!   number) and against transformers' own;
//! - top-1 agreement with transformers and the mean |Δ log p| of the true
//!   next token;
//! - each question's greedy answer, and whether it still states the fact.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_engine::kernels::{log_softmax, MatmulPolicy};
use tandem_engine::quant::eval::score_with;
use tandem_engine::quant::{ActivationCodes, Int4Config};
use tandem_engine::sampling::argmax;
use tandem_engine::{
    generate, GenerateOptions, GenerateRequest, KvCacheDtype, Model, SamplingParams,
};

#[derive(Parser, Debug)]
#[command(about = "Perplexity and answers of every precision mode against transformers (JSON)")]
struct Args {
    /// Checkpoint directory (the weights the reference was made from).
    #[arg(long)]
    model: PathBuf,
    /// The reference JSON (`bench/quality/make_reference.py`).
    #[arg(long)]
    reference: PathBuf,
    /// Modes to run, comma-separated (default: all). Names: f32, bf16-kv,
    /// f16-kv, int8-kv, fp8-kv, bf16-act, int4-g32, int4-g32-int8-act,
    /// int4-g64, int4-g128 (INT4 modes code activations in two passes unless
    /// named `-int8-act`; `bf16-act` rounds activations to bf16 at bf16
    /// weights, `MatmulPolicy::Bf16Activations`).
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Tokens per forward step while scoring.
    #[arg(long, default_value_t = 32)]
    chunk: usize,
    /// Use only the first N windows (default: all).
    #[arg(long)]
    windows: Option<usize>,
    /// Greedy tokens per answer.
    #[arg(long, default_value_t = 40)]
    answer_tokens: usize,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// A GGUF model's quantized blocks decoded to f16 (dense kernels)
    /// rather than run as stored.
    #[arg(long)]
    decode_gguf_blocks: bool,
}

/// A precision mode: the KV cache's dtype and, for INT4, the group size and
/// how the decode kernels code activations.
#[derive(Debug, Clone, Copy)]
struct Mode {
    name: &'static str,
    kv: KvCacheDtype,
    int4: Option<(usize, ActivationCodes)>,
    /// How the linears run (bf16 activations or the default).
    matmul: MatmulPolicy,
    /// The acceptance bound on the perplexity change against f32, percent.
    bound_pct: Option<f64>,
}

const TWO_PASS: ActivationCodes = ActivationCodes::TwoPass;

const MODES: [Mode; 10] = [
    mode("f32", KvCacheDtype::F32, None, None),
    mode("bf16-kv", KvCacheDtype::Bf16, None, Some(0.1)),
    mode("f16-kv", KvCacheDtype::F16, None, Some(0.1)),
    mode("int8-kv", KvCacheDtype::Int8, None, Some(1.0)),
    mode("fp8-kv", KvCacheDtype::Fp8E4m3, None, Some(3.0)),
    Mode {
        matmul: MatmulPolicy::Bf16Activations,
        ..mode("bf16-act", KvCacheDtype::F32, None, Some(1.0))
    },
    mode(
        "int4-g32",
        KvCacheDtype::F32,
        Some((32, TWO_PASS)),
        Some(3.0),
    ),
    mode(
        "int4-g32-int8-act",
        KvCacheDtype::F32,
        Some((32, ActivationCodes::Int8)),
        Some(3.0),
    ),
    mode("int4-g64", KvCacheDtype::F32, Some((64, TWO_PASS)), None),
    mode("int4-g128", KvCacheDtype::F32, Some((128, TWO_PASS)), None),
];

const fn mode(
    name: &'static str,
    kv: KvCacheDtype,
    int4: Option<(usize, ActivationCodes)>,
    bound_pct: Option<f64>,
) -> Mode {
    Mode {
        name,
        kv,
        int4,
        matmul: MatmulPolicy::Fastest,
        bound_pct,
    }
}

/// One held-out window of the reference.
struct Window {
    tokens: Vec<u32>,
    top1: Vec<u32>,
    target_logprob: Vec<f32>,
}

/// One question of the reference.
struct Question {
    question: String,
    fact: String,
    prompt: Vec<u32>,
    answer_tokens: Vec<u32>,
}

struct Reference {
    perplexity: f64,
    eos: Option<u32>,
    windows: Vec<Window>,
    questions: Vec<Question>,
}

fn ids(v: &Value, field: &str) -> Result<Vec<u32>> {
    v[field]
        .as_array()
        .with_context(|| format!("reference: `{field}` is not an array"))?
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .with_context(|| format!("reference: `{field}` holds {x}, not a token id"))
        })
        .collect()
}

fn load_reference(path: &Path, limit: Option<usize>) -> Result<Reference> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let doc: Value = serde_json::from_str(&text).context("reference JSON")?;
    let mut windows = Vec::new();
    for w in doc["windows"]
        .as_array()
        .context("reference: no `windows`")?
    {
        let tokens = ids(w, "tokens")?;
        let top1 = ids(w, "top1")?;
        let target_logprob = w["target_logprob"]
            .as_array()
            .context("reference: no `target_logprob`")?
            .iter()
            .map(|x| x.as_f64().map(|x| x as f32).context("target_logprob"))
            .collect::<Result<Vec<_>>>()?;
        if top1.len() + 1 != tokens.len() || target_logprob.len() + 1 != tokens.len() {
            bail!("reference: a window's top1/target_logprob do not match its tokens");
        }
        windows.push(Window {
            tokens,
            top1,
            target_logprob,
        });
    }
    windows.truncate(limit.unwrap_or(usize::MAX));
    let mut questions = Vec::new();
    for q in doc["questions"].as_array().into_iter().flatten() {
        questions.push(Question {
            question: q["question"].as_str().unwrap_or_default().to_string(),
            fact: q["fact"]
                .as_str()
                .context("question without `fact`")?
                .to_string(),
            prompt: ids(q, "prompt")?,
            answer_tokens: ids(q, "answer_tokens")?,
        });
    }
    Ok(Reference {
        perplexity: doc["perplexity"]
            .as_f64()
            .context("reference: no `perplexity`")?,
        eos: doc["eos_token_id"].as_u64().map(|e| e as u32),
        windows,
        questions,
    })
}

/// Perplexity and agreement of one mode over the reference's windows.
#[derive(Debug, Default)]
struct Scores {
    positions: usize,
    nll_sum: f64,
    top1_agree: usize,
    abs_dlogprob_sum: f64,
}

fn score_windows(model: &Model, m: Mode, chunk: usize, windows: &[Window]) -> Result<Scores> {
    let vocab = model.config().vocab_size;
    let mut s = Scores::default();
    for w in windows {
        let logits = score_with(model, &w.tokens, m.kv, chunk)?;
        for (t, row) in logits
            .chunks_exact(vocab)
            .take(w.tokens.len() - 1)
            .enumerate()
        {
            let mut lp = row.to_vec();
            log_softmax(&mut lp);
            let next = w.tokens[t + 1] as usize;
            s.positions += 1;
            s.nll_sum -= f64::from(lp[next]);
            s.top1_agree += usize::from(argmax(&lp) == w.top1[t]);
            s.abs_dlogprob_sum += f64::from((lp[next] - w.target_logprob[t]).abs());
        }
    }
    Ok(s)
}

/// Greedy answer token ids through a cache of the mode's dtype, up to the
/// EOS (not included).
fn answer(
    model: &Model,
    m: Mode,
    prompt: &[u32],
    steps: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    let req = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens: steps,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: false,
    };
    let opts = GenerateOptions {
        kv_dtype: m.kv,
        ..GenerateOptions::default()
    };
    let eos: Vec<u32> = eos.into_iter().collect();
    let mut out = generate(model, &eos, &req, opts, |_| Ok(()))?.output_ids;
    if out.last().is_some_and(|t| eos.contains(t)) {
        out.pop();
    }
    Ok(out)
}

fn load_mode(dir: &Path, m: Mode, decode_blocks: bool) -> Result<Model> {
    let mut model = Model::load(dir)?;
    if decode_blocks {
        model.decode_gguf_blocks();
    }
    if !m.matmul.runs_here() {
        bail!("mode {}: this CPU cannot run {:?}", m.name, m.matmul);
    }
    model.set_matmul_policy(m.matmul);
    if let Some((g, activations)) = m.int4 {
        model.quantize_int4(Int4Config::new(g)?.with_activations(activations))?;
    }
    Ok(model)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let reference = load_reference(&args.reference, args.windows)?;
    let modes: Vec<Mode> = if args.modes.is_empty() {
        let (runnable, skipped): (Vec<Mode>, Vec<Mode>) =
            MODES.into_iter().partition(|m| m.matmul.runs_here());
        for m in skipped {
            eprintln!("skipping {}: this CPU cannot run {:?}", m.name, m.matmul);
        }
        runnable
    } else {
        args.modes
            .iter()
            .map(|n| {
                MODES
                    .iter()
                    .find(|m| m.name == n)
                    .copied()
                    .with_context(|| format!("--modes: unknown mode `{n}`"))
            })
            .collect::<Result<_>>()?
    };
    // The tokenizer alone (a directory's, or a GGUF file's own vocabulary):
    // each mode loads its own model.
    let tokenizer = tandem_engine::checkpoint::tokenizer_of(&args.model)?;
    let mut rows = Vec::new();
    let mut f32_ppl = None;
    for m in modes {
        let t0 = Instant::now();
        let model = load_mode(&args.model, m, args.decode_gguf_blocks)?;
        let s = score_windows(&model, m, args.chunk, &reference.windows)?;
        let n = s.positions.max(1) as f64;
        let ppl = (s.nll_sum / n).exp();
        if m.name == "f32" {
            f32_ppl = Some(ppl);
        }
        let change = f32_ppl.map(|base| 100.0 * (ppl / base - 1.0));
        let mut answers = Vec::new();
        let (mut kept, mut exact) = (0, 0);
        for q in &reference.questions {
            let got = answer(&model, m, &q.prompt, args.answer_tokens, reference.eos)?;
            let text = match &tokenizer {
                Some(t) => t.decode(&got)?,
                None => format!("{got:?}"),
            };
            let has_fact = text.to_lowercase().contains(&q.fact.to_lowercase());
            kept += usize::from(has_fact);
            // transformers' output ends with the EOS it stopped at.
            let want: Vec<u32> = q
                .answer_tokens
                .iter()
                .copied()
                .filter(|&t| Some(t) != reference.eos)
                .collect();
            exact += usize::from(got == want);
            answers.push(
                json!({"question": q.question, "fact": q.fact, "kept": has_fact, "answer": text}),
            );
        }
        let row = json!({
            "mode": m.name,
            "kv_dtype": m.kv.name(),
            "matmul": format!("{:?}", m.matmul),
            "int4_group": m.int4.map(|(g, _)| g),
            "int4_activations": m.int4.map(|(_, a)| a.name()),
            "perplexity": ppl,
            "ppl_change_vs_f32_pct": change,
            "ppl_vs_transformers_pct": 100.0 * (ppl / reference.perplexity - 1.0),
            "top1_vs_transformers": s.top1_agree as f64 / n,
            "mean_abs_dlogprob": s.abs_dlogprob_sum / n,
            "questions_kept": kept,
            "questions": reference.questions.len(),
            "answers_token_exact": exact,
            "bound_pct": m.bound_pct,
            "within_bound": m.bound_pct.zip(change).map(|(b, c)| c <= b),
            "seconds": t0.elapsed().as_secs_f64(),
            "answers": answers,
        });
        eprintln!(
            "{:10} ppl {ppl:9.4} ({:+.3}% vs f32)  top1 {:.4}  |dlogp| {:.4}  answers {kept}/{} ({exact} token-exact)  {:.0}s",
            m.name,
            change.unwrap_or(f64::NAN),
            s.top1_agree as f64 / n,
            s.abs_dlogprob_sum / n,
            reference.questions.len(),
            t0.elapsed().as_secs_f64()
        );
        rows.push(row);
    }
    let report = json!({
        "bench": "quality-bench",
        "model": args.model.display().to_string(),
        "reference": args.reference.display().to_string(),
        "transformers_perplexity": reference.perplexity,
        "windows": reference.windows.len(),
        "positions": reference.windows.iter().map(|w| w.tokens.len() - 1).sum::<usize>(),
        "chunk": args.chunk,
        "threads": rayon::current_num_threads(),
        "modes": rows,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
