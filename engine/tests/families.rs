//! Checkpoints whose tensors contradict their config are refused at load,
//! by the tensor's name and the shape the config implies; configs the
//! engine cannot run are refused by the name of what is missing. Nothing
//! here may panic inside the engine.
//!
//! Each case starts from a checkpoint that loads (so the refusal is caused
//! by the one change the case makes) and breaks one thing.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use tandem_engine::{EngineError, Model, ModelConfig};

const H: usize = 32;
const HEADS: usize = 4;
const KV: usize = 2;
const D: usize = 8;
const INTER: usize = 48;
const VOCAB: usize = 64;

fn config(arch: &str) -> Value {
    json!({
        "architectures": [arch],
        "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 2,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
        "vocab_size": VOCAB, "tie_word_embeddings": false,
    })
}

/// The tensors of a two-layer checkpoint of `arch` (names as transformers
/// writes them), with their shapes.
fn tensors(arch: &str) -> Vec<(String, Vec<usize>)> {
    let (q, kv) = (HEADS * D, KV * D);
    let mut t = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, H]),
        ("model.norm.weight".to_string(), vec![H]),
        ("lm_head.weight".to_string(), vec![VOCAB, H]),
    ];
    for i in 0..2 {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        if arch == "Olmo2ForCausalLM" {
            // Norms on the outputs only; q/k norms over whole projections.
            t.push((p("post_feedforward_layernorm.weight"), vec![H]));
            t.push((p("self_attn.q_norm.weight"), vec![q]));
            t.push((p("self_attn.k_norm.weight"), vec![kv]));
        } else {
            t.push((p("input_layernorm.weight"), vec![H]));
        }
        t.push((p("post_attention_layernorm.weight"), vec![H]));
        t.push((p("self_attn.o_proj.weight"), vec![H, q]));
        t.push((p("mlp.down_proj.weight"), vec![H, INTER]));
        if arch == "Phi3ForCausalLM" {
            t.push((p("self_attn.qkv_proj.weight"), vec![q + 2 * kv, H]));
            t.push((p("mlp.gate_up_proj.weight"), vec![2 * INTER, H]));
            continue;
        }
        t.push((p("self_attn.q_proj.weight"), vec![q, H]));
        t.push((p("self_attn.k_proj.weight"), vec![kv, H]));
        t.push((p("self_attn.v_proj.weight"), vec![kv, H]));
        t.push((p("mlp.gate_proj.weight"), vec![INTER, H]));
        t.push((p("mlp.up_proj.weight"), vec![INTER, H]));
        if arch == "Qwen3ForCausalLM" {
            t.push((p("self_attn.q_norm.weight"), vec![D]));
            t.push((p("self_attn.k_norm.weight"), vec![D]));
        }
    }
    t
}

fn write(dir: &Path, config: &Value, tensors: &[(String, Vec<usize>)]) {
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
    let buffers: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes())
                .collect();
            (name.clone(), shape.clone(), bytes)
        })
        .collect();
    let mut views = BTreeMap::new();
    for (name, shape, bytes) in &buffers {
        let view = TensorView::new(Dtype::F32, shape.clone(), bytes).expect("view");
        views.insert(name.clone(), view);
    }
    safetensors::serialize_to_file(&views, None, &dir.join("model.safetensors")).expect("write");
}

/// Loads `arch`'s checkpoint after `edit` changed its tensor list.
fn load_with(
    arch: &str,
    edit: impl FnOnce(&mut Vec<(String, Vec<usize>)>),
) -> Result<Model, EngineError> {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut t = tensors(arch);
    edit(&mut t);
    write(dir.path(), &config(arch), &t);
    Model::load(dir.path())
}

fn set_shape(t: &mut [(String, Vec<usize>)], name: &str, shape: Vec<usize>) {
    let entry = t
        .iter_mut()
        .find(|(n, _)| n == name)
        .expect("tensor listed");
    entry.1 = shape;
}

