//! The capacity arithmetic against its formulas and real checkpoints.

use super::*;

/// hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads of 16,
/// vocab 512, 512 positions.
fn tiny() -> ModelConfig {
    ModelConfig::from_json(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 512,
    }))
    .expect("valid config")
}

#[test]
fn sliding_window_layers_hold_their_window_only() {
    // Gemma 3's pattern over 6 layers: 5 windowed (window 128), 1 global.
    let types: Vec<&str> = (0..6)
        .map(|l| {
            if l == 5 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let cfg = ModelConfig::from_json(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 4096, "sliding_window": 128, "layer_types": types,
    }))
    .expect("valid config");
    let c = CapacityPlan::new(1 << 30, 0).plan(&cfg).expect("fits");
    // One layer per block: 16 tokens × 2 × 2 heads × 16 dims × 4 bytes.
    assert_eq!((c.layers_per_block, c.bytes_per_block), (1, 4096));
    assert_eq!((c.sliding_window, c.windowed_layers), (128, 5));
    // 256 blocks for the global layer; the next token's window reads
    // positions 3969.. (blocks 248..256) in each windowed layer.
    assert_eq!(c.blocks_per_seq, 256 + 5 * 8);
    assert_eq!(c.global_blocks_per_seq, 6 * 256);
    assert_eq!(c.pool_tokens, c.pool_blocks * 16 / 6);
    assert_eq!(c.max_concurrent_seqs, c.pool_blocks / 296);
    assert!(c
        .to_string()
        .contains("holds 296 blocks, 1536 without freeing"));
}

#[test]
fn kv_bytes_per_token_by_dtype() {
    let cfg = tiny();
    // 2 × 2 layers × 2 heads × 16 dims = 128 elements.
    assert_eq!(kv_bytes_per_token(&cfg, KvCacheDtype::F32), 512);
    assert_eq!(kv_bytes_per_token(&cfg, KvCacheDtype::Bf16), 256);
    assert_eq!(kv_bytes_per_token(&cfg, KvCacheDtype::F16), 256);
    assert_eq!(kv_bytes_per_token(&cfg, KvCacheDtype::Fp8E4m3), 128);
    assert_eq!(
        kv_bytes_per_token(&cfg, KvCacheDtype::F32),
        cfg.kv_bytes_per_token() as u64
    );
}

#[test]
fn activation_bytes_follow_the_formula() {
    let cfg = tiny();
    // Per token: 2·64 + 64 + 2·32 + 64 + 2·128 = 576 floats = 2304 B;
    // × 2048 tokens = 4_718_592. Logits: 256 rows × 512 × 4 = 524_288.
    assert_eq!(activation_bytes(&cfg, 2048, 256), 5_242_880);
    // Fewer tokens than sequences: one logits row per token at most.
    assert_eq!(activation_bytes(&cfg, 8, 256), 8 * 2304 + 8 * 512 * 4);
}

#[test]
fn plan_with_hand_computed_numbers() {
    let cfg = tiny();
    let plan = CapacityPlan::new(16 << 20, 1_000_000);
    let c = plan.plan(&cfg).expect("fits");
    // 16 MiB − 1_000_000 − 5_242_880 = 10_534_336 bytes for KV;
    // 16 tokens × 512 B = 8192 B per block → 1285 blocks.
    assert_eq!(c.activation_bytes, 5_242_880);
    assert_eq!(c.bytes_per_block, 8192);
    assert_eq!(c.pool_blocks, 1285);
    assert_eq!(c.pool_tokens, 20_560);
    assert_eq!(c.kv_pool_bytes, 1285 * 8192);
    // 512 positions / 16 = 32 blocks per sequence → 40 sequences.
    assert_eq!(c.max_model_len, 512);
    assert_eq!(c.blocks_per_seq, 32);
    assert_eq!(c.max_concurrent_seqs, 40);

    let c = CapacityPlan {
        kv_dtype: KvCacheDtype::Fp8E4m3,
        block_size: 32,
        max_model_len: Some(100),
        ..plan.clone()
    }
    .plan(&cfg)
    .expect("fits");
    // 128 B/token × 32 + 2 (K, V) × 2 layers × 32 tokens × 2 heads × 2 B
    // of f16 row scales + an eighth of a bf16 copy (4096 × 2 / 8) = 5632 B
    // per block → 10_534_336 / 5632 = 1870 blocks; 100 tokens round up to
    // 4 blocks → 467 sequences.
    assert_eq!(c.bytes_per_block, 5632);
    assert_eq!(c.pool_blocks, 1870);
    assert_eq!(c.blocks_per_seq, 4);
    assert_eq!(c.max_concurrent_seqs, 467);
    assert!(c.to_string().contains("1870 blocks"), "{c}");
}

