//! Hugging Face parity: tandem must compute what transformers computes.
//!
//! Fixtures come from `tests/golden/make_golden.py` (pinned torch and
//! transformers): small random checkpoints of every supported architecture
//! variant, in f32 and bf16, with transformers' greedy continuation and
//! per-step logprobs. Two paths are checked against them:
//!
//! * incremental generation (prefill, then one paged decode step per token,
//!   with small blocks so attention crosses many block boundaries): the
//!   greedy tokens must be identical and the chosen-token logprobs close;
//! * one teacher-forced forward over prompt + reference tokens with logits at
//!   every position: the logprobs of transformers' top tokens must be close.
//!
//! The built-in models (`models/shakespeare-*`, trained, committed) have
//! their own fixtures from `models/make_golden.py` in
//! `tests/fixtures/builtin/`, checked the same way, plus their tokenizer:
//! the prompt text must encode to transformers' ids and the output decode to
//! its text.

mod common;

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tandem_engine::kernels::log_softmax;
use tandem_engine::{BlockTable, Checkpoint, KvCache, SeqInput};

#[derive(Deserialize)]
struct Step {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

#[derive(Deserialize)]
struct Golden {
    dtype: String,
    prompt_ids: Vec<u32>,
    steps: Vec<Step>,
    /// Built-in fixtures: the prompt as text, and transformers' decoding of
    /// the greedy output.
    #[serde(default)]
    prompt_text: Option<String>,
    #[serde(default)]
    output_text: Option<String>,
}

/// A built-in model's fixture file.
#[derive(Deserialize)]
struct BuiltinFixture {
    /// The checkpoint, relative to the repository root.
    checkpoint: String,
    dtype: String,
    cases: Vec<Golden>,
}

// Both references are f32 compute (see the fixture script), so the f32 bound
// applies to bf16 weights too; the looser 2e-2 for bf16 is met.
use common::TOLERANCE;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden")
}

fn cases() -> Vec<String> {
    let text = std::fs::read_to_string(fixtures().join("index.json")).expect("fixture index");
    serde_json::from_str(&text).expect("index is a list of case names")
}

fn load(case: &str) -> (Checkpoint, Golden) {
    let dir = fixtures().join(case);
    let golden: Golden = serde_json::from_str(
        &std::fs::read_to_string(dir.join("golden.json")).expect("golden.json"),
    )
    .expect("golden.json parses");
    (Checkpoint::open(&dir).expect("checkpoint loads"), golden)
}

fn check_generation(case: &str, block_size: usize) -> f32 {
    let (ckpt, g) = load(case);
    generation_error(case, &ckpt, &g, block_size)
}

/// Incremental greedy generation against `g` ([`common::greedy_error`]).
fn generation_error(case: &str, ckpt: &Checkpoint, g: &Golden, block_size: usize) -> f32 {
    let steps: Vec<(u32, f32)> = g.steps.iter().map(|s| (s.token, s.logprob)).collect();
    common::greedy_error(case, ckpt, &g.prompt_ids, &steps, block_size)
}

fn check_teacher_forced(case: &str) -> f32 {
    let (ckpt, g) = load(case);
    teacher_forced_error(case, &ckpt, &g)
}