#[test]
fn well_formed_checkpoints_of_each_family_load() {
    for arch in [
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "Olmo2ForCausalLM",
        "GraniteForCausalLM",
    ] {
        let m = load_with(arch, |_| {}).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(m.config().architecture.hf_name(), arch);
    }
}

#[test]
fn a_missing_q_norm_is_refused_by_name() {
    let name = "model.layers.1.self_attn.q_norm.weight";
    let err = load_with("Qwen3ForCausalLM", |t| t.retain(|(n, _)| n != name)).expect_err("refused");
    assert!(matches!(err, EngineError::InvalidCheckpoint(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(name) && msg.contains("missing"), "{msg}");
}

#[test]
fn a_q_norm_of_the_wrong_width_is_refused_with_the_expected_shape() {
    let name = "model.layers.0.self_attn.k_norm.weight";
    let err = load_with("Qwen3ForCausalLM", |t| set_shape(t, name, vec![H])).expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains(name), "{msg}");
    assert!(msg.contains(&format!("[{H}]")), "found shape: {msg}");
    assert!(msg.contains(&format!("[{D}]")), "expected shape: {msg}");
}

#[test]
fn olmo2_norms_are_checked_at_their_own_widths_and_names() {
    let name = "model.layers.1.post_feedforward_layernorm.weight";
    let err = load_with("Olmo2ForCausalLM", |t| t.retain(|(n, _)| n != name)).expect_err("refused");
    assert!(err.to_string().contains(name), "{err}");
    // A per-head k_norm (Qwen3's shape) where OLMo 2 norms the whole
    // projection.
    let name = "model.layers.0.self_attn.k_norm.weight";
    let err = load_with("Olmo2ForCausalLM", |t| set_shape(t, name, vec![D])).expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains(name), "{msg}");
    assert!(
        msg.contains(&format!("[{}]", KV * D)),
        "expected shape: {msg}"
    );
}

#[test]
fn olmo2_is_refused_a_tensor_parallel_split_by_its_norm() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(
        dir.path(),
        &config("Olmo2ForCausalLM"),
        &tensors("Olmo2ForCausalLM"),
    );
    let err = Model::load_shard(dir.path(), 2, 0, 1, 0).expect_err("refused");
    assert!(matches!(err, EngineError::Unsupported(_)), "{err:?}");
    assert!(err.to_string().contains("q/k RMSNorm"), "{err}");
    Model::load_shard(dir.path(), 1, 0, 2, 1).expect("a pipeline split is fine");
}

#[test]
fn a_projection_of_the_wrong_shape_is_refused_with_the_expected_shape() {
    let name = "model.layers.1.self_attn.k_proj.weight";
    let err = load_with("LlamaForCausalLM", |t| {
        set_shape(t, name, vec![HEADS * D, H])
    })
    .expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains(name), "{msg}");
    assert!(msg.contains(&format!("[{}, {H}]", KV * D)), "{msg}");
}

#[test]
fn a_fused_tensor_of_the_wrong_width_is_refused_with_the_expected_shape() {
    let (q, kv) = (HEADS * D, KV * D);
    let name = "model.layers.0.self_attn.qkv_proj.weight";
    // As if the checkpoint had as many KV heads as query heads.
    let err =
        load_with("Phi3ForCausalLM", |t| set_shape(t, name, vec![3 * q, H])).expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains(name), "{msg}");
    assert!(msg.contains(&format!("[{}, {H}]", q + 2 * kv)), "{msg}");
    let name = "model.layers.1.mlp.gate_up_proj.weight";
    let err =
        load_with("Phi3ForCausalLM", |t| set_shape(t, name, vec![INTER, H])).expect_err("refused");
    let msg = err.to_string();
    assert!(
        msg.contains(name) && msg.contains(&format!("[{}, {H}]", 2 * INTER)),
        "{msg}"
    );
}

