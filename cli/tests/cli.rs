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
    // BOS (256) then the bytes of "Hello".
    assert_eq!(
        j["prompt_ids"],
        serde_json::json!([256, 72, 101, 108, 108, 111])
    );
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
