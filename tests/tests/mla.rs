//! Multi-head latent attention (DeepSeek-V2/V3) beyond logit parity (which
//! is `golden_parity.rs`, `deepseek*`): the absorbed and expanded forms
//! compute the same logits, the cache holds one latent row per token and
//! layer (so a pool of the same bytes holds more tokens than a per-head
//! cache of the same width), and 16- and 8-bit latent caches stay close to
//! the f32 one.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tandem_engine::capacity::CapacityPlan;
use tandem_engine::kernels::log_softmax;
use tandem_engine::serving::{EngineConfig, EngineCore, KvPoolSize};
use tandem_engine::{
    BlockTable, Checkpoint, KvCache, KvCacheDtype, KvRows, MlaForm, Model, ModelConfig, SeqInput,
};

const CASES: [&str; 4] = [
    "deepseekv2_lite_f32",
    "deepseekv2_group_f32",
    "deepseekv3_yarn_f32",
    "deepseekv3_plain_f32",
];

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/golden")
        .join(case)
}

/// The prompt and transformers' greedy continuation of a fixture.
fn reference_ids(case: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(fixture(case).join("golden.json")).expect("golden.json");
    let g: Value = serde_json::from_str(&text).expect("json");
    let mut ids: Vec<u32> = serde_json::from_value(g["prompt_ids"].clone()).expect("prompt");
    let steps = g["steps"].as_array().expect("steps");
    ids.extend(
        steps
            .iter()
            .map(|s| s["token"].as_u64().expect("token") as u32),
    );
    ids
}

/// Every position's logits of `ids` in one forward over a fresh cache, the
/// prompt split into `chunks` forward calls.
fn logits(model: &Model, ids: &[u32], dtype: KvCacheDtype, chunks: &[usize]) -> Vec<f32> {
    let bs = 4;
    let mut kv = KvCache::with_dtype(model.kv_layout(bs), ids.len().div_ceil(bs), dtype);
    let pool = kv.allocator().expect("pool");
    let mut table = BlockTable::new(&pool);
    table.append(ids.len()).expect("blocks");
    let mut out = Vec::new();
    let mut start = 0;
    for &len in chunks
        .iter()
        .chain(std::iter::once(&(ids.len() - chunks.iter().sum::<usize>())))
    {
        let l = model
            .forward(
                &[SeqInput {
                    tokens: &ids[start..start + len],
                    start_pos: start,
                    blocks: table.blocks(),
                    all_logits: true,
                    lora: None,
                }],
                &mut kv,
            )
            .expect("forward");
        out.extend_from_slice(l.seq(0));
        start += len;
    }
    out
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn absorbed_and_expanded_forms_give_the_same_logits() {
    for case in CASES {
        let mut model = Checkpoint::open(&fixture(case)).expect("loads").model;
        let ids = reference_ids(case);
        let run = |model: &Model| logits(model, &ids, KvCacheDtype::F32, &[]);
        model.set_mla_form(MlaForm::Absorbed);
        let absorbed = run(&model);
        model.set_mla_form(MlaForm::Expanded);
        let expanded = run(&model);
        let d = max_diff(&absorbed, &expanded);
        eprintln!("{case}: absorbed vs expanded max |Δlogit| {d:.2e}");
        assert!(d < 1e-4, "{case}: {d}");
        // Expanded prefill, then absorbed one token at a time (the serving
        // engine's mix), gives the same logits as either alone.
        model.set_mla_form(MlaForm::Auto);
        let one_by_one: Vec<usize> = std::iter::once(30).chain(vec![1; 20]).collect();
        let mixed = logits(&model, &ids, KvCacheDtype::F32, &one_by_one);
        let d = max_diff(&mixed, &absorbed);
        assert!(d < 1e-4, "{case}: mixed forms {d}");
    }
}

#[test]
fn the_cache_holds_one_latent_row_per_token_and_layer() {
    let case = "deepseekv3_yarn_f32";
    let cfg = ModelConfig::from_dir(&fixture(case)).expect("config");
    let mla = cfg.arch.mla.clone().expect("latent attention");
    let width = mla.kv_lora_rank + mla.qk_rope_head_dim;
    let layout = Checkpoint::open(&fixture(case))
        .expect("loads")
        .model
        .kv_layout(16);
    assert_eq!(layout.rows, KvRows::Latent);
    assert_eq!((layout.num_kv_heads, layout.head_dim), (1, width));
    assert_eq!(cfg.kv_bytes_per_token(), cfg.num_layers * width * 4);
    assert_eq!(layout.block_bytes(), cfg.num_layers * width * 16 * 4);
    for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Int8] {
        let kv = KvCache::with_dtype(layout, 3, dtype);
        let (k, v) = kv.block(1, 2);
        assert_eq!((k.len(), v.len()), (width * 16, 0), "{dtype}: no V");
    }
}

