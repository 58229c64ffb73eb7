//! tandem's CPU engine side by side with llama.cpp on the same checkpoint,
//! cores and threads: prefill of 512 tokens, decode at batch 1, 8 and 32.
//!
//! ```text
//! pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/dl
//! cargo build --release -p tandem-bench --bin peer-bench --bin engine-bench
//! target/release/peer-bench --sdist /tmp/dl/llama_cpp_python-0.3.36.tar.gz \
//!     --python /tmp/qv/bin/python --preset bench-100m --out bench/results/peer-bench-100m.json
//! ```
//!
//! * **llama.cpp** is built once from the llama-cpp-python sdist into
//!   `target/peer-bench/` (`llama-bench`, `llama-batched-bench`; AMX on
//!   where tandem's check finds the tiles usable, since some VMs report
//!   them but do not enable them), or taken from `--llama-cpp BUILD/bin`.
//! * **The checkpoint** (`--model DIR`, or a synth `--preset` written in
//!   bf16 under `target/peer-bench/models/`) is converted to f16 and bf16
//!   GGUF by llama.cpp's own `convert_hf_to_gguf.py`
//!   (`bench/llama/convert.py`; `--python` needs torch, numpy,
//!   sentencepiece and protobuf).
//! * **Rounds alternate** the engines on the same cores: `llama-bench -p 512
//!   -n 128` on both files (`pp512`, `tg128`), `llama-batched-bench -npp 128
//!   -ntg 64 -npl 1,8,32` on both (decode from 128 tokens of context), then
//!   tandem's `engine-bench --prompt-len 512 --decode-context 128 --batches
//!   1,8,32 --kv-dtype bf16` in its own process (bf16 KV, what `tandem
//!   serve` keeps for a bf16 checkpoint, as llama.cpp keeps f16; runs before
//!   2026-12-07 used f32). Medians over rounds.
//! * **Ratios** are tandem over llama.cpp's best of its f16 and bf16 files
//!   (prefill and batched decode), and over bf16 for batch 1 (`tg128`), as
//!   issue 29 states its targets; tandem's batch-1 roofline fraction comes
//!   from engine-bench.
//! * **Two tandems** where the CPU has AVX512-BF16: the default (f32
//!   activations) and `--bf16-activations` (activations rounded to bf16 at
//!   bf16 weights, as llama.cpp's bf16 file runs them), each with its own
//!   ratios (`ratios`, `ratios_bf16_activations`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_bench::median;
use tandem_engine::kernels::MatmulPolicy;

