//! GPU parity and performance in one run (`bench/gpu/run.sh` calls it).
//!
//! 1. Parity: each tiny preset runs greedy for 32 tokens on the CPU engine
//!    (f32) and on the GPU with f32 weights and KV; the tokens must be equal.
//!    A batched step (several prompts of different lengths, then decoding
//!    together through the CUDA graph path) must match the CPU too. With
//!    bf16 weights and KV, the log-probability error against the CPU's f32
//!    logits is reported along the CPU's greedy path.
//! 2. Rooflines measured here: device-to-device copy bandwidth and the cuBLAS
//!    bf16 GEMM rate.
//! 3. An 8B-shaped model (Llama 3 8B geometry, random bf16 weights made on
//!    the device): prefill tokens/s at 2k tokens and MFU against the measured
//!    GEMM rate; decode tokens/s at several batch sizes with the fraction of
//!    the bandwidth roofline at batch 1, with and without CUDA graphs.
//!
//! Writes JSON (`--out`) and prints a short table last.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_cuda::{CudaModel, CudaOptions, DeviceDType};
use tandem_engine::sampling::argmax;
use tandem_engine::{KvCache, Model, ModelConfig, SeqInput};

#[derive(Parser, Debug)]
struct Args {
    /// Where the JSON results go.
    #[arg(long, default_value = "gpu-bench.json")]
    out: PathBuf,
    /// Parity only (no 8B-shaped model).
    #[arg(long)]
    parity_only: bool,
    /// Decode batch sizes of the 8B-shaped model.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    batches: Vec<usize>,
    /// Context (prompt tokens) of each decoding sequence.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Prefill length.
    #[arg(long, default_value_t = 2048)]
    prefill: usize,
}

const BLOCK: usize = 16;
const PARITY_TOKENS: usize = 32;

fn prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as u32)
        .collect()
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let mut v = row.to_vec();
    tandem_engine::kernels::log_softmax(&mut v);
    v
}

/// Greedy on the CPU: the tokens and each step's logits.
fn cpu_greedy(model: &Model, prompt: &[u32], n: usize) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let total = prompt.len() + n;
    let blocks: Vec<u32> = (0..total.div_ceil(BLOCK) as u32).collect();
    let mut kv = KvCache::new(model.kv_layout(BLOCK), blocks.len());
    let (mut out, mut rows) = (Vec::new(), Vec::new());
    let mut next: Vec<u32> = prompt.to_vec();
    let mut pos = 0;
    for _ in 0..n {
        let l = model.forward(
            &[SeqInput {
                tokens: &next,
                start_pos: pos,
                blocks: &blocks,
                all_logits: false,
                lora: None,
            }],
            &mut kv,
        )?;
        pos += next.len();
        let t = argmax(l.last(0));
        rows.push(l.last(0).to_vec());
        out.push(t);
        next = vec![t];
    }
    Ok((out, rows))
}

/// Greedy on the GPU for several prompts decoded together.
fn gpu_greedy(model: &mut CudaModel, prompts: &[Vec<u32>], n: usize) -> Result<Vec<Vec<u32>>> {
    let mut tables = Vec::new();
    let mut next_block = 0u32;
    for p in prompts {
        let nb = (p.len() + n).div_ceil(BLOCK) as u32;
        tables.push((next_block..next_block + nb).collect::<Vec<u32>>());
        next_block += nb;
    }
    let mut next: Vec<Vec<u32>> = prompts.to_vec();
    let mut pos = vec![0usize; prompts.len()];
    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..n {
        let batch: Vec<SeqInput<'_>> = next
            .iter()
            .zip(&tables)
            .zip(&pos)
            .map(|((t, b), &p)| SeqInput {
                tokens: t,
                start_pos: p,
                blocks: b,
                all_logits: false,
                lora: None,
            })
            .collect();
        let step = model.forward(&batch)?;
        let toks = model.argmax(&step)?;
        for i in 0..prompts.len() {
            pos[i] += next[i].len();
            out[i].push(toks[i]);
            next[i] = vec![toks[i]];
        }
    }
    Ok(out)
}

