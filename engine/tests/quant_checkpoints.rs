//! Pre-quantized AWQ and GPTQ checkpoints (tests/fixtures/quant, written by
//! its `make_quant_fixtures.py` from the formats' packing rules) load and
//! match the same layers dequantized to f32 by the script.

use std::path::PathBuf;

use tandem_engine::quant::eval::{compare_models, score};
use tandem_engine::quant::hf::{HfMethod, HfQuantization};
use tandem_engine::weights::WeightStore;
use tandem_engine::{Model, ModelConfig};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/quant")
        .join(name)
}

const LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

fn shape(c: &ModelConfig, name: &str) -> (usize, usize) {
    let (h, q, kv, i) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    );
    match name {
        "self_attn.q_proj" => (q, h),
        "self_attn.k_proj" | "self_attn.v_proj" => (kv, h),
        "self_attn.o_proj" => (h, q),
        "mlp.gate_proj" | "mlp.up_proj" => (i, h),
        _ => (h, i),
    }
}

#[test]
fn awq_and_gptq_layers_unpack_to_the_reference_weights() {
    let reference = WeightStore::open(&fixture("reference")).expect("reference");
    for (name, method) in [
        ("awq", HfMethod::Awq),
        (
            "gptq",
            HfMethod::Gptq {
                zeros_minus_one: true,
            },
        ),
    ] {
        let dir = fixture(name);
        let config = ModelConfig::from_dir(&dir).expect("config");
        let quant = HfQuantization::from_dir(&dir)
            .expect("config")
            .expect("quantization_config");
        assert_eq!(quant.method, method);
        assert_eq!(quant.group_size, Some(32));
        let ws = WeightStore::open(&dir).expect("weights");
        for layer in 0..config.num_layers {
            for lin in LINEARS {
                let prefix = format!("model.layers.{layer}.{lin}");
                let (out, inp) = shape(&config, lin);
                let q = quant.load_linear(&ws, &prefix, out, inp).expect("load");
                let want = reference
                    .matrix(&format!("{prefix}.weight"), out, inp)
                    .expect("reference matrix");
                let got = q.to_f32();
                let mut row = vec![0f32; inp];
                for r in 0..out {
                    want.row_to_f32(r, &mut row);
                    for (c, (a, b)) in got[r * inp..(r + 1) * inp].iter().zip(&row).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-6,
                            "{name} {prefix} ({r},{c}): {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

/// Prefill-sized steps (more than 48 rows) dequantize and run the f32 GEMM:
/// the same logits as the reference. Decode-sized steps run the integer
/// kernels on int8 activations: close, within the accuracy bounds.
#[test]
fn awq_and_gptq_models_match_their_dequantized_reference() {
    let reference = Model::load(&fixture("reference")).expect("reference");
    assert_eq!(reference.int4_matrices(), 0);
    let vocab = reference.config().vocab_size as u32;
    let tokens = |len: u32, s: u32| -> Vec<u32> {
        (0..len).map(|i| (i * 37 + s * 11 + 5) % vocab).collect()
    };
    let long: Vec<Vec<u32>> = (0..3).map(|s| tokens(64, s)).collect();
    let short: Vec<Vec<u32>> = (0..6).map(|s| tokens(40, s)).collect();
    for name in ["awq", "gptq"] {
        let model = Model::load(&fixture(name)).expect("load");
        assert_eq!(model.int4_matrices(), 7 * model.config().num_layers);
        for seq in &long {
            let want = score(&reference, seq).expect("score");
            let got = score(&model, seq).expect("score");
            let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-4 * range, "{name} prefill: {a} vs {b}");
            }
        }
        let a = compare_models(&reference, &model, &short).expect("compare");
        eprintln!(
            "{name} decode-sized steps: top-1 {:.3} over {} positions, mean |Δlogprob| {:.5}, max {:.4}",
            a.top1, a.positions, a.mean_logprob_error, a.max_logprob_error
        );
        assert!(a.top1 >= 0.95, "{name}: top-1 {:.3}", a.top1);
        assert!(
            a.mean_logprob_error <= 0.05,
            "{name}: {:.5}",
            a.mean_logprob_error
        );
    }
}

#[test]
fn a_3_bit_checkpoint_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("tmp");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("gptq").join(f), dir.path().join(f)).expect("copy");
    }
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    cfg["quantization_config"]["bits"] = 3.into();
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let err = Model::load(dir.path()).expect_err("3-bit refused");
    assert!(err.to_string().contains("only 4-bit"), "{err}");
}
