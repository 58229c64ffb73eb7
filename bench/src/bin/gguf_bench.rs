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
//! Agreement: llama.cpp continues each prompt greedily (64 tokens, by
//! `bench/llama/greedy_ids.cpp`, compiled here against the given build:
//! it prints the token ids llama.cpp generated, which re-tokenizing its
//! text does not always give back) and the ids are teacher-forced through
//! tandem, 32 tokens a step (the decode path's kernels); a position agrees
//! when tandem's argmax is llama.cpp's next token. tandem's KV cache is
//! f16 for it, llama.cpp's default. Speed: rounds alternate `llama-bench -n 128`
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
    /// llama.cpp's `build/bin` (`libllama.so`, `llama-bench`; its headers
    /// two levels up).
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

/// Compiles `bench/llama/greedy_ids.cpp` against the llama.cpp whose
/// `build/bin` is `bin` (its headers two levels up, as a CMake build of
/// the sdist lays them out).
fn build_greedy_ids(bin: &Path) -> Result<PathBuf> {
    let root = bin.join("../..");
    let include = root.join("include");
    anyhow::ensure!(
        include.join("llama.h").is_file(),
        "no llama.h under {} (--llama-cpp should be llama.cpp's build/bin)",
        include.display()
    );
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("llama/greedy_ids.cpp");
    let exe = std::env::temp_dir().join(format!("tandem-greedy-ids-{}", std::process::id()));
    let bin = bin.canonicalize()?;
    run(Command::new("c++")
        .args(["-O2", "-std=c++17"])
        .arg(format!("-I{}", include.display()))
        .arg(format!("-I{}", root.join("ggml/include").display()))
        .arg(&source)
        .arg(format!("-L{}", bin.display()))
        .arg("-lllama")
        .arg(format!("-Wl,-rpath,{}", bin.display()))
        .arg("-o")
        .arg(&exe))?;
    Ok(exe)
}

/// (prompt length, prompt + llama.cpp's greedy continuation) per prompt,
/// as the token ids llama.cpp generated.
fn llama_continuations(a: &Args) -> Result<Vec<(usize, Vec<u32>)>> {
    let exe = build_greedy_ids(&a.llama_cpp)?;
    let mut out = Vec::new();
    for p in PROMPTS {
        let printed = run(Command::new(&exe)
            .arg(&a.model)
            .arg(a.tokens.to_string())
            .arg(p))?;
        let mut lines = printed.lines().map(serde_json::from_str::<Vec<u32>>);
        let (Some(prompt), Some(continuation)) = (lines.next(), lines.next()) else {
            bail!("greedy_ids printed {printed:?}");
        };
        let (prompt, continuation) = (prompt?, continuation?);
        out.push((prompt.len(), [prompt, continuation].concat()));
    }
    std::fs::remove_file(&exe).ok();
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
        // take (the row kernels: int8 activations for blocks and INT4); keys
        // and values kept in f16, as llama.cpp's default cache keeps them.
        let logits = score_with(&ckpt.model, seq, KvCacheDtype::F16, SCORE_CHUNK)?;
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
