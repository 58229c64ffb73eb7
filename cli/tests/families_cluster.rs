//! The families beyond Llama through a cluster of real processes: `tandem
//! up --prefill 1 --decode 1` (router, one prefill and one decode worker on
//! loopback, KV moved between them) serving Qwen3, Gemma 3 and Qwen3-MoE checkpoints
//! made by transformers, against transformers' own tokens and against
//! `tandem serve`.
//!
//! The checkpoints are the golden fixtures (`tests/golden/make_golden.py`)
//! with `max_position_embeddings` raised from 256 to 2048 (RoPE here does
//! not depend on it), so a 700-token prompt fits. Gemma 3's sliding layers
//! have a window of 8: almost all of that prompt's KV lies outside it.

use std::path::{Path, PathBuf};

use tandem_tests::cluster::{all_blocks_free, Outcome, Started};

fn start(args: &[&str]) -> Started {
    tandem_tests::cluster::start(Path::new(env!("CARGO_BIN_EXE_tandem")), args)
}

/// The transformers reference for one fixture: its prompt and greedy tokens.
struct Golden {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
}

/// Copies fixture `case` into `dir` with a longer context; returns the
/// reference.
fn fixture(case: &str, dir: &Path) -> Golden {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/golden")
        .join(case);
    for entry in std::fs::read_dir(&src).expect("fixture dir") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
    }
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("config"))
            .expect("json");
    config["max_position_embeddings"] = 2048.into();
    std::fs::write(&config_path, config.to_string()).expect("write config");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).expect("golden"))
            .expect("golden json");
    let ids = |v: &serde_json::Value| v.as_u64().expect("id") as u32;
    Golden {
        prompt: golden["prompt_ids"]
            .as_array()
            .expect("prompt")
            .iter()
            .map(ids)
            .collect(),
        tokens: golden["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .map(|s| ids(&s["token"]))
            .collect(),
    }
}

/// gRPC only: the fixtures have no tokenizer, which the HTTP API needs.
fn model_args<'a>(cmd: &'a str, model: &'a str) -> Vec<&'a str> {
    vec![cmd, "--model", model, "--addr", "127.0.0.1:0"]
}

/// A 700-token prompt over the fixture's vocabulary (ids 3..128).
fn long_prompt() -> Vec<u32> {
    (0..700u32).map(|i| 3 + (i * 37 + i / 7) % 125).collect()
}

fn greedy(rt: &tokio::runtime::Runtime, addr: &str, prompt: &[u32], n: u32) -> Outcome {
    rt.block_on(tandem_tests::cluster::greedy(addr, prompt.to_vec(), n))
        .expect("served")
}

fn cluster_matches_serve_and_transformers(case: &str) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let golden = fixture(case, tmp.path());
    let model: PathBuf = tmp.path().to_path_buf();
    let model = model.to_str().expect("utf8");
    let mut serve_args = model_args("serve", model);
    serve_args.extend(["--num-kv-blocks", "1024", "--batch-invariant"]);
    let serve = start(&serve_args);
    let mut up_args = model_args("up", model);
    up_args.extend([
        "--prefill",
        "1",
        "--decode",
        "1",
        "--kv-cache-memory",
        "16MiB",
        "--remote-prefill-threshold",
        "8",
        "--worker-arg=--batch-invariant",
        "--no-http",
    ]);
    let cluster = start(&up_args);
    let rt = tandem_tests::cluster::runtime();

    // transformers' own prompt and tokens, prefilled remotely.
    let n = golden.tokens.len() as u32;
    let got = greedy(&rt, &cluster.addr, &golden.prompt, n);
    assert_eq!(got.tokens, golden.tokens, "{case}: cluster vs transformers");
    assert!(
        got.prefill.is_some(),
        "{case}: a 12-token prompt over the threshold went to prefill"
    );

    // A 700-token prompt: remote prefill, KV moved, decoded on the other
    // worker; the same tokens as the colocated server.
    let prompt = long_prompt();
    let want = greedy(&rt, &serve.addr, &prompt, 24);
    let got = greedy(&rt, &cluster.addr, &prompt, 24);
    assert_eq!(
        got.tokens, want.tokens,
        "{case}: cluster vs serve, 700-token prompt"
    );
    assert_eq!(got.tokens.len(), 24);
    assert!(
        got.prefill
            .as_ref()
            .is_some_and(|p| cluster.prefill.contains(p)),
        "{case}: the 700-token prompt was prefilled remotely: {:?}",
        got.prefill
    );
    rt.block_on(all_blocks_free(&cluster));
}

#[test]
fn qwen3_through_a_disaggregated_cluster() {
    cluster_matches_serve_and_transformers("qwen3_gqa_f32");
}

#[test]
fn gemma3_through_a_disaggregated_cluster() {
    cluster_matches_serve_and_transformers("gemma3_gqa_f32");
}

/// A mixture of experts (Qwen3-MoE: 8 experts, 2 per token, a dense layer
/// between two sparse ones) prefilled on one worker and decoded on the
/// other.
#[test]
fn qwen3_moe_through_a_disaggregated_cluster() {
    cluster_matches_serve_and_transformers("qwen3moe_norm_f32");
}
