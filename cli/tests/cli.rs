//! The `tandem` binary as a user runs it: JSON output, streaming, the default
//! model, and clear errors (non-zero exit, no panic) on bad input.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn tandem(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env("TANDEM_CACHE_DIR", cache)
        .output()
        .expect("tandem runs")
}

fn gen_model(dir: &Path, preset: &str, dtype: &str) {
    let out = tandem(
        &[
            "gen-model",
            "--config",
            preset,
            "--out",
            dir.to_str().expect("utf8"),
            "--dtype",
            dtype,
        ],
        dir,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

/// A failing run: non-zero exit, a message containing `needle`, no panic.
fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "panic instead of an error: {stderr}"
    );
    assert!(stderr.contains(needle), "stderr lacks `{needle}`: {stderr}");
}

#[test]
fn generate_json_has_the_documented_shape_and_is_deterministic() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("m");
    gen_model(&model, "tiny", "bf16");
    let m = model.to_str().expect("utf8");
    let args = [
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "5,6,7,8",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--logprobs",
        "3",
        "--json",
    ];
    let a = json_of(&tandem(&args, tmp.path()));
    assert_eq!(a["prompt_ids"], serde_json::json!([5, 6, 7, 8]));
    let ids = a["output_ids"].as_array().expect("output_ids");
    assert_eq!(ids.len(), 6);
    let lps = a["logprobs"].as_array().expect("logprobs");
    assert_eq!(lps.len(), 6);
    for (lp, id) in lps.iter().zip(ids) {
        assert_eq!(&lp["token"], id);
        assert!(lp["logprob"].as_f64().expect("number") <= 0.0);
        let top = lp["top"].as_array().expect("top");
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(&top[0][0], id);
    }
    assert!(a["ttft_ms"].as_f64().expect("ttft") > 0.0);
    assert!(a["tpot_ms"].as_f64().expect("tpot") > 0.0);
    assert!(a["text"].is_string());
    let b = json_of(&tandem(&args, tmp.path()));
    assert_eq!(
        a["output_ids"], b["output_ids"],
        "greedy decoding is deterministic"
    );
}

#[test]
fn seeded_sampling_reproduces_and_seeds_differ() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("m");
    gen_model(&model, "tiny", "f32");
    let m = model.to_str().expect("utf8");
    let run = |seed: &str| {
        json_of(&tandem(
            &[
                "generate",
                "--model",
                m,
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "24",
                "--ignore-eos",
                "--temperature",
                "1.5",
                "--top-p",
                "0.95",
                "--seed",
                seed,
                "--json",
            ],
            tmp.path(),
        ))["output_ids"]
            .clone()
    };
    assert_eq!(run("11"), run("11"));
    assert_ne!(run("11"), run("12"));
}

#[test]
fn text_prompt_streams_text_and_default_model_works() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // No --model: the built-in default is generated into TANDEM_CACHE_DIR.
    let out = tandem(
        &[
            "generate",
            "--prompt",
            "Hello, tandem",
            "--max-tokens",
            "8",
            "--ignore-eos",
        ],
        tmp.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.stdout.is_empty(), "streamed text on stdout");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("8 tokens"), "{stderr}");
    let j = json_of(&tandem(
        &[
            "generate",
            "--prompt",
            "Hello",
            "--max-tokens",
            "2",
            "--json",
        ],
        tmp.path(),
    ));
    // The built-in model's tokenizer, installed in the cache: `<s>` (0)
    // then "Hello".
    let tok = tandem_engine::tokenizer::Tokenizer::from_file(
        &tmp.path()
            .join("models/shakespeare-target-v1/tokenizer.json"),
    )
    .expect("the built-in model is installed in the cache");
    let ids = tok.encode("Hello").expect("encode");
    assert_eq!(ids[0], 0, "<s> first");
    assert_eq!(j["prompt_ids"], serde_json::json!(ids));
}