/// The same model with per-head K and V: a Llama of the same hidden size,
/// layers and heads, each head `qk_nope + qk_rope` wide (what the latent
/// expands to).
fn per_head_twin(cfg: &ModelConfig) -> ModelConfig {
    let mla = cfg.arch.mla.as_ref().expect("latent");
    ModelConfig::from_json(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
    }))
    .expect("twin config")
}

#[test]
fn a_pool_of_the_same_bytes_holds_more_tokens_than_per_head_kv() {
    let case = "deepseekv3_yarn_f32";
    let cfg = ModelConfig::from_dir(&fixture(case)).expect("config");
    let twin = per_head_twin(&cfg);
    let ratio = twin.kv_bytes_per_token() as f64 / cfg.kv_bytes_per_token() as f64;
    // 2 × 4 heads × 24 against 32 + 8 per layer.
    assert!((ratio - 4.8).abs() < 1e-9, "{ratio}");
    // The planner's pool, and the live engine's pool from the same bytes.
    let mut plan = CapacityPlan::new(64 << 20, 1 << 20);
    plan.kv_dtype = KvCacheDtype::F32;
    plan.max_num_batched_tokens = 64;
    let (latent, per_head) = (
        plan.plan(&cfg).expect("plan"),
        plan.plan(&twin).expect("plan"),
    );
    // Blocks, not pool tokens: the two models' activations differ.
    let planned = per_head.bytes_per_block as f64 / latent.bytes_per_block as f64;
    assert!((planned - ratio).abs() < 1e-9, "{planned} vs {ratio}");
    // Live: two engines given the same pool bytes, the latent model and a
    // GQA model of its hidden size, layers and heads (2 KV heads of 16).
    let bytes = 8 << 20;
    let config = EngineConfig {
        kv_pool: KvPoolSize::Bytes(bytes),
        ..EngineConfig::default()
    };
    let pool_tokens = |model: Model| {
        let core = EngineCore::new(model, None, vec![], &config).expect("engine");
        let s = core.stats();
        s.num_blocks * s.block_size
    };
    let latent_tokens = pool_tokens(Checkpoint::open(&fixture(case)).expect("loads").model);
    let gqa_dir = tempfile::tempdir().expect("tempdir");
    tandem_engine::synth::SynthConfig {
        hidden_size: cfg.hidden_size,
        num_layers: cfg.num_layers,
        num_heads: cfg.num_heads,
        num_kv_heads: 2,
        ..tandem_engine::synth::preset("tiny").expect("preset")
    }
    .write(gqa_dir.path(), 1, tandem_engine::DType::F32)
    .expect("write");
    let gqa = Model::load(gqa_dir.path()).expect("gqa");
    let gqa_per_token = gqa.config().kv_bytes_per_token();
    let gqa_tokens = pool_tokens(gqa);
    assert_eq!(latent_tokens / 16, bytes / (cfg.kv_bytes_per_token() * 16));
    let want = gqa_per_token as f64 / cfg.kv_bytes_per_token() as f64;
    let live = latent_tokens as f64 / gqa_tokens as f64;
    eprintln!("same bytes: {latent_tokens} latent tokens, {gqa_tokens} GQA tokens ({live:.3}x)");
    assert!((live - want).abs() < 0.01, "{live} vs {want}");
    assert!(live > 1.5, "{live}");
}