/// One forward over prompt and reference tokens against `g`: the worst
/// difference over transformers' top tokens' logprobs.
fn teacher_forced_error(case: &str, ckpt: &Checkpoint, g: &Golden) -> f32 {
    let mut ids = g.prompt_ids.clone();
    ids.extend(g.steps.iter().map(|s| s.token));
    let bs = 16;
    let layout = ckpt.model.kv_layout(bs);
    let groups = tandem_engine::KvGroups::of(&layout).num_groups();
    let mut kv = KvCache::new(layout, ids.len().div_ceil(bs) * groups);
    let pool = kv.allocator().expect("pool");
    let mut table = BlockTable::new(&pool);
    table.append(ids.len()).expect("blocks");
    let logits = ckpt
        .model
        .forward(
            &[SeqInput {
                tokens: &ids,
                start_pos: 0,
                blocks: table.blocks(),
                all_logits: true,
                lora: None,
            }],
            &mut kv,
        )
        .expect("forward");
    let vocab = logits.vocab();
    let rows = logits.seq(0);
    let mut worst = 0.0f32;
    for (i, s) in g.steps.iter().enumerate() {
        let at = g.prompt_ids.len() - 1 + i;
        let mut row = rows[at * vocab..(at + 1) * vocab].to_vec();
        log_softmax(&mut row);
        for &(t, want) in &s.top {
            let d = (row[t as usize] - want).abs();
            assert!(
                d < TOLERANCE,
                "{case} step {i} token {t}: {} vs {want}",
                row[t as usize]
            );
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
fn every_fixture_architecture_is_covered() {
    let names = cases();
    for arch in [
        "llama_gqa",
        "llama_mha",
        "llama_mqa",
        "llama3_rope",
        "mistral_window",
        "qwen2_bias",
        "llama_tied",
        "qwen3_gqa",
        "qwen3_mqa_tied",
        "qwen3_legacy",
        "gemma3_gqa",
        "gemma3_hd256",
        "gemma3_legacy",
        "gemma3_multimodal",
        "gemma2_softcap",
        "phi3_fused",
        "phi3_mha_tied",
        "olmo2_gqa",
        "olmo2_mqa_tied",
        "granite_gqa",
        "granite_mha_tied",
        "qwen3_yarn",
        "llama_yarn_legacy",
        "llama_dynamic",
        "phi3_longrope",
        "mixtral_top2",
        "qwen2moe_shared",
        "qwen3moe_norm",
        "qwen3moe_step2",
        "gptoss_sinks",
        "gptoss_mxfp4",
        "mixtral_mqa_tied",
        "qwen2moe_step2",
        "deepseekv2_lite",
        "deepseekv2_group",
        "deepseekv3_yarn",
        "deepseekv3_plain",
    ] {
        for dtype in ["f32", "bf16"] {
            let case = format!("{arch}_{dtype}");
            assert!(names.contains(&case), "missing fixture {case}");
            let (_, g) = load(&case);
            assert_eq!(g.dtype, dtype);
            assert!(g.steps.len() >= 32, "{case}: at least 32 generated tokens");
        }
    }
}

macro_rules! parity {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            for dtype in ["f32", "bf16"] {
                let case = format!("{}_{dtype}", stringify!($name));
                let gen4 = check_generation(&case, 4);
                let gen16 = check_generation(&case, 16);
                let tf = check_teacher_forced(&case);
                eprintln!("{case}: max |Δlogprob| generate(bs=4) {gen4:.2e}, generate(bs=16) {gen16:.2e}, teacher-forced {tf:.2e}");
            }
        }
    )*};
}

parity!(
    llama_gqa,
    llama_mha,
    llama_mqa,
    llama3_rope,
    mistral_window,
    qwen2_bias,
    llama_tied,
    qwen3_gqa,
    qwen3_mqa_tied,
    qwen3_legacy,
    gemma3_gqa,
    gemma3_hd256,
    gemma3_legacy,
    gemma3_multimodal,
    gemma2_softcap,
    phi3_fused,
    phi3_mha_tied,
    olmo2_gqa,
    olmo2_mqa_tied,
    granite_gqa,
    granite_mha_tied,
    qwen3_yarn,
    llama_yarn_legacy,
    llama_dynamic,
    phi3_longrope,
    mixtral_top2,
    qwen2moe_shared,
    qwen3moe_norm,
    qwen3moe_step2,
    gptoss_sinks,
    gptoss_mxfp4,
    mixtral_mqa_tied,
    qwen2moe_step2,
    deepseekv2_lite,
    deepseekv2_group,
    deepseekv3_yarn,
    deepseekv3_plain,
);