#[test]
fn bad_inputs_fail_with_clear_messages() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("m");
    gen_model(&model, "tiny", "f32");
    let m = model.to_str().expect("utf8");
    let gen = |extra: &[&str], model: &str| {
        let mut a = vec!["generate", "--model", model, "--max-tokens", "4"];
        a.extend_from_slice(extra);
        tandem(&a, tmp.path())
    };

    assert_clean_error(
        &gen(&["--prompt-ids", "1"], "/nonexistent/model"),
        "does not exist",
    );
    assert_clean_error(
        &gen(&["--prompt-ids", "1,999999"], m),
        "outside the vocabulary",
    );
    let long: Vec<String> = (0..600).map(|i| (i % 200).to_string()).collect();
    assert_clean_error(
        &gen(&["--prompt-ids", &long.join(",")], m),
        "max_position_embeddings",
    );
    assert_clean_error(
        &gen(&["--prompt-ids", "1", "--temperature", "-1"], m),
        "temperature",
    );

    // Missing files, one at a time.
    let broken = tmp.path().join("broken");
    gen_model(&broken, "tiny", "f32");
    let b = broken.to_str().expect("utf8");
    std::fs::remove_file(broken.join("model.safetensors")).expect("rm");
    assert_clean_error(&gen(&["--prompt-ids", "1"], b), "model.safetensors");
    std::fs::remove_file(broken.join("config.json")).expect("rm");
    assert_clean_error(&gen(&["--prompt-ids", "1"], b), "config.json");

    // An architecture we do not run.
    let cfg_path = model.join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    cfg["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    let other = tmp.path().join("other");
    std::fs::create_dir_all(&other).expect("mkdir");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(model.join(f), other.join(f)).expect("copy");
    }
    std::fs::write(other.join("config.json"), cfg.to_string()).expect("write");
    assert_clean_error(
        &gen(&["--prompt-ids", "1"], other.to_str().expect("utf8")),
        "GPTNeoXForCausalLM",
    );

    // Text without a tokenizer.
    std::fs::remove_file(other.join("tokenizer.json")).expect("rm");
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    std::fs::write(other.join("config.json"), cfg.to_string()).expect("write");
    assert_clean_error(
        &gen(&["--prompt", "hi"], other.to_str().expect("utf8")),
        "tokenizer.json",
    );

    // A truncated weights file.
    let bytes = std::fs::read(model.join("model.safetensors")).expect("read");
    std::fs::write(other.join("model.safetensors"), &bytes[..bytes.len() / 2]).expect("write");
    assert_clean_error(
        &gen(&["--prompt-ids", "1"], other.to_str().expect("utf8")),
        "invalid checkpoint",
    );

    assert_clean_error(
        &tandem(&["gen-model", "--config", "nope", "--out", b], tmp.path()),
        "unknown model preset",
    );
}

#[test]
fn gen_model_lists_presets_and_is_deterministic() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tandem(&["gen-model", "--list"], tmp.path());
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("bench-100m") && text.contains("tiny"),
        "{text}"
    );
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    gen_model(&a, "tiny", "bf16");
    gen_model(&b, "tiny", "bf16");
    for f in ["model.safetensors", "config.json", "tokenizer.json"] {
        assert_eq!(
            std::fs::read(a.join(f)).expect("a"),
            std::fs::read(b.join(f)).expect("b"),
            "{f}"
        );
    }
}

/// Bytes of tensor data in a single-file checkpoint: the file less its
/// 8-byte length prefix and JSON header.
fn safetensors_data_bytes(path: &Path) -> u64 {
    let data = std::fs::read(path).expect("read safetensors");
    let mut len = [0u8; 8];
    len.copy_from_slice(&data[..8]);
    data.len() as u64 - 8 - u64::from_le_bytes(len)
}

