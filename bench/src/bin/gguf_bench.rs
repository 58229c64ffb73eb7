//! A GGUF file side by side with llama.cpp (built from the llama-cpp-python
//! sdist) on the same file and cores: how often tandem's greedy choice is
//! llama.cpp's, and batch-1 decode speed, for each way tandem can run the
//! file: its blocks as stored (the default, `kernels::ggml`), decoded to
//! f16 (`Model::decode_gguf_blocks`), and re-quantized to INT4 g32
//! (`--quantize int4`).
//!
//! ```text
//! cargo run --release -p tandem-bench --bin gguf-bench -- \
//!     --model SmolLM2-135M-Instruct.Q4_1.gguf --llama-cpp $LLAMA/build/bin \
//!     --out bench/results/gguf-smollm2-q4_1.json
//! ```
//!
//! Agreement: llama.cpp continues each prompt greedily (`llama-simple`, 64
//! tokens); its text is tokenized by llama.cpp (`llama-tokenize`) and
//! teacher-forced through tandem, 32 tokens a step (the decode path's
//! kernels); a position agrees when tandem's argmax is llama.cpp's next
//! token. Speed: rounds alternate `llama-bench -n 128`
//! (generation from an empty context, llama.cpp's `tg128`) with tandem's
//! decode steps at 64 tokens of context (`tandem_bench::decode_tok_s`);
//! medians.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use tandem_engine::quant::eval::score_with;
use tandem_engine::quant::Int4Config;
use tandem_engine::{Checkpoint, KvCacheDtype};

#[derive(Parser, Debug)]
#[command(about = "A GGUF file against llama.cpp: greedy agreement and decode speed (JSON)")]
struct Args {
    #[arg(long)]
    model: PathBuf,
    /// llama.cpp's `build/bin` (llama-simple, llama-tokenize, llama-bench).
    #[arg(long)]
    llama_cpp: PathBuf,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Speed rounds (each runs llama.cpp and both tandem modes).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 2)]
    threads: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Here is a recipe for pancakes:",
    "The most important invention of the 20th century was",
];

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// llama.cpp's token ids of `text` (its own BOS rule).
fn llama_tokenize(bin: &Path, model: &Path, text: &str) -> Result<Vec<u32>> {
    let out = run(Command::new(bin.join("llama-tokenize"))
        .args(["-m"])
        .arg(model)
        .args(["--ids", "--log-disable", "-p", text]))?;
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .context("no ids printed")?;
    Ok(serde_json::from_str(line)?)
}

/// (prompt length, prompt + llama.cpp's greedy continuation) per prompt.
fn llama_continuations(a: &Args) -> Result<Vec<(usize, Vec<u32>)>> {
    let mut out = Vec::new();
    for p in PROMPTS {
        let text = run(Command::new(a.llama_cpp.join("llama-simple"))
            .arg("-m")
            .arg(&a.model)
            .args(["-n", &a.tokens.to_string(), p]))?;
        let prompt = llama_tokenize(&a.llama_cpp, &a.model, p)?;
        let all = llama_tokenize(&a.llama_cpp, &a.model, &text)?;
        if !all.starts_with(&prompt) {
            eprintln!("skipping {p:?}: the continuation re-tokenizes across the prompt's end");
            continue;
        }
        out.push((prompt.len(), all));
    }
    Ok(out)
}

/// Share of continuation positions where the model's argmax is the next
/// token of `seq`.
/// Tokens per teacher-forced step: within the row kernels' batch sizes.
const SCORE_CHUNK: usize = 32;

fn agreement(ckpt: &Checkpoint, seqs: &[(usize, Vec<u32>)]) -> Result<(f64, usize)> {
    let vocab = ckpt.model.config().vocab_size;
    let (mut agree, mut total) = (0usize, 0usize);
    for (prompt_len, seq) in seqs {
        // Fed 32 tokens a step, so every matmul takes the path decode steps
        // take (the row kernels: int8 activations for blocks and INT4).
        let logits = score_with(&ckpt.model, seq, KvCacheDtype::F32, SCORE_CHUNK)?;
        for i in *prompt_len..seq.len() {
            let row = &logits[(i - 1) * vocab..i * vocab];
            let top = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(t, _)| t);
            agree += usize::from(top == Some(seq[i] as usize));
            total += 1;
        }
    }
    Ok((agree as f64 / total.max(1) as f64, total))
}

/// Batch-1 decode tokens/s at 64 tokens of context (the middle of
/// llama.cpp's `tg128`), each step on a pool thread as the serving engine
/// runs it.
fn tandem_decode(ckpt: &Checkpoint) -> Result<f64> {
    rayon::scope(|_| tandem_bench::decode_tok_s(&ckpt.model, &[], 1, 64, 32))
}

fn llama_decode(a: &Args) -> Result<f64> {
    let out = run(Command::new(a.llama_cpp.join("llama-bench"))
        .arg("-m")
        .arg(&a.model)
        .args([
            "-t",
            &a.threads.to_string(),
            "-p",
            "0",
            "-n",
            "128",
            "-r",
            "1",
            "-o",
            "json",
        ]))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v[0]["avg_ts"]
        .as_f64()
        .context("llama-bench printed no avg_ts")
}

fn main() -> Result<()> {
    let a = Args::parse();
    let seqs = llama_continuations(&a)?;
    let blocks = Checkpoint::open(&a.model)?;
    anyhow::ensure!(
        blocks.model.gguf_block_matrices() > 0,
        "{} holds no block-quantized linear layers",
        a.model.display()
    );
    let mut dense = Checkpoint::open(&a.model)?;
    dense.model.decode_gguf_blocks();
    let mut int4 = Checkpoint::open(&a.model)?;
    int4.model.quantize_int4(Int4Config::default())?;
    let (blocks_agree, positions) = agreement(&blocks, &seqs)?;
    let (dense_agree, _) = agreement(&dense, &seqs)?;
    let (int4_agree, _) = agreement(&int4, &seqs)?;
    let (mut llama, mut b, mut f16, mut q) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.rounds {
        llama.push(llama_decode(&a)?);
        b.push(tandem_decode(&blocks)?);
        f16.push(tandem_decode(&dense)?);
        q.push(tandem_decode(&int4)?);
    }
    use tandem_bench::median;
    let (llama, b, f16, q) = (median(&llama), median(&b), median(&f16), median(&q));
    let report = json!({
        "model": a.model.display().to_string(),
        "threads": a.threads,
        "prompts": seqs.len(),
        "agreement_positions": positions,
        "greedy_agreement_with_llama_cpp": {"blocks": blocks_agree, "f16": dense_agree, "int4_g32": int4_agree},
        "decode_batch1_tok_s": {"llama_cpp_tg128": llama, "blocks": b, "f16": f16, "int4_g32": q},
        "decode_vs_llama_cpp": {"blocks": b / llama, "f16": f16 / llama, "int4_g32": q / llama},
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = &a.out {
        std::fs::write(p, text + "\n")?;
    }
    Ok(())
}
