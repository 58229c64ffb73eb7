//! LoRA adapters against transformers + peft, batched together, isolated in
//! the prefix cache, and refused by name when they do not fit.
//!
//! Fixtures come from `tests/golden/make_lora.py` (pinned torch,
//! transformers and peft): PEFT adapters with random A and B on the golden
//! f32 checkpoints (ranks 2–16, attention and/or MLP targets, rsLoRA, one
//! layer only; Qwen2 with biases, Gemma 3, Mixtral's attention), each with
//! the PEFT model's greedy tokens and top-5 logprobs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tandem_engine::lora::{LoraRegistry, LoraSettings};
use tandem_engine::quant::Int4Config;
use tandem_engine::serving::{
    EngineConfig, EngineCore, KvPoolSize, Prompt, PromptLogprobs, Request, RequestEvent,
    RequestSummary,
};
use tandem_engine::{Checkpoint, SamplingParams, TokenLogprob};

#[derive(Deserialize, Clone)]
struct Golden {
    base: String,
    adapter: String,
    prompt_ids: Vec<u32>,
    steps: Vec<Step>,
    base_tokens: Vec<u32>,
}

#[derive(Deserialize, Clone)]
struct Step {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

const TOLERANCE: f32 = 1e-4;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn adapter_dir(base: &str, adapter: &str) -> PathBuf {
    root().join("lora").join(base).join(adapter)
}

fn goldens() -> Vec<Golden> {
    let text = std::fs::read_to_string(root().join("lora/golden.json")).expect("golden.json");
    serde_json::from_str(&text).expect("golden.json parses")
}

/// An engine over `base` serving `adapters` (by their fixture names).
fn engine(base: &str, adapters: &[&str], block_size: usize, chunk: Option<usize>) -> EngineCore {
    let config = EngineConfig {
        block_size,
        kv_pool: KvPoolSize::Blocks(256),
        max_prefill_chunk: chunk,
        enable_prefix_caching: true,
        ..EngineConfig::default()
    };
    engine_with(base, adapters, &config)
}

fn engine_with(base: &str, adapters: &[&str], config: &EngineConfig) -> EngineCore {
    let ckpt = Checkpoint::open(&root().join("golden").join(base)).expect("checkpoint");
    let mut core = EngineCore::new(ckpt.model, None, Vec::new(), config).expect("engine");
    let settings = LoraSettings {
        adapters: adapters
            .iter()
            .map(|a| (a.to_string(), adapter_dir(base, a)))
            .collect(),
        ..LoraSettings::default()
    };
    core.enable_lora(&settings).expect("adapters load");
    core
}

fn request(prompt: &[u32], lora: Option<&str>, max_tokens: usize) -> Request {
    let mut req = Request::new(Prompt::Tokens(prompt.to_vec()), max_tokens);
    req.ignore_eos = true;
    req.sampling = SamplingParams {
        temperature: 0.0,
        logprobs: Some(5),
        ..SamplingParams::default()
    };
    req.lora = lora.map(str::to_string);
    req
}

/// Runs every request together to the end; each one's logprobs and summary.
fn run(core: &mut EngineCore, reqs: Vec<Request>) -> Vec<(Vec<TokenLogprob>, RequestSummary)> {
    let mut streams = Vec::new();
    for (i, req) in reqs.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        core.add_request(i as u64, req, tx).expect("valid request");
        streams.push(rx);
    }
    let mut steps = 0;
    while core.has_work() {
        core.step();
        core.check_accounting().expect("block books");
        steps += 1;
        assert!(steps < 2000, "the requests end");
    }
    streams
        .into_iter()
        .map(|mut rx| {
            let (mut lps, mut summary) = (Vec::new(), None);
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    RequestEvent::Delta(d) => lps.extend(d.logprobs),
                    RequestEvent::Finished(s) => summary = Some(s),
                    other => panic!("unexpected event {other:?}"),
                }
            }
            (lps, summary.expect("finished"))
        })
        .collect()
}

/// Greedy tokens equal, and every reported logprob (chosen and top-5)
/// within the tolerance; returns the worst difference.
fn check(g: &Golden, got: &[TokenLogprob]) -> f32 {
    let want: Vec<u32> = g.steps.iter().map(|s| s.token).collect();
    let tokens: Vec<u32> = got.iter().map(|l| l.token).collect();
    let what = format!("{}/{}", g.base, g.adapter);
    assert_eq!(tokens, want, "{what}: greedy tokens");
    let mut worst = 0.0f32;
    for (i, (s, l)) in g.steps.iter().zip(got).enumerate() {
        worst = worst.max((s.logprob - l.logprob).abs());
        for ((wt, wl), (gt, gl)) in s.top.iter().zip(&l.top) {
            assert_eq!(wt, gt, "{what}: top token at step {i}");
            worst = worst.max((wl - gl).abs());
        }
    }
    assert!(
        worst < TOLERANCE,
        "{what}: |Δlogprob| {worst} ≥ {TOLERANCE}"
    );
    worst
}

