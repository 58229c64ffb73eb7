//! tandem's model engine.
//!
//! Loads Hugging Face checkpoints of the families in [`arch`] (Llama 2/3,
//! Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3; MHA, GQA, MQA; f32, bf16, f16
//! weights, memory-mapped) and runs them on the
//! CPU with the same numerics as transformers in f32. The KV cache is paged
//! from the start ([`kv_cache`]), and [`Model::forward`] takes a flattened
//! batch of sequences with their block tables, so the serving scheduler can mix
//! prefill chunks and decode tokens in one call.
//!
//! **Architecture Invariant:** the engine knows nothing of networking, gRPC or
//! cluster roles; workers drive it through `Model::forward`, the KV cache
//! types and the sampler.

pub mod arch;
pub mod attention;
pub mod backend;
pub mod capacity;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod kernels;
pub mod kv_cache;
pub mod lora;
pub mod model;
pub mod pool;
pub mod progress;
pub mod quant;
pub mod sampling;
pub mod serving;
pub mod shard;
pub mod speculative;
pub mod synth;
pub mod weights;

pub use arch::{Activation, ArchSpec, LayerTensor, NormPlacement};
pub use backend::{BlockKv, ComputeBackend, CpuBackend, KvBlocks};
pub use checkpoint::Checkpoint;
pub use config::{Architecture, ModelConfig, RopeScaling};
pub use error::{EngineError, Result};
pub use generate::{generate, FinishReason, GenerateOptions, GenerateOutput, GenerateRequest};
pub use kv_cache::{
    BlockAllocator, BlockCopy, BlockId, BlockTable, CacheEvent, KvCache, KvCacheDtype, KvError,
    KvFootprint, KvGroups, KvLayout, KvRows, PrefixCacheStats, SlidingLayers, FREED,
};
pub use model::{Logits, MlaForm, Model, SeqInput};
pub use sampling::{Sampled, Sampler, SamplingParams, TokenLogprob};
pub use shard::{ShardPeers, ShardSpec};
/// Constrained decoding (grammars, token masks), re-exported for servers.
pub use tandem_structured as structured;
pub use tandem_tokenizer as tokenizer;
pub use weights::DType;