#[derive(Parser, Debug)]
#[command(about = "tandem against llama.cpp: prefill 512, decode batch 1/8/32 (JSON)")]
struct Args {
    /// A llama.cpp build's `bin` directory (with `llama-bench` and
    /// `llama-batched-bench`); else built from `--sdist`.
    #[arg(long, conflicts_with = "sdist")]
    llama_cpp: Option<PathBuf>,
    /// The llama-cpp-python sdist (`.tar.gz`) to build llama.cpp from.
    #[arg(long)]
    sdist: Option<PathBuf>,
    /// Python with torch, numpy, sentencepiece and protobuf, for llama.cpp's converter.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// Checkpoint directory (bf16 or f16 safetensors).
    #[arg(long, conflicts_with = "preset")]
    model: Option<PathBuf>,
    /// A synth preset to generate in bf16 instead (`bench-100m`,
    /// `bench-smol`).
    #[arg(long, default_value = "bench-100m")]
    preset: String,
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The engine-bench binary (default: beside this one).
    #[arg(long)]
    engine_bench: Option<PathBuf>,
    /// Work directory for the build, models and GGUF files.
    #[arg(long, default_value = "target/peer-bench")]
    work: PathBuf,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Decode batch sizes compared.
const BATCHES: [usize; 3] = [1, 8, 32];

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// llama.cpp's `build/bin`, built from the sdist unless it already is.
fn llama_bin(args: &Args) -> Result<PathBuf> {
    if let Some(dir) = &args.llama_cpp {
        return Ok(dir.clone());
    }
    let sdist = args.sdist.as_ref().ok_or_else(|| {
        anyhow!("give --llama-cpp BUILD/bin or --sdist llama_cpp_python-*.tar.gz")
    })?;
    let stem = sdist
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".tar.gz"))
        .ok_or_else(|| anyhow!("{} is not a .tar.gz", sdist.display()))?;
    let src = args.work.join(stem).join("vendor/llama.cpp");
    let bin = src.join("build/bin");
    if bin.join("llama-bench").is_file() && bin.join("llama-batched-bench").is_file() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&args.work)?;
    if !src.is_dir() {
        eprintln!("unpacking {}", sdist.display());
        run(Command::new("tar")
            .arg("xzf")
            .arg(sdist)
            .arg("-C")
            .arg(&args.work))?;
    }
    eprintln!("building llama.cpp in {} (minutes)", src.display());
    let build = src.join("build");
    // Explicit x86 flags (`x86_flags`) rather than GGML_NATIVE: some VMs report AMX
    // without enabling it, and native builds die on its first tile load.
    // AMX is on where tandem's own check finds the tiles usable (the CPU
    // has them and Linux grants them), so both engines get the same
    // hardware.
    let amx = if tandem_engine::kernels::amx::available() {
        "ON"
    } else {
        "OFF"
    };
    eprintln!("llama.cpp's AMX kernels: {amx}");
    run(Command::new("cmake")
        .arg("-S")
        .arg(&src)
        .arg("-B")
        .arg(&build)
        .args([
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=OFF",
        ])
        .args(x86_flags())
        .arg(format!("-DGGML_AMX_TILE={amx}"))
        .arg(format!("-DGGML_AMX_INT8={amx}"))
        .arg(format!("-DGGML_AMX_BF16={amx}")))?;
    run(Command::new("cmake").arg("--build").arg(&build).args([
        "-j",
        "2",
        "--target",
        "llama-bench",
        "llama-batched-bench",
    ]))?;
    Ok(bin)
}

