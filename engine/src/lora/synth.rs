//! Deterministic random PEFT adapters for any model shape, for benchmarks
//! and plumbing tests (parity is tested against adapters PEFT itself wrote,
//! `tests/golden/make_lora.py`).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use super::LoraTarget;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::sampling::Rng;

/// Writes `adapter_config.json` and `adapter_model.safetensors` of a rank-
/// `rank` adapter of `targets` in every layer of a model of `config`, with
/// `A ~ N(0, 1/in)` and `B ~ N(0, 1/r)` scaled so it moves the logits
/// visibly (PEFT itself starts `B` at zero, which would change nothing).
pub fn write_random_adapter(
    dir: &Path,
    config: &ModelConfig,
    rank: usize,
    targets: &[LoraTarget],
    seed: u64,
) -> Result<()> {
    let io = |source| EngineError::Io {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut rng = Rng::seeded(seed);
    let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in 0..config.num_layers {
        for &t in targets {
            let (inp, out) = t.shape(config);
            let parent = if t.is_mlp() { "mlp" } else { "self_attn" };
            let prefix = format!(
                "base_model.model.model.layers.{layer}.{parent}.{}",
                t.module()
            );
            for (suffix, shape, std) in [
                ("lora_A", vec![rank, inp], 1.0 / (inp as f32).sqrt()),
                ("lora_B", vec![out, rank], 0.5 / (rank as f32).sqrt()),
            ] {
                let n: usize = shape.iter().product();
                let bytes = (0..n)
                    .flat_map(|_| (std * super::normal(&mut rng)).to_le_bytes())
                    .collect();
                buffers.push((format!("{prefix}.{suffix}.weight"), shape, bytes));
            }
        }
    }
    let mut views = BTreeMap::new();
    for (name, shape, bytes) in &buffers {
        let view = TensorView::new(Dtype::F32, shape.clone(), bytes)
            .map_err(|e| EngineError::InvalidCheckpoint(e.to_string()))?;
        views.insert(name.clone(), view);
    }
    safetensors::serialize_to_file(&views, None, &dir.join("adapter_model.safetensors"))
        .map_err(|e| EngineError::InvalidCheckpoint(format!("writing an adapter: {e}")))?;
    let modules: Vec<&str> = targets.iter().map(|t| t.module()).collect();
    let cfg = json!({
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
        "fan_in_fan_out": false,
    });
    let path = dir.join("adapter_config.json");
    std::fs::write(&path, cfg.to_string()).map_err(|source| EngineError::Io { path, source })
}