#[test]
fn plan_json_follows_the_capacity_formula() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("m");
    gen_model(&model, "tiny", "bf16");
    let m = model.to_str().expect("utf8");
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(model.join("config.json")).expect("config.json"))
            .expect("config JSON");
    let get = |k: &str| cfg[k].as_u64().unwrap_or_else(|| panic!("config.{k}"));
    let (hidden, inter, layers) = (
        get("hidden_size"),
        get("intermediate_size"),
        get("num_hidden_layers"),
    );
    let (heads, kv_heads, vocab, max_pos) = (
        get("num_attention_heads"),
        get("num_key_value_heads"),
        get("vocab_size"),
        get("max_position_embeddings"),
    );
    let head_dim = cfg["head_dim"].as_u64().unwrap_or(hidden / heads);
    let weights = safetensors_data_bytes(&model.join("model.safetensors"));

    let run = |extra: &[&str]| {
        let mut args = vec!["plan", "--model", m, "--json"];
        args.extend_from_slice(extra);
        json_of(&tandem(&args, tmp.path()))
    };

    // Defaults: KV in the checkpoint's dtype (bf16 here, two bytes),
    // 16-token blocks, 2048 batched tokens, 256 sequences, max_model_len =
    // max_position_embeddings.
    let memory = 64u64 << 20;
    let p = run(&["--memory", "64MiB"]);
    let kv_per_token = 2 * layers * kv_heads * head_dim * 2;
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    let activations = 4 * (2048 * (2 * hidden + 2 * q + 2 * kv + 2 * inter) + 256 * vocab);
    let pool_blocks = (memory - weights - activations) / (16 * kv_per_token);
    let blocks_per_seq = max_pos.div_ceil(16);
    assert_eq!(p["memory_bytes"], memory);
    assert_eq!(p["weight_bytes"], weights);
    assert_eq!(p["activation_bytes"], activations);
    assert_eq!(p["kv_dtype"], "bf16");
    assert_eq!(p["kv_bytes_per_token"], kv_per_token);
    assert_eq!(p["bytes_per_block"], 16 * kv_per_token);
    assert_eq!(p["pool_blocks"], pool_blocks);
    assert_eq!(p["pool_tokens"], pool_blocks * 16);
    assert_eq!(p["max_model_len"], max_pos);
    assert_eq!(p["blocks_per_seq"], blocks_per_seq);
    assert_eq!(p["max_concurrent_seqs"], pool_blocks / blocks_per_seq);

    // Every knob: fp8 KV, 32-token blocks, a shorter max_model_len, a
    // smaller step.
    let p = run(&[
        "--memory",
        "0.5GB",
        "--kv-dtype",
        "fp8",
        "--block-size",
        "32",
        "--max-model-len",
        "100",
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        "8",
    ]);
    let memory = 500_000_000u64;
    let kv_per_token = 2 * layers * kv_heads * head_dim;
    let activations = 4 * (512 * (2 * hidden + 2 * q + 2 * kv + 2 * inter) + 8 * vocab);
    // 8-bit KV carries an f16 scale per (layer, token, KV head), K and V:
    // 32 tokens a block; FP8 also an eighth of a bf16 copy of a block (its
    // recent window).
    let scales = 2 * layers * kv_heads * 32 * 2;
    let copies = 32 * kv_per_token * 2 / 8;
    let pool_blocks = (memory - weights - activations) / (32 * kv_per_token + scales + copies);
    assert_eq!(p["memory_bytes"], memory);
    assert_eq!(p["kv_dtype"], "fp8-e4m3");
    assert_eq!(p["kv_bytes_per_token"], kv_per_token);
    assert_eq!(p["activation_bytes"], activations);
    assert_eq!(p["pool_blocks"], pool_blocks);
    assert_eq!(p["blocks_per_seq"], 4);
    assert_eq!(p["max_concurrent_seqs"], pool_blocks / 4);

    // INT4 weights: the linear layers at half a byte per weight plus an f16
    // scale and a u8 zero point per group of 32 (the default), the (untied)
    // head twice that (two INT4 passes, about 8 bits); the embedding as
    // stored.
    let p = run(&["--memory", "64MiB", "--quantize", "int4"]);
    let int4 = |rows: u64, cols: u64| rows * cols / 2 + 3 * rows * (cols / 32);
    let shapes = [
        (q, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, q),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ];
    let dense: u64 = layers * shapes.iter().map(|(r, c)| r * c).sum::<u64>() + vocab * hidden;
    let quantized: u64 =
        layers * shapes.iter().map(|&(r, c)| int4(r, c)).sum::<u64>() + 2 * int4(vocab, hidden);
    assert_eq!(p["weight_bytes"], weights - 2 * dense + quantized); // bf16 stored

    // The table names every number.
    let out = tandem(&["plan", "--model", m, "--memory", "64MiB"], tmp.path());
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    for row in [
        "KV bytes per token",
        "pool blocks",
        "weights",
        "max concurrent seqs",
    ] {
        assert!(table.contains(row), "table lacks {row}: {table}");
    }
}

