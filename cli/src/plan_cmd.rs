//! `tandem plan`: how a memory budget splits into weights, activations and
//! the KV pool for one model, and how many full-length sequences fit.
//!
//! The model is not loaded: the config comes from `config.json` and the
//! weight bytes from the safetensors headers. The arithmetic is
//! `tandem_engine::capacity`'s, the same the engine logs at start-up.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use tandem_engine::capacity::{
    checkpoint_weight_bytes, checkpoint_weight_bytes_int4, format_bytes, format_count,
    parameter_counts, parse_memory_size, weight_bytes_per_rank, Capacity, CapacityPlan,
    ParamCounts, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
};
use tandem_engine::{KvCacheDtype, ModelConfig};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Hugging Face checkpoint directory (default: the built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The memory budget for weights, activations and KV: bytes or a size
    /// such as 16GiB, 512MiB, 1.5GB.
    #[arg(long, value_parser = parse_memory_size)]
    memory: u64,
    /// The longest sequence to plan for (default: the model's context:
    /// max_position_embeddings, extended by its rope scaling).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// What the KV cache stores: auto (the checkpoint's weight dtype, the
    /// serving default), f32, bf16, f16, int8 or fp8-e4m3 (the 8-bit ones
    /// with an f16 scale per token and KV head), as the serving commands'
    /// `--kv-dtype` spells them.
    #[arg(long, default_value = "auto", value_parser = crate::engine_args::parse_kv_dtype_choice)]
    kv_dtype: crate::engine_args::KvDtypeChoice,
    /// Plan for weights quantized at load (`tandem serve --quantize int4`).
    #[arg(long, value_enum)]
    quantize: Option<crate::engine_args::Quantize>,
    /// INT4 group size (with `--quantize int4`).
    #[arg(long, default_value_t = tandem_engine::quant::DEFAULT_GROUP_SIZE)]
    quantize_group_size: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// Most tokens in one forward step (sizes the activations).
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    max_num_batched_tokens: usize,
    /// Most sequences in one forward step (sizes the logits).
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS)]
    max_num_seqs: usize,
    /// Tensor-parallel ranks per stage (for the weights per rank).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Expert groups per stage (`--tp` × `--ep` ranks; for the weights per
    /// rank).
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Plan a KV disk tier of this many bytes too (`--kv-disk-size`): the
    /// blocks and tokens it holds beside the pool.
    #[arg(long, value_parser = parse_memory_size)]
    kv_disk_size: Option<u64>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// What a disk tier of `budget` bytes holds: every layer's K and V of a
/// block, in f32 whatever the pool's dtype, behind a 64-byte header.
#[derive(Debug, Clone, Copy)]
struct DiskPlan {
    budget: u64,
    file_bytes: u64,
    blocks: u64,
    tokens: u64,
}

impl DiskPlan {
    fn of(cfg: &ModelConfig, block_size: usize, budget: u64) -> Self {
        let values = cfg.kv_layout(block_size).block_values();
        let file_bytes = (tandem_engine::serving::DISK_HEADER_BYTES + values * 4) as u64;
        let blocks = budget / file_bytes.max(1);
        Self {
            budget,
            file_bytes,
            blocks,
            tokens: blocks * block_size as u64,
        }
    }

