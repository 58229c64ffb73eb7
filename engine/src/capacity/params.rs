//! Parameter counts: every parameter the checkpoint stores, and those one
//! token's forward pass reads. They differ for a mixture of experts: a
//! token runs `top_k` of each sparse layer's experts (and the shared one),
//! so the other experts' weights are stored but not read for it. Decode at
//! small batch is bound by the bytes it reads, which follow the active
//! count; memory follows the total.

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::Result;

/// A model's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCounts {
    /// Every element of every tensor in the checkpoint.
    pub total: u64,
    /// What one token's forward pass reads: `total` less, on every sparse
    /// layer, the experts it does not run.
    pub active: u64,
    /// Parameters of the routed experts (all of them, every sparse layer).
    pub experts: u64,
}

/// Counts `dir`'s parameters from its safetensors headers or GGUF tensor
/// table (no tensor data is read) and `cfg`'s experts.
pub fn parameter_counts(dir: &Path, cfg: &ModelConfig) -> Result<ParamCounts> {
    let total = super::sum_tensors(dir, &|_, shape, _| shape.iter().product())?;
    let Some(moe) = &cfg.arch.moe else {
        return Ok(ParamCounts {
            total,
            active: total,
            experts: 0,
        });
    };
    let per_expert = 3 * (cfg.hidden_size * moe.expert_intermediate) as u64;
    let sparse = moe.sparse_count() as u64;
    let experts = sparse * moe.num_experts as u64 * per_expert;
    let idle = sparse * (moe.num_experts - moe.top_k) as u64 * per_expert;
    Ok(ParamCounts {
        total,
        active: total.saturating_sub(idle),
        experts,
    })
}

/// Weight bytes of the largest rank (rank 0, which also runs the output
/// head) when one stage is split over `ranks` processes (`--tp` × `--ep`):
/// the embedding, head, norms and routers are replicated; every other
/// weight (attention, dense MLPs, experts by index and feature) divides
/// over the ranks. An estimate from the counts: with fewer KV heads than
/// ranks the k/v projections are replicated too, and the real shard is a
/// little larger.
pub fn weight_bytes_per_rank(
    cfg: &ModelConfig,
    p: &ParamCounts,
    stored_bytes: u64,
    ranks: usize,
) -> u64 {
    if ranks <= 1 || p.total == 0 {
        return stored_bytes;
    }
    let h = cfg.hidden_size as u64;
    let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
    let norms = cfg.num_layers as u64 * (2 * h + 2 * cfg.head_dim as u64) + h;
    let routers = cfg
        .arch
        .moe
        .as_ref()
        .map_or(0, |m| m.sparse_count() as u64 * m.num_experts as u64 * h);
    let replicated = (heads * cfg.vocab_size as u64 * h + norms + routers).min(p.total);
    let per_param = stored_bytes as f64 / p.total as f64;
    let params = replicated + (p.total - replicated).div_ceil(ranks as u64);
    (params as f64 * per_param) as u64
}

/// `1.23B`, `456.7M`, `89.0K`, `512`.
pub fn format_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden(case: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/golden")
            .join(case)
    }

    #[test]
    fn a_dense_model_reads_every_parameter() {
        let dir = golden("qwen3_gqa_f32");
        let cfg = ModelConfig::from_dir(&dir).expect("config");
        let p = parameter_counts(&dir, &cfg).expect("count");
        assert_eq!(p.active, p.total);
        assert_eq!(p.experts, 0);
        let model = crate::Model::load(&dir).expect("load");
        assert_eq!(
            p.total * 4,
            model.weight_bytes() as u64 + embedding_and_norms(&cfg)
        );
    }

    /// The f32 bytes of what `weight_bytes` leaves out: the embedding (the
    /// head is separate here), the norms.
    fn embedding_and_norms(cfg: &ModelConfig) -> u64 {
        let h = cfg.hidden_size as u64;
        let d = cfg.head_dim as u64;
        let per_layer = 2 * h + 2 * d;
        4 * (cfg.vocab_size as u64 * h + h + cfg.num_layers as u64 * per_layer)
    }

    #[test]
    fn a_mixture_of_experts_reads_top_k_of_its_experts() {
        // Two sparse layers of 8 experts (top 2, 64 wide) around a dense one.
        let dir = golden("qwen3moe_norm_f32");
        let cfg = ModelConfig::from_dir(&dir).expect("config");
        let p = parameter_counts(&dir, &cfg).expect("count");
        let per_expert = 3 * 64 * 64;
        assert_eq!(p.experts, 2 * 8 * per_expert);
        assert_eq!(p.total - p.active, 2 * 6 * per_expert);
    }

    #[test]
    fn a_ranks_estimated_share_is_what_it_loads() {
        let dir = golden("qwen3moe_norm_f32");
        let cfg = ModelConfig::from_dir(&dir).expect("config");
        let p = parameter_counts(&dir, &cfg).expect("count");
        let stored = super::super::checkpoint_weight_bytes(&dir).expect("bytes");
        assert_eq!(weight_bytes_per_rank(&cfg, &p, stored, 1), stored);
        // Two ranks in two expert groups: 2 KV heads, so none replicated.
        let split = crate::shard::Split {
            tp: 2,
            tp_rank: 0,
            pp: 1,
            stage: 0,
            ep: 2,
        };
        let rank0 = crate::Model::load_split(&dir, split).expect("rank 0");
        let embedding = (cfg.vocab_size * cfg.hidden_size * 4) as u64;
        let norms = 4 * (3 * (2 * 64 + 2 * 32) + 64) as u64;
        let loaded = rank0.weight_bytes() as u64 + embedding + norms;
        assert_eq!(weight_bytes_per_rank(&cfg, &p, stored, 2), loaded);
    }

    #[test]
    fn counts_read_as_people_write_them() {
        assert_eq!(format_count(30_532_122_624), "30.53B");
        assert_eq!(format_count(3_300_000), "3.3M");
        assert_eq!(format_count(999), "999");
    }
}