fn parity(dir: &std::path::Path, name: &str) -> Result<Value> {
    let cpu = Model::load(dir)?;
    let config = ModelConfig::from_dir(dir)?;
    let vocab = config.vocab_size;
    let prompts: Vec<Vec<u32>> = [20usize, 5, 37]
        .iter()
        .enumerate()
        .map(|(i, &len)| prompt(len, vocab, i))
        .collect();
    let mut cpu_tokens = Vec::new();
    let mut cpu_rows = Vec::new();
    for p in &prompts {
        let (t, r) = cpu_greedy(&cpu, p, PARITY_TOKENS)?;
        cpu_tokens.push(t);
        cpu_rows.push(r);
    }
    let mut opts = CudaOptions::new(&config, 64);
    opts.weights = DeviceDType::F32;
    opts.kv = DeviceDType::F32;
    opts.max_tokens = 256;
    opts.max_seqs = 8;
    opts.max_logit_rows = 8;
    let mut f32_model = CudaModel::load(dir, opts.clone())?;
    // One sequence (graph path at batch 1), then all three together.
    let single = gpu_greedy(&mut f32_model, &prompts[..1], PARITY_TOKENS)?;
    let batched = gpu_greedy(&mut f32_model, &prompts, PARITY_TOKENS)?;
    let mut no_graph_opts = opts.clone();
    no_graph_opts.graph_max_batch = 0;
    let mut eager = CudaModel::load(dir, no_graph_opts)?;
    let eager_single = gpu_greedy(&mut eager, &prompts[..1], PARITY_TOKENS)?;
    let single_equal = single[0] == cpu_tokens[0];
    let eager_equal = eager_single[0] == cpu_tokens[0];
    let batched_equal = batched == cpu_tokens;

    // bf16: teacher-forced along the CPU's greedy path, logprob error of the
    // CPU's chosen token and the greedy agreement.
    let mut bopts = opts;
    bopts.weights = DeviceDType::Bf16;
    bopts.kv = DeviceDType::Bf16;
    let mut bf = CudaModel::load(dir, bopts)?;
    let p0 = &prompts[0];
    let blocks: Vec<u32> = (0..(p0.len() + PARITY_TOKENS).div_ceil(BLOCK) as u32).collect();
    let (mut max_err, mut sum_err, mut agree) = (0.0f64, 0.0f64, 0usize);
    let mut next: Vec<u32> = p0.clone();
    let mut pos = 0;
    for step in 0..PARITY_TOKENS {
        let out = bf.forward(&[SeqInput {
            tokens: &next,
            start_pos: pos,
            blocks: &blocks,
            all_logits: false,
            lora: None,
        }])?;
        let logits = bf.logits(&out)?;
        let gpu_lp = log_softmax(logits.last(0));
        let cpu_lp = log_softmax(&cpu_rows[0][step]);
        let chosen = cpu_tokens[0][step] as usize;
        let err = f64::from((gpu_lp[chosen] - cpu_lp[chosen]).abs());
        max_err = max_err.max(err);
        sum_err += err;
        if argmax(logits.last(0)) as usize == chosen {
            agree += 1;
        }
        pos += next.len();
        next = vec![cpu_tokens[0][step]];
    }
    Ok(json!({
        "model": name,
        "f32_greedy_equal_batch1_graph": single_equal,
        "f32_greedy_equal_batch1_eager": eager_equal,
        "f32_greedy_equal_batch3": batched_equal,
        "graphs_captured": f32_model.captured_graphs(),
        "bf16_logprob_err_max": max_err,
        "bf16_logprob_err_mean": sum_err / PARITY_TOKENS as f64,
        "bf16_greedy_agreement": agree as f64 / PARITY_TOKENS as f64,
    }))
}