    fn describe(&self, pool_tokens: u64) -> String {
        format!(
            "{} blocks, {} tokens ({:.1}x the pool) in {}; {} bytes per block file (f32)",
            self.blocks,
            self.tokens,
            self.tokens as f64 / pool_tokens.max(1) as f64,
            format_bytes(self.budget),
            self.file_bytes
        )
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    let cfg = ModelConfig::from_dir(&dir)
        .with_context(|| format!("reading the config of {}", dir.display()))?;
    let weight_bytes = match args.quantize {
        Some(crate::engine_args::Quantize::Int4) => {
            tandem_engine::quant::Int4Config::new(args.quantize_group_size)
                .map_err(|e| anyhow::anyhow!("--quantize-group-size: {e}"))?;
            checkpoint_weight_bytes_int4(&dir, args.quantize_group_size)
        }
        None => checkpoint_weight_bytes(&dir),
    }
    .with_context(|| format!("reading the weight headers of {}", dir.display()))?;
    let kv_dtype = match args.kv_dtype {
        crate::engine_args::KvDtypeChoice::Is(d) => d,
        crate::engine_args::KvDtypeChoice::Auto => KvCacheDtype::for_weights(
            tandem_engine::capacity::checkpoint_weight_dtype(&dir)
                .with_context(|| format!("reading the weight dtype of {}", dir.display()))?,
        ),
    };
    let plan = CapacityPlan {
        block_size: args.block_size,
        max_model_len: args.max_model_len,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        kv_dtype,
        ..CapacityPlan::new(args.memory, weight_bytes)
    };
    let cap = plan.plan(&cfg).with_context(|| {
        format!(
            "planning {} in {}",
            dir.display(),
            format_bytes(args.memory)
        )
    })?;
    let params = parameter_counts(&dir, &cfg)
        .with_context(|| format!("counting the parameters of {}", dir.display()))?;
    let ranks = args.tp.max(1) * args.ep.max(1);
    let split = tandem_engine::shard::Split {
        tp: ranks,
        tp_rank: 0,
        pp: 1,
        stage: 0,
        ep: args.ep.max(1),
    };
    tandem_engine::ShardSpec::of(&cfg, split)
        .with_context(|| format!("splitting {} over {ranks} ranks", dir.display()))?;
    let per_rank = (
        ranks,
        weight_bytes_per_rank(&cfg, &params, weight_bytes, ranks),
    );
    let disk = args
        .kv_disk_size
        .map(|b| DiskPlan::of(&cfg, args.block_size, b));
    if args.json {
        let mut v = to_json(&dir, &cfg, &cap, &params);
        v["ranks"] = json!(per_rank.0);
        v["weight_bytes_per_rank"] = json!(per_rank.1);
        if let Some(d) = disk {
            v["kv_disk"] = json!({
                "budget_bytes": d.budget,
                "block_file_bytes": d.file_bytes,
                "blocks": d.blocks,
                "tokens": d.tokens,
            });
        }
        println!("{v}");
    } else {
        print_table(&dir, &cfg, &cap, &params);
        if let Some(d) = disk {
            println!("{:<22}{}", "KV disk tier", d.describe(cap.pool_tokens));
        }
        if ranks > 1 {
            println!(
                "{:<22}{} on the largest of {ranks} ranks (--tp {} × --ep {})",
                "weights per rank",
                format_bytes(per_rank.1),
                args.tp,
                args.ep
            );
        }
    }
    Ok(())
}

fn to_json(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    c: &Capacity,
    p: &ParamCounts,
) -> serde_json::Value {
    let moe = cfg.arch.moe.as_ref();
    json!({
        "model": dir.display().to_string(),
        "architecture": cfg.architecture.hf_name(),
        "total_params": p.total,
        "active_params": p.active,
        "expert_params": p.experts,
        "experts": moe.map(|m| json!({
            "num_experts": m.num_experts,
            "experts_per_token": m.top_k,
            "sparse_layers": m.sparse_count(),
            "shared_expert": m.shared_intermediate.is_some(),
        })),
        "memory_bytes": c.memory_bytes,
        "weight_bytes": c.weight_bytes,
        "activation_bytes": c.activation_bytes,
        "kv_dtype": c.kv_dtype.name(),
        "kv_bytes_per_token": c.kv_bytes_per_token,
        "block_size": c.block_size,
        "bytes_per_block": c.bytes_per_block,
        "pool_blocks": c.pool_blocks,
        "pool_tokens": c.pool_tokens,
        "kv_pool_bytes": c.kv_pool_bytes,
        "max_model_len": c.max_model_len,
        "blocks_per_seq": c.blocks_per_seq,
        "global_blocks_per_seq": c.global_blocks_per_seq,
        "layers_per_block": c.layers_per_block,
        "sliding_window": c.sliding_window,
        "windowed_layers": c.windowed_layers,
        "max_concurrent_seqs": c.max_concurrent_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "max_num_seqs": c.max_num_seqs,
    })
}

/// A sequence's blocks, with what sliding-window layers save.
fn blocks_per_seq(c: &Capacity) -> String {
    if c.windowed_layers == 0 {
        return c.blocks_per_seq.to_string();
    }
    format!(
        "{} ({} without freeing: {} of the layers slide, window {}, {} layers per block)",
        c.blocks_per_seq,
        c.global_blocks_per_seq,
        c.windowed_layers,
        c.sliding_window,
        c.layers_per_block
    )
}

/// Total and active parameters, and how the experts make the difference.
fn parameters(cfg: &ModelConfig, p: &ParamCounts) -> String {
    let Some(moe) = &cfg.arch.moe else {
        return format!("{} (dense: every token reads all)", format_count(p.total));
    };
    format!(
        "{} total, {} active per token ({} in experts: {} of {} per token on {} sparse layers{})",
        format_count(p.total),
        format_count(p.active),
        format_count(p.experts),
        moe.top_k,
        moe.num_experts,
        moe.sparse_count(),
        if moe.shared_intermediate.is_some() {
            ", plus a shared expert"
        } else {
            ""
        },
    )
}

fn print_table(dir: &std::path::Path, cfg: &ModelConfig, c: &Capacity, p: &ParamCounts) {
    let bytes = |b: u64| format!("{} ({b} bytes)", format_bytes(b));
    let rows: Vec<(&str, String)> = vec![
        (
            "model",
            format!(
                "{} ({}, {} layers, {})",
                dir.display(),
                cfg.architecture.hf_name(),
                cfg.num_layers,
                match cfg.kv_rows() {
                    (tandem_engine::KvRows::PerHead, heads, dim) => {
                        format!("{heads} KV heads × {dim} head_dim")
                    }
                    (tandem_engine::KvRows::Latent, _, width) => {
                        format!("one latent of {width} per token and layer")
                    }
                }
            ),
        ),
        ("parameters", parameters(cfg, p)),
        ("memory budget", bytes(c.memory_bytes)),
        ("weights", bytes(c.weight_bytes)),
        (
            "activations",
            format!(
                "{} for {} tokens / {} sequences per step",
                bytes(c.activation_bytes),
                c.max_num_batched_tokens,
                c.max_num_seqs
            ),
        ),
        ("KV dtype", c.kv_dtype.to_string()),
        ("KV bytes per token", c.kv_bytes_per_token.to_string()),
        ("block size", format!("{} tokens", c.block_size)),
        ("bytes per block", c.bytes_per_block.to_string()),
        ("KV pool", bytes(c.kv_pool_bytes)),
        ("pool blocks", c.pool_blocks.to_string()),
        ("pool tokens", c.pool_tokens.to_string()),
        ("max model len", format!("{} tokens", c.max_model_len)),
        ("blocks per sequence", blocks_per_seq(c)),
        (
            "max concurrent seqs",
            format!("{} at max_model_len", c.max_concurrent_seqs),
        ),
    ];
    for (name, value) in rows {
        println!("{name:<22}{value}");
    }
    if c.max_concurrent_seqs == 0 {
        eprintln!(
            "warning: the KV pool ({} tokens) cannot hold one sequence of {} tokens; \
             raise --memory or lower --max-model-len",
            c.pool_tokens, c.max_model_len
        );
    }
}