/// An 8-bit KV pool plans the engine's own block bytes, and holds
/// `2·head_dim / (head_dim + 2)` times the blocks of a 16-bit one.
#[test]
fn eight_bit_kv_nearly_doubles_a_sixteen_bit_pool_and_fp8_pays_for_its_window() {
    let cfg = tiny();
    let plan = CapacityPlan::new(1 << 30, 0);
    let bf16 = CapacityPlan {
        kv_dtype: KvCacheDtype::Bf16,
        ..plan.clone()
    }
    .plan(&cfg)
    .expect("fits");
    let layout = crate::KvLayout {
        rows: crate::KvRows::PerHead,
        num_layers: cfg.num_layers,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        block_size: plan.block_size,
        sliding: crate::SlidingLayers::NONE,
    };
    assert_eq!(
        bf16.bytes_per_block as usize,
        KvCacheDtype::Bf16.block_bytes(&layout)
    );
    assert_eq!(
        KvCacheDtype::F16.block_bytes(&layout) * 2,
        KvCacheDtype::F32.block_bytes(&layout)
    );
    for dtype in [KvCacheDtype::Int8, KvCacheDtype::Fp8E4m3] {
        let c = CapacityPlan {
            kv_dtype: dtype,
            ..plan.clone()
        }
        .plan(&cfg)
        .expect("fits");
        assert_eq!(c.bytes_per_block as usize, dtype.block_bytes(&layout));
        // A row of `head_dim` codes plus a 2-byte scale against
        // `2 · head_dim` bytes: 1.78x at this tiny model's head_dim of 16,
        // 1.94x at 64, 1.97x at 128. FP8 adds an eighth of a bf16 copy
        // (`d / 4` bytes a row, its recent window): 1.45x, 1.56x, 1.58x.
        let ratio = c.pool_blocks as f64 / bf16.pool_blocks as f64;
        let d = cfg.head_dim as f64;
        let copies = if dtype == KvCacheDtype::Fp8E4m3 {
            d / 4.0
        } else {
            0.0
        };
        let want = 2.0 * d / (d + 2.0 + copies);
        assert!(
            (ratio / want - 1.0).abs() < 0.01,
            "{dtype}: {ratio} vs {want}"
        );
    }
}

#[test]
fn plan_errors_say_what_to_change() {
    let cfg = tiny();
    let err = CapacityPlan::new(6_000_000, 1_000_000)
        .plan(&cfg)
        .expect_err("5.24 MB of activations + 1 MB of weights > 6 MB");
    assert!(matches!(err, CapacityError::InsufficientMemory { .. }));
    assert!(err.to_string().contains("max_num_batched_tokens"), "{err}");
    let exact = CapacityPlan::new(1_000_000 + 5_242_880, 1_000_000).plan(&cfg);
    assert!(exact.is_err(), "no room for a single block is an error");

    let err = CapacityPlan {
        max_model_len: Some(513),
        ..CapacityPlan::new(1 << 30, 0)
    }
    .plan(&cfg)
    .expect_err("longer than the model");
    assert_eq!(
        err,
        CapacityError::MaxModelLenTooLong {
            requested: 513,
            limit: 512
        }
    );
    let err = CapacityPlan {
        block_size: 0,
        ..CapacityPlan::new(1 << 30, 0)
    }
    .plan(&cfg)
    .expect_err("zero block size");
    assert_eq!(err, CapacityError::Zero("block_size"));
}

#[test]
fn a_pool_smaller_than_one_sequence_plans_zero_concurrency() {
    let cfg = tiny();
    // Room for 10 blocks; a 512-token sequence needs 32.
    let c = CapacityPlan::new(5_242_880 + 10 * 8192, 0)
        .plan(&cfg)
        .expect("fits");
    assert_eq!((c.pool_blocks, c.max_concurrent_seqs), (10, 0));
}