fn llama3_8b() -> Result<ModelConfig> {
    Ok(ModelConfig::from_json(&json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": false,
    }))?)
}

/// Fills `seqs` sequences with `context` prompt tokens each, prefilling
/// several sequences per step.
fn fill(model: &mut CudaModel, tables: &[Vec<u32>], context: usize, chunk: usize) -> Result<()> {
    let vocab = model.config().vocab_size;
    let per_step = (chunk / context).max(1);
    for (g, group) in tables.chunks(per_step).enumerate() {
        let prompts: Vec<Vec<u32>> = (0..group.len())
            .map(|i| prompt(context, vocab, g * per_step + i))
            .collect();
        let batch: Vec<SeqInput<'_>> = prompts
            .iter()
            .zip(group)
            .map(|(p, b)| SeqInput {
                tokens: p,
                start_pos: 0,
                blocks: b,
                all_logits: false,
                lora: None,
            })
            .collect();
        model.forward(&batch)?;
    }
    model.gpu().sync()?;
    Ok(())
}

/// Decode tokens/s at batch `b` after a `context`-token prefill.
fn decode_rate(model: &mut CudaModel, b: usize, context: usize, steps: usize) -> Result<f64> {
    let per_seq = (context + steps + 2).div_ceil(BLOCK);
    let tables: Vec<Vec<u32>> = (0..b)
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    fill(model, &tables, context, 2048)?;
    let mut next = vec![1u32; b];
    let mut pos = context;
    let mut run = |model: &mut CudaModel, n: usize| -> Result<()> {
        for _ in 0..n {
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let batch: Vec<SeqInput<'_>> = toks
                .iter()
                .zip(&tables)
                .map(|(t, bl)| SeqInput {
                    tokens: t,
                    start_pos: pos,
                    blocks: bl,
                    all_logits: false,
                    lora: None,
                })
                .collect();
            let out = model.forward(&batch)?;
            next = model.argmax(&out)?;
            pos += 1;
        }
        Ok(())
    };
    run(model, 2)?; // warm-up (captures the graph)
    let t = Instant::now();
    run(model, steps)?;
    Ok((b * steps) as f64 / t.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let mut results = serde_json::Map::new();

    let mut parity_rows = Vec::new();
    for name in ["tiny", "tiny-mqa", "small"] {
        let dir = tempfile::tempdir()?;
        tandem_engine::synth::preset(name)?.write(dir.path(), 0, tandem_engine::DType::F32)?;
        let r = parity(dir.path(), name).with_context(|| format!("parity on {name}"))?;
        eprintln!("parity {name}: {r}");
        parity_rows.push(r);
    }
    results.insert("parity".into(), Value::Array(parity_rows.clone()));

    let mut perf = None;
    if !args.parity_only {
        let config = llama3_8b()?;
        let max_ctx = args.context.max(args.prefill) + args.steps + 16;
        let blocks_needed = args
            .batches
            .iter()
            .map(|&b| b * (args.context + args.steps + 2).div_ceil(BLOCK))
            .max()
            .unwrap_or(0)
            .max(args.prefill.div_ceil(BLOCK) + 1);
        let mut opts = CudaOptions::new(&config, blocks_needed);
        opts.max_tokens = args.prefill.max(2048);
        opts.max_seqs = args.batches.iter().copied().max().unwrap_or(1).max(8);
        opts.max_logit_rows = opts.max_seqs;
        opts.max_model_len = max_ctx;
        opts.graph_max_batch = opts.max_seqs;
        let mut model = CudaModel::random(config.clone(), opts.clone(), 7)?;
        let gpu = model.gpu();
        let bw = gpu.copy_bandwidth(2 << 30, 5)?;
        let flops_peak = gpu.bf16_gemm_flops(8192, 10)?;
        let (free, total) = gpu.mem_info()?;
        let device = gpu.name().to_string();
        eprintln!(
            "{device}: copy {:.0} GB/s, bf16 GEMM {:.0} TFLOP/s, {:.1}/{:.1} GiB free",
            bw / 1e9,
            flops_peak / 1e12,
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        );

        // Prefill: one sequence of `prefill` tokens in one step.
        let n = args.prefill;
        let table: Vec<u32> = (0..n.div_ceil(BLOCK) as u32).collect();
        let p = prompt(n, config.vocab_size, 99);
        let step = |m: &mut CudaModel| -> Result<()> {
            m.forward(&[SeqInput {
                tokens: &p,
                start_pos: 0,
                blocks: &table,
                all_logits: false,
                lora: None,
            }])?;
            m.gpu().sync()?;
            Ok(())
        };
        step(&mut model)?;
        {
            let prof = model.profile_step(&[SeqInput {
                tokens: &p,
                start_pos: 0,
                blocks: &table,
                all_logits: false,
                lora: None,
            }])?;
            eprintln!("profile prefill {n}:");
            for (name, secs, k) in &prof {
                eprintln!("  {name:<22} {:>8.3} ms {k:>5} launches", secs * 1e3);
            }
        }
        let reps = 3;
        let t = Instant::now();
        for _ in 0..reps {
            step(&mut model)?;
        }
        let prefill_secs = t.elapsed().as_secs_f64() / reps as f64;
        // Every layer's matrices for every token; the head for the last only.
        let head_params = (config.vocab_size * config.hidden_size) as f64;
        let layer_params = (model.weight_bytes() / 2) as f64 - head_params;
        let (l, h, d) = (
            config.num_layers as f64,
            config.num_heads as f64,
            config.head_dim as f64,
        );
        // Causal attention: QKᵀ and PV over n²/2 pairs, per head and layer.
        let attn_flops = 2.0 * 2.0 * l * h * d * (n as f64) * (n as f64) / 2.0;
        let prefill_flops = 2.0 * layer_params * n as f64 + 2.0 * head_params + attn_flops;
        let mfu = prefill_flops / prefill_secs / flops_peak;
        eprintln!(
            "prefill {n}: {:.0} tok/s, MFU {:.1}%",
            n as f64 / prefill_secs,
            100.0 * mfu
        );

        let mut decode = Vec::new();
        let mut replays = Vec::new();
        for &b in &args.batches {
            let rate = decode_rate(&mut model, b, args.context, args.steps)?;
            let replay = model.graph_replay_secs(b, 20)?;
            if b == 1 || b == 256 {
                let tok = [1u32];
                let table: Vec<u32> =
                    (0..(args.context + args.steps + 2).div_ceil(BLOCK) as u32).collect();
                let seqs: Vec<SeqInput<'_>> = (0..b)
                    .map(|_| SeqInput {
                        tokens: &tok,
                        start_pos: args.context,
                        blocks: &table,
                        all_logits: false,
                        lora: None,
                    })
                    .collect();
                let prof = model.profile_step(&seqs)?;
                let total: f64 = prof.iter().map(|p| p.1).sum();
                eprintln!(
                    "profile decode batch {b} (eager, {:.3} ms of kernels):",
                    total * 1e3
                );
                for (name, secs, n) in &prof {
                    eprintln!("  {name:<22} {:>8.3} ms {n:>5} launches", secs * 1e3);
                }
            }
            eprintln!(
                "decode batch {b}: {rate:.0} tok/s; graph replay {:.3} ms/step ({:.0} tok/s of GPU time)",
                replay * 1e3,
                b as f64 / replay
            );
            decode.push((b, rate));
            replays.push(json!({"batch": b, "graph_replay_ms": replay * 1e3}));
        }
        // Batch 1 without graphs, for the launch-overhead comparison.
        drop(model);
        let mut eager_opts = opts;
        eager_opts.graph_max_batch = 0;
        let mut eager = CudaModel::random(config.clone(), eager_opts, 7)?;
        let eager_rate = decode_rate(&mut eager, 1, args.context, args.steps)?;
        eprintln!("decode batch 1 without graphs: {eager_rate:.0} tok/s");
        let kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2;
        let step_bytes =
            eager.weight_bytes() + (args.context + args.steps / 2) * kv_bytes_per_token;
        let roofline_tok_s = bw / step_bytes as f64;
        let b1 = decode.iter().find(|d| d.0 == 1).map(|d| d.1);
        let biggest = decode.last().copied();
        perf = Some((
            device.clone(),
            bw,
            flops_peak,
            n,
            prefill_secs,
            mfu,
            decode.clone(),
            eager_rate,
            roofline_tok_s,
            b1,
            biggest,
        ));
        results.insert(
            "llama3_8b_shape".into(),
            json!({
                "device": device,
                "copy_bandwidth_gb_s": bw / 1e9,
                "bf16_gemm_tflops": flops_peak / 1e12,
                "weight_bytes": eager.weight_bytes(),
                "prefill_tokens": n,
                "prefill_tok_s": n as f64 / prefill_secs,
                "prefill_mfu": mfu,
                "decode_context": args.context,
                "decode": decode.iter().map(|(b, r)| json!({"batch": b, "tok_s": r})).collect::<Vec<_>>(),
                "decode_batch1_no_graphs_tok_s": eager_rate,
                "graph_replay": replays,
                "batch1_roofline_tok_s": roofline_tok_s,
                "batch1_roofline_fraction": b1.map(|r| r / roofline_tok_s),
                "largest_batch_over_batch1": match (b1, biggest) { (Some(a), Some((_, z))) => Some(z / a), _ => None },
            }),
        );
    }
    results.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
    std::fs::write(
        &args.out,
        serde_json::to_string_pretty(&Value::Object(results))?,
    )?;

    println!(
        "\n{:<10} {:>12} {:>12} {:>12} {:>14} {:>10}",
        "parity", "f32 b1", "f32 eager", "f32 b3", "bf16 lp err", "bf16 agr"
    );
    let mut all_equal = true;
    for r in &parity_rows {
        let eq = |k: &str| r[k].as_bool().unwrap_or(false);
        all_equal &= eq("f32_greedy_equal_batch1_graph")
            && eq("f32_greedy_equal_batch1_eager")
            && eq("f32_greedy_equal_batch3");
        println!(
            "{:<10} {:>12} {:>12} {:>12} {:>14.2e} {:>10.2}",
            r["model"].as_str().unwrap_or("?"),
            eq("f32_greedy_equal_batch1_graph"),
            eq("f32_greedy_equal_batch1_eager"),
            eq("f32_greedy_equal_batch3"),
            r["bf16_logprob_err_max"].as_f64().unwrap_or(f64::NAN),
            r["bf16_greedy_agreement"].as_f64().unwrap_or(f64::NAN),
        );
    }
    if let Some((device, bw, fl, n, ps, mfu, decode, eager, roof, b1, biggest)) = perf {
        println!(
            "\n{device}: copy {:.0} GB/s, bf16 GEMM {:.0} TFLOP/s",
            bw / 1e9,
            fl / 1e12
        );
        println!(
            "prefill {n} tokens: {:.0} tok/s, MFU {:.1}%",
            n as f64 / ps,
            100.0 * mfu
        );
        println!("{:>8} {:>12}", "batch", "decode tok/s");
        for (b, r) in &decode {
            println!("{b:>8} {r:>12.0}");
        }
        println!("batch 1 without graphs: {eager:.0} tok/s");
        if let Some(b1) = b1 {
            println!(
                "batch 1 roofline {roof:.0} tok/s: {:.1}% of it",
                100.0 * b1 / roof
            );
            if let Some((b, z)) = biggest {
                println!("batch {b} / batch 1 throughput: {:.1}x", z / b1);
            }
        }
    }
    println!("results: {}", args.out.display());
    if !all_equal {
        bail!("GPU greedy tokens differ from the CPU's");
    }
    Ok(())
}