#[test]
fn builtin_models_match_transformers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for model in ["shakespeare-target", "shakespeare-draft"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/builtin")
            .join(format!("{model}.json"));
        let fixture: BuiltinFixture =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture"))
                .expect("fixture parses");
        assert_eq!(fixture.dtype, "bf16");
        assert!(fixture.cases.len() >= 3, "{model}: at least 3 prompts");
        let ckpt = Checkpoint::open(&root.join(&fixture.checkpoint)).expect("checkpoint loads");
        let tok = ckpt.tokenizer.as_ref().expect("a tokenizer");
        for (i, g) in fixture.cases.iter().enumerate() {
            let case = format!("{model}[{i}]");
            let text = g.prompt_text.as_deref().expect("prompt_text");
            assert_eq!(
                tok.encode(text).expect("encode"),
                g.prompt_ids,
                "{case}: prompt ids"
            );
            let output: Vec<u32> = g.steps.iter().map(|s| s.token).collect();
            assert_eq!(
                Some(tok.decode(&output).expect("decode")),
                g.output_text,
                "{case}: output text"
            );
            let gen4 = generation_error(&case, &ckpt, g, 4);
            let gen16 = generation_error(&case, &ckpt, g, 16);
            let tf = teacher_forced_error(&case, &ckpt, g);
            eprintln!("{case}: max |Δlogprob| generate(bs=4) {gen4:.2e}, generate(bs=16) {gen16:.2e}, teacher-forced {tf:.2e}");
        }
    }
}

/// Prompt scoring through the serving engine (`prompt_logprobs`, chunked
/// prefill of 5 tokens, prefix caching on and primed with the same prompt):
/// scoring prompt + reference tokens must give transformers' logprob of
/// each reference token and its top tokens' logprobs.
fn prompt_score_error(case: &str) -> f32 {
    use tandem_engine::serving::{
        EngineConfig, EngineCore, KvPoolSize, Prompt, PromptLogprobs, Request, RequestEvent,
    };
    let (ckpt, g) = load(case);
    let mut ids = g.prompt_ids.clone();
    ids.extend(g.steps.iter().take(12).map(|s| s.token));
    let config = EngineConfig {
        block_size: 4,
        kv_pool: KvPoolSize::Blocks(256),
        max_prefill_chunk: Some(5),
        enable_prefix_caching: true,
        ..EngineConfig::default()
    };
    let mut core =
        EngineCore::new(ckpt.model, None, ckpt.eos_token_ids.clone(), &config).expect("engine");
    let mut run = |id: u64, top: Option<usize>| {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut req = Request::new(Prompt::Tokens(ids.clone()), 1);
        req.prompt_logprobs = top.map(PromptLogprobs::top);
        core.add_request(id, req, tx).expect("valid");
        while core.has_work() {
            core.step();
        }
        let mut scores = None;
        while let Ok(ev) = rx.try_recv() {
            if let RequestEvent::PromptLogprobs(lps) = ev {
                assert!(scores.is_none(), "{case}: scores sent once");
                scores = Some(lps);
            }
        }
        scores
    };
    assert!(run(1, None).is_none());
    // The prompt is cached now; scoring computes it again all the same.
    let scores = run(2, Some(8)).expect("scores");
    assert_eq!(scores.len(), ids.len() - 1, "{case}");
    let mut worst = 0.0f32;
    for (i, s) in g.steps.iter().take(12).enumerate() {
        let score = &scores[g.prompt_ids.len() - 1 + i];
        assert_eq!(score.token, s.token, "{case}");
        let mut diffs = vec![(score.logprob - s.logprob).abs()];
        assert_eq!(score.top[0].0, s.top[0].0, "{case} step {i}: the top token");
        for &(t, want) in &s.top {
            if let Some(&(_, got)) = score.top.iter().find(|(u, _)| *u == t) {
                diffs.push((got - want).abs());
            }
        }
        for d in diffs {
            assert!(d < TOLERANCE, "{case} step {i}: |Δ| {d}");
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
fn prompt_logprobs_of_the_serving_engine_match_transformers() {
    for case in [
        "llama_gqa_f32",
        "qwen3_gqa_f32",
        "gemma3_gqa_f32",
        "mixtral_top2_f32",
        "gptoss_sinks_f32",
        "mistral_window_f32",
        "deepseekv2_group_f32",
        "deepseekv3_yarn_f32",
    ] {
        let worst = prompt_score_error(case);
        eprintln!("{case}: prompt logprobs max |Δ| {worst:.2e}");
    }
}