#[test]
fn sixteen_and_eight_bit_latent_caches_stay_close_to_f32() {
    let per_head = ["llama_gqa_f32", "qwen3moe_norm_f32"];
    for case in per_head.into_iter().chain(CASES) {
        let model = Checkpoint::open(&fixture(case)).expect("loads").model;
        let ids = reference_ids(case);
        let vocab = model.config().vocab_size;
        let reference = logits(&model, &ids, KvCacheDtype::F32, &[]);
        for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Int8] {
            let got = logits(&model, &ids, dtype, &[]);
            let (mut agree, mut rows) = (0, 0);
            let mut deltas = Vec::new();
            for (a, b) in reference.chunks(vocab).zip(got.chunks(vocab)) {
                let (mut a, mut b) = (a.to_vec(), b.to_vec());
                log_softmax(&mut a);
                log_softmax(&mut b);
                let top = argmax(&a);
                agree += usize::from(top == argmax(&b));
                rows += 1;
                deltas.push((a[top] - b[top]).abs());
            }
            deltas.sort_by(f32::total_cmp);
            let median = deltas[deltas.len() / 2];
            let agreement = agree as f64 / rows as f64;
            eprintln!("{case} {dtype}: top-1 agreement {agreement:.3}, median |Δlogprob| of f32's top {median:.3e}");
            assert!(agreement >= 0.9, "{case} {dtype}: agreement {agreement}");
            assert!(median < 0.05, "{case} {dtype}: median {median}");
        }
    }
}

fn fixture_config(case: &str) -> Value {
    let text = std::fs::read_to_string(fixture(case).join("config.json")).expect("config");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn malformed_latent_configs_are_refused_by_field() {
    let base = fixture_config("deepseekv3_yarn_f32");
    let refused = |edit: &dyn Fn(&mut Value), field: &str| {
        let mut c = base.clone();
        edit(&mut c);
        let err = ModelConfig::from_json(&c).expect_err(field).to_string();
        assert!(err.contains(field), "{field}: {err}");
    };
    refused(
        &|c| {
            c.as_object_mut().expect("object").remove("kv_lora_rank");
        },
        "kv_lora_rank",
    );
    refused(&|c| c["n_group"] = 3.into(), "n_group");
    refused(
        &|c| c["num_experts_per_tok"] = 9.into(),
        "num_experts_per_tok",
    );
    let mut v2 = fixture_config("deepseekv2_lite_f32");
    v2["topk_method"] = "noaux_tc".into();
    let err = ModelConfig::from_json(&v2)
        .expect_err("V2 method")
        .to_string();
    assert!(err.contains("noaux_tc"), "{err}");
}

/// A config that promises a low-rank query over a checkpoint without one is
/// refused naming the missing tensor; so is a LoRA adapter (latent
/// attention has no per-head q/k/v/o to adapt).
#[test]
fn a_missing_latent_tensor_and_a_lora_adapter_are_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = fixture("deepseekv3_plain_f32");
    std::fs::copy(
        src.join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .expect("copy");
    let mut c = fixture_config("deepseekv3_plain_f32");
    c["q_lora_rank"] = 16.into();
    std::fs::write(tmp.path().join("config.json"), c.to_string()).expect("write");
    let err = Model::load(tmp.path())
        .expect_err("no q_a_proj")
        .to_string();
    assert!(err.contains("q_a_proj"), "{err}");
    let cfg = ModelConfig::from_dir(&src).expect("config");
    let err = tandem_engine::lora::LoraAdapter::load("a", tmp.path(), &cfg, 64)
        .expect_err("no LoRA")
        .to_string();
    assert!(err.contains("latent attention"), "{err}");
}