#[test]
fn adapters_match_peft_through_paged_decoding_and_chunked_prefill() {
    let mut worst = 0.0f32;
    for g in goldens() {
        for (block_size, chunk) in [(16, None), (4, Some(5))] {
            let mut core = engine(&g.base, &[&g.adapter], block_size, chunk);
            let req = request(&g.prompt_ids, Some(&g.adapter), g.steps.len());
            let out = run(&mut core, vec![req]);
            worst = worst.max(check(&g, &out[0].0));
        }
    }
    eprintln!("worst |Δlogprob| against peft: {worst:e}");
}

#[test]
fn a_batch_mixing_four_adapters_and_the_base_gives_each_its_own_tokens() {
    let all = goldens();
    let llama: Vec<&Golden> = all.iter().filter(|g| g.base == "llama_gqa_f32").collect();
    assert_eq!(llama.len(), 4, "four adapters of one base");
    let names: Vec<&str> = llama.iter().map(|g| g.adapter.as_str()).collect();
    let mut core = engine("llama_gqa_f32", &names, 4, Some(7));
    let n = llama[0].steps.len();
    let mut reqs: Vec<Request> = llama
        .iter()
        .map(|g| request(&g.prompt_ids, Some(&g.adapter), n))
        .collect();
    reqs.push(request(&llama[0].prompt_ids, None, n));
    // Twice each, so two rows of one adapter share the step too.
    let again: Vec<Request> = llama
        .iter()
        .map(|g| request(&g.prompt_ids, Some(&g.adapter), n))
        .collect();
    reqs.extend(again);
    let out = run(&mut core, reqs);
    for (i, g) in llama.iter().enumerate() {
        check(g, &out[i].0);
        check(g, &out[5 + i].0);
    }
    let base: Vec<u32> = out[4].0.iter().map(|l| l.token).collect();
    assert_eq!(
        base, llama[0].base_tokens,
        "the base model's row in the batch"
    );
    assert_ne!(
        base,
        llama[0].steps.iter().map(|s| s.token).collect::<Vec<_>>()
    );
}

#[test]
fn f32_adapters_run_over_int4_base_weights() {
    let all = goldens();
    let g = all.iter().find(|g| g.adapter == "r8_all").expect("r8_all");
    let config = EngineConfig {
        kv_pool: KvPoolSize::Blocks(256),
        weight_quantization: Some(Int4Config::new(32).expect("group size")),
        ..EngineConfig::default()
    };
    let mut core = engine_with(&g.base, &[&g.adapter], &config);
    // Teacher-forced over peft's own continuation: how often the next
    // token is the INT4 model's top-1, with the adapter and without.
    let text: Vec<u32> = g
        .prompt_ids
        .iter()
        .copied()
        .chain(g.steps.iter().map(|s| s.token))
        .collect();
    let mut top1 = |lora: Option<&str>| {
        let mut req = request(&text, lora, 1);
        req.prompt_logprobs = Some(PromptLogprobs::top(1));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        core.add_request(0, req, tx).expect("valid");
        while core.has_work() {
            core.step();
        }
        let mut scores = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            if let RequestEvent::PromptLogprobs(l) = ev {
                scores = l;
            }
        }
        let continuation = &scores[g.prompt_ids.len() - 1..];
        let hits = continuation
            .iter()
            .filter(|l| l.top.first().is_some_and(|t| t.0 == l.token));
        hits.count() as f64 / continuation.len() as f64
    };
    let (with, without) = (top1(Some(&g.adapter)), top1(None));
    eprintln!(
        "INT4: peft's continuation is top-1 {with:.2} with the adapter, {without:.2} without"
    );
    // (The golden model is tiny and its weights wide: INT4 moves it far, so
    // the bar is what the adapter adds, not parity.)
    assert!(with >= 0.4 && with > without + 0.3, "{with} vs {without}");
}

