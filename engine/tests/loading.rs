//! Checkpoint loading: sharded safetensors, memory mapping, dtypes.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::SafeTensors;
use tandem_engine::{synth, BlockAllocator, BlockTable, DType, KvCache, Model, SeqInput};

fn last_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let bs = 8;
    let pool = BlockAllocator::new(tokens.len().div_ceil(bs), bs).expect("pool");
    let mut kv = KvCache::new(model.kv_layout(bs), pool.num_blocks());
    let mut table = BlockTable::new(&pool);
    table.append(tokens.len()).expect("blocks");
    let out = model
        .forward(
            &[SeqInput {
                tokens,
                start_pos: 0,
                blocks: table.blocks(),
                all_logits: false,
                lora: None,
            }],
            &mut kv,
        )
        .expect("forward");
    out.last(0).to_vec()
}

/// Rewrites `dir/model.safetensors` as two shards plus an index, the layout
/// Hugging Face uses for large checkpoints.
fn shard(dir: &Path) {
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("parse");
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [a, b].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: BTreeMap<String, _> = part
            .iter()
            .map(|n| (n.clone(), st.tensor(n).expect("tensor")))
            .collect();
        safetensors::serialize_to_file(&views, None, &dir.join(&file)).expect("write shard");
        for n in part.iter() {
            weight_map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    std::fs::remove_file(dir.join("model.safetensors")).expect("rm");
}

#[test]
fn sharded_checkpoint_gives_identical_logits() {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset("tiny")
        .expect("preset")
        .write(tmp.path(), 3, DType::F32)
        .expect("write");
    let tokens = [1u32, 50, 99, 7, 300, 2, 11];
    let single = last_logits(&Model::load(tmp.path()).expect("load"), &tokens);
    shard(tmp.path());
    let sharded = Model::load(tmp.path()).expect("load sharded");
    assert_eq!(single, last_logits(&sharded, &tokens));
}

#[test]
fn weights_are_memory_mapped_and_half_dtypes_agree_with_f32() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let tokens = [1u32, 2, 3, 4, 5];
    let mut logits = Vec::new();
    for (name, dtype) in [
        ("f32", DType::F32),
        ("bf16", DType::Bf16),
        ("f16", DType::F16),
    ] {
        let dir = tmp.path().join(name);
        synth::preset("tiny-mqa")
            .expect("preset")
            .write(&dir, 5, dtype)
            .expect("write");
        let model = Model::load(&dir).expect("load");
        assert_eq!(model.weight_dtype(), dtype);
        assert!(
            model.weights_mapped(),
            "{name} weights should be read in place"
        );
        logits.push(last_logits(&model, &tokens));
    }
    // Rounding weights to 16 bits moves logits a little, not a lot.
    for half in &logits[1..] {
        let worst = half
            .iter()
            .zip(&logits[0])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 5e-3, "half-precision logits drift {worst}");
        assert!(
            worst > 0.0,
            "rounded weights cannot give bit-identical logits"
        );
    }
}