/// llama.cpp's instruction-set switches, each on where this CPU has the
/// extension: a switch the CPU lacks builds code that dies on its first
/// such instruction (AMD Zen 4 has AVX-512 VNNI but not AVX-VNNI).
fn x86_flags() -> Vec<String> {
    #[cfg(target_arch = "x86_64")]
    let has = |feature: &str| match feature {
        "AVX2" => std::arch::is_x86_feature_detected!("avx2"),
        "FMA" => std::arch::is_x86_feature_detected!("fma"),
        "F16C" => std::arch::is_x86_feature_detected!("f16c"),
        "AVX512" => std::arch::is_x86_feature_detected!("avx512f"),
        "AVX512_VBMI" => std::arch::is_x86_feature_detected!("avx512vbmi"),
        "AVX512_VNNI" => std::arch::is_x86_feature_detected!("avx512vnni"),
        "AVX512_BF16" => std::arch::is_x86_feature_detected!("avx512bf16"),
        "AVX_VNNI" => std::arch::is_x86_feature_detected!("avxvnni"),
        _ => false,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let has = |_: &str| false;
    [
        "AVX2",
        "FMA",
        "F16C",
        "AVX512",
        "AVX512_VBMI",
        "AVX512_VNNI",
        "AVX512_BF16",
        "AVX_VNNI",
    ]
    .iter()
    .map(|f| format!("-DGGML_{f}={}", if has(f) { "ON" } else { "OFF" }))
    .collect()
}

/// The checkpoint: the given one, or the preset generated once.
fn checkpoint(args: &Args) -> Result<PathBuf> {
    if let Some(dir) = &args.model {
        return Ok(dir.clone());
    }
    let dir = args.work.join("models").join(&args.preset);
    if !dir.join("config.json").is_file() {
        eprintln!("generating {} (bf16) in {}", args.preset, dir.display());
        tandem_engine::synth::preset(&args.preset)?.write(&dir, 0, tandem_engine::DType::Bf16)?;
    }
    Ok(dir)
}

/// The checkpoint as a GGUF of `outtype`, converted once.
fn gguf(args: &Args, llama_src: &Path, model: &Path, outtype: &str) -> Result<PathBuf> {
    let name = model
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("model");
    let out = args
        .work
        .join("gguf")
        .join(format!("{name}-{outtype}.gguf"));
    if out.is_file() {
        return Ok(out);
    }
    std::fs::create_dir_all(out.parent().unwrap_or(Path::new(".")))?;
    eprintln!("converting {} to {outtype}", model.display());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("llama/convert.py");
    run(Command::new(&args.python)
        .arg(script)
        .arg(llama_src)
        .arg(model)
        .arg(outtype)
        .arg(&out))?;
    Ok(out)
}

/// One round of llama.cpp on one file: pp512 and tg128 from llama-bench,
/// decode speed per batch from llama-batched-bench.
fn llama_round(bin: &Path, file: &Path, threads: usize) -> Result<(f64, f64, Vec<f64>)> {
    let t = threads.to_string();
    let text = run(Command::new(bin.join("llama-bench"))
        .arg("-m")
        .arg(file)
        .args(["-p", "512", "-n", "128", "-t", &t, "-r", "1", "-o", "json"]))?;
    let rows: Vec<Value> = serde_json::from_str(&text).context("llama-bench's JSON")?;
    let speed = |prompt: u64, gen: u64| {
        rows.iter()
            .find(|r| r["n_prompt"] == prompt && r["n_gen"] == gen)
            .and_then(|r| r["avg_ts"].as_f64())
            .ok_or_else(|| anyhow!("llama-bench printed no pp{prompt}/tg{gen} row"))
    };
    let (pp, tg) = (speed(512, 0)?, speed(0, 128)?);
    let npl = BATCHES.map(|b| b.to_string()).join(",");
    let text = run(Command::new(bin.join("llama-batched-bench"))
        .arg("-m")
        .arg(file)
        .args([
            "-c", "8192", "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "64",
        ])
        .args(["-npl", &npl, "-t", &t, "--output-format", "jsonl"]))?;
    let lines: Vec<Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let batched = BATCHES
        .iter()
        .map(|&b| {
            lines
                .iter()
                .find(|l| l["pl"] == b as u64)
                .and_then(|l| l["speed_tg"].as_f64())
                .ok_or_else(|| anyhow!("llama-batched-bench printed no pl={b} line"))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((pp, tg, batched))
}

/// One round of tandem: prefill tok/s, decode tok/s per batch and the
/// batch-1 roofline fraction, from engine-bench's JSON.
fn tandem_round(
    exe: &Path,
    model: &Path,
    threads: usize,
    flags: &[&str],
) -> Result<(f64, Vec<f64>, f64)> {
    let batches = BATCHES.map(|b| b.to_string()).join(",");
    let text = run(Command::new(exe)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .arg("--model")
        .arg(model)
        .args(["--prompt-len", "512", "--decode-context", "128"])
        .args(["--batches", &batches])
        // What `tandem serve` keeps for a bf16 checkpoint (`--kv-dtype
        // auto`), as llama.cpp keeps f16.
        .args(["--kv-dtype", "bf16"])
        .args(flags))?;
    let report: Value = serde_json::from_str(&text).context("engine-bench's JSON")?;
    let prefill = report["prefill"]["tok_s"]
        .as_f64()
        .ok_or_else(|| anyhow!("engine-bench printed no prefill"))?;
    let decode = report["decode"]
        .as_array()
        .ok_or_else(|| anyhow!("engine-bench printed no decode"))?;
    let tok_s = decode
        .iter()
        .map(|d| d["tok_s"].as_f64().ok_or_else(|| anyhow!("no tok_s")))
        .collect::<Result<Vec<_>>>()?;
    let roofline = decode[0]["roofline_fraction"].as_f64().unwrap_or(0.0);
    Ok((prefill, tok_s, roofline))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bin = llama_bin(&args)?;
    let src = bin
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| anyhow!("{} is not BUILD/bin", bin.display()))?
        .to_path_buf();
    let model = checkpoint(&args)?;
    let files = ["f16", "bf16"]
        .map(|t| gguf(&args, &src, &model, t).map(|f| (t, f)))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let engine_bench = match &args.engine_bench {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("engine-bench"),
    };
    let mut tandems: Vec<(&str, &[&str])> = vec![("tandem", &[])];
    if MatmulPolicy::Bf16Activations.runs_here() {
        tandems.push(("tandem_bf16act", &["--bf16-activations"]));
    }
    // metric name → one value per round.
    let mut samples: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut push = |k: String, v: f64| samples.entry(k).or_default().push(v);
    for round in 0..args.rounds {
        for (ty, file) in &files {
            let (pp, tg, batched) = llama_round(&bin, file, args.threads)?;
            eprintln!("round {round}: llama.cpp {ty}: pp512 {pp:.1}, tg128 {tg:.1}, batched {batched:.1?} tok/s");
            push(format!("llama_{ty}_prefill"), pp);
            push(format!("llama_{ty}_tg128"), tg);
            for (b, v) in BATCHES.iter().zip(batched) {
                push(format!("llama_{ty}_decode_b{b}"), v);
            }
        }
        for (name, flags) in &tandems {
            let (prefill, decode, roofline) =
                tandem_round(&engine_bench, &model, args.threads, flags)?;
            eprintln!("round {round}: {name}: prefill {prefill:.1}, decode {decode:.1?} tok/s, batch-1 roofline {:.0}%", roofline * 100.0);
            push(format!("{name}_prefill"), prefill);
            push(format!("{name}_roofline_b1"), roofline);
            for (b, v) in BATCHES.iter().zip(decode) {
                push(format!("{name}_decode_b{b}"), v);
            }
        }
    }
    let med: BTreeMap<String, f64> = samples
        .iter()
        .map(|(k, v)| (k.clone(), median(v)))
        .collect();
    let get = |k: &str| med.get(k).copied().unwrap_or(f64::NAN);
    let best = |metric: &str| {
        get(&format!("llama_f16_{metric}")).max(get(&format!("llama_bf16_{metric}")))
    };
    let ratios_of = |name: &str| {
        let mut ratios = json!({
            "prefill_512_vs_best_of_f16_bf16": get(&format!("{name}_prefill")) / best("prefill"),
            "decode_b1_vs_bf16_tg128": get(&format!("{name}_decode_b1")) / get("llama_bf16_tg128"),
        });
        for b in &BATCHES[1..] {
            ratios[format!("decode_b{b}_vs_best_batched")] =
                json!(get(&format!("{name}_decode_b{b}")) / best(&format!("decode_b{b}")));
        }
        ratios
    };
    let ratios = ratios_of("tandem");
    let mut report = json!({
        "model": model.display().to_string(),
        "llama_cpp": bin.display().to_string(),
        "threads": args.threads,
        "rounds": args.rounds,
        "medians_tok_s": med,
        "samples": samples,
        "ratios": ratios,
        "tandem_decode_b1_roofline_fraction": get("tandem_roofline_b1"),
        "targets": {
            "prefill_512": 1.2, "decode_b1": 1.2, "decode_b1_roofline": 0.9, "decode_b32": 2.0,
        },
    });
    if tandems.len() > 1 {
        report["ratios_bf16_activations"] = ratios_of("tandem_bf16act");
        report["tandem_bf16act_decode_b1_roofline_fraction"] =
            json!(get("tandem_bf16act_roofline_b1"));
    }
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
