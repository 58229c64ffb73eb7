//! Serving-engine flags shared by every command that runs an engine.

use anyhow::{bail, Result};
use clap::Args;
use tandem_engine::capacity::parse_memory_size;
use tandem_engine::serving::{EngineConfig, KvPoolSize};

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Memory for the KV cache, e.g. 2GiB (the CPU engine stores K/V in f32).
    #[arg(long, default_value = "1GiB", conflicts_with = "num_kv_blocks")]
    kv_cache_memory: String,
    /// KV cache size in blocks instead of bytes.
    #[arg(long)]
    num_kv_blocks: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Most tokens computed per step (decodes plus prefill chunks).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Longest prefill chunk of one request per step (default: the budget).
    #[arg(long)]
    max_prefill_chunk: Option<usize>,
    /// Context limit (default: the model's max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Do not reuse the K/V of shared prompt prefixes.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Bit-identical results whatever the batch (slower prefill).
    #[arg(long)]
    batch_invariant: bool,
}

impl EngineArgs {
    /// The engine configuration these flags describe.
    pub fn config(&self) -> Result<EngineConfig> {
        if self.block_size == 0 {
            bail!("--block-size must be positive");
        }
        let kv_pool = match self.num_kv_blocks {
            Some(0) => bail!("--num-kv-blocks must be positive"),
            Some(n) => KvPoolSize::Blocks(n),
            None => KvPoolSize::Bytes(usize::try_from(parse_memory_size(&self.kv_cache_memory)?)?),
        };
        Ok(EngineConfig {
            block_size: self.block_size,
            kv_pool,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_prefill_chunk: self.max_prefill_chunk,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_prefix_caching,
            batch_invariant: self.batch_invariant,
        })
    }
}