#[test]
fn split_projections_in_a_fused_family_are_refused_by_the_fused_name() {
    // A Phi-3 config over Llama-style tensors.
    let dir = tempfile::tempdir().expect("tempdir");
    write(
        dir.path(),
        &config("Phi3ForCausalLM"),
        &tensors("LlamaForCausalLM"),
    );
    let msg = Model::load(dir.path()).expect_err("refused").to_string();
    assert!(msg.contains("self_attn.qkv_proj.weight"), "{msg}");
}

#[test]
fn unknown_rope_types_and_partial_rotary_are_refused_by_name() {
    let mut c = config("Qwen3ForCausalLM");
    c["rope_scaling"] = json!({"rope_type": "mrope", "mrope_section": [2, 1, 1]});
    let err = ModelConfig::from_json(&c).expect_err("refused");
    assert!(matches!(err, EngineError::Unsupported(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("mrope") && msg.contains("longrope"), "{msg}");
    let mut c = config("Phi3ForCausalLM");
    c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e4,
        "partial_rotary_factor": 0.75});
    let err = ModelConfig::from_json(&c).expect_err("refused");
    assert!(err.to_string().contains("partial_rotary_factor"), "{err}");
}

#[test]
fn malformed_rope_scalings_are_refused_by_field() {
    for (rope, want) in [
        // One factor per rotated pair: head_dim 8 has 4.
        (
            json!({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 1.0, 1.0, 1.0]}),
            "short_factor",
        ),
        (
            json!({"rope_type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0]}),
            "long_factor",
        ),
        (json!({"rope_type": "dynamic"}), "factor"),
        (json!({"rope_type": "yarn", "factor": -2.0}), "factor"),
    ] {
        let mut c = config("Qwen3ForCausalLM");
        c["rope_scaling"] = rope.clone();
        let err = ModelConfig::from_json(&c).expect_err("refused");
        assert!(
            matches!(err, EngineError::InvalidCheckpoint(_)),
            "{rope}: {err:?}"
        );
        assert!(err.to_string().contains(want), "{rope}: {err}");
    }
}

#[test]
fn phi3s_early_rope_spellings_are_longrope() {
    let factors = json!([1.0, 1.5, 2.0, 4.0]);
    let mut c = config("Phi3ForCausalLM");
    c["max_position_embeddings"] = json!(4096);
    c["original_max_position_embeddings"] = json!(1024);
    for kind in ["su", "yarn", "longrope"] {
        c["rope_scaling"] = json!({"type": kind, "short_factor": factors, "long_factor": factors});
        let got = ModelConfig::from_json(&c).expect("loads").rope_scaling;
        let tandem_engine::RopeScaling::LongRope {
            original_max_position_embeddings,
            attention_factor,
            ..
        } = got
        else {
            panic!("{kind}: {got:?}");
        };
        assert_eq!(original_max_position_embeddings, 1024);
        // sqrt(1 + ln(4096 / 1024) / ln(1024)), transformers' default.
        let want = (1.0 + 4f64.ln() / 1024f64.ln()).sqrt();
        assert!(
            (attention_factor - want).abs() < 1e-12,
            "{attention_factor}"
        );
    }
    // Elsewhere `yarn` is YaRN.
    let mut c = config("Qwen3ForCausalLM");
    c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    let got = ModelConfig::from_json(&c).expect("loads").rope_scaling;
    assert!(
        matches!(got, tandem_engine::RopeScaling::Yarn { .. }),
        "{got:?}"
    );
}

#[test]
fn a_multimodal_config_without_text_config_is_refused() {
    let c = json!({"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}});
    let err = ModelConfig::from_json(&c).expect_err("refused");
    assert!(err.to_string().contains("text_config"), "{err}");
}

#[test]
fn an_unsupported_architecture_lists_what_is_supported() {
    let err = ModelConfig::from_json(&config("FalconForCausalLM")).expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains("FalconForCausalLM"), "{msg}");
    for known in [
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "Olmo2ForCausalLM",
        "GraniteForCausalLM",
    ] {
        assert!(msg.contains(known), "{msg}");
    }
}