#[test]
fn plan_rejects_budgets_and_lengths_that_cannot_work() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("m");
    gen_model(&model, "tiny", "f32");
    let m = model.to_str().expect("utf8");
    let out = tandem(&["plan", "--model", m, "--memory", "1MiB"], tmp.path());
    assert_clean_error(&out, "cannot hold the weights");
    let out = tandem(
        &[
            "plan",
            "--model",
            m,
            "--memory",
            "1GiB",
            "--max-model-len",
            "100000",
        ],
        tmp.path(),
    );
    assert_clean_error(&out, "max_position_embeddings");
    let out = tandem(&["plan", "--model", m, "--memory", "lots"], tmp.path());
    assert_clean_error(&out, "invalid memory size");
    let out = tandem(
        &[
            "plan",
            "--model",
            m,
            "--memory",
            "1GiB",
            "--kv-dtype",
            "int4",
        ],
        tmp.path(),
    );
    assert_clean_error(&out, "unknown KV cache dtype `int4`");
}

/// `tandem plan` on a Gemma 3 checkpoint (a windowed and a global layer,
/// window 8): blocks of one layer, and a sequence holding the global
/// layer's blocks plus the windowed layer's window.
#[test]
fn plan_counts_what_sliding_window_layers_free() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden/gemma3_gqa_f32");
    let m = model.to_str().expect("utf-8 path");
    let p = json_of(&tandem(
        &["plan", "--model", m, "--memory", "64MiB", "--json"],
        tmp.path(),
    ));
    // 256 positions: 16 blocks; position 256 reads from 249 on (block 15).
    assert_eq!(p["layers_per_block"], 1);
    assert_eq!(p["sliding_window"], 8);
    assert_eq!(p["windowed_layers"], 1);
    assert_eq!(p["global_blocks_per_seq"], 2 * 16);
    assert_eq!(p["blocks_per_seq"], 16 + 1);
    let pool = p["pool_blocks"].as_u64().expect("pool_blocks");
    assert_eq!(p["max_concurrent_seqs"], pool / 17);
    let table = tandem(&["plan", "--model", m, "--memory", "64MiB"], tmp.path());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("17 (32 without freeing"), "{text}");
}

/// `tandem plan` on a Qwen3-MoE checkpoint (two sparse layers of 8
/// experts, 2 per token, 64 wide, around a dense layer): total and active
/// parameters.
#[test]
fn plan_reports_total_and_active_parameters_of_a_mixture_of_experts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden/qwen3moe_norm_f32");
    let m = model.to_str().expect("utf-8 path");
    let p = json_of(&tandem(
        &["plan", "--model", m, "--memory", "64MiB", "--json"],
        tmp.path(),
    ));
    let per_expert = 3 * 64 * 64;
    assert_eq!(p["expert_params"], 2 * 8 * per_expert);
    let (total, active) = (&p["total_params"], &p["active_params"]);
    let (total, active) = (
        total.as_u64().expect("total"),
        active.as_u64().expect("active"),
    );
    assert_eq!(total - active, 2 * 6 * per_expert);
    assert_eq!(p["experts"]["experts_per_token"], 2);
    assert_eq!(p["experts"]["sparse_layers"], 2);
    let table = tandem(&["plan", "--model", m, "--memory", "64MiB"], tmp.path());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("active per token") && text.contains("2 of 8"),
        "{text}"
    );
    // Split over --ep 2: less than the whole on each rank.
    let p = json_of(&tandem(
        &[
            "plan", "--model", m, "--memory", "64MiB", "--ep", "2", "--json",
        ],
        tmp.path(),
    ));
    assert_eq!(p["ranks"], 2);
    let (whole, per_rank) = (&p["weight_bytes"], &p["weight_bytes_per_rank"]);
    let (whole, per_rank) = (
        whole.as_u64().expect("bytes"),
        per_rank.as_u64().expect("bytes"),
    );
    assert!(
        per_rank < whole && per_rank > whole / 2,
        "{per_rank} of {whole}"
    );
    // 8 experts do not make 3 groups.
    let out = tandem(
        &["plan", "--model", m, "--memory", "64MiB", "--ep", "3"],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("num_experts 8"));
}