#[test]
fn a_prefix_cached_under_one_adapter_never_serves_another() {
    let g = goldens().into_iter().next().expect("a golden");
    let (a, b) = ("r4_attn", "r8_all");
    let mut core = engine(&g.base, &[a, b], 4, None);
    let prompt: Vec<u32> = g.prompt_ids.iter().cycle().take(40).copied().collect();
    let cached = |core: &mut EngineCore, lora: Option<&str>| {
        run(core, vec![request(&prompt, lora, 2)])[0]
            .1
            .usage
            .cached_tokens
    };
    assert_eq!(cached(&mut core, Some(a)), 0);
    assert_eq!(cached(&mut core, Some(b)), 0, "A's blocks do not serve B");
    assert_eq!(cached(&mut core, None), 0, "nor the base model");
    assert!(
        cached(&mut core, Some(a)) >= 36,
        "A's own blocks do serve A"
    );
    assert!(
        cached(&mut core, None) >= 36,
        "and the base model's the base"
    );
}

#[test]
fn bad_adapters_and_names_are_refused_by_name() {
    let config = Checkpoint::open(&root().join("golden/llama_gqa_f32"))
        .expect("checkpoint")
        .model
        .config()
        .clone();
    let load = |adapter: PathBuf, max_rank: usize| {
        let settings = LoraSettings {
            adapters: vec![("x".into(), adapter)],
            max_rank,
            ..LoraSettings::default()
        };
        LoraRegistry::new(config.clone(), &settings).map(|_| ())
    };
    let foreign = load(root().join("lora/foreign/r4_attn"), 64).expect_err("shape mismatch");
    let msg = foreign.to_string();
    assert!(
        msg.contains("adapter `x`") && msg.contains("another base model"),
        "{msg}"
    );
    let big = load(adapter_dir("llama_gqa_f32", "r16_rslora_mlp"), 8).expect_err("rank");
    assert!(big.to_string().contains("max_lora_rank"), "{big}");
    let missing = load(root().join("lora/nowhere"), 64).expect_err("no dir");
    assert!(
        missing.to_string().contains("adapter_config.json"),
        "{missing}"
    );
    // A MoE model's expert MLPs cannot be adapted; its attention can.
    let moe = Checkpoint::open(&root().join("golden/mixtral_top2_f32")).expect("checkpoint");
    let moe_cfg = moe.model.config().clone();
    let on_moe = LoraRegistry::new(
        moe_cfg,
        &LoraSettings {
            adapters: vec![("mlp".into(), adapter_dir("llama_gqa_f32", "r16_rslora_mlp"))],
            ..LoraSettings::default()
        },
    )
    .expect_err("MLP targets on experts");
    assert!(
        on_moe.to_string().contains("mixture of experts"),
        "{on_moe}"
    );

    let mut core = engine("llama_gqa_f32", &["r4_attn"], 16, None);
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let err = core
        .add_request(1, request(&[1, 2, 3], Some("nope"), 2), tx)
        .expect_err("unknown adapter");
    assert!(
        err.to_string().contains("lora: no adapter named `nope`"),
        "{err}"
    );
}

#[test]
fn resident_adapters_are_bounded_and_evicted_least_recently_used() {
    let config = Checkpoint::open(&root().join("golden/llama_gqa_f32"))
        .expect("checkpoint")
        .model
        .config()
        .clone();
    let names = ["r4_attn", "r8_all", "r16_rslora_mlp"];
    let settings = LoraSettings {
        adapters: names
            .iter()
            .map(|n| (n.to_string(), adapter_dir("llama_gqa_f32", n)))
            .collect(),
        max_loras: 2,
        ..LoraSettings::default()
    };
    let reg = Arc::new(LoraRegistry::new(config, &settings).expect("registry"));
    let resident = |reg: &LoraRegistry| -> Vec<String> {
        let list = reg.list();
        assert_eq!(list.len(), 3, "all three stay known");
        list.into_iter()
            .filter(|a| a.resident)
            .map(|a| a.name)
            .collect()
    };
    assert_eq!(resident(&reg), ["r16_rslora_mlp", "r8_all"]);
    // Asking for the evicted one loads it again and evicts the least
    // recently used idle one (r8_all); a held adapter is never evicted.
    let held = reg.resolve("r16_rslora_mlp").expect("resident");
    let again = reg.resolve("r4_attn").expect("reloaded");
    assert_eq!(resident(&reg), ["r16_rslora_mlp", "r4_attn"]);
    let _third = reg.resolve("r8_all").expect_err("both slots held");
    let dir = adapter_dir("llama_gqa_f32", "r8_all");
    reg.load("r8_all", &dir).expect_err("no slot to load into");
    assert_eq!(resident(&reg).len(), 2, "a refused load keeps r8_all known");
    drop((held, again));
    reg.resolve("r8_all").expect("a slot is free now");
    reg.unload("r8_all").expect("unload");
    assert!(reg.resolve("r8_all").is_err(), "unloaded means unknown");
}