#[test]
fn memory_sizes_parse() {
    for (text, bytes) in [
        ("16GiB", 16u64 << 30),
        ("16 gib", 16 << 30),
        ("512MiB", 512 << 20),
        ("512Mi", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 << 29),
        ("1000000", 1_000_000),
        ("1_000_000", 1_000_000),
        ("42B", 42),
        ("2k", 2000),
        ("2KiB", 2048),
        ("1TB", 1_000_000_000_000),
        ("0.5", 0),
    ] {
        assert_eq!(parse_memory_size(text), Ok(bytes), "{text}");
    }
    for bad in [
        "",
        "GiB",
        "16 GiBs",
        "-1GiB",
        "1.2.3",
        "1e9",
        "99999999999TiB",
    ] {
        assert_eq!(
            parse_memory_size(bad),
            Err(CapacityError::InvalidMemorySize(bad.to_string())),
            "{bad}"
        );
    }
}

#[test]
fn kv_dtypes_parse_and_print() {
    for d in KvCacheDtype::ALL {
        assert_eq!(d.name().parse::<KvCacheDtype>(), Ok(d));
        assert_eq!(d.to_string(), d.name());
    }
    assert_eq!("BFloat16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Bf16));
    assert_eq!("fp8".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Fp8E4m3));
    assert!("int4".parse::<KvCacheDtype>().is_err());
}

#[test]
fn bytes_format_with_binary_units() {
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(3 << 29), "1.50 GiB");
    assert_eq!(format_bytes(16 << 20), "16.00 MiB");
}

#[test]
fn weight_bytes_come_from_the_headers() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::synth::preset("tiny")
        .expect("preset")
        .write(dir.path(), 0, crate::DType::Bf16)
        .expect("write");
    let cfg = ModelConfig::from_dir(dir.path()).expect("config");
    let bytes = checkpoint_weight_bytes(dir.path()).expect("headers");
    // Every tensor's data, 2 bytes per bf16 parameter.
    let params = synth_params(&cfg);
    assert_eq!(bytes, params * 2);

    // Sharded: the same tensors split over two files behind an index.
    let sharded = tempfile::tempdir().expect("tempdir");
    let data = std::fs::read(dir.path().join("model.safetensors")).expect("read");
    std::fs::write(sharded.path().join("a.safetensors"), &data).expect("write");
    std::fs::write(sharded.path().join("b.safetensors"), &data).expect("write");
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"}}"#,
    )
    .expect("write");
    assert_eq!(
        checkpoint_weight_bytes(sharded.path()).expect("sharded"),
        2 * bytes
    );

    // A truncated file is an error, not a wrong number.
    std::fs::write(
        sharded.path().join("b.safetensors"),
        &data[..data.len() - 1],
    )
    .expect("write");
    let err = checkpoint_weight_bytes(sharded.path()).expect_err("truncated");
    assert!(err.to_string().contains("data_offsets"), "{err}");
    let empty = tempfile::tempdir().expect("tempdir");
    assert!(matches!(
        checkpoint_weight_bytes(empty.path()),
        Err(EngineError::MissingFile { .. })
    ));
}

/// The INT4 plan counts exactly what quantizing at load changes in the
/// loaded model.
#[test]
fn int4_weight_bytes_match_the_quantized_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::synth::preset("tiny")
        .expect("preset")
        .write(dir.path(), 0, crate::DType::Bf16)
        .expect("write");
    let stored = checkpoint_weight_bytes(dir.path()).expect("headers");
    let planned = checkpoint_weight_bytes_int4(dir.path(), 64).expect("headers");
    let mut model = crate::Model::load(dir.path()).expect("load");
    let dense = model.weight_bytes() as u64;
    model
        .quantize_int4(crate::quant::Int4Config::new(64).expect("group"))
        .expect("quantize");
    let int4 = model.weight_bytes() as u64;
    assert!(int4 < dense, "{int4} vs {dense}");
    assert_eq!(stored - planned, dense - int4);
}

/// Parameters of a Llama checkpoint with untied embeddings.
fn synth_params(cfg: &ModelConfig) -> u64 {
    let h = cfg.hidden_size as u64;
    let q = (cfg.num_heads * cfg.head_dim) as u64;
    let kv = (cfg.num_kv_heads * cfg.head_dim) as u64;
    let i = cfg.intermediate_size as u64;
    let v = cfg.vocab_size as u64;
    let layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
    let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
    cfg.num_layers as u64 * layer + heads * v * h + h
}
